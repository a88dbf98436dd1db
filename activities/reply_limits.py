"""How much of a model's reply the worker reads: a reply is cut, never a wedge.

A reply is text a model (or whatever answers at its address) chose, and its size reaches
everything after it: the worker's memory while the body is parsed, the workflow task that
reads it (Temporal fails a task that runs past ~2 s, and retries it for ever), the history
and the conversation. So the worker reads at most `max_reply_chars` characters of a reply
(an episode limit; no provider's largest output comes near the default) and cuts there:

- the response body is read, decompressed, up to `body_cap(max_reply_chars)` bytes (the
  most a completion with that much text can take as JSON), and no further: a larger body is
  closed unread, and the text is taken from what was read (a JSON parser that accepts a cut
  document), its token counts estimated, since they came after the text;
- the text is cut at `max_reply_chars` and ends with a note saying so, which the model reads
  with its own reply in the next turn; the call records that it was cut (`reply_cut_at`).

The note holds no parenthesis and no backtick, so a cut `FINAL(` never closes on it and a
cut code block stays unclosed (neither is taken: an unclosed block is not run).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import jiter

BODY_BYTES_PER_CHAR = 12
"""The most bytes a JSON string spends on one character: an astral one escaped as a
surrogate pair, `\\ud83d\\ude00`."""

BODY_SLACK_BYTES = 64 * 1024
"""The rest of a completion around its text (ids, model name, finish reason, usage)."""

ERROR_BODY_BYTES = 64 * 1024
"""Of an error reply (4xx/5xx) only the head is read: its message is all that is quoted."""

CUT_NOTE = (
    "\n\n[drlm: this reply was cut here, after {kept:,} characters: the episode reads at most "
    "max_reply_chars = {limit:,} characters of a reply; the rest was not read]"
)

_CUT = "drlm_reply_cut"  # the response's extensions key: its body was cut at the cap
_BODY_CAP: ContextVar[int | None] = ContextVar("drlm_reply_body_cap", default=None)


def body_cap(max_reply_chars: int) -> int:
    """Bytes of a response body read for a reply of at most `max_reply_chars` characters."""
    return max_reply_chars * BODY_BYTES_PER_CHAR + BODY_SLACK_BYTES


@contextlib.contextmanager
def reading_at_most(cap: int) -> Iterator[None]:
    """Responses received inside this block (this task and those it starts) are read up to
    `cap` bytes. A context variable, since one client serves every episode's calls."""
    token = _BODY_CAP.set(cap)
    try:
        yield
    finally:
        _BODY_CAP.reset(token)


async def read_capped_body(response: Any) -> None:
    """An httpx2 response hook: read the body now, decompressed, up to the cap, and stop.

    The client reads the body after its hooks; a body already read is not read again. The
    client's own read has no bound (a 60 MB reply took the worker up by gigabytes), and
    counting on the wire would not bound a compressed body, so the hook reads it here.
    """
    cap = _BODY_CAP.get()
    if cap is None:
        return
    if response.status_code >= 400:
        cap = min(cap, ERROR_BODY_BYTES)
    parts: list[bytes] = []
    size = 0
    async for part in response.aiter_bytes():
        parts.append(part)
        size += len(part)
        if size > cap:
            await response.aclose()  # the connection goes too: the rest is never read
            response.extensions = {**response.extensions, _CUT: True}
            break
    body = b"".join(parts)
    # httpx2 keeps a read body here (Response.aread); set, the client's read returns it.
    response._content = body[:cap] if size > cap else body


def was_cut(http_response: Any) -> bool:
    return bool(getattr(http_response, "extensions", {}).get(_CUT))


def _text_in(document: Any, api: str) -> str | None:
    """The reply's text in a (possibly cut) completion document, or None where it has none."""
    if not isinstance(document, dict):
        return None
    if api == "anthropic":
        blocks = document.get("content")
        if not isinstance(blocks, list):
            return None
        texts = [b.get("text") for b in blocks if isinstance(b, dict)]
        return (
            "".join(t for t in texts if isinstance(t, str))
            if any(isinstance(t, str) for t in texts)
            else None
        )
    choices = document.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else None
    message = choice.get("message") if isinstance(choice, dict) else None
    content = message.get("content") if isinstance(message, dict) else None
    return content if isinstance(content, str) else None


def text_of_cut_body(head: bytes, api: str) -> tuple[str, bool]:
    """The reply's text in the head of a cut completion body, and whether that text is whole
    (the cut came after it: in logprobs, say). A head with no reply text in it gives ""."""
    try:
        closed = jiter.from_json(head, partial_mode="on")  # drops a string the cut left open
        whole = _text_in(closed, api)
        # One string holds an OpenAI reply's text; an Anthropic reply's blocks are whole once
        # what follows them (its stop_reason) has come.
        if whole is not None and (api != "anthropic" or "stop_reason" in closed):
            return whole, True
        return _text_in(jiter.from_json(head, partial_mode="trailing-strings"), api) or "", False
    except ValueError:  # not JSON even as a head, or nested past jiter's depth
        return "", False


def cut_reply(text: str, limit: int, whole: bool = True) -> tuple[str, int | None]:
    """The reply as the episode keeps it, and how many of its characters were kept when it
    was cut (None: it was not). Text that is not whole is cut even under the limit."""
    if len(text) <= limit and whole:
        return text, None
    kept = text[:limit]
    return kept + CUT_NOTE.format(kept=len(kept), limit=limit), len(kept)
