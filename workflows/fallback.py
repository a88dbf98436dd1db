"""Fallback extraction (seed 004, SPEC-27): when a limit is hit before a submit, ask a model
to extract the outputs from the REPL history. Pure: trigger, prompt, reply parsing,
confidence and the result variants; the model call itself is activities/extraction.py.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from itertools import islice
from typing import Any, Literal

import jsonschema_specifications
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, ValidationError, best_match
from pydantic import BaseModel, ConfigDict, Field, field_validator

from durable_rlm.workflows import defaults
from durable_rlm.workflows.parsing import fenced_blocks, shorten_middle

# --- output fields ---------------------------------------------------------------------------

FieldType = Literal["string", "integer", "number", "boolean", "array", "object"]
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}


class FieldSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    type: FieldType = "string"
    description: str = ""
    required: bool = True
    json_schema: dict[str, Any] | None = Field(
        default=None,
        description="the property's own JSON Schema (Draft 2020-12), with the `$defs` it refers to; "
        "None: only `type` is checked, as in histories recorded before typed outputs",
    )

    @field_validator("json_schema")
    @classmethod
    def _valid_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            problem = _schema_problem(_key(value))
            if problem is not None:
                raise ValueError(problem)
        return value


ANSWER_FIELDS = [FieldSpec(name="answer", type="string", description="the final answer")]


# Typed outputs are checked one property at a time, so that SUBMIT's and extraction's rules
# for missing, null and unknown fields live in one place. A root keyword that constrains the
# outputs object as a whole would then be ignored: such a schema is refused instead.
_WHOLE_OBJECT_KEYWORDS = (
    "allOf",
    "anyOf",
    "oneOf",
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "minProperties",
    "maxProperties",
    "patternProperties",
    "propertyNames",
    "unevaluatedProperties",
    "$ref",
    "$dynamicRef",
    "enum",
    "const",
)
_DEFINITIONS = ("$defs", "definitions")
_VALUE_KEYWORDS = ("enum", "const", "default", "examples")  # JSON values, not schemas
_NAME_KEYWORDS = ("properties", "patternProperties", "dependentSchemas", *_DEFINITIONS)

# The bundled meta-schemas and nothing else: no `$ref` is ever fetched (workflow code does no
# I/O, and jsonschema's default registry would fetch remote references).
_REGISTRY = jsonschema_specifications.REGISTRY

MAX_PROBLEMS = 10  # lines of feedback on one rejected output
MAX_PROBLEM_CHARS = 300  # ...each
MAX_OUTPUT_DEPTH = 32  # nesting checked; the validator recurses per level, so deeper is refused
# Values checked in one output (a few microseconds each): more is refused, so that a huge
# SUBMIT cannot hold a workflow task past its timeout.
MAX_OUTPUT_VALUES = 100_000
SCHEMA_SHOWN_CHARS = 1_500  # a field's schema as a prompt shows it
MORE_PROBLEMS = "(more problems not listed)"


def _declared_type(prop: dict[str, Any], root: dict[str, Any]) -> Any:
    """A property's "type"; a `$ref` (a nested model or an enum) takes the type of what it
    points at in the root schema, under `$defs` or Draft 7's `definitions` alike."""
    if "$ref" in prop and "type" not in prop:
        ref = str(prop["$ref"])
        target = _pointer_target(root, ref[1:]) if ref.startswith("#/") else _NOWHERE
        return target.get("type", "object") if isinstance(target, dict) else "object"
    return prop.get("type")


def _field_type(name: str, prop: dict[str, Any], root: dict[str, Any]) -> FieldType:
    kind = _declared_type(prop, root)
    if kind is None and isinstance(prop.get("anyOf"), list):  # Optional[...] in pydantic's schema
        kind = [_declared_type(o, root) if isinstance(o, dict) else None for o in prop["anyOf"]]
    if isinstance(kind, list):  # e.g. ["string", "null"]
        kind = next((k for k in kind if k not in (None, "null")), "string")
    kind = kind or "string"
    if kind not in _JSON_TYPES:
        raise ValueError(f"output field {name!r}: unsupported type {kind!r}")
    return kind


