"""A control group per sandbox: memory, tasks and CPU bounded for the sandbox as a whole.

RLIMIT_AS bounds one process, and a sandbox may have many (a cell that forks five children
filling 600 MB each took 2.8 GB with a per-process limit of 1 GB). A cgroup counts them all:
`memory.max` (the kernel's OOM killer ends the largest process of the sandbox, not of the
machine), `pids.max` (tasks, threads included) and `cpu.max` (one core at most, so a busy
sandbox leaves the others theirs).

The worker makes the leaf and moves the sandbox into it before the sandbox reads its first
request (`place`, host side), so no code of the sandbox runs outside it; processes it starts
are born inside. The sandbox writes its own limits (`limit_own`, from its init request, as
root or its worker's uid, before it drops privileges and before its private root hides
/sys), then can reach none of the files again. The worker removes the leaf when the sandbox
is closed (`Leaf.remove`), killing what is left in it; empty leaves left behind (a worker
killed mid-way) are swept by the reaper (`sweep`).

cgroup v2 is used where the worker's cgroup gives its children the memory and pids
controllers (a delegated subtree, or the root of a cgroup namespace); otherwise the v1
memory and pids hierarchies (and cpu, when mounted) where they are writable, as on hybrid
hosts. Where neither is writable (a container with a read-only /sys/fs/cgroup, a worker
that is not root without a delegated subtree), there is no leaf: the sandbox then bounds
itself by RLIMIT_AS x RLIMIT_NPROC (layers.py `set_limits`), and `drlm doctor` says so.

Standard library only: the sandbox loads this file with its siblings (child.py
`_load_siblings`), before any layer is in place.
"""

import contextlib
import errno
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

BASE = "drlm-sandboxes"
"""The directory under the worker's own cgroup (in each hierarchy) holding one leaf per live
sandbox, named after its directory: `<worker home>.<sandbox directory>`."""

CPU_PERIOD_US = 100_000
CPU_CORES = 1
"""A sandbox may use one core at most: a cell spinning every thread cannot take the others'."""

SWEEP_GRACE_S = 60.0
"""An empty leaf younger than this may be one a worker just made and is moving a sandbox
into: the sweep leaves it."""


@dataclass(frozen=True)
class Hierarchy:
    version: int  # 1 or 2
    controllers: frozenset[str]  # those this hierarchy bounds: memory, pids, cpu
    base: str  # <mount>/<worker's cgroup>/drlm-sandboxes


@dataclass
class Support:
    """What this worker can give its sandboxes: hierarchies, or the reason there are none."""

    hierarchies: list[Hierarchy] = field(default_factory=list)
    reason: str = ""

    @property
    def available(self) -> bool:
        return bool(self.hierarchies)

    def describe(self) -> str:
        if not self.available:
            return f"none ({self.reason})"
        names = sorted({c for h in self.hierarchies for c in h.controllers})
        version = "v2" if all(h.version == 2 for h in self.hierarchies) else "v1"
        return f"cgroup {version} leaf per sandbox ({', '.join(names)}) under {self.hierarchies[0].base}"


# --- where the cgroups are ---------------------------------------------------------------------


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(fstype, root, mount point, super options) of each cgroup mount this process sees."""
    found = []
    try:
        with open("/proc/self/mountinfo") as file:
            lines = file.read().splitlines()
    except OSError:
        return []
    for line in lines:
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        found.append((tail[0], fields[3], fields[4].replace("\\040", " "), set(tail[2].split(","))))
    return found


def _own_paths() -> dict[str, str]:
    """This process's cgroup in each hierarchy: controller name (or "" for v2) -> path."""
    paths: dict[str, str] = {}
    try:
        with open("/proc/self/cgroup") as file:
            lines = file.read().splitlines()
    except OSError:
        return paths
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


def _join(mount: str, root: str, path: str) -> str:
    if root != "/" and (path == root or path.startswith(root + "/")):
        path = path[len(root) :] or "/"
    return os.path.normpath(mount + "/" + path.lstrip("/"))


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _read(path: str) -> str:
    with open(path) as file:
        return file.read()


def _v2(mounts: list[tuple[str, str, str, set[str]]], own: dict[str, str]) -> Hierarchy | str:
    """Leaves under the worker's cgroup when it may hand its children the controllers (the
    root, or a cgroup without processes), else beside the worker (its cgroup's parent, when
    that is delegated: the worker runs in a leaf of its own, e.g. under systemd
    `Delegate=yes`)."""
    unified = [(root, mount) for kind, root, mount, _ in mounts if kind == "cgroup2"]
    if not unified or "" not in own:
        return "no cgroup v2 hierarchy"
    root, mount = unified[0]
    directory = _join(mount, root, own[""])
    reasons = []
    for candidate in (directory, os.path.dirname(directory)):
        if not candidate.startswith(mount):
            break
        found = _v2_base(candidate)
        if isinstance(found, Hierarchy):
            return found
        reasons.append(found)
    return "; ".join(reasons)


