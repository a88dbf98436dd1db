"""Activity tasks polled from a thread of their own (durable_rlm/worker/activity_polls.py):
every task still runs exactly once, cancellations still reach their activity, a worker
without activities keeps the SDK's loop, and the worker shuts down as before, its thread
with it. On the real
dev server, with the SDK installed: the module reaches into its private activity worker, and
these tests are where a release that moved it shows."""

from __future__ import annotations

import asyncio
import collections
import threading
import uuid
from datetime import timedelta

import pytest
from temporalio import activity, workflow
from temporalio.client import Client, WorkflowFailureError
from temporalio.common import RetryPolicy
from temporalio.worker import Worker

from durable_rlm.worker.activity_polls import _Poller, poll_on_a_thread

RAN: collections.Counter[str] = collections.Counter()
CANCELLED: set[str] = set()
STARTED: set[str] = set()


@activity.defn(name="polls_test_note")
async def note(name: str) -> str:
    RAN[name] += 1
    await asyncio.sleep(0.01)
    return name


@activity.defn(name="polls_test_wait")
async def wait_until_cancelled(name: str) -> None:
    STARTED.add(name)
    try:
        while True:
            activity.heartbeat()
            await asyncio.sleep(0.1)
    except asyncio.CancelledError:
        CANCELLED.add(name)
        raise


@workflow.defn(name="polls_test_many", sandboxed=False)
class Many:
    @workflow.run
    async def run(self, names: list[str]) -> list[str]:
        return list(
            await asyncio.gather(
                *(
                    workflow.execute_activity(
                        note,
                        name,
                        start_to_close_timeout=timedelta(seconds=30),
                    )
                    for name in names
                )
            )
        )


@workflow.defn(name="polls_test_cancel", sandboxed=False)
class CancelOne:
    @workflow.run
    async def run(self, name: str) -> None:
        handle = workflow.start_activity(
            wait_until_cancelled,
            name,
            start_to_close_timeout=timedelta(seconds=60),
            heartbeat_timeout=timedelta(seconds=5),
            cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
            retry_policy=RetryPolicy(maximum_attempts=1),
        )
        await workflow.sleep(1)
        handle.cancel()
        await handle


def worker_for(client: Client, queue: str) -> Worker:
    worker = Worker(
        client, task_queue=queue, workflows=[Many, CancelOne], activities=[note, wait_until_cancelled]
    )
    assert poll_on_a_thread(worker), "the installed temporalio's activity worker is not the one known"
    return worker


async def test_every_task_runs_once_polled_from_the_thread(client: Client) -> None:
    queue = f"polls-{uuid.uuid4().hex[:8]}"
    names = [f"{uuid.uuid4().hex[:6]}-{i}" for i in range(120)]
    async with worker_for(client, queue):
        handles = [
            await client.start_workflow(Many.run, names[i::4], id=f"{queue}-{i}", task_queue=queue)
            for i in range(4)
        ]
        results = await asyncio.gather(*(h.result() for h in handles))
    assert sorted(sum(results, [])) == sorted(names)
    assert [RAN[name] for name in names] == [1] * len(names)


async def test_a_cancellation_reaches_its_activity(client: Client) -> None:
    queue, name = f"polls-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    async with worker_for(client, queue):
        with pytest.raises(WorkflowFailureError):
            await client.execute_workflow(CancelOne.run, name, id=f"{queue}-cancel", task_queue=queue)
    assert name in CANCELLED


def pollers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "drlm-activity-polls"]


async def test_the_worker_shuts_down_with_its_poll_waiting(client: Client) -> None:
    queue = f"polls-{uuid.uuid4().hex[:8]}"
    before = len(pollers())
    worker = worker_for(client, queue)
    running = asyncio.create_task(worker.run())
    await asyncio.sleep(1.0)  # the thread's poll waiting on the core
    assert len(pollers()) == before + 1
    await worker.shutdown()
    await asyncio.wait_for(running, 30)  # the run ends: the poll was answered, not left waiting
    await threads_gone(before)


