"""What the Temporal Web UI shows of an episode (docs/guides/viewer.md): a summary on every
step, the child episodes' summaries, the memo, and search attributes the list of workflows
filters on, kept current through a pause and at the end. On a server without the attributes
an episode still completes. `python -m tests.test_ui_metadata` records the replay history."""

from __future__ import annotations

import asyncio
import base64
import json
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import given
from hypothesis import strategies as st
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest, RemoveSearchAttributesRequest
from temporalio.api.sdk.v1 import WorkflowMetadata
from temporalio.client import Client, WorkflowHandle, WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import DataConverter
from temporalio.service import RPCError
from temporalio.worker import Replayer

from durable_rlm.client.episodes import ask_search_attributes, has_search_attributes, store_context
from durable_rlm.scripted import ChatRequest, Reply, ScriptedModelServer
from durable_rlm.store.blobs import BlobStore
from durable_rlm.store.codec import data_converter
from durable_rlm.worker.runtime import EmbeddedServer, workflow_runner
from durable_rlm.workflows import metadata, names
from durable_rlm.workflows.episode import EpisodeWorkflow
from durable_rlm.workflows.models import EpisodeRequest, EpisodeResult, ModelSettings
from tests.conftest import request_for, workers_for

REGISTER = tuple(
    arg for name, kind in metadata.SEARCH_ATTRIBUTES for arg in ("--search-attribute", f"{name}={kind}")
)
HISTORIES = Path(__file__).parent / "histories"

TASK = "Count the words of the context and describe them"
ROOT = [
    "Let me count.\n```repl\ncounts = context.split()\nprint(len(counts))\n```",
    "```repl\nsummary = llm_query('Describe: ' + context)\nchild = rlm_query('1,2,3', model='child-m')\n"
    "print(summary, child)\n```",
    "FINAL_VAR(summary)",
]
CHILD = ["```repl\nt = sum(int(x) for x in context.split(','))\nprint(t)\n```", "FINAL_VAR(t)"]


def episode_script(refuse_once: bool) -> Callable[[ChatRequest], Reply | str]:
    """The root counts, asks a sub-model and a child episode, and answers; with
    `refuse_once`, its second root call is refused once (401): the episode pauses."""
    refused: list[int] = []

    def script(request: ChatRequest) -> Reply | str:
        if not request.is_root:
            return request.last_user.upper()
        if request.model == "child-m":
            return CHILD[min(request.turn, len(CHILD) - 1)]
        if refuse_once and request.turn == 1 and not refused:
            refused.append(1)
            return Reply(status=401, error="Incorrect API key provided")
        return ROOT[min(request.turn, len(ROOT) - 1)]

    return script


def episode_request(server: ScriptedModelServer, blobs: BlobStore) -> EpisodeRequest:
    child = ModelSettings(model="child-m", base_url=server.base_url, max_attempts=3)
    context = store_context(blobs, "alpha beta gamma")
    return request_for(server, TASK, context=context, max_depth=2, other_models=[child], seed=7)


async def start(client: Client, request: EpisodeRequest, queue: str, episode_id: str) -> WorkflowHandle:
    return await client.start_workflow(
        names.WORKFLOW,
        request,
        id=episode_id,
        task_queue=queue,
        result_type=EpisodeResult,
        search_attributes=metadata.start_search_attributes(request.task, request.root_model.model),
    )


# --- a server that registered the attributes ---------------------------------------------


@pytest.fixture(scope="module")
async def ui_client(session_dir: Path, blobs: BlobStore) -> AsyncIterator[Client]:
    async with EmbeddedServer(session_dir / "ui.sqlite", extra_args=REGISTER) as address:
        yield await Client.connect(address, data_converter=data_converter(blobs))


@pytest.fixture(scope="module")
async def ui_queue(
    ui_client: Client, store: tuple[BlobStore, sa.Engine], session_dir: Path
) -> AsyncIterator[str]:
    queue = f"ui-{uuid.uuid4().hex[:8]}"
    async with workers_for(ui_client, store, session_dir, queue):
        yield queue


def summary_of(event: HistoryEvent, converter: DataConverter) -> str | None:
    if not event.user_metadata.HasField("summary"):
        return None
    return converter.payload_converter.from_payload(event.user_metadata.summary, str)


def summaries(events: list[HistoryEvent], converter: DataConverter, event_type: int) -> list[str | None]:
    return [summary_of(e, converter) for e in events if e.event_type == event_type]


