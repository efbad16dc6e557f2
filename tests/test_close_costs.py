"""What one close costs the sidecar beyond its work (issue 25 item 2; bench/README.md, "The
close path, session 17: sidecar"): the keys of a new file and of its outbox entry come from a
per-process prefix and a counter (no ``getrandom`` system call, no ``UUID`` object), and the
committer makes no trio event per commit (its worker parks in a parking lot; the events
``hold`` and ``wait_idle`` wait on are made by those waiters). The behaviour those events
served is checked here too: ``hold`` waits for the commit in flight, ``wait_idle`` for the
last entry, a parked worker wakes for a new entry.

No FUSE: the committer (and the filesystem core for the node key) is driven directly, with
a stand-in client whose answer the test releases.
"""
from __future__ import annotations

import os
import re
import sys
import time
import uuid
from datetime import datetime, timezone

import trio
import trio.testing

from memfuse.sidecar.blobcache import BlobCache
from memfuse.sidecar.committer import Committer
from memfuse.sidecar.core import Filesystem, Settings
from memfuse.sidecar.journal import PUT, Journal, new_key
from memfuse.wire import Record, sha256_hex


class GatedClient:
    """``create_record`` answers once ``gate`` lets it (a fresh gate per request when
    ``gated``), else after one loop pass."""

    def __init__(self) -> None:
        self.n = 0
        self.gated = False
        self.gate = trio.Event()
        self.started = trio.Event()

    async def create_record(self, store, path, content, type=None, idempotency_key=None, *,
                            mode=None, mtime_ns=None):
        self.started.set()
        if self.gated:
            await self.gate.wait()
        else:
            await trio.lowlevel.checkpoint()
        self.n += 1
        now = datetime.now(timezone.utc)
        data = content.encode()
        return Record(id=f"r{self.n}", store=store, path=path, type=type or "project", version=1,
                      sha256=sha256_hex(data), size=len(data), created_at=now, updated_at=now,
                      updated_by="test", seq=self.n, mode=mode if mode is not None else 0o644,
                      mtime_ns=mtime_ns)


def test_new_keys_are_unique_32_hex_and_drawn_again_in_a_forked_child():
    keys = [new_key() for _ in range(20_000)]
    assert len(set(keys)) == len(keys)
    assert all(re.fullmatch(r"[0-9a-f]{32}", k) for k in keys)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its keys must not repeat the parent's
        try:
            os.write(w, new_key().encode())
        finally:
            os._exit(0)
    os.close(w)
    child = os.read(r, 64).decode()
    os.close(r)
    os.waitpid(pid, 0)
    assert re.fullmatch(r"[0-9a-f]{32}", child)
    assert child[:16] != keys[0][:16]  # another prefix (2**-64 to collide)
    assert child not in keys and new_key() not in keys


async def test_a_new_file_and_its_entry_cost_no_uuid(tmp_path, monkeypatch):
    """Creating a file and committing it takes its node key and its idempotency key from
    ``new_key``: with ``uuid.uuid4`` failing, a create-write-close still works."""
    def no_uuid() -> uuid.UUID:
        raise AssertionError("uuid4 on the close path")

    monkeypatch.setattr(uuid, "uuid4", no_uuid)
    journal = Journal(tmp_path / "outbox.db")
    fs = Filesystem(BlobCache(tmp_path / "blobs.db"), GatedClient(), journal,
                    Settings(commit_wait=10), "ws")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(journal.run)
        await nursery.start(fs.committer.run)
        sm = fs.add_store("default", "read_write", [])
        h = fs.create(sm.root.ino, b"a.md", 0o644, os.O_WRONLY | os.O_CREAT, 0, 0)
        n = h.node
        fs.write(h, 0, b"# a\nhello\n")
        with trio.fail_after(10):
            await fs.flush(h)
        assert re.fullmatch(r"n:[0-9a-f]{32}", n.key)
        assert n.state == "clean" and n.record_id == "r1"
        nursery.cancel_scope.cancel()
    journal.close()


