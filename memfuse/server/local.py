"""The CLI's local mode without building the web app: read requests served from ``Service``.

A ``memfuse`` command without ``--control-plane`` (``memfuse.devenv.local_client``) talks to
the control plane in process, on the dev database, through an ``httpx`` transport. Importing
FastAPI and building the app (its routes, pydantic schemas and OpenAPI models) took about
1.2 s of every such command; ``LocalTransport`` answers the plain reads the record commands
make (``history``, ``show``, ``search``: the records of a path, a record, its versions, one
version, a search page) and the admin listings (stores, a store, workspaces, a workspace's
attachments) straight from ``Service``, with the bytes the app would send, and
hands everything else to the full app, built on first use. It falls back in the same way
for anything it does not serve plainly: another route or method, a query parameter FastAPI
would validate or coerce, a token not among the static ones, and every refusal
(``ServiceError``) or database error: the app serves such a request again from the start
(the routes are reads), so errors keep the app's exact problem+json. The rule is
``memfuse.server.longpoll.FastPath``'s, one layer further out; which route a request is comes
from the app's route table (``memfuse.server.routetable``), on the path the app would route.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from memfuse import defs
from memfuse.server import routetable as table

__all__ = ["LocalTransport"]

_JSON = "application/json"


def _flag(value: str) -> bool | None:
    """``true`` / ``false`` as the API client sends them; None (serve it through the app) for
    the other spellings FastAPI accepts."""
    return {"true": True, "false": False}.get(value)


def _int(value: str, lo: int, hi: int) -> int | None:
    if not (value.isascii() and value.isdigit()):
        return None
    n = int(value)
    return n if lo <= n <= hi else None


class _Plain(Exception):
    """The request is not one this transport serves plainly: the app serves it."""


class LocalTransport(httpx.AsyncBaseTransport):
    """An ``httpx`` transport to the reference control plane on ``db_url`` in this process.

    ``static_tokens``: raw token → workspace (None: admin), as ``create_app`` takes them.
    ``make_app``: builds the full ASGI app with those tokens on the same database (called at
    most once, on the first request this transport does not serve itself). Served here, in a
    worker thread each (as the app's handlers run), with the app's bodies and headers:
    ``GET /v1/stores/{s}/records`` (``cursor``, ``limit``, ``content``, ``path``,
    ``include_deleted``), ``GET .../records/{id}`` (``content``), ``GET .../records/{id}/versions``
    (``limit``, ``order``, ``cursor``),
    ``GET .../versions/{n}``, ``GET /v1/stores/{s}/search``; ``GET /v1/stores``,
    ``/v1/stores/{s}``, ``/v1/workspaces``, ``/v1/workspaces/{ws}/attachments``. The database is opened (and
    upgraded to the newest schema revision, as the app does) on the first request.
    """

    def __init__(self, db_url: str, static_tokens: dict[str, str | None],
                 make_app: Callable[[], Any]) -> None:
        self.db_url = db_url
        self.static_tokens = static_tokens
        self._make_app = make_app
        self._svc: Any = None
        self._app_transport: httpx.ASGITransport | None = None
        self.served = 0  # requests answered here (tests)
        self.passed = 0  # requests handed to the app (tests)

    @property
    def service(self) -> Any:
        """The ``Service`` on the database (opened, and migrated, on first use)."""
        if self._svc is None:
            from memfuse.server.db import Database
            from memfuse.server.service import Service

            self._svc = Service(Database(self.db_url, schema="migrate"), self.static_tokens)
        return self._svc

    def app_transport(self) -> httpx.ASGITransport:
        """The ``httpx.ASGITransport`` to the full app (built on first use)."""
        if self._app_transport is None:
            self._app_transport = httpx.ASGITransport(app=self._make_app())
        return self._app_transport

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:  # noqa: D102
        call = self._route(request)
        if call is not None:
            import anyio

            from memfuse.server.service import ServiceError
            from sqlalchemy.exc import SQLAlchemyError

            try:
                body, headers = await anyio.to_thread.run_sync(call)
            except (ServiceError, SQLAlchemyError, _Plain):
                pass  # the app answers it, with its own problem+json
            else:
                self.served += 1
                headers = {"content-length": str(len(body)), "content-type": _JSON, **headers}
                return httpx.Response(200, headers=headers, content=body, request=request)
        self.passed += 1
        return await self.app_transport().handle_async_request(request)

    async def aclose(self) -> None:  # noqa: D102 — as ASGITransport: clients share it
        return None

    # ------------------------------------------------------------ routing

    def _route(self, request: httpx.Request) -> Callable[[], tuple[bytes, dict[str, str]]] | None:
        """A call answering ``request`` (body bytes, extra headers), or None for the app."""
        if request.method != "GET":
            return None
        # the path the app routes on (httpx.ASGITransport's scope["path"]), by the route table
        m = table.match("GET", request.url.path)
        if m is None:
            return None
        params: dict[str, str] = {}
        for k, v in request.url.params.multi_items():
            if k in params:
                return None
            params[k] = v
        token = instance = None
        auth = request.headers.get("authorization", "")
        scheme, _, cred = auth.partition(" ")
        if scheme.lower() == "bearer" and cred.strip():
            token = cred.strip()
        instance = request.headers.get("x-memfuse-instance")
        if token is None or token not in self.static_tokens:
            return None
        r, path = m.route, m.params
        try:
            if r in (table.LIST_STORES, table.LIST_WORKSPACES, table.GET_STORE, table.LIST_ATTACHMENTS):
                return self._admin_read(token, instance, r, path, params)
            if r is table.LIST_RECORDS:
                return self._list_records(token, instance, path["store"], params)
            if r is table.SEARCH_RECORDS:
                return self._search(token, instance, path["store"], params)
            if r is table.GET_RECORD:
                return self._get_record(token, instance, path["store"], path["record_id"], params)
            if r is table.GET_VERSION and not params:
                n = _int(path["n"], 0, 2**63 - 1)
                if n is None:
                    return None
                return self._version(token, instance, path["store"], path["record_id"], n)
            if r is table.LIST_VERSIONS:
                return self._versions(token, instance, path["store"], path["record_id"], params,
                                      request.url.query.decode("ascii"))
        except _Plain:
            return None
        return None

    def _principal(self, token: str, instance: str | None) -> Any:
        p = self.service.authenticate_cached(token, instance)
        if p is None:
            raise _Plain()
        return p

    @staticmethod
    def _take(params: dict[str, str], allowed: set[str]) -> None:
        if not set(params) <= allowed:
            raise _Plain()

    @staticmethod
    def _bool(params: dict[str, str], name: str, default: bool) -> bool:
        if name not in params:
            return default
        v = _flag(params[name])
        if v is None:
            raise _Plain()
        return v

    @staticmethod
    def _bounded(params: dict[str, str], name: str, default: int, lo: int, hi: int) -> int:
        if name not in params:
            return default
        v = _int(params[name], lo, hi)
        if v is None:
            raise _Plain()
        return v

    def _admin_read(self, token: str, instance: str | None, r: table.Route, path: dict[str, str],
                    q: dict[str, str]) -> Callable[[], tuple[bytes, dict[str, str]]] | None:
        """``GET /v1/stores``, ``/v1/stores/{s}``, ``/v1/workspaces``,
        ``/v1/workspaces/{ws}/attachments`` (``store list``, ``attach``'s checks, ...)."""
        if q:
            return None
        svc = self.service
        fn: Callable[[Any], Any]
        if r is table.LIST_STORES:
            fn = lambda p: svc.list_stores(p)  # noqa: E731
        elif r is table.LIST_WORKSPACES:
            fn = lambda p: svc.list_workspaces(p)  # noqa: E731
        elif r is table.GET_STORE:
            fn = lambda p: svc.get_store(p, path["store"])  # noqa: E731
        else:
            fn = lambda p: svc.list_attachments(p, path["ws"])  # noqa: E731

        def call() -> tuple[bytes, dict[str, str]]:
            out = fn(self._principal(token, instance))
            if isinstance(out, list):
                return b"[" + b",".join(m.model_dump_json().encode() for m in out) + b"]", {}
            return out.model_dump_json().encode(), {}

        return call

    def _list_records(self, token: str, instance: str | None, slug: str,
                      q: dict[str, str]) -> Callable[[], tuple[bytes, dict[str, str]]]:
        self._take(q, {"cursor", "limit", "content", "path", "include_deleted"})
        kw: dict[str, Any]  # keyword arguments of the service call
        kw = dict(cursor=q.get("cursor"),
                  limit=self._bounded(q, "limit", defs.RECORDS_PAGE_DEFAULT, 1, defs.RECORDS_PAGE_MAX),
                  with_content=self._bool(q, "content", False), path=q.get("path"),
                  include_deleted=self._bool(q, "include_deleted", False))
        return lambda: (self.service.list_records_json(self._principal(token, instance), slug, **kw), {})

    def _get_record(self, token: str, instance: str | None, slug: str, rid: str,
                    q: dict[str, str]) -> Callable[[], tuple[bytes, dict[str, str]]]:
        self._take(q, {"content"})
        content = self._bool(q, "content", True)

        def call() -> tuple[bytes, dict[str, str]]:
            rec = self.service.get_record(self._principal(token, instance), slug, rid, with_content=content)
            return rec.model_dump_json().encode(), {"etag": f'"{rec.sha256}"'}

        return call

    def _version(self, token: str, instance: str | None, slug: str, rid: str,
                 n: int) -> Callable[[], tuple[bytes, dict[str, str]]]:
        return lambda: (self.service.get_version(self._principal(token, instance), slug, rid, n)
                        .model_dump_json().encode(), {})

    def _versions(self, token: str, instance: str | None, slug: str, rid: str, q: dict[str, str],
                  query: str) -> Callable[[], tuple[bytes, dict[str, str]]]:
        self._take(q, {"limit", "order", "cursor"})
        order = q.get("order", "asc")
        if order not in ("asc", "desc"):
            raise _Plain()
        limit = self._bounded(q, "limit", defs.VERSIONS_PAGE_DEFAULT, 1, defs.VERSIONS_PAGE_MAX)
        cursor = self._bounded(q, "cursor", -1, 0, defs.INT64_MAX)

        def call() -> tuple[bytes, dict[str, str]]:
            page = self.service.list_versions(self._principal(token, instance), slug, rid, limit=limit,
                                              cursor=None if cursor < 0 else cursor,
                                              newest_first=order == "desc")
            return page.body(), page.headers(query)

        return call

    def _search(self, token: str, instance: str | None, slug: str,
                q: dict[str, str]) -> Callable[[], tuple[bytes, dict[str, str]]]:
        self._take(q, {"q", "match", "prefix", "type", "case_sensitive", "cursor", "limit", "max_lines", "order"})
        text, match, prefix = q.get("q", ""), q.get("match", "any"), q.get("prefix", "")
        order = q.get("order", "path")
        if (not 1 <= len(text) <= defs.SEARCH_QUERY_MAX or match not in ("any", "path", "content")
                or len(prefix) > defs.SEARCH_PREFIX_MAX or order not in ("path", "relevance")):
            raise _Plain()
        kw: dict[str, Any]  # keyword arguments of the service call
        kw = dict(match=match, prefix=prefix, type=q.get("type"),
                  case_sensitive=self._bool(q, "case_sensitive", False), cursor=q.get("cursor"),
                  limit=self._bounded(q, "limit", defs.SEARCH_PAGE_DEFAULT, 1, defs.SEARCH_PAGE_MAX),
                  max_lines=self._bounded(q, "max_lines", defs.SEARCH_LINES_DEFAULT, 0,
                                          defs.SEARCH_LINES_MAX), order=order)
        return lambda: (self.service.search(self._principal(token, instance), slug, text, **kw)
                        .model_dump_json().encode(), {})
