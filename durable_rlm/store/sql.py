"""The SQL store (SQLite by default, PostgreSQL in production): engine and migrations."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.resources
import os
import re
import socket
from collections.abc import Collection, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from durable_rlm.errors import ConfigurationError
from durable_rlm.store import schema
from durable_rlm.store.urls import sqlite_file

MIGRATIONS_DIR = Path(
    str(importlib.resources.files("durable_rlm.migrations"))
)  # the wheel's or the checkout's


def create_engine(url: str) -> sa.Engine:
    if url.startswith("sqlite"):
        engine = sa.create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

        @sa.event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
            # WAL lets the CLI, workers and tests share one file without blocking readers.
            cursor = dbapi_connection.cursor()
            # Set only where the file is new (it is fixed once WAL is on): a blob's chunk of
            # 16 MB is 256 pages of 64 KB instead of 4,096 of 4 KB, which wrote 1.2 GB of
            # chunks twice as fast and read them back five times as fast here.
            cursor.execute("PRAGMA page_size=65536")
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.close()

        return engine
    return sa.create_engine(url, pool_pre_ping=True)


DATETIME = sa.DateTime(timezone=True)  # as store/schema.py's date-time columns


class EngineReader:
    """store/reading.py's reader over a SQLAlchemy engine (PostgreSQL, a worker's engine):
    the same SQL text as the stdlib SQLite reader, date-times typed as the schema types them."""

    errors: tuple[type[Exception], ...] = (sa.exc.DatabaseError,)

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine

    def rows(
        self, sql: str, params: Mapping[str, Any] | None = None, datetimes: Collection[str] = ()
    ) -> list[Any]:
        # Aware date-times in UTC, as the SQLite reader binds them (SQLAlchemy's SQLite
        # dialect would drop another offset's zone and compare the local digits).
        params = {
            k: v.astimezone(UTC) if isinstance(v, datetime) and v.tzinfo is not None else v
            for k, v in (params or {}).items()
        }
        statement: Any = sa.text(sql).bindparams(
            *(sa.bindparam(k, type_=DATETIME) for k, v in params.items() if isinstance(v, datetime))
        )
        if datetimes:
            statement = statement.columns(**dict.fromkeys(datetimes, DATETIME))
        with self.engine.connect() as conn:
            return list(conn.execute(statement, params).all())

    def columns(self, table: str) -> set[str]:
        try:
            return {column["name"] for column in sa.inspect(self.engine).get_columns(table)}
        except (sa.exc.DatabaseError, sa.exc.NoSuchTableError):
            return set()

    def close(self) -> None:
        self.engine.dispose()


def alembic_config(engine: sa.Engine) -> Any:
    from alembic.config import Config  # start-up: alembic 0.12 s; readers (drlm list) skip it

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # Escaped: the option goes through configparser's interpolation, where a `%` (a data
    # directory's name, a password, an escaped path) would stop every migration.
    url = engine.url.render_as_string(hide_password=False)
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


MIGRATION_LOCK_KEY = 0x64726C6D  # "drlm": PostgreSQL advisory lock held while migrating


def migrate(engine: sa.Engine, revision: str = "head") -> None:
    """Upgrade the schema; processes starting at once (two `drlm run`, a worker) take turns
    instead of racing to create the same tables."""
    with _migration_lock(engine), engine.begin() as connection:
        if connection.dialect.name == "postgresql":
            connection.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
        config = alembic_config(engine)
        config.attributes["connection"] = connection
        from alembic import command  # start-up: alembic, as alembic_config's

        command.upgrade(config, revision)


@contextlib.contextmanager
def _migration_lock(engine: sa.Engine) -> Iterator[None]:
    database = engine.url.database if engine.url.get_backend_name() == "sqlite" else None
    if not database or database == ":memory:":
        yield
        return
    with open(f"{database}.migrate.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def downgrade(engine: sa.Engine, revision: str = "base") -> None:
    with engine.begin() as connection:
        config = alembic_config(engine)
        config.attributes["connection"] = connection
        from alembic import command  # start-up: alembic, as alembic_config's

        command.downgrade(config, revision)


def open_store(url: str) -> sa.Engine:
    """An engine on a migrated database; creates the SQLite file's folder if needed. A
    database at the newest revision already is not handed to alembic: importing it and
    reading the migrations costs a one-off program ~0.15 s."""
    path = sqlite_file(url)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url)
    if not at_head(engine):
        migrate(engine)
    return engine


_REVISION = re.compile(r"^(down_)?revision\s*=\s*['\"]([^'\"]+)['\"]", re.MULTILINE)


def head_revision() -> str | None:
    """The newest migration's revision, read from the migration files as alembic writes them
    (the one revision no other names as its down_revision); None when that is not one."""
    revisions: set[str] = set()
    parents: set[str] = set()
    for path in (MIGRATIONS_DIR / "versions").glob("*.py"):
        for down, revision in _REVISION.findall(path.read_text(encoding="utf-8")):
            (parents if down else revisions).add(revision)
    heads = revisions - parents
    return heads.pop() if len(heads) == 1 else None


def at_head(engine: sa.Engine) -> bool:
    """The database records the newest revision (alembic's version table), nothing else."""
    head = head_revision()
    if head is None:
        return False
    try:
        with engine.connect() as connection:
            recorded = [
                row[0] for row in connection.execute(sa.text("SELECT version_num FROM alembic_version"))
            ]
    except sa.exc.DatabaseError:  # no version table yet: a new database
        return False
    return recorded == [head]


class StoreMismatch(ConfigurationError):
    """This process would keep blobs somewhere the store's other processes do not look."""


def agree_on_blob_store(engine: sa.Engine, blob_store: str) -> None:
    """Refuse a process whose blob store differs from the one the SQL store has recorded:
    episodes it started would hold digests of blobs no other worker can read (stranded).
    The first process to use a store records its choice. `blob_store` is "sql", a resolved
    directory, or an object store's URL (Settings.blob_store_name)."""
    table = schema.store_facts
    if blob_store == "sql" or blob_store.startswith("s3://"):
        here = blob_store
    else:
        here = f"directory {Path(blob_store).resolve()}"
    who = f"{socket.gethostname()} pid {os.getpid()}"
    with engine.begin() as conn:
        known = conn.execute(sa.select(table).where(table.c.name == "blob_store")).mappings().first()
        if known is None:
            try:
                with conn.begin_nested():
                    conn.execute(table.insert().values(name="blob_store", value=here, recorded_by=who))
                return
            except sa.exc.IntegrityError:  # another process recorded it first: compare with that
                known = conn.execute(sa.select(table).where(table.c.name == "blob_store")).mappings().one()
    if known["value"] != here:
        where = "the SQL store's blobs table" if known["value"] == "sql" else known["value"]
        mine = "the SQL store's blobs table" if here == "sql" else here
        raise StoreMismatch(
            f"this store's blobs live in {where} (recorded by {known['recorded_by']}), but this "
            f"process would keep them in {mine} (DRLM_BLOB_STORE): episodes it started would "
            "hold blobs no other worker can read. Use the same DRLM_BLOB_STORE everywhere"
        )
