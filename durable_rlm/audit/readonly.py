"""Answers from the SQL store alone: `drlm show` of an ended episode and `drlm list` need
no Temporal server (and must not start one), so they answer in a fraction of a second.

The tables are projections of histories (DESIGN invariant 6): a timeline is stored only
once its episode ended, when its history can no longer change.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from durable_rlm.settings import Settings
from durable_rlm.store import schema
from durable_rlm.store.sql import create_engine

if TYPE_CHECKING:  # start-up: `drlm list` needs no timeline (issue 36)
    from durable_rlm.audit.timeline import Timeline

ENDED = ("completed", "failed", "cancelled", "terminated", "timed_out")
TURN_ID = re.compile(r"^(?P<session>.+)-turn(?P<turn>\d+)$")
"""A persistent session's turn episode (workflows/names.py's turn_episode_id): the audit store
has no session column, so `drlm list` groups a session's turns by their ids."""


def open_existing(settings: Settings) -> sa.Engine | None:
    """An engine on the SQL store if it exists (nothing is created or migrated)."""
    url = settings.effective_database_url
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).is_file():
        return None
    return create_engine(url)


def cached_timeline(engine: sa.Engine, episode_id: str) -> Timeline | None:
    """The stored timeline, if it is of the run the audit row names: a `temporal workflow
    reset` makes a new current run, whose row (written by it, or by the reconciler) names it."""
    table, rows = schema.episode_timelines, schema.episodes
    current = sa.select(rows.c.run_id).where(rows.c.episode_id == episode_id).scalar_subquery()
    try:
        with engine.connect() as conn:
            found = conn.execute(
                sa.select(table.c.timeline).where(
                    table.c.episode_id == episode_id,
                    sa.or_(current.is_(None), table.c.run_id == current),
                )
            ).scalar_one_or_none()
    except sa.exc.DatabaseError:  # an older schema: no table yet
        return None
    from durable_rlm.audit.timeline import Timeline  # start-up: the models behind it cost drlm list 0.05 s

    return None if found is None else Timeline.model_validate_json(found)


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


@dataclass(frozen=True)
class EpisodeFilter:
    """What `drlm list` narrows the audit store's episodes to; None: any."""

    status: str | None = None
    model: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    min_cost: float | None = None
    max_cost: float | None = None
    roots_only: bool = False

    @property
    def active(self) -> bool:
        return self.status is not None or self.needs_new_columns

    @property
    def needs_new_columns(self) -> bool:
        """Whether it filters on columns the audit store has had only since revision 0004."""
        return (
            any(v is not None for v in (self.model, self.since, self.until, self.min_cost, self.max_cost))
            or self.roots_only
        )

    def clauses(self, table: sa.Table) -> list[Any]:
        clauses: list[Any] = []
        if self.status is not None:
            clauses.append(table.c.status == self.status)
        if self.model is not None:
            clauses.append(sa.or_(table.c.root_model == self.model, table.c.sub_model == self.model))
        started = sa.func.coalesce(table.c.started_at, table.c.updated_at)
        if self.since is not None:
            clauses.append(started >= self.since)
        if self.until is not None:
            clauses.append(started < self.until)
        if self.min_cost is not None:
            clauses.append(table.c.cost_usd >= self.min_cost)
        if self.max_cost is not None:
            clauses.append(table.c.cost_usd <= self.max_cost)
        if self.roots_only:
            clauses.append(table.c.parent_id.is_(None))
        return clauses


def episode_rows(engine: sa.Engine, limit: int, where: EpisodeFilter | None = None) -> Sequence[sa.Row]:
    """The newest episodes first (an episode without a start time: by its last write)."""
    table = schema.episodes
    try:
        present = {column["name"] for column in sa.inspect(engine).get_columns(table.name)}
    except sa.exc.DatabaseError:
        present = set()
    if not present:
        return []  # no audit table yet: nothing has run against this store
    missing = [c.name for c in table.columns if c.name not in present]
    if missing:
        # A store from before the latest migration (it migrates when a worker or a run
        # opens it): list what it has; a filter on a column it lacks is a clear error.
        if where is not None and where.needs_new_columns:
            raise LookupError(
                f"the audit store has an older schema (no {', '.join(missing[:3])}, ...) for these "
                "filters: `drlm list --refresh` migrates it"
            )
    columns = [c if c.name in present else sa.null().label(c.name) for c in table.columns]
    updated = table.c.updated_at
    started = sa.func.coalesce(table.c.started_at, updated) if "started_at" in present else updated
    query = sa.select(*columns).where(*(where or EpisodeFilter()).clauses(table)).order_by(started.desc())
    with engine.connect() as conn:
        return conn.execute(query.limit(limit)).all()


