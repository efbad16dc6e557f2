"""The control plane's long-polls (``GET .../changes`` and ``GET .../events`` with ``wait``).

``FastPath`` serves well-formed long-polls, and streams (``stream=true``, served by
``memfuse.server.streams``), straight from ASGI (FastAPI serves the rest).

A long-poll subscribes to the ``Notifier`` *before* it looks at anything, so no commit between
its look and its wait is missed, then:

- looks without the database when it can: the ``Notifier`` knows each store's latest seq and
  each workspace's event bounds (kept by commit notes of this process and of the other
  replicas), and which tokens may read what. A cursor at the head has nothing to read: no
  query. An idle control plane therefore makes no database queries;
- otherwise reads, sharing one read among every waiter of the store at the same cursor (a
  write to a store watched by 2,000 sidecars costs one query, and one JSON encoding for those
  whose page is the same), and answers when there is something for this caller;
- sleeps until a commit concerns it (or ``wait`` ends, or the client leaves, or the server
  shuts down); never on a timer.

At the end of ``wait`` it answers the empty page, reading once more only when the head moved
past its cursor while it slept (versions of the actor it skips), so that ``seq`` moves past them.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from memfuse.defs import FEED_PAGE_MAX, INT64_MAX
from memfuse.models import ChangePage, EventPage
from memfuse.server import wakeups
from memfuse.server import routetable as table
from memfuse.server.service import MAX_WAIT_SECONDS, FeedRead, Principal, Service, ServiceError

log = logging.getLogger(__name__)

# The finished reads FeedReads keeps: they exist so that every waiter woken by one commit
# shares one read (and one JSON encoding), so a kept read is useful only while its store's
# head is the one it read up to (the others are dropped as the head moves) and only for the
# few (cursor, limit, content) keys those waiters ask at once. Bounded in bytes, since any
# token that may read a store chooses the keys (attack21 F1: 150 long-polls of distinct
# limits kept ~1 GB): 32 MiB holds the largest page (8 MiB of content, its JSON and 1,000
# changes, ~20 MiB) with a smaller one beside it; the least recently used goes first.
SHARED_READS_BYTES = 32 * 1024 * 1024
SHARED_READS_MAX = 4096  # reads kept at most, however small
_ENTRY_BYTES = 1024  # what a kept read costs besides its changes (key, objects, its page's)

_Key = tuple[str, int, int, bool]  # (store key, cursor, limit, with content)


class _Flight:
    __slots__ = ("done", "result", "error")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.result: FeedRead | None = None
        self.error: BaseException | None = None


class _Kept:
    __slots__ = ("read", "cost")

    def __init__(self, read: FeedRead, cost: int) -> None:
        self.read = read
        self.cost = cost


class FeedReads:
    """Single-flight change-feed reads: one ``Service.feed_read`` per (store, cursor, limit,
    content) at a time; a finished read is kept while the store's head is still the one it
    read up to (so every waiter woken by one commit shares it), within ``max_bytes`` (its
    changes, ``FeedRead.nbytes``, and its JSON once encoded) and ``max_entries``, the least
    recently used dropped first. A read whose head moved is dropped when the ``Notifier``
    learns the new head (``on_heads``), or found so. ``read`` runs on the event loop; the
    kept reads are guarded by a lock (the heads move in any thread)."""

    def __init__(self, svc: Service, *, max_bytes: int = SHARED_READS_BYTES,
                 max_entries: int = SHARED_READS_MAX) -> None:
        self.svc = svc
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._flights: dict[_Key, _Flight] = {}
        self._lock = threading.Lock()
        self._done: OrderedDict[_Key, _Kept] = OrderedDict()  # least recently used first
        self._by_store: dict[str, set[_Key]] = {}  # the keys of _done of each store
        self.bytes = 0  # what the kept reads hold (``_Kept.cost`` summed)
        self.reads = 0  # database reads made (for tests and metrics)
        svc.notifier.on_heads.append(self._heads_moved)

    @property
    def kept(self) -> int:
        """Finished reads kept now."""
        return len(self._done)

    async def read(self, slug: str, after: int, limit: int, content: bool, skip: str | None = None) -> FeedRead:
        """The shared read of ``slug``'s feed after ``after`` (``FeedRead``; its ``page(skip)``
        is what the caller answers). ``skip``: the ``feed_key`` the caller leaves out
        (``skip_writer`` / ``skip_actor``); with ``content``, when the store's latest commit
        was the caller's own (``Notifier.last_writer``), the caller's own versions that lead
        the read are passed over by seq and writer first (``Service.feed_own_run``), so their
        content is never read: the read starts after them, or is a ``FeedRead`` with no
        change when nothing else follows (its page moves the cursor past them)."""
        key = (slug, after, limit, content)
        hit = self._hit(key)
        if hit is not None:
            return hit
        if content and skip is not None and self.svc.notifier.last_writer(slug) == skip:
            # the store's latest commit was the reader's own: it may be behind a run of its
            # own versions. Otherwise (woken by another writer: every reader of a store woken
            # by one commit) no read of its own is made, and the content read stays shared
            after, own = await anyio.to_thread.run_sync(
                lambda: self.svc.feed_own_run(slug, after, skip, limit=limit))
            if own is not None:
                return own
            key = (slug, after, limit, content)
            hit = self._hit(key)
            if hit is not None:
                return hit
        flight = self._flights.get(key)
        if flight is None:
            flight = self._flights[key] = _Flight()
            try:
                self.reads += 1

                def run() -> tuple[FeedRead, int]:
                    fr = self.svc.feed_read(slug, after, limit=limit, with_content=content)
                    return fr, fr.nbytes()

                fr, cost = await anyio.to_thread.run_sync(run)
                flight.result = fr
                self._keep(key, fr, cost)
            except BaseException as e:
                flight.error = e
                raise
            finally:
                del self._flights[key]
                flight.done.set()
        else:
            await flight.done.wait()
        if flight.error is not None:
            if isinstance(flight.error, Exception):
                raise flight.error
            raise ServiceError(503, "unavailable", "the shared read was cancelled; retry",
                               headers={"Retry-After": "1"})
        assert flight.result is not None
        return flight.result

    # ------------------------------------------------------------ the kept reads

    def _hit(self, key: _Key) -> FeedRead | None:
        with self._lock:
            k = self._done.get(key)
            if k is None:
                return None
            if self.svc.notifier.head(key[0]) == k.read.store_top:
                self._done.move_to_end(key)
                return k.read
            self._drop(key)
            return None

    def _keep(self, key: _Key, fr: FeedRead, cost: int) -> None:
        """Keep ``fr``, read for ``key``, unless its store's head moved since (it then serves
        only the waiters of its flight); drop the reads of that store at an older head."""
        store = key[0]
        with self._lock:
            if self.svc.notifier.head(store) != fr.store_top:
                return
            for other in [o for o in self._by_store.get(store, ()) if self._done[o].read.store_top != fr.store_top]:
                self._drop(other)
            if key in self._done:
                self._drop(key)
            kept = self._done[key] = _Kept(fr, _ENTRY_BYTES + cost)
            self._by_store.setdefault(store, set()).add(key)
            self.bytes += kept.cost
            fr.on_encoded = lambda n: self._grow(key, kept, n)
            self._evict()

    def _grow(self, key: _Key, kept: _Kept, n: int) -> None:
        """A kept read's page was encoded (``n`` bytes of JSON): count them."""
        with self._lock:
            if self._done.get(key) is kept:
                kept.cost += n
                self.bytes += n
                self._evict()

    def _evict(self) -> None:  # under the lock
        while self._done and (self.bytes > self.max_bytes or len(self._done) > self.max_entries):
            self._drop(next(iter(self._done)))

    def _drop(self, key: _Key) -> None:  # under the lock
        kept = self._done.pop(key)
        kept.read.on_encoded = None  # the cycle read -> hook -> _Kept -> read: freed at once, not by a later gc
        self.bytes -= kept.cost
        keys = self._by_store[key[0]]
        keys.discard(key)
        if not keys:
            del self._by_store[key[0]]

    def _heads_moved(self, moved: dict[str, int] | None) -> None:
        """``Notifier.on_heads``: drop the reads at a head no longer their store's (from any
        thread; None: every head forgotten, every read dropped)."""
        if moved is not None and not any(store in self._by_store for store in moved):
            return  # the usual commit: nothing kept of its stores (no lock taken)
        with self._lock:
            if moved is None:
                for key in list(self._done):
                    self._drop(key)
                return
            for store, head in moved.items():
                for key in [k for k in self._by_store.get(store, ()) if self._done[k].read.store_top != head]:
                    self._drop(key)


