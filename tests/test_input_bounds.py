"""Hostile input to the control plane is refused where it comes in, never a 500: integers past
64 bits in paths, queries and bodies (versions, feed positions, limits), lone surrogates in
memory-tool parameters, out-of-range versions in the memory tool and over MCP; the OpenAPI
document states every integer bound the server enforces; an MCP tool that fails inside is a
tool result with ``isError``, never a protocol error carrying the exception's text.

In-process (``httpx.ASGITransport``) on SQLite (whose INTEGER is 64-bit: the first to break),
and on PostgreSQL when ``MEMFUSE_TEST_PG`` names one (tests/pgutil.py).
"""
from __future__ import annotations

import json

import httpx
import pytest

from memfuse.defs import INT64_MAX
from memfuse.models import RecordCreate, RecordUpdate, WorkspaceCreate
from memfuse.server.app import create_app
from memfuse.server.service import Principal
from pgutil import fresh_db_url

ADMIN, WS = "bounds-admin", "bounds-ws"
BIG = 2 ** 70
P = Principal(None)


@pytest.fixture
async def env():
    with fresh_db_url() as url:
        app = create_app(url, static_tokens={ADMIN: None, WS: "ws"})
        svc = app.state.service
        svc.create_workspace(P, WorkspaceCreate(name="ws"))
        rid = json.loads(svc.create_record(P, "ws", RecordCreate(path="a.md", content="one\n", type="user")).body)["id"]
        svc.update_record(P, "ws", rid, RecordUpdate(content="two\n"))
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                         headers={"Authorization": f"Bearer {ADMIN}"}) as c:
                yield app, c, rid
        svc.db.dispose()


def assert_422(r: httpx.Response, where: str) -> None:
    assert r.status_code == 422, (r.status_code, r.text)
    assert r.headers["content-type"] == "application/problem+json"
    body = r.json()
    assert body["code"] == "validation_error" and where in body["detail"], body


async def test_integers_past_64_bits_are_422(env):
    app, c, rid = env
    for n in (BIG, INT64_MAX + 1, -BIG, 0):
        assert_422(await c.get(f"/v1/stores/ws/records/{rid}/versions/{n}"), "path.n")
        assert_422(await c.post(f"/v1/stores/ws/records/{rid}/versions/{n}/redact"), "path.n")
        assert_422(await c.post(f"/v1/stores/ws/records/{rid}/restore", json={"version": n}), "body.version")
    for after in (BIG, INT64_MAX + 1, -1):
        for q in ("", "&wait=1", "&wait=1&stream=true"):  # the long-poll fast path too
            assert_422(await c.get(f"/v1/stores/ws/changes?after={after}{q}"), "query.after")
            assert_422(await c.get(f"/v1/workspaces/ws/events?after={after}{q}"), "query.after")
    for field in ("max_records", "max_store_bytes", "max_record_bytes"):
        assert_422(await c.post("/v1/stores", json={"slug": "big", field: BIG}), f"body.{field}")
        assert_422(await c.patch("/v1/stores/ws", json={field: BIG}), f"body.{field}")
    r = await c.post("/v1/stores/ws/batch", json={"operations": [
        {"op": "update", "record_id": rid, "body": {"content": "x\n", "mtime_ns": BIG}}]})
    assert r.status_code == 200 and r.json()["results"][0]["status"] == 422, r.text  # per operation
    # the largest allowed values are fine: a version that does not exist is 404, a cursor
    # beyond the feed 410, as before
    r = await c.get(f"/v1/stores/ws/records/{rid}/versions/{INT64_MAX}")
    assert r.status_code == 404 and r.json()["code"] == "version_not_found"
    r = await c.get(f"/v1/stores/ws/changes?after={INT64_MAX}")
    assert r.status_code == 410
    r = await c.get(f"/v1/workspaces/ws/events?after={INT64_MAX}")
    assert r.status_code == 200
    # the service itself (console, memory tool) answers 404 for an impossible version
    with pytest.raises(Exception) as err:
        app.state.service.get_version(P, "ws", rid, BIG)
    assert getattr(err.value, "status", None) == 404


