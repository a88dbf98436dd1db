"""Sandbox hygiene: the directories and processes of workers that died without cleaning up.

Each REPL host (`ReplActivities`) keeps its sandboxes in a home of its own under the sandbox
root, `w-<pid>-<random>/`, holding `owner.json` (the worker's pid, its start time from
/proc/<pid>/stat, the boot and pid namespace it runs in) and a `<pid>.proc` record for each
process it started (a sandbox or the fork-server template: pid and start time). The worker
writes both where its sandboxes cannot (a root-owned 0711 directory when they run as
`nobody`), so a sandbox cannot forge the record of a process it would like killed.

A worker killed by SIGKILL leaves its home behind; its processes normally die with it
(PR_SET_PDEATHSIG), but not always (a sandbox forked after the worker's last breath, a
process stuck in a cell). `reap_dead` finds the homes whose owner is gone (no such pid, a
zombie, a pid reused by a process started at another time, another boot), claims each by
renaming it (two reapers never both work on one home), SIGKILLs the recorded processes that
are still those processes (same start time, a sandbox command line naming that owner), and
removes the directory. It never judges a home of another pid namespace (its pids mean
nothing here) or of another user, root or not (a home another user made holds records that
user wrote), and reads only records this user wrote; it reaps nothing under a root that is
not this user's own (activities/sandbox_start.py makes it so, or refuses it). A process is
killed through a pidfd opened before its start time and command line are checked, so the
process checked is the one killed, even if its pid were reused in between.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import stat
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from durable_rlm.host.processes import proc_stat, running

try:
    from durable_rlm.activities.sandbox import cgroups
    from durable_rlm.host.files import remove_sandbox_tree
except ImportError:  # loaded with durable_rlm.host alone, as another uid's reaper (tests/test_hygiene.py)
    cgroups = None  # type: ignore[assignment]  # absent when loaded alone: checked where used
    remove_sandbox_tree = None  # type: ignore[assignment]  # likewise

log = logging.getLogger(__name__)

OWNER_FILE = "owner.json"
HOME_PREFIX = "w-"
NEW_PREFIX = ".new-"  # a home being made: renamed to w-... once its owner file is in
CLAIMED_PREFIX = ".reaping-"  # a dead home one reaper has taken
RECORD_SUFFIX = ".proc"
GRACE_S = 60.0
"""How old a home without a readable owner (or a half-made or half-reaped one) must be before
it is taken for dead: younger, it may be one another worker is making right now."""
SANDBOX_SCRIPTS = (b"child.py", b"forkserver.py")


# --- processes ------------------------------------------------------------------------------


def sandbox_of(pid: int, start: int, owner_pid: int | None) -> bool:
    """Is `pid` still that sandbox (or template) process, started by `owner_pid`? Checked
    right before a kill: a pid is only killed while it is the process that was recorded."""
    if pid <= 1 or pid == os.getpid() or not running(pid, start):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            argv = file.read().split(b"\0")
    except OSError:
        return False
    # `python -s -P child.py WORKER_PID DIR`, or a template's (and its forks')
    # `python -s -P forkserver.py WORKER_PID`.
    for arg, after in zip(argv, argv[1:], strict=False):
        if os.path.basename(arg) in SANDBOX_SCRIPTS:
            return owner_pid is None or after == str(owner_pid).encode()
    return False


def _read_line(path: str) -> str:
    try:
        with open(path) as file:
            return file.read().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


# --- owners ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Owner:
    """The worker process a home belongs to, named so that a reused pid is not mistaken for it."""

    pid: int
    start: int
    boot: str = ""
    pidns: str = ""

    @classmethod
    def current(cls) -> Owner | None:
        """This process; None when /proc cannot say (then nothing can be judged)."""
        found = proc_stat(os.getpid())
        if found is None:
            return None
        return cls(
            pid=os.getpid(),
            start=found.start,
            boot=_read_line("/proc/sys/kernel/random/boot_id"),
            pidns=_pid_namespace(),
        )

    @classmethod
    def parse(cls, data: bytes) -> Owner:
        """Raises ValueError for anything but a whole owner file."""
        try:
            fields = json.loads(data)
            owner = cls(int(fields["pid"]), int(fields["start"]), str(fields["boot"]), str(fields["pidns"]))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not an owner file: {exc}") from exc
        if owner.pid <= 0 or owner.start < 0:
            raise ValueError("not an owner file: bad pid or start time")
        return owner

    def verdict(self, here: Owner) -> Literal["alive", "dead", "foreign"]:
        if self.boot and here.boot and self.boot != here.boot:
            return "dead"  # every process of an earlier boot is gone
        if self.pidns != here.pidns:
            return "foreign"  # its pid means another process here: not ours to judge
        return "alive" if running(self.pid, self.start) else "dead"


RECORD_BYTES = 64 * 1024
"""An owner file or a process record is a line of JSON; anything larger is not one."""


def read_own_file(path: Path) -> bytes | None:
    """A small regular file this user wrote, or None: never through a link, never a FIFO or a
    device, never a file another user owns (a record another user wrote proves nothing)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_size > RECORD_BYTES:
            return None
        return os.read(fd, RECORD_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)


