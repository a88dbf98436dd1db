"""An episode's timeline, read from its Temporal history (the audit trail itself).

Every run of the episode's current chain is read (continue-as-new included; runs a reset
abandoned left out, durable_rlm/audit/history.py); activity inputs and results are decoded with
the project's converter, so claim-checked payloads come back whole. A `temporal workflow
reset` is an action in the timeline: the reset run's history is a copy of its base run up to
the workflow task it went back to, then a WorkflowTaskFailed with cause RESET_WORKFLOW.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from durable_rlm.audit.history import Reset, decode, episode_runs, repl_marker, reset_of
from durable_rlm.terminal import safe
from durable_rlm.workflows import names
from durable_rlm.workflows.fallback import ExecutionResult
from durable_rlm.workflows.models import (
    CancelRequest,
    CellDecision,
    CellOutcome,
    CompactionInput,
    CompactionReply,
    ContextRef,
    EpisodeRequest,
    EpisodeResult,
    ExecuteCellInput,
    FinishUpdate,
    ForkOrigin,
    HintUpdate,
    LimitsUpdate,
    Message,
    PauseUpdate,
    RebuildReport,
    ResumeCellInput,
    ResumeUpdate,
    RewardUpdate,
    RootCompletion,
    RootCompletionInput,
    SnapshotRef,
    StepEcho,
    SubQueryInput,
    SubQueryReply,
    TerminationDecision,
    TokenUsage,
    ending_words,
)

if TYPE_CHECKING:  # reading a history needs temporalio; rendering a stored timeline does not
    from temporalio.client import Client


class SubCall(BaseModel):
    call_index: int
    prompt: str
    reply: str | None = None
    error: str | None = None
    model: str = ""
    usage: TokenUsage | None = None
    model_time_s: float = 0.0


class ChildView(BaseModel):
    """A child episode (rlm_query) under the cell that called it, with its own timeline."""

    episode_id: str
    call_index: int
    model: str
    context: ContextRef | None = Field(default=None, description="the prompt, stored as its context")
    timeline: Timeline | None = None


class CellView(BaseModel):
    cell_index: int
    code: str
    stdout: str = ""
    stderr: str = ""
    error: str | None = None
    rebuilt: bool = False
    rebuild: RebuildReport | None = None
    snapshot: SnapshotRef | None = Field(default=None, description="the REPL snapshot taken after it")
    snapshot_note: str | None = Field(default=None, description="why no snapshot was taken after it")
    sub_calls: list[SubCall] = Field(default_factory=list)
    children: list[ChildView] = Field(default_factory=list)
    answer: str | None = Field(default=None, description="the answer the cell gave (FINAL...), if any")
    variables: dict[str, str] = Field(default_factory=dict, description="bounded summary after it")
    started_at: datetime | None = Field(default=None, description="its first step was scheduled")
    ended_at: datetime | None = Field(default=None, description="its last step completed")
    reset_gap_s: float = Field(
        default=0.0, description="of its span, the time between a reset's point and the reset"
    )


class IterationView(BaseModel):
    iteration: int
    response: str | None = None
    model_error: str | None = None
    compactions: list[str] = Field(default_factory=list, description="summaries written before the call")
    cells: list[CellView] = Field(default_factory=list)
    # What the root model was sent: the conversation chain (a head in the blob store) plus
    # the messages this turn added, shortened as `resent_message_chars` says; heads, not
    # transcripts, so a stored timeline stays linear in the episode's length.
    conversation: str | None = None
    append: list[Message] = Field(default_factory=list)
    resent_message_chars: int | None = None
    prompt: list[Message] | None = Field(
        default=None, description="the messages sent, when a reader resolved the chain (export)"
    )
    model: str = ""
    usage: TokenUsage | None = None
    model_time_s: float = 0.0
    started_at: datetime | None = Field(default=None, description="its first model step was scheduled")
    ended_at: datetime | None = Field(default=None, description="its last step completed")
    inherited_from: str | None = Field(
        default=None, description="a fork's iteration up to its branch: the episode that ran it"
    )
    reset_gap_s: float = Field(
        default=0.0, description="of its span, the time between a reset's point and the reset"
    )


class ActionView(BaseModel):
    """A person's action on the episode, as history recorded the update that carried it."""

    kind: str = Field(
        description="hint, limits, pause, resume, finish, approve, edit, reject, cancel, reward, reset"
    )
    sender: str | None = None
    at: datetime
    iteration: int = Field(description="the iteration under way when it arrived")
    detail: str = ""
    reset_to: int | None = Field(
        default=None, description="a reset: the workflow task (event id) it went back to"
    )
    abandoned_run: str | None = Field(default=None, description="a reset: the run it left from there")


