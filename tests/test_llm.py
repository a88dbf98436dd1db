"""Model calls: the real `openai` client over HTTP to a scripted server on 127.0.0.1."""

from __future__ import annotations

import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError

from durable_rlm.activities.llm import ModelActivities
from durable_rlm.activities.model_errors import retry_after
from durable_rlm.ports import free_port
from durable_rlm.scripted import Reply, root_and_sub
from durable_rlm.store.blobs import BlobStore, DirectoryBackend
from durable_rlm.workflows import names
from durable_rlm.workflows.models import Message, ModelSettings, RootCompletionInput
from tests.conftest import request_for, run_episode


@pytest.fixture
def models(tmp_path: Path) -> ModelActivities:
    return ModelActivities(BlobStore(DirectoryBackend(tmp_path / "blobs")))


def settings(server, **kw: object) -> ModelSettings:
    return ModelSettings(model="m", base_url=server.base_url, **kw)


USER = [Message(role="user", content="hi")]


async def test_a_completion_returns_text_usage_and_time(models: ModelActivities, scripted) -> None:
    server = scripted(lambda r: "hello there")
    done = await models.complete(settings(server), USER)
    assert done.text == "hello there"
    assert done.usage.completion_tokens == len("hello there") // 4
    assert done.elapsed > 0
    assert done.mean_logprob is None  # not asked for


async def test_logprobs_give_a_mean_token_logprob(models: ModelActivities, scripted) -> None:
    server = scripted(lambda r: Reply(text="sure", logprobs=[-0.1, -0.3]))
    done = await models.complete(settings(server, logprobs=True), USER)
    assert done.mean_logprob == pytest.approx(-0.2)
    assert server.requests[-1].body["logprobs"] is True


async def test_client_side_retries_are_off(models: ModelActivities, scripted) -> None:
    server = scripted(lambda r: Reply(status=500, error="boom"))
    with pytest.raises(ApplicationError):
        await models.complete(settings(server), USER)
    assert len(server.requests) == 1  # Temporal retries, each attempt visible in history


async def test_rate_limits_are_retryable_and_honour_retry_after(models: ModelActivities, scripted) -> None:
    server = scripted(lambda r: Reply(status=429, error="slow down", headers={"retry-after": "7"}))
    with pytest.raises(ApplicationError) as info:
        await models.complete(settings(server), USER)
    assert not info.value.non_retryable
    assert info.value.type == names.MODEL_UNAVAILABLE
    assert info.value.next_retry_delay == timedelta(seconds=7)


@pytest.mark.parametrize("status", [500, 502, 503])
async def test_server_errors_are_retryable(models: ModelActivities, scripted, status: int) -> None:
    server = scripted(lambda r: Reply(status=status, error="upstream trouble"))
    with pytest.raises(ApplicationError) as info:
        await models.complete(settings(server), USER)
    assert not info.value.non_retryable
    assert "upstream trouble" in str(info.value)


@pytest.mark.parametrize(
    ("status", "hint", "kind"),
    [
        (400, "rejected", names.MODEL_REQUEST_REJECTED),
        (401, "OPENAI_API_KEY", names.MODEL_AUTH_FAILED),  # the episode waits for a fixed key
        (404, "unknown model", names.MODEL_REQUEST_REJECTED),
    ],
)
async def test_client_errors_are_not_retried_and_say_why(
    models: ModelActivities, scripted, status: int, hint: str, kind: str
) -> None:
    server = scripted(lambda r: Reply(status=status, error="provider says no"))
    with pytest.raises(ApplicationError) as info:
        await models.complete(settings(server), USER)
    assert info.value.non_retryable
    assert info.value.type == kind
    assert hint in str(info.value) and "provider says no" in str(info.value)


async def test_unknown_model_is_reported_by_name(models: ModelActivities, scripted) -> None:
    server = scripted(lambda r: "x", models={"real-model"})
    with pytest.raises(ApplicationError) as info:
        await models.complete(ModelSettings(model="no-such-model", base_url=server.base_url), USER)
    assert "no-such-model" in str(info.value) and info.value.non_retryable


