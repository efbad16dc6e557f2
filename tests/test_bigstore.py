"""Big stores: the sidecar's saved mirror (format 3, and format 2 of earlier releases), a
warm restart with many records, remote changes around it, and the lean tree's identities.

- unit: a format-2 mirror loads (same records, times to the µs) and is rewritten as format 3;
  a broken format-3 file is refused (a snapshot follows); the tree shares the mirror's
  strings and keeps a record's outbox key when its id changes;
- real mount: 400 records with versions, modes and explicit mtimes, mounted fresh, then warm
  (from the saved mirror), then warm from a format-2 mirror: every file shows its record's
  size, mode, mtime, id, version and sha256; changes made while the sidecar was down arrive
  by catch-up, a change after the warm mount by the feed, and a local write to a record
  loaded from the mirror commits conditionally on the mirror's sha256 (no conflict).
"""
from __future__ import annotations

import json
import os
import stat
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import trio

from memfuse.client import ApiClient
from memfuse.sidecar.blobcache import BlobCache
from memfuse.sidecar.core import Filesystem
from memfuse.sidecar.identity import RecordIds
from memfuse.sidecar.journal import Journal
from memfuse.sidecar.sync import Meta, StoreState
from memfuse.wire import Record, datetime_ns, sha256_hex
from mountutil import ControlPlane, Rig, Sidecar, live_records, sh

EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
T0 = datetime(2026, 11, 30, 12, 0, 0, 123456, tzinfo=timezone.utc)


def rec(i: int, **kw) -> Record:
    content = kw.pop("content", f"note {i}\n")
    base = dict(id=f"id-{i:04d}", store="s", path=f"d{i % 7}/n{i}.md", type="project", version=1 + i % 3,
                sha256=sha256_hex(content.encode()), size=len(content.encode()), created_at=T0,
                updated_at=T0, updated_by="t", seq=i, mode=0o600 if i % 5 == 0 else 0o644,
                mtime_ns=10**18 + i if i % 4 == 0 else None)
    base.update(kw)
    return Record(**base)


# ------------------------------------------------------------------ unit: the saved mirror
def test_format_2_mirror_is_read_and_rewritten_as_format_4(tmp_path):
    records = [rec(i) for i in range(50)] + [rec(50, type=None, path="MEMORY.md")]
    rows = [[r.id, r.path, r.type, r.version, r.sha256, r.size, r.updated_at.isoformat(), r.mode, r.mtime_ns]
            for r in records]
    rows.append(["old-7", "old.md", "user", 2, "ab" * 32, 3, T0.isoformat()])  # 7 members: before attributes
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"format": 2, "cursor": 42, "access": "read_only",
                             "limits": {"max_records": 9}, "records": rows}))
    st = StoreState(f, "s")
    assert st.load() and st.dirty  # an old format is written anew at the next save
    assert (st.cursor, st.access, st.limits) == (42, "read_only", {"max_records": 9})
    for r in records:
        m = st.records[r.id]
        assert (m.path, m.type, m.version, m.sha256, m.size, m.mode, m.mtime_ns) == (
            r.path, r.type, r.version, r.sha256, r.size, r.mode, r.mtime_ns)
        assert m.updated_ns == datetime_ns(T0) and m.updated_at == T0
    assert (st.records["old-7"].mode, st.records["old-7"].mtime_ns) == (0o644, None)
    st.save()
    raw = json.loads(f.read_text())
    assert raw["format"] == 4 and "records" not in raw and len(raw["columns"]["id"]) == 52
    again = StoreState(f, "s")
    assert again.load() and not again.dirty
    assert again.records == st.records and again.cursor == 42
    assert (again.access, again.limits) == ("read_only", {"max_records": 9})


