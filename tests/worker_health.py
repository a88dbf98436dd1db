"""The worker's health around hostile episodes: its memory, and an honest episode's wall time
before and after. The test's worker is this process (in-process workers), so its memory is
read from /proc/self."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from durable_rlm.scripted import ChatRequest, Reply
from tests.conftest import request_for, run_episode

RSS_SLACK_MB = 100
"""How far above its start the worker may be after the attacks."""


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise KeyError("VmRSS")


class RssPeak:
    """The worker's largest resident size (MB) while the block runs, sampled every 20 ms (the
    process's own peak, from getrusage, is over its whole life)."""

    async def __aenter__(self) -> RssPeak:
        self.start = self.peak = rss_mb()
        self._task = asyncio.create_task(self._sample())
        return self

    async def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, rss_mb())
            await asyncio.sleep(0.02)

    async def __aexit__(self, *exc: object) -> None:
        self._task.cancel()
        self.peak = max(self.peak, rss_mb())

    @property
    def growth(self) -> float:
        return self.peak - self.start


def honest_script(request: ChatRequest) -> Reply | str:
    if not request.is_root:
        return request.last_user.upper()
    return ["```repl\nr = llm_query('ping')\n```", "FINAL_VAR(r)"][min(request.turn, 1)]


async def honest_episode(client, worker, scripted) -> float:
    """Run an honest episode on the worker; its wall time. It must answer right."""
    began = time.monotonic()
    result = await run_episode(client, request_for(scripted(honest_script)), worker.task_queue)
    assert result.answer == "PING", result
    return time.monotonic() - began


class WorkerHealth:
    """The worker once warm (an honest episode run): its memory, and an honest episode's
    usual wall time (the best of two)."""

    def __init__(self, rss: float, usual_s: float) -> None:
        self.rss = rss
        self.usual_s = usual_s

    @classmethod
    async def measure(cls, client, worker, scripted) -> WorkerHealth:
        await honest_episode(client, worker, scripted)
        usual = min([await honest_episode(client, worker, scripted) for _ in range(2)])
        return cls(rss_mb(), usual)

    async def check(self, client, worker, scripted) -> None:
        """After the attacks: an honest episode answers right at its usual speed (twice its
        usual time, plus a second for a loaded machine), and the worker's memory is within
        RSS_SLACK_MB of where it started."""
        took = min([await honest_episode(client, worker, scripted) for _ in range(2)])
        print(
            f"honest episode: {took:.2f} s after, {self.usual_s:.2f} s before; "
            f"RSS {rss_mb():.0f} MB, {self.rss:.0f} MB before"
        )
        assert took <= 2 * self.usual_s + 1.0, (took, self.usual_s)
        assert rss_mb() - self.rss < RSS_SLACK_MB, (rss_mb(), self.rss)
