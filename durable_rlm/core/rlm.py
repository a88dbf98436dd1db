"""rlms's `rlm.core.rlm`, for programs whose imports changed from `rlm` to `durable_rlm`."""

from durable_rlm.rlms.compat import RLM

__all__ = ["RLM"]
