"""Model calls as local activities (`DurabilitySettings.local_model_calls`, off by default):
the lever that takes an episode's round trips through the server from three events a call
to one marker (BENCHMARKS.md, section 1). What must hold with it on is what holds with it
off: the same answer from the same requests, a failed call ending the episode in the same
words, and each call's audit row written as the step completes.
"""

from __future__ import annotations

import asyncio
import uuid

import sqlalchemy as sa
from temporalio.api.enums.v1 import EventType

from durable_rlm.scripted import Reply, root_and_sub
from durable_rlm.store import schema
from durable_rlm.workflows import names
from durable_rlm.workflows.models import DurabilitySettings, EpisodeResult
from tests.conftest import request_for

TURNS = ["```repl\nx = llm_query('hello')\nprint(x)\n```", "FINAL_VAR(x)"]
MODEL_STEPS = {names.ROOT_COMPLETION, names.SUB_QUERY}


def durability(local: bool) -> DurabilitySettings:
    return DurabilitySettings(heartbeat_timeout_s=3, sticky_schedule_to_start_s=3, local_model_calls=local)


async def run(client, worker, server, local: bool) -> tuple[EpisodeResult, list]:
    handle = await client.start_workflow(
        names.WORKFLOW,
        request_for(server, durability=durability(local)),
        id=f"local-calls-{local}-{uuid.uuid4().hex[:6]}",
        task_queue=worker.task_queue,
        result_type=EpisodeResult,
    )
    result = await asyncio.wait_for(handle.result(), 60)
    return result, list((await handle.fetch_history()).events)


def scheduled(events: list) -> set[str]:
    return {
        e.activity_task_scheduled_event_attributes.activity_type.name
        for e in events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
    }


async def test_local_model_calls_give_the_same_answer_from_the_same_requests_in_fewer_events(
    client, worker, scripted, store
) -> None:
    remote_server = scripted(root_and_sub(TURNS, str.upper))
    remote, remote_events = await run(client, worker, remote_server, local=False)
    local_server = scripted(root_and_sub(TURNS, str.upper))
    local, local_events = await run(client, worker, local_server, local=True)

    assert (local.answer, local.ended_by, local.iterations) == (
        remote.answer,
        remote.ended_by,
        remote.iterations,
    )
    assert local.answer == "HELLO"
    assert len(local_server.requests) == len(remote_server.requests) == 3  # two root calls, one sub-call
    assert MODEL_STEPS <= scheduled(remote_events)
    assert not MODEL_STEPS & scheduled(local_events)  # recorded as markers instead
    assert len(local_events) < len(remote_events)

    # Each call's audit row was written by the worker as its step completed.
    _, engine = store
    with engine.connect() as conn:
        calls = conn.execute(sa.select(schema.model_calls.c.episode_id, schema.model_calls.c.call_id)).all()
    by_episode: dict[str, list[str]] = {}
    for episode_id, call_id in calls:
        by_episode.setdefault(episode_id, []).append(call_id)
    local_rows = [rows for episode, rows in by_episode.items() if episode.startswith("local-calls-True")]
    assert [sorted(rows) for rows in local_rows] == [["root:1", "root:2", "sub:1.0"]]


async def test_a_rejected_local_call_ends_the_episode_in_the_words_of_a_remote_one(
    client, worker, scripted
) -> None:
    endings = []
    for local in (False, True):
        server = scripted(lambda request: Reply(status=400, error="unknown parameter"))
        result, _ = await run(client, worker, server, local)
        assert len(server.requests) == 1  # a rejection is not retried, either way
        words = (result.error or "").replace(server.base_url, "URL")  # each server has its own port
        endings.append((result.ended_by, result.failure_cause, words))
    assert endings[0] == endings[1]
    assert endings[1][0] == "model_error" and "unknown parameter" in (endings[1][2] or "")


async def test_a_failing_local_sub_call_reaches_the_cell_as_a_remote_one_does(
    client, worker, scripted
) -> None:
    answers = []
    for local in (False, True):
        server = scripted(
            root_and_sub(TURNS, lambda prompt: Reply(status=400, error="no model for sub-calls"))
        )
        result, _ = await run(client, worker, server, local)
        said = (result.stop_reason or "").replace(server.base_url, "URL")
        answers.append((result.ended_by, result.answer, result.sub_calls, result.model_calls, said))
    assert answers[0] == answers[1]
    assert answers[1][2] == 1  # the failed sub-call was made once, and counted
