"""Files only their owner may read: the control plane's SQLite database and the token files
the CLI writes (memory content, token hashes and tokens must not be readable by other local
users). No dependencies beyond the standard library, so every part of memfuse can use it.
"""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["FILE_MODE", "DIR_MODE", "PrivateFileError", "create_private", "write_private", "prepare_sqlite_file"]

FILE_MODE = 0o600
DIR_MODE = 0o700


class PrivateFileError(OSError):
    """A private file or its directory could not be made; the message says which path, what
    was being done and the OS's reason, on one line (``str()``); ``errno`` is the OS's."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def create_private(path: Path) -> bool:
    """Create ``path`` empty with mode 0600 (exactly: the umask does not widen or narrow it)
    unless it exists; an existing file is left as it is (its mode is the owner's choice).
    Returns True when it was created. Raises ``OSError``."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
    except FileExistsError:
        return False
    try:
        os.fchmod(fd, FILE_MODE)
    finally:
        os.close(fd)
    return True


def write_private(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` with mode 0600, atomically: a temporary file in the
    same directory, created 0600, renamed over ``path`` (rename(2)), so a reader (a sidecar
    re-reading its token file) sees the old content or the new, never a part, and an existing
    file's wider mode does not carry over. Raises ``OSError`` (the temporary file removed)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
    try:
        try:
            os.fchmod(fd, FILE_MODE)
            view = memoryview(text.encode("utf-8"))
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def prepare_sqlite_file(path: Path) -> None:
    """Make ready the SQLite database file ``path`` before SQLite opens it: create its missing
    parent directory (mode 0700; missing ancestors above it get the default mode, as
    ``mkdir -p``) and the file itself, empty (SQLite reads an empty file as an empty
    database), with mode 0600. SQLite creates the ``-wal`` and ``-shm`` files with the
    database file's mode (sqlite.org, "Temporary Files Used By SQLite"; ``unixOpen``), so
    they are private too. An existing file or directory is left as it is.

    Raises ``PrivateFileError`` at once with a one-line message when the directory or the file
    cannot be created (no permission, a read-only file system, a parent that is a file)."""
    parent = path.parent
    if not parent.is_dir():
        try:
            parent.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
        except OSError as e:
            reason = "a file of that name is in the way" if isinstance(e, FileExistsError) else e.strerror
            raise PrivateFileError(e.errno, f"cannot create the directory {parent} for the SQLite "
                                   f"database {path.name}: {reason}") from None
    try:
        create_private(path)
    except OSError as e:
        raise PrivateFileError(e.errno, f"cannot create the SQLite database {path}: {e.strerror}") from None
