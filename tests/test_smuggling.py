"""Request smuggling by framing (attack19 F4): a request with both Content-Length and
Transfer-Encoding is refused 400 (problem+json, ``invalid_request``) and its connection closed
before anything after it is read (RFC 9112 §6.3), on the lean front door and on hypercorn's
path alike (same bytes but the Date); a Transfer-Encoding other than ``chunked`` is refused and
closed too. On main h11 framed such a request by its chunks and kept the connection: the bytes
after the last chunk ran as a second request (a record created).

Raw sockets against ``memfuse serve``'s server (hypercorn under trio) on loopback."""
from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import httpx
import pytest
import trio
from planeutil import serve_app, setup_ws
from test_lean import ADMIN, WS

from memfuse.server.app import create_app

pytestmark = pytest.mark.timeout(120)


def _request(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST /v1/stores/default/records HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {WS}\r\n"
            f"Content-Type: application/json\r\n{extra}Content-Length: {len(body)}\r\n\r\n").encode() + body


def _create(path: str) -> bytes:
    return _request(path, json.dumps({"path": path, "content": "x\n"}).encode())


def _smuggle(te: str, n: int, te_first: bool = False) -> bytes:
    """A POST framed both ways: Content-Length covers the whole rest; by its chunks it ends
    at once and a second request (creating ``smuggled/<n>.md``) follows."""
    rest = b"0\r\n\r\n" + _create(f"smuggled/{n}.md")
    te_line = f"Transfer-Encoding: {te}\r\n"
    cl_line = f"Content-Length: {len(rest)}\r\n"
    framing = te_line + cl_line if te_first else cl_line + te_line
    return (f"POST /v1/stores/default/records HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {WS}\r\n"
            f"Content-Type: application/json\r\n{framing}\r\n").encode() + rest


def _exchange(port: int, data: bytes) -> tuple[bytes, bool]:
    """Send ``data`` on a new connection; (all the server sent, whether it closed within 10 s)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        got = b""
        try:
            while True:
                d = s.recv(65536)
                if not d:
                    return got, True
                got += d
        except (TimeoutError, ConnectionResetError):
            return got, False


def test_cl_and_te_are_refused_and_the_connection_closed(tmp_path: Path) -> None:
    cases = [(te, first) for te in ("chunked", "Chunked", " chunked", "chunked\t", "CHUNKED ")
             for first in (False, True)]
    results: dict[str, list[tuple[bytes, bool]]] = {}
    listed: dict[str, list[str]] = {}

    async def one(lean: bool, name: str) -> None:
        app = create_app(f"sqlite:///{tmp_path / name}.db", static_tokens={ADMIN: None, WS: "ws"})
        async with trio.open_nursery() as nursery:
            base = await serve_app(nursery, app, lean=lean)
            await setup_ws(base, ADMIN)
            port = int(base.rsplit(":", 1)[1])
            out = []
            for i, (te, first) in enumerate(cases):
                out.append(await trio.to_thread.run_sync(_exchange, port, _smuggle(te, i, first)))
            # after a lean request on the same connection (the lean door hands the rest over)
            out.append(await trio.to_thread.run_sync(
                _exchange, port, _create("lean-first.md") + _smuggle("chunked", 100)))
            # a Transfer-Encoding h11 does not speak: refused and closed as well
            for j, te in enumerate(("identity, chunked", "gzip, chunked", "chunked, chunked")):
                out.append(await trio.to_thread.run_sync(_exchange, port, _smuggle(te, 200 + j)))
            results[name] = out
            async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {WS}"},
                                         timeout=30) as c:
                r = await c.get("/v1/stores/default/records")
                assert r.status_code == 200, r.text
                listed[name] = sorted(x["path"] for x in r.json()["records"])
            nursery.cancel_scope.cancel()

    trio.run(one, True, "lean")
    trio.run(one, False, "hypercorn")
    for name in ("lean", "hypercorn"):
        assert listed[name] == ["lean-first.md"], (name, listed[name])  # nothing smuggled ran
        out = results[name]
        for got, closed in out[:len(cases)]:
            assert closed, (name, got)
            statuses = re.findall(rb"HTTP/1.1 (\d{3})", got)
            assert statuses == [b"400"], (name, got)
            head, _, body = got.partition(b"\r\n\r\n")
            assert b"content-type: application/problem+json" in head.lower(), got
            assert b"connection: close" in head.lower(), got
            assert json.loads(body)["code"] == "invalid_request", got
        got, closed = out[len(cases)]
        assert closed and re.findall(rb"HTTP/1.1 (\d{3})", got) == [b"201", b"400"], (name, got)
        for got, closed in out[len(cases) + 1:]:
            assert closed and len(re.findall(rb"HTTP/1.1 (\d{3})", got)) == 1, (name, got)
            assert re.match(rb"HTTP/1.1 (400|501)", got), (name, got)

    def undated(got: bytes) -> bytes:
        return re.sub(rb"(?im)^date: [^\r]*\r\n", b"", got)

    assert [undated(g) for g, _ in results["lean"][:len(cases)]] == \
        [undated(g) for g, _ in results["hypercorn"][:len(cases)]]
