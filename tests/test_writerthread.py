"""``memfuse.server.writerthread.WriterThread``: the one thread of a database's record writes
(``memfuse serve`` on SQLite). Its promises, as ``anyio.to_thread.run_sync``'s defaults: the
result or the exception comes back to the calling task, a cancelled caller still waits for its
job to finish (a write is never abandoned half-way), the caller's context variables are seen;
and its own: every job on one thread, in order, the thread gone after ``idle`` seconds without
a job and started again by the next one; under asyncio it is ``anyio.to_thread.run_sync``."""
from __future__ import annotations

import contextvars
import threading
import time

import anyio
import pytest
import trio

from memfuse.server.writerthread import WriterThread

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("writerthread_test", default="unset")


def _alive(name: str) -> int:
    return sum(1 for t in threading.enumerate() if t.name == name)


async def test_results_errors_order_one_thread_and_context() -> None:
    w = WriterThread(name="wt-test-1", idle=5)
    seen: list[tuple[int, int]] = []

    def job(i: int) -> int:
        seen.append((i, threading.get_ident()))
        return i * 2

    assert [await w.run(job, i) for i in range(5)] == [0, 2, 4, 6, 8]
    # concurrent callers: each gets its own answer, all on the same thread
    answers: dict[int, int] = {}

    async def call(i: int) -> None:
        answers[i] = await w.run(job, i)

    async with trio.open_nursery() as n:
        for i in range(5, 25):
            n.start_soon(call, i)
    assert answers == {i: i * 2 for i in range(5, 25)}
    assert len({ident for _, ident in seen}) == 1 and seen[0][1] != threading.get_ident()
    assert w.jobs == 25

    def boom() -> None:
        raise KeyError("refused")

    with pytest.raises(KeyError, match="refused"):
        await w.run(boom)
    VAR.set("caller's")
    assert await w.run(VAR.get) == "caller's"
    assert await w.run(job, 99) == 198  # the thread survived the exception


async def test_a_cancelled_caller_waits_for_its_job() -> None:
    w = WriterThread(name="wt-test-2", idle=5)
    done = threading.Event()

    def slow() -> str:
        time.sleep(0.3)
        done.set()
        return "written"

    got: list[str] = []
    with trio.CancelScope() as scope:
        scope.deadline = trio.current_time() + 0.05
        got.append(await w.run(slow))
    assert done.is_set() and got == ["written"]  # not abandoned: the answer was delivered


async def test_the_thread_ends_when_idle_and_starts_again() -> None:
    w = WriterThread(name="wt-test-3", idle=0.2)
    assert _alive("wt-test-3") == 0
    assert await w.run(lambda: 1) == 1
    assert _alive("wt-test-3") == 1
    with trio.fail_after(5):
        while _alive("wt-test-3"):
            await trio.sleep(0.05)
    assert await w.run(lambda: 2) == 2  # a new thread took it
    assert w.jobs == 2


def test_under_asyncio_it_is_anyio_to_thread() -> None:
    w = WriterThread(name="wt-test-4", idle=5)

    async def main() -> tuple[int, int]:
        return await w.run(lambda: threading.get_ident()), threading.get_ident()

    worker, loop = anyio.run(main, backend="asyncio")
    assert worker != loop
    assert w.jobs == 0 and _alive("wt-test-4") == 0


class _Steps(trio.abc.Instrument):
    """Counts task steps by task name (trio's entry queue runs as a system task named
    ``...EntryQueue.task``)."""

    def __init__(self) -> None:
        self.steps: dict[str, int] = {}

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps[task.name] = self.steps.get(task.name, 0) + 1


async def test_the_waiting_task_is_woken_straight_not_through_trios_entry_queue() -> None:
    """The writer thread wakes the waiting task through its eventfd: no step of trio's entry
    queue task per write (``run_sync_soon`` took one each, and a loop iteration)."""
    w = WriterThread(name="wt-test-5", idle=5)
    assert await w.run(lambda: 0) == 0  # the thread started
    steps = _Steps()
    trio.lowlevel.add_instrument(steps)
    try:
        for i in range(20):
            assert await w.run(lambda i=i: i) == i
    finally:
        trio.lowlevel.remove_instrument(steps)
    queue_steps = sum(n for name, n in steps.steps.items() if "EntryQueue" in name)
    assert queue_steps == 0, steps.steps
    assert len(w._fds) == 1  # one eventfd, reused by every write (one at a time)


@pytest.mark.parametrize("eventfd", [True, False])
async def test_a_cancelled_caller_gets_its_answer_then_the_cancellation(eventfd: bool) -> None:
    """Cancelled while its job runs, the caller still gets the job's answer; the cancellation
    comes at its next checkpoint; the eventfd it waited on comes back clean (the next write
    waits for its own answer, not a stale wake-up)."""
    w = WriterThread(name="wt-test-6", idle=5, eventfd=eventfd)
    release = threading.Event()

    def slow() -> str:
        assert release.wait(5)
        return "written"

    got: list[str] = []
    after: list[str] = []
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as n:
            async def caller() -> None:
                got.append(await w.run(slow))
                after.append("no checkpoint yet")
                await trio.lowlevel.checkpoint()
                after.append("not cancelled")  # pragma: no cover - must not run

            n.start_soon(caller)
            await trio.sleep(0.05)
            threading.Timer(0.3, release.set).start()  # after the caller's cancellation
            scope.cancel()  # the caller is cancelled while it waits (its job not done)
    assert scope.cancelled_caught
    assert got == ["written"] and after == ["no checkpoint yet"]
    # the next writes wait for their own answers
    gate = threading.Event()

    def later() -> str:
        assert gate.wait(5)
        return "later"

    threading.Timer(0.1, gate.set).start()
    with trio.fail_after(5):
        assert await w.run(later) == "later"
        assert [await w.run(lambda i=i: i) for i in range(5)] == list(range(5))
    if eventfd:
        assert len(w._fds) == 1



