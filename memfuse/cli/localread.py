"""The CLI's read commands in local mode, from the dev database with the standard library.

A read command without ``--control-plane`` (``memfuse history``, ``show``, ``search``,
``store list``, ``token list``...) used to open the dev database through SQLAlchemy and the
service layer (``memfuse.server.local.LocalTransport``): importing SQLAlchemy alone costs
about 2.6 times ``python -c "import httpx, click"``. :class:`LocalReadTransport` answers the
few plain reads those commands make with Python's ``sqlite3`` module instead, with the bodies
the API gives (the client decodes them into the same :mod:`memfuse.wire` structs), and
raises :class:`memfuse.client.NeedEventLoop` for anything else, so that the command runs
again through the full local mode (``memfuse.cli.common._read_api``). It serves a request
only when the answer is plain; every refusal (no such store, record, version; a query or
path the API would refuse), a database not at the newest schema revision (the full path
upgrades it), a time stored in another form and any ``sqlite3`` error go the full way, so
errors keep the service's exact words.

One rule, one place: the columns read are the fields of the wire structs (``_fields``), so
a column added to the API shows up here or fails here (and the command goes the full way);
what the service computes from the rows (a store's history budget and usage, a token's
state, a search hit's lines) is written out below and held equal to the service by
``tests/test_cli_localread.py``, which runs every read command both ways on a database
made by the real service and compares the output byte for byte.

Served (admin only: local mode is admin): ``GET /v1/stores``, ``/v1/stores/{s}``,
``/v1/stores/{s}/records?path=P[&include_deleted=true][&limit=N]`` (``find_record``),
``/v1/stores/{s}/records/{id}[?content=...]``, ``.../records/{id}/versions[?limit=&order=&cursor=]``,
``.../records/{id}/versions/{n}``, ``/v1/tokens[?workspace=&include_revoked=]`` and
``/v1/stores/{s}/search`` in path order (``--rank`` goes the full way), ``/v1/workspaces``
and ``/v1/workspaces/{ws}/attachments``; all but the tokens only while every store's key is
its name (no two accounts share a store name: ``memfuse.server.keys``), and all only while
every workspace's key is its name.
"""
from __future__ import annotations

import os
import sqlite3
import unicodedata
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import unquote

import httpx
import msgspec

from memfuse import wire
from memfuse.client import NeedEventLoop
from memfuse.defs import (
    DEFAULT_MODE,
    HISTORY_BYTES_FACTOR,
    HISTORY_MIN_AGE_S,
    HISTORY_VERSIONS_FACTOR,
    INT64_MAX,
    LIVE_CONTENT_SQL,
    RECORDS_PAGE_DEFAULT,
    RECORDS_PAGE_MAX,
    VERSIONS_PAGE_DEFAULT,
    VERSIONS_PAGE_MAX,
    next_page_link,
    versions_page_rows,
)

__all__ = ["LocalReadTransport", "schema_head"]

_TIMES = frozenset({"created_at", "updated_at", "review_after", "expires_at", "last_used_at", "revoked_at"})
_BOOLS = frozenset({"deleted", "redacted", "pruned"})


def _record_sql(cols: list[str]) -> str:
    """The select list of ``records`` columns ``cols``, ``content`` as the live content (the
    service's one rule: ``memfuse.defs.LIVE_CONTENT_SQL``, a record's tail included)."""
    return ", ".join(f"{LIVE_CONTENT_SQL} AS content" if c == "content" else c for c in cols)


_JSON = {"content-type": "application/json"}


class _Linked(NamedTuple):
    """An answer encoded already (``body``), and the ``cursor`` of the next page when more
    follow (sent as its ``Link`` header), else None."""

    body: bytes
    cursor: int | None

# the search API's bounds (memfuse.server.search), as the CLI asks within them
_QUERY_MAX = 256
_LINE_MAX = 300
_SEARCH_LIMIT_MAX = 100
_SEARCH_LINES_MAX = 100


def schema_head(migrations: Path | None = None) -> str | None:
    """The newest Alembic revision shipped: the highest-numbered file of
    ``memfuse/server/migrations/versions`` (each revision's id is its file name,
    ``NNNN_name``: ``tests/test_cli_localread.py`` holds this equal to
    ``memfuse.server.db.SCHEMA_HEAD``). None when the directory cannot be read."""
    d = migrations or Path(__file__).resolve().parent.parent / "server" / "migrations" / "versions"
    try:
        names = [n[:-3] for n in os.listdir(d) if n.endswith(".py") and n[:4].isdigit()]
    except OSError:
        return None
    return max(names) if names else None


