"""Consolidation jobs: ``consolidation_jobs``.

Revision ID: 0012_consolidation_jobs
Revises: 0011_append_versions
Create Date: 2026-12-02

A consolidation job asks a model to rewrite a store's records (memfuse/server/consolidation.py,
docs/API.md "Consolidation jobs"). Jobs are rows, so a restarted control plane finds them
(a job whose runner stopped is marked failed) and two replicas on one database never run two
jobs on one store: ``ux_consolidation_jobs_active`` is a unique index on ``store`` over the
``pending`` and ``running`` jobs only.

The previous release neither reads nor writes the table: it keeps running on the upgraded
schema.
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012_consolidation_jobs"
down_revision = "0011_append_versions"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)
ACTIVE = sa.text("status IN ('pending', 'running')")


def upgrade() -> None:
    op.create_table(
        "consolidation_jobs",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("store", sa.String(63), sa.ForeignKey("stores.slug", ondelete="CASCADE"), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("output", sa.String(16), nullable=False),
        sa.Column("output_store", sa.String(63), nullable=True),
        sa.Column("instructions", sa.Text(), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("include_history", sa.Boolean(), nullable=False),
        sa.Column("requested_by", sa.String(200), nullable=False),
        sa.Column("scheduled", sa.Boolean(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("started_at", TS, nullable=True),
        sa.Column("finished_at", TS, nullable=True),
        sa.Column("heartbeat_at", TS, nullable=False),
        sa.Column("input_seq", sa.BigInteger(), nullable=True),
        sa.Column("usage", sa.Text(), nullable=True),
        sa.Column("summary", sa.Text(), nullable=True),
        sa.Column("changes", sa.Text(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
    )
    op.create_index("ix_consolidation_jobs_store_created", "consolidation_jobs", ["store", "created_at"])
    op.create_index("ux_consolidation_jobs_active", "consolidation_jobs", ["store"], unique=True,
                    sqlite_where=ACTIVE, postgresql_where=ACTIVE)


def downgrade() -> None:
    op.drop_index("ux_consolidation_jobs_active", table_name="consolidation_jobs")
    op.drop_index("ix_consolidation_jobs_store_created", table_name="consolidation_jobs")
    op.drop_table("consolidation_jobs")
