"""The sidecar's layers one at a time, without FUSE (the S3QL manner): what
tests/test_faults.py (journal, 410, supervision) and tests/test_core.py (random operations
through the core) leave out.

- remote-apply: ``Filesystem.apply_remote`` rule by rule (newer versions only, a dirty file is
  never overwritten, a local file at the path is kept, moves and deletes with the kernel
  invalidations they return, the store's counters);
- feed / store state: ``StoreState`` (feed changes, own commits, save and load) and
  ``catch_up`` against the fake, with a ``410`` injected;
- committer: lost responses (the request applied, the answer dropped) and concurrent edits
  (``If-Match`` races) from the fake's fault injection: one version per write, conflicts
  resolved last-writer-wins and reported to ``entry_conflicted``.
"""
from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

import trio

from memfuse.client import ApiClient
from memfuse.fake import FakeControlPlane
from memfuse.wire import Change, Operation, Record, sha256_hex
from memfuse.sidecar.blobcache import BlobCache
from memfuse.sidecar.core import CLEAN, Filesystem
from memfuse.sidecar.committer import Committer
from memfuse.sidecar.journal import PUT, Entry, Journal
from memfuse.sidecar.sync import StoreState, catch_up


class Offline:
    """A client stand-in: these tests never reach a control plane through it."""

    def __getattr__(self, name):
        raise AssertionError(f"no control plane in this test ({name})")


T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def rec(rid: str, path: str, content: str, version: int = 1, deleted: bool = False) -> Record:
    data = content.encode()
    return Record(id=rid, store="default", path=path, type="project", version=version,
                  sha256=sha256_hex(data), size=len(data), deleted=deleted,
                  created_at=T0, updated_at=T0, updated_by="ws:other", seq=0, content=content)


def make_fs(tmp_path: Path, records: list[Record] = ()) -> Filesystem:
    j = Journal(tmp_path / "outbox.db")
    fs = Filesystem(BlobCache(tmp_path / "blobs.db"), Offline(), j)
    fs.add_store("default", "read_write", list(records))
    return fs


def tree(fs: Filesystem) -> dict[str, bytes]:
    sm = fs.stores["default"]
    return {n.path(): fs._content(n) for n in fs._walk_files(sm.root)}


def counters_ok(fs: Filesystem) -> bool:
    sm = fs.stores["default"]
    files = [n for n in fs._walk_files(sm.root) if not n.local_only]
    return sm.count == len(files) and sm.used == sum(n.cur_size() for n in files)


# ------------------------------------------------------------------ remote-apply
def test_apply_remote_newer_versions_only_with_invalidations(tmp_path):
    fs = make_fs(tmp_path, [rec("r1", "a.md", "one\n")])
    sm = fs.stores["default"]
    n = fs.by_rid["r1"]
    assert fs.apply_remote(sm, rec("r1", "a.md", "stale\n", version=1)) == []  # not newer
    inv = fs.apply_remote(sm, rec("r1", "a.md", "two, longer\n", version=2))
    assert inv == [("inode", n.ino)]
    assert tree(fs) == {"a.md": b"two, longer\n"} and n.version == 2 and n.state == CLEAN
    assert counters_ok(fs)
    # a new record in a new directory: the directory and the file appear
    inv = fs.apply_remote(sm, rec("r2", "d/b.md", "bee\n"))
    d = sm.root.children["d"]
    assert ("entry", sm.root.ino, "d") in inv and ("entry", d.ino, "b.md") in inv
    assert tree(fs)["d/b.md"] == b"bee\n" and counters_ok(fs)


def test_apply_remote_never_overwrites_a_dirty_file_or_a_local_one(tmp_path):
    fs = make_fs(tmp_path, [rec("r1", "a.md", "one\n")])
    sm = fs.stores["default"]
    h = fs.open(fs.by_rid["r1"].ino, os.O_WRONLY | os.O_TRUNC)
    fs.write(h, 0, b"mine\n")  # not flushed: dirty
    assert fs.apply_remote(sm, rec("r1", "a.md", "theirs\n", version=5)) == []
    assert tree(fs)["a.md"] == b"mine\n"
    fs.release(h.fh)  # commits it locally (the outbox holds the put)
    # a file created here and not committed yet holds the path: the remote record waits
    h = fs.create(sm.root.ino, b"new.md", 0o644, os.O_WRONLY, 0, 0)
    fs.write(h, 0, b"local\n")
    assert fs.apply_remote(sm, rec("r9", "new.md", "remote\n")) == []
    assert tree(fs)["new.md"] == b"local\n"
    fs.release(h.fh)
    assert counters_ok(fs)


