"""When the conversation must be compacted to keep the next request inside the model's
context window. Pure: the summary itself is a model call (`ModelActivities.compact_conversation`
in activities/llm.py).

rlms compacts when input tokens pass a share of the window; its users hit overflows
because the reply's max_tokens was not reserved. Here the reply is reserved first.
"""

from __future__ import annotations

from durable_rlm.workflows import defaults
from durable_rlm.workflows.models import EpisodeCarry, EpisodeLimits, Message, ModelSettings
from durable_rlm.workflows.parsing import shorten_middle


def estimated_request_tokens(state: EpisodeCarry, pending: list[Message], resent_chars: int) -> int:
    """Tokens of the next root request: the provider's count for the previous request,
    plus the reply it produced (as it will be resent), plus the new messages."""
    new_chars = sum(len(m.content) for m in pending)
    reply = min(state.last_reply_tokens, resent_chars // defaults.CHARS_PER_TOKEN)
    return state.last_prompt_tokens + reply + new_chars // defaults.CHARS_PER_TOKEN


def reply_reserve(model: ModelSettings) -> int:
    return model.max_tokens or defaults.REPLY_TOKENS_RESERVED


def needs_compaction(
    state: EpisodeCarry,
    pending: list[Message],
    limits: EpisodeLimits,
    model: ModelSettings,
    rlms: bool = False,
) -> bool:
    """`rlms`: rlms's rule, the request itself at the share of the window (its examples use
    shares of 2%, which a reply reserved in the share would pass on every turn), and, rlms
    aside, never a request whose reply would not fit the window."""
    if limits.context_window_tokens is None or state.conversation is None:
        return False
    budget = limits.compact_at * limits.context_window_tokens
    estimate = estimated_request_tokens(state, pending, limits.resent_message_chars)
    if rlms:
        return estimate >= budget or estimate + reply_reserve(model) > limits.context_window_tokens
    return estimate + reply_reserve(model) > budget


def summary_input_chars(limits: EpisodeLimits, model: ModelSettings, rlms: bool = False) -> int:
    """Characters of earlier turns the summariser may read: its own request must fit too
    (`rlms`: in the window, since rlms's share may be a few percent of it)."""
    if limits.context_window_tokens is None:
        return defaults.COMPACTION_INPUT_CHARS
    share = 1.0 if rlms else limits.compact_at
    room = int(share * limits.context_window_tokens) - reply_reserve(model)
    return max(1_000, min(defaults.COMPACTION_INPUT_CHARS, room * defaults.CHARS_PER_TOKEN // 2))


def resent_view(messages: list[Message], limit: int) -> list[Message]:
    """What is sent: earlier replies and observations longer than `limit` are shortened
    (head and tail kept). The system prompt, the task and the newest message go whole; the
    stored conversation always keeps every message whole."""
    last = len(messages) - 1
    return [
        m
        if i < 2 or i == last or len(m.content) <= limit
        else Message(role=m.role, content=shorten_middle(m.content, limit))
        for i, m in enumerate(messages)
    ]
