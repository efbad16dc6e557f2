"""Owner-only permissions for the sidecar's cache directory.

The cache directory holds memory content (``blobs.db``), the outbox journal (``outbox.db``:
accepted writes, and refused content kept for the agent to fix, e.g. a key refused as a
secret), the store mirrors, ``dirs.json``, ``mount.json``, the lock and the admin socket. None
of it is for other users: directories are ``0700`` and files ``0600`` (the admin socket
included), whatever the umask.

- ``secure_cache_dir(path)`` runs at start: creates the directory ``0700`` or, when it exists,
  tightens it and everything below it (group / other bits cleared; owner bits kept) and logs
  what it changed.
- ``private_file(path)`` creates an empty file ``0600`` (before SQLite opens it: SQLite gives
  its ``-wal`` / ``-shm`` / ``-journal`` files the database file's mode) or tightens an
  existing one.
- ``write_private(path, text)`` writes a file created ``0600`` (the tmp file of an atomic
  tmp + rename).
- ``CacheError`` is what every failed write to the cache directory raises (``cache_error``
  turns a ``sqlite3`` / ``OSError`` into one; ``cache_errno`` gives its errno): the FUSE
  adapter maps it to its errno without a traceback.

Both open with ``O_NOFOLLOW``: a symlink planted in the cache directory (``blobs.db`` ->
``/etc/something``) is refused (``OSError`` ``ELOOP`` naming the path) instead of followed,
so its target is never chmod-ed, truncated or written, and SQLite never opens it.
"""
from __future__ import annotations

import errno
import logging
import os
import sqlite3
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

_T = TypeVar("_T")

log = logging.getLogger("memfuse.mount")

DIR_MODE = 0o700
FILE_MODE = 0o600
_OTHERS = stat.S_IRWXG | stat.S_IRWXO


def _tighten(path: Path, st: os.stat_result) -> bool:
    """Clear the group / other bits of ``path`` (not following symlinks); True when it
    changed."""
    mode = stat.S_IMODE(st.st_mode)
    if not mode & _OTHERS or stat.S_ISLNK(st.st_mode):
        return False
    os.chmod(path, mode & ~_OTHERS)
    return True


def secure_cache_dir(path: Path) -> int:
    """Make ``path`` (created with parents when missing) and everything in it owner-only:
    directories ``0700``, files ``0600`` at most (permission bits above the owner's are
    cleared, owner bits kept). Returns how many entries were tightened; when any were, one
    INFO line says so. Raises ``OSError`` when the directory cannot be created; an entry that
    cannot be changed (owned by someone else) is logged and skipped."""
    path.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    changed, failed = 0, 0
    entries = [path]
    for root, dirs, files in os.walk(path):
        entries += [Path(root) / d for d in dirs] + [Path(root) / f for f in files]
    for p in entries:
        try:
            if _tighten(p, p.lstat()):
                changed += 1
        except FileNotFoundError:
            continue
        except OSError as e:
            failed += 1
            log.warning("cache entry left with its permissions", extra={
                "path": str(p), "error": e.strerror or str(e)})
    if changed:
        log.info("cache directory permissions tightened to owner-only", extra={
            "cache_dir": str(path), "entries": changed, "failed": failed})
    return changed


def _open_nofollow(path: Path, flags: int) -> int:
    """``os.open(path, flags | O_NOFOLLOW | O_CLOEXEC, 0600)``; a symlink at ``path`` raises
    ``OSError(ELOOP)`` whose message names the path and says it was refused."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, f"{path} is a symbolic link; a cache file must be a "
                          "regular file (refused, not followed)", str(path)) from None
        raise


def private_file(path: Path) -> None:
    """Create ``path`` empty with mode ``0600`` when missing; clear group / other bits of an
    existing one. Never follows a symlink: one at ``path`` raises ``OSError`` (``ELOOP``);
    anything else that is not a regular file raises ``OSError`` (``EINVAL``). Raises
    ``OSError``."""
    fd = _open_nofollow(path, os.O_RDWR | os.O_CREAT)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file (refused)", str(path))
        if stat.S_IMODE(st.st_mode) & _OTHERS:
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~_OTHERS)
    finally:
        os.close(fd)


def write_private(path: Path, text: str | bytes, *, sync: bool = False) -> None:
    """Write ``text`` (a ``str``, written as UTF-8, or ``bytes`` as they are) to ``path``,
    created or truncated, mode ``0600``; ``sync``: fsync it before it is closed (the durable
    directory list, ``NamespaceOps.write_dirs_durably``). A symlink at ``path`` is refused
    (``OSError`` ``ELOOP``), never followed. Raises ``OSError``."""
    fd = _open_nofollow(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        os.fchmod(fd, FILE_MODE)
        data = text.encode("utf-8") if isinstance(text, str) else text
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


class CacheError(OSError):
    """A write to the sidecar's own cache directory failed: ``errno`` (``ENOSPC`` for a full
    disk, else ``EIO`` or the OS's errno) and a one-line ``reason`` for logs and errors.log."""

    errno: int  # never None here (``OSError.errno`` may be)

    def __init__(self, err: int, reason: str) -> None:
        super().__init__(err, reason)
        self.errno = err
        self.reason = reason


#: SQLite's extended code for a shared-memory file (``-shm``) it could not grow: on a full
#: disk, the error of opening (or first reading) a WAL database whose ``-shm`` is new
SQLITE_IOERR_SHMSIZE = getattr(sqlite3, "SQLITE_IOERR_SHMSIZE", 4874)


