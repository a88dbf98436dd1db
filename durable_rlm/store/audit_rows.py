"""The audit store's rows: each completed step's, and the episode's own, as one function of the
step's input and result (`rows_of_step`, `episode_rows`), and how they are written.

The worker writes them as an episode goes (activities/audit.py), and `drlm audit-rebuild`
applies the same functions to the inputs and results read back from history
(durable_rlm/audit/projection.py), so live and rebuilt tables are equal: the SQL store is a
projection of the histories, which stay the source of truth. Every row has a key derived from
the step (episode, iteration, cell, call), so a retried step rewrites its rows instead of
adding any.
"""

from __future__ import annotations

import functools
import hashlib
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

from durable_rlm.store import schema
from durable_rlm.workflows import names
from durable_rlm.workflows.models import (
    AuditEpisodeInput,
    CellOutcome,
    CompactionReply,
    ExecuteCellInput,
    ExtractionReply,
    ModelSettings,
    ResumeCellInput,
    RootCompletion,
    RootCompletionInput,
    SubQueryInput,
    SubQueryReply,
    TokenUsage,
)

TEXT_CHARS = 100_000
"""Longest text a row keeps (prompts, responses, output); the blob store has every byte."""


@dataclass(frozen=True)
class Row:
    table: sa.Table
    values: dict[str, Any]
    merge: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]] | None = field(default=None)

    @property
    def key(self) -> dict[str, Any]:
        return {c.name: self.values[c.name] for c in self.table.primary_key.columns}


def rows_of_step(episode_id: str, activity_type: str, arg: Any, result: Any) -> list[Row]:
    """The audit rows of one completed step: live (the interceptor) and rebuilt (history)."""
    if activity_type == names.ROOT_COMPLETION:
        return _root_rows(episode_id, arg, result)
    if activity_type == names.SUB_QUERY:
        call = f"sub:{arg.cell_index}.{arg.call_index}"
        return [
            _call_row(episode_id, call, "sub", arg.model, result, result.text, arg.iteration, arg, arg.prompt)
        ]
    if activity_type == names.COMPACT_CONVERSATION and result.removed_messages:
        why = "overflow" if arg.keep_messages == 0 else "window"
        call = f"compact:{arg.iteration}:{why}"
        return [_call_row(episode_id, call, "compaction", arg.model, result, result.summary, arg.iteration)]
    if activity_type == names.EXTRACT_FALLBACK and result.error is None:
        return [_call_row(episode_id, "extract", "extraction", arg.model, result, result.text)]
    if activity_type in (names.REPL_EXECUTE, names.REPL_RESUME):
        return _cell_rows(episode_id, activity_type, arg, result)
    if activity_type == names.RUN_TOOL:
        shown = result.result
        if shown.startswith(names.TOOL_VALUE_PREFIX):  # pickled: what it shows, not its bytes
            shown = shown.partition("\n")[2]
        detail = f"{arg.tool}({_clip(arg.arguments)}) -> {_clip(shown)}"
        key = f"tool:{arg.cell_index}.{arg.call_index}"
        return [_event(episode_id, key, "tool_call", arg.iteration, detail=detail)]
    if activity_type == names.AUDIT_EPISODE:
        return episode_rows(arg)
    return []


def _root_rows(episode_id: str, arg: RootCompletionInput, reply: RootCompletion) -> list[Row]:
    iteration = Row(
        schema.iterations,
        {
            "episode_id": episode_id,
            "iteration": arg.iteration,
            "response": _clip(reply.text),
            "prompt_tokens": reply.usage.prompt_tokens,
            "completion_tokens": reply.usage.completion_tokens,
            "cost_usd": reply.usage.cost_usd,
            "model_time_s": reply.model_time_s,
            "started_at": reply.started_at,
        },
    )
    call = _call_row(episode_id, f"root:{arg.iteration}", "root", arg.model, reply, reply.text, arg.iteration)
    return [iteration, call]


