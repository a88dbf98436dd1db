"""Tables of the SQL store. Alembic migrations (migrations/) create them; this module is
what the code reads and writes, and a test checks the two agree."""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

blobs = sa.Table(
    "blobs",
    metadata,
    sa.Column("digest", sa.String(80), primary_key=True),
    sa.Column("size", sa.BigInteger, nullable=False),
    sa.Column("data", sa.LargeBinary, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
)

# A projection of histories (docs/architecture/index.md#invariants): written by the audit
# activity, and droppable; Temporal's history stays the source of truth.
episodes = sa.Table(
    "episodes",
    metadata,
    sa.Column("episode_id", sa.String(200), primary_key=True),
    sa.Column("run_id", sa.String(80), nullable=False),
    sa.Column("task", sa.Text, nullable=False),
    sa.Column("root_model", sa.String(200), nullable=False),
    sa.Column("status", sa.String(20), nullable=False),
    sa.Column("ended_by", sa.String(40)),
    sa.Column("answer", sa.Text),
    sa.Column("iterations", sa.Integer),
    sa.Column("model_calls", sa.Integer),
    sa.Column("prompt_tokens", sa.Integer),
    sa.Column("completion_tokens", sa.Integer),
    sa.Column("error", sa.Text),
    sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    sa.Column("answer_source", sa.String(20)),
    sa.Column("confidence", sa.Float),
    sa.Column("stop_reason", sa.Text),
    # Since 0004: the request, the tree, timings and cost.
    sa.Column("parent_id", sa.String(200), index=True),
    sa.Column("depth", sa.Integer),
    sa.Column("sub_model", sa.String(200)),
    sa.Column("limits", sa.Text),  # the request's limits, JSON
    sa.Column("execution_variant", sa.String(20)),  # submitted / extracted / stopped / failed
    sa.Column("fallback_reason", sa.String(40)),
    sa.Column("started_at", sa.DateTime(timezone=True)),
    sa.Column("ended_at", sa.DateTime(timezone=True)),
    sa.Column("sub_calls", sa.Integer),
    sa.Column("cost_usd", sa.Float),  # null: a call's price was unknown
    sa.Column("model_time_s", sa.Float),
    sa.Column("tree_episodes", sa.Integer),
    # Since 0007: a fork's source and the last iteration it inherited.
    sa.Column("forked_from", sa.String(200), index=True),
    sa.Column("forked_at", sa.Integer),
)

# Call granularity (0004): written by each step's activity as it completes, keyed so a
# retried step writes its row again rather than a second one.
iterations = sa.Table(
    "audit_iterations",
    metadata,
    sa.Column("episode_id", sa.String(200), primary_key=True),
    sa.Column("iteration", sa.Integer, primary_key=True),
    sa.Column("response", sa.Text, nullable=False),
    sa.Column("prompt_tokens", sa.Integer, nullable=False),
    sa.Column("completion_tokens", sa.Integer, nullable=False),
    sa.Column("cost_usd", sa.Float),
    sa.Column("model_time_s", sa.Float, nullable=False),
    sa.Column("started_at", sa.DateTime(timezone=True)),
)

model_calls = sa.Table(
    "audit_model_calls",
    metadata,
    sa.Column("episode_id", sa.String(200), primary_key=True),
    sa.Column("call_id", sa.String(80), primary_key=True),  # root:3, sub:5.2, compact:3:window, extract
    sa.Column("role", sa.String(20), nullable=False),  # root / sub / compaction / extraction
    sa.Column("iteration", sa.Integer),
    sa.Column("cell_index", sa.Integer),
    sa.Column("call_index", sa.Integer),
    sa.Column("provider", sa.String(20), nullable=False),
    sa.Column("model", sa.String(200), nullable=False),
    sa.Column("prompt_tokens", sa.Integer, nullable=False),
    sa.Column("completion_tokens", sa.Integer, nullable=False),
    sa.Column("cost_usd", sa.Float),
    sa.Column("latency_s", sa.Float, nullable=False),
    sa.Column("prompt_digest", sa.String(80)),
    sa.Column("response_digest", sa.String(80), nullable=False),
    sa.Column("prompt", sa.Text),  # sub-calls: the prompt the cell sent (root prompts: see prompt_digest)
    sa.Column("response", sa.Text, nullable=False),
    sa.Column("started_at", sa.DateTime(timezone=True)),
)

cells = sa.Table(
    "audit_cells",
    metadata,
    sa.Column("episode_id", sa.String(200), primary_key=True),
    sa.Column("cell_index", sa.Integer, primary_key=True),
    sa.Column("iteration", sa.Integer),
    sa.Column("code", sa.Text),
    sa.Column("status", sa.String(20), nullable=False),  # running / completed
    sa.Column("stdout", sa.Text),
    sa.Column("stderr", sa.Text),
    sa.Column("error", sa.Text),
    sa.Column("sub_calls", sa.Integer, nullable=False),
    sa.Column("rebuilt", sa.Boolean, nullable=False),
    sa.Column("started_at", sa.DateTime(timezone=True)),
    sa.Column("ended_at", sa.DateTime(timezone=True)),
    sa.Column("duration_s", sa.Float),
)

events = sa.Table(
    "audit_events",
    metadata,
    sa.Column("episode_id", sa.String(200), primary_key=True),
    sa.Column("event_key", sa.String(80), primary_key=True),
    # termination / fallback / ended / reward / cancel_requested / replay_divergence / repl_rebuilt
    # / action_* (a person's steering: hint, limits, pause, resume, finish, approve, edit, reject; gate)
    sa.Column("kind", sa.String(40), nullable=False, index=True),
    sa.Column("iteration", sa.Integer),
    sa.Column("value", sa.Float),
    sa.Column("detail", sa.Text),
    sa.Column("sender", sa.String(200)),  # steering actions (0006): who sent it, and when
    sa.Column("at", sa.DateTime(timezone=True)),
)

AUDIT_TABLES = (episodes, iterations, model_calls, cells, events)
"""The projection: what `drlm audit-rebuild` writes from histories alone."""

# Timelines of ended episodes (a projection too): `drlm show` reads them without a server.
episode_timelines = sa.Table(
    "episode_timelines",
    metadata,
    sa.Column("episode_id", sa.String(200), primary_key=True),
    sa.Column("run_id", sa.String(80), nullable=False),
    sa.Column("status", sa.String(20), nullable=False),
    sa.Column("timeline", sa.Text, nullable=False),
    sa.Column("cached_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    # Since 0008: its history went past the namespace's retention and `drlm gc` removed the
    # blobs only it named; the timeline's text stays, its blob references are not checked.
    sa.Column("blobs_expired_at", sa.DateTime(timezone=True)),
)

# What every process using this store must agree on (0005): where the blobs live.
store_facts = sa.Table(
    "store_facts",
    metadata,
    sa.Column("name", sa.String(80), primary_key=True),
    sa.Column("value", sa.Text, nullable=False),
    sa.Column("recorded_by", sa.Text, nullable=False),
    sa.Column("recorded_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
)

# Since 0010: each model request an episode paid for, by the step and the call that made it,
# claimed before it is sent and holding its reply once it came (durable_rlm/store/call_ledger.py).
# Operational state, not a projection: a replay takes a recorded reply from here instead of
# asking the model again. Rows go some minutes after their episode's audit row closed.
call_ledger = sa.Table(
    "call_ledger",
    metadata,
    sa.Column("call_key", sa.String(64), primary_key=True),
    sa.Column("workflow_id", sa.String(200), nullable=False, index=True),
    sa.Column("holder", sa.String(120), nullable=False),
    sa.Column("host", sa.String(255), nullable=False),
    sa.Column("lease_until", sa.Float, nullable=False),
    sa.Column("reply", sa.LargeBinary),
    sa.Column("claimed_at", sa.Float, nullable=False),  # seconds since the epoch, as lease_until
)

SCHEMA_REVISION = "0010"  # alembic head; a test checks they agree
