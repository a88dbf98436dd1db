"""Section `concurrency`: N concurrent episodes on ONE worker process.

    python bench/concurrency.py [--quick] [--repeats R]

`worker.py` runs as a subprocess against the embedded dev server (as shipped); the model is
the scripted server in this process with 2 s of latency per call. Each episode: five
iterations of one root call + one cell making one `llm_query`, then a reply with
FINAL_VAR (11 model calls: the latency-bound ideal is 22 s, whatever N).

Baselines, measured in the same run:
- latency-bound ideal: 11 calls x 2 s (the episode's model time; no engine, no server);
- server-bound: a no-op workflow (defined here, run by a worker in this process, unsandboxed)
  that makes the same sequence of activities, local activities, patch markers and timers as
  one measured episode, so its history has (nearly) the same events; N of them at once on
  the same server. That is what the server alone takes to move N such histories.

The worker's output (stdout and stderr) is filed in the bench's directory, all of it, as it
is written (benchlib.WorkerProcess): a pipe read only for "worker ready" once filled and
stopped the worker. Its size per minute is a figure.

Also: workflow-task timeouts (WorkflowTaskTimedOut events across the N histories), the
worker's CPU time and RSS (its process and descendants, from /proc), and memory per live
sandbox (unique set size, Private_Clean + Private_Dirty from smaps_rollup, of the worker's
descendant processes, sampled every second; the sample with most live sandboxes counts).
"""

from __future__ import annotations

import asyncio
import collections
import statistics
import time
import uuid
from datetime import timedelta

import benchlib
from benchlib import Context, Section, Target, ratio, run_section, say, section_main
from temporalio import activity, workflow
from temporalio.api.enums.v1 import EventType, TimeoutType
from temporalio.api.failure.v1 import Failure
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from durable_rlm.client.episodes import start_episode
from durable_rlm.scripted import Reply, ScriptedModelServer, root_and_sub
from durable_rlm.workflows import names
from durable_rlm.workflows.models import DurabilitySettings, EpisodeRequest, ModelSettings

CELLS = 5
MODEL_CALLS = 2 * CELLS + 1
SIZES = (200, 400, 1000)  # 400 and 1,000: far past one worker's capacity (admission control)
LATENCY_S = 2.0
TARGET_N = 200
TARGET_WALL_S = 38.0
TARGET_SERVER_SHARE = 0.8
TARGET_SANDBOX_MB = 8.0


def turns(delay_s: float) -> list[Reply]:
    cells = [f"```repl\nv{i} = llm_query('question {i}')\nprint(len(v{i}))\n```" for i in range(CELLS)]
    return [Reply(text=t, delay_s=delay_s) for t in [*cells, f"FINAL_VAR(v{CELLS - 1})"]]


# --- the no-op workflow: the server-bound baseline ----------------------------------------------


@activity.defn(name="bench_noop")
async def noop_activity(step: int) -> int:
    return step


@workflow.defn(name="BenchNoop", sandboxed=False)
class NoopWorkflow:
    """Makes the given steps one after the other: 'a' an activity, 'l' a local activity,
    'p' a patch marker, 't' a long timer (cancelled at the end), as the episode did."""

    @workflow.run
    async def run(self, plan: str) -> int:
        timers = []
        for i, step in enumerate(plan):
            if step == "a":
                await workflow.execute_activity(
                    noop_activity, i, start_to_close_timeout=timedelta(seconds=60)
                )
            elif step == "l":
                await workflow.execute_local_activity(
                    noop_activity, i, start_to_close_timeout=timedelta(seconds=60)
                )
            elif step == "p":
                workflow.patched(f"bench-{i}")
            elif step == "t":
                timers.append(asyncio.ensure_future(asyncio.sleep(3600)))
                await asyncio.sleep(0)  # let the timer command go out with this task
        for timer in timers:
            timer.cancel()
        return len(plan)