def upserted(events: list[HistoryEvent]) -> list[dict[str, Any]]:
    """Our attributes of each UpsertWorkflowSearchAttributes event (patched() upserts its own)."""
    out = []
    for e in events:
        if e.event_type == EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES:
            fields = e.upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields
            ours = {k: json.loads(v.data) for k, v in fields.items() if k.startswith("Drlm")}
            if ours:
                out.append(ours)
    return out


async def listed(client: Client, query: str, expected: int = 1) -> list[Any]:
    """Visibility is eventually consistent: wait (briefly) for the list to catch up."""
    found: list[Any] = []
    for _ in range(300):
        found = [w async for w in client.list_workflows(query)]
        if len(found) >= expected:
            return found
        await asyncio.sleep(0.1)
    return found


async def test_an_episode_reads_like_itself_in_the_ui(ui_client, ui_queue, blobs, scripted) -> None:
    server = scripted(episode_script(refuse_once=True))
    request = episode_request(server, blobs)
    episode_id = f"ui-{uuid.uuid4().hex[:8]}"
    handle = await start(ui_client, request, ui_queue, episode_id)

    # The second root call's key was refused: the list shows the episode paused.
    paused = await listed(ui_client, f'WorkflowId = "{episode_id}" AND DrlmStatus = "paused"')
    assert [w.id for w in paused] == [episode_id]
    assert paused[0].typed_search_attributes.get(metadata.ITERATIONS) == 2
    await handle.execute_update(names.RETRY_CREDENTIALS)
    result = await asyncio.wait_for(handle.result(), 60)
    assert (result.answer, result.ended_by, result.iterations) == (
        "DESCRIBE: ALPHA BETA GAMMA",
        "final_var",
        3,
    )

    # Listed by model and status, with how it ended.
    (row,) = await listed(
        ui_client, f'DrlmModel = "scripted" AND DrlmStatus = "answered" AND WorkflowId = "{episode_id}"'
    )
    attrs = row.typed_search_attributes
    assert attrs.get(metadata.TASK) == TASK
    assert attrs.get(metadata.ANSWER_SOURCE) == "model"
    assert attrs.get(metadata.ENDED_BY) == "final_var"
    assert attrs.get(metadata.ITERATIONS) == 3
    assert attrs.get(metadata.TOKENS) == result.usage.total_tokens > 0
    assert await listed(
        ui_client, f'DrlmIterations >= 3 AND DrlmAnswerSource = "model" AND WorkflowId = "{episode_id}"'
    )

    history = await handle.fetch_history()
    events = list(history.events)
    converter = ui_client.data_converter
    # Every step says what it is.
    assert summaries(events, converter, EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED) == [
        "audit: running",
        "root call 1",
        "root call 2",  # refused: the episode paused
        "root call 2",  # the same call, after retry_credentials
        "llm_query 2.0: Describe: alpha beta gamma",
        "root call 3",
        "audit: answered",
    ]
    local = [
        summary_of(e, converter)
        for e in events
        if e.marker_recorded_event_attributes.marker_name == "core_local_activity"
    ]
    assert local == [
        "cell 1: `counts = context.split()…`",
        "cell 2: `summary = llm_query('Describe: ' + context)…`",
        "cell 2 resumed with 1 answer(s)",
        "cell 2 resumed with 1 answer(s)",
        "read variable summary",
        "close the sandbox",
    ]
    # The durable timer is named (it showed as "1").
    assert summaries(events, converter, EventType.EVENT_TYPE_TIMER_STARTED) == ["max_duration"]
    (child_start,) = [
        e for e in events if e.event_type == EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED
    ]
    assert summary_of(child_start, converter) == "rlm_query 2.1: 1,2,3"
    details = converter.payload_converter.from_payload(child_start.user_metadata.details, str)
    assert details.startswith("Child episode at depth 1, model child-m: call 1 of cell 2 of ui-")

    # The memo, and the attributes: upserted when it paused, resumed and ended, not each iteration.
    memo = await (await handle.describe()).memo()
    assert memo == {"task": TASK, "model": "scripted", "depth": 0}
    assert [u["DrlmStatus"] for u in upserted(events)] == ["paused", "running", "answered"]
    assert upserted(events)[-1] == {
        "DrlmStatus": "answered",
        "DrlmIterations": 3,
        "DrlmTokens": result.usage.total_tokens,
        "DrlmEndedBy": "final_var",
        "DrlmAnswerSource": "model",
    }
    # The UI's "current details" (a query: no history).
    meta = await handle.query("__temporal_workflow_metadata", result_type=WorkflowMetadata)
    assert meta.current_details == "iteration 3: ended: answered (final_var)"

    # The child: its memo names its prompt and parent; it is listed under its own model.
    child_id = f"{episode_id}/2.1"
    child_memo = await (await ui_client.get_workflow_handle(child_id).describe()).memo()
    assert {k: child_memo[k] for k in ("parent", "depth", "prompt", "model")} == {
        "parent": episode_id,
        "depth": 1,
        "prompt": "1,2,3",
        "model": "child-m",
    }
    (child_row,) = await listed(ui_client, f'DrlmModel = "child-m" AND WorkflowId = "{child_id}"')
    assert child_row.typed_search_attributes.get(metadata.STATUS) == "answered"
    assert child_row.typed_search_attributes.get(metadata.TASK) == "1,2,3"
    assert child_row.typed_search_attributes.get(metadata.ITERATIONS) == 2

    replayer = Replayer(
        workflows=[EpisodeWorkflow], data_converter=converter, workflow_runner=workflow_runner()
    )
    assert (await replayer.replay_workflow(history)).replay_failure is None


