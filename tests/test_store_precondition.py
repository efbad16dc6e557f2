"""Store identity as a precondition of every record write (docs/API.md "Store identity"):
a write sent with ``Memfuse-Store-Created`` (the creation time of the store it was made for)
is refused with 412 ``store_replaced`` when the store of that slug is another one now (deleted
and made again), inside the write's transaction, and leaves nothing; a matching one and one
without the header are served as before.

Runs on in-memory SQLite, and on PostgreSQL through ``tests/test_postgres.py``.
"""
from __future__ import annotations

import hashlib
import json

import httpx
import pytest

from memfuse.client import ApiClient, StoreReplaced, store_precondition
from memfuse.defs import STORE_CREATED_HEADER
from memfuse.server.app import create_app
from pgutil import fresh_db_url

ADMIN = "precond-admin-token"
WS = "precond-ws-token"
BASE = "http://test"


def _client(app, token: str = ADMIN) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE,
                             headers={"Authorization": f"Bearer {token}", "X-Memfuse-Instance": "t"})


async def _make_store(admin: httpx.AsyncClient, slug: str = "s") -> str:
    """Create ``slug``, attach it read-write to ``ws``; its ``created_at`` as the API gives it."""
    r = await admin.post("/v1/stores", json={"slug": slug})
    assert r.status_code == 201, r.text
    r = await admin.put(f"/v1/workspaces/ws/attachments/{slug}", json={"access": "read_write"})
    assert r.status_code == 200, r.text
    return (await admin.get(f"/v1/stores/{slug}")).json()["created_at"]


@pytest.fixture
async def env():
    with fresh_db_url() as url:
        app = create_app(url, static_tokens={ADMIN: None, WS: "ws"}, faces=False)
        async with _client(app) as admin:
            assert (await admin.post("/v1/workspaces", json={"name": "ws", "default_store": False})).status_code == 201
            async with _client(app, WS) as ws:
                yield app, admin, ws
        app.state.service.db.dispose()


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _etag(text: str) -> str:
    return '"' + _sha(text) + '"'


def svc_admin():
    from memfuse.server.base import Principal
    return Principal(workspace=None)


async def _old_and_new(app, admin: httpx.AsyncClient, ws: httpx.AsyncClient) -> tuple[str, str, dict]:
    """A store ``s`` with records a.md and d/b.md, deleted and made again with one record
    c.md: (the deleted store's created_at, the new one's, the ids of the deleted store's
    records by path)."""
    old = await _make_store(admin)
    ids = {}
    for path in ("a.md", "d/b.md"):
        r = await ws.post("/v1/stores/s/records", json={"path": path, "content": "old\n"},
                          headers={STORE_CREATED_HEADER: old})
        assert r.status_code == 201, r.text
        ids[path] = r.json()["id"]
    svc = app.state.service
    svc.ms_delete_store(svc_admin(), "s", None)  # the memory-store face's delete (faces off here)
    new = await _make_store(admin)
    assert new != old
    r = await ws.post("/v1/stores/s/records", json={"path": "c.md", "content": "new\n"})
    assert r.status_code == 201
    ids["c.md"] = r.json()["id"]
    return old, new, ids


async def _live(ws: httpx.AsyncClient) -> dict[str, str]:
    r = await ws.get("/v1/stores/s/records", params={"content": "true"})
    assert r.status_code == 200
    return {rec["path"]: rec["content"] for rec in r.json()["records"]}


