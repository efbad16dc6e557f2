"""What the record reads and writes share: the ``records`` row as an object (``_Rec``), the
content and size rules mapped to problem codes, the snapshot cursor, the statements of the hot
paths, the usage counters of a batch (``BatchStore``) and the wire models of a record and a
version (``_record_model``, ``_version_model``). No service state: plain functions over a
``Connection``. The services are ``memfuse.server.records`` (writes) and
``memfuse.server.recordreads`` (reads).
"""
from __future__ import annotations

import base64
import json
import logging
import os
from collections.abc import Iterable
from datetime import datetime

from typing import Any

import msgspec
from sqlalchemy import (String, bindparam, false, func, insert, literal_column, null, select, text, type_coerce, union_all,
                        update)
from sqlalchemy.engine import Connection

from memfuse import content as content_rules
from memfuse import wire
from memfuse.defs import mtime_effective_ns
from memfuse.defs import DEFAULT_MODE, Operation
from memfuse.models import Record, Version
from memfuse.server.base import LIVE_PATHS_ORDER, AnyRow, ServiceError, _R, _S, _V, parse_if_match
from memfuse.server import keys, staleness, tails, wakeups
from memfuse.server.rawsql import Raw, RawIn
from memfuse.server.db import DEFAULT_ACCOUNT, AccountRow, UTCDateTime

log = logging.getLogger("memfuse.server.service")  # every room of the Service logs under one name

#: characters of a record's content before an appended suffix that the secret scan reads
#: with it (from the start of their line), so a secret the suffix completes is found
#: (``tails.scan_context``)
APPEND_SCAN_CONTEXT = tails.SCAN_CONTEXT


def _check_if_match(header: str | None, current_sha: str) -> None:
    tags = parse_if_match(header)
    if tags is None or tags == ["*"] or current_sha in tags:
        return
    raise ServiceError(
        412, "precondition_failed", "the record has changed since that version", sha256=current_sha
    )


def _check_content(text: str) -> bytes:
    """``text`` as UTF-8; 422 ``invalid_content`` when it holds NUL or cannot be encoded
    (lone surrogates from JSON ``\\ud800``)."""
    try:
        return content_rules.check_text(text)
    except ValueError as err:
        raise ServiceError(422, "invalid_content", str(err)) from None


def _resolve_type(path: str, text: str, explicit: str | None, fallback: str | None) -> str | None:
    """The validated type (explicit > frontmatter > ``fallback``; None for the root
    ``MEMORY.md``); 422 ``invalid_type``."""
    try:
        t = content_rules.record_type(path, text, explicit, fallback)
        if t is None and not content_rules.is_index(path):
            raise content_rules.InvalidType("the record has no type and no default applies")
        content_rules.check_type(t)
        return t
    except ValueError as err:
        raise ServiceError(422, "invalid_type", str(err)) from None


def _secret_error(reason: str) -> ServiceError:
    """422 ``secret_detected``; ``reason`` names the kind and line, never the secret."""
    return ServiceError(
        422,
        "secret_detected",
        f"content holds a secret ({reason}); memory must not store credentials: remove it and write again",
    )


def _check_record_size(store: AnyRow, size: int) -> None:
    if size > store.max_record_bytes:
        raise ServiceError(
            413,
            "record_too_large",
            f"record is {size} bytes, the store allows {store.max_record_bytes}",
        )


def _check_writable(st: AnyRow) -> None:
    """403 ``store_archived`` when the store was archived (``stores.archived_at``, the
    Anthropic memory-store API's archive): its records may still be read, deleted and
    redacted, never created, changed, moved or restored."""
    if getattr(st, "archived_at", None) is not None:
        raise ServiceError(403, "store_archived", f"store {keys.public(st.slug)!r} is archived: its records cannot be written")


