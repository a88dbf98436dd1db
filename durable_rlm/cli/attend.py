"""A command that a worker must answer, for one episode: `drlm cancel`, `hint`, `limits`,
`pause`, `finish`, `approve`, `reject`, `reward`.

A Temporal update is answered by the worker that runs the episode; with no worker it
waits for ever. So the command first asks who runs the episode
(durable_rlm/client/attendance.py). A live worker, however busy, is left to answer: the
command waits for it a bounded time and then says that it has not answered yet. With no
live worker and the embedded server, this process runs the episode itself, on the
episode's own task queue (a `drlm run`'s queue dies with it), for as long as the command
needs it; with a cluster's server it says that no worker runs the episode, and what to
start. Every wait is bounded; the command returns within seconds, saying what happened and
what happens next.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from durable_rlm.cli.handlers import polling

if TYPE_CHECKING:
    from durable_rlm.client.attendance import Attendance
    from durable_rlm.server.connection import Services
    from durable_rlm.settings import Settings
    from durable_rlm.worker.runtime import Takes

LOOK_EVERY_S = 1.0
"""How often a waiting command looks again at who runs the episode (a `drlm run` stopped
by Ctrl-C while a cancel waits for it: its lock is free at once)."""
TICK_S = 0.2
"""How often a command running the episode itself asks whether it may take up calls."""
DRAIN_WAIT_S = 10.0
"""How long this process's worker may take to stop once the command is done: a REPL step
it took up runs inside a workflow task, which the SDK does not cancel; past this the
process leaves as a crash would, and the next worker runs the step again from the log."""

CallsAllowed = Callable[[], Awaitable[bool]]


class Attendant:
    """Sees that some worker runs one episode while a command waits on it: a live worker of
    another process, or (embedded, when none) this process's own worker, started on the
    episode's task queue and stopped when the block ends.

    This process's worker takes workflow tasks and REPL steps only: an update is applied at
    once, and the episode's next model call waits for the worker that will run it. With
    `calls_allowed`, a second worker takes activities too, once that says so (a cancel: when
    the calls the episode abandons can no longer be started, durable_rlm/client/cancelling.py)."""

    def __init__(
        self,
        settings: Settings,
        services: Services,
        task_queue: str,
        *,
        calls_allowed: CallsAllowed | None = None,
        on_taking_over: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self.services = services
        self.task_queue = task_queue
        self.calls_allowed = calls_allowed
        self.on_taking_over = on_taking_over  # told when this process's worker starts
        self.here = False  # this process's worker runs the episode
        self.calls = False  # ... and takes its activities too
        self.seen: Attendance | None = None
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> Attendant:
        return self

    async def __aexit__(self, *exc: object) -> None:
        closing = asyncio.ensure_future(self._stack.aclose())
        done, _ = await asyncio.wait({closing}, timeout=DRAIN_WAIT_S)
        if not done:  # the process exits next (os._exit): as a crash, which history survives
            closing.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait({closing}, timeout=1.0)

    async def look(self) -> Attendance:
        """Who runs the episode now; embedded and nobody: this process, from now on."""
        from durable_rlm.client.attendance import attendance  # start-up: temporalio (~0.2 s)

        seen = await attendance(self.services.client, self.task_queue, self.settings.data_dir)
        self.seen = seen
        if seen.unattended and self.settings.embedded and not self.here:
            if self.on_taking_over is not None:
                self.on_taking_over()
            await self._start("workflows")
            self.here = True
        return seen

    async def _start(self, takes: Takes) -> None:
        from durable_rlm.worker.runtime import running_workers  # start-up: the worker's imports (~0.7 s)

        services = polling(self.services, self.task_queue)
        await self._stack.enter_async_context(running_workers(services, takes=takes))

    @property
    def nobody(self) -> bool:
        """No live worker runs the episode, and this process cannot (a cluster's server)."""
        return self.seen is not None and self.seen.unattended and not self.here

    async def wait(self, future: asyncio.Future[Any], wait_s: float | None) -> bool:
        """Wait for `future` up to `wait_s` (None: until done), looking again at who runs the
        episode every LOOK_EVERY_S (its worker may die meanwhile); whether it is done."""
        loop = asyncio.get_running_loop()
        deadline = None if wait_s is None else loop.time() + wait_s
        next_look = loop.time() + LOOK_EVERY_S
        while not future.done():
            left = TICK_S if deadline is None else min(TICK_S, deadline - loop.time())
            if left <= 0:
                return False
            await asyncio.wait({future}, timeout=left)
            if future.done():
                break
            if not self.here and loop.time() >= next_look:
                await self.look()
                next_look = loop.time() + LOOK_EVERY_S
            if self.here and not self.calls and self.calls_allowed is not None and await self.calls_allowed():
                await self._start("activities")
                self.calls = True
        return True

    def who(self) -> str:
        """The live workers that poll the episode's queue, for a message."""
        from durable_rlm.client.attendance import describe_identity  # start-up: loaded by `look`

        alive = [describe_identity(i) for i in self.seen.alive] if self.seen is not None else []
        return ", ".join(alive[:3]) + (f" and {len(alive) - 3} more" if len(alive) > 3 else "")


def let_go(task: asyncio.Future[Any]) -> None:
    """Stop waiting for `task`: cancel it, and take whatever it ends with (the SDK turns a
    cancelled update into an error of its own, which would be logged as never retrieved)."""
    task.cancel()
    task.add_done_callback(lambda done: done.cancelled() or done.exception())
