"""`drlm` as a person uses it on a normal day: from several directories, several runs and
readers at once, a worker started elsewhere, a closed pipe, Ctrl-C, a typo in a flag.

Every process here is real: the CLI and worker.py as subprocesses, the shared embedded
Temporal server they start themselves, the scripted model over HTTP.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from durable_rlm.host.processes import running
from durable_rlm.ports import free_port
from durable_rlm.scripted import Reply, root_and_sub
from durable_rlm.settings import Settings
from durable_rlm.worker.runtime import EmbeddedServer, open_stores

ROOT = Path(__file__).resolve().parents[1]
DRLM = str(Path(sys.executable).with_name("drlm"))
SLOW = 0.6  # seconds per scripted reply: long enough to act while an episode runs


def turns(label: str, delay_s: float = 0.0) -> list[Reply]:
    texts = [
        "```repl\nn = len(context.split())\nprint(n)\n```",
        f"```repl\nanswer = '{label}: ' + str(n)\n```",
        "FINAL_VAR(answer)",
    ]
    return [Reply(text=t, delay_s=delay_s) for t in texts]


def environ(home: Path, **extra: str) -> dict[str, str]:
    """A user's environment: no DRLM_DATA_DIR, so the per-user default (platformdirs, under
    XDG_DATA_HOME) decides where data lives, whatever the current directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "TEMPORAL_", "DRLM_"))}
    env.update({"XDG_DATA_HOME": str(home / "xdg"), "DRLM_SERVER_IDLE_S": "2", **extra})
    return env


def data_dir(home: Path) -> Path:
    return home / "xdg" / "drlm"


def start(home: Path, cwd: Path, *args: str, **extra: str) -> subprocess.Popen[str]:
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [DRLM, *args],
        cwd=cwd,
        env=environ(home, **extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # As from a terminal: a test run started in the background (`cmd &` without job
        # control) ignores SIGINT, and Python keeps an ignored SIGINT ignored.
        preexec_fn=_default_sigint,
    )


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def drlm(
    home: Path, cwd: Path, *args: str, timeout: float = 120, **extra: str
) -> subprocess.CompletedProcess[str]:
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [DRLM, *args], cwd=cwd, env=environ(home, **extra), capture_output=True, text=True, timeout=timeout
    )


def wait_for_line(stream, needle: str, timeout_s: float = 60) -> str:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return line
    raise AssertionError(f"{needle!r} not in {''.join(seen)!r}")


def server_state(home: Path) -> dict | None:
    path = data_dir(home) / "server" / "state.json"
    return json.loads(path.read_text()) if path.exists() else None


