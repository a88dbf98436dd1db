"""An infrastructure failure is waited out, never an ending (issue 37): a full disk under the
SQL store stops every write of an episode's steps; the episode says it waits for the store,
and answers right once the disk has room again. Real parts: a tmpfs of 16 MB as the disk,
SQLite on it for the audit and blob stores, the Temporal dev server, the real sandbox and
the real openai client against a scripted server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from temporalio.client import Client

from durable_rlm.audit.projection import rebuild_audit
from durable_rlm.client.episodes import start_episode
from durable_rlm.scripted import ChatRequest, Reply
from durable_rlm.settings import Settings
from durable_rlm.store.blobs import BlobStore, SqlBackend
from durable_rlm.store.codec import data_converter
from durable_rlm.store.outages import store_problem
from durable_rlm.store.sql import create_engine, open_store
from durable_rlm.worker.runtime import EmbeddedServer, Services, running_workers
from durable_rlm.workflows import names
from durable_rlm.workflows.models import DurabilitySettings, EpisodeProgress, EpisodeRequest, EpisodeResult
from tests.conftest import WorkerProcess, request_for
from tests.test_audit import table_rows


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 16 MB file system of the test's own (a tmpfs), so that it can be filled."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    root = Path(tempfile.mkdtemp(prefix="drlm-small-disk-", dir="/tmp"))
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(root)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode(errors='replace')}")
    try:
        yield root
    finally:
        subprocess.run(["umount", "-l", str(root)], capture_output=True)
        with contextlib.suppress(OSError):
            root.rmdir()


async def start_on(client: Client, queue: str, request: EpisodeRequest, episode_id: str, minutes: int = 4):
    """Start an episode on `queue` with an execution timeout that bounds a test that hangs."""
    return await client.start_workflow(
        names.WORKFLOW,
        request,
        id=episode_id,
        task_queue=queue,
        result_type=EpisodeResult,
        execution_timeout=timedelta(minutes=minutes),
    )


def fill(disk: Path) -> Path:
    """Write zeros until the disk is full; the filler file is returned so it can be removed."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (1 << 20, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * size)
    finally:
        os.close(fd)
    return filler


def test_a_full_disk_is_a_store_outage_not_a_model_error(small_disk: Path) -> None:
    engine = open_store(f"sqlite:///{small_disk / 'drlm.sqlite'}")
    blobs = BlobStore(SqlBackend(engine))
    filler = fill(small_disk)
    with pytest.raises(sa.exc.OperationalError) as raised:
        blobs.put(os.urandom(1 << 20))
    assert "database or disk is full" in (store_problem(raised.value) or "")
    filler.unlink()
    blobs.put(os.urandom(1 << 20))  # room again: the same store works
    assert store_problem(KeyError("sha256:00")) is None  # a missing blob is not an outage
    assert store_problem(ValueError("blob sha256:00 is corrupt")) is None


@pytest.mark.slow  # long end to end (issue 34: the default run near 13 min); CI runs it
async def test_a_full_disk_under_the_sql_store_is_waited_out(
    client, session_dir, scripted, small_disk
) -> None:
    engine = open_store(f"sqlite:///{small_disk / 'drlm.sqlite'}")
    blobs = BlobStore(SqlBackend(engine))
    filled: list[Path] = []
    lock = threading.Lock()

    def script(request: ChatRequest) -> Reply | str:
        if not request.is_root:
            return request.last_user.upper()
        if request.turn == 0:
            return "```repl\nx = llm_query('shout')\nprint(len(x))\n```"
        with lock:
            if not filled:  # the disk fills while the model answers: its reply cannot be stored
                filled.append(fill(small_disk))
        return "FINAL_VAR(x)"

    server = scripted(script)
    queue = f"full-disk-{uuid.uuid4().hex[:8]}"
    settings = Settings(task_queue=queue, data_dir=session_dir)
    async with running_workers(Services(settings, blobs, engine, client)):
        request = request_for(server)
        request = request.model_copy(
            update={"root_model": request.root_model.model_copy(update={"max_attempts": 2})}
        )
        handle = await start_on(client, queue, request, f"full-disk-{uuid.uuid4().hex[:8]}")
        phase = ""
        for _ in range(600):
            progress = await handle.query("progress", result_type=EpisodeProgress)
            phase = progress.phase
            if phase.startswith("waiting for the store"):
                break
            await asyncio.sleep(0.1)
        assert phase.startswith("waiting for the store: "), phase
        assert "database or disk is full" in phase
        description = await handle.describe()
        assert description.status is not None and description.status.name == "RUNNING"
        await asyncio.sleep(3)  # it goes on waiting: a full disk is no ending
        assert (await handle.describe()).status.name == "RUNNING"
        filled[0].unlink()  # the operator frees the disk
        result = await asyncio.wait_for(handle.result(), 120)
    assert (result.answer, result.ended_by, result.status) == ("SHOUT", "final_var", "answered")
    assert result.lost_cells == 0 and result.failure_cause is None


