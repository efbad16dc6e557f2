"""ApiClient against the in-process fake control plane (memfuse.fake), plus error
classification through the fake's fault injection and a few hand-made responses."""
from __future__ import annotations

import email.utils
import logging
import time

import httpx
import pytest
import stamina
import trio

from memfuse.client import (
    ApiClient,
    parse_retry_after,
    quote_etag,
    unquote_etag,
    with_retries,
)
from memfuse.errors import (
    ApiError,
    Conflict,
    Forbidden,
    Gone,
    NotFound,
    PermanentError,
    PreconditionFailed,
    StoreFull,
    TransientError,
    Unauthorized,
)
from memfuse.fake import FakeControlPlane
from memfuse.wire import Access, Operation, Record, sha256_hex, to_jsonable

SECRET_CONTENT = "the-content-must-never-leak-7f3a"


@pytest.fixture
async def fake():
    fcp = FakeControlPlane(seed=0)
    try:
        yield fcp
    finally:
        await fcp.aclose()


@pytest.fixture
async def admin(fake):
    async with ApiClient(fake.base_url, fake.admin_token, transport=fake.transport) as c:
        yield c


@pytest.fixture
async def ws(fake):
    """A workspace-scoped client for workspace ``ws`` with store ``default`` read_write."""
    token = await fake.setup("ws", stores=("default",))
    async with ApiClient(fake.base_url, token, transport=fake.transport, instance="side-1") as c:
        yield c


# ---------------------------------------------------------------- admin endpoints


async def test_admin_workspaces_stores_attachments_tokens(fake, admin):
    w = await admin.create_workspace("team", default_store=False)
    assert w.name == "team"
    assert "team" in [x.name for x in await admin.list_workspaces()]
    with pytest.raises(Conflict) as ei:
        await admin.create_workspace("team")
    assert ei.value.status == 409 and ei.value.code == "exists"

    s = await admin.create_store("notes", description="team notes", default_type="reference",
                                 max_record_bytes=4096, max_records=3)
    assert (s.slug, s.description, s.default_type, s.max_record_bytes, s.max_records) == (
        "notes", "team notes", "reference", 4096, 3)
    assert s.max_store_bytes == 64 << 20  # server default kept
    assert [x.slug for x in await admin.list_stores()] == ["notes"]
    assert (await admin.get_store("notes")).description == "team notes"
    with pytest.raises(Conflict):
        await admin.create_store("notes")

    u = await admin.update_store("notes", description="renamed")
    assert u.description == "renamed"
    assert u.max_record_bytes == 4096 and u.default_type == "reference"  # untouched
    u = await admin.update_store("notes", max_store_bytes=1 << 20, default_type="user")
    assert (u.max_store_bytes, u.default_type, u.description) == (1 << 20, "user", "renamed")

    a = await admin.attach("team", "notes", "read_only", "read before acting")
    assert (a.workspace, a.store.slug, a.access, a.instructions) == (
        "team", "notes", Access.read_only, "read before acting")
    atts = await admin.list_attachments("team")
    assert [(x.store.slug, x.access) for x in atts] == [("notes", Access.read_only)]
    a = await admin.attach("team", "notes", Access.read_write)
    assert a.access is Access.read_write

    ev = await admin.workspace_events("team", after=0)
    assert [e.kind for e in ev.events][:2] == ["attached", "attached"]
    assert ev.seq >= ev.events[-1].seq

    t = await admin.create_token(workspace="team", name="bot")
    assert t.workspace == "team" and t.name == "bot" and t.token
    async with ApiClient(fake.base_url, t.token, transport=fake.transport) as team:
        assert [x.store.slug for x in await team.list_attachments("team")] == ["notes"]
        with pytest.raises(Forbidden) as ei:
            await team.list_stores()  # admin only
        assert ei.value.status == 403
    adm = await admin.create_token(name="ops")
    assert adm.workspace is None
    async with ApiClient(fake.base_url, adm.token, transport=fake.transport) as ops:
        assert [x.slug for x in await ops.list_stores()] == ["notes"]

    await admin.detach("team", "notes")
    assert await admin.list_attachments("team") == []
    with pytest.raises(NotFound) as ei:
        await admin.detach("team", "notes")
    assert ei.value.status == 404
    ev2 = await admin.workspace_events("team", after=ev.seq)
    assert [(e.kind, e.store) for e in ev2.events] == [("detached", "notes")]

    with pytest.raises(NotFound) as ei:
        await admin.attach("nobody", "notes")
    assert ei.value.code == "workspace_not_found"


