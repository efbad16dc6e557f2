"""The store mirror's log: a save appends what changed since the previous one to
``<slug>.log``; a load replays it on the base ``<slug>.json``.

- unit: replay equals the state after every save, and the base is not rewritten by an
  append; a torn or garbage tail is ignored (and cut off by the next append); a log of
  another base (left over from before a rewrite, or next to an earlier release's base) is
  ignored; compaction rewrites the base when the log passes its share, from a snapshot,
  with the changes made while the worker thread writes landing in the old log and then the
  new one, and a reset during it making another rewrite;
- real mount: a sidecar killed (``kill -9``) between appends, with a torn frame after the
  last one, restarts from base + log (resumed, not a snapshot) and shows the control
  plane's records.
"""
from __future__ import annotations

import json
import os
import threading
import time

import trio

from memfuse.sidecar import sync
from memfuse.sidecar.sync import StoreState
from memfuse.wire import Change, Operation
from mountutil import ControlPlane, Sidecar, live_records, sh
from test_bigstore import _loaded, _wait, rec


def _same(st: StoreState, path=None) -> StoreState:
    again = StoreState(path or st.path, st.slug)
    assert again.load() and not again.dirty
    assert again.records == st.records
    assert (again.cursor, again.access, again.limits) == (st.cursor, st.access, st.limits)
    return again


def _change(st: StoreState, step: int) -> None:
    """A mix of feed changes, own commits and removals."""
    i = step * 7
    st.apply(Change(seq=st.cursor + 1, operation=Operation.modified,
                    record=rec(i % 300, version=10 + step, content=f"v{step}\n")))
    st.apply(Change(seq=st.cursor + 1, operation=Operation.deleted,
                    record=rec((i + 3) % 300, version=99, deleted=True)))
    st.put(rec(1000 + step, path=f"new/{step}.md"))
    st.remove(f"id-{(i + 5) % 300:04d}")


def test_appends_replay_to_the_state_and_leave_the_base_alone(tmp_path):
    st = StoreState(tmp_path / "s.json", "s")
    st.reset([rec(i) for i in range(300)], 5)
    st.save()
    base = st.path.read_bytes()
    assert json.loads(base)["base"] and st.log_path.stat().st_size < 100
    sizes = []
    for step in range(20):
        _change(st, step)
        if step == 10:
            st.access, st.limits, st.dirty = "read_only", {"max_records": 7}, True
        before = st.log_path.stat().st_size
        st.save()
        sizes.append(st.log_path.stat().st_size - before)
        assert st.path.read_bytes() == base  # an append never rewrites the base
        _same(st)
    assert max(sizes) < 1000  # ~4 records per save: bytes in proportion to them
    # an unchanged mirror saved again: a frame of the cursor alone
    st.dirty = True
    st.save()
    _same(st)


