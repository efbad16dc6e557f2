"""Clients that pipeline requests on one keep-alive connection and never read the answers
(docs/SCALING.md, "Backpressure"): the control plane computes a bounded number of answers per
such connection (the listening socket's bounded send buffer makes the next send block, and the
send timeout closes the connection), stays responsive to other clients meanwhile, and closes
each abusive connection within the send timeout. A client that pipelines and reads gets every
answer. ``/openapi.json`` is served from bytes built once. A refusal for a full share or a
full server (429, 503) ends its connection, and the requests pipelined by a client that left
are not run, on the lean path and on hypercorn's (attack17 F4).

Real sockets against ``memfuse serve``'s server (hypercorn under trio) on loopback."""
from __future__ import annotations

import logging
import re
import socket
import struct
import time

import httpx
import pytest
import trio
from planeutil import serve_app, setup_ws
from stallclock import thread_stalls

from memfuse.server.app import create_app
from memfuse.server.limits import MAX_PIPELINED

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
        url = await serve_app(nursery, app)
        host, port = url.split("//")[1].rsplit(":", 1)
        port = int(port)
        async with httpx.AsyncClient(base_url=url, timeout=10) as probe:
            before = answered((await probe.get("/metrics")).text)
            cpu0 = time.process_time()
            # the times below less this process's own stalls (stallclock.thread_stalls: a GC of
            # the suite's heap, the process stopped; not the server's loop kept busy)
            with thread_stalls() as stalls:
                m0 = time.monotonic()
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
                while stalls.since(m0) < SEND_TIMEOUT + 5 and len(closed_at) < len(socks):
                    t = time.monotonic()
                    r = await probe.get("/healthz")
                    assert r.status_code == 200
                    worst, probes = max(worst, stalls.since(t)), probes + 1
                    held = server_side_open(port, ports)
                    for p in ports - held - set(closed_at):
                        closed_at[p] = stalls.since(m0)
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


# ---------------------------------------------------------------- pipelined requests that never run
# (attack17 F4) Against ``serve`` in this process with static tokens; ``lean`` is the path of
# the connection: record creates (``memfuse.server.lean``) or reads (hypercorn's h11).
ADMIN, WS = "pipe-admin-token", "pipe-ws-token"


async def _bootstrap(url: str) -> None:
    await setup_ws(url, ADMIN)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {WS}"}, timeout=30) as c:
        r = await c.post("/v1/stores/default/records", json={"path": "a.md", "content": "hello\n" * 500})
        assert r.status_code == 201, r.text


def _request(lean: bool, i: int) -> bytes:
    """One request of the lean path (a record create) or of hypercorn's (a read)."""
    if lean:
        body = b'{"path": "p/%d.md", "content": "x\\n"}' % i
        return (b"POST /v1/stores/default/records HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                + WS.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    return (b"GET /v1/stores/default/records?limit=1&content=true HTTP/1.1\r\nHost: x\r\n"
            b"Authorization: Bearer " + WS.encode() + b"\r\n\r\n")


def _metric(text: str, name: str) -> float:
    """The sum of the samples of ``name`` (every label set) in Prometheus ``text``."""
    return sum(float(v) for v in re.findall(r"^%s(?:\{[^}]*\})? ([0-9.e+-]+)$" % re.escape(name), text, re.M))


def _heads(raw: bytes) -> list[bytes]:
    """The heads of the answers in ``raw`` (each answer's body skipped by its Content-Length)."""
    heads = []
    while raw:
        head, sep, raw = raw.partition(b"\r\n\r\n")
        assert sep and head.startswith(b"HTTP/1.1 "), head[:200]
        heads.append(head)
        m = re.search(rb"\r\ncontent-length: *([0-9]+)", head, re.I)
        raw = raw[int(m.group(1)) if m else 0:]
    return heads


async def _metrics(probe: httpx.AsyncClient) -> str:
    r = await probe.get("/metrics")
    assert r.status_code == 200
    return r.text


