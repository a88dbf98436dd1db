"""The call ledger (activities/call_ledger.py, durable_rlm/store/call_ledger.py): a model
request is claimed before it is sent and its reply kept once it came, so that a step run
again for the same call (an attempt the server gave up, retried) takes that reply, or waits
for the request in flight, instead of paying for it twice. Only a dead holder's call, cut
mid-flight, is sent again. On a real SQLite store, with the store's own migrations."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from durable_rlm.activities.call_ledger import POLL_S, STORE_PATIENCE_S, CallLedger
from durable_rlm.store import schema
from durable_rlm.store.call_ledger import Claim, LedgerRows, call_key
from durable_rlm.store.encryption import Keyring
from durable_rlm.store.sql import open_store


@pytest.fixture
def rows(tmp_path: Path) -> LedgerRows:
    return LedgerRows(open_store(f"sqlite:///{tmp_path / 'drlm.sqlite'}"))


class Model:
    """A model that counts the requests it was sent and answers each after `delay_s`."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.sent = 0
        self.delay_s = delay_s

    async def reply(self) -> str:
        self.sent += 1
        await asyncio.sleep(self.delay_s)
        return f"reply {self.sent}"


def key() -> str:
    return call_key("default", "episode", uuid.uuid4().hex, "7", 0)


async def once(ledger: CallLedger, name: str, model: Model) -> str:
    return await ledger.once(name, "episode", model.reply, str.encode, bytes.decode)


async def test_a_recorded_reply_answers_every_later_attempt(rows: LedgerRows) -> None:
    ledger, model, name = CallLedger(rows, "w1"), Model(), key()
    assert await once(ledger, name, model) == "reply 1"
    again = CallLedger(rows, "w2")  # another worker, after the first one's attempt was given up
    assert [await once(again, name, model), await once(ledger, name, model)] == ["reply 1"] * 2
    assert model.sent == 1 and again.taken_from_ledger == 1


async def test_an_attempt_given_up_leaves_its_request_in_flight_for_the_next(rows: LedgerRows) -> None:
    ledger, model, name = CallLedger(rows, "w1"), Model(delay_s=0.3), key()
    first = asyncio.ensure_future(once(ledger, name, model))
    while model.sent == 0:  # claimed, and in flight
        await asyncio.sleep(0.01)
    first.cancel()  # the server gave the attempt up: the SDK cancels it
    with pytest.raises(asyncio.CancelledError):
        await first
    assert await once(ledger, name, model) == "reply 1"  # the retry waits for the same request
    assert model.sent == 1 and ledger.waited_for == 1
    assert rows.read(name).reply == b"reply 1"  # type: ignore[union-attr]


async def test_a_live_holder_on_another_worker_is_waited_for(rows: LedgerRows) -> None:
    model, name = Model(delay_s=1.0), key()
    first = CallLedger(rows, "w1", host="h", alive=lambda holder: True)
    second = CallLedger(rows, "w2", host="h", alive=lambda holder: True)
    sending = asyncio.ensure_future(once(first, name, model))
    while model.sent == 0:  # claimed, and in flight
        await asyncio.sleep(0.01)
    replies = await asyncio.gather(sending, once(second, name, model))
    assert replies == ["reply 1", "reply 1"] and model.sent == 1 and second.waited_for == 1


async def test_a_dead_holders_call_is_sent_again_and_only_that_one(rows: LedgerRows) -> None:
    # The worker that claimed it was killed mid-call: its lock is free, no reply will come.
    model, name = Model(), key()
    assert rows.claim(name, "episode", "dead", "h", lease_s=60) is None
    ledger = CallLedger(rows, "w2", host="h", alive=lambda holder: holder != "dead")
    assert await once(ledger, name, model) == "reply 1" and model.sent == 1
    # On another host it cannot see the lock: the claim's lease decides.
    other, stale = key(), CallLedger(rows, "w3", host="elsewhere")
    assert rows.claim(other, "episode", "dead", "h", lease_s=-1) is None
    assert await once(stale, other, model) == "reply 2"