async def test_every_write_made_for_a_deleted_store_is_refused_and_leaves_nothing(env):
    app, admin, ws = env
    old, new, ids = await _old_and_new(app, admin, ws)
    before = await _live(ws)
    assert before == {"c.md": "new\n"}
    c = ids["c.md"]
    stale = {STORE_CREATED_HEADER: old}
    writes = [
        ("POST", "/v1/stores/s/records", {"path": "x.md", "content": "stale\n"}),
        ("PUT", f"/v1/stores/s/records/{c}", {"content": "stale\n"}),
        ("POST", f"/v1/stores/s/records/{c}/append", {"append": "stale\n"}, _sha("new\n")),
        ("PATCH", f"/v1/stores/s/records/{c}", {"mode": 0o600}),
        ("POST", f"/v1/stores/s/records/{c}/move", {"path": "moved.md"}),
        ("POST", "/v1/stores/s/move", {"from_prefix": "d", "to_prefix": "z"}),
        ("DELETE", f"/v1/stores/s/records/{c}", None),
        ("POST", f"/v1/stores/s/records/{c}/restore", {"version": 1}),
        ("POST", "/v1/stores/s/batch", {"operations": [
            {"op": "create", "body": {"path": "y.md", "content": "stale\n"}},
            {"op": "delete", "record_id": c}]}),
    ]
    for i, (method, path, body, *if_match) in enumerate(writes):
        headers = {**stale, "Idempotency-Key": f"k{i}"} if not path.endswith("/batch") else dict(stale)
        if if_match:
            headers["If-Match"] = f'"{if_match[0]}"'
        if body is not None:
            headers["Content-Type"] = "application/json"
        r = await ws.request(method, path, headers=headers,
                             content=None if body is None else json.dumps(body))
        assert r.status_code == 412, (method, path, r.status_code, r.text)
        problem = r.json()
        assert r.headers["content-type"].startswith("application/problem+json")
        assert problem["code"] == "store_replaced", problem
    assert await _live(ws) == before
    r = await ws.get(f"/v1/stores/s/records/{c}/versions")
    assert [v["version"] for v in r.json()] == [1]
    # the same writes naming the store there is now, or naming none, are served
    r = await ws.put(f"/v1/stores/s/records/{c}", json={"content": "fresh\n"},
                     headers={STORE_CREATED_HEADER: new})
    assert r.status_code == 200, r.text
    r = await ws.post("/v1/stores/s/records", json={"path": "x.md", "content": "fresh\n"})
    assert r.status_code == 201, r.text
    # the same instant written otherwise (Z, another offset) is the same store
    z = new.replace("+00:00", "Z")
    r = await ws.post(f"/v1/stores/s/records/{c}/append", json={"append": "more\n"},
                      headers={STORE_CREATED_HEADER: z, "If-Match": _etag("fresh\n")})
    assert r.status_code == 200, r.text
    assert await _live(ws) == {"c.md": "fresh\nmore\n", "x.md": "fresh\n"}


async def test_a_store_identity_that_is_no_date_time_is_refused(env):
    app, admin, ws = env
    await _make_store(admin)
    r = await ws.post("/v1/stores/s/records", json={"path": "a.md", "content": "x"},
                      headers={STORE_CREATED_HEADER: "yesterday"})
    assert r.status_code == 422 and r.json()["code"] == "validation_error", r.text
    assert await _live(ws) == {}


async def test_the_client_sends_the_store_identity_inside_store_precondition(env):
    """``ApiClient`` sends ``Memfuse-Store-Created`` on writes inside ``store_precondition``
    and raises ``StoreReplaced`` (not ``PreconditionFailed``: nothing to merge with)."""
    app, admin, ws = env
    old, new, ids = await _old_and_new(app, admin, ws)
    async with ApiClient(BASE, WS, transport=httpx.ASGITransport(app=app), instance="t") as api:
        with store_precondition(old):
            rec = await api.get_record("s", ids["c.md"])  # a read is not checked
            with pytest.raises(StoreReplaced) as err:
                await api.update_record("s", ids["c.md"], "stale\n", if_match=rec.sha256, idempotency_key="u1")
            assert err.value.status == 412 and err.value.code == "store_replaced"
            with pytest.raises(StoreReplaced):
                await api.batch("s", [api.batch_create("y.md", "stale\n", idempotency_key="b1")])
        with store_precondition(new):
            await api.update_record("s", ids["c.md"], "fresh\n", if_match=rec.sha256, idempotency_key="u2")
        await api.create_record("s", "y.md", "plain\n", idempotency_key="c1")  # outside: not checked
    assert await _live(ws) == {"c.md": "fresh\n", "y.md": "plain\n"}
