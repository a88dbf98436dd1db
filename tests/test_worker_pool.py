"""`python worker.py --processes N`: N worker processes under one supervisor
(docs/guides/production.md): each polls the queue, they share one sandbox budget, a killed
one comes back, and one SIGTERM drains them all."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client

from durable_rlm.scripted import root_and_sub
from durable_rlm.worker.pool import child_environment, process_count
from tests.conftest import ROOT, request_for, run_episode


class Pool:
    """`python worker.py --processes 2`, its stdout read as it comes."""

    def __init__(self, address: str, database_url: str, queue: str, *args: str, **env: str) -> None:
        environ = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "DRLM_"))}
        environ.update(
            TEMPORAL_ADDRESS=address,
            DRLM_DATABASE_URL=database_url,
            DRLM_TASK_QUEUE=queue,
            DRLM_LOG_LEVEL="WARNING",
            **env,
        )
        self.process = subprocess.Popen(
            [sys.executable, str(ROOT / "worker.py"), *args],
            env=environ,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self.errors: list[str] = []
        self._got = threading.Condition()
        for stream, into in ((self.process.stdout, self.lines), (self.process.stderr, self.errors)):
            threading.Thread(target=self._read, args=(stream, into), daemon=True).start()

    def _read(self, stream, into: list[str]) -> None:  # type: ignore[no-untyped-def]
        for line in stream:
            with self._got:
                into.append(line.rstrip("\n"))
                self._got.notify_all()

    def wait_for(self, text: str, timeout: float = 60) -> str:
        with self._got:
            found = self._got.wait_for(lambda: any(text in line for line in self.lines), timeout)
        assert found, (text, self.lines, self.errors[-20:])
        return next(line for line in self.lines if text in line)

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(60)


async def pollers(client: Client, queue: str) -> set[str]:
    reply = await client.workflow_service.describe_task_queue(
        DescribeTaskQueueRequest(
            namespace=client.namespace,
            task_queue=TaskQueue(name=queue),
            task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
        )
    )
    return {p.identity for p in reply.pollers}


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


async def test_two_processes_share_the_budget_survive_a_kill_and_drain_together(
    client: Client, temporal_address: str, session_dir: Path, scripted
) -> None:
    queue = f"pool-{uuid.uuid4().hex[:8]}"
    pool = Pool(
        temporal_address,
        f"sqlite:///{session_dir / 'drlm.sqlite'}",
        queue,
        "--processes",
        "2",
        DRLM_MAX_SANDBOXES="8",
    )
    try:
        ready = pool.wait_for("worker ready")
        assert pool.lines[0] == ready and ready.startswith("worker ready: 2 processes: [1] ")
        children = [int(p) for p in pgrep_children(pool.process.pid)]
        assert len(children) == 2
        # One budget: each child holds half of the 8 sandboxes.
        assert [environ_of(pid)["DRLM_MAX_SANDBOXES"] for pid in children] == ["4", "4"]
        while len(await pollers(client, queue)) < 2:  # both poll the queue (pid@host each)
            await asyncio.sleep(0.2)
        assert {identity.split("@")[0] for identity in await pollers(client, queue)} == {
            str(pid) for pid in children
        }

        server = scripted(root_and_sub(["```repl\nx = llm_query('a')\n```", "FINAL_VAR(x)"], str.upper))
        results = await asyncio.gather(*(run_episode(client, request_for(server), queue) for _ in range(6)))
        assert [r.answer for r in results] == ["A"] * 6

        # One killed: the supervisor restarts it, and episodes go on.
        os.kill(children[0], signal.SIGKILL)
        pool.wait_for("restarted, worker ready")
        assert any("exited with code -9" in line for line in pool.errors), pool.errors[-10:]
        again = await run_episode(client, request_for(server), queue)
        assert again.answer == "A"
    finally:
        code = pool.stop()
    assert code == 0, (pool.lines, pool.errors[-20:])
    (stopped,) = [line for line in pool.lines if line.startswith("worker pool stopped")]
    assert stopped == "worker pool stopped: 2 processes, exit codes [0, 0], 1 restart(s)"
    assert sum("drained" in line for line in pool.lines) == 2, pool.lines  # each child's report


def pgrep_children(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()


def test_processes_auto_is_the_cores_this_process_may_use() -> None:
    assert process_count("auto") == len(os.sched_getaffinity(0))
    assert process_count(" 3 ") == 3
    for bad in ("0", "257", "two", ""):
        with pytest.raises(ValueError, match="--processes"):
            process_count(bad)


def test_each_child_gets_its_share_of_the_sandbox_budget() -> None:
    env = child_environment({"KEEP": "1"}, 3, 1, max_sandboxes=10, budget_mb=1000)
    assert (env["KEEP"], env["DRLM_WORKER_PROCESS"]) == ("1", "2/3")
    assert (env["DRLM_MAX_SANDBOXES"], env["DRLM_SANDBOX_BUDGET_MB"]) == ("3", "333")
    tiny = child_environment({}, 4, 0, max_sandboxes=2, budget_mb=100)
    assert (tiny["DRLM_MAX_SANDBOXES"], tiny["DRLM_SANDBOX_BUDGET_MB"]) == ("1", "64")  # floors
    assert "DRLM_SANDBOX_BUDGET_MB" not in child_environment({}, 2, 0, max_sandboxes=4, budget_mb=None)


def test_a_bad_process_count_is_a_usage_error() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "worker.py"), "--processes", "many"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--processes takes a number or 'auto', not 'many'" in done.stderr


def test_drlm_worker_is_the_same_worker() -> None:
    drlm = Path(sys.executable).parent / "drlm"
    done = subprocess.run(
        [str(drlm), "worker", "--processes", "many"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "drlm worker: error: --processes takes a number" in done.stderr, (
        done.stderr
    )
