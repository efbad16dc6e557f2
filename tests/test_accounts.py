"""Accounts (docs/API.md "Accounts"): the root admin makes accounts and account admins; an
account admin, and every token of an account, sees and changes only its account.

The isolation probe tries every endpoint of every face — the v1 API and the Anthropic-
compatible API (from the app's OpenAPI document), the memory tool, the console and MCP (from
the route table) — as account ``alpha``'s principals against account ``bravo``'s objects,
and each time the same request naming a missing object: the two answers must be the same
refusal (a ``bravo`` object is indistinguishable from no object), ``bravo``'s data never
appears in an answer and is unchanged afterwards. A route that is neither probed nor listed in
``ACCOUNT_FREE`` fails the test, so a new endpoint cannot skip it. Runs on SQLite, and on
PostgreSQL through ``tests/test_postgres.py``.
"""
from __future__ import annotations

import json
import re
import shutil
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest
from fastapi.routing import APIRoute
from starlette.routing import Mount, Route

from sqlalchemy import text

from memfuse.models import sha256_hex
from memfuse.server import schema
from memfuse.server.anthropic_api import memory_id, version_id
from memfuse.server.app import create_app
from memfuse.server.db import Database
from memfuse.server.memstores import store_id
from pgutil import fresh_db_url

ROOT = "accounts-root-token"
BASE = "http://t"
SECRET = "BRAVO-SECRET-CONTENT"
# what must never appear in an answer to alpha: bravo's names and content
BRAVO_MARKS = ("bravo-notes", "bravo-ws", "bravo-shared", SECRET)
# a store both accounts have (bravo made it first: its key is ``notes``, alpha's
# ``notes~alpha``; memfuse.server.keys), and what must never show: a key that is not a name
SAME = "notes"
KEY_MARKS = ("~alpha", "~bravo")
# a workspace both accounts have (bravo's first: its key is ``agent``, alpha's ``agent~alpha``)
SAME_WS = "agent"

# Routes with no account's object in them, each with why (the probe fails on any other route
# it does not probe).
ACCOUNT_FREE = {
    "/openapi.json": "the API description",
    "/docs": "API docs page", "/docs/oauth2-redirect": "API docs page", "/redoc": "API docs page",
    "/.well-known/oauth-protected-resource/mcp": "MCP resource metadata (static)",
    "/ui/login": "console login form", "/ui/login/{code}": "one-time login link",
    "/ui/logout": "ends the caller's own session", "/ui/static": "console assets",
}

# routes that answer 200 with the refusal in the body: the memory tool (``is_error``), the
# console's live page (a ``gone`` event)
REFUSED_IN_BODY = {"/v1/workspaces/{ws}/memory-tool", "/ui/stores/{store}/live"}

# a body that passes validation for each route that takes one (keyed by method and path
# template; a new route with a body needs an entry, or the probe fails)
BODIES: dict[tuple[str, str], object] = {
    ("POST", "/v1/accounts"): {"slug": "probe-acct"},
    ("PATCH", "/v1/accounts/{account}"): {"max_stores": 0, "max_bytes": None},
    ("POST", "/v1/workspaces"): {"name": "probe-ws", "default_store": False},
    ("POST", "/v1/stores"): {"slug": "probe-store"},
    ("PATCH", "/v1/stores/{store}"): {"description": "changed by alpha"},
    ("PUT", "/v1/workspaces/{ws}/attachments/{store}"): {"access": "read_write"},
    ("PUT", "/v1/accounts/{account}/attachments/{store}"): {"access": "read_write"},
    ("POST", "/v1/tokens"): {"workspace": "{ws}"},
    ("POST", "/v1/stores/{store}/records"): {"path": "probe.md", "content": "x\n", "type": "user"},
    ("PUT", "/v1/stores/{store}/records/{record_id}"): {"content": "overwritten\n", "type": "user"},
    ("PATCH", "/v1/stores/{store}/records/{record_id}"): {"mode": 0o600},
    ("POST", "/v1/stores/{store}/records/{record_id}/append"): {"append": "appended\n", "type": "user"},
    ("POST", "/v1/stores/{store}/records/{record_id}/move"): {"path": "moved.md"},
    ("POST", "/v1/stores/{store}/move"): {"from_prefix": "a", "to_prefix": "b"},
    ("POST", "/v1/stores/{store}/records/{record_id}/restore"): {"version": 1},
    ("POST", "/v1/stores/{store}/batch"): {"operations": [
        {"op": "update", "record_id": "{record_id}", "body": {"content": "batched\n", "type": "user"}}]},
    ("POST", "/v1/workspaces/{ws}/memory-tool"): {"command": "view", "path": "/memories/{store}/a.md"},
    ("POST", "/v1/stores/{store}/consolidations"): {"instructions": "tidy", "output": "new_store"},
    ("POST", "/v1/memory_stores"): {"name": "probe", "description": ""},
    ("POST", "/v1/memory_stores/{memory_store_id}"): {"description": "changed"},
    ("POST", "/v1/memory_stores/{memory_store_id}/memories"): {"path": "/probe.md", "content": "x"},
    ("POST", "/v1/memory_stores/{memory_store_id}/memories/{memory_id}"): {"content": "overwritten"},
}
# console forms (CSRF is not checked for a bearer caller)
FORMS = {
    "/ui/stores": {"slug": "probe-ui"},
    "/ui/account": {"account": "{account}"},
    "/ui/stores/{store}/settings": {"description": "changed"},
    "/ui/stores/{store}/new": {"path": "probe.md", "content": "x", "type": "user"},
    "/ui/stores/{store}/records/{rid}/edit": {"content": "overwritten", "type": "user"},
    "/ui/workspaces": {"name": "probe-ui-ws"},
    "/ui/workspaces/{ws}/attachments": {"store": "{store}", "access": "read_write"},
}


def _client(app, token: str, **headers: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE,
                             headers={"Authorization": f"Bearer {token}", **headers})


async def _ok(r: httpx.Response, status: int = 200) -> dict:
    assert r.status_code == status, (r.request.method, r.request.url, r.text)
    return r.json() if r.content else {}


@pytest.fixture
async def world():
    """Accounts alpha and bravo with the same shape: an account admin, a workspace (with its
    own store), a store ``<account>-notes`` attached to it holding ``a.md`` (two versions),
    a store ``notes`` (the same name in both; bravo's first) attached to it holding
    ``same.md`` (bravo's holds ``SECRET``), a workspace token, an account-wide attachment,
    and a workspace ``agent`` (the same name in both; bravo's first) with ``notes`` and
    ``<account>-notes`` attached, a token of its own and a record it wrote in ``notes``."""
    with fresh_db_url() as url:
        app = create_app(url, static_tokens={ROOT: None}, faces=True)
        async with app.router.lifespan_context(app):
            async with _client(app, ROOT) as root:
                ids: dict[str, dict] = {}
                for acct in ("bravo", "alpha"):
                    await _ok(await root.post("/v1/accounts", json={"slug": acct}), 201)
                    adm = await _ok(await root.post("/v1/tokens", json={"account": acct, "name": "adm"}), 201)
                    assert adm["account"] == acct and adm["workspace"] is None
                    async with _client(app, adm["token"]) as a:
                        ws, notes = f"{acct}-ws", f"{acct}-notes"
                        w = await _ok(await a.post("/v1/workspaces", json={"name": ws}), 201)
                        assert w["account"] == acct
                        await _ok(await a.post("/v1/stores", json={"slug": notes}), 201)
                        await _ok(await a.put(f"/v1/workspaces/{ws}/attachments/{notes}", json={}))
                        content = SECRET if acct == "bravo" else "alpha content"
                        rec = await _ok(await a.post(f"/v1/stores/{notes}/records", json={
                            "path": "a.md", "content": content + "\n", "type": "user"}), 201)
                        rec = await _ok(await a.put(f"/v1/stores/{notes}/records/{rec['id']}", json={
                            "content": content + " v2\n", "type": "user"}))
                        await _ok(await a.post("/v1/stores", json={"slug": SAME}), 201)
                        await _ok(await a.put(f"/v1/workspaces/{ws}/attachments/{SAME}", json={}))
                        same = await _ok(await a.post(f"/v1/stores/{SAME}/records", json={
                            "path": "same.md", "content": f"{content} in {SAME}\n", "type": "user"}), 201)
                        assert same["store"] == SAME
                        wt = await _ok(await a.post("/v1/tokens", json={"workspace": ws}), 201)
                        assert wt["account"] == acct
                        await _ok(await a.post("/v1/stores", json={"slug": f"{acct}-shared"}), 201)
                        await _ok(await a.put(f"/v1/accounts/{acct}/attachments/{acct}-shared",
                                              json={"access": "read_only"}))
                        job = _finished_job(app, notes)  # a consolidation job of the store
                        w = await _ok(await a.post("/v1/workspaces", json={"name": SAME_WS, "default_store": False}),
                                      201)
                        assert (w["name"], w["account"]) == (SAME_WS, acct)
                        for st in (SAME, notes):
                            att = await _ok(await a.put(f"/v1/workspaces/{SAME_WS}/attachments/{st}", json={}))
                            assert att["workspace"] == SAME_WS
                        at = await _ok(await a.post("/v1/tokens", json={"workspace": SAME_WS}), 201)
                        assert (at["workspace"], at["account"]) == (SAME_WS, acct)
                        async with _client(app, at["token"]) as agent:
                            mine = await _ok(await agent.post(f"/v1/stores/{SAME}/records", json={
                                "path": "agent.md", "content": f"{content} by the agent\n", "type": "user"}), 201)
                            assert mine["updated_by"] == f"ws:{SAME_WS}/api"  # the name, never the key
                        ids[acct] = dict(admin=adm["token"], admin_id=adm["id"], ws_token=wt["token"],
                                         ws_token_id=wt["id"], rid=rec["id"], seq=rec["seq"], ws=ws,
                                         notes=notes, job=job, same_rid=same["id"], same_seq=same["seq"],
                                         same_job=_finished_job(app, _key(app, acct)), agent_token=at["token"],
                                         agent_token_id=at["id"], agent_rid=mine["id"])
                yield app, root, ids
        app.state.service.db.dispose()


