"""Every code example of the termination policies (docs/behaviour/termination-policies.md,
rlm_code's interface), plus errors and state."""

from __future__ import annotations

import re
from typing import Any

import pytest

from durable_rlm.workflows.termination import (
    ActionResult,
    CompositeTerminationPolicy,
    ConfidenceTerminationPolicy,
    FinalPatternTerminationPolicy,
    PolicyContext,
    PolicyDecision,
    PolicyError,
    PolicyRegistry,
    RewardThresholdTerminationPolicy,
    TerminationPolicy,
)

# --- rlm_code's convergence example, registered exactly as it is written ---------------------


@PolicyRegistry.register_termination("convergence")
class ConvergenceTerminationPolicy(TerminationPolicy):
    """
    Terminate when the agent's outputs converge (stop changing).
    """

    name = "convergence"
    description = "Stop when outputs converge (stabilize)"

    @classmethod
    def get_default_config(cls) -> dict[str, Any]:
        return {"window_size": 3, "similarity_threshold": 0.9, "min_steps": 3}

    def __init__(self, config=None):
        super().__init__(config)
        self._recent_outputs: list[str] = []

    def should_terminate(self, result, context):
        config = {**self.get_default_config(), **self.config}
        self._recent_outputs.append(result.output or "")
        if context.step < config["min_steps"]:
            return False, None
        window = self._recent_outputs[-config["window_size"] :]
        if len(window) < config["window_size"]:
            return False, None
        if len(set(window)) == 1:
            return True, window[-1]
        return False, None

    def reset(self):
        self._recent_outputs = []


# --- final_pattern ----------------------------------------------------------------------------


def test_final_pattern_is_registered_under_its_seed_name() -> None:
    policy = PolicyRegistry.get_termination("final_pattern")
    assert isinstance(policy, FinalPatternTerminationPolicy)
    assert policy.name == "final_pattern" and policy.description


def test_final_pattern_default_config_is_the_seeds() -> None:
    assert FinalPatternTerminationPolicy.get_default_config() == {
        "final_patterns": [
            r"FINAL\s*\(\s*['\"](.+?)['\"]\s*\)",
            r"FINAL\s*\(\s*(.+?)\s*\)",
            r"FINAL_VAR\s*\(\s*['\"](\w+)['\"]\s*\)",
        ],
        "case_sensitive": False,
        "extract_answer": True,
    }


def test_seed_example_final_in_output() -> None:
    policy = PolicyRegistry.get_termination("final_pattern")
    result = ActionResult(
        action_type="code", success=True, output="After computing, the answer is FINAL('42')"
    )
    assert policy.should_terminate(result, PolicyContext(task="What is 6*7?")) == (True, "42")


def test_seed_example_final_var_looks_up_the_variable() -> None:
    policy = PolicyRegistry.get_termination("final_pattern")
    result = ActionResult(action_type="code", success=True, output="FINAL_VAR('result')")
    context = PolicyContext(task="Compute the sum", variables={"result": 4950})
    assert policy.should_terminate(result, context) == (True, "4950")


def test_a_final_action_terminates_with_its_output() -> None:
    policy = PolicyRegistry.get_termination("final_pattern")
    assert policy.should_terminate(ActionResult(action_type="final", output="done"), PolicyContext()) == (
        True,
        "done",
    )


def test_no_pattern_no_termination() -> None:
    policy = PolicyRegistry.get_termination("final_pattern")
    assert policy.should_terminate(ActionResult(action_type="code", output="progress"), PolicyContext()) == (
        False,
        None,
    )


def test_final_var_of_a_missing_variable_does_not_terminate() -> None:
    policy = PolicyRegistry.get_termination("final_pattern")
    result = ActionResult(action_type="code", output="FINAL_VAR('nope')")
    assert policy.should_terminate(result, PolicyContext()) == (False, None)


def test_seed_example_custom_patterns() -> None:
    policy = PolicyRegistry.get_termination(
        "final_pattern",
        config={
            "final_patterns": [
                r"FINAL\s*\(\s*['\"](.+?)['\"]\s*\)",
                r"ANSWER:\s*(.+?)$",
                r"SOLUTION\s*=\s*(.+?)$",
            ],
            "case_sensitive": False,
            "extract_answer": True,
        },
    )
    assert policy.should_terminate(ActionResult("code", output="ANSWER: 42"), PolicyContext()) == (True, "42")
    assert policy.should_terminate(ActionResult("code", output="solution = x+1"), PolicyContext()) == (
        True,
        "x+1",
    )


