"""Content-addressed blob store: the claim-check side of every large payload, contexts of any
size, REPL logs and snapshots.

A blob's address says what its bytes are (store/chunks.py): `sha256:<hex>` for a blob of at
most a chunk, `sha256m:<hex>` for a manifest of chunks. A put is idempotent, every read is
checked against the address, and a blob of any size is written and read as a stream of
chunks (`put_stream`, `chunks`), so no process holds a large value whole to move it.
Backends: a directory, the SQL store's table (backends.py) and an S3-compatible object store
(s3.py); with DRLM_ENCRYPTION_KEYS every chunk and manifest is sealed on its own.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict, deque
from collections.abc import Generator, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from durable_rlm.store.backends import BlobBackend, Data, DirectoryBackend, SqlBackend, StoredBlob
from durable_rlm.store.chunks import (
    CHUNK_BYTES,
    CorruptBlob,
    Manifest,
    address_of,
    is_manifest,
    raw_digest,
    rechunk,
    split_digest,
)
from durable_rlm.store.encryption import Keyring, open_blob

__all__ = [
    "BlobBackend",
    "BlobBatch",
    "BlobNotFound",
    "BlobStore",
    "CorruptBlob",
    "DirectoryBackend",
    "SqlBackend",
    "Stored",
    "StoredBlob",
    "address_of",
    "digest_of",
    "text_digest",
]


class BlobNotFound(KeyError):
    """A digest the store does not hold: a history that outlived its blobs, or a process
    that looks in another store than the one the episode was started with."""

    def __init__(self, digest: str, where: str = "") -> None:
        super().__init__(digest)
        self.digest = digest
        self.where = where

    def __str__(self) -> str:
        place = f" in {self.where}" if self.where else ""
        return (
            f"blob {self.digest} not found{place}: every client and worker of an episode must use "
            "the same stores (check DRLM_DATA_DIR, DRLM_DATABASE_URL and DRLM_BLOB_STORE; "
            "`drlm info` shows them)"
        )


def digest_of(data: bytes) -> str:
    """sha256 of bytes, as text: the address of a blob of at most a chunk, and the name of a
    text kept elsewhere (a prompt's digest)."""
    return raw_digest(data)


def text_digest(text: str) -> str:
    return digest_of(text.encode("utf-8"))


class TypedBlobs:
    """Text and JSON over `put` / `get`, one encoding for every store (a digest names bytes:
    two spellings of the same JSON would be two blobs)."""

    def put(self, data: bytes) -> str:
        raise NotImplementedError

    def get(self, digest: str) -> bytes:
        raise NotImplementedError

    def put_text(self, text: str) -> str:
        return self.put(text.encode("utf-8"))

    def get_text(self, digest: str) -> str:
        return self.get(digest).decode("utf-8")

    def put_json(self, value: Any) -> str:
        return self.put(json.dumps(value, sort_keys=True, separators=(",", ":")).encode("utf-8"))

    def get_json(self, digest: str) -> Any:
        return json.loads(self.get(digest))


WRITE_SKIP_S = 600.0
"""A put of a blob this process wrote or read this recently skips the backend: the blob is
there. Older ones are written again, which refreshes their time for retention (gc.py sweeps
only blobs unnamed for longer than its grace, which is far longer than this)."""

CACHED_BYTES = 1_000_000  # larger blobs are not kept in the read cache


@dataclass(frozen=True)
class Stored:
    """What a streamed put stored: the address and the size in bytes."""

    digest: str
    size: int


class BlobStore(TypedBlobs):
    """Typed access plus a small read cache (safe: content never changes under a digest)."""

    def __init__(
        self,
        backend: BlobBackend,
        cache_entries: int = 4096,
        where: str = "",
        keyring: Keyring | None = None,
        parallel: int = 2,
    ) -> None:
        self.backend = backend
        self.where = where  # for errors: the store and the setting that chose it
        # With DRLM_ENCRYPTION_KEYS, blobs are sealed as they are stored (the address stays
        # that of the clear content); blobs stored in the clear are still read.
        self.keyring = keyring
        self.parallel = parallel  # chunks written or read ahead at once (each one held)
        self._cache: OrderedDict[str, tuple[bytes, float]] = OrderedDict()
        self._cache_entries = cache_entries

    def _stored(self, digest: str, data: Data) -> Data:
        return self.keyring.seal(digest, bytes(data)) if self.keyring is not None else data

    def recently_stored(self, digest: str) -> bool:
        """Whether this process wrote the blob lately: a put may skip the backend. (A blob only
        read lately is written again: its write is what keeps it young for retention.)"""
        entry = self._cache.get(digest)
        return entry is not None and time.monotonic() - entry[1] < WRITE_SKIP_S

    # --- writing ----------------------------------------------------------------------------

    def put(self, data: bytes) -> str:
        if len(data) > CHUNK_BYTES:
            return self.put_stream([data]).digest
        digest = raw_digest(data)
        if not self.recently_stored(digest):
            self.backend.write(digest, self._stored(digest, data))
            self._remember(digest, data)
        return digest

    def put_stream(self, pieces: Iterable[Data]) -> Stored:
        """Store a stream of any length, holding a few chunks at most: each chunk is hashed
        and written as it fills (up to `parallel` writes in flight), the manifest last, so a
        manifest never names a chunk that is not stored. A stream of one chunk or less is
        stored as a plain blob."""
        written: list[Future[tuple[str, int]]] = []
        first: bytes | None = None
        with ThreadPoolExecutor(max_workers=self.parallel, thread_name_prefix="blob-put") as pool:

            def store(chunk: bytes) -> tuple[str, int]:
                digest = raw_digest(chunk)  # hashed here, beside the next chunk's making
                self.backend.write(digest, self._stored(digest, chunk))
                return digest, len(chunk)

            def write(chunk: bytes) -> None:
                while sum(not f.done() for f in written) >= self.parallel:
                    next(f for f in written if not f.done()).result()
                written.append(pool.submit(store, chunk))

            for chunk in rechunk(pieces):
                if first is None and not written:
                    first = chunk  # held until a second one shows the stream is large
                    continue
                if first is not None:
                    write(first)
                    first = None
                write(chunk)
            chunks = [future.result() for future in written]
        if not chunks:
            data = first or b""
            return Stored(self.put(data), len(data))
        manifest = Manifest(sum(n for _, n in chunks), tuple(chunks))
        address = manifest.address
        self.backend.write(address, self._stored(address, manifest.encode()))
        return Stored(address, manifest.size)

    def put_many(self, blobs: list[bytes]) -> list[str]:
        """Store several blobs in one write; their digests in order."""
        digests: list[str] = []
        fresh: dict[str, bytes] = {}
        for data in blobs:
            if len(data) > CHUNK_BYTES:
                digests.append(self.put_stream([data]).digest)
                continue
            digest = raw_digest(data)
            digests.append(digest)
            if not self.recently_stored(digest):
                fresh[digest] = data
        self.backend.write_many({d: bytes(self._stored(d, data)) for d, data in fresh.items()})
        for digest, data in fresh.items():
            self._remember(digest, data)
        return digests

    def add(self, data: bytes) -> bool:
        """Store `data` unless the backend has it; True when this call stored it. Always asks
        the backend (another process may have stored it): a once-only marker."""
        digest = raw_digest(data)
        added = self.backend.add(digest, bytes(self._stored(digest, data)))
        self._remember(digest, data)
        return added

    def delete(self, digests: Iterable[str], written_before: datetime) -> int:
        """Remove blobs not written (nor named again) since `written_before` (retention)."""
        wanted = list(digests)
        for digest in wanted:
            self._cache.pop(digest, None)
        return self.backend.delete(wanted, written_before)

    def forget(self, digest: str, keep: Iterable[str] = ()) -> int:
        """Remove one blob its owner will not read again (a snapshot an episode's quota
        replaced) and, for a large one, its chunks that no blob in `keep` names (consecutive
        snapshots of one namespace share most of their chunks). A digest names content: a
        blob another episode made alike goes too, and that episode then rebuilds its REPL by
        running its cells again. The number of stored objects removed."""
        doomed = [digest]
        manifest = self.manifest(digest) if is_manifest(digest) and self.holds(digest) else None
        if manifest is not None:
            kept: set[str] = set()
            for other in keep:
                other_manifest = self.manifest(other) if is_manifest(other) and self.holds(other) else None
                if other_manifest is not None:
                    kept.update(chunk for chunk, _ in other_manifest.chunks)
            doomed.extend(chunk for chunk, _ in manifest.chunks if chunk not in kept)
        return self.delete(doomed, written_before=datetime.max.replace(tzinfo=UTC))

    def holds(self, digest: str) -> bool:
        """Does the store hold this blob? (Read whole: for small blobs and markers.)"""
        return digest in self._cache or self.backend.read(digest) is not None

    # --- reading ----------------------------------------------------------------------------

    def cached(self, digest: str) -> bytes | None:
        """The blob if this process holds it in memory (no I/O, so no thread hop needed)."""
        entry = self._cache.get(digest)
        return None if entry is None else entry[0]

    def _read_raw(self, digest: str, size: int | None = None, within: str | None = None) -> bytes:
        stored = self.backend.read(digest)
        if stored is None:
            raise BlobNotFound(digest if within is None else f"{digest} (a chunk of {within})", self.where)
        data = open_blob(self.keyring, digest, stored)
        if raw_digest(data) != digest or (size is not None and len(data) != size):
            what = f"chunk {digest} of {within}" if within else f"blob {digest}"
            raise CorruptBlob(f"{what} is corrupt: its {len(data):,} bytes do not hash to its digest")
        return data

    def manifest(self, digest: str) -> Manifest | None:
        """The manifest a `sha256m:` address names (None for a plain blob)."""
        if not is_manifest(digest):
            split_digest(digest)
            return None
        stored = self.backend.read(digest)
        if stored is None:
            raise BlobNotFound(digest, self.where)
        return Manifest.decode(digest, open_blob(self.keyring, digest, stored))

    def get(self, digest: str) -> bytes:
        """The whole blob in memory: for payloads and logs. Contexts are read with `chunks`."""
        entry = self._cache.get(digest)
        if entry is not None:
            self._cache.move_to_end(digest)
            return entry[0]
        data = b"".join(self.chunks(digest)) if is_manifest(digest) else self._read_raw(digest)
        self._remember(digest, data, written=False)
        return data

    def chunks(self, digest: str) -> Generator[bytes, None, None]:
        """The blob as a stream of checked chunks, reading up to `parallel` ahead."""
        manifest = self.manifest(digest)
        if manifest is None:
            yield self.get(digest)
            return
        parts = list(manifest.chunks)
        pool = ThreadPoolExecutor(max_workers=self.parallel, thread_name_prefix="blob-get")
        ahead: deque[Future[bytes]] = deque()
        try:
            for index in range(len(parts)):
                while len(ahead) < self.parallel and index + len(ahead) < len(parts):
                    part, size = parts[index + len(ahead)]
                    ahead.append(pool.submit(self._read_raw, part, size, digest))
                yield ahead.popleft().result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def size(self, digest: str) -> int:
        manifest = self.manifest(digest)
        return manifest.size if manifest is not None else len(self.get(digest))

    def head(self, digest: str, limit: int) -> bytes:
        """The first `limit` bytes (a preview), reading only the chunks they are in."""
        out = bytearray()
        stream = self.chunks(digest)
        try:
            for chunk in stream:
                out += chunk[: limit - len(out)]
                if len(out) >= limit:
                    break
        finally:
            stream.close()
        return bytes(out)

    def check(self, digest: str) -> int:
        """Read the whole blob, chunk by chunk, keeping none: its size if every chunk and
        the manifest are whole; BlobNotFound or CorruptBlob naming the first that is not."""
        return sum(len(chunk) for chunk in self.chunks(digest))

    def _remember(self, digest: str, data: bytes, written: bool = True) -> None:
        if len(data) > CACHED_BYTES:
            return
        previous = self._cache.get(digest)
        if written:
            when = time.monotonic()
        else:  # a read keeps the time of this process's last write, if any
            when = previous[1] if previous is not None else -WRITE_SKIP_S
        self._cache[digest] = (data, when)
        self._cache.move_to_end(digest)
        while len(self._cache) > self._cache_entries:
            self._cache.popitem(last=False)


class BlobBatch(TypedBlobs):
    """A step's writes, held in memory and stored in one transaction by `flush` (before the
    step's result, which names them, leaves the worker). Reads see the held blobs first."""

    def __init__(self, store: BlobStore) -> None:
        self.store = store
        self._held: dict[str, bytes] = {}

    def put(self, data: bytes) -> str:
        if len(data) > CHUNK_BYTES:
            return self.store.put(data)  # stored now, as chunks: never held whole for a flush
        digest = digest_of(data)
        if not self.store.recently_stored(digest):
            self._held[digest] = data
        return digest

    def get(self, digest: str) -> bytes:
        held = self._held.get(digest)
        return held if held is not None else self.store.get(digest)

    def flush(self) -> int:
        held, self._held = self._held, {}
        self.store.put_many(list(held.values()))
        return len(held)