def _key(app, account: str, name: str = SAME) -> str:
    """The key of ``account``'s store ``name``, read from the database."""
    with app.state.service.db.read_conn() as conn:
        return conn.execute(text("SELECT slug FROM stores WHERE account = :a AND public_slug = :n"),
                            {"a": account, "n": name}).scalar_one()


def _ws_key(app, account: str, name: str = SAME_WS) -> str:
    """The key of ``account``'s workspace ``name``, read from the database."""
    with app.state.service.db.read_conn() as conn:
        return conn.execute(text("SELECT name FROM workspaces WHERE account = :a AND public_name = :n"),
                            {"a": account, "n": name}).scalar_one()


def _finished_job(app, store: str) -> str:
    """The id of a completed consolidation job of ``store``, written as the runner leaves one
    (this app has no model configured, so none can be started through the API)."""
    import uuid

    from sqlalchemy import insert

    from memfuse.server.db import ConsolidationJobRow, utcnow

    job_id, now = str(uuid.uuid4()), utcnow()
    with app.state.service.db.write_conn() as conn:
        conn.execute(insert(ConsolidationJobRow.__table__).values(
            id=job_id, store=store, status="completed", output="new_store", output_store=None,
            instructions="tidy", model="m", include_history=False, requested_by="admin", scheduled=False,
            created_at=now, started_at=now, finished_at=now, heartbeat_at=now, input_seq=0,
            summary="done", changes="[]"))
    return job_id


async def _bravo_state(app, ids) -> str:
    """Everything bravo holds, as its admin sees it (to compare before and after)."""
    b = ids["bravo"]
    async with _client(app, b["admin"]) as c:
        parts = []
        for path in ("/v1/stores", "/v1/workspaces", "/v1/tokens", f"/v1/workspaces/{b['ws']}/attachments",
                     f"/v1/stores/{b['notes']}/records?content=true",
                     f"/v1/stores/{b['notes']}/records/{b['rid']}/versions", f"/v1/stores/{b['notes']}/consolidations",
                     f"/v1/stores/{SAME}", f"/v1/stores/{SAME}/records?content=true",
                     f"/v1/stores/{SAME}/records/{b['same_rid']}/versions", f"/v1/stores/{SAME}/consolidations"):
            r = await c.get(path)
            assert r.status_code == 200, (path, r.text)
            parts.append(re.sub(r'"(last_used_at|usage_bytes)":[^,}]*', "", r.text))
        return "\n".join(parts)


def _fill(template: str, values: dict[str, str]) -> str:
    return re.sub(r"\{(\w+)(:\w+)?\}", lambda m: values[m.group(1)], template)


def _fill_body(body: object, values: dict[str, str]) -> object:
    return json.loads(_fill(json.dumps(body), values))


def _routes(app) -> list[tuple[str, str, str]]:
    """(face, method, path template) of every route of the app: the OpenAPI document's
    operations, then the route table's (console, MCP, anything outside the document)."""
    out: list[tuple[str, str, str]] = []
    doc = app.openapi()
    for path, ops in doc["paths"].items():
        for method in ops:
            face = "anthropic" if path.startswith("/v1/memory_stores") else "rest"
            out.append((face, method.upper(), path))
    documented = {p for _, _, p in out}
    for r in app.routes:
        if isinstance(r, APIRoute) and r.path in documented:
            continue
        if isinstance(r, Mount):
            for sub in getattr(r, "routes", []) or []:
                path = r.path + sub.path
                for method in sorted((getattr(sub, "methods", None) or {"GET"}) - {"HEAD"}):
                    out.append(("console", method, path))
            if not getattr(r, "routes", None):
                out.append(("static", "GET", r.path))
            continue
        if isinstance(r, Route | APIRoute):
            for method in sorted((r.methods or {"GET"}) - {"HEAD"}):
                out.append(("other", method, r.path))
    return out


def _same_refusal(a: httpx.Response, b: httpx.Response) -> bool:
    """Two answers are the same refusal: the same status and, for a JSON body, the same code
    (problem+json ``code``, Anthropic ``error.type``)."""
    if a.status_code != b.status_code:
        return False
    if a.headers.get("content-type", "").startswith(("application/problem+json", "application/json")):
        ja, jb = a.json(), b.json()
        ca = ja.get("code") if isinstance(ja, dict) else None
        cb = jb.get("code") if isinstance(jb, dict) else None
        if isinstance(ja, dict) and isinstance(ja.get("error"), dict):
            ca, cb = ja["error"].get("type"), (jb.get("error") or {}).get("type")
        if isinstance(ja, dict) and "is_error" in ja:  # the memory tool's result
            ca, cb = ja["is_error"], jb.get("is_error")
        return ca == cb
    return True


def _norm(text: str, bravo: dict[str, str] | None = None, missing: dict[str, str] | None = None) -> str:
    """``text`` with bravo's names replaced by the missing ones, and what differs for other
    reasons left out: the Anthropic API's ``request_id``, the root admin's account switch
    (it lists every account)."""
    if bravo and missing:
        for k in sorted(bravo, key=lambda k: -len(bravo[k])):
            text = text.replace(bravo[k], missing[k])
    text = re.sub(r'<select name="account".*?</select>', "", text, flags=re.S)  # the root's switch lists all
    return re.sub(r'"request_id":"[^"]*"', "", text)


def _no_bravo(r: httpx.Response, what: str) -> None:
    for mark in BRAVO_MARKS:
        assert mark not in r.text, (what, r.status_code, r.text[:500])


