"""Episodes end to end on a real Temporal dev server, real sandbox, real HTTP model."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import sqlalchemy as sa
from temporalio.client import Client

from durable_rlm.audit.timeline import episode_timeline, render
from durable_rlm.client.episodes import store_context
from durable_rlm.scripted import Reply, root_and_sub
from durable_rlm.store import schema
from durable_rlm.worker.runtime import EmbeddedServer
from durable_rlm.workflows import prompts
from durable_rlm.workflows.models import DurabilitySettings, EpisodeLimits, EpisodeRequest
from tests.conftest import request_for, run_episode, workers_for

MULTI = [
    "Let me look.\n```repl\nwords = context.split()\nprint(len(words))\n```",
    "```repl\nfirst = llm_query('summarise: ' + words[0])\n"
    "rest = llm_query_batched(['tag: ' + w for w in words[1:]])\n"
    "result = first + ' | ' + ','.join(rest)\nprint(result)\n```",
    "All done.\nFINAL_VAR(result)",
]


def upper(prompt: str) -> str:
    return prompt.upper()


async def test_a_multi_iteration_episode_answers_through_final_var(client, blobs, worker, scripted) -> None:
    server = scripted(root_and_sub(MULTI, upper))
    request = request_for(server, context=store_context(blobs, "alpha beta gamma"))
    result = await run_episode(client, request, worker.task_queue)
    assert result.answer == "SUMMARISE: ALPHA | TAG: BETA,TAG: GAMMA"
    assert result.ended_by == "final_var"
    assert (result.iterations, result.model_calls, result.sub_calls) == (3, 6, 3)
    assert len(server.root_requests()) == 3 and len(server.sub_requests()) == 3
    assert result.usage.total_tokens > 0


async def test_final_literal_ends_the_episode(client, worker, scripted) -> None:
    server = scripted(root_and_sub(["```repl\nprint(6 * 7)\n```", "The product is known.\nFINAL(42)"]))
    result = await run_episode(client, request_for(server), worker.task_queue)
    assert (result.answer, result.ended_by, result.iterations) == ("42", "final", 2)


async def test_the_answer_dict_ends_the_episode(client, worker, scripted) -> None:
    server = scripted(root_and_sub(["```repl\nanswer['content'] = 'via dict'\nanswer['ready'] = True\n```"]))
    result = await run_episode(client, request_for(server), worker.task_queue)
    assert (result.answer, result.ended_by, result.iterations) == ("via dict", "answer_ready", 1)


async def test_a_cell_error_is_fed_back_to_the_model(client, worker, scripted) -> None:
    server = scripted(root_and_sub(["```repl\nx = 1 / 0\n```", "FINAL(recovered)"]))
    result = await run_episode(client, request_for(server), worker.task_queue)
    assert result.answer == "recovered"
    assert "ZeroDivisionError" in server.root_requests()[1].last_user


async def test_malformed_output_gets_a_nudge_and_the_loop_goes_on(client, worker, scripted) -> None:
    server = scripted(root_and_sub(["I am thinking about it (no code, no answer).", "FINAL(ok)"]))
    result = await run_episode(client, request_for(server), worker.task_queue)
    assert result.answer == "ok"
    assert server.root_requests()[1].last_user == prompts.NO_CODE_TURN.format(fence="repl")


async def test_final_var_of_a_missing_variable_keeps_going(client, worker, scripted) -> None:
    server = scripted(root_and_sub(["FINAL_VAR(nothing_here)", "FINAL(second try)"]))
    result = await run_episode(client, request_for(server), worker.task_queue)
    assert (result.answer, result.iterations) == ("second try", 2)
    assert "nothing_here" in server.root_requests()[1].last_user


async def test_max_iterations_ends_without_an_answer(client, worker, scripted) -> None:
    server = scripted(root_and_sub(["```repl\nprint('still working')\n```"]))
    limits = EpisodeLimits(max_iterations=3, cell_timeout_s=10)
    result = await run_episode(client, request_for(server, limits=limits), worker.task_queue)
    assert (result.answer, result.ended_by, result.iterations) == (None, "max_iterations", 3)


async def test_max_llm_calls_stops_sub_calls_and_the_episode(client, worker, scripted) -> None:
    server = scripted(
        root_and_sub(
            ["```repl\nr = llm_query_batched(['a', 'b', 'c', 'd', 'e'])\nprint(r)\n```", "FINAL(never)"],
            upper,
        )
    )
    limits = EpisodeLimits(max_iterations=5, max_llm_calls=3, cell_timeout_s=10)
    result = await run_episode(client, request_for(server, limits=limits), worker.task_queue)
    assert (result.ended_by, result.sub_calls) == ("max_llm_calls", 3)
    assert len(server.sub_requests()) == 3
    # The limit is checked before the next root call: the cell saw the two refused calls,
    # and extraction read them, but the model was not asked again.
    assert len(server.root_requests()) == 1
    (extraction,) = server.extraction_requests()
    assert "max LLM calls reached (3/3)" in extraction.last_user
    assert "Error: max_llm_calls (3) reached: the call was not made" in extraction.last_user


async def test_an_unknown_model_ends_the_episode_with_a_clear_error(client, worker, scripted) -> None:
    server = scripted(root_and_sub(["FINAL(x)"]), models={"scripted-only"})
    result = await run_episode(client, request_for(server), worker.task_queue)
    assert result.ended_by == "model_error"
    assert "scripted" in (result.error or "") and "HTTP 404" in (result.error or "")
    assert len(server.requests) == 1  # not retried


async def test_an_unreachable_base_url_ends_with_a_clear_error(client, worker) -> None:
    from types import SimpleNamespace

    from durable_rlm.ports import free_port

    nowhere = SimpleNamespace(base_url=f"http://127.0.0.1:{free_port()}/v1")  # nothing listens
    result = await run_episode(client, request_for(nowhere), worker.task_queue)
    assert (result.ended_by, result.status, result.failure_cause) == ("model_error", "failed", "model")
    assert "cannot reach" in (result.error or "") and nowhere.base_url in (result.error or "")


async def test_provider_errors_are_retried_by_temporal(client, worker, scripted) -> None:
    calls = {"n": 0}

    def flaky(request):
        calls["n"] += 1
        if calls["n"] == 1:
            return Reply(status=503, error="overloaded", headers={"retry-after": "0"})
        return "FINAL(after retry)"

    server = scripted(flaky)
    result = await run_episode(client, request_for(server), worker.task_queue)
    assert result.answer == "after retry"
    assert len(server.requests) == 2


async def test_a_failing_sub_call_is_an_observation_not_a_crash(client, worker, scripted) -> None:
    server = scripted(
        root_and_sub(
            [
                "```repl\ntry:\n    llm_query('x')\nexcept RuntimeError as e:\n    print('caught', e)\n```",
                "FINAL(fine)",
            ],
            lambda p: Reply(status=400, error="bad prompt"),
        )
    )
    result = await run_episode(client, request_for(server), worker.task_queue)
    assert result.answer == "fine"
    assert "caught llm_query failed" in server.root_requests()[1].last_user
    assert "bad prompt" in server.root_requests()[1].last_user


async def test_timeline_shows_each_iteration(client, blobs, worker, scripted) -> None:
    server = scripted(root_and_sub(MULTI, upper))
    episode_id = f"timeline-{uuid.uuid4().hex[:8]}"
    request = request_for(server, context=store_context(blobs, "alpha beta gamma"))
    await run_episode(client, request, worker.task_queue, episode_id)
    timeline = await episode_timeline(client, episode_id)
    assert [i.iteration for i in timeline.iterations] == [1, 2, 3]
    cell = timeline.iterations[1].cells[0]
    assert "llm_query_batched" in cell.code
    assert [c.reply for c in cell.sub_calls] == ["SUMMARISE: ALPHA", "TAG: BETA", "TAG: GAMMA"]
    assert cell.stdout.startswith("SUMMARISE: ALPHA")
    text = render(timeline)
    assert "=== iteration 2 ===" in text and "Answer (model): SUMMARISE: ALPHA" in text


async def test_the_audit_store_records_the_episode(client, store, worker, scripted) -> None:
    server = scripted(root_and_sub(["FINAL(audited)"]))
    episode_id = f"audit-{uuid.uuid4().hex[:8]}"
    await run_episode(client, request_for(server), worker.task_queue, episode_id)
    with store[1].connect() as conn:
        row = conn.execute(sa.select(schema.episodes).where(schema.episodes.c.episode_id == episode_id)).one()
    assert (row.status, row.ended_by, row.answer, row.iterations) == ("answered", "final", "audited", 1)


async def test_history_grows_by_bounded_bytes_per_iteration(client, blobs, worker, scripted) -> None:
    """Claim check: a 2 MB context and 60 KB of output per cell; history per iteration flat."""
    turn = "```repl\nprint(context[:60_000])\n```"
    server = scripted(root_and_sub([turn]))
    context = store_context(blobs, "x" * 2_000_000)
    sizes = {}
    for iterations in (3, 6, 12):
        episode_id = f"bounded-{iterations}-{uuid.uuid4().hex[:6]}"
        limits = EpisodeLimits(max_iterations=iterations, cell_timeout_s=10)
        await run_episode(
            client, request_for(server, context=context, limits=limits), worker.task_queue, episode_id
        )
        history = await client.get_workflow_handle(episode_id).fetch_history()
        sizes[iterations] = sum(e.ByteSize() for e in history.events)
        assert max(e.ByteSize() for e in history.events) < 16_000
    early = (sizes[6] - sizes[3]) / 3
    late = (sizes[12] - sizes[6]) / 6
    assert late < early * 1.25, sizes  # linear in iterations, not quadratic
    assert late < 20_000, sizes


async def test_continue_as_new_carries_the_episode_over(session_dir: Path, store, blobs, scripted) -> None:
    server = scripted(
        root_and_sub(
            [
                "```repl\nimport time\nbegan = time.time()\n"
                "count = globals().get('count', 0) + 1\nprint(count)\n```",
                "```repl\ncount += 1\n```",
                "```repl\ncount += 1\n```",
                "```repl\ncount += 1\n```",
                "FINAL_VAR(count)",
            ]
        )
    )
    args = ("--dynamic-config-value", "limit.historyCount.suggestContinueAsNew=20")
    async with EmbeddedServer(session_dir / "can.sqlite", extra_args=args) as address:
        from durable_rlm.store.codec import data_converter

        can_client = await Client.connect(address, data_converter=data_converter(blobs))
        async with workers_for(can_client, store, session_dir, "can-queue"):
            episode_id = f"can-{uuid.uuid4().hex[:6]}"
            result = await run_episode(can_client, request_for(server), "can-queue", episode_id)
            timeline = await episode_timeline(can_client, episode_id)
            history = await can_client.get_workflow_handle(episode_id).fetch_history()
            started = history.events[0].workflow_execution_started_event_attributes
            (carried,) = await can_client.data_converter.decode(started.input.payloads, [EpisodeRequest])
    assert result.answer == "4"  # REPL state crossed runs: the sandbox followed the log head
    assert result.iterations == 5
    assert timeline.runs > 1
    # The new run carries the latest snapshot (cell 1 read the clock), not the cell log.
    assert carried.carry is not None and carried.carry.snapshot is not None
    assert carried.carry.snapshot.cell == 1
    assert len(carried.carry.model_dump_json()) < 4_000


async def test_results_are_the_same_for_the_same_script_and_seed(client, blobs, worker, scripted) -> None:
    rolls = "```repl\nimport random\nroll = random.randint(1, 10**9)\nprint(roll)\n```"
    server = scripted(root_and_sub([rolls, "FINAL_VAR(roll)"]))
    context = store_context(blobs, "one two")
    first = await run_episode(client, request_for(server, context=context, seed=5), worker.task_queue)
    second = await run_episode(client, request_for(server, context=context, seed=5), worker.task_queue)
    other = await run_episode(client, request_for(server, context=context, seed=6), worker.task_queue)
    assert first.answer == second.answer != other.answer  # the sandbox's random is seeded
    assert (first.model_calls, first.usage) == (second.model_calls, second.usage)
    assert first.model_time_s > 0


async def test_the_audit_projection_is_rebuilt_from_histories(client, store, worker, scripted) -> None:
    from durable_rlm.audit.projection import rebuild_audit

    server = scripted(root_and_sub(["FINAL(rebuilt)"]))
    episode_id = f"rebuild-{uuid.uuid4().hex[:8]}"
    await run_episode(client, request_for(server, task="audit me"), worker.task_queue, episode_id)
    table = schema.episodes
    with store[1].connect() as conn:
        before = conn.execute(sa.select(table).where(table.c.episode_id == episode_id)).one()
    count = await rebuild_audit(client, store[1])  # drops every row, then reads histories
    assert count >= 1
    with store[1].connect() as conn:
        after = conn.execute(sa.select(table).where(table.c.episode_id == episode_id)).one()
    keys = ("run_id", "task", "status", "ended_by", "answer", "iterations", "model_calls", "prompt_tokens")
    assert [getattr(after, k) for k in keys] == [getattr(before, k) for k in keys]
    assert after.answer == "rebuilt"


async def test_the_sandbox_is_closed_when_the_episode_ends(client, worker, scripted) -> None:
    server = scripted(root_and_sub(["```repl\nx = 1\n```", "FINAL_VAR(x)"]))
    episode_id = f"closed-{uuid.uuid4().hex[:6]}"
    result = await run_episode(client, request_for(server), worker.task_queue, episode_id)
    assert result.answer == "1"
    assert episode_id not in worker.live_episodes()  # repl_close ran on the worker holding it


async def test_a_batch_runs_in_waves_of_max_parallel_subcalls(client, worker, scripted) -> None:
    import threading
    import time

    lock, in_flight, peak = threading.Lock(), [0], [0]

    def slow_upper(prompt: str) -> str:
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        time.sleep(0.4)
        with lock:
            in_flight[0] -= 1
        return prompt.upper()

    batch = "```repl\nr = llm_query_batched([f'p{i}' for i in range(7)])\nprint(r)\n```"
    server = scripted(root_and_sub([batch, "FINAL_VAR(r)"], slow_upper))
    limits = EpisodeLimits(max_iterations=4, max_parallel_subcalls=3, cell_timeout_s=10)
    result = await run_episode(client, request_for(server, limits=limits), worker.task_queue)
    assert result.answer == str([f"P{i}" for i in range(7)])  # in order, whatever finished first
    assert peak[0] == 3  # three waves: 3, 3, 1
    assert result.sub_calls == 7


async def test_a_divergent_rebuild_is_counted_in_the_result(client, worker, scripted) -> None:
    import threading

    gate = threading.Event()

    def script(request):
        if not request.is_root:
            return "seen"
        if request.turn == 1:
            gate.wait(30)  # the test drops the worker's sandbox meanwhile
            return "```repl\nprint(first)\n```"
        return ["```repl\nimport time\nfirst = llm_query(str(time.time_ns()))\n```", "", "FINAL_VAR(first)"][
            min(request.turn, 2)
        ]

    server = scripted(script)
    # Without snapshots: a snapshot after cell 1 (it read the clock) would spare the re-run
    # (test_snapshots.py::test_clock_and_randomness_come_back_as_the_model_saw_them).
    durability = DurabilitySettings(heartbeat_timeout_s=3, sticky_schedule_to_start_s=3, snapshots=None)
    task = asyncio.ensure_future(
        run_episode(client, request_for(server, durability=durability), worker.task_queue)
    )
    while not any(r.turn == 1 for r in server.root_requests()):
        await asyncio.sleep(0.05)
    await worker.close_all()  # the next step rebuilds, and cell 1 asks a different question
    gate.set()
    result = await asyncio.wait_for(task, 60)
    assert (result.answer, result.replay_divergences) == ("seen", 1)