def _fields(struct: type, skip: tuple[str, ...] = ()) -> list[str]:
    return [f for f in struct.__struct_fields__ if f not in skip]  # type: ignore[attr-defined]


_RECORD_COLS = _fields(wire.Record, ("content",))
_VERSION_COLS = _fields(wire.Version, ("content",))
_STORE_COLS = _fields(wire.Store, ("history_bytes", "history_versions")) + [
    "version_bytes", "version_count"]
_TOKEN_COLS = _fields(wire.TokenInfo, ("state",))


def _time(text: Any) -> str | None:
    """A time as SQLAlchemy stores it on SQLite (naive UTC, ``YYYY-MM-DD HH:MM:SS[.ffffff]``)
    as the API's JSON gives it (RFC 3339, UTC); another form goes the full way."""
    if text is None:
        return None
    if isinstance(text, str) and len(text) in (19, 26) and text[10] == " ":
        return text[:10] + "T" + text[11:] + "Z"
    raise NeedEventLoop(f"a time stored as {text!r}")


def _aware(text: str | None) -> datetime | None:
    return None if text is None else datetime.fromisoformat(text[:-1]).replace(tzinfo=timezone.utc)


def _row(row: sqlite3.Row | dict[str, Any], cols: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for c in cols:
        v = row[c]
        if c in _TIMES:
            v = _time(v)
        elif c in _BOOLS:
            v = bool(v)
        elif c == "mode" and v is None:
            v = DEFAULT_MODE
        out[c] = v
    return out


def _store_body(row: sqlite3.Row | dict[str, Any]) -> dict[str, Any]:
    """A store row as the API's Store (``memfuse.server.stores._store_model``): the history
    budget in force (its own, else the defaults of ``memfuse.server.history.budget``) and
    the history's usage (``history.usage``)."""
    d = _row(row, _STORE_COLS)
    vb, vn = d.pop("version_bytes") or 0, d.pop("version_count") or 0
    d["usage_bytes"] = d["usage_bytes"] or 0
    d["record_count"] = d["record_count"] or 0
    if d["max_history_bytes"] is None:
        d["max_history_bytes"] = min(HISTORY_BYTES_FACTOR * d["max_store_bytes"], INT64_MAX)
    if d["max_history_versions"] is None:
        d["max_history_versions"] = min(HISTORY_VERSIONS_FACTOR * d["max_records"], INT64_MAX)
    if d["history_min_age_s"] is None:
        d["history_min_age_s"] = HISTORY_MIN_AGE_S
    d["history_bytes"] = max(0, vb - d["usage_bytes"])
    d["history_versions"] = max(0, vn - d["record_count"])
    return d


def _flag(q: dict[str, str], name: str, default: bool) -> bool:
    v = q.get(name)
    if v is None:
        return default
    if v not in ("true", "false"):
        raise NeedEventLoop("a flag the full path reads")
    return v == "true"


def _bounded(q: dict[str, str], name: str, default: int, lo: int, hi: int) -> int:
    v = q.get(name)
    if v is None:
        return default
    if not (v.isascii() and v.isdigit()) or not lo <= int(v) <= hi:
        raise NeedEventLoop("a bound the full path checks")
    return int(v)


class LocalReadTransport(httpx.AsyncBaseTransport):
    """An ``httpx`` transport answering the CLI's plain reads from the SQLite database at
    ``path`` with ``sqlite3`` (module docstring), synchronously: for
    :func:`memfuse.client.run_loopless`. Raises :class:`memfuse.client.NeedEventLoop` for
    every request it does not answer. Opened with :meth:`open`."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    @classmethod
    def open(cls, path: Path) -> LocalReadTransport | None:
        """The transport on the database file ``path``, or None when the file is missing or
        not at the newest schema revision (:func:`schema_head`): the full local mode creates
        or upgrades it."""
        if not path.is_file():
            return None
        try:
            conn = sqlite3.connect(path, timeout=30.0, isolation_level=None, check_same_thread=False)
        except sqlite3.Error:
            return None
        try:
            conn.row_factory = sqlite3.Row
            rev = [r[0] for r in conn.execute("SELECT version_num FROM alembic_version")]
            if rev != [schema_head()]:
                conn.close()
                return None
        except sqlite3.Error:
            conn.close()
            return None
        return cls(conn)

    async def aclose(self) -> None:  # noqa: D102
        self._conn.close()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:  # noqa: D102
        if request.method != "GET":
            raise NeedEventLoop("a write")
        raw = request.url.raw_path.split(b"?", 1)[0].decode("ascii", "replace")
        parts = [unquote(s) for s in raw.split("/")][1:]
        q: dict[str, str] = {}
        for k, v in request.url.params.multi_items():
            if k in q:
                raise NeedEventLoop("a repeated parameter")
            q[k] = v
        if parts[:1] != ["v1"] or any(not s or "/" in s for s in parts[1:]):
            raise NeedEventLoop("not an API path this serves")
        try:
            self._conn.execute("BEGIN")  # one snapshot for the whole answer
            try:
                body = self._answer(parts[1:], q)
            finally:
                self._conn.execute("COMMIT")
        except sqlite3.Error as e:
            raise NeedEventLoop(f"sqlite: {e}") from None
        if isinstance(body, _Linked):  # a page encoded already, and its link to the next
            headers = _JSON if body.cursor is None else {
                **_JSON, "link": next_page_link(request.url.query.decode("ascii"), body.cursor)}
            return httpx.Response(200, headers=headers, content=body.body, request=request)
        return httpx.Response(200, headers=_JSON, content=msgspec.json.encode(body), request=request)

    # ------------------------------------------------------------ answers

    def _one(self, sql: str, *args: Any) -> sqlite3.Row:
        row = self._conn.execute(sql, args).fetchone()
        if row is None:
            raise NeedEventLoop("not found: the full path says so")
        return row

    def _store(self, slug: str) -> sqlite3.Row:
        return self._one(f"SELECT {', '.join(_STORE_COLS)} FROM stores WHERE slug = ?", slug)

    def _record(self, slug: str, rid: str, content: bool) -> dict[str, Any]:
        cols = _RECORD_COLS + (["content"] if content else [])
        row = self._one(f"SELECT {_record_sql(cols)} FROM records WHERE id = ?", rid)
        if row["store"] != slug:
            raise NeedEventLoop("a record of another store")
        return _row(row, cols)

    def _answer(self, p: list[str], q: dict[str, str]) -> Any:
        if self._conn.execute("SELECT 1 FROM workspaces WHERE instr(name, '~') > 0 LIMIT 1").fetchone():
            # a workspace whose name another account took first: tokens, attachments and
            # listings hold its key, which the service resolves and never shows
            raise NeedEventLoop("a workspace's key differs from its name")
        if p == ["tokens"]:
            return self._tokens(q)
        if self._conn.execute("SELECT 1 FROM stores WHERE instr(slug, '~') > 0 LIMIT 1").fetchone():
            # a store whose name another account took first: its key is not its name, and the
            # service resolves names and shows them (memfuse.server.keys); plain here no more
            raise NeedEventLoop("a store's key differs from its name")
        if p[:1] == ["workspaces"] and not q:
            return self._workspaces(p[1:])
        if p[:1] != ["stores"]:
            raise NeedEventLoop("not served here")
        if p == ["stores"] and not q:
            sql = f"SELECT {', '.join(_STORE_COLS)} FROM stores ORDER BY slug"
            return [_store_body(r) for r in self._conn.execute(sql)]
        slug, rest = p[1], p[2:]
        if not rest and not q:
            return _store_body(self._store(slug))
        st = self._store(slug)
        if rest == ["records"] and "path" in q:
            return self._records_at(st["slug"], q)
        if rest == ["search"]:
            return self._search(st["slug"], q)
        if len(rest) == 2 and rest[0] == "records" and set(q) <= {"content"}:
            return self._record(st["slug"], rest[1], _flag(q, "content", True))
        if len(rest) == 3 and rest[0] == "records" and rest[2] == "versions" and set(q) <= {"limit", "order", "cursor"}:
            self._record(st["slug"], rest[1], False)
            return self._versions(rest[1], q)
        if len(rest) == 4 and rest[0] == "records" and rest[2] == "versions" and not q:
            self._record(st["slug"], rest[1], False)
            n = _bounded({"n": rest[3]}, "n", 0, 1, 2**63 - 1)
            cols = _VERSION_COLS + ["content", "base_version"]
            v = _row(self._one(f"SELECT {', '.join(cols)} FROM versions WHERE record_id = ? AND version = ?",
                               rest[1], n), cols)
            if v.pop("base_version") is not None:  # an append version holds only its suffix
                raise NeedEventLoop("an append version: its content is rebuilt from its chain")
            if v["redacted"]:
                v["content"] = None
            return v
        raise NeedEventLoop("not served here")

    def _versions(self, rid: str, q: dict[str, str]) -> _Linked:
        """A page of ``GET .../records/{id}/versions`` (``limit``, ``order``, ``cursor``), cut
        as the service cuts it (``memfuse.server.recordreads``: ``limit`` versions and
        ``defs.VERSIONS_PAGE_BYTES`` of their JSON: ``defs.versions_page_rows``), with its ``Link``
        when more follow."""
        limit = _bounded(q, "limit", VERSIONS_PAGE_DEFAULT, 1, VERSIONS_PAGE_MAX)
        cursor = _bounded(q, "cursor", -1, 0, INT64_MAX)
        order = q.get("order", "asc")
        if order not in ("asc", "desc"):
            raise NeedEventLoop("a bad order: the full path refuses it")
        cmp, way = (">", "") if order == "asc" else ("<", " DESC")
        after = f" AND version {cmp} ?" if cursor >= 0 else ""
        sql = (f"SELECT {', '.join(_VERSION_COLS)} FROM versions WHERE record_id = ?{after} "
               f"ORDER BY version{way} LIMIT ?")
        args = (rid, cursor, limit + 1) if cursor >= 0 else (rid, limit + 1)
        rows = [_row(r, _VERSION_COLS) for r in self._conn.execute(sql, args)]
        encoded = [msgspec.json.encode(r) for r in rows[:limit]]
        n = versions_page_rows(encoded)
        more = len(rows) > n
        return _Linked(b"[" + b",".join(encoded[:n]) + b"]", rows[n - 1]["version"] if more else None)

    def _workspaces(self, rest: list[str]) -> Any:
        """``GET /v1/workspaces`` (by name) and ``/v1/workspaces/{ws}/attachments`` (by store,
        each with its store: ``memfuse.server.stores.StoresService.list_attachments``)."""
        if not rest:
            sql = f"SELECT {', '.join(_fields(wire.Workspace))} FROM workspaces ORDER BY name"
            return [_row(r, _fields(wire.Workspace)) for r in self._conn.execute(sql)]
        if len(rest) != 2 or rest[1] != "attachments":
            raise NeedEventLoop("not served here")
        self._one("SELECT name FROM workspaces WHERE name = ?", rest[0])
        cols = ["access", "instructions", "created_at"]
        sql = (f"SELECT {', '.join('a.' + c for c in cols)}, {', '.join('s.' + c for c in _STORE_COLS)} "
               "FROM attachments a JOIN stores s ON s.slug = a.store WHERE a.workspace = ? ORDER BY a.store")
        out = []
        for r in self._conn.execute(sql, (rest[0],)):
            st = dict(zip(_STORE_COLS, tuple(r)[len(cols):]))
            att = _row(r, cols)
            out.append({"workspace": rest[0], "store": _store_body(st), **att})  # type: ignore[arg-type]
        return out

    def _records_at(self, slug: str, q: dict[str, str]) -> dict[str, Any]:
        """``GET .../records?path=P``: one snapshot page of the records at P (the client's
        ``find_record``), without content; a page that would need a cursor goes the full way."""
        if not set(q) <= {"path", "include_deleted", "limit", "content"} or _flag(q, "content", False):
            raise NeedEventLoop("not served here")
        limit = _bounded(q, "limit", RECORDS_PAGE_DEFAULT, 1, RECORDS_PAGE_MAX)
        sql = f"SELECT {', '.join(_RECORD_COLS)} FROM records WHERE store = ? AND path = ?"
        if not _flag(q, "include_deleted", False):
            sql += " AND deleted = 0"
        rows = self._conn.execute(sql + " ORDER BY path, id LIMIT ?", (slug, q["path"], limit + 1)).fetchall()
        if len(rows) > limit:
            raise NeedEventLoop("more than a page")
        return {"records": [_row(r, _RECORD_COLS) for r in rows], "next_cursor": None, "seq": self._seq(slug)}

    def _seq(self, slug: str) -> int:
        return int(self._conn.execute("SELECT max(seq) FROM versions WHERE store = ?", (slug,)).fetchone()[0] or 0)

    def _tokens(self, q: dict[str, str]) -> list[dict[str, Any]]:
        """``GET /v1/tokens``: every token, oldest first, with its state
        (``memfuse.server.tokens.TokensService.list_tokens``)."""
        if not set(q) <= {"workspace", "include_revoked"}:
            raise NeedEventLoop("not served here")
        sql = f"SELECT {', '.join(_TOKEN_COLS)} FROM tokens"
        where: list[str] = []
        args: list[Any] = []
        if "workspace" in q:
            if q["workspace"] == "":
                where.append("workspace IS NULL")
            else:
                where.append("workspace = ?")
                args.append(q["workspace"])
        if not _flag(q, "include_revoked", False):
            where.append("revoked_at IS NULL")
        if where:
            sql += " WHERE " + " AND ".join(where)
        now = datetime.now(timezone.utc)
        out = []
        for r in self._conn.execute(sql + " ORDER BY created_at, id", args):
            d = _row(r, _TOKEN_COLS)
            d["name"] = d["name"] or ""
            exp = _aware(d["expires_at"])
            d["state"] = ("revoked" if d["revoked_at"] is not None
                          else "expired" if exp is not None and exp <= now else "active")
            out.append(d)
        return out

    def _search(self, slug: str, q: dict[str, str]) -> dict[str, Any]:
        """``GET .../search`` in path order (``memfuse.server.search.SearchService.search``):
        every live record holding the query, in one page (the CLI reads all pages anyway;
        ``limit`` is the records it asks for, served whole). A ranked search, a prefix, a
        cursor or anything the service would check goes the full way."""
        if not set(q) <= {"q", "match", "prefix", "type", "case_sensitive", "limit", "max_lines", "order"}:
            raise NeedEventLoop("not served here")
        text, match, prefix = q.get("q", ""), q.get("match", "any"), q.get("prefix", "")
        rtype = q.get("type")
        if (q.get("order", "path") != "path" or prefix or match not in ("any", "path", "content")
                or not 1 <= len(text) <= _QUERY_MAX
                or any(unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp") for ch in text)
                or (rtype is not None and rtype not in wire.RECORD_TYPES)):
            raise NeedEventLoop("the full path checks or ranks it")
        case = _flag(q, "case_sensitive", False)
        _bounded(q, "limit", 20, 1, _SEARCH_LIMIT_MAX)
        max_lines = _bounded(q, "max_lines", 5, 0, _SEARCH_LINES_MAX)
        seq = self._seq(slug)
        needle = text if case else text.lower()  # memfuse.server.base.fold
        cols = _RECORD_COLS + ["content"]
        sql = f"SELECT {_record_sql(cols)} FROM records WHERE store = ? AND deleted = 0"
        args: list[Any] = [slug]
        if rtype is not None:
            sql += " AND type = ?"
            args.append(rtype)
        if case:  # the service's own filter; case-insensitive rows are checked below only
            field = {"path": "instr(path, ?) > 0", "content": f"instr({LIVE_CONTENT_SQL}, ?) > 0",
                     "any": f"(instr(path, ?) > 0 OR instr({LIVE_CONTENT_SQL}, ?) > 0)"}[match]
            sql += " AND " + field
            args += [text] * field.count("?")
        hits = []
        for r in self._conn.execute(sql + " ORDER BY path, id", args):
            path_match = match != "content" and needle in (r["path"] if case else r["path"].lower())
            lines = []
            count = 0
            if match != "path":
                for i, line in enumerate((r["content"] or "").split("\n"), 1):
                    if needle in (line if case else line.lower()):
                        count += 1
                        if len(lines) < max_lines:
                            lines.append({"line": i, "text": line if len(line) <= _LINE_MAX
                                          else line[:_LINE_MAX] + " …"})
            if path_match or count:
                hits.append({"record": _row(r, _RECORD_COLS), "path_match": path_match, "lines": lines,
                             "line_matches": count, "score": None, "snippet": None})
        return {"hits": hits, "next_cursor": None, "seq": seq}
