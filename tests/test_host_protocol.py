"""The host trusts no path, size or count a sandbox chose, through real episodes (the
workflow, an in-process worker, its sandboxes, the scripted model server).

Each attack is a cell that changed the sandbox's own code (its modules are reachable from
`sys.modules`, and its channel from `llm_query.__self__`), run with the audit hook on and
off; each is followed by an honest episode on the same worker that must answer right, and
the worker's threads and memory are checked after. (tests/test_host_hardening.py drives
the REPL host directly; tests/test_hostile_episodes.py runs the classic escapes.)
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import uuid
from pathlib import Path

import pytest

from durable_rlm.audit.timeline import episode_timeline
from durable_rlm.scripted import ChatRequest, Reply
from durable_rlm.store.blobs import digest_of
from durable_rlm.workflows import defaults
from durable_rlm.workflows.models import EpisodeLimits, EpisodeResult
from tests.conftest import request_for, run_episode

LIMITS = EpisodeLimits(max_iterations=5, cell_timeout_s=3)

AFTER = "```repl\nprint(llm_query('ping'))\n```"
"""The turn after the attack: the episode's REPL serves it again."""


def status(field: str) -> int:
    """A field of /proc/self/status (kB for sizes): the worker is this process."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class RssPeak:
    """The worker's largest resident size (MB) while the block runs, sampled: the process's
    own peak (getrusage) is over its whole life, so an earlier test's would hide this one's."""

    async def __aenter__(self) -> RssPeak:
        self.start = self.peak = status("VmRSS") / 1024
        self._task = asyncio.create_task(self._sample())
        return self

    async def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, status("VmRSS") / 1024)
            await asyncio.sleep(0.02)

    async def __aexit__(self, *exc: object) -> None:
        self._task.cancel()
        self.peak = max(self.peak, status("VmRSS") / 1024)

    @property
    def growth(self) -> float:
        return self.peak - self.start


def hostile_script(cell: str, think_s: float = 0.0):
    """The attack, then AFTER (`think_s` later: what the attack does meanwhile counts),
    then the answer."""

    def script(request: ChatRequest) -> Reply | str:
        if not request.is_root:
            return request.last_user.upper()
        return [f"```repl\n{cell}\n```", Reply(AFTER, delay_s=think_s), "FINAL(survived)"][
            min(request.turn, 2)
        ]

    return script


def honest_script(request: ChatRequest) -> Reply | str:
    if not request.is_root:
        return request.last_user.upper()
    return ["```repl\nr = llm_query('ping')\n```", "FINAL_VAR(r)"][min(request.turn, 1)]


async def run_hostile(
    client, worker, scripted, cell: str, limits: EpisodeLimits = LIMITS, think_s: float = 0.0
) -> tuple[EpisodeResult, str]:
    episode_id = f"hostile-{uuid.uuid4().hex[:8]}"
    script = scripted(hostile_script(cell, think_s))
    result = await run_episode(client, request_for(script, limits=limits), worker.task_queue, episode_id)
    return result, episode_id


async def first_cell(client, episode_id: str):
    timeline = await episode_timeline(client, episode_id)
    return timeline.iterations[0].cells[0], timeline.iterations[1].cells[0]


POOLS = ("asyncio_", "drlm-sandbox-rm_")
"""Thread pools of the worker that grow to a fixed size on demand: the event loop's default
executor (asyncio.to_thread) and the sandbox directory removers."""


def thread_census() -> int:
    """Threads of the worker outside its bounded pools. The scripted model servers' threads
    (the test's, in this same process) are not the worker's."""
    names = [t.name for t in threading.enumerate()]
    harness = sum(1 for n in names if "(serve_forever)" in n or "(process_request_thread)" in n)
    return status("Threads") - harness - sum(1 for n in names if n.startswith(POOLS))


async def default_executor_is_free() -> None:
    """Every thread of the loop's default executor (the blob store's reads and writes run
    there) is free: as many jobs as it has threads all run at once. A thread blocked for
    ever on a sandbox's FIFO would leave one job waiting, and the barrier broken."""
    size = min(32, (os.cpu_count() or 1) + 4)  # ThreadPoolExecutor's default size
    barrier = threading.Barrier(size, timeout=30)
    await asyncio.gather(*(asyncio.to_thread(barrier.wait) for _ in range(size)))


