"""Blobs of any size: content-addressed chunks of bounded size, named together by a manifest.

A blob of at most `CHUNK_BYTES` is stored as it is, under `sha256:<hex of its bytes>`. A larger
one is cut into chunks of `CHUNK_BYTES` (the last one shorter), each stored as such a blob,
and a manifest lists them; the blob's address is `sha256m:<hex of the manifest>`. So:

- no store ever holds a row, file or object larger than a chunk (SQLite refuses a value over
  1,000,000,000 bytes; a PostgreSQL bytea stops at 1 GB; one S3 PUT at 5 GB);
- a writer hashes each chunk as it streams and never holds more than a chunk or two; a
  reader checks each chunk against its digest as it streams, and the manifest against the
  address, which together prove the whole value, with one hash over the bytes either way;
- the two forms cannot be confused: the prefix of the address says which one a reader
  holds, so stored bytes that merely look like a manifest are read as the bytes they are.

The chunk size is part of every manifest's address: changing it would give new values new
addresses (old ones still read), so it is fixed here for every store.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

CHUNK_BYTES = 16 * 1024 * 1024
"""The most bytes a stored blob holds: big enough that a chunk costs one round trip per 16 MB
(an S3 multipart upload of two parts), small enough that a writer and a reader each hold a
few at once."""

RAW = "sha256:"
MANIFEST = "sha256m:"
MANIFEST_MAGIC = b"drlm-manifest/1\n"
MAX_MANIFEST_CHUNKS = 16_000_000  # 256 TB: a bound on what a reader parses, not on the disk


class CorruptBlob(ValueError):
    """Stored bytes that are not what their address says (a chunk, a manifest, a raw blob)."""


def split_digest(digest: str) -> tuple[str, str]:
    """(prefix, hex) of a well-formed address; ValueError otherwise."""
    for prefix in (RAW, MANIFEST):
        if digest.startswith(prefix):
            hexpart = digest[len(prefix) :]
            if len(hexpart) == 64 and all(c in "0123456789abcdef" for c in hexpart):
                return prefix, hexpart
    raise ValueError(f"malformed blob digest {digest!r}")


def is_manifest(digest: str) -> bool:
    return digest.startswith(MANIFEST)


def raw_digest(data: bytes | bytearray | memoryview) -> str:
    return RAW + hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Manifest:
    """A large blob: its size and its chunks (digest, size) in order."""

    size: int
    chunks: tuple[tuple[str, int], ...]

    def encode(self) -> bytes:
        body = {"size": self.size, "chunk_bytes": CHUNK_BYTES, "chunks": [list(c) for c in self.chunks]}
        return MANIFEST_MAGIC + json.dumps(body, separators=(",", ":")).encode("ascii")

    @property
    def address(self) -> str:
        return MANIFEST + hashlib.sha256(self.encode()).hexdigest()

    @classmethod
    def decode(cls, digest: str, data: bytes) -> Manifest:
        """The manifest stored under `digest`, checked against it and for its shape."""
        if MANIFEST + hashlib.sha256(data).hexdigest() != digest:
            raise CorruptBlob(f"manifest {digest}: its {len(data):,} bytes do not hash to its address")
        if not data.startswith(MANIFEST_MAGIC):
            raise CorruptBlob(f"manifest {digest} does not start as a manifest")
        try:
            body = json.loads(data[len(MANIFEST_MAGIC) :])
            chunks = tuple((str(d), int(n)) for d, n in body["chunks"])
            size = int(body["size"])
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptBlob(f"manifest {digest} cannot be parsed: {exc}") from None
        if len(chunks) > MAX_MANIFEST_CHUNKS or sum(n for _, n in chunks) != size:
            raise CorruptBlob(f"manifest {digest}: its chunks do not add up to its size {size:,}")
        for chunk, n in chunks:
            if not chunk.startswith(RAW) or not 0 < n <= CHUNK_BYTES:
                raise CorruptBlob(f"manifest {digest} names a bad chunk {chunk!r} of {n} bytes")
            split_digest(chunk)
        return cls(size, chunks)


def address_of(data: bytes | bytearray | memoryview) -> str:
    """The address `BlobStore.put(data)` gives `data` (computed without a store)."""
    view = memoryview(data)
    if len(view) <= CHUNK_BYTES:
        return raw_digest(view)
    return Manifest(len(view), tuple((raw_digest(c), len(c)) for c in cut(view))).address


def cut(view: memoryview) -> Iterator[memoryview]:
    for start in range(0, len(view), CHUNK_BYTES):
        yield view[start : start + CHUNK_BYTES]


def rechunk(pieces: Iterable[bytes | bytearray | memoryview]) -> Iterator[bytes]:
    """Pieces of any sizes as chunks of exactly CHUNK_BYTES (the last one shorter, and none
    for an empty stream): what a streaming writer stores, holding at most one chunk."""
    buffer = bytearray()
    for piece in pieces:
        view = memoryview(piece).cast("B")
        if not buffer and len(view) == CHUNK_BYTES:
            yield bytes(view)  # the common case of a file read chunk by chunk: no extra copy
            continue
        while view:
            take = CHUNK_BYTES - len(buffer)
            buffer += view[:take]
            view = view[take:]
            if len(buffer) == CHUNK_BYTES:
                yield bytes(buffer)
                buffer.clear()
    if buffer:
        yield bytes(buffer)
