"""Seed 004 (SPEC-27) test plan: trigger, extraction prompt, reply parsing, result variants,
confidence."""

from __future__ import annotations

from datetime import timedelta

import pytest
from pydantic import BaseModel, Field

from workflows.fallback import (
    ANSWER_FIELDS,
    ExecutionResult,
    ExecutionState,
    Extracted,
    ExtractFallbackInputs,
    Failed,
    FallbackReason,
    FallbackTrigger,
    FieldSpec,
    REPLHistoryEntry,
    Submitted,
    calculate_extraction_confidence,
    clamp_confidence,
    extraction_prompt,
    fields_from_json_schema,
    fields_from_model,
    parse_extraction_response,
)

FIELDS = [
    FieldSpec(name="answer", type="string", description="the final answer"),
    FieldSpec(name="count", type="integer", description="how many"),
]
HISTORY = [
    REPLHistoryEntry(iteration=1, reasoning="Look at the data.", code="rows = 3", output="", success=True),
    REPLHistoryEntry(iteration=2, reasoning=None, code="print(rows * 14)", output="42\n", success=True),
]


# --- test_should_trigger ----------------------------------------------------------------------


def state(iterations=0, calls=0, seconds=0.0, submitted=False) -> ExecutionState:
    return ExecutionState(iterations, calls, timedelta(seconds=seconds), submitted)


def test_trigger_defaults_are_the_seeds() -> None:
    trigger = FallbackTrigger()
    assert (trigger.max_iterations, trigger.max_llm_calls, trigger.max_duration) == (
        20,
        50,
        timedelta(seconds=300),
    )


def test_no_trigger_below_every_limit() -> None:
    assert FallbackTrigger().should_trigger(state(19, 49, 299)) is None


@pytest.mark.parametrize(
    ("s", "kind", "text"),
    [
        (state(20, 0, 0), "max_iterations", "max iterations reached (20/20)"),
        (state(3, 50, 0), "max_llm_calls", "max LLM calls reached (50/50)"),
        (state(3, 5, 300), "timeout", "timeout (300.0s elapsed, limit 300.0s)"),
    ],
)
def test_each_limit_triggers_with_a_readable_reason(s: ExecutionState, kind: str, text: str) -> None:
    reason = FallbackTrigger().should_trigger(s)
    assert reason is not None and reason.kind == kind and str(reason) == text


def test_priority_is_iterations_then_calls_then_timeout() -> None:
    trigger = FallbackTrigger()
    assert trigger.should_trigger(state(20, 50, 300)).kind == "max_iterations"
    assert trigger.should_trigger(state(1, 50, 300)).kind == "max_llm_calls"


def test_submit_bypasses_the_fallback() -> None:
    assert FallbackTrigger().should_trigger(state(99, 99, 999, submitted=True)) is None


# --- test_extraction_prompt -------------------------------------------------------------------


def test_extraction_prompt_includes_every_required_part() -> None:
    prompt = extraction_prompt(
        ExtractFallbackInputs(
            history=HISTORY,
            variables={"rows": 3, "note": "forty-two"},
            output_fields=FIELDS,
            fallback_reason=str(FallbackReason(kind="max_iterations", value=20, limit=20)),
        )
    )
    assert prompt.lstrip().startswith(
        "The REPL execution reached its limit (max iterations reached (20/20))."
    )
    assert "### Iteration 2\n\n```python\nprint(rows * 14)\n```\nOutput: 42\n" in prompt
    assert "Look at the data." in prompt
    assert "- rows = 3" in prompt and "- note = forty-two" in prompt
    assert "- answer (string, required): the final answer" in prompt
    assert '  "count": "integer (how many)",' in prompt
    assert '  "_extraction_notes": "string (optional explanation)"' in prompt
    assert "{{" not in prompt and prompt.rstrip().endswith("Return the JSON now:")


def test_schema_comes_from_json_schema_or_a_pydantic_model() -> None:
    class Outputs(BaseModel):
        answer: str = Field(description="the final answer")
        count: int = Field(description="how many")
        tags: list[str] | None = None

    fields = fields_from_model(Outputs)
    assert [(f.name, f.type, f.required) for f in fields] == [
        ("answer", "string", True),
        ("count", "integer", True),
        ("tags", "array", False),
    ]
    assert fields[0].description == "the final answer"
    with pytest.raises(ValueError, match="properties"):
        fields_from_json_schema({"type": "string"})
    with pytest.raises(ValueError, match="unsupported type"):
        fields_from_json_schema({"type": "object", "properties": {"x": {"type": "date"}}})