def _call_row(
    episode_id: str,
    call_id: str,
    role: str,
    model: ModelSettings,
    reply: RootCompletion | SubQueryReply | CompactionReply | ExtractionReply,
    text: str,
    iteration: int | None = None,
    site: SubQueryInput | None = None,
    prompt: str | None = None,
) -> Row:
    usage: TokenUsage = reply.usage
    return Row(
        schema.model_calls,
        {
            "episode_id": episode_id,
            "call_id": call_id,
            "role": role,
            "iteration": iteration,
            "cell_index": site.cell_index if site else None,
            "call_index": site.call_index if site else None,
            "provider": model.provider,
            "model": model.model,
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "cost_usd": usage.cost_usd,
            "latency_s": reply.model_time_s,
            "prompt_digest": reply.prompt_digest,
            "response_digest": digest(text),
            "prompt": None if prompt is None else _clip(prompt),
            "response": _clip(text),
            "started_at": reply.started_at,
        },
    )


def _cell_rows(
    episode_id: str, activity_type: str, arg: ExecuteCellInput | ResumeCellInput | None, outcome: CellOutcome
) -> list[Row]:
    """A cell's row grows step by step: the first step gives its code, the last its output.
    A local step's input is not in history, so its echo (in the result) names the cell."""
    echo = outcome.step
    cell_index = echo.cell_index if echo else arg.cell_index  # type: ignore[union-attr]  # no echo: a remote step
    values: dict[str, Any] = {
        "episode_id": episode_id,
        "cell_index": cell_index,
        "status": "completed" if outcome.status == "completed" else "running",
        "sub_calls": max((r.call_index + 1 for r in outcome.requests), default=0),
        "rebuilt": outcome.rebuilt,
    }
    if activity_type == names.REPL_EXECUTE:
        values["iteration"] = echo.iteration if echo else arg.iteration  # type: ignore[union-attr]  # no echo: a remote step
        values["code"] = echo.code if echo else arg.code  # type: ignore[union-attr]  # no echo: a remote step
        values["started_at"] = outcome.started_at
    if outcome.status == "completed":
        values.update(
            stdout=_clip(outcome.stdout),
            stderr=_clip(outcome.stderr),
            error=outcome.error,
            ended_at=outcome.ended_at,
        )
    rows = [Row(schema.cells, values, merge=merge_cell)]
    # A cell's steps each end on their own cell-log node: events of two steps keep apart.
    step = outcome.log_head.removeprefix("sha256:")[:12]
    for number, note in enumerate(outcome.divergences):
        key = f"divergence:{cell_index}:{step}:{number}"
        rows.append(_event(episode_id, key, "replay_divergence", detail=note))
    if outcome.rebuild is not None:
        report = outcome.rebuild
        detail = f"{report.cells_rerun} cell(s) re-run" + (
            f" after the snapshot of cell {report.from_snapshot}" if report.from_snapshot is not None else ""
        )
        rows.append(
            _event(
                episode_id,
                f"rebuilt:{cell_index}:{step}",
                "repl_rebuilt",
                value=report.seconds,
                detail=detail,
            )
        )
    return rows


