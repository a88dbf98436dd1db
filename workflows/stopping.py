"""How an episode's loop is stopped: a cancel request, the durable timer, or Temporal.

The loop races the timer and a person's `cancel` (workflows/episode.py `_episode`); the one
that wins cancels the loop. A step's handle absorbs a cancel that arrives in the activation
that also brings the step's result (the result wins), and the loop would go on. So the
cancel also sticks: the loop ends itself at its next boundary or wait (`halt_if_stopping`,
`until`).

After the loop: closing (a cancel request would change nothing), then finished.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from durable_rlm.workflows.models import CancelReceipt, CancelRequest


class Stopping:
    """Where the episode is on its way to the end; the loop's stop and the waits that obey it."""

    def __init__(self) -> None:
        self.cancel: CancelRequest | None = None  # a person's cancel update
        self.stopping = False  # the loop is being cancelled: a request, the timer, Temporal
        self.halting = False  # until the loop has ended, it stops itself at its next boundary or wait
        self.closing = False  # the loop is over: a cancel request would change nothing
        self.finished = False

    def over(self) -> bool:
        """Ended or closing: an update would change nothing."""
        return self.finished or self.closing

    # --- the cancel update --------------------------------------------------------------

    def refuse_cancel(self) -> None:
        if self.over():
            raise ValueError("the episode has already ended or is closing; nothing was changed")
        if self.cancel is not None:
            raise ValueError("the episode is already being cancelled")

    def request_cancel(self, request: CancelRequest, episode_id: str, iteration: int) -> CancelReceipt:
        self.cancel = request
        return CancelReceipt(episode_id=episode_id, iteration=iteration, extract=request.extract)

    # --- stopping the loop ----------------------------------------------------------------

    async def stop_loop(self, loop: asyncio.Future[Any], *rest: asyncio.Future[Any]) -> None:
        """Cancel the loop (and `rest`, after it: the order of the commands is history's)
        and wait until the loop has ended; what follows it (extraction, closing) runs on."""
        self.stopping = self.halting = True
        loop.cancel()
        for other in rest:
            other.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
        self.halting = False  # what runs after the loop (extraction, closing) is not halted

    def halted(self) -> bool:
        return self.halting

    def halt_if_stopping(self) -> None:
        """Where the loop goes on after a step: end it here if it is being cancelled."""
        if self.halted():
            raise asyncio.CancelledError()

    async def until(self, condition: Callable[[], bool]) -> None:
        """Wait for `condition`, or for the loop to be stopped (then end it)."""
        await workflow.wait_condition(lambda: condition() or self.halted())
        self.halt_if_stopping()
