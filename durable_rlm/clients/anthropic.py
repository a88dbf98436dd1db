"""rlms's `rlm.clients.anthropic`, for programs whose imports changed from `rlm` to `durable_rlm`."""

from durable_rlm.rlms.clients import AnthropicClient

__all__ = ["AnthropicClient"]
