"""rlms's model clients (rlm/clients/): `get_client(backend, backend_kwargs)` and the classes
an rlms program constructs itself, calling the model as rlms's do: `completion(prompt,
model=None)` with a string or a list of messages, its async twin, and the usage each keeps
per model.

These are plain clients, for programs that call a model directly (as rlms's `lm_in_repl`
example does); an episode's own calls go through the workers, durably. Every backend rlms
0.1.3 names is here: the OpenAI-compatible ones through the openai client at their
default endpoints and key variables (options.BACKENDS), Anthropic through its own, Gemini
and Portkey through their OpenAI-compatible endpoints.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections import defaultdict
from typing import Any

from durable_rlm.errors import ConfigurationError
from durable_rlm.rlms.options import BACKENDS
from durable_rlm.rlms.results import ModelUsageSummary, UsageSummary

DEFAULT_TIMEOUT: float = 300.0  # rlms's: seconds per model request


class BaseLM(ABC):
    """rlms's client interface; subclasses keep per-model usage in `_usage`."""

    def __init__(
        self,
        model_name: str | None,
        timeout: float = DEFAULT_TIMEOUT,
        sampling_args: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.model_name = model_name
        self.timeout = timeout
        self.sampling_args: dict[str, Any] = dict(sampling_args or {})
        self.kwargs = kwargs
        self._calls: dict[str, int] = defaultdict(int)
        self._tokens_in: dict[str, int] = defaultdict(int)
        self._tokens_out: dict[str, int] = defaultdict(int)
        self._costs: dict[str, float] = defaultdict(float)
        self.last_prompt_tokens = 0
        self.last_completion_tokens = 0
        self.last_cost: float | None = None

    @abstractmethod
    def completion(self, prompt: str | list[dict[str, Any]], model: str | None = None) -> str:
        raise NotImplementedError

    @abstractmethod
    async def acompletion(self, prompt: str | list[dict[str, Any]], model: str | None = None) -> str:
        raise NotImplementedError

    def get_usage_summary(self) -> UsageSummary:
        return UsageSummary(
            {
                model: ModelUsageSummary(
                    calls, self._tokens_in[model], self._tokens_out[model], self._costs.get(model) or None
                )
                for model, calls in self._calls.items()
            }
        )

    def get_last_usage(self) -> ModelUsageSummary:
        return ModelUsageSummary(1, self.last_prompt_tokens, self.last_completion_tokens, self.last_cost)

    def _model(self, model: str | None) -> str:
        chosen = model or self.model_name
        if not chosen:
            raise ValueError(f"Model name is required for {type(self).__name__}.")
        return chosen

    def _count(self, model: str, tokens_in: int, tokens_out: int, cost: float | None) -> None:
        self._calls[model] += 1
        self._tokens_in[model] += tokens_in
        self._tokens_out[model] += tokens_out
        self.last_prompt_tokens, self.last_completion_tokens = tokens_in, tokens_out
        self.last_cost = cost if cost else None
        if cost:
            self._costs[model] += cost


def messages_of(prompt: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A prompt as chat messages: a string is one user message, as in rlms."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and all(isinstance(item, dict) for item in prompt):
        return prompt
    raise ValueError(f"Invalid prompt type: {type(prompt)}")


def reported_cost(usage: Any) -> float | None:
    """The call's cost in USD where the provider reports it (usage.cost: OpenRouter, LiteLLM
    proxies, Portkey), as rlms reads it."""
    cost = getattr(usage, "cost", None)
    extra = getattr(usage, "model_extra", None) or {}
    if not cost:
        cost = extra.get("cost") or (extra.get("cost_details") or {}).get("upstream_inference_cost")
    return float(cost) if isinstance(cost, int | float) and cost > 0 else None


class OpenAIClient(BaseLM):
    """Any OpenAI-compatible endpoint. Other keyword arguments (default_headers,
    max_retries...) go to the openai client, as rlms passes them."""

    key_env = "OPENAI_API_KEY"

    def __init__(
        self,
        api_key: str | None = None,
        model_name: str | None = None,
        base_url: str | None = None,
        sampling_args: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(model_name, sampling_args=sampling_args, **kwargs)
        import openai  # start-up: the client library loads only when a program builds one

        options = {k: v for k, v in self.kwargs.items() if k != "timeout"}
        self.base_url = base_url
        self.client = openai.OpenAI(
            api_key=api_key or os.environ.get(self.key_env),
            base_url=base_url,
            timeout=self.timeout,
            **options,
        )
        self.async_client = openai.AsyncOpenAI(
            api_key=api_key or os.environ.get(self.key_env),
            base_url=base_url,
            timeout=self.timeout,
            **options,
        )

    def _request(self, prompt: str | list[dict[str, Any]], model: str | None) -> dict[str, Any]:
        sampling = dict(self.sampling_args)
        extra_body = sampling.pop("extra_body", None) or {}
        if "max_tokens" in sampling:  # rlms's rename, for reasoning models
            sampling["max_completion_tokens"] = sampling.pop("max_tokens")
        request = {"model": self._model(model), "messages": messages_of(prompt), **sampling}
        if extra_body:
            request["extra_body"] = extra_body
        return {k: v for k, v in request.items() if v is not None}

    def _reply(self, response: Any, model: str) -> str:
        usage = getattr(response, "usage", None)
        if usage is None:
            raise ValueError("No usage data received. Tracking tokens not possible.")
        self._count(model, usage.prompt_tokens, usage.completion_tokens, reported_cost(usage))
        text: str = response.choices[0].message.content  # as rlms's client returns it
        return text

    def completion(self, prompt: str | list[dict[str, Any]], model: str | None = None) -> str:
        request = self._request(prompt, model)
        return self._reply(self.client.chat.completions.create(**request), request["model"])

    async def acompletion(self, prompt: str | list[dict[str, Any]], model: str | None = None) -> str:
        request = self._request(prompt, model)
        return self._reply(await self.async_client.chat.completions.create(**request), request["model"])


class PortkeyClient(OpenAIClient):
    """Portkey's gateway, through its OpenAI-compatible endpoint with the Portkey key."""

    key_env = "PORTKEY_API_KEY"

    def __init__(
        self,
        api_key: str | None = None,
        model_name: str | None = None,
        base_url: str | None = "https://api.portkey.ai/v1",
        **kwargs: Any,
    ) -> None:
        super().__init__(api_key=api_key, model_name=model_name, base_url=base_url, **kwargs)


class GeminiClient(OpenAIClient):
    """Gemini through Google's OpenAI-compatible endpoint (rlms uses google-genai)."""

    key_env = "GEMINI_API_KEY"

    def __init__(
        self, api_key: str | None = None, model_name: str | None = "gemini-2.5-flash", **kwargs: Any
    ) -> None:
        kwargs.setdefault("base_url", BACKENDS["gemini"].base_url)
        super().__init__(api_key=api_key, model_name=model_name, **kwargs)


class AzureOpenAIClient(OpenAIClient):
    """Azure OpenAI through its OpenAI-compatible v1 endpoint (<endpoint>/openai/v1/)."""

    key_env = "AZURE_OPENAI_API_KEY"

    def __init__(
        self,
        api_key: str | None = None,
        model_name: str | None = None,
        azure_endpoint: str | None = None,
        api_version: str | None = None,
        azure_deployment: str | None = None,
        **kwargs: Any,
    ) -> None:
        endpoint = azure_endpoint or os.environ.get("AZURE_OPENAI_ENDPOINT")
        if endpoint is None:
            raise ValueError(
                "azure_endpoint is required for Azure OpenAI client. "
                "Set it via argument or AZURE_OPENAI_ENDPOINT environment variable."
            )
        deployment = azure_deployment or os.environ.get("AZURE_OPENAI_DEPLOYMENT")
        base_url = endpoint.rstrip("/") + "/openai/v1/"
        super().__init__(api_key=api_key, model_name=model_name or deployment, base_url=base_url, **kwargs)
        self.azure_deployment = deployment


class AnthropicClient(BaseLM):
    """Anthropic's Messages API; a system message becomes its `system`."""

    def __init__(
        self,
        api_key: str | None = None,
        model_name: str | None = None,
        max_tokens: int = 32768,
        **kwargs: Any,
    ) -> None:
        super().__init__(model_name, **kwargs)
        import anthropic  # start-up: the client library loads only when a program builds one

        key = api_key or os.environ.get("ANTHROPIC_API_KEY")
        self.client = anthropic.Anthropic(api_key=key, timeout=self.timeout)
        self.async_client = anthropic.AsyncAnthropic(api_key=key, timeout=self.timeout)
        self.max_tokens = max_tokens

    def _request(self, prompt: str | list[dict[str, Any]], model: str | None) -> dict[str, Any]:
        messages = messages_of(prompt)
        system = [m.get("content") for m in messages if m.get("role") == "system"]
        request: dict[str, Any] = {
            "model": self._model(model),
            "max_tokens": self.max_tokens,
            "messages": [m for m in messages if m.get("role") != "system"],
            **self.sampling_args,
        }
        if system:
            request["system"] = system[-1]
        return request

    def _reply(self, response: Any, model: str) -> str:
        self._count(model, response.usage.input_tokens, response.usage.output_tokens, None)
        text: str = response.content[0].text  # as rlms's client returns it
        return text

    def completion(self, prompt: str | list[dict[str, Any]], model: str | None = None) -> str:
        request = self._request(prompt, model)
        return self._reply(self.client.messages.create(**request), request["model"])

    async def acompletion(self, prompt: str | list[dict[str, Any]], model: str | None = None) -> str:
        request = self._request(prompt, model)
        return self._reply(await self.async_client.messages.create(**request), request["model"])


def get_client(backend: str, backend_kwargs: dict[str, Any] | None) -> BaseLM:
    """rlms's `get_client`: the client of an rlms backend name, with its default endpoint."""
    kwargs = dict(backend_kwargs or {})
    spec = BACKENDS.get(backend)
    if spec is None:
        raise ConfigurationError(f"Unknown backend: {backend}. Supported backends: {sorted(BACKENDS)}")
    if backend == "anthropic":
        return AnthropicClient(**kwargs)
    if backend == "portkey":
        return PortkeyClient(**kwargs)
    if backend == "gemini":
        return GeminiClient(**kwargs)
    if backend == "azure_openai":
        return AzureOpenAIClient(**kwargs)
    if spec.needs_base_url and not kwargs.get("base_url"):
        raise ConfigurationError(f"backend {backend!r}: backend_kwargs needs base_url (the server's address)")
    if spec.base_url is not None:
        kwargs.setdefault("base_url", spec.base_url)
    if spec.key_env != "OPENAI_API_KEY" and not kwargs.get("api_key"):
        kwargs["api_key"] = os.environ.get(spec.key_env)
    return OpenAIClient(**kwargs)
