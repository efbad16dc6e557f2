"""The lean path for record writes (``memfuse.server.lean``; ``memfuse serve`` serves create,
update and batch on keep-alive connections without hypercorn's per-request machinery) answers
byte for byte as hypercorn does: the same control plane served twice, with the lean path
(``serve(lean=True)``) and without it, is sent the same bytes on real loopback sockets and
its answers are compared (the ``Date`` header and the ids and times a create makes aside).

Cases: successes and refusals (401, 404, 413 declared and a 64-bit-overflowing length, 422
from FastAPI, a slow body's 408), a hand-over mid-connection (a GET after three creates on
one keep-alive connection), pipelined requests, ``Connection: close``, ``Expect:
100-continue``, a client that vanishes mid-body; and the lean path's own counters show it
served what it should. A small ASGI app behind ``_worker_serve`` checks the keep-alive cap
across a hand-over and that an idle lean connection closes at the header deadline.
"""
from __future__ import annotations

import json
import logging
import re
import time
from typing import Any

import httpx
import pytest
import trio
from hypercorn.config import Config
from planeutil import serve_app, setup_ws
from stallclock import thread_stalls

from memfuse.server import serve as serve_mod
from memfuse.server.app import create_app

pytestmark = pytest.mark.timeout(120)

ADMIN = "lean-admin-token"
WS = "lean-ws-token"
MAX_BODY = 64 * 1024


def _app(tmp_path, name: str) -> Any:
    return create_app(f"sqlite:///{tmp_path / name}.db", static_tokens={ADMIN: None, WS: "ws"},
                      max_body=MAX_BODY, receive_timeout=0.5, body_timeout=2, header_timeout=2)


async def _talk(port: int, pieces: list[bytes | float], *, bound: float = 10) -> bytes:
    """Send ``pieces`` on a new connection (a float: sleep that long; ``b""``: shut the
    write side), then read until the server closes it; every byte read."""
    with trio.fail_after(bound):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        got = bytearray()
        try:
            async def reader() -> None:
                while True:
                    try:
                        data = await stream.receive_some(65536)
                    except trio.BrokenResourceError:
                        return
                    if not data:
                        return
                    got.extend(data)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(reader)
                for piece in pieces:
                    if isinstance(piece, float):
                        await trio.sleep(piece)
                    elif piece == b"":  # the client leaves (its write side shut)
                        await stream.send_eof()
                    else:
                        try:
                            await stream.send_all(piece)
                        except trio.BrokenResourceError:
                            break
        finally:
            await stream.aclose()
    return bytes(got)


def _req(method: str, path: str, body: bytes | None = None, *, token: str | None = WS,
         extra: str = "", length: int | None = None, close: bool = False) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: lean\r\n"
    if token:
        head += f"Authorization: Bearer {token}\r\n"
    if body is not None:
        head += "Content-Type: application/json\r\n"
        head += f"Content-Length: {len(body) if length is None else length}\r\n"
    if close:
        head += "Connection: close\r\n"
    head += extra
    return head.encode() + b"\r\n" + (body or b"")


def _create(path: str, content: str = "hello\n", **kw: Any) -> bytes:
    return _req("POST", "/v1/stores/default/records",
                json.dumps({"path": path, "content": content}).encode(), **kw)


_ID = re.compile(rb'"(id|record_id|created_at|updated_at|modified_at|at|cursor|seq|change_id)"\s*:\s*("[^"]*"|[0-9]+)')
_DATE = re.compile(rb"\r\ndate: [^\r]*\r\n")


def _normal(raw: bytes) -> bytes:
    """``raw`` answers with the ``Date`` header and the ids and times records get made
    uniform; each body's ``content-length`` checked against the body and made uniform."""
    raw = _DATE.sub(b"\r\ndate: D\r\n", raw)
    out = bytearray()
    rest = raw
    while rest:
        head, sep, after = rest.partition(b"\r\n\r\n")
        if not sep:
            out += rest
            break
        m = re.search(rb"\r\ncontent-length: ([0-9]+)\r?", head + b"\r")
        n = int(m.group(1)) if m else 0
        body = after[:n]
        assert len(body) == n, (head, after)
        out += re.sub(rb"content-length: [0-9]+", b"content-length: N", head) + sep + _ID.sub(rb'"\1":X', body)
        rest = after[n:]
    return bytes(out)


