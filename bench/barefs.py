"""A bare in-memory pyfuse3 filesystem: the floor of the memfuse stack.

    python bench/barefs.py MOUNTPOINT [--from DIR]

Files live in a dict (inode -> node); nothing is logged, counted or persisted. It uses the same
kernel settings as memfuse's adapter (``memfuse/sidecar/fuse_ops.py``, PYFUSE3-NOTES "Kernel
settings"), so the difference between the two is what memfuse itself costs:

- entry and attribute timeouts of 300 s, absent names cached as negative entries
  (``st_ino = 0`` with a timeout), every entry of ``readdir`` passed with its attributes
  (readdirplus; each counts as a lookup and is forgotten later);
- ``FileInfo(keep_cache=True)`` on open and create, no ``direct_io``, writeback cache off;
- ``flush`` and ``release`` are implemented (no-ops here), so a close costs the same two round
  trips as on memfuse; ``getxattr`` answers ``ENODATA`` (memfuse answers xattr probes too);
- mount options ``default_permissions``, ``fsname``/``subtype``, ``auto_unmount``;
- served by ``pyfuse3.main()`` under trio, one mount per process.

``--from DIR`` copies a local directory tree into memory before mounting. Creating, writing,
``mkdir``, ``unlink`` and ``rename`` work in memory, enough for the write benchmark. SIGTERM or
SIGINT unmounts and exits 0. The mount is ready when ``MOUNTPOINT`` is a mount point.
"""
from __future__ import annotations

import argparse
import errno
import os
import signal
import stat
import sys
import time

import pyfuse3
import trio

TIMEOUT = 300.0
ROOT = pyfuse3.ROOT_INODE


class Node:
    __slots__ = ("ino", "mode", "data", "children", "nlookup", "mtime_ns", "ctime_ns", "nlink")

    def __init__(self, ino: int, mode: int) -> None:
        self.ino = ino
        self.mode = mode
        self.data = bytearray() if stat.S_ISREG(mode) else None
        self.children: dict[bytes, Node] | None = {} if stat.S_ISDIR(mode) else None
        self.nlookup = 0
        self.mtime_ns = self.ctime_ns = time.time_ns()
        self.nlink = 2 if stat.S_ISDIR(mode) else 1