async def _until_disconnect(request: Request, body: Callable[[], Awaitable[Any]]) -> Any:
    """Run ``body()``; when the client closes the connection first, cancel it and return None."""
    result: Any = None
    error: Exception | None = None
    async with anyio.create_task_group() as tg:

        async def watch_disconnect() -> None:
            # A GET has no body to read: the next messages are the end of the (empty) body and,
            # when the client closes the connection, http.disconnect.
            while (await request.receive())["type"] != "http.disconnect":
                pass
            log.debug("client left a long-poll on %s", request.url.path)
            tg.cancel_scope.cancel()

        tg.start_soon(watch_disconnect)
        try:
            result = await body()
        except Exception as exc:  # re-raised below, not wrapped in an ExceptionGroup
            error = exc
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return result


def _expired(after: int, top: int) -> ServiceError:
    return ServiceError(410, "cursor_expired", f"cursor {after} is beyond this server's feed ({top}); take a snapshot")


async def changes(svc: Service, reads: FeedReads, request: Request, p: Principal, slug: str, after: int,
                  wait: float, *, limit: int, content: bool, skip_actor: str | None) -> Response:
    """Answer ``GET /v1/stores/{slug}/changes`` with ``wait`` > 0 (docs/API.md): the page as
    JSON, or 204 when the client left. Raises ``ServiceError`` (404 not readable, 410)."""
    notifier = svc.notifier
    # from here ``slug`` is the store's key (memfuse.server.keys): what reads and wake-ups use
    # (mypy infers run_sync's result from the left operand, str | None; check_feed_access returns str)
    slug = svc.cached_feed_key(p, slug) or await anyio.to_thread.run_sync(  # type: ignore[assignment]
        svc.check_feed_access, p, slug)
    deadline = anyio.current_time() + min(wait, MAX_WAIT_SECONDS)
    cursor = after

    async def answer(final: bool) -> tuple[ChangePage, bytes | None] | None:
        nonlocal cursor
        while True:
            if notifier.head(slug) == cursor:
                return None  # nothing after the cursor: no read
            fr = await reads.read(slug, cursor, limit, content, skip_actor)
            if cursor > fr.top:
                raise _expired(cursor, fr.top)
            page, raw = fr.page(skip_actor)
            if page.changes or final:
                return page, raw
            cursor = page.seq
            if not fr.full:
                return None

    async def attempt() -> Response | None:
        got = await answer(False)
        return None if got is None else _page_response(*got)

    async def body() -> Response:
        found = await _woken_until(svc, wakeups.FEED, slug, skip_actor, deadline, attempt)
        if found is not None:
            return found
        got = await answer(True)
        if got is not None:
            return _page_response(*got)
        return _page_response(ChangePage(changes=[], seq=cursor), None)

    result = await _until_disconnect(request, body)
    return result if result is not None else Response(status_code=204)


