"""Record tails: an append to a large record writes what it appends, not the whole content.

Revision ID: 0018_record_tails
Revises: 0017_workspace_names
Create Date: 2026-12-02

- ``record_tails (record_id, tail, head)``: what was appended to a large record since its
  ``records.content`` was last written whole (``memfuse.server.tails``), and the base's
  frontmatter block (what an append reads of the base). A record's live
  content is ``records.content || tail``; every reader goes through that one rule
  (``memfuse.defs.LIVE_CONTENT_SQL``). The key cascades with the record's row.
- the full-text index's update triggers run only for a statement that sets what the index
  reads (``fulltext.update_trigger_statements``): SQLite's ``records_fts_au`` for the path,
  the content or ``deleted``, and a new ``records_fts_au_seq`` for the seq a new record gets
  after its insert; PostgreSQL's ``records_search_vector`` for the path or the content. An
  append to a record with a tail sets none of them, and no trigger reads its 200,000-character
  head twice.

No existing row changes. Downgrade folds every tail into its record's content first (the
older schema reads ``records.content`` as the whole content). The previous release must not
serve reads on the upgraded schema once an append made a tail (it would show a large record
without its latest appends): upgrade every replica before serving appends.
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from memfuse.server import fulltext

revision = "0018_record_tails"
down_revision = "0017_workspace_names"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "record_tails",
        sa.Column("record_id", sa.String(36), sa.ForeignKey("records.id", ondelete="CASCADE"),
                  primary_key=True),
        sa.Column("tail", sa.Text(), nullable=False),
        sa.Column("head", sa.Text(), nullable=False),
    )
    for stmt in fulltext.update_trigger_statements(op.get_bind().dialect.name):
        op.execute(stmt)


def downgrade() -> None:
    op.execute("UPDATE records SET content = content || (SELECT tail FROM record_tails "
               "WHERE record_tails.record_id = records.id) "
               "WHERE id IN (SELECT record_id FROM record_tails)")
    op.drop_table("record_tails")
    for stmt in fulltext.update_trigger_statements(op.get_bind().dialect.name, upgrade=False):
        op.execute(stmt)
