"""Which worker ``FuseReader.hand_off`` wakes (``memfuse/sidecar/fusereader.py``): one that read
a request before, so the workers that read stay few. Each worker's first read allocates its
request buffer (libfuse: 1 MiB + 4 KiB, kept while the worker lives); handed to the longest
parked worker, every awaiting handler woke a new one until pyfuse3's 99 all had one. Without
FUSE: worker tasks shaped as pyfuse3's loop (a new one started after each request read, up to
``max_tasks``) reading requests from a pipe, sent by one writer as ``echo >>`` sends them (the
next request after the answer to the last; every third, a flush, awaits its commit)."""
from __future__ import annotations

import os

import trio

from memfuse.sidecar.fusereader import FuseReader

MAX_TASKS = 99


async def _serve(requests: int) -> tuple[int, int]:
    """(workers started, distinct workers that read a request) after ``requests``."""
    r, w = os.pipe()
    reader = FuseReader()
    readers: set[int] = set()
    started = 0
    answered = trio.Event()

    async def worker(nursery: trio.Nursery, me: int) -> None:
        nonlocal started, answered
        while await reader.wait_readable():
            i = os.read(r, 1)[0]
            readers.add(me)
            if started < MAX_TASKS:  # pyfuse3: one more worker after a read, up to max_tasks
                started += 1
                nursery.start_soon(worker, nursery, started)
            if i % 3 == 2:  # a flush: waits for its commit
                reader.hand_off()
                await trio.sleep(0.001)
            answered.set()

    async def writer() -> None:
        nonlocal answered
        for i in range(requests):
            answered = trio.Event()
            os.write(w, bytes([i % 256]))
            await answered.wait()
        reader.close()

    try:
        with reader.installed(r):
            async with trio.open_nursery() as nursery:
                started = 1
                nursery.start_soon(worker, nursery, 1)
                nursery.start_soon(writer)
    finally:
        os.close(r)
        os.close(w)
    return started, len(readers)


async def test_a_hand_off_wakes_a_worker_that_read_before():
    started, readers = await _serve(600)
    assert started == MAX_TASKS  # pyfuse3 started all its workers
    assert readers <= 3, f"{readers} workers read requests (each allocates a 1 MiB buffer)"