class Timeline(BaseModel):
    episode_id: str
    status: str
    task: str = ""
    runs: int = 0
    run_id: str | None = Field(default=None, description="the current run: what a stored copy is valid for")
    iterations: list[IterationView] = Field(default_factory=list)
    actions: list[ActionView] = Field(default_factory=list, description="steering, cancel and rewards")
    result: EpisodeResult | None = None
    failure: str | None = None
    depth: int = 0
    request: EpisodeRequest | None = Field(default=None, description="as the first run received it")
    started_at: datetime | None = None
    ended_at: datetime | None = None
    unattended: bool = Field(default=False, description="running, and no worker runs it now")


ChildView.model_rebuild()


_INPUTS: dict[str, type] = {
    names.COMPACT_CONVERSATION: CompactionInput,
    names.ROOT_COMPLETION: RootCompletionInput,
    names.SUB_QUERY: SubQueryInput,
    names.REPL_EXECUTE: ExecuteCellInput,
    names.REPL_RESUME: ResumeCellInput,
}
_RESULTS: dict[str, type] = {
    names.COMPACT_CONVERSATION: CompactionReply,
    names.ROOT_COMPLETION: RootCompletion,
    names.SUB_QUERY: SubQueryReply,
    names.REPL_EXECUTE: CellOutcome,
    names.REPL_RESUME: CellOutcome,
}


