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
callers ("Do not call poll concurrently"), also while a failed worker drains: the thread only
keeps that one poll from waiting on the worker's busy loop.

Every worker polls this way (`build_workers` in runtime.py). It was held back at first: with
it, a test of a killed worker's episode page (tests/test_unattended.py) failed now and then.
The cause was elsewhere: a reaper held the dead worker's lock while it failed that worker's
calls, and every reader took the dead worker for a live one (durable_rlm/worker/liveness.py
no longer does that); the quicker hand-off only changed when the reaper ran.

This reaches into the SDK's private activity worker: `poll_on_a_thread` checks that what it
uses is there and, if an SDK release moved it, leaves the SDK's own loop in place and says so
(tests/test_activity_polls.py pins the installed SDK's shape).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from typing import Any, NoReturn

from temporalio.bridge.proto import ActivityTaskCompletion
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
    poller = _Poller(activities, running)
    activities.run = poller.run
    activities.drain_poll_queue = poller.drain
    return True


class _Poller:
    """The SDK's `_ActivityWorker.run` and `drain_poll_queue`, the polls on a thread.

    `run` returns once the core has shut down (its poll answered "shut down") and fails as
    the SDK's does when the worker fails; then the SDK calls `drain`, and the thread, still
    the one poller, fails every task it gets from then on ("Worker shutting down", as the
    SDK's drain does) until the core has shut down: never two polls at once."""

    def __init__(self, activities: Any, running: type) -> None:
        self.activities = activities
        self.running = running
        self.draining = False  # set on the worker's loop, read by the thread
        self.thread_ended: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ended: asyncio.Future[None] | None = None

    async def run(self) -> None:
        self.loop = loop = asyncio.get_running_loop()
        self.ended = ended = loop.create_future()
        threading.Thread(target=self._poll_forever, name="drlm-activity-polls", daemon=True).start()

        async def failure() -> NoReturn:
            raise await self.activities._fail_worker_exception_queue.get()

        failing = asyncio.create_task(failure())
        try:
            either: list[asyncio.Future[Any]] = [failing, ended]
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if failing.done():
                self.draining = True  # the SDK drains next (`drain`)
                error = failing.exception()
                raise RuntimeError("Activity worker failed") from error
            await ended
        except BaseException:
            self.draining = True
            raise
        finally:
            failing.cancel()

    async def drain(self) -> None:
        """What the SDK calls after `run` failed: the thread fails the tasks still coming,
        until the core has shut down."""
        self.draining = True
        await asyncio.wrap_future(self.thread_ended)

    def _poll_forever(self) -> None:
        try:
            asyncio.run(self._polls())
        finally:
            self.thread_ended.set_result(None)

    async def _polls(self) -> None:
        while True:
            try:
                bridge = self.activities._bridge_worker()
                task = await bridge.poll_activity_task()
            except PollShutdownError:
                self._tell(self._end, None)
                return
            except BaseException as error:  # noqa: BLE001 - the worker's loop raises it
                self._tell(self._end, error)
                return
            if self.draining:
                completion = ActivityTaskCompletion(task_token=task.task_token)
                completion.result.failed.failure.message = "Worker shutting down"
                with contextlib.suppress(Exception):  # a core gone: nothing left to tell
                    await bridge.complete_activity_task(completion)
            elif not self._tell(self._dispatch, task):
                return  # the worker's loop closed: nothing left to hand it to

    def _tell(self, callback: Any, argument: Any) -> bool:
        """Run `callback(argument)` on the worker's loop; False if that loop has closed."""
        assert self.loop is not None
        try:
            self.loop.call_soon_threadsafe(callback, argument)
        except RuntimeError:
            return False
        return True

    def _dispatch(self, task: Any) -> None:
        """On the worker's loop, as the SDK's loop does it. A cancellation goes in behind the
        start task's first step: the thread may hand over a start and its cancellation in one
        turn of the loop, where the SDK's loop polled between them, and a task cancelled
        before its first step would never report its completion to the core."""
        try:
            if task.HasField("start"):
                activity = self.running()
                activity.task = asyncio.create_task(
                    self.activities._handle_start_activity_task(task.task_token, task.start, activity)
                )
                self.activities._running_activities[task.task_token] = activity
            elif task.HasField("cancel"):
                assert self.loop is not None
                self.loop.call_soon(self._cancel, task)
            else:
                raise RuntimeError(f"Unrecognized activity task: {task}")
        except BaseException as error:  # noqa: BLE001 - fails the worker, as the SDK's loop would
            self._end(error)

    def _cancel(self, task: Any) -> None:
        try:
            self.activities._handle_cancel_activity_task(task.task_token, task.cancel)
        except BaseException as error:  # noqa: BLE001 - fails the worker, as the SDK's loop would
            self._end(error)

    def _end(self, error: BaseException | None) -> None:
        assert self.ended is not None
        if self.ended.done():
            return
        if error is None:
            self.ended.set_result(None)
        else:
            failed = RuntimeError("Activity worker failed")
            failed.__cause__ = error
            self.ended.set_exception(failed)
