"""Section `rebuild`: REPL rebuild time for 10 and 100 logged cells; loading a 100 MB context.

    python bench/rebuild.py [--quick] [--repeats R]

`durable_rlm.activities.repl.ReplActivities` is driven directly (no Temporal), as tests/conftest.py's
`Episode` driver does: N cells, each making one `llm_query` answered by the driver, are run
and logged (SQL blob store, as shipped). Then one probe cell is run at the same log head:

- live: on the sandbox that ran the N cells (the baseline: no rebuild);
- rebuild: after `close_sandbox` (as when a worker reaped or lost the sandbox), the same
  worker re-runs the N logged cells, answering their calls from the log, then the probe;
- new worker: the same on a fresh `ReplActivities` on the same blob store;
- fresh: the probe on a new episode with an empty log (sandbox start alone).

Rebuild time = rebuild step - live step (what the rebuild adds to the step); its replay part
= rebuild step - fresh step. Context load = first step of an episode with a 100 MB context -
the same step with none.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from benchlib import Context, Section, Target, median, ratio, run_section, say, section_main

from durable_rlm.activities.repl import ReplActivities
from durable_rlm.client.episodes import store_context
from durable_rlm.store.blobs import BlobStore, SqlBackend
from durable_rlm.store.sql import open_store
from durable_rlm.workflows.models import (
    CallAnswer,
    CellOutcome,
    CloseSandboxInput,
    ContextRef,
    ExecuteCellInput,
    ResumeCellInput,
    SandboxRef,
)

SIZES = (10, 100)
PROBE = "print(1 + 1)"
TARGET_MS = 50.0
CONTEXT_MB = 100


class Driver:
    """One episode's REPL steps, the way the workflow makes them (tests/conftest.py: Episode)."""

    def __init__(self, context: ContextRef | None = None) -> None:
        self.episode_id = f"bench-{uuid.uuid4().hex[:10]}"
        self.context = context

    def ref(self, head: str | None) -> SandboxRef:
        return SandboxRef(
            episode_id=self.episode_id,
            context=self.context,
            seed=1234,
            log_head=head,
            cell_timeout_s=60,
            output_truncation=2_000,
        )

    async def step(
        self, host: ReplActivities, head: str | None, index: int, code: str
    ) -> tuple[float, CellOutcome]:
        """Run one cell to its end at `head`; the seconds it took and its outcome."""
        started = time.perf_counter()
        outcome = await host.execute_cell(
            ExecuteCellInput(sandbox=self.ref(head), iteration=index, cell_index=index, code=code)
        )
        while outcome.status == "suspended":
            answers = [
                CallAnswer(
                    call_index=r.call_index, prompt_digest=r.prompt_digest, ok=True, text=r.prompt.upper()
                )
                for r in outcome.requests
            ]
            outcome = await host.resume_cell(
                ResumeCellInput(sandbox=self.ref(outcome.log_head), cell_index=index, answers=answers)
            )
        if outcome.error:
            raise RuntimeError(f"cell {index} failed: {outcome.error}")
        return time.perf_counter() - started, outcome


async def one_size(blobs: BlobStore, root: Path, n: int, repeats: int) -> dict[str, list[float]]:
    host = ReplActivities(blobs, "bench-rebuild", root)
    driver = Driver()
    head = None
    try:
        for i in range(1, n + 1):
            _, outcome = await driver.step(
                host, head, i, f"v{i} = llm_query('question {i}')\nprint(len(v{i}))"
            )
            head = outcome.log_head
        times: dict[str, list[float]] = {"live": [], "rebuild": [], "new_worker": [], "fresh": []}
        for _ in range(repeats):
            await host.close_sandbox(CloseSandboxInput(episode_id=driver.episode_id))
            seconds, outcome = await driver.step(host, head, n + 1, PROBE)
            assert outcome.rebuilt, "the step did not rebuild"
            times["rebuild"].append(seconds)
            seconds, outcome = await driver.step(host, outcome.log_head, n + 2, PROBE)
            assert not outcome.rebuilt, "the live step rebuilt"
            times["live"].append(seconds)
            other = ReplActivities(blobs, "bench-rebuild-new", root)
            try:
                seconds, _ = await driver.step(other, head, n + 1, PROBE)
                times["new_worker"].append(seconds)
            finally:
                await other.close_all()
            fresh = Driver()
            seconds, _ = await fresh.step(host, None, 1, PROBE)
            times["fresh"].append(seconds)
            await host.close_sandbox(CloseSandboxInput(episode_id=fresh.episode_id))
    finally:
        await host.close_all()
    return times


