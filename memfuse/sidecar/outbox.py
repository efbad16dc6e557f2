"""The outbox: every change the sidecar accepted, made durable on local disk, then committed to
the control plane in order (DESIGN.md §4).

Shape:

- ``Entry`` — one accepted change: ``put`` (content of a file), ``delete``, ``move`` (one record)
  or ``move_prefix`` (a directory). It carries an idempotency key (sent as ``Idempotency-Key``)
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

from ..client import (ApiClient, ApiError, Conflict, NotFound, PreconditionFailed, TransientError,
                      Unauthorized)
from ..models import Record, sha256_hex

log = logging.getLogger("memfuse.outbox")

PUT, DELETE, MOVE, MOVE_PREFIX = "put", "delete", "move", "move_prefix"

# problem `code` → errno for permanent refusals (docs/API.md table)
ERRNO_BY_CODE = {
    "invalid_path": errno.EINVAL,
    "path_too_long": errno.ENAMETOOLONG,
    "invalid_type": errno.EINVAL,
    "validation_error": errno.EINVAL,
    "invalid_content": errno.EILSEQ,
    "secret_detected": errno.EPERM,
    "record_too_large": errno.EFBIG,
    "store_full": errno.ENOSPC,
    "forbidden": errno.EACCES,
    "read_only": errno.EROFS,
    "store_not_found": errno.ENOENT,
    "store_not_attached": errno.ENOENT,
    "path_exists": errno.EEXIST,
    "idempotency_key_reused": errno.EINVAL,
}


def errno_for(err: ApiError) -> int:
    """Map a permanent API refusal to the errno the syscall returns (DESIGN §4 table)."""
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
    attempts: int = 0
    record: Record | None = None  # the record after the commit, when the op returns one
    record_id: str | None = None  # delete / move: the record the op acted on
    moved: list[Record] = field(default_factory=list)  # move_prefix: the records moved


class Journal:
    """Durable, ordered storage of entries and of the node-key map (SQLite, fsynced)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS entries (id INTEGER PRIMARY KEY, key TEXT NOT NULL,"
            " store TEXT NOT NULL, op TEXT NOT NULL, node_key TEXT, args TEXT NOT NULL,"
            " content BLOB, created REAL NOT NULL)")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS keymap (node_key TEXT PRIMARY KEY, record_id TEXT,"
            " sha256 TEXT)")
        self._pending: list[tuple[str, tuple]] = []
        self._waiters: list[trio.Event] = []
        self._wakeup = trio.Event()
        self._lock = trio.Lock()

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

    def next_id(self) -> int:
        row = self._db.execute("SELECT COALESCE(MAX(id), 0) FROM entries").fetchone()
        return int(row[0])

    # --- queued writes, applied in order by run() -------------------------------------------
    def add(self, e: Entry) -> None:
        self._pending.append(("INSERT INTO entries VALUES (?,?,?,?,?,?,?,?)",
                              (e.id, e.key, e.store, e.op, e.node_key, json.dumps(e.args),
                               e.content, e.created)))
        self._waiters.append(e.durable)
        self._wakeup.set()

    def remove(self, e: Entry) -> None:
        self._pending.append(("DELETE FROM entries WHERE id=?", (e.id,)))
        self._wakeup.set()

    def set_key(self, node_key: str, record_id: str | None, sha: str | None) -> None:
        self._pending.append(("INSERT OR REPLACE INTO keymap VALUES (?,?,?)",
                              (node_key, record_id, sha)))
        self._wakeup.set()

    def _apply(self, batch: list[tuple[str, tuple]]) -> None:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            for sql, params in batch:
                self._db.execute(sql, params)
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    async def flush_pending(self) -> None:
        """Write everything queued so far in one transaction (from a worker thread)."""
        async with self._lock:
            batch, self._pending = self._pending, []
            waiters, self._waiters = self._waiters, []
            if batch:
                await trio.to_thread.run_sync(self._apply, batch)
            for w in waiters:
                w.set()

    async def run(self) -> None:
        """Group-commit loop: wait for queued writes, apply them, repeat. Never returns."""
        while True:
            await self._wakeup.wait()
            self._wakeup = trio.Event()
            try:
                await self.flush_pending()
            except Exception:
                log.exception("outbox journal write failed; retrying in 1 s")
                await trio.sleep(1)
                self._wakeup.set()

    def close(self) -> None:
        if self._pending:
            self._apply(self._pending)
            self._pending = []
        self._db.close()


