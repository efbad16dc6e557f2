"""Secret scans of large contents run before a write reaches the writer thread, each charged
to its token's scan budget (attack18 F5).

``memfuse.server.writerthread.WriterThread`` runs every lean record write of a replica, one at a
time, and every write of any front door holds the database's write lock (SQLite: one writer).
A write's secret scan (``memfuse.content.find_secret``: each base64 / hex run decoded and
scanned again) costs about 1.1 s per MiB of adversarial content, so a batch of forty 1 MiB
records made of base64 runs held that one thread for ~45 s and another workspace's 3-byte write
waited 93 s. So:

- ``prescanned(texts, appends=..., ...)`` scans all the contents and appends of a request whose
  strings sum to ``PRESCAN_MIN`` characters or more (a batch of 100 contents of 65,000
  characters each is one: attack19 F1), each append with the context the scan reads before
  the suffix (``RecordsService.append_context``, read then), in a worker thread of anyio's
  pool first, one request of a token at a time, and keeps the verdicts in a context variable
  for the write (the writer thread runs a job in a copy of the submitter's context).
- ``find_secret(text, key, budget)`` is what the write path calls instead of
  ``content.find_secret``: the verdict kept for that text, else the scan, charged to ``key``
  when the text has ``CHARGE_MIN`` characters or more. An append's: ``append_verdict``
  before the write lock (kept, else the context read and the scan run there, in the
  request's thread), ``find_append_secret`` under it (that verdict when the context read
  there is the one scanned, else the scan).
- Every scan of ``CHARGE_MIN`` characters or more, wherever it runs (the writer thread,
  the FastAPI routes, the memory tool, the console scan in their own worker thread), is
  charged to its token's ``ScanBudget``
  (``memfuse.server.scanbudget``): a token whose budget is spent gets 429 ``rate_limited``
  with ``Retry-After`` before any more of its scans run.

The scan still holds the GIL, so the writer thread shares the interpreter with it (a switch
every ``sys.getswitchinterval()``, 5 ms) instead of waiting for the whole of it.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import AbstractAsyncContextManager
from contextvars import ContextVar
from dataclasses import dataclass, field

import anyio

from memfuse import content as content_rules
from memfuse.server.base import Principal, ServiceError
from memfuse.server.scanbudget import ScanBudget

#: requests whose contents and append suffixes sum to less than this (characters) are scanned
#: where they are written, in the writer thread: a hop to a worker thread costs more than the
#: scan of prose (~11 ms per MiB), and the worst content (~1.1 s per MiB of base64 runs) holds
#: the writer at most ~18 ms (attack20 F1: at 64 Ki characters, 70 ms a write, and sixteen
#: connections of one token kept the writer busy: another workspace's write waited p50 0.42 s)
PRESCAN_MIN = 16 * 1024
#: contents (and appends, with their context) of this many characters or more are charged to
#: their token's scan budget wherever they are scanned (attack20 F1: under ``PRESCAN_MIN``
#: they were not, so a token's scans in the writer thread had no bound but the write rate);
#: a smaller one's worst scan (~1 ms) costs no more than the write itself, which the write
#: buckets bound, and is not charged (the lookup and two clock reads would be most of it)
CHARGE_MIN = 1024


@dataclass
class _Kept:
    """The verdicts of the current write's large scans: content → ``find_secret``'s answer;
    an append's suffix → (the context scanned before it, the answer for context + suffix)."""

    contents: dict[str, str | None] = field(default_factory=dict)
    appends: dict[str, tuple[str, str | None]] = field(default_factory=dict)


_KEPT: ContextVar[_Kept | None] = ContextVar("memfuse_prescanned", default=None)


def scan_key(p: Principal) -> str:
    """The key of ``p``'s scan budget: its database token, else (a static token) its
    account, workspace and name."""
    return p.token_id or f"static\0{p.account}\0{p.workspace}\0{p.name}"


SCAN_DETAIL = ("this token's writes take more secret scanning than the control plane "
               "allows one token; retry after the time in Retry-After")


def refusal(e: ScanBudget.Refused, detail: str = SCAN_DETAIL) -> ServiceError:
    """The API's answer to a spent budget of a token (its scans; ``detail`` another's, the
    writer time of ``memfuse.server.writertime``): 429 ``rate_limited`` with ``Retry-After``."""
    return ServiceError(429, "rate_limited", detail, headers={"Retry-After": str(e.retry_after)})


