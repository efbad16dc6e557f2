"""The database the API tests run on: in-memory SQLite by default, PostgreSQL when
``MEMFUSE_TEST_DB_URL`` names one (e.g. ``postgresql://memfuse:memfuse@127.0.0.1:5432/memfuse_test``).

On PostgreSQL every test gets a fresh schema of its own (``CREATE SCHEMA``, reached through
the connection's ``search_path``), dropped with everything in it when the test ends, so tests
never see each other's rows and the role needs only CREATE on the one test database.
"""
from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

ENV = "MEMFUSE_TEST_DB_URL"


def pg_url() -> str | None:
    """The PostgreSQL URL of ``$MEMFUSE_TEST_DB_URL``, or None (run on SQLite)."""
    return os.environ.get(ENV) or None


@contextmanager
def fresh_db_url(sqlite_url: str = "sqlite://") -> Iterator[str]:
    """A database URL for one test: ``sqlite_url`` without ``$MEMFUSE_TEST_DB_URL``; with it,
    the PostgreSQL URL pointed at a new empty schema, dropped when the block ends."""
    base = pg_url()
    if base is None:
        yield sqlite_url
        return
    from sqlalchemy import create_engine

    from memfuse.server.db import normalize_db_url

    schema = "t_" + uuid.uuid4().hex[:16]
    admin = create_engine(normalize_db_url(base), poolclass=_null_pool())
    try:
        with admin.begin() as conn:
            conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
        url = normalize_db_url(base).update_query_dict({"options": f"-csearch_path={schema}"})
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        admin.dispose()


def _null_pool():
    from sqlalchemy.pool import NullPool

    return NullPool
