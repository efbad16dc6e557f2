"""HTTP/1.1 keep-alive connections whose requests are record writes, served without
hypercorn's per-request machinery (``memfuse serve``; bench/README.md, "The close path,
session 12: serve's loop").

hypercorn serves each request of a connection through its ``TCPServer`` (a reader task, a
send lock), ``H11Protocol``, an ``HTTPStream``, a task per request with a memory channel for
the body (``spawn_app``) and an event per piece of the answer; for a record write that was
about a third of the event loop's CPU. ``LeanHTTP.serve`` reads a connection's requests with
h11 (the parser hypercorn itself uses, with the same head bound) and, as long as each is one
of the three write routes (``memfuse.server.writepath.lean_route``: create, update, batch;
HTTP/1.1, ``Content-Length`` body, no ``Expect``, ``Upgrade``, ``Transfer-Encoding`` or query
string), calls the ASGI app (the front door, ``memfuse.server.gate``, then the write path or
FastAPI) on the connection's own task, its answer framed by h11 and sent in one write. The
first request that is anything else, or a head h11 refuses, is handed back with every byte of
the connection not consumed (``Handover``): hypercorn serves the rest of the connection from
that request on, as if it had read them itself.

What hypercorn guarantees holds here: the header deadline (``keep_alive_timeout`` from the
previous answer until a head is complete; an idle connection closes at once when the server
terminates), ``keep_alive_max_requests`` (the last answer carries ``Connection: close``; the
count goes on in hypercorn after a hand-over), the response headers it adds (``date``,
``server``), an app error before its answer is a 500 with ``Connection: close``, a response
not finished or a request body left unread closes the connection, and the close shuts the
write side before closing the socket. The front door's bounds (body size and deadlines,
slots, eviction, metrics) are the app's and apply as they do under hypercorn.
"""
from __future__ import annotations

import math
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple
from urllib.parse import unquote

import h11
import trio

MAX_RECV = 65536  # bytes read per receive (hypercorn's ``MAX_RECV``)


class Handover(NamedTuple):
    """A connection for hypercorn from now on: the bytes read and not consumed (they start at
    a request's first byte), whether the client had closed its end after them, and the
    requests answered on it already (for ``keep_alive_max_requests``)."""

    data: bytes
    eof: bool
    requests: int


