"""`drlm export`: an episode, run for real, written as the rlms package's trajectory log (checked
against a real rlms log and re-serialised by rlms's own types) or as one JSON document."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from durable_rlm.audit.timeline import Timeline, episode_timeline, render
from durable_rlm.scripted import ChatRequest, Reply, root_and_sub
from durable_rlm.viewer.export import export_text, run_metadata
from durable_rlm.workflows.models import EpisodeRequest, ModelSettings
from tests.conftest import request_for, run_episode

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "rlms_trace_gpt4o.jsonl"
DRLM = str(Path(sys.executable).with_name("drlm"))
RLMS_VERSION = "0.1.3"

TURNS = [
    "Let me look at the context.\n```repl\nn = len(context.splitlines())\nprint(n)\n```",
    "```repl\nlabel = llm_query('name for ' + str(n))\nprint(label)\n```",
    "```repl\nFINAL(label)\n```",
]
ANSWER = "NAME FOR 3"


async def counted_episode(client, scripted, worker, blobs) -> tuple[str, Timeline]:
    """TURNS over a three-line context: three iterations, a sub-call, a FINAL in a cell."""
    from durable_rlm.client.episodes import store_context

    server = scripted(root_and_sub(TURNS, lambda prompt: prompt.upper()))
    request = request_for(server, "count the lines and name the count")
    request = request.model_copy(update={"context": store_context(blobs, "one\ntwo\nthree\n")})
    episode_id = f"export-{uuid.uuid4().hex[:8]}"
    result = await run_episode(client, request, worker.task_queue, episode_id)
    assert result.answer == ANSWER
    return episode_id, await episode_timeline(client, episode_id)


def rlms_lines(timeline: Timeline, blobs) -> list[dict[str, Any]]:
    text = export_text(timeline, blobs, "rlms")
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


# --- the reference: a real rlms log, and rlms itself ------------------------------------


def fixture_shapes() -> dict[str, dict[str, set[str]]]:
    """Per kind of object in the real log: each key and the type names its values have."""
    shapes: dict[str, dict[str, set[str]]] = {}

    def note(kind: str, obj: dict[str, Any]) -> None:
        for key, value in obj.items():
            shapes.setdefault(kind, {}).setdefault(key, set()).add(type(value).__name__)

    for line in FIXTURE.read_text().splitlines():
        entry = json.loads(line)
        if entry["type"] in ("metadata", "iteration"):
            note(entry["type"], entry)
        for message in entry.get("prompt") if entry["type"] == "iteration" else []:
            note("message", message)
        for block in entry.get("code_blocks", []):
            note("code_block", block)
            note("result", block["result"])
    return shapes


def rlms_python() -> str | None:
    """An interpreter that imports rlms: this one, or the benchmarks' rlms virtualenv."""
    if importlib.util.find_spec("rlm") is not None:
        return sys.executable
    cache = Path(os.environ.get("DRLM_BENCH_CACHE") or Path.home() / ".cache" / "drlm-bench")
    python = cache / f"rlms-{RLMS_VERSION}" / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import rlm.core.types"]).returncode == 0:
        return str(python)
    return None


# Rebuilds every entry with rlms's own types and serialises it as RLMLogger does: equal to
# our line only if rlms reads every field we wrote, and we wrote every field it writes.
RESERIALISE = """
import json, sys
from rlm.core.types import CodeBlock, REPLResult, RLMChatCompletion, RLMIteration, RLMMetadata

def block(b):
    r = b["result"]
    calls = [RLMChatCompletion.from_dict(c) for c in r["rlm_calls"]]
    result = REPLResult(stdout=r["stdout"], stderr=r["stderr"], locals=r["locals"],
                        execution_time=r["execution_time"], rlm_calls=calls,
                        final_answer=r["final_answer"])
    return CodeBlock(code=b["code"], result=result)

out = []
for line in sys.stdin:
    e = json.loads(line)
    head = {k: e[k] for k in ("type", "timestamp")}
    if e["type"] == "metadata":
        body = RLMMetadata(**{k: v for k, v in e.items() if k not in head}).to_dict()
    else:
        head["iteration"] = e["iteration"]
        body = RLMIteration(prompt=e["prompt"], response=e["response"],
                            code_blocks=[block(b) for b in e["code_blocks"]],
                            final_answer=e["final_answer"], iteration_time=e["iteration_time"]).to_dict()
    out.append({**head, **body})
print(json.dumps(out))
"""


