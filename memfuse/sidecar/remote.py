"""Applying the control plane's state to the tree: store loading, feed changes, snapshots.

``RemoteApply`` is the part of ``core.Filesystem`` that builds a store's tree from a snapshot
(``add_store``), applies one record state from the change feed (``apply_remote``), makes a
store match a full snapshot after ``410`` (``reconcile_store``) and takes a store out of the
mount (``remove_store``). Each returns the kernel invalidations to make
(``("entry", parent_ino, name)``, ``("inode", ino)``); the caller hands them to
``invalidator.Invalidator``, which performs them off the trio thread.

Ordering (docs/ARCHITECTURE.md, "Threads and ordering"): remote changes are applied only while
the store's outbox is empty (``Committer.wait_store_idle``), so every local change is
committed first; a file with unflushed writes is never overwritten. Nothing here awaits.
"""
from __future__ import annotations

import errno
import logging
import os
import stat
import time

import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ..defs import DEFAULT_MODE, RECORD_TYPES, datetime_ns
from ..wire import Record
from .inodes import (CLEAN, DIR_MODES_KEY, DIRS_MADE_ONLY_KEY, REJECTED, STORE_CREATED_KEY, Handle, Node, StoreMount,
                     shared_mode)
from .journal import MOVE_PREFIX, Entry
from .sync import Meta

if TYPE_CHECKING:
    from .blobcache import BlobCache
    from .control import ControlFiles
    from .identity import RecordIds
    from .listeners import FsListener
    from .inodes import Settings

log = logging.getLogger("memfuse.fs")


_TYPES: dict[str | None, str | None] = {t: sys.intern(t) for t in RECORD_TYPES}


def _intern_type(t: str | None) -> str | None:
    """One shared ``str`` per record type (a snapshot decodes a new one per record)."""
    return _TYPES.get(t, t) if t is not None else None


def _digest(rec: Record | Meta) -> bytes:
    """The sha256 of a ``Record`` or a mirror ``Meta`` as 32 bytes (a ``Meta``'s own)."""
    sha = getattr(rec, "sha", None)
    return sha if type(sha) is bytes else bytes.fromhex(rec.sha256)


def updated_ns(rec: Record | Meta) -> int:
    """The update time of a ``Record`` (``updated_at``) or a mirror ``Meta``
    (``updated_ns``), in ns since the epoch."""
    if isinstance(rec, Meta):
        return rec.updated_ns
    return datetime_ns(rec.updated_at)