def test_case_sensitive_patterns() -> None:
    policy = PolicyRegistry.get_termination("final_pattern", config={"case_sensitive": True})
    assert policy.should_terminate(ActionResult("code", output="final('x')"), PolicyContext()) == (
        False,
        None,
    )


def test_extract_answer_false_returns_the_whole_output() -> None:
    policy = PolicyRegistry.get_termination("final_pattern", config={"extract_answer": False})
    output = "the answer is FINAL('42')"
    assert policy.should_terminate(ActionResult("code", output=output), PolicyContext()) == (True, output)


# --- reward_threshold -------------------------------------------------------------------------


def test_reward_threshold_default_config_is_the_seeds() -> None:
    assert RewardThresholdTerminationPolicy.get_default_config() == {
        "min_reward_threshold": 0.8,
        "max_negative_streak": 3,
        "require_final_action": False,
    }


def test_seed_example_reward_accumulates_to_the_threshold() -> None:
    policy = PolicyRegistry.get_termination("reward_threshold")
    step1 = policy.should_terminate(
        ActionResult(action_type="code", success=True, output="progress..."),
        PolicyContext(metrics={"last_reward": 0.4}),
    )
    assert step1 == (False, None)
    step2 = policy.should_terminate(
        ActionResult(action_type="code", success=True, output="more progress..."),
        PolicyContext(metrics={"last_reward": 0.5}),
    )
    assert step2 == (True, "Reward threshold reached: 0.90")


def test_seed_example_custom_threshold() -> None:
    policy = PolicyRegistry.get_termination("reward_threshold", config={"min_reward_threshold": 0.9})
    assert (
        policy.should_terminate(ActionResult("code"), PolicyContext(metrics={"last_reward": 0.85}))[0]
        is False
    )
    assert (
        policy.should_terminate(ActionResult("code"), PolicyContext(metrics={"last_reward": 0.05}))[0] is True
    )


def test_negative_streak_terminates() -> None:
    policy = PolicyRegistry.get_termination("reward_threshold")
    for _ in range(2):
        assert (
            policy.should_terminate(ActionResult("error"), PolicyContext(metrics={"last_reward": -0.1}))[0]
            is False
        )
    stop, answer = policy.should_terminate(
        ActionResult("error"), PolicyContext(metrics={"last_reward": -0.1})
    )
    assert stop and "3 consecutive negative rewards" in answer


def test_a_positive_reward_breaks_the_streak() -> None:
    policy = PolicyRegistry.get_termination("reward_threshold", config={"min_reward_threshold": 10.0})
    rewards = [-0.1, -0.1, 0.2, -0.1, -0.1]
    assert not any(
        policy.should_terminate(ActionResult("code"), PolicyContext(metrics={"last_reward": r}))[0]
        for r in rewards
    )


def test_require_final_action_waits_for_a_final() -> None:
    policy = PolicyRegistry.get_termination("reward_threshold", config={"require_final_action": True})
    assert policy.should_terminate(ActionResult("code"), PolicyContext(metrics={"last_reward": 1.0})) == (
        False,
        None,
    )
    assert policy.should_terminate(ActionResult("final", output="42"), PolicyContext()) == (True, "42")


def test_reset_clears_the_cumulative_reward() -> None:
    policy = PolicyRegistry.get_termination("reward_threshold")
    policy.should_terminate(ActionResult("code"), PolicyContext(metrics={"last_reward": 0.7}))
    policy.reset()
    assert policy.should_terminate(ActionResult("code"), PolicyContext(metrics={"last_reward": 0.7})) == (
        False,
        None,
    )


# --- confidence -------------------------------------------------------------------------------


def test_confidence_default_config_is_the_seeds() -> None:
    assert ConfidenceTerminationPolicy.get_default_config() == {
        "confidence_threshold": 0.85,
        "min_steps_before_termination": 2,
        "confidence_key": "confidence",
        "fallback_to_final_pattern": True,
    }


@pytest.mark.parametrize("config", [None, {"confidence_threshold": 0.95, "min_steps_before_termination": 3}])
def test_seed_examples_confidence(config: dict | None) -> None:
    policy = PolicyRegistry.get_termination("confidence", config=config)
    result = ActionResult(action_type="code", success=True, output="42", metadata={"confidence": 0.99})
    assert policy.should_terminate(result, PolicyContext(step=0)) == (False, None)
    assert policy.should_terminate(result, PolicyContext(step=3)) == (True, "42")
    result2 = ActionResult(
        action_type="code",
        success=True,
        output="I think it might be FINAL('42')",
        metadata={"confidence": 0.4},
    )
    assert policy.should_terminate(result2, PolicyContext(step=3)) == (True, "42")


