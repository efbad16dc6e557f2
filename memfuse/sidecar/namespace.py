"""Namespace changes of a memfuse mount: mkdir, unlink, rmdir, rename, and the directory list.

``NamespaceOps`` is the part of ``core.Filesystem`` that changes the tree on behalf of a
syscall. Each change applies locally at once and queues its outbox entries
(``DELETE``, ``MOVE``, ``MOVE_PREFIX``) with the paths of that moment, so the control plane
sees the local sequence. Renames follow rename(2) / renameat2(2) (``RENAME_NOREPLACE``;
``RENAME_EXCHANGE`` → ``EINVAL``; across stores → ``EXDEV``); a file renamed over another takes
over the target's record (docs/SEMANTICS.md, "Namespace changes"). Empty directories made by
mkdir, and directory modes, are local to this sidecar: kept in ``dirs.json`` in the cache
(``save_dirs``, written whole on every change of the directory set, not fsynced: it survives a
``kill -9``), and made durable by the fsync of a directory (``write_dirs_durably``, in a
worker thread: ``dirs.synced.json``, fsynced, then the cache directory), which a start reads
when a power cut left ``dirs.json`` unreadable or older (``load_dirs``: the higher generation
wins). Nothing here awaits.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import itertools
import stat
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from .. import names
from ..defs import PREFIX_MOVE_MAX
from .inodes import (DIR_MODE, DIR_MODES_KEY, DIRS_GENERATION_KEY, DIRS_MADE_ONLY_KEY, PENDING, RENAME_EXCHANGE, RENAME_NOREPLACE,
                     STORE_CREATED_KEY, FsError,
                     Node, StoreMount)
from .cachedir import CacheError, cache_error, write_private
from .journal import DELETE, MOVE, MOVE_PREFIX, new_key

if TYPE_CHECKING:
    from .committer import Committer

log = logging.getLogger("memfuse.fs")


class NamespaceOps:
    """mkdir, unlink, rmdir and rename of ``core.Filesystem``, and its directory list
    (module docstring); mixed into it. Each operation changes the tree and queues its outbox
    entries with no ``await`` in between (``Committer.submit`` is synchronous): the order of
    a store's entries is the order of the syscalls."""

    # what this part uses of the filesystem (declared here, S3QL style; created by
    # ``Filesystem.__init__``)
    inodes: dict[int, Node]
    by_key: dict[str, Node]
    by_rid: dict[str, Node]
    stores: dict[str, StoreMount]
    committer: Committer
    metrics: Any
    dirs_file: Path | None
    #: slug -> directory paths made here; ``DIR_MODES_KEY`` -> their modes (``dirs.json``)
    saved_dirs: dict[str, Any]
    #: how many times the directory list was saved (``save_dirs``), and that count when its
    #: durable copy was last written (``write_dirs_durably``, set from its worker thread).
    #: INVARIANT: ``_dirs_synced <= _dirs_changes``; they start at 0 and 1 (what a start
    #: loaded was never fsynced here).
    _dirs_changes: int
    _dirs_synced: int
    #: True while a worker thread writes the durable copy: set on the trio thread before the
    #: thread starts (``dirs_to_sync``), cleared when it ends (or did not start), so that
    #: one runs at a time (a stalled disk piles up no threads: an fsync that gave up left
    #: its write running)
    dirs_writing: bool
    #: orders the durable copies' renames (``write_dirs_durably``): an older list never
    #: replaces a newer one
    _dirs_rename_lock: threading.Lock
    _local: set[Node]  # ``LocalFiles``: the local-only files

    if TYPE_CHECKING:  # what this part calls of the other parts of ``core.Filesystem``
        def _bind_rid(self, n: Node, rid: str | None) -> None: ...

        def _check_name(self, d: Node, name: bytes) -> str: ...

        def _child(self, d: Node, name: bytes) -> Node: ...

        def _drop_if_unused(self, n: Node) -> None: ...

        def shadow_freed(self, n: Node) -> None: ...

        def _has_remote(self, d: Node) -> bool: ...

        def _live(self, n: Node, sign: int) -> None: ...

        def _new_node(self, name: str, parent: Node | None, is_dir: bool, store: StoreMount | None,
                      mode: int, now_ns: int, uid: int | None = None, gid: int | None = None) -> Node: ...

        def _touch_dir(self, d: Node) -> None: ...

        def _writable_dir(self, d: Node) -> StoreMount: ...

        def commit_quietly(self, n: Node) -> None: ...

        def is_local_only(self, name: str) -> bool: ...

        def judge_rename(self, n: Node, new_path: str) -> None: ...

        def node(self, ino: int) -> Node: ...

        def refuse(self, where: Node | None, name: str, err: int, reason: str, code: str = "") -> NoReturn: ...

        def sync_local(self) -> None: ...

        def sync_rejected(self) -> None: ...

    def _check_dir_name(self, d: Node, name: str) -> None:
        """``names.check_dir_name`` for a directory ``name`` made in ``d`` (mkdir, a directory
        renamed there): refused ``EINVAL`` (``invalid_path``, an ``errors.log`` line)."""
        try:
            names.check_dir_name(d.path(), name)
        except names.NameError_ as e:
            self.refuse(d, name, errno.EINVAL, e.reason, "invalid_path")

    def mkdir(self, parent_ino: int, name: bytes, mode: int, uid: int, gid: int) -> Node:
        """mkdir(2) of ``name`` in ``parent_ino`` (permission bits ``mode``, owner ``uid`` /
        ``gid``); returns the new directory (one kernel lookup). It lives in this sidecar
        (``dirs.json``) until files are written in it. Raises ``FsError``: ``EEXIST``,
        ``ENOTDIR``, ``EACCES``, ``EROFS``, ``EINVAL`` / ``ENAMETOOLONG``, and the cache disk's
        errno (``ENOSPC`` / ``EIO``) when the directory list cannot be saved."""
        d = self.node(parent_ino)
        sm = self._writable_dir(d)
        assert d.children is not None  # _writable_dir: a directory
        s = self._check_name(d, name)
        if s in d.children:
            raise FsError(errno.EEXIST)
        self._check_dir_name(d, s)
        n = self._new_node(s, d, True, sm, stat.S_IMODE(mode), time.time_ns())  # the mount's uid / gid
        n.made = True  # kept when records under it go elsewhere (RemoteApply._prune_implied)
        try:
            self.save_dirs()
        except CacheError as err:
            del d.children[s]  # a directory that would not survive a restart is refused
            self.inodes.pop(n.ino, None)
            self.refuse(d, s, err.errno, err.reason)
        n.nlookup += 1
        self._touch_dir(d)
        return n

    def _detach(self, n: Node) -> None:
        """Take ``n`` out of its directory (unlink, rmdir, a rename over it, a remote
        change): it is ``unlinked`` from now on, and a record not shown here because ``n``
        was in its way is due to be shown (``RemoteApply.shadow_freed``)."""
        self.shadow_freed(n)
        self._live(n, -1)
        parent = n.parent
        assert parent is not None and parent.children is not None  # n is in the tree
        del parent.children[n.name]
        self._touch_dir(parent)
        n.unlinked = True
        n.ctime_ns = time.time_ns()
        self._drop_if_unused(n)

    def unlink(self, parent_ino: int, name: bytes) -> None:
        """unlink(2) of file ``name`` in ``parent_ino``: removed locally at once, a ``DELETE``
        queued (not for local-only files). Raises ``FsError``: ``ENOENT``, ``EISDIR``,
        ``ENOTDIR``, ``EACCES``, ``EROFS``."""
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
        self.sync_rejected()  # an unlinked rejected file is not kept
        self.sync_local()  # nor a local-only one

    def rmdir(self, parent_ino: int, name: bytes) -> None:
        """rmdir(2) of directory ``name`` in ``parent_ino``. Raises ``FsError``: ``ENOENT``,
        ``ENOTDIR``, ``ENOTEMPTY``, ``EACCES``, ``EROFS``."""
        d = self.node(parent_ino)
        self._writable_dir(d)
        n = self._child(d, name)
        if not n.is_dir:
            raise FsError(errno.ENOTDIR)
        if n.children:
            raise FsError(errno.ENOTEMPTY)
        self._detach(n)
        self._save_dirs_logged()

    def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
               flags: int) -> None:
        """rename(2) / renameat2(2): ``flags`` may hold ``RENAME_NOREPLACE`` (an existing
        target → ``EEXIST``); ``RENAME_EXCHANGE`` → ``EINVAL``. Across stores → ``EXDEV``; a
        directory holding more than ``PREFIX_MOVE_MAX`` files → ``EXDEV`` too (``mv`` copies).
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
        if src.is_dir:
            self._check_dir_name(nd, s)
        assert od.children is not None and nd.children is not None  # _writable_dir: directories
        dst = nd.children.get(s)
        if dst is src:
            return
        if dst is not None and flags & RENAME_NOREPLACE:
            raise FsError(errno.EEXIST)
        if src.is_dir:
            a: Node | None = nd
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
        if not src.is_dir:
            self.judge_rename(src, new_path)  # content refusable under the new name: not renamed
        commit_after = False
        if src.is_dir:
            files = self._check_subtree_paths(nd, src, new_path)
            if self._has_remote(src):
                if files > PREFIX_MOVE_MAX:  # one prefix move moves no more (defs.PREFIX_MOVE_MAX)
                    self.refuse(nd, s, errno.EXDEV,
                                f"{files} files below the directory; one move moves at most {PREFIX_MOVE_MAX} "
                                "(mv copies them one by one)", "move_too_large")
                self.committer.submit(sm.slug, MOVE_PREFIX, None, {"from": old_path, "to": new_path})
        else:
            commit_after = self._rename_file_remote(sm, src, dst, s, old_path, new_path)
        if dst is not None:
            dst.dirty = False
            self._detach(dst)
        self.shadow_freed(src)  # its old path is free: a record may wait for it
        del od.children[src.name]
        self._touch_dir(od)
        src.name, src.parent = s, nd
        nd.children[s] = src
        self._touch_dir(nd)
        src.ctime_ns = time.time_ns()
        if src.is_dir:
            self._save_dirs_logged()
        if commit_after and src.opened == 0:
            self.commit_quietly(src)
        self.sync_rejected()  # rejected files moved (or replaced) keep their new paths
        self.sync_local()  # so do local-only files; one renamed onto a normal name is a record

    def _leave_record(self, n: Node) -> None:
        """File ``n``, renamed onto a local-only name, leaves its record (the ``DELETE``
        queued under its old key deletes it): from now on it is a local file like one made
        under such a name, with a new key and no record id, version or overwrite base. So
        nothing said about that record reaches it: not the answer to a put still in flight
        (it names the old path: taken for a move made elsewhere, the record was fetched
        again, found deleted by that ``DELETE``, and the deletion removed this file), not a
        remote change of it (a rival edit moved the local file back over the record's
        path), not a refetch. The committer resolves the old key on its own
        (``RecordIds``). Renamed back onto a normal name, the file is a new record."""
        if n._key and self.by_key.get(n._key) is n:
            del self.by_key[n._key]
        if n.record_id and self.by_rid.get(n.record_id) is n:
            del self.by_rid[n.record_id]
        n.record_id, n.version, n.rtype, n.last_put = None, 0, None, None
        n.key = "n:" + new_key()
        self.by_key[n.key] = n
        x = n._x
        if x is not None:
            for k in ("replacing", "read_base", "served", "attrs_version"):
                x.pop(k, None)

    def _adopt_key(self, src: Node, dst: Node) -> None:
        """``src`` replaces ``dst`` locally and takes over its record (key and id)."""
        if src._key and self.by_key.get(src._key) is src:
            del self.by_key[src._key]
        src.key = dst.key  # written out: the key stays the target's whatever its id becomes
        self.by_key[src.key] = src
        # src's content replaces dst's whole: its base is the version of dst a writer here
        # could have read (Node.read_base; none: the version this sidecar last saw)
        x = src._x
        if x is not None:
            x.pop("read_base", None)
        if dst.read_base:
            src.read_base = dst.read_base
        if dst.served and dst.unread:
            src.served = dst.served
        src.replacing = True  # its commit is an overwrite: based on what was read
        rid, src.version = dst.record_id, dst.version
        self._bind_rid(dst, None)
        self._bind_rid(src, rid)

    def _check_subtree_paths(self, nd: Node, d: Node, new_path: str) -> int:
        """Every record below a directory moved to ``new_path`` must still have a valid path
        (docs/SEMANTICS.md "Names": ≤ 32 components, ≤ 1,024 bytes) → else ``ENAMETOOLONG``.
        Returns the number of files below it (not local-only ones)."""
        stack = [(d, new_path)]
        files = 0
        while stack:
            cur, path = stack.pop()
            for name, c in (cur.children or {}).items():
                p = path + "/" + name
                if c.is_dir:
                    stack.append((c, p))
                elif not c.local_only:
                    files += 1
                if not c.local_only:
                    try:
                        names.check_path(p)
                    except names.NameError_ as e:
                        self.refuse(nd, d.name, errno.ENAMETOOLONG if e.too_long else errno.EINVAL,
                                    f"{e.reason} (for {name!r} below the moved directory)")
        return files

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
                src.renamed_over = True
            self._live(src, -1)
            src.local_only = False
            self._live(src, +1)
            src.dirty = True
            return True
        if to_local:
            self.committer.submit(sm.slug, DELETE, src.key, {"path": old_path})
            self._live(src, -1)
            src.local_only = True
            self._live(src, +1)
            self._leave_record(src)
            self._local.add(src)  # kept from now on (LocalFiles), under its new name
            return False
        if src.dirty and src.opened == 0:
            self.commit_quietly(src)
        if (dst is not None and not dst.local_only and src.record_id is None
                and src.state != PENDING):
            # src never reached the control plane (refused, or not flushed yet): there is
            # nothing to move; src takes over dst's record, so fixing or deleting src later
            # acts on that record (as a local-only file renamed over it does)
            self._adopt_key(src, dst)
            if src.dirty:  # still being written: its content reaches the record at its close
                src.renamed_over = True
            return False
        if dst is not None and not dst.local_only:
            # A rename over a record (sed -i, os.replace, an editor's save, mv over a file)
            # is a write of that record under the rules of an in-place write, never a blind
            # replace: src's record (the temporary, created or queued) is deleted, and src
            # takes over dst's key, so its content is put with dst's last-seen version as
            # the base (If-Match): a rival change since then is merged (append rebase,
            # three-way line merge), and only overlapping edits fall back to last writer
            # wins with a conflict line (Committer._put). Order in the store's queue: src's
            # create (if queued), its delete, dst's put.
            self.committer.submit(sm.slug, DELETE, src.key, {"path": old_path})
            self._adopt_key(src, dst)
            src.dirty = True
            src.renamed_over = True
            return True
        self.committer.submit(sm.slug, MOVE, src.key, {"path": old_path, "to": new_path,
                                                        "replace": False})
        return False

    # ------------------------------------------------------------------ directories (dirs.json)
    def _ensure_dir(self, sm: StoreMount, parts: list[str], ts: int,
                    inv: list[tuple[Any, ...]] | None = None) -> Node | None:
        """The directory at ``parts`` under the store root, made where missing (each new one
        added to ``inv`` as an entry to invalidate); None when the path crosses a file."""
        d = sm.root
        for comp in parts:
            assert d.children is not None  # a directory (checked below)
            child = d.children.get(comp)
            if child is None:
                child = self._new_node(comp, d, True, sm, 0o755, ts)
                if inv is not None:
                    inv.append(("entry", d.ino, comp))
            elif not child.is_dir:
                return None
            d = child
        return d

    def init_dirs(self, dirs_file: Path | None) -> None:
        """Load the directory list a previous process kept (``load_dirs``) into
        ``saved_dirs``; called by ``Filesystem.__init__``."""
        self.dirs_file = dirs_file
        self.saved_dirs = load_dirs(dirs_file) if dirs_file is not None else {}
        # a list loaded may not be on disk (dirs.json is not fsynced): the first directory
        # fsync writes its durable copy
        self._dirs_changes, self._dirs_synced = (1 if self.saved_dirs else 0), 0
        # the generation the lists written from now on count from (``_dirs_state``)
        self._dirs_generation = _generation(self.saved_dirs)
        self.dirs_writing = False
        self._dirs_rename_lock = threading.Lock()

    def remove_dirs_tmp(self) -> None:
        """Remove the temporary files of durable directory-list writes a crash cut short
        (``write_dirs_durably``). Only once the cache directory's lock is this process's
        (``Sidecar.run``): a second start on a cache in use must not take a running
        sidecar's file from under its rename (review26 F6)."""
        if self.dirs_file is None:
            return
        synced = synced_dirs_file(self.dirs_file)
        for tmp in self.dirs_file.parent.glob(f".{synced.name}.*.tmp"):
            with contextlib.suppress(OSError):
                tmp.unlink()

    def save_dirs(self) -> None:
        """Persist the directories made here of every store (``dirs.json`` in the cache:
        ``Node.made``, not those only implied by records; ``_dirs_state``), so a directory
        made by mkdir and still empty survives a restart of the sidecar, and one holding
        records stays made (kept when they go elsewhere), with
        each store's creation time (``StoreMount.created``: a store deleted and made again
        under the same slug gets none of them, ``RemoteApply.add_store``). Atomic (tmp +
        rename), not fsynced: a directory's fsync makes the list durable
        (``write_dirs_durably``); directories holding records are implied by them anyway."""
        if self.dirs_file is None:
            return
        self._dirs_changes += 1  # (a failed save too: the durable copy is written from the tree)
        out = self._dirs_state()
        tmp = self.dirs_file.with_suffix(".tmp")
        try:
            write_private(tmp, json.dumps(out))
            os.replace(tmp, self.dirs_file)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise self.dirs_error(exc) from exc
        self.saved_dirs = out

    def dirs_error(self, exc: OSError) -> CacheError:
        """The ``CacheError`` of a failed write of the directory list (``save_dirs``, its
        durable copy), counted in ``memfuse_cache_write_errors_total{part="dirs"}``."""
        err = cache_error(exc, "saving the directory list")
        if self.metrics is not None:
            self.metrics.cache_write_errors.labels("dirs", errno.errorcode.get(err.errno, str(err.errno))).inc()
        return err

    def dirs_unsynced(self) -> int:
        """The change of the directory list (a count of ``save_dirs``) a directory's fsync
        must see durable, 0 when its durable copy holds it already (no mkdir, rmdir,
        directory rename or chmod since) or there is no cache."""
        if self.dirs_file is None or self._dirs_synced >= self._dirs_changes:
            return 0
        return self._dirs_changes

    def dirs_synced(self, change: int) -> bool:
        """Whether the durable copy holds change ``change`` of the directory list."""
        return self._dirs_synced >= change

    def dirs_to_sync(self) -> tuple[str, int]:
        """The directory list as the tree holds it now (JSON, ``dirs.json``'s shape) and the
        change it reflects, for ``write_dirs_durably`` in a worker thread, which the caller
        starts now (``dirs_writing`` is set until it ends). Not while one runs."""
        assert not self.dirs_writing
        self.dirs_writing = True
        return json.dumps(self._dirs_state()), self._dirs_changes

    def write_dirs_durably(self, text: str, change: int) -> None:
        """Blocking, for a worker thread (``Filesystem.fsyncdir``): write the directory list
        ``text`` (``dirs_to_sync``) to ``dirs.synced.json`` beside ``dirs.json`` (a temporary
        file of its own, mode 0600, fsynced, renamed over it unless a newer list was), then
        fsync the cache directory, so the list as of ``change`` survives a power cut
        (``load_dirs``). Clears ``dirs_writing`` when it ends. Raises ``OSError`` (the
        temporary file removed)."""
        assert self.dirs_file is not None
        path = synced_dirs_file(self.dirs_file)
        tmp = path.with_name(f".{path.name}.{next(_TMP_SEQ)}.tmp")
        try:
            write_private(tmp, text, sync=True)
            with self._dirs_rename_lock:
                if change <= self._dirs_synced:
                    return  # (the temporary file is removed below)
                os.replace(tmp, path)
                fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                self._dirs_synced = change
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
            self.dirs_writing = False

    def _dirs_state(self) -> dict[str, Any]:
        """The directory list as the tree holds it now (``save_dirs``, ``dirs_to_sync``):
        the mounted stores' from their trees; every other store's (not loaded yet: an
        offline start mounts a store whose saved mirror is unreadable only once the control
        plane answers; or taken out of the mount) carried over as the list last read or
        written had it (``saved_dirs``), as its rejected and local-only files are kept until
        it is mounted again. Before, a list written while a store was not mounted lacked its
        directories: a directory's fsync made that list durable, of a higher generation
        than ``dirs.json``, and the next start lost them; a mkdir dropped them at once.
        A mounted store's list holds the directories made here (``Node.made``: mkdir, or
        kept from the list at load), not those only implied by records: listed, one emptied
        elsewhere while the store was out of the mount or the sidecar down came back as an
        empty directory made here (review27 R4), though an emptied implied directory leaves
        no empty shell. Modes are kept for every directory (``DIR_MODES_KEY``), applied
        when it is there."""
        out: dict[str, Any] = {}
        modes: dict[str, dict[str, int]] = {}
        saved = self.saved_dirs
        was = saved.get(STORE_CREATED_KEY)
        was_modes = saved.get(DIR_MODES_KEY)
        created: dict[str, str] = {}
        was_made_only = saved.get(DIRS_MADE_ONLY_KEY)
        made_only = set(self.stores)
        for slug, kept in saved.items():
            if slug in _DIRS_META or slug in self.stores or not isinstance(kept, list):
                continue
            out[slug] = kept
            if isinstance(was_made_only, list) and slug in was_made_only:
                made_only.add(slug)
            kept_modes = was_modes.get(slug) if isinstance(was_modes, dict) else None
            if isinstance(kept_modes, dict) and kept_modes:
                modes[slug] = kept_modes
            kept_in = was.get(slug) if isinstance(was, dict) else None
            if isinstance(kept_in, str) and kept_in:
                created[slug] = kept_in
        for slug, sm in self.stores.items():
            made_in = sm.created or (was.get(slug) if isinstance(was, dict) else None)
            if made_in:
                created[slug] = made_in
            paths: list[str] = []
            chmodded = {"": stat.S_IMODE(sm.root.mode)} if stat.S_IMODE(sm.root.mode) != DIR_MODE else {}
            stack = [sm.root]
            while stack:
                d = stack.pop()
                for c in (d.children or {}).values():
                    if c.is_dir:
                        if c.made:
                            paths.append(c.path())
                        stack.append(c)
                        if stat.S_IMODE(c.mode) != DIR_MODE:
                            chmodded[c.path()] = stat.S_IMODE(c.mode)
            out[slug] = sorted(paths)
            if chmodded:
                modes[slug] = chmodded
        out[DIR_MODES_KEY] = modes
        out[STORE_CREATED_KEY] = created
        out[DIRS_GENERATION_KEY] = self._dirs_generation + self._dirs_changes
        out[DIRS_MADE_ONLY_KEY] = sorted(made_only)
        return out

    def _save_dirs_logged(self) -> None:
        """``save_dirs`` after a change that already happened (rmdir, rename, a directory's
        chmod): a failure is logged and counted; an empty directory may then reappear, or be
        missing, or lose its mode, after a restart (the list is written again at the next
        change)."""
        try:
            self.save_dirs()
        except CacheError as err:
            log.warning("directory list not saved", extra={"reason": err.reason})


