"""A record write's answer leaves as its transaction commits (``memfuse.server.base.EARLY_ANSWER``,
the lean exchange's ``send_early``; bench/README.md, "The close path, session 16: serve"): the
client has its answer while the work after the commit (the long-poll wake-ups, the full-text
drain) still runs, and the event loop sends nothing more. The bytes are the ones the lean path
frames after the hop (``test_lean`` compares them with hypercorn's); a write the socket does not
take whole is finished by the exchange's own ``send``, and an answer the app sends after an
early one is dropped (the early one is the answer: its write committed).
"""
from __future__ import annotations

import json
import socket
import threading
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import trio
from planeutil import serve_app, setup_ws

from memfuse.server.app import create_app
from memfuse.server.db import Database
from memfuse.server.lean import _Exchange, parse_head

pytestmark = pytest.mark.timeout(120)

ADMIN = "early-admin-token"
WS = "early-ws-token"


def _create(path: str, *, close: bool = False) -> bytes:
    body = json.dumps({"path": path, "content": "early\n"}).encode()
    return (b"POST /v1/stores/default/records HTTP/1.1\r\nHost: e\r\nAuthorization: Bearer "
            + WS.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
            % (len(body), b"Connection: close\r\n" if close else b"") + body)


def _append(record_id: str, text: str, etag: str) -> bytes:
    body = json.dumps({"append": text}).encode()
    return (b"POST /v1/stores/default/records/%s/append HTTP/1.1\r\nHost: e\r\nAuthorization: Bearer %s\r\n"
            b"Content-Type: application/json\r\nIf-Match: %s\r\nContent-Length: %d\r\n\r\n"
            % (record_id.encode(), WS.encode(), etag.encode(), len(body)) + body)


async def _answer(stream: trio.SocketStream) -> bytes:
    """One whole answer (head and its ``content-length`` body) read from ``stream``."""
    got = b""
    while True:
        head, sep, rest = got.partition(b"\r\n\r\n")
        if sep:
            length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
            if len(rest) >= length:
                return got
        data = await stream.receive_some(65536)
        assert data, got
        got += data


async def test_the_answer_leaves_before_the_follow_up_of_its_commit(tmp_path, monkeypatch):
    """The work after a create's commit (``Database.write_conn``'s full-text drain,
    ``_drain_due``) is held until the client has read its answer: the answer came first, the
    commit's wake-ups had run (this process's head of the store's feed is the new version's,
    as when the answer came after them), and the write is done (a read sees it). Without the
    early answer the client waits for the drain (the test's 5 s bound fails)."""
    app = create_app(f"sqlite:///{tmp_path / 'e.db'}", static_tokens={ADMIN: None, WS: "ws"})
    hold = threading.Event()  # set: the follow-up of each write waits for ``held``
    held = threading.Event()  # set by the test once the client has its answer
    blocked: list[bool] = []
    real = Database._drain_due

    def drain_due(self: Database, conn: Any) -> None:
        if hold.is_set():
            blocked.append(held.wait(30))  # bounded: a failing test does not hang
        real(self, conn)

    monkeypatch.setattr(Database, "_drain_due", drain_due)
    async with trio.open_nursery() as nursery:
        url = await serve_app(nursery, app, lean=True)
        await setup_ws(url, ADMIN)
        notifier = app.state.service.notifier
        heads = dict(notifier._heads)  # noqa: SLF001 - what the wake-ups taught it
        port = int(url.rsplit(":", 1)[1])
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        try:
            hold.set()
            for i in range(3):  # one keep-alive connection, as the sidecar's
                await stream.send_all(_create(f"e{i}.md"))
                with trio.fail_after(5):
                    raw = await _answer(stream)
                assert raw.startswith(b"HTTP/1.1 201 \r\n"), raw
                assert len(blocked) == i, blocked  # this write's follow-up still held
                moved = {k: v for k, v in notifier._heads.items() if heads.get(k) != v}  # noqa: SLF001
                assert len(moved) == 1, (heads, notifier._heads)  # noqa: SLF001 - the new version's seq
                heads.update(moved)
                held.set()  # the answer is here: let the follow-up run
                with trio.fail_after(10):
                    while len(blocked) < i + 1:
                        await trio.sleep(0.01)
                held.clear()
            assert blocked == [True, True, True]
            hold.clear()
            assert app.state.lean.served == 3
            async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {WS}"}) as c:
                r = await c.get("/v1/stores/default/records", params={"path": "e2.md"})
                assert r.status_code == 200 and '"e2.md"' in r.text, r.text
            # a create that closes its connection is answered after the hop, as before
            await stream.send_all(_create("last.md", close=True))
            with trio.fail_after(10):
                raw = await _answer(stream)
            assert raw.startswith(b"HTTP/1.1 201 \r\n") and b"connection: close" in raw.lower(), raw
        finally:
            held.set()
            await stream.aclose()
        nursery.cancel_scope.cancel()


def _exchange(sock: socket.socket, raw: bytes) -> _Exchange:
    lean = SimpleNamespace(response_headers=lambda: [(b"date", b"D"), (b"server", b"hypercorn-h11")],
                           keep_alive_max_requests=1000)
    head = parse_head(raw, 65536)
    assert head is not None
    return _Exchange(lean, head, bytearray(), sock, False, 1)  # type: ignore[arg-type]


_HEADERS = [(b"etag", b'"abc"'), (b"content-length", b"2"), (b"content-type", b"application/json")]
_PLAIN = (b'HTTP/1.1 201 \r\netag: "abc"\r\ncontent-length: 2\r\ncontent-type: application/json\r\n'
          b"date: D\r\nserver: hypercorn-h11\r\n\r\n{}")


