"""A worker's read-only copies of contexts, keyed by digest: made once, mapped by every sandbox.

The first sandbox that needs a context makes its copy: the blob is streamed from the store
chunk by chunk (each checked) into a file of the worker's own cache directory, made read-only,
and renamed into place under the digest. Every later sandbox of the worker over the same
context — a second episode, ten at once, a rebuild after an eviction — opens that file and
maps it (activities/sandbox/contexts.py): the host holds one copy, in the page cache, and
never the whole context in its own memory. A documents context becomes one pack file: a
header naming each document's place, then the documents' bytes.

The directory is the worker's own (`owned_cache_dir`): made fresh with a random name, 0700,
never one a sandbox named or can write; a copy whose file was changed since it was made (its
size, mode, times or inode differ from what the worker recorded) is made again. With
encryption at rest on, the clear copies live only in memory-backed storage (/dev/shm) the
worker owns, never on disk in the clear. Copies unused for the longest go first when the
cache passes its size; a sandbox that has its copy open keeps it even then (an unlinked
file lives while it is open).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from durable_rlm.activities.sandbox.contexts import HEADER, PACK_MAGIC
from durable_rlm.host.owned_dirs import UnsafeDirectory, check_owned
from durable_rlm.store.blobs import BlobStore
from durable_rlm.store.chunks import split_digest
from durable_rlm.store.contexts import read_documents_index
from durable_rlm.workflows.models import ContextRef

DEFAULT_CACHE_BYTES = 32 * 1024**3
"""Copies kept before the least recently used go (one larger copy is always kept)."""

MEMORY_BACKED = Path("/dev/shm")
EVICT_AFTER_S = 300.0


def owned_cache_dir(encrypting: bool, base: Path | None = None) -> Path:
    """The cache directory: created fresh (a random name, 0700) under `base`, in memory-backed
    storage when contexts are sealed at rest. The one place that decides where the clear
    copies live."""
    if base is None:
        base = MEMORY_BACKED if encrypting and MEMORY_BACKED.is_dir() else Path(tempfile.gettempdir())
    if encrypting and not _memory_backed(base):
        raise OSError(
            f"{base} is not memory-backed (tmpfs): sealed contexts are never cached in the clear on disk"
        )
    directory = Path(tempfile.mkdtemp(prefix=f"drlm-contexts-{os.getpid()}-", dir=base))
    check_private(directory)
    return directory


def check_private(directory: Path) -> None:
    """The rules of every directory the worker owns (durable_rlm/host/owned_dirs.py: not a link,
    this user's, writable by nobody else), and readable by nobody else: it holds contexts
    in the clear."""
    info = check_owned(directory)
    if info.st_mode & 0o077:
        raise UnsafeDirectory(f"context cache {directory} is open to others (mode {info.st_mode & 0o777:o})")


def _memory_backed(path: Path) -> bool:
    with contextlib.suppress(OSError):
        with open("/proc/self/mounts") as mounts:
            best = ("", "")
            resolved = str(path.resolve())
            for line in mounts:
                fields = line.split()
                if len(fields) > 2 and (resolved + "/").startswith(fields[1].rstrip("/") + "/"):
                    if len(fields[1]) >= len(best[0]):
                        best = (fields[1], fields[2])
            return best[1] in ("tmpfs", "ramfs")
    return False


@dataclass(frozen=True)
class CachedContext:
    """A made copy: its file, what the sandbox builds from it, and what the file must stay."""

    path: Path
    kind: str  # text, json, documents
    size: int
    signature: tuple[int, int, int, int, int]  # inode, size, mode, mtime_ns, ctime_ns

    def init_message(self, view: str = "str") -> dict[str, str]:
        return {"path": str(self.path), "kind": self.kind, "view": view}


def _signature(info: os.stat_result) -> tuple[int, int, int, int, int]:
    return (info.st_ino, info.st_size, info.st_mode, info.st_mtime_ns, info.st_ctime_ns)


class ContextCache:
    def __init__(self, blobs: BlobStore, encrypting: bool, capacity: int = DEFAULT_CACHE_BYTES) -> None:
        self.blobs = blobs
        self.encrypting = encrypting
        self.capacity = capacity
        self._directory: Path | None = None
        self._entries: OrderedDict[str, CachedContext] = OrderedDict()
        self._entries_lock = threading.Lock()  # a client's copy arrives from another thread
        self._used: dict[str, float] = {}  # when each copy was last handed out
        self._locks: dict[str, asyncio.Lock] = {}
        self.made = 0  # copies made from the store (tests and benchmarks count them)
        self.adopted = 0  # copies written as a client of this process stored the context
        _LOCAL.add(self)

    @property
    def directory(self) -> Path:
        if self._directory is None or not self._directory.is_dir():
            with contextlib.suppress(OSError):
                sweep_stale_caches()  # those of this uid's workers that died without closing theirs
            self._directory = owned_cache_dir(self.encrypting)
        return self._directory

    async def copy_of(self, ref: ContextRef) -> CachedContext:
        """The worker's copy of `ref`'s context, made now if it has none (or a bad one)."""
        key = f"{ref.kind}:{ref.digest}"
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:  # ten sandboxes at once over one context: one copy is made
            with self._entries_lock:
                entry = self._entries.get(key)
                if entry is not None and self._intact(entry):
                    self._entries.move_to_end(key)
                    self._used[key] = time.monotonic()
                    return entry
            entry = await asyncio.to_thread(self._make, ref)
            self._keep(key, entry)
            self.made += 1
            await asyncio.to_thread(self._evict)
            return entry

    def _keep(self, key: str, entry: CachedContext) -> None:
        with self._entries_lock:
            self._entries[key] = entry
            self._entries.move_to_end(key)
            self._used[key] = time.monotonic()

    def teeing(self) -> CopyInPassing:
        """A copy written while a client of this process streams a context to the store
        (embedded mode: the client is the worker), so no sandbox waits for it to be read back."""
        return CopyInPassing(self)

    def adopt(self, ref: ContextRef, made: Path) -> None:
        """Take `made` (the bytes just stored as `ref`, written in this cache's directory) as
        the copy of `ref`, unless one is there already."""
        key = f"{ref.kind}:{ref.digest}"
        with self._entries_lock:
            present = self._entries.get(key)
        if present is not None and self._intact(present):
            with contextlib.suppress(OSError):
                os.unlink(made)
            return
        _, hexpart = split_digest(ref.digest)
        final = made.parent / f"{ref.kind}-{hexpart}"
        os.chmod(made, 0o444)
        os.replace(made, final)
        info = os.lstat(final)
        self._keep(key, CachedContext(final, ref.kind, info.st_size, _signature(info)))
        self.adopted += 1

    def _intact(self, entry: CachedContext) -> bool:
        try:
            return _signature(os.lstat(entry.path)) == entry.signature
        except OSError:
            return False

    def _make(self, ref: ContextRef) -> CachedContext:
        directory = self.directory
        check_private(directory)
        _, hexpart = split_digest(ref.digest)
        final = directory / f"{ref.kind}-{hexpart}"
        fd, temporary = tempfile.mkstemp(dir=directory, prefix=".making-")
        try:
            with os.fdopen(fd, "wb") as out:
                if ref.kind == "documents":
                    self._write_pack(ref, out)
                else:
                    for chunk in self.blobs.chunks(ref.digest):
                        out.write(chunk)
            os.chmod(temporary, 0o444)
            os.replace(temporary, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        info = os.lstat(final)
        return CachedContext(final, ref.kind, info.st_size, _signature(info))

    def _write_pack(self, ref: ContextRef, out: BinaryIO) -> None:
        """The header (each document's kind and place, counted from the end of the header:
        known from the index before any document is read), then each document streamed."""
        documents = read_documents_index(self.blobs, ref.digest)
        entries, offset = [], 0
        for document in documents:
            entries.append(
                {
                    "name": document.name,
                    "kind": document.kind,
                    "offset": offset,
                    "length": document.stored_bytes,
                }
            )
            offset += document.stored_bytes
        header = json.dumps({"documents": entries}).encode("utf-8")
        out.write(PACK_MAGIC + HEADER.pack(len(header)) + header)
        for document, entry in zip(documents, entries, strict=True):
            written = 0
            for chunk in self.blobs.chunks(document.digest):
                out.write(chunk)
                written += len(chunk)
            if written != entry["length"]:
                raise ValueError(
                    f"document {document.name} is {written} bytes; its index says {entry['length']}"
                )

    def _evict(self) -> None:
        """Least recently used first, never one handed out in the last EVICT_AFTER_S (its
        sandbox may not have opened it yet); a sandbox that opened it keeps reading it."""
        now = time.monotonic()
        with self._entries_lock:
            total = sum(e.size for e in self._entries.values())
            for key in list(self._entries):
                if total <= self.capacity or len(self._entries) <= 1:
                    break
                if now - self._used.get(key, 0.0) < EVICT_AFTER_S:
                    continue
                oldest = self._entries.pop(key)
                total -= oldest.size
                with contextlib.suppress(OSError):
                    os.unlink(oldest.path)

    def close(self) -> None:
        """Remove the cache (the worker stops): nothing of a context stays behind."""
        _LOCAL.discard(self)
        directory, self._directory = self._directory, None
        self._entries.clear()
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)


_LOCAL: weakref.WeakSet[ContextCache] = weakref.WeakSet()


def local_cache(blobs: BlobStore) -> ContextCache | None:
    """The cache of a worker running in this process over the same blob store, if any."""
    where = blobs.backend.describe()
    for cache in list(_LOCAL):
        if cache.blobs is blobs or cache.blobs.backend.describe() == where:
            return cache
    return None


class CopyInPassing:
    """Writes the pieces of a context to a file of the cache as they go to the store."""

    def __init__(self, cache: ContextCache) -> None:
        self.cache = cache
        fd, name = tempfile.mkstemp(dir=cache.directory, prefix=".teeing-")
        self.path = Path(name)
        self.out = os.fdopen(fd, "wb")

    def pieces(self, pieces: Iterator[bytes]) -> Iterator[bytes]:
        for piece in pieces:
            self.out.write(piece)
            yield piece

    def keep(self, ref: ContextRef) -> None:
        self.out.close()
        self.cache.adopt(ref, self.path)

    def drop(self) -> None:
        self.out.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def sweep_stale_caches(base: Path | None = None, older_than_s: float = 3600.0) -> int:
    """Caches left by workers that died without closing theirs (their pid gone)."""
    removed = 0
    for base_dir in {base} if base else {Path(tempfile.gettempdir()), MEMORY_BACKED}:
        if not base_dir.is_dir():
            continue
        for entry in base_dir.glob("drlm-contexts-*-*"):
            try:
                pid = int(entry.name.split("-")[2])
                info = os.lstat(entry)
            except (ValueError, IndexError, OSError):
                continue
            if info.st_uid != os.geteuid() or time.time() - info.st_mtime < older_than_s:
                continue
            try:
                os.kill(pid, 0)
                continue  # its worker lives
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
            shutil.rmtree(entry, ignore_errors=True)
            removed += 1
    return removed
