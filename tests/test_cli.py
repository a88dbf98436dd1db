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
from durable_rlm.ports import free_port
from durable_rlm.scripted import Reply, root_and_sub
from durable_rlm.workflows import defaults

DRLM = str(Path(sys.executable).with_name("drlm"))
TURNS = [
    "```repl\nn = len(context.splitlines())\nprint(n)\n```",
    "```repl\nlabel = llm_query('name for ' + str(n))\n```",
    "FINAL_VAR(label)",
]


def drlm(data_dir: Path, *args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "TEMPORAL_", "DRLM_"))}
    environ.update(DRLM_DATA_DIR=str(data_dir), DRLM_SERVER_IDLE_S="2", **env)
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
    slow = [Reply(text=t, delay_s=0.8) for t in TURNS]  # slower than the progress poll
    server = scripted(root_and_sub(slow, lambda p: Reply(text=p.upper(), delay_s=0.8)))
    out = run_counting(tmp_path, server, context_file)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "NAME FOR 3"
    lines = out.stderr.splitlines()
    progress = [line.split(" (")[0] for line in lines if line.startswith("iteration ")]
    for step in (
        "iteration 1: waiting for the root model",
        "iteration 2: waiting for the root model",
        "iteration 2: cell 2: 1 llm_query call(s)",
        "iteration 3: waiting for the root model",
    ):
        assert step in progress, lines
    assert progress.index("iteration 2: cell 2: 1 llm_query call(s)") > progress.index(
        "iteration 2: waiting for the root model"
    )
    assert "ended: answered (final_var) after 3 iteration(s), 4 model call(s)" in out.stderr
    assert "answer source: model, confidence 1.00" in out.stderr


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


@pytest.mark.slow  # long end to end (issue 34: the default run near 13 min); CI runs it
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


@pytest.mark.slow  # long end to end (issue 34: the default run near 13 min); CI runs it
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
        (["run", "t", "--sampling", '{"temp": 1}'], "unknown sampling setting(s) temp; known: temperature"),
        (["run", "t", "--sub-sampling", '{"top_p": 2}'], "top_p: Input should be less than or equal to 1"),
        (["run", "t", "--provider", "nope"], "invalid choice: 'nope'"),
        (["run", "t", "--model", "anthropic:claude-x"], "no API key for anthropic model 'claude-x'"),
        (["run", "t", "--max-depth", "-1"], "max_depth: Input should be greater than or equal to 1"),
        (["run", "t", "--max-depth", "1000"], "max_depth: Input should be less than or equal to 8"),
        (
            ["run", "t", "--max-children", "0"],
            "max_children_per_batch: Input should be greater than or equal to 1",
        ),
        (
            ["run", "t", "--max-model-calls", "0"],
            "max_model_calls: Input should be greater than or equal to 1",
        ),
        (["run", "t", "--max-tokens", "-5"], "max_tokens: Input should be greater than or equal to 1"),
    ],
)
def test_bad_input_is_a_clear_error(tmp_path: Path, args: list[str], message: str) -> None:
    out = drlm(tmp_path, *args, DRLM_MODEL="m")
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "command", [["run", "t", "--base-url", "http://127.0.0.1:9/v1"], ["demo", "--api-key", "k"]]
)
def test_no_model_is_chosen_for_the_user(tmp_path: Path, command: list[str]) -> None:
    """No silent default: a run against a real endpoint names its model, or nothing starts."""
    out = drlm(tmp_path, *command)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == "drlm: name a model: --model NAME or DRLM_MODEL (e.g. --model gpt-4o-mini)"
    assert "gpt-4o-mini'" not in out.stderr  # no model is named as if the user had chosen it


def test_bad_json_context_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "ctx.json"
    bad.write_text("{not json")
    out = drlm(
        tmp_path, "run", "t", "--context", str(bad), "--base-url", "http://127.0.0.1:9/v1", DRLM_MODEL="m"
    )
    assert out.returncode == 2 and "not valid JSON" in out.stderr


@pytest.mark.slow  # long end to end (issue 34: the default run near 13 min); CI runs it
def test_unknown_model_fails_the_run_with_its_name(tmp_path: Path, scripted) -> None:
    server = scripted(root_and_sub(["FINAL(x)"]), models={"real"})
    out = drlm(tmp_path, "run", "t", "--base-url", server.base_url, "--model", "imaginary", "--json")
    assert out.returncode == 1
    result = json.loads(out.stdout)
    assert result["ended_by"] == "model_error" and "imaginary" in result["error"]
    assert (result["status"], result["failure_cause"]) == ("failed", "request")
    # The audit row says so too: `drlm list --status failed` finds it, `answered` does not.
    failed = drlm(tmp_path, "list", "--status", "failed")
    assert result["episode_id"] in failed.stdout, failed.stdout + failed.stderr
    answered = drlm(tmp_path, "list", "--status", "answered")
    assert result["episode_id"] not in answered.stdout


