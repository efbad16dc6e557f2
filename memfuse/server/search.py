"""Searching and listing a store's live records by the database, bounded.

``search`` backs ``GET /v1/stores/{store}/search`` and the memory tool's / MCP ``search``:
a literal query matched in the path and / or the content of the live records, evaluated by
the database (``instr`` / ``strpos``: no pattern characters), one page of at most ``limit``
records at a time in path order, each with its first matching lines. ``tree`` backs the
memory tool's directory ``view``: the entries up to two levels under a directory, read with
indexed range queries on ``(store, path, id)`` that skip whole subtrees below the depth shown,
so a listing reads about as many rows as it shows, never the whole store.

Case-insensitive matching compares ``base.fold`` (Unicode lowercase) of both sides: the
database narrows the rows with ``LIKE`` / ``ILIKE`` (``Resource._contains``: a superset,
the same on SQLite and PostgreSQL, whatever the database's ``LC_CTYPE``) and each candidate
row is checked again here, line by line, so a hit always holds the query as this module
defines it. The console's filters (``RecordsService.search_records``) use the same rule.

Paths compare byte-wise on both databases (PostgreSQL: ``COLLATE "C"``), the order of the
snapshot pages; a cursor is the snapshot cursor of the last row read.
"""
from __future__ import annotations

import base64
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import ColumnClause, ColumnElement, and_, bindparam, false, func, literal_column, or_, select, text, tuple_
from sqlalchemy.engine import Connection

from memfuse import content as content_rules
from memfuse.defs import SEARCH_LINES_DEFAULT, SEARCH_PAGE_DEFAULT
from memfuse.models import SearchHit, SearchLine, SearchPage
from memfuse.server import budget, fulltext, tails
from memfuse.server.base import _R, _V, Principal, Resource, ServiceError, _check_path, fold
from memfuse.server.recordrows import _decode_cursor, _encode_cursor, _record_model

QUERY_MAX_CHARS = 256  # a search query is 1..256 characters
SEARCH_MAX_LIMIT = 100  # records one search page returns at most
SEARCH_MAX_LINES = 100  # matching lines shown per record at most
LINE_MAX_CHARS = 300  # a matching line is shown up to this many characters
MATCH_FIELDS = ("any", "path", "content")
ORDERS = ("path", "relevance")
RANK_MAX_OFFSET = 1000  # a ranked search pages through its best 1,000 hits at most
TREE_PAGE = 200  # rows one step of ``tree`` reads at most
TREE_MIN_PAGE = 16  # rows the step right after a jump reads


def _encode_offset(offset: int) -> str:
    """The cursor of a ranked page: the offset of its first hit."""
    return base64.urlsafe_b64encode(f"rank:{offset}".encode()).decode().rstrip("=")


