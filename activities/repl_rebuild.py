"""Rebuilding an episode's REPL on a worker that lacks it (DESIGN invariant 3).

REPL state is named by the head of its cell log: a step that names a head this worker's
sandbox is not at (or that finds no sandbox) gets a new one, made from the snapshot parked
when the old one was evicted, else from the log's latest snapshot and the cells after it,
else by re-running every cell. Re-run cells call no model: their calls are answered from
the log, and a call that differs from the recorded one is a divergence, reported with the
step. Finished cells are re-run in batches (one exchange each), the open one call by call,
since it must stop where the log's answers end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from temporalio.exceptions import ApplicationError

from durable_rlm.activities.live_sandbox import LiveSandbox, exec_message
from durable_rlm.activities.repl_snapshots import SnapshotRefused, Snapshots
from durable_rlm.activities.repl_writes import StepWrites
from durable_rlm.activities.sandbox_pool import SandboxPool
from durable_rlm.activities.sandbox_start import SandboxStarter
from durable_rlm.store import chains
from durable_rlm.store.blobs import BlobStore
from durable_rlm.store.chains import CellEnded, LoggedCell, SnapshotTaken
from durable_rlm.workflows import defaults, names
from durable_rlm.workflows.models import RebuildReport, SandboxRef

log = logging.getLogger(__name__)

REPLAY_BATCH_CELLS = 200
REPLAY_BATCH_BYTES = 8 * 1024 * 1024
"""Finished cells re-run in one exchange: at most this many, of this much code and answers."""


class Rebuilder:
    """Gives a step its episode's live sandbox at the head it names, rebuilt if need be."""

    def __init__(
        self,
        blobs: BlobStore,
        writes: StepWrites,
        pool: SandboxPool,
        starter: SandboxStarter,
        snapshots: Snapshots,
    ) -> None:
        self.blobs = blobs
        self.writes = writes
        self.pool = pool
        self.starter = starter
        self.snapshots = snapshots

    async def ensure(
        self, ref: SandboxRef, resuming: bool
    ) -> tuple[LiveSandbox, RebuildReport | None, list[str]]:
        """The episode's live sandbox at `ref.log_head`, rebuilt if this worker lacks it: from
        a snapshot parked when it was evicted, else from the log's latest snapshot and the
        cells after it, else (no usable snapshot) by re-running every cell."""
        box = self.pool.live.get(ref.episode_id)
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
            await self.pool.discard(box)
        async with self.pool.slots.starting(ref.episode_id):
            started = time.monotonic()  # the wait for a slot is not the rebuild's
            parked = self.pool.parked.pop(ref.episode_id, None)
            box = await self.starter.start(ref)
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
                        notes += await self.snapshots.restore(box, ref, snapshot)
                    except SnapshotRefused as refused:
                        log.warning("episode %s: %s; re-running its cells instead", ref.episode_id, refused)
                        notes.append(
                            f"The REPL's snapshot after cell {snapshot.cell} could not be used ({refused}); "
                            "the REPL was rebuilt by re-running every cell instead, so values that came "
                            "from the clock or OS randomness were drawn again."
                        )
                        await asyncio.shield(box.kill())
                        box, snapshot = await self.starter.start(ref), None
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
            self.pool.live[ref.episode_id] = box
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

    async def _abandon_open_cell(self, box: LiveSandbox, cell: int) -> None:
        """A new step arrives while the log's last cell never ended: the workflow gave up on
        it. The REPL was rebuilt without it; log it as lost so later rebuilds skip it too."""
        reason = await asyncio.to_thread(self.writes.store.put_text, "abandoned: a later step was started")
        box.log_head = await self.writes.log(box.log_head, CellEnded(cell=cell, status="lost", output=reason))
        box.cell_index, box.pending, box.early_done = None, [], None

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
            await box.send(exec_message(ref, cell.index, cell.code, summary=cell.status is None))
            recorded = list(cell.answers)
            while True:
                frame = await box.receive(ref.cell_timeout_s + defaults.HARD_KILL_GRACE_S)
                if frame is None or frame.get("op") not in ("call", "done"):
                    problem = await box.silence(frame, ref.cell_timeout_s)
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
                    box.pending = box.requests(frame)
                    break
                replies = []
                for request in box.requests(frame):
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
                {**exec_message(ref, c.index, c.code, summary=False), "answers": answers}
                for c, answers in batch
            ],
        }
        await box.send(message)
        timeout = len(cells) * ref.cell_timeout_s + defaults.HARD_KILL_GRACE_S
        frame = await box.receive(timeout)
        if frame is None or frame.get("op") != "replayed" or len(frame.get("cells", [])) != len(cells):
            problem = await box.silence(frame, timeout - defaults.HARD_KILL_GRACE_S)
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
