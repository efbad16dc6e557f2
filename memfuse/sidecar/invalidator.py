"""Kernel cache invalidation: tells the kernel what changed remotely.

``Invalidator`` queues invalidations (synchronously, on the trio thread, never blocking) and
performs them from a worker thread, never on the trio thread: ``pyfuse3.invalidate_entry``
blocks while a request on that directory is in flight, and that request may be waiting for
the trio thread (docs/ARCHITECTURE.md, "Threads and ordering"). The filesystem core returns
the invalidations a change needs (``remote.RemoteApply``); the sidecar submits them here.
This is the only sidecar module besides the FUSE adapter and the mount that imports pyfuse3.
"""
from __future__ import annotations

import errno
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

import pyfuse3
import trio

log = logging.getLogger("memfuse.sync")

#: Seconds an invalidation of a file's content or attributes waits for the readers that
#: have the file open to close it (``Invalidator.reading``): a reader whose read(2) calls
#: straddled the invalidation would get the older content up to its size and the newer
#: content's bytes past it (torn16b: ``sed -i`` committed them). Past this bound the
#: invalidation is made anyway (a reader still open then is flagged: ``Handle.replaced``).
READER_LINGER = 2.0

#: The last element of a request of an inode kept for its readers (``Invalidator.outlasted``):
#: counted as made, never sent to the kernel (an object no file name is).
KEPT: Any = object()


