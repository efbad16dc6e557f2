"""The full-text index of live records, for ranked search (``GET .../search?order=relevance``).

Revision ID: 0007_fulltext
Revises: 0006_anthropic_memory_stores
Create Date: 2026-12-01

What it creates is described in ``memfuse.server.fulltext``; in short:

- SQLite: the FTS5 table ``records_fts`` (path, headings, body; rowid = ``records.seq``),
  the three triggers on ``records`` that keep it in the transaction of every write, and
  ``ix_records_seq``; then fills it from the live records (one ``INSERT ... SELECT``:
  ~1 s per 30,000 records of 1 KiB measured). The triggers call ``memfuse_headings``, a
  function memfuse registers on each of its connections: a previous release (or the
  ``sqlite3`` shell) cannot write records on the upgraded file, so on SQLite upgrade every
  process on the file together (SQLite serves one host; there is no rolling update).
  Downgrading drops it all.
- PostgreSQL: the stored generated column ``records.search_vector`` (``tsvector``) and its
  partial GIN index ``ix_records_search``. Adding the column rewrites ``records`` (an
  ACCESS EXCLUSIVE lock for its time: plan a window for a large table); the previous release
  keeps working on the new schema (it never names the column, and the database computes it
  on its writes too).
"""
from __future__ import annotations

from alembic import op

from memfuse.server import fulltext

revision = "0007_fulltext"
down_revision = "0006_anthropic_memory_stores"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # op.execute, not the bind: ``memfuse db upgrade --sql`` renders these offline too
    for stmt in fulltext.create_statements(op.get_context().dialect.name):
        op.execute(stmt)


def downgrade() -> None:
    for stmt in fulltext.drop_statements(op.get_context().dialect.name):
        op.execute(stmt)
