"""The sandboxes one worker holds: at most so many, within a memory budget, idle ones
reaped, each episode's steps one at a time.

An episode's sandbox is only a cache of its cell log (DESIGN invariant 3): any of them may
be discarded when it is idle, and its next step rebuilds it (repl_rebuild.py). So the pool
discards freely: the least recently used idle one when a new episode needs a slot
(sandbox_slots.py) or the live ones hold more than the memory budget, those unused for
`idle_s`, and any a failed step leaves behind. An idle one that takes snapshots is
snapshotted first and its snapshot parked here, so it comes back without re-running cells.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from durable_rlm.activities.live_sandbox import LiveSandbox
from durable_rlm.activities.sandbox_processes import uss_bytes
from durable_rlm.activities.sandbox_reaper import reap_dead
from durable_rlm.activities.sandbox_slots import SandboxSlots, default_max_sandboxes
from durable_rlm.activities.sandbox_start import SandboxConfig, SandboxStarter
from durable_rlm.store.chains import SnapshotTaken

log = logging.getLogger(__name__)

PARKED_MAX = 1_000
"""Snapshots of evicted sandboxes a worker keeps (each a few hundred bytes: the blob is in the store)."""


class StepLock(asyncio.Lock):
    """An episode's lock: held for the length of each of its steps; its release is the
    moment a step has finished, when the memory budget is checked."""

    def __init__(self, on_release: Callable[[], None]) -> None:
        super().__init__()
        self._on_release = on_release

    def idle(self) -> bool:
        """No step holds it or waits for it: acquiring it now does not wait. (Just after a
        release with a step queued, `locked()` is False yet the queued step comes first.)"""
        return not self.locked() and not self._waiters

    def release(self) -> None:
        super().release()
        self._on_release()


@dataclass
class MemoryReport:
    """Unique set sizes in bytes: what each live sandbox alone holds, and the template."""

    sandboxes: dict[str, int]  # episode id -> USS
    template: int | None  # None in spawn mode, or when no template runs

    @property
    def sandboxes_total(self) -> int:
        return sum(self.sandboxes.values())


class SandboxPool:
    """The live sandboxes of this worker by episode, their step locks, and the snapshots of
    evicted ones. `snapshot_idle` snapshots an idle sandbox before it is evicted (None: it
    could not be, or its episode takes none)."""

    def __init__(
        self,
        starter: SandboxStarter,
        config: SandboxConfig,
        sandbox_root: Path,
        max_sandboxes: int | None,
        snapshot_idle: Callable[[LiveSandbox], Awaitable[SnapshotTaken | None]],
    ) -> None:
        self.starter = starter
        self.config = config
        self.sandbox_root = sandbox_root
        self.snapshot_idle = snapshot_idle
        self.live: dict[str, LiveSandbox] = {}
        self.slots = SandboxSlots(
            max_sandboxes or default_max_sandboxes(), lambda: len(self.live), self.evict_idle_one
        )
        self._locks: dict[str, StepLock] = {}
        # Snapshots of evicted sandboxes, off the log: episode -> (log head, snapshot).
        self.parked: dict[str, tuple[str | None, SnapshotTaken]] = {}
        self.budget_task: asyncio.Task[list[str]] | None = None
        self._budget_again = False

    async def close_episode(self, episode_id: str) -> bool:
        """The episode ended: its sandbox, parked snapshot and lock go."""
        async with self.lock(episode_id):
            self.parked.pop(episode_id, None)
            box = self.live.pop(episode_id, None)
            if box is not None:
                await box.kill()
            self._locks.pop(episode_id, None)
            return box is not None

    def reap_dead_sandboxes(self) -> None:
        """Remove the sandbox directories (and kill the processes) of dead workers sharing
        this root, and forget this worker's own ended processes. Never raises: hygiene must
        not stop a worker."""
        try:
            reap_dead(self.sandbox_root)  # stale uid claims too
            self.starter.home.forget_ended()
        except Exception:  # noqa: BLE001 - told, and tried again at the next reap
            log.exception("reaping dead sandboxes under %s failed", self.sandbox_root)

    async def reap_idle(self) -> int:
        """Kill sandboxes unused for `idle_s` (a later step rebuilds them from the log), and
        reap the sandboxes of dead workers."""
        await asyncio.to_thread(self.reap_dead_sandboxes)
        now = time.monotonic()
        stale = [(b, b.last_used) for b in self.live.values() if now - b.last_used > self.config.idle_s]
        reaped = 0
        for box, used in stale:
            # Checked again right before: a step may have taken the episode meanwhile.
            if self.live.get(box.episode_id) is box and self.lock(box.episode_id).idle():
                if await self.evict(box, used):
                    reaped += 1
        return reaped

    async def close_all(self) -> None:
        """Kill every sandbox, and the template (a later step starts a new one)."""
        if self.budget_task is not None:  # first: it may be snapshotting a sandbox to evict
            self.budget_task.cancel()
            with contextlib.suppress(BaseException):
                await self.budget_task
            self.budget_task = None
        for box in list(self.live.values()):
            await self.discard(box)
        self.parked.clear()
        await self.starter.close()

    def live_episodes(self) -> list[str]:
        return sorted(self.live)

    def memory_report(self) -> MemoryReport:
        """USS (Private_Clean + Private_Dirty of /proc/PID/smaps_rollup) of each live sandbox
        and of the template: what discarding each would free."""
        return MemoryReport(sandboxes=self._measure(dict(self.live)), template=self.starter.template_uss())

    @staticmethod
    def _measure(boxes: dict[str, LiveSandbox]) -> dict[str, int]:
        sizes = {}
        for episode_id, box in boxes.items():
            if box.process.returncode is None:
                uss = uss_bytes(box.process.pid)
                if uss is not None:
                    sizes[episode_id] = uss
        return sizes

    async def enforce_memory_budget(self) -> list[str]:
        """Discard idle sandboxes, least recently used first, until the live ones hold no
        more than `memory_budget_mb`; returns the episodes discarded. A sandbox whose
        episode runs a step (its lock held) is never discarded."""
        if self.config.memory_budget_mb is None:
            return []
        budget = self.config.memory_budget_mb * 1024 * 1024
        measured = dict(self.live)
        sizes = await asyncio.to_thread(self._measure, measured)
        total = sum(sizes.values())
        evicted: list[str] = []
        for episode_id in sorted(sizes, key=lambda e: measured[e].last_used):
            if total <= budget:
                break
            box = measured[episode_id]
            if self.live.get(episode_id) is not box or not self.lock(episode_id).idle():
                continue
            if await self.evict(box, box.last_used):
                total -= sizes[episode_id]
                evicted.append(episode_id)
        if evicted:
            log.info(
                "sandbox memory over the %d MB budget: discarded %d idle sandbox(es), %.1f MB now live",
                self.config.memory_budget_mb,
                len(evicted),
                total / 2**20,
            )
        return evicted

    def lock(self, episode_id: str) -> StepLock:
        return self._locks.setdefault(episode_id, StepLock(self.after_step))

    def after_step(self) -> None:
        """A step finished: its sandbox may be evicted for a waiting step; check the memory
        budget in the background (one pass at a time; steps that finish during a pass ask for
        one more)."""
        self.slots.freed()
        if self.config.memory_budget_mb is None:
            return
        if self.budget_task is not None and not self.budget_task.done():
            self._budget_again = True
            return
        self.budget_task = asyncio.get_running_loop().create_task(self._budget_passes())

    async def _budget_passes(self) -> list[str]:
        evicted: list[str] = []
        while True:
            self._budget_again = False
            try:
                evicted += await self.enforce_memory_budget()
            except Exception:  # noqa: BLE001 - a failed pass must not stop later ones
                log.exception("enforcing the sandbox memory budget failed")
            if not self._budget_again:
                return evicted

    @contextlib.asynccontextmanager
    async def discard_on_failure(self, box: LiveSandbox) -> AsyncIterator[None]:
        """A step that raises or is cancelled leaves its sandbox in an unknown state: kill it,
        so the next step rebuilds from the log instead of trusting it."""
        try:
            yield
        except BaseException:
            await asyncio.shield(self.discard(box))
            raise

    async def discard(self, box: LiveSandbox) -> None:
        if self.live.get(box.episode_id) is box:
            del self.live[box.episode_id]
        await box.kill()
        self.slots.freed()

    async def evict_idle_one(self, sparing: str) -> bool:
        """Make room for `sparing`'s sandbox: discard the least recently used idle one (a
        sandbox whose cell waits on calls last: its rebuild re-runs that cell)."""
        idle = [box for box in self.live.values() if box.episode_id != sparing]
        for box in sorted(idle, key=lambda b: (b.cell_index is not None, b.last_used)):
            # Idle now means `evict` takes the lock at once: no step can slip in.
            if self.lock(box.episode_id).idle() and await self.evict(box, box.last_used):
                log.info(
                    "sandbox limit of %d reached: discarded episode %s's idle sandbox for %s",
                    self.slots.limit,
                    box.episode_id,
                    sparing,
                )
                return True
        return False

    async def evict(self, box: LiveSandbox, used: float) -> bool:
        """Discard an idle sandbox to free its memory, parking a snapshot of it first (when
        its episode takes snapshots) so its next step restores it without re-running cells.
        False when a step took the episode meanwhile."""
        episode = box.episode_id
        async with self.lock(episode):
            if self.live.get(episode) is not box or box.last_used != used:
                return False  # discarded, or used by a step, while this waited for the lock
            current = box.snapshot is not None and box.snapshot_head == box.log_head
            try:
                if box.policy is not None and box.cell_index is None and box.process.returncode is None:
                    if current and box.snapshot is not None:
                        self.park(episode, box.log_head, box.snapshot)
                    elif box.last_cell is not None:
                        parked = await self.snapshot_idle(box)
                        if parked is not None:
                            self.park(episode, box.log_head, parked)
            except BaseException:
                # Cancelled (or failed) mid-snapshot: the sandbox's reply may still be on its
                # way, and would answer the episode's next request. It goes, unsnapshotted.
                await asyncio.shield(self.discard(box))
                raise
            await self.discard(box)
            return True

    def park(self, episode: str, head: str | None, snapshot: SnapshotTaken) -> None:
        """Keep an evicted sandbox's snapshot for its next step here; the oldest beyond
        `PARKED_MAX` go (their episodes may have ended elsewhere): those rebuild from the log."""
        self.parked.pop(episode, None)
        self.parked[episode] = (head, snapshot)
        while len(self.parked) > PARKED_MAX:
            del self.parked[next(iter(self.parked))]
