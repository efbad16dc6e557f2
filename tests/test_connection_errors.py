"""One connection's error stays in that connection (``memfuse.server.serve``, attack 11 F4):
the HTTP server's own connection code (hypercorn's ``TCPServer`` as ``memfuse.server.serve``
runs it) on a real loopback socket, with a small ASGI app in place of the control plane.

- The send side of a socket has one owner at a time: hypercorn shut the socket's write side
  (``send_eof``, on the reader's task when the client closes its end with a request body
  unread) without its send lock, so the response's send on the app's task, inside that
  shutdown, raised ``trio.BusyResourceError`` ("another task is currently sending data on
  this SocketStream"). Here the shutdown is made to last 0.3 s (it is one checkpoint in trio),
  so the interleaving is certain, not a one-in-thousands race.
- Whatever escapes a connection's task (here: an app whose exception hypercorn's own
  handler lets through, as its answer to the app's failure fails too) is logged with the
  connection and dropped: the server keeps serving. Before, it reached the server's nursery
  and ``memfuse serve`` exited.
"""
from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
from hypercorn.config import Config

from memfuse.server import serve as serve_mod

pytestmark = pytest.mark.timeout(60)

App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


async def _serving(app: App, nursery: trio.Nursery) -> tuple[int, trio.Event]:
    """Run ``app`` behind ``memfuse.server.serve._worker_serve`` on 127.0.0.1 in ``nursery``;
    returns the port and the event that shuts the server down."""

    async def asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        await app(scope, receive, send)

    config = Config()
    config.bind = [f"fd://{serve_mod.listen_socket('127.0.0.1:0').detach()}"]
    config.graceful_timeout = 1
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    shutdown = trio.Event()
    binds = await nursery.start(serve_mod._worker_serve, asgi, config, None, shutdown.wait)
    return int(binds[0].rsplit(":", 1)[1]), shutdown


async def _ask(port: int, raw: bytes) -> bytes:
    """Send ``raw`` on a new connection and read until the server closes it (10 s bound)."""
    with trio.fail_after(10):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(raw)
            got = b""
            while chunk := await stream.receive_some(65536):
                got += chunk
            return got


