"""rlms's `rlm.environments`, for programs whose imports changed from `rlm` to `durable_rlm`:
the local REPL, sandboxed (the other environments need Docker or a cloud service)."""

from typing import Any

from durable_rlm.errors import ConfigurationError
from durable_rlm.rlms.environments import (
    RESERVED_TOOL_NAMES,
    BaseEnv,
    SupportsCustomTools,
    SupportsPersistence,
    ToolInfo,
    extract_tool_value,
    format_tools_for_prompt,
    parse_custom_tools,
    parse_tool_entry,
    validate_custom_tools,
)
from durable_rlm.rlms.local_repl import LocalREPL

__all__ = [
    "RESERVED_TOOL_NAMES",
    "BaseEnv",
    "LocalREPL",
    "SupportsCustomTools",
    "SupportsPersistence",
    "ToolInfo",
    "extract_tool_value",
    "format_tools_for_prompt",
    "get_environment",
    "parse_custom_tools",
    "parse_tool_entry",
    "validate_custom_tools",
]


def get_environment(environment: str, environment_kwargs: dict[str, Any]) -> LocalREPL:
    """rlms's factory; "local" is the environment durable-rlm has."""
    if environment != "local":
        raise ConfigurationError(
            f"environment {environment!r} is not available: durable-rlm runs the REPL in its own "
            "sandboxed process (environment='local')"
        )
    return LocalREPL(**environment_kwargs)
