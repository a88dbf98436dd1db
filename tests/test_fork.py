"""Time travel (1): `drlm fork` starts a new episode from another's state after iteration
K, on the real dev server: the REPL rebuilt from the cell log, no model called for the
first K iterations (the scripted servers count), the source's history and audit rows
untouched."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from durable_rlm.audit.timeline import episode_timeline, render
from durable_rlm.client.episodes import start_episode
from durable_rlm.scripted import ChatRequest, Reply, root_and_sub
from durable_rlm.settings import Settings
from durable_rlm.store import schema
from durable_rlm.timetravel.fork import ForkError, describe_fork, fork_episode, fork_point, fork_request
from durable_rlm.viewer.export import export_text
from durable_rlm.workflows.models import EpisodeResult
from tests.conftest import request_for, run_episode
from tests.test_steering import Cli, Workers, until, waiting

SOURCE_TURNS = [
    "```repl\nx = 6\nprint('x is', x)\n```",
    "```repl\ny = x * 7\nhalf = llm_query(f'half of {y}')\nprint(half)\n```",
    "```repl\nz = y + 1\nprint(z)\n```",
    "FINAL_VAR(z)",
]


def _halves(prompt: str) -> str:
    return str(int(prompt.rsplit(" ", 1)[-1]) // 2)


def _roots(server: Any) -> list[ChatRequest]:
    return [r for r in server.requests if r.is_root]


def _subs(server: Any) -> list[ChatRequest]:
    return [r for r in server.requests if not r.is_root]


def _audit_of(engine: sa.Engine, episode_id: str) -> dict[str, list[tuple]]:
    tables = {
        "episodes": schema.episodes,
        "iterations": schema.iterations,
        "calls": schema.model_calls,
        "cells": schema.cells,
        "events": schema.events,
    }
    with engine.connect() as db:
        return {
            name: sorted(
                tuple(v for k, v in row._mapping.items() if k != "updated_at")
                for row in db.execute(sa.select(table).where(table.c.episode_id == episode_id))
            )
            for name, table in tables.items()
        }


async def _source(client, server, queue: str) -> tuple[str, EpisodeResult]:
    source_id = f"fork-src-{uuid.uuid4().hex[:6]}"
    return source_id, await run_episode(client, request_for(server), queue, source_id)


async def test_a_fork_at_the_last_iteration_reaches_the_source_s_state(
    client, scripted, worker, store
) -> None:
    blobs, engine = store
    server = scripted(root_and_sub(SOURCE_TURNS, _halves))
    source_id, source = await _source(client, server, worker.task_queue)
    assert source.answer == "43" and source.iterations == 4 and source.sub_calls == 1
    source_events = len((await client.get_workflow_handle(source_id).fetch_history()).events)
    source_rows = _audit_of(engine, source_id)
    last_source_call = _roots(server)[-1]
    roots, subs = len(_roots(server)), len(_subs(server))

    handle, point = await fork_episode(client, worker.task_queue, source_id, 4)
    fork = await handle.result()

    # The fork starts where the source ended: the REPL rebuilt from the cell log (z, and
    # the sub-call's answer, without calling it again), every counter carried over ...
    assert point.state.iteration == 4 and point.state.conversation is not None
    assert fork.answer == "43" and fork.iterations == 5
    assert fork.sub_calls == source.sub_calls and fork.model_calls == source.model_calls + 1
    assert fork.usage.prompt_tokens > source.usage.prompt_tokens
    # ... and its one model call is the conversation the source had, and what followed.
    assert len(_roots(server)) == roots + 1 and len(_subs(server)) == subs
    first = _roots(server)[-1]
    assert first.messages[: len(last_source_call.messages)] == last_source_call.messages
    assert first.messages[len(last_source_call.messages)] == {"role": "assistant", "content": "FINAL_VAR(z)"}
    assert first.turn == 4

    # The source is untouched: its history and its audit rows.
    assert len((await client.get_workflow_handle(source_id).fetch_history()).events) == source_events
    assert _audit_of(engine, source_id) == source_rows
    fork_rows = _audit_of(engine, handle.id)
    (row,) = fork_rows["episodes"]
    with engine.connect() as db:
        forked = db.execute(
            sa.select(schema.episodes.c.forked_from, schema.episodes.c.forked_at).where(
                schema.episodes.c.episode_id == handle.id
            )
        ).one()
    assert tuple(forked) == (source_id, 4)
    assert [r[1] for r in fork_rows["iterations"]] == [5]  # its own iterations only

    # Its timeline shows the branch; its export holds the inherited iterations, marked.
    timeline = await episode_timeline(client, handle.id)
    assert [it.iteration for it in timeline.iterations] == [1, 2, 3, 4, 5]
    assert [it.inherited_from for it in timeline.iterations] == [source_id] * 4 + [None]
    text = render(timeline)
    assert f"Forked from {source_id} after iteration 4: same settings" in text
    assert f"=== iteration 4 (inherited from {source_id}) ===" in text
    assert f"--- {handle.id} branches here from {source_id} ---" in text.split("=== iteration 5 ===")[1]
    lines = [json.loads(line) for line in export_text(timeline, blobs, "rlms").splitlines()]
    assert lines[0]["forked_from"] == {"episode_id": source_id, "iteration": 4, "changes": []}
    assert [e.get("inherited_from") for e in lines[1:]] == [source_id] * 4 + [None]
    assert lines[-1]["final_answer"] == "43"


async def test_a_fork_with_another_model_diverges_after_k(client, scripted, worker, session_dir) -> None:
    from durable_rlm.workflows.models import DurabilitySettings, SnapshotPolicy

    server = scripted(root_and_sub(SOURCE_TURNS, _halves))
    source_id = f"fork-src-{uuid.uuid4().hex[:6]}"
    durability = DurabilitySettings(
        heartbeat_timeout_s=3,
        sticky_schedule_to_start_s=3,
        snapshots=SnapshotPolicy(every_cells=1, after_s=0),
    )
    request = request_for(server, durability=durability)
    source = await run_episode(client, request, worker.task_queue, source_id)
    roots, subs = len(_roots(server)), len(_subs(server))
    other = scripted(
        root_and_sub(
            [
                Reply(status=500, error="iterations 1 and 2 are inherited: never asked"),
                Reply(status=500, error="never asked"),
                "```repl\nprint('fork sees', x, y, half)\n```",
                "FINAL(fork: 42 then 21)",
            ]
        )
    )
    settings = Settings(task_queue=worker.task_queue, data_dir=session_dir)  # the workers' snapshot key
    handle, point = await fork_episode(
        client,
        worker.task_queue,
        source_id,
        2,
        model="other-model",
        base_url=other.base_url,
        settings=settings,
    )
    fork = await handle.result()
    assert describe_fork(point) == (
        f"forked from {source_id} at iteration 2: model scripted -> other-model; "
        "sub-model scripted -> other-model"
    )
    assert fork.answer == "fork: 42 then 21" and fork.answer != source.answer
    # The new model is called from iteration 3 on only; the source's model never again.
    assert [r.turn for r in _roots(other)] == [2, 3] and not _subs(other)
    assert (len(_roots(server)), len(_subs(server))) == (roots, subs)
    seen = _roots(other)[1].messages[-1]["content"]
    assert "fork sees 6 42 21" in seen  # x, y and the recorded sub-call answer, rebuilt
    assert fork.iterations == 4 and fork.sub_calls == 1  # the inherited sub-call counts
    timeline = await episode_timeline(client, handle.id)
    assert [it.inherited_from for it in timeline.iterations] == [source_id, source_id, None, None]
    assert timeline.iterations[2].model == "other-model"
    # Its REPL came back from the source's snapshot after cell 2, a fork may load its source's.
    rebuild = timeline.iterations[2].cells[0].rebuild
    assert rebuild is not None and rebuild.from_snapshot == 2 and rebuild.cells_rerun == 0, rebuild

    # A request that only claims to descend from the source (no lineage signed with the
    # workers' key) is refused its snapshot: its REPL is rebuilt by re-running the cells.
    point = await fork_point(client, source_id, 2)
    forged = fork_request(point)
    assert forged.fork is not None and forged.fork.lineage_mac is None
    forged.fork.lineage_mac = "0" * 64
    fake = await start_episode(client, forged, worker.task_queue, f"{source_id}-forged")
    assert (await fake.result()).answer == "43"
    refused = (await episode_timeline(client, fake.id)).iterations[2].cells[0].rebuild
    assert refused is not None and refused.from_snapshot is None and refused.cells_rerun == 2
    assert any("could not be" in note and "another episode" in note for note in refused.notes), refused.notes
    # The source still reads as it ended.
    assert (await client.get_workflow_handle(source_id, result_type=EpisodeResult).result()).answer == "43"


async def test_bad_forks_are_refused_before_anything_starts(client, scripted, worker) -> None:
    server = scripted(root_and_sub(SOURCE_TURNS, _halves))
    source_id, _ = await _source(client, server, worker.task_queue)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"source_id": "no-such-episode", "at": 1}, "cannot fork 'no-such-episode': no episode with that id"),
        ({"at": 0}, "--at must be 1 or more"),
        ({"at": 5}, "it has 4 finished iteration(s); --at takes 1 to 4"),
        ({"at": 2, "max_iterations": 2}, "--max-iterations 2 leaves the fork no iteration after 2"),
        ({"at": 2, "policy": "no_such_policy"}, "invalid fork: "),
        # One list of fork settings (ForkChanges): a misspelt or mistyped one is named.
        ({"at": 2, "modle": "m2"}, "invalid fork: modle: not a fork setting (fork settings: episode_id,"),
        ({"at": 2, "max_iterations": "x"}, "invalid fork: max_iterations: Input should be a valid integer"),
    ]
    for changes, message in cases:
        arguments = {"source_id": source_id, **changes}
        with pytest.raises(ForkError) as caught:
            await fork_episode(
                client, worker.task_queue, arguments.pop("source_id"), arguments.pop("at"), **arguments
            )
        assert message in str(caught.value)
    episodes = [e async for e in client.list_workflows(f'WorkflowId STARTS_WITH "{source_id}-fork"')]
    assert episodes == []


async def test_a_running_episode_forks_at_a_finished_iteration(client, scripted, store, session_dir) -> None:
    workers = Workers(client, store, session_dir)
    await workers.start()
    try:
        server = scripted(root_and_sub(SOURCE_TURNS, _halves))
        source_id = f"fork-live-{uuid.uuid4().hex[:6]}"
        from durable_rlm.client.episodes import start_episode

        await start_episode(client, request_for(server, approve="all"), workers.queue, source_id)
        await until(client, source_id, waiting(1))
        with pytest.raises(ForkError, match="has no finished iteration so far"):
            await fork_point(client, source_id, 1)
        from durable_rlm.client.steering import decide_cell

        await decide_cell(client, f"{source_id}#1", True, "ann")
        await until(client, source_id, waiting(2))
        handle, point = await fork_episode(client, workers.queue, source_id, 1)
        assert point.running and "still running" in describe_fork(point)
        with pytest.raises(ForkError, match=r"1 finished iteration\(s\) so far \(it is still running\)"):
            await fork_point(client, source_id, 2)
        # The fork inherits the approval mode: its first cell waits for a person too.
        await until(client, handle.id, waiting(2))
        await client.get_workflow_handle(source_id).terminate("test over")
        await handle.terminate("test over")
    finally:
        await workers.stop()


@pytest.mark.slow  # long end to end (the default run stays near 13 minutes); CI runs it
async def test_the_command_line_forks_shows_and_exports(
    client, scripted, worker, tmp_path: Path, temporal_address: str, session_dir: Path
) -> None:
    server = scripted(root_and_sub(SOURCE_TURNS, _halves))
    source_id, _ = await _source(client, server, worker.task_queue)
    other = scripted(root_and_sub(["-", "-", "-", "FINAL(a different ending)"]))
    drlm = Cli(tmp_path, temporal_address, session_dir)
    drlm.env["DRLM_TASK_QUEUE"] = worker.task_queue
    code, out, err = await drlm("fork", "no-such", "--at", "1")
    assert code == 2 and "cannot fork 'no-such': no episode with that id" in err
    code, out, err = await drlm("fork", source_id, "--at", "9")
    assert code == 2 and "--at takes 1 to 4" in err
    fork_id = f"{source_id}-cli"
    code, out, err = await drlm(
        "fork", source_id, "--at", "3", "--model", "m2", "--base-url", other.base_url, "--id", fork_id
    )
    assert code == 0, err
    assert out.strip() == "a different ending"
    assert f"episode {fork_id} started: forked from {source_id} at iteration 3: model scripted -> m2;" in err
    code, shown, err = await drlm("show", fork_id)
    assert code == 0, err
    assert f"Forked from {source_id} after iteration 3: model scripted -> m2; sub-model" in shown
    assert shown.count(f"(inherited from {source_id})") == 3
    code, exported, err = await drlm("export", fork_id)
    assert code == 0, err
    entries = [json.loads(line) for line in exported.splitlines()]
    assert [e.get("inherited_from") for e in entries[1:]] == [source_id] * 3 + [None]


@pytest.mark.slow  # long end to end (the default run stays near 13 minutes); CI runs it
async def test_forks_across_continue_as_new_and_of_a_fork(session_dir: Path, store, blobs, scripted) -> None:
    from temporalio.client import Client

    from durable_rlm.store.codec import data_converter
    from durable_rlm.worker.runtime import EmbeddedServer
    from tests.conftest import workers_for

    counting = [f"```repl\ncount = globals().get('count', 0) + {n}\nprint(count)\n```" for n in range(1, 6)]
    server = scripted(root_and_sub([*counting, "FINAL_VAR(count)"]))
    args = ("--dynamic-config-value", "limit.historyCount.suggestContinueAsNew=20")
    async with EmbeddedServer(session_dir / "fork-can.sqlite", extra_args=args) as address:
        client = await Client.connect(address, data_converter=data_converter(blobs))
        async with workers_for(client, store, session_dir, "fork-can"):
            source_id = f"fork-can-{uuid.uuid4().hex[:6]}"
            source = await run_episode(client, request_for(server), "fork-can", source_id)
            assert source.answer == "15"
            timeline = await episode_timeline(client, source_id)
            assert timeline.runs > 2  # the iterations forked below lie in different runs
            ending = scripted(root_and_sub(["FINAL_VAR(count)"]))
            answers = {}
            for at in (1, 3, 5):
                handle, point = await fork_episode(
                    client, "fork-can", source_id, at, model="end-now", base_url=ending.base_url
                )
                answers[at] = (await handle.result()).answer
                assert point.state.iteration == at
            # count after iteration K is 1 + 2 + ... + K, whichever run K fell in.
            assert answers == {1: "1", 3: "6", 5: "15"}
            runs_of = {
                p.iteration: p.run_id for p in [await fork_point(client, source_id, k) for k in (1, 5)]
            }
            assert runs_of[1] != runs_of[5]

            # A fork of a fork: at its own iterations, its state; at inherited ones, its source's.
            more = scripted(root_and_sub(["-", "-", "```repl\ncount *= 10\n```", "FINAL_VAR(count)"]))
            first, _ = await fork_episode(
                client, "fork-can", source_id, 2, model="x10", base_url=more.base_url
            )
            assert (await first.result()).answer == "30"
            inner = await fork_point(client, first.id, 3)
            assert inner.source_id == first.id and inner.state.iteration == 3
            outer = await fork_point(client, first.id, 1)
            assert outer.source_id == source_id and outer.state.iteration == 1
            handle, _ = await fork_episode(
                client, "fork-can", first.id, 3, model="end", base_url=ending.base_url
            )
            assert (await handle.result()).answer == "30"
            shown = await episode_timeline(client, handle.id)
            assert [it.inherited_from for it in shown.iterations] == [source_id, source_id, first.id, None]


async def test_the_python_api_forks_and_reruns(
    temporal_address, session_dir, client, scripted, worker
) -> None:
    from durable_rlm import DurableRLM
    from durable_rlm.settings import Settings

    server = scripted(root_and_sub(SOURCE_TURNS, _halves))
    settings = Settings(temporal_address=temporal_address, task_queue=worker.task_queue, data_dir=session_dir)
    async with DurableRLM("scripted", base_url=server.base_url, settings=settings) as rlm:
        source = await rlm.start("some context", "What is z?")
        assert (await source.result()).answer == "43"
        other = scripted(root_and_sub(["-", "```repl\nprint(x)\n```", "FINAL(x was 6)"]))
        fork = await rlm.fork(source.id, 1, model="m2", base_url=other.base_url, max_iterations=5)
        result = await fork.result()
        assert (result.answer, result.iterations) == ("x was 6", 3)
        with pytest.raises(ForkError, match="--at takes 1 to 4"):
            await rlm.fork(source.id, 7)
        reports = await rlm.rerun([source.id])
        assert [(r.verdict, r.answer) for r in reports] == [("same", "43")]


async def test_a_fork_takes_the_limits_as_they_were_at_k(client, scripted, worker) -> None:
    """Limits a person changed mid-run are the fork's; a fork that could only extract (a
    limit already reached at K) is refused before it pays for the extraction."""
    from durable_rlm.client.episodes import start_episode
    from durable_rlm.client.steering import change_limits, decide_cell
    from durable_rlm.workflows.models import EpisodeLimits
    from tests.test_steering import until, waiting

    server = scripted(root_and_sub(SOURCE_TURNS, _halves))
    limits = EpisodeLimits(max_iterations=2, max_llm_calls=40, cell_timeout_s=10)
    source_id = f"fork-limits-{uuid.uuid4().hex[:6]}"
    handle = await start_episode(
        client, request_for(server, approve="all", limits=limits), worker.task_queue, source_id
    )
    await until(client, source_id, waiting(1))
    assert (await change_limits(client, source_id, "ann", max_iterations=6)).accepted
    for cell in (1, 2, 3):
        await until(client, source_id, waiting(cell))
        await decide_cell(client, f"{source_id}#{cell}", True, "ann")
    assert (await handle.result()).answer == "43"

    point = await fork_point(client, source_id, 3)
    assert point.request.limits.max_iterations == 2 and point.boundary.limits.max_iterations == 6
    assert not point.boundary.ended and (await fork_point(client, source_id, 4)).boundary.ended
    fork, _ = await fork_episode(client, worker.task_queue, source_id, 3)
    assert (await fork.result()).answer == "43"  # iteration 4 of 6: FINAL_VAR(z) again

    # A source stopped by its iteration limit: a fork at its end could only extract.
    stopped = scripted(root_and_sub(SOURCE_TURNS, _halves, extract=lambda prompt: '{"answer": "42"}'))
    stopped_id = f"fork-stopped-{uuid.uuid4().hex[:6]}"
    short = EpisodeLimits(max_iterations=2, max_llm_calls=40, cell_timeout_s=10)
    ended = await run_episode(client, request_for(stopped, limits=short), worker.task_queue, stopped_id)
    assert ended.ended_by == "max_iterations"
    calls = len(stopped.requests)
    with pytest.raises(ForkError, match=r"would end at once: .* its max_iterations \(2 of 2\)"):
        await fork_episode(client, worker.task_queue, stopped_id, 2)
    assert len(stopped.requests) == calls  # no extraction was paid for
    again, _ = await fork_episode(client, worker.task_queue, stopped_id, 2, max_iterations=4)
    assert (await again.result()).answer == "43"
    # Where the source answered, the fork asks its model again, and says so.
    last, point = await fork_episode(client, worker.task_queue, source_id, 4)
    assert "where the source ended: the fork asks its model again" in describe_fork(point)
    assert (await last.result()).answer == "43"


@pytest.mark.slow  # long end to end (the default run stays near 13 minutes); CI runs it
async def test_two_forks_at_once_survive_a_worker_restart_mid_call(
    client, scripted, store, session_dir
) -> None:
    """Two forks of one source started together (their replays in one process), their
    first model calls in flight when the worker stops: a new worker finishes both."""
    workers = Workers(client, store, session_dir)
    await workers.start()
    try:
        server = scripted(root_and_sub(SOURCE_TURNS, _halves))
        source_id = f"fork-twice-{uuid.uuid4().hex[:6]}"
        await run_episode(client, request_for(server), workers.queue, source_id)
        cell = "```repl\nprint(x, y)\n```"

        def first_a_slow_cell(request: ChatRequest) -> Reply | str:
            ran = any(m.get("content") == cell for m in request.messages)
            return "FINAL_VAR(y)" if ran else Reply(text=cell, delay_s=2)

        slow = scripted(first_a_slow_cell)
        settings = Settings(task_queue=workers.queue, data_dir=session_dir)
        (first, _), (second, _) = await asyncio.gather(
            *(
                fork_episode(
                    client,
                    workers.queue,
                    source_id,
                    at,
                    model="slow",
                    base_url=slow.base_url,
                    settings=settings,
                )
                for at in (2, 3)
            )
        )
        while len(slow.requests) < 2:  # both first calls are in flight
            await asyncio.sleep(0.05)
        await workers.stop()
        await workers.start()
        results = await asyncio.wait_for(asyncio.gather(first.result(), second.result()), 60)
        assert [r.answer for r in results] == ["42", "42"]
        assert [r.iterations for r in results] == [4, 5]
        assert len(server.requests) == 5  # the source's own calls: the forks asked it nothing
    finally:
        await workers.stop()
