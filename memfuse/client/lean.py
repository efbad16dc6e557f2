"""A lean HTTP/1.1 path for the sidecar's ordinary requests: pooled keep-alive connections
(TCP: the non-blocking socket with trio's waits, ``_Conn``; TLS through ``trio.SSLStream``
with the client's ``ssl.SSLContext``), framed with h11's rules (the protocol library httpx's
own transport, httpcore, uses): the request written as h11 writes it, with h11's own
expressions checking the request line and every header; an answer in the control plane's
plain form (``_simple_head``: header lines of h11's grammar) read directly, any other
handed with every byte read to an h11 connection, which reads it or refuses it as it always
did (``LeanHTTP._receive``). h11's state machine cost ~0.2 ms of the sidecar's CPU
per commit request on the benchmark machine (bench/README.md, "The close path, session 11").

Why: the outbox sends one small request per ``close(2)`` when one file is written at a time
(create, update, append, batch). Through ``httpx.AsyncClient`` such a request cost ~2 ms of
client CPU on the benchmark machine (URL and header models, the connection pool's locks and
events, the response model, several trio hops); the same request framed by h11 directly cost
~0.4 ms (bench/README.md, "The close path"). What the caller sees does not change:
``LeanHTTP.send`` returns an ``httpx.Response`` (status, headers, body read in full;
``exchange`` the same as an ``Answer``, without building the response) and
raises the ``httpx`` exception httpx would raise for the same failure (``ConnectError``,
``ConnectTimeout``, ``ReadTimeout``, ``WriteTimeout``, ``ReadError``, ``WriteError``,
``RemoteProtocolError``, ``LocalProtocolError``), so ``ApiSession`` classifies answers and
failures exactly as for httpx (``base._transport_error``, ``base._http_error``).

Scope (``ApiSession._request`` decides): ordinary requests only (no stream, no long poll, no
query parameters), with no custom ``transport`` and no proxy configured in the environment
(httpx honours ``HTTP(S)_PROXY`` / ``ALL_PROXY``; this path does not, so it stays off then).
Everything else goes through httpx.

Connections: at most ``MAX_IDLE`` idle connections are kept; one is reused only while its
socket shows nothing to read (a server that closed an idle keep-alive connection makes it
readable: it is dropped, as httpcore does). A request is never sent twice here: a failure
after the request may have left is raised (the caller's idempotency key covers a retry).
"""
from __future__ import annotations

import os
import select
import socket
import ssl
from urllib.parse import urlsplit

import h11
import httpx
import trio
from h11._events import method_re as _METHOD_RE, request_target_re as _TARGET_RE
from h11._headers import Headers as _H11Headers, _field_value_re as _VALUE_RE
from h11._headers import normalize_and_validate as _h11_headers
from h11._readers import status_line_re as _STATUS_RE

from .. import timers
from . import deadline

#: idle keep-alive connections kept for reuse
MAX_IDLE = 8
#: bytes read per ``receive_some``
READ_SIZE = 65536
EARLY_ANSWER_WAIT = 2.0  # s: the most a broken send waits for the answer sent before it broke
_PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy")
#: request headers whose value changes from one request to the next: validated by h11 on
#: every request; the others (``Host``, the client's defaults, the token, the content type)
#: once per distinct set (``LeanHTTP._validated``)
_PER_REQUEST = frozenset({"idempotency-key", "if-match", "content-length"})
#: distinct sets of the other headers kept validated (a new token makes a new set)
_VALIDATED_MAX = 16
#: the longest answer head read without h11 (h11's own limit on an incomplete event)
_HEAD_MAX = 16 * 1024
#: statuses whose answers have no body whatever their headers say (and 1xx): left to h11
_NO_BODY = frozenset({204, 304})


def proxy_configured() -> bool:
    """Whether the environment names a proxy httpx would use (``HTTP_PROXY``,
    ``HTTPS_PROXY``, ``ALL_PROXY``, either case): the lean path is then not used."""
    return any(os.environ.get(v) or os.environ.get(v.upper()) for v in _PROXY_VARS)


