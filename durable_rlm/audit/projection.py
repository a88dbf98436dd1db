"""The SQL audit projection from Temporal histories (DESIGN invariant 6).

One function, `record_of`, says what an execution's row is, whatever way it ended. The
workflow writes its own row when it can (started, completed, failed, cancelled); a
terminated or timed-out episode runs no code, so `reconcile_audit` (run by every worker
and by `drlm list`) settles rows left "running" with the same function that
`rebuild_audit` uses to write the table from scratch. Live and rebuilt rows are equal.

Rows describe the episode's current run chain (durable_rlm/audit/history.py): after a
`temporal workflow reset`, the reconciler finds a running episode whose row names a run
outside its chain and writes the episode's rows again from the reset run (the abandoned
run's answer and steps go), with the reset as an event.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from temporalio.client import Client, WorkflowExecution, WorkflowExecutionStatus
from temporalio.service import RPCError

from durable_rlm.audit.history import Reset, completed_steps, episode_runs, resets
from durable_rlm.audit.readonly import ENDED
from durable_rlm.audit.timeline import episode_timeline
from durable_rlm.audit.timeline_store import cached_ids, store_timeline
from durable_rlm.client.episodes import closing_error, execution_ending
from durable_rlm.server.connection import open_stores
from durable_rlm.settings import Settings
from durable_rlm.store import schema
from durable_rlm.store.audit_rows import Row, rows_of_step, upsert_episode, write_rows
from durable_rlm.store.codec import data_converter
from durable_rlm.workflows import names
from durable_rlm.workflows.models import AuditEpisodeInput, EpisodeRequest, EpisodeResult


async def first_request(client: Client, episode_id: str, first_run_id: str | None = None) -> EpisodeRequest:
    """The request an episode was started with (its first run's input)."""
    history = await client.get_workflow_handle(episode_id, run_id=first_run_id).fetch_history()
    started = history.events[0].workflow_execution_started_event_attributes
    (request,) = await client.data_converter.decode(list(started.input.payloads)[:1], [EpisodeRequest])
    return request


async def record_of(client: Client, episode_id: str, first_run_id: str | None = None) -> AuditEpisodeInput:
    """The row of an episode as its latest run says, whatever way it ended."""
    handle = client.get_workflow_handle(episode_id, result_type=EpisodeResult)
    description = await handle.describe()
    started_at = None
    if first_run_id is None:
        # The chain's first run: a reset run's started event keeps the episode's start time
        # (its own start time is the reset's).
        first_run = (await episode_runs(client, episode_id))[0]
        first_run_id, started_at = first_run.run_id, first_run.start_time
    returned = description.status == WorkflowExecutionStatus.COMPLETED
    request = await first_request(client, episode_id, first_run_id)
    result = await handle.result() if returned else None
    status = execution_ending(description.status, result)
    latest = client.get_workflow_handle(episode_id, run_id=description.run_id)
    first = await client.get_workflow_handle(episode_id, run_id=first_run_id).describe()
    return AuditEpisodeInput.of(
        request,
        episode_id=episode_id,
        run_id=description.run_id,
        status=status,
        result=result,
        error=await closing_error(latest, status),
        started_at=started_at or first.start_time,
        ended_at=description.close_time,
    )


async def rebuild_audit(
    client: Client, engine: sa.Engine, drop: bool = True, unreadable: list[str] | None = None
) -> int:
    """Write every audit table from histories (and the blob store) alone: each completed
    step through the function the workers used live, then, for an episode that ended
    without writing its row (terminated, timed out), the row `reconcile_audit` writes.
    With `unreadable`, an episode whose history cannot be decoded (a claim-checked payload's
    blob is gone) is named there and the others are still rebuilt; without it, it raises."""
    if drop:
        await asyncio.to_thread(_clear, engine)
    first_runs: dict[str, WorkflowExecution] = {}
    async for execution in client.list_workflows(f'WorkflowType = "{names.WORKFLOW}"'):
        known = first_runs.get(execution.id)
        if known is None or execution.start_time < known.start_time:
            first_runs[execution.id] = execution
    for episode_id in sorted(first_runs):
        try:
            await rebuild_episode(client, engine, episode_id)
        except (LookupError, ValueError):  # a blob missing, or corrupt
            if unreadable is None:
                raise
            unreadable.append(episode_id)
    await reconcile_audit(client, engine)
    return len(first_runs)


async def rebuild_episode(
    client: Client, engine: sa.Engine, episode_id: str, steps_only: bool = False
) -> None:
    """The episode's rows from its history. With `steps_only`, not its own row: the closing
    audit write, which writes that row right after (`settle_at_close`), must never have it
    overwritten by an earlier row of history (the opening one says `running`)."""
    runs = await episode_runs(client, episode_id)
    audited = False
    async for step in completed_steps(client, episode_id, runs):
        audited = audited or step.activity == names.AUDIT_EPISODE
        if steps_only and step.activity == names.AUDIT_EPISODE:
            continue
        rows = rows_of_step(episode_id, step.activity, step.arg, step.result)
        if rows:
            await asyncio.to_thread(write_rows, engine, rows)
    made_by_reset = resets(runs)
    if made_by_reset:
        await asyncio.to_thread(write_rows, engine, [reset_row(episode_id, r) for r in made_by_reset])
    if steps_only:
        return
    running = runs[-1].status == WorkflowExecutionStatus.RUNNING
    if not audited or (made_by_reset and running):
        # Every audit write of the episode failed (a store that was down), or the last one
        # is the opening row a reset run copied from the run it left: the row comes from
        # the history itself, as for an episode that ended without writing it.
        await asyncio.to_thread(upsert_episode, engine, await record_of(client, episode_id))


def reset_row(episode_id: str, reset: Reset) -> Row:
    """A reset as an audit event: who, when, why, and the run it left."""
    return Row(
        schema.events,
        {
            "episode_id": episode_id,
            "event_key": f"reset:{reset.new_run_id}"[:80],
            "kind": "reset",
            "detail": reset.line,
            "sender": reset.identity or None,
            "at": reset.at,
        },
    )


async def settle_resets(client: Client, engine: sa.Engine) -> int:
    """Write again the rows of running episodes whose row names a run outside their chain
    (a reset's abandoned run), from the current chain alone; a row that names an earlier
    run of the chain (continue-as-new) only learns the current run. Returns how many were
    written again."""
    table = schema.episodes
    current: dict[str, str] = {}
    query = f'WorkflowType = "{names.WORKFLOW}" AND ExecutionStatus = "Running"'
    async for execution in client.list_workflows(query):
        current[execution.id] = execution.run_id

    def named_runs(ids: list[str]) -> dict[str, str]:
        with engine.connect() as conn:
            return {
                episode_id: run_id
                for start in range(0, len(ids), 500)  # a bounded IN list per query
                for episode_id, run_id in conn.execute(
                    sa.select(table.c.episode_id, table.c.run_id).where(
                        table.c.episode_id.in_(ids[start : start + 500])
                    )
                ).tuples()
            }

    known = await asyncio.to_thread(named_runs, sorted(current))
    rewritten = await _settle_ended_resets(client, engine)
    for episode_id, run_id in sorted(current.items()):
        named = known.get(episode_id)
        if named is None or named == run_id:
            continue  # no row yet (the episode writes it), or the row is of this run
        try:
            chain = {run.run_id for run in await episode_runs(client, episode_id)}
        except (LookupError, RPCError):
            continue  # gone meanwhile
        if named not in chain:
            await _rewrite(client, engine, episode_id)
            rewritten += 1
        else:
            await asyncio.to_thread(upsert_episode, engine, await record_of(client, episode_id))
    return rewritten


RESET_WINDOW = timedelta(minutes=15)
"""How far back the reconciler looks for reset runs that ended before it saw them running."""


async def _settle_ended_resets(client: Client, engine: sa.Engine) -> int:
    """A reset run that ended before a reconciler saw it running wrote its own closing row,
    but rows of its abandoned run's later steps may remain: an episode that ended within
    RESET_WINDOW, whose current run a reset made (`last_reset_time`) and whose rows hold no
    event of that reset yet, is written again from its chain. One describe per episode."""
    since = (datetime.now(UTC) - RESET_WINDOW).strftime("%Y-%m-%dT%H:%M:%SZ")
    query = f'WorkflowType = "{names.WORKFLOW}" AND ExecutionStatus != "Running" AND CloseTime > "{since}"'
    ended: set[str] = set()
    async for execution in client.list_workflows(query):
        ended.add(execution.id)
    rewritten = 0
    for episode_id in sorted(ended):
        try:
            description = await client.get_workflow_handle(episode_id).describe()
        except RPCError:
            continue
        extended = description.raw_description.workflow_extended_info
        if description.status == WorkflowExecutionStatus.RUNNING or not extended.HasField("last_reset_time"):
            continue
        key = f"reset:{description.run_id}"[:80]
        if await asyncio.to_thread(_has_event, engine, episode_id, key):
            continue
        await _rewrite(client, engine, episode_id)
        rewritten += 1
    return rewritten


async def settle_at_close(client: Client, engine: sa.Engine, episode_id: str) -> None:
    """An ending episode's step rows from its history (its closing audit write does this
    first: activities/audit.py). A chain a reset made is written again from scratch, so
    the rows of the run it abandoned go, as the reset reconciler would."""
    if resets(await episode_runs(client, episode_id)):
        await asyncio.to_thread(_forget, engine, episode_id)  # the abandoned run's rows go
    await rebuild_episode(client, engine, episode_id, steps_only=True)


async def _rewrite(client: Client, engine: sa.Engine, episode_id: str) -> None:
    """The episode's rows again, from its chain alone: the abandoned run's rows go."""
    await asyncio.to_thread(_forget, engine, episode_id)
    try:
        await rebuild_episode(client, engine, episode_id)
    except (LookupError, ValueError):
        # A blob its history needs is gone (drlm verify names it): the episode's row at least.
        await asyncio.to_thread(upsert_episode, engine, await record_of(client, episode_id))


def _has_event(engine: sa.Engine, episode_id: str, key: str) -> bool:
    table = schema.events
    with engine.connect() as conn:
        found = conn.execute(
            sa.select(table.c.event_key).where(table.c.episode_id == episode_id, table.c.event_key == key)
        ).first()
    return found is not None


def _forget(engine: sa.Engine, episode_id: str) -> None:
    with engine.begin() as conn:
        for table in schema.AUDIT_TABLES:
            conn.execute(table.delete().where(table.c.episode_id == episode_id))


async def reconcile_audit(client: Client, engine: sa.Engine) -> int:
    """Settle rows still marked running whose episode has ended without writing its row
    (terminated, timed out, or a worker that could not reach the store)."""
    table = schema.episodes

    def running() -> list[str]:
        with engine.connect() as conn:
            return list(
                conn.execute(sa.select(table.c.episode_id).where(table.c.status == "running")).scalars()
            )

    await settle_resets(client, engine)
    settled = 0
    for episode_id in await asyncio.to_thread(running):
        try:
            record = await record_of(client, episode_id)
        except RPCError:
            continue  # not in this namespace (any more): leave the row as it is
        if record.status != "running":
            await asyncio.to_thread(upsert_episode, engine, record)
            settled += 1
    return settled


def _clear(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        for table in schema.AUDIT_TABLES:
            conn.execute(table.delete())


async def cache_closed_timelines(settings: Settings, address: str, limit: int = 500) -> int:
    """Store the timelines of ended episodes not stored yet (newest first, at most `limit`):
    the shared server runs this before it stops, so `drlm show` answers without it."""
    blobs, engine = open_stores(settings)
    client = await Client.connect(
        address,
        namespace=settings.temporal_namespace,
        data_converter=data_converter(blobs, settings.claim_check_threshold, settings.keyring()),
    )
    await reconcile_audit(client, engine)
    if settings.encryption_keys:  # a stored timeline is clear text at rest: none is kept
        engine.dispose()
        return 0
    known = await asyncio.to_thread(cached_ids, engine)
    stored = 0
    seen: set[str] = set()
    query = f'WorkflowType = "{names.WORKFLOW}" AND ExecutionStatus != "Running"'
    async for execution in client.list_workflows(query):
        if execution.id in known or execution.id in seen:
            continue
        seen.add(execution.id)
        timeline = await episode_timeline(client, execution.id)
        if timeline.status in ENDED:
            description = await client.get_workflow_handle(execution.id).describe()
            stored += await asyncio.to_thread(store_timeline, engine, timeline, description.run_id)
        if len(seen) >= limit:
            break
    engine.dispose()
    return stored
