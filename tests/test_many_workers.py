"""Three worker processes, one Temporal server, the PostgreSQL stores: 30 episodes with
sub-calls, one worker SIGKILLed mid-run, every episode right. Prints how the episodes
spread across the workers and how many REPL rebuilds the kill cost."""

from __future__ import annotations

import asyncio
import collections
import uuid

import pytest
import sqlalchemy as sa
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from durable_rlm.client.episodes import start_episode, store_context
from durable_rlm.scripted import Reply, root_and_sub
from durable_rlm.store import schema
from durable_rlm.store.blobs import BlobStore, SqlBackend
from durable_rlm.store.codec import data_converter
from durable_rlm.store.sql import create_engine, downgrade, migrate
from tests.conftest import WorkerProcess, request_for
from tests.test_crash import wait_until

EPISODES = 30
TURNS = [
    "```repl\nparts = llm_query_batched([context + '-a', context + '-b'])\n```",
    Reply("```repl\nimport time\ntime.sleep(0.5)\nresult = '+'.join(parts)\n```", delay_s=1.0),
    "FINAL_VAR(result)",
]

pytestmark = [pytest.mark.chaos, pytest.mark.slow]


async def test_thirty_episodes_on_three_workers_survive_one_killed(
    temporal_address: str, postgres_url: str, scripted
) -> None:
    engine = create_engine(postgres_url)
    downgrade(engine)
    migrate(engine)
    blobs = BlobStore(SqlBackend(engine))
    client = await Client.connect(temporal_address, data_converter=data_converter(blobs))
    server = scripted(root_and_sub(TURNS, lambda prompt: f"<{prompt}>"))
    queue = f"many-{uuid.uuid4().hex[:6]}"
    workers = [WorkerProcess(temporal_address, postgres_url, queue) for _ in range(3)]
    try:
        handles = []
        for n in range(EPISODES):
            context = store_context(blobs, f"ep{n}")
            request = request_for(server, context=context)
            handles.append(await start_episode(client, request, queue, f"{queue}-{n}"))
        # Mid-run: a third of the episodes have had their sub-calls answered.
        await wait_until(lambda: len(server.sub_requests()) >= 2 * EPISODES // 3, timeout=120)
        victim = workers[0]
        victim.kill()
        results = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 240)
    finally:
        for worker in workers:
            worker.stop()

    assert [r.answer for r in results] == [f"<ep{n}-a>+<ep{n}-b>" for n in range(EPISODES)]
    spread: collections.Counter[str] = collections.Counter()
    moved = 0
    for handle in handles:
        history = await handle.fetch_history()
        identities = {
            e.workflow_task_started_event_attributes.identity
            for e in history.events
            if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED
        }
        spread.update(identities)
        moved += len(identities) > 1
    with engine.connect() as conn:
        rebuilds = conn.execute(
            sa.select(sa.func.count()).select_from(schema.cells).where(schema.cells.c.rebuilt.is_(True))
        ).scalar_one()
    killed = f"{victim.process.pid}@"
    report = (
        f"{EPISODES} episodes on 3 workers: episodes each worker ran steps of "
        f"{ {identity.split('@')[0]: count for identity, count in spread.items()} }, "
        f"{moved} moved to another worker after worker {killed.rstrip('@')} was killed, "
        f"{rebuilds} REPL rebuild(s)"
    )
    print(report)
    assert len(spread) == 3, report  # every worker took episodes
    assert any(identity.startswith(killed) for identity in spread), report
    assert moved >= 1, report  # the killed worker's episodes finished elsewhere
    engine.dispose()
