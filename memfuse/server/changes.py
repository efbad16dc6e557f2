"""The feeds long-polls read, and the in-process ``Notifier`` that wakes them.

The store change feed (``changes_page``: versions after a seq, each as the record's state as
of that version) and the workspace events (``events_page``: attached, detached,
store_changed). ``Notifier`` wakes long-polls (changes, events) in this process right after
a commit; other processes sharing the database are seen by the long-poll's periodic
re-query (in ``memfuse.server.app``). A record write wakes only the change-feed long-polls
of its store, and not those that skip its actor. The writes themselves are in ``records``
and ``stores``.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import anyio
import sniffio
from sqlalchemy import func, null, select

from memfuse.models import DEFAULT_MODE, Access, Change, ChangePage, EventPage, Operation, Record, WorkspaceEvent
from memfuse.server.base import _R, _V, Principal, ServiceBase, ServiceError
from memfuse.server.db import EventRow

MAX_WAIT_SECONDS = 60.0  # the longest a long-poll may ask to wait


# ---------------------------------------------------------------- in-process wake-ups


class _Waiter:
    """An event a long-poll waits on; can be set from any thread (once: later wake-ups are
    no-ops, so a burst of commits costs the event loop one wake-up).

    ``store`` / ``skip_actor``: what the long-poll reads (see ``Notifier.notify``)."""

    def __init__(self, store: str | None = None, skip_actor: str | None = None) -> None:
        self.event = anyio.Event()
        self.store = store
        self.skip_actor = skip_actor
        self._woken = False
        if sniffio.current_async_library() == "trio":
            import trio

            token = trio.lowlevel.current_trio_token()
            self._wake: Callable[[], None] = lambda: token.run_sync_soon(self.event.set)
        else:
            loop = asyncio.get_running_loop()
            self._wake = lambda: loop.call_soon_threadsafe(self.event.set)

    def wants(self, store: str | None, actor: str | None) -> bool:
        """Whether a commit of ``store``'s versions by ``actor`` concerns this waiter (a
        commit with ``store`` None concerns everyone)."""
        if store is None:
            return True
        return self.store == store and (self.skip_actor is None or self.skip_actor != actor)

    def wake(self) -> None:
        """Set the event (from any thread); only the first call does anything."""
        if self._woken:
            return
        self._woken = True
        try:
            self._wake()
        except RuntimeError:  # the loop has finished (trio.RunFinishedError is one)
            pass


class Notifier:
    """Wakes the long-polls of this process after a commit.

    ``subscribe()`` (in async code, before reading the database, so no commit is missed)
    returns a waiter whose ``event`` is set by the next ``notify()`` that concerns it;
    ``notify()`` may be called from any thread. Always ``unsubscribe()`` in a ``finally``.

    A change-feed long-poll subscribes with its ``store`` (and ``skip_actor`` when it leaves
    a writer's versions out); a workspace-events long-poll without. Record writes notify with
    their store and actor, so they wake only the feeds of that store that do not skip that
    actor; every other write (admin changes, events) and the shutdown notify everyone.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: set[_Waiter] = set()

    def subscribe(self, store: str | None = None, skip_actor: str | None = None) -> _Waiter:
        """A new waiter for the next commit that concerns it (see the class docstring)."""
        w = _Waiter(store, skip_actor)
        with self._lock:
            self._waiters.add(w)
        return w

    def unsubscribe(self, w: _Waiter) -> None:
        """Forget ``w`` (idempotent)."""
        with self._lock:
            self._waiters.discard(w)

    def notify(self, store: str | None = None, actor: str | None = None) -> None:
        """Wake the waiters a commit concerns: with ``store``, a commit that wrote only
        versions of that store, all by ``actor``; without, everyone."""
        with self._lock:
            waiters = [w for w in self._waiters if w.wants(store, actor)]
        for w in waiters:
            w.wake()


# ---------------------------------------------------------------- the feeds


class ChangesMixin(ServiceBase):
    """``Service`` methods: ``changes_page`` (a store's change feed) and ``events_page`` (a
    workspace's events)."""

    def events_page(self, p: Principal, ws: str, after: int, limit: int = 1000) -> EventPage:
        """Events of ``ws`` with seq > ``after``, oldest first. When ``after`` is beyond every
        event the server has (database replaced), ``seq`` is the server's latest, so the
        caller resumes from there."""
        with self.db.read() as s:
            self._workspace(s, p, ws)
            rows = s.scalars(
                select(EventRow)
                .where(EventRow.workspace == ws, EventRow.seq > after)
                .order_by(EventRow.seq)
                .limit(limit)
            ).all()
            if rows:
                seq = rows[-1].seq
            else:
                top = s.scalar(select(func.max(EventRow.seq))) or 0
                seq = min(after, top)
            return EventPage(
                events=[
                    WorkspaceEvent(seq=r.seq, kind=r.kind, store=r.store, access=Access(r.access) if r.access else None)
                    for r in rows
                ],
                seq=seq,
            )
    def changes_page(
        self,
        p: Principal,
        slug: str,
        after: int,
        *,
        limit: int = 1000,
        with_content: bool = True,
        skip_actor: str | None = None,
    ) -> ChangePage:
        """Versions of the store with seq > ``after``, oldest first, each as the record's state
        as of that version. Raises 410 ``cursor_expired`` when ``after`` is beyond anything the
        server has written.

        ``skip_actor``: versions whose actor is exactly this are left out; the page's ``seq``
        still moves past them (to the store's latest version when the page is not full), so
        a page may be empty with ``seq`` > ``after``."""
        with self.db.read_conn() as conn:
            st = self._store(conn, p, slug)
            top = conn.scalar(select(func.max(_V.c.seq))) or 0
            if after > top:
                raise ServiceError(
                    410, "cursor_expired", f"cursor {after} is beyond this server's feed ({top}); take a snapshot"
                )
            q = (
                select(
                    _V.c.seq, _V.c.operation, _V.c.old_path, _V.c.record_id, _V.c.store, _V.c.path,
                    _V.c.type, _V.c.version, _V.c.sha256, _V.c.size, _V.c.created_at, _V.c.actor,
                    _V.c.content if with_content else null().label("content"), _V.c.redacted,
                    _V.c.mode, _V.c.mtime_ns,
                    _R.c.created_at.label("record_created_at"),
                )
                .join(_R, _R.c.id == _V.c.record_id)
                .where(_V.c.store == st.slug, _V.c.seq > after)
                .order_by(_V.c.seq)
                .limit(limit)
            )
            skip = skip_actor or None
            store_top = 0
            if skip is not None:
                # Read the store's latest seq first: every version of the store up to it has
                # committed (a store's versions commit in seq order), so the page may claim it.
                store_top = conn.scalar(select(func.max(_V.c.seq)).where(_V.c.store == st.slug)) or 0
                q = q.where(_V.c.seq <= store_top, _V.c.actor != skip)
            rows = conn.execute(q).all()
        changes = [
            Change(
                seq=v.seq,
                operation=Operation(v.operation),
                old_path=v.old_path,
                record=Record(
                    id=v.record_id,
                    store=v.store,
                    path=v.path,
                    type=v.type,
                    version=v.version,
                    sha256=v.sha256,
                    size=v.size,
                    deleted=v.operation == Operation.deleted.value,
                    created_at=v.record_created_at,
                    updated_at=v.created_at,
                    updated_by=v.actor,
                    seq=v.seq,
                    content=v.content if with_content and not v.redacted else None,
                    mode=DEFAULT_MODE if v.mode is None else v.mode,
                    mtime_ns=v.mtime_ns,
                ),
            )
            for v in rows
        ]
        if skip is not None and len(rows) < limit:
            seq = max(after, store_top)
        else:
            seq = changes[-1].seq if changes else after
        return ChangePage(changes=changes, seq=seq)
