"""What fsync(2) of a directory promises, on the filesystem core without FUSE (the mount
and power-cut tests are in test_powercut.py, section 5): the directory's own entries are
durable once it returns, those only memory held included (docs/SEMANTICS.md, "Namespace
changes"; attack26 F1, F2).

- A file created, or renamed into the directory, while still open for writing has no
  outbox entry until its close: the directory's fsync commits it as the file's own fsync
  would (what it holds now), with the control plane down, waiting for the journal alone.
  Not the files of a subdirectory, not a file unlinked while open; a refused content is
  kept rejected (never sent) and its writer's close still reports it; a local-only file is
  kept, never sent; so is a new rejected file renamed while being rewritten (its kept row
  named the old path: fsync27). Not a rejected record's file (its record and queued move
  name it), nor an empty file whose creating write its close withdrew (nothing sent), and
  a name whose content is missing from the blob cache is answered ``EIO`` (review27).
- The directory list (``dirs.json``, not fsynced) gets a durable copy
  (``dirs.synced.json``), written once per change of the list, read at start when a power
  cut left ``dirs.json`` unreadable; every write of it keeps the entries of stores not
  mounted at that moment (fsync27).
"""
from __future__ import annotations

import errno
import json
import os
import sqlite3
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from memfuse.client import ApiClient
from memfuse.fake import FakeControlPlane
from memfuse.sidecar.blobcache import BlobCache
from memfuse.sidecar.core import Filesystem, FsError, Settings
from memfuse.sidecar.inodes import PENDING, REJECTED, Handle, Node
from memfuse.sidecar.journal import Entry, Journal


@asynccontextmanager
async def core(tmp: Path) -> AsyncIterator[tuple[FakeControlPlane, Filesystem, ApiClient]]:
    """``ws``'s ``Filesystem`` on the fake control plane (store ``default`` added), its
    journal and committer running; ``dirs.json`` in ``tmp``; a file's fsync would wait 60 s
    for the control plane."""
    fake = FakeControlPlane(seed=26)
    token = await fake.setup("ws", stores=("default",))
    client = ApiClient(fake.base_url, token, transport=fake.transport, instance="fsyncdir-test")
    journal = Journal(tmp / "outbox.db")
    fs = Filesystem(BlobCache(tmp / "blobs.db"), client, journal,
                    Settings(commit_wait=0.2, fsync_timeout=60), "ws", dirs_file=tmp / "dirs.json")
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(journal.run)
            await nursery.start(fs.committer.run)
            fs.add_store("default", "read_write", [])
            yield fake, fs, client
            nursery.cancel_scope.cancel()
    finally:
        journal.close()
        fs.blobs.close()
        await client.aclose()
        await fake.aclose()


def journal_puts(tmp: Path) -> dict[str, str]:
    """The puts on disk in the outbox journal (``outbox.db``, read by another connection,
    as a start after a power cut reads it): node key -> path."""
    db = sqlite3.connect(tmp / "outbox.db")
    try:
        rows = db.execute("SELECT node_key, args FROM entries WHERE op = 'put'").fetchall()
    finally:
        db.close()
    return {k: json.loads(a)["path"] for k, a in rows}


def create(fs: Filesystem, d: Node, name: str, data: bytes) -> Handle:
    h = fs.create(d.ino, name.encode(), 0o644, os.O_WRONLY, 0, 0)
    fs.write(h, 0, data)
    return h


async def fsyncdir(fs: Filesystem, d: Node) -> None:
    h = fs.opendir(d.ino)
    try:
        with trio.fail_after(20):  # a file's fsync would wait fsync_timeout (60 s)
            await fs.fsyncdir(h)
    finally:
        fs.release(h.fh)


