"""The record-write fast path: ``POST /v1/stores/{store}/records`` (create),
``PUT /v1/stores/{store}/records/{record_id}`` (update), ``POST
/v1/stores/{store}/records/{record_id}/append`` (append: the sidecar's ``echo line >> f``) and
``POST /v1/stores/{store}/batch`` (the sidecar's outbox sends overlapping closes as one batch)
served straight from ASGI, under the front door (``memfuse.server.gate``), without FastAPI's
routing, middleware stack, dependency resolution and body handling (bench/README.md, "The
close path": they were about a quarter of ``memfuse serve``'s CPU per created file; "The
close path, session 22: appends on the lean path").

``WritePath`` answers only a request it can answer *exactly* as FastAPI would: a well-formed
JSON body (``Content-Type: application/json``) that the route's pydantic model accepts, the
caller authenticated by the front door, no account named (``X-Memfuse-Account`` or any query
string), each header it reads given at most once and within FastAPI's bounds. Anything else
returns False having sent nothing, and FastAPI serves the request with the same handlers, so
every refusal of the request's shape (422 ``validation_error`` with FastAPI's error list, a
content type FastAPI does not read as JSON) is FastAPI's own. What it serves is the same
``Service`` call as the FastAPI handler (``Service.create_record`` / ``update_record`` /
``append_record`` / ``batch``), in a worker thread as the FastAPI handler runs it (``hop``: on
SQLite the one writer thread of ``memfuse.server.writerthread``; a large content's or append's
secret scan runs before it, ``memfuse.server.prescan``), and the same response:
``reply_head`` (status, ``ETag``, ``Idempotent-Replayed``: ``reply_response``'s) or the batch's
``batch_body``, refusals rendered by ``problems.exception_response``
as the app's exception handlers render them. The request-duration histogram
(``http_request_duration_seconds``) and the front door's counters see it as they see a
FastAPI-served request. When the HTTP server offers ``gate.EARLY`` (the lean path), a create's,
update's or append's answer leaves from the write's thread as its transaction commits
(``base.EARLY_ANSWER``: framed by the same ``reply_head``); the sends after the hop then only
finish it (bench/README.md, "The close path, session 16: serve").
"""
from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from prometheus_client import Histogram
from pydantic import BaseModel
from starlette.datastructures import URL
from starlette.responses import Response
from starlette.types import Scope, Send

from memfuse.models import BatchRequest, RecordAppend, RecordCreate, RecordUpdate
from memfuse.server import routetable as table
from memfuse.server.prescan import prescanned
from memfuse.server.base import EARLY_ANSWER, parse_json, parse_json_exact
from memfuse.server.batch import batch_body
from memfuse.server.records import check_append_if_match
from memfuse.server.gate import EARLY
from memfuse.server.routes import records as record_routes
from memfuse.server.routes.deps import reply_head
from memfuse.server.service import Principal, Reply, Service, idempotency_request

log = logging.getLogger(__name__)

IDEMPOTENCY_KEY_MAX = 255  # the Idempotency-Key header's bound (routes.deps.get_idempotency)
_JSON = b"application/json"
ROUTE = "memfuse.route"  # the scope's key of the route matched by the HTTP server (``lean_route``)
# the request headers the fast path reads; any of them twice: FastAPI decides
_READ = frozenset({b"content-type", b"idempotency-key", b"if-match", b"x-memfuse-account"})


