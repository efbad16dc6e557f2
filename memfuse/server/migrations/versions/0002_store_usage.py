"""Store usage columns: ``stores.usage_bytes`` and ``stores.record_count``, filled from the
live records.

Revision ID: 0002_store_usage
Revises: 0001_initial
Create Date: 2026-12-01

Every record write keeps these two counters in the same transaction as the change; this
revision adds them (``BIGINT NOT NULL DEFAULT 0``) and fills them with the count and the sum
of sizes of each store's live (not deleted) records, using ``ix_records_usage``.
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_store_usage"
down_revision = "0001_initial"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("stores", sa.Column("usage_bytes", sa.BigInteger(), nullable=False, server_default="0"))
    op.add_column("stores", sa.Column("record_count", sa.BigInteger(), nullable=False, server_default="0"))
    op.execute(sa.text(
        "UPDATE stores SET "
        "usage_bytes = (SELECT COALESCE(SUM(size), 0) FROM records"
        " WHERE records.store = stores.slug AND records.deleted = :f), "
        "record_count = (SELECT COUNT(*) FROM records"
        " WHERE records.store = stores.slug AND records.deleted = :f)"
    ).bindparams(sa.bindparam("f", False, sa.Boolean())))


def downgrade() -> None:
    # ALTER TABLE ... DROP COLUMN (SQLite >= 3.35), never a batch copy of ``stores``: with
    # foreign keys on, dropping the old table would cascade to attachments and records.
    op.drop_column("stores", "record_count")
    op.drop_column("stores", "usage_bytes")
