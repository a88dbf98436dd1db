"""Snapshots a fork may load, kept whatever their episode's quota says.

An episode keeps only its newest snapshots in the store (activities/repl_snapshots.py); a
fork of it starts from the snapshot its source held at the fork's iteration and loads that
snapshot when its REPL is rebuilt, until it has taken its own. So a fork pins the snapshot
it starts from, and no quota deletes a pinned one. A pin is a marker blob whose content
names the snapshot: the store needs no table of its own, and every worker and CLI that
shares the store sees it.
"""

from __future__ import annotations

from durable_rlm.store.blobs import BlobStore, digest_of

_PIN = b"drlm snapshot pin\n"


def _marker(snapshot: str) -> bytes:
    return _PIN + snapshot.encode("ascii")


def pin_snapshot(blobs: BlobStore, snapshot: str) -> None:
    """Keep the snapshot blob `snapshot` (a digest) for good."""
    blobs.add(_marker(snapshot))


def snapshot_pinned(blobs: BlobStore, snapshot: str) -> bool:
    return blobs.holds(digest_of(_marker(snapshot)))
