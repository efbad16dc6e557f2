"""One long-lived worker thread for the record writes of a database whose writes are serial
anyway (SQLite: one writer; ``Database._write_lock`` queues this process's writers), instead of
a hop through ``anyio.to_thread.run_sync`` per write.

Why: ``memfuse serve`` answers a single-record write with one worker-thread hop (the SQLite
transaction and its commit must not hold the event loop: an fsync takes milliseconds, far more on
a busy disk). ``anyio.to_thread.run_sync`` costs ~115 µs of CPU per hop on this machine (anyio's
wrapper and cancel scope, trio's thread cache, which renames the OS thread twice per job:
``pthread_setname_np`` on another thread is a write to ``/proc/self/task/TID/comm``); a thread
of our own fed by a queue costs ~45 µs (bench/README.md, "The close path, session 11: serve").

Semantics are those of ``anyio.to_thread.run_sync`` with its defaults: ``fn`` runs in a copy of
the caller's context (``contextvars``), its result is returned and its exception raised in the
calling task, and the call cannot be cancelled while ``fn`` runs (the task waits for the
result: a write is never abandoned half-way). Under an event loop other than trio (asyncio:
Starlette's ``TestClient``) the call is ``anyio.to_thread.run_sync`` itself.

The hand-back (bench/README.md, "The close path, session 14: serve"): the writer thread puts
the job's outcome in the job's slot and writes the waiting task's own ``eventfd``, which the
task waits on with ``trio.lowlevel.wait_readable``: the event loop wakes that task straight
from ``epoll``. trio's ``TrioToken.run_sync_soon`` (its entry queue: a wake-up socket, a system
task that runs the callback, which reschedules the task) cost one more loop iteration and task
step per write. The eventfds are kept for reuse (one per write in progress at once). A caller
cancelled while it waits is not told until its job has finished: the wait is taken up again
shielded and the result returned (the cancellation comes at the task's next checkpoint), the
promise ``wait_task_rescheduled`` with ``Abort.FAILED`` kept before. Without ``os.eventfd``
(not Linux) the hand-back is ``run_sync_soon``'s.

The hand-over (bench/README.md, "The close path, session 17: serve's loop"): a job given while
the thread waits for one is not put in its queue at once but when the event loop is about to
block (``_HandOver``, a trio instrument's ``before_io_wait``: the end of the loop's batch of
task steps, right before ``epoll_wait`` drops the GIL). Put at once, the ``queue.put`` woke the
thread while the loop still held the GIL: it ran ~10 µs, blocked on the GIL and was woken a
second time when the loop dropped it (its ``epoll_ctl`` for the eventfd's wait, then its
``epoll_wait``): two more context switches and a cross-CPU wake per write, and the loop
stalled in that ``epoll_ctl`` until the thread let the GIL go (0.70 ms a create, profiled).
Woken as the loop blocks, the thread finds the GIL free unless it wakes within the few µs of
Python left before ``epoll_wait`` (an idle CPU can: the pipeline's trace still counts a
second wake then; only a hand-over inside the GIL's release would end it). A job given while the thread is busy (its queue not waited on) is put
at once: it wakes nothing, and the thread takes it as soon as it is done.
"""
from __future__ import annotations

import contextvars
import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import outcome
import trio

log = logging.getLogger(__name__)

T = TypeVar("T")

IDLE_SECONDS = 10.0  # a thread without a job this long ends (the next job starts another)

_EVENTFD = hasattr(os, "eventfd")  # Linux
POOL_MAX = 64  # eventfds kept for reuse at most (more only while more writes wait at once)


class _Slot:
    """One job's hand-back: its outcome (set by the writer thread) and how the waiting task
    is woken: written to ``fd`` (an eventfd), else through ``token`` (trio's entry queue)."""

    __slots__ = ("result", "fd", "token", "task")

    def __init__(self, fd: int, token: trio.lowlevel.TrioToken | None, task: trio.lowlevel.Task | None) -> None:
        self.result: outcome.Outcome[Any] | None = None
        self.fd = fd
        self.token = token
        self.task = task


_Job = tuple[contextvars.Context, Callable[..., Any], tuple[Any, ...], _Slot]


