"""HTTP/1.1 keep-alive connections whose requests are record writes, served without
hypercorn's per-request machinery (``memfuse serve``; bench/README.md, "The close path,
session 12: serve's loop").

hypercorn serves each request of a connection through its ``TCPServer`` (a reader task, a
send lock), ``H11Protocol``, an ``HTTPStream``, a task per request with a memory channel for
the body (``spawn_app``) and an event per piece of the answer; for a record write that was
about a third of the event loop's CPU. ``LeanHTTP.serve`` reads a connection's request heads
itself (``parse_head``: a strict subset of the grammar h11, hypercorn's parser, reads, with the
same head bound) and, as long as each is one of the record-write routes
(``memfuse.server.writepath.lean_route``: create, update, append, batch; HTTP/1.1, one ``Host``, a
``Content-Length`` body, no ``Expect``, ``Upgrade``, ``Transfer-Encoding`` or query string),
calls the ASGI app (the front door, ``memfuse.server.gate``, then the write path or FastAPI)
on the connection's own task, its answer framed as h11 frames it (``_plain_answer``; h11
itself frames any answer that is not plain) and sent in one write. The first request that
is anything else, or a head the parser does not take, is handed back with every byte of the
connection not consumed (``Handover``): hypercorn serves the rest of the connection from that
request on, as if it had read them itself, so whatever h11 refuses is refused as before.

What hypercorn guarantees holds here: the header deadline (``keep_alive_timeout`` from the
previous answer until a head is complete; an idle connection closes at once when the server
terminates), ``keep_alive_max_requests`` (the last answer carries ``Connection: close``; the
count goes on in hypercorn after a hand-over), the response headers it adds (``date``,
``server``), an app error before its answer is a 500 with ``Connection: close``, a response
not finished or a request body left unread closes the connection, and the close shuts the
write side before closing the socket. The front door's bounds (body size and deadlines,
slots, eviction, metrics) are the app's and apply as they do under hypercorn; two scope
extensions save it work (``memfuse.server.gate.BODY``: a body the connection's buffer holds
whole is given at once, without a read deadline to arm; ``gate.SEND_WITHIN``: the write
path's answers are sent under this exchange's own send bound, armed only when the socket
would block, instead of the front door's cancel scope).
"""
from __future__ import annotations

import math
import re
import select
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple
from urllib.parse import unquote

import h11
import trio

from memfuse.server.gate import BODY, EARLY, SEND_WITHIN
from memfuse.server.writepath import ROUTE

MAX_RECV = 65536  # bytes read per receive (hypercorn's ``MAX_RECV``)
_ROUTES_MAX = 256  # routes kept at most per server (``LeanHTTP._routes``; emptied when full)


class Handover(NamedTuple):
    """A connection for hypercorn from now on: the bytes read and not consumed (they start at
    a request's first byte), whether the client had closed its end after them, and the
    requests answered on it already (for ``keep_alive_max_requests``)."""

    data: bytes
    eof: bool
    requests: int


