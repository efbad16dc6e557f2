"""Prometheus metrics of one sidecar (prometheus-client), served on the admin ``/metrics``.

One ``Metrics`` object per process, holding its own ``CollectorRegistry`` (so tests can create
several). Gauges that mirror live state (outbox depth and age, cache size, sync lag) are
computed at scrape time through callbacks set by ``bind``.
"""
from __future__ import annotations

from bisect import bisect_left
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.gc_collector import GCCollector
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

#: seconds: the upper bounds of the latency histograms' buckets
LAT_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
               0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# the ``le`` labels as prometheus-client writes them ("5e-05", "1.0", "+Inf")
_LE = [floatToGoString(b) for b in LAT_BUCKETS] + ["+Inf"]  # type: ignore[no-untyped-call]


#: one request in ``TIME_EVERY`` of each FUSE operation is timed (the 1st, then every 16th):
#: the latency histogram is a sample, the count is exact (``OpStats``)
TIME_EVERY = 16
TIME_MASK = TIME_EVERY - 1


class OpStats:
    """Count and latency histogram of one FUSE operation, kept as plain numbers.

    Updated on the trio thread for every FUSE request (inline in ``fuse_ops``' guards), so
    it takes no lock: prometheus-client's ``Counter.inc`` plus ``Histogram.observe`` cost
    two to three lock round trips and several Python calls per request, a measurable share
    of a warm ``grep -r`` (bench/README.md, "Warm grep -r: what memfuse adds per request").
    ``n`` counts every request; only one in ``TIME_EVERY`` is timed (``sum``, ``buckets``:
    reading the clock twice and placing the result in a bucket cost more than the
    handler of a reader's ``flush`` itself), so ``memfuse_fuse_op_seconds`` is a sample of
    the latencies (its ``_count`` the requests timed) and ``memfuse_fuse_ops_total`` the
    exact count. ``FuseOpsCollector`` turns them into the metric families at scrape time;
    a scrape from another thread reads a snapshot under the GIL (the sum may lag the
    buckets by one request)."""

    __slots__ = ("n", "sum", "buckets")

    def __init__(self) -> None:
        self.n = 0  # requests handled, timed or not
        self.sum = 0.0  # seconds, over the requests timed
        self.buckets = [0] * (len(LAT_BUCKETS) + 1)  # per bucket, not cumulative; last: +Inf

    @property
    def count(self) -> int:
        """Requests handled (``memfuse_fuse_ops_total``)."""
        return self.n

    def cumulative(self) -> tuple[list[tuple[str, float]], float]:
        """A snapshot as a histogram sample: ((le, cumulative count) per bucket, +Inf last;
        the sum in seconds)."""
        counts, total, cum, buckets = list(self.buckets), self.sum, 0, []
        for le, c in zip(_LE, counts):
            cum += c
            buckets.append((le, float(cum)))
        return buckets, total

    def observe(self, seconds: float) -> None:
        """One request handled and timed at ``seconds``. (The guards in ``fuse_ops`` do the
        same updates inline: a method call per request is a measurable share of its cost.)"""
        self.n += 1
        self.sum += seconds
        self.buckets[bisect_left(LAT_BUCKETS, seconds)] += 1

    def inc(self, amount: int = 1) -> None:
        """Count ``amount`` requests without a latency (as ``Counter.inc``)."""
        self.n += amount


class FuseOpsCollector(Collector):
    """``memfuse_fuse_ops_total{op}`` (counter) and ``memfuse_fuse_op_seconds{op}``
    (histogram, buckets ``LAT_BUCKETS``) from one ``OpStats`` per operation name."""

    def __init__(self) -> None:
        self.ops: dict[str, OpStats] = {}

    def labels(self, op: str) -> OpStats:
        """The ``OpStats`` of operation ``op`` (created on first use)."""
        st = self.ops.get(op)
        if st is None:
            st = self.ops[op] = OpStats()
        return st

    def collect(self) -> Iterator[Metric]:
        """The two families, from a snapshot of every operation's numbers."""
        ops = CounterMetricFamily("memfuse_fuse_ops", "FUSE operations handled", labels=["op"])
        lat = HistogramMetricFamily("memfuse_fuse_op_seconds",
                                    f"FUSE handler latency (one request in {TIME_EVERY} timed)",
                                    labels=["op"])
        for name, st in sorted(self.ops.items()):
            ops.add_metric([name], st.n)
            buckets, total = st.cumulative()
            if not buckets[-1][1]:
                continue  # counted only (``inc``): no histogram, as before any observation
            lat.add_metric([name], buckets, total)
        yield ops
        yield lat


