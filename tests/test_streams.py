"""Streaming change feeds and event streams (``stream=true``, docs/API.md "Streams") on a real
HTTP server (hypercorn in the test's trio loop; ``httpx.ASGITransport`` cannot stream), over
SQLite or, run by ``tests/test_postgres.py``, PostgreSQL: pages in order, heartbeats, the
lifetime, mid-stream errors, the per-token limit, a client that leaves, shutdown, and the
fallback of the client to long-polls when the server does not stream. The sidecar on streams
is in ``tests/test_streams_sidecar.py``.
"""
from __future__ import annotations

import tempfile
import time
from contextlib import asynccontextmanager

import pytest
import trio

from memfuse.client import ApiClient
from memfuse.errors import Gone, NotFound, TransientError, Unauthorized
from memfuse.server.app import create_app
from memfuse.server.serve import serve
from pgutil import fresh_db_url

ADMIN = "stream-admin-token"
WS_TOKEN = "stream-ws-token"
TICK = 0.3  # heartbeat of the servers here


@asynccontextmanager
async def server(**kw):
    """A real hypercorn server on a fresh database; yields (app, base URL, admin client, ws
    client). Workspace ``ws`` has stores ``default`` and ``other`` attached."""
    kw.setdefault("stream_heartbeat", TICK)
    with tempfile.TemporaryDirectory() as tmp, fresh_db_url(f"sqlite:///{tmp}/cp.db") as url:
        app = create_app(url, static_tokens={ADMIN: None, WS_TOKEN: "ws"}, faces=False, **kw)
        try:
            async with trio.open_nursery() as nursery:
                base = await nursery.start(serve, app, "127.0.0.1:0")
                async with ApiClient(base, ADMIN) as admin, ApiClient(base, WS_TOKEN, instance="me") as ws:
                    await admin.create_workspace("ws", default_store=False)
                    for slug in ("default", "other"):
                        await admin.create_store(slug)
                        await admin.attach("ws", slug, access="read_write")
                    yield app, base, admin, ws
                nursery.cancel_scope.cancel()
        finally:
            app.state.service.db.dispose()


async def create(api: ApiClient, path: str, store: str = "default"):
    return await api.create_record(store, path, f"{path}\n")


async def until(pred, timeout: float = 20, what: str = "condition") -> None:
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(0.01)


async def test_pages_in_order_then_heartbeats_that_move_the_cursor():
    async with server() as (app, base, admin, ws):
        a = await create(admin, "a.md")
        b = await create(admin, "b.md")
        stream = ws.changes_stream("default", 0, content=True, skip_actor="ws:ws/me")
        pages = []
        with trio.fail_after(30):
            it = stream.__aiter__()
            first = await it.__anext__()
            assert stream.streaming is True
            assert [c.record.path for c in first.changes] == ["a.md", "b.md"] and first.seq == b.seq
            c = await create(admin, "c.md")
            d = await create(admin, "d.md")
            while not pages or pages[-1].seq < d.seq:
                p = await it.__anext__()
                if p.changes:
                    pages.append(p)
            got = [ch.record.path for p in pages for ch in p.changes]
            assert got == ["c.md", "d.md"]
            seqs = [ch.seq for p in pages for ch in p.changes]
            assert seqs == sorted(seqs) and seqs[-1] == d.seq == pages[-1].seq
            # a version of the skipped actor is not sent; a heartbeat carries its seq
            mine = await create(ws, "mine.md")
            t0 = time.monotonic()
            while True:
                p = await it.__anext__()
                assert not p.changes, "the skipped actor's own version was sent"
                if p.seq == mine.seq:
                    break
            assert time.monotonic() - t0 < TICK * 10
            # silence: heartbeats, the empty page at the cursor
            p = await it.__anext__()
            assert p.changes == [] and p.seq == mine.seq
        await stream.aclose()
        assert a.seq < b.seq < c.seq
        await until(lambda: app.state.streams.open == 0, what="the stream to close")


