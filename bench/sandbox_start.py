"""What a REPL sandbox costs to start and to keep, spawned (a fresh interpreter) or forked
from a template process.

    python bench/sandbox_start.py [--sandboxes N]

N sandboxes are started in each mode, the two modes taking turns (so both see the same
load), and all are kept alive. A start is timed from the request to the sandbox's `ready`:
its directory made, its process started, every isolation layer in place. The template's own
start (once per worker) is timed apart. Then every sandbox runs one small cell, and the USS
of each (the memory only it holds, Private_Clean + Private_Dirty of /proc/PID/smaps_rollup:
what discarding it frees) is read, and the PSS of all of them and the template (pages shared
by k processes count 1/k in each: the memory the whole mode takes).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from durable_rlm.activities.repl import LiveSandbox, ReplActivities  # noqa: E402
from durable_rlm.activities.sandbox_processes import uss_bytes  # noqa: E402
from durable_rlm.store.blobs import BlobStore, DirectoryBackend  # noqa: E402
from durable_rlm.workflows.models import SandboxRef  # noqa: E402

MODES = ("spawn", "fork")
CELL = "rows = [f'line {i}: ' + 'x' * (i % 50) for i in range(5_000)]\nprint(len(rows))"
MB = 1024 * 1024


def ref(mode: str, i: int) -> SandboxRef:
    return SandboxRef(
        episode_id=f"bench-{mode}-{i}",
        context=None,
        seed=i,
        log_head=None,
        cell_timeout_s=30,
        output_truncation=1_000,
    )


async def run_cell(box: LiveSandbox) -> None:
    await box.send({"op": "exec", "code": CELL, "cell_name": "<cell 1>", "timeout": 30, "limit": 1_000})
    frame = await box.receive(60)
    assert frame is not None and frame.get("op") == "done" and frame.get("error") is None, frame


def pss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def figures(values: list[float]) -> str:
    return f"median {statistics.median(values):7.1f}  min {min(values):7.1f}  max {max(values):7.1f}"


async def main(count: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="drlm-bench-", dir="/tmp"))
    root.chmod(0o711)  # reachable by the unprivileged sandbox user when run as root
    blobs = BlobStore(DirectoryBackend(root / "blobs"))
    hosts = {mode: ReplActivities(blobs, "bench", root / mode, sandbox_start=mode) for mode in MODES}
    boxes: dict[str, list[LiveSandbox]] = {mode: [] for mode in MODES}
    starts: dict[str, list[float]] = {mode: [] for mode in MODES}
    try:
        began = time.perf_counter()
        template = await hosts["fork"].starter.running_template()
        template_ms = (time.perf_counter() - began) * 1000
        assert template is not None, "the template did not start"
        layers = {mode: await host.probe() for mode, host in hosts.items()}  # also warms each mode
        for i in range(count):
            for mode in MODES:
                began = time.perf_counter()
                box = await hosts[mode].starter.start(ref(mode, i))
                starts[mode].append((time.perf_counter() - began) * 1000)
                boxes[mode].append(box)
        for mode in MODES:
            for box in boxes[mode]:
                assert box.process.kind == mode, (box.process.kind, mode)
                await run_cell(box)
        uss = {mode: [(uss_bytes(b.process.pid) or 0) / MB for b in boxes[mode]] for mode in MODES}
        template_uss = (uss_bytes(template.pid) or 0) / MB
        pss = {mode: sum(pss_bytes(b.process.pid) for b in boxes[mode]) / MB for mode in MODES}
        pss["fork"] += pss_bytes(template.pid) / MB

        print(
            f"{count} sandboxes per mode, started in turns; {os.cpu_count()} CPUs; worker uid {os.geteuid()}"
        )
        # Each sandbox has a uid of its own (root workers): the rest must be the same.
        same = {**layers["spawn"], "uid": ""} == {**layers["fork"], "uid": ""}
        print(f"  layers identical in both modes: {'yes' if same else 'NO'}")
        print("  start, request -> ready with every layer in place (ms):")
        for mode in MODES:
            print(f"    {mode:<6} {figures(starts[mode])}")
        ratio = statistics.median(starts["spawn"]) / statistics.median(starts["fork"])
        print(f"    ratio spawn/fork (medians): {ratio:.1f}x")
        print(f"  template start, once per worker: {template_ms:.0f} ms; template USS {template_uss:.1f} MB")
        print("  USS per live sandbox after one cell (MB):")
        for mode in MODES:
            extra = f" + template {template_uss:.1f} MB" if mode == "fork" else ""
            print(f"    {mode:<6} {figures(uss[mode])}   all {count}: {sum(uss[mode]):.0f} MB{extra}")
        uss_ratio = statistics.median(uss["spawn"]) / statistics.median(uss["fork"])
        print(f"    ratio spawn/fork (medians): {uss_ratio:.1f}x")
        print(
            f"  PSS of all {count} sandboxes (fork: and the template): spawn {pss['spawn']:.0f} MB, "
            f"fork {pss['fork']:.0f} MB, ratio {pss['spawn'] / pss['fork']:.1f}x"
        )
    finally:
        for mode in MODES:
            for box in boxes[mode]:
                await box.kill()
            await hosts[mode].close_all()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--sandboxes", type=int, default=20)
    args = parser.parse_args()
    asyncio.run(main(args.sandboxes))
