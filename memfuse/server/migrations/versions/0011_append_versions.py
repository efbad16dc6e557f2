"""Append versions: a version that extends its base is stored as the bytes it adds.

Revision ID: 0011_append_versions
Revises: 0010_history_budget
Create Date: 2026-12-02

Every version held its whole content, so appending a line to a 1 MB journal 1,000 times kept
about 1 GB. A version whose content is the previous version's content plus a suffix (an
append, and also a move, an attribute change or a delete: the same content) now stores only
the suffix, with a link to its base (docs/SEMANTICS.md, "Append versions"):

- ``versions.base_version``: the version of the same record this one extends (always the
  previous one), NULL for a full copy (every version before this revision);
- ``versions.chain``: links since the last full copy (0 for a full copy); at
  ``memfuse.server.deltas.CHAIN_MAX`` links the next version is a full copy again, so reading
  any version reads at most that many rows.

On SQLite the full-text index's write triggers are replaced so that they index the first
``fulltext.PG_MAX_CHARS`` characters of a record, as PostgreSQL's generated column always
did: an append to a large record reindexes a bounded text (the rows already indexed keep
theirs until their record is written again; substring search reads the whole content).

Both columns are nullable / defaulted, so the previous release keeps writing full copies on
the upgraded schema. It would read a suffix as a whole content, though: upgrade every replica
before the first append version is written (a rolling update where old replicas serve reads
of versions while new ones write shows those reads a suffix; the live content is unaffected).
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from memfuse.server import fulltext

revision = "0011_append_versions"
down_revision = "0010_history_budget"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("versions", sa.Column("base_version", sa.Integer(), nullable=True))
    op.add_column("versions", sa.Column("chain", sa.Integer(), nullable=False, server_default="0"))
    for stmt in fulltext.refresh_statements(op.get_context().dialect.name):
        op.execute(stmt)


def downgrade() -> None:
    # materialize every append version first, so the older schema reads whole contents
    from memfuse.server.deltas import materialize_all

    materialize_all(op.get_bind())
    # the triggers stay as they are: they index what every release can search
    op.drop_column("versions", "chain")
    op.drop_column("versions", "base_version")
