"""Section `containment`: a worker after 20 hostile episodes serves an honest one as before.

    python bench/containment.py [--quick] [--repeats R]

One `worker.py` process (default settings, as root here: the hard case) serves, one after
the other: honest episodes (the baseline: their median wall time and the worker's RSS and
thread count), then every attack of the security model's table (docs/security.md) twice (20
hostile episodes: a FIFO, a link to a root-only file and a link to /dev/zero left where the
host reads the snapshot; a flood of 60 MB frames; a forged frame; `llm_query_batched([''] *
200000)`; a System V message queue and 4 x 32 MB of shared memory; 5 forked children filling
600 MB each; io_uring, memfd and kernel sockets), then honest episodes again. Judged: the
honest episodes' wall time after against before (target: within 20%), the worker's RSS after
against its start (target: within 100 MB), its threads. Each hostile episode must end with
the answer its second turn gives ("survived"): the worker served it whatever its cell did.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path

import benchlib
from benchlib import Context, Section, Target, run_section, say, section_main

from durable_rlm.client.episodes import start_episode
from durable_rlm.scripted import ChatRequest, Reply, ScriptedModelServer
from durable_rlm.store.blobs import digest_of
from durable_rlm.workflows.models import EpisodeLimits, EpisodeRequest, ModelSettings

HONEST = ["```repl\nanswer_is = llm_query('ping')\nprint(answer_is)\n```", "FINAL_VAR(answer_is)"]
LIBC = "import ctypes, struct\nlibc = ctypes.CDLL(None, use_errno=True)\n"
FORGE = (
    "import json, struct, sys, time\nsession = llm_query.__self__\n"
    "SEQ = next(m._SEQ[0] for m in list(sys.modules.values())"
    " if hasattr(m, '_SEQ') and hasattr(m, 'serve'))\n"
    "def forge(message):\n"
    "    body = json.dumps({**message, 'seq': SEQ}).encode()\n"
    "    session.channel_out.write(struct.pack('>I', len(body)) + body)\n"
    "    session.channel_out.flush()\n"
)


def snapshot_plant(plant: str) -> str:
    """A cell that makes the sandbox's snapshot writer leave `plant` where the host reads."""
    return (
        "import os, sys, time\n"
        "snap = next(m for m in list(sys.modules.values())"
        " if hasattr(m, 'take') and hasattr(m, 'SNAPSHOT_PREFIX'))\n"
        f"def take(path, *args):\n    {plant}\n    return {{'size': 1, 'unsaved': {{}}}}\n"
        "snap.take = take\ntime.time()\nprint('planted')"
    )


def attacks(secret: Path) -> dict[str, str]:
    return {
        "snapshot FIFO": snapshot_plant("os.mkfifo(path)"),
        "snapshot link to a root-only file": snapshot_plant(f"os.symlink({str(secret)!r}, path)"),
        "snapshot link to /dev/zero": snapshot_plant("os.symlink('/dev/zero', path)"),
        "frame flood (10 x 60 MB)": FORGE
        + (
            "if session.recorded is None:\n"
            "    forge({'op': 'done', 'status': 'ok', 'stdout': 'flooded'})\n"
            "    big = {'op': 'done', 'status': 'ok', 'stdout': 'x' * (60 << 20)}\n"
            "    for _ in range(10):\n        forge(big)"
        ),
        "forged call frame": FORGE
        + "if session.recorded is None:\n    forge({'op': 'call', 'kind': 'llm_query', 'prompts': [1, 2]})\n"
        "    time.sleep(2)",
        "200,000 prompts in one batch": "r = llm_query_batched([''] * 200_000)",
        "System V message queue": LIBC + f"q = libc.msgget({0x7C000000 + os.getpid() % 0xFFFF}, 0o1666)\n"
        "m = struct.pack('q', 1) + b'canary'\nprint(libc.msgsnd(q, m, len(m) - 8, 0))",
        "4 x 32 MB shared memory": LIBC + "libc.shmat.restype = ctypes.c_void_p\n"
        f"for key in range({0x7B000000 + os.getpid() % 0xFFFF}, {0x7B000000 + os.getpid() % 0xFFFF + 4}):\n"
        "    i = libc.shmget(key, 32 << 20, 0o1666)\n"
        "    if i >= 0:\n        ctypes.memset(libc.shmat(i, None, 0), 1, 32 << 20)",
        "5 children filling 600 MB each": (
            "import os, time\n"
            "for _ in range(5):\n"
            "    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
            "    if pid == 0:\n"
            "        try:\n            held = b'x' * (600 << 20)\n"
            "        except MemoryError:\n            os._exit(1)\n"
            "        time.sleep(30)\n        os._exit(0)\n"
            "time.sleep(2)"
        ),
        "io_uring, memfd, netlink and vsock": LIBC
        + "for fd in (libc.syscall(425, 4, ctypes.create_string_buffer(120)), libc.syscall(319, b'x', 0),"
        " libc.socket(16, 3, 0), libc.socket(40, 1, 0)):\n    print(fd)",
    }


