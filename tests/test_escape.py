"""The escape suite: the red-team's attacks, run twice, with the audit hook on and with it
off. With it off, every file, network, process and cross-episode attack must fail by the
kernel alone (activities/sandbox/kernel.py and the uid, limits and namespaces of child.py):
the hook is Python code beside the attacker's, and code gets past it.

Each attack prints ESCAPED only if it worked; a canary secret sits in the worker's
environment, in a world-readable file like the stores, and in another episode's context,
and must appear in no output.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from durable_rlm.activities.repl import ReplActivities
from durable_rlm.activities.sandbox import cgroups
from durable_rlm.activities.sandbox.kernel import readonly_sources
from durable_rlm.store.blobs import BlobStore
from durable_rlm.workflows.models import CloseSandboxInput
from tests.conftest import Episode

ROOT = Path(__file__).resolve().parents[1]
CANARY = f"canary-{uuid.uuid4().hex}"
ROOT_WORKER = os.geteuid() == 0

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux sandbox layers")


@pytest.fixture(
    params=[
        (True, "fork", "auto"),
        (False, "fork", "auto"),
        (False, "spawn", "auto"),
        (False, "fork", "user"),
    ],
    ids=["hook-on", "hook-off", "hook-off-spawned", "hook-off-userns"],
)
async def host(
    request: pytest.FixtureRequest, blob_store: BlobStore, sandboxes: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[ReplActivities]:
    monkeypatch.setenv("DRLM_ESCAPE_CANARY", CANARY)  # the worker's environment
    # "userns": the path of a root worker without CAP_SYS_ADMIN (a default container).
    hook, start, namespaces = request.param
    repl = ReplActivities(
        blob_store,
        "queue-escape",
        sandboxes,
        memory_mb=1024,
        audit_hook=hook,
        sandbox_start=start,
        namespaces=namespaces,
    )
    yield repl
    await repl.close_all()


@pytest.fixture
def world_readable_secret() -> Iterator[Path]:
    """Like the stores and the data directory once were: readable by anyone on the host."""
    directory = Path(tempfile.mkdtemp(prefix="drlm-data-", dir="/tmp"))
    directory.chmod(0o755)
    secret = directory / "drlm.sqlite"
    secret.write_text(CANARY)
    secret.chmod(0o644)
    yield secret
    secret.unlink()
    directory.rmdir()


def escaped(outcome) -> str:
    return (outcome.stdout or "") + (outcome.error or "")


async def attack(host: ReplActivities, code: str, episode: Episode | None = None) -> str:
    episode = episode or Episode(host)
    text = escaped(await episode.run(code))
    assert "ESCAPED" not in text and CANARY not in text, text
    return text


def tried(path: object) -> str:
    return f"data = open({str(path)!r}).read()\nprint('ESCAPED', data)"


# --- files --------------------------------------------------------------------------------------


async def test_no_file_of_the_host_is_readable(host: ReplActivities, world_readable_secret: Path) -> None:
    for path in (
        world_readable_secret,  # a world-readable store in a data directory
        ROOT / "durable_rlm" / "settings.py",  # the worker's source
        "/etc/shadow",
        "/etc/passwd",
        "/proc/1/environ",
        f"/proc/{os.getpid()}/environ",  # the worker's environment, the canary in it
        "/proc/self/environ",
    ):
        await attack(host, tried(path))


async def test_the_root_holds_only_the_python_installation_and_its_own_directory(
    host: ReplActivities,
) -> None:
    listing = await attack(host, "import os\nprint(sorted(os.listdir('/')))")
    if not host.config.audit_hook:  # the hook refuses the listing itself
        shown = set(eval(listing))  # noqa: S307 - a list of names printed by our own cell
        # the first part of each bound path: the venv may live anywhere (/work here, /check in CI)
        installed = {Path(source).parts[1] for source in readonly_sources()}
        # .drlm-host: the host's side of its own directory (the context, a snapshot to load),
        # read-only, since its own is a tmpfs (activities/sandbox/kernel.py)
        assert shown <= {"dev", "etc", "root", "tmp", "bin", "sbin", ".drlm-host"} | installed, shown
        assert "proc" not in shown and "home" not in shown and "sys" not in shown


async def test_no_write_outside_its_own_directory_reaches_the_host(host: ReplActivities) -> None:
    name = f"drlm-escape-{uuid.uuid4().hex[:8]}"
    for directory in ("/tmp", "/dev/shm", "/var/tmp", str(ROOT)):
        await attack(host, f"open({directory + '/' + name!r}, 'w').write('x')\nprint('wrote')")
        assert not Path(directory, name).exists(), directory
    await attack(host, "open('/usr/lib/drlm-escape', 'w')\nprint('ESCAPED')")
    # Its own directory is where it may write.
    assert "kept" in escaped(
        await Episode(host).run("open('mine', 'w').write('kept')\nprint(open('mine').read())")
    )


async def test_no_device_node_can_be_made(host: ReplActivities) -> None:
    await attack(
        host, "import os, stat\nos.mknod('null2', stat.S_IFCHR | 0o666, os.makedev(1, 3))\nprint('ESCAPED')"
    )


async def test_a_fresh_interpreter_started_without_the_hook_is_still_inside(
    host: ReplActivities, world_readable_secret: Path
) -> None:
    python = os.path.join(sys.base_prefix, "bin", "python3")
    code = f"print(open({str(world_readable_secret)!r}).read())"
    await attack(
        host,
        "import _posixsubprocess, subprocess, sys\n"
        f"out = subprocess.run([{python!r}, '-c', {code!r}], capture_output=True, text=True)\n"
        "print('ESCAPED' if out.returncode == 0 else 'failed', out.stdout)",
    )


# --- network ------------------------------------------------------------------------------------


async def test_no_socket_reaches_the_host(host: ReplActivities) -> None:
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    path = Path(tempfile.mkdtemp(prefix="drlm-sock-", dir="/tmp")) / "s"
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(path))
    path.parent.chmod(0o755)
    path.chmod(0o777)
    unix.listen()
    abstract = socket.socket(socket.AF_UNIX)
    name = f"\0drlm-escape-{uuid.uuid4().hex[:8]}"
    abstract.bind(name)
    abstract.listen()
    try:
        for family, address in (
            ("AF_INET", ("127.0.0.1", tcp.getsockname()[1])),
            ("AF_UNIX", str(path)),
            ("AF_UNIX", name),
        ):
            await attack(
                host,
                f"import socket\ns = socket.socket(socket.{family})\ns.settimeout(2)\n"
                f"s.connect({address!r})\nprint('ESCAPED')",
            )
    finally:
        for s in (tcp, unix, abstract):
            s.close()
        path.unlink()
        path.parent.rmdir()


# --- processes and other episodes ---------------------------------------------------------------


async def test_an_episode_cannot_read_signal_limit_or_trace_another(host: ReplActivities) -> None:
    victim = Episode(host, context=f"the other episode's {CANARY}")
    await victim.run("kept = 'still here'")
    box = host.pool.live[victim.episode_id]
    pid, other_dir = box.process.pid, box.directory
    attacker = Episode(host)
    await attack(host, tried(other_dir / "context.txt"), attacker)
    await attack(host, f"import os\nprint(os.listdir({str(other_dir)!r}))", attacker)
    await attack(host, f"import os, signal\nos.kill({pid}, signal.SIGKILL)\nprint('ESCAPED')", attacker)
    await attack(
        host,
        f"import resource\nresource.prlimit({pid}, resource.RLIMIT_NOFILE, (3, 3))\nprint('ESCAPED')",
        attacker,
    )
    await attack(
        host,
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        f"print('ESCAPED' if libc.ptrace(16, {pid}, 0, 0) == 0 else 'refused')",
        attacker,
    )
    await attack(
        host,
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        f"print('ESCAPED' if libc.kill({pid}, 9) == 0 else 'refused')",
        attacker,
    )
    assert (await victim.run("print(kept)")).stdout == "still here\n"  # untouched, same process
    assert host.pool.live[victim.episode_id].process.pid == pid


async def test_the_kernel_refuses_what_the_repl_never_needs(host: ReplActivities) -> None:
    for call in (
        "libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)",
        "libc.unshare(0x10000000)",  # a user namespace: capabilities again
        "libc.syscall(250, 1, 0, 0, 0, 0)",  # keyctl
        "libc.syscall(321, 0, 0, 0)",  # bpf
        "libc.setsid()",  # leaving the process group the host kills
        "libc.syscall(155, b'/tmp', b'/tmp')",  # pivot_root
    ):
        await attack(
            host,
            "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"print('ESCAPED' if {call} == 0 else 'refused', ctypes.get_errno())",
        )


@pytest.mark.skipif(not ROOT_WORKER, reason="processes are limited per uid: a uid of its own")
async def test_a_fork_bomb_stops_at_the_process_limit(host: ReplActivities) -> None:
    text = await attack(
        host,
        "import os, time\nmade = 0\nfor i in range(500):\n"
        "    try:\n        pid = os.fork()\n"
        "    except OSError as e:\n        print('stopped at', made)\n        break\n"
        "    if pid == 0:\n        time.sleep(60)\n        os._exit(0)\n"
        "    made += 1\nelse:\n    print('ESCAPED')",
    )
    if not host.config.audit_hook:
        assert "stopped at" in text and int(text.split("stopped at")[1].split()[0]) < 64


async def test_nothing_a_sandbox_started_outlives_it(host: ReplActivities) -> None:
    episode = Episode(host)
    text = escaped(
        await episode.run(
            "import os, time\npid = os.fork()\nif pid == 0:\n"
            "    try:\n        os.setsid()\n    except OSError:\n        pass\n"
            "    time.sleep(120)\n    os._exit(0)\nprint('child', pid)"
        )
    )
    if host.config.audit_hook:
        assert "sandbox: os.fork is not allowed" in text
        return
    child = _host_pid(host.pool.live[episode.episode_id].process.pid, int(text.split("child")[1].split()[0]))
    await host.close_all()  # swept at the cell's end already when the sandbox has its own uid
    for _ in range(50):
        if not _alive(child):
            break
        await asyncio.sleep(0.1)
    assert not _alive(child), "a process the sandbox started outlived it"


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/status") as status:
            return "State:\tZ" not in status.read()
    except FileNotFoundError:
        return False


def _host_pid(keeper: int, inside: int) -> int | None:
    """A pid a cell printed is one of its PID namespace (the REPL is its PID 1): the host's
    pid of that process, None if it is gone. `keeper` is the sandbox's pid as the host has it
    (activities/sandbox/kernel.py `become_pid_one`)."""
    own = os.readlink(f"/proc/{keeper}/ns/pid")
    found: list[tuple[int, str, list[str]]] = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/status") as status:
                    fields = dict(line.split(":", 1) for line in status.read().splitlines() if ":" in line)
                found.append((int(entry.name), os.readlink(f"/proc/{entry.name}/ns/pid"), fields))
            except (OSError, ValueError):
                continue
    repl = [(pid, ns) for pid, ns, fields in found if fields.get("PPid", "").strip() == str(keeper)]
    if not repl or repl[0][1] == own:
        return inside if _alive(inside) else None  # no namespace of its own: pids are the host's
    namespace = repl[0][1]
    for pid, ns, fields in found:
        if ns == namespace and fields.get("NSpid", "").split()[-1:] == [str(inside)]:
            return pid
    return None


async def test_a_process_a_cell_forked_does_not_outlive_the_cell(host: ReplActivities) -> None:
    """It shares the channel's descriptors: alive after its cell, it could speak for the
    sandbox later. Each cell ends by killing every other process of the sandbox's uid."""
    episode = Episode(host)
    text = escaped(
        await episode.run(
            "import os, time\npid = os.fork()\n"
            "if pid == 0:\n    time.sleep(120)\n    os._exit(0)\nprint('child', pid)"
        )
    )
    if host.config.audit_hook:
        assert "sandbox: os.fork is not allowed" in text
        return
    box = host.pool.live[episode.episode_id]
    child = _host_pid(box.process.pid, int(text.split("child")[1].split()[0]))
    if ROOT_WORKER or box.layers.get("ipc_pid") == "ipc+pid":  # kill(-1) reaches only its own
        assert not _alive(child)  # killed and reaped before the cell's result was sent
    assert (await episode.run("print('still here')")).stdout == "still here\n"


