"""The promise "a close that returned 0 is never lost" across a power cut, not only a SIGKILL
(tests/powercut.py: a FUSE filesystem that keeps every byte not fsynced in memory, and
``cut()`` drops it).

0. The harness's data model against a reference, on its handlers (no mount).
1. The harness can fail: a file written without fsync is gone after the cut, with fsync it
   stays; a shared mmap is seen by readers and kept only after msync; SQLite in WAL mode
   keeps every committed transaction with ``synchronous=FULL`` and loses them with ``OFF``,
   ``NORMAL``, or a fsync made after the commit was answered (nothing else in the suite can
   see those differences).
2. The control plane (``memfuse serve``) with its SQLite database on the power-cut disk:
   every write the API acknowledged is there, with its content and version, after the cut
   and a restart on what the disk kept.
3. The sidecar with its cache directory on the power-cut disk and the control plane down,
   so closes return 0 on the outbox journal alone: after the cut (the sidecar dies with
   it), a new sidecar on what the disk kept sends every one of them to the control plane,
   exactly once.
4. Both on power-cut disks, the control plane up, so closes return 0 on its answer alone:
   after one cut of both, every one of them is there, once.

The memfuse tests run on a slow disk (``SLOW_FSYNC`` a fsync): a write answered before its
fsync finished is lost by the cut that comes right after the answer, whatever the machine's
speed. Real FUSE mounts: needs root and /dev/fuse (CI has both; skipped otherwise, which CI
counts as a failure). Every mount is unmounted in a ``finally`` (``PowerCutMount``, ``Rig``).
"""
from __future__ import annotations

import contextlib
import errno
import mmap
import os
import random
import shutil
import sqlite3
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
from pyfuse3 import ROOT_INODE, EntryAttributes

from memfuse.client import ApiClient
from mountutil import Rig, drained, wait_for
from powercut import PowerCutMount, PowerCutOps, cut_all
from test_durability import check_store, cp_state, timed, write

NEEDS_FUSE = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/fuse") or not shutil.which("fusermount3"),
    reason="the power-cut filesystem mounts FUSE as root (CI runs as root with /dev/fuse)")


