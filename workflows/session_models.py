"""What crosses a persistent session's boundary (workflows/session.py): its start, a turn
asked and answered, its state, its end.

A session's state is small by construction (the REPL's cell-log head, counters, a short
record per turn) so that it survives continue-as-new; the turns' full results stay in their
own episodes (`<session>-turn<k>`).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Literal

from pydantic import Field, field_validator

from durable_rlm.workflows.models import ContextRef, EpisodeRequest, EpisodeResult, ReplState, StrictModel

TurnStatus = Literal["running", "completed", "failed"]
SessionEndedBy = Literal["closed", "idle"]
SESSION_IDLE_TIMEOUT = timedelta(hours=1)
"""A session with no turn for this long ends (a durable timer: it fires with no worker up)."""
TURN_ANSWER_CHARS = 2_000
"""A turn's answer as the session keeps it (the whole answer is in the turn's episode)."""


class SessionStart(StrictModel):
    template: EpisodeRequest = Field(
        description="every turn's request: its settings; the task, context and setup cell are each turn's"
    )
    idle_timeout: timedelta = Field(
        default=SESSION_IDLE_TIMEOUT, description="the session ends after this long without a turn"
    )
    search_attributes: bool = Field(
        default=False, description="the server has the episodes' search attributes: turns start with them"
    )
    turns_per_run: int | None = Field(
        default=None, ge=1, description="continue-as-new after this many turns (None: when Temporal says)"
    )
    carry: SessionCarry | None = Field(default=None, description="set by continue-as-new; leave empty")

    @field_validator("idle_timeout")
    @classmethod
    def _positive(cls, value: timedelta) -> timedelta:
        if value.total_seconds() <= 0:
            raise ValueError("idle_timeout must be positive")
        return value


class TurnRequest(StrictModel):
    turn: int = Field(ge=0, description="the turn the client means: refused if another came first")
    task: str = Field(min_length=1)
    context: ContextRef | None = Field(
        default=None,
        description="while the REPL is empty: its `context` for the whole session (then context_0)",
    )
    setup_code: str | None = Field(
        default=None, description="the turn's first cell: binds context_k and the histories not yet bound"
    )
    context_index: int | None = Field(
        default=None, ge=0, description="the context_k the setup cell binds (None: the turn gives none)"
    )
    history_turns: list[int] = Field(
        default_factory=list,
        description="the turns whose message histories the setup cell binds, in order, as the next history_j",
    )


class TurnRecord(StrictModel):
    turn: int
    episode_id: str
    task: str = Field(description="shortened")
    status: TurnStatus = "running"
    answer: str | None = Field(default=None, description=f"clipped to {TURN_ANSWER_CHARS} characters")
    ended_by: str | None = None
    error: str | None = None
    conversation: str | None = Field(default=None, description="the turn's conversation head (its history)")
    started_at: datetime | None = None
    ended_at: datetime | None = None


class TurnResult(StrictModel):
    turn: int
    episode_id: str
    result: EpisodeResult | None = Field(default=None, description="None: the turn's episode failed")
    error: str | None = None


class SessionCarry(StrictModel):
    seed: int = Field(description="every turn's REPL seed: a rebuild re-runs earlier turns' cells alike")
    context: ContextRef | None = None
    repl: ReplState = Field(default_factory=ReplState)
    contexts: int = Field(default=0, description="context_0 .. context_{contexts-1} are in the REPL")
    histories: int = Field(default=0, description="history_0 .. history_{histories-1} are in the REPL")
    unbound: list[int] = Field(
        default_factory=list, description="turns whose history the REPL lacks: the next turn binds them"
    )
    turns: list[TurnRecord] = Field(default_factory=list)
    touched: datetime = Field(description="when the last turn ended (or the session began): idle since")


class SessionState(StrictModel):
    """The `session` query's answer."""

    session_id: str
    open: bool
    running: int | None = Field(default=None, description="the turn running now")
    closing: str | None = None
    ended_by: SessionEndedBy | None = None
    idle_timeout: timedelta
    contexts: int
    histories: int
    unbound: list[int]
    repl: ReplState
    turns: list[TurnRecord]


class CloseRequest(StrictModel):
    reason: str = "closed by the client"


class SessionEnd(StrictModel):
    session_id: str
    turns: int
    ended_by: SessionEndedBy
    reason: str = ""
    episodes: list[str] = Field(default_factory=list, description="the turns' episode ids, in order")


SessionStart.model_rebuild()
