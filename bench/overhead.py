"""Section `overhead`: engine overhead per iteration, durable episode against a direct loop.

    python bench/overhead.py [--quick] [--repeats R]

The episode of bench/engine_overhead.py (each iteration one root call + one cell making one
`llm_query`), at 0 and 250 ms of model latency, on the embedded dev server as shipped with
this process's workers. The baseline is the same activities called in a plain loop (no
Temporal). Overhead per iteration = (wall time - model time) / iterations. At 0 ms, the same
episode with its model calls as local activities (`DurabilitySettings.local_model_calls`) is
measured beside it, in the same rounds: the lever of fewer round trips per call.
"""

from __future__ import annotations

import benchlib  # noqa: F401 - sets sys.path
from benchlib import Context, Section, Target, median, ratio, run_section, say, section_main
from engine_overhead import direct, durable, script, sub_answer

from durable_rlm.scripted import ScriptedModelServer, root_and_sub

LATENCIES_MS = (0, 250)
TARGET_MS = 25.0
"""The scale target: at 0 ms of model latency (40 ms before it; see
docs/architecture/decisions.md#the-engines-overhead-per-iteration)."""


async def body(ctx: Context, section: Section) -> None:
    iterations = 2 if ctx.quick else 10
    env_dir = ctx.scratch("overhead")
    sandboxes = ctx.scratch("overhead-direct-sandboxes")
    sandboxes.chmod(0o711)
    plot: dict[str, dict[str, list[float]]] = {}
    async with benchlib.bench_env(env_dir) as env, env.workers("bench-overhead"):
        for latency in LATENCIES_MS:
            delay = latency / 1000
            turns = script(iterations, delay)
            with ScriptedModelServer(root_and_sub(turns, sub_answer(delay))) as server:
                if latency == LATENCIES_MS[0]:
                    say("overhead: warm-up episode")
                    await durable(env.client, "bench-overhead", server, iterations)
                    await direct(env.blobs, sandboxes, server, iterations)
                durable_rows, direct_rows, local_rows = [], [], []
                for r in range(ctx.repeats):
                    say(f"overhead: {latency} ms latency, run {r + 1}/{ctx.repeats}")
                    durable_rows.append(await durable(env.client, "bench-overhead", server, iterations))
                    direct_rows.append(await direct(env.blobs, sandboxes, server, iterations))
                    if latency == 0:
                        local_rows.append(
                            await durable(env.client, "bench-overhead", server, iterations, True)
                        )

            def per_iteration(rows: list[tuple]) -> list[float]:
                return [(wall - model) / its * 1000 for wall, model, its, *_ in rows]

            d_over, b_over = per_iteration(durable_rows), per_iteration(direct_rows)
            plot[str(latency)] = {"durable": d_over, "direct": b_over}
            section.add(
                f"direct_overhead_{latency}ms",
                f"direct loop overhead/iteration, {latency} ms model",
                "ms",
                b_over,
                baseline=True,
            )
            section.add(
                f"overhead_{latency}ms",
                f"durable overhead/iteration, {latency} ms model",
                "ms",
                d_over,
                ratio=ratio(median(d_over), median(b_over)),
                ratio_label="durable / direct",
                target=Target("<=", TARGET_MS, text=f"<= {TARGET_MS:g} ms") if latency == 0 else None,
            )
            if local_rows:
                l_over = per_iteration(local_rows)
                section.add(
                    f"overhead_local_calls_{latency}ms",
                    f"durable overhead/iteration, {latency} ms model, model calls as local activities",
                    "ms",
                    l_over,
                    ratio=ratio(median(l_over), median(b_over)),
                    ratio_label="durable / direct",
                    note=f"{median([row[4] for row in local_rows]):.0f} events per episode "
                    f"(model calls as activities: {median([row[4] for row in durable_rows]):.0f})",
                )
            section.add(
                f"engine_added_{latency}ms",
                f"added by the engine (durable - direct), {latency} ms model",
                "ms",
                [d - b for d, b in zip(d_over, b_over, strict=True)],
            )
            walls_d = [row[0] for row in durable_rows]
            walls_b = [row[0] for row in direct_rows]
            section.add(
                f"wall_{latency}ms",
                f"durable episode wall time, {latency} ms model",
                "s",
                walls_d,
                ratio=ratio(median(walls_d), median(walls_b)),
                ratio_label="durable / direct",
            )
            its = durable_rows[-1][2]
    section.series["overhead_ms"] = plot
    section.notes.append(
        f"{its} iterations per episode ({iterations} cells with one llm_query each, then FINAL); "
        "overhead = (wall - model time) / iterations; embedded dev server as shipped (tuned), "
        "in-process workers; `python bench/engine_overhead.py` also measures the untuned server"
    )


async def run(ctx: Context) -> Section:
    return await run_section(
        "overhead", "1. Engine overhead per iteration (durable vs direct loop)", body, ctx
    )


if __name__ == "__main__":
    section_main(run, __doc__, "overhead.py")
