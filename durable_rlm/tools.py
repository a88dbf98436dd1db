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
gets it from the log instead of calling again. Arguments and results must be JSON values.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from durable_rlm.settings import ConfigurationError
from workflows import defaults, names
from workflows.models import ToolParam, ToolSpec

RESERVED = names.REPL_RESERVED


@dataclass(frozen=True)
class RegisteredTool:
    fn: Callable[..., Any]
    spec: ToolSpec

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
        _REGISTRY[spec.name] = RegisteredTool(function, spec)
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
                kind=param.kind.name.lower(),  # type: ignore[arg-type]
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
    return next((name for name, entry in _REGISTRY.items() if entry.fn is fn), None)


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


def import_tool_modules(modules: tuple[str, ...]) -> None:
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigurationError(f"DRLM_TOOL_MODULES: cannot import {module!r}: {exc}") from exc
        except ToolRegistrationError as exc:
            raise ConfigurationError(f"DRLM_TOOL_MODULES: {module!r}: {exc}") from exc
