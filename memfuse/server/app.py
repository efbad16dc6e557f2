"""HTTP layer of the reference control plane: the FastAPI app of docs/API.md.

Handlers are thin: authenticate, call ``Service``, turn the result into a response. Every
error is ``application/problem+json`` (RFC 9457) with memfuse's ``code``: refusals of the
service, request validation (422 ``validation_error``), unknown routes (404 ``not_found``),
a database that stays locked (503 ``unavailable``, ``Retry-After: 1``) and unexpected
exceptions (500 ``internal_error``, logged with the traceback).

Plain ``def`` handlers run in anyio's worker threads (fine under trio and asyncio); the
long-polls (``changes``, ``events`` with ``wait``) are ``async`` (``memfuse.server.longpoll``):
they read the database only when there may be something to read, in a worker thread, and
sleep without a session until a commit concerns them (this process's, or another replica's
through the commit bus of ``memfuse.server.wakeups``). Authentication is an ``async``
dependency: static and recently seen tokens resolve on the event loop, only an unknown token
costs a worker thread and a query.

In front of the app, ``memfuse.server.gate.Gate`` answers the probes and ``GET /metrics``,
authenticates and checks the size from the headers before any body byte is read, bounds the
time a body may take and the requests in flight (503 + ``Retry-After`` beyond), runs
long-lived responses under the caps of ``memfuse.server.streamclass`` (429), and bounds the
time a response may take to be read.

Responses are serialised once, by pydantic (``model_dump_json``), into plain ``Response``
objects: FastAPI neither validates nor re-encodes them against the ``response_model``
(which only documents the body in the OpenAPI schema).
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

import anyio
from fastapi import Depends, FastAPI, Header, Path, Query, Request, Security
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import Histogram
from pydantic import BaseModel, ValidationError
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from memfuse.models import (
    BATCH_MAX_BYTES,
    Account,
    AccountCreate,
    BatchRequest,
    BatchResponse,
    Attachment,
    AttachmentPut,
    ChangePage,
    ConsolidationCreate,
    ConsolidationJob,
    EventPage,
    MoveResult,
    PrefixMove,
    Problem,
    Record,
    RecordAttributes,
    SearchPage,
    IndexReport,
    RecordCreate,
    RecordMove,
    RecordPage,
    RecordUpdate,
    RecordAppend,
    Restore,
    Store,
    StoreCreate,
    StoreUpdate,
    TokenCreate,
    TokenCreated,
    TokenInfo,
    Version,
    Workspace,
    WorkspaceCreate,
)
from memfuse import defs
from memfuse.server import gate, limits, longpoll, proxies, streamclass, streams as streaming
from memfuse.server.apidocs import install_docs
from memfuse.server.base import REASONS
from memfuse.server.batch import batch_body
from memfuse.server.db import Database
from memfuse.server.service import (
    CONTEXT_MAX_BYTES_ENV,
    CONTEXT_MIN_BYTES,
    CONTEXT_TOTAL_MAX_BYTES,
    MAX_WAIT_SECONDS,
    IdempotencyRequest,
    Principal,
    Reply,
    Service,
    ServiceError,
    idempotency_request,
)

log = logging.getLogger(__name__)

PROBLEM_JSON = "application/problem+json"
_REASONS = REASONS
_PROBLEM_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": Problem, "description": "Refusal (RFC 9457 problem details)",
            "content": {PROBLEM_JSON: {}}},
    "5XX": {"model": Problem, "description": "Transient failure (RFC 9457 problem details)",
            "content": {PROBLEM_JSON: {}}},
}


def problem_response(
    status: int,
    code: str,
    detail: str = "",
    *,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> JSONResponse:
    """An ``application/problem+json`` response; ``extra`` become additional members. A lone
    surrogate in ``detail`` (echoed client input) becomes U+FFFD: the body is always UTF-8."""
    detail = detail.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    body = Problem(title=_REASONS.get(status, "Error"), status=status, detail=detail, code=code).model_dump()
    body.update(jsonable_encoder(extra))
    return JSONResponse(body, status_code=status, headers=headers, media_type=PROBLEM_JSON)


class _CatchAll:
    """Turns an exception no handler took into a logged 500 problem (when the response has
    not started), so clients always get problem+json and the server keeps serving."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_wrapper(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception:
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise
            await problem_response(500, "internal_error", "unexpected server error")(scope, receive, send)


# Seconds; Prometheus' default buckets plus the long tail of a busy database.
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0)
_STREAM_TYPES = (b"text/event-stream", streaming.NDJSON)


