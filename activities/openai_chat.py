"""OpenAI-compatible chat completions over plain HTTP: the one request a worker sends to an
OpenAI-compatible model, without the `openai` library.

Why not the library: importing it costs 0.9-1.3 s of CPU on this machine, more than the
rest of a one-off script's start-up put together (BENCHMARKS.md, section 9), and on a
worker's hot path its object model (request transforms, a pydantic model per reply) is a
share of the CPU every call pays. A worker needs one endpoint of it: `POST
{base_url}chat/completions`, JSON in and JSON out. What this module keeps of the library is
what callers can observe: the base URL normalised as the library does it, with its trailing
slash (it names the endpoint in every error); a bearer key and the organisation and project
headers from the environment; redirects followed; no retries of its own (Temporal retries);
one timeout for the whole request; the library's connection pool; a reply read as the library
reads it (a missing field is None, a JSON body is JSON whatever its content type says); and
failures of the same three kinds (a status, a timeout, no connection) with the same fields
and message, so that `model_errors.classify` words them alike. The response hook that reads a
body within its cap (`reply_limits.read_capped_body`) runs as it did.
`tests/test_openai_chat.py` runs both against one scripted server, case for case.

The Anthropic API keeps its own library (`activities/llm.py`); `durable_rlm.clients`, the
rlms-compatible classes, keep `openai` too: they call the model as rlms's clients do.
"""

from __future__ import annotations

import json
import os
import ssl
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import httpx2

from durable_rlm.activities.reply_limits import read_capped_body

DEFAULT_BASE_URL = "https://api.openai.com/v1"
HEADERS_FROM_ENVIRONMENT = (("OpenAI-Organization", "OPENAI_ORG_ID"), ("OpenAI-Project", "OPENAI_PROJECT_ID"))
POOL = httpx2.Limits(max_connections=1000, max_keepalive_connections=100)
"""The library's own pool: a worker may have hundreds of calls in flight to one endpoint."""

_tls_lock = threading.Lock()
_tls: Future[ssl.SSLContext] | None = None


def prepare_tls() -> None:
    """Start building the process's TLS context (the trusted certificates) on a thread of its
    own, once. Loading the certificates costs ~0.15 s, on the first call's path when a client
    builds it there; OpenSSL loads them without holding the GIL, so started with the worker it
    is ready before the first call, for free. Every client of the process shares it, as
    OpenSSL allows (a context is only read once made)."""
    global _tls
    with _tls_lock:
        if _tls is None:
            _tls = Future()
            threading.Thread(target=_build_tls, args=(_tls,), name="drlm-tls-context", daemon=True).start()


def _build_tls(future: Future[ssl.SSLContext]) -> None:
    try:
        future.set_result(httpx2.create_ssl_context())  # the trust store httpx2 would pick itself
    except BaseException as exc:  # noqa: BLE001 - handed to the client that waits for it
        future.set_exception(exc)


def tls_context() -> ssl.SSLContext:
    """The shared TLS context (waiting for it if its thread still runs). One that failed to
    build raises, and is built again by the next client: SSL_CERT_FILE may have been fixed."""
    global _tls
    prepare_tls()
    future = _tls
    assert future is not None
    try:
        return future.result()
    except BaseException:
        if future.done() and future.exception() is not None:  # not an interrupt of the wait
            with _tls_lock:
                if _tls is future:
                    _tls = None
        raise


def _forget_tls_in_child() -> None:
    """A forked child has no thread building its parent's context: it builds its own."""
    global _tls, _tls_lock
    _tls, _tls_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_tls_in_child)


class ChatError(Exception):
    """A chat completion request that failed (one of the kinds below)."""


