"""Reward and confidence signals: pure functions the workflow feeds its policy with."""

from __future__ import annotations

import math
import re
from typing import Any

from durable_rlm.workflows.termination import ActionResult, PolicyError

# A line of its own: `CONFIDENCE: 0.9` or `confidence = 85%`. The last one in a reply counts:
# the leading `[\s\S]*` runs to the end and backs off to the last such line, one step a
# character, so a reply of a million such lines costs no list of a million matches.
_LAST_STATED_CONFIDENCE = re.compile(
    r"[\s\S]*^[ \t]*CONFIDENCE[ \t]*[:=][ \t]*([0-9]*\.?[0-9]+)[ \t]*(%?)", re.M | re.I
)

CONFIDENCE_INSTRUCTION = (
    "End every reply with a line `CONFIDENCE: <number between 0 and 1>` stating how sure you "
    "are that your current answer is right."
)


def stated_confidence(text: str | None) -> float | None:
    last = _LAST_STATED_CONFIDENCE.match(text or "")
    if last is None:
        return None
    number, percent = last.groups()
    value = float(number)
    if percent or value > 1:
        value /= 100
    return value if 0.0 <= value <= 1.0 else None


def logprob_confidence(mean_logprob: float | None) -> float | None:
    """Geometric-mean token probability of the reply: exp(mean log-probability)."""
    if mean_logprob is None or not math.isfinite(mean_logprob):
        return None
    return min(1.0, math.exp(mean_logprob))


# --- per-action reward functions -----------------------------------------------------------

OUTCOME_DEFAULTS: dict[str, float] = {"final": 1.0, "success": 0.1, "error": -0.5, "message": -0.1}


def _no_reward(result: ActionResult, config: dict[str, float]) -> float:
    return 0.0


def _outcome_reward(result: ActionResult, config: dict[str, float]) -> float:
    """Reward by what the iteration did: an answer, working code, an error, or nothing."""
    weights = {**OUTCOME_DEFAULTS, **config}
    if result.action_type == "final":
        return weights["final"]
    if result.action_type == "error" or not result.success:
        return weights["error"]
    if result.action_type == "code":
        return weights["success"]
    return weights["message"]


REWARD_FUNCTIONS = {"none": _no_reward, "outcome": _outcome_reward}


def validate_reward_function(name: str, config: dict[str, Any]) -> None:
    if name not in REWARD_FUNCTIONS:
        raise PolicyError(f"unknown reward function {name!r} (known: {', '.join(sorted(REWARD_FUNCTIONS))})")
    allowed = OUTCOME_DEFAULTS if name == "outcome" else {}
    for key, value in config.items():
        if key not in allowed:
            raise PolicyError(f"reward function {name!r}: unknown config key {key!r}")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise PolicyError(f"reward function {name!r}: config key {key!r} must be a number")


def action_reward(name: str, config: dict[str, Any], result: ActionResult) -> float:
    return REWARD_FUNCTIONS[name](result, config)


def build_action(
    answer: str | None,
    outputs: list[tuple[str, str, str | None]],
    response: str,
    mean_logprob: float | None,
    show_printed: bool = False,
    limit: int | None = None,
) -> ActionResult:
    """The iteration as a policy sees it. `outputs` are the cells' (stdout, stderr, error).

    A `final` action's output is the model's answer. For other actions the output is empty
    unless `show_printed`: what a cell printed is data, and data must not end an episode
    (a document that mentions "Final (revised)" is not an answer). Custom policies can still
    read it, bounded, from metadata["printed_output"]. A reply with neither code nor answer
    is a `message`, also with empty output.
    """
    metadata: dict[str, Any] = {"response": response}
    stated = stated_confidence(response)
    from_logprobs = logprob_confidence(mean_logprob)
    if stated is not None:
        metadata["stated_confidence"] = stated
    if from_logprobs is not None:
        metadata["logprob_confidence"] = from_logprobs
    confidence = stated if stated is not None else from_logprobs
    if confidence is not None:
        metadata["confidence"] = confidence
    printed = "\n".join(part for out in outputs for part in out if part).strip()
    if limit is not None:
        printed = printed[:limit]
    if outputs:
        metadata["printed_output"] = printed
    if answer is not None:
        return ActionResult("final", True, answer, metadata)
    if outputs:
        failed = any(error for _, _, error in outputs)
        return ActionResult(
            "error" if failed else "code", not failed, printed if show_printed else "", metadata
        )
    return ActionResult("message", True, "", metadata)


def uses_confidence(name: str, config: dict[str, Any]) -> bool:
    if name == "confidence":
        return True
    if name == "composite":
        for entry in config.get("policies", []):
            entry_name = entry if isinstance(entry, str) else (entry or {}).get("name")
            entry_config = {} if isinstance(entry, str) else (entry or {}).get("config") or {}
            if isinstance(entry_name, str) and uses_confidence(entry_name, entry_config):
                return True
    return False
