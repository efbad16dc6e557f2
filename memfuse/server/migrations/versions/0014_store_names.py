"""Store names unique per account: two accounts may each have a store ``notes``.

Revision ID: 0014_store_names
Revises: 0013_accounts
Create Date: 2026-12-02

``stores.slug`` stays the key every table refers to; a store's public name is the key up to
its first ``~`` (``memfuse.server.keys``): the key is the name when it was free at creation
(every existing store), ``<name>~<account>`` when another account held it. This revision:

- ``stores.public_slug``: the public name (= ``slug`` for every existing store), with the
  unique index ``ux_stores_account_public_slug`` on ``(account, public_slug)``, which makes
  a name unique within its account however two creates race. Nullable: a store the previous
  release inserts during a rolling update has none (its key is its name: never a duplicate
  within an account, since that release refuses any slug that exists);
- PostgreSQL: the columns holding a store key are widened from ``varchar(63)`` to
  ``varchar(127)`` (a name, ``~``, an account); SQLite does not enforce lengths.

The previous release keeps working on the upgraded schema (it never reads the new column,
and sees a ``notes~bravo`` store as a store of that slug).
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014_store_names"
down_revision = "0013_accounts"
branch_labels = None
depends_on = None

# (table, column) of every column holding a store key
KEY_COLUMNS = (
    ("stores", "slug"), ("records", "store"), ("versions", "store"), ("attachments", "store"),
    ("account_attachments", "store"), ("workspace_events", "store"), ("consolidation_jobs", "store"),
    ("consolidation_jobs", "output_store"),
)


def upgrade() -> None:
    op.add_column("stores", sa.Column("public_slug", sa.String(63), nullable=True))
    op.execute("UPDATE stores SET public_slug = slug")
    op.create_index("ux_stores_account_public_slug", "stores", ["account", "public_slug"], unique=True)
    if op.get_bind().dialect.name == "postgresql":
        _widen(127, 63)


def _widen(to: int, was: int) -> None:
    """PostgreSQL: the store-key columns to ``varchar(to)``. The partial unique index on the
    active jobs' store is made again as 0012 made it (PostgreSQL would keep it, with its
    predicate re-written in another, equivalent form)."""
    op.drop_index("ux_consolidation_jobs_active", table_name="consolidation_jobs")
    for table, column in KEY_COLUMNS:
        op.alter_column(table, column, type_=sa.String(to), existing_type=sa.String(was))
    active = sa.text("status IN ('pending', 'running')")  # as 0012's
    op.create_index("ux_consolidation_jobs_active", "consolidation_jobs", ["store"], unique=True,
                    postgresql_where=active)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _widen(63, 127)  # fails if a key longer than 63 exists: delete that store first
    op.drop_index("ux_stores_account_public_slug", table_name="stores")
    op.drop_column("stores", "public_slug")
