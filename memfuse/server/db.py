"""Database schema and engine setup of the reference control plane (SQLAlchemy 2.x, sync).

SQLite is the default (``sqlite:///PATH``, or ``sqlite://`` for an in-memory database);
PostgreSQL works by URL. The driver is psycopg 3 (``pip install 'memfuse[postgres]'``): a
plain ``postgresql://`` or ``postgres://`` URL is read as ``postgresql+psycopg://``
(``normalize_db_url``); an explicit driver (``postgresql+psycopg2://``) is kept as given.
The SQL is kept portable: partial unique indexes carry both ``sqlite_where`` and
``postgresql_where``.

Concurrency rules (see ``Database``):

- every request opens its own short ``Session`` (``Database.read()`` / ``Database.write()``)
  and never holds it across an ``await``;
- write transactions on SQLite start with ``BEGIN IMMEDIATE`` so two writers (threads or
  processes sharing one file) queue on the database lock (``busy_timeout`` 5 s) instead of
  dead-locking on a read-to-write upgrade; in one process writers also queue on a lock;
- the in-memory database is one connection shared by all threads (``StaticPool``), so every
  session, read or write, holds the process lock for its whole life;
- on PostgreSQL a write to a store locks the store row (``SELECT ... FOR UPDATE``), so the
  versions of one store commit in ``seq`` order and the change feed never skips one.

Each store row carries its live usage (``usage_bytes``, ``record_count``), kept by every
record write in the same transaction as the change (the store row is read under the write
lock, so the counters are exact across threads and processes).

The schema is versioned by Alembic revisions (``memfuse.server.schema``,
``memfuse/server/migrations/versions/``): a change to the models below needs a revision,
and ``tests/test_migrations.py`` fails while ``create_all`` and the revisions disagree.
"""
from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import (
    DDL,
    BigInteger,
    Boolean,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    create_engine,
    event,
    false,
    text,
)
from sqlalchemy.engine import URL, Connection, Dialect, Engine, make_url
from sqlalchemy.exc import DBAPIError, InvalidRequestError, SQLAlchemyError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column
from sqlalchemy.pool import StaticPool

from memfuse import defs, sqlitebind  # noqa: F401 - None binds as NULL without the search
from memfuse.server import budget, fulltext, writertime
from memfuse.server.rawsql import Raw, SharedCursorConnection, statement_listeners

log = logging.getLogger(__name__)

#: the newest Alembic revision (``memfuse/server/migrations/versions/``): a database at it
#: opens without Alembic (``Database._at_schema_head``). A new revision updates it;
#: tests/test_migrations.py fails while it is not ``schema.head()``.
SCHEMA_HEAD = "0024_fts_queue_updates"


def utcnow() -> datetime:
    """Current time, timezone-aware UTC."""
    return datetime.now(timezone.utc)


#: the earliest and latest aware UTC times Python can hold (years 1 and 9999)
UTC_MIN = datetime.min.replace(tzinfo=timezone.utc)
UTC_MAX = datetime.max.replace(tzinfo=timezone.utc)


def utc_shift(base: datetime, seconds: float) -> datetime:
    """``base + timedelta(seconds=seconds)`` (``seconds`` may be negative), clamped to
    [``UTC_MIN``, ``UTC_MAX``]: a duration that reaches past year 1 or 9999 (a limit, TTL or
    age of up to 2**63 s that the API and the flags accept) means "before / after any time
    there is", never ``OverflowError``. The one rule for a time computed from a duration given
    by a client, a store's settings or a flag (attack24 F2, F5)."""
    try:
        return base + timedelta(seconds=seconds)
    except OverflowError:
        return UTC_MAX if seconds > 0 else UTC_MIN


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC ``datetime`` on every backend (SQLite stores naive UTC)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:  # noqa: D102
        if value is None:
            return None
        if value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        value = value.astimezone(timezone.utc)
        if dialect.name == "sqlite":
            value = value.replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:  # noqa: D102
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)

    def bind_processor(self, dialect: Dialect) -> Callable[[Any], Any] | None:
        """``process_bind_param`` then the dialect's own processor (``TypeDecorator``'s
        composition), except on SQLite for a ``datetime``: the naive UTC time's
        ``isoformat(" ", "microseconds")`` in one step, the text SQLAlchemy's SQLite
        ``DATETIME`` writes in its default storage format (``YYYY-MM-DD HH:MM:SS.ffffff``),
        at half its CPU (six times per record create; ``tests/test_wire.py`` compares the
        two). Used only when the storage format is that default."""
        composed = super().bind_processor(dialect)
        if dialect.name != "sqlite" or composed is None:
            return composed
        fmt = getattr(self.impl_instance.dialect_impl(dialect), "_storage_format", None)
        if fmt != _SQLITE_DATETIME_FORMAT:
            return composed
        utc = timezone.utc

        def process(value: Any) -> Any:
            if value is None:  # NULL (the composed rule's answer, without its three calls)
                return None
            if value.__class__ is not datetime:  # a date, a subclass: the composed rule
                return composed(value)
            tz = value.tzinfo
            if tz is not None:
                if tz is not utc:
                    value = value.astimezone(utc)
                value = value.replace(tzinfo=None)
            return value.isoformat(" ", "microseconds")

        return process


#: SQLAlchemy's SQLite ``DATETIME`` default storage format (``UTCDateTime.bind_processor``)
_SQLITE_DATETIME_FORMAT = ("%(year)04d-%(month)02d-%(day)02d "
                           "%(hour)02d:%(minute)02d:%(second)02d.%(microsecond)06d")


# Feed positions: BIGSERIAL on PostgreSQL; on SQLite it must be exactly INTEGER PRIMARY KEY
# (the rowid alias) for AUTOINCREMENT.
_SEQ = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    """Declarative base of every control-plane table."""


