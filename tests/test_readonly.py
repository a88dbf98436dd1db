"""The store's read-only queries (audit/readonly.py) run as SQL text by two readers
(store/reading.py): the standard library's sqlite3 for a SQLite file (`drlm show`/`list`
without SQLAlchemy, issue 36) and SQLAlchemy's engine for any other store. They must give
the same answers: the rows, their order, their types."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import urllib.parse
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from durable_rlm.audit import readonly
from durable_rlm.audit.timeline import Timeline
from durable_rlm.audit.timeline_store import store_timeline
from durable_rlm.settings import Settings
from durable_rlm.store import schema
from durable_rlm.store.reading import SqliteReader, open_reader, sqlite_datetime
from durable_rlm.store.sql import EngineReader, open_store

NOW = datetime(2026, 11, 27, 10, 0, 0, 123456, tzinfo=UTC)
MODELS = ("gpt-4o", "gpt-4o-mini", "local-llama")
STATUSES = ("answered", "failed", "running", "terminated")


def episodes(prefix: str = "") -> list[dict[str, Any]]:
    """Rows with what makes reading hard: no start time, unknown cost, children, a session's
    turns, ids with LIKE's own characters, microseconds and whole seconds."""
    rows: list[dict[str, Any]] = []
    for k in range(24):
        rows.append(
            {
                "episode_id": f"{prefix}ep_{k}%" if k % 7 == 0 else f"{prefix}ep-{k}",
                "status": STATUSES[k % len(STATUSES)],
                "root_model": MODELS[k % 3],
                "sub_model": MODELS[(k + 1) % 3] if k % 2 else None,
                "cost_usd": None if k % 5 == 0 else round(0.37 * k, 4),
                "started_at": None if k % 6 == 0 else NOW - timedelta(hours=5 * k, microseconds=k % 4),
                "parent_id": f"{prefix}ep-{k - 1}" if k % 4 == 3 else None,
                "updated_at": NOW - timedelta(hours=3 * k + 1),  # the order of those without a start
            }
        )
    for turn in range(3):  # a persistent session, and a look-alike without a turn 0
        rows.append({"episode_id": f"{prefix}chat_1-turn{turn}", "started_at": NOW - timedelta(minutes=turn)})
    rows.append({"episode_id": f"{prefix}lone-turn4", "started_at": NOW - timedelta(minutes=9)})
    return rows


def write(engine: sa.Engine, rows: list[dict[str, Any]]) -> None:
    with engine.begin() as conn:
        for row in rows:
            values = {
                "run_id": "r1",
                "task": f"task of {row['episode_id']}",
                "root_model": "gpt-4o",
                "status": "answered",
                "depth": 1 if row.get("parent_id") else 0,
                "updated_at": NOW,
                **row,
            }
            conn.execute(schema.episodes.insert().values(**values))


@pytest.fixture(scope="module")
def sqlite_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, sa.Engine]]:
    path = tmp_path_factory.mktemp("readonly") / "store.sqlite"
    engine = open_store(f"sqlite:///{path}")
    write(engine, episodes())
    yield path, engine
    engine.dispose()


def as_dicts(rows: list[Any]) -> list[Any]:
    return [r.summary() if isinstance(r, readonly.SessionRows) else dict(r._mapping) for r in rows]


def test_the_column_names_are_the_schema_s() -> None:
    """readonly names the columns (no SQLAlchemy to import); the schema is the truth."""
    assert readonly.EPISODE_COLUMNS == [c.name for c in schema.episodes.columns]
    assert set(readonly.EPISODE_DATETIMES) == {
        c.name for c in schema.episodes.columns if isinstance(c.type, sa.DateTime)
    }


filters = st.builds(
    readonly.EpisodeFilter,
    status=st.none() | st.sampled_from(STATUSES),
    model=st.none() | st.sampled_from(MODELS),
    since=st.none() | st.integers(0, 120).map(lambda h: NOW - timedelta(hours=h)),
    until=st.none() | st.integers(0, 120).map(lambda h: NOW - timedelta(hours=h)),
    min_cost=st.none() | st.floats(0, 9, allow_nan=False),
    max_cost=st.none() | st.floats(0, 9, allow_nan=False),
    roots_only=st.booleans(),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=filters, limit=st.integers(1, 40))
def test_both_readers_list_the_same_rows_in_the_same_order(
    sqlite_store: tuple[Path, sa.Engine], where: readonly.EpisodeFilter, limit: int
) -> None:
    path, engine = sqlite_store
    stdlib = SqliteReader(path)
    try:
        ours = readonly.episode_rows(stdlib, limit, where)
        theirs = readonly.episode_rows(engine, limit, where)
        assert as_dicts(ours) == as_dicts(theirs)
        grouped = readonly.grouped_rows(stdlib, limit, where)
        assert as_dicts(grouped) == as_dicts(readonly.grouped_rows(engine, limit, where))
    finally:
        stdlib.close()