def test_apply_remote_moves_and_deletes(tmp_path):
    fs = make_fs(tmp_path, [rec("r1", "a.md", "one\n"), rec("r2", "b.md", "two\n")])
    sm = fs.stores["default"]
    n = fs.by_rid["r1"]
    inv = fs.apply_remote(sm, rec("r1", "x/y/a.md", "one\n", version=2))
    assert ("entry", sm.root.ino, "a.md") in inv  # the old name is invalidated
    assert n.path() == "x/y/a.md" and fs.by_rid["r1"] is n  # the same inode moved
    inv = fs.apply_remote(sm, rec("r2", "b.md", "two\n", version=2, deleted=True))
    assert inv == [("entry", sm.root.ino, "b.md")]
    assert tree(fs) == {"x/y/a.md": b"one\n"} and "r2" not in fs.by_rid
    assert counters_ok(fs)
    # a snapshot (force) at the same version does not undo a local version it cannot know
    n.state = "pending"
    assert fs.apply_remote(sm, rec("r1", "a.md", "one\n", version=2), force=True) == []
    assert n.path() == "x/y/a.md"


# ------------------------------------------------------------------ feed / store state
def test_store_state_feed_own_commits_and_save_load(tmp_path):
    st = StoreState(tmp_path / "default.json", "default")
    st.reset([rec("r1", "a.md", "one\n")], 3)
    st.apply(Change(seq=4, operation=Operation.created, record=rec("r2", "b.md", "two\n")))
    st.apply(Change(seq=5, operation=Operation.modified, record=rec("r1", "a.md", "old\n", version=1)))  # same version: kept
    st.apply(Change(seq=6, operation=Operation.deleted, record=rec("r2", "b.md", "", version=2, deleted=True)))
    assert set(st.records) == {"r1"} and st.cursor == 6

    class Committed:  # an outbox entry that committed: put / delete
        errno = 0
        op, record, record_id, moved = PUT, rec("r3", "c.md", "three\n"), None, []
    st.committed(Committed())
    assert set(st.records) == {"r1", "r3"}
    st.save()
    again = StoreState(tmp_path / "default.json", "default")
    assert again.load() and again.cursor == 6 and set(again.records) == {"r1", "r3"}
    assert again.records["r3"].sha256 == rec("r3", "c.md", "three\n").sha256


async def test_catch_up_from_the_fake_and_410(tmp_path):
    fake = FakeControlPlane(seed=7)
    token = await fake.setup("ws")
    blobs = BlobCache(tmp_path / "blobs.db")
    async with ApiClient(fake.base_url, token,
                         transport=fake.transport) as api:
        for i in range(3):
            await api.create_record("default", f"f{i}.md", f"{i}\n")
        st = StoreState(tmp_path / "s.json", "default")
        st.reset([], 0)
        assert await catch_up(api, st, blobs)
        assert len(st.records) == 3 and all(blobs.has(m.sha256) for m in st.records.values())
        fake.faults.inject.append(("GET", r"/changes$", 410))
        assert not await catch_up(api, st, blobs)  # the caller takes a snapshot
    blobs.close()


# ------------------------------------------------------------------ committer
async def test_replayed_put_that_applied_is_not_coalesced_into_the_next(tmp_path):
    """A put the previous process sent (applied; its answer lost with the process) is sent
    again on replay with its idempotency key, never absorbed by the next put of the same file:
    that one, sent on the older base, would merge the applied lines a second time."""
    fake = FakeControlPlane(seed=3)
    token = await fake.setup("ws")
    async with ApiClient(fake.base_url, token, transport=fake.transport) as api:
        rec = await api.create_record("default", "a.md", "r0\n")
        e1 = Entry(id=1, store="default", op=PUT, node_key="n:a", args={"path": "a.md"},
                   content=b"r0\nr1\n")
        e2 = Entry(id=2, store="default", op=PUT, node_key="n:a", args={"path": "a.md"},
                   content=b"r0\nr1\nr2\n")
        # the previous process sent e1 and was killed before the answer came
        await api.update_record("default", rec.id, "r0\nr1\n", if_match=rec.sha256,
                                idempotency_key=e1.key)
        j = Journal(tmp_path / "outbox.db")
        blobs = {rec.sha256: b"r0\n"}  # the blob cache: the base of an append's rebase
        c = Committer(api, j, {"n:a": (rec.id, rec.sha256)}, base_content=blobs.get)
        c.replay([e1, e2])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(j.run)
            await nursery.start(c.run)
            with trio.fail_after(30):
                await c.wait_idle()
            nursery.cancel_scope.cancel()
        recs, _ = await api.snapshot("default", content=True)
        versions = await api.versions("default", rec.id)
    assert [(r.path, r.content) for r in recs] == [("a.md", "r0\nr1\nr2\n")]
    assert len(versions) == 3 and e1.errno == 0 == e2.errno
    j.close()


