"""Streaming change feeds and event streams (``GET .../changes?stream=true``, ``GET
.../events?stream=true``; docs/API.md, "Streams").

One long-lived HTTP/1.1 response per feed (``200``, ``Content-Type: application/x-ndjson``,
chunked): one JSON line per page, exactly the page a long-poll would have answered
(``ChangePage`` / ``EventPage``), sent when there is something after the client's cursor; a
heartbeat line (the empty page with the current ``seq``) on every tick of one shared ticker
(``HEARTBEAT_SECONDS``, below the 60 s idle timeout of common proxies); the end after
``LIFETIME_SECONDS`` ± ``LIFETIME_JITTER`` (so a rolling restart or a load balancer spreads the
reconnects) or at server shutdown. The first line goes out at once (a heartbeat when there is
nothing after the cursor). An error found mid-stream (access revoked,
cursor expired, database error) is a last line ``{"error": <problem object>}``, then the end.
A refusal known before the first byte is the usual ``application/problem+json`` response.

What a stream costs while idle: a task waiting on one event (no timer, no thread, no
database); the ticker is one thread that wakes every open stream once per heartbeat, a
twentieth of them at a time. A
stream shares the long-poll machinery: it subscribes to the ``Notifier`` before it looks,
reads the feed through ``FeedReads`` (one read and one encoding for every stream at the same
cursor), and counts as a long-lived response (``memfuse.server.streamclass``).

Tokens: a stream authenticates once, when it opens. It is one of the long-lived responses of
``memfuse.server.streamclass``: the front door (``memfuse.server.gate``) runs it under a lease
that caps the streams per token and per replica and cuts it, with the last line
``{"error": <401 problem>}``, when its token is revoked (on any replica) or expires.
"""
from __future__ import annotations

import logging
import random
import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import Request
from starlette.types import Receive, Scope, Send

from memfuse.server import wakeups
from memfuse.server.service import Principal, Service, ServiceError

if TYPE_CHECKING:  # for the annotations only (longpoll imports this module)
    from memfuse.server.longpoll import FeedReads

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 20.0  # a line at least this often on an open stream
LIFETIME_SECONDS = 600.0  # a stream ends after this long (± LIFETIME_JITTER)
LIFETIME_JITTER = 0.1  # fraction of LIFETIME_SECONDS
TICK_SLOTS = 20  # streams are spread over this many slots, one woken per HEARTBEAT / TICK_SLOTS
NDJSON = b"application/x-ndjson"

_Lines = Callable[[], Awaitable[tuple[list[bytes], bool]]]  # (lines to send, more to read)


class _Open:
    """One open stream: its heartbeat slot and when it ends."""

    __slots__ = ("ends_at", "slot")

    def __init__(self, ends_at: float) -> None:
        self.slot = random.randrange(TICK_SLOTS)
        self.ends_at = ends_at