def test_a_torn_or_garbage_tail_is_ignored_and_cut_off(tmp_path):
    st = StoreState(tmp_path / "s.json", "s")
    st.reset([rec(i) for i in range(100)], 5)
    st.save()
    _change(st, 1)
    st.save()
    good = st.log_path.read_bytes()
    older = {k: v for k, v in st.records.items()}, st.cursor
    _change(st, 2)
    st.save()
    full = st.log_path.read_bytes()
    frame = full[len(good):]
    # every cut inside the last frame: the state of the frame before
    for cut in (1, sync._FRAME.size - 1, sync._FRAME.size, len(frame) // 2, len(frame) - 1):
        st.log_path.write_bytes(good + frame[:cut])
        again = StoreState(st.path, "s")
        assert again.load() and (again.records, again.cursor) == older, cut
    # a flipped byte in the last frame (CRC), zeros (a power loss), random bytes: ignored
    spoiled = bytearray(full)
    spoiled[-3] ^= 0xFF
    for tail in (bytes(spoiled), full + bytes(4096), full + os.urandom(300),
                 full + sync._frame(b"\xc1")):  # a frame whose check passes but does not decode
        st.log_path.write_bytes(tail)
        again = StoreState(st.path, "s")
        assert again.load()
        want = older if tail is not None and len(tail) == len(full) else (st.records, st.cursor)
        assert (again.records, again.cursor) == want
    # the next append cuts the garbage off first: a later load sees the new frame
    st.log_path.write_bytes(full + os.urandom(300))
    again = StoreState(st.path, "s")
    assert again.load()
    _change(again, 3)
    again.save()
    assert again.log_path.stat().st_size < len(full) + 1000
    _same(again)


def test_a_log_of_another_base_is_ignored(tmp_path):
    st = StoreState(tmp_path / "s.json", "s")
    st.reset([rec(i) for i in range(50)], 5)
    st.save()
    _change(st, 1)
    st.save()
    old_log = st.log_path.read_bytes()
    st.reset([rec(i) for i in range(20)], 9)  # a snapshot: the base is rewritten
    st.save()
    base_only = {k: v for k, v in st.records.items()}
    st.log_path.write_bytes(old_log)  # the previous base's log, left behind by a crash
    again = StoreState(st.path, "s")
    assert again.load() and again.records == base_only and again.cursor == 9
    # the next append starts a log of the right base
    again.put(rec(77))
    again.save()
    _same(again)
    # an earlier release's base (no id) with a log next to it: the log is not applied
    raw = json.loads(st.path.read_text())
    del raw["base"]
    st.path.write_text(json.dumps(raw))
    st.log_path.write_bytes(old_log)
    again = StoreState(st.path, "s")
    assert again.load() and again.records == base_only and again.dirty  # rewritten at next save
    assert again.compaction_due()


def test_compaction_rewrites_the_base_off_the_trio_thread(tmp_path, monkeypatch):
    monkeypatch.setattr(sync, "LOG_MIN", 2000)
    st = StoreState(tmp_path / "s.json", "s")
    st.reset([rec(i) for i in range(300)], 5)
    trio.run(st.save_async)
    first = json.loads(st.path.read_text())["base"]
    step = 0
    while True:
        _change(st, step)
        if st.compaction_due():
            break
        trio.run(st.save_async)  # an append
        step += 1
        assert step < 100
    assert json.loads(st.path.read_text())["base"] == first and step > 2
    while st._log_size <= max(sync.LOG_MIN, st._base_bytes * sync.LOG_FRACTION):
        st.save()  # a save on the calling thread (an unmount, the stop) appends even then
        _change(st, step)
        step += 1
    st.save()
    assert json.loads(st.path.read_text())["base"] == first and st.compaction_due()
    _same(st)
    # the rewrite runs in a worker thread; changes made meanwhile go to the old log (still
    # valid) and then start the new one
    entered, go = threading.Event(), threading.Event()
    write_base = st._write_base
    threads = []

    def slow_write(snap):
        threads.append(threading.current_thread())
        entered.set()
        assert go.wait(10)
        return write_base(snap)

    monkeypatch.setattr(st, "_write_base", slow_write)

    async def main():
        async with trio.open_nursery() as n:
            n.start_soon(st.save_async)
            await trio.to_thread.run_sync(entered.wait, 10)
            _change(st, 100)
            st.save()  # e.g. an unmount: an append to the old log
            _same(st)  # old base + old log = the state
            _change(st, 101)
            go.set()
    trio.run(main)
    assert threads[0] is not threading.main_thread()
    assert json.loads(st.path.read_text())["base"] != first
    assert st.log_path.stat().st_size < 2000 and not st.compaction_due() and not st.dirty
    _same(st)
    # a reset while the rewrite runs: that base is stale, the next save rewrites again
    entered.clear(), go.clear()

    async def reset_during():
        async with trio.open_nursery() as n:
            n.start_soon(st.save_async)
            st._base_id = None  # force the rewrite
            await trio.to_thread.run_sync(entered.wait, 10)
            st.save()  # no base of the new mirror yet and one being written: nothing
            st.reset([rec(i) for i in range(10)], 50)
            go.set()
    st.dirty = True
    trio.run(reset_during)
    assert st.dirty and st.compaction_due()
    go.set()
    trio.run(st.save_async)
    assert not st.dirty
    again = _same(st)
    assert len(again.records) == 10 and again.cursor == 50
    # a save_async (an unmount) while the saver's compaction runs waits for it to finish
    entered.clear(), go.clear()
    done = []

    async def unmount_during():
        async with trio.open_nursery() as n:
            st._base_id, st.dirty = None, True
            n.start_soon(st.save_async)
            await trio.to_thread.run_sync(entered.wait, 10)

            async def unmount():
                await st.save_async()
                done.append(st._compacting)
            n.start_soon(unmount)
            await trio.sleep(0.1)
            assert done == []  # still waiting for the compaction
            _change(st, 200)
            go.set()
    trio.run(unmount_during)
    assert done == [False] and not st.dirty
    _same(st)


# ------------------------------------------------------------------ real mount
def test_kill_9_between_appends_resumes_from_base_and_log(tmp_path):
    cp = ControlPlane(tmp_path).start()
    sc = None
    mnt, cache = tmp_path / "mnt", tmp_path / "cache"
    try:
        tok = cp.setup_workspace("ws")
        for i in range(30):
            cp.call("create_record", "default", f"d/n{i}.md", f"note {i}\n")
        sc = Sidecar(cp, "ws", tok, mnt, cache).start()
        root = mnt / "default"
        _wait(lambda: len(os.listdir(root / "d")) == 30, "the records")
        base = cache / "stores" / "default.json"
        logf = cache / "stores" / "default.log"
        _wait(lambda: logf.exists() and base.exists(), "the first save")
        base_bytes = base.read_bytes()
        # a local write, a remote change, a remote delete: each reaches the log in a save
        sh("printf 'local\\n' > d/n1.md", root)
        live = live_records(cp)
        cp.call("update_record", "default", live["d/n2.md"].id, "remote\n")
        cp.call("delete_record", "default", live["d/n3.md"].id)
        _wait(lambda: (root / "d" / "n2.md").read_text() == "remote\n"
              and not (root / "d" / "n3.md").exists(), "the feed")
        _wait(lambda: live_records(cp)["d/n1.md"].content == "local\n", "the commit")
        size = logf.stat().st_size
        _wait(lambda: logf.stat().st_size > size or _saved(cache) == _cp(cp), "a save", 10)
        _wait(lambda: _saved(cache) == _cp(cp), "the log to hold every change", 10)
        assert base.read_bytes() == base_bytes  # appended, not rewritten
        sc.kill9()
        sc = None
        # a crash in the middle of the next append: half a frame after the last one
        with logf.open("ab") as f:
            f.write(sync._frame(b"x" * 100)[:60])
        cp.call("create_record", "default", "d/while-down.md", "made while down\n")
        sc = Sidecar(cp, "ws", tok, mnt, cache).start()
        assert _loaded(sc)[-1]["resumed"] is True
        shown = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
        assert shown == set(live_records(cp))
        assert (root / "d" / "n1.md").read_text() == "local\n"
        assert (root / "d" / "while-down.md").read_text() == "made while down\n"
        assert sc.stop() == 0
        sc = None
        assert _saved(cache) == _cp(cp)
    finally:
        if sc is not None:
            sc.stop()
        cp.stop()


def _saved(cache) -> dict:
    st = StoreState(cache / "stores" / "default.json", "default")
    if not st.load():
        return {}
    return {m.path: (m.id, m.sha256) for m in st.records.values()}


def _cp(cp) -> dict:
    return {p: (r.id, r.sha256) for p, r in live_records(cp).items()}


def test_a_base_encoded_in_chunks_is_the_same_json(tmp_path, monkeypatch):
    st = StoreState(tmp_path / "s.json", "s")
    st.reset([rec(i) for i in range(50)], 5)
    whole = json.loads(st.encode())
    monkeypatch.setattr(sync, "_CHUNK", 7)  # 50 records: 8 pieces per column
    snap = st._snapshot()
    chunked = json.loads(st.encode(snap))
    assert chunked["base"] == snap.base and chunked["columns"] == whole["columns"]
    assert chunked["columns"]["sha256"] == "".join(m.sha256 for m in st.records.values())
    assert chunked["columns"]["id"] == list(st.records)
    st.save()
    _same(st)


def test_a_big_batch_of_changes_goes_into_a_compaction(tmp_path):
    st = StoreState(tmp_path / "s.json", "s")
    st.reset([rec(i, path=f"d/{'x' * 200}{i}.md") for i in range(2000)], 5)  # a base > 256 KiB
    trio.run(st.save_async)
    assert st._base_bytes * sync.LOG_FRACTION > sync.LOG_MIN
    first = json.loads(st.path.read_text())["base"]
    _change(st, 1)
    assert not st.compaction_due()  # a few records: an append
    trio.run(st.save_async)
    assert json.loads(st.path.read_text())["base"] == first
    for i in range(600):  # ~30 % of the records: more than a quarter of the base as a frame
        st.put(rec(i, path=f"d/{'x' * 200}{i}.md", version=50, content=f"batch {i}\n"))
    assert st.compaction_due()
    trio.run(st.save_async)
    assert json.loads(st.path.read_text())["base"] != first
    assert st.log_path.stat().st_size < 100
    _same(st)


# ------------------------------------------------------------------ unit: contents carried
def test_a_frame_carries_the_contents_held_behind_instead_of_writing_them(tmp_path):
    """A close's save (``save_log``) writes no blob-cache transaction: the frame carries the
    content the blob cache holds only in memory, and a load after a ``kill -9`` (the
    contents behind never written) stores it in the blob cache, checked against its digest.
    More than ``CARRY_MAX`` bytes are written to the blob cache first; a base (compaction)
    carries nothing: the contents behind are written before its snapshot."""
    from memfuse.defs import sha256_hex
    from memfuse.sidecar.blobcache import BlobCache

    blobs = BlobCache(tmp_path / "blobs.db")
    st = StoreState(tmp_path / "s.json", "s", blobs=blobs)
    st.reset([rec(i) for i in range(20)], 20)
    st.save()  # the base
    fresh = "written here\n"
    sha = sha256_hex(fresh.encode())
    blobs.put_behind(fresh.encode(), sha)  # the close's content (Filesystem.commit)
    st.put(rec(500, path="new.md", content=fresh))
    writes = blobs._db.total_changes
    assert st.save_log()
    assert blobs._db.total_changes == writes, "a blob-cache transaction per close"
    assert sha in blobs._behind  # still only in memory
    # kill -9: the contents behind are lost with the process; the log carried them
    crashed = BlobCache(tmp_path / "blobs.db")
    assert crashed.missing_digests([bytes.fromhex(sha)])
    again = StoreState(st.path, "s", blobs=crashed)
    assert again.load() and again.records == st.records
    assert not crashed.missing_digests([bytes.fromhex(sha)])
    assert crashed.get(sha) == fresh.encode()
    # a carried content that does not hash to its digest is not stored
    forged = "forged\n"
    fsha = sha256_hex(forged.encode())
    blobs.put_behind(b"other bytes\n", fsha)
    st.put(rec(501, path="forged.md", content=forged))
    assert st.save_log()
    crashed2 = BlobCache(tmp_path / "blobs.db")
    assert StoreState(st.path, "s", blobs=crashed2).load()
    assert crashed2.missing_digests([bytes.fromhex(fsha)])
    # past CARRY_MAX: written to the blob cache first, nothing carried
    big = "x" * (sync.CARRY_MAX + 1)
    bsha = sha256_hex(big.encode())
    blobs.put_behind(big.encode(), bsha)
    st.put(rec(502, path="big.md", content=big))
    carried = st._log_carried
    assert st.save_log()
    assert st._log_carried == carried and bsha not in blobs._behind
    assert not BlobCache(tmp_path / "blobs.db").missing_digests([bytes.fromhex(bsha)])
    # a compaction's base names no content held only in memory
    late = "late\n"
    lsha = sha256_hex(late.encode())
    blobs.put_behind(late.encode(), lsha)
    st.put(rec(503, path="late.md", content=late))
    trio.run(st.compact)
    assert lsha not in blobs._behind
    assert not BlobCache(tmp_path / "blobs.db").missing_digests([bytes.fromhex(lsha)])
