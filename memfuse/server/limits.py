"""Metrics of the control plane (``GET /metrics``, Prometheus text, served by the front door
``memfuse.server.gate``): requests by status class, requests in flight, long-polls waiting,
streams and long-lived responses open, refusals by reason, connections without a token yet,
database statements (``ServerMetrics`` and its collectors).

The limits themselves live where they are applied: ``memfuse.server.gate`` (authentication
and size from the headers, body deadlines, request slots, the per-address connection cap,
send timeouts), ``memfuse.server.streamclass`` (long-lived responses) and
``memfuse.server.serve`` (header deadline, socket buffers, ``TCP_USER_TIMEOUT``).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

if TYPE_CHECKING:  # for the annotations only (they import this module)
    from sqlalchemy.engine import Engine

    from memfuse.server.streamclass import StreamClass
    from memfuse.server.streams import Streams
    from memfuse.server.wakeups import Bus, Notifier

log = logging.getLogger(__name__)


class _Connections(Protocol):
    @property
    def unauthenticated(self) -> int: ...

    @property
    def refused(self) -> int: ...

    @property
    def evicted(self) -> int: ...

    @property
    def evicted_at_address(self) -> int: ...

    @property
    def refused_at_cap(self) -> int: ...

    @property
    def open(self) -> int: ...

    @property
    def ended_early(self) -> dict[str, int]: ...


class Front(Protocol):
    """What the metrics read of the front door (``memfuse.server.gate.Gate``; named here, so
    this module, which the gate imports, imports nothing of it)."""

    @property
    def connections(self) -> _Connections: ...

    @property
    def body_bytes(self) -> int: ...

SEND_TIMEOUT = 30.0  # s a send to a client may take (memfuse.server.gate, memfuse.server.serve)
MAX_HEAD = 16 * 1024  # bytes of a request line and headers (hypercorn's default); 431 past it
# Answers in a row a connection is sent while its client's next request is in already (it
# pipelines without reading): the last carries ``Connection: close`` (memfuse.server.serve,
# hypercorn's path; the lean path serves record writes, bounded by the write rate). A client
# that reads each answer before its next request never counts; one that pipelines and never
# reads cost ~350 answers a connection before (its send buffer full: attack17 F4).
MAX_PIPELINED = 64
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
        self.db_statements = StatementCount()
        self._extra: list[Callable[[], list[Metric]]] = []
        # the ``requests`` counter's child per status class ("2xx"), looked up once
        # (``labels`` validates, hashes and locks per call)
        self._answered: dict[int, Any] = {}
        r.register(self)

    def answered(self, status: int) -> None:
        """Count an answer of HTTP ``status`` in ``requests`` (by class: ``"2xx"``...)."""
        cls = status // 100
        child = self._answered.get(cls)
        if child is None:
            child = self._answered[cls] = self.requests.labels(f"{cls}xx")
        child.inc()

    def add_collector(self, fn: Callable[[], list[Metric]]) -> None:
        """``fn()`` returns metric families, read at each scrape."""
        self._extra.append(fn)

    def collect(self) -> Iterator[Metric]:  # prometheus_client custom collector protocol
        yield self.db_statements.metric()
        for fn in self._extra:
            yield from fn()

    def describe(self) -> list[Metric]:
        return []

    def count_statements(self, engine: Engine) -> None:
        """Count every statement ``engine`` executes (in ``db_statements``)."""
        from sqlalchemy import event

        # retval: called as it is (SQLAlchemy wraps a listener without it in one more call)
        event.listen(engine, "before_cursor_execute", self.db_statements.listener(), retval=True)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StatementCount:
    """The ``memfuse_server_db_statements`` counter: SQL statements sent to the database,
    counted by a ``before_cursor_execute`` listener (``listener()``) per thread, without a
    lock, and summed at each scrape (``metric()``, ``value()``): exact across threads, as
    each count has one writer, its thread, and a thread's count is added to
    ``_ended`` only once the thread has ended. prometheus_client's ``Counter.inc`` (a lock
    and three Python calls, ~6 k instructions) per statement, ~12 statements a create, was
    ~4 % of a create's writer thread (bench/README.md, "The close path, session 15: serve's
    writer")."""

    NAME = "memfuse_server_db_statements"
    HELP = ("SQL statements sent to the database (the commit listener's LISTEN and the SQLite "
            "watcher's PRAGMA data_version excluded)")

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        # GUARDED_BY(_lock): each running thread's count (a one-item list only that thread
        # adds to); the counts of threads that have ended, summed
        self._counts: list[tuple[threading.Thread, list[int]]] = []
        self._ended = 0
        self._created = time.time()  # the counter's ``_created`` sample, as a Counter has it

    def listener(self) -> Callable[..., tuple[str, Any]]:
        """A ``before_cursor_execute`` listener (to register with ``retval=True``: it returns
        the statement and parameters unchanged) that counts one statement."""
        local = self._local
        new = self._new

        def count(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any,  # noqa: ARG001
                  executemany: bool) -> tuple[str, Any]:
            try:
                local.count[0] += 1
            except AttributeError:  # this thread's first statement
                new()[0] += 1
            return statement, parameters

        return count

    def _new(self) -> list[int]:
        """This thread's count, made (and the counts of ended threads folded into ``_ended``)."""
        cell = [0]
        with self._lock:
            live = []
            for t, c in self._counts:
                if t.is_alive():
                    live.append((t, c))
                else:  # it counts no more: its last statement was before it ended
                    self._ended += c[0]
            live.append((threading.current_thread(), cell))
            self._counts = live
        self._local.count = cell
        return cell

    def value(self) -> int:
        """Statements counted so far, by every thread."""
        with self._lock:
            return self._ended + sum(c[0] for _, c in self._counts)

    def metric(self) -> Metric:
        """The counter's family for a scrape (``_total`` and ``_created``, as a Counter)."""
        return CounterMetricFamily(self.NAME, self.HELP, value=self.value(), created=self._created)


