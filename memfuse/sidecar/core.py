"""The filesystem core: memfuse's namespace and file semantics, without FUSE (docs/SEMANTICS.md).

``Filesystem`` keeps the inode table of the one mount (root → one directory per attached store →
directories implied by record paths → files), answers every lookup / getattr / readdir / read
from memory and the local blob cache, applies writes locally at once, and turns flushed changes
into outbox entries (``committer.Committer``). The FUSE adapter (``fuse_ops``) is a thin layer that
converts arguments and maps ``FsError`` to ``pyfuse3.FUSEError``.

The class is built from parts passed in at construction (the blob cache, the API client and
the journal of its committer, the record identity ``identity.RecordIds`` it shares with the
committer, the sidecar as its ``listeners.FsListener``); it builds its ``Committer`` and is
that committer's ``listeners.CommitListener``. Its concerns are one module each, mixed in,
each declaring at class level the attributes it uses: ``inodes.InodeTable`` (the tables,
lookups, handles, ``check_invariants``), ``remote.RemoteApply`` (store loading, feed
changes, snapshots), ``namespace.NamespaceOps`` (mkdir, unlink, rmdir, rename, the directory list),
``attributes.AttributeOps`` (setattr, xattrs), ``rejected.RejectedFiles``,
``localfiles.LocalFiles``, ``limits.WriteLimits`` (the refusals at write(2): size limits
and content checks) and ``overlay.OutboxOverlay`` (a backlog at start shown on the tree);
this module keeps the write sessions (open / write / truncate / flush / fsync / release and
``commit``) and the results of commits. The control files are ``control.ControlFiles``.

Concurrency: every method runs on the trio thread. Methods without ``await`` are atomic with
respect to each other; the only awaits are in ``flush`` / ``fsync`` (waiting for the outbox),
after all state changes are done, so no invariant is broken across an ``await``.

Content: a clean file's bytes are in ``BlobCache`` (rows keyed by sha256 in one SQLite file in
the cache directory); a file being written has a ``bytearray`` buffer on its node until flush, when the
buffer is stored as a blob and an outbox ``put`` entry (which carries the bytes durably) is
submitted.
"""
from __future__ import annotations

import errno
import logging
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

import trio

from .. import content as content_rules  # the server enforces the same rules
from .. import names
from ..errors import errno_of
from ..defs import MODE_MASK, datetime_ns, sha256_hex
from ..hashstate import Sha256States
from ..secretscan import AppendScans

from .appendbuf import AppendBuffer, WriteBuffer
from .attributes import AttributeOps
from .blobcache import BlobCache
from .cachedir import CacheError
from .control import CONTROL_DIR, FILES, ControlFiles
from .interrupts import Interrupts
from .inodes import (ABSENT_BASE, CLEAN, PENDING, REJECTED, ROOT_INO, UNKNOWN_BASE, FsError, Handle, InodeTable,
                     Node, Settings, StoreMount)
from .namespace import NamespaceOps
from .limits import WriteLimits
from .overlay import OutboxOverlay
from .committer import STORE_REPLACED, Committer
from .identity import RecordIds
from .journal import ATTRS, DELETE, JOURNAL_WAIT, MOVE, MOVE_PREFIX, PUT, Barrier, Entry, Journal, new_key
from .listeners import FsListener
from .localfiles import LocalFiles
from .recent import RecentContents
from .writecheck import FENCES, HEAD_BYTES
from .rejected import RejectedFiles
from .remote import RemoteApply

if TYPE_CHECKING:
    from ..wire import Record
    from .sync import Meta

log = logging.getLogger("memfuse.fs")

#: a close of a file this large or larger whose content is its previous content plus a
#: suffix (an append) is judged by the suffix (``Filesystem._checked_prefix``): UTF-8 and NUL
#: in the suffix, the secret scan from ``APPEND_SCAN_CONTEXT`` bytes before it
APPEND_CHECK_MIN = 1024
APPEND_SCAN_CONTEXT = 16 * 1024
#: seconds a read or write waits at most for a clean content fetched again from the
#: control plane (``Filesystem.refetch``), then ``EIO``
REFETCH_TIMEOUT = 30.0
#: seconds a close that gives up on a write the cache disk refused (``_journal_refused``)
#: waits at most for a request carrying it that is in flight to end, and for the journal's
#: batch being written to end, before deciding whether it can be withdrawn (beyond it: kept,
#: the close returns 0: it may have landed)
WITHDRAW_WAIT = 10.0
#: s between looks of a directory's fsync at the durable copy of the directory list being
#: written for an earlier one (``_sync_dirs``: only while that write outlived its fsync, a
#: stalled cache disk)
DIRS_WRITING_POLL = 0.05


class ContentMissing(FsError):
    """The clean content of ``node`` is not in the blob cache (absent, or found damaged and
    dropped: ``BlobCache._load``): ``EIO`` unless the FUSE handler fetches it again
    (``Filesystem.refetch``, ``fuse_ops._guard_sync``) and runs once more."""

    def __init__(self, node: Node) -> None:
        super().__init__(errno.EIO, "the file's content is missing from the blob cache")
        self.node = node


# what callers use from here (the node types live in inodes.py, re-exported for them)
class Before(NamedTuple):
    """What a file showed before a ``put`` (``Entry.before``, set by ``Filesystem.commit``),
    so that the write, withdrawn by its close, can be undone (``Filesystem._withdraw``)."""

    sha: str  #: sha256 hex of that content ('' for a file the write created)
    size: int  #: its length in bytes
    prefix: int  #: its length when the put's content starts with it (an append), else -1
    state: Any  #: the file's state then (``inodes.CLEAN`` / ``PENDING`` / ``REJECTED``)
    put: Any  #: the file's last put then (an ``Entry``), or None
    held: bytes | None  #: the content itself when only memory held it (``Node.prior``)


__all__ = ["Filesystem", "FsListener", "FsError", "ContentMissing", "Before", "Settings", "Node", "Handle", "StoreMount", "ROOT_INO",
           "CONTROL_DIR", "CLEAN", "PENDING", "REJECTED"]


#: seconds at most a system call that changed the tree without waiting for the control
#: plane (unlink, rename, rmdir, chmod, utimens, setxattr) waits for the outbox journal to
#: have the change on disk (``Filesystem.changes_durable``); a healthy disk takes
#: milliseconds. The call returns 0 after it anyway (the change is applied and queued)
CHANGE_WAIT = 5.0