async def events(svc: Service, request: Request, p: Principal, ws: str, after: int, wait: float,
                 *, limit: int) -> Response:
    """Answer ``GET /v1/workspaces/{ws}/events`` with ``wait`` > 0: the page, or 204 when the
    client left. Raises ``ServiceError`` (403, 404)."""
    notifier = svc.notifier
    # the workspace's key (memfuse.server.keys): what event bounds and wake-ups use
    cached = svc.cached_events_key(p, ws)
    key = cached if cached is not None else await anyio.to_thread.run_sync(svc.check_events_access, p, ws)
    deadline = anyio.current_time() + min(wait, MAX_WAIT_SECONDS)

    async def attempt() -> Response | None:
        if not notifier.no_events_after(key, after):
            page = await anyio.to_thread.run_sync(lambda: svc.events_page(p, ws, after, limit))
            if page.events:
                return _page_response(page, None)
        return None

    async def body() -> Response:
        found = await _woken_until(svc, wakeups.EVENTS, key, None, deadline, attempt)
        if found is not None:
            return found
        if notifier.no_events_after(key, after):
            return _page_response(EventPage(events=[], seq=after), None)
        return _page_response(await anyio.to_thread.run_sync(lambda: svc.events_page(p, ws, after, limit)), None)

    result = await _until_disconnect(request, body)
    return result if result is not None else Response(status_code=204)


async def _woken_until(svc: Service, kind: str, key: str, skip_actor: str | None, deadline: float,
                       attempt: Callable[[], Awaitable[Response | None]]) -> Response | None:
    """The wait of a long-poll: ``attempt()`` now, and again each time a commit of ``kind``
    (``wakeups.FEED`` / ``wakeups.EVENTS``) on ``key`` wakes it (``skip_actor``'s own commits
    left out), until it gives a response (returned), ``deadline`` (``anyio.current_time()``)
    passes or the service is closing (None: the caller answers its final page). A waiter is
    subscribed before each attempt, so a commit between the attempt and the wait is not
    missed; it is unsubscribed however the attempt ends (its exception propagates)."""
    notifier = svc.notifier
    while True:
        waiter = notifier.subscribe(kind, key, skip_actor)
        try:
            got = await attempt()
            if got is not None:
                return got
            remaining = deadline - anyio.current_time()
            if remaining <= 0 or svc.closing:
                return None
            with anyio.move_on_after(remaining):
                await waiter.event.wait()
        finally:
            notifier.unsubscribe(waiter)


