"""The custom-tool activity: runs a registered tool with the worker's credentials.

A tool that raises fails the attempt (retried as the tool declared; the last error reaches
the cell, the exception itself pickled beside its message), and so does a worker that does
not have the tool (another worker may); arguments that do not fit its signature are not
retried. A result that is no JSON value goes to the cell pickled (names.TOOL_VALUE_PREFIX):
only the sandbox loads it, never the worker. Sync tools run on a pool of their own: a hung
one holds one of its threads, never the threads the worker needs for the blob store and the
codec. Failures carry a bounded message and no chain of causes (the server keeps 4 KB of an
activity's failure).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import inspect
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import cloudpickle
from temporalio import activity
from temporalio.exceptions import ApplicationError

from durable_rlm.activities.model_errors import clip
from durable_rlm.activities.sandbox import values
from durable_rlm.tools import registered
from durable_rlm.workflows import defaults, names
from durable_rlm.workflows.models import ToolCallInput, ToolReply

TOOL_THREADS = ThreadPoolExecutor(max_workers=defaults.TOOL_THREADS, thread_name_prefix="drlm-tool")
PICKLE_PROTOCOL = 5  # as snapshots: the sandbox reads it
EXCEPTION_BYTES = 2_048  # a failure stays small: the server keeps little of a failure


def _bad_call(message: str) -> ApplicationError:
    return ApplicationError(clip(message), type=names.TOOL_BAD_CALL, non_retryable=True)


@activity.defn(name=names.RUN_TOOL)
async def run_tool(request: ToolCallInput) -> ToolReply:
    entry = registered(request.tool)
    if entry is None:
        raise ApplicationError(
            f"tool {request.tool!r} is not registered on this worker (DRLM_TOOL_MODULES)",
            type=names.TOOL_NOT_REGISTERED,
        )
    try:
        # A cell chose these bytes: what they hold is counted before any object is built, and
        # only values of a closed set of types are built (never unpickled).
        call = values.loads(request.arguments.encode("utf-8", "surrogatepass"))
        args, kwargs = call["args"], call["kwargs"]
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise TypeError("arguments must be a list and a mapping")
        bound = inspect.signature(entry.fn).bind(*args, **kwargs)
    except (ValueError, KeyError, TypeError) as exc:
        raise _bad_call(f"{request.tool}: {exc}") from None
    try:
        if entry.is_async:
            value: Any = await entry.fn(*bound.args, **bound.kwargs)
        else:
            call_it = functools.partial(entry.fn, *bound.args, **bound.kwargs)
            value = await asyncio.get_running_loop().run_in_executor(TOOL_THREADS, call_it)
    except Exception as exc:  # noqa: BLE001 - whatever the tool raises goes back to the cell
        said = clip(f"{type(exc).__name__}: {exc}")
        raised = pickled(exc, said, EXCEPTION_BYTES)
        raise ApplicationError(said, *([raised] if raised else []), type=names.TOOL_FAILED) from None
    try:
        return ToolReply(result=json.dumps(value, allow_nan=False))
    except (TypeError, ValueError):
        pass
    as_value = pickled(value, clip(_shown(value)), None)
    if as_value is None:
        raise _bad_call(f"{request.tool} returned a {type(value).__name__}, which cannot be pickled")
    return ToolReply(result=as_value)


def pickled(value: Any, shown: str, limit: int | None) -> str | None:
    """`value` as the sandbox loads it (names.TOOL_VALUE_PREFIX): pickled, with what it shows
    for the audit and for a sandbox that cannot load it. None: it cannot be pickled, or the
    pickle passes `limit` bytes."""
    try:
        data = cloudpickle.dumps(value, protocol=PICKLE_PROTOCOL)
    except Exception:  # noqa: BLE001 - whatever a value's __reduce__ raises
        return None
    if limit is not None and len(data) > limit:
        return None
    return f"{names.TOOL_VALUE_PREFIX}{base64.b64encode(data).decode('ascii')}\n{shown}"


def _shown(value: Any) -> str:
    try:
        return repr(value)
    except Exception:  # noqa: BLE001 - a hostile __repr__
        return f"<{type(value).__name__}>"
