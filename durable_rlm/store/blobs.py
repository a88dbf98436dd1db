"""Content-addressed blob store: the claim-check side of every large payload.

Digests are `sha256:<hex>` of the bytes, so a put is idempotent and a get can verify what it
read. Two backends: a directory (simple, local) and a SQL table (default; shared by every
worker that reaches the same database).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Protocol

import sqlalchemy as sa

from durable_rlm.store import schema
from durable_rlm.store.encryption import Keyring, open_blob


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
    return "sha256:" + hashlib.sha256(data).hexdigest()


def text_digest(text: str) -> str:
    return digest_of(text.encode("utf-8"))


def _check_digest(digest: str) -> str:
    prefix, _, hexpart = digest.partition(":")
    if prefix != "sha256" or len(hexpart) != 64 or not all(c in "0123456789abcdef" for c in hexpart):
        raise ValueError(f"malformed blob digest {digest!r}")
    return hexpart


class BlobBackend(Protocol):
    def write(self, digest: str, data: bytes) -> None: ...
    def write_many(self, items: dict[str, bytes]) -> None: ...
    def add(self, digest: str, data: bytes) -> bool: ...
    def read(self, digest: str) -> bytes | None: ...
    def delete(self, digest: str) -> bool: ...


class DirectoryBackend:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)

    def _path(self, digest: str) -> Path:
        hexpart = _check_digest(digest)
        return self.root / hexpart[:2] / hexpart

    def write(self, digest: str, data: bytes) -> None:
        path = self._path(digest)
        if path.exists():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)

    def write_many(self, items: dict[str, bytes]) -> None:
        for digest, data in items.items():
            self.write(digest, data)

    def add(self, digest: str, data: bytes) -> bool:
        """Store unless present; True when this call stored it (an exclusive create)."""
        path = self._path(digest)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(path, "xb") as handle:
                handle.write(data)
        except FileExistsError:
            return False
        return True

    def read(self, digest: str) -> bytes | None:
        path = self._path(digest)
        return path.read_bytes() if path.exists() else None

    def delete(self, digest: str) -> bool:
        try:
            self._path(digest).unlink()
        except FileNotFoundError:
            return False
        return True


class SqlBackend:
    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine

    def write(self, digest: str, data: bytes) -> None:
        _check_digest(digest)
        with self.engine.begin() as conn:
            exists = conn.execute(
                sa.select(schema.blobs.c.digest).where(schema.blobs.c.digest == digest)
            ).first()
            if exists is None:
                try:
                    conn.execute(schema.blobs.insert().values(digest=digest, size=len(data), data=data))
                except sa.exc.IntegrityError:
                    pass  # a concurrent writer stored the same bytes

    def write_many(self, items: dict[str, bytes]) -> None:
        """One transaction for a step's blobs: each commit costs more than the rows."""
        if not items:
            return
        for digest in items:
            _check_digest(digest)
        try:
            with self.engine.begin() as conn:
                present = set(
                    conn.execute(
                        sa.select(schema.blobs.c.digest).where(schema.blobs.c.digest.in_(list(items)))
                    ).scalars()
                )
                rows = [
                    {"digest": d, "size": len(data), "data": data}
                    for d, data in items.items()
                    if d not in present
                ]
                if rows:
                    conn.execute(schema.blobs.insert(), rows)
        except sa.exc.IntegrityError:
            for d, data in items.items():
                self.write(d, data)  # a concurrent writer stored some of them: one by one

    def add(self, digest: str, data: bytes) -> bool:
        """Store unless present; True when this call stored it (one insert, no read)."""
        _check_digest(digest)
        try:
            with self.engine.begin() as conn:
                conn.execute(schema.blobs.insert().values(digest=digest, size=len(data), data=data))
        except sa.exc.IntegrityError:
            return False
        return True

    def read(self, digest: str) -> bytes | None:
        _check_digest(digest)
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(schema.blobs.c.data).where(schema.blobs.c.digest == digest)).first()
        return None if row is None else bytes(row[0])

    def delete(self, digest: str) -> bool:
        _check_digest(digest)
        with self.engine.begin() as conn:
            done = conn.execute(schema.blobs.delete().where(schema.blobs.c.digest == digest))
        return bool(done.rowcount)


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


class BlobStore(TypedBlobs):
    """Typed access plus a small read cache (safe: content never changes under a digest)."""

    def __init__(
        self, backend: BlobBackend, cache_entries: int = 4096, where: str = "", keyring: Keyring | None = None
    ) -> None:
        self.backend = backend
        self.where = where  # for errors: the store and the setting that chose it
        # With DRLM_ENCRYPTION_KEYS, blobs are sealed as they are stored (the address stays
        # the digest of the clear content); blobs stored in the clear are still read.
        self.keyring = keyring
        self._cache: OrderedDict[str, bytes] = OrderedDict()
        self._cache_entries = cache_entries

    def _stored(self, digest: str, data: bytes) -> bytes:
        return self.keyring.seal(digest, data) if self.keyring is not None else data

    def put(self, data: bytes) -> str:
        digest = digest_of(data)
        if digest not in self._cache:
            self.backend.write(digest, self._stored(digest, data))
            self._remember(digest, data)
        return digest

    def cached(self, digest: str) -> bytes | None:
        """The blob if this process holds it in memory (no I/O, so no thread hop needed)."""
        return self._cache.get(digest)

    def get(self, digest: str) -> bytes:
        cached = self._cache.get(digest)
        if cached is not None:
            self._cache.move_to_end(digest)
            return cached
        stored = self.backend.read(digest)
        if stored is None:
            raise BlobNotFound(digest, self.where)
        data = open_blob(self.keyring, digest, stored)
        if digest_of(data) != digest:
            raise ValueError(f"blob {digest} is corrupt")
        self._remember(digest, data)
        return data

    def put_many(self, blobs: list[bytes]) -> list[str]:
        """Store several blobs in one write; their digests in order."""
        digests = [digest_of(data) for data in blobs]
        fresh = {d: data for d, data in zip(digests, blobs, strict=True) if d not in self._cache}
        self.backend.write_many({d: self._stored(d, data) for d, data in fresh.items()})
        for digest, data in fresh.items():
            self._remember(digest, data)
        return digests

    def delete(self, digest: str) -> bool:
        """Remove a blob nothing will read again (a snapshot the episode's quota replaced);
        True when the store held it. Only for blobs of one owner: a digest names content, and
        content two episodes made alike is one blob."""
        self._cache.pop(digest, None)
        return self.backend.delete(digest)

    def holds(self, digest: str) -> bool:
        """Does the store hold this blob? (Read whole: for small blobs, markers.)"""
        return digest in self._cache or self.backend.read(digest) is not None

    def add(self, data: bytes) -> bool:
        """Store `data` unless the backend has it; True when this call stored it. Always asks
        the backend (another process may have stored it): a once-only marker."""
        digest = digest_of(data)
        added = self.backend.add(digest, self._stored(digest, data))
        self._remember(digest, data)
        return added

    def _remember(self, digest: str, data: bytes) -> None:
        if len(data) > 1_000_000:
            return
        self._cache[digest] = data
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
        digest = digest_of(data)
        if self.store.cached(digest) is None:
            self._held[digest] = data
        return digest

    def get(self, digest: str) -> bytes:
        held = self._held.get(digest)
        return held if held is not None else self.store.get(digest)

    def flush(self) -> int:
        held, self._held = self._held, {}
        self.store.put_many(list(held.values()))
        return len(held)
