"""Section `recovery`: how long an episode waits after its only worker is SIGKILLed.

    python bench/recovery.py [--quick] [--repeats R]

An episode (six iterations of one root call + one cell making one `llm_query`, then FINAL)
runs on one `worker.py` subprocess against the embedded dev server; the scripted model takes
500 ms per call. During the third root call the worker is SIGKILLed and a new one is
started at once. The history is polled for the next completed step after the kill (an
ActivityTaskCompleted, or a MarkerRecorded of a local activity: REPL steps may run as local
activities). Reported: the time from the new worker's start (its process being started)
to that step, from the new worker being ready, and from the kill.

The model call that was cut off is retried as soon as a worker on the same machine sees the
killed worker's lock free (durable_rlm/worker/liveness.py: the new worker looks as it
starts): its attempt is failed as `WorkerLost` and retried at once. Without that signal (the
new worker on another machine: here, another data directory) the server notices only when
the call's heartbeat timeout expires (a call this short never heartbeats, so the timeout runs
from its start): `DurabilitySettings.heartbeat_timeout_s`, 10 s as shipped (5 s before
2026-11-29). Both are measured
in the same run; the target is the first's.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import benchlib
from benchlib import Context, Section, Target, run_section, say, section_main
from temporalio.api.enums.v1 import EventType

from durable_rlm.client.episodes import start_episode
from durable_rlm.scripted import ChatRequest, Reply, ScriptedModelServer, root_and_sub
from durable_rlm.workflows import defaults
from durable_rlm.workflows.models import DurabilitySettings, EpisodeRequest, ModelSettings

LATENCY_S = 0.5
ITERATIONS = 6
KILL_AT_TURN = 2  # the third root call
TARGET_S = 3.0
TARGET = Target("<=", TARGET_S + LATENCY_S, text=f"<= {TARGET_S:g} s + the step ({LATENCY_S:g} s)")


def completed_after(events: list, after: float) -> float | None:
    """The time of the first completed step recorded after `after` (epoch seconds)."""
    for e in events:
        when = e.event_time.ToNanoseconds() / 1e9
        if when <= after:
            continue
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            return when
        if e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED:
            if "patch" not in e.marker_recorded_event_attributes.marker_name:
                return when
    return None


async def one_run(env: benchlib.BenchEnv, heartbeat_s: float, same_machine: bool) -> dict[str, float]:
    queue = f"bench-recovery-{uuid.uuid4().hex[:6]}"
    # The workers' data directories: one (the machine's), or the new worker's elsewhere.
    first_dir = env.directory / "data"
    new_dir = first_dir if same_machine else env.directory / f"elsewhere-{uuid.uuid4().hex[:6]}"
    reached = threading.Event()
    cells = [f"```repl\nv{i} = llm_query('question {i}')\nprint(len(v{i}))\n```" for i in range(ITERATIONS)]
    inner = root_and_sub(
        [Reply(text=t, delay_s=LATENCY_S) for t in [*cells, "FINAL(done)"]],
        lambda p: Reply("answer to " + p, delay_s=LATENCY_S),
    )

    def script(request: ChatRequest) -> Reply | str:
        if request.is_root and request.turn == KILL_AT_TURN:
            reached.set()
        return inner(request)

    workers: list[benchlib.WorkerProcess] = []
    with ScriptedModelServer(script) as server:
        # The killed worker's request still gets its reply written to a closed socket.
        server._server.handle_error = lambda *a: None  # noqa: SLF001
        try:
            workers.append(await env.worker_process(queue, DRLM_DATA_DIR=str(first_dir)).ready())
            request = EpisodeRequest(
                task="recover",
                root_model=ModelSettings(model="scripted", base_url=server.base_url),
                durability=DurabilitySettings(heartbeat_timeout_s=heartbeat_s),
            )
            handle = await start_episode(env.client, request, queue, f"{queue}-ep")
            if not await asyncio.to_thread(reached.wait, 120):
                raise RuntimeError("the episode never reached the call to interrupt")
            await asyncio.sleep(LATENCY_S / 4)  # well inside the 500 ms call
            workers[0].kill()
            killed_at = time.time()
            workers.append(env.worker_process(queue, DRLM_DATA_DIR=str(new_dir)))
            new = workers[-1]
            ready_task = asyncio.create_task(new.ready())
            step_at = None
            deadline = time.monotonic() + 180
            while step_at is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                events = await benchlib.histories(env.client, handle.id, handle.first_execution_run_id)
                step_at = completed_after(events, killed_at)
            await ready_task
            if step_at is None:
                raise RuntimeError("no step completed within 180 s of the kill")
            result = await asyncio.wait_for(handle.result(), 180)
            if result.answer != "done":
                raise RuntimeError(f"the recovered episode answered {result.answer!r}")
        finally:
            for w in workers:
                w.stop()
    assert new.ready_at is not None
    return {
        "from_start": step_at - new.started_at,
        "from_ready": step_at - new.ready_at,
        "from_kill": step_at - killed_at,
        "worker_start": new.ready_at - new.started_at,
    }


async def body(ctx: Context, section: Section) -> None:
    heartbeat = defaults.HEARTBEAT_TIMEOUT_S
    variants = [(True, "same machine (liveness signal)"), (False, "another machine (heartbeat timeout only)")]
    async with benchlib.bench_env(ctx.scratch("recovery")) as env:
        for same_machine, what in variants:
            rows = []
            for r in range(ctx.repeats):
                say(f"recovery: {what}, run {r + 1}/{ctx.repeats}")
                rows.append(await one_run(env, heartbeat, same_machine))
            label = f"{what}, heartbeat timeout {heartbeat:g} s"
            key = "local" if same_machine else "remote"
            section.add(
                f"worker_start_{key}",
                f"{label}: new worker start to ready",
                "s",
                [x["worker_start"] for x in rows],
                baseline=True,
            )
            section.add(
                f"from_start_{key}",
                f"{label}: new worker start to next completed step",
                "s",
                [x["from_start"] for x in rows],
                ratio=benchlib.ratio(
                    benchlib.median([x["from_start"] for x in rows]),
                    benchlib.median([x["worker_start"] for x in rows]),
                ),
                ratio_label="of worker start",
                target=TARGET if same_machine else None,
            )
            section.add(
                f"from_ready_{key}",
                f"{label}: new worker ready to next completed step",
                "s",
                [x["from_ready"] for x in rows],
            )
            section.add(
                f"from_kill_{key}",
                f"{label}: kill to next completed step",
                "s",
                [x["from_kill"] for x in rows],
            )
    section.notes.append(
        f"the worker is SIGKILLed {LATENCY_S / 4:g} s into the third root call ({LATENCY_S:g} s); the new "
        "worker is started right after the kill; on the same machine (one data directory) it fails the "
        "dead worker's call as it starts (WorkerLost, retried at once); from another machine the call "
        "waits for its heartbeat timeout"
    )


async def run(ctx: Context) -> Section:
    return await run_section("recovery", "6. Recovery after the worker is SIGKILLed", body, ctx)


if __name__ == "__main__":
    section_main(run, __doc__, "recovery.py")
