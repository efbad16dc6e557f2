"""The feeds long-polls read: a store's change feed and a workspace's events.

The store change feed (``changes_page``: versions after a seq, each as the record's state as
of that version) and the workspace events (``events_page``: attached, detached,
store_changed). For long-polls (``memfuse.server.longpoll``) there are also the access checks
they remember (``check_feed_access``, ``check_events_access``) and ``feed_read``, one read of
a store's feed that every waiter at the same cursor shares and filters (``FeedRead.page``).
Reads teach the ``Notifier`` (``memfuse.server.wakeups``) the heads they saw, so later
long-polls at the head need no read. The writes themselves are in ``records`` and ``stores``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Literal, TypeVar, Unpack, cast

from sqlalchemy import ColumnElement, Connection, Select, bindparam, func, null, select

from memfuse.defs import FEED_PAGE_MAX, INT64_MAX, content_page
from memfuse.models import (DEFAULT_MODE, Access, Change, ChangePage, EventPage, Operation, Overwritten, Record,
                            WorkspaceEvent)
from memfuse.server import deltas, keys, wakeups
from memfuse.server.base import _R, _V, AnyRow, Parts, Principal, Resource, ServiceError
from memfuse.server.db import EventRow
from memfuse.server.rawsql import Raw
from memfuse.server.records import decode_overwrote

MAX_WAIT_SECONDS = 60.0  # the longest a long-poll may ask to wait
# bytes one change of a feed read holds in memory besides its path and content (its Change
# and Record models, seq, times, hashes, names): ~2.9 KB measured (tracemalloc, CPython 3.11,
# pydantic 2), a read of 1,000 changes without content ~2.8 MB (bench/README.md, "Hostile
# clients")
CHANGE_BYTES = 3 * 1024
_T = TypeVar("_T")
_EventKind = Literal["attached", "detached", "store_changed"]  # WorkspaceEvent.kind: what EventRow.kind holds


# ---------------------------------------------------------------- change feed rows


def _feed_select(with_content: bool) -> Select[Unpack[tuple[Any, ...]]]:
    """SELECT of change-feed rows (a version with its record's creation time)."""
    return select(
        _V.c.seq, _V.c.operation, _V.c.old_path, _V.c.record_id, _V.c.store, _V.c.path,
        _V.c.type, _V.c.version, _V.c.sha256, _V.c.size, _V.c.created_at, _V.c.actor,
        _V.c.content if with_content else null().label("content"), _V.c.redacted,
        _V.c.mode, _V.c.mtime_ns, _V.c.base_version, _V.c.chain,
        _V.c.overwrote, _V.c.overwrote_by, _V.c.writer,
        _R.c.created_at.label("record_created_at"),
    ).join(_R, _R.c.id == _V.c.record_id)


def _feed_where(skip: bool) -> list[ColumnElement[bool]]:
    """The versions of a feed page: of store ``:store`` with ``:after`` < seq <= ``:top``
    and, when ``skip``, not written by ``:actor`` (a version's ``feed_key``: the sidecar
    instance that wrote it, else its actor)."""
    conds = [_V.c.store == bindparam("store"), _V.c.seq > bindparam("after"), _V.c.seq <= bindparam("top")]
    if skip:
        conds.append(feed_key(_V.c.writer, _V.c.actor) != bindparam("actor"))
    return conds


def feed_key(writer: Any, actor: Any) -> Any:
    """What the change feed tells a version's writer by (``skip_actor`` / ``skip_writer``):
    the sidecar instance that wrote it (``versions.writer``, ``Memfuse-Writer``) when it
    sent one, else its actor (``Principal.feed_key`` for the caller). On columns, the SQL
    expression; on a row's values, the value."""
    if isinstance(writer, ColumnElement):
        return func.coalesce(writer, actor)
    return writer or actor


# The feed's statements, run on the DB-API cursor (memfuse.server.rawsql: a feed read is made
# for every create that another sidecar's stream or long-poll waits on; through Core its five
# statements cost more CPU than the create itself, bench/README.md "The close path, session
# 15: the echo"). Keyed by whether the actor ``:actor`` is left out (and, for rows, whether
# content is read); ``:lim`` bounds the rows.
_TOPS = Raw(select(select(func.max(_V.c.seq)).scalar_subquery().label("top"),
                   select(func.max(_V.c.seq)).where(_V.c.store == bindparam("store"))
                   .scalar_subquery().label("store_top")))
_SIZES = {skip: Raw(select(_V.c.seq, _V.c.size).where(*_feed_where(skip)).order_by(_V.c.seq)
                    .limit(bindparam("lim"))) for skip in (False, True)}
_ROWS = {(skip, content): Raw(_feed_select(content).where(*_feed_where(skip)).order_by(_V.c.seq)
                              .limit(bindparam("lim"))) for skip in (False, True) for content in (False, True)}
# the seq and ``feed_key`` of each version a page would hold (no content, no other column):
# how far a reader's own versions run from its cursor (``ChangesService.feed_own_run``)
_KEYS = Raw(select(_V.c.seq, feed_key(_V.c.writer, _V.c.actor).label("k")).join(_R, _R.c.id == _V.c.record_id)
            .where(*_feed_where(False)).order_by(_V.c.seq).limit(bindparam("lim")))


def _feed_rows(
    conn: Connection, store: str, after: int, top: int, actor: str | None, limit: int, with_content: bool,
) -> tuple[list[Any], bool]:
    """The change-feed rows (``_feed_select``) of store ``store`` with ``after`` < seq <=
    ``top``, leaving out those of ``actor`` when given, oldest first: at most ``limit``, and
    with content at most what ``defs.content_page`` lets one page carry (their sizes are
    read first, without content, so content past the budget is never read; then the same
    budget in JSON bytes: a long-poll's shared page and a stream line are encoded whole).
    Append versions' content is made whole. Returns the rows and whether the page was cut
    (by ``limit`` or by bytes): then more versions may follow the last one."""
    skip = actor is not None
    params: dict[str, Any] = {"store": store, "after": after, "top": top, "lim": limit}
    if skip:
        params["actor"] = actor
    if not with_content:
        rows = _ROWS[(skip, False)].all(conn, params)
        return list(rows), len(rows) >= limit
    sizes = _SIZES[skip].all(conn, params)

    def read(n: int) -> list[Any]:  # the first n rows with content, append versions' made whole
        return deltas.resolve(conn, _ROWS[(skip, True)].all(conn, {**params, "top": sizes[n - 1].seq, "lim": n}))

    rows, cut = content_page([r.size for r in sizes], read, lambda r: None if r.redacted else r.content)
    return rows, cut or len(sizes) >= limit


def _change(v: AnyRow | SimpleNamespace, with_content: bool) -> Change:
    """[Change] of a ``_feed_select`` row: the record as of that version (and the version
    it overwrote by last writer wins, when it did)."""
    over = v.overwrote
    return Change(
        seq=v.seq,
        operation=Operation(v.operation),
        old_path=v.old_path,
        record=Record(
            id=v.record_id,
            store=keys.public(v.store),
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
        overwrote=None if over is None else _overwritten(over, v.overwrote_by),
    )


def _overwritten(version: int, by: str | None) -> Overwritten:
    """[Overwritten] of a version's ``overwrote`` / ``overwrote_by`` columns
    (``records.decode_overwrote``): the version replaced and its writer, ``also`` the other
    writers whose changes the overwrite dropped."""
    (n, actor), *rest = decode_overwrote(version, by)
    return Overwritten(version=n, actor=actor, also=[Overwritten(version=m, actor=a) for m, a in rest])


@dataclass
class FeedRead:
    """One shared read of a store's change feed (``feed_read``): ``changes`` after ``after``
    up to ``store_top`` (the store's latest seq when read), ``top`` the latest seq of all
    stores (a cursor beyond it is expired), ``full`` when ``limit`` or the page byte
    budget (``defs.content_page``) cut the read."""

    store: str
    after: int
    changes: list[Change]
    store_top: int
    top: int
    full: bool
    #: the ``feed_key`` of each change's version (its writer's), in order
    keys: list[str]
    #: set on a read of the reader's own versions only (``ChangesService.feed_own_run``):
    #: the seq its page moves the cursor to, with no change in it
    upto: int | None = None
    _encoded: bytes | None = None
    _page: ChangePage | None = None
    #: called with the bytes of the shared page's JSON once it is encoded (``page``): the
    #: cache that holds this read counts them (``longpoll.FeedReads``)
    on_encoded: Callable[[int], None] | None = field(default=None, repr=False, compare=False)

    def page(self, skip_actor: str | None) -> tuple[ChangePage, bytes | None]:
        """The page a long-poll answers (``changes_page`` rules for ``skip_actor``: versions of
        that writer, ``feed_key``, left out, ``seq`` past them), and its JSON when it is the
        shared unfiltered page (encoded once for every waiter), else None."""
        if self.upto is not None:  # the reader's own versions, left unread (``feed_own_run``)
            return ChangePage(changes=[], seq=self.upto), None
        seq = self.changes[-1].seq if self.full else max(self.after, self.store_top)
        if skip_actor is not None and skip_actor in self.keys:
            kept = [c for c, k in zip(self.changes, self.keys) if k != skip_actor]
            return ChangePage(changes=kept, seq=seq), None
        if self._page is None:  # the same page for every waiter: built and encoded once
            self._page = ChangePage(changes=self.changes, seq=seq)
            self._encoded = self._page.model_dump_json().encode()
            if self.on_encoded is not None:
                self.on_encoded(len(self._encoded))
        return self._page, self._encoded

    def nbytes(self) -> int:
        """About the memory this read holds, in bytes, not counting its JSON (``page``): per
        change ``CHANGE_BYTES`` (its models, the seq, times, hashes, names) plus its path(s)
        and content (the UTF-8 ``size``: no more than Python's ``str`` of it takes)."""
        n = 0
        for c in self.changes:
            r = c.record
            n += CHANGE_BYTES + len(r.path) + len(c.old_path or "") + (r.size if r.content is not None else 0)
        return n


# ---------------------------------------------------------------- the feeds


class ChangesService(Resource):
    """``Service`` methods: ``changes_page`` (a store's change feed), ``events_page`` (a
    workspace's events), and for long-polls ``check_feed_access``, ``check_events_access``,
    ``feed_read``."""

    _feed_keys: dict[tuple[str, str], str]  # (scope, store name) -> key the feed last found
    _events_keys: dict[tuple[str, str], str]  # (scope, workspace name) -> its key, likewise

    def __init__(self, parts: Parts) -> None:
        super().__init__(parts)
        self._feed_keys = {}
        self._events_keys = {}

    def events_page(self, p: Principal, ws: str, after: int, limit: int = FEED_PAGE_MAX) -> EventPage:
        """Events of ``ws`` with seq > ``after``, oldest first. When ``after`` is beyond every
        event the server has (database replaced), ``seq`` is the server's latest, so the
        caller resumes from there. Teaches the ``Notifier`` the workspace's event bounds (by
        the workspace's key, memfuse.server.keys, which the events rows and wake-ups name)."""
        after = max(-1, min(after, INT64_MAX))  # a 64-bit column: beyond it there is nothing
        stamp = self.notifier.stamp()
        with self.db.read() as s:
            key = self._workspace(s, p, ws).name
            rows = s.scalars(
                select(EventRow)
                .where(EventRow.workspace == key, EventRow.seq > after)
                .order_by(EventRow.seq)
                .limit(limit)
            ).all()
            if rows:
                seq = rows[-1].seq
                if len(rows) < limit:
                    self.notifier.learn_events(key, seq, seq, stamp)
            else:
                top = s.scalar(select(func.max(EventRow.seq))) or 0
                seq = min(after, top)
                self.notifier.learn_events(key, after, top, stamp)
            self._events_keys[(p.scope, ws)] = key
            self.notifier.learn_readable(p.scope, wakeups.EVENTS, ws, stamp)
            return EventPage(
                events=[
                    WorkspaceEvent(seq=r.seq, kind=cast(_EventKind, r.kind), store=keys.public(r.store),
                                   access=Access(r.access) if r.access else None)
                    for r in rows
                ],
                seq=seq,
            )

    def check_feed_access(self, p: Principal, slug: str) -> str:
        """The key of the store ``p`` names ``slug`` (memfuse.server.keys: what ``feed_read``
        and the ``Notifier`` take); raise what ``changes_page`` would for a store ``p`` may not
        read (404). Remembered in the ``Notifier`` until access changes (and the key with it,
        ``cached_feed_key``), so a long-poll asks at most once."""
        key = self.cached_feed_key(p, slug)
        if key is not None:
            return key
        stamp = self.notifier.stamp()
        with self.db.read_conn() as conn:
            key = cast(str, self._store(conn, p, slug).slug)  # a store key
        self._feed_keys[(p.scope, slug)] = key
        self.notifier.learn_readable(p.scope, wakeups.FEED, slug, stamp)
        return key

    def cached_feed_key(self, p: Principal, slug: str) -> str | None:
        """The key ``check_feed_access`` found for ``(p.scope, slug)`` while the ``Notifier``
        still trusts that ``p`` may read it (no access change since), else None. Never reads
        the database (the event loop's fast path of long-polls and streams)."""
        if not self.notifier.readable(p.scope, wakeups.FEED, slug):
            return None
        return self._feed_keys.get((p.scope, slug))

    def check_events_access(self, p: Principal, ws: str) -> str:
        """The key of the workspace ``p`` names ``ws`` (memfuse.server.keys: what the
        ``Notifier``'s event bounds and wake-ups take); raise what ``events_page`` would for a
        workspace ``p`` may not read (403 / 404); remembered like ``check_feed_access``."""
        key = self.cached_events_key(p, ws)
        if key is not None:
            return key
        stamp = self.notifier.stamp()
        with self.db.read() as s:
            key = self._workspace(s, p, ws).name
        self._events_keys[(p.scope, ws)] = key
        self.notifier.learn_readable(p.scope, wakeups.EVENTS, ws, stamp)
        return key

    def cached_events_key(self, p: Principal, ws: str) -> str | None:
        """``cached_feed_key`` for a workspace's events: the key ``check_events_access``
        found for ``(p.scope, ws)`` while access is unchanged, else None; no database read."""
        if not self.notifier.readable(p.scope, wakeups.EVENTS, ws):
            return None
        return self._events_keys.get((p.scope, ws))

    def _read_to_head(self, slug: str, after: int,
                      read: Callable[[Connection, int, int], _T]) -> tuple[int, int, int, _T]:
        """One read transaction of store ``slug``'s feed (its key) up to its head, for the
        long-polls' reads (``feed_read``, ``feed_own_run``): ``after`` clamped to the 64-bit
        column, the latest seq of all stores (``top``) and of the store (``store_top``) read
        first, then ``read(conn, after, store_top)``; the ``Notifier`` learns the head.
        Returns ``(after, top, store_top, what read returned)``."""
        after = max(-1, min(after, INT64_MAX))  # a 64-bit column: beyond it there is nothing
        stamp = self.notifier.stamp()
        with self.db.read_conn() as conn:
            conn.begin()  # one read transaction (the Raw statements do not begin one)
            tops = _TOPS.first(conn, {"store": slug})
            assert tops is not None  # a SELECT of two aggregates has one row
            top, store_top = tops.top or 0, tops.store_top or 0
            got = read(conn, after, store_top)
        self.notifier.learn_head(slug, store_top, stamp)
        return after, top, store_top, got

    def feed_read(self, slug: str, after: int, *, limit: int = FEED_PAGE_MAX, with_content: bool = True) -> FeedRead:
        """``slug``: the store's key (``check_feed_access``'s answer). The store's versions with seq > ``after`` (at most ``limit``, oldest first, nobody
        left out) for long-polls, which share one read among all their waiters at the same
        cursor and filter it each (``FeedRead.page``). No access check: callers run
        ``check_feed_access`` first. Reads the store's latest seq first and no version beyond
        it (a store's versions commit in seq order, so the read has no gaps) and teaches the
        ``Notifier`` that head."""
        after, top, store_top, (rows, cut) = self._read_to_head(
            slug, after, lambda conn, after, store_top: _feed_rows(conn, slug, after, store_top, None, limit,
                                                                   with_content))
        return FeedRead(slug, after, [_change(v, with_content) for v in rows], store_top, top, cut,
                        [feed_key(v.writer, v.actor) for v in rows])

    def feed_own_run(self, slug: str, after: int, skip: str, *,
                     limit: int = FEED_PAGE_MAX) -> tuple[int, FeedRead | None]:
        """How far the versions after ``after`` of store ``slug`` (its key) are the reader's
        own (``feed_key`` ``skip``: a long-poll or stream with ``skip_writer`` / ``skip_actor``),
        read by seq and writer only, at most ``limit`` of them: a reader's own versions are
        left out of its page, so their content need not be read, made whole (append versions)
        nor sized in JSON. Before this a sidecar's stream, at each wake-up, read every version
        it had written since its cursor with content: a 1 MiB journal's every append, whole
        (bench/README.md, "Appends, session 23").

        Returns ``(after', None)`` when a version of another writer follows: ``after'`` is
        the seq of the last own version before it (``after`` when the first is another's),
        the cursor a content read (``feed_read``) starts from; or ``(upto, read)`` when every
        version read is the reader's own: ``read`` is a ``FeedRead`` without changes whose
        page moves the cursor to ``upto`` (the last one read when ``limit`` cut the read,
        ``full``; else the store's head). No access check (``check_feed_access`` first);
        teaches the ``Notifier`` the head, as ``feed_read`` does."""
        after, top, store_top, rows = self._read_to_head(
            slug, after, lambda conn, after, store_top: _KEYS.all(
                conn, {"store": slug, "after": after, "top": store_top, "lim": limit}))
        own = 0
        for r in rows:
            if r.k != skip:
                return (rows[own - 1].seq if own else after), None
            own += 1
        full = len(rows) >= limit
        upto = rows[-1].seq if full else max(after, store_top)
        return upto, FeedRead(slug, after, [], store_top, top, full, [], upto=upto)

    def changes_page(
        self,
        p: Principal,
        slug: str,
        after: int,
        *,
        limit: int = FEED_PAGE_MAX,
        with_content: bool = True,
        skip_actor: str | None = None,
    ) -> ChangePage:
        """Versions of the store with seq > ``after``, oldest first, each as the record's state
        as of that version. Raises 410 ``cursor_expired`` when ``after`` is beyond anything the
        server has written. With content a page holds at most ``defs.PAGE_CONTENT_BYTES`` of
        it (at least one version): a short page is not the end, the end is an empty page.

        ``skip_actor``: versions whose ``feed_key`` is exactly this are left out (the
        sidecar instance that wrote them, ``Memfuse-Writer``, else their actor); the page's ``seq``
        still moves past them (to the store's latest version when the page is not full), so
        a page may be empty with ``seq`` > ``after``."""
        with self.db.read_conn() as conn:
            conn.begin()  # one read transaction (the Raw statements do not begin one)
            st = self._store(conn, p, slug)
            tops = _TOPS.first(conn, {"store": st.slug})
            assert tops is not None  # a SELECT of two aggregates has one row
            top = tops.top or 0
            if after > top:
                raise ServiceError(
                    410, "cursor_expired", f"cursor {after} is beyond this server's feed ({top}); take a snapshot"
                )
            skip = skip_actor or None
            # The store's latest seq, read first: every version of the store up to it has
            # committed (a store's versions commit in seq order), so the page may claim it.
            store_top = tops.store_top or 0
            rows, cut = _feed_rows(conn, st.slug, max(-1, min(after, INT64_MAX)),
                                   store_top if skip is not None else INT64_MAX, skip, limit, with_content)
        changes = [_change(v, with_content) for v in rows]
        if skip is not None and not cut:
            seq = max(after, store_top)
        else:
            seq = changes[-1].seq if changes else after
        return ChangePage(changes=changes, seq=seq)