def test_confidence_without_fallback_ignores_final() -> None:
    policy = PolicyRegistry.get_termination("confidence", config={"fallback_to_final_pattern": False})
    result = ActionResult("code", output="FINAL('42')", metadata={"confidence": 0.4})
    assert policy.should_terminate(result, PolicyContext(step=5)) == (False, None)


def test_confidence_reads_its_configured_key() -> None:
    policy = PolicyRegistry.get_termination("confidence", config={"confidence_key": "p"})
    result = ActionResult("code", output="x", metadata={"p": 0.9})
    assert policy.should_terminate(result, PolicyContext(step=2)) == (True, "x")


# --- composite --------------------------------------------------------------------------------


def test_composite_default_config_is_the_seeds() -> None:
    assert CompositeTerminationPolicy.get_default_config() == {
        "policies": ["final_pattern", "reward_threshold"],
        "require_all": False,
    }


def test_seed_example_composite_or() -> None:
    policy = PolicyRegistry.get_termination(
        "composite",
        config={
            "policies": ["final_pattern", "reward_threshold"],
            "require_all": False,
        },
    )
    assert policy.should_terminate(ActionResult("code", output="FINAL('a')"), PolicyContext()) == (True, "a")
    stop, answer = policy.should_terminate(
        ActionResult("code", output="x"), PolicyContext(metrics={"last_reward": 0.9})
    )
    assert stop and answer == "Reward threshold reached: 0.90"


def test_seed_example_composite_and() -> None:
    policy = PolicyRegistry.get_termination(
        "composite",
        config={
            "policies": ["confidence", "final_pattern"],
            "require_all": True,
        },
    )
    sure_no_final = ActionResult("code", output="42", metadata={"confidence": 0.99})
    assert policy.should_terminate(sure_no_final, PolicyContext(step=3)) == (False, None)
    sure_final = ActionResult("final", output="42", metadata={"confidence": 0.99})
    assert policy.should_terminate(sure_final, PolicyContext(step=3)) == (True, "42")


def test_composite_of_three_or() -> None:
    policy = PolicyRegistry.get_termination(
        "composite",
        config={
            "policies": ["final_pattern", "confidence", "reward_threshold"],
        },
    )
    result = ActionResult("code", output="41", metadata={"confidence": 0.9})
    assert policy.should_terminate(result, PolicyContext(step=2)) == (True, "41")


def test_composite_sub_policies_can_carry_config() -> None:
    policy = PolicyRegistry.get_termination(
        "composite",
        config={
            "policies": [{"name": "reward_threshold", "config": {"min_reward_threshold": 0.1}}],
        },
    )
    assert policy.should_terminate(ActionResult("code"), PolicyContext(metrics={"last_reward": 0.2}))[0]


# --- custom policy (rlm_code's convergence example) -------------------------------------------


def test_seed_example_convergence_policy() -> None:
    policy = PolicyRegistry.get_termination("convergence", config={"window_size": 4, "min_steps": 5})
    outputs = ["a", "b", "42", "42", "42", "42"]
    decisions = [
        policy.should_terminate(ActionResult("code", output=o), PolicyContext(step=i))
        for i, o in enumerate(outputs)
    ]
    assert decisions[:5] == [(False, None)] * 5
    assert decisions[5] == (True, "42")


def test_convergence_needs_min_steps() -> None:
    policy = PolicyRegistry.get_termination("convergence")
    decisions = [
        policy.should_terminate(ActionResult("code", output="same"), PolicyContext(step=i)) for i in range(4)
    ]
    assert [d[0] for d in decisions] == [False, False, False, True]


# --- errors -----------------------------------------------------------------------------------


def test_unknown_policy_names_the_policy_and_the_known_ones() -> None:
    with pytest.raises(PolicyError, match="unknown termination policy 'nope'.*final_pattern"):
        PolicyRegistry.get_termination("nope")


