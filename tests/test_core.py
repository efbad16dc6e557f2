"""The filesystem core without FUSE (the first test layer): ``Filesystem`` driven directly,
its outbox committing to the in-process fake control plane.

Checks invariants that the mount tests see only indirectly: the per-store record count and
byte usage kept incrementally for the quota fast path always equal a full recount, and after
the outbox drains the control plane holds exactly the tree's files.
"""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import trio

from memfuse.client import ApiClient
from memfuse.fake import FakeControlPlane
from memfuse.sidecar.core import BlobCache, Filesystem, FsError, Settings
from memfuse.sidecar.outbox import Committer, Journal


def recount(fs: Filesystem, slug: str) -> tuple[int, int]:
    sm = fs.stores[slug]
    files = [n for n in fs._walk_files(sm.root) if not n.local_only]
    return len(files), sum(n.cur_size() for n in files)


def tree(fs: Filesystem, slug: str) -> dict[str, bytes]:
    sm = fs.stores[slug]
    return {n.path(): fs._content(n) for n in fs._walk_files(sm.root) if not n.local_only}


@pytest.mark.parametrize("seed,faults", [(1, False), (2, False), (3, True), (4, True)])
async def test_random_ops_keep_counters_and_reach_the_control_plane(tmp_path: Path, seed: int,
                                                                   faults: bool):
    fake = FakeControlPlane(seed=seed)
    token = await fake.setup("ws", stores=("default",))
    if faults:  # 10 % 503 and 5 % lost responses: the outcome must be the same
        fake.faults.error_rate, fake.faults.drop_rate = 0.1, 0.05
    client = ApiClient(fake.base_url, token, transport=fake.transport, instance="core-test")
    journal = Journal(tmp_path / "outbox.db")
    committer = Committer(client, journal, {})
    fs = Filesystem(BlobCache(tmp_path / "blobs.db"), committer, Settings(commit_wait=5),
                    "ws", dirs_file=tmp_path / "dirs.json")
    rng = random.Random(seed)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(journal.run)
        await nursery.start(committer.run)
        sm = fs.add_store("default", "read_write", [])
        root = sm.root
        names = ["a.md", "b.md", "c.md", "a.md~", ".a.md.swp", "d"]
        for step in range(300):
            dirs = [root] + [n for n in fs.inodes.values() if n.is_dir and n.store is sm
                             and not n.unlinked and n is not root]
            d = rng.choice(dirs)
            name = rng.choice(names).encode()
            op = rng.choice(["create", "write", "append", "truncate", "rename", "unlink",
                             "mkdir", "rmdir", "otrunc"])
            try:
                child = d.children.get(name.decode())
                if op == "create" and child is None:
                    h = fs.create(d.ino, name, 0o644, os.O_WRONLY, 0, 0)
                    fs.write(h, 0, rng.randbytes(rng.randint(0, 40)).hex().encode())
                    await fs.flush(h)
                    fs.release(h.fh)
                elif op in ("write", "append", "otrunc") and child is not None and not child.is_dir:
                    flags = os.O_WRONLY | (os.O_APPEND if op == "append" else 0) | \
                        (os.O_TRUNC if op == "otrunc" else 0)
                    h = fs.open(child.ino, flags)
                    # offsets within the file: a hole would be NUL bytes, refused (EILSEQ)
                    fs.write(h, rng.randint(0, child.cur_size()), b"x" * rng.randint(1, 30))
                    await fs.flush(h)
                    fs.release(h.fh)
                elif op == "truncate" and child is not None and not child.is_dir:
                    fs.truncate(child, rng.randint(0, child.cur_size()))
                    fs.commit(child)
                elif op == "rename" and child is not None:
                    target = rng.choice(dirs)
                    fs.rename(d.ino, name, target.ino, rng.choice(names).encode(), rng.choice([0, 1]))
                elif op == "unlink" and child is not None and not child.is_dir:
                    fs.unlink(d.ino, name)
                elif op == "mkdir" and child is None:
                    fs.mkdir(d.ino, name, 0o755, 0, 0)
                elif op == "rmdir" and child is not None and child.is_dir:
                    fs.rmdir(d.ino, name)
            except FsError:
                pass
            assert (sm.count, sm.used) == recount(fs, "default"), (step, op)
        with trio.fail_after(30):
            await committer.wait_idle()
        fake.faults.error_rate = fake.faults.drop_rate = 0  # read the result without faults
        records, _ = await client.snapshot("default", content=True)
        remote = {r.path: r.content.encode() for r in records}
        local = tree(fs, "default")
        diff = {k: (remote.get(k), local.get(k)) for k in remote.keys() | local.keys()
                if remote.get(k) != local.get(k)}
        assert not diff, (diff, list(fs.errors)[-5:])
        if faults:
            assert fake.counters.errors_503 > 0 and fake.counters.dropped > 0
        nursery.cancel_scope.cancel()
    journal.close()
    fs.blobs.close()
    await client.aclose()
    await fake.aclose()
