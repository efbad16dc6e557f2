"""The bounds of many waits kept by one task (``memfuse.timers``) and the close's
bounded wait for its entry (``Entry.wait_accepted``), which uses them instead of a trio cancel
scope per close (bench/README.md, "The close path, session 16: sidecar")."""
from __future__ import annotations

import errno
import logging

import pytest
import trio

from memfuse import timers
from memfuse.sidecar.cachedir import CacheError
from memfuse.sidecar.committer import Committer
from memfuse.sidecar.journal import PUT, Journal


async def test_a_timer_wakes_at_its_deadline_and_a_cancelled_one_never():
    woke: list[str] = []
    now = trio.current_time()
    timers.call_at(now + 0.2, lambda: woke.append("late"))
    early = timers.call_at(now + 0.05, lambda: woke.append("early"))
    gone = timers.call_at(now + 0.1, lambda: woke.append("cancelled"))
    gone.cancel()
    gone.cancel()  # idempotent
    with trio.fail_after(5):
        while len(woke) < 2:
            await trio.sleep(0.01)
    assert woke == ["early", "late"]
    assert early.fired and not early.cancelled
    early.cancel()  # after it ran: nothing
    assert early.fired and not early.cancelled
    assert trio.current_time() >= now + 0.2


async def test_a_sooner_timer_wakes_a_keeper_asleep_until_a_later_one():
    ev = trio.Event()
    now = trio.current_time()
    timers.call_at(now + 60, lambda: None)
    await trio.sleep(0.01)  # the keeper sleeps until now + 60
    timers.call_at(now + 0.05, ev.set)
    with trio.fail_after(5):
        await ev.wait()


async def test_cancelled_timers_do_not_pile_up_and_hold_nothing_alive():
    k = timers.keeper()
    big = bytearray(1 << 20)
    for _ in range(5000):  # a steady stream of waits that end early, each with a 30 s bound
        t = timers.call_at(trio.current_time() + 30, lambda b=big: b.clear())
        t.cancel()
    assert len(k.heap) <= 2 * timers.COMPACT_MIN + 2
    live = timers.call_at(trio.current_time() + 30, lambda: None)
    assert len([x for x in k.heap if not x[2].cancelled]) == 1
    live.cancel()
    # a cancelled timer drops its callback (and what it refers to) at once
    assert all(x[2].wake is timers._nothing for x in k.heap)
    assert len(big) == 1 << 20


async def test_a_failing_wake_is_logged_and_the_keeper_goes_on(caplog):
    ev = trio.Event()
    now = trio.current_time()
    timers.call_at(now + 0.01, lambda: 1 / 0)
    timers.call_at(now + 0.03, ev.set)
    with caplog.at_level(logging.ERROR, logger="memfuse.timers"), trio.fail_after(5):
        await ev.wait()
    assert "a timer's wake-up failed" in caplog.text


class _Offline:
    """A client the committer never gets to use here (no committer task runs)."""


async def test_a_close_waiting_for_its_held_entry_enters_no_cancel_scope(tmp_path, monkeypatch):
    """The close's wait for its entry (held insert, answered in milliseconds) costs no trio
    cancel scope (~58 k instructions each); its bound is kept by the timer keeper. Fails on
    main (one scope per wait)."""
    j = Journal(tmp_path / "outbox.db")
    c = Committer(_Offline(), j, {})  # type: ignore[arg-type]
    c.hold_journal = True
    e = c.submit("s", PUT, "n:1", {"path": "f"}, b"x", hold=True)
    timers.keeper()  # started outside the counted span
    await trio.sleep(0)
    entered = 0
    enter = trio.CancelScope.__enter__
    task = None

    def counting(self: trio.CancelScope) -> trio.CancelScope:
        nonlocal entered
        entered += trio.lowlevel.current_task() is task
        return enter(self)

    async def waiter() -> None:
        nonlocal task
        task = trio.lowlevel.current_task()
        monkeypatch.setattr(trio.CancelScope, "__enter__", counting)
        try:
            await e.wait_accepted(30)
        finally:
            monkeypatch.setattr(trio.CancelScope, "__enter__", enter)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.sleep(0.01)
        assert not e.done.is_set()
        e.finish()  # the control plane answered: the held row is never written
    assert entered == 0
    j.close()


async def test_a_wait_for_the_journal_is_still_bounded_without_its_task(tmp_path):
    """No journal task and no answer: ``wait_accepted`` ends at its bound, woken by the keeper
    (not by a cancel scope)."""
    j = Journal(tmp_path / "outbox.db")
    c = Committer(_Offline(), j, {})  # type: ignore[arg-type]
    e = c.submit("s", PUT, "n:1", {"path": "f"}, b"x", hold=True)
    t0 = trio.current_time()
    with trio.fail_after(5), pytest.raises(CacheError) as ei:
        await e.wait_accepted(0.2)
    assert ei.value.errno == errno.EIO and "did not write within 0.2 s" in ei.value.reason
    assert trio.current_time() - t0 >= 0.2
    # the timer of a wait that ended is gone: nothing keeps the entry alive
    assert all(x[2].wake is timers._nothing or x[2].fired for x in timers.keeper().heap)
    j.close()
