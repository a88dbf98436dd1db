"""Fallback extraction, example for example (docs/behaviour/fallback-extraction.md): trigger,
extraction prompt, reply parsing, result variants, confidence."""

from __future__ import annotations

from datetime import date, timedelta
from enum import Enum, StrEnum
from typing import Any

import pytest
from pydantic import BaseModel, Field

from durable_rlm.workflows.fallback import (
    ExecutionResult,
    ExecutionState,
    Extracted,
    ExtractFallbackInputs,
    Failed,
    FallbackReason,
    FallbackTrigger,
    REPLHistoryEntry,
    Submitted,
    calculate_extraction_confidence,
    clamp_confidence,
    extraction_prompt,
    parse_extraction_response,
)
from durable_rlm.workflows.typed_outputs import (
    ANSWER_FIELDS,
    FieldSpec,
    FieldType,
    check_outputs,
    fields_from_json_schema,
    fields_from_model,
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


def test_a_context_overflow_reads_as_such_with_its_compaction_count() -> None:
    reason = FallbackReason(kind="context_overflow", value=2, limit=0)
    assert str(reason) == (
        "the conversation no longer fits the root model's context window, even after compaction "
        "(2 compaction(s))"
    )


# --- test_extraction_prompt -------------------------------------------------------------------


# The specified extraction template with HISTORY, two variables and three fields; \x20 is the
# space after "Output:" of an iteration that printed nothing.
PINNED_PROMPT = """
The REPL execution reached its limit (max iterations reached (20/20)).
Extract the final outputs from the execution history and variables.

## REPL History

### Iteration 1
Look at the data.
```python
rows = 3
```
Output:\x20

### Iteration 2

```python
print(rows * 14)
```
Output: 42



## Current Variables

- rows = 3
- note = forty-two

## Required Outputs

You must extract values for these fields:
- answer (string, required): the final answer
- count (integer, required): how many
- tags (array, optional)

## Instructions

1. Review the REPL history to understand what was computed
2. Look at the current variable values
3. Extract or infer the required output values
4. Return ONLY valid JSON matching the output schema

If a value cannot be determined, use null and explain in _extraction_notes.

## Output Schema

```json
{
  "answer": "string (the final answer)",
  "count": "integer (how many)",
  "tags": "array",
  "_extraction_notes": "string (optional explanation)"
}
```

Return the JSON now:
"""


def prompt_for(variables: dict[str, Any], fields: list[FieldSpec] = FIELDS) -> str:
    return extraction_prompt(
        ExtractFallbackInputs(
            history=HISTORY,
            variables=variables,
            output_fields=fields,
            fallback_reason=str(FallbackReason(kind="max_iterations", value=20, limit=20)),
        )
    )


def test_the_extraction_prompt_is_the_seeds_template_filled_in_word_for_word() -> None:
    fields = [*FIELDS, FieldSpec(name="tags", type="array", required=False)]
    assert prompt_for({"rows": 3, "note": "forty-two"}, fields) == PINNED_PROMPT


def test_a_prompt_without_variables_says_none() -> None:
    assert "## Current Variables\n\n(none)\n\n## Required Outputs" in prompt_for({})


def test_repl_text_with_braces_and_placeholder_words_reaches_the_prompt_unchanged() -> None:
    history = [
        REPLHistoryEntry(
            iteration=1, code='print(f"{variables} {{x}}")', output='{"a": {"b": 1}}', success=True
        )
    ]
    prompt = extraction_prompt(
        ExtractFallbackInputs(
            history=history,
            variables={"doc": "see {history} and }}{{"},
            output_fields=FIELDS,
            fallback_reason="max_iterations",
        )
    )
    assert 'print(f"{variables} {{x}}")' in prompt
    assert '{"a": {"b": 1}}' in prompt
    assert "- doc = see {history} and }}{{\n" in prompt


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("forty-two", "forty-two"),  # text as it is, without quotes
        (3, "3"),
        (None, "null"),
        ({"b": 1, "a": [True]}, '{"a": [true], "b": 1}'),  # JSON with sorted keys
        (date(2024, 1, 2), '"2024-01-02"'),  # not JSON-serialisable: its str() as a JSON string
    ],
)
def test_a_variable_is_shown_as_its_text_or_as_json(value: Any, shown: str) -> None:
    assert f"\n- v = {shown}\n" in prompt_for({"v": value})


def test_nested_models_and_enums_take_their_definitions_type() -> None:
    class Colour(StrEnum):
        RED = "red"

    class Size(int, Enum):
        SMALL = 1

    class Point(BaseModel):
        x: int

    class Outputs(BaseModel):
        point: Point
        maybe: Point | None = None
        colour: Colour
        size: Size

    fields = fields_from_model(Outputs)
    assert [(f.name, f.type, f.required) for f in fields] == [
        ("point", "object", True),
        ("maybe", "object", False),
        ("colour", "string", True),
        ("size", "integer", True),
    ]
    assert check_outputs({"point": {"x": 1}, "colour": "red", "size": 1}, fields, allow_null=False) == []