class LeanHTTP:
    """The lean path of one server. ``app``: the ASGI app (called as hypercorn calls it,
    ``app(scope, receive, send)``); ``lean_route(method, path)``: whether a request is served
    here (decoded path, as ASGI's ``scope["path"]``); ``keep_alive_timeout`` (s) and
    ``keep_alive_max_requests``, ``max_head`` (bytes, h11's ``max_incomplete_event_size``),
    ``response_headers()``: hypercorn's (``Config.response_headers("h11")``),
    ``log_exception(msg)``: hypercorn's error log (``Config.log.exception``),
    ``lifespan_state``: the ASGI lifespan state, copied into each request's scope.
    Event-loop only."""

    def __init__(self, app: Callable[..., Awaitable[None]], lean_route: Callable[[str, str], bool], *,
                 keep_alive_timeout: float, keep_alive_max_requests: int, max_head: int,
                 response_headers: Callable[[], list[tuple[bytes, bytes]]],
                 log_exception: Callable[[str], Awaitable[None]],
                 lifespan_state: dict[str, Any] | None = None) -> None:
        self.app = app
        self.lean_route = lean_route
        self.keep_alive_timeout = keep_alive_timeout
        self.keep_alive_max_requests = keep_alive_max_requests
        self.max_head = max_head
        self.response_headers = response_headers
        self.log_exception = log_exception
        self.lifespan_state = lifespan_state if lifespan_state is not None else {}
        self.served = 0  # requests answered here (tests, the benchmark)
        self.handed_over = 0  # connections handed to hypercorn after a lean request
        # INVARIANT: ``waiting`` holds the cancel scopes of the connections waiting for a
        # request head (idle); ``terminate`` cancels them, and once ``terminated`` no
        # connection waits for another request.
        self.waiting: set[trio.CancelScope] = set()
        self.terminated = False

    def terminate(self) -> None:
        """The server stops: idle connections close now, busy ones after their answer."""
        self.terminated = True
        for scope in self.waiting:
            scope.cancel()

    async def serve(self, sock: socket.socket, first: bytes, eof: bool,
                    client: tuple[str, int] | None, server: tuple[str, int] | None) -> Handover | None:
        """Serve the connection ``sock`` (non-blocking, as trio keeps it; ``first``: the bytes
        read of it so far, a request
        head among them; ``eof``: the client closed its end after them) as long as its
        requests are lean ones. Returns a ``Handover`` for hypercorn, or None when the
        connection is over (the caller closes the socket; the write side is shut here when
        an answer was sent). Never raises for the client's doing (a reset, a vanished
        client, bad bytes); a cancellation (eviction, the end of the grace period) passes."""
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.max_head)
        conn.receive_data(first)
        if eof:
            conn.receive_data(b"")
        # INVARIANT: ``raw`` holds the bytes of the connection from the first byte of the
        # request being read (or awaited) to the last read: what hypercorn gets at a hand-over.
        raw = bytearray(first)
        requests = 0
        closed = eof
        while True:
            # -------- the head, within the header deadline
            request: h11.Request | None = None
            with trio.move_on_after(self.keep_alive_timeout if requests else math.inf) as waiting:
                self.waiting.add(waiting)
                try:
                    while True:
                        try:
                            event = conn.next_event()
                        except h11.RemoteProtocolError:  # hypercorn answers it (400, 431)
                            return self._handover(raw, closed, requests)
                        if isinstance(event, h11.Request):
                            request = event
                            break
                        if event is not h11.NEED_DATA:  # ConnectionClosed (or PAUSED: not expected)
                            if raw:
                                return self._handover(raw, closed, requests)
                            return None
                        if closed:
                            return self._handover(raw, closed, requests) if raw else None
                        if self.terminated:  # as hypercorn's idle timer: closed at once
                            return None
                        try:
                            data = await _receive(sock)
                        except OSError:  # reset
                            return None
                        raw += data
                        conn.receive_data(data)
                        closed = not data
                finally:
                    self.waiting.discard(waiting)
            if request is None:  # the header deadline passed, or the server terminates
                return None
            path, sep, query = request.target.partition(b"?")  # a query string: hypercorn's
            if (request.method not in (b"POST", b"PUT") or request.http_version != b"1.1" or sep
                    or not _plain(request.headers)
                    or not self.lean_route(request.method.decode("ascii"), unquote(path.decode("ascii")))):
                return self._handover(raw, closed, requests)
            requests += 1
            # -------- the request, on this task
            exchange = _Exchange(self, conn, sock, closed, requests)
            scope = {
                "type": "http", "http_version": "1.1", "asgi": {"spec_version": "2.1", "version": "3.0"},
                "method": request.method.decode("ascii"), "scheme": "http",
                "path": unquote(path.decode("ascii")), "raw_path": path, "query_string": query,
                "root_path": "", "headers": list(request.headers), "client": client, "server": server,
                "state": self.lifespan_state.copy(), "extensions": {},
            }
            try:
                await self.app(scope, exchange.receive, exchange.send)
            except Exception:  # as hypercorn's ``_handle``: logged, a 500 when nothing was sent
                await self.log_exception("Error in ASGI Framework")
            if exchange.head is None and not exchange.broken:
                await exchange.error(500)
            self.served += 1
            exchange.finish()
            closed = exchange.closed
            if (exchange.broken or not exchange.done or self.terminated
                    or conn.our_state is not h11.DONE or conn.their_state is not h11.DONE):
                if not exchange.broken:
                    _shut(sock)
                return None
            try:
                conn.start_next_cycle()
            except h11.LocalProtocolError:  # pragma: no cover - both DONE: h11 recycles
                _shut(sock)
                return None
            raw = bytearray(conn.trailing_data[0])
            if raw:  # pipelined: other tasks run before the next request (it may not wait)
                await trio.lowlevel.checkpoint()

    def _handover(self, raw: bytearray, closed: bool, requests: int) -> Handover:
        if requests:
            self.handed_over += 1
        return Handover(bytes(raw), closed, requests)


_REFUSED = frozenset({b"transfer-encoding", b"expect", b"upgrade"})


def _plain(headers: Any) -> bool:
    """Whether a request's headers (h11's, names lower-case) are of a lean request: a
    ``Content-Length`` body, no ``Transfer-Encoding``, ``Expect`` or ``Upgrade``."""
    length = False
    for name, _ in headers:
        if name in _REFUSED:
            return False
        if name == b"content-length":
            length = True
    return length


def _shut(sock: socket.socket) -> None:
    """Shut the write side (the client reads the answer to its end), as hypercorn's close."""
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # the client is gone


# The socket's own calls, not ``trio.SocketStream``'s (a context manager for its errors, a
# conflict detector and two checkpoints per call: ~10 % of a record write's loop CPU). Each
# connection has one task, so one reader and one writer at a time.
async def _receive(sock: socket.socket) -> bytes:
    """The next bytes of ``sock`` (b"" at the client's end), waiting for them (a
    checkpoint: cancellable). Raises ``OSError`` (a reset)."""
    while True:
        try:
            return sock.recv(MAX_RECV)
        except BlockingIOError:
            await trio.lowlevel.wait_readable(sock)


