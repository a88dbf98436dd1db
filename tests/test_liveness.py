"""A liveness signal of our own (durable_rlm/worker/liveness.py,
docs/architecture/failures.md): a dead worker's calls are retried as soon as another worker
on the machine sees its lock free, not after their heartbeat timeout; a live worker, even
one that does not run at all for a while (SIGSTOP), keeps its lock, and its call is paid
once."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType, TaskQueueKind
from temporalio.client import Client, WorkflowHandle

from durable_rlm.client.attendance import liveness_folder, lock_held, poller_alive, this_host
from durable_rlm.client.episodes import start_episode
from durable_rlm.client.steering import decide_cell
from durable_rlm.scripted import Reply, root_and_sub
from durable_rlm.settings import Settings
from durable_rlm.worker.liveness import (
    HELD_NAME,
    LOCK_SUFFIX,
    PENDING_STALE_S,
    REAPING_SUFFIX,
    LivenessUnavailable,
    WorkerLiveness,
    _find_dead,
    _finish,
)
from durable_rlm.workflows import defaults, names
from durable_rlm.workflows.models import DurabilitySettings
from tests.conftest import request_for
from tests.test_crash import wait_until
from tests.test_steering import until, waiting

pytestmark = pytest.mark.chaos

STICKY = TaskQueueKind.TASK_QUEUE_KIND_STICKY
SLOW_HEARTBEAT = DurabilitySettings(heartbeat_timeout_s=60, sticky_schedule_to_start_s=3)
"""A heartbeat timeout far longer than the tests: whatever retries a call, it is not that."""


async def root_call_attempts(client: Client, episode_id: str) -> list[tuple[int, str]]:
    """(attempt, the last failure's type) of each root call's started attempt, in order."""
    scheduled: dict[int, str] = {}
    found = []
    async for event in client.get_workflow_handle(episode_id).fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            scheduled[event.event_id] = event.activity_task_scheduled_event_attributes.activity_type.name
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            started = event.activity_task_started_event_attributes
            if scheduled.get(started.scheduled_event_id) == names.ROOT_COMPLETION:
                failure = started.last_failure.application_failure_info.type
                found.append((started.attempt, failure))
    return found


async def in_second_call(client: Client, scripted, worker_processes, turns: list, prefix: str):  # type: ignore[no-untyped-def]
    """An episode on a first worker process, once its second root call (turn 1) is in flight:
    (that worker, the model server, the episode's handle, its id)."""
    server = scripted(root_and_sub(turns, lambda p: p))
    first = worker_processes()
    episode_id = f"{prefix}-{uuid.uuid4().hex[:6]}"
    handle = await start_episode(
        client, request_for(server, durability=SLOW_HEARTBEAT), worker_processes.queue, episode_id
    )
    await wait_until(lambda: any(r.turn == 1 for r in server.root_requests()))
    return first, server, handle, episode_id


async def test_a_killed_worker_s_call_is_retried_when_a_new_worker_starts_not_after_its_timeout(
    client, scripted, worker_processes
) -> None:
    turns = [
        "```repl\nx = 6 * 7\n```",
        Reply(text="```repl\nresult = str(x)\n```", delay_s=4),
        "FINAL_VAR(result)",
    ]
    started = await in_second_call(client, scripted, worker_processes, turns, "lost")
    first, server, handle, episode_id = started
    first.kill()  # mid-call, its lock released by the kernel
    killed = time.monotonic()
    worker_processes()  # looks at the machine's workers as it starts
    result = await asyncio.wait_for(handle.result(), 50)
    assert time.monotonic() - killed < SLOW_HEARTBEAT.heartbeat_timeout_s  # not the timeout's doing
    assert result.answer == "42"
    attempts = await root_call_attempts(client, episode_id)
    # The cut call's retry says why: the worker died (not a heartbeat timeout), at attempt 2.
    assert (2, names.WORKER_LOST) in attempts, attempts
    assert sorted(r.turn for r in server.root_requests()) == [0, 1, 1, 2]


async def test_a_stopped_but_living_worker_keeps_its_call(client, scripted, worker_processes) -> None:
    """SIGSTOP: the worker runs not at all for 4 s, as under the heaviest load, while another
    worker looks every second. Its lock holds; its call is not failed, and is paid once."""
    turns = ["```repl\nx = 1\n```", Reply(text="FINAL(kept)", delay_s=2)]
    started = await in_second_call(client, scripted, worker_processes, turns, "alive")
    first, server, handle, episode_id = started
    first.process.send_signal(signal.SIGSTOP)
    try:
        worker_processes()  # its first look is at its start; then one each second
        await asyncio.sleep(4)
    finally:
        first.process.send_signal(signal.SIGCONT)
    result = await asyncio.wait_for(handle.result(), 50)
    assert result.answer == "kept"
    assert [r.turn for r in server.root_requests()] == [0, 1]  # no call paid twice
    assert all(failure != names.WORKER_LOST for _, failure in await root_call_attempts(client, episode_id))


@pytest.mark.slow  # ~18 s; the default run keeps the killed worker's call above
async def test_a_killed_worker_s_idle_episode_moves_at_once_not_after_its_sticky_timeout(
    client, scripted, worker_processes
) -> None:
    """An episode waiting for a person (a cell to approve) has no call in flight: only the
    dead worker's record of the episodes it held tells a new worker to give it back. Its
    next workflow task then goes straight to the live worker; without the record it waited
    on the dead worker's sticky queue for the schedule-to-start timeout."""
    server = scripted(root_and_sub(["```repl\nx = 6 * 7\n```", "FINAL_VAR(x)"], lambda p: p))
    first = worker_processes()
    episode_id = f"idle-{uuid.uuid4().hex[:6]}"
    handle = await start_episode(
        client,
        request_for(server, approve="all", durability=SLOW_HEARTBEAT),
        worker_processes.queue,
        episode_id,
    )
    await until(client, episode_id, waiting(1))
    folder = liveness_folder(Settings().data_dir)
    ledgers = [p for p in folder.iterdir() if p.name.startswith(f"{first.process.pid}-") and p.is_dir()]
    assert len(ledgers) == 1, ledgers
    record = ledgers[0] / HELD_NAME  # written down within a second
    await wait_until(lambda: record.exists() and episode_id in record.read_text())
    before = await sticky_queues(handle)
    dead_queues = set(before.values())
    assert dead_queues  # the episode was on the first worker's sticky queue
    first.kill()
    killed = time.monotonic()
    worker_processes()  # looks at the machine's workers as it starts
    await wait_until(lambda: not ledgers[0].exists())  # reaped: its record handled and removed
    approved = time.monotonic()
    # Well within the sticky timeout of the kill: the server's own routing has not moved it.
    assert approved - killed < defaults.STICKY_TIMEOUT_S - 2
    decided = await decide_cell(client, f"{episode_id}#1", True, "bob")
    assert decided.accepted, decided.message
    result = await asyncio.wait_for(handle.result(), 40)
    assert result.answer == "42"
    assert time.monotonic() - approved < defaults.STICKY_TIMEOUT_S
    after = {queue for event_id, queue in (await sticky_queues(handle)).items() if event_id > max(before)}
    assert after and not dead_queues & after  # its next tasks: the new worker's queue
    timed_out = [
        event.workflow_task_timed_out_event_attributes.timeout_type
        async for event in handle.fetch_history_events()
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT
    ]
    assert timed_out == []  # no task waited on the dead worker's sticky queue


async def test_a_dead_worker_s_held_episodes_are_given_back_and_its_record_removed(
    tmp_path: Path, client: Client
) -> None:
    """The record of held episodes, as a reaper reads it: the episodes it names are given
    back (an unknown one is the server's answer too), what is not a pair of ids is passed
    over, and it goes with the ledger, an unfinished write of it too. Another server's
    record is left to that server's workers while it is recent, dropped once old. Through a
    linked ledger nothing is read or removed."""
    folder = tmp_path / "workers"
    me = WorkerLiveness(folder, client).start()
    target = str(client.service_client.config.target_host)
    episodes = [["w-1", "r-1"], ["w-2", "r-2"], ["w-1", "r-1"], ["w-3"], [1, 2], "w-4", ["", "r"]]
    held = {"target": target, "namespace": client.namespace, "written": time.time(), "episodes": episodes}
    elsewhere = {**held, "target": "10.0.0.9:7233"}
    precious = tmp_path / "precious"
    precious.mkdir()
    for name in (HELD_NAME, f".{HELD_NAME}.new"):
        (precious / name).write_text(json.dumps(held))
    holders = [
        dead_worker(folder, "1-ours", {HELD_NAME: held, f".{HELD_NAME}.new": "torn"}),
        dead_worker(folder, "2-elsewhere-recent", {HELD_NAME: elsewhere}),
        dead_worker(folder, "3-elsewhere-old", {HELD_NAME: {**elsewhere, "written": time.time() - 3600}}),
        dead_worker(folder, "4-linked", {}),
    ]
    (folder / "4-linked").rmdir()
    (folder / "4-linked").symlink_to(precious)
    for holder in holders:
        holder.kill()
        holder.wait()
    report = await me.reap()
    assert sorted(report.dead_workers) == ["1-ours", "2-elsewhere-recent", "3-elsewhere-old", "4-linked"]
    assert report.handed_back == 2 and report.kept == 1
    assert not [p for p in folder.iterdir() if p.name.startswith(("1-", "3-", ".1-", ".3-"))]
    assert [p.name for p in (folder / "2-elsewhere-recent").iterdir()] == [HELD_NAME]
    assert sorted(p.name for p in precious.iterdir()) == sorted([HELD_NAME, f".{HELD_NAME}.new"])
    me.close()


async def test_a_worker_writes_down_the_episodes_it_holds_whole_and_only_when_they_change(
    tmp_path: Path, client: Client
) -> None:
    folder = tmp_path / "workers"
    me = WorkerLiveness(folder, client).start()
    held = [("w-1", "r-1")]
    me.held = lambda: held
    os.mkfifo(me.ledger / f".{HELD_NAME}.new")  # a write cut short, or planted: never opened
    await asyncio.wait_for(me.write_held(), 10)
    record = me.ledger / HELD_NAME
    assert json.loads(record.read_text())["episodes"] == [["w-1", "r-1"]]
    written = record.stat().st_mtime_ns
    await me.write_held()
    assert record.stat().st_mtime_ns == written  # unchanged: not written again
    held = [(f"w-{i:06}-{'x' * 200}", f"r-{i}") for i in range(30_000)]  # past MAX_HELD_BYTES
    await me.write_held()
    kept = json.loads(record.read_text())["episodes"]
    assert 0 < len(kept) < 30_000 and record.stat().st_size <= 4 * 1024 * 1024  # as many as fit
    assert sorted(p.name for p in me.ledger.iterdir()) == [HELD_NAME]  # no half-written file left
    me.close()
    assert not me.ledger.exists()


async def sticky_queues(handle: WorkflowHandle[Any, Any]) -> dict[int, str]:
    """The sticky queue each of an episode's workflow tasks was scheduled on, by event id."""
    found = {}
    async for event in handle.fetch_history_events():
        queue = event.workflow_task_scheduled_event_attributes.task_queue
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED and queue.kind == STICKY:
            found[event.event_id] = queue.name
    return found


HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
print("held", flush=True)
time.sleep(600)
"""


def dead_worker(folder: Path, name: str, records: dict[str, dict]) -> subprocess.Popen:
    """A process holding a worker's lock, with a ledger of records; the caller kills it."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder / f"{name}{LOCK_SUFFIX}")],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    (folder / name).mkdir(mode=0o700)
    for file, entry in records.items():
        (folder / name / file).write_text(json.dumps(entry) if isinstance(entry, dict) else entry)
    return holder


async def test_a_look_reaps_only_dead_workers_and_drops_what_it_cannot_act_on(
    tmp_path: Path, client: Client
) -> None:
    folder = tmp_path / "workers"
    me = WorkerLiveness(folder, client).start()
    neighbour = WorkerLiveness(folder, client).start()  # alive, in this very process
    target = str(client.service_client.config.target_host)
    token = base64.b64encode(b"not a task token the server made").decode()
    mine = {"token": token, "target": target, "namespace": client.namespace, "started": time.time()}
    records = {
        "ours.json": {**mine, "workflow_id": "w", "run_id": "r", "activity_type": "a", "attempt": 1},
        "torn.json": '{"token": "abc',
        "bad-token.json": {**mine, "token": "a"},
        "fresh-elsewhere.json": {**mine, "target": "10.0.0.9:7233"},
        "old-elsewhere.json": {**mine, "target": "10.0.0.9:7233", "started": 0.0},
    }
    holder = dead_worker(folder, "4242-dead", records)
    alive = await me.reap()
    assert alive.dead_workers == [] and alive.failed == []  # its holder lives: nothing touched
    assert len(list((folder / "4242-dead").iterdir())) == 5
    holder.kill()
    holder.wait()
    report = await me.reap()
    assert report.dead_workers == ["4242-dead"]
    assert report.gone == 1  # the server knows no such attempt: dropped, nothing failed
    assert report.dropped == 3  # torn, an undecodable token, past every timeout
    assert report.kept == 1  # another server's, recent: that server's workers will reap it
    assert [p.name for p in (folder / "4242-dead").iterdir()] == ["fresh-elsewhere.json"]
    assert (folder / f"4242-dead{LOCK_SUFFIX}").exists()  # kept while its ledger is not empty
    # The neighbour in this process holds its own lock (flock is per open file, not per process).
    assert neighbour.ledger.is_dir() and (await neighbour.reap()).dead_workers == ["4242-dead"]
    neighbour.close()
    me.close()
    # Kept for the next look: the record, the lock, and the reaping file a reaper takes.
    assert sorted(p.name for p in folder.iterdir()) == [
        f".4242-dead{REAPING_SUFFIX}",
        "4242-dead",
        f"4242-dead{LOCK_SUFFIX}",
    ]


async def test_a_reaper_at_work_never_makes_a_dead_worker_read_as_alive(
    tmp_path: Path, client: Client
) -> None:
    """While a look handles a dead worker (its calls to the server take seconds on a loaded
    machine), the dead worker's lock stays free: the commands and pages asking who runs an
    episode, and the call ledger, read it dead; a second reaper keeps off until it is done.
    (A reaper that held the lock itself made a killed worker's episode page say it still
    ran, and its cancel wait for it: tests/test_unattended.py.)"""
    folder = tmp_path / "workers"
    me = WorkerLiveness(folder, client).start()
    holder = dead_worker(folder, "4242-dead", {"torn.json": '{"token": "abc'})
    holder.kill()
    holder.wait()
    taken = await asyncio.to_thread(_find_dead, folder, me.worker_id)  # a look's first step
    assert [worker.worker_id for worker in taken] == ["4242-dead"]
    assert lock_held(folder, "4242-dead") is False
    assert not poller_alive(f"{holder.pid}@{this_host()} drlm-worker 4242-dead", folder)
    assert me.holder_alive("4242-dead") is False
    other = WorkerLiveness(folder, client).start()
    assert (await other.reap()).dead_workers == []  # the first reaper has it
    taken[0].done.extend(path for path, _ in taken[0].records)
    await asyncio.to_thread(_finish, taken)
    assert not [p.name for p in folder.iterdir() if "4242" in p.name]
    other.close()
    me.close()


async def test_planted_files_neither_block_a_look_nor_steer_what_it_removes(
    tmp_path: Path, client: Client
) -> None:
    """What a look meets in a dead worker's ledger that is not a record: a FIFO (read, it
    would block the worker's event loop), a link to /dev/zero (an endless read), a ledger
    that is a link to another folder (its files would be removed as torn records)."""
    folder = tmp_path / "workers"
    me = WorkerLiveness(folder, client).start()
    first = dead_worker(folder, "1-fifo", {})
    os.mkfifo(folder / "1-fifo" / "pipe.json")
    (folder / "1-fifo" / "zero.json").symlink_to("/dev/zero")
    elsewhere = tmp_path / "precious"
    elsewhere.mkdir()
    (elsewhere / "keep.json").write_text("not a record")
    second = dead_worker(folder, "2-link", {})
    (folder / "2-link").rmdir()
    (folder / "2-link").symlink_to(elsewhere)
    (folder / f"3-dir{LOCK_SUFFIX}").mkdir()  # a "lock" that is a directory: never opened
    for holder in (first, second):
        holder.kill()
        holder.wait()
    report = await asyncio.wait_for(me.reap(), 30)
    assert sorted(report.dead_workers) == ["1-fifo", "2-link"]
    assert report.dropped == 2 and report.failed == []
    assert (elsewhere / "keep.json").read_text() == "not a record"  # the link was not followed
    assert not (folder / "1-fifo").exists()  # its planted entries removed (links, not targets)
    assert Path("/dev/zero").exists()
    me.close()


async def test_a_look_cancelled_while_it_reads_lets_its_dead_workers_go(
    tmp_path: Path, client: Client
) -> None:
    """A worker stopping cancels its look while the look's thread reads a dead worker's
    ledger (thousands of records on a loaded machine): what the thread took is let go, and
    the next look, here or in another worker, handles that dead worker."""
    folder = tmp_path / "workers"
    me = WorkerLiveness(folder, client).start()
    records = {f"{i:05}.json": {"token": "x", "started": 0.0} for i in range(4_000)}
    holder = dead_worker(folder, "4242-dead", records)
    holder.kill()
    holder.wait()
    look = asyncio.ensure_future(me.reap())
    await asyncio.sleep(0.005)  # its thread is reading the records
    look.cancel()
    with pytest.raises(asyncio.CancelledError):
        await look
    await asyncio.sleep(2)  # the thread finishes on its own
    assert len(list((folder / "4242-dead").iterdir())) == 4_000  # nothing was handled
    other = WorkerLiveness(folder, client).start()
    assert (await other.reap()).dead_workers == ["4242-dead"]  # not held by the cancelled look
    other.close()
    me.close()


async def test_a_folder_others_can_write_turns_the_signal_off(tmp_path: Path, client: Client) -> None:
    folder = tmp_path / "shared" / "workers"
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    with pytest.raises(LivenessUnavailable, match="only it can write"):
        WorkerLiveness(folder, client).start()
    folder.chmod(0o700)
    (tmp_path / "shared").chmod(0o757)  # its parent, writable by others: it could be swapped
    with pytest.raises(LivenessUnavailable):
        WorkerLiveness(folder, client).start()
    (tmp_path / "shared").chmod(0o700)
    WorkerLiveness(folder, client).start().close()
    host = WorkerLiveness.in_data_dir(tmp_path / "data", client)
    assert host.folder.parent == tmp_path / "data" / "workers"  # one folder per machine
    (tmp_path / "data").mkdir(mode=0o700)
    umask = os.umask(0o002)  # a user-private-group umask: new folders 0775 by default
    try:
        host.start().close()  # its folders made 0700 all the same
    finally:
        os.umask(umask)
    assert (tmp_path / "data" / "workers").stat().st_mode & 0o777 == 0o700


async def test_a_starting_worker_s_unnamed_lock_is_left_alone_until_it_is_old(
    tmp_path: Path, client: Client
) -> None:
    folder = tmp_path / "workers"
    me = WorkerLiveness(folder, client).start()
    young = folder / ".77-starting.new"
    young.write_text("")
    old = folder / ".78-died-starting.new"
    old.write_text("")
    long_ago = time.time() - 2 * PENDING_STALE_S
    os.utime(old, (long_ago, long_ago))
    await me.reap()
    assert young.exists() and not old.exists()
    me.close()


async def test_a_worker_s_folder_is_private_and_its_lock_is_never_seen_unheld(
    tmp_path: Path, client: Client
) -> None:
    folder = tmp_path / "workers"
    liveness = WorkerLiveness(folder, client).start()
    assert folder.stat().st_mode & 0o777 == 0o700 and liveness.ledger.stat().st_mode & 0o777 == 0o700
    lock = folder / f"{liveness.worker_id}{LOCK_SUFFIX}"
    assert lock.stat().st_mode & 0o777 == 0o600
    assert not list(folder.glob(".*.new"))  # named only once held
    other = WorkerLiveness(folder, client).start()
    assert (await other.reap()).dead_workers == []
    other.close()
    liveness.close()
    assert list(folder.iterdir()) == []
    assert os.path.isdir(folder)


async def test_the_call_ledger_judges_a_holder_by_its_lock(tmp_path: Path, client: Client) -> None:
    """Whether a claim's holder on this host lives (activities/call_ledger.py): its lock held,
    however long it stood still; free or gone, it is dead and its call may be sent again."""
    folder = tmp_path / "workers"
    me = WorkerLiveness(folder, client).start()
    neighbour = WorkerLiveness(folder, client).start()
    holder = dead_worker(folder, "4242-dead", {})
    assert me.holder_alive(me.worker_id) and me.holder_alive(neighbour.worker_id)
    assert me.holder_alive("4242-dead") is True  # its process holds the lock
    holder.kill()
    holder.wait()
    assert me.holder_alive("4242-dead") is False
    neighbour.close()  # a clean stop: its lock file went with it
    assert me.holder_alive(neighbour.worker_id) is False
    assert me.holder_alive("../elsewhere") is None and me.holder_alive("") is None
    me.close()