def plan_of(events: list) -> str:
    """The episode's steps, in history order, as a no-op plan."""
    plan = []
    for e in events:
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            plan.append("a")
        elif e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED:
            name = e.marker_recorded_event_attributes.marker_name
            plan.append("p" if "patch" in name else "l")
        elif e.event_type == EventType.EVENT_TYPE_TIMER_STARTED:
            plan.append("t")
    return "".join(plan)


async def noop_wall(env: benchlib.BenchEnv, plan: str, n: int) -> tuple[float, int]:
    """Wall time of n no-op workflows at once, and the events of one."""
    queue = f"bench-noop-{uuid.uuid4().hex[:6]}"
    worker = Worker(
        env.client,
        task_queue=queue,
        workflows=[NoopWorkflow],
        activities=[noop_activity],
        workflow_runner=UnsandboxedWorkflowRunner(),
        max_concurrent_workflow_tasks=max(100, n),
        max_concurrent_activities=max(100, n),
        max_concurrent_local_activities=max(100, n),
        max_cached_workflows=max(1000, 2 * n),
    )
    task_timeout = timedelta(seconds=DurabilitySettings().task_timeout_s)  # as episodes get it
    async with worker:
        # warm-up: one no-op alone
        await env.client.execute_workflow(NoopWorkflow.run, plan, id=f"noop-warm-{queue}", task_queue=queue)
        started = time.monotonic()
        handles = await asyncio.gather(
            *(
                env.client.start_workflow(
                    NoopWorkflow.run,
                    plan,
                    id=f"noop-{queue}-{i}",
                    task_queue=queue,
                    task_timeout=task_timeout,
                )
                for i in range(n)
            )
        )
        await asyncio.gather(*(h.result() for h in handles))
        wall = time.monotonic() - started
    events = await benchlib.histories(env.client, handles[0].id, handles[0].first_execution_run_id)
    return wall, len(events)


def failure_kind(failure: Failure) -> str:
    """What a retried attempt failed with, in a few words."""
    if failure.HasField("timeout_failure_info"):
        kind = TimeoutType.Name(failure.timeout_failure_info.timeout_type)
        return kind.removeprefix("TIMEOUT_TYPE_").lower().replace("_", "-") + " timeout"
    if failure.HasField("application_failure_info"):
        return failure.application_failure_info.type or "application error"
    return (failure.message or "unknown")[:40]


