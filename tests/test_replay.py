"""Replay: every stored history replays with the current workflow code."""

from __future__ import annotations

import ast
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
SESSIONS = Path(__file__).parent / "histories" / "sessions"


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


def _patch_markers(name: str) -> list[str]:
    """The ids of the `workflow.patched` markers in a stored history."""
    events = json.loads((HISTORIES[0].parent / name).read_text())["events"]
    found = []
    for event in events:
        marker = event.get("markerRecordedEventAttributes")
        if marker and marker["markerName"] == "core_patch":
            payload = marker["details"]["patch-data"]["payloads"][0]["data"]
            found.append(json.loads(base64.b64decode(payload))["id"])
    return found


def test_no_stored_history_ran_behind_a_patch() -> None:
    """Before a release the code changes freely and the histories are recorded again: none
    holds a patch marker (after a release, tests/test_versioning.py lists the patches)."""
    stored = [*HISTORIES, *sorted(SESSIONS.glob("*.json"))]
    assert {p.stem: _patch_markers(str(p.relative_to(HISTORIES[0].parent))) for p in stored} == {
        p.stem: [] for p in stored
    }


def _patch_id(node: ast.expr) -> str:
    """A patch id as written: a string, or a constant of workflows/names.py."""
    if isinstance(node, ast.Constant):
        return str(node.value)
    return str(getattr(names, ast.unparse(node).removeprefix("names."), ast.unparse(node)))