async def episode_timeline(client: Client, episode_id: str, children: bool = True) -> Timeline:
    """The episode's timeline; with `children`, each child episode's timeline under its cell.
    Times are the history's event times (the server's clock), so they need no worker's."""
    from temporalio.api.enums.v1 import (
        EventType,  # start-up: temporalio (~0.1 s): drlm show of a kept timeline
    )

    from durable_rlm.client.episodes import execution_ending  # start-up: temporalio, as above

    runs = await episode_runs(client, episode_id)
    current = runs[-1]
    timeline = Timeline(
        episode_id=episode_id,
        status=current.status.name.lower() if current.status is not None else "unknown",
        runs=len(runs),
        run_id=current.run_id,
        started_at=runs[0].start_time,
        ended_at=current.close_time,
    )
    iterations: dict[int, IterationView] = {}
    cells: dict[int, CellView] = {}
    gaps: list[tuple[datetime, datetime]] = []  # (the reset's point, the reset) per reset

    def iteration(number: int) -> IterationView:
        return iterations.setdefault(number, IterationView(iteration=number))

    for run in runs:
        scheduled: dict[int, tuple[str, Any]] = {}
        task_started: datetime | None = None  # a local step starts within the task that runs it
        last: datetime | None = None
        for event in run.history.events:
            kind = event.event_type
            when = event.event_time.ToDatetime(tzinfo=UTC)
            before, last = last, when
            if kind == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED:
                task_started = when
            elif (reset := reset_of(event)) is not None:
                timeline.actions.append(_reset(reset, max(iterations, default=0)))
                gaps.append((before or when, when))
            elif kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED and not timeline.task:
                started = event.workflow_execution_started_event_attributes
                request = await decode(client, started.input, EpisodeRequest)
                timeline.task, timeline.depth, timeline.request = request.task, request.depth, request
            elif kind == EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED:
                initiated = event.start_child_workflow_execution_initiated_event_attributes
                child = await decode(client, initiated.input, EpisodeRequest)
                if child.parent is not None and child.parent.cell_index in cells:
                    cells[child.parent.cell_index].children.append(
                        ChildView(
                            episode_id=initiated.workflow_id,
                            call_index=child.parent.call_index,
                            model=child.root_model.model,
                            context=child.context,
                        )
                    )
            elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                scheduling = event.activity_task_scheduled_event_attributes
                activity = scheduling.activity_type.name
                hint = _INPUTS.get(activity)
                # the input model that _INPUTS names for this activity
                arg: Any = await decode(client, scheduling.input, hint) if hint else None
                scheduled[event.event_id] = (activity, arg)
                if activity == names.ROOT_COMPLETION:
                    it = iteration(arg.iteration)
                    it.conversation, it.append = arg.conversation, arg.append
                    it.resent_message_chars, it.model = arg.resent_message_chars, arg.model.model
                    it.started_at = it.started_at or when
                elif activity == names.COMPACT_CONVERSATION:
                    it = iteration(arg.iteration)
                    it.started_at = it.started_at or when
                elif activity == names.REPL_EXECUTE:
                    cell = CellView(cell_index=arg.cell_index, code=arg.code, started_at=when)
                    cells[arg.cell_index] = cell
                    iteration(arg.iteration).cells.append(cell)
                elif activity == names.SUB_QUERY and arg.cell_index in cells:
                    cells[arg.cell_index].sub_calls.append(
                        SubCall(call_index=arg.call_index, prompt=arg.prompt, model=arg.model.model)
                    )
            elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
                completed = event.activity_task_completed_event_attributes
                activity, arg = scheduled.get(completed.scheduled_event_id, ("", None))
                hint = _RESULTS.get(activity)
                if hint is None:
                    continue
                value = await decode(client, completed.result, hint)
                _apply_result(activity, arg, value, iteration, cells, when)
            elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED:
                failed = event.activity_task_failed_event_attributes
                activity, arg = scheduled.get(failed.scheduled_event_id, ("", None))
                message = failed.failure.message
                if activity == names.ROOT_COMPLETION:
                    iteration(arg.iteration).model_error = message
                    iteration(arg.iteration).ended_at = when
                elif activity in (names.REPL_EXECUTE, names.REPL_RESUME) and arg.cell_index in cells:
                    cells[arg.cell_index].error = f"attempt failed: {message}"
                    cells[arg.cell_index].ended_at = when
                elif activity == names.SUB_QUERY and arg.cell_index in cells:
                    for call in cells[arg.cell_index].sub_calls:
                        if call.call_index == arg.call_index:
                            call.error = message
            elif kind == EventType.EVENT_TYPE_MARKER_RECORDED:
                marker = event.marker_recorded_event_attributes
                await _local_step(client, marker, iteration, cells, task_started or when, when)
            elif kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED:
                request = event.workflow_execution_update_accepted_event_attributes.accepted_request
                action = await _action(client, request.input, when, max(iterations, default=0))
                if action is not None:
                    timeline.actions.append(action)
            elif kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED:
                ended = event.workflow_execution_completed_event_attributes
                timeline.result = await decode(client, ended.result, EpisodeResult)
            elif kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_FAILED:
                timeline.failure = event.workflow_execution_failed_event_attributes.failure.message
    timeline.iterations = [iterations[k] for k in sorted(iterations)]
    timeline.status = execution_ending(current.status, timeline.result)  # not Temporal's "completed"
    for it in timeline.iterations:
        ends = [t for t in (it.ended_at, *(c.ended_at for c in it.cells)) if t is not None]
        it.ended_at = max(ends, default=None)
        views: list[IterationView | CellView] = [it, *it.cells]
        for view in views:
            view.reset_gap_s = _stood_still(view.started_at, view.ended_at, gaps)
    if children:
        for cell in cells.values():
            for child in cell.children:
                with contextlib.suppress(LookupError):
                    child.timeline = await episode_timeline(client, child.episode_id)
    fork = timeline.request.fork if timeline.request is not None else None
    if fork is not None:
        timeline.iterations[:0] = await _inherited(client, fork.source_id, fork.iteration, children)
    return timeline


