"""A REPL step's writes: held in memory and stored in one transaction when the step ends.

Every step appends to its episode's cell log (a typed hash chain in the blob store) and
stores outputs and answers; a commit costs more than its rows, and a step made five. The
step's writes go to a batch (`batched`) that is flushed before its result names them;
outside a step (a sandbox evicted in the background, say) they go to the store at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterator

from durable_rlm.store import chains
from durable_rlm.store.blobs import BlobBatch, BlobStore, TypedBlobs

# The open step's blob writes (each activity runs in its own task, so its own context).
_STEP_WRITES: contextvars.ContextVar[BlobBatch | None] = contextvars.ContextVar("step_writes", default=None)


class StepWrites:
    """Where a step's blobs and log entries go: its batch while one is open, else the store."""

    def __init__(self, blobs: BlobStore) -> None:
        self.blobs = blobs

    @property
    def store(self) -> TypedBlobs:
        """Where a step writes: its batch while one is open (see `batched`)."""
        return _STEP_WRITES.get() or self.blobs

    @contextlib.asynccontextmanager
    async def batched(self) -> AsyncIterator[None]:
        """Hold the step's blob writes (log entries, outputs, answers) in memory and store
        them in one transaction when it ends, before its result names them."""
        batch = BlobBatch(self.blobs)
        token = _STEP_WRITES.set(batch)
        try:
            yield
            await asyncio.to_thread(batch.flush)
        finally:
            _STEP_WRITES.reset(token)

    async def log(self, head: str | None, entry: chains.LogEntry) -> str:
        """Append `entry` to the cell log after `head`; returns the new head."""
        store = self.store
        if isinstance(store, BlobBatch):
            return chains.append(store, head, entry)  # hashing only: no I/O
        return await asyncio.to_thread(chains.append, store, head, entry)
