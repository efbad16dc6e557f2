"""Every valid record of a store's ``max_record_bytes`` fits in one request on every write route
(verifier N1 of session 12; docs/API.md "A record fits in one request"): the body bound of the
front door (``memfuse serve --max-body``) and the store's largest record are one rule
(``memfuse.defs.record_body_bound`` / ``largest_record``), and that rule counts the true worst
case of a JSON (or form) encoder: a control character escaped as ``\\u00XX``, six bytes for
one. A record made only of ``\\x01`` at exactly ``max_record_bytes`` is written through the
front door by create, PUT, append, batch, the memory tool, the Anthropic memory-store API and
``memfuse import``; one byte more is the store's refusal (413 ``record_too_large``, read by
the app: the body was taken), never the front door's ``too_large``.

On main (a rule of twice the record) every one of these writes was refused 413 ``too_large``
before the server read it, although the record was within the store's limit.

In-process (``httpx.ASGITransport`` through the front door, ``memfuse.server.gate``) with a
small body bound so the worst case costs little. The mount's path (the sidecar's lean
client) is tests/test_big_records_mount.py.
"""
from __future__ import annotations

import json
import sys
from urllib.parse import quote_plus

import httpx
import msgspec
import pytest

from memfuse.client import ApiClient
from memfuse.defs import RECORD_BODY_GROWTH, largest_record, record_body_bound
from memfuse.models import WorkspaceCreate
from memfuse.server.app import create_app
from memfuse.server.service import Principal
from memfuse.transfer import import_files
from pgutil import fresh_db_url

ADMIN, WS = "bound-admin", "bound-ws"
N = 64 * 1024  # the store's max_record_bytes
BODY = record_body_bound(N)  # the front door's bound that admits it
WORST = "\x01"  # escaped as \u0001 by every JSON encoder: six bytes for one


@pytest.fixture
async def env():
    with fresh_db_url() as url:
        app = create_app(url, static_tokens={ADMIN: None, WS: "ws"}, max_body=BODY)
        svc = app.state.service
        svc.create_workspace(Principal(None), WorkspaceCreate(name="ws"))
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                         headers={"Authorization": f"Bearer {WS}"}) as c:
                r = await c.patch("/v1/stores/ws", json={"max_record_bytes": N},
                                  headers={"Authorization": f"Bearer {ADMIN}"})
                assert r.status_code == 200 and r.json()["max_record_bytes"] == N, r.text
                yield app, c
        svc.db.dispose()


async def _post(c: httpx.AsyncClient, method: str, url: str, body: dict, **headers: str) -> httpx.Response:
    """``body`` as a third-party client encodes it (Python's ``json.dumps``: ASCII only, a
    control character as ``\\u00XX``), sent through the front door."""
    raw = json.dumps(body).encode()
    return await c.request(method, url, content=raw, headers={"Content-Type": "application/json", **headers})


def _ok(r: httpx.Response, status: int = 200) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    return r.json()


def _refused(r: httpx.Response) -> None:
    """One byte over the store's limit: the app read the body and refused the record (413
    ``record_too_large``), not the front door (``too_large``, from the declared length)."""
    assert r.status_code == 413 and r.json()["code"] == "record_too_large", (r.status_code, r.text[:300])


def test_the_rule_counts_the_true_worst_case_of_every_encoder():
    """No character grows more than ``RECORD_BODY_GROWTH``-fold (per UTF-8 byte) in the
    encoders clients use: Python's ``json.dumps`` (ASCII only, or not), msgspec (the
    sidecar's and the CLI's), a form's percent-encoding; and a control character reaches it
    (the rule is the worst case, not a guess)."""
    most = 0.0
    for cp in range(sys.maxunicode + 1):
        if 0xD800 <= cp <= 0xDFFF:
            continue  # lone surrogates are not UTF-8 (refused 422 invalid_content)
        ch = chr(cp)
        n = len(ch.encode())
        for size in (len(json.dumps(ch)) - 2, len(json.dumps(ch, ensure_ascii=False).encode()) - 2,
                     len(msgspec.json.encode(ch)) - 2, len(quote_plus(ch))):
            most = max(most, size / n)
    assert most == RECORD_BODY_GROWTH == 6
    assert record_body_bound(N) == RECORD_BODY_GROWTH * N + 64 * 1024 and largest_record(BODY) == N


