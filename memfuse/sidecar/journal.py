"""The outbox journal: every change the sidecar accepted, made durable on local disk before
the committer (``committer.Committer``) sends it (docs/ARCHITECTURE.md, "The path of a write").

Shape:

- ``Entry`` — one accepted change: ``put`` (content of a file, with its mode and explicit
  mtime), ``attrs`` (mode and/or mtime of a clean file: ``PATCH``, no content), ``delete``,
  ``move`` (one record) or ``move_prefix`` (a directory). It carries an idempotency key (sent
  as ``Idempotency-Key``) and the paths *as they were when the change happened*. Because
  entries of a store commit strictly in order, replaying them reproduces the local sequence
  on the server. ``Entry.durable`` is set once its row is on disk: that is "accepted";
  ``Entry.done`` once it is committed or refused: that is "committed".
- ``Barrier`` — a point in the journal's queue, for writes that are not entries (local-only
  files) whose ``close(2)`` waits until they are on disk.
- ``Journal`` — the durable part: a SQLite file (``outbox.db`` in the cache directory,
  ``synchronous=FULL``) written by one task in batches (group commit) from a worker thread,
  so no handler waits on an fsync on the trio thread. Besides the entries it keeps the
  node-key map (``keymap``), the merge states of merged puts (``merges``), the rejected
  files, the local-only files and the last lines of ``errors.log``, all written in the same
  ordered batches.

Invariants: an entry leaves the journal only after it committed or was refused for good; a
committed entry may still be in the journal after a crash, and replaying it is harmless
because the server replays the stored response for a known idempotency key.
"""
from __future__ import annotations

import contextlib
import errno
import itertools
import json
import logging
import os
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import trio

from ..defs import sha256_hex
from ..wire import Record
from .. import timers
from .cachedir import CacheError, DiskReserve, cache_errno, cache_error, private_file
from .witness import WITNESS_NAME, Witness, move_aside

log = logging.getLogger("memfuse.outbox")

#: Seconds a ``close(2)`` waits for its entry to be on disk in this journal (its own bound,
#: independent of ``--commit-wait``, which bounds only the wait for the control plane). A
#: healthy disk writes a batch in milliseconds; a disk that refuses the write answers at once
#: with its errno (``ENOSPC``, ``EIO``); only a disk stalled this long makes close fail with
#: ``EIO``. Long enough that a loaded machine's fsync never trips it (ext4 commits every 5 s).
JOURNAL_WAIT = 30.0


class _Keys:
    """Where ``new_key`` draws from: a random 64-bit prefix per process (``os.urandom``,
    drawn again in a forked child) and a counter. INVARIANT: no two calls in any two
    processes give the same key but by a collision of two random prefixes (2**-64 per pair
    of processes)."""

    prefix = ""
    count: "itertools.count[int]" = itertools.count()

    @classmethod
    def reset(cls) -> None:
        cls.prefix, cls.count = os.urandom(8).hex(), itertools.count()


_Keys.reset()
os.register_at_fork(after_in_child=_Keys.reset)


def new_key() -> str:
    """A new unique key of 32 lowercase hex characters, the shape of ``uuid4().hex``: an
    entry's idempotency key (``Entry.key``) and a new file's outbox key (``n:<key>``).
    ~1 µs against ``uuid4``'s ~4.5 µs (a ``getrandom`` system call and a ``UUID`` object);
    two are made per file created and written (docs/ARCHITECTURE.md, "The path of a
    write"). Never raises."""
    return f"{_Keys.prefix}{next(_Keys.count):016x}"


#: the statement of a queued held insert not built yet (``Journal.add``, ``Journal._build``)
_UNBUILT = "-- unbuilt held insert"

#: the ops of an ``Entry``
PUT, DELETE, MOVE, MOVE_PREFIX, ATTRS = "put", "delete", "move", "move_prefix", "attrs"

#: the member of a journal row's ``args`` that makes it an append row: its ``content`` column
#: holds only the bytes appended to a base, ``{"h": the base's sha256, "n": its length in
#: bytes, "e": the id of the earlier entry of the same file whose content is that base when it
#: was still queued (else null)}``. Memory never sees it (``Journal.add`` writes it,
#: ``Journal.load`` / ``read_put`` take it out and rebuild the whole content)
APPEND_REF = "~append"


class _Waitable:
    """What ``Entry`` and ``Barrier`` share: waited on until accepted (``wait_accepted``)."""

    durable: trio.Event
    done: trio.Event
    changed: trio.Event
    journal_error: tuple[int, str] | None
    #: its waiter needs only what survives a kill -9, not a power cut (``Journal._apply``)
    light: bool

    def notify(self) -> None:
        """Wake whoever waits on ``changed`` (``wait_accepted``)."""
        ev, self.changed = self.changed, trio.Event()
        ev.set()

    async def wait_accepted(self, timeout: float) -> None:
        """Wait until the entry is accepted (its journal row is on disk) or already finished
        (committed or refused: the control plane holds the outcome), at most ``timeout`` s.

        Raises ``CacheError`` with the journal's errno (``ENOSPC`` when the cache disk is full,
        ``EIO`` for other write failures) when the journal tried to write the entry and failed,
        or ``EIO`` when it did not get to it within ``timeout``. The entry stays queued either
        way: the journal keeps retrying it and the committer may still commit it.
        """
        if self.durable.is_set() or self.done.is_set():
            return
        # bounded without a cancel scope (one per close was ~10 us): the keeper wakes this
        # wait at its deadline (``timers``), and every wake-up looks at the clock
        deadline = trio.current_time() + timeout
        timer = timers.call_at(deadline, self.notify)
        try:
            while not (self.durable.is_set() or self.done.is_set()):
                if self.journal_error is not None:
                    raise CacheError(*self.journal_error)
                if trio.current_time() >= deadline:
                    raise CacheError(errno.EIO, f"the outbox journal did not write within {timeout:g} s")
                await self.changed.wait()
        finally:
            timer.cancel()


