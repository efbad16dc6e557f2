"""Sync with the control plane: store mirrors and the change feed's catch-up.

- ``StoreState`` — the control plane's view of one store as this sidecar last saw it: every
  live record's metadata (no content; content lives in the blob cache) and the change-feed
  cursor. Saved as a base ``<cache>/stores/<slug>.json`` (written whole: tmp + rename) and an
  append-only log ``<slug>.log`` of the changes since it, so a save costs in proportion to
  what changed and a restart resumes from the cursor instead of taking a full snapshot
  (docs/SCALING.md "Saving the mirror").

The kernel cache invalidations that follow a remote change are ``invalidator.Invalidator``'s
(this module never imports pyfuse3).
"""
from __future__ import annotations

import binascii
import contextlib
import errno
import json
import logging
import os
import struct
import sys
import time
import zlib
from datetime import datetime, timedelta, timezone
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

import msgspec
import trio

from ..client import ApiClient
from ..errors import Gone
from ..defs import DEFAULT_MODE, RECORD_TYPES, datetime_ns
from ..wire import Change, Record
from .cachedir import FILE_MODE, CacheError, cache_error

if TYPE_CHECKING:
    from .blobcache import BlobCache
    from .journal import Entry

log = logging.getLogger("memfuse.sync")
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


_TYPES: dict[str | None, str | None] = {t: sys.intern(t) for t in RECORD_TYPES}
# the columns of a format-3 mirror (earlier releases)
COLUMNS = ("id", "path", "type", "version", "sha256", "size", "updated_ns", "mode", "mtime_ns")
FORMAT = 4  # of <cache>/stores/<slug>.json; formats 3 and 2 of earlier releases are still read
_Index = Annotated[int, msgspec.Meta(ge=0)]


class _Columns(msgspec.Struct, frozen=True):
    """The columns of a format-4 mirror (``StoreState``): one array per field, except
    ``sha256`` (every digest's 64 hex digits, concatenated) and ``dir`` / ``type`` / ``mode``
    (indices into the mirror's ``dirs`` / ``types`` / ``modes``)."""

    id: list[str]
    dir: list[_Index]
    name: list[str]
    type: list[_Index]
    version: list[int]
    sha256: str
    size: list[int]
    updated_ns: list[int]
    mode: list[_Index]
    mtime_ns: list[int | None]


class _Mirror(msgspec.Struct, frozen=True):
    """A format-4 mirror file (``StoreState``)."""

    format: int
    cursor: int
    columns: _Columns
    dirs: list[str]
    types: list[str | None]
    modes: list[int]
    access: str = "read_write"
    limits: dict[str, int] = {}
    base: str = ""  # the id its log names; '' in files of earlier releases (no log)


class _Format(msgspec.Struct):
    """Only the format number of a mirror file (the rest is skipped, not decoded)."""

    format: int | None = None


_MODES: dict[int, int] = {}


def _shared(mode: int) -> int:
    """One ``int`` object per permission-bits value (above CPython's small-int cache)."""
    return _MODES.setdefault(mode, mode) if len(_MODES) < 4096 else mode


