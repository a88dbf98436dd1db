"""steering: who sent an audited event, and when (a person's actions on a running episode)

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("audit_events") as batch:
        batch.add_column(sa.Column("sender", sa.String(200)))
        batch.add_column(sa.Column("at", sa.DateTime(timezone=True)))


def downgrade() -> None:
    with op.batch_alter_table("audit_events") as batch:
        batch.drop_column("at")
        batch.drop_column("sender")
