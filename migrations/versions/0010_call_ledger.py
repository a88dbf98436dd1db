"""call_ledger: each model request claimed before it is sent, its reply recorded once it came

A step that runs again (a retried attempt) takes the reply from
here instead of paying for the call twice (durable_rlm/store/call_ledger.py).

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "call_ledger",
        sa.Column("call_key", sa.String(64), primary_key=True),
        sa.Column("workflow_id", sa.String(200), nullable=False),
        sa.Column("holder", sa.String(120), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("lease_until", sa.Float, nullable=False),
        sa.Column("reply", sa.LargeBinary),
        sa.Column("claimed_at", sa.Float, nullable=False),
    )
    op.create_index("ix_call_ledger_workflow_id", "call_ledger", ["workflow_id"])


def downgrade() -> None:
    op.drop_index("ix_call_ledger_workflow_id", table_name="call_ledger")
    op.drop_table("call_ledger")
