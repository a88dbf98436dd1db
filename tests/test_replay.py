"""Replay: every stored history replays with the current workflow code."""

from __future__ import annotations

import base64
import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from temporalio import workflow
from temporalio.api.common.v1 import Payload
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer, UnsandboxedWorkflowRunner

from durable_rlm.scripted import root_and_sub
from durable_rlm.store.codec import DEFAULT_THRESHOLD, ENCODING
from durable_rlm.worker.runtime import workflow_runner
from durable_rlm.workflows import names
from durable_rlm.workflows.episode import EpisodeWorkflow
from durable_rlm.workflows.models import EpisodeRequest, EpisodeResult
from durable_rlm.workflows.session import SessionWorkflow
from durable_rlm.workflows.session_models import SessionEnd, SessionStart
from tests.conftest import request_for, run_episode

HISTORIES = sorted((Path(__file__).parent / "histories").glob("*.json"))


def load(path: Path) -> WorkflowHistory:
    return WorkflowHistory.from_json(path.stem, json.loads(path.read_text()))


def test_there_is_a_stored_multi_iteration_history() -> None:
    assert HISTORIES, "tests/histories/ holds no history"
    events = json.loads((HISTORIES[0].parent / "multi_iteration_final_var.json").read_text())["events"]
    scheduled = [e for e in events if e.get("eventType") in ("EVENT_TYPE_ACTIVITY_TASK_SCHEDULED", 10)]
    roots = [
        e
        for e in scheduled
        if e["activityTaskScheduledEventAttributes"]["activityType"]["name"] == names.ROOT_COMPLETION
    ]
    assert len(roots) >= 3


def _activity_types(name: str) -> list[str]:
    events = json.loads((HISTORIES[0].parent / name).read_text())["events"]
    return [
        e["activityTaskScheduledEventAttributes"]["activityType"]["name"]
        for e in events
        if "activityTaskScheduledEventAttributes" in e
    ]


def _has_patch_marker(name: str, patch: str = names.PATCH_FALLBACK_EXTRACTION) -> bool:
    events = json.loads((HISTORIES[0].parent / name).read_text())["events"]
    for event in events:
        marker = event.get("markerRecordedEventAttributes")
        if marker and marker["markerName"] == "core_patch":
            payload = marker["details"]["patch-data"]["payloads"][0]["data"]
            if json.loads(base64.b64decode(payload))["id"] == patch:
                return True
    return False


NEW_KINDS = [
    "answer_from_a_cell",
    "policy_stopped",
    "compacted",
    "lost_cells",
    "cancelled",
    "children",
    "children_child",
    "cancelled_tree",
    "cancelled_tree_child",
    "tools",
]
OLD_RULES = ["multi_iteration_final_var", "limit_before_extraction", "fallback_extracted", "reward_driven"]


def test_both_sides_of_the_honest_endings_patch_are_stored() -> None:
    for name in OLD_RULES:
        assert not _has_patch_marker(f"{name}.json", names.PATCH_HONEST_ENDINGS), name
    for name in NEW_KINDS:
        assert _has_patch_marker(f"{name}.json", names.PATCH_HONEST_ENDINGS), name


def test_the_new_kinds_of_episode_show_their_steps() -> None:
    assert names.COMPACT_CONVERSATION in _activity_types("compacted.json")
    # The sandbox could not start (a non-retryable failure): the cell was lost, and the
    # episode went on to ask the model again instead of failing.
    assert _activity_types("lost_cells.json")[1:4] == [
        names.ROOT_COMPLETION,
        names.REPL_EXECUTE,
        names.ROOT_COMPLETION,
    ]
    cancelled = json.loads((HISTORIES[0].parent / "cancelled.json").read_text())["events"]
    assert cancelled[-1]["eventType"] in ("EVENT_TYPE_WORKFLOW_EXECUTION_CANCELED", 26)
    assert _activity_types("cancelled.json")[-1] == names.AUDIT_EPISODE  # the row is closed


def _event_types(name: str) -> list[str]:
    return [e["eventType"] for e in json.loads((HISTORIES[0].parent / name).read_text())["events"]]