def _reset(reset: Reset, iteration: int) -> ActionView:
    """A reset as an action: who asked (the identity the server recorded; the CLI puts the
    user's name before the reason), why, the workflow task it went back to, the run it left."""
    return ActionView(
        kind="reset",
        sender=reset.identity or None,
        at=reset.at,
        iteration=iteration,
        detail=reset.reason,
        reset_to=reset.event_id,
        abandoned_run=reset.base_run_id or None,
    )


def _stood_still(
    started: datetime | None, ended: datetime | None, gaps: list[tuple[datetime, datetime]]
) -> float:
    """Seconds of [started, ended] that fell between a reset's point and the reset: the
    reset run's copy of the history keeps the old times, and the work did not go on then."""
    if started is None or ended is None:
        return 0.0
    return sum(max(0.0, (min(ended, reset) - max(started, point)).total_seconds()) for point, reset in gaps)


async def _inherited(client: Client, source_id: str, upto: int, children: bool) -> list[IterationView]:
    """A fork's iterations up to its branch, as its source ran them (a source that is a
    fork itself brings its own inherited ones); none when the source's history is gone."""
    try:
        source = await episode_timeline(client, source_id, children)
    except LookupError:
        return []
    inherited = [it for it in source.iterations if it.iteration <= upto]
    for it in inherited:
        it.inherited_from = it.inherited_from or source_id
    return inherited


_UPDATES: dict[str, type[BaseModel]] = {
    names.HINT: HintUpdate,
    names.SET_LIMITS: LimitsUpdate,
    names.PAUSE: PauseUpdate,
    names.RESUME: ResumeUpdate,
    names.FINISH_NOW: FinishUpdate,
    names.DECIDE_CELL: CellDecision,
    "cancel": CancelRequest,
    "reward": RewardUpdate,
}


async def _action(client: Client, update: Any, when: datetime, iteration: int) -> ActionView | None:
    """An accepted update as a person's action (validators refuse the rest unrecorded)."""
    hint = _UPDATES.get(update.name)
    if hint is None:
        return None  # retry_credentials: a worker's fixed key, shown by its model step
    arg = await decode(client, update.args, hint)
    sender = getattr(arg, "sender", None)
    view = ActionView(kind=update.name, sender=sender, at=when, iteration=iteration)
    if isinstance(arg, HintUpdate):
        view.detail = arg.text
    elif isinstance(arg, LimitsUpdate):
        view.kind = "limits"
        view.detail = ", ".join(f"{k}={_limit_text(v)}" for k, v in arg.changes().items())
    elif isinstance(arg, PauseUpdate):
        view.detail = arg.reason + (" (max_duration held)" if arg.hold_clock else "")
    elif isinstance(arg, FinishUpdate | CancelRequest):
        view.kind = "finish" if isinstance(arg, FinishUpdate) else "cancel"
        view.detail = arg.reason + (" (extract)" if isinstance(arg, CancelRequest) and arg.extract else "")
    elif isinstance(arg, CellDecision):
        view.kind = "reject" if not arg.approve else "edit" if arg.code is not None else "approve"
        view.detail = f"cell {arg.cell}" + (f": {arg.reason}" if arg.reason else "")
        if arg.code is not None:
            view.detail += f"; runs instead:\n{arg.code}"
    elif isinstance(arg, RewardUpdate):
        view.detail = f"{arg.value:g}" + (f": {arg.note}" if arg.note else "")
    return view


def _limit_text(value: Any) -> str:
    return f"{value.total_seconds():g}s" if isinstance(value, timedelta) else str(value)


async def _local_step(
    client: Client,
    attrs: Any,
    iteration: Any,
    cells: dict[int, CellView],
    started: datetime,
    recorded: datetime,
) -> None:
    """A local REPL step: its result (or failure) repeats the cell it ran (`StepEcho`)."""
    data = repl_marker(attrs)
    if data is None:
        return
    activity = data["activity_type"]
    ended = _marker_time(data.get("complete_time")) or recorded
    if "result" in attrs.details:
        outcome: CellOutcome = await decode(client, attrs.details["result"], CellOutcome)
        echo, failure = outcome.step, None
    else:
        failure = attrs.failure.message
        echo = None
        cause = attrs.failure
        while cause is not None and echo is None:  # the echo may sit under a wrapping failure
            details = cause.application_failure_info.details
            echo = await decode(client, details, StepEcho) if details.payloads else None
            cause = cause.cause if cause.HasField("cause") else None
    if echo is None:
        return
    if activity == names.REPL_EXECUTE and echo.cell_index not in cells:
        cell = cells[echo.cell_index] = CellView(
            cell_index=echo.cell_index, code=echo.code or "", started_at=started
        )
        iteration(echo.iteration or 0).cells.append(cell)
    if failure is not None:
        if echo.cell_index in cells:
            cells[echo.cell_index].error = f"step failed: {failure}"
            cells[echo.cell_index].ended_at = ended
        return
    _apply_result(activity, echo, outcome, iteration, cells, ended)


