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
