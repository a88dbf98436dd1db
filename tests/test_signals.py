"""Confidence and reward sources, and how an iteration becomes an ActionResult."""

from __future__ import annotations

import math

import pytest

from workflows.signals import (
    action_reward,
    build_action,
    logprob_confidence,
    stated_confidence,
    uses_confidence,
    validate_reward_function,
)
from workflows.termination import ActionResult, PolicyError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("answer\nCONFIDENCE: 0.9", 0.9),
        ("confidence = 85%", 0.85),
        ("CONFIDENCE: 70", 0.7),
        ("CONFIDENCE: 0.2\nmore\nCONFIDENCE: 0.6", 0.6),
        ("my confidence: 0.9 inline", None),
        ("CONFIDENCE: 300", None),
        ("no statement", None),
    ],
)
def test_stated_confidence_format(text: str, expected: float | None) -> None:
    assert stated_confidence(text) == expected


def test_logprob_confidence_is_the_geometric_mean_probability() -> None:
    assert logprob_confidence(math.log(0.5)) == pytest.approx(0.5)
    assert logprob_confidence(None) is None


def test_stated_confidence_wins_over_logprobs() -> None:
    action = build_action(None, [("4\n", "", None)], "```repl\n...```\nCONFIDENCE: 0.3", math.log(0.99))
    assert action.metadata["confidence"] == 0.3
    assert action.metadata["logprob_confidence"] == pytest.approx(0.99)


def test_actions_by_kind() -> None:
    assert build_action("42", [], "FINAL(42)", None).action_type == "final"
    code = build_action(None, [("out\n", "", None)], "", None)
    # What a cell printed is data: policies see it only when asked to scan it.
    assert (code.action_type, code.success, code.output) == ("code", True, "")
    assert code.metadata["printed_output"] == "out"
    scanned = build_action(None, [("out\n", "", None)], "", None, show_printed=True, limit=2)
    assert scanned.output == "ou"
    error = build_action(None, [("", "", "ValueError: x")], "", None)
    assert (error.action_type, error.success) == ("error", False)
    message = build_action(None, [], "I will call FINAL(x) later", None)
    assert (message.action_type, message.output) == ("message", "")


def test_outcome_rewards() -> None:
    assert action_reward("outcome", {}, ActionResult("final")) == 1.0
    assert action_reward("outcome", {}, ActionResult("code")) == 0.1
    assert action_reward("outcome", {"error": -1.0}, ActionResult("error", success=False)) == -1.0
    assert action_reward("none", {}, ActionResult("final")) == 0.0


def test_bad_reward_functions_are_named() -> None:
    with pytest.raises(PolicyError, match="unknown reward function 'luck'"):
        validate_reward_function("luck", {})
    with pytest.raises(PolicyError, match="unknown config key 'bonus'"):
        validate_reward_function("outcome", {"bonus": 1.0})


def test_confidence_is_asked_for_when_a_policy_uses_it() -> None:
    assert uses_confidence("confidence", {})
    assert uses_confidence("composite", {"policies": ["final_pattern", {"name": "confidence"}]})
    assert not uses_confidence("composite", {})
    assert not uses_confidence("final_pattern", {})