class StatusError(ChatError):
    """A status other than 2xx. The fields are those of the provider libraries'
    APIStatusError, which `model_errors.classify` reads: `status_code`, `body` (the parsed
    JSON, or the text), `message` (the provider's own message where its body has one), and
    the `response` whose headers may say when to retry."""

    def __init__(self, response: httpx2.Response) -> None:
        self.status_code = response.status_code
        self.response = response
        text = response.text.strip()  # as read: the hook reads only the head of an error body
        self.body: object = text
        self.message = f"Error code: {response.status_code}"
        try:
            self.body = json.loads(text)
        except ValueError:
            pass
        else:
            inner = self.body.get("error", self.body) if isinstance(self.body, dict) else None
            said = inner.get("message") if isinstance(inner, dict) else None
            if isinstance(said, str) and said:
                self.message += f" - {said}"
        super().__init__(self.message)


class RequestTimeout(ChatError):
    """No whole reply within the request's timeout."""


class ConnectionFailed(ChatError):
    """The request did not reach the endpoint, or its connection broke; the transport's
    exception is the cause (`model_errors.connection_cause` names the innermost one)."""


def base_url_of(base_url: str | None) -> httpx2.URL:
    """The endpoint's base URL as the library makes it: the argument, `OPENAI_BASE_URL`, or
    OpenAI's own, parsed (scheme and host in lower case, a default port dropped) and with a
    slash at the end of its path, before any query."""
    url = httpx2.URL(base_url or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL)
    path, sep, query = url.raw_path.partition(b"?")
    return url if path.endswith(b"/") else url.copy_with(raw_path=path + b"/" + sep + query)


class Fields(SimpleNamespace):
    """A JSON object with attribute access; a field the reply left out reads as None, as in
    the library's models (a reply without `usage`, a message without `content`)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy and pickle look these up: absent means absent
            raise AttributeError(name)
        return None


def attributes(value: Any) -> Any:
    """A JSON value with attribute access for its objects (`reply.choices[0].message.content`)."""
    if isinstance(value, dict):
        return Fields(**{str(k): attributes(v) for k, v in value.items()})
    if isinstance(value, list):
        return [attributes(v) for v in value]
    return value


@dataclass
class RawReply:
    """The response as read (within its cap), parsed on demand, as the library's raw
    responses are: `http_response`, and `parse()`."""

    http_response: httpx2.Response

    def parse(self) -> Any:
        """The completion with attribute access. A body declared JSON that is not raises
        ValueError; one declared otherwise is JSON if it parses as JSON, else its text."""
        content_type = self.http_response.headers.get("content-type", "*").split(";")[0]
        if not content_type.endswith("json"):
            try:
                return attributes(json.loads(self.http_response.content))
            except ValueError:
                return self.http_response.text
        return attributes(json.loads(self.http_response.content))


class ChatClient:
    """One endpoint and key; one connection pool, shared by every call of the worker."""

    def __init__(self, api_key: str, base_url: str | None, timeout_s: float) -> None:
        url = base_url_of(base_url)
        self.base_url = str(url)
        self._endpoint = url.copy_with(raw_path=url.raw_path.partition(b"?")[0] + b"chat/completions")
        if url.query:
            self._endpoint = self._endpoint.copy_with(query=url.query)
        headers = {"Authorization": f"Bearer {api_key}", "Accept": "application/json"}
        for header, variable in HEADERS_FROM_ENVIRONMENT:
            if (value := os.environ.get(variable)) is not None:
                headers[header] = value
        self._http = httpx2.AsyncClient(
            timeout=timeout_s,
            headers=headers,
            follow_redirects=True,
            limits=POOL,
            verify=tls_context(),
            event_hooks={"response": [read_capped_body]},
        )

    async def create(self, body: dict[str, Any]) -> RawReply:
        """Send one chat completion request; a status other than 2xx, a timeout or a failed
        connection raises its kind of ChatError."""
        try:
            response = await self._http.post(self._endpoint, json=body)
        except httpx2.TimeoutException as exc:
            raise RequestTimeout("Request timed out.") from exc
        except (httpx2.HTTPError, OSError) as exc:  # OSError: ssl.SSLError and any socket error unwrapped
            raise ConnectionFailed("Connection error.") from exc
        if not response.is_success:
            raise StatusError(response)
        return RawReply(response)

    async def close(self) -> None:
        await self._http.aclose()
