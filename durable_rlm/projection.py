"""Rebuild the SQL audit projection from Temporal histories (DESIGN invariant 6)."""

from __future__ import annotations

import asyncio

import sqlalchemy as sa
from temporalio.client import Client, WorkflowExecutionStatus

from activities.audit import upsert_episode
from durable_rlm import schema
from workflows import names
from workflows.models import AuditEpisodeInput, EpisodeRequest, EpisodeResult


async def rebuild_audit(client: Client, engine: sa.Engine, drop: bool = True) -> int:
    """Write one row per episode from its latest run; with `drop`, start from an empty table."""
    if drop:
        await asyncio.to_thread(_clear, engine)
    count = 0
    async for execution in client.list_workflows(f'WorkflowType = "{names.WORKFLOW}"'):
        handle = client.get_workflow_handle(execution.id, result_type=EpisodeResult)
        first = await client.get_workflow_handle(execution.id, run_id=execution.run_id).fetch_history()
        started = first.events[0].workflow_execution_started_event_attributes
        (request,) = await client.data_converter.decode(list(started.input.payloads)[:1], [EpisodeRequest])
        if execution.run_id != (await handle.describe()).run_id:
            continue  # an earlier run of a continued-as-new episode: the latest run has the row
        result = None
        if execution.status == WorkflowExecutionStatus.COMPLETED:
            result = await handle.result()
        record = AuditEpisodeInput(
            episode_id=execution.id,
            run_id=execution.run_id,
            task=request.task,
            root_model=request.root_model.model,
            status="completed" if result is not None else execution.status.name.lower()[:20],
            result=result,
        )
        await asyncio.to_thread(upsert_episode, engine, record)
        count += 1
    return count


def _clear(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(schema.episodes.delete())