async def _send_all(sock: socket.socket, data: bytes) -> None:
    """Send all of ``data`` on ``sock``, waiting (cancellably) while the send buffer is
    full. Raises ``OSError`` (a reset, a broken pipe)."""
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view):]
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)


class _Exchange:
    """One request and its answer on a lean connection: ``receive`` gives the body as h11
    reads it, ``send`` frames the answer with h11 and sends its head with the first body
    piece (a whole answer of known length: one write)."""

    def __init__(self, lean: LeanHTTP, conn: h11.Connection, sock: socket.socket,
                 closed: bool, requests: int) -> None:
        self.lean = lean
        self.conn = conn
        self.sock = sock
        self.closed = closed  # the client closed its end
        self.requests = requests
        self.body_done = False  # the request's body is all given
        self.head: bytes | None = None  # the answer's head, framed (b"" once sent)
        self.status = 0
        self.done = False  # the answer is complete
        self.broken = False  # the connection failed (reset, a send cut): close it
        self.done_event: trio.Event | None = None

    async def receive(self) -> dict[str, Any]:
        if self.body_done or self.head is not None or self.broken:
            # as under hypercorn: nothing more comes until the request is over
            if not self.done and not self.broken:
                if self.done_event is None:
                    self.done_event = trio.Event()
                await self.done_event.wait()
            return {"type": "http.disconnect"}
        conn = self.conn
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as e:  # the client left mid-body, or sent bad framing
                if self.head is None and conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                    await self.error(e.error_status_hint)  # as hypercorn: 400, then closed
                else:
                    self.broken = True
                return {"type": "http.disconnect"}
            if isinstance(event, h11.Data):
                body = bytes(event.data)
                more = True
                try:
                    if conn.next_event() is not h11.NEED_DATA:  # the end, at once: one message
                        more = False
                except h11.RemoteProtocolError:
                    pass  # reported at the next receive
                self.body_done = not more
                return {"type": "http.request", "body": body, "more_body": more}
            if isinstance(event, h11.EndOfMessage):
                self.body_done = True
                return {"type": "http.request", "body": b"", "more_body": False}
            if self.closed:
                self.broken = True
                return {"type": "http.disconnect"}
            try:
                data = await _receive(self.sock)
            except OSError:
                self.broken = True
                return {"type": "http.disconnect"}
            conn.receive_data(data)
            self.closed = not data

    async def send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if self.done or self.broken:
            return  # the connection is closing (hypercorn drops what the app sends then)
        if kind == "http.response.start":
            if self.head is not None:
                raise RuntimeError("http.response.start sent twice")
            headers = [(bytes(k).strip(), bytes(v).strip()) for k, v in message.get("headers", ())]
            headers += self.lean.response_headers()
            if self.requests >= self.lean.keep_alive_max_requests:
                headers.append((b"connection", b"close"))
            self.status = int(message["status"])
            self.head = self._frame(h11.Response(status_code=self.status, headers=headers))
            return
        if kind != "http.response.body" or self.head is None:
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        body = message.get("body", b"")
        data = self.head
        self.head = b""
        if body and not (100 <= self.status < 200 or self.status in (204, 304)):
            data += self._frame(h11.Data(data=body))
        if not message.get("more_body", False):
            data += self._frame(h11.EndOfMessage())
            self.done = True
        if data:
            await self._write(data)
        if self.done:
            self.finish()

    def finish(self) -> None:
        """The answer is complete (or will never be): a ``receive`` waiting returns."""
        if self.done_event is not None:
            self.done_event.set()

    async def error(self, status: int) -> None:
        """hypercorn's answer when the app sent nothing: ``status``, empty, then close."""
        self.head = self._frame(h11.Response(status_code=status, headers=[
            (b"content-length", b"0"), (b"connection", b"close"), *self.lean.response_headers()]))
        await self.send({"type": "http.response.body", "body": b""})

    def _frame(self, event: Any) -> bytes:
        try:
            return self.conn.send(event) or b""
        except h11.LocalProtocolError:
            if self.conn.their_state is not h11.ERROR:
                raise
            return b""

    async def _write(self, data: bytes) -> None:
        if self.broken:
            return
        try:
            await _send_all(self.sock, data)
        except OSError:
            self.broken = True  # the client is gone: the app is not told, as under hypercorn
            self.finish()
        except BaseException:
            self.broken = True  # cut (the front door's send bound): the stream is unusable
            raise


_DATES: list[Any] = [0, b""]


def date_header() -> bytes:
    """The ``Date`` value (RFC 9110 IMF-fixdate) of now, formatted once a second."""
    now = int(time.time())
    if _DATES[0] != now:
        from wsgiref.handlers import format_date_time
        _DATES[0], _DATES[1] = now, format_date_time(now).encode("ascii")
    value: bytes = _DATES[1]
    return value
