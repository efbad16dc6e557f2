"""Web-console sessions: ``console_sessions``.

Revision ID: 0009_console_sessions
Revises: 0008_record_review
Create Date: 2026-12-01

The console's cookie used to hold the bearer token itself. It now holds a random session id;
the database keeps only its sha256 (``id_sha256``), the token the session was made from
(``token_id``, deleted with the token; ``token_sha256`` for a static token), the token's
workspace and when the session ends (``expires_at``, indexed for the clean-up). Logging out
deletes the row; a revoked or expired token ends every session made from it (checked on every
request). See memfuse/server/sessions.py and docs/CONSOLE.md.

The previous release neither reads nor writes the table: it keeps running on the upgraded
schema (its console still uses its old cookies).
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009_console_sessions"
down_revision = "0008_record_review"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "console_sessions",
        sa.Column("id_sha256", sa.String(64), primary_key=True),
        sa.Column("token_id", sa.String(36), sa.ForeignKey("tokens.id", ondelete="CASCADE"), nullable=True),
        sa.Column("token_sha256", sa.String(64), nullable=False),
        sa.Column("workspace", sa.String(63), nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("expires_at", TS, nullable=False),
    )
    op.create_index("ix_console_sessions_token_id", "console_sessions", ["token_id"])
    op.create_index("ix_console_sessions_expires_at", "console_sessions", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_console_sessions_expires_at", table_name="console_sessions")
    op.drop_index("ix_console_sessions_token_id", table_name="console_sessions")
    op.drop_table("console_sessions")