async def threads_gone(before: int) -> None:
    for _ in range(50):
        if len(pollers()) == before:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the poller thread outlived its worker")


@workflow.defn(name="polls_test_waiting", sandboxed=False)
class ManyWaiting:
    @workflow.run
    async def run(self, names: list[str]) -> None:
        await asyncio.gather(
            *(
                workflow.execute_activity(
                    wait_until_cancelled,
                    name,
                    start_to_close_timeout=timedelta(seconds=60),
                    heartbeat_timeout=timedelta(seconds=5),
                )
                for name in names
            )
        )


async def test_a_worker_with_no_grace_shuts_down_with_calls_in_flight(client: Client) -> None:
    # The worst moment for the hand-over: with no grace the core cancels at once every task
    # it still hands out, so a start and its cancellation can reach the worker's loop in one
    # turn; a task cancelled before its first step would never report, and shutdown would
    # wait for it forever.
    queue = f"polls-{uuid.uuid4().hex[:8]}"
    before = len(pollers())
    worker = Worker(
        client,
        task_queue=queue,
        workflows=[ManyWaiting],
        activities=[wait_until_cancelled],
        graceful_shutdown_timeout=timedelta(0),
    )
    assert poll_on_a_thread(worker)
    running = asyncio.create_task(worker.run())
    names = [uuid.uuid4().hex for _ in range(40)]
    await client.start_workflow(ManyWaiting.run, names, id=f"{queue}-w", task_queue=queue)
    while not any(name in STARTED for name in names):
        await asyncio.sleep(0.01)
    await asyncio.wait_for(worker.shutdown(), 30)
    await asyncio.wait_for(running, 30)
    await threads_gone(before)


async def test_a_failed_worker_drains_through_the_thread(client: Client) -> None:
    # The SDK fails its activity worker through this queue (a task it could not complete);
    # then it drains the core with `drain_poll_queue`, which here is the thread's: still one
    # poll at a time, and the worker's run ends with the failure.
    queue = f"polls-{uuid.uuid4().hex[:8]}"
    before = len(pollers())
    worker = worker_for(client, queue)
    running = asyncio.create_task(worker.run())
    await asyncio.sleep(1.0)
    worker._activity_worker._fail_worker_exception_queue.put_nowait(ValueError("boom"))  # type: ignore[union-attr]
    with pytest.raises(RuntimeError) as failed:
        await asyncio.wait_for(running, 30)
    assert isinstance(failed.value.__cause__, ValueError), repr(failed.value)
    await threads_gone(before)


class Stand:
    """A stand-in for the SDK's activity worker with the three things the poller calls: it
    notes the order in which a start task's first step and a cancellation ran (the race is
    one loop turn wide, too narrow to aim a real server at)."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self._running_activities: dict[bytes, object] = {}

    async def _handle_start_activity_task(self, token: bytes, start: object, activity: object) -> None:
        self.seen.append("start's first step")
        await asyncio.sleep(0)

    def _handle_cancel_activity_task(self, token: bytes, cancel: object) -> None:
        self.seen.append("cancel")


class Task:
    def __init__(self, field: str) -> None:
        self.field, self.task_token, self.start, self.cancel = field, b"t", object(), object()

    def HasField(self, name: str) -> bool:  # noqa: N802 - the protobuf's name
        return name == self.field


async def test_a_cancellation_handed_over_with_its_start_runs_after_the_starts_first_step() -> None:
    stand, loop = Stand(), asyncio.get_running_loop()
    poller = _Poller(stand, type("Running", (), {"task": None}))
    poller.loop, poller.ended = loop, loop.create_future()
    poller._dispatch(Task("start"))  # both in one turn of the loop, as the thread can hand them
    poller._dispatch(Task("cancel"))
    await asyncio.sleep(0.05)
    assert stand.seen == ["start's first step", "cancel"]


def test_a_worker_without_activities_keeps_the_sdks_loop(client: Client) -> None:
    worker = Worker(client, task_queue="polls-none", workflows=[Many])
    assert not poll_on_a_thread(worker)
