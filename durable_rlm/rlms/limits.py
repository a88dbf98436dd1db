"""rlms's limits: its exception types (rlm/utils/exceptions.py, same names and attributes, each
also a DurableRLMError), max_errors as a termination policy (decided in the workflow, so it
replays), and which way an episode's end raises which."""

from __future__ import annotations

from typing import Any

from durable_rlm.errors import DurableRLMError
from durable_rlm.workflows.models import EpisodeResult
from durable_rlm.workflows.termination import (
    ActionResult,
    PolicyContext,
    PolicyDecision,
    PolicyRegistry,
    TerminationPolicy,
)

MAX_ERRORS_POLICY = "rlms_max_errors"


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


@PolicyRegistry.register_termination(MAX_ERRORS_POLICY)
class MaxErrorsTerminationPolicy(TerminationPolicy):
    """rlms's max_errors: stop after `max_errors` iterations in a row whose cells raised."""

    name = MAX_ERRORS_POLICY
    description = "Stop after max_errors consecutive iterations with a failing cell (rlms)"

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        self._errors = 0

    @classmethod
    def get_default_config(cls) -> dict[str, Any]:
        return {"max_errors": 1}

    def should_terminate(self, result: ActionResult, context: PolicyContext) -> tuple[bool, str | None]:
        return self.decide(result, context).as_tuple()

    def decide(self, result: ActionResult, context: PolicyContext) -> PolicyDecision:
        self._errors = self._errors + 1 if result.action_type == "error" else 0
        limit = int(self.settings["max_errors"])
        if self._errors < limit:
            return PolicyDecision(False)
        return PolicyDecision(
            True, None, f"Error threshold exceeded: {self._errors} consecutive errors (limit: {limit})"
        )

    def reset(self) -> None:
        self._errors = 0


def raise_for_limit(
    result: EpisodeResult,
    elapsed: float,
    *,
    max_timeout: float | None,
    max_tokens: int | None,
    max_budget: float | None,
    max_errors: int | None,
) -> None:
    """rlms raises where its limits stop a run; max_iterations answers (rlms's default
    answer is our fallback extraction)."""
    partial = result.answer
    if result.ended_by == "max_duration" and max_timeout is not None:
        raise TimeoutExceededError(elapsed, max_timeout, partial, f"Timeout exceeded: {result.stop_reason}")
    if result.ended_by == "max_tokens" and max_tokens is not None:
        raise TokenLimitExceededError(
            result.usage.total_tokens,
            max_tokens,
            partial,
            f"Token limit exceeded: {result.usage.total_tokens:,} of {max_tokens:,} tokens "
            f"({result.stop_reason})",
        )
    if result.ended_by == "max_cost_usd" and max_budget is not None:
        spent = (result.usage.cost_usd or 0.0) + result.unaccounted_cost_usd
        raise BudgetExceededError(spent, max_budget)
    decision = result.termination
    if result.ended_by == "policy" and decision is not None and "Error threshold exceeded" in decision.reason:
        raise ErrorThresholdExceededError(
            int(max_errors or 0),
            int(max_errors or 0),
            None,
            partial,
            decision.reason.split(": ", 1)[-1] if ": " in decision.reason else decision.reason,
        )
    if result.ended_by == "cancelled":
        raise CancellationError(partial, result.stop_reason or None)
