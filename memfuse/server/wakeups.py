"""Wake-ups of the control plane's long-polls without polling the database.

Three parts:

- ``Notifier`` — the waiters of this process (change-feed and workspace-event long-polls),
  woken right after the commits that concern them, plus what this process knows about the
  database without asking it: the latest change-feed ``seq`` of each store (its *head*), the
  latest event ``seq`` of each workspace, and which (token scope, store / workspace) pairs were
  found readable. A long-poll whose cursor is the head has nothing to read, so it waits
  without a query; an idle control plane makes no database queries at all.
- ``Bus`` — carries commit notes between processes sharing one database. On PostgreSQL every
  write transaction sends ``pg_notify`` (delivered at commit, and only if it commits) and one
  thread per process holds a ``LISTEN`` connection (psycopg 3) that hands other replicas'
  notes to the ``Notifier``. NOTIFY is lost while that connection is down, so the ``Notifier``
  trusts its cache only while it is connected; on every (re)connect it forgets the cache and
  wakes every waiter to read the database once; while it is down one shared scan every
  ``FALLBACK_SECONDS`` wakes the stores and workspaces that changed. On an SQLite file (one
  ``memfuse serve``; CLI commands in local mode may write it too) a thread checks ``PRAGMA
  data_version`` twice a second (it reads the WAL index, no table) and scans only when another
  connection committed. In-memory SQLite has one process by construction: nothing to watch.
- Topics: ``note_topic(topic, data)`` inside a write transaction publishes ``(topic, data)``
  to every process's ``Notifier.on_topic(topic, callback)`` after the commit (this process's
  callbacks run right after the commit; other replicas' when the NOTIFY arrives). Used for
  token revocation (``TOKEN_REVOKED``: data is the token's sha256).

Notes are collected per write transaction in a thread-local list (``begin_notes`` /
``note_feed`` / ``note_events`` / ``note_acl`` / ``note_topic`` / ``take_notes``): a write runs
in one worker thread from start to commit.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import sniffio

if TYPE_CHECKING:  # for the annotations only
    import psycopg
    import trio
    from sqlalchemy.engine import Connection

    from memfuse.server.db import Database

log = logging.getLogger(__name__)

FALLBACK_SECONDS = 5.0  # shared scan period while the PostgreSQL listener is down
SQLITE_WATCH_SECONDS = 0.5  # PRAGMA data_version period on an SQLite file
RECONNECT_MAX_SECONDS = 5.0
PAYLOAD_MAX = 7000  # bytes; PostgreSQL refuses NOTIFY payloads of 8000 bytes or more
TOKEN_REVOKED = "token_revoked"

FEED, EVENTS = "feed", "events"


# ---------------------------------------------------------------- notes of one transaction


@dataclass(frozen=True, slots=True)
class Note:
    """What one commit changed. ``kind``: ``"f"`` (versions of store ``key`` up to ``seq``, all
    written by ``actor``, or by several actors when ``actor`` is None), ``"e"`` (events of
    workspace ``key`` up to ``seq``), ``"E"`` (events of many workspaces up to ``seq``),
    ``"a"`` (attachments, stores or tokens changed: access answers may differ), ``"t"``
    (topic ``key`` with ``data``), ``"*"`` (anything: everyone re-reads)."""

    kind: str
    key: str = ""
    seq: int = 0
    actor: str | None = None
    data: str = ""


_tx = threading.local()


def begin_notes() -> None:
    """Start collecting notes for the write transaction running in this thread."""
    _tx.notes = []


def _add(note: Note) -> None:
    notes = getattr(_tx, "notes", None)
    if notes is not None:
        notes.append(note)


def notes_mark() -> int:
    """How many notes the running transaction has collected (for ``notes_rollback``)."""
    notes = getattr(_tx, "notes", None)
    return len(notes) if notes is not None else 0


def notes_rollback(mark: int) -> None:
    """Forget the notes collected after ``notes_mark()`` returned ``mark`` (a savepoint of
    the transaction was rolled back: what it wrote never commits)."""
    notes = getattr(_tx, "notes", None)
    if notes is not None:
        del notes[mark:]


def version_seq_since(mark: int) -> int | None:
    """The highest seq of the versions the running transaction wrote after
    ``notes_mark()`` returned ``mark`` (0: since ``begin_notes``), None when it wrote none:
    the ``Memfuse-Seq`` of a write answered without a body (a delete's 204)."""
    notes = getattr(_tx, "notes", None) or []
    seqs = [n.seq for n in notes[mark:] if n.kind == "f"]
    return max(seqs) if seqs else None


def note_feed(store: str, seq: int, actor: str) -> None:
    """The transaction wrote a version of ``store`` with ``seq`` by ``actor``."""
    _add(Note("f", store, seq, actor))


def note_events(workspace: str, seq: int) -> None:
    """The transaction wrote an event of ``workspace`` with ``seq``."""
    _add(Note("e", workspace, seq))


def note_acl() -> None:
    """The transaction changed attachments, stores or tokens."""
    _add(Note("a"))


def note_topic(topic: str, data: str) -> None:
    """Publish ``data`` on ``topic`` to every process once the transaction commits (see
    ``Notifier.on_topic``). ``topic`` and ``data`` are short strings (the whole NOTIFY payload
    of a transaction stays under 7,000 bytes; beyond that receivers get a reset instead)."""
    _add(Note("t", topic, data=data))


def take_notes() -> tuple[list[Note], list[int], list[int]]:
    """The notes collected since ``begin_notes``, merged (one per store / workspace, with the
    highest seq; a store written by several actors gets actor None), with every version seq
    and every event seq written; collection stops."""
    notes = getattr(_tx, "notes", None) or []
    _tx.notes = None
    feeds: dict[str, Note] = {}
    events: dict[str, int] = {}
    out: list[Note] = []
    vseqs: list[int] = []
    eseqs: list[int] = []
    acl = False
    for n in notes:
        if n.kind == "f":
            vseqs.append(n.seq)
            old = feeds.get(n.key)
            if old is None:
                feeds[n.key] = n
            else:
                feeds[n.key] = Note("f", n.key, max(old.seq, n.seq), old.actor if old.actor == n.actor else None)
        elif n.kind == "e":
            eseqs.append(n.seq)
            events[n.key] = max(events.get(n.key, 0), n.seq)
        elif n.kind == "a":
            acl = True
        else:
            out.append(n)
    out += feeds.values()
    out += [Note("e", ws, seq) for ws, seq in events.items()]
    if acl:
        out.append(Note("a"))
    return out, vseqs, eseqs


# ---------------------------------------------------------------- waiters


class _Waiter:
    """An event one long-poll waits on; set from any thread, once (later wake-ups are no-ops,
    so a burst of commits costs the event loop one wake-up). ``kind`` is ``FEED`` (``key`` a
    store, ``skip_actor`` the actor whose versions it leaves out) or ``EVENTS`` (``key`` a
    workspace). ``event`` is the event loop's own event type (``trio.Event`` under trio, an
    ``anyio.Event`` otherwise): both have ``wait``, ``set`` and ``is_set``."""

    __slots__ = ("event", "kind", "key", "skip_actor", "_woken", "_loop", "_new_event")

    def __init__(self, kind: str, key: str, skip_actor: str | None = None) -> None:
        self.kind = kind
        self.key = key
        self.skip_actor = skip_actor
        self._woken = False
        if sniffio.current_async_library() == "trio":
            import trio

            # trio's own Event: a fifth of the cost of anyio's wrapper, and a stream makes
            # one per wake-up (Notifier.rearm)
            self._new_event: Callable[[], Any] = trio.Event
            self._loop: Any = _TrioLoop.of(trio.lowlevel.current_trio_token())
        else:
            self._new_event = anyio.Event
            self._loop = _AsyncioLoop.of(asyncio.get_running_loop())
        self.event = self._new_event()

    def wake(self) -> None:
        """Set the event (from any thread); only the first call does anything."""
        wake_many((self,))


class _TrioLoop:
    """Posts callbacks into one trio run from any thread."""

    __slots__ = ("post",)
    _known: dict[int, _TrioLoop] = {}

    def __init__(self, token: Any) -> None:
        self.post: Callable[..., object] = token.run_sync_soon

    @classmethod
    def of(cls, token: Any) -> _TrioLoop:
        loop = cls._known.get(id(token))
        if loop is None or getattr(loop.post, "__self__", None) is not token:
            if len(cls._known) > 64:
                cls._known.clear()
            loop = cls._known[id(token)] = cls(token)
        return loop


class _AsyncioLoop:
    """Posts callbacks into one asyncio loop from any thread."""

    __slots__ = ("post",)
    _known: dict[int, _AsyncioLoop] = {}

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.post: Callable[..., object] = loop.call_soon_threadsafe

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _AsyncioLoop:
        known = cls._known.get(id(loop))
        if known is None or getattr(known.post, "__self__", None) is not loop:
            if len(cls._known) > 64:
                cls._known.clear()
            known = cls._known[id(loop)] = cls(loop)
        return known


def loop_poster() -> Callable[..., object]:
    """``post(fn, *args)`` that runs ``fn(*args)`` soon on the calling event loop (trio or
    asyncio), from any thread. Call it on the event loop; ``post`` raises ``RuntimeError``
    once that loop has finished."""
    if sniffio.current_async_library() == "trio":
        import trio

        return _TrioLoop.of(trio.lowlevel.current_trio_token()).post
    return _AsyncioLoop.of(asyncio.get_running_loop()).post


def _set_all(events: list[trio.Event | anyio.Event]) -> None:
    for e in events:
        e.set()


def wake_many(waiters: Iterable[_Waiter]) -> None:
    """Set the events of ``waiters`` (from any thread) with one call into each event loop
    (one thread-to-loop hand-off for a commit that wakes thousands of waiters, instead of
    one each). A waiter already woken since its last ``Notifier.rearm`` is skipped; the event
    set is the one the waiter had when this was called."""
    batches: dict[int, tuple[Any, list[trio.Event | anyio.Event]]] = {}
    for w in waiters:
        if w._woken:
            continue
        w._woken = True
        b = batches.get(id(w._loop))
        if b is None:
            b = batches[id(w._loop)] = (w._loop, [])
        b[1].append(w.event)
    for loop, events in batches.values():
        try:
            loop.post(_set_all, events)
        except RuntimeError:  # the loop has finished (trio.RunFinishedError is one)
            pass


@dataclass(frozen=True, slots=True)
class CacheStamp:
    """When a database read began, for ``Notifier.learn_*``: what it read may be remembered
    only if nothing that could make it stale happened since (no reconnect, no access change)."""

    epoch: int
    acl_gen: int


class Notifier:
    """The long-poll waiters of this process and what it knows of the database's heads.

    Waiters: ``subscribe(kind, key, skip_actor)`` before reading the database (so no commit
    between the read and the wait is missed), wait on ``waiter.event``, ``unsubscribe`` in a
    ``finally``. ``committed(notes)`` wakes the waiters a commit concerns: a store's feed
    waiters, except those skipping the only actor that wrote; a workspace's event waiters.

    Cache: ``head(store)``, ``event_bounds(ws)`` and ``readable(key)`` answer without the
    database, or None when unknown or not trusted (``trusted`` False: the cross-process bus is
    not connected). Reads remember what they found with ``learn_*`` and the ``stamp()`` taken
    before they began. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: set[_Waiter] = set()
        self._by_key: dict[tuple[str, str], set[_Waiter]] = {}
        self.trusted = True  # set by the Bus: False while commits of others could be missed
        self._epoch = 0
        self._acl_gen = 0
        self._heads: dict[str, int] = {}  # store → latest version seq (exact)
        # store → (seq, feed key) of the latest commit of its versions whose note this process
        # saw (key None: several writers in one commit); a hint only (``last_writer``), never
        # a bound: kept by the notes' seqs whether or not the heads are trusted or were
        # learnt first from a read
        self._last_writer: dict[str, tuple[int, str | None]] = {}
        self._ev_ws: dict[str, int] = {}  # workspace → upper bound of its latest event seq
        self._ev_top = 0  # lower bound of the latest event seq of all
        self._readable: set[tuple[str, str, str]] = set()  # (scope, kind, key) found readable
        self._topics: dict[str, list[Callable[[str], None]]] = {}
        self.wakeups = 0  # waiters woken (a counter for /metrics)
        self.on_subscribe: Callable[[], None] | None = None  # the Bus starts lazily
        self.on_reset: list[Callable[[], None]] = []  # called by reset(): forget other caches too
        # called with the heads that moved ({store: new latest seq}), or None when every head
        # was forgotten, outside the lock, from whichever thread moved them: the caches of
        # what a head made true drop what can no longer be served (longpoll.FeedReads)
        self.on_heads: list[Callable[[dict[str, int] | None], None]] = []
        self.track_own = False  # set by a Bus that scans (an SQLite file)
        self._own_versions: set[int] = set()
        self._own_events: set[int] = set()

    # ------------------------------------------------------------ waiters

    def subscribe(self, kind: str, key: str, skip_actor: str | None = None) -> _Waiter:
        """A new waiter for the next commit that concerns it."""
        if self.on_subscribe is not None:
            self.on_subscribe()
        w = _Waiter(kind, key, skip_actor)
        with self._lock:
            self._waiters.add(w)
            self._by_key.setdefault((kind, key), set()).add(w)
        return w

    def rearm(self, w: _Waiter) -> None:
        """Make a subscribed waiter wait for the next commit again (a stream's one waiter for
        its whole life, instead of a new one per wake-up). Call it before looking at what
        changed, on the event loop; a commit after it sets the new event."""
        w.event = w._new_event()
        w._woken = False

    def unsubscribe(self, w: _Waiter) -> None:
        """Forget ``w`` (idempotent)."""
        with self._lock:
            self._waiters.discard(w)
            group = self._by_key.get((w.kind, w.key))
            if group is not None:
                group.discard(w)
                if not group:
                    del self._by_key[(w.kind, w.key)]

    @property
    def waiting(self) -> int:
        """Long-polls waiting now."""
        return len(self._waiters)

    def wake_all(self) -> None:
        """Wake every waiter (shutdown; after a reconnect)."""
        with self._lock:
            waiters = list(self._waiters)
        self._wake(waiters)

    def _wake(self, waiters: list[_Waiter]) -> None:
        wake_many(waiters)
        self.wakeups += len(waiters)

    # ------------------------------------------------------------ commits

    def committed(self, notes: Iterable[Note], *, local: bool = True,
                  own: tuple[Iterable[int], Iterable[int]] | None = None) -> None:
        """Apply the notes of one commit (this process's when ``local``, else another's): learn
        the new heads, forget access answers when access changed, wake the waiters concerned,
        run topic callbacks. ``own``: the version and event seqs this process wrote, kept
        while ``track_own`` is set so that a scan can tell them from other processes'."""
        wake: list[_Waiter] = []
        topics: list[Note] = []
        moved: dict[str, int] | None = {}
        with self._lock:
            if own is not None and self.track_own:
                self._own_versions.update(own[0])
                self._own_events.update(own[1])
            for n in notes:
                if n.kind == "f":
                    if n.seq >= self._last_writer.get(n.key, (-1, None))[0]:
                        self._last_writer[n.key] = (n.seq, n.actor)
                    if (local or self.trusted) and n.seq > self._heads.get(n.key, -1):
                        self._heads[n.key] = n.seq
                        if moved is not None:
                            moved[n.key] = n.seq
                    for w in self._by_key.get((FEED, n.key), ()):
                        if n.actor is None or w.skip_actor != n.actor:
                            wake.append(w)
                elif n.kind == "e":
                    if local or self.trusted:
                        self._ev_ws[n.key] = max(self._ev_ws.get(n.key, 0), n.seq)
                        self._ev_top = max(self._ev_top, n.seq)
                    wake.extend(self._by_key.get((EVENTS, n.key), ()))
                elif n.kind == "E":  # events of too many workspaces to name
                    self._ev_ws.clear()
                    self._ev_top = max(self._ev_top, n.seq)
                    for (kind, _), group in self._by_key.items():
                        if kind == EVENTS:
                            wake.extend(group)
                elif n.kind == "a":
                    self._acl_gen += 1
                    self._readable.clear()
                elif n.kind == "t":
                    topics.append(n)
                elif n.kind == "*":
                    self._forget()
                    moved = None
                    wake.extend(self._waiters)
        if moved is None or moved:
            self._heads_moved(moved)
        self._wake(wake)
        for n in topics:
            for cb in self._topics.get(n.key, ()):
                try:
                    cb(n.data)
                except Exception:
                    log.exception("topic callback failed", extra={"topic": n.key})

    def take_own(self, versions_after: int, events_after: int) -> tuple[set[int], set[int]]:
        """The version / event seqs this process wrote beyond the given seqs (and forget those
        at or below them)."""
        with self._lock:
            self._own_versions = {q for q in self._own_versions if q > versions_after}
            self._own_events = {q for q in self._own_events if q > events_after}
            return set(self._own_versions), set(self._own_events)

    def reset(self, *, trusted: bool) -> None:
        """Forget everything cached (a new epoch), set ``trusted``, wake every waiter so it
        reads the database once. Called by the Bus on (re)connect and disconnect."""
        with self._lock:
            self.trusted = trusted
            self._forget()
        self._heads_moved(None)
        for fn in self.on_reset:
            try:
                fn()
            except Exception:
                log.exception("reset callback failed")
        self.wake_all()

    def _heads_moved(self, moved: dict[str, int] | None) -> None:
        for fn in self.on_heads:
            try:
                fn(moved)
            except Exception:
                log.exception("heads callback failed")

    def _forget(self) -> None:
        self._epoch += 1
        self._acl_gen += 1
        self._heads.clear()
        # (``_last_writer`` stays: a hint; a stale one costs a small read or a content read,
        # never a wrong answer)
        self._ev_ws.clear()
        self._ev_top = 0
        self._readable.clear()

    def on_topic(self, topic: str, callback: Callable[[str], None]) -> None:
        """Call ``callback(data)`` for every ``note_topic(topic, data)`` committed by any
        process on this database (from a worker or the listener thread: keep it short)."""
        with self._lock:
            self._topics.setdefault(topic, []).append(callback)

    # ------------------------------------------------------------ cache

    def stamp(self) -> CacheStamp:
        """Take before a database read whose result may be remembered."""
        return CacheStamp(self._epoch, self._acl_gen)

    def head(self, store: str) -> int | None:
        """The store's latest version seq, if known and trusted."""
        if not self.trusted:
            return None
        return self._heads.get(store)

    def last_writer(self, store: str) -> str | None:
        """The feed key (``changes.feed_key``) of the latest commit of ``store``'s versions this
        process learnt, None when unknown or several wrote in it. A hint for the change feed's
        readers (``FeedReads.read``: whether a reader may be behind versions of its own), not
        a fact about the database."""
        return self._last_writer.get(store, (-1, None))[1]

    def event_bounds(self, ws: str) -> tuple[int, int] | None:
        """``(upper bound of ws's latest event seq, lower bound of the latest event seq)`` if
        known and trusted: a cursor between the two has no events to read."""
        if not self.trusted:
            return None
        with self._lock:
            w = self._ev_ws.get(ws)
            return None if w is None else (w, self._ev_top)

    def no_events_after(self, ws: str, seq: int) -> bool:
        """Whether the cache knows workspace ``ws`` has no event after ``seq`` (a cursor
        between the two ``event_bounds``): a long-poll or stream of its events needs no read."""
        bounds = self.event_bounds(ws)
        return bounds is not None and bounds[0] <= seq <= bounds[1]

    def readable(self, scope: str, kind: str, key: str) -> bool:
        """Whether ``scope`` (a token scope) was found allowed to read ``key`` (a store for
        ``FEED``, a workspace for ``EVENTS``) since access last changed."""
        return self.trusted and (scope, kind, key) in self._readable

    def learn_head(self, store: str, seq: int, stamp: CacheStamp) -> None:
        """A read begun at ``stamp`` found the store's latest version seq ``seq``."""
        with self._lock:
            if stamp.epoch != self._epoch or not self.trusted or seq <= self._heads.get(store, -1):
                return
            self._heads[store] = seq
        self._heads_moved({store: seq})

    def learn_events(self, ws: str, ws_upper: int, top_lower: int, stamp: CacheStamp) -> None:
        """A read begun at ``stamp`` found no event of ``ws`` beyond ``ws_upper`` and the latest
        event seq at least ``top_lower``."""
        with self._lock:
            if stamp.epoch == self._epoch and self.trusted:
                self._ev_ws[ws] = max(self._ev_ws.get(ws, 0), ws_upper)
                self._ev_top = max(self._ev_top, top_lower)

    def learn_readable(self, scope: str, kind: str, key: str, stamp: CacheStamp) -> None:
        """A read begun at ``stamp`` found ``scope`` allowed to read ``key``."""
        with self._lock:
            if stamp.epoch == self._epoch and stamp.acl_gen == self._acl_gen and self.trusted:
                if len(self._readable) > 200_000:
                    self._readable.clear()
                self._readable.add((scope, kind, key))


# ---------------------------------------------------------------- across processes


def _encode(origin: str, notes: list[Note]) -> str:
    items: list[list[Any]] = []
    for n in notes:
        if n.kind == "f":
            items.append(["f", n.key, n.seq, n.actor])
        elif n.kind == "e":
            items.append(["e", n.key, n.seq])
        elif n.kind == "t":
            items.append(["t", n.key, n.data])
        else:
            items.append([n.kind])
    payload = json.dumps({"o": origin, "n": items}, separators=(",", ":"))
    if len(payload.encode()) <= PAYLOAD_MAX:
        return payload
    # Too big (events for thousands of workspaces): name the stores, summarise the events;
    # topics that do not fit become a reset ("*"), so receivers forget what they cached.
    small: list[list[Any]] = [i for i in items if i[0] == "f"]
    ev = [i[2] for i in items if i[0] == "e"]
    if ev:
        small.append(["E", max(ev)])
    if any(i[0] in ("a", "t") for i in items):
        small.append(["*"])
    payload = json.dumps({"o": origin, "n": small}, separators=(",", ":"))
    if len(payload.encode()) <= PAYLOAD_MAX:
        return payload
    return json.dumps({"o": origin, "n": [["*"]]})


def _decode(payload: str) -> tuple[str, list[Note]]:
    raw = json.loads(payload)
    notes = []
    for i in raw.get("n", []):
        k = i[0]
        if k == "f":
            notes.append(Note("f", str(i[1]), int(i[2]), i[3]))
        elif k == "e":
            notes.append(Note("e", str(i[1]), int(i[2])))
        elif k == "E":
            notes.append(Note("E", "", int(i[1])))
        elif k == "t":
            notes.append(Note("t", str(i[1]), data=str(i[2])))
        elif k in ("a", "*"):
            notes.append(Note(k))
    return str(raw.get("o", "")), notes


class Bus:
    """Commit notes between the processes sharing ``db`` (a ``memfuse.server.db.Database``),
    delivered to ``notifier``. See the module docstring for each backend.

    ``publish(conn, notes)`` runs inside the write transaction (PostgreSQL: ``pg_notify``);
    ``start()`` starts the listening thread (idempotent, also called by the first long-poll);
    ``close()`` stops it. ``connected`` tells whether notes of other processes arrive now.
    ``scans`` counts fallback / watcher scans (for /metrics).
    """

    def __init__(self, db: Database, notifier: Notifier) -> None:
        self.db = db
        self.notifier = notifier
        self.origin = uuid.uuid4().hex[:12]
        self.is_pg = db.url.get_backend_name() == "postgresql"
        self.watch_file = db.is_sqlite and not db.is_memory
        self.channel = "memfuse"
        self.connected = not self.is_pg
        self.scans = 0
        self.reconnects = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._tops: tuple[int, int] | None = None  # (versions, events) seen by the last scan
        self._pg_conn: psycopg.Connection[Any] | None = None
        # called (in the bus thread) after every scan for commits of other processes:
        # what those commits did to tokens is only known by reading them (memfuse.server.streamclass)
        self.on_scan: list[Callable[[], None]] = []
        if self.is_pg:
            notifier.trusted = False  # until the listener is connected
            with db.engine.connect() as conn:
                schema = conn.exec_driver_sql("SELECT current_schema()").scalar() or "public"
            if schema != "public":  # the tests give every test a schema of its own
                self.channel = "memfuse_" + hashlib.sha256(schema.encode()).hexdigest()[:16]
        notifier.track_own = self.watch_file
        notifier.on_subscribe = self.start if (self.is_pg or self.watch_file) else None

    # ------------------------------------------------------------ sending

    def publish(self, conn: Connection, notes: list[Note]) -> None:
        """Send ``notes`` to the other processes when the transaction on ``conn`` (a SQLAlchemy
        ``Connection``) commits. PostgreSQL only; elsewhere nothing to do."""
        if self.is_pg and notes:
            conn.exec_driver_sql("SELECT pg_notify(%(c)s, %(p)s)",
                                 {"c": self.channel, "p": _encode(self.origin, notes)})

    # ------------------------------------------------------------ the thread

    def start(self) -> None:
        """Start listening (idempotent; cheap when already started)."""
        if self._thread is not None or self._stop.is_set() or not (self.is_pg or self.watch_file):
            return  # in-memory SQLite: one process, nothing to listen to
        with self._start_lock:
            if self._thread is not None:
                return
            target = self._run_pg if self.is_pg else self._run_sqlite
            self._thread = threading.Thread(target=target, name="memfuse-bus", daemon=True)
            self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        """Stop the thread (waits up to ``timeout`` s for it)."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)

    @property
    def revocations_live(self) -> bool:
        """Whether token revocations committed by other processes arrive here as they commit
        (PostgreSQL with the listener connected). Elsewhere they must be read periodically."""
        return self.is_pg and self.connected

    def _conninfo(self) -> str:
        url = self.db.url.set(drivername="postgresql")
        info: str = url.render_as_string(hide_password=False)
        return info

    def _run_pg(self) -> None:
        import psycopg

        backoff = 0.5
        next_scan = time.monotonic()
        while not self._stop.is_set():
            try:
                with psycopg.connect(self._conninfo(), autocommit=True, connect_timeout=5) as conn:
                    conn.execute(f'LISTEN "{self.channel}"')
                    self._pg_conn = conn
                    self.connected = True
                    self.reconnects += 1
                    self._tops = None
                    self.notifier.reset(trusted=True)  # what was cached may have missed commits
                    log.info("listening for other replicas' commits", extra={"channel": self.channel})
                    backoff = 0.5
                    while not self._stop.is_set():
                        for n in conn.notifies(timeout=1.0):
                            self._deliver(n.payload)
            except Exception as e:
                if self._stop.is_set():
                    break
                log.warning("commit listener disconnected; waiters fall back to a shared scan every "
                            f"{FALLBACK_SECONDS:.0f} s until it reconnects",
                            extra={"error": type(e).__name__, "detail": str(e)[:200], "retry_in_s": backoff})
            finally:
                self._pg_conn = None
                if self.connected:
                    self.connected = False
                    self.notifier.reset(trusted=False)
            # Disconnected: one shared scan per FALLBACK_SECONDS wakes what changed.
            deadline = time.monotonic() + backoff
            while not self._stop.is_set() and time.monotonic() < deadline:
                if time.monotonic() >= next_scan:
                    next_scan = time.monotonic() + FALLBACK_SECONDS
                    self._scan_logged()
                self._stop.wait(min(0.2, max(0.0, deadline - time.monotonic())))
            backoff = min(backoff * 2, RECONNECT_MAX_SECONDS)

    def _deliver(self, payload: str) -> None:
        try:
            origin, notes = _decode(payload)
        except (ValueError, TypeError, IndexError, KeyError):
            log.warning("unreadable commit note ignored", extra={"bytes": len(payload)})
            return
        if origin != self.origin:
            self.notifier.committed(notes, local=False)

    def _run_sqlite(self) -> None:
        path = self.db.url.database
        version = None
        conn = None
        while not self._stop.is_set():
            try:
                if conn is None:
                    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
                v = conn.execute("PRAGMA data_version").fetchone()[0]
                if v != version:
                    if version is not None or self._tops is None:
                        self._scan_logged()
                    version = v
            except sqlite3.Error as e:
                log.warning("database watcher failed; retrying",
                            extra={"error": type(e).__name__, "detail": str(e)[:200]})
                if conn is not None:
                    conn.close()
                conn = None
            self._stop.wait(SQLITE_WATCH_SECONDS)
        if conn is not None:
            conn.close()

    def _scan_logged(self) -> None:
        try:
            self.scan()
        except Exception as e:
            log.warning("commit scan failed", extra={"error": type(e).__name__, "detail": str(e)[:200]})
        for fn in self.on_scan:
            try:
                fn()
            except Exception:
                log.exception("scan callback failed")

    def scan(self) -> None:
        """One shared read of what committed since the last scan: the stores and workspaces
        whose latest seq moved get their waiters woken (those already known are skipped by
        ``Notifier.committed``). The first scan only sets the baseline, and wakes everyone
        when the cache is not trusted (commits may have been missed before it)."""
        from sqlalchemy import text

        self.scans += 1
        with self.db.engine.connect() as conn:
            if self._tops is None:
                v = conn.execute(text("SELECT COALESCE(MAX(seq), 0) FROM versions")).scalar() or 0
                e = conn.execute(text("SELECT COALESCE(MAX(seq), 0) FROM workspace_events")).scalar() or 0
                self._tops = (int(v), int(e))
                if not self.connected:
                    self.notifier.committed([Note("*")], local=False)
                return
            v0, e0 = self._tops
            vrows = conn.execute(text("SELECT seq, store FROM versions WHERE seq > :v"), {"v": v0}).all()
            erows = conn.execute(text("SELECT seq, workspace FROM workspace_events WHERE seq > :e"),
                                 {"e": e0}).all()
            conn.rollback()
        own_v, own_e = self.notifier.take_own(v0, e0)
        feeds: dict[str, int] = {}
        for q, store in vrows:
            if int(q) not in own_v:
                feeds[store] = max(feeds.get(store, 0), int(q))
        evs: dict[str, int] = {}
        for q, ws in erows:
            if int(q) not in own_e:
                evs[ws] = max(evs.get(ws, 0), int(q))
        self._tops = (max([v0, *(int(q) for q, _ in vrows)]), max([e0, *(int(q) for q, _ in erows)]))
        notes = [Note("f", s, q) for s, q in feeds.items()] + [Note("e", w, q) for w, q in evs.items()]
        if evs:
            notes.append(Note("a"))  # attach / detach from elsewhere: re-check access
        if notes:
            self.notifier.committed(notes, local=False)