@pytest.mark.parametrize(
    ("name", "config", "message"),
    [
        ("reward_threshold", {"min_reward": 1}, "policy 'reward_threshold': unknown config key 'min_reward'"),
        ("reward_threshold", {"min_reward_threshold": "high"}, "'min_reward_threshold' must be a number"),
        ("confidence", {"fallback_to_final_pattern": "yes"}, "'fallback_to_final_pattern' must be a boolean"),
        ("final_pattern", {"final_patterns": "FINAL"}, "'final_patterns' must be a list"),
        ("final_pattern", {"final_patterns": ["(unclosed"]}, "bad regex"),
        ("composite", {"policies": ["final_pattern", "nope"]}, "unknown termination policy 'nope'"),
        ("composite", {"policies": []}, "at least one policy"),
        ("composite", {"policies": [42]}, "each entry of 'policies'"),
        ("convergence", {"window": 3}, "policy 'convergence': unknown config key 'window'"),
    ],
)
def test_invalid_configs_name_the_policy_and_the_key(name: str, config: dict, message: str) -> None:
    with pytest.raises(PolicyError, match=message.replace("(", r"\(")):
        PolicyRegistry.get_termination(name, config)


def test_registering_a_non_policy_is_refused() -> None:
    with pytest.raises(PolicyError):
        PolicyRegistry.register_termination("bad")(dict)  # type: ignore[arg-type]


# --- state for workflow persistence -----------------------------------------------------------


@pytest.mark.parametrize("name", ["reward_threshold", "convergence", "composite"])
def test_policy_state_round_trips_through_json(name: str) -> None:
    import json

    first = PolicyRegistry.get_termination(name)
    for i, reward in enumerate([0.3, -0.2]):
        first.should_terminate(
            ActionResult("code", output="o"), PolicyContext(step=i, metrics={"last_reward": reward})
        )
    state = json.loads(json.dumps(first.get_state()))
    second = PolicyRegistry.get_termination(name)
    second.set_state(state)
    follow = ActionResult("code", output="o")
    ctx = PolicyContext(step=2, metrics={"last_reward": 0.6})
    assert second.should_terminate(follow, ctx) == first.should_terminate(follow, ctx)
    assert second.get_state() == first.get_state()


# --- explicit policy state (docs/architecture/decisions.md: a policy's state is declared) ----


def test_a_policy_whose_state_is_a_compiled_regex_is_refused_at_registration() -> None:
    with pytest.raises(PolicyError, match=r"'_pattern' holds Pattern.*declare a pydantic `State` model"):

        @PolicyRegistry.register_termination("regex_state")
        class RegexState(TerminationPolicy):
            name = "regex_state"

            def __init__(self, config=None):
                super().__init__(config)
                self._pattern = re.compile("done")

            def should_terminate(self, result, context):
                return bool(self._pattern.search(result.output)), None

    assert "regex_state" not in PolicyRegistry.list_termination()


def test_a_tuple_in_state_would_come_back_as_a_list_and_is_refused() -> None:
    class TupleState(TerminationPolicy):
        name = "tuple_state"

        def __init__(self, config=None):
            super().__init__(config)
            self._seen = (1, 2)

        def should_terminate(self, result, context):
            return False, None

    with pytest.raises(PolicyError, match="would come back from JSON as list"):
        PolicyRegistry.register_termination("tuple_state")(TupleState)


def test_state_that_turns_unsafe_later_is_reported_when_it_is_saved() -> None:
    class LaterUnsafe(TerminationPolicy):
        name = "later_unsafe"

        def __init__(self, config=None):
            super().__init__(config)
            self._last = None

        def should_terminate(self, result, context):
            self._last = re.compile(result.output or "x")
            return False, None

    policy = PolicyRegistry.register_termination("later_unsafe")(LaterUnsafe)()
    policy.should_terminate(ActionResult("code", output="a"), PolicyContext())
    with pytest.raises(PolicyError, match="'_last' holds Pattern"):
        policy.get_state()


def test_a_declared_state_model_is_the_state_and_nothing_else() -> None:
    policy = PolicyRegistry.get_termination("reward_threshold")
    policy.should_terminate(ActionResult("code"), PolicyContext(metrics={"last_reward": 0.25}))
    assert policy.get_state() == {"cumulative_reward": 0.25, "negative_streak": 0}
    assert PolicyRegistry.get_termination("final_pattern").get_state() == {}  # compiled patterns are config
    assert PolicyRegistry.get_termination("confidence").get_state() == {}