class Pair:
    """Two control planes with the same state, one served with the lean path (``lean``), one
    without (``plain``); ports and apps."""

    def __init__(self, lean_port: int, plain_port: int, lean_app: Any, plain_app: Any) -> None:
        self.lean_port, self.plain_port, self.lean_app, self.plain_app = lean_port, plain_port, lean_app, plain_app

    async def both(self, pieces: list[bytes | float], **kw: Any) -> tuple[bytes, bytes]:
        """The answers of both to ``pieces`` (see ``_talk``), normalized, asserted equal."""
        a = _normal(await _talk(self.lean_port, pieces, **kw))
        b = _normal(await _talk(self.plain_port, pieces, **kw))
        assert a == b, (a, b)
        return a, b


async def _pair(tmp_path, nursery: trio.Nursery) -> Pair:
    apps, ports = [], []
    for name, lean in (("lean", True), ("plain", False)):
        app = _app(tmp_path, name)
        url = await serve_app(nursery, app, lean=lean)
        await setup_ws(url, ADMIN)
        apps.append(app)
        ports.append(int(url.rsplit(":", 1)[1]))
    return Pair(ports[0], ports[1], apps[0], apps[1])


def _statuses(raw: bytes) -> list[int]:
    return [int(s) for s in re.findall(rb"HTTP/1\.1 ([0-9]{3}) \r\n", raw)]


async def test_a_request_that_asked_to_close_is_answered_whatever_the_client_sends_after_it(tmp_path):
    """A create with ``Connection: close`` followed by more bytes (a stray CRLF after the body,
    which old clients send, or a request pipelined after it): the create is answered 201 and
    nothing after it runs (RFC 9112 §9.6), by hypercorn (behind a read) as by the lean path. h11
    raised on those bytes and hypercorn answered 400, although the create had been written
    (attack22)."""
    async with trio.open_nursery() as nursery:
        p = await _pair(tmp_path, nursery)
        get = _req("GET", "/v1/stores/default/records?path=a.md")
        for i, tail in enumerate((b"\r\n", get)):
            a, _ = await p.both([get + _create(f"h{i}.md", close=True) + tail])  # hypercorn's
            assert _statuses(a) == [200, 201], a
            a, _ = await p.both([_create(f"l{i}.md", close=True) + tail])  # the lean path's
            assert _statuses(a) == [201], a
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{p.plain_port}",
                                     headers={"Authorization": f"Bearer {ADMIN}"}) as c:
            r = await c.get("/v1/stores/default/records", params={"limit": 100})
            assert sorted(x["path"] for x in r.json()["records"]) == ["h0.md", "h1.md", "l0.md", "l1.md"]
        nursery.cancel_scope.cancel()