class Invalidator:
    """Queues kernel cache invalidations and performs them from a worker thread.

    Requests are ``("entry", parent_ino, name: str)``, ``("inode", ino)`` (attributes and
    pages; ``("inode", ino, "again")`` when ``served_older`` made it once more) and
    ``("attr", ino)`` (attributes only). ``active`` is
    False until the mount is up (nothing is cached before that).

    ``behind(ino)`` says whether the kernel may still hold an older content of ``ino``: an
    ``("inode", ino)`` request was submitted and has not been performed yet. Until then the
    kernel may serve a reader the pages and the size of the content before the change
    (docs/SEMANTICS.md, "Conflicts": the base of an overwrite); ``catch_up(ino, timeout)``
    waits for it. ``hold``: a fault hook for tests, awaited before each batch is performed
    (it widens that window); None in production.

    ``reading(ino)`` (set once the filesystem exists; None: nothing waits) says whether a
    handle open for reading holds ``ino``: its ``("inode", ino)`` and ``("attr", ino)``
    requests then wait until ``reader_closed(ino)`` finds none left, at most ``linger``
    seconds (``READER_LINGER``), so no reader's reads straddle the change: a reader gets
    the content of one version whole (the older one, ``Filesystem._read_shown``).
    ``outlasted(ino)`` (set with ``reading``; None: none) is asked when that bound passed
    with readers still open: it returns the invalidations to make instead (the file moved
    to a new inode, the old one kept for its readers: ``Filesystem.readers_outlasted``),
    or None, and the waiting requests are made.
    """

    def __init__(self, hold: Callable[[], Awaitable[None]] | None = None,
                 reading: Callable[[int], bool] | None = None,
                 linger: float = READER_LINGER,
                 outlasted: Callable[[int], list[tuple[Any, ...]] | None] | None = None) -> None:
        self.active = False
        self._hold = hold
        self.reading = reading
        self.outlasted = outlasted
        self.kept = 0  # files moved to a new inode, the old one kept for its readers
        self.linger = linger
        # INVARIANT: ino -> (deadline on trio's clock, its requests) of the ("inode", ino) /
        # ("attr", ino) requests waiting for the readers of ino to close; they stay counted
        # in ``behind_inodes`` and ``pending`` until performed. Trio thread only.
        self._waiting: dict[int, tuple[float, list[tuple[Any, ...]]]] = {}
        # unbounded: submit() is called from synchronous code on the trio thread and must
        # not block; the worker takes everything queued at once as one batch
        self._send, self._recv = trio.open_memory_channel(math.inf)
        self.done = 0
        self.failed = 0
        self._outstanding = 0  # submitted, not yet sent to the kernel
        self._settled = trio.Event()
        # INVARIANT: ino -> number of its ("inode", ino) requests submitted and not yet
        # performed (or dropped); an ino is a key only while that number is > 0. Changed on
        # the trio thread only (submit, and run() after its batch returned); read-only to
        # others (``behind``; the FUSE adapter's open tests it inline: an empty dict is the
        # common case).
        self.behind_inodes: dict[int, int] = {}
        self._progress = trio.Event()  # set (and replaced) after every batch
        # INVARIANT: the inodes of the ("inode", ino) requests (not "again") of the batch
        # being performed by the worker thread (empty between batches); ``_again``: those of
        # them a reader was served the older content of meanwhile (``served_older``),
        # invalidated once more when the batch returns. Trio thread only.
        self._performing: set[int] = set()
        self._again: set[int] = set()

    def submit(self, items: list[tuple[Any, ...]]) -> None:
        """Queue kernel invalidations (``("entry", parent_ino, name)``, ``("inode", ino)``,
        ``("attr", ino)``); dropped while the mount is not up. Never blocks."""
        if self.active and items:
            self._outstanding += len(items)
            stale = self.behind_inodes
            for item in items:
                if item[0] == "inode":
                    stale[item[1]] = stale.get(item[1], 0) + 1
            self._send.send_nowait(list(items))

    @property
    def pending(self) -> int:
        """Invalidations submitted and not performed (or dropped) yet."""
        return self._outstanding

    @property
    def waiting(self) -> int:
        """Inodes whose invalidation waits for their readers to close (``reading``)."""
        return len(self._waiting)

    def behind(self, ino: int) -> bool:
        """True while an ``("inode", ino)`` invalidation is queued or being performed: the
        kernel may still serve the pages and size of ``ino``'s older content. One dict
        lookup (every open and read of a changed file asks)."""
        return ino in self.behind_inodes

    def served_older(self, ino: int) -> None:
        """A reader of ``ino`` was served the older content whose size the kernel holds
        (``behind``; ``Filesystem.read``). When the kernel is performing that invalidation
        right now it may have dropped the file's pages before this read's page was filled:
        that page would then stay cached after the invalidation. So the inode is invalidated
        once more after the batch (once: a read during that one is not followed again; the
        kernel, told the attributes are stale, refreshes them at the next read and drops
        pages whose mtime or size changed). Never blocks."""
        if ino in self._performing:
            self._again.add(ino)

    def reader_closed(self, ino: int) -> None:
        """A handle open for reading on ``ino`` was released: its waiting invalidations are
        made once no reader is left (``reading``). Never blocks."""
        if ino in self._waiting:
            self._send.send_nowait([])  # wakes run(), which checks the waiting ones

    def _due(self, batch: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """The requests of ``batch`` and of the waiting ones to perform now; those of inodes a
        reader holds open (``reading``) wait, up to ``linger`` s from their first wait."""
        now = trio.current_time()
        out: list[tuple[Any, ...]] = []
        for ino in list(self._waiting):
            deadline, items = self._waiting[ino]
            if self.reading is None or not self.reading(ino):
                del self._waiting[ino]
                out += items
            elif now >= deadline:
                del self._waiting[ino]
                instead = self.outlasted(ino) if self.outlasted is not None else None
                if instead is None:
                    out += items
                    continue
                # the old inode keeps the older content for its readers: not invalidated
                # (its requests count as made: ``KEPT``); the name's entry is, instead
                self.kept += 1
                out += [(item[0], ino, KEPT) for item in items]
                self.submit(instead)
        for item in batch:
            ino = item[1]
            if item[0] in ("inode", "attr") and self.reading is not None and (
                    ino in self._waiting or self.reading(ino)):
                deadline, items = self._waiting.get(ino, (now + self.linger, []))
                items.append(item)
                self._waiting[ino] = (deadline, items)
            else:
                out.append(item)
        return out

    async def catch_up(self, ino: int, timeout: float) -> bool:
        """Wait (up to ``timeout`` s) until no invalidation of ``ino``'s content is pending
        (``behind``); True when none is, False when it still is after ``timeout``."""
        with trio.move_on_after(timeout):
            while ino in self.behind_inodes:
                await self._progress.wait()
        return ino not in self.behind_inodes

    def _run_batch(self, batch: list[tuple[Any, ...]]) -> None:
        for item in batch:
            if item[-1] is KEPT:
                continue
            try:
                if item[0] == "entry":
                    pyfuse3.invalidate_entry(item[1], item[2].encode("utf-8"))
                elif item[0] == "attr":  # mode / mtime changed: the pages stay valid
                    pyfuse3.invalidate_inode(item[1], attr_only=True)
                else:
                    pyfuse3.invalidate_inode(item[1], attr_only=False)
                self.done += 1
            except OSError as e:
                if e.errno != errno.ENOENT:  # ENOENT: the kernel had nothing cached
                    self.failed += 1
                    log.warning("kernel invalidation failed",
                                extra={"kind": item[0], "ino": item[1],
                                       "errno": errno.errorcode.get(e.errno or 0)})

    async def run(self) -> None:
        """Perform queued invalidations until cancelled."""
        # no `async with self._recv`: a run() restarted by its supervisor reads the same channel
        while True:
            batch: list[tuple[Any, ...]] = []
            wake = min((d for d, _ in self._waiting.values()), default=math.inf)
            with trio.move_on_at(wake):
                try:
                    batch = await self._recv.receive()
                except trio.EndOfChannel:
                    return
            while True:
                try:
                    batch += self._recv.receive_nowait()
                except trio.WouldBlock:
                    break
            batch = self._due(batch)
            if not batch:
                continue
            try:
                if batch and self.active:
                    if self._hold is not None:
                        await self._hold()
                    self._performing = {item[1] for item in batch
                                        if item[0] == "inode" and len(item) == 2}
                    await trio.to_thread.run_sync(self._run_batch, batch)
            finally:
                again, self._performing, self._again = self._again, set(), set()
                stale = self.behind_inodes
                for item in batch:
                    if item[0] == "inode":
                        left = stale.get(item[1], 0) - 1
                        if left > 0:
                            stale[item[1]] = left
                        else:
                            stale.pop(item[1], None)
                self._progress.set()
                self._progress = trio.Event()
                self._outstanding -= len(batch)
                if self._outstanding <= 0:
                    self._outstanding = 0
                    self._settled.set()
                    self._settled = trio.Event()
                if again:
                    self.submit([("inode", ino, "again") for ino in sorted(again)])

    async def settle(self, timeout: float = 5.0) -> None:
        """Wait (up to ``timeout`` s) until everything submitted so far reached the kernel."""
        with trio.move_on_after(timeout):
            while self._outstanding > 0 and self.active:
                await self._settled.wait()
