"""Termination policies (seed 003): when an episode is done.

Deterministic workflow code: a policy sees the iteration's `ActionResult` and a
`PolicyContext` and returns `(should_terminate, final_answer)`. Stateful policies keep their
state in attributes whose names start with `_`; `get_state()` / `set_state()` move that state
through continue-as-new, and replay rebuilds it by feeding the same results again.
"""

from __future__ import annotations

import copy
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar


class PolicyError(ValueError):
    """An unknown policy or a bad configuration, named precisely."""


@dataclass
class ActionResult:
    """What one iteration did: `final` (an answer), `code` (cells ran), `error` (a cell
    raised), or `message` (neither code nor answer)."""

    action_type: str
    success: bool = True
    output: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class PolicyContext:
    task: str = ""
    step: int = 0
    variables: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)


class Policy:
    name: ClassVar[str] = "policy_base"
    description: ClassVar[str] = "Base policy"

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        if config is not None and not isinstance(config, dict):
            raise PolicyError(f"policy {self.name!r}: config must be a mapping, got {type(config).__name__}")
        self.config: dict[str, Any] = dict(config or {})
        self.validate_config(self.config)

    @classmethod
    def get_default_config(cls) -> dict[str, Any]:
        return {}

    @classmethod
    def validate_config(cls, config: dict[str, Any]) -> None:
        """Unknown keys and values of the wrong type are errors that name the key."""
        defaults = cls.get_default_config()
        for key, value in config.items():
            if key not in defaults:
                known = ", ".join(sorted(defaults)) or "none"
                raise PolicyError(f"policy {cls.name!r}: unknown config key {key!r} (known: {known})")
            expected = defaults[key]
            if not _same_kind(value, expected):
                raise PolicyError(
                    f"policy {cls.name!r}: config key {key!r} must be {_kind(expected)}, "
                    f"got {type(value).__name__} {value!r}"
                )

    @property
    def settings(self) -> dict[str, Any]:
        return {**self.get_default_config(), **self.config}

    def reset(self) -> None:
        """Clear state between independent episodes."""

    def get_state(self) -> dict[str, Any]:
        return {k: copy.deepcopy(v) for k, v in vars(self).items() if k.startswith("_")}

    def set_state(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            if key.startswith("_"):
                setattr(self, key, copy.deepcopy(value))


class TerminationPolicy(Policy, ABC):
    """Policy for determining when to terminate execution."""

    name: ClassVar[str] = "termination_base"
    description: ClassVar[str] = "Base termination policy"
    last_reason: str | None = None

    @abstractmethod
    def should_terminate(self, result: ActionResult, context: PolicyContext) -> tuple[bool, str | None]:
        """Return (should_terminate, final_answer_if_any)."""


class PolicyRegistry:
    _termination: ClassVar[dict[str, type[TerminationPolicy]]] = {}

    @classmethod
    def register_termination(cls, name: str) -> Callable[[type[TerminationPolicy]], type[TerminationPolicy]]:
        def register(policy_cls: type[TerminationPolicy]) -> type[TerminationPolicy]:
            if not (isinstance(policy_cls, type) and issubclass(policy_cls, TerminationPolicy)):
                raise PolicyError(f"{policy_cls!r} is not a TerminationPolicy")
            cls._termination[name] = policy_cls
            return policy_cls

        return register

    @classmethod
    def get_termination(cls, name: str, config: dict[str, Any] | None = None) -> TerminationPolicy:
        policy_cls = cls._termination.get(name)
        if policy_cls is None:
            known = ", ".join(sorted(cls._termination))
            raise PolicyError(f"unknown termination policy {name!r} (known: {known})")
        return policy_cls(config)

    @classmethod
    def list_termination(cls) -> list[str]:
        return sorted(cls._termination)


@PolicyRegistry.register_termination("final_pattern")
class FinalPatternTerminationPolicy(TerminationPolicy):
    """The RLM paper's protocol: FINAL() / FINAL_VAR() in the action's output."""

    name = "final_pattern"
    description = "Stop on FINAL(...) / FINAL_VAR(...) (the RLM paper's protocol)"

    @classmethod
    def get_default_config(cls) -> dict[str, Any]:
        return {
            "final_patterns": [
                r"FINAL\s*\(\s*['\"](.+?)['\"]\s*\)",
                r"FINAL\s*\(\s*(.+?)\s*\)",
                r"FINAL_VAR\s*\(\s*['\"](\w+)['\"]\s*\)",
            ],
            "case_sensitive": False,
            "extract_answer": True,
        }

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        flags = re.MULTILINE | (0 if self.settings["case_sensitive"] else re.IGNORECASE)
        self._compiled_patterns = []
        for pattern in self.settings["final_patterns"]:
            try:
                self._compiled_patterns.append((pattern, re.compile(pattern, flags)))
            except re.error as exc:
                raise PolicyError(
                    f"policy 'final_pattern': bad regex {pattern!r} in final_patterns: {exc}"
                ) from exc

    def get_state(self) -> dict[str, Any]:
        return {}  # stateless; compiled patterns are rebuilt from config

    def should_terminate(self, result: ActionResult, context: PolicyContext) -> tuple[bool, str | None]:
        if result.action_type == "final":
            self.last_reason = "final action"
            return True, result.output
        output = result.output or ""
        for pattern, compiled in self._compiled_patterns:
            match = compiled.search(output)
            if match is None:
                continue
            if not self.settings["extract_answer"]:
                self.last_reason = f"pattern {pattern!r} matched"
                return True, output
            captured = match.group(1) if compiled.groups else match.group(0)
            if "FINAL_VAR" in pattern:
                if captured not in context.variables:
                    continue  # the variable does not exist (yet): not an answer
                captured = str(context.variables[captured])
            self.last_reason = f"pattern {pattern!r} matched"
            return True, captured
        return False, None


@PolicyRegistry.register_termination("reward_threshold")
class RewardThresholdTerminationPolicy(TerminationPolicy):
    name = "reward_threshold"
    description = "Stop when cumulative reward reaches a threshold, or after a negative streak"

    @classmethod
    def get_default_config(cls) -> dict[str, Any]:
        return {"min_reward_threshold": 0.8, "max_negative_streak": 3, "require_final_action": False}

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        self._cumulative_reward = 0.0
        self._negative_streak = 0

    def should_terminate(self, result: ActionResult, context: PolicyContext) -> tuple[bool, str | None]:
        settings = self.settings
        reward = float(context.metrics.get("last_reward") or 0.0)
        self._cumulative_reward += reward
        self._negative_streak = self._negative_streak + 1 if reward < 0 else 0
        if self._cumulative_reward >= settings["min_reward_threshold"]:
            if settings["require_final_action"] and result.action_type != "final":
                return False, None
            self.last_reason = (
                f"cumulative reward {self._cumulative_reward:.2f} >= {settings['min_reward_threshold']}"
            )
            if result.action_type == "final":
                return True, result.output
            return True, f"Reward threshold reached: {self._cumulative_reward:.2f}"
        if self._negative_streak >= settings["max_negative_streak"]:
            self.last_reason = f"{self._negative_streak} consecutive negative rewards"
            return True, f"Terminated after {self._negative_streak} consecutive negative rewards"
        return False, None

    def reset(self) -> None:
        self._cumulative_reward = 0.0
        self._negative_streak = 0


@PolicyRegistry.register_termination("confidence")
class ConfidenceTerminationPolicy(TerminationPolicy):
    name = "confidence"
    description = "Stop when the model's confidence reaches a threshold"

    @classmethod
    def get_default_config(cls) -> dict[str, Any]:
        return {
            "confidence_threshold": 0.85,
            "min_steps_before_termination": 2,
            "confidence_key": "confidence",
            "fallback_to_final_pattern": True,
        }

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        self._fallback = FinalPatternTerminationPolicy()

    def get_state(self) -> dict[str, Any]:
        return {}

    def should_terminate(self, result: ActionResult, context: PolicyContext) -> tuple[bool, str | None]:
        settings = self.settings
        if context.step < settings["min_steps_before_termination"]:
            return False, None
        confidence = result.metadata.get(settings["confidence_key"])
        if isinstance(confidence, (int, float)) and confidence >= settings["confidence_threshold"]:
            self.last_reason = f"confidence {confidence:.2f} >= {settings['confidence_threshold']}"
            return True, result.output
        if settings["fallback_to_final_pattern"]:
            stop, answer = self._fallback.should_terminate(result, context)
            if stop:
                self.last_reason = f"confidence below threshold; {self._fallback.last_reason}"
            return stop, answer
        return False, None


@PolicyRegistry.register_termination("composite")
class CompositeTerminationPolicy(TerminationPolicy):
    name = "composite"
    description = "Combine policies with OR (any) or AND (all)"

    @classmethod
    def get_default_config(cls) -> dict[str, Any]:
        return {"policies": ["final_pattern", "reward_threshold"], "require_all": False}

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        self.policies: list[TerminationPolicy] = []
        for entry in self.settings["policies"]:
            if isinstance(entry, str):
                self.policies.append(PolicyRegistry.get_termination(entry))
            elif isinstance(entry, dict) and isinstance(entry.get("name"), str):
                self.policies.append(PolicyRegistry.get_termination(entry["name"], entry.get("config")))
            else:
                raise PolicyError(
                    "policy 'composite': each entry of 'policies' must be a policy name or "
                    f"{{'name': ..., 'config': {{...}}}}, got {entry!r}"
                )
        if not self.policies:
            raise PolicyError("policy 'composite': 'policies' must name at least one policy")

    def should_terminate(self, result: ActionResult, context: PolicyContext) -> tuple[bool, str | None]:
        if not self.settings["require_all"]:
            for policy in self.policies:
                stop, answer = policy.should_terminate(result, context)
                if stop:
                    self.last_reason = f"{policy.name}: {policy.last_reason or 'triggered'}"
                    return True, answer
            return False, None
        decisions = [(p, *p.should_terminate(result, context)) for p in self.policies]
        if all(stop for _, stop, _ in decisions):
            self.last_reason = "all of " + ", ".join(p.name for p, _, _ in decisions)
            return True, next((a for _, _, a in decisions if a is not None), None)
        return False, None

    def reset(self) -> None:
        for policy in self.policies:
            policy.reset()

    def get_state(self) -> dict[str, Any]:
        return {"_policies": [p.get_state() for p in self.policies]}

    def set_state(self, state: dict[str, Any]) -> None:
        for policy, sub_state in zip(self.policies, state.get("_policies", []), strict=False):
            policy.set_state(sub_state)


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return type(value).__name__


def _same_kind(value: Any, expected: Any) -> bool:
    if isinstance(expected, bool):
        return isinstance(value, bool)
    if isinstance(expected, (int, float)):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if isinstance(expected, str):
        return isinstance(value, str)
    if isinstance(expected, list):
        return isinstance(value, list)
    return True