async def test_a_connection_hypercorn_took_comes_back_for_its_next_record_writes(tmp_path):
    """A read on a keep-alive connection hands it to hypercorn; once hypercorn's answer is
    over and the client's next request is a record write, the connection goes back to the
    lean path (``LeanHTTP.takes_back``): a sidecar whose connection carried one page read
    had every later write of it served by hypercorn, up to 1,000 of them. Answers stay
    byte for byte hypercorn's; a read pipelined behind a write, and a write pipelined
    behind a read (h11 holds it: not handed back mid-pipeline), are served as before."""
    async with trio.open_nursery() as nursery:
        p = await _pair(tmp_path, nursery)
        lean = p.lean_app.state.lean
        get = _req("GET", "/v1/stores/default/records?path=a.md")
        # a read first, then writes, a read again, writes again (a pause between the
        # pieces: each arrives after the last answer, as a client waiting for it sends)
        a, _ = await p.both([get, 0.2, _create("a.md"), 0.2, _create("b.md"), 0.2, get, 0.2,
                             _create("c.md"), 0.2, _create("d.md", close=True)])
        assert _statuses(a) == [200, 201, 201, 200, 201, 201], a
        assert lean.served == 4, lean.served  # every create, none by hypercorn
        assert lean.handed_back == 2 and lean.handed_over == 1
        # what an operator sees of it (/metrics)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{p.lean_port}") as c:
            text = (await c.get("/metrics")).text
        assert "memfuse_server_lean_requests_total 4.0" in text, text
        assert 'memfuse_server_lean_handovers_total{direction="back"} 2.0' in text
        assert 'memfuse_server_lean_handovers_total{direction="to_hypercorn"} 1.0' in text
        # a write pipelined behind a read: hypercorn serves both (h11 holds the write)
        served, back = lean.served, lean.handed_back
        a, _ = await p.both([get + _create("e.md"), 0.3, _create("f.md", close=True)])
        assert _statuses(a) == [200, 201, 201], a
        assert lean.handed_back == back + 1 and lean.served == served + 1  # f.md: lean again
        # a head cut in two after the read: hypercorn's (not a whole head), answered the same
        whole = _create("g.md", close=True)
        a, _ = await p.both([get, 0.2, whole[:20], 0.1, whole[20:]])
        assert _statuses(a) == [200, 201], a
        assert lean.handed_back == back + 1
        nursery.cancel_scope.cancel()


