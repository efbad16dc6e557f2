"""Token lifecycle: ``tokens.expires_at``, ``tokens.revoked_at`` (indexed) and
``tokens.last_used_at``.

Revision ID: 0003_token_lifecycle
Revises: 0002_store_usage
Create Date: 2026-12-01

All three are nullable, so existing tokens stay valid (no expiry, not revoked, never used)
and a replica of the previous release keeps working on the upgraded schema during a rolling
update (it does not read them; it would still accept a token revoked through a new replica,
until it is replaced). ``ix_tokens_revoked_at`` serves the read of recent revocations each
replica makes about once a second.
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_token_lifecycle"
down_revision = "0002_store_usage"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.add_column("tokens", sa.Column("expires_at", TS, nullable=True))
    op.add_column("tokens", sa.Column("revoked_at", TS, nullable=True))
    op.add_column("tokens", sa.Column("last_used_at", TS, nullable=True))
    op.create_index("ix_tokens_revoked_at", "tokens", ["revoked_at"])


def downgrade() -> None:
    # ALTER TABLE ... DROP COLUMN (SQLite >= 3.35), never a batch copy of ``tokens``.
    op.drop_index("ix_tokens_revoked_at", table_name="tokens")
    op.drop_column("tokens", "last_used_at")
    op.drop_column("tokens", "revoked_at")
    op.drop_column("tokens", "expires_at")
