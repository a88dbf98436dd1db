"""rlms's options in durable-rlm's terms: an rlms backend (and its backend_kwargs) as a model
behind an OpenAI-compatible or Anthropic endpoint, and rlms's constructor arguments as
DurableRLM's. What cannot work in a durable, sandboxed runtime is a ConfigurationError that
says what works, never ignored."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from durable_rlm.errors import ConfigurationError
from durable_rlm.request_template import RunOptions
from durable_rlm.rlms.prompts import composed_system_prompt
from durable_rlm.rlms.windows import context_window
from durable_rlm.workflows.rlms_limits import RLMS_LIMITS_POLICY


@dataclass(frozen=True)
class Backend:
    """How an rlms backend reaches a model here: provider, default endpoint, key variable."""

    provider: str
    base_url: str | None
    key_env: str
    needs_base_url: bool = False
    reports_cost: bool = False  # usage.cost in each reply: max_budget needs no price table


BACKENDS = {
    "openai": Backend("openai", None, "OPENAI_API_KEY"),
    "vllm": Backend("openai", None, "OPENAI_API_KEY", needs_base_url=True),
    "litellm": Backend("openai", None, "LITELLM_API_KEY", needs_base_url=True, reports_cost=True),
    "openrouter": Backend("openai", "https://openrouter.ai/api/v1", "OPENROUTER_API_KEY", reports_cost=True),
    "vercel": Backend("openai", "https://ai-gateway.vercel.sh/v1", "AI_GATEWAY_API_KEY"),
    "gemini": Backend("openai", "https://generativelanguage.googleapis.com/v1beta/openai/", "GEMINI_API_KEY"),
    # Azure's v1 API is OpenAI-compatible at <endpoint>/openai/v1/ (azure_endpoint below).
    "azure_openai": Backend("openai", None, "AZURE_OPENAI_API_KEY"),
    "anthropic": Backend("anthropic", None, "ANTHROPIC_API_KEY"),
    # Portkey's gateway is OpenAI-compatible; its key goes as the bearer token.
    "portkey": Backend("openai", "https://api.portkey.ai/v1", "PORTKEY_API_KEY"),
}
ENVIRONMENTS = ("local",)
UNCAPPED_LLM_CALLS = 1_000_000_000


@dataclass(frozen=True)
class ModelChoice:
    name: str
    provider: str
    base_url: str | None
    key_env: str
    api_key: str | None
    sampling: dict[str, Any] = field(default_factory=dict)
    reports_cost: bool = False


def model_choice(backend: str, kwargs: dict[str, Any] | None, what: str = "backend") -> ModelChoice:
    """An rlms (backend, backend_kwargs) pair as a model here; what cannot work is a
    ConfigurationError naming what does."""
    spec = BACKENDS.get(backend)
    if spec is None:
        raise ConfigurationError(
            f"{what} {backend!r} is not available: durable-rlm speaks {', '.join(BACKENDS)} "
            "(any OpenAI-compatible server: backend='openai' with backend_kwargs base_url)"
        )
    data = dict(kwargs or {})
    name = data.pop("model_name", None) or data.pop("azure_deployment", None)
    if name is None and backend == "gemini":
        name = "gemini-2.5-flash"  # rlms's GeminiClient default
    if not name:
        raise ConfigurationError(f"{what} {backend!r}: backend_kwargs needs model_name")
    base_url = data.pop("base_url", None) or spec.base_url
    endpoint = data.pop("azure_endpoint", None) or os.environ.get("AZURE_OPENAI_ENDPOINT")
    data.pop("api_version", None)  # the v1 endpoint takes none
    if backend == "azure_openai" and base_url is None:
        if not endpoint:
            raise ConfigurationError(
                "backend 'azure_openai': backend_kwargs needs azure_endpoint (or AZURE_OPENAI_ENDPOINT); "
                "it is reached through Azure's OpenAI-compatible v1 endpoint"
            )
        base_url = endpoint.rstrip("/") + "/openai/v1/"
    if spec.needs_base_url and not base_url:
        raise ConfigurationError(f"{what} {backend!r}: backend_kwargs needs base_url (the server's address)")
    api_key = data.pop("api_key", None)
    sampling = dict(data.pop("sampling_args", None) or {})
    if "max_tokens" in data:  # rlms's AnthropicClient takes the reply's max_tokens here
        sampling.setdefault("max_tokens", data.pop("max_tokens"))
    data.pop("timeout", None)  # the request timeout is DurableRLM's request_timeout_s
    if data:
        raise ConfigurationError(
            f"{what} {backend!r}: backend_kwargs {', '.join(sorted(data))} are not used here "
            "(known: model_name, base_url, api_key, sampling_args; azure_endpoint for azure_openai)"
        )
    return ModelChoice(name, spec.provider, base_url, spec.key_env, api_key, sampling, spec.reports_cost)


def prefixed(choice: ModelChoice) -> str:
    """The model's name as DurableRLM takes it (the provider is in the prefix)."""
    return f"anthropic:{choice.name}" if choice.provider == "anthropic" else choice.name


@dataclass(frozen=True)
class Translation:
    """rlms's constructor arguments as DurableRLM's options, the root model's key, and the
    models chosen."""

    root: ModelChoice
    sub: ModelChoice | None
    options: RunOptions
    api_key: str | None