def test_state_saved_before_state_models_still_restores() -> None:
    policy = PolicyRegistry.get_termination("reward_threshold")
    policy.set_state({"_cumulative_reward": 0.7, "_negative_streak": 2})  # an old carry
    assert policy.get_state() == {"cumulative_reward": 0.7, "negative_streak": 2}
    composite = PolicyRegistry.get_termination("composite")
    composite.set_state({"_policies": [{}, {"_cumulative_reward": 0.5, "_negative_streak": 0}]})
    assert composite.get_state() == {"policies": [{}, {"cumulative_reward": 0.5, "negative_streak": 0}]}


def test_a_state_that_does_not_fit_its_model_is_refused() -> None:
    policy = PolicyRegistry.get_termination("reward_threshold")
    with pytest.raises(PolicyError, match="cannot restore state"):
        policy.set_state({"cumulative_reward": "lots"})
    policy._negative_streak = "many"  # noqa: SLF001 - a bug in a subclass would look like this
    with pytest.raises(PolicyError, match="does not fit its State model"):
        policy.get_state()


# --- decisions keep answers and reasons apart -------------------------------------------------


def test_a_status_message_is_a_reason_not_an_answer() -> None:
    policy = PolicyRegistry.get_termination("reward_threshold")
    decision = policy.decide(ActionResult("code"), PolicyContext(metrics={"last_reward": 0.9}))
    assert decision == PolicyDecision(True, None, "Reward threshold reached: 0.90")
    assert decision.as_tuple() == (True, "Reward threshold reached: 0.90")  # rlm_code's tuple
    final = PolicyRegistry.get_termination("reward_threshold").decide(
        ActionResult("final", output="42"), PolicyContext(metrics={"last_reward": 0.9})
    )
    assert (final.answer, final.reason) == ("42", "cumulative reward 0.90 >= 0.8")
    assert PolicyDecision(False, "ignored", "ignored").as_tuple() == (False, None)


def test_decisions_say_why() -> None:
    final = PolicyRegistry.get_termination("final_pattern")
    assert final.decide(ActionResult("final", output="a"), PolicyContext()) == PolicyDecision(
        True, "a", "final action"
    )
    matched = final.decide(ActionResult("code", output="FINAL(7)"), PolicyContext())
    assert (matched.answer, matched.reason) == (
        "7",
        "pattern 'FINAL\\\\s*\\\\(\\\\s*(.+?)\\\\s*\\\\)' matched",
    )
    assert final.decide(ActionResult("code", output="nothing"), PolicyContext()) == PolicyDecision(False)
    confident = PolicyRegistry.get_termination("confidence").decide(
        ActionResult("code", output="", metadata={"confidence": 0.9}), PolicyContext(step=5)
    )
    assert confident == PolicyDecision(True, "", "confidence 0.90 >= 0.85")
    fallback = PolicyRegistry.get_termination("confidence").decide(
        ActionResult("final", output="x", metadata={"confidence": 0.1}), PolicyContext(step=5)
    )
    assert fallback == PolicyDecision(True, "x", "confidence below threshold; final action")


def test_composite_decisions_name_the_policies_that_decided() -> None:
    either = PolicyRegistry.get_termination("composite")
    decision = either.decide(ActionResult("code"), PolicyContext(metrics={"last_reward": 1.0}))
    assert decision == PolicyDecision(True, None, "reward_threshold: Reward threshold reached: 1.00")
    both = PolicyRegistry.get_termination(
        "composite", {"policies": ["final_pattern", "reward_threshold"], "require_all": True}
    )
    decision = both.decide(ActionResult("final", output="42"), PolicyContext(metrics={"last_reward": 1.0}))
    assert decision.answer == "42"
    assert (
        decision.reason
        == "all of final_pattern (final action), reward_threshold (cumulative reward 1.00 >= 0.8)"
    )
    assert both.decide(ActionResult("code"), PolicyContext(metrics={"last_reward": 1.0})) == PolicyDecision(
        False
    )


def test_a_seed_api_policy_gets_a_decision_from_its_tuple() -> None:
    policy = PolicyRegistry.get_termination("convergence", {"window_size": 1, "min_steps": 0})
    decision = policy.decide(ActionResult("code", output="same"), PolicyContext())
    assert decision == PolicyDecision(True, "same", "convergence decided to stop")


# --- what each built-in decides at its edges ------------------------------------------------


def reward_policy(**config: Any) -> TerminationPolicy:
    return PolicyRegistry.get_termination("reward_threshold", config or None)


