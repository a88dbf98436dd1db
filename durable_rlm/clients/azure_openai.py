"""rlms's `rlm.clients.azure_openai`, for programs whose imports changed from `rlm` to `durable_rlm`."""

from durable_rlm.rlms.clients import AzureOpenAIClient

__all__ = ["AzureOpenAIClient"]