def test_format_3_mirror_is_read_and_rewritten_as_format_4(tmp_path):
    records = [rec(i) for i in range(30)] + [rec(30, type=None, path="MEMORY.md")]
    cols = {"id": [r.id for r in records], "path": [r.path for r in records],
            "type": [r.type for r in records], "version": [r.version for r in records],
            "sha256": [r.sha256 for r in records], "size": [r.size for r in records],
            "updated_ns": [datetime_ns(r.updated_at) for r in records],
            "mode": [r.mode for r in records], "mtime_ns": [r.mtime_ns for r in records]}
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"format": 3, "cursor": 7, "access": "read_write", "limits": {},
                             "columns": cols}))
    st = StoreState(f, "s")
    assert st.load() and st.dirty and st.cursor == 7
    assert st.records == {r.id: Meta.of(r) for r in records}
    st.save()
    raw = json.loads(f.read_text())
    assert raw["format"] == 4 and [
        f"{raw['dirs'][d]}/{n}" if raw["dirs"][d] else n
        for d, n in zip(raw["columns"]["dir"], raw["columns"]["name"])] == cols["path"]
    assert raw["columns"]["sha256"] == "".join(cols["sha256"])
    assert sorted(raw["types"], key=str) == sorted({"project", None}, key=str)
    assert sorted(raw["modes"]) == [0o600, 0o644]
    assert [raw["types"][i] for i in raw["columns"]["type"]] == cols["type"]
    assert [raw["modes"][i] for i in raw["columns"]["mode"]] == cols["mode"]
    again = StoreState(f, "s")
    assert again.load() and not again.dirty and again.records == st.records
    # the loaded mirror holds one object per type and per mode, whatever the record count
    assert len({id(m.type) for m in again.records.values()}) == 2
    assert len({id(m.mode) for m in again.records.values()}) == 2


def test_broken_mirror_is_refused(tmp_path):
    st = StoreState(tmp_path / "s.json", "s")
    st.reset([rec(i) for i in range(5)], 7)
    st.save()
    raw = json.loads(st.path.read_text())
    assert raw["format"] == 4
    breakages = {
        "short": lambda b: b["columns"]["name"].pop(),
        "dir index": lambda b: b["columns"]["dir"].__setitem__(0, len(b["dirs"])),
        "short digests": lambda b: b["columns"].update(sha256=b["columns"]["sha256"][:-2]),
        "not hex": lambda b: b["columns"].update(sha256="zz" + b["columns"]["sha256"][2:]),
        "spaces": lambda b: b["columns"].update(sha256="  " + b["columns"]["sha256"][2:]),
        "type": lambda b: b["columns"]["size"].__setitem__(0, "12"),
        "type index": lambda b: b["columns"]["type"].__setitem__(0, len(b["types"])),
        "negative index": lambda b: b["columns"]["mode"].__setitem__(0, -1),
        "no table": lambda b: b.pop("modes"),
        "not an object": lambda b: b.clear(),
    }
    for breakage, spoil in breakages.items():
        bad = json.loads(json.dumps(raw))
        spoil(bad)
        st.path.write_text(json.dumps(bad if bad else []))
        again = StoreState(st.path, "s")
        assert not again.load() and again.records == {} and again.cursor == 0, breakage
    # format 3 (earlier releases) is checked as strictly
    cols3 = {"id": [m.id for m in st.records.values()], "path": [m.path for m in st.records.values()],
             "type": ["project"] * 5, "version": [1] * 5, "sha256": [m.sha256 for m in st.records.values()],
             "size": [1] * 5, "updated_ns": [1] * 5, "mode": [0o644] * 5, "mtime_ns": [None] * 5}
    for breakage in ("short", "type"):
        bad = {"format": 3, "cursor": 7, "columns": json.loads(json.dumps(cols3))}
        if breakage == "short":
            bad["columns"]["sha256"].pop()
        else:
            bad["columns"]["size"][0] = "12"
        st.path.write_text(json.dumps(bad))
        again = StoreState(st.path, "s")
        assert not again.load() and again.records == {} and again.cursor == 0, breakage