async def test_committer_lost_responses_and_races_give_one_version_per_write(tmp_path):
    fake = FakeControlPlane(seed=11)
    token = await fake.setup("ws")
    conflicts: list[str] = []
    results = []
    async with ApiClient(fake.base_url, token,
                         transport=fake.transport) as api:
        j = Journal(tmp_path / "outbox.db")
        class Listener:  # a CommitListener
            def entry_finished(self, e):
                results.append(e)

            def entry_conflicted(self, e, what):
                conflicts.append(what)

        c = Committer(api, j, {}, Listener())
        async with trio.open_nursery() as nursery:
            nursery.start_soon(j.run)
            await nursery.start(c.run)
            fake.faults.drop_rate = 0.5  # half the answers are lost after the write applied
            for i in range(6):  # one at a time: queued together they would be coalesced
                c.submit("default", PUT, "n:a", {"path": "a.md"}, f"v{i}\n".encode())
                with trio.fail_after(30):
                    await c.wait_idle()
            fake.faults.drop_rate = 0.0
            fake.faults.precondition_race = 1  # someone else edits before the next If-Match
            c.submit("default", PUT, "n:a", {"path": "a.md"}, b"last\n")
            with trio.fail_after(30):
                await c.wait_idle()
            nursery.cancel_scope.cancel()
        recs, _ = await api.snapshot("default", content=True)
        assert [(r.path, r.content) for r in recs] == [("a.md", "last\n")]
        versions = await api.versions("default", recs[0].id)
    assert fake.counters.dropped >= 1 and fake.counters.races == 1
    assert all(e.errno == 0 for e in results) and len(results) == 7
    # one version per write (a lost answer never made a second one), plus the racing edit
    assert len(versions) == 7 + 1
    assert len(conflicts) == 1 and "changed elsewhere" in conflicts[0]
    j.close()


async def test_journal_load_defers_exactly_the_puts_the_committer_absorbs(tmp_path):
    """``Journal.load`` reads no content of a put that the replayed queue's coalescing
    absorbs (``journal.superseded``, the rule of ``Committer._coalesce``), reads every other
    put's, and a deferred put that is sent after all gets its content from the journal."""
    import random

    from memfuse.sidecar.journal import ATTRS, DELETE, MOVE, MOVE_PREFIX

    rnd = random.Random(7)
    for run in range(40):
        path = tmp_path / f"outbox-{run}.db"
        j = Journal(path)
        written: dict[int, bytes] = {}
        for i in range(1, rnd.randint(2, 60)):
            store = rnd.choice(["s", "t"])
            op = rnd.choice([PUT] * 6 + [DELETE, MOVE, ATTRS, MOVE_PREFIX])
            key = None if op == MOVE_PREFIX else f"n:{rnd.randint(1, 3)}"
            args: dict = {"path": "p.md"}
            if op == MOVE and rnd.random() < 0.5:
                args["target_key"] = f"n:{rnd.randint(1, 3)}"
            data = f"{run}-{i}\n".encode() if op == PUT else None
            if data is not None:
                written[i] = data
            j.add(Entry(id=i, store=store, op=op, node_key=key, args=args, content=data))
        await j.flush_pending()
        j.close()
        j = Journal(path)
        entries, _ = j.load()
        c = Committer(None, j, {})  # type: ignore[arg-type]  # no request is sent here
        c.replay(entries)
        absorbed = set()
        for store, q in c.queues.items():
            c._coalesce(store, q)
            absorbed |= {a.id for e in q for a in e.absorbed}
        assert {e.id for e in entries if e.deferred} == absorbed
        for e in entries:
            if e.op == PUT and not e.deferred:
                assert e.content == written[e.id]
            if e.deferred:
                c.fill(e)
                assert e.content == written[e.id] and not e.deferred
        j.close()