def test_heartbeat_lines_are_the_pages_pydantic_would_encode():
    from memfuse.models import ChangePage, EventPage

    assert ChangePage(changes=[], seq=42).model_dump_json() == '{"changes":[],"seq":42}'
    assert EventPage(events=[], seq=7).model_dump_json() == '{"events":[],"seq":7}'


async def test_a_catch_up_comes_page_by_page_in_order():
    async with server() as (app, base, admin, ws):
        made = [await create(admin, f"p{i}.md") for i in range(5)]
        stream = ws.changes_stream("default", 0, limit=2)
        pages = []
        with trio.fail_after(30):
            async for p in stream:
                pages.append(p)
                if p.seq == made[-1].seq:
                    break
        await stream.aclose()
        assert [[c.record.path for c in p.changes] for p in pages] == [
            ["p0.md", "p1.md"], ["p2.md", "p3.md"], ["p4.md"]]
        assert [p.seq for p in pages] == [made[1].seq, made[3].seq, made[4].seq]


async def test_stream_lines_and_long_polls_are_bounded_in_json_bytes():
    """A page carries at most defs.PAGE_CONTENT_BYTES of content counted as JSON (a control
    character is six bytes there): four versions of 700 KiB of U+0001 (2.8 MB stored, 16.8 MB
    of JSON) come one per stream line and one per long-poll, each whole, in order, once."""
    from memfuse.defs import PAGE_CONTENT_BYTES, json_text_bytes

    body = "\x01" * (700 * 1024)
    async with server() as (app, base, admin, ws):
        rec = await admin.create_record("default", "ctl.txt", "0" + body)
        for i in range(1, 4):
            rec = await admin.update_record("default", rec.id, f"{i}" + body)

        def check(pages) -> None:
            got = [c.record.content for p in pages for c in p.changes]
            assert got == [f"{i}" + body for i in range(4)]
            for p in pages:  # one version each: two would be 8.4 MiB of JSON
                assert len(p.changes) == 1 and json_text_bytes(p.changes[0].record.content) <= PAGE_CONTENT_BYTES

        stream = ws.changes_stream("default", 0, content=True)
        pages = []
        with trio.fail_after(60):
            async for p in stream:
                if p.changes:
                    pages.append(p)
                if p.seq == rec.seq:
                    break
        await stream.aclose()
        check(pages)
        pages, after = [], 0
        with trio.fail_after(60):
            while after < rec.seq:
                p = await ws.changes("default", after, wait=1, content=True)
                pages.append(p)
                after = p.seq
        check(pages)


async def test_event_stream_sends_attach_and_detach():
    async with server() as (app, base, admin, ws):
        start = (await ws.workspace_events("ws", 0)).seq
        stream = ws.events_stream("ws", start)
        kinds = []
        with trio.fail_after(30):
            it = stream.__aiter__()
            p = await it.__anext__()  # the first line comes at once
            assert p.events == [] and p.seq == start
            await admin.create_store("third")
            await admin.attach("ws", "third", access="read_only")
            await admin.detach("ws", "third")
            while len(kinds) < 2:
                p = await it.__anext__()
                kinds += [(e.kind, e.store) for e in p.events]
        await stream.aclose()
        assert kinds == [("attached", "third"), ("detached", "third")]


async def test_lifetime_ends_the_stream_and_shutdown_ends_it_cleanly():
    async with server(stream_lifetime=1.0) as (app, base, admin, ws):
        stream = ws.changes_stream("default", 0)
        t0 = time.monotonic()
        with trio.fail_after(20):
            n = 0
            async for _ in stream:
                n += 1
        assert stream.streaming is True and n >= 1
        assert 0.85 <= time.monotonic() - t0 < 1.1 + 2 * TICK + 5
    # shutdown: the server is stopped while a stream is open; it ends without an error
    with tempfile.TemporaryDirectory() as tmp, fresh_db_url(f"sqlite:///{tmp}/cp.db") as url:
        app = create_app(url, static_tokens={ADMIN: None}, faces=False, stream_heartbeat=60)
        try:
            async with trio.open_nursery() as nursery:
                base = await nursery.start(serve, app, "127.0.0.1:0")
                async with ApiClient(base, ADMIN) as admin:
                    await admin.create_store("default")
                    stream = admin.changes_stream("default", 0)
                    seen = []
                    with trio.fail_after(20):
                        async for page in stream:
                            seen.append(page)
                            nursery.cancel_scope.cancel()  # stop the server: graceful shutdown
                    assert len(seen) == 1 and stream.streaming is True
        finally:
            app.state.service.db.dispose()