def _refs(schema: Any) -> Iterator[str]:
    """Every `$ref` and `$dynamicRef` in a schema, at any depth (not inside `enum` values)."""
    stack: list[tuple[Any, bool]] = [(schema, False)]  # (node, whether its keys are names)
    while stack:
        node, names = stack.pop()
        if isinstance(node, list):
            stack.extend((item, False) for item in node)
        elif isinstance(node, dict) and names:
            stack.extend((value, False) for value in node.values())
        elif isinstance(node, dict):
            for key, value in node.items():
                if key in ("$ref", "$dynamicRef") and isinstance(value, str):
                    yield value
                elif key not in _VALUE_KEYWORDS:
                    stack.append((value, key in _NAME_KEYWORDS))


def _definition(ref: str, field: str) -> tuple[str, str]:
    """("$defs", name) for a reference into the root's definitions. Anything else is refused:
    a field's schema is checked as a document of its own, where no other part of the root is."""
    parts = ref.split("/")
    if len(parts) >= 3 and parts[0] == "#" and parts[1] in _DEFINITIONS:
        return parts[1], parts[2].replace("~1", "/").replace("~0", "~")
    raise ValueError(
        f"output field {field!r}: $ref {ref!r} is not supported; refer to definitions under "
        "'$defs' ('#/$defs/Name')"
    )


def _field_schema(name: str, prop: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    """The property's schema as a document of its own: the definitions it reaches, copied in."""
    needed: dict[str, set[str]] = {}
    todo = list(_refs(prop))
    while todo:
        key, wanted = _definition(todo.pop(), name)
        defs = root.get(key)
        if not isinstance(defs, dict) or wanted not in defs:
            raise ValueError(f"output field {name!r}: $ref to a missing definition '#/{key}/{wanted}'")
        if wanted not in needed.setdefault(key, set()):
            needed[key].add(wanted)
            todo.extend(_refs(defs[wanted]))
    schema = dict(prop)
    for key, wanted in needed.items():
        own = prop.get(key) if isinstance(prop.get(key), dict) else {}
        schema[key] = {**own, **{n: d for n, d in root[key].items() if n in wanted}}
    return schema


_NOWHERE = object()  # what a JSON Pointer that leads nowhere points at


def _pointer_target(schema: Any, pointer: str) -> Any:
    """What a JSON Pointer (RFC 6901: `/$defs/a~1b` for the definition `a/b`) points at in
    `schema`, or _NOWHERE."""
    target = schema
    for part in pointer.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            return _NOWHERE
    return target


def _schema_error(schema: dict[str, Any]) -> str | None:
    """Why `schema` is not a usable Draft 2020-12 schema, or None."""
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        return f"not a valid JSON Schema (Draft 2020-12): {exc.json_path}: {_clip(exc.message)}"
    for ref in _refs(schema):
        if not ref.startswith("#"):
            return f"$ref {ref!r} is not supported: only references inside the schema ('#/...') are"
        if ref.startswith("#/") and _pointer_target(schema, ref[1:]) is _NOWHERE:
            return f"$ref {ref!r} points at nothing in the schema"
    return None


def _key(schema: dict[str, Any]) -> str:
    """A schema as a cache key; equal schemas (in the same key order) give equal keys."""
    try:
        return json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"an output schema must be JSON: {exc}") from exc


@functools.lru_cache(maxsize=256)
def _schema_problem(key: str) -> str | None:
    return _schema_error(json.loads(key))


@functools.lru_cache(maxsize=256)
def _validator(key: str) -> Draft202012Validator:
    """Built once per schema (per process): requests are decoded again on every replay."""
    return Draft202012Validator(json.loads(key), registry=_REGISTRY)


