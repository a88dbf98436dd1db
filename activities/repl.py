"""REPL cell execution: one sandbox process per episode, cells as resumable coroutines.

A cell that calls `llm_query` stops at the call; the activity returns `suspended` with the
requests (each naming its kind), the workflow answers them, and `repl_resume` hands the
answers back. Every step is appended to the cell log (a typed hash chain in the blob
store). A step names the log head it expects; a worker whose live sandbox is at another
head (or has none) rebuilds one by re-running the logged cells and answering their calls
from the log, without calling any model (docs/architecture/resuming.md).

Every step heartbeats on a timer for as long as it runs, a rebuild included, so a long log
of quick cells is not mistaken for a dead worker; a step that fails or is cancelled kills
its sandbox, so no half-run process is left behind.

This module is the activities' front: each activity takes its episode's lock, makes sure
of its sandbox and runs its cell, through the worker's parts, wired here: the pool of live
sandboxes (sandbox_pool.py) and how they start (sandbox_start.py), the cells
(repl_cells.py), snapshots (repl_snapshots.py) and rebuilds (repl_rebuild.py), and the
step's batched writes (repl_writes.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

from temporalio import activity
from temporalio.exceptions import ApplicationError

from durable_rlm.activities.attempts import beat_every_s, count_local_start, echoed
from durable_rlm.activities.live_sandbox import LiveSandbox, exec_message
from durable_rlm.activities.model_errors import compact_failures
from durable_rlm.activities.repl_cells import CellDriver
from durable_rlm.activities.repl_rebuild import Rebuilder
from durable_rlm.activities.repl_snapshots import Snapshots
from durable_rlm.activities.repl_writes import StepWrites
from durable_rlm.activities.sandbox.framing import MAX_FRAME_BYTES
from durable_rlm.activities.sandbox_pool import MemoryReport, SandboxPool
from durable_rlm.activities.sandbox_processes import SandboxUids
from durable_rlm.activities.sandbox_reaper import SandboxHome
from durable_rlm.activities.sandbox_slots import SandboxSlots
from durable_rlm.activities.sandbox_start import SandboxConfig, SandboxStarter, prepare_sandbox_root
from durable_rlm.store.blobs import BlobStore
from durable_rlm.store.chains import CallsAnswered, CellStarted, LoggedAnswer, LoggedCell
from durable_rlm.workflows import defaults, names
from durable_rlm.workflows.models import (
    CellOutcome,
    CloseSandboxInput,
    ExecuteCellInput,
    ReadVariableInput,
    ResumeCellInput,
    StepEcho,
    VariableValue,
)

__all__ = ["LiveSandbox", "ReplActivities"]  # LiveSandbox: benchmarks import it from here


@contextlib.asynccontextmanager
async def heartbeating() -> AsyncIterator[None]:
    """Heartbeat for as long as the block runs, whatever it is waiting on: at once, then every
    quarter of the heartbeat timeout (`beat_every_s`)."""

    # A local activity has no heartbeat: its workflow task keeps the worker's lease.
    if not activity.in_activity() or activity.info().is_local:
        yield
        return
    period = beat_every_s()

    async def beat() -> None:
        while True:
            activity.heartbeat()
            await asyncio.sleep(period)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


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

    Its parts are public: `config` (the worker's sandbox settings, read as each sandbox
    starts, so tests and `drlm doctor` may change them), `pool` (the live sandboxes),
    `starter` (the fork template), `snapshots`, `rebuilder`, `cells`.
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
        files_mb: int | None = defaults.SANDBOX_FILES_MB,
    ) -> None:
        if sandbox_start not in ("fork", "spawn"):
            raise ValueError(f"sandbox_start must be 'fork' or 'spawn', not {sandbox_start!r}")
        if memory_budget_mb is not None and memory_budget_mb <= 0:
            raise ValueError(f"memory_budget_mb must be positive, not {memory_budget_mb}")
        self._blobs = blobs
        self.worker_queue = worker_queue
        self.sandbox_root = prepare_sandbox_root(Path(sandbox_root))
        self.config = SandboxConfig(
            memory_mb=memory_mb,
            idle_s=idle_s,
            max_frame_bytes=max_frame_bytes,
            audit_hook=audit_hook,
            sandbox_start=sandbox_start,
            memory_budget_mb=memory_budget_mb,
            filesystem=filesystem,
            namespaces=namespaces,
            files_mb=files_mb,
        )
        if snapshot_key is not None and len(snapshot_key) < 16:
            raise ValueError("snapshot_key must be at least 16 bytes")
        # This host's sandboxes live in a home of their own, so a worker that finds it dead
        # (SIGKILLed) can remove them; the dead ones are reaped now and then every reap_idle.
        self.home = SandboxHome(self.sandbox_root)
        self.home.ensure()
        # A uid of its own per sandbox when this worker may hand them out (root).
        self.uids = SandboxUids(self.sandbox_root, self.home.path) if os.geteuid() == 0 else None
        self.writes = StepWrites(blobs)
        self.starter = SandboxStarter(blobs, self.config, self.home, self.uids)
        self.pool = SandboxPool(
            self.starter,
            self.config,
            self.sandbox_root,
            max_sandboxes,
            lambda box: self.snapshots.take_idle(box),
        )
        # Signs snapshots; every worker that may rebuild an episode needs the same key.
        self.snapshots = Snapshots(blobs, self.writes, self.pool, snapshot_key or os.urandom(32))
        self.rebuilder = Rebuilder(blobs, self.writes, self.pool, self.starter, self.snapshots)
        self.cells = CellDriver(self.writes, self.pool, worker_queue)
        self.reap_dead_sandboxes()

    @property
    def blobs(self) -> BlobStore:
        """The blob store every part of this worker reads and writes."""
        return self._blobs

    @blobs.setter
    def blobs(self, store: BlobStore) -> None:
        # Swapped whole (tests: a worker with no cached copy of a blob): every part takes it.
        self._blobs = store
        for part in (self.writes, self.starter, self.snapshots, self.rebuilder):
            part.blobs = store

    @property
    def slots(self) -> SandboxSlots:
        """The worker's sandbox slots (runtime.py admits new episodes by them)."""
        return self.pool.slots

    # --- activities -----------------------------------------------------------------------

    @activity.defn(name=names.REPL_EXECUTE)
    async def execute_cell(self, request: ExecuteCellInput) -> CellOutcome:
        echo = StepEcho(cell_index=request.cell_index, iteration=request.iteration, code=request.code)
        async with compact_failures(), echoed(echo) as step:
            return step(await self._execute_cell(request))

    async def _execute_cell(self, request: ExecuteCellInput) -> CellOutcome:
        await count_local_start(self.blobs)
        async with self.pool.lock(request.sandbox.episode_id), heartbeating(), self.writes.batched():
            box, report, divergences = await self.rebuilder.ensure(request.sandbox, resuming=False)
            async with self.pool.discard_on_failure(box):
                box.log_head = await self.writes.log(
                    box.log_head,
                    CellStarted(cell=request.cell_index, iteration=request.iteration, code=request.code),
                )
                box.cell_index, box.next_call = request.cell_index, 0
                box.cells[request.cell_index] = LoggedCell(
                    request.cell_index, request.iteration, request.code
                )
                await box.send(exec_message(request.sandbox, request.cell_index, request.code))
                outcome = await self.snapshots.after_cell(
                    box, request.sandbox, await self.cells.drive(box, request.sandbox)
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
        async with self.pool.lock(request.sandbox.episode_id), heartbeating(), self.writes.batched():
            box, report, divergences = await self.rebuilder.ensure(request.sandbox, resuming=True)
            rebuilt = report is not None
            async with self.pool.discard_on_failure(box):
                if box.early_done is not None:
                    # Rebuilt code finished without asking for these calls: it diverged.
                    done = await self.cells.finish(box, box.early_done, rebuilt, divergences)
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
                        text=self.writes.store.put_text(a.text),
                        kind=kinds[a.call_index],
                    )
                    for a in request.answers
                ]
                box.log_head = await self.writes.log(
                    box.log_head, CallsAnswered(cell=request.cell_index, answers=logged)
                )
                if request.cell_index in box.cells:
                    box.cells[request.cell_index].answers.extend(logged)
                box.pending = []
                await box.send(
                    {"op": "answers", "answers": [{"ok": a.ok, "text": a.text} for a in request.answers]}
                )
                outcome = await self.snapshots.after_cell(
                    box, request.sandbox, await self.cells.drive(box, request.sandbox)
                )
            return outcome.model_copy(
                update={"rebuilt": rebuilt, "divergences": divergences, "rebuild": report}
            )

    @activity.defn(name=names.REPL_READ_VARIABLE)
    async def read_variable(self, request: ReadVariableInput) -> VariableValue:
        await count_local_start(self.blobs)
        async with compact_failures(), self.pool.lock(request.sandbox.episode_id), heartbeating():
            box, _, _ = await self.rebuilder.ensure(request.sandbox, resuming=False)
            await box.send({"op": "read_var", "name": request.name})
            reply = await box.receive(request.sandbox.cell_timeout_s + defaults.HARD_KILL_GRACE_S)
            if reply is None or reply.get("op") != "var":
                problem = await box.silence(reply, request.sandbox.cell_timeout_s)
                await self.pool.discard(box)
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
        return await self.pool.close_episode(request.episode_id)

    # --- lifecycle (runtime.py, worker.py, drlm doctor) -------------------------------------

    def reap_dead_sandboxes(self) -> None:
        """Remove the sandboxes of dead workers sharing this root (never raises)."""
        self.pool.reap_dead_sandboxes()

    async def reap_idle(self) -> int:
        """Kill sandboxes unused for `idle_s`, and reap those of dead workers."""
        return await self.pool.reap_idle()

    async def close_all(self) -> None:
        """Kill every sandbox, and the template (a later step starts a new one)."""
        await self.pool.close_all()

    def live_episodes(self) -> list[str]:
        return self.pool.live_episodes()

    def memory_report(self) -> MemoryReport:
        """USS of each live sandbox and of the template: what discarding each would free."""
        return self.pool.memory_report()

    async def enforce_memory_budget(self) -> list[str]:
        """Discard idle sandboxes, least recently used first, down to `memory_budget_mb`."""
        return await self.pool.enforce_memory_budget()

    async def warm(self) -> None:
        """Start the fork template ahead of the first step (activities/sandbox_start.py)."""
        await self.starter.warm()

    async def probe(self) -> dict[str, str]:
        """The isolation layers of a sandbox started now (`drlm doctor`)."""
        return await self.starter.probe()