async def test_detach_and_token_revocation_end_the_stream_with_an_error_line():
    async with server() as (app, base, admin, ws):
        stream = ws.changes_stream("other", 0)
        with trio.fail_after(30):
            it = stream.__aiter__()
            await it.__anext__()
            await admin.detach("ws", "other")
            with pytest.raises(NotFound) as ei:
                while True:
                    await it.__anext__()
        assert ei.value.code == "store_not_found" or ei.value.status == 404
        # a database token revoked while its stream is open: 401 on the stream, at once
        tok = await admin.create_token(workspace="ws", name="streamer")
        async with ApiClient(base, tok.token) as api:
            stream = api.changes_stream("default", 0)
            with trio.fail_after(30):
                it = stream.__aiter__()
                await it.__anext__()
                await admin.revoke_token(tok.id)
                with pytest.raises(Unauthorized):
                    while True:
                        await it.__anext__()
        await until(lambda: app.state.streams.open == 0)


async def test_refusals_known_at_the_start_are_problem_responses():
    async with server() as (app, base, admin, ws):
        with pytest.raises(Gone):
            async for _ in ws.changes_stream("default", 10**9):
                pass
        with pytest.raises(NotFound):
            async for _ in ws.changes_stream("nope", 0):
                pass
        async with ApiClient(base, "not-a-token") as bad:
            with pytest.raises(Unauthorized):
                async for _ in bad.changes_stream("default", 0):
                    pass
        assert app.state.streams.open == 0


async def test_streams_count_as_long_polls_per_token_and_a_leaving_client_frees_its_slot():
    async with server(max_long_polls_per_token=2) as (app, base, admin, ws):
        notifier = app.state.service.notifier
        s1, s2 = ws.changes_stream("default", 0), ws.events_stream("ws", 0)
        with trio.fail_after(30):
            await s1.__aiter__().__anext__()  # __aiter__ gives the stream's one iterator
            await s2.__aiter__().__anext__()
            with pytest.raises(TransientError) as ei:
                async for _ in ws.changes_stream("other", 0):
                    pass
            assert ei.value.status == 429 and ei.value.code == "too_many_long_polls"
            # the client leaves mid-stream: its waiter and its slot are freed
            await s1.aclose()
            await until(lambda: app.state.streams.open == 1 and notifier.waiting == 1)
            s3 = ws.changes_stream("other", 0)
            await s3.__aiter__().__anext__()
            await s2.aclose()
            await s3.aclose()
            await until(lambda: app.state.streams.open == 0 and notifier.waiting == 0)


async def test_shared_read_for_every_stream_at_one_cursor():
    async with server() as (app, base, admin, ws):
        await create(admin, "x.md")
        head = (await admin.changes("default", 0)).seq
        reads = app.state.feed_reads
        streams = [ws.changes_stream("default", head) for _ in range(5)]
        its = [s.__aiter__() for s in streams]
        with trio.fail_after(30):
            for it in its:
                await it.__anext__()
            before = reads.reads
            await create(admin, "y.md")
            for it in its:
                p = await it.__anext__()
                while not p.changes:
                    p = await it.__anext__()
                assert [c.record.path for c in p.changes] == ["y.md"]
        assert reads.reads - before == 1
        for s in streams:
            await s.aclose()


