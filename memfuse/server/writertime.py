"""Each token's budget of time holding the database's writer (attack21 F2).

SQLite has one writer: every write transaction of the control plane holds it, one at a time
(``memfuse.server.db.Database``: ``_write_lock``, then ``BEGIN IMMEDIATE``), and the lean
record writes also run one at a time on the writer thread (``memfuse.server.writerthread``).
The front door's write buckets (``memfuse.server.gate.WriteRate``) bound a token's requests
and body bytes, not what a write costs the writer: a prefix move's body is a few dozen
bytes and holds the writer ~0.2 ms per record (~2 s for 9,900 records, ~4 s at
``PREFIX_MOVE_MAX``). One token looping moves ``a → b → a`` kept the writer busy and another
workspace's single creates went from p50 5 ms to p50 1.9 s (attack21). Batches, restores,
big imports and appends to huge records are the same kind.

So each write transaction of a request is timed where it holds the writer and the time is
charged to the request's token: ``Database.write`` and ``Database.write_conn`` (the one place
every write of both engines runs; SQLite: from taking the write lock to the end of the commit,
the full-text drain and WAL checkpoint that follow a commit left out: they are the work of
earlier writes of any token; PostgreSQL: the write transaction, connection checkout to commit).
The bucket (a ``memfuse.server.scanbudget.ScanBudget`` under other numbers): ``WRITER_RATE``
seconds a second, bursts of ``WRITER_BURST``. A token whose bucket is in debt is refused
its next write with 429 ``rate_limited`` and ``Retry-After`` (the seconds until the bucket is
back above zero; ``prescan.refusal``, the same answer as the scan budget's):

- at the front door, before the body is read or the write queues (``Gate``: the same step as
  the write buckets, for every ``/v1/`` write);
- at the request's first write transaction, once it holds the writer's lock and before it
  does anything (``Charge.enter``): the face the front door does not check (``/mcp``, whose
  calls read and write through one ``POST``) and the writes of one token that passed the
  front door together while its bucket was still full and queued at the lock. A
  request's later transactions (a retry of ``Writer.write``, the second transaction of a
  multi-step write) are charged, never refused: a write is not cut half-way.

The buckets are work-conserving (``WriterTime``): they apply only while the writer is shared,
i.e. another token was charged within ``SHARED_WINDOW`` s. A token alone on the writer is never
refused and is not put in debt (its charges take its bucket to zero at most), so one agent's
``cp -r`` of 10,000 files, a lone import or one sidecar's backlog drain runs at the writer's
full speed; the share below is what it is held to once another tenant writes.

A transaction that starts runs to its end (its cost is known only then), so a token's debt is
at most one transaction (per writer it may run at once: one on SQLite) past its bucket.

The numbers (writer seconds charged, measured in process on this 2-CPU machine, client in
the same process, load ~4: bench/README.md "Writer time"): a prefix move of 10,000 records
1.6-2.6 s, a batch of 100 small creates ~75 ms (0.75 ms a record), a single create ~2 ms
(the client's share of the interpreter included). ``WRITER_BURST`` = 10 s: a token's
bucket is refused only when in debt before a write starts, so one move of
``PREFIX_MOVE_MAX`` (20,000 records, ~4-5 s) always goes, and a sidecar's backlog drain after
an outage (batches of 100: 10,000 queued records ≈ 7.5 s) goes at full speed. ``WRITER_RATE``
= 0.25 s a second (the scan budget's rate): once its burst is spent a token holds the writer
at most a quarter of the time, so another workspace's write meets one of its long writes at
most one time in four; it still writes ~330 records a second in batches of 100, or ~125
single creates a second at 2 ms each (a sidecar's commits of one agent are a few a second).
A token writing flat out past its burst (batches at the write buckets' 500 requests or 16 MiB
a second are far more than the writer takes) is slowed to that share with 429s; its client
waits ``Retry-After`` and sends the write again (the sidecar's committer does: nothing is
lost). Every figure is writer time, not CPU: a loaded machine makes every write slower and
every token's charge higher alike.

The root admin token (``Principal.root_token``: the operator's, which restores and imports
whole deployments and can stop the server anyway) is not charged or refused; an account's
admin token and every workspace token are, each under its own key (``prescan.scan_key``).
Writes outside a request (the expiry sweep, consolidation's jobs) and the console's (a
session cookie, no token at the front door) have no charge.

Thread safety: ``WriterTime`` is ``ScanBudget``'s (one lock); a ``Charge`` belongs to one
request, whose transactions run one after another.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING

from memfuse.server.scanbudget import ScanBudget

if TYPE_CHECKING:
    from memfuse.server.base import Principal, ServiceError

__all__ = ["WRITER_RATE", "WRITER_BURST", "SHARED_WINDOW", "WriterTime", "Charge", "CURRENT", "charge_of", "refusal"]

#: seconds of the writer one token may hold, a second
WRITER_RATE = 0.25
#: the most it may hold at once (seconds; a new or idle token starts full)
WRITER_BURST = 10.0
#: seconds after another token's write during which the writer counts as shared (the budget
#: applies); past it a token alone on the writer is neither charged into debt nor refused
SHARED_WINDOW = 10.0

DETAIL = ("this token's writes hold the database's writer longer than the control plane "
          "allows one token; retry after the time in Retry-After")


class WriterTime(ScanBudget):
    """Each token's bucket of writer seconds: ``ScanBudget``'s (``wait``, ``charge``) at
    ``WRITER_RATE`` / ``WRITER_BURST`` by default, work-conserving: the buckets apply only
    while the writer is shared, i.e. another key was charged within ``shared_window`` s
    (``SHARED_WINDOW``). A token alone on the writer is never refused and its charges take its
    bucket down to zero at most, never into debt: a lone agent's ``cp -r`` of 10,000 files or a
    lone import runs at the writer's full speed. Once another token writes, the next charges
    of a token count in full, and a token in debt is refused until its bucket is back above
    zero, so a second tenant waits behind at most one long write in four."""

    def __init__(self, rate: float = WRITER_RATE, burst: float = WRITER_BURST,
                 clock: Callable[[], float] = time.monotonic, shared_window: float | None = None) -> None:
        super().__init__(rate, burst, clock)
        self.shared_window = SHARED_WINDOW if shared_window is None else float(shared_window)
        # INVARIANT: ``_last`` is (key, clock) of the latest charge, ``_other`` of the latest
        # charge by a key other than ``_last``'s (so the latest charge by any key other than
        # ``k`` is ``_last`` when ``k`` is not ``_last``'s key, else ``_other``). GUARDED_BY(_lock)
        self._last: tuple[str, float] | None = None
        self._other: tuple[str, float] | None = None

    def _shared(self, key: str, now: float) -> bool:
        """Whether a key other than ``key`` was charged within ``shared_window`` s. Under ``_lock``."""
        seen = self._last if self._last is not None and self._last[0] != key else self._other
        return seen is not None and now - seen[1] <= self.shared_window

    def wait(self, key: str) -> float:
        """Seconds until ``key`` may start a write transaction (0: now; always 0 while no
        other key was charged within ``shared_window``)."""
        now = self.clock()
        with self._lock:
            if not self._shared(key, now):
                return 0.0
            level = self._level(key, now)
        return 0.0 if level >= 0 else -level / self.rate

    def _taken(self, key: str, level: float, seconds: float, now: float) -> float:
        """A charge of ``seconds`` (writer time that ran, ``ScanBudget.charge``): in full while
        the writer is shared, else down to zero at most (a debt it had stays, and refills);
        the charge is noted as ``key``'s latest. Under ``_lock``."""
        after = level - seconds
        if after < 0 and not self._shared(key, now):
            after = min(level, 0.0)
        if self._last is None or self._last[0] != key:
            self._other = self._last
        self._last = (key, now)
        return after

    def refused_now(self, key: str) -> ServiceError | None:
        """None when ``key`` may write now, else the 429 to answer (counted in ``refused``)."""
        wait = self.wait(key)
        if wait <= 0:
            return None
        with self._lock:
            self.refused += 1
        return refusal(wait)