class _HandOver(trio.abc.Instrument):
    """The hand-over of one trio run (module docstring): ``due`` holds the writers with jobs
    held back (``WriterThread._held``), each once; ``before_io_wait`` puts their jobs in
    their queues as the event loop is about to block. Never raises (an instrument that
    raises is removed by trio, and held jobs would then wait forever).

    Installed in the run only while ``due`` is not empty (``arm``; ``before_io_wait``
    takes it out once it has handed everything over): trio calls an installed hook on every
    loop iteration (~4.2 k instructions each through ``Instruments.call``), and the loop of
    ``memfuse serve`` turns several times per write with nothing held. trio's public
    ``add_instrument`` finds an instrument's hooks with ``dir()`` (~30 µs, more than the
    calls it would save), so the hook is put in and taken out of the run's table of
    ``before_io_wait`` hooks directly (``_hooks``, the dict ``trio._core.Instruments``
    calls; its ``_all`` entry too, so that trio's own removal of a failed instrument still
    works); where that table is not what trio 0.25-0.35 has, the instrument is added once
    with ``add_instrument`` and stays (``_hooks`` None)."""

    def __init__(self) -> None:
        self.due: list[WriterThread] = []
        # the run's ``Instruments`` table (hook name → {instrument: None}), or None: added
        # for good through the public API. INVARIANT (when not None): this instrument is in
        # ``_hooks["before_io_wait"]`` and ``_hooks["_all"]`` exactly while ``due`` is not empty
        self._hooks: dict[str, dict[trio.abc.Instrument, None]] | None = None

    def arm(self) -> None:
        """``due`` just became non-empty: be called as the loop next blocks."""
        hooks = self._hooks
        if hooks is not None:
            hooks["_all"][self] = None
            hooks.setdefault("before_io_wait", {})[self] = None

    def before_io_wait(self, timeout: float) -> None:
        due = self.due
        while due:
            writer = due.pop()
            try:
                writer._hand_over()
            except BaseException:  # noqa: BLE001 - cannot happen; logged, never raised to trio
                log.exception("writer thread: handing jobs over failed")
        hooks = self._hooks
        if hooks is not None:  # nothing held: out of the loop's iterations until the next job
            hooks["_all"].pop(self, None)
            mine = hooks.get("before_io_wait")
            if mine is not None:
                mine.pop(self, None)
                if not mine:  # as trio leaves it: no entry, no call
                    del hooks["before_io_wait"]


#: the hand-over instrument of the current trio run (made by its first job)
_HAND_OVER: trio.lowlevel.RunVar[_HandOver] = trio.lowlevel.RunVar("memfuse_writer_hand_over")


def _run_hooks() -> dict[str, dict[trio.abc.Instrument, None]] | None:
    """The current trio run's table of instrument hooks (``trio._core._instrumentation.
    Instruments.data``), or None when trio's internals are not the ones this was written
    for (the hand-over then stays installed: correct, and dearer)."""
    try:
        from trio._core._run import GLOBAL_RUN_CONTEXT  # trio's own; checked below

        data = GLOBAL_RUN_CONTEXT.runner.instruments.data
    except (ImportError, AttributeError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("_all"), dict):
        return None
    return data


def _hand_over_of_run() -> _HandOver:
    """The current trio run's ``_HandOver`` (made at first use; installed in the run only
    while it holds jobs, ``_HandOver.arm``, or for good where trio's table is not reachable)."""
    try:
        return _HAND_OVER.get()
    except LookupError:
        h = _HandOver()
        h._hooks = _run_hooks()
        if h._hooks is None:
            trio.lowlevel.add_instrument(h)
        _HAND_OVER.set(h)
        return h


def _cannot_abort(_: Any) -> trio.lowlevel.Abort:
    return trio.lowlevel.Abort.FAILED  # the write runs to its end; the task gets its answer


