"""A liveness signal of our own: which worker holds which activity attempt, and which
worker is dead, known at once on one machine (docs/architecture/failures.md).

Temporal learns that a worker died only when an attempt's heartbeat timeout runs out (10 s
as shipped; a model call that never heartbeated: 10 s from its start). The timeout cannot be
made shorter without a live but busy worker's late heartbeat passing for a dead worker, and
its call being paid twice. The kernel knows better, and at once: every worker holds an
exclusive `flock` on a file of its own in the data directory for as long as it lives (the
kernel drops it when the process dies, however it dies), and keeps a record of each
activity attempt it runs (its task token) in a folder beside that file.

Any worker on the machine, a new one as it starts and every live one each `SCAN_EVERY_S`,
tries the lock of each other worker (shared, and let go at once): a lock it can take is a
dead worker's. Only its worker ever holds a lock, so "held" means "alive" to every reader
(the reapers, `drlm` commands and pages asking who runs an episode, the call ledger): a
reaper at work holds the dead worker's reaping file (`.<worker id>.reaping`), one reaper
at a time, never its lock. (It held the lock once, and for the seconds its look took on a
loaded machine every reader took the dead worker for a live one: an episode page said a
killed worker still ran its episode, and a cancel waited for it.) The reaper fails that
worker's attempts by their task tokens (`WorkerLost`, retried at once, each
retry of the step counted as the heartbeat timeout's would be), and gives back the sticky
queues of those attempts' episodes and of every episode the worker held (its cache: each
`SCAN_EVERY_S` a worker rewrites `<worker id>/held` if it changed; an episode waiting on a
timer or a person has no attempt in flight), so that their next workflow tasks go to a live worker at once
instead of waiting out their sticky schedule-to-start timeout (10 s: a busy live worker's
tasks must not leave it, docs/architecture/decisions.md). A live worker
keeps its lock however loaded it is: its calls are never failed for it. A token the server
no longer knows (the attempt completed, or timed out first) is simply dropped.

The folder is per host (`workers/<hostname>/`): a data directory shared between machines
(a home on NFS, where `flock` may be local to each machine) never lets one machine judge
another's workers. It must be the user's own and writable by nobody else, or the worker
runs without the signal (a warning says so): a record is a task token, and a planted file
must not steer what a worker fails or removes. Records are read without following links,
only as regular files of at most 64 KB (the held episodes' record, 4 MB), in a ledger that is
a real directory; the file work of a look runs off the event loop.

Not covered: workers on other machines (one PostgreSQL store, no shared data directory),
whose attempts wait for the heartbeat timeout as before; a REPL step on a worker's own
queue, or run as a local activity, which the workflow task's own timeout covers.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import stat
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import ActivityInboundInterceptor, ExecuteActivityInput, Interceptor

from durable_rlm.client.attendance import LOCK_SUFFIX, liveness_folder, lock_held, worker_identity
from durable_rlm.host.files import read_sandbox_file
from durable_rlm.host.owned_dirs import UnsafeDirectory, owned_directory
from durable_rlm.worker.sticky import hand_back
from durable_rlm.workflows import names

log = logging.getLogger(__name__)

SCAN_EVERY_S = 1.0
"""How often a live worker looks for dead ones (a new worker looks once as it starts)."""
RETRY_AFTER = timedelta(milliseconds=10)
"""The failed attempt's retry delay: at once (zero would read as unset, the policy's 1 s)."""
PENDING_SUFFIX = ".new"
REAPING_SUFFIX = ".reaping"
"""`.<worker id>.reaping`: held by the one reaper handling that dead worker."""
PENDING_STALE_S = 60.0
"""A lock file not yet named (a worker that died as it started) is removed after this: a
younger one may be a worker starting right now, between making its file and locking it."""
STALE_RECORD_S = 3600.0
"""A record is dropped this long after its attempt started, whatever its server says (or
if it says nothing): every timeout of the attempt has run out by then."""
MAX_RECORD_BYTES = 64 * 1024
MAX_HELD_BYTES = 4 * 1024 * 1024
"""The held episodes' record at most (~30,000 episodes of usual ids); past it, those left
out wait out their sticky schedule-to-start timeout if the worker dies."""
MAX_HELD_EPISODES = 20_000
"""Episodes given back from one record at most (a planted record of 4 MB of short ids would
otherwise hold a look for minutes)."""
HELD_NAME = "held"
"""The held episodes' record in a worker's ledger (no `.json`: not an attempt's record)."""
HELD_STALE_S = 60.0
"""A held episodes' record is dropped once given back, or once this old if it cannot be (its
server does not answer, or it is another server's): by then each of its episodes' next tasks
has left the dead worker's sticky queue by its timeout."""
MAX_RECORDS_PER_LOOK = 5_000
"""A look reads at most this many records (of all dead workers); the rest wait for the next."""


class LivenessUnavailable(Exception):
    """The folder cannot be trusted (not the user's own, or writable by others)."""


@dataclass
class ReapReport:
    """What one look at the machine's workers found and did."""

    dead_workers: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # "workflow_id/activity_type#attempt"
    gone: int = 0  # tokens the server no longer knew (the attempt had ended already)
    handed_back: int = 0  # episodes whose sticky queue was given back
    dropped: int = 0  # records that could not be acted on: torn, not a file, too old, bad token
    kept: int = 0  # records kept for the next look (another server's, or the server did not answer)


@dataclass
class _DeadWorker:
    """A dead worker: its reaping file, taken (held until `_finish`), its lock's path, and
    its ledger's records."""

    worker_id: str
    reaping_fd: int
    reaping_path: Path
    lock_path: Path
    ledger: Path
    records: list[tuple[Path, dict[str, Any] | None]]
    held: dict[str, Any] | None = None  # the episodes it held, as it last wrote them down
    held_files: list[Path] = field(default_factory=list)  # that record and its unfinished write
    done: list[Path] = field(default_factory=list)  # records to remove


class WorkerLiveness:
    """This worker's lock and its ledger of attempts, in `<folder>/<worker id>.lock` and
    `<folder>/<worker id>/`. Made once per worker process (or in-process worker)."""

    def __init__(self, folder: Path, client: Client) -> None:
        self.folder = folder
        self.client = client
        self.worker_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.ledger = folder / self.worker_id
        self._lock_fd: int | None = None
        self._target = _target_of(client)
        # The episodes this worker holds (its workflow cache), as (workflow id, run id): set
        # by the worker that runs with this signal; written down for a reaper by `watch`.
        self.held: Callable[[], Iterable[tuple[str, str]]] = lambda: ()
        self._held_written: frozenset[tuple[str, str]] = frozenset()

    @classmethod
    def in_data_dir(cls, data_dir: Path, client: Client) -> WorkerLiveness:
        """The liveness of a worker whose data directory is `data_dir`: this host's folder."""
        return cls(liveness_folder(data_dir), client)

    @property
    def identity(self) -> str:
        """The identity this worker polls with: it names this lock, so that a command asking
        whether a worker runs an episode can tell a dead poller from a busy one."""
        return worker_identity(self.worker_id)

    def start(self) -> WorkerLiveness:
        """Take this worker's lock (held until `close` or death), then make its ledger. The
        lock file gets its name only once locked: no reaper ever sees it unheld."""
        _private_folder(self.folder)
        pending = self.folder / f".{self.worker_id}{PENDING_SUFFIX}"
        fd = os.open(pending, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new, and too young for any reaper
            os.rename(pending, self.folder / f"{self.worker_id}{LOCK_SUFFIX}")
            self.ledger.mkdir(mode=0o700)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                pending.unlink()
            raise
        self._lock_fd = fd
        return self

    def close(self) -> None:
        """A clean stop: the ledger (empty after a drain; what is left is the server's to
        time out, as for any worker) and the lock go."""
        if self._lock_fd is None:
            return
        with contextlib.suppress(OSError):
            for record in self.ledger.iterdir():
                record.unlink()
            self.ledger.rmdir()
        with contextlib.suppress(OSError):
            (self.folder / f"{self.worker_id}{LOCK_SUFFIX}").unlink()
        os.close(self._lock_fd)
        self._lock_fd = None

    def interceptor(self) -> Interceptor:
        return _LedgerInterceptor(self)

    def holder_alive(self, worker_id: str) -> bool | None:
        """Whether the worker `worker_id` of this host lives (its lock is held), for the call
        ledger's judgment of a claim (activities/call_ledger.py): True, False (its lock is
        free, or gone with a clean stop), or None when this cannot tell (a name that is no
        worker id, a lock that is not a regular file)."""
        if worker_id == self.worker_id:
            return True
        if not worker_id or "/" in worker_id or worker_id.startswith("."):
            return None
        path = self.folder / f"{worker_id}{LOCK_SUFFIX}"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return False  # stopped cleanly: its lock went with it
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True  # held: the worker lives
            except OSError:
                return None
            return False  # free: the worker is dead (the reaper fails its attempts)
        finally:
            os.close(fd)

    # --- the ledger ---------------------------------------------------------------------------

    def record(self, info: activity.Info) -> Path | None:
        """Write down an attempt as it starts; the path to remove when it ends."""
        if info.is_local or not info.task_token or self._lock_fd is None:
            return None
        path = self.ledger / f"{hashlib.sha256(info.task_token).hexdigest()[:32]}.json"
        entry = {
            "token": base64.b64encode(info.task_token).decode(),
            "target": self._target,
            "namespace": info.workflow_namespace,
            "workflow_id": info.workflow_id,
            "run_id": info.workflow_run_id,
            "activity_type": info.activity_type,
            "attempt": info.attempt,
            "started": time.time(),
        }
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, json.dumps(entry).encode())
            finally:
                os.close(fd)
        except OSError as exc:  # a full disk costs the quick recovery, never the step
            log.warning("liveness: attempt not recorded (%s): a crash waits for its heartbeat timeout", exc)
            return None
        return path

    @staticmethod
    def release(path: Path | None) -> None:
        if path is not None:
            with contextlib.suppress(OSError):
                path.unlink()

    # --- other workers ------------------------------------------------------------------------

    async def reap(self) -> ReapReport:
        """Fail the attempts of every dead worker on this machine (see the module's doc)."""
        report = ReapReport()
        finding = asyncio.ensure_future(asyncio.to_thread(_find_dead, self.folder, self.worker_id))
        try:
            dead = await asyncio.shield(finding)
        except asyncio.CancelledError:
            # The thread goes on: what it takes is let go when it is done, or each dead
            # worker it found would read as another reaper's until this process exits.
            finding.add_done_callback(_let_go_found)
            raise
        try:
            for worker in dead:
                report.dead_workers.append(worker.worker_id)
                await self._fail_attempts(worker, report)
        finally:
            await asyncio.to_thread(_finish, dead)
        if report.failed:
            log.warning(
                "liveness: %d attempt(s) of dead worker(s) %s failed for a retry now: %s",
                len(report.failed),
                ", ".join(report.dead_workers),
                ", ".join(report.failed[:10]),
            )
        return report

    async def _fail_attempts(self, worker: _DeadWorker, report: ReapReport) -> None:
        executions: set[tuple[str, str]] = set()
        for path, entry in worker.records:
            token = _token(entry)
            if entry is None or token is None or _age_s(entry) > STALE_RECORD_S:
                report.dropped += 1  # torn, not a file, a bad token, or past every timeout
                worker.done.append(path)
                continue
            if entry.get("target") != self._target or entry.get("namespace") != self.client.namespace:
                report.kept += 1  # another server's worker: that server's workers reap it
                continue
            handle = self.client.get_async_activity_handle(task_token=token)
            try:
                await handle.fail(
                    ApplicationError(
                        f"the worker running this attempt died ({worker.worker_id}): retried at once",
                        type=names.WORKER_LOST,
                        next_retry_delay=RETRY_AFTER,
                    )
                )
            except RPCError as exc:
                if exc.status not in (RPCStatusCode.NOT_FOUND, RPCStatusCode.INVALID_ARGUMENT):
                    report.kept += 1  # the server did not answer: the next look tries again
                    continue
                report.gone += 1
            else:
                what = f"{entry.get('workflow_id')}/{entry.get('activity_type')}#{entry.get('attempt')}"
                report.failed.append(what)
                executions.add((str(entry.get("workflow_id")), str(entry.get("run_id"))))
            worker.done.append(path)
        held, ours = worker.held, (self._target, self.client.namespace)
        mine = held is not None and (held.get("target"), held.get("namespace")) == ours
        if mine:
            executions.update(_episodes(held))
        unanswered = await hand_back(self.client, executions)
        report.handed_back += len(executions) - unanswered
        if held is not None and (unanswered or not mine) and _age_s(held, "written") < HELD_STALE_S:
            report.kept += 1  # tried again at the next look, or left to its own server's workers
        else:
            worker.done.extend(worker.held_files)  # given back, torn, or old enough not to matter

    async def watch(self) -> None:
        """Look now, then every SCAN_EVERY_S, until cancelled; each time, write down the
        episodes this worker holds if they changed."""
        while True:
            try:  # first: a long look leaves this worker's own record as it was
                await self.write_held()
            except Exception as exc:  # noqa: BLE001 - written again next time; the look goes on
                log.warning("liveness: held episodes not written down: %s", exc)
            try:
                await self.reap()
            except Exception as exc:  # noqa: BLE001 - a failed look is tried again next time
                log.warning("liveness: a look at the machine's workers failed: %s", exc)
            await asyncio.sleep(SCAN_EVERY_S)

    async def write_held(self) -> None:
        """Write down the episodes this worker holds, for a reaper should it die: written
        whole under another name, then renamed, so a reader never sees half of it. A write
        that fails costs those episodes the quick move only (their sticky timeout remains)."""
        held = frozenset(self.held())  # read on the loop, where the SDK changes its cache
        if held == self._held_written or self._lock_fd is None:
            return
        episodes = sorted(held)
        while True:  # past the bound, as many as fit (the rest keep their sticky timeout)
            entry = {
                "target": self._target,
                "namespace": self.client.namespace,
                "written": time.time(),
                "episodes": episodes,
            }
            data = json.dumps(entry).encode()
            if len(data) <= MAX_HELD_BYTES:
                break
            episodes = episodes[: len(episodes) // 2]
        try:
            await asyncio.to_thread(_write_whole, self.ledger, HELD_NAME, data)
        except OSError as exc:
            log.warning("liveness: held episodes not written down (%s): after a crash they wait", exc)
            return
        self._held_written = held


class _LedgerInterceptor(Interceptor):
    def __init__(self, liveness: WorkerLiveness) -> None:
        self.liveness = liveness

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _LedgerInbound(next, self.liveness)


class _LedgerInbound(ActivityInboundInterceptor):
    def __init__(self, next: ActivityInboundInterceptor, liveness: WorkerLiveness) -> None:
        super().__init__(next)
        self.liveness = liveness

    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        path = self.liveness.record(activity.info())
        try:
            return await super().execute_activity(input)
        finally:
            self.liveness.release(path)


def _private_folder(folder: Path) -> None:
    """Make the folder (0700) or check it: a real directory of this user's that only it can
    write, reached through none another user could change (who could plant records or swap
    it: durable_rlm/host/owned_dirs.py)."""
    try:
        owned_directory(folder, 0o700)
    except UnsafeDirectory as exc:
        raise LivenessUnavailable(
            f"{folder} is not a directory of this user's that only it can write: {exc}"
        ) from None


def _find_dead(folder: Path, own_id: str) -> list[_DeadWorker]:
    """The workers whose locks are free, each with its reaping file held by this process,
    their records read. Runs in a thread: nothing here may hold up the event loop."""
    dead: list[_DeadWorker] = []
    budget = MAX_RECORDS_PER_LOOK
    try:
        names_here = sorted(os.listdir(folder))
    except OSError:
        return dead
    now = time.time()
    for name in names_here:
        path = folder / name
        if name.startswith(".") and name.endswith(PENDING_SUFFIX):
            with contextlib.suppress(OSError):
                if now - os.lstat(path).st_mtime > PENDING_STALE_S and (fd := _take(path)) is not None:
                    try:
                        path.unlink()  # a worker that died as it started
                    finally:
                        os.close(fd)
            continue
        if not name.endswith(LOCK_SUFFIX) or name.startswith("."):
            continue
        worker_id = name.removesuffix(LOCK_SUFFIX)
        if worker_id == own_id or budget <= 0:
            continue
        if lock_held(folder, worker_id) is not False:
            continue  # alive (its lock is held), gone meanwhile, or not a lock file
        reaping = folder / f".{worker_id}{REAPING_SUFFIX}"
        fd = _take(reaping, create=True)
        if fd is None:
            continue  # another reaper handles it now
        if lock_held(folder, worker_id) is None:  # a reaper just finished it: nothing to leave
            with contextlib.suppress(OSError):
                reaping.unlink()
            os.close(fd)
            continue
        ledger = folder / worker_id
        records = _records(ledger, budget)
        budget -= len(records)
        held_files = _held_files(ledger)
        held = _read(ledger / HELD_NAME, MAX_HELD_BYTES) if ledger / HELD_NAME in held_files else None
        dead.append(_DeadWorker(worker_id, fd, reaping, path, ledger, records, held, held_files))
    return dead


def _finish(dead: list[_DeadWorker]) -> None:
    """Remove what was handled; a dead worker with nothing left goes, its reaping file
    before its lock (the reaping file held while both are removed: a reaper that takes it
    after finds the lock gone, and nothing to do); every reaping file let go."""
    for worker in dead:
        try:
            for path in worker.done:
                with contextlib.suppress(OSError):
                    path.unlink()
            with contextlib.suppress(OSError):
                info = os.lstat(worker.ledger)
                if stat.S_ISDIR(info.st_mode) and not os.listdir(worker.ledger):
                    worker.ledger.rmdir()
            if not os.path.lexists(worker.ledger):
                for path in (worker.reaping_path, worker.lock_path):
                    with contextlib.suppress(OSError):
                        path.unlink()
        finally:
            os.close(worker.reaping_fd)


def _let_go_found(finding: asyncio.Future[list[_DeadWorker]]) -> None:
    """A look cancelled while its thread read the folder: the reaping files it took, let go
    as they are (the next look handles those workers)."""
    if finding.cancelled() or finding.exception() is not None:
        return
    for worker in finding.result():
        os.close(worker.reaping_fd)


def _take(path: Path, create: bool = False) -> int | None:
    """The lock of a regular file (made now with `create`), taken (its descriptor), or None:
    held by another process, or not a regular file (a link, a FIFO, a directory are never
    opened as locks)."""
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError("not a regular file")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _real_directory(ledger: Path) -> bool:
    """Whether a ledger is a directory itself, not a link to one (another's files, never
    read or removed as records)."""
    try:
        return stat.S_ISDIR(os.lstat(ledger).st_mode)
    except OSError:
        return False


def _records(ledger: Path, budget: int) -> list[tuple[Path, dict[str, Any] | None]]:
    """Up to `budget` records of a ledger that is a real directory (a link is not followed)."""
    if not _real_directory(ledger):
        return []
    try:
        names_here = sorted(n for n in os.listdir(ledger) if n.endswith(".json"))[:budget]
    except OSError:
        return []
    return [(ledger / name, _read(ledger / name)) for name in names_here]


def _read(path: Path, limit: int = MAX_RECORD_BYTES) -> dict[str, Any] | None:
    """A record: a regular file of this user's with one link, at most `limit` bytes, opened
    without following a link or waiting on a FIFO (the reads the host makes of a sandbox's
    files)."""
    try:
        data = read_sandbox_file(path.parent, path.name, limit, os.geteuid())
    except OSError:
        return None
    try:
        entry = json.loads(data)
    except ValueError:
        return None
    return entry if isinstance(entry, dict) else None


def _token(entry: dict[str, Any] | None) -> bytes | None:
    if entry is None or not isinstance(entry.get("token"), str):
        return None
    try:
        return base64.b64decode(entry["token"], validate=True) or None
    except (binascii.Error, ValueError):
        return None


def _age_s(entry: dict[str, Any], stamp: str = "started") -> float:
    try:
        return time.time() - float(entry.get(stamp) or 0)
    except (TypeError, ValueError):
        return float("inf")


def _target_of(client: Client) -> str:
    return str(getattr(client.service_client.config, "target_host", ""))


def _held_files(ledger: Path) -> list[Path]:
    """The held episodes' record of a ledger that is a real directory, and a write of it the
    worker did not finish, those that exist (through a linked ledger, nothing: its files
    are not ours to read or remove)."""
    if not _real_directory(ledger):
        return []
    names = (HELD_NAME, f".{HELD_NAME}{PENDING_SUFFIX}")
    return [ledger / name for name in names if os.path.lexists(ledger / name)]


def _episodes(held: dict[str, Any] | None) -> set[tuple[str, str]]:
    """The (workflow id, run id) pairs of a held-episodes record, MAX_HELD_EPISODES at most;
    anything else in it is passed over (a torn or planted record moves no episode but those
    it names)."""
    found: set[tuple[str, str]] = set()
    episodes = held.get("episodes") if held is not None else None
    for pair in episodes[:MAX_HELD_EPISODES] if isinstance(episodes, list) else ():
        if isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) and x for x in pair):
            found.add((pair[0], pair[1]))
    return found


def _write_whole(folder: Path, name: str, data: bytes) -> None:
    """`folder/name` made `data` at once: written whole as a new `.name.new` (made here, so
    never a link or a FIFO someone left), then renamed over it."""
    pending = folder / f".{name}{PENDING_SUFFIX}"
    with contextlib.suppress(FileNotFoundError):
        pending.unlink()  # a write cut short before
    fd = os.open(pending, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as handle:  # a buffered write: all of it, or an error
        handle.write(data)
    os.replace(pending, folder / name)