def refuse_what_does_not_fit(environment: str, depth: int, user_prologue: str | None) -> None:
    """rlms options that have no meaning here, each refused with what works."""
    if environment not in ENVIRONMENTS:
        raise ConfigurationError(
            f"environment {environment!r} is not available: durable-rlm runs the REPL in its own "
            "sandboxed process (environment='local')"
        )
    if depth != 0:
        raise ConfigurationError("depth is rlms's own bookkeeping for child RLMs: leave it 0")
    if user_prologue is not None:
        raise ConfigurationError("user_prologue is not available: put it in root_prompt")


def translate(
    *,
    backend: str,
    backend_kwargs: dict[str, Any] | None,
    environment_kwargs: dict[str, Any] | None,
    max_depth: int,
    max_iterations: int,
    max_budget: float | None,
    max_timeout: float | None,
    max_tokens: int | None,
    max_errors: int | None,
    custom_system_prompt: str | None,
    other_backends: list[str] | None,
    other_backend_kwargs: list[dict[str, Any]] | None,
    custom_tools: dict[str, Any] | None,
    custom_sub_tools: dict[str, Any] | None,
    compaction: bool,
    compaction_threshold_pct: float,
    max_concurrent_subcalls: int,
    sampling_args: dict[str, Any] | None,
    sub_sampling_args: dict[str, Any] | None,
    orchestrator: bool = True,
) -> Translation:
    """rlms's arguments as DurableRLM's: the models, the limits, max_errors as a policy."""
    env_kwargs = dict(environment_kwargs or {})
    setup_code = env_kwargs.pop("setup_code", None)
    if env_kwargs:
        raise ConfigurationError(
            f"environment_kwargs {', '.join(sorted(env_kwargs))} are not used here (known: setup_code)"
        )
    if other_backends is not None and len(other_backends) != 1:
        # rlms's own rule: one other backend, the model of the sub-calls.
        raise ConfigurationError("other_backends takes one backend: the model for the sub-calls")
    root = model_choice(backend, backend_kwargs)
    sub = None
    if other_backends:
        kwargs = (other_backend_kwargs or [{}])[0]
        sub = model_choice(other_backends[0], kwargs, what="other backend")
    sampling = {**root.sampling, **(sampling_args or {})}
    sub_sampling = {**(sub.sampling if sub else {}), **(sub_sampling_args or {})} or None
    limits: dict[str, Any] = {
        "max_iterations": max_iterations,
        "max_parallel_subcalls": max_concurrent_subcalls,
        # rlms has no cap on sub-calls: its own limits (tokens, budget, time) bound them.
        "max_llm_calls": UNCAPPED_LLM_CALLS,
    }
    if max_timeout is not None:
        limits["max_duration"] = timedelta(seconds=max_timeout)
    if compaction:
        # rlms's window for the model (its table), its share; rlms's `history` list from the start.
        limits["context_window_tokens"] = context_window(root.name)
        limits["compact_at"] = compaction_threshold_pct
        setup_code = "\n".join(c for c in ("history = []", setup_code) if c)
    policy, policy_config = "final_pattern", None
    checked = {"max_errors": max_errors, "max_budget": max_budget, "max_tokens": max_tokens}
    if any(value is not None for value in checked.values()):
        # Checked after each iteration, before the answer, as rlms checks them.
        policy = "composite"
        policy_config = {"policies": [{"name": RLMS_LIMITS_POLICY, "config": checked}, "final_pattern"]}
    options = RunOptions.of(
        prefixed(root),
        {
            "base_url": root.base_url,
            "sub_model": prefixed(sub) if sub else None,
            "sub_base_url": sub.base_url if sub else None,
            "max_depth": max_depth,
            "limits": limits,
            "policy": policy,
            "policy_config": policy_config,
            "tools": custom_tools or [],
            "sub_tools": custom_sub_tools,
            "system_prompt": system_prompt(custom_system_prompt, custom_tools, orchestrator),
            "setup_code": setup_code,
            "sampling": sampling or None,
            "sub_sampling": sub_sampling,
            "reports_cost": root.reports_cost or None,
        },
    )
    return Translation(root, sub, options, root.api_key)


def system_prompt(
    template: str | None, custom_tools: dict[str, Any] | None, orchestrator: bool
) -> str | None:
    """rlms's system message for a custom_system_prompt (durable_rlm/rlms/prompts.py); None
    keeps durable-rlm's own prompt."""
    if template is None:
        return None
    try:
        return composed_system_prompt(template, custom_tools, orchestrator)
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigurationError(
            f"custom_system_prompt is a str.format template with only {{custom_tools_section}} "
            f"in braces (as rlms formats it); write other braces doubled: {exc!r}"
        ) from None


def run_metadata(
    root: ModelChoice,
    backend: str,
    backend_kwargs: dict[str, Any] | None,
    environment: str,
    environment_kwargs: dict[str, Any] | None,
    max_depth: int,
    max_iterations: int,
    other_backends: list[str] | None,
) -> dict[str, Any]:
    """rlms's RLMMetadata as a dict (the logger's first line), keys left out."""
    return {
        "root_model": root.name,
        "max_depth": max_depth,
        "max_iterations": max_iterations,
        "backend": backend,
        "backend_kwargs": _keyless(backend_kwargs),
        "environment_type": environment,
        "environment_kwargs": _keyless(environment_kwargs),
        "other_backends": other_backends,
    }


def _keyless(data: dict[str, Any] | None) -> dict[str, Any]:
    """rlms's filter_sensitive_keys: no key whose name says "api" and "key"."""
    return {k: v for k, v in (data or {}).items() if not ("api" in k.lower() and "key" in k.lower())}