class Baseline:
    """The worker after one honest episode (its pools and template started): what the
    hostile episodes must leave it at."""

    def __init__(self) -> None:
        self.threads = thread_census()
        self.rss_mb = status("VmRSS") / 1024

    @staticmethod
    async def honest_episode_answers(client, worker, scripted) -> None:
        result = await run_episode(client, request_for(scripted(honest_script)), worker.task_queue)
        assert result.answer == "PING", result

    async def check(self) -> None:
        await default_executor_is_free()
        # Temporal's native runtime adds threads on demand and reaps them when idle: slack for
        # them; a thread kept per hostile episode or attempt would pass it.
        assert thread_census() <= self.threads + 6, (thread_census(), self.threads)
        assert status("VmRSS") / 1024 - self.rss_mb < 100, (status("VmRSS") / 1024, self.rss_mb)


@pytest.fixture(params=[True, False], ids=["hook-on", "hook-off"])
async def hostile_worker(request: pytest.FixtureRequest, worker, client, scripted):
    """The test's worker with the sandbox's audit hook on, then off (the other layers and
    the host's own checks must hold without it), warmed up by an honest episode."""
    worker.config.audit_hook = request.param
    await Baseline.honest_episode_answers(client, worker, scripted)
    worker.baseline = Baseline()
    yield worker


# --- the snapshot the host reads --------------------------------------------------------------


def replace_snapshot_writer(plant: str) -> str:
    """A cell that makes the sandbox's snapshot writer leave `plant` (code over `path`) where
    the host reads the snapshot, and reads the clock so a snapshot follows the cell."""
    return (
        "import os, sys, time\n"
        "snap = next(m for m in list(sys.modules.values())"
        " if hasattr(m, 'take') and hasattr(m, 'SNAPSHOT_PREFIX'))\n"
        "def take(path, *args):\n"
        f"    {plant}\n"
        "    return {'size': 1, 'unsaved': {}}\n"
        "snap.take = take\n"
        "time.time()\n"
        "print('planted')"
    )


async def test_a_fifo_for_a_snapshot_blocks_no_thread(hostile_worker, client, scripted) -> None:
    """os.mkfifo raises no audit event: with the hook on too, the host would open a FIFO
    and wait for ever, one executor thread per attempt, until honest steps starved."""
    cell = replace_snapshot_writer("os.mkfifo(path)")
    runs = [run_hostile(client, hostile_worker, scripted, cell) for _ in range(3)]
    for result, episode_id in await asyncio.gather(*runs):
        assert result.answer == "survived", result
        attack, after = await first_cell(client, episode_id)
        assert attack.stdout.startswith("planted") and after.stdout.startswith("PING")
    await hostile_worker.baseline.honest_episode_answers(client, hostile_worker, scripted)
    await hostile_worker.baseline.check()


async def test_a_link_for_a_snapshot_reads_nothing_of_the_host(
    hostile_worker, client, scripted, blobs, session_dir: Path
) -> None:
    """A symlink to a file only the worker's user may read: the host would have stored it
    as the episode's snapshot (and a link to /dev/zero grew the worker 2 GB in 6 s)."""
    private = session_dir / f"private-{uuid.uuid4().hex[:6]}"
    private.mkdir(mode=0o700)
    secret = private / "secret"
    secret.write_bytes(f"secret-{uuid.uuid4().hex}".encode())
    secret.chmod(0o600)
    for target in (secret, Path("/dev/zero")):
        cell = replace_snapshot_writer(f"os.symlink({str(target)!r}, path)")
        result, episode_id = await run_hostile(client, hostile_worker, scripted, cell)
        assert result.answer == "survived", result
        _, after = await first_cell(client, episode_id)
        assert after.stdout.startswith("PING")
    with pytest.raises(KeyError):
        blobs.get(digest_of(secret.read_bytes()))  # never stored
    await hostile_worker.baseline.honest_episode_answers(client, hostile_worker, scripted)
    await hostile_worker.baseline.check()


# --- frames the sandbox sends -----------------------------------------------------------------

FORGE = """
import json, struct, sys, time
session = llm_query.__self__.calls
SEQ = next(m._SEQ[0] for m in list(sys.modules.values()) if hasattr(m, '_SEQ') and hasattr(m, 'read_frame'))
def forge(message):
    body = json.dumps({**message, 'seq': SEQ}).encode()
    session.channel_out.write(struct.pack('>I', len(body)) + body)
    session.channel_out.flush()
"""


