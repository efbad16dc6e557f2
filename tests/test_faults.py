"""Fault paths of the sidecar without FUSE: the outbox journal, the committer, the change feed
and the supervision of long-lived tasks, driven by the in-process fake's fault injection
(``memfuse.fake.Faults``) and by injected exceptions.

The sidecar runs here as a ``Sidecar`` object inside the test's trio loop, without a mount:
its ``Filesystem`` is called directly, its tasks are started as ``run`` would start them.
"""
from __future__ import annotations

import errno
import logging
import os
import sqlite3
from pathlib import Path

import pytest
import trio

from memfuse.client import ApiClient
from memfuse.fake import FakeControlPlane
from memfuse.sidecar.core import FsError
from memfuse.sidecar.mount import MountConfig, Sidecar
from memfuse.sidecar.cachedir import CacheError
from memfuse.sidecar.committer import Committer
from memfuse.sidecar.journal import PUT, Journal
from memfuse.wire import sha256_hex

FULL = sqlite3.OperationalError("database or disk is full")


class FlakyJournal(Journal):
    """A journal whose next ``fail`` batch writes raise ``exc`` (as a full disk would)."""

    def __init__(self, path: Path, fail: int = 0, exc: Exception = FULL) -> None:
        super().__init__(path)
        self.fail, self.exc, self.batches = fail, exc, []
        self.RETRY_MIN = self.RETRY_MAX = 0.01

    def _apply(self, batch, light=False):
        self.batches.append([op[2] for op in batch])
        if self.fail > 0:
            self.fail -= 1
            raise self.exc
        super()._apply(batch, light)


class Offline:
    """A client stand-in for tests of the journal alone: every call fails as unreachable."""

    def __getattr__(self, name):
        raise AssertionError(f"no control plane in this test ({name})")


async def test_failed_journal_write_keeps_batch_and_waiters_in_order_and_retries(tmp_path):
    j = FlakyJournal(tmp_path / "outbox.db", fail=3)
    c = Committer(Offline(), j, {})  # never run: only submit() is used
    async with trio.open_nursery() as nursery:
        entries = [c.submit("s", PUT, f"n:{i}", {"path": f"f{i}"}, b"x") for i in range(3)]
        nursery.start_soon(j.run)
        # the first attempt fails: the waiter learns why at once (ENOSPC), nothing is lost
        with pytest.raises(CacheError) as ei:
            await entries[0].wait_accepted(5)
        assert ei.value.errno == errno.ENOSPC and "full" in ei.value.reason
        more = c.submit("s", PUT, "n:3", {"path": "f3"}, b"y")
        with trio.fail_after(10):
            await more.durable.wait()
        for e in entries:
            assert e.durable.is_set() and e.journal_error is None
            await e.wait_accepted(1)  # accepted now: returns at once
        nursery.cancel_scope.cancel()
    # every attempt wrote the same batch first, in order; nothing was dropped
    assert all(b[:3] == [1, 2, 3] for b in j.batches), j.batches
    assert j.batches[-1][-1] == 4
    rows = [r[0] for r in j._db.execute("SELECT id FROM entries ORDER BY id")]
    assert rows == [1, 2, 3, 4]
    assert j.error is None and j.failures == 3
    j.close()


async def test_journal_io_error_is_eio_and_a_stalled_journal_is_bounded(tmp_path):
    j = FlakyJournal(tmp_path / "outbox.db", fail=1, exc=sqlite3.OperationalError("disk I/O error"))
    c = Committer(Offline(), j, {})
    e = c.submit("s", PUT, "n:1", {"path": "f"}, b"x")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(j.run)
        with pytest.raises(CacheError) as ei:
            await e.wait_accepted(5)
        assert ei.value.errno == errno.EIO
        nursery.cancel_scope.cancel()
    # a journal that never gets to the entry (no run task): the wait ends after its bound
    e2 = c.submit("s", PUT, "n:2", {"path": "g"}, b"x")
    with trio.fail_after(5):
        with pytest.raises(CacheError) as ei:
            await e2.wait_accepted(0.2)
    assert ei.value.errno == errno.EIO and "did not write within" in ei.value.reason
    j.close()


async def test_entry_finished_before_it_was_written_is_never_written(tmp_path):
    j = Journal(tmp_path / "outbox.db")
    c = Committer(Offline(), j, {})
    e = c.submit("s", PUT, "n:1", {"path": "f"}, b"x" * 1000)
    j.remove(e)  # committed before the journal got to it
    e.finish()
    await e.wait_accepted(1)  # finished counts: close does not wait for the disk
    await j.flush_pending()
    assert j._db.execute("SELECT COUNT(*) FROM entries").fetchone()[0] == 0
    j.close()


