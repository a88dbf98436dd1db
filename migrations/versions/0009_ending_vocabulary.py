"""episodes: one vocabulary of endings (answered, extracted, no_answer) instead of "completed"

Earlier rows said "completed" of any episode that returned a result, with an answer or
without one. Each is rewritten to the ending its own columns show, as the code now writes
it (workflows/models.py `ending_of_result`); a kept timeline's status and JSON alike.

Revision ID: 0009
Revises: 0008
"""

import json

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

FAILURES = ("model_error", "infrastructure_error")
NEW_ENDINGS = ("answered", "extracted", "no_answer")

_ENDING = sa.text(
    """
    UPDATE episodes SET status = CASE
        WHEN ended_by = 'cancelled' THEN 'cancelled'
        WHEN answer IS NULL AND ended_by IN ('model_error', 'infrastructure_error') THEN 'failed'
        WHEN answer IS NULL THEN 'no_answer'
        WHEN answer_source = 'extraction' THEN 'extracted'
        ELSE 'answered'
    END
    WHERE status = 'completed'
    """
)


def _ending(result: dict) -> str:
    if result.get("ended_by") == "cancelled":
        return "cancelled"
    if result.get("answer") is None:
        return "failed" if result.get("ended_by") in FAILURES else "no_answer"
    return "extracted" if result.get("answer_source") == "extraction" else "answered"


def _rewrite_timelines(connection: sa.Connection, legacy: bool) -> None:
    """Each kept timeline's status, in its column and in its JSON: from its result (up), or
    back to "completed" for the three endings that word covered (down)."""
    table = sa.table("episode_timelines", sa.column("episode_id"), sa.column("status"), sa.column("timeline"))
    wanted = NEW_ENDINGS if legacy else ("completed",)
    rows = connection.execute(
        sa.select(table.c.episode_id, table.c.timeline).where(table.c.status.in_(wanted))
    ).all()
    for episode_id, text in rows:
        try:
            timeline = json.loads(text)
        except ValueError:
            continue  # a row that cannot be read is left as it is (the timeline is a projection)
        result = timeline.get("result")
        if legacy:
            status = "completed"
        elif isinstance(result, dict):
            status = _ending(result)
        else:
            continue
        timeline["status"] = status
        connection.execute(
            table.update()
            .where(table.c.episode_id == episode_id)
            .values(status=status, timeline=json.dumps(timeline))
        )


def upgrade() -> None:
    connection = op.get_bind()
    connection.execute(_ENDING)
    _rewrite_timelines(connection, legacy=False)


def downgrade() -> None:
    connection = op.get_bind()
    back = sa.text("UPDATE episodes SET status = 'completed' WHERE status IN :endings")
    connection.execute(back.bindparams(sa.bindparam("endings", value=list(NEW_ENDINGS), expanding=True)))
    _rewrite_timelines(connection, legacy=True)