@pytest.mark.parametrize(
    ("prop", "defs", "kind"),
    [
        ({"$ref": "#/$defs/Shape"}, {"Shape": {"properties": {}}}, "object"),  # no type: an object
        ({"$ref": "#/$defs/Level", "type": "integer"}, {"Level": {"type": "string"}}, "integer"),
        ({"anyOf": [{"$ref": "#/$defs/Level"}, {"type": "null"}]}, {"Level": {"type": "number"}}, "number"),
    ],
)
def test_a_reference_takes_its_definitions_type_and_a_propertys_own_type_wins(
    prop: dict[str, Any], defs: dict[str, Any] | None, kind: str
) -> None:
    schema: dict[str, Any] = {"type": "object", "properties": {"f": prop}}
    if defs is not None:
        schema["$defs"] = defs
    assert [f.type for f in fields_from_json_schema(schema)] == [kind]


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


@pytest.mark.parametrize(
    ("schema", "fields"),
    [
        # no "type" means an object; no "required" means every field is required
        ({"properties": {"n": {"type": "integer"}}}, [FieldSpec(name="n", type="integer")]),
        # a property without a type or description is a string without a description
        ({"type": "object", "properties": {"note": {}}}, [FieldSpec(name="note", type="string")]),
        # the first non-null type of a type list, wherever null is
        ({"properties": {"n": {"type": ["null", "integer"]}}}, [FieldSpec(name="n", type="integer")]),
        # an anyOf whose options have no type (constants) is a string
        (
            {"properties": {"mode": {"anyOf": [{"const": "fast"}, {"const": "slow"}]}}},
            [FieldSpec(name="mode", type="string")],
        ),
        # a property's own type wins over an anyOf of constraints
        (
            {"properties": {"n": {"type": "integer", "anyOf": [{"minimum": 0}, {"multipleOf": 5}]}}},
            [FieldSpec(name="n", type="integer")],
        ),
        (
            {"properties": {"a": {"type": "boolean", "description": "yes?"}, "b": {}}, "required": ["a"]},
            [
                FieldSpec(name="a", type="boolean", description="yes?"),
                FieldSpec(name="b", type="string", required=False),
            ],
        ),
    ],
)
def test_fields_from_a_hand_written_json_schema(schema: dict[str, Any], fields: list[FieldSpec]) -> None:
    made = fields_from_json_schema(schema)
    assert [f.model_copy(update={"json_schema": None}) for f in made] == fields
    assert [f.json_schema for f in made] == list(schema["properties"].values())  # each keeps its own


NOT_AN_OBJECT = "an output schema must be a JSON Schema object with 'properties'"


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "string"}, NOT_AN_OBJECT),
        ({"type": "object"}, NOT_AN_OBJECT),
        ({"type": "object", "properties": ["x"]}, NOT_AN_OBJECT),
        ({"type": "array", "properties": {"x": {"type": "string"}}}, NOT_AN_OBJECT),
        ({"type": "object", "properties": {}}, "an output schema needs at least one field"),
        ({"properties": {"x": {"type": "date"}}}, "output field 'x': unsupported type 'date'"),
        ({"properties": {"x": {"type": "null"}}}, "output field 'x': unsupported type 'null'"),
        ({"properties": {"x": True}}, "output field 'x': its schema must be a JSON object"),
        (
            {"properties": {"x": {"type": "integer", "minimum": "zero"}}},
            "not a valid JSON Schema (Draft 2020-12): $.properties.x.minimum: 'zero' is not of type 'number'",
        ),
        (
            {"properties": {"x": {"$ref": "#/$defs/Gone"}}, "$defs": {}},
            "$ref '#/$defs/Gone' points at nothing in the schema",
        ),
        (
            {"properties": {"x": {"$ref": "https://example.com/item.json"}}},
            "$ref 'https://example.com/item.json' is not supported: only "
            "references inside the schema ('#/...') are",
        ),
        (
            {"properties": {"x": {"$ref": "#/properties/y"}, "y": {"type": "string"}}},
            "output field 'x': $ref '#/properties/y' is not supported; refer to definitions under "
            "'$defs' ('#/$defs/Name')",
        ),
        (
            {"properties": {"x": {"type": "string"}}, "minProperties": 1},
            "the output schema's root keyword 'minProperties' is not supported: put the constraints "
            "on the properties",
        ),
    ],
)
def test_an_unusable_output_schema_is_refused_with_a_readable_reason(
    schema: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError) as refused:
        fields_from_json_schema(schema)
    assert str(refused.value) == message


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


DETAIL_FIELDS = [FieldSpec(name="answer"), FieldSpec(name="detail", type="object", required=False)]


