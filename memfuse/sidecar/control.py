"""The ``.memfuse/`` control directory: ``status.json``, ``errors.log`` and ``context.md``.

``ControlFiles`` owns what those files show: the last 200 refusals and conflicts
(``errors``, a ``deque`` of JSON-able dicts, newest last) and the status document. The
``errors.log`` lines are kept in the outbox journal (``Journal.add_error``, bounded to the same
200) and read back at start, so after a restart the log still says why each file is refused;
a rejected file put back from the journal whose refusal line is no longer among them gets its
line again (``note_restored``: the time it was first refused, ``restored: true``). A file
under ``.memfuse/`` is a read-only node whose ``special`` names its kind; ``content(kind)``
renders it.

Sizes and snapshots. A control file's ``st_size`` is the length of the content an open would
read, as on a local disk (``tail -c``, ``wc -c``, ``sendfile`` / ``shutil.copyfile`` and
rsync trust it), so a lookup or getattr renders the content too (``size``). ``render`` keeps
the last rendering of each file and gives it again while it is current: ``errors.log`` and
``context.md`` until their content changes (a refusal, a fetched prompt block), so their
``stat`` size always equals what a later ``cat`` reads; ``status.json`` until anything it
counts changes (``changed``: a FUSE request that modifies, a commit, a refusal) and for at
most ``STATUS_REUSE_S`` (its ages and the background sync move on their own). That reuse is
what bounds the cost of a stat storm (``ls -l`` renders each file up to three times: the
readdirplus entry, the lookup and the getattr) and makes the size of the lookup that precedes
an open match the bytes that open reads. ``opened`` takes the current rendering as the
handle's snapshot (``Filesystem.open`` keeps it on the handle: one open reads one consistent
document, however many read calls it takes); while a handle is open, ``size`` reports the
newest open's snapshot, so the ``fstat`` a reader makes after its open (``cat``, ``cp``,
Python's ``read()``, ``tail -c``'s ``SEEK_END``) sees the length of its own snapshot — pyfuse3
does not pass the handle to getattr. The FUSE adapter opens them with ``direct_io`` (reads
are answered from the handle's snapshot, never from pages another open left in the kernel's
cache) and attribute / entry timeouts of 0 (every ``stat`` asks the sidecar). Everything here
runs on the trio thread and never awaits: a read of a control file answers from memory.

``context.md`` is the prompt block of docs/API.md ("Prompt block") for this mount: the
control plane renders it with this mount's path as ``mount_root``; the sidecar fetches it
(``Sidecar._context_loop``, bounded, off the FUSE path) when the mount comes up, on attach /
detach / store changes and when a store's ``MEMORY.md`` changes here or remotely, and stores
it with ``set_context``. Until a first fetch succeeds the file holds a short placeholder that
names the mountpoint; after a failed refresh it keeps the last block.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol

from memfuse.content import refusals_line
from memfuse.errors import CODE_BY_ERRNO

from .cachedir import write_private

if TYPE_CHECKING:
    from .committer import Committer
    from .inodes import Handle, Node, StoreMount
    from .journal import Journal

log = logging.getLogger("memfuse.fs")

CONTROL_DIR = ".memfuse"
ERRORS_KEPT = 200  # entries of errors.log (oldest dropped first)
#: seconds a rendering of status.json stays current when nothing ``changed`` (module docstring)
STATUS_REUSE_S = 0.25
# name under .memfuse/ -> Node.special
FILES = {"status.json": "status", "errors.log": "errors", "context.md": "context"}




def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class _Tree(Protocol):
    """What the control files read of the filesystem core (``core.Filesystem``)."""

    metrics: Any
    committer: Committer
    workspace: str
    ready: bool
    started: float
    stores: dict[str, StoreMount]
    handles: dict[int, Handle]
    inodes: dict[int, Node]

    def rejected_files(self, sm: StoreMount) -> Iterable[Node]: ...


class _Host(Protocol):
    """What the control files ask of the sidecar (``core.FsListener`` has both)."""

    def status(self) -> dict[str, Any]: ...

    def committed_size(self, slug: str, record_id: str) -> int | None: ...


class ControlFiles:
    """What ``.memfuse/`` shows for one mount (see module docstring).

    Parts, given at construction: ``journal`` (where the lines of ``errors.log`` are kept
    across restarts; None: memory only), ``host`` (the sidecar: its ``status()`` is the
    fuller status document, its ``committed_size(slug, record_id)`` the bytes of a record as
    the control plane holds it; None: the filesystem's part of the status, sizes unknown)
    and ``mount_root`` (the mountpoint, an absolute path, for the prompt block).
    """

    def __init__(self, fs: _Tree, journal: "Journal | None" = None,
                 host: "_Host | None" = None, mount_root: str = "") -> None:
        self.fs = fs
        self.errors: deque[dict[str, Any]] = deque(maxlen=ERRORS_KEPT)
        #: where the lines are kept across restarts (``journal.Journal``), None: memory only
        self.journal = journal
        if self.journal is not None:
            # oldest first by time (a line put back by ``note_restored`` is added late)
            kept = self.journal.load_errors(ERRORS_KEPT)
            self.errors.extend(sorted(kept, key=lambda e: str(e.get("time", ""))))
        #: refusals noted by this process (``note_error``: decided here or by the control
        #: plane; not the lines put back at start): ``refusals_since_start`` in the status
        self.refusals = 0
        self.status_provider: Callable[[], dict[str, Any]] | None = host.status if host is not None else None
        #: ``committed_size(slug, record_id)``: bytes of the record as the control plane holds
        #: it (the store's mirror), None when unknown
        self.committed_size: Callable[[str, str], int | None] = (
            host.committed_size if host is not None else (lambda slug, rid: None))
        self.mount_root = mount_root  # the mountpoint (absolute path)
        self.context_text: str | None = None  # the last prompt block fetched
        self.context_at = 0.0  # time.time() of that fetch; 0 before the first
        self.context_error: str | None = None  # why the last refresh failed, else None
        #: bumped by ``changed``: the status document may differ from its last rendering
        self.changes = 0
        self._errors_gen = 0  # bumped whenever ``errors`` changes
        #: kind -> (content, what it was rendered from, time.monotonic() of the rendering)
        self._rendered: dict[str, tuple[bytes, tuple[object, ...], float]] = {}
        #: kind -> [the newest open handle's snapshot, handles open on that file]
        self._held: dict[str, list[Any]] = {}

    def set_context(self, text: str | None, error: str | None = None) -> None:
        """Keep a freshly fetched prompt block (``text``), or note that a refresh failed
        (``text`` None, ``error`` one line) while keeping the previous block."""
        if text is not None:
            self.context_text, self.context_at = text, time.time()
        self.context_error = error
        self.changed()  # status.json shows the fetch's age and error

    def context(self) -> str:
        """``context.md``: the last prompt block fetched, else a placeholder that names the
        mountpoint and says why the block is missing."""
        if self.context_text is not None:
            return self.context_text
        why = self.context_error or "it is being fetched from the control plane"
        root = self.mount_root or "this mount"
        return ("# Memory\n\nLong-term memory stores are mounted as plain files under "
                f"`{root}/`, one directory per store; each store's `MEMORY.md` is its index.\n\n"
                f"{refusals_line(root)}\n\n"
                f"[memfuse: the full prompt block is not available yet ({why}); read this "
                "file again shortly.]\n")

    def note_error(self, store: str, path: str, err: int, reason: str, code: str = "") -> None:
        """Add a refusal to ``errors.log`` (``time``, ``store``, ``path``, ``errno`` as its
        name e.g. ``"EFBIG"``, ``code``: the machine reason e.g. ``"record_too_large"``,
        ``reason``: one sentence, never content), log it at WARNING with the same fields and
        count it (``memfuse_refusals_total{errno}``). ``code`` defaults to the usual cause
        of ``err`` (``CODE_BY_ERRNO``)."""
        name = errno.errorcode.get(err, str(err))
        code = code or CODE_BY_ERRNO.get(err, name.lower())
        self.refusals += 1
        self._add({"time": _now(), "store": store, "path": path, "errno": name,
                   "code": code, "reason": reason})
        log.warning("refused", extra={"store": store, "path": path, "errno": name, "code": code,
                           "reason": reason})
        if self.fs.metrics is not None:
            self.fs.metrics.refusals.labels(name).inc()

    def note_kept(self, store: str, path: str, err: int, code: str, reason: str) -> None:
        """A rejected file at ``path`` was kept over a remote change of its record
        (``remote.RemoteApply._remote_over_rejected``): a line in ``errors.log`` with the
        file's ``errno`` name and reason ``code`` and ``kept: true``, and a WARNING
        ``rejected file kept over a remote change`` with the same fields (never content).
        Not counted as a refusal: nothing new was refused."""
        name = errno.errorcode.get(err, str(err))
        self._add({"time": _now(), "store": store, "path": path, "errno": name, "code": code,
                   "kept": True, "reason": reason})
        log.warning("rejected file kept over a remote change",
                    extra={"store": store, "path": path, "errno": name, "code": code,
                           "reason": reason})

    def note_shadowed(self, store: str, path: str, kind: str, record_path: str, record: str,
                      version: int, shown_at: str | None = None) -> None:
        """A record made or moved elsewhere (``record``, ``version``, at ``record_path``) is
        not shown there while local state at ``path`` (``kind``: "a local-only file", "a
        directory made here"...) is in its way (``remote.RemoteApply._shadow``; ``shown_at``:
        a record moved elsewhere stays shown at that path meanwhile): a line in
        ``errors.log`` with ``shadowed: true`` and those fields, and a WARNING ``shadowed: a
        record made elsewhere is hidden by local state here`` with the same fields (paths and
        ids, never content). Not counted as a refusal: nothing was refused."""
        holds = "this path" if path == record_path else "a part of its path"
        where = ("is not shown here" if shown_at is None
                 else f"stays shown here at {shown_at}")
        reason = (f"{kind} here holds {holds}; record {record} (version {version}) at "
                  f"{record_path}, made or moved there elsewhere, {where} while it stays; "
                  f"remove or rename {path} here to see the record at {record_path}")
        self._add({"time": _now(), "store": store, "path": path, "shadowed": True,
                   "record_path": record_path, "record": record, "version": version,
                   **({"shown_at": shown_at} if shown_at is not None else {}),
                   "reason": reason})
        log.warning("shadowed: a record made elsewhere is hidden by local state here",
                    extra={"store": store, "path": path, "record_path": record_path,
                           "record": record, "version": version, "kind": kind})

    def note_conflict(self, store: str, path: str, what: str) -> None:
        """Add a conflict the committer resolved (``conflict: true``, ``reason``) to
        ``errors.log``."""
        self._add({"time": _now(), "store": store, "path": path, "conflict": True,
                   "reason": what})

    def note_overwritten(self, store: str, path: str, record: str, lost: int, version: int) -> None:
        """This mount's write (version ``lost`` of record ``record``) was overwritten by
        another writer's ``version`` by last writer wins (``Change.overwrote``, told by the
        change feed): a line in ``errors.log`` (``conflict: true``, ``overwritten: true``,
        the versions, where the lost one is kept; never content)."""
        self._add({"time": _now(), "store": store, "path": path, "conflict": True,
                   "overwritten": True, "record": record, "lost_version": lost, "version": version,
                   "reason": (f"this mount's write (version {lost}) was overwritten elsewhere by "
                              f"version {version}, written on an older version (last writer wins); "
                              f"the file now shows version {version}, this mount's stays in the "
                              f"record's history: `memfuse history {store} <path>` lists it, "
                              f"`memfuse restore {store} <path> --version {lost}` brings it back")})

    def note_restored(self, store: str, path: str, err: int, code: str, reason: str,
                      since: float) -> None:
        """A rejected file kept from before a restart is back at ``path``: unless a line of
        ``errors.log`` already gives its refusal (same store, path, errno and reason), add one
        with the time it was refused (``since``, Unix seconds; placed in time order, before
        lines of the same second) and
        ``restored: true``. Not logged or counted again: it is no new refusal."""
        name = errno.errorcode.get(err, str(err))
        if any(e.get("store") == store and e.get("path") == path and e.get("errno") == name
               and e.get("reason") == reason for e in self.errors):
            return
        entry: dict[str, Any] = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(since)),
                 "store": store, "path": path, "errno": name,
                 "code": code or CODE_BY_ERRNO.get(err, name.lower()), "reason": reason,
                 "restored": True}
        lines = list(self.errors)
        # before the first line of the same second or later (it was refused first), and kept
        # even when the log is full (the oldest other line goes)
        at = next((i for i, e in enumerate(lines) if str(e.get("time", "")) >= entry["time"]),
                  len(lines))
        lines.insert(at, entry)
        if len(lines) > ERRORS_KEPT:
            del lines[1 if at == 0 else 0]
        self.errors.clear()
        self.errors.extend(lines)
        self._errors_gen += 1
        self.changed()
        if self.journal is not None:
            self.journal.add_error(entry, ERRORS_KEPT)

    def _add(self, entry: dict[str, Any]) -> None:
        """Append one line to ``errors.log`` and keep it in the journal (bounded)."""
        self.errors.append(entry)
        self._errors_gen += 1
        self.changed()
        if self.journal is not None:
            self.journal.add_error(entry, ERRORS_KEPT)

    def _store_status(self, s: StoreMount) -> dict[str, Any]:
        """One store's entry: ``records`` / ``bytes`` are what the control plane holds plus
        what is pending (a file rejected over a stored record counts with the stored
        size); ``rejected`` / ``rejected_bytes`` are the files refused for good, kept here
        (their local content), never counted in ``records`` / ``bytes``; ``local`` /
        ``local_bytes`` the local-only files kept here (never sent)."""
        records, used, rejected, rejected_bytes = s.count, s.used, 0, 0
        for n in self.fs.rejected_files(s):
            size = n.cur_size()
            rejected += 1
            rejected_bytes += size
            used -= size
            if n.record_id:  # the control plane holds the record (its earlier content)
                used += self.committed_size(s.slug, n.record_id) or 0
            else:
                records -= 1
        return {"slug": s.slug, "access": s.access, "records": records, "bytes": used,
                "rejected": rejected, "rejected_bytes": rejected_bytes,
                "local": s.local_count, "local_bytes": s.local_used,
                "max_records": s.max_records, "max_store_bytes": s.max_store_bytes}

    def status(self) -> dict[str, Any]:
        """The filesystem's part of the status document: workspace, readiness, uptime (s),
        per store its records, bytes (held by the control plane + pending), rejected files
        and their bytes (``_store_status``) and limits, the outbox (depth, oldest age in s,
        committed / retried counts and ``refused``: changes the control plane refused when
        sent), ``refusals_since_start`` (every refusal noted since this start, decided here or
        by the control plane), open handles and inodes."""
        fs = self.fs
        c = fs.committer
        return {
            "workspace": fs.workspace,
            "ready": fs.ready,
            "uptime_s": round(time.time() - fs.started, 1),
            "stores": [self._store_status(s) for s in fs.stores.values()],
            "outbox": {"depth": c.depth(), "oldest_age_s": round(c.oldest_age(), 3),
                       "committed": c.committed, "refused": c.refused, "retries": c.retries,
                       "merged": c.merges, "coalesced": c.coalesced,
                       "backlog": (left := c.backlog_left()), "draining": left > 0},
            "control_plane": self._reachability(),
            "refusals_since_start": self.refusals,
            "open_handles": len(fs.handles),
            "inodes": len(fs.inodes),
        }

    def _reachability(self) -> dict[str, Any]:
        """``control_plane`` of the status document, as the outbox sees it: ``reachable``
        (false while commits fail with connection errors, timeouts, 5xx or 429 and none was
        answered since: closes then return once their write is accepted), and when not,
        ``since`` (ISO 8601 UTC), ``down_s`` and ``error`` (the last failure's code)."""
        down = self.fs.committer.unreachable
        if down is None:
            return {"reachable": True}
        return {"reachable": False,
                "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(down["since"])),
                "down_s": round(time.time() - down["since"], 1), "error": down["error"]}

    def content(self, kind: str) -> bytes:
        """The bytes of the control file of this kind (``Node.special``): the status
        document as indented JSON, ``errors.log`` as one JSON object a line, or the prompt
        block (``context``, UTF-8 Markdown)."""
        if kind == "status":
            st = self.status_provider() if self.status_provider else self.status()
            return (json.dumps(st, indent=2) + "\n").encode()
        if kind == "context":
            return self.context().encode("utf-8")
        return "".join(json.dumps(e) + "\n" for e in self.errors).encode()

    # ------------------------------------------------------------------ sizes and snapshots
    def changed(self) -> None:
        """Note that what ``status.json`` shows may have changed (called for every FUSE
        request that modifies something, each finished commit, refusal or conflict and each
        prompt-block fetch): its next lookup, getattr or open renders it afresh."""
        self.changes += 1

    def _source(self, kind: str) -> tuple[object, ...]:
        """What the content of ``kind`` is rendered from: equal tuples, equal content
        (``status`` also ages: ``STATUS_REUSE_S``)."""
        if kind == "errors":
            return ("errors", self._errors_gen)
        if kind == "context":
            return ("context", self.context_text, self.context_error, self.mount_root)
        return ("status", self.changes)

    def render(self, kind: str) -> bytes:
        """The content of the control file ``kind`` (``Node.special``) as an open now reads
        it: the last rendering while it is current (module docstring), else a new one."""
        now = time.monotonic()
        source = self._source(kind)
        last = self._rendered.get(kind)
        if (last is not None and last[1] == source
                and (kind != "status" or now - last[2] < STATUS_REUSE_S)):
            return last[0]
        data = self.content(kind)
        self._rendered[kind] = (data, source, now)
        return data

    def size(self, kind: str) -> int:
        """``st_size`` of the control file ``kind`` in bytes: while a handle is open on it, the
        length of the newest open's snapshot (the ``fstat`` of that reader), else the length of
        ``render(kind)``."""
        held = self._held.get(kind)
        if held is not None:
            return len(held[0])
        return len(self.render(kind))

    def opened(self, kind: str) -> bytes:
        """An open of the control file ``kind``: its snapshot (``render``), which ``size``
        reports until the handle is ``closed`` or a newer open takes its place."""
        data = self.render(kind)
        held = self._held.get(kind)
        if held is None:
            self._held[kind] = [data, 1]
        else:
            held[0] = data
            held[1] += 1
        return data

    def closed(self, kind: str) -> None:
        """The release of a handle ``opened`` on the control file ``kind``."""
        held = self._held.get(kind)
        if held is not None:
            held[1] -= 1
            if held[1] <= 0:
                del self._held[kind]


MOUNT_INFO = "mount.json"  # in the cache directory while the sidecar is mounted


def write_mount_info(cache_dir: Path, info: dict[str, Any]) -> None:
    """Write ``<cache_dir>/mount.json`` (``mountpoint``, ``workspace``, ``pid``, ``admin``)
    so that other processes (``memfuse context`` beside ``memfuse dev``) find the running
    mount. Atomic (tmp + rename); a failure is logged, never raised (it is a convenience)."""
    tmp = cache_dir / (MOUNT_INFO + ".tmp")
    try:
        write_private(tmp, json.dumps(info))
        os.replace(tmp, cache_dir / MOUNT_INFO)
    except OSError as e:
        log.warning("mount info not written", extra={"errno": errno.errorcode.get(e.errno or 0)})


def running_mount(cache_dir: Path) -> dict[str, Any] | None:
    """What ``write_mount_info`` wrote for the sidecar running on ``cache_dir``, or None when
    no sidecar holds that cache (its ``lock`` is free: it stopped, even by ``kill -9``) or
    nothing readable is there."""
    try:
        info = json.loads((cache_dir / MOUNT_INFO).read_text())
        fd = os.open(cache_dir / "lock", os.O_RDONLY)
    except (OSError, ValueError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return info if isinstance(info, dict) else None  # held: the sidecar runs
    finally:
        os.close(fd)
    return None
