"""A power-cut harness: a FUSE filesystem that keeps every byte not yet fsynced in memory only,
so that cutting it leaves on disk exactly what a power cut would (tests/test_powercut.py).

A SIGKILL of a process keeps everything it wrote in the kernel's page cache: a missing fsync is
invisible to every kill test. Here the "disk" is a backing directory, and a passthrough FUSE
filesystem at a mountpoint stands between it and the programs under test:

    python tests/powercut.py BACKING MOUNTPOINT --report FILE

(one mount per process: pyfuse3 keeps its session in module globals). The test side is
``PowerCutMount`` (a context manager that starts that process and waits for the mount) and its
``cut()``.

The model (what the backing directory holds at any moment = what survives a power cut):

- **Data is volatile until fsync.** A ``write(2)`` lands in the file's *overlay* in this
  process's memory (``Dirty``: 4 KiB pages and the file's size), never in the backing file;
  reads, ``stat`` and shared mmaps see the overlay (it plays the page cache). ``fsync(2)`` or
  ``fdatasync(2)`` of the file, through any descriptor, writes its overlay into the backing
  file and drops it (``msync(MS_SYNC)`` too: the kernel sends it as a fsync). Nothing else
  syncs: not ``close(2)`` (flush, release), not the kernel's writeback of an mmap, not
  ``syncfs`` / ``sync`` (no request reaches the filesystem), not unmounting. A file's size grown by writes is data too: it is durable at the fsync.
- **Metadata is durable at once.** create, mkdir, unlink, rmdir, rename, truncate (also
  ``O_TRUNC``), chmod, chown and utimens are applied to the backing directory by the handler,
  before it answers. That is kinder to the program than real filesystems: ext4 (data=ordered) commits
  metadata in its journal every few seconds, so a rename or unlink that was not followed by
  an fsync of the directory can be lost, and a rename over a file whose new data was not
  fsynced can leave that file empty (ext4's ``auto_da_alloc`` flushes that data in the
  rename, XFS and btrfs differ); a truncate can be lost too. None of that is modelled: a
  program that forgets to fsync a *directory* passes here; only a missing fsync of a file's
  *data* shows. fsyncdir is accepted and does nothing.
- **Writes are not torn.** What is dropped at a cut is every unsynced write, whole; a real
  disk may keep some of them (any subset, any order, even a torn sector). Keeping none is
  the case that shows a missing fsync: SQLite's WAL and rollback journal are designed to
  survive any subset, so "none" is the strictest honest outcome for them.

Shared mmaps (SQLite's ``-shm``): without ``direct_io`` the kernel maps the page cache of a
FUSE file and writes dirty pages back through ``write`` requests (at ``msync``, at close, or
when it likes); every process on this machine maps the same page-cache pages, so SQLite's
wal-index works as on a local disk. The kernel's page cache of a file is kept across opens
(``keep_cache``: only this kernel ever changes the backing files while mounted, so the cache
is never stale). After a cut the ``-shm`` holds whatever was synced (SQLite never fsyncs it)
and SQLite rebuilds it from the WAL at the first open, as after a real crash. Locks (POSIX
``fcntl``, ``flock``) are kept by the kernel for a FUSE filesystem that does not implement
them: they work between processes of this machine. No product setting is changed for this.

The cut (``PowerCutMount.cut``, ``cut_all`` for several disks of one machine at once): the
processes that use the mount (open files, mmaps, working directory) are stopped (SIGSTOP);
the filesystem process is told (SIGUSR1) to write its report (what it drops: ``CutReport``)
and SIGKILLs itself, so it never writes another byte to the backing directory nor finishes
a fsync in flight; then the stopped processes are SIGKILLed and the mount is removed
(``fusermount3 -uz``). Every wait is bounded. Leaving the ``with`` block without a cut is a
clean shutdown (SIGTERM: every overlay is written to the backing files, as ``sync`` at a
shutdown would). ``fsync_delay`` makes every fsync slow (``PowerCutMount``): a write
answered before its fsync finished is then lost by a cut made right after the answer, on
any machine.

Limits: one backing directory on one local filesystem; regular files and directories only
(symlink, link and mknod → ``EPERM``); no xattrs (``ENOSYS``: the kernel stops asking); no
``fallocate`` (glibc's ``posix_fallocate`` then writes the range: data, volatile as any);
mounting needs root (CI runs as root; the tests skip otherwise). Inode numbers on the mount
are the harness's own (not the backing file's): each known file holds an ``O_PATH``
descriptor of its backing file, so a backing inode number is never reused while the harness
knows it. The backing files are not fsynced when the overlay is written to them: the backing
directory stands for the disk, and the machine that runs the test does not lose power.
"""
from __future__ import annotations

