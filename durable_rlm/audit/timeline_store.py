"""Keeping ended episodes' timelines in the SQL store, for `drlm show` to read back without
the server (audit/readonly.py reads them). A projection of the history
(docs/architecture/index.md#invariants): kept only once the episode ended, when its history
can no longer change."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from durable_rlm.audit.readonly import ENDED
from durable_rlm.store import schema

if TYPE_CHECKING:
    from durable_rlm.audit.timeline import Timeline


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
    """The episodes whose timelines are kept (the reconciler keeps the others')."""
    with engine.connect() as conn:
        return set(conn.execute(sa.select(schema.episode_timelines.c.episode_id)).scalars())