def notifier_collector(notifier: Notifier, bus: Bus,
                       streams: Streams | None = None) -> Callable[[], list[Metric]]:
    """Metric families of the long-poll waiters, the streams (``memfuse.server.streams``)
    and the commit bus."""

    def collect() -> list[Metric]:
        g = GaugeMetricFamily("memfuse_server_long_polls", "Long-polls waiting now")
        g.add_metric([], notifier.waiting)
        w = CounterMetricFamily("memfuse_server_wakeups", "Long-polls woken by commits")
        w.add_metric([], notifier.wakeups)
        c = GaugeMetricFamily("memfuse_server_bus_connected",
                              "1 while commits of other processes arrive without polling")
        c.add_metric([], 1 if bus.connected else 0)
        s = CounterMetricFamily("memfuse_server_bus_scans", "Shared scans for commits of other processes")
        s.add_metric([], bus.scans)
        out: list[Metric] = [g, w, c, s]
        if streams is not None:
            o = GaugeMetricFamily("memfuse_server_streams", "Change-feed and event streams open now")
            o.add_metric([], streams.open)
            n = CounterMetricFamily("memfuse_server_stream_lines", "Lines sent on streams (pages, "
                                    "heartbeats, errors)")
            n.add_metric([], streams.lines_sent)
            out += [o, n]
        return out

    return collect


def lean_collector(state: Any) -> Callable[[], list[Metric]]:
    """Metric families of the lean path of the server serving the app whose ``state`` this is
    (``memfuse.server.lean.LeanHTTP``, ``state.lean`` once ``serve`` runs; none before, or
    without it): the record writes it answered, and the connections it handed to hypercorn
    and got back (``takes_back``), so an operator sees which path a sidecar's writes take."""

    def collect() -> list[Metric]:
        lean = getattr(state, "lean", None)
        if lean is None:
            return []
        served = CounterMetricFamily("memfuse_server_lean_requests",
                                     "Record writes answered on the lean path (without hypercorn's "
                                     "per-request machinery)")
        served.add_metric([], lean.served)
        moved = CounterMetricFamily("memfuse_server_lean_handovers",
                                    "Keep-alive connections moved between the lean path and hypercorn, by "
                                    "direction (to_hypercorn: a request other than a record write after "
                                    "one; back: a record write after hypercorn's answer)", labels=["direction"])
        moved.add_metric(["to_hypercorn"], lean.handed_over)
        moved.add_metric(["back"], lean.handed_back)
        return [served, moved]

    return collect


def front_collector(front: Front, stream_class: StreamClass) -> Callable[[], list[Metric]]:
    """Metric families of the front door (``memfuse.server.gate.Gate``) and the long-lived
    responses (``memfuse.server.streamclass.StreamClass``)."""

    def collect() -> list[Metric]:
        o = GaugeMetricFamily("memfuse_server_long_lived", "Long-lived responses open now "
                              "(long-polls, streams, console live pages)")
        o.add_metric([], stream_class.open)
        c = CounterMetricFamily("memfuse_server_long_lived_cut", "Long-lived responses ended by "
                                "their token's revocation or expiry")
        c.add_metric([], stream_class.cut)
        u = GaugeMetricFamily("memfuse_server_unauthenticated_connections",
                              "Connections that have not shown a valid token yet")
        u.add_metric([], front.connections.unauthenticated)
        r = CounterMetricFamily("memfuse_server_connections_refused",
                                "New connections closed at once, their request not arrived: their address "
                                "had too many without a token")
        r.add_metric([], front.connections.refused)
        e = CounterMetricFamily("memfuse_server_connections_evicted",
                                "Connections without a token closed at a cap of them, by reason (oldest: the "
                                "one idle the longest of all, for a new request; address_oldest: the one idle "
                                "the longest of the new request's address, at its cap; no_head: a new one "
                                "whose request had not arrived, at the cap in all)", labels=["reason"])
        e.add_metric(["oldest"], front.connections.evicted)
        e.add_metric(["address_oldest"], front.connections.evicted_at_address)
        e.add_metric(["no_head"], front.connections.refused_at_cap)
        b = GaugeMetricFamily("memfuse_server_request_body_bytes", "Bytes of request bodies held now")
        b.add_metric([], front.body_bytes)
        n = GaugeMetricFamily("memfuse_server_connections", "Connections open now")
        n.add_metric([], front.connections.open)
        g = CounterMetricFamily("memfuse_server_connections_ended",
                                "Connections the server ended early, by reason (client_gone: their client "
                                "had gone, a reset or an answer that could not be sent, and what it had "
                                "sent and pipelined was not run; pipelined: an answer with Connection: "
                                "close after MAX_PIPELINED in a row to a client that pipelines without "
                                "reading)", labels=["reason"])
        for reason, count in front.connections.ended_early.items():
            g.add_metric([reason], count)
        return [o, c, u, r, e, b, n, g]

    return collect