async def test_context(fake, admin, ws):
    await ws.create_record("default", "MEMORY.md", "- [prefs](prefs.md): user preferences\n")
    text = await ws.context("ws")
    assert "default" in text and "user preferences" in text
    text2 = await admin.context("ws", mount_root="/home/me/memory")
    assert "/home/me/memory/default" in text2


# ---------------------------------------------------------------- records


async def test_record_lifecycle(fake, ws):
    r = await ws.create_record("default", "notes/a.md", "---\ntype: user\n---\nhello\n")
    assert isinstance(r, Record)
    assert (r.path, r.type, r.version, r.deleted) == ("notes/a.md", "user", 1, False)
    assert r.sha256 == sha256_hex(b"---\ntype: user\n---\nhello\n")
    assert r.content is None
    assert r.updated_by == "ws:ws/side-1"  # X-Memfuse-Instance recorded

    got = await ws.get_record("default", r.id)
    assert got.content == "---\ntype: user\n---\nhello\n"
    assert (await ws.get_record("default", r.id, content=False)).content is None

    with pytest.raises(Conflict) as ei:
        await ws.create_record("default", "notes/a.md", "dup")
    assert ei.value.code == "path_exists" and ei.value.record_id == r.id

    u = await ws.update_record("default", r.id, "v2", type="feedback", if_match=r.sha256)
    assert (u.version, u.type, u.sha256) == (2, "feedback", sha256_hex(b"v2"))
    same = await ws.update_record("default", r.id, "v2", type="feedback", if_match=quote_etag(u.sha256))
    assert same.version == 2  # identical content: no new version

    with pytest.raises(PreconditionFailed) as ei:
        await ws.update_record("default", r.id, "v3", if_match=r.sha256)  # stale base
    assert ei.value.status == 412 and ei.value.current_sha256 == u.sha256

    found = await ws.find_record("default", "notes/a.md")
    assert found is not None and found.id == r.id
    assert await ws.find_record("default", "notes/none.md") is None

    with pytest.raises(PreconditionFailed):
        await ws.delete_record("default", r.id, if_match=r.sha256)
    await ws.delete_record("default", r.id, if_match=u.sha256)
    with pytest.raises(NotFound) as ei:
        await ws.delete_record("default", r.id)
    assert ei.value.code == "record_not_found"
    assert await ws.find_record("default", "notes/a.md") is None
    dead = await ws.find_record("default", "notes/a.md", include_deleted=True)
    assert dead is not None and dead.id == r.id and dead.deleted
    assert (await ws.get_record("default", r.id)).deleted

    vs = await ws.versions("default", r.id)
    assert [(v.version, v.operation) for v in vs] == [
        (1, Operation.created), (2, Operation.modified), (3, Operation.deleted)]
    assert all(v.content is None for v in vs)
    v1 = await ws.version("default", r.id, 1)
    assert v1.content == "---\ntype: user\n---\nhello\n"
    with pytest.raises(NotFound) as ei:
        await ws.version("default", r.id, 99)
    assert ei.value.code == "version_not_found"

    restored = await ws.restore("default", r.id, 1)
    assert (restored.version, restored.deleted, restored.path) == (4, False, "notes/a.md")
    assert (await ws.get_record("default", r.id)).content == v1.content

    # a new record at the path of a deleted one gets a new id; find_record prefers the live one
    await ws.delete_record("default", r.id)
    r2 = await ws.create_record("default", "notes/a.md", "new life")
    assert r2.id != r.id
    pick = await ws.find_record("default", "notes/a.md", include_deleted=True)
    assert pick is not None and pick.id == r2.id