async def test_isolation_probe_every_route_of_every_face(world):
    app, root, ids = world
    a, b = ids["alpha"], ids["bravo"]
    before = await _bravo_state(app, ids)
    bravo = dict(store=b["notes"], ws=b["ws"], record_id=b["rid"], rid=b["rid"], token_id=b["ws_token_id"],
                 n="1", account="bravo", memory_store_id=store_id(b["notes"]), memory_id=memory_id(b["rid"]),
                 memory_version_id=version_id(b["seq"]), job_id=b["job"], job=b["job"])
    missing = dict(store="zulu-none", ws="zulu-none", record_id="0" * 8 + "-0000-4000-8000-" + "0" * 12,
                   rid="0" * 8 + "-0000-4000-8000-" + "0" * 12, token_id="0" * 8 + "-0000-4000-8000-" + "0" * 12,
                   n="1", account="zulu-none", memory_store_id=store_id("zulu-none"),
                   memory_id=memory_id("0" * 8 + "-0000-4000-8000-" + "0" * 12), memory_version_id=version_id(1),
                   job_id="0" * 8 + "-0000-4000-8000-" + "0" * 12, job="0" * 8 + "-0000-4000-8000-" + "0" * 12)
    # alpha's own objects of the names bravo's have too: every route must answer with alpha's
    own = dict(store=SAME, ws=SAME_WS, record_id=a["same_rid"], rid=a["same_rid"], token_id=a["ws_token_id"],
               n="1", account="alpha", memory_store_id=store_id(SAME), memory_id=memory_id(a["same_rid"]),
               memory_version_id=version_id(a["same_seq"]), job_id=a["same_job"], job=a["same_job"])
    assert _key(app, "bravo") == SAME and _key(app, "alpha") == f"{SAME}~alpha"
    assert _ws_key(app, "bravo") == SAME_WS and _ws_key(app, "alpha") == f"{SAME_WS}~alpha"
    principals = {
        "alpha admin": _client(app, a["admin"]),
        "alpha workspace": _client(app, a["ws_token"]),
        "alpha agent": _client(app, a["agent_token"]),  # its workspace's key is ``agent~alpha``
        "root acting in alpha": _client(app, ROOT, **{"X-Memfuse-Account": "alpha"}),
    }
    probed: set[str] = set()
    leaks: list[str] = []
    try:
        for face, method, template in _routes(app):
            if template in ACCOUNT_FREE or any(template.startswith(p + "/") for p in ACCOUNT_FREE
                                               if p == "/ui/static"):
                probed.add(template)
                continue
            if face == "other" and template == "/mcp":
                continue  # probed below, tool by tool
            params = set(re.findall(r"\{(\w+)", template))
            if re.search(r"\{\w+\}", json.dumps(BODIES.get((method, template))) + json.dumps(FORMS.get(template))):
                params.add("body")  # the body names bravo's object
            for who, c in principals.items():
                answers = []
                for values in (bravo, missing):
                    url = _fill(template, values)
                    kw: dict = {}
                    if face == "console":
                        if method == "POST":
                            kw["data"] = {k: _fill(v, values) for k, v in FORMS.get(template, {}).items()}
                        kw["follow_redirects"] = False
                    elif method in ("POST", "PUT", "PATCH"):
                        key = (method, template)
                        assert key in BODIES or not _takes_body(app, template, method), (
                            f"no probe body for {method} {template}: add one to BODIES")
                        if key in BODIES:
                            kw["json"] = _fill_body(BODIES[key], values)
                    r = await c.request(method, url, **kw)
                    assert r.status_code < 500, (who, method, url, r.text)
                    answers.append(r)
                    assert SECRET not in r.text, (who, method, url, r.text[:500])
                if "store" in params or "memory_store_id" in params or "job_id" in params or "ws" in params:
                    # alpha's own store and workspace of bravo's names (never a delete: the probe goes on)
                    if method != "DELETE" and not template.endswith("/live"):  # live pages never end
                        url = _fill(template, own)
                        kw = {}
                        if face == "console":
                            if method == "POST":
                                kw["data"] = {k: _fill(v, own) for k, v in FORMS.get(template, {}).items()}
                            kw["follow_redirects"] = False
                        elif (method, template) in BODIES:
                            kw["json"] = _fill_body(BODIES[(method, template)], own)
                        r = await c.request(method, url, **kw)
                        assert r.status_code < 500, (who, method, url, r.text)
                        assert SECRET not in r.text and b["same_rid"] not in r.text, ("own", who, method, url,
                                                                                     r.text[:500])
                        assert not any(m in r.text for m in KEY_MARKS), ("key shown", who, method, url, r.text[:500])
                        _no_bravo(r, f"own: {who} {method} {url}")
                        if method == "GET" and face != "console" and template.startswith("/v1/stores/{store}"):
                            assert r.status_code != 404, (who, url, r.text[:300])  # alpha's own is found
                        if (method == "GET" and face != "console" and template.startswith("/v1/workspaces/{ws}")
                                and who != "alpha workspace"):  # (another workspace of its account: 403)
                            assert r.status_code == 200, (who, url, r.text[:300])  # alpha's own ``agent``
                for r in answers:
                    assert not any(m in r.text for m in KEY_MARKS), ("key shown", who, method, r.url, r.text[:500])
                rb, rm = answers
                if params and rb.status_code >= 400 and rb.status_code != 404:
                    # the status class on every face: another account's object is 404 (REST
                    # ``*_not_found``, Anthropic ``not_found_error``, the console's and the
                    # memory tool's 404), unless the caller gets the same refusal on its own
                    # object (a privilege or a malformed request, decided before any lookup)
                    kw = {}
                    if face == "console":
                        if method == "POST":
                            kw["data"] = {k: _fill(v, own) for k, v in FORMS.get(template, {}).items()}
                        kw["follow_redirects"] = False
                    elif (method, template) in BODIES:
                        kw["json"] = _fill_body(BODIES[(method, template)], own)
                    ro = await c.request(method, _fill(template, own), **kw)
                    if not _same_refusal(rb, ro):
                        leaks.append(f"{who}: {method} {template}: {rb.status_code} {rb.text[:120]!r} for another "
                                     f"account's object, not 404 (own object: {ro.status_code})")
                if not params:  # a listing or a create: nothing of bravo's in it
                    _no_bravo(rb, f"{who} {method} {template}")
                elif any(m in rb.text for m in BRAVO_MARKS):  # only echoes of the request's own names
                    if _norm(rb.text, bravo, missing) != _norm(rm.text):
                        leaks.append(f"{who}: {method} {template}: bravo's answer differs from a missing "
                                     f"object's beyond the names asked: {rb.text[:200]!r} vs {rm.text[:200]!r}")
                if params:
                    if 200 <= rb.status_code < 300 and not (
                            template in REFUSED_IN_BODY and _norm(rb.text, bravo, missing) == _norm(rm.text)):
                        leaks.append(f"{who}: {method} {template} -> {rb.status_code} on bravo's object")
                    if not _same_refusal(rb, rm):
                        leaks.append(f"{who}: {method} {template}: bravo's object {rb.status_code} "
                                     f"{rb.text[:120]!r} vs missing {rm.status_code} {rm.text[:120]!r}")
            probed.add(template)
        # MCP (alpha's workspace token): every tool, naming bravo's store
        mcp = principals["alpha workspace"]
        h = {"Accept": "application/json, text/event-stream"}
        init = await mcp.post("/mcp", headers=h, json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "probe", "version": "1"}}})
        assert init.status_code == 200, init.text
        tools = (await mcp.post("/mcp", headers=h, json={"jsonrpc": "2.0", "id": 2, "method": "tools/list",
                                                         "params": {}})).json()["result"]["tools"]
        assert tools
        for i, tool in enumerate(tools):
            results = []
            for store in (b["notes"], "zulu-none"):
                path = f"/memories/{store}/a.md"
                generic = {"path": path, "old_path": path, "new_path": f"/memories/{store}/z.md",
                           "file_text": "x", "old_str": "v2", "new_str": "y", "insert_line": 0,
                           "insert_text": "y", "query": "v2", "store": store, "version": 1, "fact": "x"}
                args = {k: v for k, v in generic.items() if k in tool["inputSchema"].get("properties", {})}
                r = await mcp.post("/mcp", headers=h, json={"jsonrpc": "2.0", "id": 10 + i, "method": "tools/call",
                                                            "params": {"name": tool["name"], "arguments": args}})
                assert r.status_code == 200, r.text
                assert SECRET not in r.text, (tool["name"], r.text)
                results.append(r.text)
            if results[0].replace(b["notes"], "zulu-none") != results[1]:
                leaks.append(f"MCP {tool['name']}: bravo's store {results[0][:200]!r} vs missing {results[1][:200]!r}")
        for i, tool in enumerate(tools):  # alpha's own ``notes``: never bravo's
            path = f"/memories/{SAME}/same.md"
            generic = {"path": path, "old_path": path, "new_path": f"/memories/{SAME}/z.md",
                       "file_text": "x", "old_str": "alpha", "new_str": "alpha", "insert_line": 0,
                       "insert_text": "y", "query": "content", "store": SAME, "version": 1, "fact": "x"}
            args = {k: v for k, v in generic.items() if k in tool["inputSchema"].get("properties", {})}
            r = await mcp.post("/mcp", headers=h, json={"jsonrpc": "2.0", "id": 100 + i, "method": "tools/call",
                                                        "params": {"name": tool["name"], "arguments": args}})
            assert r.status_code == 200, r.text
            assert SECRET not in r.text and b["same_rid"] not in r.text, (tool["name"], r.text)
            assert not any(m in r.text for m in KEY_MARKS), (tool["name"], r.text)
        probed.add("/mcp")
    finally:
        for c in principals.values():
            await c.aclose()
    assert not leaks, "\n".join(leaks)
    every = {t for _, _, t in _routes(app)}
    assert every - probed == set(), f"routes neither probed nor account-free: {every - probed}"
    assert await _bravo_state(app, ids) == before  # nothing of bravo's changed
    async with _client(app, b["ws_token"]) as c:  # bravo's workspace token still works
        r = await c.get(f"/v1/stores/{b['notes']}/records/{b['rid']}")
        assert r.status_code == 200 and SECRET in r.json()["content"]


def _takes_body(app, template: str, method: str) -> bool:
    op = app.openapi()["paths"].get(template, {}).get(method.lower(), {})
    return "requestBody" in op


async def test_root_and_account_admins(world):
    app, root, ids = world
    a = ids["alpha"]
    # the root admin sees every account's objects; an account admin its own
    names = {s["slug"] for s in (await root.get("/v1/stores")).json()}
    assert {"alpha-notes", "bravo-notes"} <= names
    async with _client(app, a["admin"]) as c:
        assert {s["slug"] for s in (await c.get("/v1/stores")).json()} == {"alpha-notes", "alpha-ws", "alpha-shared",
                                                                           SAME}
        assert {w["name"] for w in (await c.get("/v1/workspaces")).json()} == {"alpha-ws", SAME_WS}
        assert {t["account"] for t in (await c.get("/v1/tokens")).json()} == {"alpha"}
        assert [x["slug"] for x in (await c.get("/v1/accounts")).json()] == ["alpha"]
        # account admins make no accounts and no root tokens
        assert (await c.post("/v1/accounts", json={"slug": "x"})).status_code == 403
        t = await _ok(await c.post("/v1/tokens", json={}), 201)
        assert t["account"] == "alpha"  # an admin token of its own account, never root
        assert (await c.post("/v1/tokens", json={"account": "bravo"})).status_code == 404
    # today's URLs without an account: the default account
    await _ok(await root.post("/v1/workspaces", json={"name": "legacy"}), 201)
    acc = {x["slug"]: x for x in (await root.get("/v1/accounts")).json()}
    assert set(acc) == {"default", "alpha", "bravo"}
    assert acc["default"]["stores"] == 1 and acc["alpha"]["stores"] == 4
    # root acting in an account: creates there
    async with _client(app, ROOT, **{"X-Memfuse-Account": "bravo"}) as c:
        s = await _ok(await c.post("/v1/stores", json={"slug": "bravo-more"}), 201)
        assert s["account"] == "bravo"
        assert (await c.get("/v1/stores/alpha-notes")).status_code == 404
    assert (await root.get("/v1/stores?account=nope")).status_code == 404
    # a store never attaches across accounts, even by the root admin
    r = await root.put("/v1/workspaces/legacy/attachments/alpha-notes", json={})
    assert r.status_code == 404 and r.json()["code"] == "store_not_found"
    # delete: only an empty account
    assert (await root.delete("/v1/accounts/alpha")).json()["code"] == "account_not_empty"
    await _ok(await root.post("/v1/accounts", json={"slug": "empty"}), 201)
    for reserved in ("all", "root"):  # the console's and the CLI's words in an account's place
        r = await root.post("/v1/accounts", json={"slug": reserved})
        assert r.status_code == 409 and "reserved" in r.json()["detail"], r.text
    assert (await root.delete("/v1/accounts/empty")).status_code == 204
    assert (await root.get("/v1/accounts/empty")).status_code == 404
    assert (await root.delete("/v1/accounts/default")).json()["code"] == "default_account"