def _charged(budget: ScanBudget | None, key: str | None, text: str, always: bool = False,
             alone: bool = False) -> str | None:
    """``content.find_secret(text)``, charged to ``key`` when it has ``CHARGE_MIN``
    characters or more, or ``always`` (a prescan's: part of a large request) (429 raised
    when its budget is spent). ``alone`` (the caller holds no database lock): a text of
    ``PRESCAN_MIN`` characters or more waits for the token's other such scan in another
    thread first (``_one_scan_of_token``)."""
    if budget is None or key is None or (len(text) < CHARGE_MIN and not always):
        return content_rules.find_secret(text)
    if alone and len(text) >= PRESCAN_MIN:
        with _one_scan_of_token(key):
            return _budgeted(budget, key, content_rules.find_secret, text)
    return _budgeted(budget, key, content_rules.find_secret, text)


#: seconds a thread waits at most for its token's other large scan (``_one_scan_of_token``);
#: past it the write is refused 429 ``rate_limited`` (Retry-After 1): the token has that many
#: seconds of scanning queued, which its budget would refuse anyway
SCAN_WAIT = 30.0
# token key → (the lock of its large scans in threads, the threads holding or waiting for it).
# INVARIANT: the count is ≥ 1; the entry is removed when it would reach 0. GUARDED_BY(_SCANS_LOCK)
_THREAD_SCANS: dict[str, tuple[threading.Lock, int]] = {}
_SCANS_LOCK = threading.Lock()


@contextlib.contextmanager
def _one_scan_of_token(key: str) -> Iterator[None]:
    """One large scan of token ``key`` at a time across the threads of the faces that scan
    where they run, outside the database's locks (the memory tool, the memory-store API, MCP,
    the FastAPI routes: attack20 F2, eight threads of one token each scanning 900 KB of
    base64 runs took the GIL from the writer thread and another workspace's write waited
    p50 0.59 s; the lean routes' :func:`prescanned` already ran one at a time). Waits at most
    ``SCAN_WAIT`` s, then raises ``ServiceError`` 429."""
    with _SCANS_LOCK:
        lock, n = _THREAD_SCANS.get(key) or (threading.Lock(), 0)
        _THREAD_SCANS[key] = (lock, n + 1)
    try:
        if not lock.acquire(timeout=SCAN_WAIT):
            raise refusal(ScanBudget.Refused(1))
        try:
            yield
        finally:
            lock.release()
    finally:
        with _SCANS_LOCK:
            lock, n = _THREAD_SCANS[key]
            if n > 1:
                _THREAD_SCANS[key] = (lock, n - 1)
            else:
                del _THREAD_SCANS[key]


def _budgeted(budget: ScanBudget, key: str, scan: Callable[..., str | None], *args: str) -> str | None:
    """``scan(*args)`` charged to ``key``'s ``budget``; ``ServiceError`` 429 when it is spent."""
    try:
        return budget.scan(key, scan, *args)
    except ScanBudget.Refused as e:
        raise refusal(e) from None


def find_secret(text: str, key: str | None = None, budget: ScanBudget | None = None, *,
                alone: bool = False) -> str | None:
    """``memfuse.content.find_secret(text)``, taken from the verdicts :func:`prescanned`
    kept when it scanned ``text`` (same answer: the same function on the same text), else
    scanned here (charged to ``key``'s ``budget`` from ``CHARGE_MIN`` characters on:
    ``ServiceError`` 429 when it is spent). ``alone``: the caller holds no database lock, so
    a scan of ``PRESCAN_MIN`` characters or more waits for the token's other one in another
    thread (``_one_scan_of_token``; never under a lock: everyone would wait with it)."""
    kept = _KEPT.get()
    if kept is not None:
        try:
            return kept.contents[text]
        except KeyError:
            pass
    return _charged(budget, key, text, alone=alone)


def append_verdict(suffix: str, read_context: Callable[[], str | None], key: str | None = None,
                   budget: ScanBudget | None = None) -> tuple[str, str | None] | None:
    """For an append of a large ``suffix`` (``PRESCAN_MIN`` characters or more): (the
    context scanned before it, the verdict of context + suffix), the one :func:`prescanned`
    kept, else scanned now after ``read_context()`` (None: no such record, nothing
    scanned), charged to ``key``'s ``budget`` (``ServiceError`` 429 when it is spent).
    None for a small suffix: scanned by the write itself."""
    kept = _KEPT.get()
    if kept is not None:
        got = kept.appends.get(suffix)
        if got is not None:
            return got
    if len(suffix) < PRESCAN_MIN:
        return None
    context = read_context()
    if context is None:
        return None
    return context, _charged(budget, key, context + suffix, alone=True)