# --- namespaces and limits of the sandbox as a whole (issue 33) -------------------------------

LIBC = "import ctypes, struct\nlibc = ctypes.CDLL(None, use_errno=True)\n"


async def test_no_message_queue_is_shared_between_sandboxes(host: ReplActivities) -> None:
    """System V IPC is named by a key anyone may guess: without an IPC namespace of its own,
    one episode read another's queue by it."""
    key = 0x7D000000 + uuid.uuid4().int % 0xFFFFFF
    writer, reader = Episode(host), Episode(host)
    await attack(
        host,
        LIBC + f"q = libc.msgget({key}, 0o1666)\nm = struct.pack('q', 1) + {CANARY.encode()!r}\n"
        "print('queued', q, libc.msgsnd(q, m, len(m) - 8, 0))",
        writer,
    )
    await attack(
        host,
        LIBC + f"q = libc.msgget({key}, 0)\nbuf = ctypes.create_string_buffer(256)\n"
        "n = libc.msgrcv(q, buf, 248, 0, 0o4000) if q >= 0 else -1\n"
        "print('ESCAPED' if n > 0 else 'refused', buf.raw[8 : 8 + max(n, 0)])",
        reader,
    )
    assert key not in _sysv_keys("msg"), "the queue is on the host"


async def test_shared_memory_goes_with_its_sandbox(host: ReplActivities) -> None:
    """4 x 32 MB of System V shared memory outlived its sandbox (host Shmem 46 -> 177 MB):
    its IPC namespace is freed, segments and all, when its last process exits."""
    keys = [0x7E000000 + uuid.uuid4().int % 0xFFFFFF + i for i in range(4)]
    episode = Episode(host)
    try:
        text = await attack(
            host,
            LIBC + "libc.shmat.restype = ctypes.c_void_p\nmade = 0\n"
            f"for key in {keys!r}:\n"
            "    i = libc.shmget(key, 32 << 20, 0o1666)\n"
            "    if i >= 0:\n"
            "        at = libc.shmat(i, None, 0)\n"
            "        ctypes.memset(at, 1, 32 << 20)\n"
            "        made += 1\n"
            "print('made', made)",
            episode,
        )
        if not host.config.audit_hook:
            assert "made 4" in text, text  # the attack ran: the kernel let it make them, inside
        await host.close_sandbox(CloseSandboxInput(episode_id=episode.episode_id))
        for _ in range(100):  # a namespace is freed by a kernel worker, soon after its end
            if not set(keys) & _sysv_keys("shm"):
                break
            await asyncio.sleep(0.05)
        assert not set(keys) & _sysv_keys("shm"), "shared memory outlived its sandbox"
    finally:
        _remove_segments(keys)