class LeanHTTP:
    """The lean path of one server. ``app``: the ASGI app (called as hypercorn calls it,
    ``app(scope, receive, send)``); ``lean_route(method, path)``: a true value when a request
    is served here (decoded path, as ASGI's ``scope["path"]``), given to the app in the scope
    as ``ROUTE`` (``memfuse.server.writepath``: its route match; a function of its arguments
    alone: its answer is kept per target and given to every request for it, read only);
    ``keep_alive_timeout`` (s) and
    ``keep_alive_max_requests``, ``max_head`` (bytes, h11's ``max_incomplete_event_size``),
    ``response_headers()``: hypercorn's (``Config.response_headers("h11")``),
    ``log_exception(msg)``: hypercorn's error log (``Config.log.exception``),
    ``lifespan_state``: the ASGI lifespan state, copied into each request's scope;
    ``on_client_gone()``: called when a connection ends with requests pipelined on it and
    not run, because its client had gone (``client_gone``);
    ``write``: when given, what serves a lean request instead of ``app`` (same signature;
    ``memfuse.server.gate.Gate.write``: the front door's steps for a record write without
    its general request path, everything else handed to the app's front door).
    ``watch`` must run beside ``serve`` (it keeps the header deadlines). Event-loop only."""

    def __init__(self, app: Callable[..., Awaitable[None]], lean_route: Callable[[str, str], Any], *,
                 keep_alive_timeout: float, keep_alive_max_requests: int, max_head: int,
                 response_headers: Callable[[], list[tuple[bytes, bytes]]],
                 log_exception: Callable[[str], Awaitable[None]],
                 lifespan_state: dict[str, Any] | None = None,
                 on_client_gone: Callable[[], None] | None = None,
                 write: Callable[..., Awaitable[None]] | None = None) -> None:
        self.app = app
        self.write = write if write is not None else app
        self.lean_route = lean_route
        self.keep_alive_timeout = keep_alive_timeout
        self.keep_alive_max_requests = keep_alive_max_requests
        self.max_head = max_head
        self.response_headers = response_headers
        self.log_exception = log_exception
        self.lifespan_state = lifespan_state if lifespan_state is not None else {}
        self.on_client_gone = on_client_gone
        # (method, raw target) → (decoded path, ``lean_route``'s answer) of requests seen: a
        # sidecar writes every create to the same target (``lean_route`` must be a function of
        # its arguments alone; its match is shared by the requests, read only)
        self._routes: dict[tuple[str, bytes], tuple[str, Any]] = {}
        self.served = 0  # requests answered here (tests, the benchmark)
        self.handed_over = 0  # connections handed to hypercorn after a lean request
        self.handed_back = 0  # connections given back here by hypercorn (``takes_back``)
        self.cut_gone = 0  # connections ended with requests pipelined unread: their client had gone
        # INVARIANT: ``waiting`` maps the cancel scope of each connection waiting for a
        # request head (idle) to its header deadline (``trio.current_time()`` clock), in the
        # order of those deadlines: each is ``keep_alive_timeout`` after the moment it was
        # put in, so the first one is the earliest; ``untimed`` holds those waiting without
        # a deadline (no request answered yet). ``watch`` cancels a scope once its deadline
        # has passed, ``terminate`` all of them, and once ``terminated`` no connection waits
        # for another request.
        self.waiting: dict[trio.CancelScope, float] = {}
        self.untimed: set[trio.CancelScope] = set()
        self.terminated = False
        self._watcher: trio.lowlevel.Task | None = None  # ``watch``'s task while it is parked
        self._watch_scope = trio.CancelScope()

    def terminate(self) -> None:
        """The server stops: idle connections close now, busy ones after their answer;
        ``watch`` returns."""
        self.terminated = True
        for scope in (*self.waiting, *self.untimed):
            scope.cancel()
        self._watch_scope.cancel()

    async def watch(self) -> None:
        """The header deadlines of this server's connections (run it in the server's
        nursery for as long as ``serve`` may be called; it returns at ``terminate``, or is
        cancelled): a connection still waiting for a request head at its deadline has its
        cancel scope cancelled (``serve`` then closes it). One task sleeping until the
        earliest deadline instead of a deadline per connection moved twice per request: a
        cancel scope's deadline is set and cleared through trio's deadline heap and a
        context manager, ~3 % of the loop's CPU per record write (bench/README.md, "The close
        path, session 15: serve's loop"). A deadline put in while this task sleeps is never
        earlier than the end of its sleep (deadlines are ``keep_alive_timeout`` after they
        are put in; the sleep is at most that long), so nothing has to wake it, except when
        it is parked (no connection waited through a whole sleep): the next wait wakes it."""
        waiting = self.waiting
        with self._watch_scope:
            while True:
                now = trio.current_time()
                while waiting:
                    scope, deadline = next(iter(waiting.items()))
                    if deadline > now:
                        break
                    del waiting[scope]  # ``serve`` discards it again: no harm
                    scope.cancel()
                if waiting:
                    await trio.sleep_until(next(iter(waiting.values())))
                    continue
                await trio.sleep_until(now + self.keep_alive_timeout)
                if not waiting:  # idle: parked until a connection waits (``_wait_from``)
                    self._watcher = trio.lowlevel.current_task()
                    await trio.lowlevel.wait_task_rescheduled(self._unpark)

    @property
    def parked(self) -> bool:
        """Whether ``watch`` is parked (no connection has waited for a head since its last
        sleep; tests)."""
        return self._watcher is not None

    def _unpark(self, _: Any) -> trio.lowlevel.Abort:
        """``watch`` is cancelled while parked: no connection reschedules it after this."""
        self._watcher = None
        return trio.lowlevel.Abort.SUCCEEDED

    def _wait_from(self, scope: trio.CancelScope, requests: int, clock: trio.abc.Clock) -> None:
        """``scope``'s connection waits for a request head from now (``watch``); ``clock``:
        the run's (``trio.current_time()``'s, without its two wrappers per request)."""
        if not requests:  # hypercorn's idle timer runs from the previous answer: none yet
            self.untimed.add(scope)
            return
        self.waiting[scope] = clock.current_time() + self.keep_alive_timeout
        watcher = self._watcher
        if watcher is not None:  # parked: woken once (``_unpark`` clears it when cancelled)
            self._watcher = None
            trio.lowlevel.reschedule(watcher)

    def _route(self, head: _Head) -> tuple[str, Any]:
        """(decoded path, ``lean_route``'s answer) of ``head``'s request, memoized per
        (method, raw target) (``_routes``)."""
        key = (head.method, head.path)
        seen = self._routes.get(key)
        if seen is None:
            path = unquote(head.path.decode("ascii"))
            seen = (path, self.lean_route(head.method, path))
            if len(head.path) <= _KEPT_LINE_MAX:
                if len(self._routes) >= _ROUTES_MAX:
                    self._routes.clear()
                self._routes[key] = seen
        return seen

    def takes_back(self, data: bytes | bytearray) -> bool:
        """Whether a connection hypercorn serves comes back here (counted in
        ``handed_back``): ``data``, what its client sent once hypercorn's last answer was
        over and nothing else of it was left unread, starts with a whole request head that
        ``serve`` serves (``parse_head``, ``lean_route``). Without this, one read on a
        connection (a sidecar's page, its status) made hypercorn serve every later record
        write on it, until it closed (``keep_alive_max_requests``, 1,000 requests by
        default): ~0.6 ms more of the event loop's CPU per write (bench/README.md, "The close
        path, session 22"). Cheap when it is not (one ``startswith`` for a request other than
        ``POST`` / ``PUT``)."""
        if not data.startswith((b"POST ", b"PUT ")):
            return False
        head = parse_head(data, self.max_head)
        if head is None or not self._route(head)[1]:
            return False
        self.handed_back += 1
        return True

    async def serve(self, sock: socket.socket, first: bytes, eof: bool,
                    client: tuple[str, int] | None, server: tuple[str, int] | None,
                    requests: int = 0) -> Handover | None:
        """Serve the connection ``sock`` (non-blocking, as trio keeps it; ``first``: the bytes
        read of it so far, a request head among them; ``eof``: the client closed its end after
        them) as long as its requests are lean ones (``parse_head``). ``requests``: those
        answered on it before (by hypercorn, when it gives the connection back:
        ``takes_back``), counted toward ``keep_alive_max_requests``. Returns a ``Handover``
        for hypercorn, or None when the connection is over (the caller closes the socket; the
        write side is shut here when an answer was sent). Never raises for the client's
        doing (a reset, a vanished client, bad bytes); a cancellation (eviction, the end of
        the grace period) passes."""
        # INVARIANT: ``buf`` holds the bytes read and not consumed: from the first byte of
        # the request being read (or awaited) on, what hypercorn gets at a hand-over.
        buf = bytearray(first)
        closed = eof
        clock = trio.lowlevel.current_clock()
        while True:
            # One cancel scope per connection is the header deadline of the requests that
            # follow, in ``self.waiting`` (``watch`` cancels it past the deadline) only while a
            # head is awaited: a scope entered per request was ~5 % of the loop's CPU per
            # record write. A head that came in as the scope was cancelled (the deadline
            # passed, the server terminates) is read again under a fresh one, as a scope of
            # its own would have let it through.
            answered = False  # an answer was sent since the last read: the next read waits first
            with trio.CancelScope() as waiting:
                while True:
                    # -------- the head, within the header deadline
                    # an empty buffer (the usual case after an answer) has no head to look for
                    head = parse_head(buf, self.max_head) if buf else None
                    if head is None:
                        self._wait_from(waiting, requests, clock)
                        try:
                            while head is None:
                                if buf and (len(buf) > self.max_head or HEAD_END.search(buf) is not None) or closed:
                                    # not a lean head (or a partial one and the client left): hypercorn's
                                    return self._handover(buf, closed, requests) if buf else None
                                if self.terminated:  # as hypercorn's idle timer: closed at once
                                    return None
                                try:
                                    data = await _receive(sock, answered)
                                except OSError:  # reset
                                    return None
                                answered = False
                                buf += data
                                closed = not data
                                head = parse_head(buf, self.max_head)
                        finally:
                            self.waiting.pop(waiting, None)
                            self.untimed.discard(waiting)
                        if waiting.cancel_called:
                            break  # read again under a fresh scope (above)
                    path, route = self._route(head)
                    if not route:
                        return self._handover(buf, closed, requests)
                    requests += 1
                    del buf[:head.size]
                    # -------- the request, on this task
                    exchange = _Exchange(self, head, buf, sock, closed, requests)
                    scope = {
                        "type": "http", "http_version": "1.1", "asgi": {"spec_version": "2.1", "version": "3.0"},
                        "method": head.method, "scheme": "http", "path": path, "raw_path": head.path,
                        "query_string": b"", "root_path": "", "headers": head.headers, "client": client,
                        "server": server, "state": self.lifespan_state.copy(), ROUTE: route,
                        "extensions": {BODY: exchange.take_body, SEND_WITHIN: exchange.send_within,
                                       EARLY: exchange.send_early},
                    }
                    try:
                        await self.write(scope, exchange.receive, exchange.send)
                    except Exception:  # as hypercorn's ``_handle``: logged, a 500 when nothing was sent
                        await self.log_exception("Error in ASGI Framework")
                    if exchange.head is None and not exchange.broken:
                        await exchange.error(500)
                    self.served += 1
                    exchange.finish()
                    closed = exchange.closed
                    if (exchange.broken or not exchange.done or exchange.close or self.terminated
                            or exchange.remaining):
                        if not exchange.broken:
                            _shut(sock)
                        elif buf:  # an answer that could not be sent, requests pipelined behind it
                            self._gone()
                        return None
                    if buf:  # pipelined: other tasks run before the next request (it may not wait)
                        if client_gone(sock):  # its client left: nothing it pipelined runs
                            self._gone()
                            return None
                        await trio.lowlevel.checkpoint()
                    answered = True
            if waiting.cancelled_caught:  # the header deadline passed, or the server terminates
                return None

    def _gone(self) -> None:
        """Count a connection ended with requests pipelined on it not run: its client had gone."""
        self.cut_gone += 1
        if self.on_client_gone is not None:
            self.on_client_gone()

    def _handover(self, raw: bytearray, closed: bool, requests: int) -> Handover:
        if requests:
            self.handed_over += 1
        return Handover(bytes(raw), closed, requests)


