"""The episode's durable timer: max_duration, on the server (it fires while no worker runs).

Set again whenever the deadline moves: a person's new max_duration (`set_limits`), or a pause
that holds the clock (`pause --hold-clock`), which stops it until the resume. Each move bumps
`epoch`; a timer that fires for an older epoch is set again instead of ending the episode.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import datetime

from temporalio import workflow

SUMMARY = "max_duration"
"""The timer's name in the Temporal UI's timeline (it showed as "1")."""


class DeadlineTimer:
    """`run` returns when the deadline has passed; `move` says it changed."""

    def __init__(self, deadline: Callable[[], datetime], held: Callable[[], bool]) -> None:
        self.deadline = deadline  # read each time: a new max_duration moves it
        self.held = held  # a pause that holds the clock
        self.epoch = 0

    def move(self) -> None:
        self.epoch += 1

    async def run(self) -> None:
        while True:
            if self.held():
                await workflow.wait_condition(lambda: not self.held())
                continue
            epoch = self.epoch
            remaining = max((self.deadline() - workflow.now()).total_seconds(), 0.001)
            try:
                await workflow.wait_condition(
                    functools.partial(self._moved, epoch), timeout=remaining, timeout_summary=SUMMARY
                )
            except TimeoutError:
                if self.epoch == epoch:
                    return

    def _moved(self, epoch: int) -> bool:
        return self.epoch != epoch or self.held()