def test_tree_shares_the_mirror_and_keeps_a_records_key_when_its_id_changes(tmp_path):
    journal = Journal(tmp_path / "outbox.db")
    _, keymap = journal.load()
    fs = Filesystem(BlobCache(tmp_path / "blobs.db"), None, journal, ids=RecordIds(journal, keymap))
    st = StoreState(tmp_path / "s.json", "s")
    records = [rec(i) for i in range(20)]
    st.reset(records, 1)
    sm = fs.add_store("s", "read_write", list(st.records.values()),
                      contents={r.id: f"note {r.id}".encode() for r in records})
    # content given for records whose sha differs is stored under the record's sha256
    n = fs.by_rid["id-0003"]
    m = st.records["id-0003"]
    assert n.record_id is m.id and n._sha is m.sha and n.sha == m.sha256 and n.updated_ns is m.updated_ns
    assert n.name is m.name and n.path() == m.path == "d3/n3.md"
    # one directory string per directory, whatever the number of its records
    assert len({id(x.dir) for x in st.records.values()}) == len({x.dir for x in st.records.values()}) == 7
    assert n.key == "r:id-0003" and fs.node_by_key("r:id-0003") is n and "r:id-0003" not in fs.by_key
    assert fs.ids.map == {}  # nothing per record until a record is written
    assert (stat.S_IMODE(fs.by_rid["id-0005"].mode), fs.by_rid["id-0004"].mtime_ns) == (0o600, 10**18 + 4)
    assert fs.getxattr(n, "user.memfuse.updated_at") == T0.isoformat().encode()
    assert fs.getxattr(n, "user.memfuse.version") == str(m.version).encode()
    # the record is re-created elsewhere under a new id: the file's outbox key stays
    fs._bind_rid(n, "id-new")
    assert n.key == "r:id-0003" and fs.node_by_key("r:id-0003") is n and fs.by_rid["id-new"] is n
    assert fs.node_by_key("r:id-new") is None
    assert sm.count == 20
    # the first write of a loaded record: its clean sha256 is the base of the update
    w = fs.by_rid["id-0007"]
    base = w.sha
    h = fs.open(w.ino, os.O_WRONLY | os.O_TRUNC)
    fs.write(h, 0, b"new content\n")
    e = fs.commit(w)
    assert e is not None and fs.ids.map["r:id-0007"] == ("id-0007", base)
    assert fs.committer.ids.get("r:id-0007", "s") == ("id-0007", base)
    # a record the keymap does not know: the sidecar's mirror gives the base
    fs.ids.base_sha = lambda store, rid: st.sha_of(rid) if store == "s" else None
    assert fs.committer.ids.get("r:id-0008", "s") == ("id-0008", st.records["id-0008"].sha256)
    assert fs.committer.ids.get("r:unknown", "s") == ("unknown", None)
    # a node of a record that is gone is no key's node
    other = fs.by_rid["id-0004"]
    fs._detach(other)
    fs._bind_rid(other, None)
    assert fs.node_by_key("r:id-0004") is other  # until the kernel forgets it
    other.nlookup = 0
    fs._drop_if_unused(other)
    assert fs.node_by_key("r:id-0004") is None


# ------------------------------------------------------------------ real mount
N = 400


async def _populate(cp: ControlPlane) -> None:
    async with ApiClient(cp.url, cp.admin_token) as c:
        sem = trio.Semaphore(16)

        async def one(i: int) -> None:
            async with sem:
                r = await c.create_record("default", f"d{i % 9}/e{i % 3}/note-{i:04d}.md",
                                          f"# note {i}\n" + "word " * (i % 50) + "\n")
                if i % 7 == 0:
                    r = await c.update_record("default", r.id, f"# note {i} v2\n", if_match=r.sha256)
                if i % 11 == 0:
                    await c.set_attributes("default", r.id, mode=0o600)
                if i % 13 == 0:
                    await c.set_attributes("default", r.id, mtime_ns=1_600_000_000_123_456_789 + i)
        async with trio.open_nursery() as nursery:
            for i in range(N):
                nursery.start_soon(one, i)


def _check_every_record(cp: ControlPlane, root: Path) -> dict:
    """Every live record shows in the mount with its size, mode, mtime, id, version and
    sha256; returns path → Record."""
    live = live_records(cp)
    shown = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
    assert shown == set(live), (sorted(shown ^ set(live))[:5])
    for path, r in live.items():
        p = root / path
        st = os.stat(p)
        want_mtime = r.mtime_ns if r.mtime_ns is not None else datetime_ns(r.updated_at)
        assert (st.st_size, stat.S_IMODE(st.st_mode), st.st_mtime_ns) == (r.size, r.mode, want_mtime), path
        assert os.getxattr(p, "user.memfuse.id").decode() == r.id
        assert os.getxattr(p, "user.memfuse.version").decode() == str(r.version)
        assert os.getxattr(p, "user.memfuse.sha256").decode() == r.sha256
        assert os.getxattr(p, "user.memfuse.updated_at").decode() == r.updated_at.isoformat()
    for path in sorted(live)[::40]:
        assert (root / path).read_text() == live[path].content
    return live


