"""Versions say which version they overwrote by last writer wins.

Revision ID: 0019_version_overwrote
Revises: 0018_record_tails
Create Date: 2026-12-03

- ``versions.overwrote`` / ``versions.overwrote_by``: for a version written by last writer
  wins over a concurrent change (an update sent with ``overwrite: true``, the sidecar's
  conflict rule), the number and the actor of the version it replaced; NULL for every other
  version (every existing one). The change feed carries them (``Change.overwrote``), so the
  writer of the version replaced is told (docs/SEMANTICS.md, "Conflicts").

Both nullable: the previous release keeps working on the upgraded schema (it never reads
them, and its versions leave them NULL).
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019_version_overwrote"
down_revision = "0018_record_tails"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("versions", sa.Column("overwrote", sa.Integer(), nullable=True))
    op.add_column("versions", sa.Column("overwrote_by", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("versions", "overwrote_by")
    op.drop_column("versions", "overwrote")
