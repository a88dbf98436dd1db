"""What one episode may put on disk: its sandbox's files (a size-limited tmpfs in the sandbox's
own mount namespace, counted in its memory) and its REPL snapshots (a quota per episode, the
older ones replaced), through real episodes on a real worker.

The report: a cell making 240 MB of variables added 240 MB of snapshot to drlm.sqlite each
time (720 MB in 20 s; ~77 GB for an episode of 320 cells); a cell wrote 1 GB into its
sandbox directory on the host's /tmp in 3 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from durable_rlm.activities.repl import ReplActivities
from durable_rlm.activities.repl_snapshots import Snapshots
from durable_rlm.audit.timeline import episode_timeline
from durable_rlm.scripted import ChatRequest, Reply
from durable_rlm.store.blobs import BlobStore, DirectoryBackend
from durable_rlm.store.chains import SnapshotTaken, StoredSnapshot
from durable_rlm.store.snapshot_pins import pin_snapshot, snapshot_pinned
from durable_rlm.workflows.models import DurabilitySettings, EpisodeLimits, SnapshotPolicy
from tests.conftest import Episode, request_for, run_episode
from tests.worker_health import WorkerHealth

ROOT_WORKER = os.geteuid() == 0
MB = 2**20


def script_of(cells: list[str], after: str = "FINAL(survived)"):
    """The cells one per turn, then `after`; sub-calls answered in capitals."""

    def script(request: ChatRequest) -> Reply | str:
        if not request.is_root:
            return request.last_user.upper()
        if request.turn < len(cells):
            return f"```repl\n{cells[request.turn]}\n```"
        return after

    return script


def disk_used(path: Path) -> int:
    """Bytes of the files under `path`, as the host's disk holds them (links not followed)."""
    total = 0
    for directory, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(directory, name)).st_blocks * 512
            except OSError:
                pass
    return total


@pytest.fixture(params=[True, False], ids=["hook-on", "hook-off"])
async def health(request: pytest.FixtureRequest, worker, client, scripted) -> WorkerHealth:
    worker.config.audit_hook = request.param  # the tmpfs holds without the sandbox's hook
    worker.config.files_mb = 64  # read as each sandbox starts
    return await WorkerHealth.measure(client, worker, scripted)


# --- the sandbox's files -------------------------------------------------------------------------

FILL = (
    "import os\nwritten = 0\n"
    "try:\n"
    "    for n in range(400):\n"
    "        with open(f'fill-{n}', 'wb') as f:\n"
    "            f.write(os.urandom(1 << 20))\n"
    "        written += 1 << 20\n"
    "except OSError as exc:\n"
    "    print('stopped', exc.errno, written >> 20)\n"
)
"""400 MB, a megabyte a file (RLIMIT_FSIZE bounds one file, not the total): past the 64 MB
the test gives the tmpfs, and what the host's /tmp would take without it."""


async def test_a_cell_filling_its_directory_stops_at_its_tmpfs_and_the_host_disk_is_untouched(
    client, worker: ReplActivities, scripted, health: WorkerHealth
) -> None:
    before = disk_used(worker.sandbox_root)
    episode_id = f"fill-{uuid.uuid4().hex[:8]}"
    cells = [FILL, "print(len([n for n in os.listdir('.') if n.startswith('fill-')]))"]
    server = scripted(script_of(cells, "FINAL(survived)"))
    limits = EpisodeLimits(max_iterations=5, cell_timeout_s=30)
    result = await run_episode(client, request_for(server, limits=limits), worker.task_queue, episode_id)
    assert result.answer == "survived", result
    timeline = await episode_timeline(client, episode_id)
    filled, listed = timeline.iterations[0].cells[0], timeline.iterations[1].cells[0]
    errno_, megabytes = (int(x) for x in filled.stdout.split()[1:3])
    assert errno_ == 28 and 50 <= megabytes <= 64, filled  # ENOSPC at the tmpfs's 64 MB
    assert 50 <= int(listed.stdout) <= 65  # its files stay its own (the last one cut short)
    assert disk_used(worker.sandbox_root) - before < 8 * MB  # nothing of it on the host's disk
    await health.check(client, worker, scripted)