def _loaded(sc: Sidecar) -> list[dict]:
    out = []
    for line in sc.log.read_text().splitlines():
        if line.startswith("{") and '"store loaded"' in line:
            out.append(json.loads(line))
    return out


def _wait(pred, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _earlier_format(mirror: Path, fmt: int) -> dict:
    """The saved mirror ``mirror`` as an earlier release wrote it: format 3 (plain columns:
    hex digests, type strings, modes) or 2 (one array per record, ISO 8601 times)."""
    st = StoreState(mirror, "default")
    assert st.load()
    recs = list(st.records.values())
    raw = {"format": fmt, "cursor": st.cursor, "access": st.access, "limits": st.limits}
    if fmt == 3:
        raw["columns"] = {"id": [m.id for m in recs], "path": [m.path for m in recs],
                          "type": [m.type for m in recs], "version": [m.version for m in recs],
                          "sha256": [m.sha256 for m in recs], "size": [m.size for m in recs],
                          "updated_ns": [m.updated_ns for m in recs], "mode": [m.mode for m in recs],
                          "mtime_ns": [m.mtime_ns for m in recs]}
    else:
        raw["records"] = [[m.id, m.path, m.type, m.version, m.sha256, m.size,
                           (EPOCH + timedelta(microseconds=m.updated_ns // 1000)).isoformat(),
                           m.mode, m.mtime_ns] for m in recs]
    return raw


def test_warm_restart_of_many_records_shows_every_record_and_follows_changes(tmp_path):
    with Rig(tmp_path) as rig:
        cp = rig.cp
        rig.workspace("ws")
        trio.run(_populate, cp)
        sc = rig.sidecar("ws")
        root = sc.mountpoint / "default"
        live = _check_every_record(cp, root)
        assert _loaded(sc)[-1]["resumed"] is False and _loaded(sc)[-1]["records"] == N
        sc.stop()
        mirror = sc.cache_dir / "stores" / "default.json"
        raw = json.loads(mirror.read_text())
        assert raw["format"] == 4 and len(raw["columns"]["id"]) == N
        assert len(raw["columns"]["sha256"]) == 64 * N

        # changes while the sidecar is down: an update, a delete, a create, a chmod
        paths = sorted(live)
        cp.call("update_record", "default", live[paths[0]].id, "changed while down\n")
        cp.call("delete_record", "default", live[paths[1]].id)
        cp.call("create_record", "default", "new/while-down.md", "made while down\n")
        cp.call("set_attributes", "default", live[paths[2]].id, mode=0o640)
        sc.start()
        assert _loaded(sc)[-1]["resumed"] is True  # from the saved mirror, not a snapshot
        live = _check_every_record(cp, root)
        assert (root / paths[0]).read_text() == "changed while down\n"
        assert not (root / paths[1]).exists()

        # a remote change after the warm mount arrives through the feed
        cp.call("update_record", "default", live[paths[3]].id, "changed after the mount\n")
        _wait(lambda: (root / paths[3]).read_text() == "changed after the mount\n", "the feed")

        # a local write to a record loaded from the mirror: conditional on its sha256, no conflict
        target = paths[4]
        before = live[target]
        sh(f"printf 'written here\\n' > '{target}'", root)
        _wait(lambda: live_records(cp)[target].content == "written here\n", "the commit")
        after = live_records(cp)[target]
        assert after.id == before.id and after.version == before.version + 1
        errors = (sc.mountpoint / ".memfuse" / "errors.log").read_text()
        assert "conflict" not in errors, errors

        # the mirrors of earlier releases (formats 3 and 2): resumed from, rewritten as 4
        for fmt in (3, 2):
            sc.stop()
            mirror.write_text(json.dumps(_earlier_format(mirror, fmt)))
            sc.start()
            assert _loaded(sc)[-1]["resumed"] is True
            _check_every_record(cp, root)
            _wait(lambda: json.loads(mirror.read_text()).get("format") == 4, "the mirror saved as format 4")


def test_lost_blob_cache_is_refilled_by_a_snapshot_not_one_request_per_record(tmp_path):
    """A saved mirror whose blobs are gone (the blob cache deleted, or started anew after a
    system crash in a bulk fill) is not resumed record by record: one snapshot refills it."""
    with Rig(tmp_path) as rig:
        cp = rig.cp
        rig.workspace("ws")
        trio.run(_populate, cp)
        sc = rig.sidecar("ws")
        assert _loaded(sc)[-1]["resumed"] is False
        sc.stop()
        for f in sc.cache_dir.glob("blobs.db*"):
            f.unlink()
        sc.start()
        assert _loaded(sc)[-1]["resumed"] is False and _loaded(sc)[-1]["records"] == N
        assert "blob cache lacks much of a saved store; taking a snapshot" in sc.log.read_text()
        _check_every_record(cp, sc.mountpoint / "default")
        root = sc.mountpoint / "default"
        some = sorted(live_records(cp).items())[:20]
        assert all((root / path).read_text() == r.content for path, r in some)


def test_blob_cache_missing_and_gc_by_ordered_scan(tmp_path):
    b = BlobCache(tmp_path / "blobs.db")
    held = [b.put(f"blob {i}".encode()) for i in range(300)]
    absent = [sha256_hex(f"absent {i}".encode()) for i in range(100)]
    assert b.missing([]) == set() and b.missing(held) == set()
    assert b.missing(held[::3] + absent[::2] + absent[:1]) == set(absent[::2])
    assert b.missing(absent) == set(absent)
    keep = set(held[::4]) | set(absent[:10])  # keeping what is not held deletes nothing more
    assert b.gc(keep) == 300 - len(held[::4])
    assert b.count()[0] == len(held[::4])
    assert b.missing(held) == set(held) - set(held[::4])
    assert b.gc(set()) == len(held[::4]) and b.count() == (0, 0)
    assert b.gc(set(absent)) == 0


def test_blob_cache_missing_and_gc_by_digest(tmp_path):
    b = BlobCache(tmp_path / "blobs.db")
    held = [bytes.fromhex(b.put(f"blob {i}".encode())) for i in range(300)]
    absent = [bytes.fromhex(sha256_hex(f"absent {i}".encode())) for i in range(100)]
    assert b.missing_digests([]) == set() and b.missing_digests(held) == set()
    assert b.missing_digests(held[::3] + absent[::2] + absent[:1]) == set(absent[::2])
    assert b.missing_digests(absent) == set(absent)
    keep = set(held[::4]) | set(absent[:10])  # keeping what is not held deletes nothing more
    assert b.gc_digests(keep) == 300 - len(held[::4])
    assert b.missing_digests(held) == set(held) - set(held[::4])
    assert b.missing(h.hex() for h in held) == {h.hex() for h in held} - {h.hex() for h in held[::4]}
    assert b.gc_digests(set()) == len(held[::4]) and b.count() == (0, 0)
    assert b.gc_digests(set(absent)) == 0


def test_store_build_skips_paths_through_files_and_counts_what_it_shows(tmp_path):
    journal = Journal(tmp_path / "outbox.db")
    _, keymap = journal.load()
    fs = Filesystem(BlobCache(tmp_path / "blobs.db"), None, journal, ids=RecordIds(journal, keymap))
    paths = ["a/b.md", "a/c/d.md", "a/c/e.md", "x.md", "x.md/y.md", "a/c", "a/c/f.md", "top.md"]
    records = [rec(i, path=p, content=f"content {i}\n") for i, p in enumerate(paths)]
    sm = fs.add_store("s", "read_write", records,
                      contents={r.id: f"content {i}\n".encode() for i, r in enumerate(records)})
    # "x.md/y.md" crosses the file x.md; "a/c" (a file) replaces the directory a/c, so
    # "a/c/f.md" after it crosses a file too, as a walk from the root finds
    shown = {n.path(): n for n in fs._walk_files(sm.root)}
    assert set(shown) == {"a/b.md", "a/c", "x.md", "top.md"}
    assert "a/c/f.md" not in {r.path for r in records if r.id in fs.by_rid}
    assert sm.count == len(fs.by_rid) and sm.used == sum(n.size for n in fs.by_rid.values())
    for r in records:
        if r.path in shown:
            n = shown[r.path]
            assert (n.record_id, n.version, n.size, n.sha) == (r.id, r.version, r.size, r.sha256)
            assert fs.inodes[n.ino] is n and fs.by_rid[r.id] is n and n.key == "r:" + r.id
            assert stat.S_IMODE(n.mode) == r.mode and stat.S_ISREG(n.mode)
            want_mtime = r.mtime_ns if r.mtime_ns is not None else datetime_ns(r.updated_at)
            assert (n.mtime_ns, n.xmtime, n.updated_ns) == (want_mtime, r.mtime_ns, datetime_ns(r.updated_at))


def test_mmap_threshold_is_fixed_with_glibc():
    import platform

    from memfuse.procmem import fix_mmap_threshold
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc: no mallopt")
    assert fix_mmap_threshold() is True


def _mirror_view(cache: Path) -> dict[str, tuple]:
    """path → (id, sha256, mode, mtime_ns) of the saved mirror of store ``default``."""
    st = StoreState(cache / "stores" / "default.json", "default")
    assert st.load()
    return {m.path: (m.id, m.sha256, m.mode, m.mtime_ns) for m in st.records.values()}


def _cp_view(cp: ControlPlane) -> dict[str, tuple]:
    return {p: (r.id, r.sha256, r.mode, r.mtime_ns) for p, r in live_records(cp).items()}


def test_restart_with_pending_changes_keeps_the_control_planes_state_in_the_mirror(tmp_path):
    """A write, a rename, an unlink, a chmod and a utime made while the control plane is down
    stay pending through a restart: the mirror saved at the stop holds the control plane's
    state (not the local one: it is the base of the conditional writes and what an offline
    start shows), and the next start commits each change once, after which the mirror
    equals the control plane again."""
    with Rig(tmp_path) as rig:
        cp = rig.cp
        rig.workspace("ws")
        for name in ("w", "r", "u", "c", "t"):
            cp.call("create_record", "default", f"dir/{name}.md", f"{name} as created\n")
        sc = rig.sidecar("ws", "--commit-wait", "0.3", "--drain-timeout", "1")
        mnt, cache = sc.mountpoint, sc.cache_dir
        store = mnt / "default" / "dir"
        _wait(lambda: len(os.listdir(store)) == 5, "the records to show")
        before = _cp_view(cp)
        cp.stop()  # the outage begins
        (store / "w.md").write_text("written while down\n")
        os.rename(store / "r.md", store / "renamed.md")
        os.unlink(store / "u.md")
        os.chmod(store / "c.md", 0o600)
        os.utime(store / "t.md", ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
        assert os.getxattr(store / "w.md", "user.memfuse.state") == b"pending"
        assert sc.stop() == 0
        assert _mirror_view(cache) == before  # the control plane's state, not the local one

        cp.start()  # same port and database
        sc.start()  # same cache directory and options
        want = {"dir/w.md": "written while down\n", "dir/renamed.md": "r as created\n",
                "dir/c.md": "c as created\n", "dir/t.md": "t as created\n"}
        _wait(lambda: {p: r.content for p, r in live_records(cp).items()} == want, "the replay", 30)
        after = live_records(cp)
        assert after["dir/renamed.md"].id == before["dir/r.md"][0]  # moved: same record
        assert after["dir/w.md"].id == before["dir/w.md"][0] and after["dir/w.md"].version == 2
        assert after["dir/c.md"].mode == 0o600
        assert after["dir/t.md"].mtime_ns == 1_700_000_000_000_000_000
        errors = (mnt / ".memfuse" / "errors.log").read_text()
        assert "conflict" not in errors, errors
        assert sc.stop() == 0
        assert _mirror_view(cache) == _cp_view(cp)