def test_trees_of_episodes_are_stored() -> None:
    # A parent that started two children and had their results; a child that knows its parent.
    events = _event_types("children.json")
    assert events.count("EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED") == 2
    assert events.count("EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_COMPLETED") == 2
    child = json.loads((HISTORIES[0].parent / "children_child.json").read_text())["events"][0]
    assert (
        child["workflowExecutionStartedEventAttributes"]["parentWorkflowExecution"]["workflowId"]
        == "children"
    )
    # Cancelled on request with extraction while its children ran: they were cancelled first.
    cancelled = _event_types("cancelled_tree.json")
    assert cancelled.count("EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_CANCELED") == 2
    assert "EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED" in cancelled
    assert _activity_types("cancelled_tree.json")[-3:] == [
        names.EXTRACT_FALLBACK,
        names.REPL_CLOSE,
        names.AUDIT_EPISODE,
    ]
    assert _event_types("cancelled_tree_child.json")[-1] == "EVENT_TYPE_WORKFLOW_EXECUTION_CANCELED"
    assert _has_patch_marker("cancelled_tree.json", names.PATCH_CANCEL_WAVE)
    assert not _has_patch_marker("cancelled.json", names.PATCH_CANCEL_WAVE)


def test_histories_with_local_repl_steps_are_stored() -> None:
    # REPL steps as local activities: markers in history, no activity events for them.
    for name in ("local_steps", "local_lost"):
        assert _has_patch_marker(f"{name}.json", names.PATCH_LOCAL_REPL), name
        assert names.REPL_EXECUTE not in _activity_types(f"{name}.json")
    events = json.loads((HISTORIES[0].parent / "local_steps.json").read_text())["events"]
    local = [
        e
        for e in events
        if e.get("markerRecordedEventAttributes", {}).get("markerName") == "core_local_activity"
    ]
    assert len(local) == 7  # 3 cells, 2 resumes, a variable read, the close
    for name in OLD_RULES + NEW_KINDS:
        assert not _has_patch_marker(f"{name}.json", names.PATCH_LOCAL_REPL), name


def test_a_history_with_repl_snapshots_is_stored() -> None:
    # Cell 1 read the clock: its step's result names the snapshot taken after it.
    assert _has_patch_marker("snapshots.json", names.PATCH_SNAPSHOTS)
    events = json.loads((HISTORIES[0].parent / "snapshots.json").read_text())["events"]
    results = [
        base64.b64decode(p["data"]).decode()
        for e in events
        if e.get("markerRecordedEventAttributes", {}).get("markerName") == "core_local_activity"
        for p in e["markerRecordedEventAttributes"]["details"].get("result", {}).get("payloads", [])
    ]
    assert sum('"snapshot":{"digest"' in r for r in results) == 1
    for path in HISTORIES:
        if path.stem not in ("snapshots", *UI_METADATA, *LATER):  # those were recorded later
            assert not _has_patch_marker(path.name, names.PATCH_SNAPSHOTS), path.stem


UI_METADATA = ["ui_metadata", "ui_metadata_child"]  # recorded by python -m tests.test_ui_metadata
LATER = [
    "cost_budget",
    "audit_aside",
    "sandboxes_busy",
    "steering",
    "fork",
    "final_as_written",
    "token_budget_fits",
    "setup_code",
    "cancel_sticks",
]  # recorded after the ui-metadata patch: they carry its marker too


def test_both_sides_of_the_ui_metadata_patch_are_stored() -> None:
    # The memo and search-attribute upserts are commands: only histories recorded since have them.
    for path in HISTORIES:
        recorded_since = path.stem in (*UI_METADATA, *LATER)
        assert _has_patch_marker(path.name, names.PATCH_UI_METADATA) == recorded_since, path.stem


def test_both_sides_of_the_audit_aside_patch_are_stored() -> None:
    # Since audit-aside the opening audit is scheduled with the first root call, in one task.
    for path in HISTORIES:
        since = path.stem in (
            "audit_aside",
            "sandboxes_busy",
            "steering",
            "fork",
            "final_as_written",
            "token_budget_fits",
            "setup_code",
            "cancel_sticks",
        )  # recorded after it
        assert _has_patch_marker(path.name, names.PATCH_AUDIT_ASIDE) == since, path.stem
    types = _activity_types("audit_aside.json")
    assert types[:2] == [names.AUDIT_EPISODE, names.ROOT_COMPLETION] and types[-1] == names.AUDIT_EPISODE


