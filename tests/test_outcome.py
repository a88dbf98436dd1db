"""What one iteration did, as a value (workflows/outcome.py): a cell as the loop saw it, the
answer a cell gives (FINAL-style or SUBMIT), and the next turn's message. Pure; the SUBMIT
schema checks themselves are in tests/test_typed_outputs.py."""

from __future__ import annotations

from typing import Any

import pytest

from durable_rlm.workflows import prompts
from durable_rlm.workflows.models import CellOutcome, Message
from durable_rlm.workflows.outcome import (
    CellRecord,
    IterationOutcome,
    ModelAnswer,
    answer_outputs,
    answer_text,
    cell_answer,
    next_turn,
    text_answer,
)
from durable_rlm.workflows.typed_outputs import ANSWER_FIELDS, MAX_PROBLEMS, MORE_PROBLEMS, FieldSpec

TYPED = [FieldSpec(name="title", type="string"), FieldSpec(name="year", type="integer")]
SCHEMA = [FieldSpec(name="year", json_schema={"type": "integer", "minimum": 1900})]


def outcome(**fields: Any) -> CellOutcome:
    return CellOutcome(status="completed", log_head="h", worker_queue="q", **fields)


# --- a cell as the loop saw it --------------------------------------------------------------------


def test_a_cell_record_keeps_what_the_cell_printed_answered_and_submitted() -> None:
    record = CellRecord.of(
        4,
        "print(1)",
        outcome(stdout="1\n", stderr="warn", error="E", answer="a", answer_kind="final", submitted={"x": 1}),
    )
    assert record == CellRecord(
        index=4,
        code="print(1)",
        status="error",
        stdout="1\n",
        stderr="warn",
        error="E",
        answer="a",
        answer_kind="final",
        submitted={"x": 1},
    )
    assert record.printed == ("1\n", "warn", "E")


@pytest.mark.parametrize(
    ("cell_status", "error", "status"),
    [
        (None, None, "ok"),
        (None, "NameError: x", "error"),
        ("timeout", "timed out", "timeout"),
        ("lost", None, "lost"),
    ],
)
def test_a_cells_status_is_the_sandboxs_else_ok_or_error(
    cell_status: str | None, error: str | None, status: str
) -> None:
    assert CellRecord.of(1, "x", outcome(cell_status=cell_status, error=error)).status == status


@pytest.mark.parametrize(
    ("answer", "answer_kind", "kind"),
    [
        (None, None, None),
        ("42", None, "answer_ready"),
        ("42", "final_var", "final_var"),
        (None, "final", "final"),
    ],
)
def test_an_answer_without_a_kind_is_an_answer_dict(
    answer: str | None, answer_kind: str | None, kind: str | None
) -> None:
    assert CellRecord.of(1, "x", outcome(answer=answer, answer_kind=answer_kind)).answer_kind == kind


def test_a_cell_record_defaults_to_a_silent_cell_without_an_answer() -> None:
    record = CellRecord(index=1, code="x", status="ok")
    assert record.printed == ("", "", None)
    assert (record.answer, record.answer_kind, record.submitted) == (None, None, None)


def test_an_iteration_starts_with_no_cells_no_answer_and_no_notes() -> None:
    first, second = IterationOutcome(iteration=1, reply="r"), IterationOutcome(iteration=2, reply="r")
    assert (first.cells, first.answer, first.notes, first.mean_logprob) == ([], None, [], None)
    first.notes.append("n")
    assert second.notes == []  # each its own list


# --- answers --------------------------------------------------------------------------------------


def test_final_fills_the_default_answer_field_and_nothing_else() -> None:
    assert answer_outputs("42", ANSWER_FIELDS) == {"answer": "42"}
    assert answer_outputs("42", TYPED) is None
    assert answer_outputs("42", [FieldSpec(name="result")]) is None
    assert answer_outputs("42", [FieldSpec(name="answer"), FieldSpec(name="why")]) is None


