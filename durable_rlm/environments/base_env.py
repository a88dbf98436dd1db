"""rlms's `rlm.environments.base_env`, for programs whose imports changed from `rlm` to `durable_rlm`."""

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

__all__ = [
    "RESERVED_TOOL_NAMES",
    "BaseEnv",
    "SupportsCustomTools",
    "SupportsPersistence",
    "ToolInfo",
    "extract_tool_value",
    "format_tools_for_prompt",
    "parse_custom_tools",
    "parse_tool_entry",
    "validate_custom_tools",
]
