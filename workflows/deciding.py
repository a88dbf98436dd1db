"""Decide: the termination policy sees each iteration (docs: "Termination policies").

The policy's state is workflow state (`EpisodeCarry.policy_state`, written after every
decision), so replay, a crash and continue-as-new all reach the same decision. The reward
the policy reads is the iteration's own (the request's reward function) plus the rewards
sent since the last decision (`RewardInbox`). A policy that raises fails the episode:
it is the policy's author's to fix, so it is not retried. Pure: no I/O.
"""

from __future__ import annotations

from temporalio.exceptions import ApplicationError

from durable_rlm.workflows import (
    defaults,
    names,
    rlms_limits,  # noqa: F401 - registers rlms's limits policy, for every worker
)
from durable_rlm.workflows.models import EpisodeCarry, EpisodeRequest
from durable_rlm.workflows.outcome import IterationOutcome
from durable_rlm.workflows.reward_inbox import RewardInbox
from durable_rlm.workflows.signals import action_reward, build_action
from durable_rlm.workflows.termination import ActionResult, PolicyContext, PolicyDecision, TerminationPolicy


class Decider:
    """The episode's termination policy, fed one iteration at a time."""

    def __init__(
        self,
        request: EpisodeRequest,
        state: EpisodeCarry,
        policy: TerminationPolicy,
        rewards: RewardInbox,
    ) -> None:
        self.request = request
        self.state = state
        self.policy = policy
        self.rewards = rewards

    def decide(self, outcome: IterationOutcome) -> tuple[ActionResult, PolicyDecision]:
        """The iteration as the policy sees it, and what the policy decided."""
        request, s, policy = self.request, self.state, self.policy
        action = build_action(
            outcome.answer.text if outcome.answer is not None else None,
            [cell.printed for cell in outcome.cells],
            outcome.reply,
            outcome.mean_logprob,
            show_printed=request.termination.scan_printed_output,
            limit=defaults.POLICY_TEXT_CHARS,
        )
        earned = action_reward(request.reward.function, request.reward.config, action)
        reward = self.rewards.take() + earned
        s.cumulative_reward += reward
        context = PolicyContext(
            task=request.task,
            step=s.iteration - 1,
            variables=dict(s.variables),
            metrics={
                "last_reward": reward,
                "cumulative_reward": s.cumulative_reward,
                "iteration": s.iteration,
                "model_calls": s.model_calls,
                "sub_calls": s.sub_calls,
                "tokens": s.usage.total_tokens,
                "cost_usd": (s.usage.cost_usd or 0.0) + s.unaccounted_cost_usd,
            },
        )
        try:
            decision = policy.decide(action, context)
            s.policy_state = policy.get_state()
        except Exception as exc:
            raise ApplicationError(
                f"termination policy {request.termination.name!r} raised {type(exc).__name__}: {exc}",
                type=names.POLICY_FAILURE,
                non_retryable=True,
            ) from exc
        return action, decision