def find_append_secret(context: str, suffix: str, pre: tuple[str, str | None] | None,
                       scan: Callable[[], str | None], key: str | None = None,
                       budget: ScanBudget | None = None) -> str | None:
    """The verdict of ``context + suffix`` (an append, under the write lock): ``pre``'s
    (:func:`append_verdict`) when it was scanned after this very ``context``, else
    ``scan()`` (the write path's ``AppendScans.find_secret``), charged to ``key``'s
    ``budget`` when ``context + suffix`` has ``CHARGE_MIN`` characters or more
    (``ServiceError`` 429 when it is spent)."""
    if pre is not None and pre[0] == context:
        return pre[1]
    if len(context) + len(suffix) < CHARGE_MIN or budget is None or key is None:
        return scan()
    return _budgeted(budget, key, scan)


# tokens with a prescan running, each with the lock its next prescan waits on (event loop
# only). INVARIANT: the count is the prescans of that key waiting or running (≥ 1); the entry
# is removed when it would reach 0
_RUNNING: dict[str, tuple[anyio.Lock, int]] = {}


def _scan_all(texts: list[str], appends: list[tuple[str, str]],
              context_of: Callable[[str], str | None] | None,
              key: str | None, budget: ScanBudget | None) -> _Kept:
    kept = _Kept()
    for t in texts:
        if t not in kept.contents:
            kept.contents[t] = _charged(budget, key, t, always=True)
    for record_id, suffix in appends:
        context = context_of(record_id) if context_of is not None else None
        if context is not None:  # no such record: the write refuses it, nothing to scan
            kept.appends[suffix] = (context, _charged(budget, key, context + suffix, always=True))
    return kept


def prescanned(texts: Iterable[object], *, appends: Iterable[tuple[str, object]] = (),
               context_of: Callable[[str], str | None] | None = None,
               p: Principal | None = None, budget: ScanBudget | None = None) -> AbstractAsyncContextManager[None]:
    """An async context manager: when the strings of ``texts`` and the suffixes of ``appends``
    ``(record_id, suffix)`` sum to ``PRESCAN_MIN`` characters or more, it scans all of them
    (each suffix after the context ``context_of(record_id)`` gives: None skips it), in a
    worker thread (``anyio.to_thread.run_sync``, cancellable: the scan is abandoned, not
    waited for, when the request is cancelled), and keeps their verdicts for
    :func:`find_secret` / :func:`find_append_secret` inside the ``async with``; a smaller
    request is left to the write (a shared context manager that does nothing: no generator,
    no context manager made per write on the event loop). Other items (None, dicts, empty
    strings) are skipped. With ``p`` and ``budget``: one prescan of ``p``'s token at a time
    (the next waits here, on the event loop), each scan charged to its budget; raises
    ``ServiceError`` 429 ``rate_limited`` (with ``Retry-After``) when it is spent, before
    the next scan runs."""
    big = [t for t in texts if isinstance(t, str) and t]
    more = [(r, s) for r, s in appends if isinstance(s, str) and s]
    # one rule: a request whose strings sum to PRESCAN_MIN characters or more is scanned
    # here, all of it, so the writer thread never scans more than PRESCAN_MIN characters
    # of one request (attack19 F1: a batch of 100 contents of 65,000 characters each)
    if sum(map(len, big)) + sum(len(s) for _, s in more) < PRESCAN_MIN:
        return _NOTHING
    return _prescanned(big, more, context_of, p, budget)


#: ``prescanned``'s answer for a request too small to scan first (reusable: it holds nothing)
_NOTHING: AbstractAsyncContextManager[None] = contextlib.nullcontext()


@contextlib.asynccontextmanager
async def _prescanned(big: list[str], more: list[tuple[str, str]],
                      context_of: Callable[[str], str | None] | None,
                      p: Principal | None, budget: ScanBudget | None) -> AsyncIterator[None]:
    """``prescanned``'s scans of ``big`` (the contents) and ``more`` (the appends), kept
    for the ``async with``."""
    key = scan_key(p) if p is not None and budget is not None else None
    if key is None:
        kept = await anyio.to_thread.run_sync(_scan_all, big, more, context_of, None, None,
                                              abandon_on_cancel=True)
    else:
        lock, n = _RUNNING.get(key) or (anyio.Lock(), 0)
        _RUNNING[key] = (lock, n + 1)
        try:
            async with lock:
                kept = await anyio.to_thread.run_sync(_scan_all, big, more, context_of, key, budget,
                                                      abandon_on_cancel=True)
        finally:
            lock, n = _RUNNING[key]
            if n > 1:
                _RUNNING[key] = (lock, n - 1)
            else:
                del _RUNNING[key]
    token = _KEPT.set(kept)
    try:
        yield
    finally:
        _KEPT.reset(token)
