"""Endings and time limits that hold (issue 20, item 6): every kind of ending projects into
the audit store the same way live and on rebuild; the deadline counts from submission; a
hung model shows in the progress line."""

from __future__ import annotations

import asyncio
import threading
import uuid
from datetime import timedelta

import pytest
import sqlalchemy as sa
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from durable_rlm.audit.projection import rebuild_audit, reconcile_audit
from durable_rlm.client.episodes import EpisodeEnd, follow, start_episode, wait_end
from durable_rlm.scripted import Reply, root_and_sub
from durable_rlm.store import schema
from durable_rlm.workflows import names
from durable_rlm.workflows.models import EpisodeLimits, EpisodeResult, TerminationSpec
from durable_rlm.workflows.termination import ActionResult, PolicyContext, PolicyRegistry, TerminationPolicy
from tests.conftest import request_for, workers_for
from tests.histories.record import cancel_beside_a_reply


@PolicyRegistry.register_termination("raises_on_step_one")
class RaisesOnStepOne(TerminationPolicy):
    """A custom policy with a bug: it raises on the second step."""

    name = "raises_on_step_one"

    def should_terminate(self, result: ActionResult, context: PolicyContext) -> tuple[bool, str | None]:
        if context.step == 1:
            raise KeyError("missing_metric")
        return False, None


def row(engine: sa.Engine, episode_id: str) -> dict:
    table = schema.episodes
    with engine.connect() as conn:
        found = conn.execute(sa.select(table).where(table.c.episode_id == episode_id)).one()
    values = dict(found._mapping)
    values.pop("updated_at")
    return values


async def test_every_ending_projects_the_same_live_and_rebuilt(
    client: Client, store, worker, scripted
) -> None:
    engine = store[1]
    gate = threading.Event()

    def blocks(request):
        if request.is_root and request.turn >= 1:
            gate.wait(60)
        return "```repl\nprint('working')\n```"

    queue = worker.task_queue
    completed = scripted(root_and_sub(["FINAL(done)"]))
    blocked = scripted(blocks)
    ids = {
        kind: f"end-{kind}-{uuid.uuid4().hex[:6]}"
        for kind in ("answered", "failed", "cancelled", "terminated", "timed_out")
    }
    try:
        await (await start_episode(client, request_for(completed), queue, ids["answered"])).result()
        failing = request_for(blocked, termination=TerminationSpec(name="raises_on_step_one"))
        gate.set()
        end = await wait_end(await start_episode(client, failing, queue, ids["failed"]))
        gate.clear()
        assert (end.status, end.error) == (
            "failed",
            "termination policy 'raises_on_step_one' raised KeyError: 'missing_metric'",
        )
        for kind in ("cancelled", "terminated"):
            waiting = scripted(blocks)
            handle = await start_episode(client, request_for(waiting), queue, ids[kind])
            while not any(r.turn >= 1 for r in waiting.root_requests()):
                await asyncio.sleep(0.05)
            if kind == "cancelled":
                await handle.cancel()
            else:
                await handle.terminate(reason="operator stop")
            assert (await wait_end(handle)).status == kind
        handle = await client.start_workflow(
            names.WORKFLOW,
            request_for(blocked),
            id=ids["timed_out"],
            task_queue=queue,
            result_type=EpisodeResult,
            execution_timeout=timedelta(seconds=3),
        )
        assert (await wait_end(handle)).status == "timed_out"
    finally:
        gate.set()

    await reconcile_audit(client, engine)  # what every worker runs: settles terminated/timed out
    table = schema.episodes
    with engine.connect() as conn:
        present = set(conn.execute(sa.select(table.c.episode_id)).scalars())
    assert set(ids.values()) <= present, {k: v in present for k, v in ids.items()}
    live = {kind: row(engine, episode_id) for kind, episode_id in ids.items()}
    assert {kind: r["status"] for kind, r in live.items()} == {k: k for k in ids}, live
    assert live["cancelled"]["error"] == "the episode was cancelled"
    assert live["terminated"]["error"] == "terminated: operator stop"
    assert live["answered"]["answer"] == "done" and live["answered"]["answer_source"] == "model"

    await rebuild_audit(client, engine)  # drops every row, then reads histories
    assert {kind: row(engine, episode_id) for kind, episode_id in ids.items()} == live


