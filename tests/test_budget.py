"""Budgets down the tree of episodes (workflows/budget.py), as pure functions: what an episode
has left, whether its next root call, an extraction or a sub-call may start, and a child's
share. Each limit is pinned on both sides of its boundary; no server, no sandbox."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from durable_rlm.workflows.budget import (
    MIN_CHILD_CALLS_WITH_EXTRACTION,
    MIN_REPLY_TOKENS,
    CallEstimate,
    ChildBudget,
    calls_left,
    child_budgets,
    cost_left,
    cost_spent,
    extraction_refusal,
    extraction_reply_cap,
    extraction_reserve,
    floor_cost,
    limit_reached,
    model_calls_room,
    nothing_to_extract,
    root_call_limit,
    sub_call_refusal,
    tokens_left,
    tokens_spent,
)
from durable_rlm.workflows.fallback import FallbackReason
from durable_rlm.workflows.models import (
    COST_DIGITS,
    EpisodeCarry,
    EpisodeLimits,
    EpisodeRequest,
    Message,
    ModelPrice,
    ModelSettings,
    TokenUsage,
)

DEADLINE = datetime(2030, 1, 1, tzinfo=UTC)
MILLI_PRICE = ModelPrice(input_usd_per_mtok=1_000, output_usd_per_mtok=1_000)  # $0.001 a token


def request(
    *,
    extraction: bool = True,
    max_tokens: int | None = None,
    reply_tokens: int | None = None,
    price: ModelPrice | None = None,
    **limits: object,
) -> EpisodeRequest:
    """An episode request: `max_tokens` is the token budget, `reply_tokens` the root model's own
    max_tokens (its reply length)."""
    return EpisodeRequest(
        task="t",
        root_model=ModelSettings(model="m", max_tokens=reply_tokens, price=price),
        limits=EpisodeLimits(max_tokens=max_tokens, **limits),  # type: ignore[arg-type]
        fallback_extraction=extraction,
    )


def state(
    *, tokens: int = 0, cost: float | None = 0.0, iteration: int = 1, model_calls: int = 1, **fields: object
) -> EpisodeCarry:
    """Episode state after its first step by default (so an extraction would have a reply to
    read); `tokens` and `cost` are what it has spent."""
    return EpisodeCarry(
        seed=1,
        deadline=DEADLINE,
        iteration=iteration,
        model_calls=model_calls,
        usage=TokenUsage(prompt_tokens=tokens, cost_usd=cost),
        **fields,  # type: ignore[arg-type]
    )


def sized(prompt: int = 100, reply: int = 0, **fields: object) -> EpisodeCarry:
    """A state whose last request had `prompt` tokens and whose last reply had `reply`."""
    return state(last_prompt_tokens=prompt, last_reply_tokens=reply, **fields)


# --- what is left ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extraction", "max_model_calls", "reserved"),
    [(True, 5, 1), (True, None, 0), (False, 5, 0), (False, None, 0)],
)
def test_one_call_is_kept_for_extraction_only_under_a_model_call_limit(
    extraction: bool, max_model_calls: int | None, reserved: int
) -> None:
    assert extraction_reserve(request(extraction=extraction, max_model_calls=max_model_calls)) == reserved


def test_the_model_call_room_counts_calls_made_and_the_one_kept_for_extraction() -> None:
    assert model_calls_room(request(), state(model_calls=3)) is None
    assert model_calls_room(request(max_model_calls=10), state(model_calls=3)) == 6
    assert model_calls_room(request(max_model_calls=10, extraction=False), state(model_calls=3)) == 7
    # Past the limit (children spent more than expected) the room is negative, not clamped.
    assert model_calls_room(request(max_model_calls=3), state(model_calls=5)) == -3


def test_calls_left_is_the_tighter_of_the_sub_call_and_model_call_limits() -> None:
    assert calls_left(request(max_llm_calls=50), state(sub_calls=7)) == 43
    assert calls_left(request(max_llm_calls=50, max_model_calls=10), state(sub_calls=7, model_calls=3)) == 6
    assert calls_left(request(max_llm_calls=8, max_model_calls=30), state(sub_calls=7, model_calls=3)) == 1


def test_tokens_spent_include_what_children_spent_without_telling() -> None:
    carry = state(unaccounted_tokens=5)
    carry.usage = TokenUsage(prompt_tokens=300, completion_tokens=20)
    assert tokens_spent(carry) == 325
    assert tokens_left(request(), carry) is None
    assert tokens_left(request(max_tokens=1_000), carry) == 675
    assert tokens_left(request(max_tokens=300), carry) == -25


def test_cost_spent_adds_unaccounted_shares_and_rounds_to_cost_digits() -> None:
    assert cost_spent(state(cost=0.1, unaccounted_cost_usd=0.2)) == 0.3  # not 0.30000000000000004
    assert cost_spent(state(cost=None, unaccounted_cost_usd=0.25)) == 0.25  # unknown cost counts as 0
    assert cost_spent(state(cost=4e-10)) == 0.0  # below a billionth of a dollar
    assert cost_spent(state(cost=6e-10)) == 1e-9
    assert COST_DIGITS == 9


def test_cost_left_is_none_without_a_cost_limit_and_rounded_with_one() -> None:
    assert cost_left(request(price=MILLI_PRICE), state(cost=0.5)) is None
    assert cost_left(request(max_cost_usd=1.0, price=MILLI_PRICE), state(cost=0.9)) == 0.1
    assert cost_left(request(max_cost_usd=0.5000000004, price=MILLI_PRICE), state(cost=0.0)) == 0.5
    assert cost_left(request(max_cost_usd=0.5, price=MILLI_PRICE), state(cost=0.75)) == -0.25


# --- the size of the next root-sized call ---------------------------------------------------------


def test_a_call_is_estimated_as_the_last_prompt_and_reply_plus_the_queued_turns() -> None:
    queued = [Message(role="user", content="x" * 10), Message(role="user", content="y" * 7)]  # 17 // 4
    carry = sized(prompt=100, reply=20, pending=queued)
    estimate = CallEstimate.of(request(reply_tokens=500), carry)
    assert estimate == CallEstimate(tokens=124 + 500, cost_usd=0.0, prompt_tokens=124)


def test_the_reply_is_guessed_from_max_tokens_else_the_last_reply_else_the_default() -> None:
    assert CallEstimate.of(request(reply_tokens=500), sized(reply=20)).tokens == 120 + 500
    assert CallEstimate.of(request(), sized(reply=20)).tokens == 120 + 20
    assert CallEstimate.of(request(), sized(reply=0)).tokens == 100 + 1_000  # REPLY_TOKENS_ESTIMATE


def test_a_priced_model_prices_the_prompt_and_the_reply_at_their_own_rates() -> None:
    price = ModelPrice(input_usd_per_mtok=2, output_usd_per_mtok=10)
    estimate = CallEstimate.of(request(reply_tokens=500, price=price), sized(prompt=124))
    assert estimate.cost_usd == (124 * 2 + 500 * 10) / 1e6
    assert CallEstimate(tokens=1, cost_usd=0.0).prompt_tokens == 0


@pytest.mark.parametrize(
    ("room", "reply"),
    [
        (None, 500),
        (10_000, 500),  # room for the whole reply: the guess stands
        (100 + 500, 500),
        (100 + 499, 499),  # the reply shrinks to the room its prompt leaves
        (100 + 33, 33),
        (100 + MIN_REPLY_TOKENS, MIN_REPLY_TOKENS),
        (100 + 31, MIN_REPLY_TOKENS),  # ... but never below the shortest reply worth a call
        (50, MIN_REPLY_TOKENS),
    ],
)
def test_with_room_the_reply_fits_what_the_prompt_leaves_but_not_below_the_minimum(
    room: int | None, reply: int
) -> None:
    estimate = CallEstimate.of(request(reply_tokens=500), sized(prompt=100), room=room)
    assert (estimate.tokens, estimate.prompt_tokens) == (100 + reply, 100)


# --- the next root call ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model_calls", "iteration", "nothing"), [(0, 0, True), (1, 0, False), (0, 1, False), (2, 2, False)]
)
def test_there_is_nothing_to_extract_before_the_first_root_reply(
    model_calls: int, iteration: int, nothing: bool
) -> None:
    assert nothing_to_extract(state(model_calls=model_calls, iteration=iteration)) is nothing


def test_the_model_call_limit_counts_the_calls_of_the_step_and_the_one_kept_back() -> None:
    limited = request(max_model_calls=5)
    assert root_call_limit(limited, state(model_calls=3)) is None  # room 1
    assert root_call_limit(limited, state(model_calls=3), calls=2) == FallbackReason(
        kind="max_model_calls", value=3, limit=5
    )
    assert root_call_limit(limited, state(model_calls=4)) == FallbackReason(
        kind="max_model_calls", value=4, limit=5
    )
    assert root_call_limit(request(max_model_calls=5, extraction=False), state(model_calls=4)) is None


def test_a_spent_token_budget_stops_the_loop() -> None:
    limited = request(max_tokens=100)
    assert root_call_limit(limited, state(tokens=100)) == FallbackReason(
        kind="max_tokens", value=100, limit=100
    )
    assert root_call_limit(limited, state(tokens=130)) == FallbackReason(
        kind="max_tokens", value=130, limit=100
    )
    assert root_call_limit(request(), state(tokens=10**9)) is None


@pytest.mark.parametrize(
    ("extraction", "calls", "needed"),
    [(True, 1, 2 * 200), (False, 1, 200), (True, 2, 3 * 200), (False, 3, 3 * 200)],
)
def test_the_tokens_left_must_cover_the_step_and_one_extraction(
    extraction: bool, calls: int, needed: int
) -> None:
    # A call is estimated at 100 prompt tokens plus a 100-token reply.
    limited = request(max_tokens=1_000, reply_tokens=100, extraction=extraction)
    assert root_call_limit(limited, sized(tokens=1_000 - needed), calls=calls) is None
    refused = root_call_limit(limited, sized(tokens=1_000 - needed + 1), calls=calls)
    assert refused == FallbackReason(kind="max_tokens", value=1_000 - needed + 1, limit=1_000)


def opening(**fields: object) -> EpisodeCarry:
    """The state before the first root call: 400 characters of opening turns (100 tokens)."""
    return state(iteration=0, model_calls=0, pending=[Message(role="system", content="s" * 400)], **fields)


def test_the_first_call_keeps_nothing_back_and_its_reply_fits_what_is_left() -> None:
    # The opening prompt is 100 tokens; the reply guess is REPLY_TOKENS_ESTIMATE (1,000).
    assert root_call_limit(request(max_tokens=132), opening()) is None
    assert root_call_limit(request(max_tokens=131), opening()) == FallbackReason(
        kind="max_tokens", value=0, limit=131
    )
    # Once there is a reply to extract from, the full guess twice (the call, an extraction).
    later = state(pending=[Message(role="system", content="s" * 400)])
    assert root_call_limit(request(max_tokens=2_200), later) is None
    assert root_call_limit(request(max_tokens=2_199), later) is not None


def test_a_spent_cost_budget_stops_the_loop() -> None:
    limited = request(max_cost_usd=0.5, price=MILLI_PRICE)
    assert root_call_limit(limited, state(cost=0.5)) == FallbackReason(
        kind="max_cost_usd", value=0.5, limit=0.5
    )
    assert root_call_limit(limited, state(cost=0.75)) == FallbackReason(
        kind="max_cost_usd", value=0.75, limit=0.5
    )


def test_the_money_left_must_cover_the_step_and_one_extraction() -> None:
    # 200 tokens at $0.001 each: $0.20 a call, $0.40 with the extraction.
    limited = request(max_cost_usd=1.0, reply_tokens=100, price=MILLI_PRICE)
    assert root_call_limit(limited, sized(cost=0.6)) is None
    assert root_call_limit(limited, sized(cost=0.600000001)) == FallbackReason(
        kind="max_cost_usd", value=0.600000001, limit=1.0
    )
    assert root_call_limit(limited, sized(cost=0.2), calls=3) is None  # 4 x $0.20
    assert root_call_limit(limited, sized(cost=0.2), calls=4) is not None


def test_the_first_limit_named_is_model_calls_then_tokens_then_cost() -> None:
    every = request(
        max_model_calls=2, max_tokens=10_000, max_cost_usd=0.01, reply_tokens=100, price=MILLI_PRICE
    )
    spent = sized(model_calls=5, tokens=50_000, cost=1.0)
    assert root_call_limit(every, spent).kind == "max_model_calls"  # type: ignore[union-attr]
    spent.model_calls = 0
    assert root_call_limit(every, spent).kind == "max_tokens"  # type: ignore[union-attr]
    spent.usage = TokenUsage(cost_usd=1.0)
    assert root_call_limit(every, spent).kind == "max_cost_usd"  # type: ignore[union-attr]


# --- the extraction call --------------------------------------------------------------------------


def test_an_extraction_needs_its_prompt_and_the_shortest_reply_worth_a_call() -> None:
    limited = request(max_tokens=1_000, reply_tokens=100)  # a 100-token prompt
    assert extraction_refusal(limited, sized(tokens=1_000 - 132)) is None
    assert extraction_refusal(limited, sized(tokens=1_000 - 131)) == (
        "the token budget cannot pay for an extraction call (131 left, ~132 needed), "
        "so no extraction call was made"
    )
    assert extraction_refusal(limited, sized(tokens=999)) == (
        "the token budget cannot pay for an extraction call (1 left, ~132 needed), "
        "so no extraction call was made"
    )
    for spent in (1_000, 1_500):
        assert extraction_refusal(limited, sized(tokens=spent)) == (
            "the token budget is spent, so no extraction call was made"
        )
    assert extraction_refusal(request(), sized(tokens=10**9)) is None


def test_an_extraction_needs_its_estimated_cost() -> None:
    limited = request(max_cost_usd=1.0, reply_tokens=100, price=MILLI_PRICE)  # $0.20 an extraction
    assert extraction_refusal(limited, sized(cost=1.0)) == (
        "the cost budget cannot pay for an extraction call ($0.0000 left), so no extraction call was made"
    )
    assert extraction_refusal(limited, sized(cost=3.0)) == (
        "the cost budget cannot pay for an extraction call ($0.0000 left), so no extraction call was made"
    )
    assert extraction_refusal(limited, sized(cost=0.8)) is None
    assert extraction_refusal(limited, sized(cost=0.85)) == (
        "the cost budget cannot pay for an extraction call ($0.1500 left), so no extraction call was made"
    )


def test_an_extraction_needs_a_model_call_left_with_nothing_kept_back() -> None:
    limited = request(max_model_calls=5)
    assert extraction_refusal(limited, state(model_calls=4)) is None
    assert extraction_refusal(limited, state(model_calls=5)) == (
        "the model-call budget is spent, so no extraction call was made"
    )
    assert extraction_refusal(limited, state(model_calls=6)) is not None
    assert extraction_refusal(request(), state(model_calls=10**6)) is None


def test_the_extraction_refusal_names_tokens_then_cost_then_calls() -> None:
    every = request(
        max_model_calls=2, max_tokens=10_000, max_cost_usd=0.5, reply_tokens=100, price=MILLI_PRICE
    )
    spent = sized(model_calls=5, tokens=50_000, cost=1.0)
    assert "token budget" in extraction_refusal(every, spent)  # type: ignore[operator]
    spent.usage = TokenUsage(cost_usd=1.0)
    assert "cost budget" in extraction_refusal(every, spent)  # type: ignore[operator]
    spent.usage = TokenUsage()
    assert "model-call budget" in extraction_refusal(every, spent)  # type: ignore[operator]


@pytest.mark.parametrize(
    ("reply_tokens", "left", "cap"),
    [
        (None, 1_000, 900),  # what is left after the 100-token prompt
        (901, 1_000, 900),
        (900, 1_000, None),  # the model's own max_tokens already fits
        (None, 133, 33),
        (None, 132, MIN_REPLY_TOKENS),
        (None, 120, MIN_REPLY_TOKENS),  # never below the shortest reply worth a call
        (MIN_REPLY_TOKENS, 120, None),
    ],
)
def test_the_extraction_reply_is_capped_at_what_the_budget_pays_for(
    reply_tokens: int | None, left: int, cap: int | None
) -> None:
    limited = request(max_tokens=2_000, reply_tokens=reply_tokens)
    assert extraction_reply_cap(limited, sized(prompt=100, tokens=2_000 - left)) == cap


def test_without_a_token_budget_the_extraction_reply_is_not_capped() -> None:
    assert extraction_reply_cap(request(), sized(prompt=100, tokens=10**6)) is None


# --- sub-calls from the REPL ----------------------------------------------------------------------


def test_a_sub_call_needs_a_sub_call_left() -> None:
    assert sub_call_refusal(request(max_llm_calls=4), state(sub_calls=3)) is None
    assert sub_call_refusal(request(max_llm_calls=4), state(sub_calls=4)) == (
        "max_llm_calls (4) reached: the call was not made"
    )
    assert sub_call_refusal(request(max_llm_calls=4), state(sub_calls=9)) is not None


def test_a_sub_call_needs_a_model_call_beyond_the_one_kept_for_extraction() -> None:
    assert sub_call_refusal(request(max_model_calls=5), state(model_calls=3)) is None
    assert sub_call_refusal(request(max_model_calls=5), state(model_calls=4)) == (
        "max_model_calls (5) reached: the call was not made"
    )


def test_a_sub_call_needs_tokens_and_money_left() -> None:
    assert sub_call_refusal(request(max_tokens=100), state(tokens=99)) is None
    assert sub_call_refusal(request(max_tokens=100), state(tokens=100)) == (
        "max_tokens (100) spent: the call was not made"
    )
    priced = request(max_cost_usd=0.5, price=MILLI_PRICE)
    assert sub_call_refusal(priced, state(cost=0.499999999)) is None
    assert sub_call_refusal(priced, state(cost=0.5)) == "max_cost_usd (0.5) spent: the call was not made"
    assert sub_call_refusal(priced, state(cost=0.6)) is not None


# --- children's shares ----------------------------------------------------------------------------

NOW = DEADLINE - timedelta(hours=1)


def test_children_split_the_calls_left_evenly() -> None:
    limited = request(max_llm_calls=15)
    assert child_budgets(limited, state(sub_calls=5), 2, NOW) == ChildBudget(
        model_calls=5, tokens=None, deadline=DEADLINE - timedelta(seconds=60)
    )
    assert child_budgets(limited, state(sub_calls=5), 3, NOW).model_calls == 3  # type: ignore[union-attr]


def test_a_child_that_may_extract_needs_two_calls_else_one() -> None:
    assert MIN_CHILD_CALLS_WITH_EXTRACTION == 2
    limited = request(max_llm_calls=10)
    assert child_budgets(limited, state(sub_calls=4), 3, NOW).model_calls == 2  # type: ignore[union-attr]
    assert child_budgets(limited, state(sub_calls=5), 3, NOW) == (
        "budget exhausted: 5 model call(s) left for 3 child episode(s), each needs at least 2"
    )
    alone = request(max_llm_calls=10, extraction=False)
    assert child_budgets(alone, state(sub_calls=5), 5, NOW).model_calls == 1  # type: ignore[union-attr]
    assert child_budgets(alone, state(sub_calls=5), 6, NOW) == (
        "budget exhausted: 5 model call(s) left for 6 child episode(s), each needs at least 1"
    )


def test_a_parent_past_its_model_call_limit_tells_zero_calls_left() -> None:
    assert child_budgets(request(max_model_calls=3), state(model_calls=5), 1, NOW) == (
        "budget exhausted: 0 model call(s) left for 1 child episode(s), each needs at least 2"
    )


def test_children_split_the_tokens_left() -> None:
    # What the parent's next call and its extraction need (2 x 200 tokens) is kept back.
    limited = request(max_tokens=1_000, reply_tokens=100)
    share = child_budgets(limited, sized(tokens=0), 3, NOW)
    assert isinstance(share, ChildBudget) and share.tokens == 200 and isinstance(share.tokens, int)
    assert child_budgets(limited, sized(tokens=597), 3, NOW).tokens == 1  # type: ignore[union-attr]
    assert child_budgets(limited, sized(tokens=598), 3, NOW) == (
        "budget exhausted: no tokens of max_tokens (1000) left for children"
    )


def test_the_parents_next_call_and_extraction_are_kept_back_first() -> None:
    # A root-sized call is 200 tokens and $0.20 (100 prompt + 100 reply at $0.001).
    limited = request(max_tokens=1_000, max_cost_usd=1.0, reply_tokens=100, price=MILLI_PRICE)
    share = child_budgets(limited, sized(), 3, NOW)
    assert isinstance(share, ChildBudget)
    assert (share.tokens, share.cost_usd) == ((1_000 - 2 * 200) // 3, 0.2)
    alone = request(max_tokens=1_000, max_cost_usd=1.0, reply_tokens=100, price=MILLI_PRICE, extraction=False)
    share = child_budgets(alone, sized(), 3, NOW)
    assert isinstance(share, ChildBudget)
    assert (share.tokens, share.cost_usd) == ((1_000 - 200) // 3, 0.266666666)  # rounded down


@pytest.mark.parametrize(
    ("value", "floored"),
    [
        (0.333333333, 0.333333333),
        (0.3333333339, 0.333333333),  # down, not to the nearest
        (2e-9 / 3, 0.0),
        (0.6 / 3, 0.2),  # 0.19999999999999998 is float noise, not a billionth less
        (0.8 / 3, 0.266666666),
        (0.25, 0.25),
        (7.0, 7.0),
    ],
)
def test_a_cost_share_is_rounded_down_to_cost_digits(value: float, floored: float) -> None:
    assert floor_cost(value) == floored


def test_children_split_the_money_left_rounded_to_cost_digits() -> None:
    # $0.40 is kept back: the parent's next call and its extraction ($0.20 each).
    limited = request(max_cost_usd=1.0, reply_tokens=100, price=MILLI_PRICE)
    assert child_budgets(limited, sized(cost=0.0), 3, NOW).cost_usd == 0.2  # type: ignore[union-attr]
    assert child_budgets(limited, sized(cost=0.1), 3, NOW).cost_usd == 0.166666666  # type: ignore[union-attr]
    assert child_budgets(limited, sized(cost=0.5), 2, NOW).cost_usd == 0.05  # type: ignore[union-attr]
    assert child_budgets(limited, sized(cost=1.0), 2, NOW) == (
        "budget exhausted: nothing of max_cost_usd (1.0) left for children"
    )
    kept = request(max_cost_usd=0.4, reply_tokens=100, price=MILLI_PRICE)  # exactly the $0.40 kept back
    assert child_budgets(kept, sized(), 1, NOW) == (
        "budget exhausted: nothing of max_cost_usd (0.4) left for children"
    )


def test_a_child_ends_a_little_before_its_parent() -> None:
    limited = request()
    assert child_budgets(limited, state(), 1, DEADLINE - timedelta(seconds=100)).deadline == (  # type: ignore[union-attr]
        DEADLINE - timedelta(seconds=10)
    )
    assert child_budgets(limited, state(), 1, DEADLINE - timedelta(seconds=600)).deadline == (  # type: ignore[union-attr]
        DEADLINE - timedelta(seconds=60)
    )
    assert child_budgets(limited, state(), 1, DEADLINE - timedelta(seconds=601)).deadline == (  # type: ignore[union-attr]
        DEADLINE - timedelta(seconds=60)
    )
    assert child_budgets(limited, state(), 1, DEADLINE - timedelta(microseconds=10)).deadline == (  # type: ignore[union-attr]
        DEADLINE - timedelta(microseconds=1)
    )
    assert (
        child_budgets(limited, state(), 1, DEADLINE) == "budget exhausted: the episode's deadline has passed"
    )
    assert child_budgets(limited, state(), 1, DEADLINE + timedelta(seconds=1)) == (
        "budget exhausted: the episode's deadline has passed"
    )


@given(
    children=st.integers(1, 8),
    sub_calls=st.integers(0, 60),
    tokens=st.integers(0, 20_000),
    cost=st.integers(0, 2_000_000).map(lambda micro: micro / 1e6),
    max_tokens=st.integers(1, 20_000),
    max_cost=st.integers(1, 2_000_000).map(lambda micro: micro / 1e6),
    extraction=st.booleans(),
    seconds_left=st.integers(1, 7_200),
)
def test_childrens_shares_never_sum_past_what_is_left(
    children: int,
    sub_calls: int,
    tokens: int,
    cost: float,
    max_tokens: int,
    max_cost: float,
    extraction: bool,
    seconds_left: int,
) -> None:
    limited = request(
        max_tokens=max_tokens,
        max_cost_usd=max_cost,
        max_llm_calls=50,
        reply_tokens=100,
        price=MILLI_PRICE,
        extraction=extraction,
    )
    carry = sized(tokens=tokens, cost=cost, sub_calls=sub_calls)
    now = DEADLINE - timedelta(seconds=seconds_left)
    share = child_budgets(limited, carry, children, now)
    if isinstance(share, str):
        assert share.startswith("budget exhausted: ")
        return
    kept = CallEstimate.of(limited, carry)
    kept_calls = 2 if extraction else 1
    assert share.model_calls >= kept_calls and share.model_calls * children <= calls_left(limited, carry)
    assert share.tokens is not None and share.tokens >= 1
    assert share.tokens * children + kept.tokens * kept_calls <= tokens_left(limited, carry)  # type: ignore[operator]
    money = cost_left(limited, carry)
    assert share.cost_usd is not None and money is not None and share.cost_usd > 0
    # Shares are rounded down to a billionth of a dollar: never past what is left (but float noise).
    assert share.cost_usd * children + kept.cost_usd * kept_calls <= money + 1e-12
    assert now < share.deadline < DEADLINE


def test_childrens_cost_shares_never_sum_past_the_money_left_even_by_rounding() -> None:
    limited = request(max_cost_usd=1.0, price=MILLI_PRICE)
    carry = state(cost=0.999999998)  # $0.000000002 left for three children
    share = child_budgets(limited, carry, 3, NOW)
    assert isinstance(share, str) or share.cost_usd * 3 <= cost_left(limited, carry)  # type: ignore[operator]


# --- the loop's check before each root call -------------------------------------------------------


def test_the_loop_stops_at_its_iteration_sub_call_and_duration_limits() -> None:
    limited = request(max_iterations=5, max_llm_calls=7, max_duration=timedelta(seconds=60))
    ok = timedelta(seconds=59)
    assert limit_reached(limited, state(iteration=4, sub_calls=6), ok) is None
    assert limit_reached(limited, state(iteration=5, sub_calls=6), ok) == FallbackReason(
        kind="max_iterations", value=5, limit=5
    )
    assert limit_reached(limited, state(iteration=4, sub_calls=7), ok) == FallbackReason(
        kind="max_llm_calls", value=7, limit=7
    )
    assert limit_reached(limited, state(iteration=4, sub_calls=6), timedelta(seconds=60)) == FallbackReason(
        kind="timeout", value=60.0, limit=60.0
    )


def test_the_loop_checks_the_budgets_as_a_root_call_does() -> None:
    assert limit_reached(request(max_tokens=100), state(tokens=100), timedelta(0)) == FallbackReason(
        kind="max_tokens", value=100, limit=100
    )
    limited = request(max_tokens=1_000, reply_tokens=100)
    assert limit_reached(limited, sized(tokens=600), timedelta(0)) is None
    assert limit_reached(limited, sized(tokens=700), timedelta(0)) is not None
    assert limit_reached(request(max_tokens=132), opening(), timedelta(0)) is None
    assert limit_reached(request(max_tokens=131), opening(), timedelta(0)) is not None
