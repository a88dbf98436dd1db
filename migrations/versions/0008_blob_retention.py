"""blob retention: when `drlm gc` removed the blobs of an episode whose history is gone

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("episode_timelines") as batch:
        batch.add_column(sa.Column("blobs_expired_at", sa.DateTime(timezone=True)))


def downgrade() -> None:
    with op.batch_alter_table("episode_timelines") as batch:
        batch.drop_column("blobs_expired_at")
