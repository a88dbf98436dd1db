"""Where blobs are kept: a directory, or the SQL store's `blobs` table (the S3-compatible
object store is in s3.py). Each keeps bytes under an address and knows nothing of chunks,
manifests or seals (blobs.py and chunks.py): a backend never holds more than one chunk.

Every backend also answers what retention needs (gc.py): which blobs it holds, since when,
and deletes some. A write of a blob already there refreshes its time, so a blob that a new
episode is about to name again is never one an old sweep still counts as unreferenced.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

import sqlalchemy as sa

from durable_rlm.store import schema
from durable_rlm.store.chunks import MANIFEST, RAW, split_digest

Data = bytes | bytearray | memoryview


@dataclass(frozen=True)
class StoredBlob:
    """One blob as the backend lists it (for retention)."""

    digest: str
    size: int
    written_at: datetime


class BlobBackend(Protocol):
    def write(self, digest: str, data: Data) -> None: ...
    def write_many(self, items: dict[str, bytes]) -> None: ...
    def add(self, digest: str, data: bytes) -> bool: ...
    def read(self, digest: str) -> bytes | None: ...
    def listing(self) -> Iterator[StoredBlob]: ...
    def delete(self, digests: Iterable[str], written_before: datetime) -> int: ...
    def describe(self) -> str: ...


class DirectoryBackend:
    """One file per blob, `<root>/<2 hex>/<hex>` (manifests under `<root>/m/`): a local disk
    or a directory every worker mounts."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)

    def describe(self) -> str:
        return f"the blob directory {self.root}"

    def _path(self, digest: str) -> Path:
        prefix, hexpart = split_digest(digest)
        base = self.root / "m" if prefix == MANIFEST else self.root
        return base / hexpart[:2] / hexpart

    def write(self, digest: str, data: Data) -> None:
        path = self._path(digest)
        if path.exists():
            with contextlib.suppress(OSError):
                os.utime(path)  # named again: young for retention
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

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
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None

    def listing(self) -> Iterator[StoredBlob]:
        for prefix, base in ((RAW, self.root), (MANIFEST, self.root / "m")):
            if not base.is_dir():
                continue
            for folder in os.scandir(base):
                if len(folder.name) != 2 or not folder.is_dir(follow_symlinks=False):
                    continue
                for entry in os.scandir(folder.path):
                    if len(entry.name) != 64 or not entry.is_file(follow_symlinks=False):
                        continue  # a writer's temporary file, or something not ours
                    info = entry.stat(follow_symlinks=False)
                    when = datetime.fromtimestamp(info.st_mtime, UTC)
                    yield StoredBlob(prefix + entry.name, info.st_size, when)

    def delete(self, digests: Iterable[str], written_before: datetime) -> int:
        deleted = 0
        cutoff = written_before.timestamp()
        for digest in digests:
            path = self._path(digest)
            try:
                if os.stat(path, follow_symlinks=False).st_mtime >= cutoff:
                    continue  # written (or named again) since the sweep listed it
                os.unlink(path)
                deleted += 1
            except FileNotFoundError:
                continue
        return deleted


class SqlBackend:
    """Rows of the SQL store's `blobs` table: every worker that reaches the database shares
    them, with nothing more to run."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine

    def describe(self) -> str:
        return "the blobs table of " + self.engine.url.render_as_string(hide_password=True)

    def write(self, digest: str, data: Data) -> None:
        split_digest(digest)
        table = schema.blobs
        try:
            with self.engine.begin() as conn:
                # One statement whether or not the row is there: it refreshes an existing
                # row's time (retention); only a missing row is then inserted.
                touched = conn.execute(
                    table.update().where(table.c.digest == digest).values(created_at=sa.func.now())
                ).rowcount
                if not touched:
                    conn.execute(table.insert().values(digest=digest, size=len(data), data=bytes(data)))
        except sa.exc.IntegrityError:
            pass  # a concurrent writer stored the same bytes

    def write_many(self, items: dict[str, bytes]) -> None:
        """One transaction for a step's blobs: each commit costs more than the rows."""
        if not items:
            return
        for digest in items:
            split_digest(digest)
        table = schema.blobs
        try:
            with self.engine.begin() as conn:
                present = set(
                    conn.execute(sa.select(table.c.digest).where(table.c.digest.in_(list(items)))).scalars()
                )
                if present:
                    conn.execute(
                        table.update().where(table.c.digest.in_(present)).values(created_at=sa.func.now())
                    )
                rows = [
                    {"digest": d, "size": len(data), "data": data}
                    for d, data in items.items()
                    if d not in present
                ]
                if rows:
                    conn.execute(table.insert(), rows)
        except sa.exc.IntegrityError:
            for d, data in items.items():
                self.write(d, data)  # a concurrent writer stored some of them: one by one

    def add(self, digest: str, data: bytes) -> bool:
        """Store unless present; True when this call stored it (one insert, no read)."""
        split_digest(digest)
        try:
            with self.engine.begin() as conn:
                conn.execute(schema.blobs.insert().values(digest=digest, size=len(data), data=data))
        except sa.exc.IntegrityError:
            return False
        return True

    def read(self, digest: str) -> bytes | None:
        split_digest(digest)
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(schema.blobs.c.data).where(schema.blobs.c.digest == digest)).first()
        return None if row is None else bytes(row[0])

    def listing(self) -> Iterator[StoredBlob]:
        table = schema.blobs
        query = sa.select(table.c.digest, table.c.size, table.c.created_at).order_by(table.c.digest)
        last = ""
        while True:  # pages by key: no transaction held open across the whole table
            with self.engine.connect() as conn:
                rows = conn.execute(query.where(table.c.digest > last).limit(5_000)).all()
            for digest, size, created in rows:
                when = created if created.tzinfo is not None else created.replace(tzinfo=UTC)
                yield StoredBlob(digest, int(size), when)
            if len(rows) < 5_000:
                return
            last = rows[-1][0]

    def delete(self, digests: Iterable[str], written_before: datetime) -> int:
        table = schema.blobs
        batch: list[str] = []
        deleted = 0

        if written_before.tzinfo is not None:  # SQLite compares the digits: UTC, as now() writes
            written_before = written_before.astimezone(UTC)

        def flush() -> int:
            with self.engine.begin() as conn:
                return conn.execute(
                    table.delete().where(table.c.digest.in_(batch), table.c.created_at < written_before)
                ).rowcount

        for digest in digests:
            batch.append(digest)
            if len(batch) == 500:
                deleted += flush()
                batch = []
        if batch:
            deleted += flush()
        return deleted
