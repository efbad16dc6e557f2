"""Files only their owner may read: the control plane's SQLite database and the token files
the CLI writes (memory content, token hashes and tokens must not be readable by other local
users). No dependencies beyond the standard library, so every part of memfuse can use it.

New files are made ``0600`` and new directories ``0700``. Existing ones made by older
releases (or under a wide umask) are tightened when memfuse opens them: ``tighten`` clears
the group and other permission bits of a file or directory this process's user owns (the
owner's bits are kept: ``0644`` becomes ``0600``, ``0755`` becomes ``0700``), never follows a
symlink and never touches what another user owns; one INFO line says what was tightened.
"""
from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

__all__ = ["FILE_MODE", "DIR_MODE", "SQLITE_SUFFIXES", "PrivateFileError", "create_private", "write_private",
           "prepare_sqlite_file", "tighten", "tighten_logged"]

FILE_MODE = 0o600
DIR_MODE = 0o700
_OTHERS = stat.S_IRWXG | stat.S_IRWXO
#: the files of a SQLite database ``X``: ``X`` and its write-ahead log, shared-memory index
#: and rollback journal (sqlite.org, "Temporary Files Used By SQLite")
SQLITE_SUFFIXES = ("", "-wal", "-shm", "-journal")

log = logging.getLogger("memfuse.privfile")


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


def tighten(path: Path) -> int | None:
    """Clear the group / other permission bits of ``path`` when it exists, is not a symlink
    (not followed), is owned by this process's effective user and has any of them. Returns
    the mode it had (``0o644``) when it changed it, else None. Raises ``OSError`` when the
    change fails (a read-only file system)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode) or st.st_uid != os.geteuid() or not mode & _OTHERS:
        return None
    os.chmod(path, mode & ~_OTHERS)
    return mode


def tighten_logged(paths: list[Path], what: str) -> list[str]:
    """``tighten`` each of ``paths``; when any changed, one INFO line (``what``, the paths
    and their old modes; no content); a path that cannot be changed is a WARNING and is left
    as it is. Returns the paths changed."""
    changed: dict[str, str] = {}
    for p in paths:
        try:
            old = tighten(p)
        except OSError as e:
            log.warning("%s: permissions could not be tightened", what,
                        extra={"path": str(p), "error": e.strerror or str(e)})
            continue
        if old is not None:
            changed[str(p)] = f"{old:04o}"
    if changed:
        log.info("%s: made owner-only (group and other permission bits cleared)", what,
                 extra={"paths": list(changed), "old_modes": list(changed.values())})
    return list(changed)


def prepare_sqlite_file(path: Path) -> None:
    """Make ready the SQLite database file ``path`` before SQLite opens it: create its missing
    parent directory (mode 0700; missing ancestors above it get the default mode, as
    ``mkdir -p``) and the file itself, empty (SQLite reads an empty file as an empty
    database), with mode 0600. SQLite creates the ``-wal`` and ``-shm`` files with the
    database file's mode (sqlite.org, "Temporary Files Used By SQLite"; ``unixOpen``), so
    they are private too. An existing database file, and its ``-wal``, ``-shm`` and
    ``-journal`` files, owned by this process's user are made owner-only (``tighten``: a
    database made ``0644`` by an older release becomes ``0600``; logged once, when it
    happens); an existing directory is left as it is (it may not be memfuse's).

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
        created = create_private(path)
    except OSError as e:
        raise PrivateFileError(e.errno, f"cannot create the SQLite database {path}: {e.strerror}") from None
    suffixes = SQLITE_SUFFIXES[1:] if created else SQLITE_SUFFIXES  # a new file is 0600 already
    tighten_logged([path.with_name(path.name + s) for s in suffixes], "SQLite database")
