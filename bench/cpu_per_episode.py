"""Section `cpu_per_episode`: CPU time per episode, ours against rlms's own (rlms==0.1.3).

    python bench/cpu_per_episode.py [--quick] [--repeats R] [--merge]

One episode shape on both sides, bench/concurrency.py's: five times (a root model call whose
reply is a ```repl cell making one `llm_query`), then a root reply that ends the episode with
the last cell's value; 11 model calls, all at 0 ms of latency, served by the same scripted
OpenAI-compatible server on 127.0.0.1, run in this process (its CPU counts on neither side).

- rlms (the baseline): one process of rlms's own virtualenv (bench/rlms_compare.py's
  `rlms_python()`) runs bench/rlms_driver.py: one untimed warm-up episode (imports,
  connections), then E episodes one after the other, each `RLM(backend="openai", ...,
  max_depth=1).completion(...)` with its local REPL (exec in its own process). rlms 0.1.3 does
  not read FINAL_VAR: its last root reply is a cell setting `answer["content"] = v4` and
  `answer["ready"] = True`, its way to end an episode (still 11 calls). The driver reports the
  CPU time (user + system, every thread, waited-for children) of each episode, from building
  the `RLM` to closing it; rlms CPU per episode = the E timed episodes' sum / E. The whole
  process's CPU (os.wait4: imports and warm-up included) is printed beside it.
- ours: one `worker.py` process against the embedded dev server as shipped, as
  bench/concurrency.py runs it (its `turns` at 0 s latency): one untimed warm-up episode, then
  E episodes started at once (the judged figure), then E episodes one after the other (rlms's
  way). The worker's CPU time per episode: user + system of its process, its fork-server
  template and its sandboxes, from /proc, counting the sandboxes that ended (their CPU lands
  in the template's cutime when it reaps them; `benchlib.tree_cpu_seconds`, which
  bench/concurrency.py uses, leaves it out: what it says for the same window is printed too).
  The embedded server's CPU is not the worker's; it is printed beside.

Each side checks its answers ("answer to question 4") and that the server saw 11 model calls
per episode (6 root, 5 sub-calls for rlms), and fails loudly otherwise. Target: ours <= 110 ms
per episode.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import uuid
from collections.abc import Awaitable
from pathlib import Path

import benchlib
from benchlib import BENCH, Context, Section, Target, median, ratio, run_section, say, section_main
from concurrency import CELLS, MODEL_CALLS, turns
from rlms_compare import rlms_python, rlms_version

from durable_rlm.client.episodes import start_episode
from durable_rlm.scripted import Reply, ScriptedModelServer, root_and_sub
from durable_rlm.workflows.models import DurabilitySettings, EpisodeRequest, EpisodeResult, ModelSettings

EPISODES = 20
QUICK_EPISODES = 3
TARGET_MS = 110.0
TASK = "count"
ANSWER = f"answer to question {CELLS - 1}"
RLMS_TIMEOUT_S = 600


def rlms_turns() -> list[Reply]:
    """bench/concurrency.py's turns at 0 ms, the last one in rlms's words (it has no FINAL_VAR)."""
    last = CELLS - 1
    ending = f"```repl\nanswer['content'] = v{last}\nanswer['ready'] = True\n```"
    return [*turns(0.0)[:-1], Reply(text=ending)]


def wait_rlms(command: list[str], cwd: Path, out: Path, err: Path) -> tuple[int, float]:
    """Run the driver to its end; its exit code and its whole CPU time (os.wait4: user + system
    of it and its waited-for children)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
    with out.open("w") as stdout, err.open("w") as stderr:
        process = subprocess.Popen(command, stdout=stdout, stderr=stderr, cwd=cwd, env=env)
        deadline = time.monotonic() + RLMS_TIMEOUT_S
        while True:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if pid:
                process.returncode = os.waitstatus_to_exitcode(status)
                return process.returncode, usage.ru_utime + usage.ru_stime
            if time.monotonic() > deadline:
                process.kill()
                process.wait()
                raise RuntimeError(f"rlms driver still running after {RLMS_TIMEOUT_S} s")
            time.sleep(0.05)


