"""A worker never stops because nobody reads its output (durable_rlm/telemetry/log_path.py).

Each test runs `python worker.py` as an operator's supervisor might: stdout and stderr are
pipes, read only for the "worker ready" line and never again. A pipe holds 64 KB; a worker
that writes its logs straight to it stops (its event loop, or the SDK core's pollers, block
in a write) once that much is unread. The bounds below are hang detectors, not speed
measurements: the same episodes finish in about 20 s when nothing blocks.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from temporalio.client import Client

from durable_rlm.client.episodes import start_episode
from durable_rlm.scripted import Reply, root_and_sub
from durable_rlm.telemetry.log_path import LogPath
from durable_rlm.workflows.models import EpisodeLimits
from tests.conftest import ROOT, request_for

PIPE_BYTES = 65536  # Linux's default pipe capacity: the most a writer can leave unread
HANG_S = 240  # far beyond the ~20 s these episodes take when nothing blocks


def unread_worker(address: str, database_url: str, queue: str, level: str) -> subprocess.Popen[bytes]:
    """`python worker.py` whose output nobody reads after its first line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "DRLM_"))}
    env.update(
        TEMPORAL_ADDRESS=address,
        DRLM_DATABASE_URL=database_url,
        DRLM_TASK_QUEUE=queue,
        DRLM_LOG_LEVEL=level,
        DRLM_DATA_DIR=os.environ["DRLM_DATA_DIR"],
    )
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "worker.py")],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line.startswith(b"worker ready"), line
    return process


def flaky_sub_calls(failures: int):
    """Every sub-call fails `failures` times with an HTTP 500 before it is answered: each
    failed attempt is logged by the SDK with its traceback (about 2 KB)."""
    seen: dict[str, int] = {}

    def sub(prompt: str) -> Reply:
        seen[prompt] = seen.get(prompt, 0) + 1
        if seen[prompt] <= failures:
            return Reply(status=500, error="overloaded, try again")
        return Reply("answer to " + prompt)

    return sub


def cells(n: int) -> list[str]:
    return [
        *(
            f"```repl\nimport random\nv = llm_query('q{i} ' + str(random.random()))\nprint(len(v))\n```"
            for i in range(n)
        ),
        "FINAL_VAR(v)",
    ]


async def run_unread(
    client: Client,
    scripted,
    temporal_address: str,
    session_dir: Path,
    level: str,
    episodes: int,
    failures: int,
) -> tuple[list[str], int, bytes]:
    """Run `episodes` on an unread worker; then stop it (SIGTERM) and read what it wrote."""
    server = scripted(root_and_sub([*cells(2)], flaky_sub_calls(failures)))
    queue = f"unread-{uuid.uuid4().hex[:8]}"
    worker = unread_worker(temporal_address, f"sqlite:///{session_dir / 'drlm.sqlite'}", queue, level)
    try:
        limits = EpisodeLimits(max_iterations=8, max_llm_calls=40, cell_timeout_s=10)
        request = request_for(server, limits=limits).model_copy(
            update={"root_model": request_for(server).root_model.model_copy(update={"max_attempts": 5})}
        )
        handles = await asyncio.gather(
            *(start_episode(client, request, queue, f"{queue}-{i}") for i in range(episodes))
        )
        results = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), HANG_S)
        worker.send_signal(signal.SIGTERM)  # the drain says what it does on stderr too
        code = await asyncio.to_thread(worker.wait, HANG_S)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert worker.stderr is not None
    return [r.answer for r in results], code, worker.stderr.read()


