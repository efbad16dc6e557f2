"""Functional tests of the control plane's cheap write path (no timings here; the benchmark
is ``bench/perfbench.py``): the change feed's ``skip_actor``, the store usage
counters kept by every write, their backfill in an older database, the token cache, and
which long-polls a record write wakes."""
from __future__ import annotations

import httpx
import pytest
import trio
from sqlalchemy import create_engine

from memfuse.client import ApiClient
from memfuse.models import RecordCreate, StoreCreate, StoreUpdate
from memfuse.server.app import create_app
from memfuse.server.changes import MAX_WAIT_SECONDS
from memfuse.server import fulltext
from memfuse.server.db import normalize_db_url
from memfuse.server.service import Principal, _usage
from pgutil import fresh_db_url
from planeutil import attach_ws
from test_api import WOKEN

ADMIN = "perf-admin-token"
WS_TOKEN = "perf-ws-token"
BASE = "http://test"
ME = "ws:ws/me"  # the actor of the ws client below (X-Memfuse-Instance: me)


def _client(app, token: str, **headers) -> httpx.AsyncClient:
    headers["Authorization"] = f"Bearer {token}"
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE, headers=headers)


@pytest.fixture
async def env():
    with fresh_db_url() as url:
        app = create_app(url, static_tokens={ADMIN: None, WS_TOKEN: "ws"})
        async with _client(app, ADMIN) as admin, _client(app, WS_TOKEN, **{"X-Memfuse-Instance": "me"}) as me, \
                _client(app, WS_TOKEN, **{"X-Memfuse-Instance": "peer"}) as peer:
            await attach_ws(admin, (("default", "read_write"), ("other", "read_write")))
            yield app, admin, me, peer
        app.state.service.db.dispose()


async def _create(client, path, content="x\n", store="default"):
    r = await client.post(f"/v1/stores/{store}/records", json={"path": path, "content": content})
    assert r.status_code == 201, r.text
    return r.json()


# ---------------------------------------------------------------- skip_actor


async def test_skip_actor_leaves_out_own_versions_and_advances_seq(env):
    app, admin, me, peer = env
    mine = await _create(me, "mine.md")
    theirs = await _create(peer, "theirs.md")
    mine2 = await _create(me, "mine2.md")

    full = (await me.get("/v1/stores/default/changes", params={"after": 0})).json()
    assert [c["record"]["path"] for c in full["changes"]] == ["mine.md", "theirs.md", "mine2.md"]

    r = await me.get("/v1/stores/default/changes", params={"after": 0, "skip_actor": ME})
    page = r.json()
    assert [c["record"]["path"] for c in page["changes"]] == ["theirs.md"]
    assert page["changes"][0]["record"]["updated_by"] == "ws:ws/peer"
    assert page["seq"] == mine2["seq"] == full["seq"]  # moved past the skipped tail

    # only own versions after the cursor: empty page, seq still advances
    r = await me.get("/v1/stores/default/changes", params={"after": theirs["seq"], "skip_actor": ME})
    assert r.json() == {"changes": [], "seq": mine2["seq"]}
    # nothing after: seq stays
    r = await me.get("/v1/stores/default/changes", params={"after": mine2["seq"], "skip_actor": ME})
    assert r.json() == {"changes": [], "seq": mine2["seq"]}
    # an actor nobody has, or an empty value: nothing skipped
    for skip in ("ws:ws/nobody", ""):
        r = await me.get("/v1/stores/default/changes", params={"after": 0, "skip_actor": skip})
        assert r.json() == full
    assert mine["seq"] < theirs["seq"]


async def test_skip_actor_with_limit_pages_through_everything(env):
    """A full page ends at its last change (more may follow); the pages together hold every
    foreign version once, in order, and end at the store's latest seq."""
    app, admin, me, peer = env
    expected = []
    for i in range(12):
        if i % 3 == 0:
            expected.append((await _create(peer, f"p{i}.md"))["seq"])
        else:
            await _create(me, f"m{i}.md")
    await _create(admin, "other-store.md", store="other")  # another store's seq in between
    last = (await _create(me, "last.md"))["seq"]
    got, after = [], 0
    for _ in range(10):
        page = (await me.get("/v1/stores/default/changes",
                             params={"after": after, "limit": 2, "skip_actor": ME})).json()
        got += [c["seq"] for c in page["changes"]]
        assert page["seq"] >= after
        if page["changes"]:
            assert len(page["changes"]) < 2 or page["seq"] == page["changes"][-1]["seq"]
        if page["seq"] == after:
            break
        after = page["seq"]
    assert got == expected
    assert after == last