async def test_lean_answers_as_hypercorn_does(tmp_path):
    async with trio.open_nursery() as nursery:
        p = await _pair(tmp_path, nursery)
        lean = p.lean_app.state.lean
        assert not hasattr(p.plain_app.state, "lean")

        # three creates on one keep-alive connection, then a GET: handed over to hypercorn
        a, _ = await p.both([_create("a.md"), _create("b.md"), _create("c.md"),
                             _req("GET", "/v1/stores/default/records?path=a.md", close=True)])
        assert _statuses(a) == [201, 201, 201, 200], a
        assert lean.served == 3 and lean.handed_over == 1

        # pipelined: all requests in one write, the last one closing
        a, _ = await p.both([_create("p1.md") + _create("p2.md") + _create("p1.md", "again\n")
                             + _create("p3.md", close=True)])
        assert _statuses(a) == [201, 201, 409, 201], a
        assert lean.served == 7

        # refusals: no token (401, the body unread: closed), an unknown store (404), a bad
        # body (FastAPI's 422), an update of no record, a batch
        a, _ = await p.both([_create("x.md", token=None)])
        assert _statuses(a) == [401] and b"connection: close" in a
        # two Authorization headers (a workspace's and the admin's, either order; a GET):
        # 400 problem, neither token used, nothing stored
        for extra in (f"Authorization: Bearer {ADMIN}\r\n", f"authorization: Bearer {WS}\r\n"):
            a, _ = await p.both([_create("two.md", extra=extra)])
            assert _statuses(a) == [400] and b'"code": "invalid_request"' in a, a
            assert b"content-type: application/problem+json" in a, a
        a, _ = await p.both([_req("GET", "/v1/stores/default/records?path=two.md",
                                  extra=f"Authorization: Bearer {ADMIN}\r\n", close=True)])
        assert _statuses(a) == [400], a
        # a bearer token and another X-Api-Key (attack20 F3): two credentials too; the same
        # token in both is one credential
        a, _ = await p.both([_create("two.md", extra=f"X-Api-Key: {ADMIN}\r\n")])
        assert _statuses(a) == [400] and b'"code": "invalid_request"' in a, a
        a, _ = await p.both([_create("one.md", extra=f"X-Api-Key: {WS}\r\n")])
        assert _statuses(a) == [201], a
        a, _ = await p.both([_req("GET", "/v1/stores/default/records?path=two.md", close=True)])
        assert _statuses(a) == [200] and b'"records":[]' in a, a
        a, _ = await p.both([_req("POST", "/v1/stores/nope/records", b'{"path":"n.md","content":"x"}'),
                             _req("POST", "/v1/stores/default/records", b'{"path": 5}'),
                             _req("PUT", "/v1/stores/default/records/00000000-0000-0000-0000-000000000000",
                                  b'{"content":"x"}'),
                             _req("POST", "/v1/stores/default/batch",
                                  json.dumps({"operations": [{"op": "create", "path": "bt.md",
                                                              "content": "b\n"}]}).encode(), close=True)])
        assert _statuses(a)[:3] == [404, 422, 404] and len(_statuses(a)) == 4, a

        # bodies: too large declared (413 at once, closed), a length past 64 bits, a slow
        # body (408 at the 0.5 s between pieces), a body larger than declared (the extra
        # bytes are a malformed next request: hypercorn's 400)
        a, _ = await p.both([_create("big.md", length=MAX_BODY + 1)])
        assert _statuses(a) == [413] and b"connection: close" in a
        a, _ = await p.both([_create("o.md", length=2**64 + 1)])
        assert _statuses(a) == [413], a
        body = json.dumps({"path": "slow.md", "content": "slow\n"}).encode()
        a, _ = await p.both([_create("slow.md")[:-len(body)] + body[:5], 1.5, body[5:]])
        assert _statuses(a) == [408], a
        a, _ = await p.both([_create("more.md", length=10), 0.2, _create("m2.md", close=True)])
        assert _statuses(a)[:1] == [422], a

        # heads the lean parser leaves to hypercorn (h11 reads them, or refuses them) and
        # the odd ones it reads: whitespace around values, a refusal that closes when the
        # client asked to close too (h11 rewrites the Connection header)
        body = b'{"path":"h.md","content":"h"}'
        for raw in (_req("POST", "/v1/stores/default/records", body, close=True).replace(b"\r\n", b"\n"),
                    _req("POST", "/v1/stores/default/records", body, close=True).replace(b"Host: lean\r\n", b""),
                    _req("POST", "/v1/stores/default/records", body, close=True,
                         extra=f"Content-Length: {len(body)}\r\n"),
                    _req("post", "/v1/stores/default/records", body, close=True),
                    _req("POST", "/v1/stores/default/records", body, close=True, extra="X-Odd:\t v\t \r\n"),
                    _req("POST", "/v1/stores/default/records", body, close=True, extra="X-Fold: a\r\n b\r\n"),
                    _create("big2.md", length=MAX_BODY + 1, close=True)):
            a, _ = await p.both([raw])
            assert _statuses(a), (raw, a)

        # Expect: 100-continue and a query string are hypercorn's (handed over at once)
        a, _ = await p.both([_create("e.md", extra="Expect: 100-continue\r\n", close=True)])
        assert _statuses(a) == [100, 201], a
        a, _ = await p.both([_req("POST", "/v1/stores/default/records?x=1", b'{"path":"q.md","content":"q"}',
                                  close=True)])
        assert _statuses(a) == [201], a

        # a client that leaves mid-body: hypercorn's 400 (h11's), nothing stored, the server
        # serves on
        served = lean.served
        a, _ = await p.both([_create("gone.md")[:-3], b""])
        assert _statuses(a) == [400] and b"connection: close" in a
        assert lean.served == served + 1
        a, _ = await p.both([_req("GET", "/v1/stores/default/records?path=gone.md", close=True)])
        assert _statuses(a) == [200] and b'"records":[]' in a, a
        nursery.cancel_scope.cancel()


LEANROUTE = lambda m, p: m == "POST"


