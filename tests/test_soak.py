"""The soak (issue 37, item 9): durable against the engine's failures and the infrastructure's.

Three `worker.py` processes on one PostgreSQL store (a cluster of this test's own, so it
can be restarted) and one Temporal dev server (also its own, on its own SQLite file and
port, so it can be killed -9 and restarted on both) run 40 episodes of 7 iterations each,
three sub-calls apiece, against the scripted model server, started one every few seconds
while faults come: a worker SIGKILLed every 10-20 s (and replaced), the Temporal server
killed twice, PostgreSQL restarted once and stopped for 30 s once, and one worker stopped
(SIGSTOP) for 30 s. Then:

- every answer is right;
- a call paid more than once was lost to a fault: each request of a call but its last was
  in flight during a fault (received before the fault ended, replied less than `SLACK_S`
  before it began: the worker holding a reply has not necessarily reported it yet), and the
  calls paid again are no more than the calls in flight at a fault. A request a paused
  worker sends once resumed, for an attempt the server has given up, is in flight during no
  fault: it is a call paid for nothing (issue 37, item 7: a paused worker checks before it
  pays), listed with what the episode's history says of its model calls;
- the audit store rebuilt from the histories alone (`drlm audit-rebuild`'s
  `rebuild_audit`, into a fresh database) has exactly the live store's rows;
- no sandbox is left: the sandbox root is empty and no sandbox process of any of the
  workers runs (tests/test_hygiene.py's checks).

Every failed invariant is reported together, with the rows or calls that broke it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import random
import re
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from durable_rlm.activities import sandbox_reaper
from durable_rlm.audit.projection import rebuild_audit
from durable_rlm.client.episodes import start_episode, store_context
from durable_rlm.errors import EpisodeIdInUse
from durable_rlm.scripted import ChatRequest
from durable_rlm.store import schema
from durable_rlm.store.blobs import BlobStore, SqlBackend
from durable_rlm.store.codec import data_converter
from durable_rlm.store.sql import create_engine, migrate
from durable_rlm.worker.runtime import EmbeddedServer
from durable_rlm.workflows import names
from durable_rlm.workflows.models import DurabilitySettings, EpisodeResult
from tests.conftest import PostgresCluster, WorkerProcess, request_for
from tests.test_audit import table_rows
from tests.test_hygiene import sandbox_processes

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.postgres]

EPISODES = 40
COUNTED = 4  # plain iterations between the first and the last sub-calls
START_EVERY_S = 4.5  # the 40 starts spread over 3 minutes: faults always find episodes running
ROOT_DELAY_S = 1.5
SUB_DELAY_S = 1.0
SLACK_S = 3.0
SEED = 37  # the kills' times and victims

TURNS = [
    "```repl\nparts = llm_query_batched([context + '-a', context + '-b'])\n```",
    *["```repl\nsteps = globals().get('steps', 0) + 1\n```"] * COUNTED,
    "```repl\nlast = llm_query(context + '-c')\n"
    "result = '+'.join(parts) + '|' + last + '|' + str(steps)\n```",
    "FINAL_VAR(result)",
]
TASK = re.compile(r"soak task no\. (\d+)\b")
SUB = re.compile(r"ep(\d+)-[abc]")


def task(n: int) -> str:
    return f"soak task no. {n}: join the parts"


def expected(n: int) -> str:
    return f"<ep{n}-a>+<ep{n}-b>|<ep{n}-c>|{COUNTED}"


@dataclass(frozen=True)
class Call:
    """One request the model server answered: which call of which episode, and when."""

    key: tuple[int, str]
    received: float
    replied: float


@dataclass(frozen=True)
class Fault:
    what: str
    began: float
    ended: float


class Ledger:
    """The scripted model: answers every episode's calls, and records when each request
    came and when its reply left (the delay is slept here, so the reply leaves on return)."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self._lock = threading.Lock()

    def __call__(self, request: ChatRequest) -> str:
        received = time.time()
        if request.is_root:
            text = "\n".join(str(m.get("content", "")) for m in request.messages)
            found = TASK.search(text)
            key = (int(found.group(1)) if found else -1, f"root turn {request.turn}")
            reply, delay = TURNS[min(request.turn, len(TURNS) - 1)], ROOT_DELAY_S
        else:
            prompt = request.last_user
            found = SUB.fullmatch(prompt)
            key = (int(found.group(1)) if found else -1, f"sub {prompt!r}")
            reply, delay = f"<{prompt}>", SUB_DELAY_S
        time.sleep(delay)
        with self._lock:
            self.calls.append(Call(key, received, time.time()))
        return reply


