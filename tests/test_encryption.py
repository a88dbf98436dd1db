"""Payload and blob encryption (DRLM_ENCRYPTION_KEYS): histories and blob rows at rest hold
no clear prompt, output or context; a reader with the keys sees everything, one without
them is told which key it lacks; keys rotate by adding a new one first."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from temporalio.client import Client

from durable_rlm.scripted import root_and_sub
from durable_rlm.server.connection import connect
from durable_rlm.settings import ConfigurationError, Settings
from durable_rlm.store.blobs import BlobStore, SqlBackend
from durable_rlm.store.encryption import BLOB_MAGIC, Keyring, MissingKey
from durable_rlm.store.sql import open_store
from durable_rlm.worker.runtime import EmbeddedServer, running_workers
from tests.conftest import request_for

DRLM = str(Path(sys.executable).with_name("drlm"))


def new_key() -> str:
    return base64.b64encode(os.urandom(32)).decode()


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("k1=" + base64.b64encode(b"short").decode(), "is 5 bytes; AES-256 needs 32"),
        ("k1=not base64!", "is not base64"),
        ("=abc", "is not ID=BASE64"),
        ("k1={k},k1={k}", "listed twice"),
        (" , ", "names no key"),
    ],
)
def test_bad_keys_are_refused_naming_the_entry_never_the_key(text: str, problem: str) -> None:
    key = new_key()
    with pytest.raises(ConfigurationError, match=problem) as refused:
        Settings.from_env({"DRLM_ENCRYPTION_KEYS": text.format(k=key)})
    assert key not in str(refused.value) and "DRLM_ENCRYPTION_KEYS" in str(refused.value)


def test_blobs_are_sealed_bound_to_their_address_and_keys_rotate(tmp_path: Path) -> None:
    engine = open_store(f"sqlite:///{tmp_path / 'store.sqlite'}")
    first = new_key()
    old = Keyring.parse(f"k1={first}")
    store = BlobStore(SqlBackend(engine), keyring=old)
    digest = store.put(b"a secret context")
    raw = SqlBackend(engine).read(digest)
    assert raw is not None and raw.startswith(BLOB_MAGIC + b"k1:") and b"secret" not in raw
    # Rotation: the new key first, the old kept; old blobs read, new ones sealed with k2.
    rotated = Keyring.parse(f"k2={new_key()},k1={first}")
    reader = BlobStore(SqlBackend(engine), keyring=rotated)
    assert reader.get(digest) == b"a secret context"
    newer = reader.put(b"written after the rotation")
    assert (SqlBackend(engine).read(newer) or b"").startswith(BLOB_MAGIC + b"k2:")
    with pytest.raises(MissingKey, match="set DRLM_ENCRYPTION_KEYS"):
        BlobStore(SqlBackend(engine)).get(digest)
    with pytest.raises(MissingKey, match="key 'k2', which DRLM_ENCRYPTION_KEYS does not hold"):
        BlobStore(SqlBackend(engine), keyring=old).get(newer)
    # A sealed blob moved under another address fails its check.
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE blobs SET data = :d WHERE digest = :g"), {"d": raw, "g": newer})
    with pytest.raises(ValueError, match="integrity check"):
        BlobStore(SqlBackend(engine), keyring=rotated).get(newer)


@pytest.fixture
async def server_with_attributes(tmp_path: Path):
    """A server that registered drlm's search attributes, as the shared embedded server does:
    the attributes are indexed in the clear, so they must carry no task text."""
    from durable_rlm.workflows.metadata import SEARCH_ATTRIBUTES

    registered = tuple(
        a for name, kind in SEARCH_ATTRIBUTES for a in ("--search-attribute", f"{name}={kind}")
    )
    async with EmbeddedServer(tmp_path / "temporal.sqlite", extra_args=registered) as address:
        yield address


async def test_an_encrypted_episode_leaves_no_clear_text_in_history_or_blobs(
    server_with_attributes: str, tmp_path: Path, scripted
) -> None:
    temporal_address = server_with_attributes
    marker = f"MARKER{uuid.uuid4().hex}"
    turns = [
        f"```repl\nhit = context.count('{marker}')\nr = llm_query('say {marker} ' + str(hit))\nprint(r)\n```",
        "FINAL_VAR(r)",
    ]
    server = scripted(root_and_sub(turns, str.upper))
    key = new_key()
    queue = f"enc-{uuid.uuid4().hex[:8]}"
    database = f"sqlite:///{tmp_path / 'store.sqlite'}"
    settings = Settings(
        temporal_address=temporal_address,
        task_queue=queue,
        data_dir=tmp_path,
        database_url=database,
        encryption_keys=f"k1={key}",
        claim_check_threshold=256,  # the big payloads go to blobs, so both are checked
    )
    context = (f"{marker} " * 40) + ("filler " * 2000)
    episode_id = f"enc-{uuid.uuid4().hex[:6]}"
    async with connect(settings) as services, running_workers(services):
        from durable_rlm.client.episodes import start_episode, store_context

        request = request_for(server, task=f"count {marker}", context=store_context(services.blobs, context))
        # The client's own start path: memo, summary and search attributes as drlm sets them.
        handle = await start_episode(services.client, request, queue, episode_id)
        result = await handle.result()
        assert result.answer == f"SAY {marker} 40".upper()

    # History as the server keeps it: a client with no codec sees the raw payloads.
    raw = await Client.connect(temporal_address)
    history = await raw.get_workflow_handle(episode_id).fetch_history()
    data = b"".join(event.SerializeToString() for event in history.events)  # payload bytes as stored
    # Even a shortened excerpt (a step's summary, the task's start) would carry this much.
    for piece in (marker[:14], marker[:14].upper()):
        assert piece.encode() not in data, piece
    assert b"binary/encrypted" in data
    assert b"DrlmTask" in data and b"(encrypted)" in data  # the attribute is there, not the task
    # Blob rows as stored.
    engine = sa.create_engine(database)
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT data FROM blobs")).scalars().all()
    assert rows and all(marker.encode() not in bytes(row) for row in rows)
    assert all(bytes(row).startswith(BLOB_MAGIC) for row in rows)
    # The audit rows keep digests, tokens and times, not the text.
    with engine.connect() as conn:
        dumped = [
            str(row)
            for table in ("episodes", "audit_iterations", "audit_model_calls", "audit_cells", "audit_events")
            for row in conn.execute(sa.text(f"SELECT * FROM {table}")).fetchall()  # noqa: S608
        ]
    assert dumped and all(marker[:14] not in row and marker[:14].upper() not in row for row in dumped)
    assert any("(encrypted)" in row for row in dumped)

    # The CLI: with the key it shows the episode; without it, it says which key it lacks.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DRLM_", "TEMPORAL_"))}
    env.update(TEMPORAL_ADDRESS=temporal_address, DRLM_DATA_DIR=str(tmp_path), DRLM_DATABASE_URL=database)
    lacking = subprocess.run([DRLM, "show", episode_id], env=env, capture_output=True, text=True, timeout=60)
    assert lacking.returncode != 0 and "k1" in lacking.stderr and "DRLM_ENCRYPTION_KEYS" in lacking.stderr
    assert marker not in lacking.stdout + lacking.stderr
    env["DRLM_ENCRYPTION_KEYS"] = f"k1={key}"
    shown = subprocess.run([DRLM, "show", episode_id], env=env, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert f"SAY {marker} 40".upper() in shown.stdout