async def _app_sends(ex: _Exchange, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    await ex.send({"type": "http.response.start", "status": status, "headers": headers})
    await ex.send({"type": "http.response.body", "body": body})


async def test_an_early_answer_the_socket_did_not_take_is_finished_by_send():
    """The early write finds the socket's buffer full: nothing of it goes out then, and the
    exchange's ``send`` (the app's answer after the hop) sends all of it once the client
    reads; the app's own answer (here another one, as after a failure past the commit) is
    not sent."""
    a, b = socket.socketpair()
    try:
        a.setblocking(False)
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        filler = 0
        while True:  # fill the buffer
            try:
                filler += a.send(b"f" * 4096)
            except BlockingIOError:
                break
        ex = _exchange(a, _create("x.md"))
        await trio.to_thread.run_sync(ex.send_early, 201, _HEADERS, b"{}")
        assert ex.early is not None and ex.early[2] == 0 and ex.early[1] == _PLAIN

        got = bytearray()

        def drain() -> None:
            b.settimeout(10)
            while len(got) < filler + len(_PLAIN):
                data = b.recv(65536)
                assert data
                got.extend(data)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, drain)
            with trio.fail_after(10):
                await _app_sends(ex, 500, [(b"content-length", b"3")], b"bad")
        assert bytes(got[filler:]) == _PLAIN and ex.done and not ex.broken
        await ex.send({"type": "http.response.body", "body": b"more"})  # dropped: the answer is done
    finally:
        a.close()
        b.close()


async def test_early_answers_are_the_plain_ones_and_only_on_a_connection_that_stays_open():
    """``send_early`` sends what ``send`` would (one write, the same bytes); an answer
    that is not plain, or on a connection closing after it, is left to ``send``."""
    for early in (True, False):
        a, b = socket.socketpair()
        try:
            a.setblocking(False)
            ex = _exchange(a, _create("x.md"))
            if early:
                ex.send_early(201, _HEADERS, b"{}")
                assert ex.early == (201, _PLAIN, len(_PLAIN))
                assert b.recv(65536) == _PLAIN
            await _app_sends(ex, 201, _HEADERS, b"{}")
            if not early:
                assert b.recv(65536) == _PLAIN
            a.close()
            assert b.recv(65536) == b""  # nothing else was sent
        finally:
            a.close()
            b.close()
    for raw, status, headers in ((_create("x.md", close=True), 201, _HEADERS),  # closes after it
                                 (_create("x.md"), 204, [])):  # not plain: h11 frames it
        a, b = socket.socketpair()
        try:
            ex = _exchange(a, raw)
            ex.send_early(status, headers, b"")
            assert ex.early is None
        finally:
            a.close()
            b.close()


async def test_early_answers_on_the_database_of_the_api_tests(monkeypatch):
    """The same early answers where ``Database.write_conn`` opens a connection per write
    (in-memory SQLite here; PostgreSQL with ``MEMFUSE_TEST_DB_URL``, ``tests/pgutil.py``): each
    create's and append's answer went out through ``send_early``, and the records are there."""
    from pgutil import fresh_db_url

    sent: list[int] = []
    real = _Exchange.send_early

    def send_early(self: _Exchange, status: int, headers: Any, body: bytes) -> None:
        real(self, status, headers, body)
        if self.early is not None:
            sent.append(status)

    monkeypatch.setattr(_Exchange, "send_early", send_early)
    with fresh_db_url() as db_url:
        app = create_app(db_url, static_tokens={ADMIN: None, WS: "ws"})
        async with trio.open_nursery() as nursery:
            url = await serve_app(nursery, app, lean=True)
            await setup_ws(url, ADMIN)
            stream = await trio.open_tcp_stream("127.0.0.1", int(url.rsplit(":", 1)[1]))
            try:
                for i in range(3):
                    await stream.send_all(_create(f"m{i}.md"))
                    with trio.fail_after(10):
                        raw = await _answer(stream)
                    assert raw.startswith(b"HTTP/1.1 201 \r\n"), raw
                    if i == 0:
                        first = json.loads(raw.partition(b"\r\n\r\n")[2])
                await stream.send_all(_create("m0.md"))  # a refusal: answered after the hop
                with trio.fail_after(10):
                    raw = await _answer(stream)
                assert raw.startswith(b"HTTP/1.1 409 \r\n"), raw
                # appends (``echo >>``) to m0.md: each answer early too, a stale one after the hop
                etag = f'"{first["sha256"]}"'
                for line in ("one", "two", "stale"):
                    await stream.send_all(_append(first["id"], f"{line}\n", etag))
                    with trio.fail_after(10):
                        raw = await _answer(stream)
                    if line == "stale":
                        assert raw.startswith(b"HTTP/1.1 412 \r\n"), raw
                    else:
                        assert raw.startswith(b"HTTP/1.1 200 \r\n"), raw
                        etag = '"' + json.loads(raw.partition(b"\r\n\r\n")[2])["sha256"] + '"'
                    if line == "two":
                        etag = f'"{first["sha256"]}"'  # stale now
            finally:
                await stream.aclose()
            assert sent == [201, 201, 201, 200, 200]
            async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {WS}"}) as c:
                r = await c.get("/v1/stores/default/records", params={"prefix": "m"})
                assert r.status_code == 200 and all(f'"m{i}.md"' in r.text for i in range(3)), r.text
                r = await c.get(f"/v1/stores/default/records/{first['id']}")
                assert r.json()["content"] == "early\none\ntwo\n", r.text
            nursery.cancel_scope.cancel()
