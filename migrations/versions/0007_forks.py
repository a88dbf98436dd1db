"""forks: an episode's source and the last iteration it inherited (`drlm fork`)

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("episodes") as batch:
        batch.add_column(sa.Column("forked_from", sa.String(200)))
        batch.add_column(sa.Column("forked_at", sa.Integer))
        batch.create_index("ix_episodes_forked_from", ["forked_from"])


def downgrade() -> None:
    with op.batch_alter_table("episodes") as batch:
        batch.drop_index("ix_episodes_forked_from")
        batch.drop_column("forked_at")
        batch.drop_column("forked_from")
