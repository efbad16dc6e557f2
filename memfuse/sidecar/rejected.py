"""Rejected files kept across restarts: the part of ``core.Filesystem`` that remembers them.

A file whose content the control plane (or the sidecar's own checks) refused for good keeps
that content locally with ``state=rejected`` (docs/SEMANTICS.md, "Writes and close"), so the
agent can fix it in place. A local disk would not lose such a file on a reboot, so neither
does memfuse: every rejected file of a mounted store is kept in the outbox journal's
``rejected`` table (``journal.Journal.replace_rejected``: the same SQLite file, fsynced, written
in order with the outbox entries) with its store, path, node key, errno, reason code, reason,
content, record id, type override, mode and explicit mtime. At the next start each store is
restored from that table right after it is loaded (``add_store``): the file is back at its
path, still ``rejected`` with its reason (in ``user.memfuse.error`` and in ``errors.log``,
whose lines the journal keeps too: ``control.ControlFiles.note_restored``), and nothing is sent
until it changes (a new write commits as usual; unlink drops it).

Shape: ``Filesystem._rejected`` maps each rejected node to ``(errno, code)``;
``sync_rejected()`` compares what would be written with what was written last
(``_rejected_saved``: node key → signature) and queues a replacement of the store's rows only
when something changed (a rejection, a fix, an unlink, a rename, a chmod). It is called after
commits and namespace changes, and every 2 s by the sidecar's saver (remote changes that
replace a rejected file). Nothing here awaits; everything runs on the trio thread.
"""
from __future__ import annotations

import errno
import logging
import stat
import time
from typing import TYPE_CHECKING, Any

from ..errors import CODE_BY_ERRNO
from ..defs import sha256_hex
from .cachedir import CacheError
from .inodes import REJECTED, FsError, Node, StoreMount
from .journal import new_key

if TYPE_CHECKING:
    from .blobcache import BlobCache
    from .control import ControlFiles
    from .journal import Journal

log = logging.getLogger("memfuse.fs")