def test_witness_reads_lost_entries_and_bases_with_a_cut_last_line(tmp_path):
    """``Witness.unfinished``: the accepted entries neither finished nor in the journal, in
    order; the base of each node key's earliest unfinished entry; a last line cut by a crash
    skipped."""
    from memfuse.sidecar.witness import Witness

    w = Witness(tmp_path / "accepted.log")
    lines = []
    for i in range(1, 7):
        lines.append({"i": i, "k": f"k{i}", "s": "s", "o": "put", "n": f"r:{i % 2}",
                      "a": {"path": f'p"{i}.md'}, "t": 1.0, "h": None,
                      "r": f"rec{i % 2}", "b": f"base{i}"})
    w.append(lines[:5] + [{"d": 1}, {"m": "r:0", "r": "rec0", "h": "h0"}])
    with open(w.path, "a") as f:  # the sixth entry's line, cut by a crash
        f.write(json.dumps(lines[5], separators=(",", ":"))[:40])
    lost, keys, top = w.unfinished(present={2, 3})
    # the cut line stands for its entry (it may have been accepted): named, never replayed
    assert [x["i"] for x in lost] == [4, 5, 6] and lost[0]["a"] == {"path": 'p"4.md'}
    assert lost[2]["damaged"] and lost[2]["h"] is None and lost[2]["s"] == "s"
    assert keys == {"r:0": ("rec0", "h0")} and top == 6 and w.damaged == 0
    # r:0's key-map line (a commit learnt) is newer than its entries: the key map is its base
    assert w.bases == {"r:1": ("rec1", "base3")}
    w.close()


def test_damaged_witness_lines_are_never_fatal_nor_silent(tmp_path):
    """attack17 F5: a witness line of JSON of another shape (``{"i":"x"}``: the start used to
    crash on ``int("x")``) or of garbage is counted in ``damaged``, never fatal; a line cut
    after its entry id stands for that entry (a placeholder with the store, op and path its
    text still holds), never replayed; a line of a finished entry cut or not stays finished."""
    from memfuse.sidecar.witness import Witness

    w = Witness(tmp_path / "accepted.log")
    good = {"i": 1, "k": "k1", "s": "notes", "o": "put", "n": "n:a", "a": {"path": "a.md"},
            "t": 1.0, "h": "h1", "r": None, "b": None}
    cut = json.dumps({**good, "i": 7, "k": "k7", "a": {"path": "wit005.md"}},
                     separators=(",", ":"))[:75]
    with open(w.path, "w") as f:
        f.write("\n".join([
            json.dumps(good, separators=(",", ":")),
            '{"i":"x","k":null,"s":5}',  # JSON, of another shape
            '{"i":3,"k":null,"s":5}',  # an integer id, the rest of another shape
            '{"d":"1"}', '{"m":5}', "[1,2,3]", "\x00\x01garbage", "",
            cut,  # cut after its path: the store, op and path still read
            '{"i":9',  # cut inside its id: which entry cannot be known
        ]) + "\n")
    lost, keys, top = w.unfinished(present=set())
    assert w.damaged == 7 and keys == {} and top == 7
    assert [x["i"] for x in lost] == [1, 7]
    assert lost[0] == good
    assert lost[1]["damaged"] and lost[1]["h"] is None
    assert (lost[1]["s"], lost[1]["o"], lost[1]["a"]) == ("notes", "put", {"path": "wit005.md"})
    w.close()


def test_witness_base_is_the_version_seen_after_the_last_commit(tmp_path):
    """``Witness.bases``: a key whose unfinished entries were accepted after its last key-map
    line (our own commit) gets the base they were written on (a remote change seen since,
    memory only in ``RecordIds``); one whose key-map line is newer gets none (the key map)."""
    from memfuse.sidecar.witness import Witness

    w = Witness(tmp_path / "accepted.log")

    def entry(i: int, node_key: str, rid: str | None, base: str | None) -> dict:
        # in the order Journal.add writes it (the head Witness.unfinished reads)
        return {"i": i, "k": f"k{i}", "s": "s", "o": "put", "n": node_key, "a": {"path": "f.md"},
                "t": 1.0, "h": None, "r": rid, "b": base}

    w.append([entry(1, "n:a", None, None), {"m": "n:a", "r": "rec", "h": "own"}, {"d": 1},
              entry(2, "n:a", "rec", "remote"),  # written after a remote change seen
              entry(3, "n:a", "rec", "remote"),
              entry(4, "n:b", "recb", "b0"), entry(5, "n:b", "recb", "b0"),
              {"m": "n:b", "r": "recb", "h": "b4"}, {"d": 4}])  # 4 committed while 5 waited
    lost, keys, top = w.unfinished(present={2, 3, 5})
    assert lost == [] and top == 5 and keys == {"n:a": ("rec", "own"), "n:b": ("recb", "b4")}
    assert w.bases == {"n:a": ("rec", "remote")}
    w.close()
