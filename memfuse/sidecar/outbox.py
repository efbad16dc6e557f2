"""The outbox: every change the sidecar accepted, made durable on local disk, then committed to
the control plane in order (docs/ARCHITECTURE.md, "The path of a write").

Shape:

- ``Entry`` — one accepted change: ``put`` (content of a file, with its mode and explicit
  mtime), ``attrs`` (mode and/or mtime of a clean file: ``PATCH``, no content), ``delete``,
  ``move`` (one record) or ``move_prefix`` (a directory). It carries an idempotency key (sent as ``Idempotency-Key``)
  and the paths *as they were when the change happened*. Because entries of a store commit
  strictly in order, replaying them reproduces the local sequence on the server.
- Files are named by a stable *node key*: ``r:<record id>`` for records loaded from the control
  plane, ``n:<uuid>`` for files created here. ``KeyMap`` resolves a node key to the record id
  and last known sha256; it is persisted so a replay after a crash resolves keys of records the
  previous process created.
- ``Journal`` — the durable part: a SQLite file (``outbox.db`` in the cache directory,
  ``synchronous=FULL``) written by one task in batches (group commit) from a worker thread, so
  no handler waits on an fsync on the trio thread. ``Entry.durable`` is set once its row is on
  disk: that is "accepted".
- ``Committer`` — one worker per store taking entries in order; transient failures (connection
  errors, timeouts, 5xx, 429) are retried with exponential backoff and full jitter (honouring
  ``Retry-After``) until they commit; so is a 401 (the token was revoked, expired or rotated:
  an authentication outage, not a verdict on the write); permanent refusals (403 included)
  finish the entry with an errno.
  ``Entry.done`` is set when the entry is committed or refused: that is "committed".

Invariants: an entry leaves the journal only after it committed or was refused for good; a
committed entry may still be in the journal after a crash, and replaying it is harmless because
the server replays the stored response for a known idempotency key.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import random
import sqlite3
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import trio

from ..client import ApiClient
from ..errors import (ERRNO_BY_CODE, ApiError, Conflict, NotFound, PreconditionFailed,
                      TransientError, Unauthorized)
from ..wire import BatchOperation, Record, sha256_hex
from .cachedir import private_file

log = logging.getLogger("memfuse.outbox")

PUT, DELETE, MOVE, MOVE_PREFIX, ATTRS = "put", "delete", "move", "move_prefix", "attrs"
MERGE_ROUNDS = 8  # rebase attempts of one append racing other writers, then back off
BATCH_MAX_ENTRIES = 100  # entries in one batch (the server's BATCH_MAX_OPERATIONS)
BATCH_MAX_CONTENT = 4 * 1024 * 1024  # bytes of content in one batch (the server takes 16 MiB)


def errno_for(err: ApiError) -> int:
    """Map a permanent API refusal to the errno the syscall returns (the errno table of docs/API.md)."""
    if err.code in ERRNO_BY_CODE:
        return ERRNO_BY_CODE[err.code]
    return {401: errno.EACCES, 403: errno.EACCES, 404: errno.ENOENT, 409: errno.EEXIST,
            413: errno.EFBIG, 507: errno.ENOSPC}.get(err.status or 0, errno.EIO)


@dataclass(eq=False)
class Entry:
    """One accepted change. ``args`` holds the op's paths (store-relative) and flags; ``content``
    the bytes of a ``put``. ``errno`` is 0 once committed, the refusal's errno otherwise."""

    id: int
    store: str
    op: str
    node_key: str | None
    args: dict[str, Any]
    content: bytes | None = None
    key: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: float = field(default_factory=time.time)
    durable: trio.Event = field(default_factory=trio.Event)
    done: trio.Event = field(default_factory=trio.Event)
    errno: int = 0
    reason: str = ""
    code: str = ""  # the refusal's problem code (``secret_detected``...), "" when committed
    attempts: int = 0
    record: Record | None = None  # the record after the commit, when the op returns one
    #: a ``put`` rebased onto a concurrent change (an append merged): the content the
    #: control plane now holds (``record.sha256``'s), else None
    merged: bytes | None = None
    record_id: str | None = None  # delete / move: the record the op acted on
    moved: list[Record] = field(default_factory=list)  # move_prefix: the records moved
    #: why the journal could not write this entry yet: ``(errno, reason)``, None once durable
    journal_error: tuple[int, str] | None = None
    #: set (and replaced) whenever the entry's state changes: a journal attempt or its end
    changed: trio.Event = field(default_factory=trio.Event)

    def notify(self) -> None:
        """Wake whoever waits on ``changed`` (``wait_accepted``)."""
        ev, self.changed = self.changed, trio.Event()
        ev.set()

    def finish(self) -> None:
        """The entry is committed or refused for good (``done``)."""
        self.done.set()
        self.notify()

    async def wait_accepted(self, timeout: float) -> None:
        """Wait until the entry is accepted (its journal row is on disk) or already finished
        (committed or refused: the control plane holds the outcome), at most ``timeout`` s.

        Raises ``CacheError`` with the journal's errno (``ENOSPC`` when the cache disk is full,
        ``EIO`` for other write failures) when the journal tried to write the entry and failed,
        or ``EIO`` when it did not get to it within ``timeout``. The entry stays queued either
        way: the journal keeps retrying it and the committer may still commit it.
        """
        with trio.move_on_after(timeout):
            while not (self.durable.is_set() or self.done.is_set()):
                if self.journal_error is not None:
                    raise CacheError(*self.journal_error)
                await self.changed.wait()
            return
        raise CacheError(errno.EIO, f"the outbox journal did not write within {timeout:g} s")


class Barrier:
    """A point in the journal's queue: ``durable`` (also ``done``) is set once everything
    queued before it is on disk. Waited on like an ``Entry`` (``wait_accepted``): a failed
    write sets ``journal_error``. Used by writes that are not outbox entries (local-only
    files: ``localfiles.LocalFiles``) so that their ``close(2)`` returns once they are on
    disk."""

    id = -1
    errno = 0
    reason = ""

    def __init__(self) -> None:
        self.durable = trio.Event()
        self.done = self.durable  # nothing to commit beyond the disk
        self.changed = trio.Event()
        self.journal_error: tuple[int, str] | None = None

    notify = Entry.notify
    wait_accepted = Entry.wait_accepted


class CacheError(OSError):
    """A write to the sidecar's own cache directory failed: ``errno`` (``ENOSPC`` for a full
    disk, else ``EIO`` or the OS's errno) and a one-line ``reason`` for logs and errors.log."""

    def __init__(self, err: int, reason: str) -> None:
        super().__init__(err, reason)
        self.reason = reason


def cache_errno(exc: BaseException) -> int:
    """The errno a failed write to the cache directory stands for: ``ENOSPC`` for a full
    disk (``SQLITE_FULL``, ``OSError(ENOSPC)`` or ``EDQUOT``), the OS errno of another
    ``OSError``, else ``EIO``."""
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


