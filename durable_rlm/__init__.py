"""durable-rlm: Recursive Language Model episodes as durable Temporal workflows.

The names below are imported on first use, so that `import durable_rlm.store.blobs` (which the
workers' activities do) does not pull in the client and the runtime."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

# The deterministic code, the activities and the migrations are `durable_rlm.workflows`,
# `durable_rlm.activities` and `durable_rlm.migrations` wherever they run. The wheel installs
# them inside this package (pyproject's package-dir), so nothing it installs can shadow a
# user's own `workflows`; a source checkout (the repository, an editable install, a mutation
# run's copy of the tree) keeps them in its top-level folders, which are searched here after
# this package's own folder.
_CHECKOUT = Path(__file__).resolve().parent.parent
if not Path(__file__).with_name("workflows").is_dir() and (_CHECKOUT / "workflows" / "__init__.py").is_file():
    __path__.append(str(_CHECKOUT))  # noqa: F821 -- a package's own __path__

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
