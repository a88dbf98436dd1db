"""Section `contexts`: contexts of any size, side by side with rlms 0.1.3 in one run.

    [DRLM_BENCH_CONTEXTS=text,stores,documents,concurrent] python bench/contexts.py [--quick] [--merge]

- text: the same 3-turn scripted episode (print `len(context)`, count the lines, answer) over
  100 MB and 1.2 GB of text, through each library's Python API, each in a process of its own
  (bench/contexts_driver.py) after a warm-up episode: wall time of the measured episode, and
  peak memory of the process and its children (the sum of their RSS, sampled every 50 ms;
  ours includes the embedded Temporal server and the sandbox). Targets: <= 1.2x rlms's time,
  <= rlms's peak.
- documents: 5 GB as 50 documents of 100 MB (a directory, as `--context DIR` stores it) on a
  separate worker process (`python worker.py`): the episode touches every document; the
  worker's RSS above its idle size (target <= 500 MB).
- concurrent: 10 episodes at once over one 1 GB context on one worker process: the host's
  copies (files in its context cache), the worker's PSS, and each sandbox's PSS against its
  `str` (shared pages counted once).
- stores: the 100 MB episode of `text` on PostgreSQL (a throwaway cluster) and on the S3 store
  (a `weed mini` server), beside the embedded default.

Each figure's note gives the machine's load (`uptime`) when it was taken: 2 shared cores.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import benchlib
from benchlib import BENCH, ROOT, Context, Section, Target, descendants, ratio, run_section, say, section_main

from durable_rlm.scripted import ScriptedModelServer, root_and_sub

MB = 1024 * 1024
LINE = "2026-11-27 17:00:00 INFO service-7 request 0123456789 handled in 12 ms, status ok\n"
TURNS = [
    "```repl\nprint(len(context))\n```",
    "```repl\nn = context.count(chr(10))\nprint(n)\n```",
    "```repl\nanswer['content'] = str(n)\nanswer['ready'] = True\n```",
]
TIME_RATIO, MEMORY_RATIO, DOCUMENTS_MB = 1.2, 1.0, 500


def uptime() -> str:
    one, five, fifteen = Path("/proc/loadavg").read_text().split()[:3]
    return f"load {one} {five} {fifteen}"


def write_text(path: Path, size: int) -> int:
    block = (LINE * (MB // len(LINE) + 1))[:MB]
    with open(path, "w", encoding="utf-8") as handle:
        for _ in range(size // MB):
            handle.write(block)
    return (size // MB) * block.count("\n")


class TreeMemory:
    """The peak of the summed RSS (and PSS) of a process and its descendants, sampled."""

    def __init__(self, pid: int, pss: bool = False, every_s: float = 0.05) -> None:
        self.pid, self.pss, self.every_s = pid, pss, every_s
        self.peak_rss = 0
        self.peak_pss = 0
        self.by_pid_pss: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            pids = [self.pid, *descendants(self.pid)]
            self.peak_rss = max(self.peak_rss, sum(benchlib.status_kb(p, "VmRSS") for p in pids) * 1024)
            if self.pss:
                each = {p: pss_kb(p) * 1024 for p in pids}
                for p, v in each.items():
                    self.by_pid_pss[p] = max(self.by_pid_pss.get(p, 0), v)
                self.peak_pss = max(self.peak_pss, sum(each.values()))
            self._stop.wait(self.every_s)


def pss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_driver(python: Path, impl: str, base_url: str, context: Path, cwd: Path, env: dict[str, str]) -> dict:
    process = subprocess.Popen(
        [
            str(python),
            str(BENCH / "contexts_driver.py"),
            "--impl",
            impl,
            "--base-url",
            base_url,
            "--context-file",
            str(context),
        ],
        stdout=subprocess.PIPE,
        stderr=open(cwd / f"{impl}.err", "wb"),
        cwd=cwd,
        env=env,
        text=True,
    )
    rows = []
    with TreeMemory(process.pid) as memory:
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("{"):
                rows.append(json.loads(line))
        process.wait()
    if process.returncode != 0:
        raise RuntimeError(f"{impl} driver failed: {(cwd / f'{impl}.err').read_text()[-2000:]}")
    measured = [r for r in rows if r.get("warmup") is False][-1]
    return {"wall_s": measured["wall_s"], "answer": measured["answer"], "peak_bytes": memory.peak_rss}


def driver_env(data_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "DRLM_", "TEMPORAL_"))}
    env.update(DRLM_DATA_DIR=str(data_dir), DRLM_SERVER_IDLE_S="5", DRLM_LOG_LEVEL="WARNING", **extra)
    return env


async def text_cases(ctx: Context, section: Section, server: ScriptedModelServer, stores: dict) -> None:
    from rlms_compare import rlms_python  # the rlms virtualenv, made on first use

    rlms = await asyncio.to_thread(rlms_python)
    sizes = [("10MB", 10 * MB)] if ctx.quick else [("100MB", 100 * MB), ("1.2GB", 1229 * MB)]
    for label, size in sizes:
        work = ctx.scratch(f"text-{label}")
        path = work / "context.txt"
        lines = await asyncio.to_thread(write_text, path, size)
        runs: dict[str, list[dict]] = {"rlms": [], "durable": []}
        for _ in range(ctx.repeats):
            for impl, python in (("rlms", rlms), ("durable", Path(sys.executable))):
                say(f"contexts: {label} text, {impl} ({uptime()})")
                row = await asyncio.to_thread(
                    run_driver,
                    python,
                    impl,
                    server.base_url,
                    path,
                    work,
                    driver_env(work / f"data-{uuid.uuid4().hex[:6]}"),
                )
                if row["answer"] != str(lines):
                    raise RuntimeError(f"{impl} answered {row['answer']!r}, not {lines}")
                row["load"] = uptime()
                runs[impl].append(row)
        theirs, ours = runs["rlms"], runs["durable"]
        note = "; ".join(f"{impl} {r['load']}" for impl in runs for r in runs[impl])
        section.add(
            f"rlms_{label}_wall",
            f"rlms {label}: wall time",
            "s",
            [r["wall_s"] for r in theirs],
            baseline=True,
            note=note,
        )
        section.add(
            f"durable_{label}_wall",
            f"durable {label}: wall time",
            "s",
            [r["wall_s"] for r in ours],
            ratio=ratio(
                benchlib.median([r["wall_s"] for r in ours]), benchlib.median([r["wall_s"] for r in theirs])
            ),
            ratio_label="durable / rlms",
            target=Target("<=", TIME_RATIO, on="ratio", text=f"<= {TIME_RATIO}x rlms"),
        )
        section.add(
            f"rlms_{label}_peak",
            f"rlms {label}: peak memory, process and children",
            "MB",
            [r["peak_bytes"] / MB for r in theirs],
            baseline=True,
        )
        section.add(
            f"durable_{label}_peak",
            f"durable {label}: peak memory, process and children",
            "MB",
            [r["peak_bytes"] / MB for r in ours],
            ratio=ratio(
                benchlib.median([r["peak_bytes"] for r in ours]),
                benchlib.median([r["peak_bytes"] for r in theirs]),
            ),
            ratio_label="durable / rlms",
            target=Target("<=", MEMORY_RATIO, on="ratio", text="<= rlms's"),
        )
        if label in ("100MB", "10MB"):
            stores["path"], stores["lines"], stores["sqlite"] = path, lines, [r["wall_s"] for r in ours]


async def store_cases(ctx: Context, section: Section, server: ScriptedModelServer, stores: dict) -> None:
    from durable_rlm.store.local_s3 import LocalObjectStore
    from tests.conftest import PostgresCluster

    path, lines = stores["path"], stores["lines"]
    work = ctx.scratch("stores")
    cluster = PostgresCluster()
    cluster.start()
    s3 = LocalObjectStore(work / "s3")
    try:
        for name, extra in (
            ("postgresql", {"DRLM_DATABASE_URL": cluster.url}),
            ("s3", {**s3.environment()}),
        ):
            walls = []
            for _ in range(ctx.repeats):
                say(f"contexts: stores, {name} ({uptime()})")
                env = driver_env(work / f"data-{uuid.uuid4().hex[:6]}", **extra)
                row = await asyncio.to_thread(
                    run_driver, Path(sys.executable), "durable", server.base_url, path, work, env
                )
                if row["answer"] != str(lines):
                    raise RuntimeError(f"{name}: answered {row['answer']!r}")
                walls.append(row["wall_s"])
            section.add(
                f"durable_{name}_wall",
                f"durable {path.stat().st_size // MB} MB on {name}: wall time",
                "s",
                walls,
                ratio=ratio(benchlib.median(walls), benchlib.median(stores["sqlite"])),
                ratio_label=f"{name} / embedded SQLite",
                note=uptime(),
            )
    finally:
        s3.stop()
        cluster.remove()


async def documents_case(ctx: Context, section: Section) -> None:
    from durable_rlm.client.episodes import start_episode
    from durable_rlm.store.contexts import context_files, store_documents
    from durable_rlm.workflows.models import EpisodeLimits, EpisodeRequest, ModelSettings

    count, size = (5, 20 * MB) if ctx.quick else (50, 100 * MB)
    work = ctx.scratch("documents")
    corpus = work / "corpus"
    corpus.mkdir()
    lines = 0
    for i in range(count):
        lines += await asyncio.to_thread(write_text, corpus / f"log-{i:02d}.txt", size)
    turns = [
        "```repl\ntotal = sum(d.count(chr(10)) for d in context)\nprint(len(context), total)\n```",
        "FINAL_VAR(total)",
    ]
    with ScriptedModelServer(root_and_sub(turns)) as model:
        async with benchlib.bench_env(work) as env:
            worker = await env.worker_process("bench-docs").ready()
            await asyncio.sleep(2)
            idle = benchlib.status_kb(worker.pid, "VmRSS") * 1024
            say(f"contexts: documents, storing {count} x {size // MB} MB ({uptime()})")
            ref, _ = await asyncio.to_thread(store_documents, env.blobs, context_files([corpus]))
            request = EpisodeRequest(
                task="count the lines",
                context=ref,
                root_model=ModelSettings(model="scripted", base_url=model.base_url),
                limits=EpisodeLimits(max_iterations=4, cell_timeout_s=1800),
            )
            peak = [idle]
            stop = threading.Event()

            def sample() -> None:
                while not stop.is_set():
                    peak[0] = max(peak[0], benchlib.status_kb(worker.pid, "VmRSS") * 1024)
                    stop.wait(0.05)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            started = time.monotonic()
            try:
                handle = await start_episode(
                    env.client, request, "bench-docs", f"bench-docs-{uuid.uuid4().hex[:6]}"
                )
                result = await handle.result()
            finally:
                stop.set()
                sampler.join()
                worker.stop()
            wall = time.monotonic() - started
    if result.answer != str(lines):
        raise RuntimeError(f"documents: answered {result.answer!r}, not {lines}")
    section.add(
        "documents_wall",
        f"{count} documents, {count * size // MB:,} MB: episode wall time",
        "s",
        wall,
        note=uptime(),
    )
    section.add(
        "documents_worker_rss",
        "the worker's RSS above its idle size",
        "MB",
        (peak[0] - idle) / MB,
        target=Target("<=", DOCUMENTS_MB, text=f"<= {DOCUMENTS_MB} MB"),
        note=f"idle {idle / MB:.0f} MB; {uptime()}",
    )


async def concurrent_case(ctx: Context, section: Section) -> None:
    from durable_rlm.client.episodes import start_episode, store_context
    from durable_rlm.workflows.models import EpisodeLimits, EpisodeRequest, ModelSettings

    episodes, size = (3, 50 * MB) if ctx.quick else (10, 1024 * MB)
    work = ctx.scratch("concurrent")
    path = work / "context.txt"
    await asyncio.to_thread(write_text, path, size)
    turns = ["```repl\nimport time\nn = len(context)\ntime.sleep(8)\n```", "FINAL_VAR(n)"]
    with ScriptedModelServer(root_and_sub(turns)) as model:
        async with benchlib.bench_env(work) as env:
            worker = await env.worker_process("bench-conc", DRLM_MAX_SANDBOXES=str(episodes + 2)).ready()
            text = path.read_text()
            ref = await asyncio.to_thread(store_context, env.blobs, text)
            del text
            request = EpisodeRequest(
                task="how long",
                context=ref,
                root_model=ModelSettings(model="scripted", base_url=model.base_url),
                limits=EpisodeLimits(max_iterations=4, cell_timeout_s=600),
            )
            say(f"contexts: {episodes} concurrent episodes over {size // MB} MB ({uptime()})")
            try:
                with TreeMemory(worker.pid, pss=True, every_s=0.2) as memory:
                    handles = [
                        await start_episode(
                            env.client, request, "bench-conc", f"bench-conc-{i}-{uuid.uuid4().hex[:4]}"
                        )
                        for i in range(episodes)
                    ]
                    results = await asyncio.gather(*(h.result() for h in handles))
                caches = list(Path("/tmp").glob(f"drlm-contexts-{worker.pid}-*/*"))
            finally:
                worker.stop()
    if any(r.answer != str(size // MB * MB) for r in results):
        raise RuntimeError(f"concurrent: answers {[r.answer for r in results]}")
    sandboxes = {p: v for p, v in memory.by_pid_pss.items() if p != worker.pid and v > size // 2}
    section.add(
        "concurrent_copies",
        "host copies of the context (cache files)",
        "count",
        len(caches),
        target=Target("<=", 1, text="one copy"),
        note=uptime(),
    )
    section.add("concurrent_worker_pss", "worker's peak PSS", "MB", memory.by_pid_pss.get(worker.pid, 0) / MB)
    section.add(
        "concurrent_sandbox_pss",
        f"each sandbox's peak PSS ({len(sandboxes)} sandboxes)",
        "MB",
        [v / MB for v in sandboxes.values()] or [0.0],
        target=Target("<=", size / MB * 1.25, on="max", text=f"<= its str ({size // MB} MB) + 25%"),
    )
    section.add("concurrent_tree_pss", "worker and sandboxes together, peak PSS", "MB", memory.peak_pss / MB)


CASES = {
    "text": text_cases,
    "stores": store_cases,
    "documents": documents_case,
    "concurrent": concurrent_case,
}


async def body(ctx: Context, section: Section) -> None:
    only = os.environ.get("DRLM_BENCH_CONTEXTS", ",".join(CASES)).split(",")
    stores: dict[str, Any] = {}
    with ScriptedModelServer(root_and_sub(TURNS)) as server:
        for name in only:
            if name == "stores" and "path" not in stores:
                await text_cases(ctx, section, server, stores)
            started = uptime()
            if name in ("text", "stores"):
                await CASES[name](ctx, section, server, stores)
            else:
                await CASES[name](ctx, section)
            section.notes.append(f"{name}: started at {started}, ended at {uptime()}")


async def run(ctx: Context) -> Section:
    return await run_section("contexts", "Contexts of any size", body, ctx)


if __name__ == "__main__":
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    section_main(run, __doc__, "contexts.py")