@pytest.mark.parametrize(
    ("outputs", "text"),
    [
        ({"answer": "42"}, "42"),
        ({"answer": None}, None),
        ({}, None),
        ({"answer": 42}, "42"),
        ({"answer": {"b": 1, "a": [1, 2]}}, '{"b": 1, "a": [1, 2]}'),  # keeps the model's order
    ],
)
def test_the_answer_field_is_the_answer_text(outputs: dict[str, Any], text: str | None) -> None:
    assert answer_text(outputs, ANSWER_FIELDS) == text


def test_typed_outputs_are_the_answer_as_sorted_json() -> None:
    assert answer_text({"year": 1999, "title": "x"}, TYPED) == '{"title": "x", "year": 1999}'
    assert (
        answer_text({"answer": "42"}, [FieldSpec(name="answer"), FieldSpec(name="why")]) == '{"answer": "42"}'
    )


def test_a_final_style_answer_answers_only_the_default_schema() -> None:
    assert text_answer("42", "final", ANSWER_FIELDS) == (ModelAnswer("42", "final", {"answer": "42"}), None)
    assert text_answer("42", "final_var", TYPED) == (None, prompts.NEEDS_SUBMIT)


# --- the answer a cell gives ----------------------------------------------------------------------


def cell(**fields: Any) -> CellRecord:
    return CellRecord(index=1, code="x", status="ok", **fields)


def test_a_cell_without_an_answer_goes_on() -> None:
    assert cell_answer(cell(), ANSWER_FIELDS) == (None, [], False)


def test_a_valid_submit_answers_and_ends_the_replys_cells() -> None:
    submitted = {"title": "x", "year": 1999}
    assert cell_answer(cell(submitted=submitted), TYPED) == (
        ModelAnswer('{"title": "x", "year": 1999}', "submitted", submitted),
        [],
        True,
    )
    assert cell_answer(cell(submitted={"answer": "42"}), ANSWER_FIELDS) == (
        ModelAnswer("42", "submitted", {"answer": "42"}),
        [],
        True,
    )


def test_an_invalid_submit_is_a_note_and_the_reply_goes_on() -> None:
    answer, notes, stop = cell_answer(cell(submitted={"title": "x"}), TYPED)
    assert (answer, stop) == (None, False)
    assert notes == [prompts.submit_rejected(["missing field 'year'"], listed=False)]


def test_an_invalid_submits_note_names_every_problem_on_one_line() -> None:
    _, notes, _ = cell_answer(cell(submitted={"title": 3, "extra": 1}), TYPED)
    assert notes == [
        "SUBMIT was rejected: unknown field 'extra'; field 'title' must be string, got int; "
        "missing field 'year'. Fix the values and call SUBMIT again."
    ]


def test_a_schema_checked_submits_note_lists_its_problems_one_a_line() -> None:
    fields = [*SCHEMA, FieldSpec(name="tags", json_schema={"type": "array", "items": {"type": "string"}})]
    _, notes, _ = cell_answer(cell(submitted={"year": 1066, "tags": ["a", 2]}), fields)
    assert notes == [
        "SUBMIT was rejected:\n"
        "- $.year: 1066 is less than the minimum of 1900\n"
        "- $.tags[1]: 2 is not of type 'string'\n"
        "Fix the values and call SUBMIT again."
    ]


@pytest.mark.parametrize("wrong", [MAX_PROBLEMS - 1, MAX_PROBLEMS])
def test_a_note_lists_up_to_max_problems(wrong: int) -> None:
    fields = [FieldSpec(name=f"f{i}", json_schema={"type": "integer"}) for i in range(MAX_PROBLEMS + 2)]
    values = {f.name: ("x" if i < wrong else i) for i, f in enumerate(fields)}
    _, [note], _ = cell_answer(cell(submitted=values), fields)
    assert note.count("is not of type 'integer'") == wrong and MORE_PROBLEMS not in note


def test_a_note_says_when_there_are_more_problems_than_it_lists() -> None:
    fields = [FieldSpec(name=f"f{i}", json_schema={"type": "integer"}) for i in range(MAX_PROBLEMS + 2)]
    _, [note], _ = cell_answer(cell(submitted={f.name: "x" for f in fields}), fields)
    assert note.count("is not of type 'integer'") == MAX_PROBLEMS and f"- {MORE_PROBLEMS}" in note


