"""rlms's API (docs/guides/from-rlms.md): `from rlm import RLM` becomes `from durable_rlm
import RLM` and the program runs unchanged. The same script runs under rlms itself
(installed by the dev extra) and under durable-rlm against one scripted server, and must
give the same response and the same model calls."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from durable_rlm import (
    RLM,
    ConfigurationError,
    DurableRLM,
    DurableRLMError,
    ErrorThresholdExceededError,
    RLMLogger,
    TokenLimitExceededError,
)
from durable_rlm.scripted import ChatRequest, Reply
from durable_rlm.settings import Settings

TASK = "How many are late?"

SCRIPT = """
import json, sys
from rlm import RLM
rlm = RLM(
    backend="openai",
    backend_kwargs={"model_name": "gpt-x", "base_url": sys.argv[1], "api_key": "sk-scripted"},
    max_iterations=5,
    max_depth=int(sys.argv[2]),
)
result = rlm.completion("a late\\nb on time\\nc late", root_prompt="How many are late?")
usage = {m: s.total_calls for m, s in result.usage_summary.model_usage_summaries.items()}
print(json.dumps({"response": result.response, "calls": usage, "seconds": result.execution_time}))
"""

EPISODES = {
    "plain": (
        1,
        [
            "```repl\nn = sum(1 for line in context.splitlines() if 'late' in line)\nprint(n)\n```",
            "```repl\nanswer['content'] = n\nanswer['ready'] = True\n```",
        ],
        "2",
    ),
    "batched sub-calls": (
        1,
        [
            "```repl\nparts = llm_query_batched(['x', 'y'])\nprint(parts)\n```",
            "```repl\nanswer['content'] = ' | '.join(parts)\nanswer['ready'] = True\n```",
        ],
        "<x> | <y>",
    ),
    "depth-2 recursion": (
        2,
        [
            "```repl\nr = rlm_query('1,2,3')\nprint(r)\n```",
            "```repl\nanswer['content'] = 'sum ' + r\nanswer['ready'] = True\n```",
        ],
        "sum 6",
    ),
}
CHILD_TURN = (
    "```repl\nanswer['content'] = str(sum(int(x) for x in context.split(',')))\nanswer['ready'] = True\n```"
)


def tree_script(root_turns: list[str]):
    """Root turns for the episode that was asked TASK; a child (rlm_query) sums its context;
    a plain sub-call echoes its prompt."""

    def script(request: ChatRequest) -> Reply | str:
        if not request.is_root:
            return f"<{request.last_user}>"
        if any(TASK in str(m.get("content", "")) for m in request.messages):
            return root_turns[min(request.turn, len(root_turns) - 1)]
        return CHILD_TURN

    return script


def run_script(code: str, base_url: str, depth: int, data_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "TEMPORAL_", "DRLM_"))}
    env["DRLM_DATA_DIR"] = str(data_dir)
    out = subprocess.run(
        [sys.executable, "-c", code, base_url, str(depth)],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "name",  # the plain one in the default run; the others are long (it stays near 13 min)
    [n if i == 0 else pytest.param(n, marks=pytest.mark.slow) for i, n in enumerate(EPISODES)],
)
def test_one_changed_import_gives_rlms_response(name: str, scripted, tmp_path: Path) -> None:
    depth, turns, expected = EPISODES[name]
    server = scripted(tree_script(turns))
    theirs = run_script(SCRIPT, server.base_url, depth, tmp_path)
    rlms_calls = len(server.requests)
    ours = run_script(
        SCRIPT.replace("from rlm import", "from durable_rlm import"), server.base_url, depth, tmp_path
    )
    assert theirs["response"] == expected
    assert ours["response"] == theirs["response"]
    assert len(server.requests) - rlms_calls == rlms_calls  # the same model calls, none repeated
    # Both summaries count the run's own calls per model; a child RLM's (rlm_query) are the
    # child's, so at depth 2 the summary is smaller than the server's count.
    assert ours["calls"] == theirs["calls"]
    own_calls = rlms_calls - (1 if depth > 1 else 0)  # the child makes one call
    assert sum(ours["calls"].values()) == own_calls
    assert isinstance(ours["seconds"], float) and ours["seconds"] > 0


# --- the constructor: rlms's names; what cannot work here is a clear error ---------------------


def rlm(tmp_path: Path, **kwargs) -> RLM:
    backend_kwargs = kwargs.pop(
        "backend_kwargs", {"model_name": "gpt-x", "base_url": "http://127.0.0.1:9/v1"}
    )
    return RLM(backend_kwargs=backend_kwargs, settings=Settings(data_dir=tmp_path), **kwargs)


def test_rlms_limits_become_the_episodes(tmp_path: Path) -> None:
    made = rlm(tmp_path, max_iterations=7, max_tokens=5_000, max_timeout=30, max_concurrent_subcalls=2)
    limits = made.template.limits
    assert (limits.max_iterations, limits.max_duration.total_seconds()) == (7, 30)
    assert limits.max_parallel_subcalls == 2
    # rlms checks tokens, spend and errors after each iteration (a policy), and caps no sub-calls.
    assert limits.max_tokens is None and limits.max_llm_calls >= 10**9
    assert made.template.termination.config["policies"][0] == {
        "name": "rlms_limits",
        "config": {"max_errors": None, "max_budget": None, "max_tokens": 5_000},
    }
    assert made.template.rlms and made.template.max_depth == 1  # rlms's default: plain sub-calls
    compacting = rlm(
        tmp_path,
        backend_kwargs={"model_name": "@openai/gpt-5-nano"},
        compaction=True,
        compaction_threshold_pct=0.02,
    ).template
    # rlms's window for the model (its table), its threshold (its examples use 2%), its `history`.
    assert (compacting.limits.context_window_tokens, compacting.limits.compact_at) == (272_000, 0.02)
    assert compacting.setup_code == "history = []"
    assert rlm(tmp_path).template.limits.context_window_tokens is None  # no compaction asked


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"environment": "docker"}, "environment 'docker' is not available.*'local'"),
        ({"backend": "bedrock"}, "backend 'bedrock' is not available: durable-rlm speaks openai, vllm"),
        ({"backend": "vllm", "backend_kwargs": {"model_name": "m"}}, "'vllm': backend_kwargs needs base_url"),
        ({"backend_kwargs": {"base_url": "http://x/v1"}}, "backend_kwargs needs model_name"),
        (
            {"backend_kwargs": {"model_name": "m", "organisation": "o"}},
            "backend_kwargs organisation are not used",
        ),
        ({"environment_kwargs": {"image": "x"}}, "environment_kwargs image are not used here"),
        ({"other_backends": ["openai", "openai"]}, "other_backends takes one backend"),
        ({"custom_tools": {"llm_query": len}}, "tool name 'llm_query' is taken by the REPL"),
        (
            {"custom_tools": {"conn": __import__("threading").Lock()}},
            "tool 'conn': its data \\(lock\\) cannot be pickled",
        ),
        ({"custom_system_prompt": "Use {tools}"}, "custom_system_prompt is a str.format template"),
        ({"custom_sub_tools": {"rows": [1, 2]}}, "custom_sub_tools\\) take functions only here"),
        ({"backend": "azure_openai", "backend_kwargs": {"model_name": "m"}}, "needs azure_endpoint"),
    ],
)
def test_what_cannot_work_here_is_a_configuration_error(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        rlm(tmp_path, **kwargs)


def test_backends_reach_their_openai_compatible_endpoints(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("AZURE_OPENAI_ENDPOINT", raising=False)
    router = rlm(tmp_path, backend="openrouter", backend_kwargs={"model_name": "meta/llama"})
    assert router.template.root_model.base_url == "https://openrouter.ai/api/v1"
    assert router.template.root_model.api_key_env == "OPENROUTER_API_KEY"
    gemini = rlm(tmp_path, backend="gemini", backend_kwargs={})
    assert gemini.template.root_model.model == "gemini-2.5-flash"
    assert "generativelanguage.googleapis.com" in str(gemini.template.root_model.base_url)
    azure = rlm(
        tmp_path,
        backend="azure_openai",
        backend_kwargs={"azure_deployment": "gpt4o", "azure_endpoint": "https://r.openai.azure.com"},
    )
    assert azure.template.root_model.base_url == "https://r.openai.azure.com/openai/v1/"
    claude = rlm(tmp_path, backend="anthropic", backend_kwargs={"model_name": "claude-x", "api_key": "k"})
    assert claude.template.root_model.provider == "anthropic"
    assert claude.credentials == {"ANTHROPIC_API_KEY": "k"}
    sub = rlm(tmp_path, other_backends=["openai"], other_backend_kwargs=[{"model_name": "small"}])
    assert sub.template.sub_model is not None and sub.template.sub_model.model == "small"


def test_durable_rlm_takes_limits_as_keywords(tmp_path: Path) -> None:
    made = DurableRLM("m", max_iterations=10, max_tokens=900, settings=Settings(data_dir=tmp_path))
    assert (made.template.limits.max_iterations, made.template.limits.max_tokens) == (10, 900)
    both = DurableRLM(
        "m",
        limits={"max_iterations": 3, "max_llm_calls": 4},
        max_iterations=9,
        settings=Settings(data_dir=tmp_path),
    )
    assert (both.template.limits.max_iterations, both.template.limits.max_llm_calls) == (9, 4)
    with pytest.raises(
        ConfigurationError,
        match="unknown argument\\(s\\) max_iteration; options: model, provider.*; limits: max_iterations",
    ):
        DurableRLM("m", max_iteration=10, settings=Settings(data_dir=tmp_path))


def test_rlms_exceptions_are_durable_rlm_errors() -> None:
    error = TokenLimitExceededError(10, 5, "partial")
    assert isinstance(error, DurableRLMError)
    assert (error.tokens_used, error.token_limit, error.partial_answer) == (10, 5, "partial")


# --- episodes in this process (the test's worker) --------------------------------------------


def api_settings(temporal_address: str, session_dir: Path, queue: str) -> Settings:
    return Settings(temporal_address=temporal_address, task_queue=queue, data_dir=session_dir)


async def test_an_rlm_opened_as_a_session_closes_it(temporal_address, session_dir, scripted, worker) -> None:
    server = scripted(tree_script(["```repl\nanswer['content'] = 'ok'\nanswer['ready'] = True\n```"]))
    made = RLM(
        backend_kwargs={"model_name": "gpt-x", "base_url": server.base_url},
        settings=api_settings(temporal_address, session_dir, worker.task_queue),
    )
    async with made:
        assert made._services is not None
        assert (await made.acompletion("ctx", TASK)).response == "ok"
    assert made._services is None
    made.close()  # rlms's close(): nothing to do, and no coroutine left unawaited


async def test_max_errors_raises_rlms_error_threshold(
    temporal_address, session_dir, scripted, worker
) -> None:
    server = scripted(tree_script(["```repl\n1 / 0\n```"]))
    made = RLM(
        backend_kwargs={"model_name": "gpt-x", "base_url": server.base_url},
        max_errors=2,
        max_iterations=6,
        settings=api_settings(temporal_address, session_dir, worker.task_queue),
    )
    with pytest.raises(ErrorThresholdExceededError, match="2 consecutive errors \\(limit: 2\\)") as info:
        await asyncio.to_thread(made.completion, "ctx", TASK)
    assert info.value.threshold == 2
    assert len(server.root_requests()) == 2


async def test_max_tokens_raises_rlms_token_limit(temporal_address, session_dir, scripted, worker) -> None:
    server = scripted(tree_script(["```repl\nprint('looking')\n```"]))
    made = RLM(
        backend_kwargs={"model_name": "gpt-x", "base_url": server.base_url},
        max_tokens=2_500,
        settings=api_settings(temporal_address, session_dir, worker.task_queue),
    )
    with pytest.raises(TokenLimitExceededError) as info:
        await asyncio.to_thread(made.completion, "ctx", TASK)
    # rlms's: checked after each iteration, raised once the run passed the limit.
    assert info.value.token_limit == 2_500 and info.value.tokens_used > 2_500
    iterations = len(server.root_requests())
    assert str(info.value).startswith(f"Token limit exceeded after iteration {iterations}: ")
    assert info.value.partial_answer == "```repl\nprint('looking')\n```"  # the reply before the last


async def test_setup_code_tools_callbacks_and_logger(
    temporal_address, session_dir, scripted, worker, tmp_path: Path
) -> None:
    turns = [
        "```repl\nprint(base + table['a'], double(21), odd())\n```",
        "```repl\nanswer['content'] = str(base + double(table['a']))\nanswer['ready'] = True\n```",
    ]
    server = scripted(tree_script(turns))
    events: list[tuple] = []
    logger = RLMLogger(log_dir=str(tmp_path / "logs"))

    def double(x: int) -> int:
        return 2 * x

    def odd() -> object:
        return {3, 4}

    made = RLM(
        backend_kwargs={"model_name": "gpt-x", "base_url": server.base_url},
        environment_kwargs={"setup_code": "base = 100"},
        custom_tools={"double": double, "odd": odd, "table": {"tool": {"a": 1}, "description": "the rates"}},
        custom_system_prompt="You are a careful REPL user.{custom_tools_section}",
        logger=logger,
        on_iteration_start=lambda depth, i: events.append(("start", depth, i)),
        on_iteration_complete=lambda depth, i, took: events.append(("done", depth, i)),
        settings=api_settings(temporal_address, session_dir, worker.task_queue),
    )
    result = await asyncio.to_thread(made.completion, "ctx", TASK)

    assert result.response == "102"
    assert result.ended_by == "answer_ready" and result.episode_id
    output = server.root_requests()[1].last_user
    assert "101 42 {3, 4}" in output  # the set itself (pickled to the sandbox), as rlms's tool gives it
    system = server.root_requests()[0].messages[0]["content"]
    assert system.startswith(  # rlms's template filled with rlms's section, then its addendum
        "You are a careful REPL user.\n6. Custom tools and data available in the REPL:\n"
        "- `double`: A custom function\n- `odd`: A custom function\n- `table`: the rates\n\n"
        "As an RLM, you should act as an orchestrator, not a solver."
    )
    assert events == [("start", 0, 1), ("done", 0, 1), ("start", 0, 2), ("done", 0, 2)]
    (log_file,) = (tmp_path / "logs").glob("rlm_*.jsonl")
    lines = [json.loads(line) for line in log_file.read_text().splitlines()]
    assert [line["type"] for line in lines] == ["metadata", "iteration", "iteration"], lines
    assert result.metadata["iterations"][1]["code_blocks"][0]["result"]["final_answer"] == "102"
    assert result.usage_summary.model_usage_summaries["gpt-x"].total_calls == 2


# --- `drlm export --format rlms`: what rlms's own log holds -----------------------------------


async def test_rlms_export_holds_locals_as_json_values_and_the_other_backends(
    client, scripted, worker, blobs
) -> None:
    from durable_rlm.audit.timeline import episode_timeline
    from durable_rlm.viewer.export import export_text
    from durable_rlm.workflows.models import ModelSettings
    from tests.conftest import request_for, run_episode
    from tests.test_export import reserialised

    cell = "```repl\nn = 42\nxs = [1, 2, (3, 4)]\nd = {'a': 1.5, 'b': None}\nname = 'late'\nseen = {7}\n```"
    server = scripted(tree_script([cell, "FINAL(done)"]))
    other = ModelSettings(model="other-m", base_url=server.base_url, provider="anthropic")
    request = request_for(server, TASK, other_models=[other])
    result = await run_episode(client, request, worker.task_queue)
    assert result.answer == "done"
    timeline = await episode_timeline(client, result.episode_id)
    lines = [json.loads(line) for line in export_text(timeline, blobs, "rlms").splitlines()]

    assert lines[0]["other_backends"] == ["anthropic"]
    local = lines[1]["code_blocks"][0]["result"]["locals"]
    assert local["n"] == 42 and local["xs"] == [1, 2, [3, 4]] and local["d"] == {"a": 1.5, "b": None}
    assert local["name"] == "late"
    assert local["seen"] == "{7}"  # JSON cannot hold a set: its repr, as rlms writes it
    assert reserialised(lines) == lines  # rlms's own classes read every line back


# --- tools as rlms has them ---------------------------------------------------------------------


async def test_tool_data_and_results_are_python_values_and_exceptions_keep_their_type(
    temporal_address, session_dir, scripted, worker
) -> None:
    """What rlms's in-process tools give a cell: data of any type (a date, a set, a tuple),
    a tool's result as the object itself, and its exception as its own type."""
    from datetime import date

    def release_day(version: str) -> date:
        return {"1.0": date(2024, 5, 6)}[version]

    def strict(x: int) -> int:
        raise ValueError(f"{x} is not allowed")

    cell = (
        "```repl\nday = release_day('1.0')\n"
        "try:\n    strict(3)\nexcept ValueError as e:\n    caught = f'ValueError: {e}'\n"
        "print(DATE.isoformat(), sorted(TAGS), PAIR, type(day).__name__, day.year, caught)\n```"
    )
    server = scripted(tree_script([cell, "```repl\nanswer['content'] = caught\nanswer['ready'] = True\n```"]))
    made = RLM(
        backend_kwargs={"model_name": "gpt-x", "base_url": server.base_url},
        custom_tools={
            "DATE": date(2024, 5, 6),
            "TAGS": {"b", "a"},
            "PAIR": (1, 2),
            "release_day": release_day,
            "strict": strict,
        },
        settings=api_settings(temporal_address, session_dir, worker.task_queue),
    )
    result = await asyncio.to_thread(made.completion, "ctx", TASK)
    assert result.response == "ValueError: 3 is not allowed"
    printed = server.root_requests()[1].last_user
    assert "2024-05-06 ['a', 'b'] (1, 2) date 2024 ValueError: 3 is not allowed" in printed


