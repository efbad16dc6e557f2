"""What the Anthropic memory-store API (``/v1/memory_stores``) keeps beyond memfuse's own
model: on ``stores`` a free-text ``name``, ``metadata_json`` (the store's metadata, a JSON
object of at most 16 string pairs), ``archived_at`` and ``updated_at``; on ``versions``
``redacted_at`` and ``redacted_by`` (who redacted it, an actor string).

Revision ID: 0006_anthropic_memory_stores
Revises: 0005_records_path_bytes
Create Date: 2026-12-01

Every column is nullable with no default: NULL means what every existing row had (name: the
slug; metadata: none; never archived; updated when created; a redaction made before this
revision: its time and author unknown), so nothing is backfilled, and the previous release
keeps working on the upgraded schema (it neither reads nor writes the columns; it would let
records be written into an archived store, which it does not know of).
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_anthropic_memory_stores"
down_revision = "0005_records_path_bytes"
branch_labels = None
depends_on = None

_STORE_COLUMNS = (
    ("name", sa.Text()),
    ("metadata_json", sa.Text()),
    ("archived_at", sa.DateTime(timezone=True)),
    ("updated_at", sa.DateTime(timezone=True)),
)
_VERSION_COLUMNS = (
    ("redacted_at", sa.DateTime(timezone=True)),
    ("redacted_by", sa.Text()),
)


def upgrade() -> None:
    for name, type_ in _STORE_COLUMNS:
        op.add_column("stores", sa.Column(name, type_, nullable=True))
    for name, type_ in _VERSION_COLUMNS:
        op.add_column("versions", sa.Column(name, type_, nullable=True))


def downgrade() -> None:
    # ALTER TABLE ... DROP COLUMN (SQLite >= 3.35), never a batch copy (see 0002).
    for name, _ in reversed(_VERSION_COLUMNS):
        op.drop_column("versions", name)
    for name, _ in reversed(_STORE_COLUMNS):
        op.drop_column("stores", name)