async def test_the_deadline_counts_from_submission_not_from_the_first_worker(
    client: Client, store, session_dir, scripted
) -> None:
    server = scripted(root_and_sub(["```repl\nimport time\ntime.sleep(0.5)\n```"]))
    limits = EpisodeLimits(max_iterations=50, max_duration=timedelta(seconds=6), cell_timeout_s=10)
    queue = f"late-{uuid.uuid4().hex[:6]}"
    episode_id = f"late-{uuid.uuid4().hex[:6]}"
    handle = await start_episode(
        client, request_for(server, limits=limits, fallback_extraction=False), queue, episode_id
    )
    await asyncio.sleep(4)  # submitted, but no worker polls this queue yet
    async with workers_for(client, store, session_dir, queue):
        result = await asyncio.wait_for(handle.result(), 30)
    assert result.ended_by == "max_duration"
    history = await handle.fetch_history()
    (timer,) = [
        e.timer_started_event_attributes.start_to_fire_timeout.ToTimedelta()
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_TIMER_STARTED
    ]
    assert timer < timedelta(seconds=3)  # 6 s budget, 4 s of it spent before any worker ran


@pytest.mark.slow  # long end to end (issue 34: the default run near 13 min); CI runs it
async def test_a_hung_model_shows_in_the_progress_line(client: Client, worker, scripted) -> None:
    server = scripted(root_and_sub([Reply(text="FINAL(late)", delay_s=3.5)]))
    handle = await start_episode(
        client, request_for(server), worker.task_queue, f"hung-{uuid.uuid4().hex[:6]}"
    )
    lines: list[str] = []
    end: EpisodeEnd = await follow(handle, lines.append, poll_s=0.2, waiting_every_s=1.0)
    assert end.result is not None and end.result.answer == "late"
    waiting = [line for line in lines if line.startswith("still waiting for the root model")]
    assert len(waiting) >= 2, lines
    assert "root completion, attempt 1 of 3" in waiting[-1]


@pytest.mark.parametrize("attempts", [1, 2])
async def test_request_timeout_and_attempts_come_from_the_request(
    client, worker, scripted, attempts: int
) -> None:
    server = scripted(root_and_sub([Reply(text="FINAL(too late)", delay_s=5)]))
    request = request_for(server)
    request.root_model.request_timeout_s = 1
    request.root_model.max_attempts = attempts
    handle = await start_episode(client, request, worker.task_queue, f"timeout-{uuid.uuid4().hex[:6]}")
    result = await asyncio.wait_for(handle.result(), 60)
    assert result.ended_by == "model_error" and "timed out after 1 s" in result.error
    assert len(server.root_requests()) == attempts


@pytest.mark.parametrize("approve", ["none", "all"])
async def test_a_cancel_that_arrives_with_a_steps_result_still_ends_the_episode(
    client: Client, store, session_dir, scripted, approve: str
) -> None:
    """The worst moment for a cancel: the root model's reply is in history, no worker has
    read it yet, and then the cancel arrives, so a worker gets both in one activation. The
    step's handle absorbs the cancel (its result wins); the episode must still end
    cancelled: not run on to its limits (and a cell waiting for approval would wait for
    ever: the page test's failure in CI, stop 39). How the moment is made:
    `cancel_beside_a_reply`."""
    blobs = store[0]
    queue = f"test-{uuid.uuid4().hex[:8]}"
    release = threading.Event()

    def script(request):
        if request.is_root and request.turn == 0:
            release.wait(60)
        return "```repl\nprint('working')\n```"

    server = scripted(script)
    request = request_for(
        server,
        limits=EpisodeLimits(max_iterations=3, max_llm_calls=10, max_duration=timedelta(minutes=5)),
        approve=approve,  # "all": the reply's cell would wait for a person, for ever
    )
    receipt, result, history = await cancel_beside_a_reply(
        client,
        lambda: workers_for(client, store, session_dir, queue),
        blobs,
        queue,
        f"sticky-cancel-{uuid.uuid4().hex[:8]}",
        request,
        release,
    )
    events = history.events
    kinds = [e.event_type for e in events]
    replied = next(
        i
        for i, e in enumerate(events)
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
        and events[
            e.activity_task_completed_event_attributes.scheduled_event_id - 1
        ].activity_task_scheduled_event_attributes.activity_type.name
        == names.ROOT_COMPLETION
    )
    accepted = kinds.index(EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED)
    # The moment happened: one workflow task read the reply and the cancel together.
    assert kinds[replied:accepted].count(EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED) == 1, kinds
    assert receipt.iteration == 1
    assert result.ended_by == "cancelled", result
    assert "enough" in result.stop_reason, result
    # Its cell never ran: nothing after the cancel asked for a step.
    scheduled = [
        e.activity_task_scheduled_event_attributes.activity_type.name
        for e in events[accepted:]
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
    ]
    assert names.ROOT_COMPLETION not in scheduled, scheduled
    assert {r.turn for r in server.requests if r.is_root} == {0}  # no second turn was asked