import argparse
import ctypes
import errno
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import pyfuse3
import trio

log = logging.getLogger("powercut")

PAGE = 4096  # bytes of one overlay page
TIMEOUT = 5.0  # s the kernel may cache entries and attributes (only this kernel changes them)
FSNAME = "powercut"


# ------------------------------------------------------------------ the filesystem process


@dataclass
class Dirty:
    """A file's data written and not yet fsynced: its current ``size`` (bytes) and the pages
    (index → ``PAGE`` bytes) written since the last fsync, plus the mtime of the last write
    (ns). INVARIANT: every byte of a page at or after ``size`` is zero; the backing file is
    never longer than ``size`` (writes only grow ``size``; a truncate sets both)."""

    size: int
    mtime_ns: int
    pages: dict[int, bytearray] = field(default_factory=dict)


@dataclass
class Inode:
    """A file or directory the harness knows: its FUSE inode number, an ``O_PATH`` descriptor
    of the backing file (``path_fd``: pins the backing inode), a read-write descriptor for
    regular files (``rw``, opened at the first open), the kernel's lookup count, the open
    handles, the overlay (``dirty``: None when every byte is synced) and the last path seen
    (for the report). INVARIANT: kept while ``nlookup > 0`` or ``handles > 0`` or (``dirty``
    and the backing file still has a link): dirty data of a closed, forgotten file stays
    readable, like the page cache."""

    ino: int
    key: tuple[int, int]  # (st_dev, st_ino) of the backing file
    path_fd: int
    name: str
    rw: int | None = None
    nlookup: int = 0
    handles: int = 0
    dirty: Dirty | None = None


def _proc(fd: int) -> str:
    return f"/proc/self/fd/{fd}"


@contextmanager
def _errors() -> Iterator[None]:
    """Every handler's body: ``OSError`` → its errno; anything else is logged and becomes
    ``EIO`` (any other exception would end the filesystem)."""
    try:
        yield
    except pyfuse3.FUSEError:
        raise
    except OSError as e:
        raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
    except Exception:
        log.exception("handler failed")
        raise pyfuse3.FUSEError(errno.EIO) from None


_libc = ctypes.CDLL(None, use_errno=True)