async def _small_server(nursery: trio.Nursery, *, max_requests: int = 1000,
                        keep_alive: float = 5.0, graceful: float = 1.0) -> tuple[int, Any]:
    """A small ASGI app (POST: 200 with the body's length; else 200 ``get``) behind
    ``_worker_serve`` with every POST served lean; its port and the lean path's counters."""
    holder: dict[str, Any] = {}

    async def asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        body = b""
        more = True
        while more:
            m = await receive()
            body += m.get("body", b"")
            more = m.get("more_body", False)
        out = str(len(body)).encode() if scope["method"] == "POST" else b"get"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(out)).encode())]})
        await send({"type": "http.response.body", "body": out})

    class State:
        pass

    asgi.state = State()  # type: ignore[attr-defined]
    holder["app"] = asgi
    config = Config()
    config.bind = [f"fd://{serve_mod.listen_socket('127.0.0.1:0').detach()}"]
    config.graceful_timeout = graceful
    config.accesslog = None
    config.keep_alive_timeout = keep_alive
    config.keep_alive_max_requests = max_requests
    config.errorlog = logging.getLogger("hypercorn.error")
    shutdown = trio.Event()
    binds = await nursery.start(lambda task_status: serve_mod._worker_serve(
        asgi, config, None, shutdown.wait, task_status, LEANROUTE))
    asgi.state.shutdown = shutdown  # type: ignore[attr-defined]
    return int(binds[0].rsplit(":", 1)[1]), asgi.state  # type: ignore[attr-defined]


def _post(body: bytes) -> bytes:
    return b"POST /w HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


async def test_keep_alive_cap_counts_across_the_hand_over():
    async with trio.open_nursery() as nursery:
        port, state = await _small_server(nursery, max_requests=3)
        # two lean answers, then hypercorn's third carries Connection: close and ends the
        # connection (``_talk`` reads to its end). (No fourth request is sent: a request
        # unread when the server closes makes the kernel reset the connection, and the
        # client may lose the last answer, with or without the lean path.)
        raw = await _talk(port, [_post(b"ab"), _post(b"abc"), b"GET /r HTTP/1.1\r\nHost: x\r\n\r\n"])
        assert _statuses(raw) == [200, 200, 200], raw
        assert raw.count(b"connection: close") == 1 and raw.endswith(b"connection: close\r\n\r\nget")
        assert state.lean.handed_over == 1
        # all lean: the third answer closes
        raw = await _talk(port, [_post(b"a"), _post(b"b"), _post(b"c")])
        assert _statuses(raw) == [200, 200, 200] and raw.count(b"connection: close") == 1, raw
        assert raw.endswith(b"connection: close\r\n\r\n1")
        assert state.lean.served == 5
        nursery.cancel_scope.cancel()


async def test_idle_lean_connection_closes_at_the_header_deadline():
    # the times less this process's own stalls (stallclock.thread_stalls: a garbage
    # collection, the process descheduled; not the server's event loop blocked)
    async with trio.open_nursery() as nursery:
        port, state = await _small_server(nursery, keep_alive=0.5)
        with thread_stalls() as stalls:
            t0 = time.monotonic()
            # answered, then idle: closed at the header deadline (not the 10 s bound)
            raw = await _talk(port, [_post(b"x")])
            assert _statuses(raw) == [200] and stalls.since(t0) < 3, (stalls.since(t0), stalls.worst())
            # a head begun and not finished is closed at the deadline too, without an answer
            t0 = time.monotonic()
            raw = await _talk(port, [_post(b"x"), b"POST /w HTTP/1.1\r\n"])
            assert _statuses(raw) == [200] and stalls.since(t0) < 3, (stalls.since(t0), stalls.worst())
        nursery.cancel_scope.cancel()


