"""The console over HTTP without a browser, and the service features it brought: a workspace's
default store, ``Service.search_records``. Runs on PostgreSQL too (tests/test_postgres.py).

Pages are fetched with ``Authorization: Bearer`` (as scripts do) or with the session cookie and
CSRF token a browser would send; what a browser does with the pages is in
tests/test_console_browser.py.
"""
from __future__ import annotations

import re
from contextlib import aclosing

import httpx
import pytest

from memfuse.models import RecordCreate, RecordUpdate, WorkspaceCreate
from memfuse.server.app import create_app
from memfuse.server.console import login_url
from memfuse.server.console.render import line_diff, path_breaks, render_markdown, unified_diff
from memfuse.server.console.session import csrf_token
from memfuse.server.service import Principal, ServiceError
from pgutil import fresh_db_url

ADMIN = "console-admin-token"
WS = "console-ws-token"
RO = "console-ro-token"
BASE = "http://test"
ADMIN_P = Principal(None)


def client(app, token: str | None = None, **kw) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE, headers=headers, **kw)


@pytest.fixture
async def app():
    with fresh_db_url() as url:
        app = create_app(url, static_tokens={ADMIN: None, WS: "ws", RO: "viewer"})
        svc = app.state.service
        svc.create_workspace(ADMIN_P, WorkspaceCreate(name="ws"))  # store "ws", attached read-write
        svc.create_workspace(ADMIN_P, WorkspaceCreate(name="viewer", default_store=False))
        from memfuse.models import AttachmentPut, Access
        svc.put_attachment(ADMIN_P, "viewer", "ws", AttachmentPut(access=Access.read_only))
        yield app
        svc.db.engine.dispose()


def create(app, path: str, content: str, type: str | None = "project", store: str = "ws") -> str:
    r = app.state.service.create_record(ADMIN_P, store, RecordCreate(path=path, content=content, type=type))
    import json

    return json.loads(r.body)["id"]


# ---------------------------------------------------------------- workspace default store


async def test_workspace_gets_a_same_named_store_read_write(app):
    async with client(app, ADMIN) as c:
        r = await c.post("/v1/workspaces", json={"name": "agent-1"})
        assert r.status_code == 201, r.text
        atts = (await c.get("/v1/workspaces/agent-1/attachments")).json()
        assert [(a["store"]["slug"], a["access"]) for a in atts] == [("agent-1", "read_write")]
        store = atts[0]["store"]
        assert (store["max_record_bytes"], store["max_store_bytes"], store["max_records"], store["default_type"]) == (
            1 << 20, 64 << 20, 10_000, "project")
        events = (await c.get("/v1/workspaces/agent-1/events")).json()["events"]
        assert [(e["kind"], e["store"], e["access"]) for e in events] == [("attached", "agent-1", "read_write")]


async def test_existing_store_is_attached_not_recreated(app):
    svc = app.state.service
    async with client(app, ADMIN) as c:
        assert (await c.post("/v1/stores", json={"slug": "shared", "max_records": 7})).status_code == 201
        create(app, "kept.md", "old memory\n", store="shared")
        r = await c.post("/v1/workspaces", json={"name": "shared"})
        assert r.status_code == 201, r.text
        atts = (await c.get("/v1/workspaces/shared/attachments")).json()
        assert [(a["store"]["slug"], a["access"], a["store"]["max_records"], a["store"]["record_count"])
                for a in atts] == [("shared", "read_write", 7, 1)]
    assert [r.path for r in svc.list_records(ADMIN_P, "shared").records] == ["kept.md"]


async def test_no_default_store_when_asked(app):
    async with client(app, ADMIN) as c:
        r = await c.post("/v1/workspaces", json={"name": "bare", "default_store": False})
        assert r.status_code == 201
        assert (await c.get("/v1/workspaces/bare/attachments")).json() == []
        assert (await c.get("/v1/stores/bare")).status_code == 404
        # a refused workspace creates no store either
        r = await c.post("/v1/workspaces", json={"name": "bare"})
        assert r.status_code == 409
        assert (await c.get("/v1/stores/bare")).status_code == 404


async def test_default_store_replays_with_the_idempotency_key(app):
    async with client(app, ADMIN) as c:
        h = {"Idempotency-Key": "k-1"}
        r1 = await c.post("/v1/workspaces", json={"name": "once"}, headers=h)
        r2 = await c.post("/v1/workspaces", json={"name": "once"}, headers=h)
        assert r1.status_code == r2.status_code == 201 and r2.headers["Idempotent-Replayed"] == "true"
        assert len((await c.get("/v1/workspaces/once/attachments")).json()) == 1


# ---------------------------------------------------------------- search_records


async def test_search_records_filters(app):
    svc = app.state.service
    create(app, "MEMORY.md", "# index\n", type=None)
    create(app, "prefs.md", "Prefers TEA\n", type="user")
    create(app, "notes/100%_done.md", "half_way there\n", type="project")
    create(app, "notes/100x_done.md", "percent sign elsewhere: 50%\n", type="feedback")
    gone = create(app, "old.md", "tea leaves\n", type="user")
    svc.delete_record(ADMIN_P, "ws", gone)

    def paths(**kw):
        return [r.path for r in svc.search_records(ADMIN_P, "ws", **kw).records]

    assert paths() == ["MEMORY.md", "notes/100%_done.md", "notes/100x_done.md", "prefs.md"]
    assert paths(type="user") == ["prefs.md"]  # the deleted one is not listed
    assert paths(text="tea") == ["prefs.md"]  # case-insensitive
    assert paths(path_contains="100%_") == ["notes/100%_done.md"]  # % and _ are literal
    assert paths(text="50%") == ["notes/100x_done.md"]
    assert paths(text="half_way", type="project") == ["notes/100%_done.md"]
    assert paths(text="half_way", type="user") == []
    assert paths(path_contains="\\") == []
    page = svc.search_records(ADMIN_P, "ws", text="tea")
    assert page.records[0].content is None and page.seq > 0
    with pytest.raises(ServiceError) as err:
        svc.search_records(ADMIN_P, "ws", type="secret")
    assert (err.value.status, err.value.code) == (422, "invalid_type")


async def test_search_records_pages_and_scope(app):
    svc = app.state.service
    for i in range(7):
        create(app, f"n{i}.md", f"note {i} about tea\n")
    seen, cursor = [], None
    while True:
        page = svc.search_records(ADMIN_P, "ws", text="TEA", limit=3, cursor=cursor)
        seen += [r.path for r in page.records]
        if not page.next_cursor:
            break
        cursor = page.next_cursor
    assert seen == [f"n{i}.md" for i in range(7)]
    with pytest.raises(ServiceError) as err:
        svc.search_records(Principal("other"), "ws")
    assert err.value.status == 404
    assert [r.path for r in svc.search_records(Principal("viewer"), "ws", text="note 3").records] == ["n3.md"]