#: a column holding a store's key (``stores.slug`` and every column naming a store): up to
#: ``keys.KEY_MAX`` characters (``<name>~<account>``, revision 0014_store_names) where the
#: database enforces lengths (PostgreSQL); SQLite does not, and keeps its ``varchar(63)``
STORE_KEY = String(63).with_variant(String(127), "postgresql")
#: a column holding a workspace's key (``workspaces.name`` and every column naming a
#: workspace), the same widths (revision 0017_workspace_names)
WORKSPACE_KEY = String(63).with_variant(String(127), "postgresql")
#: ``idempotency_keys.scope``: ``ws:<workspace key>`` needs 130 characters on PostgreSQL
IDEM_SCOPE = String(100).with_variant(String(140), "postgresql")

#: the account every object of a database made before accounts belongs to (revision
#: 0013_accounts), and where the root admin creates objects when it names no account
DEFAULT_ACCOUNT = defs.DEFAULT_ACCOUNT


class AccountRow(Base):
    """An account (a customer or team): it owns workspaces, stores and tokens. Quotas are
    NULL for unlimited: ``max_stores`` (stores), ``max_bytes`` (live bytes of all its stores),
    ``max_tokens`` (active tokens)."""

    __tablename__ = "accounts"

    slug: Mapped[str] = mapped_column(String(63), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    max_stores: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    max_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    max_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


# A database built by ``create_all`` (in-memory: tests, the fake) has the account ``default``
# as one built by the revisions has (0013_accounts inserts it).
event.listen(AccountRow.__table__, "after_create", DDL(  # type: ignore[no-untyped-call]  # SQLAlchemy leaves DDL() unannotated
    f"INSERT INTO accounts (slug, created_at) VALUES ('{DEFAULT_ACCOUNT}', CURRENT_TIMESTAMP)"))


class WorkspaceRow(Base):
    """A workspace (one agent / sidecar identity); ``name`` is its key (``memfuse.server.keys``:
    the public name, or ``<name>~<account>`` when another account held the name); ``account``
    its owner (revision 0013_accounts)."""

    __tablename__ = "workspaces"

    name: Mapped[str] = mapped_column(WORKSPACE_KEY, primary_key=True)  # the key (memfuse.server.keys)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    account: Mapped[str] = mapped_column(String(63), default=DEFAULT_ACCOUNT,
                                         server_default=DEFAULT_ACCOUNT, index=True)
    # the public name, unique within the account (revision 0017_workspace_names; NULL for a
    # row the release before it inserted, whose key is its name): ``keys.public(name)``
    public_name: Mapped[str | None] = mapped_column(String(63), nullable=True)

    __table_args__ = (Index("ux_workspaces_account_public_name", "account", "public_name", unique=True),)


class StoreRow(Base):
    """A memory store and its limits (bytes, bytes, record count)."""

    __tablename__ = "stores"

    slug: Mapped[str] = mapped_column(STORE_KEY, primary_key=True)  # the key (memfuse.server.keys)
    description: Mapped[str] = mapped_column(Text, default="")
    default_type: Mapped[str] = mapped_column(String(16), default="project")
    max_record_bytes: Mapped[int] = mapped_column(BigInteger)
    max_store_bytes: Mapped[int] = mapped_column(BigInteger)
    max_records: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # Live usage, kept by every record write in the same transaction (not re-counted).
    usage_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    record_count: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # The Anthropic memory-store API's fields (memfuse/server/memstores.py; revision
    # 0006_anthropic_memory_stores): a free-text name (None: the slug), metadata as a JSON
    # object (None: {}), when archived (None: never; archived stores take no new records,
    # writes or attachments), when the store itself last changed (None: ``created_at``).
    name: Mapped[str | None] = mapped_column(Text, nullable=True)
    metadata_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    archived_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    updated_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # History budget (revision 0010_history_budget): NULL = the default (``defs.HISTORY_*``:
    # 16 x max_store_bytes, 16 x max_records, 24 h), and the content kept in ``versions``
    # (rows whose content is not pruned or redacted: bytes and count), kept by every write in
    # the same transaction; history = these minus the live records (usage_bytes, record_count)
    max_history_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    max_history_versions: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    history_min_age_s: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    version_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    version_count: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # the owning account (revision 0013_accounts)
    account: Mapped[str] = mapped_column(String(63), default=DEFAULT_ACCOUNT,
                                         server_default=DEFAULT_ACCOUNT, index=True)
    # the public name, unique within the account (revision 0014_store_names; NULL for a row
    # the release before it inserted, whose key is its name): ``keys.public(slug)``
    public_slug: Mapped[str | None] = mapped_column(String(63), nullable=True)

    __table_args__ = (Index("ux_stores_account_public_slug", "account", "public_slug", unique=True),)


class AttachmentRow(Base):
    """A store attached to a workspace; ``access`` is ``read_write`` or ``read_only``."""

    __tablename__ = "attachments"

    workspace: Mapped[str] = mapped_column(
        ForeignKey("workspaces.name", ondelete="CASCADE"), primary_key=True
    )
    store: Mapped[str] = mapped_column(ForeignKey("stores.slug", ondelete="CASCADE"), primary_key=True)
    access: Mapped[str] = mapped_column(String(16))
    instructions: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class AccountAttachmentRow(Base):
    """A store attached to every workspace of its account, existing and new (revision
    0013_accounts): ``PUT /v1/accounts/{account}/attachments/{store}``."""

    __tablename__ = "account_attachments"

    account: Mapped[str] = mapped_column(ForeignKey("accounts.slug", ondelete="CASCADE"), primary_key=True)
    store: Mapped[str] = mapped_column(ForeignKey("stores.slug", ondelete="CASCADE"), primary_key=True)
    access: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class TokenRow(Base):
    """An API token; only the sha256 of the token is kept."""

    __tablename__ = "tokens"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    token_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    workspace: Mapped[str | None] = mapped_column(
        ForeignKey("workspaces.name", ondelete="CASCADE"), nullable=True
    )
    name: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # indexed: every process reads the recent revocations about once a second
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True, index=True)
    # updated at most once a minute per token (never one write per request)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # the account (revision 0013_accounts): of the workspace for a workspace token; for an
    # admin token (workspace NULL) the account it administers, NULL for a root admin token
    account: Mapped[str | None] = mapped_column(String(63), nullable=True, index=True)


