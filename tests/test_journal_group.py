"""Group commit in the outbox journal (``memfuse.sidecar.journal.Journal``): concurrent closes
share one transaction (one fsync); a failed write fails every close of its group and loses
none; a crash inside a transaction leaves nothing half-written; the writes nobody waits for
(a finished entry's delete, a key map row) ride with the next batch or go within
``LAZY_DELAY``, and a crash before they are written replays a committed entry harmlessly
(answered by its idempotency key: one version, not two).

No FUSE here: the journal and the committer are driven directly, the control plane is the
in-process fake (``memfuse.fake``), a crash is a real process killed mid-transaction.
"""
from __future__ import annotations

import errno
import os
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import trio

from memfuse.client import ApiClient
from memfuse.errors import TransientError
from memfuse.fake import FakeControlPlane
from memfuse.sidecar.cachedir import CacheError
from memfuse.sidecar.committer import Committer
from memfuse.sidecar.journal import DELETE, PUT, Entry, Journal

REPO = Path(__file__).resolve().parent.parent


class CountingJournal(Journal):
    """A journal that records each transaction's statements (first word and entry id) and can
    hold its next transaction in the worker thread until ``release`` is set, or fail its next
    ``fail`` transactions with ``exc`` (as a failed fsync would: SQLite's "disk I/O error")."""

    def __init__(self, path: Path, *, hold: bool = False, fail: int = 0,
                 exc: Exception | None = None) -> None:
        super().__init__(path)
        self.batches: list[list[tuple[str, int | None]]] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        if not hold:
            self.release.set()
        self.fail, self.exc = fail, exc
        self.RETRY_MIN = self.RETRY_MAX = 0.01

    def _apply(self, batch, light=False):
        self.batches.append([(op[0].split()[0], op[2]) for op in batch])
        self.entered.set()
        assert self.release.wait(30)
        if self.fail > 0:
            self.fail -= 1
            raise self.exc
        super()._apply(batch, light)


class Offline:
    """No control plane: the committer is never run in the journal-only tests."""

    def __getattr__(self, name):
        raise AssertionError(f"no control plane in this test ({name})")


def rows(j: Journal) -> list[int]:
    return [r[0] for r in j._db.execute("SELECT id FROM entries ORDER BY id")]


async def test_concurrent_closes_share_one_transaction(tmp_path):
    """16 closes arrive while the journal writes the first one: all 15 go in the next
    transaction, and each close returns once its own entry is on disk."""
    j = CountingJournal(tmp_path / "outbox.db", hold=True)
    c = Committer(Offline(), j, {})
    accepted: list[int] = []

    async def close(i: int) -> None:
        e = c.submit("s", PUT, f"n:{i}", {"path": f"f{i}.md"}, f"content {i}\n".encode())
        await e.wait_accepted(30)
        assert e.durable.is_set()
        accepted.append(e.id)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(j.run)
            nursery.start_soon(close, 0)
            await trio.to_thread.run_sync(j.entered.wait, 30)  # the first close's transaction
            for i in range(1, 16):
                nursery.start_soon(close, i)
            while j.depth() < 16:  # the 15 queue behind it (the first counts until on disk)
                await trio.sleep(0.001)
            assert accepted == []  # nobody is accepted before their transaction commits
            j.release.set()
            while len(accepted) < 16:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    inserts = [[i for op, i in b if op == "INSERT"] for b in j.batches]
    assert inserts == [[1], list(range(2, 17))], inserts
    assert rows(j) == list(range(1, 17))
    j.close()


async def test_depth_counts_the_batch_being_written_until_it_is_on_disk(tmp_path):
    """``depth`` (``status.json``'s ``cache.journal_queued``) is 0 only once every accepted
    write is on disk: a batch taken out of the queue and still in its transaction (the fsync,
    slow on a loaded machine) counts, for a ``kill -9`` then loses it
    (test_killmove waited for 0 and killed a queued directory move before its row was
    written); a batch that fails to write counts again as queued."""
    j = CountingJournal(tmp_path / "outbox.db", hold=True, fail=1,
                        exc=sqlite3.OperationalError("disk I/O error"))
    c = Committer(Offline(), j, {})
    e = c.submit("s", "move_prefix", None, {"from": "d", "to": "e"})
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(j.run)
            await trio.to_thread.run_sync(j.entered.wait, 30)  # its transaction has begun
            assert rows(j) == [] and not e.durable.is_set()
            assert j.depth() == 1  # not on disk: still counted
            j.release.set()  # that transaction fails: the write is queued again ...
            while j.failures < 1:  # (run's failure path and backoff yield to this task)
                await trio.sleep(0)
            assert rows(j) == [] and j.depth() == 1  # ... and counted, before its retry
            await e.durable.wait()
            assert rows(j) == [e.id] and j.depth() == 0
            nursery.cancel_scope.cancel()
    j.close()