async def test_account_wide_attachment_reaches_existing_and_new_workspaces(world):
    app, root, ids = world
    a = ids["alpha"]
    async with _client(app, a["admin"]) as c:
        await _ok(await c.post("/v1/workspaces", json={"name": "alpha-2"}), 201)
        await _ok(await c.post("/v1/stores", json={"slug": "alpha-user"}), 201)
        att = await _ok(await c.put("/v1/accounts/alpha/attachments/alpha-user", json={"access": "read_only"}))
        assert att["workspace"] == "*" and att["access"] == "read_only"
        await _ok(await c.post("/v1/workspaces", json={"name": "alpha-3"}), 201)  # made after
        for ws in ("alpha-ws", "alpha-2", "alpha-3"):
            atts = {x["store"]["slug"]: x["access"] for x in (await c.get(f"/v1/workspaces/{ws}/attachments")).json()}
            assert atts.get("alpha-user") == "read_only", (ws, atts)
            assert atts.get(ws) == "read_write" or ws == "alpha-ws"  # beside its own store
            ev = (await c.get(f"/v1/workspaces/{ws}/events?after=0")).json()["events"]
            assert any(e["kind"] == "attached" and e["store"] == "alpha-user" for e in ev)
        # bravo's workspaces are untouched
        assert (await c.put("/v1/accounts/bravo/attachments/alpha-user", json={})).status_code == 404
        assert (await c.delete("/v1/accounts/alpha/attachments/alpha-user")).status_code == 204
        for ws in ("alpha-ws", "alpha-2", "alpha-3"):
            atts = {x["store"]["slug"] for x in (await c.get(f"/v1/workspaces/{ws}/attachments")).json()}
            assert "alpha-user" not in atts
            ev = (await c.get(f"/v1/workspaces/{ws}/events?after=0")).json()["events"]
            assert ev[-1]["kind"] == "detached" and ev[-1]["store"] == "alpha-user"
    async with _client(app, ids["bravo"]["admin"]) as c:
        atts = {x["store"]["slug"] for x in (await c.get("/v1/workspaces/bravo-ws/attachments")).json()}
        assert atts == {"bravo-ws", "bravo-notes", "bravo-shared", SAME}


async def test_quotas_refuse_and_usage_shows(world):
    app, root, ids = world
    await _ok(await root.post("/v1/accounts", json={"slug": "small", "max_stores": 1, "max_bytes": 100,
                                                    "max_tokens": 1}), 201)
    async with _client(app, ROOT, **{"X-Memfuse-Account": "small"}) as c:
        await _ok(await c.post("/v1/stores", json={"slug": "small-a"}), 201)
        r = await c.post("/v1/stores", json={"slug": "small-b"})
        assert r.status_code == 409 and r.json()["code"] == "account_quota", r.text
        await _ok(await c.post("/v1/stores/small-a/records", json={"path": "a.md", "content": "x" * 60}), 201)
        r = await c.post("/v1/stores/small-a/records", json={"path": "b.md", "content": "y" * 60})
        assert r.status_code == 507 and r.json()["code"] == "account_full", r.text
        # a batch counts its own growth too
        r = await c.post("/v1/stores/small-a/batch", json={"operations": [
            {"op": "create", "body": {"path": f"c{i}.md", "content": "z" * 20}} for i in range(3)]})
        assert [x["status"] for x in r.json()["results"]][-1] == 507 or r.status_code == 507, r.text
        await _ok(await c.post("/v1/tokens", json={}), 201)
        r = await c.post("/v1/tokens", json={})
        assert r.status_code == 409 and r.json()["code"] == "account_quota"
        acct = await _ok(await c.get("/v1/accounts/small"))
        assert (acct["stores"], acct["tokens"], acct["max_bytes"]) == (1, 1, 100)
        assert 60 <= acct["bytes"] <= 100


async def test_workspace_tokens_stay_in_their_account(world):
    app, root, ids = world
    async with _client(app, ids["alpha"]["ws_token"]) as c:
        r = await c.get("/v1/workspaces/bravo-ws/attachments")
        assert r.status_code == 404 and r.json()["code"] == "workspace_not_found"
        # the refusal names the token's own workspace (a sidecar tells a token of another
        # workspace from a deleted one: attack17 F6), the same for a missing workspace
        assert r.headers["Memfuse-Actor"] == "ws:alpha-ws/api"
        r = await c.get("/v1/workspaces/no-such-ws/attachments")
        assert r.status_code == 404 and r.headers["Memfuse-Actor"] == "ws:alpha-ws/api"
        r = await c.get(f"/v1/workspaces/{SAME_WS}/attachments")  # another of its account
        assert r.status_code == 403 and r.headers["Memfuse-Actor"] == "ws:alpha-ws/api"
        r = await c.get("/v1/stores/bravo-notes/records")
        assert r.status_code == 404
        # its own account's store attached account-wide (read-only) is there
        atts = {x["store"]["slug"]: x["access"] for x in (await c.get("/v1/workspaces/alpha-ws/attachments")).json()}
        assert atts == {"alpha-ws": "read_write", "alpha-notes": "read_write", "alpha-shared": "read_only",
                        SAME: "read_write"}


# ---------------------------------------------------------------- migration


FIXTURE = Path(__file__).resolve().parent / "fixtures" / "memfuse-0af4625.db"


def _release_database(tmp_path: Path, url: str) -> dict[str, str]:
    """A database made by the release before accounts (revision 0011_append_versions), with
    an admin token, a workspace token and a revoked one; returns the tokens. SQLite: the
    fixture the code at 0af4625 made (tests/fixtures/make_release_db.py). PostgreSQL: the
    same objects as raw rows in a schema upgraded to 0011_append_versions (the fixture is an SQLite file)."""
    tokens = json.loads(Path(str(FIXTURE) + ".tokens").read_text())
    if url.startswith("sqlite"):
        shutil.copy(FIXTURE, tmp_path / "release.db")
        return tokens
    db = Database(url, schema="none")
    schema.upgrade(db, "0011_append_versions")
    now = datetime.now(timezone.utc)
    with db.write_conn() as conn:
        for ws in ("agent-1", "agent-2"):
            conn.execute(text("INSERT INTO workspaces (name, created_at) VALUES (:n, :t)"), {"n": ws, "t": now})
        for slug in ("agent-1", "notes"):
            conn.execute(text(
                "INSERT INTO stores (slug, description, default_type, max_record_bytes, max_store_bytes, "
                "max_records, created_at) VALUES (:s, '', 'project', 1048576, 67108864, 10000, :t)"),
                {"s": slug, "t": now})
        for ws, store, access in (("agent-1", "agent-1", "read_write"), ("agent-1", "notes", "read_write"),
                                  ("agent-2", "notes", "read_only")):
            conn.execute(text("INSERT INTO attachments (workspace, store, access, instructions, created_at) "
                              "VALUES (:w, :s, :a, '', :t)"), {"w": ws, "s": store, "a": access, "t": now})
        for i, (ws, key, revoked) in enumerate(((None, "admin", None), ("agent-1", "workspace", None),
                                                ("agent-2", "revoked", now))):
            conn.execute(text("INSERT INTO tokens (id, token_sha256, workspace, name, created_at, revoked_at) "
                              "VALUES (:i, :h, :w, '', :t, :r)"),
                         {"i": f"00000000-0000-4000-8000-00000000000{i}", "h": sha256_hex(tokens[key].encode()),
                          "w": ws, "t": now, "r": revoked})
    db.dispose()
    return tokens


async def test_release_database_migrates_into_default(tmp_path):
    with fresh_db_url(f"sqlite:///{tmp_path / 'release.db'}") as url:
        tokens = _release_database(tmp_path, url)
        app = create_app(url, schema="migrate")
        try:
            assert schema.status(app.state.service.db).at_head
            async with _client(app, tokens["admin"]) as admin:  # today's admin token: the root admin
                accounts = (await admin.get("/v1/accounts")).json()
                assert [(x["slug"], x["stores"], x["tokens"]) for x in accounts] == [("default", 2, 1)]
                stores = {s["slug"]: s["account"] for s in (await admin.get("/v1/stores")).json()}
                assert stores == {"agent-1": "default", "notes": "default"}
                assert {w["account"] for w in (await admin.get("/v1/workspaces")).json()} == {"default"}
                listed = {t["workspace"]: t for t in (await admin.get("/v1/tokens?include_revoked=true")).json()}
                assert listed[None]["account"] is None  # still root
                assert listed["agent-1"]["account"] == "default" and listed["agent-2"]["state"] == "revoked"
                await _ok(await admin.post("/v1/accounts", json={"slug": "new"}), 201)
                # today's URLs: a workspace made without naming an account lands in default
                w = await _ok(await admin.post("/v1/workspaces", json={"name": "agent-3"}), 201)
                assert w["account"] == "default"
            async with _client(app, tokens["workspace"]) as ws:  # today's workspace token
                atts = {a["store"]["slug"]: a["access"] for a in (await ws.get("/v1/workspaces/agent-1/attachments")).json()}
                assert atts == {"agent-1": "read_write", "notes": "read_write"}
                await _ok(await ws.post("/v1/stores/notes/records", json={"path": "after.md", "content": "x\n"}), 201)
                # a store of another account is not found, even by a token made before accounts
                assert (await ws.get("/v1/stores/new-store/records")).status_code == 404
            async with _client(app, tokens["revoked"]) as gone:
                assert (await gone.get("/v1/workspaces/agent-2/attachments")).status_code == 401
        finally:
            app.state.service.db.dispose()


# ---------------------------------------------------------------- console


async def _console_login(app, token: str) -> httpx.AsyncClient:
    """A browser logged in to the console with ``token`` (cookie session)."""
    c = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE)
    await c.get("/ui/login")
    login_cookie = next(k for k in c.cookies.keys() if k.endswith("memfuse_login"))
    r = await c.post("/ui/login", data={"token": token, "csrf": c.cookies[login_cookie]})
    assert r.status_code == 303, r.text
    return c


