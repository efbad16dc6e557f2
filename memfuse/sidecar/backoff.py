"""The sidecar's retry delay for its long-lived loops (change feeds, workspace events, store
loading, the prompt block, supervised tasks): ``Doubling``, one rule written once instead
of a ``delay = min(delay * 2, CAP)`` per loop.

The commit path has its own policy, with jitter (``committer.Backoff``): many sidecars
retry their commits against one control plane, and jitter keeps them from retrying in step.
The loops here wait for one answer each (a feed, a load), so their delays are deterministic.
"""
from __future__ import annotations

__all__ = ["Doubling"]


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

    def next(self) -> float:
        """The delay to wait now (s); the following one is twice as long, at most ``cap``."""
        d = self.delay
        self.delay = min(d * 2, self.cap)
        return d

    def reset(self) -> None:
        """Start again from ``first`` (the operation succeeded)."""
        self.delay = self.first
