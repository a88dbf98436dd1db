"""Persistent sessions (docs/guides/python-api.md): `RLM(persistent=True)` and
`DurableRLM.session()` keep one REPL across `completion()` calls, each a turn of one durable
session workflow that survives a killed worker, and ends by `close()` or an idle timeout."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from durable_rlm import RLM, DurableRLM
from durable_rlm.client.sessions import SessionClosed, session_overview, setup_cell
from durable_rlm.errors import EpisodeFailed
from durable_rlm.scripted import ChatRequest, Reply, ScriptedModelServer
from durable_rlm.settings import Settings
from durable_rlm.worker.runtime import Services, running_workers
from durable_rlm.workflows import names
from durable_rlm.workflows.session import turn_task
from durable_rlm.workflows.session_models import SessionEnd, SessionStart
from tests.rlms_compat.models import DOCUMENTS, TURN_ANSWERS, persistent_turns

STEP = re.compile(r"Session step (\d+)")
SLOW_STEP = 99


def turn_code(k: int) -> str:
    """Turn k reads what turn k-1 left (`acc`), its own context_k and the last history."""
    if k == 0:
        return "```repl\nacc = [context_0]\ntotal = '+'.join(acc)\nprint(total)\n```"
    return (
        "```repl\n"
        f"assert isinstance(history_{k - 1}, list) and history_{k - 1}[0]['role'] == 'system'\n"
        f"assert history is history_0 and context is context_0\n"
        f"acc.append(context_{k})\ntotal = '+'.join(acc)\nprint(total)\n```"
    )


def session_script(request: ChatRequest) -> str | Reply:
    """Each turn's conversation is its own: the step number in its task picks the code."""
    if not request.is_root:
        return '{"answer": "extracted"}'
    step = next(
        (int(m.group(1)) for msg in request.messages if (m := STEP.search(str(msg.get("content", ""))))),
        None,
    )
    assert step is not None, request.messages
    if step == SLOW_STEP:  # a turn that is still thinking when it is terminated
        return Reply(text="```repl\nacc.append('lost')\n```", delay_s=20)
    return turn_code(step) if request.turn == 0 else "FINAL_VAR(total)"


def expected(k: int) -> str:
    return "+".join(f"c{j}" for j in range(k + 1))


def persistent_rlm(server: ScriptedModelServer, data_dir: Path, **options: Any) -> RLM:
    """rlms's form of a session, on the scripted model: `RLM(persistent=True)`."""
    return RLM(
        backend_kwargs={"model_name": "gpt-x", "base_url": server.base_url, "api_key": "sk-scripted"},
        max_iterations=4,
        persistent=True,
        settings=Settings(data_dir=data_dir),
        **options,
    )


def test_the_setup_cell_binds_rlms_names() -> None:
    assert setup_cell(0, "x", True, {}) == "context_0 = context"
    assert setup_cell(None, None, False, {}) is None
    cell = setup_cell(2, {"a": [1]}, False, {0: [{"role": "user", "content": "q"}], 1: []})
    namespace: dict = {}
    exec(cell, namespace)  # noqa: S102 - the cell as the REPL runs it
    assert namespace["context_2"] == {"a": [1]}
    assert namespace["history"] is namespace["history_0"] == [{"role": "user", "content": "q"}]
    assert namespace["history_1"] == []
    # A context that looks like code, a frame or FINAL binds as its text, never runs.
    hostile = 'x\'\'\'\n"""; import os; os._exit(1)  # FINAL(no)\n{"kind": "tool"}\x00'
    bound: dict = {}
    exec(setup_cell(1, hostile, False, {}), bound)  # noqa: S102
    assert bound["context_1"] == hostile
    assert turn_task("q", 1, 0) == "q"
    assert turn_task("q", 2, 0) == "q\n\nNote: You have 2 contexts available (context_0 through context_1)."
    noted = turn_task("q", 3, 2)
    assert "3 contexts available (context_0 through context_2)" in noted
    assert "2 prior conversation histories available (history_0 through history_1)" in noted
    assert "1 prior conversation history available in the `history` variable" in turn_task("q", 2, 1)