# --- the audit store tells the truth -------------------------------------------------------


def test_no_negative_cell_duration_is_stored() -> None:
    """Steps of one cell written by two workers whose clocks disagree: unknown, not < 0."""
    from datetime import UTC, datetime

    from durable_rlm.store.audit_rows import merge_cell

    started = {"started_at": datetime(2026, 11, 25, 12, 0, 10, tzinfo=UTC), "sub_calls": 0, "rebuilt": False}
    ended = {"ended_at": datetime(2026, 11, 25, 12, 0, 0, tzinfo=UTC), "sub_calls": 0, "rebuilt": False}
    assert merge_cell(started, ended)["duration_s"] is None
    later = {"ended_at": datetime(2026, 11, 25, 12, 0, 12, tzinfo=UTC), "sub_calls": 0, "rebuilt": False}
    assert merge_cell(started, later)["duration_s"] == 2.0


@pytest.mark.slow  # long end to end (issue 34: the default run near 13 min); CI runs it
async def test_the_closing_row_waits_for_the_audit_store(client, session_dir, scripted, small_disk) -> None:
    """The audit store's disk is full when the episode ends: its closing row is retried
    until the disk has room, and then says completed, with the answer."""
    from durable_rlm.store import schema
    from durable_rlm.store.blobs import DirectoryBackend

    engine = open_store(f"sqlite:///{small_disk / 'audit.sqlite'}")
    blobs = BlobStore(DirectoryBackend(session_dir / f"blobs-{uuid.uuid4().hex[:6]}"))
    filled: list[Path] = []

    def script(request: ChatRequest) -> Reply | str:
        if not filled:
            filled.append(fill(small_disk))  # full as the model gives its answer
        return "FINAL(forty-two)"

    server = scripted(script)
    queue = f"audit-full-{uuid.uuid4().hex[:8]}"
    episode_id = f"audit-full-{uuid.uuid4().hex[:8]}"
    async with running_workers(
        Services(Settings(task_queue=queue, data_dir=session_dir), blobs, engine, client)
    ):
        handle = await start_on(client, queue, request_for(server), episode_id)
        await asyncio.sleep(12)  # past AUDIT_CLOSE_S: the old bound would have given up
        assert (await handle.describe()).status.name == "RUNNING"  # still writing its row
        filled[0].unlink()
        result = await asyncio.wait_for(handle.result(), 60)
    assert result.answer == "forty-two"
    with engine.connect() as conn:
        row = conn.execute(
            sa.select(schema.episodes).where(schema.episodes.c.episode_id == episode_id)
        ).first()
    assert row is not None and (row.status, row.answer) == ("answered", "forty-two")


