"""The FUSE adapter: ``pyfuse3.Operations`` over ``core.Filesystem``.

Each handler converts arguments, calls the core, and builds replies. Every handler is wrapped
(``_guard``): ``FsError`` becomes ``FUSEError(errno)``, a ``CacheError`` (the sidecar's own
disk full or failing) its errno with a logged reason; any other exception is logged with a
traceback and becomes ``FUSEError(EIO)``, because an uncaught exception would kill the whole
mount (PYFUSE3-NOTES "Process and errors"). Metrics per operation are counted here too.
Every await of a handler goes through a guard, which first hands the reading of the next
request to another worker (``fusereader.FuseReader.hand_off``): a handler that never awaits
keeps its worker the reader, with no task switch (fusereader.py docstring).

Kernel settings (PYFUSE3-NOTES "Kernel settings"): entry and attribute timeouts are long
(``CACHE_TIMEOUT``, the sidecar invalidates what changes remotely), absent names are cached as
negative entries, file pages are kept across opens (``keep_cache``), the writeback cache is off.
The ``.memfuse`` files are the exception: entry and attribute timeouts of 0 and ``direct_io``,
their size the length of the content an open reads (``control.ControlFiles.size``).
"""
from __future__ import annotations

import errno
import functools
from bisect import bisect_left
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from types import CoroutineType
from typing import Any, ParamSpec, TypeVar, cast

import pyfuse3

from .control import CONTROL_DIR
from .core import ContentMissing, Filesystem
from .fusereader import FuseReader
from .inodes import CHECK_INVARIANTS, FsError, Handle, Node
from .invalidator import Invalidator
from .metrics import LAT_BUCKETS, TIME_MASK, Metrics, OpStats
from .cachedir import CacheError

log = logging.getLogger("memfuse.fuse")

# seconds; see module docstring. MEMFUSE_KERNEL_CACHE_TIMEOUT overrides it for experiments
# (bench/README.md has the short-vs-long measurement that chose 300 s).
CACHE_TIMEOUT = float(os.environ.get("MEMFUSE_KERNEL_CACHE_TIMEOUT", "300"))
BLOCK = 4096
_WRITABLE = os.O_WRONLY | os.O_RDWR  # open flags of a handle that may write
# seconds an open for reading waits for the kernel invalidation of a remote change of the
# file still queued (``Invalidator.catch_up``; milliseconds in practice): past it the open
# proceeds, and the reader's base is what the kernel may still show (``Filesystem._served``)
OPEN_CATCH_UP = 1.0


# requests that may change what .memfuse/status.json shows (ControlFiles.changed); plain
# reads, opens and closes do not count (its inode and handle counts may lag by up to
# STATUS_REUSE_S), so an ``ls -l`` beside a busy reader does not render it on every stat
MODIFYING = frozenset({"setattr", "mkdir", "rmdir", "unlink", "rename", "mknod", "create",
                       "write", "fsync", "setxattr"})  # and a writer's flush (MemfuseOps._flush)


def _nothing() -> None:
    """``MemfuseOps._hand_off`` without a ``FuseReader`` (pyfuse3's own hand-off)."""


_H = TypeVar("_H", bound=Callable[..., Awaitable[Any]])
_P = ParamSpec("_P")
_R = TypeVar("_R")


def _failed(self: MemfuseOps, name: str, e: Exception) -> pyfuse3.FUSEError:
    """The ``FUSEError`` a handler's exception ``e`` is answered with (module docstring),
    counted in ``memfuse_fuse_errors_total`` and, for the sidecar's own disk and for
    anything unexpected, logged (``log.exception``: call it from the ``except`` block)."""
    if isinstance(e, pyfuse3.FUSEError):
        self._error_counter(name, e.errno).inc()
        return e
    if isinstance(e, FsError):
        self._error_counter(name, e.errno).inc()
        return pyfuse3.FUSEError(e.errno)
    if isinstance(e, CacheError):  # the sidecar's own disk: full (ENOSPC) or failing (EIO)
        self.metrics.fuse_errors.labels(name, errno.errorcode.get(e.errno, str(e.errno))).inc()
        log.warning("cache disk error; answered with its errno",
                    extra={"op": name, "errno": errno.errorcode.get(e.errno), "reason": e.reason})
        return pyfuse3.FUSEError(e.errno)
    self.metrics.fuse_errors.labels(name, "EIO").inc()
    log.exception("unexpected error in FUSE handler; answered EIO", extra={"op": name})
    return pyfuse3.FUSEError(errno.EIO)