def test_api_key_is_refused_for_a_remote_worker(tmp_path: Path) -> None:
    out = drlm(
        tmp_path, "run", "t", "--model", "m", "--api-key", "sk-x", TEMPORAL_ADDRESS=f"127.0.0.1:{free_port()}"
    )
    assert out.returncode == 2 and "give the key to the worker" in out.stderr


def test_run_with_an_output_schema_and_a_limit_prints_the_extraction(tmp_path: Path, scripted) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"colour": {"type": "string"}}}))
    server = scripted(root_and_sub(["```repl\ncolour = 'blue'\n```"], extract=lambda p: '{"colour": "blue"}'))

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return drlm(
            tmp_path, "run", "which colour?", "--base-url", server.base_url, "--model", "m",
            "--max-iterations", "1", "--output-schema", str(schema), *extra,
        )  # fmt: skip

    out = run()
    assert out.returncode == 4, out.stderr  # an extracted answer is told apart from a given one
    assert json.loads(out.stdout) == {"colour": "blue"}
    assert "Result: extracted after max iterations reached (1/1) (confidence 0.80)" in out.stderr
    assert "answer source: extraction, confidence 0.80" in out.stderr
    accepted = run("--accept-extracted", "--json")
    assert accepted.returncode == 0, accepted.stderr
    report = json.loads(accepted.stdout)
    assert (report["answer_source"], report["confidence"], report["ended_by"]) == (
        "extraction",
        0.8,
        "max_iterations",
    )


def test_a_bad_output_schema_is_a_clear_error(tmp_path: Path) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "array"}')
    out = drlm(tmp_path, "run", "t", "--model", "m", "--output-schema", str(schema))
    assert out.returncode == 2 and "invalid output schema" in out.stderr


# --- endings a script can tell apart (issue 20) ---------------------------------------------------

ROOT_DIR = Path(__file__).resolve().parents[1]