@dataclass(eq=False)
class Entry(_Waitable):
    """One accepted change. ``args`` holds the op's paths (store-relative) and flags; ``content``
    the bytes of a ``put``. ``errno`` is 0 once committed, the refusal's errno otherwise."""

    id: int
    store: str
    op: str
    node_key: str | None
    args: dict[str, Any]
    content: bytes | None = None
    key: str = field(default_factory=new_key)
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
    #: a committed delete: the change-feed seq of its ``deleted`` version (the answer's
    #: ``Memfuse-Seq``), None when not told (already deleted, an older control plane)
    seq: int | None = None
    moved: list[Record] = field(default_factory=list)  # move_prefix: the records moved
    #: a ``move`` / ``move_prefix`` replayed at start that the tree could not show
    #: (``OutboxOverlay._overlay_move``: its target taken): its answer is applied to the
    #: tree (``Filesystem._show_unshown_move``), as the feed leaves our own changes out
    unshown: bool = False
    #: earlier ``put``s of the same file this one supersedes (``Committer._coalesce``): they
    #: finish with it, with its result
    absorbed: list["Entry"] = field(default_factory=list)
    #: a request carrying this entry may have reached the control plane (sent once, or
    #: replayed after a crash as the first entry of its file): never coalesced away, so a
    #: write that did apply is answered by its idempotency key instead of being merged twice
    sent: bool = False
    #: a ``put`` loaded from the journal without its content (``Journal.load``: a later
    #: queued put of the same file will absorb it, so its bytes are never sent); the
    #: committer reads them (``Journal.read_content``) should it send it after all
    deferred: bool = False
    #: why the journal could not write this entry yet: ``(errno, reason)``, None once durable
    journal_error: tuple[int, str] | None = None
    #: set (and replaced) whenever the entry's state changes: a journal attempt or its end
    changed: trio.Event = field(default_factory=trio.Event)
    #: the sha256 of ``content`` when the writer computed it already (``Filesystem.commit``),
    #: else None (then computed where needed); memory only
    sha: str | None = None
    #: a ``put`` whose content is the content with sha256 ``append_base[0]`` plus a suffix
    #: (an append: ``echo >> f``), its first ``append_base[1]`` bytes that content, as the
    #: writer checked at commit (``Filesystem._checked_prefix``): the committer cuts the
    #: suffix without reading the base again (``ConflictResolver.append_suffix``); None when
    #: not known. Memory only: an entry loaded from the journal checks the base as before
    append_base: tuple[str, int] | None = None
    #: a ``put`` loaded from the journal as an append (``APPEND_REF``) whose base content
    #: neither the journal nor the blob cache holds any more: (the sha256 of that base, the
    #: bytes appended to it), ``content`` None. The committer sends it as an append on that
    #: version (``ConflictResolver.put``), which the control plane holds: it was committed
    suffix_only: tuple[str, bytes] | None = None
    #: withdrawn by its close (``Committer.withdraw``: the journal could not take it and the
    #: control plane did not answer within the close's wait): finished with the close's
    #: errno, never sent (the worker and a batch holding it check this before every attempt)
    withdrawn: bool = False
    #: a request carrying it is being sent now (its outcome unknown until the attempt ends)
    in_flight: bool = False
    #: a ``put``: what the file showed before it (``Filesystem.commit``), so that a withdrawn
    #: write can be undone: a ``core.Before`` (its ``sha`` first); memory only.
    #: INVARIANT: None once the journal wrote the entry (``durable``) or the committer
    #: finished it (``settle``): it can no longer be withdrawn then, and a ``Before`` holds
    #: the previous put (``Before.put``), whose own ``before`` held the one before it: kept,
    #: every version of a file written again and again stayed in memory (issue 25 item 1)
    before: Any = None
    #: no system call waits for more than a kill -9's durability of this entry (an unlink,
    #: a rename, attributes: ``Journal.add(light=True)``): a batch whose waiters are all
    #: light is written without its fsync (``Journal._apply``); memory only
    light: bool = False

    def content_sha(self) -> str | None:
        """The sha256 hex of ``content`` (``sha`` when the writer gave it; hashed once and
        kept otherwise), None without content."""
        if self.content is None:
            return None
        if self.sha is None:
            self.sha = sha256_hex(self.content)
        return self.sha

    def settle(self) -> None:
        """The entry can no longer be withdrawn (``Committer.withdraw``: only an entry
        neither on disk nor finished is): what the file showed before it (``before``, the
        previous put and its content) is let go. Called by the journal when the entry is on
        disk and by the committer when it finishes it (not by ``finish``: a withdrawn
        entry's close undoes the write from ``before`` after finishing it)."""
        self.before = None

    def finished_with(self) -> None:
        """The committer finished the entry and its listener applied the result: its
        content is let go (``content`` None; ``sha`` stays). Nothing reads a finished put's
        content after that: the blob cache holds it (or the node's buffer, when the cache
        disk refused it; a withdrawal's undo reads those, ``Filesystem._prior_content``).
        Kept, ``Node.last_put`` held the last content of every file written."""
        if self.content is not None:
            self.content_sha()  # (the sha256 stays known)
            self.content = None

    def finish(self) -> None:
        """The entry is committed or refused for good (``done``); whoever waits on
        ``changed`` is woken. ``changed`` stays set from then on (not replaced, as
        ``notify`` does): every wait on it looks at ``done`` first."""
        self.done.set()
        self.changed.set()


#: links of an append chain ``Journal.read_put`` follows at most (a longer one is sent as an
#: append on the base it reached: bounded work per entry at a start)
_CHAIN_MAX = 100_000


def _append_ref(args: str) -> tuple[str, int, int | None] | None:
    """(base sha256, base length, base entry id or None) of a journal row's ``args`` JSON
    when it is an append row (``APPEND_REF``), else None. A damaged reference (not of that
    shape) reads as a base of sha256 "" (``Entry.suffix_only``: refused, never sent as a
    whole content it is not)."""
    try:
        ref = json.loads(args).get(APPEND_REF)
    except (ValueError, AttributeError):
        return None
    if ref is None:
        return None
    if not isinstance(ref, dict):
        return ("", 0, None)
    h, n, i = ref.get("h"), ref.get("n"), ref.get("e")
    if not isinstance(h, str) or not isinstance(n, int) or not (i is None or isinstance(i, int)):
        return ("", 0, None)
    return (h, n, i)