async def rlms_side(python: Path, episodes: int, directory: Path) -> dict:
    """E timed episodes (after one warm-up) in one rlms process; its CPU per episode."""
    with ScriptedModelServer(root_and_sub(rlms_turns(), lambda p: Reply("answer to " + p))) as server:
        context_file = directory / "context.txt"
        context_file.write_text("one line of context\n")
        command = [
            str(python),
            str(BENCH / "rlms_driver.py"),
            "--base-url",
            server.base_url,
            "--iterations",
            str(CELLS + 1),
            "--runs",
            str(episodes),
            "--warmup",
            "1",
            "--context-file",
            str(context_file),
            "--root-prompt",
            TASK,
        ]
        out, err = directory / "rlms-driver.out", directory / "rlms-driver.err"
        code, process_cpu = await asyncio.to_thread(wait_rlms, command, directory, out, err)
        roots, subs, total = len(server.root_requests()), len(server.sub_requests()), len(server.requests)
    if code != 0:
        raise RuntimeError(f"rlms driver exited {code}: {err.read_text()[-2000:]}")
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]
    if len(rows) != episodes + 1:
        raise RuntimeError(f"rlms driver reported {len(rows)} episodes, not {episodes + 1}")
    wrong = [row["answer"] for row in rows if row["answer"] != ANSWER]
    if wrong:
        raise RuntimeError(f"rlms answered {wrong[0]!r}, not {ANSWER!r} ({len(wrong)} of {len(rows)})")
    ran = len(rows)
    if (roots, subs, total) != (ran * (CELLS + 1), ran * CELLS, ran * MODEL_CALLS):
        raise RuntimeError(
            f"rlms: the server saw {total} model calls ({roots} root, {subs} sub) for {ran} episodes, "
            f"not {MODEL_CALLS} ({CELLS + 1} root, {CELLS} sub) each"
        )
    timed = [row["cpu_s"] for row in rows if not row["warmup"]]
    return {
        "cpu_per_episode_s": sum(timed) / len(timed),
        "episode_cpu_s": timed,
        "warmup_cpu_s": next(row["cpu_s"] for row in rows if row["warmup"]),
        "process_cpu_s": process_cpu,
        "wall_s": [row["wall_s"] for row in rows if not row["warmup"]],
        "calls_per_episode": total / ran,
    }


def tree_cpu(pid: int) -> float:
    """CPU time of a process and of every live descendant, each with its waited-for children
    (a sandbox that ended is in its reaper's cutime: the template's, or the worker's)."""
    return sum(benchlib.cpu_seconds(p) for p in [pid, *benchlib.descendants(pid)])


class Meter:
    """CPU of the worker tree (counted both ways) and of the server, and model calls, over a window."""

    def __init__(self, worker_pid: int, server_pid: int | None, server: ScriptedModelServer) -> None:
        self.pids = (worker_pid, server_pid)
        self.server = server

    def read(self) -> tuple[float, float, float, int]:
        worker, server_pid = self.pids
        server = tree_cpu(server_pid) if server_pid is not None else 0.0
        return tree_cpu(worker), benchlib.tree_cpu_seconds(worker), server, len(self.server.requests)

    async def window(self, episodes: int, run: Awaitable[list]) -> dict:
        before = self.read()
        started = time.monotonic()
        results = await run
        wall = time.monotonic() - started
        after = self.read()
        worker, as_concurrency, server, calls = (a - b for a, b in zip(after, before, strict=True))
        wrong = [r.answer for r in results if r.answer != ANSWER]
        if wrong:
            raise RuntimeError(f"ours answered {wrong[0]!r}, not {ANSWER!r} ({len(wrong)} of {len(results)})")
        if calls != episodes * MODEL_CALLS or any(r.model_calls != MODEL_CALLS for r in results):
            raise RuntimeError(
                f"ours: the server saw {calls} model calls for {episodes} episodes, not {MODEL_CALLS} each "
                f"(the episodes counted {sorted({r.model_calls for r in results})})"
            )
        return {
            "cpu_per_episode_s": worker / episodes,
            "as_concurrency_per_episode_s": as_concurrency / episodes,
            "server_per_episode_s": server / episodes,
            "calls_per_episode": calls / episodes,
            "wall_s": wall,
        }


