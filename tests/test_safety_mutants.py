"""Tests for behaviours a hand-made mutation of safety code once left unnoticed (see
docs/architecture/decisions.md#mutation-testing-of-the-pure-modules): each fails on the
mutant it is named for."""

from __future__ import annotations

import asyncio
import base64
import os
import threading
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from pydantic import ValidationError
from temporalio.api.common.v1 import Payload
from temporalio.client import Client

from durable_rlm.activities.sandbox.framing import HEADER
from durable_rlm.activities.sandbox_protocol import FRAME_OVERHEAD, FrameInbox, read_frames
from durable_rlm.scripted import ChatRequest, Reply
from durable_rlm.store.codec import KEY_ID, EncryptionCodec, data_converter
from durable_rlm.store.encryption import Keyring
from durable_rlm.worker.runtime import EmbeddedServer
from durable_rlm.workflows import names
from durable_rlm.workflows.budget import child_budgets
from durable_rlm.workflows.models import (
    EpisodeCarry,
    EpisodeLimits,
    EpisodeProgress,
    EpisodeRequest,
    EpisodeResult,
    LimitsUpdate,
    ModelPrice,
    ModelSettings,
)
from tests.conftest import request_for, workers_for


def key() -> str:
    return base64.b64encode(os.urandom(32)).decode()


# --- the codec decrypts with the payload's own key, not the current one ----------------------


async def test_the_codec_decrypts_with_the_key_the_payload_names() -> None:
    old = key()
    before = EncryptionCodec(Keyring.parse(f"k1={old}"))
    (sealed,) = await before.encode([Payload(metadata={"encoding": b"json/plain"}, data=b'"secret"')])
    assert sealed.metadata[KEY_ID] == b"k1"
    rotated = EncryptionCodec(Keyring.parse(f"k2={key()},k1={old}"))  # k2 now encrypts
    (opened,) = await rotated.decode([sealed])
    assert opened.data == b'"secret"'  # read with k1, the key it names: k2 would fail its tag
    (newer,) = await rotated.encode([Payload(metadata={"encoding": b"json/plain"}, data=b'"later"')])
    (back,) = await rotated.decode([newer])
    assert back.data == b'"later"'


# --- a limit set by a person keeps the limits' own bounds ------------------------------------


@pytest.mark.parametrize(
    "change",
    [
        {"max_tokens": 0},
        {"max_tokens": -5},
        {"max_iterations": 0},
        {"max_llm_calls": 0},
        {"max_model_calls": 0},
        {"max_cost_usd": 0.0},
        {"max_duration": timedelta(0)},
    ],
)
def test_a_limits_update_is_bounded_as_the_limits_are(change: dict) -> None:
    with pytest.raises(ValidationError):
        LimitsUpdate(sender="alice", **change)
    field, value = next(iter(change.items()))
    with pytest.raises(ValidationError):
        EpisodeLimits(**{field: value})  # the same bound, one truth


# --- children split the parent's tokens and cost among siblings ------------------------------


def test_sibling_children_share_the_tokens_and_cost_left() -> None:
    price = ModelPrice(input_usd_per_mtok=1.0, output_usd_per_mtok=1.0)
    request = EpisodeRequest(
        task="t",
        root_model=ModelSettings(model="m", price=price),
        limits=EpisodeLimits(max_tokens=10_000, max_cost_usd=1.0, max_llm_calls=40),
    )
    state = EpisodeCarry(seed=1, deadline=datetime.now(UTC) + timedelta(minutes=5))
    one = child_budgets(request, state, 1, datetime.now(UTC))
    four = child_budgets(request, state, 4, datetime.now(UTC))
    assert not isinstance(one, str) and not isinstance(four, str)
    assert four.tokens is not None and one.tokens is not None and four.tokens * 4 <= one.tokens
    assert four.cost_usd is not None and one.cost_usd is not None and four.cost_usd * 4 <= one.cost_usd + 1e-9
    assert four.model_calls * 4 <= one.model_calls


