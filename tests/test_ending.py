"""How an episode ends, told honestly (workflows/ending.py), as pure functions: who gave the
answer, why it stopped, and fallback extraction's result variant, for each way an episode
can end. The endings of running episodes are in tests/test_endings.py."""

from __future__ import annotations

from typing import Any

import pytest

from durable_rlm.workflows.ending import (
    LIMIT_ENDED_BY,
    Ending,
    cancelled_ending,
    extraction_ending,
    extraction_failed_ending,
    model_error_ending,
    policy_ending,
    unextracted_ending,
)
from durable_rlm.workflows.fallback import (
    ExecutionResult,
    Extracted,
    Failed,
    FallbackReason,
    ParsedExtraction,
    REPLHistoryEntry,
    Stopped,
    Submitted,
)
from durable_rlm.workflows.models import TerminationDecision
from durable_rlm.workflows.outcome import IterationOutcome, ModelAnswer
from durable_rlm.workflows.termination import PolicyDecision
from durable_rlm.workflows.typed_outputs import ANSWER_FIELDS, FieldSpec

TYPED = [FieldSpec(name="title"), FieldSpec(name="year", type="integer")]
LIMIT = FallbackReason(kind="max_iterations", value=5, limit=5)
HISTORY = [REPLHistoryEntry(iteration=1, code="print(x)", output="42", success=True)]


# --- the model answered, and a policy agreed ------------------------------------------------------


def test_a_policy_that_lets_the_episode_go_on_makes_no_ending() -> None:
    iteration = IterationOutcome(iteration=3, reply="r", answer=ModelAnswer("42", "final", {"answer": "42"}))
    assert (
        policy_ending(iteration, PolicyDecision(stop=False, answer="x"), "p", "code", ANSWER_FIELDS, 9)
        is None
    )


def test_an_answer_the_model_gave_is_the_models_even_when_a_policy_stopped() -> None:
    answer = ModelAnswer("42", "final_var", {"answer": "42"})
    iteration = IterationOutcome(iteration=3, reply="r", answer=answer)
    decision = PolicyDecision(stop=True, answer="other", reason="done")
    assert policy_ending(iteration, decision, "finish_on_answer", "final", ANSWER_FIELDS, 9) == Ending(
        ended_by="final_var",
        answer="42",
        source="model",
        stop_reason="the model answered (final_var); finish_on_answer: done",
        execution=ExecutionResult(variant=Submitted(outputs={"answer": "42"}, iterations=3, llm_calls=9)),
        policy="finish_on_answer",
        decision=TerminationDecision(
            policy="finish_on_answer", step=2, reason="done", answer="other", action_type="final"
        ),
    )


# --- a policy stopped an episode the model had not answered ---------------------------------------


def stopped(decision: PolicyDecision, fields: list[FieldSpec] = ANSWER_FIELDS) -> Ending | None:
    return policy_ending(IterationOutcome(iteration=4, reply="r"), decision, "reward", "code", fields, 7)


def test_a_policys_answer_is_the_answer_and_its_reason_is_only_the_stop_reason() -> None:
    assert stopped(PolicyDecision(stop=True, answer="42", reason="reward 0.9")) == Ending(
        ended_by="policy",
        answer="42",
        source="policy",
        stop_reason="reward: reward 0.9",
        execution=ExecutionResult(
            variant=Stopped(
                policy="reward", reason="reward 0.9", outputs={"answer": "42"}, iterations=4, llm_calls=7
            )
        ),
        policy="reward",
        decision=TerminationDecision(
            policy="reward", step=3, reason="reward 0.9", answer="42", action_type="code"
        ),
    )


@pytest.mark.parametrize("found", [None, "", "  \n"])
def test_a_policy_without_an_answer_stops_with_none(found: str | None) -> None:
    ending = stopped(PolicyDecision(stop=True, answer=found, reason="enough"))
    assert ending == Ending(
        ended_by="policy",
        answer=None,
        source="none",
        stop_reason="reward: enough",
        execution=ExecutionResult(
            variant=Stopped(policy="reward", reason="enough", outputs=None, iterations=4, llm_calls=7)
        ),
        policy="reward",
        decision=TerminationDecision(
            policy="reward", step=3, reason="enough", answer=found, action_type="code"
        ),
    )
    assert ending.confidence is None


def test_a_policys_text_cannot_fill_typed_outputs() -> None:
    ending = stopped(PolicyDecision(stop=True, answer="42", reason="r"), TYPED)
    assert ending is not None
    assert (ending.answer, ending.source, ending.execution.outputs()) == (None, "none", None)  # type: ignore[union-attr]


