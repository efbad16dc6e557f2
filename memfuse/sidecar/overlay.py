"""A backlog at start: the part of ``core.Filesystem`` that shows the outbox a previous
process left on top of the stores just loaded (docs/SEMANTICS.md, "A backlog drains behind
the mount"; INVARIANTS.md, "Crash states").

``OutboxOverlay.overlay_outbox`` applies the queued entries to the tree as the local
operations they were, before the mount serves and before ``Committer.replay`` queues them
again; nothing here awaits and no kernel invalidation is made (nothing is mounted yet).
"""
from __future__ import annotations

import logging
import stat
import time
from typing import TYPE_CHECKING, Any

from ..defs import sha256_hex
from .inodes import PENDING, REJECTED, FsError, Node, StoreMount, shared_mode
from .journal import ATTRS, DELETE, MOVE, MOVE_PREFIX, PUT, Entry

if TYPE_CHECKING:
    from ..wire import Record
    from .committer import Committer
    from .identity import RecordIds
    from .sync import Meta

log = logging.getLogger("memfuse.fs")


class OutboxOverlay:
    """The queued entries of a previous process shown on the tree at start (module
    docstring); mixed into ``core.Filesystem``."""

    # what this part uses of the filesystem (declared here, S3QL style; created by
    # ``Filesystem.__init__``)
    by_key: dict[str, Node]
    by_rid: dict[str, Node]
    stores: dict[str, StoreMount]
    ids: RecordIds
    committer: Committer
    # files that exist only here (local-only, rejected) taken off a path a queued change
    # passes through while ``overlay_outbox`` runs, with their store and path (``_unpark``)
    _parked: list[tuple[Node, StoreMount, str]]

    if TYPE_CHECKING:  # what this part calls of the other parts of ``core.Filesystem``
        def _account(self, n: Node, delta: int) -> None: ...

        def _detach(self, n: Node) -> None: ...

        def _ensure_dir(self, sm: StoreMount, parts: list[str], ts: int,
                        inv: list[tuple[Any, ...]] | None = None) -> Node | None: ...

        def _hold_content(self, n: Node, data: bytes, sha: str, what: str) -> None: ...

        def _cached_blob(self, sha: str) -> bytes | None: ...

        def _live(self, n: Node, sign: int) -> None: ...

        def _new_node(self, name: str, parent: Node | None, is_dir: bool, store: StoreMount | None,
                      mode: int, now_ns: int, uid: int | None = None, gid: int | None = None) -> Node: ...

        def node_by_key(self, key: str | None) -> Node | None: ...

        def _move_remote(self, sm: StoreMount, n: Node, path: str, rec: Record | Meta,
                         hidden: tuple[Meta, str] | None, quiet: bool = False
                         ) -> list[tuple[Any, ...]]: ...

        def invalidate(self, items: list[tuple[Any, ...]]) -> None: ...

        def _save_dirs_logged(self) -> None: ...

        def aside_place(self, sm: StoreMount, path: str) -> tuple[Node, str]: ...

        def note_kept_aside(self, n: Node, path: str, why: str) -> None: ...

        def _prune_implied(self, d: Node, inv: list[tuple[Any, ...]]) -> None: ...

    def overlay_outbox(self, entries: list[Entry]) -> int:
        """Show what the outbox a previous process left holds on top of the stores just
        loaded (the control plane's state), before the mount serves and while the backlog
        drains (docs/SEMANTICS.md, "A backlog drains behind the mount"): ``entries`` (in
        order, not yet sent again) are applied to the tree as the local operations they
        were: a ``put`` gives its file that content (a file created here gets a node with
        the entry's ``n:`` key), ``delete`` unlinks, ``move`` / ``move_prefix`` move (a
        file already at the target is replaced), ``attrs`` sets mode / mtime; a directory
        only records implied (not made here: ``Node.made``, from the directory list) that a
        delete or move leaves empty goes, as when a remote change empties it
        (``_prune_implied``: ``rm -rf d`` then a ``kill -9`` before the deletes committed
        showed ``d`` empty after the restart, verify27 F3). Each file
        with a queued put is ``pending`` with that put as ``last_put``, so its commit makes
        it clean as for a write of this process, and the feed (which waits until the
        store's outbox is empty) never shows an older version over it. A record's clean
        sha256 becomes the base of its update first (``RecordIds.note_default``, as
        ``commit`` does), so a rival change is merged, not taken for ours. Only each file's
        last content is read and hashed. Entries of stores not mounted are skipped (they
        still commit). Synchronous: call before the mount (no kernel invalidation is made),
        or on a store just built (``Filesystem.add_store`` of a store taken out with
        entries still queued: nodes the kernel has not seen). Returns the number of entries
        applied."""
        last: dict[int, tuple[Node, Entry]] = {}  # ino -> (file, its last queued put)
        applied = 0
        self._parked = []
        for e in entries:
            sm = self.stores.get(e.store)
            if sm is None or sm.root.children is None:
                continue
            a = e.args
            try:
                if e.op == MOVE_PREFIX:
                    self._overlay_move(sm, self._node_at(sm, a.get("from", "")), a.get("to", ""), e)
                    applied += 1
                    continue
                n = self._overlay_node(sm, e.node_key)
                if e.op == PUT:
                    if n is None:
                        n = self._overlay_file(sm, a.get("path", ""), e)
                        if n is None:
                            continue
                    if n._key is None and n.sha:
                        self.ids.note_default(n.key, n.record_id, n.sha)  # the base of the update
                    if a.get("mode") is not None:
                        n.mode = shared_mode(stat.S_IFREG | stat.S_IMODE(a["mode"]))
                    if a.get("type") is not None:
                        n.type_override = a["type"]
                    n.xmtime = a.get("mtime_ns")
                    ts = int(e.created * 1e9)
                    n.ctime_ns = ts
                    n.mtime_ns = n.xmtime if n.xmtime is not None else ts
                    n.last_put = e
                    n.state, n.error = PENDING, ""
                    last[n.ino] = (n, e)
                elif n is None:
                    continue
                elif e.op == DELETE:
                    n.dirty = False
                    was_in = n.parent
                    self._detach(n)
                    last.pop(n.ino, None)
                    if was_in is not None:  # a directory only its records implied goes
                        self._prune_implied(was_in, [])
                elif e.op == MOVE:
                    self._overlay_move(sm, n, a.get("to", ""), e)
                elif e.op == ATTRS:
                    if a.get("mode") is not None:
                        n.mode = shared_mode(stat.S_IFREG | stat.S_IMODE(a["mode"]))
                    if "mtime_ns" in a:
                        n.xmtime = a["mtime_ns"]
                        n.mtime_ns = n.xmtime if n.xmtime is not None else n.updated_ns
                applied += 1
            except (FsError, KeyError, TypeError, ValueError) as exc:  # a shape the tree cannot take
                log.warning("a queued change could not be shown before it commits",
                            extra={"store": e.store, "op": e.op, "entry": e.id, "error": str(exc)})
        for n, e in last.values():
            if n.unlinked:
                continue
            self.committer.fill(e)
            if e.content is None and e.suffix_only is not None:
                continue  # an append whose base is gone here: shown once it commits
            data = e.content or b""
            if self._superseded(n, data):
                log.info("a queued write is older than the store's newest version; showing the "
                         "newest until its answer", extra={"store": e.store, "entry": e.id,
                                                           "record": n.record_id, "version": n.version})
                continue
            old = n.cur_size()
            self._hold_content(n, data, sha256_hex(data), "a queued write")
            self._account(n, n.cur_size() - old)
        self._unpark()
        return applied

    def _unpark(self) -> None:
        """Put the files parked by ``_overlay_place`` back: each at its own path when the
        queued changes left it free (they passed through it before the file was made
        there), else beside it (``aside_place``, named in ``errors.log``); never dropped."""
        parked, self._parked = self._parked, []
        for n, sm, path in parked:
            parts = path.split("/")
            d = self._ensure_dir(sm, parts[:-1], time.time_ns())
            cur = d.children.get(parts[-1]) if d is not None and d.children is not None else None
            if d is None or cur is not None:
                why = ("crossed by a file" if d is None else "a directory" if cur is not None
                       and cur.is_dir else "a queued change's file")
                d, name = self.aside_place(sm, path)
            else:
                why, name = "", parts[-1]
            assert d.children is not None  # a directory
            n.parent, n.name = d, name
            d.children[name] = n
            if why:
                self.note_kept_aside(n, path, why)

    def _show_unshown_move(self, e: Entry) -> None:
        """A queued ``move_prefix`` the tree could not show at start (``Entry.unshown``)
        committed: each record its answer moved is moved in the tree to the path the control
        plane gave it (``RemoteApply._move_remote``: a directory there, or a file with local
        changes, stays), then the source directory, when no file is left under it, goes
        (its directories grafted into the target's). The change feed cannot bring this: it
        leaves this sidecar's own changes out. Makes the kernel invalidations."""
        sm = self.stores.get(e.store)
        if sm is None or sm.root.children is None:
            return
        inv: list[tuple[Any, ...]] = []
        moved = 0
        for rec in e.moved:
            n = self.by_rid.get(rec.id)
            if n is None or n.unlinked or n.store is not sm or n.path() == rec.path:
                continue
            inv += self._move_remote(sm, n, rec.path, rec, None)
            moved += 1
        src = self._node_at(sm, e.args.get("from", ""))
        if (src is not None and src is not sm.root and src.is_dir and src.parent is not None
                and _dirs_only(src)):
            dst = self._node_at(sm, e.args.get("to", ""))
            if dst is not None and dst.is_dir:
                self._graft_dirs(src, dst, inv)
            inv.append(("entry", src.parent.ino, src.name))
            self._detach(src)
        log.info("a queued move shown once committed",
                 extra={"store": e.store, "entry": e.id, "records": len(e.moved), "moved_here": moved})
        if inv:
            self._save_dirs_logged()
            self.invalidate(inv)

    def _superseded(self, n: Node, data: bytes) -> bool:
        """Whether the queued content ``data`` of file ``n`` is known to be older than the
        version of its record the store's mirror holds (``n``'s clean state, just loaded):
        that version extends ``data`` (starts with it and is longer). Then the queued put is a
        leftover that committed before the crash (its journal delete is lazy) and appends
        followed it, here or elsewhere: the file shows the newest of the two, the mirror's,
        from the first read (its replay is answered by its idempotency key as of the older
        version, ``Filesystem._show_newest``; were it not committed after all, its answer
        brings the merged content, ``_show_merged``). A mirror version that does not extend
        it cannot be told from a rival change the put is still to be merged onto: the queued
        content shows until the answer, as every acknowledged write does. Reads the mirror's
        blob only when it is longer than ``data``."""
        if n.record_id is None or not n.sha or n.buf is not None or n.size <= len(data):
            return False
        newest = self._cached_blob(n.sha)
        return newest is not None and newest.startswith(data)

    def _overlay_node(self, sm: StoreMount, key: str | None) -> Node | None:
        """The file of store ``sm`` a queued entry's node ``key`` names: by key, or (a file
        created by the previous process, ``n:<key>``, since committed) through the
        record id the key map holds for it; such a node takes the key back, as it had it in
        that process, so the entry's result finds it (``_on_commit``)."""
        n = self.node_by_key(key)
        if n is None and key:
            rid = self.ids.record_id(key)
            n = self.by_rid.get(rid) if rid else None
            if n is not None and not (n.unlinked or n.store is not sm or n.is_dir):
                if n._key and self.by_key.get(n._key) is n:
                    del self.by_key[n._key]
                n._key = key
                self.by_key[key] = n
        if n is not None and (n.unlinked or n.store is not sm or n.is_dir):
            return None
        return n

    def _node_at(self, sm: StoreMount, path: str) -> Node | None:
        """The node at store-relative ``path`` (None when absent or crossing a file)."""
        d: Node | None = sm.root
        for comp in path.split("/") if path else ():
            if d is None or d.children is None:
                return None
            d = d.children.get(comp)
        return d

    def _overlay_place(self, sm: StoreMount, path: str, keep: Node | None) -> tuple[Node, str] | None:
        """The directory and name for ``path`` (directories made where missing), after
        detaching whatever other than ``keep`` is there (a file, or an empty directory:
        the queued change replaced it). A directory there holding directories only (no
        file at any depth) is taken over by a directory ``keep``: its directories are
        grafted into ``keep`` where ``keep`` lacks them (``_graft_dirs``). None when the
        path crosses a file or lands on a directory that holds a file."""
        parts = path.split("/")
        d = self._ensure_dir(sm, parts[:-1], time.time_ns())
        if d is None or not parts[-1]:
            return None
        assert d.children is not None  # _ensure_dir gives a directory
        old = d.children.get(parts[-1])
        if old is not None and old is not keep:
            if not old.is_dir and (old.local_only or old.state == REJECTED):
                # state that exists only here (restored from its row, saved after the queued
                # change was made: that change passed through this path before): parked, put
                # back once the queue is shown (``_unpark``), never dropped
                self._parked.append((old, sm, old.path()))
                del d.children[parts[-1]]
                return d, parts[-1]
            if old.is_dir and old.children:
                if keep is None or not keep.is_dir or not _dirs_only(old):
                    return None
                # the directories a previous process saved (dirs.json) after it made this
                # move locally: the target's subdirectories, while the records (the control
                # plane's state, loaded) are still at the source (attack 12, A6)
                self._graft_dirs(old, keep)
            old.dirty = False
            self._detach(old)
        return d, parts[-1]

    def _graft_dirs(self, src: Node, into: Node, inv: list[tuple[Any, ...]] | None = None) -> None:
        """Move the directories under directory ``src`` (which holds no file) into directory
        ``into`` where ``into`` has nothing of that name, merging those of the same name;
        each entry made is added to ``inv`` (kernel invalidations) when given."""
        assert src.children is not None and into.children is not None  # directories
        for name, c in list(src.children.items()):
            there = into.children.get(name)
            if there is None:
                del src.children[name]
                c.parent = into
                into.children[name] = c
                if inv is not None:
                    inv.append(("entry", into.ino, name))
            elif there.is_dir:
                self._graft_dirs(c, there, inv)

    def _overlay_file(self, sm: StoreMount, path: str, e: Entry) -> Node | None:
        """A node for the file a queued ``put`` of ``e.node_key`` created (not in the
        tree the control plane gave), at ``path``."""
        place = self._overlay_place(sm, path, None)
        if place is None or not e.node_key:
            log.warning("a queued write's path is taken by a directory; shown once committed",
                        extra={"store": sm.slug, "entry": e.id})
            return None
        d, name = place
        n = self._new_node(name, d, False, sm, stat.S_IMODE(e.args.get("mode") or 0o644),
                           int(e.created * 1e9))
        n.key = e.node_key
        self.by_key[e.node_key] = n
        self._live(n, +1)
        return n

    def _overlay_move(self, sm: StoreMount, n: Node | None, to: str, e: Entry) -> None:
        """Move ``n`` (a file or a directory) to store-relative ``to`` for a queued move."""
        if n is None or n is sm.root or not to:
            return
        place = self._overlay_place(sm, to, n)
        if place is None:
            log.warning("a queued move's target is taken; shown once committed",
                        extra={"store": sm.slug, "entry": e.id})
            e.unshown = True  # its answer moves the files (``Filesystem._show_unshown_move``)
            return
        d, name = place
        a: Node | None = d
        while a is not None:  # never into itself
            if a is n:
                return
            a = a.parent
        assert n.parent is not None and n.parent.children is not None  # n is in the tree
        assert d.children is not None
        was_in = n.parent
        del n.parent.children[n.name]
        n.name, n.parent = name, d
        d.children[name] = n
        self._prune_implied(was_in, [])  # a directory only its records implied goes


def _dirs_only(d: Node) -> bool:
    """Whether directory ``d`` holds no file at any depth (directories only, or nothing)."""
    return all(c.is_dir and _dirs_only(c) for c in (d.children or {}).values())