def _like_escape(text: str) -> str:
    """``text`` for a ``LIKE`` pattern with escape character ``\\``: ``\\``, ``%`` and ``_``
    match literally."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def _encode_cursor(path: str, record_id: str) -> str:
    raw = json.dumps([path, record_id], ensure_ascii=False).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[str, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        path, rid = json.loads(raw)
        if not isinstance(path, str) or not isinstance(rid, str):
            raise ValueError
        return path, rid
    except Exception:
        raise ServiceError(422, "validation_error", "cursor is not one this server gave out") from None


_RECORD_COLUMNS = tuple(c.name for c in _R.c)

#: the bits of a random 128-bit number kept (all but the version's four and the variant's two)
#: and set (version 4, variant RFC 4122) to make it a random UUID (``new_record_id``)
_UUID4_KEEP = 0xFFFFFFFF_FFFF_0FFF_3FFF_FFFFFFFFFFFF
_UUID4_SET = 0x00000000_0000_4000_8000_000000000000


def new_record_id(urandom: Any = os.urandom, from_bytes: Any = int.from_bytes) -> str:
    """A new record's id: ``str(uuid.uuid4())`` (16 bytes of ``os.urandom``, version 4,
    variant RFC 4122, lower-case hex in 8-4-4-4-12) without ``uuid.UUID``'s constructor
    and its checks: ~2 µs less a create (bench/README.md, "The close path, session 20:
    serve's writer"; ``tests/test_rawsql.py`` reads ids back with ``uuid.UUID``). The
    arguments are bound once (not for callers)."""
    x = "%032x" % (from_bytes(urandom(16)) & _UUID4_KEEP | _UUID4_SET)
    return f"{x[:8]}-{x[8:12]}-{x[12:16]}-{x[16:20]}-{x[20:]}"


class _Rec:
    """One ``records`` row as a plain mutable object (no ORM session): every column is an
    attribute. Made from a Core row with ``of``; written back by ``Service._add_version``."""

    # ``base_content``: the content of the record's current version as read (the base of an
    # append version, ``deltas.plan``); ``tailed``: whether the record has a tail
    # (``tails``: a write of its whole content drops it); not columns
    __slots__ = (*_RECORD_COLUMNS, "base_content", "tailed")

    # the columns (``memfuse.server.db.RecordRow``), declared for the type checker
    id: str
    store: str
    path: str
    type: str | None
    version: int
    sha256: str
    size: int
    content: str | None
    deleted: bool
    created_at: datetime
    updated_at: datetime
    updated_by: str
    seq: int
    mode: int | None
    mtime_ns: int | None
    review_after: datetime | None
    expires_at: datetime | None
    base_content: str | None
    tailed: bool

    def __init__(self, **values: object) -> None:
        for k, v in values.items():
            setattr(self, k, v)

    @classmethod
    def of(cls, row: AnyRow) -> "_Rec":
        """The record of a ``_SELECT_RECORD``-like row (``content``: the live content;
        ``tailed``, when selected: whether it has a tail)."""
        m = row._mapping
        rec = cls(**m) if "tailed" in m else cls(**m, tailed=False)
        rec.base_content = row.content
        return rec

    def values(self) -> dict[str, object]:
        """Every column → value."""
        return {k: getattr(self, k) for k in _RECORD_COLUMNS}


# Statements of the hot paths, built once (parameters at execution).
_INSERT_RECORD = insert(_R)
_INSERT_VERSION = insert(_V)
_UPDATE_RECORD = update(_R).where(_R.c.id == bindparam("rid"))
_UPDATE_USAGE = (  # also the batch's one usage statement
    update(_S)
    .where(_S.c.slug == bindparam("slug_"))
    .values(
        usage_bytes=_S.c.usage_bytes + bindparam("d_bytes"),
        record_count=_S.c.record_count + bindparam("d_count"),
    )
)
# A snapshot page's columns, in the order ``list_records_json`` reads them (content last).
_PAGE_COLUMNS_NO_CONTENT = (_R.c.id, _R.c.store, _R.c.path, _R.c.type, _R.c.version, _R.c.sha256, _R.c.size,
                            _R.c.deleted, _R.c.created_at, _R.c.updated_at, _R.c.updated_by, _R.c.seq,
                            _R.c.mode, _R.c.mtime_ns)
_PAGE_COLUMNS = (*_PAGE_COLUMNS_NO_CONTENT, tails.LIVE_CONTENT)


def _raw_times(cols: tuple[Any, ...]) -> tuple[Any, ...]:
    """``cols`` with the two times read as SQLite stores them (text), not parsed by
    SQLAlchemy: ``_sqlite_time`` parses them in a fraction of the time."""
    return tuple(type_coerce(c, String).label(c.name) if c.name in ("created_at", "updated_at") else c
                 for c in cols)


_PAGE_COLUMNS_SQLITE = _raw_times(_PAGE_COLUMNS)
_PAGE_COLUMNS_NO_CONTENT_SQLITE = _raw_times(_PAGE_COLUMNS_NO_CONTENT)


def _same(value: datetime) -> datetime:
    return value


def _sqlite_time(value: str) -> datetime:
    """A time as the SQLite backend stores it (naive UTC text, ``YYYY-MM-DD HH:MM:SS[.ffffff]``)
    as the aware ``datetime`` ``UTCDateTime`` reads; anything else through SQLAlchemy's own
    parser. ~0.14 µs instead of ~1.8 (the offset parsed with it: ``timezone.utc`` itself, where
    a ``replace(tzinfo=...)`` after the parse took ~0.9 µs; bench/README.md "Sidecar memory,
    session 24")."""
    try:
        if len(value) in (19, 26) and value[10] == " ":
            return datetime.fromisoformat(value + "+00:00")
    except ValueError:
        pass
    from sqlalchemy.dialects import sqlite

    dialect = sqlite.dialect()
    process = UTCDateTime().dialect_impl(dialect).result_processor(dialect, None)
    assert process is not None  # UTCDateTime always processes
    parsed = process(value)
    assert isinstance(parsed, datetime)
    return parsed


_PAGE_ENCODER = msgspec.json.Encoder()
#: every column of a record, its live content (``tails``) as ``content``, and ``tailed``
_RECORD_LIVE = (*tails.live(tuple(_R.c)), tails.HAS_TAIL)
_SELECT_RECORD = select(*_RECORD_LIVE).where(_R.c.id == bindparam("rid"))
_SELECT_LIVE_AT = select(*_RECORD_LIVE).where(
    _R.c.store == bindparam("store"), _R.c.path == bindparam("path"), _R.c.deleted == false()
)
_SELECT_LIVE_ID_AT = select(_R.c.id).where(
    _R.c.store == bindparam("store"), _R.c.path == bindparam("path"), _R.c.deleted == false()
)


#: (path, id) of the live records at any of ``paths`` (a new record's path and its ancestors)
_SELECT_LIVE_AT_PATHS = select(_R.c.path, _R.c.id).where(
    _R.c.store == bindparam("store"), _R.c.deleted == false(),
    _R.c.path.in_(bindparam("paths", expanding=True))).order_by(LIVE_PATHS_ORDER)

#: a live record under the directory ``lo`` = ``path + "/"`` (``hi`` = ``path + "0"``: the
#: byte after ``/``), if one; paths compared in byte order (``_PG``: ``COLLATE "C"``, the
#: index of revision ``0005_records_path_bytes``)
_SELECT_LIVE_UNDER = select(_R.c.path).where(
    _R.c.store == bindparam("store"), _R.c.deleted == false(),
    _R.c.path >= bindparam("lo"), _R.c.path < bindparam("hi")).limit(1)
_SELECT_LIVE_UNDER_PG = select(_R.c.path).where(
    _R.c.store == bindparam("store"), _R.c.deleted == false(),
    _R.c.path.collate("C") >= bindparam("lo"), _R.c.path.collate("C") < bindparam("hi")).limit(1)

# The statements of a create and an update, run on the DB-API cursor (``memfuse.server.rawsql``:
# the SQL above, compiled once per dialect). A version's insert hands back its seq (RETURNING:
# SQLite 3.35+, PostgreSQL), as Core's ``inserted_primary_key`` did.
_RAW_INSERT_VERSION = Raw(_INSERT_VERSION.returning(_V.c.seq))


def next_seq_sql(pg: bool) -> str:
    """The change-feed seq the versions' next insert without an explicit ``seq`` would take,
    as an SQL expression that also takes it (the one rule of seqs given ahead of their
    version: ``reserve_seqs``, a new record's insert). PostgreSQL: ``nextval`` of the
    versions' sequence (taken: a later insert without a seq gets the next one). SQLite: what
    its ``AUTOINCREMENT`` picks, one past the larger of ``sqlite_sequence``'s value (the
    largest seq ever given, none before the first insert) and the largest seq in the table;
    not taken by itself: the version's insert with that explicit seq moves
    ``sqlite_sequence`` to it, and the transaction's write lock (``BEGIN IMMEDIATE``) keeps
    any other writer from taking it between the two. ``tests/test_rawsql.py`` checks it
    against SQLite's own choice in random states."""
    if pg:
        return "nextval(pg_get_serial_sequence('versions', 'seq'))"
    return ("(max(coalesce((SELECT sqlite_sequence.seq FROM sqlite_sequence WHERE sqlite_sequence.name = 'versions'), 0), "
            "coalesce((SELECT max(versions.seq) FROM versions), 0)) + 1)")


#: A new record's insert, its seq given ahead of its version (``next_seq_sql``) and handed
#: back (RETURNING): the version is then inserted with that seq (``_RAW_INSERT_VERSION_AT``),
#: and the record needs no second statement for its seq (bench/README.md, "The close path,
#: session 18: serve's writer statements"); by "is PostgreSQL". The parameters: every column
#: but ``seq``.
_RAW_INSERT_NEW_RECORD = {pg: Raw(_INSERT_RECORD.values(seq=literal_column(next_seq_sql(pg))).returning(_R.c.seq))
                          for pg in (False, True)}
#: a new record's insert with its seq given (SQLite: read by ``_live_at_or_under``)
_RAW_INSERT_RECORD = Raw(_INSERT_RECORD)
#: a version's insert with its seq given (``seq`` among the parameters)
_RAW_INSERT_VERSION_AT = Raw(_INSERT_VERSION)
_RAW_UPDATE_RECORD = Raw(_UPDATE_RECORD)
_RAW_UPDATE_USAGE = Raw(_UPDATE_USAGE)
_RAW_SELECT_RECORD = Raw(_SELECT_RECORD)
_RAW_SELECT_LIVE_UNDER = {False: Raw(_SELECT_LIVE_UNDER), True: Raw(_SELECT_LIVE_UNDER_PG)}  # by "is PostgreSQL"
_RAW_SELECT_LIVE_AT_PATHS = RawIn("paths", lambda n: select(_R.c.path, _R.c.id).where(
    _R.c.store == bindparam("store"), _R.c.deleted == false(),
    _R.c.path.in_([bindparam(f"paths{i}") for i in range(n)])).order_by(LIVE_PATHS_ORDER))


def _live_at_or_under(n: int, pg: bool) -> Any:
    """A create's one read of the live records that refuse its path (``_create_op``): (path,
    id) of those at any of the ``n`` paths ``paths0`` .. (the path and its ancestors), then
    (path, NULL) of one live record under the directory ``lo`` .. ``hi`` (as
    ``_SELECT_LIVE_UNDER``), if any: two statements' rows in one (bench/README.md, "The close
    path, session 17: serve's writer"). One ``UNION ALL`` arm per path (``path = ?``, each
    looked up on ``ix_records_live_path``), not ``path IN (...)``: SQLite builds an ephemeral
    table of an ``IN`` list's values for every run, ~40 % of this statement's instructions
    (bench/README.md, "The close path, session 20: serve's writer"); the caller reads the
    rows into a dict, so they need no order. The part under the directory in its own
    subquery, which keeps its ``LIMIT`` (``tests/test_rawsql.py`` checks the plans).

    SQLite: a last row (NULL, the seq the new record and its version take: ``next_seq_sql``),
    read under the transaction's write lock, so the record is inserted with it
    (``_RAW_INSERT_RECORD``) without a RETURNING: SQLite runs a RETURNING through an
    ephemeral table, ~30 k instructions (bench/README.md, "The close path, session 20").
    PostgreSQL takes its seq from the sequence at the insert (``_RAW_INSERT_NEW_RECORD``)."""
    arms = [select(_R.c.path, _R.c.id).where(
        _R.c.store == bindparam("store"), _R.c.deleted == false(), _R.c.path == bindparam(f"paths{i}"))
        for i in range(n)]
    col = _R.c.path.collate("C") if pg else _R.c.path
    under = select(_R.c.path, null().label("id")).where(
        _R.c.store == bindparam("store"), _R.c.deleted == false(),
        col >= bindparam("lo"), col < bindparam("hi")).limit(1).subquery("under_")
    parts = [*arms, select(under.c.path, under.c.id)]
    if not pg:
        parts.append(select(null().label("path"), literal_column(next_seq_sql(False)).label("id")))
    return union_all(*parts)


#: ``_live_at_or_under`` by "is PostgreSQL"
_RAW_SELECT_LIVE_AT_OR_UNDER = {False: RawIn("paths", lambda n: _live_at_or_under(n, False)),
                                True: RawIn("paths", lambda n: _live_at_or_under(n, True))}


_SELECT_ACCOUNT_MAX_BYTES = select(AccountRow.__table__.c.max_bytes).where(
    AccountRow.__table__.c.slug == bindparam("account"))
_SELECT_ACCOUNT_OTHER_BYTES = select(func.coalesce(func.sum(_S.c.usage_bytes), 0)).where(
    _S.c.account == bindparam("account"), _S.c.slug != bindparam("slug"))


_UNREAD = object()


def _account_room(conn: Connection, st: AnyRow | BatchStore, store_bytes: int) -> None:
    """507 ``account_full`` when the store ``st`` holding ``store_bytes`` puts its account
    over its ``max_bytes`` (docs/API.md "Accounts"). The quota comes with a store row read
    for writing (``account_max_bytes``, ``base._for_update``), else one primary-key read; with
    one, a sum over the account's other stores (``ix_stores_account``)."""
    account = getattr(st, "account", None) or DEFAULT_ACCOUNT
    limit = getattr(st, "account_max_bytes", _UNREAD)  # read with the store row for writing
    if limit is _UNREAD:
        limit = conn.execute(_SELECT_ACCOUNT_MAX_BYTES, {"account": account}).scalar()
    if limit is None:
        return
    total = conn.execute(_SELECT_ACCOUNT_OTHER_BYTES, {"account": account, "slug": st.slug}).scalar_one() + store_bytes
    if total > limit:
        raise ServiceError(507, "account_full", f"account {account!r} would hold {total} bytes, limit {limit}")


def reserve_seqs(conn: Connection, n: int) -> list[int]:
    """``n`` change-feed seqs for versions this transaction inserts with an explicit ``seq``,
    ascending, from ``next_seq_sql`` (PostgreSQL: ``nextval`` of the versions' sequence, one
    a seq; SQLite: from the next seq on, which the database's write lock, held by the
    transaction, keeps for it; an insert with an explicit seq moves ``sqlite_sequence`` past
    it)."""
    if conn.dialect.name == "postgresql":
        return list(conn.execute(text(
            f"SELECT {next_seq_sql(True)} FROM generate_series(1, :n)"), {"n": n}).scalars())
    first = int(conn.execute(text(f"SELECT {next_seq_sql(False)}")).scalar_one())
    return list(range(first, first + n))


class BatchStore:
    """The store row of a batch as a mutable object: its columns as attributes, with the
    usage counters (``record_count``, ``usage_bytes``) kept here as the batch's operations
    change them; ``read_*`` are the counters as read under the lock (the batch adds the
    difference in one statement at its end).

    Creates at the head of a batch are *deferred*: the batch reads the live records at
    their paths in one query (``paths``: path → record id) and reserves their change-feed
    seqs in one (``seqs``), so a create checks and builds its record without a statement;
    ``flush`` inserts every deferred record, then every version, in one statement each.
    The first operation of another kind flushes and ends deferral (it reads records, and
    its version must come after every earlier create's)."""

    # the columns the batch reads and changes (every column of ``stores`` is an attribute)
    slug: str
    account: str
    record_count: int
    usage_bytes: int

    def __init__(self, row: AnyRow) -> None:
        self.__dict__.update(row._mapping)
        self.read_count, self.read_bytes = self.record_count, self.usage_bytes
        self.deferring = False
        self.paths: dict[str, str] = {}
        self.dirs: set[str] = set()  # the ancestors of every path in ``paths`` (``_check_clash``)
        self.seqs: list[int] = []
        self._records: list[dict[str, object]] = []
        self._versions: list[dict[str, object]] = []

    def defer(self, conn: Connection, paths: list[str], n: int) -> None:
        """Start deferring up to ``n`` creates at ``paths``: one read of the live records
        there, one reservation of ``n`` seqs (PostgreSQL: ``nextval`` of the versions'
        sequence; SQLite: past ``sqlite_sequence``, under the database's write lock)."""
        if n <= 0:
            return
        rows = conn.execute(select(_R.c.path, _R.c.id).where(
            _R.c.store == self.slug, _R.c.deleted == false(), _R.c.path.in_(paths)).order_by(LIVE_PATHS_ORDER))
        self.paths = {r.path: r.id for r in rows}
        self.seqs = reserve_seqs(conn, n)
        self.seqs.reverse()  # pop() takes the smallest
        self.deferring = True

    def defer_create(self, rec: "_Rec", actor: str, now: datetime, writer: str | None = None) -> None:
        """Queue the insert of ``rec`` (a new record, version 1) and its ``created`` version
        (by ``actor``, sent by sidecar instance ``writer``) with the next reserved seq; sets
        ``rec.seq``; notes the feed."""
        seq = self.seqs.pop()
        rec.seq = seq
        rec.updated_at, rec.updated_by = now, actor
        rec.review_after, rec.expires_at = staleness.record_dates(rec.content)
        self._records.append(rec.values())
        self._versions.append({
            "seq": seq, "record_id": rec.id, "store": rec.store, "version": rec.version,
            "operation": Operation.created.value, "path": rec.path, "old_path": None,
            "type": rec.type, "sha256": rec.sha256, "size": rec.size, "content": rec.content,
            "created_at": now, "actor": actor, "redacted": False, "mode": rec.mode,
            "mtime_ns": rec.mtime_ns, "base_version": None, "chain": 0, "writer": writer,
        })
        self.paths[rec.path] = rec.id
        parts = rec.path.split("/")
        self.dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
        wakeups.note_feed(rec.store, seq, writer or actor)
        if not self.seqs:
            self.deferring = False

    def flush(self, conn: Connection) -> None:
        """Insert the deferred records and versions (one statement each) and stop deferring."""
        self.deferring = False
        if self._records:
            conn.execute(_INSERT_RECORD, self._records)
            conn.execute(_INSERT_VERSION, self._versions)
            self._records, self._versions = [], []


def _mode(value: int | None) -> int:
    """The permission bits a file shows for a stored ``mode`` (NULL: 0o644)."""
    return DEFAULT_MODE if value is None else value


def _pin_mtime(rec: _Rec) -> None:
    """Store the mtime a record's file shows (``updated_at`` when it has no explicit one)
    as its explicit ``mtime_ns``, before a version that must not change it (a move, as
    rename(2) leaves ``st_mtime`` alone) sets ``updated_at`` to now."""
    if rec.mtime_ns is None:
        rec.mtime_ns = mtime_effective_ns(None, rec.updated_at)


def _attrs(rec: _Rec) -> tuple[int, int | None]:
    """What decides whether an attribute change makes a version: (effective mode, mtime)."""
    return _mode(rec.mode), rec.mtime_ns


def _record_model(rec: _Rec | AnyRow, *, with_content: bool) -> Record:
    return Record(
        id=rec.id,
        store=keys.public(rec.store),
        path=rec.path,
        type=rec.type,
        version=rec.version,
        sha256=rec.sha256,
        size=rec.size,
        deleted=rec.deleted,
        created_at=rec.created_at,
        updated_at=rec.updated_at,
        updated_by=rec.updated_by,
        seq=rec.seq,
        content=rec.content if with_content else None,
        mode=_mode(rec.mode),
        mtime_ns=rec.mtime_ns,
        review_after=getattr(rec, "review_after", None),
        expires_at=getattr(rec, "expires_at", None),
    )


def record_answer(rec: _Rec) -> wire.Record:
    """``_record_model(rec, with_content=False)`` as the ``wire.Record`` msgspec struct: the same
    members, order and JSON (``base.answer_json``; ``tests/test_wire.py``), without a pydantic
    validation and serialization: a create's answer (bench/README.md, "The close path,
    session 17: serve's writer")."""
    return wire.Record(
        id=rec.id, store=keys.public(rec.store), path=rec.path, type=rec.type, version=rec.version,
        sha256=rec.sha256, size=rec.size, deleted=rec.deleted, created_at=rec.created_at,
        updated_at=rec.updated_at, updated_by=rec.updated_by, seq=rec.seq, content=None,
        mode=_mode(rec.mode), mtime_ns=rec.mtime_ns, review_after=rec.review_after,
        expires_at=rec.expires_at)


def _version_model(v: AnyRow, *, with_content: bool) -> Version:
    return Version(
        record_id=v.record_id,
        version=v.version,
        operation=Operation(v.operation),
        path=v.path,
        type=v.type,
        sha256=v.sha256,
        size=v.size,
        created_at=v.created_at,
        actor=v.actor,
        redacted=v.redacted,
        pruned=bool(getattr(v, "pruned", False)),
        seq=v.seq,
        content=v.content if with_content and not v.redacted else None,
        mode=_mode(v.mode),
        mtime_ns=v.mtime_ns,
    )


def _usage(conn: Connection, slugs: Iterable[str] | None = None) -> dict[str, tuple[int, int]]:
    """Live (record_count, bytes) per store slug, counted from the records (a full scan of
    the stores' live records: for checks and tests, never on a request path)."""
    q = select(_R.c.store, func.count(), func.coalesce(func.sum(_R.c.size), 0)).where(_R.c.deleted == false())
    if slugs is not None:
        q = q.where(_R.c.store.in_(list(slugs)))
    return {slug: (int(n), int(b)) for slug, n, b in conn.execute(q.group_by(_R.c.store))}