async def test_redact_needs_admin(fake, admin, ws):
    r = await ws.create_record("default", "a.md", "secret-ish v1")
    await ws.update_record("default", r.id, "v2")
    with pytest.raises(Forbidden):
        await ws.redact("default", r.id, 1)
    v = await admin.redact("default", r.id, 1)
    assert v.redacted and v.content is None and v.version == 1
    assert (await ws.version("default", r.id, 1)).content is None
    with pytest.raises(Conflict) as ei:
        await admin.redact("default", r.id, 2)
    assert ei.value.code == "current_version"
    with pytest.raises(Conflict) as ei:
        await ws.restore("default", r.id, 1)
    assert ei.value.code == "redacted"


async def test_moves(fake, ws):
    a = await ws.create_record("default", "a.md", "A")
    b = await ws.create_record("default", "b.md", "B")
    res = await ws.move_record("default", a.id, "c.md")
    assert [(x.id, x.path) for x in res.records] == [(a.id, "c.md")]
    with pytest.raises(Conflict) as ei:
        await ws.move_record("default", a.id, "b.md")
    assert ei.value.code == "path_exists" and ei.value.record_id == b.id
    res = await ws.move_record("default", a.id, "b.md", replace=True)
    assert [x.id for x in res.records] == [b.id]
    assert (await ws.get_record("default", b.id)).content == "A"
    assert (await ws.get_record("default", a.id)).deleted

    for p in ("dir/x.md", "dir/sub/y.md", "dirx/z.md"):
        await ws.create_record("default", p, p)
    res = await ws.move_prefix("default", "dir", "moved/here")
    assert sorted(x.path for x in res.records) == ["moved/here/sub/y.md", "moved/here/x.md"]
    assert await ws.find_record("default", "dirx/z.md") is not None
    with pytest.raises(PermanentError) as ei:
        await ws.move_prefix("default", "moved", "moved/inner")
    assert ei.value.status == 422 and ei.value.code == "invalid_path"


async def test_snapshot_pages_and_changes(fake, ws):
    ids = {}
    for i in range(7):
        r = await ws.create_record("default", f"n/{i}.md", f"content {i}")
        ids[r.path] = r.id
    page = await ws.list_records("default", limit=3)
    assert len(page.records) == 3 and page.next_cursor
    assert all(r.content is None for r in page.records)
    pages = [p async for p in ws.iter_pages("default", limit=3)]
    assert [len(p.records) for p in pages] == [3, 3, 1]
    records, seq = await ws.snapshot("default", limit=3)
    assert [r.path for r in records] == sorted(ids)
    assert [r.content for r in records] == [f"content {i}" for i in range(7)]
    assert seq == pages[0].seq

    empty = await ws.changes("default", after=seq)
    assert empty.changes == [] and empty.seq == seq
    upd = await ws.update_record("default", ids["n/0.md"], "changed")
    await ws.move_record("default", ids["n/1.md"], "n/one.md")
    await ws.delete_record("default", ids["n/2.md"])
    ch = await ws.changes("default", after=seq)
    assert [(c.operation, c.record.path) for c in ch.changes] == [
        (Operation.modified, "n/0.md"), (Operation.moved, "n/one.md"), (Operation.deleted, "n/2.md")]
    assert ch.changes[0].record.content == "changed" and ch.changes[0].record.sha256 == upd.sha256
    assert ch.changes[1].old_path == "n/1.md"
    assert ch.changes[2].record.deleted
    no_content = await ws.changes("default", after=seq, content=False, limit=1)
    assert len(no_content.changes) == 1 and no_content.changes[0].record.content is None

    with pytest.raises(Gone) as ei:
        await ws.changes("default", after=ch.seq + 10_000)
    assert ei.value.status == 410 and ei.value.code == "cursor_expired"


async def test_long_polls_wake_on_change(fake, admin, ws):
    _, seq = await ws.snapshot("default")
    ev0 = (await ws.workspace_events("ws")).seq
    got: dict = {}

    async def poll_changes():
        got["changes"] = await ws.changes("default", after=seq, wait=20)

    async def poll_events():
        got["events"] = await ws.workspace_events("ws", after=ev0, wait=20)

    t0 = time.monotonic()
    async with trio.open_nursery() as n:
        n.start_soon(poll_changes)
        n.start_soon(poll_events)
        await trio.sleep(0.3)
        await ws.create_record("default", "late.md", "late")
        await admin.create_store("extra")
        await admin.attach("ws", "extra", "read_only")
    assert time.monotonic() - t0 < 10
    assert [c.record.path for c in got["changes"].changes] == ["late.md"]
    assert ("attached", "extra") in [(e.kind, e.store) for e in got["events"].events]


