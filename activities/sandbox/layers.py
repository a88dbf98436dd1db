"""The sandbox's isolation layers, put in place in one order when it starts (`start_layers`).

Why an order: some layers need privileges that others take away (namespaces and the private
root are made before the uid drop, or inside a user namespace of its own), the parent-death
signal must follow the uid change (the kernel clears it then), the seccomp filter forbids
what the earlier layers call, and the audit hook comes last, one layer more: every other
layer holds without it. The kernel-enforced layers themselves are in kernel.py, the cgroup
in cgroups.py; this module holds the process's own (uid, rlimits, death signal, the audit
hook, the sweep of strays after each cell) and what must be loaded before any of them
(PRELOADED, libc). Standard library only, like everything the sandbox loads.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import resource
import signal
import sys
import sysconfig
from typing import Any

from . import cgroups, kernel

NOBODY = 65534
_BLOCKED_PREFIXES = (
    "socket.",
    "subprocess.",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.fork",
    "os.forkpty",
    "os.kill",
    "os.killpg",
    "signal.pthread_kill",
    "ctypes.",
    "os.symlink",
    "os.link",
    "pty.",
    "_posixsubprocess.",
    "sys.remote_exec",
)
_PATH_WRITE_EVENTS = {
    "os.remove",
    "os.rename",
    "os.replace",
    "os.mkdir",
    "os.rmdir",
    "os.chmod",
    "os.chown",
    "os.truncate",
    "os.utime",
    "os.chdir",
    "shutil.rmtree",
    "shutil.copyfile",
    "shutil.move",
}
_PATH_READ_EVENTS = {"os.listdir", "os.scandir", "glob.glob"}


_LIBC: Any = None


def load_libc() -> Any:
    """libc through ctypes, loaded once per process: a fork-server template loads it before
    forking, so its sandboxes skip the load (`start_layers` drops the handle when done)."""
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def forget_libc() -> None:
    global _LIBC
    _LIBC = None


class LayerError(RuntimeError):
    """A sandbox layer that must hold could not be put in place: the sandbox does not start."""


# Imported before the uid drop: the interpreter may live where `nobody` cannot read
# (a pyenv under /root), and model code reaches for these most.
PRELOADED = (
    "random re json math cmath collections collections.abc itertools functools operator "
    "statistics string textwrap datetime heapq bisect decimal fractions typing dataclasses "
    "csv io hashlib base64 difflib unicodedata copy pprint time enum zlib struct array "
    "calendar numbers html html.parser urllib.parse uuid codecs locale fnmatch glob shlex "
    "contextlib abc keyword tokenize warnings gzip bz2 lzma zipfile tarfile pathlib socket subprocess "
    "encodings.idna inspect"
).split()


def preload_modules() -> None:
    """PRELOADED, and the snapshot module (cloudpickle), while every file is in reach."""
    for name in PRELOADED:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    try:
        importlib.import_module(".snapshot", __package__)
    except ImportError:
        pass  # no cloudpickle here: the host is told when it asks for a snapshot


def set_ids(uid: int) -> str:
    """Become `uid` (group `uid`, no supplementary groups) for good: a worker running as root
    never leaves a cell as uid 0."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    if os.geteuid() != uid or os.getegid() != uid or 0 in (os.getuid(), os.getgid()):
        raise LayerError("uid drop did not take effect")
    return f"uid {uid}"


def die_with_parent(parent_pid: int, libc: Any) -> str:
    # Set after the uid change: the kernel clears the parent-death signal on credential
    # changes. A SIGKILLed worker must not leave sandboxes behind.
    try:
        result = libc.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except OSError as exc:
        raise LayerError(f"cannot set the parent-death signal: {exc}") from exc
    if result != 0:
        raise LayerError("cannot set the parent-death signal: prctl failed")
    if os.getppid() != parent_pid:
        os._exit(3)  # the worker died before we could ask to die with it
    return "SIGKILL on worker death"


FALLBACK_TASKS = 8
"""Without a cgroup of its own, a sandbox with a uid of its own bounds its memory as
RLIMIT_AS x RLIMIT_NPROC: at most this many processes (threads count), each with an
address space of its budget / FALLBACK_TASKS, so all of them together stay in the budget."""


