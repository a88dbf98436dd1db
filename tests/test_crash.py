"""Crash resume: SIGKILL a real worker process mid-episode; a new worker finishes it.

The scripted model server counts every request, so the tests prove that no model call was
paid twice, except the one cut mid-flight, and that REPL state was rebuilt from the log.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from temporalio.client import Client

from durable_rlm.client.episodes import start_episode
from durable_rlm.scripted import Reply, root_and_sub
from durable_rlm.store.codec import data_converter
from durable_rlm.worker.runtime import EmbeddedServer
from durable_rlm.workflows.models import EpisodeResult
from tests.conftest import WorkerProcess, request_for, run_episode

pytestmark = pytest.mark.chaos


async def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


def sub(prompt: str) -> str:
    return f"<{prompt}>"


async def undisturbed(client, scripted, turns, worker_processes) -> EpisodeResult:
    server = scripted(root_and_sub(turns, sub))
    worker = worker_processes()
    try:
        return await run_episode(client, request_for(server), worker_processes.queue)
    finally:
        worker.stop()


@pytest.mark.parametrize(
    "local_model_calls", [False, pytest.param(True, marks=pytest.mark.slow, id="local-model-calls")]
)
async def test_killed_during_a_model_call_finishes_with_the_same_answer(
    client, scripted, worker_processes, local_model_calls
) -> None:
    """With the model calls as local activities too: a new worker runs the killed one's
    workflow task again, and the call ledger answers the calls it had made."""
    turns = [
        "```repl\nparts = llm_query_batched(['p1', 'p2'])\nprint(parts)\n```",
        Reply(text="```repl\nresult = '+'.join(parts)\n```", delay_s=4),
        "FINAL_VAR(result)",
    ]
    # The same replies without the model's thinking time (it is only there to be cut).
    quick = [*turns[:1], Reply(text=turns[1].text), *turns[2:]]
    expected = await undisturbed(client, scripted, quick, worker_processes)

    server = scripted(root_and_sub(turns, sub))
    first = worker_processes()
    request = request_for(server)
    request.durability.local_model_calls = local_model_calls
    handle = await start_episode(
        client, request, worker_processes.queue, f"crash-model-{uuid.uuid4().hex[:6]}"
    )
    await wait_until(lambda: any(r.turn == 1 for r in server.root_requests()))
    first.kill()  # mid-flight: the model is still "thinking" about turn 1
    worker_processes()
    result = await asyncio.wait_for(handle.result(), 90)

    assert result.answer == expected.answer == "<p1>+<p2>"
    root_turns = [r.turn for r in server.root_requests()]
    assert sorted(root_turns) == [0, 1, 1, 2]  # only the call cut mid-flight was repeated
    assert len(server.sub_requests()) == 2


@pytest.mark.slow
async def test_killed_during_a_cell_rebuilds_the_repl_without_repeating_model_calls(
    client, scripted, worker_processes
) -> None:
    turns = [
        "```repl\nseed_value = 7\n```",
        "```repl\nparts = llm_query_batched(['p1', 'p2'])\nimport time\ntime.sleep(4)\n"
        "result = '+'.join(parts) + f'#{seed_value}'\nprint(result)\n```",
        "FINAL_VAR(result)",
    ]
    expected = await undisturbed(client, scripted, turns, worker_processes)

    server = scripted(root_and_sub(turns, sub))
    first = worker_processes()
    handle = await start_episode(
        client, request_for(server), worker_processes.queue, f"crash-cell-{uuid.uuid4().hex[:6]}"
    )
    await wait_until(lambda: len(server.sub_requests()) == 2 and server.completed >= 4)
    await asyncio.sleep(1.5)  # the cell now sleeps inside the worker's sandbox
    first.kill()
    worker_processes()
    result = await asyncio.wait_for(handle.result(), 90)

    assert result.answer == expected.answer == "<p1>+<p2>#7"
    assert [r.turn for r in server.root_requests()] == [0, 1, 2]  # no root call repeated
    assert len(server.sub_requests()) == 2  # the rebuilt cell was answered from the log


@pytest.mark.slow
async def test_killed_while_children_run_repeats_no_finished_child(
    client, scripted, worker_processes
) -> None:
    """SIGKILL the worker while a batch of child episodes runs: the child that had finished
    is not run again (its result is in the parent's history), the others finish."""
    from tests.test_recursion import by_model, calls_of, tree_request

    child_turns = {
        "fast-m": ["```repl\nn = len(context)\n```", "FINAL_VAR(n)"],
        "slow-m": ["```repl\nn = len(context) * 10\n```", Reply(text="FINAL_VAR(n)", delay_s=4)],
    }
    server = scripted(
        by_model(
            {
                "root-m": [
                    "```repl\nfast = rlm_query('abc', model='fast-m')\n"
                    "slow = rlm_query_batched(['abcd', 'abcde'], model='slow-m')\n```",
                    "```repl\nFINAL(f'{fast} {slow}')\n```",
                ],
                **child_turns,
            }
        )
    )
    first = worker_processes()
    episode_id = f"crash-children-{uuid.uuid4().hex[:6]}"
    request = tree_request(server, "answer", ["fast-m", "slow-m"], max_depth=2)
    handle = await start_episode(client, request, worker_processes.queue, episode_id)
    await wait_until(lambda: sum(1 for r in calls_of(server, "slow-m") if r.turn == 1) == 2)
    first.kill()  # the fast child is done; both slow children are mid-call
    worker_processes()
    result = await asyncio.wait_for(handle.result(), 90)

    assert result.answer == "3 ['40', '50']"
    assert [r.turn for r in calls_of(server, "fast-m")] == [0, 1]  # not run again
    slow_turns = sorted(r.turn for r in calls_of(server, "slow-m"))
    assert slow_turns == [0, 0, 1, 1, 1, 1]  # only the two calls cut mid-flight were repeated
    assert [r.turn for r in server.root_requests() if r.model == "root-m"] == [0, 1]
    assert result.tree_episodes == 4


@pytest.mark.slow
async def test_killed_in_the_middle_of_a_batch_of_eight_pays_only_the_calls_in_flight(
    client, scripted, worker_processes
) -> None:
    """Four calls of the batch have answered when the worker dies, four are in flight: the
    four answered are never asked again; only the four cut mid-flight are paid twice."""
    prompts = [f"q{i}" for i in range(8)]
    turns = [
        f"```repl\nparts = llm_query_batched({prompts!r})\nresult = ','.join(parts)\n```",
        "FINAL_VAR(result)",
    ]

    def answer(prompt: str) -> Reply:
        slow = int(prompt[1:]) >= 4
        return Reply(text=prompt.upper(), delay_s=4.0 if slow else 0.05)

    server = scripted(root_and_sub(turns, answer))
    first = worker_processes()
    handle = await start_episode(
        client, request_for(server), worker_processes.queue, f"crash-batch-{uuid.uuid4().hex[:6]}"
    )
    await wait_until(lambda: len(server.sub_requests()) == 8)
    await asyncio.sleep(1.0)  # the quick four have answered and been recorded; four still think
    first.kill()
    worker_processes()
    result = await asyncio.wait_for(handle.result(), 90)

    assert result.answer == ",".join(p.upper() for p in prompts)
    asked: dict[str, int] = {}
    for request in server.sub_requests():
        asked[request.last_user] = asked.get(request.last_user, 0) + 1
    assert {p: asked[p] for p in prompts[:4]} == dict.fromkeys(prompts[:4], 1)  # answered: paid once
    assert {p: asked[p] for p in prompts[4:]} == dict.fromkeys(prompts[4:], 2)  # cut mid-flight
    assert [r.turn for r in server.root_requests()] == [0, 1]  # no root call repeated


async def test_the_server_killed_mid_episode_loses_nothing(tmp_path, blobs, session_dir, scripted) -> None:
    """kill -9 of the Temporal server while a model call is in flight; restarted on its
    SQLite file, the episode finishes with the right answer, and no call that had answered
    before the kill is asked again."""
    turns = [
        "```repl\nfirst = llm_query('before')\n```",
        "```repl\nsecond = llm_query('during')\nresult = first + '+' + second\n```",
        "FINAL_VAR(result)",
    ]
    server = scripted(
        root_and_sub(turns, lambda p: Reply(text=p.upper(), delay_s=3.0 if p == "during" else 0))
    )
    temporal = EmbeddedServer(tmp_path / "temporal.sqlite")
    address = await temporal.start()
    queue = f"server-kill-{uuid.uuid4().hex[:6]}"
    worker = WorkerProcess(address, f"sqlite:///{session_dir / 'drlm.sqlite'}", queue)
    try:
        client = await Client.connect(address, data_converter=data_converter(blobs))
        handle = await start_episode(
            client, request_for(server), queue, f"server-kill-{uuid.uuid4().hex[:6]}"
        )
        await wait_until(lambda: any(r.last_user == "during" for r in server.sub_requests()))
        assert temporal.process is not None
        temporal.process.kill()  # kill -9: no shutdown of any kind
        await temporal.process.wait()
        await asyncio.sleep(1.0)
        restarted = EmbeddedServer(tmp_path / "temporal.sqlite", port=temporal.port)
        await restarted.start()
        temporal = restarted
        client = await Client.connect(address, data_converter=data_converter(blobs))
        result = await asyncio.wait_for(
            client.get_workflow_handle(handle.id, result_type=EpisodeResult).result(), 120
        )
    finally:
        worker.stop()
        await temporal.stop()

    assert result.answer == "BEFORE+DURING"
    asked = [r.last_user for r in server.sub_requests()]
    assert asked.count("before") == 1  # answered before the kill: never asked again
    assert 1 <= asked.count("during") <= 2  # in flight at the kill: at most once more
    assert [r.turn for r in server.root_requests()] == [0, 1, 2]  # no root call repeated
