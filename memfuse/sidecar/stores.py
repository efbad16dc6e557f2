"""Attached stores of a running sidecar: attachments, store loading, change feeds, events.

``StoreSync`` is the part of ``mount.Sidecar`` that keeps the mounted stores equal to the
workspace's attachments and each store's tree equal to the control plane's records:

- loading: ``_add_attachment`` → ``_load_state`` (resume the saved mirror from its cursor, or
  a full snapshot) → ``Filesystem.add_store``; ``_load_offline`` mounts the saved mirrors when
  the control plane does not answer at start;
- change feeds: one task per mounted store (``_start_feed`` → ``_feed`` → ``_feed_loop``),
  each a stream of pages (``ApiClient.changes_stream``; long-polls when the control plane
  does not stream), applying remote changes only when the store's outbox is empty
  (``Committer.wait_store_idle``); ``410`` → ``_resync`` under ``Committer.hold``;
- attachments: ``reconcile`` (SIGHUP, workspace events, a refused feed), ``mount_store`` /
  ``unmount_store`` (admin API), ``_events`` (the workspace's event feed);
- upkeep: ``_saver`` saves dirty mirrors every 2 s (appends to their logs) and collects unreferenced blobs
  (``_gc_blobs``) every ``GC_EVERY`` s;
- the prompt block of ``.memfuse/context.md``: ``want_context`` (attach, detach, store
  changes, ``MEMORY.md`` changed) wakes ``_context_loop``, which fetches it with a bound.

It is a mixin: the attributes it uses (``config``, ``client``, ``fs``, ``committer``,
``metrics``, ``invalidator``, ``states``, ``feeds``, ``admin_unmounted``, ``actor``,
``_feed_kw``, ``_nursery``, ``_mount_lock``, ``_mounted``, ``offline_start``, ``feed_tasks``,
``task_failures``, ``state_save_failing``, ``_context_send`` / ``_context_recv``) and the methods (``supervise``, ``_spawn``,
``_wait_token``) are ``Sidecar``'s, set up in its ``__init__``. Everything runs on the trio
thread; see INVARIANTS.md for what may change across an ``await``.
"""
from __future__ import annotations

import errno
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

import trio

from ..content import INDEX_PATH
from ..errors import ApiError, Forbidden, Gone, PermanentError, TransientError, Unauthorized
from ..wire import Attachment, Change, ChangePage, EventPage, Record
from .inodes import ROOT_INO, STORE_CREATED_KEY, StoreMount
from .journal import Entry
from .cachedir import CacheError, disk_size, free_bytes
from .backoff import Doubling
from .sync import Meta, StoreState, catch_up, lag_seconds
from .committer import STORE_REPLACED

if TYPE_CHECKING:
    from ..client import ApiClient
    from .committer import Committer
    from .core import Filesystem
    from .invalidator import Invalidator
    from .metrics import Metrics
    from .config import MountConfig

log = logging.getLogger("memfuse.mount")


CONTEXT_TIMEOUT = 10.0  # s one fetch of the prompt block may take
SNAPSHOT_PAGE = 1000  # records per snapshot page (the API's largest)
CONTEXT_RETRY_MAX = 60.0  # s between retries of a failed fetch (from 1 s, doubling)
STREAM_RETRY_SECONDS = 600.0  # s of long-polls before asking a non-streaming server again
STREAM_SHORT_SECONDS = 1.0  # a stream that ended sooner is reopened after a backoff

R = TypeVar("R")

#: s a fetch of one record changed elsewhere (``StoreSync.refetch_record``) may take,
#: waiting for the store's outbox included
REFETCH_TIMEOUT = 120.0


class FeedKw(TypedDict, total=False):
    """The keyword arguments every change-feed request carries (``Sidecar._feed_kw``)."""

    skip_actor: str  # leave out the versions this actor wrote (a control plane without skip_writer)
    skip_writer: str  # leave out the versions this sidecar instance wrote (applied here already)


