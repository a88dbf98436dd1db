"""What a person's steering left for the loop: the workflow's steering state in one object.

The updates (workflows/episode.py) are validated, then put their effect here; the loop reads
it at its step boundaries (`_checkpoint`, `_approved`). Actions are numbered and kept (the
latest `defaults.PROGRESS_ACTIONS` for progress, all since the last write for the audit
row); a continue-as-new carries the latest and the count. Pure state and the checks that
read only it: no I/O, nothing that is not deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from durable_rlm.workflows import defaults, steering
from durable_rlm.workflows.models import (
    ActionRecord,
    CellDecision,
    FinishUpdate,
    Message,
    PauseUpdate,
    PendingCell,
)


@dataclass
class SteeringInbox:
    actions: list[ActionRecord] = field(default_factory=list)
    actions_total: int = 0
    hints: list[Message] = field(default_factory=list)  # read by the model on its next turn
    held: PauseUpdate | None = None  # paused: the loop holds at its next boundary
    held_since: datetime | None = None
    finish: FinishUpdate | None = None  # answer now: the loop ends at its next boundary
    pending_cell: PendingCell | None = None  # the cell waiting for approval
    decision: CellDecision | None = None  # a person's decision on it, until the loop reads it

    def record(self, kind: str, sender: str, detail: str, at: datetime, iteration: int) -> int:
        """Log an accepted action; its number."""
        self.actions_total += 1
        self.actions.append(
            ActionRecord(
                number=self.actions_total,
                kind=kind,
                sender=sender,
                at=at,
                iteration=iteration,
                detail=detail[: defaults.REWARD_NOTE_CHARS],
            )
        )
        self.actions = steering.keep_latest(self.actions)
        return self.actions_total

    def carry_over(self, actions: list[ActionRecord], total: int, hints: list[Message]) -> None:
        """A new run's inbox: what the last run carried, before what arrived since it began
        (actions that came early were numbered from 1: they follow the carried ones)."""
        for early in self.actions:
            early.number += total
        self.actions[:0] = actions
        self.actions_total += total
        self.hints[:0] = hints

    def gate_moved(self) -> bool:
        """A waiting cell's wait is over: decided, answer now, or paused (it waits on, held)."""
        return self.decision is not None or self.finish is not None or self.held is not None

    def held_description(self) -> str:
        held = self.held
        assert held is not None
        return f"paused by {held.sender}" + (f": {held.reason}" if held.reason else "")

    def pause_refusal(self) -> str | None:
        if self.held is not None:
            return f"it is already paused (by {self.held.sender})"
        if self.finish is not None:
            return "it was asked to answer now; there is nothing to pause"
        return None

    def finish_refusal(self) -> str | None:
        if self.finish is not None:
            return f"it was already asked to answer now (by {self.finish.sender})"
        return None

    def decision_refusal(self, decision: CellDecision) -> str | None:
        waiting = self.pending_cell
        if waiting is None or self.decision is not None:
            return "no cell waits for approval"
        if decision.cell != waiting.cell:
            return f"cell {decision.cell} does not wait for approval; cell {waiting.cell} does"
        return None
