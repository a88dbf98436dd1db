"""Confidence and reward sources, and how an iteration becomes an ActionResult."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest

from durable_rlm.workflows.signals import (
    action_reward,
    build_action,
    logprob_confidence,
    stated_confidence,
    uses_confidence,
    validate_reward_function,
)
from durable_rlm.workflows.termination import ActionResult, PolicyError

# --- confidence sources ----------------------------------------------------------------------


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
        ("", None),
        (None, None),
    ],
)
def test_stated_confidence_format(text: str | None, expected: float | None) -> None:
    assert stated_confidence(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("CONFIDENCE: 0", 0.0),
        ("CONFIDENCE: 1", 1.0),
        ("CONFIDENCE: 1.0", 1.0),
        ("CONFIDENCE: 100%", 1.0),
        ("CONFIDENCE: 100", 1.0),
        ("CONFIDENCE: 2", 0.02),
        ("CONFIDENCE: 101", None),
        ("CONFIDENCE: 150%", None),
    ],
)
def test_stated_confidence_is_a_probability_and_numbers_above_one_are_percentages(
    text: str, expected: float | None
) -> None:
    assert stated_confidence(text) == expected


@pytest.mark.parametrize(
    ("mean_logprob", "expected"),
    [
        (math.log(0.5), pytest.approx(0.5)),
        (0.0, 1.0),
        (0.3, 1.0),  # a provider's rounding can make the mean positive: still a probability
        (None, None),
        (math.nan, None),
        (math.inf, None),
        (-math.inf, None),
    ],
)
def test_logprob_confidence_is_the_geometric_mean_probability(
    mean_logprob: float | None, expected: Any
) -> None:
    assert logprob_confidence(mean_logprob) == expected


# --- the action a termination policy sees ----------------------------------------------------


@pytest.mark.parametrize(
    ("response", "mean_logprob", "expected"),
    [
        ("CONFIDENCE: 0.3", None, {"stated_confidence": 0.3, "confidence": 0.3}),
        ("no statement", math.log(0.99), {"logprob_confidence": 0.99, "confidence": 0.99}),
        (
            "CONFIDENCE: 0.3",
            math.log(0.99),
            {"stated_confidence": 0.3, "logprob_confidence": 0.99, "confidence": 0.3},
        ),
        ("no statement", None, {}),
    ],
    ids=["stated", "logprobs", "stated-wins-over-logprobs", "none"],
)
def test_action_metadata_carries_each_confidence_and_the_one_that_counts(
    response: str, mean_logprob: float | None, expected: dict[str, float]
) -> None:
    action = build_action(None, [("4\n", "", None)], response, mean_logprob)
    confidences = {key: value for key, value in action.metadata.items() if key.endswith("confidence")}
    assert confidences == pytest.approx(expected)


def test_final_action_output_is_the_answer() -> None:
    action = build_action("42", [], "FINAL(42)", None)
    assert action == ActionResult("final", True, "42", {"response": "FINAL(42)"})


def test_final_action_wins_over_cells_that_failed() -> None:
    action = build_action("42", [("", "", "ValueError: x")], "FINAL(42)", None)
    assert action == ActionResult(
        "final", True, "42", {"response": "FINAL(42)", "printed_output": "ValueError: x"}
    )


def test_code_action_hides_what_cells_printed_from_the_output() -> None:
    # What a cell printed is data: policies see it only when asked to scan it.
    action = build_action(None, [("out\n", "", None)], "```repl\nprint('out')\n```", None)
    assert action == ActionResult(
        "code", True, "", {"response": "```repl\nprint('out')\n```", "printed_output": "out"}
    )


def test_scanned_code_action_output_is_what_cells_printed_bounded() -> None:
    action = build_action(None, [("out\n", "", None)], "", None, show_printed=True, limit=2)
    assert (action.output, action.metadata["printed_output"]) == ("ou", "ou")


def test_printed_output_has_every_part_of_every_cell_on_its_own_line() -> None:
    outputs: list[tuple[str, str, str | None]] = [("a", "warning", None), ("", "", "ValueError: x")]
    action = build_action(None, outputs, "", None, show_printed=True)
    assert action.output == action.metadata["printed_output"] == "a\nwarning\nValueError: x"


def test_a_failed_cell_makes_an_error_action() -> None:
    action = build_action(None, [("ok\n", "", None), ("", "", "ValueError: x")], "", None)
    assert (action.action_type, action.success, action.output) == ("error", False, "")


def test_a_reply_without_code_or_answer_is_a_message_with_empty_output() -> None:
    action = build_action(None, [], "I will call FINAL(x) later", None)
    assert action == ActionResult("message", True, "", {"response": "I will call FINAL(x) later"})


# --- rewards ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        (ActionResult("final"), 1.0),
        (ActionResult("code"), 0.1),
        (ActionResult("error", success=False), -0.5),
        (ActionResult("error"), -0.5),  # an error is an error whatever its success flag says
        (ActionResult("code", success=False), -0.5),  # so is any failed action
        (ActionResult("message"), -0.1),
    ],
)
def test_outcome_reward_defaults(result: ActionResult, expected: float) -> None:
    assert action_reward("outcome", {}, result) == expected


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        (ActionResult("final"), 1.0),
        (ActionResult("code"), 0.1),
        (ActionResult("error", success=False), -1.0),
        (ActionResult("message"), -0.3),
    ],
)
def test_outcome_reward_weights_override_only_their_own_defaults(
    result: ActionResult, expected: float
) -> None:
    assert action_reward("outcome", {"error": -1.0, "message": -0.3}, result) == expected


@pytest.mark.parametrize(
    "result", [ActionResult("final"), ActionResult("error", success=False), ActionResult("message")]
)
def test_no_reward_function_gives_nothing(result: ActionResult) -> None:
    assert action_reward("none", {}, result) == 0.0


@pytest.mark.parametrize(
    ("name", "config"),
    [
        ("none", {}),
        ("outcome", {}),
        ("outcome", {"final": 2, "success": 0.5, "error": -1.0, "message": 0}),
    ],
)
def test_valid_reward_functions_are_accepted(name: str, config: dict[str, Any]) -> None:
    validate_reward_function(name, config)


def test_unknown_reward_function_is_named_with_the_known_ones() -> None:
    with pytest.raises(PolicyError, match=re.escape("unknown reward function 'luck' (known: none, outcome)")):
        validate_reward_function("luck", {})


@pytest.mark.parametrize(
    ("name", "config", "message"),
    [
        ("outcome", {"bonus": 1.0}, "reward function 'outcome': unknown config key 'bonus'"),
        ("none", {"final": 1.0}, "reward function 'none': unknown config key 'final'"),
    ],
)
def test_unknown_reward_config_keys_are_named(name: str, config: dict[str, Any], message: str) -> None:
    with pytest.raises(PolicyError, match=f"^{re.escape(message)}$"):
        validate_reward_function(name, config)


@pytest.mark.parametrize("value", [True, "1.0", None, math.inf, -math.inf, math.nan])
def test_reward_weights_must_be_finite_numbers(value: object) -> None:
    message = "reward function 'outcome': config key 'final' must be a number"
    with pytest.raises(PolicyError, match=f"^{re.escape(message)}$"):
        validate_reward_function("outcome", {"final": value})


# --- asking the model for confidence ---------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "config", "expected"),
    [
        ("confidence", {}, True),
        ("final_pattern", {}, False),
        ("final_pattern", {"policies": ["confidence"]}, False),
        ("composite", {}, False),
        ("composite", {"policies": ["final_pattern", "reward_threshold"]}, False),
        ("composite", {"policies": ["final_pattern", {"name": "confidence"}]}, True),
        ("composite", {"policies": [{"name": "composite", "config": {"policies": ["confidence"]}}]}, True),
        (
            "composite",
            {"policies": [{"name": "composite", "config": {"policies": ["final_pattern"]}}]},
            False,
        ),
        ("composite", {"policies": [{"name": "composite", "config": None}]}, False),
    ],
    ids=[
        "confidence",
        "other-policy",
        "only-composite-has-sub-policies",
        "composite-defaults",
        "composite-without-confidence",
        "composite-with-confidence",
        "nested-composite-with-confidence",
        "nested-composite-without-confidence",
        "nested-composite-defaults",
    ],
)
def test_confidence_is_asked_for_when_a_policy_uses_it(
    name: str, config: dict[str, Any], expected: bool
) -> None:
    assert uses_confidence(name, config) is expected