class BareOps(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self) -> None:
        super().__init__()
        self.uid, self.gid = os.getuid(), os.getgid()
        self.inodes: dict[int, Node] = {}
        self.next_ino = ROOT
        self.root = self._new(stat.S_IFDIR | 0o755)
        self.handles: dict[int, Node] = {}
        self.next_fh = 1
        self.dir_entries: dict[int, list[tuple[bytes, Node]]] = {}

    def _new(self, mode: int) -> Node:
        n = Node(self.next_ino, mode)
        self.inodes[n.ino] = n
        self.next_ino += 1
        return n

    def load(self, src: str) -> int:
        """Copy the tree under ``src`` into memory; return the number of files."""
        count = 0
        by_path = {src: self.root}
        for dirpath, dirnames, filenames in os.walk(src):
            d = by_path[dirpath]
            for name in dirnames:
                c = self._new(stat.S_IFDIR | 0o755)
                d.children[name.encode()] = c
                d.nlink += 1
                by_path[os.path.join(dirpath, name)] = c
            for name in filenames:
                c = self._new(stat.S_IFREG | 0o644)
                with open(os.path.join(dirpath, name), "rb") as f:
                    c.data[:] = f.read()
                d.children[name.encode()] = c
                count += 1
        return count

    def attrs(self, n: Node) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = n.ino
        a.generation = 0
        a.entry_timeout = TIMEOUT
        a.attr_timeout = TIMEOUT
        a.st_mode = n.mode
        a.st_nlink = n.nlink
        a.st_uid = self.uid
        a.st_gid = self.gid
        a.st_rdev = 0
        size = 4096 if n.children is not None else len(n.data)
        a.st_size = size
        a.st_blksize = 4096
        a.st_blocks = (size + 511) // 512
        a.st_atime_ns = n.mtime_ns
        a.st_mtime_ns = n.mtime_ns
        a.st_ctime_ns = n.ctime_ns
        return a

    def _dir(self, ino: int) -> Node:
        n = self.inodes.get(ino)
        if n is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if n.children is None:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return n

    # --- lookups and attributes
    async def lookup(self, parent_inode, name, ctx):
        d = self._dir(parent_inode)
        if name == b".":
            n = d
        elif name == b"..":
            n = self.root  # good enough for a benchmark floor
        else:
            n = d.children.get(name)
        if n is None:
            a = pyfuse3.EntryAttributes()
            a.st_ino = 0
            a.entry_timeout = TIMEOUT
            return a
        n.nlookup += 1
        return self.attrs(n)

    async def forget(self, inode_list):
        for ino, nlookup in inode_list:
            n = self.inodes.get(ino)
            if n is not None:
                n.nlookup = max(0, n.nlookup - nlookup)

    async def getattr(self, inode, ctx):
        n = self.inodes.get(inode)
        if n is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self.attrs(n)

    async def setattr(self, inode, attr, fields, fh, ctx):
        n = self.inodes[inode]
        if fields.update_size and n.data is not None:
            del n.data[attr.st_size:]
            n.data.extend(b"\0" * (attr.st_size - len(n.data)))
        if fields.update_mode:
            n.mode = (n.mode & ~0o7777) | (attr.st_mode & 0o7777)
        if fields.update_mtime:
            n.mtime_ns = attr.st_mtime_ns
        n.ctime_ns = time.time_ns()
        return self.attrs(n)

    async def getxattr(self, inode, name, ctx):
        raise pyfuse3.FUSEError(errno.ENODATA)

    async def listxattr(self, inode, ctx):
        return []

    async def statfs(self, ctx):
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        s.f_blocks = s.f_bfree = s.f_bavail = 1 << 20
        s.f_files = s.f_ffree = s.f_favail = 1 << 20
        s.f_namemax = 255
        return s

    # --- directories
    async def opendir(self, inode, ctx):
        self._dir(inode)
        fh = self.next_fh
        self.next_fh += 1
        self.handles[fh] = self.inodes[inode]
        return fh

    async def readdir(self, fh, start_id, token):
        d = self.handles[fh]
        if start_id == 0 or fh not in self.dir_entries:
            self.dir_entries[fh] = sorted(d.children.items())
        entries = self.dir_entries[fh]
        for i in range(start_id, len(entries)):
            name, child = entries[i]
            if not pyfuse3.readdir_reply(token, name, self.attrs(child), i + 1):
                break
            child.nlookup += 1

    async def releasedir(self, fh):
        self.handles.pop(fh, None)
        self.dir_entries.pop(fh, None)

    async def fsyncdir(self, fh, datasync):
        return None

    async def mkdir(self, parent_inode, name, mode, ctx):
        d = self._dir(parent_inode)
        if name in d.children:
            raise pyfuse3.FUSEError(errno.EEXIST)
        n = self._new(stat.S_IFDIR | (mode & 0o7777))
        d.children[name] = n
        d.nlink += 1
        d.mtime_ns = d.ctime_ns = time.time_ns()
        n.nlookup += 1
        return self.attrs(n)

    async def rmdir(self, parent_inode, name, ctx):
        d = self._dir(parent_inode)
        n = d.children.get(name)
        if n is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if n.children:
            raise pyfuse3.FUSEError(errno.ENOTEMPTY)
        del d.children[name]
        d.nlink -= 1

    async def unlink(self, parent_inode, name, ctx):
        d = self._dir(parent_inode)
        if d.children.pop(name, None) is None:
            raise pyfuse3.FUSEError(errno.ENOENT)

    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        src, dst = self._dir(parent_inode_old), self._dir(parent_inode_new)
        n = src.children.get(name_old)
        if n is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if flags & 1 and name_new in dst.children:  # RENAME_NOREPLACE
            raise pyfuse3.FUSEError(errno.EEXIST)
        del src.children[name_old]
        dst.children[name_new] = n

    # --- files
    async def open(self, inode, flags, ctx):
        n = self.inodes[inode]
        if flags & os.O_TRUNC:
            del n.data[:]
        fh = self.next_fh
        self.next_fh += 1
        self.handles[fh] = n
        return pyfuse3.FileInfo(fh=fh, keep_cache=True)

    async def create(self, parent_inode, name, mode, flags, ctx):
        d = self._dir(parent_inode)
        n = d.children.get(name)
        if n is None:
            n = self._new(stat.S_IFREG | (mode & 0o7777))
            d.children[name] = n
            d.mtime_ns = d.ctime_ns = time.time_ns()
        elif flags & os.O_EXCL:
            raise pyfuse3.FUSEError(errno.EEXIST)
        n.nlookup += 1
        fh = self.next_fh
        self.next_fh += 1
        self.handles[fh] = n
        return pyfuse3.FileInfo(fh=fh, keep_cache=True), self.attrs(n)

    async def read(self, fh, off, size):
        return bytes(self.handles[fh].data[off:off + size])

    async def write(self, fh, off, buf):
        n = self.handles[fh]
        if off > len(n.data):
            n.data.extend(b"\0" * (off - len(n.data)))
        n.data[off:off + len(buf)] = buf
        n.mtime_ns = n.ctime_ns = time.time_ns()
        return len(buf)

    async def flush(self, fh):
        return None

    async def fsync(self, fh, datasync):
        return None

    async def release(self, fh):
        self.handles.pop(fh, None)


async def serve(ops: BareOps, mountpoint: str) -> None:
    options = set(pyfuse3.default_options)
    options |= {"fsname=barefs", "subtype=barefs", "auto_unmount"}
    pyfuse3.init(ops, mountpoint, options)
    try:
        async with trio.open_nursery() as nursery:
            async def signals() -> None:
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as sigs:
                    async for _ in sigs:
                        pyfuse3.terminate()
                        return
            nursery.start_soon(signals)
            await pyfuse3.main()
            nursery.cancel_scope.cancel()
    finally:
        pyfuse3.close(unmount=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mountpoint")
    ap.add_argument("--from", dest="src", help="copy this directory tree into memory first")
    args = ap.parse_args(argv)
    ops = BareOps()
    if args.src:
        n = ops.load(args.src)
        print(f"barefs: {n} files loaded from {args.src}", file=sys.stderr, flush=True)
    trio.run(serve, ops, args.mountpoint)
    return 0


if __name__ == "__main__":
    sys.exit(main())
