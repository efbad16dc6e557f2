"""A full or failing disk under the sidecar's ``--cache-dir`` (docs/SEMANTICS.md, "The
sidecar's own disk"): ENOSPC at close with the reason in ``user.memfuse.error`` and
``errors.log``, a metric, never a hang and never EIO from a traceback; nothing accepted is lost,
and writes succeed again once space returns, without a restart.

The cache directory is an 8 MiB tmpfs (mounting one needs root: CI runs as root; elsewhere the
test is skipped with the reason). A ballast file fills all but ~700 KB of it, so the disk fills
after a few 96 KB writes, and removing the ballast gives the space back: enough for the content
held while the disk was full (20 files, in the journal and the blob cache) plus the new writes.
With 3 MiB, the space given back was itself filled by that held content, so the first write
after recovery could still meet a full disk (a correct ENOSPC, but not the recovery asserted).
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from mountcheck import errors_log, status, wait_until, xattr
from mountutil import Rig, Sidecar, live_records, unexpected_log_lines

pytestmark = pytest.mark.mount

FILE_BYTES = 96 * 1024
WRITER = r'''
import errno, json, os, sys, time
d, first, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
out = []
for i in range(first, first + count):
    p = os.path.join(d, f"f{i:03d}.md")
    data = (f"# file {i}\n".encode() + bytes([97 + i % 26]) * size)[:size]
    t0 = time.monotonic()
    res = {"i": i}
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data)
        finally:
            res["seconds"] = None
            os.close(fd)
        res["close"] = None
    except OSError as e:
        res["close"] = errno.errorcode[e.errno]
    res["seconds"] = round(time.monotonic() - t0, 3)
    out.append(res)
print(json.dumps(out))
'''


def content(i: int) -> str:
    return (f"# file {i}\n".encode() + bytes([97 + i % 26]) * FILE_BYTES)[:FILE_BYTES].decode()


def write_files(d: Path, first: int, count: int, size: int = FILE_BYTES) -> list[dict]:
    """Write files ``f<first>..`` (``size`` bytes each, 96 KB unless told) in a subprocess;
    per file the close outcome (errno name or None) and the seconds it took. A hang fails
    the test by the timeout."""
    proc = subprocess.run([sys.executable, "-c", WRITER, str(d), str(first), str(count),
                           str(size)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def metric(admin: str, name: str) -> float:
    text = urllib.request.urlopen(f"http://{admin}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


@pytest.fixture
def small_cache(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs for the cache directory needs root (CI runs as root)")
    d = tmp_path / "cache"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(d)], check=True,
                   timeout=30)
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], timeout=30)


@pytest.fixture
def on_small_cache(tmp_path, small_cache):
    """The setup of the full-cache-disk mount tests: ``with on_small_cache(*flags,
    commit_wait="3") as (rig, sc)`` is a ``Rig`` in ``tmp_path`` whose workspace ``ws`` has
    its sidecar ``sc`` mounted at ``tmp_path/mnt`` (``memfuse mount --commit-wait
    commit_wait`` and ``flags``) with its cache directory on the 8 MiB tmpfs ``small_cache``.
    A ``with`` block in the test, so that a failure inside it prints the rig's log tails."""
    @contextmanager
    def rig_on_small_cache(*flags: str, commit_wait: str = "3") -> Iterator[tuple[Rig, Sidecar]]:
        with Rig(tmp_path) as rig:
            yield rig, rig.sidecar("ws", "--commit-wait", commit_wait, *flags, cache_dir=small_cache)
    return rig_on_small_cache


@pytest.mark.timeout(300)
def write_local(path: Path) -> str | None:
    """Write ``FILE_BYTES`` to a local-only file in a subprocess bounded by a timeout; the
    errno name of its close, or None."""
    code = ("import os, sys\nfd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)\n"
            f"os.write(fd, b'~' * {FILE_BYTES})\n"
            "try:\n    os.close(fd)\nexcept OSError as e:\n    print(e.errno)\n")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                         text=True, timeout=60, check=True).stdout.strip()
    return errno.errorcode[int(out)] if out else None