def test_a_history_of_an_episode_ended_by_its_cost_budget_is_stored() -> None:
    # Token and cost budgets keep room for the extraction behind the budget-reserve patch;
    # episodes without such a budget never ask for it, so no other history has the marker.
    for path in HISTORIES:
        marked = _has_patch_marker(path.name, names.PATCH_BUDGET_RESERVE)
        assert marked == (path.stem in ("cost_budget", "token_budget_fits")), path.stem
    assert names.EXTRACT_FALLBACK in _activity_types("cost_budget.json")
    assert "WORKFLOW_EXECUTION_UPDATE_ACCEPTED" in "".join(_event_types("cost_budget.json"))


def test_both_sides_of_the_budget_fits_patch_are_stored() -> None:
    # Recorded before it: a budget kept an extraction's room from the first call on.
    assert not _has_patch_marker("cost_budget.json", names.PATCH_BUDGET_FITS)
    # Recorded after: a 2,500-token budget makes its root calls, then extracts.
    assert _has_patch_marker("token_budget_fits.json", names.PATCH_BUDGET_FITS)
    types = _activity_types("token_budget_fits.json")
    assert types.count(names.ROOT_COMPLETION) >= 2 and types[-2:].count(names.EXTRACT_FALLBACK) >= 1


def test_a_history_with_setup_code_runs_it_before_the_first_root_call() -> None:
    assert _has_patch_marker("setup_code.json", names.PATCH_SETUP_CODE)
    assert not any(
        _has_patch_marker(p.name, names.PATCH_SETUP_CODE) for p in HISTORIES if p.stem != "setup_code"
    )
    events = json.loads((HISTORIES[0].parent / "setup_code.json").read_text())["events"]
    steps = []  # REPL steps here are local activities (markers); model calls are scheduled
    for event in events:
        marker = event.get("markerRecordedEventAttributes", {})
        if marker.get("markerName") == "core_local_activity":
            data = json.loads(base64.b64decode(marker["details"]["data"]["payloads"][0]["data"]))
            steps.append(data["activity_type"])
        elif "activityTaskScheduledEventAttributes" in event:
            steps.append(event["activityTaskScheduledEventAttributes"]["activityType"]["name"])
    assert steps.index(names.REPL_EXECUTE) < steps.index(names.ROOT_COMPLETION)


def test_a_history_with_a_step_that_waited_for_a_sandbox_is_stored() -> None:
    # A step whose wait for a sandbox ran out is asked again after a timer (SandboxesBusy).
    text = (HISTORIES[0].parent / "sandboxes_busy.json").read_text()
    assert names.SANDBOXES_BUSY in text
    assert "EVENT_TYPE_TIMER_FIRED" in _event_types("sandboxes_busy.json")


def test_a_history_with_custom_tools_is_stored() -> None:
    assert _activity_types("tools.json").count(names.RUN_TOOL) == 3  # retries are attempts of one


def test_both_sides_of_the_fallback_patch_are_stored() -> None:
    # Recorded by the code before seed 004: the limit ended the episode, no extraction.
    assert names.EXTRACT_FALLBACK not in _activity_types("limit_before_extraction.json")
    assert not _has_patch_marker("limit_before_extraction.json")
    # Recorded today: the same kind of limit runs the extraction, behind the patch marker.
    assert names.EXTRACT_FALLBACK in _activity_types("fallback_extracted.json")
    assert _has_patch_marker("fallback_extracted.json")


@pytest.mark.parametrize("path", HISTORIES, ids=lambda p: p.stem)
async def test_stored_history_replays(path: Path) -> None:
    replayer = Replayer(
        workflows=[EpisodeWorkflow], data_converter=pydantic_data_converter, workflow_runner=workflow_runner()
    )
    result = await replayer.replay_workflow(load(path))
    assert result.replay_failure is None


@workflow.defn(name=names.WORKFLOW, sandboxed=False)
class WithoutAudit(EpisodeWorkflow):
    """A logic change that drops an activity: replay must notice."""

    @workflow.run
    async def run(self, request: EpisodeRequest) -> EpisodeResult:
        return await super().run(request)

    async def _audit(self, request, result) -> None:  # type: ignore[override]
        return None


@pytest.mark.parametrize("path", HISTORIES, ids=lambda p: p.stem)
async def test_an_unpatched_logic_change_fails_replay(path: Path) -> None:
    replayer = Replayer(
        workflows=[WithoutAudit],
        data_converter=pydantic_data_converter,
        workflow_runner=UnsandboxedWorkflowRunner(),
    )
    result = await replayer.replay_workflow(load(path), raise_on_replay_failure=False)
    assert result.replay_failure is not None


