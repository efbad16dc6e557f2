"""The sidecar's retry delay for its long-lived loops (change feeds, workspace events, store
loading, the prompt block, supervised tasks): ``Doubling``, one rule written once instead
of a ``delay = min(delay * 2, CAP)`` per loop.

The commit path has its own policy, with jitter (``committer.Backoff``): many sidecars
retry their commits against one control plane, and jitter keeps them from retrying in step.
The loops here wait for one answer each (a feed, a load), so their delays are deterministic.
"""
from __future__ import annotations

__all__ = ["Doubling", "RETRY_AFTER_MAX"]

#: the longest wait (s) a server's ``Retry-After`` makes these loops take (the committer's
#: ``Backoff.cap`` default): a control plane asking for an hour is not left unasked an hour
RETRY_AFTER_MAX = 30.0


class Doubling:
    """A retry delay in seconds: ``first``, doubled after each wait up to ``cap``, back to
    ``first`` on ``reset()`` (after a success).

    ``delay`` is the next wait (what a log line's ``retry_in_s`` shows); ``next()`` returns
    it and doubles it for the wait after. Not thread-safe (one loop owns one)."""

    __slots__ = ("first", "cap", "delay")

    def __init__(self, first: float, cap: float) -> None:
        if not 0 < first <= cap:
            raise ValueError(f"need 0 < first <= cap, got first={first}, cap={cap}")
        self.first = first
        self.cap = cap
        self.delay = first

    def next(self, retry_after: float | None = None) -> float:
        """The delay to wait now (s); the following one is twice as long, at most ``cap``.
        ``retry_after``: the server's ``Retry-After`` (s) of the failure waited for, if it
        gave one: the wait is at least that, itself at most ``RETRY_AFTER_MAX`` (RFC 9110
        §10.2.3; the commit path's rule, ``committer.Backoff``, caps it alike)."""
        d = self.delay
        self.delay = min(d * 2, self.cap)
        if retry_after is not None and retry_after == retry_after:  # not NaN
            d = max(d, min(retry_after, RETRY_AFTER_MAX))
        return d

    def reset(self) -> None:
        """Start again from ``first`` (the operation succeeded)."""
        self.delay = self.first
