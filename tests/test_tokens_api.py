"""Token lifecycle in the reference control plane (docs/TOKENS.md): create with an expiry,
list without secrets, revoke at once (on this process and, within about a second, on another
process sharing the database), expiry, admin only, ``last_used_at`` written at most once a
minute, audit lines with the actor. Runs on SQLite, and on PostgreSQL through
``tests/test_postgres.py``."""
from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta, timezone

import httpx
import pytest
import trio
from sqlalchemy import event

import memfuse.server.tokens as tokens_mod
from memfuse.models import sha256_hex
from memfuse.server.app import create_app
from pgutil import fresh_db_url

ADMIN = "tokens-admin-token"
WS_TOKEN = "tokens-ws-token"
BASE = "http://test"


def _client(app, token: str | None, **headers) -> httpx.AsyncClient:
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE, headers=headers)


def assert_problem(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    body = r.json()
    assert body["code"] == code, body
    return body


@pytest.fixture
async def env(tmp_path):
    # a file: a second app (another replica) may open the same database
    with fresh_db_url(f"sqlite:///{tmp_path}/cp.db") as url:
        app = create_app(url, static_tokens={ADMIN: None, WS_TOKEN: "ws"})
        async with _client(app, ADMIN) as admin:
            for ws in ("ws", "other"):
                assert (await admin.post("/v1/workspaces", json={"name": ws})).status_code == 201
            yield url, app, admin
        app.state.service.db.dispose()


async def _create(admin: httpx.AsyncClient, **body) -> dict:
    r = await admin.post("/v1/tokens", json=body)
    assert r.status_code == 201, r.text
    return r.json()


async def _works(app, token: str, ws: str = "ws") -> int:
    async with _client(app, token) as c:
        return (await c.get(f"/v1/workspaces/{ws}/attachments")).status_code


async def test_create_list_never_shows_secrets(env):
    _, app, admin = env
    a = await _create(admin, workspace="ws", name="sidecar-a")
    b = await _create(admin, workspace="ws", name="sidecar-b", ttl_seconds=3600)
    o = await _create(admin, workspace="other", name="other")
    adm = await _create(admin, name="ops")
    assert a["expires_at"] is None and a["token"].startswith("mf_")
    exp = datetime.fromisoformat(b["expires_at"])
    assert timedelta(seconds=3590) < exp - datetime.now(timezone.utc) <= timedelta(seconds=3600)
    r = await admin.get("/v1/tokens")
    assert r.status_code == 200, r.text
    listed = r.json()
    assert [t["id"] for t in listed] == [a["id"], b["id"], o["id"], adm["id"]]  # oldest first
    for t, made in zip(listed, (a, b, o, adm)):
        assert set(t) == {"id", "workspace", "name", "created_at", "last_used_at", "expires_at",
                          "revoked_at", "state", "account"}
        assert t["state"] == "active" and t["name"] == made["name"]
        assert made["token"] not in r.text and sha256_hex(made["token"].encode()) not in r.text
    assert listed[1]["expires_at"] is not None
    r = await admin.get("/v1/tokens", params={"workspace": "ws"})
    assert [t["id"] for t in r.json()] == [a["id"], b["id"]]
    r = await admin.get("/v1/tokens", params={"workspace": ""})
    assert [t["id"] for t in r.json()] == [adm["id"]]
    assert_problem(await admin.post("/v1/tokens", json={"ttl_seconds": 0}), 422, "validation_error")


async def test_revoke_is_immediate_and_listed(env, caplog):
    _, app, admin = env
    caplog.set_level(logging.INFO, logger="memfuse.server.service")
    t = await _create(admin, workspace="ws", name="leaked")
    keep = await _create(admin, workspace="ws", name="kept")
    assert await _works(app, t["token"]) == 200
    assert app.state.service.authenticate_cached(t["token"]) is not None  # in the 30 s cache
    r = await admin.delete(f"/v1/tokens/{t['id']}")
    assert r.status_code == 204, r.text
    async with _client(app, t["token"]) as c:
        body = assert_problem(await c.get("/v1/workspaces/ws/attachments"), 401, "unauthorized")
        assert "revoked" in body["detail"]
    assert await _works(app, keep["token"]) == 200  # the other token is untouched
    r = await admin.get("/v1/tokens")
    assert [x["id"] for x in r.json()] == [keep["id"]]
    r = await admin.get("/v1/tokens", params={"include_revoked": "true"})
    revoked = next(x for x in r.json() if x["id"] == t["id"])
    assert revoked["state"] == "revoked" and revoked["revoked_at"] is not None
    assert (await admin.delete(f"/v1/tokens/{t['id']}")).status_code == 204  # again: no-op
    assert_problem(await admin.delete("/v1/tokens/no-such-id"), 404, "token_not_found")
    audit = [r.getMessage() for r in caplog.records if "audit:" in r.getMessage()]
    assert any(f"token {t['id']} (leaked) created for ws by admin:static" in m for m in audit), audit
    assert sum(f"token {t['id']} (leaked) of ws revoked by admin:static" in m for m in audit) == 1
    assert all(t["token"] not in m for m in caplog.messages)


class _Clock:
    """``time`` for memfuse.server.tokens, shifted by ``shift`` seconds (both clocks)."""

    def __init__(self) -> None:
        self.shift = 0.0

    def time(self) -> float:
        return time.time() + self.shift

    def monotonic(self) -> float:
        return time.monotonic() + self.shift


async def test_revocation_reaches_another_replica_within_a_second(env, monkeypatch):
    """Two apps on one database: B has the token in its 30 s cache; A revokes it; once B's
    last read of the recent revocations is more than REVOCATION_CHECK_SECONDS old, B refuses
    it (long before the cache entry's 30 s are up). Then the same in real time."""
    url, app_a, admin = env
    clock = _Clock()
    monkeypatch.setattr(tokens_mod, "time", clock)
    app_b = create_app(url, static_tokens={ADMIN: None})
    try:
        for real_time in (False, True):
            t = await _create(admin, workspace="ws")
            assert await _works(app_b, t["token"]) == 200
            assert app_b.state.service.authenticate_cached(t["token"]) is not None
            assert (await admin.delete(f"/v1/tokens/{t['id']}")).status_code == 204
            assert await _works(app_a, t["token"]) == 401  # the replica that revoked: at once
            if not real_time:
                clock.shift += tokens_mod.REVOCATION_CHECK_SECONDS + 0.01
                assert app_b.state.service.authenticate_cached(t["token"]) is None
                assert await _works(app_b, t["token"]) == 401
            else:
                with trio.fail_after(10):  # about a second; generous under load
                    while await _works(app_b, t["token"]) != 401:
                        await trio.sleep(0.05)
    finally:
        app_b.state.service.db.dispose()


async def test_expired_token_is_refused_like_a_revoked_one(env, monkeypatch):
    _, app, admin = env
    clock = _Clock()
    monkeypatch.setattr(tokens_mod, "time", clock)
    t = await _create(admin, workspace="ws", ttl_seconds=10)
    assert await _works(app, t["token"]) == 200
    assert app.state.service.authenticate_cached(t["token"]) is not None
    clock.shift = 11  # within the cache's 30 s: the entry's expiry is checked too
    async with _client(app, t["token"]) as c:
        body = assert_problem(await c.get("/v1/workspaces/ws/attachments"), 401, "unauthorized")
    assert "expired" in body["detail"]
    app.state.service.tokens_revoked(None)  # not cached: the row's expiry is checked
    async with _client(app, t["token"]) as c:
        body = assert_problem(await c.get("/v1/workspaces/ws/attachments"), 401, "unauthorized")
    assert "expired" in body["detail"]
    monkeypatch.setattr(tokens_mod, "utcnow", lambda: datetime.now(timezone.utc) + timedelta(seconds=61))
    r = await admin.get("/v1/tokens", params={"workspace": "ws"})
    assert [x["state"] for x in r.json()] == ["expired"]


async def test_workspace_token_cannot_see_or_revoke_tokens(env):
    _, app, admin = env
    mine = await _create(admin, workspace="ws", name="mine")
    theirs = await _create(admin, workspace="other", name="theirs")
    for tok in (WS_TOKEN, mine["token"]):
        async with _client(app, tok) as ws:
            assert_problem(await ws.get("/v1/tokens"), 403, "forbidden")
            assert_problem(await ws.get("/v1/tokens", params={"workspace": "ws"}), 403, "forbidden")
            for victim in (theirs, mine):
                assert_problem(await ws.delete(f"/v1/tokens/{victim['id']}"), 403, "forbidden")
            assert_problem(await ws.post("/v1/tokens", json={"workspace": "ws"}), 403, "forbidden")
    assert await _works(app, theirs["token"], "other") == 200  # still works
    assert await _works(app, mine["token"]) == 200
    r = await admin.get("/v1/tokens")
    assert {x["id"] for x in r.json()} == {mine["id"], theirs["id"]}  # nothing revoked


async def test_last_used_is_written_for_every_token_in_one_statement_a_minute(env, monkeypatch):
    """Requests only mark their token used; once a minute (per process) one UPDATE writes
    last_used_at of every token used since; list_tokens writes what is pending first."""
    _, app, admin = env
    clock = _Clock()
    monkeypatch.setattr(tokens_mod, "time", clock)
    toks = [await _create(admin, workspace="ws", name=f"t{i}") for i in range(3)]
    assert all(t["last_used_at"] is None for t in (await admin.get("/v1/tokens")).json())
    updates: list[str] = []
    engine = app.state.service.db.engine

    def count(conn, cursor, statement, *args):
        if statement.lstrip().upper().startswith("UPDATE TOKENS"):
            updates.append(statement)
    event.listen(engine, "before_cursor_execute", count)
    try:
        for _ in range(10):
            for t in toks:
                assert await _works(app, t["token"]) == 200
        assert updates == []  # not one write per request, nor per token
        clock.shift = 67  # the process's minute (± 10 %) is over: the next request writes them all
        assert await _works(app, toks[0]["token"]) == 200
        assert len(updates) == 1
        listed = {t["name"]: t["last_used_at"] for t in (await admin.get("/v1/tokens")).json()}
        assert len(updates) == 1  # nothing pending: list_tokens wrote nothing more
        assert all(listed[f"t{i}"] is not None for i in range(3))
        first = listed["t0"]
        for _ in range(5):
            assert await _works(app, toks[1]["token"]) == 200
        assert len(updates) == 1  # within the next minute: pending only
        # a fresh process (cache empty) sees a recent last_used_at: nothing to write
        app.state.service.tokens_revoked(None)
        assert await _works(app, toks[2]["token"]) == 200
        r = await admin.get("/v1/tokens")  # writes the pending use of t1 (one statement)
        assert len(updates) == 2
        # a minute and more later: one more statement for the tokens used meanwhile
        clock.shift = 67 + 67
        monkeypatch.setattr(tokens_mod, "utcnow",
                            lambda: datetime.now(timezone.utc) + timedelta(seconds=134))
        for t in toks:
            assert await _works(app, t["token"]) == 200
        assert len(updates) == 3
        later = {t["name"]: t["last_used_at"] for t in (await admin.get("/v1/tokens")).json()}
        assert datetime.fromisoformat(later["t0"]) - datetime.fromisoformat(first) >= timedelta(seconds=60)
        assert r.status_code == 200
    finally:
        event.remove(engine, "before_cursor_execute", count)


async def test_names_no_object_can_have_are_missing_not_errors(env):
    """A workspace or store name no object can have (a NUL byte, which PostgreSQL refuses in
    a query; spaces, upper case) is 404 like a missing one, on every database (found by
    Schemathesis on PostgreSQL: ``POST /v1/tokens {"workspace": "\\x00..."}`` was a 500)."""
    _, app, admin = env
    for bad in ("\x00ws", "W S", "ws\x00"):
        r = await admin.post("/v1/tokens", json={"workspace": bad})
        assert r.status_code == 404 and r.json()["code"] == "workspace_not_found", r.text
    async with _client(app, WS_TOKEN) as ws:
        for bad in ("%00x", "x~%00", "A%20B"):
            r = await admin.get(f"/v1/stores/{bad}")
            assert r.status_code in (404, 422), r.text
            r = await ws.get(f"/v1/stores/{bad}/records")
            assert r.status_code in (404, 422), r.text
    for bad in ("%00x", "A%20B"):  # an account no account can be
        r = await admin.get(f"/v1/stores?account={bad}")
        assert r.status_code == 404 and r.json()["code"] == "account_not_found", r.text
