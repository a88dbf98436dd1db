"""Decide (workflows/deciding.py): what the termination policy is shown of an iteration, the
reward it reads, where its state goes, and how a policy's own bug ends the episode. On
running episodes: tests/test_policies.py and tests/test_episode.py."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from temporalio.exceptions import ApplicationError

from durable_rlm.workflows import names
from durable_rlm.workflows.deciding import Decider
from durable_rlm.workflows.models import EpisodeCarry, EpisodeRequest, ModelSettings, RewardSpec, RewardUpdate
from durable_rlm.workflows.outcome import CellRecord, IterationOutcome, ModelAnswer
from durable_rlm.workflows.reward_inbox import RewardInbox
from durable_rlm.workflows.termination import (
    ActionResult,
    PolicyContext,
    PolicyRegistry,
    TerminationPolicy,
)


class Recording(TerminationPolicy):
    """Stops when told to; keeps what it was shown."""

    name = "recording"

    def __init__(self, stop: bool = False, bug: Exception | None = None) -> None:
        super().__init__({})
        self.stop, self.bug = stop, bug
        self.shown: list[tuple[ActionResult, PolicyContext]] = []

    def should_terminate(self, result: ActionResult, context: PolicyContext) -> tuple[bool, str | None]:
        self.shown.append((result, context))
        if self.bug is not None:
            raise self.bug
        return self.stop, "enough" if self.stop else None

    def get_state(self) -> dict[str, int]:
        return {"decisions": len(self.shown)}


def request(reward: str = "none", policy: str = "recording") -> EpisodeRequest:
    return EpisodeRequest(
        task="add the numbers",
        root_model=ModelSettings(model="m"),
        reward=RewardSpec(function=reward),
        termination={"name": policy},
    )


def state() -> EpisodeCarry:
    return EpisodeCarry(
        seed=1, deadline=datetime(2026, 1, 1, tzinfo=UTC), iteration=2, model_calls=4, variables={"x": "int"}
    )


def code_turn() -> IterationOutcome:
    outcome = IterationOutcome(2, "```repl\nprint(1)\n```")
    outcome.cells.append(CellRecord(index=1, code="print(1)", status="ok", stdout="1\n"))
    return outcome


def test_the_policy_sees_the_iteration_and_the_episodes_counters() -> None:
    policy, s = Recording(), state()
    action, decision = Decider(request(), s, policy, RewardInbox()).decide(code_turn())
    [(shown, context)] = policy.shown
    assert shown is action and action.action_type == "code"
    assert not decision.stop
    assert (context.task, context.step, context.variables) == ("add the numbers", 1, {"x": "int"})
    assert context.metrics == {
        "last_reward": 0.0,
        "cumulative_reward": 0.0,
        "iteration": 2,
        "model_calls": 4,
        "sub_calls": 0,
        "tokens": 0,
        "cost_usd": 0.0,
    }


def test_the_reward_is_the_iterations_own_plus_those_sent_since_the_last_decision() -> None:
    policy, s, rewards = Recording(), state(), RewardInbox()
    rewards.receive(RewardUpdate(value=0.5), iteration=2, cumulative=0.0)
    rewards.receive(RewardUpdate(value=0.25), iteration=2, cumulative=0.0)
    decider = Decider(request(reward="outcome"), s, policy, rewards)
    decider.decide(code_turn())
    assert policy.shown[-1][1].metrics["last_reward"] == pytest.approx(0.85)  # 0.75 sent, 0.1 for code
    assert rewards.pending == 0.0  # read once
    decider.decide(code_turn())
    assert policy.shown[-1][1].metrics["last_reward"] == pytest.approx(0.1)
    assert s.cumulative_reward == pytest.approx(0.95)


def test_the_policys_state_is_the_episodes_after_each_decision() -> None:
    s = state()
    decider = Decider(request(), s, Recording(), RewardInbox())
    decider.decide(code_turn())
    decider.decide(code_turn())
    assert s.policy_state == {"decisions": 2}


def test_a_stated_answer_reaches_the_policy_as_a_final_action() -> None:
    outcome = IterationOutcome(2, "FINAL(3)")
    outcome.answer = ModelAnswer(text="3", kind="final", outputs={"answer": "3"})
    policy = PolicyRegistry.get_termination("final_pattern", {})
    action, decision = Decider(request(policy="final_pattern"), state(), policy, RewardInbox()).decide(
        outcome
    )
    assert (action.action_type, action.output) == ("final", "3")
    assert decision.stop and decision.answer == "3"


def test_printed_output_is_not_shown_unless_the_request_asks() -> None:
    outcome = code_turn()
    hidden = Decider(request(), state(), Recording(), RewardInbox()).decide(outcome)[0]
    asked = request().model_copy(update={"termination": {"name": "recording", "scan_printed_output": True}})
    shown = Decider(EpisodeRequest.model_validate(asked.model_dump()), state(), Recording(), RewardInbox())
    assert hidden.output == ""
    assert "1" in shown.decide(outcome)[0].output


def test_a_policy_that_raises_fails_the_episode_without_retries() -> None:
    policy = Recording(bug=RuntimeError("the plugin has a bug"))
    with pytest.raises(ApplicationError) as raised:
        Decider(request(), state(), policy, RewardInbox()).decide(code_turn())
    assert raised.value.type == names.POLICY_FAILURE
    assert raised.value.non_retryable
    assert raised.value.message == "termination policy 'recording' raised RuntimeError: the plugin has a bug"
