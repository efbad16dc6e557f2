"""The inode table of a memfuse mount: nodes, handles, stores, lookups.

``Node`` (one inode: a directory, a record file, a local-only file or a ``.memfuse`` control
file), ``StoreMount`` (an attached store as a directory at the mount root, with its limits and
live counters), ``Handle`` (an open file or directory), ``Settings`` (a mount's tunables),
``FsError`` (a refusal with an errno), and ``InodeTable``: the part of ``core.Filesystem``
that keeps the tables (``inodes``, ``by_key``, ``by_rid``, ``handles``) and answers lookups,
readdir, statfs and handle look-ups. Nothing here awaits; everything runs on the trio thread.

Kernel references: ``lookup`` and every readdirplus entry the kernel accepts (``looked_up``)
count one reference (``Node.nlookup``); ``forget`` gives them back. A node removed from the
tree (``unlinked``) leaves the tables once neither the kernel nor an open handle holds it.
"""
from __future__ import annotations

import enum
import errno
import logging
import os
import stat
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, Generic, Iterator, NoReturn, TypeVar

from .. import names
from ..durations import check_seconds
from ..errors import errno_of

if TYPE_CHECKING:
    from .appendbuf import WriteBuffer
    from .journal import Entry
    from .writecheck import WriteChecker

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


class WriteState(enum.StrEnum):
    """A file's write state, ``Node.state`` (mountpoint-s3's explicit upload state): where its
    current content stands with the control plane. Its value is what ``user.memfuse.state``
    and ``errors`` show (``"clean"``...; a ``StrEnum``, so it compares equal to that string).

    - ``CLEAN``: the content is the record's last known version (or a file never written).
    - ``PENDING``: a ``put`` of the content is in the outbox (``Node.last_put``, never None
      in this state), not yet answered.
    - ``REJECTED``: the content is refused for good (by ``_precheck``, a size limit of the
      write session, or the control plane); kept here, not sent, until rewritten.

    Transitions (each written once, where it happens; INVARIANTS.md "Write state"):
    CLEAN / PENDING / REJECTED → PENDING: ``commit`` submits a put (``overlay_outbox`` at
    start: a replayed put); PENDING → CLEAN: that put's success (``_on_commit``, when it is
    still ``last_put``); any → CLEAN: a remote version shown (``_set_clean``); any →
    REJECTED: a refused write or truncate of the session (``_check_size``, ``_check_growth``,
    ``_judge``), a commit refused here, the put refused by the control plane, a rejected file
    put back at start (``RejectedFiles``); PENDING → the state before the put: a put its
    close withdrew (``Filesystem._withdraw``: the cache disk refused it, no answer in time). Directories and control files stay CLEAN. The
    orthogonal ``Node.dirty`` says a write session changed the content since the last
    commit: the state then still describes the content before it, and ``user.memfuse.state``
    shows ``DIRTY`` ("dirty") instead (attack26 F3: it read ``clean`` for a file with unflushed
    writes, while ``cat`` showed them).
    """

    CLEAN = "clean"
    PENDING = "pending"
    REJECTED = "rejected"


CLEAN, PENDING, REJECTED = WriteState.CLEAN, WriteState.PENDING, WriteState.REJECTED
#: ``user.memfuse.state`` of a file with writes not yet flushed (``Node.dirty``): not a
#: ``WriteState`` (the write state is of the content last committed), only what it shows
DIRTY = "dirty"
DIR_MODE = 0o755  # permission bits of a directory nobody chmod-ed
DIR_MODES_KEY = "_modes"  # dirs.json: {slug: {dir path ("" = store root): mode}}; never a slug
#: dirs.json: {slug: the creation time of the store its directories were made in}; never a slug
STORE_CREATED_KEY = "_created"
#: dirs.json and its durable copy: the count of directory-list writes behind it, growing
#: across restarts; a start reads the readable file with the highest (``load_dirs``); never a slug
DIRS_GENERATION_KEY = "_generation"
#: dirs.json: the slugs whose lists hold only directories made here (``Node.made``:
#: review27 R4), every one of them made again at load; a store's list not named there
#: (written before) held every directory, implied ones too, and only those no record
#: implies are made again at load; never a slug
DIRS_MADE_ONLY_KEY = "_made_only"


_MODES: dict[int, int] = {}


def shared_mode(mode: int) -> int:
    """``mode`` as one shared ``int`` object per value (st_mode values are above CPython's
    small-int cache: 100,000 files of mode 0o100644 would hold 100,000 equal ints)."""
    return _MODES.setdefault(mode, mode) if len(_MODES) < 4096 else mode


#: errno -> ``os.strerror(errno)``, filled as met (a few dozen values at most)
_STRERROR: dict[int, str] = {}


