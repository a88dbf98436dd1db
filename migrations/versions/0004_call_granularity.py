"""audit at call granularity: iterations, model calls, cells, events; episodes gain the
request, the tree, timings and cost

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

EPISODE_COLUMNS = (
    sa.Column("parent_id", sa.String(200)),
    sa.Column("depth", sa.Integer),
    sa.Column("sub_model", sa.String(200)),
    sa.Column("limits", sa.Text),
    sa.Column("execution_variant", sa.String(20)),
    sa.Column("fallback_reason", sa.String(40)),
    sa.Column("started_at", sa.DateTime(timezone=True)),
    sa.Column("ended_at", sa.DateTime(timezone=True)),
    sa.Column("sub_calls", sa.Integer),
    sa.Column("cost_usd", sa.Float),
    sa.Column("model_time_s", sa.Float),
    sa.Column("tree_episodes", sa.Integer),
)


def upgrade() -> None:
    with op.batch_alter_table("episodes") as batch:
        for column in EPISODE_COLUMNS:
            batch.add_column(column.copy())
    op.create_index("ix_episodes_parent_id", "episodes", ["parent_id"])
    op.create_table(
        "audit_iterations",
        sa.Column("episode_id", sa.String(200), primary_key=True),
        sa.Column("iteration", sa.Integer, primary_key=True),
        sa.Column("response", sa.Text, nullable=False),
        sa.Column("prompt_tokens", sa.Integer, nullable=False),
        sa.Column("completion_tokens", sa.Integer, nullable=False),
        sa.Column("cost_usd", sa.Float),
        sa.Column("model_time_s", sa.Float, nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True)),
    )
    op.create_table(
        "audit_model_calls",
        sa.Column("episode_id", sa.String(200), primary_key=True),
        sa.Column("call_id", sa.String(80), primary_key=True),
        sa.Column("role", sa.String(20), nullable=False),
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
        sa.Column("prompt", sa.Text),
        sa.Column("response", sa.Text, nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True)),
    )
    op.create_table(
        "audit_cells",
        sa.Column("episode_id", sa.String(200), primary_key=True),
        sa.Column("cell_index", sa.Integer, primary_key=True),
        sa.Column("iteration", sa.Integer),
        sa.Column("code", sa.Text),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("stdout", sa.Text),
        sa.Column("stderr", sa.Text),
        sa.Column("error", sa.Text),
        sa.Column("sub_calls", sa.Integer, nullable=False),
        sa.Column("rebuilt", sa.Boolean, nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True)),
        sa.Column("ended_at", sa.DateTime(timezone=True)),
        sa.Column("duration_s", sa.Float),
    )
    op.create_table(
        "audit_events",
        sa.Column("episode_id", sa.String(200), primary_key=True),
        sa.Column("event_key", sa.String(80), primary_key=True),
        sa.Column("kind", sa.String(40), nullable=False),
        sa.Column("iteration", sa.Integer),
        sa.Column("value", sa.Float),
        sa.Column("detail", sa.Text),
    )
    op.create_index("ix_audit_events_kind", "audit_events", ["kind"])


def downgrade() -> None:
    op.drop_index("ix_audit_events_kind", "audit_events")
    for table in ("audit_events", "audit_cells", "audit_model_calls", "audit_iterations"):
        op.drop_table(table)
    op.drop_index("ix_episodes_parent_id", "episodes")
    with op.batch_alter_table("episodes") as batch:
        for column in reversed(EPISODE_COLUMNS):
            batch.drop_column(column.name)