async def test_skip_actor_long_poll_waits_through_own_writes(env):
    """While only the skipped actor writes, the long-poll does not answer; the first foreign
    version ends it, and that version alone is in the page."""
    app, admin, me, peer = env
    start = (await _create(peer, "start.md"))["seq"]
    result = {}

    async def poll():
        r = await me.get("/v1/stores/default/changes",
                         params={"after": start, "wait": MAX_WAIT_SECONDS, "skip_actor": ME},
                         timeout=MAX_WAIT_SECONDS + 10)
        result["page"], result["t"] = r.json(), trio.current_time()

    with trio.fail_after(MAX_WAIT_SECONDS + 30):
        async with trio.open_nursery() as n:
            n.start_soon(poll)
            await trio.sleep(0.2)
            for i in range(3):
                await _create(me, f"own{i}.md")
                await trio.sleep(0.25)  # beyond the 100 ms re-query: it must keep waiting
            assert "page" not in result
            t0 = trio.current_time()
            foreign = await _create(peer, "foreign.md")
    assert [c["record"]["path"] for c in result["page"]["changes"]] == ["foreign.md"]
    assert result["page"]["seq"] == foreign["seq"]
    assert result["t"] - t0 < WOKEN, result["t"] - t0


async def test_skip_actor_long_poll_times_out_with_advanced_seq(env):
    app, admin, me, peer = env
    start = (await _create(peer, "start.md"))["seq"]
    result = {}

    async def poll():
        r = await me.get("/v1/stores/default/changes",
                         # 3 s: the own write below must land inside the wait even when a
                         # busy machine makes it slow (1 s was a race under load)
                         params={"after": start, "wait": 3, "skip_actor": ME}, timeout=30)
        result["status"], result["page"] = r.status_code, r.json()

    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            n.start_soon(poll)
            await trio.sleep(0.2)
            own = await _create(me, "own.md")
    assert result["status"] == 200
    assert result["page"] == {"changes": [], "seq": own["seq"]}


async def test_client_changes_skip_actor(env):
    app, admin, me, peer = env
    await _create(me, "mine.md")
    theirs = await _create(peer, "theirs.md")
    async with ApiClient(BASE, WS_TOKEN, instance="me",
                         transport=httpx.ASGITransport(app=app)) as c:
        page = await c.changes("default", 0, skip_actor=ME)
        assert [ch.record.path for ch in page.changes] == ["theirs.md"] and page.seq == theirs["seq"]
        page = await c.changes("default", 0)
        assert [ch.record.path for ch in page.changes] == ["mine.md", "theirs.md"]


# ---------------------------------------------------------------- usage counters


def _recount(svc, slug):
    with svc.db.read_conn() as conn:
        return _usage(conn, [slug]).get(slug, (0, 0))


async def test_usage_counters_follow_every_write(env):
    app, admin, me, peer = env
    svc = app.state.service
    admin_p = Principal(workspace=None)

    def check():
        st = svc.get_store(admin_p, "default")
        assert (st.record_count, st.usage_bytes) == _recount(svc, "default")
        return st.record_count, st.usage_bytes

    a = await _create(me, "a.md", "aaaa\n")
    b = await _create(me, "b.md", "bb\n")
    assert check() == (2, 8)
    r = await me.put(f"/v1/stores/default/records/{a['id']}", json={"content": "a\n"})  # shrinks
    assert r.status_code == 200
    assert check() == (2, 5)
    r = await me.put(f"/v1/stores/default/records/{a['id']}", json={"content": "a longer one\n"})  # grows
    assert check() == (2, 16)
    r = await me.post(f"/v1/stores/default/records/{b['id']}/move", json={"path": "c.md"})
    assert r.status_code == 200 and check() == (2, 16)
    r = await me.post(f"/v1/stores/default/records/{b['id']}/move", json={"path": "a.md", "replace": True})
    assert r.status_code == 200 and check() == (1, 3)
    r = await me.delete(f"/v1/stores/default/records/{a['id']}")
    assert r.status_code == 204 and check() == (0, 0)
    r = await me.post(f"/v1/stores/default/records/{b['id']}/restore", json={"version": 1})
    assert r.status_code == 200, r.text
    assert check() == (1, 3)
    r = await me.post(f"/v1/stores/default/records/{a['id']}/restore", json={"version": 1})  # a.md is free
    assert r.status_code == 200 and check() == (2, 8)
    await _create(me, "c.md")
    r = await me.post(f"/v1/stores/default/records/{b['id']}/restore", json={"version": 2})  # c.md is taken
    assert r.status_code == 409 and check() == (3, 10)
    r = await admin.post("/v1/stores/default/move", json={"from_prefix": "x", "to_prefix": "y"})
    assert r.status_code == 200
    await _create(me, "dir/one.md", "1\n")
    r = await admin.post("/v1/stores/default/move", json={"from_prefix": "dir", "to_prefix": "dir2"})
    assert r.status_code == 200 and check() == (4, 12)
    # listing and attachments report the same counters
    stores = {s["slug"]: s for s in (await admin.get("/v1/stores")).json()}
    assert (stores["default"]["record_count"], stores["default"]["usage_bytes"]) == (4, 12)
    atts = {x["store"]["slug"]: x["store"] for x in (await me.get("/v1/workspaces/ws/attachments")).json()}
    assert (atts["default"]["record_count"], atts["default"]["usage_bytes"]) == (4, 12)
    assert (atts["other"]["record_count"], atts["other"]["usage_bytes"]) == (0, 0)