class ConsoleSessionRow(Base):
    """A web-console session (memfuse/server/sessions.py): the sha256 of its random id (the
    cookie's value; never stored), the token it was made from (``token_id`` for a database
    token, deleted with it; ``token_sha256`` for a static one), and when it ends."""

    __tablename__ = "console_sessions"

    id_sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    token_id: Mapped[str | None] = mapped_column(
        ForeignKey("tokens.id", ondelete="CASCADE"), nullable=True, index=True
    )
    token_sha256: Mapped[str] = mapped_column(String(64))
    workspace: Mapped[str | None] = mapped_column(WORKSPACE_KEY, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
    # the account of the session's principal (revision 0013_accounts; NULL: root admin)
    account: Mapped[str | None] = mapped_column(String(63), nullable=True)


# INVARIANT: ``records.version`` and ``versions.version`` are ``Integer`` columns, 32-bit signed
# on PostgreSQL (SQLite's are 64-bit), so no version past ``VERSION_MAX`` can exist; a client's
# version number (API.md: any signed 64-bit integer) meets a query only through
# ``version_in_range`` (``memfuse.server.records.RecordsService._version``), else PostgreSQL
# refuses the comparison (NumericValueOutOfRange, a 500) where SQLite answers 404.
VERSION_MAX = (1 << 31) - 1


def version_in_range(n: int) -> bool:
    """Whether ``n`` is a version number the version columns can hold (1..``VERSION_MAX``):
    one outside it is of no version (404), and must not reach a query."""
    return 1 <= n <= VERSION_MAX


class RecordRow(Base):
    """The current state of one record (its latest version)."""

    __tablename__ = "records"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    store: Mapped[str] = mapped_column(ForeignKey("stores.slug", ondelete="CASCADE"))
    path: Mapped[str] = mapped_column(Text)
    type: Mapped[str | None] = mapped_column(String(16), nullable=True)
    version: Mapped[int] = mapped_column(Integer)
    sha256: Mapped[str] = mapped_column(String(64))
    size: Mapped[int] = mapped_column(BigInteger)
    # None only when the record is deleted and its last version was redacted.
    content: Mapped[str | None] = mapped_column(Text, nullable=True)
    deleted: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_by: Mapped[str] = mapped_column(Text)
    seq: Mapped[int] = mapped_column(BigInteger)
    # File attributes (POSIX): permission bits (``& 0o7777``; None = 0o644) and the
    # modification time in nanoseconds since the epoch (None = ``updated_at``).
    mode: Mapped[int | None] = mapped_column(Integer, nullable=True)
    mtime_ns: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # From the content's frontmatter at every write (``memfuse.server.staleness``): when to
    # check it again, and when the expiry sweep deletes it. None: not set.
    review_after: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)

    __table_args__ = (
        Index(
            "ix_records_live_path",
            "store",
            "path",
            unique=True,
            sqlite_where=deleted == false(),
            postgresql_where=deleted == false(),
        ),
        Index("ix_records_store_path", "store", "path", "id"),
        # (``ix_records_usage (store, deleted, size)`` until revision 0022_drop_records_usage:
        # only revision 0002's backfill of the usage counters read it; every record write paid
        # a page of it in the log, bench/README.md "The close path, session 21")
        # the expiry sweep's scan: live records with an expiry, by time
        Index("ix_records_expires", "expires_at", sqlite_where=(deleted == false()) & expires_at.is_not(None),
              postgresql_where=(deleted == false()) & expires_at.is_not(None)),
    )



class RecordTailRow(Base):
    """What was appended to a large record since its ``records.content`` was last written
    (revision ``0018_record_tails``; ``memfuse.server.tails``): the record's live content is
    ``records.content || tail``, read by every reader through one rule
    (``memfuse.defs.LIVE_CONTENT_SQL``), so an append to a large record writes this small
    row, not the record's whole content again.

    INVARIANT (``tails``): a row exists only for a live record whose ``records.content``
    holds at least ``fulltext.PG_MAX_CHARS`` characters and ends with a line end, and
    ``tail`` holds more than ``records.APPEND_SCAN_CONTEXT`` characters: the full-text head
    and the frontmatter are in ``records.content`` (the frontmatter's block also in
    ``head``), an append's secret-scan context in ``tail``. Any write of a record but an append folds it (``tail`` deleted, the content
    written whole)."""

    __tablename__ = "record_tails"

    record_id: Mapped[str] = mapped_column(ForeignKey("records.id", ondelete="CASCADE"), primary_key=True)
    tail: Mapped[str] = mapped_column(Text)
    # the base's frontmatter block (``memfuse.content.frontmatter_head``; "" for none): what
    # an append reads for the type and the staleness dates instead of the base
    head: Mapped[str] = mapped_column(Text)

# Byte order of live paths on PostgreSQL (revision 0005_records_path_bytes): the snapshot,
# search and tree queries order and compare by ``path COLLATE "C"``, which no index in the
# column's own collation serves. SQLite compares bytes already (``ix_records_store_path``).
Index(
    "ix_records_live_path_bytes",
    RecordRow.__table__.c.store,
    RecordRow.__table__.c.path.collate("C"),
    RecordRow.__table__.c.id,
    postgresql_where=RecordRow.__table__.c.deleted == false(),
).ddl_if(dialect="postgresql")


