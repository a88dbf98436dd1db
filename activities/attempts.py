"""Starts of a local REPL step, counted across workers.

A local activity's attempts are counted by the worker that runs it, and nothing reaches
history until its workflow task completes. When a cell kills its worker, the next worker
replays the episode and starts the step again as attempt 1: a cell that kills every worker
would loop forever. Each start is therefore recorded in the blob store (a content-addressed
marker: start k of step S of this run), and a step started too often gives up, so the
workflow records the cell as lost and the episode goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime

from temporalio import activity
from temporalio.exceptions import ApplicationError

from durable_rlm.blobs import BlobStore
from workflows import defaults, names
from workflows.models import CellOutcome, StepEcho


def _marker(step: str, start: int) -> bytes:
    return f"drlm-local-step-start\n{step}\n{start}".encode()


def record_start(blobs: BlobStore, step: str, limit: int) -> int:
    """Record one more start of `step`; refuse the one after `limit`."""
    for start in range(1, limit + 1):
        if blobs.add(_marker(step, start)):
            return start
    raise ApplicationError(
        f"its step was started afresh {limit} times (a worker lost, or its task timed out, each time)",
        type=names.REPL_STEP_ABANDONED,
        non_retryable=True,
    )


async def count_local_start(blobs: BlobStore, limit: int = defaults.REPL_ATTEMPTS_LOCAL) -> None:
    """In a local activity: count this start of the step (its activity id is stable across
    replays of the run); remote activities are counted by the server."""
    if not activity.in_activity():
        return
    info = activity.info()
    # Retries on the same worker (attempt > 1) are bounded by the step's retry policy; a
    # start after a replay (a new worker, a lost task) is attempt 1 again: that is counted.
    if not info.is_local or info.attempt > 1:
        return
    step = f"{info.workflow_id}/{info.workflow_run_id}/{info.activity_id}"
    await asyncio.to_thread(record_start, blobs, step, limit)


@contextlib.asynccontextmanager
async def echoed(echo: StepEcho) -> AsyncIterator[Callable[[CellOutcome], CellOutcome]]:
    """A local step repeats its input in what it returns, and in the details of a failure
    (history holds a local activity's result, not its input). Every step also says when it
    ran, for the audit store's cell durations."""
    local = activity.in_activity() and activity.info().is_local
    started = datetime.now(UTC)

    def attach(outcome: CellOutcome) -> CellOutcome:
        update: dict[str, object] = {"started_at": started, "ended_at": datetime.now(UTC)}
        if local:
            update["step"] = echo
        return outcome.model_copy(update=update)

    try:
        yield attach
    except ApplicationError as exc:
        if not local or exc.details:
            raise
        raise ApplicationError(
            exc.message,
            echo,
            type=exc.type,
            non_retryable=exc.non_retryable,
            next_retry_delay=exc.next_retry_delay,
            category=exc.category,
        ) from exc
    except Exception as exc:  # a broken pipe, a locked database: retryable, and still echoed
        if not local:
            raise
        raise ApplicationError(str(exc) or type(exc).__name__, echo, type=type(exc).__name__) from exc
