"""Run the control-plane app with hypercorn under trio (``memfuse serve``).

SQLite is one replica: ``claim_database`` takes an exclusive lock next to an SQLite file
(``<file>.serve.lock``, holding the pid) for as long as the server runs, so a second ``memfuse
serve`` on the same file is refused with ``AlreadyServing`` instead of running beside the first
(the replicas' long-polls would not see each other's commits without polling). CLI commands in
local mode may still open the file; their commits are picked up by the server's watcher.
"""
from __future__ import annotations

import errno
import fcntl
import gc
import logging
import math
import os
import socket
import struct
import termios
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio
from hypercorn.config import Config

from . import consolidation, staleness
from .writepath import lean_route
from .lean import HEAD_END as _HEAD_END  # the blank line ending a request's head, as h11 finds it
from .limits import MAX_HEAD, MAX_PIPELINED, SEND_TIMEOUT

if TYPE_CHECKING:  # for the annotations only
    from fastapi import FastAPI

    from memfuse.server.gate import Connections
    from memfuse.server.service import Service

log = logging.getLogger(__name__)

GRACEFUL_TIMEOUT = 5.0  # seconds in-flight requests get after shutdown begins
BACKLOG = 2048  # pending connections the kernel queues (thousands of sidecars reconnect at once)
# Bytes of answers the kernel may hold for one connection whose client does not read
# (SO_SNDBUF of the listening socket, inherited by every accepted one; Linux doubles it for
# its bookkeeping). Without it Linux grows the buffer up to net.ipv4.tcp_wmem's maximum (4 MiB)
# and a client pipelining requests without reading makes the server compute that much per
# connection before a send blocks; with it, the next send blocks after ~256 KiB and the send
# timeout (memfuse.server.limits) closes the connection. Fast enough for a data-centre
# network (256 KiB per round trip: 250 MB/s at 1 ms).
SEND_BUFFER = 128 * 1024
# Seconds a connection whose client has sent nothing is left in the kernel before it is
# handed to accept() (TCP_DEFER_ACCEPT, see ``listen_socket``).
DEFER_ACCEPT = 1


# The cyclic garbage collector's thresholds for a serving process (``tune_gc``): CPython's
# defaults are (700, 10, 10).
GC_THRESHOLDS = (50_000, 20, 10)


def tune_gc(thresholds: tuple[int, int, int] = GC_THRESHOLDS) -> None:
    """Set the garbage collector's thresholds (``gc.set_threshold``) for a process that serves
    the control plane; call once at start-up of ``memfuse serve`` (process-wide, so not from
    ``serve``, which tests run inside their own process).

    Why: thousands of open streams keep a large heap of long-lived objects (tasks, coroutine
    frames, connection state), and every wake-up of a stream allocates objects that live
    until its next one. With CPython's default first threshold (700 allocations) those are
    promoted to the oldest generation by the thousand on every write that wakes every
    stream, which soon triggers a full collection of the whole heap: measured, 40 % of the
    server's CPU per fan-out line and pauses of a quarter of a second that delay every
    stream (bench/README.md, "Control plane at scale"). A first threshold of 50,000 lets
    those objects die young (reference counting frees them; the collector only has to
    find cycles), so full collections become rare. Memory: at most ~50,000 young objects
    more between collections (a few MiB). Reference: the ``gc`` module documentation.
    """
    gc.set_threshold(*thresholds)


class AlreadyServing(RuntimeError):
    """Another ``memfuse serve`` or ``memfuse dev`` holds this SQLite file; the message names it
    and its pid, for the user."""