def _guard(fn: _H) -> _H:
    """Wrap one handler that awaits (module docstring): errors mapped to errnos
    (``_failed``), the request counted and timed (``metrics.OpStats``: plain numbers, no
    lock); the signature stays ``fn``'s. Handlers that never await use ``_guard_sync``."""
    name = fn.__name__
    modifying = name in MODIFYING
    clock = time.perf_counter

    @functools.wraps(fn)
    async def wrapper(self: MemfuseOps, *args: Any) -> Any:
        st = self._op_stats.get(name) or self._stats(name)
        c = st.n
        st.n = c + 1
        t0 = 0.0 if c & TIME_MASK else clock()  # one request in TIME_EVERY is timed
        try:
            self._hand_off()  # it awaits: another worker reads the next request
            return await fn(self, *args)
        except Exception as e:
            raise _failed(self, name, e) from None
        finally:
            if modifying:
                self.fs.controls.changed()
                if CHECK_INVARIANTS:  # tests: MEMFUSE_CHECK_INVARIANTS=1
                    self.fs.check_invariants_after(name)
            if t0:
                dt = clock() - t0
                st.sum += dt  # OpStats.observe, inline (n counted above)
                st.buckets[bisect_left(LAT_BUCKETS, dt)] += 1

    return cast(_H, wrapper)


def _guard_sync(fn: Callable[_P, _R]) -> Callable[_P, Coroutine[Any, Any, _R]]:
    """``_guard`` for a handler written as a plain function (it never awaits): the wrapper
    is the request's only coroutine (pyfuse3 awaits what a handler returns). Every FUSE
    request of a warm ``grep -r`` goes through here, so it stays lean: bench/README.md,
    "Warm grep -r: what memfuse adds per request"."""
    name = fn.__name__
    modifying = name in MODIFYING
    clock = time.perf_counter
    call = cast(Callable[..., Any], fn)  # called as fn(self, *args): _P includes self

    @functools.wraps(fn)
    async def wrapper(self: MemfuseOps, *args: Any) -> Any:
        st = self._op_stats.get(name) or self._stats(name)
        c = st.n
        st.n = c + 1
        t0 = 0.0 if c & TIME_MASK else clock()  # one request in TIME_EVERY is timed
        try:
            return call(self, *args)
        except ContentMissing as m:  # a clean content absent or damaged in the blob cache:
            try:                     # fetched again, then the request once more (no effect
                self._hand_off()               # before the content is read: read, write,
                await self.fs.refetch(m.node)  # truncate); another worker reads meanwhile
                return call(self, *args)
            except Exception as e:
                raise _failed(self, name, e) from None
        except Exception as e:
            raise _failed(self, name, e) from None
        finally:
            if modifying:
                self.fs.controls.changed()
                if CHECK_INVARIANTS:  # tests: MEMFUSE_CHECK_INVARIANTS=1
                    self.fs.check_invariants_after(name)
            if t0:
                dt = clock() - t0
                st.sum += dt  # OpStats.observe, inline (n counted above)
                st.buckets[bisect_left(LAT_BUCKETS, dt)] += 1

    return cast(Callable[_P, Coroutine[Any, Any, _R]], wrapper)


