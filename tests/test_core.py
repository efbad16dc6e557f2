"""The filesystem core without FUSE (the first test layer): ``Filesystem`` driven directly,
its outbox committing to the in-process fake control plane.

Checks invariants that the mount tests see only indirectly: the per-store record count and
byte usage kept incrementally for the quota fast path always equal a full recount, and after
the outbox drains the control plane holds exactly the tree's files.
"""
from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import pytest
import trio
from coreutil import QueuedKernel, core_and_other

from memfuse.client import ApiClient
from memfuse.fake import FakeControlPlane
from memfuse.sidecar.blobcache import BlobCache
from memfuse.sidecar.core import Filesystem, FsError, Settings
from memfuse.sidecar.journal import Journal


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
    fs = Filesystem(BlobCache(tmp_path / "blobs.db"), client, journal, Settings(commit_wait=5),
                    "ws", dirs_file=tmp_path / "dirs.json")
    committer = fs.committer
    rng = random.Random(seed)

    async def close(h) -> None:
        # with faults, a close after a 503 returns without waiting for the commit (the
        # outbox is in backoff): fsync first, so each write still meets the faults alone
        if faults:
            await fs.fsync(h)
        await fs.flush(h)

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
                             "mkdir", "rmdir", "otrunc", "chmod", "utime"])
            try:
                child = d.children.get(name.decode())
                if op == "create" and child is None:
                    h = fs.create(d.ino, name, 0o644, os.O_WRONLY, 0, 0)
                    fs.write(h, 0, rng.randbytes(rng.randint(0, 40)).hex().encode())
                    await close(h)
                    fs.release(h.fh)
                elif op in ("write", "append", "otrunc") and child is not None and not child.is_dir:
                    flags = os.O_WRONLY | (os.O_APPEND if op == "append" else 0) | \
                        (os.O_TRUNC if op == "otrunc" else 0)
                    h = fs.open(child.ino, flags)
                    # offsets within the file: a hole would be NUL bytes, refused (EILSEQ)
                    fs.write(h, rng.randint(0, child.cur_size()), b"x" * rng.randint(1, 30))
                    await close(h)
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
                elif op == "chmod" and child is not None:
                    fs.setattr(child, mode=rng.choice([0o644, 0o600, 0o755, 0o440]))
                elif op == "utime" and child is not None:
                    fs.setattr(child, mtime_ns=rng.choice([1, 10**18, 1577923200_123456789]))
            except FsError:
                pass
            assert (sm.count, sm.used) == recount(fs, "default"), (step, op)
            fs.check_invariants()  # the tables agree after every operation
            local = [n for n in fs._walk_files(sm.root) if n.local_only]
            assert (sm.local_count, sm.local_used) == (len(local), sum(n.cur_size() for n in local))
        with trio.fail_after(30):
            await committer.wait_idle()
        fake.faults.error_rate = fake.faults.drop_rate = 0  # read the result without faults
        records, _ = await client.snapshot("default", content=True)
        remote = {r.path: r.content.encode() for r in records}
        local = tree(fs, "default")
        diff = {k: (remote.get(k), local.get(k)) for k in remote.keys() | local.keys()
                if remote.get(k) != local.get(k)}
        assert not diff, (diff, list(fs.errors)[-5:])
        # the attributes too: mode always, mtime where one was set explicitly
        remote_attrs = {r.path: (r.mode, r.mtime_ns) for r in records}
        local_attrs = {n.path(): (n.mode & 0o7777, n.xmtime) for n in fs._walk_files(sm.root)
                       if not n.local_only}
        assert remote_attrs == local_attrs
        if faults:
            assert fake.counters.errors_503 > 0 and fake.counters.dropped > 0
        # the local-only files kept in the journal are exactly the tree's (LocalFiles)
        fs.sync_local()
        await journal.flush_pending()
        kept = {r["path"]: (r["content"], r["mode"]) for r in journal.load_local()}
        assert kept == {n.path(): (fs._content(n), n.mode & 0o7777)
                        for n in fs._walk_files(sm.root) if n.local_only}
        nursery.cancel_scope.cancel()
    journal.close()
    fs.blobs.close()
    await client.aclose()
    await fake.aclose()


