"""Sandbox hygiene (issue 15, item 5): a worker killed with SIGKILL leaves no sandbox
directory and no sandbox process behind once another worker on the same root has started,
and no worker ever touches the sandboxes of a live one."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from durable_rlm.activities import sandbox_reaper
from durable_rlm.activities.repl import ReplActivities
from durable_rlm.activities.sandbox import CHILD_PATH
from durable_rlm.activities.sandbox_reaper import (
    CLAIMED_PREFIX,
    NEW_PREFIX,
    OWNER_FILE,
    UID_CLAIMS,
    Owner,
    reap_dead,
)
from durable_rlm.client.episodes import start_episode
from durable_rlm.host import processes
from durable_rlm.host.processes import proc_stat
from durable_rlm.scripted import root_and_sub
from durable_rlm.store.blobs import BlobStore
from durable_rlm.workflows.models import ContextRef, SandboxRef
from tests.conftest import ROOT, Episode, request_for

ROOT_WORKER = os.geteuid() == 0
NOBODY = 65534


# --- helpers ----------------------------------------------------------------------------------


def sandbox_processes(owners: set[int]) -> list[int]:
    """Running processes whose command line is a sandbox's or a template's of one of `owners`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        found_stat = proc_stat(int(entry.name))
        if found_stat is None or found_stat.state == "Z":
            continue
        for arg, after in zip(argv, argv[1:], strict=False):
            if os.path.basename(arg) in (b"child.py", b"forkserver.py") and after.isdigit():
                if int(after) in owners:
                    found.append(int(entry.name))
    return found


async def until(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.05)


def dead_process() -> tuple[int, int]:
    """The pid and start time of a process that has ended (and was reaped)."""
    process = subprocess.Popen(["sleep", "60"])
    found = proc_stat(process.pid)
    assert found is not None
    process.kill()
    process.wait()
    return process.pid, found.start


def me() -> Owner:
    owner = Owner.current()
    assert owner is not None
    return owner


def make_home(root: Path, owner: Owner | bytes | None, sandboxes: int = 2) -> Path:
    """A home as a worker leaves it: owner file (or `bytes` for a broken one, None for none),
    sandbox directories with files; owned by `nobody` as a root worker's sandboxes are."""
    home = root / f"w-{owner.pid if isinstance(owner, Owner) else 0}-{uuid.uuid4().hex[:8]}"
    home.mkdir(mode=0o711)
    if isinstance(owner, Owner):
        (home / OWNER_FILE).write_text(json.dumps(owner.__dict__))
    elif owner is not None:
        (home / OWNER_FILE).write_bytes(owner)
    for n in range(sandboxes):
        sandbox = home / f"ep-{n}-{uuid.uuid4().hex[:8]}"
        (sandbox / "made" / "deeper").mkdir(parents=True)
        (sandbox / "context.txt").write_text("context")
        (sandbox / "made" / "deeper" / "out.txt").write_text("written by a cell")
        if ROOT_WORKER:
            for path in [sandbox, *sandbox.rglob("*")]:
                os.chown(path, NOBODY, NOBODY)
        (sandbox / "made" / "deeper" / "out.txt").chmod(0o000)
        (sandbox / "made").chmod(0o500)  # the cell made its directory read-only
    return home


