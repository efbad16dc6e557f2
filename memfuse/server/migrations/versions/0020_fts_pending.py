"""Full-text index: a new record's indexing deferred to a queue that ranked search drains.

Revision ID: 0020_fts_pending
Revises: 0019_version_overwrote
Create Date: 2026-12-03

SQLite only (``memfuse.server.fulltext``, "Pending"): ``records_fts_pending (k)`` holds the
full-text keys of new records not indexed yet; ``records_fts_ai`` and ``records_fts_au_seq``
queue a new record's key instead of indexing it; ranked search, and a writer every
``fulltext.DRAIN_EVERY`` write transactions, index the queue (``fulltext.PENDING_DRAIN``).
No existing row changes (every record is indexed when the revision runs, so the queue starts
empty). Downgrade indexes the queue, drops it and puts back the indexing triggers. A release
before this revision does not drain the queue: upgrade every replica before serving ranked
search. PostgreSQL: nothing (its trigger computes the vector in the row).
"""
from __future__ import annotations

from alembic import op

from memfuse.server import fulltext

revision = "0020_fts_pending"
down_revision = "0019_version_overwrote"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for stmt in fulltext.pending_statements(op.get_bind().dialect.name):
        op.execute(stmt)


def downgrade() -> None:
    for stmt in fulltext.pending_statements(op.get_bind().dialect.name, upgrade=False):
        op.execute(stmt)