def rewarded(policy: TerminationPolicy, *rewards: float | None) -> PolicyDecision:
    decision = PolicyDecision(False)
    for reward in rewards:
        metrics = {} if reward is None else {"last_reward": reward}
        decision = policy.decide(ActionResult("code"), PolicyContext(metrics=metrics))
    return decision


def test_no_reward_is_no_reward() -> None:
    assert rewarded(reward_policy(), None, None, None, None) == PolicyDecision(False)


def test_zero_rewards_are_not_a_negative_streak() -> None:
    assert rewarded(reward_policy(), 0.0, 0.0, 0.0, 0.0) == PolicyDecision(False)
    assert rewarded(reward_policy(), -0.1, -0.1, 0.0, -0.1) == PolicyDecision(False)


def test_a_negative_streak_stops_with_a_reason_and_no_answer() -> None:
    decision = rewarded(reward_policy(), -0.1, -0.1, -0.1)
    assert decision == PolicyDecision(True, None, "Terminated after 3 consecutive negative rewards")


def test_reset_starts_the_streak_and_the_sum_again() -> None:
    policy = reward_policy()
    rewarded(policy, -0.1, -0.1)
    policy.reset()
    assert policy.get_state() == {"cumulative_reward": 0.0, "negative_streak": 0}
    assert rewarded(policy, -0.1, -0.1) == PolicyDecision(False)
    assert rewarded(policy, -0.1).stop


def test_a_reward_threshold_that_requires_a_final_action_waits_for_one() -> None:
    policy = reward_policy(require_final_action=True)
    assert rewarded(policy, 1.0) == PolicyDecision(False)


def test_confidence_at_exactly_the_threshold_stops() -> None:
    policy = PolicyRegistry.get_termination("confidence")
    at = ActionResult("code", output="o", metadata={"confidence": 0.85})
    assert policy.decide(at, PolicyContext(step=2)) == PolicyDecision(True, "o", "confidence 0.85 >= 0.85")
    below = ActionResult("code", output="o", metadata={"confidence": 0.84})
    assert policy.decide(below, PolicyContext(step=2)) == PolicyDecision(False)
    assert policy.decide(at, PolicyContext(step=1)) == PolicyDecision(False)  # too early


def test_confidence_falls_back_to_final_var_with_the_variables_it_was_given() -> None:
    policy = PolicyRegistry.get_termination("confidence")
    action = ActionResult("code", output="FINAL_VAR('total')")
    decision = policy.decide(action, PolicyContext(step=3, variables={"total": 12}))
    assert decision.answer == "12" and decision.reason.startswith("confidence below threshold; pattern")


# --- final_pattern with custom patterns ---------------------------------------------------------


def final_pattern(**config: Any) -> TerminationPolicy:
    return PolicyRegistry.get_termination("final_pattern", config)


def test_without_extract_answer_the_whole_output_is_the_answer() -> None:
    policy = final_pattern(extract_answer=False)
    decision = policy.decide(ActionResult("code", output="x\nFINAL(7)\n"), PolicyContext())
    assert decision == PolicyDecision(
        True, "x\nFINAL(7)\n", "pattern 'FINAL\\\\s*\\\\(\\\\s*(.+?)\\\\s*\\\\)' matched"
    )


def test_a_pattern_without_a_group_answers_with_the_whole_match() -> None:
    policy = final_pattern(final_patterns=[r"DONE \d+"])
    decision = policy.decide(ActionResult("code", output="work\nDONE 42 now"), PolicyContext())
    assert decision == PolicyDecision(True, "DONE 42", "pattern 'DONE \\\\d+' matched")


def test_a_final_var_of_a_missing_variable_lets_later_patterns_decide() -> None:
    policy = final_pattern(final_patterns=[r"FINAL_VAR\((\w+)\)", r"ANSWER: (\w+)"])
    output = "FINAL_VAR(missing)\nANSWER: five"
    assert policy.decide(ActionResult("code", output=output), PolicyContext()).answer == "five"


def test_a_catch_all_pattern_does_not_stop_on_an_action_that_printed_nothing() -> None:
    policy = final_pattern(final_patterns=[r"(.+)"])
    assert policy.decide(ActionResult("code", output=None), PolicyContext()) == PolicyDecision(False)  # type: ignore[arg-type]


# --- composite ----------------------------------------------------------------------------------


