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
"""
from __future__ import annotations

import contextvars
import logging
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

_Job = tuple[contextvars.Context, Callable[..., Any], tuple[Any, ...], trio.lowlevel.TrioToken,
             trio.lowlevel.Task]


def _cannot_abort(_: Any) -> trio.lowlevel.Abort:
    return trio.lowlevel.Abort.FAILED  # the write runs to its end; the task gets its answer


class WriterThread:
    """``await writer.run(fn, *args)``: ``fn(*args)`` on this object's one thread (see the
    module docstring), jobs in the order they were submitted. The thread is started by the
    first job and ends by itself after ``idle`` seconds without one (as trio's thread cache
    ends its threads), so nothing has to stop it: an idle server, or an app a test dropped,
    keeps no thread. ``name``: the thread's name (``ps``, py-spy)."""

    def __init__(self, name: str = "memfuse-writer", idle: float = IDLE_SECONDS) -> None:
        self.name = name
        self.idle = idle
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        # GUARDED_BY(_lock). INVARIANT: True while a thread is running that will take every
        # job queued before it ends (it ends only holding _lock with _jobs seen empty).
        self._alive = False
        self.jobs = 0  # jobs run (tests, the benchmark)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``'s result (or exception) from the writer thread. Not a cancellation
        point while ``fn`` runs; raises what ``fn`` raises."""
        try:
            token = trio.lowlevel.current_trio_token()
        except RuntimeError:  # not under trio
            return await anyio.to_thread.run_sync(fn, *args)
        self._jobs.put((contextvars.copy_context(), fn, args, token, trio.lowlevel.current_task()))
        with self._lock:
            if not self._alive:
                self._alive = True
                threading.Thread(target=self._work, name=self.name, daemon=True).start()
        result: T = await trio.lowlevel.wait_task_rescheduled(_cannot_abort)
        return result

    def _work(self) -> None:
        jobs = self._jobs
        while True:
            try:
                ctx, fn, args, token, task = jobs.get(timeout=self.idle)
            except queue.Empty:
                with self._lock:
                    if jobs.empty():
                        self._alive = False
                        return
                continue
            self.jobs += 1
            result = outcome.capture(ctx.run, fn, *args)
            try:
                token.run_sync_soon(trio.lowlevel.reschedule, task, result)
            except trio.RunFinishedError:  # cannot happen: the task waits for its answer
                log.error("writer thread: the event loop of a waiting write has ended")
