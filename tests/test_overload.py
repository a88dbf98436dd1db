"""No model call paid twice, however overloaded (docs/architecture/admission.md): a worker whose
event loop stands still past its heartbeat timeouts (as an overloaded one does) has its
attempts given up by the server and retried while their requests are still in flight, or
just answered; the call ledger (activities/call_ledger.py) lets each retry take that reply
instead of asking the model again. Every episode answers, with exactly the model requests
its script makes. Real Temporal dev server, in-process workers, the scripted model server."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from temporalio.api.enums.v1 import EventType

from durable_rlm.client.episodes import start_episode
from durable_rlm.scripted import Reply, root_and_sub
from tests.conftest import request_for

CELLS = 3
CALLS = 2 * CELLS + 1  # a root call and a sub-call per cell, and the answer


def script(delay_s: float):  # type: ignore[no-untyped-def]
    cells = [f"```repl\nv{i} = llm_query('question {i}')\nprint(len(v{i}))\n```" for i in range(CELLS)]
    turns = [Reply(text=t, delay_s=delay_s) for t in [*cells, f"FINAL_VAR(v{CELLS - 1})"]]
    return root_and_sub(turns, lambda p: Reply("answer to " + p, delay_s=delay_s))


async def retried_attempts(client, episode_id: str) -> int:  # type: ignore[no-untyped-def]
    history = await client.get_workflow_handle(episode_id).fetch_history()
    return sum(
        e.activity_task_started_event_attributes.attempt - 1
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED
    )


@pytest.mark.parametrize(
    ("episodes", "stalls"),
    [
        (4, 1),
        pytest.param(40, 3, marks=pytest.mark.slow),
    ],
)
async def test_a_worker_that_stood_still_past_its_heartbeat_timeouts_pays_no_call_twice(
    client, worker, scripted, episodes: int, stalls: int
) -> None:
    server = scripted(script(delay_s=1.0))
    request = request_for(server)  # heartbeat timeout 3 s
    queue = worker.task_queue
    ids = [f"overload-{uuid.uuid4().hex[:8]}-{i}" for i in range(episodes)]
    handles = await asyncio.gather(*(start_episode(client, request, queue, i) for i in ids))
    for _ in range(stalls):
        # Wait until calls are in flight, then hold the worker's loop (this test's) still
        # for longer than the heartbeat timeout: no heartbeat leaves, the server gives the
        # attempts up and schedules them again.
        seen = len(server.requests)
        while len(server.requests) < seen + episodes // 2 + 1:
            await asyncio.sleep(0.05)
        time.sleep(4.5)  # noqa: ASYNC251 - the point: the event loop stands still
    results = await asyncio.gather(*(h.result() for h in handles))
    assert all(r.ended_by == "final_var" for r in results), [r.ended_by for r in results]
    retried = sum([await retried_attempts(client, i) for i in ids])
    assert retried >= 1, "the stand-still must have made the server give attempts up"
    assert len(server.requests) == episodes * CALLS  # none paid twice
