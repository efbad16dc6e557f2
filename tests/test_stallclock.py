"""The stall clocks (tests/stallclock.py) the timing tests take this process's own stalls off with."""
from __future__ import annotations

import os
import subprocess
import time

import trio

from stallclock import Stalls, loop_stalls, server_time, thread_stalls


def test_only_the_stalls_within_the_span_are_taken_off():
    assert server_time(10.0, 13.0, []) == 3.0
    assert server_time(10.0, 13.0, [(12.5, 2.0)]) == 1.0  # a 2 s pause of this process inside
    assert server_time(10.0, 13.0, [(11.0, 2.0)]) == 2.0  # half of it before the span began
    assert server_time(10.0, 13.0, [(9.0, 1.0), (14.5, 1.0)]) == 3.0  # both outside
    assert server_time(10.0, 13.0, [(15.0, 6.0)]) == 0.0  # the whole span in a pause
    st = Stalls()
    st.note(1.0, 1.015, 0.01)  # 5 ms late: scheduling noise, not noted
    st.note(2.0, 2.5, 0.01)
    assert len(st.spans) == 1 and abs(st.own(0.0, 3.0) - 0.49) < 1e-9, st.spans


async def test_the_loop_clock_sees_the_event_loop_blocked_and_not_a_wait():
    async with loop_stalls() as st:
        t0 = time.monotonic()
        await trio.sleep(0.5)  # waiting: not a stall
        t1 = time.monotonic()
        time.sleep(1.0)  # the loop blocked: a stall
        await trio.sleep(0.05)
        t2 = time.monotonic()
    assert st.time(t0, t1) > 0.4
    assert 0.9 < st.own(t1, t2) < 1.2 and st.time(t1, t2) < 0.3, st.spans
    async with loop_stalls() as st:
        await trio.sleep(0.05)
        t0 = time.monotonic()
        time.sleep(1.0)
        t1 = time.monotonic()
        # judged before the clock's task has run again: its tick under way counts
        assert not st.spans and 0.9 < st.own(t0, t1) < 1.2
    assert st.own(t0, t1) < 0.1  # the clock stopped: nothing under way


def test_the_thread_clock_sees_the_process_stopped_and_not_a_wait():
    with thread_stalls() as st:
        t0 = time.monotonic()
        time.sleep(0.5)  # waiting in a system call: not a stall
        t1 = time.monotonic()
        # stopped 1 s by another process (as a descheduled or frozen process would be)
        subprocess.run(["sh", "-c", f"kill -STOP {os.getpid()}; sleep 1; kill -CONT {os.getpid()}"],
                       timeout=30, check=True)
        t2 = time.monotonic()
    assert st.time(t0, t1) > 0.4
    assert 0.8 < st.own(t1, t2) < 1.5, st.spans