def set_limits(memory_mb: int, file_mb: int, cpu_s: int, processes: int | None, whole: bool = False) -> str:
    """Kernel limits of the whole sandbox life: memory, file size, open files, CPU time (a
    thread a cell left spinning is stopped by it), and, when the sandbox has a uid of its
    own, processes (a fork bomb stops there; with a shared uid the count would be the
    worker's too).

    RLIMIT_AS is per process. When a cgroup bounds the sandbox's memory as a whole (`whole`),
    each process may have the whole budget; otherwise, with a uid of its own, the budget is
    split: FALLBACK_TASKS processes of budget / FALLBACK_TASKS each. With neither (a worker
    not root, no delegated cgroup) memory is bounded per process only, and said so."""
    budget = memory_mb
    if not whole and processes is not None:
        processes = min(processes, FALLBACK_TASKS)
        memory_mb = max(budget // processes, 1)
    limits = {
        "RLIMIT_AS": (resource.RLIMIT_AS, memory_mb * 1024 * 1024),
        "RLIMIT_FSIZE": (resource.RLIMIT_FSIZE, file_mb * 1024 * 1024),
        "RLIMIT_CORE": (resource.RLIMIT_CORE, 0),
        "RLIMIT_NOFILE": (resource.RLIMIT_NOFILE, OPEN_FILES),
        "RLIMIT_CPU": (resource.RLIMIT_CPU, cpu_s),
    }
    if processes is not None:
        limits["RLIMIT_NPROC"] = (resource.RLIMIT_NPROC, processes)
    for label, (kind, value) in limits.items():
        try:
            resource.setrlimit(kind, (value, value))
        except (ValueError, OSError, OverflowError) as exc:
            raise LayerError(f"cannot set {label} to {value}: {exc}") from exc
    counted = f"{processes} processes" if processes is not None else "processes not limited (shared uid)"
    if whole:
        bound = ""
    elif processes is not None:
        bound = f"; no cgroup: {memory_mb} MB x {processes} processes bound the sandbox's {budget} MB"
    else:
        bound = "; no cgroup and a shared uid: memory is bounded per process only"
    return (
        f"address space {memory_mb} MB, files {file_mb} MB, no core, {OPEN_FILES} open files, "
        f"CPU {cpu_s} s, {counted}{bound}"
    )


OPEN_FILES = 256


def readable_roots(sandbox_dir: str) -> tuple[str, ...]:
    """What the audit hook lets a cell read: the Python installation, time zones, locales,
    three devices, the sandbox's own directory, and the host's side of it (read-only, where
    its own directory is a tmpfs: the files the host wrote for it)."""
    paths = sysconfig.get_paths()
    roots = {paths.get(key, "") for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots |= {
        os.path.join(sys.base_prefix, "lib"),
        "/usr/share/zoneinfo",
        "/usr/lib/locale",
        "/etc/localtime",
        "/dev/null",
        "/dev/urandom",
        "/dev/zero",
        sandbox_dir,
        kernel.HOST_FILES,
    }
    return tuple(sorted(os.path.normpath(r) for r in roots if r))


def make_guard(sandbox_dir: str) -> Any:
    sandbox_dir = os.path.normpath(sandbox_dir)
    readable = readable_roots(sandbox_dir)

    def inside(path: Any, roots: tuple[str, ...]) -> bool:
        if isinstance(path, int):
            return True  # an fd the process already holds
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, str):
            path = os.fspath(path)
        full = os.path.normpath(os.path.join(sandbox_dir, path))
        return any(full == r or full.startswith(r + os.sep) for r in roots)

    def guard(event: str, args: tuple[Any, ...]) -> None:
        if event == "os.kill" and args == (-1, signal.SIGKILL) and _SWEEPING[0]:
            return  # `sweep_strays`: reaches only this sandbox's own uid, whoever asks
        if event.startswith(_BLOCKED_PREFIXES):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode = args[0], args[1]
            writing = isinstance(mode, str) and any(c in mode for c in "wax+")
            if isinstance(mode, int):  # os.open flags
                writing = bool(mode & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC))
            roots = (sandbox_dir,) if writing else readable
            if path is not None and not inside(path, roots):
                raise PermissionError(f"sandbox: access to {path!r} is not allowed")
        elif event in _PATH_WRITE_EVENTS:
            for path in args[:2]:
                if isinstance(path, (str, bytes, os.PathLike)) and not inside(path, (sandbox_dir,)):
                    raise PermissionError(f"sandbox: {event} outside the sandbox is not allowed")
        elif event in _PATH_READ_EVENTS:
            if args and args[0] is not None and not inside(args[0], readable):
                raise PermissionError(f"sandbox: {event} of {args[0]!r} is not allowed")

    return guard


_SWEEPING = [False]
_OWN_UID = [False]  # the sandbox runs as a uid no other process has (a root worker's)


def sweep_strays() -> None:
    """After each cell: SIGKILL every other process of this sandbox's own uid (kill(-1)
    reaches exactly those), and reap them. A process a cell forked (possible once the audit
    hook is out of the way) shares the channel's descriptors: it must not outlive its cell
    and speak later. With a shared uid (a worker not root) kill(-1) would reach the worker:
    nothing is swept, and the audit hook's refusal of fork is what stands."""
    if not _OWN_UID[0]:
        return
    _SWEEPING[0] = True
    try:
        os.kill(-1, signal.SIGKILL)
    except OSError:
        pass  # none to kill
    finally:
        _SWEEPING[0] = False
    while True:  # its own children, each SIGKILLed: reaped as they die
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return
        except InterruptedError:
            continue