async def test_idempotency_key_replays(fake, ws):
    a = await ws.create_record("default", "k.md", "once", idempotency_key="key-1")
    b = await ws.create_record("default", "k.md", "once", idempotency_key="key-1")
    assert a.id == b.id and b.version == 1
    with pytest.raises(PermanentError) as ei:
        await ws.create_record("default", "other.md", "x", idempotency_key="key-1")
    assert ei.value.code == "idempotency_key_reused"


# ---------------------------------------------------------------- permanent errors


async def test_permanent_errors(fake, admin, ws):
    with pytest.raises(NotFound) as ei:
        await ws.list_records("nostore")
    assert ei.value.code in ("store_not_attached", "store_not_found")
    with pytest.raises(NotFound) as ei:
        await ws.get_record("default", "no-such-id")
    assert ei.value.code == "record_not_found" and not isinstance(ei.value, TransientError)

    async with ApiClient(fake.base_url, "wrong-token", transport=fake.transport) as bad:
        with pytest.raises(Unauthorized) as ei:
            await bad.list_attachments("ws")
    assert ei.value.status == 401 and "wrong-token" not in str(ei.value)

    ro_token = await fake.setup("reader", stores=("default",), access="read_only")
    async with ApiClient(fake.base_url, ro_token, transport=fake.transport) as ro:
        with pytest.raises(Forbidden) as ei:
            await ro.create_record("default", "x.md", "x")
        assert ei.value.code == "read_only"

    with pytest.raises(PermanentError) as ei:
        await ws.create_record("default", "bad/../path.md", "x")
    assert ei.value.status in (400, 422) and ei.value.code == "invalid_path"
    with pytest.raises(PermanentError) as ei:
        await ws.create_record("default", "t.md", "x", type="nonsense")
    assert ei.value.code == "invalid_type"

    await admin.create_store("tiny", max_record_bytes=10, max_records=1)
    await admin.attach("ws", "tiny")
    with pytest.raises(PermanentError) as ei:
        await ws.create_record("tiny", "big.md", "x" * 11)
    assert ei.value.status == 413 and ei.value.code == "record_too_large"
    await ws.create_record("tiny", "one.md", "1")
    with pytest.raises(StoreFull) as ei:
        await ws.create_record("tiny", "two.md", "2")
    assert ei.value.status == 507 and ei.value.code == "store_full"
    assert isinstance(ei.value, PermanentError) and not isinstance(ei.value, TransientError)


# ---------------------------------------------------------------- transient errors (fault injection)


async def test_outage_is_transient_connect_error(fake, ws):
    fake.faults.outage = True
    with pytest.raises(TransientError) as ei:
        await ws.list_attachments("ws")
    e = ei.value
    assert e.status is None and e.code == "connect_error" and e.retry_after is None
    assert "unreachable" in str(e)
    fake.faults.outage = False
    assert [a.store.slug for a in await ws.list_attachments("ws")] == ["default"]


async def test_dropped_response_is_transient_and_idempotent_retry_is_safe(fake, ws):
    fake.faults.drop_rate = 1.0
    with pytest.raises(TransientError) as ei:
        await ws.create_record("default", "d.md", SECRET_CONTENT, idempotency_key="drop-1")
    assert ei.value.code == "read_error" and ei.value.status is None
    assert SECRET_CONTENT not in str(ei.value) and SECRET_CONTENT not in repr(ei.value)
    assert fake.counters.dropped == 1
    fake.faults.drop_rate = 0.0
    # the write was applied; the retry with the same key replays it instead of a 409
    r = await ws.create_record("default", "d.md", SECRET_CONTENT, idempotency_key="drop-1")
    assert r.version == 1
    records, _ = await ws.snapshot("default")
    assert [x.path for x in records] == ["d.md"]


