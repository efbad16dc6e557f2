"""Versions say which sidecar instance wrote them.

Revision ID: 0021_version_writer
Revises: 0020_fts_pending
Create Date: 2026-12-03

- ``versions.writer``: the ``Memfuse-Writer`` header of the write that made the version (an
  opaque id a sidecar makes at its start, one per running sidecar), NULL for a write sent
  without it (every existing version, every other face). The change feed leaves out a
  sidecar's own versions by it (``skip_writer``), not by the actor: two sidecars given one
  ``--actor`` see each other's writes (docs/API.md "Endpoints", GET .../changes). Never shown.

Nullable: the previous release keeps working on the upgraded schema (it never reads it, and
its versions leave it NULL).
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0021_version_writer"
down_revision = "0020_fts_pending"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("versions", sa.Column("writer", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("versions", "writer")