def quantile(values: list[float], q: float) -> float:
    """The value below which a fraction `q` of `values` lies (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def model_call_overheads(all_events: list[list], latency: float) -> list[float]:
    """Per model-call attempt that completed: from the server handing it out (its
    ActivityTaskStarted event's time) to the server recording its completion, less the model's
    scripted latency. The heartbeat and start-to-close clocks run from the hand-out, so this is
    what a call's timeouts see beyond the model. (Measured 2026-11-29, N=200: model-call tasks
    reached the worker's Python code a median 1.1-1.9 s after the hand-out while a start from
    another process took the same server 18 ms: BENCHMARKS.md, "Overload on 2026-11-29".)"""
    model = {names.ROOT_COMPLETION, names.SUB_QUERY}
    overheads: list[float] = []
    for events in all_events:
        scheduled: set[int] = set()
        started: dict[int, float] = {}
        for e in events:
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                if e.activity_task_scheduled_event_attributes.activity_type.name in model:
                    scheduled.add(e.event_id)
            elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
                attrs = e.activity_task_started_event_attributes
                if attrs.scheduled_event_id in scheduled:
                    started[attrs.scheduled_event_id] = e.event_time.ToDatetime().timestamp()
            elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
                done = e.activity_task_completed_event_attributes.scheduled_event_id
                if done in started:
                    overheads.append(e.event_time.ToDatetime().timestamp() - started[done] - latency)
    return overheads


# --- sampling the worker --------------------------------------------------------------------------


class Sampler:
    """The worker process tree, every `every_s`: live descendants, their unique memory, RSS."""

    def __init__(self, pid: int, every_s: float = 1.0) -> None:
        self.pid = pid
        self.every_s = every_s
        self.peak_live = 0
        self.peak_uss_kb: list[int] = []  # of each descendant, at the sample with most of them
        self.peak_sandbox_cmdlines = 0
        self.peak_templates = 0
        self.peak_template_uss_kb = 0
        self.peak_tree_rss_kb = 0
        self.samples: list[tuple[float, int, int]] = []  # (t, live descendants, tree rss kb)
        self._task: asyncio.Task | None = None

    def sample(self) -> None:
        tree = benchlib.children_map()
        below = benchlib.descendants(self.pid, tree)
        # Sandboxes run no processes of their own: the leaves are sandboxes; a descendant with
        # children is a template that forks them (its pages are shared with them).
        sandboxes = [p for p in below if not tree.get(p)]
        templates = [p for p in below if tree.get(p)]
        uss = [u for u in (benchlib.uss_kb(p) for p in sandboxes) if u is not None]
        rss = benchlib.status_kb(self.pid, "VmRSS") + sum(benchlib.status_kb(p, "VmRSS") for p in below)
        self.samples.append((time.monotonic(), len(uss), rss))
        self.peak_tree_rss_kb = max(self.peak_tree_rss_kb, rss)
        if len(uss) >= self.peak_live and uss:
            self.peak_live = len(uss)
            self.peak_uss_kb = uss
            self.peak_templates = len(templates)
            self.peak_template_uss_kb = sum(benchlib.uss_kb(p) or 0 for p in templates)
            self.peak_sandbox_cmdlines = sum(
                1 for p in sandboxes if "activities/sandbox" in benchlib.cmdline(p)
            )

    async def _loop(self) -> None:
        while True:
            await asyncio.to_thread(self.sample)
            await asyncio.sleep(self.every_s)

    def __enter__(self) -> Sampler:
        self._task = asyncio.create_task(self._loop())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


def admission_said(log: str) -> str:
    """What the worker's admission said (durable_rlm/worker/admission.py): how often it stopped
    taking new episodes, and its last state."""
    said = [
        line.split("durable_rlm.worker.admission: ", 1)[1]
        for line in log.splitlines()
        if "durable_rlm.worker.admission: " in line
    ]
    stopped = sum(1 for line in said if line.startswith("overloaded"))
    return f"stopped taking new episodes {stopped} times; last: {said[-1]}" if said else ""


# --- one size ---------------------------------------------------------------------------------------


async def answered_histories(env: benchlib.BenchEnv, handles: list, results: list) -> list[list]:
    """The episodes' histories, once every one of them is checked to have answered right."""
    bad = [r for r in results if r.answer != f"answer to question {CELLS - 1}"]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(results)} episodes answered wrongly, e.g. {bad[0]}")
    return await asyncio.gather(
        *(benchlib.histories(env.client, h.id, h.first_execution_run_id) for h in handles)
    )


