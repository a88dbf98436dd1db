"""What one iteration did, as a value: the reply, each cell, and the model's answer if it
gave one. Pure functions turn cell outcomes into the answer and the next turn's messages,
so the loop only asks, acts, decides and observes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from durable_rlm.workflows import dspy_program, prompts
from durable_rlm.workflows.models import CellOutcome, EndReason, Message
from durable_rlm.workflows.typed_outputs import FieldSpec, check_outputs


@dataclass(frozen=True)
class CellRecord:
    """One cell as the loop saw it: ok, error, timeout, killed (the sandbox died) or lost
    (the worker running it was lost on every attempt; its effects were discarded)."""

    index: int
    code: str
    status: str
    stdout: str = ""
    stderr: str = ""
    error: str | None = None
    answer: str | None = None
    answer_kind: Literal["final", "final_var", "answer_ready"] | None = None
    submitted: dict[str, Any] | None = None

    @classmethod
    def of(cls, index: int, code: str, outcome: CellOutcome) -> CellRecord:
        status = outcome.cell_status or ("ok" if outcome.error is None else "error")
        return cls(
            index=index,
            code=code,
            status=status,
            stdout=outcome.stdout,
            stderr=outcome.stderr,
            error=outcome.error,
            answer=outcome.answer,
            answer_kind=outcome.answer_kind or ("answer_ready" if outcome.answer is not None else None),
            submitted=outcome.submitted,
        )

    @property
    def printed(self) -> tuple[str, str, str | None]:
        return self.stdout, self.stderr, self.error


@dataclass(frozen=True)
class ModelAnswer:
    """An answer the model gave: its text, how it gave it, and the typed outputs it fills."""

    text: str | None
    kind: EndReason
    outputs: dict[str, Any]


@dataclass
class IterationOutcome:
    iteration: int
    reply: str
    mean_logprob: float | None = None
    cells: list[CellRecord] = field(default_factory=list)
    answer: ModelAnswer | None = None
    notes: list[str] = field(default_factory=list)
    output: str | None = None
    """A DSPy program's step: its output as DSPy's REPL history shows it (None otherwise)."""


def answer_outputs(answer: str, fields: list[FieldSpec]) -> dict[str, Any] | None:
    """FINAL(...) fills the default single `answer` field, and nothing else."""
    if [f.name for f in fields] == ["answer"]:
        return {"answer": answer}
    return None


def answer_text(outputs: dict[str, Any], fields: list[FieldSpec]) -> str | None:
    """The answer as text: the `answer` field when that is the schema, else the JSON."""
    if [f.name for f in fields] == ["answer"]:
        value = outputs.get("answer")
        return None if value is None else value if isinstance(value, str) else json.dumps(value)
    return json.dumps(outputs, sort_keys=True)


def text_answer(text: str, kind: EndReason, fields: list[FieldSpec]) -> tuple[ModelAnswer | None, str | None]:
    """A FINAL-style answer, or the note that this episode needs SUBMIT instead."""
    outputs = answer_outputs(text, fields)
    if outputs is None:
        return None, prompts.NEEDS_SUBMIT
    return ModelAnswer(text, kind, outputs), None


def cell_answer(cell: CellRecord, fields: list[FieldSpec]) -> tuple[ModelAnswer | None, list[str], bool]:
    """(the answer a cell gave, notes for the model, whether the reply's later cells are
    skipped). A valid SUBMIT answers; an invalid one is a note and the reply goes on. FINAL,
    FINAL_VAR or the answer dict end the reply's cells even when they cannot fill a typed
    schema (then the note says to SUBMIT instead)."""
    notes: list[str] = []
    if cell.submitted is not None:
        problems = check_outputs(cell.submitted, fields, allow_null=False)
        if not problems:
            return ModelAnswer(answer_text(cell.submitted, fields), "submitted", cell.submitted), notes, True
        listed = any(f.json_schema is not None for f in fields)
        notes.append(prompts.submit_rejected(problems, listed))
    if cell.answer is not None:
        kind: EndReason = cell.answer_kind if cell.answer_kind in ("final", "final_var") else "answer_ready"
        answer, note = text_answer(cell.answer, kind, fields)
        notes.extend([note] if note else [])
        return answer, notes, True
    return None, notes, False


def submitted_answer(cell: CellRecord, fields: list[FieldSpec]) -> tuple[ModelAnswer | None, str]:
    """A DSPy program's step: SUBMIT's answer, else the step's output (DSPy's RLM ends on
    SUBMIT alone; a refused SUBMIT's reason is the step's output, what it printed is not)."""
    if cell.submitted is not None and cell.error is None:
        problems = check_outputs(cell.submitted, fields, allow_null=False)
        if not problems:
            return ModelAnswer(answer_text(cell.submitted, fields), "submitted", cell.submitted), ""
        return None, dspy_program.submit_rejected(problems)
    return None, dspy_program.cell_output(cell.stdout, cell.stderr, cell.error)


def next_turn(
    outcome: IterationOutcome,
    fence: str,
    output_truncation: int,
    answer_declined_by: str | None,
) -> list[Message]:
    """The user message that follows an iteration which did not end the episode."""
    if outcome.output is not None:  # a DSPy program's step: its output, then what else to know
        parts = [part for part in (outcome.output, *outcome.notes) if part]
        if answer_declined_by is not None:
            parts.append(prompts.ANSWER_NOT_ACCEPTED.format(policy=answer_declined_by))
        return [Message(role="user", content="\n\n".join(parts) or dspy_program.NO_OUTPUT)]
    parts = [
        prompts.observation(c.index, c.code, c.stdout, c.stderr, c.error, output_truncation)
        for c in outcome.cells
    ]
    parts.extend(outcome.notes)
    if answer_declined_by is not None:
        parts.append(prompts.ANSWER_NOT_ACCEPTED.format(policy=answer_declined_by))
    if not parts:
        return [Message(role="user", content=prompts.NO_CODE_TURN.format(fence=fence))]
    return [prompts.next_turn(parts)]