async def test_memory_tool_hostile_parameters(env):
    app, c, rid = env
    h = {"Authorization": f"Bearer {WS}"}
    url = "/v1/workspaces/ws/memory-tool"
    for version in (BIG, -1, 0, INT64_MAX + 1):
        r = await c.post(url, headers=h, json={"command": "history", "path": "/memories/ws/a.md", "version": version})
        assert r.status_code == 200 and r.json()["is_error"] is True, r.text
        assert "must be an integer from 1" in r.json()["content"]
    r = await c.post(url, headers=h, json={"command": "history", "path": "/memories/ws/a.md", "version": 1})
    assert r.status_code == 200 and "one" in r.json()["content"]
    # a lone surrogate (JSON "\ud800") has no UTF-8 form: in a path (or any name) 422 ...
    for body in (b'{"command": "view", "path": "/memories/ws/\\ud800.md"}',
                 b'{"command": "create", "path": "/memories/ws/\\udfff", "file_text": "x"}',
                 b'{"command": "rename", "old_path": "/memories/ws/a.md", "new_path": "/memories/ws/\\ud800"}',
                 b'{"command": "view", "path": "/memories", "\\ud800": 1}'):
        r = await c.post(url, headers={**h, "Content-Type": "application/json"}, content=body)
        assert_422(r, "lone surrogate")
    # ... in text, the tool refuses the content (EILSEQ), as a result, never a 500
    for body in (b'{"command": "str_replace", "path": "/memories/ws/a.md", "old_str": "\\ud800", "new_str": "y"}',
                 b'{"command": "str_replace", "path": "/memories/ws/a.md", "old_str": "two", "new_str": "\\ud800"}',
                 b'{"command": "insert", "path": "/memories/ws/a.md", "insert_line": 1, "insert_text": "\\udc00"}',
                 b'{"command": "create", "path": "/memories/ws/s.md", "file_text": "x\\ud800"}'):
        r = await c.post(url, headers={**h, "Content-Type": "application/json"}, content=body)
        assert r.status_code == 200 and r.json()["is_error"] is True, (body, r.status_code, r.text)
    assert (await c.get(f"/v1/stores/ws/records/{rid}")).json()["content"] == "two\n"


async def _mcp(c: httpx.AsyncClient, method: str, params: dict, rid: int = 1) -> dict:
    h = {"Authorization": f"Bearer {WS}", "Accept": "application/json, text/event-stream"}
    r = await c.post("/mcp", headers=h, json={"jsonrpc": "2.0", "id": rid, "method": method, "params": params})
    assert r.status_code == 200, r.text
    return r.json()