def _decode_offset(cursor: str) -> int:
    """The offset of a ranked cursor; 422 ``validation_error`` for any other text."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        kind, _, n = raw.partition(":")
        offset = int(n)
        if kind != "rank" or not 0 <= offset <= RANK_MAX_OFFSET:
            raise ValueError(raw)
        return offset
    except Exception:
        raise ServiceError(422, "validation_error", "cursor is not one this server gave out") from None


def check_query(q: str) -> None:
    """422 ``invalid_query`` unless ``q`` is 1–256 characters without control or format
    characters (a query is one line of literal text)."""
    if not q or len(q) > QUERY_MAX_CHARS:
        raise ServiceError(422, "invalid_query", f"the query must be 1 to {QUERY_MAX_CHARS} characters")
    if any(unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp") for ch in q):
        raise ServiceError(422, "invalid_query",
                           "the query must be one line of text (no control or format characters)")


def cut_line(line: str) -> str:
    """A line as a hit shows it: at most ``LINE_MAX_CHARS`` characters, then `` …``."""
    return line if len(line) <= LINE_MAX_CHARS else line[:LINE_MAX_CHARS] + " …"


def _prefix_clause(path_col: Any, prefix: str) -> ColumnElement[bool]:
    """Records at ``prefix`` (a file) or under it (a directory), as an index range (in byte
    order, ``path_col``: ``prefix`` and every path under ``prefix/`` sort in [``prefix``,
    ``prefix0``)); the ``OR`` inside the range leaves out its other paths (``prefix-x``)."""
    return and_(path_col >= prefix, path_col < prefix + "0",
                or_(_R.c.path == prefix, path_col >= prefix + "/"))


@dataclass
class TreeListing:
    """What ``tree`` found under a directory: ``dirs`` (paths relative to it, each
    directory once) and ``files`` (relative path → size in bytes), at most the entries asked
    for; ``complete`` False when more entries exist than were returned."""

    dirs: list[str] = field(default_factory=list)
    files: dict[str, int] = field(default_factory=dict)
    complete: bool = True


class SearchService(Resource):
    """``Service.search`` and ``Service.tree`` (module docstring)."""

    def search(
        self,
        p: Principal,
        slug: str,
        q: str,
        *,
        match: str = "any",
        prefix: str = "",
        type: str | None = None,
        case_sensitive: bool = False,
        cursor: str | None = None,
        limit: int = SEARCH_PAGE_DEFAULT,
        max_lines: int = SEARCH_LINES_DEFAULT,
        order: str = "path",
    ) -> SearchPage:
        """One page of the live records of ``slug`` holding ``q`` (literal text) in their
        path (``match="path"``), content (``"content"``) or either (``"any"``), in path order.

        ``order="relevance"``: the records holding every word of ``q`` (as a word prefix) in
        the full-text index instead (``memfuse.server.fulltext``), best first, each with its
        ``score`` and ``snippet``; ``lines`` are then the lines holding one of the words.
        ``case_sensitive`` does not apply (422 ``validation_error``); 422 ``invalid_query``
        when ``q`` has no word; pages go to the best ``RANK_MAX_OFFSET`` hits.

        ``prefix``: only the record at that path or under that directory (``""``: the whole
        store). ``type``: only records of that type. ``limit`` (1–100) bounds the records
        read for the page, ``max_lines`` (0–100) the lines shown per hit. Raises 404 like
        ``list_records``; 422 ``invalid_query`` (empty, longer than 256 characters, control
        characters), ``invalid_path`` (prefix), ``invalid_type``, ``validation_error`` (a
        cursor this server did not give, a ``match`` or bound out of range)."""
        check_query(q)
        if match not in MATCH_FIELDS:
            raise ServiceError(422, "validation_error", f"match must be one of {', '.join(MATCH_FIELDS)}")
        if order not in ORDERS:
            raise ServiceError(422, "validation_error", f"order must be one of {', '.join(ORDERS)}")
        if not 1 <= limit <= SEARCH_MAX_LIMIT or not 0 <= max_lines <= SEARCH_MAX_LINES:
            raise ServiceError(422, "validation_error",
                               f"limit must be 1..{SEARCH_MAX_LIMIT} and max_lines 0..{SEARCH_MAX_LINES}")
        if type is not None and type not in content_rules.RECORD_TYPES:
            raise ServiceError(422, "invalid_type",
                               f"type {type!r} is not one of {', '.join(content_rules.RECORD_TYPES)}")
        prefix = prefix.strip("/")
        if prefix:
            _check_path(prefix)
        if order == "relevance":
            return self._ranked(p, slug, q, match=match, prefix=prefix, type=type,
                                case_sensitive=case_sensitive, cursor=cursor, limit=limit,
                                max_lines=max_lines)
        needle = q if case_sensitive else fold(q)
        with self.db.read_conn() as conn:
            st = self._store(conn, p, slug)
            seq = conn.scalar(select(func.max(_V.c.seq)).where(_V.c.store == st.slug)) or 0
            path_col = self._path_col()
            conds = [_R.c.store == st.slug, _R.c.deleted == false()]
            if prefix:
                conds.append(_prefix_clause(path_col, prefix))
            if type is not None:
                conds.append(_R.c.type == type)
            by_match: dict[str, list[Any]] = {"path": [_R.c.path], "content": [tails.LIVE_CONTENT_EXPR],
                                              "any": [_R.c.path, tails.LIVE_CONTENT_EXPR]}
            fields = by_match[match]
            conds.append(or_(*(self._contains(c, q, case_sensitive) for c in fields)))
            if cursor:
                cp, cid = _decode_cursor(cursor)
                conds.append(tuple_(path_col, _R.c.id) > tuple_(cp, cid))  # an index seek, as in records
            rows = conn.execute(select(*tails.live(tuple(_R.c))).where(*conds).order_by(path_col, _R.c.id)
                                .limit(limit + 1)).all()
        more = len(rows) > limit
        rows = rows[:limit]
        hits: list[SearchHit] = []
        for r in rows:
            budget.check()  # a client gone, or the read's time up: stop (memfuse.server.budget)
            path_match = match != "content" and needle in (r.path if case_sensitive else fold(r.path))
            lines: list[SearchLine] = []
            count = 0
            if match != "path":
                for i, line in enumerate((r.content or "").split("\n"), 1):
                    if needle in (line if case_sensitive else fold(line)):
                        count += 1
                        if len(lines) < max_lines:
                            lines.append(SearchLine(line=i, text=cut_line(line)))
            if path_match or count:  # else a candidate of the superset filter only
                hits.append(SearchHit(record=_record_model(r, with_content=False),
                                      path_match=path_match, lines=lines, line_matches=count))
        return SearchPage(hits=hits, seq=seq,
                          next_cursor=_encode_cursor(rows[-1].path, rows[-1].id) if more else None)

    def _ranked(self, p: Principal, slug: str, q: str, *, match: str, prefix: str, type: str | None,
                case_sensitive: bool, cursor: str | None, limit: int, max_lines: int) -> SearchPage:
        """``search`` with ``order="relevance"`` (arguments checked by the caller but for
        the ranking's own rules, see ``search``)."""
        if case_sensitive:
            raise ServiceError(422, "validation_error",
                               "case_sensitive applies to substring search only, not to order=relevance")
        words = fulltext.terms(q)
        if not words:
            raise ServiceError(422, "invalid_query", "the query has no word to rank by (letters or digits)")
        offset = _decode_offset(cursor) if cursor else 0
        take = min(limit, RANK_MAX_OFFSET - offset)
        self.db.index_pending()  # SQLite: the records written before this search, indexed
        with self.db.read_conn() as conn:
            st = self._store(conn, p, slug)
            seq = conn.scalar(select(func.max(_V.c.seq)).where(_V.c.store == st.slug)) or 0
            if take <= 0:
                return SearchPage(hits=[], seq=seq)
            if conn.dialect.name == "sqlite":
                # written out: CROSS JOIN keeps the FTS table the outer loop (SQLite never
                # reorders it), so the cost follows the matches, never the store's size
                extra, params = "", {"fts_q": fulltext.sqlite_match(words, match), "store": st.slug,
                                     "lim": take + 1, "off": offset}
                if prefix:
                    extra += (" AND records.path >= :p0 AND records.path < :p1"
                              " AND (records.path = :p0 OR records.path >= :p2)")
                    params.update(p0=prefix, p1=prefix + "0", p2=prefix + "/")
                if type is not None:
                    extra += " AND records.type = :rtype"
                    params["rtype"] = type
                bm25 = "bm25(records_fts, {}, {}, {})".format(*fulltext.SQLITE_WEIGHTS)
                ranked = conn.execute(text(
                    f"SELECT records.id, -{bm25} AS score FROM records_fts "
                    "CROSS JOIN records_fts_keys ON records_fts_keys.k = -records_fts.rowid "
                    "CROSS JOIN records INDEXED BY ix_records_fts_hit ON records.id = records_fts_keys.record_id "
                    "WHERE records_fts MATCH :fts_q "
                    f"AND records.store = :store AND records.deleted = 0{extra} "
                    f"ORDER BY {bm25}, records.path, records.id LIMIT :lim OFFSET :off"), params).all()
            else:
                conds = [_R.c.store == st.slug, _R.c.deleted == false()]
                if prefix:
                    conds.append(_prefix_clause(self._path_col(), prefix))
                if type is not None:
                    conds.append(_R.c.type == type)
                tsq = func.to_tsquery(literal_column("'simple'::regconfig"),
                                      bindparam("ts_q", fulltext.pg_tsquery(words, match)))
                vec: ColumnClause[Any] = literal_column("records.search_vector")
                rank = func.ts_rank_cd(vec, tsq)
                stmt = (select(_R.c.id, rank.label("score")).where(vec.op("@@")(tsq), *conds)
                        .order_by(rank.desc(), self._path_col(), _R.c.id))
                ranked = conn.execute(stmt.limit(take + 1).offset(offset)).all()
            # ranked without content (the sort holds ids and scores), then the page's records
            more = len(ranked) > take and offset + take < RANK_MAX_OFFSET
            ranked = ranked[:take]
            # each hit's lines and snippet are made from the text the index holds of it (its
            # first PG_MAX_CHARS characters), read alone: a page of 1 MiB records costs about
            # what a page of 200,000-character ones does (attack 15 F3)
            window = func.substr(tails.LIVE_CONTENT_EXPR, 1, fulltext.PG_MAX_CHARS).label("content")
            cols = tuple(window if c is _R.c.content else c for c in _R.c)
            by_id = {r.id: r for r in conn.execute(select(*cols).where(
                _R.c.id.in_([x.id for x in ranked])))}
        rows = [(by_id[x.id], x.score) for x in ranked if x.id in by_id]
        hits: list[SearchHit] = []
        m = fulltext.Matcher(words)
        for r, score in rows:
            budget.check()
            path_match = match != "content" and m.path(r.path)
            lines: list[SearchLine] = []
            count = 0
            body = r.content or ""
            if match != "path":
                for i, line in enumerate(body.split("\n"), 1):
                    if m.line(line):
                        count += 1
                        if len(lines) < max_lines:
                            lines.append(SearchLine(line=i, text=cut_line(line)))
            hits.append(SearchHit(record=_record_model(r, with_content=False), path_match=path_match,
                                  lines=lines, line_matches=count, score=float(score),
                                  snippet=fulltext.snippet(body, m, path_match)))
        return SearchPage(hits=hits, seq=seq, next_cursor=_encode_offset(offset + take) if more else None)

    def tree(self, p: Principal, slug: str, prefix: str = "", *, depth: int = 2,
             max_entries: int = 1000, hidden: bool = False) -> TreeListing:
        """The entries up to ``depth`` levels under directory ``prefix`` (``""``: the store
        root) of the live records of ``slug``: files at those levels with their sizes and
        the directories implied by paths, at most ``max_entries`` of them (``complete``
        False when there are more). Names starting with ``.`` (and what is under such a
        directory) are left out unless ``hidden``. Reads with range queries in path order,
        jumping over every subtree deeper than ``depth`` (module docstring). Raises 404
        like ``list_records``."""
        out = TreeListing()
        lead = prefix.strip("/") + "/" if prefix.strip("/") else ""
        seen_dirs: set[str] = set()
        with self.db.read_conn() as conn:
            st = self._store(conn, p, slug)
            for path, size in self._tree_rows(conn, st.slug, lead, depth, hidden):
                rel = path[len(lead):]
                parts = rel.split("/")
                for i in range(1, min(len(parts), depth + 1)):
                    d = "/".join(parts[:i])
                    if d not in seen_dirs:
                        if len(seen_dirs) + len(out.files) >= max_entries:
                            out.complete = False
                            return out
                        seen_dirs.add(d)
                        out.dirs.append(d)
                if len(parts) <= depth:
                    if len(seen_dirs) + len(out.files) >= max_entries:
                        out.complete = False
                        return out
                    out.files[rel] = size
        return out

    def _tree_rows(self, conn: Connection, store: str, lead: str, depth: int,
                   hidden: bool) -> Iterator[tuple[str, int]]:
        """(path, size) of the live records under ``lead`` in path order, with one row per
        subtree deeper than ``depth`` (its first) and, unless ``hidden``, none under a hidden
        name. Pages of up to ``TREE_PAGE`` rows; a page that ends inside such a subtree is
        followed by a range query that starts past the subtree (reading ``TREE_MIN_PAGE``
        rows, growing fourfold per page while pages end on entries shown), so a large
        subtree costs one query and a few rows, never all of its rows."""
        path_col = self._path_col()
        lo, inclusive = lead, True
        hi = lead[:-1] + "0" if lead else None  # every path under lead/ is below it
        skipping: str | None = None  # the subtree (path prefix + "/") being passed over
        page = TREE_PAGE  # rows per query: small right after a jump (the next subtree's
        # first rows are all it needs), growing again while pages end on shown entries
        while True:
            conds = [_R.c.store == store, _R.c.deleted == false(),
                     path_col >= lo if inclusive else path_col > lo]
            if hi is not None:
                conds.append(path_col < hi)
            rows = conn.execute(select(_R.c.path, _R.c.size).where(*conds)
                                .order_by(path_col, _R.c.id).limit(page)).all()
            for path, size in rows:
                if skipping is not None and path.startswith(skipping):
                    continue
                skipping = None
                parts = path[len(lead):].split("/")
                cut = next((i for i, c in enumerate(parts[:depth]) if c.startswith(".")), None)
                if hidden or cut is None:
                    yield path, size
                    cut = depth - 1 if len(parts) > depth else None
                if cut is not None and cut + 1 < len(parts):  # a directory: pass over it
                    skipping = lead + "/".join(parts[:cut + 1]) + "/"
            if len(rows) < page:
                return
            if skipping is not None:  # the page ended inside a subtree: start past it
                lo, inclusive = skipping[:-1] + "0", True
                skipping = None
                page = TREE_MIN_PAGE
            else:
                lo, inclusive = rows[-1][0], False
                page = min(page * 4, TREE_PAGE)