# ---------------------------------------------------------------- the request head
# A strict subset of what h11 reads (h11/_abnf.py, _readers.py, _events.py): every head this
# accepts, h11 reads the same way (method, target, lower-case names, values without their
# surrounding whitespace, keep-alive); anything else (another method, a query string, another
# version, bare LF line ends, folded lines, obs-text, a missing or second Host, no or several
# Content-Length, Transfer-Encoding, Expect, Upgrade) is handed to hypercorn as it came.
HEAD_END = re.compile(rb"\n\r?\n")  # the blank line ending a request's head, as h11 finds it
_REQUEST_LINE = re.compile(rb"(POST|PUT) (/[A-Za-z0-9\-._~%!$&'()*+,;=:@/]*) HTTP/1\.1")
_HEADER = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):[ \t]*((?:[\x21-\x7e](?:[\x20-\x7e\t]*[\x21-\x7e])?)?)[ \t]*")
_NOT_LEAN = frozenset({b"transfer-encoding", b"expect", b"upgrade"})
_MAX_LENGTH_DIGITS = 18  # a longer Content-Length (past 2**59): hypercorn's
#: header lines read before, each with its (lower-case name, value) as ``_HEADER`` reads it
#: (a lean line, not of a ``_NOT_LEAN`` name): the lines a client repeats in every request
#: (host, user-agent, accept, the token, the content type) are matched once, not per request;
#: not the lines of ``_PER_REQUEST`` names, which differ in each
_HEAD_LINES: dict[bytes, tuple[bytes, bytes]] = {}
_HEAD_LINES_MAX = 256  # lines kept at most (emptied when full)
#: the longest line (request line, header line, name, value) those memos keep: the lines a
#: client repeats are short (a token's is ~80 bytes), and any client, before it is
#: authenticated, chooses the lines (up to ``max_head``, 16 KiB: 256 of them in each memo
#: would be tens of MiB, attack21); a longer one is read each time
_KEPT_LINE_MAX = 512
_PER_REQUEST = frozenset({b"content-length", b"idempotency-key", b"if-match"})
#: ``Connection`` values read before, each with whether it asks to close (``keep-alive`` in
#: every request of a client that says so): bounded as ``_HEAD_LINES``
_CLOSES: dict[bytes, bool] = {}
#: ``_HEADER``'s two halves for ``header_pair``: a field name, and the bytes a value may hold
#: (its first and last one not a space or tab: those are stripped around it)
_NAME = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VALUE_BYTES = bytes(range(0x20, 0x7F)) + b"\t"
#: field names read before, each with its lower-case form (bounded as ``_HEAD_LINES``)
_NAMES: dict[bytes, bytes] = {}
#: request lines read before, each with its (method, raw target) as ``_REQUEST_LINE`` reads
#: them: a sidecar sends every create to the same target; bounded as ``_HEAD_LINES``
_REQUEST_LINES: dict[bytes, tuple[str, bytes]] = {}


