"""Accounts: the top of the model. An account owns workspaces, stores and tokens.

Revision ID: 0013_accounts
Revises: 0012_consolidation_jobs
Create Date: 2026-12-02

- ``accounts``: ``slug`` (primary key), ``created_at``, quotas ``max_stores``, ``max_bytes``,
  ``max_tokens`` (NULL: unlimited); the account ``default`` is created here;
- ``workspaces.account``, ``stores.account``: the owner, NOT NULL with the server default
  ``'default'``, so every existing row is in ``default`` and a row the previous release
  inserts during a rolling update lands there too; indexed (the account's listings);
- ``tokens.account``: NULL for a root admin token (every admin token made before this
  revision stays root), the account it administers for an account admin token, the
  workspace's account for a workspace token (existing ones: ``default``); indexed;
- ``console_sessions.account``: the account of the session's principal (NULL: root);
- ``account_attachments``: a store attached to every workspace of its account, existing and
  new (``PUT /v1/accounts/{account}/attachments/{store}``).

Slugs stay unique across the control plane (the primary keys are unchanged): see
docs/ARCHITECTURE.md, "Accounts". Every column is nullable or has a server default, so the
previous release keeps working on the upgraded schema.
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013_accounts"
down_revision = "0012_consolidation_jobs"
branch_labels = None
depends_on = None

DEFAULT = "default"


def upgrade() -> None:
    op.create_table(
        "accounts",
        sa.Column("slug", sa.String(63), primary_key=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("max_stores", sa.BigInteger(), nullable=True),
        sa.Column("max_bytes", sa.BigInteger(), nullable=True),
        sa.Column("max_tokens", sa.BigInteger(), nullable=True),
    )
    accounts = sa.table("accounts", sa.column("slug", sa.String), sa.column("created_at", sa.DateTime))
    op.execute(accounts.insert().values(slug=DEFAULT, created_at=sa.func.current_timestamp()))
    for table in ("workspaces", "stores"):
        op.add_column(table, sa.Column("account", sa.String(63), nullable=False, server_default=DEFAULT))
        op.create_index(f"ix_{table}_account", table, ["account"])
    op.add_column("tokens", sa.Column("account", sa.String(63), nullable=True))
    op.create_index("ix_tokens_account", "tokens", ["account"])
    op.execute(f"UPDATE tokens SET account = '{DEFAULT}' WHERE workspace IS NOT NULL")
    op.add_column("console_sessions", sa.Column("account", sa.String(63), nullable=True))
    op.create_table(
        "account_attachments",
        sa.Column("account", sa.String(63), sa.ForeignKey("accounts.slug", ondelete="CASCADE"), primary_key=True),
        sa.Column("store", sa.String(63), sa.ForeignKey("stores.slug", ondelete="CASCADE"), primary_key=True),
        sa.Column("access", sa.String(16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    # ALTER TABLE ... DROP COLUMN (SQLite >= 3.35), never a batch copy (see 0002).
    op.drop_table("account_attachments")
    op.drop_column("console_sessions", "account")
    op.drop_index("ix_tokens_account", table_name="tokens")
    op.drop_column("tokens", "account")
    for table in ("stores", "workspaces"):
        op.drop_index(f"ix_{table}_account", table_name=table)
        op.drop_column(table, "account")
    op.drop_table("accounts")
