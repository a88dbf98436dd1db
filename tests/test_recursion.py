"""Recursive sub-episodes end to end: rlm_query / rlm_query_batched start child episodes
(Temporal child workflows) on the real dev server; the scripted model answers the parent
and the children differently, routed by model name."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from datetime import timedelta

import pytest
from temporalio.client import WorkflowExecutionStatus

from durable_rlm.audit.timeline import episode_timeline, render
from durable_rlm.client.episodes import cancel_episode, start_episode, store_context
from durable_rlm.scripted import ChatRequest, Reply
from durable_rlm.workflows.models import EpisodeLimits, EpisodeRequest, ModelSettings
from tests.conftest import request_for, run_episode

Turns = list["Reply | str"]


def by_model(
    turns: dict[str, Turns],
    sub: Callable[[str], str] = lambda prompt: f"<{prompt}>",
    extract: Reply | str = '{"answer": "partial"}',
) -> Callable[[ChatRequest], Reply | str]:
    """Root calls of model M get turns[M][turn]; sub-calls get sub(prompt)."""

    def script(request: ChatRequest) -> Reply | str:
        if request.is_extraction:
            return extract
        if request.is_root:
            script_turns = turns[request.model]
            return script_turns[min(request.turn, len(script_turns) - 1)]
        return sub(request.last_user)

    return script


def tree_request(server, task: str, models: list[str], **overrides: object) -> EpisodeRequest:
    request = request_for(server, task, **overrides)
    others = [ModelSettings(model=m, base_url=server.base_url, max_attempts=3) for m in models]
    return request.model_copy(
        update={
            "root_model": request.root_model.model_copy(update={"model": "root-m"}),
            "other_models": others,
        }
    )


def calls_of(server, model: str) -> list[ChatRequest]:
    return [r for r in server.requests if r.model == model]


SUM_CHILD: Turns = [
    "```repl\ntotal = sum(int(x) for x in context.split(','))\nprint(total)\n```",
    "FINAL_VAR(total)",
]


async def test_batched_children_answer_from_their_own_repls(client, scripted, blobs, worker) -> None:
    chunks = [[3, 5, 8], [13, 21], [34, 55, 89, 144]]
    server = scripted(
        by_model(
            {
                "root-m": [
                    "```repl\nparts = [','.join(str(n) for n in chunk) for chunk in context]\n"
                    "answers = rlm_query_batched(parts, model='child-m')\nprint(answers)\n"
                    "grand = sum(int(a) for a in answers)\n```",
                    "FINAL_VAR(grand)",
                ],
                "child-m": SUM_CHILD,
            }
        )
    )
    request = tree_request(server, "add up every number", ["child-m"], max_depth=2)
    request = request.model_copy(update={"context": store_context(blobs, chunks)})
    result = await run_episode(client, request, worker.task_queue)

    assert result.answer == str(sum(sum(c) for c in chunks))
    assert result.ended_by == "final_var"
    assert [c.answer for c in result.children] == [str(sum(c)) for c in chunks]
    assert {c.depth for c in result.children} == {1}
    assert {c.ended_by for c in result.children} == {"final_var"}
    assert result.tree_episodes == 4
    # Totals of the whole tree: 2 root turns here, 2 per child.
    assert len(server.requests) == result.model_calls == 8
    assert result.sub_calls == 6
    assert 0 < sum(c.tokens for c in result.children) < result.usage.total_tokens
    # Each child reasoned over its prompt as `context`, with the child's task wording.
    first_child = calls_of(server, "child-m")[0]
    assert "a parent episode handed it to you" in first_child.last_user
    ids = [c.episode_id for c in result.children]
    assert len(set(ids)) == 3 and all(i.startswith(result.episode_id + "/1.") for i in ids)


async def test_depth_three_tree_and_the_last_level_is_a_plain_call(client, scripted, worker) -> None:
    server = scripted(
        by_model(
            {
                "root-m": [
                    "```repl\nr = rlm_query('17,25', model='mid-m')\nprint(r)\n```",
                    "```repl\nFINAL('root saw ' + r)\n```",
                ],
                "mid-m": [
                    "```repl\ndoubled = ','.join(str(2 * int(x)) for x in context.split(','))\n"
                    "r = rlm_query(doubled, model='leaf-m')\nprint(r)\n```",
                    "```repl\nFINAL('mid saw ' + r)\n```",
                ],
                "leaf-m": [
                    "```repl\ntotal = sum(int(x) for x in context.split(','))\n"
                    "plain = rlm_query('is this a plain call?')\nprint(total, plain)\n```",
                    "```repl\nFINAL(f'{total} {plain}')\n```",
                ],
            }
        )
    )
    request = tree_request(server, "answer", ["mid-m", "leaf-m"], max_depth=3)
    result = await run_episode(client, request, worker.task_queue)

    assert result.answer == "root saw mid saw 84 <is this a plain call?>"
    assert result.tree_episodes == 3
    (mid,) = result.children
    assert (mid.depth, mid.episodes, mid.model) == (1, 2, "mid-m")
    # The leaf is at depth 2 = max_depth - 1: its rlm_query went to the sub-model as a plain call.
    plain = [r for r in server.requests if not r.is_root]
    assert [r.last_user for r in plain] == ["is this a plain call?"]
    assert result.model_calls == len(server.requests) == 7

    # `drlm show`: each child indented under the cell that called it, with answer and totals.
    text = render(await episode_timeline(client, result.episode_id))
    lines = text.splitlines()
    mid_line = next(i for i, line in enumerate(lines) if f"child {mid.episode_id} " in line)
    leaf_line = next(i for i, line in enumerate(lines) if f"child {mid.episode_id}/1.0 " in line)
    assert lines[mid_line].startswith("    child ") and lines[leaf_line].startswith("            child ")
    assert "depth 1: answered (final), answer 'mid saw 84 <is this a plain call?>'" in lines[mid_line]
    assert "2 episode(s)" in lines[mid_line]
    cell_1 = lines.index("--- cell 1 ---")
    output_1 = lines.index("output:", cell_1)
    assert cell_1 < mid_line < leaf_line < output_1
    assert "Tree: 3 episode(s), 1 direct child(ren)" in text


async def test_default_depth_makes_rlm_query_a_plain_call(client, scripted, worker) -> None:
    server = scripted(
        by_model({"root-m": ["```repl\nr = rlm_query('hello')\nprint(r)\n```", "FINAL_VAR(r)"]})
    )
    result = await run_episode(client, tree_request(server, "answer", []), worker.task_queue)
    assert result.answer == "<hello>"
    assert result.children == [] and result.tree_episodes == 1


async def test_a_tree_never_spends_more_than_the_root_budget(client, scripted, worker) -> None:
    # Every episode keeps asking for two more children and never answers on its own.
    greedy: Turns = ["```repl\nprint(rlm_query_batched(['a', 'b']))\n```"]
    server = scripted(by_model({"root-m": greedy}))
    limits = EpisodeLimits(max_iterations=6, max_llm_calls=40, max_model_calls=14, cell_timeout_s=10)
    request = tree_request(server, "answer", [], max_depth=3, limits=limits)
    request = request.model_copy(update={"sub_model": request.root_model})
    result = await run_episode(client, request, worker.task_queue)

    assert len(server.requests) <= 14
    assert result.model_calls == len(server.requests)
    assert result.ended_by == "max_model_calls"
    assert result.tree_episodes > 3  # children and grandchildren did start
    assert any(c.ended_by == "max_model_calls" for c in result.children)


async def test_what_children_spend_counts_against_the_parents_llm_calls(client, scripted, worker) -> None:
    # No max_model_calls here: max_llm_calls (calls from the root's REPL) alone bounds the tree.
    greedy: Turns = ["```repl\nprint(rlm_query_batched(['a', 'b']))\n```"]
    server = scripted(by_model({"root-m": greedy}))
    limits = EpisodeLimits(max_iterations=6, max_llm_calls=6, cell_timeout_s=10)
    request = tree_request(server, "answer", [], max_depth=3, limits=limits, fallback_extraction=False)
    request = request.model_copy(update={"sub_model": request.root_model})
    result = await run_episode(client, request, worker.task_queue)

    own = [r for r in server.requests if r.is_root and "a parent episode" not in r.messages[1]["content"]]
    assert len(server.requests) - len(own) == result.sub_calls == 6
    assert result.ended_by == "max_llm_calls" and result.tree_episodes == 7


async def test_a_child_whose_budget_is_spent_returns_an_error(client, scripted, worker) -> None:
    server = scripted(
        by_model(
            {
                "root-m": [
                    "```repl\nr = rlm_query_batched(['x', 'y'], model='mid-m')\nprint(r)\n```",
                    "```repl\nFINAL(' | '.join(r))\n```",
                ],
                "mid-m": ["```repl\ninner = rlm_query('deeper', model='leaf-m')\nprint(inner)\n```"],
                "leaf-m": ["FINAL(never)"],
            }
        )
    )
    limits = EpisodeLimits(max_iterations=6, max_llm_calls=40, max_model_calls=9, cell_timeout_s=10)
    request = tree_request(server, "answer", ["mid-m", "leaf-m"], max_depth=3, limits=limits)
    result = await run_episode(client, request, worker.task_queue)

    # 9 calls, one held for extraction: the root spends 1, each mid child gets 3 of the 6
    # left; a mid child holds one back, so the leaf it asks for cannot get the 2 it needs.
    assert calls_of(server, "leaf-m") == []
    assert [c.ended_by for c in result.children] == ["max_model_calls", "max_model_calls"]
    assert result.answer == "partial | partial"  # each mid child's extracted answer
    assert len(server.requests) == result.model_calls == 8
    mid_outputs = [r.last_user for r in calls_of(server, "mid-m") if r.turn == 1]
    assert all("Error: budget exhausted" in text for text in mid_outputs)


async def test_token_budget_starts_no_call_it_cannot_pay(client, scripted, worker) -> None:
    server = scripted(by_model({"root-m": ["```repl\nx = 1\n```"]}))
    limits = EpisodeLimits(max_iterations=6, max_tokens=1, cell_timeout_s=10)
    result = await run_episode(client, tree_request(server, "answer", [], limits=limits), worker.task_queue)
    assert result.ended_by == "max_tokens"
    # The first call alone is estimated past one token: no call, and no extraction either.
    assert server.requests == [] and server.extraction_requests() == []
    assert "no extraction call was made" in result.stop_reason


async def test_a_token_budget_ends_the_loop_while_it_can_still_pay_for_extraction(
    client, scripted, worker
) -> None:
    server = scripted(by_model({"root-m": ["```repl\nx = 1\n```"]}, extract='{"answer": "1"}'))
    limits = EpisodeLimits(max_iterations=20, max_tokens=6_000, cell_timeout_s=10)
    request = tree_request(server, "answer", [], limits=limits)
    request = request.model_copy(
        update={"root_model": request.root_model.model_copy(update={"max_tokens": 50})}
    )
    result = await run_episode(client, request, worker.task_queue)
    assert (result.ended_by, result.answer_source, result.answer) == ("max_tokens", "extraction", "1")
    assert 1 < result.iterations < 20
    assert result.usage.total_tokens <= 6_000  # the extraction was paid from what was kept back


async def test_bad_calls_are_errors_in_the_cell_and_the_parent_goes_on(client, scripted, worker) -> None:
    server = scripted(
        by_model(
            {
                "root-m": [
                    "```repl\n"
                    "try:\n    rlm_query(42)\nexcept TypeError as e:\n    print('T1', e)\n"
                    "try:\n    rlm_query('p', model=3)\nexcept TypeError as e:\n    print('T2', e)\n"
                    "try:\n    rlm_query_batched(['p'] * 3)\nexcept ValueError as e:\n    print('V', e)\n"
                    "print('U', rlm_query('p', model='no-such-model'))\n"
                    "```",
                    "FINAL(done)",
                ],
            }
        )
    )
    limits = EpisodeLimits(max_iterations=4, max_children_per_batch=2, cell_timeout_s=10)
    request = tree_request(server, "answer", [], max_depth=2, limits=limits)
    result = await run_episode(client, request, worker.task_queue)

    assert result.answer == "done"
    output = server.root_requests()[1].last_user
    assert "T1 rlm_query expects str prompts, got int" in output
    assert "T2 rlm_query: model must be a model name (str) or None, got int" in output
    assert "V rlm_query_batched got 3 prompts; at most 2 child episodes" in output
    assert "U Error: unknown model 'no-such-model' (known: root-m)" in output
    assert result.children == []


async def wait_for(condition: Callable[[], object], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


SLOW_CHILD: Turns = [Reply(text="```repl\nx = 1\n```", delay_s=60)]


async def started_tree(client, scripted, worker, episode_id: str):
    server = scripted(
        by_model(
            {
                "root-m": ["```repl\nparts = rlm_query_batched(['a', 'b'], model='slow-m')\n```"],
                "slow-m": SLOW_CHILD,
            }
        )
    )
    request = tree_request(server, "answer", ["slow-m"], max_depth=2)
    handle = await start_episode(client, request, worker.task_queue, episode_id)
    await wait_for(lambda: len(calls_of(server, "slow-m")) == 2)
    return server, handle


async def test_cancel_stops_the_whole_tree(client, scripted, worker) -> None:
    episode_id = f"cancel-tree-{uuid.uuid4().hex[:6]}"
    server, handle = await started_tree(client, scripted, worker, episode_id)
    started = time.monotonic()
    outcome = await cancel_episode(client, episode_id)
    assert outcome.accepted
    result = await asyncio.wait_for(handle.result(), 30)

    assert time.monotonic() - started < 20  # the 60 s children did not run out their time
    assert result.ended_by == "cancelled" and result.answer is None
    assert result.stop_reason == "Cancelled: cancelled by request"
    for child in (f"{episode_id}/1.0", f"{episode_id}/1.1"):
        description = await client.get_workflow_handle(child).describe()
        assert description.status == WorkflowExecutionStatus.CANCELED
    assert server.extraction_requests() == []
    assert [(c.episode_id, c.ended_by) for c in result.children] == [
        (f"{episode_id}/1.0", "cancelled"),
        (f"{episode_id}/1.1", "cancelled"),
    ]

    again = await cancel_episode(client, episode_id)
    assert not again.accepted and "already ended" in again.message
    assert (await handle.result()).ended_by == "cancelled"  # nothing changed


async def test_cancel_with_extract_returns_what_was_found(client, scripted, worker) -> None:
    episode_id = f"cancel-extract-{uuid.uuid4().hex[:6]}"
    server, handle = await started_tree(client, scripted, worker, episode_id)
    await cancel_episode(client, episode_id, extract=True, reason="operator stop")
    result = await asyncio.wait_for(handle.result(), 30)

    assert result.ended_by == "cancelled"
    assert result.answer == "partial" and result.answer_source == "extraction"
    assert result.execution is not None and result.execution.variant.kind == "extracted"
    assert str(result.execution.variant.reason) == "Cancelled (operator stop)"
    assert len(server.extraction_requests()) == 1
    assert "Cancelled (operator stop)" in server.extraction_requests()[0].last_user


@pytest.mark.parametrize("depth", [0, -1, 9])
def test_max_depth_out_of_range_is_refused(depth: int) -> None:
    with pytest.raises(ValueError, match="max_depth"):
        EpisodeRequest(task="t", root_model=ModelSettings(model="m"), max_depth=depth)


@pytest.mark.slow  # long end to end (issue 34: the default run near 13 min); CI runs it
async def test_a_child_runs_out_of_time_before_its_parent(client, scripted, worker) -> None:
    # The child never answers; its deadline comes a little before the parent's, so it
    # extracts its answer and hands it over before the parent's own timer fires.
    server = scripted(
        by_model(
            {
                "root-m": ["```repl\nr = rlm_query('think', model='slow-m')\nprint(r)\n```"],
                "slow-m": [Reply(text="```repl\nx = 1\n```", delay_s=1)],
            },
            extract='{"answer": "partial"}',
        )
    )
    limits = EpisodeLimits(max_iterations=20, max_duration=timedelta(seconds=8), cell_timeout_s=10)
    result = await run_episode(
        client, tree_request(server, "answer", ["slow-m"], max_depth=2, limits=limits), worker.task_queue
    )
    child = result.children[0]
    assert (child.ended_by, child.answer) == ("max_duration", "partial")
    assert result.ended_by == "max_duration"


@pytest.mark.slow  # long end to end (issue 34: the default run near 13 min); CI runs it
async def test_a_cancel_while_the_episode_closes_changes_nothing(client, scripted, worker) -> None:
    server = scripted(
        by_model({"root-m": ["```repl\nx = 1\n```"]}, extract=Reply(text='{"answer": "x"}', delay_s=3))
    )
    limits = EpisodeLimits(max_iterations=1, cell_timeout_s=10)
    episode_id = f"closing-{uuid.uuid4().hex[:6]}"
    handle = await start_episode(
        client, tree_request(server, "answer", [], limits=limits), worker.task_queue, episode_id
    )
    await wait_for(lambda: server.extraction_requests())
    refused = await cancel_episode(client, episode_id)
    assert not refused.accepted and "closing; nothing was changed" in refused.message
    result = await handle.result()
    assert (result.ended_by, result.answer) == ("max_iterations", "x")
