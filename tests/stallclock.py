"""The test process's own stalls, to take off the times a test measures (a stall clock).

A test that bounds the time something took, measured by this process (``time.monotonic()``
before and after), also measures every moment this process itself stood still meanwhile: a
garbage collection of the whole suite's heap (CI runs ~1,800 tests in one process), the
test's own synchronous work, the process descheduled on a loaded 2-CPU machine. Such a stall
is the test's, not the time of what is measured (a server in another process, a mount's
answer); counted, it failed bounds of 2-3 s (CI of f073dc5: one ``/healthz`` at 2.44 s that
was the test's own pause, test_hostile).

A clock ticks every ``TICK`` s and notes how late each tick woke: a tick late by more than
``TICK`` is a stall of this process, ``(end, late)``, a span of ``late`` s ending at ``end``
(``time.monotonic()``). ``Stalls.own(t0, t1)`` is the part of the stalls inside [t0, t1],
``Stalls.time(t0, t1)`` the time from ``t0`` to ``t1`` less that: what the thing measured
took. Both clocks measure with ``time.monotonic()`` (not ``trio.current_time()``, whose
origin differs): time what is bounded with it too.

- ``loop_stalls()`` (trio tests): a task of the test's event loop, which sees anything that
  keeps the loop from running (GC, a blocking call in the test, the process descheduled);
- ``thread_stalls()`` (synchronous tests, and trio tests whose server runs in this process):
  a daemon thread, which sees what holds the GIL (GC) or stops the process, not the main
  thread blocked in a system call (that is the measured thing's own waiting), nor an event
  loop kept busy or blocked by its own code: a server in this process that blocks its loop
  is slow, and must stay so (``loop_stalls`` would excuse it). But it does count one call
  that holds the GIL throughout (a long regular-expression match, any C code that does not
  let go of it) as a stall: never bound CPU-bound work of the product in this process with
  it (test_content's linear-time bound of ``find_secret`` measures as seen: 15x headroom).

Only ever subtract: a lower bound (something waited *at least* so long) needs no stall
clock, a stall only lengthens what the test sees.
"""
from __future__ import annotations

import threading
import time
from contextlib import asynccontextmanager, contextmanager
from typing import AsyncIterator, Iterator

TICK = 0.01  # s: the period of the clocks


class Stalls:
    """This process's stalls seen by a clock: ``spans``, ``(end, late)`` each."""

    def __init__(self, tick: float = TICK) -> None:
        self.spans: list[tuple[float, float]] = []
        self.tick = tick
        #: when the tick under way should end (None: none under way). A tick that has not
        #: woken yet counts as late since then: right after a stall the measuring code may
        #: run before the clock does (the thread clock waits for the GIL, the loop clock's
        #: task for its turn), and its stall would not be seen yet
        self.due: float | None = None
        self._lock = threading.Lock()  # a tick's end noted at once (the thread clock)

    def start(self, t0: float) -> None:
        """A tick begins at ``t0``."""
        self.due = t0 + self.tick

    def note(self, t0: float, t1: float, tick: float) -> None:
        """A tick asked to sleep ``tick`` s from ``t0`` woke at ``t1``."""
        late = t1 - t0 - tick
        with self._lock:
            if late > tick:
                self.spans.append((t1, late))
            self.due = None

    def own(self, t0: float, t1: float) -> float:
        """The seconds of this process's stalls inside [t0, t1]."""
        with self._lock:
            spans = list(self.spans)
            due = self.due
        if due is not None:
            now = time.monotonic()
            if now - due > self.tick:
                spans.append((now, now - due))  # the tick under way, late so far
        return sum(max(0.0, min(t1, end) - max(t0, end - late)) for end, late in spans)

    def time(self, t0: float, t1: float) -> float:
        """The time from ``t0`` to ``t1`` less this process's own stalls within it."""
        return (t1 - t0) - self.own(t0, t1)

    def since(self, t0: float) -> float:
        """``time(t0, now)``."""
        return self.time(t0, time.monotonic())

    def worst(self, n: int = 10, above: float = 0.1) -> list[tuple[float, float]]:
        """The first ``n`` stalls longer than ``above`` s, rounded (for assertion messages)."""
        return [(round(end, 3), round(late, 3)) for end, late in self.spans if late > above][:n]


def server_time(t0: float, t1: float, stalls: list[tuple[float, float]]) -> float:
    """The time from ``t0`` to ``t1`` less the stalls ``(end, late)`` within it."""
    st = Stalls()
    st.spans = stalls
    return st.time(t0, t1)


@asynccontextmanager
async def loop_stalls(tick: float = TICK) -> AsyncIterator[Stalls]:
    """A clock on the test's trio event loop for the block's duration."""
    import trio

    st = Stalls(tick)

    async def clock() -> None:
        while True:
            t0 = time.monotonic()
            st.start(t0)
            await trio.sleep(tick)
            t1 = time.monotonic()
            st.note(t0, t1, tick)

    try:
        async with trio.open_nursery() as n:
            n.start_soon(clock)
            try:
                yield st
            finally:
                n.cancel_scope.cancel()
    finally:
        st.due = None  # the clock has stopped: no tick under way


@contextmanager
def thread_stalls(tick: float = TICK) -> Iterator[Stalls]:
    """A clock on a thread of this process for the block's duration."""
    st = Stalls(tick)
    stop = threading.Event()

    def clock() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            st.start(t0)
            stop.wait(tick)
            t1 = time.monotonic()
            st.note(t0, t1, tick)

    t = threading.Thread(target=clock, name="stall clock", daemon=True)
    t.start()
    try:
        yield st
    finally:
        stop.set()
        t.join(5)
        st.due = None