async def test_a_failed_request_is_released_and_asked_again(rows: LedgerRows) -> None:
    ledger, name, model = CallLedger(rows, "w1"), key(), Model()

    async def refused() -> str:
        raise ConnectionError("refused")

    with pytest.raises(ConnectionError):
        await ledger.once(name, "episode", refused, str.encode, bytes.decode)
    assert rows.read(name) is None
    assert await once(ledger, name, model) == "reply 1"


class SlowClaims(LedgerRows):
    """A store that takes each claim, but only after `delay_s`."""

    def __init__(self, rows: LedgerRows, delay_s: float) -> None:
        super().__init__(rows.engine)
        self.delay_s = delay_s

    def claim(self, key: str, workflow_id: str, holder: str, host: str, lease_s: float) -> Claim | None:
        time.sleep(self.delay_s)
        return super().claim(key, workflow_id, holder, host, lease_s)


async def until_recorded(rows: LedgerRows, name: str) -> bytes:
    """The reply the ledger holds for `name`, once it holds one (10 s at most)."""
    for _ in range(200):
        found = rows.read(name)
        if found is not None and found.reply is not None:
            return found.reply
        await asyncio.sleep(0.05)
    raise AssertionError(f"no reply recorded: {rows.read(name)}")


async def test_a_claim_the_store_took_while_the_loop_stood_still_counts(rows: LedgerRows) -> None:
    # The store takes the claim in 0.3 s, within its patience, but the process's event loop
    # stands still for longer than the patience meanwhile (a step holding it, a paused
    # process): the call is recorded, not sent unrecorded (which let a retry send it again).
    ledger, model, name = CallLedger(SlowClaims(rows, 0.3), "w1"), Model(), key()
    sending = asyncio.ensure_future(once(ledger, name, model))
    await asyncio.sleep(0.05)  # the claim is in the store's thread, the patience counting
    time.sleep(STORE_PATIENCE_S + 0.7)  # noqa: ASYNC251 - the point: the event loop stands still
    assert await sending == "reply 1"
    assert ledger.unrecorded == 0 and rows.read(name).reply == b"reply 1"  # type: ignore[union-attr]


async def test_a_call_sent_unrecorded_is_still_paid_once(rows: LedgerRows) -> None:
    # The store took the claim too late: the call went out unrecorded. A step run again here
    # meanwhile waits for that call, and the late claim gets its reply, so no later asker
    # (here or on another worker) sends it again.
    slow = SlowClaims(rows, delay_s=STORE_PATIENCE_S + 0.5)
    ledger, model, name = CallLedger(slow, "w1"), Model(delay_s=0.3), key()
    first = asyncio.ensure_future(once(ledger, name, model))
    while model.sent == 0:
        await asyncio.sleep(0.01)
    assert ledger.unrecorded == 1
    first.cancel()  # the server gave the attempt up
    with pytest.raises(asyncio.CancelledError):
        await first
    assert await once(ledger, name, model) == "reply 1"  # waited for, not sent again
    assert await until_recorded(rows, name) == b"reply 1"  # the late claim, then its reply
    assert await once(CallLedger(rows, "w2"), name, model) == "reply 1"
    assert model.sent == 1


async def test_a_claim_landing_after_the_reply_still_gets_it(rows: LedgerRows) -> None:
    # The model answered before the store took the claim (2 s late): the reply waits for the
    # claim however late, so the ledger never holds this worker's claim without its reply
    # (which a retry here would take for a dead call and send again).
    ledger, model, name = CallLedger(SlowClaims(rows, 2.0), "w1"), Model(), key()
    assert await once(ledger, name, model) == "reply 1"  # the step gets it at once
    assert await until_recorded(rows, name) == b"reply 1"
    assert await once(CallLedger(rows, "w1b"), name, model) == "reply 1"
    assert model.sent == 1