#: the keys of a directory list that are not a store's slug
_DIRS_META = frozenset((DIR_MODES_KEY, STORE_CREATED_KEY, DIRS_GENERATION_KEY, DIRS_MADE_ONLY_KEY))

#: numbers the temporary files of ``write_dirs_durably``
_TMP_SEQ = itertools.count(1)


def synced_dirs_file(dirs_file: Path) -> Path:
    """The durable copy of the directory list ``dirs_file`` (``dirs.synced.json``)."""
    return dirs_file.with_suffix(".synced.json")


def _generation(saved: dict[str, Any]) -> int:
    """A directory list's generation (``DIRS_GENERATION_KEY``; 0 for none or a list written
    before it existed)."""
    g = saved.get(DIRS_GENERATION_KEY)
    return g if isinstance(g, int) and not isinstance(g, bool) and g >= 0 else 0


def load_dirs(dirs_file: Path) -> dict[str, Any]:
    """The directory list a previous process kept: of ``dirs_file`` (``dirs.json``, written at
    every change, not fsynced) and the durable copy the last fsync of a directory wrote
    (``dirs.synced.json``), the readable one of the higher generation (``dirs.json`` on a
    tie): after a power cut ``dirs.json`` may be unreadable (its name kept, its bytes
    dropped) or an older list (its rename lost), and the durable copy then holds what a
    directory's fsync promised. None readable: a WARNING (empty directories made earlier are
    not restored) when one was there."""
    damaged = False
    best: dict[str, Any] | None = None
    for path in (dirs_file, synced_dirs_file(dirs_file)):
        try:
            saved = json.loads(path.read_text())
        except FileNotFoundError:
            continue
        except (OSError, ValueError):
            damaged = True
            continue
        if not isinstance(saved, dict):
            damaged = True
            continue
        if best is None or _generation(saved) > _generation(best):
            if best is not None or damaged:
                log.warning("directory list in the cache is unreadable or older than its copy "
                            "the last fsync of a directory made (a power cut?); that copy is used",
                            extra={"file": str(dirs_file)})
            best = saved
    if best is not None:
        return best
    if damaged:
        log.warning("directory list in the cache is unreadable; empty directories "
                    "made earlier are not restored", extra={"file": str(dirs_file)})
    return {}
