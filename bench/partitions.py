"""Section `partitions`: worker processes on task-queue partitions of one server, 1 to 3.

    python bench/partitions.py [--quick] [--merge]

Past one machine, a deployment is worker processes on many hosts, each polling its own task
queue (a partition of the episodes) on one Temporal cluster; nothing of ours is shared
between them but the server and the stores. Here each `worker.py` process polls a task queue
of its own on the one embedded dev server, and gets the same load: PER_WORKER episodes at
once (bench/concurrency.py's episode: 11 model calls at 2 s latency, latency-bound at 22 s).
With 1, 2 and 3 workers (60, 120 and 180 episodes) the figures are the throughput (episodes
a minute) against one worker's, and the CPU per episode of the workers and of the server.

On this 2-core machine the workers and the server share two cores: throughput grows with
workers until the CPU (the server's, or the machine's) is the bound. The server's own
ceiling is measured in the same run: 3 x PER_WORKER no-op workflows with the same events
(concurrency.py `noop_wall`) give the episodes a second that SQLite and the dev server move
when no worker work competes. docs/guides/production.md ("Scaling workers") derives from
these figures the worker processes and server capacity for 10,000 concurrent episodes.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
import uuid

import benchlib
from benchlib import Context, Section, run_section, say, section_main
from concurrency import LATENCY_S, MODEL_CALLS, answered_histories, noop_wall, plan_of, turns
from temporalio.api.enums.v1 import EventType

from durable_rlm.client.episodes import start_episode
from durable_rlm.scripted import Reply, ScriptedModelServer, root_and_sub
from durable_rlm.workflows.models import EpisodeRequest, ModelSettings

PER_WORKER = 60
WORKERS = (1, 2, 3)


async def partitioned(env: benchlib.BenchEnv, workers: int, per_worker: int, latency: float) -> dict:
    """per_worker episodes on each of `workers` worker processes, each on its own queue."""
    tag = uuid.uuid4().hex[:6]
    queues = [f"bench-part-{workers}-{i}-{tag}" for i in range(workers)]
    with ScriptedModelServer(
        root_and_sub(turns(latency), lambda p: Reply("answer to " + p, delay_s=latency))
    ) as server:
        server._server.socket.listen(4096)  # noqa: SLF001 - N connections at once (concurrency.py)
        server._server.handle_error = lambda *a: None  # noqa: SLF001 - replies to callers gone
        procs = [await env.worker_process(q).ready() for q in queues]
        try:
            request = EpisodeRequest(
                task="count", root_model=ModelSettings(model="scripted", base_url=server.base_url)
            )
            server_before = benchlib.tree_cpu_seconds(env.server_pid) if env.server_pid else 0.0
            workers_before = sum(benchlib.tree_cpu_seconds(p.pid) for p in procs)
            started = time.monotonic()
            handles = await asyncio.gather(
                *(
                    start_episode(env.client, request, q, f"{q}-{i}")
                    for q in queues
                    for i in range(per_worker)
                )
            )
            results = await asyncio.gather(*(h.result() for h in handles))
            wall = time.monotonic() - started
            workers_cpu = sum(benchlib.tree_cpu_seconds(p.pid) for p in procs) - workers_before
            server_cpu = (
                (benchlib.tree_cpu_seconds(env.server_pid) - server_before) if env.server_pid else None
            )
        finally:
            for proc in procs:
                proc.stop()
    n = len(handles)
    histories = await answered_histories(env, handles, results)
    timeouts = sum(
        benchlib.count_events(ev, EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT) for ev in histories
    )
    return {
        "workers": workers,
        "n": n,
        "wall_s": wall,
        "per_minute": 60 * n / wall,
        "worker_cpu_ms": 1000 * workers_cpu / n,
        "server_cpu_ms": None if server_cpu is None else 1000 * server_cpu / n,
        "wft_timeouts": timeouts,
        "events": statistics.median(len(ev) for ev in histories),
        "plan": plan_of(histories[0]),
    }


async def body(ctx: Context, section: Section) -> None:
    per_worker = 4 if ctx.quick else PER_WORKER
    latency = 0.5 if ctx.quick else LATENCY_S
    load_before = os.getloadavg()
    rows: dict[int, dict] = {}
    async with benchlib.bench_env(ctx.scratch("partitions")) as env:
        for workers in WORKERS:
            say(f"partitions: {workers} worker process(es), {per_worker} episodes each")
            rows[workers] = await partitioned(env, workers, per_worker, latency)
            say(f"partitions: {rows[workers]['n']} episodes in {rows[workers]['wall_s']:.1f} s")
        ceiling_n = max(WORKERS) * per_worker
        say(f"partitions: {ceiling_n} no-op workflows with the same events (the server's ceiling)")
        noop_s, _ = await noop_wall(env, rows[1]["plan"], ceiling_n)
    ideal = MODEL_CALLS * latency
    one = rows[1]["per_minute"]
    section.add(
        "ideal_s",
        f"latency-bound ideal per episode ({MODEL_CALLS} calls x {latency:g} s)",
        "s",
        ideal,
        baseline=True,
    )
    section.add("rate_1", "1 worker process: episodes a minute", "/min", one, baseline=True)
    for workers in WORKERS[1:]:
        r = rows[workers]
        section.add(
            f"rate_{workers}",
            f"{workers} worker processes, a task queue each: episodes a minute",
            "/min",
            r["per_minute"],
            ratio=benchlib.ratio(r["per_minute"], one),
            ratio_label="of one worker's",
        )
    for workers, r in rows.items():
        section.add(
            f"wall_{workers}", f"{workers} worker(s): wall time of {r['n']} episodes", "s", r["wall_s"]
        )
        section.add(
            f"worker_cpu_{workers}", f"{workers} worker(s): worker CPU per episode", "ms", r["worker_cpu_ms"]
        )
        if r["server_cpu_ms"] is not None:
            section.add(
                f"server_cpu_{workers}",
                f"{workers} worker(s): Temporal server CPU per episode",
                "ms",
                r["server_cpu_ms"],
            )
        section.add(
            f"timeouts_{workers}", f"{workers} worker(s): workflow-task timeouts", "count", r["wft_timeouts"]
        )
    section.add(
        "ceiling",
        f"the dev server alone: {ceiling_n} no-op workflows with the same events, episodes a second",
        "/s",
        ceiling_n / noop_s,
    )
    section.series["partitions"] = {
        str(w): {k: v for k, v in r.items() if k != "plan"} for w, r in rows.items()
    }
    section.series["noop_s"] = noop_s
    section.notes.append(
        f"{rows[1]['events']:g} events per episode; load average before/after: "
        f"{'/'.join(f'{x:.2f}' for x in load_before)}, {'/'.join(f'{x:.2f}' for x in os.getloadavg())}"
    )


async def run(ctx: Context) -> Section:
    return await run_section(
        "partitions", "3c. Worker processes on task-queue partitions of one server", body, ctx
    )


if __name__ == "__main__":
    section_main(run, __doc__, "partitions.py")
