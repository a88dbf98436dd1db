"""Where a worker's CPU goes (the CPU per episode bounds throughput: BENCHMARKS.md): py-spy
samples the worker while it serves bench/concurrency.py's episodes (N at once, 11 model
calls each).

    python bench/profile_worker.py [--n 50] [--latency 0.5] [--rate 250] [--local-model-calls]

Writes `bench/results/worker-profile.svg` (a flame graph) and `worker-profile.txt` (the
collapsed stacks), and prints the worker's CPU per episode and the functions with the most
samples in their own frame and below them, grouped by package (ours, temporalio, pydantic,
sqlalchemy, the standard library, ...). py-spy attaches to the worker's pid once it is ready
(root, or ptrace allowed) and samples from outside the process, only threads holding the GIL
(`--gil`: the Python CPU the GIL bounds); the worker runs as shipped.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import benchlib
from benchlib import RESULTS, say
from concurrency import one_size

PY_SPY = Path(sys.executable).with_name("py-spy")


def package_of(frame: str) -> str:
    """`function (path/to/module.py:line)` -> the package it belongs to."""
    path = frame.rpartition("(")[2]
    for marker, name in (
        ("durable_rlm", "durable_rlm"),
        ("/workflows/", "durable_rlm"),
        ("/activities/", "durable_rlm"),
        ("temporalio", "temporalio"),
        ("pydantic", "pydantic"),
        ("sqlalchemy", "sqlalchemy"),
        ("google/protobuf", "protobuf"),
        ("openai", "openai"),
        ("httpx", "httpx"),
        ("httpcore", "httpx"),
        ("opentelemetry", "opentelemetry"),
        ("zstandard", "zstandard"),
        ("site-packages", "other libraries"),
    ):
        if marker in path:
            return name
    return "standard library"


def summarise(collapsed: Path, top: int) -> None:
    """Own samples by package, and the heaviest frames (own and inclusive)."""
    own_by_package: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        count = int(count_text)
        frames = stack.split(";")
        total += count
        own[frames[-1]] += count
        own_by_package[package_of(frames[-1])] += count
        for frame in set(frames):
            inclusive[frame] += count
    say(f"{total} samples")
    for package, count in own_by_package.most_common():
        say(f"  own time {100 * count / total:5.1f}%  {package}")
    say("heaviest frames, own time:")
    for frame, count in own.most_common(top):
        say(f"  {100 * count / total:5.1f}%  {frame}")
    say("heaviest frames of ours, inclusive:")
    ours = [(f, c) for f, c in inclusive.most_common() if package_of(f) == "durable_rlm"]
    for frame, count in ours[:top]:
        say(f"  {100 * count / total:5.1f}%  {frame}")


async def main(n: int, latency: float, rate: int, top: int, local_model_calls: bool = False) -> None:
    if not PY_SPY.exists():
        raise SystemExit(f"py-spy is not installed ({PY_SPY}): pip install -e '.[bench]'")
    RESULTS.mkdir(parents=True, exist_ok=True)
    collapsed = RESULTS / "worker-profile.txt"
    flame = RESULTS / "worker-profile.svg"
    spies: list[subprocess.Popen] = []
    work = Path(tempfile.mkdtemp(prefix="drlm-profile-"))
    try:
        async with benchlib.bench_env(work) as env:
            started = env.worker_process

            def profiled(task_queue: str, **extra: str) -> benchlib.WorkerProcess:
                worker = started(task_queue, **extra)
                ready = worker.ready

                async def ready_then_sampled(timeout: float = 60) -> benchlib.WorkerProcess:
                    await ready(timeout)  # its start-up (imports, migrations) is not sampled
                    for fmt, out in (("raw", collapsed), ("flamegraph", flame)):
                        spies.append(
                            subprocess.Popen(
                                [str(PY_SPY), "record", "--pid", str(worker.pid), "--rate", str(rate)]
                                + ["--gil", "--format", fmt, "--output", str(out), "--nonblocking"],
                                stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL,
                            )
                        )
                    return worker

                worker.ready = ready_then_sampled  # type: ignore[method-assign]
                return worker

            env.worker_process = profiled  # type: ignore[method-assign]
            row = await one_size(env, n, latency, local_model_calls=local_model_calls)
    finally:
        for spy in spies:
            spy.wait(timeout=60)  # py-spy writes its output when the worker exits
        shutil.rmtree(work, ignore_errors=True)
    cpu_ms = 1000 * row["cpu_s"] / n
    say(f"N={n} at {latency:g} s: wall {row['wall_s']:.1f} s, worker CPU {cpu_ms:.0f} ms per episode")
    say(f"flame graph: {flame}")
    summarise(collapsed, top)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=50)
    parser.add_argument("--latency", type=float, default=0.5)
    parser.add_argument("--rate", type=int, default=250, help="samples per second")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--local-model-calls", action="store_true", help="the model calls as local activities"
    )
    args = parser.parse_args()
    asyncio.run(main(args.n, args.latency, args.rate, args.top, args.local_model_calls))
    sys.stdout.flush()
    os._exit(0)  # temporalio can crash at interpreter exit (sdk-python#300)
