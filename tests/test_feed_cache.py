"""The change feed's kept reads (``memfuse.server.longpoll.FeedReads``; attack21 F1): every
finished read a long-poll or stream made is kept only while its store's head is the one it
read up to, and all of them together within a byte bound (``SHARED_READS_BYTES``), so a
token that may read a store cannot grow the server by asking many (cursor, limit, content)
keys, nor a sidecar following a store by leaving old cursors behind.

- in process: the byte count stays within the bound whatever the keys, and covers what the
  kept reads hold (tracemalloc); a head that moves drops the reads at the old one, at once
  (no read needed), and a read that finished after its head moved is not kept; a reset of
  the ``Notifier`` drops everything; waiters at one key still share one read when nothing
  can be kept;
- a real ``memfuse serve``: 1,000 notes of ~2 KB, then long-polls with content at distinct
  limits (the outside tester's repro, bench/README.md "Hostile clients"): serve's RSS grows by
  less than the bound and some slack (on 7f460c7 it grew ~6.7 MB a request).
"""
from __future__ import annotations

import gc
import time
import tracemalloc

import anyio
import httpx
import pytest
import trio

from memfuse.models import BatchOperation, RecordCreate, StoreCreate
from memfuse.server.db import Database
from memfuse.server.longpoll import SHARED_READS_BYTES, FeedReads
from memfuse.server.service import Service
from mountutil import stop
from pgutil import fresh_db_url
from test_hostile import LIMITS, MIB, _auth, admin_client, start

pytestmark = pytest.mark.timeout(180)

NOTE = "lorem ipsum dolor sit amet " * 75  # ~2 KB, as in the repro


def _note(i: int) -> dict:
    return {"path": f"notes/n{i}.md", "content": f"note {i}: {NOTE}\n"}


@pytest.fixture
def svc():
    s = Service(Database("sqlite://"), {"adm": None})
    p = s.authenticate("adm")
    s.create_store(p, StoreCreate(slug="s"))
    for b in range(3):
        s.batch(p, "s", [BatchOperation(op="create", body=_note(b * 100 + i)) for i in range(100)])
    yield s
    s.db.dispose()


def _key(svc: Service) -> str:
    return svc.check_feed_access(svc.authenticate("adm"), "s")


async def _read(reads: FeedReads, key: str, after: int, limit: int, content: bool = True):
    fr = await reads.read(key, after, limit, content)
    fr.page(None)  # what a long-poll answers: the shared page, encoded once
    return fr


async def test_kept_reads_stay_within_their_byte_bound_least_recently_used_first(svc):
    key = _key(svc)
    bound = 4 * MIB
    reads = FeedReads(svc, max_bytes=bound)
    for limit in range(300, 240, -1):  # each ~2 MB with its JSON: a distinct key each
        await _read(reads, key, 0, limit)
        assert 0 < reads.bytes <= bound and reads.kept >= 1
    n = reads.reads
    assert n == 60
    await _read(reads, key, 0, 241)  # the latest read is kept: a waiter arriving late shares it
    assert reads.reads == n
    await _read(reads, key, 0, 300)  # the oldest went first
    assert reads.reads == n + 1
    # the default bound, against the repro's keys: distinct limits, with content
    reads = FeedReads(svc)
    for limit in range(300, 200, -1):
        await _read(reads, key, 0, limit)
        assert reads.bytes <= SHARED_READS_BYTES
    assert reads.bytes > SHARED_READS_BYTES // 2  # the bound, not the keys, stopped it
    assert reads.kept < 100


async def test_the_byte_count_covers_what_the_kept_reads_hold(svc):
    key = _key(svc)
    reads = FeedReads(svc, max_bytes=1 << 40)
    await _read(reads, key, 0, 300)  # imports and first-use caches, out of the measure
    reads = FeedReads(svc, max_bytes=1 << 40)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for limit in range(300, 280, -1):
            await _read(reads, key, 0, limit, content=limit % 2 == 0)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert reads.kept == 20
    print(f"held {held / MIB:.1f} MiB, counted {reads.bytes / MIB:.1f} MiB")
    assert held <= reads.bytes * 1.15