async def _serial(port: int, n: int) -> None:
    """``n`` POSTs on one connection, each sent once the answer before it is read."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    try:
        with trio.fail_after(20):
            for i in range(n):
                await stream.send_all(_post(b"x" * (i % 9 + 1)))
                got = b""
                while not got.endswith(b"\r\n\r\n%d" % (i % 9 + 1)):
                    data = await stream.receive_some(65536)
                    assert data, got
                    got += data
    finally:
        await stream.aclose()


async def test_lean_requests_move_no_deadline_and_idle_ones_still_close(monkeypatch):
    """The header deadline of the requests of a lean connection is ``LeanHTTP.watch``'s, not a
    cancel scope's deadline moved twice per request (trio's deadline heap and a context
    manager, ~3 % of the loop's CPU per write): serving 40 requests on one connection sets a
    scope deadline only a few times (the test's own bound and the watcher's sleeps). An idle
    connection is still closed at its deadline, also after the watcher parked (no connection
    waiting through a whole sleep) and is woken by the next one."""
    sets = 0
    prop = trio.CancelScope.deadline

    def counting(scope: trio.CancelScope, value: float) -> None:
        nonlocal sets
        sets += 1
        prop.fset(scope, value)

    async with trio.open_nursery() as nursery:
        port, state = await _small_server(nursery, keep_alive=0.4)
        await _serial(port, 2)  # the server's own scopes are made
        monkeypatch.setattr(trio.CancelScope, "deadline", property(prop.fget, counting))
        await _serial(port, 40)
        monkeypatch.undo()
        assert state.lean.served == 42
        assert sets < 10, sets  # 2 per request when each request moved the header deadline
        for _ in range(2):  # the second time, the watcher has parked (idle > 2 keep-alives)
            with thread_stalls() as stalls:  # (the upper bound less this process's own stalls)
                t0 = time.monotonic()
                raw = await _talk(port, [_post(b"x")])  # answered, then idle: closed at the deadline
                t1 = time.monotonic()
            assert _statuses(raw) == [200] and 0.3 < t1 - t0 and stalls.time(t0, t1) < 3, (t1 - t0, stalls.worst())
            await trio.sleep(1.2)
        assert state.lean.parked and not state.lean.waiting  # idle: the watcher waits for no time
        nursery.cancel_scope.cancel()


async def test_idle_lean_connections_close_at_once_when_the_server_stops():
    async with trio.open_nursery() as outer:
        done = trio.Event()

        async def run(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            async with trio.open_nursery() as nursery:
                task_status.started(await _small_server(nursery, keep_alive=30, graceful=20))
            done.set()

        port, state = await outer.start(run)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(_post(b"x"))
        got = b""
        with trio.fail_after(10):
            while not got.endswith(b"\r\n\r\n1"):
                got += await stream.receive_some(65536)
        assert state.lean.served == 1
        with thread_stalls() as stalls:  # (the bound less this process's own stalls)
            t0 = time.monotonic()
            state.shutdown.set()  # idle on the lean path: closed now, not at the grace's end (20 s)
            with trio.fail_after(10):
                assert await stream.receive_some(65536) == b""
                await done.wait()
            t1 = time.monotonic()
        assert stalls.time(t0, t1) < 3, (t1 - t0, stalls.worst())
        await stream.aclose()


async def test_lean_write_answers_not_read_are_cut_at_the_send_timeout(tmp_path, caplog):
    """A client that pipelines creates and reads no answer: once the kernel's buffers are
    full, the answer's send on the lean path is bounded by the front door's send timeout
    (``gate.SEND_WITHIN``, served by the lean exchange itself) and the connection closes,
    logged as a client that did not read."""
    app = _app(tmp_path, "cut")
    async with trio.open_nursery() as nursery:
        url = await serve_app(nursery, app, lean=True)
        await setup_ws(url, ADMIN)
        # set after the listening socket was made: its kernel bound (TCP_USER_TIMEOUT, from
        # the send timeout then: 30 s) does not cut the connection first
        app.front.send_timeout = 1.0
        port = int(url.rsplit(":", 1)[1])
        lean = app.state.lean
        sock = trio.socket.socket()
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, 1024)  # a small window
        await sock.connect(("127.0.0.1", port))
        data = b"".join(_create(f"cut/{i}.md", "x" * 100) for i in range(3000))
        caplog.set_level(logging.INFO, logger="memfuse.server.gate")
        with trio.fail_after(60):
            while data:  # the server stops reading once its answers back up: then it is cut
                try:
                    with trio.move_on_after(5):
                        data = data[await sock.send(data):]
                        continue
                except OSError:  # reset: the server closed the connection
                    pass
                break
            t0 = trio.current_time()
            while not any("did not read its response" in r.getMessage() for r in caplog.records):
                assert trio.current_time() - t0 < 1.0 + 10, "not cut by the send timeout"
                await trio.sleep(0.05)
        assert 0 < lean.served < 3000
        sock.close()
        # the server serves on
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {WS}"}) as c:
            r = await c.post("/v1/stores/default/records", json={"path": "after.md", "content": "x"})
            assert r.status_code == 201, r.text
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------- the answer's framing
_NAMES = [b"content-type", b"Content-Type", b"date", b"server", b"etag", b"content-length",
          b"x-a", b"bad name", b"connection", b"transfer-encoding", b"host", b"", b"Server"]
_VALUES = [b"application/json", b"hypercorn-h11", b"Thu, 03 Dec 2026 05:00:00 GMT", b'"abc"', b"",
           b" lead", b"trail ", b"a\x00b", b"a\tb", b"\xe9t\xe9", b"close", b"5", b"12", b"x\r\ny: 1"]


def _h11_frames(method: str, close: bool, status: int, headers: list[tuple[bytes, bytes]],
                body: bytes) -> bytes | None:
    """What h11 (hypercorn's framer) sends for the answer, or None when it refuses it."""
    import h11

    from memfuse.server.lean import _Head, _framer

    conn = _framer(_Head(method, b"/", [], 0, close, 0))
    try:
        return b"".join(conn.send(e) or b"" for e in (
            h11.Response(status_code=status, headers=headers), h11.Data(data=body), h11.EndOfMessage()))
    except h11.LocalProtocolError:
        return None


def test_plain_answers_are_what_h11_frames_also_once_their_headers_were_seen():
    """``lean._plain_answer`` on random answers (status, header pairs from a pool of good and
    bad names and values, body): when it frames one, its bytes are h11's; a second call (the
    repeating headers then known: ``_LINES``) gives the same answer as the first, and a pair
    h11 refuses is refused every time."""
    import random

    from memfuse.server import lean

    rnd = random.Random(14)
    lean._LINES.clear()
    framed = refused = 0
    for _ in range(6000):
        body = rnd.choice([b"", b"{}", b'{"id":"x"}', b"12345"])
        headers = [(rnd.choice(_NAMES), rnd.choice(_VALUES)) for _ in range(rnd.randrange(0, 3))]
        if rnd.random() < 0.8:  # mostly answers of the write path: a right length, the usual pairs
            headers.append((b"content-length", b"%d" % len(body)))
            headers += [(b"content-type", b"application/json"), (b"date", rnd.choice(_VALUES[2:4])),
                        (b"server", b"hypercorn-h11")]
            rnd.shuffle(headers)
        status = rnd.choice([200, 201, 204, 304, 404, 409, 412, 503, 100])
        close = rnd.random() < 0.2
        first = lean._plain_answer(status, headers, body, close)
        again = lean._plain_answer(status, headers, body, close)
        assert first == again, headers
        if first is None:
            refused += 1
            continue
        framed += 1
        assert first == _h11_frames(rnd.choice(["POST", "PUT"]), close, status, headers, body), headers
    assert framed > 1000 and refused > 500
    assert all(k.lower() in lean._REPEATING for k, _ in lean._LINES)


_LINES_POOL = [b"Host: cp", b"host: cp:8080", b"User-Agent: python-httpx/0.28", b"Accept: */*",
               b"Authorization: Bearer mf_abc", b"Content-Type: application/json", b"Content-Length: 2",
               b"content-length: 02", b"Content-Length:  7 ", b"Content-Length: x", b"Idempotency-Key: k1",
               b"If-Match: \"abc\"", b"Connection: keep-alive", b"Connection: Close", b"connection: te, close",
               b"Transfer-Encoding: chunked", b"Expect: 100-continue", b"Upgrade: h2c", b"X-A:", b"X-B: \t v \t",
               b"Bad Name: x", b" folded", b"X-C: a\x00b", b"X-D: caf\xe9", b"X-E : v", b"X-F:v"]


def test_request_heads_read_as_h11_reads_them_also_once_their_lines_were_seen():
    """``lean.parse_head`` on random heads (a pool of good and bad lines): a head it takes is
    the request h11 reads (method, target, lower-case names, stripped values, keep-alive,
    length); read again (its lines then known: ``_HEAD_LINES``) it gives the same answer."""
    import random

    import h11

    from memfuse.server import lean

    rnd = random.Random(14)
    lean._HEAD_LINES.clear()
    taken = 0
    for _ in range(6000):
        start = rnd.choice([b"POST /v1/stores/s/records HTTP/1.1", b"PUT /v1/stores/s/records/x HTTP/1.1",
                            b"GET / HTTP/1.1", b"POST /a?b HTTP/1.1"])
        lines = [rnd.choice(_LINES_POOL) for _ in range(rnd.randrange(0, 7))]
        if rnd.random() < 0.7:
            lines += [b"Host: cp", rnd.choice([b"Content-Length: 2", b"Content-Length: 0"])]
            rnd.shuffle(lines)
        head = b"\r\n".join([start, *lines]) + b"\r\n\r\n"
        first = lean.parse_head(head, 16384)
        again = lean.parse_head(head, 16384)
        assert first == again, head
        if first is None:
            continue
        taken += 1
        conn = h11.Connection(h11.SERVER)
        conn.receive_data(head)
        event = conn.next_event()
        assert isinstance(event, h11.Request), head
        assert (first.method, first.path) == (event.method.decode(), event.target)
        assert first.headers == list(event.headers), head
        assert first.length == int(dict(event.headers)[b"content-length"])
        assert first.close == (not h11._connection._keep_alive(event)), head
        assert first.size == len(head)
    assert taken > 400
    assert not any(n in lean._PER_REQUEST for n, _ in lean._HEAD_LINES.values())


def test_the_memos_of_head_lines_keep_no_long_line():
    """Any client, before it is authenticated, chooses the lines of its request heads (up to
    ``max_head``): the memos of lines seen (request lines, header lines, names, ``Connection``
    values) keep only short ones, so heads of distinct long lines leave them small (attack21:
    256 lines of ~15 KB in each grew ``memfuse serve`` by 38 MB); a long line still reads the
    same, each time."""
    import os

    from memfuse.server import lean

    for memo in (lean._REQUEST_LINES, lean._HEAD_LINES, lean._NAMES, lean._CLOSES):
        memo.clear()
    for i in range(1200):
        big = os.urandom(3500).hex().encode()  # 7,000 bytes a line
        kind = i % 4
        line = {1: b"X-Pad: " + big, 2: b"X" + big + b": v", 3: b"Connection: keep-alive" + big}.get(kind, b"X-Q: v")
        head = b"POST /v1/" + (big if kind == 0 else b"x") + b" HTTP/1.1\r\nHost: a\r\n" + line + \
            b"\r\nContent-Length: 0\r\n\r\n"
        got = lean.parse_head(head, 16384)
        assert got is not None and got == lean.parse_head(head, 16384)
        assert got.path == b"/v1/" + (big if kind == 0 else b"x") and got.length == 0
    kept = sum(len(k) + len(repr(v)) for memo in (lean._REQUEST_LINES, lean._HEAD_LINES, lean._NAMES, lean._CLOSES)
               for k, v in memo.items())
    assert kept < 64 * 1024, kept


def test_header_pair_reads_a_line_as_the_header_grammar_does():
    """``lean.header_pair`` (no regular expression for a name seen before) gives what the
    full line grammar ``lean._HEADER`` gives, on random lines of the bytes that matter (names,
    colons, spaces and tabs, controls, DEL, obs-text, CR, LF); a mutant that lets a tab,
    DEL or obs-text through, or strips other bytes, fails it."""
    import random

    from memfuse.server import lean

    alphabet = [b"a", b"Z", b"-", b"_", b":", b" ", b"\t", b"\x7f", b"\x80", b"\xff", b"\x00", b"\r",
                b"\n", b"~", b"!", b'"', b"(", b"9", b"=", b"\x1f", b"x"]
    r = random.Random(20)
    for _ in range(40_000):
        line = b"".join(r.choice(alphabet) for _ in range(r.randint(0, 12)))
        if r.random() < 0.5:
            line = r.choice([b"Content-Length", b"idempotency-key", b"X"]) + line
        m = lean._HEADER.fullmatch(line)
        assert lean.header_pair(line) == (None if m is None else (m.group(1).lower(), m.group(2))), line