def reserialised(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    python = rlms_python()
    if python is None:
        return [_local_reserialise(line) for line in lines]
    feed = "".join(json.dumps(line) + "\n" for line in lines)
    done = subprocess.run([python, "-c", RESERIALISE], input=feed, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _local_reserialise(entry: dict[str, Any]) -> dict[str, Any]:
    """rlms 0.1.3's from_dict / to_dict, restated: used only where rlms is not installed."""

    def usage(u: dict[str, Any]) -> dict[str, Any]:
        models = {
            m: {k: s[k] for k in ("total_calls", "total_input_tokens", "total_output_tokens")}
            | ({"total_cost": s["total_cost"]} if s.get("total_cost") is not None else {})
            for m, s in u.get("model_usage_summaries", {}).items()
        }
        costs = [s["total_cost"] for s in models.values() if "total_cost" in s]
        return {"model_usage_summaries": models} | ({"total_cost": sum(costs)} if costs else {})

    def call(c: dict[str, Any]) -> dict[str, Any]:
        out = {k: c.get(k) for k in ("root_model", "prompt", "response")}
        out |= {"usage_summary": usage(c.get("usage_summary")), "execution_time": c.get("execution_time")}
        return out | {k: c[k] for k in ("metadata", "error") if c.get(k) is not None}

    head = {k: entry[k] for k in ("type", "timestamp")}
    if entry["type"] == "metadata":
        keys = ("root_model", "max_depth", "max_iterations", "backend", "backend_kwargs")
        keys += ("environment_type", "environment_kwargs", "other_backends")
        return head | {k: entry[k] for k in keys}
    blocks = [
        {
            "code": b["code"],
            "result": {k: b["result"][k] for k in ("stdout", "stderr", "locals", "execution_time")}
            | {"rlm_calls": [call(c) for c in b["result"]["rlm_calls"]]}
            | {"final_answer": b["result"]["final_answer"]},
        }
        for b in entry["code_blocks"]
    ]
    body = {"prompt": entry["prompt"], "response": entry["response"], "code_blocks": blocks}
    body |= {"final_answer": entry["final_answer"], "iteration_time": entry["iteration_time"]}
    return head | {"iteration": entry["iteration"]} | body


def assert_shaped_like_the_fixture(
    kind: str, obj: dict[str, Any], extra: frozenset[str] = frozenset()
) -> None:
    shape = fixture_shapes()[kind]
    assert set(obj) == set(shape) | extra, kind
    for key, value in obj.items():
        if key in shape:
            assert type(value).__name__ in shape[key], (kind, key, value)


# --- rlms ----------------------------------------------------------------------------------


async def test_rlms_export_has_the_shapes_of_a_real_rlms_log(client, scripted, worker, blobs) -> None:
    _, timeline = await counted_episode(client, scripted, worker, blobs)
    metadata, *iterations = rlms_lines(timeline, blobs)

    assert metadata["type"] == "metadata"
    assert_shaped_like_the_fixture("metadata", metadata)
    assert [it["iteration"] for it in iterations] == [1, 2, 3]
    for it in iterations:
        assert_shaped_like_the_fixture("iteration", it)
        for message in it["prompt"]:
            assert_shaped_like_the_fixture("message", message)
        for block in it["code_blocks"]:
            assert_shaped_like_the_fixture("code_block", block)
            # rlms 0.1.3's REPLResult writes final_answer; the fixture's older logger did not.
            assert_shaped_like_the_fixture("result", block["result"], frozenset({"final_answer"}))
    call = iterations[1]["code_blocks"][0]["result"]["rlm_calls"][0]
    assert set(call) == {"root_model", "prompt", "response", "usage_summary", "execution_time"}
    assert isinstance(call["execution_time"], float)


async def test_rlms_export_reads_back_through_rlms_own_types(client, scripted, worker, blobs) -> None:
    _, timeline = await counted_episode(client, scripted, worker, blobs)
    lines = rlms_lines(timeline, blobs)
    assert reserialised(lines) == lines


async def test_rlms_export_tells_what_each_iteration_sent_ran_and_answered(
    client, scripted, worker, blobs
) -> None:
    _, timeline = await counted_episode(client, scripted, worker, blobs)
    metadata, first, second, third = rlms_lines(timeline, blobs)

    assert (metadata["root_model"], metadata["backend"], metadata["max_iterations"]) == (
        "scripted",
        "openai",
        8,
    )
    # The prompt is what the root model was sent: the system prompt and task first, then
    # each earlier reply and what its cell printed.
    assert [m["role"] for m in first["prompt"]][:1] == ["system"]
    assert "count the lines" in "".join(m["content"] for m in first["prompt"])
    assert second["prompt"][: len(first["prompt"])] == first["prompt"]
    assert {"role": "assistant", "content": TURNS[0]} in second["prompt"]
    assert len(third["prompt"]) > len(second["prompt"])
    assert first["response"] == TURNS[0]

    (block,) = first["code_blocks"]
    assert block["code"] == "n = len(context.splitlines())\nprint(n)"
    assert block["result"]["stdout"].strip() == "3"
    (call,) = second["code_blocks"][0]["result"]["rlm_calls"]
    assert (call["prompt"], call["response"], call["root_model"]) == ("name for 3", ANSWER, "scripted")
    assert call["usage_summary"]["model_usage_summaries"]["scripted"]["total_calls"] == 1
    assert third["code_blocks"][0]["result"]["final_answer"] == ANSWER
    assert [it["final_answer"] for it in (first, second, third)] == [None, None, ANSWER]
    for it in (first, second, third):
        assert it["iteration_time"] > 0
        assert all(b["result"]["execution_time"] > 0 for b in it["code_blocks"])
    assert first["timestamp"] < second["timestamp"] < third["timestamp"]


CHILD_TURNS = [
    "```repl\ntotal = sum(int(x) for x in context.split(','))\nprint(total)\n```",
    "FINAL_VAR(total)",
]


async def test_a_child_episode_is_an_rlm_call_with_its_own_trajectory(
    client, scripted, worker, blobs
) -> None:
    root_turns = ["```repl\nr = rlm_query('3,4,5', model='child-m')\nprint(r)\n```", "FINAL_VAR(r)"]

    def script(request: ChatRequest) -> Reply | str:
        turns = root_turns if request.model == "scripted" else CHILD_TURNS
        return turns[min(request.turn, len(turns) - 1)]

    server = scripted(script)
    request = request_for(server, "add the numbers", max_depth=2)
    child_model = ModelSettings(model="child-m", base_url=server.base_url, max_attempts=3)
    request = request.model_copy(update={"other_models": [child_model]})
    episode_id = f"export-tree-{uuid.uuid4().hex[:6]}"
    assert (await run_episode(client, request, worker.task_queue, episode_id)).answer == "12"
    lines = rlms_lines(await episode_timeline(client, episode_id), blobs)

    (call,) = lines[1]["code_blocks"][0]["result"]["rlm_calls"]
    assert (call["root_model"], call["prompt"], call["response"]) == ("child-m", "3,4,5", "12")
    trajectory = call["metadata"]
    assert trajectory["run_metadata"]["root_model"] == "child-m"
    assert [it["iteration"] for it in trajectory["iterations"]] == [1, 2]
    assert trajectory["iterations"][-1]["final_answer"] == "12"
    assert reserialised(lines) == lines
    child_log = [
        {"type": "metadata", "timestamp": "", **trajectory["run_metadata"]},
        *trajectory["iterations"],
    ]
    assert reserialised(child_log) == child_log


def test_metadata_names_the_model_and_never_a_secret() -> None:
    model = ModelSettings(model="gpt-x", base_url="https://user:sk-secret@api.example.com:8443/v1?key=sk-2")
    timeline = Timeline(
        episode_id="e", status="completed", request=EpisodeRequest(task="t", root_model=model)
    )
    metadata = run_metadata(timeline)
    assert metadata["backend_kwargs"] == {
        "model_name": "gpt-x",
        "base_url": "https://api.example.com:8443/v1",
    }
    assert "sk-" not in json.dumps(metadata)


# --- json ----------------------------------------------------------------------------------


async def test_json_export_is_one_document_with_request_iterations_and_result(
    client, scripted, worker, blobs
) -> None:
    episode_id, timeline = await counted_episode(client, scripted, worker, blobs)
    document = json.loads(export_text(timeline, blobs, "json"))

    assert document["episode_id"] == episode_id
    assert document["request"]["task"] == "count the lines and name the count"
    assert document["result"]["answer"] == ANSWER
    assert [it["response"] for it in document["iterations"]] == TURNS
    assert all(it["prompt"][0]["role"] == "system" for it in document["iterations"])
    assert document["iterations"][1]["cells"][0]["sub_calls"][0]["reply"] == ANSWER
    # The same model as `drlm show --json`: it reads back, and `drlm show` renders it.
    assert "=== iteration 3 ===" in render(Timeline.model_validate(document))


# --- the command ---------------------------------------------------------------------------


def drlm(temporal_address: str, session_dir: Path, data_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """The CLI on the tests' server and stores (the blobs of the episodes they ran)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "TEMPORAL_", "DRLM_"))}
    environ.update(
        TEMPORAL_ADDRESS=temporal_address,
        DRLM_DATABASE_URL=f"sqlite:///{session_dir / 'drlm.sqlite'}",
        DRLM_DATA_DIR=str(data_dir),
    )
    return subprocess.run([DRLM, *args], capture_output=True, text=True, timeout=120, env=environ)


async def test_export_writes_the_log_to_a_file(
    client, scripted, worker, blobs, temporal_address, session_dir, tmp_path
) -> None:
    episode_id, timeline = await counted_episode(client, scripted, worker, blobs)
    target = tmp_path / "episode.jsonl"
    out = drlm(
        temporal_address, session_dir, tmp_path, "export", episode_id, "--format", "rlms", "-o", str(target)
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""
    text = export_text(timeline, blobs, "rlms")
    assert target.read_text() == text
    lines = text.count("\n")
    assert out.stderr == (  # success says what was written where
        f"episode {episode_id}: {len(timeline.iterations)} iteration(s) written as an rlms trajectory log "
        f"to {target} ({lines:,} line(s), {len(text.encode()):,} bytes)\n"
    )


def test_an_unknown_episode_is_one_line_exit_2(temporal_address, session_dir, tmp_path) -> None:
    out = drlm(temporal_address, session_dir, tmp_path, "export", "no-such-episode", "--format", "json")
    assert out.returncode == 2
    assert out.stderr == "drlm: no episode with id 'no-such-episode'\n"
    assert out.stdout == ""