def _marker_time(value: Any) -> datetime | None:
    """A time in a local activity's marker data (protobuf JSON: an RFC 3339 string)."""
    if not isinstance(value, str):
        return None
    with contextlib.suppress(ValueError):
        return datetime.fromisoformat(value).astimezone(UTC)
    return None


def _apply_result(
    activity: str, arg: Any, value: Any, iteration: Any, cells: dict[int, CellView], when: datetime
) -> None:
    if activity == names.ROOT_COMPLETION:
        it = iteration(arg.iteration)
        it.response, it.usage, it.model_time_s = value.text, value.usage, value.model_time_s
        it.ended_at = when
    elif activity == names.COMPACT_CONVERSATION and value.removed_messages:
        iteration(arg.iteration).compactions.append(
            f"{value.removed_messages} message(s) summarised ({arg.reason}): {value.summary}"
        )
    elif activity == names.SUB_QUERY and arg.cell_index in cells:
        for call in cells[arg.cell_index].sub_calls:
            if call.call_index == arg.call_index:
                call.reply, call.usage, call.model_time_s = value.text, value.usage, value.model_time_s
    elif activity in (names.REPL_EXECUTE, names.REPL_RESUME):
        cell = cells.get(arg.cell_index)
        if cell is not None:
            cell.ended_at = when
        if cell is not None and value.status == "completed":
            cell.stdout, cell.stderr, cell.error = value.stdout, value.stderr, value.error
            cell.answer, cell.variables = value.answer, value.variables
            cell.rebuilt = cell.rebuilt or value.rebuilt
            cell.rebuild = cell.rebuild or value.rebuild
            cell.snapshot = value.snapshot or cell.snapshot
            cell.snapshot_note = value.snapshot_note or cell.snapshot_note


def fork_line(fork: ForkOrigin) -> str:
    changed = "; ".join(fork.changes) if fork.changes else "same settings"
    running = ", which was still running" if fork.source_running else ""
    return f"Forked from {fork.source_id} after iteration {fork.iteration}{running}: {changed}"


def unattended_line(episode_id: str) -> str:
    """The one sentence every command and the page say of an episode no worker runs
    (durable_rlm/client/attendance.py decides it)."""
    return f"no worker runs this episode: `drlm resume {episode_id}`"


def unanswered_line(episode_id: str, what: str, wait_s: float, who: str = "", ends: bool = False) -> str:
    """The sentence every command and the page say when the live worker running an episode
    has not answered `what` (a hint, a cancel...) in `wait_s` seconds; `who` names it."""
    worker = f"its worker ({who})" if who else "its worker"
    effect = "ends" if ends else "takes effect"
    return (
        f"episode {episode_id}: {worker} has not answered in {wait_s:g} s; the {what} is not confirmed: "
        f"the server keeps it for good only once a worker takes it, and may drop it before: "
        f"`drlm watch {episode_id}` shows whether it {effect} (if not, send it again)"
    )