async def test_create_and_put_take_the_worst_record_at_the_limit(env):
    app, c = env
    body = json.dumps({"path": "c.txt", "content": WORST * N}).encode()
    assert len(body) > RECORD_BODY_GROWTH * N  # the worst case indeed
    rec = _ok(await _post(c, "POST", "/v1/stores/ws/records", {"path": "c.txt", "content": WORST * N}), 201)
    assert rec["size"] == N
    _refused(await _post(c, "POST", "/v1/stores/ws/records", {"path": "d.txt", "content": WORST * (N + 1)}))
    small = _ok(await _post(c, "POST", "/v1/stores/ws/records", {"path": "p.txt", "content": "x"}), 201)
    up = _ok(await _post(c, "PUT", f"/v1/stores/ws/records/{small['id']}", {"content": WORST * N}))
    assert up["size"] == N
    _refused(await _post(c, "PUT", f"/v1/stores/ws/records/{small['id']}", {"content": WORST * (N + 1)}))


async def test_append_takes_the_worst_suffix_up_to_the_limit(env):
    app, c = env
    r = await _post(c, "POST", "/v1/stores/ws/records", {"path": "a.txt", "content": ""})
    rec = _ok(r, 201)
    etag = r.headers["etag"]
    r = await _post(c, "POST", f"/v1/stores/ws/records/{rec['id']}/append", {"append": WORST * N}, **{"If-Match": etag})
    assert _ok(r)["size"] == N
    r2 = await _post(c, "POST", "/v1/stores/ws/records", {"path": "b.txt", "content": ""})
    b = _ok(r2, 201)
    _refused(await _post(c, "POST", f"/v1/stores/ws/records/{b['id']}/append", {"append": WORST * (N + 1)},
                         **{"If-Match": r2.headers["etag"]}))


async def test_a_batch_takes_the_worst_record_at_the_limit(env):
    app, c = env
    statuses = []
    for path, n in (("b.txt", N), ("b2.txt", N + 1)):  # a batch holds any one record
        r = await _post(c, "POST", "/v1/stores/ws/batch", {"operations": [
            {"op": "create", "body": {"path": path, "content": WORST * n}},
            {"op": "create", "body": {"path": path + ".md", "content": "small"}}]})
        statuses.append([(x["status"], (x["body"] or {}).get("code")) for x in _ok(r)["results"]])
    assert statuses == [[(201, None), (201, None)], [(413, "record_too_large"), (201, None)]], statuses


async def test_the_memory_tool_takes_the_worst_record_at_the_limit(env):
    app, c = env
    r = _ok(await _post(c, "POST", "/v1/workspaces/ws/memory-tool",
                        {"command": "create", "path": "/memories/ws/t.txt", "file_text": WORST * N}))
    assert r["is_error"] is False, r
    r = _ok(await _post(c, "POST", "/v1/workspaces/ws/memory-tool",
                        {"command": "create", "path": "/memories/ws/u.txt", "file_text": WORST * (N + 1)}))
    assert r["is_error"] is True, r


async def test_the_anthropic_memory_store_api_takes_the_worst_record_at_the_limit(env):
    app, c = env
    url = "/v1/memory_stores/memstore_ws/memories"
    m = _ok(await _post(c, "POST", url, {"path": "/m.txt", "content": WORST * N}))
    assert m["content_size_bytes"] == N
    small = _ok(await _post(c, "POST", url, {"path": "/s.txt", "content": "x"}))
    assert _ok(await _post(c, "POST", f"{url}/{small['id']}", {"content": WORST * N}))["content_size_bytes"] == N
    for method, where, body in (("POST", url, {"path": "/o.txt", "content": WORST * (N + 1)}),
                                ("POST", f"{url}/{small['id']}", {"content": WORST * (N + 1)})):
        r = await _post(c, method, where, body)
        err = r.json()["error"]
        assert r.status_code == 413 and err["type"] == "request_too_large", r.text[:300]
        assert "(record_too_large)" in err["message"], err  # the store's refusal, not the front door's