class _Head(NamedTuple):
    method: str
    path: bytes  # the raw target (no query string)
    headers: list[tuple[bytes, bytes]]  # (lower-case name, value), as h11 gives them
    length: int  # Content-Length
    close: bool  # the client asked to close after the answer (``Connection: close``)
    size: int  # bytes of the head, blank line included


def parse_head(buf: bytearray | bytes, max_head: int) -> _Head | None:
    """The lean request head at the start of ``buf`` (see the comment above), or None: not
    complete yet, or not lean (the caller tells them apart: a complete head or more than
    ``max_head`` bytes is not lean). A head's size is bounded by ``max_head`` as h11's
    ``max_incomplete_event_size`` bounds it when it arrives in pieces."""
    m = HEAD_END.search(buf, 0, max_head + 4)
    if m is None or m.group() != b"\n\r\n" or m.start() == 0 or buf[m.start() - 1] != 13:
        return None
    end = m.start() - 1
    lines = bytes(buf[:end]).split(b"\r\n")
    target = _REQUEST_LINES.get(lines[0])
    if target is None:
        line = _REQUEST_LINE.fullmatch(lines[0])
        if line is None:
            return None
        target = (line.group(1).decode("ascii"), line.group(2))
        if len(lines[0]) <= _KEPT_LINE_MAX:
            if len(_REQUEST_LINES) >= _HEAD_LINES_MAX:
                _REQUEST_LINES.clear()
            _REQUEST_LINES[lines[0]] = target
    headers: list[tuple[bytes, bytes]] = []
    hosts = 0
    length: int | None = None
    close = False
    known = _HEAD_LINES
    for raw in lines[1:]:
        pair = known.get(raw)
        if pair is None:
            pair = header_pair(raw)
            if pair is None:
                return None
            if pair[0] in _NOT_LEAN:
                return None
            if pair[0] not in _PER_REQUEST and len(raw) <= _KEPT_LINE_MAX:
                if len(known) >= _HEAD_LINES_MAX:
                    known.clear()
                known[raw] = pair
        name, value = pair
        if name == b"host":
            hosts += 1
        elif name == b"content-length":
            if length is not None or not value.isdigit() or len(value) > _MAX_LENGTH_DIGITS:
                return None
            length = int(value)
        elif name == b"connection":
            closes = _CLOSES.get(value)
            if closes is None:
                closes = any(t.strip().lower() == b"close" for t in value.split(b","))
                if len(value) <= _KEPT_LINE_MAX:
                    if len(_CLOSES) >= _HEAD_LINES_MAX:
                        _CLOSES.clear()
                    _CLOSES[value] = closes
            close = close or closes
        headers.append(pair)
    if hosts != 1 or length is None:
        return None
    return _Head(target[0], target[1], headers, length, close, m.end())


