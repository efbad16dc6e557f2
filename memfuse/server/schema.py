"""Schema migrations of the control-plane database, with Alembic.

The revisions live in the package (``memfuse/server/migrations/versions/``, one file per
change), so an installed wheel can migrate; there is no ``alembic.ini``: the configuration is
built here (``alembic_config``). Entry points:

- ``upgrade(db)``: bring the database to the newest revision (``memfuse db upgrade``,
  ``memfuse serve --migrate``, ``memfuse dev``);
- ``status(db)``: the revision a database is at (``memfuse db current``);
- ``check(db)``: raise ``SchemaBehind`` unless the database is at the newest revision
  (``memfuse serve`` without ``--migrate``);
- ``offline_sql(url)``: the SQL ``upgrade`` would run, for a DBA to review.

Locking: every upgrade runs in one transaction that first takes the migration lock
(``BEGIN IMMEDIATE`` on SQLite, ``pg_advisory_xact_lock`` on PostgreSQL), so two processes
upgrading at once (two replicas started with ``--migrate``, or a Job and a replica) run the
revisions once, one after the other: the second finds the database at head and does nothing.
DDL is transactional on both engines, so a failed revision leaves the database as it was.

Databases made before migrations existed (memfuse 0.1.0 created its tables with
``create_all``, and added the usage columns by hand) have no ``alembic_version`` table: they
are recognised by their tables ("legacy") and stamped with the revision their tables match
(``0002_store_usage`` with the usage columns, ``0001_initial`` without) before upgrading.

A new, empty database is built by the revisions themselves. In-memory SQLite databases
(tests, the in-process fake) skip all this: ``Database`` creates them with ``create_all``,
and a test proves that ``create_all`` and ``upgrade`` give the same schema.

Compatibility rule for new revisions: the previous release must keep working on the new
schema (add columns with a server default or nullable; drop only what the previous release no
longer reads), because during a rolling update the old replicas serve on the migrated
database. A database at a revision this code does not know (made by a newer release) is
therefore accepted by ``check`` with a warning, never refused.
"""
from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

logging.getLogger("alembic").setLevel(logging.WARNING)  # see below, before Alembic logs anything

from alembic import command  # noqa: E402
from alembic.config import Config  # noqa: E402
from alembic.runtime.migration import MigrationContext  # noqa: E402
from alembic.script import ScriptDirectory  # noqa: E402
from alembic.util.exc import CommandError  # noqa: E402
from sqlalchemy import inspect, text  # noqa: E402
from sqlalchemy.engine import Connection  # noqa: E402



class Database(Protocol):
    """What the migrations need of ``memfuse.server.db.Database`` (named here, so this module,
    which ``db`` imports, imports nothing of it)."""

    is_sqlite: bool

    def read_conn(self) -> AbstractContextManager[Connection]: ...

    def write_conn(self) -> AbstractContextManager[Connection]: ...


log = logging.getLogger(__name__)
# Alembic says "Context impl SQLiteImpl" on every run (set above, before its first words);
# what was applied is logged here instead.

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
# pg_advisory_xact_lock key of schema migrations: int64 of b"memfuse\x00"
PG_LOCK_KEY = int.from_bytes(b"memfuse\x00", "big", signed=True)
VERSION_TABLE = "alembic_version"
UPGRADE_HINT = "memfuse db upgrade --db URL"


class SchemaError(RuntimeError):
    """The database's schema does not fit this memfuse."""


class SchemaBehind(SchemaError):
    """The database is behind this memfuse's newest revision (or empty), and this process
    does not migrate it. ``current``: its revision (None: empty), ``head``: the newest."""

    def __init__(self, current: str | None, head: str, url: str, legacy: bool = False) -> None:
        self.current, self.head, self.url = current, head, url
        if legacy:
            where = f"from before migrations (no alembic_version table; its tables match {current})"
        elif current:
            where = f"at revision {current}"
        else:
            where = "empty (no memfuse schema)"
        super().__init__(
            f"database {url} is {where}, this memfuse needs {head}: run "
            f"`memfuse db upgrade --db URL` first (or start `memfuse serve` with --migrate)"
        )


@dataclass(frozen=True)
class SchemaStatus:
    """Where a database stands. ``current``: revision recorded in ``alembic_version`` (for a
    legacy database: the revision its tables match; None: empty database); ``head``: newest
    revision of this code; ``legacy``: no ``alembic_version`` table yet (made by 0.1.0);
    ``known``: ``current`` is a revision of this code (False: made by a newer release)."""

    current: str | None
    head: str
    legacy: bool
    known: bool

    @property
    def at_head(self) -> bool:
        """True when the database needs no upgrade (or is ahead of this code)."""
        return (self.current == self.head and not self.legacy) or (self.current is not None and not self.known)


