"""The control plane's front door: a pure ASGI layer in front of the app that decides what a
request may cost before the app sees it (docs/API.md, "Operations: limits").

In order, for every HTTP request:

1. **Probes and metrics** (``/healthz``, ``/readyz``, ``GET /metrics``) are answered here, at
   once, outside every limit below: they never queue behind API traffic. ``/readyz`` runs
   its ``SELECT 1`` on a thread of its own (one at a time; concurrent probes share the
   answer, a success is reused for ``READY_REUSE_SECONDS``); ``/metrics`` is rendered on a
   thread too, one render at a time, shared by the scrapes that wait for it (``_metrics_text``).
2. **Authentication from the headers**, before any body byte is read: ``/v1/...`` and
   ``/mcp`` need ``Authorization: Bearer`` (or ``x-api-key`` under ``api_key_prefixes``:
   Anthropic's memory-store API). A missing token, a static token and a token in
   the positive cache are decided on the event loop; an unknown token costs one indexed
   lookup on a small thread pool of its own (``AUTH_THREADS``) and its refusal is remembered
   (``BAD_TOKEN_SECONDS``), so anonymous traffic cannot take the API's threads or repeat a
   query. 401 problem (``/mcp`` and the memory-store API: their own 401, ``auth_refusals``).
2b. **Write rate per token** (``WriteRate``): a write (``POST`` / ``PUT`` / ``PATCH`` /
   ``DELETE`` under ``/v1/``) draws on its token's two buckets, requests (``WRITE_RATE`` a
   second, bursts of ``WRITE_BURST``) and body bytes (the declared ``Content-Length``:
   ``WRITE_BYTES_RATE`` a second, bursts of ``WRITE_BYTES_BURST``); an empty bucket is 429
   ``rate_limited`` with ``Retry-After`` (the seconds until the write fits), before the body
   is read. The sidecar's outbox waits that long before its next attempt. So one token
   cannot fill the database's disk at ``max_record_bytes`` a request.
3. **Size**: a declared ``Content-Length`` above the endpoint's limit is 413 at once; a
   chunked body is counted as it is read and cut with 413 past the limit. Limits:
   ``max_body`` for record writes, batches, the memory tool, console forms and ``/mcp``
   (whose tools write records; at least ``MCP_MAX_BODY``), ``SMALL_BODY`` elsewhere. The bodies being read at once
   share ``body_budget`` bytes (503 ``overloaded`` past it).
3b. **Head size**: a request whose target and headers exceed ``MAX_HEAD`` bytes is 431
   (hypercorn refuses a longer head only when it arrives in more than one read).
4. **Deadlines**: the body must arrive within ``body_timeout`` s in all, with at most
   ``receive_timeout`` s between two pieces (408 ``request_timeout``). Headers are bounded by
   the HTTP server (``memfuse.server.serve``: hypercorn's ``keep_alive_timeout`` runs from
   the connection's start, or the previous answer, until the request's headers are in).
5. **Slots**: an ordinary request takes one of ``max_inflight`` slots only once its body is
   read, for as long as the app works on it (503 ``overloaded``, ``Retry-After: 1`` when
   none is free), and one of its token's ``max_per_token`` (``Shares``: 429
   ``too_many_requests``, ``Retry-After: 1``, so one token cannot hold every slot; a request
   without a token, a console page, one of its client address's ``max_per_token``). A ``GET``
   under ``/v1/`` or ``/ui/`` runs under a ``memfuse.server.budget.Budget``: its database
   work is interrupted when its client disconnects or ``read_budget`` s have passed (504
   ``timeout``); before the app sees it, it waits (within that budget) for one of its
   token's read slots (``memfuse.server.readslots.ReadSlots``: the reads the app works on
   at once, per token and in all, waiting tokens served in turn), so one token's reads
   cannot take the CPU from every other client. A read-only tool call (a ``POST`` of the
   memory tool or ``/mcp`` that only reads, ``memfuse.server.readslots.read_call``) is such
   a read too. A long-lived response (long-poll, stream, console live page) takes a lease
   of the ``StreamClass`` instead (``memfuse.server.streamclass``: per-token and per-replica
   caps, 429 with ``Retry-After``), and ends within a moment of its token's revocation or
   expiry.

A refusal made while the body is unread is sent with ``Connection: close`` while what is
already queued is discarded (hypercorn cannot finish a response whose request body was left
unread otherwise: the app's last send waits on its full receive queue), and the connection
closes: the rest of the body is never read. Memory per request: at most its limit (the body,
once read) plus hypercorn's receive queue (``max_app_queue_size`` × 64 KiB).

Sending: any part of a response may take at most ``send_timeout`` s (see
``memfuse.server.serve.listen_socket`` for the kernel's half of this). ``Connections`` caps
the connections that have not yet shown a valid token (or asked a probe), per client address
and in all (past the global cap the oldest is evicted); ``memfuse.server.serve`` applies it
when it accepts them.

The lean HTTP path (``memfuse.server.lean``) hands a record write (create, update, append, batch) to
``Gate.write`` instead: the same steps and refusals for a write whose head shows a cached token
(through the same methods), without the general request path; any other request goes to
``__call__`` before anything is counted.
"""
from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

import anyio
from sqlalchemy.exc import SQLAlchemyError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from memfuse.defs import RECORD_BODY_MAX, sha256_hex
from memfuse.server import budget, writertime
from memfuse.server.limits import MAX_HEAD, PROBLEM_JSON, ServerMetrics
from memfuse.server.readslots import (MAX_READS, MEMORY_TOOL_SUFFIX, READS_PER_TOKEN, ReadSlots, is_cheap,
                                      read_call)
from memfuse.server.service import Principal, Service, ServiceError, with_write_headers
from memfuse.server.streamclass import Lease, StreamClass
from memfuse.server.tokens import token_digest

log = logging.getLogger(__name__)

MAX_INFLIGHT = 128
READ_BUDGET = 30.0  # s a read (GET under /v1/, /ui/) may work before its database work is interrupted


