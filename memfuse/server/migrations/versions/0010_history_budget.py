"""History budget: per-store limits on the past versions' content kept, and its usage.

Revision ID: 0010_history_budget
Revises: 0009_console_sessions
Create Date: 2026-12-01

Every write keeps the content of each version, so a store's history grew without bound
(300 rewrites of a 1 KiB record in a 4 KiB store kept 300 KB). The control plane now prunes
the content of the oldest past versions beyond a per-store budget (docs/SEMANTICS.md,
"History budget"); a pruned version keeps its metadata.

- ``stores.max_history_bytes``, ``max_history_versions``, ``history_min_age_s``: the store's
  own budget, NULL = the default (16 x ``max_store_bytes``, 16 x ``max_records``, 24 h);
- ``stores.version_bytes``, ``version_count``: the content bytes and count of the versions
  whose content is kept, kept by every write like ``usage_bytes``; backfilled here with one
  aggregate per store (``ix_versions_store_seq`` serves the scan);
- ``versions.pruned``: the content was removed by the budget (false for every existing row).

Every new column is nullable or has a server default, so the previous release keeps working
on the upgraded schema (it neither reads nor writes them). Versions an old replica writes
during a rolling update are not added to ``version_bytes`` / ``version_count``: the history
then counts a little less than it holds, and pruning starts that much later; nothing is lost.
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010_history_budget"
down_revision = "0009_console_sessions"
branch_labels = None
depends_on = None

_STORE_COLUMNS = ("max_history_bytes", "max_history_versions", "history_min_age_s")


def upgrade() -> None:
    for name in _STORE_COLUMNS:
        op.add_column("stores", sa.Column(name, sa.BigInteger(), nullable=True))
    op.add_column("stores", sa.Column("version_bytes", sa.BigInteger(), nullable=False, server_default="0"))
    op.add_column("stores", sa.Column("version_count", sa.BigInteger(), nullable=False, server_default="0"))
    op.add_column("versions", sa.Column("pruned", sa.Boolean(), nullable=False, server_default=sa.false()))
    op.execute(
        "UPDATE stores SET "
        "version_bytes = (SELECT COALESCE(SUM(v.size), 0) FROM versions v"
        " WHERE v.store = stores.slug AND v.content IS NOT NULL), "
        "version_count = (SELECT COUNT(*) FROM versions v"
        " WHERE v.store = stores.slug AND v.content IS NOT NULL)")


def downgrade() -> None:
    # ALTER TABLE ... DROP COLUMN (SQLite >= 3.35), never a batch copy (see 0002).
    op.drop_column("versions", "pruned")
    for name in ("version_count", "version_bytes", *reversed(_STORE_COLUMNS)):
        op.drop_column("stores", name)
