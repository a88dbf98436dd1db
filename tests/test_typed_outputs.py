"""Typed outputs checked with jsonschema (Draft 2020-12): every keyword at any depth, each
violation fed back with its JSON path, bounded; the extraction prompt carries the task."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any, Literal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field, ValidationError

from durable_rlm.activities.extraction import task_of
from durable_rlm.api import DurableRLM
from durable_rlm.errors import ConfigurationError
from durable_rlm.settings import Settings
from durable_rlm.workflows import prompts
from durable_rlm.workflows.fallback import (
    EXTRACTION_TASK_CHARS,
    ExtractFallbackInputs,
    REPLHistoryEntry,
    extraction_prompt,
    parse_extraction_response,
)
from durable_rlm.workflows.models import Message
from durable_rlm.workflows.outcome import CellRecord, cell_answer
from durable_rlm.workflows.typed_outputs import (
    MAX_OUTPUT_DEPTH,
    MAX_OUTPUT_VALUES,
    MAX_PROBLEM_CHARS,
    MAX_PROBLEMS,
    MORE_PROBLEMS,
    SCHEMA_SHOWN_CHARS,
    FieldSpec,
    check_outputs,
    fields_from_json_schema,
    fields_from_model,
    format_output_fields,
)


class Item(BaseModel):
    name: str
    price: float = Field(ge=0, le=1000)
    tags: list[str] = Field(default_factory=list, max_length=3)


class Order(BaseModel):
    items: list[Item] = Field(min_length=1)
    status: Literal["open", "closed"]
    code: str = Field(pattern=r"^[A-Z]{3}-\d+$", description="the order code")
    best: Item | None = None


FIELDS = fields_from_model(Order)
GOOD: dict[str, Any] = {
    "items": [{"name": "pen", "price": 2.5}, {"name": "ink", "price": 0, "tags": ["blue"]}],
    "status": "open",
    "code": "ABC-12",
}


def problems(**changes: Any) -> list[str]:
    return check_outputs({**GOOD, **changes}, FIELDS, allow_null=False)


def test_a_valid_order_has_no_problems() -> None:
    assert problems() == []
    assert problems(best={"name": "pen", "price": 1}) == []
    assert problems(best=None) == []  # Optional[...] allows null even in a SUBMIT


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        # arrays with items, a minimum in a nested object
        (
            {"items": [{"name": "a", "price": 1}, {"name": "b", "price": 2}, {"name": "c", "price": -3}]},
            ["$.items[2].price: -3 is less than the minimum of 0"],
        ),
        (
            {"items": [{"name": "a", "price": 1001}]},
            ["$.items[0].price: 1001 is greater than the maximum of 1000"],
        ),
        ({"items": []}, ["$.items: [] should be non-empty"]),
        # enum
        ({"status": "done"}, ["$.status: 'done' is not one of ['open', 'closed']"]),
        # pattern
        ({"code": "abc-12"}, ["$.code: 'abc-12' does not match '^[A-Z]{3}-\\\\d+$'"]),
        # required keys of a nested object
        ({"items": [{"price": 1}]}, ["$.items[0]: 'name' is a required property"]),
        # nested array limits and item types
        (
            {"items": [{"name": "a", "price": 1, "tags": ["x", 2, "y", "z"]}]},
            [
                "$.items[0].tags[1]: 2 is not of type 'string'",
                "$.items[0].tags: ['x', 2, 'y', 'z'] is too long",
            ],
        ),
        # anyOf (Optional[Item]): the reason of the branch the value came closest to
        ({"best": {"name": "x", "price": -1}}, ["$.best.price: -1 is less than the minimum of 0"]),
        # JSON Schema's integer/number: a bool is neither
        ({"items": [{"name": "a", "price": True}]}, ["$.items[0].price: True is not of type 'number'"]),
        ({"code": None}, ["$.code: None is not of type 'string'"]),
    ],
)
def test_every_violation_is_named_with_its_json_path(changes: dict[str, Any], expected: list[str]) -> None:
    assert problems(**changes) == expected


def test_missing_and_unknown_fields_have_paths_too() -> None:
    values = {k: v for k, v in GOOD.items() if k != "status"} | {"extra": 1, "odd key": 2}
    assert check_outputs(values, FIELDS, allow_null=False) == [
        "$.extra: not a field of the output schema",
        '$["odd key"]: not a field of the output schema',
        "$.status: missing (a required field)",
    ]
    # extraction's notes field is never an unknown field, in a SUBMIT either
    assert check_outputs({**GOOD, "_extraction_notes": "why"}, FIELDS, allow_null=False) == []


def test_the_feedback_is_capped_in_lines_and_length() -> None:
    many = [{"name": "x" * 5_000, "price": -1} for _ in range(50)]
    found = problems(items=many, code="y" * 100_000)
    assert len(found) == MAX_PROBLEMS + 1 and found[-1] == MORE_PROBLEMS
    assert all(len(p) <= MAX_PROBLEM_CHARS for p in found)
    assert found[0] == "$.items[0].price: -1 is less than the minimum of 0"
    # a long value is cut in the middle: the path and the rule both stay
    [line] = problems(code="y" * 100_000)
    assert len(line) == MAX_PROBLEM_CHARS and line.startswith("$.code: 'yyy")
    assert line.endswith("yyy' does not match '^[A-Z]{3}-\\\\d+$'")


def test_too_deep_a_value_is_refused_without_recursing() -> None:
    fields = fields_from_json_schema({"properties": {"tree": {"type": "object"}}})
    ok: dict[str, Any] = {}  # one level
    for _ in range(MAX_OUTPUT_DEPTH - 1):
        ok = {"c": ok}
    assert check_outputs({"tree": ok}, fields, allow_null=False) == []
    assert check_outputs({"tree": {"c": ok}}, fields, allow_null=False) == [
        f"$.tree: nested deeper than {MAX_OUTPUT_DEPTH} levels"
    ]
    assert check_outputs({"tree": {"c": [1]}}, fields, allow_null=False) == []


def test_a_recursive_model_is_checked_at_every_level() -> None:
    class Node(BaseModel):
        value: int = Field(ge=0)
        children: list[Node] = Field(default_factory=list)

    class Tree(BaseModel):
        root: Node

    fields = fields_from_model(Tree)
    tree = {"value": 1, "children": [{"value": 2, "children": [{"value": -5}]}]}
    assert check_outputs({"root": tree}, fields, allow_null=False) == [
        "$.root.children[0].children[0].value: -5 is less than the minimum of 0"
    ]


def test_extraction_may_leave_fields_null_but_not_break_their_rules() -> None:
    assert parse_extraction_response('{"items": null, "status": "open"}', FIELDS).outputs == {
        "items": None,
        "status": "open",
        "code": None,
        "best": None,
    }
    parsed = parse_extraction_response('{"status": "pending", "_extraction_notes": "n"}', FIELDS)
    assert parsed.outputs is None and parsed.partial == {"status": "pending"}
    assert parsed.error == "Failed to parse extraction: $.status: 'pending' is not one of ['open', 'closed']"
    # a field left null does not end the check of the fields after it
    parsed = parse_extraction_response('{"items": null, "status": "pending"}', FIELDS)
    assert parsed.error == "Failed to parse extraction: $.status: 'pending' is not one of ['open', 'closed']"


def test_each_field_keeps_its_schema_with_only_the_definitions_it_needs() -> None:
    class Other(BaseModel):
        x: int

    class Outputs(BaseModel):
        item: Item
        other: Other
        n: int = Field(gt=0)

    by_name = {f.name: f.json_schema for f in fields_from_model(Outputs)}
    assert list(by_name["item"]["$defs"]) == ["Item"]
    assert list(by_name["other"]["$defs"]) == ["Other"]
    assert by_name["n"] == {"exclusiveMinimum": 0, "title": "N", "type": "integer"}


def test_a_schema_written_by_hand_in_draft_7_style_works() -> None:
    fields = fields_from_json_schema(
        {
            "definitions": {"level": {"type": "integer", "minimum": 1, "maximum": 5}},
            "properties": {"level": {"$ref": "#/definitions/level"}, "note": {"type": "string"}},
            "required": ["level"],
        }
    )
    assert check_outputs({"level": 9}, fields, allow_null=False) == [
        "$.level: 9 is greater than the maximum of 5"
    ]
    # the reference's type is the definition's, so the prompts call the field an integer
    assert [(f.name, f.type) for f in fields] == [("level", "integer"), ("note", "string")]
    assert format_output_fields(fields).startswith("- level (integer, required); JSON Schema: ")


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "string", "minLength": -1}, r"not a valid JSON Schema \(Draft 2020-12\): \$.minLength"),
        ({"$ref": "https://example.com/s.json"}, "is not supported: only references inside the schema"),
        ({"$ref": "#/$defs/Gone"}, "points at nothing in the schema"),
        ({"type": "number", "maximum": float("nan")}, "an output schema must be JSON"),
    ],
)
def test_a_field_spec_refuses_a_schema_it_could_not_apply(schema: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        FieldSpec(name="x", json_schema=schema)


def test_an_invalid_schema_is_refused_when_the_client_is_made(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="invalid output schema: not a valid JSON Schema"):
        DurableRLM(
            "m",
            output_schema={"properties": {"n": {"type": "integer", "maximum": "ten"}}},
            settings=Settings(data_dir=tmp_path),
        )
    client = DurableRLM("m", output_schema=Order.model_json_schema(), settings=Settings(data_dir=tmp_path))
    request = client.request(None, "count")
    assert [f.json_schema for f in request.output_fields or []] == [f.json_schema for f in FIELDS]


def test_fields_without_a_schema_keep_the_old_wording_and_rules() -> None:
    """What histories recorded before typed outputs decided must not change on replay."""
    legacy = [FieldSpec(name="count", type="integer"), FieldSpec(name="tags", type="array", required=False)]
    assert check_outputs({"count": 1.0}, legacy, allow_null=False) == [
        "field 'count' must be integer, got float"
    ]
    assert check_outputs({"count": 1, "tags": None}, legacy, allow_null=False) == ["field 'tags' is null"]
    # the same fields with their schema: JSON Schema's rules (1.0 is an integer)
    typed = fields_from_json_schema(
        {"properties": {"count": {"type": "integer"}, "tags": {"type": "array"}}, "required": ["count"]}
    )
    assert check_outputs({"count": 1.0}, typed, allow_null=False) == []


def test_the_model_is_told_each_violation_on_its_own_line() -> None:
    cell = CellRecord(index=1, code="SUBMIT(...)", status="ok", submitted={**GOOD, "status": "done"})
    answer, notes, _ = cell_answer(cell, FIELDS)
    assert answer is None
    assert notes == [
        "SUBMIT was rejected:\n- $.status: 'done' is not one of ['open', 'closed']\n"
        "Fix the values and call SUBMIT again."
    ]
    legacy = [FieldSpec(name="n", type="integer")]
    _, notes, _ = cell_answer(CellRecord(index=1, code="", status="ok", submitted={"n": "x"}), legacy)
    assert notes == [
        "SUBMIT was rejected: field 'n' must be integer, got str. Fix the values and call SUBMIT again."
    ]


def test_the_fields_list_shows_each_rule_but_not_the_titles() -> None:
    text = format_output_fields(FIELDS)
    assert '- status (string, required); JSON Schema: {"enum": ["open", "closed"], "type": "string"}' in text
    assert '- code (string, required): the order code; JSON Schema: {"pattern": ' in text
    assert '"minimum": 0' in text and '"title"' not in text
    plain = fields_from_json_schema({"properties": {"n": {"type": "integer", "title": "N"}}})
    assert format_output_fields(plain) == "- n (integer, required)"
    system = prompts.opening_messages("t", None, "repl", output_fields=FIELDS)[0].content
    assert "'open', 'closed'" in system or '"open", "closed"' in system


# --- the extraction prompt carries the task ---------------------------------------------------


def extraction(task: str | None) -> str:
    return extraction_prompt(
        ExtractFallbackInputs(
            history=[REPLHistoryEntry(iteration=1, code="x = 1", output="", success=True)],
            variables={},
            output_fields=FIELDS,
            fallback_reason="max iterations reached (3/3)",
            task=task,
        )
    )


def test_the_extraction_prompt_includes_the_task() -> None:
    prompt = extraction("Total the order for {customer}.")
    assert "variables.\n\n## Task\n\nTotal the order for {customer}.\n\n## REPL History" in prompt
    assert "## Task" not in extraction(None)


def test_a_huge_task_is_shortened_in_the_extraction_prompt() -> None:
    prompt = extraction("START " + "x" * 100_000 + " END")
    assert "START" in prompt and "END" in prompt and "characters not repeated here" in prompt
    assert len(prompt) < EXTRACTION_TASK_CHARS + 5_000


def test_the_task_is_read_back_from_the_opening_turn() -> None:
    task = "Count the ERROR lines.\n\nThen say which service logged most."
    opening = prompts.opening_messages(task, None, "repl")
    assert task_of([*opening, Message(role="assistant", content="ok")]) == task
    assert task_of([Message(role="user", content="free text")]) == "free text"
    assert task_of([]) is None


# --- properties --------------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=50),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=40,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=st.dictionaries(st.sampled_from([*GOOD, "best", "other"]) | st.text(max_size=8), JSON))
def test_any_outputs_are_checked_without_raising_and_the_feedback_stays_bounded(values: dict) -> None:
    for allow_null in (False, True):
        found = check_outputs(values, FIELDS, allow_null=allow_null)
        assert len(found) <= MAX_PROBLEMS + 1
        assert all(isinstance(p, str) and 0 < len(p) <= MAX_PROBLEM_CHARS for p in found)
        assert all(p.startswith("$") for p in found if p != MORE_PROBLEMS)
        assert check_outputs(values, FIELDS, allow_null=allow_null) == found  # deterministic
    note = prompts.submit_rejected(check_outputs(values, FIELDS, False) or ["x"], listed=True)
    assert len(note) < (MAX_PROBLEMS + 1) * (MAX_PROBLEM_CHARS + 3) + 100


def test_checking_a_large_output_is_fast_and_a_huge_one_is_refused() -> None:
    """Validation runs in a workflow task: its cost is bounded whatever the model SUBMITs."""
    rows = [{"name": f"item {i}", "price": i % 100, "tags": ["a", "b"]} for i in range(10_000)]
    started = time.perf_counter()
    assert check_outputs({**GOOD, "items": rows}, FIELDS, allow_null=False) == []  # 60,003 values
    bad = {**GOOD, "items": [{"name": 1, "price": -1}] * 10_000}
    assert len(check_outputs(bad, FIELDS, allow_null=False)) == MAX_PROBLEMS + 1
    assert time.perf_counter() - started < 5.0  # about 0.5 s on one core
    huge = {**GOOD, "items": rows * 2}
    started = time.perf_counter()
    assert check_outputs(huge, FIELDS, allow_null=False) == [
        f"$.items: too large to check: the outputs hold more than {MAX_OUTPUT_VALUES} values"
    ]
    assert time.perf_counter() - started < 1.0


# --- the corners of the schema checks (the survivors of a mutation run: docs/mutation.md) -----


def test_a_line_at_the_limit_is_shown_whole_and_a_longer_one_keeps_its_path_and_its_rule() -> None:
    suffix = ": not a field of the output schema"
    name = "f" * (MAX_PROBLEM_CHARS - len("$." + suffix))
    assert check_outputs({**GOOD, name: 1}, FIELDS, allow_null=False) == [f"$.{name}{suffix}"]
    # the head keeps two thirds of the line: a long path is not cut
    fields = fields_from_json_schema(
        {"properties": {"data": {"type": "object", "additionalProperties": {"type": "integer"}}}}
    )
    key = "k" * (MAX_PROBLEM_CHARS // 2 + 20)
    [line] = check_outputs({"data": {key: "x" * 1_000}}, fields, allow_null=False)
    assert len(line) == MAX_PROBLEM_CHARS
    assert line.startswith(f"$.data.{key}: 'xxx") and line.endswith("xxx' is not of type 'integer'")


def test_the_prompt_shows_a_fields_schema_as_written_up_to_its_own_limit() -> None:
    cities = [f"Zürich {i}" for i in range(60)]  # longer than a problem line, shorter than the limit
    fields = fields_from_json_schema({"properties": {"city": {"type": "string", "enum": cities}}})
    shown = json.dumps({"type": "string", "enum": cities}, ensure_ascii=False)
    assert MAX_PROBLEM_CHARS < len(shown) < SCHEMA_SHOWN_CHARS
    assert format_output_fields(fields) == f"- city (string, required); JSON Schema: {shown}"


def test_the_prompt_leaves_out_the_titles_of_subschemas_but_not_of_values() -> None:
    prop = {
        "type": "object",
        "properties": {"any": True, "tags": {"type": "array", "items": {"title": "Tag", "type": "string"}}},
        "anyOf": [{"title": "A", "required": ["any"]}, {"title": "B", "required": ["tags"]}],
        "default": {"title": "a value"},
        "examples": [{"title": "a value"}],
    }
    shown = {
        "type": "object",
        "properties": {"any": True, "tags": {"type": "array", "items": {"type": "string"}}},
        "anyOf": [{"required": ["any"]}, {"required": ["tags"]}],
        "default": {"title": "a value"},
        "examples": [{"title": "a value"}],
    }
    fields = fields_from_json_schema({"properties": {"p": prop}})
    assert format_output_fields(fields) == f"- p (object, required); JSON Schema: {json.dumps(shown)}"


def test_a_definition_reached_through_another_is_copied_into_the_fields_schema() -> None:
    class Inner(BaseModel):
        x: int = Field(ge=0)

    class Middle(BaseModel):
        inner: Inner

    class Outer(BaseModel):
        middle: Middle

    [field] = fields_from_model(Outer)
    assert field.json_schema is not None and sorted(field.json_schema["$defs"]) == ["Inner", "Middle"]
    assert check_outputs({"middle": {"inner": {"x": -1}}}, [field], allow_null=False) == [
        "$.middle.inner.x: -1 is less than the minimum of 0"
    ]


def test_a_propertys_own_definitions_are_kept_beside_those_of_the_root() -> None:
    schema = {
        "$defs": {"Root": {"type": "integer"}},
        "properties": {"n": {"$defs": {"Own": {"type": "string"}}, "$ref": "#/$defs/Root"}},
    }
    [field] = fields_from_json_schema(schema)
    assert field.json_schema == {
        "$defs": {"Own": {"type": "string"}, "Root": {"type": "integer"}},
        "$ref": "#/$defs/Root",
    }


def test_definition_names_are_json_pointer_escaped_in_a_reference() -> None:
    schema = {
        "$defs": {"a/b": {"type": "integer", "minimum": 0}, "c~d": {"type": "string", "maxLength": 2}},
        "properties": {"n": {"$ref": "#/$defs/a~1b"}, "s": {"$ref": "#/$defs/c~0d"}},
    }
    fields = fields_from_json_schema(schema)
    assert [f.type for f in fields] == ["integer", "string"]
    assert [f.json_schema for f in fields] == [
        {"$ref": "#/$defs/a~1b", "$defs": {"a/b": {"type": "integer", "minimum": 0}}},
        {"$ref": "#/$defs/c~0d", "$defs": {"c~d": {"type": "string", "maxLength": 2}}},
    ]
    assert check_outputs({"n": -1, "s": "abc"}, fields, allow_null=False) == [
        "$.n: -1 is less than the minimum of 0",
        "$.s: 'abc' is too long",
    ]


# Through fields_from_json_schema, which checks the whole schema each time: a FieldSpec's own
# check is cached per process, and mutmut forks every mutant from a process that filled it.
@pytest.mark.parametrize(
    ("prop", "message"),
    [
        ({"$dynamicRef": "https://example.com/s"}, "is not supported: only references inside the schema"),
        ({"$ref": "#/$defs/0"}, "points at nothing"),  # an object has no index
        ({"$ref": "#/$defs/A/anyOf/2"}, "points at nothing"),  # nor a list of two a third item
        ({"$ref": "#/$defs/A/anyOf/x"}, "points at nothing"),
    ],
)
def test_a_reference_that_leads_nowhere_is_refused(prop: dict[str, Any], message: str) -> None:
    schema = {"$defs": {"A": {"anyOf": [{}, {}]}}, "properties": {"n": prop}}
    with pytest.raises(ValueError, match=message):
        fields_from_json_schema(schema)


def test_a_reference_may_point_through_a_list_of_subschemas() -> None:
    branches = [{"type": "string"}, {"type": "array", "items": {"type": "integer", "minimum": 0}}]
    schema = {"$defs": {"A": {"anyOf": branches}}, "properties": {"n": {"$ref": "#/$defs/A/anyOf/1/items"}}}
    fields = fields_from_json_schema(schema)
    assert [f.type for f in fields] == ["integer"]
    assert check_outputs({"n": -1}, fields, allow_null=False) == ["$.n: -1 is less than the minimum of 0"]


def test_boolean_subschemas_are_schemas_and_a_definition_that_is_not_one_is_refused() -> None:
    fields = fields_from_json_schema(
        {
            "$defs": {"Anything": True},
            "properties": {"a": {"$ref": "#/$defs/Anything"}, "b": {"anyOf": [{"type": "integer"}, True]}},
        }
    )
    assert [(f.name, f.type) for f in fields] == [("a", "object"), ("b", "integer")]
    assert check_outputs({"a": [1], "b": "x"}, fields, allow_null=False) == []
    with pytest.raises(ValueError, match=r"not a valid JSON Schema \(Draft 2020-12\): \$\['\$defs'\]\.X"):
        fields_from_json_schema({"$defs": {"X": 5}, "properties": {"a": {"$ref": "#/$defs/X"}}})
    with pytest.raises(ValueError, match=r"not a valid JSON Schema \(Draft 2020-12\): \$\['\$defs'\]: \[\]"):
        fields_from_json_schema({"$defs": [], "properties": {"a": {"$ref": "#/$defs/0"}}})


def test_a_field_without_a_schema_among_typed_ones_is_checked_against_its_type() -> None:
    typed = fields_from_json_schema({"properties": {"s": {"type": "string"}}})
    fields = [FieldSpec(name="n", type="integer"), *typed]
    assert check_outputs({"n": "x", "s": 1}, fields, allow_null=False) == [
        "$.n: 'x' is not of type 'integer'",
        "$.s: 1 is not of type 'string'",
    ]


def test_a_field_missing_or_too_deep_does_not_stop_the_check_of_the_next() -> None:
    deep: list[Any] = []
    for _ in range(MAX_OUTPUT_DEPTH + 1):
        deep = [deep]
    status = "$.status: 'done' is not one of ['open', 'closed']"
    too_deep = f"$.items: nested deeper than {MAX_OUTPUT_DEPTH} levels"
    assert problems(items=deep, status="done") == [too_deep, status]
    values = {k: v for k, v in GOOD.items() if k != "items"} | {"status": "done"}
    assert check_outputs(values, FIELDS, allow_null=False) == ["$.items: missing (a required field)", status]


def test_the_value_budget_is_exact_and_shared_by_the_fields() -> None:
    arrays = {"a": {"type": "array"}, "b": {"type": "array"}}
    fields = fields_from_json_schema({"properties": arrays, "required": []})
    too_large = f"too large to check: the outputs hold more than {MAX_OUTPUT_VALUES} values"
    full = [0] * (MAX_OUTPUT_VALUES - 1)  # with the list itself: the budget exactly
    assert check_outputs({"a": full}, fields, allow_null=False) == []
    assert check_outputs({"a": [*full, 0]}, fields, allow_null=False) == [f"$.a: {too_large}"]
    half = [0] * (MAX_OUTPUT_VALUES // 2)  # 50,001 values each
    assert check_outputs({"a": half, "b": half}, fields, allow_null=False) == [f"$.b: {too_large}"]


def test_a_schema_that_cannot_be_applied_is_a_problem_that_names_the_error() -> None:
    field = FieldSpec(name="x", json_schema={"$ref": "#nowhere"})  # an anchor no subschema declares
    [line] = check_outputs({"x": 1}, [field], allow_null=False)
    found = re.fullmatch(r"\$\.x: the output schema could not be applied \((\w+): .*'nowhere'.*\)", line)
    assert found is not None and found.group(1).endswith("Error")