async def test_refused_write_leaves_counters_unchanged(env):
    app, admin, me, peer = env
    svc = app.state.service
    r = await admin.patch("/v1/stores/default", json={"max_records": 2, "max_store_bytes": 10})
    assert r.status_code == 200
    a = await _create(me, "a.md", "12345\n")
    r = await me.post("/v1/stores/default/records", json={"path": "big.md", "content": "123456\n"})
    assert r.status_code == 507 and r.json()["code"] == "store_full"
    r = await me.put(f"/v1/stores/default/records/{a['id']}", json={"content": "1234567890\n"})
    assert r.status_code == 507
    await _create(me, "b.md", "1\n")
    r = await me.post("/v1/stores/default/records", json={"path": "c.md", "content": ""})
    assert r.status_code == 507 and "records" in r.json()["detail"]
    r = await me.post("/v1/stores/default/records", json={"path": "s.md", "content": "k = AKIAQWERTYUIOPASDFGH\n"})
    assert r.status_code == 422
    st = svc.get_store(Principal(workspace=None), "default")
    assert (st.record_count, st.usage_bytes) == (2, 8) == _recount(svc, "default")
    # lowering a limit below the usage: shrinking is still allowed, growing is not
    svc.update_store(Principal(workspace=None), "default", StoreUpdate(max_store_bytes=4))
    r = await me.put(f"/v1/stores/default/records/{a['id']}", json={"content": "1\n"})
    assert r.status_code == 200
    r = await me.put(f"/v1/stores/default/records/{a['id']}", json={"content": "12\n"})
    assert r.status_code == 507
    st = svc.get_store(Principal(workspace=None), "default")
    assert (st.record_count, st.usage_bytes) == (2, 4) == _recount(svc, "default")


def test_older_database_gets_usage_columns_filled(tmp_path):
    """A database without the usage columns (made before them) gets them at start, filled
    from the live records (the 0002_store_usage revision; see also tests/test_migrations.py)."""
    with fresh_db_url(f"sqlite:///{tmp_path / 'old.db'}") as url:
        _older_database_gets_usage_columns_filled(url)


