"""Full-text index: an update of a live record queued for the drain, not indexed in its transaction.

Revision ID: 0024_fts_queue_updates
Revises: 0023_fts_queue_ids
Create Date: 2026-12-04

SQLite only (``memfuse.server.fulltext``, "Pending"). Revision ``0018_record_tails``'s
``records_fts_au`` deleted and inserted again a record's FTS row, its whole indexed text (the
first ``fulltext.PG_MAX_CHARS`` characters), in the write's transaction whenever the path or
that head changed: every append to a record under ``PG_MAX_CHARS`` characters, ~45 % of its
pages of the write-ahead log (bench/README.md, "The close path, session 22: appends
re-indexed at the drain"). Now ``records_fts_au`` queues the id of a row indexable after the
update (``records_fts_pending``, as a create does since ``0020_fts_pending`` /
``0023_fts_queue_ids``), and the drain's ``INSERT OR REPLACE`` by the record's key replaces
its FTS row; a row that stops being indexable (a delete) still leaves the index at once.
Ranked search drains first, so it sees every write before it, as before.

No row changes: the queue has the same form, and a release of ``0023_fts_queue_ids`` drains
the records this trigger queues (its drain indexes any queued live record), so replicas of
either revision serve the same index. The downgrade puts back ``0018_record_tails``'s
trigger. PostgreSQL: nothing (its trigger computes the vector in the row).
"""
from __future__ import annotations

from alembic import op

from memfuse.server import fulltext

revision = "0024_fts_queue_updates"
down_revision = "0023_fts_queue_ids"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for stmt in fulltext.queue_update_statements(op.get_bind().dialect.name):
        op.execute(stmt)


def downgrade() -> None:
    for stmt in fulltext.queue_update_statements(op.get_bind().dialect.name, upgrade=False):
        op.execute(stmt)
