"""durable-rlm: Recursive Language Model episodes as durable Temporal workflows.

The names below are imported on first use, so that `import durable_rlm.store.blobs` (which the
workers' activities do) does not pull in the client and the runtime."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DurableRLM": "durable_rlm.api",
    "Episode": "durable_rlm.api",
    # rlms's API: `from rlm import RLM` becomes `from durable_rlm import RLM`.
    "RLM": "durable_rlm.rlms.compat",
    "RLMLogger": "durable_rlm.rlms.logger",
    "RLMChatCompletion": "durable_rlm.rlms.results",
    "BudgetExceededError": "durable_rlm.rlms.limits",
    "TimeoutExceededError": "durable_rlm.rlms.limits",
    "TokenLimitExceededError": "durable_rlm.rlms.limits",
    "ErrorThresholdExceededError": "durable_rlm.rlms.limits",
    "CancellationError": "durable_rlm.rlms.limits",
    "DurableRLMError": "durable_rlm.errors",
    "ConfigurationError": "durable_rlm.errors",
    "InvalidRequestError": "durable_rlm.errors",
    "EpisodeFailed": "durable_rlm.errors",
    "tool": "durable_rlm.tools",
    "cancel_episode": "durable_rlm.client.episodes",
    # A persistent session (`DurableRLM.session()`, rlms's persistent=True) and its closed error.
    "Session": "durable_rlm.client.sessions",
    "SessionClosed": "durable_rlm.client.sessions",
    "EpisodeResult": "durable_rlm.workflows.models",
    "EpisodeLimits": "durable_rlm.workflows.models",
    "EpisodeRequest": "durable_rlm.workflows.models",
    "ModelSettings": "durable_rlm.workflows.models",
    "ChildEpisode": "durable_rlm.workflows.models",
    "ExecutionResult": "durable_rlm.workflows.fallback",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'durable_rlm' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
