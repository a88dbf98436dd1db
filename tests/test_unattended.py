"""Commands on an episode that no worker runs, or whose worker dies while they wait: each
returns within seconds, says what happened and what happens next, and a cancel ends the
episode (and its children) at once. `drlm` as a user runs it: subprocesses, the embedded
server, a real HTTP model, real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from durable_rlm.scripted import Reply
from tests.test_cli import DRLM, drlm
from tests.test_recursion import by_model

CHILD_CALL_S = 60.0  # the child's model call: far longer than any test waits
RETURNS_WITHIN_S = 25.0  # "within seconds" on a loaded 2-core machine (typically 2-4 s)


def environ(data_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "TEMPORAL_", "DRLM_"))}
    env.update(DRLM_DATA_DIR=str(data_dir), DRLM_SERVER_IDLE_S="2", **extra)
    return env


def start_run(data_dir: Path, *args: str, **extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [DRLM, "run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environ(data_dir, **extra),
    )


def wait_for(condition, timeout: float = 60.0, what: str = "the condition") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def interrupt(run: subprocess.Popen[str]) -> str:
    """Ctrl-C, as a terminal sends it; what the run said on stderr."""
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 130, err
    return err


def rows(data_dir: Path) -> dict[str, dict]:
    listed = drlm(data_dir, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    return {row["episode_id"]: row for row in map(json.loads, listed.stdout.splitlines())}


def tree_script():  # type: ignore[no-untyped-def]
    """A root whose one cell starts a child episode; the child's model call takes a minute."""
    root = ["```repl\nr = rlm_query('4,5,6', model='child-m')\nprint(r)\n```", "FINAL_VAR(r)"]
    child = [Reply(text="FINAL(15)", delay_s=CHILD_CALL_S)]
    return by_model({"m": root, "child-m": child})


TREE_ARGS = ("--model", "m", "--other-model", "child-m", "--max-depth", "2")


def test_a_cancel_after_ctrl_c_of_drlm_run_ends_the_episode_and_its_child_at_once(
    tmp_path: Path, scripted
) -> None:
    server = scripted(tree_script())
    episode_id = f"left-{uuid.uuid4().hex[:6]}"
    run = start_run(tmp_path, "t", "--base-url", server.base_url, *TREE_ARGS, "--id", episode_id)
    wait_for(lambda: any(r.model == "child-m" for r in server.requests), what="the child's model call")
    said = interrupt(run)
    assert f"drlm cancel {episode_id}" in said
    calls_before = len(server.requests)

    began = time.monotonic()
    cancelled = drlm(tmp_path, "cancel", episode_id, "--reason", "changed my mind", timeout=90)
    took = time.monotonic() - began
    assert cancelled.returncode == 0, cancelled.stderr
    assert took < RETURNS_WITHIN_S, (took, cancelled.stderr)
    err = cancelled.stderr
    assert f"no worker runs episode {episode_id}: this command runs it until the cancel ends it" in err
    assert f"episode {episode_id}: cancel accepted" in err
    assert "Traceback" not in err

    listed = rows(tmp_path)
    child_id = f"{episode_id}/1.0"
    assert listed[episode_id]["status"] == "cancelled", listed[episode_id]
    assert listed[child_id]["status"] == "cancelled", listed[child_id]
    assert len(server.requests) == calls_before  # the cancel called no model
    again = drlm(tmp_path, "cancel", episode_id)  # an ended episode: said so, at once
    assert again.returncode == 0 and "has already ended" in again.stderr, again.stderr