async def one_size(
    env: benchlib.BenchEnv, n: int, latency: float, processes: int = 1, local_model_calls: bool = False
) -> dict:
    """N episodes at once on one `worker.py` (of `processes` worker processes: bench/processes.py);
    `local_model_calls`: the model calls as local activities (DurabilitySettings)."""
    queue = f"bench-conc-{n}-{uuid.uuid4().hex[:6]}"
    with ScriptedModelServer(
        root_and_sub(turns(latency), lambda p: Reply("answer to " + p, delay_s=latency))
    ) as server:
        # N connections may arrive at once; socketserver listens with a backlog of 5, and a
        # dropped SYN costs a 1 s retransmit. Widen it (Linux updates a listening socket).
        server._server.socket.listen(4096)  # noqa: SLF001
        # A reply written after the caller gave up (an attempt timed out or was cancelled) is
        # counted, not printed.
        abandoned = [0]
        server._server.handle_error = lambda *a: abandoned.__setitem__(0, abandoned[0] + 1)  # noqa: SLF001
        worker = await env.worker_process(queue, DRLM_WORKER_PROCESSES=str(processes)).ready()
        try:
            request = EpisodeRequest(
                task="count",
                root_model=ModelSettings(model="scripted", base_url=server.base_url),
                durability=DurabilitySettings(local_model_calls=local_model_calls),
            )
            cpu_before = benchlib.tree_cpu_seconds(worker.pid)
            # Beside the worker's: the Temporal server's and this process's (the model server
            # and the client starting and awaiting the episodes), on the same 2 cores.
            server_before = benchlib.tree_cpu_seconds(env.server_pid) if env.server_pid else 0.0
            bench_before = time.process_time()
            with Sampler(worker.pid) as sampler:
                started = time.monotonic()
                handles = await asyncio.gather(
                    *(start_episode(env.client, request, queue, f"{queue}-{i}") for i in range(n))
                )
                results = await asyncio.gather(*(h.result() for h in handles))
                wall = time.monotonic() - started
            cpu = benchlib.tree_cpu_seconds(worker.pid) - cpu_before
            server_cpu = benchlib.tree_cpu_seconds(env.server_pid) - server_before if env.server_pid else None
            bench_cpu = time.process_time() - bench_before
            model_requests = len(server.requests)
            worker_hwm_kb = benchlib.status_kb(worker.pid, "VmHWM")
        finally:
            worker.stop()
        output_bytes = worker.output_bytes()
        # What the worker's log path held back (suppressed, over budget, dropped), in its words.
        held_back = [
            line.split("drlm.logs: ", 1)[1]
            for line in worker.tail(10**7).splitlines()
            if "drlm.logs: " in line
        ]
    all_events = await answered_histories(env, handles, results)
    wft_timeouts = sum(
        benchlib.count_events(ev, EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT) for ev in all_events
    )
    # start-to-close: a task taken and not completed in time (work done too late, thrown away);
    # schedule-to-start: a task that waited on this worker's sticky queue past its 1 s, and went
    # back to the shared queue (waited, nothing lost).
    wft_timeout_kinds = collections.Counter(
        TimeoutType.Name(e.workflow_task_timed_out_event_attributes.timeout_type)
        .removeprefix("TIMEOUT_TYPE_")
        .lower()
        .replace("_", "-")
        for ev in all_events
        for e in ev
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT
    )
    wft_failed = sum(
        benchlib.count_events(ev, EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED) for ev in all_events
    )
    act_timeouts = sum(
        benchlib.count_events(ev, EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT) for ev in all_events
    )
    retries, causes = 0, collections.Counter()
    for ev in all_events:
        for e in ev:
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
                attrs = e.activity_task_started_event_attributes
                if attrs.attempt > 1:
                    retries += attrs.attempt - 1
                    causes[failure_kind(attrs.last_failure)] += 1
    events = [len(ev) for ev in all_events]
    overheads = model_call_overheads(all_events, latency)
    plan = plan_of(all_events[0])
    say(f"concurrency: N={n} episodes {wall:.1f} s; now {n} no-op workflows ({len(plan)} steps each)")
    noop, noop_events = await noop_wall(env, plan, n)
    uss_mb = [u / 1024 for u in sampler.peak_uss_kb]
    return {
        "n": n,
        "wall_s": wall,
        "noop_wall_s": noop,
        "events_per_episode": statistics.median(events),
        "noop_events": noop_events,
        "wft_timeouts": wft_timeouts,
        "wft_late": wft_timeout_kinds.get("start-to-close", 0),
        "wft_timeout_kinds": dict(wft_timeout_kinds),
        "wft_failed": wft_failed,
        "activity_timeouts": act_timeouts,
        "activity_retries": retries,
        "retry_causes": dict(causes),
        "call_overhead_s": {
            "median": statistics.median(overheads),
            "p90": quantile(overheads, 0.9),
            "p99": quantile(overheads, 0.99),
            "max": max(overheads),
        }
        if overheads
        else None,
        "extra_model_requests": model_requests - n * MODEL_CALLS,
        "abandoned_requests": abandoned[0],
        "cpu_s": cpu,
        "server_cpu_s": server_cpu,
        "bench_cpu_s": bench_cpu,
        "output_bytes": output_bytes,
        "held_back": held_back,
        "admission": admission_said(worker.tail(10**7)),
        "worker_peak_rss_mb": worker_hwm_kb / 1024,
        "tree_peak_rss_mb": sampler.peak_tree_rss_kb / 1024,
        "peak_live": sampler.peak_live,
        "peak_sandbox_cmdlines": sampler.peak_sandbox_cmdlines,
        "templates": sampler.peak_templates,
        "template_uss_mb": sampler.peak_template_uss_kb / 1024,
        "uss_mb": uss_mb,
        "live_over_time": [(round(t - started, 1), live) for t, live, _ in sampler.samples],
    }