@pytest.mark.skipif(not ROOT_WORKER, reason="a cgroup of the sandbox's own is made by a root worker")
async def test_the_tmpfs_counts_in_the_sandboxes_memory(host: ReplActivities) -> None:
    from durable_rlm.activities.sandbox import cgroups

    if not cgroups.support().available:
        pytest.skip(f"no cgroup for sandboxes here: {cgroups.support().reason}")
    episode = Episode(host)
    await episode.run("x = 1")
    box = host.pool.live[episode.episode_id]
    memory = next(h for h in cgroups.support().hierarchies if "memory" in h.controllers)
    usage = "memory.current" if memory.version == 2 else "memory.usage_in_bytes"
    current = Path(memory.base) / cgroups.leaf_name(box.directory) / usage
    held = int(current.read_text())
    written = await episode.run("import os\nopen('blob', 'wb').write(os.urandom(48 << 20))\nprint('written')")
    assert written.stdout == "written\n", written
    assert int(current.read_text()) - held > 40 * MB  # the tmpfs's pages are the sandbox's
    assert (await episode.run("os.remove('blob')\nprint('freed')")).stdout == "freed\n"
    assert int(current.read_text()) - held < 8 * MB


NOT_ROOT = """
import json, os, struct, subprocess, sys
directory, child = sys.argv[1], sys.argv[2]
process = subprocess.Popen(
    [sys.executable, "-s", "-P", child, str(os.getpid()), directory], stdin=subprocess.PIPE,
    stdout=subprocess.PIPE, cwd=directory, env={"PATH": "/usr/bin:/bin", "HOME": directory},
    start_new_session=True,
)
def send(message):
    body = json.dumps(message).encode()
    process.stdin.write(struct.pack(">I", len(body)) + body)
    process.stdin.flush()
def receive():
    (length,) = struct.unpack(">I", process.stdout.read(4))
    return json.loads(process.stdout.read(length))
init = {"op": "init", "seed": 1, "memory_mb": 1024, "audit_hook": False, "processes": 64, "dir_mb": 16}
send({**init, "seq": 1})
layers = receive()["layers"]
code = (
    "open('out', 'w').write('written in its tmpfs')\\n"
    "try:\\n    open('big', 'wb').write(b'x' * (40 << 20))\\n"
    "except OSError as exc:\\n    print('stopped', exc.errno)"
)
send({"op": "exec", "code": code, "cell_name": "<cell 1>", "timeout": 10, "limit": 1000, "seq": 2})
stdout = receive()["stdout"]
seen = open(f"/proc/{process.pid}/root{directory}/out").read()  # through its own view
print(json.dumps({"layers": layers, "stdout": stdout, "seen": seen, "on_host": os.listdir(directory)}))
process.kill()
"""


