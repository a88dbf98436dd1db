"""The completed steps of an episode, read back from its Temporal history.

Every run (continue-as-new included) in order; each step is what its activity took and
returned, decoded with the project's converter (claim-checked payloads come back whole).
A REPL step run as a local activity is recorded as a marker that holds its result only;
the result echoes its cell (`StepEcho`), so such steps come with `arg=None`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from workflows import names
from workflows.models import (
    AuditEpisodeInput,
    CellOutcome,
    CompactionInput,
    CompactionReply,
    ExecuteCellInput,
    ExtractionInput,
    ExtractionReply,
    ResumeCellInput,
    RootCompletion,
    RootCompletionInput,
    SubQueryInput,
    SubQueryReply,
    ToolCallInput,
    ToolReply,
)

if TYPE_CHECKING:
    from temporalio.api.common.v1 import Payload
    from temporalio.client import Client

INPUTS: dict[str, type] = {
    names.ROOT_COMPLETION: RootCompletionInput,
    names.SUB_QUERY: SubQueryInput,
    names.COMPACT_CONVERSATION: CompactionInput,
    names.EXTRACT_FALLBACK: ExtractionInput,
    names.REPL_EXECUTE: ExecuteCellInput,
    names.REPL_RESUME: ResumeCellInput,
    names.AUDIT_EPISODE: AuditEpisodeInput,
    names.RUN_TOOL: ToolCallInput,
}
RESULTS: dict[str, type | None] = {
    names.ROOT_COMPLETION: RootCompletion,
    names.SUB_QUERY: SubQueryReply,
    names.COMPACT_CONVERSATION: CompactionReply,
    names.EXTRACT_FALLBACK: ExtractionReply,
    names.REPL_EXECUTE: CellOutcome,
    names.REPL_RESUME: CellOutcome,
    names.AUDIT_EPISODE: None,
    names.RUN_TOOL: ToolReply,
}


LOCAL_ACTIVITY_MARKER = "core_local_activity"
"""The marker a local activity's result is recorded under."""


async def decode(client: Client, payloads: Any, hint: type) -> Any:
    """One way to read a payload: the codec server's (durable_rlm/codec_server.py), whole,
    then the converter's JSON. A blob the store lacks is an error naming the store."""
    items: list[Payload] = list(payloads.payloads) if payloads else []
    if not items:
        return None
    codec = client.data_converter.payload_codec
    blobs = getattr(codec, "blobs", None)
    if blobs is None:
        return (await client.data_converter.decode(items[:1], [hint]))[0]
    from durable_rlm.codec_server import decode_payloads, unreadable

    (item,) = await asyncio.to_thread(decode_payloads, items[:1], blobs, None, False)
    problem = unreadable(item)
    if problem is not None:
        raise LookupError(problem)
    return client.data_converter.payload_converter.from_payloads([item], [hint])[0]


@dataclass(frozen=True)
class Step:
    run_id: str
    activity: str
    arg: Any
    result: Any


async def episode_runs(client: Client, episode_id: str) -> list[Any]:
    """The episode's runs, oldest first."""
    runs = [run async for run in client.list_workflows(f'WorkflowId = "{episode_id}"')]
    runs.sort(key=lambda r: r.start_time)
    if not runs:
        raise LookupError(f"no episode with id {episode_id!r}")
    return runs


async def completed_steps(client: Client, episode_id: str) -> AsyncIterator[Step]:
    """Each completed step the audit store knows, in the order the episode made them."""
    from temporalio.api.enums.v1 import EventType

    for run in await episode_runs(client, episode_id):
        history = await client.get_workflow_handle(episode_id, run_id=run.run_id).fetch_history()
        scheduled: dict[int, tuple[str, Any]] = {}
        for event in history.events:
            kind = event.event_type
            if kind == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                attrs = event.activity_task_scheduled_event_attributes
                activity = attrs.activity_type.name
                if activity in INPUTS:
                    scheduled[event.event_id] = (
                        activity,
                        await decode(client, attrs.input, INPUTS[activity]),
                    )
            elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
                attrs = event.activity_task_completed_event_attributes
                if attrs.scheduled_event_id not in scheduled:
                    continue
                activity, arg = scheduled.pop(attrs.scheduled_event_id)
                hint = RESULTS[activity]
                result = await decode(client, attrs.result, hint) if hint is not None else None
                yield Step(run.run_id, activity, arg, result)
            elif kind == EventType.EVENT_TYPE_MARKER_RECORDED:
                step = await _local_step(client, run.run_id, event.marker_recorded_event_attributes)
                if step is not None:
                    yield step


def repl_marker(attrs: Any) -> dict[str, Any] | None:
    """The data of a local REPL step's marker (activity type, times), None for any other."""
    if attrs.marker_name != LOCAL_ACTIVITY_MARKER or "data" not in attrs.details:
        return None
    data: dict[str, Any] = json.loads(attrs.details["data"].payloads[0].data)
    return data if data.get("activity_type") in (names.REPL_EXECUTE, names.REPL_RESUME) else None


async def _local_step(client: Client, run_id: str, attrs: Any) -> Step | None:
    data = repl_marker(attrs)
    if data is None or "result" not in attrs.details:
        return None  # not a REPL step, or one that failed
    outcome = await decode(client, attrs.details["result"], CellOutcome)
    return Step(run_id, data["activity_type"], None, outcome)