def route_template(scope: Scope, root_path: str = "") -> str:
    """The route template a routed request matched (``/v1/stores/{store}/records/{record_id}``,
    ``/ui/stores/{store}``), from the ``route`` Starlette leaves in ``scope``; ``"unmatched"``
    when none did (an unknown path must not make a new time series)."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    if not path:
        return "unmatched"
    mounted = str(scope.get("root_path", ""))[len(root_path):]
    if isinstance(route, Mount):  # a mounted app without routes of its own (static files)
        return mounted + "/{path}"
    return (mounted + path) or "/"


class _Timing:
    """ASGI middleware: ``http_request_duration_seconds{route, method, status}``, a histogram of
    the time from a request's arrival in the app to its last response byte, by route template
    (``route_template``) and status. Streamed responses (server-sent events, NDJSON change
    streams) are left out: their duration is how long a client listened."""

    def __init__(self, app: ASGIApp, histogram) -> None:
        self.app = app
        self.histogram = histogram

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        root_path = str(scope.get("root_path", ""))
        status = 500
        streamed = False
        done = False

        def observe() -> None:
            nonlocal done
            if not done and not streamed:
                done = True
                self.histogram.labels(route_template(scope, root_path), scope.get("method", ""),
                                      str(status)).observe(time.perf_counter() - start)

        async def send_wrapper(message: Message) -> None:
            nonlocal status, streamed
            if message["type"] == "http.response.start":
                status = message["status"]
                ctype = next((v for k, v in message.get("headers", ()) if k.lower() == b"content-type"), b"")
                streamed = ctype.split(b";")[0].strip() in _STREAM_TYPES
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                observe()

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            observe()


def _reply(r: Reply) -> Response:
    headers = dict(r.headers)
    if r.replayed:
        headers["Idempotent-Replayed"] = "true"
    if r.status == 204 or not r.body:
        return Response(status_code=r.status, headers=headers)
    return Response(content=r.body, status_code=r.status, headers=headers, media_type="application/json")


def _json(model: BaseModel | list[BaseModel], *, etag: str | None = None) -> Response:
    """A 200 JSON response of a wire model (or a list of them), serialised by pydantic."""
    headers = {"ETag": f'"{etag}"'} if etag else None
    if isinstance(model, list):
        body = b"[" + b",".join(m.model_dump_json().encode() for m in model) + b"]"
    else:
        body = model.model_dump_json().encode()
    return Response(content=body, headers=headers, media_type="application/json")

_bearer = HTTPBearer(auto_error=False, description="workspace or admin token")


def _service(request: Request) -> Service:
    return request.app.state.service


async def _principal(
    request: Request,
    cred: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)],
    x_memfuse_instance: Annotated[str | None, Header(description="sidecar id, recorded in actor")] = None,
) -> Principal:
    svc = _service(request)
    p = request.scope.get("memfuse.principal")  # the front door's (memfuse.server.gate)
    if p is None:
        token = cred.credentials if cred else None
        p = svc.authenticate_cached(token, x_memfuse_instance)  # no database, no thread
        if p is None:
            p = await anyio.to_thread.run_sync(svc.authenticate, token, x_memfuse_instance)
    if svc.token_upkeep_due():  # token bookkeeping: a few statements a minute (tokens.py)
        await anyio.to_thread.run_sync(svc.token_upkeep)
    account = requested_account(request)
    if account:  # the root admin acting in one account (docs/API.md "Accounts")
        p = await anyio.to_thread.run_sync(svc.act_in_account, p, account)
    return p


def requested_account(request: Request) -> str | None:
    """The account a request names: the ``X-Memfuse-Account`` header, else the ``account``
    query parameter (for links and the console), else None."""
    return request.headers.get("x-memfuse-account") or request.query_params.get("account") or None


async def _idempotency(
    request: Request,
    idempotency_key: Annotated[str | None, Header(max_length=255)] = None,
) -> IdempotencyRequest | None:
    if not idempotency_key:
        return None
    body = await request.body()
    return idempotency_request(idempotency_key, request.method, request.url.path, body)


P = Annotated[Principal, Depends(_principal)]
Idem = Annotated[IdempotencyRequest | None, Depends(_idempotency)]
IfMatch = Annotated[str | None, Header(description='"<sha256>" of the version the change is based on, or *')]
StoreSlug = Annotated[str, Path(description="store slug")]
AccountSlug = Annotated[str, Path(description="account slug")]
VersionNumber = Annotated[int, Path(ge=1, le=defs.INT64_MAX, description="version number (1, 2, ...)")]
After = Annotated[int, Query(ge=0, le=defs.INT64_MAX, description="feed position to read after (a page's seq)")]
Wait = Annotated[float, Query(ge=0, description="long-poll seconds (capped at 60)")]


def create_app(
    db_url: str,
    *,
    static_tokens: dict[str, str | None] | None = None,
    context_max_bytes: int | None = None,
    schema: str = "migrate",
    faces: bool = True,
    max_inflight: int = gate.MAX_INFLIGHT,
    max_long_polls: int = streamclass.MAX_STREAMS,
    max_long_polls_per_token: int = streamclass.MAX_STREAMS_PER_TOKEN,
    send_timeout: float = gate.SEND_TIMEOUT,
    max_body: int = gate.MAX_BODY,
    body_timeout: float = gate.BODY_TIMEOUT,
    receive_timeout: float = gate.RECEIVE_TIMEOUT,
    header_timeout: float = gate.HEADER_TIMEOUT,
    max_unauthenticated_per_address: int = gate.MAX_UNAUTHENTICATED_PER_ADDRESS,
    streams: bool = True,
    stream_heartbeat: float = streaming.HEARTBEAT_SECONDS,
    stream_lifetime: float = streaming.LIFETIME_SECONDS,
    trusted_proxies: tuple[str, ...] | list[str] = (),
    write_rate: gate.WriteRate | None = None,
) -> FastAPI:
    """Build the control-plane app over the database at ``db_url``.

    ``db_url``: ``sqlite:///PATH``, ``sqlite://`` (in memory) or a PostgreSQL URL.
    ``static_tokens``: raw token → workspace name, or None for admin; the dict is consulted
    on every request (tokens may be added later). ``app.state.service`` is the ``Service``.
    ``context_max_bytes``: default bound of the prompt block (``GET .../context``); when
    None, ``$MEMFUSE_CONTEXT_MAX_BYTES`` or 100,000.
    ``schema``: ``"migrate"`` (upgrade the database to the newest revision first) or
    ``"check"`` (refuse a database behind it), see ``memfuse.server.db.Database``.
    ``max_inflight`` (ordinary requests in the app at once), ``max_long_polls`` and
    ``max_long_polls_per_token`` (long-lived responses: long-polls, streams, console live
    pages, per replica and per token), ``send_timeout`` (s a send to a client may take),
    ``max_body`` (bytes of a record write's, batch's, memory-tool call's or console form's
    body), ``body_timeout`` / ``receive_timeout`` (s for a whole body / between two pieces of
    it), ``header_timeout`` (s for a request's headers; ``memfuse.server.serve`` applies it),
    ``max_unauthenticated_per_address`` (connections without a valid token yet, per client
    address; 0: no cap; applied by ``memfuse.server.serve``): the limits of the front door
    (``memfuse.server.gate``; ``app.front``) and of ``memfuse.server.streamclass``
    (``app.state.stream_class``). ``write_rate``: the per-token write buckets (``gate.WriteRate``, default
    ``gate.WriteRate()``). ``app.state.metrics`` is the ``ServerMetrics``.
    ``streams``: serve ``stream=true`` on the change feed and the workspace events
    (``memfuse.server.streams``); False answers it as a server without streams would (a
    long-poll, or the plain page), which clients handle by long-polling.
    ``stream_heartbeat`` (s between heartbeat lines) and ``stream_lifetime`` (s a stream
    lives, ± 10 %): see ``memfuse.server.streams``; ``app.state.streams`` is the ``Streams``.
    Raises ``sqlalchemy.exc.ArgumentError`` for a bad URL, ``OperationalError`` when the
    database cannot be opened, ``ValueError`` for a bad ``$MEMFUSE_CONTEXT_MAX_BYTES``,
    ``memfuse.server.schema.SchemaBehind`` when ``schema="check"`` finds it behind.
    ``trusted_proxies``: addresses or CIDR blocks whose ``X-Forwarded-Proto`` is believed
    (``memfuse.server.proxies``; ``ValueError`` for a bad one): a request through them that
    the proxy says came over TLS gets the console's ``Secure`` ``__Host-`` session cookie.
    ``faces``: also serve the web console (``/ui/``) and the agent-tool faces (the
    memory-tool endpoint, ``/mcp``). The CLI's local mode leaves them out: it calls only the
    v1 API in-process, and importing the MCP SDK and the templates would add seconds to the
    start of every command on a loaded machine.
    """
    if context_max_bytes is None:
        env = os.environ.get(CONTEXT_MAX_BYTES_ENV, "").strip()
        context_max_bytes = int(env) if env else CONTEXT_TOTAL_MAX_BYTES
    if context_max_bytes < CONTEXT_MIN_BYTES:
        raise ValueError(f"context_max_bytes must be at least {CONTEXT_MIN_BYTES}")
    trusted = proxies.parse_trusted(trusted_proxies)
    metrics = limits.ServerMetrics()
    db = Database(db_url, schema=schema)
    metrics.count_statements(db.engine)
    svc = Service(db, static_tokens, context_max_bytes=context_max_bytes)
    reads = longpoll.FeedReads(svc)
    open_streams = streaming.Streams(svc, heartbeat=stream_heartbeat, lifetime=stream_lifetime,
                                     enabled=streams)
    stream_class = streamclass.StreamClass(svc, per_replica=max_long_polls, per_token=max_long_polls_per_token)
    metrics.add_collector(limits.notifier_collector(svc.notifier, svc.bus, open_streams))
    from memfuse.server import history
    metrics.add_collector(history.collector())
    app = _App(
        title="memfuse control plane",
        version="1",
        description="Long-term memory for AI agents, served as files (see docs/API.md).",
        responses=_PROBLEM_RESPONSES,
        docs_url=None,  # served by apidocs.install_docs, every asset from this server
        redoc_url=None,
    )
    install_docs(app)
    app.state.service = svc
    app.state.metrics = metrics
    app.state.feed_reads = reads
    app.state.streams = open_streams
    app.state.stream_class = stream_class
    _install_error_handlers(app)
    app.add_middleware(_CatchAll)
    app.add_middleware(_Timing, histogram=Histogram(
        "http_request_duration_seconds", "Time from a request's arrival in the app to its last "
        "response byte, by route template, method and status (streams left out)",
        ["route", "method", "status"], buckets=REQUEST_BUCKETS, registry=metrics.registry))
    _process_collectors(metrics.registry)
    app.state.trusted_proxies = trusted
    if trusted:
        app.add_middleware(proxies.TrustedProxyScheme, trusted=trusted)
    app.front = gate.Gate(
        app.serve_fastapi, svc, metrics, stream_class, max_inflight=max_inflight,
        send_timeout=send_timeout, max_body=max_body, body_timeout=body_timeout,
        receive_timeout=receive_timeout, header_timeout=header_timeout,
        max_unauthenticated_per_address=max_unauthenticated_per_address,
        write_rate=write_rate,
        fast=longpoll.FastPath(svc, reads, _exception_response, open_streams),
    )
    metrics.add_collector(limits.front_collector(app.front, stream_class))

    if faces:
        from memfuse.server.console import install_console

        install_console(app)  # the web console at /ui/ (memfuse/server/console/)

    # /healthz, /readyz and /metrics are answered by the front door (memfuse.server.gate),
    # before any limit: they never queue behind API traffic

    # ------------------------------------------------------------ accounts

    @app.post("/v1/accounts", status_code=201, response_model=Account, tags=["accounts"])
    def create_account(body: AccountCreate, p: P, idem: Idem):
        return _reply(svc.create_account(p, body, idem))

    @app.get("/v1/accounts", response_model=list[Account], tags=["accounts"])
    def list_accounts(p: P):
        return _json(svc.list_accounts(p))

    @app.get("/v1/accounts/{account}", response_model=Account, tags=["accounts"])
    def get_account(account: AccountSlug, p: P):
        return _json(svc.get_account(p, account))

    @app.delete("/v1/accounts/{account}", status_code=204, tags=["accounts"])
    def delete_account(account: AccountSlug, p: P, idem: Idem):
        return _reply(svc.delete_account(p, account, idem))

    @app.put("/v1/accounts/{account}/attachments/{store}", response_model=Attachment, tags=["accounts"])
    def put_account_attachment(account: AccountSlug, store: StoreSlug, body: AttachmentPut, p: P, idem: Idem):
        return _reply(svc.put_account_attachment(p, account, store, body, idem))

    @app.delete("/v1/accounts/{account}/attachments/{store}", status_code=204, tags=["accounts"])
    def delete_account_attachment(account: AccountSlug, store: StoreSlug, p: P, idem: Idem):
        return _reply(svc.delete_account_attachment(p, account, store, idem))

    # ------------------------------------------------------------ admin

    @app.post("/v1/workspaces", status_code=201, response_model=Workspace, tags=["admin"])
    def create_workspace(body: WorkspaceCreate, p: P, idem: Idem):
        return _reply(svc.create_workspace(p, body, idem))

    @app.get("/v1/workspaces", response_model=list[Workspace], tags=["admin"])
    def list_workspaces(p: P):
        return _json(svc.list_workspaces(p))

    @app.post("/v1/stores", status_code=201, response_model=Store, tags=["admin"])
    def create_store(body: StoreCreate, p: P, idem: Idem):
        return _reply(svc.create_store(p, body, idem))

    @app.get("/v1/stores", response_model=list[Store], tags=["admin"])
    def list_stores(p: P):
        return _json(svc.list_stores(p))

    @app.get("/v1/stores/{store}", response_model=Store, tags=["admin"])
    def get_store(store: StoreSlug, p: P):
        return _json(svc.get_store(p, store))

    @app.patch("/v1/stores/{store}", response_model=Store, tags=["admin"])
    def update_store(store: StoreSlug, body: StoreUpdate, p: P, idem: Idem):
        return _reply(svc.update_store(p, store, body, idem))

    @app.put("/v1/workspaces/{ws}/attachments/{store}", response_model=Attachment, tags=["admin"])
    def put_attachment(ws: str, store: StoreSlug, body: AttachmentPut, p: P, idem: Idem):
        return _reply(svc.put_attachment(p, ws, store, body, idem))

    @app.delete("/v1/workspaces/{ws}/attachments/{store}", status_code=204, tags=["admin"])
    def delete_attachment(ws: str, store: StoreSlug, p: P, idem: Idem):
        return _reply(svc.delete_attachment(p, ws, store, idem))

    @app.post("/v1/tokens", status_code=201, response_model=TokenCreated, tags=["admin"])
    def create_token(body: TokenCreate, p: P, idem: Idem):
        return _reply(svc.create_token(p, body, idem))

    @app.get("/v1/tokens", response_model=list[TokenInfo], tags=["admin"])
    def list_tokens(p: P, workspace: str | None = None, include_revoked: bool = False):
        return _json(svc.list_tokens(p, workspace, include_revoked))

    @app.delete("/v1/tokens/{token_id}", status_code=204, tags=["admin"])
    def revoke_token(token_id: str, p: P, idem: Idem):
        return _reply(svc.revoke_token(p, token_id, idem))

    # ------------------------------------------------------------ workspace

    @app.get("/v1/workspaces/{ws}/attachments", response_model=list[Attachment], tags=["workspace"])
    def list_attachments(ws: str, p: P):
        return _json(svc.list_attachments(p, ws))

    @app.get("/v1/workspaces/{ws}/events", response_model=EventPage, tags=["workspace"])
    async def events(
        request: Request,
        ws: str,
        p: P,
        after: After = 0,
        wait: Wait = 0,
        limit: Annotated[int, Query(ge=1, le=1000)] = 1000,
        stream: Annotated[bool, Query(description="answer an NDJSON stream of pages (docs/API.md)")] = False,
    ):
        if stream and open_streams.enabled:
            return _StreamResponse(await open_streams.events(p, ws, after, limit=limit))
        if wait <= 0:
            return _json(await anyio.to_thread.run_sync(lambda: svc.events_page(p, ws, after, limit)))
        return await longpoll.events(svc, request, p, ws, after, wait, limit=limit)

    @app.get(
        "/v1/workspaces/{ws}/context",
        response_class=PlainTextResponse,
        responses={200: {"content": {"text/markdown": {}}, "description": "the prompt block"}},
        tags=["workspace"],
    )
    def context(
        ws: str,
        p: P,
        mount_root: Annotated[
            str | None,
            Query(description="where the sidecar mounts the stores (default: the server's, "
                              "/mnt/memory, or the mountpoint under memfuse dev)"),
        ] = None,
        max_bytes: Annotated[
            int | None,
            Query(ge=CONTEXT_MIN_BYTES, le=10_000_000,
                  description="bound of the whole block in bytes (default: the server's setting)"),
        ] = None,
        mounted: Annotated[
            bool,
            Query(description="false: for an agent without a mount (memory tool, MCP): leave out "
                              "the line on the mount's .memfuse/errors.log"),
        ] = True,
    ):
        text = svc.context(p, ws, mount_root or svc.mount_root, max_bytes, mounted=mounted)
        return PlainTextResponse(text, media_type="text/markdown; charset=utf-8")

    # ------------------------------------------------------------ records

    @app.get("/v1/stores/{store}/records", response_model=RecordPage, tags=["records"])
    def list_records(
        store: StoreSlug,
        p: P,
        cursor: str | None = None,
        limit: Annotated[int, Query(ge=1, le=defs.RECORDS_PAGE_MAX)] = defs.RECORDS_PAGE_DEFAULT,
        content: bool = False,
        path: str | None = None,
        include_deleted: bool = False,
    ):
        body = svc.list_records_json(  # the RecordPage's JSON, without pydantic per record
            p, store, cursor=cursor, limit=limit, with_content=content, path=path,
            include_deleted=include_deleted,
        )
        return Response(content=body, media_type="application/json")

    @app.get("/v1/stores/{store}/search", response_model=SearchPage, tags=["records"])
    def search_records(
        store: StoreSlug,
        p: P,
        q: Annotated[str, Query(min_length=1, max_length=defs.SEARCH_QUERY_MAX,
                                description="literal text (one line) to find")],
        match: Annotated[Literal["any", "path", "content"], Query(
            description="where to look: the path, the content, or either")] = "any",
        prefix: Annotated[str, Query(max_length=defs.SEARCH_PREFIX_MAX, description=(
            "only the record at this path or under this directory"))] = "",
        type: Annotated[str | None, Query(description="only records of this type")] = None,
        case_sensitive: bool = False,
        cursor: str | None = None,
        limit: Annotated[int, Query(ge=1, le=defs.SEARCH_PAGE_MAX,
                                    description="records read for this page")] = defs.SEARCH_PAGE_DEFAULT,
        max_lines: Annotated[int, Query(ge=0, le=defs.SEARCH_LINES_MAX,
                                        description="matching lines shown per record")] = defs.SEARCH_LINES_DEFAULT,
        order: Annotated[Literal["path", "relevance"], Query(description=(
            "path: substring search in path order (grep); relevance: every word of q in the "
            "full-text index, best first, with score and snippet"))] = "path",
    ):
        """Live records whose path and / or content hold ``q`` (docs/API.md, "Search")."""
        return _json(svc.search(p, store, q, match=match, prefix=prefix, type=type,
                                case_sensitive=case_sensitive, cursor=cursor, limit=limit,
                                max_lines=max_lines, order=order))

    @app.get("/v1/stores/{store}/index", response_model=IndexReport, tags=["records"])
    def index_report(store: StoreSlug, p: P):
        """How the store's ``MEMORY.md`` and its records agree (docs/API.md, "Index report")."""
        return _json(svc.index_report(p, store))

    @app.post("/v1/stores/{store}/consolidations", status_code=202, response_model=ConsolidationJob,
              tags=["consolidations"])
    def create_consolidation(store: StoreSlug, body: ConsolidationCreate, p: P):
        """Start a consolidation job on the store (docs/API.md, "Consolidation jobs"): 202
        with the job, ``Location`` its URL."""
        job = svc.create_consolidation(p, store, body)
        return Response(content=job.model_dump_json(), status_code=202, media_type="application/json",
                        headers={"Location": f"/v1/consolidations/{job.id}"})

    @app.get("/v1/stores/{store}/consolidations", response_model=list[ConsolidationJob], tags=["consolidations"])
    def list_consolidations(
        store: StoreSlug, p: P,
        limit: Annotated[int, Query(ge=1, le=1000, description="jobs to list at most")] = 100,
    ):
        """The store's consolidation jobs, newest first."""
        return _json(svc.list_consolidations(p, store, limit))

    @app.get("/v1/consolidations/{job_id}", response_model=ConsolidationJob, tags=["consolidations"])
    def get_consolidation(job_id: Annotated[str, Path(max_length=64)], p: P):
        """One consolidation job."""
        return _json(svc.get_consolidation(p, job_id))

    @app.post("/v1/consolidations/{job_id}/cancel", response_model=ConsolidationJob, tags=["consolidations"])
    def cancel_consolidation(job_id: Annotated[str, Path(max_length=64)], p: P):
        """Cancel a pending or running job: it writes nothing (409 ``job_finished`` once ended)."""
        return _json(svc.cancel_consolidation(p, job_id))

    @app.post("/v1/stores/{store}/records", status_code=201, response_model=Record, tags=["records"])
    def create_record(store: StoreSlug, body: RecordCreate, p: P, idem: Idem):
        return _reply(svc.create_record(p, store, body, idem))

    @app.get("/v1/stores/{store}/records/{record_id}", response_model=Record, tags=["records"])
    def get_record(store: StoreSlug, record_id: str, p: P, content: bool = True):
        rec = svc.get_record(p, store, record_id, with_content=content)
        return _json(rec, etag=rec.sha256)

    @app.put("/v1/stores/{store}/records/{record_id}", response_model=Record, tags=["records"])
    def update_record(store: StoreSlug, record_id: str, body: RecordUpdate, p: P, idem: Idem, if_match: IfMatch = None):
        return _reply(svc.update_record(p, store, record_id, body, if_match, idem))

    @app.post("/v1/stores/{store}/records/{record_id}/append", response_model=Record, tags=["records"])
    def append_record(store: StoreSlug, record_id: str, body: RecordAppend, p: P, idem: Idem,
                      if_match: IfMatch = None):
        return _reply(svc.append_record(p, store, record_id, body, if_match, idem))

    @app.patch("/v1/stores/{store}/records/{record_id}", response_model=Record, tags=["records"])
    def set_record_attributes(
        store: StoreSlug, record_id: str, body: RecordAttributes, p: P, idem: Idem, if_match: IfMatch = None
    ):
        return _reply(svc.set_attributes(p, store, record_id, body, if_match, idem))

    @app.post("/v1/stores/{store}/records/{record_id}/move", response_model=MoveResult, tags=["records"])
    def move_record(store: StoreSlug, record_id: str, body: RecordMove, p: P, idem: Idem, if_match: IfMatch = None):
        return _reply(svc.move_record(p, store, record_id, body, if_match, idem))

    @app.post("/v1/stores/{store}/move", response_model=MoveResult, tags=["records"])
    def move_prefix(store: StoreSlug, body: PrefixMove, p: P, idem: Idem):
        return _reply(svc.move_prefix(p, store, body, idem))

    @app.delete("/v1/stores/{store}/records/{record_id}", status_code=204, tags=["records"])
    def delete_record(store: StoreSlug, record_id: str, p: P, idem: Idem, if_match: IfMatch = None):
        return _reply(svc.delete_record(p, store, record_id, if_match, idem))

    @app.post(
        "/v1/stores/{store}/batch", response_model=BatchResponse, tags=["records"],
        openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/BatchRequest"}}}}},
    )
    async def batch(request: Request, store: StoreSlug, p: P):
        """Up to 100 record writes to one store in one transaction, each answered as alone
        (docs/API.md, "Batch")."""
        if request.headers.get("idempotency-key"):
            raise ServiceError(422, "validation_error",
                               "a batch takes no Idempotency-Key: give each operation its own idempotency_key")
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > BATCH_MAX_BYTES:
                raise ServiceError(413, "batch_too_large", f"a batch body holds at most {BATCH_MAX_BYTES} bytes")
        try:  # json.loads, as FastAPI parses the single endpoints' bodies (lone surrogates
            # reach the content rules and become that operation's 422 invalid_content)
            req = BatchRequest.model_validate(json.loads(raw))
        except ValueError as err:
            errors = err.errors(include_input=False) if isinstance(err, ValidationError) else [
                {"loc": ["body"], "msg": f"invalid JSON: {err}", "type": "json_invalid"}]
            raise RequestValidationError(errors) from None
        replies = await anyio.to_thread.run_sync(svc.batch, p, store, req.operations)
        return Response(content=batch_body(replies), media_type="application/json")

    @app.get("/v1/stores/{store}/records/{record_id}/versions", response_model=list[Version], tags=["records"])
    def list_versions(store: StoreSlug, record_id: str, p: P):
        return _json(svc.list_versions(p, store, record_id))

    @app.get("/v1/stores/{store}/records/{record_id}/versions/{n}", response_model=Version, tags=["records"])
    def get_version(store: StoreSlug, record_id: str, n: VersionNumber, p: P):
        return _json(svc.get_version(p, store, record_id, n))

    @app.post("/v1/stores/{store}/records/{record_id}/restore", response_model=Record, tags=["records"])
    def restore_record(store: StoreSlug, record_id: str, body: Restore, p: P, idem: Idem):
        return _reply(svc.restore_record(p, store, record_id, body, idem))

    @app.post(
        "/v1/stores/{store}/records/{record_id}/versions/{n}/redact", response_model=Version, tags=["records"]
    )
    def redact_version(store: StoreSlug, record_id: str, n: VersionNumber, p: P, idem: Idem):
        return _reply(svc.redact_version(p, store, record_id, n, idem))

    @app.get("/v1/stores/{store}/changes", response_model=ChangePage, tags=["records"])
    async def changes(
        request: Request,
        store: StoreSlug,
        p: P,
        after: After = 0,
        wait: Wait = 0,
        content: bool = True,
        limit: Annotated[int, Query(ge=1, le=1000)] = 1000,
        skip_actor: Annotated[
            str | None,
            Query(description="leave out versions whose actor is exactly this "
                  "(a sidecar's own writes); seq still moves past them and a long-poll keeps waiting"),
        ] = None,
        stream: Annotated[bool, Query(description="answer an NDJSON stream of pages (docs/API.md)")] = False,
    ):
        skip = skip_actor or None
        if stream and open_streams.enabled:
            return _StreamResponse(await open_streams.changes(
                reads, p, store, after, limit=limit, content=content, skip_actor=skip))
        if wait <= 0:
            return _json(await anyio.to_thread.run_sync(
                lambda: svc.changes_page(p, store, after, limit=limit, with_content=content, skip_actor=skip)))
        return await longpoll.changes(svc, reads, request, p, store, after, wait, limit=limit, content=content,
                                      skip_actor=skip)

    def openapi() -> dict[str, Any]:
        """FastAPI's document plus the schemas of the batch body (read by the handler itself,
        so FastAPI does not know them), with integer bounds as integers: FastAPI's OpenAPI
        models hold ``minimum`` / ``maximum`` as floats, which turns ``le=2**63 - 1`` into
        ``9.223372036854776e18`` (2**63, one more than the server takes)."""
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            defs = BatchRequest.model_json_schema(ref_template="#/components/schemas/{model}")
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, d in defs.pop("$defs", {}).items():
                comps.setdefault(name, d)
            comps["BatchRequest"] = defs
            _integer_bounds(schema)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    from memfuse.server import anthropic_api

    anthropic_api.install(app, svc)  # Anthropic's memory-store API, /v1/memory_stores (docs/ANTHROPIC-API.md)

    if faces:
        from memfuse.server import agent_tools

        agent_tools.install(app, svc, _principal)
    return app


class _StreamResponse(Response):
    """A response that runs an opened stream (``memfuse.server.streams``)."""

    def __init__(self, run: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        super().__init__(media_type=streaming.NDJSON.decode())
        self._run = run

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._run(scope, receive, send)


class _App(FastAPI):
    """FastAPI behind the control plane's front door (``front``: backpressure, ``/metrics``,
    and the long-polls served without FastAPI's per-request machinery, see
    ``memfuse.server.longpoll.FastPath``); everything else is FastAPI as usual."""

    front: Any = None
    _openapi_bytes: bytes | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.front is not None and scope["type"] == "http":
            await self.front(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)

    def openapi_bytes(self) -> bytes:
        """The OpenAPI document (``/openapi.json``) as JSON bytes, built once: the routes do
        not change after ``create_app``, and encoding the ~100 KB document per request let
        a client pipelining requests for it keep the event loop busy."""
        if self._openapi_bytes is None:
            self._openapi_bytes = json.dumps(self.openapi(), ensure_ascii=False,
                                             separators=(",", ":")).encode("utf-8")
        return self._openapi_bytes

    async def serve_fastapi(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The request as plain FastAPI serves it (``/openapi.json`` from cached bytes)."""
        if (scope["type"] == "http" and scope["path"] == self.openapi_url
                and scope["method"] in ("GET", "HEAD")):
            body = self.openapi_bytes()
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"cache-control", b"no-cache")]})
            await send({"type": "http.response.body",
                        "body": body if scope["method"] == "GET" else b""})
            return
        await super().__call__(scope, receive, send)


def _process_collectors(registry) -> None:
    """Register prometheus-client's process collectors (``process_*``: CPU seconds, resident
    and virtual memory, open file descriptors, start time; ``python_gc_*``; ``python_info``)
    on ``registry``."""
    from prometheus_client import ProcessCollector
    from prometheus_client.gc_collector import GCCollector
    from prometheus_client.platform_collector import PlatformCollector

    ProcessCollector(registry=registry)
    GCCollector(registry=registry)
    PlatformCollector(registry=registry)


def _integer_bounds(node: Any) -> None:
    """In an OpenAPI document (in place): the ``minimum`` / ``maximum`` /
    ``exclusiveMinimum`` / ``exclusiveMaximum`` of every ``"type": "integer"`` schema as an
    integer in the signed 64-bit range (a float bound of 2**63 is the float of 2**63 - 1)."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                v = node.get(key)
                if isinstance(v, float) and v == v and abs(v) != float("inf"):
                    node[key] = max(-defs.INT64_MAX - 1, min(int(v), defs.INT64_MAX))
        for v in node.values():
            _integer_bounds(v)
    elif isinstance(node, list):
        for v in node:
            _integer_bounds(v)


def _exception_response(exc: Exception, scope: Scope) -> Response:
    """What the app's exception handlers answer for ``exc`` (for the long-poll fast path)."""
    if isinstance(exc, ServiceError):
        if exc.status >= 500:
            log.warning("%s %s: %s %s", scope.get("method"), scope.get("path"), exc.status, exc.code)
        return problem_response(exc.status, exc.code, exc.detail, headers=exc.headers, **exc.extra)
    if isinstance(exc, OperationalError):
        log.error("database error on %s %s", scope.get("method"), scope.get("path"), exc_info=exc)
        return problem_response(503, "unavailable", "database error; retry", headers={"Retry-After": "1"})
    log.error("unhandled error in %s %s", scope.get("method"), scope.get("path"), exc_info=exc)
    return problem_response(500, "internal_error", "unexpected server error")


def _install_error_handlers(app: FastAPI) -> None:
    async def on_service_error(request: Request, exc: ServiceError) -> Response:
        if exc.status >= 500:
            log.warning("%s %s: %s %s", request.method, request.url.path, exc.status, exc.code)
        return problem_response(exc.status, exc.code, exc.detail, headers=exc.headers, **exc.extra)

    async def on_validation_error(request: Request, exc: RequestValidationError) -> Response:
        errors = [
            {"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
            for e in exc.errors()
        ]
        detail = "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in errors)
        return problem_response(422, "validation_error", detail, errors=errors)

    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        detail = exc.detail if isinstance(exc.detail, str) else ""
        if exc.status_code == 404 and detail == "Not Found":
            detail = f"no route for {request.method} {request.url.path}"
        return problem_response(exc.status_code, code, detail, headers=getattr(exc, "headers", None))

    async def on_db_error(request: Request, exc: OperationalError) -> Response:
        text = str(exc.orig).lower() if exc.orig is not None else ""
        if "locked" in text or "busy" in text:
            log.warning("database busy on %s %s", request.method, request.url.path)
            return problem_response(503, "unavailable", "the database is busy; retry", headers={"Retry-After": "1"})
        log.error("database error on %s %s", request.method, request.url.path, exc_info=exc)
        return problem_response(503, "unavailable", "database error; retry", headers={"Retry-After": "1"})

    handlers: dict[type[Exception], Callable[[Request, Any], Awaitable[Response]]] = {
        ServiceError: on_service_error,
        RequestValidationError: on_validation_error,
        StarletteHTTPException: on_http_error,
        OperationalError: on_db_error,
    }
    for exc_type, handler in handlers.items():
        app.add_exception_handler(exc_type, handler)
