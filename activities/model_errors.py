"""Provider errors, mapped to what Temporal should retry: 429, 5xx (Anthropic's 529
included), timeouts, connection failures and replies that are not a completion (not JSON,
no choices) are retryable, honouring `retry-after`; a request the provider rejects
(400/404/422) is not, and says why; a rejected key (401/403) is its own type, so the
workflow can wait for a fixed key instead of ending; a prompt over the context window is
its own type, so the workflow can compact and try again.

Every failure leaves an activity short and without its chain of causes: the server keeps
at most 4 KB of an activity's failure (message, stack traces and causes together) and
replaces a larger one by "Failure exceeds size limit.", losing what went wrong. An httpx
connection error alone chains four exceptions and ~7 KB of stack traces.
"""

from __future__ import annotations

import email.utils
import re
import socket
import ssl
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import Any, Literal

from temporalio.exceptions import ApplicationError, FailureError

from durable_rlm.activities.openai_chat import ConnectionFailed, RequestTimeout, StatusError
from durable_rlm.activities.providers import error_types
from durable_rlm.store.outages import store_problem, store_unavailable
from durable_rlm.workflows import names
from durable_rlm.workflows.models import ModelSettings
from durable_rlm.workflows.parsing import shorten_middle

_NOT_RETRYABLE_STATUS = {400, 404, 413, 422}
_AUTH_STATUS = {401, 403}
# Bounds that keep a failure far under the server's 4 KB (its warning starts at 2 KB): the
# whole message, what the provider said in it, and the head of a body that is not a reply.
MESSAGE_CHARS = 1_000
DETAIL_CHARS = 300
BODY_CHARS = 200
# How providers say "the prompt does not fit": OpenAI's code, and the wording of OpenAI,
# vLLM, llama.cpp, Anthropic and others.
_OVERFLOW_CODES = {"context_length_exceeded", "string_above_max_length"}
_OVERFLOW_TEXT = re.compile(
    r"maximum context length|context[ _-]?length|context window|prompt is too long|too many tokens"
    r"|reduce the length of the messages|exceeds? the (?:model'?s? )?(?:maximum|max) (?:number of )?tokens"
    r"|exceeds? context limit",
    re.IGNORECASE,
)


def retry_after(headers: Mapping[str, str] | None) -> timedelta | None:
    """The provider's requested back-off from `retry-after-ms` or `retry-after`."""
    if not headers:
        return None
    millis = headers.get("retry-after-ms")
    if millis:
        try:
            return timedelta(milliseconds=float(millis))
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return timedelta(seconds=max(0.0, float(value)))
    except ValueError:
        try:
            parsed = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=UTC)
        return max(timedelta(0), parsed - datetime.now(UTC))


def _provider_message(exc: Any) -> str:
    body = exc.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
    return str(exc.message)


def _error_code(exc: Any) -> str | None:
    body = exc.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and isinstance(inner.get("code"), str):
            return inner["code"]
    return None


def is_context_overflow(exc: Any) -> bool:
    if exc.status_code not in (400, 413, 422):
        return False
    return _error_code(exc) in _OVERFLOW_CODES or bool(_OVERFLOW_TEXT.search(_provider_message(exc)))


def clip(text: str, limit: int = MESSAGE_CHARS) -> str:
    """At most `limit` characters, head and tail kept: the cause comes first in our messages."""
    return shorten_middle(text, limit)


def auth_failed(settings: ModelSettings, base_url: str | None, problem: str) -> ApplicationError:
    """A key the provider refuses, or none: not retried, since only a fixed key helps; the
    workflow waits for one (names.MODEL_AUTH_FAILED) instead of ending the episode."""
    where = f"model {settings.model!r}" + (f" at {base_url}" if base_url else "")
    return ApplicationError(
        clip(f"authentication failed for {where}: {problem}"),
        type=names.MODEL_AUTH_FAILED,
        non_retryable=True,
    )


def bad_reply(settings: ModelSettings, base_url: str, what: str, body: str) -> ApplicationError:
    """HTTP 200 with something that is not a completion (a proxy's HTML page, a truncated
    body, JSON without choices): a provider fault, retried like a 5xx."""
    head = body[:BODY_CHARS] + ("..." if len(body) > BODY_CHARS else "")
    quoted = f": {head!r}" if body else " (an empty body)"
    return ApplicationError(
        f"model {settings.model!r} at {base_url} returned {what}{quoted}", type=names.MODEL_BAD_REPLY
    )


