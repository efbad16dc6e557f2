"""A long-poll's or stream's own versions are passed over unread (``FeedReads.read`` with
``skip``, ``ChangesService.feed_own_run``; issue 25 item 1).

A sidecar's stream leaves its own versions out (``skip_writer``), but the shared read it made
at each wake-up read every version after its cursor with content: every append to a 1 MiB
journal made whole (``deltas.resolve``) and sized in JSON, then dropped. Now the versions that
lead the read are looked at by seq and writer first: a run of the reader's own versions is
passed over without content.

- in process: a store written by writer ``w1`` only: the read with ``skip="w1"`` reads no
  content (``Service.feed_read`` not called), and its page moves the cursor as the page of
  ``changes_page(skip_actor="w1")`` (the SQL filter, the reference) does; pages of a small
  ``limit`` over a mix of writers give the same changes and the same last cursor as the
  reference's pages, and no content read starts at a cursor followed by ``w1``'s version;
- through the app: a long-poll with ``skip_writer`` behind 20 versions of its own writer
  answers an empty page past them, and no shared read with content is made (counted by a
  wrapper of ``Service.feed_read``; before this change one was).

Runs on in-memory SQLite, and on PostgreSQL through ``tests/test_postgres.py``.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import trio

from memfuse.models import RecordAppend, RecordCreate, StoreCreate
from memfuse.server.db import Database
from memfuse.server.longpoll import FeedReads
from memfuse.server.service import Service
from pgutil import fresh_db_url

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def svc():
    with fresh_db_url() as url:
        s = Service(Database(url), {"adm": None})
        s.create_store(s.authenticate("adm"), StoreCreate(slug="s"))
        yield s
        s.bus.close()
        s.db.dispose()


def _as(svc: Service, writer: str):
    return dataclasses.replace(svc.authenticate("adm"), writer=writer)


def _write(svc: Service, writers: list[str]) -> None:
    """One create by each writer of ``writers``, in order (paths distinct)."""
    for i, w in enumerate(writers):
        svc.create_record(_as(svc, w), "s", RecordCreate(path=f"n/{w}-{i}.md", content=f"{w} {i}\n" * 50), None)


def _counting(svc: Service) -> list[tuple[int, bool]]:
    """Wrap ``svc.feed_read``: the (after, with_content) of every shared read it makes."""
    calls: list[tuple[int, bool]] = []
    real = svc.feed_read

    def feed_read(slug: str, after: int, **kw):
        calls.append((after, kw.get("with_content", True)))
        return real(slug, after, **kw)

    svc.feed_read = feed_read  # type: ignore[method-assign]
    return calls


async def _pages(reads: FeedReads, key: str, after: int, limit: int, skip: str) -> tuple[list[int], int]:
    """The seqs of the changes a long-poll skipping ``skip`` is given, page after page from
    ``after`` (as ``longpoll.changes`` loops), and its last cursor."""
    seqs: list[int] = []
    cursor = after
    for _ in range(1000):
        fr = await reads.read(key, cursor, limit, True, skip)
        page, _ = fr.page(skip)
        seqs += [c.seq for c in page.changes]
        assert all(c.record.content is not None for c in page.changes)
        if page.seq == cursor and not fr.full:
            break
        cursor = page.seq
        if not fr.full and not page.changes:
            break
    return seqs, cursor


def _reference(svc: Service, after: int, limit: int, skip: str) -> tuple[list[int], int]:
    """The same, from ``changes_page``'s SQL filter (``skip_actor``)."""
    p = svc.authenticate("adm")
    seqs: list[int] = []
    cursor = after
    while True:
        page = svc.changes_page(p, "s", cursor, limit=limit, skip_actor=skip)
        seqs += [c.seq for c in page.changes]
        if page.seq == cursor:
            return seqs, cursor
        cursor = page.seq


async def test_a_reader_s_own_versions_alone_are_passed_over_without_content(svc):
    _write(svc, ["w1"] * 30)
    key = svc.check_feed_access(svc.authenticate("adm"), "s")
    calls = _counting(svc)
    reads = FeedReads(svc)
    fr = await reads.read(key, 0, 1000, True, "w1")
    page, raw = fr.page("w1")
    ref = svc.changes_page(svc.authenticate("adm"), "s", 0, skip_actor="w1")
    assert page.changes == [] and raw is None
    assert page.seq == ref.seq > 0
    assert calls == []  # no shared read, with content or without
    # in pages of 7: each moves the cursor, none reads content
    seqs, cursor = await _pages(reads, key, 0, 7, "w1")
    assert seqs == [] and cursor == ref.seq and calls == []
    # another writer's reader reads them all, with content, as before
    fr = await reads.read(key, 0, 1000, True, "w2")
    assert [c.seq for c in fr.page("w2")[0].changes] == [c.seq for c in
                                                          svc.changes_page(svc.authenticate("adm"), "s", 0).changes]
    assert calls == [(0, True)]