def _csrf(html: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', html).group(1)


async def test_console_shows_the_account_and_the_root_switches(world):
    app, root, ids = world
    c = await _console_login(app, ids["alpha"]["admin"])
    try:
        page = (await c.get("/ui/")).text
        assert "account alpha" in page and "alpha-notes" in page
        assert "Account alpha:" in page and "4 / unlimited stores" in page  # usage and quotas
        assert "bravo" not in page and 'action="/ui/account"' not in page  # no switch for an account admin
        assert (await c.get("/ui/stores/bravo-notes")).status_code == 404
    finally:
        await c.aclose()
    c = await _console_login(app, ROOT)
    try:
        page = (await c.get("/ui/")).text
        assert "account all" in page and "alpha-notes" in page and "bravo-notes" in page
        # every account's usage, quotas and account-wide attachments on the root's overview
        table = re.search(r'<table class="list accounts">.*?</table>', page, flags=re.S).group(0)
        alpha_row = re.search(r"<tr>\s*<td>alpha</td>.*?</tr>", table, flags=re.S).group(0)
        assert "4 / unlimited" in alpha_row and 'href="/ui/stores/alpha-shared~alpha"' in alpha_row, alpha_row
        assert ">RO<" in alpha_row and "bravo" not in alpha_row
        assert '<option value="bravo">' in page
        r = await c.post("/ui/account", data={"account": "bravo", "csrf": _csrf(page)})
        assert r.status_code == 303, r.text
        page = (await c.get("/ui/")).text
        assert "account bravo" in page and "bravo-notes" in page and "alpha-notes" not in page
        assert (await c.get("/ui/stores/alpha-notes")).status_code == 404
        r = await c.post("/ui/account", data={"account": "nope", "csrf": _csrf(page)})
        assert r.status_code == 404
        r = await c.post("/ui/account", data={"account": "", "csrf": _csrf(page)})
        assert r.status_code == 303
        assert "alpha-notes" in (await c.get("/ui/")).text
    finally:
        await c.aclose()


# ---------------------------------------------------------------- CLI


def test_cli_accounts_in_local_mode(home):
    from click.testing import CliRunner

    from memfuse.cli import cli

    def invoke(*args: str):
        r = CliRunner().invoke(cli, list(args), catch_exceptions=False)
        return r

    r = invoke("account", "create", "acme", "--max-stores", "2", "--max-bytes", "1M")
    assert r.exit_code == 0 and r.stdout.strip() == "created account acme", r.output
    r = invoke("account", "list")
    lines = r.stdout.splitlines()
    assert lines[0].split()[:4] == ["ACCOUNT", "STORES", "BYTES", "TOKENS"]
    acme = next(ln for ln in lines if ln.startswith("acme "))
    assert "0 / 2" in acme and "1 MiB" in acme and "0 / unlimited" in acme, acme
    assert any(ln.startswith("default ") for ln in lines)
    r = invoke("token", "create", "--account", "acme", "--name", "acme-ops")
    assert r.exit_code == 0 and "account acme admin" in r.stderr, r.output
    r = invoke("token", "create", "--account", "nope")
    assert r.exit_code != 0 and "no account 'nope'" in r.output
    # today's commands, unchanged: the default account
    assert invoke("workspace", "create", "w1").exit_code == 0
    assert invoke("store", "create", "shared").exit_code == 0
    r = invoke("account", "attach", "default", "shared", "--read-only")
    assert r.exit_code == 0 and "every workspace of account default (read_only)" in r.stdout, r.output
    assert "shared (read_only)" in invoke("workspace", "list").stdout
    r = invoke("account", "show", "default")
    assert r.exit_code == 0, r.output
    att = r.stdout.splitlines()[r.stdout.splitlines().index("Attached to every workspace of the account:") + 2]
    assert att.split()[:2] == ["shared", "read_only"], r.stdout
    assert json.loads(invoke("account", "show", "default", "--json").stdout)["attachments"][0]["store"] == "shared"
    # quotas changed after creation: given ones replaced, 'unlimited' lifts one, the rest kept
    r = invoke("account", "set", "acme", "--max-stores", "5", "--max-bytes", "unlimited", "--max-tokens", "0")
    assert r.exit_code == 0, r.output
    acme = next(ln for ln in r.stdout.splitlines() if ln.startswith("acme "))
    assert "0 / 5" in acme and "0 B / unlimited" in acme and "1 / 0" in acme, acme  # its admin token: over, kept
    r = invoke("account", "set", "acme", "--max-tokens", "unlimited")
    acme = next(ln for ln in r.stdout.splitlines() if ln.startswith("acme "))
    assert "0 / 5" in acme and "1 / unlimited" in acme, acme
    assert invoke("account", "set", "acme").exit_code != 0  # nothing to set
    assert invoke("account", "set", "acme", "--max-stores", "-1").exit_code != 0
    # 0 bytes is a quota of zero as the API takes it; 2**63-1 exactly is the largest (attacker finding)
    for size, shown in (("0", "0 B / 0 B"), ("9223372036854775807", "0 B / ")):
        r = invoke("account", "set", "acme", "--max-bytes", size)
        assert r.exit_code == 0, (size, r.output)
        assert shown in next(ln for ln in r.stdout.splitlines() if ln.startswith("acme ")), r.stdout
    assert invoke("account", "set", "acme", "--max-bytes", "9223372036854775808").exit_code != 0
    assert invoke("account", "set", "acme", "--max-bytes", "unlimited").exit_code == 0
    r = invoke("account", "set", "nope", "--max-stores", "1")
    assert r.exit_code != 0 and "no account 'nope'" in r.output
    assert invoke("account", "detach", "default", "shared").exit_code == 0
    assert "shared" not in invoke("workspace", "list").stdout
    r = invoke("account", "show", "default")
    assert r.exit_code == 0 and "2 / unlimited" in r.stdout, r.output  # w1's store and shared
    assert invoke("account", "delete", "default").exit_code != 0
    # the same store slug in another account; the root admin's lists show the accounts
    assert invoke("store", "list").stdout.splitlines()[0].split()[0] == "SLUG"  # one account: as before
    assert invoke("store", "create", "shared", "--account", "acme").exit_code == 0
    assert invoke("store", "create", "shared", "--account", "acme").exit_code != 0  # 409 in acme
    assert invoke("workspace", "create", "w2", "--account", "acme").exit_code == 0
    lines = invoke("store", "list").stdout.splitlines()
    assert lines[0].split()[:2] == ["ACCOUNT", "SLUG"], lines
    assert {tuple(ln.split()[:2]) for ln in lines[1:]} == {("default", "shared"), ("default", "w1"),
                                                           ("acme", "shared"), ("acme", "w2")}
    # the root admin names acme's ``shared`` by its reference, default's by its name
    shown = json.loads(invoke("store", "show", "shared~acme").stdout)
    assert (shown["slug"], shown["account"]) == ("shared", "acme")
    assert json.loads(invoke("store", "show", "shared").stdout)["account"] == "default"
    lines = invoke("workspace", "list").stdout.splitlines()
    assert lines[0].split()[:2] == ["ACCOUNT", "WORKSPACE"]
    assert any(ln.split()[:2] == ["acme", "w2"] for ln in lines), lines
    # the same workspace name in another account (default's w1 keeps its name and tokens)
    assert invoke("workspace", "create", "w1", "--account", "acme", "--no-default-store").exit_code == 0
    assert invoke("workspace", "create", "w1", "--account", "acme", "--no-default-store").exit_code != 0
    lines = invoke("workspace", "list").stdout.splitlines()
    assert {tuple(ln.split()[:2]) for ln in lines[1:]} >= {("default", "w1"), ("acme", "w1")}, lines
    assert "~" not in "\n".join(lines)
    r = invoke("token", "create", "--workspace", "w1", "--account", "acme", "--name", "acme-w1")
    assert r.exit_code == 0 and "workspace w1" in r.stderr and "~" not in r.output, r.output
    listed = invoke("token", "list", "--json").stdout
    assert '"acme-w1"' in listed and "~" not in listed


async def test_a_consolidation_output_store_is_in_its_inputs_account(world):
    """A consolidation job's new store belongs to the account of the store it read (and counts
    against that account's store quota), so the account's admin sees it and no other does."""
    from sqlalchemy import select

    from memfuse.server.db import ConsolidationJobRow

    app, root, ids = world
    b = ids["bravo"]
    svc = app.state.service
    with svc.db.write_conn() as conn:
        job = conn.execute(select(ConsolidationJobRow.__table__).where(
            ConsolidationJobRow.__table__.c.id == b["job"])).one()
        svc.consolidations._new_store_maker(job, "bravo-notes-consolidated-1", None)(conn)
    async with _client(app, b["admin"]) as c:
        assert (await c.get("/v1/stores/bravo-notes-consolidated-1")).json()["account"] == "bravo"
    async with _client(app, ids["alpha"]["admin"]) as c:
        assert (await c.get("/v1/stores/bravo-notes-consolidated-1")).status_code == 404


async def test_an_account_named_in_the_body_is_honoured_or_refused(world):
    """``account`` in a create body names the owner as ``X-Memfuse-Account`` does: the root
    admin's choice; an account admin naming another account is 404 ``account_not_found``
    (never a silent create in its own account)."""
    app, root, ids = world
    r = await root.post("/v1/stores", json={"slug": "zz9", "account": "bravo"})
    assert r.status_code == 201 and r.json()["account"] == "bravo", r.text
    r = await root.post("/v1/workspaces", json={"name": "zw8", "account": "bravo", "default_store": False})
    assert r.status_code == 201 and r.json()["account"] == "bravo", r.text
    async with _client(app, ids["alpha"]["admin"]) as a:
        for path, body in (("/v1/stores", {"slug": "zz8"}), ("/v1/workspaces", {"name": "zw9", "default_store": False})):
            r = await a.post(path, json={**body, "account": "bravo"})
            assert r.status_code == 404 and r.json()["code"] == "account_not_found", r.text
            r = await a.post(path, json={**body, "account": "alpha"})
            assert r.status_code == 201 and r.json()["account"] == "alpha", r.text


async def test_two_accounts_each_have_their_own_store_of_one_name(world, monkeypatch):
    """``notes`` in alpha and in bravo (docs/ARCHITECTURE.md "Accounts"): each account writes,
    reads, searches, follows and deletes its own, through every face, and no answer shows a
    key (``notes~alpha``)."""
    app, root, ids = world
    a, b = ids["alpha"], ids["bravo"]
    async with _client(app, a["ws_token"]) as aw, _client(app, b["ws_token"]) as bw, \
            _client(app, a["admin"]) as aa, _client(app, b["admin"]) as ba:
        # a second create of the name in the same account is still 409; in another account it is not
        assert (await aa.post("/v1/stores", json={"slug": SAME})).json()["code"] == "exists"
        await _ok(await root.post("/v1/accounts", json={"slug": "charlie"}), 201)
        async with _client(app, ROOT, **{"X-Memfuse-Account": "charlie"}) as rc:
            assert (await _ok(await rc.post("/v1/stores", json={"slug": SAME}), 201))["slug"] == SAME
        # follow alpha's notes (long-poll) while bravo and then alpha write theirs
        seq = (await _ok(await aw.get(f"/v1/stores/{SAME}/changes?after=0")))["seq"]
        await _ok(await bw.post(f"/v1/stores/{SAME}/records", json={"path": "b.md", "content": "bravo words\n"}), 201)
        r = await aw.get(f"/v1/stores/{SAME}/changes?after={seq}&wait=0.2")
        assert r.status_code == 200 and r.json()["changes"] == [], r.text  # bravo's write is not alpha's
        await _ok(await aw.post(f"/v1/stores/{SAME}/records", json={"path": "a.md", "content": "alpha words\n"}), 201)
        page = await _ok(await aw.get(f"/v1/stores/{SAME}/changes?after={seq}&wait=5"))
        assert [c["record"]["path"] for c in page["changes"]] == ["a.md"]
        assert page["changes"][0]["record"]["store"] == SAME
        # the console's live page of alpha's notes: alpha's change, and only after it
        from memfuse.server.console import web

        monkeypatch.setattr(web, "LIVE_STREAM_SECONDS", 0.5)
        live = await aw.get(f"/ui/stores/{SAME}/live?after={seq}")
        assert live.text.count("event: change") == 1 and f'"seq": {page["changes"][0]["seq"]}' in live.text
        live = await aw.get(f"/ui/stores/{SAME}/live?after={page['changes'][0]['seq']}")
        assert "event: change" not in live.text and "event: gone" not in live.text
        for c, mine, theirs in ((aw, "alpha words", "bravo words"), (bw, "bravo words", "alpha words")):
            recs = (await _ok(await c.get(f"/v1/stores/{SAME}/records?content=true")))["records"]
            text_ = json.dumps(recs)
            assert mine in text_ and theirs not in text_ and all(x["store"] == SAME for x in recs)
            hits = await _ok(await c.get(f"/v1/stores/{SAME}/search?q=words"))
            assert mine in json.dumps(hits) or any(h["path"] for h in hits.get("records", hits.get("hits", [])))
            assert theirs.split()[0] not in json.dumps(hits)
            tool = await _ok(await c.post(f"/v1/workspaces/{(a if c is aw else b)['ws']}/memory-tool",
                                          json={"command": "view", "path": f"/memories/{SAME}"}))
            assert "~" not in json.dumps(tool)
        # events and attachments show the name
        for c, acct in ((aa, a), (ba, b)):
            ev = (await _ok(await c.get(f"/v1/workspaces/{acct['ws']}/events?after=0")))["events"]
            assert SAME in {e["store"] for e in ev} and not any("~" in e["store"] for e in ev)
            ctx = await c.get(f"/v1/workspaces/{acct['ws']}/context")
            assert ctx.status_code == 200 and f"/{SAME}/" in ctx.text and "~" not in ctx.text
        # the root admin lists both, by name, with their accounts
        listed = [(s["slug"], s["account"]) for s in (await root.get("/v1/stores")).json() if s["slug"] == SAME]
        assert sorted(listed) == [(SAME, "alpha"), (SAME, "bravo"), (SAME, "charlie")]
        # the Anthropic API: the same id, each account its own store; alpha deletes its own
        ms = await _ok(await aa.get(f"/v1/memory_stores/{store_id(SAME)}"))
        assert ms["id"] == store_id(SAME)
        await _ok(await aa.delete(f"/v1/memory_stores/{store_id(SAME)}"))
        assert (await aa.get(f"/v1/stores/{SAME}")).status_code == 404
        recs = (await _ok(await bw.get(f"/v1/stores/{SAME}/records?content=true")))["records"]
        assert "bravo words" in json.dumps(recs)
        # alpha makes its notes again: the key is now free in no account but its own rules hold
        await _ok(await aa.post("/v1/stores", json={"slug": SAME}), 201)
        assert (await _ok(await aa.get(f"/v1/stores/{SAME}/records")))["records"] == []


async def test_the_root_admin_finds_the_one_store_holding_a_name(world):
    """alpha and bravo each make a store ``dup`` (alpha's first: its key is the name, bravo's
    ``dup~bravo``); once alpha's is deleted, the root admin's ``dup`` is bravo's, the one
    store holding the name (it was 404: the root looked for the key only). While both hold
    it, the root's plain name is the store whose key it is, and ``X-Memfuse-Account`` names
    either."""
    app, root, ids = world
    for acct in ("alpha", "bravo"):
        async with _client(app, ids[acct]["admin"]) as c:
            await _ok(await c.post("/v1/stores", json={"slug": "dup", "description": acct}), 201)
    assert (await _ok(await root.get("/v1/stores/dup")))["description"] == "alpha"
    async with _client(app, ROOT, **{"X-Memfuse-Account": "bravo"}) as c:
        assert (await _ok(await c.get("/v1/stores/dup")))["description"] == "bravo"
    async with _client(app, ids["alpha"]["admin"]) as c:
        r = await c.delete("/v1/memory_stores/memstore_dup")  # stores are deleted on this face
        assert r.status_code == 200, r.text
        assert (await c.get("/v1/stores/dup")).status_code == 404
    st = await _ok(await root.get("/v1/stores/dup"))
    assert (st["description"], st["account"], st["slug"]) == ("bravo", "bravo", "dup")
    r = await _ok(await root.post("/v1/stores/dup/records", json={"path": "x.md", "content": "x\n"}), 201)
    assert r["store"] == "dup"
    async with _client(app, ids["bravo"]["admin"]) as c:
        assert (await _ok(await c.get("/v1/stores/dup/records", params={"path": "x.md"})))["records"]


async def test_the_root_admin_names_each_store_by_its_reference(world):
    """Two accounts' ``notes`` (bravo's key ``notes``, alpha's ``notes~alpha``): the root admin
    over every account names each by its reference ``notes~<account>`` (memfuse.server.keys.ref,
    whatever the key) on every face: the v1 API, the Anthropic API's ids (listed once each), the
    console's links (the overview's rows and every link inside the store's pages). An account
    admin never sees a ``~`` and cannot reach another account's store by its reference."""
    app, root, ids = world
    a, b = ids["alpha"], ids["bravo"]
    for acct, content in (("alpha", "alpha content"), ("bravo", SECRET)):
        ref = f"{SAME}~{acct}"
        st = await _ok(await root.get(f"/v1/stores/{ref}"))
        assert (st["slug"], st["account"]) == (SAME, acct)
        recs = (await _ok(await root.get(f"/v1/stores/{ref}/records?content=true")))["records"]
        assert sorted(r["content"] for r in recs) == [f"{content} by the agent\n", f"{content} in {SAME}\n"]
        # the Anthropic API: one id per store, the reference
        ms = await _ok(await root.get(f"/v1/memory_stores/{store_id(ref)}"))
        assert ms["id"] == store_id(ref) and ms["name"] == SAME
        mems = await _ok(await root.get(f"/v1/memory_stores/{store_id(ref)}/memories"))
        assert sorted(m["id"] for m in mems["data"]) == sorted(
            [memory_id(ids[acct]["same_rid"]), memory_id(ids[acct]["agent_rid"])])
    listed = [s["id"] for s in (await _ok(await root.get("/v1/memory_stores?limit=100")))["data"]]
    assert listed.count(store_id(f"{SAME}~alpha")) == 1 and listed.count(store_id(f"{SAME}~bravo")) == 1
    assert store_id(SAME) not in listed  # neither is default's: no bare name for root
    # paging by the reference: every store once, in pages of one
    seen, page = [], None
    while True:
        r = await _ok(await root.get("/v1/memory_stores", params={"limit": 1, **({"page": page} if page else {})}))
        seen += [s["id"] for s in r["data"]]
        if not (page := r.get("next_page")):
            break
    assert sorted(seen) == sorted(listed)
    # a default store keeps its bare id; the root admin acting in one account sees bare names
    await _ok(await root.post("/v1/stores", json={"slug": "plain"}), 201)
    assert store_id("plain") in [s["id"] for s in (await _ok(await root.get("/v1/memory_stores?limit=100")))["data"]]
    async with _client(app, ROOT, **{"X-Memfuse-Account": "alpha"}) as c:
        ids_alpha = [s["id"] for s in (await _ok(await c.get("/v1/memory_stores?limit=100")))["data"]]
        assert store_id(SAME) in ids_alpha and not any("~" in i for i in ids_alpha)
    async with _client(app, a["admin"]) as c:
        assert (await c.get(f"/v1/stores/{SAME}~alpha")).status_code == 200  # its own, qualified
        for ref in (f"{SAME}~bravo", "bravo-notes~bravo"):
            r = await c.get(f"/v1/stores/{ref}")
            assert r.status_code == 404 and r.json()["code"] == "store_not_found", r.text
            r = await c.get(f"/v1/memory_stores/{store_id(ref)}")
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text
        listed = (await _ok(await c.get("/v1/memory_stores?limit=100")))["data"]
        assert store_id(SAME) in [s["id"] for s in listed] and "~" not in json.dumps(listed)
    # a workspace token names its attached stores by name only: a reference (or a key) is
    # refused alike in both accounts, whichever account took the name first (attacker finding)
    for acct in ("alpha", "bravo"):
        async with _client(app, ids[acct]["ws_token"]) as c:
            assert (await c.get(f"/v1/stores/{SAME}")).status_code == 200
            for ref in (f"{SAME}~{acct}", f"{SAME}~alpha", f"{SAME}~bravo"):
                r = await c.get(f"/v1/stores/{ref}")
                assert r.status_code == 404, (acct, ref, r.text)
    # the console, root over every account: a row and a link per store, and inside the store
    c = await _console_login(app, ROOT)
    try:
        page = (await c.get("/ui/")).text
        for acct in ("alpha", "bravo"):
            assert f'href="/ui/stores/{SAME}~{acct}"' in page, page
        assert f'href="/ui/stores/{SAME}"' not in page
        store_page = (await c.get(f"/ui/stores/{SAME}~alpha")).text
        assert "same.md" in store_page and SECRET not in store_page
        assert f'/ui/stores/{SAME}~alpha/records/{a["same_rid"]}' in store_page
        assert f'href="/ui/stores/{SAME}/' not in store_page  # no link inside leads to the key's store
        job_page = await c.get(f"/ui/consolidations/{a['same_job']}")  # the job of alpha's notes
        assert job_page.status_code == 200 and f'href="/ui/stores/{SAME}~alpha/consolidations"' in job_page.text
        rec_page = await c.get(f"/ui/stores/{SAME}~bravo/records/{b['same_rid']}")
        assert rec_page.status_code == 200 and SECRET in rec_page.text
        assert f'href="/ui/stores/{SAME}~bravo"' in rec_page.text and f'href="/ui/stores/{SAME}"' not in rec_page.text
        # the workspace page offers only the workspace's account's stores, by reference
        async with _client(app, a["admin"]) as adm:
            await _ok(await adm.post("/v1/stores", json={"slug": "alpha-extra"}), 201)
        ws_page = (await c.get(f"/ui/workspaces/{a['ws']}")).text
        options = re.search(r'<select id="store".*?</select>', ws_page, flags=re.S).group(0)
        assert options.count("<option") == 1 and 'value="alpha-extra~alpha"' in options, options
        assert f'/attachments/{SAME}~alpha/detach' in ws_page
        r = await c.post(f"/ui/workspaces/{a['ws']}/attachments", data={
            "store": "alpha-extra~alpha", "access": "read_only", "csrf": _csrf(ws_page)})
        assert r.status_code == 303, r.text
        async with _client(app, a["admin"]) as adm:
            atts = {x["store"]["slug"]: x["access"] for x in (await adm.get(f"/v1/workspaces/{a['ws']}/attachments")).json()}
            assert atts["alpha-extra"] == "read_only"
    finally:
        await c.aclose()


async def test_two_accounts_each_have_their_own_workspace_of_one_name(world):
    """``agent`` in alpha and in bravo (docs/ARCHITECTURE.md "Accounts"): each account
    addresses its own by name on every resource (attachments, events as page, long-poll and
    stream, the prompt block, tokens, the memory tool, the console); versions record
    ``ws:agent/<instance>`` and the feed's ``skip_actor`` leaves out exactly the writer's own;
    the root admin's plain name is the default account's, else the key's, and
    ``X-Memfuse-Account`` names either; no answer shows a key (``agent~alpha``)."""
    app, root, ids = world
    a, b = ids["alpha"], ids["bravo"]
    async with _client(app, a["agent_token"], **{"X-Memfuse-Instance": "pod-1"}) as ag, \
            _client(app, b["agent_token"], **{"X-Memfuse-Instance": "pod-1"}) as bg, \
            _client(app, a["admin"]) as aa, _client(app, b["admin"]) as ba:
        # a second ``agent`` in one account is 409; a third account may have one too
        assert (await aa.post("/v1/workspaces", json={"name": SAME_WS})).json()["code"] == "exists"
        await _ok(await root.post("/v1/accounts", json={"slug": "charlie"}), 201)
        w = await _ok(await root.post("/v1/workspaces", json={"name": SAME_WS, "account": "charlie"}), 201)
        assert (w["name"], w["account"]) == (SAME_WS, "charlie")
        assert _ws_key(app, "charlie") == f"{SAME_WS}~charlie"
        # an account admin may name its own workspace by reference, whichever account took the
        # name first (bravo's key is the bare name); never another account's (attacker finding)
        for c, own, other in ((aa, "alpha", "bravo"), (ba, "bravo", "alpha")):
            atts = await _ok(await c.get(f"/v1/workspaces/{SAME_WS}~{own}/attachments"))
            assert {x["workspace"] for x in atts} == {SAME_WS}, own
            for ref in (f"{SAME_WS}~{other}", f"{SAME_WS}~charlie", f"{SAME_WS}~{own}~x"):
                r = await c.get(f"/v1/workspaces/{ref}/attachments")
                assert r.status_code == 404 and r.json()["code"] == "workspace_not_found", (own, ref, r.text)
        # each account's agent: its own attachments (bravo's has bravo-notes, alpha's alpha-notes)
        for c in (ag, aa):
            atts = await _ok(await c.get(f"/v1/workspaces/{SAME_WS}/attachments"))
            assert {x["store"]["slug"] for x in atts} == {SAME, "alpha-notes", "alpha-shared"}
            assert {x["workspace"] for x in atts} == {SAME_WS}
        atts = await _ok(await bg.get(f"/v1/workspaces/{SAME_WS}/attachments"))
        assert {x["store"]["slug"] for x in atts} == {SAME, "bravo-notes", "bravo-shared"}
        # the root admin: ``agent`` is no default account's, so the key's (bravo's, made first)
        atts = await _ok(await root.get(f"/v1/workspaces/{SAME_WS}/attachments"))
        assert "bravo-notes" in {x["store"]["slug"] for x in atts}
        async with _client(app, ROOT, **{"X-Memfuse-Account": "alpha"}) as ra:
            atts = await _ok(await ra.get(f"/v1/workspaces/{SAME_WS}/attachments"))
            assert "alpha-notes" in {x["store"]["slug"] for x in atts}
        listed = sorted((w["name"], w["account"]) for w in (await root.get("/v1/workspaces")).json()
                        if w["name"] == SAME_WS)
        assert listed == [(SAME_WS, "alpha"), (SAME_WS, "bravo"), (SAME_WS, "charlie")]
        # tokens: listed by name, filtered by the name in the caller's account
        toks = await _ok(await aa.get(f"/v1/tokens?workspace={SAME_WS}"))
        assert [t["id"] for t in toks] == [a["agent_token_id"]] and toks[0]["workspace"] == SAME_WS
        assert [t["id"] for t in await _ok(await ba.get(f"/v1/tokens?workspace={SAME_WS}"))] == [b["agent_token_id"]]
        # events: an attach in alpha wakes alpha's long-poll (keyed by agent~alpha; the stream
        # in tests/test_streams.py), and never bravo's
        seq = (await _ok(await ag.get(f"/v1/workspaces/{SAME_WS}/events?after=0")))["seq"]
        bseq = (await _ok(await bg.get(f"/v1/workspaces/{SAME_WS}/events?after=0")))["seq"]
        import anyio

        got: dict[str, object] = {}

        async def poll() -> None:
            got["page"] = (await ag.get(f"/v1/workspaces/{SAME_WS}/events?after={seq}&wait=30")).json()

        await _ok(await aa.post("/v1/stores", json={"slug": "alpha-late"}), 201)
        with anyio.fail_after(10):  # woken at the attach, long before the wait ends
            async with anyio.create_task_group() as tg:
                tg.start_soon(poll)
                await anyio.sleep(0.2)  # waiting (a late start still finds the event)
                await _ok(await aa.put(f"/v1/workspaces/{SAME_WS}/attachments/alpha-late", json={}))
        assert [(e["kind"], e["store"]) for e in got["page"]["events"]] == [("attached", "alpha-late")], got
        r = await bg.get(f"/v1/workspaces/{SAME_WS}/events?after={bseq}&wait=0.2")
        assert r.json()["events"] == [], r.text
        # versions: the actor names the workspace and the instance; skip_actor leaves out exactly
        # the writer's own, in each account's notes
        feed = (await _ok(await ag.get(f"/v1/stores/{SAME}/changes?after=0")))["seq"]
        rec = await _ok(await ag.post(f"/v1/stores/{SAME}/records", json={"path": "pod.md", "content": "pod\n"}), 201)
        assert rec["updated_by"] == f"ws:{SAME_WS}/pod-1"
        mine = f"ws:{SAME_WS}/pod-1"
        page = await _ok(await ag.get(f"/v1/stores/{SAME}/changes?after={feed}&skip_actor={mine}"))
        assert page["changes"] == [] and page["seq"] >= rec["seq"]
        await _ok(await aa.post(f"/v1/stores/{SAME}/records", json={"path": "adm.md", "content": "adm\n"}), 201)
        page = await _ok(await ag.get(f"/v1/stores/{SAME}/changes?after={feed}&skip_actor={mine}&wait=5"))
        assert [c["record"]["path"] for c in page["changes"]] == ["adm.md"]
        vers = await _ok(await aa.get(f"/v1/stores/{SAME}/records/{a['agent_rid']}/versions"))
        assert [v["actor"] for v in vers] == [f"ws:{SAME_WS}/api"]
        # the prompt block and the memory tool of alpha's agent: alpha's stores
        ctx = await _ok_text(await aa.get(f"/v1/workspaces/{SAME_WS}/context"))
        assert "/alpha-notes/" in ctx and "bravo" not in ctx and "~" not in ctx
        for c in (ag, aa):
            tool = await _ok(await c.post(f"/v1/workspaces/{SAME_WS}/memory-tool",
                                          json={"command": "view", "path": "/memories"}))
            assert "alpha-notes" in tool["content"] and "bravo" not in tool["content"], tool
        # a workspace token names its own workspace by name; another of its account is 403
        r = await _client(app, a["ws_token"]).get(f"/v1/workspaces/{SAME_WS}/attachments")
        assert r.status_code == 403 and r.json()["code"] == "forbidden"
    # the console of alpha's agent token: the name in its header and links
    c = await _console_login(app, a["agent_token"])
    try:
        page = (await c.get("/ui/")).text
        assert f"workspace {SAME_WS}" in page and "~" not in page
        r = await c.get("/ui/workspaces", follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"].endswith(f"/workspaces/{SAME_WS}")
        page = (await c.get(f"/ui/workspaces/{SAME_WS}")).text
        assert "alpha-notes" in page and "bravo" not in page and "~" not in page
    finally:
        await c.aclose()
    c = await _console_login(app, ROOT)  # the root over every account: each agent by its reference
    try:
        page = (await c.get("/ui/workspaces")).text
        assert "alpha-notes" in page and "bravo-notes" in page
        for acct in ("alpha", "bravo"):
            assert f'href="/ui/workspaces/{SAME_WS}~{acct}"' in page, page
            ws_page = (await c.get(f"/ui/workspaces/{SAME_WS}~{acct}")).text
            other = "bravo" if acct == "alpha" else "alpha"
            assert f"/attachments/{acct}-notes~{acct}/detach" in ws_page, ws_page  # its attachments
            assert f"/attachments/{other}-notes~{other}/detach" not in ws_page
        assert f'href="/ui/workspaces/{SAME_WS}"' not in page
    finally:
        await c.aclose()


async def test_the_root_admin_changes_an_accounts_quotas(world):
    """``PATCH /v1/accounts/{account}``: the fields given replace the quotas (null:
    unlimited, 0: zero, as at creation), the rest are kept; below the usage it refuses what
    would add to it and deletes nothing; root admin only, 404 for a missing account."""
    app, root, ids = world
    await _ok(await root.post("/v1/accounts", json={"slug": "small", "max_tokens": 5}), 201)
    async with _client(app, ROOT, **{"X-Memfuse-Account": "small"}) as c:
        for i in range(2):
            await _ok(await c.post("/v1/stores", json={"slug": f"s{i}"}), 201)
        await _ok(await c.post("/v1/stores/s0/records", json={"path": "a.md", "content": "x" * 100}), 201)
        await _ok(await c.post("/v1/tokens", json={}), 201)
        acct = await _ok(await root.patch("/v1/accounts/small", json={"max_stores": 1, "max_bytes": 50}))
        assert (acct["max_stores"], acct["max_bytes"], acct["max_tokens"]) == (1, 50, 5)  # tokens kept
        assert (acct["stores"], acct["bytes"]) == (2, 100)  # over both: nothing deleted
        r = await c.post("/v1/stores", json={"slug": "s2"})
        assert r.status_code == 409 and r.json()["code"] == "account_quota", r.text
        r = await c.post("/v1/stores/s1/records", json={"path": "b.md", "content": "y"})
        assert r.status_code == 507 and r.json()["code"] == "account_full", r.text
        rec = (await _ok(await c.get("/v1/stores/s0/records?content=true")))["records"][0]
        assert rec["content"] == "x" * 100
        shrink = await c.put(f"/v1/stores/s0/records/{rec['id']}", json={"content": "x" * 10})
        assert shrink.status_code == 200, shrink.text  # a write that does not grow is never refused
        acct = await _ok(await root.patch("/v1/accounts/small", json={"max_tokens": 0}))
        r = await c.post("/v1/tokens", json={})
        assert r.status_code == 409 and r.json()["code"] == "account_quota", r.text
        # null: unlimited again; {}: nothing changes
        acct = await _ok(await root.patch("/v1/accounts/small", json={"max_stores": None, "max_bytes": None,
                                                                      "max_tokens": None}))
        assert (acct["max_stores"], acct["max_bytes"], acct["max_tokens"]) == (None, None, None)
        assert (await _ok(await root.patch("/v1/accounts/small", json={})))["max_stores"] is None
        await _ok(await c.post("/v1/stores", json={"slug": "s2"}), 201)
        await _ok(await c.post("/v1/stores/s1/records", json={"path": "b.md", "content": "y"}), 201)
        # root only: the account's own admin (or root acting in it) cannot raise its quotas
        r = await c.patch("/v1/accounts/small", json={"max_stores": 9})
        assert r.status_code == 403 and r.json()["code"] == "forbidden"
    async with _client(app, ids["alpha"]["admin"]) as c:
        assert (await c.patch("/v1/accounts/alpha", json={"max_stores": 99})).status_code == 403
    r = await root.patch("/v1/accounts/nope", json={"max_stores": 1})
    assert r.status_code == 404 and r.json()["code"] == "account_not_found"
    assert (await root.patch("/v1/accounts/small", json={"max_stores": -1})).status_code == 422
    # JSON true is not 1, "10" is not 10, a misspelt field is not a silent no-op (attacker finding)
    for body in ({"max_bytes": True}, {"max_bytes": "10"}, {"max_byte": 10}, {"max_stores": 1.5}):
        r = await root.patch("/v1/accounts/small", json=body)
        assert r.status_code == 422, (body, r.text)
    assert (await root.post("/v1/accounts", json={"slug": "boolq", "max_bytes": True})).status_code == 422
    acct = await _ok(await root.get("/v1/accounts/small"))
    assert (acct["max_stores"], acct["max_bytes"]) == (None, None)  # the refused ones changed nothing


async def test_an_account_shows_its_account_wide_attachments(world):
    app, root, ids = world
    for c_token in (ROOT, ids["alpha"]["admin"]):
        async with _client(app, c_token) as c:
            acct = await _ok(await c.get("/v1/accounts/alpha"))
            assert [(x["store"], x["access"]) for x in acct["attachments"]] == [("alpha-shared", "read_only")]
    listed = {a["slug"]: a for a in (await _ok(await root.get("/v1/accounts")))}
    assert [x["store"] for x in listed["bravo"]["attachments"]] == ["bravo-shared"]
    assert listed["default"]["attachments"] == []
    # a store whose key is not its name shows by its name
    async with _client(app, ids["alpha"]["admin"]) as c:
        await _ok(await c.put(f"/v1/accounts/alpha/attachments/{SAME}", json={"access": "read_write"}))
        acct = await _ok(await c.get("/v1/accounts/alpha"))
        assert [x["store"] for x in acct["attachments"]] == ["alpha-shared", SAME]
        assert "~" not in json.dumps(acct)


async def test_anthropic_workspace_header_of_another_account_is_404(world):
    """``anthropic-workspace-id`` naming another account's workspace answers as a missing
    one: 404 ``not_found_error`` (the v1 API's ``workspace_not_found``), for a workspace token
    and an admin token; a workspace token naming another workspace of its own account: 403,
    as on the v1 API."""
    app, root, ids = world
    a = ids["alpha"]
    for token in (a["ws_token"], a["admin"]):
        async with _client(app, token) as c:
            for ws in ("bravo-ws", "wrkspc_bravo-ws", "zulu-none"):
                r = await c.get("/v1/memory_stores", headers={"anthropic-workspace-id": ws})
                assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", (token, ws, r.text)
            r = await c.get("/v1/memory_stores", headers={"anthropic-workspace-id": a["ws"]})
            assert r.status_code == 200, r.text
    async with _client(app, a["admin"]) as c:
        await _ok(await c.post("/v1/workspaces", json={"name": "alpha-other", "default_store": False}), 201)
    async with _client(app, a["ws_token"]) as c:
        r = await c.get("/v1/memory_stores", headers={"anthropic-workspace-id": "alpha-other"})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", r.text


async def _ok_text(r: httpx.Response) -> str:
    assert r.status_code == 200, (r.request.url, r.text)
    return r.text


async def test_the_attachments_answer_names_the_callers_actor(world):
    """``Memfuse-Actor`` on ``GET /v1/workspaces/{ws}/attachments``: the actor the control
    plane records on the caller's writes, which a sidecar takes as its own
    (``ApiClient.actor``, ``StoreSync.learn_actor``): the workspace's name (never its key)
    and the instance, whether the workspace is named by its name or by its key."""
    from memfuse.client import ApiClient

    app, root, ids = world
    a = ids["alpha"]
    for named in (SAME_WS, _ws_key(app, "alpha")):
        async with ApiClient(BASE, a["agent_token"], transport=httpx.ASGITransport(app=app),
                             instance="pod-9") as api:
            assert api.actor is None
            atts = await api.list_attachments(named)
            assert {x.store.slug for x in atts} == {SAME, "alpha-notes", "alpha-shared"}
            assert api.actor == f"ws:{SAME_WS}/pod-9"
            rec = await api.create_record(SAME, f"by-{len(named)}.md", "x\n")
            assert rec.updated_by == api.actor  # what the feed leaves out as this client's own
    async with _client(app, a["admin"]) as c:
        r = await c.get(f"/v1/workspaces/{SAME_WS}/attachments")
        assert r.headers["Memfuse-Actor"] == "admin:adm"
