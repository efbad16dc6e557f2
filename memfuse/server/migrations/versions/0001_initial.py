"""Initial schema: the tables of memfuse 0.1.0 before the store usage columns.

Revision ID: 0001_initial
Revises:
Create Date: 2026-12-01

Workspaces, stores and their limits, attachments, tokens (sha256 only), records (current
state) and versions (immutable history, ``seq`` = change-feed position), idempotency keys,
workspace events. Written out in full (not derived from the models), so later model changes
never alter what this revision creates.
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001_initial"
down_revision = None
branch_labels = None
depends_on = None

# BIGSERIAL on PostgreSQL; exactly INTEGER PRIMARY KEY (the rowid alias) on SQLite, where
# AUTOINCREMENT needs it.
SEQ = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "workspaces",
        sa.Column("name", sa.String(63), primary_key=True),
        sa.Column("created_at", TS, nullable=False),
    )
    op.create_table(
        "stores",
        sa.Column("slug", sa.String(63), primary_key=True),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("default_type", sa.String(16), nullable=False),
        sa.Column("max_record_bytes", sa.BigInteger(), nullable=False),
        sa.Column("max_store_bytes", sa.BigInteger(), nullable=False),
        sa.Column("max_records", sa.BigInteger(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
    )
    op.create_table(
        "attachments",
        sa.Column("workspace", sa.String(63), sa.ForeignKey("workspaces.name", ondelete="CASCADE"),
                  primary_key=True),
        sa.Column("store", sa.String(63), sa.ForeignKey("stores.slug", ondelete="CASCADE"), primary_key=True),
        sa.Column("access", sa.String(16), nullable=False),
        sa.Column("instructions", sa.Text(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
    )
    op.create_table(
        "tokens",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("token_sha256", sa.String(64), nullable=False, unique=True),
        sa.Column("workspace", sa.String(63), sa.ForeignKey("workspaces.name", ondelete="CASCADE"),
                  nullable=True),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
    )
    op.create_table(
        "records",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("store", sa.String(63), sa.ForeignKey("stores.slug", ondelete="CASCADE"), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("type", sa.String(16), nullable=True),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("content", sa.Text(), nullable=True),
        sa.Column("deleted", sa.Boolean(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.Column("updated_by", sa.Text(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
    )
    live = sa.column("deleted", sa.Boolean()) == sa.false()  # "= 0" on SQLite, "= false" on PostgreSQL
    op.create_index("ix_records_live_path", "records", ["store", "path"], unique=True,
                    sqlite_where=live, postgresql_where=live)
    op.create_index("ix_records_store_path", "records", ["store", "path", "id"])
    op.create_index("ix_records_usage", "records", ["store", "deleted", "size"])
    op.create_table(
        "versions",
        sa.Column("seq", SEQ, primary_key=True, autoincrement=True),
        sa.Column("record_id", sa.String(36), sa.ForeignKey("records.id", ondelete="CASCADE"), nullable=False),
        sa.Column("store", sa.String(63), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("operation", sa.String(16), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("old_path", sa.Text(), nullable=True),
        sa.Column("type", sa.String(16), nullable=True),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("content", sa.Text(), nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("actor", sa.Text(), nullable=False),
        sa.Column("redacted", sa.Boolean(), nullable=False),
        sa.UniqueConstraint("record_id", "version", name="uq_versions_record_version"),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_versions_store_seq", "versions", ["store", "seq"])
    op.create_table(
        "idempotency_keys",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("scope", sa.String(100), nullable=False),
        sa.Column("key", sa.String(255), nullable=False),
        sa.Column("method", sa.String(10), nullable=False),
        sa.Column("url_path", sa.Text(), nullable=False),
        sa.Column("request_hash", sa.String(64), nullable=False),
        sa.Column("status", sa.Integer(), nullable=False),
        sa.Column("response_body", sa.Text(), nullable=False),
        sa.Column("response_headers", sa.Text(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.UniqueConstraint("scope", "key", name="uq_idempotency_scope_key"),
    )
    op.create_index("ix_idempotency_keys_created_at", "idempotency_keys", ["created_at"])
    op.create_table(
        "workspace_events",
        sa.Column("seq", SEQ, primary_key=True, autoincrement=True),
        sa.Column("workspace", sa.String(63), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("store", sa.String(63), nullable=False),
        sa.Column("access", sa.String(16), nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_events_workspace_seq", "workspace_events", ["workspace", "seq"])


def downgrade() -> None:
    for table in ("workspace_events", "idempotency_keys", "versions", "records", "tokens",
                  "attachments", "stores", "workspaces"):
        op.drop_table(table)
