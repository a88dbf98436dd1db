"""durable-rlm: Recursive Language Model episodes as durable Temporal workflows.

The names below are imported on first use, so that `import durable_rlm.store.blobs` (which the
workers' activities do) does not pull in the client and the runtime."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what a type checker and an IDE see: the same names, from the same modules
    from durable_rlm.api import DurableRLM as DurableRLM
    from durable_rlm.api import Episode as Episode
    from durable_rlm.client.episodes import cancel_episode as cancel_episode
    from durable_rlm.client.sessions import Session as Session
    from durable_rlm.client.sessions import SessionClosed as SessionClosed
    from durable_rlm.errors import ConfigurationError as ConfigurationError
    from durable_rlm.errors import DurableRLMError as DurableRLMError
    from durable_rlm.errors import EpisodeFailed as EpisodeFailed
    from durable_rlm.errors import InvalidRequestError as InvalidRequestError
    from durable_rlm.rlms.compat import RLM as RLM
    from durable_rlm.rlms.limits import BudgetExceededError as BudgetExceededError
    from durable_rlm.rlms.limits import CancellationError as CancellationError
    from durable_rlm.rlms.limits import ErrorThresholdExceededError as ErrorThresholdExceededError
    from durable_rlm.rlms.limits import TimeoutExceededError as TimeoutExceededError
    from durable_rlm.rlms.limits import TokenLimitExceededError as TokenLimitExceededError
    from durable_rlm.rlms.logger import RLMLogger as RLMLogger
    from durable_rlm.rlms.results import RLMChatCompletion as RLMChatCompletion
    from durable_rlm.tools import tool as tool
    from durable_rlm.workflows.fallback import ExecutionResult as ExecutionResult
    from durable_rlm.workflows.models import ChildEpisode as ChildEpisode
    from durable_rlm.workflows.models import EpisodeLimits as EpisodeLimits
    from durable_rlm.workflows.models import EpisodeRequest as EpisodeRequest
    from durable_rlm.workflows.models import EpisodeResult as EpisodeResult
    from durable_rlm.workflows.models import ModelSettings as ModelSettings

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
