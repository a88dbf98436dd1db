"""rlms's `rlm.core.types`, for programs whose imports changed from `rlm` to `durable_rlm`."""

from durable_rlm.rlms.results import ModelUsageSummary, RLMChatCompletion, UsageSummary
from durable_rlm.rlms.types import (
    ClientBackend,
    CodeBlock,
    EnvironmentType,
    QueryMetadata,
    REPLResult,
    RLMIteration,
    RLMMetadata,
    json_value,
)

_serialize_value = json_value  # rlms's own tests import it under this name

__all__ = [
    "ClientBackend",
    "CodeBlock",
    "EnvironmentType",
    "ModelUsageSummary",
    "QueryMetadata",
    "REPLResult",
    "RLMChatCompletion",
    "RLMIteration",
    "RLMMetadata",
    "UsageSummary",
]