async def test_a_flood_of_large_frames_is_held_within_the_byte_budget(
    hostile_worker, client, scripted
) -> None:
    """The cell's end, then 10 frames of 60 MB nobody asked for: the worker holds at most
    SANDBOX_IN_FLIGHT_BYTES of them (by count, 8 frames and the pipe's buffer were held).
    Only the live run floods: its rebuild (the sandbox spoke unasked) re-runs it quietly."""
    cell = FORGE + (
        "if session.recorded is None:\n"
        "    forge({'op': 'done', 'status': 'ok', 'stdout': 'flooded'})\n"
        "    big = {'op': 'done', 'status': 'ok', 'stdout': 'x' * (60 << 20)}\n"
        "    for _ in range(10):\n"
        "        forge(big)"
    )
    # The model takes 4 s over its next turn: the flood is all written by then, or blocked.
    async with RssPeak() as rss:
        result, episode_id = await run_hostile(client, hostile_worker, scripted, cell, think_s=4)
    assert result.answer == "survived", result
    attack, after = await first_cell(client, episode_id)
    assert attack.stdout.startswith("flooded")
    # The next cell runs in a rebuilt sandbox, or meets the flood first (out of turn).
    assert after.stdout.startswith("PING") or "out of turn" in (after.error or ""), after
    budget_mb = defaults.SANDBOX_IN_FLIGHT_BYTES / 2**20
    # The budget and one frame's copy at most (measured: 64 MB; by count it was 182 MB).
    assert rss.growth < budget_mb + 60, rss.growth
    await hostile_worker.baseline.honest_episode_answers(client, hostile_worker, scripted)
    await hostile_worker.baseline.check()


@pytest.mark.parametrize(
    ("frame", "problem"),
    [
        (
            "{'op': 'call', 'kind': 'llm_query', 'prompts': [1, 2]}",
            "prompts.0: Input should be a valid string",
        ),
        ("{'op': 'call', 'kind': 'llm_query', 'prompts': 'ab'}", "prompts: Input should be a valid array"),
        ("{'op': 'call', 'kind': 7, 'prompts': ['a']}", "kind"),
        ("{'op': 'call', 'kind': 'llm_query', 'prompts': ['a'], 'model': ['m']}", "model"),
        (
            "{'op': 'call', 'kind': 'llm_query_batched', 'prompts': [''] * "
            f"{defaults.MAX_PROMPTS_PER_CALL + 1}}}",
            f"prompts: List should have at most {defaults.MAX_PROMPTS_PER_CALL} items",
        ),
        ("{'op': 'done', 'status': 'ok', 'stdout': ['a']}", "stdout"),
        ("{'op': 'done', 'status': 'killed'}", "status"),
        ("{'op': 'done', 'status': 'ok', 'variables': {'a': 1}}", "variables.a"),
        ("{'op': 'done', 'status': 'ok', 'elapsed': -1}", "elapsed"),
        ("{'op': 'replayed', 'cells': 3}", "cells"),
        ("{'op': 'shell'}", "does not match any of the expected tags"),
    ],
    ids=lambda value: value[:40] if isinstance(value, str) else value,
)
async def test_a_malformed_frame_ends_only_its_cell(
    hostile_worker, client, scripted, frame: str, problem: str
) -> None:
    """Every field of every frame is checked: a forged frame is a protocol error, which the
    cell reports; the episode's next cell runs in a rebuilt sandbox."""
    cell = FORGE + f"if session.recorded is None:\n    forge({frame})\n    time.sleep(2)"
    result, episode_id = await run_hostile(client, hostile_worker, scripted, cell)
    assert result.answer == "survived", result
    attack, after = await first_cell(client, episode_id)
    assert "the sandbox sent a malformed frame" in (attack.error or ""), attack
    assert problem in (attack.error or ""), attack
    assert after.stdout.startswith("PING")
    await hostile_worker.baseline.honest_episode_answers(client, hostile_worker, scripted)
    await hostile_worker.baseline.check()