def render(timeline: Timeline, width: int = 2_000) -> str:
    """The timeline as text for a person: each iteration's response, code, output, calls."""

    def clip(text: str | None) -> str:
        text = text or ""
        return text if len(text) <= width else text[:width] + f" ... [{len(text) - width} more chars]"

    ending = ending_text(timeline.result) if timeline.result is not None else ending_words(timeline.status)
    lines = [f"Episode {timeline.episode_id}: {ending} ({timeline.runs} run(s))"]
    if timeline.unattended:
        lines.append(unattended_line(timeline.episode_id))
    lines.append(f"Task: {clip(timeline.task)}")
    fork = timeline.request.fork if timeline.request is not None else None
    if fork is not None:
        lines.append(fork_line(fork))
    if (session := timeline.request.session if timeline.request is not None else None) is not None:
        lines.append(f"turn {session.turn} of session {session.session_id}: drlm show {session.session_id}")
    actions = sorted(timeline.actions, key=lambda a: a.at)
    for it in timeline.iterations:
        lines.extend(_action_lines(a, clip) for a in actions if a.iteration < it.iteration)
        actions = [a for a in actions if a.iteration >= it.iteration]
        inherited = f" (inherited from {it.inherited_from})" if it.inherited_from else ""
        lines.append(f"\n=== iteration {it.iteration}{inherited} ===")
        if fork is not None and it.iteration == fork.iteration + 1 and not it.inherited_from:
            lines.append(f"--- {timeline.episode_id} branches here from {fork.source_id} ---")
        for compaction in it.compactions:
            lines.append("compacted: " + clip(compaction))
        if it.model_error:
            lines.append(f"model error: {it.model_error}")
        lines.append("model:\n" + _indent(clip(it.response)))
        for cell in it.cells:
            lines.append(f"--- cell {cell.cell_index}{' (rebuilt)' if cell.rebuilt else ''} ---")
            lines.append(_indent(clip(cell.code)))
            for call in cell.sub_calls:
                outcome = call.reply if call.error is None else f"ERROR {call.error}"
                lines.append(
                    f"  sub-call {call.call_index}: {clip(call.prompt)[:120]!r} -> {clip(outcome)[:120]!r}"
                )
            for child in cell.children:
                lines.append(_indent(_render_child(child, width)))
            output = "\n".join(x for x in (cell.stdout, cell.stderr, cell.error or "") if x)
            lines.append("output:\n" + _indent(clip(output) or "(none)"))
            if cell.rebuild is not None:
                source = (
                    f"the snapshot after cell {cell.rebuild.from_snapshot}"
                    if cell.rebuild.from_snapshot is not None
                    else "the cell log alone"
                )
                lines.append(
                    f"REPL rebuilt before it from {source}: {cell.rebuild.cells_rerun} cell(s) re-run "
                    f"in {cell.rebuild.seconds:.2f} s"
                )
                lines.extend(f"  {note}" for note in cell.rebuild.notes)
            if cell.snapshot is not None:
                unsaved = f"; re-created by re-running cells: {', '.join(cell.snapshot.unsaved)}"
                lines.append(
                    f"snapshot after this cell: {cell.snapshot.size:,} bytes"
                    + (unsaved if cell.snapshot.unsaved else "")
                )
            elif cell.snapshot_note is not None:
                lines.append(cell.snapshot_note)
    lines.extend(_action_lines(a, clip) for a in actions)
    if timeline.result is not None:
        r = timeline.result
        lines.append("\n" + ended_line(r).replace("ended:", "Ended:", 1))
        if r.children:
            lines.append(
                f"Tree: {r.tree_episodes} episode(s), {len(r.children)} direct child(ren); the "
                "counts above include what the children spent"
            )
        if r.termination is not None:
            lines.append(termination_text(r.termination))
        if r.execution is not None:
            lines.append(describe_execution(r.execution, r.status))
        if r.error:
            lines.append(f"Error: {r.error}")
        lines.append(f"Stop reason: {r.stop_reason}")
        if r.lost_cells or r.compactions or r.replay_divergences:
            lines.append(
                f"Lost cells: {r.lost_cells}; compactions: {r.compactions}; "
                f"replay divergences: {r.replay_divergences}"
            )
        source = r.answer_source + (f" ({r.answer_policy})" if r.answer_policy else "")
        lines.append(f"Answer ({source}): {r.answer}")
    if timeline.failure:
        lines.append(f"\nFailed: {timeline.failure}")
    return safe("\n".join(lines))  # for a terminal: model text cannot drive it


