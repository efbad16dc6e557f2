"""Clients that pipeline requests on one keep-alive connection and never read the answers
(docs/SCALING.md, "Backpressure"): the control plane computes a bounded number of answers per
such connection (the listening socket's bounded send buffer makes the next send block, and the
send timeout closes the connection), stays responsive to other clients meanwhile, and closes
each abusive connection within the send timeout. A client that pipelines and reads gets every
answer. ``/openapi.json`` is served from bytes built once.

Real sockets against ``memfuse serve``'s server (hypercorn under trio) on loopback."""
from __future__ import annotations

import re
import time

import httpx
import trio

from memfuse.server.app import create_app
from memfuse.server.serve import serve

CONNECTIONS, PIPELINED = 20, 200
SEND_TIMEOUT = 2.0


def server_side_open(server_port: int, client_ports: set[int]) -> set[int]:
    """Of ``client_ports``, those whose connection to ``server_port`` the server still holds
    (its end in /proc/net/tcp, any state but TIME_WAIT / CLOSE)."""
    held = set()
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            local, remote, state = fields[1], fields[2], int(fields[3], 16)
            if (int(local.split(":")[1], 16) == server_port and state not in (6, 7)
                    and int(remote.split(":")[1], 16) in client_ports):
                held.add(int(remote.split(":")[1], 16))
    return held


def answered(metrics: str) -> int:
    m = re.search(r'^memfuse_server_requests_total\{status="2xx"\} ([0-9.e+]+)$', metrics, re.M)
    return int(float(m.group(1))) if m else 0


async def _pipeline(host: str, port: int, n: int, path: str) -> trio.socket.SocketType:
    sock = trio.socket.socket()
    await sock.connect((host, port))
    req = f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    data = req * n
    while data:
        with trio.move_on_after(5):  # the server stops reading once its answers back up
            sent = await sock.send(data)
            data = data[sent:]
            continue
        break
    return sock


async def test_pipelining_without_reading_is_bounded_and_cut(tmp_path):
    app = create_app(f"sqlite:///{tmp_path / 'cp.db'}")
    app.front.send_timeout = SEND_TIMEOUT
    doc = app.openapi_bytes()
    assert app.openapi_bytes() is doc  # built once
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve, app, "127.0.0.1:0")
        host, port = url.split("//")[1].rsplit(":", 1)
        port = int(port)
        async with httpx.AsyncClient(base_url=url, timeout=10) as probe:
            before = answered((await probe.get("/metrics")).text)
            cpu0 = time.process_time()
            t0 = trio.current_time()
            socks = []
            async with trio.open_nursery() as n:
                async def open_one():
                    socks.append(await _pipeline(host, port, PIPELINED, "/openapi.json"))
                for _ in range(CONNECTIONS):
                    n.start_soon(open_one)
            # other clients are answered within a second while the abusers wait to be cut
            worst, probes = 0.0, 0
            ports = {s.getsockname()[1] for s in socks}
            closed_at: dict[int, float] = {}
            while trio.current_time() - t0 < SEND_TIMEOUT + 5 and len(closed_at) < len(socks):
                t = trio.current_time()
                r = await probe.get("/healthz")
                assert r.status_code == 200
                worst, probes = max(worst, trio.current_time() - t), probes + 1
                held = server_side_open(port, ports)
                for p in ports - held - set(closed_at):
                    closed_at[p] = trio.current_time() - t0
                await trio.sleep(0.05)
            cpu = time.process_time() - cpu0
            assert len(closed_at) == CONNECTIONS, f"only {len(closed_at)} of {CONNECTIONS} closed"
            # bounded: the whole attack cost this process (server, abusers and the probe loop,
            # which itself runs ~140 probes) a few seconds of CPU at most; unbounded, the 4,000
            # pipelined encodings took over 30 s (wall time is the machine's load: each probe
            # is only bounded generously)
            assert cpu < 3.0, f"the attack took {cpu:.2f} s of CPU"
            assert worst < 5.0, f"a /healthz took {worst:.2f} s"
            # cut once a send blocked for the send timeout (the kernel's zero-window probes
            # come at growing intervals: up to about a second more)
            assert max(closed_at.values()) < SEND_TIMEOUT + 3.0, closed_at
            served = answered((await probe.get("/metrics")).text) - before - probes
            # each abusive connection got a few answers (what fits in the socket buffers),
            # not its 200: the server did not encode the rest
            assert served <= CONNECTIONS * 12, served
            for s in socks:
                s.close()
            # a client that pipelines AND reads gets every answer
            sock = await _pipeline(host, port, 50, "/healthz")
            got = b""
            with trio.fail_after(10):
                while got.count(b"HTTP/1.1 200") < 50 or not got.endswith(b'{"ok":true}'):
                    chunk = await sock.recv(65536)
                    assert chunk, got[-200:]
                    got += chunk
            sock.close()
            r = await probe.get("/openapi.json")
            assert r.status_code == 200 and r.content == doc and r.json()["paths"]
        nursery.cancel_scope.cancel()
    app.state.service.db.dispose()
