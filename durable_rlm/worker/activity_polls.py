"""Activity tasks reach this worker's code as soon as the SDK's core has them.

The Python SDK's activity worker (temporalio 1.35, `_ActivityWorker.run`) asks its core for
one task at a time on the worker's event loop: it awaits a poll, hands the task to a new
asyncio task, and only then asks again. Each round trip crosses the Rust bridge and takes two
or three turns of the loop, and on a loaded worker a turn is long (its thread was busy ~94% of
the time at N=200): the loop took ~30 tasks a second, while the core, which serves local
activities first, held the model calls the server had already handed out. Their heartbeat and
start-to-close clocks ran all that time: at N=200 on one process a model call reached our
code a median 1-4 s after the server handed it out, and up to 7 s, while an idle process on
the same server got its tasks in 8 ms (BENCHMARKS.md, "Overload on 2026-11-29").

So the polls run on a thread of their own, with an event loop that does nothing else: as soon
as a poll returns the next one is asked, and the task goes to the worker's loop, where it is
dispatched exactly as the SDK dispatches it. Still one poll at a time, as the core asks of its
callers ("Do not call poll concurrently"): the thread only keeps that one poll from waiting on
the worker's busy loop.

This reaches into the SDK's private activity worker: `poll_on_a_thread` checks that what it
uses is there and, if an SDK release moved it, leaves the SDK's own loop in place and says so
(tests/test_activity_polls.py pins the installed SDK's shape).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from typing import Any, NoReturn

from temporalio.bridge.worker import PollShutdownError
from temporalio.worker import Worker

_running_activity: type | None
try:
    from temporalio.worker._activity import _RunningActivity

    _running_activity = _RunningActivity
except ImportError:  # a release that moved it: poll_on_a_thread keeps the SDK's own loop
    _running_activity = None

log = logging.getLogger(__name__)

USES = (
    "_bridge_worker",
    "_handle_start_activity_task",
    "_handle_cancel_activity_task",
    "_running_activities",
    "_fail_worker_exception_queue",
)
"""What of the SDK's activity worker the poller uses: its own dispatch, unchanged."""


def poll_on_a_thread(worker: Worker) -> bool:
    """Have `worker` poll its activity tasks from a thread of its own; False (the SDK's loop
    kept) for a worker without activities, or an SDK whose activity worker is not the shape
    known here."""
    activities = getattr(worker, "_activity_worker", None)
    if activities is None:
        return False
    running = _running_activity
    if running is None or not all(hasattr(activities, name) for name in USES):
        log.warning(
            "this temporalio's activity worker is not the one known (1.35): its own poll loop is"
            " kept, and activity tasks may wait in its core while the worker is busy"
        )
        return False
    activities.run = functools.partial(_run, activities, running)
    return True


async def _run(activities: Any, running: type) -> None:
    """The SDK's `_ActivityWorker.run`, its polls on a thread: returns once the core has shut
    down, and fails as the SDK's does when the worker fails."""
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()

    def dispatch(task: Any) -> None:  # on the worker's loop, as the SDK's loop does it
        if task.HasField("start"):
            activity = running()
            activity.task = asyncio.create_task(
                activities._handle_start_activity_task(task.task_token, task.start, activity)
            )
            activities._running_activities[task.task_token] = activity
        elif task.HasField("cancel"):
            activities._handle_cancel_activity_task(task.task_token, task.cancel)
        elif not ended.done():
            ended.set_exception(RuntimeError(f"Unrecognized activity task: {task}"))

    def end(error: BaseException | None) -> None:
        if ended.done():
            return
        if error is None:
            ended.set_result(None)
        else:
            failed = RuntimeError("Activity worker failed")
            failed.__cause__ = error
            ended.set_exception(failed)

    async def poll_forever() -> None:
        while True:
            try:
                task = await activities._bridge_worker().poll_activity_task()
            except PollShutdownError:
                loop.call_soon_threadsafe(end, None)
                return
            except BaseException as error:  # noqa: BLE001 - the worker's loop raises it
                loop.call_soon_threadsafe(end, error)
                return
            try:
                loop.call_soon_threadsafe(dispatch, task)
            except RuntimeError:  # the worker's loop closed: nothing left to hand it to
                return

    poller = threading.Thread(
        target=asyncio.run, args=(poll_forever(),), name="drlm-activity-polls", daemon=True
    )
    poller.start()

    async def failure() -> NoReturn:
        raise await activities._fail_worker_exception_queue.get()

    # Should the worker fail, the SDK then drains the core's tasks with polls of its own, and
    # the thread's last poll may still be waiting beside them: the one case of two at once,
    # on a worker going down.
    failing = asyncio.create_task(failure())
    try:
        either: list[asyncio.Future[Any]] = [failing, ended]
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if failing.done():
            await failing  # raises the worker's failure, as the SDK's loop does
        await ended
    finally:
        failing.cancel()
