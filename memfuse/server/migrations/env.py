"""Alembic environment of the control-plane schema (run by ``memfuse.server.schema``).

Online only through a connection handed over in ``config.attributes["connection"]``: the
caller has already begun the transaction and taken the migration lock (``BEGIN IMMEDIATE``
on SQLite, an advisory transaction lock on PostgreSQL), so every revision and the version
stamp commit or roll back together. Offline (``memfuse db upgrade --sql``) renders the SQL for
the dialect of ``sqlalchemy.url`` without connecting.
"""
from __future__ import annotations

from alembic import context

from memfuse.server.db import Base

config = context.config

if context.is_offline_mode():
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=Base.metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()
else:
    connection = config.attributes["connection"]
    context.configure(connection=connection, target_metadata=Base.metadata, compare_type=True)
    with context.begin_transaction():
        context.run_migrations()