def test_a_cancel_sent_to_a_live_worker_that_then_exits_is_taken_over(tmp_path: Path, scripted) -> None:
    """The worst moment: the cancel reaches `drlm run`'s worker while it is alive but does not
    answer (stopped), and `drlm run` then exits on Ctrl-C. The cancel notices at once (the
    worker's liveness lock is free) and runs the episode itself."""
    server = scripted(lambda request: Reply(text="FINAL(late)", delay_s=CHILD_CALL_S))
    episode_id = f"race-{uuid.uuid4().hex[:6]}"
    run = start_run(tmp_path, "t", "--base-url", server.base_url, "--model", "m", "--id", episode_id)
    wait_for(lambda: len(server.requests) == 1, what="the root model call")
    run.send_signal(signal.SIGSTOP)  # alive, its lock held, answering nothing
    cancel = subprocess.Popen(
        [DRLM, "cancel", episode_id], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=environ(tmp_path),
    )  # fmt: skip
    time.sleep(6)  # the cancel waits for the live worker (it does not start one of its own)
    assert cancel.poll() is None
    began = time.monotonic()
    run.send_signal(signal.SIGINT)
    run.send_signal(signal.SIGCONT)
    run.communicate(timeout=60)
    _, err = cancel.communicate(timeout=90)
    assert cancel.returncode == 0, err
    assert time.monotonic() - began < RETURNS_WITHIN_S
    assert f"no worker runs episode {episode_id}: this command runs it until the cancel ends it" in err
    assert "ended by cancelled" in err and "Traceback" not in err
    assert rows(tmp_path)[episode_id]["status"] == "cancelled"
    assert len(server.requests) == 1  # the call in flight was not made again


def test_a_cancel_racing_ctrl_c_of_drlm_run_ends_the_episode(tmp_path: Path, scripted) -> None:
    """`drlm cancel` started, and `drlm run` interrupted, at the same moment."""
    server = scripted(lambda request: Reply(text="FINAL(late)", delay_s=CHILD_CALL_S))
    episode_id = f"race-{uuid.uuid4().hex[:6]}"
    run = start_run(tmp_path, "t", "--base-url", server.base_url, "--model", "m", "--id", episode_id)
    wait_for(lambda: len(server.requests) == 1, what="the root model call")
    cancel = subprocess.Popen(
        [DRLM, "cancel", episode_id], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=environ(tmp_path),
    )  # fmt: skip
    run.send_signal(signal.SIGINT)
    run.communicate(timeout=60)
    assert run.returncode in (130, 5)  # interrupted, or it saw the cancel end the episode first
    _, err = cancel.communicate(timeout=90)
    assert cancel.returncode == 0, err
    assert "ended by cancelled" in err and "Traceback" not in err, err
    assert rows(tmp_path)[episode_id]["status"] == "cancelled"
    assert len(server.requests) == 1