async def body(ctx: Context, section: Section) -> None:
    sizes = (5,) if ctx.quick else SIZES
    latency = 0.5 if ctx.quick else LATENCY_S
    ideal = MODEL_CALLS * latency
    rows = []
    async with benchlib.bench_env(ctx.scratch("concurrency")) as env:
        for n in sizes:
            say(f"concurrency: N={n} episodes at {latency:g} s latency (ideal {ideal:g} s)")
            rows.append(await one_size(env, n, latency))
    section.series["concurrency"] = {
        "latency_s": latency,
        "ideal_s": ideal,
        "rows": [{k: v for k, v in r.items() if k != "uss_mb"} for r in rows],
    }
    section.add(
        "ideal_s", f"latency-bound ideal ({MODEL_CALLS} calls x {latency:g} s)", "s", ideal, baseline=True
    )
    largest = max(sizes)
    for r in rows:
        n = r["n"]
        judged = n == largest
        at_target = n == TARGET_N
        bound = max(ideal, r["noop_wall_s"])
        section.add(
            f"noop_wall_{n}",
            f"N={n}: {n} no-op workflows, same events (server-bound)",
            "s",
            r["noop_wall_s"],
            baseline=True,
            note=f"{r['noop_events']} events each (episodes: {r['events_per_episode']:.0f})",
        )
        section.add(
            f"wall_{n}",
            f"N={n}: wall time of {n} episodes",
            "s",
            r["wall_s"],
            ratio=ratio(r["wall_s"], ideal),
            ratio_label="of ideal",
            target=Target("<=", TARGET_WALL_S, text=f"<= {TARGET_WALL_S:g} s") if at_target else None,
        )
        section.add(
            f"rate_{n}",
            f"N={n}: episodes per minute",
            "count",
            60 * n / r["wall_s"],
            ratio=ratio(ideal, r["wall_s"]),
            ratio_label=f"of the ideal {60 * n / ideal:.0f}/min",
        )
        section.add(
            f"server_share_{n}",
            f"N={n}: rate / server-bound rate (no-op wall / wall)",
            "%",
            100 * r["noop_wall_s"] / r["wall_s"],
        )
        section.add(
            f"bound_share_{n}",
            f"N={n}: rate / best bound (max(ideal, no-op) / wall)",
            "%",
            100 * bound / r["wall_s"],
            target=Target(">=", 100 * TARGET_SERVER_SHARE, text=f">= {TARGET_SERVER_SHARE:.0%}")
            if at_target
            else None,
        )
        section.add(
            f"wft_timeouts_{n}",
            f"N={n}: workflow-task timeouts (all histories)",
            "count",
            r["wft_timeouts"],
            target=Target("<=", 0, on="max", text="0") if at_target else None,
            note="by kind: "
            + (", ".join(f"{k} x{v}" for k, v in sorted(r["wft_timeout_kinds"].items())) or "none")
            + f"; workflow-task failures {r['wft_failed']}",
        )
        late_activities = r["activity_timeouts"] + sum(
            v for k, v in r["retry_causes"].items() if k.endswith("timeout")
        )
        section.add(
            f"late_{n}",
            f"N={n}: tasks past their timeout (workflow tasks start-to-close + activity attempts)",
            "count",
            r["wft_late"] + late_activities,
            target=Target("<=", 0, on="max", text="0") if judged else None,
            note=f"workflow tasks {r['wft_late']}, activity attempts {late_activities}; the worker's "
            f"admission: {r['admission'] or 'never overloaded'}",
        )
        section.add(
            f"retries_{n}",
            f"N={n}: activity attempts retried (all histories)",
            "count",
            r["activity_retries"],
            note=f"model requests beyond {MODEL_CALLS} per episode: {r['extra_model_requests']}; "
            f"replies the caller had given up on: {r['abandoned_requests']}"
            + (
                "; last failure before the attempt that succeeded: "
                + ", ".join(f"{k} x{v}" for k, v in sorted(r["retry_causes"].items()))
                if r["retry_causes"]
                else ""
            ),
        )
        if r.get("call_overhead_s"):
            o = r["call_overhead_s"]
            section.add(
                f"call_overhead_{n}",
                f"N={n}: a model call's attempt, handed out to completed, beyond the model (median)",
                "s",
                o["median"],
                note=f"p90 {o['p90']:.2f} s, p99 {o['p99']:.2f} s, max {o['max']:.2f} s: what the "
                "call's heartbeat and start-to-close clocks see beyond the model's own time",
            )
        section.add(f"cpu_{n}", f"N={n}: worker CPU time (process + sandboxes)", "s", r["cpu_s"])
        section.add(
            f"output_{n}",
            f"N={n}: worker output per minute (stdout + stderr, filed by the bench)",
            "KB",
            r["output_bytes"] / 1024 / (r["wall_s"] / 60),
            note=f"{r['output_bytes'] / 1024:.1f} KB in all at DRLM_LOG_LEVEL=WARNING"
            + (f"; held back: {'; '.join(r['held_back'][:3])}" if r["held_back"] else ""),
        )
        section.add(f"cpu_per_episode_{n}", f"N={n}: worker CPU per episode", "ms", 1000 * r["cpu_s"] / n)
        section.add(f"rss_{n}", f"N={n}: worker peak RSS (its own process)", "MB", r["worker_peak_rss_mb"])
        section.add(f"tree_rss_{n}", f"N={n}: peak RSS, worker + sandboxes", "MB", r["tree_peak_rss_mb"])
        section.add(
            f"memory_per_episode_{n}",
            f"N={n}: worker memory per episode (peak RSS of worker + sandboxes / N)",
            "MB",
            r["tree_peak_rss_mb"] / n,
            note="RSS counts the pages forked sandboxes share with their template once per sandbox",
        )
        if r["uss_mb"]:
            section.add(
                f"unique_memory_per_episode_{n}",
                f"N={n}: worker memory per episode, shared pages once (worker RSS + sandboxes' USS) / N",
                "MB",
                (r["worker_peak_rss_mb"] + sum(r["uss_mb"]) + r["template_uss_mb"]) / n,
            )
        section.add(f"live_{n}", f"N={n}: most live sandboxes at once", "count", r["peak_live"])
        if r["uss_mb"]:
            section.add(
                f"sandbox_uss_{n}",
                f"N={n}: unique memory per live sandbox (median of {len(r['uss_mb'])})",
                "MB",
                r["uss_mb"],
                target=Target("<=", TARGET_SANDBOX_MB, text=f"<= {TARGET_SANDBOX_MB:g} MB")
                if judged
                else None,
                note=f"{r['peak_sandbox_cmdlines']} of them run activities/sandbox; template processes: "
                f"{r['templates']}, {r['template_uss_mb']:.1f} MB unique; with the template's share: "
                f"{(sum(r['uss_mb']) + r['template_uss_mb']) / len(r['uss_mb']):.1f} MB per sandbox",
            )
    section.notes.append(
        f"episodes: {CELLS} x (root call + cell with one llm_query) + FINAL_VAR, {latency:g} s per "
        "model call; one worker.py process with its shipped settings; one run per N (min/max of the "
        "memory figure are over the sandboxes)"
    )
    section.notes.append(
        "rate / best bound: the wall time the slower of the two baselines allows, over the wall time "
        "measured (100% = as fast as model latency or the server allows); the server-bound rate alone "
        "is printed too"
    )


async def run(ctx: Context) -> Section:
    return await run_section("concurrency", "3. Concurrent episodes on one worker process", body, ctx)


if __name__ == "__main__":
    section_main(run, __doc__)
