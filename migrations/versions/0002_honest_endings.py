"""episodes: answer source, confidence and stop reason

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("episodes") as batch:
        batch.add_column(sa.Column("answer_source", sa.String(20)))
        batch.add_column(sa.Column("confidence", sa.Float))
        batch.add_column(sa.Column("stop_reason", sa.Text))


def downgrade() -> None:
    with op.batch_alter_table("episodes") as batch:
        batch.drop_column("stop_reason")
        batch.drop_column("confidence")
        batch.drop_column("answer_source")
