"""Anthropic's memory-store API on memfuse, driven by the anthropic SDK itself.

A real ``memfuse serve`` (subprocess) on SQLite and on a throwaway PostgreSQL cluster; the
client is ``anthropic.Anthropic(base_url=…, api_key=<memfuse token>)`` calling
``client.beta.memory_stores…`` exactly as against Anthropic's API, and the SDK's own session
sync helper (``SessionMemoryStores``) against a store that a real memfuse mount also writes.
Every call of the API (stores, memories, versions) goes through the SDK here; the same rows
are checked through memfuse's own API (``ApiClient``).
"""
from __future__ import annotations

import hashlib
import re
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest
import trio

anthropic = pytest.importorskip("anthropic")
from anthropic import Anthropic, AsyncAnthropic  # noqa: E402

from memfuse.client import ApiClient  # noqa: E402
from mountutil import ControlPlane, Sidecar, sh, wait_until  # noqa: E402
from pgutil import pg_bindir, pg_cluster  # noqa: E402


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class Server(ControlPlane):
    """``ControlPlane`` over any database URL."""

    def __init__(self, tmp: Path, db_url: str) -> None:
        super().__init__(tmp)
        self.db_url = db_url

    def start(self) -> "Server":
        import subprocess

        from mountutil import MEMFUSE, serve_listening

        self.proc = subprocess.Popen(
            [MEMFUSE, "serve", "--db", self.db_url, "--listen", "127.0.0.1:0",
             "--admin-token-file", str(self.token_file), "--migrate"],
            stdout=self.log.open("ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=dict(os.environ, MEMFUSE_HOME=str(self.tmp / "home")))
        url = serve_listening(self.proc, self.log)
        self.port = int(url.rsplit(":", 1)[1])
        return self


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def server(request, tmp_path_factory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp(f"anthropic-{request.param}")
    if request.param == "sqlite":
        srv = Server(tmp, f"sqlite:///{tmp / 'cp.db'}").start()
        try:
            yield srv
        finally:
            srv.stop()
        return
    if pg_bindir() is None:
        pytest.skip("PostgreSQL is not installed (./scripts/setup --test)")
    with pg_cluster(max_connections=50) as url:
        srv = Server(tmp, url).start()
        try:
            yield srv
        finally:
            srv.stop()


def _workspace(srv: Server, ws: str, stores: tuple[str, ...] = (), access: str = "read_write") -> str:
    async def go() -> str:
        async with ApiClient(srv.url, srv.admin_token) as c:
            await c.create_workspace(ws, default_store=False)
            for s in stores:
                await c.create_store(s)
                await c.attach(ws, s, access=access)
            return (await c.create_token(workspace=ws, name=f"sdk-{ws}")).token
    return trio.run(go)


def client(srv: Server, token: str) -> Anthropic:
    return Anthropic(base_url=srv.url, api_key=token, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def ws_token(server) -> str:
    return _workspace(server, "ws")


@pytest.fixture(scope="module")
def admin(server) -> Anthropic:
    return client(server, server.admin_token)


@pytest.fixture(scope="module")
def agent(server, ws_token) -> Anthropic:
    return client(server, ws_token)


@pytest.fixture(scope="module")
def notes(admin) -> str:
    """A store attached read-write to workspace ``ws`` (created through the SDK)."""
    return admin.beta.memory_stores.create(name="Agent Notes", workspace_id="ws").id


# ---------------------------------------------------------------- memory stores


def test_store_lifecycle(server, admin, agent, ws_token):
    ms = admin.beta.memory_stores
    a = ms.create(name="User Preferences!", description="what the user likes",
                  metadata={"owner": "alice"}, workspace_id="ws")
    assert a.type == "memory_store" and a.id == "memstore_user-preferences"
    assert (a.name, a.description, a.metadata, a.archived_at) == (
        "User Preferences!", "what the user likes", {"owner": "alice"}, None)
    b = ms.create(name="user preferences")  # names need not be unique: the slug gets a suffix
    assert b.id == "memstore_user-preferences-2" and b.description == "" and b.metadata == {}

    got = ms.retrieve(a.id)
    assert got == a
    upd = ms.update(a.id, name="Prefs", metadata={"owner": None, "team": "x"})
    assert (upd.name, upd.description, upd.metadata) == ("Prefs", "what the user likes", {"team": "x"})
    assert upd.updated_at >= a.updated_at and upd.created_at == a.created_at
    assert upd.id == a.id  # a rename keeps the id (and the slug: the mount directory)

    with pytest.raises(anthropic.BadRequestError):
        ms.update(a.id, metadata={f"k{i}": "v" for i in range(17)})
    with pytest.raises(anthropic.BadRequestError):
        ms.create(name="")
    with pytest.raises(anthropic.BadRequestError):
        ms.create(name="x", description="d" * 1025)

    # the store is memfuse's: its description reaches memfuse's own API and the prompt block
    st = server.call("get_store", "user-preferences")
    assert st.description == "what the user likes"

    # listing: newest first, pages through the SDK's own paginator
    ids = [s.id for s in ms.list(limit=1)]
    assert ids.index(b.id) < ids.index(a.id)
    page = ms.list(limit=1)
    assert len(page.data) == 1 and page.next_page
    # an admin's workspace_id scopes the listing to that workspace's attachments
    scoped = {s.id for s in ms.list(workspace_id="ws")}
    assert a.id in scoped and b.id not in scoped
    # a workspace token sees the stores attached to its workspace only, and cannot create one
    seen = {s.id for s in agent.beta.memory_stores.list()}
    assert a.id in seen and b.id not in seen
    with pytest.raises(anthropic.PermissionDeniedError):
        agent.beta.memory_stores.create(name="mine")
    with pytest.raises(anthropic.NotFoundError):
        agent.beta.memory_stores.retrieve(b.id)
    # another workspace of its account: 403; a missing one (or another account's): 404, as
    # memfuse's own API answers a workspace in a path
    server.call("create_workspace", "other", default_store=False)
    with pytest.raises(anthropic.PermissionDeniedError):
        agent.beta.memory_stores.list(workspace_id="other")
    with pytest.raises(anthropic.PermissionDeniedError):
        agent.beta.memory_stores.memories.list(a.id, workspace_id="other")
    with pytest.raises(anthropic.NotFoundError):
        agent.beta.memory_stores.list(workspace_id="nowhere")
    with pytest.raises(anthropic.NotFoundError):
        ms.list(workspace_id="nowhere")
    assert agent.beta.memory_stores.retrieve(a.id, workspace_id="wrkspc_ws").id == a.id
    # created_at filters
    assert b.id in {s.id for s in ms.list(created_at_gte=b.created_at)}
    assert b.id not in {s.id for s in ms.list(created_at_lte=a.created_at)}

    # archive: irreversible; reads, deletes and redaction go on, writes and updates do not
    m = agent.beta.memory_stores.memories.create(a.id, path="/likes.md", content="tea\n")
    arch = ms.archive(a.id)
    assert arch.archived_at is not None
    assert ms.archive(a.id).archived_at == arch.archived_at
    assert a.id not in {s.id for s in ms.list()}
    assert a.id in {s.id for s in ms.list(include_archived=True)}
    with pytest.raises(anthropic.BadRequestError):
        ms.update(a.id, description="new")
    with pytest.raises(anthropic.BadRequestError):
        agent.beta.memory_stores.memories.create(a.id, path="/more.md", content="x")
    with pytest.raises(anthropic.BadRequestError):
        agent.beta.memory_stores.memories.update(m.id, memory_store_id=a.id, content="coffee\n")
    assert agent.beta.memory_stores.memories.retrieve(m.id, memory_store_id=a.id).content == "tea\n"
    # memfuse's own API and faces meet the archive too: the prompt block says it, no record
    # writes, no new attachment
    assert "## Store `user-preferences` at `/mnt/memory/user-preferences/` (read-only, archived)" in \
        server.call("context", "ws", token=ws_token)
    with pytest.raises(Exception, match="store_archived"):
        server.call("create_record", "user-preferences", "x.md", "x", token=ws_token)
    server.call("create_workspace", "ws2", default_store=False)
    with pytest.raises(Exception, match="store_archived"):
        server.call("attach", "ws2", "user-preferences")
    server.call("attach", "ws2", "user-preferences-2")  # a store not archived: fine
    assert agent.beta.memory_stores.memories.delete(m.id, memory_store_id=a.id).type == "memory_deleted"
    first = ms.memory_versions.list(a.id, memory_id=m.id, operation="created").data[0]
    assert ms.memory_versions.redact(first.id, memory_store_id=a.id).redacted_at is not None

    # delete: the store, its records and versions go
    gone = ms.delete(a.id)
    assert (gone.type, gone.id) == ("memory_store_deleted", a.id)
    with pytest.raises(anthropic.NotFoundError):
        ms.retrieve(a.id)
    with pytest.raises(Exception, match="store_not_found"):
        server.call("get_store", "user-preferences")
    with pytest.raises(anthropic.PermissionDeniedError):
        agent.beta.memory_stores.delete(b.id)


# ---------------------------------------------------------------- memories


def test_memories(server, agent, notes):
    mem = agent.beta.memory_stores.memories
    m = mem.create(notes, path="/notes/todo.md", content="- buy milk\n")
    assert m.type == "memory" and m.id.startswith("mem_") and m.memory_version_id.startswith("memver_")
    assert (m.path, m.content, m.content_sha256, m.content_size_bytes, m.memory_store_id) == (
        "/notes/todo.md", None, sha("- buy milk\n"), 11, notes)
    assert mem.retrieve(m.id, memory_store_id=notes).content == "- buy milk\n"
    assert mem.retrieve(m.id, memory_store_id=notes, view="basic").content is None
    empty = mem.create(notes, path="/empty.md", content="", view="full")
    assert (empty.content, empty.content_size_bytes, empty.content_sha256) == ("", 0, sha(""))

    # the same record through memfuse's own API
    rec = server.call("get_record", "agent-notes", server_record_id(m.id))
    assert (rec.path, rec.content, rec.sha256) == ("notes/todo.md", "- buy milk\n", m.content_sha256)

    # update under a content_sha256 precondition; a stale one is 409 and changes nothing
    u = mem.update(m.id, memory_store_id=notes, content="- buy oat milk\n",
                   precondition={"type": "content_sha256", "content_sha256": m.content_sha256})
    assert u.content_sha256 == sha("- buy oat milk\n") and u.memory_version_id != m.memory_version_id
    sent = []
    retrying = Anthropic(base_url=server.url, api_key=agent.api_key, max_retries=2,
                         http_client=anthropic.DefaultHttpxClient(event_hooks={"request": [sent.append]}))
    with pytest.raises(anthropic.ConflictError) as err:
        retrying.beta.memory_stores.memories.update(
            m.id, memory_store_id=notes, content="lost",
            precondition={"type": "content_sha256", "content_sha256": m.content_sha256})
    assert len(sent) == 1  # x-should-retry: false: the SDK, which retries a 409, did not
    assert err.value.body["error"]["type"] == "memory_precondition_failed_error"
    assert mem.retrieve(m.id, memory_store_id=notes).content == "- buy oat milk\n"

    # a no-op update makes no version; a rename keeps the id
    n_before = len(list(agent.beta.memory_stores.memory_versions.list(notes, memory_id=m.id)))
    same = mem.update(m.id, memory_store_id=notes, content="- buy oat milk\n")
    assert same.memory_version_id == u.memory_version_id
    assert len(list(agent.beta.memory_stores.memory_versions.list(notes, memory_id=m.id))) == n_before
    r = mem.update(m.id, memory_store_id=notes, path="/archive/todo.md", view="full")
    assert (r.id, r.path, r.content) == (m.id, "/archive/todo.md", "- buy oat milk\n")
    both = mem.update(m.id, memory_store_id=notes, path="/notes/todo.md", content="done\n",
                      precondition={"type": "content_sha256", "content_sha256": u.content_sha256})
    assert (both.id, both.path, both.content_sha256) == (m.id, "/notes/todo.md", sha("done\n"))
    # a rename and a content change are one transaction: a refused content moves nothing
    with pytest.raises(anthropic.BadRequestError):
        mem.update(m.id, memory_store_id=notes, path="/moved.md",
                   content="token: " + "gh" + "p_" + secrets.token_hex(18) + "\n")
    assert mem.retrieve(m.id, memory_store_id=notes).path == "/notes/todo.md"
    with pytest.raises(anthropic.ConflictError) as err:
        mem.update(m.id, memory_store_id=notes, path="/empty.md")
    assert err.value.body["error"]["type"] == "memory_path_conflict_error"
    with pytest.raises(anthropic.ConflictError):
        mem.create(notes, path="/notes/todo.md", content="dup")

    # path rules
    for bad in ("notes/x.md", "/a//b.md", "/a/../b.md", "/./b.md", "/e\u0301.md", "/a\x07.md",
                "/a\u200b.md", "/a\u2028.md", "/" + "x" * 1024, "/" + "/".join("d" * 21)):
        with pytest.raises(anthropic.BadRequestError):
            mem.create(notes, path=bad, content="x")
    nfc = mem.create(notes, path="/caf\u00e9.md", content="ok")
    assert nfc.path == "/caf\u00e9.md"

    # delete under expected_content_sha256
    with pytest.raises(anthropic.ConflictError):
        mem.delete(nfc.id, memory_store_id=notes, expected_content_sha256=sha("other"))
    assert mem.delete(nfc.id, memory_store_id=notes, expected_content_sha256=sha("ok")).id == nfc.id
    with pytest.raises(anthropic.NotFoundError):
        mem.retrieve(nfc.id, memory_store_id=notes)
    with pytest.raises(anthropic.NotFoundError):
        mem.delete(nfc.id, memory_store_id=notes)
    with pytest.raises(anthropic.NotFoundError):
        mem.retrieve("mem_" + "0" * 32, memory_store_id=notes)


def server_record_id(mem_id: str) -> str:
    import uuid

    return str(uuid.UUID(hex=mem_id.removeprefix("mem_")))


def test_listing(agent, admin):
    store = admin.beta.memory_stores.create(name="listing", workspace_id="ws").id
    mem = agent.beta.memory_stores.memories
    paths = ["/a.md", "/notes/one.md", "/notes/two.md", "/notes/deep/x.md", "/notes/deep/y/z.md",
             "/notes-archive/old.md", "/zeta/q.md"]
    for p in paths:
        mem.create(store, path=p, content=p)

    def listed(**kw) -> list[tuple[str, str]]:
        return [(i.type, i.path) for i in mem.list(store, **kw)]

    assert listed() == [("memory", p) for p in sorted(paths, key=lambda s: s.encode())]
    # whole segments: /notes/ is not /notes-archive/
    assert {p for _, p in listed(path_prefix="/notes/")} == {
        "/notes/one.md", "/notes/two.md", "/notes/deep/x.md", "/notes/deep/y/z.md"}
    assert listed(path_prefix="/notes/", depth=1) == [
        ("memory_prefix", "/notes/deep/"), ("memory", "/notes/one.md"), ("memory", "/notes/two.md")]
    assert listed(depth=1) == [("memory", "/a.md"), ("memory_prefix", "/notes-archive/"),
                               ("memory_prefix", "/notes/"), ("memory_prefix", "/zeta/")]
    assert listed(path_prefix="/notes/", depth=2) == [
        ("memory", "/notes/deep/x.md"), ("memory_prefix", "/notes/deep/y/"),
        ("memory", "/notes/one.md"), ("memory", "/notes/two.md")]
    # pages of 2 (prefix items count), walked by the SDK's paginator; same result
    assert listed(depth=1, limit=2) == listed(depth=1)
    first = mem.list(store, limit=2)
    assert len(first.data) == 2 and first.next_page and first.has_next_page()
    assert listed(limit=3) == listed()
    full = list(mem.list(store, view="full", path_prefix="/zeta/"))
    assert [(i.path, i.content, i.content_sha256) for i in full] == [("/zeta/q.md", "/zeta/q.md", sha("/zeta/q.md"))]
    assert all(i.content is None for i in mem.list(store))
    # a listed memory is the retrieved one, member for member (the listing builds its JSON
    # without the models)
    for item in mem.list(store, path_prefix="/notes/"):
        assert item == mem.retrieve(item.id, memory_store_id=store, view="basic")
        assert item.to_dict() == mem.retrieve(item.id, memory_store_id=store, view="basic").to_dict()
    for item in mem.list(store, path_prefix="/notes/", view="full"):
        assert item == mem.retrieve(item.id, memory_store_id=store)
    assert len(mem.list(store, view="full", limit=100).data) == len(paths)  # capped at 20 per page
    with pytest.raises(anthropic.BadRequestError):
        mem.list(store, path_prefix="/notes")
    with pytest.raises(anthropic.BadRequestError):
        mem.list(store, limit=101)
    with pytest.raises(anthropic.BadRequestError):
        mem.list(store, page="bogus")


def test_forged_pages_are_refused_as_bad_requests_never_500(server, ws_token, notes):
    """A ``page`` is opaque to the client: one forged with the right kind but another shape
    is a 400 ``invalid_request_error`` (which the SDK does not retry), never a 500
    ``api_error`` nor a listing from a value of another type (attack 12 A7)."""
    import base64
    import json

    def page(value: object) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")

    url = f"{server.url}/v1/memory_stores"
    hdr = {"x-api-key": ws_token, "anthropic-version": "2023-06-01", "anthropic-beta": "agent-memory-2026-07-22"}
    forged = {
        f"{url}/{notes}/memories": [
            {"k": "m", "q": ["", 0], "a": 5}, {"k": "m", "q": ["", 0], "a": ["zz"]}, {"k": "m", "q": ["", 0]},
            {"k": "m", "q": ["", 0], "a": ["m", "x", 7]}, {"k": "m", "q": ["", 0], "a": ["q", "x"]},
            {"k": "m", "q": "x", "a": ["p", "x"]}, {"k": "m", "q": ["", 2 ** 70], "a": ["p", "x"]}],
        f"{url}/{notes}/memory_versions": [
            {"k": "v", "b": 2 ** 70}, {"k": "v", "b": [1]}, {"k": "v", "b": "x"}, {"k": "v", "b": True},
            {"k": "v", "b": -1}, {"k": "v"}],
        url: [{"k": "s", "t": "x", "s": "a"}, {"k": "s", "t": 1.0}, {"k": "s", "t": [1], "s": "a"},
              {"k": "s", "t": 1e300, "s": "a"}],
    }
    with httpx.Client(timeout=30) as h:
        for where, values in forged.items():
            for value in values:
                r = h.get(where, headers=hdr, params={"page": page(value)})
                assert r.status_code == 400, (where, value, r.status_code, r.text)
                assert r.json()["error"]["type"] == "invalid_request_error"
        # JSON the decoder cannot hold (nested deeper than the stack) and strings no listing
        # puts in a page (a lone surrogate, a NUL): 400 too, not a 500 with a traceback (attack 14 F2)
        raw = ["[" * 5000 + "]" * 5000, '{"k":"m","q":' + "[" * 3000 + "]" * 3000 + "}",
               '{"k":"m","q":["",0],"a":["m","\\ud800","x"]}', '{"k":"m","q":["\\udfff",0],"a":["p","x"]}',
               '{"k":"m","q":["",0],"a":["m","a\\u0000b","00000000-0000-0000-0000-000000000000"]}']
        for where in (f"{url}/{notes}/memories", f"{url}/{notes}/memory_versions", url):
            for text in raw:
                forged_page = base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")
                r = h.get(where, headers=hdr, params={"page": forged_page})
                assert r.status_code == 400, (where, text[:60], r.status_code, r.text[:300])
                assert r.json()["error"]["type"] == "invalid_request_error"
        # a page the listing made still pages on
        r = h.get(f"{url}/{notes}/memory_versions", headers=hdr, params={"limit": 1})
        assert r.status_code == 200
        nxt = r.json()["next_page"]
        if nxt:
            assert h.get(f"{url}/{notes}/memory_versions", headers=hdr,
                         params={"limit": 1, "page": nxt}).status_code == 200


# ---------------------------------------------------------------- versions


def test_versions(server, agent, admin, ws_token):
    store = admin.beta.memory_stores.create(name="history", workspace_id="ws").id
    mem = agent.beta.memory_stores.memories
    vers = agent.beta.memory_stores.memory_versions
    m = mem.create(store, path="/h.md", content="v1")
    mem.update(m.id, memory_store_id=store, content="v2")
    mem.update(m.id, memory_store_id=store, path="/h2.md")
    other = mem.create(store, path="/other.md", content="o")
    mem.delete(m.id, memory_store_id=store)

    vs = list(vers.list(store, memory_id=m.id))
    assert [v.operation for v in vs] == ["deleted", "modified", "modified", "created"]  # newest first
    deleted, renamed, edited, created = vs
    assert (created.path, created.content_sha256, created.content_size_bytes, created.content) == (
        "/h.md", sha("v1"), 2, None)
    assert (deleted.path, deleted.content, deleted.content_sha256, deleted.content_size_bytes) == (
        "/h2.md", None, None, None)
    assert renamed.path == "/h2.md" and edited.path == "/h.md"
    assert created.created_by.type == "api_actor" and created.created_by.api_key_id == "ws:ws/api"
    assert all(v.memory_id == m.id and v.memory_store_id == store and v.type == "memory_version" for v in vs)
    full = vers.retrieve(edited.id, memory_store_id=store)
    assert full.content == "v2" and full.redacted_at is None
    assert vers.retrieve(edited.id, memory_store_id=store, view="basic").content is None
    assert [v.content for v in vers.list(store, memory_id=m.id, view="full")] == [None, "v2", "v2", "v1"]

    # filters
    assert [v.memory_id for v in vers.list(store, operation="created")] == [other.id, m.id]
    assert {v.id for v in vers.list(store, operation="deleted")} == {deleted.id}
    assert [v.id for v in vers.list(store, created_at_gte=deleted.created_at)] == [deleted.id]
    assert created.id in {v.id for v in vers.list(store, created_at_lte=created.created_at)}
    assert len(list(vers.list(store, api_key_id="ws:ws/api"))) == 5
    assert list(vers.list(store, api_key_id="admin:static")) == []
    assert list(vers.list(store, service_account_id="svac_x")) == []
    assert list(vers.list(store, session_id="nobody")) == []
    pages = vers.list(store, limit=2)
    assert len(pages.data) == 2 and pages.next_page
    assert [v.id for v in vers.list(store, limit=2)] == [v.id for v in vers.list(store)]
    with pytest.raises(anthropic.BadRequestError):
        vers.list(store, operation="moved")
    with pytest.raises(anthropic.NotFoundError):
        vers.retrieve("memver_999999999", memory_store_id=store)

    # redaction: admin only; not the current version of a live memory
    with pytest.raises(anthropic.PermissionDeniedError):
        vers.redact(created.id, memory_store_id=store)
    red = admin.beta.memory_stores.memory_versions.redact(created.id, memory_store_id=store)
    assert red.redacted_at is not None and red.redacted_by.type == "api_actor"
    assert (red.content, red.path, red.content_sha256, red.content_size_bytes) == (None, None, None, None)
    assert red.created_by == created.created_by and red.operation == "created"
    assert vers.retrieve(created.id, memory_store_id=store).redacted_at == red.redacted_at
    cur = vers.list(store, memory_id=other.id).data[0]
    with pytest.raises(anthropic.ConflictError):
        admin.beta.memory_stores.memory_versions.redact(cur.id, memory_store_id=store)
    # memfuse's own API shows the same redaction
    rv = server.call("version", "history", server_record_id(m.id), 1)
    assert rv.redacted and rv.content is None


# ---------------------------------------------------------------- the wire


def test_wire_and_errors(server, ws_token, notes):
    url = f"{server.url}/v1/memory_stores"
    with httpx.Client(timeout=30) as h:
        r = h.get(url)
        assert r.status_code == 401 and r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "authentication_error"
        r = h.get(url, headers={"x-api-key": "nope"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        hdr = {"x-api-key": ws_token, "anthropic-version": "2023-06-01", "anthropic-beta": "agent-memory-2026-07-22"}
        r = h.get(url, headers=hdr)
        assert r.status_code == 200 and set(r.json()) == {"data", "next_page"}
        r = h.get(f"{url}/memstore_nope", headers=hdr)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert r.headers["x-should-retry"] == "false" and r.json()["request_id"].startswith("req_")
        r = h.post(f"{url}/{notes}/memories", headers=hdr, json={"path": "/x.md"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = h.post(f"{url}/{notes}/memories", headers=hdr, json={"path": "/x.md", "content": "x", "extra": 1})
        assert r.status_code == 400
        r = h.get(url, headers={**hdr, "anthropic-workspace-id": "wrkspc_ws"})
        assert r.status_code == 200
        # created_at filters are RFC 3339 date-times, as the OpenAPI document says
        r = h.get(url, headers=hdr, params={"created_at[gte]": "1.5e-198"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = h.get(url, headers=hdr, params={"created_at[gte]": "2020-01-01T00:00:00Z"})
        assert r.status_code == 200
        # the front door's refusals, before the body is read, are in the same envelope: a body
        # past the endpoint's limit (declared; never sent) is 413 request_too_large
        import json
        import socket

        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(f"POST /v1/memory_stores/{notes}/memories HTTP/1.1\r\nHost: x\r\n"
                         f"x-api-key: {ws_token}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {64 << 20}\r\n\r\n".encode())
            raw = b""
            while b"\r\n\r\n" not in raw or len(raw.split(b"\r\n\r\n", 1)[1]) < int(
                    re.search(rb"(?i)content-length: (\d+)", raw).group(1)):
                piece = sock.recv(65536)
                assert piece, raw
                raw += piece
        head, body = raw.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 413") and b"content-type: application/json\r\n" in head.lower(), head
        err = json.loads(body)
        assert err["type"] == "error" and err["error"]["type"] == "request_too_large"
        assert err["request_id"].startswith("req_")
    # the document declares these refusals: the envelope, not the app's problem+json
    doc = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    op = doc["paths"]["/v1/memory_stores/{memory_store_id}/memories"]["post"]
    assert {"400", "401", "404", "409", "413", "429", "503"} <= set(op["responses"])
    assert "422" not in op["responses"] and "4XX" not in op["responses"]
    assert op["responses"]["413"]["content"] == {
        "application/json": {"schema": {"$ref": "#/components/schemas/AnthropicErrorResponse"}}}
    assert {"AnthropicApiKey": []} in op["security"]
    with pytest.raises(anthropic.AuthenticationError):
        client(server, "wrong").beta.memory_stores.list()
    # the secret rule of memfuse holds here too: 400, nothing stored
    with pytest.raises(anthropic.BadRequestError):
        client(server, ws_token).beta.memory_stores.memories.create(
            notes, path="/key.md", content="token: " + "gh" + "p_" + secrets.token_hex(18) + "\n")


# ---------------------------------------------------------------- the SDK's session sync helper


def test_session_sync_through_mount(server, tmp_path):
    """``SessionMemoryStores`` (the SDK's self-hosted session worker's sync) downloads a store
    into a directory, pushes a local edit and a new file back, and pulls a change an agent
    made meanwhile through a memfuse mount of the same store."""
    if "postgres" in str(server.tmp):
        pytest.skip("the mount half runs once, on SQLite")
    from anthropic.lib.tools._memories import MARKER_PATH, SessionMemoryStores
    from anthropic.types.beta.sessions import BetaManagedAgentsMemoryStoreResource

    tok = _workspace(server, "syncws", stores=("shared",))
    token_file = tmp_path / "syncws.token"
    token_file.write_text(tok)
    sdk = client(server, tok)
    store = "memstore_shared"
    mem = sdk.beta.memory_stores.memories
    mem.create(store, path="/prefs.md", content="tea\n")
    mem.create(store, path="/projects/plan.md", content="step 1\n")

    mnt = tmp_path / "mnt"
    sc = Sidecar(server, "syncws", token_file, mnt, tmp_path / "cache").start(expect="shared")
    try:
        wait_until(lambda: (mnt / "shared" / "projects" / "plan.md").exists(), 30, "the mount shows the store")
        root = tmp_path / "session" / "shared"

        async def run() -> None:
            async with AsyncAnthropic(base_url=server.url, api_key=tok, max_retries=2, timeout=30) as aclient:
                stores = SessionMemoryStores(aclient, workdir=tmp_path / "work")
                res = BetaManagedAgentsMemoryStoreResource.model_construct(
                    type="memory_store", memory_store_id=store, mount_path=str(root), access="read_write",
                    name="shared")
                session = type("Session", (), {"resources": [res]})()
                await stores.download(session)
                assert (root / "prefs.md").read_text() == "tea\n"
                assert (root / "projects" / "plan.md").read_text() == "step 1\n"
                assert (root / MARKER_PATH).exists()

                # the session edits its copy; meanwhile an agent edits another file on the mount
                (root / "prefs.md").write_text("coffee\n")
                (root / "new.md").write_text("from the session\n")
                sh("printf 'step 1\\nstep 2\\n' > shared/projects/plan.md", cwd=mnt, timeout=30)
                await anyio.to_thread.run_sync(lambda: wait_until(
                    lambda: sdk.beta.memory_stores.memories.list(store, path_prefix="/projects/").data[0]
                    .content_sha256 == sha("step 1\nstep 2\n"), 30, "the mount's write reaches the server"))

                await stores.finish()  # the session's last sync: push, then pull
                assert (root / "projects" / "plan.md").read_text() == "step 1\nstep 2\n"
                await stores.dispose()

        anyio.run(run)
        wait_until(lambda: (mnt / "shared" / "new.md").exists()
                   and (mnt / "shared" / "prefs.md").read_text() == "coffee\n", 30,
                   "the session's sync reaches the mount")
        assert (mnt / "shared" / "new.md").read_text() == "from the session\n"
        assert not (mnt / "shared" / MARKER_PATH).exists()
        assert not root.exists()  # dispose removed the folder download made

        # the mount's write is a session_actor version; its filter finds exactly those
        plan = mem.list(store, path_prefix="/projects/").data[0]
        vs = list(sdk.beta.memory_stores.memory_versions.list(store, memory_id=plan.id))
        assert vs[0].created_by.type == "session_actor"
        sid = vs[0].created_by.session_id
        assert [v.id for v in sdk.beta.memory_stores.memory_versions.list(store, session_id=sid)] == [vs[0].id]

        # archived through the API, the store refuses the mount's writes too (EACCES at close)
        # and keeps serving reads
        client(server, server.admin_token).beta.memory_stores.archive(store)
        out = sh("python3 -c \"f = open('shared/late.md', 'w'); f.write('late'); f.close()\"",
                 cwd=mnt, timeout=30, check=False)
        assert out.returncode != 0 and "Permission denied" in out.stderr, (out.returncode, out.stderr)
        assert (mnt / "shared" / "prefs.md").read_text() == "coffee\n"
        assert [m.path for m in mem.list(store) if m.path == "/late.md"] == []

        # deleted through the API, the store leaves the mount (its workspace gets `detached`)
        client(server, server.admin_token).beta.memory_stores.delete(store)
        wait_until(lambda: not (mnt / "shared").exists(), 30, "the deleted store leaves the mount")
    finally:
        sc.stop()


def test_full_view_pages_bounded_in_bytes(agent, admin):
    """With ``view=full`` a page holds at most defs.PAGE_CONTENT_BYTES of content (at least one
    item), cut short with a ``next_page``; the SDK's auto-pager still lists every version and
    every memory exactly once, with its content."""
    from memfuse.defs import PAGE_CONTENT_BYTES

    big = 1_000_000  # 8 fit in a page's content budget, 9 do not
    assert 8 * big <= PAGE_CONTENT_BYTES < 9 * big

    def text(i: int) -> str:
        return (f"{i:03d}" * (big // 3 + 1))[:big]

    store = admin.beta.memory_stores.create(name="big pages", workspace_id="ws").id
    mem = agent.beta.memory_stores.memories
    m = mem.create(store, path="/big.md", content=text(0))
    for i in range(1, 10):
        mem.update(m.id, memory_store_id=store, content=text(i))
    versions = agent.beta.memory_stores.memory_versions
    first = versions.list(store, memory_id=m.id, view="full", limit=20)
    assert 1 <= len(first.data) <= 8 and first.has_next_page()
    listed = list(versions.list(store, memory_id=m.id, view="full", limit=20))
    assert [v.content for v in listed] == [text(i) for i in reversed(range(10))]
    assert len({v.id for v in listed}) == 10
    for i in range(1, 10):
        mem.create(store, path=f"/more/{i}.md", content=text(i))
    first_m = mem.list(store, view="full", limit=20)
    assert 1 <= len(first_m.data) <= 8 and first_m.has_next_page()
    got = [(x.path, x.content) for x in mem.list(store, view="full", limit=20)]
    assert got == [("/big.md", text(9))] + [(f"/more/{i}.md", text(i)) for i in range(1, 10)]


def test_full_view_pages_bounded_in_encoded_bytes(server, ws_token, admin):
    """A hostile writer's memories of control characters (``\x01`` is six bytes of JSON,
    ``\u0001``): a ``view=full`` page of memories or versions holds at most
    defs.PAGE_CONTENT_BYTES of *encoded* content (defs.json_rows_within; at least one item),
    not 8 MiB of raw content built into ~48 MiB of JSON per answer (attack 14 F6), and
    following ``next_page`` still yields every item once with its content."""
    import json

    from memfuse.defs import PAGE_CONTENT_BYTES

    ctl = 1_000_000  # 6 MB of JSON each: one per page by encoded bytes, eight by raw bytes

    def text(i: int) -> str:
        return chr(1) * (ctl - 1) + str(i)

    store = admin.beta.memory_stores.create(name="ctl pages", workspace_id="ws").id
    url = f"{server.url}/v1/memory_stores/{store}"
    hdr = {"x-api-key": ws_token, "anthropic-version": "2023-06-01", "anthropic-beta": "agent-memory-2026-07-22"}
    with httpx.Client(timeout=120, headers=hdr) as h:
        mid = None
        for i in range(3):  # three memories, the first with three versions
            r = h.post(f"{url}/memories", json={"path": f"/ctl/{i}.md", "content": text(i)})
            assert r.status_code == 200, r.text
            mid = mid or r.json()["id"]
        for i in (10, 11):
            r = h.post(f"{url}/memories/{mid}", json={"content": text(i)})
            assert r.status_code == 200, r.text

        def follow(where: str, params: dict[str, object]) -> list[tuple[str, str]]:
            got, page = [], None
            for _ in range(20):
                r = h.get(f"{url}/{where}", params={**params, "view": "full", "limit": 20,
                                                   **({"page": page} if page else {})})
                assert r.status_code == 200, r.text
                body = json.loads(r.content)
                encoded = sum(len(json.dumps(x["content"], ensure_ascii=False)) - 2 for x in body["data"])
                assert len(body["data"]) == 1 or encoded <= PAGE_CONTENT_BYTES, (where, len(body["data"]), encoded)
                assert len(r.content) < PAGE_CONTENT_BYTES + 64 * 1024, (where, len(r.content))
                got += [(x["id"], x["content"]) for x in body["data"]]
                page = body["next_page"]
                if page is None:
                    return got
            raise AssertionError(f"{where}: more than 20 pages")

        memories = follow("memories", {"path_prefix": "/ctl/"})
        assert [c for _, c in memories] == [text(11), text(1), text(2)]
        assert len({i for i, _ in memories}) == 3
        versions = follow("memory_versions", {"memory_id": mid})
        assert [c for _, c in versions] == [text(11), text(10), text(0)]
        assert len({i for i, _ in versions}) == 3
