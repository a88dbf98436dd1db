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

# A projection of histories (DESIGN invariant 6): written by the audit activity, and
# droppable; Temporal's history stays the source of truth.
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
)

# Timelines of ended episodes (a projection too): `drlm show` reads them without a server.
episode_timelines = sa.Table(
    "episode_timelines",
    metadata,
    sa.Column("episode_id", sa.String(200), primary_key=True),
    sa.Column("run_id", sa.String(80), nullable=False),
    sa.Column("status", sa.String(20), nullable=False),
    sa.Column("timeline", sa.Text, nullable=False),
    sa.Column("cached_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
)

SCHEMA_REVISION = "0003"  # alembic head; a test checks they agree