# ------------------------------------------------------------------ sidecar without a mount
async def make_sidecar(tmp_path: Path, fake: FakeControlPlane, token: str, **kw) -> Sidecar:
    client = ApiClient(fake.base_url, token, transport=fake.transport, instance="fault-test")
    cfg = MountConfig(mountpoint=tmp_path / "mnt", workspace="ws", cache_dir=tmp_path / "cache",
                      commit_wait=kw.pop("commit_wait", 5), **kw)
    return Sidecar(cfg, client)


async def start(sc: Sidecar, nursery: trio.Nursery) -> None:
    """What ``Sidecar.run`` does before and after the mount, minus FUSE."""
    sc._nursery = nursery
    sc._spawn("journal", sc.journal.run)
    await nursery.start(sc.committer.run)
    for att in await sc.client.list_attachments("ws"):
        await sc._add_attachment(att)
    sc._mounted = True
    for slug in sc.fs.stores:
        sc._start_feed(slug)
    sc._spawn("events", sc._events)
    sc.fs.ready = True


async def write(sc: Sidecar, path: str, data: bytes, *, wait: bool = True,
                append: bool = False):
    """create-or-truncate (``append``: open ``O_APPEND``, as ``echo data >> path``), write,
    close through the core (as the FUSE adapter would); returns the node. ``wait=False``:
    commit and release without waiting for the control plane (a writer that closes and goes
    on: a backlog builds up)."""
    import os
    sm = sc.fs.stores["default"]
    n = sc.fs.lookup(sm.root.ino, path.encode())
    if n is None:
        h = sc.fs.create(sm.root.ino, path.encode(), 0o644, os.O_WRONLY, 0, 0)
    else:
        h = sc.fs.open(n.ino, os.O_WRONLY | (os.O_APPEND if append else os.O_TRUNC))
    try:
        sc.fs.write(h, 0, data)
        if wait:
            await sc.fs.flush(h)
        else:
            assert sc.fs.commit(h.node) is not None
    finally:
        sc.fs.release(h.fh)
    return h.node


def local(sc: Sidecar) -> dict[str, bytes]:
    sm = sc.fs.stores["default"]
    return {n.path(): sc.fs._content(n) for n in sc.fs._walk_files(sm.root)}


async def remote(fake: FakeControlPlane) -> dict[str, bytes]:
    import httpx
    async with ApiClient(fake.base_url, fake.admin_token,
                         transport=httpx.ASGITransport(app=fake.app)) as api:
        recs, _ = await api.snapshot("default", content=True)
    return {r.path: r.content.encode() for r in recs}


async def wait_until(pred, timeout: float = 20) -> None:
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(0.01)


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_410_while_writes_commit_never_reverts_or_hides_a_write(tmp_path, seed):
    """A 410 arrives again and again while this sidecar's writes commit (and the snapshot is
    slow, so commits land around it): after each close that returned 0, the tree shows the
    written content, and at the end the tree equals the control plane."""
    fake = FakeControlPlane(seed=seed)
    token = await fake.setup("ws")
    sc = await make_sidecar(tmp_path, fake, token)
    sc._feed_kw = {"skip_actor": sc.actor}
    async with trio.open_nursery() as nursery:
        await start(sc, nursery)
        fake.faults.latency = 0.002
        written: dict[str, bytes] = {}

        async def expire_cursor():  # another actor writes (waking the feed), then 410
            async with fake.client() as http:
                for k in range(10_000):
                    fake.faults.inject.append(("GET", r"/changes$", 410))
                    r = await http.post("/v1/stores/default/records",
                                        json={"path": f"remote/r{k}.md", "content": f"{k}\n"})
                    assert r.status_code == 201, r.text
                    await trio.sleep(0.03)
        nursery.start_soon(expire_cursor)
        for i in range(60):
            path = f"f{i % 12}.md"
            data = f"version {i} of {path}\n".encode()
            await write(sc, path, data)
            written[path] = data
            if i % 3 == 0:
                await trio.sleep(0.02)  # let a resync run between writes
            got = local(sc)
            assert {p: got.get(p) for p in written} == written, f"after write {i}"
        assert fake.counters.injected >= 3  # the cursor did expire meanwhile
        nursery.cancel_scope.cancel()
    fake.faults.inject.clear()
    async with trio.open_nursery() as nursery:  # the feed alone, until it caught up
        sc._nursery = nursery
        sc._spawn("journal", sc.journal.run)
        await nursery.start(sc.committer.run)
        sc._start_feed("default")
        await wait_until(lambda: sc.committer.depth() == 0)
        want = await remote(fake)
        await wait_until(lambda: local(sc) == want)
        assert {p: want.get(p) for p in written} == written
        nursery.cancel_scope.cancel()
    sc.journal.close()
    await sc.client.aclose()