@pytest.mark.parametrize("commit_wait", ["10", "0"])
def test_full_cache_disk_gives_enospc_at_close_never_hangs_and_recovers(on_small_cache, small_cache,
                                                                        commit_wait):
    """The control plane answering: a write the full disk refuses is committed within the
    close's wait, so the close returns 0 (it is in the control plane). With ``--commit-wait
    0`` a close may give up first: then ``ENOSPC`` (not ``EIO`` for a zero wait) and the write
    is withdrawn, never sent (docs/SEMANTICS.md, "The sidecar's own disk")."""
    with on_small_cache(commit_wait=commit_wait) as (rig, sc):
        cp, root = rig.cp, sc.mountpoint
        admin = status(root)["admin"]
        # leave ~700 KB free: a few 96 KB files fit, then the disk is full
        ballast = fill_disk(small_cache, 700 * 1024)

        first = write_files(root / "default", 0, 20)
        outcomes = {r["close"] for r in first}
        assert outcomes <= {None, "ENOSPC"}, first  # never EIO, never anything else
        if commit_wait != "0":  # the control plane answers within the wait
            assert outcomes == {None}, first
        # bounded: a close waits at most --commit-wait (10 s) for anything
        assert max(r["seconds"] for r in first) < 15, first
        refused = [r["i"] for r in first if r["close"] == "ENOSPC"]
        for i in refused:  # withdrawn: the file as before the write (created by it: empty)
            f = root / "default" / f"f{i:03d}.md"
            assert f.stat().st_size == 0 and "withdrawn" in (xattr(f, "error") or "")
            assert any(e["errno"] == "ENOSPC" and "withdrawn" in e["reason"]
                       for e in errors_log(root))
        assert metric(admin, "memfuse_cache_write_errors_total") > 0  # the disk did fill up
        # a local-only file is kept in the same journal: its close says ENOSPC too (the
        # disk filled again: a drained journal gives space back, DiskReserve)
        more = keep_full(small_cache, "ballast2")
        assert write_local(root / "default" / "big.md~") == "ENOSPC"
        more.unlink(missing_ok=True)  # a disk already full takes no ballast

        ballast.unlink()  # space returns: writes succeed again, no restart
        again = write_files(root / "default", 100, 5)
        assert [r["close"] for r in again] == [None] * 5, again
        assert write_local(root / "default" / "other.md~") is None
        assert (root / "default" / "big.md~").read_bytes() == b"~" * FILE_BYTES  # kept, retried

        # nothing accepted is lost; the refused ones were withdrawn: never sent
        accepted = [r for r in first + again if r["close"] is None]

        def all_there() -> bool:
            recs = live_records(cp)
            return all(f"f{r['i']:03d}.md" in recs for r in accepted)
        wait_until(all_there, 60, "every file on the control plane")
        wait_until(lambda: status(root)["outbox"]["depth"] == 0, 60, "the outbox drained")
        recs = live_records(cp)
        for r in accepted:
            assert recs[f"f{r['i']:03d}.md"].content == content(r["i"]), r
        for i in refused:
            assert f"f{i:03d}.md" not in recs, i
        assert sc.proc.poll() is None
        assert sc.stop() == 0
    # the log says what failed, without a traceback or an ERROR line
    assert unexpected_log_lines(sc.log) == []


APPEND = r'''
import errno, os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
os.write(fd, sys.stdin.buffer.read())
try:
    os.close(fd)
except OSError as e:
    print(errno.errorcode[e.errno])
'''


