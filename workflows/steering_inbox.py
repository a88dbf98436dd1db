"""What a person's steering left for the loop: the workflow's steering state in one object.

The updates (declared in workflows/episode.py) are checked here first (`refuse_*`: a refused
one changes nothing and writes nothing to history), then put their effect here; the loop
reads it at its step boundaries (workflows/steering_gate.py). Actions are numbered and kept
(the latest `defaults.PROGRESS_ACTIONS` for progress, all since the last write for the audit
row); a continue-as-new carries the latest and the count. Pure state and the rules that read
it: the workflow passes in the time and where the episode is (`Moment`), so no I/O and
nothing that is not deterministic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from durable_rlm.workflows import defaults, steering
from durable_rlm.workflows.models import (
    ActionRecord,
    CellDecision,
    EpisodeCarry,
    EpisodeRequest,
    FinishUpdate,
    HintUpdate,
    LimitsUpdate,
    Message,
    PauseUpdate,
    PendingCell,
    ResumeUpdate,
    SteeringReceipt,
)


@dataclass(frozen=True)
class Moment:
    """Where an update finds the episode: what the action log and the receipt say."""

    episode_id: str
    at: datetime
    iteration: int


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

    def accept(self, moment: Moment, kind: str, sender: str, detail: str, effect: str) -> SteeringReceipt:
        """Log an action the workflow accepted; the receipt tells the sender what happens."""
        number = self.record(kind, sender, detail, moment.at, moment.iteration)
        return SteeringReceipt(
            episode_id=moment.episode_id,
            iteration=moment.iteration,
            action=number,
            message=f"{kind} accepted at iteration {moment.iteration}: {effect}",
        )

    def gate_moved(self) -> bool:
        """A waiting cell's wait is over: decided, answer now, or paused (it waits on, held)."""
        return self.decision is not None or self.finish is not None or self.held is not None

    def clock_held(self) -> bool:
        """Paused with `--hold-clock`: max_duration stops counting (workflows/deadline.py)."""
        return self.held is not None and self.held.hold_clock

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

    # --- the updates: each refused first if it would change nothing -----------------------

    def refuse_if_over(self, what: str, over: bool) -> None:
        """`over`: the episode has ended or is closing."""
        if over:
            raise ValueError(f"the episode has already ended or is closing; the {what} changed nothing")

    def hint(self, update: HintUpdate, moment: Moment) -> SteeringReceipt:
        """The root model reads it as a user message on its next turn."""
        self.hints.append(steering.hint_message(update.sender, update.text))
        return self.accept(moment, "hint", update.sender, update.text, "the model reads it on its next turn")

    def set_limits(
        self,
        update: LimitsUpdate,
        request: EpisodeRequest | None,
        state: EpisodeCarry | None,
        moment: Moment,
        deadline_moved: Callable[[], None],
    ) -> SteeringReceipt:
        """New limits, from the next step boundary; one already passed ends the episode by
        the normal limit path (fallback extraction)."""
        assert request is not None and state is not None
        before = request.limits
        request.limits = steering.changed_limits(before, update)  # every reader shares the request
        if update.max_duration is not None:
            state.deadline = steering.moved_deadline(
                state.deadline, before.max_duration, update.max_duration, request.deadline
            )
            deadline_moved()  # the durable timer is set again
        detail = steering.describe_changes(update, before)
        return self.accept(moment, "limits", update.sender, detail, f"{detail}, from the next step boundary")

    def refuse_limits(
        self, update: LimitsUpdate, request: EpisodeRequest | None, state: EpisodeCarry | None, over: bool
    ) -> None:
        self.refuse_if_over("limit change", over)
        if request is None or state is None:
            raise ValueError("the episode is starting; send it again in a moment")
        problem = steering.limits_problem(request, update)
        if problem is not None:
            raise ValueError(problem)

    def pause(self, update: PauseUpdate, moment: Moment) -> SteeringReceipt:
        """Hold at the next step boundary, without a sandbox, until `resume`."""
        self.held, self.held_since = update, moment.at
        clock = "max_duration stops counting" if update.hold_clock else "max_duration keeps counting"
        detail = update.reason + (" " if update.reason else "") + f"({clock})"
        return self.accept(
            moment, "pause", update.sender, detail, f"pauses at the next step boundary; {clock}"
        )

    def refuse_pause(self, over: bool) -> None:
        self.refuse_if_over("pause", over)
        if (problem := self.pause_refusal()) is not None:
            raise ValueError(problem)

    def resume(
        self,
        update: ResumeUpdate,
        state: EpisodeCarry | None,
        moment: Moment,
        deadline_moved: Callable[[], None],
    ) -> SteeringReceipt:
        held, since = self.held, self.held_since
        assert held is not None and since is not None
        paused_for = moment.at - since
        if held.hold_clock and state is not None:
            state.deadline += paused_for  # the pause did not count against max_duration
            deadline_moved()
        self.held = self.held_since = None
        detail = f"after {paused_for.total_seconds():.0f} s paused"
        return self.accept(
            moment, "resume", update.sender, detail, "goes on (its REPL is rebuilt from the log)"
        )

    def refuse_resume(self, over: bool, waits_for_key: bool) -> None:
        """`waits_for_key`: a model call waits for a fixed key, which `resume` does not give."""
        self.refuse_if_over("resume", over)
        if self.held is None:
            raise ValueError(
                "it is not paused"
                + ("; it waits for a fixed key (retry_credentials)" if waits_for_key else "")
            )

    def finish_now(self, update: FinishUpdate, moment: Moment) -> SteeringReceipt:
        """Answer now: stop at the next step boundary, then fallback extraction over the
        history so far."""
        self.finish = update
        return self.accept(
            moment, "finish", update.sender, update.reason, "answers by extraction at the next step boundary"
        )

    def refuse_finish(self, over: bool) -> None:
        self.refuse_if_over("finish request", over)
        if (problem := self.finish_refusal()) is not None:
            raise ValueError(problem)

    def decide_cell(self, decision: CellDecision, moment: Moment) -> SteeringReceipt:
        """Approve the waiting cell (as written or edited) or reject it with a reason."""
        self.decision = decision
        kind, detail = steering.describe_decision(decision)
        what = "runs" if decision.approve else "is not run; the model reads the reason"
        return self.accept(moment, kind, decision.sender, detail, f"cell {decision.cell} {what}")

    def refuse_decision(self, decision: CellDecision, over: bool) -> None:
        self.refuse_if_over("decision", over)
        if (problem := self.decision_refusal(decision)) is not None:
            raise ValueError(problem)
