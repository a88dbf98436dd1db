"""Admission by measured capacity: how many episodes one worker process holds at once.

A worker process runs every workflow activation, model call, REPL step and audit write of
its episodes on one event loop, one core (the GIL). Each episode it holds costs it work at
every step until the episode ends. Past its capacity the work of the episodes it holds
waits inside it while their clocks run: an activation answered late lets its workflow task
time out (and its work be thrown away), a heartbeat sent late lets the server give up a live
call. A task that waits on the server costs nothing: its clock starts when a worker takes
it (no schedule-to-start timeout on the shared queue).

So the worker holds a window of episodes and takes a task from the shared queue (a new
episode, or one moving in) only while it holds fewer, and while it is not overloaded.
Each second it measures:
- how busy the process was: its CPU time over the second, against one core;
- how late its event loop ran a timer, and how long a job waited for a thread of the loop's
  executor: everything the worker does waits on one or the other.
Over `busy_high` of a core or `lag_high_s` late, the worker is overloaded: it takes nothing
new from the shared queue and its window becomes nine tenths of what it holds. Below
`busy_low` and `lag_low_s`, with tasks waiting for room, the window grows toward what it
could hold at `busy_target` if each episode held costs what those held cost now (at most a
quarter more each second: the cost of an episode just admitted shows within a second or
two, and a worker far below its capacity still reaches it in seconds). The episodes it already
holds are served whatever the window: their tasks (sticky, from this worker's own queue)
always find a slot up to the worker's cache size, so none waits past its sticky
schedule-to-start timeout for want of one. Nothing here deadlocks: tasks of held episodes wait
for no window, and the window comes back as held episodes end.

Remote activities (a model call when an episode runs them as activities, a tool) are
shed the same way (`AdmittingActivitySlots`): an overloaded worker polls for none, and a
call it would start late, with its heartbeat clock already running, waits on the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from temporalio.worker import (
    CustomSlotSupplier,
    SlotMarkUsedContext,
    SlotPermit,
    SlotReleaseContext,
    SlotReserveContext,
)

log = logging.getLogger(__name__)

TICK_S = 1.0
WAKE_CHECK_S = 0.2  # how often a waiting reservation looks again, whatever it was told


@dataclass
class Capacity:
    """How many episodes the worker holds at most (its window), and what set it."""

    window: int = 32
    floor: int = 2
    ceiling: int = 1000  # the worker's cache: an episode held is an episode cached
    busy_high: float = 0.9  # of one core: past it, overloaded
    busy_target: float = 0.8
    busy_low: float = 0.7
    # Heartbeats leave every second against a 5 s timeout, workflow tasks have a few seconds:
    # a loop this late is the first sign that they will not.
    lag_high_s: float = 0.5
    lag_low_s: float = 0.1
    # what the last tick measured
    busy: float = 0.0
    lag_s: float = 0.0
    held: int = 0
    overloaded: bool = False
    cuts: int = 0
    held_back: int = 0  # reservations from the shared queue that waited to be admitted
    admitted: int = 0

    def adjust(self, busy: float, lag_s: float, held: int, wanted_more: bool) -> None:
        """One tick (see the module's docstring)."""
        self.busy, self.lag_s, self.held = busy, lag_s, held
        self.overloaded = busy > self.busy_high or lag_s > self.lag_high_s
        if self.overloaded:
            self.window = max(self.floor, min(self.window, held) * 9 // 10)
            self.cuts += 1
        elif wanted_more and busy < self.busy_low and lag_s < self.lag_low_s:
            # What it could hold at the target, if each episode held costs what they cost now.
            room = int(held * self.busy_target / max(busy, 0.01)) if held else self.window
            self.window = min(self.ceiling, max(self.window + 1, min(room, self.window * 5 // 4)))

    def describe(self) -> str:
        return (
            f"{self.held} episodes held, window {self.window} (cut {self.cuts} times; "
            f"{self.admitted} tasks admitted from the shared queue, {self.held_back} waited), "
            f"busy {self.busy:.0%} of a core, lag {self.lag_s:.2f} s"
        )


class _Permit(SlotPermit):
    pass


class AdmittingWorkflowSlots(CustomSlotSupplier):
    """Workflow-task slots: a reservation from this worker's own (sticky) queue is granted up
    to `ceiling`; one from the shared queue also needs the worker to hold fewer episodes than
    its window, and not to be overloaded (see the module's docstring). `live` counts the
    episodes held; unset, those admitted since the last tick count.

    The SDK may call `try_reserve_slot`, `mark_slot_used` and `release_slot` from its own
    threads: the counts are guarded by a thread lock, and waiters are woken through the event
    loop. `run` measures, on the loop, and must run while the worker does; unmeasured, the
    window stays at its first value."""

    def __init__(self, ceiling: int, capacity: Capacity | None = None) -> None:
        self.ceiling = ceiling
        self.capacity = capacity or Capacity(ceiling=ceiling)
        self.live: Callable[[], int] = lambda: 0  # episodes held (the worker's cache), once it runs
        self._guard = threading.Lock()
        self._used = 0
        self._held = 0  # episodes held at the last tick, plus those admitted since
        self._waited = False  # a shared-queue reservation found no admission since the last tick
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Future[None] | None = None
        self._cpu = time.process_time()
        self._at = time.monotonic()

    def _take(self, sticky: bool) -> bool:
        with self._guard:
            if self._used >= self.ceiling:
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
        pass

    def release_slot(self, ctx: SlotReleaseContext) -> None:
        with self._guard:
            self._used -= 1
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._wake_waiters)

    def _wake_waiters(self) -> None:
        wake, self._wake = self._wake, None
        if wake is not None and not wake.done():
            wake.set_result(None)

    def busy(self) -> float:
        """The process's CPU time since the last look, as a share of one core's."""
        cpu, at = time.process_time(), time.monotonic()
        share = (cpu - self._cpu) / max(at - self._at, 1e-3)
        self._cpu, self._at = cpu, at
        return share

    def tick(self, lag_s: float, busy: float | None = None) -> None:
        """Measure the last tick's load and the episodes held, and adjust the window."""
        busy = self.busy() if busy is None else busy
        with self._guard:
            wanted_more, self._waited = self._waited, False
        live = self.live()
        was = self.capacity.overloaded
        self.capacity.adjust(busy, lag_s, live, wanted_more)
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
        self.busy()
        while True:
            began = time.monotonic()
            await asyncio.sleep(TICK_S)
            loop_lag = max(0.0, time.monotonic() - began - TICK_S)
            submitted = time.monotonic()
            started = await loop.run_in_executor(None, time.monotonic)
            self.tick(max(loop_lag, started - submitted))


class AdmittingActivitySlots(CustomSlotSupplier):
    """Activity-task slots (remote activities: model calls of episodes that run them as
    activities, tools): up to `limit`, and none new while `overloaded()` says so. A task
    taken by an overloaded worker would start its heartbeat clock in a queue of work."""

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
        return _Permit()

    def try_reserve_slot(self, ctx: SlotReserveContext) -> SlotPermit | None:
        return _Permit() if self._take() else None

    def mark_slot_used(self, ctx: SlotMarkUsedContext) -> None:
        pass

    def release_slot(self, ctx: SlotReleaseContext) -> None:
        with self._guard:
            self._used -= 1
