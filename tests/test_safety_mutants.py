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

from durable_rlm.activities.repl import ReplActivities
from durable_rlm.activities.sandbox.framing import MAX_FRAME_BYTES
from durable_rlm.activities.sandbox_protocol import FRAME_OVERHEAD
from durable_rlm.scripted import ChatRequest, Reply
from durable_rlm.store.codec import KEY_ID, EncryptionCodec, data_converter
from durable_rlm.store.encryption import Keyring
from durable_rlm.worker.runtime import EmbeddedServer
from durable_rlm.workflows import defaults, names
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
from tests.conftest import Episode, request_for, workers_for
from tests.worker_health import RssPeak


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


# --- one frame is bounded by the worker's in-flight budget, not only the format's limit --------


async def test_one_frame_past_the_in_flight_budget_is_refused_from_its_header(host: ReplActivities) -> None:
    """The format allows frames of MAX_FRAME_BYTES (256 MiB); a worker holds at most
    SANDBOX_IN_FLIGHT_BYTES of one sandbox. A frame that announces the format's maximum is
    refused from its header and its body is never read: with the bound on one frame gone,
    the worker would buffer all 256 MiB of it (a frame alone always fits the inbox)."""
    episode = Episode(host, cell_timeout_s=30)
    await episode.run("kept = 1")
    cell = (
        "import struct\n"
        "out = llm_query.__self__.calls.channel_out\n"
        f"out.write(struct.pack('>I', {MAX_FRAME_BYTES}))\n"
        "chunk = b' ' * (1 << 20)\n"
        f"for _ in range({MAX_FRAME_BYTES >> 20}):\n"
        "    out.write(chunk)\n"
        "out.flush()"
    )
    async with RssPeak() as memory:
        outcome = await episode.run(cell)
    limit = defaults.SANDBOX_IN_FLIGHT_BYTES - FRAME_OVERHEAD
    assert f"the sandbox sent a {MAX_FRAME_BYTES:,}-byte frame, over the {limit:,}-byte limit" in (
        outcome.error or ""
    ), outcome
    assert memory.growth < 64, memory.growth  # nothing of the body was read (~0 MB here)
    assert (await episode.run("print(kept)")).stdout == "1\n"  # rebuilt for the next cell


# --- a batch of exactly the cap goes out; one more is refused in the cell ----------------------

CAP = defaults.MAX_PROMPTS_PER_CALL


async def test_a_cell_sends_a_batch_of_the_cap_and_reads_why_one_more_is_refused(
    host: ReplActivities,
) -> None:
    """A cell's batch of exactly the cap is answered; one more is refused in the cell with the
    documented ValueError, not as a protocol error of its sandbox (the host's schema would
    refuse it too: off by one, the cell's error was a malformed frame). In process, against
    the host's decoder: tests/test_host_calls.py."""
    episode = Episode(host)
    sent = await episode.run(f"r = llm_query_batched(['p'] * {CAP})\nprint(len(r), r[0])")
    assert sent.error is None and sent.stdout == f"{CAP} P\n", sent
    refused = await episode.run(f"llm_query_batched(['p'] * {CAP + 1})")
    assert "ValueError" in (refused.error or "") and (
        f"llm_query_batched got {CAP + 1:,} prompts; at most {CAP:,} go in one call" in refused.error
    ), refused
