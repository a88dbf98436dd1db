"""REPL cell execution: one sandbox process per episode, cells as resumable coroutines.

A cell that calls `llm_query` stops at the call; the activity returns `suspended` with the
requests (each naming its kind), the workflow answers them, and `repl_resume` hands the
answers back. Every step is appended to the cell log (a typed hash chain in the blob
store). A step names the log head it expects; a worker whose live sandbox is at another
head (or has none) rebuilds one by re-running the logged cells and answering their calls
from the log, without calling any model (DESIGN invariant 3).

Every step heartbeats on a timer for as long as it runs, a rebuild included, so a long log
of quick cells is not mistaken for a dead worker; a step that fails or is cancelled kills
its sandbox, so no half-run process is left behind.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import hashlib
import hmac
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities import chains
from activities.attempts import count_local_start, echoed
from activities.chains import (
    CallsAnswered,
    CellEnded,
    CellStarted,
    LoggedAnswer,
    LoggedCell,
    RecreateCell,
    SnapshotTaken,
)
from activities.model_errors import compact_failures
from activities.sandbox.framing import MAX_FRAME_BYTES, encode_frame
from activities.sandbox.snapshot import SNAPSHOT_PREFIX
from activities.sandbox_files import (
    read_sandbox_file,
    remove_sandbox_tree,
    sandbox_file_tail,
    write_sandbox_file,
)
from activities.sandbox_processes import (
    ForkServer,
    ForkServerError,
    SandboxProcess,
    SandboxUids,
    kill_uid,
    sandbox_env,
    spawn_sandbox,
    uss_bytes,
)
from activities.sandbox_protocol import (
    BROKEN,
    FRAME_OVERHEAD,
    READ_BUFFER,
    FrameInbox,
    decode_frame,
    read_frames,
)
from activities.sandbox_reaper import SandboxHome, reap_dead
from activities.sandbox_slots import SandboxSlots, default_max_sandboxes
from durable_rlm.blobs import BlobBatch, BlobStore, TypedBlobs, text_digest
from durable_rlm.snapshot_key import lineage_mac
from workflows import defaults, names
from workflows.models import (
    CellOutcome,
    CloseSandboxInput,
    ContextRef,
    ExecuteCellInput,
    ReadVariableInput,
    RebuildReport,
    ResumeCellInput,
    SandboxRef,
    SnapshotPolicy,
    SnapshotRef,
    StepEcho,
    SubCallRequest,
    VariableValue,
)

log = logging.getLogger(__name__)

# The open step's blob writes (each activity runs in its own task, so its own context).
_STEP_WRITES: contextvars.ContextVar[BlobBatch | None] = contextvars.ContextVar("step_writes", default=None)


def prepare_sandbox_root(root: Path) -> Path:
    """Create the root; when sandboxes drop to `nobody`, every parent must let it through."""
    root = root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        os.chmod(root, 0o711)
        for parent in [root, *root.parents]:
            if not os.stat(parent).st_mode & 0o001:
                raise ValueError(
                    f"sandbox directory {root} is unreachable for the unprivileged sandbox user: "
                    f"{parent} is not traversable by others (chmod o+x, or choose another root)"
                )
    return root


@contextlib.asynccontextmanager
async def heartbeating(every_s: float = defaults.HEARTBEAT_EVERY_S) -> AsyncIterator[None]:
    """Heartbeat for as long as the block runs, whatever it is waiting on."""

    async def beat() -> None:
        while True:
            activity.heartbeat()
            await asyncio.sleep(every_s)

    # A local activity has no heartbeat: its workflow task keeps the worker's lease.
    if not activity.in_activity() or activity.info().is_local:
        yield
        return
    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@dataclass
class LiveSandbox:
    episode_id: str
    process: SandboxProcess
    directory: Path
    frames: FrameInbox
    reader: asyncio.Task[None]
    log_head: str | None = None
    cell_index: int | None = None
    next_call: int = 0
    pending: list[SubCallRequest] = field(default_factory=list)
    early_done: dict[str, Any] | None = None
    last_used: float = field(default_factory=time.monotonic)
    layers: dict[str, str] = field(default_factory=dict)
    # REPL snapshots: the policy of the last step, the latest snapshot, what ran since it,
    # and the cells a snapshot may need to re-run (by index).
    policy: SnapshotPolicy | None = None
    snapshot: SnapshotTaken | None = None
    snapshot_head: str | None = None  # the log node recording `snapshot`
    since_s: float = 0.0
    since_cells: int = 0
    since_volatile: bool = False
    last_cell: int | None = None
    cells: dict[int, LoggedCell] = field(default_factory=dict)
    snapshot_cost_s: float = 0.0  # what the last snapshot took, sandbox and store
    uid: int | None = None  # its own uid (root workers), released when it is gone
    seq: int = 0  # the number of the last request sent to it
    output_limit: int = defaults.STORED_OUTPUT_CHARS  # the stdout it may send for the cell
    uids: SandboxUids | None = None

    def ran(self, cell: LoggedCell, elapsed: float, volatile: bool) -> None:
        """A cell finished (live or re-run): the snapshot policy counts it."""
        self.cells[cell.index] = cell
        self.since_s += elapsed
        self.since_cells += 1
        self.since_volatile |= volatile
        self.last_cell = cell.index

    def snapshot_due(self) -> bool:
        """The policy's rules, with one bound: a snapshot is not retaken before the cells
        since the last would cost as much to re-run as it cost to take (twice as much, for
        the time rule). A big namespace is snapshotted less often, never more than ~half
        of the cells' own time. A cell that read the clock is snapshotted regardless."""
        policy = self.policy
        if policy is None or self.since_cells == 0:
            return False
        if (policy.volatile and self.since_volatile) or policy.every_cells == 1:
            return True  # every_cells=1 asks for every cell, whatever it costs
        rerun = self.since_s + self.since_cells * defaults.REPLAY_CELL_COST_S
        cost = self.snapshot_cost_s
        return rerun >= max(policy.after_s, 2 * cost) or (
            self.since_cells >= policy.every_cells and rerun >= cost
        )

    async def send(self, message: dict[str, Any]) -> None:
        """Write a frame, numbered: the sandbox's frames must carry the number of the last
        request (`receive`). A sandbox that stops reading (its pipe full) for
        SEND_TIMEOUT_S is broken, not waited for: the step fails and the sandbox is
        discarded."""
        self.seq += 1
        if message.get("op") == "exec":
            self.output_limit = int(message["limit"])
        self.process.stdin.write(encode_frame({**message, "seq": self.seq}))
        try:
            async with asyncio.timeout(defaults.SANDBOX_SEND_TIMEOUT_S):
                await self.process.stdin.drain()
        except TimeoutError:
            raise ConnectionError(
                f"the sandbox read none of a {message.get('op')!r} frame for "
                f"{defaults.SANDBOX_SEND_TIMEOUT_S:g} s"
            ) from None

    async def receive(self, timeout: float) -> dict[str, Any] | None:
        """The next frame; None when the process died or stayed silent past `timeout`."""
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancel that
            # arrives as the frame does, and a cancelled step would go on running.
            async with asyncio.timeout(timeout):
                item = await self.frames.get()
        except TimeoutError:
            return None
        if isinstance(item, bytes):
            # Checked field by field; a large frame off the event loop (a bounded task).
            big = len(item) > DECODE_INLINE_BYTES
            frame = await asyncio.to_thread(decode_frame, item) if big else decode_frame(item)
        else:
            frame = item
        if frame is not None and frame.get("op") != BROKEN and frame.get("seq") != self.seq:
            return {
                "op": BROKEN,
                "error": f"the sandbox sent a frame out of turn (numbered {frame.get('seq')!r}, "
                f"the request was {self.seq})",
            }
        return frame

    async def kill(self) -> None:
        self.reader.cancel()
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.process.wait(), 5)
        self.process.close()
        if self.uid is not None:
            # What the sandbox started and left (a grandchild in its own session included)
            # runs as its uid, and nothing else does: all of it goes before the uid is reused.
            uid, self.uid = self.uid, None
            await asyncio.to_thread(kill_uid, uid)
            if self.uids is not None:
                self.uids.release(uid)
        # Whatever the sandbox left in its directory (a tree of any depth, links, FIFOs) is
        # removed on threads of its own, never followed; a long removal is not waited for.
        removal = asyncio.get_running_loop().run_in_executor(REMOVER, remove_sandbox_tree, self.directory)
        try:
            async with asyncio.timeout(REMOVE_WAIT_S):
                await asyncio.shield(removal)
        except TimeoutError:
            log.warning("removing sandbox directory %s goes on in the background", self.directory)

    async def exit_code(self) -> int | None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.process.wait(), 1.0)
        return self.process.returncode