class Committer:
    """Commits entries to the control plane, one ordered queue per store.

    ``on_result(entry)`` is called on the trio thread after each entry finishes (committed or
    refused) so the filesystem can update the node's state; ``on_refusal(entry)`` logs it.
    """

    def __init__(self, client: ApiClient, journal: Journal,
                 keymap: dict[str, tuple[str | None, str | None]],
                 on_result: Callable[[Entry], None] | None = None,
                 backoff_max: float = 30.0, metrics=None) -> None:
        self.metrics = metrics
        self.client = client
        self.journal = journal
        self.keymap = keymap  # node_key -> (record_id, sha256)
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
        self.auth_waits = 0  # commit attempts deferred because the token was refused (401)
        self.idle = trio.Event()
        self.idle.set()
        self._store_idle: dict[str, trio.Event] = {}
        self._poke = trio.Event()

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
        ages = [time.time() - q[0].created for q in self.queues.values() if q]
        return max(ages, default=0.0)

    async def wait_idle(self) -> None:
        """Return once every queued entry is finished."""
        while self.depth():
            await self.idle.wait()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for store in list(self._wakeups):
                nursery.start_soon(self._worker, store)
            task_status.started()
            await trio.sleep_forever()

    # --- the per-store worker ----------------------------------------------------------------
    async def _worker(self, store: str) -> None:
        q = self.queues[store]
        while True:
            if not q:
                ev = self._store_idle.pop(store, None)
                if ev is not None:
                    ev.set()
                if not self.depth():
                    self.idle.set()
                ev = self._wakeups[store] = trio.Event()
                await ev.wait()
                continue
            e = q[0]
            await self._commit_with_retry(e)
            q.popleft()
            self.journal.remove(e)
            e.done.set()
            try:
                self.on_result(e)
            except Exception:
                log.exception("outbox result handler failed", extra={"entry": e.id})

    async def _commit_with_retry(self, e: Entry) -> None:
        while True:
            e.attempts += 1
            try:
                await self._apply(e)
                self.committed += 1
                if self.metrics is not None:
                    self.metrics.commits.labels(e.op).inc()
                return
            except TransientError as err:
                self.retries += 1
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
                self.refused += 1
                e.errno = errno_for(err)
                e.reason = err.detail or err.code or f"HTTP {err.status}"
                log.warning("commit refused", extra={
                    "entry": e.id, "op": e.op, "store": e.store, "path": e.args.get("path"),
                    "status": err.status, "code": err.code, "errno": errno.errorcode.get(e.errno)})
                return

    def _conflict(self, e: Entry, what: str) -> None:
        self.conflicts += 1
        if self.metrics is not None:
            self.metrics.conflicts.inc()
        try:
            self.on_conflict(e, what)
        except Exception:
            log.exception("conflict handler failed")

    def _rid(self, node_key: str | None) -> tuple[str | None, str | None]:
        if node_key is None:
            return None, None
        if node_key in self.keymap:
            return self.keymap[node_key]
        if node_key.startswith("r:"):
            return node_key[2:], None
        return None, None

    def _learn(self, node_key: str, rec: Record | None) -> None:
        val = (rec.id, rec.sha256) if rec is not None else (None, None)
        self.keymap[node_key] = val
        self.journal.set_key(node_key, *val)

    async def _apply(self, e: Entry) -> None:
        c = self.client
        a = e.args
        if e.op == PUT:
            text = (e.content or b"").decode("utf-8", errors="surrogateescape")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise _local_refusal("invalid_content", "content is not valid UTF-8") from None
            rid, sha = self._rid(e.node_key)
            want = sha256_hex(e.content or b"")
            typ = a.get("type")
            create_key = e.key
            if rid is not None:
                create_key = e.key + "-create"

                try:
                    rec = await c.update_record(e.store, rid, text, type=typ, if_match=sha,
                                                idempotency_key=e.key)
                except PreconditionFailed:
                    cur = await c.get_record(e.store, rid, content=False)
                    if cur.sha256 == want and (typ is None or cur.type == typ):
                        rec = cur
                    else:
                        self._conflict(e, "the record changed elsewhere; this write is now the "
                                          "latest version, the other one stays in history")
                        log.warning("conflict: record changed elsewhere; last writer wins, the "
                                    "other version stays in history",
                                    extra={"store": e.store, "path": a.get("path"), "record": rid})
                        rec = await c.update_record(e.store, rid, text, type=typ,
                                                    idempotency_key=e.key + "-lww")
                except NotFound:
                    rid = None  # deleted elsewhere: re-create it below
            if rid is None:
                try:
                    rec = await c.create_record(e.store, a["path"], text, type=typ,
                                                idempotency_key=create_key)
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
                                                idempotency_key=e.key + "-lww")
            e.record = rec
            self._learn(e.node_key, rec)
        elif e.op == DELETE:
            rid, _ = self._rid(e.node_key)
            e.record_id = rid
            if rid is not None:
                try:
                    await c.delete_record(e.store, rid, idempotency_key=e.key)
                except NotFound:
                    pass
            self._learn(e.node_key, None)
        elif e.op == MOVE:
            rid, sha = self._rid(e.node_key)
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
        elif e.op == MOVE_PREFIX:
            res = await c.move_prefix(e.store, a["from"], a["to"], idempotency_key=e.key)
            e.moved = res.records
        else:  # pragma: no cover - journal corruption
            raise _local_refusal("validation_error", f"unknown outbox op {e.op!r}")


def _local_refusal(code: str, detail: str) -> ApiError:
    from ..client import PermanentError
    return PermanentError(detail, status=422, code=code, detail=detail, problem={"code": code})
