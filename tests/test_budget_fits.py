"""Budgets that work at any size (docs/architecture/decisions.md#a-budget-works-at-any-size):
a token budget pays for the first root call it can cover, and what is held back for an
extraction never exceeds what is left. Real episodes on the dev server against the scripted
model."""

from __future__ import annotations

import pytest

from durable_rlm.scripted import root_and_sub
from durable_rlm.workflows.budget import CallEstimate, extraction_refusal, root_call_limit
from durable_rlm.workflows.models import EpisodeCarry, EpisodeLimits, Message
from tests.conftest import request_for, run_episode


def limits(max_tokens: int) -> EpisodeLimits:
    return EpisodeLimits(max_iterations=8, max_tokens=max_tokens, cell_timeout_s=10)


async def test_a_2500_token_budget_makes_its_root_calls_and_answers(client, scripted, worker) -> None:
    server = scripted(root_and_sub(["```repl\nx = 6 * 7\nprint(x)\n```", "FINAL_VAR(x)"]))
    result = await run_episode(client, request_for(server, limits=limits(2_500)), worker.task_queue)
    assert len(server.root_requests()) == 2 and server.extraction_requests() == []
    assert (result.answer, result.ended_by) == ("42", "final_var")
    assert result.usage.total_tokens <= 2_500


async def test_a_1000_token_budget_makes_its_first_call_and_still_answers(client, scripted, worker) -> None:
    # Before: the first call's estimate (prompt + a 1,000-token reply) was refused, and so
    # was the extraction: no call at all, no answer. Now the first call is made, the next
    # one would leave no room to extract, so the extraction answers within the budget.
    server = scripted(
        root_and_sub(["```repl\nx = 'hello'\n```", "FINAL_VAR(x)"], extract=lambda p: '{"answer": "hello"}')
    )
    result = await run_episode(client, request_for(server, limits=limits(1_000)), worker.task_queue)
    assert len(server.root_requests()) >= 1
    assert result.answer == "hello"
    assert result.usage.total_tokens <= 1_000


async def test_a_small_budget_extracts_with_a_reply_capped_at_what_is_left(client, scripted, worker) -> None:
    # Never answers: the budget runs low, the loop stops, extraction gets what is left.
    looking = "```repl\nprint('still looking at the context, nothing yet')\n```"
    server = scripted(root_and_sub([looking], extract=lambda p: '{"answer": "partial"}'))
    result = await run_episode(client, request_for(server, limits=limits(2_500)), worker.task_queue)
    assert len(server.root_requests()) >= 2
    assert result.ended_by == "max_tokens" and result.answer == "partial"
    (extraction,) = server.extraction_requests()
    cap = extraction.body.get("max_tokens") or extraction.body.get("max_completion_tokens")
    spent_before = result.usage.total_tokens - extraction_tokens(extraction)
    assert cap is not None and cap <= 2_500 - spent_before


def extraction_tokens(request) -> int:
    # The scripted server counts chars // 4 for the prompt and the reply.
    prompt = sum(len(str(m.get("content", ""))) for m in request.messages) // 4
    return prompt + len('{"answer": "partial"}') // 4


def test_the_first_call_keeps_nothing_back_for_an_extraction_with_nothing_to_read() -> None:
    opening = [Message(role="system", content="s" * 1_500), Message(role="user", content="u" * 100)]
    request = request_for_unit(2_500)
    state = EpisodeCarry(seed=1, deadline="2030-01-01T00:00:00Z", pending=opening)
    # Kept back for an extraction, the estimate (prompt + 1,000-token reply) twice would pass
    # 2,500: with nothing to extract yet, the first call needs only to fit.
    assert root_call_limit(request, state) is None
    # 400 prompt tokens and the shortest reply worth a call (MIN_REPLY_TOKENS).
    assert root_call_limit(request_for_unit(432), state) is None
    assert root_call_limit(request_for_unit(431), state) is not None


def test_an_extraction_is_refused_only_when_its_prompt_cannot_fit() -> None:
    state = EpisodeCarry(seed=1, deadline="2030-01-01T00:00:00Z", iteration=2, model_calls=2)
    state.last_prompt_tokens, state.last_reply_tokens = 600, 0
    request = request_for_unit(1_000)
    state.usage = state.usage.model_copy(update={"prompt_tokens": 300})
    assert CallEstimate.of(request, state).tokens > 700  # the 1,000-token reply guess does not fit ...
    assert extraction_refusal(request, state) is None  # ... but a reply of what is left does
    state.usage = state.usage.model_copy(update={"prompt_tokens": 400})
    assert extraction_refusal(request, state) is not None


class _Server:
    base_url = "http://127.0.0.1:9/v1"


def request_for_unit(max_tokens: int):
    return request_for(_Server(), limits=limits(max_tokens))  # type: ignore[arg-type]


# --- provider-reported cost: used when present, the price table otherwise ---------------------


async def test_a_cost_budget_counts_the_cost_the_provider_reports(client, scripted, worker) -> None:
    from durable_rlm.audit.timeline import episode_timeline
    from durable_rlm.scripted import Reply
    from durable_rlm.workflows.models import EpisodeRequest

    # No price for this model: max_cost_usd works because the provider reports each cost.
    server = scripted(root_and_sub([Reply(text="```repl\nprint(1)\n```", cost=0.02)]))
    data = request_for(server).model_dump()
    data["limits"] = EpisodeLimits(max_iterations=8, max_cost_usd=0.05, cell_timeout_s=10).model_dump()
    with pytest.raises(ValueError, match="max_cost_usd needs a price"):
        EpisodeRequest.model_validate(data)
    data["root_model"]["reports_cost"] = True
    request = EpisodeRequest.model_validate(data)
    result = await run_episode(client, request, worker.task_queue)

    assert result.ended_by == "max_cost_usd"
    assert len(server.root_requests()) == 3  # 0.02 each: the third passes 0.05, then nothing more
    assert result.usage.cost_usd == pytest.approx(0.06)
    timeline = await episode_timeline(client, result.episode_id)
    assert [it.usage.cost_source for it in timeline.iterations if it.usage] == ["provider"] * 3


async def test_without_a_reported_cost_the_price_table_prices_the_call(client, scripted, worker) -> None:
    from durable_rlm.audit.timeline import episode_timeline
    from durable_rlm.workflows.models import EpisodeRequest, ModelPrice

    server = scripted(root_and_sub(["```repl\nx = 1\n```", "FINAL_VAR(x)"]))
    data = request_for(server).model_dump()
    data["limits"] = EpisodeLimits(max_iterations=4, max_cost_usd=1.0, cell_timeout_s=10).model_dump()
    data["root_model"]["price"] = ModelPrice(input_usd_per_mtok=1.0, output_usd_per_mtok=2.0).model_dump()
    request = EpisodeRequest.model_validate(data)
    result = await run_episode(client, request, worker.task_queue)
    timeline = await episode_timeline(client, result.episode_id)
    usages = [it.usage for it in timeline.iterations if it.usage]
    assert [u.cost_source for u in usages] == ["price_table"] * 2
    assert result.usage.cost_usd == pytest.approx(sum(u.cost_usd for u in usages))