def read_owner(home: Path) -> Owner | None:
    data = read_own_file(home / OWNER_FILE)
    try:
        return None if data is None else Owner.parse(data)
    except ValueError:
        return None


def _write_atomically(path: Path, data: bytes) -> None:
    """A reader sees the whole file or none (a crash mid-write leaves only a temporary)."""
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(temporary, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise


# --- this worker's home ---------------------------------------------------------------------


class SandboxHome:
    """This REPL host's directory under the sandbox root: its sandboxes, its template's log,
    and the files that say whose they are."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.owner = Owner.current()
        self.path = root / f"{HOME_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def ensure(self) -> Path:
        """The home, made now if it is not there (first use, or after `remove`)."""
        try:
            there = stat.S_ISDIR(os.lstat(self.path).st_mode)  # a link in its place is not it
        except FileNotFoundError:
            there = False
        if not there:
            self._make()
        return self.path

    def _make(self) -> None:
        # Made aside and renamed into place once the owner file is in: a w-... home without
        # a readable owner is then never one being made.
        staging = self.root / f"{NEW_PREFIX}{uuid.uuid4().hex}"
        staging.mkdir(mode=0o700)
        try:
            # The unprivileged sandbox user must pass through to its own directory.
            os.chmod(staging, 0o711 if os.geteuid() == 0 else 0o700)
            if self.owner is not None:
                _write_atomically(staging / OWNER_FILE, json.dumps(asdict(self.owner)).encode())
            os.rename(staging, self.path)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def record(self, pid: int, role: str) -> None:
        """Note a process this worker started, so a reaper can kill it if the worker dies.
        Best effort: its death signal is the first line, this the second."""
        found = proc_stat(pid)
        if found is None:
            return  # already gone
        body = json.dumps({"pid": pid, "start": found.start, "role": role}).encode()
        try:
            _write_atomically(self.path / f"{pid}{RECORD_SUFFIX}", body)
        except OSError as exc:
            log.warning("could not record sandbox process %d in %s: %s", pid, self.path, exc)

    def forget_ended(self) -> int:
        """Drop the records of this worker's processes that have ended (a long-lived worker
        would otherwise gather one per sandbox it ever started)."""
        dropped = 0
        with contextlib.suppress(OSError):
            for path in self.path.glob(f"*{RECORD_SUFFIX}"):
                record = _read_record(path)
                if record is not None and not running(*record):
                    with contextlib.suppress(OSError):
                        path.unlink()
                        dropped += 1
        return dropped

    def remove(self) -> None:
        """The worker closes: its sandboxes and template are gone, so is their home."""
        if not remove_tree(self.path):
            log.warning("could not remove the sandbox directory %s", self.path)


def _read_record(path: Path) -> tuple[int, int] | None:
    data = read_own_file(path)
    try:
        fields = json.loads(data) if data is not None else None
        return None if fields is None else (int(fields["pid"]), int(fields["start"]))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


# --- reaping --------------------------------------------------------------------------------


@dataclass
class Reaped:
    home: str  # its name before it was claimed
    owner_pid: int | None  # None: its owner file was missing or unreadable
    sandboxes: int  # sandbox directories removed with it
    killed: list[int] = field(default_factory=list)  # processes that had outlived the worker
    removed: bool = True  # False: something in it could not be deleted (told in the log)


def reap_dead(root: Path, grace_s: float = GRACE_S) -> list[Reaped]:
    """Reap every home under `root` whose worker is gone: kill its leftover processes and
    remove its directory. Safe to run from any number of workers at once; what vanishes
    mid-scan, or belongs to a live worker, another user or another pid namespace, is left."""
    here = Owner.current()
    if here is None:
        log.warning("sandbox directories are not reaped: /proc/self/stat cannot be read")
        return []
    try:
        info = os.lstat(root)
    except FileNotFoundError:
        return []
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        log.warning(
            "sandbox directories under %s are not reaped: it is not a directory of this user's "
            "that only it can write (uid %d, mode %s)",
            root,
            info.st_uid,
            stat.filemode(info.st_mode),
        )
        return []
    try:
        entries = list(os.scandir(root))
    except OSError as exc:
        if not isinstance(exc, FileNotFoundError):
            log.warning("could not scan the sandbox root %s: %s", root, exc)
        return []
    reaped: list[Reaped] = []
    for entry in entries:
        try:
            done = _reap_one(root, entry, here, grace_s)
        except OSError as exc:
            log.warning("could not reap %s: %s", entry.path, exc)
            continue
        if done is None:
            continue
        reaped.append(done)
        log.log(
            logging.WARNING if done.killed or not done.removed else logging.INFO,
            "reaped the sandboxes of a dead worker: %s (pid %s), %d sandbox directories%s%s",
            done.home,
            done.owner_pid if done.owner_pid is not None else "unknown",
            done.sandboxes,
            f", killed leftover processes {done.killed}" if done.killed else "",
            "" if done.removed else ", but some of its files could not be deleted",
        )
    forget_stale_uid_claims(root)
    try:
        if cgroups is not None:
            cgroups.sweep()  # the leaves closed sandboxes could not remove, and dead workers'
    except OSError as exc:
        log.warning("could not sweep the sandboxes' cgroups: %s", exc)
    return reaped


UID_CLAIMS = ".uids"
"""Under the root: a symlink per sandbox uid in use, to the home of the worker holding it
(activities/sandbox_processes.py: SandboxUids)."""


def forget_stale_uid_claims(root: Path) -> None:
    """Remove the uid claims whose worker home is gone, and the directory once empty."""
    claims = root / UID_CLAIMS
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(claims):
            if entry.is_symlink() and not os.path.exists(os.readlink(entry.path)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
    with contextlib.suppress(OSError):  # not empty, or gone: both fine
        claims.rmdir()


def _reap_one(root: Path, entry: os.DirEntry[str], here: Owner, grace_s: float) -> Reaped | None:
    name = entry.name
    if not name.startswith((HOME_PREFIX, NEW_PREFIX, CLAIMED_PREFIX)):
        return None  # not a home (an older worker's layout, or someone else's file)
    try:
        info = entry.stat(follow_symlinks=False)
    except FileNotFoundError:
        return None  # reaped by another worker meanwhile
    if not stat.S_ISDIR(info.st_mode):
        return None
    if info.st_uid != os.geteuid():
        return None  # another user's, even to root: its owner file and records are that user's word
    home = Path(entry.path)
    owner = read_owner(home)
    if name.startswith(HOME_PREFIX) and owner is not None:
        if owner.verdict(here) != "dead":
            return None
    elif time.time() - max(info.st_mtime, info.st_ctime) < grace_s:
        return None  # no owner to ask, and young: it may be being made or reaped right now
    claimed = root / f"{CLAIMED_PREFIX}{uuid.uuid4().hex}"
    try:
        os.rename(home, claimed)
    except FileNotFoundError:
        return None  # another reaper claimed it first
    owner_pid = owner.pid if owner is not None else None
    killed = kill_recorded(claimed, owner_pid)
    sandboxes = sum(1 for child in _listing(claimed) if child.is_dir(follow_symlinks=False))
    return Reaped(name, owner_pid, sandboxes, killed, remove_tree(claimed))


def _listing(path: Path) -> list[os.DirEntry[str]]:
    try:
        return list(os.scandir(path))
    except OSError:
        return []


def kill_recorded(home: Path, owner_pid: int | None) -> list[int]:
    """SIGKILL the recorded processes of a dead home that are still those processes."""
    killed = []
    for entry in _listing(home):
        if not entry.name.endswith(RECORD_SUFFIX):
            continue
        record = _read_record(Path(entry.path))
        if record is None:
            continue
        try:
            if kill_if_still(*record, owner_pid):
                killed.append(record[0])
        except PermissionError as exc:
            log.warning("could not kill leftover sandbox process %d: %s", record[0], exc)
    return killed


def kill_if_still(pid: int, start: int, owner_pid: int | None) -> bool:
    """SIGKILL `pid` if it is still the recorded sandbox process; True when it was killed.
    The pidfd is opened first: a pid reused after that is another process, which the pidfd
    does not name, so the process checked is the one signalled."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except OSError:  # no pidfds here (a kernel before 5.3): the check right before the kill
        fd = None
    try:
        if not sandbox_of(pid, start, owner_pid):
            return False
        if fd is None:
            os.kill(pid, signal.SIGKILL)
        else:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False
    finally:
        if fd is not None:
            os.close(fd)


def remove_tree(path: Path) -> bool:
    """Delete a sandbox tree, even one whose sandbox made parts of it read-only or deep;
    True once nothing of it is left. The tree is the sandbox's writing: it is removed
    without recursion and without following a link (durable_rlm/host/files.py), so a
    1,500-deep tree or a planted link cannot stop a reaper or lead it out."""
    if not os.path.lexists(path):
        return True
    if os.path.islink(path):
        with contextlib.suppress(OSError):
            os.unlink(path)
        return not os.path.lexists(path)
    if remove_sandbox_tree is not None:
        remove_sandbox_tree(path)
        return not os.path.lexists(path)
    # Loaded alone (another uid's reaper, standard library only): the plain removal, and
    # when that leaves something (not root: a directory the sandbox made read-only), write
    # and search given back on every directory of it, never following a link, and again.
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.lexists(path):
        return True
    with contextlib.suppress(OSError):
        os.chmod(path, 0o700)
    for directory, subdirectories, _ in os.walk(path):
        for name in subdirectories:
            inner = os.path.join(directory, name)
            if not os.path.islink(inner):
                with contextlib.suppress(OSError):
                    os.chmod(inner, 0o700)
    shutil.rmtree(path, ignore_errors=True)
    return not os.path.lexists(path)