def append(path: Path, text: str) -> str | None:
    """``echo text >> path`` in a subprocess bounded by a timeout (``text`` by its stdin:
    one ``write(2)``, any length): the errno name of its close, or None."""
    out = subprocess.run([sys.executable, "-c", APPEND, str(path)], input=text,
                         capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    return out or None


@pytest.mark.timeout(300)
def test_close_failing_on_a_full_cache_disk_means_the_write_did_not_happen(on_small_cache, small_cache):
    """attack 12 A3: the cache disk full and the control plane down, a close fails with
    ENOSPC (not EIO) and the write is withdrawn: the file shows what it showed before,
    and the write never reaches the control plane once it is back. An append the agent
    retries then appears once. With the control plane answering (the disk still full), a
    close returns 0 and the write is there (docs/SEMANTICS.md, "The sidecar's own disk")."""
    with on_small_cache() as (rig, sc):
        cp, root = rig.cp, sc.mountpoint
        log_md = root / "default" / "log.md"
        assert append(log_md, "line-0\n") is None
        wait_until(lambda: "log.md" in live_records(cp), 30, "log.md committed")
        cp.stop()  # the control plane down (its port refuses connections)
        fill_disk(small_cache, 700 * 1024)

        first = write_files(root / "default", 0, 20)
        outcomes = {r["close"] for r in first}
        assert outcomes <= {None, "ENOSPC"}, first  # never EIO
        refused = [r["i"] for r in first if r["close"] == "ENOSPC"]
        kept = [r["i"] for r in first if r["close"] is None]
        assert refused, first  # the disk did fill up
        assert max(r["seconds"] for r in first) < 15, first  # bounded by --commit-wait
        # a refused new file shows what it showed before the write: nothing (empty, unsent)
        f = root / "default" / f"f{refused[-1]:03d}.md"
        assert f.stat().st_size == 0
        assert "withdrawn" in (xattr(f, "error") or "")
        # the agent's append: refused, withdrawn, the file as before. A disk filled once
        # does not stay full (keep_full), and a full disk still takes a write that fits in
        # the space the journal's files hold already (SQLite starts its write-ahead log over
        # once a checkpoint has copied all of it): the append is longer than that space
        # (CI on 2e08ace and 2947f4b here: a 7-byte append was accepted, as it should be)
        keep_full(small_cache, "ballast2")
        line1 = "line-1 " + "x" * journal_bytes(small_cache) + "\n"
        assert append(log_md, line1) == "ENOSPC"
        assert log_md.read_bytes() == b"line-0\n"
        assert "withdrawn" in (xattr(log_md, "error") or "")
        assert any(e["errno"] == "ENOSPC" and "withdrawn" in e["reason"] for e in errors_log(root))

        cp.start()  # the control plane back, the cache disk still full
        wait_until(lambda: all(f"f{i:03d}.md" in live_records(cp) for i in kept), 60,
                   "the accepted writes committed")
        wait_until(lambda: status(root)["outbox"]["depth"] == 0, 60, "the outbox drained")
        recs = live_records(cp)
        for i in kept:
            assert recs[f"f{i:03d}.md"].content == content(i), i
        for i in refused:  # a close that failed: the write did not happen
            assert f"f{i:03d}.md" not in recs, i
        assert recs["log.md"].content == "line-0\n"
        # the agent retries the append (the disk is still full, the control plane answers
        # within the close's wait): close 0, and it is there once
        assert append(log_md, line1) is None
        assert live_records(cp)["log.md"].content == "line-0\n" + line1
        assert log_md.read_bytes() == ("line-0\n" + line1).encode()
        again = write_files(root / "default", refused[0], 1)
        assert again[0]["close"] is None, again
        assert live_records(cp)[f"f{refused[0]:03d}.md"].content == content(refused[0])
        assert sc.proc.poll() is None
        assert sc.stop() == 0
    assert unexpected_log_lines(sc.log) == []


def fill_disk(cache: Path, leave: int, name: str = "ballast") -> Path:
    """A ballast file ``name`` in ``cache`` taking all but ``leave`` bytes of its disk; its
    path. The running sidecar may take some of that space between the measure and the
    write (its journal, state saves and disk reserve write in the background): the ballast
    then ends short with ENOSPC, and the disk has ``leave`` bytes free at most."""
    st = os.statvfs(cache)
    ballast = cache / name
    try:
        ballast.write_bytes(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
    return ballast


def journal_bytes(cache: Path) -> int:
    """Bytes the outbox journal's files take on the cache disk (``outbox.db*``): a write
    longer than this needs new space (``st_blocks``, 512-byte units)."""
    return sum(f.stat().st_blocks * 512 for f in cache.glob("outbox.db*"))


def free_bytes(cache: Path) -> int:
    """Bytes free on the cache disk (``statvfs``)."""
    st = os.statvfs(cache)
    return st.f_bavail * st.f_frsize


def keep_full(cache: Path, name: str, settle: float = 2.5, timeout: float = 30.0) -> Path:
    """Fill the cache disk (ballast file ``name``, grown in place, never truncated) and keep
    it 100 % full until the running sidecar has stopped giving space back: ``settle`` s in a
    row with 0 bytes free (longer than the journal's idle checkpoint,
    ``Journal.CHECKPOINT_EVERY``); its path. Bounded by ``timeout`` s (``AssertionError``).

    A disk filled once does not stay full: the sidecar gives its own space back by design
    (a drained journal truncates its write-ahead log and spends its ``DiskReserve``; a
    failed journal or blob-cache transaction's frames are truncated after it), and a write
    that then finds room is accepted, as it should be (fix14c: seen as a close returning 0
    where ENOSPC was asserted, under load, once the drain came after the one fill)."""
    ballast = cache / name
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(ballast, "ab") as f:
                f.write(b"\0" * free_bytes(cache))
        except OSError as e:  # the sidecar took some of it meanwhile: as full as asked
            if e.errno != errno.ENOSPC:
                raise
        full_since = time.monotonic()
        while free_bytes(cache) == 0 and time.monotonic() - full_since < settle:
            time.sleep(0.02)
        if free_bytes(cache) == 0:
            return ballast
        assert time.monotonic() < deadline, f"the cache disk never stayed full for {settle} s"


@pytest.mark.timeout(300)
def test_a_withdrawn_append_to_a_file_only_memory_held_is_undone(on_small_cache, small_cache):
    """Session 12's verifier (N3, 1): a file whose content the full disk kept out of the blob
    cache (held in memory only) lost that content when an append to it was withdrawn: the
    append stayed in the file as ``state=rejected`` and the file's next write committed it
    (a failed close whose write then appears in memory for good; a retried ``>>`` twice).
    The content before the append is kept for the withdrawal (``Node.prior``): the file
    shows it again, and the retried append appears once (docs/SEMANTICS.md, "The sidecar's
    own disk")."""
    with on_small_cache() as (rig, sc):
        cp, root = rig.cp, sc.mountpoint
        fill_disk(small_cache, 0)  # the cache disk full; the control plane answers
        # 64 contents wait for the blob cache (BEHIND_MAX): from then on it refuses each
        # new content at once, which stays in memory only
        first = write_files(root / "default", 0, 70, 16 * 1024)
        assert {r["close"] for r in first} == {None}, first  # committed within the wait
        log_md = root / "default" / "log.md"
        assert append(log_md, "held-0\n") is None
        wait_until(lambda: "log.md" in live_records(cp), 30, "log.md committed")
        cp.stop()  # the control plane down: the journal cannot take the append either
        # (the drain of log.md gave the journal's space back: the disk filled again)
        keep_full(small_cache, "ballast2")
        assert append(log_md, "line-1\n") == "ENOSPC"
        assert log_md.read_bytes() == b"held-0\n"  # withdrawn: the file as before
        assert xattr(log_md, "state") == "clean"
        assert "withdrawn" in (xattr(log_md, "error") or "")
        keep_full(small_cache, "ballast2")  # the withdrawn write's frames were given back
        assert append(log_md, "line-2\n") == "ENOSPC"
        assert log_md.read_bytes() == b"held-0\n"

        cp.start()
        wait_until(lambda: status(root)["outbox"]["depth"] == 0, 60, "the outbox drained")
        assert live_records(cp)["log.md"].content == "held-0\n"  # never sent
        assert append(log_md, "line-1\n") is None  # the agent retries: once
        wait_until(lambda: status(root)["outbox"]["depth"] == 0, 60, "the outbox drained")
        assert live_records(cp)["log.md"].content == "held-0\nline-1\n"
        assert log_md.read_bytes() == b"held-0\nline-1\n"
        assert sc.proc.poll() is None
        assert sc.stop() == 0
    assert unexpected_log_lines(sc.log) == []


@pytest.mark.timeout(300)
def test_a_drained_journal_gives_the_full_cache_disk_space_back(on_small_cache, small_cache):
    """Session 12's verifier (N3, 2): the cache disk full and the control plane down, then
    back: everything committed, yet the disk stayed 100 % full (the journal's write-ahead
    log could not be checkpointed into a database that could not grow; the blob cache's
    retried writes took what was freed), so the next write refused while the control plane
    was down again failed although nothing waited. Once the outbox drains, the journal
    gives its log back (with the disk's reserve, ``DiskReserve``) and the blob cache waits
    for room: the next write is accepted (docs/SEMANTICS.md, "The sidecar's own disk")."""
    with on_small_cache() as (rig, sc):
        cp, root = rig.cp, sc.mountpoint
        log_md = root / "default" / "log.md"
        assert append(log_md, "line-0\n") is None
        wait_until(lambda: "log.md" in live_records(cp), 30, "log.md committed")
        cp.stop()
        fill_disk(small_cache, 700 * 1024)
        first = write_files(root / "default", 0, 20)
        assert "ENOSPC" in {r["close"] for r in first}, first  # the disk did fill up
        kept = [r["i"] for r in first if r["close"] is None]

        cp.start()
        wait_until(lambda: all(f"f{i:03d}.md" in live_records(cp) for i in kept), 60,
                   "the accepted writes committed")
        wait_until(lambda: status(root)["outbox"]["depth"] == 0, 60, "the outbox drained")
        # the ballast still there: what the sidecar gives back is its own (measured: ~550 KB
        # of the 8 MiB disk within 2 s; 0 bytes before)
        wait_until(lambda: free_bytes(small_cache) >= 256 * 1024, 20, "space given back after the drain")
        cp.stop()  # down again: the next write must be taken by the journal
        assert append(log_md, "line-1\n") is None
        assert log_md.read_bytes() == b"line-0\nline-1\n"
        cp.start()
        wait_until(lambda: live_records(cp)["log.md"].content == "line-0\nline-1\n", 60,
                   "the write accepted while the control plane was down committed")
        assert sc.proc.poll() is None
        assert sc.stop() == 0
    assert unexpected_log_lines(sc.log) == []


def test_a_full_disk_met_writing_the_witness_is_enospc():
    """The journal's witness (``accepted.log``) failing with ENOSPC is re-raised as a
    ``sqlite3.Error`` (``Journal._apply``); it is a full disk (``ENOSPC`` at close), not
    ``EIO`` (attack 12 A3 saw EIO closes on a full 4 MiB cache disk)."""
    import sqlite3
    from memfuse.sidecar.cachedir import cache_error
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as exc:
            raise sqlite3.OperationalError("writing the witness: No space left on device") from exc
    except sqlite3.Error as exc:
        assert cache_error(exc, "writing the outbox journal").errno == errno.ENOSPC


async def test_a_withdrawn_write_whose_earlier_content_is_gone_never_sends_it(tmp_path):
    """``Filesystem._withdraw`` when nothing here holds the content a withdrawn write
    replaced (not the write, not a copy, not the put before it, not the blob cache): a file
    that was clean shows the version the control plane holds again (read: fetched,
    ``ContentMissing``); one that was rejected keeps the withdrawn content, never sent: an
    append to it is refused at close (``EIO``), a whole rewrite is sent (docs/SEMANTICS.md,
    "The sidecar's own disk"). The filesystem core against the in-process control plane."""
    import trio
    from memfuse.client import ApiClient
    from memfuse.fake import FakeControlPlane
    from memfuse.sidecar.blobcache import BlobCache
    from memfuse.sidecar.core import ContentMissing, Filesystem, FsError, Settings
    from memfuse.sidecar.inodes import CLEAN, REJECTED
    from memfuse.sidecar.journal import Journal

    fake = FakeControlPlane(seed=0)
    token = await fake.setup("ws", stores=("default",))
    client = ApiClient(fake.base_url, token, transport=fake.transport, instance="disk-test")
    journal = Journal(tmp_path / "outbox.db")
    fs = Filesystem(BlobCache(tmp_path / "blobs.db"), client, journal, Settings(commit_wait=5), "ws")

    def forget(sha: str) -> None:  # gone from memory and the blob cache
        fs.blobs.write_behind()
        fs.blobs._db.execute("DELETE FROM blobs WHERE sha=?", (sha,))
        fs.blobs._verified.discard(sha)
        fs.recent.drop(sha)

    def withdrawn_append(n, text: bytes, state) -> None:
        """An append committed and withdrawn by its close at once (never sent), with
        nothing holding what the file showed before it."""
        w = fs.open(n.ino, os.O_WRONLY | os.O_APPEND)
        fs.write(w, 0, text)
        e = fs.commit(n)
        assert fs.committer.withdraw(e, errno.ENOSPC, "the cache disk is full", "cache_disk_full")
        e.before = e.before._replace(put=None, held=None, prefix=-1, state=state)
        forget(e.before.sha)
        fs._withdraw(n, e)
        fs.release(w.fh)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(journal.run)
        await nursery.start(fs.committer.run)
        sm = fs.add_store("default", "read_write", [])
        h = fs.create(sm.root.ino, b"n.md", 0o600, os.O_WRONLY, 0, 0)
        fs.write(h, 0, b"v1\n")
        await fs.flush(h)
        fs.release(h.fh)
        await fs.committer.wait_idle()
        n = h.node
        v1 = n.sha

        withdrawn_append(n, b"lost\n", CLEAN)
        assert (n.sha, n.size, n.state, n.buf) == (v1, 3, CLEAN, None)
        r = fs.open(n.ino, os.O_RDONLY)
        with pytest.raises(ContentMissing):  # the FUSE guard refetches and reads again
            fs.read(r, 0, 100)
        await fs.refetch(n)
        assert fs.read(r, 0, 100) == b"v1\n"
        fs.release(r.fh)

        withdrawn_append(n, b"lost\n", REJECTED)
        assert n.state == REJECTED and n.lost_prior
        w = fs.open(n.ino, os.O_WRONLY | os.O_APPEND)
        fs.write(w, 0, b"more\n")
        with pytest.raises(FsError) as ei:
            await fs.flush(w)
        assert ei.value.errno == errno.EIO and "withdrawn" in ei.value.reason
        fs.release(w.fh)
        w = fs.open(n.ino, os.O_WRONLY | os.O_TRUNC)  # written whole again: sent
        fs.write(w, 0, b"whole\n")
        await fs.flush(w)
        fs.release(w.fh)
        await fs.committer.wait_idle()
        assert not n.lost_prior and n.state == CLEAN
        rec = await client.get_record("default", n.record_id)
        assert rec.content == "whole\n"
        nursery.cancel_scope.cancel()
    await client.aclose()


def queue_writes(rig: Rig, sc, first: int, count: int) -> list[dict]:
    """With the control plane stopped, write ``count`` files (accepted: queued in the
    outbox journal), then stop the sidecar (its drain gives up: they stay in the journal)
    and start the control plane again. The writer's outcomes."""
    rig.cp.stop()
    out = write_files(sc.mountpoint / "default", first, count, 16 * 1024)
    assert {r["close"] for r in out} == {None}, out  # accepted (the disk has room yet)
    assert sc.stop() == 0
    rig.cp.start()
    return out


def no_journal_moved_aside(cache: Path) -> None:
    assert not [p.name for p in cache.iterdir() if ".corrupt-" in p.name], sorted(os.listdir(cache))


@pytest.mark.timeout(300)
def test_a_sidecar_starts_on_a_full_cache_disk_and_sends_its_queued_writes(on_small_cache, small_cache):
    """attack 14 F3: a sidecar stopped with writes in its outbox journal, its cache disk
    then filled by another program (100 %): the next start moved the journal aside as
    "unreadable" (SQLite's I/O error of a ``-shm`` that cannot grow) and exited with a bare
    ``OperationalError``. A full disk is not a damaged journal: the start makes room from
    what the sidecar owns and can drop (its disk reserve first), mounts, and the queued
    writes reach the control plane (docs/SEMANTICS.md, "The sidecar's own disk")."""
    with on_small_cache("--drain-timeout", "2") as (rig, sc):
        cp = rig.cp
        assert write_files(sc.mountpoint / "default", 0, 3, 16 * 1024)[0]["close"] is None
        queued = queue_writes(rig, sc, 10, 5)
        fill_disk(small_cache, 0, "other-program.bin")
        assert free_bytes(small_cache) == 0
        sc.start()
        want = [0, 1, 2] + [r["i"] for r in queued]

        def all_there() -> bool:
            recs = live_records(cp)
            return all(f"f{i:03d}.md" in recs for i in want)
        wait_until(all_there, 60, "every queued write on the control plane")
        recs = live_records(cp)
        for i in want:
            assert recs[f"f{i:03d}.md"].content == content(i)[:16 * 1024], i
        no_journal_moved_aside(small_cache)
        assert sc.stop() == 0
    assert unexpected_log_lines(sc.log) == []


@pytest.mark.timeout(300)
@pytest.mark.expect_sidecar_errors  # the refused start's one line; checked below
def test_a_cache_disk_with_no_room_to_make_fails_the_start_with_a_sentence(on_small_cache, small_cache):
    """attack 14 F3: a full cache disk where the sidecar has nothing left to give (its reserve
    spent, no blob cache): the start fails (exit 1) with one sentence naming the cache
    directory, that its disk is full and what to do, never a raw SQLite error; the journal
    is kept as it is (not moved aside), and once space is freed the next start sends what
    it holds."""
    with on_small_cache("--drain-timeout", "2") as (rig, sc):
        cp = rig.cp
        queued = queue_writes(rig, sc, 0, 4)
        journal = (small_cache / "outbox.db").read_bytes()
        for name in ("blobs.db", "blobs.db-wal", "blobs.db-shm"):
            (small_cache / name).unlink(missing_ok=True)
        os.truncate(small_cache / "reserve", 0)  # spent, as after a full disk
        ballast = fill_disk(small_cache, 0, "other-program.bin")
        assert free_bytes(small_cache) == 0
        sc.launch()
        assert sc.proc.wait(60) == 1
        text = sc.log.read_text()
        assert "OperationalError" not in text and "Traceback" not in text, text[-3000:]
        line = [json.loads(x) for x in text.splitlines() if x.startswith("{")][-1]
        assert line["level"] == "error", line
        assert str(small_cache) in line["msg"] and "full" in line["msg"], line
        assert "free" in line["msg"], line  # what to do
        assert unexpected_log_lines(sc.log) == [x for x in text.splitlines() if x.startswith("{")][-1:]
        offset = sc.log.stat().st_size
        assert (small_cache / "outbox.db").read_bytes() == journal  # kept as it was
        no_journal_moved_aside(small_cache)

        ballast.unlink()
        sc.start()
        wait_until(lambda: all(f"f{r['i']:03d}.md" in live_records(cp) for r in queued), 60,
                   "the queued writes on the control plane")
        no_journal_moved_aside(small_cache)
        assert sc.stop() == 0
    assert unexpected_log_lines(sc.log, offset) == []


@pytest.mark.timeout(300)
def test_stores_that_do_not_fit_the_cache_disk_say_so_while_the_start_waits(tmp_path, small_cache):
    """attack 14 (the silent start): a new sidecar whose store holds more content than its
    cache disk can take logged "cache disk refused a write while loading default; retrying"
    every few seconds and nothing else. While it waits, ``/readyz`` and the status say why
    (the cache disk, the bytes the store needs, the bytes free) and the log line says the
    sizes too (docs/DEPLOY.md, "When things go wrong")."""
    import httpx

    with Rig(tmp_path) as rig:
        token = rig.workspace("ws")
        for i in range(12):  # ~11 MB (12 contents of ~0.9 MB): more than the 8 MiB cache disk
            big = "".join(f"record {i} line {k}\n" for k in range(45000))
            rig.cp.call("create_record", "default", f"big{i:02d}.md", big)
        sc = rig.sidecar("ws", cache_dir=small_cache, token=token, start=False)
        sc.launch()
        sock = small_cache / "admin.sock"
        wait_until(lambda: sock.exists(), 60, "the admin socket")
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://sidecar",
                          timeout=10) as c:
            def said() -> bool:
                r = c.get("/readyz")
                return r.status_code == 503 and "cache disk" in r.text
            wait_until(said, 90, "/readyz saying the cache disk is too small")
            reason = c.get("/readyz").json()["detail"]
            assert str(small_cache) in reason and "bytes are free" in reason, reason
            st = c.get("/v1/status").json()
            assert st["ready"] is False and "cache disk" in (st["cache"]["load_error"] or ""), st["cache"]
        assert sc.proc.poll() is None  # still trying: space may come
        lines = [json.loads(x) for x in sc.log.read_text().splitlines() if x.startswith("{")]
        full = [x for x in lines if "loading default" in x["msg"] and "cache disk" in x["msg"]]
        assert full and "needed_bytes" in full[-1] and "free_bytes" in full[-1], full[-1:]
        assert full[-1]["needed_bytes"] > 8 << 20
        assert sc.stop() == 0


def test_space_freed_on_a_full_cache_disk_is_not_taken_by_the_blob_cache_log(small_cache):
    """attack 14 F1: on a full cache disk the blob cache's checkpoint (the collection's, the
    one after a failed write, the one behind the writes) copied its write-ahead log into a
    database file that grew into whatever was freed, and failed again: the space an operator
    freed went to the cache, and the outbox journal stayed refused. A checkpoint that must
    copy pages now waits until the disk has room for them; one that only truncates the log
    still runs, giving its space back (docs/SEMANTICS.md, "The sidecar's own disk")."""
    from memfuse.sidecar.blobcache import BlobCache

    blobs = BlobCache(small_cache / "blobs.db")
    try:
        for i in range(16):  # ~2.5 MB in the log, not copied yet (behind: from 4 MiB)
            blobs.put(bytes([65 + i]) * (160 * 1024))
        assert os.stat(small_cache / "blobs.db-wal").st_size > 2 << 20
        db_size = os.stat(small_cache / "blobs.db").st_size
        ballast = fill_disk(small_cache, 0)
        assert free_bytes(small_cache) == 0
        with open(ballast, "r+b") as f:  # the operator frees 512 KiB
            f.truncate(os.stat(ballast).st_size - (512 << 10))
        freed = free_bytes(small_cache)
        assert freed >= 512 << 10
        blobs.checkpoint()
        assert free_bytes(small_cache) >= freed - (64 << 10), "the log's checkpoint took the space"
        assert os.stat(small_cache / "blobs.db").st_size == db_size
        assert len(blobs.read(sha256_of(bytes([65]) * (160 * 1024)))) == 160 * 1024  # all held

        ballast.unlink()  # room: the log is copied and truncated
        blobs.checkpoint()
        assert os.stat(small_cache / "blobs.db-wal").st_size == 0
        blobs.put(b"one more" * 1000)  # a log again, all of it copied by a checkpoint that
        _, frames, copied = blobs._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        wal = os.stat(small_cache / "blobs.db-wal").st_blocks * 512  # left it in place
        assert wal > 0 and frames == copied
        fill_disk(small_cache, 0, "ballast2")
        before = free_bytes(small_cache)
        blobs.checkpoint()  # a full disk: only a truncation, which gives the log back
        assert free_bytes(small_cache) >= before + wal - 4096
    finally:
        blobs.close()


def sha256_of(data: bytes) -> str:
    import hashlib
    return hashlib.sha256(data).hexdigest()


async def test_a_directory_fsync_refused_by_a_full_disk_names_the_directory(tmp_path):
    """``Filesystem.fsyncdir`` whose changes the outbox journal cannot take (the cache disk
    full): ``ENOSPC``, and the ``errors.log`` line names the store and the directory (``.``
    for the store's root), not the mount root's entry with no store (attack26 F8: ``store=""
    path=agent``). The filesystem core against the in-process control plane, the journal's
    barrier refusing as a full disk does."""
    import trio
    from memfuse.client import ApiClient
    from memfuse.fake import FakeControlPlane
    from memfuse.sidecar.blobcache import BlobCache
    from memfuse.sidecar.cachedir import CacheError
    from memfuse.sidecar.core import Filesystem, FsError, Settings
    from memfuse.sidecar.journal import Journal

    fake = FakeControlPlane(seed=0)
    token = await fake.setup("ws", stores=("default",))
    client = ApiClient(fake.base_url, token, transport=fake.transport, instance="disk-test")
    journal = Journal(tmp_path / "outbox.db")
    fs = Filesystem(BlobCache(tmp_path / "blobs.db"), client, journal, Settings(commit_wait=5), "ws")

    class Refused:
        async def wait_accepted(self, timeout: float) -> None:
            raise CacheError(errno.ENOSPC, "the sidecar's cache disk is full (writing the outbox journal)")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(journal.run)
        await nursery.start(fs.committer.run)
        sm = fs.add_store("default", "read_write", [])
        sub = fs.mkdir(sm.root.ino, b"notes", 0o755, 0, 0)
        journal.barrier = Refused  # type: ignore[method-assign]
        for node, path in ((sm.root, "."), (sub, "notes")):
            h = fs.opendir(node.ino)
            with pytest.raises(FsError) as ei:
                await fs.fsyncdir(h)
            assert ei.value.errno == errno.ENOSPC
            line = fs.controls.errors[-1]
            assert (line["store"], line["path"], line["errno"], line["code"]) == (
                "default", path, "ENOSPC", "cache_disk_full"), line
        nursery.cancel_scope.cancel()
    await client.aclose()


@pytest.mark.timeout(300)
def test_a_rename_or_unlink_on_a_full_cache_disk_returns_0_and_is_committed(on_small_cache,
                                                                            small_cache):
    """ns27: a rename, an unlink and a chmod wait for their outbox entry to be in the
    journal (so a kill -9 keeps them), but never fail for it: with the cache disk 100 %
    full the journal refuses the entry, and the call still returns 0, at once (bounded),
    the change applied and queued, a log line saying so; it is committed all the same."""
    with on_small_cache() as (rig, sc):
        cp, store = rig.cp, sc.mountpoint / "default"
        for name in ("mv.md", "rm.md", "mode.md"):
            (store / name).write_text(f"# {name}\n")
        wait_until(lambda: all(xattr(store / n, "state") == "clean" for n in ("mv.md", "rm.md", "mode.md")),
                 timeout=30)
        ballast = keep_full(small_cache, "ballast")
        try:
            t0 = time.monotonic()
            os.rename(store / "mv.md", store / "mv2.md")
            os.unlink(store / "rm.md")
            os.chmod(store / "mode.md", 0o600)
            took = time.monotonic() - t0
        finally:
            ballast.unlink()
        assert took < 12, took  # each at most CHANGE_WAIT (5 s); a failing journal is not waited for
        assert "returned before the outbox journal had it on disk" in sc.log.read_text()
        wait_until(lambda: status(sc.mountpoint)["outbox"]["depth"] == 0, timeout=60)
        recs, _ = cp.call("snapshot", "default", content=False)
        assert sorted(r.path for r in recs) == ["mode.md", "mv2.md"]
        assert sorted(os.listdir(store)) == ["mode.md", "mv2.md"]