class Meta(msgspec.Struct, gc=False):
    """What the mirror keeps of one live record: the ``Record`` fields the tree needs, in a
    fraction of a ``Record``'s memory (100,000 records are held at once). The tree's
    ``Node`` shares its objects (id, file name, sha256 bytes, size, update time): they are
    held once.

    ``dir`` / ``name``: the record's path split at its last ``/`` (``dir`` '' at the store
    root; one ``str`` object per directory, shared by its records: ``sys.intern``; ``name``
    is the file node's name too); ``sha``: the sha256 as 32 bytes (``sha256`` gives the 64
    hex digits); ``updated_ns``: the update time in ns since the epoch
    (``Record.updated_at``); ``mode``: permission bits; ``mtime_ns``: the explicit mtime
    (ns), None when it is the update time. Build one with ``new`` (from a path and hex
    digits) or ``of`` (from a ``Record``); the constructor takes the fields as kept.
    A msgspec Struct without GC tracking (it holds no containers): 96 bytes for 10 fields.
    """

    id: str
    dir: str
    name: str
    type: str | None
    version: int
    sha: bytes
    size: int
    updated_ns: int
    mode: int = DEFAULT_MODE
    mtime_ns: int | None = None
    # duck-typing with ``Record`` for ``Filesystem.add_store`` / ``reconcile_store``
    content: ClassVar[None] = None
    deleted: ClassVar[bool] = False

    @property
    def path(self) -> str:
        """The store-relative path (``dir/name``)."""
        return f"{self.dir}/{self.name}" if self.dir else self.name

    @property
    def sha256(self) -> str:
        """The content's sha256 as 64 hex digits."""
        return self.sha.hex()

    def __repr__(self) -> str:
        return f"Meta(id={self.id!r}, path={self.path!r}, version={self.version}, sha256={self.sha256[:12]}…)"

    @classmethod
    def new(cls, id: str, path: str, type: str | None, version: int, sha256: str, size: int,
            updated_ns: int, mode: int = DEFAULT_MODE, mtime_ns: int | None = None) -> "Meta":
        """The entry of a record at ``path`` whose content has sha256 ``sha256`` (64 hex
        digits; ``ValueError`` for anything else); type and mode as the shared objects."""
        d, _, name = path.rpartition("/")
        return cls(id, sys.intern(d), name, _TYPES.get(type, type), version,
                   bytes.fromhex(sha256), size, updated_ns, _shared(mode), mtime_ns)

    @classmethod
    def of(cls, r: Record) -> "Meta":
        """The mirror entry of record ``r`` (no content)."""
        return cls.new(r.id, r.path, r.type, r.version, r.sha256, r.size,
                       datetime_ns(r.updated_at), r.mode, r.mtime_ns)

    @property
    def updated_at(self) -> datetime:
        """The update time as an aware UTC ``datetime`` (µs precision)."""
        return _EPOCH + timedelta(microseconds=self.updated_ns // 1000)

    @classmethod
    def load_v2(cls, row: list[Any]) -> "Meta":
        """A row of a format-2 file (``[id, path, type, version, sha256, size, updated_at
        ISO 8601, mode, mtime_ns]``); rows of earlier releases (7 members, before the
        attributes) load with the defaults, as their records had no attributes then."""
        mode, mtime = (int(row[7]), None if row[8] is None else int(row[8])) if len(row) >= 9 else (DEFAULT_MODE, None)
        return cls.new(row[0], row[1], row[2], int(row[3]), row[4], int(row[5]),
                       datetime_ns(datetime.fromisoformat(row[6])), mode, mtime)


# The mirror's log (<cache>/stores/<slug>.log): frames appended to the base file
LOG_FRACTION = 0.25  # a log past this fraction of its base (and LOG_MIN) is compacted
LOG_MIN = 64 * 1024  # bytes: a small store's log is never compacted below this
LOG_FORMAT = 1
#: bytes of content one log frame may carry (``StoreState``: the contents, held only in memory,
#: of the records it names; past it they are written to the blob cache first)
CARRY_MAX = 64 * 1024
#: a log whose frames carried more content than this is compacted whatever its other bytes
#: (the carried bytes do not count towards ``LOG_FRACTION``: a close's content would
#: otherwise make a small store's base be rewritten every few dozen closes)
CARRIED_MAX = 4 << 20
_FRAME = struct.Struct("<2sII")  # magic, payload length, CRC-32 of the payload
_MAGIC = b"MJ"
# a record as a log row: Meta's fields in order
_Row = tuple[str, str, str, str | None, int, bytes, int, int, int, int | None]


class _LogHead(msgspec.Struct, array_like=True, frozen=True):
    """The first frame of a mirror log: the log format and the id of the base it extends."""

    log: int
    base: str


class _LogEntry(msgspec.Struct, array_like=True, frozen=True):
    """One save appended to a mirror log: the records changed since the previous frame
    (``put``: their state now, as ``_Row``; ``removed``: their ids) and the cursor, access
    and limits at the same moment; ``carried``: the contents of ``put`` records that the
    blob cache held only in memory when the frame was written (``[sha256 as 32 bytes,
    content]``; absent in frames of earlier releases)."""

    cursor: int
    access: str
    limits: dict[str, int]
    put: list[_Row]
    removed: list[str]
    carried: list[tuple[bytes, bytes]] = []


_LOG_ENC = msgspec.msgpack.Encoder()
_HEAD_DEC = msgspec.msgpack.Decoder(_LogHead)
_ENTRY_DEC = msgspec.msgpack.Decoder(_LogEntry)


def _frame(payload: bytes) -> bytes:
    return _FRAME.pack(_MAGIC, len(payload), zlib.crc32(payload)) + payload


def _frames(data: bytes) -> Iterator[tuple[bytes, int]]:
    """The payloads of the whole frames at the start of ``data``, as ``(payload, end
    offset)``; stops at the first frame that is cut short, has no magic, is empty or fails
    its CRC (a torn or garbage tail: nothing after it is trusted)."""
    off, n = 0, len(data)
    while off + _FRAME.size <= n:
        magic, length, crc = _FRAME.unpack_from(data, off)
        start = off + _FRAME.size
        if magic != _MAGIC or length == 0 or start + length > n:
            return
        payload = data[start:start + length]
        if zlib.crc32(payload) != crc:
            return
        off = start + length
        yield payload, off


_CHUNK = 8192  # items per encoding call of a base's column


def _json_array(col: list[Any]) -> list[bytes | memoryview]:
    """``col`` as a JSON array in pieces (bytes or memoryviews; their concatenation is the
    array), each encoded by its own call of at most ``_CHUNK`` items: from a worker thread
    no single call then holds the GIL for more than about a millisecond."""
    if len(col) <= _CHUNK:
        return [msgspec.json.encode(col)]
    parts: list[bytes | memoryview] = [b"["]
    for i in range(0, len(col), _CHUNK):
        if i:
            parts.append(b",")
        parts.append(memoryview(msgspec.json.encode(col[i:i + _CHUNK]))[1:-1])
    parts.append(b"]")
    return parts


class _Snapshot(msgspec.Struct, frozen=True):
    """What a base file is written from: the mirror at one moment (``compact``)."""

    recs: list[Any]
    cursor: int
    access: str
    limits: dict[str, int]
    base: str


class StoreState:
    """Mirror of one store's live records (id → ``Meta``) and the change-feed cursor.

    Saved in two files: a **base**, ``<cache>/stores/<slug>.json``, the whole mirror, and a
    **log**, ``<cache>/stores/<slug>.log``, what changed since that base, appended on each
    save. A load reads the base and replays the log; a save appends one frame (cost in
    proportion to the records changed since the previous save); the base is rewritten
    (compaction, ``compaction_due``) when the log would grow past ``LOG_FRACTION`` of it
    (and ``LOG_MIN``), after a full snapshot (``reset``) and after a base of an earlier
    release was read.

    The base, format 4: ``{"format": 4, "base": id, "cursor": int, "access": str,
    "limits": {name: int}, "dirs": [str], "types": [str | null], "modes": [int],
    "columns": {column: ...}}`` with the columns ``id``, ``dir``, ``name``, ``type``,
    ``version``, ``sha256``, ``size``, ``updated_ns``, ``mode``, ``mtime_ns``: one JSON
    array per field (a record's path is ``dirs[dir] + "/" + name``, ``name`` alone when that
    directory is ''), except ``sha256`` (one string: every record's 64 hex digits,
    concatenated) and ``dir`` / ``type`` / ``mode`` (indices into ``dirs`` / ``types`` /
    ``modes``). ``base`` (16 hex digits, new at each rewrite) names the log that extends
    it; a base without one (earlier releases) has no log. Written and read with msgspec:
    a save makes no object per record, and a load makes only what the mirror keeps
    (docs/SCALING.md). Format 3 (columns of ``COLUMNS`` as plain arrays: paths, hex
    digests, type strings, modes) and format 2 (``"records"``: one array per record, ISO
    8601 times) of earlier releases are read too and written as format 4 at the next save.

    The log: frames of ``magic "MJ", payload length (u32 LE), CRC-32 of the payload (u32
    LE), payload (msgpack)``. The first frame is ``_LogHead`` (``[1, base id]``); a log
    whose head names another base (one left over from before a rewrite) is ignored. Each
    later frame is one ``_LogEntry``, written with one ``write`` call: the records touched
    since the previous frame (their state now, or their removal) with the cursor, access
    and limits of the same moment, so the cursor saved is never ahead of the records
    saved. Replay stops at the first frame cut short or failing its check (a torn or
    garbage tail is never trusted); the next append truncates the log there first.

    No fsync: the mirror is a cache (the outbox carries the durability of writes). A
    ``kill -9`` loses nothing written (the page cache keeps it); a power loss may lose the
    tail of the log or leave a base unreadable, which loads an older, consistent state
    (caught up from its cursor) or takes a snapshot.

    A saved mirror names no content held only in memory (``blobs``, the blob cache passed
    in, holds a close's content behind: ``BlobCache.put_behind``), else a ``kill -9`` and an
    offline restart would show a file whose read fails. The rule, here only: a frame
    carries the contents its records have behind (``_LogEntry.carried``, up to
    ``CARRY_MAX`` bytes; past that they are written to the blob cache first, as they are
    before every base is snapshotted), and ``load`` stores what the log carried in the
    blob cache (``BlobCache.put_carried``). So a close's save (``save_log``) is one frame
    and no blob-cache transaction. Without ``blobs`` (tests, tools) nothing is carried.
    """

    def __init__(self, path: Path, slug: str, blobs: BlobCache | None = None) -> None:
        self.path = path
        self.blobs = blobs
        self.log_path = path.with_suffix(".log")
        self.slug = slug
        self.cursor = 0
        self.records: dict[str, Meta] = {}
        self.dirty = False
        self.last_change_at = 0.0
        self.access = "read_write"  # the attachment as last seen, for an offline start
        self.limits: dict[str, int] = {}
        #: record id -> the change-feed ``seq`` of a version of it this sidecar wrote whose
        #: state the tree and this mirror show (``committed``: a delete, a directory move),
        #: while the cursor is below it. INVARIANT: a feed change of such a record with a
        #: lower ``seq`` is older than what this mount shows, and is never applied
        #: (``older_than_own``). The feed leaves our own versions out (``skip_writer``), so a
        #: page (fetched before ours committed, or after it) may hold another writer's
        #: version made before ours; applied, it undid our delete (the file back with the
        #: other's content, attack 18 F9) or our move (the other's file at the old path,
        #: F11). A write's or a single move's answer needs no entry: its version number is
        #: on the file (``Node.version``) and on the mirror's record, which refuse older
        #: states already; a deleted record has no file, and a directory move's answer
        #: does not reach the files' versions. An entry leaves once the cursor reaches it
        #: (nothing older can come any more). Memory only: after a restart the catch-up
        #: from the saved cursor applies our own versions too, in order.
        self.own_newer: dict[str, int] = {}
        # what is on disk: the id of the base our log extends (None: the next save rewrites
        # the base), its size, and the bytes of the log's whole frames (None: no log of
        # that base yet; the next append starts one)
        self._base_id: str | None = None
        self._base_bytes = 0
        self._log_size: int | None = None
        self._log_carried = 0  # bytes of content the log's frames carried (part of _log_size)
        # the log kept open between appends (None: opened at the next one), positioned at
        # its end (_log_size); closed when the log is started anew, after a failed append,
        # at a load and by ``close``
        self._log_fd: int | None = None
        self._changed: set[str] = set()  # ids touched since the last frame written
        self._since: set[str] | None = None  # ids touched since a compaction's snapshot
        self._compacting = False
        self._compacted = trio.Event()  # set when the last compaction finished
        self._compacted.set()
        self._reset_since = False  # a reset came while a compaction ran

    def load(self) -> bool:
        """Read the saved state (format 4 and its log, or 3 and 2 of earlier releases);
        False when there is none or it is unreadable (then the caller takes a full
        snapshot)."""
        self._base_id, self._log_size, self._changed = None, None, set()
        self._log_carried = 0
        self.close()
        try:
            data = self.path.read_bytes()
            fmt = msgspec.json.decode(data, type=_Format).format
            if fmt == 4:
                m = msgspec.json.decode(data, type=_Mirror)
                self._base_bytes = len(data)
                del data
                self._load_v4(m)
                if m.base:
                    self._base_id = m.base
                    self._replay()
                else:
                    self.dirty = True  # an earlier release's base: rewritten with an id
                return True
            raw = json.loads(data)
            del data
            if fmt == 3:
                cols = raw["columns"]
                ids = cols["id"]
                n = len(ids)
                if any(len(cols[c]) != n for c in COLUMNS):
                    raise ValueError("columns of different lengths")
                for c in ("version", "size", "updated_ns", "mode"):
                    if not all(type(v) is int for v in cols[c]):
                        raise ValueError(f"column {c} holds a non-integer")
                self.records = dict(zip(ids, map(Meta.new, ids, cols["path"], cols["type"],
                                                 cols["version"], cols["sha256"], cols["size"],
                                                 cols["updated_ns"], cols["mode"], cols["mtime_ns"])))
            elif fmt == 2:
                self.records = {row[0]: Meta.load_v2(row) for row in raw["records"]}
            else:
                return False
            self.dirty = True  # written as format 4 at the next save
            self.cursor = int(raw["cursor"])
            self.access = raw.get("access", "read_write")
            self.limits = {k: int(v) for k, v in raw.get("limits", {}).items()}
            return True
        except FileNotFoundError:
            return False
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError,
                msgspec.DecodeError) as e:
            log.warning("saved store state unreadable; taking a full snapshot",
                        extra={"store": self.slug, "error": type(e).__name__})
            self.records, self.cursor, self._base_id = {}, 0, None
            return False

    def _replay(self) -> None:
        """Apply the log of the loaded base (``load``): every whole frame in order, up to the
        first that is cut short, fails its check or does not decode. A missing log, or one
        of another base, leaves the base as it is (the next append starts a new log)."""
        try:
            data = self.log_path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as e:
            log.warning("store state log unreadable; resuming from its base",
                        extra={"store": self.slug, "errno": errno.errorcode.get(e.errno or 0)})
            return
        frames = _frames(data)
        first = next(frames, None)
        try:
            head = _HEAD_DEC.decode(first[0]) if first is not None else None
        except (msgspec.DecodeError, ValueError):
            head = None
        if head is None or head.log != LOG_FORMAT or head.base != self._base_id:
            if data:
                log.info("store state log of another base ignored", extra={"store": self.slug})
            return
        assert first is not None  # else head is None
        good, applied = first[1], 0
        recs = self.records
        carried: list[tuple[bytes, bytes]] = []
        for payload, end in frames:
            try:
                entry = _ENTRY_DEC.decode(payload)
                metas = [Meta(i, sys.intern(d), name, _TYPES.get(t, t), v, sha, size, upd,
                              _shared(mode), mt)
                         for i, d, name, t, v, sha, size, upd, mode, mt in entry.put]
                if any(len(m.sha) != 32 for m in metas):
                    raise ValueError("a digest is not 32 bytes")
            except (msgspec.DecodeError, ValueError) as exc:
                log.warning("store state log entry unreadable; the rest is ignored",
                            extra={"store": self.slug, "error": type(exc).__name__})
                break
            for m in metas:
                recs[m.id] = m
            for i in entry.removed:
                recs.pop(i, None)
            carried += entry.carried
            self.cursor, self.access, self.limits = entry.cursor, entry.access, dict(entry.limits)
            good, applied = end, applied + 1
        if good != len(data):
            log.info("store state log tail ignored (torn or unreadable)",
                     extra={"store": self.slug, "ignored_bytes": len(data) - good})
        self._log_size = good
        self._log_carried = sum(len(c) for _, c in carried)
        self._store_carried(carried)

    def _store_carried(self, carried: list[tuple[bytes, bytes]]) -> None:
        """Store in the blob cache the contents the log carried for records the mirror
        still names (the class's rule). A failure is logged: those contents are then
        missing, fetched again at the load's check when the control plane answers."""
        if not carried or self.blobs is None:
            return
        live = {m.sha for m in self.records.values()}
        try:
            stored = self.blobs.put_carried((d, c) for d, c in carried if d in live)
        except CacheError as e:
            log.warning("contents carried by the store state log not stored",
                        extra={"store": self.slug, "reason": e.reason})
            return
        if stored:
            log.info("contents carried by the store state log stored",
                     extra={"store": self.slug, "contents": stored})

    def _load_v4(self, m: _Mirror) -> None:
        """Take a decoded format-4 mirror (``load``). Raises ``ValueError`` / ``IndexError``
        for columns that do not add up (different lengths, a digest column of the wrong
        size, an index out of its table)."""
        c = m.columns
        n = len(c.id)
        if any(len(col) != n for col in (c.dir, c.name, c.type, c.version, c.size,
                                         c.updated_ns, c.mode, c.mtime_ns)) or len(c.sha256) != 64 * n:
            raise ValueError("columns of different lengths")
        digests = bytes.fromhex(c.sha256)  # ValueError for anything but hex digits...
        if len(digests) != 32 * n:  # ...and whitespace, which fromhex skips
            raise ValueError("digest column is not 64 hex digits per record")
        dirs = [sys.intern(d) for d in m.dirs]
        types = [_TYPES.get(t, t) for t in m.types]
        modes = [_shared(x) for x in m.modes]
        for col, table in ((c.dir, dirs), (c.type, types), (c.mode, modes)):
            if col and max(col) >= len(table):
                raise IndexError("an index out of its table")
        self.records = dict(zip(c.id, map(
            Meta, c.id, map(dirs.__getitem__, c.dir), c.name, map(types.__getitem__, c.type),
            c.version, [digests[i:i + 32] for i in range(0, 32 * n, 32)], c.size, c.updated_ns,
            map(modes.__getitem__, c.mode), c.mtime_ns)))
        self.cursor = m.cursor
        self.access = m.access
        self.limits = dict(m.limits)

    def _snapshot(self) -> _Snapshot:
        """The mirror now, for a base (a list of the ``Meta`` objects, which are never
        changed in place: a change replaces them). The contents held behind are written
        to the blob cache first (the class's rule: a base carries none)."""
        if self.blobs is not None:
            self.blobs.write_behind()
        return _Snapshot(list(self.records.values()), self.cursor, self.access,
                         dict(self.limits), os.urandom(8).hex())

    def encode(self, snap: _Snapshot | None = None) -> bytes:
        """The state (or ``snap``) as a format-4 base file (``StoreState``)."""
        return b"".join(self._encode_parts(snap if snap is not None else self._snapshot()))

    @staticmethod
    def _encode_parts(snap: _Snapshot) -> list[bytes | memoryview]:
        """``snap`` as a format-4 base file in pieces (their concatenation is the file): no
        object per record is made (the columns hold the mirror's own strings and ints;
        directories, types and modes are indices made once per distinct value). Each column
        is encoded by its own call and the pieces are never joined, so that in a worker
        thread no single call holds the GIL for long (the trio thread waits for it)."""
        recs = snap.recs
        dirs: dict[str, int] = {}
        types: dict[str | None, int] = {}
        modes: dict[int, int] = {}
        cols = [(b'"id":', [m.id for m in recs]),
                (b',"dir":', [dirs.setdefault(m.dir, len(dirs)) for m in recs]),
                (b',"name":', [m.name for m in recs]),
                (b',"type":', [types.setdefault(m.type, len(types)) for m in recs]),
                (b',"version":', [m.version for m in recs]),
                (b',"sha256":', None),
                (b',"size":', [m.size for m in recs]),
                (b',"updated_ns":', [m.updated_ns for m in recs]),
                (b',"mode":', [modes.setdefault(m.mode, len(modes)) for m in recs]),
                (b',"mtime_ns":', [m.mtime_ns for m in recs])]
        head = msgspec.json.encode({"format": FORMAT, "base": snap.base, "cursor": snap.cursor,
                                    "access": snap.access, "limits": snap.limits,
                                    "dirs": list(dirs), "types": list(types),
                                    "modes": list(modes)})
        parts: list[bytes | memoryview] = [head[:-1], b',"columns":{']
        for key, col in cols:
            parts.append(key)
            if col is None:  # the digests: one string of hex digits (no escaping needed)
                shas = [m.sha for m in recs]
                parts.append(b'"')
                parts += [binascii.hexlify(b"".join(shas[i:i + _CHUNK]))
                          for i in range(0, len(shas), _CHUNK)]
                parts.append(b'"')
            else:
                parts += _json_array(col)
        parts.append(b"}}")
        return parts

    def _write_base(self, snap: _Snapshot) -> int:
        """Write ``snap`` as the base file (tmp + rename); returns its size in bytes. Runs
        on the trio thread or a worker thread (it touches only ``snap`` and the files).
        Raises ``CacheError``."""
        tmp = self.path.with_suffix(".tmp")
        parts = self._encode_parts(snap)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
            try:
                os.fchmod(fd, FILE_MODE)
                for part in parts:
                    view = memoryview(part)
                    while view:
                        view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()  # a partial file would only take space
            raise cache_error(exc, f"saving the state of store {self.slug}") from exc
        return sum(map(len, parts))

    def _based(self, snap: _Snapshot, size: int) -> None:
        """The base ``snap`` is on disk: its log starts now with the changes made since the
        snapshot (``_since``), written at once. Raises ``CacheError`` (the log then starts
        at the next save; until it does, the base alone is the saved state)."""
        since, self._since = self._since or set(), None
        if self._reset_since:  # the mirror was replaced after the snapshot: rewrite again
            self._reset_since = False
            self.dirty = True
            return
        self._base_id, self._base_bytes, self._log_size, self._log_carried = snap.base, size, None, 0
        self._changed = since  # what changed before the snapshot is in the base
        self._append()
        self.dirty = False

    def compaction_due(self) -> bool:
        """Whether the next save rewrites the base: there is none for this mirror (a new
        snapshot, an earlier release's file), or the log with the frame of the records
        changed since the last save (estimated at the base's bytes per record) would pass
        ``LOG_FRACTION`` of it (and ``LOG_MIN``): a big batch of changes (a long catch-up)
        then goes into a base written by a worker thread, not a frame encoded on the trio
        thread. The contents the frames carried count apart (``CARRIED_MAX``)."""
        if self._base_id is None:
            return True
        frame = len(self._changed) * self._base_bytes / max(1, len(self.records))
        if self._log_carried > CARRIED_MAX:
            return True
        own = (self._log_size or 0) - self._log_carried
        return own + frame > max(LOG_MIN, self._base_bytes * LOG_FRACTION)

    def save(self) -> None:
        """Save on the calling thread: append the changes since the last save to the log
        (one ``write``), or rewrite the base when there is none for this mirror. Raises
        ``CacheError`` when it cannot (what is on disk is then an older, consistent state,
        and ``dirty`` stays set). While ``compact`` runs, only appends are made. Nothing is
        written when nothing changed since the last save."""
        if not self.dirty and self._base_id is not None:
            return
        if self._base_id is None:
            if self._compacting:
                return  # the running compaction is stale; the saver rewrites again after it
            snap = self._snapshot()
            self._since, self._reset_since = set(), False
            try:
                size = self._write_base(snap)
            except BaseException:
                self._since = None
                raise
            self._based(snap, size)
            return
        self._append()
        self.dirty = False

    def save_log(self) -> bool:
        """Append what changed since the last save to the log now, on the calling thread
        (one frame, one ``write``: the cost of the periodic save's frame, made per call), but
        only when the mirror has a base on disk that a frame can extend; never a base
        rewrite (that is the periodic saver's, off the trio thread). Returns whether the
        changes are on disk now (True too when nothing changed). Used for this sidecar's own
        committed writes (``StoreSync.save_committed``), so that a ``kill -9`` right after
        their ``close(2)`` returned leaves them in the saved mirror. Raises ``CacheError``
        (``dirty`` stays set: the periodic saver tries again)."""
        if not self.dirty:
            return True
        if self._base_id is None:
            return False  # a new snapshot or a reset: the saver writes its base first
        self._append()
        self.dirty = False
        return True

    async def save_async(self) -> None:
        """The periodic save (``StoreSync._saver``): an append, or, when due, a compaction
        whose encode and write run in a worker thread (``compact``). A compaction already
        running (the periodic saver's, when an unmount saves) is waited for first (it is
        bounded by the write of the base), so that once this returns no thread writes the
        store's files. Raises ``CacheError``."""
        if self._compacting:
            await self._compacted.wait()
        if self.compaction_due():
            await self.compact()
        else:
            self.save()

    async def compact(self) -> None:
        """Rewrite the base from the mirror as it is now, encoded and written in a worker
        thread (the trio thread only copies the list of entries); changes made meanwhile
        are appended to the old log (still valid until the rename) and start the new one.
        Raises ``CacheError`` (the old base and log stay in force)."""
        if self._compacting:
            return
        self._compacting, self._reset_since = True, False
        self._compacted = done = trio.Event()
        try:
            snap = self._snapshot()
            self._since = set()
            try:
                size = await trio.to_thread.run_sync(self._write_base, snap)
            except BaseException:
                self._since = None
                raise
            finally:
                self._compacting = False
            self._based(snap, size)
        finally:
            done.set()

    def _append(self) -> None:
        """Write one frame of what changed since the last one (``_changed``) to the log, in
        one ``write``; a new log (head + frame, the file truncated) when there is none for
        this base. Raises ``CacheError``; the log's whole frames stay as they were (a
        partial write is cut off by the next append)."""
        recs = self.records
        put: list[tuple[Any, ...]] = []
        removed: list[str] = []
        for i in self._changed:
            m = recs.get(i)
            if m is None:
                removed.append(i)
            else:
                put.append((m.id, m.dir, m.name, m.type, m.version, m.sha, m.size,
                            m.updated_ns, m.mode, m.mtime_ns))
        carried: list[tuple[bytes, bytes]] = []
        if self.blobs is not None and put:
            held = self.blobs.held_behind((row[5] for row in put), CARRY_MAX)
            if held is None:  # too much to carry: written to the blob cache first
                self.blobs.write_behind()
            else:
                carried = list(held.items())
        frame = _frame(_LOG_ENC.encode(_LogEntry(self.cursor, self.access, self.limits,
                                                 put, removed, carried)))
        size = self._log_size
        try:
            if size is None:  # a new log for this base
                assert self._base_id is not None  # appends extend a base (save, _based)
                data = _frame(_LOG_ENC.encode(_LogHead(LOG_FORMAT, self._base_id))) + frame
                self.close()
                self._log_fd = fd = os.open(
                    self.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
            else:
                data = frame
                fd = self._log_fd if self._log_fd is not None else self._open_log(size)
                if os.fstat(fd).st_nlink == 0:  # deleted since it was opened
                    raise FileNotFoundError(errno.ENOENT, "the store state log was removed")
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except FileNotFoundError as exc:  # the log went away: the base alone is saved
            self.close()
            self._base_id = None
            raise cache_error(exc, f"saving the state of store {self.slug}") from exc
        except OSError as exc:
            self.close()  # the next append opens it again and cuts a partial frame off
            raise cache_error(exc, f"saving the state of store {self.slug}") from exc
        self._log_size = len(data) if size is None else size + len(data)
        self._log_carried = (0 if size is None else self._log_carried) + sum(len(c) for _, c in carried)
        self._changed.clear()

    def _open_log(self, size: int) -> int:
        """Open the log to append after its first ``size`` bytes (its whole frames): a
        longer file (a torn tail, a failed append) is cut there first. Raises ``OSError``."""
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)  # a torn tail or a failed append
            os.lseek(fd, size, os.SEEK_SET)
        except BaseException:
            os.close(fd)
            raise
        self._log_fd = fd
        return fd

    def discard(self) -> None:
        """Delete the saved mirror (its base and its log; a missing one is no error): it
        held another store of this slug (deleted since). A failure is logged: the next
        load's own checks still apply."""
        self.close()
        for p in (self.path, self.log_path):
            try:
                p.unlink(missing_ok=True)
            except OSError as e:
                log.warning("saved store state not deleted", extra={"store": self.slug,
                                                                   "file": str(p), "error": str(e)})

    def close(self) -> None:
        """Close the log kept open between appends (a later append opens it again)."""
        fd, self._log_fd = self._log_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __del__(self) -> None:
        fd = getattr(self, "_log_fd", None)  # (also at interpreter exit: no helpers)
        if fd is not None:
            try:
                os.close(fd)
            except Exception:
                pass

    def _touch(self, record_id: str) -> None:
        self._changed.add(record_id)
        if self._since is not None:
            self._since.add(record_id)
        self.dirty = True

    def sha_of(self, record_id: str) -> str | None:
        """The sha256 of record ``record_id`` as last seen on the control plane, or None."""
        m = self.records.get(record_id)
        return m.sha256 if m is not None else None

    def reset(self, records: "list[Record] | list[Meta]", seq: int) -> None:
        """Replace the mirror with ``records`` (``Record`` or ``Meta``) at cursor ``seq``
        (the next save rewrites the base)."""
        self.records = {r.id: r if isinstance(r, Meta) else Meta.of(r) for r in records}
        self.cursor = seq
        self.dirty = True
        self._base_id = None
        self._changed.clear()
        if self._compacting:
            self._reset_since = True

    def put(self, r: Record) -> None:
        """Record ``r``'s state (a committed write of this sidecar, or a fetched record)."""
        self.records[r.id] = Meta.of(r)
        self._touch(r.id)

    def remove(self, record_id: str | None) -> None:
        """Forget record ``record_id`` (None and unknown ids are ignored)."""
        if record_id is not None and self.records.pop(record_id, None) is not None:
            self._touch(record_id)

    def committed(self, e: Entry) -> None:
        """Mirror what this sidecar's own committed outbox entry did on the control plane.
        The change feed leaves our own versions out (``skip_writer``), so this is how they
        reach the mirror; a restart or an offline start then shows them.
        A record is never moved back to an older version than the mirror holds: a replayed
        entry (left in the journal by a crash after it committed) is answered by its
        idempotency key with the record as of that commit, which a later version (caught
        up at start) may have replaced already."""
        if e.errno:
            return
        if e.op in ("put", "attrs") and e.record is not None:
            self._put_newer(e.record)
        elif e.op == "delete":
            self.remove(e.record_id)
            if e.record_id is not None and e.seq is not None:
                self._own_version(e.record_id, e.seq)
        elif e.op == "move" and e.record is not None:
            if e.record_id != e.record.id:  # moved over another record: the source is gone
                self.remove(e.record_id)
            self._put_newer(e.record)
        elif e.op == "move_prefix":
            for r in e.moved:
                self._put_newer(r)
                self._own_version(r.id, r.seq)

    def _own_version(self, record_id: str, seq: int) -> None:
        """Note a version of ours the feed leaves out (``own_newer``), unless passed."""
        if seq > self.cursor and seq > self.own_newer.get(record_id, 0):
            self.own_newer[record_id] = seq

    def older_than_own(self, ch: Change) -> bool:
        """Whether feed change ``ch`` is older than a version of its record this sidecar
        wrote and shows (``own_newer``): then it is not applied (to the tree nor to this
        mirror); the cursor still passes it. The one place of that rule."""
        own = self.own_newer.get(ch.record.id)
        if own is None:
            return False
        if own <= self.cursor:  # passed: nothing older can come
            del self.own_newer[ch.record.id]
            return False
        return ch.seq < own

    def drop_passed(self) -> None:
        """Forget the entries of ``own_newer`` the cursor has reached."""
        if self.own_newer:
            cur = self.cursor
            self.own_newer = {k: v for k, v in self.own_newer.items() if v > cur}

    def _put_newer(self, r: Record) -> None:
        """``put`` unless the mirror holds a newer version of ``r`` (``committed``)."""
        cur = self.records.get(r.id)
        if cur is None or cur.version <= r.version:
            self.put(r)

    def newest(self, record_id: str) -> Meta | None:
        """The mirror's entry of record ``record_id`` (its newest version known here), or None."""
        return self.records.get(record_id)

    def apply(self, ch: Change) -> None:
        """Apply one feed change: a delete removes the record, an update replaces an older or
        equal version; the cursor moves to ``ch.seq``."""
        rec = ch.record
        if rec.deleted:
            if self.records.pop(rec.id, None) is not None:
                self._touch(rec.id)
        else:
            cur = self.records.get(rec.id)
            if cur is None or cur.version <= rec.version:
                self.records[rec.id] = Meta.of(rec)
                self._touch(rec.id)
        self.cursor = max(self.cursor, ch.seq)
        self.dirty = True


async def catch_up(client: ApiClient, state: StoreState, blobs: BlobCache,
                   on_change: Callable[[Change], None] | None = None) -> bool:
    """Bring a loaded ``state`` up to date through the change feed (no waiting), storing the
    content of every change in ``blobs`` and handing each to ``on_change`` (when given).
    Returns False when the cursor is gone (410): the caller takes a full snapshot."""
    while True:
        try:
            page = await client.changes(state.slug, state.cursor, wait=0, content=True)
        except Gone:
            return False
        with blobs.batch():
            for ch in page.changes:
                if ch.record.content is not None:
                    blobs.put(ch.record.content.encode("utf-8"), ch.record.sha256)
                state.apply(ch)
                if on_change is not None:
                    on_change(ch)
        state.cursor = max(state.cursor, page.seq)
        if not page.changes:
            return True


def lag_seconds(rec: Record) -> float:
    """Seconds from ``rec.updated_at`` to now (never negative): the feed's delay."""
    return max(0.0, time.time() - rec.updated_at.timestamp())
