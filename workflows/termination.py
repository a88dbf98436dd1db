"""Termination policies (docs/behaviour/termination-policies.md): when an episode is done.

Deterministic workflow code: a policy sees the iteration's `ActionResult` and a
`PolicyContext` and returns `(should_terminate, final_answer)` (rlm_code's API), or a
`PolicyDecision` from `decide()`, which keeps an answer apart from a status message.

A policy's state crosses continue-as-new as JSON. Built-ins declare it as a pydantic
`State` model whose fields are the policy's `_field` attributes; a custom policy without
one has its `_` attributes checked instead, and registration refuses a policy whose state
would not come back as it went (a compiled regex would come back as a string).
"""

from __future__ import annotations

import copy
import json
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError


class PolicyError(ValueError):
    """An unknown policy, a bad configuration or unsafe state, named precisely."""


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


@dataclass(frozen=True)
class PolicyDecision:
    """A decision with its parts kept apart: `answer` is text the policy stands behind as
    the answer (None: none); `reason` says why, and is never an answer."""

    stop: bool
    answer: str | None = None
    reason: str = ""

    def as_tuple(self) -> tuple[bool, str | None]:
        """rlm_code's `(should_terminate, final_answer)`: a status message fills the
        second place when there is no answer, as its examples show."""
        if not self.stop:
            return False, None
        return True, self.answer if self.answer is not None else (self.reason or None)