async def test_transient_error_during_the_410_snapshot_is_retried(tmp_path, caplog):
    fake = FakeControlPlane(seed=4)
    token = await fake.setup("ws")
    sc = await make_sidecar(tmp_path, fake, token)
    async with trio.open_nursery() as nursery:
        await start(sc, nursery)
        await write(sc, "a.md", b"one\n")
        fake.faults.inject += [("GET", r"/changes$", 410), ("GET", r"/records$", 503),
                               ("GET", r"/changes$", 410), ("GET", r"/records$", 500)]
        # someone else writes while this happens: the feed must still deliver it
        async with fake.client() as http:
            r = await http.post("/v1/stores/default/records", json={"path": "b.md", "content": "two\n"})
            assert r.status_code == 201, r.text
        await wait_until(lambda: local(sc).get("b.md") == b"two\n")
        await wait_until(lambda: not fake.faults.inject)  # every injected failure was met
        async with fake.client() as http:
            r = await http.post("/v1/stores/default/records", json={"path": "c.md", "content": "3\n"})
            assert r.status_code == 201, r.text
        await wait_until(lambda: local(sc).get("c.md") == b"3\n")
        assert local(sc)["a.md"] == b"one\n"
        assert sc.feed_tasks == 1 and sc.task_failures == {}
        nursery.cancel_scope.cancel()
    sc.journal.close()
    await sc.client.aclose()


@pytest.mark.expect_sidecar_errors("exceptions injected into every long-lived task on purpose")
async def test_unexpected_exceptions_in_tasks_are_logged_counted_and_restarted(tmp_path, caplog):
    """An exception at each long-lived task's failure point: the task is restarted with
    backoff, the failure is logged with its context and counted; nothing ends."""
    fake = FakeControlPlane(seed=5)
    token = await fake.setup("ws")
    sc = await make_sidecar(tmp_path, fake, token)
    boom = {"apply_remote": 1, "list_attachments": 1, "update_record": 1}
    real_apply, real_list = sc.fs.apply_remote, sc.client.list_attachments
    real_update = sc.client.update_record

    def apply_remote(*a, **k):
        if boom["apply_remote"]:
            boom["apply_remote"] -= 1
            raise RuntimeError("injected: feed")
        return real_apply(*a, **k)

    async def list_attachments(*a, **k):
        if boom["list_attachments"] and sc.fs.ready:
            boom["list_attachments"] -= 1
            raise RuntimeError("injected: reconcile")
        return await real_list(*a, **k)

    async def update_record(*a, **k):
        if boom["update_record"]:
            boom["update_record"] -= 1
            raise RuntimeError("injected: committer")
        return await real_update(*a, **k)

    sc.fs.apply_remote = apply_remote
    sc.client.list_attachments = list_attachments
    sc.client.update_record = update_record
    caplog.set_level(logging.INFO)
    async with trio.open_nursery() as nursery:
        await start(sc, nursery)
        await write(sc, "a.md", b"one\n")
        # a remote change (feed: apply_remote raises once) and an attach event (events:
        # reconcile raises once); a local update (committer: update_record raises once)
        async with fake.client() as http:
            r = await http.post("/v1/stores/default/records", json={"path": "r.md", "content": "x\n"})
            assert r.status_code == 201
            r = await http.post("/v1/stores", json={"slug": "other"})
            assert r.status_code == 201
            r = await http.put("/v1/workspaces/ws/attachments/other", json={"access": "read_write"})
            assert r.status_code in (200, 201)
        await write(sc, "a.md", b"two\n")
        await wait_until(lambda: local(sc).get("r.md") == b"x\n")
        await wait_until(lambda: boom["list_attachments"] == 0)
        sc.fs.ready = False  # the next reconcile succeeds
        async with fake.client() as http:
            await http.delete("/v1/workspaces/ws/attachments/other")
            await http.put("/v1/workspaces/ws/attachments/other", json={"access": "read_write"})
        await wait_until(lambda: "other" in sc.fs.stores)
        await wait_until(lambda: sc.committer.depth() == 0)
        assert (await remote(fake))["a.md"] == b"two\n"
        assert sc.task_failures.get("feed") == 1 and sc.task_failures.get("reconcile") == 1
        assert sc.committer.unexpected == 1
        nursery.cancel_scope.cancel()
    msgs = {r.getMessage() for r in caplog.records if r.exc_info}
    assert "background task failed; restarting it" in msgs
    assert "reconcile failed unexpectedly" in msgs
    assert "commit failed unexpectedly; will retry" in msgs
    feed_rec = next(r for r in caplog.records if r.getMessage().startswith("background task failed"))
    assert feed_rec.task == "feed" and feed_rec.store == "default"
    sc.journal.close()
    await sc.client.aclose()


