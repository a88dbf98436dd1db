"""REPL steps as local activities: what changes for a person watching or auditing.

A local step's result is a marker in history, its input is not; the step runs inside a
workflow task, which the SDK keeps alive for as long as the step runs.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta

import pytest
from temporalio.exceptions import ApplicationError

from durable_rlm.activities.attempts import record_start
from durable_rlm.audit.timeline import episode_timeline, render
from durable_rlm.scripted import root_and_sub
from durable_rlm.store.blobs import BlobStore
from durable_rlm.workflows import names
from durable_rlm.workflows.models import DurabilitySettings, EpisodeLimits, EpisodeProgress, EpisodeResult
from tests.conftest import request_for


async def test_a_cell_longer_than_the_workflow_task_timeout_finishes_and_stays_visible(
    client, worker, scripted
) -> None:
    turns = ["```repl\nimport time\ntime.sleep(5)\nslept = 'yes'\n```", "FINAL_VAR(slept)"]
    server = scripted(root_and_sub(turns))
    limits = EpisodeLimits(max_iterations=4, cell_timeout_s=30)
    episode_id = f"long-local-{uuid.uuid4().hex[:6]}"
    handle = await client.start_workflow(
        names.WORKFLOW,
        request_for(server, limits=limits),
        id=episode_id,
        task_queue=worker.task_queue,
        result_type=EpisodeResult,
        task_timeout=timedelta(seconds=2),  # the cell runs 2.5 times as long
    )
    while len(server.root_requests()) < 1:
        await asyncio.sleep(0.05)
    await asyncio.sleep(2.5)
    # Mid-cell, past the task timeout: a query is still answered, and says what runs.
    progress = await asyncio.wait_for(handle.query("progress", result_type=EpisodeProgress), 5)
    assert progress.phase.startswith("cell 1") and not progress.finished
    result = await asyncio.wait_for(handle.result(), 60)
    assert (result.answer, result.lost_cells) == ("yes", 0)
    history = await handle.fetch_history()
    timeouts = [e for e in history.events if e.HasField("workflow_task_timed_out_event_attributes")]
    assert not timeouts


async def test_the_timeline_shows_local_cells_including_a_lost_one(client, worker, scripted) -> None:
    turns = [
        "```repl\nx = llm_query('hello')\nprint(x)\n```",
        "```repl\nimport os\nos._exit(9)\n```",  # kills its sandbox on every attempt
        "FINAL_VAR(x)",
    ]
    server = scripted(root_and_sub(turns, str.upper))
    episode_id = f"timeline-local-{uuid.uuid4().hex[:6]}"
    handle = await client.start_workflow(
        names.WORKFLOW,
        request_for(server),
        id=episode_id,
        task_queue=worker.task_queue,
        result_type=EpisodeResult,
    )
    result = await asyncio.wait_for(handle.result(), 60)
    assert result.answer == "HELLO"
    timeline = await episode_timeline(client, episode_id)
    first, second = timeline.iterations[0].cells[0], timeline.iterations[1].cells[0]
    assert "llm_query('hello')" in first.code and first.stdout.strip() == "HELLO"
    assert [c.reply for c in first.sub_calls] == ["HELLO"]
    assert "os._exit(9)" in second.code
    assert "exited" in (second.error or "")
    assert "os._exit(9)" in render(timeline)
    # The steps were local: markers in history, no REPL activity scheduled.
    history = await handle.fetch_history()
    scheduled = [
        e.activity_task_scheduled_event_attributes.activity_type.name
        for e in history.events
        if e.HasField("activity_task_scheduled_event_attributes")
    ]
    assert names.REPL_EXECUTE not in scheduled and names.ROOT_COMPLETION in scheduled
    markers = [e for e in history.events if e.HasField("marker_recorded_event_attributes")]
    assert len(markers) >= 4  # the patch markers, then each local step


def test_a_step_started_too_often_gives_up(blob_store: BlobStore) -> None:
    step = f"wf/run/{uuid.uuid4().hex}"
    assert [record_start(blob_store, step, 3) for _ in range(3)] == [1, 2, 3]
    with pytest.raises(ApplicationError) as raised:
        record_start(blob_store, step, 3)
    assert raised.value.type == names.REPL_STEP_ABANDONED and raised.value.non_retryable
    assert record_start(blob_store, step + "-other", 3) == 1  # another step counts apart


async def test_remote_steps_still_work_when_asked_for(client, worker, scripted) -> None:
    turns = ["```repl\nv = llm_query('a')\n```", "FINAL_VAR(v)"]
    server = scripted(root_and_sub(turns, str.upper))
    durability = DurabilitySettings(heartbeat_timeout_s=3, sticky_schedule_to_start_s=3, local_repl=False)
    episode_id = f"remote-{uuid.uuid4().hex[:6]}"
    result = await client.execute_workflow(
        names.WORKFLOW,
        request_for(server, durability=durability),
        id=episode_id,
        task_queue=worker.task_queue,
        result_type=EpisodeResult,
    )
    assert result.answer == "A"
    history = await client.get_workflow_handle(episode_id).fetch_history()
    scheduled = [
        e.activity_task_scheduled_event_attributes.activity_type.name
        for e in history.events
        if e.HasField("activity_task_scheduled_event_attributes")
    ]
    assert names.REPL_EXECUTE in scheduled


async def test_only_fresh_starts_of_a_local_step_are_counted(blob_store: BlobStore) -> None:
    """A retry on the same worker is bounded by the step's retry policy; a start after a
    replay (attempt 1 on a new worker) is what the ledger counts."""
    import dataclasses

    from temporalio.testing import ActivityEnvironment

    from durable_rlm.activities.attempts import count_local_start

    env = ActivityEnvironment()
    fresh = dataclasses.replace(env.info, is_local=True, attempt=1, activity_id="7", workflow_run_id="r")
    for _ in range(3):
        env.info = fresh
        await env.run(count_local_start, blob_store)
        env.info = dataclasses.replace(fresh, attempt=2)  # a local retry: not counted
        await env.run(count_local_start, blob_store)
    env.info = fresh
    with pytest.raises(ApplicationError, match="started afresh 3 times"):
        await env.run(count_local_start, blob_store)