def test_a_submit_may_not_leave_a_field_null() -> None:
    answer, notes, stop = cell_answer(cell(submitted={"title": "x", "year": None}), TYPED)
    assert (answer, stop) == (None, False) and len(notes) == 1


def test_a_schema_checked_submit_lists_each_violation_on_its_own_line() -> None:
    answer, notes, stop = cell_answer(cell(submitted={"year": 1066}), SCHEMA)
    assert (answer, stop) == (None, False)
    assert notes == [prompts.submit_rejected(["$.year: 1066 is less than the minimum of 1900"], listed=True)]
    assert notes[0] != prompts.submit_rejected(
        ["$.year: 1066 is less than the minimum of 1900"], listed=False
    )


@pytest.mark.parametrize(
    ("answer_kind", "kind"),
    [
        ("final", "final"),
        ("final_var", "final_var"),
        ("answer_ready", "answer_ready"),
        (None, "answer_ready"),
        ("odd", "answer_ready"),
    ],
)
def test_a_final_style_answer_ends_the_replys_cells(answer_kind: str | None, kind: str) -> None:
    assert cell_answer(cell(answer="42", answer_kind=answer_kind), ANSWER_FIELDS) == (
        ModelAnswer("42", kind, {"answer": "42"}),  # type: ignore[arg-type]
        [],
        True,
    )


def test_a_final_style_answer_to_a_typed_schema_ends_the_cells_and_asks_for_submit() -> None:
    assert cell_answer(cell(answer="42", answer_kind="final"), TYPED) == (None, [prompts.NEEDS_SUBMIT], True)


def test_an_invalid_submit_and_a_final_in_one_cell_answer_with_the_final() -> None:
    answer, notes, stop = cell_answer(
        cell(submitted={"answer": 3}, answer="42", answer_kind="final"), ANSWER_FIELDS
    )
    assert answer == ModelAnswer("42", "final", {"answer": "42"}) and stop
    assert len(notes) == 1 and "answer" in notes[0]


# --- the next turn --------------------------------------------------------------------------------


def test_a_reply_without_cells_or_notes_is_told_to_write_code() -> None:
    assert next_turn(IterationOutcome(iteration=1, reply="hm"), "python", 1_000, None) == [
        Message(role="user", content=prompts.NO_CODE_TURN.format(fence="python"))
    ]


def test_the_next_turn_shows_each_cell_then_the_notes_then_the_declined_answer() -> None:
    cells = [
        CellRecord(index=1, code="print(1)", status="ok", stdout="1"),
        CellRecord(index=2, code="boom()", status="error", stdout="", stderr="w", error="NameError"),
    ]
    iteration = IterationOutcome(iteration=3, reply="r", cells=cells, notes=["a note"])
    assert next_turn(iteration, "repl", 1_000, "reward_threshold") == [
        prompts.next_turn(
            [
                prompts.observation(1, "print(1)", "1", "", None, 1_000),
                prompts.observation(2, "boom()", "", "w", "NameError", 1_000),
                "a note",
                prompts.ANSWER_NOT_ACCEPTED.format(policy="reward_threshold"),
            ]
        )
    ]


def test_the_next_turn_truncates_output_at_the_episodes_limit() -> None:
    iteration = IterationOutcome(
        iteration=1, reply="r", cells=[CellRecord(index=1, code="x", status="ok", stdout="y" * 5_000)]
    )
    [short] = next_turn(iteration, "repl", 100, None)
    [long] = next_turn(iteration, "repl", 4_000, None)
    assert (
        short.content == prompts.next_turn([prompts.observation(1, "x", "y" * 5_000, "", None, 100)]).content
    )
    assert len(short.content) < len(long.content)


def test_notes_alone_or_a_declined_answer_alone_make_a_turn() -> None:
    assert next_turn(IterationOutcome(iteration=1, reply="r", notes=["n"]), "repl", 1_000, None) == [
        prompts.next_turn(["n"])
    ]
    assert next_turn(IterationOutcome(iteration=1, reply="r"), "repl", 1_000, "p") == [
        prompts.next_turn([prompts.ANSWER_NOT_ACCEPTED.format(policy="p")])
    ]