async def test_import_takes_the_worst_record_at_the_limit(env, tmp_path):
    app, c = env
    (tmp_path / "at.txt").write_bytes(WORST.encode() * N)
    async with ApiClient("http://t", WS, transport=httpx.ASGITransport(app=app), instance="imp") as api:
        report = await import_files(api, "ws", [("at.txt", tmp_path / "at.txt")], False, lambda _: None)
    assert report.refused == [] and len(report.done) == 1, report
    r = _ok(await c.get("/v1/stores/ws/records", params={"path": "at.txt", "content": "true"}))
    assert r["records"][0]["size"] == N


async def test_a_batch_holds_the_largest_record_of_a_larger_body_bound(tmp_path):
    """A batch's own bound is the front door's (``--max-body``), not the default's: under a
    bound past the default (stores of 9 MiB records) a batch carrying one such record of
    control characters (a 54 MiB body) is taken. On main it was ``BATCH_MAX_BYTES`` (the
    default bound): 413 ``batch_too_large``."""
    from memfuse.defs import RECORD_BODY_MAX

    n = 9 << 20
    with fresh_db_url() as url:
        app = create_app(url, static_tokens={ADMIN: None, WS: "ws"}, max_body=record_body_bound(n), faces=False)
        svc = app.state.service
        svc.create_workspace(Principal(None), WorkspaceCreate(name="ws"))
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                         headers={"Authorization": f"Bearer {ADMIN}"}) as c:
                _ok(await c.patch("/v1/stores/ws", json={"max_record_bytes": n, "max_store_bytes": 64 << 20}))
                raw = json.dumps({"operations": [{"op": "create", "body": {"path": "b.txt", "content": WORST * n}}]})
                assert len(raw) > RECORD_BODY_MAX
                r = await c.post("/v1/stores/ws/batch", content=raw, headers={"Content-Type": "application/json"})
                results = _ok(r)["results"]
                assert [x["status"] for x in results] == [201], results
        svc.db.dispose()


async def test_mcp_takes_the_worst_record_of_a_default_store():
    """``/mcp``'s tools write records, so its body bound is the record writes' (at least the
    rule's): ``memory_create`` of a default store's largest record (1 MiB) of control
    characters, a 6 MiB body, is taken; one byte more is the tool's refusal. On main /mcp
    took 4 MiB: 413 before the server read it."""
    from memfuse.defs import DEFAULT_MAX_RECORD_BYTES as n

    h = {"Authorization": f"Bearer {WS}", "Accept": "application/json, text/event-stream"}

    async def call(c: httpx.AsyncClient, path: str, text: str) -> dict:
        body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                "params": {"name": "memory_create", "arguments": {"path": path, "file_text": text}}}
        r = await _post(c, "POST", "/mcp", body, **h)
        return _ok(r)["result"]

    with fresh_db_url() as url:
        app = create_app(url, static_tokens={ADMIN: None, WS: "ws"})
        svc = app.state.service
        svc.create_workspace(Principal(None), WorkspaceCreate(name="ws"))
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                init = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
                    "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
                _ok(await _post(c, "POST", "/mcp", init, **h))
                got = await call(c, "/memories/ws/m.txt", WORST * n)
                assert got["isError"] is False, got
                assert svc.get_store(Principal(None), "ws").max_record_bytes == n
                got = await call(c, "/memories/ws/o.txt", WORST * (n + 1))
                assert got["isError"] is True, got
                r = _ok(await c.get("/v1/stores/ws/records", params={"path": "m.txt"},
                                    headers={"Authorization": f"Bearer {WS}"}))
                assert [x["size"] for x in r["records"]] == [n]
        svc.db.dispose()
