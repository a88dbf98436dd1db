"""The kernel layers of issue 33 ("Containment"), through real episodes on a real worker: an
IPC namespace per sandbox (System V objects neither shared nor left behind), a PID namespace
(no other process can be named), a cgroup bounding the sandbox as a whole (or RLIMIT_AS x
RLIMIT_NPROC), and seccomp refusing io_uring, memfd and the socket families a REPL never
needs. Each attack runs with the audit hook on and off (off: the kernel alone must stop it),
and each is followed by an honest episode on the same worker that must answer right.
(tests/test_escape.py attacks each layer of one sandbox directly.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from durable_rlm.activities.sandbox import cgroups, kernel
from durable_rlm.audit.timeline import episode_timeline
from durable_rlm.scripted import ChatRequest, Reply
from durable_rlm.workflows.models import EpisodeLimits
from tests.conftest import request_for, run_episode

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the hard case: a worker running as root")

CANARY = f"canary-{uuid.uuid4().hex}"
LIBC = "import ctypes, struct\nlibc = ctypes.CDLL(None, use_errno=True)\n"
AFTER = "```repl\nprint(llm_query('ping'))\n```"


def hostile(cell: str):
    def script(request: ChatRequest) -> Reply | str:
        if not request.is_root:
            return request.last_user.upper()
        return [f"```repl\n{cell}\n```", AFTER, "FINAL(survived)"][min(request.turn, 2)]

    return script


def honest(request: ChatRequest) -> Reply | str:
    if not request.is_root:
        return request.last_user.upper()
    return ["```repl\nr = llm_query('ping')\n```", "FINAL_VAR(r)"][min(request.turn, 1)]


@pytest.fixture(params=[True, False], ids=["hook-on", "hook-off"])
def hook(request: pytest.FixtureRequest, worker) -> bool:
    worker.config.audit_hook = request.param  # read as each sandbox starts
    worker.config.memory_mb = 1024  # the budget the whole sandbox stays in
    return request.param


async def observed(client, scripted, worker, cell: str) -> str:
    """Run a hostile episode to its end; what its cell showed (output and error)."""
    episode_id = f"kernel-{uuid.uuid4().hex[:8]}"
    limits = EpisodeLimits(max_iterations=5, cell_timeout_s=30)
    result = await run_episode(
        client, request_for(scripted(hostile(cell)), limits=limits), worker.task_queue, episode_id
    )
    assert result.answer == "survived", result
    timeline = await episode_timeline(client, episode_id)
    cell_view, after = timeline.iterations[0].cells[0], timeline.iterations[1].cells[0]
    assert after.stdout.startswith("PING"), after  # the REPL serves the episode again
    shown = (cell_view.stdout or "") + (cell_view.error or "")
    assert "ESCAPED" not in shown and CANARY not in shown, shown
    return shown


async def then_an_honest_episode_answers(client, scripted, worker) -> None:
    result = await run_episode(client, request_for(scripted(honest)), worker.task_queue)
    assert result.answer == "PING"


def sysv_keys(kind: str) -> set[int]:
    with open(f"/proc/sysvipc/{kind}") as table:
        return {int(line.split()[0]) for line in table.read().splitlines()[1:] if line.split()}


async def test_one_episode_cannot_read_anothers_message_queue(client, scripted, worker, hook: bool) -> None:
    key = 0x7C000000 + uuid.uuid4().int % 0xFFFFFF
    wrote = await observed(
        client,
        scripted,
        worker,
        LIBC + f"q = libc.msgget({key}, 0o1666)\nm = struct.pack('q', 1) + {CANARY.encode()!r}\n"
        "print('queued', libc.msgsnd(q, m, len(m) - 8, 0) == 0)",
    )
    if not hook:
        assert "queued True" in wrote  # the kernel let it: inside its own IPC namespace
    await observed(
        client,
        scripted,
        worker,
        LIBC + f"q = libc.msgget({key}, 0)\nbuf = ctypes.create_string_buffer(256)\n"
        "n = libc.msgrcv(q, buf, 248, 0, 0o4000) if q >= 0 else -1\n"
        "print('ESCAPED' if n > 0 else 'refused', buf.raw[8 : 8 + max(n, 0)])",
    )
    assert key not in sysv_keys("msg")
    await then_an_honest_episode_answers(client, scripted, worker)


async def test_shared_memory_ends_with_its_episode(client, scripted, worker, hook: bool) -> None:
    keys = [0x7B000000 + uuid.uuid4().int % 0xFFFFFF + i for i in range(4)]
    try:
        shown = await observed(
            client,
            scripted,
            worker,
            LIBC + "libc.shmat.restype = ctypes.c_void_p\nmade = 0\n"
            f"for key in {keys!r}:\n"
            "    i = libc.shmget(key, 32 << 20, 0o1666)\n"
            "    if i >= 0:\n"
            "        ctypes.memset(libc.shmat(i, None, 0), 1, 32 << 20)\n"
            "        made += 1\n"
            "print('made', made)",
        )
        if not hook:
            assert "made 4" in shown, shown
        for _ in range(100):  # the episode ended and closed its sandbox; the kernel frees its IPC soon after
            if not set(keys) & sysv_keys("shm"):
                break
            await asyncio.sleep(0.05)
        assert not set(keys) & sysv_keys("shm"), "4 x 32 MB of shared memory outlived the episode"
    finally:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        for key in keys:  # a failed run leaves nothing behind
            if (found := libc.shmget(key, 0, 0)) >= 0:
                libc.shmctl(found, 0, None)
    await then_an_honest_episode_answers(client, scripted, worker)


async def test_an_episode_forking_children_stays_in_its_memory_budget(
    client, scripted, worker, hook: bool
) -> None:
    shown = await observed(
        client,
        scripted,
        worker,
        "import os, select, time\nr, w = os.pipe()\nkids = 0\n"
        "for _ in range(5):\n"
        "    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
        "    if pid == 0:\n"
        "        try:\n            held = b'x' * (600 << 20)\n            os.write(w, b'1')\n"
        "        except MemoryError:\n            os._exit(1)\n"
        "        time.sleep(120)\n        os._exit(0)\n"
        "    kids += 1\n"
        "os.close(w)\nfilled = 0\n"
        "while filled < kids and select.select([r], [], [], 5)[0]:\n"
        "    got = os.read(r, 16)\n    if not got:\n        break\n    filled += len(got)\n"
        "import signal\nalive = 0\n"
        "for pid in range(2, 64):\n"
        "    try:\n        os.kill(pid, 0)\n        alive += os.waitpid(pid, os.WNOHANG) == (0, 0)\n"
        "    except (OSError, ChildProcessError):\n        pass\n"
        "print('filled', filled, 'of', kids, 'alive', alive)",
    )
    if hook:
        assert "filled 0 of 0" in shown, shown  # the hook refused the first fork
    else:
        filled = int(shown.split("filled")[1].split()[0])
        alive = int(shown.split("alive")[1].split()[0])
        # Held at once is what counts: a child ended past the budget may have filled first.
        assert min(filled, alive) * 600 <= 1024, shown  # 5 x 600 MB = 3 GB per-process only
    await then_an_honest_episode_answers(client, scripted, worker)


async def test_no_process_of_the_worker_can_be_named(client, scripted, worker, hook: bool) -> None:
    shown = await observed(
        client,
        scripted,
        worker,
        f"import os\ntry:\n    os.kill({os.getpid()}, 0)\n    print('ESCAPED')\n"
        "except ProcessLookupError:\n    print('no such process')\n"
        "except PermissionError as e:\n"
        "    print('refused' if 'sandbox:' in str(e) else 'ESCAPED: it is there')",
    )
    if not hook:
        assert "no such process" in shown, shown
    await then_an_honest_episode_answers(client, scripted, worker)


async def test_io_uring_memfd_and_kernel_sockets_are_refused(client, scripted, worker, hook: bool) -> None:
    calls = (
        "libc.syscall(425, 4, ctypes.create_string_buffer(120))",  # io_uring_setup
        "libc.syscall(319, b'x', 0)",  # memfd_create
        "libc.socket(16, 3, 0)",  # AF_NETLINK
        "libc.socket(40, 1, 0)",  # AF_VSOCK
    )
    shown = await observed(
        client,
        scripted,
        worker,
        LIBC
        + "".join(
            f"fd = {c}\nprint('ESCAPED' if fd >= 0 else 'refused', ctypes.get_errno())\n" for c in calls
        ),
    )
    if not hook:
        assert shown.split().count("refused") == len(calls), shown
    await then_an_honest_episode_answers(client, scripted, worker)


# --- the pieces, alone ----------------------------------------------------------------------


SECCOMP_PROBE = """
import ctypes, errno, importlib.util, os, sys
spec = importlib.util.spec_from_file_location("kernel", sys.argv[1])
kernel = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kernel)
libc = ctypes.CDLL(None, use_errno=True)
kernel.install_seccomp(libc)
def tried(call):
    result = call()
    return "ok" if result >= 0 else errno.errorcode[ctypes.get_errno()]
