"""The FUSE adapter: ``pyfuse3.Operations`` over ``core.Filesystem``.

Each handler converts arguments, calls the core, and builds replies. Every handler is wrapped
(``_guard``): ``FsError`` becomes ``FUSEError(errno)``, a ``CacheError`` (the sidecar's own
disk full or failing) its errno with a logged reason; any other exception is logged with a
traceback and becomes ``FUSEError(EIO)``, because an uncaught exception would kill the whole
mount (PYFUSE3-NOTES "Process and errors"). Metrics per operation are counted here too.

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
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar, cast

import pyfuse3

from .control import CONTROL_DIR
from .core import Filesystem
from .inodes import CHECK_INVARIANTS, FsError, Node
from .metrics import LAT_BUCKETS, Metrics, OpStats
from .cachedir import CacheError

log = logging.getLogger("memfuse.fuse")

# seconds; see module docstring. MEMFUSE_KERNEL_CACHE_TIMEOUT overrides it for experiments
# (bench/README.md has the short-vs-long measurement that chose 300 s).
CACHE_TIMEOUT = float(os.environ.get("MEMFUSE_KERNEL_CACHE_TIMEOUT", "300"))
BLOCK = 4096
_WRITABLE = os.O_WRONLY | os.O_RDWR  # open flags of a handle that may write


# requests that may change what .memfuse/status.json shows (ControlFiles.changed); plain
# reads, opens and closes do not count (its inode and handle counts may lag by up to
# STATUS_REUSE_S), so an ``ls -l`` beside a busy reader does not render it on every stat
MODIFYING = frozenset({"setattr", "mkdir", "rmdir", "unlink", "rename", "mknod", "create",
                       "write", "flush", "fsync", "setxattr"})


_H = TypeVar("_H", bound=Callable[..., Awaitable[Any]])


def _guard(fn: _H) -> _H:
    """Wrap one handler (module docstring): errors mapped to errnos, the request counted and
    timed (``metrics.OpStats``: plain numbers, no lock; this runs for every FUSE request, so
    it stays lean: bench/README.md, "Warm grep -r: what memfuse adds per request"); the
    signature stays ``fn``'s."""
    name = fn.__name__
    modifying = name in MODIFYING
    clock = time.perf_counter

    @functools.wraps(fn)
    async def wrapper(self: MemfuseOps, *args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return await fn(self, *args, **kwargs)
        except pyfuse3.FUSEError as e:
            self.metrics.fuse_errors.labels(name, errno.errorcode.get(e.errno, str(e.errno))).inc()
            raise
        except FsError as e:
            self.metrics.fuse_errors.labels(name, errno.errorcode.get(e.errno, str(e.errno))).inc()
            raise pyfuse3.FUSEError(e.errno) from None
        except CacheError as e:  # the sidecar's own disk: full (ENOSPC) or failing (EIO)
            self.metrics.fuse_errors.labels(name, errno.errorcode.get(e.errno, str(e.errno))).inc()
            log.warning("cache disk error; answered with its errno",
                        extra={"op": name, "errno": errno.errorcode.get(e.errno), "reason": e.reason})
            raise pyfuse3.FUSEError(e.errno) from None
        except Exception:
            self.metrics.fuse_errors.labels(name, "EIO").inc()
            log.exception("unexpected error in FUSE handler; answered EIO", extra={"op": name})
            raise pyfuse3.FUSEError(errno.EIO) from None
        finally:
            if modifying:
                self.fs.controls.changed()
                if CHECK_INVARIANTS:  # tests: MEMFUSE_CHECK_INVARIANTS=1
                    self.fs.check_invariants_after(name)
            dt = clock() - t0
            st = self._op_stats.get(name)
            if st is None:
                st = self._op_stats[name] = self.metrics.fuse_ops.labels(name)
            st.sum += dt  # OpStats.observe, inline
            st.buckets[bisect_left(LAT_BUCKETS, dt)] += 1

    return cast(_H, wrapper)


class MemfuseOps(pyfuse3.Operations):
    """pyfuse3 operations of one memfuse mount (see module docstring)."""

    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, fs: Filesystem, metrics: Metrics | None = None) -> None:
        super().__init__()
        self.fs = fs
        self.metrics = metrics or Metrics()
        self._op_stats: dict[str, OpStats] = {}  # per op name, looked up once (hot path)

    # ------------------------------------------------------------------ attributes
    def attrs(self, n: Node) -> pyfuse3.EntryAttributes:
        """The attributes of ``n`` as the kernel caches them (module docstring). Built for
        every lookup, getattr and ``readdir`` entry (readdirplus), so each property of the
        node is read once."""
        a = pyfuse3.EntryAttributes()
        a.st_ino = n.ino
        a.generation = 0
        special = n.special
        timeout = 0 if special or n is self.fs.control else CACHE_TIMEOUT
        a.entry_timeout = timeout
        a.attr_timeout = timeout
        sm = n.store
        # a read-only store shows no write bits (ls -l, test -w, stat): the kernel then
        # refuses writes by other users itself (default_permissions: EACCES); root's reach
        # the handlers, which answer EROFS
        a.st_mode = n.mode if sm is None or sm.writable else n.mode & ~0o222
        a.st_nlink = self.fs.nlink(n)
        a.st_uid = n.uid
        a.st_gid = n.gid
        a.st_rdev = 0
        if special:  # the length of the content an open reads (control.py docstring)
            size = self.fs.controls.size(special)
        elif n.children is not None:
            size = BLOCK
        else:
            size = n.cur_size()
        a.st_size = size
        a.st_blksize = BLOCK
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

    @_guard
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        n = self.fs.lookup(parent_inode, name)
        if n is None:
            parent = self.fs.node(parent_inode)
            if parent is self.fs.root or parent is self.fs.control:
                raise FsError(errno.ENOENT)  # store set can change: never cache absence here
            return self._negative()
        return self.attrs(n)

    @_guard
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self.attrs(self.fs.node(inode))

    @_guard
    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
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

    @_guard
    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for ino, nlookup in inode_list:
            self.fs.forget(ino, nlookup)

    # ------------------------------------------------------------------ directories
    @_guard
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        return self.fs.opendir(inode).fh

    @_guard
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        # "." and ".." first (offsets 1 and 2), as a local directory lists them (`ls -a`).
        # They are not lookups: the kernel links no dentry for them and never forgets them
        # (linux fs/fuse/readdir.c, fuse_direntplus_link; libfuse fuse_lowlevel.h: the lookup
        # count of every readdirplus entry "except . and .." is incremented).
        h = self.fs.handle(fh)
        dots = ((1, b".", h.node), (2, b"..", h.node.parent or h.node))
        for nxt, name, node in dots[start_id:]:
            if not pyfuse3.readdir_reply(token, name, self.attrs(node), nxt):
                return
        for nxt, entry, child in self.fs.readdir(h, max(start_id - len(dots), 0)):
            if not pyfuse3.readdir_reply(token, entry.encode("utf-8"), self.attrs(child),
                                         nxt + len(dots)):
                break
            self.fs.looked_up(child)  # readdirplus: an accepted entry is a lookup

    @_guard
    async def releasedir(self, fh: int) -> None:
        self.fs.release(fh)

    @_guard
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        return None

    @_guard
    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self.attrs(self.fs.mkdir(parent_inode, name, mode, ctx.uid, ctx.gid))

    @_guard
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self.fs.rmdir(parent_inode, name)

    @_guard
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self.fs.unlink(parent_inode, name)

    @_guard
    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: pyfuse3.RequestContext) -> None:
        self.fs.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags)

    @_guard
    async def symlink(self, parent_inode: int, name: bytes, target: bytes,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        raise FsError(errno.EPERM, "symlinks are not supported")

    @_guard
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes,
                   ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        raise FsError(errno.EPERM, "hard links are not supported")

    @_guard
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if stat.S_ISREG(mode):
            fi, attrs = await self._create(parent_inode, name, mode, os.O_WRONLY, ctx)
            self.fs.release(fi.fh)
            return attrs
        raise FsError(errno.EPERM, "special files are not supported")

    # ------------------------------------------------------------------ files
    @_guard
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        h = self.fs.open(inode, flags)
        if h.node.special:  # reads from this open's snapshot, never from another's pages
            return pyfuse3.FileInfo(fh=h.fh, direct_io=True, keep_cache=False)
        return pyfuse3.FileInfo(fh=h.fh, keep_cache=True)

    async def _create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                      ctx: pyfuse3.RequestContext) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        h = self.fs.create(parent_inode, name, mode, flags, ctx.uid, ctx.gid)
        return pyfuse3.FileInfo(fh=h.fh, keep_cache=True), self.attrs(h.node)

    @_guard
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        return await self._create(parent_inode, name, mode, flags, ctx)

    @_guard
    async def read(self, fh: int, off: int, size: int) -> bytes:
        return self.fs.read(self.fs.handle(fh), off, size)

    @_guard
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        return self.fs.write(self.fs.handle(fh), off, buf)

    @_guard
    async def flush(self, fh: int) -> None:
        h = self.fs.handle(fh, allow_stale=True)
        # a reader's close of a file nobody is writing: nothing to commit or wait for
        # (Filesystem.flush returns at once then); skipping the call keeps this close,
        # one of three requests per file of a warm grep -r, at the cost of the bare floor's
        if h.flags & _WRITABLE or h.node.dirty:
            await self.fs.flush(h)

    @_guard
    async def fsync(self, fh: int, datasync: bool) -> None:
        await self.fs.fsync(self.fs.handle(fh))

    @_guard
    async def release(self, fh: int) -> None:
        self.fs.release(fh)

    # ------------------------------------------------------------------ misc
    @_guard
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
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

    @_guard
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        return self.fs.getxattr(self.fs.node(inode), name.decode("utf-8", "replace"))

    @_guard
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> Sequence[bytes]:
        return []

    @_guard
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext) -> None:
        self.fs.setxattr(self.fs.node(inode), name.decode("utf-8", "replace"), value)

    @_guard
    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        raise FsError(errno.ENOTSUP)


__all__ = ["MemfuseOps", "CACHE_TIMEOUT", "CONTROL_DIR"]
