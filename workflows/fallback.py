"""Fallback extraction (docs/behaviour/fallback-extraction.md: DSPy's and rlm-core's
behaviour, kept example for example): when a limit is hit before a submit, ask a model
to extract the outputs from the REPL history. Pure: trigger, prompt, reply parsing,
confidence and the result variants; the model call itself is activities/extraction.py, the
output fields and their check are workflows/typed_outputs.py.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from durable_rlm.workflows import defaults
from durable_rlm.workflows.parsing import iter_fenced_blocks, shorten_middle
from durable_rlm.workflows.typed_outputs import (
    FieldSpec,
    check_outputs,
    format_output_fields,
)

# --- trigger ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExecutionState:
    iterations: int
    llm_calls: int
    elapsed: timedelta
    submitted: bool = False


class FallbackReason(BaseModel):
    """Why extraction ran; str() is the readable form used in the prompt and the result."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal[
        "max_iterations",
        "max_llm_calls",
        "timeout",
        "context_overflow",
        "cancelled",
        "max_model_calls",
        "max_tokens",
        "max_cost_usd",
        "finish_requested",
    ]
    value: float
    limit: float
    detail: str | None = None

    def __str__(self) -> str:
        if self.kind == "cancelled":
            return f"Cancelled ({self.detail})" if self.detail else "Cancelled"
        if self.kind == "finish_requested":
            return f"asked to answer now ({self.detail})" if self.detail else "asked to answer now"
        if self.kind == "max_model_calls":
            return f"model-call budget spent ({self.value:g}/{self.limit:g}, one kept for extraction)"
        if self.kind == "max_tokens":
            return f"token budget spent ({self.value:g}/{self.limit:g} tokens)"
        if self.kind == "max_cost_usd":
            return f"cost budget spent (${self.value:.4f} of ${self.limit:.4f})"
        if self.kind == "max_iterations":
            return f"max iterations reached ({self.value:g}/{self.limit:g})"
        if self.kind == "max_llm_calls":
            return f"max LLM calls reached ({self.value:g}/{self.limit:g})"
        if self.kind == "context_overflow":
            return (
                "the conversation no longer fits the root model's context window, even after "
                f"compaction ({self.value:g} compaction(s))"
            )
        return f"timeout ({self.value:.1f}s elapsed, limit {self.limit:.1f}s)"


@dataclass(frozen=True)
class FallbackTrigger:
    max_iterations: int = defaults.MAX_ITERATIONS
    max_llm_calls: int = defaults.MAX_LLM_CALLS
    max_duration: timedelta = defaults.SEED_TRIGGER_MAX_DURATION

    def should_trigger(self, state: ExecutionState) -> FallbackReason | None:
        """Priority: submitted (no fallback) > max iterations > max LLM calls > timeout."""
        if state.submitted:
            return None
        if state.iterations >= self.max_iterations:
            return FallbackReason(kind="max_iterations", value=state.iterations, limit=self.max_iterations)
        if state.llm_calls >= self.max_llm_calls:
            return FallbackReason(kind="max_llm_calls", value=state.llm_calls, limit=self.max_llm_calls)
        if state.elapsed >= self.max_duration:
            return FallbackReason(
                kind="timeout",
                value=state.elapsed.total_seconds(),
                limit=self.max_duration.total_seconds(),
            )
        return None


# --- extraction inputs and prompt ---------------------------------------------------------------


class REPLHistoryEntry(BaseModel):
    iteration: int
    reasoning: str | None = None
    code: str
    output: str
    success: bool


class ExtractFallbackInputs(BaseModel):
    history: list[REPLHistoryEntry]
    variables: dict[str, Any]
    output_fields: list[FieldSpec]
    fallback_reason: str
    task: str | None = Field(default=None, description="the episode's task; None: not known")


EXTRACTION_TASK_CHARS = 4_000  # a longer task is shown by its head and tail

EXTRACTION_PROMPT_TEMPLATE = """
The REPL execution reached its limit ({fallback_reason}).
Extract the final outputs from the execution history and variables.
{task}
## REPL History

{history}

## Current Variables

{variables}

## Required Outputs

You must extract values for these fields:
{output_fields}

## Instructions

1. Review the REPL history to understand what was computed
2. Look at the current variable values
3. Extract or infer the required output values
4. Return ONLY valid JSON matching the output schema

If a value cannot be determined, use null and explain in _extraction_notes.

## Output Schema

```json
{{
{output_schema}
  "_extraction_notes": "string (optional explanation)"
}}
```

Return the JSON now:
"""

EXTRACTION_MARKER = "The REPL execution reached its limit"


def format_history(history: list[REPLHistoryEntry]) -> str:
    return "\n".join(
        f"### Iteration {e.iteration}\n{e.reasoning or ''}\n```python\n{e.code}\n```\nOutput: {e.output}\n"
        for e in history
    )


def format_variables(variables: dict[str, Any]) -> str:
    if not variables:
        return "(none)"
    return "\n".join(f"- {name} = {_text(value)}" for name, value in variables.items())


def generate_schema(fields: list[FieldSpec]) -> str:
    """One line per field, in the specified `"name": "type (description)",` shape (pinned
    word for word in tests/golden/prompts.txt)."""
    return "\n".join(
        f'  "{f.name}": "{f.type}' + (f" ({f.description})" if f.description else "") + '",' for f in fields
    )


def extraction_prompt(inputs: ExtractFallbackInputs) -> str:
    # One format() pass: text put into the template (REPL output, variable values) is never
    # scanned again, so its braces and placeholder-like words reach the model as they were.
    task = inputs.task.strip() if inputs.task else ""
    return EXTRACTION_PROMPT_TEMPLATE.format(
        fallback_reason=inputs.fallback_reason,
        task=f"\n## Task\n\n{shorten_middle(task, EXTRACTION_TASK_CHARS)}\n" if task else "",
        history=format_history(inputs.history),
        variables=format_variables(inputs.variables),
        output_fields=format_output_fields(inputs.output_fields),
        output_schema=generate_schema(inputs.output_fields),
    )