def claim_sqlite_file(path: Path, kind: str = "serve") -> int:
    """Take the one-replica lock of the SQLite file ``path`` for this process: an exclusive
    ``flock`` on ``<path>.serve.lock`` (mode 0600), which holds ``"<pid> <kind>"``; ``kind``
    is the command holding it (``"serve"`` or ``"dev"``). Returns the lock's descriptor (the
    lock lasts until it is closed, or the process ends). Raises ``AlreadyServing`` at once,
    naming the other process's command and pid, when another holds it; ``OSError`` when the
    lock file cannot be created."""
    path = Path(path).resolve()
    lock = path.with_name(path.name + ".serve.lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            words = os.pread(fd, 64, 0).decode(errors="replace").split()
        finally:
            os.close(fd)
        other = words[0] if words else "?"
        other_kind = words[1] if len(words) > 1 and words[1] in ("serve", "dev") else "serve"
        if kind == "dev":
            raise AlreadyServing(f"another memfuse {other_kind} (pid {other}) is using {path}; stop it first") from None
        raise AlreadyServing(
            f"another memfuse {other_kind} (pid {other}) is serving {path}; SQLite supports one control-plane "
            "replica: stop it, or run several replicas on PostgreSQL (--db postgresql://...)"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {kind}\n".encode(), 0)
    return fd


def claim_database(app: FastAPI) -> None:
    """Take the one-replica lock of an SQLite file database (``claim_sqlite_file``; no-op for
    PostgreSQL, in-memory SQLite, or when ``app`` already holds it: ``app.state.db_claim``).
    Raises ``AlreadyServing`` naming the other pid when another process holds it; ``OSError``
    when the lock file cannot be created."""
    db = app.state.service.db
    if not db.is_sqlite or db.is_memory or getattr(app.state, "db_claim", None) is not None:
        return
    app.state.db_claim = claim_sqlite_file(Path(db.url.database))


def release_database(app: FastAPI) -> None:
    """Drop the lock of ``claim_database`` (idempotent)."""
    fd = getattr(getattr(app, "state", None), "db_claim", None)
    if fd is not None:
        app.state.db_claim = None
        os.close(fd)


def framing_problem() -> bytes:
    """The body (problem+json, 400 ``invalid_request``) of the answer to a request that gives
    both Content-Length and Transfer-Encoding (``_HTTP11Only._create_stream``)."""
    from memfuse.server.gate import _problem
    return _problem(400, "invalid_request",
                    "the request gives both Content-Length and Transfer-Encoding; send one "
                    "(the connection is closed)")


async def serve(app: FastAPI, listen: str = "127.0.0.1:8080", *, lean: bool = True,
                task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve the ASGI ``app`` on ``listen`` (``HOST:PORT``; port 0 picks a free one) until
    cancelled.

    ``task_status.started(url)`` is called once the socket listens, with the base URL actually
    bound (``"http://127.0.0.1:54321"``). On cancellation the server stops accepting, gives
    requests in flight up to 5 s to finish (long-polls are cut), then returns (re-raising the
    cancellation). Raises ``OSError`` when the address cannot be bound, ``AlreadyServing`` when
    another process serves the same SQLite file (``claim_database``).

    ``lean``: record writes on keep-alive connections are served without hypercorn's
    per-request machinery (``memfuse.server.lean``) when the app has the write path
    (``app.front.writes``); False serves every request through hypercorn (the tests compare
    the two byte for byte).
    """
    claimed_here = getattr(app.state, "db_claim", None) is None
    claim_database(app)
    try:
        await _serve(app, listen, task_status, lean)
    finally:
        if claimed_here:
            release_database(app)


def listen_socket(listen: str, send_buffer: int = SEND_BUFFER,
                  send_timeout: float = SEND_TIMEOUT) -> socket.socket:
    """A TCP socket bound to ``listen`` (``HOST:PORT``, ``[IPv6]:PORT``; port 0 picks a free
    one), not yet listening, as hypercorn would make it (``SO_REUSEADDR``, ``TCP_NODELAY``)
    plus two bounds every accepted connection inherits:

    - ``SO_SNDBUF`` = ``send_buffer`` bytes (see ``SEND_BUFFER``);
    - ``TCP_USER_TIMEOUT`` = ``send_timeout`` s (tcp(7)): answer bytes the client neither
      acknowledges nor makes room for (a zero receive window: it does not read) for that
      long abort the connection in the kernel, so the server's blocked send fails and the
      connection is closed. hypercorn shields its socket writes from cancellation, so the
      application cannot time them out itself. An idle connection (a long-poll waiting,
      nothing unacknowledged) is not affected, nor is a client that reads.

    and one of the listening socket: ``TCP_DEFER_ACCEPT`` = ``DEFER_ACCEPT`` s (tcp(7)): the
    kernel hands a connection to accept() once its first bytes arrived (an HTTP client sends
    first), or, for a client that sends nothing, after that long. So a connection accepted
    without bytes to read has been silent that long: at the cap of unauthenticated
    connections it is closed at once (``_accept_forever``), while a client whose request
    is under way is never accepted before its request.

    Raises ``OSError`` when the address cannot be bound, ``ValueError`` for a malformed
    ``listen``."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"listen address must be HOST:PORT, got {listen!r}")
    host = host.strip("[]") or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT,
                        max(1, int(send_timeout * 1000)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, DEFER_ACCEPT)
        sock.bind((host, int(port)))
    except BaseException:
        sock.close()
        raise
    return sock


async def _serve(app: FastAPI, listen: str, task_status: trio.TaskStatus[str], lean: bool = True) -> None:
    config = Config()
    front = getattr(app, "front", None)  # memfuse.server.gate.Gate
    # our own socket (hypercorn takes a bound one over as fd://N: it listens and closes it)
    # for its bounded send buffer; other forms (unix:, fd://) go to hypercorn as they are
    if listen.startswith(("unix:", "fd://")):
        config.bind = [listen]
    else:
        send_timeout = getattr(front, "send_timeout", SEND_TIMEOUT)
        config.bind = [f"fd://{listen_socket(listen, send_timeout=send_timeout).detach()}"]
    config.backlog = BACKLOG
    config.graceful_timeout = GRACEFUL_TIMEOUT
    # hypercorn's idle timer runs from a connection's start (or its previous answer) until
    # a request's headers are complete: the header deadline, and how long an idle keep-alive
    # connection stays open
    config.keep_alive_timeout = getattr(front, "header_timeout", config.keep_alive_timeout)
    config.h11_max_incomplete_size = MAX_HEAD  # a longer request head is refused (431) and closed
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    connections = getattr(front, "connections", None)
    shutdown = trio.Event()
    # Shielded: our cancellation becomes a graceful shutdown (the trigger below), not an
    # abrupt cancel of hypercorn's tasks; its deadline, set at shutdown, bounds the wait.
    inner = trio.CancelScope(shield=True)

    async def run(task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        with inner:
            await _worker_serve(app, config, connections, shutdown.wait, task_status,
                                lean_route if lean and getattr(front, "writes", None) is not None else None)

    svc: Service | None = getattr(getattr(app, "state", None), "service", None)
    if svc is not None:
        svc.bus.start()  # listen for other replicas' commits before the first long-poll
    sweeps = trio.CancelScope()  # the expiry sweep (memfuse.server.staleness), stopped at shutdown

    async def sweep(svc: Service) -> None:
        with sweeps:
            await staleness.sweep_forever(svc, svc.expiry_interval)

    async def schedule(svc: Service) -> None:
        with sweeps:
            await consolidation.schedule_forever(svc)

    async with trio.open_nursery() as nursery:
        binds = await nursery.start(run)
        if svc is not None and getattr(svc, "expiry_interval", 0) > 0:
            nursery.start_soon(sweep, svc)
        cons = getattr(svc, "consolidation", None)
        if svc is not None and cons is not None and cons.scheduled:  # scheduled consolidation (off unless configured)
            nursery.start_soon(schedule, svc)
        url = binds[0] if binds else f"http://{listen}"
        log.info("control plane listening on %s", url)
        task_status.started(url)
        try:
            await trio.sleep_forever()
        finally:
            log.info("control plane shutting down")
            svc = getattr(getattr(app, "state", None), "service", None)
            if svc is not None:  # answer open long-polls now instead of holding the shutdown
                svc.closing = True
                svc.notifier.wake_all()
            sweeps.cancel()
            shutdown.set()
            inner.deadline = trio.current_time() + GRACEFUL_TIMEOUT + 2




async def _first_head(stream: trio.SocketStream, timeout: float, first: bytes = b"") -> tuple[bytes | None, bool]:
    """Read a new connection's first request head, before hypercorn's machinery for the
    connection is built: returns (the bytes read, whether the client closed its end after
    them) as soon as they hold the blank line ending the head (as h11 finds it) or pass
    ``MAX_HEAD`` bytes (hypercorn then refuses the head: 431); (None, False), and the caller
    closes the connection without an answer, when the client closed its end before its head
    was complete (hypercorn answered 400 to a partial head: the client is gone or leaving), or
    no head came within ``timeout`` s (the header deadline, from the connection's start), or
    the connection was reset.

    Why: hypercorn's per-connection state (its server, protocol, task group, idle timer) cost
    ~700 us of CPU per connection, most of it for a connection that never finishes its head;
    waiting here costs a fraction of that, so a flood of such connections is accepted (and,
    past the cap of unauthenticated connections, evicted) fast enough that the kernel's
    listen backlog drains and a client that sends its request is read (bench/README.md,
    "Hostile clients"). Memory: the head read so far (at most ``MAX_HEAD`` + 64 KiB).
    ``first``: bytes of the connection read already (``_accept_forever``)."""
    buf = bytearray(first)
    if buf and (len(buf) > MAX_HEAD or _HEAD_END.search(buf) is not None):
        return first, False
    with trio.move_on_after(timeout):
        while True:
            try:
                piece = await stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return None, False
            if not piece:  # the client closed its end: answered only when its head is complete
                return (bytes(buf), True) if _HEAD_END.search(buf) is not None else (None, False)
            start = max(0, len(buf) - 2)  # only the new bytes (and the two before) are searched
            buf += piece
            if len(buf) > MAX_HEAD or _HEAD_END.search(buf, start) is not None:
                return bytes(buf), False
    return None, False


ACCEPT_BATCH = 64  # connections accepted in a row before the other tasks run
ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
ACCEPT_IGNORED_ERRNOS = frozenset({errno.ECONNABORTED, errno.EPERM, errno.EPROTO})
LIMBO_SECONDS = 0.1  # how long a connection accepted at the cap may take to send its request head
LIMBO_MAX = 4096  # such connections waiting at once (the oldest closed past it)


async def _accept_forever(listener: socket.socket, nursery: trio.Nursery,
                          handle: Callable[[socket.socket, bytes, tuple[str, int] | None, trio.CancelScope],
                                           Awaitable[None]],
                          connections: Connections | None) -> None:
    """Accept connections on the listening socket ``listener`` until cancelled (then close
    it), starting ``handle(connection, first, peer, scope)`` in ``nursery`` for each: trio's
    ``serve_listeners`` (trio 0.22, ``_highlevel_serve_listeners.py``: errors of capacity such
    as EMFILE are logged and retried after 0.1 s) with one change, for when a new
    connection meets a cap of connections without a valid token (``Connections.at_cap``: its
    address's, or the one of all addresses): one whose request head has begun to arrive but
    is not complete (read without waiting), or whose client left, is closed at once, before
    any task or trio object is made for it (counted and logged by
    ``Connections.turned_away``); one whose head is in is started with those bytes
    (``first``); one that has sent nothing yet is looked at again ``LIMBO_SECONDS`` later,
    without a task (a client's request may be a moment behind its connection: the listening
    socket's ``TCP_DEFER_ACCEPT`` holds such a connection back, but not one the kernel took
    by SYN cookie, as it does under a flood): started if its head is in by then, else
    closed. ``Connections.opened`` makes room for those started by evicting the one idle the
    longest (of the address, of all). Every connection from an address (``peer``: host,
    port) is counted by ``Connections.opened`` here, before its task starts, with
    ``scope.cancel`` as its eviction: ``handle`` runs the connection in ``scope`` and reports
    its end (``Connections.closed``). So a client that sends its request is never shut out
    by connections that do not, from other addresses or its own (one NAT, one ingress, the
    node's probes: attack 16 F3).

    Why: a flood of connections that never finish their heads fills the kernel's listen
    backlog; a client's SYN is then dropped (retried after 1, 3, 7 s) and its connection
    waits behind the backlog's worth of the flood. The flood is only drained when accepting
    and refusing one costs less than the flood's clients take to make one (here ~40 us,
    against ~250 us for a connection given a task; bench/README.md, "Hostile clients"). A
    client behind the backlog has sent its request by the time it is accepted, so it is
    started."""
    listener.setblocking(False)
    # INVARIANT: ``limbo`` holds, oldest first, (accepted at, connection, peer) of the
    # connections accepted at the cap that had sent nothing yet; each is looked at again
    # ``LIMBO_SECONDS`` later (its head in: started; else closed), at most ``LIMBO_MAX``.
    limbo: deque[tuple[float, socket.socket, tuple[str, int]]] = deque()

    def head_state(conn: socket.socket) -> tuple[bytes, str]:
        """What ``conn`` sent so far, read without waiting, and ``"head"`` (a whole request
        head or more than ``MAX_HEAD`` bytes), ``"nothing"`` yet, or ``"drop"`` (a head begun
        and not finished, the client left, or the connection was reset)."""
        try:
            first = conn.recv(MAX_HEAD + 1, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return b"", "nothing"
        except OSError:
            return b"", "drop"
        if first and (len(first) > MAX_HEAD or _HEAD_END.search(first) is not None):
            return first, "head"
        return b"", "drop"

    def start(conn: socket.socket, peer: tuple[str, int] | None, first: bytes) -> None:
        scope = trio.CancelScope()  # entered by the connection's task; cancelled to evict it
        # counted here, not in the task: the connections of one batch count at once
        if connections is not None and peer is not None:
            connections.opened(peer, scope.cancel)
        nursery.start_soon(handle, conn, first, peer, scope)

    def turn_away(conn: socket.socket, peer: tuple[str, int] | None) -> None:
        conn.close()
        if connections is not None:
            connections.turned_away(peer)

    try:
        while True:
            if limbo:
                with trio.move_on_after(max(0.0, limbo[0][0] + LIMBO_SECONDS - trio.current_time())):
                    await trio.lowlevel.wait_readable(listener)
            else:
                await trio.lowlevel.wait_readable(listener)
            now = trio.current_time()
            while limbo and limbo[0][0] + LIMBO_SECONDS <= now:
                _, conn, waited = limbo.popleft()
                first, state = head_state(conn)
                if state == "head" or (state == "nothing" and connections is not None
                                          and not connections.at_cap(waited)):
                    start(conn, waited, first)  # its head is in, or it meets a cap no more
                else:
                    turn_away(conn, waited)
            for _ in range(ACCEPT_BATCH):
                try:
                    conn, addr = listener.accept()
                except BlockingIOError:
                    break
                except OSError as exc:
                    if exc.errno in ACCEPT_IGNORED_ERRNOS:
                        continue
                    if exc.errno not in ACCEPT_CAPACITY_ERRNOS:
                        raise
                    log.error("accept: %s; retrying in 0.1 s", errno.errorcode[exc.errno])
                    await trio.sleep(0.1)
                    break
                peer: tuple[str, int] | None = (addr[0], addr[1]) if isinstance(addr, tuple) else None
                if connections is None or peer is None or not connections.at_cap(peer):
                    start(conn, peer, b"")
                    continue
                first, state = head_state(conn)
                if state == "head":
                    start(conn, peer, first)
                elif state == "nothing":
                    limbo.append((now, conn, peer))
                    if len(limbo) > LIMBO_MAX:
                        _, old, old_peer = limbo.popleft()
                        turn_away(old, old_peer)
                else:
                    turn_away(conn, peer)
            await trio.lowlevel.checkpoint()
    finally:
        for _, conn, _ in limbo:
            conn.close()
        listener.close()


def _response_headers(config: Config) -> Callable[[], list[tuple[bytes, bytes]]]:
    """hypercorn's headers of every HTTP/1.1 answer (``Config.response_headers("h11")``),
    the ``Date`` formatted once a second (``memfuse.server.lean.date_header``) when they are
    its defaults."""
    if not (config.include_date_header and config.include_server_header) or config.alt_svc_headers:
        return lambda: config.response_headers("h11")
    from memfuse.server.lean import date_header

    return lambda: [(b"date", date_header()), (b"server", b"hypercorn-h11")]


def _address(stream: trio.SocketStream) -> str:
    """``host:port`` of the client of ``stream`` (``"?"`` when the socket cannot tell), for
    logs."""
    try:
        name = stream.socket.getpeername()
    except OSError:
        return "?"
    return f"{name[0]}:{name[1]}" if isinstance(name, tuple) else str(name)


class _IdleTimer:
    """hypercorn's per-connection idle timer (``TCPServer.idle_task``: its
    ``_idle_timeout``, armed by ``restart`` when the connection turns idle, disarmed by
    ``stop`` when a request's headers are in) as one task per connection whose deadline
    is moved, instead of a task started and cancelled per request (a task spawn, a
    cancellation and the lock of ``TrioSingleTask`` per request: bench/README.md, "The
    close path, session 11: serve"). Same behaviour: the connection is closed (shielded,
    as hypercorn does) ``keep_alive_timeout`` s after it turned idle, or at once when the
    server terminates while it is idle; a busy connection is left to finish. ``end()``
    (the connection is over) ends the task without closing anything. ``server``: the
    connection's hypercorn ``TCPServer`` (``_worker_serve``)."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.scope = trio.CancelScope()  # its deadline: when an idle connection closes
        self.armed: bool = False  # the connection is idle (closes at the deadline)
        self.ended: bool = False
        self.started: bool = False  # its task is spawned
        self.changed: trio.Event = trio.Event()  # set when ``armed`` or ``ended`` changes (after termination)

    async def restart(self, task_group: Any, action: Any) -> None:
        self.armed = True
        self.scope.deadline = trio.current_time() + self.server.config.keep_alive_timeout
        self.changed.set()
        if not self.started:
            self.started = True
            task_group.spawn(self._run)

    async def stop(self) -> None:
        self.armed = False
        self.scope.deadline = math.inf

    def end(self) -> None:
        self.armed = False
        self.ended = True
        self.scope.cancel()
        self.changed.set()

    async def _run(self) -> None:
        with self.scope:  # cancelled: the deadline passed while idle, or ``end()``
            await self.server.context.terminated.wait()
            # the server terminates: close the connection now if idle, else once it is
            while not self.armed and not self.ended:
                self.changed = trio.Event()
                await self.changed.wait()
        if self.ended:
            return
        with trio.CancelScope(shield=True):
            await self.server._initiate_server_close()


async def _worker_serve(app: FastAPI, config: Config, connections: Connections | None,
                        shutdown_trigger: Callable[[], Awaitable[object]],
                        task_status: trio.TaskStatus[list[str]],
                        lean_route: Callable[[str, str], Any] | None = None) -> None:
    """hypercorn's ``worker_serve`` (hypercorn 0.18, ``hypercorn/trio/run.py``, plain TCP
    and Unix sockets only) with one change: each accepted connection is first offered to
    ``connections`` (``memfuse.server.gate.Connections``: the cap on connections without a
    valid token per client address, and in all), closed at once when over it, and reported
    when it ends. hypercorn has no hook for this; the rest is its own code, called as it calls it.

    A second change: when the client closes its end, the connection ends then. hypercorn
    0.18's ``TCPServer`` leaves its keep-alive idle timer running after the client's EOF, so a
    closed connection's task lived on for ``keep_alive_timeout`` (5 s) and still counted
    against the per-address cap: 64 short requests in a row without a token (a client whose
    token expired, Schemathesis' negative cases) filled it and every further connection was
    reset for 5 s.

    A third: no HTTP/2 on cleartext connections (``_HTTP11Only``).

    A fourth: the keep-alive idle timer is one task per connection whose deadline moves
    (``_IdleTimer``), not a task started and cancelled per request, and a read has no cancel
    scope of its own when there is no read timeout (hypercorn's default).

    A fifth: one connection's error stays in it. The socket's write side is shut under
    hypercorn's send lock (``_TCPServer._close``), so a response is never sent beside it
    (``trio.BusyResourceError``), and anything else a connection raises is logged with its
    peer and dropped in ``handle`` instead of stopping the server.

    A fifth: connections are accepted by ``_accept_forever`` (not trio's ``serve_listeners``),
    which closes new connections without their request head at the cap of unauthenticated
    connections before any task is made for them, and a connection's first request head is
    read by ``_first_head`` (within the header deadline) before hypercorn's objects for it
    are made, then given to hypercorn as if it had read it (``_TCPServer.first``). An
    evicted connection (``Connections.opened``) is cancelled where it stands and closed.

    A sixth: with ``lean_route`` (``(method, decoded path) ->`` a true value when served
    lean), a connection's requests that it names are served by ``memfuse.server.lean`` (h11 and the app on the connection's
    task, no hypercorn object made) until the first that is not, which hypercorn serves
    (``_TCPServer.first``, ``requests_before``); once hypercorn is between two requests and
    the client's next bytes start a lean request, the connection goes back to the lean path
    (``_TCPServer.handback``, ``LeanHTTP.takes_back``).

    A seventh: requests a client pipelined are not run once it has gone (attack17 F4):
    hypercorn ran each, its answer sent to nobody. A client that reset its connection, or
    could not be sent an answer (``memfuse.server.lean.client_gone``), ends the connection
    before its first request and at the end of each answer (``_HTTP11Only._maybe_recycle``:
    the reader, parked while the answer is under way, is cancelled); and the answer that makes
    ``MAX_PIPELINED`` in a row to a client whose next request was already in carries
    ``Connection: close`` (``_HTTP11Only._pipelined_cut``). Counted by ``Connections.ended``."""
    from itertools import chain

    import h11
    from hypercorn.events import Closed, RawData
    from hypercorn.protocol import ProtocolWrapper
    from hypercorn.protocol.events import Body as HyBody
    from hypercorn.protocol.events import EndBody as HyEndBody
    from hypercorn.protocol.events import Response as HyResponse
    from hypercorn.protocol.h11 import H11Protocol
    from hypercorn.trio.lifespan import Lifespan
    from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
    from hypercorn.trio.worker_context import WorkerContext
    from hypercorn.typing import ConnectionState
    from hypercorn.utils import ShutdownError, parse_socket_addr, raise_shutdown, repr_socket_addr, wrap_app

    from memfuse.server.lean import LeanHTTP
    from memfuse.server.lean import client_gone as lean_client_gone

    # counts a connection ended early, by reason (``Connections.ended``)
    on_ended = connections.ended if connections is not None else None

    class _HTTP11Only(H11Protocol):
        """hypercorn's HTTP/1.1 protocol without its switch to HTTP/2 on a cleartext
        connection (``Upgrade: h2c``, or the HTTP/2 preface): the upgrade is ignored (RFC 9110
        lets a server ignore ``Upgrade``) and a preface is answered as the malformed HTTP/1.1
        request it is. Over HTTP/2 one connection could start and reset streams without
        reading a byte of their answers (the "rapid reset" of CVE-2023-44487): work without
        bound that none of the front door's per-connection limits sees, where an HTTP/1.1
        client that does not read stops the server at the send buffer. memfuse's clients
        speak HTTP/1.1; HTTP/2 belongs to a TLS proxy in front."""

        async def _check_protocol(self, event: Any) -> None:
            return None

        async def _create_stream(self, request: Any) -> None:
            # attack19 F4: a request with both Content-Length and Transfer-Encoding (h11
            # frames it by the chunks and kept the connection: the bytes after the last chunk
            # ran as a second request, one a proxy framing by Content-Length never saw) is
            # refused here, before a stream is made, and the connection closed (RFC 9112
            # §6.3); its body is never read, nothing after it runs. h11 itself refuses any
            # Transfer-Encoding but ``chunked`` (case and surrounding spaces aside, RFC 9112
            # §7) and a second one: 501 and close. The lean front door hands every request
            # with a Transfer-Encoding to hypercorn (``memfuse.server.lean``): one place.
            names = {name for name, _ in request.headers}
            if b"transfer-encoding" in names and b"content-length" in names:
                body = framing_problem()
                await self._send_h11_event(h11.Response(status_code=400, headers=[
                    (b"content-length", str(len(body)).encode()), (b"content-type", b"application/problem+json"),
                    (b"connection", b"close"), *self.config.response_headers("h11")]))
                await self._send_h11_event(h11.Data(data=body))
                await self._send_h11_event(h11.EndOfMessage())
                if on_ended is not None:
                    on_ended("framing")
                await self.send(Closed())
                return  # no stream: the loop reading the request's body ends at once
            await super()._create_stream(request)

        # INVARIANT: ``_held`` is the head of a response of known length (``Content-Length``,
        # not chunked) that h11 has framed and that is not sent yet; it leaves with the next
        # event's bytes (the body, the end of an empty body, or anything else) in one send.
        # hypercorn sends the head, the body and the (empty) end of a response as three
        # socket writes, each with its lock and cancel scope; a record write's answer is now
        # one (bench/README.md, "The close path, session 10: serve"). A response without a
        # length (a stream, a long-lived answer) has its head sent at once, as before.
        _held: bytes = b""

        # INVARIANT: ``pipelined`` counts the answers in a row whose head went out while the
        # client's next request had arrived already (its bytes held by h11 or the kernel: it
        # sent it without waiting for the answer); an answer sent with nothing of it in sets
        # it back to 0. The answer that makes it ``MAX_PIPELINED`` carries ``Connection:
        # close`` and the connection ends after it (``_pipelined_cut``).
        pipelined = 0

        def _pipelined_cut(self) -> bool:
            """Count an answer about to start (``pipelined``); True when it is the last one of
            the connection (a deep pipeline), then counted (``Connections.ended``)."""
            nxt = bool(self.connection.trailing_data[0]) or (self.tcp is not None and self.tcp.readable())
            self.pipelined = self.pipelined + 1 if nxt else 0
            if self.pipelined < MAX_PIPELINED:
                return False
            if on_ended is not None:
                on_ended("pipelined")
            return True

        async def stream_send(self, event: Any) -> None:
            if isinstance(event, HyResponse) and event.status_code >= 200 and self._pipelined_cut():
                event = HyResponse(stream_id=event.stream_id, status_code=event.status_code,
                                   headers=[*event.headers, (b"connection", b"close")])
            if (isinstance(event, HyResponse) and event.status_code >= 200 and not self._held
                    and any(k.lower() == b"content-length" for k, _ in event.headers)
                    and not any(k.lower() == b"transfer-encoding" for k, _ in event.headers)):
                headers = list(chain(event.headers, self.config.response_headers("h11")))
                if self.keep_alive_requests >= self.config.keep_alive_max_requests:
                    headers.append((b"connection", b"close"))
                self._held = self._frame(h11.Response(headers=headers, status_code=event.status_code))
                return
            if isinstance(event, (HyBody, HyEndBody)):
                data = self._frame(h11.Data(data=event.data) if isinstance(event, HyBody) else h11.EndOfMessage())
                held, self._held = self._held, b""
                if held or data:
                    await self.send(RawData(data=held + data))
                return
            if self._held:
                held, self._held = self._held, b""
                await self.send(RawData(data=held))
            await super().stream_send(event)

        # the connection's ``_TCPServer`` (set by its ``protocol`` setter)
        tcp: Any = None

        # set while the connection's reader waits for this cycle's end (``_TCPServer._cycle_over``);
        # ``_maybe_recycle`` sets it and clears it
        cycle_over: trio.Event | None = None

        async def _maybe_recycle(self) -> None:
            # An answer is over. hypercorn goes on to the next request the client pipelined
            # (h11 holds them, the kernel more) even when its client has gone: each was run
            # and its answer sent to nobody (attack17 F4: 1,000 pipelined reads a connection
            # ran on for a minute after their client left). A client gone (``client_gone``: a
            # reset, or an answer it could not be sent) ends the connection here instead: the
            # reader stops, nothing it pipelined runs.
            tcp = self.tcp
            try:
                if tcp is not None and tcp.client_gone():
                    await self._close_stream()
                    tcp.stop_reading()
                    await self.send(Closed())
                    return
                await super()._maybe_recycle()
                if tcp is not None and not (self.connection.our_state is h11.IDLE
                                            and self.connection.their_state is h11.IDLE):
                    # no next cycle (the server terminates, the client asked to close, an
                    # error): the connection ends, so does its reader, wherever it waits. It
                    # could wait for ever: a request read as the server began to terminate
                    # left h11 paused on an event nothing set again, and the connection lived
                    # until the end of the grace period (attack22: SIGTERM with keep-alive
                    # reads always took the whole 5 s)
                    tcp.stop_reading()
            finally:
                over, self.cycle_over = self.cycle_over, None
                if over is not None:
                    over.set()

        def _frame(self, event: Any) -> bytes:
            """h11's bytes of ``event`` (b"" when the connection is in error, as hypercorn's
            ``_send_h11_event`` sends nothing then)."""
            try:
                return self.connection.send(event) or b""
            except h11.LocalProtocolError:
                if self.connection.their_state != h11.ERROR:
                    raise
                return b""

    class _LastRequestH11(h11.Connection):
        """h11's server connection, which ignores what a client sends after the request that
        asked to close the connection (RFC 9112 §9.6: the server "MUST NOT process any further
        requests received on that connection"). h11 raises a protocol error on those bytes
        (even a stray CRLF after the body, which old clients send) and hypercorn then answered
        400 in place of the answer of the request, whose write had run (attack22: the record
        stored, the client told 400); the lean path answers that request and closes."""

        def next_event(self) -> Any:
            if self.their_state is h11.MUST_CLOSE and self.trailing_data[0]:
                return h11.NEED_DATA
            return super().next_event()

    class _TCPServer(TCPServer):
        # what ``_first_head`` read of the connection before hypercorn took it over, and
        # whether the client had closed its end by then
        first: bytes = b""
        first_eof = False
        idle_task: _IdleTimer  # type: ignore[assignment]  # hypercorn's TrioSingleTask, replaced

        # INVARIANT: None while hypercorn serves the connection; once set (``_read_data``,
        # ``_between_requests`` true), the bytes its client sent next, a lean request's whole
        # head first: hypercorn has ended without closing the connection (``_close``) and
        # ``handle`` serves it with the lean path again from those bytes on
        handback: bytes | None = None

        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            self.idle_task = _IdleTimer(self)
            # the reader (``_read_data``), cancelled by ``stop_reading``: it may be parked
            # until the answer being sent is over (h11's PAUSED), with requests pipelined
            self.reading = trio.CancelScope()
            self.send_failed = False  # an answer could not be sent: the client is gone

        def client_gone(self) -> bool:
            """Whether the connection's client is gone (an answer could not be sent, or
            ``memfuse.server.lean.client_gone``); counted (``Connections.ended``) when so."""
            gone = self.send_failed or lean_client_gone(self.stream.socket)
            if gone and on_ended is not None:
                on_ended("client_gone")
            return gone

        def readable(self) -> bool:
            """Whether bytes of the client wait in the kernel, not read yet (``FIONREAD``)."""
            fd = self.stream.socket.fileno()
            if fd < 0:
                return False
            try:
                waiting: int = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
            except OSError:
                return False
            return waiting > 0

        def stop_reading(self) -> None:
            """Nothing more is read from the connection, nor run of what was read."""
            self.reading.cancel()

        async def protocol_send(self, event: Any) -> None:
            # hypercorn's, remembering a send that failed (it tells only the protocol, whose
            # stream ends, and then runs the client's next pipelined request)
            if not isinstance(event, RawData):
                await super().protocol_send(event)
                return
            async with self.send_lock:
                try:
                    with trio.CancelScope(shield=True):
                        await self.stream.send_all(event.data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    self.send_failed = True
                    await self.protocol.handle(Closed())

        async def _read_data(self) -> None:
            # hypercorn's loop, without a cancel scope per read when there is no read
            # timeout (``config.read_timeout`` None: the idle timer bounds an idle connection),
            # given first what ``_first_head`` read
            try:
                with self.reading:
                    if self.first:
                        await self.protocol.handle(RawData(self.first))
                    if self.first_eof:  # as the loop below ends on the client's EOF
                        await self.protocol.handle(RawData(b""))
                        await self.protocol.handle(Closed())
                        return
                    timeout = self.config.read_timeout
                    while True:
                        try:
                            if timeout is None:
                                data = await self.stream.receive_some(MAX_RECV)
                            else:
                                with trio.fail_after(timeout):
                                    data = await self.stream.receive_some(MAX_RECV)
                        except (trio.ClosedResourceError, trio.BrokenResourceError, trio.TooSlowError):
                            break
                        else:
                            if data and lean is not None:
                                await self._cycle_over()
                                if self._between_requests() and lean.takes_back(data):
                                    self.handback = bytes(data)  # ``handle`` gives it to the lean path
                                    return
                            await self.protocol.handle(RawData(bytes(data)))
                            if data == b"":
                                break
                await self.protocol.handle(Closed())
            finally:
                self.idle_task.end()  # the peer is gone: nothing to keep alive

        # INVARIANT: the socket's send side has one user at a time: every ``send_all``
        # (hypercorn's ``protocol_send``) and this ``send_eof`` run holding ``send_lock``.
        # hypercorn 0.18 shuts the write side without the lock, from whichever task ends the
        # connection (the reader's, when the client leaves with a request body unread), and
        # trio's ``send_eof`` holds the stream over a checkpoint: a response sent meanwhile
        # on the app's task (the gate's refusal) raised ``trio.BusyResourceError`` (attack 11
        # F4; tests/test_connection_errors.py). When a send holds the lock (it may be blocked
        # on a client that does not read), the write side is not shut: closing the stream
        # ends that send with ``ClosedResourceError``, which ``protocol_send`` handles.
        async def _cycle_over(self) -> None:
            """Wait, when the answer to the connection's request is out but its cycle is not
            over yet (both h11 sides ``DONE``, the app's task not ended: hypercorn sends the
            answer before the task ends and ``_maybe_recycle`` runs), until it is: a client that
            sends its next request as soon as it has the answer found hypercorn there most of
            the time, and its record write stayed hypercorn's (attack22: 37 of 200). Bounded as
            h11's own wait: it holds what came (``PAUSED``) until the next cycle starts too;
            ``_maybe_recycle`` sets the event at its end, and stops the reader when no next
            cycle starts."""
            proto = self._protocol.protocol
            if type(proto) is not _HTTP11Only:
                return
            conn = proto.connection
            if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                over = proto.cycle_over = trio.Event()
                await over.wait()

        def _between_requests(self) -> bool:
            """Whether hypercorn is between two requests of this connection: the last answer
            is over (h11's next cycle started: both sides ``IDLE``), no request of it runs,
            h11 holds no byte of the client's not read yet, and the server does not
            terminate. Then the connection may go back to the lean path (``handback``)."""
            proto = self._protocol.protocol
            if type(proto) is not _HTTP11Only or proto.stream is not None:
                return False
            conn = proto.connection
            return (conn.our_state is h11.IDLE and conn.their_state is h11.IDLE
                    and not conn.trailing_data[0] and not self.context.terminated.is_set())

        @property
        def requests(self) -> int:
            """Requests answered on the connection so far (lean's before, then hypercorn's)."""
            proto = self._protocol.protocol
            return int(getattr(proto, "keep_alive_requests", self.requests_before))

        async def _close(self) -> None:
            if self.handback is not None:  # the connection goes on, on the lean path
                return
            try:
                if self.send_lock.locked():  # by a send (or by this task: not re-entered)
                    raise trio.WouldBlock
                self.send_lock.acquire_nowait()
            except trio.WouldBlock:
                pass
            else:
                try:
                    await self.stream.send_eof()
                except (trio.BrokenResourceError, trio.BusyResourceError, trio.ClosedResourceError):
                    pass  # the peer is gone, or the stream is closed already
                finally:
                    self.send_lock.release()
            await self.stream.aclose()

        # requests answered on the connection by the lean path before it was handed over
        # (``memfuse.server.lean``): hypercorn's keep-alive count goes on from there
        requests_before = 0

        # hypercorn's ``run`` makes its ProtocolWrapper inline: its HTTP/1.1 protocol is
        # swapped for ``_HTTP11Only`` as it is set (TLS with ALPN h2 is not served here)
        @property
        def protocol(self) -> ProtocolWrapper:
            return self._protocol

        @protocol.setter
        def protocol(self, wrapper: ProtocolWrapper) -> None:
            protocol = wrapper.protocol
            if type(protocol) is H11Protocol:
                protocol.__class__ = _HTTP11Only
                assert isinstance(protocol, _HTTP11Only)
                if type(protocol.connection) is h11.Connection:
                    protocol.connection.__class__ = _LastRequestH11
                protocol.keep_alive_requests = self.requests_before
                protocol.tcp = self
            self._protocol = wrapper

    # hypercorn types its ASGI app with its own TypedDict scopes; starlette's are plain mappings
    asgi = wrap_app(app, config.wsgi_max_body_size, None)  # type: ignore[arg-type]
    lifespan_state: dict[str, Any] = {}
    lifespan = Lifespan(asgi, config, lifespan_state)
    context = WorkerContext(None)
    # requests named by ``lean_route`` (the record writes) without hypercorn's per-request
    # machinery (memfuse.server.lean)
    lean: LeanHTTP | None = None
    if lean_route is not None:
        lean = LeanHTTP(app, lean_route, keep_alive_timeout=config.keep_alive_timeout,
                        keep_alive_max_requests=config.keep_alive_max_requests,
                        max_head=config.h11_max_incomplete_size,
                        response_headers=_response_headers(config),
                        log_exception=config.log.exception, lifespan_state=lifespan_state,
                        on_client_gone=None if on_ended is None else lambda: on_ended("client_gone"),
                        # the front door's record-write route (memfuse.server.gate.Gate.write)
                        write=getattr(getattr(app, "front", None), "write", None))
        state = getattr(app, "state", None)
        if state is not None:
            state.lean = lean  # its counters, for tests and benchmarks

    async def handle(conn: socket.socket, first_bytes: bytes, peer: tuple[str, int] | None,
                     scope: trio.CancelScope) -> None:
        try:
            stream = trio.SocketStream(trio.socket.from_stdlib_socket(conn))
        except BaseException:
            conn.close()
            if peer is not None and connections is not None:
                connections.closed(peer)
            raise
        try:
            with scope:
                where = f"{peer[0]}:{peer[1]}" if peer is not None else _address(stream)
                try:
                    first, eof = await _first_head(stream, config.keep_alive_timeout, first_bytes)
                    if first is None:
                        return  # no head in time, or the client left before it: closed (finally)
                    if lean_client_gone(conn):  # it sent its requests and left: none of them runs
                        if on_ended is not None:
                            on_ended("client_gone")
                        return
                    served = 0
                    if lean is not None:
                        sock = stream.socket
                        try:
                            addresses = (parse_socket_addr(sock.family, sock.getpeername()),
                                         parse_socket_addr(sock.family, sock.getsockname()))
                        except OSError:  # reset since (ENOTCONN): as hypercorn's run(), closed quietly
                            return
                        over = await lean.serve(conn, first, eof, *addresses)
                        if over is None:
                            return  # the connection is over: closed (finally)
                        first, eof, served = over
                    while True:
                        # (hypercorn types the stream as its TLS one; it serves plain streams too: its own run())
                        server = _TCPServer(asgi, config, context, ConnectionState(lifespan_state.copy()), stream)
                        server.first, server.first_eof, server.requests_before = first, eof, served
                        await server
                        if server.handback is None or lean is None:
                            break
                        # between two requests, the next one a lean request: the lean path again
                        over = await lean.serve(conn, server.handback, False, *addresses, requests=server.requests)
                        if over is None:
                            return  # the connection is over: closed (finally)
                        first, eof, served = over
                except* Exception:
                    # supervision: whatever one connection raises (hypercorn catches only the app's
                    # own errors and OSError) ends that connection here, logged, and never reaches the
                    # server's nursery: before, it stopped ``memfuse serve`` (attack 11 F4). The
                    # stream is closed by hypercorn's ``finally`` (or below); a cancellation passes
                    # through.
                    log.exception("connection failed; dropped", extra={"peer": where})
        finally:
            # an evicted connection's task is cancelled where it stands (hypercorn's own close
            # is cut by the cancellation): its socket is closed here, before it stops counting
            stream.socket.close()
            if peer is not None and connections is not None:
                connections.closed(peer)

    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as server_nursery:
            sockets = config.create_sockets()
            binds = []
            for sock in sockets.insecure_sockets:
                sock.listen(config.backlog)
                binds.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
            task_status.started(binds)
            if lean is not None:
                server_nursery.start_soon(lean.watch)  # its header deadlines (ends at terminate)
            try:
                async with trio.open_nursery(strict_exception_groups=True) as nursery:
                    nursery.start_soon(raise_shutdown, shutdown_trigger)
                    nursery.start_soon(raise_shutdown, context.terminate.wait)
                    for sock in sockets.insecure_sockets:
                        nursery.start_soon(_accept_forever, sock, server_nursery, handle, connections)
                    await trio.sleep_forever()
            except BaseExceptionGroup as error:
                _, other = error.split((ShutdownError, KeyboardInterrupt))
                if other is not None:
                    raise other
            finally:
                await context.terminated.set()
                if lean is not None:
                    lean.terminate()
                server_nursery.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()
