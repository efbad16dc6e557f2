"""Bounds of many short waits kept by one task, instead of a trio cancel scope per wait.

A trio ``CancelScope`` with a deadline costs ~58 k instructions to enter and leave (~10 us on
the benchmark machine: it registers its deadline with the run loop, links a cancel status and
unlinks both again), and the close path entered one per ``close(2)`` only to bound a wait
that, in the common case, ends long before its bound (``Entry.wait_accepted``: the journal's
30 s bound on a commit answered in milliseconds; bench/README.md, "The close path, session
16: sidecar"). A wait that is woken through an event it re-checks (a ``changed`` event
replaced at each wake-up) needs no cancellation to be bounded: it only needs someone to wake
it at its deadline. ``call_at(deadline, wake)`` arranges that: one *keeper* task per trio
run (a system task, started at the first call: no nursery to pass around, and it works in
any trio run, tests included) calls ``wake()`` once ``trio.current_time()`` reaches
``deadline``, unless the ``Timer`` was cancelled first (``Timer.cancel``: a flag, the usual
end of such a wait).

State invariants (``_Keeper``): ``heap`` holds every timer neither fired nor discarded,
ordered by (deadline, sequence); ``cancelled`` counts the cancelled timers still in it;
when it passes half the heap (and ``COMPACT_MIN``) the heap is rebuilt without them, so a
steady stream of waits that end early (one per close, each with a 30 s bound) holds memory in
proportion to the waits in progress, not to those of the last 30 s. The keeper sleeps until
the deadline of the first timer that was live when it last looked (``_sleeping_until``) and
is woken early only by a new timer due sooner than that; a timer cancelled meanwhile costs
it at most one wake-up at that deadline. ``wake`` callbacks run on the keeper task, never
raise into it (an exception is logged), and must not block.
"""
from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Callable

import trio

log = logging.getLogger("memfuse.timers")

#: timers below this count are never compacted (a rebuild would cost more than it frees)
COMPACT_MIN = 64


def _nothing() -> None:
    pass


class Timer:
    """One pending ``wake`` (``call_at``). ``cancel`` before the deadline: it never runs."""

    __slots__ = ("deadline", "wake", "cancelled", "fired", "_keeper")

    def __init__(self, deadline: float, wake: Callable[[], None], keeper: "_Keeper") -> None:
        self.deadline = deadline
        self.wake = wake
        self.cancelled = False
        self.fired = False
        self._keeper = keeper

    def cancel(self) -> None:
        """Never call ``wake`` (idempotent; a no-op once it ran)."""
        if not self.cancelled and not self.fired:
            self.cancelled = True
            self.wake = _nothing  # what it would wake is not kept alive until the deadline
            self._keeper.cancelled_one()


class _Keeper:
    """The one task of a trio run that calls the due ``wake``s (module docstring)."""

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, Timer]] = []
        self.cancelled = 0
        self.seq = 0
        self.fired = 0  # wakes called since start (tests, benchmarks)
        self._wakeup = trio.Event()
        self._sleeping_until = math.inf

    def add(self, deadline: float, wake: Callable[[], None]) -> Timer:
        t = Timer(deadline, wake, self)
        self.seq += 1
        heapq.heappush(self.heap, (deadline, self.seq, t))
        if deadline < self._sleeping_until:
            self._sleeping_until = deadline
            self._wakeup.set()
        return t

    def cancelled_one(self) -> None:
        self.cancelled += 1
        if self.cancelled > COMPACT_MIN and self.cancelled * 2 > len(self.heap):
            self.heap = [x for x in self.heap if not x[2].cancelled]
            heapq.heapify(self.heap)
            self.cancelled = 0

    def _due(self, now: float) -> list[Timer]:
        """Pop the timers due at ``now`` (live ones returned) and the cancelled ones on top."""
        out: list[Timer] = []
        heap = self.heap
        while heap and (heap[0][2].cancelled or heap[0][0] <= now):
            t = heapq.heappop(heap)[2]
            if t.cancelled:
                self.cancelled -= 1
            else:
                t.fired = True
                out.append(t)
        return out

    async def run(self) -> None:
        while True:
            for t in self._due(trio.current_time()):
                self.fired += 1
                try:
                    t.wake()
                except Exception:
                    log.exception("a timer's wake-up failed")
            self._sleeping_until = self.heap[0][0] if self.heap else math.inf
            self._wakeup = trio.Event()
            with trio.move_on_at(self._sleeping_until):
                await self._wakeup.wait()


_KEEPER: trio.lowlevel.RunVar[_Keeper] = trio.lowlevel.RunVar("memfuse_timers")


def keeper() -> _Keeper:
    """The current trio run's keeper, started at the first call (a system task: cancelled
    when the run ends)."""
    try:
        return _KEEPER.get()
    except LookupError:
        k = _Keeper()
        _KEEPER.set(k)
        trio.lowlevel.spawn_system_task(k.run, name="memfuse.timers")
        return k


def call_at(deadline: float, wake: Callable[[], None]) -> Timer:
    """Call ``wake()`` on the keeper task once ``trio.current_time()`` reaches ``deadline``
    (soon after: one loop pass), unless the returned ``Timer`` is cancelled first. Must be
    called from the trio thread, inside a run. ``wake`` must not raise or block: it is meant
    to set an event that a bounded wait re-checks (``Entry.wait_accepted``)."""
    return keeper().add(deadline, wake)


__all__ = ["Timer", "call_at", "keeper"]
