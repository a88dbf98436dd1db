"""Sandboxes forked from a template process (docs/security.md, "The sandbox"): as isolated
as spawned ones, cheaper to start and to keep, and bounded by a memory budget.

Isolation is checked in both modes where a layer alone decides (with the audit hook off,
`bare`, for the OS layers); tests/test_repl.py runs every REPL test on the default (fork).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from temporalio.client import Client

from durable_rlm.activities import sandbox_processes
from durable_rlm.activities.live_sandbox import LiveSandbox
from durable_rlm.activities.repl import ReplActivities
from durable_rlm.activities.sandbox_processes import SandboxUids
from durable_rlm.host.processes import proc_stat
from durable_rlm.store.blobs import BlobStore
from durable_rlm.workflows.models import SandboxRef
from tests.conftest import ROOT, Episode, workers_for

MODES = ["fork", "spawn"]
ROOT_WORKER = os.geteuid() == 0


@pytest.fixture(params=MODES)
async def any_host(request: pytest.FixtureRequest, blob_store: BlobStore, sandboxes: Path) -> AsyncIterator:
    repl = ReplActivities(blob_store, "queue-a", sandboxes, memory_mb=1024, sandbox_start=request.param)
    yield repl
    await repl.close_all()


@pytest.fixture(params=MODES)
async def any_bare(request: pytest.FixtureRequest, blob_store: BlobStore, sandboxes: Path) -> AsyncIterator:
    """Without the audit hook and the private root: the uid, network and limits alone."""
    repl = ReplActivities(
        blob_store,
        "queue-bare",
        sandboxes,
        memory_mb=1024,
        audit_hook=False,
        sandbox_start=request.param,
        filesystem=False,
    )
    yield repl
    await repl.close_all()


@pytest.fixture
async def forking(blob_store: BlobStore, sandboxes: Path) -> AsyncIterator[ReplActivities]:
    repl = ReplActivities(blob_store, "queue-f", sandboxes / "fork", memory_mb=1024, sandbox_start="fork")
    yield repl
    await repl.close_all()


@pytest.fixture
async def spawning(blob_store: BlobStore, sandboxes: Path) -> AsyncIterator[ReplActivities]:
    repl = ReplActivities(blob_store, "queue-s", sandboxes / "spawn", memory_mb=1024, sandbox_start="spawn")
    yield repl
    await repl.close_all()


def live(host: ReplActivities, episode: Episode) -> LiveSandbox:
    return host.pool.live[episode.episode_id]


def template_pid(host: ReplActivities) -> int:
    assert host.starter.template is not None and host.starter.template.alive
    return host.starter.template.pid


def ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def gone(pid: int) -> bool:
    """Exited (a zombie nobody reaped yet counts: it runs nothing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


async def until(condition, what: str, tries: int = 400) -> None:
    """Wait for a condition (a bound for a hung test, not a timing assertion)."""
    for _ in range(tries):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never happened: {what}")


def repl_pid(keeper: int) -> int:
    """The REPL: the child of the process the host started, PID 1 of its own namespace."""
    entries = [p for p in Path("/proc").iterdir() if p.name.isdigit()]
    children = [int(p.name) for p in entries if _ppid_or_none(p) == keeper]
    assert len(children) == 1, children
    return children[0]


def _ppid_or_none(entry: Path) -> int | None:
    try:
        return ppid(int(entry.name))
    except (OSError, ValueError, IndexError):
        return None


def fd_targets(pid: int) -> dict[int, str]:
    targets = {}
    for entry in Path(f"/proc/{pid}/fd").iterdir():
        try:
            targets[int(entry.name)] = os.readlink(entry)
        except OSError:
            continue
    return targets


class Seeded(Episode):
    def __init__(self, host: ReplActivities, seed: int) -> None:
        super().__init__(host)
        self.seed = seed

    def ref(self) -> SandboxRef:
        return super().ref().model_copy(update={"seed": self.seed})


# --- the same sandbox, however started ---------------------------------------------------------


async def test_forked_and_spawned_sandboxes_report_the_same_layers(
    forking: ReplActivities, spawning: ReplActivities
) -> None:
    forked, spawned = await forking.probe(), await spawning.probe()
    # Each sandbox has a uid of its own (root workers): the rest is the same.
    assert {**forked, "uid": ""} == {**spawned, "uid": ""}
    assert forked["network"] in ("netns", "userns+netns")
    assert forked["filesystem"].startswith("private root") and forked["seccomp"].endswith("refused")
    if ROOT_WORKER:
        assert forked["uid"] != spawned["uid"] and forked["uid"].startswith("uid ")
    else:
        assert forked["uid"] == f"uid {os.geteuid()} (worker not root: no drop)"
    assert forked["audit_hook"] == "on"


async def test_a_forked_sandbox_is_the_templates_child_and_a_spawned_one_the_workers(
    forking: ReplActivities, spawning: ReplActivities
) -> None:
    # Seen from the host: the REPL runs as PID 1 of a PID namespace of its own, below the
    # process the host started (activities/sandbox/kernel.py become_pid_one), which sees none.
    code = "import os\nprint(os.getpid(), os.getppid())"
    forked, spawned = Episode(forking), Episode(spawning)
    assert (await forked.run(code)).stdout == "1 0\n"
    assert (await spawned.run(code)).stdout == "1 0\n"
    for host, episode, parent in ((forking, forked, template_pid(forking)), (spawning, spawned, os.getpid())):
        pid = live(host, episode).process.pid
        assert proc_stat(pid).ppid == parent and os.getsid(pid) == pid  # and each leads its session
    assert live(forking, forked).process.kind == "fork"
    assert live(spawning, spawned).process.kind == "spawn"
    assert spawning.starter.template is None


async def test_every_sandbox_hashes_with_seed_0_whatever_its_episode_seed_or_start(
    forking: ReplActivities, spawning: ReplActivities
) -> None:
    """A REPL rebuilt on another worker, forked or not, iterates its sets the same way."""
    code = "print(hash('abc'), list({'alpha', 'beta', 'gamma', 'delta', 'epsilon'}))"
    expected = subprocess.run(
        [sys.executable, "-c", code], env={"PYTHONHASHSEED": "0"}, capture_output=True, text=True, check=True
    ).stdout
    outputs = {
        (await Seeded(host, seed).run(code)).stdout for host in (forking, spawning) for seed in (1, 987654)
    }
    assert outputs == {expected}


async def test_per_episode_random_seeding_is_kept(forking: ReplActivities, spawning: ReplActivities) -> None:
    code = "import random\nprint(random.random())"
    first = {(await Seeded(host, 7).run(code)).stdout for host in (forking, spawning)}
    other = (await Seeded(forking, 8).run(code)).stdout
    assert len(first) == 1 and other not in first


async def test_a_forked_sandbox_holds_only_its_own_channel_and_files(forking: ReplActivities) -> None:
    episode = Episode(forking)
    await episode.run("x = 1")
    box = live(forking, episode)
    # The process the host started keeps the sandbox's PID namespace from outside: it holds
    # its stderr and one pipe of its own (its REPL's sign of life), not the channel.
    keeper = set(fd_targets(box.process.pid).values())
    kept = {t for t in keeper if t.startswith("pipe:")}
    assert keeper == {"/dev/null", str(box.directory / "sandbox.err"), *kept} and len(kept) == 1
    assert not kept & set(fd_targets(os.getpid()).values())
    sandbox = fd_targets(repl_pid(box.process.pid))
    # 0 and 1 become /dev/null once the channel is moved off them; 2 is sandbox.err.
    assert sandbox[0] == sandbox[1] == "/dev/null"
    assert sandbox[2] == str(box.directory / "sandbox.err")
    pipes = {t for t in sandbox.values() if t.startswith("pipe:")}
    assert len(pipes) == 2
    assert set(sandbox.values()) == {"/dev/null", str(box.directory / "sandbox.err"), *pipes}
    # The two pipes are the worker's channel to it and nothing the template holds.
    assert pipes <= set(fd_targets(os.getpid()).values())
    template = set(fd_targets(template_pid(forking)).values()) - {"/dev/null"}
    assert template and not template & set(sandbox.values())
    assert any(t.startswith("socket:") for t in template)  # the control channel stays there


async def test_sandboxes_see_no_variable_of_the_worker(
    any_host: ReplActivities, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret-of-the-worker")
    episode = Episode(any_host)
    outcome = await episode.run("import os\nprint(sorted(os.environ.items()))")
    box = live(any_host, episode)
    home = str(box.directory)
    expected = [("HOME", home), ("LANG", "C.UTF-8"), ("PATH", "/usr/bin:/bin"), ("PYTHONHASHSEED", "0")]
    assert outcome.stdout == f"{expected}\n"
    # The environment the process was started with (a forked one: the template's) holds none.
    pids = [box.process.pid] + ([template_pid(any_host)] if any_host.config.sandbox_start == "fork" else [])
    for pid in pids:
        initial = Path(f"/proc/{pid}/environ").read_bytes()
        assert b"sk-secret" not in initial and b"OPENAI" not in initial


# --- isolation, both modes -----------------------------------------------------------------------


@pytest.fixture
def listener() -> Iterator[int]:
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    yield server.getsockname()[1]
    server.close()


def connect(port: int) -> str:
    return f"import socket\ns = socket.socket()\ns.settimeout(2)\ns.connect(('127.0.0.1', {port}))"


async def test_no_network(any_host: ReplActivities, any_bare: ReplActivities, listener: int) -> None:
    outcome = await Episode(any_host).run(connect(listener))
    assert "PermissionError: sandbox: socket.__new__ is not allowed" in (outcome.error or "")
    outcome = await Episode(any_bare).run(connect(listener))  # the namespace alone
    assert "OSError: [Errno 101] Network is unreachable" in (outcome.error or "")


async def test_separate_network_namespaces(forking: ReplActivities) -> None:
    first, second = Episode(forking), Episode(forking)
    await first.run("x = 1")
    await second.run("y = 2")
    a, b = live(forking, first).process.pid, live(forking, second).process.pid
    spaces = {os.readlink(f"/proc/{pid}/ns/net") for pid in (a, b, template_pid(forking), os.getpid())}
    assert len(spaces) == 3  # each sandbox its own; the template shares the worker's


async def test_no_files_outside(any_host: ReplActivities, blob_store: BlobStore) -> None:
    secret = blob_store.backend._path(blob_store.put_text("secret blob"))  # type: ignore[attr-defined]
    outcome = await Episode(any_host).run(f"print(open({str(secret)!r}).read())")
    assert f"sandbox: access to {str(secret)!r} is not allowed" in (outcome.error or "")
    outcome = await Episode(any_host).run(f"import os\nprint(os.listdir({str(ROOT)!r}))")
    assert "sandbox: os.listdir of" in (outcome.error or "")


@pytest.mark.skipif(not ROOT_WORKER, reason="the uid drop happens when the worker is root")
async def test_its_own_uid_alone_stops_reads_writes_and_signals(
    any_bare: ReplActivities, tmp_path: Path
) -> None:
    episode = Episode(any_bare)
    outcome = await episode.run(f"open({str(tmp_path / 'escape.txt')!r}, 'w')")
    assert "PermissionError: [Errno 13] Permission denied" in (outcome.error or "")
    assert "PermissionError: [Errno 13]" in ((await episode.run("open('/etc/shadow').read()")).error or "")
    outcome = await episode.run(f"import os\nos.kill({os.getpid()}, 0)")
    # Refused by the uid, or (its PID namespace) the worker is not even there to be named.
    error = outcome.error or ""
    assert "[Errno 1] Operation not permitted" in error or "[Errno 3] No such process" in error
    outcome = await episode.run("import os\nprint(os.getuid(), os.geteuid(), os.getgid(), os.getgroups())")
    uid, euid, gid, groups = outcome.stdout.split(maxsplit=3)
    assert uid == euid == gid and int(uid) >= SandboxUids.FIRST and groups.strip() == "[]"


async def test_no_kill_fork_or_subprocess(any_host: ReplActivities) -> None:
    episode = Episode(any_host)
    for code, event in [
        (f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)", "os.kill"),
        ("import os\nos.fork()", "os.fork"),
        ("import subprocess\nsubprocess.run(['id'])", "subprocess.Popen"),
        ("import os\nos.system('id')", "os.system"),
        ("import ctypes\nctypes.CDLL(None)", "ctypes.dlopen"),
    ]:
        outcome = await episode.run(code)
        assert f"sandbox: {event} is not allowed" in (outcome.error or ""), code


async def test_rlimits_and_the_death_signal(any_bare: ReplActivities) -> None:
    episode = Episode(any_bare)
    outcome = await episode.run(
        "import resource\n"
        "limits = ('RLIMIT_AS', 'RLIMIT_FSIZE', 'RLIMIT_CORE')\n"
        "print([resource.getrlimit(getattr(resource, r)) for r in limits])"
    )
    assert outcome.stdout == f"[{(2**30, 2**30)}, {(256 * 2**20, 256 * 2**20)}, (0, 0)]\n"
    assert "MemoryError" in ((await episode.run("x = bytearray(4 * 1024 ** 3)")).error or "")
    # PR_GET_PDEATHSIG (ctypes is refused only by the hook, which is off here)
    outcome = await episode.run(
        "import ctypes, os\nsig = ctypes.c_int()\nctypes.CDLL(None).prctl(2, ctypes.byref(sig))\n"
        "print(sig.value, os.getppid())"
    )
    # The REPL's parent is its keeper, outside its PID namespace (so 0 to it); the keeper's
    # parent is the template or the worker, and its death kills the REPL (the signal above).
    parent = template_pid(any_bare) if any_bare.config.sandbox_start == "fork" else os.getpid()
    assert outcome.stdout == f"{int(signal.SIGKILL)} 0\n"
    assert ppid(live(any_bare, episode).process.pid) == parent


async def test_two_episodes_are_separate_processes_with_separate_namespaces(forking: ReplActivities) -> None:
    first, second = Episode(forking), Episode(forking)
    await first.run("secret = 'first'")
    outcome = await second.run("print('secret' in globals())")
    assert outcome.stdout == "False\n"
    a, b = live(forking, first).process.pid, live(forking, second).process.pid
    assert a != b and ppid(a) == ppid(b) == template_pid(forking)
    assert live(forking, first).directory != live(forking, second).directory
    outcome = await second.run(f"print(open({str(live(forking, first).directory / 'x')!r}, 'w'))")
    assert "is not allowed" in (outcome.error or "")


# --- deaths, told as they are --------------------------------------------------------------------


async def test_a_sigkilled_sandbox_reports_code_minus_9_and_only_its_cell_is_lost(
    any_host: ReplActivities,
) -> None:
    episode = Episode(any_host, cell_timeout_s=60)
    await episode.run("kept = 'earlier'")
    box = live(any_host, episode)
    running = asyncio.ensure_future(episode.run("open('busy', 'w').close()\nimport time\ntime.sleep(60)"))
    await until(lambda: (box.view / "busy").exists(), "the cell started")  # its own view: a tmpfs
    os.kill(box.process.pid, signal.SIGKILL)  # alive (it is busy), so the pid is still its own
    outcome = await running
    assert "the REPL process exited (code -9) during this cell" in (outcome.error or "")
    assert (await episode.run("print(kept)")).stdout == "earlier\n"


async def test_killing_the_template_kills_its_sandboxes_and_the_next_step_rebuilds(
    forking: ReplActivities,
) -> None:
    episode, other = Episode(forking), Episode(forking)
    await episode.run("kept = 41")
    await other.run("mine = 'other'")
    old_template = template_pid(forking)
    boxes = [live(forking, episode), live(forking, other)]
    os.kill(old_template, signal.SIGKILL)
    for box in boxes:
        await until(lambda box=box: gone(box.process.pid), "the sandbox died with its template")
        assert await asyncio.wait_for(box.process.wait(), 30) == -signal.SIGKILL
    outcome = await episode.run("print(kept + 1)")
    assert (outcome.stdout, outcome.rebuilt, outcome.error) == ("42\n", True, None)
    new_template = template_pid(forking)
    assert new_template != old_template
    assert ppid(live(forking, episode).process.pid) == new_template
    assert (await other.run("print(mine)")).stdout == "other\n"


@pytest.mark.chaos
async def test_a_sigkilled_worker_takes_its_template_and_busy_sandboxes_down(sandboxes: Path) -> None:
    """PR_SET_PDEATHSIG, twice: worker -> template -> sandbox, for a sandbox computing."""
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        from durable_rlm.activities.repl import ReplActivities
        from durable_rlm.store.blobs import BlobStore, DirectoryBackend
        from durable_rlm.workflows.models import SandboxRef

        async def main():
            root = Path({str(sandboxes)!r})
            host = ReplActivities(BlobStore(DirectoryBackend(root / "blobs")), "q", root / "s")
            ref = SandboxRef(episode_id="busy", context=None, seed=0, log_head=None,
                             cell_timeout_s=600, output_truncation=100)
            box = await host.starter.start(ref)
            await box.send({{"op": "exec", "code": "open('busy', 'w').close()\\nwhile True: pass",
                            "cell_name": "<cell 1>", "timeout": 600, "limit": 100}})
            print(host.starter.template.pid, box.process.pid, box.view, flush=True)
            await asyncio.sleep(3600)

        asyncio.run(main())
        """
    )
    worker = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout is not None
        template, sandbox, directory = worker.stdout.readline().split()
        await until(lambda: (Path(directory) / "busy").exists(), "the cell runs")
        assert ppid(int(sandbox)) == int(template)
        worker.kill()
        worker.wait()
        await until(lambda: gone(int(template)) and gone(int(sandbox)), "both died with the worker")
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


async def test_a_template_that_cannot_start_is_told_once_and_sandboxes_are_spawned(
    blob_store: BlobStore, sandboxes: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    broken = sandboxes / "broken_forkserver.py"
    broken.write_text("import sys\nprint('no template today', file=sys.stderr)\nsys.exit(3)\n")
    monkeypatch.setattr(sandbox_processes, "FORKSERVER_PATH", broken)
    host = ReplActivities(blob_store, "q", sandboxes / "s", memory_mb=1024)
    try:
        with caplog.at_level(logging.WARNING, logger="durable_rlm.activities.repl"):
            first, second = Episode(host), Episode(host)
            assert (await first.run("print(1 + 1)")).stdout == "2\n"
            assert (await second.run("print(2 + 2)")).stdout == "4\n"
        assert live(host, first).process.kind == live(host, second).process.kind == "spawn"
        warnings = [r.getMessage() for r in caplog.records if "cannot be forked" in r.getMessage()]
        assert len(warnings) == 1 and "no template today" in warnings[0]
    finally:
        await host.close_all()


# --- memory ----------------------------------------------------------------------------------------


async def test_the_memory_report_gives_each_sandbox_and_the_template(forking: ReplActivities) -> None:
    first, second = Episode(forking), Episode(forking)
    await first.run("x = 1")
    await second.run("big = b'x' * (32 * 1024 * 1024)  # written, so resident")
    report = forking.memory_report()
    assert set(report.sandboxes) == {first.episode_id, second.episode_id}
    assert report.template is not None and report.template > 0
    assert report.sandboxes[second.episode_id] - report.sandboxes[first.episode_id] > 30 * 2**20
    assert report.sandboxes_total == sum(report.sandboxes.values())


async def test_over_budget_idle_sandboxes_go_least_recently_used_first_and_come_back(
    forking: ReplActivities,
) -> None:
    a, b, c = Episode(forking), Episode(forking), Episode(forking)
    await a.run("kept = 'a'")
    await b.run("kept = 'b'")
    await c.run("kept = 'c'")
    await a.run("print(kept)")  # least recently used now: b, then c, then a
    forking.config.memory_budget_mb = 1
    async with forking.pool.lock(c.episode_id):  # c runs a step: it is never discarded
        assert await forking.enforce_memory_budget() == [b.episode_id, a.episode_id]
        assert forking.live_episodes() == [c.episode_id]
    forking.config.memory_budget_mb = None
    for episode, name in ((a, "a"), (b, "b")):
        outcome = await episode.run("print(kept)")
        assert (outcome.stdout, outcome.rebuilt) == (f"{name}\n", True)


BALLAST = """
class Ballast:
    def __init__(self):
        self.data = b'x' * (24 * 1024 * 1024)

    def __repr__(self):  # short: the variables summary of each cell reprs it
        return 'Ballast()'

ballast = Ballast()
"""


async def test_the_budget_is_checked_when_a_step_finishes(blob_store: BlobStore, sandboxes: Path) -> None:
    host = ReplActivities(blob_store, "q", sandboxes, memory_mb=1024)
    try:
        a, b = Episode(host), Episode(host)
        await a.run("kept = 'a'")
        await b.run(BALLAST)
        sizes = host.memory_report().sandboxes
        # Room for b as it is and some growth, not for a as well: a, idle, goes.
        host.config.memory_budget_mb = math.ceil(sizes[b.episode_id] / 2**20) + 1
        assert sizes[a.episode_id] > 2**20 + 2**20  # so a does not fit in the slack
        await b.run("ballast2 = 1")
        assert host.pool.budget_task is not None
        assert await host.pool.budget_task == [a.episode_id]
        assert host.live_episodes() == [b.episode_id]
        outcome = await a.run("print(kept)")
        assert (outcome.stdout, outcome.rebuilt) == ("a\n", True)
    finally:
        await host.close_all()


@pytest.mark.slow
def test_the_sandbox_start_benchmark_prints_its_figures() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sandbox_start.py"), "--sandboxes", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "layers identical in both modes: yes" in out.stdout
    assert re.search(r"ratio spawn/fork \(medians\): [0-9.]+x", out.stdout), out.stdout


async def test_a_worker_starts_its_template_before_any_step(
    client: Client, store: tuple[BlobStore, sa.Engine], session_dir: Path
) -> None:
    """The template's interpreter and imports run beside the worker's start and the first
    model call, not on the first step's path (activities/sandbox_start.py `warm`)."""
    async with workers_for(client, store, session_dir, f"warm-{uuid.uuid4().hex[:8]}") as repl:
        assert isinstance(repl, ReplActivities) and not repl.live_episodes()
        await until(lambda: repl.starter.template is not None and repl.starter.template.alive, "the template")
        assert ppid(template_pid(repl)) == os.getpid()


async def test_a_spawning_worker_starts_no_template(spawning: ReplActivities) -> None:
    await spawning.warm()
    assert spawning.starter.template is None
