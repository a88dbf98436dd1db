"""The benchmark suite: one command, every figure against a baseline measured in the same run.

    python bench/run.py                      # everything (~10 minutes on 2 cores)
    python bench/run.py --only concurrency   # one section (repeat --only for more)
    python bench/run.py --quick              # a tiny smoke version of each section
    python bench/run.py --report             # also render BENCHMARKS.md (bench/report.py)

Sections (each also runs alone: python bench/<module>.py [--quick]):

    overhead     engine overhead per iteration, durable vs direct loop   (bench/overhead.py)
    rlms         wall time against rlms==0.1.3 in its own virtualenv     (bench/rlms_compare.py)
    concurrency  N concurrent episodes on one worker process             (bench/concurrency.py)
    processes    N=200 on one worker process and on two (--processes 2)  (bench/processes.py)
    partitions   1, 2, 3 worker processes on task queues of their own    (bench/partitions.py)
    history      history bytes per iteration at 10, 50, 200 iterations   (bench/history.py)
    rebuild      REPL rebuild for 10 and 100 cells; a 100 MB context     (bench/rebuild.py)
    recovery     SIGKILL the only worker mid-call; time to the next step (bench/recovery.py)
    snapshots    rebuild time against episode length, with/without snapshots (bench/snapshots.py)
    startup      new processes: imports, CLI, a first answer against rlms (bench/startup.py)
    contexts     contexts of 100 MB to 5 GB against rlms==0.1.3, stores, documents (bench/contexts.py)

Prints rich tables (median, min, max of several runs, the ratio to the baseline, the target
and PASS/MISS) and writes the figures to bench/results/latest.json with PNG plots next to it
(--quick writes to bench/results/quick/ instead, so a smoke run never replaces real figures).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import importlib
import json
import os
import shutil
import time
from pathlib import Path

import benchlib
from benchlib import RESULTS, console, render, say
from rich.table import Table

SECTIONS = {
    "overhead": "overhead",
    "rlms": "rlms_compare",
    "concurrency": "concurrency",
    "cpu_per_episode": "cpu_per_episode",
    "processes": "processes",
    "partitions": "partitions",
    "history": "history",
    "rebuild": "rebuild",
    "recovery": "recovery",
    "snapshots": "snapshots",
    "containment": "containment",
    "startup": "startup",
    "contexts": "contexts",
}


async def run_all(names: list[str], ctx: benchlib.Context) -> dict[str, dict]:
    done = {}
    for name in names:
        module = importlib.import_module(SECTIONS[name])
        say(f"[bold]section {name}[/bold]")
        section = await module.run(ctx)
        data = section.to_json()
        render(data)
        done[name] = data
    return done


def summary(results: dict) -> None:
    table = Table(title="Targets", title_justify="left")
    for column in ("section", "figure", "value", "target", ""):
        table.add_column(column)
    for name, section in results["sections"].items():
        if section.get("error"):
            table.add_row(name, "[red]section failed[/red]", "", "", section["error"][:80])
        for f in section["figures"]:
            if f["target"] is None:
                continue
            value = f["ratio"] if f["target"]["on"] == "ratio" else f["median"]
            shown = (
                f"{value:.2f}x"
                if f["target"]["on"] == "ratio" and value is not None
                else benchlib.fmt(f["max"] if f["target"]["on"] == "max" else value, f["unit"])
            )
            status = {"PASS": "[green]PASS[/green]", "MISS": "[red]MISS[/red]"}.get(f["status"] or "", "-")
            table.add_row(name, f["label"], shown, f["target"]["text"], status)
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", action="append", choices=list(SECTIONS), help="run only this section")
    parser.add_argument("--quick", action="store_true", help="a tiny smoke version of each section")
    parser.add_argument("--repeats", type=int, default=None, help="runs per figure (default 3, quick 1)")
    parser.add_argument("--output", type=Path, default=None, help="results directory (latest.json, *.png)")
    parser.add_argument("--report", action="store_true", help="render BENCHMARKS.md from the results")
    parser.add_argument("--note", default="", help="a remark kept with the results (e.g. other load)")
    args = parser.parse_args()

    names = [n for n in SECTIONS if n in (args.only or SECTIONS)]
    out = args.output or (RESULTS / "quick" if args.quick else RESULTS)
    ctx = benchlib.make_context(args.quick, args.repeats)
    started, wall = dt.datetime.now(dt.UTC), time.monotonic()
    load_before = os.getloadavg()
    say(f"benchmark suite: {', '.join(names)}{' (quick)' if args.quick else ''}; scratch {ctx.work}")
    try:
        sections = asyncio.run(run_all(names, ctx))
    finally:
        shutil.rmtree(ctx.work, ignore_errors=True)
    results = {
        "meta": {
            "started": started.isoformat(timespec="seconds"),
            "duration_s": round(time.monotonic() - wall, 1),
            "quick": args.quick,
            "note": args.note,
            "repeats": ctx.repeats,
            "sections_run": names,
            "machine": benchlib.machine(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "git": benchlib.git_commit(),
            "command": "python bench/run.py"
            + (" --quick" if args.quick else "")
            + "".join(f" --only {n}" for n in args.only or []),
        },
        "sections": sections,
    }
    out.mkdir(parents=True, exist_ok=True)
    try:
        from plots import make_plots

        results["plots"] = [p.name for p in make_plots(results, out)]
    except ImportError as exc:  # matplotlib is in the `bench` extra
        say(f"no plots: {exc} (pip install -e '.[bench]')")
        results["plots"] = []
    path = out / "latest.json"
    path.write_text(json.dumps(results, indent=1))
    summary(results)
    console.print(f"figures: {path}" + "".join(f"\nplot:    {out / p}" for p in results["plots"]))
    console.print(f"took {results['meta']['duration_s']:.0f} s")
    if args.report:
        from report import render_markdown

        target = benchlib.ROOT / "BENCHMARKS.md"
        target.write_text(render_markdown(results, out))
        console.print(f"report:  {target}")
    failed = [n for n, s in sections.items() if s.get("error")]
    benchlib.finish(1 if failed else 0)


if __name__ == "__main__":
    main()
