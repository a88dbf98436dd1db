"""A person steering a running episode: hints, limits, pause and resume, answer now, and
approvals. Each action is sent mid-episode, with a worker restart between sending it and
the episode's next step: the action lives in history, not in a worker."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from pydantic import ValidationError
from temporalio.client import Client, WorkflowHandle

from durable_rlm.audit.timeline import episode_timeline, render
from durable_rlm.client.episodes import start_episode
from durable_rlm.client.steering import (
    change_limits,
    decide_cell,
    finish_episode,
    parse_approval_id,
    pause_episode,
    pending_cells,
    progress_of,
    resume_episode,
    send_hint,
)
from durable_rlm.scripted import Reply, root_and_sub
from durable_rlm.settings import Settings
from durable_rlm.store import schema
from durable_rlm.worker.runtime import Services, running_workers
from durable_rlm.workflows import names, steering
from durable_rlm.workflows.models import EpisodeLimits, EpisodeProgress, EpisodeResult, Message
from tests.conftest import request_for, workers_for

EXTRACTED = '{"answer": "82", "_extraction_notes": "from the history"}'


class Workers:
    """In-process workers on one queue, stopped and started again at will."""

    def __init__(self, client: Client, store: Any, session_dir: Path) -> None:
        self.client, self.store, self.session_dir = client, store, session_dir
        self.queue = f"steer-{uuid.uuid4().hex[:8]}"
        self.stack: contextlib.AsyncExitStack | None = None
        self.repl: Any = None
        self.starts = 0

    async def start(self) -> None:
        self.stack = contextlib.AsyncExitStack()
        self.repl = await self.stack.enter_async_context(
            workers_for(self.client, self.store, self.session_dir, self.queue)
        )
        self.starts += 1

    async def stop(self) -> None:
        assert self.stack is not None
        await self.stack.aclose()
        self.stack = self.repl = None

    async def restart_while(self, action: Awaitable[Any]) -> Any:
        """Stop the worker, send the action while none runs, start a new one: the new
        worker accepts the action from history and takes the next step."""
        await self.stop()
        sent = asyncio.ensure_future(action)
        await asyncio.sleep(0.3)
        assert not sent.done()  # nobody can accept it yet
        await self.start()
        return await asyncio.wait_for(sent, 30)


@pytest.fixture
async def workers(client, store, session_dir):
    pool = Workers(client, store, session_dir)
    await pool.start()
    yield pool
    if pool.stack is not None:
        await pool.stop()


async def until(
    client: Client, episode_id: str, ready: Callable[[EpisodeProgress], bool], timeout: float = 40
) -> EpisodeProgress:
    deadline = time.monotonic() + timeout
    while True:
        progress = await progress_of(client, episode_id)
        if ready(progress):
            return progress
        assert time.monotonic() < deadline, f"not reached: {progress.phase}"
        await asyncio.sleep(0.1)


async def calls_until(server: Any, count: int, timeout: float = 40) -> None:
    deadline = time.monotonic() + timeout
    while len(server.root_requests()) < count:
        assert time.monotonic() < deadline, f"{len(server.root_requests())} root calls"
        await asyncio.sleep(0.05)


def waiting(cell: int) -> Callable[[EpisodeProgress], bool]:
    return lambda p: p.pending_cell is not None and p.pending_cell.cell == cell


async def test_approvals_an_edit_a_rejection_a_hint_and_answer_now(client, scripted, workers, store) -> None:
    server = scripted(
        root_and_sub(
            [
                "```repl\nx = 41\nprint('x set')\n```",
                Reply(text="```repl\nprint(x + 1)\n```", delay_s=2),
                "```repl\nimport subprocess\ny = 'ran'\n```",
                "```repl\nprint('y' in globals())\n```",
                Reply(text="Still working on it.", delay_s=2),
            ],
            extract=lambda prompt: EXTRACTED,
        )
    )
    request = request_for(server, approve="all")
    episode_id = f"steer-approve-{uuid.uuid4().hex[:6]}"
    handle: WorkflowHandle = await start_episode(client, request, workers.queue, episode_id)

    # Cell 1 waits; the approval is sent while no worker runs.
    first = await until(client, episode_id, waiting(1))
    assert first.pending_cell.code == "x = 41\nprint('x set')" and first.pending_cell.reasons == []
    assert [p.approval_id for p in await pending_cells(client) if p.episode_id == episode_id] == [
        f"{episode_id}#1"
    ]
    approved = await workers.restart_while(decide_cell(client, f"{episode_id}#1", True, "bob"))
    assert approved.accepted, approved.message

    # A hint sent while the root call is in flight, then the worker restarts mid-call.
    await calls_until(server, 2)
    hinted = await send_hint(client, episode_id, "x is the answer minus one", "alice")
    assert hinted.accepted and "next turn" in hinted.message
    await workers.stop()
    await workers.start()

    # Cell 2 is edited: exactly the edited code runs.
    await until(client, episode_id, waiting(2))
    edited = await workers.restart_while(decide_cell(client, episode_id, True, "bob", code="print(x * 2)"))
    assert edited.accepted, edited.message

    # Cell 3 is flagged (a process import) and rejected: it never runs.
    third = await until(client, episode_id, waiting(3))
    assert any("subprocess" in reason for reason in third.pending_cell.reasons)
    stale = await decide_cell(client, f"{episode_id}#2", True, "bob")
    assert not stale.accepted and "cell 3 does" in stale.message  # a stale id approves nothing
    rejected = await workers.restart_while(
        decide_cell(client, f"{episode_id}#3", False, "carol", reason="no processes")
    )
    assert rejected.accepted

    await until(client, episode_id, waiting(4))
    assert (await decide_cell(client, episode_id, True, "bob")).accepted

    # Answer now, sent while the last root call is in flight; the worker restarts.
    await calls_until(server, 5)
    finish = await finish_episode(client, episode_id, "dave", "enough")
    assert finish.accepted
    await workers.stop()
    await workers.start()
    result: EpisodeResult = await asyncio.wait_for(handle.result(), 60)

    assert result.ended_by == "finish_requested" and result.answer == "82"
    assert result.answer_source == "extraction"
    assert "asked to answer now (by dave: enough)" in result.stop_reason
    roots = server.root_requests()
    turn = {r.turn: r.last_user for r in roots}  # the last request of each turn
    assert "A hint from alice, the person supervising this episode:\nx is the answer minus one" in turn[2]
    assert "82" in turn[2] and "edited by bob" in turn[2] and "print(x * 2)" in turn[2]
    assert "Not run: carol rejected this cell before it ran. Their reason: no processes" in turn[3]
    assert "False" in turn[4]  # y was never set: the rejected cell did not run
    assert "A hint from alice" not in turn[1] + turn[3]  # read once, on the turn after it came

    timeline = await episode_timeline(client, episode_id)
    ran = {cell.cell_index: cell.code for it in timeline.iterations for cell in it.cells}
    assert ran == {1: "x = 41\nprint('x set')", 2: "print(x * 2)", 4: "print('y' in globals())"}
    kinds = [(a.kind, a.sender) for a in timeline.actions]
    assert kinds == [
        ("approve", "bob"),
        ("hint", "alice"),
        ("edit", "bob"),
        ("reject", "carol"),
        ("approve", "bob"),
        ("finish", "dave"),
    ]
    text = render(timeline)
    assert ">>> reject by carol" in text and ">>> hint by alice" in text

    engine = store[1]
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(schema.events.c.kind, schema.events.c.sender, schema.events.c.at)
            .where(schema.events.c.episode_id == episode_id, schema.events.c.kind.like("action_%"))
            .order_by(schema.events.c.event_key)
        ).all()
    audited = sorted((kind, sender) for kind, sender, at in rows)
    assert audited == sorted(
        [
            ("action_gate", "drlm"),
            ("action_gate", "drlm"),
            ("action_gate", "drlm"),
            ("action_gate", "drlm"),
            ("action_approve", "bob"),
            ("action_approve", "bob"),
            ("action_edit", "bob"),
            ("action_reject", "carol"),
            ("action_hint", "alice"),
            ("action_finish", "dave"),
        ]
    )
    assert all(at is not None for _, _, at in rows)


async def test_pause_holds_no_sandbox_resume_rebuilds_it_and_a_lowered_limit_ends_by_extraction(
    client, scripted, workers
) -> None:
    server = scripted(
        root_and_sub(
            [
                "```repl\nx = 7\n```",
                Reply(text="```repl\nprint('x is', x)\n```", delay_s=2),
                Reply(text="Thinking.", delay_s=2),
            ],
            extract=lambda prompt: '{"answer": "7", "_extraction_notes": "x"}',
        )
    )
    request = request_for(server)
    episode_id = f"steer-pause-{uuid.uuid4().hex[:6]}"
    handle = await start_episode(client, request, workers.queue, episode_id)

    await calls_until(server, 2)
    paused = await pause_episode(client, episode_id, "eve", reason="lunch")
    assert paused.accepted and "keeps counting" in paused.message
    again = await pause_episode(client, episode_id, "eve")
    assert not again.accepted and "already paused (by eve)" in again.message
    await workers.stop()  # restarted while the root call is in flight
    await workers.start()

    held = await until(client, episode_id, lambda p: p.held is not None and p.phase.startswith("paused"))
    assert held.held == "paused by eve: lunch"
    assert episode_id not in workers.repl.live_episodes()  # no sandbox while paused
    calls = len(server.root_requests())  # turn 1's call, and its retry after the restart
    assert max(r.turn for r in server.root_requests()) == 1
    await asyncio.sleep(0.5)
    assert len(server.root_requests()) == calls  # nothing runs while paused: the cell waits too

    resumed = await workers.restart_while(resume_episode(client, episode_id, "eve"))
    assert resumed.accepted and "rebuilt" in resumed.message
    await calls_until(server, calls + 1)
    assert "x is 7" in server.root_requests()[-1].last_user  # the REPL was rebuilt from its log

    not_paused = await resume_episode(client, episode_id, "eve")
    assert not not_paused.accepted and "not paused" in not_paused.message
    nothing = await change_limits(client, episode_id, "eve")
    assert not nothing.accepted and "no limit was given" in nothing.message
    priced = await change_limits(client, episode_id, "eve", max_cost_usd=1.0)
    assert not priced.accepted and "needs a price" in priced.message
    no_cell = await decide_cell(client, f"{episode_id}#9", True, "eve")
    assert not no_cell.accepted and "no cell waits" in no_cell.message

    lowered = await change_limits(client, episode_id, "eve", max_iterations=2)
    assert lowered.accepted and "max_iterations 8 -> 2" in lowered.message
    await workers.stop()
    await workers.start()
    result = await asyncio.wait_for(handle.result(), 60)
    assert result.ended_by == "max_iterations" and result.answer == "7"
    assert result.answer_source == "extraction" and result.iterations == 3

    timeline = await episode_timeline(client, episode_id)
    # Refused actions wrote nothing to history.
    assert [(a.kind, a.sender) for a in timeline.actions] == [
        ("pause", "eve"),
        ("resume", "eve"),
        ("limits", "eve"),
    ]


async def test_finish_now_ends_a_paused_episode_and_max_duration_follows_a_new_limit(
    client, scripted, workers
) -> None:
    server = scripted(
        root_and_sub(
            ["```repl\nx = 1\n```", Reply(text="```repl\nx += 1\n```", delay_s=1)],
            extract=lambda prompt: '{"answer": "x", "_extraction_notes": ""}',
        )
    )
    paused_id = f"steer-finish-{uuid.uuid4().hex[:6]}"
    handle = await start_episode(client, request_for(server), workers.queue, paused_id)
    await calls_until(server, 2)
    assert (await pause_episode(client, paused_id, "fay")).accepted
    await until(client, paused_id, lambda p: p.held is not None)
    assert (await finish_episode(client, paused_id, "fay", "stop here")).accepted
    result = await asyncio.wait_for(handle.result(), 30)
    assert result.ended_by == "finish_requested" and result.answer == "x"

    # A shorter max_duration moves the durable timer: the episode ends by the time limit.
    slow = scripted(
        root_and_sub(
            [Reply(text="```repl\nx = 1\n```", delay_s=20)],
            extract=lambda prompt: '{"answer": "late", "_extraction_notes": ""}',
        )
    )
    timed_id = f"steer-duration-{uuid.uuid4().hex[:6]}"
    timed = await start_episode(client, request_for(slow), workers.queue, timed_id)
    await calls_until(slow, 1)
    shortened = await change_limits(client, timed_id, "fay", max_duration=3)
    assert shortened.accepted
    started = time.monotonic()
    result = await asyncio.wait_for(timed.result(), 30)
    assert result.ended_by == "max_duration" and result.answer == "late"
    assert time.monotonic() - started < 15  # not the 20 s call, nor the 10 minutes first set


async def test_an_episode_paused_for_a_week_resumes_with_its_repl_state(
    skipping_env, store, session_dir: Path, scripted
) -> None:
    server = scripted(
        root_and_sub(
            ["```repl\nkept = 'still here'\n```", "```repl\nprint(kept)\n```", "FINAL(done)"],
        )
    )
    limits = EpisodeLimits(max_iterations=8, max_duration=timedelta(days=1), cell_timeout_s=10)
    request = request_for(server, limits=limits, approve="all")
    client = skipping_env.client
    settings = Settings(task_queue=f"skip-{uuid.uuid4().hex[:6]}", data_dir=session_dir)
    episode_id = f"steer-week-{uuid.uuid4().hex[:6]}"
    started = time.monotonic()
    services = Services(settings, store[0], store[1], client)
    async with running_workers(services) as repl:
        handle = await start_episode(client, request, settings.task_queue, episode_id)
        await until(client, episode_id, waiting(1))
        assert (await decide_cell(client, episode_id, True, "gus")).accepted
        await until(client, episode_id, waiting(2))
        assert (await pause_episode(client, episode_id, "gus", hold_clock=True, reason="a week off")).accepted
        await until(client, episode_id, lambda p: p.held is not None and p.phase.startswith("paused"))
        assert episode_id not in repl.live_episodes()
        await skipping_env.sleep(timedelta(days=7))  # a week longer than max_duration
        assert (await resume_episode(client, episode_id, "gus")).accepted
        await until(client, episode_id, waiting(2))
        assert (await decide_cell(client, episode_id, True, "gus")).accepted
        result = await asyncio.wait_for(handle.result(), 60)
    assert result.ended_by == "final" and result.answer == "done"
    assert "still here" in server.root_requests()[-1].last_user
    assert time.monotonic() - started < 60


# --- the pure parts -------------------------------------------------------------------------


def test_hints_join_the_waiting_user_message_or_make_their_own() -> None:
    hint = steering.hint_message("ann", "look at line 3")
    observed = [Message(role="user", content="Output: 3")]
    merged = steering.with_hints(observed, [hint])
    assert len(merged) == 1 and merged[0].content.startswith("Output: 3\n\nA hint from ann")
    assert steering.with_hints([], [hint]) == [hint]
    assert steering.with_hints(observed, []) is observed


@pytest.mark.parametrize(
    ("mode", "code", "waits"),
    [
        ("none", "import socket", False),
        ("risky", "print(1 + 1)", False),
        ("risky", "import socket", True),
        ("risky", "open('f', 'w').write('x')", True),
        ("all", "print(1 + 1)", True),
    ],
)
def test_which_cells_wait(mode: str, code: str, waits: bool) -> None:
    assert (steering.gate(mode, code) is not None) == waits


def test_bad_actions_are_refused_before_they_are_sent() -> None:
    from durable_rlm.workflows.models import CellDecision, HintUpdate, LimitsUpdate

    with pytest.raises(ValidationError, match="blank"):
        HintUpdate(sender="a", text="   ")
    with pytest.raises(ValidationError, match="one line"):
        HintUpdate(sender="a\nb", text="x")
    with pytest.raises(ValidationError, match="needs a reason"):
        CellDecision(sender="a", cell=1, approve=False)
    with pytest.raises(ValidationError, match="no edited code"):
        CellDecision(sender="a", cell=1, approve=False, code="x", reason="r")
    with pytest.raises(ValidationError):
        LimitsUpdate(sender="a", max_iterations=0)
    with pytest.raises(ValidationError, match="positive"):
        LimitsUpdate(sender="a", max_duration=timedelta(0))
    assert parse_approval_id("ep-1#3") == ("ep-1", 3)
    assert parse_approval_id("ep#x") == ("ep#x", None)
    assert parse_approval_id("ep-1") == ("ep-1", None)


# --- the command line -----------------------------------------------------------------------

DRLM = str(Path(sys.executable).with_name("drlm"))


class Cli:
    """`drlm` as a person at another terminal runs it: a client of the test's server. It
    runs beside the event loop, whose in-process workers answer its updates."""

    def __init__(self, tmp_path: Path, address: str, session_dir: Path) -> None:
        self.env = {
            k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "TEMPORAL_", "DRLM_"))
        }
        self.env.update(
            TEMPORAL_ADDRESS=address,
            DRLM_DATA_DIR=str(tmp_path),
            DRLM_DATABASE_URL=f"sqlite:///{session_dir / 'drlm.sqlite'}",
        )

    async def start(self, *args: str) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            DRLM, *args, env=self.env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )

    async def __call__(self, *args: str) -> tuple[int, str, str]:
        return await self.finish(await self.start(*args))

    @staticmethod
    async def finish(process: asyncio.subprocess.Process) -> tuple[int, str, str]:
        out, err = await asyncio.wait_for(process.communicate(), 90)
        assert process.returncode is not None
        return process.returncode, out.decode(), err.decode()


@pytest.mark.slow  # long end to end (the default run stays near 13 minutes); CI runs it
async def test_the_command_line_supervises_an_episode(
    client, scripted, workers, tmp_path: Path, temporal_address: str, session_dir: Path
) -> None:
    server = scripted(
        root_and_sub(
            [
                "```repl\nprint('safe')\n```",
                "```repl\nimport socket\nprint('net')\n```",
                "```repl\nopen('out.txt', 'w').write('x')\n```",
                "```repl\nimport ctypes\n```",  # waits while the person does the rest
            ],
            extract=lambda prompt: '{"answer": "edited", "_extraction_notes": ""}',
        )
    )
    episode_id = f"steer-cli-{uuid.uuid4().hex[:6]}"
    handle = await start_episode(client, request_for(server, approve="risky"), workers.queue, episode_id)
    drlm = Cli(tmp_path, temporal_address, session_dir)
    watcher = await drlm.start("watch", episode_id, "--plain")

    # Cell 1 ran at once (nothing risky); cell 2 imports socket and waits.
    await until(client, episode_id, waiting(2))
    code, out, err = await drlm("pending", "--json")
    assert code == 0, err
    listed = [json.loads(line) for line in out.splitlines()]
    mine = [p for p in listed if p["episode_id"] == episode_id]
    assert [p["id"] for p in mine] == [f"{episode_id}#2"]
    assert mine[0]["reasons"] == ["line 1: imports socket (network or native code)"]
    code, out, err = await drlm("pending")
    assert (
        f"{episode_id}#2  waiting" in out
        and "risk: line 1: imports socket" in out
        and "| import socket" in out
    )

    edit = tmp_path / "cell.py"
    edit.write_text("print('edited')\n")
    code, out, err = await drlm("approve", f"{episode_id}#2", "--edit", str(edit), "--as", "zed")
    assert code == 0 and "edit accepted" in err, err

    await until(client, episode_id, waiting(3))
    code, out, err = await drlm("reject", f"{episode_id}#3")
    assert code == 2 and "--reason" in err  # the model must read why
    code, out, err = await drlm("reject", f"{episode_id}#3", "--reason", "no writes", "--as", "zed")
    assert code == 0, err
    code, out, err = await drlm("approve", f"{episode_id}#3")
    assert code == 2 and "cell 3 does not wait for approval" in err  # a stale id approves nothing

    await until(client, episode_id, waiting(4))
    code, out, err = await drlm("hint", episode_id, "the answer is what cell 2 printed", "--as", "zed")
    assert code == 0 and "hint accepted" in err, err
    code, out, err = await drlm("limits", episode_id)
    assert code == 2 and "at least one limit" in err
    code, out, err = await drlm("limits", episode_id, "--max-iterations", "30", "--as", "zed")
    assert code == 0 and "max_iterations 8 -> 30" in err, err
    code, out, err = await drlm("pause", episode_id, "--hold-clock", "--as", "zed")
    assert code == 0 and "max_duration stops counting" in err, err
    await until(client, episode_id, lambda p: p.held is not None and p.phase.startswith("paused"))

    # `drlm resume` lifts the pause and follows the episode; `drlm finish` ends it.
    follower = await drlm.start("resume", episode_id, "--json", "--as", "zed")
    await until(client, episode_id, lambda p: p.held is None)
    code, out, err = await drlm("finish", episode_id, "--reason", "done", "--as", "zed")
    assert code == 0 and "finish accepted" in err, err
    code, out, err = await Cli.finish(follower)
    assert code == 4, err  # an extracted answer, as for any limit
    report = json.loads(out)
    assert report["ended_by"] == "finish_requested" and report["answer"] == "edited"
    await handle.result()
    code, out, err = await Cli.finish(watcher)
    assert code == 4, err
    assert "`drlm approve " + f"{episode_id}#2 [--edit FILE]`" in err  # told what to do
    for line in ("gate by drlm: cell 2 waits for approval", "edit by zed: cell 2", "reject by zed: cell 3"):
        assert line in err, err

    observed = server.root_requests()[2].last_user
    assert "print('edited')" in observed and "\nedited\n" in observed and "import socket" not in observed
    assert "Not run: zed rejected this cell" in server.root_requests()[3].last_user
    code, out, err = await drlm("show", episode_id)
    assert code == 0, err
    for line in (
        ">>> edit by zed",
        ">>> reject by zed",
        ">>> hint by zed",
        ">>> limits by zed",
        ">>> pause by zed",
    ):
        assert line in out, out
    assert ">>> resume by zed" in out and ">>> finish by zed" in out


@pytest.mark.slow  # long end to end (the default run stays near 13 minutes); CI runs it
async def test_a_child_episodes_cells_wait_for_approval_too(client, scripted, workers) -> None:
    from tests.test_recursion import by_model, tree_request

    server = scripted(
        by_model(
            {
                "root-m": ["```repl\nanswer = rlm_query('count', model='child-m')\n```", "FINAL_VAR(answer)"],
                "child-m": ["```repl\nimport socket\nn = 3\n```", "FINAL_VAR(n)"],
            }
        )
    )
    request = tree_request(server, "delegate", ["child-m"], max_depth=2, approve="risky")
    episode_id = f"steer-tree-{uuid.uuid4().hex[:6]}"
    handle = await start_episode(client, request, workers.queue, episode_id)
    child_id = f"{episode_id}/1.0"
    deadline = time.monotonic() + 40
    while not [p for p in await pending_cells(client) if p.episode_id == child_id]:
        assert time.monotonic() < deadline, "the child's cell never waited"
        await asyncio.sleep(0.2)
    # The parent's cell (an rlm_query) ran at once; the child's imports socket and waits.
    waiting_child = (await progress_of(client, child_id)).pending_cell
    assert waiting_child is not None and waiting_child.mode == "risky"
    assert waiting_child.reasons == ["line 1: imports socket (network or native code)"]
    assert (await progress_of(client, episode_id)).pending_cell is None
    assert (await decide_cell(client, child_id, True, "hal")).accepted
    result = await asyncio.wait_for(handle.result(), 40)
    assert result.answer == "3"


async def test_max_duration_keeps_counting_through_a_pause_unless_held(
    skipping_env, store, session_dir: Path, scripted
) -> None:
    server = scripted(
        root_and_sub(
            ["```repl\nx = 1\n```", "```repl\nx += 1\n```"],
            extract=lambda prompt: '{"answer": "1", "_extraction_notes": ""}',
        )
    )
    limits = EpisodeLimits(max_iterations=8, max_duration=timedelta(days=1), cell_timeout_s=10)
    client = skipping_env.client
    settings = Settings(task_queue=f"skip-{uuid.uuid4().hex[:6]}", data_dir=session_dir)
    episode_id = f"steer-clock-{uuid.uuid4().hex[:6]}"
    async with running_workers(Services(settings, store[0], store[1], client)):
        handle = await start_episode(
            client, request_for(server, limits=limits, approve="all"), settings.task_queue, episode_id
        )
        await until(client, episode_id, waiting(1))
        assert (await pause_episode(client, episode_id, "ida")).accepted
        await until(client, episode_id, lambda p: p.held is not None and p.phase.startswith("paused"))
        await skipping_env.sleep(timedelta(days=2))
        result = await asyncio.wait_for(handle.result(), 60)
    assert result.ended_by == "max_duration" and result.answer == "1"  # the durable timer fired
    assert result.iterations == 1 and len(server.root_requests()) == 1  # nothing ran after the pause


async def test_the_python_api_steers_an_episode(temporal_address, session_dir, scripted, workers) -> None:
    from durable_rlm import DurableRLM

    server = scripted(
        root_and_sub(
            ["```repl\nx = 2\n```", "```repl\nprint(x * 10)\n```", Reply(text="Done soon.", delay_s=1)],
            extract=lambda prompt: '{"answer": "200", "_extraction_notes": ""}',
        )
    )
    settings = Settings(temporal_address=temporal_address, task_queue=workers.queue, data_dir=session_dir)
    async with DurableRLM("scripted", base_url=server.base_url, approve="all", settings=settings) as rlm:
        episode = await rlm.start("some context", "What is x times a hundred?")

        async def waiting_cell(number: int) -> None:
            deadline = time.monotonic() + 30
            while (cell := await episode.pending_cell()) is None or cell.cell != number:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)

        await waiting_cell(1)
        assert (await episode.approve(cell=1, sender="api")).accepted
        await waiting_cell(2)
        assert (await episode.hint("multiply by a hundred", sender="api")).accepted
        assert (await episode.set_limits(max_iterations=12, max_duration=600, sender="api")).accepted
        assert (await episode.pause(sender="api")).accepted
        assert (await episode.resume(sender="api")).accepted
        assert (await episode.approve(code="print(x * 100)", sender="api")).accepted
        refused = await episode.reject("nothing waits now", sender="api")
        assert not refused.accepted and "no cell waits" in refused.message
        await calls_until(server, 3)
        assert (await episode.finish_now("good enough", sender="api")).accepted
        result = await episode.result()
    assert result.ended_by == "finish_requested" and result.answer == "200"
    observed = server.root_requests()[2].last_user
    assert "200" in observed and "multiply by a hundred" in observed


@pytest.mark.slow  # long end to end (the default run stays near 13 minutes); CI runs it
async def test_episodes_no_worker_polls_do_not_hold_up_the_list_of_waiting_cells(
    client, scripted, workers
) -> None:
    """Running episodes that no worker polls (a `drlm run` whose process exited leaves them on
    its own queue) answer no query. The list asks only episodes whose status says a cell
    may wait (or that have no status), each for a bounded time: before, every running
    episode was asked and a few such orphans held `drlm pending` for a minute in the suite."""
    server = scripted(root_and_sub(["```repl\nx = 1\n```"]))
    nobody = f"nobody-polls-{uuid.uuid4().hex[:6]}"
    tag = uuid.uuid4().hex[:6]
    orphans = [
        await start_episode(client, request_for(server), nobody, f"orphan-{tag}-{i}") for i in range(4)
    ]
    # One started without the list's attributes cannot say it does not wait: it is asked.
    orphans.append(
        await client.start_workflow(
            names.WORKFLOW, request_for(server), id=f"orphan-{tag}-bare", task_queue=nobody
        )
    )
    episode_id = f"steer-orphans-{tag}"
    try:
        await start_episode(client, request_for(server, approve="all"), workers.queue, episode_id)
        await until(client, episode_id, waiting(1))
        # Under the server's own query timeout (30 s): one orphan asked without a bound of
        # ours fails this (before: 30 s; now 5 s, the bare one's bound).
        cells = await asyncio.wait_for(pending_cells(client), 25)
    finally:
        for orphan in orphans:
            await orphan.terminate("test over")
    assert [c.approval_id for c in cells if c.episode_id == episode_id] == [f"{episode_id}#1"]
    assert not [c for c in cells if c.episode_id.startswith(f"orphan-{tag}")]
