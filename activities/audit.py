"""Writes the SQL projection of episodes. History stays the source of truth; this table can
be dropped and rebuilt, so writes are idempotent upserts keyed by episode id."""

from __future__ import annotations

import asyncio

import sqlalchemy as sa
from temporalio import activity
from temporalio.worker import Interceptor

from durable_rlm import schema
from workflows import names
from workflows.models import AuditEpisodeInput


class AuditActivities:
    def __init__(self, engine: sa.Engine | None) -> None:
        self.engine = engine

    @activity.defn(name=names.AUDIT_EPISODE)
    async def audit_episode(self, record: AuditEpisodeInput) -> None:
        if self.engine is not None:
            await asyncio.to_thread(upsert_episode, self.engine, record)


def upsert_episode(engine: sa.Engine, record: AuditEpisodeInput) -> None:
    """Insert or update one episode's row: the same write for the activity and a rebuild."""
    values: dict[str, object] = {
        "run_id": record.run_id,
        "task": record.task[:10_000],
        "root_model": record.root_model,
        "status": record.status,
        "error": record.error,
        "stop_reason": record.error,
        "updated_at": sa.func.now(),
    }
    if record.result is not None:
        result = record.result
        values.update(
            ended_by=result.ended_by,
            answer=result.answer,
            answer_source=result.answer_source,
            confidence=result.confidence,
            stop_reason=result.stop_reason,
            iterations=result.iterations,
            model_calls=result.model_calls,
            prompt_tokens=result.usage.prompt_tokens,
            completion_tokens=result.usage.completion_tokens,
            error=result.error,
        )
    table = schema.episodes
    with engine.begin() as conn:
        updated = conn.execute(
            table.update().where(table.c.episode_id == record.episode_id).values(**values)
        ).rowcount
        if not updated:
            conn.execute(table.insert().values(episode_id=record.episode_id, **values))


class AuditInterceptor(Interceptor):
    """Writes each completed step's audit rows (NOT FINISHED: being built, issue 9)."""

    def __init__(self, engine: sa.Engine | None) -> None:
        self.engine = engine
