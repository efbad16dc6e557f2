"""Records: the index ``ix_records_usage (store, deleted, size)`` dropped.

Revision ID: 0022_drop_records_usage
Revises: 0021_version_writer
Create Date: 2026-12-04

Revision 0001 made it for the count and the sum of sizes of a store's live records, which
revision 0002 read once to fill the usage counters (``stores.usage_bytes``,
``stores.record_count``); since then every write keeps the counters in its own transaction
and no statement of memfuse needs it (``tests/test_write_pages.py`` plans the statements that
took it: each finds ``ix_records_live_path`` or ``ix_records_store_path`` instead, or reads
the same table rows). Every record write changed it: one page more in SQLite's write-ahead
log (a create wrote ~21 pages; bench/README.md, "The close path, session 21: serve's WAL
pages"), one index entry more on PostgreSQL. Its absence also takes away a plan SQLite's
planner chose badly (``base.LIVE_PATHS_ORDER``). The previous release works on the upgraded
schema (it never names the index). Downgrade makes it again.
"""
from __future__ import annotations

from alembic import op

revision = "0022_drop_records_usage"
down_revision = "0021_version_writer"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # IF EXISTS (both dialects; offline SQL too): a database whose schema a later memfuse's
    # ``create_all`` made and that was stamped older never had it
    op.execute("DROP INDEX IF EXISTS ix_records_usage")


def downgrade() -> None:
    op.create_index("ix_records_usage", "records", ["store", "deleted", "size"])
