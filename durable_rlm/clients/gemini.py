"""rlms's `rlm.clients.gemini`, for programs whose imports changed from `rlm` to `durable_rlm`."""

from durable_rlm.rlms.clients import GeminiClient

__all__ = ["GeminiClient"]