class _Conn:
    """One HTTP/1.1 connection, idle between two exchanges: every answer read on it so far
    was whole, with nothing after it, and allowed keep-alive. A plain (``http``) connection
    is its non-blocking socket, read and written here with trio's waits
    (``trio.lowlevel.wait_readable`` / ``wait_writable``) and nothing between: trio's
    ``SocketStream`` and socket wrappers cost a scheduler pass after every send and a
    failed ``recv`` before every wait (bench/README.md, "The close path, session 15: the
    commit exchange"). A TLS connection is its ``trio.SSLStream`` (``stream``)."""

    __slots__ = ("stream", "sock", "_poll")

    def __init__(self, stream: trio.abc.Stream | None, sock: socket.socket) -> None:
        self.stream = stream  # None: plain, ``sock`` itself is read and written
        self.sock = sock
        self._poll = select.poll()  # kept: one poll(2) per reuse check (``reusable``)
        self._poll.register(sock.fileno(), select.POLLIN)

    def reusable(self) -> bool:
        """Idle and still open as far as the socket tells: nothing to read (an EOF, a reset
        or stray bytes from the server make it readable)."""
        try:
            return not self._poll.poll(0)
        except OSError:
            return False

    async def send_all(self, data: bytes) -> None:
        """Send all of ``data``. Raises ``OSError`` (plain), ``trio.BrokenResourceError`` /
        ``ssl.SSLError`` (TLS), ``trio.ClosedResourceError``. A plain send that the kernel
        takes at once is no checkpoint: the wait for the answer that follows is one."""
        if self.stream is not None:
            await self.stream.send_all(data)
            return
        sock = self.sock
        with memoryview(data) as view:
            sent = 0
            while sent < len(view):
                try:
                    sent += sock.send(view[sent:])
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(sock)

    async def receive(self, wait: bool) -> bytes:
        """The next bytes the server sent (b"" at EOF); ``wait``: wait for them before the
        first ``recv`` (the answer to a request just sent is not there yet). Raises as
        ``send_all``."""
        if self.stream is not None:
            return bytes(await self.stream.receive_some(READ_SIZE))
        sock = self.sock
        if not wait:
            try:
                return sock.recv(READ_SIZE)
            except BlockingIOError:
                pass
        while True:
            await trio.lowlevel.wait_readable(sock)
            try:
                return sock.recv(READ_SIZE)
            except BlockingIOError:
                pass

    def cut(self) -> None:
        """Shut the connection down both ways (its request's deadline passed: ``_Bound``);
        the descriptor stays open until ``aclose``."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # not connected any more: nothing to wake
            pass

    async def aclose(self) -> None:
        if self.stream is None:
            trio.lowlevel.notify_closing(self.sock)
            self.sock.close()
            return
        with trio.CancelScope(shield=True):
            try:
                await trio.aclose_forcefully(self.stream)
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass


class _Bound:
    """The total deadline of one request (``deadline``: ``trio.current_time()``, moved on
    by ``deadline.extend`` as the body arrives), kept by the run's timer keeper
    (``memfuse.timers``) instead of a trio cancel scope (~58 k instructions each, one per
    commit request: bench/README.md, "The close path, session 16: sidecar"). At the
    deadline the connection in use (``conn``) is shut down (``shutdown(2)`` both ways): a
    wait on it ends at once (readable at EOF), every later read gives EOF and every send
    fails, so whatever the exchange awaits ends with a transport error, which ``exchange``
    turns into the deadline's ``httpx.ReadTimeout`` (``expired``). The connection is never
    reused then (an exchange that failed closes it)."""

    __slots__ = ("deadline", "conn", "expired", "_timer")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.conn: _Conn | None = None
        self.expired = False
        self._timer = timers.call_at(deadline, self._due)

    def _due(self) -> None:
        if trio.current_time() < self.deadline:  # moved on since (``deadline.extend``)
            self._timer = timers.call_at(self.deadline, self._due)
            return
        self.expired = True
        if self.conn is not None:
            self.conn.cut()

    def cancel(self) -> None:
        """The exchange ended: nothing happens at the deadline."""
        self._timer.cancel()


class _StaleConnection(Exception):
    """The send of a request on a pooled connection broke and no answer came (``_exchange``)."""


class LeanHTTP:
    """Pooled HTTP/1.1 requests to one origin (``base_url``: ``http://`` or ``https://``
    host, port and an optional path prefix). ``ssl_context`` is used for ``https``;
    ``timeout`` (s) bounds the connect, each write and each read, as ``httpx.Timeout(timeout)``
    does, and the whole request too (``deadline``: the answer's head within ``timeout`` s of
    the start, its body at ``deadline.MIN_BODY_RATE`` after that). Not thread-safe; one
    trio run."""

    #: the header names each request gives its own value (lower case; ``_headers``)
    PER_REQUEST = _PER_REQUEST

    def __init__(self, base_url: str, ssl_context: ssl.SSLContext | None, timeout: float) -> None:
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http(s) origin: {u.scheme}://...")
        self.https = u.scheme == "https"
        self.host = u.hostname
        self.port = u.port or (443 if self.https else 80)
        self.prefix = u.path.rstrip("/")
        default_port = self.port == (443 if self.https else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = host if default_port else f"{host}:{self.port}"
        self.ssl_context = ssl_context
        self.timeout = float(timeout)
        self._idle: list[_Conn] = []
        #: the headers of a request other than ``_PER_REQUEST`` -> h11's validated and
        #: normalized form of them after ``Host``, and their lines (``_headers``)
        self._validated: dict[tuple[tuple[str, str], ...],
                              tuple[list[tuple[bytes, bytes, bytes]], bytes]] = {}
        self.connections_opened = 0  # for tests and status: how often a connection was made

    async def aclose(self) -> None:
        """Close the idle connections. Idempotent."""
        idle, self._idle = self._idle, []
        for c in idle:
            await c.aclose()

    async def _connect(self, until: float = float("inf")) -> _Conn:
        """A new connection, made within ``timeout`` s and before ``until``
        (``trio.current_time()``: its request's deadline)."""
        try:
            with trio.fail_at(min(trio.current_time() + self.timeout, until)):
                tcp = await trio.open_tcp_stream(self.host, self.port)
                if self.https:
                    ctx = self.ssl_context or ssl.create_default_context()
                    tls = trio.SSLStream(tcp, ctx, server_hostname=self.host, https_compatible=True)
                    try:
                        await tls.do_handshake()
                    except BaseException:
                        await trio.aclose_forcefully(tcp)
                        raise
                    conn = _Conn(tls, tcp.socket)  # type: ignore[arg-type]  # poll(2)s its fileno
                else:  # the stream's socket (TCP_NODELAY set) taken out of trio's wrappers
                    sock = socket.socket(fileno=tcp.socket.detach())
                    sock.setblocking(False)
                    conn = _Conn(None, sock)
        except trio.TooSlowError:
            raise httpx.ConnectTimeout("timed out connecting") from None
        except (OSError, trio.BrokenResourceError, ssl.SSLError) as exc:
            raise httpx.ConnectError(str(exc) or type(exc).__name__) from None
        self.connections_opened += 1
        return conn

    async def _take(self, until: float = float("inf")) -> tuple[_Conn, bool]:
        """A connection for the next request and whether it was idle in the pool (reused);
        a new one is made before ``until`` (``_connect``)."""
        while self._idle:
            c = self._idle.pop()
            if c.reusable():
                return c, True
            await c.aclose()
        return await self._connect(until), False

    def _headers(self, headers: list[tuple[str, str]], length: int | None,
                 varying: list[tuple[str, str]] | None = None,
                 ) -> tuple[list[tuple[bytes, bytes, bytes]], bytes]:
        """``Host``, ``headers`` and ``Content-Length: length`` (None: none) validated and
        normalized by h11's own ``normalize_and_validate`` (its ``LocalProtocolError``
        raised for an illegal name or value, conflicting lengths, a second
        ``Transfer-Encoding``): ``(items, lines)``, h11's ``(raw name, lower-case name,
        value)`` items and the header lines h11 writes for them (``Host`` first, then the
        others in order: its ``write_request``). The headers that are the same from one
        request to the next are validated, and their lines written, once per distinct set:
        each request's headers cost h11 two regular expressions per header, ~100 us of the
        sidecar's CPU per commit request on the benchmark machine (9 headers), though only
        the idempotency key, ``If-Match`` and the length change. ``Content-Length`` and
        ``Transfer-Encoding`` are each validated with all of their kind (the first among the
        per-request headers, the second never), so h11's checks across headers hold as
        before; ``Host`` is counted by ``Request``. ``varying``: the caller split them already
        (``headers`` then holds none of ``_PER_REQUEST``, ``varying`` only those)."""
        if varying is None:
            fixed: list[tuple[str, str]] = []
            varying = []
            for kv in headers:
                (varying if kv[0].lower() in _PER_REQUEST else fixed).append(kv)
        else:
            fixed = headers
        if length is not None:
            varying = [*varying, ("Content-Length", str(length))]
        key = tuple(fixed)
        got = self._validated.get(key)
        if got is None:
            items = _h11_headers([("Host", self.host_header), *fixed])._full_items
            ordered = [kv for kv in items if kv[1] == b"host"] + [kv for kv in items if kv[1] != b"host"]
            block = b"".join([b"%s: %s\r\n" % (raw, value) for raw, _, value in ordered])
            got = (items, block)
            if len(self._validated) >= _VALIDATED_MAX:
                self._validated.clear()
            self._validated[key] = got
        items, block = got
        more = _varying_items(varying)  # never ``Host``: written after the others, in order
        return items + more, block + b"".join([b"%s: %s\r\n" % (raw, value) for raw, _, value in more])

    async def send(self, method: str, path: str, headers: list[tuple[str, str]],
                   content: bytes | None) -> httpx.Response:
        """Send one request (``path`` below the base URL's prefix; ``headers`` without
        ``Host`` and ``Content-Length``, added here: ``_headers``) and read its whole
        answer. Returns an ``httpx.Response``; raises ``httpx.TransportError`` subclasses
        as httpx would (``LocalProtocolError`` for a header h11 refuses)."""
        return (await self.exchange(method, path, headers, content)).response()

    async def exchange(self, method: str, path: str, headers: list[tuple[str, str]],
                       content: bytes | None,
                       varying: list[tuple[str, str]] | None = None) -> "Answer":
        """``send``, the answer as an ``Answer`` (status, headers, body): a caller that
        only decodes a successful answer's body skips building an ``httpx.Response``
        (~50 us of the sidecar's CPU per commit request on the benchmark machine). Raises
        as ``send``. ``varying``: the headers named in ``_PER_REQUEST`` given apart (then
        ``headers`` holds none of them; ``_headers``)."""
        body = content or b""
        length = len(body) if content is not None or method in ("POST", "PUT", "PATCH") else None
        bound = _Bound(trio.current_time() + self.timeout)
        try:
            try:
                return await self._exchange(bound, method, path, headers, length, body, varying)
            except _StaleConnection:  # sent again, once, on a new connection (within the deadline)
                if not bound.expired:
                    return await self._exchange(bound, method, path, headers, length, body, varying,
                                                fresh=True)
        except httpx.TransportError:
            # what an exchange cut at its deadline ended with (an EOF, a failed send or read,
            # a connect cut short) is the deadline's timeout
            if not (bound.expired or trio.current_time() >= bound.deadline):
                raise
        finally:
            bound.cancel()
        # the deadline passed (a drip, or a server that stalls)
        raise httpx.ReadTimeout(deadline.message(self.timeout))

    async def _exchange(self, scope: _Bound, method: str, path: str,
                        headers: list[tuple[str, str]], length: int | None,
                        body: bytes, varying: list[tuple[str, str]] | None = None,
                        fresh: bool = False) -> "Answer":
        """One request on a pooled connection (``fresh``: a new one). Raises
        ``_StaleConnection`` when the send on a pooled connection broke with no answer (the
        server closed it as idle while the request went out: the request never arrived
        whole, so ``exchange`` sends it once more on a new connection), else as ``send``."""
        if fresh:
            c, reused = await self._connect(scope.deadline), False
        else:
            c, reused = await self._take(scope.deadline)
        scope.conn = c
        if scope.expired:  # (while it connected)
            c.cut()
        ok = reuse = False
        try:
            target = self.prefix + path
            try:
                hdrs, lines = self._headers(headers, length, varying)
                data = _request_head(method, target, lines) + body
            except h11.LocalProtocolError as exc:
                raise httpx.LocalProtocolError(str(exc)) from None
            # no timeout of its own: ``scope`` (the request's deadline, ``timeout`` s from
            # its start) ends earlier than one started now would (``_receive``)
            try:
                await c.send_all(data)
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError) as exc:
                failed = httpx.WriteError(str(exc) or type(exc).__name__)
                # the server may have answered before it read the whole body (a 413 from the
                # declared length, a 401) and closed: its answer is the verdict, not the
                # broken send (RFC 9112 section 9.5; httpcore reads it the same way)
                early = await self._early_answer(c, scope, method, target, hdrs, length, body)
                if early is None:
                    raise (_StaleConnection() if reused else failed) from None
                return early
            resp, reuse = await self._receive(c, scope, method, target, hdrs, length, body)
            ok = True
        finally:
            if not ok:
                await c.aclose()
        if reuse and len(self._idle) < MAX_IDLE:
            self._idle.append(c)
        else:
            await c.aclose()
        return resp

    async def _early_answer(self, c: _Conn, scope: _Bound, method: str, target: str,
                            hdrs: list[tuple[bytes, bytes, bytes]], length: int | None,
                            body: bytes) -> "Answer | None":
        """The answer the server sent before the request's send broke (it answered without
        reading the whole body and closed the connection), or None when none can be read
        (the connection gives EOF or an error first). Bounded by ``scope`` and by
        ``EARLY_ANSWER_WAIT`` s: a peer that closed has sent its answer already. The
        connection is closed by the caller (never reused)."""
        with trio.move_on_after(EARLY_ANSWER_WAIT):
            try:
                resp, _ = await self._receive(c, scope, method, target, hdrs, length, body)
            except httpx.TransportError:
                return None
            return resp if resp.status >= 400 else None
        return None

    async def _read(self, c: _Conn, scope: _Bound, wait: bool = False) -> bytes:
        """The next bytes of the answer (b"" at EOF; ``wait``: none can be there yet,
        ``_Conn.receive``). Each read is bounded by ``timeout`` s (``httpx.Timeout``'s read
        timeout); while ``scope`` ends sooner than that (always before the head arrived: it
        started earlier with the same bound) no scope of its own is entered."""
        try:
            if scope.deadline <= trio.current_time() + self.timeout:
                return await c.receive(wait)
            with trio.fail_after(self.timeout):  # the body's deadline moved on (extend)
                return await c.receive(wait)
        except trio.TooSlowError:
            raise httpx.ReadTimeout("timed out reading the answer") from None
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError) as exc:
            raise httpx.ReadError(str(exc) or type(exc).__name__) from None

    async def _receive(self, c: _Conn, scope: _Bound, method: str, target: str,
                       hdrs: list[tuple[bytes, bytes, bytes]], length: int | None,
                       body: bytes) -> tuple["Answer", bool]:
        """Read one whole answer: ``(answer, reusable)``. An answer in the plain form the
        control plane gives (``_simple_head``: HTTP/1.1, ``Content-Length``, no
        ``Transfer-Encoding``, a final status with a body) is read here; anything else (and
        any doubt: EOF, bytes past its end, a head that is not that form) goes to h11 with
        every byte read so far (``_receive_h11``), which reads it or raises as before, and
        the connection is not reused then. ``scope``'s deadline moves on as the body
        arrives (``deadline.extend``)."""
        buf = b""
        wait = True  # the request was just sent: its answer is not there yet
        while True:
            got = await self._read(c, scope, wait)
            wait = False
            buf += got
            head = _simple_head(buf, method) if got else False
            if head is False or (head is None and len(buf) > _HEAD_MAX):
                return await self._receive_h11(c, scope, method, target, hdrs, length, body, buf, got), False
            if isinstance(head, tuple):
                break
        status, reason, headers, start, size, keep_alive = head
        body_start = trio.current_time()
        while len(buf) - start < size:
            got = await self._read(c, scope)
            if not got:
                return await self._receive_h11(c, scope, method, target, hdrs, length, body, buf, got), False
            buf += got
            deadline.extend(scope, body_start, self.timeout, len(buf) - start)
        if len(buf) - start > size:  # bytes after the answer: h11 says what they are
            return await self._receive_h11(c, scope, method, target, hdrs, length, body, buf, b"x"), False
        return Answer(status, reason, headers, buf[start:]), keep_alive

    async def _receive_h11(self, c: _Conn, scope: _Bound, method: str, target: str,
                           hdrs: list[tuple[bytes, bytes, bytes]], length: int | None,
                           body: bytes, buf: bytes,
                           last: bytes) -> "Answer":
        """Read the answer through h11, given the bytes ``buf`` read so far (``last``: the
        last read's, b"" for an EOF): an h11 client connection is told of the request sent
        (its bytes dropped: they were sent already) and then reads as it always did."""
        conn = h11.Connection(h11.CLIENT)
        try:
            conn.send(h11.Request(method=method, target=target, headers=_H11Headers(hdrs)))
            if body:
                conn.send(h11.Data(data=body))
            conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError as exc:  # pragma: no cover - framed alike above
            raise httpx.LocalProtocolError(str(exc)) from None
        try:
            conn.receive_data(buf)
            if not last:
                conn.receive_data(b"")  # the EOF
        except h11.RemoteProtocolError as exc:
            raise httpx.RemoteProtocolError(str(exc)) from None
        status = 0
        body_start = 0.0
        received = 0
        reason = b""
        headers: list[tuple[bytes, bytes]] = []
        chunks: list[bytes] = []
        while True:
            try:
                ev = conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise httpx.RemoteProtocolError(str(exc)) from None
            if ev is h11.NEED_DATA:
                got = await self._read(c, scope)
                try:
                    conn.receive_data(got)
                except h11.RemoteProtocolError as exc:
                    raise httpx.RemoteProtocolError(str(exc)) from None
                continue
            if isinstance(ev, h11.InformationalResponse):
                continue
            if isinstance(ev, h11.Response):
                status, reason, headers = ev.status_code, ev.reason, list(ev.headers)
                body_start = trio.current_time()
            elif isinstance(ev, h11.Data):
                chunks.append(bytes(ev.data))
                received += len(ev.data)
                deadline.extend(scope, body_start, self.timeout, received)
            elif isinstance(ev, h11.EndOfMessage):
                break
            elif isinstance(ev, h11.ConnectionClosed):
                raise httpx.RemoteProtocolError("server disconnected without sending a complete answer")
            else:  # pragma: no cover - h11 emits no other client-side events
                raise httpx.RemoteProtocolError(f"unexpected event {type(ev).__name__}")
        return Answer(status, reason, headers, b"".join(chunks))


