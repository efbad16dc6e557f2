"""The committer: sends the outbox journal's entries to the control plane, in order, one
worker per store (docs/ARCHITECTURE.md, "The path of a write").

- ``Committer`` — one ordered queue per store; each store's worker takes entries in order
  (a backlog in batches: ``POST .../batch``) and finishes each: committed (``Entry.done``,
  ``errno`` 0) or refused for good (``errno`` from ``errors.errno_for``). Transient failures
  (connection errors, timeouts, 5xx, 429) are retried until they commit; so is a 401 (the
  token was revoked, expired or rotated: an authentication outage, not a verdict on the
  write); permanent refusals (403 included) finish the entry with an errno. A send that
  breaks for one entry while the control plane answers other requests is not an outage:
  after ``SEND_FAILURES_MAX`` of them the entry is refused (``_broken_send``). A ``put`` that
  meets a concurrent change is resolved by the conflict protocol (``conflict.ConflictResolver``);
  the node keys of entries are resolved through the record identity (``identity.RecordIds``).
  Each entry carries the creation time of the store it was written in (``STORE_CREATED``):
  one written in a store since deleted and made again under its slug is refused, never
  sent (``_refuse_replaced``; the store's identity is asked again after any failed attempt,
  ``_confirm``). Every request of an entry also names that store (``store_precondition``:
  ``Memfuse-Store-Created``), so one sent in the moment between that check and its arrival
  is refused by the control plane in the write's own transaction (412 ``store_replaced``,
  ``StoreReplaced``: the same refusal, ``ESTALE``).
- ``Backoff`` — the one retry policy of every retry path here: exponential with full
  jitter, at least the server's ``Retry-After``, capped.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import math
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

import trio

from ..client import ApiClient, store_precondition
from ..errors import ApiError, Conflict, NotFound, StoreReplaced, TransientError, Unauthorized, errno_for
from ..wire import BatchOperation
from .conflict import AnsweredClient, ConflictResolver, local_refusal
from .identity import RecordIds
from .journal import ATTRS, DELETE, MOVE, MOVE_PREFIX, PUT, Entry, Journal
from .listeners import CommitListener

log = logging.getLogger("memfuse.outbox")

__all__ = ["BATCH_MAX_CONTENT", "BATCH_MAX_ENTRIES", "STORE_CREATED", "STORE_REPLACED", "Backoff", "Committer"]

#: the ``Entry.args`` key of the creation time of the store an entry was written in
#: (``Committer.submit``); an entry without it (an older journal) is sent as before
STORE_CREATED = "store_created"
#: the code of a write refused because it was made in a store deleted since, whose slug another
#: store has now (``Committer._replaced``): never sent, and never shown in the new store
STORE_REPLACED = "store_replaced"

BATCH_MAX_ENTRIES = 100  # entries in one batch (the server's BATCH_MAX_OPERATIONS)
BATCH_MAX_CONTENT = 4 * 1024 * 1024  # bytes of content in one batch (the server takes 48 MiB + 64 KiB by default)
#: sends of one entry that broke (``write_error``: the connection failed while its request
#: was being sent, no answer read) before it is refused for good, once the control plane
#: answered other requests since its first broken send (``Committer._broken_send``)
SEND_FAILURES_MAX = 5

#: the codes of transient failures of a request that never reached the control plane (no
#: connection was made: ``client.base._transport_error``); after one, the entry is as unsent
#: as before the attempt (``Entry.sent``), so its close may still withdraw it
#: (``Committer.withdraw``). Every other failure may have been applied (a timeout, a lost
#: answer, a 5xx): such an entry is only ever finished by the control plane's answer to its
#: idempotency key. (An attempt's later requests follow only refusals of its first one,
#: ``ConflictResolver.put``, so a connect failure never hides an applied request.)
NOT_SENT_CODES = frozenset({"connect_error", "connect_timeout", "pool_timeout"})

#: the result of ``_send_batch`` when an entry of the batch was withdrawn while it waited to
#: be sent again: the worker builds the batch again from its queue
_WITHDRAWN: list[Any] = []


#: a proxy's answers for a control plane it cannot reach (RFC 9110 15.6.3-15.6.5): without
#: ``Retry-After``, no answer of the control plane itself (``Committer._back_off``)
GATEWAY_STATUSES = frozenset({502, 503, 504})


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with full jitter (AWS Architecture Blog, "Exponential Backoff
    and Jitter"): before attempt ``n + 1``, a uniform random delay in
    ``[0, min(cap, base * 2**min(n, 12))]`` seconds, at least ``floor`` and at least the
    server's ``Retry-After`` (itself capped at ``cap``)."""

    cap: float = 30.0  # s
    base: float = 0.05  # s

    def delay(self, attempts: int, retry_after: float | None = None, floor: float = 0.0) -> float:
        """Seconds to wait after ``attempts`` failed attempts (``attempts`` >= 1)."""
        delay = random.uniform(0, min(self.cap, self.base * 2 ** min(attempts, 12)))
        if retry_after is not None and not math.isnan(retry_after):
            delay = max(delay, min(retry_after, self.cap))
        return max(delay, floor)


class _NoListener:
    """The listener of a committer nobody listens to (tests driving the committer alone)."""

    def entry_finished(self, e: Entry) -> None:
        pass

    def entry_conflicted(self, e: Entry, what: str) -> None:
        pass


