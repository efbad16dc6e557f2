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
from pathlib import Path

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


def write_private(path: Path, text: str | bytes) -> None:
    """Write ``text`` (a ``str``, written as UTF-8, or ``bytes`` as they are) to ``path``,
    created or truncated, mode ``0600``. A symlink at ``path`` is refused (``OSError``
    ``ELOOP``), never followed. Raises ``OSError``."""
    fd = _open_nofollow(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        os.fchmod(fd, FILE_MODE)
        data = text.encode("utf-8") if isinstance(text, str) else text
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
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


def cache_errno(exc: BaseException) -> int:
    """The errno a failed write to the cache directory stands for: ``ENOSPC`` for a full
    disk (``SQLITE_FULL``, ``OSError(ENOSPC)`` or ``EDQUOT``), the OS errno of another
    ``OSError``, else ``EIO``."""
    if isinstance(exc.__cause__, OSError) and exc.__cause__.errno:
        return cache_errno(exc.__cause__)  # e.g. the journal's witness: raised as sqlite3's
    if isinstance(exc, OSError) and exc.errno:
        return errno.ENOSPC if exc.errno == errno.EDQUOT else exc.errno
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)
        if code is not None and code & 0xFF == sqlite3.SQLITE_FULL:
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
