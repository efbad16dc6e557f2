"""The full-text index keyed by record, so a write that leaves the indexed text alone skips it.

Revision ID: 0016_fts_record_keys
Revises: 0014_store_names
Create Date: 2026-12-02

SQLite only (``memfuse.server.fulltext``, module docstring): the FTS5 table's rowid was the
record's ``seq``, new at every write, so every write to a record deleted and re-inserted its
indexed text (the first ``fulltext.PG_MAX_CHARS`` characters): ~48 ms of an append to a
1 MiB record. This revision gives every record a stable key (``records_fts_keys``: ``k``
per record id; the FTS rowid is ``-k``), replaces the three triggers (``records_fts_au``
does nothing when the path and the indexed text are unchanged) and ``ix_records_seq`` with
``ix_records_fts_hit`` (the covering index of a hit's join by record id), and indexes every
live record again under its key (one pass, as ``0007_fulltext``'s fill).

PostgreSQL: nothing (the generated ``search_vector`` is the record row's own).

A previous release on the upgraded schema (a rolling update): its writes keep the index
right (the triggers are the database's); its ranked search (``order=relevance``) joins on
``seq``, which no key equals, so it finds nothing until it is replaced. Downgrade puts the
seq-keyed form back and indexes every live record again.
"""
from __future__ import annotations

from alembic import op

from memfuse.server import fulltext

revision = "0016_fts_record_keys"
down_revision = "0014_store_names"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for stmt in fulltext.rekey_statements(op.get_context().dialect.name):
        op.execute(stmt)


def downgrade() -> None:
    for stmt in fulltext.unkey_statements(op.get_context().dialect.name):
        op.execute(stmt)
