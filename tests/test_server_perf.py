"""Functional tests of the control plane's cheap write path (no timings here; the benchmark
is ``memfuse/server/perfbench.py``): the store usage counters kept by every write, their
backfill in an older database, the token cache, and which long-polls a record write wakes."""
from __future__ import annotations

import sqlite3

import httpx
import pytest
import trio

from memfuse.models import RecordCreate, StoreCreate, StoreUpdate
from memfuse.server.app import create_app
from memfuse.server.service import Principal, _usage

ADMIN = "perf-admin-token"
WS_TOKEN = "perf-ws-token"
BASE = "http://test"


def _client(app, token: str, **headers) -> httpx.AsyncClient:
    headers["Authorization"] = f"Bearer {token}"
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE, headers=headers)


@pytest.fixture
async def env():
    app = create_app("sqlite://", static_tokens={ADMIN: None, WS_TOKEN: "ws"})
    async with _client(app, ADMIN) as admin, _client(app, WS_TOKEN, **{"X-Memfuse-Instance": "me"}) as me, \
            _client(app, WS_TOKEN, **{"X-Memfuse-Instance": "peer"}) as peer:
        assert (await admin.post("/v1/workspaces", json={"name": "ws"})).status_code == 201
        assert (await admin.post("/v1/stores", json={"slug": "default"})).status_code == 201
        assert (await admin.post("/v1/stores", json={"slug": "other"})).status_code == 201
        for slug in ("default", "other"):
            r = await admin.put(f"/v1/workspaces/ws/attachments/{slug}", json={"access": "read_write"})
            assert r.status_code == 200, r.text
        yield app, admin, me, peer
    app.state.service.db.dispose()


async def _create(client, path, content="x\n", store="default"):
    r = await client.post(f"/v1/stores/{store}/records", json={"path": path, "content": content})
    assert r.status_code == 201, r.text
    return r.json()


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
    from the live records."""
    db = tmp_path / "old.db"
    app = create_app(f"sqlite:///{db}")
    svc = app.state.service
    admin = Principal(workspace=None)
    svc.create_store(admin, StoreCreate(slug="s"))
    svc.create_store(admin, StoreCreate(slug="empty"))
    for i in range(5):
        svc.create_record(admin, "s", RecordCreate(path=f"r{i}.md", content="x" * (i + 1)))
    rid = svc.list_records(admin, "s").records[0].id
    svc.delete_record(admin, "s", rid)
    svc.db.dispose()
    con = sqlite3.connect(db)
    con.execute("ALTER TABLE stores DROP COLUMN usage_bytes")
    con.execute("ALTER TABLE stores DROP COLUMN record_count")
    con.commit()
    con.close()

    app2 = create_app(f"sqlite:///{db}")
    svc2 = app2.state.service
    st = svc2.get_store(admin, "s")
    assert (st.record_count, st.usage_bytes) == (4, 2 + 3 + 4 + 5)
    assert svc2.get_store(admin, "empty").record_count == 0
    svc2.create_record(admin, "s", RecordCreate(path="new.md", content="yy"))
    assert svc2.get_store(admin, "s").usage_bytes == 16
    svc2.db.dispose()
    create_app(f"sqlite:///{db}").state.service.db.dispose()  # already migrated: a no-op


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
        svc._token_cache.update({k: (ws, name, 0.0) for k, (ws, name, _) in svc._token_cache.items()})
        r = await c.get("/v1/stores/default/records")
        assert r.status_code == 401 and r.json()["code"] == "unauthorized"
    async with _client(app, "mf_unknown") as c:
        assert (await c.get("/v1/stores/default/records")).status_code == 401
    assert svc.authenticate_cached("mf_unknown") is None  # refusals are not remembered


# ---------------------------------------------------------------- wake-ups


async def test_record_writes_wake_only_their_stores_feeds(env):
    app, admin, me, peer = env
    notifier = app.state.service.notifier
    feed = notifier.subscribe("default")
    other_feed = notifier.subscribe("other")
    events = notifier.subscribe()
    try:
        await _create(me, "a.md")
        assert feed.event.is_set()
        assert not other_feed.event.is_set() and not events.event.is_set()
        r = await admin.put("/v1/workspaces/ws/attachments/other", json={"access": "read_only"})
        assert r.status_code == 200
        await trio.sleep(0)
        assert other_feed.event.is_set() and events.event.is_set()  # admin writes wake everyone
    finally:
        for w in (feed, other_feed, events):
            notifier.unsubscribe(w)