def superseded(entries: list[Entry]) -> set[int]:
    """The ids of the ``put``s among ``entries`` (a previous process's outbox, in order)
    that ``Committer._coalesce`` absorbs once they are replayed: followed later in their
    store by another put of the same node key with nothing between that touches that key
    (a move, a delete, attributes, a move onto it) or moves a directory, and not the first
    entry of their key (``Committer.replay`` marks that one ``sent``: it may have reached
    the control plane). The same rule as ``_coalesce``'s, so their content need not be
    read; should one be sent after all, the committer reads it then (``Entry.deferred``)."""
    first: set[tuple[str, str | None]] = set()
    sent: set[int] = set()
    for e in entries:
        if (e.store, e.node_key) not in first:
            first.add((e.store, e.node_key))
            sent.add(e.id)
    later: dict[str, set[str]] = {}  # store -> node keys with a later put, nothing between
    out: set[int] = set()
    for e in reversed(entries):
        lat = later.setdefault(e.store, set())
        if e.op == MOVE_PREFIX or e.node_key is None:
            lat.clear()
            continue
        if e.op == PUT and e.node_key in lat and e.id not in sent:
            out.add(e.id)
            continue
        lat.discard(e.node_key)
        tk = e.args.get("target_key")
        if tk:
            lat.discard(tk)
        if e.op == PUT:
            lat.add(e.node_key)
    return out


class Barrier(_Waitable):
    """A point in the journal's queue: ``durable`` (also ``done``) is set once everything
    queued before it is on disk. Waited on like an ``Entry`` (``wait_accepted``): a failed
    write sets ``journal_error``. Used by writes that are not outbox entries (local-only
    files: ``localfiles.LocalFiles``) so that their ``close(2)`` returns once they are on
    disk."""

    id = -1
    errno = 0
    reason = ""

    def __init__(self, light: bool = False) -> None:
        #: its waiter needs only what survives a kill -9 (``Journal.barrier(light=True)``)
        self.light = light
        self.durable = trio.Event()
        self.done = self.durable  # nothing to commit beyond the disk
        self.changed = trio.Event()
        self.journal_error: tuple[int, str] | None = None


