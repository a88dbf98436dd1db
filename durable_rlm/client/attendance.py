"""Whether a worker runs an episode now: what `drlm watch`, `show`, `list`, the page and
every steering command ask before they tell a person "no worker runs this episode".

Two signals, each trusted only where it is sure:
- the server's list of the workers that polled the episode's task queue. It keeps a worker
  there about a minute after its last poll, dead or alive, and a worker that sheds load
  (its slots full) does not poll at all for a while: the list alone says neither "dead"
  nor "busy".
- the liveness lock every worker of this machine holds for as long as it lives
  (durable_rlm/worker/liveness.py). A worker names its lock in the identity it polls with
  (`worker_identity`), so a poller of this machine is judged by its lock: held, alive
  however busy; let go (or gone with a process that exited), dead.

A poller of another machine, or one that names no lock, counts as alive while the server
lists it: "no worker" is said only when every poller listed is known dead, never of a
worker that is only slow.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import re
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError

LOCK_SUFFIX = ".lock"
DESCRIBES_AT_ONCE = 8
_TAG = " drlm-worker "


def this_host() -> str:
    """This machine's name as the liveness folder and worker identities spell it."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64] or "host"


def liveness_folder(data_dir: Path) -> Path:
    """Where this machine's workers of `data_dir` keep their locks (one folder per host: a
    data directory shared between machines never lets one judge another's workers)."""
    return data_dir / "workers" / this_host()


def worker_identity(worker_id: str) -> str:
    """The identity a worker polls with: Temporal's usual `pid@host`, and its lock's name."""
    return f"{os.getpid()}@{this_host()}{_TAG}{worker_id}"


def _parse(identity: str) -> tuple[str, int, str] | None:
    """(host, pid, worker id) of an identity made by `worker_identity`, else None."""
    head, tag, worker_id = identity.partition(_TAG)
    pid, at, host = head.partition("@")
    if not tag or not at or not pid.isdigit() or not re.fullmatch(r"[A-Za-z0-9_-]+", worker_id):
        return None
    return host, int(pid), worker_id


def describe_identity(identity: str) -> str:
    """A poller's identity as a person reads it: `process 4242 on HOST`, or as it is."""
    parsed = _parse(identity)
    return identity if parsed is None else f"process {parsed[1]} on {parsed[0]}"


def lock_held(folder: Path, worker_id: str) -> bool | None:
    """True: the worker's lock is held (it lives); False: free (it died); None: no such
    lock here. A shared lock is tried, never kept; only its worker ever holds the lock
    (reapers hold a file of their own: durable_rlm/worker/liveness.py), so a held lock is a
    live worker."""
    path = folder / f"{worker_id}{LOCK_SUFFIX}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: it exists
    return True


def poller_alive(identity: str, folder: Path | None) -> bool:
    """Whether a worker the server lists as a poller may still run: dead only when it is of
    this machine and its lock is free, or its lock is gone with its process."""
    parsed = _parse(identity)
    if parsed is None or folder is None:
        return True
    host, pid, worker_id = parsed
    if host != this_host():
        return True
    held = lock_held(folder, worker_id)
    if held is not None:
        return held
    # No lock of that name here: it closed cleanly, or it keeps its locks in another data
    # directory. Its process tells which, conservatively (a live process may be a worker).
    return _process_exists(pid)


@dataclass(frozen=True)
class Attendance:
    """Who polls an episode's task queue: the workers alive, and those the server still
    lists though they died."""

    task_queue: str
    alive: tuple[str, ...]
    dead: tuple[str, ...]
    known: bool = True  # False: the server did not answer, nothing is claimed

    @property
    def unattended(self) -> bool:
        """True only when the server answered and no live worker polls the queue."""
        return self.known and not self.alive


async def attendance(client: Client, task_queue: str, data_dir: Path | None) -> Attendance:
    """The workers polling `task_queue` for workflow tasks, each judged alive or dead."""
    try:
        reply = await client.workflow_service.describe_task_queue(
            DescribeTaskQueueRequest(
                namespace=client.namespace,
                task_queue=TaskQueue(name=task_queue),
                task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
            )
        )
    except RPCError:
        return Attendance(task_queue, (), (), known=False)
    folder = liveness_folder(data_dir) if data_dir is not None else None
    alive: list[str] = []
    dead: list[str] = []
    for poller in reply.pollers:
        (alive if poller_alive(poller.identity, folder) else dead).append(poller.identity)
    return Attendance(task_queue, tuple(alive), tuple(dead))


async def unattended_episodes(client: Client, episode_ids: list[str], data_dir: Path | None) -> set[str]:
    """Those of the running episodes `episode_ids` that no live worker runs (one look at the
    server per task queue; an episode that ended meanwhile, or the server not answering,
    is not counted)."""
    queues: dict[str, list[str]] = {}
    gate = asyncio.Semaphore(DESCRIBES_AT_ONCE)

    async def queue_of(episode_id: str) -> None:
        async with gate:
            try:
                description = await client.get_workflow_handle(episode_id).describe()
            except RPCError:
                return
        if description.status == WorkflowExecutionStatus.RUNNING:
            queues.setdefault(description.task_queue, []).append(episode_id)

    await asyncio.gather(*(queue_of(i) for i in dict.fromkeys(episode_ids)))
    found: set[str] = set()
    for queue, ids in queues.items():
        if (await attendance(client, queue, data_dir)).unattended:
            found.update(ids)
    return found