DECODE_INLINE_BYTES = 1024 * 1024
"""A frame larger than this is checked on a thread: the event loop serves every episode."""

REMOVER = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="drlm-sandbox-rm")
"""Threads that remove sandbox directories: a sandbox that left a million files there takes
these, not the threads every step's store reads and writes run on."""

REMOVE_WAIT_S = 5.0
"""How long discarding a sandbox waits for its directory to go; the rest goes on behind."""


FIELD_SLACK = 1_000
"""Beyond a field's limit, room for the note the sandbox adds when it cut the field itself."""


def clip_field(value: Any, limit: int = defaults.SANDBOX_FIELD_CHARS + FIELD_SLACK) -> str | None:
    """A text field of a sandbox's frame as the host keeps it: text (whatever was sent), at
    most `limit` characters, and says what it cut. The sandbox bounds its own fields; this
    holds when it did not (its code was changed by the cell)."""
    if value is None:
        return None
    text = value if isinstance(value, str) else repr(value)[: limit + 1]
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n... [cut by the worker at {limit:,} characters]"


def clip_variables(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        return {}
    shown = list(value.items())[: defaults.VARIABLES_SHOWN]
    width = defaults.VARIABLE_CHARS
    return {str(k)[:width]: clip_field(v, width) or "" for k, v in shown}


def clip_submitted(value: Any) -> tuple[dict[str, Any] | None, str | None]:
    """SUBMIT's outputs, whole or not at all (a typed output cut in the middle would be a
    different value), and why they were refused: the model reads that as the cell's error."""
    if value is None:
        return None, None
    if not isinstance(value, dict):
        return None, f"SUBMIT outputs must be a mapping, not {type(value).__name__}"
    size = len(json.dumps(value, default=str))
    if size > defaults.SANDBOX_FIELD_CHARS:
        return (
            None,
            f"SUBMIT outputs of {size:,} characters refused (at most {defaults.SANDBOX_FIELD_CHARS:,})",
        )
    return value, None


PARKED_MAX = 1_000
"""Snapshots of evicted sandboxes a worker keeps (each a few hundred bytes: the blob is in the store)."""


class StepLock(asyncio.Lock):
    """An episode's lock: held for the length of each of its steps; its release is the
    moment a step has finished, when the memory budget is checked."""

    def __init__(self, on_release: Callable[[], None]) -> None:
        super().__init__()
        self._on_release = on_release

    def idle(self) -> bool:
        """No step holds it or waits for it: acquiring it now does not wait. (Just after a
        release with a step queued, `locked()` is False yet the queued step comes first.)"""
        return not self.locked() and not self._waiters

    def release(self) -> None:
        super().release()
        self._on_release()


@dataclass
class MemoryReport:
    """Unique set sizes in bytes: what each live sandbox alone holds, and the template."""

    sandboxes: dict[str, int]  # episode id -> USS
    template: int | None  # None in spawn mode, or when no template runs

    @property
    def sandboxes_total(self) -> int:
        return sum(self.sandboxes.values())


class SnapshotRefused(Exception):
    """A snapshot a rebuild will not load (another episode's, altered, unreadable); the
    rebuild re-runs the cells instead."""


FORK_RETRY_S = 60.0  # after a template failed to start, sandboxes are spawned this long


class ReplActivities:
    """The sandboxes this worker process holds, and the REPL activities that drive them.

    `worker_queue` is a task queue only this process polls; outcomes name it so the workflow
    routes the episode's next REPL step back here, where its sandbox lives.

    `sandbox_start="fork"` forks sandboxes from a template process started on first use
    (and again if it dies); "spawn" starts a fresh interpreter for each. A template that
    cannot start is warned about once, and sandboxes are spawned meanwhile. With
    `memory_budget_mb`, idle sandboxes are discarded least recently used first once the live
    ones hold more than the budget; their next step rebuilds them from the cell log.

    With a snapshot policy (`SandboxRef.snapshots`), the sandbox's namespace is snapshotted
    after cells (signed with `snapshot_key`, stored in the blob store, recorded in the log),
    and a rebuild loads the latest snapshot and re-runs only the cells after it. A sandbox
    discarded while idle (reaped, or over the memory budget) is snapshotted first, so it
    comes back as it was without re-running anything.
    """

    def __init__(
        self,
        blobs: BlobStore,
        worker_queue: str,
        sandbox_root: Path,
        memory_mb: int = defaults.SANDBOX_MEMORY_MB,
        idle_s: float = defaults.SANDBOX_IDLE_S,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        audit_hook: bool = True,
        sandbox_start: str = "fork",
        memory_budget_mb: int | None = None,
        snapshot_key: bytes | None = None,
        max_sandboxes: int | None = None,
        filesystem: bool = True,
        namespaces: str = "auto",
    ) -> None:
        if sandbox_start not in ("fork", "spawn"):
            raise ValueError(f"sandbox_start must be 'fork' or 'spawn', not {sandbox_start!r}")
        if memory_budget_mb is not None and memory_budget_mb <= 0:
            raise ValueError(f"memory_budget_mb must be positive, not {memory_budget_mb}")
        self.blobs = blobs
        self.worker_queue = worker_queue
        self.sandbox_root = prepare_sandbox_root(Path(sandbox_root))
        self.memory_mb = memory_mb
        self.idle_s = idle_s
        self.max_frame_bytes = max_frame_bytes
        self.audit_hook = audit_hook  # tests turn it off to prove the other layers hold alone
        self.filesystem = filesystem  # the private root; tests of the other layers turn it off
        self.namespaces = namespaces  # "user": as a root worker without CAP_SYS_ADMIN would
        self.network_warned = False
        self.sandbox_start = sandbox_start
        self.memory_budget_mb = memory_budget_mb
        self.fork_warned = False
        self._live: dict[str, LiveSandbox] = {}
        self.slots = SandboxSlots(
            max_sandboxes or default_max_sandboxes(), lambda: len(self._live), self._evict_idle_one
        )
        self._locks: dict[str, asyncio.Lock] = {}
        self._template: ForkServer | None = None
        self._template_lock = asyncio.Lock()
        self._fork_retry_at = 0.0
        self._budget_task: asyncio.Task[list[str]] | None = None
        self._budget_again = False
        # Signs snapshots; every worker that may rebuild an episode needs the same key (a
        # snapshot signed with another is refused, and the cells re-run instead).
        if snapshot_key is not None and len(snapshot_key) < 16:
            raise ValueError("snapshot_key must be at least 16 bytes")
        self.snapshot_key = snapshot_key or os.urandom(32)
        # Snapshots of evicted sandboxes, off the log: episode -> (log head, snapshot).
        self._parked: dict[str, tuple[str | None, SnapshotTaken]] = {}
        # This host's sandboxes live in a home of their own, so a worker that finds it dead
        # (SIGKILLed) can remove them; the dead ones are reaped now and then every reap_idle.
        self.home = SandboxHome(self.sandbox_root)
        self.home.ensure()
        # A uid of its own per sandbox when this worker may hand them out (root).
        self.uids = SandboxUids(self.sandbox_root, self.home.path) if os.geteuid() == 0 else None
        self.reap_dead_sandboxes()

    # --- activities -----------------------------------------------------------------------

    @activity.defn(name=names.REPL_EXECUTE)
    async def execute_cell(self, request: ExecuteCellInput) -> CellOutcome:
        echo = StepEcho(cell_index=request.cell_index, iteration=request.iteration, code=request.code)
        async with compact_failures(), echoed(echo) as step:
            return step(await self._execute_cell(request))

    async def _execute_cell(self, request: ExecuteCellInput) -> CellOutcome:
        await count_local_start(self.blobs)
        async with self._lock(request.sandbox.episode_id), heartbeating(), self._batched():
            box, report, divergences = await self._ensure(request.sandbox, resuming=False)
            async with self._discard_on_failure(box):
                box.log_head = await self._log(
                    box.log_head,
                    CellStarted(cell=request.cell_index, iteration=request.iteration, code=request.code),
                )
                box.cell_index, box.next_call = request.cell_index, 0
                box.cells[request.cell_index] = LoggedCell(
                    request.cell_index, request.iteration, request.code
                )
                await box.send(self._exec_message(request.sandbox, request.cell_index, request.code))
                outcome = await self._after_cell(
                    box, request.sandbox, await self._drive(box, request.sandbox)
                )
            return outcome.model_copy(
                update={"rebuilt": report is not None, "divergences": divergences, "rebuild": report}
            )

    @activity.defn(name=names.REPL_RESUME)
    async def resume_cell(self, request: ResumeCellInput) -> CellOutcome:
        async with compact_failures(), echoed(StepEcho(cell_index=request.cell_index)) as step:
            return step(await self._resume_cell(request))

    async def _resume_cell(self, request: ResumeCellInput) -> CellOutcome:
        await count_local_start(self.blobs)
        async with self._lock(request.sandbox.episode_id), heartbeating(), self._batched():
            box, report, divergences = await self._ensure(request.sandbox, resuming=True)
            rebuilt = report is not None
            async with self._discard_on_failure(box):
                if box.early_done is not None:
                    # Rebuilt code finished without asking for these calls: it diverged.
                    done = await self._finish(box, box.early_done, rebuilt, divergences)
                    return done.model_copy(update={"rebuild": report})
                expected = [r.call_index for r in box.pending]
                given = [a.call_index for a in request.answers]
                if box.cell_index != request.cell_index or expected != given:
                    raise ApplicationError(
                        f"answers for calls {given} of cell {request.cell_index} do not match the "
                        f"pending calls {expected} of cell {box.cell_index}",
                        type=names.SANDBOX_FAILURE,
                        non_retryable=True,
                    )
                kinds = {r.call_index: r.kind for r in box.pending}
                logged = [
                    LoggedAnswer(
                        call=a.call_index,
                        prompt=a.prompt_digest,
                        ok=a.ok,
                        text=self._store.put_text(a.text),
                        kind=kinds[a.call_index],
                    )
                    for a in request.answers
                ]
                box.log_head = await self._log(
                    box.log_head, CallsAnswered(cell=request.cell_index, answers=logged)
                )
                if request.cell_index in box.cells:
                    box.cells[request.cell_index].answers.extend(logged)
                box.pending = []
                await box.send(
                    {"op": "answers", "answers": [{"ok": a.ok, "text": a.text} for a in request.answers]}
                )
                outcome = await self._after_cell(
                    box, request.sandbox, await self._drive(box, request.sandbox)
                )
            return outcome.model_copy(
                update={"rebuilt": rebuilt, "divergences": divergences, "rebuild": report}
            )

    @activity.defn(name=names.REPL_READ_VARIABLE)
    async def read_variable(self, request: ReadVariableInput) -> VariableValue:
        await count_local_start(self.blobs)
        async with compact_failures(), self._lock(request.sandbox.episode_id), heartbeating():
            box, _, _ = await self._ensure(request.sandbox, resuming=False)
            await box.send({"op": "read_var", "name": request.name})
            reply = await box.receive(request.sandbox.cell_timeout_s + defaults.HARD_KILL_GRACE_S)
            if reply is None or reply.get("op") != "var":
                problem = await self._silence(box, reply, request.sandbox.cell_timeout_s)
                await self._discard(box)
                raise ApplicationError(
                    f"reading {request.name!r} failed: {problem}", type=names.SANDBOX_FAILURE
                )
            return VariableValue(
                found=bool(reply["found"]),
                value=reply.get("value"),
                log_head=box.log_head or "",
                worker_queue=self.worker_queue,
            )

    @activity.defn(name=names.REPL_CLOSE)
    async def close_sandbox(self, request: CloseSandboxInput) -> bool:
        async with self._lock(request.episode_id):
            self._parked.pop(request.episode_id, None)
            box = self._live.pop(request.episode_id, None)
            if box is not None:
                await box.kill()
            self._locks.pop(request.episode_id, None)
            return box is not None

    # --- lifecycle ------------------------------------------------------------------------

    def reap_dead_sandboxes(self) -> None:
        """Remove the sandbox directories (and kill the processes) of dead workers sharing
        this root, and forget this worker's own ended processes. Never raises: hygiene must
        not stop a worker."""
        try:
            reap_dead(self.sandbox_root)  # stale uid claims too
            self.home.forget_ended()
        except Exception:  # noqa: BLE001 - told, and tried again at the next reap
            log.exception("reaping dead sandboxes under %s failed", self.sandbox_root)

    async def reap_idle(self) -> int:
        """Kill sandboxes unused for `idle_s` (a later step rebuilds them from the log), and
        reap the sandboxes of dead workers."""
        await asyncio.to_thread(self.reap_dead_sandboxes)
        now = time.monotonic()
        stale = [(b, b.last_used) for b in self._live.values() if now - b.last_used > self.idle_s]
        reaped = 0
        for box, used in stale:
            # Checked again right before: a step may have taken the episode meanwhile.
            if self._live.get(box.episode_id) is box and self._lock(box.episode_id).idle():
                if await self._evict(box, used):
                    reaped += 1
        return reaped

    async def close_all(self) -> None:
        """Kill every sandbox, and the template (a later step starts a new one)."""
        if self._budget_task is not None:  # first: it may be snapshotting a sandbox to evict
            self._budget_task.cancel()
            with contextlib.suppress(BaseException):
                await self._budget_task
            self._budget_task = None
        for box in list(self._live.values()):
            await self._discard(box)
        self._parked.clear()
        async with self._template_lock:
            if self._template is not None:
                await self._template.close()
                self._template = None
            self.home.remove()  # made again if this host starts another sandbox
            if self.uids is not None:
                self.uids.reap_stale()

    def live_episodes(self) -> list[str]:
        return sorted(self._live)

    def memory_report(self) -> MemoryReport:
        """USS (Private_Clean + Private_Dirty of /proc/PID/smaps_rollup) of each live sandbox
        and of the template: what discarding each would free."""
        template = self._template
        return MemoryReport(
            sandboxes=self._measure(dict(self._live)),
            template=uss_bytes(template.pid) if template is not None and template.alive else None,
        )

    @staticmethod
    def _measure(boxes: dict[str, LiveSandbox]) -> dict[str, int]:
        sizes = {}
        for episode_id, box in boxes.items():
            if box.process.returncode is None:
                uss = uss_bytes(box.process.pid)
                if uss is not None:
                    sizes[episode_id] = uss
        return sizes

    async def enforce_memory_budget(self) -> list[str]:
        """Discard idle sandboxes, least recently used first, until the live ones hold no
        more than `memory_budget_mb`; returns the episodes discarded. A sandbox whose
        episode runs a step (its lock held) is never discarded."""
        if self.memory_budget_mb is None:
            return []
        budget = self.memory_budget_mb * 1024 * 1024
        measured = dict(self._live)
        sizes = await asyncio.to_thread(self._measure, measured)
        total = sum(sizes.values())
        evicted: list[str] = []
        for episode_id in sorted(sizes, key=lambda e: measured[e].last_used):
            if total <= budget:
                break
            box = measured[episode_id]
            if self._live.get(episode_id) is not box or not self._lock(episode_id).idle():
                continue
            if await self._evict(box, box.last_used):
                total -= sizes[episode_id]
                evicted.append(episode_id)
        if evicted:
            log.info(
                "sandbox memory over the %d MB budget: discarded %d idle sandbox(es), %.1f MB now live",
                self.memory_budget_mb,
                len(evicted),
                total / 2**20,
            )
        return evicted

    async def probe(self) -> dict[str, str]:
        """Start a sandbox, report its isolation layers, and close it (`drlm doctor`). A
        forked sandbox and a spawned one report the same layers: they run the same code."""
        ref = SandboxRef(
            episode_id=f"doctor-{uuid.uuid4().hex[:8]}",
            context=None,
            seed=0,
            log_head=None,
            cell_timeout_s=5,
            output_truncation=1_000,
        )
        box = await self._spawn(ref)
        try:
            return dict(box.layers)
        finally:
            await box.kill()

    # --- internals ------------------------------------------------------------------------

    def _lock(self, episode_id: str) -> StepLock:
        return self._locks.setdefault(episode_id, StepLock(self._after_step))

    def _after_step(self) -> None:
        """A step finished: its sandbox may be evicted for a waiting step; check the memory
        budget in the background (one pass at a time; steps that finish during a pass ask for
        one more)."""
        self.slots.freed()
        if self.memory_budget_mb is None:
            return
        if self._budget_task is not None and not self._budget_task.done():
            self._budget_again = True
            return
        self._budget_task = asyncio.get_running_loop().create_task(self._budget_passes())

    async def _budget_passes(self) -> list[str]:
        evicted: list[str] = []
        while True:
            self._budget_again = False
            try:
                evicted += await self.enforce_memory_budget()
            except Exception:  # noqa: BLE001 - a failed pass must not stop later ones
                log.exception("enforcing the sandbox memory budget failed")
            if not self._budget_again:
                return evicted

    @contextlib.asynccontextmanager
    async def _discard_on_failure(self, box: LiveSandbox) -> AsyncIterator[None]:
        """A step that raises or is cancelled leaves its sandbox in an unknown state: kill it,
        so the next step rebuilds from the log instead of trusting it."""
        try:
            yield
        except BaseException:
            await asyncio.shield(self._discard(box))
            raise

    @property
    def _store(self) -> TypedBlobs:
        """Where a step writes: its batch while one is open (see `_batched`)."""
        return _STEP_WRITES.get() or self.blobs

    @contextlib.asynccontextmanager
    async def _batched(self) -> AsyncIterator[None]:
        """Hold the step's blob writes (log entries, outputs, answers) in memory and store
        them in one transaction when it ends, before its result names them: a commit costs
        more than its rows, and a step made five."""
        batch = BlobBatch(self.blobs)
        token = _STEP_WRITES.set(batch)
        try:
            yield
            await asyncio.to_thread(batch.flush)
        finally:
            _STEP_WRITES.reset(token)

    async def _log(self, head: str | None, entry: chains.LogEntry) -> str:
        store = self._store
        if isinstance(store, BlobBatch):
            return chains.append(store, head, entry)  # hashing only: no I/O
        return await asyncio.to_thread(chains.append, store, head, entry)

    def _exec_message(
        self, ref: SandboxRef, cell_index: int, code: str, summary: bool = True
    ) -> dict[str, Any]:
        return {
            "op": "exec",
            "code": code,
            "cell": cell_index,
            "cell_name": f"<cell {cell_index}>",
            "timeout": ref.cell_timeout_s,
            "limit": max(ref.stored_output_chars, ref.output_truncation),
            "summary": summary,
        }

    async def _discard(self, box: LiveSandbox) -> None:
        if self._live.get(box.episode_id) is box:
            del self._live[box.episode_id]
        await box.kill()
        self.slots.freed()

    async def _evict_idle_one(self, sparing: str) -> bool:
        """Make room for `sparing`'s sandbox: discard the least recently used idle one (a
        sandbox whose cell waits on calls last: its rebuild re-runs that cell)."""
        idle = [box for box in self._live.values() if box.episode_id != sparing]
        for box in sorted(idle, key=lambda b: (b.cell_index is not None, b.last_used)):
            # Idle now means `_evict` takes the lock at once: no step can slip in.
            if self._lock(box.episode_id).idle() and await self._evict(box, box.last_used):
                log.info(
                    "sandbox limit of %d reached: discarded episode %s's idle sandbox for %s",
                    self.slots.limit,
                    box.episode_id,
                    sparing,
                )
                return True
        return False

    def _requests(self, box: LiveSandbox, frame: dict[str, Any]) -> list[SubCallRequest]:
        kind = str(frame.get("kind") or "llm_query")
        model = frame.get("model")
        requests = [
            SubCallRequest(
                call_index=box.next_call + i,
                prompt=p,
                prompt_digest=text_digest(p),
                kind=kind,
                model=model if isinstance(model, str) else None,
            )
            for i, p in enumerate(frame["prompts"])
        ]
        box.next_call += len(requests)
        return requests

    def _with_contexts(self, requests: list[SubCallRequest]) -> list[SubCallRequest]:
        """rlm_query prompts become child contexts: stored once, named by their digest."""
        out = []
        for request in requests:
            if request.kind in names.CHILD_KINDS:
                digest = self._store.put_text(request.prompt)
                size = len(request.prompt)
                request = request.model_copy(update={"context": ContextRef(digest=digest, size=size)})
            out.append(request)
        return out

    async def _drive(self, box: LiveSandbox, ref: SandboxRef) -> CellOutcome:
        """Run the current cell until it completes or stops at calls."""
        box.last_used = time.monotonic()
        frame = await box.receive(ref.cell_timeout_s + defaults.HARD_KILL_GRACE_S)
        if frame is None or frame.get("op") not in ("call", "done"):
            return await self._killed(box, ref, frame)
        if frame["op"] == "call":
            box.pending = await asyncio.to_thread(self._with_contexts, self._requests(box, frame))
            return CellOutcome(
                status="suspended",
                log_head=box.log_head or "",
                worker_queue=self.worker_queue,
                requests=box.pending,
            )
        return await self._finish(box, frame, False, [])

    async def _finish(
        self, box: LiveSandbox, frame: dict[str, Any], rebuilt: bool, divergences: list[str]
    ) -> CellOutcome:
        status = frame.get("status", "error")
        # The output is logged so fallback extraction can rebuild the REPL history.
        parts = (frame.get("stdout"), frame.get("stderr"), frame.get("error"))
        limit = max(defaults.SANDBOX_FIELD_CHARS, box.output_limit) + FIELD_SLACK
        output = "\n".join(clip_field(x, limit) or "" for x in parts if x)
        output_ref = await asyncio.to_thread(self._store.put_text, output)
        box.log_head = await self._log(
            box.log_head, CellEnded(cell=box.cell_index, status=status, output=output_ref)
        )
        cell = box.cells.get(box.cell_index) if box.cell_index is not None else None
        if cell is not None:
            cell.status = status
            if status in chains.SKIPPED_ON_REBUILD:
                del box.cells[cell.index]
            else:
                box.ran(cell, float(frame.get("elapsed") or 0.0), bool(frame.get("volatile")))
        box.cell_index, box.pending, box.early_done = None, [], None
        submitted, refused = clip_submitted(frame.get("submitted"))
        error = clip_field(frame.get("error"))
        if refused is not None:
            error = f"{error}\n{refused}" if error else refused
        printed = max(defaults.SANDBOX_FIELD_CHARS, box.output_limit) + FIELD_SLACK
        return CellOutcome(
            status="completed",
            log_head=box.log_head,
            worker_queue=self.worker_queue,
            stdout=clip_field(frame.get("stdout", ""), printed) or "",
            stderr=clip_field(frame.get("stderr", ""), printed) or "",
            error=error,
            answer=clip_field(frame.get("answer")),
            answer_kind=frame.get("answer_kind"),
            cell_status=status,
            rebuilt=rebuilt,
            divergences=divergences,
            variables=clip_variables(frame.get("variables")),
            submitted=submitted,
        )

    async def _silence(self, box: LiveSandbox, frame: dict[str, Any] | None, timeout: float) -> str:
        """Why the sandbox did not answer as expected, in words."""
        if frame is not None and frame.get("op") == BROKEN:
            return str(frame["error"])
        if frame is not None:
            return f"the sandbox answered out of turn ({frame.get('op')!r})"
        code = await box.exit_code()
        if code is not None:
            return f"the REPL process exited (code {code})"
        return f"the sandbox did not answer within {timeout + defaults.HARD_KILL_GRACE_S:g} s"

    async def _killed(self, box: LiveSandbox, ref: SandboxRef, frame: dict[str, Any] | None) -> CellOutcome:
        """The cell ignored its interrupt, the process died, or it broke the channel: the
        namespace is gone; the cell is logged as killed so a rebuild skips it."""
        problem = await self._silence(box, frame, ref.cell_timeout_s)
        timed_out = frame is None and box.process.returncode is None
        await self._discard(box)
        if timed_out:
            reason = (
                f"cell exceeded its {ref.cell_timeout_s:g} s time limit and did not stop; "
                "the REPL was restarted with the variables of earlier cells"
            )
        else:
            reason = (
                f"{problem} during this cell; variables from earlier cells are restored, "
                "this cell's effects are lost"
            )
        output_ref = await asyncio.to_thread(self._store.put_text, reason)
        head = await self._log(
            box.log_head, CellEnded(cell=box.cell_index, status="killed", output=output_ref)
        )
        return CellOutcome(
            status="completed",
            log_head=head,
            worker_queue=self.worker_queue,
            error=reason,
            cell_status="killed",
        )

    async def _ensure(
        self, ref: SandboxRef, resuming: bool
    ) -> tuple[LiveSandbox, RebuildReport | None, list[str]]:
        """The episode's live sandbox at `ref.log_head`, rebuilt if this worker lacks it: from
        a snapshot parked when it was evicted, else from the log's latest snapshot and the
        cells after it, else (no usable snapshot) by re-running every cell."""
        box = self._live.get(ref.episode_id)
        mid_cell = box is not None and box.cell_index is not None
        if box is not None and not box.frames.empty():
            # It spoke between steps, when nothing was asked of it (a process a cell forked
            # before its end, or a changed sandbox): it cannot be trusted with the next one.
            log.warning("episode %s: its sandbox sent frames nobody asked for; rebuilt", ref.episode_id)
        elif (
            box is not None
            and box.log_head == ref.log_head
            and box.process.returncode is None
            and (resuming or not mid_cell)
        ):
            box.last_used = time.monotonic()
            box.policy = ref.snapshots
            return box, None, []
        if box is not None:
            await self._discard(box)
        async with self.slots.starting(ref.episode_id):
            started = time.monotonic()  # the wait for a slot is not the rebuild's
            parked = self._parked.pop(ref.episode_id, None)
            box = await self._spawn(ref)
            try:
                box.policy = ref.snapshots
                notes: list[str] = []
                cell_log = await asyncio.to_thread(chains.read_cell_log, self.blobs, ref.log_head, True)
                snapshot: SnapshotTaken | None = None
                if parked is not None and parked[0] == ref.log_head:
                    snapshot, cell_log = parked[1], chains.CellLog(cells=[])
                elif cell_log.snapshot is not None:
                    snapshot = cell_log.snapshot
                    cell_log = chains.CellLog(cells=cell_log.cells[cell_log.snapshot_at :])
                if snapshot is not None:
                    try:
                        notes += await self._restore(box, ref, snapshot)
                    except SnapshotRefused as refused:
                        log.warning("episode %s: %s; re-running its cells instead", ref.episode_id, refused)
                        notes.append(
                            f"The REPL's snapshot after cell {snapshot.cell} could not be used ({refused}); "
                            "the REPL was rebuilt by re-running every cell instead, so values that came "
                            "from the clock or OS randomness were drawn again."
                        )
                        await asyncio.shield(box.kill())
                        box, snapshot = await self._spawn(ref), None
                        box.policy = ref.snapshots
                        cell_log = await asyncio.to_thread(chains.read_cell_log, self.blobs, ref.log_head)
                open_cell = cell_log.open_cell
                replayed = cell_log.cells if resuming or open_cell is None else cell_log.cells[:-1]
                divergences = await self._replay(box, ref, replayed)
                box.log_head = ref.log_head
                if open_cell is not None and not resuming:
                    await self._abandon_open_cell(box, open_cell.index)
            except BaseException:
                await asyncio.shield(box.kill())
                raise
            self._live[ref.episode_id] = box
        if ref.log_head is None:
            return box, None, divergences
        kept = [c for c in replayed if c.status not in chains.SKIPPED_ON_REBUILD]
        report = RebuildReport(
            from_snapshot=snapshot.cell if snapshot is not None else None,
            cells_rerun=len(kept) + (len(snapshot.recreate) if snapshot is not None else 0),
            seconds=round(time.monotonic() - started, 3),
            notes=notes,
        )
        return box, report, divergences

    async def _restore(self, box: LiveSandbox, ref: SandboxRef, snapshot: SnapshotTaken) -> list[str]:
        """Load a snapshot into a fresh sandbox after checking it was made for this episode
        (or one it descends from) and is unchanged; then the cells it lists re-create the
        names it could not hold. Notes say which names came back how."""
        if snapshot.episode != ref.episode_id and not self._descends(ref, snapshot.episode):
            raise SnapshotRefused(f"it belongs to another episode ({snapshot.episode})")
        if not hmac.compare_digest(snapshot.mac, self._mac(snapshot)):
            raise SnapshotRefused("its integrity check failed: it was altered, or signed with another key")
        try:
            data = await asyncio.to_thread(self.blobs.get, snapshot.ref)
        except (KeyError, ValueError) as exc:
            raise SnapshotRefused(f"its blob cannot be read ({exc})") from None
        name = f"{SNAPSHOT_PREFIX}{uuid.uuid4().hex[:8]}"
        await asyncio.to_thread(write_sandbox_file, box.directory, name, data, box.uid)
        del data
        recreate = []
        for cell in snapshot.recreate:
            texts = [await asyncio.to_thread(self.blobs.get_text, a.text) for a in cell.answers]
            recreate.append(
                {
                    **self._exec_message(ref, cell.cell, cell.code, summary=False),
                    "names": sorted(cell.names),
                    "answers": [{"ok": a.ok, "text": t} for a, t in zip(cell.answers, texts, strict=True)],
                }
            )
        await box.send({"op": "restore", "name": name, "recreate": recreate})
        timeout = defaults.SNAPSHOT_TIMEOUT_S + len(recreate) * ref.cell_timeout_s
        reply = await box.receive(timeout)
        if reply is None or reply.get("op") not in ("restored", "restore_failed"):
            raise SnapshotRefused(f"loading it failed: {await self._silence(box, reply, timeout)}")
        if reply["op"] == "restore_failed":
            raise SnapshotRefused(f"loading it failed: {reply.get('error')}")
        box.snapshot, box.snapshot_head = snapshot, ref.log_head
        box.cells = {
            c.cell: LoggedCell(c.cell, 0, c.code, list(c.answers), status="ok") for c in snapshot.recreate
        }
        box.last_cell = snapshot.cell
        notes = dict(reply.get("notes") or {})
        notes.update({name: f"lost: {why}" for name, why in snapshot.lost.items()})
        if not notes:
            return []
        how = "; ".join(f"`{name}` {how}" for name, how in sorted(notes.items()))
        return [
            f"The REPL was restored from its snapshot after cell {snapshot.cell}. Names the snapshot "
            f"could not hold: {how}. A re-created value starts over as that cell made it."
        ]

    def _descends(self, ref: SandboxRef, episode: str) -> bool:
        """`ref`'s episode is a fork of `episode` (or of a fork of it), as `drlm fork` signed."""
        if episode not in ref.lineage or ref.lineage_mac is None:
            return False
        signed = lineage_mac(self.snapshot_key, ref.episode_id, ref.lineage)
        return hmac.compare_digest(ref.lineage_mac, signed)

    def _mac(self, snapshot: SnapshotTaken) -> str:
        return hmac.new(self.snapshot_key, snapshot.signed_part(), hashlib.sha256).hexdigest()

    async def _after_cell(self, box: LiveSandbox, ref: SandboxRef, outcome: CellOutcome) -> CellOutcome:
        """A cell completed: snapshot the namespace if the policy says so, and record it in
        the log right after the cell. A snapshot that fails costs only itself."""
        if outcome.status != "completed" or self._live.get(box.episode_id) is not box:
            return outcome
        box.policy = ref.snapshots
        if not box.snapshot_due():
            return outcome
        entry = await self._snapshot(box, ref)
        if entry is None:
            return outcome
        box.log_head = await self._log(box.log_head, entry)
        box.snapshot, box.snapshot_head = entry, box.log_head
        return outcome.model_copy(
            update={
                "log_head": box.log_head,
                "snapshot": SnapshotRef(
                    digest=entry.ref,
                    cell=entry.cell,
                    size=entry.size,
                    log_head=box.log_head,
                    unsaved=entry.unsaved,
                ),
            }
        )

    async def _snapshot(self, box: LiveSandbox, ref: SandboxRef | None = None) -> SnapshotTaken | None:
        """Have the sandbox pickle its namespace to a file; store it, list what a rebuild
        must re-run for the names it could not hold, and sign the entry."""
        episode = ref.episode_id if ref is not None else box.episode_id
        started = time.monotonic()
        name = f"{SNAPSHOT_PREFIX}{uuid.uuid4().hex[:8]}"
        path = box.directory / name
        box.since_s, box.since_cells, box.since_volatile = 0.0, 0, False  # tried: not again at once
        limit = defaults.SNAPSHOT_MAX_MB * 2**20
        await box.send(
            {
                "op": "snapshot",
                "name": name,
                "files_bytes": defaults.SNAPSHOT_FILES_MB * 2**20,
                "max_bytes": limit,
            }
        )
        reply = await box.receive(defaults.SNAPSHOT_TIMEOUT_S)
        if reply is None or reply.get("op") not in ("snapshotted", "snapshot_failed"):
            problem = await self._silence(box, reply, defaults.SNAPSHOT_TIMEOUT_S)
            log.warning("episode %s: snapshot abandoned (%s); the sandbox is discarded", episode, problem)
            await self._discard(box)  # its log is intact: the next step rebuilds from it
            return None
        if reply["op"] == "snapshot_failed":
            log.info("episode %s: no snapshot after cell %s: %s", episode, box.last_cell, reply.get("error"))
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        try:
            # The sandbox chose what is at that path: only a regular file of its own, at most
            # `limit` bytes, is read, and never for longer than a snapshot may take.
            async with asyncio.timeout(defaults.SNAPSHOT_TIMEOUT_S):
                data = await asyncio.to_thread(read_sandbox_file, box.directory, name, limit, box.uid)
        except (OSError, TimeoutError) as exc:
            problem = str(exc) if isinstance(exc, OSError) else "reading it took too long"
            log.warning("episode %s: snapshot refused (%s); the sandbox is discarded", episode, problem)
            await self._discard(box)  # its log is intact: the next step rebuilds from it
            return None
        finally:
            with contextlib.suppress(OSError):
                path.unlink()  # the name itself, whatever it is (a link is not followed)
        digest = await asyncio.to_thread(self._store.put, data)
        box.snapshot_cost_s = time.monotonic() - started
        recreate: dict[int, RecreateCell] = {}
        lost: dict[str, str] = {}
        earlier = {c.cell: c for c in box.snapshot.recreate} if box.snapshot is not None else {}
        for unsaved, (cell_index, reason) in sorted(dict(reply.get("unsaved") or {}).items()):
            cell = box.cells.get(cell_index) if isinstance(cell_index, int) else None
            if cell is not None:
                code, answers = cell.code, list(cell.answers)
            elif cell_index in earlier:
                code, answers = earlier[cell_index].code, list(earlier[cell_index].answers)
            else:
                lost[unsaved] = f"{reason} (no cell to re-create it)"
                continue
            entry = recreate.setdefault(
                cell_index, RecreateCell(cell=cell_index, code=code, answers=answers, names={})
            )
            entry.names[unsaved] = str(reason)
        if box.snapshot is not None:
            lost.update({k: v for k, v in box.snapshot.lost.items() if k in (reply.get("unsaved") or {})})
        snapshot = SnapshotTaken(
            ref=digest,
            cell=box.last_cell if box.last_cell is not None else 0,
            episode=episode,
            size=len(data),
            recreate=[recreate[i] for i in sorted(recreate)],
            lost=lost,
        )
        snapshot.mac = self._mac(snapshot)
        box.cells = {
            c.cell: box.cells.get(c.cell) or LoggedCell(c.cell, 0, c.code, list(c.answers), "ok")
            for c in snapshot.recreate
        }
        return snapshot

    async def _evict(self, box: LiveSandbox, used: float) -> bool:
        """Discard an idle sandbox to free its memory, parking a snapshot of it first (when
        its episode takes snapshots) so its next step restores it without re-running cells.
        False when a step took the episode meanwhile."""
        episode = box.episode_id
        async with self._lock(episode):
            if self._live.get(episode) is not box or box.last_used != used:
                return False  # discarded, or used by a step, while this waited for the lock
            current = box.snapshot is not None and box.snapshot_head == box.log_head
            try:
                if box.policy is not None and box.cell_index is None and box.process.returncode is None:
                    if current and box.snapshot is not None:
                        self._park(episode, box.log_head, box.snapshot)
                    elif box.last_cell is not None:
                        async with self._batched():
                            parked = await self._snapshot(box)
                        if parked is not None:
                            self._park(episode, box.log_head, parked)
            except BaseException:
                # Cancelled (or failed) mid-snapshot: the sandbox's reply may still be on its
                # way, and would answer the episode's next request. It goes, unsnapshotted.
                await asyncio.shield(self._discard(box))
                raise
            await self._discard(box)
            return True

    def _park(self, episode: str, head: str | None, snapshot: SnapshotTaken) -> None:
        """Keep an evicted sandbox's snapshot for its next step here; the oldest beyond
        `PARKED_MAX` go (their episodes may have ended elsewhere): those rebuild from the log."""
        self._parked.pop(episode, None)
        self._parked[episode] = (head, snapshot)
        while len(self._parked) > PARKED_MAX:
            del self._parked[next(iter(self._parked))]

    async def _abandon_open_cell(self, box: LiveSandbox, cell: int) -> None:
        """A new step arrives while the log's last cell never ended: the workflow gave up on
        it. The REPL was rebuilt without it; log it as lost so later rebuilds skip it too."""
        reason = await asyncio.to_thread(self._store.put_text, "abandoned: a later step was started")
        box.log_head = await self._log(box.log_head, CellEnded(cell=cell, status="lost", output=reason))
        box.cell_index, box.pending, box.early_done = None, [], None

    async def _spawn(self, ref: SandboxRef) -> LiveSandbox:
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in ref.episode_id)[:80]
        directory = self.home.ensure() / f"{safe}-{uuid.uuid4().hex[:8]}"
        directory.mkdir()
        init: dict[str, Any] = {
            "op": "init",
            "seed": ref.seed,
            "memory_mb": self.memory_mb,
            "file_mb": defaults.SANDBOX_FILE_MB,
            "variables_shown": defaults.VARIABLES_SHOWN,
            "variable_chars": defaults.VARIABLE_CHARS,
            "audit_hook": self.audit_hook,
            "child_batch_cap": ref.child_batch_cap,
            "tools": [spec.model_dump(mode="json") for spec in ref.tools],
            "cpu_s": defaults.SANDBOX_CPU_S,
            "processes": defaults.SANDBOX_PROCESSES,
            "filesystem": self.filesystem,
            # The sandbox refuses larger calls in the cell; a frame past them is refused here.
            "max_prompts": defaults.MAX_PROMPTS_PER_CALL,
            "max_call_bytes": defaults.MAX_CALL_BYTES,
        }
        if self.namespaces == "user":
            init["namespaces"] = "user"  # tests: the path of a root worker without CAP_SYS_ADMIN
        uid = self.uids.claim() if self.uids is not None else None
        try:
            if ref.context is not None:
                data = await asyncio.to_thread(self.blobs.get, ref.context.digest)
                path = directory / ("context.json" if ref.context.kind == "json" else "context.txt")
                path.write_bytes(data)
                init.update(context_path=str(path), context_kind=ref.context.kind)
            if uid is not None:
                init["uid"] = uid
                for p in [directory, *directory.iterdir()]:
                    os.chown(p, uid, uid)
            process = await self._start_process(directory)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)  # no process yet: nothing else holds it
            if uid is not None and self.uids is not None:
                self.uids.release(uid)
            raise
        self.home.record(process.pid, "sandbox")
        frames = FrameInbox(defaults.SANDBOX_IN_FLIGHT_BYTES)
        max_frame = min(self.max_frame_bytes, defaults.SANDBOX_IN_FLIGHT_BYTES - FRAME_OVERHEAD)
        box = LiveSandbox(
            episode_id=ref.episode_id,
            process=process,
            directory=directory,
            frames=frames,
            reader=asyncio.create_task(read_frames(process.stdout, frames, max_frame)),
            uid=uid,
            uids=self.uids,
        )
        try:
            await box.send(init)
            ready = await box.receive(defaults.SANDBOX_STARTUP_S)
        except BaseException:
            await asyncio.shield(box.kill())
            raise
        if ready is None or ready.get("op") != "ready":
            if ready is not None and ready.get("op") == "failed":
                detail = str(ready.get("error"))
            else:
                detail = await asyncio.to_thread(sandbox_file_tail, directory, "sandbox.err") or "no output"
            await box.kill()
            raise ApplicationError(f"the REPL sandbox failed to start: {detail}", type=names.SANDBOX_FAILURE)
        box.layers = dict(ready.get("layers") or {})
        if box.layers.get("network") == "none" and not self.network_warned:
            self.network_warned = True
            log.warning(
                "sandboxes have no network namespace on this worker (unshare refused); only the "
                "audit hook refuses sockets. Run the worker as root or allow user namespaces."
            )
        return box

    async def _start_process(self, directory: Path) -> SandboxProcess:
        """Fork the sandbox from the template, or spawn it (spawn mode, or no template)."""
        env = sandbox_env(directory)
        if self.sandbox_start == "fork":
            template = await self._running_template()
            if template is not None:
                try:
                    return await template.fork(directory, env, READ_BUFFER, defaults.SANDBOX_STARTUP_S)
                except ForkServerError as exc:
                    self._fork_failed(str(exc))
        return await spawn_sandbox(directory, env, READ_BUFFER)

    async def _running_template(self) -> ForkServer | None:
        """The template, started now if there is none or it died; None while a failed start
        is recent (sandboxes are spawned meanwhile)."""
        async with self._template_lock:
            if self._template is not None and self._template.alive:
                return self._template
            if time.monotonic() < self._fork_retry_at:
                return None
            try:
                self._template = await ForkServer.start(self.home.ensure(), defaults.SANDBOX_STARTUP_S)
                self.home.record(self._template.pid, "template")
            except (ForkServerError, OSError) as exc:
                self._template = None
                self._fork_retry_at = time.monotonic() + FORK_RETRY_S
                self._fork_failed(str(exc))
            return self._template

    def _fork_failed(self, problem: str) -> None:
        if not self.fork_warned:
            self.fork_warned = True
            log.warning(
                "sandboxes cannot be forked from a template on this worker (%s); they are spawned "
                "instead (slower to start, more memory each)",
                problem,
            )

    async def _replay(self, box: LiveSandbox, ref: SandboxRef, cells: list[LoggedCell]) -> list[str]:
        """Re-run the logged cells, answering their calls from the log: the finished ones in
        batches (one exchange each), then the open one call by call, since it must stop
        where the log's answers end."""
        kept = [c for c in cells if c.status not in chains.SKIPPED_ON_REBUILD]
        finished = [c for c in kept if c.status is not None]
        divergences: list[str] = []
        batch: list[tuple[LoggedCell, list[dict[str, Any]]]] = []
        size = 0
        for cell in finished:
            texts = [await asyncio.to_thread(self.blobs.get_text, a.text) for a in cell.answers]
            answers = [{"ok": a.ok, "text": t} for a, t in zip(cell.answers, texts, strict=True)]
            weight = len(cell.code) + sum(len(t) for t in texts) + 64
            if batch and (len(batch) >= REPLAY_BATCH_CELLS or size + weight > REPLAY_BATCH_BYTES):
                divergences += await self._replay_finished(box, ref, batch)
                batch, size = [], 0
            batch.append((cell, answers))
            size += weight
        if batch:
            divergences += await self._replay_finished(box, ref, batch)
        for cell in kept:
            if cell.status is not None:
                continue
            box.cell_index, box.next_call = cell.index, 0
            box.cells[cell.index] = LoggedCell(cell.index, cell.iteration, cell.code, list(cell.answers))
            # A finished cell's summary is not reported; the open cell's may be (early_done).
            await box.send(self._exec_message(ref, cell.index, cell.code, summary=cell.status is None))
            recorded = list(cell.answers)
            while True:
                frame = await box.receive(ref.cell_timeout_s + defaults.HARD_KILL_GRACE_S)
                if frame is None or frame.get("op") not in ("call", "done"):
                    problem = await self._silence(box, frame, ref.cell_timeout_s)
                    raise ApplicationError(
                        f"rebuilding the REPL failed: cell {cell.index} did not finish ({problem})",
                        type=names.SANDBOX_FAILURE,
                    )
                if frame["op"] == "done":
                    if cell.status is None:
                        divergences.append(
                            f"cell {cell.index}: finished during rebuild before its pending calls"
                        )
                        box.early_done = frame
                    else:
                        box.cell_index = None
                    break
                if cell.status is None and not recorded:
                    # The in-progress cell reached the calls the workflow is answering now.
                    box.pending = self._requests(box, frame)
                    break
                replies = []
                for request in self._requests(box, frame):
                    if not recorded:
                        divergences.append(f"cell {cell.index} call {request.call_index}: no recorded result")
                        replies.append({"ok": False, "text": "replay diverged: no recorded result"})
                        continue
                    answer = recorded.pop(0)
                    if answer.prompt != request.prompt_digest or answer.kind != request.kind:
                        divergences.append(
                            f"cell {cell.index} call {request.call_index}: the {request.kind} call differs "
                            "from the recorded one"
                        )
                    text = await asyncio.to_thread(self.blobs.get_text, answer.text)
                    replies.append({"ok": answer.ok, "text": text})
                await box.send({"op": "answers", "answers": replies})
        return divergences

    async def _replay_finished(
        self, box: LiveSandbox, ref: SandboxRef, batch: list[tuple[LoggedCell, list[dict[str, Any]]]]
    ) -> list[str]:
        """One exchange: the batch's cells with their logged answers (a batch is bounded by
        the real size of its code and answers, far under the frame limit)."""
        cells = [cell for cell, _ in batch]
        message = {
            "op": "replay",
            "cells": [
                {**self._exec_message(ref, c.index, c.code, summary=False), "answers": answers}
                for c, answers in batch
            ],
        }
        await box.send(message)
        timeout = len(cells) * ref.cell_timeout_s + defaults.HARD_KILL_GRACE_S
        frame = await box.receive(timeout)
        if frame is None or frame.get("op") != "replayed" or len(frame.get("cells", [])) != len(cells):
            problem = await self._silence(box, frame, timeout - defaults.HARD_KILL_GRACE_S)
            raise ApplicationError(
                f"rebuilding the REPL failed: cells {cells[0].index}-{cells[-1].index} did not finish "
                f"({problem})",
                type=names.SANDBOX_FAILURE,
            )
        divergences = []
        for cell, report in zip(cells, frame["cells"], strict=True):
            box.ran(cell, float(report.get("elapsed") or 0.0), bool(report.get("volatile")))
            recorded = [(a.kind, a.prompt) for a in cell.answers]
            for call, asked in enumerate(report.get("asked", [])):
                if call >= len(recorded):
                    divergences.append(f"cell {cell.index} call {call}: no recorded result")
                elif tuple(asked) != recorded[call]:
                    divergences.append(
                        f"cell {cell.index} call {call}: the {asked[0]} call differs from the recorded one"
                    )
        box.cell_index = None
        return divergences


REPLAY_BATCH_CELLS = 200
REPLAY_BATCH_BYTES = 8 * 1024 * 1024