async def test_a_failed_write_fails_every_close_of_its_group_and_loses_none(tmp_path):
    """The transaction of 8 concurrent closes fails (an I/O error at commit): every one of the
    8 closes fails with EIO, none returns success; the batch stays queued in order, is
    retried, and then every entry is on disk."""
    j = CountingJournal(tmp_path / "outbox.db", fail=1, exc=sqlite3.OperationalError("disk I/O error"))
    c = Committer(Offline(), j, {})
    entries = [c.submit("s", PUT, f"n:{i}", {"path": f"f{i}.md"}, b"x\n") for i in range(8)]
    outcomes: dict[int, object] = {}

    async def close(e: Entry) -> None:
        try:
            await e.wait_accepted(30)
            outcomes[e.id] = "ok"
        except CacheError as err:
            outcomes[e.id] = err.errno

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for e in entries:
                nursery.start_soon(close, e)
            await trio.sleep(0.01)  # every close waits before the journal runs
            nursery.start_soon(j.run)
            while len(outcomes) < 8:
                await trio.sleep(0.01)
            assert outcomes == {e.id: errno.EIO for e in entries}
            for e in entries:  # the retry writes them all, in order
                await e.durable.wait()
            nursery.cancel_scope.cancel()
    assert [[i for _, i in b] for b in j.batches[:2]] == [list(range(1, 9))] * 2
    assert rows(j) == list(range(1, 9)) and j.failures == 1 and j.error is None
    j.close()


CRASH_SCRIPT = r"""
import os, sys, trio
from pathlib import Path
from memfuse.sidecar.journal import PUT, Entry, Journal

class Dying(Journal):
    def _apply(self, batch, light=False):
        self._db.execute("BEGIN IMMEDIATE")
        for sql, params, *_ in batch:
            self._db.execute(sql, params)
        print("inside", flush=True)
        os._exit(9)  # killed between the writes and the commit (its fsync)

j = Dying(Path(sys.argv[1]))
es = [Entry(id=i, store="s", op=PUT, node_key=f"n:{i}", args={"path": f"f{i}.md"}, content=b"x")
      for i in range(1, 5)]
for e in es:
    j.add(e)

async def main():
    await j.flush_pending()
    print("returned", flush=True)  # never: the close would have been told it is on disk

trio.run(main)
"""


def test_a_crash_inside_the_transaction_leaves_no_entry_and_no_witness_line(tmp_path):
    """A process killed after its journal transaction wrote its rows but before the commit:
    the rows are gone at the next start and the witness names none of them (its lines are
    written after the commit), so no close was told "accepted" for them and nothing is
    reported lost; the journal works on."""
    db = tmp_path / "outbox.db"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-c", CRASH_SCRIPT, str(db)], capture_output=True,
                       text=True, timeout=60, env=env)
    assert p.returncode == 9, p.stderr
    assert p.stdout.split() == ["inside"]
    j = Journal(db)
    entries, keys = j.load()
    assert entries == [] and keys == {}
    back, _, gone = j.recover(lambda sha: None)
    assert back == [] and gone == []
    assert (tmp_path / "accepted.log").read_bytes() == b""
    j.close()


async def test_lazy_writes_ride_with_the_next_close_or_go_within_the_delay(tmp_path):
    """A finished entry's delete and its key map row start no transaction: the next close's
    transaction carries them; with no next close they are written within ``LAZY_DELAY``."""
    j = CountingJournal(tmp_path / "outbox.db")
    j.LAZY_DELAY = 2.0  # long enough that a loaded machine's stall does not write them early
    c = Committer(Offline(), j, {})
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(j.run)
            e1 = c.submit("s", PUT, "n:1", {"path": "a.md"}, b"a\n")
            await e1.wait_accepted(10)
            j.set_key("n:1", "rid-1", "sha-1")  # what the commit of e1 learns
            j.remove(e1)
            await trio.sleep(0.05)
            assert len(j.batches) == 1  # nothing written for them alone yet
            e2 = c.submit("s", PUT, "n:2", {"path": "b.md"}, b"b\n")
            await e2.wait_accepted(10)
            assert j.batches[1] == [("INSERT", None), ("DELETE", None), ("INSERT", 2)]
            assert rows(j) == [2]
            j.remove(e2)
            t0 = trio.current_time()
            while rows(j) != []:  # no close comes: written after the delay
                await trio.sleep(0.01)
            assert trio.current_time() - t0 < j.LAZY_DELAY + 5
            assert len(j.batches) == 3
            nursery.cancel_scope.cancel()
    assert dict(j.load()[1]) == {"n:1": ("rid-1", "sha-1")}
    j.close()