def in_flight(call: Call, fault: Fault) -> bool:
    return call.received <= fault.ended and call.replied + SLACK_S >= fault.began


def paid_again(calls: list[Call], faults: list[Fault], zero: float) -> tuple[int, int, dict[int, list[str]]]:
    """Calls paid more than once; calls in flight at a fault; the repeats no fault explains,
    by episode (times in seconds after `zero`, the first start)."""
    by_key: dict[tuple[int, str], list[Call]] = collections.defaultdict(list)
    for call in sorted(calls, key=lambda c: c.received):
        by_key[call.key].append(call)
    again = sum(len(requests) - 1 for requests in by_key.values())
    caught = sum(1 for call in calls if any(in_flight(call, f) for f in faults))
    unexplained: dict[int, list[str]] = collections.defaultdict(list)
    for key, requests in sorted(by_key.items()):
        for lost in requests[:-1]:  # each request but the last was lost: to which fault?
            if not any(in_flight(lost, f) for f in faults):
                unexplained[key[0]].append(
                    f"episode {key[0]} {key[1]}: {len(requests)} requests at "
                    f"{[round(r.received - zero, 1) for r in requests]} s; the one at "
                    f"{lost.received - zero:.1f}-{lost.replied - zero:.1f} s was in flight during no fault"
                )
    return again, caught, unexplained


async def model_attempts(client: Client, episode_id: str, zero: float) -> str:
    """What the episode's history says of its model calls: when each was scheduled, which
    attempt of it was started by which worker (pid@host) and what failed the attempt before,
    and how it ended. (History keeps only the last attempt of a retried activity.)"""
    history = await client.get_workflow_handle(episode_id).fetch_history()
    kinds = {names.ROOT_COMPLETION: "root", names.SUB_QUERY: "sub"}
    scheduled: dict[int, str] = {}
    said = []
    for event in history.events:
        at = f"+{event.event_time.ToMicroseconds() / 1e6 - zero:.1f}"
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            name = kinds.get(event.activity_task_scheduled_event_attributes.activity_type.name)
            if name is not None:
                scheduled[event.event_id] = f"{name}#{event.event_id}"
                said.append(f"{at} {scheduled[event.event_id]} scheduled")
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            started = event.activity_task_started_event_attributes
            if started.scheduled_event_id in scheduled:
                before = started.last_failure.message[:80] if started.HasField("last_failure") else ""
                said.append(
                    f"{at} {scheduled[started.scheduled_event_id]} attempt {started.attempt} started by "
                    f"{started.identity}" + (f" (the attempt before: {before})" if before else "")
                )
        elif event.event_type in ENDED:
            ended = getattr(event, ENDED[event.event_type])
            if ended.scheduled_event_id in scheduled:
                said.append(
                    f"{at} {scheduled[ended.scheduled_event_id]} {ENDED[event.event_type].split('_')[2]}"
                )
    return "; ".join(said)


ENDED = {
    EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED: "activity_task_completed_event_attributes",
    EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED: "activity_task_failed_event_attributes",
    EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT: "activity_task_timed_out_event_attributes",
}


