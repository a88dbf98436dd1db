"""The Python API: DurableRLM, its Episode handle and its typed errors; the README's
example runs as written."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from durable_rlm import ConfigurationError, DurableRLM, EpisodeFailed, EpisodeResult, InvalidRequestError
from durable_rlm.scripted import Reply, root_and_sub
from durable_rlm.settings import Settings
from tests.conftest import ROOT

COUNT_LATE = [
    "```repl\nn = sum(1 for line in context.splitlines() if 'late' in line)\nprint(n)\n```",
    "FINAL_VAR(n)",
]


def readme_block(heading: str) -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index(heading) :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, f"no python block after {heading!r}"
    return match.group(1)


def test_the_readme_example_runs(tmp_path: Path, scripted) -> None:
    server = scripted(root_and_sub(COUNT_LATE))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "TEMPORAL_", "DRLM_"))}
    env.update(OPENAI_BASE_URL=server.base_url, OPENAI_API_KEY="sk-scripted", DRLM_DATA_DIR=str(tmp_path))
    script = readme_block("## Python API") + "\nimport sys, os\nsys.stdout.flush()\nos._exit(0)\n"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:2] == ["15", "final_var"], out.stdout
    assert server.root_requests()[0].model == "gpt-4o-mini"


def api_settings(temporal_address: str, session_dir: Path, queue: str) -> Settings:
    return Settings(temporal_address=temporal_address, task_queue=queue, data_dir=session_dir)


async def test_the_episode_handle(temporal_address, session_dir, client, scripted, worker) -> None:
    server = scripted(root_and_sub([*COUNT_LATE[:1], Reply(text=COUNT_LATE[1], delay_s=1.5)]))
    settings = api_settings(temporal_address, session_dir, worker.task_queue)
    rlm = DurableRLM("scripted", base_url=server.base_url, limits={"max_iterations": 5}, settings=settings)
    async with rlm:
        episode = await rlm.start("a late\nb on time\nc late", "How many are late?")
        while (await episode.progress()).iteration < 2:
            pass
        receipt = await episode.reward(0.5, "looks right")
        assert receipt.accepted == 1
        result = await episode.result()
    assert isinstance(result, EpisodeResult)
    assert (result.answer, result.ended_by, result.episode_id) == ("2", "final_var", episode.id)


async def test_cancel_and_a_failed_episode(temporal_address, session_dir, client, scripted, worker) -> None:
    server = scripted(root_and_sub([Reply(text="```repl\nx = 1\n```", delay_s=30)]))
    settings = api_settings(temporal_address, session_dir, worker.task_queue)
    async with DurableRLM("scripted", base_url=server.base_url, settings=settings) as rlm:
        cancelled = await rlm.start("ctx", "q", episode_id=f"api-cancel-{uuid.uuid4().hex[:6]}")
        outcome = await cancelled.cancel()
        assert outcome.accepted
        assert (await cancelled.result()).ended_by == "cancelled"

        terminated = await rlm.start("ctx", "q")
        await client.get_workflow_handle(terminated.id).terminate(reason="operator")
        with pytest.raises(EpisodeFailed, match="terminated: terminated: operator") as info:
            await terminated.result()
        assert info.value.end.status == "terminated"


def test_errors_the_caller_can_fix_are_typed(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    with pytest.raises(InvalidRequestError, match="max_depth: Input should be less than or equal to 8"):
        DurableRLM("m", max_depth=99, settings=settings)
    with pytest.raises(
        InvalidRequestError, match="max_iterations: Input should be greater than or equal to 1"
    ):
        DurableRLM("m", limits={"max_iterations": 0}, settings=settings)
    with pytest.raises(ConfigurationError, match="unknown termination policy 'nope'"):
        DurableRLM("m", policy="nope", settings=settings)
    with pytest.raises(ConfigurationError, match="unknown sampling setting\\(s\\) temp"):
        DurableRLM("m", sampling={"temp": 1}, settings=settings)
    with pytest.raises(ConfigurationError, match="unknown tool\\(s\\) nope"):
        DurableRLM("m", tools=["nope"], settings=settings)
    with pytest.raises(ConfigurationError, match="invalid output schema"):
        DurableRLM("m", output_schema={"type": "string"}, settings=settings)
    with pytest.raises(ConfigurationError, match="start\\(\\) needs an open session"):
        import asyncio

        asyncio.run(DurableRLM("m", base_url="http://127.0.0.1:9/v1", settings=settings).start("c"))


def test_models_on_two_providers_and_functions_as_tools(tmp_path: Path) -> None:
    def shout(text: str) -> str:
        """Upper-case a text."""
        return text.upper()

    rlm = DurableRLM(
        "anthropic:claude-x",
        sub_model="openai:gpt-4o-mini",
        sub_base_url="http://127.0.0.1:9/v1",
        sampling={"temperature": 0.1},
        tools=[shout],
        settings=Settings(data_dir=tmp_path),
    )
    request = rlm.request(None, "q")
    assert (request.root_model.provider, request.root_model.api_key_env) == ("anthropic", "ANTHROPIC_API_KEY")
    sub = request.sub_model
    assert sub is not None and (sub.provider, sub.model, sub.api_key_env) == (
        "openai",
        "gpt-4o-mini",
        "OPENAI_API_KEY",
    )
    assert sub.base_url == "http://127.0.0.1:9/v1" and sub.temperature == 0.1
    assert [t.name for t in request.tools] == ["shout"] and request.tools[0].doc == "Upper-case a text."


def test_a_missing_key_is_reported_before_the_episode_starts(tmp_path: Path, monkeypatch) -> None:
    import asyncio

    for name in ("ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL", "OPENAI_API_KEY", "OPENAI_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    rlm = DurableRLM("anthropic:claude-x", settings=Settings(data_dir=tmp_path))
    with pytest.raises(
        ConfigurationError, match="no API key for anthropic model 'claude-x': set ANTHROPIC_API_KEY"
    ):
        asyncio.run(rlm.start("c"))
    keyed = DurableRLM("anthropic:claude-x", api_key="k", settings=Settings(data_dir=tmp_path))
    with pytest.raises(ConfigurationError, match="needs an open session"):  # past the key check
        asyncio.run(keyed.start("c"))


def test_an_explicit_provider(tmp_path: Path) -> None:
    rlm = DurableRLM(
        "claude-x", provider="anthropic", sub_model="gpt-4o-mini", settings=Settings(data_dir=tmp_path)
    )
    request = rlm.request(None)
    assert (request.root_model.provider, request.root_model.api_key_env) == ("anthropic", "ANTHROPIC_API_KEY")
    assert request.sub_model is not None and request.sub_model.provider == "anthropic"  # same endpoint
    with pytest.raises(InvalidRequestError, match="provider"):
        DurableRLM("m", provider="nope", settings=Settings(data_dir=tmp_path))


async def test_two_completions_at_once_share_the_embedded_server(tmp_path: Path, scripted) -> None:
    import asyncio

    server = scripted(root_and_sub(COUNT_LATE))
    rlm = DurableRLM("scripted", base_url=server.base_url, settings=Settings(data_dir=tmp_path))
    first, second = await asyncio.wait_for(
        asyncio.gather(rlm.acompletion("a late\nb late", "q"), rlm.acompletion("late\nx\nlate\nlate", "q")),
        90,
    )
    assert (first.answer, second.answer) == ("2", "3")
    # One server for both (one state file), and no lease left once both are done.
    assert json.loads((tmp_path / "server" / "state.json").read_text())["db_file"] == str(
        tmp_path.resolve() / "temporal.sqlite"
    )
    assert list((tmp_path / "server" / "leases").iterdir()) == []


def test_tools_given_as_functions(tmp_path: Path) -> None:
    import tests.tool_plugins  # noqa: F401 - registers lookup_price: the clash below needs it
    from durable_rlm.tools import tool as register

    @register(name="priced", timeout_s=5)
    def price_of(item: str) -> float:
        """A price."""
        return 1.0

    def lookup_price(item: str) -> float:  # same name as a registered tool, another function
        return 2.0

    settings = Settings(data_dir=tmp_path)
    request = DurableRLM("m", tools=[price_of], settings=settings).request(None)
    assert [(t.name, t.timeout_s) for t in request.tools] == [("priced", 5)]  # as registered
    with pytest.raises(ConfigurationError, match="a different tool is already registered as 'lookup_price'"):
        DurableRLM("m", tools=[lookup_price], settings=settings)
    with pytest.raises(ConfigurationError, match="not a free Python identifier"):
        DurableRLM("m", tools=[lambda: 1], settings=settings)


def test_a_sub_model_on_another_provider_keeps_only_its_own_endpoint(tmp_path: Path) -> None:
    rlm = DurableRLM(
        "claude-x",
        provider="anthropic",
        base_url="https://anthropic.example",
        sampling={"extra_body": {"anthropic_only": True}},
        sub_model="openai:gpt-4o-mini",
        other_models=["openai:gpt-4o", "claude-y"],
        settings=Settings(data_dir=tmp_path),
    )
    request = rlm.request(None)
    sub = request.sub_model
    assert sub is not None and (sub.provider, sub.base_url, sub.extra_body) == ("openai", None, {})
    gpt, claude_y = request.other_models
    assert (gpt.provider, gpt.base_url, gpt.extra_body) == ("openai", None, {})
    assert (claude_y.provider, claude_y.base_url) == ("anthropic", "https://anthropic.example")
    explicit = DurableRLM(
        "anthropic:claude-x",
        sub_model="openai:gpt-4o-mini",
        sub_base_url="http://127.0.0.1:9/v1",
        settings=Settings(data_dir=tmp_path),
    ).request(None)
    assert explicit.sub_model is not None and explicit.sub_model.base_url == "http://127.0.0.1:9/v1"


DOWN_SCRIPT = """
import logging, os, sys
from durable_rlm import DurableRLM, EpisodeFailed
if sys.argv[2] == "debug":
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
rlm = DurableRLM("gpt-x", base_url=sys.argv[1], api_key="sk-x", max_attempts=2)
try:
    rlm.completion("ctx", "q")
    print("returned")
