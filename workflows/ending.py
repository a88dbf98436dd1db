"""How an episode ends, told honestly: who gave the answer, why it stopped, and the
result variant of fallback extraction (docs/behaviour/fallback-extraction.md). Pure; the
workflow adds the counters.

The rules: only the model gives an answer of its own (FINAL, FINAL_VAR, the answer dict,
SUBMIT); a termination policy may stop the episode, and its status message is a stop
reason, never an answer; a limit ends it through one fallback extraction, whose answer is
marked as extracted with its confidence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from durable_rlm.workflows.fallback import (
    ExecutionResult,
    Extracted,
    Failed,
    FallbackReason,
    ParsedExtraction,
    REPLHistoryEntry,
    Stopped,
    Submitted,
    calculate_extraction_confidence,
)
from durable_rlm.workflows.models import AnswerSource, EndReason, FailureCause, TerminationDecision
from durable_rlm.workflows.outcome import IterationOutcome, answer_outputs, answer_text
from durable_rlm.workflows.termination import PolicyDecision
from durable_rlm.workflows.typed_outputs import FieldSpec

CANCELLED = "the episode was cancelled"
TIMED_OUT = "the episode passed its Temporal execution timeout"


@dataclass(frozen=True)
class Ending:
    ended_by: EndReason
    answer: str | None
    source: AnswerSource
    stop_reason: str
    execution: ExecutionResult | None
    policy: str | None = None
    decision: TerminationDecision | None = None
    error: str | None = None
    failure_cause: FailureCause | None = None

    @property
    def confidence(self) -> float | None:
        if self.answer is None or self.execution is None:
            return None
        return self.execution.confidence()


@dataclass(frozen=True)
class LimitReached:
    """A limit came first: the episode ends through fallback extraction."""

    reason: FallbackReason


LIMIT_ENDED_BY: dict[str, EndReason] = {
    "max_iterations": "max_iterations",
    "max_llm_calls": "max_llm_calls",
    "timeout": "max_duration",
    "context_overflow": "context_overflow",
    "cancelled": "cancelled",
    "max_model_calls": "max_model_calls",
    "max_tokens": "max_tokens",
    "max_cost_usd": "max_cost_usd",
    "finish_requested": "finish_requested",
}


def policy_ending(
    outcome: IterationOutcome,
    decision: PolicyDecision,
    policy: str,
    action_type: str,
    fields: list[FieldSpec],
    llm_calls: int,
) -> Ending | None:
    """The ending a policy's decision makes, or None when it lets the episode go on."""
    if not decision.stop:
        return None
    record = TerminationDecision(
        policy=policy,
        step=outcome.iteration - 1,
        reason=decision.reason,
        answer=decision.answer,
        action_type=action_type,
    )
    if outcome.answer is not None:
        model = outcome.answer
        submitted = Submitted(outputs=model.outputs, iterations=outcome.iteration, llm_calls=llm_calls)
        return Ending(
            ended_by=model.kind,
            answer=model.text,
            source="model",
            stop_reason=f"the model answered ({model.kind}); {policy}: {decision.reason}",
            execution=ExecutionResult(variant=submitted),
            policy=policy,
            decision=record,
        )
    found = decision.answer if decision.answer and decision.answer.strip() else None
    outputs = answer_outputs(found, fields) if found is not None else None
    answer = answer_text(outputs, fields) if outputs is not None else None
    stopped = Stopped(
        policy=policy,
        reason=decision.reason,
        outputs=outputs,
        iterations=outcome.iteration,
        llm_calls=llm_calls,
    )
    return Ending(
        ended_by="policy",
        answer=answer,
        source="policy" if answer is not None else "none",
        stop_reason=f"{policy}: {decision.reason}",
        execution=ExecutionResult(variant=stopped),
        policy=policy,
        decision=record,
    )


_FAILED_STEP = {
    "model": "the root model call failed",
    "request": "the root model refused the request",
    "store": "the store failed the root model step",
    "sandbox": "the sandbox failed the root model step",
    "infrastructure": "the infrastructure failed the root model step",
}


def model_error_ending(error: str, cause: FailureCause = "model") -> Ending:
    """A root model step that failed for good, worded after what really failed."""
    what = _FAILED_STEP[cause]
    return Ending(
        ended_by="infrastructure_error" if cause in ("infrastructure", "sandbox", "store") else "model_error",
        answer=None,
        source="none",
        stop_reason=f"{what}: {error}",
        execution=ExecutionResult(variant=Failed(reason=f"{what}: {error}")),
        error=error,
        failure_cause=cause,
    )


def cancelled_ending(why: str) -> Ending:
    return Ending(
        ended_by="cancelled",
        answer=None,
        source="none",
        stop_reason=f"Cancelled: {why}",
        execution=ExecutionResult(variant=Failed(reason=f"Cancelled: {why}")),
    )


def unextracted_ending(reason: FallbackReason, why: str) -> Ending:
    return Ending(
        ended_by=LIMIT_ENDED_BY[reason.kind],
        answer=None,
        source="none",
        stop_reason=f"{reason}; {why}",
        execution=ExecutionResult(variant=Failed(reason=f"{reason}; {why}")),
    )


def extraction_failed_ending(
    reason: FallbackReason, error: str, history: list[REPLHistoryEntry], partial: dict[str, Any] | None = None
) -> Ending:
    failed = Failed(reason=error, partial_outputs=partial, history=history)
    return Ending(
        ended_by=LIMIT_ENDED_BY[reason.kind],
        answer=None,
        source="none",
        stop_reason=f"{reason}; extraction failed: {error}",
        execution=ExecutionResult(variant=failed),
    )


def extraction_ending(
    reason: FallbackReason,
    parsed: ParsedExtraction,
    history: list[REPLHistoryEntry],
    variables: dict[str, str],
    fields: list[FieldSpec],
) -> Ending:
    """Extracted with the extraction's confidence formula, or Failed keeping partial outputs
    (docs/behaviour/fallback-extraction.md, "The result variants")."""
    if parsed.outputs is None:
        return extraction_failed_ending(reason, parsed.error or "extraction failed", history, parsed.partial)
    extracted = Extracted(
        outputs=parsed.outputs,
        confidence=calculate_extraction_confidence(parsed.outputs, history, variables),
        reason=reason,
        extraction_notes=parsed.notes,
    )
    answer = answer_text(parsed.outputs, fields)
    return Ending(
        ended_by=LIMIT_ENDED_BY[reason.kind],
        answer=answer,
        source="extraction" if answer is not None else "none",
        stop_reason=f"{reason}; the answer was extracted from the history",
        execution=ExecutionResult(variant=extracted),
    )
