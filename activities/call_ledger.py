"""No model call paid twice: each request is claimed in the call ledger before it is sent,
and its reply recorded there as soon as it came (the rows: durable_rlm/store/call_ledger.py).

A model step can run more than once for the same call: the server gives up an attempt
whose heartbeats came late (an overloaded worker, a paused process) and starts another,
perhaps while the first one's request is still in flight or its reply just came. Each time,
the step asks the ledger first, by the call's name (the episode's run, the step's activity
id, which its retries keep, and the call's place in the step):

- a reply is there: it is the answer, and the model is not asked;
- the call runs in this process already: its result is awaited;
- another live worker holds it (its lock held on this host, its lease renewed): waited for;
- its holder is dead (its lock free, or its lease run out): taken over, and sent again.

A request, once sent, is never abandoned by the step that sent it: when that step is
cancelled (its attempt given up, its episode evicted) the request goes on, bounded by its own
timeout, and its reply is recorded for whoever asks next. The one window left is a worker
killed between sending a request and recording its reply: the call it cut mid-flight is
sent again (docs/architecture/failures.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from temporalio import activity

from durable_rlm.store.call_ledger import Claim, LedgerRows, call_key

log = logging.getLogger(__name__)

T = TypeVar("T")

LEASE_S = 15.0
"""How long a claim stands without its holder renewing it (every RENEW_EVERY_S, from a
thread of its own, so a busy event loop does not let it lapse): the wait, for a worker on
another host, before a dead worker's call is sent again."""
RENEW_EVERY_S = 5.0
POLL_S = 0.2
"""How often a step waiting for another worker's call looks at the ledger again."""
STORE_PATIENCE_S = 0.5
"""How long a call waits for the store to take its claim, or its reply, before it goes on
unrecorded: no heartbeat leaves meanwhile, and a model call's heartbeat timeout may be 3 s
(the attempt must still have its margin when it sends; activities/attempts.py)."""
PATIENCE_SLICE_S = 0.1
"""The patience is counted in slices of this length, none counting for more than two: a
stall of the event loop is not time the store took (_within_patience)."""


