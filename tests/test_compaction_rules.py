"""When the conversation is compacted (workflows/compaction.py), as pure functions: the size of
the next request, the reply reserved before the window is full, and how much the summariser
may read. The episodes that compact are in tests/test_compaction.py."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from durable_rlm.workflows import defaults
from durable_rlm.workflows.compaction import (
    estimated_request_tokens,
    needs_compaction,
    reply_reserve,
    summary_input_chars,
)
from durable_rlm.workflows.models import EpisodeCarry, EpisodeLimits, Message, ModelSettings

CONVERSATION = "sha256:" + "0" * 64


def state(prompt: int = 0, reply: int = 0, conversation: str | None = CONVERSATION) -> EpisodeCarry:
    return EpisodeCarry(
        seed=1,
        deadline="2030-01-01T00:00:00Z",  # type: ignore[arg-type]
        conversation=conversation,
        last_prompt_tokens=prompt,
        last_reply_tokens=reply,
    )


def turns(*sizes: int) -> list[Message]:
    return [Message(role="user", content="x" * size) for size in sizes]


def model(max_tokens: int | None = None) -> ModelSettings:
    return ModelSettings(model="m", max_tokens=max_tokens)


# --- the size of the next request -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("sizes", "tokens"),
    [((), 0), ((3,), 0), ((4,), 1), ((7,), 1), ((8,), 2), ((3, 5), 2), ((4_000, 4_000), 2_000)],
)
def test_new_messages_count_four_characters_a_token_summed_before_dividing(
    sizes: tuple[int, ...], tokens: int
) -> None:
    assert estimated_request_tokens(state(prompt=1_000), turns(*sizes), 20_000) == 1_000 + tokens


@pytest.mark.parametrize(
    ("reply", "resent_chars", "counted"),
    [
        (100, 20_000, 100),  # a short reply is resent whole
        (4_999, 20_000, 4_999),
        (5_000, 20_000, 5_000),
        (5_001, 20_000, 5_000),  # a long one is resent shortened: it counts at the resend size
        (250_000, 20_000, 5_000),
        (250_000, 20_003, 5_000),
        (250_000, 20_004, 5_001),
    ],
)
def test_the_last_reply_counts_at_most_at_the_resend_size(
    reply: int, resent_chars: int, counted: int
) -> None:
    assert estimated_request_tokens(state(prompt=1_000, reply=reply), [], resent_chars) == 1_000 + counted


# --- the reply is reserved ------------------------------------------------------------------------


def test_the_reply_reserved_is_the_models_max_tokens_else_the_default() -> None:
    assert reply_reserve(model(1_000)) == 1_000
    assert reply_reserve(model()) == defaults.REPLY_TOKENS_RESERVED == 4_096


def test_there_is_no_compaction_without_a_window_or_a_conversation() -> None:
    assert not needs_compaction(state(prompt=10**9), [], EpisodeLimits(), model())
    window = EpisodeLimits(context_window_tokens=10_000)
    assert not needs_compaction(state(prompt=10**9, conversation=None), [], window, model())
    assert needs_compaction(state(prompt=10**9), [], window, model())


@pytest.mark.parametrize(
    ("prompt", "compacts"),
    [(6_999, False), (7_000, False), (7_001, True)],  # 7,000 + the 1,000-token reply = 80% of 10,000
)
def test_compaction_starts_when_the_request_and_its_reply_pass_the_share_of_the_window(
    prompt: int, compacts: bool
) -> None:
    limits = EpisodeLimits(context_window_tokens=10_000, compact_at=0.8)
    assert needs_compaction(state(prompt=prompt), [], limits, model(1_000)) is compacts


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "compacts"),
    [
        (199, 1_000, False),
        (200, 1_000, True),  # rlms's rule: the request itself reaches 2% of the window
        (199, 9_801, False),
        (199, 9_802, True),  # ...and, rlms aside, never a request whose reply would not fit
    ],
)
def test_the_rlms_rule_compacts_at_the_share_and_keeps_the_reply_inside_the_window(
    prompt: int, max_tokens: int, compacts: bool
) -> None:
    limits = EpisodeLimits(context_window_tokens=10_000, compact_at=0.02)
    assert needs_compaction(state(prompt=prompt), [], limits, model(max_tokens), rlms=True) is compacts


def test_the_new_turns_and_the_resent_reply_count_toward_the_window() -> None:
    limits = EpisodeLimits(context_window_tokens=10_000, compact_at=0.5, resent_message_chars=1_000)
    # 2,000 prompt + 250 of a long reply (resent at 1,000 chars) + 1,000 new + 1,750 reserved = 5,000.
    assert not needs_compaction(state(prompt=2_000, reply=9_999), turns(4_000), limits, model(1_750))
    assert needs_compaction(state(prompt=2_000, reply=9_999), turns(4_004), limits, model(1_750))
    assert needs_compaction(state(prompt=2_000, reply=9_999), turns(4_000), limits, model(1_751))
    assert needs_compaction(state(prompt=2_001, reply=9_999), turns(4_000), limits, model(1_750))


# --- what the summariser may read -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("window", "compact_at", "max_tokens", "chars"),
    [
        (None, 0.8, None, defaults.COMPACTION_INPUT_CHARS),
        (100_000, 0.8, None, (80_000 - 4_096) * 2),  # half the room left by the reply, in characters
        (1_000_000, 0.8, None, defaults.COMPACTION_INPUT_CHARS),  # capped
        (5_000, 0.8, 3_500, 1_000),  # room 500: 1,000 characters
        (5_000, 0.8, 3_499, 1_002),
        (5_000, 0.8, 3_501, 1_000),  # never below 1,000 characters
        (5_000, 0.8, None, 1_000),  # the reply alone passes the share: still 1,000
        (1_001, 0.85, 100, 1_500),  # int(850.85) - 100 = 750 tokens of room
    ],
)
def test_the_summariser_reads_half_the_room_its_own_reply_leaves(
    window: int | None, compact_at: float, max_tokens: int | None, chars: int
) -> None:
    limits = EpisodeLimits(context_window_tokens=window, compact_at=compact_at)
    allowed = summary_input_chars(limits, model(max_tokens))
    assert allowed == chars and isinstance(allowed, int)


@given(
    window=st.one_of(st.none(), st.integers(1_000, 2_000_000)),
    compact_at=st.floats(0.11, 1.0),
    max_tokens=st.one_of(st.none(), st.integers(1, 200_000)),
)
def test_the_summary_input_is_bounded_and_leaves_room_for_the_summariser(
    window: int | None, compact_at: float, max_tokens: int | None
) -> None:
    limits = EpisodeLimits(context_window_tokens=window, compact_at=compact_at)
    chars = summary_input_chars(limits, model(max_tokens))
    assert 1_000 <= chars <= defaults.COMPACTION_INPUT_CHARS
    if window is not None and chars > 1_000:
        # Its input, read at four characters a token, takes at most half the room left.
        room = int(compact_at * window) - reply_reserve(model(max_tokens))
        assert chars // defaults.CHARS_PER_TOKEN <= room // 2