def test_ctrl_c_of_a_waiting_cancel_prints_one_line(tmp_path: Path, scripted) -> None:
    server = scripted(lambda request: Reply(text="FINAL(late)", delay_s=CHILD_CALL_S))
    episode_id = f"wait-{uuid.uuid4().hex[:6]}"
    run = start_run(tmp_path, "t", "--base-url", server.base_url, "--model", "m", "--id", episode_id)
    wait_for(lambda: len(server.requests) == 1, what="the root model call")
    run.send_signal(signal.SIGSTOP)
    try:
        for command in (["cancel", episode_id], ["hint", episode_id, "look again"]):
            waiting = subprocess.Popen(
                [DRLM, *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                env=environ(tmp_path),
            )  # fmt: skip
            time.sleep(5)
            waiting.send_signal(signal.SIGINT)
            _, err = waiting.communicate(timeout=30)
            assert waiting.returncode == 130, err
            assert len(err.strip().splitlines()) == 1, err
            assert err.startswith(f"drlm: interrupted before episode {episode_id}"), err
    finally:
        run.send_signal(signal.SIGKILL)
        run.send_signal(signal.SIGCONT)
        run.communicate(timeout=30)


def test_a_steering_command_to_a_busy_worker_returns_and_says_it_waits(tmp_path: Path, scripted) -> None:
    """A live worker that does not answer in time is not called dead, nor competed with: the
    command says the request waits at the server, and the worker applies it when it runs."""
    server = scripted(lambda request: Reply(text="FINAL(done)", delay_s=3 if request.turn == 0 else 0))
    episode_id = f"busy-{uuid.uuid4().hex[:6]}"
    run = start_run(tmp_path, "t", "--base-url", server.base_url, "--model", "m", "--id", episode_id)
    wait_for(lambda: len(server.requests) == 1, what="the root model call")
    run.send_signal(signal.SIGSTOP)
    began = time.monotonic()
    hinted = drlm(tmp_path, "hint", episode_id, "the answer is 42", DRLM_STEER_WAIT_S="4")
    assert time.monotonic() - began < RETURNS_WITHIN_S
    run.send_signal(signal.SIGCONT)
    assert hinted.returncode == 1, hinted.stderr
    assert "has not answered in 4 s; the hint waits at the server for it" in hinted.stderr
    assert "no worker runs" not in hinted.stderr
    _, err = run.communicate(timeout=90)
    assert run.returncode == 0, err
    assert "hint by" in err and "the answer is 42" in err  # applied once the worker ran again


def test_a_hint_to_an_episode_no_worker_runs_is_applied_and_says_what_next(tmp_path: Path, scripted) -> None:
    server = scripted(lambda request: "FINAL(done)")
    episode_id = f"idle-{uuid.uuid4().hex[:6]}"
    started = drlm(tmp_path, "run", "t", "--base-url", server.base_url, "--model", "m", "--id", episode_id,
                   "--no-wait")  # fmt: skip
    assert started.returncode == 0, started.stderr
    began = time.monotonic()
    hinted = drlm(tmp_path, "hint", episode_id, "the answer is 42")
    assert time.monotonic() - began < RETURNS_WITHIN_S
    assert hinted.returncode == 0, hinted.stderr
    assert f"episode {episode_id}: hint accepted" in hinted.stderr
    assert f"no worker runs episode {episode_id}" in hinted.stderr
    assert f"`drlm resume {episode_id}`" in hinted.stderr
    assert server.requests == []  # applied without starting the episode's model call


@pytest.mark.parametrize("extract", [False, True], ids=["plain", "extract"])
def test_a_cancel_with_a_cluster_server_and_no_worker_is_recorded_on_the_server(
    tmp_path: Path, scripted, temporal_address: str, extract: bool
) -> None:
    """With TEMPORAL_ADDRESS the CLI runs no worker: the cancel is Temporal's own, recorded in
    the history at once; the episode ends cancelled when a worker runs it."""
    server = scripted(lambda request: "FINAL(done)")
    episode_id = f"cluster-{uuid.uuid4().hex[:6]}"
    queue = f"nobody-{uuid.uuid4().hex[:6]}"
    env = {"TEMPORAL_ADDRESS": temporal_address, "DRLM_TASK_QUEUE": queue}
    started = drlm(tmp_path, "run", "t", "--base-url", server.base_url, "--model", "m", "--id", episode_id,
                   "--no-wait", **env)  # fmt: skip
    assert started.returncode == 0, started.stderr
    began = time.monotonic()
    args = ("--extract",) if extract else ()
    cancelled = drlm(tmp_path, "cancel", episode_id, *args, **env)
    assert time.monotonic() - began < RETURNS_WITHIN_S
    if extract:
        assert cancelled.returncode == 1
        assert "--extract needs one to extract" in cancelled.stderr
        return
    assert cancelled.returncode == 0, cancelled.stderr
    assert "its cancel is recorded on the server" in cancelled.stderr
    worker = subprocess.Popen(
        [DRLM, "worker"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=environ(tmp_path, **env),
    )  # fmt: skip
    try:
        shown = drlm(tmp_path, "watch", episode_id, "--json", **env)
        assert shown.returncode == 5, shown.stderr
        assert json.loads(shown.stdout)["status"] == "cancelled"
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.communicate(timeout=60)
    assert server.requests == []
