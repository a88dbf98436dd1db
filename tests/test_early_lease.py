"""The shared server asked for early (durable_rlm/server/embedded.py `acquire_early`): the
Python API begins taking the lease, starting the server if it is down, before it imports the
worker side, so the two overlap; the session then takes that very lease. Pinned here: the
session gets the early lease (one supervisor, one lease file), a lease nobody claims is let
go, a failed early attempt leaves the error to the session's own, and constructing the API
objects imports no worker side (there would be nothing left to overlap)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from durable_rlm.server import embedded
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
    monkeypatch.setattr(embedded, "EARLY_CLAIM_S", 0.5)
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


def test_constructing_the_api_objects_imports_no_worker_side() -> None:
    """`RLM(...)` and `DurableRLM(...)` check everything, and leave the worker side (the
    stores, temporalio's worker) to the first episode, which imports it while the server
    starts beside it."""
    code = (
        "import sys\n"
        "from durable_rlm import RLM, DurableRLM\n"
        "DurableRLM('gpt-x', base_url='http://127.0.0.1:9/v1', max_iterations=3)\n"
        "kwargs = {'model_name': 'gpt-x', 'base_url': 'http://127.0.0.1:9/v1', 'api_key': 'k'}\n"
        "RLM(backend='openai', backend_kwargs=kwargs, max_iterations=3)\n"
        "watched = ('sqlalchemy', 'temporalio.worker', 'durable_rlm.worker.runtime',"
        " 'durable_rlm.activities.llm')\n"
        "print(' '.join(m for m in watched if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == []
