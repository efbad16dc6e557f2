"""Byte-order index of live records on PostgreSQL: ``ix_records_live_path_bytes`` on
``records (store, path COLLATE "C", id) WHERE deleted = false``.

Revision ID: 0005_records_path_bytes
Revises: 0004_record_attributes
Create Date: 2026-12-01

The control plane pages a store's live records in byte order of the path on both databases
(the snapshot ``GET /v1/stores/{store}/records``, its search filters, ``GET .../search``
and the tree listing): on PostgreSQL its queries order and compare by ``path COLLATE "C"``.
PostgreSQL uses an index for an ORDER BY or a range only when the index's collation is the
expression's, and ``ix_records_store_path`` is in the column's (the database's default:
``en_US.UTF-8``, ``C.UTF-8``, an ICU locale...): without this index every page read and
sorted every live record of the store (a 100,000-record snapshot in pages of 1,000 read the
store 100 times). On a database whose default collation is ``C`` the two indexes order
alike; this one is still the one the queries name.

SQLite compares text byte-wise already (``ix_records_store_path`` serves the same queries
there): nothing to do. Creating the index takes a SHARE lock on ``records`` (writes wait,
reads go on) for the time of the build (~0.3 s per 100,000 live records measured); for a
very large table a DBA may build it beforehand without blocking writes, with exactly this
definition and name: ``CREATE INDEX CONCURRENTLY ix_records_live_path_bytes ON records
(store, path COLLATE "C", id) WHERE deleted = false``; this revision then keeps it
(``IF NOT EXISTS``). The previous release runs on the upgraded schema and uses the index too
(its queries are the same).
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_records_path_bytes"
down_revision = "0004_record_attributes"
branch_labels = None
depends_on = None

NAME = "ix_records_live_path_bytes"


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.create_index(NAME, "records", ["store", sa.text('path COLLATE "C"'), "id"], if_not_exists=True,
                    postgresql_where=sa.column("deleted", sa.Boolean()) == sa.false())


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.drop_index(NAME, table_name="records", if_exists=True)