def test_five_turns_through_rlms_persistent_api(scripted, tmp_path: Path) -> None:
    server = scripted(session_script)
    rlm = persistent_rlm(server, tmp_path)
    answers = [rlm.completion(f"c{k}", root_prompt=f"Session step {k}") for k in range(5)]
    assert [a.response for a in answers] == [expected(k) for k in range(5)]
    session_id = rlm.session_id
    assert session_id is not None
    assert [a.episode_id for a in answers] == [names.turn_episode_id(session_id, k) for k in range(5)]
    assert all(a.ended_by == "final_var" for a in answers)
    # Each turn is a fresh root conversation (rlms's): two root calls per turn, no more.
    assert len(server.root_requests()) == 10
    last_first_prompt = "\n".join(str(m["content"]) for m in server.root_requests()[-2].messages)
    assert "5 contexts available (context_0 through context_4)" in last_first_prompt
    rlm.close()
    # rlms's close() ended the session: a new RLM attaches to nothing open.
    state = asyncio.run(_state(rlm, session_id))
    assert (state.ended_by, len(state.turns), state.contexts, state.histories) == ("closed", 5, 5, 4)


def test_each_turn_of_a_persistent_rlm_answers_for_itself(scripted, tmp_path: Path) -> None:
    """rlms counts an answer only when a turn's own cell sets `answer["ready"]`: the flag
    turn 0 left set does not end turns 1 and 2 before they looked at their contexts."""
    server = scripted(persistent_turns)
    rlm = persistent_rlm(server, tmp_path)
    answers = [rlm.completion(doc, root_prompt=f"Session step {k}") for k, doc in enumerate(DOCUMENTS)]
    rlm.close()
    assert [a.response for a in answers] == TURN_ANSWERS
    assert all(a.ended_by == "answer_ready" for a in answers)
    assert len(server.root_requests()) == 6  # two root calls per turn, none skipped


def test_a_persistent_rlm_in_a_with_block_answers_each_turn(scripted, tmp_path: Path) -> None:
    server = scripted(persistent_turns)
    with persistent_rlm(server, tmp_path) as rlm:
        answers = [
            rlm.completion(doc, root_prompt=f"Session step {k}").response for k, doc in enumerate(DOCUMENTS)
        ]
        session_id = rlm.session_id
    assert answers == TURN_ANSWERS
    assert session_id is not None and rlm.session_id is None  # the block's end closed it


def test_a_persistent_rlm_fires_its_callbacks_while_each_turn_runs(scripted, tmp_path: Path) -> None:
    """rlms's iteration callbacks follow a session's turn live, as they follow one episode:
    each turn's first iteration is reported before its last root reply (3 s late) came,
    and every iteration once."""

    def slow_ending(request: ChatRequest) -> str | Reply:
        reply = session_script(request)
        return Reply(text=reply, delay_s=3.0) if isinstance(reply, str) and "FINAL" in reply else reply

    server = scripted(slow_ending)
    events: list[tuple[str, int, int, float]] = []
    rlm = persistent_rlm(
        server,
        tmp_path,
        on_iteration_start=lambda depth, i: events.append(("start", depth, i, time.monotonic())),
        on_iteration_complete=lambda depth, i, took: events.append(("done", depth, i, time.monotonic())),
    )
    returned = []
    for k in range(2):
        assert rlm.completion(f"c{k}", root_prompt=f"Session step {k}").response == expected(k)
        returned.append(time.monotonic())
    rlm.close()
    turns = [[e for e in events if e[3] <= returned[0]], [e for e in events if e[3] > returned[0]]]
    for turn, ended in zip(turns, returned, strict=True):
        assert [e[:3] for e in turn] == [("start", 0, 1), ("done", 0, 1), ("start", 0, 2), ("done", 0, 2)]
        assert ended - turn[0][3] >= 1.0, (ended, turn)  # live: long before the turn's answer


def test_a_session_in_a_with_block_from_synchronous_code(scripted, tmp_path: Path) -> None:
    """The documented form (docs/guides/python-api.md): `with rlm.session() as s:` and
    `s.completion(...)`; the block's end closes the session."""
    server = scripted(session_script)
    settings = Settings(data_dir=tmp_path)
    rlm = DurableRLM("gpt-x", base_url=server.base_url, max_iterations=4, settings=settings)
    with rlm.session() as session:
        answers = [session.completion(f"c{k}", root_prompt=f"Session step {k}").answer for k in range(2)]
    assert answers == [expected(0), expected(1)]
    state = asyncio.run(_state(rlm, session.id))
    assert (state.ended_by, len(state.turns)) == ("closed", 2)


async def _state(rlm: DurableRLM, session_id: str):
    return await rlm.session(session_id=session_id).state()