def default_per_token(max_inflight: int) -> int:
    """The default share of ``max_inflight`` request slots one token may hold: a quarter of
    them, at least 1 (128 slots: 32)."""
    return max(1, max_inflight // 4)
MAX_BODY = RECORD_BODY_MAX  # record writes, batches, the memory tool, console forms (defs: one rule)
SMALL_BODY = 1024 * 1024  # every other endpoint
MCP_MAX_BODY = 4 * 1024 * 1024  # /mcp's bound when max_body is smaller (a test's app)


def mcp_body_bound(max_body: int) -> int:
    """The body bound (bytes) of ``/mcp`` on a control plane whose record writes take
    ``max_body`` bytes: that bound (its tools write records, so a store's largest record fits
    however escaped: ``memfuse.defs.record_body_bound``), at least ``MCP_MAX_BODY`` (the MCP
    SDK's default). The front door and the MCP face (``memfuse.server.agent_tools``) both apply it."""
    return max(MCP_MAX_BODY, max_body)
BODY_BUDGET = 256 * 1024 * 1024  # bytes of request bodies held at once, all requests
BODY_TIMEOUT = 60.0  # s for a whole body
RECEIVE_TIMEOUT = 10.0  # s between two pieces of a body
HEADER_TIMEOUT = 5.0  # s for a request's headers (and an idle keep-alive connection)
MAX_UNAUTHENTICATED_PER_ADDRESS = 64
MAX_UNAUTHENTICATED = 1024  # connections without a valid token yet, all addresses (oldest evicted past it)
SEND_TIMEOUT = 30.0
AUTH_THREADS = 4  # worker threads for lookups of unknown tokens
BAD_TOKEN_SECONDS = 60.0  # a refused token is refused again without a query this long
BAD_TOKEN_MAX = 10_000
RATE_KEYS_MAX = 10_000  # tokens whose digest is kept (``Gate._token_key``; the table is cleared past it)
READY_REUSE_SECONDS = 0.25
DRAIN_SECONDS = 5.0

PROBES = ("/healthz", "/readyz")
# ASGI scope extensions an HTTP server may offer (memfuse.server.lean does): ``BODY``, a
# function ``() -> bytes | None`` giving the whole request body when the server holds all of
# it already (it is then read: ``receive`` gives no more of it), else None; ``SEND_WITHIN``,
# ``async (message, seconds)``: ``send(message)`` bounded by the server itself, raising
# ``TimeoutError`` (the connection then closes) when it does not finish within ``seconds``;
# ``EARLY``, ``(status, headers, body) -> None``, callable from another thread while the
# request's task waits for that thread: the whole answer sent at once as the server would frame
# it, when it can be without waiting; the answer the app sends after it is then this one
# (``memfuse.server.lean._Exchange.send_early``).
#: ``_headers``' token (or X-Api-Key) of a request that gives the header twice: refused with
#: 400 ``invalid_request`` (a proxy may add a credential to a client's, or keep the first of
#: two where this server would read the last: attack18 scan19), never one of them chosen
TWO_TOKENS = "\0two"
BODY = "memfuse.body"
SEND_WITHIN = "memfuse.send_within"
EARLY = "memfuse.send_early"
_TRUE = ("true", "1", "yes", "on")


class Connections:
    """Open connections that have not shown a valid token yet (nor asked a probe, nor had an
    answer below 400 or one the app marked ``memfuse.authenticated``: a console page, whose
    session the console checks): at most ``cap`` per client address (0: no cap), and at most
    ``max_total`` in all (0: no cap). ``memfuse.server.serve`` calls ``opened`` when it
    accepts a connection and ``closed`` when it ends; the ``Gate`` calls ``active`` when a
    request on it starts and ``cleared`` once one authenticated. Event-loop only.

    One rule for both caps. At a cap (``full`` in all, ``at_cap(peer)`` for an address) the
    server closes a new connection whose request head has not arrived yet at once
    (``turned_away``); a new one whose head is in is kept (``opened``) and the one idle the
    longest is evicted (its ``evict`` callback, given to ``opened``, is called: the server
    closes it): of the connection's address at its cap, of all addresses at ``max_total``.
    The one idle the longest is the oldest still waiting for a request's headers, or for a
    next request after a refusal: the one whose header deadline is furthest gone. A flood of
    connections that never finish their heads, from any number of addresses or from the one
    address a client shares with it (a NAT, an ingress, the node's kubelet probes: attack 16
    F3), then can neither hold the server's descriptors nor keep the kernel's listen backlog
    full nor shut out a client that sends its request
    (``memfuse.server.serve._accept_forever``; tests/test_hostile.py, bench/README.md
    "Hostile clients"). Every such close is counted (``evicted``, ``evicted_at_address``,
    ``turned_away``, ``refused``: the metrics ``memfuse_server_connections_evicted_total``
    by reason and ``memfuse_server_connections_refused_total``) and logged (at most one line
    per ``LOG_EVERY`` s, with the totals). Memory: two dict entries per connection."""

    LOG_EVERY = 5.0  # s between two log lines about evictions

    def __init__(self, cap: int = MAX_UNAUTHENTICATED_PER_ADDRESS, max_total: int = MAX_UNAUTHENTICATED) -> None:
        self.cap = cap
        self.max_total = max_total
        self.refused = 0  # new connections without their head closed at their address's cap
        self.evicted = 0  # the oldest of all closed for a new connection whose head was in
        self.evicted_at_address = 0  # the oldest of an address at its cap, likewise
        self.refused_at_cap = 0  # new connections without their head closed at ``max_total``
        self.open = 0  # connections open now (``opened``, not yet ``closed``), with or without a token
        # connections the server ended early, by reason (``ended``)
        self.ended_early: dict[str, int] = {"client_gone": 0, "pipelined": 0, "framing": 0}
        # INVARIANT: ``_pending`` holds every open connection (host, port) not cleared yet,
        # with its evict callback, in the order of its last activity (accepted, or a request
        # started on it: ``active``), oldest first; ``_hosts[host]`` holds the same keys of
        # that host in the same order (no empty entry).
        self._pending: dict[tuple[str, int], Callable[[], object] | None] = {}
        self._hosts: dict[str, dict[tuple[str, int], None]] = {}
        self._logged_at = -math.inf

    def at_cap(self, peer: tuple[str, int]) -> bool:
        """Whether a new connection from ``peer`` meets a cap: its address holds ``cap``
        connections without a valid token, or ``full``."""
        return (bool(self.cap) and len(self._hosts.get(peer[0], ())) >= self.cap) or self.full

    def opened(self, peer: tuple[str, int], evict: Callable[[], object] | None = None) -> bool:
        """Count a new connection from ``peer`` (the server calls it only for a connection
        whose request head is in when ``at_cap(peer)``): at its address's ``cap`` the
        address's connection idle the longest is evicted (its ``evict`` called, it stops
        counting), and at ``max_total`` the oldest of all. Returns True (kept)."""
        self.open += 1
        host = peer[0]
        if peer in self._pending:  # a reused (host, port): the old connection has ended
            self._forget(peer)
        mine = self._hosts.get(host)
        while self.cap and mine is not None and len(mine) >= self.cap:
            self._evict(next(iter(mine)))
            self.evicted_at_address += 1
            mine = self._hosts.get(host)
        while self.max_total and len(self._pending) >= self.max_total:
            self._evict(next(iter(self._pending)))
            self.evicted += 1
        self._pending[peer] = evict
        self._hosts.setdefault(host, {})[peer] = None
        return True

    def _evict(self, peer: tuple[str, int]) -> None:
        callback = self._pending.get(peer)
        self._forget(peer)
        if callback is not None:
            callback()
        self._log_eviction()

    @property
    def full(self) -> bool:
        """Whether ``max_total`` connections without a valid token are open."""
        return bool(self.max_total) and len(self._pending) >= self.max_total

    def turned_away(self, peer: tuple[str, int] | None = None) -> None:
        """Count (and log) a new connection (from ``peer``) closed at once at a cap: its
        request head had not arrived. Counted as ``refused`` when only its address was at
        its cap, else as ``refused_at_cap``."""
        if peer is not None and not self.full:
            self.refused += 1
        else:
            self.refused_at_cap += 1
        self._log_eviction()

    def active(self, peer: Any) -> None:
        """A request started on ``peer``'s connection: it becomes the newest of the pending."""
        if isinstance(peer, (tuple, list)) and len(peer) >= 2:
            key = (peer[0], peer[1])
            if key in self._pending:
                self._pending[key] = self._pending.pop(key)
                mine = self._hosts[key[0]]
                mine[key] = mine.pop(key)

    def cleared(self, peer: Any) -> None:
        """``peer``'s connection showed a valid token (or asked a probe): it no longer counts."""
        if isinstance(peer, (tuple, list)) and len(peer) >= 2:
            key = (peer[0], peer[1])
            if key in self._pending:
                self._forget(key)

    def closed(self, peer: tuple[str, int]) -> None:
        """``peer``'s connection ended (one call per ``opened``)."""
        self.open -= 1
        self.cleared(peer)

    def ended(self, reason: str) -> None:
        """Count a connection the server ended early: ``"client_gone"`` (its client had gone,
        ``memfuse.server.lean.client_gone``: the requests it had sent were not run) or
        ``"pipelined"`` (``memfuse.server.limits.MAX_PIPELINED`` answers in a row to a client
        that pipelines without reading) or ``"framing"`` (a request with both Content-Length
        and Transfer-Encoding, answered 400: ``memfuse.server.serve``)."""
        self.ended_early[reason] = self.ended_early.get(reason, 0) + 1

    def _forget(self, peer: tuple[str, int]) -> None:
        del self._pending[peer]
        mine = self._hosts[peer[0]]
        del mine[peer]
        if not mine:
            del self._hosts[peer[0]]

    def _log_eviction(self) -> None:
        now = time.monotonic()
        if now - self._logged_at >= self.LOG_EVERY:
            log.warning("closing connections without a token: at a cap of unauthenticated connections "
                        "(the oldest for a new request; new ones whose request has not arrived)",
                        extra={"reason": "max_unauthenticated", "cap": self.max_total, "cap_per_address": self.cap,
                               # totals since the start (a line the log's rate limit drops loses none)
                               "evicted_oldest": self.evicted, "evicted_oldest_of_address": self.evicted_at_address,
                               "refused_without_head": self.refused_at_cap,
                               "refused_without_head_at_address": self.refused})
            self._logged_at = now

    @property
    def unauthenticated(self) -> int:
        return len(self._pending)


class _Refusal(Exception):
    def __init__(self, status: int, code: str, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status, self.code, self.detail, self.headers = status, code, detail, headers or {}


_TITLES = {400: "Bad Request", 401: "Unauthorized", 408: "Request Timeout", 413: "Content Too Large",
           431: "Request Header Fields Too Large",
           429: "Too Many Requests", 503: "Service Unavailable", 504: "Gateway Timeout"}


WRITE_RATE, WRITE_BURST = 500.0, 2_000  # writes / s of one token, and its burst
WRITE_BYTES_RATE, WRITE_BYTES_BURST = 16 << 20, 256 << 20  # body bytes / s of one token, burst
_WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


class WriteRate:
    """Token buckets of writes per bearer token: ``take(key, size, now)`` returns 0 when a
    write of ``size`` body bytes may go now (and takes it), else the seconds until it could.
    Buckets start full and refill continuously (requests at ``rate``/s up to ``burst``;
    bytes at ``bytes_rate``/s up to ``bytes_burst``); a token idle long enough to be full
    again is forgotten, so the table holds only the tokens writing now."""

    def __init__(self, rate: float = WRITE_RATE, burst: int = WRITE_BURST,
                 bytes_rate: float = WRITE_BYTES_RATE, bytes_burst: int = WRITE_BYTES_BURST) -> None:
        self.rate, self.burst = float(rate), float(burst)
        self.bytes_rate, self.bytes_burst = float(bytes_rate), float(bytes_burst)
        self._buckets: dict[str, tuple[float, float, float]] = {}  # key -> (writes, bytes, at)

    def take(self, key: str, size: int, now: float) -> float:
        writes, nbytes, at = self._buckets.get(key, (self.burst, self.bytes_burst, now))
        # ``min(a, b)`` is ``b if b < a else a``, written out (the builtin's call costs more than
        # the rest of this step: bench/README.md, "The close path, session 15: serve's loop")
        writes += (now - at) * self.rate
        writes = writes if writes < self.burst else self.burst
        nbytes += (now - at) * self.bytes_rate
        nbytes = nbytes if nbytes < self.bytes_burst else self.bytes_burst
        want = float(size)
        want = self.bytes_burst if self.bytes_burst < want else want  # a body larger than a burst waits for a full bucket
        if writes >= 1 and nbytes >= want:
            self._buckets[key] = (writes - 1, nbytes - want, now)
            if len(self._buckets) > 10_000:
                self._forget_full(now)
            return 0.0
        self._buckets[key] = (writes, nbytes, now)
        return max((1 - writes) / self.rate if writes < 1 else 0.0,
                   (want - nbytes) / self.bytes_rate if nbytes < want else 0.0)

    def _forget_full(self, now: float) -> None:
        for key, (w, b, at) in list(self._buckets.items()):
            if w + (now - at) * self.rate >= self.burst and b + (now - at) * self.bytes_rate >= self.bytes_burst:
                del self._buckets[key]


class Shares:
    """Each token's share of the request slots: at most ``per_token`` ordinary requests of one
    token (by its key, ``Gate._token_key``) in the app at once. Event-loop only."""

    def __init__(self, per_token: int) -> None:
        self.per_token = per_token
        self._held: dict[str, int] = {}  # key → requests of that token in the app now

    def take(self, key: str) -> bool:
        """Take one of ``key``'s share: False (nothing taken) when it holds ``per_token``."""
        n = self._held.get(key, 0)
        if n >= self.per_token:
            return False
        self._held[key] = n + 1
        return True

    def give(self, key: str) -> None:
        """Give back one taken with ``take``."""
        n = self._held[key] - 1
        if n:
            self._held[key] = n
        else:
            del self._held[key]


class Gate:
    """ASGI wrapper of the app: the steps of the module docstring.

    ``fast(scope, receive, send)``, when given, is tried first for long-polls and streams
    (``memfuse.server.longpoll.FastPath``): True when it answered. ``writes(scope, body,
    send)``, when given, is tried first for every other request once its body is read (the
    record writes, ``memfuse.server.writepath.WritePath``): True when it answered. ``auth_refusals`` maps a
    path prefix to a function ``(ServiceError, scope) -> ASGI response`` for prefixes whose
    401 has its own form (``/mcp``). ``connections``: the caps of connections without a valid
    token (per address, ``max_unauthenticated_per_address``, and in all, ``max_unauthenticated``),
    when the server applies them (``memfuse.server.serve``). ``max_per_token``: the ordinary
    requests one token may have in the app at once (default ``default_per_token``);
    ``read_budget``: s a read may wait for a read slot and work (``memfuse.server.budget``);
    ``max_reads`` / ``max_reads_per_token``: the reads the app works on at once, in all and
    per token (``memfuse.server.readslots``)."""

    def __init__(self, app: ASGIApp, svc: Service, metrics: ServerMetrics, streams: StreamClass, *,
                 max_inflight: int = MAX_INFLIGHT, max_per_token: int | None = None,
                 read_budget: float = READ_BUDGET, send_timeout: float = SEND_TIMEOUT,
                 max_reads: int = MAX_READS, max_reads_per_token: int = READS_PER_TOKEN,
                 max_body: int = MAX_BODY, body_timeout: float = BODY_TIMEOUT,
                 receive_timeout: float = RECEIVE_TIMEOUT, body_budget: int = BODY_BUDGET,
                 header_timeout: float = HEADER_TIMEOUT,
                 max_unauthenticated_per_address: int = MAX_UNAUTHENTICATED_PER_ADDRESS,
                 max_unauthenticated: int = MAX_UNAUTHENTICATED,
                 fast: Callable[[Scope, Receive, Send], Awaitable[bool]] | None = None,
                 ready: Callable[[], Any] | None = None,
                 write_rate: WriteRate | None = None,
                 writes: Callable[[Scope, bytes, Send], Awaitable[bool]] | None = None) -> None:
        self.app = app
        self.writes = writes
        self.write_rate = write_rate if write_rate is not None else WriteRate()
        # each token's writer time (memfuse.server.writertime): the service's, which the
        # database charges
        self.writer_time: writertime.WriterTime = svc.parts.writer_time
        self.svc = svc
        self.metrics = metrics
        self.streams = streams
        self.fast = fast
        self.ready = ready
        self.max_inflight = max_inflight
        self.shares = Shares(default_per_token(max_inflight) if max_per_token is None else max_per_token)
        self.read_budget = read_budget
        self.reads = ReadSlots(max_reads_per_token, max_reads)
        self.send_timeout = send_timeout
        self.max_body = max_body
        self.body_timeout = body_timeout
        self.receive_timeout = receive_timeout
        self.body_budget = body_budget
        self.header_timeout = header_timeout
        self.connections = Connections(max_unauthenticated_per_address, max_unauthenticated)
        self.auth_refusals: dict[str, Callable[[ServiceError, Scope], Any]] = {}
        # path prefix → ``(status, code, detail) -> (body, content type)``: the form of every
        # other refusal (413, 408, 429, 503) under that prefix, where it is not problem+json
        # (Anthropic's memory-store API answers its own error envelope)
        self.refusal_bodies: dict[str, Callable[[int, str, str], tuple[bytes, bytes]]] = {}
        # path prefixes whose clients may send the token as ``x-api-key`` (it wins over
        # ``Authorization``, as there): Anthropic's memory-store API
        self.api_key_prefixes: tuple[str, ...] = ()
        self.inflight = 0  # read by the gauge ``metrics.inflight`` when scraped
        self.lean_writes = 0  # requests ``write`` took itself (tests, the benchmark)
        metrics.inflight.set_function(lambda: self.inflight)
        self.body_bytes = 0  # bytes of bodies held now
        # token → its ``token_digest`` (the token cache's key; its first 32 characters key the
        # token's write buckets and request share), so a token is hashed once, not per request
        self._digests: dict[str, str] = {}
        self._auth_limiter: anyio.CapacityLimiter | None = None
        self._probe_limiter: anyio.CapacityLimiter | None = None
        self._ready_lock: anyio.Lock | None = None
        self._ready_at = -1e18
        # /metrics renders (``_metrics_text``), GUARDED_BY the event loop: counted as started,
        # the number of the last finished one, its text
        self._metrics_lock: anyio.Lock | None = None
        self._metrics_limiter: anyio.CapacityLimiter | None = None
        self._metrics_started = 0
        self._metrics_done = 0
        self._metrics_body = b""
        self._bad_tokens: dict[str, tuple[float, str]] = {}  # digest → (until, detail)
        self._last_refusal_log = 0.0

    # ------------------------------------------------------------ what a request is

    def body_limit(self, method: str, path: str) -> int:
        """The largest body ``method path`` may carry, in bytes."""
        if path == "/mcp" or path.startswith("/mcp/"):
            return mcp_body_bound(self.max_body)
        if method in ("POST", "PUT", "PATCH"):
            if path.startswith("/ui/"):
                return self.max_body
            if path.startswith("/v1/") and ("/records" in path or "/memories" in path
                                            or path.endswith(("/batch", "/memory-tool"))):
                return self.max_body
        return SMALL_BODY

    @staticmethod
    def long_lived(method: str, path: str, query: bytes) -> bool:
        """Whether ``method path?query`` is a long-lived response: a long-poll or stream of
        the change feed or the workspace events, or a console live page."""
        if method != "GET":
            return False
        if path.startswith("/ui/"):
            return path.endswith("/live") and path.startswith("/ui/stores/")
        if not path.startswith("/v1/") or not path.endswith(("/changes", "/events")):
            return False
        qs = parse_qs(query.decode("latin-1"))
        if qs.get("stream", ["false"])[-1].lower() in _TRUE:
            return True
        try:
            return float(qs.get("wait", ["0"])[-1]) > 0
        except ValueError:
            return False

    # ------------------------------------------------------------ serving

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        self.connections.active(scope.get("client"))
        if path in PROBES or (path == "/metrics" and method == "GET"):
            self.connections.cleared(scope.get("client"))
            await self._probe(path, receive, send)
            return
        head, length, chunked, token, instance, api_key, store_created, writer = _headers(scope)
        if head > MAX_HEAD:  # hypercorn bounds only a head that arrives in several reads
            await self._refuse(receive, send, 431, "header_too_large",
                               f"the request line and headers are larger than {MAX_HEAD} bytes",
                               close=True, path=path)
            return
        if api_key and path.startswith(self.api_key_prefixes or ("\0",)):
            token = api_key
        limit = self.body_limit(method, path)
        pending = chunked or bool(length)  # a body not read yet
        if token is TWO_TOKENS:
            await self._refuse(receive, send, 400, "invalid_request",
                               "the request gives its credential twice (two Authorization or "
                               "X-Api-Key headers, or a bearer token and another X-Api-Key); "
                               "send one", close=pending, path=path)
            return
        if length is not None and length > limit:
            await self._refuse(receive, send, 413, "too_large",
                               f"the body is larger than this endpoint takes ({limit} bytes)",
                               close=pending, path=path)
            return
        principal: Principal | None = None
        charge: writertime.Charge | None = None  # a write's account of writer time (its token's)
        if path.startswith("/v1/") or path == "/mcp" or path.startswith("/mcp/"):
            try:
                principal = await self._authenticate(token, instance)
            except ServiceError as e:
                render = next((fn for prefix, fn in self.auth_refusals.items() if path.startswith(prefix)), None)
                if render is not None:
                    self._count(401, e.code)
                    await self._drained(receive, render(e, scope), scope, send, close=pending)
                else:
                    await self._refuse(receive, send, e.status, e.code, e.detail, headers=e.headers,
                                       close=pending, path=path)
                return
            except SQLAlchemyError as e:
                log.warning("authentication: database unavailable: %s", type(e).__name__)
                await self._refuse(receive, send, 503, "unavailable", "database error; retry",
                                   headers={"Retry-After": "1"}, close=pending, path=path)
                return
            self.connections.cleared(scope.get("client"))
            principal = with_write_headers(principal, store_created, writer)
            scope["memfuse.principal"] = principal
            if method in _WRITE_METHODS:
                charge = writertime.charge_of(principal, self.writer_time)
            if method in _WRITE_METHODS and path.startswith("/v1/") and token:
                # the token's writer time, then its write buckets, from the headers, before
                # the body is read
                refusal = self._writer_refusal(charge, receive, send, pending, path)
                if refusal is None:
                    refusal = self._rate_refusal(self._token_key(token), length, receive, send, pending, path)
                if refusal is not None:
                    await refusal
                    return
        lease: Lease | None = None
        if self.long_lived(method, path, scope.get("query_string", b"")):
            try:
                lease = self.streams.enter()
                if principal is not None:
                    lease.bind(principal)
            except ServiceError as e:
                if lease is not None:
                    lease.close()
                await self._refuse(receive, send, e.status, e.code, e.detail, headers=e.headers,
                                   close=pending, path=path)
                return
            scope["memfuse.lease"] = lease
        held = 0
        charged = writertime.CURRENT.set(charge) if charge is not None else None
        try:
            body, held = await self._body(receive, send, limit, scope, path)
            if body is None:
                return  # the client left, or refused
            if lease is None:
                share = self._share_key(principal, token, scope)
                refusal = self._slot_refusal(share, receive, send, path)
                if refusal is not None:
                    await refusal
                    return
                self.inflight += 1
                try:
                    if method == "GET" and path.startswith(("/v1/", "/ui/")):
                        await self._run_read(scope, body, receive, send, share,
                                             is_cheap(path, scope.get("query_string", b"")))
                    elif method == "POST" and (cheap := read_call(path, body)) is not None:
                        await self._run_read(scope, body, receive, send, share, cheap)
                    else:
                        await self._run(scope, replay(body, receive), send, None, body)
                finally:
                    self.inflight -= 1
                    if share is not None:
                        self.shares.give(share)
            else:
                await self._run(scope, replay(body, receive), send, lease)
        finally:
            self.body_bytes -= held
            if lease is not None:
                lease.close()
            if charged is not None:
                writertime.CURRENT.reset(charged)

    async def write(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A record write (create, update, append, batch: the routes ``memfuse.server.writepath``
        serves) from an HTTP server that offers ``SEND_WITHIN`` (``memfuse.server.lean``):
        the steps ``__call__`` takes for it, without its general request path (probes,
        long-lived responses, reads, the app's bounded sends: bench/README.md, "The close
        path, session 18: serve's loop"). Taken here only when the head alone shows the
        common case: a ``/v1/`` ``POST`` / ``PUT`` with a ``Content-Length`` within the
        endpoint's bound, a head within ``MAX_HEAD``, a bearer token the service resolves
        without the database (``Service.authenticate_cached``), no ``x-api-key`` that would
        replace it; every other request (a 401, 413, 431, an unknown token, a chunked body)
        goes to ``__call__`` before anything is counted or taken, so its answer is that
        path's own. From then on the steps, their order and every refusal (429
        ``rate_limited``, the body's 413 / 408 / 503, 503 ``overloaded``, 429
        ``too_many_requests``) are ``__call__``'s, through the same methods; a request the
        write path declines (``writes`` False: FastAPI's own refusals) is run as
        ``__call__`` runs it."""
        path = scope["path"]
        head, length, chunked, token, instance, api_key, store_created, writer = _headers(scope)
        within = (scope.get("extensions") or {}).get(SEND_WITHIN)
        limit = self.body_limit(scope["method"], path)
        principal: Principal | None = None
        if (within is not None and self.writes is not None and not chunked and token
                and token is not TWO_TOKENS and length is not None and length <= limit and head <= MAX_HEAD
                and scope["method"] in ("POST", "PUT") and path.startswith("/v1/")
                and not path.endswith(MEMORY_TOOL_SUFFIX)
                and not (api_key and path.startswith(self.api_key_prefixes or ("\0",)))):
            digest = self._digests.get(token) or token_digest(token)
            try:
                principal = self.svc.authenticate_cached(token, instance, digest)
            except ServiceError:
                principal = None
        if principal is None:
            await self(scope, receive, send)
            return
        assert token is not None and length is not None and self.writes is not None and within is not None
        self.lean_writes += 1
        # ``__call__``'s ``active`` then ``cleared``: the second forgets what the first reorders
        self.connections.cleared(scope.get("client"))
        scope["memfuse.principal"] = with_write_headers(principal, store_created, writer)
        share = self._token_key(token, digest)  # ``_share_key`` of a request with a principal and a token
        charge = writertime.charge_of(principal, self.writer_time)
        refusal = self._writer_refusal(charge, receive, send, bool(length), path)
        if refusal is None:
            refusal = self._rate_refusal(share, length, receive, send, bool(length), path)
        if refusal is not None:
            await refusal
            return
        held = 0
        charged = writertime.CURRENT.set(charge) if charge is not None else None
        try:
            try:  # the body the server holds whole (the usual case) without a coroutine of ``_body``'s
                body = self._held_body(scope, limit)
            except _Refusal as r:
                await self._body_refused(r, receive, send, path)
                return
            if body is not None:
                held = len(body)
            else:
                body, held = await self._body(receive, send, limit, scope, path)
                if body is None:
                    return  # the client left, or refused
            refusal = self._slot_refusal(share, receive, send, path)
            if refusal is not None:
                await refusal
                return
            self.inflight += 1
            status = 0
            try:
                async def send_(message: Message) -> None:
                    # as ``_run``'s ``send_bounded`` for a write's answer: the head (of known
                    # length; held by the server until the body) as it is, the body bounded
                    nonlocal status
                    if message["type"] == "http.response.start":
                        status = message["status"]
                        await send(message)
                        return
                    await within(message, self.send_timeout)

                try:
                    if await self.writes(scope, body, send_):
                        return
                except TimeoutError:
                    log.info("client did not read its response; connection dropped",
                             extra={"path": path, "timeout_s": self.send_timeout})
                    return
                await self._run(scope, replay(body, receive), send, None, body, offer_writes=False)
            finally:
                if status:
                    self.metrics.answered(status)
                self.inflight -= 1
                self.shares.give(share)
        finally:
            self.body_bytes -= held
            if charged is not None:
                writertime.CURRENT.reset(charged)

    def _rate_refusal(self, key: str, length: int | None, receive: Receive, send: Send,
                      pending: bool, path: str) -> Awaitable[None] | None:
        """Draw a write of ``length`` body bytes on the write buckets of the token whose
        ``_token_key`` is ``key`` (``WriteRate``, before the body is read): None when it
        fits, else the refusal for the caller to await (429 ``rate_limited`` with
        ``Retry-After``; ``pending``: a body is left unread, the connection closes). Not a
        coroutine itself: the common case makes none (bench/README.md, "The close path,
        session 20: serve's loop")."""
        wait = self.write_rate.take(key, length or 0, time.monotonic())
        if wait <= 0:
            return None
        return self._refuse(receive, send, 429, "rate_limited",
                            "this token writes faster than the control plane allows; "
                            "retry after the time in Retry-After",
                            headers={"Retry-After": str(max(1, math.ceil(wait)))},
                            close=pending, path=path)

    def _writer_refusal(self, charge: writertime.Charge | None, receive: Receive, send: Send,
                        pending: bool, path: str) -> Awaitable[None] | None:
        """None when ``charge``'s token may write now (or ``charge`` is None: not charged),
        else the refusal for the caller to await: 429 ``rate_limited`` with ``Retry-After``
        while the token's writer time (``memfuse.server.writertime``) is in debt, before the
        body is read or the write queues. Not a coroutine itself, as ``_rate_refusal``."""
        if charge is None:
            return None
        e = self.writer_time.refused_now(charge.key)
        if e is None:
            return None
        return self._refuse(receive, send, e.status, e.code, e.detail, headers=e.headers, close=pending, path=path)

    async def _body(self, receive: Receive, send: Send, limit: int, scope: Scope,
                    path: str) -> tuple[bytes | None, int]:
        """``_read_body``, its refusals (413, 408, 503) answered (the connection then closes):
        (None, 0) when refused or the client left, else (the body, the bytes of
        ``body_budget`` it holds: the caller gives them back)."""
        try:
            return await self._read_body(receive, limit, scope)
        except _Refusal as r:
            await self._body_refused(r, receive, send, path)
            return None, 0

    async def _body_refused(self, r: _Refusal, receive: Receive, send: Send, path: str) -> None:
        """Answer a refusal of the body (``_read_body``, ``_held_body``); the connection closes."""
        await self._refuse(receive, send, r.status, r.code, r.detail, headers=r.headers, close=True, path=path)

    def _slot_refusal(self, share: str | None, receive: Receive, send: Send, path: str) -> Awaitable[None] | None:
        """None when an ordinary request whose body is read gets a request slot (one of
        ``share``'s taken: the caller gives it back), else its refusal for the caller to
        await: 503 ``overloaded`` at ``max_inflight``, 429 ``too_many_requests`` when
        ``share``'s (``_share_key``) is full; both end the connection after their answer
        (attack17 F4: requests a client pipelined behind one would each be refused in turn,
        long after it left). Not a coroutine itself, as ``_rate_refusal``."""
        if self.inflight >= self.max_inflight:
            return self._refuse(receive, send, 503, "overloaded",
                                "the server is at its request limit; retry",
                                headers={"Retry-After": "1"}, close=True, path=path)
        if share is not None and not self.shares.take(share):
            return self._refuse(receive, send, 429, "too_many_requests",
                                "this client has as many requests in the server at once as "
                                "one token (or one address without a token) may; retry",
                                headers={"Retry-After": "1"}, close=True, path=path)
        return None

    def _token_key(self, token: str, digest: str | None = None) -> str:
        """The key of ``token``'s write buckets and request share (a digest, so the tables
        keyed by it hold no token): the first 32 characters of its ``token_digest``
        (``digest``, when the caller has it), which is remembered per token for the next
        request (hashed once, not per request: ``write`` gives it to the token cache too).
        Called only for a token that authenticated, so only those are kept; the memo is
        cleared past ``RATE_KEYS_MAX`` tokens (its keys are raw tokens, as they were when it
        held the 32 characters alone, since session 12: bounded, event-loop only)."""
        digests = self._digests
        kept = digests.get(token)
        if kept is None:
            if len(digests) >= RATE_KEYS_MAX:
                digests.clear()
            kept = digests[token] = digest if digest is not None else token_digest(token)
        return kept[:32]

    def _share_key(self, principal: Principal | None, token: str | None, scope: Scope) -> str | None:
        """Whose share of the slots an ordinary request takes (``Shares``): its token's (by
        ``_token_key``), else, without a token (console pages, the API docs), its client
        address's (behind a proxy: the proxy's, as for ``Connections``); None when the
        server gave no address."""
        if principal is not None and token:
            return self._token_key(token)
        peer = scope.get("client")
        if isinstance(peer, (tuple, list)) and peer:
            return f"addr {peer[0]}"
        return None

    async def _run_read(self, scope: Scope, body: bytes, receive: Receive, send: Send,
                        share: str | None, cheap: bool) -> None:
        """``_run`` for a read (an ordinary ``GET`` under ``/v1/`` or ``/ui/``, a read-only tool
        call: ``memfuse.server.readslots.read_call``; ``cheap``: estimated cheap) under a ``Budget`` of
        ``read_budget`` s: once its body is read the connection's messages are watched here,
        and its client's disconnect, or the budget's end, interrupts its database work
        (``memfuse.server.budget``); the app then answers 504 ``timeout`` if the client is
        still there. The app's ``receive`` gives the body, then ``http.disconnect`` once the
        client has gone. The read first waits for one of ``share``'s read slots (``reads``,
        ``memfuse.server.readslots``) within the same budget: past it, 504 ``timeout`` here
        (the body ``refusal_bodies`` gives for the path, e.g. MCP's; its client gone: no answer)."""
        b = budget.Budget()
        gone = anyio.Event()
        waiting = anyio.CancelScope()  # the wait for a read slot, cancelled when the budget ends
        answered = False  # the answer's last byte handed to the server: a disconnect now is its end

        async def send_(message: Message) -> None:
            nonlocal answered
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                answered = True  # before the send: hypercorn ends the stream (a disconnect) in it
            await send(message)

        async def watch() -> None:
            with anyio.move_on_after(self.read_budget):
                while (await receive())["type"] != "http.disconnect":
                    pass
                if answered:  # hypercorn's end of an answered request, not the client leaving
                    return
                b.end(budget.GONE)
                gone.set()
                waiting.cancel()
                return
            b.end(budget.DEADLINE)
            waiting.cancel()

        async def gone_receive() -> Message:  # the connection's messages are watch()'s
            await gone.wait()
            return {"type": "http.disconnect"}

        app_receive = replay(body, gone_receive)

        reset = budget.CURRENT.set(b)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch)
                try:
                    held = share is None  # a read without a key (no address) takes no slot
                    with waiting:
                        if not held:
                            assert share is not None
                            await self.reads.acquire(share, cheap)
                            held = True
                    if not held:
                        if b.reason == budget.DEADLINE:  # counted below, as a read cut at it
                            problem, ctype = self._refusal_body(scope["path"], 504, "timeout",
                                                                b.error().detail)
                            self.metrics.answered(504)
                            await send_({"type": "http.response.start", "status": 504, "headers": [
                                (b"content-type", ctype),
                                (b"content-length", str(len(problem)).encode())]})
                            await send_({"type": "http.response.body", "body": problem})
                        return
                    try:
                        await self._run(scope, app_receive, send_, None, body)
                    finally:
                        if share is not None:
                            self.reads.release(share)
                finally:
                    tg.cancel_scope.cancel()
        finally:
            budget.CURRENT.reset(reset)
            if b.reason == budget.GONE:
                self.metrics.refused.labels("client_gone").inc()
            elif b.reason == budget.DEADLINE:
                self.metrics.refused.labels("timeout").inc()

    async def _run(self, scope: Scope, receive: Receive, send: Send, lease: Lease | None,
                   body: bytes = b"", offer_writes: bool = True) -> None:
        """Run the app with bounded sends (an ordinary request first offered to ``writes``
        with its ``body``, unless ``offer_writes`` is False: ``write`` did); a lease's
        response runs in its scope and, when the lease is cut, is ended here."""
        state: dict[str, Any] = {"status": 0, "type": b"", "done": False}
        # One cancel scope around the whole request, armed only while a send is under way:
        # a stream sends thousands of lines, and a scope per send was a third of a
        # heartbeat's CPU. Made where it is entered (``send_bounded`` uses it only in there):
        # an answer of ``writes`` sent ``within`` needs none.
        # the HTTP server's own bounded send (extension ``SEND_WITHIN``), for the answers of
        # ``writes``: no scope to enter nor arm (memfuse.server.lean); None under hypercorn
        within: Callable[[Message, float], Awaitable[None]] | None = None
        # the front door cleared the connection already when it authenticated the request
        # (``Connections.cleared`` is then a no-op: the connection never counts again)
        cleared = scope.get("memfuse.principal")
        writes = self.writes if offer_writes else None
        if lease is None and writes is not None:
            within = (scope.get("extensions") or {}).get(SEND_WITHIN)

        async def send_bounded(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
                if (message["status"] < 400 or scope.get("memfuse.authenticated")) and cleared is None:
                    # served, or refused to a client the app authenticated (the console checks
                    # its own sessions: a 429 past a token's live pages is not anonymous)
                    self.connections.cleared(scope.get("client"))
                ctype: bytes | None = None
                length = chunked = False
                for k, v in message.get("headers", ()):
                    k = k.lower()
                    if k == b"content-type":
                        ctype = v if ctype is None else ctype
                    elif k == b"content-length":
                        length = True
                    elif k == b"transfer-encoding":
                        chunked = True
                state["type"] = ctype or b""
                if length and not chunked and message["status"] >= 200:
                    # the head of an answer of known length is held by the HTTP server until
                    # the body (memfuse.server.serve's ``_HTTP11Only``, memfuse.server.lean):
                    # this send does not wait on the client, so it is not armed (two
                    # deadline moves of a cancel scope less per answer)
                    await send(message)
                    return
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["done"] = True
            if within is not None:  # raises TimeoutError when the send does not finish in time
                await within(message, self.send_timeout)
                return
            bound.deadline = anyio.current_time() + self.send_timeout
            try:
                await send(message)
            finally:
                bound.deadline = float("inf")

        try:
            tried = within is not None
            if tried:
                assert writes is not None
                if await writes(scope, body, send_bounded):
                    return
                within = None  # the app's sends: under ``bound``, as under hypercorn
            bound = anyio.CancelScope()
            with bound:
                if lease is None:
                    if not (not tried and writes is not None
                            and await writes(scope, body, send_bounded)):
                        await self.app(scope, receive, send_bounded)
                else:
                    with lease.scope:
                        if not (self.fast is not None and await self.fast(scope, receive, send_bounded)):
                            await self.app(scope, receive, send_bounded)
                    why = lease.ended
                    if why is not None and not state["done"] and not scope.get("memfuse.disconnected"):
                        await self._end_cut(why, state, send_bounded)
            if bound.cancelled_caught:  # a send did not finish in time
                raise TimeoutError
        except TimeoutError:
            # the connection is gone (the kernel's TCP_USER_TIMEOUT aborted it, see
            # memfuse.server.serve.listen_socket, or this bound cut the send): nothing is
            # left to answer, and it is the client's doing, not a server error
            log.info("client did not read its response; connection dropped",
                     extra={"path": scope["path"], "timeout_s": self.send_timeout})
        finally:
            if state["status"]:
                self.metrics.answered(state["status"])

    async def _end_cut(self, why: str, state: dict[str, Any], send: Send) -> None:
        """End a long-lived response whose token was revoked or expired: a 401 problem when
        nothing was sent, else the stream's last line (NDJSON: ``{"error": problem}``; SSE:
        a ``gone`` event), then the end."""
        problem = {"type": "about:blank", "title": "Unauthorized", "status": 401, "detail": why,
                   "code": "unauthorized"}
        log.info("long-lived response ended: %s", why)
        try:
            if not state["status"]:
                body = json.dumps(problem).encode()
                await send({"type": "http.response.start", "status": 401, "headers": [
                    (b"content-type", PROBLEM_JSON), (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body": body})
                return
            ctype = state["type"]
            if ctype.startswith(b"application/x-ndjson"):
                last = b'{"error":' + json.dumps(problem).encode() + b"}\n"
            elif ctype.startswith(b"text/event-stream"):
                last = b'event: gone\ndata: {"status": 401}\n\n'
            else:
                last = b""
            await send({"type": "http.response.body", "body": last, "more_body": False})
        except Exception:  # noqa: BLE001 - the client may be gone; nothing more to do
            log.debug("could not end a cut response", exc_info=True)

    # ------------------------------------------------------------ the steps

    async def _authenticate(self, token: str | None, instance: str | None) -> Principal:
        """The principal of ``token``, deciding without the database when it can (see the
        module docstring). Raises ``ServiceError`` 401, ``SQLAlchemyError``."""
        svc = self.svc
        p = svc.authenticate_cached(token, instance)  # raises 401 for a missing token
        if p is not None:
            return p
        assert token is not None
        digest = sha256_hex(token.encode("utf-8", "surrogatepass"))
        bad = self._bad_tokens.get(digest)
        now = time.monotonic()
        if bad is not None:
            if bad[0] > now:
                raise ServiceError(401, "unauthorized", bad[1], headers={"WWW-Authenticate": "Bearer"})
            del self._bad_tokens[digest]
        if self._auth_limiter is None:
            self._auth_limiter = anyio.CapacityLimiter(AUTH_THREADS)
        try:
            return await anyio.to_thread.run_sync(svc.authenticate, token, instance, limiter=self._auth_limiter)
        except ServiceError as e:
            if e.status == 401:
                if len(self._bad_tokens) >= BAD_TOKEN_MAX:
                    self._bad_tokens.clear()
                self._bad_tokens[digest] = (now + BAD_TOKEN_SECONDS, e.detail)
            raise

    async def _read_body(self, receive: Receive, limit: int, scope: Scope | None = None) -> tuple[bytes | None, int]:
        """The whole body (None when the client left) and the bytes of ``body_budget`` it
        holds now (the caller gives them back). Raises ``_Refusal`` 413 / 408 / 503. A body
        the HTTP server holds whole already (``scope``'s extension ``BODY``) is taken at once
        (nothing to wait for: no deadline), under the same bounds."""
        whole = self._held_body(scope, limit) if scope is not None else None
        if whole is not None:
            return whole, len(whole)
        chunks: list[bytes] = []
        size = 0
        deadline = anyio.current_time() + self.body_timeout
        try:
            while True:
                message = None
                with anyio.move_on_after(max(0.0, min(self.receive_timeout, deadline - anyio.current_time()))):
                    message = await receive()
                if message is None:
                    raise _Refusal(408, "request_timeout", "the request body did not arrive in time")
                if message["type"] == "http.disconnect":
                    self.body_bytes -= size
                    return None, 0
                piece = message.get("body", b"")
                if piece:
                    if size + len(piece) > limit:
                        raise _Refusal(413, "too_large",
                                       f"the body is larger than this endpoint takes ({limit} bytes)")
                    if self.body_bytes + len(piece) > self.body_budget:
                        raise _Refusal(503, "overloaded", "the server holds too many request bodies; retry",
                                       {"Retry-After": "1"})
                    size += len(piece)
                    self.body_bytes += len(piece)
                    chunks.append(piece)
                if not message.get("more_body", False):
                    break
        except BaseException:
            self.body_bytes -= size
            raise
        return (chunks[0] if len(chunks) == 1 else b"".join(chunks)), size

    def _held_body(self, scope: Scope, limit: int) -> bytes | None:
        """The whole body when the HTTP server holds it already (``scope``'s extension
        ``BODY``: nothing to wait for, no deadline), as ``_read_body`` takes one piece that
        ends the body, under the same bounds: its bytes then held in ``body_bytes`` (the
        caller gives them back); None when the server does not hold it whole. Raises
        ``_Refusal`` 413 / 503."""
        take = (scope.get("extensions") or {}).get(BODY)
        whole = take() if take is not None else None
        if whole is not None:
            if len(whole) > limit:
                raise _Refusal(413, "too_large", f"the body is larger than this endpoint takes ({limit} bytes)")
            if self.body_bytes + len(whole) > self.body_budget:
                raise _Refusal(503, "overloaded", "the server holds too many request bodies; retry",
                               {"Retry-After": "1"})
            self.body_bytes += len(whole)
        return whole

    async def _probe(self, path: str, receive: Receive, send: Send) -> None:
        if path == "/healthz":
            headers: list[tuple[bytes, bytes]] = []
            status, body, ctype = 200, b'{"ok":true}', b"application/json"
        elif path == "/readyz":
            status, body, ctype, headers = await self._readiness()
        else:
            status, body = 200, await self._metrics_text()
            ctype, headers = b"text/plain; version=0.0.4; charset=utf-8", []
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", ctype), (b"content-length", str(len(body)).encode()), *headers]})
        await send({"type": "http.response.body", "body": body})

    async def _readiness(self) -> tuple[int, bytes, bytes, list[tuple[bytes, bytes]]]:
        """``/readyz``: 200 when ``SELECT 1`` answers (on the probe's own thread; concurrent
        probes share one check; a success is reused for ``READY_REUSE_SECONDS``); 503 problem
        ``database_unavailable`` (reason logged) or ``shutting_down``."""
        retry = [(b"retry-after", b"1")]
        if self.svc.closing:
            return 503, _problem(503, "shutting_down", "the server is shutting down"), PROBLEM_JSON, retry
        if self._ready_lock is None:
            self._ready_lock = anyio.Lock()
            self._probe_limiter = anyio.CapacityLimiter(1)
        async with self._ready_lock:
            if anyio.current_time() - self._ready_at > READY_REUSE_SECONDS:
                try:
                    await anyio.to_thread.run_sync(self._select_1, limiter=self._probe_limiter)
                except SQLAlchemyError as e:
                    log.warning("readiness: database unavailable: %s", type(e).__name__)
                    return (503, _problem(503, "database_unavailable", "the database does not answer"),
                            PROBLEM_JSON, retry)
                self._ready_at = anyio.current_time()
        return 200, b'{"ready":true}', b"application/json", []

    async def _metrics_text(self) -> bytes:
        """``GET /metrics``'s body: ``ServerMetrics.render`` run on a worker thread (one at a
        time), never on the event loop, and shared. A scrape is answered by the first render
        that *started after it arrived* (so it sees every count made before it), and scrapes
        that arrive while a render runs share the next one: a flood of scrapes (an anonymous
        client on 32 keep-alive connections, attack 12 A5) costs one render per wave instead of
        one per request (~20 ms of CPU each on the loop before, with ~125 KB of text), and
        never holds the loop for a render."""
        arrived = self._metrics_started  # renders started before this scrape arrived
        if self._metrics_lock is None:
            self._metrics_lock = anyio.Lock()
            self._metrics_limiter = anyio.CapacityLimiter(1)
        async with self._metrics_lock:
            # INVARIANT: renders run one at a time (this lock); ``_metrics_done`` is the number
            # of the last finished one and ``_metrics_body`` its text
            if self._metrics_done > arrived:
                return self._metrics_body  # started after this scrape arrived: fresh enough
            self._metrics_started += 1
            number = self._metrics_started
            body = await anyio.to_thread.run_sync(self.metrics.render, limiter=self._metrics_limiter)
            self._metrics_body, self._metrics_done = body, number
            return body

    def _select_1(self) -> None:
        with self.svc.db.read_conn() as conn:
            conn.exec_driver_sql("SELECT 1")

    # ------------------------------------------------------------ refusals

    def _count(self, status: int, code: str) -> None:
        self.metrics.refused.labels(code).inc()
        self.metrics.answered(status)
        now = time.monotonic()
        if status != 401 and now - self._last_refusal_log > 5:  # one line per 5 s, not one per refusal
            self._last_refusal_log = now
            log.warning("refusing requests: %s", code, extra={
                "status": status, "inflight": self.inflight, "streams": self.streams.open})

    async def _refuse(self, receive: Receive, send: Send, status: int, code: str, detail: str, *,
                      headers: dict[str, str] | None = None, close: bool = False, path: str = "") -> None:
        """Answer a problem (RFC 9457) now, or the body ``refusal_bodies`` gives for ``path``;
        with ``close``, the request's body is left unread and the connection is closed after
        the answer."""
        self._count(status, code)
        body, ctype = self._refusal_body(path, status, code, detail)
        hdrs = [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]
        hdrs += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
        messages: list[Message] = [{"type": "http.response.start", "status": status, "headers": hdrs},
                    {"type": "http.response.body", "body": body}]

        async def respond(scope: Scope, receive_: Receive, send_: Send) -> None:
            for m in messages:
                await send_(m)

        await self._drained(receive, respond, {}, send, close=close)

    def _refusal_body(self, path: str, status: int, code: str, detail: str) -> tuple[bytes, bytes]:
        """(body, content type) of a refusal of ``path``: what ``refusal_bodies`` gives for
        it, else a problem (RFC 9457)."""
        render = next((fn for prefix, fn in self.refusal_bodies.items() if path.startswith(prefix)), None)
        if render is not None:
            return render(status, code, detail)
        return _problem(status, code, detail), PROBLEM_JSON

    async def _drained(self, receive: Receive, response: Any, scope: Scope, send: Send, *, close: bool) -> None:
        """Send ``response`` (an ASGI app) while discarding what the server queued of the
        request's body, so that the response can finish (see the module docstring)."""
        async def send_closing(message: Message) -> None:
            if close and message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        async with anyio.create_task_group() as tg:
            async def drain() -> None:
                with anyio.move_on_after(DRAIN_SECONDS):
                    while (await receive())["type"] != "http.disconnect":
                        pass

            tg.start_soon(drain)
            await response(scope, _nothing, send_closing)


async def _nothing() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


def replay(body: bytes, receive: Receive) -> Receive:
    """An ASGI ``receive`` for an app whose request body was read before it runs: its first
    call gives ``body`` whole (one ``http.request`` message, ``more_body`` False), every later
    call what ``receive`` gives (the connection's own messages; a read's disconnect once its
    watcher saw it, ``_run_read``; the fake control plane's disconnect when its client
    closes the response, ``memfuse.fake``). Used wherever a body is read ahead of an app:
    the gate's requests, ``/mcp`` (``memfuse.server.agent_tools``) and the fake's streams."""
    given = False

    async def replay() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


_GATE_HEADERS = frozenset({b"content-length", b"transfer-encoding", b"authorization", b"x-memfuse-instance",
                           b"x-api-key", b"memfuse-store-created", b"memfuse-writer"})


def _headers(scope: Scope) -> tuple[int, int | None, bool, str | None, str | None, str | None, str | None,
                                   str | None]:
    """(the head's size: the target and every header name and value, 4 bytes more a header;
    Content-Length or None, chunked, bearer token or None, X-Memfuse-Instance or None,
    X-Api-Key or None, Memfuse-Store-Created or None, Memfuse-Writer or None), in one pass
    over the headers. The token (or the X-Api-Key) is ``TWO_TOKENS`` when the header is
    given more than once; the token is when a bearer token and an X-Api-Key that differ
    are both given (on any path: which one counts is not ours to guess)."""
    length: int | None = None
    chunked = False
    seen_auth = seen_key = False
    token = instance = api_key = store_created = writer = None
    head = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
    for k, v in scope.get("headers", ()):
        head += len(k) + len(v) + 4
        if k not in _GATE_HEADERS:
            continue  # one set lookup for the headers the front door does not read
        if k == b"content-length":
            try:
                length = int(v)
            except ValueError:
                length = None
        elif k == b"transfer-encoding":
            chunked = b"chunked" in v.lower()
        elif k == b"authorization":
            if seen_auth:  # two credentials: which one counts is not ours to guess (``TWO_TOKENS``)
                token = TWO_TOKENS
                continue
            seen_auth = True
            scheme, _, cred = v.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and cred.strip():
                token = cred.strip()
        elif k == b"x-memfuse-instance":
            instance = v.decode("latin-1")
        elif k == b"x-api-key":
            if seen_key:
                api_key = TWO_TOKENS
                continue
            seen_key = True
            api_key = v.decode("latin-1").strip() or None
        elif k == b"memfuse-store-created":
            store_created = v.decode("latin-1")
        elif k == b"memfuse-writer":
            writer = v.decode("latin-1")
    if token is not None and api_key is not None and token != api_key:
        token = TWO_TOKENS  # a bearer token and another X-Api-Key: two credentials (attack20 F3)
    return head, length, chunked, token, instance, api_key, store_created, writer


def _problem(status: int, code: str, detail: str) -> bytes:
    return json.dumps({"type": "about:blank", "title": _TITLES.get(status, "Error"), "status": status,
                       "detail": detail, "code": code}).encode()
