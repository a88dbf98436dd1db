"""The key that signs REPL snapshots: every worker that may rebuild an episode needs it.

`DRLM_SNAPSHOT_KEY` names it (production: the same secret on every worker). Without it, a
key file in the data directory is made once (0600) and shared by the processes that use
that directory: the CLI, the API and local workers. A worker whose key differs refuses the
snapshots it cannot verify and re-runs the cells instead: slower, never wrong.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import time
from pathlib import Path

from durable_rlm.errors import ConfigurationError

KEY_FILE = "snapshot.key"
MIN_CHARS = 32


def snapshot_key(configured: str | None, data_dir: Path) -> bytes:
    if configured:
        if len(configured) < MIN_CHARS:
            raise ConfigurationError(
                f"DRLM_SNAPSHOT_KEY must have at least {MIN_CHARS} characters (it signs REPL snapshots)"
            )
        return configured.encode("utf-8")
    path = data_dir / KEY_FILE
    data_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        # O_EXCL: of two processes starting at once, one writes the key and both read it.
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(secrets.token_hex(32))
    for _ in range(50):
        text = path.read_text().strip()
        if len(text) >= MIN_CHARS:
            return text.encode("utf-8")
        time.sleep(0.01)  # the other process is still writing it
    raise ConfigurationError(f"{path} holds no usable snapshot key: delete it to make a new one")


def lineage_mac(key: bytes, episode_id: str, lineage: list[str]) -> str:
    """What lets a fork load its sources' REPL snapshots: `drlm fork` signs the fork's id and
    the episodes it descends from with the snapshot key, and a worker loads another
    episode's snapshot only under a lineage it can verify (a request alone cannot claim one)."""
    signed = "\n".join(["drlm-fork-lineage", episode_id, *lineage]).encode("utf-8")
    return hmac.new(key, signed, hashlib.sha256).hexdigest()