def test_a_worker_that_is_not_root_bounds_its_sandboxes_files_and_reads_them_through_their_view(
    sandboxes: Path,
) -> None:
    """As uid `nobody` with the system's Python (the sandbox needs only its standard library):
    the tmpfs is made in the sandbox's user namespace, and the worker, of the same uid, reads
    what the sandbox wrote through /proc/PID/root (its keeper lets it)."""
    from durable_rlm.activities.sandbox import kernel

    python = "/usr/bin/python3"
    if not ROOT_WORKER or not os.path.exists(python):
        pytest.skip("needs root (to become another user) and /usr/bin/python3")
    directory = sandboxes / "not-root"
    directory.mkdir(mode=0o777)
    directory.chmod(0o777)
    child = str(Path(kernel.__file__).with_name("child.py"))
    setpriv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    out = subprocess.run(
        [*setpriv, python, "-c", NOT_ROOT, str(directory), child], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert "own directory a tmpfs of 16 MB" in seen["layers"]["filesystem"], seen["layers"]
    assert seen["stdout"] == "stopped 28\n"  # ENOSPC at 16 MB
    assert seen["seen"] == "written in its tmpfs"
    assert "out" not in seen["on_host"] and "big" not in seen["on_host"]  # nothing on the host's disk


NO_PTRACE = """
import asyncio, json, sys, tempfile
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from durable_rlm.activities.repl import ReplActivities
from durable_rlm.store.blobs import BlobStore, DirectoryBackend
from durable_rlm.workflows.models import SnapshotPolicy
from tests.conftest import Episode

async def main():
    base = Path(tempfile.mkdtemp(prefix="drlm-noptrace-", dir="/tmp"))
    base.chmod(0o711)
    host = ReplActivities(BlobStore(DirectoryBackend(base / "blobs")), "q", base / "s", memory_mb=1024)
    try:
        layers = await host.probe()
        episode = Episode(host, snapshots=SnapshotPolicy(every_cells=1))
        first = await episode.run("x = 41")
        await host.pool.discard(host.pool.live[episode.episode_id])
        second = await episode.run("print(x + 1)")
        print(json.dumps({"view": layers.get("view"), "note": first.snapshot_note, "stdout": second.stdout}))
    finally:
        await host.close_all()
        import shutil
        shutil.rmtree(base, ignore_errors=True)
asyncio.run(main())
"""


@pytest.mark.skipif(not ROOT_WORKER, reason="a root worker without CAP_SYS_PTRACE, as in a container")
def test_a_root_worker_without_ptrace_keeps_the_tmpfs_and_says_its_snapshots_are_off() -> None:
    """Docker gives root no CAP_SYS_PTRACE unless asked: /proc/PID/root of a sandbox of its
    own uid is then closed to the worker. The disk bound holds; snapshots are off, said by
    `drlm doctor`'s layers and in each cell's timeline; a rebuild re-runs the cells."""
    from tests.conftest import ROOT

    out = subprocess.run(
        ["setpriv", "--bounding-set=-sys_ptrace", sys.executable, "-c", NO_PTRACE, str(ROOT)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["view"].startswith("unreadable") and "CAP_SYS_PTRACE" in seen["view"]
    assert "no snapshot after cell 1: unreadable" in seen["note"]
    assert seen["stdout"] == "42\n"


async def test_host_files_are_read_only_to_the_sandbox_and_snapshots_cross_both_ways(
    host: ReplActivities,
) -> None:
    """The context the host wrote is where cells find it, read-only; the host's side of the
    directory is seen read-only at /.drlm-host; a snapshot the sandbox writes in its tmpfs is
    read through its own view, and one the host writes is loaded by a new sandbox."""
    episode = Episode(host, context="the context", snapshots=SnapshotPolicy(every_cells=1))
    first = await episode.run("print(open('context.txt').read(), context)\nkept = [1, 2, 3]")
    assert first.stdout == "the context the context\n"
    refused = await episode.run("open('context.txt', 'w')\n")
    assert "Read-only file system" in (refused.error or "") or "not allowed" in (refused.error or "")
    refused = await episode.run("open('/.drlm-host/planted', 'w')\n")
    assert "Read-only file system" in (refused.error or "") or "not allowed" in (refused.error or "")
    taken = await episode.run("kept.append(4)")
    assert taken.snapshot is not None
    await host.pool.discard(host.pool.live[episode.episode_id])
    back = await episode.run("print(kept)")
    assert back.stdout == "[1, 2, 3, 4]\n" and back.rebuild is not None
    assert back.rebuild.from_snapshot == taken.snapshot.cell


# --- snapshots ---------------------------------------------------------------------------------


def blob_size(blobs: BlobStore, digest: str) -> int | None:
    try:
        return len(blobs.get(digest))
    except KeyError:
        return None


async def snapshots_of(client, episode_id: str) -> list[str]:
    """The digests of the snapshots the episode took, cell by cell, as its timeline has them."""
    timeline = await episode_timeline(client, episode_id)
    return [c.snapshot.digest for it in timeline.iterations for c in it.cells if c.snapshot is not None]


@pytest.mark.parametrize("hook", [True, False], ids=["hook-on", "hook-off"])
async def test_an_episode_keeps_its_snapshot_quota_and_older_snapshots_go(
    client, worker: ReplActivities, scripted, blobs: BlobStore, hook: bool
) -> None:
    """Six cells of 24 MB of variables each, every cell snapshotted, a quota of 64 MB: the
    store keeps the newest that fit (at most 64 MB), the older ones are gone. Without the
    quota the store would hold 6 x 24 MB."""
    worker.config.audit_hook = hook
    health = await WorkerHealth.measure(client, worker, scripted)
    cells = ["import os\nv = os.urandom(24 << 20)"] + ["v = os.urandom(24 << 20)"] * 5
    server = scripted(script_of(cells, "FINAL(kept)"))
    durability = DurabilitySettings(
        heartbeat_timeout_s=3,
        sticky_schedule_to_start_s=3,
        snapshots=SnapshotPolicy(every_cells=1, max_mb=64),
    )
    episode_id = f"quota-{uuid.uuid4().hex[:8]}"
    limits = EpisodeLimits(max_iterations=10, cell_timeout_s=30)
    result = await run_episode(
        client, request_for(server, limits=limits, durability=durability), worker.task_queue, episode_id
    )
    assert result.answer == "kept", result
    taken = await snapshots_of(client, episode_id)
    assert len(taken) == 6, taken  # each fits beside the one before it
    stored = [blob_size(blobs, d) for d in taken]
    held = sum(size for size in stored if size is not None)
    assert held <= 64 * MB, stored
    assert stored[-1] is not None and stored[-2] is not None  # the newest two are always kept
    assert stored[:4] == [None] * 4  # the older went as the newer needed the room
    await health.check(client, worker, scripted)


@pytest.mark.slow  # the report's scale: ~1.2 GB of snapshots taken, 30 s; CI runs it
async def test_cells_of_240_mb_of_variables_leave_at_most_the_quota_in_the_store(
    client, worker: ReplActivities, scripted, blobs: BlobStore
) -> None:
    health = await WorkerHealth.measure(client, worker, scripted)
    cells = ["import os\nv = os.urandom(240 << 20)"] + ["v = os.urandom(240 << 20)"] * 4
    server = scripted(script_of(cells, "FINAL(kept)"))
    durability = DurabilitySettings(
        heartbeat_timeout_s=10,
        sticky_schedule_to_start_s=10,
        snapshots=SnapshotPolicy(every_cells=1, max_mb=512),
    )
    episode_id = f"quota-240-{uuid.uuid4().hex[:8]}"
    limits = EpisodeLimits(max_iterations=10, cell_timeout_s=60)
    result = await run_episode(
        client, request_for(server, limits=limits, durability=durability), worker.task_queue, episode_id
    )
    assert result.answer == "kept", result
    taken = await snapshots_of(client, episode_id)
    stored = [blob_size(blobs, d) for d in taken]
    assert len(taken) == 5 and stored[:3] == [None] * 3, stored  # 5 x 240 MB taken, 2 kept
    assert sum(size for size in stored if size is not None) <= 512 * MB
    await health.check(client, worker, scripted)


async def test_a_snapshot_over_the_quota_is_not_taken_and_the_timeline_says_why(
    client, worker: ReplActivities, scripted
) -> None:
    cells = ["import os\nsmall = os.urandom(8 << 20)", "big = os.urandom(40 << 20)", "print(len(big))"]
    server = scripted(script_of(cells, "FINAL(noted)"))
    durability = DurabilitySettings(
        heartbeat_timeout_s=3,
        sticky_schedule_to_start_s=3,
        snapshots=SnapshotPolicy(every_cells=1, max_mb=32),
    )
    episode_id = f"over-{uuid.uuid4().hex[:8]}"
    limits = EpisodeLimits(max_iterations=10, cell_timeout_s=30)
    result = await run_episode(
        client, request_for(server, limits=limits, durability=durability), worker.task_queue, episode_id
    )
    assert result.answer == "noted", result
    timeline = await episode_timeline(client, episode_id)
    first, second = timeline.iterations[0].cells[0], timeline.iterations[1].cells[0]
    assert first.snapshot is not None
    assert second.snapshot is None and second.snapshot_note is not None, second
    assert "no snapshot after cell 2" in second.snapshot_note
    assert "keeps 32 MB of snapshots, snapshots.max_mb" in second.snapshot_note


def test_the_oldest_snapshots_go_first_and_a_pinned_one_stays(tmp_path: Path) -> None:
    blobs = BlobStore(DirectoryBackend(tmp_path))
    refs = [blobs.put(bytes([n]) * (10 * MB)) for n in range(4)]
    pin_snapshot(blobs, refs[0])
    assert snapshot_pinned(blobs, refs[0]) and not snapshot_pinned(blobs, refs[1])
    snapshots = Snapshots.__new__(Snapshots)
    snapshots.blobs = blobs
    previous = SnapshotTaken(
        ref=refs[2],
        cell=3,
        episode="e",
        size=10 * MB,
        kept=[StoredSnapshot(ref=r, size=10 * MB) for r in refs[:2]],
    )
    new = SnapshotTaken(ref=refs[3], cell=4, episode="e", size=10 * MB)
    kept = snapshots._kept_beside(previous, new, quota=25 * MB)
    assert [k.ref for k in kept] == [refs[2]]  # the one before the newest, whatever the quota
    assert blob_size(blobs, refs[1]) is None  # deleted
    assert blob_size(blobs, refs[0]) is not None  # pinned: a fork loads it
    assert (
        SnapshotTaken(ref="r", cell=1, episode="e", size=1).signed_part()
        == SnapshotTaken(ref="r", cell=1, episode="e", size=1, kept=kept).signed_part()
    )  # the inventory is not signed: entries logged before it verify alike


def test_doctor_states_what_an_episode_may_put_on_disk(tmp_path: Path) -> None:
    from tests.test_cli import drlm

    out = drlm(tmp_path, "doctor", COLUMNS="400")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "sandbox files" in out.stdout and "REPL snapshots" in out.stdout
    assert "a tmpfs of 1,024 MB (DRLM_SANDBOX_FILES_MB)" in out.stdout or "host's disk" in out.stdout
    assert "each episode keeps at most 1,024 MB of snapshots" in out.stdout