def _renameat2(old_fd: int, old: bytes, new_fd: int, new: bytes, flags: int) -> None:
    """renameat2(2) (Python has no binding); raises ``OSError``."""
    if _libc.renameat2(old_fd, old, new_fd, new, ctypes.c_uint(flags)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


class PowerCutOps(pyfuse3.Operations):
    """The passthrough with volatile data (module docstring). Every handler is synchronous
    inside (no ``await``; ``fsync`` sleeps ``fsync_delay`` s first, then syncs without one),
    so each runs whole before the next: no lock is needed. GUARDED_BY(the trio thread):
    every attribute."""

    enable_writeback_cache = False  # writes reach ``write`` at once, in order

    def __init__(self, backing: Path, fsync_delay: float = 0.0) -> None:
        super().__init__()
        self.fsync_delay = fsync_delay  # s every fsync takes before it syncs (a slow disk)
        fd = os.open(backing, os.O_PATH | os.O_DIRECTORY)
        st = os.fstat(fd)
        root = Inode(pyfuse3.ROOT_INODE, (st.st_dev, st.st_ino), fd, ".", nlookup=1)
        self.inodes: dict[int, Inode] = {root.ino: root}
        self.by_key: dict[tuple[int, int], Inode] = {root.key: root}
        self.handles: dict[int, Inode] = {}
        self.dirs: dict[int, tuple[Inode, list[str]]] = {}
        self.next_ino = pyfuse3.ROOT_INODE + 1
        self.next_fh = 1
        self.cut = False  # once set, every handler answers EIO and nothing reaches the backing
        self.stats = {"writes": 0, "bytes_written": 0, "fsyncs": 0, "bytes_synced": 0}

    # ---- inodes

    def _node(self, ino: int) -> Inode:
        if self.cut:
            raise pyfuse3.FUSEError(errno.EIO)
        node = self.inodes.get(ino)
        if node is None:
            raise pyfuse3.FUSEError(errno.ESTALE)
        return node

    def _known(self, parent: Inode, name: bytes, st: os.stat_result) -> Inode:
        """The Inode of ``name`` in ``parent`` (stat ``st``), made when unknown."""
        sub = f"{parent.name}/{os.fsdecode(name)}"
        node = self.by_key.get((st.st_dev, st.st_ino))
        if node is not None:
            node.name = sub
            return node
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW, dir_fd=parent.path_fd)
        st2 = os.fstat(fd)
        node = Inode(self.next_ino, (st2.st_dev, st2.st_ino), fd, sub)
        self.next_ino += 1
        self.inodes[node.ino] = node
        self.by_key[node.key] = node
        return node

    def _maybe_drop(self, node: Inode) -> None:
        """Forget ``node`` when nothing needs it any more (``Inode``'s INVARIANT)."""
        if node.ino == pyfuse3.ROOT_INODE or node.nlookup > 0 or node.handles > 0:
            return
        if node.dirty is not None and os.fstat(node.path_fd).st_nlink > 0:
            return
        del self.inodes[node.ino]
        if self.by_key.get(node.key) is node:
            del self.by_key[node.key]
        if node.rw is not None:
            os.close(node.rw)
        os.close(node.path_fd)

    def _attrs(self, node: Inode, st: os.stat_result | None = None) -> pyfuse3.EntryAttributes:
        st = st or os.fstat(node.path_fd)
        a = pyfuse3.EntryAttributes()
        a.st_ino = node.ino
        a.generation = 0
        a.entry_timeout = a.attr_timeout = TIMEOUT
        a.st_mode, a.st_nlink, a.st_uid, a.st_gid = st.st_mode, st.st_nlink, st.st_uid, st.st_gid
        a.st_rdev = st.st_rdev
        a.st_size = st.st_size if node.dirty is None else node.dirty.size
        a.st_blksize = PAGE
        a.st_blocks = (a.st_size + 511) // 512
        a.st_atime_ns, a.st_ctime_ns = st.st_atime_ns, st.st_ctime_ns
        a.st_mtime_ns = st.st_mtime_ns if node.dirty is None else node.dirty.mtime_ns
        return a

    def _entry(self, parent: Inode, name: bytes) -> tuple[Inode, pyfuse3.EntryAttributes]:
        """Look ``name`` up in ``parent`` and count the kernel's lookup."""
        st = os.stat(name, dir_fd=parent.path_fd, follow_symlinks=False)
        node = self._known(parent, name, st)
        node.nlookup += 1
        return node, self._attrs(node)

    def _rw(self, node: Inode) -> int:
        if node.rw is None:
            node.rw = os.open(_proc(node.path_fd), os.O_RDWR | os.O_CLOEXEC)
        return node.rw

    # ---- data

    def _read(self, node: Inode, off: int, size: int) -> bytes:
        d, rw = node.dirty, self._rw(node)
        if d is None:
            return os.pread(rw, size, off)
        end, out, pos = min(off + size, d.size), bytearray(), off
        while pos < end:
            idx, within = divmod(pos, PAGE)
            n = min(PAGE - within, end - pos)
            page = d.pages.get(idx)
            if page is not None:
                out += page[within:within + n]
            else:  # clean page: the backing file's bytes, zeros past its end (it is shorter)
                chunk = os.pread(rw, n, pos)
                out += chunk + bytes(n - len(chunk))
            pos += n
        return bytes(out)

    def _write(self, node: Inode, off: int, buf: bytes) -> None:
        rw = self._rw(node)
        if node.dirty is None:
            node.dirty = Dirty(os.fstat(rw).st_size, time.time_ns())
        d, pos, end = node.dirty, off, off + len(buf)
        while pos < end:
            idx, within = divmod(pos, PAGE)
            n = min(PAGE - within, end - pos)
            page = d.pages.get(idx)
            if page is None:
                page = bytearray(PAGE)
                chunk = os.pread(rw, PAGE, idx * PAGE)  # the backing file is no longer than size
                page[:len(chunk)] = chunk
                d.pages[idx] = page
            page[within:within + n] = buf[pos - off:pos - off + n]
            pos += n
        d.size = max(d.size, end)
        d.mtime_ns = time.time_ns()
        self.stats["writes"] += 1
        self.stats["bytes_written"] += len(buf)

    def _sync(self, node: Inode) -> None:
        """Write ``node``'s overlay into its backing file (the fsync) and drop it."""
        d = node.dirty
        if d is None:
            return
        rw = self._rw(node)
        for idx in sorted(d.pages):
            start = idx * PAGE
            if start < d.size:
                data = d.pages[idx][:min(PAGE, d.size - start)]
                os.pwrite(rw, data, start)
                self.stats["bytes_synced"] += len(data)
        os.ftruncate(rw, d.size)
        st = os.fstat(rw)
        os.utime(rw, ns=(st.st_atime_ns, d.mtime_ns))
        node.dirty = None

    def _truncate(self, node: Inode, size: int) -> None:
        """Set the size: in the backing file at once (metadata), and in the overlay."""
        d = node.dirty
        if d is not None:
            for idx in [i for i in d.pages if i * PAGE >= size]:
                del d.pages[idx]
            idx, within = divmod(size, PAGE)
            if within and idx in d.pages:
                d.pages[idx][within:] = bytes(PAGE - within)
            d.size = size
            d.mtime_ns = time.time_ns()
        os.truncate(_proc(node.path_fd), size)

    def sync_all(self) -> None:
        """Write every overlay to the backing files (a clean shutdown)."""
        for node in list(self.inodes.values()):
            if node.dirty is not None:
                self._sync(node)

    def dropped(self) -> list[dict[str, object]]:
        """What a cut drops now: per dirty file its last path, overlay size, pages and the
        backing file's size."""
        out: list[dict[str, object]] = []
        for node in self.inodes.values():
            if node.dirty is not None:
                out.append({"path": node.name, "size": node.dirty.size,
                            "pages": len(node.dirty.pages),
                            "backing_size": os.fstat(node.path_fd).st_size})
        return sorted(out, key=lambda r: str(r["path"]))

    # ---- handlers

    async def lookup(self, parent_inode: int, name: bytes,
                     ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        with _errors():
            return self._entry(self._node(parent_inode), name)[1]

    async def forget(self, inode_list: list[tuple[int, int]]) -> None:  # type: ignore[override]
        with _errors():
            for ino, n in inode_list:
                node = self.inodes.get(ino)
                if node is not None:
                    node.nlookup = max(0, node.nlookup - n)
                    self._maybe_drop(node)

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        with _errors():
            return self._attrs(self._node(inode))

    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                      fh: int | None, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        with _errors():
            node = self._node(inode)
            path = _proc(node.path_fd)
            if fields.update_size:
                self._truncate(node, attr.st_size)
            if fields.update_mode:
                os.chmod(path, stat.S_IMODE(attr.st_mode))
            if fields.update_uid or fields.update_gid:
                os.chown(path, attr.st_uid if fields.update_uid else -1,
                         attr.st_gid if fields.update_gid else -1)
            if fields.update_atime or fields.update_mtime:
                st = os.fstat(node.path_fd)
                mtime = attr.st_mtime_ns if fields.update_mtime else (
                    st.st_mtime_ns if node.dirty is None else node.dirty.mtime_ns)
                os.utime(path, ns=(attr.st_atime_ns if fields.update_atime else st.st_atime_ns, mtime))
                if node.dirty is not None:
                    node.dirty.mtime_ns = mtime
            return self._attrs(node)

    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        raise pyfuse3.FUSEError(errno.EPERM)

    async def symlink(self, parent_inode: int, name: bytes, target: bytes,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        raise pyfuse3.FUSEError(errno.EPERM)

    async def link(self, inode: int, new_parent_inode: int, new_name: bytes,
                   ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        raise pyfuse3.FUSEError(errno.EPERM)

    async def mkdir(self, parent_inode: int, name: bytes, mode: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        with _errors():
            parent = self._node(parent_inode)
            os.mkdir(name, mode, dir_fd=parent.path_fd)
            os.chown(name, ctx.uid, ctx.gid, dir_fd=parent.path_fd, follow_symlinks=False)
            return self._entry(parent, name)[1]

    def _remove(self, parent_inode: int, name: bytes, is_dir: bool) -> None:
        parent = self._node(parent_inode)
        st = os.stat(name, dir_fd=parent.path_fd, follow_symlinks=False)
        (os.rmdir if is_dir else os.unlink)(name, dir_fd=parent.path_fd)
        node = self.by_key.get((st.st_dev, st.st_ino))
        if node is not None:
            self._maybe_drop(node)

    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        with _errors():
            self._remove(parent_inode, name, False)

    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        with _errors():
            self._remove(parent_inode, name, True)

    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: pyfuse3.RequestContext) -> None:
        with _errors():
            old, new = self._node(parent_inode_old), self._node(parent_inode_new)
            try:
                st = os.stat(name_new, dir_fd=new.path_fd, follow_symlinks=False)
                target = self.by_key.get((st.st_dev, st.st_ino))
            except FileNotFoundError:
                target = None
            if flags:
                _renameat2(old.path_fd, name_old, new.path_fd, name_new, flags)
            else:
                os.rename(name_old, name_new, src_dir_fd=old.path_fd, dst_dir_fd=new.path_fd)
            st = os.stat(name_new, dir_fd=new.path_fd, follow_symlinks=False)
            moved = self.by_key.get((st.st_dev, st.st_ino))
            if moved is not None:
                moved.name = f"{new.name}/{os.fsdecode(name_new)}"
            if target is not None and target is not moved:
                self._maybe_drop(target)

    def _open(self, node: Inode, flags: int) -> pyfuse3.FileInfo:
        self._rw(node)
        if flags & os.O_TRUNC:
            self._truncate(node, 0)
        fh = self.next_fh
        self.next_fh += 1
        self.handles[fh] = node
        node.handles += 1
        return pyfuse3.FileInfo(fh=fh, keep_cache=True)

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        with _errors():
            return self._open(self._node(inode), flags)

    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        with _errors():
            parent = self._node(parent_inode)
            fd = os.open(name, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
                         | (flags & os.O_EXCL), mode, dir_fd=parent.path_fd)
            try:
                os.fchown(fd, ctx.uid, ctx.gid)
            finally:
                os.close(fd)
            node, attrs = self._entry(parent, name)
            info = self._open(node, flags)
            return info, self._attrs(node)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        with _errors():
            if self.cut:
                raise pyfuse3.FUSEError(errno.EIO)
            return self._read(self.handles[fh], off, size)

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        with _errors():
            if self.cut:
                raise pyfuse3.FUSEError(errno.EIO)
            self._write(self.handles[fh], off, buf)
            return len(buf)

    async def flush(self, fh: int) -> None:
        return None  # close(2) is not a sync

    async def release(self, fh: int) -> None:
        with _errors():
            node = self.handles.pop(fh)
            node.handles -= 1
            if not self.cut:
                self._maybe_drop(node)

    async def fsync(self, fh: int, datasync: bool) -> None:
        with _errors():
            if self.cut:
                raise pyfuse3.FUSEError(errno.EIO)
            node = self.handles[fh]  # the fsync holds the descriptor: no release meanwhile
        if self.fsync_delay > 0:
            await trio.sleep(self.fsync_delay)  # a slow disk; other requests are served meanwhile
        with _errors():
            if self.cut:
                raise pyfuse3.FUSEError(errno.EIO)
            self.stats["fsyncs"] += 1
            self._sync(node)

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        with _errors():
            node = self._node(inode)
            fd = os.open(_proc(node.path_fd), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                names = sorted(os.listdir(fd))
            finally:
                os.close(fd)
            fh = self.next_fh
            self.next_fh += 1
            self.dirs[fh] = (node, names)
            return fh

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        with _errors():
            parent, names = self.dirs[fh]
            for i in range(start_id, len(names)):
                name = os.fsencode(names[i])
                try:
                    st = os.stat(name, dir_fd=parent.path_fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                node = self._known(parent, name, st)
                if not pyfuse3.readdir_reply(token, name, self._attrs(node, None), i + 1):
                    self._maybe_drop(node)
                    break
                node.nlookup += 1  # readdirplus: every entry replied counts as a lookup

    async def releasedir(self, fh: int) -> None:
        self.dirs.pop(fh, None)

    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        return None  # metadata is durable at once (module docstring)

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        with _errors():
            v = os.statvfs(_proc(self._node(pyfuse3.ROOT_INODE).path_fd))
            s = pyfuse3.StatvfsData()
            s.f_bsize, s.f_frsize, s.f_blocks = v.f_bsize, v.f_frsize, v.f_blocks
            s.f_bfree, s.f_bavail, s.f_files = v.f_bfree, v.f_bavail, v.f_files
            s.f_ffree, s.f_favail, s.f_namemax = v.f_ffree, v.f_favail, v.f_namemax
            return s


async def serve(backing: Path, mountpoint: Path, report: Path, fsync_delay: float = 0.0) -> None:
    """Mount ``backing`` at ``mountpoint`` until SIGTERM / SIGINT (every overlay synced, then
    unmounted) or SIGUSR1 (the cut: ``report`` written as JSON — ``dropped``, the files whose
    unsynced data the cut loses, and ``stats`` — then this process SIGKILLs itself). Every fsync takes ``fsync_delay`` s.
    """
    ops = PowerCutOps(backing, fsync_delay)
    options = set(pyfuse3.default_options) | {f"fsname={FSNAME}", f"subtype={FSNAME}"}
    pyfuse3.init(ops, str(mountpoint), options)
    clean = False
    try:
        async with trio.open_nursery() as nursery:
            async def signals() -> None:
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGUSR1) as sigs:
                    async for sig in sigs:
                        if sig == signal.SIGUSR1:
                            ops.cut = True
                            tmp = report.with_name(report.name + ".tmp")
                            tmp.write_text(json.dumps({"dropped": ops.dropped(), "stats": ops.stats}))
                            os.replace(tmp, report)
                            os.kill(os.getpid(), signal.SIGKILL)
                        ops.sync_all()
                        pyfuse3.terminate()
                        return
            nursery.start_soon(signals)
            await pyfuse3.main()
            clean = True
            nursery.cancel_scope.cancel()
    finally:
        pyfuse3.close(unmount=clean)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("backing", type=Path)
    ap.add_argument("mountpoint", type=Path)
    ap.add_argument("--report", type=Path, required=True)
    ap.add_argument("--fsync-delay", type=float, default=0.0,
                    help="seconds every fsync waits before it syncs and answers (a slow disk)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    trio.run(serve, args.backing.resolve(), args.mountpoint.resolve(), args.report.resolve(),
             args.fsync_delay)
    return 0


# ------------------------------------------------------------------ the test side


@dataclass
class CutReport:
    """What a cut did: ``dropped`` (per file whose unsynced data was lost: ``path`` relative
    to the backing directory as last seen, ``size`` it had, ``pages`` dropped,
    ``backing_size`` it keeps), ``stats`` of the filesystem's life (``writes``,
    ``bytes_written``, ``fsyncs``, ``bytes_synced``) and ``killed``, the pids it SIGKILLed."""

    dropped: list[dict[str, object]]
    stats: dict[str, int]
    killed: list[int]

    def dropped_paths(self) -> set[str]:
        return {str(r["path"]).removeprefix("./") for r in self.dropped}


def _mounted(path: Path) -> bool:
    target = os.path.realpath(path)
    with open("/proc/mounts") as f:
        return any(line.split()[1] == target for line in f)


def _wait(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


class PowerCutMount:
    """The power-cut filesystem over ``backing`` at ``mountpoint`` (both made if missing), in
    its own process (its stderr to ``log``, ``mountpoint.parent/powercut.log`` unless told).
    ``with PowerCutMount(b, m) as pc: ... pc.cut()``: entering waits (``timeout`` s at most)
    for the mount; ``cut()`` is the power cut; leaving the block without a cut is a clean
    shutdown (every overlay written to ``backing``); either way the mount is gone afterwards
    (a lazy unmount in a ``finally``) and the process reaped.

    ``fsync_delay`` (s): every fsync waits that long before it syncs and answers, a slow
    disk. It makes "answered before its fsync" deterministic to catch: a program that
    answers a write and syncs it afterwards (in a background task, a group commit after the
    answer) has its data still unsynced for at least that long after the answer, so a cut
    made at once after the answer loses it, however fast the machine; a program that
    answers after its fsync only gets slower. Unlike a slow local disk, the kernel holds
    the file's inode lock across a FUSE fsync: writes to that file wait for it (a program
    that fsyncs one file in a loop while writing it crawls)."""

    def __init__(self, backing: Path, mountpoint: Path, log: Path | None = None,
                 timeout: float = 30.0, fsync_delay: float = 0.0) -> None:
        self.backing, self.mountpoint = backing, mountpoint
        self.fsync_delay = fsync_delay
        self.log = log or mountpoint.parent / "powercut.log"
        self.report = mountpoint.parent / f"{mountpoint.name}.cut.json"
        self.timeout = timeout
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> "PowerCutMount":
        self.backing.mkdir(parents=True, exist_ok=True)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, str(self.backing), str(self.mountpoint),
                 "--report", str(self.report), "--fsync-delay", str(self.fsync_delay)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            proc = self.proc
            _wait(lambda: _mounted(self.mountpoint) or proc.poll() is not None, self.timeout,
                  f"the power-cut mount at {self.mountpoint}")
            if not _mounted(self.mountpoint):
                raise AssertionError(f"the power-cut filesystem exited {proc.returncode}:\n"
                                     + self.log.read_text(errors="replace")[-3000:])
        except BaseException:
            self._end(clean=False)
            raise
        return self

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._end(clean=True)

    def users(self) -> list[int]:
        """Pids of the processes using the mount: an open file, an mmap or the working
        directory under it (this process excluded)."""
        root = os.path.realpath(self.mountpoint)
        under = (root, root + "/")
        out = []
        for pid_s in os.listdir("/proc"):
            if not pid_s.isdigit() or int(pid_s) == os.getpid():
                continue
            base = f"/proc/{pid_s}"
            try:
                links = [os.readlink(f"{base}/cwd")]
                fds = os.listdir(f"{base}/fd")
                for fd in fds:
                    try:
                        links.append(os.readlink(f"{base}/fd/{fd}"))
                    except OSError:
                        pass
                with open(f"{base}/maps") as f:
                    links += [line.split(None, 5)[-1].strip() for line in f if "/" in line]
            except OSError:
                continue  # gone, or a kernel thread
            if any(x == under[0] or x.startswith(under[1]) for x in links):
                out.append(int(pid_s))
        return out

    def cut(self, kill: bool = True) -> CutReport:
        """The power cut of this mount alone: ``cut_all(self, kill=kill)``."""
        return cut_all(self, kill=kill)[0]

    def _die(self) -> None:
        """Tell the filesystem to cut (SIGUSR1: it writes its report and SIGKILLs itself, so
        it answers nothing more and writes no other byte to the backing directory) and reap
        it (``timeout`` s at most, else SIGKILL and ``AssertionError``)."""
        assert self.proc is not None and self.proc.poll() is None, "the power-cut mount is not up"
        self.report.unlink(missing_ok=True)
        self.proc.send_signal(signal.SIGUSR1)
        try:
            self.proc.wait(self.timeout)
        except subprocess.TimeoutExpired:
            self._end(clean=False)
            raise AssertionError("the power-cut filesystem did not die at the cut") from None

    def _report(self, killed: list[int]) -> CutReport:
        if not self.report.exists():
            raise AssertionError("the power-cut filesystem wrote no report:\n"
                                 + self.log.read_text(errors="replace")[-3000:])
        data = json.loads(self.report.read_text())
        return CutReport(data["dropped"], data["stats"], killed)

    def _end(self, clean: bool) -> None:
        """Stop the process (SIGTERM when ``clean``: it syncs and unmounts; SIGKILL after
        ``timeout`` s or when not clean), reap it, then unmount lazily and wait (bounded)
        until the mount is gone. Idempotent."""
        proc = self.proc
        try:
            if proc is not None and proc.poll() is None:
                if clean:
                    proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(self.timeout)
                    except subprocess.TimeoutExpired:
                        pass
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(self.timeout)
        finally:
            if _mounted(self.mountpoint):
                subprocess.run(["fusermount3", "-uz", str(self.mountpoint)], capture_output=True,
                               timeout=self.timeout)
            _wait(lambda: not _mounted(self.mountpoint), self.timeout,
                  f"{self.mountpoint} to be unmounted")


def cut_all(*mounts: PowerCutMount, kill: bool = True) -> list[CutReport]:
    """One power cut of every mount in ``mounts`` (one machine losing power: its disks at
    once), in the order that lets no process act between the instant and its death:

    1. with ``kill``, every process using any of the mounts is stopped (SIGSTOP: it runs no
       more code; one waiting on a request of the filesystem stays in the kernel);
    2. each filesystem cuts: it drops every unsynced byte and dies at once, so a fsync in
       flight (``fsync_delay``) never completes, and a request in flight fails;
    3. the stopped processes are SIGKILLed and waited for (``timeout`` s at most); each
       mount is removed (``fusermount3 -uz``) and its unmount waited for.

    Killing the processes first instead would let a fsync they have in flight complete (a
    process killed while it waits for a FUSE answer dies only once the answer came), which
    would hide a write answered before its fsync. A caller that wants its processes gone
    first passes ``kill=False`` after killing them. Returns each mount's ``CutReport``
    (``killed``: the pids of step 3, on every report). Raises ``AssertionError`` when a wait
    times out; every mount is removed even then."""
    timeout = max(m.timeout for m in mounts)
    stopped: list[int] = []
    try:
        if kill:
            stopped = sorted({pid for m in mounts for pid in m.users()})
            for pid in stopped:
                _signal(pid, signal.SIGSTOP)
        for m in mounts:
            m._die()
    finally:
        for pid in stopped:
            _signal(pid, signal.SIGKILL)
        try:
            _wait(lambda: not [p for p in stopped if _alive(p)], timeout,
                  f"the processes using the mount ({stopped}) to die")
        finally:
            for m in mounts:
                m._end(clean=False)
    return [m._report(stopped) for m in mounts]


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as dead: its files and maps are gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