def external(temporal_address: str, session_dir: Path, queue: str, base_url: str) -> DurableRLM:
    settings = Settings(temporal_address=temporal_address, task_queue=queue, data_dir=session_dir)
    return DurableRLM("scripted", base_url=base_url, max_iterations=4, settings=settings)


async def rebuilds(client, episode_id: str) -> list:
    from durable_rlm.audit.timeline import episode_timeline

    timeline = await episode_timeline(client, episode_id)
    return [c.rebuild for it in timeline.iterations for c in it.cells if c.rebuild is not None]


async def test_a_session_survives_a_killed_worker_between_turns(
    temporal_address, session_dir, scripted, worker_processes
) -> None:
    """The Done-when case: 5 turns; the worker is SIGKILLed between turns 3 and 4; a new
    worker rebuilds the REPL and turns 4 and 5 see the variables of turns 1-3."""
    server = scripted(session_script)
    first = worker_processes()
    rlm = external(temporal_address, session_dir, worker_processes.queue, server.base_url)
    chat = rlm.session(idle_timeout=timedelta(minutes=10))
    async with chat.opened() as services:
        answers = [(await chat.acompletion(f"c{k}", f"Session step {k}")).answer for k in range(3)]
        first.kill()  # SIGKILL: its sandbox dies with it
        assert first.process.returncode == -9
        worker_processes()
        for k in (3, 4):
            result = await chat.acompletion(f"c{k}", f"Session step {k}")
            answers.append(result.answer)
            assert result.replay_divergences == 0
        assert answers == [expected(k) for k in range(5)]
        state = await chat.state()
        assert [t.status for t in state.turns] == ["completed"] * 5
        assert state.repl.cell_count == 10  # one setup cell and one model cell per turn
        overview = await session_overview(services.client, chat.id)
        for _ in range(50):  # visibility lags its writes by a moment
            if len(overview.episodes) == 5:
                break
            await asyncio.sleep(0.1)
            overview = await session_overview(services.client, chat.id)
        assert overview.status == "running"
        # Turn 1 ran in the sandbox turn 0 left; turn 3, on the new worker, rebuilt it from the log.
        assert await rebuilds(services.client, overview.episodes[1]) == []
        rebuilt = await rebuilds(services.client, overview.episodes[3])
        assert rebuilt and rebuilt[0].cells_rerun == 6
        assert overview.episodes == [names.turn_episode_id(chat.id, k) for k in range(5)]
        await chat.aclose()


async def test_turns_answer_for_themselves_across_a_killed_worker(
    temporal_address, session_dir, client, scripted, worker_processes
) -> None:
    """The answer dict turn 0 left (ready, in the snapshot or the rebuilt REPL) does not end
    turns 1 and 2, which a new worker runs after the first was SIGKILLed between turns."""
    server = scripted(persistent_turns)
    first = worker_processes()
    settings = Settings(
        temporal_address=temporal_address, task_queue=worker_processes.queue, data_dir=session_dir
    )
    rlm = RLM(
        backend_kwargs={"model_name": "gpt-x", "base_url": server.base_url},
        max_iterations=4,
        persistent=True,
        settings=settings,
    )
    first_answer = await rlm.acompletion(DOCUMENTS[0], root_prompt="Session step 0")
    first.kill()  # SIGKILL: its sandbox, with `answer` as turn 0 left it, dies with it
    assert first.process.returncode == -9
    worker_processes()
    answers = [first_answer.response]
    for k in (1, 2):
        answers.append((await rlm.acompletion(DOCUMENTS[k], root_prompt=f"Session step {k}")).response)
    session_id = rlm.session_id
    await rlm.aclose()
    assert answers == TURN_ANSWERS
    assert len(server.root_requests()) == 6
    # Turn 1 ran in a REPL rebuilt on the new worker, with turn 0's `answer` in it.
    rebuilt = await rebuilds(client, names.turn_episode_id(session_id, 1))
    assert rebuilt and rebuilt[0].cells_rerun + (rebuilt[0].from_snapshot or 0) >= 2, rebuilt