async def test_nul_is_refused_at_close_without_the_control_plane(tmp_path):
    fake = FakeControlPlane(seed=6)
    token = await fake.setup("ws")
    sc = await make_sidecar(tmp_path, fake, token)
    async with trio.open_nursery() as nursery:
        await start(sc, nursery)
        fake.faults.outage = True
        with pytest.raises(FsError) as ei:
            await write(sc, "n.md", b"text\0more\n")
        assert ei.value.errno == errno.EILSEQ and "NUL" in ei.value.reason
        nursery.cancel_scope.cancel()
    sc.journal.close()
    await sc.client.aclose()


async def test_closes_during_an_outage_return_once_accepted_and_commit_after(tmp_path):
    """While the outbox knows the control plane is unreachable (its last attempt failed with
    a connection error and none was answered since), a close returns as soon as its write is
    accepted, not after ``--commit-wait``: N closes take far less than N × commit-wait. fsync
    keeps its contract (EIO after ``--fsync-timeout``). A healthy but slow control plane is
    still waited for. ``status.json`` shows the reachability; the writes commit afterwards."""
    wait = 10.0
    fake = FakeControlPlane(seed=8)
    token = await fake.setup("ws")
    sc = await make_sidecar(tmp_path, fake, token, commit_wait=wait, fsync_timeout=1.0)
    async with trio.open_nursery() as nursery:
        await start(sc, nursery)
        fake.faults.latency = 0.3  # healthy, slow: close waits for the commit as before
        await write(sc, "slow.md", b"slow\n")
        sm = sc.fs.stores["default"]
        assert sc.fs.lookup(sm.root.ino, b"slow.md").state == "clean"
        assert sc.status()["control_plane"] == {"reachable": True}
        fake.faults.latency = 0.0

        fake.faults.outage = True
        n = 12
        t0 = trio.current_time()
        for i in range(n):
            await write(sc, f"f{i:02d}.md", f"during the outage {i}\n".encode())
        took = trio.current_time() - t0
        # before: every close waited the full commit-wait (n × 10 s); now all of them
        # together take less than one commit-wait
        assert took < wait, took
        assert all(sc.fs.lookup(sm.root.ino, f"f{i:02d}.md".encode()).state == "pending"
                   for i in range(n))
        cp = sc.status()["control_plane"]
        assert cp["reachable"] is False and cp["error"] == "connect_error", cp
        assert "since" in cp and cp["down_s"] >= 0
        # fsync still waits for the commit, bounded by --fsync-timeout
        h = sc.fs.open(sc.fs.lookup(sm.root.ino, b"f00.md").ino, os.O_WRONLY | os.O_APPEND)
        try:
            sc.fs.write(h, 0, b"synced\n")
            t1 = trio.current_time()
            with pytest.raises(FsError) as ei:
                await sc.fs.fsync(h)
            assert ei.value.errno == errno.EIO and trio.current_time() - t1 >= 0.9
            await sc.fs.flush(h)  # returns at once: accepted, pending
        finally:
            sc.fs.release(h.fh)

        fake.faults.outage = False
        sc.committer.poke()
        await wait_until(lambda: sc.committer.depth() == 0, timeout=60)
        assert sc.status()["control_plane"] == {"reachable": True}
        want = {f"f{i:02d}.md": f"during the outage {i}\n".encode() for i in range(n)}
        want["f00.md"] += b"synced\n"
        want["slow.md"] = b"slow\n"
        assert await remote(fake) == want
        assert all(sc.fs.lookup(sm.root.ino, p.encode()).state == "clean" for p in want)
        nursery.cancel_scope.cancel()
    sc.journal.close()
    await sc.client.aclose()


# ------------------------------------------------------------------ appends meeting a concurrent change
async def append(sc: Sidecar, path: str, data: bytes, *, wait: bool = True):
    """``echo data >> path`` through the core (``write`` with ``append``); returns the node."""
    return await write(sc, path, data, wait=wait, append=True)


