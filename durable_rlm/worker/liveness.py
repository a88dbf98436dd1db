"""A liveness signal of our own: which worker holds which activity attempt, and which
worker is dead, known at once on one machine (issue 38, item 4).

Temporal learns that a worker died only when an attempt's heartbeat timeout runs out (5 s
as shipped; a model call that never heartbeated: 5 s from its start). The timeout cannot be
made shorter without a live but busy worker's late heartbeat passing for a dead worker, and
its call being paid twice. The kernel knows better, and at once: every worker holds an
exclusive `flock` on a file of its own in the data directory for as long as it lives (the
kernel drops it when the process dies, however it dies), and keeps a record of each
activity attempt it runs (its task token) in a folder beside that file.

Any worker on the machine, a new one as it starts and every live one each `SCAN_EVERY_S`,
takes the lock of each other worker it can: a lock it can take is a dead worker's. It
fails that worker's attempts by their task tokens (`WorkerLost`, retried at once, each
retry of the step counted as the heartbeat timeout's would be), and gives those episodes'
sticky queues back, so that their next workflow tasks do not wait for the dead worker
either. A live worker keeps its lock however loaded it is: its calls are never failed for
it. A token the server no longer knows (the attempt completed, or timed out first) is
simply dropped.

Not covered: workers on other machines (one PostgreSQL store, no shared data directory),
whose attempts wait for the heartbeat timeout as before; a REPL step on a worker's own
queue, or run as a local activity, which the workflow task's own timeout covers.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio import activity
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.workflowservice.v1 import ResetStickyTaskQueueRequest
from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import ActivityInboundInterceptor, ExecuteActivityInput, Interceptor

from durable_rlm.workflows import names

log = logging.getLogger(__name__)

SCAN_EVERY_S = 1.0
"""How often a live worker looks for dead ones (a new worker looks once as it starts)."""
RETRY_AFTER = timedelta(milliseconds=10)
"""The failed attempt's retry delay: at once (zero would read as unset, the policy's 1 s)."""
LOCK_SUFFIX = ".lock"
STALE_RECORD_S = 3600.0
"""A dead worker's record of another server's attempt is dropped this long after the attempt
started: whatever its timeouts, that server has retried or failed the attempt by then."""


@dataclass
class ReapReport:
    """What one look at the machine's workers found and did."""

    dead_workers: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # "workflow_id/activity_type#attempt"
    gone: int = 0  # tokens the server no longer knew (the attempt had ended already)
    kept: int = 0  # records kept for the next look (the server did not answer)


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

    def start(self) -> WorkerLiveness:
        """Take this worker's lock (held until `close` or death), then make its ledger. The
        lock file gets its name only once locked: no reaper ever sees it unheld."""
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        pending = self.folder / f".{self.worker_id}.new"
        fd = os.open(pending, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(pending, self.folder / f"{self.worker_id}{LOCK_SUFFIX}")
        self._lock_fd = fd
        self.ledger.mkdir(mode=0o700)
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
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
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
        for pending in self.folder.glob(".*.new"):  # a worker that died as it started
            with _taken(pending) as taken:
                if taken:
                    with contextlib.suppress(OSError):
                        pending.unlink()
        for lock_path in _lock_files(self.folder):
            worker_id = lock_path.name.removesuffix(LOCK_SUFFIX)
            if worker_id == self.worker_id:
                continue
            with _taken(lock_path) as taken:
                if not taken:
                    continue  # alive: its lock is held
                report.dead_workers.append(worker_id)
                await self._fail_attempts(self.folder / worker_id, report)
                ledger = self.folder / worker_id
                with contextlib.suppress(OSError):
                    if not any(ledger.iterdir()):
                        ledger.rmdir()
                if not ledger.exists():
                    with contextlib.suppress(OSError):
                        lock_path.unlink()  # while held: a second reaper finds nothing left
        if report.failed:
            log.warning(
                "liveness: %d attempt(s) of dead worker(s) %s failed for a retry now: %s",
                len(report.failed),
                ", ".join(report.dead_workers),
                ", ".join(report.failed[:10]),
            )
        return report

    async def _fail_attempts(self, ledger: Path, report: ReapReport) -> None:
        records = sorted(ledger.glob("*.json")) if ledger.is_dir() else []
        executions: set[tuple[str, str]] = set()
        for path in records:
            entry = _read(path)
            if entry is None:
                self.release(path)  # torn or foreign: nothing to act on
                continue
            if entry.get("target") != self._target or entry.get("namespace") != self.client.namespace:
                if _age_s(entry) > STALE_RECORD_S:
                    self.release(path)  # its server gave the attempt up long ago
                else:
                    report.kept += 1  # another server's worker: that server's workers reap it
                continue
            what = f"{entry.get('workflow_id')}/{entry.get('activity_type')}#{entry.get('attempt')}"
            handle = self.client.get_async_activity_handle(task_token=base64.b64decode(entry["token"]))
            try:
                await handle.fail(
                    ApplicationError(
                        f"the worker running this attempt died ({ledger.name}): retried at once",
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
                report.failed.append(what)
                executions.add((str(entry.get("workflow_id")), str(entry.get("run_id"))))
            self.release(path)
        await asyncio.gather(
            *(
                self.client.workflow_service.reset_sticky_task_queue(
                    ResetStickyTaskQueueRequest(
                        namespace=self.client.namespace,
                        execution=WorkflowExecution(workflow_id=workflow_id, run_id=run_id),
                    )
                )
                for workflow_id, run_id in executions
            ),
            return_exceptions=True,  # an episode that ended meanwhile: nothing to give back
        )

    async def watch(self) -> None:
        """Look now, then every SCAN_EVERY_S, until cancelled."""
        while True:
            try:
                await self.reap()
            except Exception as exc:  # noqa: BLE001 - a failed look is tried again next time
                log.warning("liveness: a look at the machine's workers failed: %s", exc)
            await asyncio.sleep(SCAN_EVERY_S)


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


def _target_of(client: Client) -> str:
    return str(getattr(client.service_client.config, "target_host", ""))


def _lock_files(folder: Path) -> list[Path]:
    try:
        return sorted(p for p in folder.iterdir() if p.name.endswith(LOCK_SUFFIX))
    except OSError:
        return []


@contextlib.contextmanager
def _taken(lock_path: Path) -> Iterator[bool]:
    """Whether this process could take the lock (its holder is dead), held while inside."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        yield False  # gone meanwhile (its worker stopped cleanly, or another reaper)
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _age_s(entry: dict[str, Any]) -> float:
    try:
        return time.time() - float(entry.get("started") or 0)
    except (TypeError, ValueError):
        return float("inf")


def _read(path: Path) -> dict[str, Any] | None:
    try:
        entry = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return entry if isinstance(entry, dict) and isinstance(entry.get("token"), str) else None
