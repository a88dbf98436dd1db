"""rlms's `rlm.logger.rlm_logger`, for programs whose imports changed from `rlm` to `durable_rlm`."""

from durable_rlm.rlms.logger import RLMLogger

__all__ = ["RLMLogger"]