def differing_rows(
    live: dict[str, list[dict[str, Any]]], rebuilt: dict[str, list[dict[str, Any]]], zero: float
) -> list[str]:
    """Each row that is only live, only rebuilt, or differs, with the columns that differ
    (times also in seconds after `zero`, the first start)."""

    def shown(value: object) -> str:
        if isinstance(value, datetime):
            return f"{value:%H:%M:%S.%f} (+{value.timestamp() - zero:.1f} s)"
        if isinstance(value, dict):
            text = "{" + ", ".join(f"{k}: {shown(v)}" for k, v in value.items() if v is not None) + "}"
            return text if len(text) <= 700 else text[:697] + "..."
        text = repr(value)
        return text if len(text) <= 400 else text[:397] + "..."

    found = []
    for table in schema.AUDIT_TABLES:
        keys = [c.name for c in table.primary_key.columns]
        mine = {tuple(r[k] for k in keys): r for r in live[table.name]}
        theirs = {tuple(r[k] for k in keys): r for r in rebuilt[table.name]}
        for key in sorted(mine.keys() - theirs.keys(), key=str):
            found.append(f"{table.name} {key}: live only: {shown(mine[key])}")
        for key in sorted(theirs.keys() - mine.keys(), key=str):
            found.append(f"{table.name} {key}: rebuilt only: {shown(theirs[key])}")
        for key in sorted(mine.keys() & theirs.keys(), key=str):
            columns = [
                f"{c} live={shown(v)} rebuilt={shown(theirs[key][c])}"
                for c, v in mine[key].items()
                if v != theirs[key][c]
            ]
            if columns:
                found.append(f"{table.name} {key}: " + "; ".join(columns))
    return found