class Count:
    """One child of a ``PlainCounter``: a plain number (``n``), no lock. Callers on the trio
    thread may add to ``n`` inline (``c.n += 1``) instead of calling ``inc``."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0

    def inc(self, amount: int = 1) -> None:
        """Count ``amount`` more (as ``Counter.inc``)."""
        self.n += amount


class PlainCounter(Collector):
    """A labelled counter kept as plain numbers, exported as ``NAME_total{labels}`` at scrape
    time: what ``prometheus_client.Counter`` exposes but its ``_created`` samples, at a
    fraction of its cost per increment (``Counter.inc`` takes a lock and makes three
    Python calls; every create-write-close counts a commit, an API call and the kernel's
    ``ENODATA`` probe: bench/README.md, "The close path, session 20: sidecar"). Updated on
    the trio thread only; a scrape from another thread reads a snapshot under the GIL."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...]) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, list(labelnames)
        self.children: dict[tuple[str, ...], Count] = {}

    def labels(self, *values: str) -> Count:
        """The ``Count`` of these label values (made on first use); look it up once and keep
        it on a hot path."""
        key = tuple(str(v) for v in values)
        if len(key) != len(self.labelnames):
            raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {key}")
        c = self.children.get(key)
        if c is None:
            c = self.children[key] = Count()
        return c

    def collect(self) -> Iterator[Metric]:
        """The counter family, one sample per label set."""
        fam = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for key, c in sorted(self.children.items()):
            fam.add_metric(list(key), c.n)
        yield fam


class ApiLatency(Collector):
    """``memfuse_api_call_seconds{endpoint}``, the control-plane API calls' latency histogram
    (buckets ``LAT_BUCKETS``), one ``OpStats`` per endpoint with every call timed (its ``n``
    the calls observed): the histogram ``prometheus_client.Histogram`` made (no
    ``_created``), updated inline on the trio thread (``mount.Sidecar``'s observer)."""

    def __init__(self) -> None:
        self.endpoints: dict[str, OpStats] = {}

    def labels(self, endpoint: str) -> OpStats:
        """The ``OpStats`` of ``endpoint`` (made on first use)."""
        st = self.endpoints.get(endpoint)
        if st is None:
            st = self.endpoints[endpoint] = OpStats()
        return st

    def collect(self) -> Iterator[Metric]:
        """The histogram family, from a snapshot of every endpoint's numbers."""
        lat = HistogramMetricFamily("memfuse_api_call_seconds", "control-plane API call latency",
                                    labels=["endpoint"])
        for name, st in sorted(self.endpoints.items()):
            lat.add_metric([name], *st.cumulative())
        yield lat