def _varying_items(varying: list[tuple[str, str]]) -> list[tuple[bytes, bytes, bytes]]:
    """h11's validated form of the per-request headers (``_PER_REQUEST``: names h11 takes
    as they are): each value checked by h11's own expression for a field value (a
    ``Content-Length`` by its own), ``(raw name, lower-case name, value)``; a name given
    twice, or anything those checks refuse, goes through h11's ``normalize_and_validate``,
    which merges or refuses as it does (``LocalProtocolError``)."""
    out: list[tuple[bytes, bytes, bytes]] = []
    seen: set[bytes] = set()
    for k, v in varying:
        raw, value = k.encode("ascii"), v.encode("ascii")
        name = raw.lower()
        if name in seen:
            break
        seen.add(name)
        if name == b"content-length":
            if not (value.isdigit() and len(value) <= 20) or (len(value) > 1 and value[:1] == b"0"):
                break
        elif not value.isalnum() and _VALUE_RE.fullmatch(value) is None:
            break  # (letters and digits only, an idempotency key: h11's field value)
        out.append((raw, name, value))
    else:
        return out
    return _h11_headers(varying)._full_items


#: (method, target) -> its request line, checked (``_request_head``): a store's creates all
#: go to one target; cleared when full
_REQUEST_LINES: dict[tuple[str, str], bytes] = {}
_REQUEST_LINES_MAX = 256