def conflict_lines(sc: Sidecar) -> list[dict]:
    return [e for e in sc.fs.errors if e.get("conflict")]


@pytest.mark.parametrize("races", [1, 3])
async def test_an_append_meeting_a_concurrent_change_is_rebased_not_overwritten(tmp_path, races, caplog):
    """A write that is its base plus a suffix (``echo >> f``) gets 412 because another writer
    changed the record: the sidecar writes the current content plus the suffix (If-Match the
    current version, again when it races again), the local file shows the merged content,
    no conflict line; one structured log line per merge, without content."""
    from memfuse.fake import RACE_MARKER
    caplog.set_level(logging.INFO, logger="memfuse.outbox")
    fake = FakeControlPlane(seed=9)
    token = await fake.setup("ws")
    sc = await make_sidecar(tmp_path, fake, token)
    async with trio.open_nursery() as nursery:
        await start(sc, nursery)
        await write(sc, "j.md", b"a\n")
        fake.faults.precondition_race = races  # the append, then each rebase, meet an edit
        n = await append(sc, "j.md", b"b\n")
        want = b"a\n" + RACE_MARKER.encode() * races + b"b\n"
        assert fake.counters.races == races
        assert (await remote(fake))["j.md"] == want
        assert sc.fs._content(n) == want and n.state == "clean" and n.buf is None
        assert n.sha == sha256_hex(want) and n.size == len(want)
        assert sc.committer.merges == 1 and sc.committer.conflicts == 0
        assert conflict_lines(sc) == []
        merged = [r for r in caplog.records if r.getMessage() == "write merged onto a concurrent change"]
        assert len(merged) == 1 and merged[0].attempt == races and merged[0].kind == "append"
        assert "b\n" not in repr(merged[0].__dict__) and sc.status()["outbox"]["merged"] == 1
        # the next append is based on the merged content: no 412, no merge
        await append(sc, "j.md", b"c\n")
        assert (await remote(fake))["j.md"] == want + b"c\n" and sc.committer.merges == 1
        nursery.cancel_scope.cancel()
    sc.journal.close()
    await sc.client.aclose()


async def test_writes_made_while_a_merge_is_in_flight_are_rebased_onto_it(tmp_path):
    """The file is appended to again (dirty, then a queued put) while its previous append is
    being merged: the local dirty file is not overwritten by the merge, and its put — written
    on the content before the merge — is rebased onto the merge in turn: every line once."""
    from memfuse.fake import RACE_MARKER
    fake = FakeControlPlane(seed=10)
    token = await fake.setup("ws")
    sc = await make_sidecar(tmp_path, fake, token)
    async with trio.open_nursery() as nursery:
        await start(sc, nursery)
        await write(sc, "j.md", b"a\n")
        fake.faults.precondition_race = 1
        fake.faults.latency = 0.2  # the merge takes a while
        n = await append(sc, "j.md", b"b\n", wait=False)
        e1 = n.last_put
        sm = sc.fs.stores["default"]
        h = sc.fs.open(n.ino, os.O_WRONLY | os.O_APPEND)
        sc.fs.write(h, 0, b"c\n")  # dirty while the merge is in flight
        with trio.fail_after(20):
            await e1.done.wait()
        assert e1.merged is not None and e1.errno == 0
        assert sc.fs._content(n) == b"a\nb\nc\n" and n.dirty  # never overwritten
        await append(sc, "j.md", b"d\n", wait=False)  # another put, queued behind
        await sc.fs.flush(h)
        sc.fs.release(h.fh)
        fake.faults.latency = 0.0
        await wait_until(lambda: sc.committer.depth() == 0)
        want = b"a\n" + RACE_MARKER.encode() + b"b\nc\nd\n"
        assert (await remote(fake))["j.md"] == want
        assert sc.fs._content(sc.fs.lookup(sm.root.ino, b"j.md")) == want
        assert sc.committer.conflicts == 0 and conflict_lines(sc) == []
        assert sc.committer.resolver.merged == {}
        nursery.cancel_scope.cancel()
    sc.journal.close()
    await sc.client.aclose()