async def test_a_worker_settles_rows_left_running_as_it_starts(client, store, session_dir, scripted) -> None:
    """A worker killed while closing an episode left its row `running`: the next worker's
    reconciler settles it at start, not a minute later."""
    from durable_rlm.scripted import root_and_sub
    from durable_rlm.store import schema
    from tests.conftest import run_episode, workers_for

    blobs, engine = store
    server = scripted(root_and_sub(["FINAL(done)"]))
    queue = f"settle-{uuid.uuid4().hex[:8]}"
    async with workers_for(client, store, session_dir, queue):
        result = await run_episode(client, request_for(server), queue)
    where = schema.episodes.c.episode_id == result.episode_id
    with engine.begin() as conn:
        conn.execute(schema.episodes.update().where(where).values(status="running", answer=None))
    async with workers_for(client, store, session_dir, f"{queue}-next"):
        for _ in range(100):
            with engine.connect() as conn:
                row = conn.execute(sa.select(schema.episodes).where(where)).first()
            if row.status != "running":
                break
            await asyncio.sleep(0.1)
    assert (row.status, row.answer) == ("answered", "done")


@pytest.mark.slow
@pytest.mark.postgres
async def test_postgresql_stopped_for_25_s_mid_episode_is_waited_out(client, session_dir, scripted) -> None:
    """Issue 37's "done when": the episode's PostgreSQL store (audit and blobs) stops for 25 s
    while the model answers; the episode waits, says why, and answers right once it is back."""
    from durable_rlm.store.sql import create_engine, migrate
    from tests.conftest import PostgresCluster

    cluster = PostgresCluster()
    cluster.start()
    try:
        engine = create_engine(cluster.url)
        migrate(engine)
        blobs = BlobStore(SqlBackend(engine))
        stopped = threading.Event()

        def script(request: ChatRequest) -> Reply | str:
            if not request.is_root:
                return request.last_user.upper()
            if request.turn == 0:
                return "```repl\nx = llm_query('shout')\nprint(len(x))\n```"
            if not stopped.is_set():
                stopped.set()
                cluster.stop()  # PostgreSQL goes away as the model answers
            return "FINAL_VAR(x)"

        server = scripted(script)
        queue = f"pg-down-{uuid.uuid4().hex[:8]}"
        settings = Settings(task_queue=queue, data_dir=session_dir)
        async with running_workers(Services(settings, blobs, engine, client)):
            request = request_for(server)
            handle = await start_on(client, queue, request, f"pg-down-{uuid.uuid4().hex[:8]}", minutes=5)
            phases = []
            while not stopped.is_set():
                await asyncio.sleep(0.1)
            for _ in range(250):  # 25 s down
                phases.append((await handle.query("progress", result_type=EpisodeProgress)).phase)
                await asyncio.sleep(0.1)
            assert (await handle.describe()).status.name == "RUNNING"
            cluster.start()
            result = await asyncio.wait_for(handle.result(), 120)
        assert any(p.startswith("waiting for the store: ") for p in phases), sorted(set(phases))
        assert (result.answer, result.ended_by, result.status) == ("SHOUT", "final_var", "answered")
        assert result.lost_cells == 0
    finally:
        cluster.remove()


async def test_a_full_disk_during_a_cell_loses_no_cell(client, session_dir, scripted, small_disk) -> None:
    """The disk fills while a cell waits for its sub-call: the REPL step that resumes the cell
    cannot write the cell log. It waits for the store and goes on; the cell is not lost."""
    engine = open_store(f"sqlite:///{small_disk / 'drlm.sqlite'}")
    blobs = BlobStore(SqlBackend(engine))
    filled: list[Path] = []

    def script(request: ChatRequest) -> Reply | str:
        if request.is_root:
            return ["```repl\nx = llm_query('shout')\ny = x + '!'\n```", "FINAL_VAR(y)"][min(request.turn, 1)]
        if not filled:
            filled.append(fill(small_disk))
        return request.last_user.upper()

    server = scripted(script)
    queue = f"full-cell-{uuid.uuid4().hex[:8]}"
    async with running_workers(
        Services(Settings(task_queue=queue, data_dir=session_dir), blobs, engine, client)
    ):
        handle = await start_on(
            client, queue, request_for(server), f"full-cell-{uuid.uuid4().hex[:8]}", minutes=4
        )
        phase = ""
        for _ in range(600):
            phase = (await handle.query("progress", result_type=EpisodeProgress)).phase
            if phase.startswith("waiting for the store"):
                break
            await asyncio.sleep(0.1)
        assert phase.startswith("waiting for the store: "), phase
        filled[0].unlink()
        result = await asyncio.wait_for(handle.result(), 120)
    assert (result.answer, result.lost_cells, result.status) == ("SHOUT!", 0, "answered")