async def test_setattr_sends_only_changes_and_never_content(tmp_path: Path):
    """chmod / utimens of a clean file: one ``attrs`` entry with just the changed member;
    the same value again: none; on a file with unsent writes: carried by its ``put``."""
    fake = FakeControlPlane(seed=0)
    token = await fake.setup("ws", stores=("default",))
    client = ApiClient(fake.base_url, token, transport=fake.transport, instance="core-test")
    journal = Journal(tmp_path / "outbox.db")
    seen: list = []

    class Seen:  # the sidecar's place: told of every finished entry
        def entry_finished(self, e):
            seen.append(e)

        def entry_conflicted(self, e, what):
            pass

        def invalidate(self, items):
            pass

        def committed_size(self, slug, rid):
            return None

        def kernel_behind(self, ino):
            return False

        def status(self):
            return {}

    fs = Filesystem(BlobCache(tmp_path / "blobs.db"), client, journal, Settings(commit_wait=5), "ws",
                    listener=Seen())
    committer = fs.committer
    async with trio.open_nursery() as nursery:
        nursery.start_soon(journal.run)
        await nursery.start(committer.run)
        sm = fs.add_store("default", "read_write", [])
        h = fs.create(sm.root.ino, b"s.sh", 0o600, os.O_WRONLY, 0, 0)  # sed -i's temp file
        fs.write(h, 0, b"#!/bin/sh\n")
        fs.setattr(h.node, mode=0o755)  # fchmod before close: rides with the put
        fs.setattr(h.node, mtime_ns=7)  # futimens after the write (cp -p)
        assert committer.depth() == 0
        await fs.flush(h)
        fs.release(h.fh)
        n = h.node
        put = n.last_put
        assert (put.op, put.args["mode"], put.args["mtime_ns"]) == ("put", 0o755, 7)
        await committer.wait_idle()
        rec = await client.get_record("default", n.record_id)
        assert (rec.mode, rec.mtime_ns, rec.version) == (0o755, 7, 1)
        seen.clear()
        fs.setattr(n, mode=0o755)  # unchanged
        fs.setattr(n, mtime_ns=7)
        fs.setattr(n, uid=n.uid, gid=n.gid, atime_ns=9)  # local only (a no-op chown)
        with pytest.raises(FsError) as ei:  # owners are the mount's: another is refused
            fs.setattr(n, uid=n.uid + 5)
        assert ei.value.errno == errno.EPERM
        assert committer.depth() == 0
        fs.setattr(n, mode=0o700)
        fs.setattr(n, mtime_ns=8)
        assert [(e.op, {k: v for k, v in e.args.items() if k != "path"})
                for e in committer.queues["default"]] == [("attrs", {"mode": 0o700}), ("attrs", {"mtime_ns": 8})]
        await committer.wait_idle()
        assert [e.content for e in seen] == [None, None]
        rec = await client.get_record("default", n.record_id)
        assert (rec.mode, rec.mtime_ns, rec.version) == (0o700, 8, 3)
        assert n.version == 3 and n.state == "clean"
        # a write clears the explicit mtime, the mode stays
        h = fs.open(n.ino, os.O_WRONLY | os.O_APPEND)
        fs.write(h, 0, b"echo\n")
        await fs.flush(h)
        fs.release(h.fh)
        await committer.wait_idle()
        rec = await client.get_record("default", n.record_id)
        assert (rec.mode, rec.mtime_ns, rec.version) == (0o700, None, 4)
        # a change made elsewhere and seen only through a snapshot (after 410): applied,
        # the kernel's attributes invalidated
        async with ApiClient(fake.base_url, token, transport=fake.transport, instance="other") as other:
            await other.set_attributes("default", n.record_id, mode=0o444, mtime_ns=5)
        records, _ = await client.snapshot("default", content=True)
        inv = fs.reconcile_store(sm, records)
        assert (n.mode & 0o7777, n.xmtime, n.mtime_ns) == (0o444, 5, 5) and ("attr", n.ino) in inv
        assert fs.reconcile_store(sm, records) == []
        # a read-only store refuses
        ro = fs.add_store("ro", "read_only", [])
        with pytest.raises(FsError):
            fs.setattr(ro.root, mode=0o700)
        nursery.cancel_scope.cancel()
    journal.close()
    fs.blobs.close()
    await client.aclose()
    await fake.aclose()


