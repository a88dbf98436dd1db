"""rlms's `rlm.clients.openai`, for programs whose imports changed from `rlm` to `durable_rlm`."""

from durable_rlm.rlms.clients import OpenAIClient

__all__ = ["OpenAIClient"]