class _HoldBeforeIOWait(trio.abc.Instrument):
    """Once armed: the next time the event loop is about to block, it is held ``seconds``
    more (a blocking sleep: the GIL free), then ``started`` (a job's event) is noted."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.started: threading.Event | None = None
        self.seen: list[bool] = []

    def before_io_wait(self, timeout: float) -> None:
        if self.started is not None:
            time.sleep(self.seconds)
            self.seen.append(self.started.is_set())
            self.started = None


async def test_a_job_is_handed_over_as_the_loop_blocks_not_while_it_runs() -> None:
    """A job given to an idle thread is put in its queue when the event loop is about to
    block, not while the loop still runs (and holds the GIL): the thread is woken once, and
    finds the GIL free. Held here: the loop is kept busy (a blocking sleep that lets the GIL
    go) as it is about to block, before the hand-over: the job has not started by then (put
    in the queue at once, the thread took it during that sleep)."""
    hold = _HoldBeforeIOWait(0.1)
    trio.lowlevel.add_instrument(hold)  # before the writer's: its hook runs first
    try:
        w = WriterThread(name="wt-test-7", idle=5)
        assert await w.run(lambda: 0) == 0  # the thread started and waits for a job
        for i in range(3):
            started = threading.Event()

            def job(i: int = i, started: threading.Event = started) -> int:
                started.set()
                return i

            with trio.fail_after(5):
                while not w._waiting:  # the thread back at its queue (done answering the last)
                    await trio.sleep(0.01)
            hold.started = started
            with trio.fail_after(5):
                assert await w.run(job) == i
            assert started.is_set()
        assert hold.seen == [False, False, False]
    finally:
        trio.lowlevel.remove_instrument(hold)


async def test_jobs_given_to_a_busy_thread_keep_their_order() -> None:
    """A busy thread takes what is given at once (its put wakes nothing), in order, behind
    what was held."""
    w = WriterThread(name="wt-test-8", idle=5)
    release = threading.Event()
    order: list[int] = []

    def blocking() -> None:
        assert release.wait(5)
        order.append(0)

    async with trio.open_nursery() as n:
        n.start_soon(w.run, blocking)
        await trio.sleep(0.05)  # the thread is busy with it

        async def later(i: int) -> None:
            await w.run(order.append, i)

        for i in range(1, 6):
            n.start_soon(later, i)
            await trio.lowlevel.checkpoint()
        release.set()
    assert order == [0, 1, 2, 3, 4, 5]



def _installed_hand_over() -> bool:
    """Whether a writer's hand-over instrument is among the run's ``before_io_wait`` hooks."""
    from trio._core._run import GLOBAL_RUN_CONTEXT

    from memfuse.server.writerthread import _HandOver

    hooks = GLOBAL_RUN_CONTEXT.runner.instruments.data.get("before_io_wait", {})
    return any(isinstance(h, _HandOver) for h in hooks)


class _SeeHeld(trio.abc.Instrument):
    """Added before the writer's hand-over (its hook runs first): at each loop iteration,
    whether ``writer`` holds jobs and whether the hand-over is installed."""

    def __init__(self, writer: WriterThread) -> None:
        self.writer = writer
        self.seen: list[tuple[bool, bool]] = []

    def before_io_wait(self, timeout: float) -> None:
        self.seen.append((bool(self.writer._held), _installed_hand_over()))


async def test_the_hand_over_is_installed_only_while_a_job_is_held() -> None:
    """The hand-over's hook (trio calls an installed one on every loop iteration, ~4.2 k
    instructions through ``Instruments.call``) is in the run exactly while a job is held
    back: the loop's iterations with nothing held do not call it (on main it stayed for the
    run's life), jobs still reach the thread in order, and an instrument added before it
    keeps its place."""
    w = WriterThread(name="wt-test-9", idle=5)
    see = _SeeHeld(w)
    trio.lowlevel.add_instrument(see)
    try:
        results: list[int] = []

        async def give(i: int) -> None:
            results.append(await w.run(lambda: i))

        for i in range(3):
            with trio.fail_after(5):
                while i and not w._waiting:  # the thread idle at its queue: the next job is held
                    await trio.sleep(0.01)
                await give(i)
            await trio.sleep(0.02)  # idle iterations of the loop
            assert not _installed_hand_over()
        with trio.fail_after(5):
            while not w._waiting:
                await trio.sleep(0.01)
            async with trio.open_nursery() as n:  # several given at once, held together
                for i in range(3, 7):
                    n.start_soon(give, i)
        assert sorted(results) == list(range(7)) and results[:3] == [0, 1, 2]
        assert (True, True) in see.seen  # held: installed (the job waited for the loop's block)
        assert (False, False) in see.seen  # nothing held: not installed
        assert all(held == installed for held, installed in see.seen), see.seen
        from trio._core._run import GLOBAL_RUN_CONTEXT

        assert next(iter(GLOBAL_RUN_CONTEXT.runner.instruments.data["before_io_wait"])) is see
    finally:
        trio.lowlevel.remove_instrument(see)
