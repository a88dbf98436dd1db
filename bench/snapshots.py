"""Section `snapshots`: REPL rebuild time against episode length, with and without snapshots.

    python bench/snapshots.py [--quick] [--repeats R]

`durable_rlm.activities.repl.ReplActivities` is driven directly (no Temporal), as bench/rebuild.py does,
on the SQL blob store. An episode of N cells is run on one worker; then a second worker (same
store and key, no sandbox: a crash) runs a probe cell at the same log head. Rebuild time =
that step - the same probe on the live sandbox. "without" runs the same episode with no
snapshot policy (every cell is re-run), "with" with the default policy (bench figures below
chose it: after 1 s of cells, every 20 cells, after a cell that read the clock).

- length: N trivial cells, N = 10, 100, 1,000;
- long cells: cells of 1 s and of 10 s;
- 100 MB: a namespace holding ~100 MB of variables (random bytes, rows of tuples, floats);
- cost: time a snapshot adds to its step, and its size, for a small and the 100 MB namespace.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from benchlib import Context, Section, Target, median, ratio, run_section, say, section_main
from rebuild import Driver

from durable_rlm.activities.repl import ReplActivities
from durable_rlm.store.blobs import BlobStore, SqlBackend
from durable_rlm.store.sql import open_store
from durable_rlm.workflows.models import SandboxRef, SnapshotPolicy

KEY = b"bench-snapshot-key-0123456789abcdef"
PROBE = "print(1 + 1)"
LENGTHS = (10, 100, 1000)
BIG = (
    "import os, random\n"
    "payload = os.urandom(48 * 2**20)\n"
    "rows = [(i, random.random(), f'name-{i:07d}-{random.getrandbits(32):08x}') for i in range(600_000)]\n"
    "floats = [random.random() for _ in range(1_500_000)]\n"
)


class SnapDriver(Driver):
    def __init__(self, policy: SnapshotPolicy | None) -> None:
        super().__init__()
        self.episode_id = f"snap-{uuid.uuid4().hex[:10]}"
        self.policy = policy

    def ref(self, head: str | None) -> SandboxRef:
        return super().ref(head).model_copy(update={"snapshots": self.policy})


async def episode_rebuild(
    blobs: BlobStore, root: Path, cells: list[str], policy: SnapshotPolicy | None, repeats: int
) -> dict[str, list[float]]:
    """Run the cells on one worker; then time the probe on a new worker, and on the live one."""
    host = ReplActivities(blobs, "bench-a", root / "a", snapshot_key=KEY)
    driver = SnapDriver(policy)
    head = None
    times: dict[str, list[float]] = {"rebuild": [], "live": [], "rerun": [], "step": []}
    try:
        for i, code in enumerate(cells, 1):
            seconds, outcome = await driver.step(host, head, i, code)
            times["step"].append(seconds)
            head = outcome.log_head
        live_head = head  # where the first worker's sandbox is
        for _ in range(repeats):
            other = ReplActivities(blobs, "bench-b", root / "b", snapshot_key=KEY)
            try:
                seconds, outcome = await driver.step(other, head, len(cells) + 1, PROBE)
            finally:
                await other.close_all()
            assert outcome.rebuild is not None, "the new worker did not rebuild"
            times["rebuild"].append(seconds)
            times["rerun"].append(float(outcome.rebuild.cells_rerun))
            seconds, outcome = await driver.step(host, live_head, len(cells) + 1, PROBE)
            assert outcome.rebuild is None, "the live step rebuilt"
            times["live"].append(seconds)
            live_head = outcome.log_head
    finally:
        await host.close_all()
    return times


def add_pair(
    section: Section, key: str, label: str, cells: list[str], t: dict[str, dict], target=None
) -> None:
    out = {}
    for kind in ("without", "with"):
        added = [(r - live) * 1000 for r, live in zip(t[kind]["rebuild"], t[kind]["live"], strict=True)]
        out[kind] = added
    section.add(f"{key}_without", f"{label}: rebuild, every cell re-run", "ms", out["without"], baseline=True)
    section.add(
        f"{key}_with",
        f"{label}: rebuild from the latest snapshot",
        "ms",
        out["with"],
        ratio=ratio(median(out["with"]), median(out["without"])),
        ratio_label="of without",
        target=target,
        note=f"cells re-run: {median(t['with']['rerun']):.0f} of {len(cells)}",
    )


async def body(ctx: Context, section: Section) -> None:
    work = ctx.scratch("snapshots")
    engine = open_store(f"sqlite:///{work / 'drlm.sqlite'}")
    blobs = BlobStore(SqlBackend(engine))
    default = SnapshotPolicy()
    await episode_rebuild(blobs, work, ["x = 1"], default, 1)  # warm-up: template, store
    lengths = (10, 100) if ctx.quick else LENGTHS
    for n in lengths:
        say(f"snapshots: {n} trivial cells")
        cells = [f"v{i} = {i} * 2" for i in range(1, n + 1)]
        t = {
            kind: await episode_rebuild(blobs, work, cells, policy, ctx.repeats)
            for kind, policy in (("without", None), ("with", default))
        }
        add_pair(section, f"length_{n}", f"{n} cells", cells, t)
    long = ((0.2, 3), (1.0, 2)) if ctx.quick else ((1.0, 3), (10.0, 2))
    for seconds, count in long:
        say(f"snapshots: {count} cells of {seconds:g} s")
        cells = [f"import time\ntime.sleep({seconds})\nw{i} = {i}" for i in range(count)]
        t = {
            kind: await episode_rebuild(blobs, work, cells, policy, 1)
            for kind, policy in (("without", None), ("with", default))
        }
        add_pair(section, f"long_{seconds:g}s", f"{count} cells of {seconds:g} s", cells, t)
    say("snapshots: a namespace of ~100 MB")
    big = BIG if not ctx.quick else BIG.replace("48 * 2**20", "4 * 2**20").replace("600_000", "50_000")
    big = big.replace("1_500_000", "150_000") if ctx.quick else big
    t = {
        kind: await episode_rebuild(blobs, work, [big], policy, ctx.repeats)
        for kind, policy in (("without", None), ("with", SnapshotPolicy(every_cells=1)))
    }
    add_pair(
        section,
        "big",
        "one cell making ~100 MB of variables",
        [big],
        t,
        target=Target("<=", 1000.0, text="<= 1 s"),
    )
    # What a snapshot costs its step: the same first cell with and without one.
    say("snapshots: time a snapshot adds to its step")
    for label, code in (("small namespace", "a = list(range(1000))\nb = {'k': 'v' * 100}"), ("~100 MB", big)):
        steps: dict[str, list[float]] = {}
        size = 0
        for kind, policy in (("without", None), ("with", SnapshotPolicy(every_cells=1))):
            runs = []
            for _ in range(ctx.repeats):
                host = ReplActivities(blobs, "bench-cost", work / "cost", snapshot_key=KEY)
                driver = SnapDriver(policy)
                try:
                    _, first = await driver.step(host, None, 1, "pass")  # the sandbox is started
                    seconds, outcome = await driver.step(host, first.log_head, 2, code)
                    runs.append(seconds * 1000)
                    if policy is not None:
                        assert outcome.snapshot is not None
                        size = outcome.snapshot.size
                finally:
                    await host.close_all()
            steps[kind] = runs
        key = "cost_small" if label.startswith("small") else "cost_big"
        section.add(
            f"{key}_without", f"{label}: the cell's step, no snapshot", "ms", steps["without"], baseline=True
        )
        section.add(
            f"{key}_with",
            f"{label}: the same step with a snapshot",
            "ms",
            steps["with"],
            ratio=ratio(median(steps["with"]), median(steps["without"])),
            ratio_label="of without",
            note=f"snapshot size {size / 2**20:.2f} MB; "
            f"adds {median(steps['with']) - median(steps['without']):.1f} ms",
        )
    section.notes.append(
        "rebuild = probe step on a new worker (same store and key) - the probe on the live sandbox; "
        "SQL blob store; default policy unless noted (100 MB and cost rows: every cell)"
    )


async def run(ctx: Context) -> Section:
    return await run_section("snapshots", "7. REPL snapshots: rebuild time against episode length", body, ctx)


if __name__ == "__main__":
    section_main(run, __doc__)
