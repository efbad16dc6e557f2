"""Two mounts create the same new path at the same moment (attack 17 F9; docs/SEMANTICS.md
"Names"): ``open(p, "w")`` / dash's ``echo > p`` (``O_CREAT | O_TRUNC``, no ``O_EXCL``) never
fails ``EEXIST``. The kernel looks the name up absent, then the other mount's create is
applied here before the kernel's CREATE comes: the create opens that file (truncating it),
and the write is last writer wins over a path created elsewhere, with a ``conflict`` line,
the other version kept in history. ``O_EXCL`` and ``mknod`` still get ``EEXIST``; a
directory made there meanwhile gives ``EISDIR``, as on a local disk.

Three layers: the filesystem core with the fake control plane (the window forced by
applying the remote create before ``Filesystem.create``); two real sidecars, one of which
holds its kernel invalidations back so that its kernel keeps the negative entry while its
sidecar applies the other's create (deterministic); and a barrier-released race of many
pairs of real tools on two real mounts.
"""
from __future__ import annotations

import errno
import os
import subprocess
import threading
import uuid
from pathlib import Path

import pytest
import trio

from memfuse.client import ApiClient
from memfuse.fake import FakeControlPlane
from memfuse.sidecar.blobcache import BlobCache
from memfuse.sidecar.core import Filesystem, FsError, Settings
from memfuse.sidecar.inodes import ABSENT_BASE
from memfuse.sidecar.journal import Journal


async def test_a_create_of_a_name_applied_from_elsewhere_meanwhile_opens_it(tmp_path: Path):
    """``Filesystem.create`` of a name the feed made meanwhile: without ``O_EXCL`` it opens
    the file (``O_TRUNC``: emptied; the overwrite is based on no version, so it is last
    writer wins with a conflict, the other version in history); ``O_APPEND`` without
    ``O_TRUNC`` appends to it (no conflict); ``O_EXCL`` is ``EEXIST``; a directory is
    ``EISDIR``."""
    fake = FakeControlPlane(seed=0)
    token = await fake.setup("ws", stores=("default",))
    other_token = await fake.setup("other", stores=("default",))
    client = ApiClient(fake.base_url, token, transport=fake.transport, instance="core-test")
    other = ApiClient(fake.base_url, other_token, transport=fake.transport, instance="other")
    journal = Journal(tmp_path / "outbox.db")
    fs = Filesystem(BlobCache(tmp_path / "blobs.db"), client, journal, Settings(commit_wait=5), "ws")
    cursor = 0

    async def feed() -> None:
        nonlocal cursor
        await fs.committer.wait_idle()
        page = await client.changes("default", cursor)
        for ch in page.changes:
            fs.apply_remote(sm, ch.record)
        cursor = page.seq

    async with trio.open_nursery() as nursery:
        nursery.start_soon(journal.run)
        await nursery.start(fs.committer.run)
        sm = fs.add_store("default", "read_write", [])
        root = sm.root
        rec = await other.create_record("default", "f.md", "theirs\n")
        await other.create_record("default", "g.md", "theirs\n")
        await other.create_record("default", "d/inner.md", "x\n")
        await feed()  # applied here after the kernel looked the names up absent
        n = root.children["f.md"]
        lookups = n.nlookup

        with pytest.raises(FsError) as ei:
            fs.create(root.ino, b"f.md", 0o644, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0, 0)
        assert ei.value.errno == errno.EEXIST
        with pytest.raises(FsError) as ei:
            fs.create(root.ino, b"d", 0o644, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0, 0)
        assert ei.value.errno == errno.EISDIR

        h = fs.create(root.ino, b"f.md", 0o644, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0, 0)
        assert h.node is n and n.nlookup == lookups + 1 and n.cur_size() == 0
        assert n.read_base == ABSENT_BASE
        fs.write(h, 0, b"mine\n")
        await fs.flush(h)
        fs.release(h.fh)

        g = root.children["g.md"]
        h = fs.create(root.ino, b"g.md", 0o644, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0, 0)
        assert h.node is g and g.read_base == ""
        fs.write(h, 0, b"appended\n")
        await fs.flush(h)
        fs.release(h.fh)
        await fs.committer.wait_idle()

        cur = await other.get_record("default", rec.id)
        assert cur.content == "mine\n"  # last writer wins
        assert [v.version for v in await other.versions("default", rec.id)] == [1, 2]
        assert (await other.version("default", rec.id, 1)).content == "theirs\n"  # in history
        assert fs.committer.conflicts == 1  # f.md's; g.md's append is no conflict
        [line] = [e for e in fs.errors if e.get("path") == "f.md"]
        assert line.get("conflict") and "created elsewhere" in line["reason"], line
        recs, _ = await other.snapshot("default", content=True)
        assert {r.path: r.content for r in recs}["g.md"] == "theirs\nappended\n"
        fs.check_invariants()
        nursery.cancel_scope.cancel()
    await client.aclose()
    await other.aclose()