class Journal:
    """Durable, ordered storage of entries and of the node-key map (SQLite, fsynced).

    Writes are queued (``add`` / ``remove`` / ``set_key``, synchronous, on the trio thread) and
    applied in order by ``run`` in one transaction per batch (group commit) from a worker
    thread. A batch that fails to write (full disk, I/O error) stays queued, in order and with
    its waiters, in front of anything queued since; ``run`` retries it with backoff, so the
    journal resumes by itself once space returns. Every waiter of a failed batch is told why
    (``Entry.journal_error``), so ``close(2)`` can answer ``ENOSPC`` instead of waiting.

    Size: committed rows are deleted, an insert still queued when its entry finishes is never
    written at all, and the write-ahead log is checkpointed and truncated whenever the queue
    runs empty (at most every ``CHECKPOINT_EVERY`` s) and after a failed write, so the file
    holds about the bytes of the entries not yet committed (docs/SEMANTICS.md, cache size).
    """

    CHECKPOINT_EVERY = 2.0  # s between idle checkpoints
    RETRY_MIN, RETRY_MAX = 0.1, 2.0  # s: backoff of a failed batch

    def __init__(self, path: Path, metrics=None) -> None:
        self.path = path
        self.metrics = metrics
        private_file(path)  # 0600; SQLite gives its -wal / -shm files the same mode
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        # a new file gives freed pages back on `incremental_vacuum` (no effect on an old one)
        self._db.execute("PRAGMA auto_vacuum=INCREMENTAL")
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA wal_autocheckpoint=256")  # pages (1 MiB), not the default 4 MiB
        self._db.execute("PRAGMA journal_size_limit=1048576")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS entries (id INTEGER PRIMARY KEY, key TEXT NOT NULL,"
            " store TEXT NOT NULL, op TEXT NOT NULL, node_key TEXT, args TEXT NOT NULL,"
            " content BLOB, created REAL NOT NULL)")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS keymap (node_key TEXT PRIMARY KEY, record_id TEXT,"
            " sha256 TEXT)")
        # files whose content was refused for good: kept here (not in the blob cache, a
        # cache) so they survive a restart, still rejected (``rejected.RejectedFiles``)
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS rejected (node_key TEXT PRIMARY KEY, store TEXT NOT NULL,"
            " path TEXT NOT NULL, errno INTEGER NOT NULL, code TEXT NOT NULL, reason TEXT NOT NULL,"
            " content BLOB NOT NULL, record_id TEXT, type TEXT, mode INTEGER, mtime_ns INTEGER,"
            " created REAL NOT NULL)")
        # files with local-only names (editor temporaries, ``*~``, ``4913``...): never sent,
        # kept here so they survive a restart as on a local disk (``localfiles.LocalFiles``)
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS local_files (node_key TEXT PRIMARY KEY,"
            " store TEXT NOT NULL, path TEXT NOT NULL, content BLOB NOT NULL,"
            " mode INTEGER NOT NULL, mtime_ns INTEGER NOT NULL, created REAL NOT NULL)")
        # the recent lines of ``.memfuse/errors.log`` (one JSON object each, oldest first by
        # id), so the log of refusals survives a restart as a log file on a local disk would
        # (``control.ControlFiles``); bounded by ``add_error``'s ``keep``
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS errors_log (id INTEGER PRIMARY KEY, line TEXT NOT NULL)")
        # files whose last put was merged while they were written again: the local content
        # that put carried, base of the next put (``Committer._merged``), kept across a crash
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS merges (node_key TEXT PRIMARY KEY, local_sha TEXT NOT NULL,"
            " local BLOB NOT NULL, merged_sha TEXT NOT NULL)")
        # queued writes: [sql, params, entry id of an insert (else None)]
        self._pending: list[list] = []
        self._waiters: list[Entry] = []
        self._unwritten: dict[int, list] = {}  # entry id -> its queued insert
        self._wakeup = trio.Event()
        self._lock = trio.Lock()
        self.error: CacheError | None = None  # the last write failure, None once one succeeds
        self.failures = 0  # failed batch writes since start
        self._last_checkpoint = 0.0

    def load(self) -> tuple[list[Entry], dict[str, tuple[str | None, str | None]]]:
        """Read what a previous process left: entries in order and the key map."""
        entries = []
        for row in self._db.execute(
                "SELECT id, key, store, op, node_key, args, content, created FROM entries ORDER BY id"):
            e = Entry(id=row[0], key=row[1], store=row[2], op=row[3], node_key=row[4],
                      args=json.loads(row[5]), content=row[6], created=row[7])
            e.durable.set()
            entries.append(e)
        keymap = {r[0]: (r[1], r[2]) for r in self._db.execute(
            "SELECT node_key, record_id, sha256 FROM keymap")}
        return entries, keymap

    def load_merges(self) -> dict[str, tuple[str, bytes, str]]:
        """What ``set_merge`` kept: node key -> (local sha256, local bytes, merged sha256)."""
        return {r[0]: (r[1], bytes(r[2]), r[3]) for r in self._db.execute(
            "SELECT node_key, local_sha, local, merged_sha FROM merges")}

    def set_merge(self, node_key: str, value: tuple[str, bytes, str] | None) -> None:
        """Queue the merge state of ``node_key`` (None: forgotten), written in order with the
        entries (in the batch of the entry whose put made it). Never blocks."""
        if value is None:
            self._pending.append(["DELETE FROM merges WHERE node_key=?", (node_key,), None])
        else:
            self._pending.append(["INSERT OR REPLACE INTO merges VALUES (?,?,?,?)",
                                  (node_key, *value), None])
        self._wakeup.set()

    REJECTED_COLUMNS = ("node_key", "store", "path", "errno", "code", "reason", "content",
                        "record_id", "type", "mode", "mtime_ns", "created")

    def load_rejected(self) -> list[dict[str, Any]]:
        """The rejected files a previous process kept (``replace_rejected``), one dict a row
        with the keys of ``REJECTED_COLUMNS`` (``content`` as bytes), oldest first."""
        cols = ", ".join(self.REJECTED_COLUMNS)
        return [dict(zip(self.REJECTED_COLUMNS, row)) for row in self._db.execute(
            f"SELECT {cols} FROM rejected ORDER BY created")]

    def replace_rejected(self, stores: list[str], rows: list[dict[str, Any]]) -> None:
        """Queue the replacement of the rejected files of ``stores`` (slugs) by ``rows``
        (dicts with the keys of ``REJECTED_COLUMNS``), written in order with the entries, in
        one transaction with whatever else the batch holds (so a fix's ``put`` and the end of
        its rejection land together). Rows of other stores are kept. Never blocks."""
        for slug in stores:
            self._pending.append(["DELETE FROM rejected WHERE store=?", (slug,), None])
        marks = ",".join("?" * len(self.REJECTED_COLUMNS))
        for r in rows:
            self._pending.append([f"INSERT OR REPLACE INTO rejected VALUES ({marks})",
                                  tuple(r[c] for c in self.REJECTED_COLUMNS), None])
        self._wakeup.set()

    LOCAL_COLUMNS = ("node_key", "store", "path", "content", "mode", "mtime_ns", "created")

    def load_local(self) -> list[dict[str, Any]]:
        """The local-only files a previous process kept (``put_local``), one dict a row with
        the keys of ``LOCAL_COLUMNS`` (``content`` as bytes), oldest first."""
        cols = ", ".join(self.LOCAL_COLUMNS)
        return [dict(zip(self.LOCAL_COLUMNS, row)) for row in self._db.execute(
            f"SELECT {cols} FROM local_files ORDER BY created")]

    def put_local(self, row: dict[str, Any]) -> None:
        """Queue the write of one local-only file (a dict with the keys of
        ``LOCAL_COLUMNS``), replacing its earlier row. Never blocks."""
        marks = ",".join("?" * len(self.LOCAL_COLUMNS))
        self._pending.append([f"INSERT OR REPLACE INTO local_files VALUES ({marks})",
                              tuple(row[c] for c in self.LOCAL_COLUMNS), None])
        self._wakeup.set()

    def move_local(self, node_key: str, path: str, mode: int, mtime_ns: int) -> None:
        """Queue a new path / mode / mtime for a kept local-only file (content unchanged)."""
        self._pending.append(["UPDATE local_files SET path=?, mode=?, mtime_ns=? WHERE node_key=?",
                              (path, mode, mtime_ns, node_key), None])
        self._wakeup.set()

    def delete_local(self, node_key: str) -> None:
        """Queue the deletion of a kept local-only file (unlinked, or renamed onto a normal
        name and now a record)."""
        self._pending.append(["DELETE FROM local_files WHERE node_key=?", (node_key,), None])
        self._wakeup.set()

    def barrier(self) -> Barrier:
        """A ``Barrier`` after everything queued so far (set once it is all on disk)."""
        b = Barrier()
        self._waiters.append(b)
        self._wakeup.set()
        return b

    def load_errors(self, keep: int) -> list[dict[str, Any]]:
        """The last ``keep`` lines of ``errors.log`` a previous process kept (``add_error``),
        oldest first, each the dict that was added; unreadable lines are skipped."""
        out = []
        for (line,) in self._db.execute(
                "SELECT line FROM (SELECT id, line FROM errors_log ORDER BY id DESC LIMIT ?)"
                " ORDER BY id", (keep,)):
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict):
                out.append(entry)
        return out

    def add_error(self, entry: dict[str, Any], keep: int) -> None:
        """Queue ``entry`` (one ``errors.log`` line: a JSON-able dict without content) as the
        newest kept line and the deletion of all but the newest ``keep`` lines; written in
        order with the entries. Never blocks, never raises (a failed write is retried with
        the batch)."""
        self._pending.append(["INSERT INTO errors_log (line) VALUES (?)",
                              (json.dumps(entry),), None])
        self._pending.append(["DELETE FROM errors_log WHERE id <= "
                              "(SELECT MAX(id) FROM errors_log) - ?", (keep,), None])
        self._wakeup.set()

    def next_id(self) -> int:
        """The highest entry id on disk (0 for an empty journal): entry ids continue from it."""
        row = self._db.execute("SELECT COALESCE(MAX(id), 0) FROM entries").fetchone()
        return int(row[0])

    def depth(self) -> int:
        """Queued writes not yet on disk."""
        return len(self._pending)

    # --- queued writes, applied in order by run() -------------------------------------------
    def add(self, e: Entry) -> None:
        """Queue the insert of entry ``e`` (written by ``run`` in the next batch; ``e.durable``
        is set once it is on disk). Never blocks, never raises."""
        op = ["INSERT INTO entries VALUES (?,?,?,?,?,?,?,?)",
              (e.id, e.key, e.store, e.op, e.node_key, json.dumps(e.args), e.content, e.created),
              e.id]
        self._pending.append(op)
        self._unwritten[e.id] = op
        self._waiters.append(e)
        self._wakeup.set()

    def remove(self, e: Entry) -> None:
        """The entry finished: delete its row (or never write it, when still queued)."""
        op = self._unwritten.pop(e.id, None)
        if op is not None:
            self._pending.remove(op)
            if e in self._waiters:
                self._waiters.remove(e)
            return
        self._pending.append(["DELETE FROM entries WHERE id=?", (e.id,), None])
        self._wakeup.set()

    def set_key(self, node_key: str, record_id: str | None, sha: str | None) -> None:
        """Queue the key map row ``node_key`` → (record id, sha256) (None, None: forgotten)."""
        self._pending.append(["INSERT OR REPLACE INTO keymap VALUES (?,?,?)",
                              (node_key, record_id, sha), None])
        self._wakeup.set()

    def _apply(self, batch: list[list]) -> None:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            for sql, params, _ in batch:
                self._db.execute(sql, params)
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise

    def _checkpoint(self) -> None:
        """Copy the write-ahead log into the database, truncate it, give free pages back."""
        self._db.execute("PRAGMA incremental_vacuum").fetchall()  # one page per step
        self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()

    async def flush_pending(self) -> None:
        """Write everything queued so far in one transaction (from a worker thread).

        Raises ``CacheError`` when the write fails; the batch then stays queued in front of
        later writes, and each of its entries carries the error in ``journal_error``."""
        async with self._lock:
            batch, self._pending = self._pending, []
            waiters, self._waiters = self._waiters, []
            self._unwritten = {}
            if batch:
                try:
                    await trio.to_thread.run_sync(self._apply, batch)
                except BaseException as exc:
                    self._pending[:0] = batch
                    self._waiters[:0] = waiters
                    self._unwritten = {op[2]: op for op in self._pending if op[2] is not None}
                    if not isinstance(exc, Exception):
                        raise
                    err = cache_error(exc, "writing the outbox journal")
                    self.error = err
                    self.failures += 1
                    for w in waiters:
                        w.journal_error = (err.errno, err.reason)
                        w.notify()
                    raise err from exc
            self.error = None
            for w in waiters:
                w.journal_error = None
                w.durable.set()
                w.notify()

    async def run(self) -> None:
        """Group-commit loop: wait for queued writes, apply them, repeat. Never returns; a
        failed write is retried with backoff (``RETRY_MIN`` .. ``RETRY_MAX`` s)."""
        delay = self.RETRY_MIN
        while True:
            await self._wakeup.wait()
            self._wakeup = trio.Event()
            try:
                await self.flush_pending()
            except CacheError as err:
                if self.metrics is not None:
                    self.metrics.cache_write_errors.labels(
                        "outbox", errno.errorcode.get(err.errno, str(err.errno))).inc()
                if delay == self.RETRY_MIN:  # once per streak of failures, no traceback
                    log.warning("outbox journal write failed; the batch stays queued and is "
                                "retried", extra={"errno": errno.errorcode.get(err.errno),
                                                  "reason": err.reason, "queued": len(self._pending),
                                                  "retry_in_s": delay})
                with contextlib.suppress(sqlite3.Error):  # may free the log's space
                    await trio.to_thread.run_sync(self._checkpoint)
                await trio.sleep(delay)
                delay = min(delay * 2, self.RETRY_MAX)
                self._wakeup.set()
                continue
            if delay != self.RETRY_MIN:
                log.info("outbox journal writes again", extra={"failures": self.failures})
                delay = self.RETRY_MIN
            now = time.monotonic()
            if not self._pending and now - self._last_checkpoint >= self.CHECKPOINT_EVERY:
                self._last_checkpoint = now
                try:
                    await trio.to_thread.run_sync(self._checkpoint)
                except sqlite3.Error as exc:
                    log.info("outbox checkpoint failed; retried later",
                             extra={"errno": errno.errorcode.get(cache_errno(exc))})

    def close(self) -> None:
        """Write what is still queued (best effort: on failure it is logged, and the entries
        concerned are replayed from the outbox or re-sent by their nodes next time), close."""
        try:
            if self._pending:
                self._apply(self._pending)
                self._pending = []
            self._checkpoint()
        except (sqlite3.Error, OSError) as exc:
            log.warning("outbox journal: could not write the last queued changes at exit",
                        extra={"queued": len(self._pending),
                               "errno": errno.errorcode.get(cache_errno(exc))})
        self._db.close()