def alembic_config(url: str | None = None, connection: Connection | None = None) -> Config:
    """An Alembic ``Config`` for memfuse's revisions, without an ini file. ``connection`` (an
    open connection inside a transaction) is what ``env.py`` migrates; ``url`` is only used to
    render offline SQL."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if url is not None:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def script_directory() -> ScriptDirectory:
    """The revisions shipped with this code."""
    return ScriptDirectory.from_config(alembic_config())


def head() -> str:
    """The newest revision id of this code (e.g. ``"0002_store_usage"``)."""
    heads = script_directory().get_heads()
    if len(heads) != 1:  # a merge revision is missing: a packaging bug, never a user error
        raise SchemaError(f"memfuse's migrations have {len(heads)} heads: {heads}")
    return heads[0]


def _legacy_revision(conn: Connection) -> str | None:
    """The revision a database without ``alembic_version`` matches, or None when it holds no
    memfuse tables (empty)."""
    insp = inspect(conn)
    if not insp.has_table("stores"):
        return None
    cols = {c["name"] for c in insp.get_columns("stores")}
    return "0002_store_usage" if {"usage_bytes", "record_count"} <= cols else "0001_initial"


def _status(conn: Connection) -> SchemaStatus:
    newest = head()
    if inspect(conn).has_table(VERSION_TABLE):
        heads = MigrationContext.configure(conn).get_current_heads()
        current = heads[0] if heads else None
        legacy = False
    else:
        current, legacy = _legacy_revision(conn), True
        if current is None:
            legacy = False
    known = True
    if current is not None:
        try:
            known = script_directory().get_revision(current) is not None
        except CommandError:
            known = False
    return SchemaStatus(current=current, head=newest, legacy=legacy, known=known)


@contextmanager
def _locked(db: "Database") -> Iterator[Connection]:
    """A connection in a write transaction holding the migration lock (see module doc)."""
    with db.write_conn() as conn:
        if not db.is_sqlite:
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": PG_LOCK_KEY})
        yield conn


def status(db: "Database") -> SchemaStatus:
    """Where ``db`` stands (see ``SchemaStatus``). Raises ``sqlalchemy.exc.OperationalError``
    when the database cannot be reached."""
    with db.read_conn() as conn:
        return _status(conn)


def upgrade(db: "Database", target: str = "head") -> tuple[SchemaStatus, SchemaStatus]:
    """Upgrade ``db`` to ``target`` (default: the newest revision) under the migration lock;
    a legacy database is stamped first. Returns the status before and after. A database
    already at (or ahead of) ``target`` is left alone. Raises ``SchemaError`` for an unknown
    ``target``, SQLAlchemy errors when a revision fails (the transaction is rolled back)."""
    with _locked(db) as conn:
        before = _status(conn)
        if before.current is not None and not before.known:
            log.warning("database is at revision %s, unknown to this memfuse (newer release?): "
                        "not migrating", before.current)
            return before, before
        cfg = alembic_config(connection=conn)
        if before.legacy and before.current is not None:  # legacy: a revision its tables match
            command.stamp(cfg, before.current)
            log.info("legacy database (no migration history) recognised as revision %s", before.current)
        try:
            command.upgrade(cfg, target)
        except CommandError as err:
            raise SchemaError(str(err)) from err
        after = _status(conn)
    if before.current != after.current:
        applied = [r.revision for r in script_directory().iterate_revisions(after.current, before.current)]
        log.info("database schema upgraded from %s to %s (applied: %s)", before.current or "empty",
                 after.current, ", ".join(reversed(applied)))
    return before, after


def check(db: "Database", url: str) -> SchemaStatus:
    """Raise ``SchemaBehind`` (naming ``memfuse db upgrade``) unless ``db`` is at the newest
    revision; a database ahead of this code is accepted with a warning (see the module's
    compatibility rule). ``url`` is the database URL shown in the message (no password)."""
    st = status(db)
    if st.current is not None and not st.known:
        log.warning("database is at revision %s, unknown to this memfuse (newer release?); "
                    "serving on it", st.current)
        return st
    if not st.at_head:
        raise SchemaBehind(st.current, st.head, url, legacy=st.legacy)
    return st


def offline_sql(url: str, target: str = "head", start: str | None = None) -> str:
    """The SQL that upgrading a database of ``url``'s dialect from ``start`` (None: empty) to
    ``target`` runs, as text, without connecting (Alembic offline mode)."""
    cfg = alembic_config(url=url)
    buf = io.StringIO()
    cfg.output_buffer = buf
    rng = f"{start}:{target}" if start else target
    with redirect_stdout(io.StringIO()):
        command.upgrade(cfg, rng, sql=True)
    return buf.getvalue()