async def test_a_fresh_claim_checked_history_replays(client, blobs, worker, scripted) -> None:
    server = scripted(
        root_and_sub(
            ["```repl\nbig = 'y' * 50_000\nprint(big)\nr = llm_query(big[:10])\n```", "FINAL_VAR(r)"],
            str.upper,
        )
    )
    episode_id = f"replay-{uuid.uuid4().hex[:6]}"
    await run_episode(client, request_for(server), worker.task_queue, episode_id)
    history = await client.get_workflow_handle(episode_id).fetch_history()
    replayer = Replayer(
        workflows=[EpisodeWorkflow], data_converter=client.data_converter, workflow_runner=workflow_runner()
    )
    result = await replayer.replay_workflow(history)
    assert result.replay_failure is None
    # The history holds digests, not the 50 KB output: the claim check did its work ...
    payloads = list(_payloads(history.events))
    claimed = [p for p in payloads if p.metadata.get("encoding") == ENCODING]
    assert claimed and all(p.ByteSize() < 200 for p in claimed)
    assert max(p.ByteSize() for p in payloads) <= DEFAULT_THRESHOLD
    # ... so replaying it needs the blob store behind the codec.
    plain = Replayer(
        workflows=[EpisodeWorkflow], data_converter=pydantic_data_converter, workflow_runner=workflow_runner()
    )
    assert (await plain.replay_workflow(history, raise_on_replay_failure=False)).replay_failure is not None


def _payloads(messages) -> Iterator[Payload]:
    """Every Payload inside protobuf messages (a history's events), however deep."""
    for message in messages:
        if isinstance(message, Payload):
            yield message
            continue
        for field, value in message.ListFields():
            if field.message_type is None:
                continue
            if field.is_repeated:
                items = value.values() if field.message_type.GetOptions().map_entry else value
                yield from _payloads(items)
            else:
                yield from _payloads([value])


def test_the_steering_history_holds_every_kind_of_action() -> None:
    """steering.json (replayed above like every history) holds each action a person can send."""
    events = json.loads((HISTORIES[0].parent / "steering.json").read_text())["events"]
    updates = [
        e["workflowExecutionUpdateAcceptedEventAttributes"]["acceptedRequest"]["input"]
        for e in events
        if "workflowExecutionUpdateAcceptedEventAttributes" in e
    ]
    names_sent = {u["name"] for u in updates}
    assert names_sent == {
        names.HINT,
        names.SET_LIMITS,
        names.PAUSE,
        names.RESUME,
        names.FINISH_NOW,
        names.DECIDE_CELL,
    }
    decisions = [
        json.loads(base64.b64decode(u["args"]["payloads"][0]["data"]))
        for u in updates
        if u["name"] == names.DECIDE_CELL
    ]
    kinds = {("edit" if d.get("code") else "approve") if d["approve"] else "reject" for d in decisions}
    assert kinds == {"approve", "edit", "reject"}
    assert _has_patch_marker("steering.json", names.PATCH_STEERING)


def test_the_fork_history_starts_from_its_source_s_state() -> None:
    """fork.json (replayed above like every history): a fork after iteration 2 asks its
    model for iteration 3 first, and its first cell rebuilds the REPL from the log."""
    events = json.loads((HISTORIES[0].parent / "fork.json").read_text())["events"]
    started = events[0]["workflowExecutionStartedEventAttributes"]["input"]["payloads"][0]["data"]
    request = json.loads(base64.b64decode(started))
    assert request["fork"]["source_id"] == "fork_source" and request["fork"]["iteration"] == 2
    assert request["carry"]["iteration"] == 2 and request["carry"]["sub_calls"] == 1
    roots = [
        json.loads(
            base64.b64decode(e["activityTaskScheduledEventAttributes"]["input"]["payloads"][0]["data"])
        )
        for e in events
        if e.get("activityTaskScheduledEventAttributes", {}).get("activityType", {}).get("name")
        == names.ROOT_COMPLETION
    ]
    assert [r["iteration"] for r in roots] == [3, 4]
    payloads = [
        base64.b64decode(p).decode() for p in re.findall(r'"data": "([A-Za-z0-9+/=]+)"', json.dumps(events))
    ]
    (cell,) = [p for p in payloads if '"rebuilt":true' in p]
    assert '"x":"6","y":"SHOUT","z":"6 SHOUT"' in cell  # x and y came back from the log


