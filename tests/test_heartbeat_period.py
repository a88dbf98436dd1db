"""How often a long activity heartbeats: a quarter of its heartbeat timeout, never more often
than once a second (`beat_every_s`, defaults.BEATS_PER_HEARTBEAT_TIMEOUT).

Every heartbeat the server records is a write to its store; at 1,000 episodes on one worker a
beat each second against a 5 s timeout had ~1,300 heartbeat timeouts, a beat every 2.5 s
against 10 s had 376 (BENCHMARKS.md, "Overload on 2026-11-29"). The SDK's ActivityEnvironment
runs our real heartbeat code and counts what it would send (the worker's throttle, 1 s, lets
each of these through as it comes).
"""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import UTC, datetime, timedelta

import pytest
from temporalio.testing import ActivityEnvironment

from durable_rlm.activities.attempts import beat_every_s, start_attempt_clock
from durable_rlm.activities.llm import with_heartbeats
from durable_rlm.activities.repl import heartbeating
from durable_rlm.workflows import defaults
from durable_rlm.workflows.models import DurabilitySettings


def environment(timeout_s: float | None, beats: list[float]) -> ActivityEnvironment:
    env = ActivityEnvironment()
    env.info = dataclasses.replace(
        env.info,
        heartbeat_timeout=timedelta(seconds=timeout_s) if timeout_s is not None else None,
        started_time=datetime.now(UTC),  # handed out just now: no early first beat is due
    )
    env.on_heartbeat = lambda *details: beats.append(asyncio.get_running_loop().time())
    return env


def gaps(beats: list[float]) -> list[float]:
    return [b - a for a, b in zip(beats, beats[1:], strict=False)]


def test_the_period_is_a_quarter_of_the_timeout_and_never_under_a_second() -> None:
    assert defaults.HEARTBEAT_TIMEOUT_S / defaults.BEATS_PER_HEARTBEAT_TIMEOUT == 2.5
    assert DurabilitySettings().heartbeat_timeout_s == defaults.HEARTBEAT_TIMEOUT_S
    assert beat_every_s() == defaults.HEARTBEAT_EVERY_S  # outside an activity

    def period(timeout_s: float | None) -> float:
        return environment(timeout_s, []).run(beat_every_s)

    assert period(None) == 1.0  # no heartbeat timeout: the shortest period
    assert period(3) == 1.0  # a test's short timeout keeps a beat a second
    assert period(10) == 2.5
    assert period(60) == 15.0


async def test_a_model_call_beats_a_quarter_of_its_timeout_apart() -> None:
    """A call waiting 4.6 s under an 8 s heartbeat timeout beats at 2 s and 4 s: two writes
    for the server, where a beat each second made four."""
    beats: list[float] = []

    async def call() -> str:
        start_attempt_clock()
        return await with_heartbeats(asyncio.sleep(4.6, result="reply"))

    started = asyncio.get_running_loop().time()
    assert await environment(8, beats).run(call) == "reply"
    assert len(beats) == 2, gaps(beats)
    assert beats[0] - started == pytest.approx(2.0, abs=0.4)
    assert gaps(beats)[0] == pytest.approx(2.0, abs=0.4)


async def test_a_call_under_a_short_timeout_still_beats_each_second() -> None:
    beats: list[float] = []

    async def call() -> str:
        start_attempt_clock()
        return await with_heartbeats(asyncio.sleep(2.6, result="reply"))

    assert await environment(3, beats).run(call) == "reply"
    assert len(beats) == 2 and gaps(beats)[0] == pytest.approx(1.0, abs=0.4)


async def test_a_remote_repl_step_beats_at_once_then_a_quarter_of_its_timeout_apart() -> None:
    beats: list[float] = []

    async def step() -> None:
        async with heartbeating():
            await asyncio.sleep(4.5)

    started = asyncio.get_running_loop().time()
    await environment(8, beats).run(step)
    assert len(beats) == 3, gaps(beats)  # at 0, 2 and 4 s
    assert beats[0] - started < 0.4
    assert all(gap == pytest.approx(2.0, abs=0.4) for gap in gaps(beats))