def header_pair(raw: bytes) -> tuple[bytes, bytes] | None:
    """The (lower-case name, value) of the header line ``raw`` as ``_HEADER.fullmatch`` reads
    it, or None where it does not match: the name before the first colon (a field name:
    checked once per distinct name, ``_NAMES``), the value after it without the spaces and
    tabs around it, every byte of it printable ASCII, a space or a tab. For the lines whose
    value differs in each request (``Content-Length``, ``Idempotency-Key``): the regular
    expression cost ~3 k instructions a line (bench/README.md, "The close path, session
    20: serve's loop"; tests/test_lean.py compares both on random lines)."""
    name, colon, rest = raw.partition(b":")
    if not colon:
        return None
    low = _NAMES.get(name)
    if low is None:
        if _NAME.fullmatch(name) is None:
            return None
        low = name.lower()
        if len(name) <= _KEPT_LINE_MAX:
            if len(_NAMES) >= _HEAD_LINES_MAX:
                _NAMES.clear()
            _NAMES[name] = low
    value = rest.strip(b" \t")
    if value.translate(None, _VALUE_BYTES):  # a byte left that a value may not hold
        return None
    return low, value


def client_gone(sock: socket.socket) -> bool:
    """Whether the client of the connection ``sock`` is gone, so no answer sent on it can
    reach it: the connection was reset (a client that closes its socket with answers unread
    resets it) or is shut both ways (``POLLHUP``), an error is pending on it (``POLLERR``),
    or the socket is closed here. One ``poll(2)`` that does not wait (~2 us). A client that
    only shut its write side (a half-close, ``POLLRDHUP``: ``nc`` at the end of its input)
    is not gone: it may still read the answers to what it sent, and is answered them. The
    servers ask it before a request pipelined on a connection runs (attack17 F4: a client
    that pipelined 1,000 reads and left had each one run, its answer sent to nobody)."""
    fd = sock.fileno()
    if fd < 0:
        return True
    poll = select.poll()
    poll.register(fd, 0)  # POLLHUP, POLLERR and POLLNVAL are reported whatever is asked
    return bool(poll.poll(0))


