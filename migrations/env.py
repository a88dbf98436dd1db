"""Alembic environment: runs on the connection durable_rlm.store.sql hands over, or on the URL."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context

from durable_rlm.store.schema import metadata

config = context.config


def run_migrations(connection: sa.Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        render_as_batch=True,  # SQLite cannot ALTER most things; batch mode rebuilds tables
    )
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    run_migrations(connection)
else:
    url = config.get_main_option("sqlalchemy.url")
    if url is None:  # alembic run by hand, with an ini that names no database
        raise SystemExit("no database to migrate: set sqlalchemy.url (durable_rlm.store.sql.migrate does)")
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        run_migrations(conn)
