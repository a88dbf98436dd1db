"""durable-rlm: Recursive Language Model episodes as durable Temporal workflows.

The names below are imported on first use, so that `import durable_rlm.blobs` (which the
workers' activities do) does not pull in the client and the runtime."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DurableRLM": "durable_rlm.api",
    "Episode": "durable_rlm.api",
    # rlms's API: `from rlm import RLM` becomes `from durable_rlm import RLM`.
    "RLM": "durable_rlm.rlms_compat",
    "RLMLogger": "durable_rlm.rlms_compat",
    "RLMChatCompletion": "durable_rlm.rlms_compat",
    "BudgetExceededError": "durable_rlm.rlms_compat",
    "TimeoutExceededError": "durable_rlm.rlms_compat",
    "TokenLimitExceededError": "durable_rlm.rlms_compat",
    "ErrorThresholdExceededError": "durable_rlm.rlms_compat",
    "CancellationError": "durable_rlm.rlms_compat",
    "DurableRLMError": "durable_rlm.errors",
    "ConfigurationError": "durable_rlm.errors",
    "InvalidRequestError": "durable_rlm.errors",
    "EpisodeFailed": "durable_rlm.errors",
    "tool": "durable_rlm.tools",
    "cancel_episode": "durable_rlm.episodes",
    "EpisodeResult": "workflows.models",
    "EpisodeLimits": "workflows.models",
    "EpisodeRequest": "workflows.models",
    "ModelSettings": "workflows.models",
    "ChildEpisode": "workflows.models",
    "ExecutionResult": "workflows.fallback",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'durable_rlm' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