def fields_from_json_schema(schema: dict[str, Any]) -> list[FieldSpec]:
    """Output fields from a JSON Schema object (what pydantic's model_json_schema() gives).
    Each field keeps its own schema, so every keyword is enforced; a schema that is not
    valid Draft 2020-12, or that the per-field check could not honour, is refused here."""
    if (
        not isinstance(schema, dict)
        or schema.get("type", "object") != "object"
        or not isinstance(schema.get("properties"), dict)
    ):
        raise ValueError("an output schema must be a JSON Schema object with 'properties'")
    required = set(schema.get("required", list(schema["properties"])))
    kinds = {}
    for name, prop in schema["properties"].items():
        if not isinstance(prop, dict):
            raise ValueError(f"output field {name!r}: its schema must be a JSON object")
        kinds[name] = _field_type(name, prop, schema)
    if not kinds:
        raise ValueError("an output schema needs at least one field")
    problem = _schema_error(schema)
    if problem is not None:
        raise ValueError(problem)
    for keyword in _WHOLE_OBJECT_KEYWORDS:
        if keyword in schema:
            raise ValueError(
                f"the output schema's root keyword {keyword!r} is not supported: put the "
                "constraints on the properties"
            )
    return [
        FieldSpec(
            name=name,
            type=kinds[name],
            description=prop.get("description", ""),
            required=name in required,
            json_schema=_field_schema(name, prop, schema),
        )
        for name, prop in schema["properties"].items()
    ]


def fields_from_model(model: type[BaseModel]) -> list[FieldSpec]:
    return fields_from_json_schema(model.model_json_schema())


def check_outputs(values: dict[str, Any], fields: list[FieldSpec], allow_null: bool) -> list[str]:
    """Problems with `values` against the fields. Fields with a JSON Schema: every keyword,
    one line per violation with its JSON path, at most MAX_PROBLEMS lines of bounded length.
    Fields without one (histories recorded before typed outputs): missing, unknown, mistyped,
    worded as those histories were. `allow_null` (extraction) lets any field be null or left out."""
    if all(f.json_schema is None for f in fields):
        return _type_problems(values, fields, allow_null)
    problems = list(islice(_schema_problems(values, fields, allow_null), MAX_PROBLEMS + 1))
    if len(problems) > MAX_PROBLEMS:
        problems[MAX_PROBLEMS:] = [MORE_PROBLEMS]
    return problems


def _type_problems(values: dict[str, Any], fields: list[FieldSpec], allow_null: bool) -> list[str]:
    problems = []
    known = {f.name for f in fields}
    for name in values:
        if name not in known and name != "_extraction_notes":
            problems.append(f"unknown field {name!r}")
    for spec in fields:
        if spec.name not in values:
            if spec.required and not allow_null:
                problems.append(f"missing field {spec.name!r}")
            continue
        value = values[spec.name]
        if value is None:
            if not allow_null:
                problems.append(f"field {spec.name!r} is null")
            continue
        wrong_bool = isinstance(value, bool) and spec.type in ("integer", "number")
        if wrong_bool or not isinstance(value, _JSON_TYPES[spec.type]):
            problems.append(f"field {spec.name!r} must be {spec.type}, got {type(value).__name__}")
    return problems


def _member(name: str) -> str:
    """`name` as a JSON path step: `.name`, or `["odd name"]`."""
    return f".{name}" if name.isidentifier() else f"[{json.dumps(name)}]"


def _schema_problems(values: dict[str, Any], fields: list[FieldSpec], allow_null: bool) -> Iterator[str]:
    known = {f.name for f in fields}
    for name in values:
        if name not in known and name != "_extraction_notes":
            yield _clip(f"${_member(name)}: not a field of the output schema")
    budget = MAX_OUTPUT_VALUES
    for spec in fields:
        where = f"${_member(spec.name)}"
        if spec.name not in values:
            if spec.required and not allow_null:
                yield f"{where}: missing (a required field)"
            continue
        value = values[spec.name]
        if value is None and allow_null:
            continue
        size = _measure(value, budget)
        if isinstance(size, str):
            yield f"{where}: {size}"
            continue
        budget -= size
        schema = spec.json_schema if spec.json_schema is not None else {"type": spec.type}
        try:
            for error in _validator(_key(schema)).iter_errors(value):
                # anyOf / oneOf: the reason of the branch the value came closest to.
                shown: ValidationError = (best_match([error]) or error) if error.context else error
                yield _clip(f"{where}{shown.json_path[1:]}: {shown.message}")
        except Exception as exc:  # noqa: BLE001 - a schema we could not apply is a problem, not a crash
            yield _clip(f"{where}: the output schema could not be applied ({type(exc).__name__}: {exc})")


