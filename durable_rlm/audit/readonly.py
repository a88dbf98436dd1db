"""Answers from the SQL store alone: `drlm show` of an ended episode and `drlm list` need
no Temporal server (and must not start one), so they answer in a fraction of a second.

The queries are SQL text, run by store/reading.py's readers: the standard library's sqlite3
for a SQLite file (`drlm show`/`list` without SQLAlchemy's import, issue 36), SQLAlchemy's
engine for any other store. A function here takes a reader or an engine.

The tables are projections of histories (DESIGN invariant 6): a timeline is stored only
once its episode ended, when its history can no longer change (audit/timeline_store.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from durable_rlm.settings import Settings
from durable_rlm.store.reading import Reader, as_reader, open_reader

if TYPE_CHECKING:  # start-up: `drlm list` needs no timeline (issue 36)
    from durable_rlm.audit.timeline import Timeline

ENDED = ("answered", "extracted", "no_answer", "failed", "cancelled", "terminated", "timed_out")
"""workflows/models.py's ENDINGS (a test holds them equal), named here because importing the
models costs `drlm list` 0.2 s."""
TURN_ID = re.compile(r"^(?P<session>.+)-turn(?P<turn>\d+)$")
"""A persistent session's turn episode (workflows/names.py's turn_episode_id): the audit store
has no session column, so `drlm list` groups a session's turns by their ids."""

EPISODE_COLUMNS = (
    "episode_id run_id task root_model status ended_by answer iterations model_calls prompt_tokens "
    "completion_tokens error updated_at answer_source confidence stop_reason parent_id depth "
    "sub_model limits execution_variant fallback_reason started_at ended_at sub_calls cost_usd "
    "model_time_s tree_episodes forked_from forked_at"
).split()
"""store/schema.py's `episodes` columns in its order (tests/test_readonly.py holds them equal):
named here so that reading them needs no SQLAlchemy."""
EPISODE_DATETIMES = ("updated_at", "started_at", "ended_at")

CACHED_TIMELINE = """
SELECT t.timeline FROM episode_timelines AS t
WHERE t.episode_id = :episode_id
  AND COALESCE((SELECT e.run_id FROM episodes AS e WHERE e.episode_id = :episode_id), t.run_id) = t.run_id
"""


def open_existing(settings: Settings) -> Reader | None:
    """A reader of the SQL store if it exists (nothing is created or migrated)."""
    return open_reader(settings.effective_database_url)


def cached_timeline(source: Any, episode_id: str) -> Timeline | None:
    """The stored timeline, if it is of the run the audit row names: a `temporal workflow
    reset` makes a new current run, whose row (written by it, or by the reconciler) names it."""
    reader = as_reader(source)
    try:
        found = reader.rows(CACHED_TIMELINE, {"episode_id": episode_id})
    except reader.errors:  # an older schema: no table yet
        return None
    if not found:
        return None
    from durable_rlm.audit.timeline import Timeline  # start-up: the models behind it cost drlm list 0.05 s

    return Timeline.model_validate_json(found[0].timeline)


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

    def clauses(self) -> tuple[list[str], dict[str, Any]]:
        """The SQL conditions on `episodes` and their parameters."""
        clauses: list[str] = []
        params: dict[str, Any] = {}

        def add(clause: str, **values: Any) -> None:
            clauses.append(clause)
            params.update(values)

        if self.status is not None:
            add("status = :status", status=self.status)
        if self.model is not None:
            add("(root_model = :model OR sub_model = :model)", model=self.model)
        if self.since is not None:
            add(f"{STARTED} >= :since", since=self.since)
        if self.until is not None:
            add(f"{STARTED} < :until", until=self.until)
        if self.min_cost is not None:
            add("cost_usd >= :min_cost", min_cost=self.min_cost)
        if self.max_cost is not None:
            add("cost_usd <= :max_cost", max_cost=self.max_cost)
        if self.roots_only:
            add("parent_id IS NULL")
        return clauses, params


STARTED = "COALESCE(started_at, updated_at)"
"""When an episode started; one without a start time (before revision 0004): its last write."""


def episode_rows(source: Any, limit: int, where: EpisodeFilter | None = None) -> list[Any]:
    """The newest episodes first (an episode without a start time: by its last write)."""
    reader = as_reader(source)
    present = reader.columns("episodes")
    if not present:
        return []  # no audit table yet: nothing has run against this store
    missing = [name for name in EPISODE_COLUMNS if name not in present]
    if missing and where is not None and where.needs_new_columns:
        # A store from before the latest migration (it migrates when a worker or a run
        # opens it): list what it has; a filter on a column it lacks is a clear error.
        raise LookupError(
            f"the audit store has an older schema (no {', '.join(missing[:3])}, ...) for these "
            "filters: `drlm list --refresh` migrates it"
        )
    columns = ", ".join(name if name in present else f"NULL AS {name}" for name in EPISODE_COLUMNS)
    clauses, params = (where or EpisodeFilter()).clauses()
    started = STARTED if "started_at" in present else "updated_at"
    sql = (
        f"SELECT {columns} FROM episodes"
        + (f" WHERE {' AND '.join(clauses)}" if clauses else "")
        + f" ORDER BY {started} DESC LIMIT :limit"
    )
    return reader.rows(sql, {**params, "limit": limit}, EPISODE_DATETIMES)


def turn_of(episode_id: str) -> tuple[str, int] | None:
    """(session id, turn) if the id is a session turn's, by its form alone."""
    found = TURN_ID.match(episode_id)
    return None if found is None else (found["session"], int(found["turn"]))


def turn_rows(source: Any, session_id: str) -> list[Any]:
    """The audit rows of a session's turns, in turn order (a turn not written yet is absent)."""
    reader = as_reader(source)
    escaped = session_id.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    sql = f"SELECT {', '.join(EPISODE_COLUMNS)} FROM episodes WHERE episode_id LIKE :pattern ESCAPE '\\'"
    try:
        rows = reader.rows(sql, {"pattern": f"{escaped}-turn%"}, EPISODE_DATETIMES)
    except reader.errors:  # no audit table yet, or an older schema
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


def grouped_rows(source: Any, limit: int, where: EpisodeFilter | None = None) -> list[Any]:
    """`drlm list`'s entries, newest first: episode rows, and a SessionRows in place of a
    session's turns (all of them, whichever matched the filter), up to `limit` entries."""
    reader = as_reader(source)
    fetch = limit
    while True:
        rows = episode_rows(reader, fetch, where)
        entries: list[Any] = []
        sessions: dict[str, SessionRows | None] = {}
        for row in rows:
            found = turn_of(row.episode_id) if not row.parent_id else None
            if found is not None and found[0] not in sessions:
                turns = turn_rows(reader, found[0])
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