# --- a server without them ----------------------------------------------------------------


async def test_an_episode_on_a_server_without_the_attributes_completes(
    session_dir: Path, store: tuple[BlobStore, sa.Engine], blobs: BlobStore, scripted
) -> None:
    server = scripted(episode_script(refuse_once=False))
    request = episode_request(server, blobs)
    async with EmbeddedServer(session_dir / "bare.sqlite") as address:
        client = await Client.connect(address, data_converter=data_converter(blobs))
        await _unregister(client)
        queue = f"bare-{uuid.uuid4().hex[:8]}"
        async with workers_for(client, store, session_dir, queue):
            # A client that names them anyway is refused at once: nothing starts, nothing hangs.
            with pytest.raises(RPCError, match="no mapping defined for search attribute"):
                await start(client, request, queue, f"bare-{uuid.uuid4().hex[:8]}")
            # Started without them, the episode (and its child) never upserts them.
            episode_id = f"bare-{uuid.uuid4().hex[:8]}"
            handle = await client.start_workflow(
                names.WORKFLOW, request, id=episode_id, task_queue=queue, result_type=EpisodeResult
            )
            result = await asyncio.wait_for(handle.result(), 60)
            assert (result.answer, result.ended_by) == ("DESCRIBE: ALPHA BETA GAMMA", "final_var")
            history = await handle.fetch_history()
            assert upserted(list(history.events)) == []
            child = await client.get_workflow_handle(f"{episode_id}/2.1").fetch_history()
            assert upserted(list(child.events)) == []
            # The memo and the summaries need no registration.
            assert (await (await handle.describe()).memo())["model"] == "scripted"
            scheduled = summaries(
                list(history.events), client.data_converter, EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
            )
            assert "llm_query 2.0: Describe: alpha beta gamma" in scheduled


async def _unregister(client: Client) -> None:
    """Make sure this server lacks them, even if the embedded server someday registers them."""
    listing = await client.operator_service.list_search_attributes(
        ListSearchAttributesRequest(namespace="default")
    )
    ours = [name for name, _ in metadata.SEARCH_ATTRIBUTES if name in listing.custom_attributes]
    if ours:
        await client.operator_service.remove_search_attributes(
            RemoveSearchAttributesRequest(namespace="default", search_attributes=ours)
        )


# --- the stored history --------------------------------------------------------------------


def _stored(name: str) -> list[dict[str, Any]]:
    return json.loads((HISTORIES / f"{name}.json").read_text())["events"]


def test_the_stored_ui_history_upserts_the_memo_and_the_attributes() -> None:
    events = _stored("ui_metadata")
    types = [e["eventType"] for e in events]
    assert "EVENT_TYPE_WORKFLOW_PROPERTIES_MODIFIED" in types  # the memo
    statuses = [
        e["upsertWorkflowSearchAttributesEventAttributes"]["searchAttributes"]["indexedFields"]
        for e in events
        if "DrlmStatus"
        in e.get("upsertWorkflowSearchAttributesEventAttributes", {})
        .get("searchAttributes", {})
        .get("indexedFields", {})
    ]
    assert len(statuses) == 3  # paused, running, answered
    child = _stored("ui_metadata_child")
    assert "EVENT_TYPE_WORKFLOW_PROPERTIES_MODIFIED" in [e["eventType"] for e in child]