async def test_reads_at_a_head_that_moved_are_dropped_at_once(svc):
    key = _key(svc)
    p = svc.authenticate("adm")
    reads = FeedReads(svc)
    for limit in (100, 200, 300):
        await _read(reads, key, 0, limit)
        await _read(reads, key, 0, limit, content=False)
    assert reads.kept == 6 and reads.bytes > 0
    n = reads.reads
    await anyio.to_thread.run_sync(lambda: svc.create_record(p, "s", RecordCreate(**_note(1000))))
    assert reads.kept == 0 and reads.bytes == 0  # the commit moved the head: nothing read since
    fr = await _read(reads, key, 0, 1000)
    assert reads.reads == n + 1 and len(fr.changes) == 301 and reads.kept == 1
    # another store's commit leaves these alone
    svc.create_store(p, StoreCreate(slug="t"))
    svc.create_record(p, "t", RecordCreate(path="a.md", content="a\n"))
    assert reads.kept == 1
    # a read that finished after its head moved serves its own waiters and is not kept
    read = svc.feed_read

    def read_then_write(*a, **kw):
        fr = read(*a, **kw)
        svc.create_record(p, "s", RecordCreate(**_note(1001)))
        return fr

    svc.feed_read = read_then_write
    try:
        fr = await _read(reads, key, 5, 10)
    finally:
        svc.feed_read = read
    assert len(fr.changes) == 10 and reads.kept == 0 and reads.bytes == 0
    # a reset (the bus reconnected) forgets every head: and every kept read
    await _read(reads, key, 0, 10)
    assert reads.kept == 1
    svc.notifier.reset(trusted=True)
    assert reads.kept == 0 and reads.bytes == 0


async def test_waiters_at_one_key_share_one_read_even_when_nothing_can_be_kept(svc):
    key = _key(svc)
    reads = FeedReads(svc, max_bytes=1)  # every read is dropped as soon as it is counted
    got = []

    async def one():
        got.append(await reads.read(key, 0, 300, True))

    async with trio.open_nursery() as n:
        for _ in range(20):
            n.start_soon(one)
    assert len(got) == 20 and all(fr is got[0] for fr in got)
    assert reads.reads == 1 and reads.kept == 0 and reads.bytes == 0


# ---------------------------------------------------------------- a real serve


SLACK = 40 * MIB  # the process's own growth under the load (sockets, pages in flight, malloc)


async def test_long_polls_of_distinct_keys_do_not_grow_serve_past_the_bound(tmp_path):
    with fresh_db_url(f"sqlite:///{tmp_path / 'cp.db'}") as db:
        s = start(tmp_path, db, "serve", {**LIMITS, "max_body": 48 * MIB})
        try:
            async with admin_client(s.url) as a:
                assert (await a.post("/v1/workspaces", json={"name": "ws", "default_store": False})).status_code == 201
                assert (await a.post("/v1/stores", json={"slug": "shared"})).status_code == 201
                r = await a.put("/v1/workspaces/ws/attachments/shared", json={"access": "read_only"})
                assert r.status_code == 200, r.text
                reader = (await a.post("/v1/tokens", json={"workspace": "ws", "name": "reader"})).json()["token"]
                for b in range(10):  # the store's writer: 1,000 notes of ~2 KB
                    ops = [{"op": "create", "body": _note(b * 100 + i)} for i in range(100)]
                    r = await a.post("/v1/stores/shared/batch", json={"operations": ops})
                    assert r.status_code == 200, r.text
            async with httpx.AsyncClient(base_url=s.url, headers=_auth(reader), timeout=60) as c:
                path = "/v1/stores/shared/changes?after=0&wait=1&content=true&limit={}"
                for k in range(3):  # the first answers: the process's one-time growth
                    assert (await c.get(path.format(1000 - k))).status_code == 200
                base = s.rss()
                t0 = time.monotonic()
                k, peak = 3, base
                while k < 120 and time.monotonic() - t0 < 30:
                    r = await c.get(path.format(1000 - k))
                    assert r.status_code == 200 and len(r.json()["changes"]) == 1000 - k
                    peak = max(peak, s.rss())
                    k += 1
                    if peak - base >= SHARED_READS_BYTES + SLACK:
                        break  # failed: no need to grow it further
                await trio.sleep(1)
                after = s.rss()
            grown = max(peak, after) - base
            print(f"serve RSS {base / MIB:.0f} MiB, +{grown / MIB:.1f} MiB after {k} long-polls "
                  f"in {time.monotonic() - t0:.1f} s")
            assert k >= 40 or grown >= SHARED_READS_BYTES + SLACK
            assert grown < SHARED_READS_BYTES + SLACK
        finally:
            stop(s.proc)