async def test_a_directory_fsync_commits_the_open_files_only_memory_names(tmp_path: Path) -> None:
    async with core(tmp_path) as (fake, fs, client):
        root = fs.stores["default"].root
        sub = fs.mkdir(root.ino, b"sub", 0o755, 0, 0)
        fake.faults.outage = True  # the names must be durable without the control plane
        opened = create(fs, root, "open.md", b"open\n")
        fs.rename(root.ino, b"open.md", root.ino, b"open2.md", 0)
        moved = create(fs, sub, "moved.md", b"moved in\n")
        fs.rename(sub.ino, b"moved.md", root.ino, b"moved.md", 0)  # its name is root's now
        stays = create(fs, sub, "stays.md", b"in a subdirectory\n")
        bad = create(fs, root, "bad.md", b"caf\xc3")  # a character cut: judged at close
        swap = create(fs, root, "notes.md~", b"local only\n")
        kept = create(fs, root, ".notes.md.swp", b"kept once\n")
        with trio.fail_after(20):
            await fs.fsync(kept)  # its row names .notes.md.swp
        fs.write(kept, 10, b"more\n")
        fs.rename(root.ino, b".notes.md.swp", root.ino, b".notes.md.swo", 0)  # still being written
        gone = create(fs, root, "gone.md", b"unlinked while open\n")
        fs.unlink(root.ino, b"gone.md")
        await fsyncdir(fs, root)

        assert root.children is not None
        n = {c.name: c for c in root.children.values()}
        on_disk = journal_puts(tmp_path)
        assert on_disk.get(n["open2.md"].key) == "open2.md"
        assert on_disk.get(n["moved.md"].key) == "moved.md"
        assert set(on_disk.values()) == {"open2.md", "moved.md"}  # nothing else sent
        assert n["open2.md"].state == PENDING and not n["open2.md"].dirty
        # a subdirectory's file is not this directory's entry: left to its close
        assert stays.node.dirty and stays.node.last_put is None
        # refused: kept rejected with its name (never sent), judged again at its close
        assert bad.node.state == REJECTED and bad.node.dirty
        assert fs.journal.load_rejected()[0]["path"] == "bad.md"
        assert swap.node.key in fs._local_saved  # kept (its own table), never sent
        assert fs._local_saved[kept.node.key][1] == ".notes.md.swo"  # under its new name
        assert {r["path"]: r["content"] for r in fs.journal.load_local()} == {
            "notes.md~": b"local only\n", ".notes.md.swo": b"kept once\nmore\n"}
        assert gone.node.last_put is None

        with pytest.raises(FsError) as exc:
            await fs.flush(bad)  # its writer still learns it at close
        assert exc.value.errno == errno.EILSEQ
        for h in (opened, moved, stays, swap, kept, gone):
            with trio.fail_after(20):
                await fs.flush(h)  # the outbox is failing: returns once accepted
        for h in (opened, moved, stays, bad, swap, kept, gone):
            fs.release(h.fh)
        fs.check_invariants()
        fake.faults.outage = False
        fs.committer.poke(urgent=True)
        with trio.fail_after(30):
            await fs.committer.wait_idle()
        records, _ = await client.snapshot("default", content=True)
        assert {r.path: r.content for r in records} == {
            "open2.md": "open\n", "moved.md": "moved in\n", "sub/stays.md": "in a subdirectory\n"}
        # one version each: the close after the directory's fsync wrote nothing more
        assert {r.path: r.version for r in records}["open2.md"] == 1


