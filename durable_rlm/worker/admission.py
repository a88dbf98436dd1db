"""Admission by measured capacity: how many episodes one worker process holds at once.

A worker process runs every workflow task, activity, local REPL step and heartbeat of its
episodes on one event loop, one core (the GIL), and its blob-store and REPL work on the
loop's few executor threads. Each episode it holds costs it work every step until the
episode ends. With nothing but fixed slots it takes every episode the server offers; past
its capacity their clocks run while they wait inside it: a workflow task not completed in
its timeout (10 s) is given again and its work thrown away, heartbeats leave late, live
calls are presumed dead and paid again (400 episodes on one worker had 288 fail on heartbeat
timeouts; docs/architecture/decisions.md, "Scale"). A task that waits on the server costs
nothing: its clock starts when a worker takes it (no schedule-to-start timeout on the shared
queue).

So two limits follow what a worker measures each second:
- how late its event loop runs a timer, and how long a job waits for a thread of the
  loop's executor: everything the worker does waits on one or the other, so this is the
  backlog its tasks, heartbeats and calls see;
- how long the workflow tasks it took stayed in it (taken to completed, the 90th
  percentile: the completion's round trip is in it, so a saturated server shows too),
  against a target well below the task timeout (a task running a long local REPL step
  stays long without overload; one of them does not move the percentile).
Beside them it reports (its log lines, `Capacity.describe`) how long the activity tasks it
received had waited since the server handed them out (the 90th percentile, `HandoffWatch`):
a task's heartbeat clock runs from the hand-out, and at N=200 on one worker that wait reached
7.5 s while the loop itself ran on time (BENCHMARKS.md, "Overload on 2026-11-29"); polled
from a thread of their own (activity_polls.py, as every worker now does) 0.23 s at most.
The limits: workflow tasks at once (every kind), and a window of episodes held, which a
reservation the SDK marks as not sticky (the shared queue: a new episode, or one moving
in) must find room in, and which it never gets while the worker is over a target. Past
either target both become two thirds (the window, of what is held); below half of both,
each grows by a tenth when a reservation waited for it. Nothing here deadlocks: tasks of
held episodes wait for no window, only for a slot, and slots come back as tasks complete.

Measured (bench/concurrency.py, N=400 on one worker): the tasks-at-once limit settles at
5-16 and is what keeps task and heartbeat clocks short; the window does not bound the
episodes held (180-250 of 400): far fewer reservations came marked not sticky than
episodes came in (7 against 180 in one run), so the SDK's core apparently does not mark a
reservation by the queue its task will come from (not checked in its source).

Activity tasks follow the same judgment (`AdmittingActivitySlots`): an overloaded worker
polls for none, so a model call it could not start in time waits on the server, where no
clock runs. A call the server gives up anyway is not paid again: the call ledger
(activities/call_ledger.py) answers its retry.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from temporalio import activity
from temporalio.worker import (
    ActivityInboundInterceptor,
    CustomSlotSupplier,
    ExecuteActivityInput,
    Interceptor,
    SlotMarkUsedContext,
    SlotPermit,
    SlotReleaseContext,
    SlotReserveContext,
)

log = logging.getLogger(__name__)

TICK_S = 1.0
MAX_HANDOFFS = 10_000  # activity tasks measured per tick at most
WAKE_CHECK_S = 0.2  # how often a waiting reservation looks again, whatever it was told


class _Permit(SlotPermit):
    def __init__(self) -> None:
        self.taken_at: float | None = None  # when the slot got its task (mark_slot_used)


@dataclass
class Capacity:
    """How many episodes the worker holds at most (its window), and what set it."""

    window: int = 8
    floor: int = 2
    ceiling: int = 1000
    # Workflow tasks at once, all kinds: the window bounds what comes in from the shared queue,
    # this what the loop is asked to hold at once, whoever asks.
    limit: int = 16
    limit_floor: int = 4
    limit_ceiling: int = 100
    # Taken to completed includes the completion's round trip: a slow server shows here too.
    task_target_s: float = 1.0  # a tenth of the default workflow-task timeout (10 s)
    lag_target_s: float = 0.5  # heartbeats leave every second; a 5 s timeout must never see a late one
    # How long the activity tasks the worker received had waited since the server handed them
    # out (their heartbeat clocks run from then). Reported, not a limit: shedding new episodes
    # on it past a quarter of the heartbeat timeout made N=200 slower (168-176 s against
    # 143-166 s) and did not bring it down (BENCHMARKS.md, "Overload on 2026-11-29").
    # what the last tick measured
    task_s: float = 0.0
    lag_s: float = 0.0
    handoff_s: float = 0.0
    overloaded: bool = False
    cuts: int = 0
    held_back: int = 0  # reservations from the shared queue that waited to be admitted
    admitted: int = 0

    live: int = 0

    def adjust(
        self,
        task_s: float,
        lag_s: float,
        live: int,
        wanted_more: bool,
        wanted_slots: bool = False,
        handoff_s: float = 0.0,
    ) -> None:
        """One tick: past a target, a window of two thirds of what is held (or of the window,
        if less) and a limit of two thirds; below half of both, a tenth more of either when
        more waited for it. The activity hand-off is recorded for `describe`."""
        self.task_s, self.lag_s, self.live, self.handoff_s = task_s, lag_s, live, handoff_s
        self.overloaded = task_s > self.task_target_s or lag_s > self.lag_target_s
        if self.overloaded:
            self.window = max(self.floor, min(self.window, live) * 2 // 3)
            self.limit = max(self.limit_floor, self.limit * 2 // 3)
            self.cuts += 1
        elif task_s < self.task_target_s / 2 and lag_s < self.lag_target_s / 2:
            if wanted_more:
                self.window = min(self.ceiling, self.window + max(1, self.window // 10))
            if wanted_slots:
                self.limit = min(self.limit_ceiling, self.limit + max(1, self.limit // 10))

    def describe(self) -> str:
        return (
            f"{self.live} episodes held, window {self.window}, {self.limit} tasks at once "
            f"(cut {self.cuts} times; "
            f"{self.admitted} tasks admitted from the shared queue, {self.held_back} waited), "
            f"tasks {self.task_s:.2f} s, lag {self.lag_s:.2f} s, activity hand-off {self.handoff_s:.2f} s"
        )


class AdmittingWorkflowSlots(CustomSlotSupplier):
    """Workflow-task slots: up to `capacity.limit` at once; a reservation marked not sticky
    also needs the worker to hold fewer episodes than its window, and to be below its
    targets (see the module's docstring). `live` counts the episodes held; unset, those
    admitted since the last tick count.

    The SDK may call `try_reserve_slot`, `mark_slot_used` and `release_slot` from its own
    threads: the counts are guarded by a thread lock, and waiters are woken through the event
    loop. `run` measures, on the loop, and must run while the worker does; unmeasured, the
    window stays at its first value."""

    def __init__(self, ceiling: int, capacity: Capacity | None = None) -> None:
        self.capacity = capacity or Capacity(limit_ceiling=ceiling)
        self.live: Callable[[], int] = lambda: 0  # episodes held (the worker's cache), once it runs
        self._guard = threading.Lock()
        self._used = 0
        self._held = 0  # episodes held at the last tick, plus those admitted since
        self._durations: list[float] = []  # of tasks completed since the last tick
        # How long activity tasks received since the last tick had waited; bounded, in case
        # nothing ticks (a worker built without `run`).
        self._handoffs: collections.deque[float] = collections.deque(maxlen=MAX_HANDOFFS)
        self._waited = False  # a shared-queue reservation found no admission since the last tick
        self._short = False  # a reservation found every slot taken since the last tick
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Future[None] | None = None

    def _take(self, sticky: bool) -> bool:
        with self._guard:
            if self._used >= self.capacity.limit:
                self._short = True
                return False
            if not sticky:
                if self.capacity.overloaded or self._held >= self.capacity.window:
                    self._waited = True
                    return False
                self._held += 1
                self.capacity.admitted += 1
            self._used += 1
            return True

    async def reserve_slot(self, ctx: SlotReserveContext) -> SlotPermit:
        self._loop = asyncio.get_running_loop()
        counted = False
        while not self._take(ctx.is_sticky):
            if not counted and not ctx.is_sticky:
                counted = True
                self.capacity.held_back += 1
            if self._wake is None or self._wake.done():
                self._wake = self._loop.create_future()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(WAKE_CHECK_S):  # admissions also come with a tick
                    await asyncio.shield(self._wake)
        return _Permit()

    def try_reserve_slot(self, ctx: SlotReserveContext) -> SlotPermit | None:
        return _Permit() if self._take(ctx.is_sticky) else None

    def mark_slot_used(self, ctx: SlotMarkUsedContext) -> None:
        if isinstance(ctx.permit, _Permit):
            ctx.permit.taken_at = time.monotonic()

    def release_slot(self, ctx: SlotReleaseContext) -> None:
        taken_at = getattr(ctx.permit, "taken_at", None)
        with self._guard:
            self._used -= 1
            if taken_at is not None:
                self._durations.append(time.monotonic() - taken_at)
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._wake_waiters)

    def _wake_waiters(self) -> None:
        wake, self._wake = self._wake, None
        if wake is not None and not wake.done():
            wake.set_result(None)

    def saw_handoff(self, waited_s: float) -> None:
        """An activity task reached this worker's code `waited_s` after the server handed it
        out (`HandoffWatch`)."""
        with self._guard:
            self._handoffs.append(waited_s)

    def tick(self, lag_s: float) -> None:
        """Measure the last tick's tasks and the episodes held, and adjust the window."""
        with self._guard:
            durations, self._durations = self._durations, []
            handoffs = sorted(self._handoffs)
            self._handoffs.clear()
            wanted_more, self._waited = self._waited, False
            wanted_slots, self._short = self._short, False
        durations.sort()
        live = self.live()
        was = self.capacity.overloaded
        self.capacity.adjust(_p90(durations), lag_s, live, wanted_more, wanted_slots, _p90(handoffs))
        with self._guard:
            self._held = live
        if self.capacity.overloaded and not was:
            log.warning("overloaded, taking no new episode: %s", self.capacity.describe())
        elif was and not self.capacity.overloaded:
            log.warning("no longer overloaded: %s", self.capacity.describe())
        self._wake_waiters()

    async def run(self) -> None:
        """Every TICK_S: how late the loop woke this task, and how long a job waited for a
        thread of the loop's default executor (every `asyncio.to_thread` of the blob store
        and the REPL host queues there); then `tick`."""
        loop = self._loop = asyncio.get_running_loop()
        while True:
            began = time.monotonic()
            await asyncio.sleep(TICK_S)
            loop_lag = max(0.0, time.monotonic() - began - TICK_S)
            submitted = time.monotonic()
            started = await loop.run_in_executor(None, time.monotonic)
            self.tick(max(loop_lag, started - submitted))


def _p90(ordered: list[float]) -> float:
    """The 90th percentile of sorted values (0 for none)."""
    return ordered[int(0.9 * (len(ordered) - 1))] if ordered else 0.0


class AdmittingActivitySlots(CustomSlotSupplier):
    """Activity-task slots (model calls, audit writes, tools): up to `limit` at once, and none
    new while `overloaded()` says so. A task taken by an overloaded worker would start its
    heartbeat and start-to-close clocks in a queue of work; left on the server, no clock runs
    (a model step has no schedule-to-start timeout)."""

    def __init__(self, limit: int, overloaded: Callable[[], bool]) -> None:
        self.limit = limit
        self.overloaded = overloaded
        self._guard = threading.Lock()
        self._used = 0

    def _take(self) -> bool:
        with self._guard:
            if self._used >= self.limit or self.overloaded():
                return False
            self._used += 1
            return True

    async def reserve_slot(self, ctx: SlotReserveContext) -> SlotPermit:
        while not self._take():
            await asyncio.sleep(WAKE_CHECK_S)
        return SlotPermit()

    def try_reserve_slot(self, ctx: SlotReserveContext) -> SlotPermit | None:
        return SlotPermit() if self._take() else None

    def mark_slot_used(self, ctx: SlotMarkUsedContext) -> None:
        pass

    def release_slot(self, ctx: SlotReleaseContext) -> None:
        with self._guard:
            self._used -= 1


class HandoffWatch(Interceptor):
    """Tells admission how long each activity task waited between the server handing it out
    and this worker's code receiving it: its heartbeat and start-to-close clocks ran all that
    time. At N=200 on one worker that wait was a median 1-2 s and up to 7.5 s while the
    worker's own loop ran on time (BENCHMARKS.md, "Overload on 2026-11-29"), so the loop's lag
    alone did not see it; the SDK's poll on the busy loop was the cause (activity_polls.py),
    and this is how a return of it would show. By this machine's clock against the server's:
    on another machine a clock ahead of the server's reads as a longer wait (NTP keeps it to
    milliseconds)."""

    def __init__(self, slots: AdmittingWorkflowSlots) -> None:
        self.slots = slots

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _HandoffInbound(next, self.slots)


class _HandoffInbound(ActivityInboundInterceptor):
    def __init__(self, next: ActivityInboundInterceptor, slots: AdmittingWorkflowSlots) -> None:
        super().__init__(next)
        self.slots = slots

    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        info = activity.info()
        if not info.is_local:  # a local activity's clock is its workflow task's
            self.slots.saw_handoff(max(0.0, (datetime.now(UTC) - info.started_time).total_seconds()))
        return await super().execute_activity(input)