@pytest.mark.chaos
@pytest.mark.slow  # 21 s of SIGSTOP; the default run keeps the store-outage kind above
async def test_a_paused_worker_s_rows_never_stand_over_the_accepted_ones(tmp_path: Path, scripted) -> None:
    """A worker stopped (SIGSTOP) while its root call waits for the model: the call's attempt
    times out, another worker makes it again and finishes the episode. Resumed, the first
    completes its stale attempt (the server refuses it): its rows are fenced off (it stood
    still far past its heartbeat timeout), the episode's rows come from history, and a
    rebuild of the audit store finds nothing to change."""
    url = f"sqlite:///{tmp_path / 'audit.sqlite'}"
    engine = open_store(url)
    blobs = BlobStore(SqlBackend(engine))
    turns = [Reply("```repl\nx = 5\n```", delay_s=4), "FINAL_VAR(x)"]
    server = scripted(lambda r: turns[min(r.turn, 1)] if r.is_root else "-")
    async with EmbeddedServer(tmp_path / "temporal.sqlite") as address:
        client = await Client.connect(address, data_converter=data_converter(blobs))
        queue = f"zombie-{uuid.uuid4().hex[:6]}"
        request = request_for(server, durability=DurabilitySettings(task_timeout_s=2, heartbeat_timeout_s=3))
        first = WorkerProcess(address, url, queue)
        second = None
        try:
            handle = await start_episode(client, request, queue, f"zombie-{uuid.uuid4().hex[:6]}")
            for _ in range(300):
                if server.root_requests():
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # the root call waits for the model's reply
            first.process.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            second = WorkerProcess(address, url, queue)
            result = await asyncio.wait_for(handle.result(), 90)
            # Stopped past the fence's threshold, as a SIGSTOP of a worker usually is.
            await asyncio.sleep(max(0.0, 8.0 - (time.monotonic() - stopped)))
            first.process.send_signal(signal.SIGCONT)  # its step completes now: a zombie's
            await asyncio.sleep(6)  # its reconciler settles what it fenced (every 2 s)
        finally:
            first.process.send_signal(signal.SIGCONT)
            first.stop()
            if second is not None:
                second.stop()
        assert result.answer == "5"
        live = table_rows(engine)
        await rebuild_audit(client, engine)
        rebuilt = table_rows(create_engine(url))
    for table in live:
        assert rebuilt[table] == live[table], f"{table}: live {live[table]} rebuilt {rebuilt[table]}"
    durations = [r["duration_s"] for r in live["audit_cells"]]
    assert durations and all(d is None or d >= 0 for d in durations)


def test_a_cell_run_again_after_its_worker_was_killed_keeps_the_later_run() -> None:
    """Worker A completes a cell and dies (SIGKILL) before its task reaches the server; B
    runs the cell again, and history holds B's run. The later completion wins the row; a
    step that did not complete the cell never undoes one that did."""
    from datetime import UTC, datetime

    from durable_rlm.store.audit_rows import merge_cell

    def at(second: int) -> datetime:
        return datetime(2026, 11, 25, 12, 0, second, tzinfo=UTC)

    first = {
        "status": "completed",
        "stdout": "a",
        "stderr": "",
        "error": None,
        "sub_calls": 0,
        "rebuilt": False,
    }
    first |= {"started_at": at(0), "ended_at": at(1)}
    again = {
        "status": "completed",
        "stdout": "b",
        "stderr": "",
        "error": None,
        "sub_calls": 0,
        "rebuilt": True,
    }
    again |= {"started_at": at(10), "ended_at": at(12)}
    merged = merge_cell(first, again)
    assert (merged["stdout"], merged["ended_at"], merged["duration_s"]) == ("b", at(12), 2.0)
    running = {"status": "running", "sub_calls": 2, "rebuilt": False, "started_at": at(10)}
    kept = merge_cell(merged, running)
    assert (kept["status"], kept["stdout"], kept["ended_at"], kept["sub_calls"]) == (
        "completed",
        "b",
        at(12),
        2,
    )