def cache_errno(exc: BaseException) -> int:
    """The errno a failed write to the cache directory stands for: ``ENOSPC`` for a full
    disk (``SQLITE_FULL``, ``SQLITE_IOERR_SHMSIZE``: a ``-shm`` that cannot grow,
    ``OSError(ENOSPC)`` or ``EDQUOT``), the OS errno of another ``OSError``, else
    ``EIO``."""
    if isinstance(exc.__cause__, OSError) and exc.__cause__.errno:
        return cache_errno(exc.__cause__)  # e.g. the journal's witness: raised as sqlite3's
    if isinstance(exc, OSError) and exc.errno:
        return errno.ENOSPC if exc.errno == errno.EDQUOT else exc.errno
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)
        if code is not None and (code & 0xFF == sqlite3.SQLITE_FULL or code == SQLITE_IOERR_SHMSIZE):
            return errno.ENOSPC
        if "full" in str(exc):
            return errno.ENOSPC
    return errno.EIO


def cache_error(exc: BaseException, what: str) -> CacheError:
    """``exc`` (a failed write to the cache directory) as a ``CacheError`` whose reason says
    ``what`` was being written."""
    err = cache_errno(exc)
    if err == errno.ENOSPC:
        reason = f"the sidecar's cache disk is full ({what})"
    else:
        reason = f"the sidecar's cache disk failed ({what}: {errno.errorcode.get(err, err)})"
    return CacheError(err, reason)


#: bytes free on the cache disk a start wants before it opens the outbox journal and the
#: blob cache (their ``-shm`` files, a first write-ahead log); less, and the start makes room
#: from the sidecar's own files (``mount.open_cache``)
START_ROOM = 256 << 10

#: bytes the cache directory keeps allocated in ``reserve`` (``DiskReserve``), at most a
#: sixteenth of its file system: what a full disk needs to give space back
RESERVE_BYTES = 1 << 20


class DiskReserve:
    """Space held back on the cache disk (a file of ``size`` allocated bytes, ``path``) so
    that a full disk can still give space back.

    A SQLite write-ahead log gives its space back only by a checkpoint, which copies the
    log's pages into the database file first; on a disk that is 100 % full the database
    cannot grow, the checkpoint fails with ``SQLITE_FULL`` and the log (hundreds of KiB of
    pages already written) stays for good: the cache disk stays full after everything
    committed (session 12's verifier, N3). ``spent(fn)`` runs such a checkpoint with the
    reserve released (its file truncated to 0). The reserve is made again (``fill``) only
    while the disk has at least ``REFILL_FACTOR`` times its size free: right after a full
    disk the space goes to writes, not back to the reserve.

    Thread-safe (the journal checkpoints in a worker thread, the blob cache on the trio
    thread). Never raises: a reserve that cannot be made is simply smaller (logged at
    debug level). ``size``: bytes, at most a sixteenth of the file system (a small test
    disk), 0 disables it."""

    REFILL_FACTOR = 4

    def __init__(self, path: Path, size: int = RESERVE_BYTES) -> None:
        import threading

        self.path = path
        self._lock = threading.Lock()
        try:
            st = os.statvfs(path.parent)
            size = min(size, st.f_blocks * st.f_frsize // 16)
        except OSError:
            pass
        self.size = max(0, size)
        self.spent_count = 0  # times the reserve was released for a checkpoint
        self.fill()

    def held(self) -> int:
        """Bytes the reserve's file holds allocated now (0 when it is missing)."""
        try:
            return os.stat(self.path).st_blocks * 512
        except OSError:
            return 0

    def release(self) -> int:
        """Give the reserve's space back (its file truncated to 0; made again by ``fill``
        when space allows); the bytes given back. Never raises."""
        with self._lock:
            held = self.held()
            try:
                fd = _open_nofollow(self.path, os.O_RDWR)
                try:
                    os.ftruncate(fd, 0)
                finally:
                    os.close(fd)
            except OSError:
                return 0
            return held

    def fill(self) -> None:
        """Allocate the reserve's bytes (``posix_fallocate``) when it holds fewer and the
        disk has ``REFILL_FACTOR`` times its size free (else nothing)."""
        if not self.size:
            return
        with self._lock:
            if self.held() >= self.size:
                return
            try:
                st = os.statvfs(self.path.parent)
                if st.f_bavail * st.f_frsize < self.REFILL_FACTOR * self.size:
                    return
                private_file(self.path)
                fd = _open_nofollow(self.path, os.O_RDWR)
                try:
                    os.posix_fallocate(fd, 0, self.size)
                finally:
                    os.close(fd)
            except OSError as e:
                log.debug("cache disk reserve not made", extra={"reason": e.strerror or str(e)})

    def spent(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` (a checkpoint that failed for a full disk) with the reserve's space
        released; the reserve is made again later (``fill``) when space allows. Raises what
        ``fn`` raises."""
        self.release()
        with self._lock:
            self.spent_count += 1
        return fn()


def free_bytes(path: Path) -> int:
    """Bytes free on the file system of ``path`` for an unprivileged writer
    (``statvfs``: ``f_bavail``); -1 when it cannot be told."""
    try:
        st = os.statvfs(path)
    except OSError:
        return -1
    return st.f_bavail * st.f_frsize


def disk_size(path: Path) -> int:
    """Bytes of the file system of ``path`` (``statvfs``); -1 when it cannot be told."""
    try:
        st = os.statvfs(path)
    except OSError:
        return -1
    return st.f_blocks * st.f_frsize