async def test_503_and_429_are_transient_with_retry_after(fake, ws):
    fake.faults.error_rate = 1.0
    with pytest.raises(TransientError) as ei:
        await ws.list_records("default")
    assert ei.value.status == 503 and ei.value.code == "unavailable"
    fake.faults.error_rate = 0.0
    fake.faults.rate_429 = 1.0
    with pytest.raises(TransientError) as ei:
        await ws.list_records("default")
    assert ei.value.status == 429 and ei.value.retry_after == 0.0
    assert fake.counters.errors_503 == 1 and fake.counters.rate_limited_429 == 1


async def test_precondition_race_is_412(fake, ws):
    r = await ws.create_record("default", "race.md", "base")
    fake.faults.precondition_race = 1
    with pytest.raises(PreconditionFailed) as ei:
        await ws.update_record("default", r.id, "mine", if_match=r.sha256)
    current = await ws.get_record("default", r.id)
    assert ei.value.current_sha256 == current.sha256 != r.sha256
    # last writer wins on top of the current version
    mine = await ws.update_record("default", r.id, "mine", if_match=ei.value.current_sha256)
    assert mine.version == current.version + 1


def _mock_client(handler, **kw) -> ApiClient:
    return ApiClient("http://mock", "tok-secret-123", transport=httpx.MockTransport(handler), **kw)


@pytest.mark.parametrize("retry_after", ["0", "-1", "Thu, 01 Jan 1970 00:00:00 GMT"])
async def test_a_share_refusal_with_no_wait_is_not_sent_again_at_once(retry_after):
    """A 429 ``too_many_requests`` whose ``Retry-After`` asks no wait (0, negative, a past
    date) is sent again after a floor that doubles (``SHARE_RETRY_MIN``), never in a tight
    loop (verify26: a proxy answering ``Retry-After: 0`` drew ~2,000 requests a second)."""
    calls: list[float] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(time.monotonic())
        if len(calls) <= 5:
            return httpx.Response(429, headers={"Retry-After": retry_after},
                                  json={"title": "Too Many Requests", "status": 429, "code": "too_many_requests"})
        return httpx.Response(200, json={"slug": "s", "records": 0})

    from memfuse.client.base import SHARE_RETRY_MIN
    c = _mock_client(handler)
    try:
        await c._request("GET", "/v1/stores/s")
    finally:
        await c.aclose()
    assert len(calls) == 6
    gaps = [b - a for a, b in zip(calls, calls[1:])]
    for i, gap in enumerate(gaps):  # jitter: at least half the floor, which doubles
        assert gap >= SHARE_RETRY_MIN * 2 ** i * 0.5 * 0.99, gaps


async def test_classification_of_handmade_responses():
    date = email.utils.formatdate(time.time() + 30, usegmt=True)
    answers = {
        "/v1/stores/a": httpx.Response(503, headers={"Retry-After": "7"}, text="<html>down</html>"),
        "/v1/stores/b": httpx.Response(429, headers={"Retry-After": date},
                                       json={"title": "Too Many Requests", "status": 429, "code": "rate_limited"}),
        "/v1/stores/c": httpx.Response(500, json={"title": "Internal Server Error", "status": 500}),
        "/v1/stores/d": httpx.Response(200, text="not json"),
        "/v1/stores/e": httpx.Response(418, text="teapot"),
        "/v1/stores/f": httpx.Response(422, json={"title": "Unprocessable", "status": 422,
                                                  "detail": [{"loc": ["body", "content"], "msg": "bad",
                                                              "input": SECRET_CONTENT}]}),
    }

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/stores/t":
            raise httpx.ReadTimeout("timed out", request=request)
        if request.url.path == "/v1/stores/p":
            raise httpx.RemoteProtocolError("peer closed connection", request=request)
        return answers[request.url.path]

    async with _mock_client(handler) as c:
        async def err(slug):
            with pytest.raises(ApiError) as ei:
                await c.get_store(slug)
            return ei.value

        e = await err("a")
        assert type(e) is TransientError and e.status == 503 and e.retry_after == 7.0
        assert e.problem["status"] == 503
        e = await err("b")
        assert type(e) is TransientError and e.code == "rate_limited" and 25 <= e.retry_after <= 31
        e = await err("c")
        assert type(e) is TransientError and e.retry_after is None
        e = await err("d")
        assert type(e) is TransientError and e.code == "bad_response"
        e = await err("e")
        assert type(e) is PermanentError and e.status == 418
        e = await err("f")
        assert type(e) is PermanentError and "\n" not in str(e)
        assert e.detail == "body.content: bad" and SECRET_CONTENT not in f"{e} {e!r} {e.problem}"
        e = await err("t")
        assert type(e) is TransientError and e.code == "read_timeout" and e.status is None
        e = await err("p")
        assert type(e) is TransientError and e.code == "protocol_error"


