"""Section `processes`: the same 200 concurrent episodes on one worker process and on two.

    python bench/processes.py [--quick]

`python worker.py --processes 2` (durable_rlm/worker/pool.py) runs two whole workers under one
supervisor, sharing one sandbox budget: one Python process is one core (the GIL), so on this
2-core machine the second process is the one way to use the other core. Each run is
bench/concurrency.py's (`one_size`): N episodes of 11 model calls at 2 s latency, against the
embedded dev server as shipped; the baselines, in the same run, are the latency-bound ideal
and N no-op workflows with the same events on the same server (the server-bound wall).

Targets (the scale targets, docs/architecture/decisions.md): with 2 processes, N=200 at >=
80% of the best bound (the larger of the two baselines, over the wall time measured) and 0
workflow-task timeouts.
"""

from __future__ import annotations

import benchlib
from benchlib import Context, Section, Target, run_section, say, section_main
from concurrency import LATENCY_S, MODEL_CALLS, one_size

N = 200
TARGET_BOUND_SHARE = 0.8


async def body(ctx: Context, section: Section) -> None:
    n = 5 if ctx.quick else N
    latency = 0.5 if ctx.quick else LATENCY_S
    ideal = MODEL_CALLS * latency
    rows = {}
    async with benchlib.bench_env(ctx.scratch("processes")) as env:
        for processes in (1, 2):
            say(f"processes: N={n} episodes on {processes} worker process(es)")
            rows[processes] = await one_size(env, n, latency, processes=processes)
        # The lever measured beside them: the same, model calls as local activities.
        say(f"processes: N={n} episodes on 2 worker processes, model calls as local activities")
        local = await one_size(env, n, latency, processes=2, local_model_calls=True)
    section.series["processes"] = {
        str(p): {k: v for k, v in r.items() if k != "uss_mb"} for p, r in rows.items()
    }
    section.add(
        "ideal_s", f"latency-bound ideal ({MODEL_CALLS} calls x {latency:g} s)", "s", ideal, baseline=True
    )
    noop = min(r["noop_wall_s"] for r in rows.values())
    section.add("noop_wall_s", f"{n} no-op workflows, same events (server-bound)", "s", noop, baseline=True)
    bound = max(ideal, noop)
    for processes, r in rows.items():
        judged = processes == 2
        section.add(
            f"wall_{processes}",
            f"N={n} on {processes} process(es): wall time",
            "s",
            r["wall_s"],
            ratio=benchlib.ratio(r["wall_s"], rows[1]["wall_s"]),
            ratio_label="of one process's",
        )
        section.add(
            f"bound_share_{processes}",
            f"N={n} on {processes} process(es): rate / best bound (max(ideal, no-op) / wall)",
            "%",
            100 * bound / r["wall_s"],
            target=Target(">=", 100 * TARGET_BOUND_SHARE, text=f">= {TARGET_BOUND_SHARE:.0%}")
            if judged
            else None,
        )
        section.add(
            f"wft_timeouts_{processes}",
            f"N={n} on {processes} process(es): workflow-task timeouts (all histories)",
            "count",
            r["wft_timeouts"],
            target=Target("<=", 0, on="max", text="0") if judged else None,
            note="by kind: "
            + (", ".join(f"{k} x{v}" for k, v in sorted(r["wft_timeout_kinds"].items())) or "none"),
        )
        section.add(
            f"cpu_per_episode_{processes}",
            f"N={n} on {processes} process(es): worker CPU per episode (all processes + sandboxes)",
            "ms",
            1000 * r["cpu_s"] / n,
        )
        section.add(
            f"events_{processes}",
            f"N={n} on {processes} process(es): events per episode (median)",
            "count",
            r["events_per_episode"],
        )
    for processes, r in rows.items():
        if r["server_cpu_s"] is not None:
            section.add(
                f"server_cpu_per_episode_{processes}",
                f"N={n} on {processes} process(es): Temporal server CPU per episode",
                "ms",
                1000 * r["server_cpu_s"] / n,
                note=f"the bench process (model server, client) {1000 * r['bench_cpu_s'] / n:.0f} ms",
            )
    section.add(
        "bound_share_2_local",
        f"N={n} on 2 processes, model calls as local activities: rate / best bound",
        "%",
        100 * max(ideal, local["noop_wall_s"]) / local["wall_s"],
        note=f"wall {local['wall_s']:.1f} s (its own no-op baseline: {local['noop_wall_s']:.1f} s); "
        f"workflow-task timeouts {local['wft_timeouts']}; worker CPU {1000 * local['cpu_s'] / n:.0f} ms "
        f"per episode; {local['events_per_episode']:.0f} events per episode; model requests beyond "
        f"{MODEL_CALLS} per episode: {local['extra_model_requests']}",
    )
    section.notes.append(
        "one run per process count, in the same run against the same server; the no-op baseline is "
        "the faster of its measurements"
    )


async def run(ctx: Context) -> Section:
    return await run_section(
        "processes", "3b. One worker process against two (worker.py --processes 2)", body, ctx
    )


if __name__ == "__main__":
    section_main(run, __doc__)
