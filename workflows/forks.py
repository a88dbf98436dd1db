"""A fork's starting state: its source's state after iteration K (`drlm fork`).

The state is what the workflow itself held at that boundary, read by replaying the
source's history (durable_rlm/timetravel/fork.py), so it is exact: chain heads, counters, policy
state, rewards. The fork runs no sandbox of its source's: its REPL is rebuilt from the
cell log (and the latest snapshot) when its first cell needs it, answering the recorded
calls from the log, so no model is called for the first K iterations.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from pydantic import Field

from durable_rlm.workflows.models import (
    EpisodeCarry,
    EpisodeLimits,
    EpisodeRequest,
    Message,
    RewardRecord,
    StrictModel,
)


class Boundary(StrictModel):
    """The loop's state at the end of an iteration, as a fork would start from it."""

    state: EpisodeCarry
    elapsed_s: float = Field(ge=0, description="max_duration spent by then")
    limits: EpisodeLimits = Field(description="the limits then (a person may have changed them)")
    ended: bool = Field(default=False, description="the source ended with this iteration")


def boundary(
    request: EpisodeRequest,
    state: EpisodeCarry,
    turn: list[Message],
    rewards: tuple[float, int, list[RewardRecord]],
    elapsed: timedelta,
    ended: bool,
) -> Boundary:
    """The state after this iteration: its outputs waiting for the model, as if it went on.
    Rewards are state (a reward policy sums them) and come along; the source's sandbox, the
    actions people took on it and its unread hints stay the source's."""
    carried = state.model_copy(deep=True)
    carried.pending = [*carried.pending, *turn]
    carried.reward_inbox, carried.rewards_received, carried.rewards = rewards[0], rewards[1], list(rewards[2])
    carried.repl_queue = None
    carried.actions, carried.actions_total, carried.hints = [], 0, []
    return Boundary(
        state=carried,
        elapsed_s=max(elapsed.total_seconds(), 0.0),
        limits=request.limits.model_copy(),
        ended=ended,
    )


def starting_state(request: EpisodeRequest, started: datetime) -> EpisodeCarry:
    """The fork's first state: its source's, with a deadline that keeps the time it spent."""
    assert request.carry is not None and request.fork is not None
    state = request.carry.model_copy(deep=True)
    spent = timedelta(seconds=request.fork.elapsed_s)
    state.deadline = started + request.limits.max_duration - spent
    if request.deadline is not None:
        state.deadline = min(state.deadline, request.deadline)
    state.repl_queue = None
    return state