class StoreSync:
    """Attachments, store loading, change feeds and workspace events (module docstring)."""

    # what this part uses of the sidecar (declared here, S3QL style; set up by
    # ``Sidecar.__init__``)
    config: MountConfig
    client: ApiClient
    fs: Filesystem
    committer: Committer
    metrics: Metrics
    invalidator: Invalidator
    #: a fault hook for tests (``Sidecar``'s ``feed_hold``), awaited before a feed page with
    #: changes is applied; None in production
    feed_hold: Callable[[], Awaitable[None]] | None
    states: dict[str, StoreState]  # slug -> the store's mirror
    feeds: dict[str, trio.CancelScope]  # slug -> its change-feed task's scope
    admin_unmounted: set[str]
    actor: str
    _feed_kw: FeedKw
    _nursery: trio.Nursery | None
    _mount_lock: trio.Lock
    _mounted: bool
    offline_start: bool
    #: stores mounted from the cache without a catch-up (``_load_offline``). INVARIANT: a
    #: store in it may lack versions this sidecar's previous process had committed: not
    #: those whose close returned (``save_committed`` saved each as it finished), but one
    #: whose answer the killed process never got (the control plane applied it; its close
    #: never returned) or one saved without an fsync before a power loss. The feed, leaving
    #: our own versions out (``skip_actor``), would never bring them: its feed first catches
    #: up with every actor's versions (``_catch_up_own``), then leaves it.
    #: Also a store added again while the committer still held entries of it
    #: (``_add_attachment``): one answered after the load's catch-up is a version of ours
    #: the store loaded lacks. GUARDED_BY the trio thread.
    own_unseen: set[str]
    #: slug -> the ``seq`` of an empty feed page that came while the store had outbox
    #: entries unfinished. INVARIANT: a store's cursor never passes a version of ours whose
    #: answer has not reached its mirror (``StoreState.committed``): the feed leaves those
    #: out, so a page may pass them before their answer arrives, and a mirror saved then
    #: and killed before the next save would resume past a version it lacks. The cursor
    #: moves to it once the store's outbox is idle (``own_commits_done``). GUARDED_BY the
    #: trio thread.
    cursor_held: dict[str, int]
    #: the outbox a previous process left, until it is queued again (``Committer.replay``,
    #: right after the stores of the start are loaded; then empty): a store loaded before
    #: keeps what its files' entries are based on (``Filesystem.add_store``'s ``unsent``)
    leftovers: list[Entry]
    feed_tasks: int
    task_failures: dict[str, int]
    state_save_failing: bool
    _context_send: trio.MemorySendChannel[None]
    _context_recv: trio.MemoryReceiveChannel[None]
    _no_stream_until: float
    GC_EVERY: float
    last_start_error: str | None
    #: why loading a store waits on the cache disk (``_retrying``: full, or failing), in
    #: one sentence for ``/readyz`` and the status (``cache.load_error``); None once a load
    #: went through
    load_error: str | None

    if TYPE_CHECKING:  # Sidecar's methods this part calls
        async def supervise(self, name: str, fn: Callable[..., Awaitable[object]], *args: Any,
                            context: dict[str, Any] | None = None) -> None: ...

        def _spawn(self, name: str, fn: Callable[..., Awaitable[object]], *args: Any,
                   context: dict[str, Any] | None = None) -> None: ...

        async def _wait_token(self, timeout: float) -> None: ...

    # ------------------------------------------------------------------ .memfuse/context.md
    def want_context(self) -> None:
        """Ask for a new prompt block (``.memfuse/context.md``); never blocks: requests made
        while one is pending fold into it."""
        try:
            self._context_send.send_nowait(None)
        except trio.WouldBlock:
            pass

    def touches_index(self, sm: StoreMount, rec: Record | Meta) -> bool:
        """Whether the remote state ``rec`` of a record in store ``sm`` changes the store's
        ``MEMORY.md``: it is at that path now, or the file it replaces here was."""
        if rec.path == INDEX_PATH:
            return True
        n = self.fs.by_rid.get(rec.id)
        return n is not None and n.store is sm and not n.unlinked and n.path() == INDEX_PATH

    async def refresh_context(self) -> bool:
        """Fetch this mount's prompt block (``GET /v1/workspaces/{ws}/context`` with
        ``mount_root`` = the mountpoint) within ``CONTEXT_TIMEOUT`` s and keep it in
        ``fs.controls``. Returns False (the previous block stays, the reason is noted) when
        the control plane fails or does not answer in time."""
        err = None
        with trio.move_on_after(CONTEXT_TIMEOUT):
            try:
                text = await self.client.context(self.config.workspace,
                                                 str(self.config.mountpoint))
            except ApiError as e:
                err = f"the control plane answered {e.status or e.code}"
            else:
                self.fs.controls.set_context(text)
                return True
        err = err or f"the control plane did not answer within {CONTEXT_TIMEOUT:g} s"
        self.fs.controls.set_context(None, err)
        log.info("prompt block not refreshed; keeping the last one", extra={"reason": err})
        return False

    async def prompt_block(self) -> str | None:
        """Admin ``GET /v1/context``: refresh the prompt block (bounded by
        ``CONTEXT_TIMEOUT`` s) and return it, or the last one fetched when the refresh fails;
        None when none was ever fetched."""
        await self.refresh_context()
        return self.fs.controls.context_text

    async def _context_loop(self) -> None:
        """Refresh the prompt block on every ``want_context``; a failed fetch is retried
        after 1 s doubling to ``CONTEXT_RETRY_MAX`` s, or at once on the next request."""
        retry = Doubling(1.0, CONTEXT_RETRY_MAX)
        while True:
            await self._context_recv.receive()
            while not await self.refresh_context():
                with trio.move_on_after(retry.next()):
                    await self._context_recv.receive()
            retry.reset()

    # ------------------------------------------------------------------ loading
    async def _retrying(self, what: str, fn: Callable[[], Awaitable[R]],
                        need: int | None = None) -> R:
        """``await fn()`` until it returns, retrying (0.2 s doubling to 5 s) while the
        control plane is unreachable, refuses the token, or the cache disk refuses a write.
        ``what`` ("loading notes") names the step in the log; ``need``: the bytes of
        content it stores (a store's ``usage_bytes``), said with the disk's free bytes when
        the disk is full, in the log and in ``load_error`` (``/readyz``, the status; no
        store name there: ``/readyz`` is open on TCP), so a cache disk too small for the
        stores is told, not only retried (attack 14)."""
        retry = Doubling(0.2, 5.0)
        while True:
            try:
                out = await fn()
                self.load_error = None
                return out
            except TransientError as e:
                self.last_start_error = e.code or (f"HTTP {e.status}" if e.status else type(e).__name__)
                wait = retry.next(e.retry_after)
                log.warning(f"control plane unreachable while {what}; retrying",
                            extra={"status": e.status, "code": e.code, "retry_in_s": wait})
                await trio.sleep(wait)
            except CacheError as e:
                cache_dir = self.config.cache_dir
                free, size = free_bytes(cache_dir), disk_size(cache_dir)
                if e.errno == errno.ENOSPC:
                    self.load_error = (
                        f"the cache disk of {cache_dir} is full: "
                        + (f"a store to load needs {need} bytes for its content, "
                           if need is not None else "")
                        + f"{free} bytes are free of {size}; give the cache volume more room "
                        "(docs/DEPLOY.md, cache size) or free space on it: the start goes on "
                        "by itself")
                else:
                    self.load_error = (f"the cache disk of {cache_dir} refused a write while "
                                       f"loading: {e.reason}; retrying")
                log.warning(f"cache disk refused a write while {what}; retrying",
                            extra={"errno": errno.errorcode.get(e.errno), "reason": e.reason,
                                   "needed_bytes": need, "free_bytes": free, "disk_bytes": size,
                                   "cache_dir": str(cache_dir), "retry_in_s": retry.delay})
                await trio.sleep(retry.next())
            except Unauthorized as e:  # an authentication outage: wait for a valid token
                self.last_start_error = f"HTTP {e.status}: the token was refused"
                log.warning(f"the control plane refused the token while {what}; retrying",
                            extra={"status": e.status, "code": e.code, "retry_in_s": retry.delay})
                await self._wait_token(retry.next())

    async def _load_state(self, slug: str, expect_records: int | None = None) -> StoreState:
        """The store's mirror, resumed from the saved cursor or from a full snapshot.
        ``expect_records`` (the control plane's live record count) guards the resume: a
        mirror that does not add up is replaced by a snapshot, and so is one whose blobs
        are mostly missing (the blob cache was deleted or started anew after a system
        crash: ``BlobCache.rebuilt``); a few missing blobs are fetched one by one."""
        state = StoreState(self.config.cache_dir / "stores" / f"{slug}.json", slug,
                           blobs=self.fs.blobs)
        # no blob collection until the store is in the tree: its blobs are referenced by
        # nothing else meanwhile (_gc_blobs), and add_store trusts the check below
        self._snapshots_running = getattr(self, "_snapshots_running", 0) + 1
        try:
            resumed = state.load() and await catch_up(
                self.client, state, self.fs.blobs, lambda ch: self.told_overwritten(slug, ch))
            if resumed and expect_records is not None and len(state.records) != expect_records:
                log.warning("saved store state does not match the control plane; taking a snapshot",
                            extra={"store": slug, "saved": len(state.records),
                                   "live": expect_records})
                resumed = False
            missing = (self.fs.blobs.missing_digests(m.sha for m in state.records.values())
                       if resumed else set())
            if len(missing) > max(100, len(state.records) // 50):  # the blob cache was lost:
                # a snapshot (1,000 records a request) costs less than one request per blob
                log.warning("blob cache lacks much of a saved store; taking a snapshot",
                            extra={"store": slug, "missing": len(missing)})
                resumed = False
            if not resumed:
                await self._snapshot_into(slug, state)
                missing = set()  # a snapshot carries every live record's content, now stored
            for r in [r for r in state.records.values() if r.sha in missing]:
                full = await self.client.get_record(slug, r.id, content=True)
                assert full.content is not None  # asked for (content=True)
                self.fs.blobs.put(full.content.encode("utf-8"), full.sha256)
                state.put(full)
        finally:
            self._snapshots_running -= 1
        log.info("store loaded", extra={"store": slug, "records": len(state.records),
                                        "cursor": state.cursor, "resumed": bool(resumed)})
        return state

    async def _snapshot_metas(self, slug: str, limit: int = SNAPSHOT_PAGE) -> tuple[list[Meta], int]:
        """The store's full snapshot as ``([Meta], seq)`` (``seq``: the change-feed position
        of its first page), every record's content stored in the blob cache, one
        transaction per page of ``limit`` records. The next page is requested while one is
        being stored (one request ahead, never more: ``fetch`` waits on a channel of one),
        so the control plane's work and ours overlap; a page's content is dropped once
        stored, so a big store is never held in memory with its content. The blob cache
        fills in bulk mode (``BlobCache.bulk``: content written once, no wait for the disk
        per page, one ``fsync`` at the end), so every blob is durable before this returns
        and the caller saves a mirror referring to them; each page's blobs are written by a
        worker thread while this thread takes the next page off the wire. No blob gc runs
        meanwhile (the blobs of stored pages are referenced by nothing yet). Raises what
        ``ApiClient.list_records`` raises and ``CacheError``."""
        send, recv = trio.open_memory_channel(1)
        metas: list[Meta] = []
        seq: int | None = None

        failed: list[BaseException] = []

        async def fetch() -> None:  # its failure is raised as is below, not in a group
            async with send:
                try:
                    async for page in self.client.iter_pages(slug, content=True, limit=limit):
                        await send.send(page)
                except Exception as exc:
                    failed.append(exc)

        blobs = self.fs.blobs

        async def store_pages() -> None:
            nonlocal seq
            async with recv:
                async for page in recv:
                    if seq is None:
                        seq = page.seq
                    recs = page.records
                    del page
                    rows = [(r.sha256, r.content.encode("utf-8"))
                            for r in recs if r.content is not None]
                    metas.extend([Meta.of(r) for r in recs])
                    del recs
                    # written by a worker thread (one transaction): the trio thread
                    # reads and decodes the next page meanwhile
                    await trio.to_thread.run_sync(blobs.put_many, rows)
                    del rows

        self._snapshots_running = getattr(self, "_snapshots_running", 0) + 1
        try:
            with blobs.bulk():  # durable when it returns: the mirror is saved only after
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(fetch)
                    try:
                        await store_pages()
                    except Exception as exc:  # raised as is below, not in a group
                        failed.insert(0, exc)
                        nursery.cancel_scope.cancel()
        finally:
            self._snapshots_running -= 1
        if failed:
            raise failed[0]
        return metas, seq or 0

    async def _snapshot_into(self, slug: str, state: StoreState) -> None:
        """Replace ``state`` with a full snapshot (``_snapshot_metas``)."""
        metas, seq = await self._snapshot_metas(slug)
        state.reset(metas, seq)

    async def _add_attachment(self, att: Attachment) -> None:
        slug = att.store.slug
        # entries of a store taken out still commit (nothing new queues while it is out); one
        # answered after the load's catch-up is a version of ours the feed leaves out
        queued_before = self.committer.depth(slug)
        created = att.store.created_at.isoformat()
        self.committer.confirmed[slug] = created
        if self._saved_identity(slug) not in ("", created):
            log.warning("the saved state of this store is of a deleted store of that name; "
                        "taking a snapshot", extra={"store": slug, "store_created": created,
                                                     "earlier": self._saved_identity(slug)})
            self._drop_mirror(slug)
            self.fs.forget_store(slug)
        state = await self._retrying(
            f"loading {slug}", lambda: self._load_state(slug, att.store.record_count),
            need=att.store.usage_bytes)
        if slug in self.fs.stores:
            return
        self.states[slug] = state
        limits = {"max_record_bytes": att.store.max_record_bytes,
                  "max_store_bytes": att.store.max_store_bytes,
                  "max_records": att.store.max_records}
        if (state.access, state.limits) != (att.access.value, limits):
            state.access, state.limits, state.dirty = att.access.value, limits, True
        # every blob is cached (_load_state checked, nothing awaited since)
        self.fs.add_store(slug, att.access.value, list(state.records.values()), limits=limits,
                          cached=True, unsent=self._unsent(slug), created=created)
        if self._saved_identity(slug) != created:  # which store the cache now holds
            self.fs._save_dirs_logged()
        if queued_before:  # its feed first catches up with our versions too (_catch_up_own)
            self.own_unseen.add(slug)
        self.invalidator.submit([("entry", ROOT_INO, slug)])
        self.want_context()
        if self._mounted:  # before the mount, run() starts every store's feed once mounted
            self._start_feed(slug)

    def _saved_identity(self, slug: str) -> str:
        """The creation time of the store of ``slug`` the cache last held (``dirs.json``,
        ``Filesystem.save_dirs``), '' when unknown."""
        saved = self.fs.saved_dirs.get(STORE_CREATED_KEY)
        was = saved.get(slug) if isinstance(saved, dict) else None
        return was if isinstance(was, str) else ""

    def _unsent(self, slug: str) -> list[Entry]:
        """The entries of ``slug`` the previous process left that are not queued again yet
        (``leftovers``: only while the stores of the start load)."""
        return [e for e in self.leftovers if e.store == slug]

    def _saved_slugs(self) -> list[str]:
        d = self.config.cache_dir / "stores"
        return sorted(p.stem for p in d.glob("*.json")) if d.is_dir() else []

    def _load_offline(self, listed: bool = False) -> None:
        """The control plane did not answer in time at start (``Sidecar._load_at_start``):
        mount every store saved in the cache as it was last seen, except those loaded from
        the control plane already (``listed``: the attachments were listed, some stores may
        be). The change feeds catch up, and the attachments are reconciled, once the control
        plane answers again; the outbox left by the last run is replayed as usual."""
        for slug in self._saved_slugs():
            if slug in self.fs.stores:
                continue
            state = StoreState(self.config.cache_dir / "stores" / f"{slug}.json", slug,
                           blobs=self.fs.blobs)
            if not state.load():
                continue
            missing = self.fs.blobs.missing_digests(m.sha for m in state.records.values())
            records = [m for m in state.records.values() if m.sha not in missing]
            self.states[slug] = state
            self.own_unseen.add(slug)
            self.fs.add_store(slug, state.access, records, limits=state.limits or None,
                              cached=True, unsent=self._unsent(slug),
                              created=self._saved_identity(slug))
        self.offline_start = True
        log.warning("control plane unreachable or too slow at start: mounted from the local "
                    "cache; writes are accepted and commit once it answers",
                    extra={"stores": ",".join(self.states), "timeout_s": self.config.offline_after,
                           "listed": listed, "last_error": self.last_start_error})

    def _start_feed(self, slug: str) -> None:
        """Start the store's change-feed task; exactly one per store (two would apply
        stale pages over each other's newer ones)."""
        old = self.feeds.pop(slug, None)
        if old is not None:
            old.cancel()
        scope = trio.CancelScope()
        self.feeds[slug] = scope
        assert self._nursery is not None, "feeds start while the sidecar runs"
        self._nursery.start_soon(self._feed, slug, scope)

    # ------------------------------------------------------------------ change feed
    async def _feed(self, slug: str, scope: trio.CancelScope) -> None:
        """Long-poll the store's change feed and apply what others changed (docs/ARCHITECTURE.md)."""
        self.feed_tasks += 1
        try:
            with scope:
                await self.supervise("feed", self._feed_loop, slug, context={"store": slug})
        finally:
            self.feed_tasks -= 1

    async def _resync(self, slug: str) -> None:
        """After ``410``: replace the store's mirror and tree with a full snapshot, without
        reverting or hiding a local write. No commit of the store runs from the request of
        the snapshot until it is applied (``Committer.hold``), so every local change is
        either in the snapshot or still queued, and queued ones are left alone
        (``Filesystem.reconcile_store``)."""
        async with self.committer.hold(slug):
            records, seq = await self._snapshot_metas(slug)  # metadata; content is cached
            state, sm = self.states.get(slug), self.fs.stores.get(slug)
            if state is None or sm is None:
                return
            self.invalidator.submit(self.fs.reconcile_store(sm, records,
                                                            self.committer.queued(slug)))
            state.reset(records, seq)
        self.want_context()
        log.info("store resynchronised from a snapshot", extra={"store": slug,
                                                                "records": len(records)})

    def _streams_ok(self) -> bool:
        """Whether to open streams now: yes unless the control plane answered a stream
        request without streaming in the last ``STREAM_RETRY_SECONDS``."""
        return trio.current_time() >= self._no_stream_until

    def _streams_refused(self, what: str) -> None:
        """A stream request was answered without streaming: long-poll every feed for
        ``STREAM_RETRY_SECONDS``. Said once per window (at INFO; at DEBUG when the control
        plane is known not to stream, ``MountConfig.streams_expected``)."""
        if self._streams_ok():
            level = logging.INFO if self.config.streams_expected else logging.DEBUG
            log.log(level, "the control plane does not stream; long-polling",
                    extra={"feed": what, "retry_stream_in_s": STREAM_RETRY_SECONDS})
        self._no_stream_until = trio.current_time() + STREAM_RETRY_SECONDS

    async def _feed_loop(self, slug: str) -> None:
        """The feed of one store (run under ``supervise``; ``_feed`` owns the scope): a
        stream of pages (``ApiClient.changes_stream``), reopened from the cursor when it
        ends, or long-polls when the control plane does not stream."""
        retry, probe = Doubling(0.2, 5.0), False
        while True:
            state, sm = self.states.get(slug), self.fs.stores.get(slug)
            if state is None or sm is None:
                return
            try:
                if slug in self.own_unseen:
                    await self._catch_up_own(slug)
                    retry.reset()
                    probe = False
                    continue
                if self._streams_ok() and not probe:
                    stream = self.client.changes_stream(slug, state.cursor, content=True, **self._feed_kw)
                    opened = trio.current_time()
                    try:
                        async for page in stream:
                            if trio.current_time() - opened >= STREAM_SHORT_SECONDS:
                                retry.reset()  # a stream that lasts: the control plane is fine
                            self.committer.poke()
                            if not await self._apply_page(slug, page):
                                break  # reopened from the cursor of the last page applied
                    finally:
                        await stream.aclose()
                    if stream.streaming is False:
                        self._streams_refused(f"changes:{slug}")
                    elif trio.current_time() - opened < STREAM_SHORT_SECONDS:
                        await trio.sleep(retry.next())  # streams that end at once: reopen with backoff
                    continue
                # after a failure, ask without waiting: the first answer tells the
                # committer at once that the control plane is back
                page = await self.client.changes(slug, state.cursor, wait=0 if probe else 25,
                                                 content=True, **self._feed_kw)
                retry.reset()
                probe = False
                self.committer.poke()
                await self._apply_page(slug, page)
            except Gone:
                log.warning("change-feed cursor expired; taking a full snapshot", extra={"store": slug})
                try:
                    await self._resync(slug)
                except TransientError as e:
                    wait = retry.next(e.retry_after)
                    log.info("snapshot after 410 failed; retrying",
                             extra={"store": slug, "status": e.status, "retry_in_s": wait})
                    await trio.sleep(wait)
                except Unauthorized:  # an authentication outage: wait for a valid token
                    await self._wait_token(retry.next())
                except CacheError as e:
                    log.warning("snapshot after 410 not stored: cache disk error; retrying",
                                extra={"store": slug, "reason": e.reason, "retry_in_s": 5.0})
                    await trio.sleep(5.0)
                continue
            except TransientError as e:
                wait = retry.next(e.retry_after)  # a 429's or 503's Retry-After is waited out
                log.info("change feed unreachable; retrying",
                         extra={"store": slug, "status": e.status, "code": e.code, "retry_in_s": wait})
                await trio.sleep(wait)
                probe = not self._streams_ok()  # a stream's first line is a probe already
                continue
            except Unauthorized:
                # an authentication outage, not a detach: keep the store, wait for a token
                await self._wait_token(retry.next())
                probe = not self._streams_ok()
                continue
            except PermanentError as e:
                log.warning("change feed refused; reconciling attachments",
                            extra={"store": slug, "status": e.status, "code": e.code})
                assert self._nursery is not None
                self._nursery.start_soon(self._reconcile_logged)
                await trio.sleep(5)
                continue

    def own_commits_done(self, slug: str) -> None:
        """An outbox entry of ``slug`` finished, its answer in the mirror: once none is left,
        the cursor takes the ``seq`` held for it (``cursor_held``)."""
        held = self.cursor_held.get(slug)
        if held is None or self.committer.depth(slug):
            return
        del self.cursor_held[slug]
        state = self.states.get(slug)
        if state is not None and held > state.cursor:
            state.cursor = held
            state.dirty = True
            state.drop_passed()

    async def _catch_up_own(self, slug: str) -> None:
        """The first feed requests of a store in ``own_unseen``: every version since its
        cursor, ours included (no ``skip_actor``, no wait), applied as the feed applies
        others' (``_apply_page(own=True)``: a file already at that version or written since
        is left alone), until a page is empty; then the store leaves ``own_unseen``, and its
        feed goes on as usual. Without it, a version committed by the previous process and
        missing from the saved mirror stays missing, shown as clean, for good (a later
        online start catches up from the cursor, past it). Raises what
        ``ApiClient.changes`` raises (the feed loop retries)."""
        while slug in self.own_unseen:
            state = self.states.get(slug)
            if state is None or slug not in self.fs.stores:
                self.own_unseen.discard(slug)
                return
            page = await self.client.changes(slug, state.cursor, wait=0, content=True)
            self.committer.poke()
            if not await self._apply_page(slug, page, own=True):
                continue  # asked again from the unmoved cursor (after 5 s), or gone
            if not page.changes:
                self.own_unseen.discard(slug)
                log.info("store caught up after an offline start",
                         extra={"store": slug, "cursor": state.cursor})

    async def _apply_page(self, slug: str, page: ChangePage, own: bool = False) -> bool:
        """Apply one change-feed page (a long-poll's answer or a stream's line) to the store
        and move its cursor; this sidecar's own versions are skipped (applied here already)
        unless ``own`` (``_catch_up_own``). Returns False when the cache disk refused a
        change (after 5 s: the page is asked again from the unmoved cursor) or the store is
        gone."""
        state, sm = self.states.get(slug), self.fs.stores.get(slug)
        if state is None or sm is None:
            return False
        if not page.changes:
            if self.committer.depth(slug):  # it may pass a version of ours not answered yet
                self.cursor_held[slug] = max(self.cursor_held.get(slug, 0), page.seq)
            else:
                state.cursor = max(state.cursor, page.seq)
                state.drop_passed()
            return True
        if self.feed_hold is not None and not own:
            await self.feed_hold()
        # every local change of this store must be committed before remote ones apply
        await self.committer.wait_store_idle(slug)
        inv: list[tuple[Any, ...]] = []
        try:
            for ch in page.changes:
                if ch.seq <= state.cursor:
                    continue  # already applied (a page asked again after a reconnect)
                # our own versions are left out by the control plane (``skip_writer``), not
                # here by actor: another sidecar given the same actor writes versions of that
                # actor too (a control plane that sends ours anyway: each is applied as the
                # catch-up applies them, ``own``: a file at that version or newer is left alone)
                if ch.overwrote is not None:
                    self.told_overwritten(slug, ch)
                if state.older_than_own(ch):
                    # another writer's version made before a delete or directory move of
                    # ours that this mount shows (``StoreState.own_newer``): passed over
                    state.cursor = max(state.cursor, ch.seq)
                    state.dirty = True
                    continue
                if self.touches_index(sm, ch.record):
                    self.want_context()
                inv += self.fs.apply_remote(sm, ch.record)
                state.apply(ch)
                self.metrics.remote_changes.labels(slug).inc()
                self.metrics.sync_lag.observe(lag_seconds(ch.record))
        except CacheError as e:  # the changes from the failed one on are asked again
            self.fs.save_pruned_dirs()
            self.invalidator.submit(inv)
            log.warning("remote change not stored: cache disk error; retrying",
                        extra={"store": slug, "reason": e.reason, "retry_in_s": 5.0})
            await trio.sleep(5.0)
            return False
        state.cursor = max(state.cursor, page.seq)
        state.drop_passed()
        state.last_change_at = time.time()
        # a record this page brought may wait for local state that went (the mirror has
        # the page's states now)
        inv += self.fs.unshadow(sm)
        self.fs.save_pruned_dirs()
        self.invalidator.submit(inv)
        return True

    def told_overwritten(self, slug: str, ch: Change) -> None:
        """A change of the feed (``_apply_page``, or the catch-up of a saved mirror at start)
        ``ch``: when another writer wrote it by last writer wins (``Change.overwrote``) over
        a version this sidecar wrote (its actor), or dropped this sidecar's changes held by a
        version written after the one it was made on (``Overwritten.also``: e.g. this
        mount's edit merged into another mount's version, which that mount overwrote), its
        agent is told, as the writer that won is (``ConflictResolver.conflict``): a line in
        ``errors.log`` (``ControlFiles.note_overwritten``, naming this mount's newest version
        dropped), a WARNING and ``memfuse_overwritten``. Changes of other writers only, and
        this sidecar's own overwrites, are not this mount's to report."""
        over = ch.overwrote
        if over is None or ch.record.updated_by == self.actor:
            return
        lost = next((o.version for o in (over, *over.also) if o.actor == self.actor), None)
        if lost is None:
            return
        rec = ch.record
        self.metrics.overwritten.inc()
        self.fs.controls.note_overwritten(slug, rec.path, rec.id, lost, rec.version)
        log.warning("conflict: this mount's write was overwritten elsewhere; last writer wins, "
                    "this mount's version stays in history",
                    extra={"store": slug, "path": rec.path, "record": rec.id,
                           "lost_version": lost, "version": rec.version,
                           "by": rec.updated_by})

    async def _events(self) -> None:
        """Follow the workspace's attach / detach / store-changed events: a stream
        (``ApiClient.events_stream``), or long-polls when the control plane does not stream."""
        cursor, retry = None, Doubling(0.2, 10.0)
        while True:
            try:
                if cursor is None:
                    cursor = (await self.client.workspace_events(self.config.workspace, 0, wait=0)).seq
                    if self.offline_start:  # attachments may have changed while unreachable
                        self.offline_start = False
                        await self._reconcile_logged()
                    continue
                if self._streams_ok():
                    stream = self.client.events_stream(self.config.workspace, cursor)
                    opened = trio.current_time()
                    try:
                        async for page in stream:
                            if trio.current_time() - opened >= STREAM_SHORT_SECONDS:
                                retry.reset()  # a stream that lasts: the control plane is fine
                            cursor = max(cursor, page.seq)
                            await self._on_events(page)
                    finally:
                        await stream.aclose()
                    if stream.streaming is False:
                        self._streams_refused("events")
                    elif trio.current_time() - opened < STREAM_SHORT_SECONDS:
                        await trio.sleep(retry.next())  # streams that end at once: reopen with backoff
                    continue
                page = await self.client.workspace_events(self.config.workspace, cursor, wait=25)
                retry.reset()
            except ApiError as e:
                wait = retry.next(e.retry_after)
                log.info("workspace events unreachable; retrying",
                         extra={"status": e.status, "code": e.code, "retry_in_s": wait})
                await trio.sleep(wait)
                continue
            cursor = max(cursor, page.seq)
            await self._on_events(page)

    async def _on_events(self, page: EventPage) -> None:
        if page.events:
            log.info("workspace events", extra={"events": ",".join(
                f"{ev.kind}:{ev.store}" for ev in page.events)})
            await self._reconcile_logged()
            self.want_context()  # descriptions and instructions are in the block too

    async def _saver(self) -> None:
        """Save dirty store mirrors at once and then every 2 s (``save_states_async``: an
        append to each one's log, or a compaction in a worker thread); collect unreferenced blobs
        every ``GC_EVERY`` s (overwritten and deleted records leave their old content
        behind). The first collection waits ``GC_EVERY`` s too: it is a pass over every
        blob on the trio thread (~0.2 s at 100,000), which would hold up the first requests
        of a fresh mount, and nothing needs it sooner."""
        last_gc = trio.current_time()
        first = True
        while True:
            if not first:
                await trio.sleep(2)
            first = False
            await self.save_states_async()
            self.fs.sync_rejected()  # e.g. a remote change replaced a rejected file
            self.fs.sync_local()  # e.g. a remote record moved over a local-only file
            if trio.current_time() - last_gc >= self.GC_EVERY:
                last_gc = trio.current_time()
                self._gc_blobs()
            await trio.sleep(0)

    def save_states(self) -> None:
        """Save every dirty store mirror on the calling thread (at the stop: an append to
        its log, or a rewrite of its base when it has none; ``StoreState.save``). A failure
        (full or failing cache disk) is logged once per streak (no traceback), counted, and
        retried at the next call: the mirror is a cache, what is on disk stays valid."""
        self.fs.blobs.write_behind()  # a saved mirror names no content held only in memory
        failed = None
        for st in list(self.states.values()):
            if st.dirty:
                try:
                    st.save()
                except CacheError as e:
                    failed = e
                    self._state_not_saved(st, e)
        self._states_saved(failed)

    async def save_states_async(self) -> None:
        """``save_states`` for the periodic saver: a mirror whose log is due for compaction
        (or that has no base: a new snapshot) has its base encoded and written in a worker
        thread (``StoreState.save_async``), so a save holds the trio thread in proportion
        to what changed, not to the store's size."""
        self.fs.blobs.write_behind()  # a saved mirror names no content held only in memory
        failed = None
        for st in list(self.states.values()):
            if st.dirty:
                try:
                    await st.save_async()
                except CacheError as e:
                    failed = e
                    self._state_not_saved(st, e)
        self._states_saved(failed)

    def save_committed(self, st: StoreState) -> None:
        """Save the mirror ``st`` at once after one of this sidecar's own writes committed
        (``Sidecar.entry_finished``, called by the committer before the ``close(2)`` waiting
        for it can return: nothing awaits in between). Read-your-writes across a crash: the
        entry leaves the outbox journal within ``Journal.LAZY_DELAY`` s (or was never written
        there: a held insert answered first), and the feed leaves our own versions out, so
        without this a ``kill -9`` before the periodic save (every 2 s) would restart the
        mount, offline, at the older version shown as clean. One frame appended to the
        mirror's log (``StoreState.save_log``; no fsync: a ``kill -9`` keeps what was
        written); a mirror without a base yet (a new snapshot) waits for the periodic saver,
        which writes the base. A failure is counted and logged once per streak, never
        raised: the periodic saver retries (the write itself is in the control plane).
        The frame carries the close's content while the blob cache holds it only in memory
        (``BlobCache.put_behind``; ``StoreState``'s rule: a saved mirror names no content
        held only in memory, else a ``kill -9`` and an offline restart would show the file
        and answer EIO at its read), so the close writes no blob-cache transaction."""
        try:
            st.save_log()
        except CacheError as e:
            self._state_not_saved(st, e)
            self.state_save_failing = True

    def _state_not_saved(self, st: StoreState, e: CacheError) -> None:
        self.metrics.cache_write_errors.labels(
            "state", errno.errorcode.get(e.errno, str(e.errno))).inc()
        if not self.state_save_failing:
            log.warning("store state not saved; retrying every 2 s",
                        extra={"store": st.slug, "reason": e.reason})

    def _states_saved(self, failed: CacheError | None) -> None:
        if failed is None and self.state_save_failing:
            log.info("store states saved again")
        self.state_save_failing = failed is not None

    # ------------------------------------------------------------------ mount / umount signals
    def learn_actor(self) -> None:
        """Take the actor the control plane records on this sidecar's writes (the client's
        ``actor``, from the attachments answer) as ``actor`` and the feeds' ``skip_actor``
        (what a control plane without ``skip_writer`` leaves out as ours). A control plane
        that does not say leaves the sidecar's own ``ws:<workspace>/<instance>``."""
        told = self.client.actor
        if told and told != self.actor:
            log.info("actor named by the control plane", extra={"actor": told, "was": self.actor})
            self.actor = told
            self._feed_kw["skip_actor"] = told

    async def reconcile(self) -> dict[str, Any]:
        """Make the mounted stores match the workspace's attachments (SIGHUP, events)."""
        async with self._mount_lock:
            atts = await self.client.list_attachments(self.config.workspace)
            self.learn_actor()
            want = {a.store.slug: a for a in atts}
            added, removed = [], []
            for slug, att in want.items():
                sm = self.fs.stores.get(slug)
                if sm is not None and self._replaced(sm, att):
                    await self._replace(sm, att)
                    added.append(slug)
                    continue
                if sm is None:
                    if slug not in self.admin_unmounted:
                        await self._add_attachment(att)
                        added.append(slug)
                    continue
                sm.access = att.access.value
                sm.max_record_bytes = att.store.max_record_bytes
                sm.max_store_bytes = att.store.max_store_bytes
                sm.max_records = att.store.max_records
            for slug in [s for s in self.fs.stores if s not in want]:
                await self._remove(slug)
                removed.append(slug)
            if added or removed:
                log.info("attachments reconciled", extra={"added": ",".join(added),
                                                          "removed": ",".join(removed)})
            return {"added": added, "removed": removed, "stores": sorted(self.fs.stores)}

    async def mount_store(self, slug: str) -> dict[str, Any]:
        """Admin ``POST /v1/mounts/{store}``: load and mount an attached store. Returns
        ``{"store", "mounted": True, "changed"}``. Raises ``LookupError`` when the store is
        not attached to the workspace, ``PermissionError`` when the control plane refuses it
        (403: the token may not read it), ``ApiError`` for other failures of the control
        plane."""
        try:
            return await self._mount_store(slug)
        except Forbidden as e:
            raise PermissionError(e.detail or e.code or "forbidden") from e

    async def _mount_store(self, slug: str) -> dict[str, Any]:
        async with self._mount_lock:
            self.admin_unmounted.discard(slug)
            if slug in self.fs.stores:
                return {"store": slug, "mounted": True, "changed": False}
            atts = await self.client.list_attachments(self.config.workspace)
            self.learn_actor()
            att = next((a for a in atts if a.store.slug == slug), None)
            if att is None:
                raise LookupError(f"store {slug} is not attached to workspace {self.config.workspace}")
            await self._add_attachment(att)
            return {"store": slug, "mounted": True, "changed": True}

    async def unmount_store(self, slug: str) -> dict[str, Any]:
        """Admin ``DELETE /v1/mounts/{store}``. Raises LookupError when not mounted."""
        async with self._mount_lock:
            if slug not in self.fs.stores:
                raise LookupError(f"store {slug} is not mounted")
            self.admin_unmounted.add(slug)
            left = await self._remove(slug)
            return {"store": slug, "mounted": False, "uncommitted": left}

    def _replaced(self, sm: StoreMount, att: Attachment) -> bool:
        """Whether the store attached under ``sm``'s slug is another store than the one
        mounted (deleted and made again under its name: both creation times known and
        different). The one place the sidecar tells stores of one slug apart; the outbox
        keeps the same rule for the entries (``Committer._refuse_replaced``)."""
        created = att.store.created_at.isoformat()
        self.committer.confirmed[sm.slug] = created
        return bool(sm.created) and sm.created != created

    async def _replace(self, sm: StoreMount, att: Attachment) -> None:
        """The store mounted under ``sm.slug`` was deleted and another store made under its
        name (attack 16 F7, F5): nothing of the old one is carried over. Its tree goes (the
        kernel's entries invalidated), and so do its mirror and its local-only and rejected
        files (``Filesystem.forget_store``, each named in ``errors.log``); its queued writes
        are refused, never sent to the new store (``Committer.confirmed`` already names the
        new one); its unflushed writes are not committed. Then the new store is loaded from
        a snapshot."""
        slug = sm.slug
        log.warning("the store was deleted and a new store made under its name; everything "
                    "kept of the deleted one is dropped", extra={
                        "store": slug, "store_created": att.store.created_at.isoformat(),
                        "earlier": sm.created, "queued": self.committer.depth(slug)})
        await self._remove(slug, commit=False)
        self.fs.forget_store(slug)
        self._drop_mirror(slug)
        await self._add_attachment(att)

    def _drop_mirror(self, slug: str) -> None:
        """Delete the saved mirror of ``slug`` (its base and log): the next load takes a
        snapshot. A failure is logged; the load's own checks still apply."""
        StoreState(self.config.cache_dir / "stores" / f"{slug}.json", slug,
                   blobs=self.fs.blobs).discard()

    async def _remove(self, slug: str, *, commit: bool = True) -> int:
        """Commit the store's dirty files (bounded wait), then take it out of the mount.
        ``commit`` false (the store was deleted and another made under its name): its dirty
        files are not committed, each is named in ``errors.log``."""
        sm = self.fs.stores[slug]
        for n in self.fs.dirty_nodes(sm):
            if commit:
                self.fs.commit_quietly(n)
            else:
                self.fs.note_error(n.parent, n.name, errno.ESTALE,
                                   "the store was deleted (a new store has its name); this "
                                   "unsaved write is not sent to the new one", STORE_REPLACED)
        with trio.move_on_after(self.config.commit_wait):
            await self.committer.wait_store_idle(slug)
        left = self.committer.depth(slug)
        scope = self.feeds.pop(slug, None)
        if scope is not None:
            scope.cancel()
        self.invalidator.submit(self.fs.remove_store(slug))
        await self.invalidator.settle()  # the directory is gone for the kernel too on return
        self.want_context()
        state = self.states.pop(slug, None)
        self.own_unseen.discard(slug)  # a later mount loads it anew (catch-up or snapshot)
        self.cursor_held.pop(slug, None)
        if state is not None:
            try:
                await state.save_async()
            except CacheError as e:  # a cache: the next mount resumes from the older file
                log.warning("store state not saved at unmount", extra={"store": slug,
                                                                       "reason": e.reason})
            finally:
                state.close()
        log.info("store unmounted", extra={"store": slug, "uncommitted": left})
        return left

    async def _reconcile_logged(self) -> None:
        """``reconcile`` for background callers (events, SIGHUP, a refused feed): a failure
        is logged and counted, never raised (it would end the mount); the next event, SIGHUP
        or feed refusal tries again."""
        try:
            await self.reconcile()
        except (ApiError, CacheError) as e:
            log.warning("reconcile failed", extra={"status": getattr(e, "status", None),
                                                   "code": getattr(e, "code", None),
                                                   "reason": getattr(e, "reason", None)})
        except Exception:
            self.task_failures["reconcile"] = self.task_failures.get("reconcile", 0) + 1
            self.metrics.task_failures.labels("reconcile").inc()
            log.exception("reconcile failed unexpectedly")

    def shadow_freed(self, slug: str) -> None:
        """``FsListener``: a local entry in the way of a record of ``slug`` not shown here
        went; its shadowed records are applied again once the store's outbox is empty
        (``apply_shadowed``), in a task of the sidecar's nursery (nothing when not running:
        the next feed page applies them)."""
        if self._nursery is not None:
            self._nursery.start_soon(self.apply_shadowed, slug, name=f"unshadow {slug}")

    async def apply_shadowed(self, slug: str) -> None:
        """Show the records of ``slug`` that local state here kept hidden and that may be
        shown now (``Filesystem.unshadow``), once the store's outbox is empty (every local
        change committed first, as for a feed page). Each wait for the outbox is bounded by
        ``REFETCH_TIMEOUT`` s; past it, the wait is logged and starts again while the store
        is mounted and the records are still due (a feed page with changes applies them
        too: ``_apply_page``)."""
        while slug in self.fs.unshadow_due and slug in self.fs.stores:
            with trio.move_on_after(REFETCH_TIMEOUT) as cs:
                await self.committer.wait_store_idle(slug)
            if cs.cancelled_caught:
                log.info("records hidden by local state wait for the store's outbox",
                         extra={"store": slug, "waited_s": REFETCH_TIMEOUT})
                continue
            sm = self.fs.stores.get(slug)
            if sm is not None:
                self.invalidator.submit(self.fs.unshadow(sm))
                self.fs.save_pruned_dirs()
            return

    def record_stale(self, slug: str, record_id: str) -> None:
        """``FsListener``: fetch record ``record_id`` of ``slug`` and apply it
        (``refetch_record``), in a task of the sidecar's nursery (nothing when not running)."""
        if self._nursery is not None:
            self._nursery.start_soon(self.refetch_record, slug, record_id,
                                     name=f"refetch {slug}/{record_id}")

    async def refetch_record(self, slug: str, record_id: str) -> None:
        """Apply the control plane's current state of one record to the tree as a snapshot
        state (``Filesystem.apply_remote`` with ``force``: the newest version wins by
        version number, a local write is never overwritten), once the store's outbox is
        empty. Asked when a commit answer carried a change made elsewhere that the tree
        cannot show from what it holds (attack finding 4: a move answered with content
        appended elsewhere, a put answered at a path the record was moved to elsewhere).
        Fetched again when an entry of the store finished while it was fetched (its state
        may be older than that local change).
        Bounded by ``REFETCH_TIMEOUT`` s; a failure is logged (the next change of the record
        brings it), never raised."""
        with trio.move_on_after(REFETCH_TIMEOUT) as cs:
            try:
                while True:
                    await self.committer.wait_store_idle(slug)
                    done = self.committer.finished.get(slug, 0)
                    rec = await self.client.get_record(slug, record_id, content=True)
                    await self.committer.wait_store_idle(slug)
                    # a local change committed while the record was fetched (an unlink, a
                    # move, a write of it) is newer than ``rec``: applied, the older state
                    # would undo it (an unlinked file came back with the content it had
                    # before), so it is fetched again; nothing awaits from here to the apply
                    if self.committer.finished.get(slug, 0) == done:
                        break
                sm = self.fs.stores.get(slug)
                if sm is None:
                    return
                self.invalidator.submit(self.fs.apply_remote(sm, rec, force=True))
                self.fs.save_pruned_dirs()
            except (ApiError, CacheError) as e:
                log.warning("a record changed elsewhere could not be fetched; the next change "
                            "of it brings it", extra={"store": slug, "record": record_id,
                                                       "reason": str(e)})
                return
            log.info("a record changed elsewhere was fetched and applied",
                     extra={"store": slug, "record": record_id, "version": rec.version})
        if cs.cancelled_caught:
            log.warning("fetching a record changed elsewhere timed out; the next change of it "
                        "brings it", extra={"store": slug, "record": record_id,
                                            "timeout_s": REFETCH_TIMEOUT})

    def _gc_blobs(self) -> None:
        """Delete cached blobs no store mirror or file refers to (a failure is logged and
        tried again at the next collection). Skipped while a store is being loaded (a
        snapshot, or a resume and its missing blobs): its blobs are referenced only once it
        is in the tree."""
        if getattr(self, "_snapshots_running", 0):
            return
        # the digests as the mirrors and nodes hold them (32 bytes): no object per blob
        keep = {r.sha for st in self.states.values() for r in st.records.values()}
        keep.update(n._sha for n in self.fs.inodes.values() if n._sha)
        # the versions readers were served before a remote change, or the kernel may still
        # serve them (Node.shown), or before a write here (Node.served): an overwrite's base
        keep.update(bytes.fromhex(x[f]) for x in (n._x for n in self.fs.inodes.values())
                    if x is not None for f in ("read_base", "shown", "served") if x.get(f))
        # the bases of queued puts: an append meeting a concurrent change is rebased on it
        keep.update(bytes.fromhex(sha) for sha in self.committer.base_shas())
        try:
            removed = self.fs.blobs.gc_digests(keep)
        except CacheError as e:
            log.warning("blob cache not cleaned", extra={"reason": e.reason})
            return
        if removed:
            log.info("blob cache cleaned", extra={"removed": removed})
