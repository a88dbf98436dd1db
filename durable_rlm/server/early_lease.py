"""A lease on the shared server, begun early on a thread of its own and claimed later by the
process's session (durable_rlm/server/embedded.py `acquire_early`, `acquire`).

Why: a one-off script's first episode imports the worker side (~1 s of CPU, the GIL held)
and then needs the server, whose start (~1.3 s: the supervisor's interpreter, the Temporal
binary, its database) runs in processes of their own. Begun before those imports, the two
overlap on a machine's two cores instead of following each other.

A lease no session claims within EARLY_CLAIM_S is let go, and `abandon` lets it go at once
(the caller failed before it connected), so asking early keeps no server up for long. A
claim cancelled while it waits lets the lease go once it is taken; a forked child forgets
its parent's. Keyed by the data directory; what a lease is, and how one is taken, is the
caller's (`take`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol, TypeVar


class Releasable(Protocol):
    def release(self) -> None: ...


Take = Callable[[], Coroutine[Any, Any, Releasable]]
"""How a lease is taken: a coroutine function, run on the lease's own thread and loop."""


L = TypeVar("L", bound=Releasable)

EARLY_CLAIM_S = 60.0
"""How long a lease taken early waits for its session before it is let go."""

_early_lock = threading.Lock()
_early: dict[Path, tuple[Future[Any], threading.Event]] = {}


def _forget_early_in_child() -> None:
    """A forked child has none of its parent's threads: a lease still being taken there would
    never arrive here, and one taken is the parent's to release. The child asks anew."""
    global _early_lock
    _early_lock = threading.Lock()
    _early.clear()


os.register_at_fork(after_in_child=_forget_early_in_child)


def begin(key: Path, take: Take) -> None:
    """Start taking `key`'s lease with `take` on a thread of its own (once until claimed)."""
    with _early_lock:
        if key in _early:
            return
        taken: Future[Any] = Future()
        claimed = threading.Event()
        _early[key] = (taken, claimed)
    threading.Thread(
        target=_take_early, args=(take, key, taken, claimed), name="drlm-server-lease", daemon=True
    ).start()


def _take_early(
    take: Callable[[], Coroutine[Any, Any, Releasable]],
    key: Path,
    taken: Future[Any],
    claimed: threading.Event,
) -> None:
    try:
        lease = asyncio.run(take())
    except BaseException as exc:  # noqa: BLE001 - the claiming `acquire` tries again itself
        taken.set_exception(exc)
        with _early_lock:
            if _early.get(key, (None,))[0] is taken:
                del _early[key]
        return
    taken.set_result(lease)
    if claimed.wait(EARLY_CLAIM_S):
        return
    _let_go(key, taken)


def _let_go(key: Path, taken: Future[Any]) -> None:
    """Release the early lease of `key` unless a session claimed it meanwhile."""
    with _early_lock:
        unclaimed = _early.get(key, (None,))[0] is taken
        if unclaimed:
            del _early[key]
    if unclaimed:
        _release_when_taken(taken)


def _release_when_taken(taken: Future[Any]) -> None:
    """The lease, released as soon as it is taken (at once if it already is)."""

    def release(done: Future[Any]) -> None:
        if done.exception() is None:
            done.result().release()

    taken.add_done_callback(release)


def abandon(key: Path) -> None:
    """Let `key`'s early lease go now (a bad setting, a failed import, Ctrl-C before the
    session claimed it): the server stops after its idle time as if never asked for."""
    with _early_lock:
        entry = _early.get(key)
    if entry is not None:
        _let_go(key, entry[0])
        entry[1].set()  # its thread need not wait out EARLY_CLAIM_S


async def claim(key: Path) -> Any:
    """The lease begun for `key` (waiting for it), or None: none was begun, or taking it
    failed (the caller's own attempt then says why, in its words). A claim cancelled while
    it waits (a timeout around the episode, Ctrl-C) lets the lease go once it is taken:
    nobody else will."""
    with _early_lock:
        entry = _early.pop(key, None)
    if entry is None:
        return None
    taken, claimed = entry
    claimed.set()
    try:
        return await _arrival(taken)
    except asyncio.CancelledError:
        _release_when_taken(taken)
        raise
    except Exception:  # noqa: BLE001 - see the docstring
        return None


def _arrival(taken: Future[L]) -> asyncio.Future[L]:
    """`taken`'s outcome on this event loop. Unlike `asyncio.wrap_future`, cancelling the
    wait leaves `taken` to its thread, and a loop closed before it arrives is no error."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[L] = loop.create_future()

    def settle(done: Future[L]) -> None:
        if waiter.done():
            return
        problem = done.exception()
        if problem is None:
            waiter.set_result(done.result())
        else:
            waiter.set_exception(problem)

    def arrived(done: Future[L]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(settle, done)

    taken.add_done_callback(arrived)
    return waiter