@dataclass
class RefusedRow:
    """An episode whose sub-call's audit row meets a full disk: the store, its blobs (on
    another disk), the scripted model, and the filler to remove once the row was refused."""

    engine: sa.Engine
    blobs: BlobStore
    server: Any
    filled: list[Path]

    def workers(self, client, session_dir: Path, queue: str):  # type: ignore[no-untyped-def]
        settings = Settings(task_queue=queue, data_dir=session_dir)
        return running_workers(Services(settings, self.blobs, self.engine, client))

    def calls(self, episode_id: str) -> list[str]:
        from durable_rlm.store import schema

        table = schema.model_calls
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(table.c.call_id).where(table.c.episode_id == episode_id))
            return list(rows.scalars())


def refused_row(session_dir: Path, scripted, small_disk: Path) -> RefusedRow:  # type: ignore[no-untyped-def]
    from durable_rlm.store.blobs import DirectoryBackend

    engine = open_store(f"sqlite:///{small_disk / 'audit.sqlite'}")
    blobs = BlobStore(DirectoryBackend(session_dir / f"blobs-{uuid.uuid4().hex[:6]}"))
    filled: list[Path] = []

    def script(request: ChatRequest) -> Reply | str:
        if not request.is_root:
            if not filled:
                filled.append(fill(small_disk))  # full while the sub-call's row is written
            return request.last_user.upper()
        return ["```repl\nx = llm_query('shout')\n```", "FINAL_VAR(x)"][min(request.turn, 1)]

    return RefusedRow(engine, blobs, scripted(script), filled)


async def test_rows_the_store_refused_are_settled_once_it_is_back(
    client, session_dir, scripted, small_disk
) -> None:
    """A step's rows that could not be written (the audit store's disk full) are written
    from history by the worker's reconciler once the store answers again."""
    episode = refused_row(session_dir, scripted, small_disk)
    queue = f"settle-full-{uuid.uuid4().hex[:8]}"
    episode_id = f"settle-full-{uuid.uuid4().hex[:8]}"
    async with episode.workers(client, session_dir, queue):
        handle = await start_on(client, queue, request_for(episode.server), episode_id)
        for _ in range(300):
            if episode.filled:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(3)
        episode.filled[0].unlink()
        assert (await asyncio.wait_for(handle.result(), 120)).answer == "SHOUT"
        calls: list[str] = []
        for _ in range(100):  # the reconciler looks every 2 s while something is unsettled
            calls = episode.calls(episode_id)
            if "sub:1.0" in calls:
                break
            await asyncio.sleep(0.2)
    assert "sub:1.0" in calls, calls


