"""`temporal workflow reset` on an episode with children, with the real `temporal` CLI: the
readers (show, export, list, the audit rows, the stored timeline) follow the reset run's
chain, never the run it abandoned, and the reset is an event of the timeline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from datetime import UTC
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from durable_rlm.audit import readonly, timeline_store
from durable_rlm.audit.history import episode_runs
from durable_rlm.audit.projection import _forget, rebuild_episode, reconcile_audit
from durable_rlm.audit.timeline import episode_timeline, render
from durable_rlm.scripted import ChatRequest
from durable_rlm.store import schema
from durable_rlm.viewer.export import rlms_log
from durable_rlm.worker.runtime import temporal_binary
from durable_rlm.workflows import names
from tests.conftest import request_for, run_episode, workers_for
from tests.test_recursion import by_model, tree_request

DRLM = str(Path(sys.executable).with_name("drlm"))
ROOT_TURNS = [
    "```repl\na = rlm_query('one', model='child-m')\nb = rlm_query('two', model='child-m')\n"
    "answer = a + '+' + b\n```",
    "FINAL_VAR(answer)",
]
CHILD_TURNS = ["```repl\nsize = len(context)\n```", "FINAL_VAR(size)"]


def reset_point(history: Any) -> int:
    """The workflow task completed right after iteration 1's root call: a reset there runs
    the cell, and so both children, again."""
    root = next(
        e.event_id
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and e.activity_task_scheduled_event_attributes.activity_type.name == names.ROOT_COMPLETION
    )
    answered = next(
        e.event_id
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
        and e.activity_task_completed_event_attributes.scheduled_event_id == root
    )
    return next(
        e.event_id
        for e in history.events
        if e.event_id > answered and e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED
    )


def temporal_reset(address: str, episode_id: str, event_id: int, reason: str) -> None:
    out = subprocess.run(
        [
            temporal_binary(),
            "workflow",
            "reset",
            "--address",
            address,
            "--workflow-id",
            episode_id,
            "--event-id",
            str(event_id),
            "--reason",
            reason,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr


def drlm(session_dir: Path, address: str, *args: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "TEMPORAL_", "DRLM_"))}
    environ.update(
        TEMPORAL_ADDRESS=address,
        DRLM_DATABASE_URL=f"sqlite:///{session_dir / 'drlm.sqlite'}",
        DRLM_DATA_DIR=str(session_dir / "cli"),
    )
    return subprocess.run([DRLM, *args], capture_output=True, text=True, timeout=120, env=environ)


def episode_row(engine: sa.Engine, episode_id: str) -> dict[str, Any]:
    with engine.connect() as conn:
        row = conn.execute(
            sa.select(schema.episodes).where(schema.episodes.c.episode_id == episode_id)
        ).first()
    assert row is not None
    return dict(row._mapping)


def reset_events(engine: sa.Engine, episode_id: str) -> list[dict[str, Any]]:
    table = schema.events
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(table).where(table.c.episode_id == episode_id, table.c.kind == "reset")
        ).all()
    return [dict(r._mapping) for r in rows]


@pytest.mark.slow  # long end to end (issue 34: the default run near 13 min); CI runs it
async def test_a_reset_episode_with_children_reads_as_its_reset_run(
    client: Client, scripted, store, session_dir: Path, temporal_address: str
) -> None:
    blobs, engine = store
    server = scripted(by_model({"root-m": ROOT_TURNS, "child-m": CHILD_TURNS}))
    request = tree_request(server, "two children", ["child-m"], max_depth=2)
    episode_id = f"reset-{uuid.uuid4().hex[:8]}"
    queue = f"test-{uuid.uuid4().hex[:8]}"
    async with workers_for(client, store, session_dir, queue):
        first = await run_episode(client, request, queue, episode_id)
    assert first.answer == "3+3"
    old_run = (await client.get_workflow_handle(episode_id).describe()).run_id
    # `drlm show` kept the ended episode's timeline, as it does.
    shown = await episode_timeline(client, episode_id)
    assert timeline_store.store_timeline(engine, shown, old_run)
    assert readonly.cached_timeline(engine, episode_id) is not None

    point = reset_point(await client.get_workflow_handle(episode_id).fetch_history())
    temporal_reset(temporal_address, episode_id, point, "try the cell again")

    # No worker yet: the reconciler (every worker's, `drlm list --refresh`) makes the row
    # the reset run's, which has no answer yet; the stored timeline of the old run is stale.
    await reconcile_audit(client, engine)
    row = episode_row(engine, episode_id)
    new_run = (await client.get_workflow_handle(episode_id).describe()).run_id
    assert new_run != old_run
    assert (row["run_id"], row["status"], row["answer"]) == (new_run, "running", None)
    assert [e["sender"] for e in reset_events(engine, episode_id)] == ["history-service"]
    assert readonly.cached_timeline(engine, episode_id) is None

    async with workers_for(client, store, session_dir, queue):  # `drlm resume` runs a worker too
        result = await client.get_workflow_handle(episode_id).result()
    assert result["answer"] == "3+3"

    # The timeline: one run (the abandoned one is not a continue-as-new), each child once.
    timeline = await episode_timeline(client, episode_id)
    assert (timeline.runs, timeline.run_id, timeline.status) == (1, new_run, "answered")
    assert [it.iteration for it in timeline.iterations] == [1, 2]
    (cell,) = timeline.iterations[0].cells
    assert [c.episode_id for c in cell.children] == [f"{episode_id}/1.0", f"{episode_id}/1.1"]
    for child in cell.children:
        assert child.timeline is not None and child.timeline.runs == 1
        assert child.timeline.result is not None and child.timeline.result.answer == "3"
    (reset,) = [a for a in timeline.actions if a.kind == "reset"]
    assert (reset.reset_to, reset.abandoned_run, reset.sender) == (point, old_run, "history-service")
    assert "try the cell again" in reset.detail
    text = render(timeline)
    assert f">>> reset to workflow task {point} by history-service" in text
    assert text.count(f"child {episode_id}/1.") == 2

    # Iteration 1 spans the reset: the time between its point and the reset is not its own.
    history = (await episode_runs(client, episode_id))[-1].history
    events = list(history.events)
    at = next(i for i, e in enumerate(events) if e.event_id == point)
    gap = (
        events[at].event_time.ToDatetime(tzinfo=UTC) - events[at - 1].event_time.ToDatetime(tzinfo=UTC)
    ).total_seconds()
    first_iteration = timeline.iterations[0]
    assert abs(first_iteration.reset_gap_s - gap) < 1e-6
    entries = rlms_log(timeline, blobs)[1:]
    span = (first_iteration.ended_at - first_iteration.started_at).total_seconds()
    assert abs(entries[0]["iteration_time"] - max(0.0, span - gap)) < 1e-6
    assert len(entries[0]["code_blocks"][0]["result"]["rlm_calls"]) == 2

    # The audit rows are the reset run's, live and rebuilt.
    live = episode_row(engine, episode_id)
    assert (live["run_id"], live["status"], live["answer"]) == (new_run, "answered", "3+3")
    await _forget_and_rebuild(client, engine, episode_id)
    rebuilt = episode_row(engine, episode_id)
    assert (rebuilt["run_id"], rebuilt["status"], rebuilt["answer"]) == (new_run, "answered", "3+3")
    assert len(reset_events(engine, episode_id)) == 1

    # The CLI: show reads the reset run (not the stored timeline of the old one), export
    # lists two children, list shows the reset run's row.
    out = drlm(session_dir, temporal_address, "show", episode_id)
    assert out.returncode == 0, out.stderr
    assert f"reset to workflow task {point}" in out.stdout and "(1 run(s))" in out.stdout
    assert out.stdout.count(f"child {episode_id}/1.") == 2
    out = drlm(session_dir, temporal_address, "export", episode_id)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [e["iteration"] for e in lines[1:]] == [1, 2]
    assert len(lines[1]["code_blocks"][0]["result"]["rlm_calls"]) == 2
    out = drlm(session_dir, temporal_address, "list", "--json", "--limit", "1000")
    assert out.returncode == 0, out.stderr
    (listed,) = [r for r in map(json.loads, out.stdout.splitlines()) if r["episode_id"] == episode_id]
    assert (listed["run_id"], listed["status"], listed["answer"]) == (new_run, "answered", "3+3")


async def _forget_and_rebuild(client: Client, engine: sa.Engine, episode_id: str) -> None:
    _forget(engine, episode_id)
    await rebuild_episode(client, engine, episode_id)


def audit_keys(engine: sa.Engine, episode_id: str) -> dict[str, set[tuple[Any, ...]]]:
    """The keys of every audit row of the episode, per table."""
    keys: dict[str, set[tuple[Any, ...]]] = {}
    with engine.connect() as conn:
        for table in schema.AUDIT_TABLES:
            columns = [c for c in table.primary_key.columns]
            rows = conn.execute(sa.select(*columns).where(table.c.episode_id == episode_id)).all()
            keys[table.name] = {tuple(r) for r in rows}
    return keys


async def test_the_rows_of_steps_a_reset_abandoned_go_even_when_the_reset_run_ended_unseen(
    client: Client, scripted, store, worker, temporal_address: str
) -> None:
    """The reset run ends before any reconciler saw it running: the abandoned run's later
    steps left rows (a third iteration, a second cell), which go when the episode's rows are
    written again from its chain: at its close now, else by the reconciler."""
    _, engine = store
    reset_done = {"yes": False}

    def script(request: ChatRequest) -> str:
        if request.is_extraction:
            return '{"answer": "none"}'
        if request.turn == 0:
            return "```repl\nx = 1\n```"
        if request.turn == 1 and reset_done["yes"]:
            return "FINAL(short)"  # the reset run answers at once
        return "```repl\ny = x + 1\n```" if request.turn == 1 else "FINAL_VAR(y)"

    server = scripted(script)
    episode_id = f"reset-{uuid.uuid4().hex[:8]}"
    first = await run_episode(client, request_for(server), worker.task_queue, episode_id)
    assert (first.answer, first.iterations) == ("2", 3)
    point = reset_point(await client.get_workflow_handle(episode_id).fetch_history())
    reset_done["yes"] = True
    temporal_reset(temporal_address, episode_id, point, "answer sooner")
    result = await client.get_workflow_handle(episode_id).result()
    assert (result["answer"], result["iterations"]) == ("short", 2)

    # The reset run's closing write settled its rows from its chain (projection.settle_at_close):
    # the abandoned run's third iteration and second cell are gone already, and the
    # reconciler, which did it before, finds nothing more to do.
    left = audit_keys(engine, episode_id)
    assert (episode_id, 3) not in left["audit_iterations"]
    assert episode_row(engine, episode_id)["answer"] == "short"

    await reconcile_audit(client, engine)
    settled = audit_keys(engine, episode_id)
    assert settled == left
    assert (episode_id, 3) not in settled["audit_iterations"]
    assert (episode_id, 2) not in settled["audit_cells"]
    assert len(reset_events(engine, episode_id)) == 1
    row = episode_row(engine, episode_id)
    assert (row["answer"], row["iterations"], row["status"]) == ("short", 2, "answered")
    await _forget_and_rebuild(client, engine, episode_id)
    assert audit_keys(engine, episode_id) == settled