def test_final_keeps_its_quotes_behind_the_final_as_written_patch() -> None:
    """Seed 001's row FINAL("hello") -> "hello" (quotes included) is recorded with its patch
    marker; every history recorded before it carries no marker and replays (above) with the
    quotes stripped, as it ran."""
    assert _has_patch_marker("final_as_written.json", names.PATCH_FINAL_AS_WRITTEN)
    events = json.loads((HISTORIES[0].parent / "final_as_written.json").read_text())["events"]
    done = events[-1]["workflowExecutionCompletedEventAttributes"]["result"]["payloads"][0]["data"]
    assert json.loads(base64.b64decode(done))["answer"] == '"hello"'
    for path in HISTORIES:
        if path.stem != "final_as_written":
            assert not _has_patch_marker(path.name, names.PATCH_FINAL_AS_WRITTEN), path.stem


def test_a_cancel_read_with_a_reply_is_stored_behind_the_cancel_sticks_patch() -> None:
    """The root model's reply and a cancel read in one workflow task (the reply's handle
    absorbed the cancel): since the patch the episode ends cancelled there, and the reply's
    cell (which waited for approval) never runs. Only this history took that path."""
    assert _has_patch_marker("cancel_sticks.json", names.PATCH_CANCEL_STICKS)
    events = json.loads((HISTORIES[0].parent / "cancel_sticks.json").read_text())["events"]
    kinds = [e["eventType"] for e in events]
    accepted = kinds.index("EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED")
    replied = max(i for i in range(accepted) if kinds[i] == "EVENT_TYPE_ACTIVITY_TASK_COMPLETED")
    assert kinds[replied:accepted].count("EVENT_TYPE_WORKFLOW_TASK_COMPLETED") == 1
    assert _activity_types("cancel_sticks.json") == [
        names.AUDIT_EPISODE, names.ROOT_COMPLETION, names.AUDIT_EPISODE
    ]  # fmt: skip
    done = events[-1]["workflowExecutionCompletedEventAttributes"]["result"]["payloads"][0]["data"]
    assert json.loads(base64.b64decode(done))["ended_by"] == "cancelled"
    for path in HISTORIES:
        if path.stem != "cancel_sticks":
            assert not _has_patch_marker(path.name, names.PATCH_CANCEL_STICKS), path.stem


# --- persistent sessions (workflows/session.py): kept apart, in histories/sessions/ -----------

SESSIONS = Path(__file__).parent / "histories" / "sessions"


def test_a_session_history_is_stored() -> None:
    events = _event_types("sessions/session.json")
    assert events.count("EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED") == 2  # two turns
    assert events.count("EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED") == 3  # and the close
    first = json.loads((SESSIONS / "session_turn1.json").read_text())["events"][0]
    payload = first["workflowExecutionStartedEventAttributes"]["input"]["payloads"][0]["data"]
    request = json.loads(base64.b64decode(payload))
    assert request["session"]["turn"] == 1 and request["session"]["repl"]["cell_count"] == 2


@pytest.mark.parametrize("name", ["session", "session_turn1"])
async def test_stored_session_histories_replay(name: str) -> None:
    replayer = Replayer(
        workflows=[SessionWorkflow, EpisodeWorkflow],
        data_converter=pydantic_data_converter,
        workflow_runner=workflow_runner(),
    )
    result = await replayer.replay_workflow(load(SESSIONS / f"{name}.json"))
    assert result.replay_failure is None


@workflow.defn(name=names.SESSION_WORKFLOW, sandboxed=False)
class LeavesItsSandbox(SessionWorkflow):
    """Drops the closing step (a local activity): replay must notice."""

    @workflow.init
    def __init__(self, start: SessionStart) -> None:
        super().__init__(start)

    @workflow.run
    async def run(self, start: SessionStart) -> SessionEnd:
        return await super().run(start)

    async def _close_sandbox(self) -> None:
        return None


async def test_a_session_logic_change_fails_replay() -> None:
    replayer = Replayer(
        workflows=[LeavesItsSandbox],
        data_converter=pydantic_data_converter,
        workflow_runner=UnsandboxedWorkflowRunner(),
    )
    result = await replayer.replay_workflow(load(SESSIONS / "session.json"), raise_on_replay_failure=False)
    assert result.replay_failure is not None