class Committer:
    """Commits entries to the control plane, one ordered queue per store.

    ``on_result(entry)`` is called on the trio thread after each entry finishes (committed or
    refused: ``entry.errno`` / ``entry.reason``) so the filesystem can update the node's state
    and the store's mirror; ``on_conflict(entry, what)`` when a write met a concurrent change
    and was resolved last-writer-wins (``what``: one sentence for ``errors.log``). Both are
    set by the filesystem and the sidecar; an exception in either is logged, never raised.
    """

    def __init__(self, client: ApiClient, journal: Journal,
                 keymap: dict[str, tuple[str | None, str | None]],
                 on_result: Callable[[Entry], None] | None = None,
                 backoff_max: float = 30.0, metrics=None) -> None:
        self.metrics = metrics
        self.client = client
        self.journal = journal
        self.keymap = keymap  # node_key -> (record_id, sha256)
        # (store, record id) -> the sha256 the store's mirror holds, or None; set by the
        # sidecar: records loaded from a snapshot are not in ``keymap`` (memory per record)
        self.base_sha: Callable[[str, str], str | None] | None = None
        self.on_result = on_result or (lambda e: None)
        #: ``on_conflict(entry, description)``: a write met a newer version (last writer wins)
        self.on_conflict: Callable[[Entry, str], None] = lambda e, what: None
        self.backoff_max = backoff_max
        self.queues: dict[str, deque[Entry]] = {}
        self._wakeups: dict[str, trio.Event] = {}
        self._nursery: trio.Nursery | None = None
        self._seq = journal.next_id()
        self.committed = 0
        self.refused = 0
        self.retries = 0
        self.conflicts = 0
        self.merges = 0  # appends rebased onto a concurrent change instead of overwriting it
        #: ``base_content(sha256)``: the bytes of a version this sidecar had (the blob
        #: cache), None when gone; the base of an append rebased after a 412
        self.base_content: Callable[[str], bytes | None] = lambda sha: None
        #: node key -> (sha256 and bytes of the local content a merged put carried, sha256
        #: the control plane holds after the merge): a later put of that file, written
        #: before the merge came back, derives from the local content, not the merge, and is
        #: rebased onto it too (``_put_base``); dropped once the file shows the merge
        #: (``forget_merge``) or the next put was sent
        self._merged: dict[str, tuple[str, bytes, str]] = journal.load_merges()
        self.auth_waits = 0  # commit attempts deferred because the token was refused (401)
        self.idle = trio.Event()
        self.idle.set()
        self._store_idle: dict[str, trio.Event] = {}
        self._poke = trio.Event()
        #: entries finished (committed or refused) per store since start; a reconcile after
        #: ``410`` compares it across its snapshot to see whether a local commit landed
        self.finished: dict[str, int] = {}
        self._held: dict[str, trio.Event] = {}  # stores whose next commit waits (``hold``)
        self._inflight: dict[str, trio.Event] = {}  # set when the store's current commit ends
        self.unexpected = 0  # commit attempts that failed with an unexpected exception
        #: commit a backlog of one store in batches (``POST .../batch``); turned off when the
        #: control plane answers that it has no such endpoint
        self.batching = True
        self.batches = 0  # batches the control plane answered
        #: the outbox's own view of the control plane: None while its last commit attempt
        #: was answered (or none was made yet), else since when (``time.time()``) and why
        #: its attempts fail transiently (``unreachable``: ``{"since", "error"}``)
        self.unreachable: dict[str, Any] | None = None

    # --- the control plane's reachability, as the outbox sees it ------------------------------
    @property
    def failing(self) -> bool:
        """Whether the outbox is in backoff: its last commit attempt failed transiently
        (connection error, timeout, 5xx, 429) and none was answered since. A ``close`` then
        returns once its write is accepted, without waiting for a commit that cannot come
        (``Filesystem.flush``). A 401 does not count: a rotated token is re-read within
        seconds, so a commit may well come within ``--commit-wait``."""
        return self.unreachable is not None

    def _attempt_failed(self, err: ApiError) -> None:
        """A commit attempt (single or batch) failed transiently: note since when, and on
        the transition wake every queued entry's waiters (a ``close`` waiting for its
        commit returns then)."""
        why = err.code or (f"http_{err.status}" if err.status else "unreachable")
        if self.unreachable is not None:
            self.unreachable["error"] = why
            return
        self.unreachable = {"since": time.time(), "error": why}
        log.warning("control plane unreachable for commits; closes return once their write "
                    "is accepted", extra={"status": err.status, "code": why,
                                          "depth": self.depth()})
        for q in self.queues.values():
            for e in q:
                e.notify()

    def _attempt_answered(self) -> None:
        """The control plane answered a commit attempt (a commit or a refusal)."""
        if self.unreachable is not None:
            log.info("control plane reachable again for commits",
                     extra={"down_s": round(time.time() - self.unreachable["since"], 3),
                            "depth": self.depth()})
            self.unreachable = None

    def forget_merge(self, node_key: str) -> None:
        """The file ``node_key`` now shows the merged content of its last put (nothing was
        written on top meanwhile): later puts derive from it, so nothing to rebase."""
        self._set_merged(node_key, None)

    def replayed(self) -> None:
        """The outbox a previous process left is committed (``replay`` + ``wait_idle``),
        before any store is loaded: no put written on content from before the restart is
        left, and every file will show the control plane's content, so the merge states
        kept for such puts are obsolete: dropped."""
        for key in list(self._merged):
            self._set_merged(key, None)

    def _set_merged(self, node_key: str, value: tuple[str, bytes, str] | None) -> None:
        """Change ``_merged[node_key]`` (None: drop it) and queue the same in the journal."""
        if value is None:
            if self._merged.pop(node_key, None) is not None:
                self.journal.set_merge(node_key, None)
        elif self._merged.get(node_key) != value:
            self._merged[node_key] = value
            self.journal.set_merge(node_key, value)

    def base_shas(self) -> set[str]:
        """The sha256 of the bases of queued ``put`` entries (the versions their
        ``If-Match`` names): the blob collection keeps those blobs, so an append that
        meets a concurrent change can be rebased (``_rebase``)."""
        out = set()
        for store, q in self.queues.items():
            for e in q:
                if e.op == PUT and e.node_key is not None:
                    sha = self._rid(e.node_key, store)[1]
                    if sha:
                        out.add(sha)
        return out

    # --- enqueueing (synchronous, on the trio thread: order is fixed here) -------------------
    def submit(self, store: str, op: str, node_key: str | None, args: dict[str, Any],
               content: bytes | None = None) -> Entry:
        """Accept one change: queue it for the journal and for its store's worker."""
        self._seq += 1
        e = Entry(id=self._seq, store=store, op=op, node_key=node_key, args=args, content=content)
        self.journal.add(e)
        self._enqueue(e)
        return e

    def _enqueue(self, e: Entry) -> None:
        q = self.queues.setdefault(e.store, deque())
        q.append(e)
        self.idle = trio.Event() if self.idle.is_set() else self.idle
        if e.store not in self._wakeups:
            self._wakeups[e.store] = trio.Event()
            if self._nursery is not None:
                self._nursery.start_soon(self._worker, e.store)
        self._wakeups[e.store].set()

    def replay(self, entries: list[Entry]) -> None:
        """Queue entries a previous process accepted but did not finish (call before mount)."""
        for e in entries:
            self._seq = max(self._seq, e.id)
            self._enqueue(e)

    def poke(self) -> None:
        """The control plane answered someone (e.g. the change feed): retry waiting commits
        now instead of at the end of their backoff."""
        if self.depth():
            self._poke.set()
            self._poke = trio.Event()

    def depth(self, store: str | None = None) -> int:
        """Entries not yet finished, in one store or in all."""
        if store is not None:
            return len(self.queues.get(store, ()))
        return sum(len(q) for q in self.queues.values())

    async def wait_store_idle(self, store: str) -> None:
        """Return once ``store`` has no unfinished entry (at once when it has none)."""
        while self.queues.get(store):
            ev = self._store_idle.setdefault(store, trio.Event())
            await ev.wait()

    def oldest_age(self) -> float:
        """Seconds the oldest queued entry has waited (0.0 when none is queued)."""
        ages = [time.time() - q[0].created for q in self.queues.values() if q]
        return max(ages, default=0.0)

    async def wait_idle(self) -> None:
        """Return once every queued entry is finished."""
        while self.depth():
            await self.idle.wait()

    def queued(self, store: str) -> list[Entry]:
        """The store's unfinished entries, in order (the first may be in flight)."""
        return list(self.queues.get(store, ()))

    @contextlib.asynccontextmanager
    async def hold(self, store: str):
        """Inside: no commit of ``store`` is in flight and none starts (entries still queue).

        Waits for the commit in flight to end (it is retried until it commits or is refused,
        so this waits as long as the control plane is unreachable). Used by the reconcile
        after ``410``, so that its snapshot and the local tree describe the same moment."""
        ev = trio.Event()
        self._held[store] = ev
        try:
            while store in self._inflight:
                await self._inflight[store].wait()
            yield
        finally:
            del self._held[store]
            ev.set()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run one worker per store (more start as stores appear) until cancelled; reports
        ready through ``task_status.started()`` at once."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for store in list(self._wakeups):
                nursery.start_soon(self._worker, store)
            task_status.started()
            await trio.sleep_forever()

    # --- the per-store worker ----------------------------------------------------------------
    async def _worker(self, store: str) -> None:
        """Commit the store's entries in order, forever. Supervised: an unexpected exception
        outside a commit attempt is logged, counted and the loop restarts after a backoff
        (the entry it was on stays first in the queue)."""
        delay = 0.1
        while True:
            try:
                await self._worker_loop(store)
            except Exception:
                if self.metrics is not None:
                    self.metrics.task_failures.labels("committer").inc()
                log.exception("outbox worker failed; restarting", extra={"store": store,
                                                                          "restart_in_s": delay})
                await trio.sleep(delay)
                delay = min(delay * 2, self.backoff_max)

    async def _worker_loop(self, store: str) -> None:
        q = self.queues[store]
        while True:
            held = self._held.get(store)
            if held is not None:
                await held.wait()
                continue
            if not q:
                ev = self._store_idle.pop(store, None)
                if ev is not None:
                    ev.set()
                if not self.depth():
                    self.idle.set()
                ev = self._wakeups[store] = trio.Event()
                await ev.wait()
                continue
            batch = self._batch_of(q) if self.batching and len(q) > 1 else []
            if sum(op is not None for _, op in batch) >= 2:
                await self._commit_batch(store, q, batch)
                continue
            e = q[0]
            self._inflight[store] = trio.Event()
            try:
                await self._commit_with_retry(e)
            finally:
                self._inflight.pop(store).set()
            self._finished(store, q, e)

    def _finished(self, store: str, q: deque[Entry], e: Entry) -> None:
        """``e`` (first in ``q``) committed or was refused for good: out of the queue and the
        journal, then ``on_result``."""
        q.popleft()
        self.finished[store] = self.finished.get(store, 0) + 1
        self.journal.remove(e)
        e.finish()
        try:
            self.on_result(e)
        except Exception:
            log.exception("outbox result handler failed", extra={"entry": e.id})

    # --- batches: a backlog of one store in one request ---------------------------------------
    def _batch_of(self, q: deque[Entry]) -> list[tuple[Entry, BatchOperation | None]]:
        """The longest prefix of ``q`` that may go in one batch, each entry with the operation
        its first request would be (None: it sends nothing, e.g. a delete of a file that never
        reached the server, or a local refusal). A batch holds at most ``BATCH_MAX_ENTRIES``
        entries and ``BATCH_MAX_CONTENT`` bytes of content, no ``move_prefix``, and touches
        each file (node key, move target) once: an entry's request may depend on what an
        earlier entry of the same file learnt (its record id, its sha256)."""
        out: list[tuple[Entry, BatchOperation | None]] = []
        seen: set[str] = set()
        size = 0
        for e in q:
            if e.op not in (PUT, ATTRS, DELETE, MOVE) or e.node_key is None or len(out) >= BATCH_MAX_ENTRIES:
                break
            touched = {e.node_key}
            if e.op == MOVE and e.args.get("target_key"):
                touched.add(e.args["target_key"])
            n = len(e.content or b"")
            if touched & seen or (out and size + n > BATCH_MAX_CONTENT):
                break
            seen |= touched
            size += n
            out.append((e, self._first_op(e)))
        return out

    def _first_op(self, e: Entry) -> BatchOperation | None:
        """The batch operation of the first request ``_apply(e)`` would send (same body, key
        and If-Match, so an answer replays across single requests and batches), or None when
        it would send none."""
        a, c = e.args, self.client
        rid, sha = self._rid(e.node_key, e.store)
        if e.op == PUT:
            rid, sha, _ = self._put_base(e)
            text = (e.content or b"").decode("utf-8", errors="surrogateescape")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                return None  # refused locally by _put
            kw = {"mode": a.get("mode"), "mtime_ns": a.get("mtime_ns")}
            if rid is not None:
                return c.batch_update(rid, text, type=a.get("type"), if_match=sha, idempotency_key=e.key, **kw)
            return c.batch_create(a["path"], text, type=a.get("type"), idempotency_key=e.key, **kw)
        if rid is None:
            return None
        if e.op == ATTRS:
            given = {k: a[k] for k in ("mode", "mtime_ns") if k in a}
            return c.batch_attrs(rid, idempotency_key=e.key, **given)
        if e.op == DELETE:
            return c.batch_delete(rid, idempotency_key=e.key)
        return c.batch_move(rid, a["to"], replace=bool(a.get("replace")), idempotency_key=e.key)

    async def _commit_batch(self, store: str, q: deque[Entry],
                            batch: list[tuple[Entry, BatchOperation | None]]) -> None:
        """Send the first requests of ``batch``'s entries as one batch, then finish each entry
        in order exactly as alone: its batch answer stands for its first request (a 412, 404
        or 409 then gets the same follow-up requests, one by one), refusals get their errno.
        A transient failure of the batch retries it (same keys: what was applied replays); a
        server without the endpoint (404 ``not_found`` / 405) turns batching off; any other
        refusal of the whole batch commits the entries one by one."""
        self._inflight[store] = trio.Event()
        try:
            ops = [op for _, op in batch if op is not None]
            outcomes = await self._send_batch(store, ops)
            answers = iter(outcomes) if outcomes is not None else None
            for e, op in batch:
                first = None
                if answers is not None and op is not None:
                    first = _Answered(self.client, op.op, next(answers))
                await self._commit_with_retry(e, first)
                self._finished(store, q, e)
        finally:
            self._inflight.pop(store).set()

    async def _send_batch(self, store: str, ops: list[BatchOperation]) -> list[Any] | None:
        """The outcomes of ``ops`` (``ApiClient.batch``), retrying transient failures and 401
        with the committer's backoff; None when the entries must go one by one."""
        attempts = 0
        while True:
            attempts += 1
            try:
                outcomes = await self.client.batch(store, ops)
                self._attempt_answered()
                self.batches += 1
                if self.metrics is not None:
                    self.metrics.batches.inc()
                return outcomes
            except (TransientError, Unauthorized) as err:
                self.retries += 1
                if isinstance(err, TransientError):
                    self._attempt_failed(err)
                if self.metrics is not None:
                    self.metrics.retries.inc()
                delay = self._backoff(attempts, err)
                log.info("batch deferred: will retry", extra={
                    "store": store, "operations": len(ops), "attempt": attempts,
                    "status": err.status, "code": err.code, "retry_in_s": round(delay, 3)})
                with trio.move_on_after(delay):
                    await self._poke.wait()
            except ApiError as err:
                self._attempt_answered()
                if err.status == 405 or (err.status == 404 and err.code in ("not_found", "")):
                    self.batching = False
                    log.info("the control plane has no batch endpoint; committing one by one",
                             extra={"store": store, "status": err.status})
                else:
                    log.info("batch refused as a whole; committing its entries one by one",
                             extra={"store": store, "status": err.status, "code": err.code})
                return None
            except Exception:
                self.unexpected += 1
                log.exception("batch failed unexpectedly; committing its entries one by one",
                              extra={"store": store, "operations": len(ops)})
                return None

    def _backoff(self, attempts: int, err: ApiError) -> float:
        """Seconds before attempt ``attempts + 1``: exponential with full jitter, at least the
        server's ``Retry-After`` (capped at ``backoff_max``)."""
        delay = random.uniform(0, min(self.backoff_max, 0.05 * 2 ** min(attempts, 12)))
        ra = getattr(err, "retry_after", None)
        if ra is not None and not math.isnan(ra):
            delay = max(delay, min(ra, self.backoff_max))
        return delay

    async def _commit_with_retry(self, e: Entry, answered: "_Answered | None" = None) -> None:
        """Commit ``e``, retrying transient failures until it commits or is refused for good.
        ``answered``: the client whose first request of ``e`` was answered inside a batch (used
        for the first attempt only)."""
        while True:
            e.attempts += 1
            client, answered = answered, None
            try:
                await self._apply(e, client)
                self._attempt_answered()
                self.committed += 1
                if self.metrics is not None:
                    self.metrics.commits.labels(e.op).inc()
                return
            except TransientError as err:
                self.retries += 1
                if err.code != "merge_contended":  # that one was answered: busy, not down
                    self._attempt_failed(err)
                else:
                    self._attempt_answered()
                if self.metrics is not None:
                    self.metrics.retries.inc()
                delay = min(self.backoff_max, 0.05 * 2 ** min(e.attempts, 12))
                delay = random.uniform(0, delay)  # full jitter
                if err.retry_after is not None and not math.isnan(err.retry_after):
                    delay = max(delay, min(err.retry_after, self.backoff_max))
                log.info("commit deferred: transient failure, will retry",
                         extra={"entry": e.id, "op": e.op, "store": e.store,
                                "attempt": e.attempts, "status": err.status, "code": err.code,
                                "retry_in_s": round(delay, 3)})
                with trio.move_on_after(delay):  # or sooner, once the control plane answers
                    await self._poke.wait()
            except Unauthorized as err:
                # an authentication outage (token revoked, expired, or rotated and not yet
                # re-read), not a refusal of this write: it stays first in the queue
                self.auth_waits += 1
                delay = random.uniform(0, min(self.backoff_max, 0.05 * 2 ** min(e.attempts, 12)))
                log.info("commit deferred: the control plane refused the token; will retry",
                         extra={"entry": e.id, "op": e.op, "store": e.store,
                                "attempt": e.attempts, "status": err.status, "code": err.code,
                                "retry_in_s": round(delay, 3)})
                with trio.move_on_after(delay):  # or sooner: a new token, an answer
                    await self._poke.wait()
            except ApiError as err:
                if isinstance(err, TransientError):  # pragma: no cover - caught above
                    raise
                self._attempt_answered()
                self.refused += 1
                e.errno = errno_for(err)
                e.reason = err.detail or err.code or f"HTTP {err.status}"
                e.code = err.code or f"http_{err.status}"
                log.warning("commit refused", extra={
                    "entry": e.id, "op": e.op, "store": e.store,
                    "path": e.args.get("path") or e.args.get("from"),
                    "status": err.status, "code": e.code, "errno": errno.errorcode.get(e.errno)})
                return
            except Exception:
                # a bug or an answer we cannot read: never end the mount, never drop the
                # entry; log it with context, count it and retry like a transient failure
                self.unexpected += 1
                self.retries += 1
                if self.metrics is not None:
                    self.metrics.task_failures.labels("committer").inc()
                delay = random.uniform(0, min(self.backoff_max, 0.05 * 2 ** min(e.attempts, 12)))
                log.exception("commit failed unexpectedly; will retry",
                              extra={"entry": e.id, "op": e.op, "store": e.store,
                                     "attempt": e.attempts, "retry_in_s": round(delay, 3)})
                await trio.sleep(max(delay, 0.05))

    def _conflict(self, e: Entry, what: str) -> None:
        self.conflicts += 1
        if self.metrics is not None:
            self.metrics.conflicts.inc()
        try:
            self.on_conflict(e, what)
        except Exception:
            log.exception("conflict handler failed")

    def _rid(self, node_key: str | None, store: str = "") -> tuple[str | None, str | None]:
        """(record id, last known sha256) of a node key: from ``keymap`` (keys learned from
        commits, remote changes and first local writes), else for ``r:<id>`` the id and the
        sha256 the store's mirror holds (``base_sha``; None when unknown: the update is then
        unconditional)."""
        if node_key is None:
            return None, None
        if node_key in self.keymap:
            return self.keymap[node_key]
        if node_key.startswith("r:"):
            rid = node_key[2:]
            return rid, (self.base_sha(store, rid) if self.base_sha is not None else None)
        return None, None

    def _learn(self, node_key: str, rec: Record | None) -> None:
        val = (rec.id, rec.sha256) if rec is not None else (None, None)
        self.keymap[node_key] = val
        self.journal.set_key(node_key, *val)

    async def _apply(self, e: Entry, client: Any = None) -> None:
        """Send one entry to the control plane with the method for its ``op`` (through
        ``client``, default the committer's). Raises the client's ``ApiError``
        (``_commit_with_retry`` tells transient from permanent); an unknown ``op`` (a corrupt
        journal) is a permanent refusal."""
        apply = {PUT: self._put, ATTRS: self._set_attrs, DELETE: self._delete, MOVE: self._move,
                 MOVE_PREFIX: self._move_prefix}.get(e.op)
        if apply is None:  # pragma: no cover - journal corruption
            raise _local_refusal("validation_error", f"unknown outbox op {e.op!r}")
        await apply(e, client if client is not None else self.client, e.args)

    def _put_base(self, e: Entry) -> tuple[str | None, str | None, bytes | None]:
        """(record id, the sha256 the put's ``If-Match`` names, that version's bytes when
        known here already) of a ``put``: the last known sha256 of its record, unless the
        previous put of the same file was merged (``_merged``) and the control plane still
        holds that merge: this put was written on the local content before the merge came
        back, so its base is that local content (the ``If-Match`` then fails and the put is
        rebased onto the merge, ``_rebase``)."""
        rid, sha = self._rid(e.node_key, e.store)
        m = self._merged.get(e.node_key) if e.node_key else None
        if rid is not None and m is not None and sha == m[2]:
            return rid, m[0], m[1]
        return rid, sha, None

    async def _put(self, e: Entry, c: ApiClient, a: dict[str, Any]) -> None:
        """Create or update the record with the entry's content and attributes (``If-Match``
        the sha256 of the version it was written on, ``_put_base``). On ``412`` an append
        (the content is that version's plus a suffix) is rebased onto the current version
        (``_rebase``); any other concurrent change is resolved last-writer-wins
        (``_conflict``); a record deleted elsewhere is created again."""
        text = (e.content or b"").decode("utf-8", errors="surrogateescape")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise _local_refusal("invalid_content", "content is not valid UTF-8") from None
        rid, sha, base = self._put_base(e)
        e.merged = None
        want = sha256_hex(e.content or b"")
        typ = a.get("type")
        # absent in entries journaled by earlier releases: then the server keeps / defaults
        attrs = {"mode": a.get("mode"), "mtime_ns": a.get("mtime_ns")}
        create_key = e.key
        if rid is not None:
            create_key = e.key + "-create"

            try:
                rec = await c.update_record(e.store, rid, text, type=typ, if_match=sha,
                                            idempotency_key=e.key, **attrs)
            except PreconditionFailed:
                cur = await c.get_record(e.store, rid, content=True)
                merged = None
                if (cur.sha256 == want and (typ is None or cur.type == typ)
                        and attrs["mode"] in (None, cur.mode)
                        and attrs["mtime_ns"] in (None, cur.mtime_ns)):
                    rec = cur
                elif (merged := await self._rebase(e, c, rid, sha, base, cur)) is not None:
                    rec = merged
                else:
                    self._conflict(e, "the record changed elsewhere; this write is now the "
                                      "latest version, the other one stays in history")
                    log.warning("conflict: record changed elsewhere; last writer wins, the "
                                "other version stays in history",
                                extra={"store": e.store, "path": a.get("path"), "record": rid})
                    rec = await c.update_record(e.store, rid, text, type=typ,
                                                idempotency_key=e.key + "-lww", **attrs)
            except NotFound:
                rid = None  # deleted elsewhere: re-create it below
        if rid is None:
            try:
                rec = await c.create_record(e.store, a["path"], text, type=typ,
                                            idempotency_key=create_key, **attrs)
            except Conflict as err:
                other = (err.problem or {}).get("record_id")
                if not other:
                    found = await c.find_record(e.store, a["path"])
                    other = found.id if found else None
                if other is None:
                    raise
                self._conflict(e, "the path was created elsewhere; this write is now the "
                                  "latest version of that record, the other stays in history")
                log.warning("conflict: path created elsewhere; last writer wins",
                            extra={"store": e.store, "path": a["path"], "record": other})
                rec = await c.update_record(e.store, other, text, type=typ,
                                            idempotency_key=e.key + "-lww", **attrs)
        e.record = rec
        self._learn(e.node_key, rec)
        if e.node_key is not None:
            # this put was sent: its base is used; a merge of it is the next one's base
            # until the file shows it (forget_merge)
            if e.merged is not None and rec is not None and rec.sha256 != want:
                self._set_merged(e.node_key, (want, e.content or b"", rec.sha256))
            else:
                self._set_merged(e.node_key, None)

    async def _rebase(self, e: Entry, c: ApiClient, rid: str, base_sha: str | None,
                      base: bytes | None, cur: Record) -> Record | None:
        """Merge a write that met a concurrent change (412) instead of overwriting it, when
        that is clean: an **append** (the put's content is its base version's content plus
        a suffix: ``echo >> f``) becomes the current content plus that suffix; any other
        change becomes a **three-way line merge** of base, current and local content
        (``merge3``, the Breezy project's merge) when the two changes touch disjoint
        regions. The result is written ``If-Match`` the current version, again (at most
        ``MERGE_ROUNDS``) if that changes meanwhile. ``cur``: the current record, with
        content. Returns the record written (``e.merged`` set to its content), or None when
        the changes overlap, or the base's content is not known here (``base_content``):
        last writer wins then.

        The merge is sent with one idempotency key (``<key>-rebase``): the control plane
        stores only answered writes, so a merge whose answer was lost (even across a
        restart) is met again as ``422 idempotency_key_reused`` on the retry's new body,
        which means it was applied: the current record is then the result. Raises
        ``TransientError`` (``merge_contended``) when other writers won ``MERGE_ROUNDS``
        times in a row (the entry backs off and tries again); API errors as the client
        raises them."""
        local = e.content or b""
        if base is None and base_sha:
            base = self.base_content(base_sha)
        if base is None or cur.deleted or cur.content is None:
            return None
        kind = "append" if local.startswith(base) else "three_way"
        typ = e.args.get("type")
        attrs = {"mode": e.args.get("mode"), "mtime_ns": e.args.get("mtime_ns")}
        for attempt in range(1, MERGE_ROUNDS + 1):
            theirs = cur.content.encode("utf-8")
            if kind == "append":
                new = theirs + local[len(base):]
            else:
                new = await trio.to_thread.run_sync(merge_lines, base, theirs, local)
                if new is None:
                    return None  # the changes overlap: last writer wins
            try:
                rec = await c.update_record(e.store, rid, new.decode("utf-8"), type=typ,
                                            if_match=cur.sha256,
                                            idempotency_key=e.key + "-rebase", **attrs)
            except PreconditionFailed:
                cur = await c.get_record(e.store, rid, content=True)
                if cur.deleted or cur.content is None:
                    return None
                continue
            except ApiError as err:
                if err.code != "idempotency_key_reused":
                    raise
                # applied before, its answer lost: what it wrote is in the current record
                rec = await c.get_record(e.store, rid, content=True)
                new = (rec.content or "").encode("utf-8")
            self.merges += 1
            if self.metrics is not None:
                self.metrics.merges.inc()
            e.merged = new
            log.info("write merged onto a concurrent change", extra={
                "store": e.store, "path": e.args.get("path"), "record": rid, "kind": kind,
                "base_sha256": base_sha, "theirs_sha256": cur.sha256,
                "merged_sha256": rec.sha256, "local_bytes": len(local),
                "merged_bytes": len(new), "attempt": attempt, "entry": e.id})
            return rec
        raise TransientError(f"merge lost {MERGE_ROUNDS} races in a row; will retry",
                             code="merge_contended")

    async def _set_attrs(self, e: Entry, c: ApiClient, a: dict[str, Any]) -> None:
        """Set the mode and / or mtime of a record whose content the control plane has."""
        # mode / mtime of a file whose content the control plane has: no upload, no
        # If-Match (attributes merge with whatever content is current: last writer wins
        # per attribute); only the members that changed are sent
        rid, _ = self._rid(e.node_key, e.store)
        e.record_id = rid
        if rid is None:
            return  # never reached the server (refused): the next put carries them
        given = {k: a[k] for k in ("mode", "mtime_ns") if k in a}
        try:
            e.record = await c.set_attributes(e.store, rid, idempotency_key=e.key, **given)
        except NotFound:
            pass  # deleted elsewhere: nothing to set

    async def _delete(self, e: Entry, c: ApiClient, a: dict[str, Any]) -> None:
        """Delete the record (already gone: nothing to do) and forget its key."""
        rid, _ = self._rid(e.node_key, e.store)
        e.record_id = rid
        if rid is not None:
            try:
                await c.delete_record(e.store, rid, idempotency_key=e.key)
            except NotFound:
                pass
        self._learn(e.node_key, None)
        if e.node_key is not None:
            self._set_merged(e.node_key, None)

    async def _move(self, e: Entry, c: ApiClient, a: dict[str, Any]) -> None:
        """Move one record to ``args["to"]`` (``replace`` an existing target); a target
        created elsewhere meanwhile is replaced (last writer wins)."""
        rid, sha = self._rid(e.node_key, e.store)
        e.record_id = rid
        if rid is None:
            return  # never reached the server (refused earlier): nothing to move
        replace = bool(a.get("replace"))
        try:
            res = await c.move_record(e.store, rid, a["to"], replace=replace,
                                      idempotency_key=e.key)
        except Conflict:
            log.warning("conflict: move target created elsewhere; replacing it",
                        extra={"store": e.store, "path": a["to"]})
            res = await c.move_record(e.store, rid, a["to"], replace=True,
                                      idempotency_key=e.key + "-lww")
        rec = res.records[0] if res.records else None
        e.record = rec
        self._learn(e.node_key, rec)
        tk = a.get("target_key")
        if tk and tk != e.node_key:
            self.keymap.pop(tk, None)
            self.journal.set_key(tk, None, None)

    async def _move_prefix(self, e: Entry, c: ApiClient, a: dict[str, Any]) -> None:
        """Move every record under ``args["from"]`` to ``args["to"]`` (a directory)."""
        res = await c.move_prefix(e.store, a["from"], a["to"], idempotency_key=e.key)
        e.moved = res.records

