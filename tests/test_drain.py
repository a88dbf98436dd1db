"""Graceful shutdown: SIGTERM drains a real worker process mid-call; the call it held
finishes there, its episode goes on on another worker, and no attempt fails or repeats.

History is the proof: every activity and local step ran once (attempt 1), none failed,
timed out or was cancelled, and the scripted server was asked each root turn once.
"""

from __future__ import annotations

import asyncio
import signal
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client

from durable_rlm.audit.history import repl_marker
from durable_rlm.client.episodes import start_episode
from durable_rlm.scripted import Reply, root_and_sub
from durable_rlm.settings import Settings
from durable_rlm.worker.runtime import Services, running_workers
from durable_rlm.workflows import defaults, names
from tests.conftest import request_for
from tests.test_crash import wait_until

FAILED = {
    EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED,
    EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT,
    EventType.EVENT_TYPE_ACTIVITY_TASK_CANCELED,
    EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED,
    EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT,
}


def attempts(events: list[HistoryEvent]) -> list[int]:
    """The attempt of every activity and local step: ActivityTaskStarted's, and the one
    the SDK records in each local step's marker."""
    found = [
        e.activity_task_started_event_attributes.attempt
        for e in events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED
    ]
    for event in events:
        step = repl_marker(event.marker_recorded_event_attributes)
        if step is not None:
            found.append(step["attempt"])
    return found


def pid_of(identity: str) -> int:
    return int(identity.split("@", 1)[0])  # the SDK's default worker identity: pid@host


def ran_by(events: list[HistoryEvent]) -> list[tuple[str, int]]:
    """Each activity started, in order: its type and the pid of the worker that ran it."""
    types = {
        e.event_id: e.activity_task_scheduled_event_attributes.activity_type.name
        for e in events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
    }
    return [
        (
            types[e.activity_task_started_event_attributes.scheduled_event_id],
            pid_of(e.activity_task_started_event_attributes.identity),
        )
        for e in events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED
    ]


@pytest.fixture(params=["sqlite", "postgresql"])
def stores(request: pytest.FixtureRequest, temporal_address: str, session_dir: Path):
    """Worker processes and a client sharing one store: the session's SQLite file, or a
    throwaway PostgreSQL 15 cluster (what a deployment of many workers shares)."""
    if request.param == "sqlite":
        return request.getfixturevalue("client"), request.getfixturevalue("worker_processes")
    url = request.getfixturevalue("postgres_url")
    return url, _pg_workers(temporal_address, url, request)


def _pg_workers(address: str, url: str, request: pytest.FixtureRequest):
    from tests.conftest import WorkerProcess

    started: list[WorkerProcess] = []
    queue = f"drain-pg-{uuid.uuid4().hex[:8]}"

    def start() -> WorkerProcess:
        worker = WorkerProcess(address, url, queue)
        started.append(worker)
        return worker

    start.queue = queue  # type: ignore[attr-defined]
    request.addfinalizer(lambda: [w.stop() for w in started])
    return start


async def _client_for(stores_value: object, temporal_address: str) -> Client:
    if isinstance(stores_value, Client):
        return stores_value
    from durable_rlm.store.blobs import BlobStore, SqlBackend
    from durable_rlm.store.codec import data_converter
    from durable_rlm.store.sql import open_store

    blobs = BlobStore(SqlBackend(open_store(str(stores_value))))
    return await Client.connect(temporal_address, data_converter=data_converter(blobs))


@pytest.mark.chaos
async def test_a_drained_worker_finishes_its_call_and_its_episode_goes_on_elsewhere(
    stores, scripted, temporal_address: str
) -> None:
    target, worker_processes = stores
    client = await _client_for(target, temporal_address)
    turns = [
        "```repl\nanswer = 6 * 7\n```",
        Reply(text="```repl\nresult = f'{answer}!'\n```", delay_s=3),
        "FINAL_VAR(result)",
    ]
    server = scripted(root_and_sub(turns))
    draining = worker_processes()
    episode_id = f"drain-{uuid.uuid4().hex[:6]}"
    handle = await start_episode(client, request_for(server), worker_processes.queue, episode_id)
    await wait_until(lambda: any(r.turn == 1 for r in server.root_requests()))
    signalled = time.monotonic()
    draining.process.send_signal(signal.SIGTERM)  # the model "thinks" about turn 1 for 3 s
    successor = worker_processes()
    result = await asyncio.wait_for(handle.result(), 30)
    code = await asyncio.to_thread(draining.process.wait, defaults.DRAIN_GRACE_S)
    drained_in = time.monotonic() - signalled

    assert result.answer == "42!"  # turn 1's cell ran on the successor, its REPL rebuilt
    assert code == 0 and drained_in < defaults.DRAIN_GRACE_S
    said = draining.output()
    assert "1 in flight finished (drlm.root_completion)" in said and "1 sandbox closed" in said, said
    sandboxes = Path(tempfile.gettempdir()) / "drlm-sandboxes"
    assert not list(sandboxes.glob(f"w-{draining.process.pid}-*"))  # closed, not left to a reaper
    assert [r.turn for r in server.root_requests()] == [0, 1, 2]  # each root call paid once

    events = list((await client.get_workflow_handle(episode_id).fetch_history()).events)
    failed = [e for e in events if e.event_type in FAILED]
    assert [e.event_type for e in failed] == [], [(e.event_id, str(e)[:600]) for e in failed]
    assert attempts(events) and set(attempts(events)) == {1}
    roots = [pid for name, pid in ran_by(events) if name == names.ROOT_COMPLETION]
    drained, took_over = draining.process.pid, successor.process.pid
    assert roots == [drained, drained, took_over]  # turn 1's call finished where it began
    tasks = [
        pid_of(e.workflow_task_started_event_attributes.identity)
        for e in events
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED
    ]
    assert tasks == [drained] * tasks.count(drained) + [took_over] * tasks.count(took_over)


async def test_an_idle_worker_drains_at_once_whatever_its_grace(
    client: Client, store, session_dir: Path
) -> None:
    reports = []
    settings = Settings(task_queue=f"drain-{uuid.uuid4().hex[:8]}", data_dir=session_dir)
    services = Services(settings, store[0], store[1], client)
    async with running_workers(services, drain_grace_s=defaults.DRAIN_GRACE_S, on_drained=reports.append):
        pass
    [report] = reports
    assert (report.finished, report.overran, report.sandboxes) == ((), (), 0)
    assert report.seconds < 5