async def test_a_damaged_cached_content_is_fetched_again_or_eio_never_other_bytes(tmp_path: Path):
    """A clean file whose cached content was damaged (a byte changed in ``blobs.db``): a read
    raises ``ContentMissing`` (the FUSE guard then calls ``refetch`` and reads once more),
    so does a write on top of it (never a write on other bytes); ``refetch`` brings the
    content back from the control plane and reads are exact; with the control plane
    unreachable, ``refetch`` raises ``FsError(EIO)`` and the damaged bytes are never served."""
    from memfuse.sidecar.core import ContentMissing

    fake = FakeControlPlane(seed=0)
    token = await fake.setup("ws", stores=("default",))
    client = ApiClient(fake.base_url, token, transport=fake.transport, instance="core-test")
    journal = Journal(tmp_path / "outbox.db")
    fs = Filesystem(BlobCache(tmp_path / "blobs.db"), client, journal, Settings(commit_wait=5), "ws")
    content = b"# notes\n" + b"an exact line\n" * 200

    def damage() -> None:  # what a disk or a hand does while the sidecar is stopped
        fs.blobs.write_behind()  # (a stop writes what the cache held in memory)
        fs.blobs._db.execute("UPDATE blobs SET data=CAST(replace(CAST(data AS TEXT), 'exact', 'EXACT') AS BLOB)")
        fs.blobs._verified.clear()  # a new process: nothing checked yet ...
        for sha in list(fs.recent._items):  # ... nor held in memory (recent.RecentContents)
            fs.recent.drop(sha)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(journal.run)
        await nursery.start(fs.committer.run)
        sm = fs.add_store("default", "read_write", [])
        h = fs.create(sm.root.ino, b"n.md", 0o600, os.O_WRONLY, 0, 0)
        fs.write(h, 0, content)
        await fs.flush(h)
        fs.release(h.fh)
        await fs.committer.wait_idle()
        n = h.node
        damage()
        r = fs.open(n.ino, os.O_RDONLY)
        with pytest.raises(ContentMissing):
            fs.read(r, 0, 4096)
        w = fs.open(n.ino, os.O_WRONLY | os.O_APPEND)
        with pytest.raises(ContentMissing):
            fs.write(w, 0, b"more\n")
        assert n.buf is None and not n.dirty
        await fs.refetch(n)
        assert fs.read(r, 0, 1 << 20) == content and fs.read(r, 100, 50) == content[100:150]
        damage()

        class Offline:
            async def get_record(self, *a, **k):
                raise ConnectionError("control plane unreachable")

        fs.client = Offline()
        with pytest.raises(ContentMissing):
            fs.read(r, 0, 4096)
        with pytest.raises(FsError) as ei:
            await fs.refetch(n)
        assert ei.value.errno == errno.EIO
        fs.client = client
        await fs.refetch(n)
        fs.write(w, 0, b"more\n")
        await fs.flush(w)
        fs.release(w.fh)
        fs.release(r.fh)
        await fs.committer.wait_idle()
        rec = await client.get_record("default", n.record_id)
        assert rec.content == (content + b"more\n").decode()
        nursery.cancel_scope.cancel()
    await client.aclose()