class NoState(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _json_round_trip(name: str, attribute: str, value: Any) -> Any:
    try:
        back = json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise PolicyError(
            f"policy {name!r}: state attribute {attribute!r} holds {type(value).__name__}, which "
            f"cannot cross continue-as-new as JSON ({exc}); declare a pydantic `State` model, "
            "or rebuild the value from config in __init__ and keep it out of `_` attributes"
        ) from None
    if back != value or type(back) is not type(value):
        raise PolicyError(
            f"policy {name!r}: state attribute {attribute!r} ({type(value).__name__}) would come "
            f"back from JSON as {type(back).__name__}; declare a pydantic `State` model"
        )
    return back


class Policy:
    name: ClassVar[str] = "policy_base"
    description: ClassVar[str] = "Base policy"
    State: ClassVar[type[BaseModel] | None] = None
    """The policy's state: field `x` is attribute `_x`. None: every `_` attribute, checked."""

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
        """The state as JSON-safe data; raises PolicyError when it cannot be that."""
        if self.State is not None:
            values = {key: getattr(self, "_" + key) for key in self.State.model_fields}
            try:
                return self.State.model_validate(values).model_dump(mode="json")
            except ValidationError as exc:
                raise PolicyError(f"policy {self.name!r}: state does not fit its State model: {exc}") from exc
        return {
            key: _json_round_trip(self.name, key, value)
            for key, value in vars(self).items()
            if key.startswith("_")
        }

    def set_state(self, state: dict[str, Any]) -> None:
        if self.State is not None:
            # Histories written before State models carried the attribute names ("_x").
            plain = {key.removeprefix("_"): value for key, value in state.items()}
            try:
                value = self.State.model_validate(plain)
            except ValidationError as exc:
                raise PolicyError(f"policy {self.name!r}: cannot restore state: {exc}") from exc
            for key in self.State.model_fields:
                setattr(self, "_" + key, copy.deepcopy(getattr(value, key)))
            return
        for key, value in state.items():
            if key.startswith("_"):
                setattr(self, key, copy.deepcopy(value))


def check_state_round_trip(policy: Policy) -> None:
    """Refuse a policy whose state would not survive continue-as-new unchanged."""
    state = policy.get_state()
    twin = copy.deepcopy(policy)
    twin.set_state(json.loads(json.dumps(state)))
    if twin.get_state() != state:
        raise PolicyError(f"policy {policy.name!r}: its state does not come back unchanged from JSON")


class TerminationPolicy(Policy, ABC):
    """Policy for determining when to terminate execution."""

    name: ClassVar[str] = "termination_base"
    description: ClassVar[str] = "Base termination policy"

    @abstractmethod
    def should_terminate(self, result: ActionResult, context: PolicyContext) -> tuple[bool, str | None]:
        """Return (should_terminate, final_answer_if_any)."""

    def decide(self, result: ActionResult, context: PolicyContext) -> PolicyDecision:
        """The decision with answer and reason apart. Policies written to rlm_code's API
        only implement should_terminate; what they return counts as their answer."""
        stop, text = self.should_terminate(result, context)
        return PolicyDecision(
            bool(stop), text if stop else None, f"{self.name} decided to stop" if stop else ""
        )


class PolicyRegistry:
    _termination: ClassVar[dict[str, type[TerminationPolicy]]] = {}

    @classmethod
    def register_termination(cls, name: str) -> Callable[[type[TerminationPolicy]], type[TerminationPolicy]]:
        def register(policy_cls: type[TerminationPolicy]) -> type[TerminationPolicy]:
            if not (isinstance(policy_cls, type) and issubclass(policy_cls, TerminationPolicy)):
                raise PolicyError(f"{policy_cls!r} is not a TerminationPolicy")
            try:
                probe = policy_cls()
            except PolicyError:
                raise
            except Exception:  # noqa: BLE001 - needs config; checked when built with one
                probe = None
            if probe is not None:
                check_state_round_trip(probe)
            cls._termination[name] = policy_cls
            return policy_cls

        return register

    @classmethod
    def get_termination(cls, name: str, config: dict[str, Any] | None = None) -> TerminationPolicy:
        policy_cls = cls._termination.get(name)
        if policy_cls is None:
            known = ", ".join(sorted(cls._termination))
            raise PolicyError(f"unknown termination policy {name!r} (known: {known})")
        policy = policy_cls(config)
        check_state_round_trip(policy)
        return policy

    @classmethod
    def list_termination(cls) -> list[str]:
        return sorted(cls._termination)


@PolicyRegistry.register_termination("final_pattern")
class FinalPatternTerminationPolicy(TerminationPolicy):
    """The RLM paper's protocol: FINAL() / FINAL_VAR() in the action's output."""

    name = "final_pattern"
    description = "Stop on FINAL(...) / FINAL_VAR(...) (the RLM paper's protocol)"
    State = NoState  # compiled patterns are rebuilt from config

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

    def should_terminate(self, result: ActionResult, context: PolicyContext) -> tuple[bool, str | None]:
        return self.decide(result, context).as_tuple()

    def decide(self, result: ActionResult, context: PolicyContext) -> PolicyDecision:
        if result.action_type == "final":
            return PolicyDecision(True, result.output, "final action")
        output = result.output or ""
        for pattern, compiled in self._compiled_patterns:
            match = compiled.search(output)
            if match is None:
                continue
            if not self.settings["extract_answer"]:
                return PolicyDecision(True, output, f"pattern {pattern!r} matched")
            captured = match.group(1) if compiled.groups else match.group(0)
            if "FINAL_VAR" in pattern:
                if captured not in context.variables:
                    continue  # the variable does not exist (yet): not an answer
                captured = str(context.variables[captured])
            return PolicyDecision(True, captured, f"pattern {pattern!r} matched")
        return PolicyDecision(False)


class RewardState(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cumulative_reward: float = 0.0
    negative_streak: int = 0


@PolicyRegistry.register_termination("reward_threshold")
class RewardThresholdTerminationPolicy(TerminationPolicy):
    name = "reward_threshold"
    description = "Stop when cumulative reward reaches a threshold, or after a negative streak"
    State = RewardState

    @classmethod
    def get_default_config(cls) -> dict[str, Any]:
        return {"min_reward_threshold": 0.8, "max_negative_streak": 3, "require_final_action": False}

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        self._cumulative_reward = 0.0
        self._negative_streak = 0

    def should_terminate(self, result: ActionResult, context: PolicyContext) -> tuple[bool, str | None]:
        return self.decide(result, context).as_tuple()

    def decide(self, result: ActionResult, context: PolicyContext) -> PolicyDecision:
        settings = self.settings
        reward = float(context.metrics.get("last_reward") or 0.0)
        self._cumulative_reward += reward
        self._negative_streak = self._negative_streak + 1 if reward < 0 else 0
        if self._cumulative_reward >= settings["min_reward_threshold"]:
            if settings["require_final_action"] and result.action_type != "final":
                return PolicyDecision(False)
            if result.action_type == "final":
                return PolicyDecision(
                    True,
                    result.output,
                    f"cumulative reward {self._cumulative_reward:.2f} >= {settings['min_reward_threshold']}",
                )
            return PolicyDecision(True, None, f"Reward threshold reached: {self._cumulative_reward:.2f}")
        if self._negative_streak >= settings["max_negative_streak"]:
            return PolicyDecision(
                True, None, f"Terminated after {self._negative_streak} consecutive negative rewards"
            )
        return PolicyDecision(False)

    def reset(self) -> None:
        self._cumulative_reward = 0.0
        self._negative_streak = 0


@PolicyRegistry.register_termination("confidence")
class ConfidenceTerminationPolicy(TerminationPolicy):
    name = "confidence"
    description = "Stop when the model's confidence reaches a threshold"
    State = NoState  # the fallback policy is stateless and rebuilt from config

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

    def should_terminate(self, result: ActionResult, context: PolicyContext) -> tuple[bool, str | None]:
        return self.decide(result, context).as_tuple()

    def decide(self, result: ActionResult, context: PolicyContext) -> PolicyDecision:
        settings = self.settings
        if context.step < settings["min_steps_before_termination"]:
            return PolicyDecision(False)
        confidence = result.metadata.get(settings["confidence_key"])
        if isinstance(confidence, (int, float)) and confidence >= settings["confidence_threshold"]:
            return PolicyDecision(
                True, result.output, f"confidence {confidence:.2f} >= {settings['confidence_threshold']}"
            )
        if settings["fallback_to_final_pattern"]:
            fallback = self._fallback.decide(result, context)
            if fallback.stop:
                return PolicyDecision(True, fallback.answer, f"confidence below threshold; {fallback.reason}")
        return PolicyDecision(False)


class CompositeState(BaseModel):
    model_config = ConfigDict(extra="forbid")
    policies: list[dict[str, Any]] = []


@PolicyRegistry.register_termination("composite")
class CompositeTerminationPolicy(TerminationPolicy):
    name = "composite"
    description = "Combine policies with OR (any) or AND (all)"
    State = CompositeState

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

    def _decisions(
        self, result: ActionResult, context: PolicyContext
    ) -> list[tuple[TerminationPolicy, PolicyDecision]]:
        if self.settings["require_all"]:
            return [(p, p.decide(result, context)) for p in self.policies]
        for policy in self.policies:  # OR: the first that stops; later ones are not asked
            decision = policy.decide(result, context)
            if decision.stop:
                return [(policy, decision)]
        return []

    def should_terminate(self, result: ActionResult, context: PolicyContext) -> tuple[bool, str | None]:
        decisions = self._decisions(result, context)
        if not decisions or not all(d.stop for _, d in decisions):
            return False, None
        return True, next((d.as_tuple()[1] for _, d in decisions if d.as_tuple()[1] is not None), None)

    def decide(self, result: ActionResult, context: PolicyContext) -> PolicyDecision:
        decisions = self._decisions(result, context)
        if not decisions or not all(d.stop for _, d in decisions):
            return PolicyDecision(False)
        answer = next((d.answer for _, d in decisions if d.answer is not None), None)
        if self.settings["require_all"]:
            reason = "all of " + ", ".join(f"{p.name} ({d.reason})" for p, d in decisions)
        else:
            policy, decision = decisions[0]
            reason = f"{policy.name}: {decision.reason}"
        return PolicyDecision(True, answer, reason)

    def reset(self) -> None:
        for policy in self.policies:
            policy.reset()

    def get_state(self) -> dict[str, Any]:
        return CompositeState(policies=[p.get_state() for p in self.policies]).model_dump(mode="json")

    def set_state(self, state: dict[str, Any]) -> None:
        saved = state.get("policies", state.get("_policies", []))
        for policy, sub_state in zip(self.policies, saved, strict=False):
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
