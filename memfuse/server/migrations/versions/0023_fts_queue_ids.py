"""Full-text index: the queue of new records holds their ids; their keys are given at the drain.

Revision ID: 0023_fts_queue_ids
Revises: 0022_drop_records_usage
Create Date: 2026-12-04

SQLite only (``memfuse.server.fulltext``, "Pending"). Revision ``0020_fts_pending``'s
triggers gave a new record its full-text key (a row of ``records_fts_keys`` and an entry of
its index of record ids) and queued the key, in the create's transaction: three b-trees, three
pages of the write-ahead log a create. Now ``records_fts_ai`` and ``records_fts_au_seq``
queue the record's id (``records_fts_pending (record_id)``, ``WITHOUT ROWID``: one b-tree)
and the drain (``fulltext.PENDING_DRAIN``) gives each queued live record its key, then indexes
it: the keys of up to ``fulltext.DRAIN_EVERY`` records in one transaction (bench/README.md,
"The close path, session 21: serve's WAL pages"). A record's key is still given once and kept
while its row exists; a write of a queued record before the drain (``records_fts_au``) gives
it its key and indexes it, as before.

The upgrade drains the queue in its 0020 form (its records indexed), then replaces the table
and the two triggers; the downgrade does the same the other way. A release before this
revision cannot drain the new queue (its drain reads ``records_fts_pending.k``): upgrade
every replica before serving ranked search. PostgreSQL: nothing (its trigger computes the
vector in the row).
"""
from __future__ import annotations

from alembic import op

from memfuse.server import fulltext

revision = "0023_fts_queue_ids"
down_revision = "0022_drop_records_usage"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for stmt in fulltext.queue_id_statements(op.get_bind().dialect.name):
        op.execute(stmt)


def downgrade() -> None:
    for stmt in fulltext.queue_id_statements(op.get_bind().dialect.name, upgrade=False):
        op.execute(stmt)