@pytest.mark.slow  # long end to end (the default run stays near 13 minutes); CI runs it
async def test_close_and_idle_timeout_end_a_session(
    temporal_address, session_dir, client, scripted, worker
) -> None:
    server = scripted(session_script)
    rlm = external(temporal_address, session_dir, worker.task_queue, server.base_url)
    # Closed, across a continue-as-new after each turn: the REPL is carried over.
    async with rlm.session(turns_per_run=1) as chat:
        assert (await chat.acompletion("c0", "Session step 0")).answer == expected(0)
        assert (await chat.acompletion("c1", "Session step 1")).answer == expected(1)
        closed = await chat.aclose("done for today")
        assert closed is not None and (closed.ended_by, closed.closing) == ("closed", "done for today")
        end = await client.get_workflow_handle(chat.id, result_type=SessionEnd).result()
        assert (end.ended_by, end.turns, end.reason) == ("closed", 2, "done for today")
        with pytest.raises(SessionClosed):
            await chat.acompletion("c2", "Session step 2")
        overview = await session_overview(client, chat.id)
        assert (overview.status, overview.episodes) == ("completed", end.episodes)
        assert end.episodes == [names.turn_episode_id(chat.id, k) for k in range(2)]
        with pytest.raises(LookupError, match="is not a session"):
            await session_overview(client, end.episodes[0])
        memo = await client.get_workflow_handle(end.episodes[1]).describe()
        assert (await memo.memo_value("session"), await memo.memo_value("turn")) == (chat.id, 1)
    # Idle: a durable timer ends it when no turn came for idle_timeout.
    idle = rlm.session(idle_timeout=2)
    async with idle.opened():
        assert (await idle.acompletion("c0", "Session step 0")).answer == expected(0)
        end = await client.get_workflow_handle(idle.id, result_type=SessionEnd).result()
        assert (end.ended_by, end.turns) == ("idle", 1)
        with pytest.raises(SessionClosed):
            await idle.acompletion("c1", "Session step 1")


async def test_a_second_client_attaches_by_id(temporal_address, session_dir, scripted, worker) -> None:
    server = scripted(session_script)
    rlm = external(temporal_address, session_dir, worker.task_queue, server.base_url)
    started = rlm.session(session_id=None)
    async with started.opened():
        assert (await started.acompletion("c0", "Session step 0")).answer == expected(0)
    other = external(temporal_address, session_dir, worker.task_queue, server.base_url)
    attached = other.session(session_id=started.id)
    async with attached:
        assert (await attached.acompletion("c1", "Session step 1")).answer == expected(1)
    assert (await attached.state()).ended_by == "closed"


async def test_a_failed_turn_leaves_the_repl_and_the_numbering_as_they_were(
    temporal_address, session_dir, client, scripted, worker
) -> None:
    """A turn whose episode fails (here: terminated) changes nothing: the next turn starts from
    the REPL the last completed turn left, and its context and history take the next numbers."""
    server = scripted(session_script)
    rlm = external(temporal_address, session_dir, worker.task_queue, server.base_url)
    async with rlm.session() as chat:
        assert (await chat.acompletion("c0", "Session step 0")).answer == expected(0)
        failing = asyncio.ensure_future(chat.acompletion("lost", f"Session step {SLOW_STEP}"))
        doomed = client.get_workflow_handle(names.turn_episode_id(chat.id, 1))
        while (await chat.state()).running != 1:
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # into its first root call
        await doomed.terminate(reason="test")
        with pytest.raises(EpisodeFailed, match="terminated"):
            await failing
        state = await chat.state()
        assert [t.status for t in state.turns] == ["completed", "failed"]
        assert (state.contexts, state.histories, state.unbound) == (1, 0, [0])
        # Turn 2 binds context_1 and history_0 (turn 0's), and sees acc as turn 0 left it.
        assert (await chat.acompletion("c1", "Session step 1")).answer == expected(1)
        state = await chat.state()
        assert (state.contexts, state.histories, state.unbound) == (2, 1, [2])


async def test_the_default_idle_timeout_is_a_durable_timer(
    skipping_env, store, session_dir, scripted
) -> None:
    """An hour without a turn ends the session (time-skipping server: in seconds of real time)."""
    server = scripted(session_script)
    settings = Settings(task_queue=f"skip-{uuid.uuid4().hex[:6]}", data_dir=session_dir)
    template = DurableRLM("scripted", base_url=server.base_url, max_iterations=4, settings=settings).template
    started = time.monotonic()
    async with running_workers(Services(settings, store[0], store[1], skipping_env.client)):
        end = await skipping_env.client.execute_workflow(
            names.SESSION_WORKFLOW,
            SessionStart(template=template),
            id=f"idle-{uuid.uuid4().hex[:6]}",
            task_queue=settings.task_queue,
            result_type=SessionEnd,
        )
    assert (end.ended_by, end.turns, end.reason) == ("idle", 0, "no turn for 1:00:00")
    assert time.monotonic() - started < 30
