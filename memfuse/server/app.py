"""HTTP layer of the reference control plane: the FastAPI app of docs/API.md, assembled.

``create_app`` builds the ``Service`` and includes one ``APIRouter`` per resource
(``memfuse.server.routes``: accounts, stores, workspaces, tokens, records, feeds,
consolidations), every route registered from the one route table
(``memfuse.server.routetable``); the other faces (the web console, the memory tool and MCP,
the Anthropic memory-store API) install their own routes. Errors are problem+json
(``memfuse.server.problems``).

The long-polls (``changes``, ``events`` with ``wait``) are ``async``
(``memfuse.server.longpoll``): they read the database only when there may be something to
read, in a worker thread, and sleep without a session until a commit concerns them (this
process's, or another replica's through the commit bus of ``memfuse.server.wakeups``).

The record writes (``POST .../records``, ``PUT .../records/{record_id}``) are served by
``memfuse.server.writepath.WritePath`` from the front door, without FastAPI's per-request
machinery, whenever it can answer exactly as FastAPI would (FastAPI serves the rest).

In front of the app, ``memfuse.server.gate.Gate`` answers the probes and ``GET /metrics``,
authenticates and checks the size from the headers before any body byte is read, bounds the
time a body may take and the requests in flight (503 + ``Retry-After`` beyond), runs
long-lived responses under the caps of ``memfuse.server.streamclass`` (429), and bounds the
time a response may take to be read. This module also holds the app's middleware
(``_CatchAll``: a logged 500 for anything unhandled; ``_Timing``: the request-duration
histogram by route template).
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Histogram
from starlette.routing import Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from memfuse.models import BatchRequest
from memfuse import defs
from memfuse.server import gate, limits, longpoll, proxies, readslots, streamclass, streams as streaming, writepath, writerthread, writertime
from memfuse.server.apidocs import install_docs
from memfuse.server.db import Database
from memfuse.server.routes import accounts, consolidations, feeds, records, stores, tokens, workspaces
from memfuse.server.routes.deps import get_principal, requested_account
from memfuse.server.problems import (
    PROBLEM_JSON,
    PROBLEM_RESPONSES,
    exception_response,
    install_error_handlers,
    problem_response,
)
from memfuse.server.service import (
    CONTEXT_MAX_BYTES_ENV,
    CONTEXT_MIN_BYTES,
    CONTEXT_TOTAL_MAX_BYTES,
    Service,
)

__all__ = ["PROBLEM_JSON", "create_app", "problem_response", "requested_account", "route_template"]

log = logging.getLogger(__name__)

ROUTERS = (accounts, stores, workspaces, tokens, records, feeds, consolidations)
"""The resource routers of the v1 API (``memfuse.server.routes``), in the order they are added."""

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

    def __init__(self, app: ASGIApp, histogram: Histogram) -> None:
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


def create_app(
    db_url: str,
    *,
    static_tokens: dict[str, str | None] | None = None,
    context_max_bytes: int | None = None,
    schema: str = "migrate",
    faces: bool = True,
    max_inflight: int = gate.MAX_INFLIGHT,
    max_inflight_per_token: int | None = None,
    read_budget: float = gate.READ_BUDGET,
    max_reads: int = readslots.MAX_READS,
    max_reads_per_token: int = readslots.READS_PER_TOKEN,
    max_long_polls: int = streamclass.MAX_STREAMS,
    max_long_polls_per_token: int = streamclass.MAX_STREAMS_PER_TOKEN,
    max_long_polls_per_account: int | None = None,
    send_timeout: float = gate.SEND_TIMEOUT,
    max_body: int = gate.MAX_BODY,
    body_timeout: float = gate.BODY_TIMEOUT,
    receive_timeout: float = gate.RECEIVE_TIMEOUT,
    header_timeout: float = gate.HEADER_TIMEOUT,
    max_unauthenticated_per_address: int = gate.MAX_UNAUTHENTICATED_PER_ADDRESS,
    max_unauthenticated: int = gate.MAX_UNAUTHENTICATED,
    streams: bool = True,
    stream_heartbeat: float = streaming.HEARTBEAT_SECONDS,
    stream_lifetime: float = streaming.LIFETIME_SECONDS,
    trusted_proxies: tuple[str, ...] | list[str] = (),
    write_rate: gate.WriteRate | None = None,
    writer_time_rate: float = writertime.WRITER_RATE,
    writer_time_burst: float = writertime.WRITER_BURST,
) -> FastAPI:
    """Build the control-plane app over the database at ``db_url``.

    ``db_url``: ``sqlite:///PATH``, ``sqlite://`` (in memory) or a PostgreSQL URL.
    ``static_tokens``: raw token → workspace name, or None for admin; the dict is consulted
    on every request (tokens may be added later). ``app.state.service`` is the ``Service``.
    ``context_max_bytes``: default bound of the prompt block (``GET .../context``); when
    None, ``$MEMFUSE_CONTEXT_MAX_BYTES`` or 100,000.
    ``schema``: ``"migrate"`` (upgrade the database to the newest revision first) or
    ``"check"`` (refuse a database behind it), see ``memfuse.server.db.Database``.
    ``max_inflight`` (ordinary requests in the app at once), ``max_inflight_per_token`` (of
    them, one token's; default ``gate.default_per_token``), ``read_budget`` (s a read's
    wait for a read slot and database work may take, ``memfuse.server.budget``),
    ``max_reads`` / ``max_reads_per_token`` (reads the app works on at once, in all and per
    token, ``memfuse.server.readslots``), ``max_long_polls`` and
    ``max_long_polls_per_token`` (long-lived responses: long-polls, streams, console live
    pages, per replica and per token), ``max_long_polls_per_account`` (the same per
    account; None: 2/5 of ``max_long_polls``, ``streamclass.default_per_account``), ``send_timeout`` (s a send to a client may take),
    ``max_body`` (bytes of a record write's, batch's, memory-tool call's or console form's
    body), ``body_timeout`` / ``receive_timeout`` (s for a whole body / between two pieces of
    it), ``header_timeout`` (s for a request's headers; ``memfuse.server.serve`` applies it),
    ``max_unauthenticated_per_address`` (connections without a valid token yet, per client
    address; 0: no cap; applied by ``memfuse.server.serve``), ``max_unauthenticated`` (the
    same in all; past it the oldest is closed; 0: no cap): the limits of the front door
    (``memfuse.server.gate``; ``app.front``) and of ``memfuse.server.streamclass``
    (``app.state.stream_class``). ``write_rate``: the per-token write buckets (``gate.WriteRate``, default
    ``gate.WriteRate()``). ``writer_time_rate`` / ``writer_time_burst``: each token's seconds
    holding the database's writer, a second and at once (``memfuse.server.writertime``;
    ``svc.parts.writer_time``). ``app.state.metrics`` is the ``ServerMetrics``.
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
        if env and not (env.isascii() and env.isdigit()):
            raise ValueError(f"${CONTEXT_MAX_BYTES_ENV} must be a whole number of bytes "
                             f"(at least {CONTEXT_MIN_BYTES}), not {env[:40]!r}")
        context_max_bytes = int(env) if env else CONTEXT_TOTAL_MAX_BYTES
        if context_max_bytes < CONTEXT_MIN_BYTES:
            raise ValueError(f"${CONTEXT_MAX_BYTES_ENV} must be at least {CONTEXT_MIN_BYTES} bytes, "
                             f"not {context_max_bytes}")
    if context_max_bytes < CONTEXT_MIN_BYTES:
        raise ValueError(f"context_max_bytes must be at least {CONTEXT_MIN_BYTES}")
    trusted = proxies.parse_trusted(trusted_proxies)
    metrics = limits.ServerMetrics()
    db = Database(db_url, schema=schema)
    metrics.count_statements(db.engine)
    svc = Service(db, static_tokens, context_max_bytes=context_max_bytes, max_body=max_body)
    svc.parts.writer_time.rate, svc.parts.writer_time.burst = float(writer_time_rate), float(writer_time_burst)
    reads = longpoll.FeedReads(svc)
    open_streams = streaming.Streams(svc, heartbeat=stream_heartbeat, lifetime=stream_lifetime,
                                     enabled=streams)
    stream_class = streamclass.StreamClass(svc, per_replica=max_long_polls, per_token=max_long_polls_per_token,
                                           per_account=max_long_polls_per_account)
    metrics.add_collector(limits.notifier_collector(svc.notifier, svc.bus, open_streams))
    from memfuse.server import history
    metrics.add_collector(history.collector())
    app = _App(
        title="memfuse control plane",
        version="1",
        description="Long-term memory for AI agents, served as files (see docs/API.md).",
        responses=PROBLEM_RESPONSES,
        docs_url=None,  # served by apidocs.install_docs, every asset from this server
        redoc_url=None,
    )
    install_docs(app)
    app.state.service = svc
    app.state.metrics = metrics
    app.state.feed_reads = reads
    app.state.streams = open_streams
    app.state.stream_class = stream_class
    install_error_handlers(app)
    app.add_middleware(_CatchAll)
    durations = Histogram(
        "http_request_duration_seconds", "Time from a request's arrival in the app to its last "
        "response byte, by route template, method and status (streams left out)",
        ["route", "method", "status"], buckets=REQUEST_BUCKETS, registry=metrics.registry)
    app.add_middleware(_Timing, histogram=durations)
    _process_collectors(metrics.registry)
    app.state.trusted_proxies = trusted
    if trusted:
        app.add_middleware(proxies.TrustedProxyScheme, trusted=trusted)
    app.front = gate.Gate(
        app.serve_fastapi, svc, metrics, stream_class, max_inflight=max_inflight,
        max_per_token=max_inflight_per_token, read_budget=read_budget,
        max_reads=max_reads, max_reads_per_token=max_reads_per_token, send_timeout=send_timeout, max_body=max_body, body_timeout=body_timeout,
        receive_timeout=receive_timeout, header_timeout=header_timeout,
        max_unauthenticated_per_address=max_unauthenticated_per_address,
        max_unauthenticated=max_unauthenticated,
        write_rate=write_rate,
        fast=longpoll.FastPath(svc, reads, exception_response, open_streams),
        # the record writes without FastAPI's machinery (memfuse.server.writepath)
        writes=writepath.WritePath(
            svc, exception_response, durations,
            # SQLite has one writer: its writes on one thread of their own, not a thread hop
            # each (memfuse.server.writerthread); PostgreSQL's run side by side as before
            hop=writerthread.WriterThread().run if db.is_sqlite else None),
    )
    metrics.add_collector(limits.front_collector(app.front, stream_class))
    metrics.add_collector(limits.lean_collector(app.state))

    if faces:
        from memfuse.server.console import install_console

        install_console(app)  # the web console at /ui/ (memfuse/server/console/)

    # /healthz, /readyz and /metrics are answered by the front door (memfuse.server.gate),
    # before any limit: they never queue behind API traffic
    # One APIRouter per resource (memfuse.server.routes), each route from the route table
    # (memfuse.server.routetable). Their routes join the app's own list: FastAPI 0.165 keeps an
    # included router (include_router) as a branch matched apart on every request, about 800
    # more Python calls a request for these seven (bench/README.md, "The routers").
    for module in ROUTERS:
        app.router.routes.extend(module.router.routes)

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
        assert app.openapi_schema is not None  # FastAPI.openapi stored the document it made
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    from memfuse.server import anthropic_api

    anthropic_api.install(app, svc)  # Anthropic's memory-store API, /v1/memory_stores (docs/ANTHROPIC-API.md)

    if faces:
        from memfuse.server import agent_tools

        agent_tools.install(app, svc, get_principal)
    return app


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


def _process_collectors(registry: CollectorRegistry) -> None:
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