async def test_drlm_list_refreshed_shows_what_a_running_episode_says_of_itself(
    tmp_path: Path, scripted
) -> None:
    """`drlm list --refresh` takes a running episode's status from the episode itself (its
    DrlmStatus attribute: waiting for the store, paused, awaiting approval), which its audit
    row cannot say (while it waits for the store, that row's store is the one down). Shown
    here with a pause; and during a store outage, a CLI says so in one line."""
    from durable_rlm.client.steering import pause_episode
    from durable_rlm.workflows.metadata import SEARCH_ATTRIBUTES

    url = f"sqlite:///{tmp_path / 'drlm.sqlite'}"
    engine = open_store(url)
    blobs = BlobStore(SqlBackend(engine))
    server = scripted(lambda r: Reply("```repl\nx = 1\n```", delay_s=0.5))
    registered = tuple(
        a for name, kind in SEARCH_ATTRIBUTES for a in ("--search-attribute", f"{name}={kind}")
    )
    async with EmbeddedServer(tmp_path / "temporal.sqlite", extra_args=registered) as address:
        client = await Client.connect(address, data_converter=data_converter(blobs))
        queue = f"list-live-{uuid.uuid4().hex[:6]}"
        settings = Settings(task_queue=queue, data_dir=tmp_path)
        async with running_workers(Services(settings, blobs, engine, client)):
            handle = await start_episode(client, request_for(server), queue, f"held-{uuid.uuid4().hex[:6]}")
            await pause_episode(client, handle.id, "alice")
            for _ in range(300):
                if (await handle.query("progress", result_type=EpisodeProgress)).phase.startswith("paused"):
                    break
                await asyncio.sleep(0.1)
            environ = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "DRLM_"))}
            environ.update(TEMPORAL_ADDRESS=address, DRLM_DATABASE_URL=url, DRLM_DATA_DIR=str(tmp_path))
            drlm = str(Path(sys.executable).with_name("drlm"))
            listed = subprocess.run(
                [drlm, "list", "--refresh", "--json"], capture_output=True, text=True, env=environ, timeout=60
            )
            stored = subprocess.run(
                [drlm, "list", "--json"], capture_output=True, text=True, env=environ, timeout=60
            )
            await handle.terminate("done looking")
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [(r["episode_id"], r["status"]) for r in rows] == [(handle.id, "paused")], listed.stderr
    assert [json.loads(line)["status"] for line in stored.stdout.splitlines()] == ["running"]


def test_a_cli_facing_a_full_store_says_so_in_one_line(tmp_path: Path, small_disk: Path) -> None:
    url = f"sqlite:///{small_disk / 'drlm.sqlite'}"
    open_store(url).dispose()
    filler = fill(small_disk)
    try:
        environ = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "DRLM_"))}
        environ.update(TEMPORAL_ADDRESS="127.0.0.1:9", DRLM_DATABASE_URL=url, DRLM_DATA_DIR=str(tmp_path))
        drlm = str(Path(sys.executable).with_name("drlm"))
        out = subprocess.run(
            [drlm, "list", "--refresh"], capture_output=True, text=True, env=environ, timeout=60
        )
    finally:
        filler.unlink()
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip().splitlines() == [out.stderr.strip()], out.stderr  # one line
    assert "drlm: the store is unavailable: OperationalError" in out.stderr  # full: "disk I/O error"


async def test_rows_refused_by_a_process_that_died_are_settled_when_the_episode_closes(
    client, session_dir, scripted, small_disk
) -> None:
    """A step's rows the store refused are remembered only by the process that ran the step,
    for its reconciler. Here that memory is lost (as when the process is SIGKILLed before
    the store answers again: the soak found a row missing that way); the episode's closing
    audit write settles its rows from history, so the row is there when the episode ends."""
    from durable_rlm.activities.audit import UNSETTLED, take_unsettled

    episode = refused_row(session_dir, scripted, small_disk)
    queue = f"settle-lost-{uuid.uuid4().hex[:8]}"
    episode_id = f"settle-lost-{uuid.uuid4().hex[:8]}"
    async with episode.workers(client, session_dir, queue):
        handle = await start_on(client, queue, request_for(episode.server), episode_id)
        for _ in range(600):
            if episode_id in UNSETTLED:
                break
            await asyncio.sleep(0.05)
        assert episode_id in UNSETTLED, "the sub-call's row was refused"
        take_unsettled()  # the process that knew is gone
        episode.filled[0].unlink()
        assert (await asyncio.wait_for(handle.result(), 120)).answer == "SHOUT"
        calls = episode.calls(episode_id)
    assert "sub:1.0" in calls, calls