async def test_a_step_run_again_while_the_claim_is_on_its_way_waits_for_it(rows: LedgerRows) -> None:
    # Two steps for one call in this process at once, the claim still with the store: one
    # request, one reply for both.
    ledger, model, name = CallLedger(SlowClaims(rows, 0.3), "w1"), Model(delay_s=0.1), key()
    replies = await asyncio.gather(once(ledger, name, model), once(ledger, name, model))
    assert replies == ["reply 1", "reply 1"] and model.sent == 1 and ledger.waited_for == 1


async def test_a_failed_call_whose_claim_came_late_is_asked_anew(rows: LedgerRows) -> None:
    # The claim took 1 s (past the patience), the request failed at once: its step gets the
    # error only once the claim has landed and been let go, so a step asked again right
    # after sends the request anew instead of getting the old error.
    ledger, model, name = CallLedger(SlowClaims(rows, 1.0), "w1"), Model(), key()

    async def refused() -> str:
        raise ConnectionError("refused")

    with pytest.raises(ConnectionError):
        await ledger.once(name, "episode", refused, str.encode, bytes.decode)
    assert rows.read(name) is None  # let go
    assert await once(ledger, name, model) == "reply 1" and model.sent == 1


async def test_a_step_given_up_before_its_request_went_out_sends_nothing(rows: LedgerRows) -> None:
    # The step waits for another worker's call; it is given up (its episode cancelled); the
    # other worker then dies: nobody asks any more, so nothing is sent on its behalf.
    name, model, holder_alive = key(), Model(), [True]
    assert rows.claim(name, "episode", "w0", "h", lease_s=60) is None
    ledger = CallLedger(rows, "w1", host="h", alive=lambda holder: holder_alive[0])
    waiting = asyncio.ensure_future(once(ledger, name, model))
    while ledger.waited_for == 0:
        await asyncio.sleep(0.01)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    holder_alive[0] = False
    await asyncio.sleep(3 * POLL_S)
    assert model.sent == 0 and name not in ledger._in_flight


async def test_leases_are_renewed_for_calls_in_flight_only(rows: LedgerRows) -> None:
    a, b = key(), key()
    rows.claim(a, "episode", "w1", "h", lease_s=1)
    rows.claim(b, "episode", "w1", "h", lease_s=1)
    rows.record(b, b"done")
    assert rows.renew("w1", lease_s=100) == 1
    assert rows.read(a).lease_until > time.time() + 50  # type: ignore[union-attr]


def test_a_reply_is_sealed_in_the_store_with_its_keys(tmp_path: Path) -> None:
    engine = open_store(f"sqlite:///{tmp_path / 'drlm.sqlite'}")
    rows = LedgerRows(engine, Keyring.parse("k1=" + base64.b64encode(bytes(range(32))).decode()))
    name = key()
    rows.claim(name, "episode", "w1", "h", lease_s=10)
    rows.record(name, b"the model's secret words")
    with engine.connect() as conn:
        stored = conn.execute(sa.select(schema.call_ledger.c.reply)).scalar_one()
    assert b"secret" not in stored and rows.read(name).reply == b"the model's secret words"  # type: ignore[union-attr]


EPISODE = {"run_id": "r", "task": "t", "root_model": "m"}


def test_rows_of_ended_episodes_are_forgotten(rows: LedgerRows) -> None:
    an_hour_ago = datetime.now(UTC) - timedelta(hours=1)
    ended, running = key(), key()
    rows.claim(ended, "ended-episode", "w1", "h", lease_s=10)
    rows.claim(running, "running-episode", "w1", "h", lease_s=10)
    with rows.engine.begin() as conn:
        conn.execute(
            schema.episodes.insert(),
            [
                {**EPISODE, "episode_id": "ended-episode", "status": "answered", "ended_at": an_hour_ago},
                {**EPISODE, "episode_id": "running-episode", "status": "running", "ended_at": None},
            ],
        )
    assert rows.forget_ended(timedelta(minutes=10), timedelta(days=30)) == 1
    assert rows.read(ended) is None and rows.read(running) is not None