def fake_sandbox(owner_pid: int, directory: Path) -> subprocess.Popen[bytes]:
    """The real sandbox program, started as a worker starts it, waiting for its init frame:
    a process that outlived its worker (none of its layers, the death signal included, is
    in place before the init frame)."""
    return subprocess.Popen(
        [sys.executable, "-s", "-P", str(CHILD_PATH), str(owner_pid), str(directory)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
    )


def record(home: Path, pid: int, start: int) -> None:
    (home / f"{pid}.proc").write_text(json.dumps({"pid": pid, "start": start, "role": "sandbox"}))


@pytest.fixture
def root() -> Iterator[Path]:
    """A sandbox root of this test's own, traversable by the unprivileged sandbox user."""
    path = Path(tempfile.mkdtemp(prefix="drlm-hygiene-", dir="/tmp"))
    path.chmod(0o711)
    yield path
    sandbox_reaper.remove_tree(path)


# --- the reaper -------------------------------------------------------------------------------


def test_a_dead_owners_home_and_leftover_processes_are_removed(root: Path) -> None:
    owner_pid, owner_start = dead_process()
    home = make_home(root, Owner(owner_pid, owner_start, me().boot, me().pidns))
    leftover = fake_sandbox(owner_pid, home)
    wrong_owner = fake_sandbox(owner_pid + 1, home)  # a sandbox, but not that worker's
    reused = fake_sandbox(owner_pid, home)  # its pid was recorded for a process started earlier
    unrelated = subprocess.Popen(["sleep", "60"])  # recorded, but not a sandbox
    try:
        for process in (leftover, wrong_owner, reused, unrelated):
            found = proc_stat(process.pid)
            assert found is not None
            record(home, process.pid, found.start - 1 if process is reused else found.start)
        (home / "9.proc").write_text("{broken")  # a record cut short is skipped

        reaped = reap_dead(root)

        assert [(r.home, r.owner_pid, r.sandboxes, r.killed, r.removed) for r in reaped] == [
            (home.name, owner_pid, 2, [leftover.pid], True)
        ]
        assert leftover.wait(10) == -signal.SIGKILL
        assert wrong_owner.poll() is None and unrelated.poll() is None and reused.poll() is None
        assert list(root.iterdir()) == []
    finally:
        for process in (leftover, wrong_owner, reused, unrelated):
            process.kill()
            process.wait()


def test_a_reused_pid_is_not_the_owner(root: Path) -> None:
    """The owner's pid runs, but a process started at another time: the owner is dead."""
    here = me()
    reused = make_home(root, Owner(here.pid, here.start + 1, here.boot, here.pidns))
    earlier_boot = make_home(root, Owner(here.pid, here.start, "another-boot", here.pidns))
    mine = make_home(root, here)
    assert {r.home for r in reap_dead(root)} == {reused.name, earlier_boot.name}
    assert list(root.iterdir()) == [mine]


def test_a_live_owners_home_and_another_pid_namespaces_are_left_alone(root: Path) -> None:
    here = me()
    mine = make_home(root, here)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        live = make_home(root, Owner(sleeper.pid, proc_stat(sleeper.pid).start, here.boot, here.pidns))  # type: ignore[union-attr]
        owner_pid, owner_start = dead_process()
        foreign = make_home(root, Owner(owner_pid, owner_start, here.boot, "pid:[1]"))  # can't judge
        assert reap_dead(root, grace_s=0) == []
        assert sorted(root.iterdir()) == sorted([mine, live, foreign])
    finally:
        sleeper.kill()
        sleeper.wait()
    assert {r.home for r in reap_dead(root)} == {live.name}  # once its owner is gone


@pytest.mark.parametrize(
    "owner_file",
    [None, b"", b'{"pid": 12', b"[1, 2]", b'{"pid": -1, "start": 5, "boot": "", "pidns": ""}', b"\xff\xfe"],
    ids=["missing", "empty", "partial", "list", "negative", "binary"],
)
def test_a_home_without_a_readable_owner_is_reaped_only_once_old(
    root: Path, owner_file: bytes | None
) -> None:
    home = make_home(root, owner_file)
    assert reap_dead(root) == []  # young: it may be being made
    assert home.exists()
    [reaped] = reap_dead(root, grace_s=0)
    assert (reaped.home, reaped.owner_pid, reaped.removed) == (home.name, None, True)
    assert list(root.iterdir()) == []


def test_half_made_and_half_reaped_homes_are_finished_once_old_and_strangers_are_left(
    root: Path, tmp_path: Path
) -> None:
    owner_pid, owner_start = dead_process()
    half_made = root / f"{NEW_PREFIX}abc"
    half_made.mkdir()
    half_reaped = make_home(root, Owner(owner_pid, owner_start, me().boot, me().pidns))
    half_reaped = half_reaped.rename(root / f"{CLAIMED_PREFIX}def")
    (root / "w-a-file").write_text("not a home")
    (root / "ep-legacy-12345678").mkdir()  # the flat layout of older workers: not judged
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep")
    (root / "w-a-link").symlink_to(outside)

    assert reap_dead(root) == []
    assert {r.owner_pid for r in reap_dead(root, grace_s=0)} == {None, owner_pid}
    assert sorted(p.name for p in root.iterdir()) == ["ep-legacy-12345678", "w-a-file", "w-a-link"]
    assert (outside / "precious").read_text() == "keep"


def test_reapers_racing_claim_each_dead_home_once(root: Path) -> None:
    """Eight reapers at once over 40 dead homes: each is reaped by exactly one, none fails,
    and homes vanishing mid-scan (under another reaper) are skipped."""
    owner_pid, owner_start = dead_process()
    dead = Owner(owner_pid, owner_start, me().boot, me().pidns)
    homes = {make_home(root, dead, sandboxes=3).name for _ in range(40)}
    results: list[list[sandbox_reaper.Reaped]] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def reaper() -> None:
        barrier.wait()
        try:
            results.append(reap_dead(root))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=reaper) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    claimed = [r.home for result in results for r in result]
    assert sorted(claimed) == sorted(homes)
    assert list(root.iterdir()) == []


