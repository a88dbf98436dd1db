"""The native Anthropic path: the real `anthropic` client against a scripted Messages API
server on 127.0.0.1, its errors mapped like the OpenAI path's, and an episode whose root
model is on Anthropic while its sub-model is OpenAI-compatible."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError

from durable_rlm.activities.llm import ModelActivities
from durable_rlm.scripted import Reply, root_and_sub
from durable_rlm.store.blobs import BlobStore, DirectoryBackend
from durable_rlm.workflows import names
from durable_rlm.workflows.models import Message, ModelSettings
from tests.conftest import request_for, run_episode

KEY = "sk-ant-scripted"


@pytest.fixture
def models(tmp_path: Path) -> ModelActivities:
    return ModelActivities(BlobStore(DirectoryBackend(tmp_path / "blobs")), {"ANTHROPIC_API_KEY": KEY})


def claude(server, **kw: object) -> ModelSettings:
    return ModelSettings(
        model="anthropic:claude-scripted", base_url=server.base_url.removesuffix("/v1"), **kw
    )


CHAT = [
    Message(role="system", content="be brief"),
    Message(role="user", content="hi"),
    Message(role="user", content="and again"),
]


def test_the_provider_prefix_and_its_key_variable() -> None:
    settings = ModelSettings(model="anthropic:claude-x")
    assert (settings.provider, settings.model, settings.api_key_env) == (
        "anthropic",
        "claude-x",
        "ANTHROPIC_API_KEY",
    )
    assert ModelSettings(model="llama3:8b").provider == "openai"  # a tag, not a provider
    with pytest.raises(ValueError, match="provider"):
        ModelSettings(model="m", provider="nope")
    with pytest.raises(ValueError, match="names provider 'anthropic', not 'openai'"):
        ModelSettings(model="anthropic:c", provider="openai")


async def test_system_prompt_turns_sampling_and_usage(models: ModelActivities, scripted) -> None:
    server = scripted(lambda r: "hello from claude", api_key=KEY)
    done = await models.complete(claude(server, temperature=0.3, stop=["###"], extra_body={"top_k": 5}), CHAT)

    assert done.text == "hello from claude"
    assert done.usage.completion_tokens == len("hello from claude") // 4 and done.usage.prompt_tokens > 0
    # What the Messages API said of its reply: telemetry's gen_ai.response.* attributes.
    assert (done.facts.response_model, done.facts.finish_reasons) == ("claude-scripted", ["end_turn"])
    assert done.facts.response_id == "msg_scripted_1"
    (request,) = server.requests
    assert request.api == "anthropic" and "anthropic-version" in request.headers
    assert KEY in (
        request.headers.get("x-api-key"),
        request.headers.get("Authorization", "").removeprefix("Bearer "),
    )
    body = request.body
    assert body["system"] == "be brief"
    assert body["messages"] == [{"role": "user", "content": "hi\n\nand again"}]  # turns alternate
    assert (body["max_tokens"], body["temperature"], body["stop_sequences"], body["top_k"]) == (
        4096,
        0.3,
        ["###"],
        5,
    )


async def test_anthropic_errors_map_like_openai_ones(models: ModelActivities, scripted) -> None:
    limited = scripted(
        lambda r: Reply(status=429, error="slow down", headers={"retry-after": "3"}), api_key=KEY
    )
    with pytest.raises(ApplicationError) as info:
        await models.complete(claude(limited), CHAT)
    assert (info.value.type, info.value.non_retryable) == (names.MODEL_UNAVAILABLE, False)
    assert info.value.next_retry_delay == timedelta(seconds=3)

    overloaded = scripted(lambda r: Reply(status=529, error="Overloaded"), api_key=KEY)
    with pytest.raises(ApplicationError) as info:
        await models.complete(claude(overloaded), CHAT)
    assert not info.value.non_retryable and "HTTP 529: Overloaded" in str(info.value)

    too_long = scripted(
        lambda r: Reply(status=400, error="prompt is too long: 250000 tokens > 200000"), api_key=KEY
    )
    with pytest.raises(ApplicationError) as info:
        await models.complete(claude(too_long), CHAT)
    assert info.value.type == names.MODEL_CONTEXT_OVERFLOW

    with pytest.raises(ApplicationError) as info:
        await ModelActivities(models.blobs, {"ANTHROPIC_API_KEY": "wrong"}).complete(claude(limited), CHAT)
    assert info.value.non_retryable and info.value.type == names.MODEL_AUTH_FAILED
    assert "HTTP 401: invalid x-api-key (check ANTHROPIC_API_KEY" in str(info.value)


async def test_a_missing_key_names_the_variable(models: ModelActivities, monkeypatch) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_BASE_URL", raising=False)
    bare = ModelActivities(models.blobs)
    with pytest.raises(
        ApplicationError, match="no API key for anthropic model 'claude-x': set ANTHROPIC_API_KEY"
    ):
        await bare.complete(ModelSettings(model="anthropic:claude-x"), CHAT)


async def test_the_tools_episode_with_an_anthropic_root_and_an_openai_compatible_sub_model(
    client, scripted, worker, monkeypatch
) -> None:
    """The custom-tools episode (tests/test_tools.py), with a sub-call added, across providers."""
    from durable_rlm.tools import tool_specs
    from tests import tool_plugins  # noqa: F401 - registers the tools

    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    turns = [
        "```repl\np = lookup_price('widget')\nusd = convert(p, currency='USD')\n"
        "label = llm_query(f'label {usd}')\nprint(p, usd, label)\n```",
        "```repl\nFINAL(f'{usd} {label}')\n```",
    ]
    anthropic_server = scripted(root_and_sub(turns), api_key=KEY)
    openai_server = scripted(root_and_sub(["unused"], str.upper))
    request = request_for(openai_server, tools=tool_specs(["lookup_price", "convert"]))
    request = request.model_copy(
        update={"sub_model": request.root_model, "root_model": claude(anthropic_server)}
    )
    result = await run_episode(client, request, worker.task_queue)

    assert result.answer == "13.75 LABEL 13.75"
    assert result.tool_calls == 2
    assert [r.api for r in anthropic_server.requests] == ["anthropic", "anthropic"]
    assert [r.last_user for r in openai_server.requests] == ["label 13.75"]
    assert result.usage.prompt_tokens > 0


async def test_an_empty_reply_and_the_context_limit_wording(models: ModelActivities, scripted) -> None:
    server = scripted(lambda r: "fine", api_key=KEY)
    chat = [*CHAT, Message(role="assistant", content="  "), Message(role="user", content="go on")]
    await models.complete(claude(server), chat)
    assert server.requests[0].body["messages"][1] == {"role": "assistant", "content": "(empty reply)"}

    limit = "input length and `max_tokens` exceed context limit: 190000 + 20000 > 200000"
    full = scripted(lambda r: Reply(status=400, error=limit), api_key=KEY)
    with pytest.raises(ApplicationError) as info:
        await models.complete(claude(full), CHAT)
    assert info.value.type == names.MODEL_CONTEXT_OVERFLOW
