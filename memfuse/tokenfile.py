"""A bearer token kept in a file and re-read when the file changes (``--token-file``).

In Kubernetes a token comes from a Secret volume. The kubelet updates such a volume in place
when the Secret changes: it writes the new files into a fresh timestamped directory and
atomically swaps the ``..data`` symlink, so ``token -> ..data/token`` then resolves to a new
file (Kubernetes docs, "Secrets": "Mounted Secrets are updated automatically"; a ``subPath``
mount is *not* updated). :meth:`TokenFile.refresh` ``stat``s the path (following symlinks)
and re-reads it when the resolved file's identity, size or mtime changed: that catches the
symlink swap as well as an in-place rewrite or an ``mv`` over the file. A ``stat`` is one
syscall, so the sidecar calls it on every authentication failure and every few seconds.

A file that cannot be read, or reads empty (a writer that truncated it and has not written
yet), never replaces the token in use: the old one is kept, a warning is logged, and the next
``refresh`` tries again. The token itself never appears in a log line or an exception.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("memfuse.token")


class TokenFileError(Exception):
    """The token file cannot be read or is empty (message names the file, never its content)."""


def _signature(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class TokenFile:
    """The token in ``path`` (whitespace stripped), re-read by :meth:`refresh` when it changed.

    Attributes:
        path: the file (a symlink is followed on every read).
        token: the token in use.
        generation: grows by one each time a different token is taken up; a caller that
            remembers it can tell whether the token changed since it last looked.
        reloads: how many times a different token was taken up (same as ``generation``).
        on_change: called with no arguments after a different token was taken up (by
            whoever called :meth:`refresh`); its exceptions are logged, not raised.

    Raises ``TokenFileError`` at construction when the file cannot be read or is empty.
    Not thread-safe; the sidecar uses it from its one trio thread.
    """

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.generation = 0
        self._sig: tuple[int, int, int, int] | None = None
        self._bad_state: object = None
        self.on_change: Callable[[], None] | None = None
        try:
            st = os.stat(self.path)
            tok = self.path.read_text(encoding="utf-8").strip()
        except OSError as e:
            raise TokenFileError(f"cannot read token file {self.path}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise TokenFileError(f"token file {self.path} is not UTF-8 text") from None
        if not tok:
            raise TokenFileError(f"token file {self.path} is empty")
        self.token: str = tok
        self._sig = _signature(st)

    @property
    def reloads(self) -> int:
        return self.generation

    def refresh(self) -> bool:
        """``stat`` the file and re-read it when it changed; return True when the token in use
        is now a different one. Never raises: for a missing, unreadable or empty file the
        token in use stays and a warning is logged (once for each state of the file)."""
        try:
            st = os.stat(self.path)
        except OSError as e:
            self._bad(("missing", e.errno), e.strerror or "cannot stat")
            return False
        sig = _signature(st)
        if sig == self._sig:
            return False
        try:
            tok = self.path.read_text(encoding="utf-8").strip()
        except OSError as e:
            self._bad(sig, e.strerror or "cannot read")
            return False
        except UnicodeDecodeError:
            self._bad(sig, "not UTF-8 text")
            return False
        if not tok:  # e.g. a writer between truncate and write: look again next time
            self._bad(sig, "empty")
            return False
        self._sig, self._bad_state = sig, None
        if tok == self.token:
            return False
        self.token = tok
        self.generation += 1
        log.info("token file changed; using the new token",
                 extra={"path": str(self.path), "generation": self.generation})
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception:
                log.exception("token change handler failed")
        return True

    def _bad(self, state: object, why: str) -> None:
        self._sig = None  # read again on the next refresh
        if state != self._bad_state:
            self._bad_state = state
            log.warning("token file unusable; keeping the token in use",
                        extra={"path": str(self.path), "error": why})

    def __repr__(self) -> str:  # never show the token
        return f"TokenFile({str(self.path)!r}, generation={self.generation})"
