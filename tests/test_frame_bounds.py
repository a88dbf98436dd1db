"""Frames a cell forges on its sandbox's channel, through real episodes: what the host parses
is bounded in objects, not only bytes (the wire's decoder counts values and depth first), and a
call is no larger than MAX_CALL_BYTES whatever the sandbox's own check said. Each attack runs
with the audit hook on and off, beside an honest episode that keeps its usual wall time, and
is followed by honest episodes on the same worker (tests/worker_health.py).

The report: a `done` frame whose `submitted` was 60 MB of `[{},{},...]` took the worker to
3.2 GB and held its GIL 2.9 s (neighbours' wall time 0.7-1.9 s -> 9-12 s); a forged 60 MB
`call` frame reached the provider as a 62.9 MB request.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from durable_rlm.audit.timeline import episode_timeline
from durable_rlm.scripted import ChatRequest, Reply
from durable_rlm.workflows import defaults
from durable_rlm.workflows.models import EpisodeLimits
from tests.conftest import request_for, run_episode
from tests.worker_health import RssPeak, WorkerHealth, honest_episode

LIMITS = EpisodeLimits(max_iterations=5, cell_timeout_s=10)

FORGE = """
import struct, sys, time
session = llm_query.__self__.calls
SEQ = next(m._SEQ[0] for m in list(sys.modules.values()) if hasattr(m, '_SEQ') and hasattr(m, 'read_frame'))
def forge(body):
    session.channel_out.write(struct.pack('>I', len(body)) + body)
    session.channel_out.flush()
"""
"""Writes a frame's bytes on the sandbox's channel, numbered as the host's request."""

DONE = 'b\'{"op":"done","status":"ok","seq":%d,"submitted":\' % SEQ'
CALL = 'b\'{"op":"call","kind":"llm_query","seq":%d,"prompts":\' % SEQ'

ATTACKS = {
    "60 MB of empty objects": (
        f"forge({DONE} + b'[' + b'{{}},' * (20 << 20) + b'{{}}]}}')",
        "more than 400,000 values in one document",
    ),
    "lists nested 300,000 deep": (
        f"forge({DONE} + b'[' * 300_000 + b']' * 300_000 + b'}}')",
        "nested more than 100 deep",
    ),
    "a 60 MB call": (
        f"forge({CALL} + b'[\"' + b'x' * (60 << 20) + b'\"]}}')",
        f"over the {defaults.MAX_CALL_BYTES:,}-byte limit of one call",
    ),
}


def attack_script(cell: str):
    def script(request: ChatRequest) -> Reply | str:
        if not request.is_root:
            return request.last_user.upper()
        turns = [f"```repl\n{cell}\n```", "```repl\nprint(llm_query('ping'))\n```", "FINAL(survived)"]
        return turns[min(request.turn, 2)]

    return script


@pytest.fixture(params=[True, False], ids=["hook-on", "hook-off"])
async def health(request: pytest.FixtureRequest, worker, client, scripted) -> WorkerHealth:
    worker.config.audit_hook = request.param  # the host's bounds must hold without the sandbox's hook
    return await WorkerHealth.measure(client, worker, scripted)


@pytest.mark.parametrize("name", ATTACKS)
async def test_a_forged_frame_is_refused_by_its_parsed_size_and_nobody_else_waits(
    client, worker, scripted, health: WorkerHealth, name: str
) -> None:
    forged, refusal = ATTACKS[name]
    cell = FORGE + "if session.recorded is None:\n    " + forged + "\n    time.sleep(3)"
    server = scripted(attack_script(cell))
    episode_id = f"frame-{uuid.uuid4().hex[:8]}"
    async with RssPeak() as memory:
        began = time.monotonic()
        attacked = asyncio.ensure_future(
            run_episode(client, request_for(server, limits=LIMITS), worker.task_queue, episode_id)
        )
        # A neighbour runs while the forged frame is read and refused.
        await asyncio.sleep(0.5)
        neighbour_s = await honest_episode(client, worker, scripted)
        result = await attacked
    print(
        f"{name}: attack {time.monotonic() - began:.1f} s; neighbour {neighbour_s:.2f} s "
        f"(usual {health.usual_s:.2f} s); worker peak +{memory.growth:.0f} MB"
    )
    assert result.answer == "survived", result
    timeline = await episode_timeline(client, episode_id)
    attack, after = timeline.iterations[0].cells[0], timeline.iterations[1].cells[0]
    assert refusal in (attack.error or ""), attack
    assert after.stdout.startswith("PING")  # the episode's REPL serves it again
    assert result.sub_calls == 1  # the ping: no forged call reached the workflow
    assert max(len(str(r.messages)) for r in server.sub_requests()) < 10_000
    assert neighbour_s <= 2 * health.usual_s + 1.0, (neighbour_s, health.usual_s)
    # The frame's bytes are held (the in-flight budget) and copied once; its objects never built.
    assert memory.growth < defaults.SANDBOX_IN_FLIGHT_BYTES / 2**20 + 80, memory.growth
    await health.check(client, worker, scripted)
