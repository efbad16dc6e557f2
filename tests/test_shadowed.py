"""The rule for remote records that local state holds the path of, on a bare core
(``RemoteApply._shadow`` / ``shadow_freed`` / ``unshadow``; docs/SEMANTICS.md, "Remote changes
and local state"), and the directories of a store made again under the same slug
(``RemoteApply.add_store``'s ``created``). The mount-level behaviour is in
test_shadowed_mount."""
from __future__ import annotations

import os
from pathlib import Path

import trio

from memfuse.client import ApiClient
from memfuse.fake import FakeControlPlane
from memfuse.sidecar.blobcache import BlobCache
from memfuse.sidecar.core import Filesystem, Settings
from memfuse.sidecar.journal import Journal


async def test_a_hidden_record_is_said_once_and_shown_once_the_local_state_goes(tmp_path: Path):
    fake = FakeControlPlane(seed=0)
    token = await fake.setup("ws", stores=("default",))
    client = ApiClient(fake.base_url, token, transport=fake.transport, instance="core-test")
    other = ApiClient(fake.base_url, token, transport=fake.transport, instance="other")
    journal = Journal(tmp_path / "outbox.db")
    fs = Filesystem(BlobCache(tmp_path / "blobs.db"), client, journal, Settings(commit_wait=5), "ws")
    cursor = 0

    async def feed() -> list:
        nonlocal cursor
        page = await client.changes("default", cursor, content=True)
        inv = []
        for ch in page.changes:
            inv += fs.apply_remote(sm, ch.record)
        cursor = page.seq
        return inv

    def shadowed_lines() -> list[dict]:
        return [e for e in fs.errors if e.get("shadowed")]

    async with trio.open_nursery() as nursery:
        nursery.start_soon(journal.run)
        sm = fs.add_store("default", "read_write", [])
        root = sm.root
        h = fs.create(root.ino, b"x~", 0o644, os.O_WRONLY, 0, 0)  # local-only
        fs.write(h, 0, b"mine\n")
        await fs.flush(h)
        fs.release(h.fh)
        fs.mkdir(root.ino, b"d", 0o755, 0, 0)
        inner = await other.create_record("default", "x~/in.md", "remote\n")
        await other.create_record("default", "d", "remote file\n")
        gone = await other.create_record("default", "x~/gone.md", "soon deleted\n")
        assert await feed() == []  # nothing shown: local state is in the way of each
        assert set(fs.shadowed["default"]) == {inner.id, gone.id} | {
            r.id for r in (await client.snapshot("default"))[0] if r.path == "d"}
        lines = shadowed_lines()
        assert sorted((e["path"], e["record_path"]) for e in lines) == [
            ("d", "d"), ("x~", "x~/gone.md"), ("x~", "x~/in.md")]
        assert not any("remote" in str(v) for e in lines for k, v in e.items() if k != "reason")
        cursor = 0
        await feed()  # the same states again: not said again
        assert len(shadowed_lines()) == 3
        await other.delete_record("default", gone.id)
        await feed()  # a record deleted elsewhere is no longer waited for
        assert gone.id not in fs.shadowed["default"]
        assert fs.unshadow(sm) == [] and "default" not in fs.unshadow_due  # nothing went yet
        fs.unlink(root.ino, b"x~")
        assert "default" in fs.unshadow_due
        inv = fs.unshadow(sm)
        assert ("entry", root.ino, "x~") in inv
        n = root.children["x~"].children["in.md"]
        assert (n.record_id, n.state, n.size) == (inner.id, "clean", len("remote\n"))
        assert root.children["d"].is_dir  # still in the way of "d"
        fs.rmdir(root.ino, b"d")
        fs.unshadow(sm)
        assert not root.children["d"].is_dir and fs.shadowed["default"] == {}
        assert len(shadowed_lines()) == 3
        nursery.cancel_scope.cancel()
    journal.close()
    fs.blobs.close()
    await other.aclose()
    await client.aclose()
    await fake.aclose()


async def test_a_store_made_again_under_the_same_slug_gets_none_of_the_old_directories(tmp_path: Path):
    journal = Journal(tmp_path / "outbox.db")
    dirs = tmp_path / "dirs.json"
    fs = Filesystem(BlobCache(tmp_path / "blobs.db"), None, journal, Settings(), "ws", dirs_file=dirs)
    sm = fs.add_store("s", "read_write", [], created="2026-01-01T00:00:00+00:00")
    fs.mkdir(sm.root.ino, b"e", 0o700, 0, 0)
    fs.remove_store("s")
    # the same store attached again (same creation time) gets its directory back
    sm = fs.add_store("s", "read_write", [], created="2026-01-01T00:00:00+00:00")
    assert list(sm.root.children) == ["e"]
    fs.remove_store("s")
    # unknown creation time (an offline start): kept
    sm = fs.add_store("s", "read_write", [])
    assert list(sm.root.children) == ["e"]
    fs.remove_store("s")
    # another store of that slug: none
    sm = fs.add_store("s", "read_write", [], created="2026-02-02T00:00:00+00:00")
    assert sm.root.children == {}
    # also after a restart (read back from dirs.json)
    fs2 = Filesystem(BlobCache(tmp_path / "blobs2.db"), None, journal, Settings(), "ws", dirs_file=dirs)
    sm2 = fs2.add_store("s", "read_write", [], created="2026-02-02T00:00:00+00:00")
    assert sm2.root.children == {}
    fs2.blobs.close()
    journal.close()
    fs.blobs.close()