print(tried(lambda: libc.syscall(425, 4, ctypes.create_string_buffer(120))))  # io_uring_setup
print(tried(lambda: libc.syscall(319, b"x", 0)))  # memfd_create
print(tried(lambda: libc.socket(16, 3, 0)))  # AF_NETLINK
print(tried(lambda: libc.socket(17, 3, 0)))  # AF_PACKET
print(tried(lambda: libc.socket(40, 1, 0)))  # AF_VSOCK
print(tried(lambda: libc.socketpair(16, 3, 0, (ctypes.c_int * 2)())))  # AF_NETLINK pair
print(tried(lambda: libc.socket(2, 1, 0)))  # AF_INET: a REPL may make one (no network anyway)
print(tried(lambda: libc.socket(1, 1, 0)))  # AF_UNIX
"""


def test_the_seccomp_program_refuses_io_uring_memfd_and_three_socket_families() -> None:
    """The filter alone, in a fresh process: refused calls fail with EPERM, the socket
    families with EAFNOSUPPORT, and the families a REPL may use are still allowed."""
    out = subprocess.run(
        [sys.executable, "-c", SECCOMP_PROBE, kernel.__file__], capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["EPERM", "EPERM", *["EAFNOSUPPORT"] * 4, "ok", "ok"], out


def test_the_sweep_removes_empty_leaves_and_keeps_those_in_use() -> None:
    """Leaves a killed worker could not remove are swept by the reaper; one a process is in
    is never touched."""
    if not cgroups.support().available:
        pytest.skip(f"no cgroup for sandboxes here: {cgroups.support().reason}")
    name = f"w-0-test.{uuid.uuid4().hex[:8]}"
    gone, kept = (subprocess.Popen(["sleep", "60"]) for _ in range(2))
    try:
        empty, busy = cgroups.place(gone.pid, name + "-empty"), cgroups.place(kept.pid, name + "-busy")
        assert empty is not None and busy is not None
        gone.kill()
        gone.wait()  # its leaf is empty now, and nobody removed it
        cgroups.sweep(grace_s=0)
        assert not any(os.path.exists(p) for p in empty.paths)
        assert all(os.path.exists(p) for p in busy.paths)
    finally:
        for process in (gone, kept):
            process.kill()
            process.wait()
        for hierarchy in cgroups.support().hierarchies:
            for suffix in ("-empty", "-busy"):
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(hierarchy.base, name + suffix))


NOT_ROOT = """
import json, os, struct, subprocess, sys
directory, child, worker = sys.argv[1], sys.argv[2], int(sys.argv[3])
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
send({"op": "init", "seed": 1, "memory_mb": 1024, "audit_hook": False, "processes": 64, "seq": 1})
layers = receive()["layers"]
code = f"import os\\ntry:\\n    os.kill({worker}, 0)\\nexcept ProcessLookupError:\\n    print('none')"
send({"op": "exec", "code": code, "cell_name": "<cell 1>", "timeout": 10, "limit": 1000, "seq": 2})
print(json.dumps({"layers": layers, "stdout": receive()["stdout"]}))
process.kill()
"""


def test_a_worker_that_is_not_root_still_gets_ipc_and_pid_namespaces_and_says_what_it_lacks(
    sandboxes: Path,
) -> None:
    """The path of a worker running as an ordinary user (uid `nobody` here, with the system's
    Python, standard library only as the sandbox is): its sandboxes share its uid, so the
    PID namespace is what keeps them from signalling it; with no cgroup it can write, the
    layers say memory is bounded per process only."""
    python = "/usr/bin/python3"
    setpriv = "/usr/bin/setpriv"
    if not (os.path.exists(python) and os.path.exists(setpriv)):
        pytest.skip("needs /usr/bin/python3 and setpriv to run as another user")
    version = subprocess.run(
        [python, "-c", "import sys; print(sys.version_info[:2] >= (3, 11))"], text=True, capture_output=True
    )
    if version.stdout.strip() != "True":
        pytest.skip("the system's Python is older than the sandbox's code")
    directory = sandboxes / "not-root"  # under /tmp, traversable by anyone
    directory.mkdir(mode=0o777)
    directory.chmod(0o777)
    out = subprocess.run(
        [
            setpriv,
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            python,
            "-c",
            NOT_ROOT,
            str(directory),
            str(Path(kernel.__file__).with_name("child.py")),
            str(os.getpid()),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    layers = seen["layers"]
    assert layers["ipc_pid"] == "ipc+pid" and layers["network"] == "userns+netns", layers
    assert "memory is bounded per process only" in layers["rlimits"], layers
    assert layers["cgroup"].startswith("none"), layers
    assert seen["stdout"] == "none\n"  # the worker, same uid, is not there to be signalled
