"""A person steering a running episode: the pure parts the workflow's updates use.

Every action is a Temporal update (workflows/episode.py): validated before it is accepted
(a refused one writes nothing to history), recorded in history with its sender, applied
at the next step boundary, and replayed like any other event. This module holds what
those updates compute: the text a hint becomes, the limits a change yields, whether a
cell must wait for approval. All of it is deterministic and linear in its input.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from durable_rlm.workflows import defaults
from durable_rlm.workflows.models import (
    ActionRecord,
    ApproveMode,
    CellDecision,
    EpisodeLimits,
    EpisodeRequest,
    LimitsUpdate,
    Message,
)
from durable_rlm.workflows.risk import assess

HINT_TURN = "A hint from {sender}, the person supervising this episode:\n{text}"
CELL_REJECTED = "Not run: {sender} rejected this cell before it ran. Their reason: {reason}"
CELLS_SKIPPED = (
    "The code blocks after cell {cell} in your reply were not run, because {sender} rejected "
    "cell {cell}. Take their reason into account and continue."
)
CELL_EDITED = (
    "Cell {cell} was edited by {sender} before it ran: the code shown for it above is the code "
    "that ran (and that the REPL state follows), not the code you wrote."
)


def with_hints(pending: list[Message], hints: list[Message]) -> list[Message]:
    """The next turn with the hints added: to the user message already waiting (providers
    that require alternating roles keep working), else as a user message of their own."""
    if not hints:
        return pending
    text = "\n\n".join(h.content for h in hints)
    if pending and pending[-1].role == "user":
        last = pending[-1]
        return [*pending[:-1], Message(role="user", content=f"{last.content}\n\n{text}")]
    return [*pending, Message(role="user", content=text)]


def hint_message(sender: str, text: str) -> Message:
    return Message(role="user", content=HINT_TURN.format(sender=sender, text=text))


def limits_problem(request: EpisodeRequest, update: LimitsUpdate) -> str | None:
    """Why this change of limits is refused, or None. The change itself is checked by its
    model (positive numbers); here what depends on the episode."""
    changes = update.changes()
    if not changes:
        return "no limit was given; nothing to change"
    if "max_cost_usd" in changes:
        unpriced = sorted(request.uncosted_models())  # the request's own check, one truth
        if unpriced:
            return (
                "max_cost_usd needs a price for every model the episode can call; "
                f"none for {', '.join(unpriced)}"
            )
    return None


def changed_limits(limits: EpisodeLimits, update: LimitsUpdate) -> EpisodeLimits:
    """The limits with the update applied, validated as a whole (model_copy would not)."""
    return EpisodeLimits.model_validate({**limits.model_dump(), **update.changes()})


def moved_deadline(deadline: datetime, old: timedelta, new: timedelta, cap: datetime | None) -> datetime:
    """The deadline after max_duration changes: still counted from the same start (a
    child's never passes its parent's)."""
    moved = deadline - old + new
    return moved if cap is None else min(moved, cap)


def describe_changes(update: LimitsUpdate, before: EpisodeLimits) -> str:
    parts = []
    for name, value in update.changes().items():
        old = getattr(before, name)
        if isinstance(value, timedelta):
            value, old = f"{value.total_seconds():g} s", f"{old.total_seconds():g} s"
        parts.append(f"{name} {old} -> {value}")
    return ", ".join(parts)


def gate(mode: ApproveMode, code: str) -> list[str] | None:
    """Whether a cell waits for approval: None if it runs at once, else the risk reasons
    recorded with it (empty when every cell waits and this one raised no flag)."""
    if mode == "none":
        return None
    reasons = assess(code)
    if mode == "risky" and not reasons:
        return None
    return reasons


def describe_decision(decision: CellDecision) -> tuple[str, str]:
    """(kind, detail) of a decision for the action log."""
    if not decision.approve:
        return "reject", f"cell {decision.cell}: {decision.reason}"
    if decision.code is not None:
        return "edit", f"cell {decision.cell} approved as edited ({len(decision.code)} chars)"
    return "approve", f"cell {decision.cell}" + (f": {decision.reason}" if decision.reason else "")


def keep_latest(actions: list[ActionRecord]) -> list[ActionRecord]:
    return actions[-defaults.AUDITED_ACTIONS :]