def _v2_base(directory: str) -> Hierarchy | str:
    try:
        offered = set(_read(os.path.join(directory, "cgroup.controllers")).split())
    except OSError as exc:
        return f"cgroup v2 at {directory}: {exc.strerror}"
    if not {"memory", "pids"} <= offered:
        shown = " ".join(sorted(offered)) or "none"
        return f"cgroup v2 offers no memory and pids controllers at {directory} ({shown})"
    wanted = {"memory", "pids"} | ({"cpu"} & offered)
    try:
        enabled = set(_read(os.path.join(directory, "cgroup.subtree_control")).split())
        if not wanted <= enabled:
            _write(os.path.join(directory, "cgroup.subtree_control"), " ".join(f"+{c}" for c in wanted))
        base = os.path.join(directory, BASE)
        with contextlib.suppress(FileExistsError):
            os.mkdir(base, 0o755)
        _write(os.path.join(base, "cgroup.subtree_control"), " ".join(f"+{c}" for c in wanted))
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if exc.errno == errno.EBUSY:
            reason = "it holds processes"
        return f"cgroup v2 at {directory}: {reason}"
    return Hierarchy(2, frozenset(wanted), base)


def _v1(mounts: list[tuple[str, str, str, set[str]]], own: dict[str, str]) -> list[Hierarchy] | str:
    found: list[Hierarchy] = []
    for needed in ("memory", "pids", "cpu"):
        match = [(r, m, o) for kind, r, m, o in mounts if kind == "cgroup" and needed in o]
        if not match or needed not in own:
            if needed == "cpu":
                continue  # memory and tasks are what bound a sandbox; CPU time has RLIMIT_CPU too
            return f"no cgroup v1 {needed} hierarchy"
        root, mount, opts = match[0]
        base = os.path.join(_join(mount, root, own[needed]), BASE)
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(base, 0o755)
            if not os.access(base, os.W_OK):
                raise PermissionError(errno.EACCES, "not writable")
        except OSError as exc:
            return f"cgroup v1 {needed} at {base}: {exc.strerror or exc}"
        bounded = frozenset({needed} | ({"cpu"} & opts))
        if not any(h.base == base for h in found):
            found.append(Hierarchy(1, bounded, base))
    return found


_SUPPORT: list[Support] = []


def support() -> Support:
    """Found once per process (the first sandbox pays a few reads of /proc and /sys)."""
    if not _SUPPORT:
        _SUPPORT.append(_detect())
    return _SUPPORT[0]


def _detect() -> Support:
    if os.environ.get("DRLM_SANDBOX_CGROUPS", "").lower() in ("0", "off", "no"):
        return Support(reason="turned off (DRLM_SANDBOX_CGROUPS=off)")
    mounts, own = _mounts(), _own_paths()
    if not mounts:
        return Support(reason="no cgroup file system mounted")
    v2 = _v2(mounts, own)
    if isinstance(v2, Hierarchy):
        return Support([v2])
    v1 = _v1(mounts, own)
    if isinstance(v1, list):
        return Support(v1)
    return Support(reason=f"{v2}; {v1}")


# --- one sandbox's leaf (host side) ------------------------------------------------------------


@dataclass
class Leaf:
    """A sandbox's cgroup, one directory per hierarchy."""

    paths: list[str]

    def remove(self) -> bool:
        """Kill what is left in it and remove it. Called on the worker's event loop, a leaf
        still busy (its last process exiting) is tried again later on the loop, never waited
        for; elsewhere the wait is a few tens of ms. False if a directory stays for now (the
        reaper's `sweep` removes what is left for good)."""
        busy = [path for path in self.paths if not _remove(path, attempts=1)]
        if not busy:
            return True
        loop = _running_loop()
        if loop is None:
            return all(_remove(path) for path in busy)
        for path in busy:
            loop.call_later(RETRY_S, _retry, loop, path, 1)
        return False


RETRY_S = 0.05
RETRIES = 20


def _retry(loop: Any, path: str, attempt: int) -> None:
    if not _remove(path, attempts=1) and attempt < RETRIES:
        loop.call_later(RETRY_S * attempt, _retry, loop, path, attempt + 1)


def _running_loop() -> Any:
    """The running asyncio loop, if this is a worker's thread running one (the sandbox, which
    loads this file too, never imports asyncio)."""
    asyncio = sys.modules.get("asyncio")
    if asyncio is None:
        return None
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _pids(path: str) -> list[int]:
    try:
        return [int(p) for p in _read(os.path.join(path, "cgroup.procs")).split()]
    except (OSError, ValueError):
        return []


def _remove(path: str, attempts: int = 3) -> bool:
    for attempt in range(attempts):
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                log.warning("could not remove the sandbox cgroup %s: %s", path, exc)
                return False
        if os.path.exists(os.path.join(path, "cgroup.kill")):
            with contextlib.suppress(OSError):
                _write(os.path.join(path, "cgroup.kill"), "1")
        for pid in _pids(path):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if attempt + 1 < attempts:
            time.sleep(0.01 * (attempt + 1))  # the killed are exiting; the next rmdir usually holds
    return False


