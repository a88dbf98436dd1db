"""Provider errors, mapped to what Temporal should retry: 429, 5xx (Anthropic's 529
included), timeouts and connection failures are retryable, honouring `retry-after`; a
request the provider rejects (400/401/403/404/422) is not, and says why; a prompt over the
context window is its own type, so the workflow can compact and try again.
"""

from __future__ import annotations

import email.utils
import re
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import anthropic
import openai
from temporalio.exceptions import ApplicationError

from workflows import names
from workflows.models import ModelSettings

_NOT_RETRYABLE_STATUS = {400, 401, 403, 404, 413, 422}
# How providers say "the prompt does not fit": OpenAI's code, and the wording of OpenAI,
# vLLM, llama.cpp, Anthropic and others.
_OVERFLOW_CODES = {"context_length_exceeded", "string_above_max_length"}
_OVERFLOW_TEXT = re.compile(
    r"maximum context length|context[ _-]?length|context window|prompt is too long|too many tokens"
    r"|reduce the length of the messages|exceeds? the (?:model'?s? )?(?:maximum|max) (?:number of )?tokens"
    r"|exceeds? context limit",
    re.IGNORECASE,
)
StatusError = (openai.APIStatusError, anthropic.APIStatusError)
TimeoutErrors = (openai.APITimeoutError, anthropic.APITimeoutError)
ConnectionErrors = (openai.APIConnectionError, anthropic.APIConnectionError)


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


def classify(exc: Exception, settings: ModelSettings, base_url: str) -> ApplicationError:
    """Turn a client exception into the error Temporal should (or should not) retry."""
    where = f"model {settings.model!r} at {base_url}"
    if isinstance(exc, StatusError):
        status = exc.status_code
        detail = _provider_message(exc)
        if is_context_overflow(exc):
            return ApplicationError(
                f"{where} rejected the request: it exceeds the model's context window: {detail}",
                type=names.MODEL_CONTEXT_OVERFLOW,
                non_retryable=True,
            )
        if status in _NOT_RETRYABLE_STATUS:
            hint = {
                401: "check the API key given to the worker",
                403: "the key may not use this model",
                404: "unknown model or wrong base URL",
            }.get(status, "the request was rejected")
            return ApplicationError(
                f"{where} rejected the request: HTTP {status} ({hint}): {detail}",
                type=names.MODEL_REQUEST_REJECTED,
                non_retryable=True,
            )
        return ApplicationError(
            f"{where} failed: HTTP {status}: {detail}",
            type=names.MODEL_UNAVAILABLE,
            next_retry_delay=retry_after(exc.response.headers if exc.response else None),
        )
    if isinstance(exc, TimeoutErrors):
        return ApplicationError(
            f"{where} timed out after {settings.request_timeout_s:g} s", type=names.MODEL_UNAVAILABLE
        )
    if isinstance(exc, ConnectionErrors):
        return ApplicationError(f"cannot reach {where}: {exc}", type=names.MODEL_UNAVAILABLE)
    return ApplicationError(f"{where}: {type(exc).__name__}: {exc}", type=names.MODEL_UNAVAILABLE)