@pytest.mark.parametrize("limit", [1, 2, 3, 5, 1000])
async def test_pages_over_mixed_writers_are_those_of_the_sql_filter(svc, limit):
    pattern = ["w1", "w1", "w2", "w1", "w2", "w2", "w1", "w1", "w1", "w3", "w1"]
    _write(svc, pattern * 3)
    key = svc.check_feed_access(svc.authenticate("adm"), "s")
    calls = _counting(svc)
    got = await _pages(FeedReads(svc), key, 0, limit, "w1")
    assert got == _reference(svc, 0, limit, "w1")
    # every content read starts where the next version is another writer's
    p = svc.authenticate("adm")
    whole = svc.changes_page(p, "s", 0).changes
    writer_after = {}
    prev = 0
    for c, w in zip(whole, pattern * 3):
        writer_after[prev] = w
        prev = c.seq
    content_reads = [a for a, content in calls if content]
    assert content_reads and all(writer_after.get(a) != "w1" for a in content_reads)


async def test_an_own_append_run_over_a_big_record_reads_no_content(svc):
    # the case measured: a sidecar appending to its journal (~0.7 MB, past the tail threshold), its stream woken later
    p1 = _as(svc, "w1")
    r = svc.create_record(p1, "s", RecordCreate(path="J.jsonl", content="x" * 1000 + "\n" * 700_000), None)
    rid, etag = json.loads(r.body)["id"], r.headers["ETag"]
    key = svc.check_feed_access(svc.authenticate("adm"), "s")
    after = svc.changes_page(svc.authenticate("adm"), "s", 0).seq
    for i in range(20):
        rr = svc.append_record(p1, "s", rid, RecordAppend(append=f"line {i}\n"), etag, None)
        etag = rr.headers["ETag"]
    calls = _counting(svc)
    reads = FeedReads(svc)
    seqs, cursor = await _pages(reads, key, after, 1000, "w1")
    assert seqs == [] and calls == []
    assert cursor == svc.changes_page(svc.authenticate("adm"), "s", after, skip_actor="w1").seq
    rr = svc.append_record(_as(svc, "w2"), "s", rid, RecordAppend(append="theirs\n"), etag, None)
    seqs, _ = await _pages(reads, key, cursor, 1000, "w1")
    assert len(seqs) == 1 and calls[0] == (cursor, True)  # (then one at the head: nothing)


async def test_a_long_poll_behind_its_own_versions_reads_no_content_through_the_app():
    # end to end (fails before this change: the long-poll's shared read read them with content)
    from memfuse.server.app import create_app

    with fresh_db_url() as url:
        await _through_the_app(create_app(url, static_tokens={"adm": None, "wst": "ws"}, faces=False))


async def _through_the_app(app) -> None:
    import httpx
    from memfuse.client import ApiClient

    try:
        t = httpx.ASGITransport(app=app)
        async with ApiClient("http://test", "adm", transport=t) as admin:
            await admin.create_workspace("ws", default_store=False)
            await admin.create_store("s")
            await admin.attach("ws", "s", access="read_write")
        async with ApiClient("http://test", "wst", transport=t, instance="pod") as one:
            one.set_writer("w1")
            start = (await one.changes("s", 0)).seq
            for i in range(20):
                await one.create_record("s", f"n{i}.md", f"mine {i}\n" * 100, idempotency_key=f"k{i}")
            svc = app.state.service
            key = svc.check_feed_access(svc.authenticate("adm"), "s")
            with trio.fail_after(10):  # PostgreSQL: the commits' notes come by the bus
                while svc.notifier.last_writer(key) != "w1":
                    await trio.sleep(0.05)
            calls = _counting(svc)
            page = await one.changes("s", start, wait=0.5, skip_actor="ws:ws/pod", skip_writer="w1")
            assert page.changes == [] and page.seq > start
            assert [c for c in calls if c[1]] == []
    finally:
        app.state.service.db.dispose()


async def test_readers_woken_by_another_writer_share_one_read(svc):
    # attack23 HIGH 1: every reader woken by one commit made a read of its own first (the
    # own-run), so N waiters made N + 1 reads; a reader whose store's latest commit was not
    # its own makes none (``Notifier.last_writer``). The bus is started as ``memfuse serve``
    # starts it: on PostgreSQL the Notifier trusts no head until its listener is connected
    # (``wakeups.Bus``), and a read is kept only while its head is the store's, so a Service
    # whose bus never started shares only the reads in flight at once (25 reads here, not 1)
    svc.bus.start()
    with trio.fail_after(10):
        while not svc.bus.connected:
            await trio.sleep(0.01)
    _write(svc, ["w1"] * 3 + ["w2"])
    key = svc.check_feed_access(svc.authenticate("adm"), "s")
    calls = _counting(svc)
    own: list[str] = []
    real = svc.feed_own_run

    def feed_own_run(slug, after, skip, **kw):
        own.append(skip)
        return real(slug, after, skip, **kw)

    svc.feed_own_run = feed_own_run  # type: ignore[method-assign]
    reads = FeedReads(svc)
    for skip in [f"r{i}" for i in range(20)] + ["w1"] * 5:
        fr = await reads.read(key, 0, 1000, True, skip)
        assert len(fr.page(skip)[0].changes) == (1 if skip == "w1" else 4)
    assert own == [] and calls == [(0, True)]