async def test_a_reader_served_while_the_kernel_is_behind_is_based_on_what_it_still_shows(tmp_path: Path):
    """docs/SEMANTICS.md "Conflicts": until the kernel invalidation of a remote change
    reaches the kernel (``FsListener.kernel_behind``), a reader may get the pages and size of
    the content before it (``Node.shown``): an open or read meanwhile keeps (or makes) that
    the base of an overwrite, and a read is served that content whole (the kernel cuts
    reads at the size it holds: the current content would reach the reader cut, attack 15
    F1); once the kernel caught up, or was sent the file's attributes (its current size), a
    reader is served the current content. Content this mount wrote itself (no reader since:
    ``unread``) counts too. When the shown content is no longer cached, the reader gets
    the current content and the base is unknown (``UNKNOWN_BASE``)."""
    from memfuse.sidecar.core import sha256_hex
    from memfuse.sidecar.inodes import UNKNOWN_BASE

    kernel = QueuedKernel()  # the sidecar's place: which inodes' invalidations are still queued
    behind, older = kernel.behind, kernel.older
    async with core_and_other(tmp_path, kernel) as core:
        fs, sm, other, feed = core.fs, core.sm, core.other, core.feed
        rec = await other.create_record("default", "f.md", "v1\n")
        await feed()
        n = sm.root.children["f.md"]
        fs.release(fs.open(n.ino, os.O_RDONLY).fh)  # a reader served v1
        await other.update_record("default", rec.id, "v1\nv2\n")
        assert ("inode", n.ino) in await feed()
        v1 = sha256_hex(b"v1\n")
        assert n.read_base == v1 and n.shown == v1 and behind == {n.ino}
        h = fs.open(n.ino, os.O_RDONLY)  # the kernel may still serve v1: v1 stays the base
        assert fs.read(h, 0, 4096) == b"v1\n"  # v1 whole, not v2 cut at v1's size
        assert fs.read(h, 1, 4096) == b"1\n"
        assert n.read_base == v1 and h.replaced == v1 and older == [n.ino, n.ino]
        behind.clear()  # the invalidation reached the kernel
        assert fs.read(h, 0, 4096) == b"v1\nv2\n"
        assert n.read_base == "" and n.shown == "" and not n.unread
        fs.release(h.fh)
        # this mount's own write, which no reader served since (unread)
        h = fs.open(n.ino, os.O_WRONLY | os.O_TRUNC)
        fs.write(h, 0, b"mine\n")
        await fs.flush(h)
        fs.release(h.fh)
        await fs.committer.wait_idle()
        assert n.unread and not n.read_base
        await other.update_record("default", rec.id, "mine\ntheirs\n")
        await feed()
        mine = sha256_hex(b"mine\n")
        assert n.shown == mine and not n.read_base  # no reader was served it...
        fs.release(fs.open(n.ino, os.O_RDONLY).fh)  # ... until one, while the kernel shows it
        assert n.read_base == mine
        fs.kernel_told_size(n)  # a getattr answered: the kernel holds the current size
        h = fs.open(n.ino, os.O_RDONLY)
        assert fs.read(h, 0, 4096) == b"mine\ntheirs\n" and not n.shown
        fs.release(h.fh)
        behind.clear()
        fs.release(fs.open(n.ino, os.O_RDONLY).fh)
        # the content the kernel shows is gone from the cache: the current one is served,
        # and the base of an overwrite is unknown (last writer wins with a conflict line)
        await other.update_record("default", rec.id, "replaced\n")
        await feed()
        cur = sha256_hex(b"mine\ntheirs\n")
        assert n.shown == cur
        fs.recent.drop(cur)
        fs.blobs.gc({n.sha})
        h = fs.open(n.ino, os.O_RDONLY)
        assert fs.read(h, 0, 4096) == b"replaced\n"
        assert n.read_base == UNKNOWN_BASE
        fs.release(h.fh)
        fs.check_invariants()


