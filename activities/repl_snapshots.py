"""REPL snapshots on the worker's side: when to take one, storing and signing it, and
checking one before a rebuild loads it.

A snapshot is bytes that sandboxed code produced (DESIGN, "REPL cells as resumable
coroutines"): the worker never loads one itself. It stores the file a sandbox wrote (read
with the care durable_rlm/host/files.py takes), signs the log entry that names it with the
worker's snapshot key, and hands a snapshot only to a sandbox of the same episode (or of a
fork of it, as `drlm fork` signed), after checking that signature; what a snapshot could
not hold is re-created by re-running the cells that bound it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import time
import uuid

from durable_rlm.activities.live_sandbox import UNREADABLE_VIEW, LiveSandbox, exec_message
from durable_rlm.activities.repl_writes import StepWrites
from durable_rlm.activities.sandbox.snapshot import SNAPSHOT_PREFIX
from durable_rlm.activities.sandbox_pool import SandboxPool
from durable_rlm.host.files import read_sandbox_file, write_sandbox_file
from durable_rlm.store.blobs import BlobStore
from durable_rlm.store.chains import LoggedCell, RecreateCell, SnapshotTaken, StoredSnapshot
from durable_rlm.store.snapshot_key import lineage_mac
from durable_rlm.store.snapshot_pins import pin_snapshot, snapshot_pinned
from durable_rlm.workflows import defaults
from durable_rlm.workflows.models import CellOutcome, SandboxRef, SnapshotRef

log = logging.getLogger(__name__)


_TOLD_UNREADABLE: list[bool] = []


class SnapshotRefused(Exception):
    """A snapshot a rebuild will not load (another episode's, altered, unreadable); the
    rebuild re-runs the cells instead."""


class Snapshots:
    """Takes, signs, checks and restores the snapshots of the pool's sandboxes. Every worker
    that may rebuild an episode needs the same `snapshot_key` (a snapshot signed with another
    is refused, and the cells re-run instead)."""

    def __init__(self, blobs: BlobStore, writes: StepWrites, pool: SandboxPool, snapshot_key: bytes) -> None:
        self.blobs = blobs
        self.writes = writes
        self.pool = pool
        self.snapshot_key = snapshot_key

    async def restore(self, box: LiveSandbox, ref: SandboxRef, snapshot: SnapshotTaken) -> list[str]:
        """Load a snapshot into a fresh sandbox after checking it was made for this episode
        (or one it descends from) and is unchanged; then the cells it lists re-create the
        names it could not hold. Notes say which names came back how."""
        if snapshot.episode != ref.episode_id and not self._descends(ref, snapshot.episode):
            raise SnapshotRefused(f"it belongs to another episode ({snapshot.episode})")
        if not hmac.compare_digest(snapshot.mac, self._mac(snapshot)):
            raise SnapshotRefused("its integrity check failed: it was altered, or signed with another key")
        if snapshot.episode != ref.episode_id:  # a fork's: its source's quota must not delete it
            await asyncio.to_thread(pin_snapshot, self.blobs, snapshot.ref)
        try:
            data = await asyncio.to_thread(self.blobs.get, snapshot.ref)
        except (KeyError, ValueError) as exc:
            raise SnapshotRefused(f"its blob cannot be read ({exc})") from None
        name = f"{SNAPSHOT_PREFIX}{uuid.uuid4().hex[:8]}"
        # The host's side of the directory (seen read-only by a sandbox whose own is a tmpfs).
        await asyncio.to_thread(write_sandbox_file, box.directory, name, data, box.uid)
        del data
        recreate = []
        for cell in snapshot.recreate:
            texts = [await asyncio.to_thread(self.blobs.get_text, a.text) for a in cell.answers]
            recreate.append(
                {
                    **exec_message(ref, cell.cell, cell.code, summary=False),
                    "names": sorted(cell.names),
                    "answers": [{"ok": a.ok, "text": t} for a, t in zip(cell.answers, texts, strict=True)],
                }
            )
        await box.send({"op": "restore", "name": name, "recreate": recreate})
        timeout = defaults.SNAPSHOT_TIMEOUT_S + len(recreate) * ref.cell_timeout_s
        reply = await box.receive(timeout)
        with contextlib.suppress(OSError):
            (box.directory / name).unlink()  # read by now (the sandbox cannot, where it is read-only)
        if reply is None or reply.get("op") not in ("restored", "restore_failed"):
            raise SnapshotRefused(f"loading it failed: {await box.silence(reply, timeout)}")
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

    async def after_cell(self, box: LiveSandbox, ref: SandboxRef, outcome: CellOutcome) -> CellOutcome:
        """A cell completed: snapshot the namespace if the policy says so, and record it in
        the log right after the cell. A snapshot that fails costs only itself."""
        if outcome.status != "completed" or self.pool.live.get(box.episode_id) is not box:
            return outcome
        box.policy = ref.snapshots
        if not box.snapshot_due():
            return outcome
        entry = await self.take(box, ref)
        if entry is None:
            note = box.snapshot_note
            return outcome if note is None else outcome.model_copy(update={"snapshot_note": note})
        box.log_head = await self.writes.log(box.log_head, entry)
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

    async def take(self, box: LiveSandbox, ref: SandboxRef | None = None) -> SnapshotTaken | None:
        """Have the sandbox pickle its namespace to a file; store it, list what a rebuild
        must re-run for the names it could not hold, and sign the entry."""
        episode = ref.episode_id if ref is not None else box.episode_id
        started = time.monotonic()
        name = f"{SNAPSHOT_PREFIX}{uuid.uuid4().hex[:8]}"
        path = box.view / name  # written by the sandbox: read through its own view
        box.since_s, box.since_cells, box.since_volatile = 0.0, 0, False  # tried: not again at once
        box.snapshot_note = None
        policy = (ref.snapshots if ref is not None else None) or box.policy
        quota = (policy.max_mb if policy is not None else defaults.SNAPSHOT_EPISODE_MB) * 2**20
        # The one before it is always kept: what it leaves of the quota bounds this one.
        previous = box.snapshot if box.snapshot is not None and box.snapshot.episode == episode else None
        room = quota - (previous.size if previous is not None else 0)
        limit = min(defaults.SNAPSHOT_MAX_MB * 2**20, room)
        over_quota = (
            f" (the episode keeps {quota // 2**20:,} MB of snapshots, snapshots.max_mb; "
            f"the one after cell {previous.cell if previous is not None else 0} takes "
            f"{previous.size if previous is not None else 0:,} bytes of it)"
        )
        if limit <= 0:
            box.snapshot_note = f"no snapshot after cell {box.last_cell}: no room left{over_quota}"
            return None
        if not box.view_readable():
            box.snapshot_note = f"no snapshot after cell {box.last_cell}: {UNREADABLE_VIEW}"
            if not _TOLD_UNREADABLE:
                _TOLD_UNREADABLE.append(True)
                log.warning("REPL snapshots are off on this worker: %s", UNREADABLE_VIEW)
            return None
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
            problem = await box.silence(reply, defaults.SNAPSHOT_TIMEOUT_S)
            log.warning("episode %s: snapshot abandoned (%s); the sandbox is discarded", episode, problem)
            await self.pool.discard(box)  # its log is intact: the next step rebuilds from it
            return None
        if reply["op"] == "snapshot_failed":
            log.info("episode %s: no snapshot after cell %s: %s", episode, box.last_cell, reply.get("error"))
            why = str(reply.get("error") or "it failed")[:500]
            box.snapshot_note = f"no snapshot after cell {box.last_cell}: {why}" + (
                over_quota if limit < defaults.SNAPSHOT_MAX_MB * 2**20 else ""
            )
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        try:
            # The sandbox chose what is at that path: only a regular file of its own, at most
            # `limit` bytes, is read, and never for longer than a snapshot may take.
            async with asyncio.timeout(defaults.SNAPSHOT_TIMEOUT_S):
                data = await asyncio.to_thread(read_sandbox_file, box.view, name, limit, box.uid)
        except (OSError, TimeoutError) as exc:
            problem = str(exc) if isinstance(exc, OSError) else "reading it took too long"
            log.warning("episode %s: snapshot refused (%s); the sandbox is discarded", episode, problem)
            await self.pool.discard(box)  # its log is intact: the next step rebuilds from it
            return None
        finally:
            with contextlib.suppress(OSError):
                path.unlink()  # the name itself, whatever it is (a link is not followed)
        digest = await asyncio.to_thread(self.writes.store.put, data)
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
        snapshot.kept = await asyncio.to_thread(self._kept_beside, previous, snapshot, quota)
        box.cells = {
            c.cell: box.cells.get(c.cell) or LoggedCell(c.cell, 0, c.code, list(c.answers), "ok")
            for c in snapshot.recreate
        }
        return snapshot

    def _kept_beside(
        self, previous: SnapshotTaken | None, new: SnapshotTaken, quota: int
    ) -> list[StoredSnapshot]:
        """The episode's earlier snapshots still stored beside `new`: those `previous` listed,
        and `previous` itself, less the oldest ones the quota has no room for, whose blobs go
        (the one before `new` is always kept; a pinned one, which a fork loads, is kept in the
        store but no longer counted)."""
        if previous is None:
            return []
        kept = [*previous.kept]
        if previous.ref != new.ref:
            kept.append(StoredSnapshot(ref=previous.ref, size=previous.size))
        total = new.size + sum(k.size for k in kept)
        while len(kept) > 1 and total > quota:
            oldest = kept.pop(0)
            total -= oldest.size
            if oldest.ref == new.ref or any(k.ref == oldest.ref for k in kept):
                continue  # the same bytes as one still kept: one blob
            if not snapshot_pinned(self.blobs, oldest.ref):
                self.blobs.forget(oldest.ref, keep=[new.ref, *(k.ref for k in kept)])
        return kept

    async def take_idle(self, box: LiveSandbox) -> SnapshotTaken | None:
        """A snapshot of an idle sandbox about to be evicted: no step is open, so its writes
        are batched here as a step's are."""
        async with self.writes.batched():
            return await self.take(box)