async def test_a_crash_before_the_lazy_delete_replays_the_committed_entry_once(tmp_path):
    """The entry committed, its delete and key map row were still queued when the process
    died: the next start finds the entry again and replays it; the control plane answers it
    by its idempotency key, so the record has one version, not two, and the key map learns
    the record."""
    fake = FakeControlPlane(seed=5)
    token = await fake.setup("ws")
    db = tmp_path / "outbox.db"
    async with ApiClient(fake.base_url, token, transport=fake.transport) as api:
        j = Journal(db)
        c = Committer(api, j, {})
        async with trio.open_nursery() as nursery:
            nursery.start_soon(j.run)
            await nursery.start(c.run)
            e = c.submit("default", PUT, "n:a", {"path": "a.md"}, b"hello\n")
            with trio.fail_after(30):
                await e.wait_accepted(10)
                await e.done.wait()
            assert e.errno == 0
            # killed now: the delete and the key map row are queued, not written
            assert j.depth() >= 2
            nursery.cancel_scope.cancel()
        j._db.close()  # no Journal.close(): it would write what is queued
        j.witness.close()

        j2 = Journal(db)
        entries, keys = j2.load()
        assert [x.key for x in entries] == [e.key] and "n:a" not in keys
        c2 = Committer(api, j2, keys)
        c2.replay(entries)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(j2.run)
            await nursery.start(c2.run)
            with trio.fail_after(30):
                await c2.wait_idle()
            nursery.cancel_scope.cancel()
        assert entries[0].errno == 0
        recs, _ = await api.snapshot("default", content=True)
        assert [(r.path, r.content) for r in recs] == [("a.md", "hello\n")]
        assert len(await api.versions("default", recs[0].id)) == 1
        assert c2.ids.get("n:a", "default")[0] == recs[0].id
        j2.close()
    assert Journal(db).load()[0] == []


@pytest.mark.parametrize("hold", [False, True])
@pytest.mark.parametrize("n", [1, 4])
async def test_one_transaction_per_close_in_a_steady_stream(tmp_path, n, hold):
    """``n`` writers each close files one after another (each close waits for its commit),
    committed by the committer against the fake: the journal writes at most one transaction
    per close (the deletes and key map rows ride along), not two. With ``hold`` (the
    committer holds inserts, ``Journal.HOLD``) the commits come first: no entry is written,
    the key map rows go in a few lazy transactions (never spinning on a held insert that
    blocks them), and every file's row is in the key map at the end."""
    fake = FakeControlPlane(seed=7)
    token = await fake.setup("ws")
    fake.faults.latency = 0.01  # a commit takes longer than the journal's write, as over HTTP
    async with ApiClient(fake.base_url, token, transport=fake.transport) as api:
        j = CountingJournal(tmp_path / "outbox.db")
        j.LAZY_DELAY = 0.05 if hold else 5.0  # (without hold: a stall between two closes writes nothing alone)
        c = Committer(api, j, {})
        c.hold_journal = hold
        j.HOLD = 5.0  # longer than any commit of a loaded machine: every commit comes first
        per = 20

        async def writer(w: int) -> None:
            for i in range(per):
                e = c.submit("default", PUT, f"n:{w}:{i}", {"path": f"w{w}/f{i}.md"}, b"x\n", hold=True)
                await e.wait_accepted(10)
                await e.done.wait()  # close waits for the commit
                assert e.errno == 0
                await trio.sleep(0.005)  # the writer's next create and write, through FUSE

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(j.run)
                await nursery.start(c.run)
                async with trio.open_nursery() as writers:
                    for w in range(n):
                        writers.start_soon(writer, w)
                while rows(j) or (hold and j.depth()):  # the last deletes (key map rows), after LAZY_DELAY
                    await trio.sleep(0.01)
                nursery.cancel_scope.cancel()
        closes = n * per
        # one transaction per close and one for the last deletes (before: a close's insert,
        # then a transaction of its delete and key map row: two per close); 4 writers in
        # step share theirs (group commit), out of step at most one each
        bound = per + 3 if n == 1 else closes + 3
        assert len(j.batches) <= bound, (len(j.batches), closes)
        assert rows(j) == []
        if hold:
            assert j.held_skipped == closes
            assert all(i is None for b in j.batches for _, i in b)
            assert len(j.load()[1]) == closes
        j.close()