@pytest.fixture
def sandbox_root(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Worker processes whose sandbox root (TMPDIR/drlm-sandboxes) is this test's own."""
    tmp = Path(tempfile.mkdtemp(prefix="drlm-soak-tmp-", dir="/tmp"))
    tmp.chmod(0o711)
    monkeypatch.setenv("TMPDIR", str(tmp))
    (tmp / "drlm-sandboxes").mkdir(mode=0o711)
    yield tmp / "drlm-sandboxes"
    sandbox_reaper.remove_tree(tmp)


class Soak:
    """The infrastructure of the run, and the faults done to it (each timed)."""

    def __init__(self, cluster: PostgresCluster, temporal: EmbeddedServer, blobs: BlobStore) -> None:
        self.cluster = cluster
        self.temporal = temporal
        self.blobs = blobs
        self.client: Client | None = None
        self.queue = f"soak-{uuid.uuid4().hex[:6]}"
        self.workers: list[WorkerProcess] = []
        self.pids: set[int] = set()
        self.paused: WorkerProcess | None = None
        self.faults: list[Fault] = []
        # Held while the server or the store is down: a worker starts only with both up
        # (one that cannot reach the store at start exits).
        self.infra = asyncio.Lock()

    async def connect(self) -> None:
        self.client = await Client.connect(self.temporal.address, data_converter=data_converter(self.blobs))

    async def start_worker(self) -> None:
        async with self.infra:
            worker = await asyncio.wait_for(
                asyncio.to_thread(WorkerProcess, self.temporal.address, self.cluster.url, self.queue), 120
            )
        self.workers.append(worker)
        self.pids.add(worker.process.pid)

    def kill_worker(self, rng: random.Random) -> None:
        victim = rng.choice([w for w in self.workers if w is not self.paused])
        began = time.time()
        victim.kill()
        self.workers.remove(victim)
        self.faults.append(Fault(f"worker {victim.process.pid} SIGKILL", began, began))

    async def kill_temporal(self) -> None:
        async with self.infra:
            assert self.temporal.process is not None
            began = time.time()
            self.temporal.process.kill()  # kill -9: no shutdown of any kind
            await self.temporal.process.wait()
            await asyncio.sleep(1.0)
            self.temporal = EmbeddedServer(self.temporal.db_file, port=self.temporal.port)
            await self.temporal.start()
            await self.connect()
            self.faults.append(Fault("Temporal server kill -9", began, time.time()))

    async def pause_worker(self, seconds: float) -> None:
        worker = self.workers[0]
        self.paused = worker
        began = time.time()
        os.kill(worker.process.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(seconds)
        finally:
            os.kill(worker.process.pid, signal.SIGCONT)
            self.paused = None
        self.faults.append(Fault(f"worker {worker.process.pid} SIGSTOP {seconds:g} s", began, time.time()))

    async def store_down(self, seconds: float, what: str) -> None:
        async with self.infra:
            began = time.time()
            await asyncio.to_thread(self.cluster.stop)
            await asyncio.sleep(seconds)
            await asyncio.to_thread(self.cluster.start)
            self.faults.append(Fault(what, began, time.time()))

    async def stop_workers(self) -> list[str]:
        """SIGTERM to every worker (each drains and closes its sandboxes); what went wrong."""
        for worker in self.workers:
            worker.process.terminate()
        problems = []
        for worker in self.workers:
            try:
                code = await asyncio.wait_for(asyncio.to_thread(worker.process.wait), 60)
            except TimeoutError:
                worker.kill()
                code = "killed after 60 s"
            if code != 0:
                problems.append(f"worker {worker.process.pid} stopped with {code}: {worker.output()[-500:]}")
        self.workers = []
        return problems


async def within(seconds: float, what: str, attempt: Callable[[], Awaitable[object]]) -> object:
    """`attempt` until it succeeds, for `seconds` at most (the server or the store may be down)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return await attempt()
        except Exception as exc:  # noqa: BLE001 - down for a while: said if it lasts
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: still failing after {seconds:g} s: {exc!r}") from exc
            await asyncio.sleep(1.0)


async def test_forty_episodes_survive_workers_server_and_store_failing_around_them(
    tmp_path: Path, scripted, sandbox_root: Path
) -> None:
    began = time.monotonic()
    ledger = Ledger()
    server = scripted(ledger)
    cluster = PostgresCluster()
    cluster.start()
    engine = create_engine(cluster.url)
    migrate(engine)
    blobs = BlobStore(SqlBackend(engine))
    temporal = EmbeddedServer(tmp_path / "temporal.sqlite")
    await temporal.start()
    soak = Soak(cluster, temporal, blobs)
    ids = [f"{soak.queue}-{n}" for n in range(EPISODES)]
    requests = [
        request_for(server, task(n), context=store_context(blobs, f"ep{n}"), durability=DurabilitySettings())
        for n in range(EPISODES)
    ]
    problems: list[str] = []
    results: list[EpisodeResult | BaseException] = []
    try:
        await soak.connect()
        for _ in range(3):
            await soak.start_worker()
        t0 = time.monotonic()

        async def at(offset: float) -> None:
            await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))

        async def launch() -> None:
            for n in range(EPISODES):
                await at(n * START_EVERY_S)

                async def start(n: int = n) -> None:
                    assert soak.client is not None
                    with contextlib.suppress(EpisodeIdInUse):  # started before a lost reply
                        await start_episode(soak.client, requests[n], soak.queue, ids[n])

                await within(120, f"starting episode {n}", start)

        last_fault = EPISODES * START_EVERY_S + 10

        async def kill_workers() -> None:
            rng = random.Random(SEED)
            next_kill = t0 + rng.uniform(10, 20)
            while next_kill < t0 + last_fault:
                await asyncio.sleep(max(0.0, next_kill - time.monotonic()))
                soak.kill_worker(rng)
                next_kill = time.monotonic() + rng.uniform(10, 20)
                await soak.start_worker()

        async def infrastructure() -> None:
            await at(30)
            await soak.kill_temporal()
            await at(60)
            await soak.pause_worker(30)
            await at(105)
            await soak.store_down(0, "PostgreSQL restart")
            await at(135)
            await soak.store_down(30, "PostgreSQL stopped 30 s")
            await at(185)
            await soak.kill_temporal()

        await asyncio.wait_for(asyncio.gather(launch(), kill_workers(), infrastructure()), last_fault + 180)
        faults_done = time.monotonic() - t0

        deadline = time.monotonic() + 300

        async def result(episode_id: str) -> EpisodeResult:
            assert soak.client is not None
            handle = soak.client.get_workflow_handle(episode_id, result_type=EpisodeResult)
            return await asyncio.wait_for(handle.result(), max(1.0, deadline - time.monotonic()))

        results = await asyncio.gather(*(result(i) for i in ids), return_exceptions=True)
        finished = time.monotonic() - t0
        problems += await soak.stop_workers()

        # Every answer right.
        for n, got in enumerate(results):
            if isinstance(got, BaseException):
                problems.append(f"episode {n} ({ids[n]}) failed: {got!r}")
            elif (got.answer, got.status) != (expected(n), "answered"):
                problems.append(
                    f"episode {n} ({ids[n]}): answer {got.answer!r} status {got.status} "
                    f"ended_by {got.ended_by}, wanted {expected(n)!r}"
                )

        # A call paid again was in flight during a fault.
        calls = list(ledger.calls)
        unknown = [c for c in calls if c.key[0] < 0]
        if unknown:
            problems.append(f"{len(unknown)} requests of no known episode: {unknown[:5]}")
        zero = time.time() - (time.monotonic() - t0)  # the first start, on the wall clock
        again, caught, unexplained = paid_again(calls, soak.faults, zero)
        if again > caught:
            problems.append(f"{again} calls paid again, more than the {caught} in flight at a fault")
        for n, repeats in sorted(unexplained.items()):
            problems += repeats
            assert soak.client is not None
            try:
                problems.append(f"  episode {n}'s history: {await model_attempts(soak.client, ids[n], zero)}")
            except Exception as exc:  # noqa: BLE001 - the finding stands without its history
                problems.append(f"  episode {n}'s history could not be read: {exc!r}")

        # No sandbox left.
        left = [p.name for p in sandbox_root.iterdir()] if sandbox_root.exists() else []
        if left:
            problems.append(f"left in the sandbox root: {left}")
        processes = sandbox_processes(soak.pids)
        if processes:
            problems.append(f"sandbox processes still running: {processes}")

        # The audit store equals its rebuild from the histories alone.
        engine.dispose()  # its pooled connections died with the store's restarts
        live = table_rows(engine)
        with sa.create_engine(cluster.url, isolation_level="AUTOCOMMIT").connect() as conn:
            conn.execute(sa.text("CREATE DATABASE rebuilt"))
        fresh = create_engine(cluster.url.rsplit("/", 1)[0] + "/rebuilt")
        migrate(fresh)
        unreadable: list[str] = []
        assert soak.client is not None
        rebuilt_episodes = await rebuild_audit(soak.client, fresh, unreadable=unreadable)
        rebuilt = table_rows(fresh)
        fresh.dispose()
        if unreadable:
            problems.append(f"histories the rebuild could not read: {unreadable}")
        if rebuilt_episodes != EPISODES:
            problems.append(f"the rebuild found {rebuilt_episodes} episodes, not {EPISODES}")
        rows = differing_rows(live, rebuilt, zero)
        problems += [f"audit row differs: {row}" for row in rows]

        kinds = collections.Counter(
            f.what.split(" ", 2)[-1] if f.what.startswith("worker") else f.what for f in soak.faults
        )
        summary = (
            f"soak: {EPISODES} episodes, {len(calls)} model requests, {len(soak.pids)} worker processes; "
            f"faults {dict(kinds)} over {faults_done:.0f} s; all answered {finished:.0f} s after the "
            f"first start; {again} calls paid again, {caught} in flight at a fault; "
            f"{sum(len(v) for v in live.values())} audit rows, {len(rows)} differ; "
            f"{time.monotonic() - began:.0f} s in all"
        )
        # When each fault came (UTC, and seconds after the first start): rows and calls that
        # break an invariant are matched to them by their times.
        summary += "\nfaults: " + "; ".join(
            f"{f.what} at {time.strftime('%H:%M:%S', time.gmtime(f.began))} "
            f"(+{f.began - zero:.1f} s, {f.ended - f.began:.1f} s long)"
            for f in soak.faults
        )
        print(summary)
    finally:
        if soak.paused is not None:
            os.kill(soak.paused.process.pid, signal.SIGCONT)
        for worker in soak.workers:
            worker.stop()
        await soak.temporal.stop()
        engine.dispose()
        cluster.remove()

    # Every kind of fault happened (else the run proved less than it says).
    wanted = {"Temporal server kill -9": 2, "PostgreSQL restart": 1, "PostgreSQL stopped 30 s": 1}
    wanted["SIGSTOP 30 s"] = 1
    problems += [f"{kinds[k]} x {k}, wanted {n}" for k, n in wanted.items() if kinds[k] != n]
    if kinds["SIGKILL"] < 8:
        problems.append(f"only {kinds['SIGKILL']} worker SIGKILLs")
    shown = problems[:60] + ([f"... and {len(problems) - 60} more"] if len(problems) > 60 else [])
    assert not problems, summary + "\n" + "\n".join(shown)