async def test_summaries_are_not_compared_on_replay() -> None:
    # A step's summary is metadata, not a command: a history whose summaries read otherwise
    # than today's code writes them ("root model, iteration N" for a root call, say) still
    # replays, so rewording a summary needs no new workflow version.
    name = "local_steps"
    events = json.loads((HISTORIES / f"{name}.json").read_text())
    reworded = 0
    for event in events["events"]:
        summary = event.get("userMetadata", {}).get("summary")
        if summary is not None:
            summary["data"] = base64.b64encode(json.dumps(f"step {reworded}").encode()).decode()
            reworded += 1
    assert reworded > 5
    history = WorkflowHistory.from_json(name, events)
    recorded = [summary_of(e, pydantic_data_converter) for e in history.events]
    assert "step 1" in recorded
    replayer = Replayer(
        workflows=[EpisodeWorkflow], data_converter=pydantic_data_converter, workflow_runner=workflow_runner()
    )
    assert (await replayer.replay_workflow(history)).replay_failure is None


# --- summaries: one line, bounded, linear -------------------------------------------------


@given(st.text(), st.integers(min_value=2, max_value=80))
def test_a_summary_is_one_bounded_line(text: str, limit: int) -> None:
    shown = metadata.shorten(text, limit)
    assert len(shown) <= limit and "\n" not in shown and shown.isprintable()
    first = text.strip().split("\n")[0].strip() if text.strip() else ""
    if first and first.isprintable() and len(first) <= limit and first == text.strip():
        assert shown == first  # one short line is shown as it is


def test_summaries_read_like_the_step() -> None:
    assert metadata.cell_summary(2, "\n\n  counts = {}\nfor x in y:\n    pass") == "cell 2: `counts = {}…`"
    assert metadata.cell_summary(3, "print(`x`)") == "cell 3: `print('x')`"
    assert metadata.cell_summary(4, "   \n") == "cell 4: (blank)"
    long = "Describe the following log lines in great detail, then count them by level please"
    assert metadata.call_summary("llm_query", 2, 1, long) == (
        "llm_query 2.1: Describe the following log lines in great detail, then…"
    )
    assert metadata.call_summary("llm_query", 2, 1, "hi", model="small") == "llm_query 2.1 (small): hi"


@pytest.mark.parametrize(
    "text",
    [
        " " * 10_000_000,
        "\n" * 10_000_000 + "x",
        "x" * 10_000_000,
        "x\n" + " \n" * 5_000_000,
        "`" * 10_000_000,
    ],
    ids=["blank", "late line", "one long line", "blank lines after", "backticks"],
)
def test_summaries_take_linear_time_and_stay_short(text: str) -> None:
    began = time.perf_counter()
    summary = metadata.cell_summary(1, text)
    assert time.perf_counter() - began < 1.0  # ~0.05 s measured for 10 MB
    assert len(summary) <= 72


# --- recording the replay history ------------------------------------------------------------


async def record() -> None:
    """Record tests/histories/ui_metadata.json (and its child) with the plain converter."""
    from durable_rlm.settings import Settings
    from durable_rlm.store.blobs import SqlBackend
    from durable_rlm.store.sql import open_store
    from durable_rlm.worker.runtime import Services, running_workers

    work = Path(tempfile.mkdtemp(prefix="drlm-record-ui-"))
    engine = open_store(f"sqlite:///{work / 'drlm.sqlite'}")
    blobs = BlobStore(SqlBackend(engine))
    async with EmbeddedServer(work / "temporal.sqlite", extra_args=REGISTER) as address:
        client = await Client.connect(address, data_converter=pydantic_data_converter)
        services = Services(Settings(task_queue="record", data_dir=work), blobs, engine, client)
        with ScriptedModelServer(episode_script(refuse_once=True)) as server:
            async with running_workers(services):
                request = episode_request(server, blobs)
                handle = await start(client, request, "record", "ui_metadata")
                while not await listed(client, 'WorkflowId = "ui_metadata" AND DrlmStatus = "paused"'):
                    await asyncio.sleep(0.1)
                await handle.execute_update(names.RETRY_CREDENTIALS)
                await handle.result()
                for workflow_id, name in (
                    ("ui_metadata", "ui_metadata"),
                    ("ui_metadata/2.1", "ui_metadata_child"),
                ):
                    history = await client.get_workflow_handle(workflow_id).fetch_history()
                    (HISTORIES / f"{name}.json").write_text(history.to_json())
                    print("recorded", name)


if __name__ == "__main__":
    asyncio.run(record())
    sys.exit(0)


async def test_a_client_asks_for_the_attributes_once(client: Client) -> None:
    """A session asks as it connects (durable_rlm/worker/runtime.py `session`); the first
    episode's start then awaits that same question instead of putting its own."""
    asked = ask_search_attributes(client)
    assert ask_search_attributes(client) is asked  # pending or answered: the same question
    assert await has_search_attributes(client) is False  # the tests' server registers none
    assert ask_search_attributes(client) is asked and asked.result() is False
