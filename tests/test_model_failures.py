"""Errors that explain (issue 15): a provider reply that is not a completion, an unreachable
endpoint and a refused key, through the real `openai` and `anthropic` clients talking HTTP
to a scripted server on 127.0.0.1, and through whole episodes on a Temporal dev server.

A failure must say its cause first and fit what the server keeps of it (4 KB per activity
failure; over that it stores "Failure exceeds size limit." instead). A refused key pauses
the episode until a worker with the right key is told to retry, without spending an
iteration or a sub-call on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from temporalio.api.enums.v1 import EventType
from temporalio.api.failure.v1 import Failure
from temporalio.client import Client, WorkflowHandle
from temporalio.converter import DataConverter
from temporalio.exceptions import ApplicationError
from temporalio.worker import Replayer

from durable_rlm.activities.llm import ModelActivities
from durable_rlm.activities.model_errors import MESSAGE_CHARS, compact_failures
from durable_rlm.client.episodes import follow, pending_step, retry_credentials
from durable_rlm.ports import free_port
from durable_rlm.scripted import Reply, root_and_sub
from durable_rlm.settings import Settings
from durable_rlm.store.blobs import BlobStore, DirectoryBackend
from durable_rlm.store.codec import CUT_MARK, data_converter
from durable_rlm.worker.runtime import Services, running_workers, workflow_runner
from durable_rlm.workflows import names
from durable_rlm.workflows.episode import EpisodeWorkflow
from durable_rlm.workflows.models import (
    EpisodeLimits,
    EpisodeProgress,
    EpisodeRequest,
    EpisodeResult,
    Message,
    ModelSettings,
    ToolCallInput,
)
from tests.conftest import request_for

USER = [Message(role="user", content="hi")]
HTML = "<html><head><title>502 Bad Gateway</title></head><body>" + "x" * 500 + "</body></html>"
RIGHT, WRONG = "sk-right", "sk-wrong"
# What the server keeps of an activity's failure before it replaces it; our bound is half.
SERVER_LIMIT = 4 * 1024


@pytest.fixture
def models(tmp_path: Path) -> ModelActivities:
    return ModelActivities(BlobStore(DirectoryBackend(tmp_path / "blobs")))


def openai_model(server, **kw: object) -> ModelSettings:
    return ModelSettings(model="m", base_url=server.base_url, **kw)


def claude(server) -> ModelSettings:
    return ModelSettings(model="anthropic:claude-scripted", base_url=server.base_url.removesuffix("/v1"))


def failure_size(error: BaseException) -> int:
    """Bytes of the Failure proto the SDK sends for `error` (message, stack traces, causes)."""
    failure = Failure()
    DataConverter.default.failure_converter.to_failure(
        error, DataConverter.default.payload_converter, failure
    )
    return failure.ByteSize()


async def raised(call) -> ApplicationError:
    """What an activity body raises, as the worker would serialise it."""
    with pytest.raises(ApplicationError) as info:
        with compact_failures():
            await call
    return info.value


# --- replies that are not a completion ----------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "what"),
    [
        (Reply(raw=HTML, content_type="text/html"), "a body that is not JSON"),
        (Reply(raw=HTML), "a body that is not JSON"),  # declared JSON: a bare JSONDecodeError before
        (Reply(raw=""), "a body that is not JSON (an empty body)"),
        (Reply(raw='{"id": "x", "object": "chat.completion", "choices": []}'), "without choices"),
        (Reply(raw='{"error": null, "id": "x"}'), "without choices"),
    ],
)
async def test_openai_replies_that_are_not_completions_are_retried_and_quoted(
    models: ModelActivities, scripted, reply: Reply, what: str
) -> None:
    server = scripted(lambda r: reply)
    error = await raised(models.complete(openai_model(server), USER))
    assert (error.type, error.non_retryable) == (names.MODEL_BAD_REPLY, False)
    assert error.message.startswith(f"model 'm' at {server.base_url}/ returned ")
    assert what in error.message
    assert reply.raw[:200] in error.message
    assert len(reply.raw) <= 200 or reply.raw[:201] not in error.message
    assert error.__cause__ is None and failure_size(error) < SERVER_LIMIT // 2


@pytest.mark.parametrize(
    ("reply", "what"),
    [
        (Reply(raw=HTML, content_type="text/html"), "a body that is not JSON"),
        (Reply(raw="{not json"), "a body that is not JSON"),
        (Reply(raw='{"type": "message", "role": "assistant"}'), "a message without content"),
    ],
)
async def test_anthropic_replies_that_are_not_messages_are_retried_and_quoted(
    models: ModelActivities, scripted, reply: Reply, what: str
) -> None:
    server = scripted(lambda r: reply)
    error = await raised(models.complete(claude(server), USER))
    assert (error.type, error.non_retryable) == (names.MODEL_BAD_REPLY, False)
    assert what in error.message and reply.raw[:200] in error.message


async def test_an_empty_anthropic_content_list_is_an_empty_reply(models: ModelActivities, scripted) -> None:
    body = {"type": "message", "role": "assistant", "content": [], "usage": {"input_tokens": 1}}
    server = scripted(lambda r: Reply(raw=json.dumps(body)))
    assert (await models.complete(claude(server), USER)).text == ""


# --- failures that fit --------------------------------------------------------------------


async def test_connection_refused_names_the_cause_in_a_failure_that_fits(models: ModelActivities) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    error = await raised(models.complete(ModelSettings(model="m", base_url=url), USER))
    assert error.message == f"cannot reach model 'm' at {url}/: connection refused"
    assert not error.non_retryable and error.__cause__ is None
    assert failure_size(error) < SERVER_LIMIT // 2  # the four-exception chain was ~6.8 KB


async def test_an_unresolvable_host_says_so(models: ModelActivities) -> None:
    error = await raised(
        models.complete(ModelSettings(model="m", base_url="http://no-such-host.invalid/v1"), USER)
    )
    assert (
        "cannot reach model 'm' at http://no-such-host.invalid/v1/: the host name does not resolve"
        in error.message
    )


async def test_compact_failures_bounds_the_message_and_drops_the_chain() -> None:
    async def deep() -> None:
        try:
            try:
                raise ConnectionRefusedError("refused " + "r" * 5_000)
            except OSError as exc:
                raise RuntimeError("middle " + "m" * 5_000) from exc
        except RuntimeError as exc:
            raise ApplicationError("the cause first " + "x" * 5_000, "detail", type="Kind") from exc

    with pytest.raises(ApplicationError) as info:
        await deep()
    assert failure_size(info.value) > 3 * SERVER_LIMIT  # as the SDK would have sent it
    error = await raised(deep())
    assert error.message.startswith("the cause first") and len(error.message) < MESSAGE_CHARS + 60
    assert (error.type, error.details, error.__cause__) == ("Kind", ("detail",), None)
    assert failure_size(error) < SERVER_LIMIT // 2

    async def plain() -> None:
        raise KeyError("k" * 5_000)

    error = await raised(plain())
    assert error.type == "KeyError" and not error.non_retryable and failure_size(error) < SERVER_LIMIT // 2


# --- refused keys -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "hint"), [(401, "check OPENAI_API_KEY or --api-key"), (403, "may not use")]
)
async def test_a_refused_key_names_the_setting_and_is_not_retried(
    models: ModelActivities, scripted, status: int, hint: str
) -> None:
    server = scripted(lambda r: Reply(status=status, error="Incorrect API key provided"))
    error = await raised(models.complete(openai_model(server), USER))
    assert (error.type, error.non_retryable) == (names.MODEL_AUTH_FAILED, True)
    assert error.message.startswith(
        f"authentication failed for model 'm' at {server.base_url}/: HTTP {status}"
    )
    assert hint in error.message and "Incorrect API key provided" in error.message


async def test_a_refused_anthropic_key_names_its_variable(tmp_path: Path, scripted) -> None:
    server = scripted(lambda r: "x", api_key=RIGHT)
    models = ModelActivities(BlobStore(DirectoryBackend(tmp_path)), {"ANTHROPIC_API_KEY": WRONG})
    error = await raised(models.complete(claude(server), USER))
    assert error.type == names.MODEL_AUTH_FAILED and "ANTHROPIC_API_KEY" in error.message


async def test_a_bad_request_stays_a_rejection(models: ModelActivities, scripted) -> None:
    server = scripted(lambda r: Reply(status=400, error="unknown parameter"))
    error = await raised(models.complete(openai_model(server), USER))
    assert (error.type, error.non_retryable) == (names.MODEL_REQUEST_REJECTED, True)


# --- episodes -----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def worker_with_key(
    client: Client, store: tuple[BlobStore, sa.Engine], session_dir: Path, queue: str, key: str
) -> AsyncIterator[object]:
    """An in-process worker whose model calls use `key` (as `drlm run --api-key` gives it)."""
    blobs, engine = store
    services = Services(Settings(task_queue=queue, data_dir=session_dir), blobs, engine, client)
    async with running_workers(services, {"OPENAI_API_KEY": key}) as repl:
        yield repl


async def start(client: Client, request: EpisodeRequest, queue: str, prefix: str) -> WorkflowHandle:
    return await client.start_workflow(
        names.WORKFLOW,
        request,
        id=f"{prefix}-{uuid.uuid4().hex[:8]}",
        task_queue=queue,
        result_type=EpisodeResult,
        execution_timeout=timedelta(minutes=3),
    )


async def test_an_unreachable_model_ends_the_episode_with_its_cause(client, worker) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    request = request_for(type("Gone", (), {"base_url": url}))  # three attempts, as --max-attempts 3
    handle = await start(client, request, worker.task_queue, "unreachable")

    # While it retries, what `drlm run` shows of the last failure is the cause, not
    # "Failure exceeds size limit." (the server's stand-in for a failure over 4 KB).
    seen = None
    for _ in range(100):
        seen = await pending_step(handle)
        if seen and "attempt 2" in seen:
            break
        await asyncio.sleep(0.1)
    assert seen is not None and "last failure: cannot reach model" in seen and "connection refused" in seen

    end = await follow(handle)
    assert end.result is not None and end.result.ended_by == "model_error"
    assert end.status == "failed" and end.result.failure_cause == "model"
    assert end.result.error == f"cannot reach model 'scripted' at {url}/: connection refused"
    history = await handle.fetch_history()
    failed = [
        e.activity_task_failed_event_attributes.failure
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED
    ]
    assert failed and all(f.ByteSize() < SERVER_LIMIT // 2 and not f.HasField("cause") for f in failed)


async def progress_of(handle: WorkflowHandle) -> EpisodeProgress:
    return await handle.query("progress", result_type=EpisodeProgress)


async def assert_replays_with_the_pause(client: Client, handle: WorkflowHandle) -> None:
    """The paused-and-resumed history replays, with the one update that resumed it."""
    history = await handle.fetch_history()
    replayer = Replayer(
        workflows=[EpisodeWorkflow], data_converter=client.data_converter, workflow_runner=workflow_runner()
    )
    assert (await replayer.replay_workflow(history)).replay_failure is None
    updates = [
        e for e in history.events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED
    ]
    assert len(updates) == 1  # the retry_credentials update


async def test_a_refused_root_key_pauses_until_a_worker_with_the_right_key_retries(
    client, store, session_dir, scripted
) -> None:
    server = scripted(root_and_sub(["```repl\nx = 6 * 7\n```", "FINAL(the answer is 42)"]), api_key=RIGHT)
    queue = f"keys-{uuid.uuid4().hex[:8]}"
    async with worker_with_key(client, store, session_dir, queue, WRONG):
        handle = await start(client, request_for(server), queue, "root-key")
        end = await asyncio.wait_for(follow(handle), 30)  # returns: a pause is not an end
        assert end.status == "paused" and end.result is None
        assert end.error is not None and end.error.startswith(
            f"authentication failed for model 'scripted' at {server.base_url}/: HTTP 401: Incorrect API key"
        )
        assert "OPENAI_API_KEY" in end.error and f"drlm resume {handle.id}" in end.error
        progress = await progress_of(handle)
        assert progress.paused == end.error and progress.phase.startswith("paused: authentication failed")
        assert (progress.iteration, progress.model_calls, progress.finished) == (1, 0, False)
        assert server.completed == 0
    # `drlm run` has exited; `drlm resume` runs a worker with the fixed key and retries.
    async with worker_with_key(client, store, session_dir, queue, RIGHT):
        outcome = await retry_credentials(client, handle.id)
        assert (outcome.accepted, outcome.waiting_calls) == (True, 1), outcome.message
        assert not (await retry_credentials(client, handle.id)).accepted  # nothing waits now
        end = await asyncio.wait_for(follow(handle), 60)
    assert end.status == "answered" and end.result is not None
    assert end.result.answer == "the answer is 42"
    assert (end.result.iterations, end.result.model_calls) == (2, 2)
    assert [r.turn for r in server.root_requests()] == [0, 1]  # the refused call, made again once
    await assert_replays_with_the_pause(client, handle)
    again = await retry_credentials(client, handle.id)
    assert not again.accepted and "already ended" in again.message


async def test_a_refused_sub_call_key_pauses_the_cell_without_spending_an_iteration(
    client, store, session_dir, scripted
) -> None:
    turns = ["```repl\nshout = llm_query('hello')\nprint(shout)\n```", "FINAL_VAR(shout)"]
    root = scripted(root_and_sub(turns))  # takes any key
    sub = scripted(root_and_sub(["unused"], str.upper), api_key=RIGHT)
    request = request_for(root)
    request = request.model_copy(
        update={"sub_model": ModelSettings(model="scripted-sub", base_url=sub.base_url, max_attempts=3)}
    )
    queue = f"keys-{uuid.uuid4().hex[:8]}"
    async with worker_with_key(client, store, session_dir, queue, WRONG):
        handle = await start(client, request, queue, "sub-key")
        end = await asyncio.wait_for(follow(handle), 30)
        assert end.status == "paused" and end.error is not None
        assert end.error.startswith(
            f"authentication failed for model 'scripted-sub' at {sub.base_url}/: HTTP 401"
        )
        progress = await progress_of(handle)
        assert (progress.iteration, progress.sub_calls, progress.model_calls) == (1, 1, 2)
        # Still paused a moment later: nothing is retried, no iteration is spent.
        await asyncio.sleep(1.5)
        assert (await progress_of(handle)).paused == end.error and len(root.root_requests()) == 1
    async with worker_with_key(client, store, session_dir, queue, RIGHT):
        outcome = await retry_credentials(client, handle.id)
        assert outcome.waiting_calls == 1
        end = await asyncio.wait_for(follow(handle), 60)
    result = end.result
    assert result is not None and result.answer == "HELLO"
    assert (result.iterations, result.sub_calls, result.model_calls) == (2, 1, 3)
    assert [r.last_user for r in sub.sub_requests()] == ["hello"]
    assert "Error" not in root.root_requests()[1].last_user  # the cell saw the answer, not a failure
    await assert_replays_with_the_pause(client, handle)


async def test_a_paused_episode_still_ends_at_its_deadline(client, store, session_dir, scripted) -> None:
    server = scripted(root_and_sub(["FINAL(never)"]), api_key=RIGHT)
    limits = EpisodeLimits(max_iterations=8, max_duration=timedelta(seconds=6), cell_timeout_s=5)
    queue = f"keys-{uuid.uuid4().hex[:8]}"
    async with worker_with_key(client, store, session_dir, queue, WRONG):
        handle = await start(client, request_for(server, limits=limits), queue, "deadline")
        assert (await asyncio.wait_for(follow(handle), 30)).status == "paused"
        result = await asyncio.wait_for(handle.result(), 30)
    assert result.ended_by == "max_duration" and result.answer is None
    assert "authentication failed" in (result.stop_reason or "") + (result.error or "")


# --- tools --------------------------------------------------------------------------------


async def test_a_failing_tool_leaves_a_short_failure_without_its_chain() -> None:
    from durable_rlm import tools
    from durable_rlm.activities.tools import run_tool

    def flaky_upstream(query: str) -> str:
        try:
            raise ConnectionRefusedError("upstream refused " + "u" * 10_000)
        except OSError as exc:
            raise RuntimeError("search failed: " + "s" * 10_000) from exc

    name = f"flaky_upstream_{uuid.uuid4().hex[:6]}"
    tools.tool(flaky_upstream, name=name)
    try:
        call = ToolCallInput(
            episode_id="e",
            iteration=1,
            cell_index=1,
            call_index=0,
            tool=name,
            arguments=json.dumps({"args": ["q"], "kwargs": {}}),
        )
        with pytest.raises(ApplicationError) as info:
            await run_tool(call)
    finally:
        tools._REGISTRY.pop(name, None)
    error = info.value
    assert error.type == names.TOOL_FAILED and error.message.startswith("RuntimeError: search failed: sss")
    assert error.__cause__ is None and failure_size(error) < SERVER_LIMIT // 2


# --- a paused worker checks before it pays (issue 37) ----------------------------------------


@pytest.mark.parametrize(
    ("paused_s", "handed_s", "heartbeat_s", "start_to_close_s", "why", "beat_first"),
    [
        (5.0, 5.0, 2.0, 60.0, "sent no heartbeat", None),  # stopped after the attempt began
        (5.0, 5.0, None, 3.0, "start-to-close", None),
        (0.0, 5.0, 2.0, 60.0, "sent no heartbeat", None),  # handed to its poll while it stood still
        (0.0, 0.0, 2.0, 60.0, None, True),  # the regular beat (1 s) would come too near 2 s
        # Handed while it stood still, woken with less than SERVER_MARGIN_S of its heartbeat
        # timeout left: the first beat might reach the server too late (the soak of 11-27).
        (0.0, 4.5, 5.0, 60.0, "sent no heartbeat", None),
        (0.0, 3.5, 5.0, 60.0, None, True),  # sent, after a beat that resets the server's clock
        (0.0, 0.0, 5.0, 60.0, None, False),  # fresh: its first beat waits its turn (no write)
    ],
)
async def test_a_stale_attempt_sends_no_model_request(
    models: ModelActivities, scripted, paused_s, handed_s, heartbeat_s, start_to_close_s, why, beat_first
) -> None:
    """A worker stopped (SIGSTOP, a starved loop) between an attempt's start and its model
    request, or handed the attempt while it stood still: past its heartbeat or
    start-to-close timeout the server has scheduled another attempt, so this one must not
    pay. The SDK's ActivityEnvironment runs the real activity code; the real openai client
    would reach the scripted server."""
    import dataclasses
    import time
    from datetime import UTC, datetime, timedelta

    from temporalio.testing import ActivityEnvironment

    from durable_rlm.activities.attempts import start_attempt_clock

    beats: list[float] = []
    beats_before: list[int] = []  # heartbeats sent before the request came, by request

    def reply(request: object) -> str:
        beats_before.append(len(beats))
        return "fine"

    server = scripted(reply)

    async def attempt() -> str:
        clock = start_attempt_clock()
        clock.started = clock.last_beat = time.monotonic() - paused_s  # the pause, by the clock
        return (await models.complete(openai_model(server), USER)).text

    env = ActivityEnvironment()
    env.info = dataclasses.replace(
        env.info,
        heartbeat_timeout=timedelta(seconds=heartbeat_s) if heartbeat_s else None,
        start_to_close_timeout=timedelta(seconds=start_to_close_s),
        started_time=datetime.now(UTC) - timedelta(seconds=handed_s),  # the server's start
    )
    env.on_heartbeat = lambda *details: beats.append(time.monotonic())
    if why is None:
        assert await env.run(attempt) == "fine" and len(server.requests) == 1
        # Handed late, the attempt reset the server's heartbeat clock before it paid.
        assert (beats_before[0] > 0) == beat_first
        return
    error = await raised(env.run(attempt))
    assert error.type == names.STALE_ATTEMPT and why in error.message
    assert server.requests == []  # nothing paid


def test_a_deep_failure_keeps_its_innermost_frames_under_the_server_s_warning_size() -> None:
    """However deep the stack (the SDK, the worker's interceptors, the activity), a failure
    stays under 2 KB and keeps where it was raised; each cause in the chain too."""

    # Eighty distinct frames (a recursion's repeated frames are folded by the formatter).
    chain: dict[str, object] = {"ApplicationError": ApplicationError}
    exec("def f0():\n    raise ApplicationError('the innermost failure', type='Deep')\n", chain)
    for k in range(1, 80):
        exec(f"def f{k}():\n    f{k - 1}()\n", chain)

    try:
        try:
            chain["f79"]()  # type: ignore[operator]
        except ApplicationError as inner:
            raise RuntimeError("wrapping it") from inner
    except RuntimeError as outer:
        failure = Failure()
        converter = data_converter(None)
        converter.failure_converter.to_failure(outer, converter.payload_converter, failure)
    assert failure.ByteSize() < SERVER_LIMIT // 2
    kept = failure.cause.stack_trace
    assert kept.startswith(CUT_MARK) and kept.endswith("in f0\n")  # where it was raised
    assert failure.cause.message == "the innermost failure"