@pytest.mark.parametrize(
    "reply",
    [
        'The result is {"answer": "42"}.',
        '{"answer": "42"}\nThat is all I could find.',
        'I counted the {rows} variable.\n```json\n{"answer": "42"}\n```\nNo other {braces} matter.',
        'I counted the {rows} variable.\n```JSON\n{"answer": "42"}\n```\nNo other {braces} matter.',
        'I counted the {rows} variable.\n```\n{"answer": "42"}\n```\nNo other {braces} matter.',
        'First I ran\n```python\nresult = {"answer": "draft"}\n```\nso:\n```json\n{"answer": "42"}\n```',
    ],
    ids=["in-prose", "then-prose", "json-fence", "JSON-fence", "bare-fence", "after-python-block"],
)
def test_the_json_object_is_found_wherever_the_reply_puts_it(reply: str) -> None:
    parsed = parse_extraction_response(reply, DETAIL_FIELDS)
    assert parsed.error is None and parsed.outputs == {"answer": "42", "detail": None}


def test_a_nested_object_in_prose_is_read_whole() -> None:
    parsed = parse_extraction_response(
        'Result: {"answer": "42", "detail": {"rows": 3}} as computed.', DETAIL_FIELDS
    )
    assert parsed.outputs == {"answer": "42", "detail": {"rows": 3}}


def test_notes_that_are_not_text_are_dropped() -> None:
    parsed = parse_extraction_response(
        '{"answer": "42", "count": 1, "_extraction_notes": {"why": 1}}', FIELDS
    )
    assert parsed.outputs == {"answer": "42", "count": 1} and parsed.notes is None


def test_a_failed_extraction_keeps_partial_outputs_without_the_notes() -> None:
    parsed = parse_extraction_response('{"answer": 42, "_extraction_notes": "guessed"}', FIELDS)
    assert parsed.outputs is None and parsed.partial == {"answer": 42}


@pytest.mark.parametrize(
    ("reply", "problems"),
    [
        ('{"answer": "42", "count": "many"}', "field 'count' must be integer, got str"),
        ('{"count": "many"}', "field 'count' must be integer, got str"),  # a missing field is fine
        ('{"answer": null, "count": "many"}', "field 'count' must be integer, got str"),  # so is a null
        ('{"answer": "42", "count": 1, "extra": 1}', "unknown field 'extra'"),
        (
            '{"answer": 1, "count": true}',
            "field 'answer' must be string, got int; field 'count' must be integer, got bool",
        ),
    ],
)
def test_a_reply_that_does_not_fit_the_fields_fails_naming_every_problem(reply: str, problems: str) -> None:
    parsed = parse_extraction_response(reply, FIELDS)
    assert parsed.outputs is None and parsed.error == f"Failed to parse extraction: {problems}"


# --- output checks (extraction and SUBMIT) -----------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "value", "fits"),
    [
        ("string", "x", True),
        ("string", 3, False),
        ("integer", 3, True),
        ("integer", 2.5, False),
        ("integer", True, False),  # a bool is not a number, though Python says it is an int
        ("number", 2.5, True),
        ("number", 3, True),
        ("number", False, False),
        ("boolean", True, True),
        ("boolean", 1, False),
        ("array", [1], True),
        ("array", {}, False),
        ("object", {"a": 1}, True),
        ("object", [], False),
    ],
)
def test_a_value_fits_its_fields_json_type(kind: FieldType, value: Any, fits: bool) -> None:
    problems = check_outputs({"v": value}, [FieldSpec(name="v", type=kind)], allow_null=False)
    assert problems == ([] if fits else [f"field 'v' must be {kind}, got {type(value).__name__}"])


@pytest.mark.parametrize(
    ("values", "problems"),
    [
        ({"answer": "42", "count": 1}, []),
        ({"answer": "42", "count": 1, "_extraction_notes": "from iteration 2"}, []),
        ({}, ["missing field 'answer'", "missing field 'count'"]),
        ({"answer": None, "count": None}, ["field 'answer' is null", "field 'count' is null"]),
        ({"answer": "42", "count": 1, "extra": 2}, ["unknown field 'extra'"]),
    ],
)
def test_a_submit_must_fill_every_required_field_with_a_value(
    values: dict[str, Any], problems: list[str]
) -> None:
    assert check_outputs(values, FIELDS, allow_null=False) == problems


def test_an_optional_field_may_be_left_out_of_a_submit() -> None:
    fields = [*FIELDS, FieldSpec(name="tags", type="array", required=False)]
    assert check_outputs({"answer": "42", "count": 1}, fields, allow_null=False) == []


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


@pytest.mark.parametrize(("at", "expected"), [(0, 0.5), (1, 0.7), (3, 0.7)])
def test_only_the_last_three_iterations_count_as_recent_history(at: int, expected: float) -> None:
    history = [
        REPLHistoryEntry(iteration=i + 1, code="", output="42" if i == at else "...", success=True)
        for i in range(4)
    ]
    assert calculate_extraction_confidence({"answer": "42"}, history, {}) == pytest.approx(expected)


def test_an_empty_output_does_not_count_as_seen_in_the_history() -> None:
    assert calculate_extraction_confidence({"answer": ""}, HISTORY, {}) == pytest.approx(0.5)


def test_an_object_equal_to_a_variable_counts_whatever_its_key_order() -> None:
    outputs = {"detail": {"b": 1, "a": 2}}
    assert calculate_extraction_confidence(outputs, HISTORY, {"x": {"a": 2, "b": 1}}) == pytest.approx(0.8)