# --- failures and cancellation --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cause", "ended_by", "what"),
    [
        ("model", "model_error", "the root model call failed"),
        ("request", "model_error", "the root model refused the request"),
        ("store", "infrastructure_error", "the store failed the root model step"),
        ("sandbox", "infrastructure_error", "the sandbox failed the root model step"),
        ("infrastructure", "infrastructure_error", "the infrastructure failed the root model step"),
    ],
)
def test_a_failed_root_step_is_worded_after_what_failed(cause: Any, ended_by: str, what: str) -> None:
    assert model_error_ending("HTTP 500", cause) == Ending(
        ended_by=ended_by,  # type: ignore[arg-type]
        answer=None,
        source="none",
        stop_reason=f"{what}: HTTP 500",
        execution=ExecutionResult(variant=Failed(reason=f"{what}: HTTP 500")),
        error="HTTP 500",
        failure_cause=cause,
    )


def test_a_failed_root_step_is_the_models_fault_unless_told_otherwise() -> None:
    assert model_error_ending("HTTP 500") == model_error_ending("HTTP 500", "model")


def test_a_cancelled_episode_says_why() -> None:
    assert cancelled_ending("asked by ann") == Ending(
        ended_by="cancelled",
        answer=None,
        source="none",
        stop_reason="Cancelled: asked by ann",
        execution=ExecutionResult(variant=Failed(reason="Cancelled: asked by ann")),
    )
    assert cancelled_ending("x").confidence is None


# --- a limit came first ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "ended_by"),
    [
        ("max_iterations", "max_iterations"),
        ("max_llm_calls", "max_llm_calls"),
        ("timeout", "max_duration"),
        ("context_overflow", "context_overflow"),
        ("cancelled", "cancelled"),
        ("max_model_calls", "max_model_calls"),
        ("max_tokens", "max_tokens"),
        ("max_cost_usd", "max_cost_usd"),
        ("finish_requested", "finish_requested"),
    ],
)
def test_each_limit_names_its_ending(kind: Any, ended_by: str) -> None:
    reason = FallbackReason(kind=kind, value=3, limit=3)
    assert LIMIT_ENDED_BY[kind] == ended_by
    assert unextracted_ending(reason, "no budget").ended_by == ended_by
    assert extraction_failed_ending(reason, "bad JSON", []).ended_by == ended_by
    parsed = ParsedExtraction(outputs={"answer": "a"}, notes=None, error=None, partial=None)
    assert extraction_ending(reason, parsed, [], {}, ANSWER_FIELDS).ended_by == ended_by


@pytest.mark.parametrize(
    ("kind", "value", "limit", "detail", "cause"),
    [
        ("max_iterations", 5, 5, None, "max iterations reached (5/5)"),
        ("max_llm_calls", 50, 50, None, "max LLM calls reached (50/50)"),
        ("timeout", 3600.04, 3600, None, "timeout (3600.0s elapsed, limit 3600.0s)"),
        (
            "context_overflow",
            2,
            0,
            None,
            "the conversation no longer fits the root model's context window, "
            "even after compaction (2 compaction(s))",
        ),
        ("cancelled", 0, 0, None, "Cancelled"),
        ("cancelled", 0, 0, "by ann", "Cancelled (by ann)"),
        ("finish_requested", 0, 0, None, "asked to answer now"),
        ("finish_requested", 0, 0, "enough", "asked to answer now (enough)"),
        ("max_model_calls", 9, 10, None, "model-call budget spent (9/10, one kept for extraction)"),
        ("max_tokens", 2500, 2500, None, "token budget spent (2500/2500 tokens)"),
        ("max_cost_usd", 0.25, 0.25, None, "cost budget spent ($0.2500 of $0.2500)"),
    ],
)
def test_a_limit_ending_names_its_real_cause(
    kind: Any, value: float, limit: float, detail: str | None, cause: str
) -> None:
    reason = FallbackReason(kind=kind, value=value, limit=limit, detail=detail)
    assert unextracted_ending(reason, "no budget").stop_reason == f"{cause}; no budget"
    assert (
        extraction_failed_ending(reason, "no JSON", []).stop_reason == f"{cause}; extraction failed: no JSON"
    )


def test_every_limit_kind_has_an_ending() -> None:
    kinds = FallbackReason.model_fields["kind"].annotation.__args__  # type: ignore[union-attr]
    assert sorted(LIMIT_ENDED_BY) == sorted(kinds)


