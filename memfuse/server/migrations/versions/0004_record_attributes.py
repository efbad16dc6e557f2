"""Record attributes: ``mode`` (permission bits) and ``mtime_ns`` (modification time) on
``records`` and ``versions``.

Revision ID: 0004_record_attributes
Revises: 0003_token_lifecycle
Create Date: 2026-12-01

A file's permission bits (``chmod``; ``& 0o7777``) and modification time (``utimensat``,
nanoseconds since the epoch) are record attributes kept by the control plane, so they
survive a sidecar restart and reach other sidecars. Both columns are nullable with no
default: NULL means "not set" (mode 0o644, mtime = ``updated_at``), which is exactly what
every existing record had, so nothing is backfilled, and the previous release keeps working
on the upgraded schema (it neither reads nor writes the columns).
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_record_attributes"
down_revision = "0003_token_lifecycle"
branch_labels = None
depends_on = None

_TABLES = ("records", "versions")


def upgrade() -> None:
    for table in _TABLES:
        op.add_column(table, sa.Column("mode", sa.Integer(), nullable=True))
        op.add_column(table, sa.Column("mtime_ns", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    # ALTER TABLE ... DROP COLUMN (SQLite >= 3.35), never a batch copy (see 0002).
    for table in reversed(_TABLES):
        op.drop_column(table, "mtime_ns")
        op.drop_column(table, "mode")