def _older_database_gets_usage_columns_filled(url):
    app = create_app(url)
    svc = app.state.service
    admin = Principal(workspace=None)
    svc.create_store(admin, StoreCreate(slug="s"))
    svc.create_store(admin, StoreCreate(slug="empty"))
    for i in range(5):
        svc.create_record(admin, "s", RecordCreate(path=f"r{i}.md", content="x" * (i + 1)))
    rid = svc.list_records(admin, "s").records[0].id
    svc.delete_record(admin, "s", rid)
    svc.db.dispose()
    old = create_engine(normalize_db_url(url))
    with old.begin() as con:  # as memfuse 0.1.0 left it before these columns: no migration history
        for col in ("overwrote", "overwrote_by", "writer"):  # nor 0019's overwrite columns, 0021's writer
            con.exec_driver_sql(f"ALTER TABLE versions DROP COLUMN {col}")
        con.exec_driver_sql("DROP TABLE record_tails")  # nor 0018's tails
        # with 0001's usage index (0022 drops it)
        con.exec_driver_sql("CREATE INDEX ix_records_usage ON records (store, deleted, size)")
        con.exec_driver_sql("DROP INDEX ux_workspaces_account_public_name")  # nor 0017's workspace names
        con.exec_driver_sql("ALTER TABLE workspaces DROP COLUMN public_name")
        con.exec_driver_sql("DROP INDEX ux_stores_account_public_slug")  # nor 0014's store names
        con.exec_driver_sql("ALTER TABLE stores DROP COLUMN public_slug")
        con.exec_driver_sql("ALTER TABLE stores DROP COLUMN usage_bytes")
        con.exec_driver_sql("ALTER TABLE stores DROP COLUMN record_count")
        con.exec_driver_sql("DROP INDEX ix_tokens_revoked_at")  # nor the token lifecycle ones
        for col in ("expires_at", "revoked_at", "last_used_at"):
            con.exec_driver_sql(f"ALTER TABLE tokens DROP COLUMN {col}")
        for table in ("records", "versions"):  # nor the attribute columns (0004)
            con.exec_driver_sql(f"ALTER TABLE {table} DROP COLUMN mode")
            con.exec_driver_sql(f"ALTER TABLE {table} DROP COLUMN mtime_ns")
        for col in ("name", "metadata_json", "archived_at", "updated_at"):  # nor 0006's
            con.exec_driver_sql(f"ALTER TABLE stores DROP COLUMN {col}")
        for col in ("redacted_at", "redacted_by"):
            con.exec_driver_sql(f"ALTER TABLE versions DROP COLUMN {col}")
        con.exec_driver_sql("DROP TABLE console_sessions")  # nor 0009's table
        con.exec_driver_sql("DROP TABLE consolidation_jobs")  # nor 0012's
        for stmt in fulltext.drop_statements(old.dialect.name):  # nor 0007's full-text index
            con.exec_driver_sql(stmt)
        con.exec_driver_sql("DROP INDEX ix_records_expires")  # nor 0008's columns
        for col in ("review_after", "expires_at"):
            con.exec_driver_sql(f"ALTER TABLE records DROP COLUMN {col}")
        for col in ("max_history_bytes", "max_history_versions", "history_min_age_s",
                    "version_bytes", "version_count"):  # nor 0010's history budget
            con.exec_driver_sql(f"ALTER TABLE stores DROP COLUMN {col}")
        con.exec_driver_sql("ALTER TABLE versions DROP COLUMN pruned")
        for col in ("base_version", "chain"):  # nor 0011's append versions
            con.exec_driver_sql(f"ALTER TABLE versions DROP COLUMN {col}")
        con.exec_driver_sql("DROP TABLE account_attachments")  # nor 0013's accounts
        con.exec_driver_sql("DROP TABLE accounts")
        for table in ("workspaces", "stores", "tokens"):
            con.exec_driver_sql(f"DROP INDEX ix_{table}_account")
            con.exec_driver_sql(f"ALTER TABLE {table} DROP COLUMN account")
        con.exec_driver_sql("DROP TABLE alembic_version")
    old.dispose()

    app2 = create_app(url)
    svc2 = app2.state.service
    st = svc2.get_store(admin, "s")
    assert (st.record_count, st.usage_bytes) == (4, 2 + 3 + 4 + 5)
    assert svc2.get_store(admin, "empty").record_count == 0
    svc2.create_record(admin, "s", RecordCreate(path="new.md", content="yy"))
    assert svc2.get_store(admin, "s").usage_bytes == 16
    svc2.db.dispose()
    create_app(url).state.service.db.dispose()  # already migrated: a no-op


# ---------------------------------------------------------------- auth cache


async def test_database_token_is_cached_and_expires(env):
    app, admin, me, peer = env
    svc = app.state.service
    r = await admin.post("/v1/tokens", json={"workspace": "ws", "name": "cached"})
    token = r.json()["token"]
    async with _client(app, token, **{"X-Memfuse-Instance": "t1"}) as c:
        rec = await _create(c, "via-db-token.md")
        assert rec["updated_by"] == "ws:ws/t1"
        assert svc.authenticate_cached(token) is not None
        # removed from the database behind the service's back: still known until expiry
        with svc.db.write_conn() as conn:
            conn.exec_driver_sql("DELETE FROM tokens")
        assert (await c.get("/v1/stores/default/records")).status_code == 200
        # its time is up (TOKEN_CACHE_SECONDS later): asked again, refused
        for entry in svc.tokens._token_cache.entries.values():
            entry.until = 0.0
        r = await c.get("/v1/stores/default/records")
        assert r.status_code == 401 and r.json()["code"] == "unauthorized"
    async with _client(app, "mf_unknown") as c:
        assert (await c.get("/v1/stores/default/records")).status_code == 401
    assert svc.authenticate_cached("mf_unknown") is None  # refusals are not remembered


# ---------------------------------------------------------------- wake-ups