class RemoteApply:
    """Loading and remote changes of ``core.Filesystem`` (module docstring); mixed into it.

    Every method here is synchronous: a page of changes, a snapshot or a store is applied
    with no ``await`` in between (the invariants of ``inodes.InodeTable`` hold after each).
    """

    # what this part uses of the filesystem (declared here, S3QL style; created by
    # ``Filesystem.__init__``): the tables (``inodes.InodeTable``), the blob cache, the
    # record identity shared with the committer, the settings and the saved directory list
    inodes: dict[int, Node]
    by_key: dict[str, Node]
    by_rid: dict[str, Node]
    handles: dict[int, Handle]
    stores: dict[str, StoreMount]
    root: Node
    blobs: BlobCache
    ids: RecordIds
    settings: Settings
    saved_dirs: dict[str, Any]
    listener: FsListener | None
    _next_ino: int
    _rejected: dict[Node, tuple[int, str]]  # rejected.RejectedFiles: node -> (errno, code)
    _rejected_remote: dict[Node, set[tuple[int, str]]]  # rejected.RejectedFiles: changes noted
    controls: ControlFiles
    #: directories went (``_prune_implied``) since the directory list was last saved
    #: (``save_pruned_dirs``)
    dirs_pruned: bool = False
    #: slug -> record id -> (the newest state of that record from the feed or a snapshot,
    #: as a ``Meta``; the path of the local entry in its way): records made or moved
    #: elsewhere that this mount does not show because local state holds their path or a
    #: component of it (``_shadow``); shown once that local state goes (``unshadow``).
    #: GUARDED_BY the trio thread (created by ``Filesystem.__init__``)
    shadowed: dict[str, dict[str, tuple[Meta, str]]]
    #: stores where a local entry in the way of a shadowed record went (``shadow_freed``)
    #: since their shadowed records were last applied again (``unshadow``)
    unshadow_due: set[str]

    if TYPE_CHECKING:  # what this part calls of the other parts of ``core.Filesystem``
        def _account(self, n: Node, delta: int) -> None: ...

        def _bind_rid(self, n: Node, rid: str | None) -> None: ...

        def _detach(self, n: Node) -> None: ...

        def _ensure_dir(self, sm: StoreMount, parts: list[str], ts: int,
                        inv: list[tuple[Any, ...]] | None = None) -> Node | None: ...

        def _live(self, n: Node, sign: int) -> None: ...

        def _new_node(self, name: str, parent: Node | None, is_dir: bool, store: StoreMount | None,
                      mode: int, now_ns: int, uid: int | None = None, gid: int | None = None) -> Node: ...

        def _save_dirs_logged(self) -> None: ...

        def _set_record_key(self, n: Node, rid: str) -> None: ...

        def _touch_dir(self, d: Node) -> None: ...

        def _walk_files(self, d: Node) -> Iterator[Node]: ...


    def add_store(self, slug: str, access: str, records: Sequence[Record | Meta], *,
                  limits: dict[str, Any] | None = None, contents: dict[str, bytes] | None = None,
                  cached: bool = False, created: str = "") -> StoreMount:
        """Put one attached store under the root, built from a snapshot of its live records
        (``Record`` or mirror ``Meta`` objects; the nodes share their strings), with the
        empty directories and directory modes kept in ``dirs.json`` for it, unless they were
        made in another store of that slug (``created``: the store's creation time,
        ``Store.created_at``; one deleted and made again is another store; '' when unknown:
        they are kept).

        ``contents`` maps record id → bytes for records whose blob is not already cached;
        a record whose content is neither given nor cached is left out (logged). Which blobs
        are cached is asked in one scan (``BlobCache.missing_digests``), unless ``cached``:
        the caller checked that every record's blob is. Raises ``CacheError``.
        """
        now = time.time_ns()
        root = self._new_node(slug, self.root, True, None, 0o755, now)
        sm = StoreMount(slug=slug, access=access, root=root, created=created, **(limits or {}))
        root.store = sm
        self.stores[slug] = sm
        contents = contents or {}
        given = [r for r in records if r.content is not None or r.id in contents]
        if given:
            with self.blobs.batch():
                for rec in given:
                    data = contents.get(rec.id)
                    self.blobs.put(data if data is not None  # else rec.content is not None (given)
                                   else (rec.content or "").encode("utf-8"), rec.sha256)
        missing = set() if cached else self.blobs.missing_digests(
            _digest(r) for r in records if r.content is None and r.id not in contents)
        if missing:
            kept: list[Record | Meta] = []
            for rec in records:
                if _digest(rec) in missing:
                    log.error("record content missing from snapshot and cache; skipped",
                              extra={"store": slug, "record": rec.id})
                else:
                    kept.append(rec)
            records = kept
        self._insert_records(sm, records)
        if not self._dirs_of_another_store(sm):
            made_only = self.saved_dirs.get(DIRS_MADE_ONLY_KEY)
            made_only = isinstance(made_only, list) and slug in made_only
            for path in self.saved_dirs.get(slug, []):
                made: list[tuple[Any, ...]] = []
                d = self._ensure_dir(sm, path.split("/"), now, made)
                if d is not None and (made or made_only):
                    # made here before (a list of made directories only: one holding records
                    # stays made too), or an empty directory kept from a list written before
                    # those (every directory listed: one records imply is left implied)
                    d.made = True
            self._restore_dir_modes(sm)
        return sm

    def _dirs_of_another_store(self, sm: StoreMount) -> bool:
        """Whether the directories ``dirs.json`` keeps for ``sm``'s slug were made in another
        store of that slug (deleted since, and made again: attack 13 F5): both creation
        times known and different. Logged (INFO) when so: they are not put back."""
        saved = self.saved_dirs.get(STORE_CREATED_KEY)
        was = saved.get(sm.slug) if isinstance(saved, dict) else None
        if not (sm.created and was and was != sm.created):
            return False
        log.info("directories kept for an earlier store of this name dropped",
                 extra={"store": sm.slug, "store_created": sm.created, "earlier": was})
        return True

    def _insert_records(self, sm: StoreMount, records: Iterable[Record | Meta]) -> None:
        """Add clean files for ``records`` (``Record`` or mirror ``Meta``) to a store being
        built (``add_store``), in one loop (a store of 100,000 records is built at start, on
        the mount's critical path): each record a clean file (as ``_set_clean`` shows it),
        its key ``r:<id>`` implicit (as ``InodeTable._set_record_key`` gives it), counted in
        the store's ``count`` / ``used`` (as ``_live`` does); missing directories are made.
        Nodes share the records' objects (id, a mirror entry's file name, sha256 bytes, size,
        update time); a record whose path crosses a file is skipped (logged)."""
        uid, gid = self.settings.uid, self.settings.gid
        inodes, by_rid, by_key = self.inodes, self.by_rid, self.by_key
        types_get = _TYPES.get
        fmodes: dict[int, int] = {}  # permission bits -> the shared st_mode of a file
        root = sm.root
        last_dir, last_d = None, root
        ino = self._next_ino
        count = used = 0
        try:
            for rec in records:
                if not isinstance(rec, Meta):
                    rec = Meta.of(rec)  # a Record: the fields as the mirror keeps them
                head, name, ts = rec.dir, rec.name, rec.updated_ns
                if head != last_dir:
                    d: Node | None = root
                    for comp in head.split("/") if head else ():
                        assert d is not None and d.children is not None  # a directory
                        child = d.children.get(comp)
                        if child is None:
                            self._next_ino = ino
                            child = self._new_node(comp, d, True, sm, 0o755, ts)
                            ino = self._next_ino
                        elif child.children is None:
                            d = None
                            break
                        d = child
                    if d is None:
                        log.error("record path crosses a file; skipped",
                                  extra={"store": sm.slug, "record": rec.id})
                        last_dir = None
                        continue
                    last_dir, last_d = head, d
                d = last_d
                assert d.children is not None  # a directory
                xm = rec.mtime_ns
                fmode = fmodes.get(rec.mode)
                if fmode is None:
                    fmode = fmodes[rec.mode] = shared_mode(stat.S_IFREG | stat.S_IMODE(rec.mode))
                n = Node(ino, name, d, False, sm, fmode, uid, gid, ts, ts if xm is None else xm, ts)
                inodes[ino] = n
                ino += 1
                prev = d.children.get(name)
                if prev is not None and prev.children is not None:
                    last_dir = None  # a directory replaced by a file: walk again next time
                d.children[name] = n
                rid = rec.id
                n._key, n.record_id = None, rid  # the key is "r:" + rid (InodeTable._set_record_key)
                if by_key:
                    stale = by_key.get("r:" + rid)
                    if stale is not None and stale is not n:
                        del by_key["r:" + rid]
                by_rid[rid] = n
                t = rec.type
                n.version, n.rtype, n._sha = rec.version, types_get(t, t), rec.sha
                n.size, n.updated_ns = rec.size, ts
                if xm is not None:
                    n.xmtime = xm
                count += 1
                used += rec.size
        finally:
            self._next_ino = ino
            sm.count += count
            sm.used += used

    def _remove_file(self, n: Node) -> list[tuple[Any, ...]]:
        """Take file ``n`` (in the tree) out of it without a change of its own to send: its
        record deleted elsewhere, gone from a snapshot, or its write refused for a store
        deleted since. It leaves its directory and its record identity; directories that
        only held it go too (``_prune_implied``). Returns the kernel invalidations to submit
        (its entry first)."""
        parent = n.parent
        assert parent is not None  # a file of the tree
        inv: list[tuple[Any, ...]] = [("entry", parent.ino, n.name)]
        self._detach(n)
        self._bind_rid(n, None)
        self._prune_implied(parent, inv)
        return inv

    def _restore_dir_modes(self, sm: StoreMount) -> None:
        """Give the store's directories the modes saved in ``dirs.json`` (directory modes
        are local to this sidecar: docs/SEMANTICS.md)."""
        saved = self.saved_dirs.get(DIR_MODES_KEY, {})
        for path, mode in (saved.get(sm.slug, {}) if isinstance(saved, dict) else {}).items():
            d: Node | None = sm.root
            for comp in path.split("/") if path else []:
                d = d.children.get(comp) if d is not None and d.children is not None else None
            if d is not None and d.is_dir and isinstance(mode, int):
                d.mode = stat.S_IFDIR | stat.S_IMODE(mode)

    def _set_clean(self, n: Node, rec: Record | Meta, ts: int | None = None) -> None:
        """Show ``rec`` (a ``Record`` or a mirror ``Meta``; ``ts``: its update time in ns
        when the caller has it) as ``n``'s clean state: its content is ``rec``'s blob from
        now on. A write buffer ``n`` still holds is dropped (callers apply a state only to a
        file that is not ``dirty``, so the buffer holds no write: the content before, read in
        by a write refused at write(2), or kept in memory on a failing cache disk): kept, it
        would go on serving the old bytes and count their size in the store's usage
        (``cur_size``) while ``size`` says ``rec``'s."""
        if n._x is not None and n.buf is not None:
            assert not n.dirty, "a clean state over unsent writes"
            n.buf = None
            n.checker = None  # it judged the old content; the next write starts afresh
        self._bind_rid(n, rec.id)
        n.version, n.rtype = rec.version, _intern_type(rec.type)
        sha = getattr(rec, "sha", None)  # a mirror entry's bytes: shared, not copied
        if type(sha) is bytes:
            n._sha = sha
        else:
            n.sha = rec.sha256
        n.size, n.state = rec.size, CLEAN
        if n._x is not None:
            n.error = ""
        n.updated_ns = n.ctime_ns = updated_ns(rec) if ts is None else ts
        if n._x is None or rec.version >= n.attrs_version:  # else our newer attribute change stays shown
            n.mode = shared_mode(stat.S_IFREG | stat.S_IMODE(getattr(rec, "mode", DEFAULT_MODE)))
            n.xmtime = getattr(rec, "mtime_ns", None)
            n.attrs_version = 0
        xm = n.xmtime
        n.mtime_ns = xm if xm is not None else n.ctime_ns

    def apply_remote(self, sm: StoreMount, rec: Record | Meta, *,
                     force: bool = False) -> list[tuple[Any, ...]]:
        """Apply one record state from the change feed (or a snapshot when ``force``) to the
        tree. Returns the kernel invalidations to make: ``("entry", parent_ino, name)`` and
        ``("inode", ino)`` (content changed), ``("attr", ino)`` (only mode / mtime changed).

        Rules (docs/ARCHITECTURE.md, "Threads and ordering"): call only while the store's outbox is empty, so every local change
        is already committed; a file with unflushed local writes is never overwritten (its
        commit lands on top); a state not newer than the local version is skipped (our own
        writes come back through the feed), unless ``force`` (after a snapshot), where the
        path, sha256 and attributes decide.
        """
        shadow = self.shadowed.get(sm.slug)
        # a state of it kept because local state was in its way: this newer one is applied
        # or kept instead (``_shadow``, told ``hidden`` so as not to say it twice)
        hidden = shadow.pop(rec.id, None) if shadow else None
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
            if n.state == REJECTED:
                kept = self._remote_over_rejected(sm, n, rec, hidden)
                if kept is not None:
                    return kept
        if rec.deleted:
            if n is None:
                return []
            return self._remove_file(n)
        if rec.content is None and not self.blobs.has(rec.sha256):
            log.error("remote change without content; skipped", extra={"store": sm.slug, "record": rec.id})
            return []
        if rec.content is not None:
            self.blobs.put(rec.content.encode("utf-8"), rec.sha256)
        inv: list[tuple[Any, ...]] = []
        if n is None:
            parts = rec.path.split("/")
            blocker = self._local_in_way(sm, parts)
            if blocker is not None:
                self._shadow(sm, rec, blocker, hidden)
                return []
            d = self._ensure_dir(sm, parts[:-1], time.time_ns(), inv)
            assert d is not None and d.children is not None  # no file in the way (above)
            cur = d.children.get(parts[-1])
            if cur is not None:  # the clean file of another record: this one replaces it
                inv.append(("entry", d.ino, cur.name))
                self._detach(cur)
                self._bind_rid(cur, None)
            n = self._new_node(parts[-1], d, False, sm, 0o644, time.time_ns())
            n.unread = True  # no reader here was served it: never an overwrite's base
            self._set_record_key(n, rec.id)
            self.ids.note(n.key, rec.id, rec.sha256)
            self._live(n, +1)  # size 0 now; its size is accounted below
            inv.append(("entry", d.ino, n.name))
            self._touch_dir(d)
        else:
            if n.path() != rec.path:
                inv += self._move_remote(sm, n, rec.path, rec, hidden)
            if n.sha != rec.sha256:
                inv.append(("inode", n.ino))
                self.note_replaced(n, rec.sha256)
            self.ids.note(n.key, rec.id, rec.sha256)
        old = n.cur_size()
        before = (n.mode, n.mtime_ns)
        self._set_clean(n, rec)
        self._account(n, n.size - old)
        if (n.mode, n.mtime_ns) != before and not any(i[0] == "inode" and i[1] == n.ino for i in inv):
            inv.append(("attr", n.ino))
        return inv

    def _local_in_way(self, sm: StoreMount, parts: list[str]) -> Node | None:
        """The local entry that keeps a record not shown here at path ``parts`` (its
        components) from being shown: a file where the path needs a directory (a local-only
        file, a rejected file, a file not committed yet), or at the path itself a directory
        (made here, or holding such files), a file with unsent writes, a file with no record
        (local-only, refused at create, not committed yet) or a rejected file. None when the
        path is free, or holds only the clean file of another record (replaced)."""
        d = sm.root
        for comp in parts[:-1]:
            assert d.children is not None  # a directory (checked below)
            child = d.children.get(comp)
            if child is None:
                return None  # the rest of the path is made
            if child.children is None:
                return child
            d = child
        assert d.children is not None  # a directory
        cur = d.children.get(parts[-1])
        if cur is not None and (cur.is_dir or cur.dirty or cur.record_id is None
                                or cur.state == REJECTED):
            return cur
        return None

    def _shadow(self, sm: StoreMount, rec: Record | Meta, blocker: Node,
                hidden: tuple[Meta, str] | None, shown_at: str | None = None,
                quiet: bool = False) -> None:
        """Record ``rec`` (a state from the feed, a snapshot or a refetch, of a record not
        shown here) cannot be shown: local state here, ``blocker``, holds its path or a
        component of it. The local entry stays (it was there first; docs/SEMANTICS.md,
        "Remote changes and local state"); the record's state is kept in ``shadowed`` and
        shown once ``blocker`` goes (``shadow_freed``, ``unshadow``). Said once per record
        and local path (``hidden``: the entry it had before; a record changed again while
        hidden is not said again, so a busy one cannot flood ``errors.log``): a line in
        ``errors.log`` and a WARNING (paths, record id and version, never content); for a
        rejected file in the way, its ``kept`` line (``_note_rejected_kept``). ``shown_at``:
        the record is shown here at that path (a move of it waits), not hidden."""
        where = blocker.path()
        state = rec if isinstance(rec, Meta) else Meta.of(rec)
        self.shadowed.setdefault(sm.slug, {})[rec.id] = (state, where)
        if quiet or (hidden is not None and hidden[1] == where):
            return  # said already (a record changed while hidden is not said again)
        if blocker.state == REJECTED and not blocker.local_only and not blocker.is_dir:
            at = ("this path" if where == rec.path else f"{rec.path}, below this file's path")
            if shown_at is not None:
                what = (f"record {rec.id} was moved onto {at} elsewhere; it stays shown at "
                        f"{shown_at} while this file is kept")
            else:
                what = (f"another record now has {at} elsewhere (record {rec.id}, version "
                        f"{rec.version}); that record is not shown here while this file is kept")
            self._note_rejected_kept(blocker, None if shown_at is not None else rec, what)
            return
        kind = ("a directory made here" if blocker.is_dir and blocker.made
                else "a directory" if blocker.is_dir
                else "a local-only file" if blocker.local_only
                else "a file with writes not committed yet" if blocker.dirty or blocker.record_id is None
                else "a file")
        self.controls.note_shadowed(sm.slug, where, kind, rec.path, rec.id, rec.version, shown_at)

    def shadow_freed(self, n: Node) -> None:
        """Local entry ``n`` is leaving its path (unlink, rmdir, a rename away or over it, a
        remote change): when a record not shown here (``shadowed``) waits for that path or
        one below it, its store's shadowed records are due to be applied again
        (``unshadow``), which the sidecar does once the store's outbox is empty
        (``FsListener.shadow_freed``). Costs nothing for a store with none."""
        sm = n.store
        if sm is None or sm.slug in self.unshadow_due:
            return
        entries = self.shadowed.get(sm.slug)
        if not entries:
            return
        path = n.path()
        below = path + "/"
        if any(w == path or w.startswith(below) for _, w in entries.values()):
            self.unshadow_due.add(sm.slug)
            if self.listener is not None:
                try:
                    self.listener.shadow_freed(sm.slug)
                except Exception:  # a listener's failure never fails the syscall
                    log.exception("shadow_freed listener failed", extra={"store": sm.slug})

    def unshadow(self, sm: StoreMount) -> list[tuple[Any, ...]]:
        """Apply again the records of ``sm`` not shown because local state was in their way
        (``shadowed``), when a local entry in the way of one went since (``unshadow_due``):
        each as a snapshot state (``apply_remote`` with ``force``), from its newest state
        known here (the store's mirror, ``FsListener.known_record``: none → gone; a bare core:
        the state kept). A record still in the way of local state stays shadowed (said
        again only for another local path). Call only while the store's outbox is
        empty (as for the feed). Returns the kernel invalidations to make."""
        if sm.slug not in self.unshadow_due:
            return []
        self.unshadow_due.discard(sm.slug)
        entries = self.shadowed.get(sm.slug, {})
        inv: list[tuple[Any, ...]] = []
        for rid, (kept, _) in list(entries.items()):
            state: Meta | None = kept
            if self.listener is not None:
                state = self.listener.known_record(sm.slug, rid)
            if state is None:
                del entries[rid]
                continue
            inv += self.apply_remote(sm, state, force=True)
            if rid not in entries and rid in self.by_rid:
                log.info("a record hidden by local state here is shown now",
                         extra={"store": sm.slug, "path": state.path, "record": rid,
                                "version": state.version})
        return inv

    def kernel_behind(self, ino: int) -> bool:
        """True while the kernel may still show an older content of inode ``ino``: the
        invalidation of a change of its content has not reached the kernel yet
        (``FsListener.kernel_behind``; a bare core, without a kernel, is never behind)."""
        listener = self.listener
        return listener is not None and listener.kernel_behind(ino)

    def note_replaced(self, n: Node, sha: str) -> None:
        """File ``n``'s content is about to be replaced by the version ``sha`` (sha256, 64
        hex digits) that no reader here was served yet: a remote change, or the merge of
        this sidecar's own write shown; the caller then invalidates the kernel's pages and
        attributes of ``n``. Readers were served ``n``'s content, or an older
        one still when none read it since the last such change: a later overwrite is based
        on that (``Node.read_base``, docs/SEMANTICS.md "Conflicts"), not on ``sha``. Until
        the invalidation reaches the kernel, the kernel may still serve a reader ``n``'s
        content (``Node.shown``; when it is behind already, the older content it showed
        before that earlier change)."""
        x = n._x
        if x is not None and x.get("read_base") == sha:
            del x["read_base"]  # back to what readers were served
        elif not n.read_base and n.sha and n.sha != sha:
            # readers were served n's content, or, when a writer here changed it since, the
            # content before that write (Node.served: sed -i reads while echo >> appends)
            base = n.served if n.unread else n.sha
            if base and base != sha:
                n.read_base = base
        if n.sha and (not n.shown or not self.kernel_behind(n.ino)):
            # (behind with no ``shown``: the kernel was told n's attributes since,
            # ``Filesystem.kernel_told_size``)
            n.shown = n.sha
        n.unread = True  # ``sha`` is served to nobody yet
        if n.opened and n.sha and n.sha != sha:
            # a reader open now may hold part of n's content: its next read is checked
            # against it (Handle.replaced, Filesystem._read_across)
            for h in self.handles.values():
                if (h.node is n and not h.replaced and h.snapshot is None
                        and h.flags & os.O_ACCMODE != os.O_WRONLY):
                    h.replaced, h.across = n.sha, ""

    def _remote_over_rejected(self, sm: StoreMount, n: Node, rec: Record | Meta,
                              hidden: tuple[Meta, str] | None = None
                              ) -> list[tuple[Any, ...]] | None:
        """A newer state ``rec`` of the record of ``n``, a rejected file (refused for good,
        kept here until fixed: docs/SEMANTICS.md, "Remote changes and rejected files"), from
        the feed or a snapshot. Returns None when applying it as usual loses nothing: the
        remote content is the rejected content, or the rejected content is the stored content
        the file had (a write refused at once and held back). Otherwise the file keeps its
        rejected content, state and reason (a move moves it along, as a local rename does;
        its content is never replaced and it is not removed); its base version stays the one
        it was refused over, so its fix is sent by the conflict rules (a delete elsewhere:
        created again); the change is one ``errors.log`` line and WARNING per version.
        Returns the invalidations of a move (``hidden``: the state of the record kept
        because local state was in the way of its move, ``shadowed``)."""
        known = self.ids.map.get(n.key, (None, None))[1]
        if not rec.deleted and (rec.sha256 == n.sha or (known is not None and known == n.sha)):
            return None
        inv: list[tuple[Any, ...]] = []
        was = n.path()
        moved = not rec.deleted and rec.path != was
        if moved:
            inv = self._move_remote(sm, n, rec.path, rec, hidden, quiet=True)
        if rec.deleted:
            what = f"the record was deleted elsewhere (version {rec.version})"
        elif moved and rec.sha256 == known:
            what = f"the record was moved elsewhere from {was} (version {rec.version})"
        elif moved:
            what = f"the record was moved from {was} and changed elsewhere (version {rec.version})"
        else:
            what = f"the record was changed elsewhere (version {rec.version})"
        if moved and n.path() == was:
            what += f"; its new path {rec.path} is taken here, so the file stays at {was}"
        self._note_rejected_kept(n, rec, what)
        return inv

    def _note_rejected_kept(self, n: Node, rec: Record | Meta | None, what: str) -> None:
        """One ``errors.log`` line and WARNING ``refused`` (the file's errno and reason
        code, path, never content) saying that the rejected file ``n`` was kept over the
        remote change ``what``; once per record version (``rec``)."""
        key = (rec.version if rec is not None else -1, what)
        noted = self._rejected_remote.setdefault(n, set())
        if key in noted:
            return
        noted.add(key)
        err, code = self._rejected.get(n, (errno.EIO, ""))
        assert n.store is not None  # a file of a store
        self.controls.note_kept(n.store.slug, n.path(), err, code,
                                f"{what}: the rejected local content is kept in this file, still "
                                "rejected (the other version is in the record's history); fixing this "
                                "file sends it over that version by the conflict rules")

    def _move_remote(self, sm: StoreMount, n: Node, path: str, rec: Record | Meta,
                     hidden: tuple[Meta, str] | None, quiet: bool = False) -> list[tuple[Any, ...]]:
        """Move file ``n`` to ``path``, its record's new path (state ``rec``) from a remote
        change. When local state holds ``path`` or a component of it (``_local_in_way``),
        ``n`` stays where it is, still shown, and the move waits for that state to go
        (``_shadow``; ``quiet``: said by the caller, a rejected file's own line). Returns the
        kernel invalidations to make."""
        parts = path.split("/")
        inv: list[tuple[Any, ...]] = []
        blocker = self._local_in_way(sm, parts)
        if blocker is not None and blocker is not n:
            self._shadow(sm, rec, blocker, hidden, shown_at=n.path(), quiet=quiet)
            return []
        d = self._ensure_dir(sm, parts[:-1], time.time_ns(), inv)
        if d is None:  # n itself is in the way (a file moved below its own path)
            return []
        assert d.children is not None  # _ensure_dir gives a directory
        cur = d.children.get(parts[-1])
        if cur is not None and cur is not n:  # the clean file of another record: replaced
            inv.append(("entry", d.ino, cur.name))
            self._detach(cur)
            self._bind_rid(cur, None)
        self.shadow_freed(n)  # its old path is free: a record may wait for it
        old = n.parent
        assert old is not None and old.children is not None  # n is in the tree
        inv.append(("entry", old.ino, n.name))
        del old.children[n.name]
        self._touch_dir(old)
        n.parent, n.name = d, parts[-1]
        d.children[n.name] = n
        self._touch_dir(d)
        inv.append(("entry", d.ino, n.name))
        self._prune_implied(old, inv)
        return inv

    def _prune_implied(self, d: Node, inv: list[tuple[Any, ...]]) -> None:
        """A remote change (a delete, a move) took a file out of directory ``d``: ``d`` and
        then each parent that is left empty go, up to the store's root, unless made here
        (``Node.made``: ``mkdir``, or kept empty from ``dirs.json``). A directory only
        implied by records is shown while records are under it, as other mounts see it
        (docs/SEMANTICS.md, "Layout"): a directory moved or emptied elsewhere leaves no
        empty shell here, as a local disk shows no source after ``mv``. Each removal is an
        entry invalidation in ``inv``; the directory list is saved by the caller once the
        page or snapshot is applied (``save_pruned_dirs``: one walk of the tree, not one
        per directory of a big move)."""
        while (d.children is not None and not d.children and not d.made and not d.unlinked
               and d.store is not None and d is not d.store.root and d.parent is not None):
            parent = d.parent
            inv.append(("entry", parent.ino, d.name))
            self._detach(d)
            self.dirs_pruned = True
            d = parent

    def save_pruned_dirs(self) -> None:
        """Save the directory list (``dirs.json``) when remote changes applied since the last
        call removed directories (``_prune_implied``); called after each page of the feed and
        each snapshot applied. A failure to save is logged (the directory list is written
        again at the next change; until then a restart may show the removed directories as
        empty ones)."""
        if self.dirs_pruned:
            self.dirs_pruned = False
            self._save_dirs_logged()

    def reconcile_store(self, sm: StoreMount, records: Iterable[Record | Meta],
                        queued: Sequence[Entry] = ()) -> list[tuple[Any, ...]]:
        """Make the store's tree match a full snapshot (after ``410``): apply every record,
        remove clean local files whose record is no longer live.

        Call with no commit of the store in flight between the snapshot and this call
        (``Committer.hold``): every local change that committed is then in ``records``.
        ``queued`` are the store's outbox entries not committed yet: local changes the
        snapshot cannot show. Records and files they touch are left as they are here (their
        commits land on top), so a reconcile never reverts or hides a local write. A rejected
        file is never replaced or removed by it (``_remote_over_rejected``)."""
        busy_keys = {e.node_key for e in queued if e.node_key}
        busy_rids = {self.ids.record_id(k) for k in busy_keys}
        busy_rids |= {k[2:] for k in busy_keys if k.startswith("r:")}
        prefixes = [p for e in queued if e.op == MOVE_PREFIX
                    for p in (e.args.get("from", ""), e.args.get("to", ""))]

        def touched(path: str) -> bool:
            return any(path == p or path.startswith(p + "/") for p in prefixes)

        inv: list[tuple[Any, ...]] = []
        live: set[str] = set()
        self.unshadow_due.discard(sm.slug)  # every record is applied again below
        for rec in records:
            live.add(rec.id)
            n = self.by_rid.get(rec.id)
            if rec.id in busy_rids or touched(rec.path) or (n is not None and n.key in busy_keys):
                continue
            inv += self.apply_remote(sm, rec, force=True)
        for n in list(self._walk_files(sm.root)):
            if (n.record_id and n.record_id not in live and not n.dirty and not n.local_only
                    and n.key not in busy_keys and n.state == REJECTED and not touched(n.path())):
                # kept (its fix creates the record again), and said so once
                if not any(w.startswith("the record was deleted")
                           for _, w in self._rejected_remote.get(n, ())):
                    self._note_rejected_kept(n, None, "the record was deleted elsewhere")
                continue
            if (n.record_id and n.record_id not in live and not n.dirty and not n.local_only
                    and n.key not in busy_keys and n.state == CLEAN and not touched(n.path())):
                inv += self._remove_file(n)
        shadow = self.shadowed.get(sm.slug, {})
        for rid in [r for r in shadow if r not in live]:
            del shadow[rid]
        self.save_pruned_dirs()
        return inv

    def remove_store(self, slug: str) -> list[tuple[Any, ...]]:
        """Take a store out of the mount; handles still open on it answer ``ESTALE``."""
        sm = self.stores.pop(slug, None)
        if sm is None:
            return []
        sm.detached = True
        inv: list[tuple[Any, ...]] = [("entry", self.root.ino, slug)]
        self._detach(sm.root)
        self.shadowed.pop(slug, None)  # loaded again, the store is built afresh
        self.unshadow_due.discard(slug)
        # the tree taken out is found by no key: a store loaded again gets new nodes, and
        # results of its entries still queued find those (``overlay_outbox``) or none
        for n in self._walk_files(sm.root):
            if n.record_id and self.by_rid.get(n.record_id) is n:
                del self.by_rid[n.record_id]
            if n._key and self.by_key.get(n._key) is n:
                del self.by_key[n._key]
        return inv