def mount_test(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A test on a real power-cut mount: marked ``mount`` (CI fails when it is skipped),
    skipped without root and /dev/fuse."""
    return pytest.mark.mount(NEEDS_FUSE(fn))


#: s every fsync of the power-cut disk takes in the tests of memfuse (a slow disk): a write
#: answered before its fsync finished is still unsynced when the cut comes, right after the
#: answer, however fast the machine (``PowerCutMount``); ~50-100 fsyncs a test: +2.5-5 s
SLOW_FSYNC = 0.05


# ------------------------------------------------------------------ 0. the model, handler-level


async def test_overlay_reads_the_writes_and_the_disk_keeps_the_synced_data_and_the_sizes(tmp_path):
    """The data model against a reference, on the handlers (no mount): 400 random writes,
    truncates and fsyncs of one file; reads always give what was written (``current``); the
    backing file always holds ``durable``: the content at the last fsync, with every truncate
    since applied at once (metadata)."""
    ops = PowerCutOps(tmp_path)
    ctx = SimpleNamespace(uid=os.getuid(), gid=os.getgid())
    fi, attr = await ops.create(ROOT_INODE, b"f", 0o644, os.O_RDWR, ctx)
    rnd = random.Random(25)
    current, durable = bytearray(), bytearray()
    for step in range(400):
        op = rnd.random()
        if op < 0.6:
            off, n = rnd.randrange(0, 20_000), rnd.randrange(1, 9_000)
            data = bytes([rnd.randrange(1, 256)]) * n
            assert await ops.write(fi.fh, off, data) == n
            current[len(current):] = bytes(max(0, off + n - len(current)))
            current[off:off + n] = data
        elif op < 0.8:
            size = rnd.randrange(0, 20_000)
            a = EntryAttributes()
            a.st_size = size
            fields = SimpleNamespace(update_size=True, update_mode=False, update_uid=False,
                                     update_gid=False, update_atime=False, update_mtime=False)
            assert (await ops.setattr(attr.st_ino, a, fields, fi.fh, ctx)).st_size == size
            for b in (current, durable):
                b[size:] = b""
                b[len(b):] = bytes(size - len(b))
        else:
            await ops.fsync(fi.fh, rnd.random() < 0.5)
            durable = bytearray(current)
        assert (await ops.getattr(attr.st_ino, ctx)).st_size == len(current), step
        assert await ops.read(fi.fh, 0, 40_000) == bytes(current), step
        assert (tmp_path / "f").read_bytes() == bytes(durable), step
    await ops.release(fi.fh)


# ------------------------------------------------------------------ 1. the harness can fail


@mount_test
def test_unsynced_file_data_is_gone_after_the_cut_and_synced_data_stays(tmp_path):
    disk, mnt = tmp_path / "disk", tmp_path / "mnt"
    with PowerCutMount(disk, mnt) as pc:
        with open(mnt / "kept.txt", "w") as f:
            f.write("kept\n")
            f.flush()
            os.fsync(f.fileno())
        (mnt / "lost.txt").write_text("never synced\n")
        with open(mnt / "part.txt", "w") as f:
            f.write("one\n")
            f.flush()
            os.fdatasync(f.fileno())
            f.write("two\n")
        (mnt / "sub").mkdir()
        (mnt / "sub" / "new.txt").write_text("x" * 10_000)
        os.replace(mnt / "kept.txt", mnt / "sub" / "moved.txt")
        # before the cut, reads see every write (the overlay plays the page cache)
        assert (mnt / "lost.txt").read_text() == "never synced\n"
        assert (mnt / "part.txt").read_text() == "one\ntwo\n"
        assert os.stat(mnt / "sub" / "new.txt").st_size == 10_000
        assert not (disk / "lost.txt").read_bytes()  # nothing of it reached the disk yet
        report = pc.cut()
    assert not os.path.ismount(mnt)
    print(report)
    assert (disk / "sub" / "moved.txt").read_text() == "kept\n"  # data synced, rename at once
    assert (disk / "part.txt").read_text() == "one\n"  # the part before the fdatasync
    # metadata is durable at once, data is not: the names are there, empty
    assert (disk / "lost.txt").read_bytes() == b""
    assert (disk / "sub" / "new.txt").read_bytes() == b""
    assert report.dropped_paths() == {"lost.txt", "part.txt", "sub/new.txt"}


@mount_test
def test_shared_mmap_writes_are_seen_by_readers_and_kept_only_after_msync(tmp_path):
    """MAP_SHARED on the power-cut mount (what SQLite's ``-shm`` needs): a write through a
    shared mapping is seen by another process's ``read(2)`` at once (one page cache); the
    kernel writes the dirty pages back to the filesystem as data, volatile like any write
    (dropped by the cut), unless ``msync(MS_SYNC)`` (a fsync) synced them."""
    disk, mnt = tmp_path / "disk", tmp_path / "mnt"
    with PowerCutMount(disk, mnt) as pc:
        for name, sync in (("kept.bin", True), ("lost.bin", False)):
            with open(mnt / name, "wb") as f:
                f.write(b"." * 8192)
                f.flush()
                os.fsync(f.fileno())
            with open(mnt / name, "r+b") as f, mmap.mmap(f.fileno(), 8192) as mm:
                mm[0:4], mm[4096:4100] = b"AAAA", b"BBBB"
                seen = subprocess.run(["head", "-c", "4", str(mnt / name)], capture_output=True,
                                      timeout=30, check=True).stdout
                assert seen == b"AAAA", name
                if sync:
                    mm.flush()  # msync(MS_SYNC)
        report = pc.cut()
    kept, lost = (disk / "kept.bin").read_bytes(), (disk / "lost.bin").read_bytes()
    assert (kept[:4], kept[4096:4100]) == (b"AAAA", b"BBBB")
    assert lost == b"." * 8192
    assert report.dropped_paths() == {"lost.bin"}


SQLITE_WRITER = r'''
import sqlite3, sys, time
path, sync, n, done = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
db = sqlite3.connect(path, isolation_level=None)  # made on the disk before the mount (WAL)
db.execute(f"PRAGMA synchronous={'OFF' if sync == 'DEFERRED' else sync}")
for i in range(n):
    db.execute("BEGIN")
    db.execute("INSERT INTO t VALUES (?, ?)", (i, f"row {i} " + "x" * 200))
    db.execute("COMMIT")  # returned: committed, as far as the program can tell
with open(done, "w") as f:
    f.write(str(db.execute("SELECT count(*) FROM t").fetchone()[0]))
if sync == "DEFERRED":  # answered, then synced: the fsync of the WAL comes after the answer
    import os
    os.fsync(os.open(path + "-wal", os.O_RDONLY))
time.sleep(120)  # still running (connection open) when the power goes
'''


@mount_test
@pytest.mark.parametrize("sync", ["FULL", "NORMAL", "OFF", "DEFERRED"])
def test_sqlite_wal_keeps_committed_transactions_only_with_synchronous_full(tmp_path, sync):
    """The test that proves the harness sees a missing fsync: the same 50 committed
    transactions (WAL mode, the process still running with its connection open when the
    power goes) survive with ``synchronous=FULL`` (the WAL fsynced at each commit) and are
    lost with ``NORMAL`` (the WAL fsynced only at a checkpoint: none of 50 small
    transactions reaches one) and ``OFF``; and with ``DEFERRED`` (``OFF``, then one fsync
    of the WAL right *after* the commits were answered: a group commit after the answer) on
    a slow disk (5 s a fsync: the test's reaction has that long) they are lost too: the cut stops the writer before it cuts the
    disk, so the fsync in flight never completes (killing the writer first would wait for
    that fsync, and find nothing lost)."""
    n = 50
    disk, mnt, done = tmp_path / "disk", tmp_path / "mnt", tmp_path / "done"
    disk.mkdir()
    db = sqlite3.connect(disk / "t.db")  # the schema, durable before the power-cut mount
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("CREATE TABLE t (i INTEGER PRIMARY KEY, v TEXT)")
        db.commit()
    finally:
        db.close()
    with PowerCutMount(disk, mnt, fsync_delay=5.0 if sync == "DEFERRED" else 0.0) as pc:
        proc = subprocess.Popen([sys.executable, "-c", SQLITE_WRITER, str(mnt / "t.db"), sync,
                                 str(n), str(done)], stdin=subprocess.DEVNULL)
        try:
            wait_for(done.exists, 60, "the writer's commits", proc)
            assert done.read_text() == str(n)
            report = pc.cut()
            assert proc.pid in report.killed
        finally:
            proc.kill()
            proc.wait(30)
    print(sync, report)
    db = sqlite3.connect(disk / "t.db")
    try:
        rows = db.execute("SELECT count(*) FROM t").fetchone()[0]
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        db.close()
    if sync == "FULL":
        assert rows == n
        assert "t.db-wal" not in report.dropped_paths()
    else:
        assert rows < n, f"synchronous={sync}: the cut kept all {n} commits"
        assert "t.db-wal" in report.dropped_paths()


# ------------------------------------------------------------------ 2. the control plane


@mount_test
@pytest.mark.timeout(300)
def test_control_plane_keeps_every_acknowledged_write_across_a_power_cut(tmp_path):
    """``memfuse serve`` on a database on the power-cut disk: 40 creates and 10 updates,
    each answered; the power goes (serve SIGKILLed with it); serve started again on what
    the disk kept: every answered write is there with its content and version."""
    disk, mnt = tmp_path / "disk", tmp_path / "mnt"
    with PowerCutMount(disk, mnt, fsync_delay=SLOW_FSYNC) as pc:
        with Rig(tmp_path, db_url=f"sqlite:///{mnt}/cp.db") as rig:
            cp = rig.cp

            async def writes() -> dict[str, tuple[str, str, int]]:
                acked: dict[str, tuple[str, str, int]] = {}  # id -> (path, content, version)
                async with ApiClient(cp.url, cp.admin_token) as api:
                    await api.create_store("default")
                    recs = []
                    for i in range(40):
                        r = await api.create_record("default", f"n{i:02d}.md", f"note {i}\n")
                        acked[r.id] = (r.path, f"note {i}\n", r.version)
                        recs.append(r)
                    for r in recs[::4]:
                        text = f"{acked[r.id][1]}and updated\n"
                        u = await api.update_record("default", r.id, text, if_match=r.sha256)
                        assert u.version == r.version + 1
                        acked[r.id] = (u.path, text, u.version)
                return acked
            acked = trio.run(writes)
            report = pc.cut()  # right after the last answer
            assert cp.proc is not None and cp.proc.pid in report.killed
            print(report)
            cp.proc.wait(30)
            cp.db_url = f"sqlite:///{disk}/cp.db"  # what the disk kept
            cp.start()

            async def read_back() -> list[str]:
                lost: list[str] = []
                async with ApiClient(cp.url, cp.admin_token) as api:
                    for rid, (path, content, version) in acked.items():
                        try:
                            r = await api.get_record("default", rid)
                        except Exception as e:  # noqa: BLE001 - named in the failure
                            lost.append(f"{path}: {type(e).__name__} {e}")
                            continue
                        if (r.path, r.content, r.version) != (path, content, version):
                            lost.append(f"{path}: has v{r.version} {r.content!r}, "
                                        f"acknowledged v{version} {content!r}")
                return lost
            lost = trio.run(read_back)
            assert not lost, f"{len(lost)} acknowledged write(s) lost:\n" + "\n".join(lost)


# ------------------------------------------------------------------ 3. the sidecar


@mount_test
@pytest.mark.timeout(300)
def test_sidecar_closes_acknowledged_by_the_journal_survive_a_power_cut(tmp_path):
    """The sidecar's cache directory on the power-cut disk, the control plane down: 20 new
    files and appends to two files (one committed before the outage, one new), every close
    returning 0 on the outbox journal alone; the power cut right after the last close (the
    sidecar dies with it, its journal's fsyncs slow: ``SLOW_FSYNC``); the control plane back and a new sidecar on what the disk kept: every write reaches the
    control plane, each file once, with its last content (``check_store``)."""
    disk, cache = tmp_path / "cachedisk", tmp_path / "cache"
    with PowerCutMount(disk, cache, fsync_delay=SLOW_FSYNC) as pc:
        with Rig(tmp_path) as rig:
            cp = rig.cp
            sc = rig.sidecar("ws", "--commit-wait", "0.3", "--admin-listen", "", cache_dir=cache)
            store = sc.mountpoint / "default"
            written: dict[str, list[str]] = {}

            def w(name: str, text: str, append: bool = False) -> None:
                timed(write, store / name, text, append)  # returns: close returned 0
                seq = written.setdefault(name, [])
                seq.append((seq[-1] if append and seq else "") + text)

            w("before.md", "committed before the outage\n")
            wait_for(lambda: os.getxattr(store / "before.md", "user.memfuse.state") == b"clean",
                     30, "before.md to commit")
            cp.kill()  # the outage: connections refused
            for i in range(20):
                w(f"down{i:02d}.md", f"written while down {i}\n")
            for k in range(3):
                w("before.md", f"appended while down {k}\n", append=True)
                w("log.md", f"line {k}\n", append=True)
            report = pc.cut()  # right after the last close: the sidecar dies with the power
            print(report)
            assert sc.proc is not None and sc.proc.pid in report.killed
            sc.kill9()  # reaped, its mount removed
            cp.start()
            sc.cache_dir = disk  # a new sidecar on what the disk kept
            sc.start()

            def all_there() -> bool:
                got = live(cp)
                return all(got.get(p) == seq[-1] for p, seq in written.items())
            deadline = time.monotonic() + 30
            while not all_there():
                if time.monotonic() > deadline:
                    break  # check_store names what is missing
                time.sleep(0.2)
            check_store(cp_state(cp), written)


# ------------------------------------------------------------------ 4. the machine


@mount_test
@pytest.mark.timeout(300)
def test_closes_acknowledged_by_the_control_plane_survive_a_power_cut_of_both_disks(tmp_path):
    """One machine (``memfuse dev``'s shape): the control plane's database and the sidecar's
    cache directory each on a power-cut disk, the control plane up, so most closes return 0
    on the control plane's answer alone (the journal row held back and never written:
    docs/SEMANTICS.md, "Accepted"); both processes die with the power and both disks keep
    only what was fsynced; both started again on what the disks kept: every write whose
    close returned 0 is on the control plane, once, with its last content."""
    cp_disk, cp_mnt = tmp_path / "cpdisk", tmp_path / "cpmnt"
    cache_disk, cache = tmp_path / "cachedisk", tmp_path / "cache"
    with PowerCutMount(cp_disk, cp_mnt, log=tmp_path / "powercut-cp.log",
                       fsync_delay=SLOW_FSYNC) as pc_cp, \
            PowerCutMount(cache_disk, cache, log=tmp_path / "powercut-cache.log",
                          fsync_delay=SLOW_FSYNC) as pc_cache:
        with Rig(tmp_path, db_url=f"sqlite:///{cp_mnt}/cp.db") as rig:
            cp = rig.cp
            sc = rig.sidecar("ws", "--admin-listen", "", cache_dir=cache)
            store = sc.mountpoint / "default"
            written: dict[str, list[str]] = {}

            def w(name: str, text: str, append: bool = False) -> None:
                timed(write, store / name, text, append)  # returns: close returned 0
                seq = written.setdefault(name, [])
                seq.append((seq[-1] if append and seq else "") + text)

            for i in range(30):
                w(f"n{i:02d}.md", f"note {i}\n")
                if i % 5 == 4:
                    w("log.md", f"line {i}\n", append=True)
            w("n00.md", "note 0, rewritten\n")
            reports = cut_all(pc_cp, pc_cache)  # right after the last close
            print(*reports, sep="\n")
            assert cp.proc is not None and sc.proc is not None
            assert {cp.proc.pid, sc.proc.pid} <= set(reports[0].killed)
            sc.kill9()  # reaped, its mount removed
            cp.kill()
            cp.db_url = f"sqlite:///{cp_disk}/cp.db"
            cp.start()
            sc.cache_dir = cache_disk
            sc.start()

            def all_there() -> bool:
                got = live(cp)
                return all(got.get(p) == seq[-1] for p, seq in written.items())
            deadline = time.monotonic() + 30
            while not all_there():
                if time.monotonic() > deadline:
                    break  # check_store names what is missing
                time.sleep(0.2)
            check_store(cp_state(cp), written)


# ------------------------------------------------------------------ 5. a directory's fsync


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        timed(os.fsync, fd)
    finally:
        os.close(fd)


def live(cp) -> dict[str, str]:
    """The control plane's live records of store ``default``: path -> content."""
    return {r["path"]: r["content"] for r in cp_state(cp) if not r["deleted"]}


def outage_after_one_commit(rig, cache: Path, name: str, text: str):
    """A sidecar of ``ws`` (commit wait 0.3 s, its cache in ``cache``) that committed
    ``name`` (``text``), then the control plane stopped: (cp, sidecar, store directory)."""
    cp = rig.cp
    sc = rig.sidecar("ws", "--commit-wait", "0.3", "--admin-listen", "", cache_dir=cache)
    store = sc.mountpoint / "default"
    timed(write, store / name, text, False)
    wait_for(lambda: os.getxattr(store / name, "user.memfuse.state") == b"clean",
             30, f"{name} to commit")
    cp.kill()
    return cp, sc, store


@mount_test
@pytest.mark.timeout(300)
def test_a_rename_and_an_unlink_whose_directory_fsync_returned_survive_a_power_cut(tmp_path):
    """The POSIX idiom for a durable rename (write a file, close, rename it, fsync the
    directory: Python's atomic-write libraries, git, SQLite's own journals) and a durable
    unlink, with the control plane down: once ``fsync`` of the directory returned 0, a
    power cut must not bring back the old name nor the deleted file. (Seen in session 25:
    both come back, 3 of 3 runs, and also with a plain ``kill -9`` of the sidecar right
    after the directory's fsync and no power cut at all: ``fsyncdir`` answered 0 in ~0.6 ms
    without waiting for the entries to reach the journal. Now it waits for them to be
    accepted: ``Filesystem.fsyncdir``.)"""
    disk, cache = tmp_path / "cachedisk", tmp_path / "cache"
    with PowerCutMount(disk, cache, fsync_delay=SLOW_FSYNC) as pc:
        with Rig(tmp_path) as rig:
            cp, sc, store = outage_after_one_commit(rig, cache, "gone.md", "to be deleted\n")
            timed(write, store / "a.md", "renamed after its close\n", False)  # accepted
            os.rename(store / "a.md", store / "b.md")
            os.unlink(store / "gone.md")
            fsync_dir(store)
            print(pc.cut())
            sc.kill9()
            cp.start()
            sc.cache_dir = disk
            sc.start()
            drained(sc, timeout=30)
            assert live(cp) == {"b.md": "renamed after its close\n"}, live(cp)


@mount_test
@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["power cut", "kill -9"])
def test_a_file_named_while_open_survives_once_its_directory_fsync_returned(tmp_path, how):
    """POSIX: once fsync of a directory returned, its entries survive a crash; a file's name
    too when the file is still open for writing (its content need not). With the control
    plane down: a file created and written, renamed while open, and one created in a
    subdirectory and renamed into the directory while open, then the directory's fsync, then
    a power cut (or a kill -9 of the sidecar) before their writers close. (attack26 F1: both
    names were gone after the restart, in both cases: a create reaches the outbox only at
    close, so the directory's fsync had nothing to wait for. Now it commits such files as
    their own fsync would: ``Filesystem.fsyncdir``.)"""
    disk, cache = tmp_path / "cachedisk", tmp_path / "cache"
    with PowerCutMount(disk, cache, fsync_delay=SLOW_FSYNC) as pc:
        with Rig(tmp_path) as rig:
            cp, sc, store = outage_after_one_commit(rig, cache, "kept.md", "committed before the outage\n")
            os.mkdir(store / "sub")
            fds = []
            try:
                fds.append(os.open(store / "open.md", os.O_WRONLY | os.O_CREAT, 0o644))
                os.write(fds[-1], b"open\n")
                os.rename(store / "open.md", store / "open2.md")
                fds.append(os.open(store / "sub" / "in.md", os.O_WRONLY | os.O_CREAT, 0o644))
                os.write(fds[-1], b"moved in\n")
                os.rename(store / "sub" / "in.md", store / "in.md")
                fsync_dir(store)
                if how == "power cut":
                    print(pc.cut())
                    sc.cache_dir = disk  # a new sidecar on what the disk kept
                sc.kill9()
            finally:
                for fd in fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)  # ENOTCONN: the sidecar is gone
            cp.start()
            sc.start()
            drained(sc, timeout=30)
            got = live(cp)
            assert got == {"kept.md": "committed before the outage\n",
                           "open2.md": "open\n", "in.md": "moved in\n"}, got
            assert {"open2.md", "in.md"} <= set(os.listdir(store))


@mount_test
@pytest.mark.timeout(300)
def test_an_empty_directory_survives_a_power_cut_once_its_parent_fsync_returned(tmp_path):
    """An empty directory made by mkdir lives in this sidecar alone (``dirs.json``, not
    fsynced): once its parent's fsync returned it survives a power cut, with its mode, also
    when another mkdir (not fsynced) rewrote the list after it. (attack26 F2: it was gone;
    now the directory's fsync writes a durable copy, ``dirs.synced.json``.)"""
    disk, cache = tmp_path / "cachedisk", tmp_path / "cache"
    with PowerCutMount(disk, cache, fsync_delay=SLOW_FSYNC) as pc:
        with Rig(tmp_path) as rig:
            sc = rig.sidecar("ws", "--admin-listen", "", cache_dir=cache)
            store = sc.mountpoint / "default"
            os.mkdir(store / "empty", 0o750)
            os.chmod(store / "empty", 0o750)  # (the umask)
            os.mkdir(store / "empty" / "inner")
            fsync_dir(store)
            os.mkdir(store / "later")  # after the fsync: dirs.json rewritten, not fsynced
            print(pc.cut())
            sc.kill9()
            sc.cache_dir = disk
            sc.start()
            assert os.path.isdir(store / "empty" / "inner")
            assert stat.S_IMODE(os.stat(store / "empty").st_mode) == 0o750


@mount_test
@pytest.mark.timeout(300)
def test_a_rejected_file_renamed_while_rewritten_keeps_its_new_name_once_its_directory_fsync_returned(
        tmp_path):
    """Two files refused at close (a character cut at the end: ``EILSEQ``, kept rejected
    with their names in the journal), each opened again, rewritten (one fixed, one still
    refused) and renamed while open, then the directory's fsync and a kill -9 of the sidecar
    before their writers close: the restart shows them under their new names, the fixed one
    a record, the other still rejected. (fsync27: the kept row of a rejected file being
    rewritten named its old path until its close, so the restart put it back there and
    nothing named the new one.)"""
    with Rig(tmp_path) as rig:
        cp = rig.cp
        sc = rig.sidecar("ws", "--commit-wait", "0.3", "--admin-listen", "",
                         cache_dir=tmp_path / "cache")
        store = sc.mountpoint / "default"
        for name in ("fix.md", "bad.md"):
            fd = os.open(store / name, os.O_WRONLY | os.O_CREAT, 0o644)
            os.write(fd, b"caf\xc3")
            with pytest.raises(OSError) as exc:
                os.close(fd)  # the close reports the refusal
            assert exc.value.errno == errno.EILSEQ
        cp.kill()
        fds = []
        try:
            for name, text in (("fix.md", b"fixed\n"), ("bad.md", b"still caf\xc3")):
                fds.append(os.open(store / name, os.O_WRONLY | os.O_TRUNC))
                os.write(fds[-1], text)
            os.rename(store / "fix.md", store / "fixed.md")
            os.rename(store / "bad.md", store / "worse.md")
            fsync_dir(store)
            sc.kill9()
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)  # ENOTCONN: the sidecar is gone
        cp.start()
        sc.start()
        drained(sc, timeout=30)
        assert live(cp) == {"fixed.md": "fixed\n"}, live(cp)
        assert sorted(os.listdir(store)) == ["fixed.md", "worse.md"]
        assert os.getxattr(store / "worse.md", "user.memfuse.state") == b"rejected"
        assert (store / "worse.md").read_bytes() == b"still caf\xc3"


@mount_test
@pytest.mark.timeout(300)
def test_a_directory_fsync_sends_no_empty_version_of_a_rejected_record_another_handle_rewrites(
        tmp_path):
    """review27 R2 on a mount: a record whose update was refused (``EILSEQ``, kept rejected:
    the record holds v1) opened ``O_TRUNC`` with nothing written yet and renamed while open;
    another process's directory fsync sends nothing for it (its record and the rename's
    queued move name it): the control plane holds v1 under the new name, after the fsync and
    after the rewrite is refused again. (fsync27 committed the emptied file: ``good.md`` =
    '', a version nobody wrote.)"""
    with Rig(tmp_path) as rig:
        cp = rig.cp
        sc = rig.sidecar("ws", "--commit-wait", "2", "--admin-listen", "",
                         cache_dir=tmp_path / "cache")
        store = sc.mountpoint / "default"
        (store / "bad.md").write_bytes(b"v1\n")
        wait_for(lambda: os.getxattr(store / "bad.md", "user.memfuse.state") == b"clean", 20,
                 "bad.md clean")
        fd = os.open(store / "bad.md", os.O_WRONLY | os.O_TRUNC)
        os.write(fd, b"caf\xc3")
        with pytest.raises(OSError) as exc:
            os.close(fd)
        assert exc.value.errno == errno.EILSEQ
        w = os.open(store / "bad.md", os.O_WRONLY | os.O_TRUNC)  # a rewrite starts
        try:
            os.rename(store / "bad.md", store / "good.md")
            fsync_dir(store)  # any process's durable rename in this directory
            drained(sc, timeout=30)
            after_fsync = live(cp)
            os.write(w, b"still caf\xc3")
        finally:
            with pytest.raises(OSError):
                os.close(w)  # refused again: EILSEQ
        drained(sc, timeout=30)
        assert after_fsync == {"good.md": "v1\n"}, after_fsync
        assert live(cp) == {"good.md": "v1\n"}, live(cp)