async def test_record_writes_wake_only_their_stores_feeds(env):
    from memfuse.server.wakeups import EVENTS, FEED

    app, admin, me, peer = env
    svc = app.state.service
    notifier = svc.notifier
    svc.bus.start()  # PostgreSQL: its connect wakes every waiter once; let that pass first
    with trio.fail_after(10):
        while not svc.bus.connected:
            await trio.sleep(0.02)
    feed = notifier.subscribe(FEED, "default")
    feed_skip = notifier.subscribe(FEED, "default", skip_actor=ME)
    other_feed = notifier.subscribe(FEED, "other")
    events = notifier.subscribe(EVENTS, "ws")
    other_events = notifier.subscribe(EVENTS, "elsewhere")
    try:
        # A write's wakes are posted to the loop by the writer thread, which wakes the
        # request's own task straight (writerthread: an eventfd): the answer may come a loop
        # pass before the wakes run, so each wake is awaited (bounded) and a wake that must
        # not come is checked after the loop has run what was posted.
        await _create(me, "a.md")
        with trio.fail_after(5):
            await feed.event.wait()
        await trio.sleep(0.05)
        assert not feed_skip.event.is_set() and not other_feed.event.is_set() and not events.event.is_set()
        await _create(peer, "b.md")
        with trio.fail_after(5):
            await feed_skip.event.wait()
        await trio.sleep(0.05)
        assert not other_feed.event.is_set() and not events.event.is_set()
        r = await admin.put("/v1/workspaces/ws/attachments/other", json={"access": "read_only"})
        assert r.status_code == 200
        # an attachment change wakes that workspace's events, nobody's feed
        with trio.fail_after(5):
            await events.event.wait()
        await trio.sleep(0.05)
        assert not other_feed.event.is_set() and not other_events.event.is_set()
    finally:
        for w in (feed, feed_skip, other_feed, events, other_events):
            notifier.unsubscribe(w)


async def _bus_connected(svc):
    svc.bus.start()
    with trio.fail_after(10):
        while not svc.bus.connected:
            await trio.sleep(0.02)


async def test_idle_long_polls_make_no_database_queries(env):
    """A long-poll whose cursor is the store's head (or past the workspace's events) waits
    without a query: the server knows the heads from its commits. The first look learns
    them; every later long-poll, answer at the end of wait included, costs no statement."""
    app, admin, me, peer = env
    svc = app.state.service
    await _bus_connected(svc)
    seq = (await _create(peer, "x.md"))["seq"]
    ev = (await me.get("/v1/workspaces/ws/events", params={"after": 0})).json()["seq"]
    counter = app.state.metrics.db_statements

    async def both():
        async with trio.open_nursery() as n:
            async def feed():
                r = await me.get("/v1/stores/default/changes", params={"after": seq, "wait": 0.3, "skip_actor": ME})
                assert r.json() == {"changes": [], "seq": seq}

            async def events():
                r = await me.get("/v1/workspaces/ws/events", params={"after": ev, "wait": 0.3})
                assert r.json() == {"events": [], "seq": ev}
            n.start_soon(feed)
            n.start_soon(events)

    await both()  # may read once
    before = counter.value()
    for _ in range(3):
        await both()
    assert counter.value() == before
    # and a write still wakes them
    result = {}

    async def poll():
        r = await me.get("/v1/stores/default/changes", params={"after": seq, "wait": 20, "skip_actor": ME})
        result["page"] = r.json()

    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            n.start_soon(poll)
            while svc.notifier.waiting < 1:
                await trio.sleep(0.01)
            await _create(peer, "y.md")
    assert [c["record"]["path"] for c in result["page"]["changes"]] == ["y.md"]


async def test_woken_feeds_share_one_read(env):
    """Fifty long-polls at one cursor woken by one write: one database read serves them all
    (and those skipping the writer stay asleep)."""
    app, admin, me, peer = env
    svc, reads = app.state.service, app.state.feed_reads
    await _bus_connected(svc)
    seq = (await _create(peer, "x.md"))["seq"]
    await me.get("/v1/stores/default/changes", params={"after": seq, "wait": 0.1})  # learn the head
    got = []

    async def poll(i):
        r = await me.get("/v1/stores/default/changes", params={"after": seq, "wait": 20,
                                                               "skip_actor": f"ws:ws/s{i}"})
        got.append(r.json())

    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            for i in range(50):
                n.start_soon(poll, i)
            while svc.notifier.waiting < 50:
                await trio.sleep(0.01)
            before = reads.reads
            await _create(peer, "y.md")
    assert len(got) == 50 and all([c["record"]["path"] for c in g["changes"]] == ["y.md"] for g in got)
    assert reads.reads - before == 1


