"""rlms's `rlm.clients.base_lm`, for programs whose imports changed from `rlm` to `durable_rlm`."""

from durable_rlm.rlms.clients import DEFAULT_TIMEOUT, BaseLM

__all__ = ["DEFAULT_TIMEOUT", "BaseLM"]