class VersionRow(Base):
    """One immutable version of a record; ``seq`` is the change-feed position."""

    __tablename__ = "versions"

    seq: Mapped[int] = mapped_column(_SEQ, primary_key=True, autoincrement=True)
    record_id: Mapped[str] = mapped_column(ForeignKey("records.id", ondelete="CASCADE"))
    store: Mapped[str] = mapped_column(STORE_KEY)
    version: Mapped[int] = mapped_column(Integer)
    operation: Mapped[str] = mapped_column(String(16))
    path: Mapped[str] = mapped_column(Text)
    old_path: Mapped[str | None] = mapped_column(Text, nullable=True)
    type: Mapped[str | None] = mapped_column(String(16), nullable=True)
    sha256: Mapped[str] = mapped_column(String(64))
    size: Mapped[int] = mapped_column(BigInteger)
    content: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    actor: Mapped[str] = mapped_column(Text)
    redacted: Mapped[bool] = mapped_column(Boolean, default=False)
    # The record's attributes as of this version (see ``RecordRow``).
    mode: Mapped[int | None] = mapped_column(Integer, nullable=True)
    mtime_ns: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # When and by whom (an actor string) the version was redacted; None for redactions made
    # before revision 0006_anthropic_memory_stores.
    redacted_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    redacted_by: Mapped[str | None] = mapped_column(Text, nullable=True)
    # content removed by the store's history budget (metadata kept; revision 0010)
    pruned: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # An append version (revision 0011, ``memfuse.server.deltas``): ``content`` holds only
    # what this version adds to version ``base_version`` (always ``version - 1``) of the same
    # record; NULL: ``content`` is whole. ``chain``: links since the last whole copy.
    base_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    chain: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # A version written by last writer wins over a concurrent change (an update with
    # ``overwrite``; revision 0019): the number and actor of the version it replaced, which
    # the change feed carries (``Change.overwrote``) so that its writer is told; else NULL.
    overwrote: Mapped[int | None] = mapped_column(Integer, nullable=True)
    overwrote_by: Mapped[str | None] = mapped_column(Text, nullable=True)
    # the sidecar instance that wrote it (``Memfuse-Writer``), NULL without one: what a
    # sidecar's change feed leaves out as its own (``skip_writer``; revision 0021)
    writer: Mapped[str | None] = mapped_column(Text, nullable=True)

    __table_args__ = (
        UniqueConstraint("record_id", "version", name="uq_versions_record_version"),
        Index("ix_versions_store_seq", "store", "seq"),
        {"sqlite_autoincrement": True},
    )


class IdempotencyRow(Base):
    """A stored response for (scope, Idempotency-Key); kept 24 h."""

    __tablename__ = "idempotency_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    scope: Mapped[str] = mapped_column(IDEM_SCOPE)
    key: Mapped[str] = mapped_column(String(255))
    method: Mapped[str] = mapped_column(String(10))
    url_path: Mapped[str] = mapped_column(Text)
    request_hash: Mapped[str] = mapped_column(String(64))
    status: Mapped[int] = mapped_column(Integer)
    response_body: Mapped[str] = mapped_column(Text)
    response_headers: Mapped[str] = mapped_column(Text, default="{}")  # JSON object
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)

    __table_args__ = (UniqueConstraint("scope", "key", name="uq_idempotency_scope_key"),)


class EventRow(Base):
    """A workspace event (attached / detached / store_changed); ``seq`` is the feed position."""

    __tablename__ = "workspace_events"

    seq: Mapped[int] = mapped_column(_SEQ, primary_key=True, autoincrement=True)
    workspace: Mapped[str] = mapped_column(WORKSPACE_KEY)
    kind: Mapped[str] = mapped_column(String(16))
    store: Mapped[str] = mapped_column(STORE_KEY)
    access: Mapped[str | None] = mapped_column(String(16), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    __table_args__ = (Index("ix_events_workspace_seq", "workspace", "seq"), {"sqlite_autoincrement": True})


class ConsolidationJobRow(Base):
    """A consolidation job (``memfuse.server.consolidation``, revision
    ``0012_consolidation_jobs``): a model rewrites a store's records into a new store or in
    place. ``status``: ``pending`` → ``running`` → ``completed`` | ``failed`` | ``canceled``.
    At most one ``pending`` or ``running`` job per store (``ux_consolidation_jobs_active``:
    the database enforces it across replicas). ``heartbeat_at`` is refreshed by the process
    running the job; a job whose heartbeat stops (the process died) is marked failed by any
    replica. ``input_seq``: the store's change-feed seq the job read (the scheduled
    maintenance's cursor). ``usage``, ``changes``: JSON text."""

    __tablename__ = "consolidation_jobs"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    store: Mapped[str] = mapped_column(ForeignKey("stores.slug", ondelete="CASCADE"))
    status: Mapped[str] = mapped_column(String(16))
    output: Mapped[str] = mapped_column(String(16))
    output_store: Mapped[str | None] = mapped_column(STORE_KEY, nullable=True)
    instructions: Mapped[str] = mapped_column(Text)
    model: Mapped[str] = mapped_column(String(200))
    include_history: Mapped[bool] = mapped_column(Boolean, default=False)
    requested_by: Mapped[str] = mapped_column(String(200))
    scheduled: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime)
    input_seq: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    usage: Mapped[str | None] = mapped_column(Text, nullable=True)
    summary: Mapped[str | None] = mapped_column(Text, nullable=True)
    changes: Mapped[str | None] = mapped_column(Text, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)

    __table_args__ = (
        Index("ix_consolidation_jobs_store_created", "store", "created_at"),
        Index("ux_consolidation_jobs_active", "store", unique=True,
              sqlite_where=status.in_(("pending", "running")),
              postgresql_where=status.in_(("pending", "running"))),
    )


# The full-text index of live records (revision 0007_fulltext): not models, DDL run after
# the tables are created (``memfuse.server.fulltext``).
fulltext.install(Base.metadata)


