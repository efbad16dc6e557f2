"""The total deadline of one control-plane request made by the sidecar (``bounded=True``
clients: ``ApiSession._request`` on the httpx path, ``lean.LeanHTTP.send`` on the lean one).

httpx's timeouts (and the lean path's) bound each connect, write and read, not the request:
an answer that arrives a byte every 0.2 s never trips a 30 s read timeout and holds its
caller forever (a sidecar start stayed unmounted that way). A bounded request must have

- its answer's head (status line and headers) within ``head`` seconds of being sent
  (``timeout``, plus the long poll's ``wait`` when it is one), and
- its body at ``MIN_BODY_RATE`` bytes/s at least after that: the deadline moves to
  ``body_start + timeout + received / MIN_BODY_RATE`` as bytes arrive, so a 100 MB snapshot
  page over a slow link is still fine and a drip is cut ``timeout`` s after its head.

A request past its deadline raises ``httpx.ReadTimeout`` (so ``TransientError``
``read_timeout`` for the caller, retried like any other read timeout). Streams (change and
event feeds) have their head bounded so, then each of their lines (a page or a heartbeat):
``read_timeout`` s from when it is awaited, moved on as its bytes arrive
(``stream.PageStream._lines``). One rule in one place: every path calls ``extend``. No trio import here
(the CLI's read commands import this module through ``base`` and never load trio); the
scope is any object with a ``deadline``: a ``trio.CancelScope`` (httpx path, streams) or the
lean path's ``lean._Bound`` (kept by the timer keeper, ``memfuse.timers``).
"""
from __future__ import annotations

from typing import Protocol

#: bytes/s an answer's body must arrive at, at least, once its head came (64 KiB/s)
MIN_BODY_RATE = 64 * 1024


class _Scope(Protocol):
    deadline: float


def extend(scope: _Scope, body_start: float, timeout: float, received: int) -> None:
    """Move ``scope``'s deadline to what ``received`` body bytes since ``body_start``
    (``trio.current_time()`` when the head arrived) allow: ``body_start + timeout +
    received / MIN_BODY_RATE``; never earlier than it is."""
    scope.deadline = max(scope.deadline, body_start + timeout + received / MIN_BODY_RATE)


def message(timeout: float) -> str:
    """The text of the ``httpx.ReadTimeout`` raised for a request cut at its deadline."""
    return (f"no complete answer within the request deadline ({timeout:g} s for the head, "
            f"then {MIN_BODY_RATE // 1024} KiB/s)")