def test_rows_read_without_sqlalchemy_have_its_types(sqlite_store: tuple[Path, sa.Engine]) -> None:
    path, engine = sqlite_store
    stdlib = SqliteReader(path)
    rows = readonly.episode_rows(stdlib, 100)
    assert len(rows) == 28
    first = rows[0]
    assert isinstance(first.updated_at, datetime) and first.updated_at.tzinfo is None  # as SQLAlchemy's
    assert [r.episode_id for r in rows] == [r.episode_id for r in readonly.episode_rows(engine, 100)]
    started = [r for r in rows if r.episode_id == "ep-1"][0]
    assert started.started_at == (NOW - timedelta(hours=5, microseconds=1)).replace(tzinfo=None)
    assert isinstance(started.cost_usd, float) and isinstance(started.depth, int)
    with pytest.raises(AttributeError):
        _ = started.no_such_column
    # A session's turns by their ids, LIKE's own characters taken literally.
    turns = [r.episode_id for r in readonly.turn_rows(stdlib, "chat_1")]
    assert turns == [f"chat_1-turn{k}" for k in range(3)]
    assert readonly.turn_rows(stdlib, "chat%") == [] == readonly.turn_rows(engine, "chat%")
    stdlib.close()


def test_a_kept_timeline_is_read_back_by_both_and_a_reset_run_s_is_not(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite"
    engine = open_store(f"sqlite:///{path}")
    write(engine, [{"episode_id": "kept", "run_id": "run-a"}])
    timeline = Timeline(episode_id="kept", status="answered", task="t", runs=1)
    assert store_timeline(engine, timeline, "run-a")
    stdlib = SqliteReader(path)
    assert readonly.cached_timeline(stdlib, "kept") == timeline == readonly.cached_timeline(engine, "kept")
    assert readonly.cached_timeline(stdlib, "other") is None
    with engine.begin() as conn:  # `temporal workflow reset`: the row names a new run
        conn.execute(schema.episodes.update().values(run_id="run-b"))
    assert readonly.cached_timeline(stdlib, "kept") is None is readonly.cached_timeline(engine, "kept")
    stdlib.close()
    engine.dispose()


def test_the_stdlib_reader_never_creates_or_writes_a_store(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "drlm.sqlite"
    assert open_reader(f"sqlite:///{missing}") is None
    assert not missing.parent.exists()
    path = tmp_path / "store.sqlite"
    engine = open_store(f"sqlite:///{path}")
    write(engine, [{"episode_id": "a"}])
    reader = open_reader(f"sqlite:///{path}")
    assert isinstance(reader, SqliteReader)
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        reader.rows("DELETE FROM episodes")
    assert [r.episode_id for r in readonly.episode_rows(reader, 5)] == ["a"]
    reader.close()
    engine.dispose()


def test_a_store_from_before_the_new_columns_lists_and_names_what_it_lacks(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as conn:  # revision 0003's episodes table, in short
        conn.execute(
            "CREATE TABLE episodes (episode_id TEXT PRIMARY KEY, run_id TEXT, task TEXT, root_model TEXT,"
            " status TEXT, updated_at DATETIME)"
        )
        conn.execute("INSERT INTO episodes VALUES ('old', 'r', 't', 'm', 'answered', '2026-01-02 03:04:05')")
    conn.close()
    engine = sa.create_engine(f"sqlite:///{path}")
    for reader in (SqliteReader(path), EngineReader(engine)):
        (row,) = readonly.episode_rows(reader, 5)
        assert (row.episode_id, row.cost_usd, row.updated_at) == ("old", None, datetime(2026, 1, 2, 3, 4, 5))
        with pytest.raises(LookupError, match="older schema .* `drlm list --refresh` migrates it"):
            readonly.episode_rows(reader, 5, readonly.EpisodeFilter(min_cost=1.0))
        assert readonly.cached_timeline(reader, "old") is None  # no timelines table yet
        assert readonly.turn_rows(reader, "old") == []
    assert readonly.episode_rows(SqliteReader(tmp_path / "old.sqlite"), 5) != []
    engine.dispose()


def test_postgres_gives_the_same_rows_as_sqlite(
    postgres_url: str, sqlite_store: tuple[Path, sa.Engine]
) -> None:
    """The same SQL text on PostgreSQL (SQLAlchemy's reader): the same episodes in the same
    order for each filter (its date-times come back with their zone, as timestamptz does)."""
    prefix = f"pg{uuid.uuid4().hex[:6]}-"
    engine = open_store(postgres_url)
    write(engine, episodes(prefix))
    path, _ = sqlite_store
    stdlib = SqliteReader(path)
    reader = open_reader(postgres_url)
    assert isinstance(reader, EngineReader)
    try:
        cases = [
            readonly.EpisodeFilter(),
            readonly.EpisodeFilter(status="answered", model="gpt-4o"),
            readonly.EpisodeFilter(since=NOW - timedelta(hours=40), min_cost=1.0),
            readonly.EpisodeFilter(until=NOW - timedelta(hours=30), roots_only=True, max_cost=8.0),
        ]
        for where in cases:
            ours = [r.episode_id for r in readonly.episode_rows(stdlib, 100, where)]
            theirs = [
                r.episode_id.removeprefix(prefix)
                for r in readonly.episode_rows(reader, 1000, where)
                if r.episode_id.startswith(prefix)
            ]
            assert ours == theirs, where
        turns = readonly.turn_rows(reader, f"{prefix}chat_1")
        assert [r.episode_id for r in turns] == [f"{prefix}chat_1-turn{k}" for k in range(3)]
        assert turns[0].started_at.tzinfo is not None
    finally:
        stdlib.close()
        with engine.begin() as conn:
            conn.execute(schema.episodes.delete().where(schema.episodes.c.episode_id.like(f"{prefix}%")))
        reader.close()
        engine.dispose()


def test_sqlite_date_times_are_bound_as_sqlalchemy_stores_them(tmp_path: Path) -> None:
    engine = open_store(f"sqlite:///{tmp_path / 's.sqlite'}")
    moment = datetime(2026, 3, 4, 5, 6, 7, 890, tzinfo=UTC)
    write(engine, [{"episode_id": "x", "started_at": moment}])
    with engine.connect() as conn:
        stored = conn.exec_driver_sql("SELECT started_at FROM episodes").scalar_one()
    assert sqlite_datetime(moment) == stored
    engine.dispose()


def test_drlm_show_and_list_read_a_sqlite_store_without_sqlalchemy(tmp_path: Path) -> None:
    """What issue 36's 0.35 s needs: neither command imports SQLAlchemy (~0.17 s) or the SDK
    for an ended episode's kept timeline and the list, and both print what is stored."""
    engine = open_store(f"sqlite:///{tmp_path / 'drlm.sqlite'}")
    write(engine, [{"episode_id": "shown", "run_id": "run-a", "answer": "forty-two"}])
    store_timeline(engine, Timeline(episode_id="shown", status="answered", task="the task", runs=1), "run-a")
    engine.dispose()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TEMPORAL_", "DRLM_", "OPENAI_"))}
    env |= {"DRLM_DATA_DIR": str(tmp_path), "COLUMNS": "200"}
    for command, expected in ((["list"], "forty-two"), (["show", "shown"], "the task")):
        out = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "durable_rlm.cli", *command],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        assert expected in out.stdout
        imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if "|" in line}
        assert "sqlite3" in imported  # the probe sees imports: the store was read
        assert not {"sqlalchemy", "temporalio"} & imported, command


def test_both_readers_open_the_same_file_and_bind_zones_alike(tmp_path: Path) -> None:
    """A URL's %-escapes name the file SQLAlchemy opens; a moment with another zone's offset
    is the same instant for both readers."""
    path = tmp_path / "my store%.sqlite"
    url = "sqlite:///" + urllib.parse.quote(str(path))
    engine = open_store(url)
    assert path.is_file()
    earlier = NOW - timedelta(hours=3)
    write(engine, [{"episode_id": "a", "started_at": NOW}, {"episode_id": "b", "started_at": earlier}])
    reader = open_reader(url)
    assert isinstance(reader, SqliteReader)
    paris = timezone(timedelta(hours=2))
    since = (NOW - timedelta(hours=1)).astimezone(paris)  # 1 h ago, written with +02:00
    where = readonly.EpisodeFilter(since=since)
    assert [r.episode_id for r in readonly.episode_rows(reader, 5, where)] == ["a"]
    assert [r.episode_id for r in readonly.episode_rows(engine, 5, where)] == ["a"]
    reader.close()
    engine.dispose()


def test_a_data_directory_with_escapes_in_its_name_holds_its_own_store(tmp_path: Path) -> None:
    """`a%20b` is a name, not `a b`: the store is made, migrated and read where it says."""
    settings = Settings(data_dir=tmp_path / "data a%20b")
    engine = open_store(settings.effective_database_url)
    write(engine, [{"episode_id": "here"}])
    assert (tmp_path / "data a%20b" / "drlm.sqlite").is_file()
    assert not (tmp_path / "data a b").exists()
    reader = readonly.open_existing(settings)
    assert reader is not None and [r.episode_id for r in readonly.episode_rows(reader, 5)] == ["here"]
    reader.close()
    engine.dispose()