def normalize_db_url(url: str) -> URL:
    """The SQLAlchemy ``URL`` for ``url``, with ``postgresql://`` / ``postgres://`` (no
    driver named) mapped to psycopg 3 (``postgresql+psycopg://``); any other URL unchanged.
    Raises ``sqlalchemy.exc.ArgumentError`` for a bad URL."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://"):]
    u = make_url(url)
    if u.drivername == "postgresql":
        u = u.set(drivername="postgresql+psycopg")
    return u


class Database:
    """Engine plus session factories with the locking rules of this module.

    ``url``: an SQLAlchemy URL (``sqlite:///PATH``, ``sqlite://``, ``postgresql://...``, see
    ``normalize_db_url``). ``schema`` says what to do about the schema at start:

    - ``"migrate"`` (default): upgrade to the newest revision (``schema.upgrade``);
    - ``"check"``: raise ``schema.SchemaBehind`` unless it is there already (``memfuse serve``);
    - ``"none"``: leave it alone (``memfuse db current``).

    An in-memory database is always created with ``create_all`` (nothing else can see it).
    A new SQLite file is created with mode 0600 in its directory, created 0700 when missing
    (``memfuse.privfile.prepare_sqlite_file``, which raises ``PrivateFileError``, an
    ``OSError``, when they cannot be made).
    Raises ``sqlalchemy.exc.ArgumentError`` for a bad URL, ``OperationalError`` when the
    database cannot be reached, ``schema.SchemaError`` as above.
    """

    def __init__(self, url: str, *, schema: str = "migrate") -> None:
        if schema not in ("migrate", "check", "none"):
            raise ValueError(f"schema must be 'migrate', 'check' or 'none', not {schema!r}")
        self.url = normalize_db_url(url)
        self.is_sqlite = self.url.get_backend_name() == "sqlite"
        self.is_memory = self.is_sqlite and self.url.database in (None, "", ":memory:")
        # In-memory: one shared connection, so every session holds this lock.
        self._all_lock: threading.RLock | None = threading.RLock() if self.is_memory else None
        # SQLite file: writers of this process queue here before BEGIN IMMEDIATE.
        self._write_lock: threading.Lock | None = (
            threading.Lock() if self.is_sqlite and not self.is_memory else None
        )
        # SQLite file: the connection of ``write_conn``'s transactions, kept between them (made
        # at the first, replaced when closed or invalidated, closed by ``dispose``): no pool
        # checkout, check-in with its reset and ``Connection`` per write, and its page cache
        # stays this writer's. GUARDED_BY(_write_lock). INVARIANT: None or a connection of
        # ``_write_bind`` outside any transaction while ``_write_lock`` is free.
        self._kept: Connection | None = None
        # SQLite: write_conn transactions committed since the full-text queue was last drained
        # (``_drain_due``). GUARDED_BY(_write_lock, or _all_lock in memory)
        self._since_drain = 0
        # SQLite file: the WAL checkpoint of the kept connection, run after a write's answer
        # (``_checkpoint_due``) instead of inside its commit. GUARDED_BY(_write_lock)
        self._wal = WalCheckpoints()
        # SQLite file: the kept connection while ``write_conn`` holds a transaction it began on
        # the driver (``_driver_transaction``), else None: SQLAlchemy's ``begin`` of it (the
        # autobegin of a Core statement inside) then emits nothing. GUARDED_BY(_write_lock)
        self._driver_open: Connection | None = None
        if self.is_sqlite and self.url.database and not self.is_memory and not self.url.query.get("uri"):
            # a missing directory made 0700, a new file 0600 (it holds memory content and
            # token hashes); fails at once, with a clear message, when they cannot be made
            from memfuse.privfile import prepare_sqlite_file

            prepare_sqlite_file(Path(self.url.database))  # the path SQLite opens
        self.engine = self._make_engine()
        self._on_dispose: list[Callable[[], object]] = []
        # Write sessions bind to this (BEGIN IMMEDIATE on SQLite); made once, not per session.
        self._write_bind = self.engine.execution_options(memfuse_write=True) if self.is_sqlite else self.engine
        shown = self.url.render_as_string(hide_password=True)
        try:
            if self.is_memory:
                Base.metadata.create_all(self.engine)
            elif schema != "none" and not self._at_schema_head():
                from memfuse.server import schema as _schema  # Alembic: only when needed

                if schema == "migrate":
                    _schema.upgrade(self)
                else:
                    _schema.check(self, shown)
        except BaseException:
            self.engine.dispose()
            raise
        log.info("database ready (%s)", shown)

    def _at_schema_head(self) -> bool:
        """Whether the database's Alembic revision is ``SCHEMA_HEAD``, read with one query
        and without importing Alembic (which, with its revision scripts, costs a CLI command
        in local mode about a third of its time). False, when unsure (no version table,
        another revision, an error), sends ``Database`` down the full path of
        ``memfuse.server.schema``, which also handles every other case."""
        with self.engine.connect() as conn:  # a database that does not answer raises, as before
            try:
                rows = conn.exec_driver_sql("SELECT version_num FROM alembic_version").fetchall()
            except SQLAlchemyError:
                return False
        return [r[0] for r in rows] == [SCHEMA_HEAD]

    def _make_engine(self) -> Engine:
        if not self.is_sqlite:
            try:
                # a database that does not answer fails a connect in 10 s (readiness, start),
                # unless the URL says otherwise (?connect_timeout=N)
                args = {} if "connect_timeout" in self.url.query else {"connect_timeout": 10}
                return create_engine(self.url, pool_pre_ping=True, pool_size=10, max_overflow=30,
                                     connect_args=args)
            except ModuleNotFoundError as err:
                hint = " (pip install 'memfuse[postgres]')" if self.url.drivername == "postgresql+psycopg" else ""
                raise ModuleNotFoundError(f"no driver for {self.url.drivername}: {err}{hint}", name=err.name) from err
        if self.is_memory:
            engine = create_engine(
                self.url, connect_args={"check_same_thread": False}, poolclass=StaticPool
            )
        else:
            engine = create_engine(
                self.url,
                # SharedCursorConnection: write_conn's statements share one cursor (rawsql)
                connect_args={"check_same_thread": False, "timeout": 5.0, "factory": SharedCursorConnection},
                pool_size=10,
                max_overflow=30,
                # the connection used last comes back first: its SQLite page cache is still
                # valid after its own commit (another connection's commit empties it), so a
                # write after a write reads the pages it touches from memory, not the file
                # (an append's UPDATE of a 1 MiB record row: its 256 overflow pages)
                pool_use_lifo=True,
            )

        memory = self.is_memory

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn: Any, _record: Any) -> None:  # pragma: no cover - trivial
            # Let SQLAlchemy (not pysqlite) emit BEGIN, so writes can use BEGIN IMMEDIATE.
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=5000")
            fulltext.register_sqlite_functions(dbapi_conn)  # the full-text triggers call it
            if not memory:
                _set_wal(cur)
            cur.close()

        # on the DB-API cursor (memfuse.server.rawsql): the first statement of every transaction
        begin_write, begin_read = Raw(text("BEGIN IMMEDIATE")), Raw(text("BEGIN"))

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Connection) -> None:
            if conn is self._driver_open:
                return  # in write_conn's transaction, begun on the driver: SQLAlchemy joins it
            if conn.get_execution_options().get("memfuse_write"):
                begin_write.run(conn, {})
            else:
                begin_read.run(conn, {})

        return engine

    @contextmanager
    def read(self) -> Iterator[Session]:
        """A session for reading; rolled back at the end. Hold it only briefly."""
        if self._all_lock is not None:
            self._all_lock.acquire()
        try:
            with Session(self.engine, expire_on_commit=False, autoflush=False) as s:
                try:
                    yield s
                finally:
                    s.rollback()
        finally:
            if self._all_lock is not None:
                self._all_lock.release()

    @contextmanager
    def write(self) -> Iterator[Session]:
        """A session in a write transaction, committed when the block ends without error and
        rolled back otherwise. On SQLite it starts with ``BEGIN IMMEDIATE`` and may raise
        ``sqlalchemy.exc.OperationalError`` ("database is locked") after 5 s of contention."""
        lock = self._all_lock if self._all_lock is not None else self._write_lock
        charge = writertime.CURRENT.get()
        if lock is not None:
            lock.acquire()
        try:
            start = charge.enter() if charge is not None else 0.0  # the token's writer time (429)
            try:
                with Session(self._write_bind, expire_on_commit=False, autoflush=True) as s:
                    try:
                        yield s
                        s.commit()
                    except BaseException:
                        s.rollback()
                        raise
            finally:
                if charge is not None:
                    charge.leave(start)
        finally:
            if lock is not None:
                lock.release()

    @contextmanager
    def read_conn(self) -> Iterator[Connection]:
        """``read()`` without the ORM: a Core connection in a read transaction, rolled back
        at the end (for the hot read paths). Same locking rules. In a read request with a
        budget (``memfuse.server.budget``) the connection is attached to it: its statements
        are interrupted when the budget ends, which raises ``ServiceError`` 504 ``timeout``."""
        b = budget.CURRENT.get()
        if b is not None:
            b.check()
        if self._all_lock is not None:
            self._all_lock.acquire()
        try:
            with self.engine.connect() as conn:
                try:
                    if b is None:
                        yield conn
                    else:
                        try:
                            with b.attached(conn.connection.dbapi_connection):
                                yield conn
                        except DBAPIError:
                            b.check()  # interrupted by the budget's end: its error instead
                            raise
                finally:
                    conn.rollback()
        finally:
            if self._all_lock is not None:
                self._all_lock.release()

    @contextmanager
    def write_conn(self, committed: Callable[[], None] | None = None) -> Iterator[Connection]:
        """``write()`` without the ORM: a Core connection in a write transaction (``BEGIN
        IMMEDIATE`` on SQLite), committed when the block ends without error and rolled back
        otherwise. Same locking rules and errors as ``write()``. On an SQLite file every such
        transaction runs on one connection kept between them (``_kept``). ``committed()`` is
        called once the transaction has committed, before the follow-up work of a write
        (SQLite: the full-text drain, ``_drain_due``); it must not raise. The transaction's
        time (to its commit) is charged to the request's token (``writertime.CURRENT``),
        whose first write transaction is refused 429 here when that token's time is spent."""
        lock = self._all_lock if self._all_lock is not None else self._write_lock
        charge = writertime.CURRENT.get()
        if lock is not None:
            lock.acquire()
        try:
            start = charge.enter() if charge is not None else 0.0  # the token's writer time (429)
            if self._write_lock is None:  # PostgreSQL (writers side by side), in-memory SQLite
                with self._write_bind.connect() as conn:
                    try:
                        with conn.begin():
                            yield conn
                    finally:
                        if charge is not None:
                            charge.leave(start)
                    if committed is not None:
                        committed()
                    if self.is_sqlite:
                        self._drain_due(conn)
                return
            kept = self._kept
            if kept is None or kept.closed or kept.invalidated:
                if kept is not None:
                    kept.close()
                kept = self._kept = self._write_bind.connect()
                dbapi = _driver(kept)
                if dbapi is not None:  # its page cache (per connection) holds the write path's indexes
                    dbapi.execute(f"PRAGMA cache_size=-{WRITER_CACHE_KIB}")
                self._wal.take_over(kept)
            conn = kept
            try:
                with self._driver_transaction(conn):
                    yield conn
            finally:
                if charge is not None:
                    charge.leave(start)
            if committed is not None:
                committed()
            self._drain_due(conn)
            if conn.invalidated or conn.in_transaction():  # a drain that failed half-way
                self._kept = None
                conn.close()
            else:
                self._wal.due(conn)
        finally:
            if lock is not None:
                lock.release()

    @contextmanager
    def _driver_transaction(self, conn: Connection) -> Iterator[None]:
        """``with conn.begin():`` for the kept connection (``_write_lock`` held, ``conn`` outside
        any transaction), on the DB-API connection: ``BEGIN IMMEDIATE`` through ``Raw`` (the
        ``before_cursor_execute`` listeners see it, as they see SQLAlchemy's), the driver's
        ``commit()`` when the block ends without error, its ``rollback()`` otherwise.
        SQLAlchemy's transaction machinery (``RootTransaction``, its ``begin`` / ``commit``
        events and pool bookkeeping) cost ~77 Python calls a transaction (bench/README.md,
        "The close path, session 15: serve's writer"). A Core statement inside autobegins
        SQLAlchemy's transaction, which joins this one (``_on_begin`` emits nothing for it)
        and ends it through SQLAlchemy (``commit`` / ``rollback``): the same end on the
        driver. Raises what ``BEGIN IMMEDIATE`` or the commit raises (``OperationalError``:
        database locked, disk I/O), after a rollback; a connection left in a transaction or
        invalidated is closed and not kept."""
        _BEGIN_WRITE.run(conn, {})
        self._driver_open = conn
        shared = _driver(conn)
        if type(shared) is SharedCursorConnection:  # the transaction's Raw statements share one cursor
            shared.raw_listeners = statement_listeners(conn)  # and its listeners (rawsql)
            shared.raw_cursor = shared.cursor()
        else:
            shared = None
        try:
            try:
                yield
            finally:
                if shared is not None:  # closed before the end: no statement left open past it
                    cursor, shared.raw_cursor = shared.raw_cursor, None
                    if cursor is not None:
                        try:
                            cursor.close()
                        except sqlite3.Error:  # its connection closed inside: nothing left open
                            pass
            self._driver_open = None
            tx = conn.get_transaction()
            if tx is not None:  # SQLAlchemy's, autobegun inside: it ends the driver's too
                tx.commit()
            else:
                dbapi = _driver(conn)
                if dbapi is None:  # invalidated inside, without an error: nothing to commit
                    raise InvalidRequestError("the write transaction's connection was invalidated")
                try:
                    dbapi.commit()
                except conn.dialect.loaded_dbapi.Error as e:  # as SQLAlchemy raises it
                    raise DBAPIError.instance(None, None, e, conn.dialect.loaded_dbapi.Error,
                                              dialect=conn.dialect) from e
        except BaseException:
            self._driver_open = None
            keep = False
            try:
                tx = conn.get_transaction()
                if tx is not None:
                    tx.rollback()
                dbapi = _driver(conn)
                if dbapi is not None:
                    if dbapi.in_transaction:
                        dbapi.rollback()
                    keep = not dbapi.in_transaction and not conn.invalidated
            except Exception:  # noqa: BLE001 - the first error is the one to raise
                log.warning("rollback of a write transaction failed: its connection is closed")
            if not keep and self._kept is conn:
                self._kept = None  # not usable as it is: a new one next time
                conn.close()
            raise

    def _drain_due(self, conn: Connection) -> None:
        """After a committed ``write_conn`` transaction on SQLite (its lock held, ``conn``
        outside a transaction): every ``fulltext.DRAIN_EVERY`` of them, index the records
        queued for the full-text index (``fulltext.drain``) in a transaction of its own. A
        failure is logged, never raised (the write committed; ranked search drains first)."""
        self._since_drain += 1
        if self._since_drain < fulltext.DRAIN_EVERY:
            return
        self._since_drain = 0
        try:
            with conn.begin():
                fulltext.drain(conn)
        except Exception as e:  # noqa: BLE001 - logged: the queue waits for the next drain
            log.warning("full-text queue drain failed", extra={"error": type(e).__name__})

    def index_pending(self) -> None:
        """SQLite: index the records queued for the full-text index (``memfuse.server.fulltext``,
        "Pending") in a write transaction, when any is queued (one read tells); nothing on
        PostgreSQL. Ranked search calls it before its read, so it finds every record written
        before it started. Raises what ``write_conn`` raises (``OperationalError`` when the
        database stays locked)."""
        if not self.is_sqlite:
            return
        with self.read_conn() as conn:
            if conn.exec_driver_sql(fulltext.PENDING_ANY).first() is None:
                return
        mine = writertime.CURRENT.set(None)  # earlier writes' work (any token's): nobody's writer time
        try:
            with self.write_conn() as conn:
                fulltext.drain(conn)
        finally:
            writertime.CURRENT.reset(mine)

    def on_dispose(self, fn: Callable[[], object]) -> None:
        """Call ``fn()`` at ``dispose()`` (before the pool closes): stops what listens on the
        database."""
        self._on_dispose.append(fn)

    def dispose(self) -> None:
        """Stop what was registered with ``on_dispose``, then close the kept write connection
        (waiting up to ``DISPOSE_WAIT_SECONDS`` for a write in progress to end; after that it
        is left to the write) and every pooled connection."""
        for fn in self._on_dispose:
            try:
                fn()
            except Exception:  # noqa: BLE001 - closing the pool matters more
                log.exception("closing a database listener failed")
        lock = self._write_lock
        if lock is not None and lock.acquire(timeout=DISPOSE_WAIT_SECONDS):
            try:
                if self._kept is not None:
                    self._kept.close()
                    self._kept = None
            finally:
                lock.release()
        self.engine.dispose()