def _page_response(page: ChangePage | EventPage, raw: bytes | None) -> Response:
    body = raw if raw is not None else page.model_dump_json().encode()
    return Response(content=body, media_type="application/json")


# ---------------------------------------------------------------- the front door


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


class FastPath:
    """Serves well-formed long-polls straight from ASGI, without FastAPI's routing, dependency
    injection and middleware layers (about half the CPU of a woken long-poll, which matters
    when one write answers thousands of them). ``await fast(scope, receive, send)`` returns
    False, having sent nothing, for anything it does not serve plainly: another route, a
    parameter FastAPI must validate, a token not in the cache (the database must be asked);
    FastAPI then serves the request with the same handlers. Responses and refusals are the
    same either way (``problem`` renders a ``ServiceError`` as the app's handler does)."""

    def __init__(self, svc: Service, reads: FeedReads, problem: Callable[[Exception, Any], Any],
                 streams: Any = None) -> None:
        self.svc = svc
        self.reads = reads
        self.problem = problem
        self.streams = streams  # memfuse.server.streams.Streams, or None

    @staticmethod
    def _params(scope: Scope) -> dict[str, str] | None:
        from urllib.parse import parse_qsl

        try:
            return dict(parse_qsl(scope.get("query_string", b"").decode("ascii"), strict_parsing=False))
        except (UnicodeDecodeError, ValueError):
            return None

    def _principal(self, scope: Scope) -> tuple[Principal, str] | None:
        p = scope.get("memfuse.principal")  # authenticated by the front door (memfuse.server.gate)
        if p is not None:
            return p, ""
        token = instance = None
        for k, v in scope.get("headers", ()):
            if k == b"authorization":
                scheme, _, cred = v.decode("latin-1").partition(" ")
                if scheme.lower() != "bearer" or not cred.strip():
                    return None
                token = cred.strip()
            elif k == b"x-memfuse-instance":
                instance = v.decode("latin-1")
        if token is None:
            return None
        try:
            p = self.svc.authenticate_cached(token, instance)
        except ServiceError:
            return None
        return None if p is None else (p, token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> bool:
        m = table.match(scope["method"], scope["path"])  # the app's route table
        if m is None or m.route not in (table.CHANGES, table.EVENTS):
            return False
        is_changes = m.route is table.CHANGES
        target = m.params["store"] if is_changes else m.params["ws"]
        q = self._params(scope)
        if q is None:
            return False
        try:
            after = int(q.get("after", "0"))
            wait = float(q.get("wait", "0"))
            limit = int(q.get("limit", str(FEED_PAGE_MAX)))
        except ValueError:
            return False
        stream = q.get("stream", "false").lower()
        if stream not in _TRUE and stream not in _FALSE:
            return False
        stream_on = stream in _TRUE and self.streams is not None and self.streams.enabled
        if not 0 <= after <= INT64_MAX or not (stream_on or 0 < wait < float("inf")) or not (1 <= limit <= FEED_PAGE_MAX):
            return False
        content = q.get("content", "true").lower()
        if content not in _TRUE and content not in _FALSE:
            return False
        auth = self._principal(scope)
        if auth is None:
            return False
        if self.svc.token_upkeep_due():  # token bookkeeping: a few statements a minute (tokens.py)
            await anyio.to_thread.run_sync(self.svc.token_upkeep)
        p, token = auth
        request = Request(scope, receive)
        if stream_on:
            try:
                if is_changes:
                    run = await self.streams.changes(
                        self.reads, p, target, after, limit=limit, content=content in _TRUE,
                        skip_actor=q.get("skip_writer") or q.get("skip_actor") or None)
                else:
                    run = await self.streams.events(p, target, after, limit=limit)
            except Exception as e:  # refused before the first byte: the usual problem response
                await self.problem(e, scope)(scope, receive, send)
                return True
            await run(scope, receive, send)
            return True
        try:
            if is_changes:
                response = await changes(self.svc, self.reads, request, p, target, after, wait, limit=limit,
                                         content=content in _TRUE, skip_actor=q.get("skip_writer") or q.get("skip_actor") or None)
            else:
                response = await events(self.svc, request, p, target, after, wait, limit=limit)
        except Exception as e:  # rendered as the app's exception handlers would
            response = self.problem(e, scope)
        await response(scope, receive, send)
        return True