async def test_client_falls_back_when_the_server_does_not_stream():
    async with server(streams=False) as (app, base, admin, ws):
        await create(admin, "a.md")
        stream = ws.changes_stream("default", 0)
        pages = [p async for p in stream]
        assert stream.streaming is False
        assert [[c.record.path for c in p.changes] for p in pages] == [["a.md"]]
        ev = ws.events_stream("ws", 0)
        assert len([p async for p in ev]) == 1 and ev.streaming is False
        # the long-poll is unchanged
        with trio.fail_after(30):
            page = await ws.changes("default", pages[0].seq, wait=0.2)
        assert page.changes == [] and page.seq == pages[0].seq


async def test_a_client_that_never_reads_is_cut_off_and_frees_its_slot():
    """A stream whose client stops reading: once the connection's send buffers are full, the
    kernel closes it after the send timeout (``TCP_USER_TIMEOUT``), and its slot is freed."""
    async with server(send_timeout=1.0) as (app, base, admin, ws):
        host, port = base.removeprefix("http://").split(":")
        sock = await trio.open_tcp_stream(host, int(port))
        try:
            await sock.send_all(b"GET /v1/stores/default/changes?after=0&stream=true&content=true HTTP/1.1\r\n"
                                b"host: x\r\nauthorization: Bearer " + WS_TOKEN.encode() + b"\r\n\r\n")
            await until(lambda: app.state.streams.open == 1, what="the stream to open")
            big = "x" * 500_000 + "\n"
            with trio.fail_after(120):
                for i in range(40):  # 20 MB of pages, never read
                    await admin.create_record("default", f"big{i}.md", big)
                    if app.state.streams.open == 0:
                        break
                await until(lambda: app.state.streams.open == 0, timeout=60, what="the stream to be cut")
            assert app.state.service.notifier.waiting == 0
        finally:
            await sock.aclose()



async def test_a_long_polls_wait_tries_again_at_each_wake_up_until_answered():
    """``longpoll._woken_until``, the one wait of the change feed's and the events' long-polls:
    an attempt now and one after each commit that concerns it (the skipped actor's own wakes
    nothing), each with its waiter subscribed first; None at the deadline or when the service
    is closing; no waiter left behind."""
    from types import SimpleNamespace

    from memfuse.server import longpoll, wakeups

    notifier = wakeups.Notifier()
    svc = SimpleNamespace(notifier=notifier, closing=False)
    tries: list[int] = []

    async def attempt():
        tries.append(len(notifier._waiters))  # subscribed before the attempt
        return "page" if len(tries) == 3 else None

    async def commits():
        for actor in ("me", "other", "other"):
            await trio.sleep(0.05)
            notifier.committed([wakeups.Note("f", "s", 10 + len(tries), actor)])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(commits)
        got = await longpoll._woken_until(svc, wakeups.FEED, "s", "me", trio.current_time() + 60, attempt)
    assert got == "page" and tries == [1, 1, 1] and not notifier._waiters

    async def nothing():
        tries.append(len(notifier._waiters))

    tries.clear()  # the deadline: once more when the wait ends, then None
    assert await longpoll._woken_until(svc, wakeups.EVENTS, "ws", None, trio.current_time() + 0.1, nothing) is None
    assert tries == [1, 1] and not notifier._waiters
    tries.clear()
    svc.closing = True
    assert await longpoll._woken_until(svc, wakeups.EVENTS, "ws", None, trio.current_time() + 60, nothing) is None
    assert tries == [1] and not notifier._waiters


def test_no_events_after_a_cursor_between_the_known_bounds():
    """``Notifier.no_events_after``, the one rule by which an events long-poll or stream skips
    its read: only a cursor between the workspace's latest event (upper bound) and the latest
    event of all (lower bound), and only while the cache is trusted."""
    from memfuse.server import wakeups

    n = wakeups.Notifier()
    assert not n.no_events_after("ws", 0)  # nothing known: read
    n.learn_events("ws", 5, 7, n.stamp())
    assert n.no_events_after("ws", 5) and n.no_events_after("ws", 7)
    assert not n.no_events_after("ws", 4) and not n.no_events_after("ws", 8)
    n.trusted = False
    assert not n.no_events_after("ws", 6)
