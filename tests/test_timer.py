"""The durable max_duration timer, on Temporal's time-skipping test server.

The test server skips time only while nothing runs, so "a model that never finishes" is a
provider that answers every call with 429 and a ten-minute retry-after: between attempts
the episode waits, and an hour passes in moments.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import timedelta
from pathlib import Path

from durable_rlm.scripted import Reply
from durable_rlm.settings import Settings
from durable_rlm.worker.runtime import Services, running_workers
from durable_rlm.workflows import names
from durable_rlm.workflows.models import EpisodeLimits, EpisodeRequest, EpisodeResult
from tests.conftest import request_for

EXTRACTED = '{"answer": "partial result", "_extraction_notes": "from the history"}'


def never_answering(scripted) -> tuple[EpisodeRequest, object]:
    def overloaded(request):
        if request.is_extraction:
            return EXTRACTED
        return Reply(status=429, error="overloaded", headers={"retry-after": "600"})

    server = scripted(overloaded)
    limits = EpisodeLimits(max_iterations=1000, max_duration=timedelta(hours=1), cell_timeout_s=10)
    request = request_for(server, limits=limits)
    request.root_model.max_attempts = 1000
    return request, server


async def test_max_duration_ends_an_episode_whose_model_never_answers(
    skipping_env, store, session_dir: Path, scripted
) -> None:
    request, server = never_answering(scripted)
    settings = Settings(task_queue=f"skip-{uuid.uuid4().hex[:6]}", data_dir=session_dir)
    started = time.monotonic()
    async with running_workers(Services(settings, store[0], store[1], skipping_env.client)):
        result = await skipping_env.client.execute_workflow(
            names.WORKFLOW,
            request,
            id=f"timer-{uuid.uuid4().hex[:6]}",
            task_queue=settings.task_queue,
            result_type=EpisodeResult,
        )
    elapsed = time.monotonic() - started
    assert (result.ended_by, result.answer) == ("max_duration", "partial result")
    variant = result.execution.variant
    assert variant.kind == "extracted" and variant.reason.kind == "timeout"
    assert variant.reason.limit == 3600 and variant.reason.value >= 3600
    assert variant.confidence() == 0.5  # nothing in variables or history backs it
    assert 5 <= len(server.root_requests()) <= 8  # one attempt per 10 minutes of episode time
    assert len(server.extraction_requests()) == 1
    assert elapsed < 30, f"an hour of episode time took {elapsed:.1f} s of real time"


async def test_the_timer_fires_while_no_worker_runs(client, worker_processes, scripted) -> None:
    """Real dev server, real time: every worker is dead when the deadline passes."""
    server = scripted(lambda r: EXTRACTED if r.is_extraction else Reply(text="never in time", delay_s=60))
    request = request_for(server, limits=EpisodeLimits(max_duration=timedelta(seconds=4), cell_timeout_s=10))
    first = worker_processes()
    handle = await client.start_workflow(
        names.WORKFLOW,
        request,
        id=f"deadline-{uuid.uuid4().hex[:6]}",
        task_queue=worker_processes.queue,
        result_type=EpisodeResult,
    )
    while not server.root_requests():
        await asyncio.sleep(0.05)
    first.kill()
    await asyncio.sleep(6)  # the deadline passes with no worker anywhere
    worker_processes()
    result = await asyncio.wait_for(handle.result(), 60)
    assert (result.ended_by, result.answer) == ("max_duration", "partial result")
    assert result.execution.variant.reason.kind == "timeout"
