"""The ``.memfuse/`` control directory: ``status.json`` and ``errors.log``.

``ControlFiles`` owns what those files show: the last 200 refusals and conflicts
(``errors``, a ``deque`` of JSON-able dicts, newest last) and the status document. A file
under ``.memfuse/`` is a read-only node whose ``special`` names its kind; ``content(kind)``
renders it once per open (``Filesystem.open`` keeps the bytes on the handle, so a reader that
reads twice sees one consistent snapshot). Everything here runs on the trio thread and never
awaits: a read of a control file answers from memory.
"""
from __future__ import annotations

import errno
import json
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .core import Filesystem

log = logging.getLogger("memfuse.fs")

CONTROL_DIR = ".memfuse"
ERRORS_KEPT = 200  # entries of errors.log (oldest dropped first)
# name under .memfuse/ -> Node.special
FILES = {"status.json": "status", "errors.log": "errors"}


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class ControlFiles:
    """What ``.memfuse/`` shows for one mount (see module docstring).

    ``status_provider`` (set by the sidecar) returns the fuller status document of
    ``Sidecar.status``; without it ``status()`` (the filesystem's part) is used.
    """

    def __init__(self, fs: "Filesystem") -> None:
        self.fs = fs
        self.errors: deque[dict] = deque(maxlen=ERRORS_KEPT)
        self.status_provider: Callable[[], dict] | None = None

    def note_error(self, store: str, path: str, err: int, reason: str) -> None:
        """Add a refusal to ``errors.log`` (``time``, ``store``, ``path``, ``errno`` as its
        name e.g. ``"EFBIG"``, ``reason``), log it at WARNING and count it
        (``memfuse_refusals_total{errno}``)."""
        name = errno.errorcode.get(err, str(err))
        self.errors.append({"time": _now(), "store": store, "path": path, "errno": name,
                            "reason": reason})
        log.warning("refused", extra={"store": store, "path": path, "errno": name,
                                      "reason": reason})
        if self.fs.metrics is not None:
            self.fs.metrics.refusals.labels(name).inc()

    def note_conflict(self, store: str, path: str, what: str) -> None:
        """Add a conflict the committer resolved (``conflict: true``, ``reason``) to
        ``errors.log``."""
        self.errors.append({"time": _now(), "store": store, "path": path, "conflict": True,
                            "reason": what})

    def status(self) -> dict:
        """The filesystem's part of the status document: workspace, readiness, uptime (s),
        per store its records, bytes and limits, the outbox (depth, oldest age in s,
        committed / refused / retried counts), open handles and inodes."""
        fs = self.fs
        c = fs.committer
        return {
            "workspace": fs.workspace,
            "ready": fs.ready,
            "uptime_s": round(time.time() - fs.started, 1),
            "stores": [{"slug": s.slug, "access": s.access, "records": s.count, "bytes": s.used,
                        "max_records": s.max_records, "max_store_bytes": s.max_store_bytes}
                       for s in fs.stores.values()],
            "outbox": {"depth": c.depth(), "oldest_age_s": round(c.oldest_age(), 3),
                       "committed": c.committed, "refused": c.refused, "retries": c.retries},
            "open_handles": len(fs.handles),
            "inodes": len(fs.inodes),
        }

    def content(self, kind: str) -> bytes:
        """The bytes of the control file of this kind (``Node.special``): the status
        document as indented JSON, or ``errors.log`` as one JSON object a line."""
        if kind == "status":
            st = self.status_provider() if self.status_provider else self.status()
            return (json.dumps(st, indent=2) + "\n").encode()
        return "".join(json.dumps(e) + "\n" for e in self.errors).encode()