@PolicyRegistry.register_termination("silent_stop")
class SilentStop(TerminationPolicy):
    """Stops with neither answer nor reason: the most a custom decide() can leave out."""

    name = "silent_stop"

    def should_terminate(self, result: ActionResult, context: PolicyContext) -> tuple[bool, str | None]:
        return True, None

    def decide(self, result: ActionResult, context: PolicyContext) -> PolicyDecision:
        return PolicyDecision(True)


def test_a_composite_stop_with_no_text_is_no_text() -> None:
    composite = PolicyRegistry.get_termination("composite", {"policies": ["silent_stop"]})
    assert composite.should_terminate(ActionResult("code"), PolicyContext()) == (True, None)


@pytest.mark.parametrize(
    ("policies", "message"),
    [
        (
            [3],
            "policy 'composite': each entry of 'policies' must be a policy name or "
            "{'name': ..., 'config': {...}}, got 3",
        ),
        ([], "policy 'composite': 'policies' must name at least one policy"),
    ],
)
def test_composite_configuration_errors(policies: list[Any], message: str) -> None:
    with pytest.raises(PolicyError, match=f"^{re.escape(message)}$"):
        PolicyRegistry.get_termination("composite", {"policies": policies})


def test_an_empty_composite_state_restores_nothing() -> None:
    composite = PolicyRegistry.get_termination("composite")
    rewarded(composite, 0.5)
    composite.set_state({})
    assert composite.get_state() == {"policies": [{}, {"cumulative_reward": 0.5, "negative_streak": 0}]}


# --- configuration errors say what was wrong ----------------------------------------------------


@pytest.mark.parametrize(
    ("name", "config", "message"),
    [
        (
            "reward_threshold",
            {"min_reward": 1},
            "policy 'reward_threshold': unknown config key 'min_reward' "
            "(known: max_negative_streak, min_reward_threshold, require_final_action)",
        ),
        ("silent_stop", {"x": 1}, "policy 'silent_stop': unknown config key 'x' (known: none)"),
        (
            "reward_threshold",
            {"min_reward_threshold": "high"},
            "policy 'reward_threshold': config key 'min_reward_threshold' must be a number, got str 'high'",
        ),
        (
            "confidence",
            {"confidence_key": 3},
            "policy 'confidence': config key 'confidence_key' must be a string, got int 3",
        ),
        ("reward_threshold", [1], "policy 'reward_threshold': config must be a mapping, got list"),
    ],
)
def test_configuration_errors_name_the_key_and_what_it_must_be(name: str, config: Any, message: str) -> None:
    with pytest.raises(PolicyError, match=f"^{re.escape(message)}$"):
        PolicyRegistry.get_termination(name, config)


def test_an_unknown_policy_lists_every_known_one() -> None:
    message = f"unknown termination policy 'nope' (known: {', '.join(PolicyRegistry.list_termination())})"
    with pytest.raises(PolicyError, match=f"^{re.escape(message)}$"):
        PolicyRegistry.get_termination("nope")


def test_a_config_key_whose_default_is_a_mapping_takes_a_mapping() -> None:
    class Weighted(TerminationPolicy):
        name = "weighted"

        @classmethod
        def get_default_config(cls) -> dict[str, Any]:
            return {"weights": {}}

        def should_terminate(self, result: ActionResult, context: PolicyContext) -> tuple[bool, str | None]:
            return False, None

    PolicyRegistry.register_termination("weighted")(Weighted)
    policy = PolicyRegistry.get_termination("weighted", {"weights": {"a": 1.0}})
    assert policy.settings["weights"] == {"a": 1.0}


# --- registration ---------------------------------------------------------------------------------


def test_only_termination_policies_register() -> None:
    with pytest.raises(PolicyError, match=r"^<class 'int'> is not a TerminationPolicy$"):
        PolicyRegistry.register_termination("int")(int)  # type: ignore[arg-type]


def test_a_policy_that_needs_config_registers_and_is_checked_when_built() -> None:
    class NeedsConfig(TerminationPolicy):
        name = "needs_config"

        def __init__(self, config: dict[str, Any] | None = None) -> None:
            if not config:
                raise KeyError("target")
            self.target = config["target"]  # not a `_` attribute: no state
            self._hits = 0

        def should_terminate(self, result: ActionResult, context: PolicyContext) -> tuple[bool, str | None]:
            return result.output == self.target, None

    assert PolicyRegistry.register_termination("needs_config")(NeedsConfig) is NeedsConfig
    policy = PolicyRegistry.get_termination("needs_config", {"target": "ok"})
    assert policy.should_terminate(ActionResult("code", output="ok"), PolicyContext()) == (True, None)