def merge_cell(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    merged = {**old, **new}
    # A step that did not complete the cell (its first, still running) never undoes one that
    # did, whatever the order their rows arrive in. A later completion wins: the cell was
    # run again after the worker that first completed it was lost before its task did (a
    # SIGKILL), and history holds the later run (a zombie's rows are fenced: see below).
    if old.get("status") == "completed" and new.get("status") != "completed":
        merged.update({k: old[k] for k in ("status", "stdout", "stderr", "error", "ended_at")})
    merged["sub_calls"] = max(old.get("sub_calls") or 0, new["sub_calls"])
    merged["rebuilt"] = bool(old.get("rebuilt")) or new["rebuilt"]
    start, end = merged.get("started_at"), merged.get("ended_at")
    if start is not None and end is not None:
        seconds = (_aware(end) - _aware(start)).total_seconds()
        # Two workers' clocks (a step lost and run again elsewhere) can disagree: a duration
        # below zero is unknown, never stored.
        merged["duration_s"] = round(seconds, 6) if seconds >= 0 else None
    return merged


def episode_rows(record: AuditEpisodeInput) -> list[Row]:
    """The episode's row (written when it starts and when it ends) and its events."""
    values: dict[str, Any] = {
        "episode_id": record.episode_id,
        "run_id": record.run_id,
        "task": record.task[:10_000],
        "root_model": record.root_model,
        "status": record.status,
        "error": record.error,
        "stop_reason": record.error,
        "sub_model": record.sub_model,
        "parent_id": record.parent_id,
        "depth": record.depth,
        "forked_from": record.forked_from,
        "forked_at": record.forked_at,
        "limits": record.limits,
    }
    if record.started_at is not None:
        values["started_at"] = record.started_at
    if record.ended_at is not None:
        values["ended_at"] = record.ended_at
    events = [
        _event(record.episode_id, e.key, e.kind, e.iteration, e.value, e.detail, e.sender, e.at)
        for e in record.events
    ]
    result = record.result
    if result is not None:
        variant = result.execution.variant if result.execution is not None else None
        reason = getattr(variant, "reason", None)
        values.update(
            ended_by=result.ended_by,
            answer=result.answer,
            answer_source=result.answer_source,
            confidence=result.confidence,
            stop_reason=result.stop_reason,
            iterations=result.iterations,
            model_calls=result.model_calls,
            sub_calls=result.sub_calls,
            prompt_tokens=result.usage.prompt_tokens,
            completion_tokens=result.usage.completion_tokens,
            cost_usd=result.usage.cost_usd,
            model_time_s=result.model_time_s,
            tree_episodes=result.tree_episodes,
            error=result.error,
            execution_variant=variant.kind if variant is not None else None,
            fallback_reason=reason.kind if reason is not None and not isinstance(reason, str) else None,
        )
        if result.termination is not None:
            t = result.termination
            events.append(
                _event(
                    record.episode_id,
                    "termination",
                    "termination",
                    t.step + 1,
                    detail=f"{t.policy}: {t.reason}",
                )
            )
        if reason is not None and not isinstance(reason, str):
            events.append(
                _event(
                    record.episode_id, "fallback", "fallback", result.iterations, reason.value, str(reason)
                )
            )
        events.append(
            _event(
                record.episode_id,
                "ended",
                "ended",
                result.iterations,
                detail=f"{result.ended_by}: {result.stop_reason}",
            )
        )
    elif record.status != "running":
        events.append(_event(record.episode_id, "ended", "ended", detail=f"{record.status}: {record.error}"))
    return [Row(schema.episodes, values, merge=_merge_episode), *events]


def _merge_episode(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    return {**old, **new, "updated_at": sa.func.now()}


def _event(
    episode_id: str,
    key: str,
    kind: str,
    iteration: int | None = None,
    value: float | None = None,
    detail: str | None = None,
    sender: str | None = None,
    at: datetime | None = None,
) -> Row:
    values: dict[str, Any] = {
        "episode_id": episode_id,
        "event_key": key,
        "kind": kind,
        "iteration": iteration,
        "value": value,
        "detail": None if detail is None else _clip(detail),
    }
    if sender is not None:  # a steering action: who sent it, and when it was accepted
        values.update(sender=sender, at=at)
    return Row(schema.events, values)


REDACTED = "(encrypted)"
PRIVATE_COLUMNS = {
    "episodes": frozenset({"task", "answer", "error"}),
    "audit_iterations": frozenset({"response"}),
    "audit_model_calls": frozenset({"prompt", "response"}),
    "audit_cells": frozenset({"code", "stdout", "stderr", "error"}),
    "audit_events": frozenset({"detail"}),
}
"""The columns that hold model or user text: with DRLM_ENCRYPTION_KEYS they are written as
REDACTED (the history, sealed, has them); digests, tokens, costs and times stay."""

_PRIVATE_STORES: weakref.WeakSet[sa.Engine] = weakref.WeakSet()


def keep_text_out(engine: sa.Engine) -> None:
    """Write no model or user text into this store's audit rows (its payloads are encrypted:
    clear text here would undo that). Live rows and rebuilt ones alike (`write_rows`)."""
    _PRIVATE_STORES.add(engine)


def _redacted(table: sa.Table, values: dict[str, Any]) -> dict[str, Any]:
    private = PRIVATE_COLUMNS.get(table.name, frozenset())
    return {k: (REDACTED if k in private and v else v) for k, v in values.items()}


def write_rows(engine: sa.Engine, rows: Sequence[Row]) -> None:
    """Upsert the rows in one transaction: a row's key finds the row a retry wrote before.

    On SQLite and PostgreSQL each row is one `INSERT ... ON CONFLICT (key) DO UPDATE`,
    built once per table and set of columns and run for runs of rows alike at once: the
    statements the old update-then-insert built per row were a sixth of a busy worker's CPU
    (bench/profile_worker.py). Elsewhere, an update, then an insert if no row had the key."""
    private = engine in _PRIVATE_STORES
    dialect = engine.dialect.name
    with engine.begin() as conn:
        batch: list[dict[str, Any]] = []
        statement: Any = None
        for row in rows:
            table = row.table
            values = _redacted(table, row.values) if private else row.values
            if row.merge is not None:
                if batch:  # the merge reads the rows before it
                    conn.execute(statement, batch)
                    batch, statement = [], None
                old = conn.execute(sa.select(table).where(_where(row))).mappings().first()
                values = row.merge(dict(old) if old is not None else {}, values)
            if dialect not in _UPSERT_DIALECTS:
                updated = conn.execute(table.update().where(_where(row)).values(**values)).rowcount
                if not updated:
                    conn.execute(table.insert().values(**{**row.key, **values}))
                continue
            if any(isinstance(v, sa.ClauseElement) for v in values.values()):
                # A value computed by the store (`now()`): in the statement, not a parameter.
                one = _upsert(dialect, table, tuple(sorted(values)))
                conn.execute(one.values(**{**row.key, **values}))
                continue
            wanted = _upsert(dialect, table, tuple(sorted({**row.key, **values})))
            if wanted is not statement and batch:
                conn.execute(statement, batch)
                batch = []
            statement = wanted
            batch.append({**row.key, **values})
        if batch:
            conn.execute(statement, batch)


def _where(row: Row) -> sa.ColumnElement[bool]:
    return sa.and_(*(row.table.c[name] == value for name, value in row.key.items()))


_UPSERT_DIALECTS = ("sqlite", "postgresql")


@functools.lru_cache(maxsize=256)
def _upsert(dialect: str, table: sa.Table, columns: tuple[str, ...]) -> Any:
    """`INSERT ... ON CONFLICT (primary key) DO UPDATE SET` the other columns given."""
    statement: sqlite.Insert | postgresql.Insert  # each dialect's own ON CONFLICT
    if dialect == "sqlite":
        from sqlalchemy.dialects import sqlite  # optional: the dialect the store uses

        statement = sqlite.insert(table)
    else:
        from sqlalchemy.dialects import postgresql  # optional: the dialect the store uses

        statement = postgresql.insert(table)
    keys = [c.name for c in table.primary_key.columns]
    others = {name: statement.excluded[name] for name in columns if name not in keys}
    if not others:
        return statement.on_conflict_do_nothing(index_elements=keys)
    return statement.on_conflict_do_update(index_elements=keys, set_=others)


def digest(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _clip(text: str) -> str:
    return (
        text
        if len(text) <= TEXT_CHARS
        else text[:TEXT_CHARS] + f"\n[... {len(text) - TEXT_CHARS} more chars]"
    )


def _aware(moment: datetime) -> datetime:
    """SQLite hands datetimes back naive (in UTC); the results' are aware."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def upsert_episode(engine: sa.Engine, record: AuditEpisodeInput) -> None:
    """The episode's row and events alone (reconciling an episode that ended unaudited)."""
    write_rows(engine, episode_rows(record))