def test_a_home_vanishing_mid_scan_is_skipped(root: Path) -> None:
    owner_pid, owner_start = dead_process()
    make_home(root, Owner(owner_pid, owner_start, me().boot, me().pidns))
    entries = list(os.scandir(root))
    shutil.rmtree(entries[0].path)
    assert sandbox_reaper._reap_one(root, entries[0], me(), 0) is None


@pytest.mark.skipif(not ROOT_WORKER, reason="needs root to run a reaper as another user")
def test_a_reaper_of_another_uid_reaps_its_own_dead_homes_and_leaves_root_owned_ones(root: Path) -> None:
    """A non-root worker: it removes its dead home even where a cell made things read-only,
    and leaves a home of another user (here root's) alone."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("no system python the unprivileged user can run")
    owner_pid, owner_start = dead_process()
    dead = Owner(owner_pid, owner_start, me().boot, me().pidns)
    theirs = make_home(root, dead)  # made by root: sandboxes as nobody, home as root
    own = make_home(root, dead)
    for path in [own, *own.rglob("*")]:
        os.chown(path, NOBODY, NOBODY, follow_symlinks=False)
    os.chown(root, NOBODY, NOBODY)  # the root of a worker running as that user
    # The reaper is standard library only, and of the package it needs durable_rlm.host alone:
    # both copied where that user can read them.
    module = root / "reaper_copy.py"
    shutil.copy(sandbox_reaper.__file__, module)
    package = root / "alone" / "durable_rlm"
    (package / "host").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "host" / "__init__.py").write_text("")
    shutil.copy(processes.__file__, package / "host" / "processes.py")
    for path in [module, root / "alone", *(root / "alone").rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    script = textwrap.dedent(
        f"""
        import importlib.util, json, sys
        sys.path.insert(0, {str(root / "alone")!r})
        spec = importlib.util.spec_from_file_location("reaper", {str(module)!r})
        reaper = sys.modules["reaper"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(reaper)
        from pathlib import Path
        print(json.dumps([r.home for r in reaper.reap_dead(Path({str(root)!r}))]))
        """
    )
    done = subprocess.run(
        [python, "-I", "-B", "-c", script],  # -I: the reaper alone, whatever PYTHONPATH says
        user=NOBODY,
        group=NOBODY,
        capture_output=True,
        text=True,
        timeout=30,
        cwd="/",
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [own.name], done.stderr
    assert sorted(p.name for p in root.iterdir()) == sorted([theirs.name, module.name, "alone"])


# --- the REPL host ----------------------------------------------------------------------------


async def test_a_host_keeps_its_sandboxes_in_a_home_of_its_own_and_removes_it_when_closed(
    blob_store: BlobStore, root: Path
) -> None:
    host = ReplActivities(blob_store, "q", root, memory_mb=1024)
    try:
        episode = Episode(host)
        await episode.run("x = 1")
        box = host.pool.live[episode.episode_id]
        assert box.directory.parent == host.home.path
        owner = Owner.parse((host.home.path / OWNER_FILE).read_bytes())
        assert owner == me()
        recorded = {json.loads(p.read_text())["role"]: p.stem for p in host.home.path.glob("*.proc")}
        assert recorded == {"sandbox": str(box.process.pid), "template": str(host.starter.template.pid)}  # type: ignore[union-attr]
        if ROOT_WORKER:
            assert (host.home.path.stat().st_uid, host.home.path.stat().st_mode & 0o777) == (0, 0o711)

        other = ReplActivities(blob_store, "q2", root, memory_mb=1024)  # a second worker starts
        assert (await episode.run("print(x)")).stdout == "1\n"  # and left this one alone
        await other.close_all()

        await host.pool.discard(box)
        host.home.forget_ended()
        assert [p.stem for p in host.home.path.glob("*.proc")] == [str(host.starter.template.pid)]  # type: ignore[union-attr]
    finally:
        await host.close_all()
    assert list(root.iterdir()) == []
    episode = Episode(host)  # used again after closing: a new home
    await episode.run("y = 2")
    assert host.home.path.is_dir()
    await host.close_all()


async def test_a_sandbox_that_fails_to_start_leaves_no_directory(blob_store: BlobStore, root: Path) -> None:
    host = ReplActivities(blob_store, "q", root, memory_mb=1024)
    try:
        ref = SandboxRef(
            episode_id="missing-context",
            context=ContextRef(digest="0" * 64, size=1),
            seed=0,
            log_head=None,
            cell_timeout_s=5,
            output_truncation=100,
        )
        with pytest.raises(Exception):  # noqa: B017 - whatever the store raises for a missing blob
            await host.starter.start(ref)
        assert [p for p in host.home.path.iterdir() if p.is_dir()] == []
    finally:
        await host.close_all()


@pytest.mark.chaos
async def test_a_killed_workers_sandboxes_are_reaped_by_a_worker_sharing_the_root(
    root: Path, tmp_path: Path, blob_store: BlobStore
) -> None:
    """Two worker processes on one root: starting the second leaves the live first's busy
    sandbox alone; once the first is SIGKILLed, the second's next reap removes its home."""
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        from durable_rlm.activities.repl import ReplActivities
        from durable_rlm.store.blobs import BlobStore, DirectoryBackend
        from durable_rlm.workflows.models import SandboxRef

        async def main():
            host = ReplActivities(BlobStore(DirectoryBackend(Path(sys.argv[2]))), "q", Path(sys.argv[1]))
            ref = SandboxRef(episode_id="busy", context=None, seed=0, log_head=None,
                             cell_timeout_s=600, output_truncation=100)
            box = await host.starter.start(ref)
            await box.send({{"op": "exec", "code": "open('busy', 'w').close()\\nwhile True: pass",
                            "cell_name": "<cell 1>", "timeout": 600, "limit": 100}})
            print(host.starter.template.pid, box.process.pid, box.directory, box.view, flush=True)
            await asyncio.sleep(3600)

        asyncio.run(main())
        """
    )
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(root), str(tmp_path / f"blobs-{n}")],
            stdout=subprocess.PIPE,
            text=True,
        )
        for n in range(2)
    ]
    try:
        lines = [w.stdout.readline().split() for w in workers]  # type: ignore[union-attr]
        for *_, view in lines:  # a tmpfs of the sandbox's: seen through its own view
            await until(lambda d=view: (Path(d) / "busy").exists(), "the cell runs")
        first, second = workers
        homes = {Path(directory).parent for _, _, directory, _ in lines}
        # The second's start reaped nothing of the live first (".uids": the uids in use).
        assert {p for p in root.iterdir() if p.name != UID_CLAIMS} == homes
        # Each: its template, and its sandbox's keeper and REPL (PID 1 of the sandbox's namespace)
        assert len(sandbox_processes({first.pid, second.pid})) == 6

        first.kill()
        first.wait()
        reaper = ReplActivities(blob_store, "q", root)  # a third worker starts
        live = {p for p in root.iterdir() if p.name != UID_CLAIMS}
        assert live == {Path(lines[1][2]).parent, reaper.home.path}
        await until(lambda: sandbox_processes({first.pid}) == [], "the first worker's sandboxes died")
        assert len(sandbox_processes({second.pid})) == 3
        await reaper.close_all()
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()
    await until(lambda: sandbox_processes({w.pid for w in workers}) == [], "every sandbox died")
    assert reap_dead(root) != [] and list(root.iterdir()) == []


# --- real workers, killed mid-cell --------------------------------------------------------------

SLEEPING_CELL = [
    "```repl\nimport time\nopen('started', 'w').close()\ntime.sleep(2)\nx = 41 + 1\n```",
    "FINAL_VAR(x)",
]


def leftovers(root: Path, live: int) -> list[str]:
    """What the sandbox root holds besides the live worker's home and its own uid claims
    (`.uids/<uid>` -> its home: the new worker may already run a sandbox)."""
    mine = f"w-{live}-"
    found = [p.name for p in root.iterdir() if not p.name.startswith(mine) and p.name != ".uids"]
    claims = root / ".uids"
    if claims.is_dir():
        for claim in claims.iterdir():
            try:
                target = os.readlink(claim)
            except FileNotFoundError:  # released meanwhile
                continue
            if not Path(target).name.startswith(mine):
                found.append(f".uids/{claim.name} -> {target}")
    return found


def cell_wrote(root: Path, worker_pid: int, name: str) -> bool:
    """A file a cell of that worker wrote in its own directory: a tmpfs of the sandbox's mount
    namespace, seen through the sandbox's processes (/proc/PID/root), not the host's path."""
    for sandbox in sandbox_processes({worker_pid}):
        for directory in root.glob(f"w-{worker_pid}-*/*/"):
            if Path(f"/proc/{sandbox}/root{directory}", name).exists():
                return True
    return False


async def kill_mid_cell(kills: int, client, scripted, worker_processes, root: Path) -> None:
    """Kill a worker while a cell sleeps in its sandbox, start the next (which reaps the dead
    one's sandboxes), let the episode finish there; `kills` times. Then stop the last."""
    worker = worker_processes()
    dead: set[int] = set()
    for n in range(kills):
        server = scripted(root_and_sub(SLEEPING_CELL, lambda p: p))
        handle = await start_episode(
            client, request_for(server), worker_processes.queue, f"hygiene-{n}-{uuid.uuid4().hex[:6]}"
        )
        pid = worker.process.pid
        await until(lambda pid=pid: cell_wrote(root, pid, "started"), "the cell runs")
        worker.kill()
        dead.add(pid)
        worker = worker_processes()  # started: it has reaped the dead worker's home
        assert leftovers(root, worker.process.pid) == []
        await until(lambda: sandbox_processes(dead) == [], "the dead workers' sandboxes are gone")
        result = await asyncio.wait_for(handle.result(), 90)
        assert result.answer == "42"
    worker.stop()
    assert list(root.iterdir()) == []
    assert sandbox_processes(dead | {worker.process.pid}) == []


@pytest.fixture
def worker_root(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Worker processes whose sandbox root (TMPDIR/drlm-sandboxes) is this test's own."""
    tmp = Path(tempfile.mkdtemp(prefix="drlm-hygiene-tmp-", dir="/tmp"))
    tmp.chmod(0o711)
    monkeypatch.setenv("TMPDIR", str(tmp))
    (tmp / "drlm-sandboxes").mkdir(mode=0o711)
    yield tmp / "drlm-sandboxes"
    sandbox_reaper.remove_tree(tmp)


@pytest.mark.chaos
@pytest.mark.slow  # 14 s; tests/test_crash.py keeps a killed worker in the default run
async def test_a_worker_killed_mid_cell_leaves_no_sandbox_behind(
    client, scripted, worker_processes, worker_root: Path
) -> None:
    await kill_mid_cell(1, client, scripted, worker_processes, worker_root)


@pytest.mark.chaos
@pytest.mark.slow
async def test_ten_workers_killed_mid_cell_leave_no_sandbox_behind(
    client, scripted, worker_processes, worker_root: Path
) -> None:
    await kill_mid_cell(10, client, scripted, worker_processes, worker_root)