# --- the reply -----------------------------------------------------------------------------------


EXTRACTION_FENCES_READ = 16
"""Fenced blocks of an extraction reply looked into for its JSON: the answer is in one of
the first, and a reply of a million blocks must not cost a million parses (workflow code)."""


def _json_candidates(text: str) -> Iterator[str]:
    yield text.strip()
    for block in itertools.islice(iter_fenced_blocks(text), EXTRACTION_FENCES_READ):
        if block.language in ("", "json", "JSON"):
            yield block.code.strip()
    start, end = text.find("{"), text.rfind("}")
    if 0 <= start < end:
        yield text[start : end + 1]


def _json_object(text: str) -> dict[str, Any] | None:
    for candidate in _json_candidates(text):
        try:
            value = json.loads(candidate)
        except (ValueError, RecursionError):  # not JSON; or nested past the parser's depth
            continue
        if isinstance(value, dict):
            return value
    return None


@dataclass(frozen=True)
class ParsedExtraction:
    outputs: dict[str, Any] | None
    notes: str | None
    error: str | None
    partial: dict[str, Any] | None


def parse_extraction_response(text: str, fields: list[FieldSpec]) -> ParsedExtraction:
    """Raw JSON or JSON in a markdown fence; anything else is a failure that keeps whatever
    JSON object could be read as partial outputs."""
    value = _json_object(text or "")
    if value is None:
        return ParsedExtraction(None, None, "Failed to parse extraction: no JSON object in the reply", None)
    notes = value.get("_extraction_notes")
    outputs = {k: v for k, v in value.items() if k != "_extraction_notes"}
    problems = check_outputs(outputs, fields, allow_null=True)
    if problems:
        return ParsedExtraction(None, None, "Failed to parse extraction: " + "; ".join(problems), outputs)
    full = {f.name: outputs.get(f.name) for f in fields}
    return ParsedExtraction(full, notes if isinstance(notes, str) else None, None, outputs)


# --- confidence ----------------------------------------------------------------------------------


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


def outputs_in_variables(outputs: dict[str, Any], variables: dict[str, Any]) -> bool:
    """Some extracted value is the value of a REPL variable."""
    values = {_text(v).strip() for v in variables.values()}
    return any(v is not None and _text(v).strip() in values for v in outputs.values())


def outputs_in_history(outputs: dict[str, Any], history: list[REPLHistoryEntry], recent: int = 3) -> bool:
    """Some extracted value appears in the output of one of the last `recent` iterations."""
    texts = [e.output for e in history[-recent:]]
    return any(
        v is not None and _text(v).strip() and any(_text(v).strip() in t for t in texts)
        for v in outputs.values()
    )


def null_field_ratio(outputs: dict[str, Any]) -> float:
    return sum(v is None for v in outputs.values()) / len(outputs) if outputs else 1.0


def calculate_extraction_confidence(
    outputs: dict[str, Any], history: list[REPLHistoryEntry], variables: dict[str, Any]
) -> float:
    confidence = 0.5
    if outputs_in_variables(outputs, variables):
        confidence += 0.3
    if outputs_in_history(outputs, history):
        confidence += 0.2
    confidence -= null_field_ratio(outputs) * 0.3
    return clamp_confidence(confidence)


def clamp_confidence(value: float) -> float:
    """The specified clamp to [0.1, 0.99]. With today's weights the formula never goes
    below 0.2; the lower bound stands for weights that may change
    (docs/architecture/decisions.md#behaviour-kept-from-the-specifications)."""
    return round(min(max(value, 0.1), 0.99), 6)


# --- the result ----------------------------------------------------------------------------------


class Submitted(BaseModel):
    kind: Literal["submitted"] = "submitted"
    outputs: dict[str, Any]
    iterations: int
    llm_calls: int

    def confidence(self) -> float:
        return 1.0


class Extracted(BaseModel):
    kind: Literal["extracted"] = "extracted"
    outputs: dict[str, Any]
    confidence_value: float = Field(alias="confidence")
    reason: FallbackReason
    extraction_notes: str | None = None
    model_config = ConfigDict(populate_by_name=True)

    def confidence(self) -> float:
        return self.confidence_value


class Failed(BaseModel):
    kind: Literal["failed"] = "failed"
    reason: str
    partial_outputs: dict[str, Any] | None = None
    history: list[REPLHistoryEntry] = Field(default_factory=list)

    def confidence(self) -> float:
        return 0.0


class Stopped(BaseModel):
    """A termination policy stopped the episode on an iteration where the model gave no
    answer (say a reward threshold mid-computation). `outputs` holds an answer the policy
    itself found, if any; no confidence is claimed for it."""

    kind: Literal["stopped"] = "stopped"
    policy: str
    reason: str
    outputs: dict[str, Any] | None = None
    iterations: int
    llm_calls: int

    def confidence(self) -> None:
        return None


class ExecutionResult(BaseModel):
    """Submitted | Extracted | Failed, or Stopped by a policy, with the accessors fallback
    extraction's users know (docs/behaviour/fallback-extraction.md)."""

    variant: Submitted | Extracted | Failed | Stopped = Field(discriminator="kind")

    def outputs(self) -> dict[str, Any] | None:
        return None if isinstance(self.variant, Failed) else self.variant.outputs

    def was_extracted(self) -> bool:
        return isinstance(self.variant, Extracted)

    def confidence(self) -> float | None:
        return self.variant.confidence()