class _Answered:
    """The client for an entry whose first request was answered inside a batch: that one
    call (``op``'s method) returns, or raises, the batch's answer, once; every other call
    goes to the real client."""

    _METHODS = {"create": "create_record", "update": "update_record", "attrs": "set_attributes",
                "move": "move_record", "delete": "delete_record"}

    def __init__(self, client: ApiClient, op: str, outcome: Any) -> None:
        self._client = client
        self._method = self._METHODS[op]
        self._outcome: Any = outcome

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if name != self._method or self._outcome is _USED:
            return attr

        async def answered(*args: Any, **kwargs: Any) -> Any:
            outcome, self._outcome = self._outcome, _USED
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome

        return answered


_USED = object()


def merge_lines(base: bytes, theirs: bytes, ours: bytes) -> bytes | None:
    """The three-way merge of two changes of ``base`` line by line (``merge3.Merge3``,
    as ``bzr merge`` / ``diff3``): the merged content when the changes touch disjoint
    regions (or make the same change), None when they conflict (both change the same
    lines, or both insert at the same place). Pure; ``Committer._rebase`` runs it in a
    worker thread (the line diff of two large files takes a while)."""
    import merge3

    m = merge3.Merge3(base.splitlines(keepends=True), theirs.splitlines(keepends=True),
                      ours.splitlines(keepends=True))
    out: list[bytes] = []
    for group in m.merge_groups():
        if group[0] == "conflict":
            return None
        out.extend(group[1])
    return b"".join(out)


def _local_refusal(code: str, detail: str) -> ApiError:
    from ..errors import PermanentError
    return PermanentError(detail, status=422, code=code, detail=detail, problem={"code": code})
