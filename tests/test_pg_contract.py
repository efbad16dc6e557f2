"""Two parts of docs/API.md that PostgreSQL broke and SQLite kept (an outside tester's finds):

- a version number is any signed 64-bit integer: one no record can have (past the 32-bit
  version columns of PostgreSQL) is 404 ``version_not_found``, never a 500;
- "Idempotency": requests with one Idempotency-Key and the same body get the stored answer,
  also when they arrive at once (PostgreSQL runs writers concurrently, SQLite one at a time).

Runs on SQLite (a file, so the requests' threads share it) and, under MEMFUSE_TEST_DB_URL,
PostgreSQL (tests/test_postgres.py runs it there)."""
from __future__ import annotations

import hashlib
import uuid

import httpx
import pytest
import trio

from memfuse.server.app import create_app
from pgutil import fresh_db_url
from planeutil import attach_ws

ADMIN = "test-admin-token"
WS_TOKEN = "test-ws-token"
BASE = "http://test"
R = "/v1/stores/default/records"
N = 8  # requests at once with one key (the tester's figure)


def _client(app, token: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE,
                             headers={"Authorization": f"Bearer {token}"}, timeout=60)


@pytest.fixture
async def env(tmp_path):
    with fresh_db_url(f"sqlite:///{tmp_path / 'cp.db'}") as url:
        app = create_app(url, static_tokens={ADMIN: None, WS_TOKEN: "ws"})
        async with _client(app, ADMIN) as admin, _client(app, WS_TOKEN) as ws:
            await attach_ws(admin)
            yield admin, ws
        app.state.service.db.dispose()


def _problem(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    assert r.json()["code"] == code, r.text


@pytest.mark.parametrize("n", [2**31 - 1, 2**31, 2**32 + 1, 2**63 - 1])
async def test_a_version_past_the_columns_is_not_found(env, n):
    """GET …/versions/{n}, restore and redact of version n, for n from the largest the version
    columns hold to the largest API.md takes: 404 ``version_not_found`` (PostgreSQL's 32-bit
    ``Integer`` columns refused the comparison: a 500)."""
    admin, ws = env
    r = await ws.post(R, json={"path": "v.md", "content": "one\n"})
    assert r.status_code == 201, r.text
    rid = r.json()["id"]
    _problem(await ws.get(f"{R}/{rid}/versions/{n}"), 404, "version_not_found")
    _problem(await ws.post(f"{R}/{rid}/restore", json={"version": n}), 404, "version_not_found")
    _problem(await admin.post(f"{R}/{rid}/versions/{n}/redact"), 404, "version_not_found")
    _problem(await ws.get(f"{R}/{rid}/versions/{2**63}"), 422, "validation_error")
    assert (await ws.get(f"{R}/{rid}/versions/1")).json()["content"] == "one\n"


async def _burst(ws: httpx.AsyncClient, method: str, url: str, body, headers: dict[str, str]) -> list[httpx.Response]:
    """``N`` identical requests sent at once (ASGI handlers run the writes in threads)."""
    out: list[httpx.Response] = []

    async def one() -> None:
        out.append(await ws.request(method, url, json=body, headers=headers))

    async with trio.open_nursery() as nursery:
        for _ in range(N):
            nursery.start_soon(one)
    return out


def _one_answer(rs: list[httpx.Response], status: int) -> dict:
    """Every response is the same ``status`` and body; exactly one was not a replay."""
    assert [r.status_code for r in rs] == [status] * N, [(r.status_code, r.text) for r in rs]
    assert len({r.content for r in rs}) == 1
    assert sum(r.headers.get("idempotent-replayed") is None for r in rs) == 1, [dict(r.headers) for r in rs]
    return rs[0].json() if rs[0].content else {}


@pytest.mark.timeout(300)
async def test_one_key_sent_at_once_gets_one_answer(env):
    """PUT with If-Match, append with If-Match, PATCH, move and DELETE, each sent ``N`` times
    at once with one Idempotency-Key: every request gets the first one's answer (none a 412
    or 404 because a twin committed first), and each wrote one version."""
    admin, ws = env
    for rnd in range(3):
        r = await ws.post(R, json={"path": f"c{rnd}.md", "content": "base " * 300 + "\n"})
        assert r.status_code == 201, r.text
        rid, tag = r.json()["id"], r.headers["etag"]
        key = lambda: {"Idempotency-Key": uuid.uuid4().hex}  # noqa: E731
        rec = _one_answer(await _burst(ws, "PUT", f"{R}/{rid}", {"content": "new\n"}, {**key(), "If-Match": tag}), 200)
        assert rec["version"] == 2
        tag = '"' + hashlib.sha256(b"new\n").hexdigest() + '"'
        rec = _one_answer(await _burst(ws, "POST", f"{R}/{rid}/append", {"append": "more\n"},
                                       {**key(), "If-Match": tag}), 200)
        assert rec["version"] == 3 and rec["sha256"] == hashlib.sha256(b"new\nmore\n").hexdigest()
        rec = _one_answer(await _burst(ws, "PATCH", f"{R}/{rid}", {"mode": 0o600},
                                       {**key(), "If-Match": f'"{rec["sha256"]}"'}), 200)
        assert rec["version"] == 4
        moved = _one_answer(await _burst(ws, "POST", f"{R}/{rid}/move", {"path": f"m{rnd}.md"}, key()), 200)
        assert [(m["path"], m["version"]) for m in moved["records"]] == [(f"m{rnd}.md", 5)]
        _one_answer(await _burst(ws, "DELETE", f"{R}/{rid}", None, key()), 204)
        r = await admin.get(f"{R}/{rid}/versions")
        assert [(v["version"], v["operation"]) for v in r.json()] == [
            (1, "created"), (2, "modified"), (3, "modified"), (4, "modified"), (5, "moved"), (6, "deleted")]


async def test_a_refusal_after_its_twin_committed_replays_the_twin(env, monkeypatch):
    """The window of the burst above made certain, on either database: the key's check finds
    nothing (as when it ran before the twin committed), then the write is refused because the
    twin changed the record (412). The request gets the twin's stored answer; a request of
    another body with that key gets 422 ``idempotency_key_reused``, and a keyed request no
    twin answered keeps its refusal."""
    from memfuse.server.base import Writer

    admin, ws = env
    r = await ws.post(R, json={"path": "t.md", "content": "one\n"})
    rid, tag = r.json()["id"], r.headers["etag"]
    headers = {"Idempotency-Key": "k-twin", "If-Match": tag}
    first = await ws.put(f"{R}/{rid}", json={"content": "two\n"}, headers=headers)
    assert first.status_code == 200, first.text
    monkeypatch.setattr(Writer, "idem_lookup", lambda self, conn, p, idem: None)
    again = await ws.put(f"{R}/{rid}", json={"content": "two\n"}, headers=headers)
    assert again.status_code == 200, again.text
    assert again.content == first.content and again.headers["idempotent-replayed"] == "true"
    _problem(await ws.put(f"{R}/{rid}", json={"content": "three\n"}, headers=headers), 422, "idempotency_key_reused")
    _problem(await ws.put(f"{R}/{rid}", json={"content": "two\n"}, headers={"Idempotency-Key": "k-new", "If-Match": tag}),
             412, "precondition_failed")
    assert [v["version"] for v in (await admin.get(f"{R}/{rid}/versions")).json()] == [1, 2]