def wait_server_gone(home: Path, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    state = server_state(home)
    while time.monotonic() < deadline:
        current = server_state(home)
        if current is None and (state is None or not running(state["pid"], state["started"])):
            return
        time.sleep(0.2)
    raise AssertionError(f"the shared server is still up: {server_state(home)}")


@pytest.mark.slow  # long end to end (the default run stays near 13 minutes); CI runs it
def test_two_runs_from_two_directories_readers_and_a_worker_from_a_third(tmp_path: Path, scripted) -> None:
    context = tmp_path / "ctx.txt"
    context.write_text("one two three four")
    quick = scripted(root_and_sub(turns("quick", SLOW)))
    slow = scripted(root_and_sub(turns("slow", 2 * SLOW)))
    run = ("run", "count", "--context", str(context), "--model", "m")
    first = start(tmp_path, tmp_path / "a", *run, "--base-url", quick.base_url, "--id", "ep-quick")
    second = start(tmp_path, tmp_path / "b", *run, "--base-url", slow.base_url, "--id", "ep-slow")
    (tmp_path / "c").mkdir()
    worker = subprocess.Popen(
        [sys.executable, str(ROOT / "worker.py")],
        cwd=tmp_path / "c",
        env=environ(tmp_path, DRLM_LOG_LEVEL="WARNING"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdout is not None
        wait_for_line(worker.stdout, "worker ready")
        # Both episodes started (the first may start after the second: the run that starts
        # the shared server is the slower one), so the listing below has both.
        for run_process in (first, second):
            assert run_process.stderr is not None
            wait_for_line(run_process.stderr, "started on task queue")
        # Readers while both run: a watcher, a listing, a timeline of a running episode.
        watcher = start(tmp_path, tmp_path / "d", "watch", "ep-slow", "--json")
        listing = drlm(tmp_path, tmp_path / "d", "list")
        assert listing.returncode == 0, listing.stderr
        assert "ep-slow" in listing.stdout and "ep-quick" in listing.stdout
        shown = drlm(tmp_path, tmp_path / "e", "show", "ep-slow")
        assert shown.returncode == 0 and "count" in shown.stdout, shown.stderr

        out1, err1 = first.communicate(timeout=120)
        assert first.returncode == 0, err1
        assert out1.strip() == "quick: 4"
        # The first run has ended and left: the second goes on on the same server.
        out2, err2 = second.communicate(timeout=120)
        assert second.returncode == 0, err2
        assert out2.strip() == "slow: 4"
        watched, _ = watcher.communicate(timeout=60)
        assert watcher.returncode == 0 and json.loads(watched)["answer"] == "slow: 4"

        # Only the worker from the third directory is left: it runs the next episode, and
        # finds its context in the same per-user stores.
        third = scripted(root_and_sub(turns("third")))
        started = drlm(
            tmp_path, tmp_path / "a", *run, "--base-url", third.base_url, "--id", "ep-3", "--no-wait"
        )
        assert started.returncode == 0 and started.stdout.strip() == "ep-3", started.stderr
        followed = drlm(tmp_path, tmp_path / "b", "watch", "ep-3", "--json")
        assert followed.returncode == 0, followed.stderr
        assert json.loads(followed.stdout)["answer"] == "third: 4"
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)
    # Every client is gone: the server stops after its idle time, and an ended episode is
    # shown and listed from the store without starting it again.
    wait_server_gone(tmp_path)
    shown = drlm(tmp_path, tmp_path / "f", "show", "ep-quick", "--json")
    assert shown.returncode == 0 and json.loads(shown.stdout)["result"]["answer"] == "quick: 4"
    listing = drlm(tmp_path, tmp_path / "f", "list")
    assert "ep-3" in listing.stdout and "answered" in listing.stdout
    assert server_state(tmp_path) is None


def test_per_user_data_directory_is_private_and_info_says_who_chose_it(tmp_path: Path) -> None:
    out = drlm(tmp_path, tmp_path / "somewhere", "info", "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["data directory"]["value"] == str(data_dir(tmp_path))
    assert info["data directory"]["chosen_by"].startswith("default: the user data directory")
    assert "not running" in info["server"]["value"]
    assert not (tmp_path / "somewhere" / ".drlm").exists()
    moved = drlm(tmp_path, tmp_path, "info", "--json", DRLM_DATA_DIR=str(tmp_path / "elsewhere"))
    assert json.loads(moved.stdout)["data directory"] == {
        "value": str(tmp_path / "elsewhere"),
        "chosen_by": "DRLM_DATA_DIR",
    }

    demo = drlm(tmp_path, tmp_path / "somewhere", "demo", "--json")
    assert demo.returncode == 0, demo.stderr
    home = data_dir(tmp_path)
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    for name in ("drlm.sqlite", "temporal.sqlite", "snapshot.key"):
        assert stat.S_IMODE((home / name).stat().st_mode) == 0o600, name
    for path in (home / "server").rglob("*"):
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path


def test_a_missing_blob_names_the_store_and_the_settings(tmp_path: Path) -> None:
    settings = Settings.from_env({"DRLM_DATA_DIR": str(tmp_path / "other")})
    blobs, _ = open_stores(settings)
    with pytest.raises(KeyError) as caught:
        blobs.get("sha256:" + "0" * 64)
    message = str(caught.value)
    assert str(tmp_path / "other" / "drlm.sqlite") in message
    assert "DRLM_DATA_DIR" in message and "drlm info" in message


def test_a_worker_waits_for_its_server(tmp_path: Path) -> None:
    port = free_port()
    worker = subprocess.Popen(
        [sys.executable, str(ROOT / "worker.py")],
        cwd=tmp_path,
        env=environ(tmp_path, TEMPORAL_ADDRESS=f"127.0.0.1:{port}", DRLM_DATA_DIR=str(tmp_path / "w")),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stderr is not None and worker.stdout is not None
        line = wait_for_line(worker.stderr, "waiting for Temporal")
        assert f"127.0.0.1:{port}" in line and "TEMPORAL_ADDRESS" in line
        assert worker.poll() is None

        async def serve() -> None:
            async with EmbeddedServer(tmp_path / "late.sqlite", port=port):
                await asyncio.to_thread(wait_for_line, worker.stdout, "worker ready", 60)

        asyncio.run(serve())
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)


@pytest.mark.slow  # long end to end (the default run stays near 13 minutes); CI runs it
def test_closed_pipe_ends_quietly(tmp_path: Path, scripted) -> None:
    big = [Reply(text="```repl\nprint('x' * 300_000)\n```"), Reply(text="FINAL(done)")]
    server = scripted(root_and_sub(big))
    ran = drlm(
        tmp_path, tmp_path, "run", "t", "--base-url", server.base_url, "--model", "m", "--id", "big",
        "--output-truncation", "400000",
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    for command in ("show big --json", "show big --full", "list"):
        piped = subprocess.run(
            f"{DRLM} {command} | head -c 10",
            shell=True,
            cwd=tmp_path,
            env=environ(tmp_path),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert piped.stderr == "", (command, piped.stderr)
        assert len(piped.stdout) == 10


@pytest.mark.slow  # long end to end (the default run stays near 13 minutes); CI runs it
def test_ctrl_c_says_the_episode_goes_on_and_resume_finishes_it(tmp_path: Path, scripted) -> None:
    server = scripted(root_and_sub(turns("after", 1.5)))
    episode = f"int-{uuid.uuid4().hex[:6]}"
    (tmp_path / "one.txt").write_text("word")
    running = start(
        tmp_path, tmp_path, "run", "t", "--context", "one.txt", "--base-url", server.base_url, "--model", "m",
        "--id", episode,
    )  # fmt: skip
    assert running.stderr is not None
    wait_for_line(running.stderr, "waiting for the root model")
    running.send_signal(signal.SIGINT)
    _, err = running.communicate(timeout=60)
    assert running.returncode == 130, err
    assert f"episode {episode} goes on" in err
    for hint in (f"drlm watch {episode}", f"drlm resume {episode}", f"drlm cancel {episode}"):
        assert hint in err
    assert "Traceback" not in err
    resumed = drlm(tmp_path, tmp_path, "resume", episode, "--json")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["answer"] == "after: 1"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "t", "--max-iterations", "many"], "drlm run: argument --max-iterations: invalid int value"),
        (["frobnicate"], "drlm: argument command: invalid choice: 'frobnicate'"),
        (["run", "t", "--context", "pipe"], "is a FIFO (named pipe)"),
        (["run", "t", "--context", "latin1.txt"], "context file is not UTF-8 text"),
    ],
)
def test_bad_flags_and_files_are_one_line_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    os.mkfifo(tmp_path / "pipe")
    out = (
        drlm(tmp_path, tmp_path, *args, "--base-url", "http://127.0.0.1:9/v1", "--model", "m")
        if args[0] == "run"
        else drlm(tmp_path, tmp_path, *args)
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and message in out.stderr, out.stderr
    assert server_state(tmp_path) is None  # nothing was started


def test_an_unreadable_context_file_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from durable_rlm.client.episodes import read_context_text
    from durable_rlm.settings import ConfigurationError

    path = tmp_path / "secret.txt"
    path.write_text("x")

    real_open = os.open

    def refuse(target: object, *args: object, **kwargs: object) -> int:
        if str(target) == str(path):  # root reads any file: the refusal a user would meet
            raise PermissionError(13, "Permission denied")
        return real_open(target, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(ConfigurationError, match="cannot read context file .*secret.txt: Permission denied"):
        read_context_text(path)


def test_a_duplicate_id_is_refused(tmp_path: Path, scripted) -> None:
    server = scripted(root_and_sub(["FINAL(one)"]))
    run = ("run", "t", "--base-url", server.base_url, "--model", "m", "--id", "twice")
    assert drlm(tmp_path, tmp_path, *run).returncode == 0
    again = drlm(tmp_path, tmp_path, *run)
    assert again.returncode == 2
    assert again.stderr.strip() == (
        "drlm: episode id 'twice' is already used: choose another id, or see it with `drlm show twice`"
    )


def test_an_unreachable_cluster_is_one_line_exit_1(tmp_path: Path) -> None:
    out = drlm(tmp_path, tmp_path, "watch", "x", TEMPORAL_ADDRESS=f"127.0.0.1:{free_port()}")
    assert out.returncode == 1
    assert (
        out.stderr.startswith("drlm: cannot reach Temporal at 127.0.0.1:")
        and "(TEMPORAL_ADDRESS)" in out.stderr
    )
    assert out.stderr.count("\n") == 1


@pytest.mark.slow  # long end to end (the default run stays near 13 minutes); CI runs it
def test_a_wrong_key_pauses_the_run_and_resume_with_the_right_one_finishes_it(
    tmp_path: Path, scripted
) -> None:
    server = scripted(root_and_sub(turns("keyed")), api_key="sk-right")
    (tmp_path / "ctx.txt").write_text("a b c")
    ran = drlm(
        tmp_path, tmp_path, "run", "t", "--context", "ctx.txt", "--base-url", server.base_url, "--model", "m",
        "--id", "keyed", "--api-key", "sk-wrong",
    )  # fmt: skip
    assert ran.returncode == 6, ran.stderr
    paused = [line for line in ran.stderr.splitlines() if line.startswith("episode keyed paused:")]
    assert paused and "authentication failed" in paused[0] and "drlm resume keyed" in paused[0], ran.stderr
    assert "OPENAI_API_KEY" in paused[0]
    # Still wrong: it pauses again, nothing is lost.
    again = drlm(tmp_path, tmp_path, "resume", "keyed", "--api-key", "sk-also-wrong")
    assert again.returncode == 6, again.stderr
    resumed = drlm(tmp_path, tmp_path, "resume", "keyed", "--json", OPENAI_API_KEY="sk-right")
    assert resumed.returncode == 0, resumed.stderr
    result = json.loads(resumed.stdout)
    assert result["answer"] == "keyed: 3"
    assert result["iterations"] == 3  # the refused calls cost no iteration
