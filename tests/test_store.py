"""The SQL store and blob store on SQLite and on a throwaway PostgreSQL 15 cluster."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from temporalio.api.common.v1 import Payload

from durable_rlm.settings import ConfigurationError, Settings
from durable_rlm.store.blobs import BlobNotFound, BlobStore, DirectoryBackend, SqlBackend, digest_of
from durable_rlm.store.codec import ENCODING, ClaimCheckCodec
from durable_rlm.store.schema import metadata
from durable_rlm.store.sql import create_engine, downgrade, migrate, open_store
from durable_rlm.worker.admission import AdmittingActivitySlots, AdmittingWorkflowSlots

PG_BIN = Path("/usr/lib/postgresql/15/bin")


@pytest.fixture(params=["sqlite", "postgres"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sa.Engine]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    else:
        url = request.getfixturevalue("postgres_url")
    engine = create_engine(url)
    downgrade(engine)
    yield engine
    downgrade(engine)
    engine.dispose()


def test_migrations_go_up_and_down(engine: sa.Engine) -> None:
    migrate(engine)
    assert {"blobs", "episodes"} <= set(sa.inspect(engine).get_table_names())
    downgrade(engine)
    assert not {"blobs", "episodes"} & set(sa.inspect(engine).get_table_names())


def test_migrations_match_the_schema_the_code_uses(engine: sa.Engine) -> None:
    migrate(engine)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), metadata)
    assert diff == []


def test_sql_blob_store_round_trips_and_dedupes(engine: sa.Engine) -> None:
    migrate(engine)
    store = BlobStore(SqlBackend(engine), cache_entries=0)
    data = os.urandom(100_000)
    digest = store.put(data)
    assert store.put(data) == digest == digest_of(data)
    assert store.get(digest) == data
    with engine.connect() as conn:
        assert conn.execute(sa.text("select count(*) from blobs")).scalar() == 1


def test_missing_blob_is_a_clear_error(tmp_path: Path) -> None:
    store = BlobStore(DirectoryBackend(tmp_path))
    with pytest.raises(BlobNotFound):
        store.get(digest_of(b"never stored"))
    with pytest.raises(ValueError, match="malformed"):
        store.get("sha256:../../etc/passwd")


def test_a_corrupt_blob_is_detected(tmp_path: Path) -> None:
    store = BlobStore(DirectoryBackend(tmp_path), cache_entries=0)
    digest = store.put(b"original")
    store.backend._path(digest).write_bytes(b"tampered")  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="corrupt"):
        store.get(digest)


async def test_codec_moves_only_large_payloads_to_the_store(tmp_path: Path) -> None:
    codec = ClaimCheckCodec(BlobStore(DirectoryBackend(tmp_path)), threshold=1024)
    small = Payload(metadata={"encoding": b"json/plain"}, data=b'"x"')
    large = Payload(metadata={"encoding": b"json/plain"}, data=b'"' + b"y" * 10_000 + b'"')
    encoded = await codec.encode([small, large])
    assert encoded[0] == small
    assert encoded[1].metadata["encoding"] == ENCODING
    assert encoded[1].ByteSize() < 200
    assert await codec.decode(encoded) == [small, large]


def test_bad_settings_are_rejected_with_the_variable_name() -> None:
    with pytest.raises(ConfigurationError, match="DRLM_CLAIM_CHECK_THRESHOLD: .*integer.*'ten'"):
        Settings.from_env({"DRLM_CLAIM_CHECK_THRESHOLD": "ten"})
    with pytest.raises(ConfigurationError, match="DRLM_SERVER_IDLE_S"):
        Settings.from_env({"DRLM_SERVER_IDLE_S": "-1"})
    with pytest.raises(ConfigurationError, match="DRLM_TRACING"):
        Settings.from_env({"DRLM_TRACING": "loud"})


def test_settings_default_to_the_embedded_server_and_sqlite(tmp_path: Path) -> None:
    settings = Settings.from_env({"DRLM_DATA_DIR": str(tmp_path)})
    assert settings.embedded
    assert settings.effective_database_url == f"sqlite:///{tmp_path.resolve() / 'drlm.sqlite'}"
    assert not Settings.from_env({"TEMPORAL_ADDRESS": "localhost:7233"}).embedded


def test_the_default_data_dir_is_the_users_whatever_the_directory(tmp_path: Path) -> None:
    import platformdirs

    settings = Settings.from_env({})  # from_env(mapping) reads the mapping only
    assert settings.data_dir == Path(platformdirs.user_data_dir("drlm", appauthor=False))
    assert settings.origin("data_dir") == "default (DRLM_DATA_DIR unset)"
    chosen = Settings.from_env(
        {"DRLM_DATA_DIR": str(tmp_path), "DRLM_DATABASE_URL": "postgresql://u:pw@h/db"}
    )
    stores = chosen.describe_stores()
    assert stores["data directory"] == (str(tmp_path.resolve()), "DRLM_DATA_DIR")
    assert stores["SQL store"] == ("postgresql://u:***@h/db", "DRLM_DATABASE_URL")  # no password printed
    assert Settings(data_dir=tmp_path).origin("data_dir") == "set by the caller"


async def test_capacity_settings_size_the_worker(sandboxes: Path, blobs: BlobStore, client) -> None:
    from durable_rlm.worker.runtime import build_workers

    env = {
        "DRLM_CAPACITY": "20",
        "DRLM_ACTIVITY_SLOTS": "30",
        "DRLM_SANDBOX_BUDGET_MB": "256",
        "DRLM_SANDBOX_START": "spawn",
        "DRLM_MAX_SANDBOXES": "12",
    }
    settings = Settings.from_env(env)
    assert (settings.capacity, settings.activity_slots, settings.sandbox_budget_mb) == (20, 30, 256)
    assert settings.max_sandboxes == 12
    with pytest.raises(ConfigurationError, match="DRLM_SANDBOX_START"):
        Settings.from_env({"DRLM_SANDBOX_START": "clone"})
    with pytest.raises(ConfigurationError, match="DRLM_CAPACITY"):
        Settings.from_env({"DRLM_CAPACITY": "0"})
    workers, repl = build_workers(
        client,
        "q",
        blobs,
        None,
        sandbox_root=sandboxes,
        capacity=settings.capacity,
        activity_slots=settings.activity_slots,
        sandbox_budget_mb=settings.sandbox_budget_mb,
        sandbox_start=settings.sandbox_start,
        max_sandboxes=settings.max_sandboxes,
    )
    config = workers[0].config()
    assert config["max_cached_workflows"] == 20
    tuner = config["tuner"]
    assert (tuner.local_activity_slot_supplier.num_slots, tuner.activity_slot_supplier.limit) == (20, 30)
    # Workflow tasks and activities: admission by measured capacity (durable_rlm/worker/admission.py).
    assert isinstance(tuner.workflow_slot_supplier, AdmittingWorkflowSlots) and repl.slots.limit == 12
    assert isinstance(tuner.activity_slot_supplier, AdmittingActivitySlots)
    held, held_repl = build_workers(
        client, "q-held", blobs, None, sandbox_root=sandboxes, hold_new_episodes=True
    )
    assert held[0].config()["tuner"].workflow_slot_supplier.sandboxes is held_repl.slots
    # Heartbeats leave at most a second apart, not at 80% of the timeout.
    assert config["max_heartbeat_throttle_interval"] == timedelta(seconds=1)
    assert (repl.config.memory_budget_mb, repl.config.sandbox_start) == (256, "spawn")


def _backends(engine: sa.Engine, tmp_path: Path) -> list[BlobStore]:
    migrate(engine)
    return [BlobStore(SqlBackend(engine)), BlobStore(DirectoryBackend(tmp_path / "blobs"))]


def test_a_once_only_marker_is_added_once_across_stores(engine: sa.Engine, tmp_path: Path) -> None:
    """`add` asks the backend, not the cache: two stores on one backend (two workers) agree."""
    for store in _backends(engine, tmp_path):
        other = BlobStore(store.backend)
        assert store.add(b"step 1 started") is True
        assert store.add(b"step 1 started") is False
        assert other.add(b"step 1 started") is False
        assert other.get(digest_of(b"step 1 started")) == b"step 1 started"


def test_a_step_stores_its_blobs_in_one_write(engine: sa.Engine, tmp_path: Path) -> None:
    for store in _backends(engine, tmp_path):
        store.put(b"already there")
        blobs = [b"already there", b"new one", b"new one", b"another"]
        digests = store.put_many(blobs)
        assert digests == [digest_of(b) for b in blobs]
        fresh = BlobStore(store.backend)  # nothing from the first store's cache
        assert [fresh.get(d) for d in digests] == blobs
        assert store.put_many([]) == []


def test_processes_opening_a_new_store_at_once_take_turns_migrating(tmp_path: Path) -> None:
    """Two `drlm run` (or a run and a worker) starting together on a new data directory:
    both must find a migrated store, neither may fail on 'table blobs already exists'."""
    import sys

    url = f"sqlite:///{tmp_path / 'new.sqlite'}"
    start_at = time.time() + 3  # every process imported and waiting: they migrate together
    code = (
        "import time; from durable_rlm.store.sql import open_store; "
        f"time.sleep(max(0, {start_at} - time.time())); open_store({url!r}).dispose()"
    )
    processes = [
        subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True) for _ in range(6)
    ]
    errors = [p.communicate(timeout=120)[1] for p in processes]
    assert [p.returncode for p in processes] == [0] * 6, errors
    engine = open_store(url)
    with engine.connect() as conn:
        tables = set(sa.inspect(conn).get_table_names())
    assert {"blobs", "episodes", "episode_timelines"} <= tables


def test_the_head_revision_read_from_the_files_is_alembic_s() -> None:
    from alembic.script import ScriptDirectory

    from durable_rlm.store.sql import MIGRATIONS_DIR, alembic_config, head_revision

    config = alembic_config(create_engine("sqlite://"))
    assert config.get_main_option("script_location") == str(MIGRATIONS_DIR)
    assert [head_revision()] == ScriptDirectory.from_config(config).get_heads()


def test_a_store_at_the_newest_revision_opens_without_alembic(tmp_path: Path) -> None:
    """A one-off program pays for alembic only when the schema must change."""
    from durable_rlm.store.sql import head_revision

    url = f"sqlite:///{tmp_path / 'drlm.sqlite'}"
    open_store(url)  # new: migrated
    code = (
        "import sys\nfrom durable_rlm.store.sql import open_store\n"
        f"open_store({url!r})\nprint('alembic' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    downgrade(create_engine(url), "-1")  # one migration behind: alembic brings it up
    open_store(url)
    with create_engine(url).connect() as connection:
        recorded = connection.execute(sa.text("SELECT version_num FROM alembic_version")).scalar()
    assert recorded == head_revision()