# --- calls the cell makes ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "refusal"),
    [
        (
            "r = llm_query_batched([''] * 200_000)",
            "llm_query_batched got 200,000 prompts; "
            f"at most {defaults.MAX_PROMPTS_PER_CALL:,} go in one call",
        ),
        (
            "r = llm_query_batched(['x' * (1 << 20)] * 40)",
            f"at most {defaults.MAX_CALL_BYTES:,} go in one call",
        ),
        ("r = llm_query('x' * (40 << 20))", f"at most {defaults.MAX_CALL_BYTES:,} go in one call"),
    ],
    ids=["prompts", "batch bytes", "prompt bytes"],
)
async def test_a_call_past_the_limits_is_refused_in_the_cell(
    hostile_worker, client, scripted, call: str, refusal: str
) -> None:
    """Prompts per call and bytes per call are capped where the call is made: the cell
    reads why, as it reads any refused call, and the workflow never sees the call."""
    result, episode_id = await run_hostile(client, hostile_worker, scripted, call)
    assert result.answer == "survived", result
    attack, after = await first_cell(client, episode_id)
    assert "ValueError" in (attack.error or "") and refusal in (attack.error or ""), attack
    assert after.stdout.startswith("PING")
    assert result.sub_calls == 1  # the ping: the refused call was never made
    await hostile_worker.baseline.honest_episode_answers(client, hostile_worker, scripted)
    await hostile_worker.baseline.check()


def test_the_limits_fit_each_other() -> None:
    """A call the sandbox allows fits in a frame the worker takes whole."""
    from durable_rlm.activities.sandbox.framing import MAX_FRAME_BYTES
    from durable_rlm.activities.sandbox_protocol import FRAME_OVERHEAD

    assert defaults.MAX_CALL_BYTES + FRAME_OVERHEAD < defaults.SANDBOX_IN_FLIGHT_BYTES
    assert defaults.SANDBOX_IN_FLIGHT_BYTES <= MAX_FRAME_BYTES


# --- what the sandbox leaves in its directory --------------------------------------------------


async def test_a_tree_deeper_than_recursion_goes_with_its_sandbox(hostile_worker, client, scripted) -> None:
    """1,500 nested directories (each deeper mkdir is slower in the sandbox: 2,000 took 6 s):
    shutil.rmtree recursed a frame per level and raised RecursionError out of the sandbox's
    close, leaving the tree on the worker's disk."""
    cell = (
        "import os\nfd = os.open('.', os.O_RDONLY)\nfor _ in range(1_500):\n"
        "    os.mkdir('d', dir_fd=fd)\n    inner = os.open('d', os.O_RDONLY, dir_fd=fd)\n"
        "    os.close(fd)\n    fd = inner\nprint('deep')"
    )
    limits = EpisodeLimits(max_iterations=5, cell_timeout_s=30)
    result, episode_id = await run_hostile(client, hostile_worker, scripted, cell, limits)
    assert result.answer == "survived", result
    attack, _ = await first_cell(client, episode_id)
    assert attack.stdout.startswith("deep"), attack.error
    for _ in range(300):  # the episode's end closes its sandbox
        left = [p for p in hostile_worker.home.path.iterdir() if p.name.startswith(episode_id)]
        if not left and episode_id not in hostile_worker.live_episodes():
            break
        await asyncio.sleep(0.1)
    assert not left, left
    await hostile_worker.baseline.honest_episode_answers(client, hostile_worker, scripted)
    await hostile_worker.baseline.check()


# --- a worker process ----------------------------------------------------------------------------


async def test_a_worker_that_served_hostile_episodes_still_drains_on_sigterm(
    client, scripted, worker_processes
) -> None:
    """`python worker.py` after three FIFO attacks: an honest episode answers right, and
    SIGTERM drains it (a thread blocked on a FIFO kept the process alive for ever: the
    loop's executor is joined at exit)."""
    process = worker_processes()
    cell = replace_snapshot_writer("os.mkfifo(path)")
    runs = [
        run_episode(
            client, request_for(scripted(hostile_script(cell)), limits=LIMITS), worker_processes.queue
        )
        for _ in range(3)
    ]
    for result in await asyncio.gather(*runs):
        assert result.answer == "survived", result
    honest = await run_episode(client, request_for(scripted(honest_script)), worker_processes.queue)
    assert honest.answer == "PING", honest
    process.process.send_signal(signal.SIGTERM)
    # A bound on liveness, not a speed: the drain's own grace, and room to close.
    code = await asyncio.to_thread(process.process.wait, defaults.DRAIN_GRACE_S + 30)
    assert code == 0