class WritePath:
    """``await writes(scope, body, send)``: True when it answered the request (``body``: the
    whole request body, read by the front door), False having sent nothing when FastAPI must
    (see the module docstring). ``problem(exc, scope)`` renders an exception as the app's
    handlers do (``problems.exception_response``); ``histogram`` is the app's request-duration
    histogram (labels route template, method, status). ``hop(fn, *args)`` runs a write's
    ``Service`` call off the event loop and returns its result (default
    ``anyio.to_thread.run_sync``; ``memfuse.server.writerthread.WriterThread.run`` for a
    database whose writes are serial anyway)."""

    def __init__(self, svc: Service, problem: Callable[[Exception, Any], Response],
                 histogram: Histogram | None = None,
                 hop: Callable[..., Awaitable[Any]] | None = None) -> None:
        self.svc = svc
        self.problem = problem
        self.histogram = histogram
        self.hop: Callable[..., Awaitable[Any]] = hop if hop is not None else anyio.to_thread.run_sync
        self.served = 0  # requests answered here (for tests and the benchmark)
        # the histogram's child per (route template, method, status), looked up once
        self._observe: dict[tuple[str, str, int], Any] = {}

    async def __call__(self, scope: Scope, body: bytes, send: Send) -> bool:
        start = time.perf_counter()
        method = scope["method"]
        if method not in ("POST", "PUT") or scope.get("query_string"):
            return False
        m = scope.get(ROUTE)  # the lean HTTP path's (``lean_route``), else matched here
        if m is None:
            m = table.match(method, scope["path"])
        if m is None or m.route not in _ROUTES:
            return False
        p: Principal | None = scope.get("memfuse.principal")  # the front door's
        if p is None or not body:
            return False
        headers: dict[bytes, bytes] = {}
        for k, v in scope.get("headers", ()):
            if k in _READ:
                if k in headers:
                    return False
                headers[k] = v
        if b"x-memfuse-account" in headers:
            return False  # the root admin acting in an account: FastAPI's dependency does it
        if m.route is table.BATCH:
            return await self._batch(scope, body, send, p, m.params["store"], headers, start)
        ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()  # as FastAPI reads it
        if ctype != _JSON:
            return False
        key = headers.get(b"idempotency-key", b"").decode("latin-1")
        if len(key) > IDEMPOTENCY_KEY_MAX:
            return False
        model: type[BaseModel] = _MODELS[m.route]
        try:  # json.loads (``parse_json``), then the model: what FastAPI does with a JSON body
            value, exact = parse_json_exact(body)
            # ``model.model_validate(value)`` without its Python frame: pydantic's own call
            parsed: RecordCreate | RecordUpdate | RecordAppend = model.__pydantic_validator__.validate_python(value)
        except Exception:  # noqa: BLE001 - bad JSON, too deep, refused: FastAPI answers it
            return False
        svc = self.svc
        store = m.params["store"]
        try:
            if svc.token_upkeep_due():  # token bookkeeping, as the principal dependency does it
                await anyio.to_thread.run_sync(svc.token_upkeep)
            idem = idempotency_request(key, method, url_path(scope), body, value, exact) if key else None
            reply: Reply
            early = (scope.get("extensions") or {}).get(EARLY)
            sender = _EarlySender(early, self, m.route, method, start) if early is not None else None
            token = EARLY_ANSWER.set(sender) if sender is not None else None
            try:
                # a large content's (an append's: its suffix after its context) secret scan
                # runs before the writer thread (prescan)
                if isinstance(parsed, RecordCreate):
                    async with prescanned((parsed.content,), p=p, budget=svc.parts.scans):
                        reply = await self.hop(svc.create_record, p, store, parsed, idem)
                else:
                    raw_match = headers.get(b"if-match")  # as FastAPI's ``IfMatch`` header reads it
                    if_match = raw_match.decode("latin-1") if raw_match is not None else None
                    record_id = m.params["record_id"]
                    if isinstance(parsed, RecordUpdate):
                        async with prescanned((parsed.content,), p=p, budget=svc.parts.scans):
                            reply = await self.hop(svc.update_record, p, store, record_id, parsed, if_match, idem)
                    else:
                        check_append_if_match(if_match)  # the service's first refusal: no scan for it
                        async with prescanned((), appends=[(record_id, parsed.append)],
                                              context_of=svc.records.append_context, p=p, budget=svc.parts.scans):
                            reply = await self.hop(svc.append_record, p, store, record_id, parsed, if_match, idem)
            finally:
                if token is not None:
                    EARLY_ANSWER.reset(token)
            answer: tuple[int, list[tuple[bytes, bytes]], bytes] | Response
            # the answer framed for the early send is this reply's (not framed again)
            answer = sender.framed if sender is not None and sender.framed is not None else reply_head(reply)
        except Exception as e:  # rendered as the app's exception handlers would
            answer = self.problem(e, scope)
        await self._send(scope, send, answer, m.route, start,
                         observed=sender is not None and sender.framed is not None)
        return True

    async def _batch(self, scope: Scope, body: bytes, send: Send, p: Principal, store: str,
                     headers: dict[bytes, bytes], start: float) -> bool:
        """``POST .../batch`` as ``routes.records.batch`` serves it (the body read whatever its
        content type); its refusals of the request itself (an ``Idempotency-Key``, a body
        past ``routes.records.batch_max_bytes``, JSON or operations the model refuses) are FastAPI's."""
        # the batch handler's own bound (one knob: routes.records.batch_max_bytes)
        if headers.get(b"idempotency-key") or len(body) > record_routes.batch_max_bytes(self.svc):
            return False
        try:
            req = BatchRequest.model_validate(parse_json(body))
        except Exception:  # noqa: BLE001 - bad JSON, too deep, refused: FastAPI answers it
            return False
        svc = self.svc
        answer: tuple[int, list[tuple[bytes, bytes]], bytes] | Response
        try:
            if svc.token_upkeep_due():
                await anyio.to_thread.run_sync(svc.token_upkeep)
            # the large contents' secret scans run before the writer thread (prescan)
            async with prescanned((op.body.get("content") for op in req.operations
                                   if op.body is not None and op.op in ("create", "update")),
                                  appends=[(op.record_id, op.body.get("append")) for op in req.operations
                                           if op.body is not None and op.op == "append" and op.record_id],
                                  context_of=svc.records.append_context, p=p, budget=svc.parts.scans):
                replies = await self.hop(svc.batch, p, store, req.operations)
            content = batch_body(replies)
            # as starlette's Response(content, media_type="application/json") frames it
            answer = (200, [(b"content-length", str(len(content)).encode("latin-1")),
                            (b"content-type", _JSON)], content)
        except Exception as e:
            answer = self.problem(e, scope)
        await self._send(scope, send, answer, table.BATCH, start)
        return True

    async def _send(self, scope: Scope, send: Send,
                    answer: tuple[int, list[tuple[bytes, bytes]], bytes] | Response,
                    route: table.Route, start: float, observed: bool = False) -> None:
        """Send ``answer`` (status, headers, body; or a refusal's ``Response``) and count it
        (``observed``: its duration was observed already, as it left early)."""
        if isinstance(answer, Response):
            status = answer.status_code
            await answer(scope, _no_receive, send)
        else:
            status, headers, content = answer
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": content})
        self.served += 1
        if not observed:
            self.observe(route, scope["method"], status, start)

    def observe(self, route: table.Route, method: str, status: int, start: float) -> None:
        """Observe an answer's duration (from ``start``, ``time.perf_counter``) in the
        request-duration histogram. Any thread (prometheus_client's children lock; a child
        looked up twice at once is the same child)."""
        if self.histogram is not None:
            key = (route.path, method, status)
            child = self._observe.get(key)
            if child is None:
                child = self._observe[key] = self.histogram.labels(key[0], key[1], str(key[2]))
            child.observe(time.perf_counter() - start)