@pytest.mark.slow  # long end to end (the default run stays near 13 minutes); CI runs it
async def test_a_worker_whose_output_nobody_reads_finishes_a_flood_of_failed_attempts(
    client: Client, scripted, temporal_address: str, session_dir: Path
) -> None:
    # 20 episodes x 2 sub-calls x 3 failed attempts: 120 warnings with tracebacks, ~280 KB
    # as the SDK logs them, four times what the unread pipe holds.
    answers, code, stderr = await run_unread(
        client, scripted, temporal_address, session_dir, "INFO", episodes=20, failures=3
    )

    assert all(a.startswith("answer to q1 ") for a in answers) and len(answers) == 20
    assert code == 0  # the drain, too, never waited on the pipe
    # Every writer was bounded: the pipe never filled, and what was held back is counted.
    assert len(stderr) < PIPE_BYTES // 2, len(stderr)
    text = stderr.decode()
    assert "Completing activity as failed" in text  # the first ones are shown
    assert "more like it suppressed" in text, text[-2000:]


async def test_sdk_core_logs_go_through_the_same_bounded_path(
    client: Client, scripted, temporal_address: str, session_dir: Path
) -> None:
    # At DEBUG the SDK core logs every poll and activation: a flood from Rust threads, which
    # must reach Python's logging (not the process's stdout) and be bounded there.
    answers, code, stderr = await run_unread(
        client, scripted, temporal_address, session_dir, "DEBUG", episodes=5, failures=0
    )

    assert len(answers) == 5 and all(a.startswith("answer to q1 ") for a in answers)
    assert code == 0
    assert len(stderr) < PIPE_BYTES // 2, len(stderr)
    assert "sdk_core" in stderr.decode()  # core's own lines, forwarded


# --- the log path itself ------------------------------------------------------------------------


def logger_on(path: LogPath) -> logging.Logger:
    logger = logging.getLogger(f"test-log-path-{uuid.uuid4().hex[:8]}")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    logger.addHandler(path.handler)
    return logger


def test_logging_never_waits_for_a_stream_nobody_reads() -> None:
    read_end, write_end = os.pipe()
    stream = os.fdopen(write_end, "w")
    path = LogPath(stream, capacity=50, burst=10**9, budget_bytes=10**9)
    logger = logger_on(path)
    try:
        for i in range(2000):  # 2 MB of distinct records into a 64 KB pipe
            logger.warning("record %d: %s", i, "x" * 1000)
        path.close(timeout_s=0.5)  # the writer is stuck in a write: close gives up, it does not hang
        assert path.dropped > 0
    finally:
        os.close(read_end)


def test_repeated_records_are_written_a_few_times_and_counted() -> None:
    stream = io.StringIO()
    path = LogPath(stream, burst=3)
    logger = logger_on(path)
    for i in range(50):  # the same warning about a different task each time
        logger.warning(
            "Activity not found on completion ({'task_token': '%s', 'attempt': %d})", f"{i:032x}", i
        )
    path.close()

    written = stream.getvalue().splitlines()
    assert sum("Activity not found on completion" in line for line in written) == 4  # 3 + the count
    assert path.suppressed == 47
    assert "47 more like it suppressed" in written[-1] and "(3 shown)" in written[-1]


def test_a_window_writes_no_more_than_its_budget() -> None:
    stream = io.StringIO()
    path = LogPath(stream, burst=10**9, budget_bytes=2000)
    logger = logger_on(path)
    for i in range(20):
        logger.error("distinct failure %s: %s", chr(ord("a") + i), "y" * 300)
    path.close()

    records = [line for line in stream.getvalue().splitlines() if "distinct failure" in line]
    assert 0 < len(records) < 20 and sum(len(r) for r in records) <= 2000
    assert path.over_budget == 20 - len(records)
    assert f"{path.over_budget} records not written" in stream.getvalue()


def test_a_long_record_keeps_its_beginning_and_its_end() -> None:
    stream = io.StringIO()
    path = LogPath(stream, record_chars=500)
    logger = logger_on(path)
    try:
        raise ValueError("the cause at the very end")
    except ValueError:
        logger.exception("failed after %s", "z" * 5000)
    path.close()

    text = stream.getvalue()
    assert "failed after zzz" in text and "ValueError: the cause at the very end" in text
    assert "characters cut" in text and len(text) < 700
