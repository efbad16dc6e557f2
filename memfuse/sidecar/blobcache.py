"""The sidecar's content cache: clean record content by sha256, in one SQLite file.

``BlobCache`` is what ``Filesystem.read`` answers from for a clean file, what the store
loader and the change feed fill, and what ``Sidecar._gc_blobs`` cleans. See its docstring for
durability (none needed: a cache) and errors (``CacheError`` only).
"""
from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import logging
import os
import sqlite3
import struct
import threading
from pathlib import Path
from collections.abc import Callable, Iterable
from typing import Any, Concatenate, Iterator, ParamSpec, TypeVar

from .. import procmem
from ..defs import sha256_hex
from .cachedir import private_file
from .cachedir import CacheError, cache_error, free_bytes

log = logging.getLogger("memfuse.mount")

TRIM_AFTER_BYTES = 16 << 20  # a bulk fill that wrote more gives the heap's free pages back
#: bytes of write-ahead log from which a put starts a checkpoint behind it, in a thread of its
#: own (``BlobCache._checkpoint_behind``); SQLite's own checkpoint (``AUTOCHECKPOINT_PAGES``)
#: is only the backstop of a log that thread cannot keep up with
CHECKPOINT_BEHIND_BYTES = 4 << 20
#: pages of write-ahead log at which a commit checkpoints by itself (SQLite's
#: ``wal_autocheckpoint``; 4 KiB pages: 64 MiB)
AUTOCHECKPOINT_PAGES = 16384
PUT_ROWS = 400  # blobs per INSERT of put_many: 800 parameters (SQLite before 3.32 allows 999)
#: links from a whole blob at most (``BlobCache.put_append``): the next append is stored
#: whole again, so a read resolves at most this many rows and the cache holds one whole copy
#: per ``APPEND_CHAIN_MAX`` appends of a file
APPEND_CHAIN_MAX = 16
#: sha256s whose stored content was checked since this process opened the file, at most
#: (``BlobCache._verified``: ~100 bytes each; past it the set starts empty again, and a blob
#: read again is hashed again)
VERIFIED_MAX = 1 << 17
#: contents ``put_behind`` holds in memory before it writes them, in one transaction: the
#: close of a created file stored its content with an autocommit ``INSERT`` of its own
#: (~50 us of CPU and ~12 KiB of log writes per 550-byte file on the benchmark machine)
BEHIND_MAX = 64
BEHIND_BYTES = 1 << 20
#: free bytes the cache disk must have beyond twice what waits before contents put behind
#: are written again after a write of them met a full disk (``BlobCache._write_behind``):
#: the space a drained journal gives back goes to accepted writes, not to a cache
FULL_HEADROOM = 1 << 20
#: where the wal-index (a WAL database's ``-shm`` file) keeps ``mxFrame`` (the log's last
#: valid frame, in the first copy of its header) and ``nBackfill`` (the frames already
#: copied into the database), 32-bit native byte order, and the bytes to read for both
#: (https://www.sqlite.org/walformat.html, "The WAL-Index Header"; ``_uncopied_bytes``)
WAL_INDEX = (16, 96, 100)


def _put_sql(n: int) -> str:
    return "INSERT OR IGNORE INTO blobs VALUES " + ",".join(["(?, ?)"] * n)


_PUT_SQL = _put_sql(PUT_ROWS)