class FsError(Exception):
    """A refusal with an errno (``errno.E*``), a reason for logs and ``errors.log`` and, for
    refusals of content or names, a machine ``code`` (the control plane's problem codes:
    ``secret_detected``, ``invalid_content``, ``record_too_large``...; "" when none)."""

    def __init__(self, err: int, reason: str = "", code: str = "") -> None:
        if not reason:  # (a negative lookup and the GETXATTR probe raise one per new file)
            reason = _STRERROR.get(err) or _STRERROR.setdefault(err, os.strerror(err))
        super().__init__(reason)
        self.errno = err
        self.reason = reason
        self.code = code

    @classmethod
    def of(cls, code: str, reason: str) -> FsError:
        """The refusal with problem ``code`` and its errno from the one table
        (``errors.ERRNO_BY_CODE``). Raises ``KeyError`` for a code the table does not hold."""
        return cls(errno_of(code), reason, code)

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


_V = TypeVar("_V")


class Children(dict[str, "Node"]):
    """A directory's entries, name -> ``Node``, counting its subdirectories as they come and
    go: ``dirs``, so the link count a GETATTR of the directory shows (``InodeTable.nlink``,
    asked by the kernel after every create in it) costs O(1), not a pass over every entry
    (~0.4 ms per create in a directory of 10,000 files). Entries change only through
    ``d[name] = node`` and ``del d[name]`` (the other mutating ``dict`` methods are refused,
    so no change can pass the count by).

    INVARIANT: ``dirs`` is the number of values whose ``children`` is not None (checked by
    ``InodeTable.check_invariants``); a node is a directory or not for its whole life."""

    __slots__ = ("dirs",)

    def __init__(self) -> None:
        super().__init__()
        self.dirs = 0

    def __setitem__(self, name: str, node: "Node") -> None:
        old = self.get(name)
        if old is not None and old.children is not None:
            self.dirs -= 1
        dict.__setitem__(self, name, node)
        if node.children is not None:
            self.dirs += 1

    def __delitem__(self, name: str) -> None:
        node = self[name]
        dict.__delitem__(self, name)
        if node.children is not None:
            self.dirs -= 1

    def _refused(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("a directory's entries change only by d[name] = node and del d[name]")

    pop = popitem = setdefault = update = clear = __ior__ = _refused


class _Rare(Generic[_V]):
    """The type checker's view of a ``_rare`` attribute: reads and writes a ``_V`` (at run
    time the attribute is the ``property`` ``_rare`` makes)."""

    if TYPE_CHECKING:
        def __get__(self, obj: object, owner: object = None) -> _V: ...

        def __set__(self, obj: object, value: _V) -> None: ...


def _rare(name: str, default: Any) -> Any:
    """A ``Node`` attribute kept in the node's side table (``Node._x``, a dict created on the
    first non-default value): fields most nodes never set cost nothing per node. Declared
    as ``_Rare[type]`` for the type checker."""
    def get(self: Node) -> Any:
        x = self._x
        return default if x is None else x.get(name, default)

    def set_(self: Node, value: Any) -> None:
        x = self._x
        if x is None:
            if value == default and type(value) is type(default):
                return
            x = self._x = {}
        x[name] = value

    return property(get, set_, doc=f"(side table) default {default!r}")


class Node:
    """One inode. Directories have ``children``; files have content state.

    ``key`` names the file in the outbox (``r:<record id>`` / ``n:<key>``); ``sha`` is the
    blob of the current content when ``buf`` is None (64 hex digits; held as 32 bytes, the
    same ``bytes`` object as the store mirror's entry). ``local_only`` files never leave the sidecar.

    Memory (a big store holds 100,000 of these): ``__slots__`` only; the key of a record
    loaded from the control plane is not stored (``_key`` None means ``"r:" + record_id``;
    ``InodeTable._bind_rid`` writes it out before the id changes); times are int ns, the
    update time is ``updated_ns`` (``updated_at`` is rendered from it); fields few nodes set
    (``buf``, ``last_put``, ``error``, ``type_override``, ``special``, ``refused`` and its code,
    ``xmtime``, ``attrs_version``, ``local_only``, ``unlinked``) live in a dict per node
    (``_x``) that exists only once one of them is set. ``opened`` (open handles) is a slot:
    every ``open`` and ``release`` changes it (a warm ``grep -r`` opens every file), and in
    the side table each opened file kept a dict for good.

    INVARIANT: ``_x is None`` means every side-table field has its default (not special,
    not unlinked, no write buffer, ...). The per-request paths of a warm read (``open``,
    ``release``, ``readdir``, the adapter's ``attrs``) test it before reading any of them:
    each such read is a Python property call.
    """

    __slots__ = ("ino", "name", "parent", "store", "mode", "uid", "gid", "atime_ns", "mtime_ns",
                 "ctime_ns", "children", "_key", "record_id", "version", "rtype", "_sha", "size",
                 "dirty", "state", "nlookup", "updated_ns", "opened", "_x")

    def __init__(self, ino: int, name: str, parent: "Node | None", is_dir: bool,
                 store: "StoreMount | None" = None, mode: int = 0, uid: int = 0, gid: int = 0,
                 atime_ns: int = 0, mtime_ns: int = 0, ctime_ns: int = 0) -> None:
        self.ino = ino
        self.name = name
        self.parent = parent
        self.store = store
        self.mode = mode
        self.uid = uid
        self.gid = gid
        self.atime_ns = atime_ns
        self.mtime_ns = mtime_ns
        self.ctime_ns = ctime_ns
        self.children: Children | None = Children() if is_dir else None
        self._key: str | None = ""  # "" no key yet; None: "r:" + record_id
        self.record_id: str | None = None
        self.version = 0
        self.rtype: str | None = None
        self._sha = b""  # the sha256 as 32 bytes (shared with the mirror's entry), b"": none
        self.size = 0
        self.dirty = False
        self.state: WriteState = CLEAN
        self.nlookup = 0
        self.updated_ns = 0  # ns since the epoch of the record's last version; 0: none
        self.opened = 0  # open handles
        self._x: dict[str, Any] | None = None

    @property
    def is_dir(self) -> bool:
        """Whether the node is a directory (it has ``children``)."""
        return self.children is not None

    @property
    def key(self) -> str:
        """The outbox key: ``r:<record id>``, ``n:<key>``, or '' (directories, control files)."""
        k = self._key
        if k is None:  # a record loaded from the control plane: its key is implicit
            rid = self.record_id
            assert rid is not None  # INVARIANT: only a record's key is left implicit
            return "r:" + rid
        return k

    @key.setter
    def key(self, value: str) -> None:
        self._key = value

    @property
    def sha(self) -> str:
        """The sha256 of the content in the blob cache (64 hex digits; '' when none)."""
        return self._sha.hex()

    @sha.setter
    def sha(self, value: str) -> None:
        self._sha = bytes.fromhex(value) if value else b""

    @property
    def updated_at(self) -> str:
        """The record's update time, ISO 8601 as the control plane gives it ('' when none)."""
        ns = self.updated_ns
        if not ns:
            return ""
        return (_EPOCH + timedelta(microseconds=ns // 1000)).isoformat()

    buf: _Rare[WriteBuffer | None] = _rare("buf", None)  # bytes being written (appendbuf), None: content is the blob ``sha``
    # INVARIANT: on a file that is not ``dirty``, ``buf`` holds its clean content (read in by
    # a write refused at write(2), or kept in memory on a failing cache disk); a new clean
    # state drops it (``RemoteApply._set_clean``), else it would serve the old bytes and
    # count their size in the store's usage (``cur_size``) under the new ``size``
    last_put: _Rare[Entry | None] = _rare("last_put", None)  # the outbox Entry of the last content commit
    error: _Rare[str] = _rare("error", "")  # why the last commit was refused ('' when not)
    local_only: _Rare[bool] = _rare("local_only", False)
    # A directory made here: by ``mkdir``, or kept empty from the saved directory list
    # (``dirs.json``) at start. It stays when the records under it go elsewhere; a
    # directory only implied by records (made for them from the control plane's state) goes
    # with the last of them removed by a remote change (``RemoteApply._prune_implied``).
    made: _Rare[bool] = _rare("made", False)
    unlinked: _Rare[bool] = _rare("unlinked", False)
    # The older content of a file kept under its inode for the readers that held it open
    # past ``READER_LINGER`` when a remote change replaced it (``Filesystem.keep_for_readers``):
    # the path has a new inode (the current content) and this one, ``unlinked``, serves those
    # readers its content whole until they close, as a local disk serves a descriptor opened
    # before a rename over the file. INVARIANT: set only by ``keep_for_readers``, on a node
    # with no key and no record (never sent, found by no key); an open for writing of it is
    # refused (``ESTALE``: the kernel looks the name up again and opens the current inode).
    kept: _Rare[bool] = _rare("kept", False)
    # The kept inodes of this file's older contents (``kept``) that readers may still hold
    # open: while one is, the overwrite base (``read_base``, what they read) is not cleared
    # by a reader served the current content (``Filesystem._served``): the next overwrite may
    # be theirs. INVARIANT: appended to only by ``Filesystem.keep_for_readers``; pruned of
    # the closed ones by ``Filesystem._kept_open``.
    kept_open: _Rare["list[Node] | None"] = _rare("kept_open", None)
    special: _Rare[str] = _rare("special", "")  # .memfuse control files: "status" / "errors"
    type_override: _Rare[str | None] = _rare("type_override", None)  # set through user.memfuse.type, sent with the next put
    refused: _Rare[int] = _rare("refused", 0)  # errno of a write refused in the current write session (held back)
    refused_code: _Rare[str] = _rare("refused_code", "")  # its problem code (``refused``'s, set with it)
    checker: _Rare[WriteChecker | None] = _rare("checker", None)  # writecheck.WriteChecker of the current write session
    # The content a write session started from, ``(sha256 hex, bytes)``, when only memory
    # held it (``buf``: the blob cache refused it, a full cache disk), so that the session's
    # write, withdrawn by its close, can be undone (``Filesystem._withdraw``): the session
    # changes ``buf`` in place. INVARIANT: set by ``Filesystem._keep_prior`` at a session's
    # first change of a held ``buf``; taken (cleared) by the session's ``commit``.
    prior: _Rare[tuple[str, bytes] | None] = _rare("prior", None)
    # The file keeps the content of a withdrawn write because what it showed before is gone
    # (``Filesystem._withdraw``): that content is never sent; a write session that does not
    # replace it whole is refused at close (``Filesystem.commit``). INVARIANT: set only by
    # ``_withdraw``, cleared by the commit of a session that replaced the content whole.
    lost_prior: _Rare[bool] = _rare("lost_prior", False)
    # File attributes (records): ``mode`` holds the permission bits shown and sent; ``xmtime``
    # is the explicit mtime (utimensat) the record keeps, None when it follows the last write
    # (``updated_ns``); ``attrs_version``: the version our last attribute change made, when
    # it was made on content not seen here yet (older remote states keep our attributes).
    xmtime: _Rare[int | None] = _rare("xmtime", None)
    attrs_version: _Rare[int] = _rare("attrs_version", 0)
    # The version a writer here could have read, when a remote change replaced it since
    # (docs/SEMANTICS.md "Conflicts", the base of an overwrite): the sha256 (64 hex digits) of
    # the content this mount served to readers of the file before the feed applied a newer
    # version, '' when readers were served the current one.
    # INVARIANT: set only by ``RemoteApply.note_replaced`` (a remote change of content, or
    # the merge of our own write shown, when not set already: the oldest version no reader
    # was served a newer one after), by a reader served while the kernel may still
    # show an older content (``shown``; ``UNKNOWN_BASE`` when that content is no longer
    # cached and the reader got the current one, ``Filesystem._read_shown``), and by a
    # reader whose reads straddled a change
    # (``Filesystem._read_across``: the replaced content it holds, or ``UNKNOWN_BASE``
    # when it holds parts of two); cleared by a reader's open or read
    # (``Filesystem.open`` / ``read``: served the current content) and by the commit of a
    # session that replaced the content whole (``replacing``), which carries it as its base
    # (``Filesystem.commit``). A write session built on the current content (``echo >>``)
    # neither uses nor clears it: its base is that content, and the readers it was recorded
    # for may still overwrite (``sed -i`` reading while another process appends; attack
    # report 11, F3). A file renamed over a record takes the target's
    # (``NamespaceOps._adopt_key``). Memory only (a restart forgets it: the base is then the
    # version this sidecar last saw).
    read_base: _Rare[str] = _rare("read_base", "")
    # The sha256 of the content readers here were last served, when a writer here changed
    # the file since (it is ``unread``): a remote change or the merge of our own write
    # replacing the content then records it as the ``read_base`` (not the content written
    # here, which no reader was served).
    # INVARIANT: set by ``Filesystem._touch_content`` (the first write after readers were
    # served ``sha``, when not set already), only while ``unread`` is set; cleared with
    # ``unread`` by a reader served (``Filesystem._served``) and by the commit of a session
    # that replaced the content whole. Its blob is kept (``_gc_blobs``).
    served: _Rare[str] = _rare("served", "")
    # True while the current write session replaces the content whole (an ``O_TRUNC`` open,
    # a truncate to 0, a file renamed over a record): its commit is based on what a reader
    # here could have read (``read_base``), not on the content it replaced.
    # INVARIANT: set by ``Filesystem.open`` (``O_TRUNC``), ``Filesystem.truncate`` (to 0,
    # ``_make_buf``) and ``NamespaceOps._adopt_key``; cleared by ``Filesystem.commit`` of
    # the session.
    replacing: _Rare[bool] = _rare("replacing", False)
    # True while a file renamed over a record (or from a local-only name onto a record's)
    # holds content no put has carried yet: the target's name shows it, but the outbox and
    # the control plane still hold the target's old content (the put waits for the file's
    # close), so a directory's fsync must commit it (``Filesystem._names_only_here``).
    # INVARIANT: set by ``NamespaceOps._rename_file_remote`` where it adopts the target's key
    # of a dirty file; cleared by ``Filesystem.commit`` (review26 F1: ``os.replace`` of a
    # temporary still open, then the directory's fsync, lost the new content at a kill -9).
    renamed_over: _Rare[bool] = _rare("renamed_over", False)
    # The open handles (``fh``) that emptied the file for a rewrite (an ``O_TRUNC`` open,
    # ``ftruncate(0)``: vim's in-place save, ``echo x > f``, ``cp``). The emptying takes
    # every handle's writes away (``Handle.modified`` cleared: ``Filesystem.rewriting``);
    # while a rewriter is open, a handle with no write since commits nothing at its fsync or
    # release (``Filesystem.rewritten_by_another``), as none does at its flush: a reader's
    # or an earlier writer's release that the kernel sends late, after the next save emptied
    # the file, commits neither the emptied file nor the rewrite's first writes. The
    # rewrite is committed by its own close (flush after a write, fsync) or, closed with
    # nothing written, by the release of the last rewriter (as ``: > f``).
    # INVARIANT: each is the ``fh`` of an open handle of this node, held once; added by
    # ``Filesystem.rewriting`` (from ``Filesystem.open`` and ``AttributeOps.setattr``),
    # removed only by ``Filesystem.release`` of its handle.
    rewriters: _Rare[tuple[int, ...]] = _rare("rewriters", ())
    # The sha256 of the content the kernel may still serve a reader of this file (its pages
    # and its size) while the invalidation of a change of it has not reached the kernel
    # (``FsListener.kernel_behind``): a reader served meanwhile may get it, so it becomes
    # that reader's ``read_base`` (unless an older one is kept).
    # While the kernel is behind, readers are served this content whole, not the current one
    # (``Filesystem._read_shown``: the kernel cuts reads at the size it holds).
    # INVARIANT: set only by ``RemoteApply.note_replaced`` to the content being replaced,
    # when the kernel is not behind on the file already or was told its current size since
    # (else it keeps the older content it may show); cleared, with ``read_base`` and
    # ``unread``, by a reader served while the kernel is not behind (``Filesystem._served``),
    # and alone when the file's attributes are sent to the kernel while it is behind
    # (``Filesystem.kernel_told_size``: it holds the current size then) and by a withdrawn
    # write (``Filesystem._withdraw``: the kernel holds that write). Its blob is kept
    # (``_gc_blobs``).
    shown: _Rare[str] = _rare("shown", "")
    # True while no reader here opened or read the file since its content was made: by a
    # writer here, or elsewhere (a record the feed created here, a remote change of its
    # content). Content no reader was served never becomes a ``read_base`` (except as the
    # content the kernel still shows a reader, ``shown``): an overwrite by
    # a writer that read nothing since is based on the version this sidecar last saw (last
    # writer wins, as on a local disk; tests/test_reference_model.py). Files loaded at
    # mount count as served (no side table for them).
    # INVARIANT: set by ``RemoteApply`` (a new record from the feed, ``note_replaced``) and
    # by ``Filesystem._touch_content`` (a write); cleared by a reader's open past the warm
    # path and by a read (``Filesystem.open`` / ``read``) while the kernel is not behind.
    unread: _Rare[bool] = _rare("unread", False)

    def __repr__(self) -> str:
        return f"Node(ino={self.ino}, name={self.name!r}, key={self.key!r}, state={self.state})"

    def path(self) -> str:
        """Store-relative path ``a/b.md`` ('' for a store root)."""
        parts = []
        n = self
        while n.parent is not None and n.store is not None and n is not n.store.root:
            parts.append(n.name)
            n = n.parent
        return "/".join(reversed(parts))

    def cur_size(self) -> int:
        """The size shown, in bytes: the write buffer's while the file is being written."""
        buf = self.buf
        return len(buf) if buf is not None else self.size

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
    local_count: int = 0  # live local-only files (never sent; bounded by max_records apart)
    local_used: int = 0  # bytes of the live local-only files
    #: the store's creation time (``Store.created_at``, ISO 8601) as the control plane gave
    #: it: which store of that slug this is (one deleted and made again is another); ''
    #: when unknown (mounted from the cache at an offline start)
    created: str = ""

    @property
    def writable(self) -> bool:
        """Whether the store is attached read-write."""
        return self.access == "read_write"

@dataclass(slots=True)
class Handle:
    """One open file or directory: ``fh`` (the number the kernel passes back), its node,
    the ``os.O_*`` open flags; a directory handle keeps the listing it pages through
    (``entries``), a ``.memfuse`` file the content rendered at open (``snapshot``)."""

    fh: int
    node: Node
    flags: int
    is_dir: bool = False
    entries: list[tuple[str, Node]] | None = None
    # write(2) or ftruncate(2) through this handle since open and since the file was last
    # emptied for a rewrite, through any handle (``Filesystem.rewriting``)
    modified: bool = False
    snapshot: bytes | None = None  # .memfuse files: content generated once at open
    # The sha256 of the content the file had when a remote change or the merge of our own
    # write replaced it while this handle was open for reading ('' when none since): the
    # reader may hold part of it (from its reads, or the kernel's pages), so what its next
    # read gets is checked against it (``Filesystem._read_across``; verify 11: a ``sed -i``
    # whose reads straddled a merge shown got the older bytes up to one offset and the
    # merge's after it, while its base became the merge).
    # INVARIANT: set by ``RemoteApply.note_replaced`` (the first replacement since the
    # handle's last check) and by ``Filesystem._read_shown`` (the reader was served the
    # older content the kernel still shows, ``Node.shown``); cleared by
    # ``Filesystem._read_across`` when the reader is served the current content (a pure
    # append of it).
    replaced: str = ""
    # What the reader holds once ``replaced`` was checked: '' (not checked yet), ``"old"``
    # (exactly the replaced content: the rest of the file is the same bytes) or ``"mixed"``
    # (parts of both: the base of an overwrite is unknown, ``UNKNOWN_BASE``).
    across: str = ""

#: ``Node.read_base`` of a file a reader was served partly one content and partly another
#: (its reads straddled a change, ``Handle.across``): no version is what the reader holds,
#: so an overwrite is sent ``If-Match`` this tag, which no version has, and resolved last
#: writer wins with a conflict line, never merged from a version it did not read
#: (``ConflictResolver.put``). 64 hex digits (kept, journaled and collected as a sha256
#: is), the digest of no content anyone can make.
UNKNOWN_BASE = "0" * 64

#: ``Node.read_base`` of a file a writer here asked to create (``O_CREAT | O_TRUNC``, not
#: ``O_EXCL``) where the kernel had looked the name up absent, while a record made
#: elsewhere at that name was applied here before the create came (``Filesystem.create``
#: opens that file instead: attack 17 F9): the writer read no version of it, so its
#: overwrite is sent ``If-Match`` this tag, which no version has, and resolved as a path
#: created elsewhere, last writer wins with a conflict line, the other version kept in
#: history (``ConflictResolver.put``): the same outcome as when the other create reaches
#: the control plane after this one is sent. 64 hex digits, as ``UNKNOWN_BASE``.
ABSENT_BASE = "0" * 63 + "1"

@dataclass
class Settings:
    """Tunables of one mount (see ``MountConfig``). Times in seconds."""

    uid: int = field(default_factory=os.getuid)
    gid: int = field(default_factory=os.getgid)
    commit_wait: float = 10.0
    fsync_timeout: float = 60.0
    local_only_patterns: tuple[str, ...] = names.DEFAULT_LOCAL_ONLY

    def __post_init__(self) -> None:
        check_seconds(self, "commit_wait", "fsync_timeout", positive=("fsync_timeout",))


#: invariants found broken by ``check_invariants_after`` in this process (tests read it)
BROKEN_INVARIANTS: list[str] = []
#: whether the FUSE adapter checks the invariants after every modifying operation
CHECK_INVARIANTS = os.environ.get("MEMFUSE_CHECK_INVARIANTS", "") == "1"
CHECK_EVERY_NODES = 128  # nodes per skipped check in large tables (``check_invariants_after``)


class InodeTable:
    """The inode and handle tables of ``core.Filesystem`` (module docstring). Mixed into
    ``Filesystem``, whose ``__init__`` creates ``inodes``, ``by_key``, ``by_rid``, ``handles``,
    ``stores``, ``settings`` and the root.

    Concurrency: one trio thread, no lock. The rule that stands for gcsfuse's
    ``GUARDED_BY(mu)``: every change of these tables and of the nodes' ``parent`` /
    ``children`` / ``name`` / ``_key`` / ``record_id`` is made with no ``await`` between the
    changes that restore the invariants below (a method that awaits does so only after
    them: ``Filesystem.flush`` / ``fsync``). ``check_invariants`` asserts them; tests run it
    after every modifying FUSE operation (``MEMFUSE_CHECK_INVARIANTS=1``).
    """

    # --- mutable state (declared here, created by ``Filesystem.__init__``) ---------------------
    #: INVARIANT: ``inodes[i].ino == i``; every node reachable from the root is here; an
    #: unlinked node stays until the kernel and every handle dropped it (``_drop_if_unused``)
    inodes: dict[int, Node]
    #: INVARIANT: ``by_key[k].key == k`` (written-out keys only: a record's implicit
    #: ``r:<id>`` key is found through ``by_rid``). Not asserted: that ``by_key[k]`` is in
    #: ``inodes`` (an entry may outlive its dropped node: seen after a flush in
    #: tests/test_attributes.py; harmless for lookups, which check ``unlinked``)
    by_key: dict[str, Node]
    #: INVARIANT: ``by_rid[r].record_id == r`` and ``by_rid[r]`` is in ``inodes``
    by_rid: dict[str, Node]
    #: INVARIANT: ``handles[f].fh == f``; ``handles[f].node.opened`` counts it
    handles: dict[int, Handle]
    #: INVARIANT: ``stores[s].slug == s``; ``count`` / ``used`` (``local_count`` /
    #: ``local_used``) equal a recount of the store's live record (local-only) files
    stores: dict[str, StoreMount]
    settings: Settings
    root: Node
    _next_ino: int  # INVARIANT: above every inode number given out
    _next_fh: int  # INVARIANT: at or above every handle number given out
    _checks_skipped: int  # modifying operations since the last ``check_invariants_after``

    def check_invariants_after(self, op: str) -> None:
        """``check_invariants`` after the FUSE operation ``op`` (tests:
        ``MEMFUSE_CHECK_INVARIANTS=1``): a broken invariant is logged as an error and kept in
        ``BROKEN_INVARIANTS`` (the test suite fails a test that leaves one), never raised
        into the FUSE loop. The check walks the whole table: on a table of ``n`` nodes it
        runs after every ``n // CHECK_EVERY_NODES``-th operation (every one up to that
        many nodes), so its cost per operation stays bounded in large trees."""
        self._checks_skipped = getattr(self, "_checks_skipped", 0) + 1
        if self._checks_skipped < len(self.inodes) // CHECK_EVERY_NODES:
            return
        self._checks_skipped = 0
        try:
            self.check_invariants()
        except AssertionError as e:
            BROKEN_INVARIANTS.append(f"after {op}: {e}")
            log.error("invariant broken", extra={"op": op, "invariant": str(e)})

    def check_invariants(self) -> None:
        """Assert the tables' invariants (the ``INVARIANT:`` comments above): raises
        ``AssertionError`` naming the first one broken. Costs a walk of the whole tree: for
        tests (``MEMFUSE_CHECK_INVARIANTS=1``), never on a production path."""
        for ino, n in self.inodes.items():
            assert n.ino == ino, f"inodes[{ino}] is inode {n.ino}"
            assert ino < self._next_ino, f"inode {ino} not below the next inode number"
            if n.parent is not None and not n.unlinked:
                kids = n.parent.children
                assert kids is not None and kids.get(n.name) is n, f"{n.path()!r} not in its parent"
            for name, c in (n.children or {}).items():
                assert c.parent is n and c.name == name, f"child {name!r} of {n.path()!r}"
                assert self.inodes.get(c.ino) is c, f"{c.path()!r} not in the inode table"
            if n.children is not None:
                dirs = sum(c.children is not None for c in n.children.values())
                assert n.children.dirs == dirs, f"{n.path()!r} counts {n.children.dirs} subdirectories, holds {dirs}"
        for k, n in self.by_key.items():
            assert n.key == k, f"by_key[{k!r}] has key {n.key!r}"
        for rid, n in self.by_rid.items():
            assert n.record_id == rid, f"by_rid[{rid!r}] is record {n.record_id!r}"
            assert self.inodes.get(n.ino) is n, f"by_rid[{rid!r}] not in the inode table"
        opened: dict[int, int] = {}
        for fh, h in self.handles.items():
            assert h.fh == fh and fh <= self._next_fh, f"handle {fh}"
            opened[h.node.ino] = opened.get(h.node.ino, 0) + 1
        for ino, count in opened.items():
            node = self.inodes.get(ino)
            assert node is None or node.opened >= count, \
                f"inode {ino}: {count} handles, opened {node.opened if node else 0}"
        for slug, sm in self.stores.items():
            assert sm.slug == slug, f"stores[{slug!r}] is {sm.slug!r}"
            files = [n for n in self._walk_files(sm.root)]
            rec = [n for n in files if not n.local_only]
            loc = [n for n in files if n.local_only]
            assert (sm.count, sm.used) == (len(rec), sum(n.cur_size() for n in rec)), \
                f"store {slug}: count/used {(sm.count, sm.used)} != recount"
            assert (sm.local_count, sm.local_used) == (len(loc), sum(n.cur_size() for n in loc)), \
                f"store {slug}: local count/used != recount"
            for n in files:  # the write state (WriteState's docstring)
                assert isinstance(n.state, WriteState), f"{n.path()!r}: state {n.state!r}"
                assert n.state != PENDING or n.last_put is not None, \
                    f"{n.path()!r}: pending without its put"
        for n in self.inodes.values():
            assert n.state == CLEAN or not (n.is_dir or n.special), \
                f"{n.path()!r}: a directory or control file in state {n.state}"
            fhs = n.rewriters if n._x is not None else ()
            assert len(set(fhs)) == len(fhs) and all(
                fh in self.handles and self.handles[fh].node is n for fh in fhs), \
                f"{n.path()!r}: rewriters {fhs} are not its open handles"

    def _new_node(self, name: str, parent: Node | None, is_dir: bool, store: StoreMount | None,
                  mode: int, now_ns: int, uid: int | None = None, gid: int | None = None) -> Node:
        ino = self._next_ino
        self._next_ino += 1
        n = Node(ino=ino, name=name, parent=parent, is_dir=is_dir, store=store,
                 mode=shared_mode((stat.S_IFDIR if is_dir else stat.S_IFREG) | mode),
                 uid=self.settings.uid if uid is None else uid,
                 gid=self.settings.gid if gid is None else gid,
                 atime_ns=now_ns, mtime_ns=now_ns, ctime_ns=now_ns)
        self.inodes[ino] = n
        if parent is not None:
            assert parent.children is not None  # a directory
            parent.children[name] = n
        return n

    def node(self, ino: int) -> Node:
        """The node for ``ino``; raises ``FsError(ENOENT)`` for an unknown or forgotten one."""
        try:
            return self.inodes[ino]
        except KeyError:
            raise FsError(errno.ENOENT, f"unknown inode {ino}") from None

    def _drop_if_unused(self, n: Node) -> None:
        if n._x is not None and n.unlinked and n.nlookup <= 0 and n.opened <= 0:
            self.inodes.pop(n.ino, None)
            if n._key and self.by_key.get(n._key) is n:
                del self.by_key[n._key]
            if n.record_id and self.by_rid.get(n.record_id) is n:
                del self.by_rid[n.record_id]

    def forget(self, ino: int, nlookup: int) -> None:
        """The kernel dropped ``nlookup`` references to ``ino`` (unknown inodes and the root are
        ignored); an unlinked node unused by the kernel and by handles leaves the tables."""
        n = self.inodes.get(ino)
        if n is None or ino == ROOT_INO:
            return
        n.nlookup -= nlookup
        self._drop_if_unused(n)

    def node_by_key(self, key: str | None) -> Node | None:
        """The node whose outbox key is ``key`` (``r:<id>`` / ``n:<key>``), or None. Keys
        of nodes that keep theirs implicitly (``Node._key`` None: ``r:`` + record id) are
        found through ``by_rid``; ``by_key`` holds the others and wins."""
        if not key:
            return None
        n = self.by_key.get(key)
        if n is None and key.startswith("r:"):
            n = self.by_rid.get(key[2:])
            if n is not None and n._key is not None:
                n = None
        return n

    def _set_record_key(self, n: Node, rid: str) -> None:
        """Give ``n`` (bound to record ``rid``) the key ``r:<rid>`` without storing it."""
        if n._key:
            if self.by_key.get(n._key) is n:
                del self.by_key[n._key]
        self._bind_rid(n, rid)
        n._key = None
        stale = self.by_key.get("r:" + rid)
        if stale is not None and stale is not n:
            del self.by_key["r:" + rid]  # the key belongs to this node now

    def _bind_rid(self, n: Node, rid: str | None) -> None:
        if n._key is None and n.record_id != rid:
            # the key stays "r:<old id>": write it out before the id changes
            n._key = n.key
            if self.node_by_key(n._key) is None:
                self.by_key[n._key] = n
        if n.record_id and self.by_rid.get(n.record_id) is n:
            del self.by_rid[n.record_id]
        n.record_id = rid
        if rid:
            self.by_rid[rid] = n

    def lookup(self, parent_ino: int, name: bytes) -> Node | None:
        """The child named ``name`` or None; ``.``/``..`` resolve. Counts a lookup when found."""
        d = self.node(parent_ino)
        if d.children is None:  # not a directory
            raise FsError(errno.ENOTDIR)
        n: Node | None
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
        if n.children is None:  # a file
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
        entries = h.entries
        for i in range(start, len(entries)):
            name, child = entries[i]
            if child._x is None or not child.unlinked:  # Node: _x None, not unlinked
                yield i + 1, name, child

    def statfs(self) -> dict[str, int]:
        """statvfs(2) totals over the mounted stores: ``bytes`` / ``used`` (bytes, from the
        stores' quotas, live records and local-only files, which share the byte quota) and
        ``files`` / ``nfiles`` (record limits and counts; local-only files have a count of
        their own); the defaults of one store when none is mounted."""
        stores = list(self.stores.values())
        return {"bytes": sum(sm.max_store_bytes for sm in stores) or DEFAULT_MAX_STORE_BYTES,
                "used": sum(sm.used + sm.local_used for sm in stores),
                "files": sum(sm.max_records for sm in stores) or DEFAULT_MAX_RECORDS,
                "nfiles": sum(sm.count for sm in stores)}

    def listdir(self, d: Node) -> list[tuple[str, Node]]:
        """The children of directory ``d`` as ``(name, node)`` sorted by name; ``ENOTDIR`` for a
        file."""
        if d.children is None:  # not a directory
            raise FsError(errno.ENOTDIR)
        return sorted(d.children.items())

    def nlink(self, n: Node) -> int:
        """The link count shown: 2 + subdirectories for a directory, 1 for a file (0 once
        unlinked)."""
        kids = n.children
        if kids is None:  # a file
            return 0 if n._x is not None and n.unlinked else 1
        return 2 + kids.dirs  # kept as entries come and go (Children)

    def _account(self, n: Node, delta: int) -> None:
        """Keep ``StoreMount.used`` equal to the sum of its live records' sizes (and
        ``local_used`` to its local-only files')."""
        if delta and n.store is not None and not n.unlinked and not n.is_dir:
            if n.local_only:
                n.store.local_used += delta
            else:
                n.store.used += delta

    def _live(self, n: Node, sign: int) -> None:
        """A record file appears in (+1) or leaves (-1) its store: count and bytes (a
        local-only file: ``local_count`` / ``local_used``). Flip ``local_only`` only
        between a -1 and a +1."""
        if n.store is not None and not n.unlinked and not n.is_dir:
            if n.local_only:
                n.store.local_count += sign
                n.store.local_used += sign * n.cur_size()
            else:
                n.store.count += sign
                n.store.used += sign * n.cur_size()

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

    def _child(self, d: Node, name: bytes) -> Node:
        if d.children is None:  # not a directory
            raise FsError(errno.ENOTDIR)
        n = d.children.get(name.decode("utf-8", "surrogateescape"))
        if n is None:
            raise FsError(errno.ENOENT)
        return n

    def _has_remote(self, d: Node) -> bool:
        for c in (d.children or {}).values():
            if (c.is_dir and self._has_remote(c)) or (not c.is_dir and not c.local_only):
                return True
        return False

    def _walk_files(self, d: Node) -> Iterator[Node]:
        for c in (d.children or {}).values():
            if c.is_dir:
                yield from self._walk_files(c)
            else:
                yield c

    def dirty_nodes(self, sm: StoreMount | None = None) -> list[Node]:
        """Files with unflushed writes, of one store or (``sm`` None) of all."""
        return [n for n in self.inodes.values()
                if n.dirty and not n.is_dir and (sm is None or n.store is sm)]
