"""Local-only files kept across restarts: the part of ``core.Filesystem`` that persists them.

Files with a local-only name (editor and tool temporaries: ``*~``, ``.*.swp``, ``4913``,
``.#*``, ``#*#``, ``.goutputstream-*``, ``.~lock.*#``; ``Settings.local_only_patterns``) are
never sent to the control plane (docs/SEMANTICS.md, "Local-only files"). A local disk would
not lose them on a reboot, so neither does memfuse: each one is kept in the outbox journal's
``local_files`` table (``journal.Journal.put_local``: the same SQLite file as the outbox,
``synchronous=FULL``, written in order with the outbox entries) with its store, path, node
key, content, mode and mtime. ``close(2)`` / ``fsync(2)`` of a written local-only file return
once its row is on disk (``journal.Barrier``), as a record's close returns once its change is
accepted; a full cache disk is ``ENOSPC`` at close. At the next start each store gets its
local-only files back right after it is loaded (``add_store``), with ``state=local``.

Shape: ``_local`` is the set of local-only nodes; ``sync_local()`` compares each one's
signature (store, path, sha256, mode, mtime) with what was written last (``_local_saved``:
node key → signature) and queues per-file writes: the whole row when the content changed, an
``UPDATE`` of path / mode / mtime when only they did (a rename, a chmod), a ``DELETE`` for a
file gone (unlinked, renamed onto a normal name and now a record, replaced). It is called after
each local-only commit and namespace change, and every 2 s by the sidecar's saver (a remote
record moved over one). A file being written (``dirty``) keeps its last row until its close.
Rows of a store taken out of the mount stay as they are; a store mounted again in the same
process gets its files back from the rows taken when it was removed (``take_local``).

Limits: local-only files share the store's byte quota with its records in this sidecar (as
temporaries share a disk with the files they belong to): ``StoreMount.local_used`` counts
their bytes, and a write that would take records plus local-only files past
``max_store_bytes`` is refused with ``ENOSPC`` (``limits.WriteLimits._check_growth``). Their
number (``local_count``) is bounded by ``max_records`` on its own, so a store full of records
still lets an editor make its swap and backup files (in-place edits keep working at the
record limit). There is no per-file ``EFBIG`` (a vim swap file of a record near
``max_record_bytes`` is a little larger than the record). Nothing here awaits;
everything runs on the trio thread.
"""
from __future__ import annotations

import errno
import logging
import stat
import time
from typing import TYPE_CHECKING, Any

from ..defs import sha256_hex
from .inodes import FsError, Node, StoreMount
from .cachedir import CacheError
from .journal import new_key

if TYPE_CHECKING:
    from .journal import Journal

log = logging.getLogger("memfuse.fs")