def start_layers(init: dict[str, Any], parent_pid: int, sandbox_dir: str) -> dict[str, str]:
    """Put every isolation layer in place; each reports what it did.

    As root (with CAP_SYS_ADMIN): an empty network namespace and a private root filesystem
    are made as root, then the sandbox becomes its own uid (which clears every capability).
    Otherwise (not root, or root without CAP_SYS_ADMIN, as in a default container): the uid
    is dropped first, then a user namespace of its own (its uid mapped to itself) makes the
    network and mount namespaces, and every capability is dropped. Then the limits, the
    parent-death signal, the seccomp filter, and last the audit hook (Python's own guard,
    one layer more: every other layer holds without it)."""
    # libc (through ctypes), the kernel layers and `resource` (set_limits) are loaded before
    # the uid drop and the new root (kernel and resource with this module): after them the
    # interpreter's own files may be out of reach.
    libc = load_libc()
    uid = int(init.get("uid", NOBODY))
    filesystem = bool(init.get("filesystem", True))
    preload_modules()
    guard = make_guard(sandbox_dir)
    sources = kernel.readonly_sources()
    layers: dict[str, str] = {}
    root = os.geteuid() == 0
    _OWN_UID[0] = root and "uid" in init  # the host gave it a uid of its own
    memory_mb, processes = int(init.get("memory_mb", 4096)), int(init.get("processes", 64))
    # First, while /sys is in view and before any privilege goes: the limits of the cgroup the
    # host placed it in, which bound the sandbox as a whole (activities/sandbox/cgroups.py).
    try:
        whole = cgroups.limit_own(memory_mb, processes)
    except OSError as exc:
        raise LayerError(f"cannot limit the sandbox's cgroup: {exc}") from exc
    layers["cgroup"] = whole or "none (the host placed it in no cgroup of its own)"
    dir_mb = int(init["dir_mb"]) if init.get("dir_mb") else None  # the own directory's tmpfs
    if root and init.get("namespaces") != "user" and libc.unshare(kernel.CLONE_NEWNET) == 0:
        layers["network"] = "netns"
        layers["ipc_pid"] = _ipc_and_pids(libc)
        # Made as root, so its tmpfs is given to the uid the sandbox becomes next.
        layers["filesystem"] = _filesystem(libc, sandbox_dir, sources, filesystem, dir_mb, uid)
        layers["uid"] = set_ids(uid)
    else:
        if root:
            layers["uid"] = set_ids(uid)  # first: no namespace may leave it uid 0
        else:
            uid = os.geteuid()
            layers["uid"] = f"uid {uid} (worker not root: no drop)"
        try:
            kernel.enter_user_namespace(libc, uid, os.getegid())
            if libc.unshare(kernel.CLONE_NEWNET) != 0:
                raise OSError("unshare(CLONE_NEWNET) refused")
            layers["network"] = "userns+netns"
            layers["ipc_pid"] = _ipc_and_pids(libc)
            layers["filesystem"] = _filesystem(libc, sandbox_dir, sources, filesystem, dir_mb, None)
            kernel.drop_capabilities(libc)
        except OSError as exc:
            layers.setdefault("network", "none")
            layers.setdefault("ipc_pid", f"none (no user namespace: {exc})")
            layers.setdefault("filesystem", f"none (no user namespace: {exc})")
    layers["rlimits"] = set_limits(
        memory_mb,
        int(init.get("file_mb", 256)),
        int(init.get("cpu_s", 3600)),
        processes if root else None,
        whole=whole is not None,
    )
    layers["death_signal"] = die_with_parent(parent_pid, libc)
    try:
        layers["seccomp"] = kernel.install_seccomp(libc)
    except OSError as exc:
        raise LayerError(f"cannot install the seccomp filter: {exc}") from exc
    if layers["ipc_pid"] == "ipc+pid":
        # Last of the kernel layers, so the keeper left outside holds every one of them too.
        kernel.become_pid_one(libc, host_reads=not root)  # a worker of its own uid reads its files
        _OWN_UID[0] = True  # kill(-1) now reaches the namespace's processes only: strays can be swept
    os.chdir(sandbox_dir)
    forget_libc()  # model code finds no libc handle lying around (it is refused anyway)
    if init.get("audit_hook", True):
        sys.addaudithook(guard)
        layers["audit_hook"] = "on"
    else:  # only tests turn it off, to prove the other layers hold alone
        layers["audit_hook"] = "off"
    return layers


def _ipc_and_pids(libc: Any) -> str:
    try:
        return kernel.private_ipc_and_pids(libc)
    except OSError as exc:  # a kernel without these namespaces: said, and `drlm doctor` warns
        return f"none ({exc})"


def _filesystem(
    libc: Any, sandbox_dir: str, sources: list[str], wanted: bool, dir_mb: int | None, uid: int | None
) -> str:
    if not wanted:
        return "off (asked)"
    try:
        return kernel.isolate_filesystem(libc, sandbox_dir, sources, dir_mb, uid)
    except OSError as exc:
        raise LayerError(f"cannot make the sandbox's private root: {exc}") from exc