async def test_a_rebase_whose_answer_was_lost_is_not_applied_twice(tmp_path):
    """The rebased write is applied but its answer lost: the retry meets the record with the
    suffix already on it; the rebase's idempotency key, reused with another body, tells the
    sidecar it was applied (422 idempotency_key_reused): the suffix is there once."""
    from memfuse.errors import TransientError
    from memfuse.fake import RACE_MARKER
    fake = FakeControlPlane(seed=11)
    token = await fake.setup("ws")
    sc = await make_sidecar(tmp_path, fake, token)
    real = sc.client.update_record
    lost = []

    async def losing(*args, **kw):
        rec = await real(*args, **kw)
        if kw.get("idempotency_key", "").endswith("-rebase") and not lost:
            lost.append(rec)
            raise TransientError("answer lost", code="read_error")
        return rec

    sc.client.update_record = losing
    async with trio.open_nursery() as nursery:
        await start(sc, nursery)
        await write(sc, "j.md", b"a\n")
        fake.faults.precondition_race = 1
        n = await append(sc, "j.md", b"b\n")
        await wait_until(lambda: sc.committer.depth() == 0)
        want = b"a\n" + RACE_MARKER.encode() + b"b\n"
        assert lost and (await remote(fake))["j.md"] == want
        assert sc.fs._content(n) == want and sc.committer.conflicts == 0
        nursery.cancel_scope.cancel()
    sc.journal.close()
    await sc.client.aclose()


async def test_no_append_or_no_base_is_last_writer_wins_with_a_conflict_line(tmp_path):
    """A rewrite (not base + suffix) meeting a concurrent change, and an append whose base
    content is no longer cached: last writer wins, the other version stays in history, and
    a conflict line goes to errors.log."""
    fake = FakeControlPlane(seed=12)
    token = await fake.setup("ws")
    sc = await make_sidecar(tmp_path, fake, token)
    async with trio.open_nursery() as nursery:
        await start(sc, nursery)
        # a partial last line: the fake's concurrent edit (a line appended) is no whole-line
        # append after a rewrite of it (which merges: attack 15 F5), it overlaps the rewrite
        await write(sc, "r.md", b"one")
        fake.faults.precondition_race = 1
        await write(sc, "r.md", b"rewritten\n")
        assert (await remote(fake))["r.md"] == b"rewritten\n"
        assert len(conflict_lines(sc)) == 1 and sc.committer.merges == 0

        await write(sc, "j.md", b"a\n")
        sc.committer.resolver.base_content = lambda sha: None  # the base's content is not cached
        fake.faults.precondition_race = 1
        await append(sc, "j.md", b"b\n")
        assert (await remote(fake))["j.md"] == b"a\nb\n"
        assert len(conflict_lines(sc)) == 2 and sc.committer.merges == 0
        nursery.cancel_scope.cancel()
    sc.journal.close()
    await sc.client.aclose()


def test_both_sides_adding_lines_at_the_end_merge_as_two_appends():
    """``merge_lines``: lines both sides added after the base's last line are kept, theirs
    first (attack 12 A9: a rewrite carrying the mount's own queued appends met the other
    mount's appends); the same lines added on both sides once; two insertions at one place
    inside the file, or changes of the same line, are still a conflict (None); a change of
    the last line and the other side's lines appended after it merge (attack 27 F3)."""
    from memfuse.sidecar.conflict import merge_lines

    base = b"counter=0\nx\nB-1\n"
    assert merge_lines(base, base + b"A-1\nA-2\n", b"counter=1\nx\nB-1\nB-2\n") == \
        b"counter=1\nx\nB-1\nA-1\nA-2\nB-2\n"
    assert merge_lines(base, base + b"A-1\n", base + b"A-1\n") == base + b"A-1\n"
    assert merge_lines(base, b"counter=0\nA\nx\nB-1\n", b"counter=0\nB\nx\nB-1\n") is None
    # theirs changed the last line, ours appended after it: they touch but change no common
    # line (attack 27 F3): merged, the change then the appended line
    assert merge_lines(base, b"counter=0\nx\nB-9\n", b"counter=0\nx\nB-1\nB-2\n") == \
        b"counter=0\nx\nB-9\nB-2\n"
    assert merge_lines(base, b"counter=0\nx\nB-9\n", b"counter=0\nx\nB-5\nB-2\n") is None
    assert merge_lines(base, b"counter=2\nx\nB-1\n", b"counter=1\nx\nB-1\n") is None


