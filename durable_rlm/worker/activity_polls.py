"""Activity tasks reach this worker's code as soon as the SDK's core has them.

The Python SDK's activity worker (temporalio 1.35, `_ActivityWorker.run`) asks its core for
one task at a time: it awaits a poll, hands the task to a new asyncio task, and only then
asks again. Each round trip crosses the Rust bridge and takes two or three turns of the
event loop, and on a loaded worker a turn is long (its thread was busy ~94% of the time at
N=200): the loop took ~30 tasks a second, while the core, which feeds local activities first,
held the model calls that had already been handed out. Their heartbeat and start-to-close
clocks ran all that time: at N=200 on one process a model call reached our code a median
1-4 s after the server handed it out, and up to 7 s; an idle process beside it, on the same
server, got its tasks in 8 ms (BENCHMARKS.md, "Overload on 2026-11-29").

So the worker keeps POLLERS polls waiting at once, each dispatching as the SDK does. The core
serves them one by one behind its own lock (its `WorkerActivityTasks::poll` takes the task
stream's mutex), so no task is given twice; there is simply always a poll waiting when a task
comes. With four, the hand-off fell to a median 0.03 s, 0.22 s at most, in the same run.

This reaches into the SDK's private activity worker: `poll_concurrently` checks that what it
uses is there and, if an SDK release moved it, leaves the SDK's own loop in place and says so
(tests/test_activity_polls.py pins the installed SDK's shape).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, NoReturn

from temporalio.bridge.worker import PollShutdownError
from temporalio.worker import Worker

_running_activity: type | None
try:
    from temporalio.worker._activity import _RunningActivity

    _running_activity = _RunningActivity
except ImportError:  # a release that moved it: poll_concurrently keeps the SDK's own loop
    _running_activity = None

log = logging.getLogger(__name__)

POLLERS = 4
"""Polls waiting on the core at once. One leaves the core holding tasks while the event loop
comes round; two already keep one waiting; four leave room for the loop's slowest turns."""

USES = (
    "_bridge_worker",
    "_handle_start_activity_task",
    "_handle_cancel_activity_task",
    "_running_activities",
    "_fail_worker_exception_queue",
)
"""What of the SDK's activity worker the polls use: its own dispatch, unchanged."""


def poll_concurrently(worker: Worker, pollers: int = POLLERS) -> bool:
    """Have `worker` keep `pollers` activity polls waiting; False (the SDK's loop kept) for a
    worker without activities, or an SDK whose activity worker is not the shape known here."""
    activities = getattr(worker, "_activity_worker", None)
    if activities is None or pollers <= 1:
        return False
    running = _running_activity
    if running is None or not all(hasattr(activities, name) for name in USES):
        log.warning(
            "this temporalio's activity worker is not the one known (1.35): its single poll loop is"
            " kept, and activity tasks may wait in its core under load"
        )
        return False
    activities.run = functools.partial(_run, activities, running, pollers)
    return True


async def _run(activities: Any, running: type, pollers: int) -> None:
    """The SDK's `_ActivityWorker.run`, with `pollers` loops: it returns when the core has
    shut down (every loop told so), and fails as the SDK's does when the worker fails."""

    async def failure() -> NoReturn:
        raise await activities._fail_worker_exception_queue.get()

    failing = asyncio.create_task(failure())
    loops = [asyncio.create_task(_poll(activities, running)) for _ in range(pollers)]
    polling = set(loops)
    try:
        while polling:
            done, _ = await asyncio.wait([failing, *polling], return_when=asyncio.FIRST_COMPLETED)
            if failing in done:
                await failing  # raises the worker's failure, as the SDK's loop does
            for loop in done:
                polling.discard(loop)
                if loop.exception() is not None:
                    raise RuntimeError("Activity worker failed") from loop.exception()
    finally:
        failing.cancel()
        # A loop still waiting is left only when the worker failed: a shut down core answers
        # every waiting poll, so on shutdown they have all ended by now.
        for loop in loops:
            loop.cancel()


async def _poll(activities: Any, running: type) -> None:
    """One poll loop: each task dispatched exactly as the SDK's loop dispatches it."""
    while True:
        try:
            task = await activities._bridge_worker().poll_activity_task()
        except PollShutdownError:
            return
        if task.HasField("start"):
            activity = running()
            activity.task = asyncio.create_task(
                activities._handle_start_activity_task(task.task_token, task.start, activity)
            )
            activities._running_activities[task.task_token] = activity
        elif task.HasField("cancel"):
            activities._handle_cancel_activity_task(task.task_token, task.cancel)
        else:
            raise RuntimeError(f"Unrecognized activity task: {task}")
