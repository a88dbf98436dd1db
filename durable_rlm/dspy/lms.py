"""A DSPy LM as a model here: `dspy.LM("openai/gpt-4o-mini", api_base=..., api_key=...)`
becomes the model name, provider, endpoint, key and sampling our providers call.

DSPy reaches models through LiteLLM's provider prefixes; the workers here call them with
the `openai` client (any OpenAI-compatible server) or the `anthropic` one. A prefix with no
such road is refused with what works, never sent somewhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import dspy

from durable_rlm.errors import ConfigurationError


@dataclass(frozen=True)
class Road:
    """How a LiteLLM provider prefix reaches its model here."""

    provider: str
    base_url: str | None
    key_env: str
    reports_cost: bool = False


ROADS = {
    "openai": Road("openai", None, "OPENAI_API_KEY"),
    "anthropic": Road("anthropic", None, "ANTHROPIC_API_KEY"),
    "openrouter": Road("openai", "https://openrouter.ai/api/v1", "OPENROUTER_API_KEY", reports_cost=True),
    # LiteLLM's own OpenAI-compatible roads: a vLLM server and a LiteLLM proxy.
    "hosted_vllm": Road("openai", None, "OPENAI_API_KEY"),
    "litellm_proxy": Road("openai", None, "LITELLM_API_KEY", reports_cost=True),
}

SAMPLING = ("temperature", "max_tokens", "top_p", "stop")
"""The LM's settings that reach the model; DSPy's own (cache, num_retries, rollout_id...)
stay DSPy's."""


@dataclass(frozen=True)
class Endpoint:
    model: str
    """The model's name as DurableRLM takes it (an Anthropic model carries its prefix)."""
    road: Road
    base_url: str | None
    api_key: str | None
    sampling: dict[str, Any] = field(default_factory=dict)


def endpoint_of(lm: Any, what: str = "the LM") -> Endpoint:
    """The endpoint `lm` (a dspy.LM) calls; anything else is a ConfigurationError that says
    what works."""
    if not isinstance(lm, dspy.LM):
        raise ConfigurationError(
            f"{what} is a {type(lm).__name__}: durable_rlm.dspy.RLM calls its models from the "
            'workers, so it needs a dspy.LM ("openai/NAME", api_base=..., api_key=...)'
        )
    if lm.model_type != "chat":
        raise ConfigurationError(
            f"{what} has model_type {lm.model_type!r}: durable_rlm.dspy.RLM calls chat models"
        )
    prefix, slash, name = str(lm.model).partition("/")
    if not slash:
        prefix, name = "openai", prefix  # LiteLLM's default provider
    road = ROADS.get(prefix)
    if road is None:
        raise ConfigurationError(
            f"{what} {lm.model!r}: provider {prefix!r} has no road here; durable_rlm.dspy.RLM speaks "
            f"{', '.join(ROADS)} (any OpenAI-compatible server: 'openai/NAME' with api_base)"
        )
    kwargs: dict[str, Any] = dict(lm.kwargs)
    sampling = {key: kwargs[key] for key in SAMPLING if kwargs.get(key) is not None}
    if kwargs.get("max_completion_tokens") is not None:  # DSPy's name for reasoning models
        sampling.setdefault("max_tokens", kwargs["max_completion_tokens"])
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    base_url = kwargs.get("api_base") or kwargs.get("base_url") or road.base_url
    model = f"anthropic:{name}" if road.provider == "anthropic" else name
    return Endpoint(model, road, base_url, kwargs.get("api_key"), sampling)