async def _still_serves(port: int) -> None:
    answer = await _ask(port, b"GET /ok HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 "), answer


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [f"{r.name}: {r.getMessage()} {r.exc_info[1]!r}" if r.exc_info else f"{r.name}: {r.getMessage()}"
            for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_shutdown_of_the_send_side_never_overlaps_a_response_being_sent(monkeypatch, caplog):
    """The client closes its end with the body unread while the app answers: hypercorn's reader
    shuts the socket's write side while the app sends its answer. One of them waits for the
    other (the answer is sent, or finds the socket closed): no ``BusyResourceError``, no
    "Error in ASGI Framework", and the server serves the next connection."""
    caplog.set_level(logging.INFO)
    in_eof = trio.Event()
    real_send_eof = trio.SocketStream.send_eof
    send_errors: list[BaseException] = []

    async def slow_send_eof(self: trio.SocketStream) -> None:
        # trio's send_eof holds the stream's send-conflict detector over one checkpoint; here
        # over 0.3 s, so that a send started meanwhile by another task surely meets it
        with self._send_conflict_detector:
            in_eof.set()
            await trio.sleep(0.3)
        await real_send_eof(self)

    monkeypatch.setattr(trio.SocketStream, "send_eof", slow_send_eof)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["path"] == "/ok":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        # a refusal of a request whose body is left unread (the gate's 429 / 408 / 413)
        await send({"type": "http.response.start", "status": 429,
                    "headers": [(b"content-length", b"2"), (b"connection", b"close")]})
        with trio.fail_after(5):
            await in_eof.wait()  # the reader is shutting the write side now
        try:
            await send({"type": "http.response.body", "body": b"no"})
        except BaseException as e:
            send_errors.append(e)
            raise

    async with trio.open_nursery() as nursery:
        port, shutdown = await _serving(app, nursery)
        with trio.fail_after(10):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(b"POST /records HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n{")
                await trio.sleep(0.2)  # the app has framed its answer's head
                stream.socket.shutdown(socket.SHUT_WR)  # the client leaves with the body unread
                while await stream.receive_some(65536):
                    pass
        await in_eof.wait()
        await _still_serves(port)
        shutdown.set()
    assert not send_errors, send_errors
    assert not _errors(caplog), _errors(caplog)


async def test_the_readers_own_answer_never_overlaps_a_shutdown_by_the_app(monkeypatch, caplog):
    """The other order, the one that stopped ``memfuse serve`` in attack 11: the client leaves
    before the app answers, so hypercorn's reader answers 400 itself (head, then the end of the
    message: two sends); as the second is about to start, the app's task, finding the response
    already made, ends the connection and shuts the write side. The reader's send met that shutdown
    (``BusyResourceError`` on the reader's task, which hypercorn does not catch: it reached
    the server's nursery). Now the client gets the 400, no connection fails, the server
    serves on."""
    caplog.set_level(logging.INFO)
    answered, ending = trio.Event(), trio.Event()
    real_send_eof = trio.SocketStream.send_eof
    real_send_all = trio.SocketStream.send_all

    async def slow_send_eof(self: trio.SocketStream) -> None:
        with self._send_conflict_detector:
            await trio.sleep(1.0)
        await real_send_eof(self)

    async def send_all(self: trio.SocketStream, data: Any) -> None:
        if not data and answered.is_set():  # the reader's second send (the end: no bytes)
            # hypercorn's send lock is taken and h11 has framed the end; trio's send_all is
            # entered after a checkpoint, where the app's task ends the connection
            ending.set()
            await trio.sleep(0.3)
        await real_send_all(self, data)
        if bytes(data).startswith(b"HTTP/1.1 400 "):  # the reader's answer's head
            answered.set()

    monkeypatch.setattr(trio.SocketStream, "send_eof", slow_send_eof)
    monkeypatch.setattr(trio.SocketStream, "send_all", send_all)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["path"] == "/ok":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        with trio.fail_after(5):
            await ending.wait()
        # a refusal, as the gate's: h11 has answered already, so nothing is sent, and the
        # stream's end closes the connection
        await send({"type": "http.response.start", "status": 429,
                    "headers": [(b"content-length", b"2"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": b"no"})

    async with trio.open_nursery() as nursery:
        port, shutdown = await _serving(app, nursery)
        with trio.fail_after(10):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(b"POST /records HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n{")
                stream.socket.shutdown(socket.SHUT_WR)  # gone before the app answers
                answer = b""
                while chunk := await stream.receive_some(65536):
                    answer += chunk
        assert answer.startswith(b"HTTP/1.1 400 "), answer
        await trio.sleep(1.2)  # the shutdown has ended
        await _still_serves(port)
        shutdown.set()
    assert not _errors(caplog), _errors(caplog)


async def test_an_error_that_escapes_a_connection_is_logged_and_the_server_keeps_serving(monkeypatch, caplog):
    """hypercorn lets an app's exception through when its own answer to it fails (its 500 on a
    connection gone bad): that connection is dropped and logged with its peer; the server and
    its other connections go on."""
    caplog.set_level(logging.INFO)
    from hypercorn.protocol.http_stream import HTTPStream

    real_app_send = HTTPStream.app_send

    async def failing_app_send(self: HTTPStream, message: Any) -> None:
        if message is None and self.scope.get("path") == "/boom":
            raise RuntimeError("the connection's own answer failed")
        await real_app_send(self, message)

    monkeypatch.setattr(HTTPStream, "app_send", failing_app_send)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["path"] == "/boom":
            raise ValueError("the app failed")
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async with trio.open_nursery() as nursery:
        port, shutdown = await _serving(app, nursery)
        await _still_serves(port)
        answer = await _ask(port, b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n")
        assert answer == b"", answer  # the connection is dropped, nothing half-sent
        for _ in range(3):
            await _still_serves(port)
        shutdown.set()
    dropped = [r for r in caplog.records if r.name == "memfuse.server.serve" and "connection" in r.getMessage()]
    assert dropped and dropped[0].levelno == logging.ERROR, [r.getMessage() for r in caplog.records]
    assert "127.0.0.1" in str(getattr(dropped[0], "peer", "")), dropped[0].__dict__