async def test_wrong_api_key_is_not_retried(tmp_path: Path, scripted) -> None:
    server = scripted(lambda r: "x", api_key="right")
    models = ModelActivities(BlobStore(DirectoryBackend(tmp_path)), credentials={"OPENAI_API_KEY": "wrong"})
    with pytest.raises(ApplicationError) as info:
        await models.complete(settings(server), USER)
    assert info.value.non_retryable and "HTTP 401" in str(info.value)


async def test_unreachable_endpoint_is_retryable_and_named(models: ModelActivities) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(ApplicationError) as info:
        await models.complete(ModelSettings(model="m", base_url=url), USER)
    assert not info.value.non_retryable
    assert "cannot reach" in str(info.value) and url in str(info.value)


async def test_request_timeout_is_retryable(models: ModelActivities, scripted) -> None:
    server = scripted(lambda r: Reply(text="late", delay_s=3))
    with pytest.raises(ApplicationError) as info:
        await models.complete(settings(server, request_timeout_s=0.5), USER)
    assert "timed out" in str(info.value) and not info.value.non_retryable


async def test_no_key_for_the_default_openai_endpoint_is_a_clear_error(
    models: ModelActivities, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    with pytest.raises(ApplicationError) as info:
        await models.complete(ModelSettings(model="gpt-4o"), USER)
    assert info.value.non_retryable and "OPENAI_API_KEY" in str(info.value)


async def test_root_completion_grows_the_conversation_chain(models: ModelActivities, scripted) -> None:
    server = scripted(lambda r: f"turn {r.turn}")
    first = await models.root_completion(
        RootCompletionInput(
            episode_id="e",
            iteration=1,
            model=settings(server),
            conversation=None,
            append=[Message(role="system", content="sys"), Message(role="user", content="q")],
        )
    )
    second = await models.root_completion(
        RootCompletionInput(
            episode_id="e",
            iteration=2,
            model=settings(server),
            conversation=first.conversation,
            append=[Message(role="user", content="more")],
        )
    )
    assert (first.text, second.text) == ("turn 0", "turn 1")
    sent = server.requests[-1].messages
    assert [m["content"] for m in sent] == ["sys", "q", "turn 0", "more"]


def test_retry_after_forms() -> None:
    assert retry_after({"retry-after": "2"}) == timedelta(seconds=2)
    assert retry_after({"retry-after-ms": "1500"}) == timedelta(milliseconds=1500)
    assert retry_after({}) is None
    assert retry_after({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) == timedelta(0)


async def test_sampling_settings_reach_the_provider_and_history(client, scripted, worker) -> None:
    server = scripted(root_and_sub(["```repl\nprint(llm_query('x'))\n```", "FINAL(ok)"], str.upper))
    request = request_for(server)
    root = request.root_model.model_copy(
        update={"temperature": 0.2, "top_p": 0.9, "stop": ["###"], "extra_body": {"top_k": 40}}
    )
    sub = root.model_copy(update={"temperature": 0.0, "top_p": None, "stop": None, "extra_body": {}})
    episode_id = f"sampling-{uuid.uuid4().hex[:6]}"
    request = request.model_copy(update={"root_model": root, "sub_model": sub})
    await run_episode(client, request, worker.task_queue, episode_id)

    body = server.root_requests()[0].body
    assert (body["temperature"], body["top_p"], body["stop"], body["top_k"]) == (0.2, 0.9, ["###"], 40)
    sub_body = server.sub_requests()[0].body
    assert sub_body["temperature"] == 0.0 and "top_p" not in sub_body and "top_k" not in sub_body
    # Recorded in history: the root step's input names the settings it ran with.
    history = await client.get_workflow_handle(episode_id).fetch_history()
    scheduled = next(
        e.activity_task_scheduled_event_attributes
        for e in history.events
        if e.activity_task_scheduled_event_attributes.activity_type.name == names.ROOT_COMPLETION
    )
    (recorded,) = await client.data_converter.decode(list(scheduled.input.payloads), [RootCompletionInput])
    assert recorded.model == root