# --- the deadline counts from the episode's start, across continue-as-new --------------------


async def test_the_deadline_is_not_recounted_by_a_new_run(tmp_path: Path, store, scripted) -> None:
    """A run that continues as new keeps the first run's start: its max_duration is the
    episode's, not each run's."""
    gate = threading.Event()
    turns = ["```repl\nx = 1\n```"] * 6

    def script(request: ChatRequest) -> Reply | str:
        if not request.is_root:
            return "-"
        if request.turn >= 4:
            gate.wait(30)  # hold it in its later run while the test looks
        return Reply(turns[min(request.turn, 5)], delay_s=0.6)

    blobs, engine = store
    args = ("--dynamic-config-value", "limit.historyCount.suggestContinueAsNew=20")
    async with EmbeddedServer(tmp_path / "temporal.sqlite", extra_args=args) as address:
        client = await Client.connect(address, data_converter=data_converter(blobs))
        queue = f"deadline-{uuid.uuid4().hex[:6]}"
        async with workers_for(client, store, tmp_path, queue):
            request = request_for(server := scripted(script))
            request = request.model_copy(
                update={"limits": request.limits.model_copy(update={"max_iterations": 6})}
            )
            episode_id = f"deadline-{uuid.uuid4().hex[:6]}"
            handle = await client.start_workflow(
                names.WORKFLOW, request, id=episode_id, task_queue=queue, result_type=EpisodeResult
            )
            first_start = (await handle.describe()).start_time
            try:
                for _ in range(400):
                    if len(server.root_requests()) >= 5:
                        break
                    await asyncio.sleep(0.05)
                latest = client.get_workflow_handle(episode_id)
                description = await latest.describe()
                assert description.run_id != handle.first_execution_run_id  # it continued as new
                progress = await latest.query("progress", result_type=EpisodeProgress)
            finally:
                gate.set()
            await asyncio.wait_for(latest.result(), 60)
    assert progress.started_at is not None and first_start is not None
    # The new run began later than the first (by the script's pauses); a clock counted from
    # it would be off by that much, and the one the episode keeps is the first's to the microsecond.
    assert description.start_time is not None and (description.start_time - first_start).total_seconds() > 0.5
    assert abs((progress.started_at - first_start).total_seconds()) < 0.01, (progress.started_at, first_start)


# --- the frame queue holds a sandbox's frames within its budget -----------------------------


async def test_the_frame_queue_reads_no_further_than_its_budget() -> None:
    """A sandbox that writes frames faster than its host takes them: the reader stops at the
    budget (the bytes wait in the pipe, in the sandbox's memory), and goes on as frames are
    taken. With the bound removed, all of them would sit in the worker's memory."""
    frame = b"x" * 4_000
    size = len(frame) + FRAME_OVERHEAD
    stream = asyncio.StreamReader()
    for _ in range(10):
        stream.feed_data(HEADER.pack(len(frame)) + frame)
    stream.feed_eof()
    inbox = FrameInbox(budget=3 * size)
    reader = asyncio.create_task(read_frames(stream, inbox, max_frame=1 << 20))
    for _ in range(20):
        await asyncio.sleep(0)
    assert inbox.held == 3 * size and not reader.done()  # three frames in, seven wait
    taken = [await inbox.get() for _ in range(10)]
    assert taken == [frame] * 10 and inbox.held <= 3 * size
    assert await inbox.get() is None  # and the end is told
    await reader


async def test_one_frame_larger_than_the_budget_still_passes_alone() -> None:
    """The budget never deadlocks a frame within the frame limit: alone, it always fits."""
    inbox = FrameInbox(budget=10)
    await asyncio.wait_for(inbox.reserve(1_000), 1)
    inbox.put(b"big", 1_000)
    second = asyncio.create_task(inbox.reserve(5))
    await asyncio.sleep(0)
    assert not second.done()  # waits while the big one is held
    assert await inbox.get() == b"big"
    await asyncio.wait_for(second, 1)
