"""OpenAI-compatible chat completions over plain HTTP: the one request a worker sends to an
OpenAI-compatible model, without the `openai` library.

Why not the library: importing it costs 0.9-1.3 s of CPU on this machine, more than the
rest of a one-off script's start-up put together (BENCHMARKS.md, section 9), and on a
worker's hot path its object model (request transforms, a pydantic model per reply) is a
share of the CPU every call pays. A worker needs one endpoint of it: `POST
{base_url}chat/completions`, JSON in and JSON out. What this module keeps of the library is
what callers can observe: the base URL with its trailing slash (it names the endpoint in
every error), a bearer key, no retries of its own (Temporal retries), one timeout for the
whole request, and failures of the same three kinds (a status, a timeout, no connection)
with the same fields, so that `model_errors.classify` words them alike. The response hook
that reads a body within its cap (`reply_limits.read_capped_body`) runs as it did.

The Anthropic API keeps its own library (`activities/llm.py`); `durable_rlm.clients`, the
rlms-compatible classes, keep `openai` too: they call the model as rlms's clients do.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import httpx2

from durable_rlm.activities.reply_limits import read_capped_body

DEFAULT_BASE_URL = "https://api.openai.com/v1"


class ChatError(Exception):
    """A chat completion request that failed (one of the kinds below)."""


class StatusError(ChatError):
    """An HTTP error status. The fields are those of the provider libraries' APIStatusError,
    which `model_errors.classify` reads: `status_code`, `body` (the parsed JSON, or the
    text), `message`, and the `response` whose headers may say when to retry."""

    def __init__(self, response: httpx2.Response, body: object) -> None:
        self.status_code = response.status_code
        self.body = body
        self.response = response
        self.message = f"Error code: {response.status_code} - {body}"
        super().__init__(self.message)


class RequestTimeout(ChatError):
    """No whole reply within the request's timeout."""


class ConnectionFailed(ChatError):
    """The request did not reach the endpoint, or its connection broke; the transport's
    exception is the cause (`model_errors.connection_cause` names the innermost one)."""


def base_url_of(base_url: str | None) -> str:
    """The endpoint's base URL as the library uses it: the argument, `OPENAI_BASE_URL`, or
    OpenAI's own, always ending in one slash."""
    url = base_url or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL
    return url if url.endswith("/") else url + "/"


def attributes(value: Any) -> Any:
    """A JSON value with attribute access for its objects, as the library's models give it
    (`reply.choices[0].message.content`); an absent field is read with getattr's default."""
    if isinstance(value, dict):
        return SimpleNamespace(**{str(k): attributes(v) for k, v in value.items()})
    if isinstance(value, list):
        return [attributes(v) for v in value]
    return value


@dataclass
class RawReply:
    """The response as read (within its cap), parsed on demand, as the library's raw
    responses are: `http_response`, and `parse()`."""

    http_response: httpx2.Response

    def parse(self) -> Any:
        """The completion with attribute access; the text itself for a body that is not
        declared JSON; ValueError for one declared JSON that is not."""
        content_type = self.http_response.headers.get("content-type", "")
        if "json" not in content_type:
            return self.http_response.text
        return attributes(json.loads(self.http_response.content))


class ChatClient:
    """One endpoint and key; one connection pool, shared by every call of the worker."""

    def __init__(self, api_key: str, base_url: str | None, timeout_s: float) -> None:
        self.base_url = base_url_of(base_url)
        self._http = httpx2.AsyncClient(
            timeout=timeout_s,
            headers={"Authorization": f"Bearer {api_key}", "Accept": "application/json"},
            event_hooks={"response": [read_capped_body]},
        )

    async def create(self, body: dict[str, Any]) -> RawReply:
        """Send one chat completion request; an error status, a timeout or a failed
        connection raises its kind of ChatError."""
        try:
            response = await self._http.post(self.base_url + "chat/completions", json=body)
        except httpx2.TimeoutException as exc:
            raise RequestTimeout("Request timed out.") from exc
        except httpx2.HTTPError as exc:
            raise ConnectionFailed("Connection error.") from exc
        if response.status_code >= 400:
            raise StatusError(response, _error_body(response))
        return RawReply(response)

    async def close(self) -> None:
        await self._http.aclose()


def _error_body(response: httpx2.Response) -> object:
    """An error reply's body: its JSON where it is JSON, else its text (as read: the hook
    reads only the head of an error body)."""
    try:
        return json.loads(response.content)
    except ValueError:
        return response.text