class CallLedger:
    """This worker's side of the ledger: its claims (as `holder`, on `host`), the calls it has
    in flight, and how it judges another worker on its host (`alive(holder)`: True, False, or
    None when it cannot tell; the worker's liveness lock answers it)."""

    def __init__(
        self,
        rows: LedgerRows,
        holder: str,
        host: str | None = None,
        alive: Callable[[str], bool | None] | None = None,
    ) -> None:
        self.rows = rows
        self.holder = holder
        self.host = host or socket.gethostname()
        self.alive = alive
        self._in_flight: dict[str, _Asked] = {}  # each call asked here, while its task keeps it
        self._renewing: threading.Thread | None = None
        self.taken_from_ledger = 0  # replies answered from the ledger: calls not paid twice
        self.waited_for = 0  # steps that waited for another attempt's call
        self.unrecorded = 0  # claims or replies the store refused (it was down or full)

    def key_here(self, call: int) -> tuple[str, str] | None:
        """The ledger's name of this activity's `call`-th request, and its episode's id; None
        outside an activity."""
        if not activity.in_activity():
            return None
        info = activity.info()
        key = call_key(
            info.workflow_namespace or "",
            info.workflow_id or "",
            info.workflow_run_id or "",
            info.activity_id,
            call,
        )
        return key, info.workflow_id or ""

    async def once(
        self,
        key: str,
        workflow_id: str,
        call: Callable[[], Awaitable[T]],
        encode: Callable[[T], bytes],
        decode: Callable[[bytes], T],
    ) -> T:
        """`call()` made at most once for `key` across every attempt and replay, whatever
        timed out: see the module's docstring. In this process one task answers a key, from
        its claim to its reply's record; a step run again meanwhile waits for its answer.
        Once the request is sent, the task goes on whether or not a step still waits; before
        that, when the last step waiting gives up, it stops and lets its claim go."""
        asked = self._in_flight.get(key)
        if asked is None:
            asked = _Asked(asyncio.get_running_loop().create_future())
            self._in_flight[key] = asked
            asked.keeping = asyncio.ensure_future(self._answer(key, workflow_id, call, encode, decode, asked))
            asked.keeping.add_done_callback(functools.partial(self._ended, key, asked))
        else:  # this call is asked here already: a step run again
            self.waited_for += 1
        asked.waiting += 1
        try:
            done: T = await asyncio.shield(asked.answer)
            return done
        finally:
            asked.waiting -= 1
            if asked.waiting == 0 and not asked.sending and not asked.answer.done() and asked.keeping:
                asked.keeping.cancel()

    async def _answer(
        self,
        key: str,
        workflow_id: str,
        call: Callable[[], Awaitable[T]],
        encode: Callable[[T], bytes],
        decode: Callable[[bytes], T],
        asked: _Asked,
    ) -> None:
        claiming = asyncio.ensure_future(
            asyncio.to_thread(self.rows.claim, key, workflow_id, self.holder, self.host, LEASE_S)
        )
        try:
            try:
                found = await _within_patience(claiming)
            except Exception:  # noqa: BLE001 - the store down, full or locked: see below
                # The SQL store cannot be reached (or is full, or a lock holds it past the
                # audit writes' patience): the call goes out unrecorded, as before the ledger,
                # rather than every episode waiting on the audit store. It is still this
                # process's call (a step run again here waits for it), and its reply or its
                # release waits for the claim, however late it lands, so that no claim of ours
                # stands without either.
                self.unrecorded += 1
                log.warning(
                    "call ledger: the store refused a claim; call %s sent unrecorded", key[:12], exc_info=True
                )
                await self._send(key, call, encode, asked, claiming)
                return
            waited = False
            while found is not None:
                if found.reply is not None:
                    self.taken_from_ledger += 1
                    asked.answer.set_result(decode(found.reply))
                    return
                if self._dead(found):
                    if await asyncio.to_thread(
                        self.rows.take_over, key, found.holder, self.holder, self.host, LEASE_S
                    ):
                        break
                else:
                    if not waited:
                        waited = True
                        self.waited_for += 1
                    await asyncio.sleep(POLL_S)
                found = await asyncio.to_thread(self.rows.read, key)
                if found is None:  # released meanwhile (no reply came): claim it again
                    found = await asyncio.to_thread(
                        self.rows.claim, key, workflow_id, self.holder, self.host, LEASE_S
                    )
        except asyncio.CancelledError:
            # Every step asking gave up before the request went out: nothing was sent, and a
            # claim of ours (now or when the store takes it) is let go for the next asker.
            claiming.add_done_callback(functools.partial(self._let_go, key))
            await asyncio.shield(asyncio.to_thread(self._release_quietly, key))
            raise
        await self._send(key, call, encode, asked)

    async def _send(
        self,
        key: str,
        call: Callable[[], Awaitable[T]],
        encode: Callable[[T], bytes],
        asked: _Asked,
        claiming: asyncio.Future[Claim | None] | None = None,
    ) -> None:
        """Send the claimed call and record its reply (or release the claim). `claiming` is a
        claim still on its way to the store (it took longer than the store's patience): the
        step gets its reply at once, and the record or the release waits for the claim. A
        failed call's steps get its error once the claim is let go (`_ended`), so one asked
        again claims anew."""
        asked.sending = True
        self._renew_while_in_flight()
        try:
            result = await call()
        except BaseException:
            if claiming is not None:  # the claim first, or the release would find no row
                await asyncio.wait({claiming})
            await asyncio.to_thread(self._release_quietly, key)
            raise
        if claiming is not None:
            asked.answer.set_result(result)
            await asyncio.wait({claiming})  # however late: the store's own timeout bounds it
        try:
            recording = asyncio.to_thread(self.rows.record, key, encode(result))
            await _within_patience(asyncio.ensure_future(recording))
        except Exception:  # noqa: BLE001 - the reply is paid for: the step gets it all the same
            self.unrecorded += 1
            log.warning("call ledger: the store refused the reply of call %s", key[:12], exc_info=True)
        if not asked.answer.done():
            asked.answer.set_result(result)

    def _release_quietly(self, key: str) -> None:
        with contextlib.suppress(Exception):  # a store down: the lease runs out instead
            self.rows.release(key, self.holder)

    def _let_go(self, key: str, claiming: asyncio.Future[Claim | None]) -> None:
        """A claim that landed after every step asking had given up: released, if ours."""
        if not claiming.cancelled() and claiming.exception() is None and claiming.result() is None:
            threading.Thread(target=self._release_quietly, args=(key,), daemon=True).start()

    def _ended(self, key: str, asked: _Asked, task: asyncio.Task[None]) -> None:
        if self._in_flight.get(key) is asked:
            del self._in_flight[key]
        if task.cancelled():
            _settle(asked.answer, asyncio.CancelledError())
            return
        error = task.exception()
        if error is not None:
            _settle(asked.answer, error)
            log.debug("call ledger: call %s failed: %r", key[:12], error)

    def _dead(self, found: Claim) -> bool:
        """Whether the holder of a claim without a reply can no longer send or record it."""
        if found.holder == self.holder:
            return True  # this process's, yet not in flight here: nothing will record it
        if found.lease_until < time.time():
            return True
        if found.host == self.host and self.alive is not None:
            return self.alive(found.holder) is False
        return False

    def _renew_while_in_flight(self) -> None:
        """Start the thread that renews this worker's leases (once: it idles while no call
        is in flight)."""
        if self._renewing is None:
            self._renewing = threading.Thread(target=self._renew, name="drlm-ledger-leases", daemon=True)
            self._renewing.start()

    def _renew(self) -> None:
        while True:
            time.sleep(RENEW_EVERY_S)
            if self._in_flight:
                with contextlib.suppress(Exception):  # a store down: the next renewal tries again
                    self.rows.renew(self.holder, LEASE_S)