def _shut(sock: socket.socket) -> None:
    """Shut the write side (the client reads the answer to its end), as hypercorn's close."""
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # the client is gone


# The socket's own calls, not ``trio.SocketStream``'s (a context manager for its errors, a
# conflict detector and two checkpoints per call: ~10 % of a record write's loop CPU). Each
# connection has one task, so one reader and one writer at a time.
async def _receive(sock: socket.socket, wait_first: bool = False) -> bytes:
    """The next bytes of ``sock`` (b"" at the client's end), waiting for them (a
    checkpoint: cancellable). ``wait_first``: wait until the socket is readable before the
    first read (just after an answer, when a client that waits for its answer cannot have
    sent more yet: a read that fails with ``EAGAIN`` saved, a system call and an exception;
    bytes already there only cost a loop pass). Raises ``OSError`` (a reset)."""
    if wait_first:
        await trio.lowlevel.wait_readable(sock)
    while True:
        try:
            return sock.recv(MAX_RECV)
        except BlockingIOError:
            await trio.lowlevel.wait_readable(sock)


async def _send_all(sock: socket.socket, data: bytes, timeout: float = math.inf) -> None:
    """Send all of ``data`` on ``sock``, waiting (cancellably) while the send buffer is
    full, at most ``timeout`` s from the first wait. Raises ``TimeoutError`` (the time ran
    out: part of ``data`` may be sent), ``OSError`` (a reset, a broken pipe)."""
    view = memoryview(data)
    deadline = math.inf
    while view:
        try:
            view = view[sock.send(view):]
        except BlockingIOError:
            if deadline == math.inf:
                deadline = trio.current_time() + timeout
            with trio.move_on_at(deadline) as waiting:
                await trio.lowlevel.wait_writable(sock)
            if waiting.cancelled_caught:
                raise TimeoutError from None