async def test_a_commit_makes_no_trio_event(tmp_path, monkeypatch):
    """The committer's bookkeeping per commit (the queue's wake-up, the commit in flight, the
    outbox going idle, the entry's finish) makes no ``trio.Event``: 60 commits one after
    another, each waited for as a close waits, make none from the committer or an entry's
    ``finish`` (main made 4 per commit)."""
    journal = Journal(tmp_path / "outbox.db")
    client = GatedClient()
    c = Committer(client, journal, {})
    made = 0
    real = trio.Event

    def counting() -> trio.Event:
        nonlocal made
        f, callers = sys._getframe(1), []
        while f is not None and len(callers) < 3:
            callers.append((f.f_code.co_filename, f.f_code.co_name))
            f = f.f_back
        if any(name.endswith("committer.py") or fn == "finish" for name, fn in callers):
            made += 1  # (the journal's own wake-ups, per batch, are not counted)
        return real()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(journal.run)
        await nursery.start(c.run)
        for i in range(5):  # the store's worker starts, the journal settles
            e = c.submit("s", PUT, f"n:{i}", {"path": f"w{i}.md"}, b"warm\n")
            with trio.fail_after(10):
                await e.wait_accepted(30)
        monkeypatch.setattr(trio, "Event", counting)
        for i in range(60):
            e = c.submit("s", PUT, f"n:x{i}", {"path": f"f{i}.md"}, f"content {i}\n".encode())
            with trio.fail_after(10):
                await e.wait_accepted(30)
            assert e.done.is_set() and not e.errno
        monkeypatch.setattr(trio, "Event", real)
        nursery.cancel_scope.cancel()
    journal.close()
    assert made == 0, f"{made} trio.Event made by 60 commits"


async def test_hold_waits_for_the_commit_in_flight_and_wait_idle_for_the_last(tmp_path):
    journal = Journal(tmp_path / "outbox.db")
    client = GatedClient()
    c = Committer(client, journal, {})
    log: list[str] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(journal.run)
        await nursery.start(c.run)
        client.gated = True
        e = c.submit("s", PUT, "n:1", {"path": "a.md"}, b"a\n")
        with trio.fail_after(10):
            await client.started.wait()  # in flight now

        async def hold() -> None:
            async with c.hold("s"):
                log.append(f"held done={e.done.is_set()}")

        async def idle() -> None:
            await c.wait_idle()
            log.append(f"idle depth={c.depth()}")

        nursery.start_soon(hold)
        nursery.start_soon(idle)
        await trio.testing.wait_all_tasks_blocked()
        assert log == []  # both wait for the commit in flight
        client.gate.set()
        with trio.fail_after(10):
            while len(log) < 2:
                await trio.sleep(0.01)
        assert sorted(log) == ["held done=True", "idle depth=0"]
        # the worker parked on an empty queue wakes for the next entry
        client.gated = False
        e2 = c.submit("s", PUT, "n:2", {"path": "b.md"}, b"b\n")
        with trio.fail_after(10):
            await e2.wait_accepted(30)
            await c.wait_idle()
        assert e2.done.is_set() and not e2.errno and c.depth() == 0
        nursery.cancel_scope.cancel()
    journal.close()


async def test_the_journal_survives_its_clock_passing_a_due_time_while_it_arranges_its_sleep(
        tmp_path, monkeypatch):
    """``Journal.run`` checks that the first held insert is not due yet, then arranges its
    sleep until then; on a loaded machine the clock can pass the due time in between
    (seen under valgrind at load 20: ``move_on_after`` raised ``ValueError`` for a negative
    delay and the journal task died). Here the first event it makes for that sleep takes
    longer than what was left: the journal still writes the insert when due."""
    journal = Journal(tmp_path / "outbox.db")
    journal.HOLD = 0.05
    c = Committer(GatedClient(), journal, {})  # never run: the insert is written when due
    c.hold_journal = True
    real, slept = trio.Event, []

    def slow_event() -> trio.Event:
        if not slept:
            slept.append(1)
            time.sleep(0.1)  # past the insert's due time (HOLD = 0.05 s)
        return real()

    e = c.submit("s", PUT, "n:1", {"path": "a.md"}, b"a\n", hold=True)  # a held insert
    async with trio.open_nursery() as nursery:
        monkeypatch.setattr(trio, "Event", slow_event)
        nursery.start_soon(journal.run)
        with trio.fail_after(10):
            await e.durable.wait()
        monkeypatch.setattr(trio, "Event", real)
        nursery.cancel_scope.cancel()
    journal.close()
    assert slept
