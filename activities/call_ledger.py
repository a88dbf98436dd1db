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
        self._in_flight: dict[str, asyncio.Task[Any]] = {}
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
        timed out: see the module's docstring."""
        running = self._in_flight.get(key)
        if running is not None:  # this call is in flight here already: a step run again
            self.waited_for += 1
            done: T = await asyncio.shield(running)
            return done
        claiming = asyncio.ensure_future(
            asyncio.to_thread(self.rows.claim, key, workflow_id, self.holder, self.host, LEASE_S)
        )
        try:
            found = await _within_patience(claiming)
        except Exception:  # noqa: BLE001 - the store down, full or locked: see below
            # The SQL store cannot be reached (or is full, or a lock holds it past the audit
            # writes' patience): the call goes out unrecorded, as before the ledger, rather
            # than every episode waiting on the audit store. It still goes out as this
            # process's call in flight, so a step run again here meanwhile waits for it; and
            # its reply is recorded after the claim, should the claim land late.
            self.unrecorded += 1
            log.warning(
                "call ledger: the store refused a claim; call %s sent unrecorded", key[:12], exc_info=True
            )
            return await self._send(key, call, encode, claiming)
        waited = False
        while found is not None:
            if found.reply is not None:
                self.taken_from_ledger += 1
                return decode(found.reply)
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
        return await self._send(key, call, encode)

    async def _send(
        self,
        key: str,
        call: Callable[[], Awaitable[T]],
        encode: Callable[[T], bytes],
        claiming: asyncio.Future[Claim | None] | None = None,
    ) -> T:
        """Send the claimed call in a task of its own, which records its reply (or releases
        the claim) whether or not the step that started it still waits: a step given up
        meanwhile leaves the request to go on, and whoever asks next finds it in flight here
        until its reply is in the ledger. `claiming` is a claim still on its way to the store
        (it took longer than the store's patience): the reply waits for it before it is
        recorded, so that a claim landing late does not stand without its reply."""
        task: asyncio.Task[T] = asyncio.ensure_future(self._call_and_keep(key, call, encode, claiming))
        self._in_flight[key] = task
        task.add_done_callback(functools.partial(self._ended, key))
        self._renew_while_in_flight()
        return await asyncio.shield(task)

    async def _call_and_keep(
        self,
        key: str,
        call: Callable[[], Awaitable[T]],
        encode: Callable[[T], bytes],
        claiming: asyncio.Future[Claim | None] | None = None,
    ) -> T:
        try:
            result = await call()
        except BaseException:
            with contextlib.suppress(Exception):  # a store down: the lease runs out instead
                await asyncio.to_thread(self.rows.release, key, self.holder)
            raise
        try:
            if claiming is not None:  # the claim first, or the reply would find no row
                await asyncio.wait({claiming}, timeout=STORE_PATIENCE_S)
            recording = asyncio.to_thread(self.rows.record, key, encode(result))
            await _within_patience(asyncio.ensure_future(recording))
        except Exception:  # noqa: BLE001 - the reply is paid for: the step gets it all the same
            self.unrecorded += 1
            log.warning("call ledger: the store refused the reply of call %s", key[:12], exc_info=True)
        return result

    def _ended(self, key: str, task: asyncio.Task[Any]) -> None:
        if self._in_flight.get(key) is task:
            del self._in_flight[key]
        if not task.cancelled() and task.exception() is not None:
            log.debug("call ledger: call %s failed: %r", key[:12], task.exception())

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
            work.add_done_callback(_retrieved)  # its failure, if it fails late, is no one's news
            raise TimeoutError(f"the store took longer than {STORE_PATIENCE_S} s")


def _retrieved(work: asyncio.Future[Any]) -> None:
    if not work.cancelled() and work.exception() is not None:
        log.debug("call ledger: a store write that came late failed: %r", work.exception())
