"""Who reads the next FUSE request: pyfuse3's worker hand-off, made lazy.

``pyfuse3.main()`` runs worker tasks (``pyfuse3._session_loop``) that take turns reading
``/dev/fuse``: each waits for the device under one ``trio.Lock`` (``_wait_fuse_readable``),
and the worker that got a request releases the lock at once, so that the next worker waits
on the device while it processes the request. Most requests are answered without an await
(every memfuse handler but a writer's flush, fsync, an open that waits for an invalidation
and a read of content to fetch again), and for those the hand-off costs a task switch, a lock
round and a loop pass for nothing: the worker is back before anyone else ran. Of the seven
requests of a create-write-close only the flush awaits; barefs (bench/barefs.py) measured
0.235 -> 0.168 ms of CPU per file without the hand-off (bench/README.md, "The close path,
session 13").

``FuseReader`` replaces pyfuse3's ``_wait_fuse_readable`` (a module global that the worker
loop looks up on each call) for the span of one ``pyfuse3.main()`` (``installed``):

- the worker that read a request stays the reader (``owner``) and waits on the device again
  directly when it comes back;
- a handler about to await calls ``hand_off`` first (the guards in ``fuse_ops.py``: every
  await of a handler goes through one of them): one parked worker is woken and becomes the
  reader, so a flush waiting for its commit never holds up other requests; with none parked,
  the next worker to come back (pyfuse3 starts a new one after each request read, up to its
  ``max_tasks``) becomes it;
- a worker coming back while another is the reader parks until it is handed the role.

Ending: ``terminate`` (instead of ``pyfuse3.terminate``) and any worker leaving pyfuse3's loop
(the session ended: an external unmount, an error) close the reader: every parked worker and
the one waiting on the device return False, which ends their loops, so ``main()`` returns.

pyfuse3's own count of waiting workers (a C field this module cannot reach) stays 0, so its
loop starts one more worker after each request read until ``max_tasks`` (99) and keeps them:
up to 99 parked tasks, as many as pyfuse3 allows to run handlers at once anyway.

A worker's first read allocates its request buffer (libfuse's ``fuse_session_receive_buf``:
``max_write`` + 4 KiB, 1 MiB + 4 KiB here), kept until the worker ends. So ``hand_off``
wakes a parked worker that has read before (``_warm``) and one that never did only when none
is parked: the workers that read stay the few that ever awaited at once. Handed to the
longest parked of all, every flush woke another new worker until all 99 had a buffer:
~100 MiB of heap, each new buffer taking the place of a freed 1 MiB content of an append to
a 1 MiB file, whose next content then faulted in fresh pages, 257 an append for the first
~100 appends (bench/README.md, "Appends, session 23").

Depends on pyfuse3's internals (3.4 and 3.5, ``src/pyfuse3/internal.pxi``: the loop calls
``_wait_fuse_readable()`` and starts ``_session_loop`` by their module-global names); with
another version, without a single ``/dev/fuse`` descriptor in the process, or with
``MEMFUSE_FUSE_READER=pyfuse3`` (benchmarks: the A/B switch), nothing is replaced and
pyfuse3's loop runs as shipped.
"""
from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Callable, Iterator
from typing import Any

import pyfuse3
import trio

log = logging.getLogger("memfuse.fuse")

#: the pyfuse3 versions whose worker loop this module was checked against (major.minor)
KNOWN_VERSIONS = ("3.4", "3.5")
#: /dev/fuse's device number (linux Documentation/admin-guide/devices.txt: 10 229)
FUSE_DEV = os.makedev(10, 229)