def connection_cause(exc: BaseException) -> str:
    """What really failed under a client's "Connection error.": the chain's innermost cause."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    for error in chain:
        if isinstance(error, ConnectionRefusedError):
            return "connection refused"
        if isinstance(error, socket.gaierror):
            return f"the host name does not resolve ({error})"
        if isinstance(error, ssl.SSLError):
            return f"TLS failed ({error})"
    innermost = next((e for e in reversed(chain) if str(e)), exc)
    return clip(f"{type(innermost).__name__}: {innermost}", DETAIL_CHARS)


def classify(exc: BaseException, settings: ModelSettings, base_url: str) -> ApplicationError:
    """Turn a client exception into the error Temporal should (or should not) retry, its
    message cause first and bounded. Raise it `from None`: the chain would not fit."""
    where = f"model {settings.model!r} at {base_url}"
    if isinstance(exc, (StatusError, *error_types("APIStatusError"))):
        failed: Any = exc  # ours (openai_chat.py) or anthropic's: both have these fields
        status = failed.status_code
        detail = clip(_provider_message(exc), DETAIL_CHARS)
        if is_context_overflow(exc):
            return ApplicationError(
                f"{where} rejected the request: it exceeds the model's context window: {detail}",
                type=names.MODEL_CONTEXT_OVERFLOW,
                non_retryable=True,
            )
        if status in _AUTH_STATUS:
            env = settings.api_key_env
            hint = (
                f"check {env} or --api-key of the worker"
                if status == 401
                else f"the key in {env} may not use this model or endpoint"
            )
            return auth_failed(settings, base_url, f"HTTP {status}: {detail} ({hint})")
        if status in _NOT_RETRYABLE_STATUS:
            hint = {404: "unknown model or wrong base URL"}.get(status, "the request was rejected")
            return ApplicationError(
                f"{where} rejected the request: HTTP {status} ({hint}): {detail}",
                type=names.MODEL_REQUEST_REJECTED,
                non_retryable=True,
            )
        return ApplicationError(
            f"{where} failed: HTTP {status}: {detail}",
            type=names.MODEL_UNAVAILABLE,
            next_retry_delay=retry_after(failed.response.headers if failed.response else None),
        )
    if isinstance(exc, (RequestTimeout, *error_types("APITimeoutError"))):
        return ApplicationError(
            f"{where} timed out after {settings.request_timeout_s:g} s (request_timeout_s)",
            type=names.MODEL_UNAVAILABLE,
        )
    if isinstance(exc, (ConnectionFailed, *error_types("APIConnectionError"))):
        return ApplicationError(
            f"cannot reach {where}: {connection_cause(exc)}", type=names.MODEL_UNAVAILABLE
        )
    return ApplicationError(clip(f"{where}: {type(exc).__name__}: {exc}"), type=names.MODEL_UNAVAILABLE)


class compact_failures:  # noqa: N801 - used as a context manager, like contextlib's
    """`with compact_failures():` (or `async with`) around an activity's body: whatever it
    raises leaves as one ApplicationError with a bounded message, its type, retry flags and
    details kept, and no chain of causes. Cancellation passes through untouched."""

    def __enter__(self) -> compact_failures:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        if exc is None or not isinstance(exc, Exception):
            return False  # asyncio's CancelledError is a BaseException: an activity cancelled
        if isinstance(exc, ApplicationError):
            problem = store_problem(exc.__cause__) if exc.__cause__ is not None else None
            if problem is not None and exc.type != names.STORE_UNAVAILABLE:
                raise store_unavailable(problem) from None  # raised from a store failure
            chained = exc.__cause__ is not None or (
                exc.__context__ is not None and not exc.__suppress_context__
            )
            if len(exc.message) <= MESSAGE_CHARS and not chained:
                return False
            raise ApplicationError(
                clip(exc.message),
                *exc.details,
                type=exc.type,
                non_retryable=exc.non_retryable,
                next_retry_delay=exc.next_retry_delay,
                category=exc.category,
            ) from None
        if isinstance(exc, FailureError):
            return False  # Temporal's own (a cancellation): its shape matters to the SDK
        problem = store_problem(exc)
        if problem is not None:
            raise store_unavailable(problem) from None  # waited out by the workflow
        # As the SDK would convert it (type = class name, retryable), minus the chain.
        raise ApplicationError(clip(f"{type(exc).__name__}: {exc}"), type=type(exc).__name__) from None

    async def __aenter__(self) -> compact_failures:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        return self.__exit__(kind, exc, tb)