@pytest.mark.parametrize("fsynced_first", [False, True])
async def test_a_directory_fsync_keeps_a_rename_over_a_record_of_a_file_still_open(
        tmp_path: Path, fsynced_first: bool) -> None:
    """``os.replace`` of a temporary still open (``NamedTemporaryFile(delete=False)`` replaced
    inside its ``with``), then the directory's fsync: the target's new content is in the
    outbox journal, under the target's record, before the fsync returns; the close adds no
    version (review26 F1: the put waited for the close, so a kill -9 after the fsync left the
    target's old content, and with the temporary fsynced first its delete only)."""
    async with core(tmp_path) as (fake, fs, client):
        root = fs.stores["default"].root
        old = create(fs, root, "target.md", b"old\n")
        with trio.fail_after(20):
            await fs.flush(old)
        fs.release(old.fh)
        with trio.fail_after(30):
            await fs.committer.wait_idle()
        target_key = old.node.key
        fake.faults.outage = True
        tmp = create(fs, root, "tmpab12.md", b"new\n")
        if fsynced_first:
            with pytest.raises(FsError):  # the control plane is down: EIO after the wait
                fs.settings.fsync_timeout = 0.5
                await fs.fsync(tmp)
            fs.settings.fsync_timeout = 60
        fs.rename(root.ino, b"tmpab12.md", root.ino, b"target.md", 0)
        assert tmp.node.renamed_over
        await fsyncdir(fs, root)
        assert journal_puts(tmp_path).get(target_key) == "target.md"
        assert not tmp.node.renamed_over and not tmp.node.dirty
        with trio.fail_after(20):
            await fs.flush(tmp)
        fs.release(tmp.fh)
        fake.faults.outage = False
        fs.committer.poke(urgent=True)
        with trio.fail_after(30):
            await fs.committer.wait_idle()
        records, _ = await client.snapshot("default", content=True)
        assert [(r.path, r.content, r.version) for r in records] == [("target.md", "new\n", 2)]


async def test_a_directory_fsync_writes_the_rest_at_close(tmp_path: Path) -> None:
    """What the directory's fsync committed is what the file held then; its close commits
    what was written since, as after a file's fsync."""
    async with core(tmp_path) as (fake, fs, client):
        root = fs.stores["default"].root
        h = create(fs, root, "log.md", b"one\n")
        await fsyncdir(fs, root)
        fs.write(h, 4, b"two\n")
        with trio.fail_after(20):
            await fs.flush(h)
        fs.release(h.fh)
        with trio.fail_after(30):
            await fs.committer.wait_idle()
        records, _ = await client.snapshot("default", content=True)
        assert [(r.path, r.content) for r in records] == [("log.md", "one\ntwo\n")]


async def test_a_directory_fsync_makes_the_directory_list_durable_once_per_change(
        tmp_path: Path) -> None:
    dirs, synced = tmp_path / "dirs.json", tmp_path / "dirs.synced.json"
    async with core(tmp_path) as (fake, fs, client):
        root = fs.stores["default"].root
        await fsyncdir(fs, root)
        assert not synced.exists()  # no list to keep
        fs.mkdir(root.ino, b"kept", 0o700, 0, 0)
        await fsyncdir(fs, root)
        assert json.loads(synced.read_text())["default"] == ["kept"]
        ino = synced.stat().st_ino
        await fsyncdir(fs, root)  # nothing changed: not written again (it is replaced)
        assert synced.stat().st_ino == ino
        fs.mkdir(root.ino, b"later", 0o755, 0, 0)  # not fsynced
        assert json.loads(dirs.read_text())["default"] == ["kept", "later"]
        assert json.loads(synced.read_text())["default"] == ["kept"]
        # an older list never replaces a newer one (two writes that outlived their fsyncs)
        fs.dirs_writing = True
        fs.write_dirs_durably('{"default": ["older"]}', fs._dirs_synced - 1)
        assert json.loads(synced.read_text())["default"] == ["kept"]
        assert not fs.dirs_writing and not list(tmp_path.glob(".dirs.synced.json.*"))
    from memfuse.sidecar.namespace import load_dirs  # (here: the module runs on older code)
    # a start reads dirs.json while it is whole (the newest list), the durable copy when a
    # power cut left dirs.json without its bytes
    assert load_dirs(dirs)["default"] == ["kept", "later"]
    # or when the power cut kept an older dirs.json whole (its last rename lost): the list
    # of the higher generation wins, dirs.json on a tie
    whole = json.loads(dirs.read_text())
    older = dict(whole, default=["gone"], _generation=json.loads(synced.read_text())["_generation"] - 1)
    dirs.write_text(json.dumps(older))
    assert load_dirs(dirs)["default"] == ["kept"]
    dirs.write_text(json.dumps(dict(older, _generation=older["_generation"] + 1)))
    assert load_dirs(dirs)["default"] == ["gone"]
    assert whole["_generation"] > json.loads(synced.read_text())["_generation"]
    dirs.write_bytes(b"")
    saved: dict[str, Any] = load_dirs(dirs)
    assert saved["default"] == ["kept"] and saved["_modes"] == {"default": {"kept": 0o700}}
    dirs.unlink()
    synced.unlink()
    assert load_dirs(dirs) == {}


