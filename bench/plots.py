"""The suite's plots (matplotlib, PNG), drawn from the figures' JSON (`bench/results/latest.json`).

- overhead.png: engine overhead per iteration, durable vs direct loop, at each model latency;
- concurrency.png: wall time of N concurrent episodes against the latency-bound ideal and
  the server-bound no-op run;
- history.png: history bytes per iteration (slope) at each episode size.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any


def _pyplot():  # noqa: ANN202
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _errors(values_by_bar: list[list[float]]) -> tuple[list[float], list[list[float]]]:
    medians = [statistics.median(v) for v in values_by_bar]
    low = [m - min(v) for m, v in zip(medians, values_by_bar, strict=True)]
    high = [max(v) - m for m, v in zip(medians, values_by_bar, strict=True)]
    return medians, [low, high]


def overhead_plot(section: dict[str, Any], out: Path) -> Path | None:
    data = section.get("series", {}).get("overhead_ms")
    if not data:
        return None
    plt = _pyplot()
    latencies = list(data)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.38
    xs = range(len(latencies))
    for offset, kind, color in ((-width / 2, "durable", "#1f77b4"), (width / 2, "direct", "#aaaaaa")):
        medians, errors = _errors([data[lat][kind] for lat in latencies])
        label = "durable episode" if kind == "durable" else "direct loop (baseline)"
        ax.bar([x + offset for x in xs], medians, width, yerr=errors, capsize=4, label=label, color=color)
    ax.axhline(40, color="#d62728", linestyle="--", linewidth=1, label="target 40 ms")
    ax.set_xticks(list(xs), [f"{lat} ms model latency" for lat in latencies])
    ax.set_ylabel("engine overhead per iteration (ms)")
    ax.set_title("Engine overhead per iteration (median, min-max)")
    top = max(max(v) for lat in latencies for v in data[lat].values())
    ax.set_ylim(0, max(top, 40) * 1.35)
    ax.legend(loc="upper left", ncol=3, fontsize="small")
    fig.tight_layout()
    path = out / "overhead.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def concurrency_plot(section: dict[str, Any], out: Path) -> Path | None:
    data = section.get("series", {}).get("concurrency")
    if not data or not data.get("rows"):
        return None
    plt = _pyplot()
    rows = sorted(data["rows"], key=lambda r: r["n"])
    ns = [r["n"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(ns, [r["wall_s"] for r in rows], "o-", label="N episodes, one worker process")
    ax.axhline(data["ideal_s"], linestyle="--", color="#2ca02c", label="latency-bound ideal")
    ax.plot(
        ns, [r["noop_wall_s"] for r in rows], "s:", color="#7f7f7f", label="N no-op workflows (server-bound)"
    )
    if 200 in ns:
        ax.axhline(38, color="#d62728", linestyle="--", linewidth=1, label="target at N=200: 38 s")
    ax.set_xscale("log")
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("concurrent episodes N")
    ax.set_ylabel("wall time (s)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Concurrent episodes at {data['latency_s']:g} s model latency")
    ax.legend(fontsize="small")
    fig.tight_layout()
    path = out / "concurrency.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def history_plot(section: dict[str, Any], out: Path) -> Path | None:
    data = section.get("series", {}).get("history")
    if not data or not data.get("rows"):
        return None
    plt = _pyplot()
    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.bar([str(r["iterations"]) for r in rows], [r["slope"] / 1024 for r in rows], color="#1f77b4")
    ax.set_xlabel("iterations in the episode")
    ax.set_ylabel("history KB per iteration (slope)")
    ax.set_title(f"History growth, cells printing ~20 KB, {data['context_mb']} MB context")
    fig.tight_layout()
    path = out / "history.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def make_plots(results: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    sections = results.get("sections", {})
    made = []
    for name, draw in (
        ("overhead", overhead_plot),
        ("concurrency", concurrency_plot),
        ("history", history_plot),
    ):
        if name in sections:
            path = draw(sections[name], out)
            if path is not None:
                made.append(path)
    return made
