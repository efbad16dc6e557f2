"""Control-plane scale: N simulated sidecars against 1 or 2 ``memfuse serve`` replicas.

A simulated sidecar is what a ``memfuse mount`` does on the wire while it is idle: it holds
the change-feed stream of its store (``GET /v1/stores/shared/changes?after=&stream=true
&content=true&skip_actor=...``) and the workspace-events stream (``GET
/v1/workspaces/{ws}/events?after=&stream=true``), each on its own connection, with its own
workspace token, reading NDJSON lines as they come, reopening a stream from its cursor when
the server ends it, treating 45 s without a line as a dead connection, and honouring
``Retry-After`` on 429 / 503. ``--feed longpoll`` makes it long-poll instead (``wait=25``,
re-issued as soon as it answers): what a sidecar does against a server without streams. The clients speak HTTP/1.1 on raw trio sockets (the harness
must not be the bottleneck on a 2-CPU machine: 4,000 httpx connections would cost more
CPU than the server).

Phases, per configuration (database × replicas):

1. **idle**: every sidecar holds both feeds (streams, or long-polls); nothing is written for
   ``--idle`` seconds;
   the control plane's CPU (``/proc/PID/stat``) and database statements (the server's
   ``memfuse_server_db_statements_total``; on PostgreSQL also ``pg_stat_database``
   transactions) over that window, per replica and per 1,000 sidecars.
2. **fan-out**: ``--writes`` writes to the store every sidecar watches, alternating the
   replica they go to; for each write, the time from sending it until each sidecar's feed
   has it; p50 / p99 over every (write, sidecar) pair, and the slowest feed per write.
3. **throughput**: 1, 8 and 32 writers creating records (550 B) in a store nobody watches
   (or 32 stores) for ``--duration`` s each, spread over the replicas, one record per
   request or (``--writers ...bN``) in batches of N (``POST .../batch``, what the sidecar's
   committer sends for a backlog); committed records/s, server CPU ms and database
   statements per committed record.
4. **overload** (``--overload``): requests offered open-loop at 2× the best single-record rate, each
   with an ``Idempotency-Key``, retried after the server's ``Retry-After`` on 429 / 503;
   counts of 503s and the check that every record is stored exactly once.
5. **abuse** (``--abuse``): one token opens ``--abuse-polls`` long-polls and another client
   sends requests it never reads; the refusals the server gives, and the fan-out latency of
   the honest sidecars while it goes on.

Run ``python bench/bench_scale.py --db sqlite,postgres --replicas 1,2`` (PostgreSQL: the
tests' throwaway cluster, ``tests/pgutil.py``). SQLite runs one replica only (a second
``memfuse serve`` on the file is refused). Results: ``bench/results-scale.json``.
Loopback only; every process started here is stopped in ``finally``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for p in (str(REPO), str(REPO / "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

import trio  # noqa: E402

from mountutil import MEMFUSE, free_port  # noqa: E402

HOST = "127.0.0.1"
FEED_WAIT = 25  # what memfuse mount asks for (long-polls)
STREAM_READ_TIMEOUT = 45.0  # what memfuse mount allows between two lines of a stream
STORE = "shared"
BULK = "bulk"


# ------------------------------------------------------------------------ a small HTTP/1.1
class HttpError(Exception):
    """The connection failed or answered something this client cannot parse."""


class Conn:
    """One keep-alive HTTP/1.1 connection on a trio socket (Content-Length bodies only, which
    is what the control plane sends). Reconnects on the next request after a failure."""

    def __init__(self, port: int, token: str) -> None:
        self.port = port
        self.auth = f"Bearer {token}".encode()
        self.stream: trio.SocketStream | None = None
        self.buf = bytearray()

    async def close(self) -> None:
        if self.stream is not None:
            s, self.stream = self.stream, None
            with trio.move_on_after(1):
                await s.aclose()

    async def request(self, method: str, target: str, body: bytes | None = None,
                      headers: dict[str, str] | None = None, timeout: float = 60.0,
                      ) -> tuple[int, dict[str, str], bytes, float]:
        """Send one request; return (status, headers lower-cased, body, perf_counter when the
        body was complete). Raises ``HttpError`` (connection closed) or ``trio.TooSlowError``."""
        with trio.fail_after(timeout):
            for attempt in (0, 1):
                reused = self.stream is not None
                try:
                    return await self._exchange(method, target, body, headers)
                except HttpError:
                    # a kept-alive connection the server closed meanwhile: once more on a new one
                    if not reused or attempt:
                        raise
            raise AssertionError("unreachable")

    async def _exchange(self, method: str, target: str, body: bytes | None,
                        headers: dict[str, str] | None) -> tuple[int, dict[str, str], bytes, float]:
        if True:
            if self.stream is None:
                self.stream = await trio.open_tcp_stream(HOST, self.port)
                self.buf.clear()
            head = [f"{method} {target} HTTP/1.1", f"host: {HOST}:{self.port}",
                    "authorization: " + self.auth.decode()]
            for k, v in (headers or {}).items():
                head.append(f"{k}: {v}")
            if body is not None:
                head += ["content-type: application/json", f"content-length: {len(body)}"]
            data = ("\r\n".join(head) + "\r\n\r\n").encode() + (body or b"")
            try:
                await self.stream.send_all(data)
                return await self._read()
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, HttpError) as e:
                await self.close()
                raise HttpError(str(e) or type(e).__name__) from None
            except BaseException:
                await self.close()  # cancelled mid-response: the connection is unusable
                raise

    async def _fill(self) -> None:
        assert self.stream is not None
        chunk = await self.stream.receive_some(65536)
        if not chunk:
            raise HttpError("connection closed by the server")
        self.buf += chunk

    async def _read_head(self) -> tuple[int, dict[str, str]]:
        """Read one response head: (status, headers with lower-case names)."""
        while (end := self.buf.find(b"\r\n\r\n")) < 0:
            await self._fill()
        lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
        del self.buf[:end + 4]
        hdrs = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            hdrs[k.strip().lower()] = v.strip()
        return int(lines[0].split()[1]), hdrs

    async def _read(self) -> tuple[int, dict[str, str], bytes, float]:
        status, hdrs = await self._read_head()
        if "content-length" not in hdrs:
            if status in (204, 304):
                return status, hdrs, b"", time.perf_counter()
            raise HttpError(f"no content-length (status {status})")
        n = int(hdrs["content-length"])
        while len(self.buf) < n:
            await self._fill()
        body = bytes(self.buf[:n])
        del self.buf[:n]
        t = time.perf_counter()
        if hdrs.get("connection", "").lower() == "close":
            await self.close()
        return status, hdrs, body, t


    async def open_stream(self, target: str, on_line, read_timeout: float = STREAM_READ_TIMEOUT,
                     ) -> tuple[int, dict[str, str], bytes]:
        """Open a stream (``stream=true``): call ``on_line(line, perf_counter)`` for each NDJSON
        line of a chunked 200 answer until the server ends it. Returns (status, headers, body
        of a non-stream answer). Raises ``HttpError`` (connection lost) or
        ``trio.TooSlowError`` (nothing for ``read_timeout`` s: a dead connection)."""
        try:
            if self.stream is None:
                with trio.fail_after(30):
                    self.stream = await trio.open_tcp_stream(HOST, self.port)
                self.buf.clear()
            head = (f"GET {target} HTTP/1.1\r\nhost: {HOST}:{self.port}\r\n"
                    f"authorization: {self.auth.decode()}\r\naccept: application/x-ndjson\r\n\r\n")
            await self.stream.send_all(head.encode())
            with trio.fail_after(read_timeout):
                status, hdrs = await self._read_head()
            if hdrs.get("transfer-encoding", "").lower() != "chunked":
                n = int(hdrs.get("content-length", "0"))
                while len(self.buf) < n:
                    await self._fill()
                body = bytes(self.buf[:n])
                del self.buf[:n]
                return status, hdrs, body
            pending = b""
            while True:
                with trio.fail_after(read_timeout):
                    while (eol := self.buf.find(b"\r\n")) < 0:
                        await self._fill()
                    size = int(bytes(self.buf[:eol]).split(b";")[0], 16)
                    while len(self.buf) < eol + 2 + size + 2:
                        await self._fill()
                chunk = bytes(self.buf[eol + 2:eol + 2 + size])
                del self.buf[:eol + 2 + size + 2]
                if size == 0:
                    return status, hdrs, b""
                pending += chunk
                t = time.perf_counter()
                *done, pending = pending.split(b"\n")
                for line in done:
                    if line:
                        on_line(line, t)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, HttpError) as e:
            await self.close()
            raise HttpError(str(e) or type(e).__name__) from None
        except BaseException:
            await self.close()
            raise


def retry_after(hdrs: dict[str, str], default: float = 1.0) -> float:
    try:
        return max(0.0, float(hdrs.get("retry-after", default)))
    except ValueError:
        return default


# ------------------------------------------------------------------------ processes
@dataclass
class Replica:
    url: str
    port: int
    proc: subprocess.Popen
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def start_replica(work: Path, db_url: str, token_file: Path, name: str, extra: list[str]) -> Replica:
    port = free_port()
    log = work / f"{name}.log"
    env = dict(os.environ, MEMFUSE_HOME=str(work / "home"))
    proc = subprocess.Popen(
        [MEMFUSE, "serve", "--db", db_url, "--listen", f"{HOST}:{port}", "--admin-token-file",
         str(token_file), "--migrate", *extra],
        stdout=log.open("ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
        start_new_session=True)
    return Replica(f"http://{HOST}:{port}", port, proc, log)


def wait_listening(r: Replica, timeout: float = 60) -> None:
    import socket

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if r.proc.poll() is not None:
            raise RuntimeError(f"memfuse serve exited: {r.log.read_text()[-2000:]}")
        try:
            socket.create_connection((HOST, r.port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"memfuse serve did not listen: {r.log.read_text()[-2000:]}")


def stop_proc(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → {name{labels}: value} (samples only)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, val = line.rpartition(" ")
        try:
            out[key] = float(val)
        except ValueError:
            pass
    return out


async def scrape(r: Replica, token: str) -> dict[str, float]:
    c = Conn(r.port, token)
    try:
        status, _, body, _ = await c.request("GET", "/metrics", timeout=90)
        if status != 200:
            raise HttpError(f"/metrics answered {status}")
        return parse_metrics(body.decode())
    finally:
        await c.close()


def metric(m: dict[str, float], name: str) -> float:
    return sum(v for k, v in m.items() if k == name or k.startswith(name + "{"))


# ------------------------------------------------------------------------ the simulated sidecars
@dataclass
class Stats:
    errors: dict[str, int] = field(default_factory=dict)
    arrivals: dict[str, list[float]] = field(default_factory=dict)  # path → perf_counter per feed
    expected: dict[str, trio.Event] = field(default_factory=dict)
    n_feeds: int = 0
    throttled: int = 0
    reopened: int = 0  # streams ended by the server and opened again

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


class Sidecar:
    def __init__(self, ws: str, token: str, replica: Replica, stats: Stats, feed: str = "stream") -> None:
        self.ws, self.token, self.replica, self.stats = ws, token, replica, stats
        self.feed = feed
        self.actor = f"ws:{ws}/sim"
        self.feed_cursor = 0
        self.event_cursor = 0

    async def _poll(self, conn: Conn, target_of, on_page) -> None:
        delay = 0.5
        while True:
            try:
                status, hdrs, body, t = await conn.request("GET", target_of(), timeout=FEED_WAIT + 30)
            except (HttpError, trio.TooSlowError) as e:
                self.stats.error(f"transport:{type(e).__name__}")
                await trio.sleep(delay)
                delay = min(delay * 2, 10)
                continue
            if status == 200:
                delay = 0.5
                on_page(json.loads(body), t)
            elif status in (429, 503):
                self.stats.throttled += 1
                await trio.sleep(retry_after(hdrs))
            else:
                self.stats.error(f"http:{status}")
                await trio.sleep(delay)
                delay = min(delay * 2, 10)

    async def _stream(self, conn: Conn, target_of, on_page) -> None:
        """What the sidecar does with a stream: read lines as they come, reopen from the
        cursor when the server ends it, back off on failures, honour Retry-After."""
        delay = 0.5

        def on_line(line: bytes, t: float) -> None:
            page = json.loads(line)
            if "error" in page:
                self.stats.error(f"stream:{page['error'].get('code')}")
                return
            on_page(page, t)

        while True:
            try:
                status, hdrs, body = await conn.open_stream(target_of(), on_line)
            except (HttpError, trio.TooSlowError) as e:
                self.stats.error(f"transport:{type(e).__name__}")
                await trio.sleep(delay)
                delay = min(delay * 2, 10)
                continue
            if status == 200:
                delay = 0.5
                self.stats.reopened += 1
                if body:  # the server does not stream: a page
                    on_page(json.loads(body), time.perf_counter())
            elif status in (429, 503):
                self.stats.throttled += 1
                await trio.sleep(retry_after(hdrs))
            else:
                self.stats.error(f"http:{status}")
                await trio.sleep(delay)
                delay = min(delay * 2, 10)

    def _on_feed(self, page: dict, t: float) -> None:
        for ch in page["changes"]:
            path = ch["record"]["path"]
            lst = self.stats.arrivals.get(path)
            if lst is not None:
                lst.append(t)
                if len(lst) == self.stats.n_feeds and path in self.stats.expected:
                    self.stats.expected[path].set()
        self.feed_cursor = max(self.feed_cursor, page["seq"])

    def _on_events(self, page: dict, t: float) -> None:
        self.event_cursor = max(self.event_cursor, page["seq"])

    async def run(self, ready: trio.Semaphore | None = None, starting: trio.Semaphore | None = None) -> None:
        feed, events = Conn(self.replica.port, self.token), Conn(self.replica.port, self.token)
        try:
            # the start-up reads of a sidecar: where the feeds are now
            if starting is not None:
                await starting.acquire()
            for _ in range(20):
                try:
                    st, hdrs, body, _ = await feed.request(
                        "GET", f"/v1/stores/{STORE}/records?limit=1", timeout=60)
                    if st == 200:
                        self.feed_cursor = json.loads(body)["seq"]
                        st, hdrs, body, _ = await events.request(
                            "GET", f"/v1/workspaces/{self.ws}/events?after=0&wait=0", timeout=60)
                        if st == 200:
                            self.event_cursor = json.loads(body)["seq"]
                            break
                    await trio.sleep(retry_after(hdrs))
                except (HttpError, trio.TooSlowError):
                    await trio.sleep(1)
            if starting is not None:
                starting.release()
            if ready is not None:
                ready.release()
            if self.feed == "stream":
                async with trio.open_nursery() as n:
                    n.start_soon(self._stream, feed,
                                 lambda: (f"/v1/stores/{STORE}/changes?after={self.feed_cursor}&stream=true"
                                          f"&content=true&limit=1000&skip_actor={self.actor}"),
                                 self._on_feed)
                    n.start_soon(self._stream, events,
                                 lambda: f"/v1/workspaces/{self.ws}/events?after={self.event_cursor}&stream=true",
                                 self._on_events)
                return
            async with trio.open_nursery() as n:
                n.start_soon(self._poll, feed,
                             lambda: (f"/v1/stores/{STORE}/changes?after={self.feed_cursor}&wait={FEED_WAIT}"
                                      f"&content=true&limit=1000&skip_actor={self.actor}"),
                             self._on_feed)
                n.start_soon(self._poll, events,
                             lambda: f"/v1/workspaces/{self.ws}/events?after={self.event_cursor}&wait={FEED_WAIT}",
                             self._on_events)
        finally:
            await feed.close()
            await events.close()


# ------------------------------------------------------------------------ phases
async def bootstrap(replica: Replica, admin: str, n: int, prefix: str) -> list[tuple[str, str]]:
    """Stores ``shared`` and ``bulk``; ``n`` workspaces attached to ``shared`` with a token each."""
    c = Conn(replica.port, admin)
    for slug in (STORE, BULK, BULK + "2", *(f"{BULK}-{i}" for i in range(32))):
        st, _, body, _ = await c.request("POST", "/v1/stores", json.dumps(
            {"slug": slug, "max_records": 10_000_000, "max_store_bytes": 10**11}).encode())
        assert st in (201, 409), body
    await c.close()
    out: list[tuple[str, str]] = []
    sem = trio.Semaphore(16)

    async def one(i: int) -> None:
        ws = f"{prefix}{i:05d}"
        async with sem:
            conn = Conn(replica.port, admin)
            try:
                for method, target, body in (
                    ("POST", "/v1/workspaces", {"name": ws}),
                    ("PUT", f"/v1/workspaces/{ws}/attachments/{STORE}", {"access": "read_write"}),
                ):
                    st, _, b, _ = await conn.request(method, target, json.dumps(body).encode())
                    assert st in (200, 201, 409), b
                st, _, b, _ = await conn.request("POST", "/v1/tokens", json.dumps(
                    {"workspace": ws, "name": f"sim-{ws}"}).encode())
                assert st == 201, b
                out.append((ws, json.loads(b)["token"]))
            finally:
                await conn.close()

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    return sorted(out)


async def write_once(conn: Conn, store: str, path: str, size: int = 550,
                     key: str | None = None) -> tuple[int, dict[str, str]]:
    body = json.dumps({"path": path, "content": ("x" * (size - 1)) + "\n"}).encode()
    headers = {"idempotency-key": key} if key else None
    st, hdrs, _, _ = await conn.request("POST", f"/v1/stores/{store}/records", body, headers, timeout=60)
    return st, hdrs


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = max(0, min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1)))))
    return xs[k]


async def phase_idle(replicas: list[Replica], admin: str, seconds: float, pg_url: str | None) -> dict:
    before = [await scrape(r, admin) for r in replicas]
    cpu0 = [cpu_seconds(r.pid) for r in replicas]
    pg0 = pg_xacts(pg_url) if pg_url else None
    t0 = time.monotonic()
    await trio.sleep(seconds)
    dt = time.monotonic() - t0
    cpu1 = [cpu_seconds(r.pid) for r in replicas]
    pg1 = pg_xacts(pg_url) if pg_url else None
    after = [await scrape(r, admin) for r in replicas]
    per = []
    for i, r in enumerate(replicas):
        per.append({
            "cpu_pct": 100 * (cpu1[i] - cpu0[i]) / dt,
            "db_statements_per_s": (metric(after[i], "memfuse_server_db_statements_total")
                                    - metric(before[i], "memfuse_server_db_statements_total")) / dt,
            "long_polls": metric(after[i], "memfuse_server_long_polls"),
            "requests_per_s": (metric(after[i], "memfuse_server_requests_total")
                               - metric(before[i], "memfuse_server_requests_total")) / dt,
            "rss_mib": rss_mib(r.pid),
        })
    out = {"seconds": dt, "replicas": per}
    if pg0 is not None and pg1 is not None:
        # the pg_stat_database read itself is one transaction of its own, at each end
        out["pg_xacts_per_s"] = max(0.0, (pg1 - pg0 - 1)) / dt
    return out


def pg_xacts(url: str) -> int:
    import psycopg

    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://")) as c:
        row = c.execute("SELECT xact_commit + xact_rollback FROM pg_stat_database "
                        "WHERE datname = current_database()").fetchone()
        return int(row[0])


async def phase_fanout(replicas: list[Replica], admin: str, stats: Stats, writes: int) -> dict:
    conns = [Conn(r.port, admin) for r in replicas]
    lat: list[float] = []
    worst: list[float] = []
    missing = 0
    cpu0 = [cpu_seconds(r.pid) for r in replicas]
    before = [await scrape(r, admin) for r in replicas]
    spy = None
    if os.environ.get("BENCH_SCALE_PROFILE"):  # py-spy (pip install py-spy) on the first replica
        spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid",
                                str(replicas[0].pid), "--rate", "250", "--format", "raw", "--nonblocking",
                                "-o", os.environ["BENCH_SCALE_PROFILE"]],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        await trio.sleep(1)
    try:
        for k in range(writes):
            path = f"fanout/{uuid.uuid4().hex[:8]}.md"
            stats.arrivals[path] = []
            ev = stats.expected[path] = trio.Event()
            t0 = time.perf_counter()
            st, _ = await write_once(conns[k % len(conns)], STORE, path)
            if st != 201:
                stats.error(f"write:{st}")
                continue
            with trio.move_on_after(30):
                await ev.wait()
            got = [t - t0 for t in stats.arrivals[path]]
            missing += stats.n_feeds - len(got)
            lat += got
            if got:
                worst.append(max(got))
            await trio.sleep(0.3)
    finally:
        for c in conns:
            await c.close()
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(30)
    cpu = sum(cpu_seconds(r.pid) - c for r, c in zip(replicas, cpu0))
    after = [await scrape(r, admin) for r in replicas]
    stmts = sum(metric(a, "memfuse_server_db_statements_total") - metric(b, "memfuse_server_db_statements_total")
                for a, b in zip(after, before))
    fed = max(1, writes * stats.n_feeds)
    return {"writes": writes, "samples": len(lat), "missing": missing,
            "server_cpu_ms_per_feed_answer": 1000 * cpu / fed,
            "db_statements_per_write": stmts / max(1, writes),
            "p50_s": pct(lat, 50), "p99_s": pct(lat, 99), "max_s": max(lat) if lat else None,
            "slowest_feed_per_write_median_s": statistics.median(worst) if worst else None}


async def write_batch(conn: Conn, store: str, paths: list[str], size: int = 550) -> tuple[int, dict[str, str], int]:
    """One ``POST .../batch`` creating ``paths`` (each with its own idempotency key, as the
    sidecar's committer sends a backlog). Returns (status, headers, operations answered 201)."""
    body = json.dumps({"operations": [
        {"op": "create", "idempotency_key": uuid.uuid4().hex,
         "body": {"path": p, "content": ("x" * (size - 1)) + "\n"}} for p in paths]}).encode()
    st, hdrs, raw, _ = await conn.request("POST", f"/v1/stores/{store}/batch", body, timeout=120)
    ok = sum(1 for r in json.loads(raw)["results"] if r["status"] == 201) if st == 200 else 0
    return st, hdrs, ok


async def phase_throughput(replicas: list[Replica], admin: str, writers: int, seconds: float,
                           stats: Stats, stores: int = 1, batch: int = 0) -> dict:
    """``writers`` writers creating 550 B records for ``seconds`` s in ``stores`` stores
    (writer i in store i % stores), each on its own connection, spread over the replicas:
    one ``POST .../records`` per record, or (``batch`` > 0) ``POST .../batch`` of ``batch``
    creates. Committed records/s, server CPU ms per record, database statements per record."""
    done = 0
    errors: dict[str, int] = {}
    lat: list[float] = []
    deadline = time.monotonic() + seconds

    async def writer(i: int) -> None:
        nonlocal done
        conn = Conn(replicas[i % len(replicas)].port, admin)
        store = BULK if stores == 1 else f"{BULK}-{i % stores}"
        k = 0
        try:
            while time.monotonic() < deadline:
                t0 = time.perf_counter()
                tag = f"w{writers}b{batch}/{i}/{k}-{uuid.uuid4().hex[:6]}"
                try:
                    if batch:
                        st, hdrs, ok = await write_batch(conn, store, [f"{tag}-{j}.md" for j in range(batch)])
                    else:
                        st, hdrs = await write_once(conn, store, f"{tag}.md")
                        ok = 1 if st == 201 else 0
                except (HttpError, trio.TooSlowError) as e:
                    errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
                    continue
                k += 1
                if ok:
                    done += ok
                    lat.append(time.perf_counter() - t0)
                if st not in (200, 201) or (batch and ok != batch):
                    errors[str(st)] = errors.get(str(st), 0) + 1
                    if st in (429, 503):
                        await trio.sleep(retry_after(hdrs))
        finally:
            await conn.close()

    before = [await scrape(r, admin) for r in replicas]
    cpu0 = [cpu_seconds(r.pid) for r in replicas]
    t0 = time.monotonic()
    async with trio.open_nursery() as n:
        for i in range(writers):
            n.start_soon(writer, i)
    dt = time.monotonic() - t0
    cpu_s = [cpu_seconds(r.pid) - c for r, c in zip(replicas, cpu0)]
    after = [await scrape(r, admin) for r in replicas]
    stmts = sum(metric(a, "memfuse_server_db_statements_total") - metric(b, "memfuse_server_db_statements_total")
                for a, b in zip(after, before))
    return {"writers": writers, "stores": stores, "batch": batch, "records_per_s": done / dt,
            "committed": done, "errors": errors,
            "p50_ms": 1000 * pct(lat, 50), "p99_ms": 1000 * pct(lat, 99),  # per request
            "cpu_pct": [100 * c / dt for c in cpu_s],
            "server_cpu_ms_per_record": 1000 * sum(cpu_s) / max(1, done),
            "db_statements_per_record": stmts / max(1, done),
            "loadavg": os.getloadavg()[0]}


async def phase_overload(replicas: list[Replica], admin: str, rate: float, seconds: float) -> dict:
    """Open-loop offer at ``rate`` requests/s over a pool of 256 connections; each request
    carries an ``Idempotency-Key`` and is retried with it after ``Retry-After`` on 429 / 503
    until it is answered 201 (at most 100 attempts)."""
    n_req = int(rate * seconds)
    statuses: dict[str, int] = {}
    done = 0
    gave_up = 0
    lat: list[float] = []
    conns = [Conn(replicas[i % len(replicas)].port, admin) for i in range(256)]
    send, recv = trio.open_memory_channel[Conn](len(conns))
    for c in conns:
        send.send_nowait(c)

    async def one(i: int) -> None:
        nonlocal done, gave_up
        key = uuid.uuid4().hex
        t0 = time.perf_counter()
        for _ in range(100):
            conn = await recv.receive()
            try:
                st, hdrs = await write_once(conn, BULK + "2", f"ov/{i:06d}.md", key=key)
            except (HttpError, trio.TooSlowError) as e:
                statuses[type(e).__name__] = statuses.get(type(e).__name__, 0) + 1
                st, hdrs = 0, {}
            finally:
                send.send_nowait(conn)
            statuses[str(st)] = statuses.get(str(st), 0) + 1
            if st == 201:
                done += 1
                lat.append(time.perf_counter() - t0)
                return
            await trio.sleep(retry_after(hdrs) if st in (429, 503) else 1.0)
        gave_up += 1

    t0 = time.monotonic()
    async with trio.open_nursery() as n:
        for i in range(n_req):
            await trio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            n.start_soon(one, i)
    dt = time.monotonic() - t0
    for c in conns:
        await c.close()
    c = Conn(replicas[0].port, admin)
    st, _, body, _ = await c.request("GET", f"/v1/stores/{BULK}2")
    await c.close()
    stored = json.loads(body)["record_count"] if st == 200 else None
    return {"offered_per_s": rate, "requests": n_req, "committed": done, "gave_up": gave_up,
            "stored": stored, "statuses": statuses, "seconds": dt,
            "p50_s": pct(lat, 50), "p99_s": pct(lat, 99)}


async def phase_abuse(replicas: list[Replica], ws: str, token: str, polls: int, silent: int) -> dict:
    """One workspace token opens ``polls`` event long-polls at once; ``silent`` connections
    pipeline requests for big responses and never read them. Returns what the abuser got
    (``held``: long-polls still waiting after 3 s)."""
    statuses: dict[str, int] = {}
    conns: list[Conn] = []
    r = replicas[0]
    c = Conn(r.port, token)
    st, _, body, _ = await c.request("GET", f"/v1/workspaces/{ws}/events?after=0&wait=0")
    await c.close()
    ev = json.loads(body)["seq"]

    async def hog(i: int) -> None:
        c = Conn(r.port, token)
        conns.append(c)
        try:
            st, hdrs, _, _ = await c.request("GET", f"/v1/workspaces/{ws}/events?after={ev}&wait=60",
                                             timeout=70)
            statuses[str(st)] = statuses.get(str(st), 0) + 1
        except (HttpError, trio.TooSlowError) as e:
            statuses[type(e).__name__] = statuses.get(type(e).__name__, 0) + 1

    silent_socks = []
    async with trio.open_nursery() as n:
        for i in range(polls):
            n.start_soon(hog, i)
        for _ in range(silent):
            s = await trio.open_tcp_stream(HOST, r.port)
            req = b"GET /openapi.json HTTP/1.1\r\nhost: x\r\n\r\n"
            await s.send_all(req * 20)  # pipelined, the answers (~100 KB each) never read
            silent_socks.append(s)
        await trio.sleep(3)
        n.cancel_scope.cancel()
    for s in silent_socks:
        await s.aclose()
    for c in conns:
        await c.close()
    return {"statuses": statuses, "held": polls - sum(statuses.values())}


# ------------------------------------------------------------------------ one configuration
def raise_fd_limit(need: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        new = hard if hard == resource.RLIM_INFINITY else min(hard, max(need, soft))
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        soft = new
    if soft < need:
        raise SystemExit(f"need {need} file descriptors, the hard limit is {hard}")
    return soft


async def run_config(args, db: str, n_replicas: int, pg_url: str | None, work: Path) -> dict:
    admin = secrets.token_urlsafe(24)
    token_file = work / "admin.token"
    token_file.write_text(admin)
    if db == "sqlite":
        db_url = f"sqlite:///{work / 'cp.db'}"
    else:
        assert pg_url is not None
        db_url = pg_url
        import psycopg

        with psycopg.connect(pg_url, autocommit=True) as c:  # a clean database per configuration
            c.execute("DROP SCHEMA public CASCADE")
            c.execute("CREATE SCHEMA public")
    extra = list(args.serve_args)
    replicas = []
    out: dict = {"db": db, "replicas": n_replicas, "sidecars": args.sidecars, "feed": args.feed}
    try:
        for i in range(n_replicas):
            replicas.append(start_replica(work, db_url, token_file, f"serve-{db}-{n_replicas}-{i}", extra))
            wait_listening(replicas[-1])  # one at a time: the first creates the tables
        if db == "sqlite":
            # a second replica on the same SQLite file is refused with a clear message
            r2 = start_replica(work, db_url, token_file, "serve-sqlite-second", [])
            try:
                r2.proc.wait(30)
                out["second_sqlite_serve"] = {"exit": r2.proc.returncode,
                                              "message": r2.log.read_text().strip().splitlines()[-1:]}
            except subprocess.TimeoutExpired:
                out["second_sqlite_serve"] = {"exit": None, "message": "still running: NOT refused"}
            finally:
                stop_proc(r2.proc)
        t0 = time.monotonic()
        tokens = await bootstrap(replicas[0], admin, args.sidecars, "sim")
        out["bootstrap_s"] = time.monotonic() - t0
        stats = Stats(n_feeds=args.sidecars)
        say(f"  {db} x{n_replicas}: {len(tokens)} workspaces in {out['bootstrap_s']:.1f} s; starting sidecars")
        async with trio.open_nursery() as nursery:
            ready = trio.Semaphore(0)
            starting = trio.Semaphore(32)  # sidecars starting at once (a rolling deployment)
            t_start = time.monotonic()
            for i, (ws, tok) in enumerate(tokens):
                nursery.start_soon(Sidecar(ws, tok, replicas[i % n_replicas], stats, args.feed).run,
                                   ready, starting)
            for _ in tokens:
                await ready.acquire()
            out["sidecars_started_s"] = time.monotonic() - t_start
            # wait until every long-poll is held
            t_wait = time.monotonic()
            while True:
                held = 0.0
                for r in replicas:
                    held += metric(await scrape(r, admin), "memfuse_server_long_polls")
                if held >= 2 * args.sidecars or time.monotonic() - t_wait > 120:
                    break
                await trio.sleep(0.5)
            out["long_polls_held"] = held
            await trio.sleep(2)  # let the start-up settle
            say(f"  idle {args.idle:.0f} s with {held:.0f} long-polls held")
            out["idle"] = await phase_idle(replicas, admin, args.idle, pg_url if db == "postgres" else None)
            say(f"  idle: {out['idle']}")
            out["fanout"] = await phase_fanout(replicas, admin, stats, args.writes)
            say(f"  fan-out: {out['fanout']}")
            out["throughput"] = []
            for w, n_stores, b in args.writers:
                r = await phase_throughput(replicas, admin, w, args.duration, stats, n_stores, b)
                out["throughput"].append(r)
                say(f"  throughput {w} writers on {n_stores} store(s){f', batches of {b}' if b else ''}: "
                    f"{r['records_per_s']:.0f}/s (server CPU {[round(c) for c in r['cpu_pct']]} %, "
                    f"{r['server_cpu_ms_per_record']:.2f} ms and {r['db_statements_per_record']:.1f} "
                    f"statements per record) errors {r['errors']}")
            if args.overload:
                # 2× the best rate of single-record writers (the overload offers single records)
                rate = 2 * max((t["records_per_s"] for t in out["throughput"] if not t.get("batch")),
                               default=100.0)
                out["overload"] = await phase_overload(replicas, admin, rate, args.duration)
                say(f"  overload: {out['overload']}")
            if args.abuse:
                async with trio.open_nursery() as an:
                    res: dict = {}

                    async def abuse():
                        res.update(await phase_abuse(replicas, tokens[0][0], tokens[0][1], args.abuse_polls, 5))

                    an.start_soon(abuse)
                    await trio.sleep(1.0)
                    res["fanout_during"] = await phase_fanout(replicas, admin, stats, 3)
                out["abuse"] = res
                say(f"  abuse: {res}")
            out["server_metrics"] = [
                {k: v for k, v in (await scrape(r, admin)).items()
                 if k.startswith("memfuse_server_") and "bucket" not in k}
                for r in replicas]
            nursery.cancel_scope.cancel()
        out["errors"] = stats.errors
        out["sidecar_throttled"] = stats.throttled
        out["streams_reopened"] = stats.reopened
    finally:
        for r in replicas:
            stop_proc(r.proc)
    return out


def say(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


def parse_writers(spec: str) -> tuple[int, int, int]:
    """``"32x1"`` → (32 writers, 1 store, no batches); ``"32x32b100"`` → batches of 100."""
    spec, _, batch = spec.partition("b")
    w, s = spec.split("x")
    return int(w), int(s), int(batch or 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sidecars", type=int, default=2000)
    ap.add_argument("--feed", choices=("stream", "longpoll"), default="stream",
                    help="how the simulated sidecars follow their feeds (memfuse mount streams)")
    ap.add_argument("--db", default="sqlite,postgres")
    ap.add_argument("--replicas", default="1,2")
    ap.add_argument("--idle", type=float, default=30.0,
                    help="seconds of the idle window (≥ 25: every long-poll times out and is re-issued once, "
                         "every stream sends at least one heartbeat)")
    ap.add_argument("--writes", type=int, default=20, help="fan-out writes")
    ap.add_argument("--writers", default="1x1,8x1,32x1,32x32,1x1b100,8x1b100,32x1b100,32x32b100",
                    help="throughput runs as WRITERSxSTORES (one record per request) or "
                         "WRITERSxSTORESbN (batches of N creates), comma-separated ('' for none)")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per throughput run")
    ap.add_argument("--overload", action="store_true")
    ap.add_argument("--abuse", action="store_true")
    ap.add_argument("--abuse-polls", type=int, default=2000)
    ap.add_argument("--serve-arg", dest="serve_args", action="append", default=[],
                    help="extra argument for memfuse serve (repeatable)")
    ap.add_argument("--out", type=Path, default=BENCH / "results-scale.json")
    ap.add_argument("--report", type=Path, metavar="RESULTS", help="print RESULTS as the README table and exit")
    args = ap.parse_args()
    if args.report:
        print(table(json.loads(args.report.read_text())))
        return 0
    args.writers = [parse_writers(x) for x in args.writers.split(",") if x]
    dbs = [x for x in args.db.split(",") if x]
    reps = [int(x) for x in args.replicas.split(",") if x]
    fds = raise_fd_limit(4 * args.sidecars + args.abuse_polls + 1000)
    results = {"meta": {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                        "commit": subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                                 capture_output=True, text=True).stdout.strip(),
                        "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()[0], "fd_limit": fds,
                        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}},
               "runs": []}
    work = Path(tempfile.mkdtemp(prefix="memfuse-scale-"))
    try:
        from pgutil import pg_cluster

        pg_ctx = pg_cluster(max_connections=400) if "postgres" in dbs else None
        pg_url = pg_ctx.__enter__() if pg_ctx else None
        try:
            for db in dbs:
                for n in reps:
                    if db == "sqlite" and n > 1:
                        continue
                    say(f"{db}, {n} replica(s), {args.sidecars} sidecars")
                    sub = work / f"{db}-{n}"
                    sub.mkdir()
                    results["runs"].append(trio.run(run_config, args, db, n, pg_url, sub))
                    args.out.write_text(json.dumps(results, indent=1))
        finally:
            if pg_ctx:
                pg_ctx.__exit__(None, None, None)
    finally:
        results["meta"]["loadavg_end"] = os.getloadavg()[0]
        args.out.write_text(json.dumps(results, indent=1))
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    say(f"results in {args.out}")
    return 0



# ------------------------------------------------------------------------ the table
def table(results: dict) -> str:
    """``results-scale.json`` as the Markdown table of bench/README.md: one column per
    configuration, one row per figure."""
    runs = results["runs"]
    cols = [f"{r['db']} × {r['replicas']}" for r in runs]

    def per_k(r, v):
        return v * 1000 / r["sidecars"]

    def tp(r, w, s, b=0):
        for t in r.get("throughput", []):
            if t["writers"] == w and t.get("stores", 1) == s and t.get("batch", 0) == b:
                extra = ""
                if "server_cpu_ms_per_record" in t:
                    extra = (f" ({t['server_cpu_ms_per_record']:.2f} ms, "
                             f"{t['db_statements_per_record']:.1f} st.)")
                return f"{t['records_per_s']:.0f}{extra}"
        return "—"

    def refused(r):
        return f"{sum(v for m in r.get('server_metrics', []) for k, v in m.items() if 'too_many_long_polls' in k and k.startswith('memfuse_server_refused_total')):.0f}"

    def idle(r, key):
        return [x.get(key, float("nan")) for x in r["idle"]["replicas"]]

    rows: list[tuple[str, str, list[str]]] = [
        ("sidecars (2 feeds each: streams, or long-polls with --feed longpoll)", "",
         [f"{r['sidecars']} ({r.get('feed', 'longpoll')})" for r in runs]),
        ("idle: control-plane CPU, % of one core per replica", "< 5 % at 2,000",
         [" / ".join(f"{c:.1f}" for c in idle(r, "cpu_pct")) for r in runs]),
        ("idle: CPU per 1,000 sidecars, % of one core (all replicas)", "",
         [f"{per_k(r, sum(idle(r, 'cpu_pct'))):.1f}" for r in runs]),
        ("idle: database statements/s (per 1,000 sidecars)", "0",
         [f"{sum(idle(r, 'db_statements_per_s')):.2f} ({per_k(r, sum(idle(r, 'db_statements_per_s'))):.2f})"
          for r in runs]),
        ("idle: PostgreSQL transactions/s (pg_stat_database)", "0",
         [f"{r['idle']['pg_xacts_per_s']:.2f}" if "pg_xacts_per_s" in r["idle"] else "—" for r in runs]),
        ("idle: HTTP requests/s (long-polls re-issued at 25 s; streams reopened at ~10 min)", "",
         [f"{sum(idle(r, 'requests_per_s')):.0f}" for r in runs]),
        ("idle: server RSS, MiB per replica", "",
         [" / ".join(f"{m:.0f}" for m in idle(r, "rss_mib")) for r in runs]),
        ("write → every waiting feed, p50 (s)", "",
         [f"{r['fanout']['p50_s']:.2f}" for r in runs]),
        ("write → every waiting feed, p99 (s)", "≤ 1 s",
         [f"{r['fanout']['p99_s']:.2f}" for r in runs]),
        ("feeds missed (of writes × sidecars)", "0",
         [f"{r['fanout']['missing']} / {r['fanout']['writes'] * r['sidecars']}" for r in runs]),
        ("server CPU per answered feed (ms)", "",
         [f"{r['fanout']['server_cpu_ms_per_feed_answer']:.2f}" for r in runs]),
        ("database statements per fan-out write (write + shared reads)", "",
         [f"{r['fanout']['db_statements_per_write']:.0f}" for r in runs]),
        ("committed records/s, 1 writer (server CPU ms, database statements per record)", "",
         [tp(r, 1, 1) for r in runs]),
        ("committed records/s, 8 writers, one store", "", [tp(r, 8, 1) for r in runs]),
        ("committed records/s, 32 writers, one store", "", [tp(r, 32, 1) for r in runs]),
        ("committed records/s, 32 writers, 32 stores", "", [tp(r, 32, 32) for r in runs]),
        ("batches of 100 (the committer's backlog): records/s, 1 writer", "", [tp(r, 1, 1, 100) for r in runs]),
        ("batches of 100: records/s, 8 writers, one store", "", [tp(r, 8, 1, 100) for r in runs]),
        ("batches of 100: records/s, 32 writers, one store", "≥ 1,000 (PostgreSQL)",
         [tp(r, 32, 1, 100) for r in runs]),
        ("batches of 100: records/s, 32 writers, 32 stores", "", [tp(r, 32, 32, 100) for r in runs]),
    ]
    ov = [r.get("overload") for r in runs]
    rows += [
        ("overload: offered records/s (2× the best rate above)", "",
         [f"{o['offered_per_s']:.0f}" if o else "—" for o in ov]),
        ("overload: 503 + Retry-After answers / requests", "",
         [f"{o['statuses'].get('503', 0)} / {o['requests']}" if o else "—" for o in ov]),
        ("overload: stored exactly once / requests (lost)", "all, 0 lost",
         [f"{o['stored']} / {o['requests']} ({o['requests'] - (o['stored'] or 0)})" if o else "—" for o in ov]),
        ("overload: request → 201 incl. retries, p50 / p99 (s)", "",
         [f"{o['p50_s']:.1f} / {o['p99_s']:.1f}" if o else "—" for o in ov]),
    ]
    ab = [r.get("abuse") for r in runs]
    rows += [
        ("abuse: one token opens N long-polls → answered 429 within 3 s / refused by the server in all",
         "all but 64",
         [f"{a['statuses'].get('429', 0)} / {refused(r)}" if a else "—" for a, r in zip(ab, runs)]),
        ("abuse: fan-out p99 meanwhile (s)", "",
         [f"{a['fanout_during']['p99_s']:.2f}" if a else "—" for a in ab]),
        ("errors (transport / unexpected status) over the run", "0",
         [str(sum(r.get("errors", {}).values())) for r in runs]),
    ]
    out = ["| figure | target | " + " | ".join(cols) + " |",
           "|---|---|" + "---:|" * len(cols)]
    for name, target, vals in rows:
        out.append(f"| {name} | {target} | " + " | ".join(vals) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
