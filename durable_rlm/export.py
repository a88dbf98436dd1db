"""`drlm export`: an episode as the rlms package's JSONL trajectory log, or as JSON.
NOT FINISHED: being built (issue 9, export)."""

from __future__ import annotations

from durable_rlm.settings import Settings


async def export_command(settings: Settings, episode_id: str, fmt: str, output: str | None) -> int:
    raise NotImplementedError("drlm export is not finished")