# --- test_parse_extraction_response -----------------------------------------------------------


def test_parse_raw_json() -> None:
    parsed = parse_extraction_response(
        '{"answer": "42", "count": 42, "_extraction_notes": "from iteration 2"}', FIELDS
    )
    assert parsed.outputs == {"answer": "42", "count": 42}
    assert parsed.notes == "from iteration 2" and parsed.error is None


def test_parse_markdown_wrapped_json() -> None:
    text = 'Here you go:\n```json\n{"answer": "42", "count": null}\n```\nDone.'
    parsed = parse_extraction_response(text, FIELDS)
    assert parsed.outputs == {"answer": "42", "count": None}


def test_parse_garbage_is_a_failure_without_partial_outputs() -> None:
    parsed = parse_extraction_response("I could not work it out, sorry.", FIELDS)
    assert parsed.outputs is None and parsed.partial is None
    assert parsed.error.startswith("Failed to parse extraction")


def test_parse_wrong_types_is_a_failure_that_keeps_partial_outputs() -> None:
    parsed = parse_extraction_response('{"answer": "42", "count": "many"}', FIELDS)
    assert parsed.outputs is None
    assert parsed.partial == {"answer": "42", "count": "many"}
    assert "'count' must be integer" in parsed.error


def test_missing_fields_become_null() -> None:
    assert parse_extraction_response('{"answer": "x"}', FIELDS).outputs == {"answer": "x", "count": None}


# --- result variants --------------------------------------------------------------------------


def test_execution_result_submitted() -> None:
    result = ExecutionResult(variant=Submitted(outputs={"answer": "42"}, iterations=3, llm_calls=2))
    assert result.outputs() == {"answer": "42"}
    assert not result.was_extracted() and result.confidence() == 1.0


def test_execution_result_extracted() -> None:
    reason = FallbackReason(kind="timeout", value=301, limit=300)
    result = ExecutionResult(
        variant=Extracted(outputs={"answer": "42"}, confidence=0.7, reason=reason, extraction_notes="n")
    )
    assert result.outputs() == {"answer": "42"} and result.was_extracted() and result.confidence() == 0.7
    again = ExecutionResult.model_validate_json(result.model_dump_json(by_alias=True))
    assert again == result


def test_execution_result_failed() -> None:
    result = ExecutionResult(variant=Failed(reason="bad", partial_outputs={"answer": 1}, history=HISTORY))
    assert result.outputs() is None and not result.was_extracted() and result.confidence() == 0.0
    assert result.variant.history == HISTORY and result.variant.partial_outputs == {"answer": 1}


# --- confidence -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("outputs", "variables", "expected"),
    [
        ({"answer": "unrelated"}, {}, 0.5),  # base
        ({"answer": "forty"}, {"x": "forty"}, 0.8),  # +0.3 in variables
        ({"answer": "42"}, {}, 0.7),  # +0.2 in recent history
        ({"answer": "42"}, {"x": "42"}, 0.99),  # 1.0 clamped to 0.99
        ({"answer": None}, {}, 0.2),  # -0.3 x 1.0 nulls
        ({"answer": "zzz", "count": None}, {}, 0.35),  # -0.3 x 0.5 nulls
        ({"answer": None, "count": None}, {}, 0.2),
    ],
)
def test_confidence_follows_the_seed_formula(outputs: dict, variables: dict, expected: float) -> None:
    assert calculate_extraction_confidence(outputs, HISTORY, variables) == pytest.approx(expected)


def test_confidence_at_its_lowest_is_0_2_with_the_seeds_weights() -> None:
    history = [REPLHistoryEntry(iteration=1, code="", output="", success=False)]
    assert calculate_extraction_confidence({}, history, {}) == pytest.approx(0.2)
    assert calculate_extraction_confidence({"a": None}, [], {}) == pytest.approx(0.2)


@pytest.mark.parametrize(
    ("value", "clamped"), [(-3.0, 0.1), (0.05, 0.1), (0.1, 0.1), (0.5, 0.5), (0.99, 0.99), (1.2, 0.99)]
)
def test_the_seeds_clamp(value: float, clamped: float) -> None:
    assert clamp_confidence(value) == clamped


def test_default_fields_are_a_single_answer() -> None:
    assert [f.name for f in ANSWER_FIELDS] == ["answer"]