except EpisodeFailed as exc:
    print("raised", exc.end.status, exc.end.result.failure_cause, exc.end.result.ended_by)
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


@pytest.mark.parametrize("logging_level", ["default", pytest.param("debug", marks=pytest.mark.slow)])
def test_a_model_that_is_down_raises_episode_failed_quietly(tmp_path: Path, logging_level: str) -> None:
    """A failed episode raises EpisodeFailed (status failed, the cause named), and the SDK's
    per-attempt tracebacks are DEBUG records: none on stderr unless asked for."""
    from durable_rlm.ports import free_port

    nowhere = f"http://127.0.0.1:{free_port()}/v1"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "TEMPORAL_"))}
    env.update(DRLM_DATA_DIR=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-c", DOWN_SCRIPT, nowhere, logging_level],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert out.stdout.split() == ["raised", "failed", "model", "model_error"], (out.stdout, out.stderr)
    if logging_level == "default":
        assert len(out.stderr.splitlines()) <= 3, out.stderr
    else:
        assert "Completing activity as failed" in out.stderr  # turned up, it is all there


def test_a_persistent_session_s_names_are_exported() -> None:
    """`from durable_rlm import Session, SessionClosed`: what `DurableRLM.session()` returns and
    what a closed session raises, without knowing the module they live in."""
    import durable_rlm
    from durable_rlm.client import sessions

    assert durable_rlm.Session is sessions.Session
    assert durable_rlm.SessionClosed is sessions.SessionClosed
    assert {"Session", "SessionClosed"} <= set(durable_rlm.__all__)