async def ours_side(env: benchlib.BenchEnv, episodes: int) -> dict:
    """One warm-up episode, E at once, E one after the other, on one fresh worker.py."""
    queue = f"bench-cpu-{uuid.uuid4().hex[:6]}"
    with ScriptedModelServer(root_and_sub(turns(0.0), lambda p: Reply("answer to " + p))) as server:
        server._server.socket.listen(4096)  # noqa: SLF001 - E connections at once (concurrency.py)
        worker = await env.worker_process(queue, DRLM_WORKER_PROCESSES="1").ready()
        try:
            request = EpisodeRequest(
                task=TASK, root_model=ModelSettings(model="scripted", base_url=server.base_url)
            )
            # The lever measured beside it: the model calls as local activities.
            local = request.model_copy(
                update={"durability": DurabilitySettings(local_model_calls=True)}, deep=True
            )

            async def episode(name: str, asked: EpisodeRequest = request) -> EpisodeResult:
                handle = await start_episode(env.client, asked, queue, f"{queue}-{name}")
                return await handle.result()

            async def at_once() -> list:
                return await asyncio.gather(*(episode(f"c{i}") for i in range(episodes)))

            async def local_at_once() -> list:
                return await asyncio.gather(*(episode(f"l{i}", local) for i in range(episodes)))

            async def in_turn() -> list:
                return [await episode(f"s{i}") for i in range(episodes)]

            meter = Meter(worker.pid, env.server_pid, server)
            warmup = await meter.window(1, asyncio.gather(episode("warmup")))
            concurrent = await meter.window(episodes, at_once())
            sequential = await meter.window(episodes, in_turn())
            local_calls = await meter.window(episodes, local_at_once())
        finally:
            worker.stop()
    return {"warmup": warmup, "at_once": concurrent, "in_turn": sequential, "local_at_once": local_calls}