async def test_headers_timeouts_and_etag_quoting():
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path.endswith("/changes"):
            return httpx.Response(200, json={"changes": [], "seq": 5})
        return httpx.Response(204)

    async with _mock_client(handler, instance="pod-7", timeout=3.0) as c:
        await c.changes("s", after=5, wait=25)
        await c.delete_record("s", "r1", if_match="abc", idempotency_key="k1")
        await c.delete_record("s", "r1", if_match='"abc"')
    poll, d1, d2 = seen
    assert poll.headers["Authorization"] == "Bearer tok-secret-123"
    assert poll.headers["X-Memfuse-Instance"] == "pod-7"
    assert poll.url.params["after"] == "5" and poll.url.params["wait"] == "25"
    assert poll.extensions["timeout"]["read"] == 28.0  # wait + timeout
    assert d1.extensions["timeout"]["read"] == 3.0
    assert d1.headers["If-Match"] == '"abc"' and d1.headers["Idempotency-Key"] == "k1"
    assert d2.headers["If-Match"] == '"abc"' and "Idempotency-Key" not in d2.headers
    assert quote_etag("*") == "*" and quote_etag('W/"x"') == 'W/"x"'
    assert unquote_etag('W/"abc"') == "abc" and unquote_etag('"abc"') == "abc" and unquote_etag(None) is None
    assert parse_retry_after("3") == 3.0 and parse_retry_after("soon") is None and parse_retry_after(None) is None
    assert parse_retry_after("-5") == 0.0


async def test_no_token_or_content_in_errors_or_logs(fake, ws, caplog):
    caplog.set_level(logging.DEBUG)
    token = ws._http.headers["Authorization"].split()[1]
    errors: list[ApiError] = []
    for faults in ({"drop_rate": 1.0}, {"error_rate": 1.0}, {"outage": True}, {}):
        fake.faults.reset()
        for k, v in faults.items():
            setattr(fake.faults, k, v)
        try:
            await ws.create_record("default", "x/../bad.md" if not faults else "s.md", SECRET_CONTENT)
        except ApiError as e:
            errors.append(e)
    assert len(errors) == 4
    text = "\n".join(f"{e}\n{e!r}\n{e.problem}\n{e.detail}" for e in errors) + "\n" + caplog.text
    assert token not in text and SECRET_CONTENT not in text
    assert token not in repr(ws)


async def test_with_retries_helper(fake, ws):
    stamina.set_testing(True, attempts=3)
    try:
        calls = 0

        async def flaky():
            nonlocal calls
            calls += 1
            if calls < 3:
                raise TransientError("down", status=503, retry_after=0.0)
            return "ok"

        assert await with_retries(flaky) == "ok" and calls == 3

        calls = 0

        async def refused():
            nonlocal calls
            calls += 1
            raise NotFound("nope", status=404)

        with pytest.raises(NotFound):
            await with_retries(refused)
        assert calls == 1

        # against the fake: one injected 503 then success
        fake.faults.error_rate = 1.0
        attempts = 0

        async def list_once():
            nonlocal attempts
            attempts += 1
            if attempts == 2:
                fake.faults.error_rate = 0.0
            return await ws.list_attachments("ws")

        atts = await with_retries(list_once)
        assert [a.store.slug for a in atts] == ["default"] and attempts == 2

        fake.faults.outage = True
        with pytest.raises(TransientError):
            await with_retries(lambda: ws.list_attachments("ws"))
        assert fake.counters.outage_refused == 3
    finally:
        stamina.set_testing(False)