async def test_readers_that_outlast_the_linger_keep_the_older_content_on_its_inode(tmp_path: Path):
    """attack 17 F1 (``Filesystem.readers_outlasted``, asked once ``READER_LINGER`` passed
    with readers open): a file held only by readers moves to a new inode with the current
    content; the old inode keeps the older content whole for them (no version cut at the
    newer size), refuses an open for writing (``ESTALE``: the kernel looks the name up
    again), keeps the overwrite base while open, and leaves the tables once closed. A file
    also open for writing is not split: its reader, which the kernel may cut at the
    shorter size, holds parts of two versions (``UNKNOWN_BASE``)."""
    from memfuse.sidecar.core import sha256_hex
    from memfuse.sidecar.inodes import UNKNOWN_BASE

    v1 = b"".join(b"v1 line %04d\n" % i for i in range(400))
    kernel = QueuedKernel()  # the sidecar's place: invalidations stay queued (the readers hold them)
    behind = kernel.behind
    async with core_and_other(tmp_path, kernel) as core:
        fs, sm, other, feed = core.fs, core.sm, core.other, core.feed
        rec = await other.create_record("default", "f.md", v1.decode())
        await feed()
        n = sm.root.children["f.md"]
        old_ino = n.ino
        h = fs.open(old_ino, os.O_RDONLY)
        assert fs.read(h, 0, 4096) == v1[:4096]
        await other.update_record("default", rec.id, "v2\n")
        await feed()
        assert behind == {old_ino}
        assert fs.readers_outlasted(old_ino) == [("entry", sm.root.ino, "f.md")]
        behind.clear()  # the old inode's requests are never made (Invalidator: KEPT)
        ghost = fs.inodes[old_ino]
        assert ghost is h.node and ghost.kept and ghost.unlinked and n.ino != old_ino
        assert fs.inodes[n.ino] is n and sm.root.children["f.md"] is n and ghost.record_id is None
        assert fs.read(h, 4096, 1 << 20) == v1[4096:]  # the older content, whole
        with pytest.raises(FsError) as e:
            fs.open(old_ino, os.O_WRONLY)
        assert e.value.errno == errno.ESTALE
        h2 = fs.open(n.ino, os.O_RDONLY)  # the name's inode: the current content
        assert fs.read(h2, 0, 4096) == b"v2\n"
        fs.release(h2.fh)
        assert n.read_base == sha256_hex(v1)  # kept while the older content is open
        fs.check_invariants()
        fs.release(h.fh)
        assert old_ino not in fs.inodes
        fs.release(fs.open(n.ino, os.O_RDONLY).fh)
        assert n.read_base == ""  # the reader of the older content closed: the current one
        # a file also open for writing keeps today's rules: made, its reader marked
        h = fs.open(n.ino, os.O_RDONLY)
        assert fs.read(h, 0, 4096) == b"v2\n"
        w = fs.open(n.ino, os.O_RDWR)
        await other.update_record("default", rec.id, "v3\n")
        await feed()
        assert fs.readers_outlasted(n.ino) is None and n.ino in fs.inodes
        assert h.across == "" and n.read_base == sha256_hex(b"v2\n")  # v3 not shorter
        fs.release(w.fh)
        fs.release(h.fh)
        behind.clear()
        h = fs.open(n.ino, os.O_RDONLY)
        w = fs.open(n.ino, os.O_RDWR)
        assert fs.read(h, 0, 2) == b"v3"
        await other.update_record("default", rec.id, "4\n")  # shorter: the kernel may cut h
        await feed()
        assert fs.readers_outlasted(n.ino) is None
        assert h.across == "mixed" and n.read_base == UNKNOWN_BASE
        fs.release(w.fh)
        fs.release(h.fh)
        fs.check_invariants()


async def test_a_reader_whose_reads_straddle_a_change_is_based_on_what_it_holds(tmp_path: Path):
    """docs/SEMANTICS.md "Conflicts" (verify 11, the silent merge of F3): a handle open for
    reading when a remote change replaces the content (``Handle.replaced``) is checked at
    its next read: a change that extends the content (an append) serves it the current
    content; one that leaves the bytes from the read's offset on as they were leaves it
    holding the older version (the base stays that one); any other leaves it holding parts
    of both: the base is unknown (``UNKNOWN_BASE``), never the newer version."""
    from memfuse.sidecar.core import sha256_hex
    from memfuse.sidecar.inodes import UNKNOWN_BASE

    async with core_and_other(tmp_path) as core:
        fs, sm, other, feed = core.fs, core.sm, core.other, core.feed
        v1 = "".join(f"line {i}\n" for i in range(10))
        for name, v2, off, want in [
            ("append.md", v1 + "A-1\n", 0, "current"),  # an append: the reader reads on into it
            ("head.md", "LINE 0\n" + v1[7:], 7, "old"),  # only bytes before the read changed
            ("mixed.md", v1.replace("line 5\n", "A-1\nline 5\n"), 0, "mixed"),  # parts of both
        ]:
            rec = await other.create_record("default", name, v1)
            await feed()
            n = sm.root.children[name]
            h = fs.open(n.ino, os.O_RDONLY)
            assert fs.read(h, 0, 7) == v1[:7].encode()  # the reader holds v1's first line
            await other.update_record("default", rec.id, v2)
            await feed()
            assert h.replaced == sha256_hex(v1.encode())
            assert fs.read(h, off, 4096) == v2.encode()[off:]
            if want == "current":
                assert n.read_base == "" and not h.replaced
            elif want == "old":
                assert n.read_base == sha256_hex(v1.encode()) and h.across == "old"
            else:
                assert n.read_base == UNKNOWN_BASE and h.across == "mixed"
            fs.release(h.fh)
            fs.check_invariants()