class Metrics:
    """The sidecar's metrics. Names are ``memfuse_*``; latencies in seconds."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        # process_* (CPU seconds, resident memory, open descriptors, start time), python_gc_*,
        # python_info: prometheus-client's standard process collectors, on this registry
        ProcessCollector(registry=r)
        GCCollector(registry=r)
        PlatformCollector(registry=r)
        # per-request count and latency: plain numbers, exported at scrape time (OpStats)
        self.fuse_ops = FuseOpsCollector()
        r.register(self.fuse_ops)
        # counted on every create-write-close: plain numbers (PlainCounter, ApiLatency)
        self.fuse_errors = PlainCounter("memfuse_fuse_errors", "FUSE operations answered with an errno",
                                        ("op", "errno"))
        r.register(self.fuse_errors)
        self.api_calls = PlainCounter("memfuse_api_calls", "control-plane API calls",
                                      ("endpoint", "status"))
        r.register(self.api_calls)
        self.api_latency = ApiLatency()
        r.register(self.api_latency)
        self.refusals = Counter("memfuse_refusals", "writes refused for good, by reason",
                                ["reason"], registry=r)
        self.commits = PlainCounter("memfuse_outbox_committed", "outbox entries committed", ("op",))
        r.register(self.commits)
        self.retries = Counter("memfuse_outbox_retries", "transient commit failures retried", registry=r)
        self.batches = Counter("memfuse_outbox_batches",
                               "batches of outbox entries the control plane answered (POST .../batch)",
                               registry=r)
        self.conflicts = Counter("memfuse_conflicts", "writes that met a newer version (last writer wins)",
                                 registry=r)
        self.overwritten = Counter("memfuse_overwritten",
                                   "this sidecar's writes another writer overwrote by last writer "
                                   "wins (told by the change feed)", registry=r)
        self.merges = Counter("memfuse_merges", "appends that met a newer version and were rebased onto it",
                              registry=r)
        self.remote_changes = Counter("memfuse_sync_changes_applied",
                                      "remote changes applied from the change feed", ["store"], registry=r)
        self.sync_lag = Histogram("memfuse_sync_lag_seconds",
                                  "time from a remote version's creation to its arrival here",
                                  buckets=LAT_BUCKETS, registry=r)
        self.cache_write_errors = Counter(
            "memfuse_cache_write_errors",
            "writes to the sidecar's own cache directory that failed (what: outbox, blobs, "
            "state, dirs), by errno", ["what", "errno"], registry=r)
        self.task_failures = Counter(
            "memfuse_task_failures",
            "unexpected exceptions in long-lived tasks (each logged and the task restarted "
            "with backoff), by task", ["task"], registry=r)
        self.outbox_depth = Gauge("memfuse_outbox_depth", "entries accepted, not yet committed", registry=r)
        self.outbox_oldest = Gauge("memfuse_outbox_oldest_age_seconds", "age of the oldest outbox entry",
                                   registry=r)
        self.cache_records = Gauge("memfuse_cache_records", "records in the local cache", registry=r)
        self.cache_bytes = Gauge("memfuse_cache_bytes", "bytes of record content in the local cache",
                                 registry=r)
        self.stores = Gauge("memfuse_stores_mounted", "stores mounted", registry=r)
        self.ready = Gauge("memfuse_ready", "1 once the first load and mount are done, while the token is accepted", registry=r)
        self.auth_failures = Counter("memfuse_auth_failures",
                                     "control-plane answers 401 to the token in use (revoked, "
                                     "expired or unknown token)", registry=r)
        self.auth_ok = Gauge("memfuse_auth_ok",
                             "0 while the control plane refuses the token in use, else 1",
                             registry=r)
        self.auth_ok.set(1)
        self.control_plane_up = Gauge(
            "memfuse_control_plane_up",
            "0 while the outbox counts the control plane as down (commits fail with connection "
            "errors, timeouts, 5xx or 429, or nothing was answered for a few seconds), else 1",
            registry=r)
        self.no_answer = Counter(
            "memfuse_control_plane_no_answer",
            "times the control plane answered nothing for a few seconds while a request "
            "waited (a paused process, a black-holed network)", registry=r)
        self.token_reloads = Counter("memfuse_token_reloads",
                                     "times a changed --token-file was taken up", registry=r)

    def api_observer(self) -> Callable[[str, str, float], None]:
        """An ``ApiSession.observer``: each control-plane API call answered (or failed)
        ``observe(endpoint, status, seconds)`` counted in ``memfuse_api_calls_total{endpoint,
        status}`` and timed in ``memfuse_api_call_seconds{endpoint}``. Every commit request
        comes here: the children of an (endpoint, status) are looked up once and their plain
        numbers updated inline (no lock, no further call). Call it on the trio thread."""
        children: dict[tuple[str, str], tuple[Count, OpStats]] = {}
        calls, latency = self.api_calls, self.api_latency

        def observe(endpoint: str, status: str, seconds: float) -> None:
            c = children.get((endpoint, status))
            if c is None:
                c = children[(endpoint, status)] = (calls.labels(endpoint, status),
                                                    latency.labels(endpoint))
            c[0].n += 1
            lat = c[1]
            lat.n += 1
            lat.sum += seconds
            lat.buckets[bisect_left(LAT_BUCKETS, seconds)] += 1
        return observe

    def bind(self, *, depth: Callable[[], float], oldest: Callable[[], float],
             records: Callable[[], float], cache_bytes: Callable[[], float],
             stores: Callable[[], float], ready: Callable[[], float]) -> None:
        """Compute the live gauges at scrape time from these callbacks."""
        self.outbox_depth.set_function(depth)
        self.outbox_oldest.set_function(oldest)
        self.cache_records.set_function(records)
        self.cache_bytes.set_function(cache_bytes)
        self.stores.set_function(stores)
        self.ready.set_function(ready)