async def test_search_records_is_case_insensitive_beyond_ascii(app):
    """``ÄPFEL`` finds ``äpfel`` (and the other way round) in content and path, on SQLite and
    PostgreSQL alike (their ``LIKE`` / ``ILIKE`` fold ASCII only, or by the locale); pages
    are full although the database's filter lets rows through that do not match."""
    svc = app.state.service
    for i in range(5):  # candidates of the database's filter for "Ä" (any one character)
        create(app, f"a{i}.md", f"plain {i}\n")
    create(app, "b.md", "Ich mag ÄPFEL\n")
    create(app, "c.md", "grüne äpfel\n")
    create(app, "notes/Äpfel.md", "nothing\n")
    create(app, "d.md", "KELVIN \u212a, İstanbul\n")

    def paths(**kw):
        return [r.path for r in svc.search_records(ADMIN_P, "ws", **kw).records]

    assert paths(text="äpfel") == ["b.md", "c.md"]
    assert paths(text="ÄPFEL") == ["b.md", "c.md"]
    assert paths(text="GRÜNE") == ["c.md"]
    assert paths(path_contains="äpfel") == ["notes/Äpfel.md"]
    assert paths(path_contains="ÄPFEL", text="NOTHING") == ["notes/Äpfel.md"]
    assert paths(text="kelvin k") == ["d.md"]  # U+212A KELVIN SIGN lowercases to k
    assert paths(text="i̇stanbul") == ["d.md"]  # U+0130 lowercases to i + U+0307 ...
    assert paths(text="istanbul") == []  # ... (so this is not in it: Unicode lowercase, no folding)
    assert paths(text="ä", limit=1) == ["b.md"]
    page = svc.search_records(ADMIN_P, "ws", text="Ä", limit=1)
    assert page.next_cursor is not None  # full page, more to come
    page = svc.search_records(ADMIN_P, "ws", text="Ä", limit=1, cursor=page.next_cursor)
    assert [r.path for r in page.records] == ["c.md"] and page.next_cursor is None
    assert page.records[0].content is None


# ---------------------------------------------------------------- console over HTTP


