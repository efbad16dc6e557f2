"""The filesystem core without FUSE beside a writer elsewhere: one shape for the layer tests
(test_core, test_create_race) where this mount's ``Filesystem`` meets changes another
workspace made to the same store, applied as the sidecar's feed applies them."""
from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import trio

from memfuse.client import ApiClient
from memfuse.fake import FakeControlPlane
from memfuse.sidecar.blobcache import BlobCache
from memfuse.sidecar.core import Filesystem, Settings
from memfuse.sidecar.journal import Journal


class QueuedKernel:
    """A ``FsListener`` in the sidecar's place whose kernel invalidations stay queued:
    ``behind`` holds the inodes with an inode invalidation not yet performed (a test clears
    it when "the kernel caught up"), ``older`` gets an inode each time a reader was served
    the content the kernel still shows (``kernel_served_older``). Everything else is
    answered as by a sidecar that knows nothing more."""

    def __init__(self) -> None:
        self.behind: set[int] = set()
        self.older: list[int] = []

    def entry_finished(self, e: Any) -> None:
        pass

    def entry_conflicted(self, e: Any, what: Any) -> None:
        pass

    def invalidate(self, items: list[tuple[Any, ...]]) -> None:
        self.behind.update(i[1] for i in items if i[0] == "inode")

    def kernel_behind(self, ino: int) -> bool:
        return ino in self.behind

    def kernel_served_older(self, ino: int) -> None:
        self.older.append(ino)

    def reader_closed(self, ino: int) -> None:
        pass

    def committed_size(self, slug: str, rid: str) -> None:
        return None

    def known_record(self, slug: str, rid: str) -> None:
        return None

    def status(self) -> dict[str, Any]:
        return {}


class CoreAndOther:
    """What ``core_and_other`` yields: ``fs`` (workspace ``ws``, its outbox committing to
    ``fake``) with the store ``default`` added as ``sm``, ``client`` its API client, and
    ``other``: the API client of workspace ``other``, attached to the same store, which
    writes "elsewhere". ``feed`` applies what reached the store since the last call."""

    def __init__(self, fake: FakeControlPlane, client: ApiClient, other: ApiClient,
                 journal: Journal, fs: Filesystem) -> None:
        self.fake, self.client, self.other, self.journal, self.fs = fake, client, other, journal, fs
        self.sm: Any = None  # the store ``default``'s state, set once the committer runs
        self.cursor = 0  # the store's change feed read up to here

    async def feed(self) -> list[tuple[Any, ...]]:
        """As ``StoreSync`` does: once this mount's outbox is idle, every change of
        ``default`` after ``cursor`` applied (``Filesystem.apply_remote``), the kernel
        invalidations they need handed to the listener (queued, performed later); returns
        those invalidations."""
        await self.fs.committer.wait_idle()
        page = await self.client.changes("default", self.cursor)
        inv: list[tuple[Any, ...]] = []
        for ch in page.changes:
            inv += self.fs.apply_remote(self.sm, ch.record)
        self.cursor = page.seq
        self.fs.invalidate(inv)
        return inv


@asynccontextmanager
async def core_and_other(tmp: Path, listener: Any = None) -> AsyncIterator[CoreAndOther]:
    """The fake control plane (seed 0) with workspaces ``ws`` and ``other`` on the store
    ``default``, and ``ws``'s ``Filesystem`` (outbox and blob cache in ``tmp``, commit wait
    5 s, ``listener`` as its ``FsListener``, e.g. a ``QueuedKernel``) with its journal and
    committer running in a nursery. Leaving the block cancels them and closes the journal,
    the blob cache, both clients and the fake."""
    fake = FakeControlPlane(seed=0)
    token = await fake.setup("ws", stores=("default",))
    other_token = await fake.setup("other", stores=("default",))
    client = ApiClient(fake.base_url, token, transport=fake.transport, instance="core-test")
    other = ApiClient(fake.base_url, other_token, transport=fake.transport, instance="other")
    journal = Journal(tmp / "outbox.db")
    fs = Filesystem(BlobCache(tmp / "blobs.db"), client, journal, Settings(commit_wait=5), "ws",
                    listener=listener)
    core = CoreAndOther(fake, client, other, journal, fs)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(journal.run)
            await nursery.start(fs.committer.run)
            core.sm = fs.add_store("default", "read_write", [])
            yield core
            nursery.cancel_scope.cancel()
    finally:
        journal.close()
        fs.blobs.close()
        await client.aclose()
        await other.aclose()
        await fake.aclose()