async def _within_patience(work: asyncio.Future[T]) -> T:
    """`work`'s result, or TimeoutError after STORE_PATIENCE_S of waiting for the store. The
    work goes on either way (a write that lands late still lands). The patience counts the
    time this process's event loop ran, in short slices: a loop that stood still meanwhile (a
    step holding it, a paused process) did not let the store's answer in, and that is not
    the store's slowness. Without it a claim the store took at once was sent unrecorded after
    a stall, and a retry paid for it again."""
    waited = 0.0
    while True:
        began = time.monotonic()
        await asyncio.wait({work}, timeout=PATIENCE_SLICE_S)
        if work.done():
            return work.result()
        waited += min(time.monotonic() - began, 2 * PATIENCE_SLICE_S)
        if waited >= STORE_PATIENCE_S:
            work.add_done_callback(_read)  # its failure, if it fails late, is no one's news
            raise TimeoutError(f"the store took longer than {STORE_PATIENCE_S} s")


@dataclasses.dataclass
class _Asked:
    """A call asked in this process: the answer its steps wait for, the task that keeps it,
    how many steps wait, and whether its request has gone out."""

    answer: asyncio.Future[Any]
    keeping: asyncio.Task[None] | None = None
    waiting: int = 0
    sending: bool = False

    def __post_init__(self) -> None:
        self.answer.add_done_callback(_read)  # a step given up leaves no one to read it


def _settle(answer: asyncio.Future[Any], error: BaseException) -> None:
    """Give the waiting steps `error`, unless they have their answer already."""
    if answer.done():
        return
    if isinstance(error, asyncio.CancelledError):
        answer.cancel()
    else:
        answer.set_exception(error)


def _read(answer: asyncio.Future[Any]) -> None:
    if not answer.cancelled():
        answer.exception()