class _Exchange:
    """One request and its answer on a lean connection: ``receive`` gives the body from the
    connection's buffer ``buf`` (shared: what follows the body stays there for the next
    request), ``send`` frames the answer as h11 would and sends its head with the first
    body piece (a whole answer of known length: one write). An answer that is not plain
    (no or a wrong ``Content-Length``, a ``Connection`` header, several pieces, 204/304, a
    header h11 refuses) is framed by h11 itself, given the request's method and keep-alive."""

    __slots__ = ("lean", "request", "buf", "sock", "closed", "requests", "remaining", "body_done", "close",
                 "head", "h11", "status", "done", "broken", "done_event", "send_timeout", "early")

    def __init__(self, lean: LeanHTTP, request: _Head, buf: bytearray, sock: socket.socket,
                 closed: bool, requests: int) -> None:
        self.lean = lean
        self.request = request
        self.buf = buf
        self.sock = sock
        self.closed = closed  # the client closed its end
        self.requests = requests
        self.remaining = request.length  # body bytes not given to the app yet
        self.body_done = False  # the request's body is all given
        self.close = request.close  # the connection closes after the answer
        # the answer: (status, headers) held until its first body piece, then b"" (sent)
        self.head: tuple[int, list[tuple[bytes, bytes]]] | bytes | None = None
        self.h11: h11.Connection | None = None  # framing an answer that is not plain
        self.status = 0
        self.done = False  # the answer is complete
        self.broken = False  # the connection failed (reset, a send cut): close it
        self.done_event: trio.Event | None = None
        self.send_timeout = math.inf  # s a send may take (``send_within``)
        # the answer framed and sent by ``send_early`` (status, its bytes, how many of them
        # went out), else None. INVARIANT: once set, it is the answer: ``send`` sends the rest
        # of its bytes and nothing else
        self.early: tuple[int, bytes, int] | None = None

    async def receive(self) -> dict[str, Any]:
        if self.body_done or self.head is not None or self.broken:
            # as under hypercorn: nothing more comes until the request is over
            if not self.done and not self.broken:
                if self.done_event is None:
                    self.done_event = trio.Event()
                await self.done_event.wait()
            return {"type": "http.disconnect"}
        buf = self.buf
        while True:
            if buf or not self.remaining:
                n = min(len(buf), self.remaining)
                body = bytes(buf[:n])
                del buf[:n]
                self.remaining -= n
                self.body_done = not self.remaining
                return {"type": "http.request", "body": body, "more_body": not self.body_done}
            if self.closed:  # the client left mid-body: h11's error, hypercorn's 400
                await self.error(400)
                return {"type": "http.disconnect"}
            try:
                data = await _receive(self.sock)
            except OSError:
                self.broken = True
                return {"type": "http.disconnect"}
            buf += data
            self.closed = not data

    def take_body(self) -> bytes | None:
        """The whole request body when the connection's buffer, topped up with what the
        kernel holds already (no waiting), holds all of it and none of it was given yet (it
        is then given: ``receive`` gives no more of it), else None (the front door's
        extension ``memfuse.server.gate.BODY``)."""
        n = self.remaining
        if self.body_done or self.head is not None or self.broken or n != self.request.length:
            return None
        while len(self.buf) < n:  # what the kernel holds already, without waiting
            if self.closed:
                return None
            try:
                data = self.sock.recv(MAX_RECV)
            except BlockingIOError:
                return None
            except OSError:  # a reset: ``receive`` answers it
                self.broken = True
                return None
            self.buf += data
            self.closed = not data
        body = bytes(self.buf[:n])
        del self.buf[:n]
        self.remaining = 0
        self.body_done = True
        return body

    async def send_within(self, message: dict[str, Any], seconds: float) -> None:
        """``send(message)``, its write bounded by ``seconds``: raises ``TimeoutError`` past
        it, the connection then broken (closed without a word more), as the front door's own
        bound cuts it (``memfuse.server.gate.SEND_WITHIN``)."""
        self.send_timeout = seconds
        try:
            await self.send(message)
        finally:
            self.send_timeout = math.inf

    def send_early(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """The whole answer (``status``, ASGI ``headers``, ``body``), framed as ``send`` frames
        it, sent now with one non-blocking write, from any thread, while this request's task
        waits for that thread (the gate's extension ``EARLY``: the write path's answer leaves
        as its transaction commits, before the event loop is woken; bench/README.md, "The
        close path, session 16: serve"). Only an answer that is plain (``_plain_answer``) on a
        connection that stays open, before anything was sent; otherwise nothing happens and
        the app's ``send`` frames it as ever. What the write did not take (the socket's buffer
        full, an error) is sent by ``send``, which sends nothing else: the app's own answer,
        sent after this, must be this one. Never raises."""
        if (self.head is not None or self.early is not None or self.done or self.broken or self.close
                or self.requests >= self.lean.keep_alive_max_requests):
            return
        framed = [(bytes(k).strip(), bytes(v).strip()) for k, v in headers]
        framed += self.lean.response_headers()
        data = _plain_answer(status, framed, body, False)
        if data is None:
            return
        try:
            sent = self.sock.send(data)
        except OSError:  # the buffer full, or the client gone: ``send`` finds out
            sent = 0
        self.early = (status, data, sent)

    async def send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if self.done or self.broken:
            return  # the connection is closing (hypercorn drops what the app sends then)
        if kind == "http.response.start":
            if self.head is not None:
                raise RuntimeError("http.response.start sent twice")
            if self.early is not None:  # sent (``send_early``): its head is out
                self.status = self.early[0]
                self.head = (self.status, [])
                return
            headers = [(bytes(k).strip(), bytes(v).strip()) for k, v in message.get("headers", ())]
            headers += self.lean.response_headers()
            if self.requests >= self.lean.keep_alive_max_requests:
                headers.append((b"connection", b"close"))
            self.status = int(message["status"])
            self.head = (self.status, headers)
            return
        if kind != "http.response.body" or self.head is None:
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        body = message.get("body", b"")
        more = message.get("more_body", False)
        early = self.early
        if early is not None:  # the whole answer: what of it did not go out yet
            self.head = b""
            self.done = True
            if early[2] < len(early[1]):
                await self._write(early[1][early[2]:])
            self.finish()
            return
        head, self.head = self.head, b""
        data: bytes | None = None
        if isinstance(head, tuple):
            data = None if more else _plain_answer(head[0], head[1], body, self.close)
            if data is None:  # not plain: h11 frames it
                self.h11 = _framer(self.request)
                data = self._frame(h11.Response(status_code=head[0], headers=head[1]))
        if self.h11 is not None:
            if body and not (100 <= self.status < 200 or self.status in (204, 304)):  # hypercorn's suppress_body
                data = (data or b"") + self._frame(h11.Data(data=body))
            if not more:
                data = (data or b"") + self._frame(h11.EndOfMessage())
                if self.h11.our_state is not h11.DONE:  # h11 closes: Connection: close
                    self.close = True
        if not more:
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
        """hypercorn's answer when the app sent nothing (or the request broke): ``status``,
        empty, then close."""
        self.status = status
        self.head = (status, [(b"content-length", b"0"), (b"connection", b"close"),
                              *self.lean.response_headers()])
        self.close = True
        await self.send({"type": "http.response.body", "body": b""})

    def _frame(self, event: Any) -> bytes:
        assert self.h11 is not None
        return self.h11.send(event) or b""

    async def _write(self, data: bytes) -> None:
        if self.broken:
            return
        try:
            await _send_all(self.sock, data, self.send_timeout)
        except TimeoutError:
            self.broken = True  # cut: the socket is unusable; the front door logs it
            self.finish()
            raise
        except OSError:
            self.broken = True  # the client is gone: the app is not told, as under hypercorn
            self.finish()
        except BaseException:
            self.broken = True  # cut (the front door's send bound): the socket is unusable
            raise


# h11's grammar of a header it sends (h11/_abnf.py: field-name, field-value)
_FIELD_NAME = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_FIELD_VALUE = re.compile(rb"(?:[\x21-\x7e\x80-\xff](?:[ \t\x21-\x7e\x80-\xff]*[\x21-\x7e\x80-\xff])?)?")


#: the framed line (``name: value\r\n``) of each header pair of these names that passed
#: ``_plain_answer``'s checks: the headers every answer repeats (``date`` changes once a
#: second, ``server`` and ``content-type`` never) are checked once, not per answer
_REPEATING = frozenset({b"content-type", b"date", b"server"})
_LINES: dict[tuple[bytes, bytes], bytes] = {}
_LINES_MAX = 64  # pairs kept at most (emptied when full: a new date each second)


def _plain_answer(status: int, headers: list[tuple[bytes, bytes]], body: bytes, close: bool) -> bytes | None:
    """The bytes h11 sends for a whole answer (``Response``, ``Data``, ``EndOfMessage``) to a
    POST or PUT, when it is plain: status 200-599 but 204 and 304, one ``Content-Length``
    equal to the body's length, no ``Transfer-Encoding``, ``Connection`` or ``Host``, every
    header as h11's grammar has it. Else None (h11 frames it: ``_framer``). ``close``: the
    client asked to close (h11 then adds ``Connection: close`` last). A pair of a
    ``_REPEATING`` name that passed once is not checked again (``_LINES``)."""
    if not 200 <= status < 600 or status in (204, 304):
        return None
    length = 0
    out = [b"HTTP/1.1 %d \r\n" % status]
    lines = _LINES
    for pair in headers:
        line = lines.get(pair)
        if line is None:
            name, value = pair
            low = name.lower()
            if low == b"content-length":
                if length or value != b"%d" % len(body):
                    return None
                length = 1
            elif low in (b"transfer-encoding", b"connection", b"host"):
                return None
            if _FIELD_NAME.fullmatch(name) is None or _FIELD_VALUE.fullmatch(value) is None:
                return None
            line = b"%s: %s\r\n" % (name, value)
            if low in _REPEATING:
                if len(lines) >= _LINES_MAX:
                    lines.clear()
                lines[(name, value)] = line
        out.append(line)
    if not length:
        return None
    if close:
        out.append(b"Connection: close\r\n")
    out.append(b"\r\n")
    out.append(body)
    return b"".join(out)


def _framer(request: _Head) -> h11.Connection:
    """An h11 connection that has read a request like ``request`` (method, keep-alive): it
    frames an answer exactly as hypercorn's h11 would for it."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"%s / HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n%s\r\n" % (
        request.method.encode("ascii"), b"connection: close\r\n" if request.close else b""))
    conn.next_event()  # the Request
    conn.next_event()  # its EndOfMessage
    return conn


#: (second, its ``Date`` value), replaced whole: read and written from the event loop and
#: from a write's thread (``_Exchange.send_early``), never a second paired with another's value
_DATE: tuple[int, bytes] = (0, b"")


def date_header() -> bytes:
    """The ``Date`` value (RFC 9110 IMF-fixdate) of now, formatted once a second. Thread-safe."""
    global _DATE
    now = int(time.time())
    kept = _DATE
    if kept[0] != now:
        from wsgiref.handlers import format_date_time
        kept = _DATE = (now, format_date_time(now).encode("ascii"))
    return kept[1]