def test_a_seed_api_policy_that_goes_on_gives_no_answer_and_no_reason() -> None:
    class Chatty(TerminationPolicy):
        name = "chatty"

        def should_terminate(self, result: ActionResult, context: PolicyContext) -> tuple[bool, str | None]:
            return False, "not yet"

    assert Chatty().decide(ActionResult("code"), PolicyContext()) == PolicyDecision(False, None, "")


# --- state that cannot cross continue-as-new, and the messages that say so ----------------------


class Holder(TerminationPolicy):
    """A custom policy without a State model: its `_value` attribute is its state."""

    name = "holder"

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        self._value: Any = 0

    def should_terminate(self, result: ActionResult, context: PolicyContext) -> tuple[bool, str | None]:
        return False, None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            re.compile("x"),
            "policy 'holder': state attribute '_value' holds Pattern, which cannot cross continue-as-new "
            "as JSON (Object of type Pattern is not JSON serializable); declare a pydantic `State` model, "
            "or rebuild the value from config in __init__ and keep it out of `_` attributes",
        ),
        (
            float("nan"),
            "policy 'holder': state attribute '_value' holds float, which cannot cross continue-as-new "
            "as JSON (Out of range float values are not JSON compliant",
        ),
        (
            {1: "a"},
            "policy 'holder': state attribute '_value' (dict) would come back from JSON as dict; "
            "declare a pydantic `State` model",
        ),
        (
            (1, 2),
            "policy 'holder': state attribute '_value' (tuple) would come back from JSON as list; "
            "declare a pydantic `State` model",
        ),
    ],
)
def test_unsafe_state_is_named_with_its_policy_attribute_and_type(value: Any, message: str) -> None:
    policy = Holder()
    policy._value = value  # noqa: SLF001
    with pytest.raises(PolicyError, match=f"^{re.escape(message)}"):
        policy.get_state()


def test_a_state_that_changes_on_its_way_through_json_is_refused_at_registration() -> None:
    class Drifting(TerminationPolicy):
        name = "drifting"

        def should_terminate(self, result: ActionResult, context: PolicyContext) -> tuple[bool, str | None]:
            return False, None

        pair: Any = (1, 2)  # a class attribute, so the `_` attribute check does not see it

        def get_state(self) -> dict[str, Any]:
            return {"pair": self.pair}

        def set_state(self, state: dict[str, Any]) -> None:
            self.pair = state["pair"]  # a list after JSON

    with pytest.raises(
        PolicyError, match="^policy 'drifting': its state does not come back unchanged from JSON$"
    ):
        PolicyRegistry.register_termination("drifting")(Drifting)


def test_a_declared_state_is_dumped_as_json() -> None:
    from pydantic import BaseModel

    class SeenState(BaseModel):
        seen: set[str] = set()

    class Seen(TerminationPolicy):
        name = "seen"
        State = SeenState

        def __init__(self, config: dict[str, Any] | None = None) -> None:
            super().__init__(config)
            self._seen: set[str] = set()

        def should_terminate(self, result: ActionResult, context: PolicyContext) -> tuple[bool, str | None]:
            self._seen.add(result.output)
            return False, None

    policy = PolicyRegistry.register_termination("seen")(Seen)()
    policy.should_terminate(ActionResult("code", output="a"), PolicyContext())
    assert policy.get_state() == {"seen": ["a"]}


@pytest.mark.parametrize("declared", [True, False])
def test_restored_state_is_the_policys_own_copy(declared: bool) -> None:
    from pydantic import BaseModel

    class LogState(BaseModel):
        log: dict[str, Any] = {}

    class Logger(TerminationPolicy):
        name = "logger"
        State = LogState if declared else None

        def __init__(self, config: dict[str, Any] | None = None) -> None:
            super().__init__(config)
            self._log: dict[str, Any] = {"outputs": []}

        def should_terminate(self, result: ActionResult, context: PolicyContext) -> tuple[bool, str | None]:
            self._log["outputs"].append(result.output)
            return False, None

    carried = {"log": {"outputs": ["a"]}} if declared else {"_log": {"outputs": ["a"]}}
    policy = Logger()
    policy.set_state(carried)
    policy.should_terminate(ActionResult("code", output="b"), PolicyContext())
    assert carried == ({"log": {"outputs": ["a"]}} if declared else {"_log": {"outputs": ["a"]}})
