"""episode_timelines: the timeline of each ended episode, so `drlm show` needs no server

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "episode_timelines",
        sa.Column("episode_id", sa.String(200), primary_key=True),
        sa.Column("run_id", sa.String(80), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("timeline", sa.Text, nullable=False),
        sa.Column("cached_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("episode_timelines")
