"""`drlm gc`: remove the blobs that only histories gone past the namespace's retention named.

Mark, then sweep. The mark walks every history the server still has — open or closed, every
workflow type — the way `drlm verify` does (audit/verify.py): claim-checked payloads, the
contexts requests name (documents and manifests' chunks with them), conversation and cell-log
chains with their outputs, replies and snapshots, and what a fork's request names of its
source. So a blob that a live history, a snapshot a fork or a rebuild may load, or a fork
still needs, is marked. The sweep lists the store and removes each blob that is neither
marked nor written (or named again) within the grace period before the mark began: a context
stored by a client that has not started its episode yet, a step's blobs not yet in history,
or a local step's start marker, is younger than that.

The audit store's timelines of episodes whose history is gone are marked expired (their text
stays for `drlm show`; `drlm verify` no longer checks their blobs). Run it by hand, or as a
Temporal Schedule (`drlm gc --schedule 6h`), which any worker runs.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from temporalio import activity
from temporalio.client import (
    Client,
    Schedule,
    ScheduleActionStartWorkflow,
    ScheduleAlreadyRunningError,
    ScheduleIntervalSpec,
    ScheduleSpec,
    ScheduleUpdate,
)
from temporalio.service import RPCError, RPCStatusCode

from durable_rlm.audit.verify import Verifier
from durable_rlm.server.connection import connect
from durable_rlm.store import schema
from durable_rlm.store.blobs import BlobNotFound, BlobStore, CorruptBlob
from durable_rlm.workflows import names
from durable_rlm.workflows.retention import GcRequest, GcSummary

DEFAULT_GRACE = timedelta(days=1)


class Marker(Verifier):
    """The verifier's walk, reading only what names further blobs: payloads, chain nodes,
    documents indexes and manifests; contexts, snapshots and outputs are marked unread."""

    def __init__(self, client: Client, blobs: BlobStore) -> None:
        super().__init__(client, blobs, None)
        self.marked: set[str] = set()

    def _load(self, digest: str, keep: bool = True) -> bytes | None:
        self.marked.add(digest)
        known = self._read.get(digest)
        if isinstance(known, bytes) or (digest in self._read and not keep):
            return known if isinstance(known, bytes) else None
        data: bytes | None = None
        try:
            manifest = self.blobs.manifest(digest)
            if manifest is not None:
                self.marked.update(chunk for chunk, _ in manifest.chunks)
            if keep:
                data = self.blobs.get(digest)
        except (BlobNotFound, CorruptBlob, ValueError):
            data = None  # missing or broken: `drlm verify` says so; nothing to follow here
        self._read[digest] = data
        return data

    def _stored_timeline(self, episode_id: str) -> dict[str, Any] | None:
        return None  # a projection of a history walked already, or of one that is gone


@dataclass
class GcReport:
    started_at: datetime
    cutoff: datetime
    histories: int = 0
    referenced: int = 0
    listed: int = 0
    listed_bytes: int = 0
    removed: int = 0
    removed_bytes: int = 0
    kept_young: int = 0
    expired_timelines: int = 0
    dry_run: bool = False

    def summary(self) -> GcSummary:
        return GcSummary(
            started_at=self.started_at.isoformat(),
            histories=self.histories,
            referenced=self.referenced,
            listed=self.listed,
            removed=self.removed,
            removed_bytes=self.removed_bytes,
            kept_young=self.kept_young,
            expired_timelines=self.expired_timelines,
            dry_run=self.dry_run,
        )

    def lines(self) -> list[str]:
        verb = "would remove" if self.dry_run else "removed"
        return [
            f"{self.histories} history(ies) walked: {self.referenced:,} blob(s) and chunk(s) referenced",
            f"{self.listed:,} blob(s) stored ({self.listed_bytes:,} bytes); {verb} {self.removed:,} "
            f"({self.removed_bytes:,} bytes) named by no history; kept {self.kept_young:,} unnamed "
            f"one(s) written since {self.cutoff.isoformat(timespec='seconds')} (the grace period)",
            f"{self.expired_timelines} stored timeline(s) of episodes past retention marked expired",
        ]


async def collect_garbage(
    client: Client,
    blobs: BlobStore,
    engine: sa.Engine | None,
    grace: timedelta = DEFAULT_GRACE,
    dry_run: bool = False,
    beat: Callable[[str], None] | None = None,
) -> GcReport:
    started = datetime.now(UTC)
    report = GcReport(started_at=started, cutoff=started - grace, dry_run=dry_run)
    marker = Marker(client, blobs)
    alive: set[str] = set()
    async for execution in client.list_workflows():
        alive.add(execution.id)
    for workflow_id in sorted(alive):
        try:
            await marker.episode(workflow_id)
        except LookupError:
            continue  # gone between the listing and the walk: its blobs are not needed
        report.histories += 1
        if beat is not None:
            beat(f"marked {report.histories} of {len(alive)} histories")
    report.referenced = len(marker.marked)
    if engine is not None:
        report.expired_timelines = await _expire_timelines(client, engine, alive, started, dry_run)
    candidates: list[tuple[str, int]] = []
    last_beat = time.monotonic()
    for blob in await asyncio.to_thread(lambda: list(blobs.backend.listing())):
        report.listed += 1
        report.listed_bytes += blob.size
        if blob.digest in marker.marked:
            continue
        if blob.written_at >= report.cutoff:
            report.kept_young += 1
            continue
        candidates.append((blob.digest, blob.size))
        if beat is not None and time.monotonic() - last_beat > 10:
            last_beat = time.monotonic()
            beat(f"listed {report.listed} blobs")
    sizes = dict(candidates)
    if dry_run:
        report.removed, report.removed_bytes = len(candidates), sum(sizes.values())
        return report
    report.removed = await asyncio.to_thread(blobs.delete, list(sizes), report.cutoff)
    report.removed_bytes = sum(sizes.values()) if report.removed == len(sizes) else _still_gone(blobs, sizes)
    return report


def _still_gone(blobs: BlobStore, sizes: dict[str, int]) -> int:
    """Bytes freed when some candidates were named again meanwhile (and so kept)."""
    present = {b.digest for b in blobs.backend.listing()}
    return sum(size for digest, size in sizes.items() if digest not in present)


async def _expire_timelines(
    client: Client, engine: sa.Engine, alive: set[str], now: datetime, dry_run: bool
) -> int:
    table = schema.episode_timelines

    def stored() -> list[str]:
        with engine.connect() as conn:
            query = sa.select(table.c.episode_id).where(table.c.blobs_expired_at.is_(None))
            return list(conn.execute(query).scalars())

    gone: list[str] = []
    for episode_id in await asyncio.to_thread(stored):
        if episode_id in alive:
            continue
        try:
            await client.get_workflow_handle(episode_id).describe()
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                gone.append(episode_id)  # the server has no history of it any more
            continue
    if gone and not dry_run:

        def mark() -> None:
            with engine.begin() as conn:
                conn.execute(table.update().where(table.c.episode_id.in_(gone)).values(blobs_expired_at=now))

        await asyncio.to_thread(mark)
    return len(gone)


class RetentionActivities:
    """The scheduled collection, run by any worker with the deployment's stores."""

    def __init__(self, blobs: BlobStore, engine: sa.Engine | None) -> None:
        self.blobs = blobs
        self.engine = engine

    @activity.defn(name=names.COLLECT_GARBAGE)
    async def collect(self, request: GcRequest) -> GcSummary:
        report = await collect_garbage(
            activity.client(),
            self.blobs,
            self.engine,
            timedelta(seconds=request.grace_s),
            request.dry_run,
            beat=activity.heartbeat,
        )
        activity.logger.info("blob retention: %s", " / ".join(report.lines()))
        return report.summary()