def _measure(value: Any, budget: int) -> int | str:
    """How many values `value` holds, or why it is not checked: nested too deep, or more
    values than the budget left. Iterative, so no value can exhaust the stack here."""
    count = 0
    stack = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > budget:
            return f"too large to check: the outputs hold more than {MAX_OUTPUT_VALUES} values"
        if isinstance(node, dict | list):
            if depth >= MAX_OUTPUT_DEPTH:
                return f"nested deeper than {MAX_OUTPUT_DEPTH} levels"
            stack.extend((v, depth + 1) for v in (node.values() if isinstance(node, dict) else node))
    return count


def _clip(text: str, limit: int = MAX_PROBLEM_CHARS) -> str:
    """Head and tail of a long line: a message names the value first and the rule last."""
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    return f"{text[:head]} ... {text[len(text) - (limit - head - 5) :]}"


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


def format_output_fields(fields: list[FieldSpec]) -> str:
    return "\n".join(
        f"- {f.name} ({f.type}{', required' if f.required else ', optional'})"
        + (f": {f.description}" if f.description else "")
        + _constraints(f)
        for f in fields
    )


def _constraints(spec: FieldSpec) -> str:
    """The field's schema beyond its type and description, so the model knows every rule
    its value is checked against (titles left out: pydantic puts one on every property)."""
    if spec.json_schema is None:
        return ""
    shown = _without_titles(spec.json_schema)
    shown.pop("description", None)
    if shown in ({}, {"type": spec.type}):
        return ""
    return "; JSON Schema: " + _clip(json.dumps(shown, ensure_ascii=False), SCHEMA_SHOWN_CHARS)


def _without_titles(schema: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "title" and isinstance(value, str):
            continue
        if key in _NAME_KEYWORDS and isinstance(value, dict):
            value = {n: _without_titles(v) if isinstance(v, dict) else v for n, v in value.items()}
        elif key not in _VALUE_KEYWORDS and isinstance(value, dict):
            value = _without_titles(value)
        elif key not in _VALUE_KEYWORDS and isinstance(value, list):
            value = [_without_titles(v) if isinstance(v, dict) else v for v in value]
        out[key] = value
    return out


def generate_schema(fields: list[FieldSpec]) -> str:
    """One line per field, in the seed's `"name": "type (description)",` shape."""
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


def _json_object(text: str) -> dict[str, Any] | None:
    fenced = [b.code.strip() for b in fenced_blocks(text) if b.language in ("", "json", "JSON")]
    candidates = [text.strip(), *fenced]
    start, end = text.find("{"), text.rfind("}")
    if 0 <= start < end:
        candidates.append(text[start : end + 1])
    for candidate in candidates:
        try:
            value = json.loads(candidate)
        except (json.JSONDecodeError, ValueError):
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
    """The seed's clamp to [0.1, 0.99]. With the seed's weights the formula never goes
    below 0.2; the lower bound stands for weights that may change."""
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
    """Submitted | Extracted | Failed (seed 004), or Stopped by a policy, with the seed's
    accessors."""

    variant: Submitted | Extracted | Failed | Stopped = Field(discriminator="kind")

    def outputs(self) -> dict[str, Any] | None:
        return None if isinstance(self.variant, Failed) else self.variant.outputs

    def was_extracted(self) -> bool:
        return isinstance(self.variant, Extracted)

    def confidence(self) -> float | None:
        return self.variant.confidence()
