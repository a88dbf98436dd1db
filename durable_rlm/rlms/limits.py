"""rlms's limits: its exception types (rlm/utils/exceptions.py, same names and attributes, each
also a DurableRLMError), and which way an episode's end raises which. The limits themselves
are decided in the workflow (workflows/rlms_limits.py), so they replay."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from durable_rlm.errors import DurableRLMError
from durable_rlm.workflows.models import EpisodeResult
from durable_rlm.workflows.rlms_limits import BUDGET, ERRORS, RLMS_LIMITS_POLICY, TOKENS

if TYPE_CHECKING:
    from durable_rlm.audit.timeline import Timeline


class BudgetExceededError(DurableRLMError):
    """Raised when the episode's spend passed max_budget (USD)."""

    def __init__(self, spent: float, budget: float, message: str | None = None):
        self.spent = spent
        self.budget = budget
        super().__init__(message or f"Budget exceeded: spent ${spent:.6f} of ${budget:.6f} budget")


class TimeoutExceededError(DurableRLMError):
    """Raised when the episode ran out of max_timeout seconds."""

    def __init__(
        self, elapsed: float, timeout: float, partial_answer: str | None = None, message: str | None = None
    ):
        self.elapsed = elapsed
        self.timeout = timeout
        self.partial_answer = partial_answer
        super().__init__(message or f"Timeout exceeded: {elapsed:.1f}s of {timeout:.1f}s limit")


class TokenLimitExceededError(DurableRLMError):
    """Raised when the episode's tokens reached max_tokens."""

    def __init__(
        self,
        tokens_used: int,
        token_limit: int,
        partial_answer: str | None = None,
        message: str | None = None,
    ):
        self.tokens_used = tokens_used
        self.token_limit = token_limit
        self.partial_answer = partial_answer
        super().__init__(message or f"Token limit exceeded: {tokens_used:,} of {token_limit:,} tokens")


class ErrorThresholdExceededError(DurableRLMError):
    """Raised when max_errors iterations in a row had a cell that raised."""

    def __init__(
        self,
        error_count: int,
        threshold: int,
        last_error: str | None = None,
        partial_answer: str | None = None,
        message: str | None = None,
    ):
        self.error_count = error_count
        self.threshold = threshold
        self.last_error = last_error
        self.partial_answer = partial_answer
        super().__init__(
            message or f"Error threshold exceeded: {error_count} consecutive errors (limit: {threshold})"
        )


class CancellationError(DurableRLMError):
    """Raised when the episode was cancelled (Ctrl+C cancels it: it does not run on)."""

    def __init__(self, partial_answer: str | None = None, message: str | None = None):
        self.partial_answer = partial_answer
        super().__init__(message or "Execution cancelled by user")


@dataclass(frozen=True)
class Trail:
    """What rlms's limit exceptions carry besides the limit, read from the episode: the last
    root reply before the one that tripped the limit (rlms's `partial_answer`: the best it
    had) and the last failing cell's error (rlms's `last_error`)."""

    partial_answer: str | None = None
    last_error: str | None = None
    last_reply: str | None = None  # the last root reply of all (a timeout's partial answer)


def trail_of(timeline: Timeline) -> Trail:
    replies = [it.response for it in timeline.iterations if it.response and it.response.strip()]
    errors = [cell.error for it in timeline.iterations for cell in it.cells if cell.error]
    return Trail(
        partial_answer=replies[-2] if len(replies) > 1 else None,
        last_error=errors[-1] if errors else None,
        last_reply=replies[-1] if replies else None,
    )


def raise_for_limit(
    result: EpisodeResult,
    elapsed: float,
    trail: Trail,
    *,
    max_timeout: float | None,
    max_tokens: int | None,
    max_budget: float | None,
    max_errors: int | None,
) -> None:
    """rlms raises where its limits stop a run (rlms's limits policy, or the durable timer
    for max_timeout), even when that iteration also answered; max_iterations answers
    (rlms's default answer is our fallback extraction)."""
    reason = _limits_reason(result)
    if result.ended_by == "max_duration" and max_timeout is not None:
        raise TimeoutExceededError(
            elapsed, max_timeout, trail.last_reply, f"Timeout exceeded: {result.stop_reason}"
        )
    if reason.startswith(ERRORS) and max_errors is not None:
        count = int(reason.split(": ", 1)[1].split(" ", 1)[0])
        raise ErrorThresholdExceededError(count, max_errors, trail.last_error, trail.partial_answer, reason)
    if reason.startswith(BUDGET) and max_budget is not None:
        raise BudgetExceededError(_spent(result), max_budget, reason)
    if reason.startswith(TOKENS) and max_tokens is not None:
        raise TokenLimitExceededError(result.usage.total_tokens, max_tokens, trail.partial_answer, reason)
    if result.ended_by == "cancelled":
        raise CancellationError(trail.last_reply, result.stop_reason or None)


def _limits_reason(result: EpisodeResult) -> str:
    """The reason rlms's limits policy gave for stopping the episode ("" if it did not)."""
    decision = result.termination
    if decision is None:
        return ""
    if decision.policy == RLMS_LIMITS_POLICY:
        return decision.reason
    prefix = RLMS_LIMITS_POLICY + ": "  # as one of a composite's policies
    return decision.reason.removeprefix(prefix) if decision.reason.startswith(prefix) else ""


def _spent(result: EpisodeResult) -> float:
    return (result.usage.cost_usd or 0.0) + result.unaccounted_cost_usd