def test_a_limit_without_an_extraction_says_why_none_was_made() -> None:
    assert unextracted_ending(LIMIT, "the token budget is spent") == Ending(
        ended_by="max_iterations",
        answer=None,
        source="none",
        stop_reason="max iterations reached (5/5); the token budget is spent",
        execution=ExecutionResult(
            variant=Failed(reason="max iterations reached (5/5); the token budget is spent")
        ),
    )


def test_a_failed_extraction_keeps_its_error_history_and_partial_outputs() -> None:
    assert extraction_failed_ending(LIMIT, "no JSON", HISTORY, {"title": "x"}) == Ending(
        ended_by="max_iterations",
        answer=None,
        source="none",
        stop_reason="max iterations reached (5/5); extraction failed: no JSON",
        execution=ExecutionResult(
            variant=Failed(reason="no JSON", partial_outputs={"title": "x"}, history=HISTORY)
        ),
    )
    assert extraction_failed_ending(LIMIT, "no JSON", []).execution.variant.partial_outputs is None  # type: ignore[union-attr]


def test_an_unparsed_extraction_ends_failed_with_what_could_be_read() -> None:
    parsed = ParsedExtraction(outputs=None, notes=None, error="Failed to parse", partial={"title": "x"})
    assert extraction_ending(LIMIT, parsed, HISTORY, {}, TYPED) == extraction_failed_ending(
        LIMIT, "Failed to parse", HISTORY, {"title": "x"}
    )
    unexplained = ParsedExtraction(outputs=None, notes=None, error=None, partial=None)
    assert extraction_ending(LIMIT, unexplained, HISTORY, {}, TYPED) == extraction_failed_ending(
        LIMIT, "extraction failed", HISTORY, None
    )


def test_an_extracted_answer_carries_the_seeds_confidence() -> None:
    parsed = ParsedExtraction(
        outputs={"answer": "42"}, notes="from the last output", error=None, partial=None
    )
    # Seen in the last outputs (+0.2), not a variable's value: 0.5 + 0.2.
    ending = extraction_ending(LIMIT, parsed, HISTORY, {"x": "41"}, ANSWER_FIELDS)
    assert ending == Ending(
        ended_by="max_iterations",
        answer="42",
        source="extraction",
        stop_reason="max iterations reached (5/5); the answer was extracted from the history",
        execution=ExecutionResult(
            variant=Extracted(
                outputs={"answer": "42"},
                confidence=0.7,
                reason=LIMIT,
                extraction_notes="from the last output",
            )
        ),
    )
    assert ending.confidence == 0.7
    # A variable's value too (+0.3): the confidence clamp at 0.99.
    assert extraction_ending(LIMIT, parsed, HISTORY, {"x": "42"}, ANSWER_FIELDS).confidence == 0.99


def test_typed_outputs_are_extracted_as_json() -> None:
    parsed = ParsedExtraction(outputs={"year": 1999, "title": "x"}, notes=None, error=None, partial=None)
    ending = extraction_ending(LIMIT, parsed, [], {}, TYPED)
    assert (ending.answer, ending.source, ending.confidence) == (
        '{"title": "x", "year": 1999}',
        "extraction",
        0.5,
    )


def test_an_extraction_that_found_no_answer_claims_no_confidence() -> None:
    parsed = ParsedExtraction(outputs={"answer": None}, notes=None, error=None, partial=None)
    ending = extraction_ending(LIMIT, parsed, HISTORY, {}, ANSWER_FIELDS)
    assert (ending.answer, ending.source, ending.confidence) == (None, "none", None)
    assert ending.execution.confidence() == 0.2  # type: ignore[union-attr]  # 0.5 - 0.3 for the null field


# --- confidence -----------------------------------------------------------------------------------


def test_confidence_needs_both_an_answer_and_a_result() -> None:
    extracted = ExecutionResult(variant=Extracted(outputs={"answer": "a"}, confidence=0.7, reason=LIMIT))
    base = {"ended_by": "max_iterations", "source": "extraction", "stop_reason": "s"}
    assert Ending(answer="a", execution=extracted, **base).confidence == 0.7  # type: ignore[arg-type]
    assert Ending(answer=None, execution=extracted, **base).confidence is None  # type: ignore[arg-type]
    assert Ending(answer="a", execution=None, **base).confidence is None  # type: ignore[arg-type]
    ending = Ending(answer="a", execution=extracted, **base)  # type: ignore[arg-type]
    assert (ending.policy, ending.decision, ending.error, ending.failure_cause) == (None, None, None, None)