def status(pid: int, field: str) -> int:
    """A field of /proc/PID/status (VmRSS in kB, Threads)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


async def episode(
    env: benchlib.BenchEnv, server: ScriptedModelServer, queue: str, model: str
) -> tuple[str, float]:
    request = EpisodeRequest(
        task="containment",
        root_model=ModelSettings(model=model, base_url=server.base_url),
        limits=EpisodeLimits(max_iterations=4, cell_timeout_s=10),
    )
    started = time.monotonic()
    handle = await start_episode(env.client, request, queue, f"{queue}-{model}-{uuid.uuid4().hex[:6]}")
    result = await asyncio.wait_for(handle.result(), 240)
    return result.answer or "", time.monotonic() - started


async def body(ctx: Context, section: Section) -> None:
    directory = ctx.scratch("containment")
    secret_dir = directory / "private"
    secret_dir.mkdir(mode=0o700)
    secret = secret_dir / "secret"
    secret.write_text(f"secret-{uuid.uuid4().hex}")
    secret.chmod(0o600)
    cells = attacks(secret)
    names = list(cells)[:3] if ctx.quick else list(cells)
    honest_runs = 2 if ctx.quick else 3 * ctx.repeats

    def script(request: ChatRequest) -> Reply | str:
        if not request.is_root:
            return request.last_user.upper()
        if request.model == "honest":
            return HONEST[min(request.turn, 1)]
        attack = cells[names[int(request.model.removeprefix("attack-"))]]
        return f"```repl\n{attack}\n```" if request.turn == 0 else "FINAL(survived)"

    async with benchlib.bench_env(directory) as env:
        queue = f"bench-containment-{uuid.uuid4().hex[:6]}"
        with ScriptedModelServer(script) as server:
            server._server.handle_error = lambda *a: None  # noqa: SLF001 - a killed sandbox's socket
            worker = await env.worker_process(queue).ready()
            try:
                await episode(env, server, queue, "honest")  # warm: the template, the caches
                rss_start, threads_start = status(worker.pid, "VmRSS"), status(worker.pid, "Threads")
                before = []
                for _ in range(honest_runs):
                    answer, seconds = await episode(env, server, queue, "honest")
                    assert answer == "PING", answer
                    before.append(seconds)
                survived = 0
                for round_ in range(2):
                    for index, name in enumerate(names):
                        say(f"containment: attack {round_ * len(names) + index + 1}/{2 * len(names)}: {name}")
                        answer, _ = await episode(env, server, queue, f"attack-{index}")
                        survived += answer == "survived"
                after = []
                for _ in range(honest_runs):
                    answer, seconds = await episode(env, server, queue, "honest")
                    assert answer == "PING", answer
                    after.append(seconds)
                rss_end, threads_end = status(worker.pid, "VmRSS"), status(worker.pid, "Threads")
                try:
                    env.blobs.get(digest_of(secret.read_bytes()))  # stored as a "snapshot"?
                    leaked = True
                except KeyError:
                    leaked = False
            finally:
                worker.stop()
    section.add("honest_before", "honest episode before the attacks", "s", before, baseline=True)
    section.add(
        "honest_after",
        f"honest episode after {2 * len(names)} hostile episodes",
        "s",
        after,
        ratio=benchlib.ratio(benchlib.median(after), benchlib.median(before)),
        ratio_label="after / before",
        target=Target("<=", 1.2, on="ratio", text="within 20% of before"),
    )
    section.add(
        "rss_growth",
        "worker RSS growth over the whole run",
        "MB",
        (rss_end - rss_start) / 1024,
        target=Target("<=", 100.0, text="within 100 MB of its start"),
    )
    section.add("threads", "worker threads, start -> end", "count", [threads_start, threads_end])
    section.add(
        "survived",
        "hostile episodes the worker served to their end",
        "count",
        survived,
        target=Target(">=", 2 * len(names), text="every one"),
    )
    section.notes.append(f"attacks, each twice: {', '.join(names)}")
    if leaked:
        section.notes.append("the root-only file was found in the blob store")


async def run(ctx: Context) -> Section:
    return await run_section("containment", "Containment: a worker after hostile episodes", body, ctx)


if __name__ == "__main__":
    section_main(run, __doc__.splitlines()[0])