def test_json_names_the_episode_the_source_the_confidence_and_the_usage(tmp_path: Path, scripted) -> None:
    server = scripted(root_and_sub(["```repl\nx = 6 * 7\n```", "FINAL(42)"]))
    episode_id = f"json-{uuid.uuid4().hex[:6]}"
    out = drlm(
        tmp_path, "run", "t", "--base-url", server.base_url, "--model", "m", "--id", episode_id, "--json"
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["status"] == "answered" and report["episode_id"] == episode_id
    assert (report["answer"], report["answer_source"], report["confidence"]) == ("42", "model", 1.0)
    assert report["stop_reason"] == "the model answered (final); final_pattern: final action"
    assert report["iterations"] == 2 and report["usage"]["prompt_tokens"] > 0


def test_a_limit_without_an_answer_exits_3(tmp_path: Path, scripted) -> None:
    server = scripted(root_and_sub(["```repl\nprint(1)\n```"]))
    args = (
        "--base-url",
        server.base_url,
        "--model",
        "m",
        "--max-iterations",
        "1",
        "--no-extraction",
        "--json",
    )
    out = drlm(tmp_path, "run", "t", *args)
    assert out.returncode == 3, out.stderr
    report = json.loads(out.stdout)
    assert (report["answer"], report["answer_source"], report["ended_by"]) == (None, "none", "max_iterations")
    assert report["stop_reason"] == "max iterations reached (1/1); fallback extraction is disabled"


@pytest.mark.slow  # long end to end (issue 34: the default run near 13 min); CI runs it
def test_a_cancelled_episode_exits_5(tmp_path: Path, scripted) -> None:
    server = scripted(root_and_sub(["FINAL(never asked)"]))
    episode_id = f"cancel-{uuid.uuid4().hex[:6]}"
    started = drlm(
        tmp_path, "run", "t", "--base-url", server.base_url, "--model", "m", "--id", episode_id, "--no-wait"
    )
    assert started.returncode == 0, started.stderr
    cancelled = drlm(tmp_path, "cancel", episode_id, "--reason", "changed my mind")
    assert cancelled.returncode == 0, cancelled.stderr
    assert f"episode {episode_id}: cancel accepted" in cancelled.stderr
    assert "ended: cancelled" in cancelled.stderr
    resumed = drlm(tmp_path, "resume", episode_id, "--json")
    assert resumed.returncode == 5
    report = json.loads(resumed.stdout)
    assert (report["status"], report["ended_by"], report["answer"]) == ("cancelled", "cancelled", None)
    assert report["stop_reason"] == "Cancelled: changed my mind"
    assert server.requests == []
    listed = drlm(tmp_path, "list")
    row = next(line.split() for line in listed.stdout.splitlines() if line.startswith(episode_id))
    assert row[:3] == [episode_id, "cancelled", "cancelled"]

    again = drlm(tmp_path, "cancel", episode_id, "--extract")
    assert again.returncode == 0, again.stderr
    assert "has already ended (cancelled); nothing was changed" in again.stderr
    assert json.loads(drlm(tmp_path, "resume", episode_id, "--json").stdout) == report
    unknown = drlm(tmp_path, "cancel", "no-such-episode")
    assert (unknown.returncode, unknown.stderr.strip()) == (2, "drlm: no episode with id 'no-such-episode'")


@pytest.mark.slow  # long end to end (issue 34: the default run near 13 min); CI runs it
def test_a_failed_episode_exits_1_and_a_custom_policy_loads_from_settings(tmp_path: Path, scripted) -> None:
    server = scripted(root_and_sub(["```repl\nprint(1)\n```"]))
    env = {"DRLM_POLICY_MODULES": "tests.policy_plugins", "PYTHONPATH": str(ROOT_DIR)}
    args = ("--base-url", server.base_url, "--model", "m", "--json")
    stops = drlm(tmp_path, "run", "t", *args, "--policy", "plugin_stops_at_step_one", **env)
    assert stops.returncode == 0, stops.stderr  # the policy gave an answer of its own
    report = json.loads(stops.stdout)
    assert (report["answer"], report["answer_source"], report["answer_policy"]) == (
        "plugin says enough",
        "policy",
        "plugin_stops_at_step_one",
    )
    failed = drlm(tmp_path, "run", "t", *args, "--policy", "plugin_raises", **env)
    assert failed.returncode == 1
    report = json.loads(failed.stdout)
    assert report["status"] == "failed"
    assert report["error"] == "termination policy 'plugin_raises' raised RuntimeError: the plugin has a bug"
    unknown = drlm(
        tmp_path, "run", "t", *args, "--policy", "plugin_raises", DRLM_POLICY_MODULES="no.such.module"
    )
    assert unknown.returncode == 2 and "DRLM_POLICY_MODULES: cannot import 'no.such.module'" in unknown.stderr


@pytest.mark.slow  # long end to end (issue 34: the default run near 13 min); CI runs it
def test_request_timeout_and_attempts_are_set_from_flags_and_settings(tmp_path: Path, scripted) -> None:
    server = scripted(root_and_sub([Reply(text="FINAL(late)", delay_s=4)]))
    base = ("--base-url", server.base_url, "--model", "m", "--json")
    out = drlm(tmp_path, "run", "t", *base, "--request-timeout", "1", "--max-attempts", "2")
    assert out.returncode == 1, out.stderr
    assert "timed out after 1 s" in json.loads(out.stdout)["error"]
    assert len(server.root_requests()) == 2
    out = drlm(tmp_path, "run", "t", *base, DRLM_REQUEST_TIMEOUT_S="1", DRLM_MODEL_ATTEMPTS="1")
    assert out.returncode == 1 and len(server.root_requests()) == 3
    bad = drlm(tmp_path, "run", "t", *base, DRLM_REQUEST_TIMEOUT_S="soon")
    assert bad.returncode == 2 and "DRLM_REQUEST_TIMEOUT_S must be a number, got 'soon'" in bad.stderr


def test_cli_defaults_are_the_one_home_of_defaults() -> None:
    from durable_rlm.cli import build_parser

    args = build_parser().parse_args(["run", "t"])
    assert (args.max_iterations, args.max_llm_calls) == (defaults.MAX_ITERATIONS, defaults.MAX_LLM_CALLS)
    assert args.max_duration == defaults.MAX_DURATION.total_seconds()
    assert (args.cell_timeout, args.output_truncation) == (
        defaults.CELL_TIMEOUT_S,
        defaults.OUTPUT_TRUNCATION,
    )
    assert (args.request_timeout, args.max_attempts) == (defaults.REQUEST_TIMEOUT_S, defaults.MODEL_ATTEMPTS)


def test_doctor_reports_each_sandbox_layer(tmp_path: Path) -> None:
    out = drlm(tmp_path, "doctor")
    assert out.returncode == 0, out.stdout + out.stderr
    for check in ("network", "filesystem", "rlimits", "seccomp", "death signal", "audit hook", "SQL store"):
        assert check in out.stdout
    assert "empty network namespace" in out.stdout and "private root" in out.stdout
    if os.geteuid() == 0:
        assert "(one per sandbox)" in out.stdout
    # Bounded as a whole: a cgroup of its own, or the rlimits' product, stated either way.
    assert "ipc and pid namespaces" in out.stdout and "memory as a whole" in out.stdout


@pytest.mark.slow  # long end to end (issue 34: the default run near 13 min); CI runs it
def test_run_with_depth_shows_the_tree(tmp_path: Path, scripted) -> None:
    from tests.test_recursion import SUM_CHILD, by_model

    root_turns = ["```repl\nr = rlm_query('4,5,6', model='child-m')\n```", "FINAL_VAR(r)"]
    server = scripted(by_model({"m": root_turns, "child-m": SUM_CHILD}))
    episode_id = f"tree-{uuid.uuid4().hex[:6]}"
    args = ("--base-url", server.base_url, "--model", "m", "--other-model", "child-m", "--id", episode_id)
    out = drlm(tmp_path, "run", "t", *args, "--max-depth", "2", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert (report["answer"], report["tree_episodes"]) == ("15", 2)
    assert report["children"][0]["episode_id"] == f"{episode_id}/1.0"
    shown = drlm(tmp_path, "show", episode_id)
    line = f"    child {episode_id}/1.0 (call 0, model child-m), depth 1: answered (final_var), answer '15'"
    assert line in shown.stdout


def test_an_unknown_tool_is_refused_before_anything_starts(tmp_path: Path) -> None:
    out = drlm(
        tmp_path,
        "run",
        "t",
        "--tool",
        "nope",
        "--model",
        "m",
        DRLM_TOOL_MODULES="tests.tool_plugins",
        PYTHONPATH=str(ROOT_DIR),
    )
    assert out.returncode == 2
    assert (
        "drlm: unknown tool(s) nope; registered: broken, convert, hangs, lookup_price, not_json" in out.stderr
    )
    missing = drlm(tmp_path, "run", "t", "--model", "m", DRLM_TOOL_MODULES="no.such.tools")
    assert missing.returncode == 2 and "DRLM_TOOL_MODULES: cannot import 'no.such.tools'" in missing.stderr


@pytest.mark.slow  # long end to end (issue 34: the default run near 13 min); CI runs it
def test_a_drlm_run_works_only_for_its_own_episode(tmp_path: Path, scripted, context_file: Path) -> None:
    """Issue 37: an episode nobody runs (started with --no-wait, or left by Ctrl-C) is not
    taken up by an unrelated `drlm run`, which would leave it mid-call as it exits (the
    call paid again). `drlm watch` of it says no worker runs it; `drlm resume` does."""
    server = scripted(lambda request: "FINAL(done)" if request.is_root else "x")
    waiting = f"left-{uuid.uuid4().hex[:6]}"
    started = drlm(
        tmp_path,
        "run",
        "the left one",
        "--base-url",
        server.base_url,
        "--model",
        "left",
        "--id",
        waiting,
        "--no-wait",
    )
    assert started.returncode == 0, started.stderr
    for _ in range(2):  # two unrelated runs, one after the other, each on a server that knows it
        other = drlm(tmp_path, "run", "another", "--base-url", server.base_url, "--model", "other", "--json")
        assert other.returncode == 0 and other.stdout.strip(), (other.returncode, other.stdout, other.stderr)
        assert json.loads(other.stdout)["answer"] == "done"
    assert [r.model for r in server.requests if r.model == "left"] == []  # nobody took it up
    with pytest.raises(subprocess.TimeoutExpired) as watched:  # it follows until the end: stopped
        drlm(tmp_path, "watch", waiting, "--plain", timeout=15)
    said = watched.value.stderr.decode() if isinstance(watched.value.stderr, bytes) else watched.value.stderr
    assert f"no worker runs this episode: `drlm resume {waiting}`" in (said or ""), said
    resumed = drlm(tmp_path, "resume", waiting, "--json")
    assert resumed.returncode == 0 and json.loads(resumed.stdout)["answer"] == "done", resumed.stderr
    assert len([r for r in server.requests if r.model == "left"]) == 1  # paid once


def test_scripted_server_lets_a_new_user_run_without_a_key(tmp_path: Path) -> None:
    """Issue 36: `drlm scripted-server` prints its base URL; the README's `drlm run` against
    it answers the demo's question right, with no key of a real provider."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "TEMPORAL_", "DRLM_"))}
    environ.update(DRLM_DATA_DIR=str(tmp_path), DRLM_SERVER_IDLE_S="2")
    log = tmp_path / "demo.log"
    server = subprocess.Popen(
        [DRLM, "scripted-server", "--log", str(log)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environ,
    )
    try:
        assert server.stdout is not None
        base_url = server.stdout.readline().strip()
        assert base_url.startswith("http://127.0.0.1:") and base_url.endswith("/v1"), base_url
        args = ("--base-url", base_url, "--model", "scripted-rlm", "--context", str(log), "--json")
        out = drlm(tmp_path, "run", demo.TASK, *args)
        assert out.returncode == 0, out.stderr
        service, count = demo.expected_answer(log.read_text())
        assert json.loads(out.stdout)["answer"] == f"{service} logged the most ERROR lines: {count}"
    finally:
        server.terminate()
        assert server.wait(timeout=10) == 0  # SIGTERM stops it cleanly