async def body(ctx: Context, section: Section) -> None:
    episodes = QUICK_EPISODES if ctx.quick else EPISODES
    python = await asyncio.to_thread(rlms_python)
    version = rlms_version(python)
    loads = [os.getloadavg()[0]]
    theirs, ours = [], []
    async with benchlib.bench_env(ctx.scratch("cpu-per-episode")) as env:
        for repeat in range(ctx.repeats):
            say(f"cpu per episode: rlms {version}, 1 warm-up + {episodes} episodes (run {repeat + 1})")
            theirs.append(await rlms_side(python, episodes, ctx.scratch("rlms")))
            loads.append(os.getloadavg()[0])
            say(
                f"cpu per episode: ours, 1 warm-up, {episodes} at once, {episodes} in turn (run {repeat + 1})"
            )
            ours.append(await ours_side(env, episodes))
            loads.append(os.getloadavg()[0])
            t, o = theirs[-1], ours[-1]
            say(
                f"cpu per episode: rlms {1000 * t['cpu_per_episode_s']:.1f} ms; ours "
                f"{1000 * o['at_once']['cpu_per_episode_s']:.1f} ms at once, "
                f"{1000 * o['in_turn']['cpu_per_episode_s']:.1f} ms in turn"
            )

    def ms(rows: list[dict], *keys: str) -> list[float]:
        """rows[i][keys[0]][keys[1]]..., in ms."""
        values = []
        for row in rows:
            value = row
            for key in keys:
                value = value[key]
            values.append(1000 * value)
        return values

    rlms_ms = ms(theirs, "cpu_per_episode_s")
    at_once_ms = ms(ours, "at_once", "cpu_per_episode_s")
    in_turn_ms = ms(ours, "in_turn", "cpu_per_episode_s")
    section.series["cpu_per_episode"] = {
        "episodes": episodes,
        "rlms_ms": rlms_ms,
        "ours_at_once_ms": at_once_ms,
        "ours_in_turn_ms": in_turn_ms,
        "rlms_episode_cpu_ms": [[1000 * c for c in t["episode_cpu_s"]] for t in theirs],
        "ours": ours,
        "load_average_1min": loads,
    }
    single = [1000 * c for t in theirs for c in t["episode_cpu_s"]]
    section.add(
        "rlms_cpu_per_episode",
        f"rlms {version}: CPU per episode (its own process, {episodes} in turn after a warm-up)",
        "ms",
        rlms_ms,
        baseline=True,
        note=f"single episodes {min(single):.1f} to {max(single):.1f} ms; warm-up episode "
        f"{1000 * median([t['warmup_cpu_s'] for t in theirs]):.0f} ms; whole process (imports, "
        f"warm-up, {episodes}): {median([t['process_cpu_s'] for t in theirs]):.2f} s; wall per "
        f"episode {1000 * median([median(t['wall_s']) for t in theirs]):.0f} ms",
    )
    for way, values, label, judged in (
        ("at_once", at_once_ms, f"{episodes} at once", True),
        ("in_turn", in_turn_ms, f"{episodes} in turn, as rlms", False),
        (
            "local_at_once",
            ms(ours, "local_at_once", "cpu_per_episode_s"),
            f"{episodes} at once, model calls as local activities",
            False,
        ),
    ):
        rows = [o[way] for o in ours]
        section.add(
            f"ours_cpu_per_episode_{way}",
            f"ours: worker CPU per episode (process + template + sandboxes, {label})",
            "ms",
            values,
            ratio=ratio(median(values), median(rlms_ms)),
            ratio_label="ours / rlms",
            target=Target("<=", TARGET_MS, text=f"<= {TARGET_MS:g} ms") if judged else None,
            note=f"counted as bench/concurrency.py does (ended sandboxes left out): "
            f"{median(ms(rows, 'as_concurrency_per_episode_s')):.1f} ms; the embedded server besides: "
            f"{median(ms(rows, 'server_per_episode_s')):.1f} ms; wall of the {episodes}: "
            f"{median([r['wall_s'] for r in rows]):.2f} s",
        )
    section.add(
        "ours_cpu_warmup",
        "ours: worker CPU of the warm-up episode (first on a fresh worker; not in the above)",
        "ms",
        ms(ours, "warmup", "cpu_per_episode_s"),
        ratio=ratio(median(ms(ours, "warmup", "cpu_per_episode_s")), median(ms(theirs, "warmup_cpu_s"))),
        ratio_label="of rlms's warm-up episode",
    )
    section.add(
        "rlms_calls_per_episode",
        "rlms: model calls per episode (seen by the server)",
        "count",
        [t["calls_per_episode"] for t in theirs],
        note=f"{CELLS + 1} root + {CELLS} sub-calls each, warm-up included",
    )
    section.add(
        "ours_calls_per_episode",
        "ours: model calls per episode (seen by the server)",
        "count",
        [o[way]["calls_per_episode"] for o in ours for way in ("at_once", "in_turn", "local_at_once")],
        note="all three ways; each episode's own count agrees",
    )
    section.notes.append(
        f"episodes: {CELLS} x (root call + cell with one llm_query) + an ending reply, {MODEL_CALLS} "
        f"model calls at 0 ms; rlms {version} with its local REPL in its own virtualenv "
        f"({python.parent.parent}); ours: one worker.py process as shipped, one warm-up episode "
        "first; the scripted server runs in the bench's process for both sides"
    )
    section.notes.append(
        f"{ctx.repeats} run(s) of each side, alternating; 1-minute load average before, between "
        f"and after: {', '.join(f'{x:.2f}' for x in loads)} on {os.cpu_count()} cores"
    )


async def run(ctx: Context) -> Section:
    return await run_section("cpu_per_episode", "3d. CPU per episode against rlms", body, ctx)


if __name__ == "__main__":
    section_main(run, __doc__, "cpu_per_episode.py")
