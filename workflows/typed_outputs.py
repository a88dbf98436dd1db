"""Typed outputs: the fields an episode's answer has, how a prompt shows them, and the
check of values against them.

A field is named and typed, and (since typed outputs) carries its own JSON Schema (Draft
2020-12) taken from the caller's schema or pydantic model. SUBMIT's outputs and extraction's
both go through `check_outputs`, so their rules for missing, null and unknown fields live in
one place; the problems it returns are fed back to the model, one bounded line each. Pure:
workflow code checks outputs on every replay, so nothing here does I/O (not even a `$ref`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from itertools import islice
from typing import TYPE_CHECKING, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator

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

if TYPE_CHECKING:
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import ValidationError

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
    return cast(FieldType, kind)  # one of _JSON_TYPES, checked just above


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
    for key, kept in needed.items():
        given = prop.get(key)
        own = given if isinstance(given, dict) else {}
        schema[key] = {**own, **{n: d for n, d in root[key].items() if n in kept}}
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
    from jsonschema import Draft202012Validator  # start-up: ~60 ms that drlm show and the API skip
    from jsonschema.exceptions import SchemaError  # start-up: as above

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
    """Built once per schema (per process): requests are decoded again on every replay.
    Its registry is the bundled meta-schemas and nothing else: no `$ref` is ever fetched
    (workflow code does no I/O; jsonschema's default registry would fetch remote ones)."""
    import jsonschema_specifications  # start-up: ~60 ms that drlm show and the API skip
    from jsonschema import Draft202012Validator  # start-up: as above

    return Draft202012Validator(json.loads(key), registry=jsonschema_specifications.REGISTRY)


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
    from jsonschema.exceptions import best_match  # start-up: ~60 ms that drlm show and the API skip

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


# --- the fields as a prompt shows them ------------------------------------------------------


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
