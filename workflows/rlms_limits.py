"""rlms 0.1.3's limits, as a termination policy: after each iteration, as rlms checks them,
in its order (consecutive errors, then spend, then tokens), with its words.

rlms checks what its run spent after each iteration and raises when it passed a limit
(`max_budget`, `max_tokens`) or when `max_errors` iterations in a row had a failing cell.
Decided here, in workflow code, so replay reaches the same ending; the rlms-compatible
`RLM` raises rlms's exception from the reason (durable_rlm/rlms/limits.py). The spend is
what the providers report (usage.cost), none counting as nothing, as rlms counts it.
Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

from durable_rlm.workflows.termination import (
    ActionResult,
    PolicyContext,
    PolicyDecision,
    PolicyRegistry,
    TerminationPolicy,
)

RLMS_LIMITS_POLICY = "rlms_limits"

ERRORS = "Error threshold exceeded"
BUDGET = "Budget exceeded"
TOKENS = "Token limit exceeded"


@PolicyRegistry.register_termination(RLMS_LIMITS_POLICY)
class RlmsLimitsPolicy(TerminationPolicy):
    """rlms's max_errors, max_budget and max_tokens (each None: no limit)."""

    name = RLMS_LIMITS_POLICY
    description = "Stop where rlms raises: max_errors failing iterations in a row, max_budget, max_tokens"

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        self._errors = 0

    @classmethod
    def get_default_config(cls) -> dict[str, Any]:
        return {"max_errors": None, "max_budget": None, "max_tokens": None}

    def should_terminate(self, result: ActionResult, context: PolicyContext) -> tuple[bool, str | None]:
        return self.decide(result, context).as_tuple()

    def decide(self, result: ActionResult, context: PolicyContext) -> PolicyDecision:
        self._errors = self._errors + 1 if result.action_type == "error" else 0
        settings, metrics = self.settings, context.metrics
        iteration = int(metrics.get("iteration", context.step + 1))
        max_errors = settings.get("max_errors")
        if max_errors is not None and self._errors >= int(max_errors):
            return PolicyDecision(
                True, None, f"{ERRORS}: {self._errors} consecutive errors (limit: {int(max_errors)})"
            )
        budget = settings.get("max_budget")
        spent = float(metrics.get("cost_usd") or 0.0)
        if budget is not None and spent > float(budget):
            return PolicyDecision(
                True,
                None,
                f"{BUDGET} after iteration {iteration}: spent ${spent:.6f} of ${float(budget):.6f} budget",
            )
        limit = settings.get("max_tokens")
        tokens = int(metrics.get("tokens") or 0)
        if limit is not None and tokens > int(limit):
            return PolicyDecision(
                True, None, f"{TOKENS} after iteration {iteration}: {tokens:,} of {int(limit):,} tokens"
            )
        return PolicyDecision(False)

    def reset(self) -> None:
        self._errors = 0