async def test_namespace_changes_in_a_directory_no_longer_in_the_tree_fail_enoent(tmp_path: Path):
    """A directory inode still held (a shell's cwd) but out of the tree: removed here, or its
    store taken out of the mount. create / mknod / mkdir / a rename into it fail ``ENOENT``
    and nothing is queued (attack 14 F4; tests/test_other_mount_told.py has the remote
    prune on real mounts)."""
    fake = FakeControlPlane(seed=0)
    token = await fake.setup("ws", stores=("default", "other"))
    client = ApiClient(fake.base_url, token, transport=fake.transport, instance="core-test")
    journal = Journal(tmp_path / "outbox.db")
    fs = Filesystem(BlobCache(tmp_path / "blobs.db"), client, journal, Settings(commit_wait=5),
                    "ws", dirs_file=tmp_path / "dirs.json")
    sm = fs.add_store("default", "read_write", [])
    top = fs.mkdir(sm.root.ino, b"top", 0o755, 0, 0)
    sub = fs.mkdir(top.ino, b"sub", 0o755, 0, 0)
    h = fs.create(sm.root.ino, b"f.md", 0o644, os.O_WRONLY, 0, 0)
    fs.release(h.fh)
    fs.rmdir(top.ino, b"sub")
    fs.rmdir(sm.root.ino, b"top")
    sm2 = fs.add_store("other", "read_write", [])
    kept = fs.mkdir(sm2.root.ino, b"kept", 0o755, 0, 0)
    fs.remove_store("other")
    depth = fs.committer.depth()
    for d in (top, sub, kept):
        for op in (lambda: fs.create(d.ino, b"here.md", 0o644, os.O_WRONLY, 0, 0),
                   lambda: fs.mkdir(d.ino, b"new", 0o755, 0, 0),
                   lambda: fs.rename(sm.root.ino, b"f.md", d.ino, b"f.md", 0)):
            with pytest.raises(FsError) as e:
                op()
            assert e.value.errno == errno.ENOENT
        assert d.children == {}
    assert [n.path() for n in fs._walk_files(sm.root)] == ["f.md"]
    assert fs.committer.depth() == depth
    fs.check_invariants()
    journal.close()
    fs.blobs.close()
    await client.aclose()
    await fake.aclose()


async def test_a_refetch_never_applies_a_state_older_than_a_local_change_made_meanwhile(
        tmp_path: Path):
    """``StoreSync.refetch_record`` (a commit answer that named a state the tree does not
    show) fetches the record once the store's outbox is idle and applies it once it is idle
    again. A local change committed while the GET was in flight is newer than the state
    fetched: here an unlink. Applied, that older state brought the unlinked file back, clean,
    with the content it had (found by test_properties' ``MountVsLocal``: a rejected file
    renamed, its move's answer asked a refetch, then the file was unlinked)."""
    from types import SimpleNamespace

    from memfuse.sidecar.stores import StoreSync
    fake = FakeControlPlane(seed=0)
    token = await fake.setup("ws", stores=("default",))
    client = ApiClient(fake.base_url, token, transport=fake.transport, instance="core-test")
    journal = Journal(tmp_path / "outbox.db")
    fs = Filesystem(BlobCache(tmp_path / "blobs.db"), client, journal, Settings(commit_wait=5),
                    "ws", dirs_file=tmp_path / "dirs.json")
    unlinked: list[int] = []

    class Racing:  # the control plane's answer arrives after the file was unlinked here
        async def get_record(self, *a, **kw):
            rec = await client.get_record(*a, **kw)
            if not unlinked:
                fs.unlink(sm.root.ino, b"a.md")
                unlinked.append(fs.committer.depth("default"))
            return rec

    async with trio.open_nursery() as nursery:
        nursery.start_soon(journal.run)
        await nursery.start(fs.committer.run)
        sm = fs.add_store("default", "read_write", [])
        h = fs.create(sm.root.ino, b"a.md", 0o644, os.O_WRONLY, 0, 0)
        fs.write(h, 0, b"x\n")
        await fs.flush(h)
        fs.release(h.fh)
        rid = sm.root.children["a.md"].record_id
        assert rid is not None
        host = SimpleNamespace(committer=fs.committer, client=Racing(), fs=fs,
                               invalidator=SimpleNamespace(submit=lambda items: None))
        with trio.fail_after(30):
            await StoreSync.refetch_record(host, "default", rid)  # type: ignore[arg-type]
            await fs.committer.wait_idle()
        assert unlinked == [1]  # the unlink's delete was queued during the GET
        assert list(sm.root.children) == []
        assert (await client.list_records("default")).records == []
        fs.check_invariants()
        nursery.cancel_scope.cancel()
    journal.close()
    fs.blobs.close()
    await client.aclose()
    await fake.aclose()