async def test_a_held_insert_acknowledged_first_is_never_written(tmp_path):
    """``Committer.hold_journal`` (a close that waits for the commit): the control plane
    acknowledges each entry within ``Journal.HOLD``, so the journal never writes the entry
    (its close returns on the acknowledgement; the row would be moot): no entry insert, no
    delete, only the key map rows, in one lazy transaction, not one per close."""
    fake = FakeControlPlane(seed=11)
    token = await fake.setup("ws")
    fake.faults.latency = 0.01
    async with ApiClient(fake.base_url, token, transport=fake.transport) as api:
        j = CountingJournal(tmp_path / "outbox.db")
        j.HOLD = 10.0  # longer than any commit of a loaded machine
        # the key map rows wait 5 s for company (not 0.25 s): at load 15-20 the 20 closes
        # outlasted LAZY_DELAY and their rows went in 4 lazy transactions (km17)
        j.LAZY_DELAY = 5.0
        c = Committer(api, j, {})
        c.hold_journal = True
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(j.run)
                await nursery.start(c.run)
                for i in range(20):
                    e = c.submit("default", PUT, f"n:{i}", {"path": f"f{i}.md"}, b"x\n", hold=True)
                    await e.wait_accepted(30)  # as flush: returns on the acknowledgement
                    assert e.done.is_set() and not e.durable.is_set() and e.errno == 0
                while j.depth():  # the key map rows, after LAZY_DELAY
                    await trio.sleep(0.01)
                nursery.cancel_scope.cancel()
        assert j.held_skipped == 20
        assert all(i is None for b in j.batches for _, i in b), j.batches  # no entry row
        assert len(j.batches) <= 3 and rows(j) == []
        assert len(j.load()[1]) == 20  # the key map has every record
        recs, _ = await api.snapshot("default")
        assert len(recs) == 20
        j.close()


async def test_held_inserts_do_not_wake_the_journal_once_per_close(tmp_path):
    """One writer whose closes are acknowledged within ``HOLD`` (each close adds a held
    insert): the journal's loop, asleep until the first insert or lazy write is due, is not
    woken by a later one due no earlier (``Journal._wake_by``): a few wake-ups for 30 closes
    (the first insert, the lazy key map rows), not one or more per close."""
    fake = FakeControlPlane(seed=13)
    token = await fake.setup("ws")
    fake.faults.latency = 0.01
    async with ApiClient(fake.base_url, token, transport=fake.transport) as api:
        j = CountingJournal(tmp_path / "outbox.db")
        j.HOLD, j.LAZY_DELAY = 10.0, 5.0  # nothing falls due while the closes run
        c = Committer(api, j, {})
        c.hold_journal = True
        closes = 30
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(j.run)
                await nursery.start(c.run)
                for i in range(closes):
                    e = c.submit("default", PUT, f"n:{i}", {"path": f"f{i}.md"}, b"x\n", hold=True)
                    await e.wait_accepted(30)
                    await e.done.wait()
                    assert e.errno == 0 and not e.durable.is_set()
                woken = j.wakeups
                j.hurry() if j._held else j._wake()  # the key map rows: written now
                while j.depth():
                    await trio.sleep(0.01)
                nursery.cancel_scope.cancel()
        assert j.held_skipped == closes
        assert woken <= 3, woken  # before: one per close (31 for 30)
        assert len(j.load()[1]) == closes
        j.close()