async def test_edits_of_disjoint_lines_are_merged_three_way(tmp_path, caplog):
    """Not an append: the local edit (line 1) and the concurrent one (line 5) touch
    disjoint lines: a clean three-way merge, no conflict line; edits of the same line are
    last-writer-wins with a conflict line."""
    caplog.set_level(logging.INFO, logger="memfuse.outbox")
    fake = FakeControlPlane(seed=13)
    token = await fake.setup("ws")
    sc = await make_sidecar(tmp_path, fake, token)
    async with trio.open_nursery() as nursery:
        await start(sc, nursery)
        await write(sc, "m.md", b"a\nb\nc\nd\ne\n")
        sm = sc.fs.stores["default"]
        n = sc.fs.lookup(sm.root.ino, b"m.md")

        async def edit_elsewhere(content: str) -> None:
            async with ApiClient(fake.base_url, fake.admin_token, transport=fake._inner) as adm:
                await adm.update_record("default", n.record_id, content)

        h = sc.fs.open(n.ino, os.O_WRONLY)
        sc.fs.write(h, 0, b"A")  # dirty: the feed does not touch it
        await edit_elsewhere("a\nb\nc\nd\nE\n")
        await sc.fs.flush(h)
        sc.fs.release(h.fh)
        want = b"A\nb\nc\nd\nE\n"
        assert (await remote(fake))["m.md"] == want and sc.fs._content(n) == want
        assert sc.committer.merges == 1 and conflict_lines(sc) == []
        assert [r.kind for r in caplog.records if r.getMessage().startswith("write merged")] == ["three_way"]

        h = sc.fs.open(n.ino, os.O_WRONLY)
        sc.fs.write(h, 4, b"X")  # line 3, changed elsewhere too
        await edit_elsewhere("A\nb\nY\nd\nE\n")
        await sc.fs.flush(h)
        sc.fs.release(h.fh)
        assert (await remote(fake))["m.md"] == b"A\nb\nX\nd\nE\n"
        assert sc.committer.merges == 1 and len(conflict_lines(sc)) == 1
        nursery.cancel_scope.cancel()
    sc.journal.close()
    await sc.client.aclose()


async def test_the_merge_state_survives_a_crash_before_the_next_write_commits(tmp_path):
    """A file appended to again while its previous append was being merged, and the
    sidecar stops before that second write commits: the restarted sidecar replays it onto
    the merge (the merge state is in the outbox journal), not over it."""
    from memfuse.fake import RACE_MARKER
    fake = FakeControlPlane(seed=14)
    token = await fake.setup("ws")
    sc = await make_sidecar(tmp_path, fake, token)
    async with trio.open_nursery() as nursery:
        await start(sc, nursery)
        await write(sc, "j.md", b"a\n")
        fake.faults.precondition_race = 1
        fake.faults.latency = 0.2
        n = await append(sc, "j.md", b"b\n", wait=False)
        e1 = n.last_put
        h = sc.fs.open(n.ino, os.O_WRONLY | os.O_APPEND)
        sc.fs.write(h, 0, b"c\n")  # written while the merge is in flight
        with trio.fail_after(20):
            await e1.done.wait()
        assert e1.merged is not None
        fake.faults.outage = True  # the second write is accepted, never committed here
        await sc.fs.flush(h)
        sc.fs.release(h.fh)
        assert sc.committer.depth() == 1 and n.state == "pending"
        nursery.cancel_scope.cancel()
    sc.journal.close()  # what was queued is written, as at a crash after the journal batch
    await sc.client.aclose()
    fake.faults.reset()

    sc2 = await make_sidecar(tmp_path, fake, token)
    assert len(sc2.leftovers) == 1 and len(sc2.committer.resolver.merged) == 1
    async with trio.open_nursery() as nursery:
        sc2._nursery = nursery
        sc2._spawn("journal", sc2.journal.run)
        await nursery.start(sc2.committer.run)
        sc2.committer.replay(sc2.leftovers)
        with trio.fail_after(30):
            await sc2.committer.wait_idle()
        sc2.committer.replayed()  # as Sidecar.run does before loading the stores
        assert (await remote(fake))["j.md"] == b"a\n" + RACE_MARKER.encode() + b"b\nc\n"
        assert sc2.committer.conflicts == 0 and sc2.committer.resolver.merged == {}
        await sc2.journal.flush_pending()
        assert sc2.journal.load_merges() == {}
        nursery.cancel_scope.cancel()
    sc2.journal.close()
    await sc2.client.aclose()