def _guard_durable(fn: Callable[_P, _R]) -> Callable[_P, Coroutine[Any, Any, _R]]:
    """``_guard_sync`` for a plain handler that changes what the outbox journal keeps and
    whose system call does not wait for the control plane (unlink, rename, rmdir, setattr,
    setxattr): when the call queued a journal write that wants a batch now (an entry, a kept
    row: ``Journal.woken`` moved), the reply waits until it is on disk
    (``Filesystem.changes_durable``: bounded, never an error), so a change whose call
    returned 0 survives a ``kill -9`` of the sidecar (ns27: it was only in memory until the
    journal's next batch). A call that queued nothing (a chmod to the current mode, the
    rename of a file being written) answers at once, as ``_guard_sync``."""
    name = fn.__name__
    modifying = name in MODIFYING
    clock = time.perf_counter
    call = cast(Callable[..., Any], fn)  # called as fn(self, *args): _P includes self

    @functools.wraps(fn)
    async def wrapper(self: MemfuseOps, *args: Any) -> Any:
        st = self._op_stats.get(name) or self._stats(name)
        c = st.n
        st.n = c + 1
        t0 = 0.0 if c & TIME_MASK else clock()  # one request in TIME_EVERY is timed
        journal = self.fs.journal
        try:
            woken = journal.woken
            try:
                reply = call(self, *args)
            except ContentMissing as m:  # as _guard_sync: fetched again, the request once more
                self._hand_off()
                await self.fs.refetch(m.node)
                reply = call(self, *args)
            if journal.woken != woken:
                self._hand_off()  # another worker reads the next request meanwhile
                await self.fs.changes_durable(name)
            return reply
        except Exception as e:
            raise _failed(self, name, e) from None
        finally:
            if modifying:
                self.fs.controls.changed()
                if CHECK_INVARIANTS:  # tests: MEMFUSE_CHECK_INVARIANTS=1
                    self.fs.check_invariants_after(name)
            if t0:
                dt = clock() - t0
                st.sum += dt  # OpStats.observe, inline (n counted above)
                st.buckets[bisect_left(LAT_BUCKETS, dt)] += 1

    return cast(Callable[_P, Coroutine[Any, Any, _R]], wrapper)


def _guard_then(fn: Callable[_P, Any]) -> Callable[_P, Coroutine[Any, Any, Any]]:
    """``_guard`` for a handler written as a plain function that is done at once in the
    common case (its reply, or None) and otherwise returns a coroutine, awaited for the
    reply (``flush``: a reader's close does nothing, a writer's waits for its commit;
    ``open``: one of a file whose remote change the kernel has not seen yet waits for it).
    The guards (``_guard``, ``_guard_sync``, ``_guard_durable``, this one) share ``_failed``;
    their bodies are kept apart so that none pays a check per request."""
    name = fn.__name__
    modifying = name in MODIFYING
    clock = time.perf_counter
    call = cast(Callable[..., Any], fn)  # called as fn(self, *args): _P includes self

    @functools.wraps(fn)
    async def wrapper(self: MemfuseOps, *args: Any) -> Any:
        st = self._op_stats.get(name) or self._stats(name)
        c = st.n
        st.n = c + 1
        t0 = 0.0 if c & TIME_MASK else clock()  # one request in TIME_EVERY is timed
        try:
            reply = call(self, *args)
            if type(reply) is CoroutineType:
                self._hand_off()  # another worker reads the next request meanwhile
                reply = await reply
            return reply
        except Exception as e:
            raise _failed(self, name, e) from None
        finally:
            if modifying:
                self.fs.controls.changed()
                if CHECK_INVARIANTS:  # tests: MEMFUSE_CHECK_INVARIANTS=1
                    self.fs.check_invariants_after(name)
            if t0:
                dt = clock() - t0
                st.sum += dt  # OpStats.observe, inline (n counted above)
                st.buckets[bisect_left(LAT_BUCKETS, dt)] += 1

    return cast(Callable[_P, Coroutine[Any, Any, Any]], wrapper)