def refusal(wait: float) -> ServiceError:
    """The API's 429 ``rate_limited`` for a token whose writer time is spent for ``wait`` s."""
    from memfuse.server import prescan  # prescan imports base, which imports db, which imports this

    return prescan.refusal(ScanBudget.Refused(max(1, math.ceil(wait))), DETAIL)


class Charge:
    """One request's account of writer time: its token's ``key`` in ``budget``. ``enter()``
    at each write transaction once it holds the writer (raises the 429 at the first when the
    bucket is in debt), ``leave(seconds)`` when it lets it go."""

    __slots__ = ("key", "budget", "entered")

    def __init__(self, key: str, budget: WriterTime) -> None:
        self.key, self.budget, self.entered = key, budget, False

    def enter(self) -> float:
        """The clock at the start of a write transaction; raises ``ServiceError`` 429 at the
        request's first when the token's bucket is in debt."""
        if not self.entered:
            self.entered = True
            refused = self.budget.refused_now(self.key)
            if refused is not None:
                raise refused
        return time.perf_counter()

    def leave(self, start: float) -> None:
        """Charge the time since ``start`` (``enter``'s)."""
        self.budget.charge(self.key, time.perf_counter() - start)


#: the current request's ``Charge`` (set by the front door for a write of a token; the app's
#: worker threads and the writer thread run in a copy of the request's context)
CURRENT: ContextVar[Charge | None] = ContextVar("memfuse_writer_time", default=None)


def charge_of(p: Principal, budget: WriterTime) -> Charge | None:
    """The ``Charge`` of a request of ``p`` (None for the root admin: not charged)."""
    if p.root_token:
        return None
    # ``prescan.scan_key(p)`` (its token's key), written out: not imported per write
    return Charge(p.token_id or f"static\0{p.account}\0{p.workspace}\0{p.name}", budget)