def turn_of(episode_id: str) -> tuple[str, int] | None:
    """(session id, turn) if the id is a session turn's, by its form alone."""
    found = TURN_ID.match(episode_id)
    return None if found is None else (found["session"], int(found["turn"]))


def turn_rows(engine: sa.Engine, session_id: str) -> list[sa.Row]:
    """The audit rows of a session's turns, in turn order (a turn not written yet is absent)."""
    table = schema.episodes
    escaped = session_id.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.select(table).where(table.c.episode_id.like(f"{escaped}-turn%", escape="\\"))
            ).all()
    except sa.exc.DatabaseError:  # no audit table yet, or an older schema
        return []
    numbered = [
        (found[1], row) for row in rows if (found := turn_of(row.episode_id)) and found[0] == session_id
    ]
    return [row for _, row in sorted(numbered, key=lambda pair: pair[0])]


@dataclass
class SessionRows:
    """A session as `drlm list` shows it: one line for all its turns' rows."""

    session_id: str
    turns: list[Any] = field(default_factory=list)
    status: str | None = None  # the session's own (from the server), when read

    @property
    def last(self) -> Any:
        return self.turns[-1]

    def summary(self) -> dict[str, Any]:
        """The session's line as `drlm list --json` prints it (its turns' rows under `turns`)."""
        last, first = self.last, self.turns[0]
        costs = [row.cost_usd for row in self.turns]
        return {
            "kind": "session",
            "episode_id": self.session_id,
            "session_id": self.session_id,
            "status": self.status or last.status,
            "session_status": self.status,
            "turn_count": len(self.turns),
            "last_turn": last.episode_id,
            "last_turn_status": last.status,
            "ended_by": last.ended_by,
            "root_model": last.root_model,
            "task": last.task,
            "answer": last.answer,
            "iterations": _total(row.iterations for row in self.turns),
            "model_calls": _total(row.model_calls for row in self.turns),
            "prompt_tokens": _total(row.prompt_tokens for row in self.turns),
            "completion_tokens": _total(row.completion_tokens for row in self.turns),
            "cost_usd": None if any(c is None for c in costs) else sum(costs),
            "started_at": first.started_at,
            "ended_at": last.ended_at,
            "depth": 0,
            "turns": [dict(row._mapping) for row in self.turns],
        }


def _total(values: Any) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def grouped_rows(engine: sa.Engine, limit: int, where: EpisodeFilter | None = None) -> list[Any]:
    """`drlm list`'s entries, newest first: episode rows, and a SessionRows in place of a
    session's turns (all of them, whichever matched the filter), up to `limit` entries."""
    fetch = limit
    while True:
        rows = episode_rows(engine, fetch, where)
        entries: list[Any] = []
        sessions: dict[str, SessionRows | None] = {}
        for row in rows:
            found = turn_of(row.episode_id) if not row.parent_id else None
            if found is not None and found[0] not in sessions:
                turns = turn_rows(engine, found[0])
                # Only named like a turn when no turn 0 stands beside it: an episode of its own.
                whole = bool(turns) and turns[0].episode_id.endswith("-turn0")
                sessions[found[0]] = SessionRows(found[0], turns) if whole else None
                if whole:
                    entries.append(sessions[found[0]])
                    continue
            if found is None or sessions[found[0]] is None:
                entries.append(row)
        if len(entries) >= limit or len(rows) < fetch:
            return entries[:limit]
        fetch *= 2


def parse_moment(text: str, now: datetime | None = None) -> datetime:
    """An ISO date or time (UTC unless it says), or an age: 30m, 24h, 7d, 2w."""
    units = {"m": 60, "h": 3_600, "d": 86_400, "w": 604_800}
    text = text.strip()
    if text[:-1].isdigit() and text[-1:] in units:
        return (now or datetime.now(UTC)) - timedelta(seconds=int(text[:-1]) * units[text[-1]])
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"{text!r} is neither a date or time (2026-11-24T10:00) nor an age (24h, 7d)"
        ) from None
    return (moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)).astimezone(UTC)
