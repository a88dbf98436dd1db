"""Blobs of any size as chunks plus a manifest, on every store: the directory, the SQL table
(SQLite and PostgreSQL) and an S3-compatible object store (a real `weed mini` server)."""

from __future__ import annotations

import hashlib
import os
import tracemalloc
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from durable_rlm.store.blobs import BlobNotFound, BlobStore, CorruptBlob, DirectoryBackend, SqlBackend
from durable_rlm.store.chunks import CHUNK_BYTES, MANIFEST, MANIFEST_MAGIC, Manifest, address_of
from durable_rlm.store.encryption import Keyring
from durable_rlm.store.sql import open_store

MB = 1024 * 1024


def pseudo_random(size: int, seed: int = 1) -> Iterator[bytes]:
    """Incompressible bytes made a megabyte at a time (never the whole value at once)."""
    block = hashlib.sha512(str(seed).encode()).digest() * (MB // 64)
    made = 0
    n = 0
    while made < size:
        piece = bytes(b ^ (n & 0xFF) for b in block[:64]) + block[64 : min(MB, size - made)]
        piece = piece[: min(MB, size - made)]
        made += len(piece)
        n += 1
        yield piece


def whole(size: int, seed: int = 1) -> bytes:
    return b"".join(pseudo_random(size, seed))


@pytest.fixture(params=["directory", "sqlite", "postgres", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BlobStore]:
    if request.param == "directory":
        yield BlobStore(DirectoryBackend(tmp_path / "blobs"), cache_entries=0)
    elif request.param == "sqlite":
        engine = open_store(f"sqlite:///{tmp_path / 'store.sqlite'}")
        yield BlobStore(SqlBackend(engine), cache_entries=0)
        engine.dispose()
    elif request.param == "postgres":
        engine = open_store(request.getfixturevalue("postgres_url"))
        with engine.begin() as conn:
            conn.execute(sa.text("delete from blobs"))
        yield BlobStore(SqlBackend(engine), cache_entries=0)
        engine.dispose()
    else:
        from durable_rlm.store.s3 import S3Backend

        server = request.getfixturevalue("object_store")
        url = f"s3://{server.bucket}/t-{uuid.uuid4().hex[:8]}"
        yield BlobStore(S3Backend(url, server.endpoint_url, client=server.client()), cache_entries=0)


def test_a_large_blob_is_chunks_and_a_manifest_and_reads_back_whole(store: BlobStore) -> None:
    size = 2 * CHUNK_BYTES + 12_345
    stored = store.put_stream(pseudo_random(size))
    assert stored.size == size and stored.digest.startswith(MANIFEST)
    manifest = store.manifest(stored.digest)
    assert manifest is not None and [n for _, n in manifest.chunks] == [CHUNK_BYTES, CHUNK_BYTES, 12_345]
    data = whole(size)
    assert stored.digest == address_of(data)  # the same address with or without a store
    assert b"".join(store.chunks(stored.digest)) == data
    assert store.get(stored.digest) == data
    assert store.size(stored.digest) == size
    assert store.head(stored.digest, 100) == data[:100]
    assert store.put(data) == stored.digest  # idempotent, whichever way it is written


def test_a_blob_of_at_most_a_chunk_is_stored_as_it_is(store: BlobStore) -> None:
    data = whole(CHUNK_BYTES)
    stored = store.put_stream(pseudo_random(CHUNK_BYTES))
    assert stored.digest == "sha256:" + hashlib.sha256(data).hexdigest()
    assert store.get(stored.digest) == data
    assert store.put_stream([]).digest == store.put(b"")


def test_each_chunk_is_checked_as_it_is_read(tmp_path: Path) -> None:
    store = BlobStore(DirectoryBackend(tmp_path), cache_entries=0)
    stored = store.put_stream(pseudo_random(3 * CHUNK_BYTES))
    manifest = store.manifest(stored.digest)
    assert manifest is not None
    second = manifest.chunks[1][0]
    path = store.backend._path(second)  # type: ignore[attr-defined]
    path.write_bytes(b"x" * CHUNK_BYTES)
    stream = store.chunks(stored.digest)
    assert len(next(stream)) == CHUNK_BYTES  # the first chunk is whole
    with pytest.raises(CorruptBlob, match=f"chunk {second} of {stored.digest} is corrupt"):
        next(stream)
    path.unlink()
    with pytest.raises(BlobNotFound, match="a chunk of"):
        store.check(stored.digest)


def test_a_manifest_is_checked_against_its_address(tmp_path: Path) -> None:
    store = BlobStore(DirectoryBackend(tmp_path), cache_entries=0)
    first = store.put_stream(pseudo_random(2 * CHUNK_BYTES, seed=1))
    other = store.put_stream(pseudo_random(2 * CHUNK_BYTES, seed=2))
    # A manifest swapped for another's (its chunks all whole) is still caught.
    store.backend._path(first.digest).write_bytes(store.backend.read(other.digest))  # type: ignore[attr-defined]
    with pytest.raises(CorruptBlob, match="do not hash to its address"):
        store.get(first.digest)


def test_stored_bytes_that_look_like_a_manifest_are_read_as_bytes(tmp_path: Path) -> None:
    """A model's output can be any text: one shaped as a manifest naming another episode's
    chunks is a plain blob under a plain address, never followed."""
    store = BlobStore(DirectoryBackend(tmp_path), cache_entries=0)
    secret = store.put_stream(pseudo_random(2 * CHUNK_BYTES, seed=7))
    manifest = store.manifest(secret.digest)
    assert manifest is not None
    lookalike = manifest.encode()
    digest = store.put(lookalike)
    assert not digest.startswith(MANIFEST) and lookalike.startswith(MANIFEST_MAGIC)
    assert store.get(digest) == lookalike


def test_a_single_row_blob_larger_than_a_chunk_still_reads(tmp_path: Path) -> None:
    """Stores written before chunking hold large blobs in one row: they read as they are."""
    engine = open_store(f"sqlite:///{tmp_path / 'old.sqlite'}")
    data = whole(CHUNK_BYTES + 5 * MB, seed=3)
    legacy = "sha256:" + hashlib.sha256(data).hexdigest()
    with engine.begin() as conn:
        conn.execute(sa.text("insert into blobs (digest, size, data) values (:d, :n, :b)"),
                     {"d": legacy, "n": len(data), "b": data})  # fmt: skip
    store = BlobStore(SqlBackend(engine), cache_entries=0)
    assert store.get(legacy) == data
    assert b"".join(store.chunks(legacy)) == data
    assert store.check(legacy) == len(data)


def test_a_streamed_put_holds_a_few_chunks_at_most(tmp_path: Path) -> None:
    store = BlobStore(DirectoryBackend(tmp_path), cache_entries=0)
    size = 12 * CHUNK_BYTES  # 192 MB
    tracemalloc.start()
    try:
        stored = store.put_stream(pseudo_random(size))
        _, put_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        assert sum(len(c) for c in store.chunks(stored.digest)) == size
        _, read_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert put_peak < 5 * CHUNK_BYTES, f"a put of {size:,} bytes held {put_peak:,}"
    assert read_peak < 5 * CHUNK_BYTES, f"a read of {size:,} bytes held {read_peak:,}"


def test_chunks_and_manifests_are_sealed_each_on_its_own(tmp_path: Path) -> None:
    keyring = Keyring.parse("k1=" + __import__("base64").b64encode(os.urandom(32)).decode())
    store = BlobStore(DirectoryBackend(tmp_path), cache_entries=0, keyring=keyring)
    text = (b"a secret line of the context\n" * (3 * CHUNK_BYTES // 29))[: 2 * CHUNK_BYTES + 99]
    stored = store.put_stream([text])
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert b"a secret line" not in path.read_bytes()
    assert store.get(stored.digest) == text
    plain = BlobStore(DirectoryBackend(tmp_path), cache_entries=0)
    with pytest.raises(Exception, match="DRLM_ENCRYPTION_KEYS"):
        plain.get(stored.digest)


def test_a_backend_lists_and_deletes_only_what_was_not_written_since(store: BlobStore) -> None:
    old = store.put(b"old and unnamed " + uuid.uuid4().bytes)
    listed = {b.digest: b for b in store.backend.listing()}
    assert old in listed and listed[old].size > 0
    cutoff = datetime.now(UTC) + timedelta(seconds=5)
    assert store.delete([old], written_before=datetime.now(UTC) - timedelta(hours=1)) == 0
    assert store.delete([old], written_before=cutoff) == 1
    with pytest.raises(BlobNotFound):
        store.get(old)


def test_a_manifest_names_bounded_chunks_only() -> None:
    bad = Manifest(CHUNK_BYTES + 1, (("sha256:" + "0" * 64, CHUNK_BYTES + 1),))
    with pytest.raises(CorruptBlob, match="bad chunk"):
        Manifest.decode(bad.address, bad.encode())
