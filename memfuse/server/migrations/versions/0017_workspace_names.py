"""Workspace names unique per account: two accounts may each have a workspace ``agent``.

Revision ID: 0017_workspace_names
Revises: 0016_fts_record_keys
Create Date: 2026-12-02

``workspaces.name`` stays the key every table refers to (attachments, tokens, events,
console sessions, idempotency scopes); a workspace's public name is the key up to its first
``~`` (``memfuse.server.keys``): the key is the name when it was free at creation (every
existing workspace), ``<name>~<account>`` when another account held it. Versions keep the
actor ``ws:<public name>/<instance>`` as before (no key in them, nothing to map). This
revision:

- ``workspaces.public_name``: the public name (= ``name`` for every existing workspace),
  with the unique index ``ux_workspaces_account_public_name`` on ``(account,
  public_name)``, which makes a name unique within its account however two creates race.
  Nullable: a workspace the previous release inserts during a rolling update has none (its
  key is its name: never a duplicate within an account, since that release refuses any name
  that exists);
- PostgreSQL: the columns holding a workspace key are widened from ``varchar(63)`` to
  ``varchar(127)`` (a name, ``~``, an account), and ``idempotency_keys.scope`` from
  ``varchar(100)`` to ``varchar(140)`` (``ws:<key>``); SQLite does not enforce lengths.

The previous release keeps working on the upgraded schema (it never reads the new column,
and sees an ``agent~bravo`` workspace as a workspace of that name).
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017_workspace_names"
down_revision = "0016_fts_record_keys"
branch_labels = None
depends_on = None

# (table, column) of every column holding a workspace key
KEY_COLUMNS = (
    ("workspaces", "name"), ("attachments", "workspace"), ("tokens", "workspace"),
    ("workspace_events", "workspace"), ("console_sessions", "workspace"),
)


def upgrade() -> None:
    op.add_column("workspaces", sa.Column("public_name", sa.String(63), nullable=True))
    op.execute("UPDATE workspaces SET public_name = name")
    op.create_index("ux_workspaces_account_public_name", "workspaces", ["account", "public_name"],
                    unique=True)
    if op.get_bind().dialect.name == "postgresql":
        _widen(127, 63, 140, 100)


def _widen(to: int, was: int, scope_to: int, scope_was: int) -> None:
    """PostgreSQL: the workspace-key columns to ``varchar(to)``, the idempotency scope to
    ``varchar(scope_to)``."""
    for table, column in KEY_COLUMNS:
        op.alter_column(table, column, type_=sa.String(to), existing_type=sa.String(was))
    op.alter_column("idempotency_keys", "scope", type_=sa.String(scope_to),
                    existing_type=sa.String(scope_was), existing_nullable=False)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _widen(63, 127, 100, 140)  # fails if a longer key exists: delete that workspace first
    op.drop_index("ux_workspaces_account_public_name", table_name="workspaces")
    op.drop_column("workspaces", "public_name")
