"""Custom tools: plain Python functions the REPL can call, run as durable activities.

    from durable_rlm.tools import tool

    @tool(timeout_s=10, max_attempts=2)
    def lookup_price(item: str) -> float:
        "The list price of an item, in EUR."
        ...

Register them in a module that the workers (and the CLI, which offers them to episodes)
import: name it in DRLM_TOOL_MODULES. Inside the REPL each tool is a function of the same
name, parameters and docstring; a call suspends the cell like `llm_query`, the workflow runs
the tool as an activity on the shared queue, and the result is recorded, so a rebuilt REPL
gets it from the log instead of calling again. Arguments are values of a closed set of types
(JSON's, and tuple, set, frozenset, bytes, date, datetime, time, timedelta, Decimal, UUID),
which the worker decodes without unpickling (activities/sandbox/values.py); a result is
any value: one that is no JSON value reaches the cell pickled (loaded in the sandbox only,
never in the worker), as rlms hands back the object itself.

rlms's form is a dict, `custom_tools={"name": fn_or_data}` (`offered`): functions become
tools under the dict's names, data values (any value that pickles) become REPL variables
set by the REPL's setup cell, so a rebuilt REPL has them too.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from durable_rlm.errors import ConfigurationError
from durable_rlm.workflows import defaults, names
from durable_rlm.workflows.models import ToolParam, ToolSpec

RESERVED = names.REPL_RESERVED


@dataclass(frozen=True)
class RegisteredTool:
    fn: Callable[..., Any]
    spec: ToolSpec
    source: Callable[..., Any] | None = field(default=None, compare=False)
    """The function as the caller gave it."""

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)


_REGISTRY: dict[str, RegisteredTool] = {}


class ToolRegistrationError(ValueError):
    """A tool that cannot be offered to the REPL as declared."""


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    timeout_s: float = defaults.TOOL_TIMEOUT_S,
    max_attempts: int = defaults.TOOL_ATTEMPTS,
) -> Any:
    """Register `fn` as a custom tool (usable bare, `@tool`, or with options)."""

    def register(function: Callable[..., Any]) -> Callable[..., Any]:
        spec = spec_of(function, name or function.__name__, timeout_s, max_attempts)
        _REGISTRY[spec.name] = RegisteredTool(function, spec, function)
        return function

    return register(fn) if fn is not None else register


def spec_of(function: Callable[..., Any], name: str, timeout_s: float, max_attempts: int) -> ToolSpec:
    if not name.isidentifier() or name in RESERVED or name.startswith("_"):
        raise ToolRegistrationError(f"tool name {name!r} is not a free Python identifier in the REPL")
    params = []
    signature = inspect.signature(function)
    for param in signature.parameters.values():
        has_default = param.default is not inspect.Parameter.empty
        if has_default:
            try:
                json.dumps(param.default)
            except (TypeError, ValueError) as exc:
                raise ToolRegistrationError(
                    f"tool {name!r}: the default of {param.name!r} is not a JSON value ({exc})"
                ) from exc
        params.append(
            ToolParam(
                name=param.name,
                kind=param.kind.name.lower(),  # type: ignore[arg-type]  # inspect's five kinds, as ToolParam names them
                has_default=has_default,
                default=param.default if has_default else None,
            )
        )
    shown = signature.replace(
        parameters=[p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()],
        return_annotation=inspect.Signature.empty,
    )
    return ToolSpec(
        name=name,
        params=params,
        signature=str(shown),
        doc=inspect.getdoc(function) or "",
        timeout_s=timeout_s,
        max_attempts=max_attempts,
    )


def registered(name: str) -> RegisteredTool | None:
    return _REGISTRY.get(name)


def registered_as(fn: Callable[..., Any]) -> str | None:
    """The name a function is registered under (it may differ from its __name__)."""
    return next((name for name, entry in _REGISTRY.items() if fn in (entry.fn, entry.source)), None)


ToolsArgument = Sequence[Callable[..., Any] | str] | Mapping[str, Any] | None


@dataclass(frozen=True)
class OfferedTools:
    """What `tools=` / `custom_tools=` asks the REPL to offer: tool names (registered) and
    data values by name (set by the setup cell)."""

    names: list[str] | None
    data: dict[str, Any]
    descriptions: dict[str, str] = field(default_factory=dict)

    def value_lines(self) -> list[str]:
        """What the model reads about each data value: name, type, and its description."""
        lines = []
        for name, value in self.data.items():
            about = self.descriptions.get(name)
            lines.append(f"`{name}` ({type(value).__name__})" + (f" - {about}" if about else ""))
        return lines

    def setup_code(self) -> str | None:
        """The cell that binds the data values, so the cell log holds the values themselves:
        JSON text for a JSON value, else the value pickled (loaded in the sandbox, which is
        where the cell runs)."""
        if not self.data:
            return None
        import cloudpickle  # start-up: only an episode with data values that JSON cannot hold

        lines = ["import json as _drlm_json, pickle as _drlm_pickle"]
        for name, value in self.data.items():
            if _is_json(value):
                lines.append(f"{name} = _drlm_json.loads({json.dumps(value)!r})")
            else:
                lines.append(f"{name} = _drlm_pickle.loads({cloudpickle.dumps(value, protocol=5)!r})")
        lines.append("del _drlm_json, _drlm_pickle")
        return "\n".join(lines)


def offered(tools: ToolsArgument) -> OfferedTools:
    """Check and register what `tools` names. A sequence holds functions (registered on
    first use) and names of registered tools; rlms's dict maps a name to a function (a tool
    of that name) or to data (a REPL variable). Every misuse is a ConfigurationError that
    names the tool. None offers every registered tool."""
    if tools is None:
        return OfferedTools(None, {})
    if isinstance(tools, Mapping):
        return _offered_dict(tools)
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise ConfigurationError(
            f"tools must be a list of functions or tool names, or a dict of name -> function or "
            f"data (rlms's custom_tools), not {type(tools).__name__}"
        )
    names: list[str] = []
    for position, item in enumerate(tools):
        if isinstance(item, str):
            names.append(item)
        elif callable(item):
            names.append(_registered_function(getattr(item, "__name__", ""), item, bare=True))
        else:
            raise ConfigurationError(
                f"tool {item!r} (at position {position}, a {type(item).__name__}) is neither a "
                "function nor the name of a registered tool"
            )
    return OfferedTools(names, {})


def _offered_dict(tools: Mapping[Any, Any]) -> OfferedTools:
    names: list[str] = []
    data: dict[str, Any] = {}
    descriptions: dict[str, str] = {}
    for name, value in tools.items():
        if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
            raise ConfigurationError(f"tool name {name!r} is not a Python identifier the REPL can bind")
        if name in RESERVED:
            raise ConfigurationError(f"tool name {name!r} is taken by the REPL itself")
        description = None
        if isinstance(value, dict) and "tool" in value:
            # rlms also takes {"tool": fn_or_data, "description": ...}
            description = value.get("description") if isinstance(value.get("description"), str) else None
            value = value["tool"]
        if callable(value) and not isinstance(value, type):
            names.append(_registered_function(name, value, bare=False))
            entry = _REGISTRY[name]
            if description and entry.spec.doc != description:  # what the model reads about it
                _REGISTRY[name] = dataclasses.replace(
                    entry, spec=entry.spec.model_copy(update={"doc": description})
                )
            continue
        if not _is_json(value):
            import cloudpickle  # start-up: only data values that JSON cannot hold

            try:
                cloudpickle.dumps(value, protocol=5)
            except Exception as exc:  # noqa: BLE001 - whatever a value's __reduce__ raises
                raise ConfigurationError(
                    f"tool {name!r}: its data ({type(value).__name__}) cannot be pickled, and the "
                    f"REPL runs in a process of its own ({type(exc).__name__}: {exc})"
                ) from None
        data[name] = value
        if description:
            descriptions[name] = description
    return OfferedTools(names, data, descriptions)


def _is_json(value: Any) -> bool:
    """A value JSON gives back as it is (a tuple, a NaN or an int key would not be)."""
    try:
        return bool(json.loads(json.dumps(value, allow_nan=False)) == value)
    except (TypeError, ValueError):
        return False


def _registered_function(name: str, fn: Callable[..., Any], bare: bool) -> str:
    """The name `fn` is registered under, registering it as `name` on first use."""
    known = registered_as(fn)
    if known is not None and (bare or known == name):
        return known
    taken = registered(name)
    if taken is not None:
        raise ConfigurationError(f"tool {name!r}: a different tool is already registered as {name!r}")
    try:
        tool(fn, name=name)
    except ToolRegistrationError as exc:
        raise ConfigurationError(str(exc)) from exc
    except (TypeError, ValueError) as exc:  # inspect.signature of a builtin without one
        raise ConfigurationError(f"tool {name!r}: cannot read its signature ({exc})") from exc
    return name


def tool_specs(names: list[str] | None = None) -> list[ToolSpec]:
    """The specs of the named tools (all registered ones when None); unknown names are an
    error before anything starts."""
    if names is None:
        return [entry.spec for entry in _REGISTRY.values()]
    missing = [n for n in names if n not in _REGISTRY]
    if missing:
        known = ", ".join(sorted(_REGISTRY)) or "none (set DRLM_TOOL_MODULES)"
        raise ConfigurationError(f"unknown tool(s) {', '.join(missing)}; registered: {known}")
    return [_REGISTRY[n].spec for n in names]