async def test_mcp_tool_errors_are_tool_results(env, monkeypatch, caplog):
    app, c, rid = env
    init = await _mcp(c, "initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                        "clientInfo": {"name": "t", "version": "1"}})
    assert "result" in init
    for version in (BIG, -BIG, "7", 1.5):
        out = await _mcp(c, "tools/call", {"name": "memory_history",
                                           "arguments": {"path": "/memories/ws/a.md", "version": version}})
        assert "error" not in out and out["result"]["isError"] is True, out
    # a failure inside the server (the database gone, a bug): a tool result without the
    # exception's text, logged
    from memfuse.server import memtool

    def broken(self, *a, **kw):
        raise RuntimeError("internal detail /var/lib/secret-path")

    monkeypatch.setattr(memtool.MemoryTool, "run", broken)
    out = await _mcp(c, "tools/call", {"name": "memory_view", "arguments": {"path": "/memories"}})
    assert "error" not in out, out
    assert out["result"]["isError"] is True
    text = json.dumps(out)
    assert "secret-path" not in text and "RuntimeError" not in text
    assert "memory tool memory_view failed (RuntimeError)" in caplog.text


async def test_json_nested_too_deep_is_a_parse_error_on_every_face(env, caplog):
    """A body nested deeper than the JSON parser recurses (``[`` x 100,000) is refused as a
    parse error where it comes in, never a 500 with a traceback: /mcp answers JSON-RPC's
    -32700 (400), the record and batch routes 422 (attack 13 F4)."""
    app, c, rid = env
    deep = b"[" * 100_000 + b"]" * 100_000
    h = {"Authorization": f"Bearer {WS}", "Accept": "application/json, text/event-stream",
         "Content-Type": "application/json"}
    r = await c.post("/mcp", headers=h, content=deep)
    assert r.status_code == 400, (r.status_code, r.text[:300])
    assert r.json()["error"]["code"] == -32700, r.text[:300]
    for url in ("/v1/stores/ws/records", "/v1/stores/ws/batch", "/v1/workspaces/ws/memory-tool"):
        r = await c.post(url, headers=h, content=deep)
        assert r.status_code == 422, (url, r.status_code, r.text[:300])
        assert r.json()["code"] == "validation_error", (url, r.text[:300])
    assert "Traceback" not in caplog.text and "RecursionError" not in caplog.text
    # the face still works afterwards
    init = await _mcp(c, "initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                        "clientInfo": {"name": "t", "version": "1"}})
    assert "result" in init


async def test_an_integer_too_long_to_parse_is_422_on_every_record_route(env, caplog):
    """An integer of more than 4,300 digits (Python's bound on parsing one) in a JSON body is
    a 422 ``validation_error`` (``json_invalid``) on the single-record routes as on the batch
    route; FastAPI alone answered it 400 ``http_error`` (attack24)."""
    app, c, rid = env
    big = "9" * 5000
    h = {"Content-Type": "application/json"}
    for url, body in (("/v1/stores/ws/records", '{"path": "b.md", "content": "x", "mode": %s}' % big),
                      (f"/v1/stores/ws/records/{rid}", '{"content": "x", "mtime_ns": %s}' % big),
                      (f"/v1/stores/ws/records/{rid}/append", '{"content": "x", "mode": %s}' % big),
                      (f"/v1/stores/ws/records/{rid}/restore", '{"version": %s}' % big),
                      ("/v1/stores/ws/batch", '{"operations": [{"op": "create", "path": "b.md", '
                                              '"content": "x", "mode": %s}]}' % big)):
        method = "PUT" if url.endswith(rid) else "POST"
        r = await c.request(method, url, headers=h, content=body)
        assert_422(r, "body")
        assert r.json()["errors"][0]["type"] == "json_invalid", r.text
        assert "4300" in r.json()["detail"], r.text
    # nothing was written
    r = await c.get(f"/v1/stores/ws/records/{rid}")
    assert r.json()["content"] == "two\n" and r.json()["version"] == 2
    assert "Traceback" not in caplog.text


async def test_openapi_states_every_integer_bound(env):
    """Every integer parameter and body field in /openapi.json has a minimum and a maximum
    (no larger than 64 bits), so a client generated from it and the server agree."""
    app, c, rid = env
    doc = (await c.get("/openapi.json")).json()
    schemas = doc["components"]["schemas"]
    request_models = set()
    missing = []

    def check(schema: dict, where: str) -> None:
        if "$ref" in schema:
            return
        for alt in schema.get("anyOf", []) + schema.get("oneOf", []):
            check(alt, where)
        if schema.get("type") == "integer":
            lo = schema.get("minimum", schema.get("exclusiveMinimum"))
            hi = schema.get("maximum", schema.get("exclusiveMaximum"))
            if lo is None or hi is None or hi > INT64_MAX or lo < -INT64_MAX - 1:
                missing.append(where)

    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            for prm in op.get("parameters", []):
                check(prm.get("schema", {}), f"{method.upper()} {path} {prm['in']}.{prm['name']}")
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
            ref = body.get("$ref", "")
            if ref:
                request_models.add(ref.rsplit("/", 1)[1])

    def walk_model(name: str, seen: set[str]) -> None:
        if name in seen:
            return
        seen.add(name)
        for field, schema in schemas[name].get("properties", {}).items():
            check(schema, f"{name}.{field}")
            for ref in json.dumps(schema).split('"$ref": "')[1:]:
                walk_model(ref.split('"', 1)[0].rsplit("/", 1)[1], seen)

    seen: set[str] = set()
    for name in request_models:
        walk_model(name, seen)
    assert {"Restore", "StoreCreate", "StoreUpdate", "RecordCreate"} <= seen
    assert not missing, missing


async def test_a_store_never_allows_records_larger_than_one_request_carries(env):
    """``max_record_bytes`` past what the front door takes in one request (its body bound:
    a record's JSON body may be six times its size, ``memfuse.defs.largest_record``) is 422
    ``invalid_limit`` at create and update, with nothing changed; the largest allowed is
    taken, and a record of that size made of escaped characters (every byte a newline or a
    quote, the body twice the record) is written through the front door. Attack 12 A2: 64 MiB
    was accepted, and every record past 16 MiB then met 413 before the server read it."""
    from memfuse.defs import MAX_RECORD_BYTES, RECORD_BODY_MAX, largest_record, record_body_bound

    app, c, rid = env
    assert largest_record(RECORD_BODY_MAX) == MAX_RECORD_BYTES == 8 << 20
    assert record_body_bound(MAX_RECORD_BYTES) == RECORD_BODY_MAX == app.front.max_body
    for too_big in (MAX_RECORD_BYTES + 1, 64 << 20):
        for r in (await c.post("/v1/stores", json={"slug": "big", "max_record_bytes": too_big}),
                  await c.patch("/v1/stores/ws", json={"max_record_bytes": too_big})):
            assert r.status_code == 422 and r.json()["code"] == "invalid_limit", r.text
            assert str(MAX_RECORD_BYTES) in r.json()["detail"]
    assert (await c.get("/v1/stores/big")).status_code == 404
    assert (await c.get("/v1/stores/ws")).json()["max_record_bytes"] == 1 << 20
    r = await c.patch("/v1/stores/ws", json={"max_record_bytes": MAX_RECORD_BYTES, "max_store_bytes": 64 << 20})
    assert r.status_code == 200 and r.json()["max_record_bytes"] == MAX_RECORD_BYTES, r.text
    r = await c.post("/v1/stores", json={"slug": "big", "max_record_bytes": MAX_RECORD_BYTES})
    assert r.status_code == 201, r.text
    content = '"\n' * (MAX_RECORD_BYTES // 2)
    body = json.dumps({"path": "big.md", "content": content, "type": "user"}).encode()
    assert len(body) > 2 * MAX_RECORD_BYTES - 100
    r = await c.post("/v1/stores/ws/records", content=body,
                     headers={"Authorization": f"Bearer {WS}", "Content-Type": "application/json"})
    assert r.status_code == 201, r.text[:300]
    assert r.json()["size"] == MAX_RECORD_BYTES
