"""rlms's environment interfaces (rlm/environments/base_env.py): the names a REPL keeps for
itself, custom tools as rlms reads them (a value, or {"tool": value, "description": ...}),
how its prompt lists them, and the protocols a REPL implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from durable_rlm.rlms.types import REPLResult

RESERVED_TOOL_NAMES: frozenset[str] = frozenset(
    {
        "llm_query",
        "llm_query_batched",
        "rlm_query",
        "rlm_query_batched",
        "SHOW_VARS",
        "answer",
        "context",
        "history",
    }
)
"""The REPL's own names: no custom tool may take one, and a cell that rebinds one changes
nothing after it."""


@dataclass
class ToolInfo:
    name: str
    value: Any
    description: str | None = None

    @property
    def is_callable(self) -> bool:
        return callable(self.value)


def parse_tool_entry(name: str, entry: Any) -> ToolInfo:
    """A tool as rlms reads it: {"tool": value, "description": text} or the value alone."""
    if isinstance(entry, dict) and "tool" in entry:
        description = entry.get("description")
        return ToolInfo(name, entry["tool"], description if isinstance(description, str) else None)
    return ToolInfo(name, entry)


def parse_custom_tools(custom_tools: dict[str, Any] | None) -> list[ToolInfo]:
    return [parse_tool_entry(name, entry) for name, entry in (custom_tools or {}).items()]


def extract_tool_value(entry: Any) -> Any:
    return parse_tool_entry("", entry).value


def format_tools_for_prompt(custom_tools: dict[str, Any] | None) -> str | None:
    """One line per tool as rlms's prompt lists them; None when there are none."""
    lines = []
    for tool in parse_custom_tools(custom_tools):
        if tool.description:
            lines.append(f"- `{tool.name}`: {tool.description}")
        elif tool.is_callable:
            lines.append(f"- `{tool.name}`: A custom function")
        else:
            lines.append(f"- `{tool.name}`: A custom {type(tool.value).__name__} value")
    return "\n".join(lines) or None


def validate_custom_tools(custom_tools: dict[str, Any] | None) -> None:
    """rlms's check: a tool that would take one of the REPL's own names is a ValueError."""
    taken = sorted(set(custom_tools or {}) & RESERVED_TOOL_NAMES)
    if taken:
        raise ValueError(
            f"Custom tools cannot override reserved REPL functions: {taken}. "
            f"Reserved names: {sorted(RESERVED_TOOL_NAMES)}"
        )


@runtime_checkable
class SupportsCustomTools(Protocol):
    """A REPL that offers custom tools and data."""

    custom_tools: dict[str, Any]


@runtime_checkable
class SupportsPersistence(Protocol):
    """A REPL that keeps its namespace across completions: versioned contexts and histories
    (context_0, context_1...; history_0...), index 0 also as `context` / `history`."""

    def update_handler_address(self, address: tuple[str, int]) -> None: ...

    def add_context(
        self, context_payload: dict[str, Any] | list[Any] | str, context_index: int | None = None
    ) -> int: ...

    def get_context_count(self) -> int: ...

    def add_history(self, message_history: list[dict[str, Any]], history_index: int | None = None) -> int: ...

    def get_history_count(self) -> int: ...


class BaseEnv(ABC):
    """rlms's environment base class: a REPL the RLM runs its code in."""

    def __init__(
        self, persistent: bool = False, depth: int = 1, max_concurrent_subcalls: int = 4, **kwargs: Any
    ):
        self.persistent = persistent
        self.depth = depth
        self.max_concurrent_subcalls = max_concurrent_subcalls
        self.kwargs = kwargs

    @abstractmethod
    def setup(self) -> None:
        raise NotImplementedError

    @abstractmethod
    def load_context(self, context_payload: dict[str, Any] | list[Any] | str) -> None:
        raise NotImplementedError

    @abstractmethod
    def execute_code(self, code: str) -> REPLResult:
        raise NotImplementedError
