"""The filesystem core: memfuse's namespace and file semantics, without FUSE (docs/SEMANTICS.md).

``Filesystem`` keeps the inode table of the one mount (root → one directory per attached store →
directories implied by record paths → files), answers every lookup / getattr / readdir / read
from memory and the local blob cache, applies writes locally at once, and turns flushed changes
into outbox entries (``outbox.Committer``). The FUSE adapter (``fuse_ops``) is a thin layer that
converts arguments and maps ``FsError`` to ``pyfuse3.FUSEError``.

Concurrency: every method runs on the trio thread. Methods without ``await`` are atomic with
respect to each other; the only awaits are in ``flush`` / ``fsync`` (waiting for the outbox),
after all state changes are done, so no invariant is broken across an ``await``.

Content: a clean file's bytes are in ``BlobCache`` (rows keyed by sha256 in one SQLite file in
the cache directory); a file being written has a ``bytearray`` buffer on its node until flush, when the
buffer is stored as a blob and an outbox ``put`` entry (which carries the bytes durably) is
submitted.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import stat
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import trio

from .. import names
from ..models import DEFAULT_MODE, RECORD_TYPES, Record, datetime_ns, sha256_hex

try:  # shared content rules (types, secrets) for the fast path; the server enforces them too
    from .. import content as content_rules
except ImportError:  # pragma: no cover
    content_rules = None
from .blobcache import BlobCache
from .control import CONTROL_DIR, FILES, ControlFiles
from .outbox import (ATTRS, DELETE, MOVE, MOVE_PREFIX, PUT, CacheError, Committer, Entry,
                     cache_error)

log = logging.getLogger("memfuse.fs")

ROOT_INO = 1
# renameat2(2) flags (linux/fs.h); pyfuse3 passes them through as the kernel sent them
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
# a store's limits when the control plane gives none (StoreMount's defaults, statfs of an
# empty mount)
DEFAULT_MAX_RECORD_BYTES = 1 << 20
DEFAULT_MAX_STORE_BYTES = 64 << 20
DEFAULT_MAX_RECORDS = 10_000
CLEAN, PENDING, REJECTED = "clean", "pending", "rejected"
DIR_MODE = 0o755  # permission bits of a directory nobody chmod-ed
DIR_MODES_KEY = "_modes"  # dirs.json: {slug: {dir path ("" = store root): mode}}; never a slug


class FsError(Exception):
    """A refusal with an errno (``errno.E*``) and a reason for logs and ``errors.log``."""

    def __init__(self, err: int, reason: str = "") -> None:
        super().__init__(reason or os.strerror(err))
        self.errno = err
        self.reason = reason or os.strerror(err)


@dataclass(eq=False, slots=True)
class Node:
    """One inode. Directories have ``children``; files have content state.

    ``key`` names the file in the outbox (``r:<record id>`` / ``n:<uuid>``); ``sha`` is the
    blob of the current content when ``buf`` is None; ``base_sha`` the content the control
    plane last acknowledged. ``local_only`` files never leave the sidecar.
    """

    ino: int
    name: str
    parent: "Node | None"
    is_dir: bool
    store: "StoreMount | None" = None
    mode: int = 0
    uid: int = 0
    gid: int = 0
    atime_ns: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0
    children: dict[str, "Node"] | None = None
    key: str = ""
    record_id: str | None = None
    version: int = 0
    rtype: str | None = None
    sha: str = ""
    size: int = 0
    buf: bytearray | None = None
    dirty: bool = False
    state: str = CLEAN
    error: str = ""
    local_only: bool = False
    last_put: Entry | None = None
    updated_at: str = ""
    nlookup: int = 0
    opened: int = 0
    unlinked: bool = False
    special: str = ""  # .memfuse control files: "status" / "errors"
    type_override: str | None = None  # set through user.memfuse.type, sent with the next put
    refused: int = 0  # errno of a write refused in the current write session (held back)
    # File attributes (records): ``mode`` holds the permission bits shown and sent; ``xmtime``
    # is the explicit mtime (utimensat) the record keeps, None when it follows the last write
    # (``updated_at``); ``attrs_version``: the version our last attribute change made, when
    # it was made on content not seen here yet (older remote states keep our attributes).
    xmtime: int | None = None
    attrs_version: int = 0

    def path(self) -> str:
        """Store-relative path ``a/b.md`` ('' for a store root)."""
        parts = []
        n = self
        while n.parent is not None and n.store is not None and n is not n.store.root:
            parts.append(n.name)
            n = n.parent
        return "/".join(reversed(parts))

    def cur_size(self) -> int:
        return len(self.buf) if self.buf is not None else self.size


@dataclass(eq=False)
class StoreMount:
    """One attached store as a directory at the mount root."""

    slug: str
    access: str
    root: Node
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    max_store_bytes: int = DEFAULT_MAX_STORE_BYTES
    max_records: int = DEFAULT_MAX_RECORDS
    detached: bool = False  # removed from the mount: open handles get ESTALE
    used: int = 0  # bytes of the live records' current local content (quota fast path)
    count: int = 0  # live records (files that are not local-only)

    @property
    def writable(self) -> bool:
        return self.access == "read_write"


@dataclass
class Handle:
    fh: int
    node: Node
    flags: int
    is_dir: bool = False
    entries: list[tuple[str, Node]] | None = None
    modified: bool = False  # write(2) or ftruncate(2) through this handle since open
    snapshot: bytes | None = None  # .memfuse files: content generated once at open


@dataclass
class Settings:
    """Tunables of one mount (see ``MountConfig``). Times in seconds."""

    uid: int = field(default_factory=os.getuid)
    gid: int = field(default_factory=os.getgid)
    commit_wait: float = 10.0
    fsync_timeout: float = 60.0
    local_only_patterns: tuple[str, ...] = names.DEFAULT_LOCAL_ONLY


class Filesystem:
    """The namespace and semantics of one memfuse mount (see module docstring)."""

    def __init__(self, blobs: BlobCache, committer: Committer, settings: Settings | None = None,
                 workspace: str = "", dirs_file: Path | None = None) -> None:
        self.blobs = blobs
        self.dirs_file = dirs_file
        self.saved_dirs: dict = {}  # slug -> directory paths; DIR_MODES_KEY -> modes
        if dirs_file is not None and dirs_file.exists():
            try:
                self.saved_dirs = json.loads(dirs_file.read_text())
            except (OSError, ValueError):
                log.warning("directory list in the cache is unreadable; empty directories "
                            "made earlier are not restored", extra={"file": str(dirs_file)})
        self.committer = committer
        self.settings = settings or Settings()
        self.workspace = workspace
        self.inodes: dict[int, Node] = {}
        self.by_key: dict[str, Node] = {}
        self.by_rid: dict[str, Node] = {}
        self.handles: dict[int, Handle] = {}
        self.stores: dict[str, StoreMount] = {}
        self._next_ino = ROOT_INO
        self._next_fh = 0
        self.controls = ControlFiles(self)
        self.errors = self.controls.errors  # errors.log entries, newest last
        self.metrics = None  # memfuse.sidecar.metrics.Metrics, set by the sidecar
        self.started = time.time()
        self.ready = False
        now = time.time_ns()
        self.root = self._new_node("", None, True, None, 0o555, now)
        self.control = self._new_node(CONTROL_DIR, self.root, True, None, 0o555, now)
        for fname, kind in FILES.items():
            self._new_node(fname, self.control, False, None, 0o444, now).special = kind
        committer.on_result = self._on_commit
        committer.on_conflict = self._on_conflict

    # ------------------------------------------------------------------ inode table
    def _new_node(self, name: str, parent: Node | None, is_dir: bool, store: StoreMount | None,
                  mode: int, now_ns: int, uid: int | None = None, gid: int | None = None) -> Node:
        ino = self._next_ino
        self._next_ino += 1
        n = Node(ino=ino, name=name, parent=parent, is_dir=is_dir, store=store,
                 mode=(stat.S_IFDIR if is_dir else stat.S_IFREG) | mode,
                 uid=self.settings.uid if uid is None else uid,
                 gid=self.settings.gid if gid is None else gid,
                 atime_ns=now_ns, mtime_ns=now_ns, ctime_ns=now_ns,
                 children={} if is_dir else None)
        self.inodes[ino] = n
        if parent is not None:
            parent.children[name] = n
        return n

    def node(self, ino: int) -> Node:
        """The node for ``ino``; raises ``FsError(ENOENT)`` for an unknown or forgotten one."""
        try:
            return self.inodes[ino]
        except KeyError:
            raise FsError(errno.ENOENT, f"unknown inode {ino}") from None

    def _drop_if_unused(self, n: Node) -> None:
        if n.unlinked and n.nlookup <= 0 and n.opened <= 0:
            self.inodes.pop(n.ino, None)
            if n.key and self.by_key.get(n.key) is n:
                del self.by_key[n.key]
            if n.record_id and self.by_rid.get(n.record_id) is n:
                del self.by_rid[n.record_id]

    def forget(self, ino: int, nlookup: int) -> None:
        n = self.inodes.get(ino)
        if n is None or ino == ROOT_INO:
            return
        n.nlookup -= nlookup
        self._drop_if_unused(n)

    # ------------------------------------------------------------------ loading
    def add_store(self, slug: str, access: str, records: list[Record], *,
                  limits: dict | None = None, contents: dict[str, bytes] | None = None) -> StoreMount:
        """Put one attached store under the root, built from a snapshot of its live records.

        ``contents`` maps record id → bytes for records whose blob is not already cached.
        """
        now = time.time_ns()
        root = self._new_node(slug, self.root, True, None, 0o755, now)
        sm = StoreMount(slug=slug, access=access, root=root, **(limits or {}))
        root.store = sm
        self.stores[slug] = sm
        for rec in records:
            data = (contents or {}).get(rec.id)
            if data is None and rec.content is not None:
                data = rec.content.encode("utf-8")
            if data is not None:
                self.blobs.put(data, rec.sha256)
            elif not self.blobs.has(rec.sha256):
                log.error("record content missing from snapshot and cache; skipped",
                          extra={"store": slug, "record": rec.id})
                continue
            self._insert_record(sm, rec)
        for path in self.saved_dirs.get(slug, []):
            self._ensure_dir(sm, path.split("/"), now)
        self._restore_dir_modes(sm)
        return sm

    def _restore_dir_modes(self, sm: StoreMount) -> None:
        """Give the store's directories the modes saved in ``dirs.json`` (directory modes
        are local to this sidecar: docs/SEMANTICS.md)."""
        saved = self.saved_dirs.get(DIR_MODES_KEY, {})
        for path, mode in (saved.get(sm.slug, {}) if isinstance(saved, dict) else {}).items():
            d = sm.root
            for comp in path.split("/") if path else []:
                d = d.children.get(comp) if d is not None and d.is_dir else None
            if d is not None and d.is_dir and isinstance(mode, int):
                d.mode = stat.S_IFDIR | stat.S_IMODE(mode)

    def _ensure_dir(self, sm: StoreMount, parts: list[str], ts: int,
                    inv: list[tuple] | None = None) -> Node | None:
        """The directory at ``parts`` under the store root, made where missing (each new one
        added to ``inv`` as an entry to invalidate); None when the path crosses a file."""
        d = sm.root
        for comp in parts:
            child = d.children.get(comp)
            if child is None:
                child = self._new_node(comp, d, True, sm, 0o755, ts)
                if inv is not None:
                    inv.append(("entry", d.ino, comp))
            elif not child.is_dir:
                return None
            d = child
        return d

    def save_dirs(self) -> None:
        """Persist every directory path of every store (``dirs.json`` in the cache), so a
        directory made by mkdir and still empty survives a restart of the sidecar. Atomic
        (tmp + rename); directories holding records are implied by them anyway."""
        if self.dirs_file is None:
            return
        out: dict = {}
        modes: dict[str, dict[str, int]] = {}
        for slug, sm in self.stores.items():
            paths: list[str] = []
            chmodded = {"": stat.S_IMODE(sm.root.mode)} if stat.S_IMODE(sm.root.mode) != DIR_MODE else {}
            stack = [sm.root]
            while stack:
                d = stack.pop()
                for c in d.children.values():
                    if c.is_dir:
                        paths.append(c.path())
                        stack.append(c)
                        if stat.S_IMODE(c.mode) != DIR_MODE:
                            chmodded[c.path()] = stat.S_IMODE(c.mode)
            out[slug] = sorted(paths)
            if chmodded:
                modes[slug] = chmodded
        out[DIR_MODES_KEY] = modes
        tmp = self.dirs_file.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(out))
            os.replace(tmp, self.dirs_file)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            err = cache_error(exc, "saving the directory list")
            if self.metrics is not None:
                self.metrics.cache_write_errors.labels(
                    "dirs", errno.errorcode.get(err.errno, str(err.errno))).inc()
            raise err from exc
        self.saved_dirs = out

    def _insert_record(self, sm: StoreMount, rec: Record) -> Node:
        parts = rec.path.split("/")
        d = sm.root
        ts = datetime_ns(rec.updated_at)
        for comp in parts[:-1]:
            child = d.children.get(comp)
            if child is None:
                child = self._new_node(comp, d, True, sm, 0o755, ts)
            elif not child.is_dir:
                log.error("record path crosses a file; skipped", extra={"store": sm.slug, "record": rec.id})
                return child
            d = child
        n = self._new_node(parts[-1], d, False, sm, 0o644, ts)
        self._set_clean(n, rec)
        self._live(n, +1)
        n.key = "r:" + rec.id
        self.by_key[n.key] = n
        self.committer.keymap.setdefault(n.key, (rec.id, rec.sha256))
        return n

    def _set_clean(self, n: Node, rec: Record) -> None:
        self._bind_rid(n, rec.id)
        n.version, n.rtype = rec.version, rec.type
        n.sha, n.size, n.state, n.error = rec.sha256, rec.size, CLEAN, ""
        n.updated_at = rec.updated_at.isoformat()
        n.ctime_ns = datetime_ns(rec.updated_at)
        if rec.version >= n.attrs_version:  # else our newer attribute change stays shown
            n.mode = stat.S_IFREG | stat.S_IMODE(getattr(rec, "mode", DEFAULT_MODE))
            n.xmtime = getattr(rec, "mtime_ns", None)
            n.attrs_version = 0
        n.mtime_ns = n.xmtime if n.xmtime is not None else n.ctime_ns

    def _bind_rid(self, n: Node, rid: str | None) -> None:
        if n.record_id and self.by_rid.get(n.record_id) is n:
            del self.by_rid[n.record_id]
        n.record_id = rid
        if rid:
            self.by_rid[rid] = n

    # ------------------------------------------------------------------ checks
    def _store_of(self, n: Node) -> StoreMount:
        if n.store is None:
            raise FsError(errno.EACCES, "the mount root and .memfuse are read-only")
        return n.store

    def _writable_dir(self, d: Node) -> StoreMount:
        if not d.is_dir:
            raise FsError(errno.ENOTDIR)
        sm = self._store_of(d)
        if not sm.writable:
            raise FsError(errno.EROFS, f"store {sm.slug} is attached read-only")
        return sm

    def _check_name(self, d: Node, name: bytes) -> str:
        try:
            s = names.check_component(name)
        except names.NameError_ as e:
            self.refuse(d, name.decode("utf-8", "replace"),
                        errno.ENAMETOOLONG if e.too_long else errno.EINVAL, e.reason)
        path = (d.path() + "/" + s) if d.path() else s
        if not self.is_local_only(s):
            try:
                names.check_path(path)
            except names.NameError_ as e:
                self.refuse(d, s, errno.ENAMETOOLONG if e.too_long else errno.EINVAL, e.reason)
        return s

    def is_local_only(self, name: str) -> bool:
        return names.is_local_only(name, self.settings.local_only_patterns)

    def refuse(self, where: Node, name: str, err: int, reason: str) -> None:
        """Record a refusal in ``errors.log`` and raise it as ``FsError``."""
        self.note_error(where, name, err, reason)
        raise FsError(err, reason)

    def note_error(self, where: Node | None, name: str, err: int, reason: str) -> None:
        store = where.store.slug if where is not None and where.store else ""
        base = where.path() if where is not None and where.store else ""
        path = f"{base}/{name}" if base and name else (name or base)
        self.controls.note_error(store, path, err, reason)

    # ------------------------------------------------------------------ lookups
    def lookup(self, parent_ino: int, name: bytes) -> Node | None:
        """The child named ``name`` or None; ``.``/``..`` resolve. Counts a lookup when found."""
        d = self.node(parent_ino)
        if not d.is_dir:
            raise FsError(errno.ENOTDIR)
        if name == b".":
            n = d
        elif name == b"..":
            n = d.parent or d
        else:
            try:
                n = d.children.get(name.decode("utf-8"))
            except UnicodeDecodeError:
                return None
        if n is not None:
            n.nlookup += 1
        return n

    def looked_up(self, n: Node) -> None:
        """The kernel now holds one more reference to ``n`` (an entry of a readdirplus
        reply it accepted); ``forget`` gives it back."""
        n.nlookup += 1

    def opendir(self, ino: int) -> Handle:
        """A directory handle on ``ino`` (``ENOTDIR`` for a file); closed by ``release``."""
        n = self.node(ino)
        if not n.is_dir:
            raise FsError(errno.ENOTDIR)
        h = self._new_handle(n, os.O_RDONLY)
        h.is_dir = True
        return h

    def readdir(self, h: Handle, start: int) -> Iterator[tuple[int, str, Node]]:
        """Entries of the directory open as ``h`` from offset ``start``: ``(offset of the
        next entry, name, node)``, sorted by name, from a listing taken when ``start`` is 0
        (so offsets stay stable while the caller pages); entries removed since are left
        out."""
        if start == 0 or h.entries is None:
            h.entries = self.listdir(h.node)
        for i in range(start, len(h.entries)):
            name, child = h.entries[i]
            if not child.unlinked:
                yield i + 1, name, child

    def statfs(self) -> dict[str, int]:
        """statvfs(2) totals over the mounted stores: ``bytes`` / ``used`` (bytes, from the
        stores' quotas and live records) and ``files`` / ``nfiles`` (record limits and
        counts); the defaults of one store when none is mounted."""
        stores = list(self.stores.values())
        return {"bytes": sum(sm.max_store_bytes for sm in stores) or DEFAULT_MAX_STORE_BYTES,
                "used": sum(sm.used for sm in stores),
                "files": sum(sm.max_records for sm in stores) or DEFAULT_MAX_RECORDS,
                "nfiles": sum(sm.count for sm in stores)}

    def listdir(self, d: Node) -> list[tuple[str, Node]]:
        if not d.is_dir:
            raise FsError(errno.ENOTDIR)
        return sorted(d.children.items())

    def nlink(self, n: Node) -> int:
        if not n.is_dir:
            return 0 if n.unlinked else 1
        return 2 + sum(1 for c in n.children.values() if c.is_dir)

    # ------------------------------------------------------------------ content
    def read(self, h: Handle, off: int, size: int) -> bytes:
        """Bytes ``[off, off+size)`` of the file open as ``h``: the snapshot taken at open
        for ``.memfuse`` files, else the write buffer or the cached blob."""
        if h.snapshot is not None:
            return h.snapshot[off:off + size]
        n = h.node
        if n.buf is not None:
            return bytes(n.buf[off:off + size])
        if off >= n.size or not n.sha:
            return b""
        return self.blobs.read(n.sha, off, size)

    def _content(self, n: Node) -> bytes:
        if n.buf is not None:
            return bytes(n.buf)
        return self.blobs.read(n.sha) if n.sha else b""

    def _make_buf(self, n: Node) -> bytearray:
        if n.buf is None:
            n.buf = bytearray(self._content(n))
        return n.buf

    def _check_size(self, n: Node, size: int) -> None:
        sm = n.store
        if sm is not None and size > sm.max_record_bytes and not n.local_only:
            reason = f"record would be {size} bytes, limit {sm.max_record_bytes}"
            self.note_error(n.parent, n.name, errno.EFBIG, reason)
            # What this write session left behind (often a truncation at open plus part of
            # the content) must not replace the stored record: hold it back until the next
            # open for writing (docs/SEMANTICS.md: the stored record untouched).
            if n.dirty:  # else nothing changed and the file stays as it was
                n.refused, n.state, n.error = errno.EFBIG, REJECTED, reason
            raise FsError(errno.EFBIG, reason)

    def _account(self, n: Node, delta: int) -> None:
        """Keep ``StoreMount.used`` equal to the sum of its live records' sizes."""
        if delta and n.store is not None and not n.local_only and not n.unlinked and not n.is_dir:
            n.store.used += delta

    def _live(self, n: Node, sign: int) -> None:
        """A record file appears in (+1) or leaves (-1) its store: count and bytes."""
        if n.store is not None and not n.local_only and not n.unlinked and not n.is_dir:
            n.store.count += sign
            n.store.used += sign * n.cur_size()

    def _check_growth(self, n: Node, new_size: int) -> None:
        """``ENOSPC`` when growing ``n`` to ``new_size`` passes the store's byte quota."""
        sm = n.store
        grow = new_size - n.cur_size()
        if sm is None or n.local_only or grow <= 0 or sm.used + grow <= sm.max_store_bytes:
            return
        reason = (f"store {sm.slug} would hold {sm.used + grow} bytes, "
                  f"limit {sm.max_store_bytes}")
        self.note_error(n.parent, n.name, errno.ENOSPC, reason)
        if n.dirty:
            n.refused, n.state, n.error = errno.ENOSPC, REJECTED, reason
        raise FsError(errno.ENOSPC, reason)

    def write(self, h: Handle, off: int, data: bytes) -> int:
        n = h.node
        if not (h.flags & (os.O_WRONLY | os.O_RDWR)):
            raise FsError(errno.EBADF)
        buf = self._make_buf(n)
        if h.flags & os.O_APPEND:
            off = len(buf)
        end = off + len(data)
        self._check_size(n, end)
        old = len(buf)
        self._check_growth(n, max(old, end))
        if off > len(buf):
            buf.extend(b"\0" * (off - len(buf)))
        buf[off:end] = data
        self._account(n, len(buf) - old)
        self._touch_content(n)
        h.modified = True
        return len(data)

    def truncate(self, n: Node, size: int) -> None:
        if n.is_dir:
            raise FsError(errno.EISDIR)
        if n.special:
            raise FsError(errno.EACCES)
        self._check_writable_file(n)
        self._check_size(n, size)
        self._check_growth(n, size)
        buf = self._make_buf(n)
        self._account(n, size - len(buf))
        if size < len(buf):
            del buf[size:]
        else:
            buf.extend(b"\0" * (size - len(buf)))
        self._touch_content(n)

    def _touch_content(self, n: Node) -> None:
        n.dirty = True
        now = time.time_ns()
        n.mtime_ns = n.ctime_ns = now
        n.xmtime = None  # a write sets the mtime (an explicit one is gone)

    def _check_writable_file(self, n: Node) -> None:
        sm = self._store_of(n)
        if not sm.writable:
            raise FsError(errno.EROFS, f"store {sm.slug} is attached read-only")

    # ------------------------------------------------------------------ open / create
    def open(self, ino: int, flags: int) -> Handle:
        n = self.node(ino)
        if n.is_dir:
            raise FsError(errno.EISDIR)
        writing = flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC)
        if writing:
            if n.special:
                raise FsError(errno.EACCES, ".memfuse files are read-only")
            self._check_writable_file(n)
            n.refused = 0  # a new write session: its content is judged at commit
        if n.special:  # one consistent snapshot per open: json.load may read twice
            h = self._new_handle(n, flags)
            h.snapshot = self.controls.content(n.special)
            return h
        if flags & os.O_TRUNC and n.cur_size() > 0:
            self._account(n, -n.cur_size())
            n.buf = bytearray()
            self._touch_content(n)
        elif flags & os.O_TRUNC:
            n.dirty = True  # opening with O_TRUNC is a write, even of nothing
        return self._new_handle(n, flags)

    def _new_handle(self, n: Node, flags: int) -> Handle:
        self._next_fh += 1
        h = Handle(self._next_fh, n, flags)
        self.handles[h.fh] = h
        n.opened += 1
        return h

    def handle(self, fh: int, *, allow_stale: bool = False) -> Handle:
        """The open handle ``fh``. ``EBADF`` when unknown; ``ESTALE`` when its store was
        unmounted, unless ``allow_stale`` (close must still succeed)."""
        try:
            h = self.handles[fh]
        except KeyError:
            raise FsError(errno.EBADF) from None
        if not allow_stale and h.node.store is not None and h.node.store.detached:
            raise FsError(errno.ESTALE, f"store {h.node.store.slug} was unmounted")
        return h

    def create(self, parent_ino: int, name: bytes, mode: int, flags: int, uid: int, gid: int) -> Handle:
        d = self.node(parent_ino)
        sm = self._writable_dir(d)
        s = self._check_name(d, name)
        if s in d.children:
            raise FsError(errno.EEXIST)
        local = self.is_local_only(s)
        if not local and sm.count >= sm.max_records:
            self.refuse(d, s, errno.ENOSPC, f"store {sm.slug} holds {sm.max_records} records, its limit")
        n = self._new_node(s, d, False, sm, stat.S_IMODE(mode), time.time_ns(), uid, gid)
        n.local_only = local
        n.key = "n:" + uuid.uuid4().hex
        self.by_key[n.key] = n
        n.buf = bytearray()
        n.dirty = not local
        self._live(n, +1)
        n.nlookup += 1
        self._touch_dir(d)
        return self._new_handle(n, flags)

    def _touch_dir(self, d: Node) -> None:
        d.mtime_ns = d.ctime_ns = time.time_ns()

    # ------------------------------------------------------------------ flush / fsync / release
    def commit(self, n: Node) -> "Entry | FsError | None":
        """Turn a dirty file into an accepted change (outbox ``put``).

        Returns the outbox entry; None when there is nothing to send; an ``FsError`` when the
        content is refused here already (the fast path of the errno table in docs/API.md: not UTF-8 →
        ``EILSEQ``; more checks where ``memfuse.content`` provides them) — the file then keeps
        the refused content with ``state=rejected`` and nothing is sent.
        """
        if not n.dirty or n.is_dir or n.special:
            return None
        n.dirty = False
        if n.local_only or n.unlinked:
            return None
        data = self._content(n)  # the write buffer, or the clean content (e.g. renamed back)
        n.sha = sha256_hex(data)
        n.size = len(data)
        try:
            self.blobs.put(data, n.sha)
            n.buf = None
        except CacheError as err:
            # the cache disk is full or failing: the content stays in memory (reads are
            # served from it) and the outbox entry below carries it durably, when the
            # journal can write; the next commit of this file tries the blob cache again
            n.buf = bytearray(data)
            log.warning("blob cache write failed; the file's content stays in memory",
                        extra={"store": n.store.slug, "path": n.path(), "reason": err.reason})
        if n.refused:
            return FsError(n.refused, n.error)
        refusal = self._precheck(n, data)
        if refusal is not None:
            n.state, n.error, n.last_put = REJECTED, refusal.reason, None
            self.note_error(n.parent, n.name, refusal.errno, refusal.reason)
            return refusal
        # the attributes ride with the content (cp -p, install -m, sed -i's fchmod)
        e = self.committer.submit(n.store.slug, PUT, n.key,
                                  {"path": n.path(), "type": n.type_override,
                                   "mode": stat.S_IMODE(n.mode), "mtime_ns": n.xmtime}, data)
        n.last_put = e
        n.state, n.error = PENDING, ""
        return e

    def _precheck(self, n: Node, data: bytes) -> FsError | None:
        """Refusals the sidecar can decide alone, so they fail at close even offline:
        not UTF-8 or a NUL character (``EILSEQ``), a secret (``EPERM``), a bad frontmatter
        type (``EINVAL``). Sizes and names are checked at write / create already."""
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as e:
            return FsError(errno.EILSEQ, f"content is not valid UTF-8 (byte {e.start})")
        nul = data.find(b"\0")
        if nul >= 0:
            return FsError(errno.EILSEQ, f"content contains a NUL character (at offset {nul}); "
                                         "records are text")
        if content_rules is None:
            return None
        text = data.decode("utf-8")
        try:
            kind = content_rules.find_secret(text)
            if kind:
                return FsError(errno.EPERM, f"content looks like it holds a secret ({kind}); "
                                            "memory must not store credentials")
            try:
                t = content_rules.record_type(n.path(), text, n.type_override, "project")
                if t is not None:
                    content_rules.check_type(t)
            except ValueError as e:
                return FsError(errno.EINVAL, str(e) or "invalid record type")
        except Exception:  # the control plane still enforces every rule
            log.exception("local content check failed; leaving the decision to the control plane")
        return None

    async def flush(self, h: Handle) -> None:
        """close(2): commit a dirty file; wait up to ``commit_wait`` s for the control plane.

        Raises ``FsError`` with the refusal's errno when the control plane refused the content
        for good (the content stays here, ``state=rejected``). A transient failure is not an
        error: the write stays accepted and the outbox retries (docs/SEMANTICS.md, "Writes and close").
        """
        n = h.node
        if n.store is not None and n.store.detached:
            return  # its dirty content was committed (bounded) when the store was unmounted
        if not h.flags & (os.O_WRONLY | os.O_RDWR) and not n.dirty:
            return  # a reader's close never waits for someone else's commit
        if n.dirty and not h.modified:
            # Nothing was written through this handle yet: the file is only created or
            # truncated at open. A shell redirection (`echo x > f`) opens, dup2()s and closes
            # the first descriptor before writing; committing here would make an empty
            # version. The commit happens at the final flush after a write, or at release.
            return
        e = self.commit(n)
        if isinstance(e, FsError):
            raise e
        if e is None:
            e = n.last_put if n.state == PENDING and not (n.local_only or n.unlinked) else None
            if e is None:
                return
        deadline = trio.current_time() + self.settings.commit_wait
        await self._wait_accepted(n, e, self.settings.commit_wait)
        with trio.move_on_at(deadline):
            await e.done.wait()
        if e.done.is_set() and e.errno:
            raise FsError(e.errno, e.reason)

    async def fsync(self, h: Handle) -> None:
        """fsync(2): commit and wait for the control plane's acknowledgement; ``EIO`` after
        ``fsync_timeout`` s (the write stays accepted)."""
        n = h.node
        e = self.commit(n)
        if isinstance(e, FsError):
            raise e
        e = e or (n.last_put if n.state == PENDING and not (n.local_only or n.unlinked) else None)
        if e is None:
            return
        deadline = trio.current_time() + self.settings.fsync_timeout
        await self._wait_accepted(n, e, self.settings.fsync_timeout)
        with trio.move_on_at(deadline):
            await e.done.wait()
        if not e.done.is_set():
            raise FsError(errno.EIO, "control plane did not acknowledge within fsync timeout")
        if e.errno:
            raise FsError(e.errno, e.reason)

    async def _wait_accepted(self, n: Node, e: Entry, timeout: float) -> None:
        """Wait (at most ``timeout`` s) until ``e`` is accepted (on disk in the outbox) or
        finished. When the sidecar's own disk refuses it, raise ``FsError`` with the journal's
        errno (``ENOSPC`` for a full disk) and its reason in ``user.memfuse.error`` and
        ``errors.log``; the entry stays queued (the journal retries it and the committer may
        still commit it), so the file keeps ``state=pending``."""
        try:
            await e.wait_accepted(timeout)
        except CacheError as err:
            if n.last_put is e:
                n.error = err.reason
            self.note_error(n.parent if n.store is not None else None, n.name, err.errno,
                            err.reason + "; the write is kept in memory and retried")
            raise FsError(err.errno, err.reason) from None

    def release(self, fh: int) -> None:
        h = self.handles.pop(fh, None)
        if h is None:
            return
        n = h.node
        n.opened -= 1
        if n.dirty:  # flush was not called (or failed): never drop the write
            self.commit(n)
        self._drop_if_unused(n)

    def _on_conflict(self, e: Entry, what: str) -> None:
        self.controls.note_conflict(e.store, e.args.get("path", ""), what)

    def _on_commit(self, e: Entry) -> None:
        if e.op == MOVE_PREFIX or e.node_key is None:
            if e.errno:
                self.note_error(None, e.args.get("from", ""), e.errno, e.reason)
            return
        n = self.by_key.get(e.node_key)
        if e.op == PUT:
            if e.errno:
                self.note_error(n.parent if n else None, n.name if n else e.args.get("path", ""),
                                e.errno, e.reason)
            if n is None or n.last_put is not e:
                return
            if e.errno:
                n.state, n.error = REJECTED, e.reason
            elif e.record is not None:
                self._bind_rid(n, e.record.id)
                n.version, n.rtype = e.record.version, e.record.type
                if n.type_override == e.args.get("type"):
                    n.type_override = None
                n.updated_at = e.record.updated_at.isoformat()
                n.state, n.error = CLEAN, ""
        elif e.op == ATTRS:
            if e.errno:
                self.note_error(n.parent if n else None, n.name if n else e.args.get("path", ""),
                                e.errno, e.reason)
            elif n is not None and e.record is not None and n.record_id == e.record.id:
                if e.record.sha256 == n.sha and n.buf is None:
                    n.version = max(n.version, e.record.version)
                    n.updated_at = e.record.updated_at.isoformat()
                else:  # content changed elsewhere meanwhile: the feed brings it, ours stay
                    n.attrs_version = max(n.attrs_version, e.record.version)
        elif e.op == MOVE and n is not None and e.record is not None:
            self._bind_rid(n, e.record.id)
            n.version = e.record.version
        elif e.op in (DELETE, MOVE) and e.errno:
            self.note_error(None, e.args.get("path", ""), e.errno, e.reason)

    # ------------------------------------------------------------------ attributes
    def setattr(self, n: Node, *, size: int | None = None, mode: int | None = None,
                uid: int | None = None, gid: int | None = None, atime_ns: int | None = None,
                mtime_ns: int | None = None) -> None:
        """setattr (truncate, chmod, chown, utimensat). Permission bits and mtime of a record
        are kept by the control plane: on a file with unsent writes (or a refused one) they
        ride with its next content commit; on a clean file a change queues an ``attrs``
        outbox entry (a metadata-only version, no content upload); a change to the current
        value queues nothing. Directory modes stay in this sidecar (``dirs.json``); uid/gid
        and atime are local (per mount)."""
        if n.special or n is self.root or n is self.control:
            raise FsError(errno.EACCES, "read-only")
        if size is not None:
            self.truncate(n, size)
        if (n.store is not None and not n.store.writable
                and any(v is not None for v in (mode, uid, gid, atime_ns, mtime_ns))):
            raise FsError(errno.EROFS)
        changed: dict[str, int] = {}
        if mode is not None:
            new = stat.S_IFMT(n.mode) | stat.S_IMODE(mode)
            if new != n.mode:
                n.mode = new
                changed["mode"] = stat.S_IMODE(mode)
        if uid is not None and uid != -1 & 0xFFFFFFFF:
            n.uid = uid
        if gid is not None and gid != -1 & 0xFFFFFFFF:
            n.gid = gid
        if atime_ns is not None:
            n.atime_ns = atime_ns
        if mtime_ns is not None:
            if size is None and not n.is_dir and (n.dirty or mtime_ns != n.mtime_ns):
                # an explicit time (touch -d, cp -p); with a size it is the truncation's own
                n.xmtime = mtime_ns
                changed["mtime_ns"] = mtime_ns
            n.mtime_ns = mtime_ns
        n.ctime_ns = time.time_ns()
        if not changed:
            return
        if n.is_dir:
            if "mode" in changed and n.store is not None:
                self._save_dirs_logged()  # the mode applies now; a failure is logged
            return
        if n.local_only or n.unlinked or n.store is None or n.dirty or n.state == REJECTED:
            return  # local only, or rides with the next content commit (commit() sends both)
        self.committer.submit(n.store.slug, ATTRS, n.key, {"path": n.path(), **changed})

    # ------------------------------------------------------------------ namespace changes
    def mkdir(self, parent_ino: int, name: bytes, mode: int, uid: int, gid: int) -> Node:
        d = self.node(parent_ino)
        sm = self._writable_dir(d)
        s = self._check_name(d, name)
        if s in d.children:
            raise FsError(errno.EEXIST)
        n = self._new_node(s, d, True, sm, stat.S_IMODE(mode), time.time_ns(), uid, gid)
        try:
            self.save_dirs()
        except CacheError as err:
            del d.children[s]  # a directory that would not survive a restart is refused
            self.inodes.pop(n.ino, None)
            self.refuse(d, s, err.errno, err.reason)
        n.nlookup += 1
        self._touch_dir(d)
        return n

    def _child(self, d: Node, name: bytes) -> Node:
        if not d.is_dir:
            raise FsError(errno.ENOTDIR)
        n = d.children.get(name.decode("utf-8", "surrogateescape"))
        if n is None:
            raise FsError(errno.ENOENT)
        return n

    def _detach(self, n: Node) -> None:
        self._live(n, -1)
        del n.parent.children[n.name]
        self._touch_dir(n.parent)
        n.unlinked = True
        n.ctime_ns = time.time_ns()
        self._drop_if_unused(n)

    def unlink(self, parent_ino: int, name: bytes) -> None:
        d = self.node(parent_ino)
        sm = self._writable_dir(d)
        n = self._child(d, name)
        if n.is_dir:
            raise FsError(errno.EISDIR)
        if not n.local_only:
            self.committer.submit(sm.slug, DELETE, n.key, {"path": n.path()})
        n.dirty = False
        self._detach(n)
        self._bind_rid(n, None)

    def rmdir(self, parent_ino: int, name: bytes) -> None:
        d = self.node(parent_ino)
        self._writable_dir(d)
        n = self._child(d, name)
        if not n.is_dir:
            raise FsError(errno.ENOTDIR)
        if n.children:
            raise FsError(errno.ENOTEMPTY)
        self._detach(n)
        self._save_dirs_logged()

    def _save_dirs_logged(self) -> None:
        """``save_dirs`` after a change that already happened (rmdir, rename, a directory's
        chmod): a failure is logged and counted; an empty directory may then reappear, or be
        missing, or lose its mode, after a restart (the list is written again at the next
        change)."""
        try:
            self.save_dirs()
        except CacheError as err:
            log.warning("directory list not saved", extra={"reason": err.reason})

    def _has_remote(self, d: Node) -> bool:
        for c in d.children.values():
            if (c.is_dir and self._has_remote(c)) or (not c.is_dir and not c.local_only):
                return True
        return False

    def _walk_files(self, d: Node) -> Iterator[Node]:
        for c in d.children.values():
            if c.is_dir:
                yield from self._walk_files(c)
            else:
                yield c

    def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
               flags: int) -> None:
        """rename(2) / renameat2(2): ``flags`` may hold ``RENAME_NOREPLACE`` (an existing
        target → ``EEXIST``); ``RENAME_EXCHANGE`` → ``EINVAL``. Across stores → ``EXDEV``.
        Applied locally at once; the control plane learns it through the outbox."""
        if flags & RENAME_EXCHANGE:
            raise FsError(errno.EINVAL, "RENAME_EXCHANGE is not supported")
        od, nd = self.node(old_parent), self.node(new_parent)
        sm = self._writable_dir(od)
        sm2 = self._writable_dir(nd)
        src = self._child(od, old_name)
        if sm is not sm2:
            raise FsError(errno.EXDEV)
        s = self._check_name(nd, new_name)
        dst = nd.children.get(s)
        if dst is src:
            return
        if dst is not None and flags & RENAME_NOREPLACE:
            raise FsError(errno.EEXIST)
        if src.is_dir:
            a = nd
            while a is not None:  # a directory cannot move into itself
                if a is src:
                    raise FsError(errno.EINVAL, "cannot move a directory into itself")
                a = a.parent
            if dst is not None:
                if not dst.is_dir:
                    raise FsError(errno.ENOTDIR)
                if dst.children:
                    raise FsError(errno.ENOTEMPTY)
        elif dst is not None and dst.is_dir:
            raise FsError(errno.EISDIR)

        old_path = src.path()
        new_path = (nd.path() + "/" + s) if nd.path() else s
        commit_after = False
        if src.is_dir:
            self._check_subtree_paths(nd, src, new_path)
            if self._has_remote(src):
                self.committer.submit(sm.slug, MOVE_PREFIX, None, {"from": old_path, "to": new_path})
        else:
            commit_after = self._rename_file_remote(sm, src, dst, s, old_path, new_path)
        if dst is not None:
            dst.dirty = False
            self._detach(dst)
        del od.children[src.name]
        self._touch_dir(od)
        src.name, src.parent = s, nd
        nd.children[s] = src
        self._touch_dir(nd)
        src.ctime_ns = time.time_ns()
        if src.is_dir:
            self._save_dirs_logged()
        if commit_after and src.opened == 0:
            self.commit(src)

    def _adopt_key(self, src: Node, dst: Node) -> None:
        """``src`` replaces ``dst`` locally and takes over its record (key and id)."""
        if self.by_key.get(src.key) is src:
            del self.by_key[src.key]
        src.key = dst.key
        self.by_key[src.key] = src
        rid, src.version = dst.record_id, dst.version
        self._bind_rid(dst, None)
        self._bind_rid(src, rid)

    def _check_subtree_paths(self, nd: Node, d: Node, new_path: str) -> None:
        """Every record below a directory moved to ``new_path`` must still have a valid path
        (docs/SEMANTICS.md "Names": ≤ 32 components, ≤ 1,024 bytes) → else ``ENAMETOOLONG``."""
        stack = [(d, new_path)]
        while stack:
            cur, path = stack.pop()
            for name, c in cur.children.items():
                p = path + "/" + name
                if c.is_dir:
                    stack.append((c, p))
                if not c.local_only:
                    try:
                        names.check_path(p)
                    except names.NameError_ as e:
                        self.refuse(nd, d.name, errno.ENAMETOOLONG if e.too_long else errno.EINVAL,
                                    f"{e.reason} (for {name!r} below the moved directory)")

    def _rename_file_remote(self, sm: StoreMount, src: Node, dst: Node | None, s: str,
                            old_path: str, new_path: str) -> bool:
        """Queue the outbox entries of a file rename; True when the file must be committed
        under its new name once the local rename is done."""
        to_local = self.is_local_only(s)
        if src.local_only and to_local:
            return False
        if src.local_only:
            # a temporary becomes a real file: its content goes to the target's record
            if dst is not None and not dst.local_only:
                self._adopt_key(src, dst)
            src.local_only = False
            self._live(src, +1)
            src.dirty = True
            return True
        if to_local:
            self.committer.submit(sm.slug, DELETE, src.key, {"path": old_path})
            self._live(src, -1)
            src.local_only = True
            return False
        if src.dirty and src.opened == 0:
            self.commit(src)
        if (dst is not None and not dst.local_only and src.record_id is None
                and src.state != PENDING):
            # src never reached the control plane (refused, or not flushed yet): there is
            # nothing to move; src takes over dst's record, so fixing or deleting src later
            # acts on that record (as a local-only file renamed over it does)
            self._adopt_key(src, dst)
            return False
        args = {"path": old_path, "to": new_path, "replace": dst is not None and not dst.local_only}
        if dst is not None and not dst.local_only:
            args["target_key"] = dst.key
        self.committer.submit(sm.slug, MOVE, src.key, args)
        return False

    # ------------------------------------------------------------------ remote changes
    def apply_remote(self, sm: StoreMount, rec: Record, *, force: bool = False) -> list[tuple]:
        """Apply one record state from the change feed (or a snapshot when ``force``) to the
        tree. Returns the kernel invalidations to make: ``("entry", parent_ino, name)`` and
        ``("inode", ino)`` (content changed), ``("attr", ino)`` (only mode / mtime changed).

        Rules (docs/ARCHITECTURE.md, "Threads and ordering"): call only while the store's outbox is empty, so every local change
        is already committed; a file with unflushed local writes is never overwritten (its
        commit lands on top); a state not newer than the local version is skipped (our own
        writes come back through the feed), unless ``force`` (after a snapshot), where the
        path, sha256 and attributes decide.
        """
        n = self.by_rid.get(rec.id)
        if n is not None and (n.unlinked or n.store is not sm):
            n = None
        if n is not None:
            if n.dirty:
                return []
            if force:
                if (n.sha == rec.sha256 and n.path() == rec.path and not rec.deleted
                        and stat.S_IMODE(n.mode) == rec.mode and n.xmtime == rec.mtime_ns):
                    return []
                if n.version > rec.version or (n.version == rec.version and n.state != CLEAN):
                    return []  # a local version the snapshot does not know yet
            elif n.version >= rec.version:
                return []
        if rec.deleted:
            if n is None:
                return []
            inv = [("entry", n.parent.ino, n.name)]
            self._detach(n)
            self._bind_rid(n, None)
            return inv
        if rec.content is None and not self.blobs.has(rec.sha256):
            log.error("remote change without content; skipped", extra={"store": sm.slug, "record": rec.id})
            return []
        if rec.content is not None:
            self.blobs.put(rec.content.encode("utf-8"), rec.sha256)
        inv: list[tuple] = []
        if n is None:
            parts = rec.path.split("/")
            d = self._ensure_dir(sm, parts[:-1], time.time_ns(), inv)
            if d is None:
                log.warning("remote record path crosses a local file; skipped",
                            extra={"store": sm.slug, "record": rec.id})
                return []
            cur = d.children.get(parts[-1])
            if cur is not None:
                if cur.is_dir or cur.dirty or cur.record_id is None:
                    log.warning("remote record collides with a local entry; local kept",
                                extra={"store": sm.slug, "record": rec.id})
                    return []
                inv.append(("entry", d.ino, cur.name))
                self._detach(cur)
                self._bind_rid(cur, None)
            n = self._new_node(parts[-1], d, False, sm, 0o644, time.time_ns())
            n.key = "r:" + rec.id
            self.by_key[n.key] = n
            self.committer.keymap[n.key] = (rec.id, rec.sha256)
            self._live(n, +1)  # size 0 now; its size is accounted below
            inv.append(("entry", d.ino, n.name))
            self._touch_dir(d)
        else:
            if n.path() != rec.path:
                inv += self._move_remote(sm, n, rec.path)
            if n.sha != rec.sha256:
                inv.append(("inode", n.ino))
            self.committer.keymap[n.key] = (rec.id, rec.sha256)
        old = n.cur_size()
        before = (n.mode, n.mtime_ns)
        self._set_clean(n, rec)
        self._account(n, n.size - old)
        if (n.mode, n.mtime_ns) != before and not any(i[0] == "inode" and i[1] == n.ino for i in inv):
            inv.append(("attr", n.ino))
        return inv

    def _move_remote(self, sm: StoreMount, n: Node, path: str) -> list[tuple]:
        parts = path.split("/")
        inv: list[tuple] = []
        d = self._ensure_dir(sm, parts[:-1], time.time_ns(), inv)
        if d is None:
            return []
        cur = d.children.get(parts[-1])
        if cur is not None and cur is not n:
            if cur.is_dir or cur.dirty:
                return []
            inv.append(("entry", d.ino, cur.name))
            self._detach(cur)
            self._bind_rid(cur, None)
        inv.append(("entry", n.parent.ino, n.name))
        del n.parent.children[n.name]
        self._touch_dir(n.parent)
        n.parent, n.name = d, parts[-1]
        d.children[n.name] = n
        self._touch_dir(d)
        inv.append(("entry", d.ino, n.name))
        return inv

    def reconcile_store(self, sm: StoreMount, records: list[Record],
                        queued: list[Entry] = ()) -> list[tuple]:
        """Make the store's tree match a full snapshot (after ``410``): apply every record,
        remove clean local files whose record is no longer live.

        Call with no commit of the store in flight between the snapshot and this call
        (``Committer.hold``): every local change that committed is then in ``records``.
        ``queued`` are the store's outbox entries not committed yet: local changes the
        snapshot cannot show. Records and files they touch are left as they are here (their
        commits land on top), so a reconcile never reverts or hides a local write."""
        busy_keys = {e.node_key for e in queued if e.node_key}
        busy_rids = {self.committer.keymap.get(k, (None, None))[0] for k in busy_keys}
        busy_rids |= {k[2:] for k in busy_keys if k.startswith("r:")}
        prefixes = [p for e in queued if e.op == MOVE_PREFIX
                    for p in (e.args.get("from", ""), e.args.get("to", ""))]

        def touched(path: str) -> bool:
            return any(path == p or path.startswith(p + "/") for p in prefixes)

        inv: list[tuple] = []
        live = set()
        for rec in records:
            live.add(rec.id)
            n = self.by_rid.get(rec.id)
            if rec.id in busy_rids or touched(rec.path) or (n is not None and n.key in busy_keys):
                continue
            inv += self.apply_remote(sm, rec, force=True)
        for n in list(self._walk_files(sm.root)):
            if (n.record_id and n.record_id not in live and not n.dirty and not n.local_only
                    and n.key not in busy_keys and n.state == CLEAN and not touched(n.path())):
                inv.append(("entry", n.parent.ino, n.name))
                self._detach(n)
                self._bind_rid(n, None)
        return inv

    def remove_store(self, slug: str) -> list[tuple]:
        """Take a store out of the mount; handles still open on it answer ``ESTALE``."""
        sm = self.stores.pop(slug, None)
        if sm is None:
            return []
        sm.detached = True
        inv = [("entry", self.root.ino, slug)]
        self._detach(sm.root)
        for n in self._walk_files(sm.root):
            if n.record_id and self.by_rid.get(n.record_id) is n:
                del self.by_rid[n.record_id]
        return inv

    def dirty_nodes(self, sm: StoreMount | None = None) -> list[Node]:
        return [n for n in self.inodes.values()
                if n.dirty and not n.is_dir and (sm is None or n.store is sm)]

    # ------------------------------------------------------------------ xattrs
    XATTRS = ("id", "version", "sha256", "state", "updated_at", "error", "type")

    def getxattr(self, n: Node, name: str) -> bytes:
        if not name.startswith("user.memfuse."):
            raise FsError(errno.ENODATA)
        key = name[len("user.memfuse."):]
        if n.is_dir or n.special or key not in self.XATTRS:
            raise FsError(errno.ENODATA)
        value = {"id": n.record_id or "", "version": str(n.version) if n.record_id else "",
                 "sha256": n.sha if n.buf is None else sha256_hex(bytes(n.buf)),
                 "state": n.state, "updated_at": n.updated_at, "error": n.error,
                 "type": n.rtype or ""}[key]
        if not value and key not in ("error",):
            raise FsError(errno.ENODATA)
        return value.encode("utf-8")

    def setxattr(self, n: Node, name: str, value: bytes) -> None:
        """setxattr(2): only ``user.memfuse.type`` is writable (``set_type``); other
        ``user.memfuse.*`` names → ``EPERM``; any other name → ``ENOTSUP``."""
        if name == "user.memfuse.type":
            self.set_type(n, value)
            return
        if name.startswith("user.memfuse."):
            raise FsError(errno.EPERM, f"{name} is read-only")
        raise FsError(errno.ENOTSUP)

    def set_type(self, n: Node, value: bytes) -> None:
        """``setxattr user.memfuse.type``: a new version with that type (docs/SEMANTICS.md, "Extended attributes")."""
        if n.is_dir or n.special or n.store is None:
            raise FsError(errno.ENOTSUP, "only records have a type")
        self._check_writable_file(n)
        t = value.decode("utf-8", "replace").strip()
        if t not in RECORD_TYPES:
            self.refuse(n.parent, n.name, errno.EINVAL,
                        f"type {t!r} is not one of {', '.join(RECORD_TYPES)}")
        if n.local_only:
            raise FsError(errno.ENOTSUP, "local-only files have no type")
        n.type_override = t
        n.dirty = True
        if n.opened == 0 or n.buf is None:
            self.commit(n)

    # ------------------------------------------------------------------ status
    def status(self) -> dict:
        """The filesystem's status document (``ControlFiles.status``)."""
        return self.controls.status()