_TOLD = [False]


def place(pid: int, name: str) -> Leaf | None:
    """Make the leaf `name` and move `pid` (a sandbox that has not yet read its init request)
    into it. None when this worker cannot (said once in its log, and by `drlm doctor`)."""
    found = support()
    if not found.available:
        if not _TOLD[0]:
            _TOLD[0] = True
            log.warning(
                "sandboxes get no cgroup of their own on this worker: %s; each bounds itself by "
                "RLIMIT_AS x RLIMIT_NPROC instead (see `drlm doctor`)",
                found.reason,
            )
        return None
    made: list[str] = []
    try:
        for hierarchy in found.hierarchies:
            path = os.path.join(hierarchy.base, name)
            os.mkdir(path, 0o755)
            made.append(path)
            _write(os.path.join(path, "cgroup.procs"), str(pid))
    except OSError as exc:
        log.warning("could not put sandbox %d in a cgroup of its own (%s): %s", pid, name, exc)
        for path in made:
            _remove(path)
        return None
    return Leaf(made)


def sweep(grace_s: float = SWEEP_GRACE_S) -> int:
    """Remove the empty leaves (older than `grace_s`) that closed sandboxes or dead workers
    left. A leaf still holding processes is left alone: the reaper kills a dead worker's
    recorded processes (sandbox_reaper.py), and the leaf goes at a later sweep. It never
    kills by leaf: a leaf may be a live worker's of another PID namespace. Returns how many
    went."""
    found = support()
    removed = 0
    now = time.time()
    for hierarchy in found.hierarchies:
        try:
            entries = list(os.scandir(hierarchy.base))
        except OSError:
            continue
        for entry in entries:
            try:
                if not entry.is_dir(follow_symlinks=False) or now - entry.stat().st_mtime < grace_s:
                    continue
                if _pids(entry.path):
                    continue
                os.rmdir(entry.path)
            except OSError:
                continue  # busy (a process still exiting) or gone: the next sweep
            removed += 1
    return removed


# --- in the sandbox ---------------------------------------------------------------------------


LIMIT_FILES = {
    # (version, what) -> file, and how the value is written
    (2, "memory"): ("memory.max", "{bytes}"),
    (2, "swap"): ("memory.swap.max", "0"),
    (2, "pids"): ("pids.max", "{tasks}"),
    (2, "cpu"): ("cpu.max", "{quota} {period}"),
    (1, "memory"): ("memory.limit_in_bytes", "{bytes}"),
    (1, "swap"): ("memory.memsw.limit_in_bytes", "{bytes}"),  # memory + swap: no swap at all
    (1, "pids"): ("pids.max", "{tasks}"),
    (1, "cpu"): ("cpu.cfs_quota_us", "{quota}"),
}


def own_leaves() -> list[tuple[int, str]]:
    """The leaves this process was placed in: (version, directory) per hierarchy."""
    mounts, own = _mounts(), _own_paths()
    leaves: list[tuple[int, str]] = []
    for controller, path in own.items():
        if os.path.basename(os.path.dirname(path)) != BASE:
            continue
        for kind, root, mount, opts in mounts:
            version = 2 if kind == "cgroup2" else 1
            if (version == 2) != (controller == "") or (version == 1 and controller not in opts):
                continue
            directory = _join(mount, root, path)
            if (version, directory) not in leaves:
                leaves.append((version, directory))
    return leaves


def limit_own(memory_mb: int, tasks: int) -> str | None:
    """In the sandbox, before it drops privileges: write its memory, task and CPU limits into
    the leaf the host placed it in. None when it was placed in none. Raises OSError when a
    limit cannot be written (the sandbox then refuses to start: a leaf without limits
    bounds nothing)."""
    leaves = own_leaves()
    if not leaves:
        return None
    values = {
        "bytes": memory_mb * 1024 * 1024,
        "tasks": tasks,
        "quota": CPU_CORES * CPU_PERIOD_US,
        "period": CPU_PERIOD_US,
    }
    bounded: set[str] = set()
    for version, directory in leaves:
        for what in ("memory", "swap", "pids", "cpu"):
            name, template = LIMIT_FILES[(version, what)]
            path = os.path.join(directory, name)
            if not os.path.exists(path):
                continue  # not this hierarchy's controller (or no swap accounting)
            _write(path, template.format(**values))
            bounded.add(what)
    if not {"memory", "pids"} <= bounded:
        raise OSError(errno.ENOTSUP, f"the sandbox's cgroup bounds only {sorted(bounded)}")
    cpu = f", {CPU_CORES} CPU core" if "cpu" in bounded else ""
    return f"whole sandbox: memory {memory_mb} MB, {tasks} tasks{cpu} (cgroup v{leaves[0][0]})"


def leaf_name(directory: os.PathLike[str] | str) -> str:
    """`<worker home>.<sandbox directory>`: unique, and says whose it is to a reader."""
    path = os.fspath(directory).rstrip("/")
    return f"{os.path.basename(os.path.dirname(path))}.{os.path.basename(path)}"
