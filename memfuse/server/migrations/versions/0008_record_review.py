"""Record dates from the frontmatter: ``records.review_after`` and ``records.expires_at``,
with the partial index ``ix_records_expires`` of the expiry sweep.

Revision ID: 0008_record_review
Revises: 0007_fulltext
Create Date: 2026-12-01

Both columns are nullable without a default (NULL: not set). Every write fills them from the
record's frontmatter (``memfuse.server.staleness.record_dates``); this revision fills them
for the live records whose content has a frontmatter naming ``review_after`` or ``expires``
(read in pages of 500, so memory stays bounded). The previous release keeps working on the
upgraded schema: it never names the columns; a record it writes keeps the dates of its
previous version until a newer release writes it again (the sweep and the stale list then
see the old dates).
"""
from __future__ import annotations

from typing import cast

import sqlalchemy as sa
from alembic import op

revision = "0008_record_review"
down_revision = "0007_fulltext"
branch_labels = None
depends_on = None

NAME = "ix_records_expires"


def upgrade() -> None:
    op.add_column("records", sa.Column("review_after", sa.DateTime(timezone=True), nullable=True))
    op.add_column("records", sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
    where = sa.and_(sa.column("deleted", sa.Boolean()) == sa.false(), sa.column("expires_at").is_not(None))
    op.create_index(NAME, "records", ["expires_at"], sqlite_where=where, postgresql_where=where)
    if op.get_context().as_sql:  # offline SQL: the backfill needs the rows
        return
    from memfuse.server.db import RecordRow
    from memfuse.server.staleness import record_dates

    t = cast(sa.Table, RecordRow.__table__)  # a mapped class's table (SQLAlchemy types it as a FromClause)
    conn = op.get_bind()
    after = ""
    while True:
        rows = conn.execute(sa.select(t.c.id, t.c.content).where(
            t.c.deleted == sa.false(), t.c.id > after, t.c.content.like("%---%"),
            sa.or_(t.c.content.like("%review\\_after%", escape="\\"), t.c.content.like("%expires%")))
            .order_by(t.c.id).limit(500)).all()
        if not rows:
            return
        for rid, text in rows:
            review, expires = record_dates(text)
            if review or expires:
                conn.execute(sa.update(t).where(t.c.id == rid).values(review_after=review, expires_at=expires))
        after = rows[-1][0]


def downgrade() -> None:
    op.drop_index(NAME, table_name="records")
    op.drop_column("records", "expires_at")
    op.drop_column("records", "review_after")