def _sysv_keys(kind: str) -> set[int]:
    """The System V keys the host's IPC namespace holds (/proc/sysvipc/msg or shm)."""
    with open(f"/proc/sysvipc/{kind}") as table:
        return {int(line.split()[0]) for line in table.read().splitlines()[1:] if line.split()}


def _remove_segments(keys: list[int]) -> None:
    """A failed run leaves nothing behind on the host."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for key in keys:
        found = libc.shmget(key, 0, 0)
        if found >= 0:
            libc.shmctl(found, 0, None)  # IPC_RMID


@pytest.mark.skipif(
    not ROOT_WORKER, reason="processes are counted per sandbox with a uid or cgroup of its own"
)
@pytest.mark.parametrize("cgroup", [True, False], ids=["cgroup", "rlimits-only"])
async def test_memory_is_bounded_for_the_sandbox_as_a_whole(
    host: ReplActivities, cgroup: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RLIMIT_AS is per process: five children filling 600 MB each took 2.8 GB with a 1 GB
    limit. The sandbox's cgroup (or, without one, RLIMIT_AS x RLIMIT_NPROC) holds all of them
    to its budget: the kernel ends what goes past it."""
    if not cgroup:  # as on a machine whose cgroups the worker cannot write
        monkeypatch.setattr(cgroups, "_SUPPORT", [cgroups.Support(reason="switched off by the test")])
    episode = Episode(host, cell_timeout_s=60)
    text = await attack(
        host,
        "import os, select, time\nr, w = os.pipe()\nkids = []\n"
        "for _ in range(5):\n"
        "    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
        "    if pid == 0:\n"
        "        try:\n            held = b'x' * (600 << 20)\n            os.write(w, b'1')\n"
        "        except MemoryError:\n            os._exit(1)\n"
        "        time.sleep(120)\n        os._exit(0)\n"
        "    kids.append(pid)\n"
        "os.close(w)\nfilled = 0\n"
        "while filled < len(kids) and select.select([r], [], [], 5)[0]:\n"
        "    got = os.read(r, 16)\n    if not got:\n        break\n    filled += len(got)\n"
        # Held at once is what counts: a child the kernel ended past the budget may have
        # filled first (the next one then fills in its place).
        "alive = sum(1 for pid in kids if os.waitpid(pid, os.WNOHANG) == (0, 0))\n"
        "print('filled', filled, 'of', len(kids), 'alive', alive)",
        episode,
    )
    filled = int(text.split("filled")[1].split()[0])
    alive = int(text.split("alive")[1].split()[0])
    assert min(filled, alive) * 600 <= host.config.memory_mb, text  # 5 x 600 MB = 3000 MB without the bound
    layer = host.pool.live[episode.episode_id].layers["cgroup"]
    # Where the worker can make one, every sandbox has its cgroup, and then one process may
    # use most of the budget (600 MB of 1024 here); split rlimits allow 1024 / 8 MB each.
    assert layer.startswith("whole sandbox") == cgroups.support().available, layer
    one = await episode.run("held = b'x' * (600 << 20)\ndel held\nprint('held 600 MB')")
    assert (one.stdout == "held 600 MB\n") == layer.startswith("whole sandbox"), (layer, one)
    assert (await episode.run("print('still here')")).stdout == "still here\n"