def info_of(conn: Connection) -> dict[Any, Any]:
    """``conn.info`` (the dict kept with its DB-API connection) read without ``Connection.info``'s
    and ``Connection.connection``'s property calls (~1.5 k instructions each read, and a record
    create read it nine times; bench/README.md, "The close path, session 20: serve's writer"):
    the pool's connection's own (memoized) ``info``; ``conn.info`` itself when ``conn`` has no
    DB-API connection (invalidated, closed: it revalidates or raises, as before)."""
    fairy = conn._dbapi_connection  # noqa: SLF001
    if fairy is None:
        return conn.info
    info: dict[Any, Any] = fairy.info
    return info


def _driver(conn: Connection) -> Any:
    """``conn``'s DB-API connection (sqlite3), or None when it has none (invalidated,
    closed); never reconnects, as ``Connection.connection`` would."""
    fairy = conn._dbapi_connection  # noqa: SLF001
    return None if fairy is None else fairy.dbapi_connection


class WalCheckpoints:
    """The WAL checkpoints of an SQLite file's kept write connection (``Database.write_conn``),
    run after a write's answer instead of inside its commit.

    SQLite's automatic checkpoint (``wal_autocheckpoint``, 1,000 frames by default) runs in the
    ``COMMIT`` that crosses it: that write waits for the copy of the log into the database and
    two fsyncs (the log's, the database file's) before it is answered. A create writes ~20
    frames (one page of each b-tree it touches), so every ~50th create paid ~1 ms more, on the
    critical path of a ``close(2)`` (bench/README.md, "The close path, session 20: the WAL
    checkpoint"). Here the kept connection runs with ``wal_autocheckpoint=0`` and, after a
    committed transaction has been answered (``write_conn`` calls ``due`` after
    ``committed()`` and the full-text drain), a ``PRAGMA wal_checkpoint(PASSIVE)`` once about
    ``FRAMES`` frames were written since the last one: the same work and the same rule as
    SQLite's own (PASSIVE, the automatic checkpoint's mode: it never waits for a reader or a
    writer), in the time the client spends on the answer. Durability is unchanged: a commit is
    on disk at its own fsync of the log (``synchronous=FULL``); a checkpoint only moves pages.

    Frames per transaction are not known before a checkpoint reports the log's size, so the
    interval in transactions is learnt: ``every`` starts at ``FIRST_EVERY`` and is set after
    each checkpoint to the transactions that made ``FRAMES`` frames at the last rate seen,
    within ``[1, MAX_EVERY]``. A checkpoint that fails (disk error, database locked) is logged
    and tried again at the next transaction; it never fails the write, which committed.

    Other connections (readers that write, the CLI in local mode, another process) keep
    SQLite's automatic checkpoint: if this one stops running, theirs still bound the log.
    """

    FRAMES = 1000  # SQLite's default wal_autocheckpoint (frames)
    FIRST_EVERY = 32  # transactions before the first checkpoint of a connection
    MAX_EVERY = 1000  # at most this many transactions between two checkpoints

    def __init__(self) -> None:
        # GUARDED_BY(Database._write_lock). INVARIANT: ``since`` counts the kept connection's
        # committed transactions since its last checkpoint (or since it was taken over)
        self.since = 0
        self.every = self.FIRST_EVERY
        self.runs = 0  # checkpoints run (tests, the benchmark)
        self.frames = 0  # log frames the checkpoints found, summed (the benchmark: frames a write)

    def take_over(self, conn: Connection) -> None:
        """``conn`` is the new kept write connection: turn its automatic checkpoint off.
        A failure leaves it on (SQLite checkpoints in the commit, as before), logged."""
        self.since, self.every = 0, self.FIRST_EVERY
        dbapi = _driver(conn)
        try:
            if dbapi is not None:  # on the driver: outside SQLAlchemy's autobegun transaction
                dbapi.execute("PRAGMA wal_autocheckpoint=0")
        except sqlite3.Error as e:
            log.warning("WAL checkpoint: automatic checkpoint left on",
                        extra={"error": type(e).__name__})

    def due(self, conn: Connection) -> None:
        """After a committed transaction of ``conn`` (outside any transaction, the write lock
        held): checkpoint when ``every`` transactions have committed since the last one.
        Never raises."""
        self.since += 1
        if self.since < self.every:
            return
        dbapi = _driver(conn)
        if dbapi is None:
            return
        try:  # on the driver, in autocommit: a checkpoint cannot run inside a transaction
            row = dbapi.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except sqlite3.Error as e:
            log.warning("WAL checkpoint failed; tried again after the next write",
                        extra={"error": type(e).__name__})
            self.every = self.since + 1
            return
        self.runs += 1
        frames = int(row[1]) if row is not None and row[1] is not None and int(row[1]) > 0 else 0
        if frames > 0:
            self.frames += frames
            self.every = max(1, min(self.MAX_EVERY, self.since * self.FRAMES // frames))
        self.since = 0


# on the DB-API cursor (memfuse.server.rawsql): write_conn's transactions on the kept connection
_BEGIN_WRITE = Raw(text("BEGIN IMMEDIATE"))
#: KiB of SQLite page cache of the kept write connection (``write_conn``; SQLite's default is
#: 2,000 KiB). Every create inserts into five indexes keyed by a random id (the record's id
#: twice, its version's ``(record_id, version)``, its full-text key, its idempotency key), each
#: at a random leaf page: once a store's file outgrows the cache those pages are read again
#: from the file, read system calls per create growing with the store (4.2 → 15.3 over 8,000
#: creates; 3.4 → 6.8 with 64 MiB; bench/README.md, "The close path, session 20: serve's
#: writer"). One connection: the memory is bounded by this, allocated only as pages are read.
WRITER_CACHE_KIB = 16384
DISPOSE_WAIT_SECONDS = 5.0  # how long dispose() waits for a write in progress (the kept connection)
WAL_SWITCH_SECONDS = 5.0  # how long a new connection may wait to switch a new file to WAL


def _set_wal(cur: sqlite3.Cursor) -> None:
    """Put the SQLite file in WAL mode (persistent in the file, so usually already set).

    Switching a brand-new file needs a lock that SQLite does not wait for through
    ``busy_timeout``: while another connection holds a write transaction on it (two processes
    creating or migrating the same new database at once), ``PRAGMA journal_mode=WAL`` fails
    at once with "database is locked". So look first, and retry the switch for up to
    ``WAL_SWITCH_SECONDS``; then raise ``sqlite3.OperationalError``."""
    deadline = time.monotonic() + WAL_SWITCH_SECONDS
    while True:
        try:
            if str(cur.execute("PRAGMA journal_mode").fetchone()[0]).lower() != "wal":
                cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() >= deadline:
                raise
            time.sleep(0.02)
