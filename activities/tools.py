"""The custom-tool activity: runs a registered tool with the worker's credentials.

A tool that raises fails the attempt (retried as the tool declared; the last error reaches
the cell as a ToolError); arguments that do not fit its signature, a result that is not a
JSON value, or a tool this worker does not have are not retried.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from typing import Any

from temporalio import activity
from temporalio.exceptions import ApplicationError

from durable_rlm.tools import registered
from workflows import names
from workflows.models import ToolCallInput, ToolReply


def _bad_call(message: str) -> ApplicationError:
    return ApplicationError(message, type=names.TOOL_BAD_CALL, non_retryable=True)


@activity.defn(name=names.RUN_TOOL)
async def run_tool(request: ToolCallInput) -> ToolReply:
    entry = registered(request.tool)
    if entry is None:
        raise ApplicationError(
            f"tool {request.tool!r} is not registered on this worker (DRLM_TOOL_MODULES)",
            type=names.TOOL_NOT_REGISTERED,
            non_retryable=True,
        )
    try:
        call = json.loads(request.arguments)
        bound = inspect.signature(entry.fn).bind(*call["args"], **call["kwargs"])
    except (ValueError, KeyError, TypeError) as exc:
        raise _bad_call(f"{request.tool}: {exc}") from exc
    try:
        if entry.is_async:
            value: Any = await entry.fn(*bound.args, **bound.kwargs)
        else:
            value = await asyncio.to_thread(entry.fn, *bound.args, **bound.kwargs)
    except Exception as exc:  # noqa: BLE001 - whatever the tool raises goes back to the cell
        raise ApplicationError(f"{type(exc).__name__}: {exc}", type=names.TOOL_FAILED) from exc
    try:
        return ToolReply(result=json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise _bad_call(f"{request.tool} returned a value that is not JSON: {exc}") from exc