async def test_the_durable_directory_list_is_bounded_one_write_at_a_time_and_fails_with_the_disk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stalled cache disk: the directory's fsync gives up after ``fsync_timeout`` with
    ``EIO`` and the write goes on in its thread; the next fsync starts no second one while
    it runs (a stall piles up no threads), and is answered once it ends. A full disk:
    ``ENOSPC``, with an ``errors.log`` line."""
    async with core(tmp_path) as (fake, fs, client):
        fs.settings.fsync_timeout = 0.3
        root = fs.stores["default"].root
        fs.mkdir(root.ino, b"d", 0o755, 0, 0)
        stalled, calls = threading.Event(), []
        real = fs.write_dirs_durably

        def stalling(text: str, change: int) -> None:
            calls.append(change)
            assert stalled.wait(30)
            real(text, change)
        monkeypatch.setattr(fs, "write_dirs_durably", stalling)
        for _ in range(2):
            with pytest.raises(FsError) as exc:
                await fsyncdir(fs, root)
            assert exc.value.errno == errno.EIO
            line = list(fs.errors)[-1]  # told, at the store's root (review26 F7)
            assert (line["store"], line["path"], line["errno"]) == ("default", ".", "EIO"), line
        assert len(calls) == 1 and fs.dirs_writing
        stalled.set()
        fs.settings.fsync_timeout = 20
        await fsyncdir(fs, root)  # the stalled write ends; it held this change already
        assert len(calls) == 1 and not fs.dirs_writing

        def full(text: str, change: int) -> None:
            fs.dirs_writing = False  # (as write_dirs_durably does when it ends)
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(fs, "write_dirs_durably", full)
        fs.mkdir(root.ino, b"e", 0o755, 0, 0)
        with pytest.raises(FsError) as exc:
            await fsyncdir(fs, root)
        assert exc.value.errno == errno.ENOSPC
        line = list(fs.errors)[-1]
        assert (line["code"], line["store"], line["path"]) == ("cache_disk_full", "default", "."), line
        monkeypatch.setattr(fs, "write_dirs_durably", real)
        await fsyncdir(fs, root)  # space back: written
    assert json.loads((tmp_path / "dirs.synced.json").read_text())["default"] == ["d", "e"]


async def test_the_leftovers_of_a_cut_durable_write_are_removed_only_once_the_cache_is_ours(
        tmp_path: Path) -> None:
    """A temporary file of a durable directory-list write a crash cut short is removed by
    ``remove_dirs_tmp`` (``Sidecar.run`` calls it once it holds the cache's lock), never by
    building a ``Filesystem``: a second start on a cache in use would take a running
    sidecar's file from under its rename (review26 F6)."""
    stray = tmp_path / ".dirs.synced.json.7.tmp"
    stray.write_text("{}")
    async with core(tmp_path) as (fake, fs, client):
        assert stray.exists()
        fs.remove_dirs_tmp()
        assert not stray.exists()


def rejected_paths(tmp: Path) -> list[str]:
    """The paths of the rejected files kept on disk in the outbox journal (its ``rejected``
    table, read by another connection, as a start after a kill -9 reads it)."""
    db = sqlite3.connect(tmp / "outbox.db")
    try:
        return sorted(p for (p,) in db.execute("SELECT path FROM rejected"))
    finally:
        db.close()


async def test_the_directory_list_keeps_the_directories_of_a_store_not_loaded_yet(
        tmp_path: Path) -> None:
    """A start that has not loaded every store yet (an offline start whose saved mirror of
    one store is unreadable: it loads once the control plane answers; a store taken out of
    the mount): every write of the directory list (a directory's fsync, a mkdir) keeps that
    store's entries (its empty directories, their modes, its creation time) as the list read
    at start had them. Before, the list was written from the mounted stores alone: a
    directory's fsync made durable a list without them (dirs.synced.json, of a higher
    generation than dirs.json: the next start lost them) and a mkdir in another store
    dropped them from dirs.json and from memory (lost when the store loaded)."""
    from memfuse.sidecar.namespace import load_dirs
    dirs, synced = tmp_path / "dirs.json", tmp_path / "dirs.synced.json"
    created = "2026-01-01T00:00:00+00:00"
    async with core(tmp_path) as (fake, fs, client):
        other = fs.add_store("other", "read_write", [], created=created)
        fs.mkdir(other.root.ino, b"keep", 0o700, 0, 0)
        await fsyncdir(fs, other.root)
    # the next start: "other" is not loaded (yet)
    async with core(tmp_path) as (fake, fs, client):
        root = fs.stores["default"].root
        fs.mkdir(root.ino, b"made", 0o755, 0, 0)
        await fsyncdir(fs, root)
        for path in (dirs, synced):
            saved = json.loads(path.read_text())
            assert saved["other"] == ["keep"], path
            assert saved["_modes"].get("other") == {"keep": 0o700}, path
            assert saved["_created"].get("other") == created, path
        # the store loads later in the same process: its directory is back
        other = fs.add_store("other", "read_write", [], created=created)
        assert other.root.children is not None and list(other.root.children) == ["keep"]
        assert other.root.children["keep"].mode & 0o777 == 0o700
        fs.remove_store("other")  # taken out of the mount: kept for a later mount of it
        fs.mkdir(root.ino, b"made2", 0o755, 0, 0)
        await fsyncdir(fs, root)
    assert load_dirs(dirs)["other"] == ["keep"]
    dirs.write_bytes(b"")  # a power cut kept dirs.json's name, not its bytes
    saved = load_dirs(dirs)
    assert saved["other"] == ["keep"] and saved["default"] == ["made", "made2"]


@pytest.mark.parametrize("fixed", [False, True])
async def test_a_directory_fsync_keeps_the_new_name_of_a_rejected_file_renamed_while_rewritten(
        tmp_path: Path, fixed: bool) -> None:
    """A rejected file (kept with its name in the journal, ``RejectedFiles``) being rewritten
    and renamed while still open, then the directory's fsync: its name is durable as any
    file's whose name only memory holds (``_names_only_here``): committed as its own fsync
    would, so a fixed content is a put under the new name (the kept row goes) and a content
    still refused is kept rejected under the new name. Before, its kept row named the old
    path until the close (``_rejected_row`` keeps the row of a file being rewritten), so a
    kill -9 after the fsync put it back at its old name."""
    async with core(tmp_path) as (fake, fs, client):
        root = fs.stores["default"].root
        h = create(fs, root, "bad.md", b"caf\xc3")  # a character cut: refused at close
        with pytest.raises(FsError):
            await fs.flush(h)
        fs.release(h.fh)
        n = h.node
        with trio.fail_after(20):
            await fs.journal.barrier().wait_accepted(20)
        assert n.state == REJECTED and rejected_paths(tmp_path) == ["bad.md"]
        fake.faults.outage = True
        w = fs.open(n.ino, os.O_WRONLY | os.O_TRUNC)
        fs.write(w, 0, b"fixed\n" if fixed else b"still caf\xc3")
        fs.rename(root.ino, b"bad.md", root.ino, b"good.md", 0)
        await fsyncdir(fs, root)
        if fixed:
            assert rejected_paths(tmp_path) == []
            assert journal_puts(tmp_path).get(n.key) == "good.md"
            assert n.state == PENDING
        else:
            assert rejected_paths(tmp_path) == ["good.md"]
            assert n.state == REJECTED and n.dirty  # judged again at its close
        fs.release(w.fh)


async def withdrawn(fs: Filesystem, h: Handle, text: bytes, lose_prior: bool = False) -> None:
    """A write of ``h`` committed and withdrawn by its close at once (as
    ``Filesystem._journal_refused`` does): out of the journal's queue, never sent."""
    n = h.node
    fs.write(h, n.cur_size(), text)
    e = fs.commit(n)
    assert isinstance(e, Entry)
    before = e.before  # (let go once the journal wrote it)
    if not await fs.journal.withdraw(e, 10):  # written already: its row goes
        fs.journal.remove(e)  # (on a full disk it never was)
    assert fs.committer.withdraw(e, errno.ENOSPC, "the cache disk is full", "cache_disk_full")
    e.before = before
    if lose_prior:  # nothing here holds what the file showed before it
        e.before = before._replace(put=None, held=None, prefix=-1, state=REJECTED, sha="0" * 64)
    fs._withdraw(n, e)


async def test_a_directory_fsync_and_the_files_whose_close_was_withdrawn(tmp_path: Path) -> None:
    """A file whose close the full cache disk withdrew (``Filesystem._withdraw``): created
    by the write, it is an empty file that no put and no record name, not being written:
    the directory's fsync sends nothing for it (docs/SEMANTICS.md: "nothing sent"; its name
    is kept in memory alone). One whose earlier content is lost keeps the withdrawn content
    rejected (``Node.lost_prior``); renamed while rewritten whole, its kept row names the
    old path: the directory's fsync keeps its new name (``_names_only_here``). (fsync27
    committed the first empty; review27 R1: that empty create met another writer's record
    at the path and replaced its content.)"""
    async with core(tmp_path) as (fake, fs, client):
        root = fs.stores["default"].root
        fake.faults.outage = True
        h = create(fs, root, "empty.md", b"")
        await withdrawn(fs, h, b"refused by the disk\n")
        assert h.node.cur_size() == 0 and not h.node.dirty and h.node.last_put is None
        fs.release(h.fh)
        g = create(fs, root, "lost.md", b"")
        await withdrawn(fs, g, b"held\n", lose_prior=True)
        fs.release(g.fh)
        assert g.node.state == REJECTED and g.node.lost_prior
        w = fs.open(g.node.ino, os.O_WRONLY | os.O_TRUNC)
        fs.write(w, 0, b"whole again\n")
        fs.rename(root.ino, b"lost.md", root.ino, b"found.md", 0)
        await fsyncdir(fs, root)
        puts = journal_puts(tmp_path)
        assert h.node.key not in puts and not h.node.dirty and h.node.last_put is None
        assert puts.get(g.node.key) == "found.md" and rejected_paths(tmp_path) == []
        fs.release(w.fh)


async def test_a_directory_fsync_does_not_send_a_withdrawn_empty_file_over_another_writers_record(
        tmp_path: Path) -> None:
    """review27 R1: a file whose creating write its close withdrew (empty, never sent);
    meanwhile another writer creates a record at that path. A later directory fsync sends
    nothing: the other writer's content stays (fsync27 committed the empty file, whose
    create met ``path_exists`` and replaced that content with '')."""
    async with core(tmp_path) as (fake, fs, client):
        root = fs.stores["default"].root
        fake.faults.outage = True
        h = create(fs, root, "notes.md", b"")
        await withdrawn(fs, h, b"refused by the disk\n")
        fs.release(h.fh)
        assert h.node.cur_size() == 0 and h.node.last_put is None and not h.node.dirty
        fake.faults.outage = False
        await client.create_record("default", "notes.md", "theirs\n")
        await fsyncdir(fs, root)
        assert h.node.key not in journal_puts(tmp_path)
        fs.committer.poke(urgent=True)
        with trio.fail_after(30):
            await fs.committer.wait_idle()
        records, _ = await client.snapshot("default", content=True)
        assert {r.path: r.content for r in records} == {"notes.md": "theirs\n"}


async def test_a_directory_fsync_sends_nothing_for_a_rejected_record_another_handle_rewrites(
        tmp_path: Path) -> None:
    """review27 R2: a record whose update was refused (kept rejected, the record holds v1)
    opened O_TRUNC with nothing written yet and renamed while open, then the directory's
    fsync: its record and the queued move name it, so nothing is committed (fsync27
    committed the emptied file, an empty version nobody wrote: the rewrite's handle's own
    fsync commits nothing, ``rewritten_by_another``)."""
    async with core(tmp_path) as (fake, fs, client):
        root = fs.stores["default"].root
        h = create(fs, root, "bad.md", b"v1\n")
        with trio.fail_after(20):
            await fs.flush(h)
        fs.release(h.fh)
        with trio.fail_after(30):
            await fs.committer.wait_idle()
        n = h.node
        u = fs.open(n.ino, os.O_WRONLY | os.O_TRUNC)
        fs.write(u, 0, b"caf\xc3")
        with pytest.raises(FsError):
            await fs.flush(u)
        fs.release(u.fh)
        assert n.state == REJECTED and n.record_id
        with trio.fail_after(20):
            await fs.journal.barrier().wait_accepted(20)
        w = fs.open(n.ino, os.O_WRONLY | os.O_TRUNC)  # nothing written through it yet
        fs.rename(root.ino, b"bad.md", root.ino, b"good.md", 0)
        await fsyncdir(fs, root)
        sent = journal_puts(tmp_path).get(n.key)
        fs.write(w, 0, b"still caf\xc3")
        with pytest.raises(FsError):
            await fs.flush(w)
        fs.release(w.fh)
        fs.committer.poke(urgent=True)
        with trio.fail_after(30):
            await fs.committer.wait_idle()
        records, _ = await client.snapshot("default", content=True)
        got = {r.path: (r.content, r.version) for r in records}
        assert sent is None and got == {"good.md": ("v1\n", 2)}, (sent, got)


async def test_a_directory_fsync_answers_eio_for_a_name_whose_content_is_missing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """review27 R5: a local-only file (its content in the blob cache) open by a reader,
    renamed over a record: the target's new content waits for the close
    (``renamed_over``). Its blob missing (a damaged cache), the directory's fsync cannot
    keep it: ``EIO`` and an ``errors.log`` line, not 0 (``ContentMissing`` is an
    ``FsError`` and was taken for a refusal kept rejected)."""
    async with core(tmp_path) as (fake, fs, client):
        root = fs.stores["default"].root
        t = create(fs, root, "x.md", b"old\n")
        with trio.fail_after(20):
            await fs.flush(t)
        fs.release(t.fh)
        with trio.fail_after(30):
            await fs.committer.wait_idle()
        s = create(fs, root, ".x.md.swp", b"new content\n")
        with trio.fail_after(20):
            await fs.flush(s)
        fs.release(s.fh)
        n = s.node
        assert n.buf is None and n.sha
        r = fs.open(n.ino, os.O_RDONLY)  # a reader keeps it open
        fs.rename(root.ino, b".x.md.swp", root.ino, b"x.md", 0)
        assert n.dirty and n.renamed_over
        real = fs.blobs.get
        monkeypatch.setattr(fs.blobs, "get", lambda sha: None if sha == n.sha else real(sha))
        fs.recent.drop(n.sha)
        fake.faults.outage = True
        lines = len(fs.errors)
        with pytest.raises(FsError) as exc:
            await fsyncdir(fs, root)
        assert exc.value.errno == errno.EIO
        assert len(fs.errors) > lines
        fs.release(r.fh)


async def test_a_directory_fsync_keeps_a_new_file_whose_write_was_refused_in_its_session(
        tmp_path: Path) -> None:
    """A file created and written, one of its writes refused at write(2) (here ``EFBIG``:
    past the store's ``max_record_bytes``), still open: ``state=rejected`` with no kept row
    yet (its close keeps it). The directory's fsync keeps it rejected with its name, as
    docs/SEMANTICS.md says of "a write refused in the session". Before, ``_names_only_here``
    left out every rejected file (assumed kept with its name already): nothing named it,
    and a kill -9 after the fsync lost it."""
    async with core(tmp_path) as (fake, fs, client):
        root = fs.stores["default"].root
        fs.stores["default"].max_record_bytes = 10
        h = create(fs, root, "big.md", b"12345\n")
        with pytest.raises(FsError) as exc:
            fs.write(h, 6, b"past the limit\n")
        assert exc.value.errno == errno.EFBIG
        assert h.node.state == REJECTED and h.node.dirty
        await fsyncdir(fs, root)
        assert rejected_paths(tmp_path) == ["big.md"] and journal_puts(tmp_path) == {}
        with pytest.raises(FsError) as exc:
            await fs.flush(h)  # its writer still learns it at close
        assert exc.value.errno == errno.EFBIG
        fs.release(h.fh)


async def test_the_directory_list_holds_only_directories_made_here(tmp_path: Path) -> None:
    """review27 R4: the directory list holds the directories made here (mkdir, or kept from
    the list), not those only implied by records. Before, it held every directory: one
    implied by a record deleted elsewhere while the store was out of the mount came back,
    when it was mounted again, as an empty directory made here (SEMANTICS: an emptied
    implied directory leaves no empty shell). A directory made here that holds records
    stays made: its records going elsewhere leave it, as mkdir's."""
    async with core(tmp_path) as (fake, fs, client):
        rec = await client.create_record("default", "notes/a.md", "a\n")
        await client.create_record("default", "made/b.md", "b\n")
        records, _ = await client.snapshot("default", content=True)
        fs.remove_store("default")
        sm = fs.add_store("default", "read_write", records)
        assert sm.root.children is not None
        made = sm.root.children["made"]
        made.made = True  # as if made here by mkdir before its record was written in it
        fs.mkdir(sm.root.ino, b"empty", 0o755, 0, 0)  # any save of the list
        saved = json.loads((tmp_path / "dirs.json").read_text())
        assert saved["default"] == ["empty", "made"] and saved["_made_only"] == ["default"]
        fs.remove_store("default")
        await client.delete_record("default", rec.id)  # elsewhere, while out of the mount
        records, _ = await client.snapshot("default", content=True)
        sm = fs.add_store("default", "read_write", records)
        assert sm.root.children is not None
        assert sorted(sm.root.children) == ["empty", "made"]
        assert sm.root.children["made"].made  # holds a record, made here: stays made


async def test_a_restart_brings_back_no_directory_only_records_implied(tmp_path: Path) -> None:
    """review27 R4b: R4 across a restart (the record deleted elsewhere while the sidecar was
    down): the next start shows the directory made here, not the implied one."""
    async with core(tmp_path) as (fake, fs, client):
        await client.create_record("default", "notes/a.md", "a\n")
        records, _ = await client.snapshot("default", content=True)
        fs.remove_store("default")
        sm = fs.add_store("default", "read_write", records)
        fs.mkdir(sm.root.ino, b"made", 0o755, 0, 0)
        await fsyncdir(fs, sm.root)
    async with core(tmp_path) as (fake, fs, client):  # a new control plane: no records
        sm = fs.stores["default"]
        assert sm.root.children is not None and sorted(sm.root.children) == ["made"]


async def test_a_directory_list_written_before_keeps_implied_directories_implied(
        tmp_path: Path) -> None:
    """A list written before review27 R4 (every directory, no ``_made_only``): at load, a
    listed directory no record implies comes back made (an empty one kept, as before); one
    records imply is left implied, and the next write of the list leaves it out."""
    (tmp_path / "dirs.json").write_text(json.dumps({"default": ["empty", "notes"]}))
    async with core(tmp_path) as (fake, fs, client):
        await client.create_record("default", "notes/a.md", "a\n")
        records, _ = await client.snapshot("default", content=True)
        fs.remove_store("default")
        sm = fs.add_store("default", "read_write", records)
        assert sm.root.children is not None
        assert sm.root.children["empty"].made and not sm.root.children["notes"].made
        fs.mkdir(sm.root.ino, b"new", 0o755, 0, 0)
        assert json.loads((tmp_path / "dirs.json").read_text())["default"] == ["empty", "new"]
