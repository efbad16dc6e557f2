"""``Invalidator`` knows which inodes the kernel may still show an older content of
(``behind``) until their queued invalidation is performed, and ``catch_up`` waits for it
within its bound. No mount: the batches are held by the fault hook and then dropped (the
mount taken down: ``active`` False), which ends them as performing them does."""
from __future__ import annotations

import trio

from memfuse.sidecar.invalidator import Invalidator


async def test_an_inode_is_behind_until_its_queued_invalidation_is_done():
    release = trio.Event()
    held = trio.Event()

    async def hold() -> None:
        held.set()
        with trio.move_on_after(10):
            await release.wait()

    inv = Invalidator(hold=hold)
    inv.active = True
    async with trio.open_nursery() as nursery:
        nursery.start_soon(inv.run)
        inv.submit([("entry", 1, "a.md"), ("attr", 6)])
        assert not inv.behind(1) and not inv.behind(6)  # only content changes count
        inv.submit([("inode", 5), ("inode", 5)])
        assert inv.behind(5) and not inv.behind(7)
        assert inv.pending == 4
        with trio.fail_after(5):
            await held.wait()
        assert await inv.catch_up(5, 0.05) is False  # bounded: still queued
        assert inv.behind(5)
        inv.active = False  # the batch is dropped, not sent (no kernel here)

        async def late_release() -> None:
            await trio.sleep(0.05)
            release.set()

        nursery.start_soon(late_release)
        with trio.fail_after(5):
            assert await inv.catch_up(5, 5) is True
        assert not inv.behind(5) and inv.pending == 0
        nursery.cancel_scope.cancel()


async def test_submissions_while_the_mount_is_down_are_never_behind():
    inv = Invalidator()
    inv.submit([("inode", 3)])  # not active: dropped
    assert not inv.behind(3) and inv.pending == 0
    with trio.fail_after(1):
        assert await inv.catch_up(3, 1) is True


async def test_a_read_served_the_older_content_while_the_kernel_invalidates_is_invalidated_again(
        monkeypatch):
    """A reader served the older content (``served_older``) while the worker thread performs
    that inode's invalidation may have its page filled after the kernel dropped the pages:
    the inode is invalidated once more afterwards, once (a read during that one is not
    followed again), and a read while the request is only queued needs nothing more."""
    calls: list[int] = []
    inv = Invalidator()

    def invalidate_inode(ino: int, attr_only: bool = False) -> None:
        calls.append(ino)
        if ino == 5:  # a read served the older content meanwhile, on the trio thread
            trio.from_thread.run_sync(inv.served_older, ino)

    import memfuse.sidecar.invalidator as mod
    monkeypatch.setattr(mod.pyfuse3, "invalidate_inode", invalidate_inode)
    inv.active = True
    async with trio.open_nursery() as nursery:
        nursery.start_soon(inv.run)
        inv.submit([("inode", 5)])
        inv.served_older(5)  # queued, not performed yet: the kernel holds the older pages
        with trio.fail_after(5):
            while inv.pending or inv.behind(5):
                await inv.catch_up(5, 1)
                await trio.sleep(0.01)
        assert calls == [5, 5]  # again once, not for the read during the second one
        inv.submit([("inode", 7)])
        with trio.fail_after(5):
            await inv.settle(5)
        assert calls == [5, 5, 7] and not inv.behind(7)
        nursery.cancel_scope.cancel()


async def test_an_invalidation_waits_for_the_files_readers_within_its_bound(monkeypatch):
    """torn16b: an inode held open for reading (``reading``) is invalidated once its last
    reader closed (``reader_closed``), never while it reads (its read(2) calls would
    straddle the change: the older version followed by the newer one's tail); it stays
    ``behind`` meanwhile (reads are served the older content), other inodes are not held,
    and a reader that never closes holds it ``linger`` seconds at most."""
    calls: list[int] = []
    import memfuse.sidecar.invalidator as mod
    monkeypatch.setattr(mod.pyfuse3, "invalidate_inode",
                        lambda ino, attr_only=False: calls.append(ino))
    readers = {5: 1, 9: 1}
    inv = Invalidator(reading=lambda ino: readers.get(ino, 0) > 0, linger=0.3)
    inv.active = True
    async with trio.open_nursery() as nursery:
        nursery.start_soon(inv.run)
        inv.submit([("inode", 5), ("inode", 7), ("attr", 5)])
        with trio.fail_after(5):
            while 7 not in calls:
                await trio.sleep(0.01)
        await trio.sleep(0.1)
        assert calls == [7] and inv.behind(5) and inv.waiting == 1 and inv.pending == 2
        assert await inv.catch_up(5, 0.05) is False
        readers[5] = 0
        inv.reader_closed(5)
        with trio.fail_after(5):
            assert await inv.catch_up(5, 5) is True
        assert calls == [7, 5, 5] and inv.waiting == 0 and inv.pending == 0
        start = trio.current_time()
        inv.submit([("inode", 9)])  # its reader never closes: made after the bound
        with trio.fail_after(5):
            assert await inv.catch_up(9, 5) is True
        assert trio.current_time() - start >= 0.3 and calls[-1] == 9
        nursery.cancel_scope.cancel()


async def test_readers_that_outlast_the_bound_keep_the_inode_when_the_filesystem_can(monkeypatch):
    """attack 17 F1: past ``linger`` with its reader still open, an inode's waiting requests
    are not sent to the kernel when ``outlasted`` moves the file to a new inode (it returns
    the name's entry invalidation instead: made), yet count as made (not ``behind``, not
    ``pending``); when it returns None they are made as before."""
    calls: list[tuple[str, object]] = []
    import memfuse.sidecar.invalidator as mod
    monkeypatch.setattr(mod.pyfuse3, "invalidate_inode",
                        lambda ino, attr_only=False: calls.append(("inode", ino)))
    monkeypatch.setattr(mod.pyfuse3, "invalidate_entry",
                        lambda parent, name: calls.append(("entry", (parent, name))))
    asked: list[int] = []

    def outlasted(ino: int) -> list[tuple[object, ...]] | None:
        asked.append(ino)
        return [("entry", 1, "f.md")] if ino == 5 else None

    inv = Invalidator(reading=lambda ino: True, linger=0.2, outlasted=outlasted)
    inv.active = True
    async with trio.open_nursery() as nursery:
        nursery.start_soon(inv.run)
        inv.submit([("inode", 5), ("attr", 5), ("inode", 9)])
        with trio.fail_after(5):
            assert await inv.catch_up(5, 5) is True and await inv.catch_up(9, 5) is True
            while inv.pending:
                await trio.sleep(0.01)
        assert sorted(asked) == [5, 9], asked
        assert ("inode", 5) not in calls and ("entry", (1, b"f.md")) in calls, calls
        assert ("inode", 9) in calls and inv.kept == 1 and inv.waiting == 0, calls
        nursery.cancel_scope.cancel()