class Journal:
    """Durable, ordered storage of entries and of the node-key map (SQLite, fsynced).

    Writes are queued (``add`` / ``remove`` / ``set_key``, synchronous, on the trio thread) and
    applied in order by ``run`` in one transaction per batch (group commit) from a worker
    thread. A batch that fails to write (full disk, I/O error) stays queued, in order and with
    its waiters, in front of anything queued since; ``run`` retries it with backoff, so the
    journal resumes by itself once space returns. Every waiter of a failed batch is told why
    (``Entry.journal_error``), so ``close(2)`` can answer ``ENOSPC`` instead of waiting.
    Writes nobody waits for (a finished entry's delete, a key map row: ``_lazy``) do not
    start a transaction of their own: they ride with the next one, at most ``LAZY_DELAY`` s
    later, so a steady stream of closes costs one transaction (one fsync) per batch of
    closes, not one more per commit (bench/README.md, "The close path").

    Size: committed rows are deleted, an insert still queued when its entry finishes is never
    written at all, and the write-ahead log is checkpointed and truncated whenever the queue
    runs empty (at most every ``CHECKPOINT_EVERY`` s) and after a failed write, so the file
    holds about the bytes of the entries not yet committed (docs/SEMANTICS.md, cache size).
    On a disk 100 % full that checkpoint needs the ``reserve`` (``DiskReserve``) to give the
    log's space back; the reserve is made again after an idle checkpoint when space allows.
    """

    CHECKPOINT_EVERY = 2.0  # s between idle checkpoints
    #: s at most between a queued write that woke nobody (``_lazy``: a finished entry's
    #: delete, a key map row) and its transaction, when no ``close`` comes to carry it
    LAZY_DELAY = 0.25
    RETRY_MIN, RETRY_MAX = 0.1, 2.0  # s: backoff of a failed batch
    #: s an entry's insert may wait for its commit when ``add`` is asked to hold it
    #: (``hold=True``: the control plane answers and the close waits for it): an entry
    #: the control plane acknowledges within this time is never written here (its close
    #: returns on the acknowledgement; the journal row would be moot), one still unanswered
    #: is written then (its close returns only after that, or after the acknowledgement).
    #: Longer than a healthy commit (~5-15 ms on loopback; ~100 ms on a loaded machine),
    #: short beside ``--commit-wait``
    #: (docs/SEMANTICS.md, "Writes and close": the crash windows)
    HOLD = 0.2

    def __init__(self, path: Path, metrics: Any = None,
                 before_batch: Callable[[], None] | None = None,
                 reserve: DiskReserve | None = None,
                 on_full: Callable[[], None] | None = None) -> None:
        """Open (create) the journal at ``path``. A file that is damaged or not a database
        is moved aside (kept, ``moved_aside``) and a new one made; one the disk refuses
        (full: ``SQLITE_FULL``, a ``-shm`` that cannot grow; an I/O error) or that is locked
        is left exactly as it is, never moved aside (it may hold accepted writes not sent
        yet): ``CacheError`` (``ENOSPC`` for a full disk, else ``EIO`` / the OS's errno).
        Raises ``OSError`` when the file cannot be made (a symlink in its place)."""
        self.path = path
        self.metrics = metrics
        #: the cache disk's reserve, released for a checkpoint a full disk refused (``_wal_truncate``)
        self.reserve = reserve
        #: called on the trio thread before a batch holding an entry's insert is written
        #: (the sidecar's: ``BlobCache.write_behind``, so the content of every write the
        #: journal accepts is in the blob cache file first, where ``recover`` finds it
        #: should the journal be lost); must not raise
        self.before_batch = before_batch
        #: called on the trio thread after a batch failed for a full disk (the sidecar's:
        #: ``BlobCache.checkpoint``, which gives its write-ahead log's space back when that
        #: costs none, so the space goes to the accepted writes: attack 14 F1); must not raise
        self.on_full = on_full
        #: where an unreadable journal was moved aside at this start (kept, named in the
        #: log), else None
        self.moved_aside: Path | None = None
        #: the witness (``accepted.log`` beside the journal): what the journal should hold,
        #: kept apart from it (``Witness``)
        self.witness = Witness(path.with_name(WITNESS_NAME))
        try:
            self._open(path)
        except sqlite3.DatabaseError as exc:  # corrupt, or not a database: keep it, start anew
            with contextlib.suppress(Exception):
                self._db.close()
            if isinstance(exc, sqlite3.OperationalError):
                # a full disk (SQLITE_FULL, a -shm that cannot grow), an I/O error, a lock:
                # not damage, and the journal may hold accepted writes not sent yet: it
                # stays as it is, and the caller decides (the start makes room, or says why)
                self.witness.close()
                raise cache_error(exc, "opening the outbox journal") from exc
            self.moved_aside = move_aside(path)
            log.error("the outbox journal is unreadable; moved aside (kept for inspection) and "
                      "started anew; what it held is recovered from the witness and the blob cache",
                      extra={"path": str(path), "moved_to": str(self.moved_aside),
                             "error": str(exc)[:200]})
            try:
                self._open(path)
            except sqlite3.Error as again:  # a new, empty journal the disk refuses
                with contextlib.suppress(Exception):
                    self._db.close()
                self.witness.close()
                raise cache_error(again, "opening the outbox journal") from again

    def _open(self, path: Path) -> None:
        """Open (create) the journal's SQLite file and its tables; ``sqlite3.DatabaseError``
        when it is corrupt or not a database (``quick_check`` included), its subclass
        ``sqlite3.OperationalError`` when the disk refused (full, I/O error) or the file is
        locked."""
        private_file(path)  # 0600; SQLite gives its -wal / -shm files the same mode
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        check = self._db.execute("PRAGMA quick_check").fetchone()
        if not check or check[0] != "ok":
            raise sqlite3.DatabaseError(f"quick_check: {check[0] if check else 'no answer'}")
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
        # that put carried, base of the next put (``conflict.ConflictResolver.merged``), kept across a crash
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS merges (node_key TEXT PRIMARY KEY, local_sha TEXT NOT NULL,"
            " local BLOB NOT NULL, merged_sha TEXT NOT NULL)")
        self._init_queue()

    def _init_queue(self) -> None:
        self._witness_top = 0  # the highest entry id the witness names (``recover``)
        # queued writes: [sql, params, entry id of an insert (else None)]
        self._pending: list[list[Any]] = []
        self._waiters: list[Entry | Barrier] = []
        self._unwritten: dict[int, list[Any]] = {}  # entry id -> its queued insert
        self._wakeup = trio.Event()
        #: when the oldest queued write that woke nobody (``_lazy``) was queued, None when
        #: every queued write woke ``run``
        self._lazy_since: float | None = None
        self._urgent = False  # a write queued since the last batch wants it written now
        #: entry id -> when (``time.monotonic()``) its held insert (``add(hold=True)``) is
        #: due, for the inserts queued and not written; ``run`` writes no later than the
        #: earliest
        self._held: dict[int, float] = {}
        #: lazy writes are queued behind a held insert not due yet (a batch written for
        #: lazy writes stops at it): they go when it is due, at most ``LAZY_DELAY + HOLD``
        #: after the oldest of them
        self._lazy_behind = False
        #: INVARIANT: while ``run`` sleeps until a due time (its timed wait for held
        #: inserts and lazy writes), that time (``time.monotonic()``); None whenever it
        #: does anything else (waits for a first write, writes a batch). A non-urgent write
        #: due no earlier than it need not wake ``run``: with one writer every close adds a
        #: held insert, which would otherwise wake it once per file only to sleep again
        self._sleeping_until: float | None = None
        self.wakeups = 0  # times ``run`` woke (tests: held inserts do not wake it per file)
        self.held_skipped = 0  # held inserts never written: their entry finished first
        #: writes queued that want a batch now (``_wake``: an entry not held, a kept row, a
        #: barrier): a handler that changed the tree without awaiting compares it across its
        #: call to learn whether it queued one (``fuse_ops._guard_durable``)
        self.woken = 0
        #: the last transaction was light (``_apply(light=True)``: committed, not fsynced):
        #: a waiter that needs more, with nothing to write, fsyncs the log (``_sync_log``)
        self._unsynced = False
        #: INVARIANT: the number of writes in the batch ``flush_pending`` is writing now
        #: (taken out of ``_pending``, not yet committed), 0 whenever none is being written;
        #: ``depth`` counts them, so "nothing queued" means "everything on disk"
        self._writing = 0
        self._lock = trio.Lock()
        self.error: CacheError | None = None  # the last write failure, None once one succeeds
        self.failures = 0  # failed batch writes since start
        self._last_checkpoint = 0.0
        #: node key -> (id, content sha256) of its last put added and not finished: the base
        #: an append row names (``add``)
        self._last_put: dict[str, tuple[int, str | None]] = {}

    def load(self) -> tuple[list[Entry], dict[str, tuple[str | None, str | None]]]:
        """Read what a previous process left: entries in order and the key map.

        The content of a ``put`` that a later queued put of the same file supersedes
        (``superseded``: the committer's coalescing will absorb it, so it is never sent) is
        not read: the entry comes back ``deferred`` (content None) and stays in the journal
        as it is. A backlog of 10,000 appends to one file holds 10,000 copies of a growing
        file (~370 MB at 75 KB); only the last is read (bench/README.md, "A backlog of one
        file")."""
        entries = []
        appends: set[int] = set()  # ids of append rows (``APPEND_REF``)
        for row in self._db.execute(
                "SELECT id, key, store, op, node_key, args, created FROM entries ORDER BY id"):
            args = json.loads(row[5])
            if isinstance(args, dict) and args.pop(APPEND_REF, None) is not None:
                appends.add(row[0])
            e = Entry(id=row[0], key=row[1], store=row[2], op=row[3], node_key=row[4],
                      args=args, created=row[6])
            e.durable.set()
            entries.append(e)
            if e.op == PUT and e.node_key is not None:
                self._last_put[e.node_key] = (e.id, None)  # its sha: unknown (not read)
        skip = superseded(entries)
        want = [e for e in entries if e.op == PUT and e.id not in skip]
        contents: dict[int, bytes] = {}
        for i in range(0, len(want), 500):  # SQLite's bound on host parameters
            ids = [e.id for e in want[i:i + 500]]
            contents.update(self._db.execute(
                f"SELECT id, content FROM entries WHERE id IN ({','.join('?' * len(ids))})", ids))
        for e in entries:
            if e.op != PUT:
                continue
            if e.id in skip:
                e.deferred = True
            elif e.id in appends:
                e.content, e.suffix_only = self.read_put(e.id)
            else:
                e.content = contents.get(e.id)
        keymap = {r[0]: (r[1], r[2]) for r in self._db.execute(
            "SELECT node_key, record_id, sha256 FROM keymap")}
        return entries, keymap

    def read_content(self, entry_id: int) -> bytes | None:
        """The whole content of entry ``entry_id`` (a ``deferred`` put's: ``load``), None
        when the journal holds none or cannot rebuild it (``read_put``). Raises
        ``sqlite3.Error``."""
        return self.read_put(entry_id)[0]

    def read_put(self, entry_id: int) -> tuple[bytes | None, tuple[str, bytes] | None]:
        """(the whole content of put ``entry_id``, None) as the journal holds it; for an
        append row (``APPEND_REF``) its base is rebuilt from the earlier rows it names, back
        to a whole one, and checked against the base's sha256 and length. When the base is
        not all here (its row finished and was deleted: the control plane had it; or the
        chain does not check out): (None, (the sha256 of the oldest base reached, the bytes
        appended to it since)), for ``resolve_bases`` / the committer (``Entry.suffix_only``).
        (None, None) when there is no such row or it holds no content. Raises
        ``sqlite3.Error``."""
        row = self._db.execute("SELECT content, args FROM entries WHERE id=?", (entry_id,)).fetchone()
        if row is None or row[0] is None:
            return None, None
        ref = _append_ref(row[1])
        if ref is None:
            return bytes(row[0]), None
        top, parts = ref, [bytes(row[0])]
        while ref is not None:
            prev = None
            if ref[2] is not None and len(parts) <= _CHAIN_MAX:
                prev = self._db.execute("SELECT content, args FROM entries WHERE id=?",
                                        (ref[2],)).fetchone()
            if prev is None or prev[0] is None:
                return None, (ref[0], b"".join(reversed(parts)))
            parts.append(bytes(prev[0]))
            ref = _append_ref(prev[1])
        whole = b"".join(reversed(parts))
        base_len = len(whole) - len(parts[0])
        if base_len != top[1] or sha256_hex(whole[:base_len]) != top[0]:
            log.warning("an append in the outbox journal does not match the entries it extends; "
                        "it is sent as an append on its base version",
                        extra={"entry": entry_id})
            return None, (top[0], parts[0])
        return whole, None

    @staticmethod
    def resolve_bases(entries: list[Entry], content_of: Callable[[str], bytes | None]) -> int:
        """Give each put of ``entries`` loaded as ``suffix_only`` its whole content when
        ``content_of(sha256)`` (the blob cache) still holds its base (checked against the
        sha256). Returns how many were rebuilt."""
        done = 0
        for e in entries:
            if e.suffix_only is None or not e.suffix_only[0]:
                continue
            base = content_of(e.suffix_only[0])
            if base is not None and sha256_hex(base) == e.suffix_only[0]:
                e.content, e.suffix_only = base + e.suffix_only[1], None
                done += 1
        return done

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
        self._wake()

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
        self._wake()

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
        self._wake()

    def move_local(self, node_key: str, path: str, mode: int, mtime_ns: int) -> None:
        """Queue a new path / mode / mtime for a kept local-only file (content unchanged)."""
        self._pending.append(["UPDATE local_files SET path=?, mode=?, mtime_ns=? WHERE node_key=?",
                              (path, mode, mtime_ns, node_key), None])
        self._wake()

    def delete_local(self, node_key: str) -> None:
        """Queue the deletion of a kept local-only file (unlinked, or renamed onto a normal
        name and now a record)."""
        self._pending.append(["DELETE FROM local_files WHERE node_key=?", (node_key,), None])
        self._wake()

    def barrier(self, *, light: bool = False) -> Barrier:
        """A ``Barrier`` after everything queued so far (set once it is all on disk).
        ``light``: its waiter needs only what survives a ``kill -9`` of this process (a
        namespace change's system call: ``Filesystem.changes_durable``), not a power cut:
        a batch whose waiters are all light is committed without an fsync (``_apply``)."""
        b = Barrier(light)
        self._waiters.append(b)
        self._wake()
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
        self._wake()

    def next_id(self) -> int:
        """The highest entry id on disk or in the witness (0 for none): entry ids continue
        from it."""
        row = self._db.execute("SELECT COALESCE(MAX(id), 0) FROM entries").fetchone()
        return max(int(row[0]), self._witness_top)

    def recover(self, content_of: Callable[[str], bytes | None]
                ) -> tuple[list[Entry], dict[str, tuple[Any, Any]], list[dict[str, Any]]]:
        """What the journal lost, from the witness (call after ``load``, before anything is
        queued): (the entries recovered: accepted, unfinished, missing from the journal, and
        whose content ``content_of(sha256)`` still gives (the blob cache; ops without content
        always), queued again here with their ids and idempotency keys, so one that did
        commit before the loss is not applied twice; the key map the witness saw; the
        witness lines of the accepted writes that cannot be recovered: their content is gone,
        or their witness line is damaged, ``Witness.unfinished``'s placeholders).
        The lost ones are marked finished in the witness, so they are named once."""
        present = {int(r[0]) for r in self._db.execute("SELECT id FROM entries")}
        lost, keys, self._witness_top = self.witness.unfinished(present)
        back: list[Entry] = []
        gone: list[dict[str, Any]] = []
        for x in lost:
            if x.get("damaged"):  # its witness line is cut: what it wrote cannot be known
                gone.append(x)
                continue
            content = None
            if x.get("h"):
                content = content_of(x["h"])
                if content is None or sha256_hex(content) != x["h"]:
                    gone.append(x)
                    continue
            e = Entry(id=int(x["i"]), key=x["k"], store=x["s"], op=x["o"], node_key=x.get("n"),
                      args=x.get("a") or {}, content=content, created=float(x.get("t") or time.time()))
            if e.node_key and x.get("r") and e.node_key not in keys:
                keys[e.node_key] = (x.get("r"), x.get("b"))
            self.add(e, (x.get("r"), x.get("b")))
            back.append(e)
        if gone:
            self.witness.append([{"d": x["i"]} for x in gone])
        return back, keys, gone

    async def withdraw(self, e: Entry, timeout: float) -> bool:
        """Take back the insert of ``e``, not on disk yet (a write its close gave up on:
        ``Filesystem.flush``): True when it is out of the queue (never written), False when
        it is on disk already, or a batch holding it is still being written after
        ``timeout`` s (its outcome decides). Waits for the batch being written (the lock) so
        a failed batch cannot put the insert back after this."""
        with trio.move_on_after(timeout):
            async with self._lock:
                if e.durable.is_set() or e.id not in self._unwritten:
                    return False
                self.remove(e)  # never written: out of the queue
                e.journal_error = None
                return True
        return False

    def depth(self) -> int:
        """Writes not yet on disk: those queued and those of the batch being written (a
        batch leaves the queue when its transaction starts, in a worker thread, and is on
        disk only once it commits: a ``kill -9`` meanwhile loses it, so 0 means every
        write accepted so far is on disk; ``status.json``'s ``cache.journal_queued``)."""
        return len(self._pending) + self._writing

    # --- queued writes, applied in order by run() -------------------------------------------
    def add(self, e: Entry, ident: tuple[str | None, str | None] | None = None, *,
            hold: bool = False, light: bool = False) -> None:
        """Queue the insert of entry ``e`` (written by ``run`` in the next batch; ``e.durable``
        is set once it is on disk, its witness line too). ``ident``: the (record id, base
        sha256) its node key maps to now, noted in the witness. ``hold``: the insert does not
        start a transaction for ``HOLD`` s (it goes with any batch written meanwhile); if
        ``e`` finishes first (``remove``) it is never written. ``light`` (``Entry.light``):
        no system call waits for more than a kill -9's durability of it (not held then).
        Never blocks, never raises."""
        e.light = light
        ref = None
        if e.op == PUT and e.content is not None and e.node_key is not None:
            ab = e.append_base
            if ab is not None and 0 < ab[1] <= len(e.content):
                # an append: the row holds what it adds (one fsync of the suffix, not of the
                # file); the base is the earlier queued put of the file, or the version the
                # file showed (the blob cache; the control plane, which committed it)
                last = self._last_put.get(e.node_key)
                ref = {"h": ab[0], "n": ab[1], "e": last[0] if last is not None and last[1] == ab[0] else None}
            self._last_put[e.node_key] = (e.id, e.content_sha())
        held = hold and self.HOLD > 0
        # a held insert is built (its row, its JSON, its witness line) only when a batch
        # writes it (``_build``): one its entry's commit makes moot costs nothing more
        op: list[Any] = [_UNBUILT, (e, ident, ref), e.id] if held else self._insert(e, ident, ref)
        self._pending.append(op)
        self._unwritten[e.id] = op
        self._waiters.append(e)
        if held:
            due = self._held[e.id] = time.monotonic() + self.HOLD
            self._wake_by(due)  # not urgent: ``run`` waits until it is due, or for company
        else:
            self._wake()

    @staticmethod
    def _insert(e: Entry, ident: tuple[str | None, str | None] | None,
                ref: dict[str, Any] | None) -> list[Any]:
        """The queued write of entry ``e``'s row: [statement, parameters, entry id, witness
        line]; ``ref``: the append reference of an append row (``APPEND_REF``), else None."""
        line = {"i": e.id, "k": e.key, "s": e.store, "o": e.op, "n": e.node_key, "a": e.args,
                "t": e.created, "h": e.content_sha(),
                "r": ident[0] if ident else None, "b": ident[1] if ident else None}
        content = e.content
        if ref is not None:
            assert content is not None and e.append_base is not None
            content, args = content[e.append_base[1]:], json.dumps({**e.args, APPEND_REF: ref})
        else:
            args = json.dumps(e.args)
        return ["INSERT INTO entries VALUES (?,?,?,?,?,?,?,?)",
                (e.id, e.key, e.store, e.op, e.node_key, args, content, e.created), e.id, line]

    @classmethod
    def _build(cls, batch: list[list[Any]]) -> None:
        """Build, in place, the held inserts of ``batch`` (``add(hold=True)``) not built yet."""
        for op in batch:
            if op[0] is _UNBUILT:
                op[:] = cls._insert(*op[1])

    def remove(self, e: Entry) -> None:
        """The entry finished: delete its row (or never write it, when still queued). The
        delete is lazy (``_lazy``): it goes with the next batch."""
        if e.node_key is not None and self._last_put.get(e.node_key, (None,))[0] == e.id:
            del self._last_put[e.node_key]
        op = self._unwritten.pop(e.id, None)
        if op is not None:
            self._pending.remove(op)
            if e in self._waiters:
                self._waiters.remove(e)
            if self._held.pop(e.id, None) is not None:
                self.held_skipped += 1
            return
        self._pending.append(["DELETE FROM entries WHERE id=?", (e.id,), None, {"d": e.id}])
        self._lazy()

    def set_key(self, node_key: str, record_id: str | None, sha: str | None) -> None:
        """Queue the key map row ``node_key`` → (record id, sha256) (None, None: forgotten)."""
        self._pending.append(["INSERT OR REPLACE INTO keymap VALUES (?,?,?)",
                              (node_key, record_id, sha), None,
                              {"m": node_key, "r": record_id, "h": sha}])
        self._lazy()

    def _lazy(self) -> None:
        """A queued write nobody waits for (the end of a finished entry, a key map row): it
        does not wake ``run`` by itself but goes with the next batch that has a waiter (the
        next ``close``), or after at most ``LAZY_DELAY`` s. So one file created, written
        and closed costs one journal transaction (one fsync), not two: its insert carries
        the previous file's delete. A crash before it is written loses nothing: the entry
        stays in the journal, committed, and its replay is answered by its idempotency key
        (the key map row is learnt again from that answer)."""
        if self._lazy_since is None:
            self._lazy_since = time.monotonic()
            # not urgent: ``run`` then waits up to LAZY_DELAY for company
            self._wake_by(self._lazy_since + self.LAZY_DELAY)

    def _wake_by(self, due: float) -> None:
        """A queued write that must be written by ``due`` (``time.monotonic()``) at the
        latest: wake ``run`` unless it sleeps until no later than that already
        (``_sleeping_until``); it then finds this write when it wakes."""
        until = self._sleeping_until
        if until is None or due < until:
            self._wakeup.set()

    def _wake(self) -> None:
        """A queued write someone waits for (or a retry): ``run`` writes the batch now."""
        self._urgent = True
        self.woken += 1
        self._wakeup.set()

    def hurry(self) -> None:
        """Write held inserts (``add(hold=True)``) now: their closes will not get an
        acknowledgement soon (the committer learnt the control plane is unreachable)."""
        if self._held:
            self._wake()

    def _due(self) -> float | None:
        """When (``time.monotonic()``) the queued writes must be written at the latest
        without an urgent one: the earliest held insert's due time, or ``LAZY_DELAY`` after
        the oldest lazy write; None when nothing non-urgent is queued."""
        due = min(self._held.values(), default=None)
        if self._lazy_since is not None:
            lazy = self._lazy_since + self.LAZY_DELAY
            if self._lazy_behind:
                lazy += self.HOLD
            due = lazy if due is None else min(due, lazy)
        return due

    def _apply(self, batch: list[list[Any]], light: bool = False) -> None:
        """Write ``batch`` in one transaction (worker thread). ``light``: its waiters need
        only what survives a kill -9 (every one ``Entry.light`` / a light ``Barrier``):
        committed with ``synchronous=NORMAL``, its write-ahead log frames written, not
        fsynced; the next fsynced transaction (any other batch) or checkpoint makes them
        durable across a power cut too, in order (one log). Saves the fsync of each unlink
        of a ``rm -rf`` (ns27)."""
        if light:
            self._db.execute("PRAGMA synchronous=NORMAL")
        try:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for sql, params, *_ in batch:
                    self._db.execute(sql, params)
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
        finally:
            if light:
                self._db.execute("PRAGMA synchronous=FULL")
        # after the commit, before the waiters learn it is accepted: a crash in between
        # leaves the entry in the journal (the witness is read only for what it lacks)
        lines = [op[3] for op in batch if len(op) > 3]
        if lines:
            try:
                self.witness.append(lines)
            except OSError as exc:
                raise sqlite3.OperationalError(f"writing the witness: {exc.strerror or exc}") from exc

    def _sync_log(self) -> None:
        """fsync the write-ahead log (worker thread): the frames of light batches
        (``_apply(light=True)``) become durable across a power cut. Raises ``OSError``."""
        try:
            fd = os.open(f"{self.path}-wal", os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return  # no log: checkpointed and removed, nothing unsynced in it
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _checkpoint(self, drain: bool = False) -> None:
        """Copy the write-ahead log into the database, truncate it, give free pages back;
        empty the witness when no entry is left (it then has nothing to witness). The log is
        truncated first: on a full cache disk the vacuum (which writes to the log) fails, and
        the truncated log is the space a drained journal gives back (docs/SEMANTICS.md, "The
        sidecar's own disk"). ``drain``: the queued writes only give space back
        (``_draining``), so the reserve may be spent (``_wal_truncate``). Raises
        ``sqlite3.Error``."""
        self._wal_truncate(drain)
        try:
            self._db.execute("PRAGMA incremental_vacuum").fetchall()  # one page per step
            self._wal_truncate(drain)
        finally:
            if self.witness.size() and not self._db.execute("SELECT 1 FROM entries LIMIT 1").fetchone():
                with contextlib.suppress(OSError):
                    self.witness.clear()

    def _wal_truncate(self, drain: bool) -> None:
        """``wal_checkpoint(TRUNCATE)``; when the full disk refuses it (the database cannot
        grow to take the log's pages), again with the ``reserve`` released
        (``DiskReserve.spent``), but only once the outbox drained: ``drain`` (the queued
        writes delete committed rows and add none), or no entry left in the journal. Spent
        while accepted writes wait, the space would go to more of them and the drain would
        find the disk full again. Raises ``sqlite3.Error``."""
        try:
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        except sqlite3.Error as exc:
            if self.reserve is None or cache_errno(exc) != errno.ENOSPC:
                raise
            if not drain and self._db.execute("SELECT 1 FROM entries LIMIT 1").fetchone():
                raise
            self.reserve.spent(lambda: self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall())

    def _draining(self) -> bool:
        """The queued writes give space back: deletes of committed entries' rows, and no
        accepted write waiting to be written (on the trio thread)."""
        return (not any(op[2] is not None for op in self._pending)
                and any(len(op) > 3 and op[3] and "d" in op[3] for op in self._pending))

    async def flush_pending(self, *, due_only: bool = False) -> None:
        """Write everything queued so far in one transaction (from a worker thread).
        ``due_only`` (nothing urgent queued: ``run`` woke for lazy writes or a held insert
        that is due): stop before the first held insert not due yet, in order, unless the
        oldest lazy write has waited ``LAZY_DELAY + HOLD`` already.

        Raises ``CacheError`` when the write fails; the batch then stays queued in front of
        later writes, and each of its entries carries the error in ``journal_error``."""
        async with self._lock:
            cut = len(self._pending)
            now = time.monotonic()
            if due_only and self._held and (self._lazy_since is None or now < self._lazy_since
                                            + self.LAZY_DELAY + self.HOLD):
                for i, op in enumerate(self._pending):
                    if op[2] is not None and self._held.get(op[2], 0.0) > now:
                        cut = i
                        break
            batch, self._pending = self._pending[:cut], self._pending[cut:]
            if self._pending:  # the rest: held inserts not due, what was queued after them
                ids = {op[2] for op in batch if op[2] is not None}
                waiters: list[Entry | Barrier] = [w for w in self._waiters
                                                  if isinstance(w, Entry) and w.id in ids]
                self._waiters = [w for w in self._waiters if not (isinstance(w, Entry) and w.id in ids)]
                held = {i: self._held.pop(i) for i in ids if i in self._held}
                self._unwritten = {op[2]: op for op in self._pending if op[2] is not None}
                lazy_since = self._lazy_since
                if not any(op[2] is None for op in self._pending):
                    self._lazy_since = None
                self._lazy_behind = self._lazy_since is not None
            else:
                waiters, self._waiters = self._waiters, []
                lazy_since, self._lazy_since = self._lazy_since, None
                held, self._held = self._held, {}
                self._unwritten = {}
                self._lazy_behind = False
            if batch:
                self._build(batch)
                if self.before_batch is not None and any(op[2] is not None for op in batch):
                    self.before_batch()
                self._writing = len(batch)
                try:
                    # light: every waiter needs only a kill -9's durability (none waits
                    # for the lazy writes; a batch with no waiter is fsynced as before)
                    light = bool(waiters) and all(w.light for w in waiters)
                    await trio.to_thread.run_sync(self._apply, batch, *((True,) if light else ()))
                except BaseException as exc:
                    self._pending[:0] = batch
                    self._waiters[:0] = waiters
                    if lazy_since is not None:
                        self._lazy_since = min(lazy_since, self._lazy_since or lazy_since)
                    self._held.update(held)
                    self._lazy_behind = False
                    self._unwritten = {op[2]: op for op in self._pending if op[2] is not None}
                    if not isinstance(exc, Exception):
                        raise
                    err = cache_error(exc, "writing the outbox journal")
                    if err.errno != errno.ENOSPC and self.error is None:  # what SQLite said
                        log.info("outbox journal write error", extra={
                            "error": type(exc).__name__, "detail": str(exc)[:200],
                            "sqlite_code": getattr(exc, "sqlite_errorcode", None)})
                    raise self._refused(waiters, err) from exc
                finally:
                    self._writing = 0  # committed, or back in the queue
                self._unsynced = light
            elif self._unsynced and any(not w.light for w in waiters):
                # nothing to write, but a waiter needs a power cut's durability of what light
                # batches committed before it (an unlink, then a directory's fsync): the log
                # they are in is fsynced
                try:
                    await trio.to_thread.run_sync(self._sync_log)
                except OSError as exc:
                    self._waiters[:0] = waiters
                    raise self._refused(waiters, cache_error(exc, "syncing the outbox journal")) from exc
                self._unsynced = False
            self.error = None
            for w in waiters:
                w.journal_error = None
                if isinstance(w, Entry):
                    w.settle()
                w.durable.set()
                w.notify()

    def _refused(self, waiters: list[Entry | Barrier], err: CacheError) -> CacheError:
        """The cache disk refused a batch's write or the log's sync (``flush_pending``):
        ``err`` is kept (``error``) and counted (``failures``), and every waiter of the
        batch is told it (``journal_error``) and woken. Returns ``err``, for the caller to
        raise."""
        self.error = err
        self.failures += 1
        for w in waiters:
            w.journal_error = (err.errno, err.reason)
            w.notify()
        return err

    async def run(self) -> None:
        """Group-commit loop: wait for queued writes, apply them, repeat: every write queued
        while a batch is being written goes in the next one, so concurrent closes share one
        fsync. Lazy writes alone (``_lazy``) wait up to ``LAZY_DELAY`` s for company, held
        inserts (``add(hold=True)``) up to ``HOLD`` s for their entry to finish. Never
        returns; a failed write is retried with backoff (``RETRY_MIN`` .. ``RETRY_MAX`` s)."""
        delay = self.RETRY_MIN
        while True:
            await self._wakeup.wait()
            self.wakeups += 1
            # only lazy writes or held inserts queued: write them with the next urgent batch,
            # or when the first of them is due (LAZY_DELAY, HOLD)
            while not self._urgent and (due := self._due()) is not None and due > time.monotonic():
                self._wakeup = trio.Event()
                self._sleeping_until = due
                try:
                    # (the clock read again: it may have passed ``due`` since the check,
                    # on a loaded machine; ``move_on_after`` refuses a negative delay)
                    with trio.move_on_after(max(0.0, due - time.monotonic())):
                        await self._wakeup.wait()
                finally:
                    self._sleeping_until = None
                self.wakeups += 1
            self._wakeup = trio.Event()
            if not self._urgent and not self._pending and not self._waiters:
                continue  # the held inserts finished first: nothing to write
            urgent, self._urgent = self._urgent, False
            try:
                await self.flush_pending(due_only=not urgent)
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
                    await trio.to_thread.run_sync(self._checkpoint, self._draining())
                if err.errno == errno.ENOSPC and self.on_full is not None:
                    self.on_full()
                await trio.sleep(delay)
                delay = min(delay * 2, self.RETRY_MAX)
                self._wake()
                continue
            if delay != self.RETRY_MIN:
                log.info("outbox journal writes again", extra={"failures": self.failures})
                delay = self.RETRY_MIN
            if self._pending:
                # a batch cut before a held insert not due yet (``flush_pending(due_only)``):
                # what stays queued has no wake-up of its own, so look at its due time again
                # (else a held insert waits for the next close, forever on a quiet mount)
                self._wakeup.set()
            now = time.monotonic()
            if not self._pending and now - self._last_checkpoint >= self.CHECKPOINT_EVERY:
                self._last_checkpoint = now
                try:
                    await trio.to_thread.run_sync(self._checkpoint)
                except sqlite3.Error as exc:
                    log.info("outbox checkpoint failed; retried later",
                             extra={"errno": errno.errorcode.get(cache_errno(exc))})
                else:
                    if self.reserve is not None:  # made again once space allows
                        await trio.to_thread.run_sync(self.reserve.fill)

    def close(self) -> None:
        """Write what is still queued (best effort: on failure it is logged, and the entries
        concerned are replayed from the outbox or re-sent by their nodes next time), close."""
        try:
            if self._pending:
                self._build(self._pending)
                self._apply(self._pending)
                self._pending = []
            self._checkpoint()
        except (sqlite3.Error, OSError) as exc:
            log.warning("outbox journal: could not write the last queued changes at exit",
                        extra={"queued": len(self._pending),
                               "errno": errno.errorcode.get(cache_errno(exc))})
        self._db.close()
        self.witness.close()