# the single-record routes served here, each with its body's model
_MODELS: dict[table.Route, type[BaseModel]] = {
    table.CREATE_RECORD: RecordCreate, table.UPDATE_RECORD: RecordUpdate, table.APPEND_RECORD: RecordAppend}
# every route served here (``lean_route``: the requests ``memfuse.server.lean`` serves)
_ROUTES = (*_MODELS, table.BATCH)


class _EarlySender:
    """``EARLY_ANSWER``'s function for a request whose HTTP server offers ``gate.EARLY``: the
    write's reply framed by ``reply_head`` and sent through ``early`` from the write's thread
    as its transaction commits; what it framed is kept (``framed``: the answer ``_send``
    sends after the hop, not framed again on the event loop) and the request's duration is
    observed there too (``WritePath.observe``): bookkeeping off the loop, which runs beside
    the client taking its answer (bench/README.md, "The close path, session 17")."""

    __slots__ = ("early", "path", "route", "method", "start", "framed")

    def __init__(self, early: Callable[[int, list[tuple[bytes, bytes]], bytes], None], path: WritePath,
                 route: table.Route, method: str, start: float) -> None:
        self.early = early
        self.path = path
        self.route = route
        self.method = method
        self.start = start
        # INVARIANT: None until the answer is framed and sent (then observed); set once
        self.framed: tuple[int, list[tuple[bytes, bytes]], bytes] | None = None

    def __call__(self, reply: Reply) -> None:
        framed = reply_head(reply)
        self.early(*framed)
        self.framed = framed
        self.path.observe(self.route, self.method, framed[0], self.start)


def url_path(scope: Scope) -> str:
    """``starlette.datastructures.URL(scope=scope).path`` (what ``Request.url.path`` gives
    the FastAPI handlers: the idempotency request's path), without building the URL when
    the path has no character ``urllib.parse.urlsplit`` strips or removes (ASCII controls
    and space)."""
    path: str = scope["path"]
    if path.isprintable() and " " not in path:
        return path.replace("?", "%3F").replace("#", "%23").replace("\\", "%5C")
    return URL(scope=scope).path


def lean_route(method: str, path: str) -> table.Match | None:
    """The route of ``method path`` (decoded, as ASGI's ``scope["path"]``) when it is one of
    the routes this module serves (the requests ``memfuse.server.lean`` serves without
    hypercorn; it puts the match in the scope as ``ROUTE``), else None."""
    m = table.match(method, path)
    return m if m is not None and m.route in _ROUTES else None


async def _no_receive() -> dict[str, Any]:
    return {"type": "http.request", "body": b"", "more_body": False}