async def _until_closed(probe: httpx.AsyncClient, left_open: int, bound: float) -> str:
    """Wait (at most ``bound`` s: a failure past it) until the server holds only the
    ``left_open`` connections the test keeps (``memfuse_server_connections``: a connection
    counts until its task has ended, so none of its requests can run after); the metrics
    text then."""
    with trio.fail_after(bound):
        while True:
            text = await _metrics(probe)
            if _metric(text, "memfuse_server_connections") <= left_open:
                return text
            await trio.sleep(0.05)


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "hypercorn"])
@pytest.mark.parametrize("refusal", [429, 503])
async def test_a_refusal_for_a_full_share_or_server_ends_the_connection_and_nothing_pipelined_runs(
        tmp_path, lean, refusal):
    """A 429 ``too_many_requests`` (the token's share of the slots is full) or a 503
    ``overloaded`` (every slot is taken) carries ``Connection: close`` and ends its
    connection: the 19 requests pipelined behind it are never read, so never run (attack17
    F4: a client that left had them refused one by one for a minute). Made deterministic by a
    share of 0 requests a token (every request is refused 429) or 0 slots (503); counted
    from ``/metrics`` once the connection's task has ended (``memfuse_server_connections``)."""
    app = create_app(f"sqlite:///{tmp_path / 'cp.db'}", static_tokens={ADMIN: None, WS: "ws"})
    async with trio.open_nursery() as nursery:
        url = await serve_app(nursery, app)
        port = int(url.rsplit(":", 1)[1])
        await _bootstrap(url)
        async with httpx.AsyncClient(base_url=url, timeout=30) as probe:
            before = await _metrics(probe)
            served_before = app.state.lean.served
            if refusal == 429:
                app.front.shares.per_token = 0
            else:
                app.front.max_inflight = 0
            sock = trio.socket.socket()
            await sock.connect(("127.0.0.1", port))
            await sock.send(b"".join(_request(lean, i) for i in range(20)))
            got = b""
            with trio.fail_after(30):  # until the server closes the connection
                while chunk := await sock.recv(65536):
                    got += chunk
            sock.close()
            heads = _heads(got)
            assert len(heads) == 1, got[:2000]
            assert heads[0].startswith(b"HTTP/1.1 %d " % refusal), heads[0]
            assert b"\r\nconnection: close" in heads[0].lower(), heads[0]
            after = await _until_closed(probe, 1, 30)  # the probe's
            answered = _metric(after, "memfuse_server_requests_total") - _metric(before, "memfuse_server_requests_total")
            assert answered == 1, answered  # the 19 behind it were not refused one by one: not run
            code = "too_many_requests" if refusal == 429 else "overloaded"
            refused = f'memfuse_server_refused_total{{reason="{code}"}}'
            assert _metric(after, refused) - _metric(before, refused) == 1
            assert app.state.lean.served - served_before == (1 if lean else 0)  # the path it took
        nursery.cancel_scope.cancel()
    app.state.service.db.dispose()


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "hypercorn"])
async def test_requests_pipelined_by_clients_that_left_are_not_run(tmp_path, lean, caplog):
    """Hostile clients: N connections each pipeline M requests and leave without reading
    (their close resets the connection: ``SO_LINGER`` 0, as a close with answers unread
    does), half of them at once, half once their first answer came. The server runs none of
    the requests of the first (their client was gone before it started on them) and, on each
    of the others, at most the few it started before the reset arrived (one hop of this
    event loop), never the rest: before, hypercorn's path ran all M, each answer sent to
    nobody (attack17 F4: a minute of it). Every connection ends within a bound, counted in
    ``memfuse_server_connections_ended_total{reason="client_gone"}``, and another client's
    reads stay answered meanwhile. A connection reset before the server started on it is no error
    (before: ``connection failed; dropped`` and a traceback, logged at ERROR, for each)."""
    n, m = 20, 200
    caplog.set_level(logging.WARNING, logger="memfuse.server")
    app = create_app(f"sqlite:///{tmp_path / 'cp.db'}", static_tokens={ADMIN: None, WS: "ws"})
    async with trio.open_nursery() as nursery:
        url = await serve_app(nursery, app)
        port = int(url.rsplit(":", 1)[1])
        await _bootstrap(url)
        async with httpx.AsyncClient(base_url=url, timeout=30) as probe, \
                httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {WS}"}, timeout=30) as good:
            assert (await good.get("/v1/stores/default/records?limit=1")).status_code == 200  # its connection open
            before = await _metrics(probe)
            pipelined = b"".join(_request(lean, i) for i in range(m))
            reads: list[float] = []
            done = trio.Event()

            async def good_reads() -> None:
                while not done.is_set():
                    t0 = trio.current_time()
                    r = await good.get("/v1/stores/default/records?limit=1")
                    assert r.status_code == 200, r.text
                    reads.append(trio.current_time() - t0)
                    await trio.sleep(0.05)

            def reset(sock: socket.socket | trio.socket.SocketType) -> None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.close()  # a reset: the client is gone

            def leave_at_once() -> None:
                # blocking calls: this event loop (the server's too) runs nothing meanwhile, so
                # the reset is in before the server starts on the connection
                sock = socket.create_connection(("127.0.0.1", port))
                sock.sendall(pipelined)  # fits the socket buffers: never waits on the server
                reset(sock)

            async def leave_after_an_answer() -> None:
                sock = trio.socket.socket()
                await sock.connect(("127.0.0.1", port))
                data = pipelined
                while data:  # fits the socket buffers: never waits on the server
                    data = data[await sock.send(data):]
                got = b""
                with trio.fail_after(30):
                    while b"\r\n\r\n" not in got:
                        chunk = await sock.recv(65536)
                        assert chunk, got
                        got += chunk
                reset(sock)

            async with trio.open_nursery() as n2:
                n2.start_soon(good_reads)
                for _ in range(n // 2):
                    leave_at_once()
                async with trio.open_nursery() as clients:
                    for _ in range(n // 2):
                        clients.start_soon(leave_after_an_answer)
                after = await _until_closed(probe, 2, 60)  # the probe's and the good client's
                done.set()
            answered = (_metric(after, "memfuse_server_requests_total")
                        - _metric(before, "memfuse_server_requests_total") - len(reads))
            # none of the n/2 that left at once; the first answers of the n/2 that waited for
            # one, and at most 3 more each (started before their reset came in)
            assert answered <= n // 2 * 4, f"{answered} requests of {n} connections that had left were run"
            assert reads and max(reads) < 10.0, reads  # answered meanwhile (a shared machine: generous)
            gone = _metric(after, "memfuse_server_connections_ended_total{reason=\"client_gone\"}") - _metric(
                before, "memfuse_server_connections_ended_total{reason=\"client_gone\"}")
            assert gone == n, gone
            r = await good.get("/v1/stores/default/records?limit=1")
            assert r.status_code == 200
        nursery.cancel_scope.cancel()
    app.state.service.db.dispose()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


async def test_a_client_that_pipelines_without_reading_is_answered_a_bounded_run_then_closed(tmp_path):
    """200 reads pipelined at once, the client reading nothing until they are all sent: the
    server answers ``MAX_PIPELINED`` of them in a row, the last with ``Connection: close``, then
    ends the connection; the rest are never run (before: every one, until the send buffer
    was full, ~350 a connection). Counted in
    ``memfuse_server_connections_ended_total{reason="pipelined"}``. A client that waits for
    each answer is never cut (the run starts again at each answer it waited for)."""
    app = create_app(f"sqlite:///{tmp_path / 'cp.db'}", static_tokens={ADMIN: None, WS: "ws"})
    async with trio.open_nursery() as nursery:
        url = await serve_app(nursery, app)
        port = int(url.rsplit(":", 1)[1])
        await _bootstrap(url)
        async with httpx.AsyncClient(base_url=url, timeout=30) as probe:
            before = await _metrics(probe)
            sock = trio.socket.socket()
            await sock.connect(("127.0.0.1", port))
            data = b"".join(_request(False, i) for i in range(200))
            while data:  # fits the socket buffers
                data = data[await sock.send(data):]
            got = b""
            with trio.fail_after(30):  # until the server closes the connection
                while chunk := await sock.recv(65536):
                    got += chunk
            sock.close()
            heads = _heads(got)
            assert len(heads) == MAX_PIPELINED, len(heads)
            assert all(h.startswith(b"HTTP/1.1 200 ") for h in heads)
            assert b"\r\nconnection: close" in heads[-1].lower(), heads[-1]
            assert not any(b"\r\nconnection: close" in h.lower() for h in heads[:-1])
            after = await _until_closed(probe, 1, 30)  # the probe's
            answered = _metric(after, "memfuse_server_requests_total") - _metric(before, "memfuse_server_requests_total")
            assert answered == MAX_PIPELINED, answered
            cut = 'memfuse_server_connections_ended_total{reason="pipelined"}'
            assert _metric(after, cut) - _metric(before, cut) == 1
            # one at a time, waiting for each answer: far past the bound on one connection
            async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {WS}"}, timeout=30) as c:
                for _ in range(MAX_PIPELINED * 2):
                    assert (await c.get("/v1/stores/default/records?limit=1")).status_code == 200
            assert _metric(await _metrics(probe), cut) - _metric(before, cut) == 1
        nursery.cancel_scope.cancel()
    app.state.service.db.dispose()