async def test_a_tool_takes_arguments_of_the_types_rlms_passes(
    temporal_address, session_dir, scripted, worker
) -> None:
    """rlms calls a tool in process, so a set, a tuple or a date reaches it as it is. Here
    arguments cross from the sandbox to the worker, which decodes them without unpickling
    (activities/sandbox/values.py: a closed set of types, bounded before it is built)."""

    def how_many(items: set) -> str:
        return f"{type(items).__name__} of {len(items)}"

    server = scripted(
        tree_script(["```repl\nanswer['content'] = how_many({1, 2, 2})\nanswer['ready'] = True\n```"])
    )
    made = RLM(
        backend_kwargs={"model_name": "gpt-x", "base_url": server.base_url},
        custom_tools={"how_many": how_many},
        settings=api_settings(temporal_address, session_dir, worker.task_queue),
    )
    result = await asyncio.to_thread(made.completion, "ctx", TASK)
    assert result.response == "set of 2"


def test_a_dict_tool_with_a_description_shows_it_to_the_model(tmp_path: Path) -> None:
    def eur_to_usd(amount: float) -> float:
        return amount * 1.1

    # A name of its own: tests/tool_plugins.py registers a `convert` in the same process.
    made = rlm(tmp_path, custom_tools={"eur_to_usd": {"tool": eur_to_usd, "description": "EUR to USD"}})
    (spec,) = made.template.tools
    assert (spec.name, spec.doc, spec.signature) == ("eur_to_usd", "EUR to USD", "(amount)")


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        ([42], "tool 42 \\(at position 0, a int\\) is neither a function nor the name"),
        ("lookup", "tools must be a list of functions or tool names, or a dict"),
        ({"1bad": len}, "tool name '1bad' is not a Python identifier"),
        ({"_private": 1}, "tool name '_private' is not a Python identifier"),
        (["no_such_tool"], "unknown tool\\(s\\) no_such_tool"),
    ],
)
def test_every_tool_misuse_is_a_configuration_error_naming_the_tool(
    tmp_path: Path, tools, message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        DurableRLM("m", tools=tools, settings=Settings(data_dir=tmp_path))


async def test_sub_tools_reach_child_episodes_only(client, scripted, worker) -> None:
    from durable_rlm.tools import tool_specs
    from tests import tool_plugins
    from tests.conftest import request_for, run_episode

    assert tool_plugins.PRICES
    seen = "print('{who}', 'lookup_price' in globals(), 'not_json' in globals())"
    root_turns = [f"```repl\n{seen.format(who='ROOT')}\nr = rlm_query('c')\n```", "FINAL(done)"]
    child_turns = [f"```repl\n{seen.format(who='CHILD')}\n```", "FINAL(child)"]

    def script(request: ChatRequest) -> Reply | str:
        if not request.is_root:
            return "sub"
        turns = (
            root_turns if any(TASK in str(m.get("content", "")) for m in request.messages) else child_turns
        )
        return turns[min(request.turn, 1)]

    server = scripted(script)
    request = request_for(
        server, TASK, tools=tool_specs(["lookup_price"]), sub_tools=tool_specs(["not_json"]), max_depth=2
    )
    result = await run_episode(client, request, worker.task_queue)
    assert result.answer == "done"
    root_seen = [r.last_user for r in server.root_requests() if r.turn == 1 and TASK in str(r.messages)]
    child_seen = [r.last_user for r in server.root_requests() if r.turn == 1 and TASK not in str(r.messages)]
    assert "ROOT True False" in root_seen[0]
    assert "CHILD False True" in child_seen[0]


async def test_max_budget_raises_rlms_budget_exceeded_with_the_cost_the_provider_reports(
    temporal_address, session_dir, scripted, worker
) -> None:
    from durable_rlm import BudgetExceededError

    server = scripted(lambda request: Reply(text="```repl\nprint(1)\n```", cost=0.02))
    made = RLM(
        backend="litellm",  # an OpenAI-compatible proxy that reports each call's cost
        backend_kwargs={"model_name": "unpriced-model", "base_url": server.base_url},
        max_budget=0.05,
        settings=api_settings(temporal_address, session_dir, worker.task_queue),
    )
    with pytest.raises(BudgetExceededError) as info:
        await asyncio.to_thread(made.completion, "ctx", TASK)
    assert info.value.budget == 0.05 and info.value.spent == pytest.approx(0.06)


@pytest.mark.slow  # long end to end (the default run stays near 13 minutes); CI runs it
@pytest.mark.chaos
async def test_setup_code_survives_a_worker_killed_before_the_first_turn(
    client, scripted, worker_processes
) -> None:
    from durable_rlm.client.episodes import start_episode
    from tests.conftest import request_for
    from tests.test_crash import wait_until

    turns = [Reply(text="```repl\nprint('base is', base)\n```", delay_s=4), "FINAL(done)"]
    server = scripted(tree_script(turns))
    first = worker_processes()
    request = request_for(server, TASK, setup_code="base = 100")
    handle = await start_episode(client, request, worker_processes.queue, f"setup-{os.getpid()}-{id(server)}")
    await wait_until(lambda: len(server.root_requests()) == 1)  # the setup cell ran before this call
    first.kill()  # its sandbox, and the namespace the setup cell made, are gone
    worker_processes()
    result = await asyncio.wait_for(handle.result(), 90)
    assert result.answer == "done"
    assert "base is 100" in server.root_requests()[-1].last_user  # the rebuilt REPL ran it again


@pytest.mark.slow  # long end to end (the default run stays near 13 minutes); CI runs it
async def test_max_timeout_raises_rlms_timeout_and_subcalls_and_verbose_are_reported(
    temporal_address, session_dir, scripted, worker, capsys
) -> None:
    from durable_rlm import TimeoutExceededError

    turns = ["```repl\nr = rlm_query('1,2,3')\nprint(r)\n```", Reply(text="FINAL(late)", delay_s=30)]
    server = scripted(tree_script(turns))
    subcalls: list[tuple] = []
    made = RLM(
        backend_kwargs={"model_name": "gpt-x", "base_url": server.base_url},
        max_depth=2,
        max_timeout=8,
        verbose=True,
        on_subcall_start=lambda depth, model, preview: subcalls.append(("start", depth, model, preview)),
        on_subcall_complete=lambda depth, model, took, error: subcalls.append(("done", depth, model, error)),
        settings=api_settings(temporal_address, session_dir, worker.task_queue),
    )
    with pytest.raises(TimeoutExceededError) as info:
        await asyncio.to_thread(made.completion, "ctx", TASK)
    assert info.value.timeout == 8
    assert subcalls == [("start", 1, "gpt-x", "1,2,3"), ("done", 1, "gpt-x", None)]
    printed = capsys.readouterr().out
    assert "[durable-rlm] iteration 1:" in printed and "[durable-rlm] iteration 2:" in printed


async def test_subcalls_are_reported_as_the_child_episodes_start_and_end(
    temporal_address, session_dir, scripted, worker
) -> None:
    """rlms fires on_subcall_start when a child RLM starts and on_subcall_complete when it
    ends, while the run goes on: each child's start is seen before the root's next turn is
    asked for (which waits for the child, whose reply takes 2 s), and each child is reported
    once, in order."""
    root_turns = [
        "```repl\na = rlm_query('1,2')\nb = rlm_query('3,4')\nprint(a, b)\n```",
        "```repl\nanswer['content'] = a + ' ' + b\nanswer['ready'] = True\n```",
    ]

    def script(request: ChatRequest) -> Reply | str:
        if any(TASK in str(m.get("content", "")) for m in request.messages):
            return root_turns[min(request.turn, len(root_turns) - 1)]
        return Reply(text=CHILD_TURN, delay_s=2)

    server = scripted(script)

    def root_turns_asked() -> int:
        return sum(
            1 for r in server.root_requests() if any(TASK in str(m.get("content", "")) for m in r.messages)
        )

    events: list[tuple] = []
    made = RLM(
        backend_kwargs={"model_name": "gpt-x", "base_url": server.base_url},
        max_depth=2,
        on_subcall_start=lambda depth, model, preview: events.append(
            ("start", depth, model, preview, root_turns_asked())
        ),
        on_subcall_complete=lambda depth, model, took, error: events.append(
            ("done", depth, model, took, error)
        ),
        settings=api_settings(temporal_address, session_dir, worker.task_queue),
    )
    result = await asyncio.to_thread(made.completion, "ctx", TASK)

    assert result.response == "3 7"
    assert [e[0] for e in events] == ["start", "done", "start", "done"], events
    starts, dones = events[0::2], events[1::2]
    # Live: the root had asked for its first turn only when each child started.
    assert starts == [("start", 1, "gpt-x", "1,2", 1), ("start", 1, "gpt-x", "3,4", 1)]
    assert all(d[1:3] == (1, "gpt-x") and d[4] is None for d in dones)
    assert all(d[3] >= 2.0 for d in dones)  # each child ran at least as long as its reply waited
    assert root_turns_asked() == 2


async def test_a_follower_that_starts_late_reads_every_child_from_the_history(
    temporal_address, session_dir, scripted, worker
) -> None:
    """The children are read from the history's first event: a follower started after the
    episode ended misses none, and reports each once."""
    from durable_rlm.rlms.follow import Callbacks, ChildWatcher

    server = scripted(tree_script(EPISODES["depth-2 recursion"][1]))
    made = RLM(
        backend_kwargs={"model_name": "gpt-x", "base_url": server.base_url},
        max_depth=2,
        settings=api_settings(temporal_address, session_dir, worker.task_queue),
    )
    events: list[tuple] = []
    callbacks = Callbacks(
        on_subcall_start=lambda depth, model, preview: events.append(("start", depth, model, preview)),
        on_subcall_complete=lambda depth, model, took, error: events.append(("done", depth, model, error)),
    )
    async with made:
        episode = await made.start("ctx", TASK)
        assert (await episode.result()).answer == "sum 6"
        watcher = ChildWatcher(episode, callbacks)
        await asyncio.wait_for(watcher.run(), 60)
        watcher.close()
    assert events == [("start", 1, "gpt-x", "1,2,3"), ("done", 1, "gpt-x", None)]
    assert len(watcher.reported) == 1


async def test_a_subcall_callback_that_raises_does_not_break_the_run(
    temporal_address, session_dir, scripted, worker, capsys
) -> None:
    server = scripted(tree_script(EPISODES["depth-2 recursion"][1]))
    completed: list[str | None] = []

    def broken(depth: int, model: str, preview: str) -> None:
        raise RuntimeError("the callback broke")

    made = RLM(
        backend_kwargs={"model_name": "gpt-x", "base_url": server.base_url},
        max_depth=2,
        on_subcall_start=broken,
        on_subcall_complete=lambda depth, model, took, error: completed.append(error),
        settings=api_settings(temporal_address, session_dir, worker.task_queue),
    )
    result = await asyncio.to_thread(made.completion, "ctx", TASK)

    assert result.response == "sum 6"
    assert completed == [None]
    assert "callback 'broken' raised: the callback broke" in capsys.readouterr().err


def rlms_readme_example() -> str:
    """The first example of rlms 0.1.3's README (its package metadata), as its users have it."""
    from importlib.metadata import metadata

    readme = metadata("rlms").get_payload()  # type: ignore[attr-defined]
    start = readme.index("```python\nfrom rlm import RLM")
    return readme[start + len("```python\n") : readme.index("```", start + 10)]


async def test_rlms_readme_example_runs_with_one_changed_import(
    temporal_address, session_dir, scripted, worker, monkeypatch, capsys
) -> None:
    from rlm.logger import RLMLogger as RlmsOwnLogger

    powers = (
        "```repl\nanswer['content'] = '\\n'.join(str(2 ** i) for i in range(100))\n"
        "answer['ready'] = True\n```"
    )
    server = scripted(lambda request: powers if request.is_root else "sub")
    example = rlms_readme_example()
    assert 'backend_kwargs={"model_name": "gpt-5-nano"}' in example and "verbose=True" in example
    # The user's environment: their key and endpoint, and (for this test) the test's server and worker.
    monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-scripted")
    monkeypatch.setenv("TEMPORAL_ADDRESS", temporal_address)
    monkeypatch.setenv("DRLM_TASK_QUEUE", worker.task_queue)
    monkeypatch.setenv("DRLM_DATA_DIR", str(session_dir))
    code = example.replace("from rlm import RLM", "from durable_rlm import RLM")
    await asyncio.to_thread(exec, code, {})
    printed = capsys.readouterr().out.splitlines()
    assert printed[-100:] == [str(2**i) for i in range(100)]
    assert server.root_requests()[0].model == "gpt-5-nano"

    # rlms's own logger (its import left as it was) takes our iterations.
    logger = RlmsOwnLogger()
    made = RLM(backend_kwargs={"model_name": "gpt-5-nano"}, logger=logger)
    result = await asyncio.to_thread(made.completion, "ctx", TASK)
    trajectory = logger.get_trajectory()
    assert trajectory is not None and trajectory["run_metadata"]["root_model"] == "gpt-5-nano"
    assert [i["iteration"] for i in trajectory["iterations"]] == [1]
    assert result.metadata == trajectory