class MemfuseOps(pyfuse3.Operations):
    """pyfuse3 operations of one memfuse mount (see module docstring)."""

    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, fs: Filesystem, metrics: Metrics | None = None,
                 invalidator: Invalidator | None = None,
                 reader: FuseReader | None = None) -> None:
        super().__init__()
        self.fs = fs
        #: the openers of writable descriptors (``Filesystem.interrupts``): a stop signal to
        #: one ends its close's or fsync's wait with EINTR (pyfuse3 hides FUSE_INTERRUPT)
        self.interrupts = fs.interrupts
        #: the lazy reader hand-off (``fusereader``; the mount installs it around
        #: ``pyfuse3.main()``): every await of a handler goes through one of the guards,
        #: which call ``_hand_off`` first so that the next request is read meanwhile
        self.reader = reader
        self._hand_off: Callable[[], None] = reader.hand_off if reader is not None else _nothing
        self.metrics = metrics or Metrics()
        #: the kernel invalidations queued (``mount.Sidecar``'s; None: nothing is ever
        #: behind): an open for reading of a file still being invalidated waits for it
        self.invalidator = invalidator
        #: its ``behind_inodes`` (read here on every open: an empty dict almost always)
        self._behind: dict[int, int] = invalidator.behind_inodes if invalidator is not None else {}
        self._op_stats: dict[str, OpStats] = {}  # per op name (hot path: one dict lookup)
        #: (op name, errno) -> its ``memfuse_fuse_errors_total`` child: every file written
        #: is answered one ENODATA (the kernel's ``security.capability`` probe before the
        #: first write), and ``labels()`` takes a lock and builds its key per call
        self._err_counters: dict[tuple[str, int], Any] = {}

    def _stats(self, name: str) -> OpStats:
        """The ``OpStats`` of operation ``name``, taken from the metrics on first use."""
        st = self._op_stats[name] = self.metrics.fuse_ops.labels(name)
        return st

    def _error_counter(self, name: str, err: int) -> Any:
        """The ``memfuse_fuse_errors_total{op=name, errno=...}`` child counting ``err``
        (its symbolic name, or the number when it has none), looked up once."""
        c = self._err_counters.get((name, err))
        if c is None:
            c = self._err_counters[(name, err)] = self.metrics.fuse_errors.labels(
                name, errno.errorcode.get(err, str(err)))
        return c

    # ------------------------------------------------------------------ attributes
    def attrs(self, n: Node) -> pyfuse3.EntryAttributes:
        """The attributes of ``n`` as the kernel caches them (module docstring). Built for
        every lookup, getattr and ``readdir`` entry (readdirplus), so it reads each property
        of the node once and none of the side-table ones for a plain node (``Node._x``).
        ``EntryAttributes()`` starts zeroed (``generation``, ``st_rdev``) with
        ``st_blksize`` 4096 (``BLOCK``)."""
        a = pyfuse3.EntryAttributes()
        a.st_ino = n.ino
        kids = n.children
        special = "" if n._x is None else n.special
        timeout = 0 if special or n is self.fs.control else CACHE_TIMEOUT
        a.entry_timeout = timeout
        a.attr_timeout = timeout
        sm = n.store
        # a read-only store shows no write bits (ls -l, test -w, stat): the kernel then
        # refuses writes by other users itself (default_permissions: EACCES); root's reach
        # the handlers, which answer EROFS
        a.st_mode = n.mode if sm is None or sm.writable else n.mode & ~0o222
        a.st_uid = n.uid
        a.st_gid = n.gid
        if special:  # the length of the content an open reads (control.py docstring)
            size = self.fs.controls.size(special)
            a.st_nlink = 1
        elif kids is not None:
            size = BLOCK
            a.st_nlink = self.fs.nlink(n)
        elif n._x is None:  # a plain file: no write buffer, not unlinked
            size = n.size
            a.st_nlink = 1
        else:
            size = n.cur_size()
            a.st_nlink = self.fs.nlink(n)
            if n._x.get("shown") and n.ino in self._behind:
                older = self.fs.shown_size(n)
                if older is not None:
                    # a reader holds the file open and reads the older content whole
                    # (Filesystem._read_shown) until it closes: the kernel keeps its size,
                    # else that reader's next read past it would get the current content's
                    # bytes (torn16b); its pages, dropped if the mtime changed, are filled
                    # with the older content again
                    size = older
                else:
                    # the kernel takes this size while it still holds an older content's:
                    # its readers get the current content from now on (Filesystem.read)
                    self.fs.kernel_told_size(n)
        a.st_size = size
        a.st_blocks = (size + 511) // 512
        a.st_atime_ns = n.atime_ns
        a.st_mtime_ns = n.mtime_ns
        a.st_ctime_ns = n.ctime_ns
        return a

    def _negative(self) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = 0
        a.entry_timeout = CACHE_TIMEOUT
        return a

    @_guard_sync
    def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        n = self.fs.lookup(parent_inode, name)
        if n is None:
            parent = self.fs.node(parent_inode)
            if parent is self.fs.root or parent is self.fs.control:
                raise FsError(errno.ENOENT)  # store set can change: never cache absence here
            return self._negative()
        return self.attrs(n)

    @_guard_sync
    def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self.attrs(self.fs.node(inode))

    @_guard_durable
    def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                fh: int | None, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        n = self.fs.node(inode)
        self.fs.setattr(
            n, fh=fh,
            size=attr.st_size if fields.update_size else None,
            mode=attr.st_mode if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None,
            gid=attr.st_gid if fields.update_gid else None,
            atime_ns=attr.st_atime_ns if fields.update_atime else None,
            mtime_ns=attr.st_mtime_ns if fields.update_mtime else None,
        )
        return self.attrs(n)

    @_guard_sync
    def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for ino, nlookup in inode_list:
            self.fs.forget(ino, nlookup)

    # ------------------------------------------------------------------ directories
    @_guard_sync
    def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        return self.fs.opendir(inode).fh

    @_guard_sync
    def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        # "." and ".." first (offsets 1 and 2), as a local directory lists them (`ls -a`).
        # They are not lookups: the kernel links no dentry for them and never forgets them
        # (linux fs/fuse/readdir.c, fuse_direntplus_link; libfuse fuse_lowlevel.h: the lookup
        # count of every readdirplus entry "except . and .." is incremented).
        h = self.fs.handle(fh)
        reply, attrs = pyfuse3.readdir_reply, self.attrs
        if start_id < 2:
            dots = ((1, b".", h.node), (2, b"..", h.node.parent or h.node))
            for nxt, name, node in dots[start_id:]:
                if not reply(token, name, attrs(node), nxt):
                    return
        looked_up = self.fs.looked_up
        for nxt, entry, child in self.fs.readdir(h, max(start_id - 2, 0)):
            if not reply(token, entry.encode("utf-8"), attrs(child), nxt + 2):
                break
            looked_up(child)  # readdirplus: an accepted entry is a lookup

    @_guard_sync
    def releasedir(self, fh: int) -> None:
        self.fs.release(fh)

    @_guard
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        await self.fs.fsyncdir(self.fs.handle(fh))

    @_guard_sync
    def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self.attrs(self.fs.mkdir(parent_inode, name, mode, ctx.uid, ctx.gid))

    @_guard_durable
    def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self.fs.rmdir(parent_inode, name)

    @_guard_durable
    def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self.fs.unlink(parent_inode, name)

    @_guard_durable
    def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
               name_new: bytes, flags: int, ctx: pyfuse3.RequestContext) -> None:
        self.fs.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags)

    @_guard_sync
    def symlink(self, parent_inode: int, name: bytes, target: bytes,
                ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        raise FsError(errno.EPERM, "symlinks are not supported")

    @_guard_sync
    def link(self, inode: int, new_parent_inode: int, new_name: bytes,
                   ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        raise FsError(errno.EPERM, "hard links are not supported")

    @_guard_sync
    def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int,
              ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if stat.S_ISREG(mode):
            # O_EXCL: mknod(2) of a name that exists is EEXIST (Filesystem.create)
            fi, attrs = self._create(parent_inode, name, mode, os.O_WRONLY | os.O_EXCL, ctx)
            self.fs.release(fi.fh)
            return attrs
        raise FsError(errno.EPERM, "special files are not supported")

    # ------------------------------------------------------------------ files
    @_guard_then
    def open(self, inode: int, flags: int,
             ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo | Awaitable[pyfuse3.FileInfo]:
        behind = self._behind
        if behind and inode in behind and flags & os.O_ACCMODE != os.O_WRONLY:
            # a remote change of the file has not reached the kernel's pages and size yet
            # (Invalidator.behind): the reader gets the new content once it has
            # (Filesystem._served)
            return self._open_caught_up(inode, flags, ctx.pid)
        h = self.fs.open(inode, flags)
        if flags & _WRITABLE:
            self.interrupts.opened(h.fh, ctx.pid)
        if h.snapshot is not None:  # a .memfuse file: reads from this open's snapshot,
            # never from another's pages
            return pyfuse3.FileInfo(fh=h.fh, direct_io=True, keep_cache=False)
        return pyfuse3.FileInfo(h.fh)  # keep_cache (pyfuse3's default), no direct_io

    async def _open_caught_up(self, inode: int, flags: int, pid: int) -> pyfuse3.FileInfo:
        """``open`` (by thread ``pid``) once the kernel invalidation of ``inode`` still queued
        was performed (at most ``OPEN_CATCH_UP`` s; ``Filesystem.open`` follows with no await
        between)."""
        assert self.invalidator is not None  # open() checked
        await self.invalidator.catch_up(inode, OPEN_CATCH_UP)
        h = self.fs.open(inode, flags)
        if flags & _WRITABLE:
            self.interrupts.opened(h.fh, pid)
        if h.snapshot is not None:  # (a .memfuse file is never invalidated: not reached)
            return pyfuse3.FileInfo(fh=h.fh, direct_io=True, keep_cache=False)
        return pyfuse3.FileInfo(h.fh)

    def _create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                ctx: pyfuse3.RequestContext) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        h = self.fs.create(parent_inode, name, mode, flags, ctx.uid, ctx.gid)
        self.interrupts.opened(h.fh, ctx.pid)
        return pyfuse3.FileInfo(fh=h.fh, keep_cache=True), self.attrs(h.node)

    @_guard_sync
    def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
               ctx: pyfuse3.RequestContext) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        return self._create(parent_inode, name, mode, flags, ctx)

    @_guard_sync
    def read(self, fh: int, off: int, size: int) -> bytes:
        return self.fs.read(self.fs.handle(fh), off, size)

    @_guard_sync
    def write(self, fh: int, off: int, buf: bytes) -> int:
        return self.fs.write(self.fs.handle(fh), off, buf)

    @_guard_then
    def flush(self, fh: int) -> Awaitable[None] | None:
        h = self.fs.handle(fh, allow_stale=True)
        # a reader's close of a file nobody is writing: nothing to commit or wait for
        # (Filesystem.flush returns at once then); not calling it keeps this close, one of
        # three requests per file of a warm grep -r, at the cost of the bare floor's
        if h.flags & _WRITABLE or h.node.dirty:
            return self._flush(h)
        return None

    async def _flush(self, h: Handle) -> None:
        """A writer's flush: commit and wait (``Filesystem.flush``); what ``MODIFYING`` does
        for the other modifying requests (a reader's flush changes nothing)."""
        try:
            await self.fs.flush(h)
        finally:
            self.fs.controls.changed()
            if CHECK_INVARIANTS:  # tests: MEMFUSE_CHECK_INVARIANTS=1
                self.fs.check_invariants_after("flush")

    @_guard
    async def fsync(self, fh: int, datasync: bool) -> None:
        await self.fs.fsync(self.fs.handle(fh))

    @_guard_sync
    def release(self, fh: int) -> None:
        self.interrupts.released(fh)
        self.fs.release(fh)

    # ------------------------------------------------------------------ misc
    @_guard_sync
    def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        s = pyfuse3.StatvfsData()
        t = self.fs.statfs()
        total, used, files, nfiles = t["bytes"], t["used"], t["files"], t["nfiles"]
        s.f_bsize = BLOCK
        s.f_frsize = BLOCK
        s.f_blocks = total // BLOCK
        s.f_bfree = max(0, total - used) // BLOCK
        s.f_bavail = s.f_bfree
        s.f_files = files
        s.f_ffree = max(0, files - nfiles)
        s.f_favail = s.f_ffree
        s.f_namemax = 255
        return s

    @_guard_sync
    def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        return self.fs.getxattr(self.fs.node(inode), name.decode("utf-8", "replace"))

    @_guard_sync
    def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> Sequence[bytes]:
        return []

    @_guard_durable
    def setxattr(self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext) -> None:
        self.fs.setxattr(self.fs.node(inode), name.decode("utf-8", "replace"), value)

    @_guard_sync
    def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        raise FsError(errno.ENOTSUP)


__all__ = ["MemfuseOps", "CACHE_TIMEOUT", "CONTROL_DIR"]
