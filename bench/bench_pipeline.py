"""Pipelined requests of clients that leave (attack17 F4): how long ``memfuse serve`` goes on
working for connections whose clients have gone.

    .venv/bin/python bench/bench_pipeline.py [--conns 200] [--pipelined 1000] [--hold 5]

One ``memfuse serve`` (SQLite file, default limits) on loopback, a store of 200 records of
4 KB. ``--conns`` connections of one token each send ``--pipelined`` reads of the whole store
(``GET .../records?content=true&limit=200``, ~850 KB answers) at once, read nothing, and close
after ``--hold`` s (with answers unread: a reset). Then, until the server's
``memfuse_server_requests_total`` has not moved for 3 s (at most 300 s), another token reads
one record every 0.2 s. Printed (JSON): the requests answered after the clients left, the
seconds until the last of them, the server's CPU seconds after the close, the other client's
read p50 / max (ms), and ``memfuse_server_connections_ended_total`` by reason when the server
has it. The attacker runs in this process; the server in its own.
"""
from __future__ import annotations

import argparse
import json
import re
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for p in (str(HERE.parent), str(HERE.parent / "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

import httpx  # noqa: E402

import test_hostile as h  # noqa: E402
from mountutil import stop  # noqa: E402


def _metric(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(r"^%s(?:\{[^}]*\})? ([0-9.e+-]+)$" % re.escape(name), text, re.M))


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conns", type=int, default=200)
    ap.add_argument("--pipelined", type=int, default=1000)
    ap.add_argument("--hold", type=float, default=5.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp_:
        tmp = Path(tmp_)
        s = h.start(tmp, f"sqlite:///{tmp / 'cp.db'}", "serve", {})
        try:
            return _run(s, args)
        finally:
            stop(s.proc)


def _run(s: h.Server, args: argparse.Namespace) -> int:
    with httpx.Client(base_url=s.url, headers=h._auth(h.ADMIN), timeout=60) as a:
        for ws in ("att", "good"):
            assert a.post("/v1/workspaces", json={"name": ws, "default_store": False}).status_code == 201
            assert a.post("/v1/stores", json={"slug": ws}).status_code == 201
            assert a.put(f"/v1/workspaces/{ws}/attachments/{ws}", json={"access": "read_write"}).status_code == 200
        att = a.post("/v1/tokens", json={"workspace": "att", "name": "att"}).json()["token"]
        good = a.post("/v1/tokens", json={"workspace": "good", "name": "good"}).json()["token"]
    with httpx.Client(base_url=s.url, headers=h._auth(att), timeout=60) as c:
        for i in range(200):
            r = c.post("/v1/stores/att/records", json={"path": f"r/{i:03}.md", "content": f"line {i}\n" * 500})
            assert r.status_code == 201, r.text
    with httpx.Client(base_url=s.url, headers=h._auth(good), timeout=60) as c:
        assert c.post("/v1/stores/good/records", json={"path": "a.md", "content": "hello\n"}).status_code == 201
    probe = httpx.Client(base_url=s.url, timeout=60)
    start = _metric(probe.get("/metrics").text, "memfuse_server_requests_total")
    good_c = httpx.Client(base_url=s.url, headers=h._auth(good), timeout=60)
    req = (f"GET /v1/stores/att/records?content=true&limit=200 HTTP/1.1\r\nHost: x\r\n"
           f"Authorization: Bearer {att}\r\n\r\n").encode()
    socks = []
    for _ in range(args.conns):
        sock = socket.create_connection(("127.0.0.1", s.port))
        sock.settimeout(2)
        try:
            sock.sendall(req * args.pipelined)
        except TimeoutError:
            pass  # the server stopped reading: what went is pipelined
        socks.append(sock)
    time.sleep(args.hold)
    before = probe.get("/metrics").text
    cpu0, t0 = _cpu(s.proc.pid), time.monotonic()
    for sock in socks:
        sock.close()
    lat: list[float] = []
    last, last_change, total = _metric(before, "memfuse_server_requests_total"), t0, 0.0
    text = before
    while time.monotonic() - last_change < 3 and time.monotonic() - t0 < 300:
        t = time.monotonic()
        assert good_c.get("/v1/stores/good/records?limit=1").status_code == 200
        lat.append(time.monotonic() - t)
        text = probe.get("/metrics").text
        total = _metric(text, "memfuse_server_requests_total")
        if total - len(lat) != last:
            last, last_change = total - len(lat), time.monotonic()
        time.sleep(0.2)
    ended = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^memfuse_server_connections_ended_total\{reason="([^"]+)"\} (\S+)$', text, re.M)}
    out = {
        "conns": args.conns, "pipelined": args.pipelined, "hold_s": args.hold,
        "answered_before_close": _metric(before, "memfuse_server_requests_total") - start,
        "answered_after_close": last - _metric(before, "memfuse_server_requests_total"),
        "seconds_until_quiet": round(last_change - t0, 1),
        "server_cpu_after_close_s": round(_cpu(s.proc.pid) - cpu0, 1),
        "good_read_p50_ms": round(statistics.median(lat) * 1e3, 1), "good_read_max_ms": round(max(lat) * 1e3, 1),
        "ended": ended,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