class LocalFiles:
    """Persistence of local-only files (module docstring); mixed into ``core.Filesystem``,
    whose ``__init__`` calls ``_init_local``."""

    # what this part uses of the filesystem (declared here, S3QL style; created by
    # ``Filesystem.__init__``)
    by_key: dict[str, Node]
    stores: dict[str, StoreMount]
    journal: Journal

    if TYPE_CHECKING:  # what this part calls of the other parts of ``core.Filesystem``
        def aside_place(self, sm: StoreMount, path: str) -> tuple[Node, str]: ...

        def note_kept_aside(self, n: Node, path: str, why: str) -> None: ...

        def _content(self, n: Node) -> bytes: ...

        def _ensure_dir(self, sm: StoreMount, parts: list[str], ts: int,
                        inv: list[tuple[Any, ...]] | None = None) -> Node | None: ...

        def _hold_content(self, n: Node, data: bytes, sha: str, what: str) -> None: ...

        def _live(self, n: Node, sign: int) -> None: ...

        def _new_node(self, name: str, parent: Node | None, is_dir: bool, store: StoreMount | None,
                      mode: int, now_ns: int, uid: int | None = None, gid: int | None = None) -> Node: ...

        def note_error(self, where: Node | None, name: str, err: int, reason: str,
                       code: str = "", store: str = "") -> None: ...

    def _init_local(self, saved: list[dict[str, Any]] | None) -> None:
        self._local: set[Node] = set()
        self._local_saved: dict[str, tuple[Any, ...]] = {}  # node key -> signature written
        # rows a previous process kept (or a store removed from the mount had), by store,
        # until the store is loaded
        self._local_restore: dict[str, list[dict[str, Any]]] = {}
        for row in saved or ():
            self._local_restore.setdefault(row["store"], []).append(row)
            self._local_saved[row["node_key"]] = (row["store"], "kept")

    def _local_sig(self, n: Node) -> tuple[Any, ...]:
        # the content is the blob ``sha``, or the buffer when the blob cache could not take it
        sha = sha256_hex(bytes(n.buf)) if n.buf is not None else n.sha
        assert n.store is not None  # a file of a store
        return (n.store.slug, n.path(), sha, stat.S_IMODE(n.mode), n.mtime_ns)

    def _local_row(self, n: Node) -> dict[str, Any]:
        assert n.store is not None  # a file of a store
        return {"node_key": n.key, "store": n.store.slug, "path": n.path(),
                "content": self._content(n), "mode": stat.S_IMODE(n.mode),
                "mtime_ns": n.mtime_ns, "created": time.time()}

    def save_local(self, n: Node) -> None:
        """Store the content of local-only file ``n`` (closed, or fsynced) in the blob
        cache (reads are served from there; on a cache-disk failure it stays in memory)
        and queue its row (``sync_local``)."""
        if n.buf is not None:
            data = bytes(n.buf)
            self._hold_content(n, data, sha256_hex(data), "the local-only file")
        self._local.add(n)
        self.sync_local()

    def sync_local(self) -> None:
        """Queue the journal writes that make the ``local_files`` table match the live
        local-only files of the mounted stores (module docstring). Never blocks, never raises
        for the disk (the journal retries a failed write)."""
        if not self._local and not self._local_saved:
            return
        journal = self.journal
        current: dict[str, tuple[Any, ...]] = {}
        for n in list(self._local):
            if n.unlinked or not n.local_only or n.store is None or n.store.detached:
                self._local.discard(n)
                continue
            prev = self._local_saved.get(n.key)
            if n.dirty:
                if prev is not None:
                    current[n.key] = prev  # being written: its last row stays until close
                continue
            sig = self._local_sig(n)
            current[n.key] = sig
            if prev == sig:
                continue
            if prev is not None and prev[0] == sig[0] and prev[2] == sig[2] and len(prev) == 5:
                journal.move_local(n.key, sig[1], sig[3], sig[4])
            else:
                try:
                    row = self._local_row(n)
                except (CacheError, FsError):  # its content unreadable or damaged in the blob
                    # cache (core.ContentMissing): the row the journal holds stays
                    log.warning("local-only file's content unreadable in the blob cache; its "
                                "saved row is kept", extra={"store": sig[0], "path": sig[1]})
                    if prev is not None:
                        current[n.key] = prev
                    else:
                        del current[n.key]
                    continue
                journal.put_local(row)
        mounted = self.stores
        for key, sig in list(self._local_saved.items()):
            if key not in current and sig[0] in mounted and not mounted[sig[0]].detached:
                journal.delete_local(key)
                del self._local_saved[key]
        self._local_saved.update(current)

    def take_local(self, sm: StoreMount) -> None:
        """Store ``sm`` is leaving the mount: keep its local-only files' rows in memory, so
        the store mounted again in this process gets them back (``_restore_local``)."""
        rows = []
        for n in list(self._local):
            if n.store is sm and not n.unlinked and n.local_only:
                try:
                    rows.append(self._local_row(n))
                except (CacheError, FsError):  # FsError: core.ContentMissing (damaged)
                    log.warning("local-only file not kept: its content is unreadable",
                                extra={"store": sm.slug, "path": n.path()})
                self._local.discard(n)
        self._local_restore[sm.slug] = rows

    def _restore_local(self, sm: StoreMount) -> None:
        """Put back the local-only files kept for store ``sm`` (just loaded): at their path,
        with their content, mode and mtime. One whose path now holds a record or a
        directory, or crosses a record (made elsewhere meanwhile), is put back beside it
        instead, never dropped: a local-only file at ``aside_place`` (``<stem>.rejected<ext>``),
        named in ``errors.log`` (``EEXIST``, ``local_file_kept_aside``: both paths, never the
        content) and the log; its row is replaced by the new file's."""
        aside = False
        for row in self._local_restore.pop(sm.slug, []):
            try:
                aside = self._restore_local_one(sm, row) or aside
            except Exception:  # a bad row must not stop the mount
                log.exception("local-only file not restored",
                              extra={"store": sm.slug, "path": row.get("path")})
        if aside:  # the kept file's row written, the old one deleted, in one go
            self.sync_local()

    def _restore_local_one(self, sm: StoreMount, row: dict[str, Any]) -> bool:
        """Put back one local-only row of ``sm``; True when it was kept beside its path."""
        path: str = row["path"]
        parts = path.split("/")
        now = time.time_ns()
        d = self._ensure_dir(sm, parts[:-1], now)
        cur = d.children.get(parts[-1]) if d is not None and d.children is not None else None
        key = row["node_key"]
        if d is None or cur is not None:
            why = ("crossed by a file" if d is None
                   else "a directory" if cur is not None and cur.is_dir else "a record's path")
            d, name = self.aside_place(sm, path)
            key = "n:" + new_key()
            self._local_saved[row["node_key"]] = (sm.slug, "moved aside")  # deleted at the sync
        else:
            name = parts[-1]
        data: bytes = row["content"]
        n = self._new_node(name, d, False, sm, row["mode"] & 0o7777, now)
        n.local_only = True
        n.key = key
        self.by_key[n.key] = n
        # in memory when the cache disk refuses it; written to the blob cache at the next close
        self._hold_content(n, data, sha256_hex(data), "a local-only file kept from before the restart")
        n.mtime_ns = n.ctime_ns = row["mtime_ns"]
        self._live(n, +1)
        self._local.add(n)
        if key != row["node_key"]:
            self.note_kept_aside(n, path, why)
            return True
        self._local_saved[n.key] = self._local_sig(n)
        return False
