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

from durable_rlm.worker.activity_polls import poll_on_a_thread

RAN: collections.Counter[str] = collections.Counter()
CANCELLED: set[str] = set()


@activity.defn(name="polls_test_note")
async def note(name: str) -> str:
    RAN[name] += 1
    await asyncio.sleep(0.01)
    return name


@activity.defn(name="polls_test_wait")
async def wait_until_cancelled(name: str) -> None:
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


async def test_every_task_runs_once_with_several_polls_waiting(client: Client) -> None:
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
    for _ in range(50):
        if len(pollers()) == before:
            break
        await asyncio.sleep(0.1)
    assert len(pollers()) == before, "the poller thread outlived its worker"


def test_a_worker_without_activities_keeps_the_sdks_loop(client: Client) -> None:
    worker = Worker(client, task_queue="polls-none", workflows=[Many])
    assert not poll_on_a_thread(worker)