def test_error_classes_stay_importable_from_client():
    """memfuse.errors holds them; memfuse.client re-exports the same objects for callers
    outside the package."""
    import errno

    import memfuse.client as client_mod
    import memfuse.errors as errors_mod
    import memfuse.sidecar.committer as committer_mod

    for name in errors_mod.__all__:
        if isinstance(getattr(errors_mod, name), type) or name == "ERRNO_BY_CODE":
            assert getattr(client_mod, name) is getattr(errors_mod, name), name
    assert committer_mod.errno_for is errors_mod.errno_for  # the one table, applied
    assert errors_mod.ERRNO_BY_CODE["store_full"] == errno.ENOSPC
    assert issubclass(StoreFull, PermanentError) and issubclass(TransientError, ApiError)


async def test_snapshot_and_iter_pages_with_deleted_records(ws):
    ids = [(await ws.create_record("default", f"r{i}.md", f"{i}\n")).id for i in range(5)]
    for rid in ids[1:3]:
        await ws.delete_record("default", rid)
    live, seq = await ws.snapshot("default", limit=2)
    assert [r.path for r in live] == ["r0.md", "r3.md", "r4.md"] and seq >= 7
    every, seq2 = await ws.snapshot("default", limit=2, include_deleted=True, content=False)
    assert [(r.path, r.deleted) for r in every] == [(f"r{i}.md", i in (1, 2)) for i in range(5)]
    assert seq2 == seq and all(r.content is None for r in every)
    pages = [p async for p in ws.iter_pages("default", limit=2, include_deleted=True)]
    assert [len(p.records) for p in pages] == [2, 2, 1] and pages[-1].next_cursor is None


async def test_record_attributes(fake, ws):
    """mode / mtime_ns on create and update, set_attributes (PATCH) with kept, set and reset
    members; bodies without attributes are byte-for-byte those of earlier releases."""
    rec = await ws.create_record("default", "s.sh", "#!/bin/sh\n", mode=0o755, mtime_ns=7)
    assert (rec.mode, rec.mtime_ns) == (0o755, 7)
    plain = await ws.create_record("default", "p.md", "x")
    assert (plain.mode, plain.mtime_ns) == (0o644, None)
    r = await ws.set_attributes("default", rec.id, mtime_ns=9, if_match=rec.sha256, idempotency_key="a1")
    assert (r.mode, r.mtime_ns, r.version, r.sha256) == (0o755, 9, 2, rec.sha256)
    r = await ws.set_attributes("default", rec.id, mode=None)  # reset to 0o644, mtime kept
    assert (r.mode, r.mtime_ns, r.version) == (0o644, 9, 3)
    r = await ws.set_attributes("default", rec.id, mode=0o644)  # unchanged: no version
    assert r.version == 3
    with pytest.raises(PreconditionFailed):
        await ws.set_attributes("default", rec.id, mode=0o700, if_match="0" * 64)
    with pytest.raises(ValueError):  # checked before anything is sent
        await ws.set_attributes("default", rec.id, mode=0o17777)
    r = await ws.update_record("default", rec.id, "#!/bin/sh\necho\n", mode=0o750, mtime_ns=11)
    assert (r.mode, r.mtime_ns) == (0o750, 11)
    versions = await ws.versions("default", rec.id)
    assert [(v.operation, v.mode, v.mtime_ns) for v in versions] == [
        (Operation.created, 0o755, 7), (Operation.modified, 0o755, 9), (Operation.modified, 0o644, 9),
        (Operation.modified, 0o750, 11)]

    captured: list[bytes] = []

    def handler(request: httpx.Request) -> httpx.Response:
        captured.append(request.content)
        return httpx.Response(201, json=to_jsonable(rec))

    async with ApiClient("http://x", "t", transport=httpx.MockTransport(handler)) as c:
        await c.create_record("default", "a.md", "x")
        await c.update_record("default", "id", "x", type="user")
        await c.set_attributes("default", "id", mtime_ns=None)
    assert captured == [b'{"path":"a.md","content":"x","type":null}', b'{"content":"x","type":"user"}',
                        b'{"mtime_ns":null}']


# ---------------------------------------------------------------- TLS to the control plane

