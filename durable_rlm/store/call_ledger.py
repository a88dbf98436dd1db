"""The call ledger's rows: one per model request an episode's steps made, in the SQL store.

A row is written (claimed) before its request is sent, naming the worker process that sends
it (its holder, on its host) and a lease that process keeps renewing while the request is in
flight; the reply is written into it once it came. A step that runs again for the same call
(a retried attempt whose predecessor the server gave up) finds the row: a reply is taken
as it is; a live holder's claim is waited for; a dead holder's claim (its lock free on
this host, or its lease run out) is taken over, and only then is the model asked again.
activities/call_ledger.py is the protocol; this module is its statements, each one short
transaction.

The reply is sealed with the store's keys when DRLM_ENCRYPTION_KEYS is set (bound to its
call), as blobs are: the SQL store never holds model text in the clear.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa

from durable_rlm.store import schema
from durable_rlm.store.encryption import Keyring, open_blob

table = schema.call_ledger


def call_key(namespace: str, workflow_id: str, run_id: str, step: str, call: int) -> str:
    """The ledger's name for the `call`-th request of a step (a step is an activity of a run,
    named by its activity id, which a retry and a replay keep)."""
    return hashlib.sha256(f"{namespace}\n{workflow_id}\n{run_id}\n{step}\n{call}".encode()).hexdigest()


@dataclass(frozen=True)
class Claim:
    """A row as read: who holds the call, until when, and its reply if it came."""

    holder: str
    host: str
    lease_until: float
    reply: bytes | None


class LedgerRows:
    """The ledger's statements on one SQL store."""

    def __init__(self, engine: sa.Engine, keyring: Keyring | None = None) -> None:
        self.engine = engine
        self.keyring = keyring

    def claim(self, key: str, workflow_id: str, holder: str, host: str, lease_s: float) -> Claim | None:
        """Claim the call for `holder`: None when this claimed it, else the row that was there."""
        now = time.time()
        try:
            with self.engine.begin() as conn:
                conn.execute(
                    table.insert().values(
                        call_key=key,
                        workflow_id=workflow_id[:200],
                        holder=holder,
                        host=host,
                        lease_until=now + lease_s,
                        claimed_at=now,
                    )
                )
        except sa.exc.IntegrityError:
            found = self.read(key)
            if found is None:  # released between the insert and the read: claim it again
                return self.claim(key, workflow_id, holder, host, lease_s)
            return found
        return None

    def read(self, key: str) -> Claim | None:
        with self.engine.connect() as conn:
            row = conn.execute(
                sa.select(table.c.holder, table.c.host, table.c.lease_until, table.c.reply).where(
                    table.c.call_key == key
                )
            ).first()
        if row is None:
            return None
        reply = None if row.reply is None else open_blob(self.keyring, _address(key), bytes(row.reply))
        return Claim(row.holder, row.host, row.lease_until, reply)

    def take_over(self, key: str, dead_holder: str, holder: str, host: str, lease_s: float) -> bool:
        """Claim a call whose holder is dead; False when another worker was first, or the
        reply came meanwhile."""
        with self.engine.begin() as conn:
            taken = conn.execute(
                table.update()
                .where(table.c.call_key == key, table.c.holder == dead_holder, table.c.reply.is_(None))
                .values(holder=holder, host=host, lease_until=time.time() + lease_s)
            ).rowcount
        return taken == 1

    def record(self, key: str, reply: bytes) -> None:
        """The reply came: kept for any step that asks for this call again (whoever holds the
        claim now; a reply already there stays)."""
        sealed = self.keyring.seal(_address(key), reply) if self.keyring is not None else reply
        with self.engine.begin() as conn:
            conn.execute(
                table.update().where(table.c.call_key == key, table.c.reply.is_(None)).values(reply=sealed)
            )

    def release(self, key: str, holder: str) -> None:
        """No reply came (the request failed, or was never sent): the next step calls again."""
        with self.engine.begin() as conn:
            conn.execute(
                table.delete().where(
                    table.c.call_key == key, table.c.holder == holder, table.c.reply.is_(None)
                )
            )

    def renew(self, holder: str, lease_s: float) -> int:
        """Renew the leases of every call `holder` has in flight, in one statement."""
        with self.engine.begin() as conn:
            return int(
                conn.execute(
                    table.update()
                    .where(table.c.holder == holder, table.c.reply.is_(None))
                    .values(lease_until=time.time() + lease_s)
                ).rowcount
            )

    def forget_ended(self, after: timedelta, longest: timedelta) -> int:
        """Rows no step can ask for again: those of episodes whose audit row closed more
        than `after` ago (by then every reply they hold is in their history), and any older
        than `longest` (an episode with no audit row)."""
        # UTC, as the audit rows write it: SQLite compares the digits.
        ended_before = datetime.now(UTC) - after
        episodes = schema.episodes
        ended = sa.select(episodes.c.episode_id).where(
            episodes.c.status != "running", episodes.c.ended_at < ended_before
        )
        with self.engine.begin() as conn:
            return int(
                conn.execute(
                    table.delete().where(
                        sa.or_(
                            table.c.workflow_id.in_(ended),
                            table.c.claimed_at < time.time() - longest.total_seconds(),
                        )
                    )
                ).rowcount
            )


def _address(key: str) -> str:
    """What a sealed reply is bound to: its call, so that one call's reply cannot pass for another's."""
    return f"call:{key}"