class Filesystem(InodeTable, RemoteApply, NamespaceOps, AttributeOps, RejectedFiles, LocalFiles,
                 WriteLimits, OutboxOverlay):
    """The namespace and semantics of one memfuse mount (see module docstring).

    Parts, given at construction (nothing is wired from outside afterwards): ``blobs`` (the
    blob cache), ``client`` and ``journal`` (the committer's: this core builds its
    ``Committer``, listening to it itself), ``ids`` (the record identity shared with the
    committer; default: an empty one on ``journal``), ``listener`` (the sidecar, an
    ``FsListener``; None for a bare core), ``metrics``, ``mount_root`` (the mountpoint, for
    the prompt block), ``backoff_max`` (the committer's retry cap, s) and ``interrupts``
    (``interrupts.Interrupts``: Ctrl-C of a waiting close or fsync).

    Concurrency (one trio thread; the rule that stands for a lock): no ``await`` between the
    changes of one operation. Only ``flush`` / ``fsync`` (and ``_wait_accepted``) await, after
    every state change; ``entry_finished`` / ``entry_conflicted`` run after the committer's
    ``await`` of an HTTP call and change a node only while its ``last_put`` is still that
    entry (a newer local write is never overwritten). The tables' invariants are in
    ``inodes.InodeTable``; ``check_invariants`` asserts them.
    """

    # --- dependencies (given at construction, never replaced) --------------------------------
    blobs: BlobCache
    journal: Journal
    ids: RecordIds  # shared with ``committer``: node key -> (record id, sha256)
    committer: Committer  # built here, listening to this filesystem (``CommitListener``)
    listener: FsListener | None
    metrics: Any
    settings: Settings
    controls: ControlFiles
    # --- mutable state (besides the tables of ``InodeTable``) --------------------------------
    workspace: str
    dirs_file: Path | None
    #: slug -> directory paths made here; ``DIR_MODES_KEY`` -> their modes (``dirs.json``)
    saved_dirs: dict[str, Any]
    errors: Any  # ``controls.errors``: errors.log lines, newest last
    started: float  # time.time() at construction
    ready: bool  # every attached store is loaded
    control: Node  # ``.memfuse/``
    #: sha256 states of recently committed contents: an append is hashed over its suffix
    hashes: Sha256States
    #: the bytes of recently held contents (``APPEND_CHECK_MIN`` bytes or more): an append's
    #: base at open (``_make_buf``) and at close (``_checked_prefix``) without a blob read
    recent: RecentContents
    #: the hints the secret scans of recent appends found: the next append to the same file
    #: is scanned over its suffix, not its 16 KiB context again (``secretscan``)
    scans: AppendScans

    def __init__(self, blobs: BlobCache, client: Any, journal: Journal,
                 settings: Settings | None = None, workspace: str = "",
                 dirs_file: Path | None = None, rejected: list[dict[str, Any]] | None = None,
                 local: list[dict[str, Any]] | None = None, *, ids: RecordIds | None = None,
                 listener: FsListener | None = None, metrics: Any = None,
                 mount_root: str = "", backoff_max: float = 30.0,
                 interrupts: Interrupts | None = None) -> None:
        """``rejected``: the rejected files a previous process kept
        (``Journal.load_rejected``), ``local``: its local-only files
        (``Journal.load_local``); both put back as each store is added (``add_store``).
        ``interrupts``: the openers of writable handles, whose stop signals end a close's or
        an fsync's wait for the control plane (its ``run`` is the sidecar's task)."""
        self.blobs = blobs
        self.interrupts = interrupts if interrupts is not None else Interrupts()
        self.client = client  # refetch: a clean content the blob cache lost or found damaged
        self.hashes = Sha256States()
        self.recent = RecentContents(min_bytes=APPEND_CHECK_MIN)
        self.scans = AppendScans()
        self.journal = journal
        self.ids = ids if ids is not None else RecordIds(journal, {})
        self.listener = listener
        self.metrics = metrics  # memfuse.sidecar.metrics.Metrics, or None
        self.init_dirs(dirs_file)  # dirs.json (NamespaceOps.load_dirs)
        self.committer = Committer(client, journal, self.ids, listener=self,
                                   base_content=self._cached_blob, backoff_max=backoff_max,
                                   metrics=metrics, store_created=self._store_created)
        self.settings = settings or Settings()
        # a close that waits for the commit need not wait for the journal too when the
        # acknowledgement comes first (Journal.HOLD); with --commit-wait 0 (or near it) the
        # close waits only for the journal, which then writes at once
        self.committer.hold_journal = self.settings.commit_wait > 2 * journal.HOLD
        #: calls in a row that returned before the journal had their change on disk
        #: (``changes_durable``: logged at the first of a streak)
        self._changes_unsettled = 0
        self.workspace = workspace
        self.inodes = {}
        self.by_key = {}
        self.by_rid = {}
        self.handles = {}
        self.stores = {}
        self.shadowed = {}
        self.unshadow_due = set()
        self._next_ino = ROOT_INO
        self._next_fh = 0
        self.controls = ControlFiles(self, journal=journal, host=listener, mount_root=mount_root)
        self.errors = self.controls.errors  # errors.log entries, newest last
        self.started = time.time()
        self.ready = False
        now = time.time_ns()
        self.root = self._new_node("", None, True, None, 0o555, now)
        self.control = self._new_node(CONTROL_DIR, self.root, True, None, 0o555, now)
        for fname, kind in FILES.items():
            self._new_node(fname, self.control, False, None, 0o444, now).special = kind
        self._init_rejected(rejected)
        self._init_local(local)

    def invalidate(self, items: list[tuple[Any, ...]]) -> None:
        """Hand kernel invalidations to the sidecar (``FsListener.invalidate``); nothing
        without one (no mount, nothing cached)."""
        if self.listener is not None and items:
            self.listener.invalidate(items)

    def add_store(self, slug: str, access: str, records: Sequence[Record | Meta], *,
                  unsent: Sequence[Entry] = (), **kw: Any) -> StoreMount:
        """``RemoteApply.add_store``, then the store's rejected files and local-only files
        kept from before a restart are put back (``RejectedFiles``, ``LocalFiles``).

        The tree just built is the store's state as loaded; what this process remembers of
        its files from an earlier mount of it (the store taken out and put back: admin
        ``mounts remove`` / ``add``, a detach and attach; or the key map and merge states a
        previous process left) is re-validated against it (``_revalidate_store``), except
        for files with a change still to commit: ``unsent`` (the entries a previous process
        left, not queued yet: ``Committer.replay`` comes after) and the store's entries the
        committer still holds, which are then shown on top of the loaded tree as at a
        restart (``overlay_outbox``; docs/SEMANTICS.md, "Life cycle"), and for the rejected
        files of an earlier mount of the store in this process, which keep the version they
        were refused over (docs/SEMANTICS.md: a fix is sent on it, by the conflict rules)."""
        sm = super().add_store(slug, access, records, **kw)
        queued = self.committer.queued(slug)
        keep = {e.node_key for e in (*queued, *unsent) if e.node_key}
        if slug not in self._rejected_restore:
            # mounted again in this process: its rejected files keep the version they were
            # refused over as their base (as the feed leaves it, ``_remote_over_rejected``),
            # so a fix is sent by the conflict rules, never as an overwrite of what the
            # store loaded (verify 11, N2: a write refused ``store_not_attached`` at a detach)
            keep.update(k for k, r in self._rejected_rows.items() if r["store"] == slug)
        self._revalidate_store(sm, keep)
        self._restore_rejected(sm)
        self._restore_local(sm)
        if queued:  # taken out with changes in the outbox: they show as they commit
            try:
                self.overlay_outbox(queued)
            except sqlite3.Error as exc:  # a deferred put's content unreadable (Committer.fill)
                log.warning("queued changes of a store loaded again not shown before they commit",
                            extra={"store": slug, "error": str(exc)})
        return sm

    def _revalidate_store(self, sm: StoreMount, keep: set[str]) -> None:
        """The store ``sm`` was just loaded (``add_store``): every record of it whose node key
        is not in ``keep`` (files with a change still to commit) gets, as the base of its
        next update, the sha256 its loaded file shows (``RecordIds.note``, memory only, as a
        remote change seen), and loses any merge state of an earlier put
        (``Committer.forget_merge``). Both may be left from an earlier mount of the store in
        this process (the feed, stopped while the store was out, did not bring the changes
        made meanwhile) or from a previous process (the journal's key map persists commits
        only): an append written on the loaded content, sent as a suffix against an older
        version, would repeat what was added since (attack 11, F6)."""
        by_rid = self.by_rid
        for key, (rid, sha) in list(self.ids.map.items()):
            if key in keep or not key.startswith("r:"):
                continue
            n = by_rid.get(key[2:])
            if n is not None and n.store is sm and n._key is None and (rid, sha) != (n.record_id, n.sha):
                self.ids.note(key, n.record_id, n.sha)
        for key in list(self.committer.resolver.merged):
            if key in keep:
                continue
            rid = key[2:] if key.startswith("r:") else self.ids.record_id(key)
            n = by_rid.get(rid) if rid else None
            if n is not None and n.store is sm:
                self.committer.forget_merge(key)

    def remove_store(self, slug: str) -> list[tuple[Any, ...]]:
        """``RemoteApply.remove_store``; the store's local-only files are kept for a later
        mount of it (``LocalFiles.take_local``)."""
        sm = self.stores.get(slug)
        if sm is not None:
            self.take_local(sm)
        return super().remove_store(slug)

    def _store_created(self, slug: str) -> str:
        """The creation time of the store mounted under ``slug`` (``StoreMount.created``),
        '' when none is or it is unknown: the stamp of the entries written in it
        (``Committer.submit``)."""
        sm = self.stores.get(slug)
        return sm.created if sm is not None else ""

    def forget_store(self, slug: str) -> int:
        """The store that was mounted under ``slug`` (taken out of the tree already:
        ``remove_store``) was deleted, and another store made under its name (attack 16
        F7): the rejected and local-only files kept for a later mount of it are dropped, not
        carried into the new store (their content belonged to the deleted one), each named
        in ``errors.log`` (path, code ``store_replaced``; never content); their journal rows
        go. Returns how many were dropped."""
        assert slug not in self.stores, "forget a store once it is out of the tree"
        rows = list(self._rejected_restore.pop(slug, []))
        for k, r in list(self._rejected_rows.items()):
            if r["store"] == slug:
                rows.append(r)
                del self._rejected_rows[k]
                self._rejected_saved.pop(k, None)
        for n in [n for n in self._rejected if n.store is not None and n.store.slug == slug]:
            del self._rejected[n]
        if rows:
            self.journal.replace_rejected([slug], [])
        local = list(self._local_restore.pop(slug, []))
        for key, sig in list(self._local_saved.items()):
            if sig[0] == slug:
                self.journal.delete_local(key)
                del self._local_saved[key]
        for row in local:
            self.journal.delete_local(row["node_key"])
        paths = sorted({str(r.get("path", "")) for r in (*rows, *local)})
        for path in paths:
            self.note_error(None, path, errno.ESTALE,
                            "the store was deleted (a new store has its name): this file of "
                            "the deleted store is not carried into the new one",
                            STORE_REPLACED, slug)
        return len(paths)

    # ------------------------------------------------------------------ checks
    def _store_of(self, n: Node) -> StoreMount:
        if n.store is None:
            raise FsError(errno.EACCES, "the mount root and .memfuse are read-only")
        return n.store

    def _writable_dir(self, d: Node) -> StoreMount:
        """The store of directory ``d``, where a namespace change (create, mknod, mkdir,
        unlink, rmdir, either side of a rename) is about to happen; the one place those
        resolve their parent inode. Raises ``FsError``: ``ENOTDIR`` (not a directory),
        ``EACCES`` (the mount root, ``.memfuse``), ``ENOENT`` (``d`` or a directory above it
        is no longer in the tree: removed here, pruned or deleted by a remote change, its
        store taken out of the mount; a shell's cwd still holds the inode. As on a local
        filesystem whose cwd was rmdir'ed, nothing is made there, so nothing is sent for a
        path no one here can see: attack 14 F4), ``EROFS`` (a read-only store)."""
        if not d.is_dir:
            raise FsError(errno.ENOTDIR)
        sm = self._store_of(d)
        a = d
        while a is not sm.root:
            if a._x is not None and a.unlinked:  # Node: _x None, not unlinked
                raise FsError(errno.ENOENT, "the directory was removed")
            parent = a.parent
            assert parent is not None  # a node of a store, below its root
            a = parent
        if sm.detached:
            raise FsError(errno.ENOENT, f"store {sm.slug} was taken out of the mount")
        if not sm.writable:
            raise FsError(errno.EROFS, f"store {sm.slug} is attached read-only")
        return sm

    def _check_name(self, d: Node, name: bytes) -> str:
        """``name``, a new entry of directory ``d`` (create, mkdir, rename target), as
        ``str``; refused (``errors.log`` line, ``FsError``) with ``EINVAL`` /
        ``ENAMETOOLONG`` for the name rules (docs/SEMANTICS.md, "Names": ``check_component``
        and, for a name given, ``check_new_name``; at a store's root ``check_root_name``, no
        look-alike of the index) and ``EPERM``
        (``secret_detected``) for a name holding a secret (``content.find_secret_in_path``;
        the line shows the name redacted)."""
        try:
            s = names.check_component(name)
            if d.store is not None and d is d.store.root:
                names.check_root_name(s)  # first, as in ``check_new_path``: the same reason
            names.check_new_name(s)
        except names.NameError_ as e:
            code = "path_too_long" if e.too_long else "invalid_path"
            self.refuse(d, name.decode("utf-8", "replace"), errno_of(code), e.reason, code)
        found = content_rules.find_secret_in_path(s)
        if found is not None:
            # a credential in a name would show in listings, history and logs: refused at
            # once (as the control plane would), logged by its kind and a redacted form
            self.refuse(d, found.redacted, errno_of("secret_detected"), found.reason,
                        "secret_detected")
        dpath = d.path()
        path = (dpath + "/" + s) if dpath else s
        if not self.is_local_only(s):
            try:
                names.check_path(path)
            except names.NameError_ as e:
                code = "path_too_long" if e.too_long else "invalid_path"
                self.refuse(d, s, errno_of(code), e.reason, code)
        return s

    def is_local_only(self, name: str) -> bool:
        """Whether ``name`` (one path component) matches a local-only pattern (editor and
        tool temporaries kept in this sidecar, never sent: ``Settings.local_only_patterns``)."""
        return names.is_local_only(name, self.settings.local_only_patterns)

    def refuse(self, where: Node | None, name: str, err: int, reason: str, code: str = "") -> NoReturn:
        """Record a refusal in ``errors.log`` and raise it as ``FsError``."""
        self.note_error(where, name, err, reason, code)
        raise FsError(err, reason, code)

    def note_error(self, where: Node | None, name: str, err: int, reason: str,
                   code: str = "", store: str = "") -> None:
        """Record a refusal at ``where`` / ``name`` (``where`` None: ``name`` is the path in
        ``store``) in ``errors.log`` and the log with its errno, reason code and reason
        (``ControlFiles.note_error``); raises nothing."""
        store = where.store.slug if where is not None and where.store else store
        base = where.path() if where is not None and where.store else ""
        path = f"{base}/{name}" if base and name else (name or base)
        self.controls.note_error(store, path, err, reason, code)

    # ------------------------------------------------------------------ content
    def read(self, h: Handle, off: int, size: int) -> bytes:
        """Bytes ``[off, off+size)`` of the file open as ``h``: the snapshot taken at open
        for ``.memfuse`` files, else the write buffer or the cached blob."""
        if h.snapshot is not None:
            return h.snapshot[off:off + size]
        n = h.node
        x = n._x
        if x is not None and x.get("shown") and n.buf is None and self.kernel_behind(n.ino):
            older = self._read_shown(h, n, x, off, size)
            if older is not None:
                return older
        if h.replaced and not self._read_across(h, n, off):
            pass  # the reader holds the replaced content, or a mix: not served the current one
        elif x is not None and ("read_base" in x or "unread" in x or "shown" in x):
            # the reader is served the current content (a handle opened before a remote
            # change reads it once the kernel's pages are invalidated), or what the kernel
            # still shows: Node.read_base
            self._served(n, x)
        if n.buf is not None:
            return bytes(n.buf[off:off + size])
        if off >= n.size or not n.sha:
            return b""
        data = self.blobs.read(n.sha, off, size)
        if not data and size > 0:  # absent or damaged (dropped): MemfuseOps refetches it
            raise ContentMissing(n)
        return data

    def _read_shown(self, h: Handle, n: Node, x: dict[str, Any], off: int,
                    size: int) -> bytes | None:
        """A read of bytes ``[off, off+size)`` of file ``n`` (side table ``x``) through ``h``
        while the kernel may still hold the size (and pages) of an older content
        (``Node.shown``: the invalidation of a change has not reached it,
        ``kernel_behind``). The kernel cuts what a read returns
        at the size it holds, so a reader served the current content would get it cut at
        the older size, content no one wrote (attack 15 F1: ``sed -i`` committed it): the
        reader is served that older content whole instead, which becomes the base of an
        overwrite (``_served``), and the handle is checked against it once the kernel is
        told (``Handle.replaced``: a later read of the current content from an offset on
        holds parts of two). Returns those bytes of the older content, or None when the
        blob cache no longer holds it (the kernel asks only for bytes within its size: an
        empty answer is a missing blob): the reader is then served the current content,
        and an overwrite after it is last writer wins with a conflict line
        (``UNKNOWN_BASE``). Raises ``CacheError`` when the cache cannot be read. Nothing
        awaits here."""
        shown = x["shown"]
        older = None
        if shown != n.sha:
            kept = self.recent.get(shown)
            older = kept[off:off + size] if kept is not None else self.blobs.read(shown, off, size)
            if not older and size > 0:
                older = None
        if older is None:
            if shown != n.sha and x.get("read_base") != UNKNOWN_BASE:
                x["read_base"] = UNKNOWN_BASE
                log.warning("a reader was served a file's content while the kernel still held "
                            "the size of an older one no longer cached; its overwrite is last "
                            "writer wins with a conflict line",
                            extra={"store": n.store.slug if n.store else None, "path": n.path()})
            return None
        self._served(n, x)
        if h.replaced != shown:
            h.replaced, h.across = shown, ""
        if self.listener is not None:
            self.listener.kernel_served_older(n.ino)
        return older

    def _read_across(self, h: Handle, n: Node, off: int) -> bool:
        """A read at byte ``off`` through ``h``, a handle open for reading when a remote
        change or the merge of our own write replaced the file's content
        (``Handle.replaced``, the older content's sha256): the reader may hold any part of
        the older content before ``off`` (its earlier reads, or the kernel's pages), and
        gets the current content from here on. Returns True when that is the current
        content (it extends the older one: an append; the handle is then an ordinary
        reader again). Otherwise the overwrite base of the file stays the older version
        when the reader holds exactly it (the current content has the same bytes from
        ``off`` on: ``Handle.across`` ``"old"``), else it is unknown (``"mixed"``:
        ``Node.read_base`` ``UNKNOWN_BASE``, last writer wins with a conflict line; verify
        11, a ``sed -i`` whose reads straddled a merge shown). Raises ``ContentMissing``
        as ``read`` does."""
        if not h.across:
            old = self._cached_blob(h.replaced)
            cur = self._content(n)
            if old is not None and cur.startswith(old):
                h.replaced = ""
                return True
            h.across = "old" if old is not None and cur[off:] == old[off:] else "mixed"
        elif h.across == "old":
            cur = self._content(n)
            old = self._cached_blob(h.replaced)
            if old is None or cur[off:] != old[off:]:
                h.across = "mixed"
        if h.across == "old" and not n.read_base:
            n.read_base = h.replaced  # what this reader holds (a reader since dropped it)
        elif h.across == "mixed" and n.read_base != UNKNOWN_BASE:
            n.read_base = UNKNOWN_BASE
            log.info("a reader was served parts of two contents of a file (its reads straddled "
                     "a change); its overwrite is last writer wins with a conflict line",
                     extra={"store": n.store.slug if n.store else None, "path": n.path()})
        return False

    def _served(self, n: Node, x: dict[str, Any]) -> None:
        """A reader of file ``n`` (side table ``x``, ``n._x``) is served its content: by an
        open for reading or a read. An overwrite after it is based on what the reader got
        (``Node.read_base``, docs/SEMANTICS.md "Conflicts"): the current content, unless the
        kernel may still show an older one (``kernel_behind``: the invalidation of a change
        has not reached it): then the reader may get the pages and the size of the content
        before that change (``Node.shown``), which becomes the base unless an older one is
        kept already. Nothing awaits here."""
        if self.kernel_behind(n.ino):
            shown = x.get("shown")
            if shown and "read_base" not in x and shown != n.sha:
                x["read_base"] = shown
            return
        if not self._kept_open(x):  # else the next overwrite may be of a kept inode's reader
            x.pop("read_base", None)
        x.pop("unread", None)
        x.pop("shown", None)
        x.pop("served", None)
        if not x:
            n._x = None  # back on the warm paths

    @staticmethod
    def _kept_open(x: dict[str, Any]) -> bool:
        """Whether a kept inode of an older content of the file whose side table is ``x``
        is still open (``Node.kept_open``, pruned here of the closed ones)."""
        kept = x.get("kept_open")
        if not kept:
            return False
        kept[:] = [g for g in kept if g.opened > 0]
        if not kept:
            del x["kept_open"]
        return bool(kept)

    def shown_size(self, n: Node) -> int | None:
        """The size of the older content the kernel still shows of file ``n``
        (``Node.shown``, the invalidation of a change not made yet: ``kernel_behind``) while
        a handle holds ``n`` open for reading (``reading``: the invalidation waits for it),
        to answer the kernel's attribute requests with; None otherwise, or when that content
        is no longer cached. Never blocks."""
        x = n._x
        shown = x.get("shown") if x is not None else None
        if not shown or shown == n.sha or not self.reading(n.ino):
            return None
        older = self._cached_blob(shown)
        return None if older is None else len(older)

    def kernel_told_size(self, n: Node) -> None:
        """The attributes of file ``n`` (its current size) are being sent to the kernel (a
        lookup, getattr or readdirplus answer) while the invalidation of a change has not
        reached it (``kernel_behind``, ``Node.shown`` set): the kernel takes that size and
        drops its pages of the older content when the size or mtime differs, so its readers
        are served the current content from now on (``read``), not the older one. Never
        blocks."""
        x = n._x
        if x is not None:
            x.pop("shown", None)
            if not x:
                n._x = None

    def _cached_blob(self, sha: str) -> bytes | None:
        """The cached content whose sha256 is ``sha`` (checked), None when the blob cache
        does not hold it or cannot be read."""
        kept = self.recent.get(sha)  # exact: held under the sha256 of those bytes
        if kept is not None:
            return kept
        try:
            return self.blobs.get(sha)  # checked against sha (BlobCache._load)
        except (CacheError, sqlite3.Error):
            return None

    def _hold_content(self, n: Node, data: bytes, sha: str, what: str,
                      base: tuple[str, int] | None = None, *, hashed: bool = False) -> None:
        """Make ``data`` (whose sha256 is ``sha``) the content of file ``n``: ``n.sha`` and
        ``n.size`` set, the bytes in the blob cache (reads are served from there, ``n.buf``
        None), or, when the cache disk refuses them (full or failing), kept in memory
        (``n.buf``, reads served from it) with a warning naming ``what`` was kept (never the
        content). ``base``: ``(sha256, length)`` of a cached blob that ``data`` starts with
        (an append): stored as a link to it plus the suffix when the cache can
        (``BlobCache.put_append``), else whole. ``hashed``: ``sha`` was computed here from
        ``data`` (not a sha256 the control plane claims), so the blob cache may hold it in
        memory a while and write it with others (``BlobCache.put_behind``). Accounting
        (``_account``) is the caller's."""
        n.sha, n.size = sha, len(data)
        self.recent.keep(sha, data)  # the base of the next append to it (``_make_buf``)
        if base is not None and base[0] != sha:
            # the content this one extends is superseded: the base of no next append (a
            # rebase or a reader of it reads the blob cache). Kept, ``recent`` held the last
            # versions of one journal, each 1 MiB a line at 1 MiB (bench/README.md,
            # "Appends, session 23")
            self.recent.drop(base[0])
        try:
            if base is None or not self.blobs.put_append(sha, base[0], base[1], data[base[1]:]):
                if hashed:
                    self.blobs.put_behind(data, sha)
                else:
                    self.blobs.put(data, sha)
            n.buf = None
        except CacheError as err:
            n.buf = bytearray(data)
            log.warning(f"blob cache write failed; {what} stays in memory",
                        extra={"store": n.store.slug if n.store else None, "path": n.path(),
                               "reason": err.reason})

    def _content(self, n: Node) -> bytes:
        if n.buf is not None:
            return bytes(n.buf)
        if not n.sha:
            return b""
        kept = self.recent.get(n.sha) if n.size >= APPEND_CHECK_MIN else None
        return kept if kept is not None else self._clean_content(n)

    def _clean_content(self, n: Node) -> bytes:
        """The clean content of ``n`` (``n.sha``, ``n.size`` bytes) from the blob cache,
        checked (``BlobCache.get``). Raises ``ContentMissing`` when it is absent or damaged
        (never another content: it may become the base of a write), ``CacheError``."""
        data = self.blobs.get(n.sha) if n.size else b""
        if data is None:
            raise ContentMissing(n)
        return data

    async def refetch(self, n: Node) -> None:
        """Fetch the clean content of ``n`` (sha256 ``n.sha``) again from the control plane
        and hold it (``_hold_content``: the blob cache, or memory when its disk refuses) —
        what a ``ContentMissing`` asks for. Bounded by ``REFETCH_TIMEOUT`` (s). Raises
        ``FsError(EIO)`` with a logged reason when it cannot: no record id (never
        committed), the control plane unreachable or slow, or holding neither this version
        nor its content (redacted, pruned)."""
        sha, slug, rid, version = n.sha, n.store.slug if n.store else "", n.record_id, n.version
        extra = {"store": slug, "path": n.path(), "sha256": sha}
        if not slug or not rid:
            log.warning("file content missing from the blob cache and never committed; EIO", extra=extra)
            raise FsError(errno.EIO, "the file's content is missing from the blob cache")
        try:
            with trio.fail_after(REFETCH_TIMEOUT):
                rec = await self.client.get_record(slug, rid, content=True)
                text, got = rec.content, rec.sha256
                if got != sha and version:
                    v = await self.client.version(slug, rid, version)
                    text, got = v.content, v.sha256
        except Exception as e:  # offline, refused, slow: the content is not there to serve
            log.warning("file content missing from the blob cache; the control plane did not "
                        "give it; EIO", extra={**extra, "error": type(e).__name__})
            raise FsError(errno.EIO, "the file's content is missing from the blob cache and "
                                     "the control plane did not give it") from None
        data = text.encode("utf-8") if text is not None else None
        if data is None or got != sha or sha256_hex(data) != sha or n.sha != sha:
            log.warning("file content missing from the blob cache; the control plane holds "
                        "another content now; EIO", extra=extra)
            raise FsError(errno.EIO, "the file's content is missing from the blob cache")
        if n.buf is None:
            self._hold_content(n, data, sha, "the content fetched again")
        log.info("file content fetched again from the control plane", extra=extra)

    def _make_buf(self, n: Node, *, replacing: bool = False) -> WriteBuffer:
        """``n``'s write buffer, made from its current content at a write session's first
        change. Such a session's content derives from that content, which is then its base
        (the version this sidecar last saw), unless the session replaces the content whole
        (``Node.replacing``: ``replacing``, a truncate to 0, an ``O_TRUNC`` open, a file
        renamed over a record: written on what the writer read, ``Node.read_base``). A
        ``read_base`` stays for the readers it was recorded for (``sed -i`` reads while
        ``echo >>`` appends)."""
        if replacing:
            n.replacing = True
        if n.buf is None:
            if n.sha and n.size >= APPEND_CHECK_MIN:
                # the content by reference (an append adds to it, ``appendbuf``): from
                # memory when this sidecar held it last (the previous close of a journal),
                # else read once from the blob cache and kept
                base = self.recent.get(n.sha)
                if base is None:
                    base = self._clean_content(n)
                    self.recent.keep(n.sha, base)
                n.buf = AppendBuffer(base, n.sha)
            else:
                n.buf = bytearray(self._content(n))
        elif not n.dirty:
            self._keep_prior(n)  # this session changes the held content in place
        return n.buf

    def _keep_prior(self, n: Node) -> None:
        """A write session's first change of a content only memory holds (``n.buf`` while
        not dirty: the blob cache refused it, a full cache disk): keep a copy of it
        (``Node.prior``), the only one left once the session changes ``n.buf``, so that a
        write its close withdraws can be undone (``_withdraw``). Costs one copy of the file,
        only while the cache disk refuses contents. Local-only files are never withdrawn."""
        if n.buf is not None and not n.local_only and n.sha:
            n.prior = (n.sha, bytes(n.buf))

    def write(self, h: Handle, off: int, data: bytes) -> int:
        """write(2) of ``data`` at byte offset ``off`` (the end for ``O_APPEND``) through
        ``h``; returns the number of bytes written. Raises ``FsError``: ``EBADF`` (not open for
        writing), ``EFBIG`` (the record would pass ``max_record_bytes``), ``ENOSPC`` (the store
        would pass ``max_store_bytes``); a refused write holds the session back (``Node.refused``)."""
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
        self._judge(n, buf, off, data)  # EILSEQ / EPERM / EINVAL: not applied
        if off > len(buf):
            buf.extend(b"\0" * (off - len(buf)))
        buf[off:end] = data
        self._account(n, len(buf) - old)
        self._touch_content(n)
        h.modified = True
        return len(data)

    def truncate(self, n: Node, size: int, *, judge: bool = False) -> None:
        """Set the file's size to ``size`` bytes (cut, or zero-filled). Raises ``FsError``:
        ``EISDIR``, ``EACCES`` (control file / mount root), ``EROFS`` (read-only store),
        ``EFBIG`` / ``ENOSPC`` (limits, as ``write``).

        ``judge`` (truncate(2) by path: no close follows, the result is final): the content
        it would leave must also pass the checks of a close (``_precheck``: ``EILSEQ`` for
        NUL bytes or a cut UTF-8 sequence, ``EPERM`` for a secret, ``EINVAL`` for a bad
        type); else the truncate is refused with that errno and a line in ``errors.log``,
        and the file is left as it was (as for ``EFBIG``)."""
        if n.is_dir:
            raise FsError(errno.EISDIR)
        if n.special:
            raise FsError(errno.EACCES)
        self._check_writable_file(n)
        self._check_size(n, size, truncating=True)
        self._check_growth(n, size)
        ch = n.checker
        if ch is not None:
            ch.clean_len = -1  # the content changes here, not through check_write
        if judge and not n.local_only and n.cur_size() != size:
            cur = self._content(n)
            after = cur[:size] + b"\0" * (size - len(cur))
            refusal = self._precheck(n, after)
            if refusal is not None:
                self.refuse(n.parent, n.name, refusal.errno,
                            refusal.reason + "; the truncate was not applied", refusal.code)
        buf = self._make_buf(n, replacing=size == 0)
        if not judge:  # ftruncate(2) on a descriptor: judged as a write (EILSEQ for NULs)
            self._judge(n, buf, 0, size=size)
        self._account(n, size - len(buf))
        if size < len(buf):
            del buf[size:]
        else:
            buf.extend(b"\0" * (size - len(buf)))
        self._touch_content(n)

    def _touch_content(self, n: Node) -> None:
        if not n.unread and n.sha and not n.served:
            n.served = n.sha  # the content readers were served before this write (Node.served)
        n.dirty = True
        n.unread = True  # what a writer made here: no reader was served it yet (Node.unread)
        now = time.time_ns()
        n.mtime_ns = n.ctime_ns = now
        n.xmtime = None  # a write sets the mtime (an explicit one is gone)

    def _check_writable_file(self, n: Node) -> None:
        sm = self._store_of(n)
        if not sm.writable:
            raise FsError(errno.EROFS, f"store {sm.slug} is attached read-only")

    # ------------------------------------------------------------------ open / create
    def open(self, ino: int, flags: int) -> Handle:
        """open(2) of the file ``ino`` with ``flags`` (``os.O_*``; ``O_TRUNC`` arrives here,
        libfuse's atomic truncation); returns a new ``Handle``. Raises ``FsError``: ``ENOENT``,
        ``EISDIR``, ``EACCES`` (writing a ``.memfuse`` file), ``EROFS`` (writing on a read-only
        store). A ``.memfuse`` file's content is rendered once, into the handle."""
        n = self.node(ino)
        if n.children is not None:  # a directory
            raise FsError(errno.EISDIR)
        writing = flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC)
        if not writing and n._x is None:  # a reader of a plain file (Node: _x): the warm path
            return self._new_handle(n, flags)
        special = n.special
        x = n._x
        if not writing and x is not None:
            # a reader is served the content (Node.unread, Node.read_base; a writing open
            # keeps them: vim reads, then opens to rewrite)
            self._served(n, x)
        if writing:
            if special:
                raise FsError(errno.EACCES, ".memfuse files are read-only")
            if x is not None and n.kept:
                # the older content kept for its readers (keep_for_readers), reached through
                # a name the kernel has not dropped yet: the kernel looks it up again on
                # ESTALE and opens the file's current inode
                raise FsError(errno.ESTALE, "the file was replaced; open it again")
            self._check_writable_file(n)
            n.refused, n.refused_code = 0, ""  # a new write session: its content is judged at commit
            n.checker = None  # ... and at each write (writecheck), from what it holds now
        if special:  # one consistent snapshot per open: json.load may read twice
            h = self._new_handle(n, flags)
            h.snapshot = self.controls.opened(special)
            return h
        if flags & os.O_TRUNC and n.cur_size() > 0:
            if not n.dirty:
                self._keep_prior(n)  # replaced below: kept to undo a withdrawn write
            self._account(n, -n.cur_size())
            n.buf = bytearray()
            self._touch_content(n)
            n.replacing = True
        elif flags & os.O_TRUNC:
            n.dirty = True  # opening with O_TRUNC is a write, even of nothing
            n.replacing = True
        h = self._new_handle(n, flags)
        if flags & os.O_TRUNC:
            self.rewriting(n, h)
        return h

    def rewriting(self, n: Node, h: Handle) -> None:
        """``h`` (open on ``n``) emptied the file for a rewrite (an ``O_TRUNC`` open, a
        ``ftruncate(0)``): what any handle of it wrote before is gone, so none holds a write
        of its own (``Handle.modified``) until its next one; ``h`` rewrites the file until it
        is released (``Node.rewriters``). Costs a walk of the open handles when the file has
        others open."""
        if h.fh not in n.rewriters:
            n.rewriters = n.rewriters + (h.fh,)
        h.modified = False
        if n.opened > 1:
            for x in self.handles.values():
                if x.node is n:
                    x.modified = False

    @staticmethod
    def rewritten_by_another(n: Node, h: Handle) -> bool:
        """Whether another open handle of ``n`` is rewriting it (``Node.rewriters``) and ``h``
        wrote nothing since it was emptied: ``h``'s fsync or release then commits nothing (the
        emptied file, or the first of the rewrite's writes, is not a version; the rewrite's
        close commits it)."""
        if h.modified or n._x is None:
            return False
        return any(fh != h.fh for fh in n.rewriters)

    def create(self, parent_ino: int, name: bytes, mode: int, flags: int, uid: int, gid: int) -> Handle:
        """create(2) of ``name`` in directory ``parent_ino`` with permission bits ``mode``
        (``uid`` / ``gid``, the caller's, are not used: every file belongs to the mount's
        ``--uid`` / ``--gid``); returns the open ``Handle`` (the new file counts one kernel
        lookup). A name that exists here is opened as ``open(2)`` would (``flags``;
        ``_create_existing``), ``EEXIST`` only with ``O_EXCL``. Raises ``FsError``:
        ``EEXIST``, ``EISDIR``, ``ENOTDIR``, ``EACCES`` (mount root), ``EROFS``, ``EINVAL`` /
        ``ENAMETOOLONG`` (name rules), ``ENOSPC`` (the store's record limit)."""
        d = self.node(parent_ino)
        sm = self._writable_dir(d)
        assert d.children is not None  # _writable_dir: a directory
        try:
            old = d.children.get(name.decode("utf-8"))
        except UnicodeDecodeError:
            old = None
        if old is not None:
            if flags & os.O_EXCL:
                raise FsError(errno.EEXIST)
            return self._create_existing(old, flags)
        s = self._check_name(d, name)
        local = self.is_local_only(s)
        if not local and sm.count >= sm.max_records:
            self.refuse(d, s, errno_of("store_full"),
                        f"store {sm.slug} holds {sm.max_records} records, its limit", "store_full")
        if local and sm.local_count >= sm.max_records:
            # a count of their own (a store full of records still lets vim make its swap
            # and backup files), bounded by the same number
            self.refuse(d, s, errno_of("store_full"),
                        f"store {sm.slug} holds {sm.max_records} local-only files, its limit",
                        "store_full")
        # owned by the mount's --uid / --gid, not the caller's: the owner a file shows must
        # not change at the next restart (nothing stores it); chown to another is EPERM
        n = self._new_node(s, d, False, sm, stat.S_IMODE(mode) & MODE_MASK, time.time_ns())
        n.unread = True  # made by a writer; no reader was served it yet (Node.unread)
        n.local_only = local
        n.key = "n:" + new_key()
        self.by_key[n.key] = n
        n.buf = bytearray()
        n.dirty = True  # a local-only file is kept once closed (LocalFiles), even empty
        self._live(n, +1)
        if local:
            self._local.add(n)
        n.nlookup += 1
        self._touch_dir(d)
        return self._new_handle(n, flags)

    def _create_existing(self, n: Node, flags: int) -> Handle:
        """create(2) without ``O_EXCL`` of the name of ``n``, which exists here: the kernel
        looked the name up absent (its negative entry), then a change made elsewhere was
        applied at it (another mount's create of the same path at the same moment) before
        the kernel's CREATE came. On a local disk such an open opens the file, so it is
        opened as ``open`` would (``O_TRUNC`` truncates it; a directory is ``EISDIR``) and
        counts one kernel lookup, never ``EEXIST`` (attack 17 F9: ``open(p, "w")`` and
        dash's ``>`` failed). A writer that truncates it read no version of it: its
        overwrite is based on none (``ABSENT_BASE``), last writer wins with a conflict
        line, as for a create that reaches the control plane second. Raises what ``open``
        raises."""
        if n.children is not None:
            raise FsError(errno.EISDIR)
        h = self.open(n.ino, flags)
        n.nlookup += 1
        if flags & os.O_TRUNC and not n.local_only and n.store is not None:
            n.read_base = ABSENT_BASE
        log.info("create of a name made elsewhere just before: the file is opened",
                 extra={"store": n.store.slug if n.store else None, "path": n.path(),
                        "truncated": bool(flags & os.O_TRUNC)})
        return h

    def _touch_dir(self, d: Node) -> None:
        d.mtime_ns = d.ctime_ns = time.time_ns()

    # ------------------------------------------------------------------ flush / fsync / release
    def commit(self, n: Node, *, hold: bool = False) -> Entry | Barrier | None:
        """Turn a dirty file into an accepted change (outbox ``put``).

        Returns the outbox entry, or None when there is nothing to send (not dirty, a
        directory or control file, unlinked); for a local-only file, which is never sent, a
        ``Barrier`` set once its kept copy is on disk (``LocalFiles.save_local``). Raises ``FsError`` when the content
        is refused here already — held back by a refused write of this session (``EFBIG`` /
        ``ENOSPC``), or by ``_precheck`` (the fast path of the errno table in docs/API.md:
        ``EILSEQ``, ``EPERM``, ``EINVAL``); the file then keeps the refused content with
        ``state=rejected``, the reason is in ``errors.log`` and nothing is sent. Callers
        without a syscall to fail use ``commit_quietly``. ``hold``: the caller's system
        call waits for the commit (``flush``, ``fsync``), so the journal may hold the
        entry's insert (``Committer.submit``); every other caller's entry is written at once.
        """
        if not n.dirty or n.is_dir or n.special:
            return None
        n.dirty = False
        n.renamed_over = False  # this commit carries (or refuses) what the name shows
        ch = n.checker
        n.checker = None  # the whole content is judged here; a later write starts afresh
        if n.unlinked:
            return None
        if n.local_only:  # never sent: kept in the journal (LocalFiles), on disk at the barrier
            self.save_local(n)
            return self.journal.barrier()
        buf = n.buf
        appended = buf.appended_to if isinstance(buf, AppendBuffer) else None
        was = (n.sha, n.state, n.last_put, n.size)  # what the file showed: Entry.before
        prior = n.prior
        if prior is not None:
            n.prior = None
        data = self._content(n)  # the write buffer, or the clean content (e.g. renamed back)
        # the content before this write session passed these checks already (committed, or
        # queued after them) unless it was refused: an append is judged by what it adds
        prev_sha = n.sha if n.state != REJECTED else ""
        if n._key is None and n.sha:
            # the first commit of a record loaded from the control plane: its clean sha256
            # is the base the update is conditional on (If-Match)
            self.ids.note_default(n.key, n.record_id, n.sha)
        # on a full or failing cache disk the content stays in memory and the outbox entry
        # below carries it durably, when the journal can write; the next commit of this file
        # tries the blob cache again
        # an append (the content before this session plus a suffix) is judged by its suffix
        # and hashed from the base's kept hash state: one pass over the suffix (hashstate)
        checked = self._checked_prefix(prev_sha, data, appended)
        sha = self.hashes.of(data, prev_sha, checked)
        self._hold_content(n, data, sha, "the file's content", base=(prev_sha, checked) if checked else None,
                           hashed=True)  # self.hashes.of(data): computed from these bytes
        if n.refused:
            # an earlier put still in flight must not mark the file clean when it lands
            n.state, n.last_put = REJECTED, None
            self._mark_rejected(n, n.refused, n.refused_code)
            self.sync_rejected()
            raise FsError(n.refused, n.error)
        if n.lost_prior:
            if not n.replacing:  # it holds a withdrawn write: never sent (Node.lost_prior)
                self._refuse_lost_prior(n)
            n.lost_prior = False
        # a file written in one go had its whole content scanned for secrets at that write
        # (WriteChecker.clean_len): the same text, so not scanned again
        scanned = not checked and ch is not None and ch.clean_len == len(data)
        path = n.path()  # (no await from here to the submit: the path of both)
        refusal = self._precheck(n, data, path, checked=checked, base_sha=prev_sha, sha=sha,
                                 secret_free=scanned)
        if refusal is not None:
            n.state, n.error, n.last_put = REJECTED, refusal.reason, None
            self.note_error(n.parent, n.name, refusal.errno, refusal.reason, refusal.code)
            self._mark_rejected(n, refusal.errno, refusal.code)
            self.sync_rejected()
            raise refusal
        # the attributes ride with the content (cp -p, install -m, sed -i's fchmod)
        assert n.store is not None  # a record's file (not local-only, not a control file)
        args = {"path": path, "type": n.type_override, "mode": stat.S_IMODE(n.mode),
                "mtime_ns": n.xmtime}
        # the base of an overwrite is the version the writer could have read: when the
        # feed replaced the content readers here were served before this write replaced
        # it whole, the put is conditional on that older version (its If-Match fails, the
        # rival change is merged three-way or reported: ConflictResolver.put_base)
        # (a write session built on the current content is based on it: the read_base
        # stays for the readers it was recorded for, Node.replacing)
        x = n._x
        read_base = served = ""
        if x is not None and x.pop("replacing", False):
            read_base = x.pop("read_base", "")
            served = x.pop("served", "")
        if read_base and read_base != self.ids.get(n.key, n.store.slug)[1]:
            args["base"] = read_base
        elif served:
            # what readers here were served before a write here changed the file: the base
            # when that write's put was merged onto a rival change this file does not show
            # yet (ConflictResolver.put_base)
            args["served"] = served
        e = self.committer.submit(n.store.slug, PUT, n.key, args, data, hold=hold,
                                  sha=sha, append_base=(prev_sha, checked) if checked else None)
        e.before = Before(was[0], was[3], checked if checked and prev_sha == was[0] else -1,
                          was[1], was[2], prior[1] if prior is not None and prior[0] == was[0]
                          else None)
        n.last_put = e
        n.state, n.error = PENDING, ""
        self.sync_rejected()  # a fixed file is no longer kept as rejected (same batch as e)
        return e

    def commit_quietly(self, n: Node) -> None:
        """``commit`` for callers with no syscall to fail (release, rename, a type change,
        truncate by path, unmount, drain): a refusal stays on the node (``state=rejected``,
        ``user.memfuse.error``, ``errors.log``) and the next ``close`` of a writer reports
        it."""
        try:
            self.commit(n)
        except FsError:
            pass

    def _checked_prefix(self, prev_sha: str, data: bytes,
                        appended: tuple[str, bytes] | None = None) -> int:
        """How many leading bytes of ``data`` are a content that passed ``_precheck``
        already: the file's previous content (sha256 ``prev_sha``, from the blob cache) when
        ``data`` starts with it (an append: ``echo >> f``), else 0. Costs one read of that
        content (kept in memory, ``recent``, else from the blob cache) and a comparison,
        instead of a secret scan of all of it; nothing when the write buffer knows ``data``
        is ``appended`` (``AppendBuffer.appended_to``: (sha256, bytes) of what it extends)."""
        if not prev_sha or len(data) < APPEND_CHECK_MIN:
            return 0
        if appended is not None and appended[0] == prev_sha and appended[1]:
            return len(appended[1])  # data is appended[1] + what was written after it
        base = self.recent.get(prev_sha)
        if base is None:
            try:
                base = self.blobs.read(prev_sha)
            except CacheError:
                return 0
        if not base or not data.startswith(base):  # content-addressed: base is prev_sha's
            return 0
        return len(base)

    def _precheck(self, n: Node, data: bytes, path: str | None = None, checked: int = 0,
                  base_sha: str = "", sha: str = "", secret_free: bool = False) -> FsError | None:
        """Refusals the sidecar can decide alone, so they fail at close even offline:
        not UTF-8 or a NUL character (``EILSEQ``), a secret (``EPERM``), a bad frontmatter
        type (``EINVAL``) of file ``n`` holding ``data`` at ``path`` (default: its own).
        Sizes and names are checked at write / create already. ``checked``: the first bytes
        of ``data`` passed these checks already (``_checked_prefix``): UTF-8 and NUL are
        checked after them, the secret scan reads from ``APPEND_SCAN_CONTEXT`` bytes before
        them (a line start; as the control plane's append does), the type from the first
        ``writecheck.HEAD_BYTES`` (all a frontmatter can span: ``content.frontmatter``
        reads its first 64 Ki characters), not decoded at all when it opens no fence.
        ``base_sha`` / ``sha``: the sha256 of the content the first ``checked`` bytes are
        and of ``data``, for the append's secret scan (``secretscan.AppendScans``: the
        context is not scanned again when the scan of the append that made it is kept).
        ``secret_free``: the whole of ``data`` was scanned for secrets already (at its
        write, ``WriteChecker.clean_len``) and held none: not scanned again."""
        start = 0
        if checked:
            start = max(0, checked - APPEND_SCAN_CONTEXT)
            start = data.rfind(b"\n", 0, start) + 1 if start else 0
        try:
            data[checked:].decode("utf-8")
        except UnicodeDecodeError as e:
            return FsError.of("invalid_content", f"content is not valid UTF-8 (byte {e.start + checked})")
        nul = data.find(b"\0", checked)
        if nul >= 0:
            return FsError.of("invalid_content", f"content contains a NUL character (at offset "
                                                 f"{nul}); records are text")
        if checked:  # an append: the whole is valid UTF-8 now; never decoded whole
            # checked is a character boundary: data[checked:] decoded above
            kind = self.scans.find_secret(data[start:checked].decode("utf-8"),
                                          data[checked:].decode("utf-8"), base_sha, sha)
            # the type comes from the frontmatter only, which opens with the first bytes
            # and lies within HEAD_BYTES (a character cut at its end is dropped: the
            # 64 Ki characters the frontmatter may take end before it)
            head = (data[:HEAD_BYTES].decode("utf-8", "ignore") if data.startswith(FENCES)
                    else "")
        else:
            head = data.decode("utf-8")
            kind = None if secret_free else content_rules.find_secret(head)
        if kind:
            return FsError.of("secret_detected", f"content looks like it holds a secret ({kind}); "
                                                 "memory must not store credentials")
        try:
            t = content_rules.record_type(path or n.path(), head, n.type_override, "project")
            if t is not None:
                content_rules.check_type(t)
        except ValueError as e:
            return FsError.of("invalid_type", str(e) or "invalid record type")
        return None

    def judge_rename(self, n: Node, new_path: str) -> None:
        """A rename(2) that would make file ``n``'s content refusable fails with the
        refusal's errno (and an ``errors.log`` line), nothing renamed: a local-only file
        (never judged: ``f~``, a swap file) renamed onto a record's name, or a file whose
        type rule changes with its path (the root ``MEMORY.md`` has no type). Content
        refusable already at its old path is left to close, as before."""
        if n.store is None or self.is_local_only(new_path.rsplit("/", 1)[-1]):
            return
        if not n.local_only and content_rules.is_index(n.path()) == content_rules.is_index(new_path):
            return  # same rules at both paths: judged at its writes and close already
        data = self._content(n)
        refusal = self._precheck(n, data, new_path)
        if refusal is None or (not n.local_only and self._precheck(n, data) is not None):
            return
        self.refuse(n.parent, n.name, refusal.errno,
                    refusal.reason + "; the rename was not applied", refusal.code)

    async def flush(self, h: Handle) -> None:
        """close(2): commit a dirty file; wait until it is accepted (on disk in the outbox
        journal, at most ``journal.JOURNAL_WAIT`` s), then up to ``commit_wait`` s from the
        start of the close for the control plane (0: not at all),
        unless the outbox knows no commit can come soon (``Committer.failing``: its last
        attempt failed with a connection error, timeout, 5xx or 429 and none was answered
        since, or the control plane refuses the token the token file still gives): then
        return as soon as the write is accepted, or as soon as the outbox learns it while
        this close waits.

        Raises ``FsError`` ``EINTR`` when the process that opened ``h`` gets a stop signal
        while the close waits for the control plane (``interrupts``: the write stays
        queued), and with the refusal's errno when the control plane refused the content
        for good (the content stays here, ``state=rejected``). A transient failure is not an
        error: the write stays accepted and the outbox retries (docs/SEMANTICS.md, "Writes and close").
        A written local-only file is never sent: the close returns once its kept copy is on
        disk (``LocalFiles``), ``ENOSPC`` / ``EIO`` when the cache disk refuses it.
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
            # The same after the file was emptied for a rewrite, through this handle or
            # another, with nothing written through this one since (Filesystem.rewriting):
            # a child's close of an inherited descriptor mid-save commits no emptied file.
            return
        e = self.commit(n, hold=True)  # this close waits for it: its insert may be held
        if e is None:
            e = n.last_put if n.state == PENDING and not (n.local_only or n.unlinked) else None
            if e is None:
                return
        # the local journal has its own bound (JOURNAL_WAIT): a close never fails for a
        # write the journal accepts, whatever --commit-wait is; --commit-wait bounds only the
        # wait for the control plane (0: do not wait for it), counted from the close
        deadline = trio.current_time() + self.settings.commit_wait
        if isinstance(e, Entry):
            try:
                await e.wait_accepted(JOURNAL_WAIT)
            except CacheError as err:
                await self._journal_refused(n, e, err, deadline)
                return
        else:  # a local-only file's kept copy: ENOSPC / EIO when the disk refuses it
            await self._wait_accepted(n, e, JOURNAL_WAIT)
        c = self.committer
        if not e.done.is_set() and not c.failing:  # (committed already: no scope to enter)
            # a stop signal to the process that opened h ends the wait (interrupts.py)
            with trio.move_on_at(deadline) as scope, self.interrupts.watch(h.fh, scope) as w:
                # e.changed is set when e finishes and, for every queued entry, when the
                # outbox starts failing (Committer._attempt_failed)
                while not e.done.is_set() and not c.failing:
                    await e.changed.wait()
            if w.interrupted:
                raise FsError(errno.EINTR, "interrupted by a signal; the write stays queued")
        if e.done.is_set() and e.errno:
            raise FsError(e.errno, e.reason)

    async def fsync(self, h: Handle) -> None:
        """fsync(2): commit and wait for the control plane's acknowledgement; ``EIO`` after
        ``fsync_timeout`` s, ``EINTR`` once the process that opened ``h`` has a stop signal
        to take (``interrupts``; the write stays accepted either way)."""
        n = h.node
        e = self._fsync_commit(n, h, hold=True)
        if e is None:
            return
        deadline = trio.current_time() + self.settings.fsync_timeout
        await self._wait_accepted(n, e, self.settings.fsync_timeout)
        with trio.move_on_at(deadline) as scope, self.interrupts.watch(h.fh, scope) as w:
            await e.done.wait()  # (or a stop signal to the process that opened h)
        if w.interrupted:
            raise FsError(errno.EINTR, "interrupted by a signal; the write stays queued")
        if not e.done.is_set():
            raise FsError(errno.EIO, "control plane did not acknowledge within fsync timeout")
        if e.errno:
            raise FsError(e.errno, e.reason)

    def _fsync_commit(self, n: Node, h: Handle | None = None, *,
                      hold: bool = False) -> Entry | Barrier | None:
        """What an fsync of file ``n`` (through handle ``h``) makes durable, and waits for:
        its content as it holds it now, committed (``commit``: raises its refusals), else
        the put of it still pending, else (a local-only file) a ``Barrier`` behind its kept
        copy; None when there is nothing to wait for. A handle with no write of its own while
        another rewrites the file commits nothing (the rewrite's close commits it). The one
        rule of a file's fsync and of a directory's for the files only it holds
        (``fsyncdir``)."""
        e = None if h is not None and self.rewritten_by_another(n, h) else self.commit(n, hold=hold)
        e = e or (n.last_put if n.state == PENDING and not (n.local_only or n.unlinked) else None)
        if e is None and n.local_only and not n.unlinked:
            e = self.journal.barrier()  # its kept copy may still be queued
        return e

    def _names_only_here(self, d: Node) -> list[Node]:
        """The files of directory ``d`` (its own entries, not its subdirectories') whose name
        only this process's memory holds: no outbox entry, record or kept row names them
        there. The one rule, by what keeps a file's name across a restart:

        - only a file being written (``dirty``): one that is not is named by its record,
          put or kept row, or (created by a write its close withdrew, ``_withdraw``: empty,
          never sent) by memory alone, as a close that failed leaves it (review27 R1:
          committing it sent an empty create that replaced another writer's record);
        - a record's file: its record or a put. Not one with neither: created and not closed
          yet, or renamed while still open (a create is queued at close); nor one renamed
          over a record while still open (the target's name shows content only memory
          holds, its put waits for the close: ``Node.renamed_over``);
        - a rejected file (``RejectedFiles``): its record or put when it has one (and their
          queued moves: review27 R2, committing it sent another handle's emptied rewrite),
          else its kept row; a local-only file (``LocalFiles``): its kept row. Not one whose
          row does not name it here (never kept, or renamed while being rewritten: the row
          keeps what was kept last until the file is judged or closed again). Before
          fsync27, a new rejected file renamed while being rewritten was left out: its row
          named the old path and a kill -9 put it back there.

        A file committed once is named by its put, record and moves already; its later
        writes are content, which a directory's fsync does not promise."""
        out: list[Node] = []
        if d.store is None or d.store.detached:  # the mount root, .memfuse; an unmounted store
            return out
        for c in (d.children or {}).values():
            if not c.dirty or c.children is not None or c.special or c.unlinked:
                # (not being written: a kept row is written as it changes, sync_local /
                # sync_rejected; a file a withdrawn write created keeps its name in memory
                # alone, never sent: review27 R1)
                continue
            if c.local_only:
                # (a row loaded at start is (store, "kept"): its path is not known here)
                saved = self._local_saved.get(c.key)
                if saved is None or len(saved) < 5 or saved[1] != c.path():
                    out.append(c)
            elif c.state == REJECTED:
                if c.record_id is not None or c.last_put is not None:
                    continue  # named by its record or put, and their queued moves (review27 R2)
                row = self._rejected_rows.get(c.key)
                if row is None or row["path"] != c.path():
                    out.append(c)
            elif c.renamed_over or (c.record_id is None and c.last_put is None):
                out.append(c)
        return out

    async def fsyncdir(self, h: Handle) -> None:
        """fsync(2) of a directory (POSIX: its entries durable; the idiom of a durable rename:
        write, close, rename, fsync the directory): return once every change queued so far
        (this directory's create, rename, unlink, mkdir and rmdir among them) is accepted, on
        disk in the outbox journal (a ``Barrier``), or committed; a crash or a power cut then
        loses none of them (docs/SEMANTICS.md, "Namespace changes"). Its files whose name
        only memory holds (``_names_only_here``: being written, created or renamed while
        open, with no record, put or kept row naming them there) are committed first as
        their own fsync would (``_fsync_commit``, with no handle: what they hold now; their
        close commits the rest), so their names are in that journal too; a refused one is
        kept rejected with its name (never sent) and judged again at its close, which
        reports it. One whose content is missing from the blob cache (``ContentMissing``)
        is not kept: ``EIO`` once the rest is done, with an ``errors.log`` line. A file not
        being written is never committed here (a file a withdrawn write created keeps its
        name in memory alone: nothing sent). The directory list (empty directories made by
        mkdir, their modes) is made durable too (``write_dirs_durably``) when it changed
        since.
        It does not wait for the control plane, as a file's fsync does for its content: the
        journal holds the names. Raises ``FsError`` with the cache disk's errno when it
        refuses the write (``ENOSPC``, ``EIO``), ``EIO`` after ``fsync_timeout`` s.
        (powercut25: it returned 0 at once, and a rename and an unlink it had answered for
        came back after a power cut, and after a kill -9; attack26: a file renamed while
        open, and an empty directory, were lost.)"""
        d = h.node
        deadline = trio.current_time() + self.settings.fsync_timeout
        missing: list[Node] = []
        for n in self._names_only_here(d):
            try:
                self._fsync_commit(n)
            except ContentMissing:
                # (a ContentMissing is an FsError too, but nothing kept the name: review27 R5)
                missing.append(n)
            except FsError:
                # refused (kept rejected, with its name: RejectedFiles): its writer's close
                # judges it again and reports the refusal, as it would have
                n.dirty = True
        barrier = self.journal.barrier()
        change = self.dirs_unsynced()
        if change:
            await self._sync_dirs(d, change, deadline)
        await self._wait_accepted(d, barrier, max(0.0, deadline - trio.current_time()))
        if missing:
            reason = "a directory's fsync could not keep a file's name: its content is missing from the blob cache"
            for n in missing:
                log.warning(reason, extra={"store": n.store.slug if n.store else "", "path": n.path()})
                self._note_at(n, errno.EIO, reason, "cache_disk_error")
            raise FsError(errno.EIO, reason)

    async def _sync_dirs(self, d: Node, change: int, deadline: float) -> None:
        """Until the durable copy of the directory list holds change ``change``
        (``write_dirs_durably`` in a worker thread, one at a time: an earlier fsync's still
        running is waited for, and may have written it), at most until ``deadline``
        (``trio.current_time()``). Raises ``FsError`` with the cache disk's errno when it
        refuses the write (and an ``errors.log`` line), ``EIO`` when it is not done in time
        (the write goes on in its thread)."""
        with trio.move_on_at(deadline):
            while not self.dirs_synced(change):
                if self.dirs_writing:
                    await trio.sleep(DIRS_WRITING_POLL)
                    continue
                text, latest = self.dirs_to_sync()
                # exactly one side ends the write (``dirs_writing``): the thread once it
                # claims the job (``write_dirs_durably`` clears it when done), or this task
                # when it is cancelled first; trio may still run a thread it started after
                # the task was cancelled (``abandon_on_cancel``), which then drops the job
                claim = threading.Lock()
                claimed = dropped = False

                def write() -> None:
                    nonlocal claimed
                    with claim:
                        if dropped:
                            return
                        claimed = True
                    self.write_dirs_durably(text, latest)
                try:
                    await trio.to_thread.run_sync(write, abandon_on_cancel=True)
                except OSError as exc:
                    err = self.dirs_error(exc)
                    self._note_at(d, err.errno, err.reason, "cache_disk_full" if err.errno == errno.ENOSPC
                                  else "cache_disk_error")
                    raise FsError(err.errno, err.reason) from None
                finally:
                    with claim:
                        if not claimed:  # no thread took it: none will (review26 F5)
                            dropped = True
                            self.dirs_writing = False
            return
        reason = "the directory list was not on disk within the fsync timeout"
        self._note_at(d, errno.EIO, reason, "cache_disk_error")
        raise FsError(errno.EIO, reason)

    async def _journal_refused(self, n: Node, e: Entry, err: CacheError, deadline: float) -> None:
        """The close of a write the outbox journal could not take (``err``: the cache disk
        is full, ``ENOSPC``, or fails, ``EIO``): the one rule of docs/SEMANTICS.md ("The
        sidecar's own disk"). Wait until ``deadline`` (``trio.current_time()``: the close's
        ``--commit-wait``) for the control plane's answer, or for the journal to take it
        after all (space came back); when the outbox knows the control plane is down, only
        until one attempt made during this wait failed (it is tried at once: ``poke``).
        Committed: return (its refusal's errno raised as any close's); accepted: return.
        Else the write is withdrawn (``_withdraw``) and ``FsError(err.errno)`` raised, unless
        a request carrying it may have reached the control plane (``Entry.sent``: its
        outcome is then learnt only from the answer to its idempotency key): that write is
        kept and retried, and the close returns 0, for a failed close must mean the write
        did not happen. A request in flight is waited for first, at most ``WITHDRAW_WAIT`` s."""
        c = self.committer
        tried = c.failed_attempts
        c.poke(urgent=True)
        with c.watch(e), trio.move_on_at(deadline):
            while not (e.done.is_set() or e.durable.is_set()):
                if c.failing and c.failed_attempts > tried and not e.in_flight:
                    break  # the control plane was tried during this close: no answer
                await e.changed.wait()
        with trio.move_on_after(WITHDRAW_WAIT):
            while e.in_flight and not e.done.is_set():
                await e.changed.wait()
        if e.done.is_set() or e.durable.is_set():
            if e.done.is_set() and e.errno:
                raise FsError(e.errno, e.reason)
            return
        code = "cache_disk_full" if err.errno == errno.ENOSPC else "cache_disk_error"
        where = n.parent if n.store is not None else None
        extra = {"store": e.store, "path": n.path(), "errno": errno.errorcode.get(err.errno)}
        if (n.last_put is e and isinstance(e.before, Before) and not e.sent
                and await self.journal.withdraw(e, WITHDRAW_WAIT)):
            if c.withdraw(e, err.errno, err.reason, code):
                self._withdraw(n, e)
                log.warning("write withdrawn: the cache disk refused it and the control plane "
                            "did not answer within the close's wait; the close fails",
                            extra={**extra, "reason": err.reason})
                self.note_error(where, n.name, err.errno, err.reason + "; the write was "
                                "withdrawn (not kept, never sent): the file shows what it "
                                "showed before it; write it again", code)
                raise FsError(err.errno, err.reason)
            # taken out of the journal's queue but not the committer's (sent meanwhile):
            # queued again, as it was (its journal row is retried with the others)
            self.journal.add(e)
        elif e.done.is_set() or e.durable.is_set():  # answered, or written, meanwhile
            if e.done.is_set() and e.errno:
                raise FsError(e.errno, e.reason)
            return
        # a request carrying it may have reached the control plane, or a later write of the
        # file holds it: kept in memory, retried, and the close does not say it failed
        if n.last_put is e:
            n.error = err.reason
        log.warning("the cache disk refused a write that may have reached the control plane "
                    "(or that a later write of the file holds); kept in memory and retried "
                    "under its idempotency key; the close returns 0",
                    extra={**extra, "reason": err.reason})
        self.note_error(where, n.name, err.errno, err.reason + "; the write may have reached "
                        "the control plane (or a later write holds it): it is kept in memory "
                        "and retried until answered", code)

    def _withdraw(self, n: Node, e: Entry) -> None:
        """Undo on the tree the put ``e`` of ``n`` its close withdrew (``_journal_refused``):
        the file shows what it showed before (``Entry.before``, a ``Before``): its previous
        content and state (a file the write created: empty, never written, not sent),
        ``user.memfuse.error`` saying why. That content comes from the put itself (an
        append), the copy kept when only memory held it (``Node.prior``), the put before it,
        or the blob cache (``_prior_content``); when none holds it and the file was clean, it
        is the version the control plane holds, fetched again when read or written
        (``ContentMissing``: ``EIO`` while the control plane is unreachable). Else (never
        seen so far: a damaged blob cache) the file keeps the withdrawn content marked
        ``state=rejected``, never sent (``Node.lost_prior``: a later write that does not
        replace it whole is refused at close)."""
        b = e.before
        assert isinstance(b, Before) and e.content is not None  # a put made by commit
        old = self._prior_content(e, b)
        reason = e.reason + "; the write was withdrawn"
        state, put = b.state, b.put
        if isinstance(put, Entry) and put.done.is_set():  # (or a put before it finished)
            state = REJECTED if put.errno else CLEAN
        size = n.cur_size()
        if old is not None:
            self._hold_content(n, old, b.sha, "the file's content before a withdrawn write")
        elif state == CLEAN and n.record_id and n.store is not None:
            # the control plane holds it: shown again, its bytes fetched when needed
            n.buf, n.sha, n.size = None, b.sha, b.size
            log.warning("the content before a withdrawn write is not held here; the file "
                        "shows the version the control plane holds, fetched when read",
                        extra={"store": n.store.slug, "path": n.path()})
        else:
            n.state, n.error, n.last_put, n.lost_prior = REJECTED, reason, None, True
            self._mark_rejected(n, e.errno, e.code)
            self.sync_rejected()
            return
        self._account(n, n.cur_size() - size)
        n.state, n.last_put, n.error = state, put, reason
        if state == REJECTED:
            self._mark_rejected(n, e.errno, e.code)
            self.sync_rejected()
        self.controls.changed()
        if n._x is not None:
            # the kernel holds the withdrawn write (its size), not an older content a
            # reader could be served whole while it is told (Filesystem._read_shown)
            n._x.pop("shown", None)
        self.invalidate([("inode", n.ino)])

    def _prior_content(self, e: Entry, b: Before) -> bytes | None:
        """The content a withdrawn put ``e`` replaced (``b``: its ``Before``), or None when
        nothing here holds it: the put's own first bytes (an append), the copy kept while
        only memory held it, the previous put's content (queued: not in the blob cache
        when the disk refused it), else the blob cache."""
        if not b.sha:
            return b""
        if b.prefix >= 0:
            assert e.content is not None
            return e.content[:b.prefix]
        if b.held is not None:
            return b.held
        put = b.put
        if isinstance(put, Entry) and put.content is not None and put.content_sha() == b.sha:
            return put.content
        return self._cached_blob(b.sha)

    def _refuse_lost_prior(self, n: Node) -> NoReturn:
        """``commit`` of a file that keeps a withdrawn write (``Node.lost_prior``) in a
        session that did not replace its content whole: refused (``EIO``), nothing sent, the
        file rejected; writing it whole (``> f``) or deleting it is what is left."""
        reason = ("the file holds a write that was withdrawn (the cache disk refused it) and "
                  "its content before that write is lost; it is not sent: write it whole again")
        n.state, n.last_put, n.error = REJECTED, None, reason
        self._mark_rejected(n, errno.EIO, "cache_disk_error")
        self.sync_rejected()
        self.note_error(n.parent, n.name, errno.EIO, reason, "cache_disk_error")
        raise FsError(errno.EIO, reason)

    async def changes_durable(self, op: str) -> None:
        """The end of a system call that changed the tree without awaiting (unlink, rename,
        rmdir, setattr, setxattr: ``fuse_ops._guard_durable``) and queued a write the
        outbox journal is to keep (an entry, a kept row of a rejected or local-only file):
        wait until everything queued so far is on disk (a ``Barrier``), at most
        ``CHANGE_WAIT`` s (and ``fsync_timeout``), so that a change whose call returned 0
        survives a ``kill -9`` of the sidecar (docs/SEMANTICS.md, "Namespace changes").
        Never raises: the change is applied and queued whatever happens here; when the
        journal refuses the write (the cache disk is full or failing) or does not write it
        within the bound, the call still returns 0 and a log line says so (once per streak
        of such calls). A journal failing already is not waited for."""
        j = self.journal
        if j.error is None:
            b = j.barrier(light=True)
            try:
                await b.wait_accepted(min(CHANGE_WAIT, self.settings.fsync_timeout))
                self._changes_unsettled = 0
                return
            except CacheError as exc:
                err: CacheError = exc
        else:
            err = j.error
        self._changes_unsettled += 1
        if self._changes_unsettled == 1:
            log.warning("a namespace or attribute change returned before the outbox journal "
                        "had it on disk; it is applied and queued (a kill -9 now may lose it)",
                        extra={"op": op, "errno": errno.errorcode.get(err.errno),
                               "reason": err.reason})

    async def _wait_accepted(self, n: Node, e: Entry | Barrier, timeout: float) -> None:
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
            self._note_at(n, err.errno, err.reason + "; the write is kept in memory and retried",
                          "cache_disk_full" if err.errno == errno.ENOSPC else "cache_disk_error")
            raise FsError(err.errno, err.reason) from None

    def _note_at(self, n: Node, err: int, reason: str, code: str) -> None:
        """``note_error`` of a refusal met by an operation on ``n`` itself: a file at its
        path, a directory (a directory's fsync) as itself, ``.`` for a store's root (the
        mount root's entry named it with no store: attack26 F8)."""
        if n.is_dir and n.store is not None:
            self.note_error(None, n.path() or ".", err, reason, code, store=n.store.slug)
        else:
            self.note_error(n.parent if n.store is not None else None, n.name, err, reason, code)

    def reading(self, ino: int) -> bool:
        """True while a handle open for reading (not a directory's) holds file ``ino``: the
        kernel invalidation of a change of it waits for its release (``Invalidator``), so
        no reader's reads straddle the change. Walks the open handles (only when a change
        of an open file is about to reach the kernel). Never blocks."""
        n = self.inodes.get(ino)
        if n is None or n.opened <= 0:
            return False
        return any(h.node is n and not h.is_dir and h.flags & os.O_ACCMODE != os.O_WRONLY
                   for h in self.handles.values())

    def readers_outlasted(self, ino: int) -> list[tuple[Any, ...]] | None:
        """The invalidation of a change of file ``ino`` waited ``READER_LINGER`` s for the
        handles open for reading on it (``reading``) and some are still open
        (``Invalidator``). Made now, it would give the kernel the current content's size
        and drop its pages: a reader's next read(2) would get the current content's bytes
        after the older ones, or, at or past the current (shorter) size, an EOF the kernel
        answers itself (attack 17 F1: ``sed -i`` committed the older version cut at 16384
        bytes, a version no one wrote).

        When only readers hold the file (every handle ``O_RDONLY``), its content is clean, the
        older content the kernel shows is cached (``Node.shown``) and the current one does
        not extend it (an append reaches the readers of that inode, as on a local disk:
        ``tail -f``): the readers keep it
        (docs/SEMANTICS.md "Conflicts", local-disk semantics). The file (record, key, state,
        ``read_base``) moves to a new inode; the old inode stays, ``unlinked`` and ``kept``,
        with the older content and size, serving its handles until they close and the
        kernel forgets it. Returns the invalidations to make instead: the name's entry, so
        that the next open looks it up and gets the new inode; the old inode is not
        invalidated (its pages and size are its content's).

        Otherwise (a handle open for writing, ``O_RDWR`` included, keeps today's rules; the
        older content not cached) returns None and the invalidation is made: each reader
        open that may now be cut by the kernel at the shorter size, or hold parts of two,
        makes the overwrite base unknown (``Node.read_base`` ``UNKNOWN_BASE``: last writer
        wins with the straddle conflict line). Never blocks."""
        n = self.inodes.get(ino)
        if n is None or n.children is not None or n.opened <= 0:
            return None
        mine = [h for h in self.handles.values() if h.node is n]
        kept = self._keep_for_readers(n, mine)
        if kept is not None:
            return kept
        self._readers_may_straddle(n, mine)
        return None

    def _keep_for_readers(self, n: Node, mine: list[Handle]) -> list[tuple[Any, ...]] | None:
        """``readers_outlasted``'s split of file ``n`` (handles ``mine``): the old inode kept
        for them, the file on a new one. Returns the entry invalidation, or None when it
        does not apply."""
        x, sm, parent = n._x, n.store, n.parent
        if (x is None or n.unlinked or n.dirty or n.buf is not None or sm is None or sm.detached
                or parent is None or n.local_only):
            return None
        shown = x.get("shown")
        if not shown or shown == n.sha:
            return None
        if any(h.is_dir or h.snapshot is not None or h.flags & os.O_ACCMODE != os.O_RDONLY
               or h.across == "mixed" for h in mine):
            return None
        older = self._cached_blob(shown)
        if older is None:
            return None
        if n.size > len(older):
            cur = self._cached_blob(n.sha)
            if cur is not None and cur.startswith(older):
                # an append: the readers get the appended bytes on that inode, as on a
                # local disk (``tail -f``; ``_read_across`` serves it)
                return None
        ino = n.ino
        ghost = Node(ino, n.name, parent, False, sm, n.mode, n.uid, n.gid, n.atime_ns,
                     n.mtime_ns, n.ctime_ns)
        ghost.sha, ghost.size = shown, len(older)
        ghost.unlinked = True
        ghost.kept = True
        ghost.nlookup, n.nlookup = n.nlookup, 0
        ghost.opened, n.opened = n.opened, 0
        for h in mine:
            h.node, h.replaced, h.across = ghost, "", ""
        n.ino = self._next_ino
        self._next_ino += 1
        self.inodes[n.ino] = n
        self.inodes[ino] = ghost
        x.pop("shown", None)  # the kernel holds nothing of the new inode
        x.setdefault("kept_open", []).append(ghost)
        log.info("readers open past the linger keep the older content of a file replaced "
                 "elsewhere; the path has a new inode",
                 extra={"store": sm.slug, "path": n.path(), "old_ino": ino, "ino": n.ino,
                        "readers": len(mine)})
        return [("entry", parent.ino, n.name)]

    def _readers_may_straddle(self, n: Node, mine: list[Handle]) -> None:
        """The invalidation of file ``n`` is made while handles ``mine`` hold it open for
        reading (``readers_outlasted``). A reader whose handle was open when its content
        was replaced (``Handle.replaced``) and not checked since (``Handle.across``) may be
        anywhere in that older content: when the current content is shorter than it, the
        kernel answers a read at or past the current size with EOF without asking here, so
        the reader may hold the older content cut there (no version); a read below it comes
        here and is checked (``_read_across``). Such a handle holds parts of two versions
        (``"mixed"``) and the overwrite base is unknown (last writer wins with the straddle
        conflict line; a reader that had read the older content whole is counted too: what
        it holds cannot be told apart here)."""
        cur_size = n.cur_size()
        for h in mine:
            if (h.is_dir or h.snapshot is not None or h.flags & os.O_ACCMODE == os.O_WRONLY
                    or not h.replaced or h.across):
                continue
            old = self._cached_blob(h.replaced)
            if old is not None and cur_size >= len(old):
                continue  # every read below the current size comes here (pages dropped)
            h.across = "mixed"
            if n.read_base != UNKNOWN_BASE:
                n.read_base = UNKNOWN_BASE
                log.info("a reader was served parts of two contents of a file (it was open "
                         "past the linger when the kernel was told a shorter content: its "
                         "reads may be cut there); its overwrite is last writer wins with a "
                         "conflict line",
                         extra={"store": n.store.slug if n.store else None, "path": n.path()})

    def release(self, fh: int) -> None:
        """The last close of handle ``fh`` (unknown handles are ignored): a file still dirty
        (flush not called, or failed) is committed (``commit_quietly``), never dropped."""
        h = self.handles.pop(fh, None)
        if h is None:
            return
        n = h.node
        n.opened -= 1
        if n._x is not None and fh in n.rewriters:  # (else no side table: Node._x)
            n.rewriters = tuple(r for r in n.rewriters if r != fh)
        # flush was not called (or failed): never drop the write; but a handle with no
        # write of its own while another rewrites the file commits nothing (a reader's or
        # an earlier writer's release arrives late, after the next save emptied the file:
        # Node.rewriters); the rewrite's close, or its release, commits it
        if n.dirty and not self.rewritten_by_another(n, h):
            self.commit_quietly(n)
        if self.listener is not None and not h.is_dir and h.flags & os.O_ACCMODE != os.O_WRONLY:
            self.listener.reader_closed(n.ino)  # a change of it may wait for its readers
        if n._x is not None:  # else neither special nor unlinked (Node: _x)
            if n.special:
                self.controls.closed(n.special)
            self._drop_if_unused(n)

    # ------------------------------------------------------------------ CommitListener
    def entry_conflicted(self, e: Entry, what: str) -> None:
        """``CommitListener``: a write resolved last-writer-wins: a line in errors.log, then
        the sidecar is told."""
        self.controls.note_conflict(e.store, e.args.get("path", ""), what)
        if self.listener is not None:
            self.listener.entry_conflicted(e, what)

    def entry_finished(self, e: Entry) -> None:
        """``CommitListener``: apply a finished entry's result to the tree (``_on_commit``),
        then tell the sidecar (the store's mirror follows the tree)."""
        try:
            self._on_commit(e)
        finally:
            if self.listener is not None:
                self.listener.entry_finished(e)

    def _on_commit(self, e: Entry) -> None:
        self.controls.changed()  # the outbox and the store's counts in status.json
        if e.op == MOVE_PREFIX or e.node_key is None:
            if e.errno:
                self.note_error(None, e.args.get("from", ""), e.errno, e.reason, e.code, e.store)
                return
            if e.unshown:
                self._show_unshown_move(e)
            if e.op == MOVE_PREFIX:
                self._reconcile_moved(e)
            return
        n = self.node_by_key(e.node_key)
        if e.op == PUT:
            if e.errno and n is None and not e.withdrawn:
                self._refused_unshown(e)
                return
            if e.errno:
                self.note_error(n.parent if n else None, n.name if n else e.args.get("path", ""),
                                e.errno, e.reason, e.code, e.store)
            if n is None:
                return
            if n.last_put is not e:
                # an earlier put of a file rewritten meanwhile (``: > f`` then a refused
                # ``truncate -s 10 f`` before the create committed): the record exists now,
                # so the node learns its id, which a rejected file kept across a restart
                # needs to find its record again; its state is the later write's
                if not e.errno and e.record is not None and n.record_id is None:
                    self._bind_rid(n, e.record.id)
                    n.version = e.record.version
                    self.sync_rejected()
                return
            if e.errno and e.code == STORE_REPLACED and n.buf is None:
                self._drop_replaced(n)
            elif e.errno:
                n.state, n.error = REJECTED, e.reason
                self._mark_rejected(n, e.errno, e.code)
                self.sync_rejected()
            elif e.record is not None:
                self._bind_rid(n, e.record.id)
                if e.record.version < n.version and self._show_newest(n, e):
                    return
                n.version, n.rtype = e.record.version, e.record.type
                if n.type_override == e.args.get("type"):
                    n.type_override = None
                n.updated_ns = datetime_ns(e.record.updated_at)
                n.state, n.error = CLEAN, ""
                if e.merged is not None:
                    self._show_merged(n, e)
                self._reconcile_answer(n, e.record)
        elif e.op == ATTRS:
            if e.errno:
                self.note_error(n.parent if n else None, n.name if n else e.args.get("path", ""),
                                e.errno, e.reason, e.code, e.store)
            elif n is not None and e.record is not None and n.record_id == e.record.id:
                if e.record.sha256 == n.sha and n.buf is None:
                    n.version = max(n.version, e.record.version)
                    n.updated_ns = datetime_ns(e.record.updated_at)
                else:  # content changed elsewhere meanwhile: the feed brings it, ours stay
                    n.attrs_version = max(n.attrs_version, e.record.version)
        elif e.op == MOVE and n is not None and e.record is not None:
            self._bind_rid(n, e.record.id)
            n.version = max(n.version, e.record.version)  # a replayed move: answered as of then
            if (n.sha and n.sha != e.record.sha256 and e.record.version == n.version
                    and (n.last_put is None or n.last_put.done.is_set())):
                # the content changed elsewhere before the move: the file shows (and a write
                # of it derives from) its older content, so that stays the base of its next
                # put, which is then merged onto the newer one (attack finding 4a), until the
                # newer content is shown (``_reconcile_answer``, ``apply_remote``)
                self.ids.note(n.key, e.record.id, n.sha)
            self._reconcile_answer(n, e.record)
            if n.xmtime is None and not n.dirty:
                n.xmtime = e.record.mtime_ns  # the control plane keeps the mtime across a move
        elif e.op in (DELETE, MOVE) and e.errno:
            self.note_error(None, e.args.get("path", ""), e.errno, e.reason, e.code, e.store)

    def _drop_replaced(self, n: Node) -> None:
        """The last write of file ``n`` was refused because it was made in a store deleted
        since, whose slug another store has now (``STORE_REPLACED``: replayed from the
        journal at a start, e.g. a cache directory another workspace of that name used, in
        another account: attack 16 F9). Its content belongs to the deleted store: the file
        leaves this store's tree (the kernel's entry invalidated) instead of staying as a
        rejected file that would show it in the new store; the refusal is in ``errors.log``
        already (path, code). A record of the new store waiting for the path is shown again
        (``shadow_freed``). Never blocks."""
        if n.parent is None:
            return
        self.shadow_freed(n)
        self.invalidate(self._remove_file(n))
        self.controls.changed()

    def _refused_unshown(self, e: Entry) -> None:
        """A put refused for good whose file the tree does not show because its path is a
        directory here (made elsewhere: a queued write shown over a tree that could not
        hold it at start, attack 13): its content is kept as a rejected file beside its
        path (``keep_aside``), never dropped; so is one whose path crosses a file (a record
        made elsewhere at ``notes/x`` while the write of ``notes/x/y`` was queued:
        ``parent_is_file``). Otherwise (the file deleted here since, a path free or holding
        another file: replaced here by a later move, a put without its content: an append
        sent as a suffix) the ``errors.log`` line only, as before."""
        path = e.args.get("path", "")
        sm = self.stores.get(e.store)
        data = e.content  # (a sent put holds it: ``Committer`` reads a deferred one first)
        why = self._unshown_why(sm, path) if sm is not None else None
        deleted = any(q.node_key == e.node_key and q.op == DELETE
                      for q in self.committer.queues.get(e.store, ()))
        if sm is None or data is None or why is None or deleted:
            self.note_error(None, path, e.errno, e.reason, e.code, e.store)
            return
        self.keep_aside(sm, path, data, e.errno, e.code, e.reason, why,
                        mode=e.args.get("mode"), type_=e.args.get("type"))

    @staticmethod
    def _unshown_why(sm: StoreMount, path: str) -> str | None:
        """Why the tree of ``sm`` cannot show a file at store-relative ``path``: ``"a
        directory"`` (one is at the path), ``"crossed by a file"`` (a file is at one of its
        directories), None when it could (the path is free or holds a file)."""
        d: Node | None = sm.root
        for comp in path.split("/") if path else ():
            if d is None:
                return None
            if d.children is None:
                return "crossed by a file"
            d = d.children.get(comp)
        return "a directory" if d is not None and d.is_dir else None

    def _reconcile_moved(self, e: Entry) -> None:
        """A directory move of ours (``move_prefix``) was answered with every record it
        moved (``e.moved``), as the control plane held them: each file here takes its
        record's version (as a single move's answer gives it, ``_on_commit``), and a record
        this tree does not show as the answer has it is fetched and applied
        (``FsListener.record_stale``): one made under the directory elsewhere before the
        move (the tree has no file of it), or a file whose content was changed elsewhere
        before the move (it shows the older content). The feed cannot bring either: it
        leaves our move out, and passes the other writer's versions made before it
        (``StoreState.own_newer``; attack 18 F11). A file here at another path than the
        answer's was moved (or unlinked) here since: its queued entry says so; one written
        here since has its put queued, sent on the content it showed, so a change made
        elsewhere meets it there (merged, or last writer wins), as after a single move."""
        sm = self.stores.get(e.store)
        if sm is None:
            return
        for rec in e.moved:
            n = self.by_rid.get(rec.id)
            if n is None or n.store is not sm:
                log.info("a directory move answer carries a record made elsewhere; fetching it",
                         extra={"store": e.store, "record": rec.id, "version": rec.version})
                if self.listener is not None:
                    self.listener.record_stale(e.store, rec.id)
                continue
            if n.unlinked:
                continue
            n.version = max(n.version, rec.version)
            if n.last_put is not None and not n.last_put.done.is_set():
                continue  # written here since: its put, on the older content, is merged
            if rec.version == n.version and not n.dirty and n.buf is None and n.sha != rec.sha256:
                log.info("a directory move answer carries a change made elsewhere; fetching "
                         "the record", extra={"store": e.store, "record": rec.id,
                                              "version": rec.version})
                if self.listener is not None:
                    self.listener.record_stale(e.store, rec.id)

    def _reconcile_answer(self, n: Node, rec: Record) -> None:
        """A commit of ``n`` was answered with ``rec``, the version ``n`` now claims: unless
        ``n`` shows it (its path and, when not written since, its sha256), the record is
        fetched and applied like a snapshot state (``FsListener.record_stale``: the newest
        version wins, by version number, whatever arrived first). The feed cannot bring it:
        it leaves this sidecar's own versions out, and skips the other writer's older one.
        Cases (attack finding 4): a put answered at the path another sidecar moved the
        record to (this file's name is dead in the store), a move answered with content
        another sidecar wrote before it (this file shows the older content)."""
        if rec.version != n.version or rec.deleted or n.store is None:
            return  # not the version n claims (an older answer, ``_show_newest``)
        moved = n.path() != rec.path
        if moved or (not n.dirty and n.buf is None and n.sha != rec.sha256):
            log.info("a commit answer carries a change made elsewhere; fetching the record",
                     extra={"store": n.store.slug, "record": rec.id, "version": rec.version,
                            "moved": moved})
            if self.listener is not None:
                self.listener.record_stale(n.store.slug, rec.id)

    def _show_newest(self, n: Node, e: Entry) -> bool:
        """``e`` (``n``'s last put, committed) was answered with an older version of the record
        than ``n`` knows: a replayed entry, left in the journal by a crash after it
        committed (its delete is lazy), answered by its idempotency key with the record as
        of that commit, while a later version (made after it, caught up at start) is the
        record's state. Unless ``n`` was written since (``dirty``: its put derives from the
        older content and is merged onto the newer version, ``ConflictResolver.put_base``),
        ``n`` shows the newest state the store's mirror holds, clean, so the file never
        goes back to an older version (the feed, past it, would not bring it again).
        Returns False when that state is not known here (no mirror, or its content is not
        in the blob cache): the caller then shows ``e``'s result."""
        assert e.record is not None  # a committed put
        if n.dirty or self.listener is None:
            return False
        m = self.listener.known_record(e.store, e.record.id)
        if m is None or m.version <= e.record.version:
            return False
        data = self._cached_blob(m.sha256)
        if data is None:
            log.warning("a replayed write was answered with an older version and the newest is "
                        "not cached; showing the older one until the next change",
                        extra={"store": e.store, "record": e.record.id,
                               "answered": e.record.version, "known": m.version})
            return False
        log.info("a replayed write was answered with an older version; showing the newest",
                 extra={"store": e.store, "record": e.record.id, "entry": e.id,
                        "answered": e.record.version, "known": m.version})
        old = n.cur_size()
        self.note_replaced(n, m.sha256)
        self._hold_content(n, data, m.sha256, "the newest version")
        self._set_clean(n, m)
        self._account(n, n.cur_size() - old)
        n.state, n.error = CLEAN, ""
        if n.type_override == e.args.get("type"):
            n.type_override = None
        self.ids.note(n.key, m.id, m.sha256)  # the base of the next update
        self.committer.forget_merge(n.key)
        self.invalidate([("inode", n.ino)])
        return True

    def _show_merged(self, n: Node, e: Entry) -> None:
        """``e`` (``n``'s last put) was rebased onto a concurrent change (an append merged,
        ``ConflictResolver.rebase``): show the merged content, so the file reads what the control
        plane holds (read-your-writes: it holds this sidecar's writes too). Not when ``n``
        was written since (``dirty``): a local write is never overwritten; its put derives
        from the content before the merge and is rebased onto the merge in turn
        (``ConflictResolver.put_base``)."""
        if n.dirty or e.merged is None or e.record is None:
            return
        old = n.cur_size()
        self.note_replaced(n, e.record.sha256)  # a reader may have read our write before
        self._hold_content(n, e.merged, e.record.sha256, "the merged content")  # the control plane has it
        self._account(n, n.cur_size() - old)
        n.mtime_ns = n.ctime_ns = n.updated_ns
        self.committer.forget_merge(n.key)
        self.invalidate([("inode", n.ino)])

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        """The filesystem's status document (``ControlFiles.status``)."""
        return self.controls.status()