async def test_backpressure_answers_503_and_429_with_retry_after():
    """Over the in-flight limit: 503 ``overloaded`` with ``Retry-After`` at once; over the
    per-token long-poll limit: 429 ``too_many_long_polls``; other tokens are not affected."""
    with fresh_db_url() as url:
        app = create_app(url, static_tokens={ADMIN: None, WS_TOKEN: "ws"}, max_long_polls_per_token=2)
        try:
            async with _client(app, ADMIN) as admin, _client(app, WS_TOKEN) as ws:
                assert (await admin.post("/v1/workspaces", json={"name": "ws"})).status_code == 201
                assert (await admin.post("/v1/stores", json={"slug": "default"})).status_code == 201
                await admin.put("/v1/workspaces/ws/attachments/default", json={"access": "read_write"})
                statuses = []

                async def hold():
                    r = await ws.get("/v1/stores/default/changes", params={"after": 0, "wait": 2})
                    statuses.append(r.status_code)

                with trio.fail_after(20):
                    async with trio.open_nursery() as n:
                        n.start_soon(hold)
                        n.start_soon(hold)
                        while app.state.service.notifier.waiting < 2:
                            await trio.sleep(0.01)
                        r = await ws.get("/v1/stores/default/changes", params={"after": 0, "wait": 2})
                        assert r.status_code == 429 and r.headers["Retry-After"] == "5"
                        assert r.json()["code"] == "too_many_long_polls"
                        assert r.headers["content-type"] == "application/problem+json"
                        # another token may still long-poll; ordinary calls still pass
                        r = await admin.get("/v1/stores/default/changes", params={"after": 0, "wait": 0.1})
                        assert r.status_code == 200
                        assert (await ws.get("/v1/stores/default/records")).status_code == 200
                assert statuses == [200, 200]
                metrics = (await admin.get("/metrics")).text
                assert 'memfuse_server_refused_total{reason="too_many_long_polls"} 1.0' in metrics
        finally:
            app.state.service.db.dispose()
        app = create_app(url, static_tokens={ADMIN: None}, max_inflight=0)
        try:
            async with _client(app, ADMIN) as admin:
                r = await admin.get("/v1/stores")
                assert r.status_code == 503 and r.headers["Retry-After"] == "1"
                assert r.json()["code"] == "overloaded"
        finally:
            app.state.service.db.dispose()


async def test_revocation_topic_reaches_the_token_cache(env):
    """A revocation note on the commit bus (as another replica's revoke sends it) drops the
    token from this process's cache."""
    from memfuse.server import wakeups

    app, admin, me, peer = env
    svc = app.state.service
    tok = (await admin.post("/v1/tokens", json={"workspace": "ws", "name": "t"})).json()
    svc.authenticate(tok["token"])
    assert any(e.token_id == tok["id"] for e in svc.tokens._token_cache.entries.values())
    wakeups.begin_notes()
    wakeups.note_topic(wakeups.TOKEN_REVOKED, tok["id"])
    notes, _, _ = wakeups.take_notes()
    svc.notifier.committed(notes, local=False)
    assert not any(e.token_id == tok["id"] for e in svc.tokens._token_cache.entries.values())


async def test_token_confirmations_are_batched(env):
    """One query looks up a token whose cache entry ran out and confirms every other cached
    token in the second half of its life (dropping those gone from the database), so idle
    sidecars cost about one token query per 15 s in all instead of one per token."""
    import time

    from sqlalchemy import event

    from memfuse.models import sha256_hex

    app, admin, me, peer = env
    svc = app.state.service
    toks = [(await admin.post("/v1/tokens", json={"workspace": "ws", "name": f"t{i}"})).json()["token"]
            for i in range(3)]
    for t in toks:
        svc.authenticate(t)
    digests = [sha256_hex(t.encode()) for t in toks]
    cache = svc.tokens._token_cache
    with svc.db.write_conn() as conn:
        conn.exec_driver_sql(f"DELETE FROM tokens WHERE token_sha256 = '{digests[2]}'")
    mono = time.monotonic()
    cache.entries[digests[0]].until = mono - 1  # ran out
    cache.entries[digests[1]].until = mono + 5  # due for confirmation
    cache.entries[digests[2]].until = mono + 5  # due, and gone from the database
    cache.batch_at = -1e18
    seen = []

    def log_statement(conn, cursor, statement, *args):
        if "FROM tokens" in statement and "revoked_at >" not in statement:
            seen.append(statement)

    event.listen(svc.db.engine, "before_cursor_execute", log_statement)
    try:
        assert svc.authenticate(toks[0]).workspace == "ws"
    finally:
        event.remove(svc.db.engine, "before_cursor_execute", log_statement)
    assert len(seen) == 1
    assert cache.entries[digests[1]].until > mono + 20  # confirmed by that query
    assert digests[2] not in cache.entries