class WriterThread:
    """``await writer.run(fn, *args)``: ``fn(*args)`` on this object's one thread (see the
    module docstring), jobs in the order they were submitted. The thread is started by the
    first job and ends by itself after ``idle`` seconds without one (as trio's thread cache
    ends its threads), so nothing has to stop it: an idle server, or an app a test dropped,
    keeps no thread. ``name``: the thread's name (``ps``, py-spy). ``eventfd``: wake the
    waiting task through an eventfd (default: where ``os.eventfd`` exists), else through
    trio's ``run_sync_soon``."""

    def __init__(self, name: str = "memfuse-writer", idle: float = IDLE_SECONDS, *,
                 eventfd: bool = _EVENTFD) -> None:
        self.name = name
        self.idle = idle
        self.eventfd = eventfd
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        # GUARDED_BY(_lock). INVARIANT: True while a thread is running that will take every
        # job queued before it ends (it ends only holding _lock with _jobs seen empty).
        self._alive = False
        # INVARIANT: eventfds no job holds, each with its count at 0 (read after its wake)
        self._fds: list[int] = []
        # Event-loop only. INVARIANT: jobs given and not yet put in ``_jobs``, in the order
        # given; when not empty, this writer is in its run's ``_HandOver.due`` (once), which
        # puts them in ``_jobs`` before the loop next blocks; no job is put in ``_jobs``
        # directly while one is held (the order of the jobs is the order they were given).
        self._held: list[_Job] = []
        # True while the thread waits for a job in ``_jobs.get`` (set and cleared by the
        # thread holding the GIL, read by the loop): a job put then wakes it (held back)
        self._waiting = False
        self.jobs = 0  # jobs run (tests, the benchmark)

    def __del__(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``'s result (or exception) from the writer thread. Not a cancellation
        point while ``fn`` runs; raises what ``fn`` raises."""
        try:
            task = trio.lowlevel.current_task()
        except RuntimeError:  # not under trio
            return await anyio.to_thread.run_sync(fn, *args)
        if self.eventfd:
            fd = self._fds.pop() if self._fds else os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
            slot = _Slot(fd, None, None)
        else:
            slot = _Slot(-1, trio.lowlevel.current_trio_token(), task)
        job = (contextvars.copy_context(), fn, args, slot)
        if self._held or self._waiting or not self._alive:  # its put would wake the thread now
            if not self._held:
                hand_over = _hand_over_of_run()
                if not hand_over.due:
                    hand_over.arm()
                hand_over.due.append(self)
            self._held.append(job)
        else:  # the thread is busy: it takes the job when done, nothing to wake
            self._jobs.put(job)
            self._start()  # it may have been ending (idle) as it was read alive
        if slot.fd < 0:
            result: T = await trio.lowlevel.wait_task_rescheduled(_cannot_abort)
            return result
        read = False
        try:  # the wake: the eventfd read once written (no coroutine of its own per write)
            try:
                await trio.lowlevel.wait_readable(slot.fd)
            except BaseException as e:  # noqa: BLE001 - the job is under way: its answer first
                read = await _woken_after(slot, e)
            else:
                os.eventfd_read(slot.fd)
                read = True
        finally:
            if read and len(self._fds) < POOL_MAX:
                self._fds.append(slot.fd)  # its count back at 0: ready for another job
            elif read:
                os.close(slot.fd)
            # else the wait failed (its fd closed there, or still to be written: left open)
        # out of the slot before it is unwrapped: an exception raised here carries this frame in
        # its traceback, and this frame's ``slot`` held the outcome holding the exception: a
        # cycle that kept every refused write's request (its body, its parsed content) until
        # the cyclic collector ran, which the server's thresholds make rare (attack23 HIGH 2)
        got, slot.result = slot.result, None
        assert got is not None
        try:
            value: T = got.unwrap()
        finally:
            del got
        return value

    def _hand_over(self) -> None:
        """Put the held jobs in the thread's queue (``_HandOver``, as the loop is about to
        block), starting the thread if none runs."""
        held, self._held = self._held, []
        for job in held:
            self._jobs.put(job)
        self._start()

    def _start(self) -> None:
        """Start the thread unless one runs (that one takes every job queued before it ends)."""
        with self._lock:
            if not self._alive:
                self._alive = True
                threading.Thread(target=self._work, name=self.name, daemon=True).start()

    def _work(self) -> None:
        jobs = self._jobs
        while True:
            self._waiting = True
            try:
                ctx, fn, args, slot = jobs.get(timeout=self.idle)
            except queue.Empty:
                self._waiting = False
                with self._lock:
                    if jobs.empty():
                        self._alive = False
                        return
                continue
            self._waiting = False
            self.jobs += 1
            result = outcome.capture(ctx.run, fn, *args)
            del ctx, fn, args  # (nothing of the job stays on this thread while it waits)
            if slot.fd >= 0:
                slot.result = result
                del result
                os.eventfd_write(slot.fd, 1)  # the waiting task's wake (``run``)
                continue
            token, task = slot.token, slot.task
            assert token is not None and task is not None
            try:
                token.run_sync_soon(trio.lowlevel.reschedule, task, result)
                del result, slot, token, task
            except trio.RunFinishedError:  # cannot happen: the task waits for its answer
                log.error("writer thread: the event loop of a waiting write has ended")


async def _woken_after(slot: _Slot, e: BaseException) -> bool:
    """The wait of ``WriterThread.run`` for the writer thread's write of ``slot.fd`` raised
    ``e``: the job is under way, so wait again, shielded, and read the eventfd back to 0
    (its outcome is then in ``slot``); True when ``e`` is a cancellation (not raised here:
    the task's next checkpoint raises it; the job ran to its end and its caller gets its
    answer, as with ``Abort.FAILED``), else ``e`` raised after the wake (``slot.fd``
    closed: read, and the thread is done with it)."""
    with trio.CancelScope(shield=True):
        await trio.lowlevel.wait_readable(slot.fd)  # readable once written, not before
    os.eventfd_read(slot.fd)
    if not isinstance(e, trio.Cancelled):
        os.close(slot.fd)
        raise e
    return True
