"""The shared server asked for early (durable_rlm/server/embedded.py `acquire_early`): the
Python API begins taking the lease, starting the server if it is down, before it imports the
worker side, so the two overlap; the session then takes that very lease. Pinned here: the
session gets the early lease (one supervisor, one lease file), a lease nobody claims is let
go, a failed early attempt leaves the error to the session's own, a cancelled claim and a
failed session let it go, and a forked child asks anew. That constructing the API objects
imports no worker side (there would be nothing left to overlap) is tests/test_startup.py's."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest

from durable_rlm.server import early_lease, embedded
from durable_rlm.server.embedded import ServerFiles, acquire, acquire_early
from durable_rlm.settings import ConfigurationError, Settings


async def test_the_session_takes_the_lease_asked_for_early(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", server_idle_s=1, ui=False)
    files = ServerFiles.of(settings)
    acquire_early(settings)
    acquire_early(settings)  # asked twice: still one attempt
    lease = await acquire(settings)
    try:
        state = files.read_state()
        assert state is not None and state["address"] == lease.address
        assert files.live_leases() == [lease.path]  # the early lease is the session's, not a second
        again = await acquire(settings)  # nothing early any more: an ordinary lease
        assert again.path != lease.path and again.address == lease.address
        again.release()
    finally:
        lease.release()


async def test_an_unclaimed_early_lease_is_let_go(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(early_lease, "EARLY_CLAIM_S", 0.5)
    settings = Settings(data_dir=tmp_path / "data", server_idle_s=1, ui=False)
    files = ServerFiles.of(settings)
    acquire_early(settings)
    deadline = time.monotonic() + 60
    while files.read_state() is None or not files.live_leases():
        assert time.monotonic() < deadline, "the early lease was never taken"
        await asyncio.sleep(0.05)
    while files.live_leases():  # let go after EARLY_CLAIM_S...
        assert time.monotonic() < deadline, "the unclaimed lease was kept"
        await asyncio.sleep(0.05)
    while files.read_state() is not None:  # ...and the server idles out as with no client
        assert time.monotonic() < deadline, "the server outlived its idle time"
        await asyncio.sleep(0.1)


async def test_a_failed_early_attempt_leaves_the_error_to_the_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(data_dir=tmp_path / "data", server_idle_s=1, ui=False)
    attempts: list[str] = []

    async def refused(settings: Settings) -> embedded.Lease:
        attempts.append(threading.current_thread().name)
        raise ConfigurationError(f"refused, attempt {len(attempts)}")

    monkeypatch.setattr(embedded, "_acquire", refused)
    acquire_early(settings)
    with pytest.raises(ConfigurationError, match="attempt 2"):  # its own attempt, its own words
        await acquire(settings)
    assert attempts == ["drlm-server-lease", "MainThread"]
    with pytest.raises(ConfigurationError, match="attempt 3"):  # nothing early is left over
        await acquire(settings)


def slow_leases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, delay_s: float) -> list[Path]:
    """`_acquire` without a server: a lease file, made after `delay_s` (a server starting)."""
    made: list[Path] = []

    async def slow(settings: Settings) -> embedded.Lease:
        await asyncio.sleep(delay_s)
        path = tmp_path / f"lease-{len(made)}"
        path.touch()
        made.append(path)
        return embedded.Lease(path, "127.0.0.1:1")

    monkeypatch.setattr(embedded, "_acquire", slow)
    return made


async def until_gone(paths: list[Path], expected: int) -> None:
    deadline = time.monotonic() + 30
    while len(paths) < expected or any(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"leases kept: {[p.name for p in paths if p.exists()]}"
        await asyncio.sleep(0.02)


async def test_a_claim_cancelled_while_the_server_starts_lets_the_lease_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A timeout around the episode (or Ctrl-C) cancels the wait; the lease, taken after,
    is released, and the thread that took it ends without an error."""
    made = slow_leases(tmp_path, monkeypatch, 0.5)
    settings = Settings(data_dir=tmp_path / "data")
    errors: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    acquire_early(settings)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(acquire(settings), 0.1)
    await until_gone(made, 1)
    assert errors == []


async def test_a_session_that_fails_before_it_connects_lets_the_early_lease_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DurableRLM asks for the server before its imports; a failure after that and before its
    session took the lease (here: the stores refused) releases it at once, not in 60 s."""
    from durable_rlm import DurableRLM
    from durable_rlm.server import connection

    made = slow_leases(tmp_path, monkeypatch, 0.2)

    def refused(settings: Settings) -> None:
        raise RuntimeError("the store refused")

    monkeypatch.setattr(connection, "open_stores", refused)
    settings = Settings(data_dir=tmp_path / "data")
    rlm = DurableRLM("gpt-x", base_url="http://127.0.0.1:9/v1", api_key="k", settings=settings)
    with pytest.raises(RuntimeError, match="the store refused"):
        await rlm.open()
    await until_gone(made, 1)
    assert not early_lease._early


def test_a_forked_child_asks_anew(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fork while the lease is being taken: the child has no thread to finish it and does
    not share the parent's; it takes its own."""
    made = slow_leases(tmp_path, monkeypatch, 0.5)
    settings = Settings(data_dir=tmp_path / "data")
    acquire_early(settings)
    pid = os.fork()
    if pid == 0:  # the child: its own lease, in time
        code = 1
        try:
            lease = asyncio.run(asyncio.wait_for(acquire(settings), 5))
            code = 0 if lease.path.exists() else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    lease = asyncio.run(acquire(settings))  # the parent's own early lease, taken once
    assert lease.path.exists() and made == [lease.path]