def test_tune_gc_sets_the_collector_thresholds():
    """``memfuse serve`` raises the collector's first threshold (memfuse.server.serve.tune_gc)."""
    import gc

    from memfuse.server.serve import GC_THRESHOLDS, tune_gc

    before = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_threshold() == GC_THRESHOLDS
        assert GC_THRESHOLDS[0] > 700  # above CPython's default
    finally:
        gc.set_threshold(*before)


# ---------------------------------------------------------------- prefix move


async def test_prefix_move_statements_do_not_grow_with_the_records(env):
    """A prefix move (``mv`` of a directory) runs a fixed number of statements whatever the
    number of records it moves (attack 12 A4: ~1.15 ms and several statements per record
    held the writer 30-50 s for 10,000 records), and keeps every meaning: each record gets
    a ``moved`` version with its old path and its mtime, the change feed and search see the
    new paths, the live content (with an appended tail) is unchanged, a taken target is 409
    with nothing moved, and a target that is another moving record's old path is fine."""
    from sqlalchemy import event

    app, admin, me, peer = env
    svc = app.state.service
    seen: list[str] = []

    def log_statement(conn, cursor, statement, *args):
        if "records" in statement or "versions" in statement:
            seen.append(statement)

    async def move(src: str, dst: str) -> tuple[int, httpx.Response]:
        seen.clear()
        event.listen(svc.db.engine, "before_cursor_execute", log_statement)
        try:
            r = await me.post("/v1/stores/default/move", json={"from_prefix": src, "to_prefix": dst})
        finally:
            event.remove(svc.db.engine, "before_cursor_execute", log_statement)
        return len(seen), r

    small = [await _create(me, f"s/{i:02d}.md", f"# s{i}\nsmall {i}\n") for i in range(3)]
    big = [await _create(me, f"b/{i:02d}.md", f"# b{i}\nbig {i}\n") for i in range(40)]
    r = await me.post(f"/v1/stores/default/records/{big[0]['id']}/append", json={"append": "more\n"},
                      headers={"If-Match": f'"{big[0]["sha256"]}"'})
    assert r.status_code == 200, r.text
    n_small, r = await move("s", "s2")
    assert r.status_code == 200, r.text
    n_big, r = await move("b", "b2")
    assert r.status_code == 200, r.text
    assert n_big == n_small, (n_small, n_big)
    moved = r.json()["records"]
    assert [x["path"] for x in moved] == [f"b2/{i:02d}.md" for i in range(40)]
    assert [x["seq"] for x in moved] == sorted(x["seq"] for x in moved)
    assert all(x["version"] == 2 for x in moved[1:]) and moved[0]["version"] == 3
    got = (await me.get(f"/v1/stores/default/records/{big[0]['id']}")).json()
    assert (got["path"], got["content"]) == ("b2/00.md", "# b0\nbig 0\nmore\n")
    vs = (await me.get(f"/v1/stores/default/records/{big[5]['id']}/versions")).json()
    vs = vs["versions"] if isinstance(vs, dict) else vs
    last = max(vs, key=lambda v: v["version"])
    assert (last["operation"], last["path"]) == ("moved", "b2/05.md")
    full = (await me.get(f"/v1/stores/default/records/{big[5]['id']}/versions/2")).json()
    assert full["content"] == "# b5\nbig 5\n"
    changes = (await peer.get("/v1/stores/default/changes", params={"after": big[-1]["seq"]})).json()["changes"]
    assert [c["record"]["path"] for c in changes][-40:] == [f"b2/{i:02d}.md" for i in range(40)]
    for order in ("path", "relevance"):  # relevance: the full-text index (its paths too)
        r = await me.get("/v1/stores/default/search", params={"q": "big", "order": order, "limit": 100})
        assert r.status_code == 200, r.text
        assert sorted(h["record"]["path"] for h in r.json()["hits"]) == [f"b2/{i:02d}.md" for i in range(40)]
    # a taken target: 409, nothing moves
    await _create(me, "t/03.md", "taken\n")
    _, r = await move("b2", "t")
    assert r.status_code == 409 and r.json()["code"] == "path_exists", r.text
    got = (await me.get(f"/v1/stores/default/records/{big[3]['id']}")).json()
    assert got["path"] == "b2/03.md"
    # out of a directory into its parent: a target that is another moving record's old path
    inner = await _create(me, "a/a/x.md", "ax\n")
    deep = await _create(me, "a/a/a/x.md", "aax\n")
    _, r = await move("a/a", "a")
    assert r.status_code == 200, r.text
    assert [x["path"] for x in r.json()["records"]] == ["a/a/x.md", "a/x.md"]
    assert (await me.get(f"/v1/stores/default/records/{inner['id']}")).json()["path"] == "a/x.md"
    assert (await me.get(f"/v1/stores/default/records/{deep['id']}")).json()["path"] == "a/a/x.md"