async def _until(cond, timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not cond():
            await trio.sleep(0.01)


@pytest.mark.parametrize("fault", ["refused", "answer_lost", "in_flight"])
async def test_a_withdrawn_write_is_never_sent_and_one_that_may_have_landed_is_not_withdrawn(
        tmp_path, fault):
    """``Committer.withdraw`` (a close giving up on a write the cache disk refused,
    docs/SEMANTICS.md "The sidecar's own disk"): an entry whose requests were all refused a
    connection is taken back, even out of a batch waiting to be sent again, and never sent
    (the other entries of the batch commit once); an entry a request may have carried (its
    answer lost, or in flight) is not: it commits, once, under its idempotency key."""
    fake = FakeControlPlane(seed=3)
    token = await fake.setup("ws")
    async with ApiClient(fake.base_url, token, transport=fake.transport) as api:
        j = Journal(tmp_path / "outbox.db")
        c = Committer(api, j, {})
        async with trio.open_nursery() as nursery:
            nursery.start_soon(j.run)
            await nursery.start(c.run)
            if fault == "refused":
                fake.faults.outage = True
            elif fault == "answer_lost":
                fake.faults.drop_rate = 1.0
            else:
                fake.faults.latency = 1.0
            # queued together: one batch of three creates
            es = [c.submit("default", PUT, f"n:{i}", {"path": f"f{i}.md"}, f"v{i}\n".encode())
                  for i in range(3)]
            if fault == "in_flight":
                await _until(lambda: es[1].in_flight)
            else:
                await _until(lambda: c.failed_attempts >= 1)
            taken = c.withdraw(es[1], errno.ENOSPC, "the sidecar's cache disk is full", "cache_disk_full")
            assert taken == (fault == "refused"), (fault, es[1].sent, es[1].in_flight)
            fake.faults.reset()
            c.poke()
            with trio.fail_after(30):
                await c.wait_idle()
            nursery.cancel_scope.cancel()
        recs, _ = await api.snapshot("default", content=True)
    got = sorted((r.path, r.content) for r in recs)
    if fault == "refused":
        assert got == [("f0.md", "v0\n"), ("f2.md", "v2\n")]
        assert es[1].withdrawn and es[1].errno == errno.ENOSPC and es[1].done.is_set()
    else:  # each once: one version per record
        assert got == [(f"f{i}.md", f"v{i}\n") for i in range(3)]
        assert all(r.version == 1 for r in recs) and not es[1].withdrawn and es[1].errno == 0
    j.close()


async def test_a_request_that_never_gets_sent_while_others_are_answered_is_refused_not_an_outage(tmp_path):
    """Attack 12, A2: one write whose request breaks in the send every time (here: a proxy
    that resets any upload past 20 kB, without an answer) while the control plane answers
    everything else. It is not an outage: after ``SEND_FAILURES_MAX`` broken sends it is
    refused for good (EIO ``send_failed``: ``state=rejected``, the content kept in the file,
    an errors.log line), the store's later writes commit, and ``status.json`` says the
    control plane is reachable. Before: retried for ever, every later write of the store
    pending behind it, the mount reporting the control plane unreachable."""
    from memfuse.sidecar.committer import SEND_FAILURES_MAX

    fake = FakeControlPlane(seed=12)
    token = await fake.setup("ws")
    sc = await make_sidecar(tmp_path, fake, token, commit_wait=2)
    big = b"big line\n" * 4000
    async with trio.open_nursery() as nursery:
        await start(sc, nursery)
        fake.faults.broken_send_over = 20_000
        stop = trio.Event()

        async def other_requests() -> None:  # the control plane answers everything else
            while not stop.is_set():
                await sc.client.get_store("default")
                await trio.sleep(0.05)

        nursery.start_soon(other_requests)
        try:  # the close: accepted (the first broken send looked like an outage), or its verdict
            await write(sc, "big.md", big)  # within the commit wait (the broken sends come fast)
        except FsError as err:
            assert err.errno == errno.EIO, err
        await write(sc, "small.md", b"small\n", wait=False)
        await wait_until(lambda: sc.committer.depth() == 0, timeout=60)
        sm = sc.fs.stores["default"]
        node = sc.fs.lookup(sm.root.ino, b"big.md")
        assert node.state == "rejected"
        assert sc.fs._content(node) == big  # what the close accepted is kept
        (line,) = [e for e in sc.fs.errors if e.get("path", "").endswith("big.md")]
        assert line["errno"] == "EIO" and line.get("code") == "send_failed", line
        assert sc.fs.lookup(sm.root.ino, b"small.md").state == "clean"
        assert await remote(fake) == {"small.md": b"small\n"}
        assert sc.status()["control_plane"] == {"reachable": True}
        assert sc.committer.refused == 1 and sc.committer.retries >= SEND_FAILURES_MAX - 1
        stop.set()
        nursery.cancel_scope.cancel()
    sc.journal.close()
    await sc.client.aclose()
