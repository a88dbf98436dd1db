"""Reading the SQL store by plain SQL, with or without SQLAlchemy.

`drlm show` of an ended episode and `drlm list` answer from the store in a new process each
time, and importing SQLAlchemy alone cost them ~0.17 s of their 0.35 s budget
(docs/architecture/decisions.md#start-up-pays-only-for-what-it-uses). So a SQLite file is
read with the standard library's `sqlite3` (opened without creating it; no statement can
write: `query_only`, though closing may checkpoint the WAL into the file, as any SQLite
connection's close does), and any other store through SQLAlchemy's engine
(`store.sql.EngineReader`). Both run the same SQL text: the queries exist once
(`audit/readonly.py`); only how they are run differs.

Rows come back as SQLAlchemy's do where they are used: attributes and `_mapping`, and the
columns a query names as date-times parsed to `datetime` (naive, in UTC, as SQLAlchemy's
SQLite dialect returns them), whichever reader ran it.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Collection, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from durable_rlm.store.urls import sqlite_file


class StoredRow:
    """One result row: its columns as attributes and as `_mapping` (as a SQLAlchemy Row)."""

    __slots__ = ("_mapping",)

    def __init__(self, mapping: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_mapping", dict(mapping))

    def __getattr__(self, name: str) -> Any:
        try:
            return self._mapping[name]
        except KeyError:
            raise AttributeError(name) from None

    def __iter__(self) -> Iterator[Any]:
        return iter(self._mapping.values())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StoredRow) and self._mapping == other._mapping

    __hash__ = None  # type: ignore[assignment]  # equal by value, so never a key (Python's rule)

    def __repr__(self) -> str:
        return f"StoredRow({self._mapping!r})"


class Reader(Protocol):
    """What the store's read-only queries need of a connection to it."""

    errors: tuple[type[Exception], ...]
    """The database's errors (no such table or column in an older schema): a reader's
    caller catches these (`except reader.errors`) without importing its driver."""

    def rows(
        self, sql: str, params: Mapping[str, Any] | None = None, datetimes: Collection[str] = ()
    ) -> list[Any]:
        """The rows `sql` (with `:name` parameters) gives; the columns in `datetimes` parsed."""
        ...

    def columns(self, table: str) -> set[str]:
        """The table's column names in the store as it is (empty: no such table)."""
        ...

    def close(self) -> None: ...


class SqliteReader:
    """A SQLite store file read with the standard library alone."""

    errors: tuple[type[Exception], ...] = (sqlite3.DatabaseError,)

    def __init__(self, path: Path) -> None:
        # mode=rw: a missing file is an error, never an empty new store (mode=ro cannot open
        # a WAL store whose -shm is missing); query_only: no statement can write. timeout: a
        # writer's transaction is waited for as store/sql.py's engines wait (30 s).
        self._conn = sqlite3.connect(f"{path.absolute().as_uri()}?mode=rw", uri=True, timeout=30)
        self._conn.execute("PRAGMA query_only = ON")

    def rows(
        self, sql: str, params: Mapping[str, Any] | None = None, datetimes: Collection[str] = ()
    ) -> list[Any]:
        bound = {k: sqlite_datetime(v) if isinstance(v, datetime) else v for k, v in (params or {}).items()}
        cursor = self._conn.execute(sql, bound)
        names = [d[0] for d in cursor.description]
        parse = [name in datetimes for name in names]
        return [
            StoredRow(
                {
                    name: parsed_datetime(value) if wanted else value
                    for name, value, wanted in zip(names, values, parse, strict=True)
                }
            )
            for values in cursor.fetchall()
        ]

    def columns(self, table: str) -> set[str]:
        if not table.isidentifier():
            raise ValueError(f"not a table name: {table!r}")
        try:
            return {row[1] for row in self._conn.execute(f'PRAGMA table_info("{table}")')}
        except sqlite3.DatabaseError:
            return set()

    def close(self) -> None:
        self._conn.close()


def sqlite_datetime(value: datetime) -> str:
    """A date-time as SQLAlchemy's SQLite dialect stores and compares it (UTC digits, no zone)."""
    if value.tzinfo is not None:
        value = value.astimezone(UTC)
    return value.strftime("%Y-%m-%d %H:%M:%S.%f")


def parsed_datetime(value: Any) -> Any:
    """A stored date-time text as a `datetime` (as SQLAlchemy's SQLite dialect reads it)."""
    if isinstance(value, str):
        return datetime.fromisoformat(value)
    return value


def open_reader(url: str) -> Reader | None:
    """A reader of the store at `url` if it exists; nothing is created or migrated."""
    path = sqlite_file(url)
    if path is not None:
        return SqliteReader(path) if path.is_file() else None
    from durable_rlm.store.sql import EngineReader, create_engine  # start-up: SQLAlchemy (~0.17 s)

    return EngineReader(create_engine(url))


def as_reader(source: Any) -> Reader:
    """A reader as given, or one over a SQLAlchemy engine (a worker's, the episode page's)."""
    if hasattr(source, "rows") and hasattr(source, "errors"):
        return source
    from durable_rlm.store.sql import EngineReader  # start-up: SQLAlchemy, which an engine's owner has

    return EngineReader(source)