class Committer:
    """Commits entries to the control plane, one ordered queue per store.

    Parts, given at construction: ``client`` (the API client), ``journal`` (where entries
    and what is learnt are made durable), ``ids`` (the record identity shared with the
    filesystem: a ``RecordIds``, or for a bare committer the journal's key map as a dict),
    ``listener`` (a ``CommitListener``: told of every finished entry and every conflict
    resolved last-writer-wins), ``base_content(sha256)`` (the bytes of a version this
    sidecar had, None when gone: the base of a rebase), ``backoff_max`` (s, the cap of the
    one ``Backoff`` policy) and ``metrics``.
    """

    def __init__(self, client: ApiClient, journal: Journal,
                 ids: RecordIds | dict[str, tuple[str | None, str | None]],
                 listener: CommitListener | None = None, *,
                 base_content: Callable[[str], bytes | None] | None = None,
                 backoff_max: float = 30.0, metrics: Any = None,
                 store_created: Callable[[str], str] | None = None) -> None:
        self.metrics = metrics
        #: slug -> the creation time (``Store.created_at``, ISO 8601) of the store mounted
        #: under it now, '' when unknown: stamped on each entry at ``submit``
        #: (``args[STORE_CREATED]``, kept in the journal with it)
        self.store_created = store_created or (lambda slug: "")
        #: slug -> the creation time of the store the control plane holds under it, as last
        #: learnt (the attachments, or ``_confirm``). INVARIANT: an entry stamped with
        #: another store's creation time is never sent (``_refuse_replaced``): a store
        #: deleted and made again under its slug is another store (attack 16 F5)
        self.confirmed: dict[str, str] = {}
        #: stores whose identity is asked again (``_confirm``) before their next send: every
        #: store with queued entries after a failed attempt (an outage may hide a delete and
        #: a re-creation), and every store of a replayed backlog
        self._unconfirmed: set[str] = set()
        self._confirm_failures = 0
        self.client = client
        self.journal = journal
        #: node key -> (record id, sha256), persisted in the journal's ``keymap`` table
        self.ids = ids if isinstance(ids, RecordIds) else RecordIds(journal, ids)
        self.listener: CommitListener = listener if listener is not None else _NoListener()
        #: puts sent with ``If-Match`` and the concurrent changes they meet
        self.resolver = ConflictResolver(self.ids, journal, metrics, base_content=base_content,
                                         on_conflict=self.listener.entry_conflicted)
        #: the one backoff policy of every retry of a commit, a batch and the worker itself
        self.backoff = Backoff(cap=backoff_max)
        self.queues: dict[str, deque[Entry]] = {}
        #: store -> where its worker parks while its queue is empty (the store has a worker
        #: once it is here); unparked by every entry queued (``_enqueue``) and by a
        #: ``withdraw``. INVARIANT: a worker parks only after seeing its queue empty, with no
        #: await between, so no entry queued is left unseen
        self._wakeups: dict[str, trio.lowlevel.ParkingLot] = {}
        self._nursery: trio.Nursery | None = None
        self._seq = journal.next_id()
        self._backlog: list[Entry] = []  # what ``replay`` queued (``backlog_left``)
        self._to_coalesce: set[str] = set()  # stores whose queue got a put since the last look
        self.coalesced = 0  # puts superseded by a later put of the same file (``_coalesce``)
        self._absorbed: dict[str, int] = {}  # store -> puts waiting in a later one's ``absorbed``
        self.committed = 0
        self.refused = 0
        self.retries = 0
        self.auth_waits = 0  # commit attempts deferred because the token was refused (401)
        #: set by the worker that finds every queue empty, made by ``wait_idle`` (no event
        #: is made or set per commit while nobody waits for the outbox to drain)
        self._idle: trio.Event | None = None
        self._store_idle: dict[str, trio.Event] = {}
        # INVARIANT: ``_poke`` is set (and replaced) at every ``poke``, ``_urgent`` only at an
        # urgent one: a wait out of a failure the control plane answered (500, 429, a 503 with
        # ``Retry-After``; not a proxy's 502 / 503 / 504 without one) ends only at ``_urgent``
        # (``_back_off``)
        self._poke = trio.Event()
        self._urgent = trio.Event()
        #: entries finished (committed or refused) per store since start; a reconcile after
        #: ``410`` compares it across its snapshot to see whether a local commit landed
        self.finished: dict[str, int] = {}
        self._held: dict[str, trio.Event] = {}  # stores whose next commit waits (``hold``)
        #: stores with a commit in flight (a worker between taking its first entry and
        #: finishing it); ``_inflight_done[store]``, made by ``hold`` when it must wait for
        #: one, is set when it ends
        self._inflight: set[str] = set()
        self._inflight_done: dict[str, trio.Event] = {}
        self.unexpected = 0  # commit attempts that failed with an unexpected exception
        #: commit a backlog of one store in batches (``POST .../batch``); turned off when the
        #: control plane answers that it has no such endpoint
        self.batching = True
        self.batches = 0  # batches the control plane answered
        #: the outbox's own view of the control plane: None while its last commit attempt
        #: was answered (or none was made yet), else since when (``time.time()``) and why
        #: its attempts fail transiently (``unreachable``: ``{"since", "error"}``)
        self.unreachable: dict[str, Any] | None = None
        #: the authentication outage as the outbox sees it: None while the token is accepted
        #: (or untried), else since when (``time.time()``) and the client's reason
        #: (``{"since", "error"}``): set when a commit attempt met a 401 for a token the
        #: client had just re-read its token file for (``ApiClient.auth_failure``), cleared
        #: by an answered attempt or a new token (``auth_restored``)
        self.auth_refused: dict[str, Any] | None = None
        #: ask the journal to hold each new entry's insert (``Journal.add(hold=True)``) while
        #: the control plane answers: set by the filesystem when a close waits for the
        #: commit (``--commit-wait`` well above ``Journal.HOLD``), so a write acknowledged
        #: within ``Journal.HOLD`` costs no journal transaction (docs/SEMANTICS.md)
        self.hold_journal = False
        #: entry id -> (its sends that broke, ``time.monotonic()`` of the first of them):
        #: ``_broken_send``; an entry leaves it when it finishes (``_finished``)
        self._broken_sends: dict[int, tuple[int, float]] = {}
        #: the method that sends an entry of each op (``_apply``), built once
        self._appliers: dict[str, Callable[[Entry, Any, dict[str, Any]], Awaitable[None]]] = {
            PUT: self.resolver.put, ATTRS: self._set_attrs, DELETE: self._delete,
            MOVE: self._move, MOVE_PREFIX: self._move_prefix}
        #: op -> its ``memfuse_commits_total`` child, looked up once (``labels()`` takes a
        #: lock and builds its key per call; every commit counts one)
        self._commit_counters: dict[str, Any] = {}
        #: transient failures of commit attempts since start (``_attempt_failed``)
        self.failed_attempts = 0
        #: entries whose close waits for the control plane without the journal having
        #: taken them (``watch``): woken at every failed attempt of any entry
        self._watched: set[Entry] = set()

    # --- the control plane's reachability, as the outbox sees it ------------------------------
    @property
    def failing(self) -> bool:
        """Whether no commit can come soon, so a ``close`` returns once its write is
        accepted instead of waiting out ``--commit-wait`` (``Filesystem.flush``): the outbox
        is in backoff (its last commit attempt failed transiently: connection error,
        timeout, 5xx, 429, and none was answered since: ``unreachable``), or in an
        authentication outage (a commit met a 401 for the token the token file still gives,
        re-read at that 401: ``auth_refused``; a rotated token ends it at once)."""
        return self.unreachable is not None or self.auth_refused is not None

    def _attempt_failed(self, err: ApiError) -> None:
        """A commit attempt (single or batch) failed transiently: note since when, and on
        the transition wake every queued entry's waiters (a ``close`` waiting for its
        commit returns then)."""
        why = err.code or (f"http_{err.status}" if err.status else "unreachable")
        self._unconfirmed.update(self.queues)
        self._outage("unreachable", why, err.status, why,
                     "control plane unreachable for commits; closes return once their write "
                     "is accepted")

    def _token_refused(self, err: ApiError) -> None:
        """A commit attempt (single or batch) met a 401. When the client has re-read its
        token file for it and the token is still refused (``ApiClient.auth_failure``; a
        token that changed meanwhile is tried again first), the outbox is in an
        authentication outage: ``failing`` until a token is accepted (``auth_restored``),
        and every waiting ``close`` returns now, its write accepted and pending."""
        self.auth_waits += 1
        self._unconfirmed.update(self.queues)
        why = getattr(self.client, "auth_failure", None)
        if not why:
            return  # a token taken up meanwhile: its retry may well commit within the wait
        self._outage("auth_refused", why, err.status, err.code,
                     "authentication outage: the control plane refuses the token; closes "
                     "return once their write is accepted")

    def _outage(self, kind: str, why: str, status: int | None, code: str | None,
                message: str) -> None:
        """One commit attempt failed with no commit coming soon (``failing``): ``kind`` is
        the outage it shows, ``"unreachable"`` or ``"auth_refused"`` (the attribute holding
        ``{"since": epoch s, "error": why}`` while it lasts). Counts the attempt and wakes
        the closes watching their entries; an outage already on only takes the new ``why``;
        one starting is logged (``message``, with ``status`` and ``code``) and wakes every
        queued entry's waiters (``_wake_all``): a waiting ``close`` returns then."""
        self.failed_attempts += 1
        for w in self._watched:
            w.notify()
        state = getattr(self, kind)
        if state is not None:
            state["error"] = why
            return
        setattr(self, kind, {"since": time.time(), "error": why})
        log.warning(message, extra={"status": status, "code": code, "depth": self.depth()})
        self._wake_all()

    def auth_restored(self) -> None:
        """A token was accepted again, or a new one taken up (``ApiClient.auth_listener``,
        ``TokenFile.on_change``): the authentication outage is over, closes wait for their
        commit again (one refused again starts it anew); queued entries are retried now."""
        if self.auth_refused is not None:
            log.info("authentication outage over for commits", extra={
                "down_s": round(time.time() - self.auth_refused["since"], 3),
                "depth": self.depth()})
            self.auth_refused = None
        self.poke(urgent=True)

    def _wake_all(self) -> None:
        """``failing`` became true: make held journal rows durable (no acknowledgement is
        coming soon) and wake every queued entry's waiters."""
        self.journal.hurry()
        for q in self.queues.values():
            for e in q:
                e.notify()
                for a in e.absorbed:
                    a.notify()

    def _broken_send(self, e: Entry, err: TransientError) -> bool:
        """A send of ``e`` broke (``write_error``). While the control plane answers other
        requests (``client.last_answer`` after this entry's first broken send: another
        store's commit, a change-feed heartbeat) this is not an outage: reachability is not
        flipped, and after ``SEND_FAILURES_MAX`` broken sends the entry is refused for good
        (EIO, ``send_failed``, logged; the file keeps its content as ``rejected``), so one
        request the control plane never takes (a body over a proxy's bound that resets the
        connection without an answer) cannot hold the store's later writes for ever (attack
        12, A2). Returns True when ``e`` was refused; otherwise the caller retries."""
        now = time.monotonic()
        count, first = self._broken_sends.get(e.id, (0, now))
        count += 1
        self._broken_sends[e.id] = (count, first)
        last_answer = getattr(self.client, "last_answer", 0.0)
        if not (isinstance(last_answer, float) and last_answer > first):
            self._attempt_failed(err)  # nothing answered meanwhile: an outage, as any failure
            return False
        self._attempt_answered()
        if count < SEND_FAILURES_MAX:
            return False
        del self._broken_sends[e.id]
        self.refused += 1
        e.errno = errno.EIO
        e.code = "send_failed"
        e.reason = (f"the control plane answered other requests but this one's send broke "
                    f"{count} times ({err.detail or err.code})")
        log.warning("commit refused: its request cannot be sent", extra={
            "entry": e.id, "op": e.op, "store": e.store,
            "path": e.args.get("path") or e.args.get("from"), "attempts": count,
            "code": e.code, "errno": "EIO", "size": len(e.content or b"")})
        return True

    def _attempt_answered(self) -> None:
        """The control plane answered a commit attempt (a commit or a refusal)."""
        if self.unreachable is not None:
            log.info("control plane reachable again for commits",
                     extra={"down_s": round(time.time() - self.unreachable["since"], 3),
                            "depth": self.depth()})
            self.unreachable = None
        if self.auth_refused is not None:  # answered: the token was accepted
            self.auth_restored()

    def no_answer(self, seconds: float) -> None:
        """The control plane has answered nothing for ``seconds`` while a request waits (a
        paused process, a black-holed network: ``ApiClient.no_answer_for``): treat it as a
        known outage (``failing``, error ``no_answer``) so a waiting ``close`` returns once
        its write is accepted instead of waiting out ``--commit-wait``. A failure already
        noted is left as it is. Cleared by ``heard_again`` or any answered commit."""
        if self.unreachable is None:
            self._attempt_failed(TransientError(f"no answer for {seconds:.1f} s", code="no_answer"))

    def heard_again(self) -> None:
        """The control plane answered something after ``no_answer``: the outage it noted is
        over (a failure of another kind stays until a commit is answered)."""
        if self.unreachable is not None and self.unreachable["error"] == "no_answer":
            self._attempt_answered()

    @contextlib.contextmanager
    def watch(self, e: Entry) -> Iterator[None]:
        """Inside: ``e.changed`` is also set at every failed commit attempt of any entry
        (``failed_attempts`` grows), so a close waiting for ``e`` learns that the control
        plane was tried and did not answer."""
        self._watched.add(e)
        try:
            yield
        finally:
            self._watched.discard(e)

    def withdraw(self, e: Entry, errno_: int, reason: str, code: str) -> bool:
        """Take back a queued ``e`` that no request may have carried to the control plane
        (``Entry.sent`` false, not in flight, not finished, first in nothing: not absorbed by a
        later put): out of its store's queue, finished with ``errno_`` / ``reason`` / ``code``
        and ``withdrawn``, never sent (the worker and a batch check ``withdrawn`` before every
        attempt). The puts it absorbed were accepted on their own: the newest takes its
        place in the queue, carrying the others. The listener is not told (the caller undoes
        the write on the tree). False, nothing changed, when it cannot be taken back. The
        caller takes its insert out of the journal first (``Journal.withdraw``)."""
        q = self.queues.get(e.store)
        if e.done.is_set() or e.sent or e.in_flight or q is None or e not in q:
            return False
        i = q.index(e)
        del q[i]
        if e.absorbed:
            last = e.absorbed[-1]
            last.absorbed, e.absorbed = e.absorbed[:-1], []
            q.insert(i, last)
            self._absorbed[e.store] = self._absorbed.get(e.store, 0) - 1
            self._to_coalesce.add(e.store)
        e.withdrawn = True
        e.errno, e.reason, e.code = errno_, reason, code
        e.finish()
        self._wakeups[e.store].unpark()  # an emptied queue: its worker goes idle
        self.poke(urgent=True)
        return True

    # --- views of the parts -------------------------------------------------------------------
    @property
    def conflicts(self) -> int:
        """Writes resolved last-writer-wins since start."""
        return self.resolver.conflicts

    @property
    def merges(self) -> int:
        """Writes merged onto a concurrent change since start."""
        return self.resolver.merges

    def forget_merge(self, node_key: str) -> None:
        """The file ``node_key`` shows the merged content of its last put
        (``ConflictResolver.forget_merge``)."""
        self.resolver.forget_merge(node_key)

    def replayed(self, keep: set[str] | frozenset[str] = frozenset()) -> None:
        """The outbox a previous process left is queued again (``replay``): merge states
        kept for files without a queued put are obsolete (``ConflictResolver.replayed``)."""
        self.resolver.replayed(keep)

    def base_shas(self) -> set[str]:
        """The sha256 of the bases of queued ``put`` entries (the versions their
        ``If-Match`` names, and the content an append's journal row extends,
        ``Entry.append_base``): the blob collection keeps those blobs, so an append that
        meets a concurrent change can be rebased (``_rebase``) and an append row rebuilt
        after a crash (``Journal.resolve_bases``); and the content each replaced
        (``Entry.before``), from which a write its close withdraws is undone
        (``Filesystem._withdraw``)."""
        out = set()
        for store, q in self.queues.items():
            for e in q:
                if e.op == PUT and e.node_key is not None:
                    sha = self.ids.get(e.node_key, store)[1]
                    if sha:
                        out.add(sha)
                    for a in (e, *e.absorbed):
                        if a.append_base is not None:
                            out.add(a.append_base[0])
                        if a.before is not None and a.before[0]:
                            out.add(a.before[0])
                        if a.args.get("base"):  # an overwrite's older base (Node.read_base)
                            out.add(a.args["base"])
                        if a.args.get("served"):  # ... or what readers were served (Node.served)
                            out.add(a.args["served"])
        return out

    # --- enqueueing (synchronous, on the trio thread: order is fixed here) -------------------
    def submit(self, store: str, op: str, node_key: str | None, args: dict[str, Any],
               content: bytes | None = None, *, sha: str | None = None,
               append_base: tuple[str, int] | None = None, hold: bool = False) -> Entry:
        """Accept one change: queue it for the journal and for its store's worker. ``sha``:
        the sha256 of ``content`` when the caller has it (not hashed again); ``append_base``:
        (sha256, length) of the content ``content`` extends, when the caller checked it
        (``Entry.append_base``). ``args`` is the entry's own (not copied): it gets the
        creation time of the store it is written in (``STORE_CREATED``), when known.
        ``hold``: the caller's system call waits for the commit (a ``close``, an ``fsync``),
        so the journal may hold the insert (``Journal.HOLD``, when ``hold_journal`` and not
        ``failing``): a kill -9 before it is written finds that call not returned yet. Every
        other change (unlink, rename, attributes, a commit no call waits for) is written at
        once, and its system call waits until it is (``fuse_ops._guard_durable``): a change
        whose call returned 0 survives a kill -9 (ns27)."""
        self._seq += 1
        created = self.store_created(store)
        if created:
            args[STORE_CREATED] = created  # the callers pass a dict of their own
        e = Entry(id=self._seq, store=store, op=op, node_key=node_key, args=args, content=content,
                  sha=sha, append_base=append_base)
        # the witness notes the record id and base the entry is written on (Journal.recover)
        self.journal.add(e, self.ids.get(node_key, store) if node_key is not None else None,
                         hold=hold and self.hold_journal and not self.failing, light=not hold)
        self._enqueue(e)
        return e

    def _enqueue(self, e: Entry) -> None:
        if e.op == PUT:
            self._to_coalesce.add(e.store)
        q = self.queues.setdefault(e.store, deque())
        q.append(e)
        lot = self._wakeups.get(e.store)
        if lot is None:
            self._wakeups[e.store] = trio.lowlevel.ParkingLot()
            if self._nursery is not None:
                self._nursery.start_soon(self._worker, e.store)
        elif lot:  # (its worker is parked: woken; else it sees the entry when it looks)
            lot.unpark()

    def replay(self, entries: list[Entry]) -> None:
        """Queue entries a previous process accepted but did not finish, ahead of anything
        written since (called once the stores are loaded and the entries shown on the tree,
        ``Filesystem.overlay_outbox``, just before the mount: the backlog drains while the
        mount serves). ``backlog_left`` counts them down."""
        self._backlog = list(entries)
        first: set[tuple[str, str | None]] = set()
        for e in entries:
            self._seq = max(self._seq, e.id)
            if (e.store, e.node_key) not in first:
                # the previous process may have sent it (its answer lost with the process)
                first.add((e.store, e.node_key))
                e.sent = True
            self._unconfirmed.add(e.store)
            self._enqueue(e)

    def backlog_left(self) -> int:
        """Entries of the replayed backlog (``replay``) not finished yet: 0 once it drained
        (``status.json``'s ``outbox.backlog``, ``draining`` while above 0)."""
        left = sum(1 for e in self._backlog if not e.done.is_set())
        if not left:
            self._backlog = []
        return left

    def poke(self, *, urgent: bool = False) -> None:
        """The control plane answered someone (e.g. the change feed): retry now, instead of
        at the end of their backoff, the commits whose last attempt got no answer (refused
        connection, reset, timeout, a proxy's 502 / 503 / 504: the outage may be over).
        ``urgent``: every waiting commit, also one the control plane answered with a failure
        for now (500, 429, a 503 with ``Retry-After``), whose
        backoff (and ``Retry-After``) is otherwise waited out whole (``_back_off``): a new
        token, a withdrawn entry, a close that must learn now."""
        if self.depth():
            self._poke.set()
            self._poke = trio.Event()
            if urgent:
                self._urgent.set()
                self._urgent = trio.Event()

    async def _back_off(self, delay: float, err: ApiError) -> None:
        """Wait ``delay`` s after the failed attempt ``err`` (transient, or a refused token)
        before the next one, or less: until a ``poke`` when the control plane did not answer
        it (no status; or a proxy's 502 / 503 / 504 without ``Retry-After``: the control
        plane behind it is down, and a change-feed page says it is back) or refused the token
        (a new one pokes); until an urgent one when the control plane answered it for now
        (500, 429, a 503 with ``Retry-After``: it is up and said "not now"; a change-feed
        page every second poked a commit refused with 500 once a second whatever its backoff,
        attack24 F4)."""
        now_only = isinstance(err, TransientError) and err.status is not None and not (
            err.status in GATEWAY_STATUSES and err.retry_after is None)
        with trio.move_on_after(delay):
            await (self._urgent if now_only else self._poke).wait()

    def depth(self, store: str | None = None) -> int:
        """Entries not yet finished, in one store or in all."""
        if store is not None:
            return len(self.queues.get(store, ())) + self._absorbed.get(store, 0)
        return sum(len(q) for q in self.queues.values()) + sum(self._absorbed.values())

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
            if self._idle is None:
                self._idle = trio.Event()
            await self._idle.wait()

    def queued(self, store: str) -> list[Entry]:
        """The store's unfinished entries, in order (the first may be in flight)."""
        return list(self.queues.get(store, ()))

    @contextlib.asynccontextmanager
    async def hold(self, store: str) -> AsyncIterator[None]:
        """Inside: no commit of ``store`` is in flight and none starts (entries still queue).

        Waits for the commit in flight to end (it is retried until it commits or is refused,
        so this waits as long as the control plane is unreachable). Used by the reconcile
        after ``410``, so that its snapshot and the local tree describe the same moment."""
        ev = trio.Event()
        self._held[store] = ev
        try:
            while store in self._inflight:
                done = self._inflight_done.get(store)
                if done is None:
                    done = self._inflight_done[store] = trio.Event()
                await done.wait()
            yield
        finally:
            del self._held[store]
            ev.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
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
        restarts = 0
        while True:
            try:
                await self._worker_loop(store)
            except Exception:
                restarts += 1
                delay = self.backoff.delay(restarts, floor=0.1)
                if self.metrics is not None:
                    self.metrics.task_failures.labels("committer").inc()
                log.exception("outbox worker failed; restarting", extra={"store": store,
                                                                          "restart_in_s": delay})
                await trio.sleep(delay)

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
                if self._idle is not None and not self.depth():
                    self._idle.set()
                    self._idle = None
                await self._wakeups[store].park()
                continue
            if store in self._unconfirmed and not await self._confirm(store):
                continue
            if self._refuse_replaced(store, q):
                continue
            if store in self._to_coalesce:
                self._to_coalesce.discard(store)
                if len(q) > 1:
                    self._coalesce(store, q)
            batch = self._batch_of(q) if self.batching and len(q) > 1 else []
            if sum(op is not None for _, op in batch) >= 2:
                await self._commit_batch(store, q, batch)
                continue
            e = q[0]
            self.fill(e)
            self._inflight.add(store)
            try:
                await self._commit_with_retry(e)
            finally:
                self._end_inflight(store)
            if not e.withdrawn:  # (withdrawn: out of the queue already, never sent)
                self._finished(store, q, e)

    async def _confirm(self, store: str) -> bool:
        """Ask the control plane which store it holds under ``store`` now (``GET
        /v1/stores/{slug}``: its creation time) into ``confirmed``. False after a transient
        failure or a refused token (waited out: backoff, or a ``poke``): the caller asks
        again. A store not found (deleted) or not readable gives no verdict: the sends get
        their own answer."""
        try:
            st = await self.client.get_store(store)
        except (TransientError, Unauthorized) as err:
            # an attempt like a commit's: the outage is told the same way (``failing``)
            if isinstance(err, Unauthorized):
                self._token_refused(err)
            else:
                self._attempt_failed(err)
            self._confirm_failures += 1
            delay = self.backoff.delay(self._confirm_failures, getattr(err, "retry_after", None))
            await self._back_off(delay, err)
            return False
        except ApiError:
            self._attempt_answered()
        except Exception:  # an answer we cannot read: no verdict, never a dropped entry
            log.exception("store identity not confirmed", extra={"store": store})
        else:
            self._attempt_answered()
            self.confirmed[store] = st.created_at.isoformat()
        self._confirm_failures = 0
        self._unconfirmed.discard(store)
        return True

    def _refuse_replaced(self, store: str, q: deque[Entry]) -> bool:
        """Refuse for good the first entry of ``q`` when it was written in another store
        of that slug (``_replaced``), and finish it. Returns whether one was refused."""
        e = q[0]
        if not self._replaced(e):
            return False
        self._finished(store, q, e)
        return True

    def _stamp_differs(self, e: Entry) -> bool:
        """Whether ``e``'s stamp and the store's ``confirmed`` creation time are both known
        and differ."""
        made_in, now = e.args.get(STORE_CREATED), self.confirmed.get(e.store)
        return bool(made_in and now and made_in != now)

    def _replaced(self, e: Entry) -> bool:
        """Whether ``e`` was written in another store of its slug than the one the control
        plane holds now (its stamp and ``confirmed`` both known and different: the store was
        deleted and made again under its name); then ``e`` is refused for good (``ESTALE``,
        ``store_replaced``, logged; the caller finishes it): it is never sent."""
        if not self._stamp_differs(e):
            return False
        store, made_in, now = e.store, e.args.get(STORE_CREATED), self.confirmed.get(e.store)
        e.errno, e.code = errno.ESTALE, STORE_REPLACED
        e.reason = ("the store was deleted (a new store has its name); this change was "
                    "made in the deleted store and is not sent to the new one")
        self.refused += 1
        log.warning("write of a deleted store refused: a new store has its name",
                    extra={"store": store, "entry": e.id, "op": e.op,
                           "path": e.args.get("path") or e.args.get("from"),
                           "store_created": made_in, "now_created": now})
        return True

    def _coalesce(self, store: str, q: deque[Entry]) -> None:
        """Successive queued ``put``s of one file become one: a ``put`` followed later in the
        queue by another ``put`` of the same node key, with nothing between them that touches
        that file (a move, a delete, its attributes) or moves a directory, is superseded. It
        leaves the queue and joins the later one's ``absorbed``; it finishes when that one
        does, with its result (a ``close`` or ``fsync`` waiting for it waits for that). The
        later content was written on top of the earlier one here, so it holds every earlier
        close (appends in their order); it is sent with the base the earlier one had (the
        version this sidecar last saw: ``If-Match``), so a rival change is merged as before.
        Nothing moves ahead of what was written before it: the content waits at the later
        position. A put that may already have reached the control plane (``Entry.sent``) is
        never absorbed: its content may be applied, so the later put, sent on the earlier
        base, would merge it a second time; it is sent again with its own idempotency key.
        A backlog of 1,000 writes to 2 files is 2 requests."""
        later: dict[str, Entry] = {}  # node key -> the next put of it, nothing touching it between
        keep: list[Entry] = []
        dropped = 0
        for e in reversed(q):
            if e.op == MOVE_PREFIX or e.node_key is None:
                later.clear()
                keep.append(e)
                continue
            nxt = later.get(e.node_key)
            if e.op == PUT and nxt is not None and not e.sent:
                nxt.absorbed[:0] = [*e.absorbed, e]  # oldest first
                e.absorbed = []
                dropped += 1
                continue
            later.pop(e.node_key, None)
            tk = e.args.get("target_key")
            if tk:
                later.pop(tk, None)
            if e.op == PUT:
                later[e.node_key] = e
            keep.append(e)
        if dropped:
            keep.reverse()
            q.clear()
            q.extend(keep)
            self.coalesced += dropped
            self._absorbed[store] = self._absorbed.get(store, 0) + dropped
            log.debug("outbox: successive puts of the same files coalesced",
                      extra={"dropped": dropped, "left": len(q)})

    def fill(self, e: Entry) -> None:
        """Read the content of a ``deferred`` put (loaded without it: ``Journal.load``)
        before it is sent or shown; an append row whose base the journal no longer holds is
        rebuilt from the blob cache (``base_content``), else stays ``suffix_only``. A
        journal that cannot give it (``sqlite3.Error``) is a failure of this attempt:
        raised, the worker restarts and the entry stays first."""
        if e.deferred:
            e.content, e.suffix_only = self.journal.read_put(e.id)
            e.deferred = False
            self.journal.resolve_bases([e], self.resolver.base_content)


    def _finished(self, store: str, q: deque[Entry], e: Entry) -> None:
        """``e`` (first in ``q``) committed or was refused for good: out of the queue and the
        journal, then the listener's ``entry_finished``; the puts it superseded (``absorbed``) first, with its
        result."""
        for a in e.absorbed:
            a.errno, a.reason, a.code, a.record = e.errno, e.reason, e.code, e.record
            self.finished[store] = self.finished.get(store, 0) + 1
            self.journal.remove(a)
            a.settle()
            a.finish()
            try:
                self.listener.entry_finished(a)
            except Exception:
                log.exception("outbox result handler failed", extra={"entry": a.id})
            a.finished_with()
        if e.absorbed:
            self._absorbed[store] = self._absorbed.get(store, 0) - len(e.absorbed)
        e.absorbed = []
        q.popleft()
        self._broken_sends.pop(e.id, None)
        self.finished[store] = self.finished.get(store, 0) + 1
        self.journal.remove(e)
        e.settle()
        e.finish()
        try:
            self.listener.entry_finished(e)
        except Exception:
            log.exception("outbox result handler failed", extra={"entry": e.id})
        e.finished_with()

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
            if out and e.args.get(STORE_CREATED) != out[0][0].args.get(STORE_CREATED):
                break  # one batch names one store (``store_precondition``)
            self.fill(e)
            if e.op == PUT and e.content is None and e.suffix_only is not None:
                break  # sent alone (ConflictResolver.put), as an append on its base
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
        rid, sha = self.ids.get(e.node_key, e.store)
        if e.op == PUT:
            rid, sha, base = self.resolver.put_base(e)
            text = (e.content or b"").decode("utf-8", errors="surrogateescape")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                return None  # refused locally by _put
            kw = {"mode": a.get("mode"), "mtime_ns": a.get("mtime_ns")}
            suffix = self.resolver.append_suffix(e, sha, base) if rid is not None else None
            if rid is not None and sha is not None and suffix is not None:
                return c.batch_append(rid, suffix.decode("utf-8"), if_match=sha, type=a.get("type"),
                                      idempotency_key=e.key + "-append", **kw)
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
        self._inflight.add(store)
        try:
            ops = [op for _, op in batch if op is not None]
            outcomes = await self._send_batch(store, ops, batch)
            if outcomes is _WITHDRAWN:
                return  # built again from the queue, without it
            answers = iter(outcomes) if outcomes is not None else None
            for e, op in batch:
                if e.withdrawn:  # pragma: no cover - an answered batch's entries were sent
                    continue
                first = None
                if answers is not None and op is not None:
                    first = AnsweredClient(self.client, op.op, next(answers))
                await self._commit_with_retry(e, first)
                self._finished(store, q, e)
        finally:
            self._end_inflight(store)

    def _end_inflight(self, store: str) -> None:
        """The store's commit in flight ended: ``hold`` may go on."""
        self._inflight.discard(store)
        done = self._inflight_done.pop(store, None)
        if done is not None:
            done.set()

    async def _send_batch(self, store: str, ops: list[BatchOperation],
                          batch: list[tuple[Entry, BatchOperation | None]]) -> list[Any] | None:
        """The outcomes of ``ops`` (the requests of ``batch``'s entries: ``ApiClient.batch``),
        retrying transient failures and 401 with the committer's backoff; None when the
        entries must go one by one (also after ``SEND_FAILURES_MAX`` broken sends while the
        control plane answered other requests: each entry then meets ``_broken_send`` alone);
        ``_WITHDRAWN`` when an entry was withdrawn meanwhile (``withdraw``: checked before every
        attempt, never sent)."""
        attempts = 0
        carried = [e for e, op in batch if op is not None]
        broken, first_broken = 0, 0.0
        while True:
            attempts += 1
            if any(e.withdrawn for e, _ in batch):
                return _WITHDRAWN
            if attempts > 1 and store in self._unconfirmed:  # a failure since: which store now?
                if not await self._confirm(store):
                    continue
                if any(self._stamp_differs(e) for e, _ in batch):
                    return _WITHDRAWN  # built again: the worker refuses those first
            was = [e.sent for e in carried]
            for e in carried:
                e.sent = e.in_flight = True
            try:
                try:
                    with store_precondition(carried[0].args.get(STORE_CREATED) if carried else None):
                        outcomes = await self.client.batch(store, ops)
                finally:
                    for e in carried:
                        e.in_flight = False
                self._attempt_answered()
                self.batches += 1
                if self.metrics is not None:
                    self.metrics.batches.inc()
                return outcomes
            except (TransientError, Unauthorized) as err:
                self.retries += 1
                if isinstance(err, Unauthorized) or err.code in NOT_SENT_CODES:
                    for e, sent in zip(carried, was):
                        e.sent = sent  # it never reached the control plane
                for e in carried:
                    e.notify()
                if isinstance(err, TransientError) and err.code == "write_error":
                    broken, first_broken = broken + 1, first_broken or time.monotonic()
                    last_answer = getattr(self.client, "last_answer", 0.0)
                    if isinstance(last_answer, float) and last_answer > first_broken:
                        self._attempt_answered()  # answered elsewhere: this request, not an outage
                        if broken >= SEND_FAILURES_MAX:
                            log.info("batch cannot be sent; committing its entries one by one",
                                     extra={"store": store, "operations": len(ops), "attempts": broken})
                            return None
                    else:
                        self._attempt_failed(err)
                elif isinstance(err, TransientError):
                    self._attempt_failed(err)
                else:  # an authentication outage, as in _commit_with_retry
                    self._token_refused(err)
                if self.metrics is not None:
                    self.metrics.retries.inc()
                delay = self.backoff.delay(attempts, err.retry_after)
                log.info("batch deferred: will retry", extra={
                    "store": store, "operations": len(ops), "attempt": attempts,
                    "status": err.status, "code": err.code, "retry_in_s": round(delay, 3)})
                await self._back_off(delay, err)
            except ApiError as err:
                self._attempt_answered()
                if isinstance(err, StoreReplaced):  # each entry gets its own refusal
                    self._unconfirmed.add(store)
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

    async def _commit_with_retry(self, e: Entry, answered: "AnsweredClient | None" = None) -> None:
        """Commit ``e``, retrying transient failures until it commits or is refused for good.
        ``answered``: the client whose first request of ``e`` was answered inside a batch (used
        for the first attempt only)."""
        while True:
            if e.withdrawn:
                return  # its close took it back (``withdraw``): never sent
            if e.attempts and e.store in self._unconfirmed:  # a failure since: which store now?
                if not await self._confirm(e.store):
                    continue
                if self._replaced(e):
                    return
            e.attempts += 1
            was, e.sent, e.in_flight = e.sent, True, True
            client, answered = answered, None
            try:
                try:
                    await self._apply(e, client)
                finally:
                    e.in_flight = False
                self._attempt_answered()
                self.committed += 1
                if self.metrics is not None:
                    c = self._commit_counters.get(e.op)
                    if c is None:
                        c = self._commit_counters[e.op] = self.metrics.commits.labels(e.op)
                    c.inc()
                return
            except TransientError as err:
                self.retries += 1
                if err.code in NOT_SENT_CODES:
                    e.sent = was  # it never reached the control plane
                e.notify()
                if err.code == "write_error":  # the send broke: an outage, or this request alone?
                    if self._broken_send(e, err):
                        return
                elif err.code != "merge_contended":  # that one was answered: busy, not down
                    self._attempt_failed(err)
                else:
                    self._attempt_answered()
                if self.metrics is not None:
                    self.metrics.retries.inc()
                delay = self.backoff.delay(e.attempts, err.retry_after)
                log.info("commit deferred: transient failure, will retry",
                         extra={"entry": e.id, "op": e.op, "store": e.store,
                                "attempt": e.attempts, "status": err.status, "code": err.code,
                                "retry_in_s": round(delay, 3)})
                await self._back_off(delay, err)  # or sooner, once the control plane answers
            except Unauthorized as err:
                # an authentication outage (token revoked, expired, or rotated and not yet
                # re-read), not a refusal of this write: it stays first in the queue
                e.sent = was  # refused before anything was applied
                e.notify()
                self._token_refused(err)
                delay = self.backoff.delay(e.attempts)
                log.info("commit deferred: the control plane refused the token; will retry",
                         extra={"entry": e.id, "op": e.op, "store": e.store,
                                "attempt": e.attempts, "status": err.status, "code": err.code,
                                "retry_in_s": round(delay, 3)})
                await self._back_off(delay, err)  # or sooner: a new token, an answer
            except ApiError as err:
                if isinstance(err, TransientError):  # pragma: no cover - caught above
                    raise
                self._attempt_answered()
                if isinstance(err, StoreReplaced):  # the entries after it are refused unsent
                    self._unconfirmed.add(e.store)
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
                delay = self.backoff.delay(e.attempts, floor=0.05)
                log.exception("commit failed unexpectedly; will retry",
                              extra={"entry": e.id, "op": e.op, "store": e.store,
                                     "attempt": e.attempts, "retry_in_s": round(delay, 3)})
                await trio.sleep(delay)

    async def _apply(self, e: Entry, client: Any = None) -> None:
        """Send one entry to the control plane with the method for its ``op`` (through
        ``client``, default the committer's). Raises the client's ``ApiError``
        (``_commit_with_retry`` tells transient from permanent); an unknown ``op`` (a corrupt
        journal) is a permanent refusal."""
        apply = self._appliers.get(e.op)
        if apply is None:  # pragma: no cover - journal corruption
            raise local_refusal("validation_error", f"unknown outbox op {e.op!r}")
        with store_precondition(e.args.get(STORE_CREATED)):  # refused if another store now
            await apply(e, client if client is not None else self.client, e.args)

    async def _set_attrs(self, e: Entry, c: ApiClient, a: dict[str, Any]) -> None:
        """Set the mode and / or mtime of a record whose content the control plane has."""
        # mode / mtime of a file whose content the control plane has: no upload, no
        # If-Match (attributes merge with whatever content is current: last writer wins
        # per attribute); only the members that changed are sent
        rid, _ = self.ids.get(e.node_key, e.store)
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
        rid, _ = self.ids.get(e.node_key, e.store)
        e.record_id = rid
        if rid is not None:
            try:
                e.seq = await c.delete_record(e.store, rid, idempotency_key=e.key)
            except NotFound:
                pass
        self.ids.learn(e.node_key, None)
        if e.node_key is not None:
            self.resolver.set_merged(e.node_key, None)

    async def _move(self, e: Entry, c: ApiClient, a: dict[str, Any]) -> None:
        """Move one record to ``args["to"]``. The sidecar sends no ``replace`` for a target
        it knows (a rename over a record it has seen is a ``put`` of that record, merged like
        any write: ``NamespaceOps._rename_file_remote``); a target created elsewhere that
        this sidecar never saw is replaced (last writer wins), reported as a conflict (a
        line in ``errors.log``, ``memfuse_conflicts``): its content stays a version in the
        target's history. Entries journaled by earlier releases may still carry ``replace``."""
        rid, sha = self.ids.get(e.node_key, e.store)
        e.record_id = rid
        if rid is None:
            return  # never reached the server (refused earlier): nothing to move
        replace = bool(a.get("replace"))
        try:
            res = await c.move_record(e.store, rid, a["to"], replace=replace,
                                      idempotency_key=e.key)
        except Conflict as err:
            if err.code in ("parent_is_file", "path_is_directory"):
                raise  # a file and a directory of one name: refused for good
            self.resolver.conflict(e, "the target path was created elsewhere; this rename replaced "
                                      "it (last writer wins; its content is kept in the record's history)")
            log.warning("conflict: move target created elsewhere; replacing it",
                        extra={"store": e.store, "path": a["to"]})
            res = await c.move_record(e.store, rid, a["to"], replace=True,
                                      idempotency_key=e.key + "-lww")
        rec = res.records[0] if res.records else None
        e.record = rec
        self.ids.learn(e.node_key, rec)
        tk = a.get("target_key")
        if tk and tk != e.node_key:
            self.ids.forget(tk)

    async def _move_prefix(self, e: Entry, c: ApiClient, a: dict[str, Any]) -> None:
        """Move every record under ``args["from"]`` to ``args["to"]`` (a directory)."""
        res = await c.move_prefix(e.store, a["from"], a["to"], idempotency_key=e.key)
        e.moved = res.records
