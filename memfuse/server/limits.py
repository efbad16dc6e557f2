"""Backpressure and metrics of the control plane: an ASGI middleware in front of the app.

- **Queue limit**: at most ``max_inflight`` ordinary requests (everything but a waiting
  long-poll) are in the app at once; one more is answered at once with ``503`` problem
  ``overloaded`` and ``Retry-After: 1`` (RFC 9110 §15.6.4, §10.2.3) instead of queueing until
  the client times out. Behind the queue, requests run in anyio's worker threads (40) on a
  database pool of the same size, so neither grows without bound.
- **Long-polls**: a long-poll (``GET .../changes`` or ``.../events`` with ``wait`` > 0, or a
  stream: ``stream=true``) holds a
  connection and a small task, not a thread. At most ``max_long_polls_per_token`` at once per
  bearer token (429 ``too_many_long_polls``, ``Retry-After: 5``; RFC 6585 §4) and
  ``max_long_polls`` in all (503 ``overloaded``): a client that opens thousands cannot take
  every socket. A sidecar holds one per attached store plus one for its workspace's events.
- **Slow readers and pipelining**: sending any part of a response (a stream's line too) may take at most
  ``send_timeout`` s; a client that does not read its responses is cut off (the connection
  is closed) and its slot freed. hypercorn shields its socket writes from cancellation, so
  the cut is made by the kernel: ``memfuse.server.serve.listen_socket`` gives every
  connection ``TCP_USER_TIMEOUT`` = ``send_timeout`` and a bounded send buffer
  (``SEND_BUFFER``), so a client that pipelines requests on one connection without reading
  gets a few answers computed (what fits in the socket buffers), then none, and its
  connection is closed about ``send_timeout`` s later. A client that reads (a long stream
  included) is never cut; an idle connection (a long-poll waiting) neither.
- **Metrics** (``GET /metrics``, Prometheus text): requests by status class, requests in
  flight, long-polls waiting, refusals by reason, database statements (``ServerMetrics``).
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from urllib.parse import parse_qs

import anyio
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

MAX_INFLIGHT = 128
MAX_LONG_POLLS = 20_000
MAX_LONG_POLLS_PER_TOKEN = 64
SEND_TIMEOUT = 30.0
PROBLEM_JSON = b"application/problem+json"


class ServerMetrics:
    """The control plane's Prometheus registry. ``db_statements`` is counted by a SQLAlchemy
    ``before_cursor_execute`` listener (``count_statements``); gauges read the ``Notifier``
    and ``Bus`` when scraped."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("memfuse_server_requests", "HTTP requests answered, by status class",
                                ["status"], registry=r)
        self.refused = Counter("memfuse_server_refused", "Requests refused by backpressure, by reason",
                               ["reason"], registry=r)
        self.inflight = Gauge("memfuse_server_inflight", "Ordinary requests in the app now", registry=r)
        self.db_statements = Counter("memfuse_server_db_statements",
                                     "SQL statements sent to the database (the commit listener's "
                                     "LISTEN and the SQLite watcher's PRAGMA data_version excluded)",
                                     registry=r)
        self._extra: list[Callable[[], list]] = []
        r.register(self)

    def add_collector(self, fn: Callable[[], list]) -> None:
        """``fn()`` returns metric families, read at each scrape."""
        self._extra.append(fn)

    def collect(self):  # prometheus_client custom collector protocol
        for fn in self._extra:
            yield from fn()

    def describe(self):
        return []

    def count_statements(self, engine) -> None:
        """Count every statement ``engine`` executes."""
        from sqlalchemy import event

        counter = self.db_statements

        @event.listens_for(engine, "before_cursor_execute")
        def _count(conn, cursor, statement, parameters, context, executemany):  # noqa: ARG001
            counter.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def notifier_collector(notifier, bus, streams=None) -> Callable[[], list]:
    """Metric families of the long-poll waiters, the streams (``memfuse.server.streams``)
    and the commit bus."""

    def collect() -> list:
        g = GaugeMetricFamily("memfuse_server_long_polls", "Long-polls waiting now")
        g.add_metric([], notifier.waiting)
        w = CounterMetricFamily("memfuse_server_wakeups", "Long-polls woken by commits")
        w.add_metric([], notifier.wakeups)
        c = GaugeMetricFamily("memfuse_server_bus_connected",
                              "1 while commits of other processes arrive without polling")
        c.add_metric([], 1 if bus.connected else 0)
        s = CounterMetricFamily("memfuse_server_bus_scans", "Shared scans for commits of other processes")
        s.add_metric([], bus.scans)
        out = [g, w, c, s]
        if streams is not None:
            o = GaugeMetricFamily("memfuse_server_streams", "Change-feed and event streams open now")
            o.add_metric([], streams.open)
            n = CounterMetricFamily("memfuse_server_stream_lines", "Lines sent on streams (pages, "
                                    "heartbeats, errors)")
            n.add_metric([], streams.lines_sent)
            out += [o, n]
        return out

    return collect


