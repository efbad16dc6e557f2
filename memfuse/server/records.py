"""Records and their versions: every write (reads: ``recordreads``; shared rules: ``recordrows``).

A write appends a version and updates the record row and the store's usage counters in one
transaction (``Writer.write`` with ``feed`` = the store), through SQLAlchemy Core on the
session's connection. Content rules (UTF-8, type, secrets) come from :mod:`memfuse.content`,
mapped here to problem codes. The change feed that reads these versions is in ``changes``.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

from sqlalchemy import false, select, update
from sqlalchemy.engine import Connection

from memfuse import content as content_rules
from memfuse import wire
from memfuse.defs import PREFIX_MOVE_MAX, mtime_effective_ns
from memfuse.hashstate import Sha256States
from memfuse.secretscan import AppendScans
from memfuse.models import (
    MoveResult,
    Operation,
    PrefixMove,
    Record,
    RecordAppend,
    RecordAttributes,
    RecordCreate,
    RecordMove,
    RecordUpdate,
    Restore,
    Version,
)
from memfuse.server.base import (
    _R,
    _V,
    AnyRow,
    IdempotencyRequest,
    Principal,
    Reply,
    Resource,
    ServiceError,
    _check_new_path,
    _check_path,
    parse_if_match,
)
from memfuse.server import deltas, history, keys, prescan, staleness, tails, wakeups
from memfuse.server.db import info_of, utcnow, version_in_range
from memfuse.server.recordrows import (
    BatchStore,
    _RAW_INSERT_NEW_RECORD,
    _RAW_INSERT_RECORD,
    _RAW_INSERT_VERSION,
    _RAW_INSERT_VERSION_AT,
    _RAW_SELECT_LIVE_AT_OR_UNDER,
    _RAW_SELECT_LIVE_AT_PATHS,
    _RAW_SELECT_LIVE_UNDER,
    _RAW_SELECT_RECORD,
    _RAW_UPDATE_RECORD,
    _RAW_UPDATE_USAGE,
    _RECORD_LIVE,
    _Rec,
    _SELECT_LIVE_AT,
    _SELECT_LIVE_ID_AT,
    _INSERT_VERSION,
    _UPDATE_RECORD,
    _account_room,
    _attrs,
    _check_content,
    _check_if_match,
    _check_record_size,
    _check_writable,
    _decode_cursor,
    _encode_cursor,
    _like_escape,
    _mode,
    _pin_mtime,
    _record_model,
    _resolve_type,
    record_answer,
    _secret_error,
    _sqlite_time,
    _usage,
    _version_model,
    new_record_id,
    reserve_seqs,
)

log = logging.getLogger("memfuse.server.service")  # every room of the Service logs under one name

#: sha256 states of recently written contents (``memfuse.hashstate``): an append's sha256 is
#: computed over its suffix when its base was written (or appended to) by this process
_HASHES = Sha256States()
#: the hints of the windows recent appends' secret scans read: an append's scan from the last
#: one's (``memfuse.secretscan``)
_SCANS = AppendScans()
#: the most records one prefix move (``move_prefix``, a directory rename) moves
#: (``memfuse.defs.PREFIX_MOVE_MAX``: the sidecar refuses a bigger rename(2) with EXDEV and
#: its client's timeout for a move is derived from it, ``defs.prefix_move_timeout``)
MAX_PREFIX_MOVE = PREFIX_MOVE_MAX



#: how many of a record's newest versions an overwrite looks through for the writers it
#: drops (``overwritten_authors``): a bound on the work of one write
OVERWRITE_SCAN = 64


def overwritten_authors(conn: Connection, rec: Any, base: str | None, actor: str) -> list[tuple[int, str]]:
    """Who a last-writer-wins write of record ``rec`` by ``actor`` drops changes of
    (docs/SEMANTICS.md "Conflicts"; attack 15 F6): [(number, actor)] of the version it
    replaces (``rec.version``, ``rec.updated_by``: always first, as before), then, for every
    other writer of a version made after the one the write was made on, that writer's
    newest such version (newest first). The write's content was made on ``base`` (the
    sha256 its ``If-Match`` named, [RecordUpdate] ``overwrite_base``) and replaces the
    record whole, so every content change after that version is dropped, whoever made it:
    e.g. mount B's edit held by a version mount A merged or appended on top of it, which A
    overwrites (the version replaced is A's; the edit lost is B's). ``base`` not among the
    record's ``OVERWRITE_SCAN`` newest versions (a content that was never a version: a
    sidecar's local content before a merge, a read of parts of two versions): the versions
    after ``actor``'s own newest one before the version replaced stand in for it. ``base``
    None: only the version replaced (its writer). Versions that did not change the content
    (a move, attributes) drop nothing and name no one; nor does ``actor`` itself (told by
    its own conflict line)."""
    first = (rec.version, rec.updated_by)
    if not base:
        return [first]
    rows = conn.execute(
        select(_V.c.version, _V.c.sha256, _V.c.actor)
        .where(_V.c.record_id == rec.id, _V.c.version <= rec.version)
        .order_by(_V.c.version.desc()).limit(OVERWRITE_SCAN)).all()
    at = next((i for i, r in enumerate(rows) if r.sha256 == base), None)
    if at is None:  # since the writer's own newest version before the one replaced
        at = next((i for i, r in enumerate(rows) if i and r.actor == actor), len(rows))
    out, seen = [first], {first[1], actor}
    for i, r in enumerate(rows[:at]):
        changed = i + 1 >= len(rows) or rows[i + 1].sha256 != r.sha256
        if changed and r.actor not in seen and "\n" not in r.actor:
            seen.add(r.actor)
            out.append((r.version, r.actor))
    return out


def encode_overwrote(authors: list[tuple[int, str]]) -> str:
    """The ``versions.overwrote_by`` text of ``overwritten_authors``' list: the first actor
    (the writer of the version replaced, the column's meaning since migration 0019), then one
    line ``<version> <actor>`` per other writer whose changes were dropped
    (``decode_overwrote`` reads it)."""
    return "\n".join([authors[0][1], *(f"{n} {a}" for n, a in authors[1:])])


def decode_overwrote(version: int, text: str | None) -> list[tuple[int, str]]:
    """``encode_overwrote`` read back, with the replaced ``version`` (``versions.overwrote``):
    [(number, actor)], the version replaced first. A line that does not parse is skipped."""
    first, *rest = (text or "").split("\n")
    out = [(version, first)]
    for line in rest:
        n, _, a = line.partition(" ")
        if n.isdigit() and a:
            out.append((int(n), a))
    return out


def check_append_if_match(if_match: str | None) -> None:
    """An append's first check (``append_record``): ``ServiceError`` 428
    ``precondition_required`` when ``if_match`` names no version (absent, empty or ``*``),
    before anything else is read or scanned. The record-write fast path asks it before its
    prescan (``memfuse.server.writepath``): a request refused so costs no scan."""
    tags = parse_if_match(if_match)
    if tags is None or tags == ["*"]:
        raise ServiceError(428, "precondition_required",
                           "an append needs If-Match: the sha256 of the version it extends")


class RecordsService(Resource):
    """``Service`` methods: record writes (``create_record``, ``update_record``,
    ``append_record``, ``set_attributes``, ``move_record``, ``move_prefix``, ``delete_record``,
    ``restore_record``, ``redact_version``; reads are ``recordreads.RecordReadsService``'s), and
    the operations batch plans with (``_create_op``, ``_update_op``, ...). In an archived
    store every write but ``delete_record`` and ``redact_version`` refuses 403
    ``store_archived`` (``_check_writable``)."""

    @staticmethod
    def _record(conn: Connection, st: AnyRow, record_id: str) -> _Rec:
        row = _RAW_SELECT_RECORD.first(conn, {"rid": record_id})
        if row is None or row.store != st.slug:
            raise ServiceError(404, "record_not_found", f"no record {record_id!r} in store {keys.public(st.slug)!r}")
        return _Rec.of(row)

    @staticmethod
    def _live(rec: _Rec) -> _Rec:
        if rec.deleted:
            raise ServiceError(404, "record_not_found", f"record {rec.id!r} is deleted")
        return rec

    @staticmethod
    def _live_at(conn: Connection, store: str, path: str) -> _Rec | None:
        row = conn.execute(_SELECT_LIVE_AT, {"store": store, "path": path}).first()
        return _Rec.of(row) if row is not None else None

    @staticmethod
    def _live_at_id(conn: Connection, store: str, path: str) -> str | None:
        """The id of the live record at ``path``, if any."""
        return conn.scalar(_SELECT_LIVE_ID_AT, {"store": store, "path": path})

    def _check_clash(self, conn: Connection, st: Any, path: str, skip: frozenset[str] = frozenset(),
                     *, under: bool = True, parents: bool = True) -> None:
        """Refuse a record at ``path`` that would make a file and a directory of one name
        (a file ``fd`` beside a file ``fd/child.md``: a filesystem cannot show both, so the
        mount would hide one and export would fail). 409 ``parent_is_file`` when a live
        record sits at one of ``path``'s ancestors; 409 ``path_is_directory`` when live
        records sit under ``path/`` (not checked when ``under`` is False: a prefix move
        checks one moved path for its ancestors, and each target for ``path_exists``).
        Records whose id is in ``skip`` (the ones being moved) do not count. Within a batch
        still deferring its creates, the creates not yet written count too
        (``BatchStore.paths`` / ``dirs``). Two indexed reads of at most one row each
        (``parents`` False: the caller checked the ancestors already, one read)."""
        parts = path.split("/")
        ancestors = ["/".join(parts[:i]) for i in range(1, len(parts))]
        deferred = isinstance(st, BatchStore) and st.deferring
        not_skipped = [_R.c.id.notin_(skip)] if skip else []
        if ancestors and parents:
            hit = None
            if deferred:
                hit = next((a for a in ancestors if st.paths.get(a) not in (None, *skip)), None)
            if hit is None:
                # the statement built once, not at every call (~0.2 ms a batch's create:
                # bench/README.md, "Sidecar memory, session 24"): the live records at the
                # ancestors in path order, at most one a path; the first not skipped is the hit
                rows = _RAW_SELECT_LIVE_AT_PATHS.all(conn, {"store": st.slug, "paths": ancestors})
                hit = next((r.path for r in rows if r.id not in skip), None)
            if hit is not None:
                raise ServiceError(409, "parent_is_file",
                                   f"{hit!r} is a file, so {path!r} cannot be under it")
        if not under:
            return
        below = None
        if deferred and path in st.dirs:
            below = next((q for q, rid in st.paths.items() if q.startswith(path + "/") and rid not in skip), None)
        if below is None:
            if skip:
                col = self._path_col()
                below = conn.scalar(select(_R.c.path).where(
                    _R.c.store == st.slug, _R.c.deleted == false(), col >= path + "/", col < path + "0",
                    *not_skipped).limit(1))
            else:  # a create: the statement built once (bench/README.md, "The close path")
                pg = self.db.engine.dialect.name == "postgresql"
                below = _RAW_SELECT_LIVE_UNDER[pg].scalar(conn, {"store": st.slug, "lo": path + "/", "hi": path + "0"})
        if below is not None:
            raise ServiceError(409, "path_is_directory",
                               f"{path!r} is a directory ({below!r} is under it), so it cannot be a file")

    @staticmethod
    def _add_version(
        conn: Connection,
        rec: _Rec,
        op: Operation,
        actor: str,
        now: datetime,
        *,
        old_path: str | None = None,
        new: bool = False,
        append: tails.Append | None = None,
        overwrote: list[tuple[int, str]] | None = None,
        writer: str | None = None,
    ) -> int:
        """Append version ``rec.version`` (already bumped by the caller) from the record's
        current state and write the record row (inserted when ``new``); sets ``rec.seq``,
        ``updated_at``, ``updated_by``. Returns the version's seq. Counts the write in
        ``conn.info["memfuse_writes"]`` (a batch tells from it whether a refusal came after
        a write).

        ``append``: the write is that append (``tails``): with a tail, ``rec.content`` holds
        only the base's frontmatter block and the record's content is written as
        ``tails.write`` says. Any other write of a record with a tail drops the tail (the
        row's content is the whole live content, read through ``tails.LIVE_CONTENT``).

        ``overwrote``: (number, actor) of the version this one replaced by last writer wins
        (an update with ``overwrite``), then those of the other writers whose changes it
        drops (``overwritten_authors``), kept on the version for the change feed
        (``encode_overwrote``). ``writer``: the sidecar instance that wrote it
        (``Principal.writer``), kept on the version for the change feed."""
        info = info_of(conn)
        info["memfuse_writes"] = info.get("memfuse_writes", 0) + 1
        rec.updated_at = now
        rec.updated_by = actor
        rec.review_after, rec.expires_at = staleness.record_dates(rec.content)
        if new:  # before the version that references it, with the version's seq (``next_seq_sql``)
            values = rec.values()
            if rec.seq > 0:  # read ahead (SQLite: ``recordrows._live_at_or_under``)
                _RAW_INSERT_RECORD.run(conn, values)
            else:
                del values["seq"]
                rec.seq = _RAW_INSERT_NEW_RECORD[conn.dialect.name == "postgresql"].scalar(conn, values)
            stored, base_version, chain = rec.content, None, 0
        elif append is not None:
            whole = RecordsService._appended_content(conn, rec, append)
            stored, base_version, chain = deltas.plan_append(conn, rec.id, rec.version, append.suffix, whole)
        else:
            stored, base_version, chain = deltas.plan(
                conn, rec.id, rec.version, getattr(rec, "base_content", None), rec.content)
            if getattr(rec, "tailed", False):  # the row gets the whole content
                tails.drop(conn, rec.id)
                rec.tailed = False
        rec.base_content = rec.content if append is None or append.tail is None else None
        row: dict[str, Any] = {
            "record_id": rec.id,
            "store": rec.store,
            "version": rec.version,
            "operation": op.value,
            "path": rec.path,
            "old_path": old_path,
            "type": rec.type,
            "sha256": rec.sha256,
            "size": rec.size,
            "content": stored,
            "created_at": now,
            "actor": actor,
            "redacted": False,
            "mode": rec.mode,
            "mtime_ns": rec.mtime_ns,
            "base_version": base_version,
            "chain": chain,
        }
        if overwrote is not None:  # else left out: the statement every other write runs
            row["overwrote"], row["overwrote_by"] = overwrote[0][0], encode_overwrote(overwrote)
        if writer is not None:
            row["writer"] = writer
        seq: int
        if new:  # the record has its version's seq already
            seq = row["seq"] = rec.seq
            _RAW_INSERT_VERSION_AT.run(conn, row)
        else:
            if conn.dialect.name == "sqlite":  # seq is the rowid: no RETURNING (rawsql)
                seq = rec.seq = _RAW_INSERT_VERSION_AT.inserted_rowid(conn, row)
            else:
                seq = rec.seq = _RAW_INSERT_VERSION.scalar(conn, row)
        if rec.content is not None:
            history.note_kept(conn, rec.store, rec.size, 1)
        wakeups.note_feed(rec.store, seq, writer or actor)
        if not new:
            values = rec.values()
            for k in ("id", "store", "created_at"):
                del values[k]
            if append is not None:
                content, rec.tailed = tails.write(conn, rec.id, append, RecordsService._appended_content(conn, rec, append))
                if content is None:  # nor what an append never changes: no index trigger runs
                    for k in ("content", "path", "deleted"):
                        del values[k]
                else:
                    values["content"] = content
            values["rid"] = rec.id
            _RAW_UPDATE_RECORD.run(conn, values)
        return seq

    @staticmethod
    def _appended_content(conn: Connection, rec: _Rec, append: tails.Append) -> Callable[[], str]:
        """The record's whole content after ``append``, as a function (called only when a
        write needs it whole: a whole version, or a record without a tail, where
        ``rec.content`` is it). With a tail it reads the base and the tail before the tail
        is written (one read of the whole content)."""
        if append.tail is None:
            return lambda: rec.content or ""
        memo: list[str] = []

        def whole() -> str:
            if not memo:
                memo.append((tails.live_content(conn, rec.id) or "") + append.suffix)
            return memo[0]
        return whole

    @staticmethod
    def _room(st: AnyRow, d_bytes: int, d_count: int, *, grew_bytes: bool, grew_count: bool) -> tuple[int, int]:
        """The store's (record_count, usage_bytes) after adding ``d_count`` / ``d_bytes``; 507
        ``store_full`` when the write grew usage (``grew_*``) past a limit. Reads only ``st``:
        writes call it before their first statement, so a refusal leaves nothing to undo."""
        n, b = st.record_count + d_count, st.usage_bytes + d_bytes
        if grew_count and n > st.max_records:
            raise ServiceError(507, "store_full", f"store {keys.public(st.slug)!r} holds its limit of {st.max_records} records")
        if grew_bytes and b > st.max_store_bytes:
            raise ServiceError(
                507, "store_full", f"store {keys.public(st.slug)!r} would hold {b} bytes, limit {st.max_store_bytes}"
            )
        return n, b

    @staticmethod
    def _use(
        conn: Connection, st: AnyRow, d_bytes: int, d_count: int, *, grew_bytes: bool, grew_count: bool
    ) -> None:
        """Add ``d_bytes`` / ``d_count`` to the store's usage counters (``st`` was read in
        this transaction, under the write lock). 507 ``store_full`` when the write grew usage
        (``grew_*``) and the store is now over a limit; the caller's transaction then rolls
        back, counters included."""
        n, b = RecordsService._room(st, d_bytes, d_count, grew_bytes=grew_bytes, grew_count=grew_count)
        if grew_bytes and d_bytes > 0:
            _account_room(conn, st, b)
        if isinstance(st, BatchStore):  # a batch writes the counters once, at its end
            st.record_count, st.usage_bytes = n, b
        elif (d_bytes or d_count) and not history.settle_with_usage(conn, st, d_bytes, d_count):
            _RAW_UPDATE_USAGE.run(conn, {"slug_": st.slug, "d_bytes": d_bytes, "d_count": d_count})

    @staticmethod
    def _version(conn: Connection, record_id: str, n: int) -> Any:
        """Version ``n``'s row, an append version's content made whole (``deltas.resolve``);
        404 ``version_not_found``."""
        if not version_in_range(n):  # no such version, and not one the database could compare
            raise ServiceError(404, "version_not_found", f"record {record_id!r} has no version {n}")
        v = conn.execute(select(_V).where(_V.c.record_id == record_id, _V.c.version == n)).first()
        if v is None:
            raise ServiceError(404, "version_not_found", f"record {record_id!r} has no version {n}")
        return deltas.resolve(conn, [v])[0]
    # ------------------------------------------------------------ records: writes

    def create_record(
        self, p: Principal, slug: str, body: RecordCreate, idem: IdempotencyRequest | None = None
    ) -> Reply:
        """201 [Record] without content, with ``ETag``. Refusals, in this order: 422
        ``invalid_path`` / ``path_too_long`` / ``invalid_content``, 413 ``record_too_large``,
        422 ``invalid_type``, 422 ``secret_detected``, 409 ``path_exists`` (with
        ``record_id``), 507 ``store_full``. Type: the request's ``type``, else the
        frontmatter, else the store's ``default_type`` (None for the root ``MEMORY.md``)."""
        op = self._create_op(p, body)
        return self._write(p, idem, 201, lambda conn: op(conn, self._store(conn, p, slug, write=True)),
                           etag=True, feed=slug, store_first=True)

    def _create_op(self, p: Principal, body: RecordCreate) -> Callable[[Connection, Any], wire.Record]:
        """``create_record``'s checks that need no database (path, content, secrets: raised
        here), and the write itself as ``fn(conn, st)`` under the store's lock (``st``: the
        store row read for writing)."""
        path = _check_new_path(body.path)
        raw = _check_content(body.content)
        # outside the write lock (and the writer thread: prescan), charged to the token
        secret = prescan.find_secret(body.content, prescan.scan_key(p), self.scans, alone=True)
        sha = _HASHES.digest(raw)

        def fn(conn: Connection, st: Any) -> wire.Record:
            _check_writable(st)
            _check_record_size(st, len(raw))
            rtype = _resolve_type(path, body.content, body.type, st.default_type)
            if secret is not None:
                raise _secret_error(secret)
            deferred = isinstance(st, BatchStore) and st.deferring
            seq = 0  # the seq read with the paths (SQLite), else given at the insert
            parts = path.split("/")
            ancestors = ["/".join(parts[:i]) for i in range(1, len(parts))]
            if deferred:
                other = st.paths.get(path)
                if other is not None:
                    raise ServiceError(409, "path_exists", f"{path!r} exists", record_id=other)
                self._check_clash(conn, st, path)
            else:
                # one read: the live records at the path and at its ancestors (path -> id),
                # and one live record under ``path/`` (its id read as None), if any
                pg = self.db.engine.dialect.name == "postgresql"
                hits: dict[str | None, Any] = {r.path: r.id for r in _RAW_SELECT_LIVE_AT_OR_UNDER[pg].all(
                    conn, {"store": st.slug, "paths": [path, *ancestors], "lo": path + "/", "hi": path + "0"})}
                if not pg:  # SQLite: the row (NULL, the seq this create takes)
                    seq = hits.pop(None)
                other = hits.get(path)
                if other is not None:
                    raise ServiceError(409, "path_exists", f"{path!r} exists", record_id=other)
                # then _check_clash's refusals, in its order
                hit = next((a for a in ancestors if hits.get(a) is not None), None)
                if hit is not None:
                    raise ServiceError(409, "parent_is_file",
                                       f"{hit!r} is a file, so {path!r} cannot be under it")
                below = next((q for q, rid in hits.items() if rid is None), None)
                if below is not None:
                    raise ServiceError(409, "path_is_directory",
                                       f"{path!r} is a directory ({below!r} is under it), so it cannot be a file")
            now = utcnow()
            rec = _Rec(
                id=new_record_id(), store=st.slug, path=path, type=rtype, version=1,
                sha256=sha, size=len(raw), content=body.content, deleted=False,
                created_at=now, updated_at=now, updated_by=p.actor, seq=seq,
                mode=body.mode, mtime_ns=body.mtime_ns,
            )
            self._room(st, len(raw), 1, grew_bytes=True, grew_count=True)  # refused before any write
            if deferred:
                st.defer_create(rec, p.actor, now, p.writer)  # written with the batch's other creates
                history.note_kept(conn, st.slug, rec.size, 1)
                conn.info["memfuse_writes"] = conn.info.get("memfuse_writes", 0) + 1  # as if written
            else:
                self._add_version(conn, rec, Operation.created, p.actor, now, new=True, writer=p.writer)
            self._use(conn, st, len(raw), 1, grew_bytes=True, grew_count=True)
            return record_answer(rec)

        return fn

    def update_record(
        self,
        p: Principal,
        slug: str,
        record_id: str,
        body: RecordUpdate,
        if_match: str | None = None,
        idem: IdempotencyRequest | None = None,
    ) -> Reply:
        """200 [Record] without content, with ``ETag``. Identical content and type → the
        current record, no new version. 404 for a deleted record, 412 ``precondition_failed``
        (with ``sha256``) when ``if_match`` does not match, plus the create refusals.

        Type: the request's ``type``, else the new content's frontmatter, else the record's
        current type (so a type set explicitly, e.g. through the ``user.memfuse.type`` xattr,
        survives later edits of a file without frontmatter)."""
        op = self._update_op(p, record_id, body, if_match)
        return self._write(p, idem, 200, lambda conn: op(conn, self._store(conn, p, slug, write=True)),
                           etag=True, feed=slug, store_first=True)

    def _update_op(
        self, p: Principal, record_id: str, body: RecordUpdate, if_match: str | None
    ) -> Callable[[Connection, Any], Record]:
        """``update_record`` as ``_create_op`` splits ``create_record``."""
        raw = _check_content(body.content)
        # outside the write lock (and the writer thread: prescan), charged to the token
        secret = prescan.find_secret(body.content, prescan.scan_key(p), self.scans, alone=True)
        sha = _HASHES.digest(raw)

        def fn(conn: Connection, st: Any) -> Record:
            _check_writable(st)
            rec = self._live(self._record(conn, st, record_id))
            _check_if_match(if_match, rec.sha256)
            return self._put_content(conn, st, p, rec, body, body.content, len(raw), sha, secret)

        return fn

    def _put_content(self, conn: Connection, st: Any, p: Principal, rec: _Rec, body: Any, content: str,
                     size: int, sha: str, secret: str | None, append: tails.Append | None = None) -> Record:
        """The rest of an update of live record ``rec`` (If-Match checked) to ``content``
        (``size`` bytes of UTF-8, sha256 ``sha``, ``secret`` what the secret scan found):
        size, type, secret refusals in that order, then the ``modified`` version (none when
        nothing changes). ``body``: the request's ``type``, ``mode`` and ``mtime_ns``.
        ``append``: the update is that append (``_add_version``); with a tail, ``content``
        is the base's frontmatter block (``tails``: all the type and the staleness dates
        read)."""
        _check_record_size(st, size)
        current = rec.type if rec.type is not None else st.default_type
        rtype = _resolve_type(rec.path, content, body.type, current)
        if secret is not None:
            raise _secret_error(secret)
        mode = body.mode if body.mode is not None else rec.mode
        if body.mtime_ns is not None:
            mtime = body.mtime_ns
        else:  # a write sets the mtime; the same content keeps an explicit one
            mtime = rec.mtime_ns if sha == rec.sha256 else None
        if sha == rec.sha256 and rtype == rec.type and (_mode(mode), mtime) == _attrs(rec):
            return _record_model(rec, with_content=False)
        # a write by last writer wins: the version it replaces, for the writers it drops
        overwrote = (overwritten_authors(conn, rec, getattr(body, "overwrite_base", None), p.actor)
                     if getattr(body, "overwrite", False) else None)
        old_size = rec.size
        rec.content, rec.sha256, rec.size, rec.type = content, sha, size, rtype
        rec.mode, rec.mtime_ns = mode, mtime
        rec.version += 1
        self._room(st, size - old_size, 0, grew_bytes=size > old_size, grew_count=False)
        self._add_version(conn, rec, Operation.modified, p.actor, utcnow(), append=append,
                          overwrote=overwrote, writer=p.writer)
        self._use(conn, st, size - old_size, 0, grew_bytes=size > old_size, grew_count=False)
        return _record_model(rec, with_content=False)

    def append_record(
        self,
        p: Principal,
        slug: str,
        record_id: str,
        body: RecordAppend,
        if_match: str | None = None,
        idem: IdempotencyRequest | None = None,
    ) -> Reply:
        """200 [Record] without content, with ``ETag``: ``update_record`` of the record's
        current content plus ``body.append``, sent as only the suffix. ``if_match`` (the
        sha256 of the version the suffix was written on) is required: 428
        ``precondition_required`` without one (or with ``*``); 412 ``precondition_failed``
        (with ``sha256``) when the record changed since. Every other answer is
        ``update_record``'s for the whole content (an empty suffix with the same type and
        attributes makes no version). The secret scan reads the suffix and the
        ``APPEND_SCAN_CONTEXT`` characters before it (from a line start), not the whole
        content the record held already."""
        op = self._append_op(p, record_id, body, if_match)
        return self._write(p, idem, 200, lambda conn: op(conn, self._store(conn, p, slug, write=True)),
                           etag=True, feed=slug, store_first=True)

    def append_context(self, record_id: str) -> str | None:
        """The text an append to ``record_id`` is scanned after (``tails.scan_context`` of
        the record's tail, else of its whole content), read now on a read connection (the
        write checks it is still the one before it takes the verdict: ``prescan``); None
        when there is no such record. No access check: the text is only scanned, never
        answered."""
        with self.db.read_conn() as conn:
            row = tails.read_for_append(conn, record_id)
        if row is None:
            return None
        return tails.scan_context(row.tail if row.tail is not None else (row.content or ""))

    def _append_op(
        self, p: Principal, record_id: str, body: RecordAppend, if_match: str | None
    ) -> Callable[[Connection, Any], Record]:
        """``append_record`` as ``_create_op`` splits ``create_record``."""
        check_append_if_match(if_match)
        raw = _check_content(body.append)
        key = prescan.scan_key(p)
        # a large suffix is scanned now, outside the write lock (unless prescanned), after
        # the context read now: ``fn`` takes the verdict when it reads the same context
        pre = prescan.append_verdict(body.append, lambda: self.append_context(record_id), key, self.scans)

        def fn(conn: Connection, st: Any) -> Record:
            _check_writable(st)
            row = tails.read_for_append(conn, record_id)  # with a tail: not the whole base
            if row is None or row.store != st.slug:
                raise ServiceError(404, "record_not_found", f"no record {record_id!r} in store {keys.public(st.slug)!r}")
            values = dict(row._mapping)
            append = tails.Append(body.append, values.pop("tail"))
            rec = self._live(_Rec(**values, tailed=append.tail is not None))
            rec.base_content = rec.content
            _check_if_match(if_match, rec.sha256)
            if append.tail is not None:  # rec.content: the head; the context is in the tail
                context = tails.scan_context(append.tail)
                content = rec.content or ""
                sha = rec.sha256
                if raw:
                    sha = _HASHES.extend(rec.sha256, raw) or _HASHES.digest(
                        ((tails.live_content(conn, rec.id) or "") + body.append).encode("utf-8"))
            else:
                old = rec.content or ""
                context = tails.scan_context(old)
                content = old + body.append
                sha = rec.sha256
                if raw:  # one pass over the suffix when the base's hash state is kept (hashstate)
                    sha = _HASHES.extend(rec.sha256, raw) or _HASHES.digest(content.encode("utf-8"))
            # the context's hints are known when this process scanned the append that made
            # rec's content (secretscan): then only the suffix is looked through
            # a large suffix was scanned before (prescan: its verdict kept when ``context`` is
            # the one it read), else here, charged to the token
            secret = prescan.find_append_secret(
                context, body.append, pre, lambda: _SCANS.find_secret(context, body.append, rec.sha256, sha),
                key, self.scans) if raw else None
            return self._put_content(conn, st, p, rec, body, content, rec.size + len(raw), sha, secret,
                                     append=append)

        return fn

    def set_attributes(
        self,
        p: Principal,
        slug: str,
        record_id: str,
        body: RecordAttributes,
        if_match: str | None = None,
        idem: IdempotencyRequest | None = None,
    ) -> Reply:
        """200 [Record] without content, with ``ETag``: change only the record's attributes
        (``chmod`` / ``utimensat`` of a file whose content is already stored). Members of
        ``body`` left out are kept (a mode change alone pins the mtime the file showed, as
        chmod(2) leaves st_mtime alone); ``null`` resets them (mode 0o644, mtime ``updated_at``).
        A change makes a ``modified`` version with the same sha256, content, type and path;
        no change (e.g. a chmod to the current mode) makes none. 404 ``record_not_found`` for
        a missing or deleted record, 412 ``precondition_failed`` (with ``sha256``) when
        ``if_match`` does not match the current content."""
        op = self._attrs_op(p, record_id, body, if_match)
        return self._write(p, idem, 200, lambda conn: op(conn, self._store(conn, p, slug, write=True)),
                           etag=True, feed=slug, store_first=True)

    def _attrs_op(
        self, p: Principal, record_id: str, body: RecordAttributes, if_match: str | None
    ) -> Callable[[Connection, Any], Record]:
        """``set_attributes`` as ``_create_op`` splits ``create_record``."""
        given = body.model_fields_set

        def fn(conn: Connection, st: Any) -> Record:
            _check_writable(st)
            rec = self._live(self._record(conn, st, record_id))
            _check_if_match(if_match, rec.sha256)
            mode = body.mode if "mode" in given else rec.mode
            mtime = body.mtime_ns if "mtime_ns" in given else rec.mtime_ns
            if (_mode(mode), mtime) == _attrs(rec):
                return _record_model(rec, with_content=False)
            if "mtime_ns" not in given and rec.mtime_ns is None:
                # a chmod changes the ctime, not the mtime (POSIX chmod(2)): the file keeps
                # the mtime it shows (``updated_at`` until now), not this version's time
                mtime = mtime_effective_ns(None, rec.updated_at)
            rec.mode, rec.mtime_ns = mode, mtime
            rec.version += 1
            self._add_version(conn, rec, Operation.modified, p.actor, utcnow(), writer=p.writer)
            return _record_model(rec, with_content=False)

        return fn

    def move_record(
        self,
        p: Principal,
        slug: str,
        record_id: str,
        body: RecordMove,
        if_match: str | None = None,
        idem: IdempotencyRequest | None = None,
    ) -> Reply:
        """200 [MoveResult] with the one resulting record. Same path → no-op. Target taken:
        409 ``path_exists`` unless ``replace``, in which case the target keeps its id and gets
        a ``modified`` version with this record's content and type (none when identical) and
        this record gets a ``deleted`` version. Moving onto / off the root ``MEMORY.md``
        drops / re-derives the type."""
        op = self._move_op(p, record_id, body, if_match)
        return self._write(p, idem, 200, lambda conn: op(conn, self._store(conn, p, slug, write=True)),
                           feed=slug, store_first=True)

    def _move_op(
        self, p: Principal, record_id: str, body: RecordMove, if_match: str | None
    ) -> Callable[[Connection, Any], MoveResult]:
        """``move_record`` as ``_create_op`` splits ``create_record``."""
        new_path = _check_new_path(body.path)

        def fn(conn: Connection, st: Any) -> MoveResult:
            _check_writable(st)
            rec = self._live(self._record(conn, st, record_id))
            _check_if_match(if_match, rec.sha256)
            if new_path == rec.path:
                return MoveResult(records=[_record_model(rec, with_content=False)])
            new_type = self._type_after_move(rec, new_path, st)
            now = utcnow()
            target = self._live_at(conn, st.slug, new_path)
            if target is not None:
                if not body.replace:
                    raise ServiceError(409, "path_exists", f"{new_path!r} exists", record_id=target.id)
                rec.deleted = True
                rec.version += 1
                self._add_version(conn, rec, Operation.deleted, p.actor, now, writer=p.writer)
                d_bytes = -rec.size
                if (target.sha256, target.type, *_attrs(target)) != (rec.sha256, new_type, *_attrs(rec)):
                    d_bytes += rec.size - target.size
                    target.content, target.sha256, target.size, target.type = (
                        rec.content, rec.sha256, rec.size, new_type,
                    )
                    # the renamed file replaces the target's inode: its mode and mtime too
                    target.mode, target.mtime_ns = rec.mode, rec.mtime_ns
                    target.version += 1
                    self._add_version(conn, target, Operation.modified, p.actor, now, writer=p.writer)
                self._use(conn, st, d_bytes, -1, grew_bytes=False, grew_count=False)  # shrinks
                return MoveResult(records=[_record_model(target, with_content=False)])
            self._check_clash(conn, st, new_path, frozenset((rec.id,)))
            old_path = rec.path
            rec.path, rec.type = new_path, new_type
            _pin_mtime(rec)  # rename(2) keeps the file's mtime: the moved version stores it
            rec.version += 1
            self._add_version(conn, rec, Operation.moved, p.actor, now, old_path=old_path, writer=p.writer)
            return MoveResult(records=[_record_model(rec, with_content=False)])

        return fn

    @staticmethod
    def _type_after_move(rec: _Rec, new_path: str, st: AnyRow) -> str | None:
        if content_rules.is_index(new_path):
            return None
        if content_rules.is_index(rec.path) or rec.type is None:
            return _resolve_type(new_path, rec.content or "", None, st.default_type)
        return rec.type

    def move_prefix(self, p: Principal, slug: str, body: PrefixMove, idem: IdempotencyRequest | None = None) -> Reply:
        """200 [MoveResult] with every moved record (ordered by new path), in one transaction:
        each live record under ``from_prefix/`` moves to ``to_prefix/`` with a ``moved``
        version. 409 ``path_exists`` when a target is taken by a record that does not move
        (nothing changes); 422 ``invalid_path`` / ``path_too_long`` for bad prefixes or
        targets, or when ``to_prefix`` is inside ``from_prefix``."""
        src = _check_path(body.from_prefix.rstrip("/"), "from_prefix")
        dst = _check_new_path(body.to_prefix.rstrip("/"), "to_prefix", directory=True)
        if dst == src or dst.startswith(src + "/"):
            raise ServiceError(422, "invalid_path", "to_prefix is inside from_prefix")

        def fn(conn: Connection) -> MoveResult:
            st = self._store(conn, p, slug, write=True)
            _check_writable(st)
            col = self._path_col()  # byte order: exactly the paths under src/ (no case folding)
            under = (_R.c.store == st.slug, _R.c.deleted == false(), col >= src + "/", col < src + "0")
            moving = [_Rec.of(r) for r in conn.execute(select(*_RECORD_LIVE).where(*under))]
            if len(moving) > MAX_PREFIX_MOVE:
                raise ServiceError(413, "move_too_large",
                                   f"{len(moving)} records under {src!r}; one move moves at most {MAX_PREFIX_MOVE} "
                                   "(move its subdirectories one by one)")
            plan = [(r, r.path, _check_path(dst + r.path[len(src):], "target path")) for r in moving]
            if not plan:
                log.info("moved %d records in store %s", 0, st.slug)
                return MoveResult(records=[])
            plan.sort(key=lambda x: x[2])
            moving_ids = {r.id for r in moving}
            targets = {new_path for _, _, new_path in plan}
            taken = sorted((path, rid) for rid, path in conn.execute(select(_R.c.id, _R.c.path).where(
                _R.c.store == st.slug, _R.c.deleted == false(), col >= dst + "/", col < dst + "0"))
                if path in targets and rid not in moving_ids)
            if taken:
                raise ServiceError(409, "path_exists", f"{taken[0][0]!r} exists", record_id=taken[0][1])
            # a file at the target prefix or above it
            self._check_clash(conn, st, plan[0][2], frozenset(moving_ids), under=False)
            # INVARIANT: the live-path unique index never sees a transient duplicate: a record
            # whose old path is another's target is parked first (a parking path has a
            # leading slash, so no valid record path equals it, and no NUL: PostgreSQL text
            # cannot hold one); every other old path is no target, so the one update below
            # may set the paths in any order.
            parked = [{"rid": r.id, "path": f"/moving/{r.id}"} for r, old, _ in plan if old in targets]
            if parked:
                conn.execute(_UPDATE_RECORD, parked)
            # how each moved version is stored (``deltas.plan`` with the content unchanged: an
            # empty suffix of the current version when that one is kept and its chain short)
            prev = {row.record_id: row for row in conn.execute(
                select(_V.c.record_id, _V.c.chain, _V.c.content.is_not(None).label("kept"))
                .select_from(_V.join(_R, (_V.c.record_id == _R.c.id) & (_V.c.version == _R.c.version)))
                .where(*under))}
            now = utcnow()
            versions: list[dict[str, object]] = []
            kept_bytes = kept_n = 0
            for r, old_path, new_path in plan:
                r.path = new_path
                _pin_mtime(r)  # a directory rename keeps each file's mtime
                r.version += 1
                r.updated_at, r.updated_by = now, p.actor
                pv = prev.get(r.id)
                stored: str | None
                base_version: int | None
                if r.content is not None and pv is not None and pv.kept and pv.chain < deltas.CHAIN_MAX:
                    stored, base_version, chain = "", r.version - 1, pv.chain + 1
                else:
                    stored, base_version, chain = r.content, None, 0
                if r.content is not None:
                    kept_bytes, kept_n = kept_bytes + r.size, kept_n + 1
                versions.append({
                    "record_id": r.id, "store": r.store, "version": r.version,
                    "operation": Operation.moved.value, "path": new_path, "old_path": old_path,
                    "type": r.type, "sha256": r.sha256, "size": r.size, "content": stored,
                    "created_at": now, "actor": p.actor, "redacted": False, "mode": r.mode,
                    "mtime_ns": r.mtime_ns, "base_version": base_version, "chain": chain,
                    "writer": p.writer,
                })
            seqs = reserve_seqs(conn, len(versions))  # ascending: in the order of the new paths
            for v, seq in zip(versions, seqs):
                v["seq"] = seq
            conn.execute(_INSERT_VERSION, versions)
            rows: list[dict[str, object]] = []
            tailed: list[dict[str, object]] = []
            for (r, _, _), seq in zip(plan, seqs):
                r.seq = seq
                row = {"rid": r.id, "path": r.path, "version": r.version, "seq": seq,
                       "updated_at": now, "updated_by": p.actor, "mtime_ns": r.mtime_ns}
                if r.tailed:  # a write other than an append stores the whole content (``tails``)
                    row["content"] = r.content
                    r.tailed = False
                    tailed.append(row)
                else:
                    rows.append(row)
            if tailed:
                tails.drop_many(conn, [str(row["rid"]) for row in tailed])
                conn.execute(_UPDATE_RECORD, tailed)
            if rows:
                conn.execute(_UPDATE_RECORD, rows)
            conn.info["memfuse_writes"] = conn.info.get("memfuse_writes", 0) + len(plan)
            if kept_n:
                history.note_kept(conn, st.slug, kept_bytes, kept_n)
            for seq in seqs:  # every seq: the notifier tells this process's versions apart
                wakeups.note_feed(st.slug, seq, p.feed_key)
            log.info("moved %d records in store %s", len(plan), st.slug)
            return MoveResult(records=[_record_model(r, with_content=False) for r, _, _ in plan])

        return self._write(p, idem, 200, fn, feed=slug)

    def delete_record(
        self,
        p: Principal,
        slug: str,
        record_id: str,
        if_match: str | None = None,
        idem: IdempotencyRequest | None = None,
    ) -> Reply:
        """204; a ``deleted`` version is kept (with the content, so it can be restored).
        404 when missing or already deleted; 412 when ``if_match`` does not match."""
        op = self._delete_op(p, record_id, if_match)
        return self._write(p, idem, 204, lambda conn: op(conn, self._store(conn, p, slug, write=True)),
                           feed=slug, store_first=True)

    def _delete_op(self, p: Principal, record_id: str, if_match: str | None) -> Callable[[Connection, Any], None]:
        """``delete_record`` as ``_create_op`` splits ``create_record``."""

        def fn(conn: Connection, st: Any) -> None:
            rec = self._live(self._record(conn, st, record_id))
            _check_if_match(if_match, rec.sha256)
            rec.deleted = True
            rec.version += 1
            self._add_version(conn, rec, Operation.deleted, p.actor, utcnow(), writer=p.writer)
            self._use(conn, st, -rec.size, -1, grew_bytes=False, grew_count=False)
            return None

        return fn

    def restore_record(
        self, p: Principal, slug: str, record_id: str, body: Restore, idem: IdempotencyRequest | None = None
    ) -> Reply:
        """200 [Record] with ``ETag``: a ``restored`` version with version n's content, type
        and path; undeletes a deleted record. No new version when the live record already is
        that content, type and path. 404 ``version_not_found``; 409 ``redacted``; 409
        ``path_exists`` when another live record holds the path; 413 / 507 against the
        store's current limits; 422 ``secret_detected`` when that version holds a secret
        (written before the rule, or under another detector)."""

        def fn(conn: Connection) -> Record:
            st = self._store(conn, p, slug, write=True)
            _check_writable(st)
            rec = self._record(conn, st, record_id)
            v = self._version(conn, record_id, body.version)
            if getattr(v, "pruned", False):
                raise ServiceError(409, "pruned", f"version {body.version}'s content was pruned by the "
                                   "store's history budget (its metadata is kept); restore a later version")
            if v.redacted or v.content is None:
                raise ServiceError(409, "redacted", f"version {body.version} was redacted")
            if not rec.deleted and (rec.path, rec.sha256, rec.type, *_attrs(rec)) == (
                v.path, v.sha256, v.type, _mode(v.mode), v.mtime_ns
            ):
                return _record_model(rec, with_content=False)
            other = self._live_at_id(conn, st.slug, v.path)
            if other is not None and other != rec.id:
                raise ServiceError(409, "path_exists", f"{v.path!r} exists", record_id=other)
            self._check_clash(conn, st, v.path, frozenset((rec.id,)))
            _check_record_size(st, v.size)
            # under the write lock (the version is read there), charged to the token when large
            secret = prescan.find_secret(v.content, prescan.scan_key(p), self.scans)
            if secret is not None:
                raise _secret_error(secret)
            grew_count = rec.deleted
            grew_bytes = rec.deleted or v.size > rec.size
            d_bytes = v.size if rec.deleted else v.size - rec.size
            old_path = rec.path if rec.path != v.path else None
            rec.path, rec.content, rec.sha256, rec.size, rec.type = v.path, v.content, v.sha256, v.size, v.type
            rec.mode, rec.mtime_ns = v.mode, v.mtime_ns
            rec.deleted = False
            rec.version += 1
            self._add_version(conn, rec, Operation.restored, p.actor, utcnow(), old_path=old_path, writer=p.writer)
            self._use(conn, st, d_bytes, 1 if grew_count else 0, grew_bytes=grew_bytes, grew_count=grew_count)
            return _record_model(rec, with_content=False)

        return self._write(p, idem, 200, fn, etag=True, feed=slug)

    def redact_version(
        self, p: Principal, slug: str, record_id: str, n: int, idem: IdempotencyRequest | None = None
    ) -> Reply:
        """200 [Version]: version n's content removed, audit fields kept (admin). 409
        ``current_version`` for a live record's current version; 404 ``version_not_found``."""
        self._require_admin(p)

        def fn(conn: Connection) -> Version:
            st = self._store(conn, p, slug, write=True)
            rec = self._record(conn, st, record_id)
            v = self._version(conn, record_id, n)
            if not rec.deleted and rec.version == n:
                raise ServiceError(
                    409, "current_version", "the current version of a live record cannot be redacted; write over it first"
                )
            if not v.redacted:
                if v.content is not None:  # no longer kept (the history budget's count)
                    history.note_kept(conn, st.slug, -v.size, -1)
                # a later append version built on this one becomes whole first (deltas)
                deltas.materialize_dependent(conn, record_id, n)
                conn.execute(update(_V).where(_V.c.seq == v.seq).values(
                    redacted=True, content=None, base_version=None, chain=0,
                    redacted_at=utcnow(), redacted_by=p.actor))
                if rec.deleted and rec.version == n:
                    conn.execute(_UPDATE_RECORD, {"rid": rec.id, "content": None})
                v = self._version(conn, record_id, n)
                log.info("redacted version %d of record %s", n, record_id)
            return _version_model(v, with_content=True)

        return self._write(p, idem, 200, fn, feed=slug)
