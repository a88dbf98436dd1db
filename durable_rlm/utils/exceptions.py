"""rlms's `rlm.utils.exceptions`, for programs whose imports changed from `rlm` to `durable_rlm`."""

from durable_rlm.rlms.limits import (
    BudgetExceededError,
    CancellationError,
    ErrorThresholdExceededError,
    TimeoutExceededError,
    TokenLimitExceededError,
)

__all__ = [
    "BudgetExceededError",
    "CancellationError",
    "ErrorThresholdExceededError",
    "TimeoutExceededError",
    "TokenLimitExceededError",
]