async def schedule_collection(client: Client, task_queue: str, every: timedelta, grace: timedelta) -> str:
    """Create (or update) the Temporal Schedule that runs the collection every `every`."""
    action = ScheduleActionStartWorkflow(
        names.GC_WORKFLOW,
        GcRequest(grace_s=grace.total_seconds()),
        id=f"{names.GC_SCHEDULE_ID}-run",
        task_queue=task_queue,
    )
    schedule = Schedule(action=action, spec=ScheduleSpec(intervals=[ScheduleIntervalSpec(every=every)]))
    try:
        await client.create_schedule(names.GC_SCHEDULE_ID, schedule)
        return f"schedule {names.GC_SCHEDULE_ID} created: blob retention every {every}, grace {grace}"
    except ScheduleAlreadyRunningError:
        handle = client.get_schedule_handle(names.GC_SCHEDULE_ID)
        await handle.update(lambda _: ScheduleUpdate(schedule=schedule))
        return f"schedule {names.GC_SCHEDULE_ID} updated: blob retention every {every}, grace {grace}"


async def gc_command(
    settings: Any, grace: timedelta, dry_run: bool, as_json: bool, every: timedelta | None
) -> int:
    """`drlm gc [--dry-run] [--grace D] [--schedule EVERY]`: the report on stdout."""
    async with connect(settings) as services:
        if every is not None:
            print(await schedule_collection(services.client, settings.task_queue, every, grace))
            return 0
        report = await collect_garbage(services.client, services.blobs, services.engine, grace, dry_run)
    if as_json:
        print(json.dumps({**report.summary().model_dump(), "cutoff": report.cutoff.isoformat()}))
    else:
        print("\n".join(report.lines()))
    return 0