def test_workflow_code_patches_only_changes_made_after_a_release() -> None:
    """Every `workflow.patched` id in workflows/ is listed with the release it follows, and
    each listed id has a stored history on each side of it."""
    used = set()
    for path in sorted(Path(names.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(("patched", "deprecate_patch")):
                used.add(_patch_id(node.args[0]) if node.args else f"{path.name}:{node.lineno}")
    assert used <= set(names.RELEASED_PATCHES)
    for patch in names.RELEASED_PATCHES:
        sides = {patch in _patch_markers(p.name) for p in HISTORIES}
        assert sides == {True, False}, patch


def test_the_new_kinds_of_episode_show_their_steps() -> None:
    assert names.COMPACT_CONVERSATION in _activity_types("compacted.json")
    # The sandbox could not start (a non-retryable failure): the cell was lost, and the
    # episode went on to ask the model again instead of failing.
    assert _steps("lost_cells.json")[1:4] == [
        names.ROOT_COMPLETION,
        names.REPL_EXECUTE,
        names.ROOT_COMPLETION,
    ]
    cancelled = json.loads((HISTORIES[0].parent / "cancelled.json").read_text())["events"]
    assert cancelled[-1]["eventType"] in ("EVENT_TYPE_WORKFLOW_EXECUTION_CANCELED", 26)
    assert _activity_types("cancelled.json")[-1] == names.AUDIT_EPISODE  # the row is closed


def _steps(name: str) -> list[str]:
    """Every step of a stored history in order: activities scheduled, and local activities
    (REPL steps), which history holds as markers."""
    steps = []
    for event in json.loads((HISTORIES[0].parent / name).read_text())["events"]:
        marker = event.get("markerRecordedEventAttributes", {})
        if marker.get("markerName") == "core_local_activity":
            data = json.loads(base64.b64decode(marker["details"]["data"]["payloads"][0]["data"]))
            steps.append(data["activity_type"])
        elif "activityTaskScheduledEventAttributes" in event:
            steps.append(event["activityTaskScheduledEventAttributes"]["activityType"]["name"])
    return steps


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
    assert _steps("cancelled_tree.json")[-3:] == [
        names.EXTRACT_FALLBACK,
        names.REPL_CLOSE,
        names.AUDIT_EPISODE,
    ]
    assert _event_types("cancelled_tree_child.json")[-1] == "EVENT_TYPE_WORKFLOW_EXECUTION_CANCELED"


def test_histories_with_local_repl_steps_are_stored() -> None:
    # REPL steps as local activities: markers in history, no activity events for them.
    for name in ("local_steps", "local_lost"):
        assert names.REPL_EXECUTE not in _activity_types(f"{name}.json")
    events = json.loads((HISTORIES[0].parent / "local_steps.json").read_text())["events"]
    local = [
        e
        for e in events
        if e.get("markerRecordedEventAttributes", {}).get("markerName") == "core_local_activity"
    ]
    assert len(local) == 7  # 3 cells, 2 resumes, a variable read, the close


def test_a_history_with_repl_snapshots_is_stored() -> None:
    # Cell 1 read the clock: its step's result names the snapshot taken after it.
    events = json.loads((HISTORIES[0].parent / "snapshots.json").read_text())["events"]
    results = [
        base64.b64decode(p["data"]).decode()
        for e in events
        if e.get("markerRecordedEventAttributes", {}).get("markerName") == "core_local_activity"
        for p in e["markerRecordedEventAttributes"]["details"].get("result", {}).get("payloads", [])
    ]
    assert sum('"snapshot":{"digest"' in r for r in results) == 1


def test_the_ui_history_upserts_its_memo() -> None:
    # The memo and the search attributes are commands of their own, in every history.
    for path in HISTORIES:
        assert "EVENT_TYPE_WORKFLOW_PROPERTIES_MODIFIED" in _event_types(path.name), path.stem


def test_the_opening_audit_row_is_written_beside_the_first_root_call() -> None:
    types = _activity_types("audit_aside.json")
    assert types[:2] == [names.AUDIT_EPISODE, names.ROOT_COMPLETION] and types[-1] == names.AUDIT_EPISODE


def test_a_history_of_an_episode_ended_by_its_cost_budget_is_stored() -> None:
    # Token and cost budgets keep room for the extraction: the loop ends while it can be paid.
    assert names.EXTRACT_FALLBACK in _activity_types("cost_budget.json")
    assert "WORKFLOW_EXECUTION_UPDATE_ACCEPTED" in "".join(_event_types("cost_budget.json"))


def test_a_small_token_budget_makes_its_root_calls_then_extracts() -> None:
    # A 2,500-token budget: the first calls need only to fit, the extraction what is left.
    types = _activity_types("token_budget_fits.json")
    assert types.count(names.ROOT_COMPLETION) >= 2 and types[-2:].count(names.EXTRACT_FALLBACK) >= 1


def test_a_history_with_setup_code_runs_it_before_the_first_root_call() -> None:
    steps = _steps("setup_code.json")
    assert steps.index(names.REPL_EXECUTE) < steps.index(names.ROOT_COMPLETION)


def test_a_history_with_a_step_that_waited_for_a_sandbox_is_stored() -> None:
    # A step whose wait for a sandbox ran out is asked again after a timer (SandboxesBusy).
    text = (HISTORIES[0].parent / "sandboxes_busy.json").read_text()
    assert names.SANDBOXES_BUSY in text
    assert "EVENT_TYPE_TIMER_FIRED" in _event_types("sandboxes_busy.json")


def test_a_history_with_custom_tools_is_stored() -> None:
    assert _activity_types("tools.json").count(names.RUN_TOOL) == 3  # retries are attempts of one


def test_a_limit_before_an_answer_runs_the_extraction() -> None:
    assert names.EXTRACT_FALLBACK in _activity_types("fallback_extracted.json")


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


def test_final_keeps_its_quotes() -> None:
    """FINAL("hello") answers "hello", quotes included (docs: "FINAL and FINAL_VAR")."""
    events = json.loads((HISTORIES[0].parent / "final_as_written.json").read_text())["events"]
    done = events[-1]["workflowExecutionCompletedEventAttributes"]["result"]["payloads"][0]["data"]
    assert json.loads(base64.b64decode(done))["answer"] == '"hello"'


def test_a_cancel_read_with_a_reply_ends_the_episode_there() -> None:
    """The root model's reply and a cancel read in one workflow task (the reply's handle
    absorbed the cancel): the episode ends cancelled there, and the reply's cell (which
    waited for approval) never runs."""
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


# --- persistent sessions (workflows/session.py): kept apart, in histories/sessions/ -----------


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


def test_a_dspy_program_s_episodes_are_stored() -> None:
    # durable_rlm.dspy.RLM: one cell per reply, SUBMIT's answer or DSPy's extract at the limit.
    submitted = _activity_types("dspy_submitted.json")
    assert submitted.count(names.ROOT_COMPLETION) == 2 and names.SUB_QUERY in submitted
    assert names.EXTRACT_FALLBACK not in submitted
    extracted = _activity_types("dspy_extracted.json")
    assert extracted.count(names.ROOT_COMPLETION) == 1 and names.EXTRACT_FALLBACK in extracted
