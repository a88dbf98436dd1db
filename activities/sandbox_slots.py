"""How many sandboxes one worker may hold, and what happens at the limit.

A worker holds at most `limit` live (or starting) sandboxes. A step that needs a new one
when all are taken first evicts an idle sandbox (least recently used; one whose cell is not
suspended on calls first): its episode's next step rebuilds it from the log. When none is
idle (every sandbox is running a step), the step waits for one to finish, and meanwhile
the worker stops taking workflow tasks it does not already hold (`WorkflowSlots`), so new
episodes and episodes moving between workers go to other workers instead of growing this
one's memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from temporalio.exceptions import ApplicationError, ApplicationErrorCategory
from temporalio.worker import (
    CustomSlotSupplier,
    SlotMarkUsedContext,
    SlotPermit,
    SlotReleaseContext,
    SlotReserveContext,
)

from durable_rlm.workflows import defaults, names

log = logging.getLogger(__name__)


def memory_limit_bytes() -> int:
    """The memory this worker's processes may use: the cgroup's limit when it has one (a
    container), else the host's RAM."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            text = Path(path).read_text().strip()
            if text != "max" and int(text) < 1 << 60:  # cgroup v1 says "no limit" with a huge number
                return int(text)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_max_sandboxes(memory_bytes: int | None = None) -> int:
    """Three quarters of the worker's memory, at `SANDBOX_SLOT_MB` per sandbox (at least
    `MIN_SANDBOXES`): the rest is the worker's own (its workflow cache, payloads)."""
    memory = memory_limit_bytes() if memory_bytes is None else memory_bytes
    per_sandbox = defaults.SANDBOX_SLOT_MB * 1024 * 1024
    return max(defaults.MIN_SANDBOXES, (memory * 3 // 4) // per_sandbox)


class SandboxesBusy(ApplicationError):
    """Every sandbox of this worker ran a step for the whole wait. The workflow asks for the
    step again without counting it as an attempt (workflows/repl_steps.py)."""

    def __init__(self, limit: int, waited_s: float) -> None:
        super().__init__(
            f"this worker holds its limit of {limit} sandboxes (DRLM_MAX_SANDBOXES), all running "
            f"steps, for {waited_s:g} s; the step is asked again",
            type=names.SANDBOXES_BUSY,
            category=ApplicationErrorCategory.BENIGN,  # expected under load: the SDK logs it quietly
        )


class SandboxSlots:
    """Counts the sandboxes starting; `live` counts the running ones. `evict_idle(sparing)`
    discards one idle sandbox of another episode and says whether it did."""

    def __init__(
        self,
        limit: int,
        live: Callable[[], int],
        evict_idle: Callable[[str], Awaitable[bool]],
        wait_s: float = defaults.SANDBOX_SLOT_WAIT_S,
    ) -> None:
        if limit < 1:
            raise ValueError(f"max_sandboxes must be at least 1, not {limit}")
        self.limit = limit
        self.wait_s = wait_s
        self._live = live
        self._evict_idle = evict_idle
        self._starting = 0
        self._waiting = 0
        self._wake: asyncio.Future[None] | None = None
        self.evictions = 0  # idle sandboxes discarded to make room
        self.waits = 0  # steps that waited for a sandbox to finish its step
        self.busy = 0  # waits that ran out (the step was asked again)

    @property
    def saturated(self) -> bool:
        """Steps are waiting for a sandbox: take no new episodes."""
        return self._waiting > 0

    @property
    def waiting(self) -> int:
        return self._waiting

    def held(self) -> int:
        return self._live() + self._starting

    def freed(self) -> None:
        """A sandbox finished a step or closed: waiting steps look again."""
        wake, self._wake = self._wake, None
        if wake is not None and not wake.done():
            wake.set_result(None)

    @contextlib.asynccontextmanager
    async def starting(self, episode_id: str) -> AsyncIterator[None]:
        """Held while `episode_id`'s sandbox starts: the caller puts it among the live ones
        before leaving the block (or it failed to start)."""
        await self._admit(episode_id)
        try:
            yield
        finally:
            self._starting -= 1
            self.freed()

    async def _admit(self, episode_id: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        waited = False
        while self.held() >= self.limit:
            if await self._evict_idle(episode_id):
                self.evictions += 1
                continue
            remaining = deadline - loop.time()
            if remaining <= 0:
                self.busy += 1
                raise SandboxesBusy(self.limit, self.wait_s)
            if not waited:
                waited = True
                self.waits += 1
                log.info("episode %s waits for a sandbox: all %d are running steps", episode_id, self.limit)
            self._waiting += 1
            try:
                await self._next_change(min(remaining, 1.0))  # and look again at least every second
            finally:
                self._waiting -= 1
        self._starting += 1

    async def _next_change(self, timeout: float) -> None:
        if self._wake is None:
            self._wake = asyncio.get_running_loop().create_future()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await asyncio.shield(self._wake)


class WorkflowSlots(CustomSlotSupplier):
    """Workflow-task slots (at most `limit` at once) that are not handed to a non-sticky poll
    while this worker's sandboxes are saturated. Sticky polls bring tasks of episodes this
    worker already runs (their sandboxes are here) and go on; a non-sticky task would be a
    new episode or one moving in, that would need a sandbox this worker cannot give.

    The SDK may call `try_reserve_slot` and `release_slot` from its own threads: the count
    is guarded by a thread lock, and waiters are woken through the event loop."""

    def __init__(self, limit: int, sandboxes: SandboxSlots) -> None:
        self.limit = limit
        self.sandboxes = sandboxes
        self._used = 0
        self._guard = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Future[None] | None = None
        self.held_back = 0  # non-sticky polls that waited for the sandboxes

    def _take(self, sticky: bool) -> bool:
        with self._guard:
            if self._used >= self.limit or (not sticky and self.sandboxes.saturated):
                return False
            self._used += 1
            return True

    async def reserve_slot(self, ctx: SlotReserveContext) -> SlotPermit:
        self._loop = asyncio.get_running_loop()
        counted = False
        while not self._take(ctx.is_sticky):
            if not counted and not ctx.is_sticky and self.sandboxes.saturated:
                counted = True
                self.held_back += 1
            if self._wake is None:
                self._wake = self._loop.create_future()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.2):  # saturation ends without telling us
                    await asyncio.shield(self._wake)
        return SlotPermit()

    def try_reserve_slot(self, ctx: SlotReserveContext) -> SlotPermit | None:
        return SlotPermit() if self._take(ctx.is_sticky) else None

    def mark_slot_used(self, ctx: SlotMarkUsedContext) -> None:
        return None

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
