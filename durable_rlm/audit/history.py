"""The completed steps of an episode, read back from its Temporal history.

The runs of its current chain (continue-as-new included) in order; each step is what its
activity took and returned, decoded with the project's converter (claim-checked payloads
come back whole). A REPL step run as a local activity is recorded as a marker that holds
its result only; the result echoes its cell (`StepEcho`), so such steps come with `arg=None`.

The chain, not every run of the id: `temporal workflow reset` starts a new run from a copy
of an old run's history up to a workflow task, and the old run (abandoned, not continued)
stays listed under the same id. A reader that took every run would show the copied steps
twice and the abandoned run's steps as if they had happened. The chain is found from the
current run backwards along each run's started event (`continued_execution_run_id`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from durable_rlm.workflows import names
from durable_rlm.workflows.models import (
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
    from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHistory

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
    """One way to read a payload: as a reader sees it (durable_rlm/store/display.py), whole,
    then the converter's JSON. A blob the store lacks is an error naming the store."""
    from durable_rlm.store.display import decode_payloads, unreadable  # start-up: temporalio, protobuf

    items: list[Payload] = list(payloads.payloads) if payloads else []
    if not items:
        return None
    codec = client.data_converter.payload_codec
    blobs = getattr(codec, "blobs", None)
    if blobs is None:
        return (await client.data_converter.decode(items[:1], [hint]))[0]

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


@dataclass(frozen=True)
class EpisodeRun:
    """One run of an episode's current chain, with its history (read once, used by all)."""

    run_id: str
    status: WorkflowExecutionStatus | None
    start_time: datetime  # its started event's: a reset run's copy keeps the original time
    close_time: datetime | None
    history: WorkflowHistory

    @property
    def continued_from(self) -> str | None:
        """The run this one continued as new from (a reset run keeps its base's link)."""
        started = self.history.events[0].workflow_execution_started_event_attributes
        return started.continued_execution_run_id or None


async def episode_runs(client: Client, episode_id: str) -> list[EpisodeRun]:
    """The runs of the episode's current chain, oldest first: the current run, then back
    along continue-as-new links. Runs a reset abandoned are in no chain (module docstring).
    A start time is the started event's: a reset run's copy keeps the episode's own."""
    from temporalio.api.enums.v1 import EventType  # start-up: temporalio (~0.1 s): drlm show reads no history
    from temporalio.service import RPCError, RPCStatusCode  # start-up: as above

    chain: list[EpisodeRun] = []
    run_id: str | None = None
    while True:
        try:
            description = await client.get_workflow_handle(episode_id, run_id=run_id).describe()
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
            if not chain:
                raise LookupError(f"no episode with id {episode_id!r}") from None
            break  # an older run past the namespace's retention: the chain starts later
        history = await client.get_workflow_handle(episode_id, run_id=description.run_id).fetch_history()
        first = history.events[0]
        if first.event_type != EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED:
            raise LookupError(f"episode {episode_id!r}: run {description.run_id} has no started event")
        run = EpisodeRun(
            run_id=description.run_id,
            status=description.status,
            start_time=first.event_time.ToDatetime(tzinfo=UTC),
            close_time=description.close_time,
            history=history,
        )
        chain.append(run)
        run_id = run.continued_from
        if run_id is None or any(r.run_id == run_id for r in chain):
            break
    chain.reverse()
    return chain


async def completed_steps(
    client: Client, episode_id: str, runs: list[EpisodeRun] | None = None
) -> AsyncIterator[Step]:
    """Each completed step the audit store knows, in the order the episode made them (of
    `runs`, when the caller has read the chain already)."""
    from temporalio.api.enums.v1 import EventType  # start-up: temporalio (~0.1 s): drlm show reads no history

    for run in runs if runs is not None else await episode_runs(client, episode_id):
        history = run.history
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
                completed = event.activity_task_completed_event_attributes
                if completed.scheduled_event_id not in scheduled:
                    continue
                activity, arg = scheduled.pop(completed.scheduled_event_id)
                hint = RESULTS[activity]
                result = await decode(client, completed.result, hint) if hint is not None else None
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


@dataclass(frozen=True)
class Reset:
    """A `temporal workflow reset` as the reset run's history records it: the workflow task
    it went back to fails with cause RESET_WORKFLOW, naming the run it left and why."""

    event_id: int
    at: datetime
    identity: str
    reason: str
    base_run_id: str
    new_run_id: str

    @property
    def line(self) -> str:
        by = f" by {self.identity}" if self.identity else ""
        return f"reset to workflow task {self.event_id}{by}: {self.reason} (run {self.base_run_id} abandoned)"


def reset_of(event: Any) -> Reset | None:
    """The reset an event records, None for any other event."""
    from temporalio.api.enums.v1 import EventType, WorkflowTaskFailedCause  # start-up: temporalio (~0.1 s)

    if event.event_type != EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED:
        return None
    attrs = event.workflow_task_failed_event_attributes
    if attrs.cause != WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_RESET_WORKFLOW:
        return None
    return Reset(
        event_id=event.event_id,
        at=event.event_time.ToDatetime(tzinfo=UTC),
        identity=attrs.identity,
        reason=attrs.failure.message,
        base_run_id=attrs.base_run_id,
        new_run_id=attrs.new_run_id,
    )


def resets(runs: list[EpisodeRun]) -> list[Reset]:
    """The resets that made the chain, oldest first."""
    return [r for run in runs for event in run.history.events if (r := reset_of(event)) is not None]
