"""Answers from the SQL store alone: `drlm show` of an ended episode and `drlm list` need
no Temporal server (and must not start one), so they answer in a fraction of a second.

The tables are projections of histories (DESIGN invariant 6): a timeline is stored only
once its episode ended, when its history can no longer change.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from durable_rlm import schema
from durable_rlm.settings import Settings
from durable_rlm.store import create_engine
from durable_rlm.timeline import Timeline

ENDED = ("completed", "failed", "cancelled", "terminated", "timed_out")


def open_existing(settings: Settings) -> sa.Engine | None:
    """An engine on the SQL store if it exists (nothing is created or migrated)."""
    url = settings.effective_database_url
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).is_file():
        return None
    return create_engine(url)


def cached_timeline(engine: sa.Engine, episode_id: str) -> Timeline | None:
    table = schema.episode_timelines
    try:
        with engine.connect() as conn:
            text = conn.execute(
                sa.select(table.c.timeline).where(table.c.episode_id == episode_id)
            ).scalar_one_or_none()
    except sa.exc.DatabaseError:  # an older schema: no table yet
        return None
    return None if text is None else Timeline.model_validate_json(text)


def store_timeline(engine: sa.Engine, timeline: Timeline, run_id: str) -> bool:
    """Keep an ended episode's timeline; a running one is not kept (it still changes)."""
    if timeline.status not in ENDED:
        return False
    table = schema.episode_timelines
    values: dict[str, Any] = {
        "run_id": run_id,
        "status": timeline.status,
        "timeline": timeline.model_dump_json(),
        "cached_at": datetime.now(UTC),
    }
    with engine.begin() as conn:
        updated = conn.execute(table.update().where(table.c.episode_id == timeline.episode_id).values(values))
        if updated.rowcount == 0:
            conn.execute(table.insert().values(episode_id=timeline.episode_id, **values))
    return True


def cached_ids(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return set(conn.execute(sa.select(schema.episode_timelines.c.episode_id)).scalars())


def episode_rows(engine: sa.Engine, limit: int) -> Sequence[sa.Row]:
    table = schema.episodes
    try:
        with engine.connect() as conn:
            return conn.execute(sa.select(table).order_by(table.c.updated_at.desc()).limit(limit)).all()
    except sa.exc.DatabaseError:
        return []