async def test_pages_need_a_session(app):
    async with client(app) as c:
        for path in ("/ui/", "/ui/stores/ws", "/ui/workspaces", "/ui/workspaces/ws/context", "/ui/nope"):
            r = await c.get(path)
            assert r.status_code == 303 and r.headers["location"].startswith("/ui/login?next="), path
        r = await c.get("/ui/stores/ws/live")
        assert r.status_code == 401
        r = await c.post("/ui/stores/ws/new", data={"path": "x.md", "content": "x", "type": "user"})
        assert r.status_code == 401
        r = await c.get("/ui/", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = await c.get("/ui")
        assert r.status_code == 308 and r.headers["location"] == "/ui/"
        r = await c.get("/ui/login")
        assert r.status_code == 200
        csp = r.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "default-src 'none'" in csp
        assert r.headers["x-frame-options"] == "DENY" and r.headers["cache-control"] == "no-store"
        assert re.findall(r"<script[^>]*>", r.text) == ['<script src="/ui/static/console.js" defer>']


async def test_login_cookie_and_csrf(app):
    async with client(app) as c:
        r = await c.get("/ui/login")
        nonce = c.cookies["memfuse_login"]
        # a login without the form's double-submit value is refused
        r = await c.post("/ui/login", data={"token": ADMIN, "csrf": "forged"})
        assert r.status_code == 403 and "memfuse_session" not in c.cookies
        r = await c.post("/ui/login", data={"token": ADMIN, "csrf": nonce, "next": "https://evil.example/"})
        assert r.status_code == 303 and r.headers["location"] == "/ui/"  # never off-site
        cookie = r.headers["set-cookie"]
        assert "memfuse_session=" in cookie and "HttpOnly" in cookie and "SameSite=strict" in cookie.replace(
            "Strict", "strict") and "Path=/ui/" in cookie and "Max-Age=" in cookie and "Secure" not in cookie
        session = c.cookies["memfuse_session"]
        assert ADMIN not in cookie and len(session) >= 40  # a random session id, never the token
        r = await c.get("/ui/stores/ws")
        assert r.status_code == 200
        # a POST with the cookie but without the CSRF token is refused, and nothing is written
        r = await c.post("/ui/stores/ws/new", data={"path": "x.md", "content": "x\n", "type": "user"})
        assert r.status_code == 403
        for forged in ("0" * 64, csrf_token(ADMIN)):  # nor with one made from the token
            r = await c.post("/ui/stores/ws/new", data={"path": "x.md", "content": "x\n", "type": "user",
                                                        "csrf": forged})
            assert r.status_code == 403
        assert app.state.service.list_records(ADMIN_P, "ws", path="x.md").records == []
        r = await c.post("/ui/stores/ws/new", data={"path": "x.md", "content": "x\r\ny\r\n", "type": "user",
                                                    "csrf": csrf_token(session)})
        assert r.status_code == 303
        rec = app.state.service.list_records(ADMIN_P, "ws", path="x.md", with_content=True).records[0]
        assert rec.content == "x\ny\n" and rec.type == "user"  # CRLF from the textarea → LF
        r = await c.post("/ui/logout", data={"csrf": csrf_token(session)})
        assert r.status_code == 303
        assert (await c.get("/ui/stores/ws")).status_code == 303
    # the old cookie, replayed after logout (copied, or a browser that kept it): refused
    async with client(app, cookies={"memfuse_session": session}) as c:
        r = await c.get("/ui/stores/ws")
        assert r.status_code == 303 and "/ui/login" in r.headers["location"]
    # the API never takes the session id
    async with client(app, session) as c:
        assert (await c.get("/v1/stores")).status_code == 401


def set_cookies(r: httpx.Response) -> dict[str, tuple[str, dict[str, str]]]:
    """The cookies a response sets: name → (value, {attribute (lower case): value})."""
    out = {}
    for header in r.headers.get_list("set-cookie"):
        first, *rest = [p.strip() for p in header.split(";")]
        name, _, value = first.partition("=")
        out[name] = (value, {k.lower(): v for k, _, v in (a.partition("=") for a in rest)})
    return out


async def _login(app, token: str, **kw) -> tuple[httpx.AsyncClient, str]:
    """A client logged in to the console with ``token``; (client, session cookie value)."""
    c = client(app, **kw)
    await c.get("/ui/login")
    login_cookie = next(k for k in c.cookies.keys() if k.endswith("memfuse_login"))
    r = await c.post("/ui/login", data={"token": token, "csrf": c.cookies[login_cookie]})
    assert r.status_code == 303, r.text
    name = next(k for k in c.cookies.keys() if k.endswith("memfuse_session"))
    return c, c.cookies[name]


async def test_session_ends_with_its_token_and_is_stored_hashed(app):
    """A database token's console session: stored as a hash only, refused once the token is
    revoked or has expired, and once the session itself expires."""
    from datetime import timedelta

    from sqlalchemy import select, update

    from memfuse.models import TokenCreate
    from memfuse.server.db import ConsoleSessionRow, TokenRow, utcnow
    from memfuse.server.sessions import session_digest

    svc = app.state.service
    tok = svc.create_token(ADMIN_P, TokenCreate(workspace="ws", name="person"))
    import json as _json

    created = _json.loads(tok.body)
    c, session = await _login(app, created["token"])
    async with aclosing(c):
        assert (await c.get("/ui/stores/ws")).status_code == 200
        with svc.db.read_conn() as conn:
            rows = conn.execute(select(ConsoleSessionRow.__table__)).all()
        assert [(r.id_sha256, r.token_id, r.workspace) for r in rows] == [
            (session_digest(session), created["id"], "ws")]
        assert all(session not in str(tuple(r)) and created["token"] not in str(tuple(r)) for r in rows)
        # the session's principal names its token: its live pages end with the token
        # (memfuse.server.streamclass), and no later than the session
        sp = svc.session_principal(session)
        assert sp.token_id == created["id"] and sp.expires_at is not None and sp.workspace == "ws"
        # the session expires: refused
        with svc.db.write_conn() as conn:
            conn.execute(update(ConsoleSessionRow.__table__).values(expires_at=utcnow() - timedelta(seconds=1)))
        assert (await c.get("/ui/stores/ws")).status_code == 303
    c, session = await _login(app, created["token"])
    async with aclosing(c):
        assert (await c.get("/ui/stores/ws")).status_code == 200
        # the token expires: refused
        with svc.db.write_conn() as conn:
            conn.execute(update(TokenRow.__table__).values(expires_at=utcnow() - timedelta(seconds=1)))
        assert (await c.get("/ui/stores/ws")).status_code == 303
        with svc.db.write_conn() as conn:
            conn.execute(update(TokenRow.__table__).values(expires_at=None))
        c.cookies.set("memfuse_session", session)  # the refusal made the client drop it
        assert (await c.get("/ui/stores/ws")).status_code == 200  # the same session, token valid again
        # the token is revoked: refused at once, the cookie dropped
        assert svc.revoke_token(ADMIN_P, created["id"]).status == 204
        r = await c.get("/ui/stores/ws")
        assert r.status_code == 303 and "/ui/login" in r.headers["location"]
        assert "memfuse_session=" in r.headers.get("set-cookie", "") and 'memfuse_session=""' in r.headers[
            "set-cookie"].replace("memfuse_session=;", 'memfuse_session="";')
    # a static token no longer given: its sessions end too
    c, session = await _login(app, RO)
    async with aclosing(c):
        assert (await c.get("/ui/stores/ws")).status_code == 200
        del svc.static_tokens[RO]
        assert (await c.get("/ui/stores/ws")).status_code == 303


async def test_a_token_keeps_at_most_its_cap_of_console_sessions(app):
    """Logins of one token past ``MAX_SESSIONS_PER_TOKEN`` end its oldest sessions (attack21:
    300 logins in 15 s made 300 rows of 12 hours); the newest stay valid, and another token's
    sessions are not touched. A database token (by id) and a static one (by digest)."""
    import json as _json

    from sqlalchemy import func, select

    from memfuse.models import TokenCreate
    from memfuse.server.db import ConsoleSessionRow
    from memfuse.server.sessions import MAX_SESSIONS_PER_TOKEN

    svc = app.state.service
    tok = _json.loads(svc.create_token(ADMIN_P, TokenCreate(workspace="ws", name="looper")).body)["token"]
    made = {token: [svc.create_session(token)[0] for _ in range(MAX_SESSIONS_PER_TOKEN + 8)] for token in (tok, RO)}
    for token, sessions in made.items():  # judged after both tokens' logins: neither ended the other's
        for s in sessions[:8]:
            with pytest.raises(ServiceError) as ei:
                svc.session_principal(s)
            assert ei.value.status == 401
        for s in sessions[8:]:
            assert svc.session_principal(s).workspace == ("ws" if token == tok else "viewer")
    with svc.db.read_conn() as conn:
        n = conn.execute(select(func.count()).select_from(ConsoleSessionRow.__table__)).scalar()
    assert n == 2 * MAX_SESSIONS_PER_TOKEN


async def test_session_cookie_over_tls_from_a_trusted_proxy_only():
    """``X-Forwarded-Proto: https`` from a --trusted-proxy address: the cookie is
    ``__Host-memfuse_session``, ``Secure``, ``Path=/``; from any other peer the header is
    ignored (plain-HTTP cookie)."""
    with fresh_db_url() as url:
        app = create_app(url, static_tokens={ADMIN: None}, trusted_proxies=["10.1.2.0/24", "::1"])
        try:
            proxied = {"X-Forwarded-Proto": "https"}
            for peer, secure in ((("10.1.2.3", 5000), True), (("10.9.9.9", 5000), False), (("::1", 1), True)):
                transport = httpx.ASGITransport(app=app, client=peer)
                # cookies by hand: httpx keeps a Secure cookie for https URLs only
                async with httpx.AsyncClient(transport=transport, base_url=BASE, headers=proxied) as c:
                    r = await c.get("/ui/login")
                    login_cookie = "__Host-memfuse_login" if secure else "memfuse_login"
                    nonce = set_cookies(r)[login_cookie][0]
                    c.cookies.clear()
                    r = await c.post("/ui/login", data={"token": ADMIN, "csrf": nonce},
                                     headers={"Cookie": f"{login_cookie}={nonce}"})
                    assert r.status_code == 303, (peer, r.text)
                    c.cookies.clear()
                    name = "__Host-memfuse_session" if secure else "memfuse_session"
                    value, attrs = set_cookies(r)[name]
                    if secure:
                        assert "secure" in attrs and attrs["path"] == "/" and "domain" not in attrs
                    else:
                        assert "secure" not in attrs and attrs["path"] == "/ui/"
                    assert attrs["samesite"].lower() == "strict" and "httponly" in attrs
                    # the cookie works on the next request of the same kind
                    r = await c.get("/ui/", headers={"Cookie": f"{name}={value}"})
                    assert r.status_code == 200, (peer, r.status_code)
        finally:
            app.state.service.db.engine.dispose()
    with pytest.raises(ValueError, match="not an IP address"):
        create_app("sqlite://", trusted_proxies=["example.com"])


async def test_redact_asks_for_confirmation(app):
    """Redact from the console: a GET (or a POST without ``confirm``) shows what is lost and
    changes nothing; only the confirming form redacts."""
    svc = app.state.service
    rid = create(app, "secret.md", "old secret text\n")
    svc.update_record(ADMIN_P, "ws", rid, RecordUpdate(content="clean\n"))
    c, session = await _login(app, ADMIN)
    async with aclosing(c):
        page = (await c.get(f"/ui/stores/ws/records/{rid}")).text
        assert f'href="/ui/stores/ws/records/{rid}/versions/1/redact"' in page
        assert f'action="/ui/stores/ws/records/{rid}/versions/1/redact"' not in page  # no one-click form
        r = await c.get(f"/ui/stores/ws/records/{rid}/versions/1/redact")
        assert r.status_code == 200
        assert "Redact version 1 of" in r.text and "secret.md" in r.text and "no undo" in r.text
        assert "16 bytes" in r.text and 'name="confirm" value="redact"' in r.text
        assert svc.get_version(ADMIN_P, "ws", rid, 1).content == "old secret text\n"
        # a POST without the confirmation: the page again, nothing redacted
        r = await c.post(f"/ui/stores/ws/records/{rid}/versions/1/redact", data={"csrf": csrf_token(session)})
        assert r.status_code == 200 and "no undo" in r.text
        assert svc.get_version(ADMIN_P, "ws", rid, 1).content == "old secret text\n"
        # the current version cannot be redacted: the page says so, no form
        r = await c.get(f"/ui/stores/ws/records/{rid}/versions/2/redact")
        assert r.status_code == 409 and 'name="confirm"' not in r.text
        r = await c.post(f"/ui/stores/ws/records/{rid}/versions/1/redact",
                         data={"csrf": csrf_token(session), "confirm": "redact"})
        assert r.status_code == 303 and r.headers["location"].endswith("msg=redacted")
        assert svc.get_version(ADMIN_P, "ws", rid, 1).content is None
        r = await c.get(f"/ui/stores/ws/records/{rid}/versions/1/redact")
        assert "already redacted" in r.text and 'name="confirm"' not in r.text
        # out-of-range version numbers are a 404 page, never a 500
        r = await c.get(f"/ui/stores/ws/records/{rid}/versions/{2 ** 70}/redact")
        assert r.status_code == 404
    # a workspace token may not redact (no link, 403)
    async with client(app, WS) as c:
        assert "/redact" not in (await c.get(f"/ui/stores/ws/records/{rid}")).text
        assert (await c.get(f"/ui/stores/ws/records/{rid}/versions/1/redact")).status_code == 403


async def test_one_time_login_link(app):
    url = login_url(app, ADMIN, BASE)
    assert url.startswith(BASE + "/ui/login/")
    path = url[len(BASE):]
    async with client(app) as c:
        r = await c.get(path)
        assert r.status_code == 303 and r.headers["location"] == "/ui/"
        assert (await c.get("/ui/")).status_code == 200
    async with client(app) as c:  # a second use does not log in
        r = await c.get(path)
        assert r.status_code == 303 and "notice=expired" in r.headers["location"]
        assert (await c.get("/ui/")).status_code == 303


async def test_unknown_store_record_version_are_404_pages(app):
    rid = create(app, "a.md", "a\n")
    async with client(app, ADMIN) as c:
        for path in ("/ui/stores/nope", f"/ui/stores/ws/records/{'0' * 8}", f"/ui/stores/nope/records/{rid}",
                     f"/ui/stores/ws/records/{rid}?version=9", f"/ui/stores/ws/records/{rid}/diff?a=1&b=9",
                     "/ui/workspaces/nope", "/ui/no/such/page"):
            r = await c.get(path)
            assert r.status_code == 404, path
            assert r.headers["content-type"].startswith("text/html") and "Traceback" not in r.text
            assert "<h1>Not found</h1>" in r.text


async def test_workspace_token_sees_only_its_attachments(app):
    create(app, "a.md", "a\n")
    async with client(app, ADMIN) as c:
        assert (await c.post("/v1/stores", json={"slug": "private"})).status_code == 201
    async with client(app, RO) as c:
        r = await c.get("/ui/")
        assert r.status_code == 200 and ">ws<" in r.text and "private" not in r.text
        assert (await c.get("/ui/stores/private")).status_code == 404
        assert (await c.get("/ui/workspaces/ws")).status_code == 403  # another workspace
        r = await c.get("/ui/workspaces")
        assert r.status_code == 303 and r.headers["location"] == "/ui/workspaces/viewer"
        r = await c.post("/ui/workspaces/viewer/attachments", data={"store": "private", "access": "read_write"})
        assert r.status_code == 403


async def test_read_only_attachment_has_no_edit_and_refuses_posts(app):
    rid = create(app, "a.md", "a\n")
    async with client(app, RO) as c:
        page = (await c.get(f"/ui/stores/ws/records/{rid}")).text
        assert "/edit" not in page and "/delete" not in page and "/restore" not in page
        store = (await c.get("/ui/stores/ws")).text
        assert "/ui/stores/ws/new" not in store
        for path, data in ((f"/ui/stores/ws/records/{rid}/edit", {"content": "b\n"}),
                           (f"/ui/stores/ws/records/{rid}/delete", {}),
                           (f"/ui/stores/ws/records/{rid}/restore", {"version": "1"}),
                           ("/ui/stores/ws/new", {"path": "b.md", "content": "b\n", "type": "user"})):
            r = await c.post(path, data=data)
            assert r.status_code == 403, path
        assert (await c.get(f"/ui/stores/ws/records/{rid}/edit")).status_code == 403
    assert app.state.service.get_record(ADMIN_P, "ws", rid).version == 1


async def test_edit_refusals_and_stale(app):
    svc = app.state.service
    rid = create(app, "a.md", "one\n")
    base = svc.get_record(ADMIN_P, "ws", rid)
    async with client(app, WS) as c:
        form = {"base_sha256": base.sha256, "base_version": "1", "type": "project", "original_type": "project"}
        # not UTF-8 (a script can send any bytes): the mount's EILSEQ reason, next to the field
        body = "&".join(f"{k}={v}" for k, v in form.items()) + "&content=caf%E9"
        r = await c.post(f"/ui/stores/ws/records/{rid}/edit", content=body,
                         headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert r.status_code == 422 and "not valid UTF-8 (bad byte at offset 3)" in r.text
        r = await c.post(f"/ui/stores/ws/records/{rid}/edit", data=dict(form, content="a\x00b"))
        assert r.status_code == 422 and "NUL" in r.text
        r = await c.post(f"/ui/stores/ws/records/{rid}/edit",
                         data=dict(form, content="aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYzz1ZQ3abcd\n"))
        assert r.status_code == 422 and "secret" in r.text and "wJalrXUtnFEMI" not in r.text.split("textarea")[0]
        # someone else writes meanwhile
        svc.update_record(Principal("ws", instance="agent"), "ws", rid, RecordUpdate(content="one\ntwo\n"))
        r = await c.post(f"/ui/stores/ws/records/{rid}/edit", data=dict(form, content="mine\n"))
        assert r.status_code == 409
        assert "changed while you were editing" in r.text and "+two" in r.text and "mine" in r.text
        assert svc.get_record(ADMIN_P, "ws", rid, with_content=True).content == "one\ntwo\n"
        new_sha = svc.get_record(ADMIN_P, "ws", rid).sha256
        assert f'value="{new_sha}"' in r.text  # saving again is a knowing overwrite
    assert svc.get_record(ADMIN_P, "ws", rid).version == 2  # nothing else was written
    # deleted meanwhile: the text stays on the page, nothing is written
    svc.delete_record(ADMIN_P, "ws", rid)
    async with client(app, WS) as c:
        r = await c.post(f"/ui/stores/ws/records/{rid}/edit", data=dict(form, base_sha256=new_sha, base_version="2",
                                                                        content="still mine\n"))
        assert r.status_code == 409 and "deleted while you were editing" in r.text and "still mine" in r.text
    assert svc.get_record(ADMIN_P, "ws", rid).version == 3


async def test_editing_keeps_a_records_own_line_endings(app):
    """A textarea submits every line break as CRLF (HTML): saving a one-word edit of a CRLF
    record keeps CRLF, of an LF record LF; a record mixing them (or with a lone CR) gets a
    warning on the edit page before it is saved with LF (attack 13 F15)."""
    svc = app.state.service
    crlf = create(app, "win.md", "first line\r\nold word here\r\nend\r\n")
    lf = create(app, "unix.md", "first line\nold word here\n")
    mixed = create(app, "mixed.md", "a\r\nb\nlone CR\rend\n")
    async with client(app, WS) as c:
        for rid, want in ((crlf, "first line\r\nnew word here\r\nend\r\n"),
                          (lf, "first line\nnew word here\n")):
            page = await c.get(f"/ui/stores/ws/records/{rid}/edit")
            assert page.status_code == 200 and "mixes line endings" not in page.text
            newline = re.search(r'name="newline" value="([a-z]+)"', page.text).group(1)
            base = svc.get_record(ADMIN_P, "ws", rid)
            typed = base.content if base.content else svc.get_record(ADMIN_P, "ws", rid, with_content=True).content
            typed = typed.replace("\r\n", "\n").replace("old", "new").replace("\n", "\r\n")  # as a browser sends it
            r = await c.post(f"/ui/stores/ws/records/{rid}/edit", data={
                "base_sha256": base.sha256, "base_version": str(base.version), "type": "project",
                "original_type": "project", "newline": newline, "content": typed})
            assert r.status_code == 303, r.text
            assert svc.get_record(ADMIN_P, "ws", rid, with_content=True).content == want
        page = await c.get(f"/ui/stores/ws/records/{mixed}/edit")
        assert "mixes line endings" in page.text


async def test_memory_settings_replace_and_clear(app):
    svc = app.state.service
    async with client(app, WS) as c:
        r = await c.get("/ui/stores/ws/memory")
        assert r.status_code == 303 and r.headers["location"] == "/ui/stores/ws/new?path=MEMORY.md"
        r = await c.post("/ui/stores/ws/new", data={"path": "MEMORY.md", "content": "# Index\n- a\n"})
        assert r.status_code == 303  # the index needs no type
        rec = svc.list_records(ADMIN_P, "ws", path="MEMORY.md").records[0]
        assert rec.type is None
        r = await c.get("/ui/stores/ws/memory")
        assert r.status_code == 200 and "Clear MEMORY.md" in r.text
        form = {"base_sha256": rec.sha256, "base_version": str(rec.version)}
        r = await c.post("/ui/stores/ws/records/" + rec.id + "/edit?view=settings",
                         data=dict(form, action="clear", content="ignored"))
        assert r.status_code == 303 and r.headers["location"] == "/ui/stores/ws/memory?msg=cleared"
        rec2 = svc.get_record(ADMIN_P, "ws", rec.id, with_content=True)
        assert rec2.content == "" and rec2.version == 2 and not rec2.deleted


async def test_restore_delete_redact_and_diff(app):
    svc = app.state.service
    rid = create(app, "a.md", "one\n")
    svc.update_record(ADMIN_P, "ws", rid, RecordUpdate(content="two\n"))
    async with client(app, ADMIN) as c:
        r = await c.get(f"/ui/stores/ws/records/{rid}/diff?a=1&b=2")
        assert re.search(r'<tr class="d-del"><td class="ln">1</td><td class="ln"></td><td class="code">one</td>', r.text)
        assert re.search(r'<tr class="d-add"><td class="ln"></td><td class="ln">1</td><td class="code">two</td>', r.text)
        r = await c.get(f"/ui/stores/ws/records/{rid}/diff?a=1&b=2&view=split")
        assert 'class="diff split"' in r.text and '<td class="code d-del">one</td>' in r.text
        r = await c.get(f"/ui/stores/ws/records/{rid}")  # each history row links its previous version's diff
        assert f'href="/ui/stores/ws/records/{rid}/diff?a=1&amp;b=2"' in r.text
        r = await c.post(f"/ui/stores/ws/records/{rid}/restore", data={"version": "1"})
        assert r.status_code == 303
        rec = svc.get_record(ADMIN_P, "ws", rid, with_content=True)
        assert (rec.content, rec.version) == ("one\n", 3)
        assert svc.list_versions(ADMIN_P, "ws", rid).versions[-1].operation.value == "restored"
        r = await c.post(f"/ui/stores/ws/records/{rid}/delete", data={"sha256": "0" * 64})
        assert r.status_code == 412 and "nothing was deleted" in r.text
        r = await c.post(f"/ui/stores/ws/records/{rid}/delete", data={"sha256": rec.sha256})
        assert r.status_code == 303 and svc.get_record(ADMIN_P, "ws", rid).deleted
        r = await c.post(f"/ui/stores/ws/records/{rid}/versions/2/redact", data={})
        assert r.status_code == 200 and "no undo" in r.text  # asked first
        assert svc.get_version(ADMIN_P, "ws", rid, 2).content is not None
        r = await c.post(f"/ui/stores/ws/records/{rid}/versions/2/redact", data={"confirm": "redact"})
        assert r.status_code == 303
        r = await c.get(f"/ui/stores/ws/records/{rid}/diff?a=1&b=2")
        assert "was redacted" in r.text
    async with client(app, WS) as c:  # redact is for admins
        r = await c.post(f"/ui/stores/ws/records/{rid}/versions/1/redact", data={"confirm": "redact"})
        assert r.status_code == 403


async def test_attach_detach_switch(app):
    svc = app.state.service
    async with client(app, ADMIN) as c:
        assert (await c.post("/v1/stores", json={"slug": "team"})).status_code == 201
        r = await c.post("/ui/workspaces/viewer/attachments", data={"store": "team", "access": "read_only",
                                                                      "instructions": "shared notes"})
        assert r.status_code == 303
        assert [(a.store.slug, a.access.value, a.instructions) for a in svc.list_attachments(ADMIN_P, "viewer")] == [
            ("team", "read_only", "shared notes"), ("ws", "read_only", "")]
        r = await c.post("/ui/workspaces/viewer/attachments", data={"store": "team", "access": "read_write",
                                                                      "instructions": "shared notes"})
        assert [a.access.value for a in svc.list_attachments(ADMIN_P, "viewer")] == ["read_write", "read_only"]
        r = await c.post("/ui/workspaces/viewer/attachments/team/detach", data={})
        assert r.status_code == 303
        assert [a.store.slug for a in svc.list_attachments(ADMIN_P, "viewer")] == ["ws"]
        r = await c.post("/ui/workspaces", data={"name": "new-ws", "default_store": "on"})
        assert r.status_code == 303
        assert [a.store.slug for a in svc.list_attachments(ADMIN_P, "new-ws")] == ["new-ws"]
        r = await c.post("/ui/workspaces", data={"name": "Bad Name"})
        assert r.status_code == 422


async def test_store_page_search_is_server_side(app):
    create(app, "MEMORY.md", "# The index\n", type=None)
    create(app, "tea.md", "green tea\n", type="user")
    create(app, "coffee.md", "espresso\n", type="project")
    async with client(app, WS) as c:
        r = await c.get("/ui/stores/ws", params={"text": "TEA"})
        listing = r.text.split("<h2>Records</h2>")[1]
        assert "tea.md" in listing and "coffee.md" not in listing
        assert "green tea" not in listing  # no content goes to the browser for the listing
        assert r.text.index("The index") < r.text.index("<h2>Records</h2>")  # MEMORY.md first
        r = await c.get("/ui/stores/ws", params={"type": "project"})
        listing = r.text.split("<h2>Records</h2>")[1]
        assert "coffee.md" in listing and "tea.md" not in listing


async def test_prompt_preview_is_the_context_block(app):
    create(app, "MEMORY.md", "".join(f"line {i}\n" for i in range(300)), type=None)
    async with client(app, WS) as c:
        block = (await c.get("/v1/workspaces/ws/context")).text
        page = (await c.get("/ui/workspaces/ws/context")).text
    import html

    pre = re.search(r'<pre class="context">(.*?)</pre>', page, re.S).group(1)
    text = html.unescape(re.sub(r"</?mark[^>]*>", "", pre))
    assert text == block
    assert '<mark class="omission">[memfuse: MEMORY.md is cut here: 100 more line(s)' in page


async def test_live_events(app, monkeypatch):
    """The store's event stream: a ``change`` event for versions after ``after`` (only the
    record's own with ``record=``), then the end of the stream (shortened here; the browser
    test reads it live from a real server)."""
    from memfuse.server.console import web

    monkeypatch.setattr(web, "LIVE_STREAM_SECONDS", 1.0)
    svc = app.state.service
    seq = svc.list_records(ADMIN_P, "ws", limit=1).seq
    mine = create(app, "mine.md", "x\n")
    async with client(app, WS) as c:
        r = await c.get(f"/ui/stores/ws/live?after={seq}")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.text.count("event: change") == 1
        seq2 = svc.list_records(ADMIN_P, "ws", limit=1).seq
        create(app, "other.md", "y\n")
        r = await c.get(f"/ui/stores/ws/live?after={seq2}&record={mine}")
        assert "event: change" not in r.text  # another record changed, not this one
        r = await c.get(f"/ui/stores/ws/live?after={seq2}")
        assert "event: change" in r.text
        r = await c.get(f"/ui/stores/nope/live?after=0")
        assert "event: gone" in r.text


async def test_idle_live_page_makes_no_database_queries(app, monkeypatch):
    """A live page is woken by the commits that concern its store (the ``Notifier``, as
    long-polls and streams are), never by a timer that re-reads the database: once it has
    looked, an open page makes no statement across its keep-alives, and a write still reaches
    it at once (before the page's end)."""
    import trio

    from memfuse.server.console import web

    monkeypatch.setattr(web, "LIVE_KEEPALIVE_SECONDS", 0.2)  # many wake-ups in a short page
    svc = app.state.service
    svc.bus.start()
    with trio.fail_after(10):  # PostgreSQL: the server trusts its cache once LISTEN is up
        while not svc.bus.connected:
            await trio.sleep(0.02)
    seq = svc.list_records(ADMIN_P, "ws", limit=1).seq
    counter = app.state.metrics.db_statements
    async with client(app, WS) as c:
        monkeypatch.setattr(web, "LIVE_STREAM_SECONDS", 0.3)
        r = await c.get(f"/ui/stores/ws/live?after={seq}")  # looks once: learns the head, access
        assert r.status_code == 200 and "event: change" not in r.text
        monkeypatch.setattr(web, "LIVE_STREAM_SECONDS", 2.5)
        before = counter.value()
        r = await c.get(f"/ui/stores/ws/live?after={seq}")
        assert r.text.count(": keep-alive") >= 5 and "event: change" not in r.text, r.text
        assert counter.value() == before
    # a write wakes an open page: the change event comes long before the page's end (the
    # app called as ASGI directly: httpx's ASGITransport hands over a body only once complete)
    monkeypatch.setattr(web, "LIVE_STREAM_SECONDS", 60.0)
    body = bytearray()
    seen = trio.Event()

    async def send(message):
        if message["type"] == "http.response.body":
            body.extend(message.get("body", b""))
            if b"data:" in body:
                seen.set()

    requested = False

    async def receive():  # the (empty) request body, then nothing: the client stays
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await trio.sleep_forever()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
             "scheme": "http", "path": "/ui/stores/ws/live", "raw_path": b"/ui/stores/ws/live",
             "root_path": "", "query_string": f"after={seq}".encode(), "server": ("test", 80),
             "client": ("127.0.0.1", 1), "headers": [(b"host", b"test"), (b"authorization", f"Bearer {WS}".encode())]}
    with trio.fail_after(15):
        async with trio.open_nursery() as n:
            n.start_soon(app, scope, receive, send)
            while svc.notifier.waiting < 1:
                await trio.sleep(0.01)
            await trio.to_thread.run_sync(create, app, "woken.md", "w\n")
            await seen.wait()
            n.cancel_scope.cancel()
    new_seq = svc.list_records(ADMIN_P, "ws", limit=1).seq
    assert f'data: {{"seq": {new_seq}}}' in body.decode()


def test_markdown_is_inert():
    html = str(render_markdown(
        "<script>alert(1)</script>\n\n<img src=x onerror=alert(1)>\n\n[a](javascript:alert(1))\n\n"
        "[b](JaVaScRiPt:alert(1))\n\n[c](vbscript:x)\n\n![d](data:text/html;base64,PHNjcmlwdD4=)\n\n"
        "<a href=\"javascript:alert(1)\">e</a>\n\n<iframe src=x></iframe>\n\n[ok](https://example.com \"t\")\n"))
    assert "<script" not in html and "<img src=x" not in html and "<iframe" not in html
    assert html.count("<a ") == 1 and "<a href=\"javascript" not in html.lower()  # the others stay text
    assert "<img" not in html and "<a href=\"vbscript" not in html
    assert '<a href="https://example.com" title="t" rel="noopener noreferrer nofollow">ok</a>' in html


def test_protocol_relative_links_are_external_links():
    """attack21: ``[d](//evil.example/x)`` (and its spellings: a reference definition,
    ``///``, ``&#47;&#47;``) is a link to another host, not a console page: it gets what an
    ``https://`` link gets (nh3's ``rel="noopener noreferrer nofollow"``, on every link),
    no ``target``; backslash and tab spellings a browser would read as ``//`` come out
    percent-encoded (a path on this host); an image from another host stays subject to the
    page's ``img-src 'self'``."""
    from memfuse.server.console.session import CONTENT_SECURITY_POLICY

    rel = 'rel="noopener noreferrer nofollow"'
    for md, href in (("[d](//evil.example/x)", "//evil.example/x"),
                     ("[d](https://evil.example/x)", "https://evil.example/x"),
                     ("[d]: //evil.example/r\n\n[d]", "//evil.example/r"),
                     ("[d](///evil.example)", "///evil.example"),
                     ("[d](&#47;&#47;evil.example)", "//evil.example"),
                     ("[d](/\\evil.example)", "/%5Cevil.example"),
                     ("[d](\\\\evil.example)", "%5Cevil.example"),
                     ("[d](/&#9;/evil.example)", "/%09/evil.example")):
        html = str(render_markdown(md))
        assert f'<a href="{href}" {rel}>d</a>' in html, (md, html)
        assert "target=" not in html
    assert "img-src 'self'" in CONTENT_SECURITY_POLICY


def test_unified_diff():
    lines = unified_diff("a\nb\n", "a\nc\n", "v1", "v2")
    assert [(ln.kind, ln.text) for ln in lines] == [
        ("head", "--- v1"), ("head", "+++ v2"), ("hunk", "@@ -1,2 +1,2 @@"), ("ctx", " a"), ("del", "-b"),
        ("add", "+c")]
    assert unified_diff("x", "x", "a", "b") == []
    assert unified_diff("x", "x\n", "a", "b")[0].kind == "hunk"


def test_line_diff_numbers_and_words():
    d = line_diff("keep\nprefers tea with milk\ngone\n", "keep\nprefers coffee with milk\n", context=3)
    (h,) = d.hunks
    assert h.header == "@@ -1,3 +1,2 @@"
    assert [(r.kind, r.old, r.new) for r in h.unified] == [
        ("ctx", 1, 1), ("del", 2, None), ("del", 3, None), ("add", None, 2)]
    changed = [[(s.text, s.changed) for s in r.segments] for r in h.unified[1:]]
    assert changed[0] == [("prefers ", False), ("tea", True), (" with milk", False)]
    assert changed[1] == [("gone", False)]  # no counterpart: not word-marked
    assert changed[2] == [("prefers ", False), ("coffee", True), (" with milk", False)]
    assert [(left and left.old, right and right.new) for left, right in h.split] == [(1, 1), (2, 2), (3, None)]
    # unrelated lines are not marked word by word; equal texts have no hunk; a final newline is noted
    (h,) = line_diff("alpha beta\n", "1 2 3\n").hunks
    assert all(not s.changed for r in h.unified for s in r.segments)
    assert line_diff("x\n", "x\n").hunks == () and line_diff("x", "x\n").note
    # hunks keep 3 lines of context and split far-apart changes
    a = "".join(f"l{i}\n" for i in range(30))
    d = line_diff(a, a.replace("l2\n", "L2\n").replace("l25\n", "L25\n"))
    assert [h.header for h in d.hunks] == ["@@ -1,6 +1,6 @@", "@@ -23,7 +23,7 @@"]


def test_path_breaks_between_directories_and_escapes():
    assert str(path_breaks("notes/a<b>/JOURNAL.jsonl")) == "notes/<wbr>a&lt;b&gt;/<wbr>JOURNAL.jsonl"


async def test_diff_of_hostile_content_is_inert(app):
    svc = app.state.service
    rid = create(app, "x/<svg onload=alert(1)>.md", "<script>alert(1)</script>\n")
    svc.update_record(ADMIN_P, "ws", rid, RecordUpdate(content="<script>alert(2)</script><img src=x onerror=alert(3)>\n"))
    async with client(app, ADMIN) as c:
        for view in ("unified", "split"):
            r = await c.get(f"/ui/stores/ws/records/{rid}/diff?a=1&b=2&view={view}")
            assert r.status_code == 200
            assert "<script>" not in r.text and "<img" not in r.text and "<svg" not in r.text
            assert "&lt;script&gt;alert(" in r.text and "script-src 'self'" in r.headers["content-security-policy"]


async def test_untrusted_names_and_text_are_escaped(app):
    evil = '<img src=x onerror=alert(1)>.md'
    rid = create(app, evil, "# hi\n<b onclick=alert(1)>x</b>\n", type="user")
    svc = app.state.service
    from memfuse.models import AttachmentPut, StoreUpdate

    svc.update_store(ADMIN_P, "ws", StoreUpdate(description='<script>alert("d")</script>'))
    svc.put_attachment(ADMIN_P, "viewer", "ws", AttachmentPut(access="read_only", instructions="<svg onload=x>"))
    async with client(app, ADMIN) as c:
        pages = [(await c.get(p)).text for p in (
            "/ui/", "/ui/stores/ws", f"/ui/stores/ws/records/{rid}", f"/ui/stores/ws/records/{rid}/edit",
            "/ui/workspaces", "/ui/workspaces/viewer", "/ui/workspaces/viewer/context",
            f"/ui/stores/ws/records/{rid}/diff?a=1&b=1")]
    for page in pages:
        assert "<img src=x" not in page and "onclick=alert" not in page.replace("&lt;b onclick=alert", "")
        assert '<script>alert("d")' not in page and "<svg" not in page
        assert re.findall(r"<script[^>]*>", page) == ['<script src="/ui/static/console.js" defer>']
    assert "&lt;img src=x onerror=alert(1)&gt;.md" in pages[1]


async def test_a_big_record_renders_only_its_head_as_markdown(app, monkeypatch):
    """markdown-it-py costs ~15 µs of CPU a character on hostile valid Markdown (``[`` x N):
    the console renders at most MARKDOWN_RENDER_MAX characters of a record (cut at a line
    end) and shows the rest only as escaped source, so a 1 MiB record is not a minute of a
    replica's CPU per view (attack 13 F9); a version viewed again is not rendered again."""
    from memfuse.server.console import render

    lengths: list[int] = []
    real = render._md.render
    monkeypatch.setattr(render._md, "render", lambda t: lengths.append(len(t)) or real(t))
    render.render_markdown.cache_clear()
    body = "# head\n\n" + ("[" * 1000 + "\n") * 1000  # ~1 MB of valid, hostile Markdown
    rid = create(app, "big.md", body, type="user")
    async with client(app, ADMIN) as c:
        for _ in range(2):
            r = await c.get(f"/ui/stores/ws/records/{rid}")
            assert r.status_code == 200
            assert "characters are not rendered" in r.text and "<h1>head</h1>" in r.text
    assert len(lengths) == 1 and lengths[0] <= render.MARKDOWN_RENDER_MAX, lengths
    small = render.render_content("s.md", "# t\n\nx\n")
    assert small.unrendered == 0 and "<h1>t</h1>" in small.html
    assert render.markdown_head("a\n\nb" + "c" * 10, limit=5) == "a\n\n"


async def test_store_settings_form(app):
    """(admin) the store page's settings form: description, default type and limits, sizes as
    people write them; bad values are shown by their field and change nothing; CSRF and the
    admin's right are checked like every other form."""
    svc = app.state.service
    before = svc.get_store(ADMIN_P, "ws")
    form = {"description": "team notes", "default_type": "user", "max_record_bytes": "512K",
            "max_store_bytes": "2 MiB", "max_records": "1,500"}
    async with client(app) as c:
        await c.get("/ui/login")
        r = await c.post("/ui/login", data={"token": ADMIN, "csrf": c.cookies["memfuse_login"]})
        assert r.status_code == 303
        csrf = csrf_token(c.cookies["memfuse_session"])
        page = (await c.get("/ui/stores/ws")).text
        assert 'action="/ui/stores/ws/settings"' in page and 'value="1048576"' in page
        # without the CSRF token: refused, nothing changed
        assert (await c.post("/ui/stores/ws/settings", data=form)).status_code == 403
        bad = {**form, "max_record_bytes": "12 parsecs", "max_records": "0", "default_type": "diary",
               "max_store_bytes": "<b>9</b>", "csrf": csrf}
        r = await c.post("/ui/stores/ws/settings", data=bad)
        assert r.status_code == 422
        assert "Nothing was changed" in r.text
        assert "&#39;12 parsecs&#39; is not a byte size" in r.text
        assert "must be at least 1" in r.text and "choose one of user, feedback, project, reference" in r.text
        assert "<b>9</b>" not in r.text and "&lt;b&gt;9&lt;/b&gt;" in r.text  # typed values kept, escaped
        assert 'value="12 parsecs"' in r.text and "<details class=\"settings\" id=\"settings\" open>" in r.text
        assert svc.get_store(ADMIN_P, "ws") == before
        r = await c.post("/ui/stores/ws/settings", data={**form, "max_record_bytes": "4M",
                                                          "max_store_bytes": "1M", "csrf": csrf})
        assert r.status_code == 422 and "cannot be larger than the whole store" in r.text
        assert svc.get_store(ADMIN_P, "ws") == before
        # good values: saved, one store_changed event for the attached workspaces
        r = await c.post("/ui/stores/ws/settings", data={**form, "csrf": csrf})
        assert r.status_code == 303 and r.headers["location"].endswith("msg=settings_saved")
        after = svc.get_store(ADMIN_P, "ws")
        assert (after.description, after.default_type, after.max_record_bytes, after.max_store_bytes,
                after.max_records) == ("team notes", "user", 512 << 10, 2 << 20, 1500)
        assert "Store settings saved." in (await c.get(r.headers["location"])).text
        r = await c.post("/ui/stores/ws/settings", data={**form, "max_records": "1500", "csrf": csrf})
        assert r.headers["location"].endswith("msg=settings_unchanged")
    # a workspace token (even read-write) sees no form and may not post one
    async with client(app, WS) as c:
        assert 'action="/ui/stores/ws/settings"' not in (await c.get("/ui/stores/ws")).text
        r = await c.post("/ui/stores/ws/settings", data={**form, "max_records": "9"})
        assert r.status_code == 403
    assert svc.get_store(ADMIN_P, "ws").max_records == 1500