def fuse_device_fd(hint: int | None = None) -> int | None:
    """The descriptor of ``/dev/fuse`` this process serves: ``hint`` (the one a privileged
    helper passed) when it is that device, else the only such descriptor open in the
    process (``/proc/self/fd``), else None (none, or several: which one pyfuse3 reads is
    then unknown)."""
    def is_fuse(fd: int) -> bool:
        try:
            st = os.fstat(fd)
        except OSError:
            return False
        return stat.S_ISCHR(st.st_mode) and st.st_rdev == FUSE_DEV

    if hint is not None:
        return hint if is_fuse(hint) else None
    try:
        fds = [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:
        return None
    found = [fd for fd in fds if is_fuse(fd)]
    return found[0] if len(found) == 1 else None


class FuseReader:
    """The lazy reader hand-off of a mount's ``pyfuse3.main()`` (module docstring), made
    with the FUSE adapter (``MemfuseOps``, whose guards call ``hand_off``) and put in place
    by ``installed`` around ``main()``. One trio thread; nothing here is awaited across but
    the park and the device wait."""

    def __init__(self) -> None:
        #: the device pyfuse3 reads (``installed``); -1 outside it
        self.fd = -1
        #: the worker that reads the next request (waits on the device, or was just handed
        #: the role); None: the next worker to come back takes it
        self.owner: Any = None
        self.closed = False
        #: the workers that read a request since ``installed`` (their buffer is allocated)
        self._warm: set[Any] = set()
        self._lot = trio.lowlevel.ParkingLot()  # parked workers of ``_warm``
        self._cold = trio.lowlevel.ParkingLot()  # parked workers that never read

    async def wait_readable(self) -> bool:
        """pyfuse3's ``_wait_fuse_readable``: return True once this worker may read a request
        (it is the reader and the device is readable), False when the loop must end."""
        if self.closed:
            return False
        task = trio.lowlevel.current_task()
        owner = self.owner
        if owner is None:
            self.owner = task
        elif owner is not task:
            # hand_off makes this task the owner, or close wakes it
            await (self._lot if task in self._warm else self._cold).park()
            if self.closed:
                return False
        self._warm.add(task)
        try:
            await trio.lowlevel.wait_readable(self.fd)
        except trio.ClosedResourceError:
            self.close()
            return False
        return True

    def hand_off(self) -> None:
        """Called by a handler about to await: when its worker is the reader, pass the role
        to a parked worker (woken now), or to the next one to come back."""
        if self.owner is not trio.lowlevel.current_task():
            return  # handed on already (a second await of the same request)
        woken = self._lot.unpark() or self._cold.unpark()  # one that read before, if any
        self.owner = woken[0] if woken else None

    def close(self) -> None:
        """End the loop: every parked worker and the one waiting on the device return False
        from ``wait_readable`` (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.owner = None
        self._lot.unpark_all()
        self._cold.unpark_all()
        self._warm.clear()
        if self.fd >= 0:  # (no task waiting on it is fine)
            trio.lowlevel.notify_closing(self.fd)

    def terminate(self) -> None:
        """``pyfuse3.terminate()`` and the end of this reader's loop (module docstring)."""
        self.close()
        pyfuse3.terminate()

    def _wrap_loop(self, loop: Callable[..., Any]) -> Callable[..., Any]:
        """pyfuse3's ``_session_loop`` with this reader closed when a worker leaves it (the
        session ended, or the worker failed: either way every worker must go)."""
        async def session_loop(*args: Any) -> None:
            try:
                await loop(*args)
            finally:
                self.close()
        return session_loop

    @contextlib.contextmanager
    def installed(self, fd: int) -> Iterator[None]:
        """This reader in place of pyfuse3's for the ``with`` block (around ``main()``),
        reading ``fd`` (``usable_fd``)."""
        self.fd, self.owner, self.closed = fd, None, False
        self._warm.clear()
        mod: Any = pyfuse3
        saved = (mod._wait_fuse_readable, mod._session_loop)
        mod._wait_fuse_readable = self.wait_readable
        mod._session_loop = self._wrap_loop(saved[1])
        try:
            yield
        finally:
            mod._wait_fuse_readable, mod._session_loop = saved
            self.fd = -1  # (pyfuse3.close closes it next; its number may be reused)


def usable_fd(fd_hint: int | None = None) -> int | None:
    """The device descriptor a ``FuseReader`` reads for the mount just made by
    ``pyfuse3.init`` (``fuse_device_fd(fd_hint)``), or None when pyfuse3's own loop must
    run (module docstring: another pyfuse3, no single device descriptor,
    ``MEMFUSE_FUSE_READER=pyfuse3``)."""
    if os.environ.get("MEMFUSE_FUSE_READER", "handoff") == "pyfuse3":
        return None
    version = ".".join(str(getattr(pyfuse3, "__version__", "")).split(".")[:2])
    if version not in KNOWN_VERSIONS or not all(
            hasattr(pyfuse3, n) for n in ("_wait_fuse_readable", "_session_loop")):
        log.info("pyfuse3's own reader loop", extra={"pyfuse3": getattr(pyfuse3, "__version__", "?")})
        return None
    fd = fuse_device_fd(fd_hint)
    if fd is None:
        log.info("pyfuse3's own reader loop: no single /dev/fuse descriptor")
    return fd


__all__ = ["FuseReader", "usable_fd", "fuse_device_fd"]