async def test_prefix_move_past_the_bound_is_refused(env, monkeypatch):
    """More records under ``from_prefix/`` than ``MAX_PREFIX_MOVE`` (lowered to 2 here; 20,000
    by default, ``memfuse.defs.PREFIX_MOVE_MAX``): 413 ``move_too_large``, nothing moves;
    the sidecar's errno for it is EXDEV (``mv`` copies instead)."""
    import errno

    from memfuse.errors import ERRNO_BY_CODE
    from memfuse.server import records

    app, admin, me, peer = env
    monkeypatch.setattr(records, "MAX_PREFIX_MOVE", 2)
    for i in range(3):
        await _create(me, f"m/{i}.md")
    r = await me.post("/v1/stores/default/move", json={"from_prefix": "m", "to_prefix": "n"})
    assert r.status_code == 413 and r.json()["code"] == "move_too_large", r.text
    assert ERRNO_BY_CODE["move_too_large"] == errno.EXDEV
    r = await me.get("/v1/stores/default/records", params={"prefix": "m/"})
    assert sorted(x["path"] for x in r.json()["records"]) == ["m/0.md", "m/1.md", "m/2.md"]
    r = await me.post("/v1/stores/default/move", json={"from_prefix": "m/0.md", "to_prefix": "k"})
    assert r.status_code == 200 and r.json() == {"records": []}


async def test_a_feed_read_costs_one_statement_per_step_and_pages_as_changes_page(env):
    """A change-feed read (``Service.feed_read``: what each create costs once for the other
    sidecars' streams and long-polls that wait on its store, whatever their number) runs one
    statement per step: BEGIN (SQLite), both heads in one, the sizes, the rows
    (bench/README.md, "The close path, session 15: the echo"; main ran the heads apart). Its
    pages are the ones ``changes_page`` answers: creates, an append version made whole, a
    move, a delete, ``skip_actor``, a limit, with and without content."""
    app, admin, me, peer = env
    svc = app.state.service
    counter = app.state.metrics.db_statements
    p = Principal(workspace="ws", instance="me")
    key = svc.check_feed_access(p, "default")
    start = svc.feed_read(key, 0, with_content=False).store_top
    a = await _create(peer, "a.md", "one\n")
    r = await peer.post(f"/v1/stores/default/records/{a['id']}/append", json={"append": "two\n"},
                        headers={"If-Match": a["sha256"]})
    assert r.status_code == 200, r.text
    await _create(me, "mine.md")
    r = await peer.post(f"/v1/stores/default/records/{a['id']}/move", json={"path": "b.md"})
    assert r.status_code == 200, r.text
    b = await _create(peer, "gone.md")
    assert (await peer.delete(f"/v1/stores/default/records/{b['id']}")).status_code == 204
    prev = svc.feed_read(key, start, with_content=False).store_top
    top = (await _create(peer, "last.md"))["seq"]
    before = counter.value()
    fr = svc.feed_read(key, prev)  # the one create, as a stream woken by it reads it
    assert [c.record.path for c in fr.changes] == ["last.md"]
    steps = 4 if svc.db.is_sqlite else 3  # BEGIN is sent by the driver itself on PostgreSQL
    assert counter.value() - before == steps
    for content in (True, False):
        for skip in (None, ME):
            for limit in (1, 2, 100):
                got = {}
                for way in ("changes_page", "feed_read"):
                    after, changes = start, []
                    while True:
                        if way == "changes_page":
                            page = svc.changes_page(p, "default", after, limit=limit, with_content=content,
                                                    skip_actor=skip)
                        else:
                            page, _ = svc.feed_read(key, after, limit=limit, with_content=content).page(skip)
                            if skip is None:  # unfiltered, the shared page is changes_page's
                                assert page.model_dump() == svc.changes_page(
                                    p, "default", after, limit=limit, with_content=content).model_dump()
                        if not page.changes and page.seq == after:
                            break
                        changes += page.changes
                        after = page.seq
                    got[way] = ([c.model_dump() for c in changes], after)
                    assert [c.record.path for c in changes] == (
                        ["a.md", "a.md"] + ([] if skip else ["mine.md"]) + ["b.md", "gone.md", "gone.md", "last.md"])
                    if content:
                        assert changes[1].record.content == "one\ntwo\n"  # the append made whole
                    assert changes[-2].record.deleted and after == top
                assert got["changes_page"] == got["feed_read"]
