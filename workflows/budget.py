"""Budgets down the tree of episodes: what an episode has left, and a child's share of it.

An episode's counters include what its children spent (a child's model calls are calls
made from the parent's REPL), so checking the counters against the limits before every
call bounds the whole tree. A child's ceiling is its share of what its parent has left
when it starts: the children of one batch split it evenly, so together they cannot spend
more than the parent had. Pure: the workflow and its REPL steps call these on their state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta

from durable_rlm.workflows import defaults
from durable_rlm.workflows.fallback import ExecutionState, FallbackReason, FallbackTrigger
from durable_rlm.workflows.models import COST_DIGITS, EpisodeCarry, EpisodeRequest

MIN_CHILD_CALLS_WITH_EXTRACTION = 2
"""A child that may have to extract needs one call to work and one held back to extract."""

MIN_REPLY_TOKENS = 32
"""A call whose reply could not be even this long within the token budget is not started:
the budget cannot cover it."""


def extraction_reserve(request: EpisodeRequest) -> int:
    return 1 if request.fallback_extraction and request.limits.max_model_calls is not None else 0


def model_calls_room(request: EpisodeRequest, state: EpisodeCarry) -> int | None:
    """What max_model_calls still allows, one call kept back for extraction (None: no limit)."""
    limit = request.limits.max_model_calls
    return None if limit is None else limit - state.model_calls - extraction_reserve(request)


def calls_left(request: EpisodeRequest, state: EpisodeCarry) -> int:
    """Model calls this episode may still start from its REPL."""
    left = request.limits.max_llm_calls - state.sub_calls
    room = model_calls_room(request, state)
    return left if room is None else min(left, room)


def tokens_spent(state: EpisodeCarry) -> int:
    return state.usage.total_tokens + state.unaccounted_tokens


def tokens_left(request: EpisodeRequest, state: EpisodeCarry) -> int | None:
    limit = request.limits.max_tokens
    return None if limit is None else limit - tokens_spent(state)


def floor_cost(value: float) -> float:
    """`value` rounded down to COST_DIGITS places (a share never rounds up past its whole).
    A millionth of the last place is float noise (0.6 / 3 is 0.19999999999999998), not a
    share's worth: it does not cost the share a whole billionth."""
    scale: int = 10**COST_DIGITS
    return math.floor(value * scale + 1e-6) / scale


def cost_spent(state: EpisodeCarry) -> float:
    return round((state.usage.cost_usd or 0.0) + state.unaccounted_cost_usd, COST_DIGITS)


def cost_left(request: EpisodeRequest, state: EpisodeCarry) -> float | None:
    limit = request.limits.max_cost_usd
    return None if limit is None else round(limit - cost_spent(state), COST_DIGITS)


@dataclass(frozen=True)
class CallEstimate:
    """What one root-sized call (the next root call, or an extraction) is expected to spend:
    the last request's prompt plus its reply and the turns queued since, and a reply as
    long as the model's max_tokens (else as the last reply, or REPLY_TOKENS_ESTIMATE)."""

    tokens: int
    cost_usd: float
    prompt_tokens: int = 0

    @classmethod
    def of(cls, request: EpisodeRequest, state: EpisodeCarry, room: int | None = None) -> CallEstimate:
        """With `room` (tokens the budget has left) the reply is expected
        to be no longer than the room its prompt leaves, and at least MIN_REPLY_TOKENS: a
        reply guess of REPLY_TOKENS_ESTIMATE alone must not refuse a call a small budget
        can pay for."""
        model = request.root_model
        queued = sum(len(m.content) for m in state.pending) // defaults.CHARS_PER_TOKEN
        prompt = state.last_prompt_tokens + state.last_reply_tokens + queued
        reply = model.max_tokens or state.last_reply_tokens or defaults.REPLY_TOKENS_ESTIMATE
        if room is not None:
            reply = max(min(reply, room - prompt), MIN_REPLY_TOKENS)
        cost = model.price.cost(prompt, reply) if model.price is not None else 0.0
        return cls(tokens=prompt + reply, cost_usd=cost, prompt_tokens=prompt)


def nothing_to_extract(state: EpisodeCarry) -> bool:
    """No root reply yet: an extraction would read only the task, so the first call keeps
    nothing back for one."""
    return state.model_calls == 0 and state.iteration == 0


def root_call_limit(request: EpisodeRequest, state: EpisodeCarry, calls: int = 1) -> FallbackReason | None:
    """Whether the next root step (`calls` model calls) would pass the episode's budgets.
    The token and cost budgets must cover the step's estimate and one extraction, so a
    budget ends the loop while extraction can still run. The first step needs only to fit
    what is left (nothing is kept for an extraction that would have nothing to read), and a
    reply is expected to fit the room its prompt leaves: a 2,500-token budget makes its
    root calls."""
    limits = request.limits
    room = model_calls_room(request, state)
    if room is not None and room < calls:
        return FallbackReason(
            kind="max_model_calls", value=state.model_calls, limit=limits.max_model_calls or 0
        )
    left = tokens_left(request, state)
    first = nothing_to_extract(state)
    need = CallEstimate.of(request, state, room=left if first else None)
    extraction = 1 if request.fallback_extraction and not first else 0
    if left is not None and (left <= 0 or left < need.tokens * (calls + extraction)):
        return FallbackReason(kind="max_tokens", value=tokens_spent(state), limit=limits.max_tokens or 0)
    money = cost_left(request, state)
    if money is not None and (money <= 0 or money < need.cost_usd * (calls + extraction)):
        return FallbackReason(kind="max_cost_usd", value=cost_spent(state), limit=limits.max_cost_usd or 0)
    return None