def _trim_heap(db: sqlite3.Connection) -> None:
    """Give free memory back to the system after a big fill: SQLite's page cache of ``db``
    (``shrink_memory``) and the C heap's free pages (glibc ``malloc_trim(0)``; elsewhere
    nothing). A fill of 100,000 records passes ~250 MB of content and SQLite's in-memory
    journal through the heap; without this ~4 MiB more stay resident."""
    with contextlib.suppress(sqlite3.Error):
        db.execute("PRAGMA shrink_memory")
    procmem.trim()


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _locked(fn: Callable[Concatenate[BlobCache, _P], _R]) -> Callable[Concatenate[BlobCache, _P], _R]:
    """Run the method under the cache's lock (``BlobCache``: one thread at a time), after
    the contents put behind are written (``BlobCache._write_behind``): every method but
    the few that serve them from memory (``_locked_mem``) sees the file complete."""
    def locked(self: BlobCache, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            if self._behind:
                self._write_behind()
            return fn(self, *args, **kwargs)
    functools.update_wrapper(locked, fn)
    return locked


def _locked_mem(fn: Callable[Concatenate[BlobCache, _P], _R]) -> Callable[Concatenate[BlobCache, _P], _R]:
    """``_locked`` for the methods that serve the contents put behind from memory
    (``put_behind``, ``read``, ``get``, ``has``): nothing written first."""
    def locked(self: BlobCache, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            return fn(self, *args, **kwargs)
    functools.update_wrapper(locked, fn)
    return locked


class BlobCache:
    """Content-addressed cache of clean record content: one SQLite file, rows ``(sha256, data)``.

    One file instead of one file per record: loading a 10,000-record store is one transaction
    instead of 10,000 create-write-rename cycles, and a read is one indexed ``substr``. WAL with
    ``synchronous=NORMAL``: a crash never corrupts it; durability is the outbox's job, and
    anything missing is fetched again from the control plane.

    Threads: used from the trio thread, except ``put_many`` of a snapshot's fill, which the
    loader runs in a worker thread (SQLite releases the GIL while it writes, so the trio
    thread reads and decodes the next page meanwhile). Every method holds one lock
    (re-entrant; ``batch`` for its whole block, which never awaits), so the one connection
    is used by one thread at a time; a read on the trio thread then waits for at most one
    page being written (~20–30 ms for 1,000 records, only while a snapshot is taken).

    A snapshot fills it in *bulk mode* (``bulk``): the rollback journal kept in memory
    instead of WAL, so the content is written once into the file rather than into the log
    and then again into the file (nor are the index pages a page of inserts touches copied
    to a journal file), and ``synchronous=OFF``, so no commit waits for the disk; at its
    end one ``fsync`` makes everything durable, then the mode returns to WAL (after a big
    fill free heap pages are given back: ``_trim_heap``). A crash in
    the middle (of the process or of the system) may leave the file torn, and a torn file
    could answer wrong bytes for a sha256 it claims to hold. So a bulk fill first commits,
    durably and journaled, a marker row, and removes it only after the final ``fsync``: a
    file opened with the marker (or one SQLite cannot read) is deleted and created anew,
    empty (``rebuilt`` is True then; a saved store mirror then finds its blobs missing,
    and the loader takes a snapshot). The store mirror of a snapshot is saved only after
    ``bulk`` has returned, so a saved mirror never refers to blobs that are not durable.

    An append (``put_append``: a content that is an earlier blob plus a suffix, as a close
    after ``echo line >> f`` makes) is stored as a *link*: a row of ``appends`` ``(sha,
    base, base_len, chain, suffix)`` naming the blob it extends, so the close of an append
    to a 1 MiB file writes what it appends, not 1 MiB. ``read`` resolves a link through at
    most ``APPEND_CHAIN_MAX`` rows (every ``APPEND_CHAIN_MAX``-th append is stored whole
    again); ``gc`` keeps the base of every link it keeps. A link and its base are written in
    one SQLite transaction each (the base first), so a crash never leaves a link without its
    base; a link whose base is missing anyway (a file damaged by hand) reads as absent.

    Content is checked against the sha256 it is stored under before it is served
    (``read``, ``get``): the first time this process loads a blob or an append chain from
    the file, the whole content is hashed (~1 µs per KiB; an append chain link by link, each
    link against its own version's sha256), and a row that does not match, or that is
    malformed (a value that is not a BLOB, a length that does not add up), is deleted with a
    warning naming the sha256 (never content) and reads as absent, so it is fetched again
    from the control plane (``core.Filesystem.refetch``). A checked sha256 is remembered
    (``_verified``, at most ``VERIFIED_MAX``), so the later range reads of a big file (one
    ``read`` per 128 KiB FUSE request) and the warm path pay one ``substr`` as before: the
    check is against damage at rest (a disk, a hand, a tool changing the file while the
    sidecar is stopped), not against a file changed under the running sidecar. The disk
    cache of mountpoint-s3 does the same per block (a CRC32C of each block and of its
    header, checked on every block read; a mismatch is a cache miss and the block is
    removed); a content here is hashed whole once, as it is named by its sha256 anyway.

    Every failure of the file (a full disk, an I/O error) is raised as ``CacheError``
    (``ENOSPC`` / ``EIO``), never as a raw ``sqlite3`` exception. Unreferenced blobs are
    deleted by ``gc``; the write-ahead log is kept under 1 MiB and truncated by ``checkpoint``.
    """

    def __init__(self, path: Path, metrics: Any = None) -> None:
        """Open (create) the cache file ``path``; ``metrics``: the sidecar's, counting failed
        writes (or None). A file that cannot be trusted is started anew (``rebuilt``).
        Raises ``CacheError`` when the disk refuses to open it (``ENOSPC`` for a full disk:
        SQLite could not grow its ``-shm``; the files are left as they are), ``OSError`` when
        it cannot be made (a symlink in its place)."""
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.rebuilt = False  # the file was left by a crash during a bulk fill: made anew
        self._bulk = 0  # depth of nested ``bulk`` blocks (stores may load at the same time)
        self._bulk_bytes = 0  # content written by the current bulk fill
        self._in_batch = False
        self._lock = threading.RLock()
        # INVARIANT: every sha256 in it was read from the file by this process and its content
        # (whole, or its append chain resolved) hashed to it; a row it names is never
        # rewritten (content-addressed), only deleted (then the sha256 is discarded)
        self._verified: set[str] = set()  # GUARDED_BY: _lock
        # INVARIANT: each content's sha256 was computed by this process from those very
        # bytes (``put_behind``'s callers hash what they store); served from here by
        # ``read`` / ``get`` / ``has`` until written (``_write_behind``: before any other
        # method runs, and when it holds ``BEHIND_MAX`` contents or ``BEHIND_BYTES``)
        self._behind: dict[str, bytes] = {}  # GUARDED_BY: _lock
        self._behind_bytes = 0  # GUARDED_BY: _lock; the sum of ``_behind``'s lengths
        #: a write of the contents put behind met a full disk; cleared by one that succeeds
        self._disk_full = False  # GUARDED_BY: _lock
        self.dropped = 0  # damaged rows deleted by a check (``_load``)
        self.metrics = metrics  # counts failed writes (the sidecar's), or None
        private_file(path)  # 0600 (memory content); SQLite's -wal / -shm files get its mode
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        try:
            self._open()
        except sqlite3.Error as exc:  # a full disk (a -shm that cannot grow), an I/O error
            with contextlib.suppress(sqlite3.Error):
                self._db.close()
            raise cache_error(exc, "opening the blob cache") from exc
        self._checkpointer: threading.Thread | None = None

    @staticmethod
    def remove_files(path: Path) -> int:
        """Delete the cache file ``path`` and its ``-wal`` / ``-shm`` / ``-journal`` files
        (no connection may have it open); the bytes they held. A cache: its content is
        fetched again from the control plane. Never raises."""
        freed = 0
        for suffix in ("", "-wal", "-shm", "-journal"):
            with contextlib.suppress(OSError):
                f = f"{path}{suffix}"
                size = os.stat(f).st_blocks * 512
                os.unlink(f)
                freed += size
        return freed

    def _open(self) -> None:
        """Check the file just opened (started anew when it cannot be trusted: ``rebuilt``)
        and set it up. Raises ``sqlite3.Error``."""
        path = self.path
        if not self._trusted():
            log.warning("blob cache left by a crash during a bulk fill, or unreadable; "
                        "starting it anew (content is fetched again)", extra={"path": str(path)})
            self._db.close()
            self.remove_files(path)
            private_file(path)
            self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
            self.rebuilt = True
        self._db.execute("PRAGMA auto_vacuum=INCREMENTAL")  # new files only
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        # a commit that checkpoints copies the log into the file and fsyncs it: a put of a
        # 1 MiB content on the trio thread would pay that every time (the close of an
        # append to a 1 MiB file: ~3x its cost); the copy runs behind instead
        self._db.execute(f"PRAGMA wal_autocheckpoint={AUTOCHECKPOINT_PAGES}")
        self._db.execute("PRAGMA journal_size_limit=1048576")
        self._page_size = int(self._db.execute("PRAGMA page_size").fetchone()[0])
        self._db.execute("CREATE TABLE IF NOT EXISTS blobs (sha TEXT PRIMARY KEY, data BLOB NOT NULL)")
        self._db.execute("CREATE TABLE IF NOT EXISTS fill (what TEXT NOT NULL)")  # bulk's marker
        # appends stored as links to the blob they extend (``put_append``)
        self._db.execute("CREATE TABLE IF NOT EXISTS appends (sha TEXT PRIMARY KEY, base TEXT NOT NULL, "
                         "base_len INTEGER NOT NULL, chain INTEGER NOT NULL, suffix BLOB NOT NULL)")

    def _trusted(self) -> bool:
        """Whether the file can be used as it is: SQLite reads it and no bulk fill was cut
        short (the marker of ``bulk`` is absent)."""
        try:
            self._db.execute("PRAGMA schema_version").fetchall()  # reads the header
            if not self._db.execute("SELECT 1 FROM sqlite_master WHERE name = 'fill'").fetchall():
                return True  # never filled in bulk (or a new file)
            return not self._db.execute("SELECT 1 FROM fill LIMIT 1").fetchall()
        except sqlite3.OperationalError:
            raise  # locked, I/O error, full disk: not a sign of a torn file
        except sqlite3.DatabaseError:  # "file is not a database", "disk image is malformed"
            return False

    def _failed(self, exc: BaseException, what: str) -> CacheError:
        """The ``CacheError`` of a failed write (counted). On a full disk the write-ahead log
        is truncated (``wal_checkpoint(TRUNCATE)``, outside a transaction): a failed
        transaction left its frames in the log's file, space the disk needs back
        (docs/SEMANTICS.md, "The sidecar's own disk")."""
        err = cache_error(exc, what)
        if self.metrics is not None:
            self.metrics.cache_write_errors.labels(
                "blobs", errno.errorcode.get(err.errno, str(err.errno))).inc()
        if err.errno == errno.ENOSPC and not self._db.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                self._wal_truncate()
        return err

    def _wal_truncate(self) -> bool:
        """``wal_checkpoint(TRUNCATE)`` when it fits (``_checkpoint_fits``); whether it ran.
        The cache never spends the disk's reserve, which is the journal's
        (``cachedir.DiskReserve``). Raises ``sqlite3.Error``."""
        if not self._checkpoint_fits():
            return False
        self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        return True

    def _uncopied_bytes(self) -> int:
        """Bytes a checkpoint would still copy from the write-ahead log into the database
        file, at most what the file grows by: the frames past ``nBackfill`` up to
        ``mxFrame`` (read from the wal-index, ``-shm``: ``WAL_INDEX``) times the page size;
        0 when every frame was copied (a checkpoint then only truncates the log) or when it
        cannot be told (no ``-shm``)."""
        try:
            with open(f"{self.path}-shm", "rb") as f:
                head = f.read(WAL_INDEX[2])
        except OSError:
            return 0
        if len(head) < WAL_INDEX[2]:
            return 0
        mx_frame: int = struct.unpack_from("=I", head, WAL_INDEX[0])[0]
        backfill: int = struct.unpack_from("=I", head, WAL_INDEX[1])[0]
        return max(0, mx_frame - backfill) * self._page_size

    def _checkpoint_fits(self) -> bool:
        """Whether a checkpoint may run now (attack 14 F1): one that only truncates the log
        always; one that copies pages only while the disk has room for them beyond
        ``FULL_HEADROOM``. On a full disk a checkpoint copies what fits into the growing
        database file and fails, giving nothing back: the space an operator (or the drained
        journal) frees would go to it, not to the accepted writes (docs/SEMANTICS.md, "The
        sidecar's own disk")."""
        todo = self._uncopied_bytes()
        if not todo:
            return True
        free = free_bytes(self.path.parent)
        return free < 0 or free >= todo + FULL_HEADROOM

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Group many ``put`` calls into one transaction. Raises ``CacheError`` when the
        transaction cannot be written (nothing of it is kept then)."""
        with self._lock:
            behind = self._behind
            with self._batch():
                self._put_held(behind)  # the contents put behind go with it
                yield
            if behind:
                self._behind, self._behind_bytes = {}, 0

    @contextlib.contextmanager
    def _batch(self) -> Iterator[None]:
        try:
            self._db.execute("BEGIN")
        except sqlite3.Error as exc:
            raise self._failed(exc, "writing the blob cache") from exc
        self._in_batch = True
        try:
            yield
            self._db.execute("COMMIT")
            self._in_batch = False
            self._checkpoint_behind()
        except BaseException as exc:
            if self._db.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
            if isinstance(exc, sqlite3.Error):
                raise self._failed(exc, "writing the blob cache") from exc
            raise
        finally:
            self._in_batch = False

    @contextlib.contextmanager
    def bulk(self) -> Iterator[None]:
        """Bulk mode for a snapshot's fill (class docstring): inside, ``batch`` / ``put`` /
        ``put_many`` write the content once and never wait for the disk; on leaving, one
        ``fsync`` makes it all durable before the crash marker is removed, then WAL and
        ``synchronous=NORMAL`` are back. Nested blocks (stores loading at the same time)
        share the outermost one. Reads work as usual meanwhile; a failed ``batch`` rolls
        back as usual (the journal in memory). Raises ``CacheError`` when the marker cannot
        be written (nothing changed then). A failure while leaving (the ``fsync``) keeps the
        marker, so the next open starts the file anew, and ``synchronous=NORMAL``."""
        with self._lock:
            if self._behind:
                self._write_behind()  # in WAL mode, as they would have been
            self._start_bulk()
        self._bulk += 1
        try:
            yield
        finally:
            self._bulk -= 1
            if self._bulk == 0:
                self._end_bulk()

    def _start_bulk(self) -> None:
        if self._bulk == 0:
            try:
                self._db.execute("PRAGMA journal_mode=TRUNCATE").fetchall()
                self._db.execute("PRAGMA synchronous=FULL")
                self._db.execute("INSERT INTO fill VALUES ('filling')")  # durable now
                self._db.execute("PRAGMA journal_mode=MEMORY").fetchall()
            except sqlite3.Error as exc:
                self._db.execute("PRAGMA synchronous=NORMAL")
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("DELETE FROM fill")  # nothing was filled
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("PRAGMA journal_mode=WAL").fetchall()
                raise self._failed(exc, "writing the blob cache") from exc
            self._db.execute("PRAGMA synchronous=OFF")

    @_locked
    def _end_bulk(self) -> None:
        self._db.execute("PRAGMA synchronous=FULL")
        try:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.fsync(fd)  # every page of the fill on disk before the marker goes
            finally:
                os.close(fd)
            self._db.execute("PRAGMA journal_mode=TRUNCATE").fetchall()
            self._db.execute("DELETE FROM fill")  # a durable, journaled commit
            self._db.execute("PRAGMA journal_mode=WAL").fetchall()
        except (OSError, sqlite3.Error) as exc:
            log.warning("blob cache bulk fill could not be made durable; the cache starts "
                        "anew at the next start", extra={"error": type(exc).__name__})
        finally:
            self._db.execute("PRAGMA synchronous=NORMAL")
            if self._bulk_bytes > TRIM_AFTER_BYTES:
                _trim_heap(self._db)
            self._bulk_bytes = 0

    @_locked_mem
    def has(self, sha: str) -> bool:
        """Whether the blob with this sha256 (64 hex digits) is held (whole or as an append
        link whose bases are held, or put behind)."""
        if sha in self._behind:
            return True
        if self._db.execute("SELECT 1 FROM blobs WHERE sha=?", (sha,)).fetchone() is not None:
            return True
        return self._link_chain(sha) is not None

    def _link_chain(self, sha: str) -> list[tuple[str, int, int]] | None:
        """The links from append blob ``sha`` down to the whole blob it rests on:
        ``[(sha, base_len, suffix_len), …]`` newest first, then ``(whole sha, size, 0)``;
        None when ``sha`` is not a link or a base is missing. At most
        ``APPEND_CHAIN_MAX + 1`` indexed point reads (a longer chain, never written by
        ``put_append``, reads as absent)."""
        out: list[tuple[str, int, int]] = []
        cur = sha
        for _ in range(APPEND_CHAIN_MAX + 1):
            row = self._db.execute("SELECT base, base_len, length(suffix) FROM appends WHERE sha=?",
                                   (cur,)).fetchone()
            if row is None:
                if not out:
                    return None
                whole = self._db.execute("SELECT length(data) FROM blobs WHERE sha=?", (cur,)).fetchone()
                if whole is None or whole[0] != out[-1][1]:
                    return None
                out.append((cur, int(whole[0]), 0))
                return out
            out.append((cur, int(row[1]), int(row[2])))
            cur = row[0]
        return None

    def missing(self, shas: Iterable[str]) -> set[str]:
        """The sha256s of ``shas`` (an iterable of 64-hex-digit strings) not held:
        ``missing_digests`` for callers holding hex digits (a string that is not hex is
        never held). Raises ``CacheError(EIO)`` when the file cannot be read."""
        want: dict[bytes, str] = {}
        out: set[str] = set()
        for sha in shas:
            try:
                want[bytes.fromhex(sha)] = sha
            except (ValueError, TypeError):
                out.add(sha)
        return out | {want[d] for d in self.missing_digests(want)}

    @_locked
    def missing_digests(self, digests: Iterable[bytes]) -> set[bytes]:
        """The digests of ``digests`` (an iterable of sha256s as 32 ``bytes``) not held: the
        same as ``missing`` without a hex string per digest (a 100,000-record store asks
        for 100,000). One scan of the primary key (4,096 rows at a time), each key compared
        as bytes; ~0.3 µs per blob; then a digest not held whole is held when it is an
        append link whose chain resolves (``_link_chain``: a few point reads; a broken
        one counts as missing, so it is fetched again). Raises ``CacheError(EIO)`` when the
        file cannot be read."""
        out = set(digests)
        if not out:
            return out
        discard, fromhex = out.discard, bytes.fromhex
        try:
            cur = self._db.execute("SELECT sha FROM blobs")
            while out:
                rows = cur.fetchmany(4096)
                if not rows:
                    break
                for (have,) in rows:
                    try:
                        discard(fromhex(have))
                    except (ValueError, TypeError):  # not a digest: nobody asks for it
                        pass
            cur.close()
            if out and self._behind:  # not written (the write failed): held in memory
                for sha in self._behind:
                    discard(fromhex(sha))
            if out and self._db.execute("SELECT 1 FROM appends LIMIT 1").fetchone() is not None:
                # append links: held when their chain resolves (a broken one is fetched again)
                for d in list(out):
                    if self._link_chain(d.hex()) is not None:
                        discard(d)
        except sqlite3.Error as exc:
            raise CacheError(errno.EIO, f"the sidecar's blob cache cannot be read "
                                        f"({type(exc).__name__})") from exc
        return out

    @_locked
    def gc_digests(self, keep: set[bytes]) -> int:
        """Delete every blob whose sha256 is not in ``keep`` (sha256s as 32 ``bytes``: the
        store mirrors' and the tree's own objects, nothing per blob is made to build it),
        then ``checkpoint``; return how many were deleted. The base of every kept append
        link is kept (and its base, down to the whole blob). One scan of the primary key
        (4,096 rows at a time), then one ``DELETE`` per unreferenced blob in one
        transaction. Raises ``CacheError`` when the file cannot be written."""
        drop: list[tuple[str]] = []
        fromhex = bytes.fromhex
        for sha in [sha for sha in self._behind if fromhex(sha) not in keep]:
            self._behind_bytes -= len(self._behind.pop(sha))  # not written (its write failed)
        try:
            links = {sha: base for sha, base in self._db.execute("SELECT sha, base FROM appends")}
            if links:
                keep = set(keep)
                for sha in list(links):
                    try:
                        if fromhex(sha) not in keep:
                            continue
                    except (ValueError, TypeError):
                        continue
                    base: str | None = links.get(sha)
                    for _ in range(APPEND_CHAIN_MAX + 1):  # a chain is short; a cycle (never
                        if base is None:                   # written) cannot hold the scan
                            break
                        try:
                            d = fromhex(base)
                        except (ValueError, TypeError):
                            break
                        keep.add(d)
                        base = links.get(base)
            cur = self._db.execute("SELECT sha FROM blobs UNION ALL SELECT sha FROM appends")
            while True:
                rows = cur.fetchmany(4096)
                if not rows:
                    break
                for row in rows:
                    try:
                        held = fromhex(row[0]) in keep
                    except (ValueError, TypeError):  # not a digest: referenced by nothing
                        held = False
                    if not held:
                        drop.append(row)
            cur.close()
            if drop:
                self._db.execute("BEGIN")
                try:
                    for (s_,) in drop:
                        self._verified.discard(s_)
                    self._db.executemany("DELETE FROM blobs WHERE sha=?", drop)
                    if links:
                        self._db.executemany("DELETE FROM appends WHERE sha=?", drop)
                    self._db.execute("COMMIT")
                except BaseException:
                    if self._db.in_transaction:
                        with contextlib.suppress(sqlite3.Error):
                            self._db.execute("ROLLBACK")
                    raise
        except sqlite3.Error as exc:
            raise self._failed(exc, "cleaning the blob cache") from exc
        self.checkpoint()
        return len(drop)

    @_locked
    def put(self, data: bytes, sha: str | None = None) -> str:
        """Store ``data``; return its sha256 (computed when not given; a given one is not
        checked here: reads check it, ``_load``). Nothing is written when ``sha`` is held
        already, whole or as an append link whose chain resolves (``put_append``; a link
        whose chain is broken is replaced by the whole content)."""
        return self._put(data, sha or sha256_hex(data))

    def _put(self, data: bytes, sha: str) -> str:
        try:
            # a content held as an append link is not stored whole again (the change feed
            # brings back the content of this sidecar's own appends); a link whose chain is
            # broken (a base deleted) can never be read: it gives way to the whole content
            if self._db.execute("SELECT 1 FROM appends WHERE sha=?", (sha,)).fetchone() is not None:
                if self._link_chain(sha) is not None:
                    return sha
                self._db.execute("DELETE FROM appends WHERE sha=?", (sha,))
            self._db.execute("INSERT OR IGNORE INTO blobs VALUES (?, ?)", (sha, data))
        except sqlite3.Error as exc:
            if self._in_batch:
                raise  # batch() rolls the whole transaction back and raises CacheError
            raise self._failed(exc, "writing the blob cache") from exc
        if not self._in_batch:
            self._checkpoint_behind()
        return sha

    def _put_held(self, held: dict[str, bytes]) -> None:
        """``_put`` of each content of ``held`` (``{sha256 hex: content}``), inside a
        ``_batch``, in a fixed number of statements per ``PUT_ROWS`` contents instead of
        two per content: one ``SELECT`` of those held as append links (a link whose chain
        resolves keeps them from being stored whole; a broken one is deleted), one
        multi-row ``INSERT OR IGNORE``. The write behind a close's ``put_behind``
        (``BEHIND_MAX`` contents, on the trio thread) was 2 statements a content. Raises
        ``sqlite3.Error`` (``_batch`` rolls back and raises ``CacheError``)."""
        if not held:
            return
        shas = list(held)
        linked: list[str] = []
        for k in range(0, len(shas), PUT_ROWS):
            chunk = shas[k:k + PUT_ROWS]
            linked += [r[0] for r in self._db.execute(
                "SELECT sha FROM appends WHERE sha IN (" + ",".join("?" * len(chunk)) + ")", chunk)]
        skip: set[str] = set()
        for sha in linked:  # (rare: the feed bringing back the content of our own append)
            if self._link_chain(sha) is not None:
                skip.add(sha)
            else:
                self._db.execute("DELETE FROM appends WHERE sha=?", (sha,))
        values: list[str | bytes] = [v for sha in shas if sha not in skip for v in (sha, held[sha])]
        step = 2 * PUT_ROWS
        for k in range(0, len(values), step):
            part = values[k:k + step]
            self._db.execute(_PUT_SQL if len(part) == step else _put_sql(len(part) // 2), part)

    @_locked_mem
    def put_behind(self, data: bytes, sha: str) -> None:
        """``put`` for a content whose sha256 ``sha`` the caller computed from ``data``
        itself (never a sha256 another party claims: those are checked at their first
        load from the file): held in memory and written with others in one transaction
        (``_write_behind``: before any method other than ``read`` / ``get`` / ``has`` /
        ``put_behind`` runs, inside the next ``batch``, once ``BEHIND_MAX`` contents or
        ``BEHIND_BYTES`` wait, and at ``write_behind``: the sidecar's, twice a second). Meanwhile those three serve it from memory. A cache, not a
        durable copy: a ``kill -9`` loses what waits (a store's load finds it missing and
        fetches it, INVARIANTS.md). Raises ``CacheError`` when a write it had to make
        failed: then ``data`` is not held (what waited before stays in memory, served, and
        is written at the next chance)."""
        if self._in_batch or self._bulk:
            self._put(data, sha)
            return
        if sha in self._behind:
            return
        self._behind[sha] = data
        self._behind_bytes += len(data)
        if len(self._behind) >= BEHIND_MAX or self._behind_bytes >= BEHIND_BYTES:
            try:
                self._write_behind(quiet=False)
            except CacheError:
                kept = self._behind.pop(sha, None)
                if kept is not None:
                    self._behind_bytes -= len(kept)
                raise

    @_locked_mem
    def held_behind(self, digests: Iterable[bytes], max_bytes: int) -> dict[bytes, bytes] | None:
        """The contents of ``digests`` (sha256s as 32 ``bytes``) held only in memory now
        (put behind, not written yet), ``{digest: content}``; None when together they pass
        ``max_bytes`` (the caller then writes them: ``write_behind``). Nothing is written:
        a store mirror's log frame carries these contents instead (``StoreState``'s rule,
        ``sync.CARRY_MAX``), so a close need not write a blob-cache transaction of its own."""
        behind = self._behind
        if not behind:
            return {}
        out: dict[bytes, bytes] = {}
        size = 0
        for d in digests:
            data = behind.get(d.hex())
            if data is not None:
                size += len(data)
                if size > max_bytes:
                    return None
                out[d] = data
        return out

    @_locked
    def put_carried(self, rows: Iterable[tuple[bytes, bytes]]) -> int:
        """Store the contents a store mirror's log carried (``StoreState.load``: the
        contents of this sidecar's own closes, held only in memory when their frame was
        written), ``[(sha256 as 32 bytes, content)]``, each only when its content hashes to
        its digest and it is not held already; returns how many were stored. Raises
        ``CacheError`` when the file cannot be written."""
        want = {d: data for d, data in rows if hashlib.sha256(data).digest() == d}
        missing = self.missing_digests(want)
        if not missing:
            return 0
        with self.batch():
            for d in missing:
                self._put(want[d], d.hex())
        return len(missing)

    @_locked_mem
    def write_behind(self) -> None:
        """Write the contents put behind now (``put_behind``; the sidecar's
        ``_blobs_behind`` task calls it every ``BLOBS_BEHIND_EVERY`` s). A failure is
        logged; they stay in memory, served, and are written at the next chance."""
        if self._behind:
            self._write_behind()

    def _write_behind(self, quiet: bool = True) -> None:
        """Write the contents put behind in one transaction (``put``'s rule for each).
        When that fails they stay in memory, served and written at the next chance:
        logged (``quiet``) or raised as ``CacheError``. After a full disk, the next chance
        is once the disk has ``FULL_HEADROOM`` bytes free beyond twice what waits (not
        tried before: ``ENOSPC`` at once, not logged when ``quiet``). Under the lock."""
        if self._disk_full and not self._room():
            if not quiet:
                raise CacheError(errno.ENOSPC, "the sidecar's cache disk is full (writing the "
                                               "blob cache)")
            return
        try:
            with self._batch():
                self._put_held(self._behind)
        except CacheError as err:
            self._disk_full = err.errno == errno.ENOSPC
            if not quiet:
                raise
            log.warning("blob cache write failed; contents kept in memory and written later",
                        extra={"contents": len(self._behind), "reason": err.reason})
            return
        self._behind, self._behind_bytes, self._disk_full = {}, 0, False

    def _room(self) -> bool:
        """The cache disk has room for the contents put behind: ``FULL_HEADROOM`` bytes
        free beyond twice their size (True when it cannot be told)."""
        try:
            st = os.statvfs(self.path.parent)
        except OSError:
            return True
        return st.f_bavail * st.f_frsize >= 2 * self._behind_bytes + FULL_HEADROOM

    @_locked
    def put_append(self, sha: str, base: str, base_len: int, suffix: bytes) -> bool:
        """Store the content whose sha256 is ``sha`` as blob ``base`` (``base_len`` bytes)
        followed by ``suffix``: a link row of a few bytes beside ``suffix`` instead of the
        whole content (class docstring). True when it is held afterwards (linked now, or
        held already); False when the caller must ``put`` it whole: ``base`` is not held
        with that length, or its chain has ``APPEND_CHAIN_MAX`` links already (the periodic
        whole copy), or ``suffix`` is empty. ``sha`` is not checked (the caller hashed the
        content: ``memfuse.hashstate``). Raises ``CacheError`` when the file cannot be
        written (nothing stored then)."""
        if not suffix or sha == base:
            return False
        try:
            if self._db.execute("SELECT 1 FROM blobs WHERE sha=? UNION ALL SELECT 1 FROM appends WHERE sha=?",
                                (sha, sha)).fetchone() is not None:
                return True
            row = self._db.execute("SELECT chain, base_len + length(suffix) FROM appends WHERE sha=?",
                                   (base,)).fetchone()
            if row is not None:
                chain, size = int(row[0]) + 1, int(row[1])
            else:
                whole = self._db.execute("SELECT length(data) FROM blobs WHERE sha=?", (base,)).fetchone()
                if whole is None:
                    return False
                chain, size = 1, int(whole[0])
            if size != base_len or chain > APPEND_CHAIN_MAX:
                return False
            self._db.execute("INSERT INTO appends VALUES (?, ?, ?, ?, ?)", (sha, base, base_len, chain, suffix))
        except sqlite3.Error as exc:
            if self._in_batch:
                raise
            raise self._failed(exc, "writing the blob cache") from exc
        if not self._in_batch:
            self._checkpoint_behind()
        return True

    def _checkpoint_behind(self) -> None:
        """Once the write-ahead log holds ``CHECKPOINT_BEHIND_BYTES``, copy it into the file
        from a thread of its own (a second connection, ``wal_checkpoint(PASSIVE)``: readers
        and writers of this connection go on meanwhile), one at a time; never in a bulk
        fill (no log then). A failure is logged at debug level: the next put starts another,
        SQLite's own checkpoint is the backstop."""
        if self._bulk or (self._checkpointer is not None and self._checkpointer.is_alive()):
            return
        try:
            if os.stat(f"{self.path}-wal").st_size < CHECKPOINT_BEHIND_BYTES:
                return
        except OSError:
            return
        if not self._checkpoint_fits():  # the disk's last space goes to accepted writes
            return
        t = threading.Thread(target=self._checkpoint_thread, name="blobcache-checkpoint", daemon=True)
        self._checkpointer = t
        t.start()

    def _checkpoint_thread(self) -> None:
        try:
            db = sqlite3.connect(str(self.path), isolation_level=None)
            try:
                db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            finally:
                db.close()
        except sqlite3.Error as exc:
            log.debug("blob cache checkpoint failed; tried again later", extra={"error": str(exc)[:200]})

    @_locked
    def put_many(self, rows: list[tuple[str, bytes]]) -> None:
        """Store many blobs, ``[(sha256 hex, data)]`` (sha256s not checked), ``PUT_ROWS`` a
        statement (one multi-row ``INSERT``: SQLite runs it without the GIL, so a worker
        thread writing a page is not stalled for the GIL once per row while the trio thread
        decodes; ``executemany`` takes the GIL back after every row); inside ``batch`` as
        ``put`` is (its failure rolls the batch back), else in its own transaction. Raises
        ``CacheError`` when the file cannot be written."""
        if not self._in_batch:
            with self.batch():
                self.put_many(rows)
            return
        if self._bulk:
            self._bulk_bytes += sum(len(row[1]) for row in rows)
        for k in range(0, len(rows), PUT_ROWS):
            chunk = rows[k:k + PUT_ROWS]
            sql = _PUT_SQL if len(chunk) == PUT_ROWS else _put_sql(len(chunk))
            self._db.execute(sql, [v for row in chunk for v in row])

    @_locked_mem
    def read(self, sha: str, off: int = 0, size: int = -1) -> bytes:
        """Bytes ``[off, off+size)`` of a blob (all from ``off`` when ``size`` < 0), checked
        against ``sha`` (class docstring: hashed whole at its first load by this process,
        ``_load``; a content put behind and not written yet: from memory); ``b""`` when
        absent, or damaged (then deleted). Raises ``CacheError(EIO)`` when the file cannot
        be read."""
        data = self._behind.get(sha)
        if data is not None:
            if off == 0 and (size < 0 or size >= len(data)):
                return data
            return data[off:] if size < 0 else data[off:off + size]
        try:
            if sha in self._verified:
                try:
                    return self._read_checked(sha, off, size)
                except (TypeError, ValueError):  # the row changed since it was checked
                    self._verified.discard(sha)
            data = self._load(sha)
        except sqlite3.Error as exc:
            raise CacheError(errno.EIO, f"the sidecar's blob cache cannot be read "
                                        f"({type(exc).__name__})") from exc
        if data is None:
            return b""
        if off == 0 and (size < 0 or size >= len(data)):
            return data
        return data[off:] if size < 0 else data[off:off + size]

    def _read_checked(self, sha: str, off: int, size: int) -> bytes:
        """``read`` of a sha256 in ``_verified``: one ``substr`` (or one per link)."""
        if size < 0:
            row = self._db.execute("SELECT substr(data, ?) FROM blobs WHERE sha=?",
                                   (off + 1, sha)).fetchone()
        else:
            row = self._db.execute("SELECT substr(data, ?, ?) FROM blobs WHERE sha=?",
                                   (off + 1, size, sha)).fetchone()
        if row is None:
            return self._read_link(sha, off, size)
        return bytes(row[0]) if row[0] is not None else b""

    @_locked_mem
    def get(self, sha: str) -> bytes | None:
        """The whole content whose sha256 is ``sha``, checked (hashed on every call: a
        write's base, a journal's recovery; a content put behind and not written yet:
        from memory), or None when absent or damaged (then deleted, ``_load``). Raises
        ``CacheError(EIO)`` when the file cannot be read."""
        data = self._behind.get(sha)
        if data is not None:
            return data
        try:
            self._verified.discard(sha)
            return self._load(sha)
        except sqlite3.Error as exc:
            raise CacheError(errno.EIO, f"the sidecar's blob cache cannot be read "
                                        f"({type(exc).__name__})") from exc

    def _load(self, sha: str) -> bytes | None:
        """The whole content stored under ``sha`` (a whole blob, else an append chain
        resolved), hashed and compared with ``sha``; None when absent. A row whose content
        does not hash to its sha256, or is malformed (not a BLOB; a chain whose lengths do
        not add up), is deleted (``_drop``): so is every link resting on a deleted one of
        the chain read; the rest of the chain (checked link by link, oldest first, each
        against its own sha256) is kept. Checked sha256s join ``_verified``. Raises
        ``sqlite3.Error``."""
        row = self._db.execute("SELECT data FROM blobs WHERE sha=?", (sha,)).fetchone()
        if row is not None:
            data = row[0]
            if isinstance(data, bytes) and hashlib.sha256(data).hexdigest() == sha:
                self._remember(sha)
                return data
            self._drop([sha], "blob", "not a BLOB" if not isinstance(data, bytes) else "sha256 mismatch")
        # an append link: [(sha, base_len, suffix)] newest first, to the whole blob
        links: list[tuple[str, int, bytes]] = []
        cur = sha
        for _ in range(APPEND_CHAIN_MAX + 1):  # a chain is short; a cycle cannot hold it
            r = self._db.execute("SELECT base, base_len, suffix FROM appends WHERE sha=?", (cur,)).fetchone()
            if r is None:
                break
            base, base_len, suffix = r
            if not isinstance(suffix, bytes) or not isinstance(base, str) or not isinstance(base_len, int):
                self._drop([s for s, _, _ in links] + [cur], "append link", "malformed row")
                return None
            links.append((cur, base_len, suffix))
            cur = base
        else:
            self._drop([s for s, _, _ in links], "append link", "chain too long")
            return None
        if not links:
            return None
        whole = self._db.execute("SELECT data FROM blobs WHERE sha=?", (cur,)).fetchone()
        if whole is None:
            return None  # a broken chain (its base deleted): absent, as before
        base_data = whole[0]
        if not isinstance(base_data, bytes):
            self._drop([cur], "blob", "not a BLOB")
            self._drop([s for s, _, _ in links], "append link", "its base was damaged")
            return None
        h = hashlib.sha256(base_data)
        if h.hexdigest() != cur:
            self._drop([cur], "blob", "sha256 mismatch")
            self._drop([s for s, _, _ in links], "append link", "its base was damaged")
            return None
        self._remember(cur)
        parts = [base_data]
        size = len(base_data)
        for i in range(len(links) - 1, -1, -1):  # oldest first
            s_, base_len, suffix = links[i]
            h.update(suffix)
            if base_len != size or h.copy().hexdigest() != s_:
                # the damaged link first (named in the log), then the links resting on it
                self._drop([s_] + [s for s, _, _ in links[:i]], "append link",
                           "length mismatch" if base_len != size else "sha256 mismatch")
                return None
            self._remember(s_)
            parts.append(suffix)
            size += len(suffix)
        return b"".join(parts)

    def _remember(self, sha: str) -> None:
        if len(self._verified) >= VERIFIED_MAX:
            self._verified.clear()
        self._verified.add(sha)

    def _drop(self, shas: list[str], what: str, reason: str) -> None:
        """Delete the damaged rows ``shas`` (whole blobs and append links) found by a check,
        with a warning naming them (never content); a failure to delete is logged (the
        check runs again at the next load). They read as absent from now on."""
        if not shas:
            return
        for s_ in shas:
            self._verified.discard(s_)
        self.dropped += len(shas)
        log.warning(f"blob cache {what} damaged; dropped (its content is fetched again from "
                    "the control plane)", extra={"sha256": shas[0], "rows": len(shas), "reason": reason})
        try:
            rows = [(s_,) for s_ in shas]
            self._db.executemany("DELETE FROM blobs WHERE sha=?", rows)
            self._db.executemany("DELETE FROM appends WHERE sha=?", rows)
        except sqlite3.Error as exc:
            log.warning("blob cache damaged rows could not be deleted",
                        extra={"error": type(exc).__name__})

    def _read_link(self, sha: str, off: int, size: int) -> bytes:
        """``read`` of an append link: the parts of ``[off, off+size)`` from each link's
        suffix and from the whole blob at the chain's end, one ``substr`` each; ``b""``
        when ``sha`` is not held or its chain is broken."""
        chain = self._link_chain(sha)
        if chain is None:
            return b""
        total = chain[0][1] + chain[0][2]
        end = total if size < 0 else min(total, off + size)
        if off >= end:
            return b""
        parts: list[bytes] = []
        for i, (s_, base_len, suffix_len) in enumerate(chain):
            lo, hi = max(off, base_len), min(end, base_len + suffix_len)
            if i == len(chain) - 1:  # the whole blob: bytes [0, base_len)
                lo, hi = off, min(end, base_len)
                if hi > lo:
                    r = self._db.execute("SELECT substr(data, ?, ?) FROM blobs WHERE sha=?",
                                         (lo + 1, hi - lo, s_)).fetchone()
                    parts.append(bytes(r[0]) if r is not None and r[0] is not None else b"")
            elif hi > lo:
                r = self._db.execute("SELECT substr(suffix, ?, ?) FROM appends WHERE sha=?",
                                     (lo - base_len + 1, hi - lo, s_)).fetchone()
                parts.append(bytes(r[0]) if r is not None and r[0] is not None else b"")
            if base_len <= off:
                break
        out = b"".join(reversed(parts))
        return out if len(out) == end - off else b""

    def gc(self, keep: set[str]) -> int:
        """Delete every blob whose sha256 (64 hex digits) is not in ``keep``, then
        ``checkpoint``; return how many were deleted: ``gc_digests`` for callers holding hex
        digits. Raises ``CacheError`` when the file cannot be written."""
        digests: set[bytes] = set()
        for sha in keep:
            with contextlib.suppress(ValueError, TypeError):  # not hex: names no blob
                digests.add(bytes.fromhex(sha))
        return self.gc_digests(digests)

    @_locked
    def checkpoint(self) -> None:
        """Copy the write-ahead log into the file and truncate it; give free pages back
        (files created with incremental auto-vacuum). Failures are ignored (tried again next
        time): the log then stays, bounded by ``journal_size_limit``. The log is truncated
        first: on a full disk the vacuum (which writes to the log) fails."""
        with contextlib.suppress(sqlite3.Error):
            self._wal_truncate()
        with contextlib.suppress(sqlite3.Error):
            self._db.execute("PRAGMA incremental_vacuum").fetchall()  # one page per step
            self._wal_truncate()

    @_locked
    def count(self) -> tuple[int, int]:
        """(blobs and append links, bytes stored: whole blobs' content plus links' suffixes)."""
        row = self._db.execute("SELECT COUNT(*), COALESCE(SUM(LENGTH(data)), 0) FROM blobs").fetchone()
        link = self._db.execute("SELECT COUNT(*), COALESCE(SUM(LENGTH(suffix)), 0) FROM appends").fetchone()
        return int(row[0]) + int(link[0]), int(row[1]) + int(link[1])

    def close(self) -> None:
        """Close the database file (after a checkpoint running behind, at most 30 s)."""
        t = self._checkpointer
        if t is not None:
            t.join(timeout=30)
        with self._lock:
            if self._behind:
                self._write_behind()
            self._db.close()
