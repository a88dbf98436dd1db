"""Section `history`: history bytes and events per iteration as an episode grows.

    python bench/history.py [--quick] [--repeats R]

Episodes of 10, 50 and 200 iterations, each iteration one root call and one cell printing
~20 KB, with a 100 MB context, on the embedded dev server as shipped (this process's
workers, the claim check at its default threshold). The baseline is an episode that answers
in its first reply (no cell). Slope at N = (bytes(N) - bytes(baseline)) / N: what one more
iteration adds to history. A history that grew with the transcript would show a slope that
rises with N; the target is slope(200) <= 1.1 x slope(10).

Sizes are deterministic: one run per size (wall times are printed for information).
"""

from __future__ import annotations

import time
import uuid

import benchlib
from benchlib import Context, Section, Target, ratio, run_section, say, section_main

from durable_rlm.client.episodes import start_episode, store_context
from durable_rlm.scripted import ScriptedModelServer, root_and_sub
from durable_rlm.workflows.models import EpisodeLimits, EpisodeRequest, EpisodeResult, ModelSettings

SIZES = (10, 50, 200)
PRINT_CHARS = 19_900  # under the default output truncation (20,000): the model sees it all
CONTEXT_MB = 100
TARGET_SLOPE_RATIO = 1.1


def turns(iterations: int) -> list[str]:
    cell = f"```repl\nprint(('x' * 99 + '\\n') * {PRINT_CHARS // 100})\n```"
    return [cell] * iterations + ["FINAL(done)"]


def big_context(mb: int) -> str:
    line = "order 0000000: shipped on time to a customer in the north region\n"  # 64 chars
    return line * (mb * 1024 * 1024 // len(line))


async def episode(env: benchlib.BenchEnv, queue: str, iterations: int, context: object) -> dict:
    with ScriptedModelServer(root_and_sub(turns(iterations))) as server:
        request = EpisodeRequest(
            task="benchmark history growth",
            context=context,
            root_model=ModelSettings(model="scripted", base_url=server.base_url),
            limits=EpisodeLimits(max_iterations=iterations + 2),
        )
        started = time.monotonic()
        handle = await start_episode(
            env.client, request, queue, f"bench-history-{iterations}-{uuid.uuid4().hex[:6]}"
        )
        result = await handle.result()
        wall = time.monotonic() - started
    result = EpisodeResult.model_validate(result) if isinstance(result, dict) else result
    if result.answer != "done" or result.iterations != iterations + 1:
        raise RuntimeError(
            f"{iterations}-iteration episode ended {result.ended_by} after {result.iterations}"
        )
    events = await benchlib.histories(env.client, handle.id, handle.first_execution_run_id)
    return {
        "iterations": iterations,
        "bytes": benchlib.history_bytes(events),
        "events": len(events),
        "wall_s": wall,
    }


async def body(ctx: Context, section: Section) -> None:
    sizes = (3, 6) if ctx.quick else SIZES
    mb = 1 if ctx.quick else CONTEXT_MB
    queue = "bench-history"
    async with benchlib.bench_env(ctx.scratch("history")) as env, env.workers(queue):
        say(f"history: storing a {mb} MB context")
        context = store_context(env.blobs, big_context(mb))
        say("history: baseline episode (answers in its first reply)")
        base = await episode(env, queue, 0, context)
        rows = []
        for n in sizes:
            say(f"history: {n}-iteration episode, each cell printing {PRINT_CHARS:,} chars")
            rows.append(await episode(env, queue, n, context))
    section.add(
        "baseline_bytes",
        "history of an episode with no cell",
        "B",
        base["bytes"],
        baseline=True,
        note=f"{base['events']} events",
    )
    slopes = {}
    for r in rows:
        n = r["iterations"]
        slope = (r["bytes"] - base["bytes"]) / n
        slopes[n] = slope
        r["slope"] = slope
        r["events_slope"] = (r["events"] - base["events"]) / n
    first, last = sizes[0], sizes[-1]
    for r in rows:
        n = r["iterations"]
        section.add(
            f"bytes_{n}", f"{n} iterations: history bytes", "B", r["bytes"], note=f"{r['events']} events"
        )
        section.add(
            f"slope_{n}",
            f"{n} iterations: slope, bytes per iteration",
            "B",
            r["slope"],
            ratio=ratio(r["slope"], slopes[first]),
            ratio_label=f"of slope at {first}",
            target=Target(
                "<=", TARGET_SLOPE_RATIO, on="ratio", text=f"<= {TARGET_SLOPE_RATIO:g}x slope at {first}"
            )
            if n == last
            else None,
            note=f"{r['events_slope']:.1f} events per iteration; episode wall time {r['wall_s']:.1f} s",
        )
    section.series["history"] = {"baseline": base, "rows": rows, "context_mb": mb}
    section.notes.append(
        f"each iteration: one root call + one cell printing {PRINT_CHARS:,} chars; context {mb} MB; "
        "bytes = sum of the events' protobuf sizes across every run of the episode"
    )


async def run(ctx: Context) -> Section:
    return await run_section("history", "4. History growth per iteration", body, ctx)


if __name__ == "__main__":
    section_main(run, __doc__)