def extraction_refusal(request: EpisodeRequest, state: EpisodeCarry) -> str | None:
    """Why no extraction call may be made once a limit is hit, or None when it may. The
    extraction's reply is expected to be no longer than what is left (the call is sent with
    that cap: `extraction_reply_cap`), so what is held back for it never exceeds what the
    budget has."""
    left = tokens_left(request, state)
    need = CallEstimate.of(request, state, room=left)
    if left is not None and left < need.tokens:
        if left <= 0:
            return "the token budget is spent, so no extraction call was made"
        return (
            f"the token budget cannot pay for an extraction call ({left} left, ~{need.tokens} "
            "needed), so no extraction call was made"
        )
    money = cost_left(request, state)
    if money is not None and (money <= 0 or money < need.cost_usd):
        return (
            f"the cost budget cannot pay for an extraction call (${max(money, 0):.4f} left), "
            "so no extraction call was made"
        )
    calls = request.limits.max_model_calls
    if calls is not None and state.model_calls >= calls:
        return "the model-call budget is spent, so no extraction call was made"
    return None


def extraction_reply_cap(request: EpisodeRequest, state: EpisodeCarry) -> int | None:
    """The longest extraction reply the token budget still pays for, or
    None when the model's own max_tokens already fits (or there is no token budget)."""
    left = tokens_left(request, state)
    if left is None:
        return None
    prompt = CallEstimate.of(request, state).prompt_tokens
    cap = max(left - prompt, MIN_REPLY_TOKENS)
    own = request.root_model.max_tokens
    return None if own is not None and own <= cap else cap


def sub_call_refusal(request: EpisodeRequest, state: EpisodeCarry) -> str | None:
    """Why a sub-call from the REPL may not start, or None when it may."""
    limits = request.limits
    if state.sub_calls >= limits.max_llm_calls:
        return f"max_llm_calls ({limits.max_llm_calls}) reached: the call was not made"
    if calls_left(request, state) < 1:
        return f"max_model_calls ({limits.max_model_calls}) reached: the call was not made"
    left = tokens_left(request, state)
    if left is not None and left <= 0:
        return f"max_tokens ({limits.max_tokens}) spent: the call was not made"
    money = cost_left(request, state)
    if money is not None and money <= 0:
        return f"max_cost_usd ({limits.max_cost_usd}) spent: the call was not made"
    return None


@dataclass(frozen=True)
class ChildBudget:
    model_calls: int
    tokens: int | None
    deadline: datetime
    cost_usd: float | None = None


def child_budgets(
    request: EpisodeRequest, state: EpisodeCarry, children: int, now: datetime
) -> ChildBudget | str:
    """Each of `children` children's share of what is left, or why none can start. What the
    parent's next root call and its extraction need is kept back first."""
    calls = calls_left(request, state) // children
    needed = MIN_CHILD_CALLS_WITH_EXTRACTION if request.fallback_extraction else 1
    if calls < needed:
        return (
            f"budget exhausted: {max(calls_left(request, state), 0)} model call(s) left for "
            f"{children} child episode(s), each needs at least {needed}"
        )
    need = CallEstimate.of(request, state)
    kept = 1 + (1 if request.fallback_extraction else 0)
    left = tokens_left(request, state)
    tokens = None if left is None else (left - need.tokens * kept) // children
    if tokens is not None and tokens < 1:
        return f"budget exhausted: no tokens of max_tokens ({request.limits.max_tokens}) left for children"
    money = cost_left(request, state)
    # Rounded down: shares rounded to the nearest could sum past what is left.
    cost = None if money is None else floor_cost((money - need.cost_usd * kept) / children)
    if cost is not None and cost <= 0:
        return f"budget exhausted: nothing of max_cost_usd ({request.limits.max_cost_usd}) left for children"
    if state.deadline <= now:
        return "budget exhausted: the episode's deadline has passed"
    slack = min((state.deadline - now) / 10, timedelta(seconds=defaults.CHILD_DEADLINE_SLACK_S))
    # A little before the parent's: a child that runs out of time extracts its answer before
    # the parent's own timer cancels it.
    return ChildBudget(model_calls=calls, tokens=tokens, deadline=state.deadline - slack, cost_usd=cost)


def limit_reached(request: EpisodeRequest, state: EpisodeCarry, elapsed: timedelta) -> FallbackReason | None:
    """The limit that stops the loop before its next root call, or None: the loop's own
    check at each iteration, and `drlm fork`'s before a fork starts from `state`."""
    limits = request.limits
    # DSPy's max_llm_calls refuses the call over it and the run goes on (the code sees why);
    # the loop ends on it only here.
    calls = state.sub_calls if request.dspy is None else 0
    trigger = FallbackTrigger(limits.max_iterations, limits.max_llm_calls, limits.max_duration)
    reason = trigger.should_trigger(
        ExecutionState(iterations=state.iteration, llm_calls=calls, elapsed=elapsed)
    )
    return reason or root_call_limit(request, state)