async def test_the_kernel_refuses_io_uring_memfd_and_sockets_a_repl_never_needs(host: ReplActivities) -> None:
    for call in (
        "libc.syscall(425, 4, ctypes.create_string_buffer(120))",  # io_uring_setup
        "libc.syscall(319, b'x', 0)",  # memfd_create
        "libc.syscall(323, 0)",  # userfaultfd
        "libc.socket(16, 3, 0)",  # AF_NETLINK: the kernel's routing, audit, uevents
        "libc.socket(17, 3, 0)",  # AF_PACKET
        "libc.socket(40, 1, 0)",  # AF_VSOCK: to the hypervisor
    ):
        await attack(
            host, LIBC + f"fd = {call}\nprint('ESCAPED' if fd >= 0 else 'refused', ctypes.get_errno())"
        )


async def test_no_process_outside_its_sandbox_can_be_named(host: ReplActivities) -> None:
    """Its PID namespace: the worker, the template and other sandboxes are not there to be
    signalled, traced or counted, whatever the uid (a worker not root shares its uid)."""
    other = Episode(host)
    await other.run("x = 1")
    targets = [os.getpid(), host.pool.live[other.episode_id].process.pid]
    if host.starter.template is not None:
        targets.append(host.starter.template.pid)
    text = await attack(
        host,
        "import os\nfor pid in " + repr(targets) + ":\n"
        "    try:\n        os.kill(pid, 0)\n        print('ESCAPED', pid)\n"
        "    except ProcessLookupError:\n        print('none')\n"
        "    except PermissionError as e:\n"
        "        print('refused' if 'sandbox:' in str(e) else 'ESCAPED: it is there')",
    )
    if not host.config.audit_hook:
        assert text.split() == ["none"] * len(targets), text