def _request_head(method: str, target: str, lines: bytes) -> bytes:
    """The request line h11 writes for ``method`` ``target`` (both checked by h11's own
    expressions: ``LocalProtocolError``; a line made once is kept, ``_REQUEST_LINES``), the
    header ``lines`` (``LeanHTTP._headers``) and the blank line that ends the head."""
    line = _REQUEST_LINES.get((method, target))
    if line is None:
        m, t = method.encode("ascii"), target.encode("ascii")
        if _METHOD_RE.fullmatch(m) is None:
            raise h11.LocalProtocolError("Illegal method characters")
        if _TARGET_RE.fullmatch(t) is None:
            raise h11.LocalProtocolError("Illegal target characters")
        line = b"%s %s HTTP/1.1\r\n" % (m, t)
        if len(_REQUEST_LINES) >= _REQUEST_LINES_MAX:
            _REQUEST_LINES.clear()
        _REQUEST_LINES[(method, target)] = line
    return b"%s%s\r\n" % (line, lines)


_Head = tuple[int, bytes, list[tuple[bytes, bytes]], int, int, bool]

#: a header line of an answer, as h11 reads one (``header_field`` of its ``_abnf``, RFC 9110
#: section 5): ``field-name ":" OWS field-value OWS``, the name a ``token`` (no ``:`` in it:
#: the line's first colon ends it) and the rest any run of ``field-vchar`` (h11's
#: ``[^\x00\s]``) and ``SP`` / ``HTAB`` (the OWS either side and the blanks inside a value),
#: so a line is h11's exactly when its name holds only ``_TOKEN`` bytes and the rest none
#: of ``\x00 \n \r \x0b \x0c``; the value is the rest without its OWS. Checked with
#: ``bytes.translate`` (the bytes left after deleting the allowed ones: none) and, for the
#: values, ``count`` / ``in`` over the whole head (session 20), ~5 us less per
#: answer than h11's expression, which backtracks over each value (bench/README.md, "The
#: close path, session 15: the commit exchange"). tests/test_lean_http.py holds it to h11's
#: reading (``test_header_lines_read_as_h11_reads_them``).
_TOKEN = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
#: header names found to be ``_TOKEN`` bytes only (the control plane sends the same few on
#: every answer): a ``bytes.translate`` with a 78-byte delete set costs ~1,800 instructions
#: (its table is built per call); cleared when full. The field values' rule (no byte of
#: ``\x00 \n \r \x0b \x0c``) is checked on the whole head at once (``_simple_head``).
_TOKEN_NAMES: set[bytes] = set()
_TOKEN_NAMES_MAX = 256


