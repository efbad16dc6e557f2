"""Record reads: snapshot pages of a store's records (``list_records``, and its JSON built
without pydantic per record), the console's record search (``search_records``), a record, its
versions. Writes are in ``memfuse.server.records``; what both share in
``memfuse.server.recordrows``.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from sqlalchemy import false, func, select, text, tuple_

from memfuse import content as content_rules
from memfuse import wire
from memfuse.defs import (DEFAULT_MODE, RECORDS_PAGE_DEFAULT, RECORDS_PAGE_MAX, VERSIONS_PAGE_DEFAULT, content_page,
                          next_page_link, versions_page_rows)
from memfuse.models import Record, RecordPage, Version
from memfuse.server import keys, tails
from memfuse.server.base import AnyRow, Principal, Resource, ServiceError, _R, _V, holds
from memfuse.server.db import VERSION_MAX
from memfuse.server.jsonpieces import json_list_pieces
from memfuse.server.recordrows import (
    _PAGE_COLUMNS,
    _PAGE_COLUMNS_NO_CONTENT,
    _PAGE_COLUMNS_NO_CONTENT_SQLITE,
    _PAGE_COLUMNS_SQLITE,
    _PAGE_ENCODER,
    _decode_cursor,
    _encode_cursor,
    _record_model,
    _same,
    _sqlite_time,
    _version_model,
)
from memfuse.server.records import RecordsService

log = logging.getLogger("memfuse.server.service")  # every room of the Service logs under one name


@dataclass(frozen=True)
class VersionList:
    """One page of a record's versions (``RecordReadsService.list_versions``): ``versions``
    in the page's order, ``encoded`` each one's JSON (what the answer's array holds, measured
    for the page's byte bound), ``next_cursor`` the number of the last version when more
    follow (the ``cursor`` of the next page), else None."""

    versions: list[Version]
    encoded: list[bytes]
    next_cursor: int | None

    def body(self) -> bytes:
        """The JSON array of the page's versions (the answer's body)."""
        return b"[" + b",".join(self.encoded) + b"]"

    def headers(self, query: str) -> dict[str, str]:
        """The answer's headers for a request whose query string was ``query`` (raw): when
        more follow, ``Link`` to the next page (``defs.next_page_link``), else none."""
        return {} if self.next_cursor is None else {"Link": next_page_link(query, self.next_cursor)}


class RecordReadsService(Resource):
    """``Service`` methods: ``list_records``, ``list_records_json`` (and its pieces,
    ``list_records_pieces``), ``search_records``,
    ``get_record``, ``list_versions``, ``get_version``."""

    _record = staticmethod(RecordsService._record)
    _version = staticmethod(RecordsService._version)

    def _snapshot_rows(
        self, p: Principal, slug: str, cursor: str | None, limit: int, with_content: bool,
        path: str | None, include_deleted: bool, raw_times: bool = False,
    ) -> tuple[Sequence[AnyRow], bool, int, bool]:
        """The rows of one snapshot page (``limit`` at most, ordered by (path, id)), whether
        more follow, and the store's change-feed seq read before them. The keyset condition
        is one row-value comparison, ``(path, id) > (cursor)``: SQLite seeks the ``(store,
        path, id)`` index to the cursor with it (written as ``path > p OR (path = p AND id >
        i)`` SQLite scanned the store's index from its start on every page), PostgreSQL the
        live records' ``(store, path COLLATE "C", id)`` index (revision
        ``0005_records_path_bytes``; with ``include_deleted`` it sorts the store's records).
        With ``raw_times`` on SQLite the two times come as stored text (``_sqlite_time``);
        the last member says whether they do. With content a page holds at most
        ``defs.PAGE_CONTENT_BYTES`` of it, counted again in JSON bytes (``content_page``; at
        least one record), and more follow when it was cut."""
        with self.db.read_conn() as conn:
            st = self._store(conn, p, slug)
            seq = conn.scalar(select(func.max(_V.c.seq)).where(_V.c.store == st.slug)) or 0
            path_col = self._path_col()
            if raw_times and self.db.is_sqlite:
                cols = _PAGE_COLUMNS_SQLITE if with_content else _PAGE_COLUMNS_NO_CONTENT_SQLITE
            else:
                cols = _PAGE_COLUMNS if with_content else _PAGE_COLUMNS_NO_CONTENT
                raw_times = False
            q = select(*cols).where(_R.c.store == st.slug)
            if not include_deleted:
                q = q.where(_R.c.deleted == false())
            if path is not None:
                q = q.where(_R.c.path == path)
            if cursor:
                cp, cid = _decode_cursor(cursor)
                q = q.where(tuple_(path_col, _R.c.id) > tuple_(cp, cid))
            if not with_content:
                rows = conn.execute(q.order_by(path_col, _R.c.id).limit(limit + 1)).all()
                return rows[:limit], len(rows) > limit, seq, raw_times
            # with content: the sizes first, so content past the page's byte budget is never read
            keys_q = q.with_only_columns(_R.c.path, _R.c.id, _R.c.size)
            sizes = conn.execute(keys_q.order_by(path_col, _R.c.id).limit(limit + 1)).all()

            def read(n: int) -> Sequence[AnyRow]:  # the first n with content, and one more if any
                q_n = q
                if len(sizes) > n:  # up to the last record kept (a record created meanwhile may push it
                    last = sizes[n - 1]  # out: then the cursor is the last one read, on the next page)
                    q_n = q.where(tuple_(path_col, _R.c.id) <= tuple_(last.path, last.id))
                return conn.execute(q_n.order_by(path_col, _R.c.id).limit(n + 1)).all()

            # one rule with the change feed: a page's answer holds at most 8 MiB of content
            page, cut = content_page([r.size for r in sizes[:limit]], read, lambda r: r.content)
        return page, cut or len(sizes) > limit, seq, raw_times

    def list_records(
        self,
        p: Principal,
        slug: str,
        *,
        cursor: str | None = None,
        limit: int = RECORDS_PAGE_DEFAULT,
        with_content: bool = False,
        path: str | None = None,
        include_deleted: bool = False,
    ) -> RecordPage:
        """One snapshot page ordered by (path, id); ``seq`` is the store's change-feed position
        read before the page. Raises 422 ``validation_error`` for a foreign cursor."""
        rows, more, seq, _ = self._snapshot_rows(p, slug, cursor, limit, with_content, path, include_deleted)
        return RecordPage(
            records=[_record_model(r, with_content=with_content) for r in rows],
            next_cursor=_encode_cursor(rows[-1].path, rows[-1].id) if more else None,
            seq=seq,
        )

    def list_records_json(
        self,
        p: Principal,
        slug: str,
        *,
        cursor: str | None = None,
        limit: int = RECORDS_PAGE_DEFAULT,
        with_content: bool = False,
        path: str | None = None,
        include_deleted: bool = False,
    ) -> bytes:
        """``list_records`` as the JSON body of ``GET /v1/stores/{store}/records``: the same
        bytes as ``RecordPage.model_dump_json()`` of its answer (``tests/test_wire.py`` holds
        them equal), built without a pydantic model per record: each row becomes the
        client's msgspec ``Record`` (same members, same order, same JSON) and the page is
        encoded by msgspec, ~5× less CPU for a page of 1,000 records with content. Raises
        what ``list_records`` raises."""
        pieces, _ = self.list_records_pieces(p, slug, cursor=cursor, limit=limit, with_content=with_content,
                                             path=path, include_deleted=include_deleted)
        return b"".join(pieces)

    def list_records_pieces(
        self,
        p: Principal,
        slug: str,
        *,
        cursor: str | None = None,
        limit: int = RECORDS_PAGE_DEFAULT,
        with_content: bool = False,
        path: str | None = None,
        include_deleted: bool = False,
    ) -> tuple[Iterator[bytes], int]:
        """``list_records_json``'s bytes as pieces encoded lazily (one per record, between
        the page's head and tail: a route sends a page of much content without holding its
        whole JSON, ``routes.deps.pieces_response``), and the page's content bytes. The page
        is read at once (raises what ``list_records`` raises); only its encoding waits."""
        rows, more, seq, raw = self._snapshot_rows(p, slug, cursor, limit, with_content, path, include_deleted,
                                                   raw_times=True)
        W = wire.Record
        t = _sqlite_time if raw else _same
        enc = _PAGE_ENCODER.encode

        def items() -> Iterator[bytes]:
            for r in rows:
                yield enc(W(id=r[0], store=keys.public(r[1]), path=r[2], type=r[3], version=r[4], sha256=r[5],
                            size=r[6], deleted=r[7], created_at=t(r[8]), updated_at=t(r[9]), updated_by=r[10],
                            seq=r[11], mode=DEFAULT_MODE if r[12] is None else r[12], mtime_ns=r[13],
                            content=r[14] if with_content else None))

        nxt = _encode_cursor(rows[-1].path, rows[-1].id) if more else None
        tail = b'],"next_cursor":' + enc(nxt) + b',"seq":' + enc(seq) + b"}"
        content = sum(r[6] or 0 for r in rows) if with_content else 0
        return json_list_pieces(b'{"records":[', items(), tail), content

    def search_records(
        self,
        p: Principal,
        slug: str,
        *,
        type: str | None = None,
        path_contains: str | None = None,
        text: str | None = None,
        cursor: str | None = None,
        limit: int = 100,
    ) -> RecordPage:
        """Live records of the store that match every filter given, without content, ordered
        by (path, id) like ``list_records`` (same cursors; ``seq`` is the store's change-feed
        position read before the page). Filters, all evaluated by the database:

        - ``type``: one of ``user``, ``feedback``, ``project``, ``reference`` (422
          ``invalid_type`` otherwise); the root ``MEMORY.md`` has no type and never matches;
        - ``path_contains``: a substring of the path, case-insensitive;
        - ``text``: a substring of the content, case-insensitive.

        Substrings match literally (``%``, ``_``, ``\\`` are plain characters) and
        case-insensitively by ``base.fold`` (Unicode lowercase: ``ÄPFEL`` finds ``äpfel``), the
        search API's rule, on both databases: the database narrows the rows with the superset
        filter of ``Resource._contains`` and each row read is checked here (``holds``);
        rows are read in batches of ``limit`` + 1 until the page is full, so a page holds
        ``limit`` records unless it is the last. A content filter reads every live record
        of the store it passes (no index). ``limit`` is clamped to 1–1000. Raises 404 like
        ``list_records``, 422 ``validation_error`` for a foreign cursor."""
        if type is not None and type not in content_rules.RECORD_TYPES:
            raise ServiceError(422, "invalid_type", f"type {type!r} is not one of {', '.join(content_rules.RECORD_TYPES)}")
        limit = min(max(int(limit), 1), RECORDS_PAGE_MAX)
        with self.db.read_conn() as conn:
            st = self._store(conn, p, slug)
            after = _decode_cursor(cursor) if cursor else None
            seq = conn.scalar(select(func.max(_V.c.seq)).where(_V.c.store == st.slug)) or 0
            path_col = self._path_col()
            q = select(*tails.live(tuple(c for c in _R.c if c.name != "content" or text))).where(
                _R.c.store == st.slug, _R.c.deleted == false()
            )
            if type is not None:
                q = q.where(_R.c.type == type)
            if path_contains:
                q = q.where(self._contains(_R.c.path, path_contains))
            if text:
                q = q.where(self._contains(tails.LIVE_CONTENT_EXPR, text))
            q = q.order_by(path_col, _R.c.id).limit(limit + 1)
            rows: list[AnyRow] = []
            while len(rows) <= limit:
                batch = conn.execute(q.where(tuple_(path_col, _R.c.id) > tuple_(*after)) if after else q).all()
                rows.extend(r for r in batch if (not path_contains or holds(r.path, path_contains))
                            and (not text or holds(r.content or "", text)))
                if len(batch) <= limit:
                    break
                after = (batch[-1].path, batch[-1].id)  # an index seek, see _snapshot_rows
            more = len(rows) > limit
            rows = rows[:limit]
            return RecordPage(
                records=[_record_model(r, with_content=False) for r in rows],
                next_cursor=_encode_cursor(rows[-1].path, rows[-1].id) if more else None,
                seq=seq,
            )

    def get_record(self, p: Principal, slug: str, record_id: str, *, with_content: bool = True) -> Record:
        """The record (deleted ones too, with ``deleted`` true); 404 ``record_not_found``."""
        with self.db.read_conn() as conn:
            st = self._store(conn, p, slug)
            return _record_model(self._record(conn, st, record_id), with_content=with_content)

    def list_versions(
        self, p: Principal, slug: str, record_id: str, *, limit: int = VERSIONS_PAGE_DEFAULT,
        cursor: int | None = None, newest_first: bool = False,
    ) -> VersionList:
        """One page of the record's versions (deleted records too), without content: oldest
        first (after version ``cursor``), or with ``newest_first`` newest first (before
        version ``cursor``). At most ``limit`` versions and at most
        ``defs.VERSIONS_PAGE_BYTES`` of their JSON (``defs.versions_page_rows``: at least one
        version). ``next_cursor``: the last version's number when more follow, else None.
        404 ``store_not_found`` / ``record_not_found``."""
        cols = [c for c in _V.c if c.name != "content"]
        with self.db.read_conn() as conn:
            st = self._store(conn, p, slug)
            self._record(conn, st, record_id)
            q = select(*cols).where(_V.c.record_id == record_id)
            # a cursor past what the version columns hold (32-bit on PostgreSQL: the database
            # would refuse to compare it) is the end (asc) or no bound at all (desc)
            if newest_first:
                q = q.where(_V.c.version < cursor) if cursor is not None and cursor <= VERSION_MAX else q
                q = q.order_by(_V.c.version.desc())
            else:
                q = q.where(_V.c.version > min(cursor, VERSION_MAX)) if cursor is not None else q
                q = q.order_by(_V.c.version)
            rows = conn.execute(q.limit(limit + 1)).all()
        versions = [_version_model(v, with_content=False) for v in rows[:limit]]
        encoded = [v.model_dump_json().encode() for v in versions]
        n = versions_page_rows(encoded)
        more = len(rows) > n
        return VersionList(versions[:n], encoded[:n], versions[n - 1].version if more else None)

    def get_version(self, p: Principal, slug: str, record_id: str, n: int) -> Version:
        """Version ``n`` with content (None when redacted); 404 ``version_not_found``."""
        with self.db.read_conn() as conn:
            st = self._store(conn, p, slug)
            self._record(conn, st, record_id)
            return _version_model(self._version(conn, record_id, n), with_content=True)