class Backpressure:
    """ASGI wrapper of the app: the limits of the module docstring, and ``GET /metrics``.

    ``fast(scope, receive, send)``, when given, is tried first for long-polls: it returns True
    when it answered (``memfuse.server.longpoll.FastPath``), else ``app`` serves the request.
    """

    def __init__(
        self,
        app: ASGIApp,
        metrics: ServerMetrics,
        *,
        max_inflight: int = MAX_INFLIGHT,
        max_long_polls: int = MAX_LONG_POLLS,
        max_long_polls_per_token: int = MAX_LONG_POLLS_PER_TOKEN,
        send_timeout: float = SEND_TIMEOUT,
        fast: Callable[[Scope, Receive, Send], Any] | None = None,
    ) -> None:
        self.app = app
        self.fast = fast
        self.metrics = metrics
        self.max_inflight = max_inflight
        self.max_long_polls = max_long_polls
        self.max_long_polls_per_token = max_long_polls_per_token
        self.send_timeout = send_timeout
        self.inflight = 0
        self.long_polls = 0
        self._per_token: dict[str, int] = {}
        self._last_refusal_log = 0.0

    @staticmethod
    def _is_long_poll(scope: Scope) -> bool:
        if scope["method"] != "GET":
            return False
        path: str = scope["path"]
        if not (path.endswith("/changes") or path.endswith("/events")):
            return False
        qs = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        if qs.get("stream", ["false"])[-1].lower() in ("true", "1", "yes", "on"):
            return True  # a stream (memfuse.server.streams) counts as a long-poll
        try:
            return float(qs.get("wait", ["0"])[-1]) > 0
        except ValueError:
            return False

    @staticmethod
    def _token_key(scope: Scope) -> str:
        for k, v in scope.get("headers", ()):
            if k == b"authorization":
                return hashlib.sha256(v).hexdigest()[:32]
        return ""

    async def _refuse(self, send: Send, status: int, code: str, detail: str, retry_after: int) -> None:
        self.metrics.refused.labels(code).inc()
        self.metrics.requests.labels(f"{status // 100}xx").inc()
        now = time.monotonic()
        if now - self._last_refusal_log > 5:  # one line per 5 s, not one per refusal
            self._last_refusal_log = now
            log.warning("refusing requests: %s", code, extra={
                "status": status, "inflight": self.inflight, "long_polls": self.long_polls})
        body = json.dumps({"type": "about:blank", "title": "Too Many Requests" if status == 429
                           else "Service Unavailable", "status": status, "detail": detail,
                           "code": code}).encode()
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", PROBLEM_JSON), (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(retry_after).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] == "/metrics" and scope["method"] == "GET":
            body = self.metrics.render()
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/plain; version=0.0.4; charset=utf-8"),
                (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        status_seen = 0
        # One cancel scope around the whole request, armed only while a send is under way:
        # a stream sends thousands of lines, and a scope per send (anyio.fail_after) was a
        # third of a heartbeat's CPU.
        bound = anyio.CancelScope()

        async def send_bounded(message: Message) -> None:
            nonlocal status_seen
            if message["type"] == "http.response.start":
                status_seen = message["status"]
            bound.deadline = anyio.current_time() + self.send_timeout
            try:
                await send(message)
            finally:
                bound.deadline = float("inf")

        long_poll = self._is_long_poll(scope)
        key = ""
        if long_poll:
            key = self._token_key(scope)
            if self._per_token.get(key, 0) >= self.max_long_polls_per_token:
                await self._refuse(send, 429, "too_many_long_polls",
                                   f"this token already holds {self.max_long_polls_per_token} long-polls", 5)
                return
            if self.long_polls >= self.max_long_polls:
                await self._refuse(send, 503, "overloaded", "too many long-polls on this server", 5)
                return
            self._per_token[key] = self._per_token.get(key, 0) + 1
            self.long_polls += 1
        else:
            if self.inflight >= self.max_inflight:
                await self._refuse(send, 503, "overloaded", "the server is at its request limit; retry", 1)
                return
            self.inflight += 1
            self.metrics.inflight.inc()
        try:
            with bound:
                if not (long_poll and self.fast is not None and await self.fast(scope, receive, send_bounded)):
                    await self.app(scope, receive, send_bounded)
            if bound.cancelled_caught:  # a send did not finish in time
                raise TimeoutError
        except TimeoutError:
            # the connection is gone (the kernel's TCP_USER_TIMEOUT aborted it, see
            # memfuse.server.serve.listen_socket, or this bound cut the send): nothing is
            # left to answer, and it is the client's doing, not a server error
            log.info("client did not read its response; connection dropped",
                     extra={"path": scope["path"], "timeout_s": self.send_timeout})
        finally:
            if long_poll:
                n = self._per_token.get(key, 1) - 1
                if n:
                    self._per_token[key] = n
                else:
                    self._per_token.pop(key, None)
                self.long_polls -= 1
            else:
                self.inflight -= 1
                self.metrics.inflight.dec()
            if status_seen:
                self.metrics.requests.labels(f"{status_seen // 100}xx").inc()