def _action_lines(action: ActionView, clip: Callable[[str | None], str]) -> str:
    by = f" by {action.sender}" if action.sender else ""
    if action.kind == "reset":
        left = f" (run {action.abandoned_run} abandoned from there)" if action.abandoned_run else ""
        return (
            f">>> reset to workflow task {action.reset_to}{by} at {action.at:%Y-%m-%d %H:%M:%S}: "
            + clip(action.detail)
            + left
        )
    return f">>> {action.kind}{by} at {action.at:%Y-%m-%d %H:%M:%S}: " + clip(action.detail)


def _render_child(child: ChildView, width: int) -> str:
    head = f"child {child.episode_id} (call {child.call_index}, model {child.model})"
    timeline = child.timeline
    if timeline is None:
        return f"{head}: no history found"
    r = timeline.result
    if r is None:
        ending = timeline.failure or timeline.status
        return f"{head}: {ending}\n" + _indent(render(timeline, width))
    summary = (
        f"{head}, depth {r.depth}: {ending_text(r)}, answer {r.answer!r}; "
        f"{r.model_calls} model call(s), {r.usage.total_tokens} tokens, {r.tree_episodes} episode(s)"
    )
    return summary + "\n" + _indent(render(timeline, width))


def cost_text(usage: TokenUsage) -> str:
    """An episode's cost as a person reads it; unknown when a model had no price."""
    return "cost unknown (a model has no price)" if usage.cost_usd is None else f"${usage.cost_usd:.4f}"


def ending_text(result: EpisodeResult) -> str:
    """How an episode ended, as every command and the page say it: the ending in the one
    vocabulary (answered, extracted, no answer, failed, cancelled, ...), then what ended it
    (`final_var`, `max_iterations`, ...) when that says more."""
    words = ending_words(result.status)
    return words if result.ended_by == result.status else f"{words} ({result.ended_by})"


def ended_line(result: EpisodeResult) -> str:
    """`ended: no answer (max_iterations) after 3 iteration(s), 3 model call(s), ...`"""
    return (
        f"ended: {ending_text(result)} after {result.iterations} iteration(s), {result.model_calls} "
        f"model call(s) ({result.sub_calls} from the REPL), {result.usage.total_tokens:,} tokens, "
        f"{cost_text(result.usage)}"
    )


def termination_text(decision: TerminationDecision) -> str:
    """A policy's decision; `step` is 0-based (the policy's own count), iterations are not."""
    return (
        f"Termination: policy {decision.policy} at iteration {decision.step + 1} "
        f"({decision.action_type}): {decision.reason}"
    )


_CANCELLED_PREFIX = "Cancelled: "


def describe_execution(execution: ExecutionResult, status: str | None = None) -> str:
    """One line on how the outputs were obtained (fallback extraction's result variants, and a
    policy stop);
    a `failed` variant is named after the episode's ending (`status`): a cancel, no answer,
    or a failure."""
    v = execution.variant
    if v.kind == "submitted":
        return f"Result: submitted (confidence 1.0), outputs {json.dumps(v.outputs, sort_keys=True)}"
    if v.kind == "extracted":
        notes = f"; notes: {v.extraction_notes}" if v.extraction_notes else ""
        return (
            f"Result: extracted after {v.reason} (confidence {v.confidence():.2f}), "
            f"outputs {json.dumps(v.outputs, sort_keys=True)}{notes}"
        )
    if v.kind == "stopped":
        found = f", with an answer it found: {json.dumps(v.outputs, sort_keys=True)}" if v.outputs else ""
        return f"Result: stopped by policy {v.policy} ({v.reason}){found}; no confidence claimed"
    partial = (
        f"; partial outputs {json.dumps(v.partial_outputs, sort_keys=True)}" if v.partial_outputs else ""
    )
    kept = f"; {len(v.history)} REPL history entries kept" if v.history else ""
    if status == "cancelled":
        return f"Result: cancelled: {v.reason.removeprefix(_CANCELLED_PREFIX)}{partial}{kept}"
    words = ending_words(status) if status in ("no_answer", "failed") else "failed"
    return f"Result: {words}: {v.reason}{partial}{kept}"


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines()) or "    "
