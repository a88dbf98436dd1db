"""`drlm` as a user runs it: a subprocess, the embedded server, a real HTTP model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from durable_rlm import demo
from durable_rlm.runtime import free_port
from durable_rlm.scripted import root_and_sub

DRLM = str(Path(sys.executable).with_name("drlm"))
TURNS = [
    "```repl\nn = len(context.splitlines())\nprint(n)\n```",
    "```repl\nlabel = llm_query('name for ' + str(n))\n```",
    "FINAL_VAR(label)",
]


def drlm(data_dir: Path, *args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "TEMPORAL_", "DRLM_"))}
    environ.update(DRLM_DATA_DIR=str(data_dir), **env)
    return subprocess.run([DRLM, *args], capture_output=True, text=True, timeout=timeout, env=environ)


def run_counting(tmp_path: Path, server, context_file: Path, *extra: str, task: str = "count the lines"):
    """`drlm run` of the TURNS episode against the scripted server."""
    return drlm(
        tmp_path,
        "run",
        task,
        "--context",
        str(context_file),
        "--base-url",
        server.base_url,
        "--model",
        "scripted",
        *extra,
    )


@pytest.fixture
def context_file(tmp_path: Path) -> Path:
    path = tmp_path / "context.txt"
    path.write_text("one\ntwo\nthree\n")
    return path


def test_run_json_prints_only_the_episode_result(tmp_path: Path, scripted, context_file: Path) -> None:
    server = scripted(root_and_sub(TURNS, lambda p: p.upper()))
    out = run_counting(tmp_path, server, context_file, "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)  # the whole of stdout is one JSON object
    assert result["answer"] == "NAME FOR 3"
    assert (result["ended_by"], result["iterations"], result["model_calls"]) == ("final_var", 3, 4)


def test_run_prints_progress_and_the_answer(tmp_path: Path, scripted, context_file: Path) -> None:
    server = scripted(root_and_sub(TURNS, lambda p: p.upper()))
    out = run_counting(tmp_path, server, context_file)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "NAME FOR 3"
    assert "iteration" in out.stderr and "ended by final_var" in out.stderr


def test_show_prints_the_timeline(tmp_path: Path, scripted, context_file: Path) -> None:
    server = scripted(root_and_sub(TURNS, lambda p: p.upper()))
    episode_id = f"cli-{uuid.uuid4().hex[:6]}"
    run_counting(tmp_path, server, context_file, "--id", episode_id, "--json", task="count")
    out = drlm(tmp_path, "show", episode_id)
    assert out.returncode == 0, out.stderr
    assert "=== iteration 3 ===" in out.stdout
    assert "sub-call 0: 'name for 3' -> 'NAME FOR 3'" in out.stdout
    timeline = json.loads(drlm(tmp_path, "show", episode_id, "--json").stdout)
    assert timeline["result"]["answer"] == "NAME FOR 3"


def test_an_episode_survives_a_restart_of_the_cli(tmp_path: Path, scripted, context_file: Path) -> None:
    server = scripted(root_and_sub(TURNS, lambda p: p.upper()))
    episode_id = f"later-{uuid.uuid4().hex[:6]}"
    started = run_counting(tmp_path, server, context_file, "--id", episode_id, "--no-wait", task="count")
    assert started.returncode == 0 and started.stdout.strip() == episode_id
    assert server.requests == []  # nothing ran: the CLI and its server are gone
    resumed = drlm(tmp_path, "resume", episode_id, "--json")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["answer"] == "NAME FOR 3"
    listing = drlm(tmp_path, "list")
    assert episode_id in listing.stdout


def test_demo_finds_the_ground_truth(tmp_path: Path) -> None:
    out = drlm(tmp_path, "demo", "--json")
    assert out.returncode == 0, out.stderr
    service, count = demo.expected_answer(demo.demo_log())
    assert json.loads(out.stdout)["answer"] == f"{service} logged the most ERROR lines: {count}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "  "], "task must not be empty"),
        (["run", "t", "--context", "/no/such/file"], "context file not found"),
        (["run", "t", "--max-iterations", "0"], "max_iterations"),
        (["run", "t", "--fence", "py thon"], "invalid code fence"),
        (["show", "no-such-episode"], "no episode with id"),
    ],
)
def test_bad_input_is_a_clear_error(tmp_path: Path, args: list[str], message: str) -> None:
    out = drlm(tmp_path, *args)
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_bad_json_context_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "ctx.json"
    bad.write_text("{not json")
    out = drlm(tmp_path, "run", "t", "--context", str(bad))
    assert out.returncode == 2 and "not valid JSON" in out.stderr


def test_unknown_model_fails_the_run_with_its_name(tmp_path: Path, scripted) -> None:
    server = scripted(root_and_sub(["FINAL(x)"]), models={"real"})
    out = drlm(tmp_path, "run", "t", "--base-url", server.base_url, "--model", "imaginary", "--json")
    assert out.returncode == 1
    result = json.loads(out.stdout)
    assert result["ended_by"] == "model_error" and "imaginary" in result["error"]


def test_api_key_is_refused_for_a_remote_worker(tmp_path: Path) -> None:
    out = drlm(tmp_path, "run", "t", "--api-key", "sk-x", TEMPORAL_ADDRESS=f"127.0.0.1:{free_port()}")
    assert out.returncode == 2 and "give the key to the worker" in out.stderr


def test_worker_py_needs_a_temporal_address(tmp_path: Path) -> None:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TEMPORAL_")}
    out = subprocess.run(
        [sys.executable, "worker.py"],
        capture_output=True,
        text=True,
        timeout=60,
        env=environ,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert out.returncode == 2 and "TEMPORAL_ADDRESS" in out.stderr


def test_run_with_an_output_schema_and_a_limit_prints_the_extraction(tmp_path: Path, scripted) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"colour": {"type": "string"}}}))
    server = scripted(root_and_sub(["```repl\ncolour = 'blue'\n```"], extract=lambda p: '{"colour": "blue"}'))
    out = drlm(
        tmp_path,
        "run",
        "which colour?",
        "--base-url",
        server.base_url,
        "--model",
        "m",
        "--max-iterations",
        "1",
        "--output-schema",
        str(schema),
    )
    assert out.returncode == 4, out.stderr  # an extracted answer is told apart from a given one
    assert json.loads(out.stdout) == {"colour": "blue"}
    assert "Result: extracted after max iterations reached (1/1) (confidence 0.80)" in out.stderr
    assert "answer source: extraction, confidence 0.80" in out.stderr


def test_a_bad_output_schema_is_a_clear_error(tmp_path: Path) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "array"}')
    out = drlm(tmp_path, "run", "t", "--output-schema", str(schema))
    assert out.returncode == 2 and "invalid output schema" in out.stderr