def _simple_head(buf: bytes, method: str) -> "_Head | None | bool":
    """The head of the answer starting ``buf`` when it is in the plain form read without h11:
    ``(status, reason, headers, body offset, body length, keep-alive)``; None when more
    bytes are needed to tell; False when it is not that form (h11 reads it). The form: a
    status line ``HTTP/1.1 NNN reason`` (h11's own expression) and header lines of h11's
    grammar (``_field_line``; no obsolete line folding), CRLF line ends only, a final
    status other than 204 / 304 to a request other than ``HEAD``, exactly one
    ``Content-Length`` and no ``Transfer-Encoding``. Keep-alive unless a ``Connection``
    header names ``close``."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        if b"\n" in buf.replace(b"\r\n", b""):
            return False  # a bare LF (h11 accepts those line ends)
        return None
    head = buf[:end]
    lines = head.split(b"\r\n")
    seps = len(lines) - 1
    if (head.count(b"\r") != seps or head.count(b"\n") != seps or b"\x00" in head
            or b"\x0b" in head or b"\x0c" in head):
        return False  # a bare CR or LF, or a NUL, VT or FF: no field value holds one
    m = _STATUS_RE.fullmatch(lines[0])
    if m is None or m["http_version"] != b"1.1" or method == "HEAD":
        return False
    status = int(m["status_code"])
    if status < 200 or status in _NO_BODY:
        return False
    headers: list[tuple[bytes, bytes]] = []
    size = -1
    keep_alive = True
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name:
            return False
        if name not in _TOKEN_NAMES:
            if name.translate(None, _TOKEN):
                return False
            if len(_TOKEN_NAMES) >= _TOKEN_NAMES_MAX:
                _TOKEN_NAMES.clear()
            _TOKEN_NAMES.add(name)
        name, value = name.lower(), value.strip(b" \t")
        if name == b"content-length":
            if size >= 0 or not value.isdigit() or not value.isascii():
                return False
            size = int(value)
        elif name == b"transfer-encoding":
            return False
        elif name == b"connection" and b"close" in [v.strip() for v in value.lower().split(b",")]:
            keep_alive = False
        headers.append((name, value))
    if size < 0:
        return False
    return status, m["reason"] or b"", headers, end + 4, size, keep_alive


class Answer:
    """One whole answer read by ``LeanHTTP.exchange``: ``status``, ``reason`` (the reason
    phrase), ``headers`` (raw ``(name, value)`` pairs as h11 gives them, names lower-case)
    and ``content`` (the body, as received: no ``Content-Encoding`` is asked for)."""

    __slots__ = ("status", "reason", "headers", "content")

    def __init__(self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]],
                 content: bytes) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self.content = content

    def plain(self) -> bool:
        """Whether the body is as sent (no ``Content-Encoding``: then only
        ``response()`` decodes it, as httpx would)."""
        for name, _ in self.headers:
            if name == b"content-encoding":
                return False
        return True

    def response(self) -> httpx.Response:
        """The answer as an ``httpx.Response`` (what ``LeanHTTP.send`` returns)."""
        resp = httpx.Response(self.status, headers=self.headers, content=self.content)
        resp.extensions["reason_phrase"] = self.reason
        return resp