class Streams:
    """The open streams of one process and their shared heartbeat ticker.

    ``heartbeat``: seconds between ticks (every open stream sends a heartbeat line on each
    tick); ``lifetime``: seconds a stream lives (± ``LIFETIME_JITTER``). Each stream sits in one
    of ``TICK_SLOTS`` slots and the ticker wakes one slot every ``heartbeat / TICK_SLOTS`` s, so
    thousands of heartbeats are spread over the period instead of sent in one burst (which
    would delay a write's fan-out behind them). ``enabled`` False
    makes the app answer ``stream=true`` as if it did not know the parameter (a long-poll
    when ``wait`` is given, else the plain page): the operator's switch, and the tests' way
    of checking the clients' fallback. ``gens[slot]`` counts the ticks of each slot; ``open``
    the streams open now.
    Thread-safe where it says so; the rest runs on the event loop.
    """

    def __init__(self, svc: Service, *, heartbeat: float = HEARTBEAT_SECONDS,
                 lifetime: float = LIFETIME_SECONDS, enabled: bool = True) -> None:
        self.svc = svc
        self.heartbeat = float(heartbeat)
        self.lifetime = float(lifetime)
        self.enabled = enabled
        self.gens = [0] * TICK_SLOTS
        self._next_slot = 0
        self.open = 0
        self.lines_sent = 0  # for /metrics
        self._lock = threading.Lock()
        self._waiters: list[set[wakeups._Waiter]] = [set() for _ in range(TICK_SLOTS)]
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        svc.db.on_dispose(self.close)

    # ------------------------------------------------------------ the ticker

    def _start(self) -> None:
        if self._thread is not None or self._stop.is_set():
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="memfuse-heartbeat", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.heartbeat / TICK_SLOTS):
            self.tick()

    def tick(self) -> None:
        """Wake the streams of the next slot for their heartbeat (from any thread)."""
        with self._lock:
            slot = self._next_slot
            self._next_slot = (slot + 1) % TICK_SLOTS
            self.gens[slot] += 1
            waiters = list(self._waiters[slot])
        wakeups.wake_many(waiters)  # one hand-off to the event loop for the whole slot

    def _wake_all(self) -> None:
        with self._lock:
            waiters = [w for group in self._waiters for w in group]
        wakeups.wake_many(waiters)

    def close(self) -> None:
        """Stop the ticker thread (idempotent)."""
        self._stop.set()

    def _watch(self, slot: int, w: wakeups._Waiter) -> None:
        with self._lock:
            self._waiters[slot].add(w)

    def _unwatch(self, slot: int, w: wakeups._Waiter) -> None:
        with self._lock:
            self._waiters[slot].discard(w)

    def _add(self, o: _Open) -> None:
        self.open += 1

    def _remove(self, o: _Open) -> None:
        self.open -= 1

    # ------------------------------------------------------------ serving

    async def changes(self, reads: FeedReads, p: Principal, slug: str, after: int, *, limit: int,
                      content: bool, skip_actor: str | None) -> Callable[[Any, Any, Any], Awaitable[None]]:
        """Open a change-feed stream: checks access and the cursor first (raises
        ``ServiceError`` 404 / 410 / 401 before anything is sent), then returns the ASGI
        callable that streams (``await run(scope, receive, send)``)."""
        svc, notifier = self.svc, self.svc.notifier
        cursor = after
        name = slug  # the public name; ``slug`` becomes the store's key (memfuse.server.keys)

        async def check() -> None:
            if svc.cached_feed_key(p, name) is None:
                await anyio.to_thread.run_sync(svc.check_feed_access, p, name)

        async def lines() -> tuple[list[bytes], bool]:
            # one read (one page of at most ``limit``) per call: a long catch-up is sent page
            # by page, never gathered in memory
            nonlocal cursor
            if notifier.head(slug) == cursor:
                return [], False
            fr = await reads.read(slug, cursor, limit, content, skip_actor)
            if cursor > fr.top:
                raise ServiceError(410, "cursor_expired",
                                   f"cursor {cursor} is beyond this server's feed ({fr.top}); take a snapshot")
            page, raw = fr.page(skip_actor)
            out = [(raw if raw is not None else page.model_dump_json().encode()) + b"\n"] if page.changes else []
            moved = page.seq != cursor
            cursor = page.seq
            return out, fr.full and moved

        def heartbeat() -> bytes:  # ChangePage(changes=[], seq=cursor) as pydantic encodes it
            return b'{"changes":[],"seq":%d}\n' % cursor

        key = svc.cached_feed_key(p, name)
        slug = key if key is not None else await anyio.to_thread.run_sync(svc.check_feed_access, p, name)
        first = await lines()  # a 410 known now is a plain problem response
        return self._runner(lambda: notifier.subscribe(wakeups.FEED, slug, skip_actor),
                            check, lines, heartbeat, first, {"store": name})

    async def events(self, p: Principal, ws: str, after: int, *,
                     limit: int) -> Callable[[Any, Any, Any], Awaitable[None]]:
        """Open a workspace-event stream (like ``changes``; raises ``ServiceError`` 403 / 404
        / 401 before anything is sent)."""
        svc, notifier = self.svc, self.svc.notifier
        cursor = after

        async def check() -> None:
            if svc.cached_events_key(p, ws) is None:
                await anyio.to_thread.run_sync(svc.check_events_access, p, ws)

        # the workspace's key (memfuse.server.keys): what event bounds and wake-ups use
        cached = svc.cached_events_key(p, ws)
        key = cached if cached is not None else await anyio.to_thread.run_sync(svc.check_events_access, p, ws)

        async def lines() -> tuple[list[bytes], bool]:
            nonlocal cursor
            if notifier.no_events_after(key, cursor):
                return [], False
            at = cursor
            page = await anyio.to_thread.run_sync(lambda: svc.events_page(p, ws, at, limit))
            cursor = page.seq
            out = [page.model_dump_json().encode() + b"\n"] if page.events else []
            return out, len(page.events) >= limit and page.seq != at

        def heartbeat() -> bytes:  # EventPage(events=[], seq=cursor) as pydantic encodes it
            return b'{"events":[],"seq":%d}\n' % cursor

        first = await lines()
        return self._runner(lambda: notifier.subscribe(wakeups.EVENTS, key),
                            check, lines, heartbeat, first, {"workspace": ws})

    def _runner(self, subscribe: Callable[[], wakeups._Waiter],
                check: Callable[[], Awaitable[None]], lines: _Lines, heartbeat: Callable[[], bytes],
                first: tuple[list[bytes], bool], where: dict[str, str]) -> Callable[[Any, Any, Any], Awaitable[None]]:
        svc = self.svc
        ends_at = anyio.current_time() + self.lifetime * (1 + random.uniform(-LIFETIME_JITTER, LIFETIME_JITTER))

        async def run(scope: Scope, receive: Receive, send: Send) -> None:
            o = _Open(ends_at)
            self._add(o)
            self._start()
            sent_gen = self.gens[o.slot]
            ended = "lifetime"

            async def line(data: bytes) -> None:
                nonlocal sent_gen
                sent_gen = self.gens[o.slot]
                self.lines_sent += 1
                await send({"type": "http.response.body", "body": data, "more_body": True})

            async def body() -> None:
                nonlocal ended
                # the first line goes out at once (the current seq when there is nothing
                # to send): the client knows the stream is up before the first tick
                for data in first[0] or [heartbeat()]:
                    await line(data)
                waiter = subscribe()
                self._watch(o.slot, waiter)
                try:
                    while True:
                        svc.notifier.rearm(waiter)  # before looking: no commit is missed
                        await check()
                        out, more = await lines()
                        for data in out:
                            await line(data)
                        if svc.closing:
                            ended = "shutdown"
                            return
                        if anyio.current_time() >= o.ends_at:
                            return
                        if more:
                            continue  # the next page of a catch-up, without waiting
                        if self.gens[o.slot] != sent_gen:
                            await line(heartbeat())
                        await waiter.event.wait()
                finally:
                    svc.notifier.unsubscribe(waiter)
                    self._unwatch(o.slot, waiter)

            try:
                await send({"type": "http.response.start", "status": 200, "headers": [
                    (b"content-type", NDJSON), (b"cache-control", b"no-store"),
                    (b"x-accel-buffering", b"no"),  # proxies: pass lines on as they come
                    (b"x-memfuse-heartbeat", str(int(self.heartbeat) or 1).encode())]})
                try:
                    await _until_disconnect(Request(scope, receive), body)
                except TimeoutError:
                    raise  # the client does not read: nothing more can be sent (memfuse.server.gate)
                except Exception as e:  # noqa: BLE001 - every failure ends the stream with a line
                    ended = getattr(e, "code", None) or type(e).__name__
                    level = logging.WARNING if not isinstance(e, ServiceError) or e.status >= 500 else logging.INFO
                    log.log(level, "stream ended with an error line", extra={**where, "error": ended})
                    await send({"type": "http.response.body", "more_body": True,
                                "body": b'{"error":' + _problem_json(e) + b"}\n"})
                if _disconnected(scope):
                    log.debug("client left a stream", extra=where)
                    return
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                log.debug("stream ended", extra={**where, "reason": ended})
            finally:
                self._remove(o)

        return run


# ---------------------------------------------------------------- helpers


async def _until_disconnect(request: Request, body: Callable[[], Awaitable[Any]]) -> None:
    """Run ``body()``; when the client closes the connection first, cancel it, mark the
    scope disconnected and return. Exceptions of ``body`` propagate (not wrapped)."""
    error: Exception | None = None
    async with anyio.create_task_group() as tg:

        async def watch_disconnect() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            request.scope["memfuse.disconnected"] = True
            tg.cancel_scope.cancel()

        tg.start_soon(watch_disconnect)
        try:
            await body()
        except Exception as exc:
            error = exc
        tg.cancel_scope.cancel()
    if error is not None:
        raise error


def _disconnected(scope: Scope) -> bool:
    return bool(scope.get("memfuse.disconnected"))


def _problem_json(exc: Exception) -> bytes:
    """The problem object (RFC 9457) of a mid-stream failure, as the app would render it."""
    from memfuse.server.problems import exception_response as _exception_response

    return bytes(_exception_response(exc, {"method": "GET", "path": "stream"}).body)