async def context_load(blobs: BlobStore, root: Path, mb: int, repeats: int) -> dict[str, list[float]]:
    line = "order 0000000: shipped on time to a customer in the north region\n"
    ref = store_context(blobs, line * (mb * 1024 * 1024 // len(line)))
    host = ReplActivities(blobs, "bench-context", root)
    times: dict[str, list[float]] = {"with": [], "without": []}
    try:
        warm = Driver()  # the host's first sandbox may start a template process: not measured
        await warm.step(host, None, 1, PROBE)
        await host.close_sandbox(CloseSandboxInput(episode_id=warm.episode_id))
        for _ in range(repeats):
            for kind, context in (("without", None), ("with", ref)):
                driver = Driver(context)
                code = "print(len(context))" if context is not None else "print(0)"
                seconds, outcome = await driver.step(host, None, 1, code)
                if context is not None and outcome.stdout.strip() != str(ref.size):
                    raise RuntimeError(f"the sandbox saw a context of {outcome.stdout.strip()} chars")
                times[kind].append(seconds)
                await host.close_sandbox(CloseSandboxInput(episode_id=driver.episode_id))
    finally:
        await host.close_all()
    return times


async def body(ctx: Context, section: Section) -> None:
    sizes = (3, 10) if ctx.quick else SIZES
    mb = 1 if ctx.quick else CONTEXT_MB
    work = ctx.scratch("rebuild")
    root = work / "sandboxes"
    engine = open_store(f"sqlite:///{work / 'drlm.sqlite'}")
    blobs = BlobStore(SqlBackend(engine))
    # warm-up: imports, the first sandbox start, the store
    await one_size(blobs, root, 1, 1)
    largest = max(sizes)
    for n in sizes:
        say(f"rebuild: {n} logged cells, {ctx.repeats} run(s)")
        t = {k: [s * 1000 for s in v] for k, v in (await one_size(blobs, root, n, ctx.repeats)).items()}
        added = [r - live for r, live in zip(t["rebuild"], t["live"], strict=True)]
        replay = [r - f for r, f in zip(t["rebuild"], t["fresh"], strict=True)]
        section.add(f"live_{n}", f"{n} cells: step on the live sandbox", "ms", t["live"], baseline=True)
        section.add(f"fresh_{n}", f"{n} cells: step on a new sandbox, empty log", "ms", t["fresh"])
        section.add(
            f"rebuild_step_{n}",
            f"{n} cells: step that rebuilds (same worker, sandbox closed)",
            "ms",
            t["rebuild"],
            ratio=ratio(median(t["rebuild"]), median(t["live"])),
            ratio_label="of live step",
        )
        section.add(
            f"rebuild_{n}",
            f"{n} cells: rebuild time (rebuild step - live step)",
            "ms",
            added,
            target=Target("<=", TARGET_MS, text=f"<= {TARGET_MS:g} ms") if n == largest else None,
            note=f"replay alone (rebuild step - fresh step): {median(replay):.1f} ms",
        )
        section.add(
            f"new_worker_{n}",
            f"{n} cells: step that rebuilds on a new worker (fresh ReplActivities)",
            "ms",
            t["new_worker"],
            ratio=ratio(median(t["new_worker"]), median(t["live"])),
            ratio_label="of live step",
        )
    say(f"rebuild: loading a {mb} MB context into a sandbox, {ctx.repeats} run(s)")
    c = {k: [s * 1000 for s in v] for k, v in (await context_load(blobs, root, mb, ctx.repeats)).items()}
    section.add(
        "no_context_ms", "first step of an episode without context", "ms", c["without"], baseline=True
    )
    section.add(
        "context_step_ms",
        f"first step of an episode with a {mb} MB context",
        "ms",
        c["with"],
        ratio=ratio(median(c["with"]), median(c["without"])),
        ratio_label="of no context",
        note=f"load time (difference): {median(c['with']) - median(c['without']):.0f} ms",
    )
    section.notes.append(
        "cells: `v{i} = llm_query(...)` + print, answered by the driver; SQL blob store (as shipped); "
        "the probe cell is `print(1 + 1)`"
    )


async def run(ctx: Context) -> Section:
    return await run_section("rebuild", "5. REPL rebuild and context load", body, ctx)


if __name__ == "__main__":
    section_main(run, __doc__)
