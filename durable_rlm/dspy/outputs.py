"""A DSPy signature's output fields as the episode's typed outputs, and their values as the
Prediction has them.

SUBMIT's values are checked in the workflow against each field's JSON Schema (pydantic's, of
the field's annotation), so a value of the wrong type is refused and the model tries again,
as under DSPy. A `str` field takes any value (DSPy makes it `str(value)`), and a type with no
JSON Schema is checked by DSPy alone. The Prediction's values are then DSPy's own parse of
what was submitted or extracted (`parse_value`, the adapter's), so they are what DSPy's RLM
would return.
"""

from __future__ import annotations

from typing import Any

import pydantic
from dspy.adapters.utils import parse_value

from durable_rlm.errors import DurableRLMError
from durable_rlm.workflows.typed_outputs import FieldSpec, fields_from_json_schema


class OutputParseError(DurableRLMError, ValueError):
    """An output value DSPy's parse refused: the Prediction cannot be built."""


def output_fields(signature: Any) -> list[FieldSpec]:
    """One typed output per output field, in the signature's order."""
    return [_field(name, info.annotation) for name, info in signature.output_fields.items()]


def _field(name: str, annotation: Any) -> FieldSpec:
    if annotation is str:
        return FieldSpec(name=name, type="string", json_schema={})
    try:
        definitions: dict[str, Any] = {name: (annotation, ...)}
        model = pydantic.create_model("Outputs", **definitions)
        schema = model.model_json_schema()
        prop = schema["properties"][name]
        prop.pop("title", None)
        single = {"type": "object", "properties": {name: prop}, "required": [name]}
        if "$defs" in schema:
            single["$defs"] = schema["$defs"]
        (spec,) = fields_from_json_schema(single)
        return spec
    except Exception:  # noqa: BLE001 - a type pydantic cannot describe: DSPy's parse checks it
        return FieldSpec(name=name, type="string", json_schema={})


def parsed(signature: Any, values: dict[str, Any]) -> dict[str, Any]:
    """`values` (submitted, or extracted text) as the Prediction holds them: each parsed as
    DSPy parses the field's type, in the signature's order."""
    out: dict[str, Any] = {}
    for name, info in signature.output_fields.items():
        try:
            out[name] = parse_value(values[name], info.annotation)
        except (ValueError, pydantic.ValidationError) as exc:
            raise OutputParseError(
                f"output field {name!r}: {values[name]!r} is no {info.annotation}: {exc}"
            ) from None
    return out