class RejectedFiles:
    """Persistence of rejected files (module docstring); mixed into ``core.Filesystem``,
    whose ``__init__`` calls ``_init_rejected``."""

    # what this part uses of the filesystem (declared here, S3QL style; created by
    # ``Filesystem.__init__``)
    by_key: dict[str, Node]
    by_rid: dict[str, Node]
    stores: dict[str, StoreMount]
    blobs: BlobCache
    journal: Journal
    controls: ControlFiles

    if TYPE_CHECKING:  # what this part calls of the other parts of ``core.Filesystem``
        def _account(self, n: Node, delta: int) -> None: ...

        def _content(self, n: Node) -> bytes: ...

        def _ensure_dir(self, sm: StoreMount, parts: list[str], ts: int,
                        inv: list[tuple[Any, ...]] | None = None) -> Node | None: ...

        def _live(self, n: Node, sign: int) -> None: ...

        def _new_node(self, name: str, parent: Node | None, is_dir: bool, store: StoreMount | None,
                      mode: int, now_ns: int, uid: int | None = None, gid: int | None = None) -> Node: ...

        def note_error(self, where: Node | None, name: str, err: int, reason: str,
                       code: str = "", store: str = "") -> None: ...

        def invalidate(self, items: list[tuple[Any, ...]]) -> None: ...

    def _init_rejected(self, saved: list[dict[str, Any]] | None) -> None:
        self._rejected: dict[Node, tuple[int, str]] = {}  # node -> (errno, code)
        # node -> (version, what) of each remote change kept out of it (remote.py)
        self._rejected_remote: dict[Node, set[tuple[int, str]]] = {}
        self._rejected_saved: dict[str, tuple[Any, ...]] = {}  # node key -> signature written
        self._rejected_rows: dict[str, dict[str, Any]] = {}  # node key -> row written
        # rows a previous process kept, by store, until the store is loaded
        self._rejected_restore: dict[str, list[dict[str, Any]]] = {}
        for row in saved or ():
            self._rejected_restore.setdefault(row["store"], []).append(row)

    def _mark_rejected(self, n: Node, err: int, code: str) -> None:
        """``n`` was refused for good with ``err`` / ``code``: keep it (``sync_rejected``)."""
        self._rejected[n] = (err, code or CODE_BY_ERRNO.get(err, ""))

    def rejected_files(self, sm: StoreMount | None = None) -> list[Node]:
        """The live rejected files, of one store or (``sm`` None) of all."""
        return [n for n in self._rejected if n.state == REJECTED and not n.unlinked
                and not n.local_only and n.store is not None and not n.store.detached
                and (sm is None or n.store is sm)]

    def _rejected_row(self, n: Node, err: int, code: str) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        prev = self._rejected_rows.get(n.key)
        if n.dirty:  # being rewritten: the content refused last stays kept until judged
            return (self._rejected_saved[n.key], prev) if prev is not None else None
        data = self._content(n)
        assert n.store is not None  # a file of a store
        sig = (n.store.slug, n.path(), err, code, n.error, sha256_hex(data), n.record_id,
               n.type_override, stat.S_IMODE(n.mode), n.xmtime)
        if prev is not None and self._rejected_saved.get(n.key) == sig:
            return sig, prev
        row = {"node_key": n.key, "store": n.store.slug, "path": n.path(), "errno": err,
               "code": code, "reason": n.error, "content": data, "record_id": n.record_id,
               "type": n.type_override, "mode": stat.S_IMODE(n.mode), "mtime_ns": n.xmtime,
               "created": prev["created"] if prev else time.time()}
        return sig, row

    def aside_place(self, sm: StoreMount, path: str) -> tuple[Node, str]:
        """Where content of ``path`` (store-relative) that the tree cannot show there (its
        path, or a directory on it, taken by a record or a directory made elsewhere) is kept
        beside it, never dropped: the deepest directory of ``path`` the tree has and a free
        name there, ``<stem>.rejected<ext>`` (``notes/x.md`` → ``x.rejected.md``; then
        ``.rejected-2``...; at most 255 bytes). The one naming rule of every file kept aside:
        refused writes (``keep_aside``) and local-only files (``LocalFiles``)."""
        parts = path.split("/")
        d = sm.root
        for comp in parts[:-1]:
            assert d.children is not None  # a directory
            child = d.children.get(comp)
            if child is None or not child.is_dir:
                break
            d = child
        assert d.children is not None  # a directory
        base = parts[-1]
        stem, dot, ext = base.rpartition(".")
        stem, ext = (stem, "." + ext) if dot and stem else (base, "")
        name, i = "", 1
        while not name or name in d.children:
            tag = ".rejected" + (f"-{i}" if i > 1 else "")
            room = 255 - len((tag + ext).encode())
            name = stem.encode()[:room].decode("utf-8", "ignore") + tag + ext
            i += 1
        return d, name

    def note_kept_aside(self, n: Node, path: str, why: str) -> None:
        """File ``n`` (a local-only or rejected file: state that exists only here) could
        not be put at its path ``path`` (``why``: what holds it) and was put at
        ``aside_place`` instead: one line in ``errors.log`` (the new path, ``EEXIST`` and
        ``local_file_kept_aside`` for a local-only file, else its refusal's errno and code;
        a reason naming ``path``) and a WARNING log line; never the content."""
        assert n.store is not None and n.parent is not None  # a file of the tree
        sm, kept = n.store, n.path()
        if n.local_only:
            err, code = errno.EEXIST, "local_file_kept_aside"
            what = "a local-only file (kept here, never sent)"
        else:
            err, code = self._rejected.get(n, (errno.EEXIST, ""))
            what = f"a rejected file ({n.error})"
        self.note_error(n.parent, n.name, err,
                        f"{path}, {what}, could not be put back at its path: {path} is {why} "
                        f"here; it is kept in this file as it was; rename it to use it, "
                        f"delete it when done", code, sm.slug)
        log.warning("file kept aside: its path is taken here",
                    extra={"store": sm.slug, "path": path, "kept": kept, "code": code})

    def keep_aside(self, sm: StoreMount, path: str, data: bytes, err: int, code: str,
                   reason: str, why: str, *, mode: int | None = None, type_: str | None = None,
                   mtime_ns: int | None = None, restoring: bool = False) -> str:
        """A refused write of ``path`` (store-relative) that the tree cannot show there
        (``why``: a directory made elsewhere holds the path, or a file crosses it) is kept
        as a new rejected file beside it, never dropped (at ``aside_place``), with
        ``data``, ``state=rejected``, ``err`` / ``code``, a reason naming ``path``, and
        kept across restarts like any rejected file. Not sent until it changes; writing it
        (or copying it) to a free path commits it. One line in ``errors.log`` (the kept
        file's path, ``err``, ``code``, the reason). ``restoring``: called while a store's
        rejected rows are put back (``_restore_rejected``, which writes them all once done:
        a write now would replace the store's rows before the rest are back). Returns the
        kept file's path."""
        d, name = self.aside_place(sm, path)
        now = time.time_ns()
        n = self._new_node(name, d, False, sm, mode if mode is not None else 0o644, now)
        n.key = "n:" + new_key()
        self.by_key[n.key] = n
        self._live(n, +1)
        sha = sha256_hex(data)
        self.blobs.put(data, sha)
        n.sha, n.size, n.buf = sha, len(data), None
        self._account(n, len(data))
        n.xmtime, n.type_override = mtime_ns, type_
        kept = n.path()
        n.state, n.error, n.dirty, n.last_put = REJECTED, (
            f"a write of {path} was refused ({reason}) and {path} is {why} here: its content "
            f"is kept in this file, not sent; write or copy it to a free path to commit it, "
            f"delete it when done"), False, None
        self._rejected[n] = (err, code or CODE_BY_ERRNO.get(err, ""))
        self.note_error(d, name, err, n.error, code, sm.slug)
        if not restoring:
            self.sync_rejected()
            self.invalidate([("entry", d.ino, name)])
        log.warning("refused write kept aside: its path is taken here",
                    extra={"store": sm.slug, "path": path, "kept": kept,
                           "errno": errno.errorcode.get(err, str(err)), "code": code})
        return kept

    def sync_rejected(self) -> None:
        """Write the rejected files of the mounted stores to the journal when they changed
        since the last call (a rejection, a fix, an unlink, a rename, a chmod). Queued in
        order with the outbox entries; never blocks, never raises for the disk (the journal
        retries a failed write)."""
        if not self._rejected and not self._rejected_saved:
            return
        sigs: dict[str, tuple[Any, ...]] = {}
        rows: dict[str, dict[str, Any]] = {}
        for n in list(self._rejected):
            if n.state != REJECTED or n.unlinked or n.local_only or n.store is None:
                del self._rejected[n]
                self._rejected_remote.pop(n, None)
                continue
            if n.store.detached:  # its rows stay as they are until it is mounted again
                continue
            try:
                got = self._rejected_row(n, *self._rejected[n])
            except (CacheError, FsError):  # its content unreadable or damaged in the blob
                # cache (core.ContentMissing): the row the journal holds stays
                log.warning("rejected file's content unreadable in the blob cache; its saved "
                            "row is kept", extra={"store": n.store.slug, "path": n.path()})
                prev, row = self._rejected_saved.get(n.key), self._rejected_rows.get(n.key)
                got = (prev, row) if prev is not None and row is not None else None
            if got is not None:
                sigs[n.key], rows[n.key] = got
        mounted = set(self.stores)
        kept = {k: s for k, s in self._rejected_saved.items() if s[0] not in mounted}
        if {**kept, **sigs} == self._rejected_saved:
            return
        changed = {s[0] for s in sigs.values()} | {
            s[0] for k, s in self._rejected_saved.items() if s[0] in mounted and sigs.get(k) != s}
        self.journal.replace_rejected(
            sorted(changed), [r for r in rows.values() if r["store"] in changed])
        self._rejected_saved = {**kept, **sigs}
        self._rejected_rows = {k: r for k, r in {**self._rejected_rows, **rows}.items()
                               if k in self._rejected_saved}

    def _restore_rejected(self, sm: StoreMount) -> None:
        """Put back the rejected files a previous process kept for store ``sm`` (just
        loaded): at their path, with their content, ``state=rejected`` and the reason. A
        file whose path now holds another record or a directory, or crosses a file, is kept
        beside it instead (``keep_aside``), named in ``errors.log`` and the log.

        A store mounted again in the same process (detached, then attached) gets back the
        rejected files it had when it was taken out of the mount."""
        rows = self._rejected_restore.pop(sm.slug, None)
        if rows is None:
            rows = [r for r in self._rejected_rows.values() if r["store"] == sm.slug]
            for n in [n for n in self._rejected if n.store is not None
                      and n.store.slug == sm.slug and n.store is not sm]:
                del self._rejected[n]  # the nodes of the earlier mount of this store
        aside = False
        for row in rows:
            try:
                aside = self._restore_one(sm, row) or aside
            except Exception:  # a bad row must not stop the mount
                log.exception("rejected file not restored", extra={"store": sm.slug,
                                                                   "path": row.get("path")})
        if aside:  # the rows of the files kept beside their path, every other one with them
            self.sync_rejected()

    def _restore_one(self, sm: StoreMount, row: dict[str, Any]) -> bool:
        """Put back one rejected row of ``sm``; True when it was kept beside its path."""
        data: bytes = row["content"]
        path: str = row["path"]
        parts = path.split("/")
        n = self.by_rid.get(row["record_id"]) if row["record_id"] else None
        if n is not None and (n.unlinked or n.store is not sm or n.is_dir):
            n = None
        if n is None:
            d = self._ensure_dir(sm, parts[:-1], time.time_ns())
            cur = d.children.get(parts[-1]) if d is not None and d.children is not None else None
            if d is None or (cur is not None and (cur.is_dir or cur.record_id != row["record_id"]
                                                  or cur.record_id is None)):
                why = ("crossed by a file" if d is None else "a directory" if cur is not None
                       and cur.is_dir else "another record's path")
                # its row goes at the next sync_rejected (a signature nothing matches); the
                # content stays, beside it (a new rejected file, with a row of its own)
                self._rejected_saved[row["node_key"]] = (sm.slug, "moved aside")
                self._rejected_rows.pop(row["node_key"], None)
                self.keep_aside(sm, path, data, row["errno"], row["code"], row["reason"], why,
                                mode=row["mode"], type_=row["type"], mtime_ns=row["mtime_ns"],
                                restoring=True)
                return True
            n = cur
        if n is None:
            n = self._new_node(parts[-1], d, False, sm, row["mode"] or 0o644, time.time_ns())
            n.key = row["node_key"]
            self.by_key[n.key] = n
            self._live(n, +1)
        old = n.cur_size()
        sha = sha256_hex(data)
        self.blobs.put(data, sha)
        n.sha, n.size, n.buf = sha, len(data), None
        self._account(n, len(data) - old)
        if row["mode"] is not None:
            n.mode = stat.S_IFREG | stat.S_IMODE(row["mode"])
        n.xmtime = row["mtime_ns"]
        n.type_override = row["type"]
        n.state, n.error, n.dirty, n.last_put = REJECTED, row["reason"], False, None
        n.mtime_ns = n.ctime_ns = int(row["created"] * 1e9) if n.xmtime is None else n.xmtime
        self._rejected[n] = (row["errno"], row["code"])
        saved = self._rejected_row(n, row["errno"], row["code"])
        assert saved is not None  # not dirty: a row is made
        self._rejected_saved[n.key] = saved[0]
        self._rejected_rows[n.key] = row
        # errors.log still says why (its line kept in the journal, else written again)
        self.controls.note_restored(sm.slug, path, row["errno"], row["code"], row["reason"],
                                    row["created"])
        log.info("rejected file kept from before the restart",
                 extra={"store": sm.slug, "path": path,
                        "errno": errno.errorcode.get(row["errno"], row["errno"]),
                        "code": row["code"]})
        return False