async def test_a_held_insert_is_written_when_due_or_when_the_control_plane_fails(tmp_path):
    """No acknowledgement within ``HOLD``: the insert is written then, and the waiting
    close returns once it is on disk (accepted), as without the hold. The committer learning
    that the control plane is unreachable writes held inserts at once (``Journal.hurry``),
    and entries submitted while it is unreachable are not held."""
    j = CountingJournal(tmp_path / "outbox.db")
    j.HOLD = 0.3
    c = Committer(Offline(), j, {})
    c.hold_journal = True
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(j.run)
            t0 = trio.current_time()
            e1 = c.submit("s", PUT, "n:1", {"path": "a.md"}, b"a\n", hold=True)
            await trio.sleep(0.1)
            assert not e1.durable.is_set() and j.batches == []
            await e1.wait_accepted(30)
            assert e1.durable.is_set() and trio.current_time() - t0 >= j.HOLD - 0.01
            assert rows(j) == [1]
            j.HOLD = 30.0
            e2 = c.submit("s", PUT, "n:2", {"path": "b.md"}, b"b\n", hold=True)
            await trio.sleep(0.05)
            assert not e2.durable.is_set()
            c._attempt_failed(TransientError("down", code="connect_error"))  # hurries the journal
            with trio.fail_after(10):
                await e2.wait_accepted(30)
            e3 = c.submit("s", PUT, "n:3", {"path": "c.md"}, b"c\n", hold=True)  # failing: not held
            with trio.fail_after(10):
                await e3.wait_accepted(30)
            assert rows(j) == [1, 2, 3]
            nursery.cancel_scope.cancel()
    j.close()


async def test_a_held_insert_behind_a_lazy_write_is_written_when_due(tmp_path):
    """A lazy write due before a held insert (a finished entry's delete, then a close that
    waits for its commit): the batch written for the lazy write stops at the held insert, and
    the held insert is still written once it is due, with no other close to wake the journal
    (the reference model found a close waiting forever: ``wait_accepted`` timed out)."""
    j = CountingJournal(tmp_path / "outbox.db")
    j.LAZY_DELAY, j.HOLD = 0.1, 0.6
    c = Committer(Offline(), j, {})
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(j.run)
            e1 = c.submit("s", PUT, "n:1", {"path": "a.md"}, b"a\n", hold=True)
            await e1.wait_accepted(10)
            j.remove(e1)  # lazy: due LAZY_DELAY from now
            c.hold_journal = True
            e2 = c.submit("s", PUT, "n:2", {"path": "b.md"}, b"b\n", hold=True)  # held: due HOLD from now
            t0 = trio.current_time()
            while len(j.batches) < 2:  # the lazy delete goes alone, cut before the held insert
                await trio.sleep(0.01)
            assert j.batches[1] == [("DELETE", None)] and not e2.durable.is_set()
            await e2.wait_accepted(20)  # without a look at its due time again: never
            assert trio.current_time() - t0 >= j.HOLD - 0.2
            assert rows(j) == [2]
            nursery.cancel_scope.cancel()
    j.close()


async def test_a_change_no_call_waits_for_is_never_held_and_committed_without_an_fsync(tmp_path):
    """ns27: an unlink's entry (``Committer.submit`` without ``hold``) is written at once
    even while closes' inserts are held (``hold_journal``, ``HOLD`` 30 s here: a held one
    would not be on disk within the wait), in a light batch (``synchronous=NORMAL``: a
    kill -9 keeps it, its fsync comes later); a barrier that needs more (a directory's
    fsync) with nothing left to write fsyncs the log; a close's put is still held. On main
    the unlink's entry was held like a close's."""
    j = Journal(tmp_path / "outbox.db")
    j.HOLD = 30.0
    c = Committer(object(), j, {})  # type: ignore[arg-type]  (no committer task runs)
    c.hold_journal = True
    calls: list[tuple] = []
    real_apply, real_sync = j._apply, j._sync_log

    def apply(batch, light=False):
        calls.append(("apply", light))
        real_apply(batch, light)

    def sync():
        calls.append(("sync",))
        real_sync()

    j._apply, j._sync_log = apply, sync  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(j.run)
        e = c.submit("s", DELETE, "n:1", {"path": "a.md"})
        with trio.fail_after(10):
            await e.wait_accepted(10)
        assert e.durable.is_set() and e.light and calls == [("apply", True)]
        b = j.barrier()
        with trio.fail_after(10):
            await b.wait_accepted(10)
        assert calls == [("apply", True), ("sync",)]
        p = c.submit("s", PUT, "n:2", {"path": "b.md"}, b"x\n", hold=True)
        await trio.sleep(0.3)
        assert not p.durable.is_set() and not p.light  # held: a close waits for its commit
        nursery.cancel_scope.cancel()
    j._db.close()  # killed: no Journal.close(), which would write what is queued
    j.witness.close()
    j2 = Journal(tmp_path / "outbox.db")
    assert [x.key for x in j2.load()[0]] == [e.key]  # the unlink, not the held put
    j2.close()
