"""rlms's `rlm.core.lm_handler`, for programs whose imports changed from `rlm` to `durable_rlm`."""

from durable_rlm.rlms.lm_handler import LMHandler

__all__ = ["LMHandler"]
