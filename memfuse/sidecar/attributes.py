"""File attributes and extended attributes of ``core.Filesystem``: ``setattr`` (truncate,
chmod, chown, utimensat) and the ``user.memfuse.*`` xattrs (docs/SEMANTICS.md, "Attributes"
and "Extended attributes"). Mixed into ``Filesystem``; every method is synchronous (no
``await``: the invariants of ``inodes.InodeTable`` hold after each).

Permission bits and the explicit mtime of a record are kept by the control plane: on a file
with unsent writes they ride with its next content commit; on a clean file a change queues
an ``attrs`` outbox entry (no content upload). Directory modes stay in this sidecar
(``dirs.json``); uid / gid are the mount's (a chown to another owner is ``EPERM``) and atime
is local (per mount).
"""
from __future__ import annotations

import errno
import stat
import time
from typing import TYPE_CHECKING, Callable, NoReturn

from .. import content as content_rules
from ..errors import errno_of
from ..defs import MODE_MASK, RECORD_TYPES, sha256_hex
from .inodes import DIRTY, REJECTED, FsError, Node
from .journal import ATTRS

if TYPE_CHECKING:
    from .committer import Committer
    from .inodes import Handle

__all__ = ["AttributeOps"]


class AttributeOps:
    """setattr and xattrs of ``core.Filesystem`` (module docstring); mixed into it."""

    # what this part uses of the filesystem (declared here, S3QL style; created by
    # ``Filesystem.__init__``)
    root: Node
    control: Node
    committer: Committer

    # ------------------------------------------------------------------ attributes
    if TYPE_CHECKING:  # what this part calls of the other parts of ``core.Filesystem``
        def _check_writable_file(self, n: Node) -> None: ...

        def _save_dirs_logged(self) -> None: ...

        def commit_quietly(self, n: Node) -> None: ...

        def handle(self, fh: int, *, allow_stale: bool = False) -> Handle: ...

        def rewriting(self, n: Node, h: Handle) -> None: ...

        def refuse(self, where: Node | None, name: str, err: int, reason: str, code: str = "") -> NoReturn: ...

        def sync_local(self) -> None: ...

        def truncate(self, n: Node, size: int, *, judge: bool = False) -> None: ...

    def setattr(self, n: Node, *, fh: int | None = None, size: int | None = None,
                mode: int | None = None, uid: int | None = None, gid: int | None = None,
                atime_ns: int | None = None, mtime_ns: int | None = None) -> None:
        """setattr: truncate to ``size`` bytes (through the open handle ``fh`` — ftruncate(2),
        which counts as a write of that handle's session — or by path, which commits at once
        since no close follows), chmod (``mode``: permission bits), chown (``uid`` / ``gid``;
        -1 leaves one as is), utimensat (``atime_ns`` / ``mtime_ns``, ns since the epoch); see
        ``_set_attributes`` for what reaches the control plane. Raises ``FsError``:
        ``EACCES`` on the root or ``.memfuse``, ``EROFS`` on a read-only store, ``EBADF`` /
        ``ESTALE`` for a bad handle, and the size refusals of ``truncate`` (``EFBIG``,
        ``ENOSPC``, ``EISDIR``)."""
        h = self.handle(fh) if fh is not None and size is not None else None
        if h is not None:
            h.modified = True
        by_path = size is not None and fh is None and n.opened == 0
        self._set_attributes(n, size=size, mode=mode, uid=uid, gid=gid, atime_ns=atime_ns,
                             mtime_ns=mtime_ns, judge=by_path)
        if h is not None and size == 0:
            # ftruncate(0) empties the file for a rewrite (vim's in-place save: open
            # O_WRONLY|O_CREAT, ftruncate(0), write, fsync, close): no handle holds a write
            # of its own until its next one, so no flush or release commits the emptied
            # file, nor the first of the rewrite's writes, before the rewrite's own close
            # (Filesystem.rewriting, Node.rewriters: a child the writer forked closes its
            # copy of the descriptor, a reader's or an earlier writer's release arrives
            # late; attack17 F10: the emptied file was committed mid-save, another mount's
            # append merged onto it, its lines lost)
            self.rewriting(n, h)
        if by_path:
            self.commit_quietly(n)  # truncate(2) by path: no close will follow to commit it

    @staticmethod
    def _check_chown(n: Node, uid: int | None, gid: int | None) -> None:
        """chown(2): owner and group are the mount's (``--uid`` / ``--gid``), the same for
        every file and across restarts, so only a chown to the current owner and group (or
        -1, "leave it") is accepted, as a no-op; any other is ``EPERM``, as a filesystem that
        cannot store owners answers (``tar x`` then reports "Cannot change ownership",
        instead of an owner shown until the next restart)."""
        keep = -1 & 0xFFFFFFFF
        for what, value, current in (("owner", uid, n.uid), ("group", gid, n.gid)):
            if value is not None and value != keep and value != current:
                raise FsError(errno.EPERM, f"the {what} of files on this mount is fixed "
                                           f"({current}, the mount's --{'uid' if what == 'owner' else 'gid'})")

    def _set_attributes(self, n: Node, *, size: int | None, mode: int | None,
                        uid: int | None, gid: int | None, atime_ns: int | None,
                        mtime_ns: int | None, judge: bool = False) -> None:
        """What ``setattr`` changes (truncate, chmod, chown, utimensat). Permission bits and
        mtime of a record are kept by the control plane: on a file with unsent writes (or a
        refused one) they ride with its next content commit; on a clean file a change queues an ``attrs``
        outbox entry (a metadata-only version, no content upload); a change to the current
        value queues nothing. Directory modes stay in this sidecar (``dirs.json``); uid/gid
        and atime are local (per mount)."""
        if n.special or n is self.root or n is self.control:
            raise FsError(errno.EACCES, "read-only")
        self._check_chown(n, uid, gid)  # first: a refused chown changes nothing
        if size is not None:
            self.truncate(n, size, judge=judge)
        if (n.store is not None and not n.store.writable
                and any(v is not None for v in (mode, uid, gid, atime_ns, mtime_ns))):
            raise FsError(errno.EROFS)
        changed: dict[str, int] = {}
        if mode is not None and stat.S_IMODE(mode) & ~MODE_MASK and not n.is_dir:
            # setuid / setgid / sticky: no record keeps them (the control plane refuses them)
            raise FsError(errno.EPERM, "setuid, setgid and sticky bits are not kept on memory files",
                          "validation_error")
        if mode is not None:
            new = stat.S_IFMT(n.mode) | stat.S_IMODE(mode)
            if new != n.mode:
                n.mode = new
                changed["mode"] = stat.S_IMODE(mode)
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
        if n.local_only and not n.unlinked:
            self.sync_local()  # the kept copy gets the new mode / mtime
            return
        if n.unlinked or n.store is None or n.dirty or n.state == REJECTED:
            return  # rides with the next content commit (commit() sends both)
        if "mtime_ns" not in changed and n.xmtime is None:
            # chmod(2) changes the ctime, not the mtime: pin the mtime this file shows, or the
            # record would show the chmod's version time (here after a restart, elsewhere)
            n.xmtime = changed["mtime_ns"] = n.mtime_ns
        self.committer.submit(n.store.slug, ATTRS, n.key, {"path": n.path(), **changed})

    # ------------------------------------------------------------------ xattrs
    #: each readable ``user.memfuse.<key>``'s value of a record file ('' when it has none),
    #: computed only for the key asked (``sha256`` of a file being written hashes its buffer)
    _XATTR_VALUES: dict[str, Callable[[Node], str]] = {
        "id": lambda n: n.record_id or "",
        "version": lambda n: str(n.version) if n.record_id else "",
        "sha256": lambda n: n.sha if n.buf is None else sha256_hex(bytes(n.buf)),
        # ``dirty``: written here since the last commit and not yet flushed (closed or
        # fsynced), so not in the outbox: the write state describes the content before it
        "state": lambda n: "local" if n.local_only else DIRTY if n.dirty else n.state,
        "updated_at": lambda n: n.updated_at,
        "error": lambda n: n.error,
        # a type set and not yet committed shows at once (read your write), by the record's
        # type rule (``content.record_type``: the explicit type wins, the root index has none)
        "type": lambda n: content_rules.record_type(n.path(), "", n.type_override, n.rtype) or "",
    }
    XATTRS = tuple(_XATTR_VALUES)

    def getxattr(self, n: Node, name: str) -> bytes:
        """The value of ``user.memfuse.<key>`` for a record file (``id``, ``version``, ``sha256``,
        ``state``, ``updated_at``, ``error``, ``type``) as UTF-8 bytes. Raises
        ``FsError(ENODATA)`` for other names, directories, control files and empty values."""
        if not name.startswith("user.memfuse."):
            raise FsError(errno.ENODATA)
        key = name[len("user.memfuse."):]
        if n.is_dir or n.special or key not in self.XATTRS:
            raise FsError(errno.ENODATA)
        value = self._XATTR_VALUES[key](n)
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
            self.refuse(n.parent, n.name, errno_of("invalid_type"), content_rules.TYPE_REFUSAL,
                        "invalid_type")
        if n.local_only:
            raise FsError(errno.ENOTSUP, "local-only files have no type")
        n.type_override = t
        n.dirty = True
        if n.opened == 0 or n.buf is None:
            self.commit_quietly(n)
