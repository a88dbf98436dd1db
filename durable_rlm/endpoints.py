"""Model endpoints: a named model's settings on a base endpoint, and what it needs to be called.

Used where a model is chosen (the Python API, `drlm run`, a fork that changes models), so
that a provider prefix, sampling options and cost reporting mean the same everywhere.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit

from durable_rlm.errors import ConfigurationError
from durable_rlm.workflows.models import ModelSettings

SAMPLING_KEYS = ("temperature", "top_p", "max_tokens", "stop", "extra_body")


def model_settings(
    name: str, base: dict[str, Any], sampling: dict[str, Any] | None = None, provider: str | None = None
) -> ModelSettings:
    """Settings of a named model on the base's endpoint; a provider prefix ("anthropic:") or
    `provider` picks its own provider and key variable."""
    data = dict(base)
    prefix = name.partition(":")[0]
    named = provider or (prefix if prefix in ("openai", "anthropic") else None)
    if named is not None:
        if named != data.get("provider", named):
            # Another provider: the base's endpoint and vendor options are not its own.
            data.pop("base_url", None)
            data.pop("extra_body", None)
        data.pop("provider", None)
        data.pop("api_key_env", None)
    if provider is not None:
        data["provider"] = provider
    unknown = sorted(set(sampling or {}) - set(SAMPLING_KEYS))
    if unknown:
        raise ConfigurationError(
            f"unknown sampling setting(s) {', '.join(unknown)}; known: {', '.join(SAMPLING_KEYS)}"
        )
    return ModelSettings(**{**data, **(sampling or {}), "model": name})


COST_REPORTING_HOSTS = ("openrouter.ai",)
"""Endpoints known to return each call's cost (usage.cost); others say so with reports_cost."""


def cost_reported_by(base_url: str | None) -> bool:
    host = urlsplit(base_url).hostname or "" if base_url else ""
    return any(host == known or host.endswith("." + known) for known in COST_REPORTING_HOSTS)


def missing_key(model: ModelSettings, credentials: dict[str, str]) -> str | None:
    """Why the worker could not call `model` (no key and no local endpoint), or None."""

    def known(name: str) -> bool:
        return bool(credentials.get(name) or os.environ.get(name))

    base_variable = "ANTHROPIC_BASE_URL" if model.provider == "anthropic" else "OPENAI_BASE_URL"
    if model.base_url or known(base_variable) or known(model.api_key_env):
        return None
    return f"no API key for {model.provider} model {model.model!r}: set {model.api_key_env} (or pass api_key)"
