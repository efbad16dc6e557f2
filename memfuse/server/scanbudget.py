"""Each token's budget of secret-scan work on a replica (attack18 F5).

A write's secret scan (``memfuse.content.find_secret``) costs from ~11 ms per MiB of prose to
~1.1 s per MiB of adversarial content (base64 runs, each decoded and scanned again). The
front door's write buckets (``memfuse.server.gate.WriteRate``) bound a token's body bytes,
16 MiB/s in bursts of 256 MiB: hundreds of seconds of scan CPU a token could ask for at once
on a machine with 2 CPUs. So every scan of ``memfuse.server.prescan.CHARGE_MIN`` characters
or more (the smaller ones cost no more than their request: attack20 F1 showed that leaving the
scans under ``PRESCAN_MIN``, done in the writer thread, uncharged let one token keep that
thread busy) is charged, in CPU seconds measured on the scanning thread
(``time.thread_time``), to a bucket of its token: ``SCAN_RATE`` seconds a second, bursts of
``SCAN_BURST``. A token whose bucket is empty (in debt after its last scan) is refused its
next charged scan with 429 ``rate_limited`` and ``Retry-After`` (the
seconds until the bucket is back above zero) before any of it runs; a scan that starts runs
to its end (its cost is known only then), so a token's debt is at most one scan past its
bucket. Prose never meets the bound: 0.25 s of scan a second is ~22 MiB/s of prose, past the
write buckets' 16 MiB/s.

Thread safety: the table is changed under one lock (scans run on worker threads).
"""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["SCAN_RATE", "SCAN_BURST", "ScanBudget"]

T = TypeVar("T")

#: CPU seconds of secret scans one token may make a replica do, a second
SCAN_RATE = 0.25
#: the most it may ask for at once (CPU seconds; a new or idle token starts full)
SCAN_BURST = 5.0
#: tokens kept at most (past it, the ones whose bucket has filled again are forgotten)
KEYS_MAX = 10_000


class ScanBudget:
    """``wait(key)``: 0 when ``key``'s bucket allows a charged scan now, else the seconds
    until it does; ``charge(key, seconds)`` takes a scan's CPU seconds from it (the bucket
    may go below zero: the debt is paid before the next scan). ``scan(key, fn, *args)``
    does both around ``fn(*args)`` and returns its result, or raises ``Refused`` (with
    ``retry_after``, whole seconds ≥ 1) without calling it. ``clock``: monotonic seconds
    (default ``time.monotonic``)."""

    class Refused(Exception):
        """The token's scan budget is spent; ``retry_after``: whole seconds (≥ 1) to wait."""

        def __init__(self, retry_after: int) -> None:
            super().__init__(f"scan budget spent; retry after {retry_after} s")
            self.retry_after = retry_after

    def __init__(self, rate: float = SCAN_RATE, burst: float = SCAN_BURST,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = float(rate), float(burst), clock
        # INVARIANT: key → (level in CPU seconds, at: the clock when it was that);
        # level ≤ burst. GUARDED_BY(_lock)
        self._levels: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()
        self.charged = 0.0  # CPU seconds charged in all (tests, metrics)
        self.refused = 0  # scans refused in all

    def _level(self, key: str, now: float) -> float:
        level, at = self._levels.get(key, (self.burst, now))
        level += (now - at) * self.rate
        return level if level < self.burst else self.burst

    def wait(self, key: str) -> float:
        """Seconds until ``key`` may start a charged scan (0: now)."""
        now = self.clock()
        with self._lock:
            level = self._level(key, now)
        return 0.0 if level >= 0 else -level / self.rate

    def charge(self, key: str, seconds: float) -> None:
        """Take ``seconds`` (CPU seconds of a scan that ran) from ``key``'s bucket."""
        now = self.clock()
        with self._lock:
            self.charged += seconds
            self._levels[key] = (self._taken(key, self._level(key, now), seconds, now), now)
            if len(self._levels) > KEYS_MAX:
                for k, (lv, at) in list(self._levels.items()):
                    if lv + (now - at) * self.rate >= self.burst:
                        del self._levels[k]

    def _taken(self, key: str, level: float, seconds: float, now: float) -> float:
        """``key``'s level after a charge of ``seconds`` from ``level`` at ``now`` (under
        ``_lock``): all of it here; subclasses may take less (``writertime.WriterTime``)."""
        return level - seconds

    def scan(self, key: str, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` charged to ``key`` (its CPU time on this thread); raises
        ``ScanBudget.Refused`` without calling it when ``key``'s bucket is spent, and
        whatever ``fn`` raises (charged too)."""
        wait = self.wait(key)
        if wait > 0:
            with self._lock:
                self.refused += 1
            raise ScanBudget.Refused(max(1, math.ceil(wait)))
        start = time.thread_time()
        try:
            return fn(*args)
        finally:
            self.charge(key, time.thread_time() - start)