_TLS_CALL = r"""
import ssl, sys, trio
from memfuse.client import ApiClient
from memfuse.errors import TransientError

cert, key = sys.argv[1:3]

async def answer(stream):
    try:
        await stream.receive_some(65536)
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n[]")
    except trio.BrokenResourceError:  # the client refused the handshake
        pass
    finally:
        await stream.aclose()

async def main():
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert, key)
    async with trio.open_nursery() as nursery:
        listeners = await trio.open_ssl_over_tcp_listeners(0, server, host="127.0.0.1")
        port = listeners[0].transport_listener.socket.getsockname()[1]
        nursery.start_soon(trio.serve_listeners, answer, listeners)
        async with ApiClient(f"https://127.0.0.1:{port}", "t", timeout=10) as api:
            try:
                print("answered", await api.list_stores())
            except TransientError as e:
                chain, cause = [], e
                while cause is not None and len(chain) < 20:
                    chain.append(cause)
                    cause = cause.__cause__ or cause.__context__
                print("refused", any(isinstance(c, ssl.SSLCertVerificationError) for c in chain))
        nursery.cancel_scope.cancel()

trio.run(main)
"""


def test_https_control_plane_certificates_are_verified(tmp_path):
    """An ``https://`` control plane gets a verifying TLS context: a self-signed certificate
    is refused (certificate verify failed), and trusted once ``SSL_CERT_FILE`` names it (the
    documented way to trust a private CA, docs/DEPLOY.md). One process per case: the context
    is built once per process."""
    import os
    import subprocess
    import sys

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
    env = {k: v for k, v in os.environ.items() if k not in ("SSL_CERT_FILE", "SSL_CERT_DIR")}

    def call(extra: dict[str, str]) -> str:
        out = subprocess.run([sys.executable, "-c", _TLS_CALL, str(cert), str(key)], capture_output=True,
                             text=True, timeout=60, env={**env, **extra})
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert call({}) == "refused True"
    assert call({"SSL_CERT_FILE": str(cert)}) == "answered []"


def test_plain_http_control_plane_loads_no_ca_bundle():
    """``http://``: no CA bundle is loaded (it would cost the sidecar ~2 MiB), and the
    context still requires a verified certificate, so it can never complete a handshake."""
    import ssl

    from memfuse.client import tls_context

    plain = tls_context("http://control-plane:8080")
    assert plain.cert_store_stats()["x509_ca"] == 0
    assert plain.verify_mode == ssl.CERT_REQUIRED and plain.check_hostname
    verifying = tls_context("https://control-plane")
    assert verifying is tls_context("HTTPS://other")  # one per process, shared
    assert verifying.verify_mode == ssl.CERT_REQUIRED and verifying.check_hostname
    assert verifying.cert_store_stats()["x509_ca"] > 0


async def test_instance_names_are_cleaned_for_the_actor(fake):
    """``X-Memfuse-Instance`` reaches the actor as UTF-8 (an ASGI header value arrives as
    Latin-1), without format controls (a bidirectional override, zero-width space), ``/``,
    spaces or controls, at most 100 characters (found by the fresh tester: an instance with
    U+202E was stored garbled with a C1 control)."""
    import httpx

    from memfuse.names import client_label

    token = await fake.setup("ws", stores=("default",))
    for raw, want in (("EVIL\u202eadmin", "ws:ws/EVILadmin"), ("pod-ü\u200b7", "ws:ws/pod-ü7"),
                      ("x" * 5000, "ws:ws/" + "x" * 100), ("\u202e/ \x1b", "ws:ws/[api]")):
        headers = [(b"authorization", f"Bearer {token}".encode()), (b"x-memfuse-instance", raw.encode())]
        async with httpx.AsyncClient(transport=fake.transport, base_url=fake.base_url) as c:
            r = await c.post("/v1/stores/default/records", headers=headers,
                             json={"path": f"i/{len(raw)}-{raw.encode().hex()[:8]}.md", "content": "x\n"})
        assert r.status_code == 201, r.text
        assert r.json()["updated_by"] == want.replace("[api]", "api"), (raw, r.json()["updated_by"])
    assert client_label("café") == "café" and client_label("  ") is None
