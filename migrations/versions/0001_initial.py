"""blobs and episodes

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "blobs",
        sa.Column("digest", sa.String(80), primary_key=True),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.Column("data", sa.LargeBinary, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    )
    op.create_table(
        "episodes",
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
    )


def downgrade() -> None:
    op.drop_table("episodes")
    op.drop_table("blobs")
