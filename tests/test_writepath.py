"""The record-write fast path (``memfuse.server.writepath``): a create, update, append or batch
served straight from ASGI answers exactly what FastAPI answers for it (status, headers, body), and
every request it cannot answer so (bad JSON, a body the model refuses, another content type,
an over-long Idempotency-Key, an account named, a query string, a header twice) is left to
FastAPI. Each scenario runs twice on two fresh control planes, one with the fast path and one
without, and the answers are compared after the values that differ by nature (record ids,
timestamps) are blanked."""
from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from memfuse.server.app import create_app
from pgutil import fresh_db_url

ADMIN = "wp-admin"
WS = "wp-ws"
RO = "wp-ro"
BASE = "http://test"
_VOLATILE = {"id", "record_id", "created_at", "updated_at"}
_SKIP_HEADERS = {"date", "server"}


def _blank(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: ("*" if k in _VOLATILE and v[k] is not None else _blank(x)) for k, x in v.items()}
    if isinstance(v, list):
        return [_blank(x) for x in v]
    return v


def _answer(r: httpx.Response, ids: dict[str, str]) -> tuple[Any, ...]:
    try:
        body: Any = _blank(r.json())
    except ValueError:
        body = r.content
    text = json.dumps(body) if not isinstance(body, bytes) else body.decode("latin-1")
    for rid, name in ids.items():
        text = text.replace(rid, name)
    headers = sorted((k, v) for k, v in r.headers.items() if k not in _SKIP_HEADERS and k != "content-length")
    return r.status_code, headers, text


async def _scenario(fast: bool) -> tuple[list[tuple[Any, ...]], int]:
    """Run every request of the scenario against a fresh app; the answers, and how many the
    fast path served."""
    with fresh_db_url() as url:
        app = create_app(url, static_tokens={ADMIN: None, WS: "ws", RO: "ro"}, faces=False)
        if not fast:
            app.front.writes = None
        answers: list[tuple[Any, ...]] = []
        ids: dict[str, str] = {}
        t = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=t, base_url=BASE, headers={"Authorization": f"Bearer {ADMIN}"}) as a, \
                    httpx.AsyncClient(transport=t, base_url=BASE, headers={
                        "Authorization": f"Bearer {WS}", "X-Memfuse-Instance": "me"}) as c, \
                    httpx.AsyncClient(transport=t, base_url=BASE, headers={"Authorization": f"Bearer {RO}"}) as ro:
                for m, p, b in [("POST", "/v1/workspaces", {"name": "ws", "default_store": False}),
                                ("POST", "/v1/workspaces", {"name": "ro", "default_store": False}),
                                ("POST", "/v1/stores", {"slug": "s", "max_record_bytes": 4096}),
                                ("POST", "/v1/stores", {"slug": "tiny", "max_records": 1}),
                                ("PUT", "/v1/workspaces/ws/attachments/s", {"access": "read_write"}),
                                ("PUT", "/v1/workspaces/ws/attachments/tiny", {"access": "read_write"}),
                                ("PUT", "/v1/workspaces/ro/attachments/s", {"access": "read_only"})]:
                    r = await a.request(m, p, json=b)
                    assert r.status_code < 300, r.text

                async def send(client: httpx.AsyncClient, method: str, path: str, **kw: Any) -> httpx.Response:
                    r = await client.request(method, path, **kw)
                    got = _answer(r, ids)
                    for rid, name in ids.items():
                        path = path.replace(rid, name)
                    answers.append((method, path, *got))
                    if r.status_code == 201:
                        ids.setdefault(r.json()["id"], f"<rec{len(ids)}>")
                    return r

                rec = "/v1/stores/s/records"
                first = await send(c, "POST", rec, json={"path": "notes/a.md", "content": "hello\n"},
                                   headers={"Idempotency-Key": "k1"})
                rid = first.json()["id"]
                etag = first.headers["etag"]
                one = f"{rec}/{rid}"
                # the same key again: replayed; the key on another body: 422
                await send(c, "POST", rec, json={"path": "notes/a.md", "content": "hello\n"},
                           headers={"Idempotency-Key": "k1"})
                await send(c, "POST", rec, json={"path": "notes/b.md", "content": "other\n"},
                           headers={"Idempotency-Key": "k1"})
                # service refusals
                await send(c, "POST", rec, json={"path": "notes/a.md", "content": "again\n"})  # 409 path_exists
                await send(c, "POST", rec, json={"path": "notes/a.md/x.md", "content": "x\n"})  # parent_is_file
                await send(c, "POST", rec, json={"path": "notes", "content": "x\n"})  # path_is_directory
                await send(c, "POST", rec, json={"path": "../up.md", "content": "x\n"})  # invalid_path
                await send(c, "POST", rec, json={"path": "big.md", "content": "x" * 5000})  # record_too_large
                await send(c, "POST", rec, json={"path": "nul.md", "content": "a\u0000b"})  # invalid_content
                await send(c, "POST", rec, content=b'{"path": "sur.md", "content": "\\ud800"}',
                           headers={"Content-Type": "application/json"})  # a lone surrogate
                await send(c, "POST", rec, json={"path": "key.md",
                                                 "content": "token = ghp_" + "a1B2c3D4" * 5 + "\n"})
                await send(c, "POST", "/v1/stores/nope/records", json={"path": "x.md", "content": "x"})
                await send(ro, "POST", rec, json={"path": "x.md", "content": "x"})  # read_only
                await send(c, "POST", "/v1/stores/tiny/records", json={"path": "1.md", "content": "x"})
                await send(c, "POST", "/v1/stores/tiny/records", json={"path": "2.md", "content": "x"})  # full
                await send(c, "POST", rec, json={"path": "typed.md", "content": "x", "type": "feedback",
                                                 "mode": 0o600, "mtime_ns": 1_700_000_000_000_000_000})
                # updates: If-Match, a stale one, *, unknown record, identical content
                await send(c, "PUT", one, json={"content": "hello\nworld\n"}, headers={"If-Match": etag})
                await send(c, "PUT", one, json={"content": "stale\n"}, headers={"If-Match": etag})
                await send(c, "PUT", one, json={"content": "star\n"}, headers={"If-Match": "*",
                                                                             "Idempotency-Key": "k2"})
                await send(c, "PUT", one, json={"content": "star\n"}, headers={"If-Match": "*",
                                                                             "Idempotency-Key": "k2"})
                cur = (await send(c, "PUT", one, json={"content": "star\n"})).headers["etag"]
                await send(c, "PUT", f"{rec}/no-such-id", json={"content": "x"})
                # appends (``echo >>``): If-Match, a stale one, none or * (428), an unknown
                # record, an idempotent replay and the key on another body, attributes, an
                # empty suffix (no version), the service's refusals
                add = f"{one}/append"
                nxt = (await send(c, "POST", add, json={"append": "more\n"}, headers={"If-Match": cur})).headers["etag"]
                await send(c, "POST", add, json={"append": "stale\n"}, headers={"If-Match": cur})
                await send(c, "POST", add, json={"append": "none\n"})
                await send(c, "POST", add, json={"append": "star\n"}, headers={"If-Match": "*",
                                                                               "Idempotency-Key": "k6"})
                await send(c, "POST", f"{rec}/no-such-id/append", json={"append": "x\n"}, headers={"If-Match": nxt})
                keyed = {"If-Match": nxt, "Idempotency-Key": "k5"}
                r = await send(c, "POST", add, json={"append": "k\n", "type": "feedback", "mode": 0o600,
                                                     "mtime_ns": 1_700_000_000_000_000_000}, headers=keyed)
                await send(c, "POST", add, json={"append": "k\n", "type": "feedback", "mode": 0o600,
                                                 "mtime_ns": 1_700_000_000_000_000_000}, headers=keyed)
                await send(c, "POST", add, json={"append": "other\n"}, headers=keyed)
                nxt = r.headers["etag"]
                await send(c, "POST", add, json={"append": ""}, headers={"If-Match": nxt})  # nothing changes
                await send(c, "POST", add, json={"append": "token = ghp_" + "a1B2c3D4" * 5 + "\n"},
                           headers={"If-Match": nxt})  # secret_detected
                await send(c, "POST", add, json={"append": "x" * 5000}, headers={"If-Match": nxt})  # too large
                await send(c, "POST", add, json={"append": "a\u0000b"}, headers={"If-Match": nxt})  # invalid_content
                await send(ro, "POST", add, json={"append": "x\n"}, headers={"If-Match": nxt})  # read_only
                await send(c, "POST", "/v1/stores/nope/records/x/append", json={"append": "x\n"},
                           headers={"If-Match": nxt})
                # appends left to FastAPI: its own 422s and readings
                await send(c, "POST", add, json={"content": "x\n"}, headers={"If-Match": nxt})  # append missing
                await send(c, "POST", add, content=b"{nope", headers={"Content-Type": "application/json",
                                                                      "If-Match": nxt})
                await send(c, "POST", add, content=b'{"append": "t\\n"}', headers={"Content-Type": "text/plain",
                                                                                   "If-Match": nxt})
                await send(c, "POST", add, json={"append": "twice\n"}, headers=[("If-Match", nxt), ("If-Match", nxt)])
                await send(c, "POST", add + "?account=default", json={"append": "q\n"}, headers={"If-Match": nxt})
                await send(c, "POST", add, json={"append": "last\n"}, headers={"If-Match": nxt})
                # what the fast path leaves to FastAPI: its own 422s and readings
                await send(c, "POST", rec, content=b"{not json", headers={"Content-Type": "application/json"})
                await send(c, "POST", rec, json={"path": "m.md"})  # content missing
                await send(c, "POST", rec, json={"path": "m.md", "content": "x", "mode": 2**64})  # 64-bit
                await send(c, "POST", rec, json={"path": "m.md", "content": "x", "mtime_ns": -(2**63) - 1})
                await send(c, "POST", rec, json=[1, 2])
                await send(c, "POST", rec, content=b'{"path": "t.md", "content": "x"}',
                           headers={"Content-Type": "text/plain"})
                await send(c, "POST", rec, content=b'{"path": "v.md", "content": "x"}',
                           headers={"Content-Type": "application/vnd.x+json"})
                await send(c, "POST", rec, json={"path": "long.md", "content": "x"},
                           headers={"Idempotency-Key": "k" * 256})
                await send(c, "POST", rec + "?account=default", json={"path": "q.md", "content": "x"})
                await send(a, "POST", rec, json={"path": "acct.md", "content": "x"},
                           headers={"X-Memfuse-Account": "nobody"})
                await send(c, "POST", rec, json={"path": "two.md", "content": "x"},
                           headers=[("Idempotency-Key", "k3"), ("Idempotency-Key", "k4")])
                await send(c, "PUT", one, content=b"", headers={"Content-Type": "application/json"})
                # batches: served (whatever the content type, as the handler reads the raw body)
                batch = "/v1/stores/s/batch"
                ops = {"operations": [
                    {"op": "create", "body": {"path": "b/1.md", "content": "one\n"}, "idempotency_key": "b1"},
                    {"op": "create", "body": {"path": "b/2.md", "content": "two\n"}},
                    {"op": "create", "body": {"path": "notes/a.md", "content": "taken\n"}},
                    {"op": "update", "record_id": rid, "body": {"content": "batched\n"}, "if_match": etag},
                    {"op": "delete", "record_id": "no-such-id"}]}
                await send(c, "POST", batch, json=ops)
                await send(c, "POST", batch, json=ops)  # b1 replayed, the rest refused or new
                await send(c, "POST", batch, content=json.dumps(ops).encode(), headers={"Content-Type": "text/plain"})
                await send(ro, "POST", batch, json=ops)
                await send(c, "POST", "/v1/stores/nope/batch", json=ops)
                await send(c, "POST", batch, json={"operations": []})
                await send(c, "POST", batch, json={"operations": [{"op": "create", "body": {"path": "x" * 5000,
                                                                                          "content": "x"}}]})
                # left to FastAPI: an Idempotency-Key, bad JSON, operations the model refuses
                await send(c, "POST", batch, json=ops, headers={"Idempotency-Key": "kb"})
                await send(c, "POST", batch, content=b"[", headers={"Content-Type": "application/json"})
                await send(c, "POST", batch, json={"operations": [{"op": "explode"}]})
                await send(c, "POST", batch, json={"operations": "no"})
                # JSON nested past the parser's recursion limit: FastAPI's answer either way
                deep = b"[" * 100_000 + b"]" * 100_000
                await send(c, "POST", rec, content=deep, headers={"Content-Type": "application/json"})
                await send(c, "POST", batch, content=deep, headers={"Content-Type": "application/json"})
                deep_op = b'{"operations": [{"op": "create", "body": {"a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}}]}"
                await send(c, "POST", batch, content=deep_op, headers={"Content-Type": "application/json"})
            return answers, app.front.writes.served if fast else 0
        finally:
            app.state.service.db.dispose()


async def test_fast_path_answers_as_fastapi_does():
    fast, served = await _scenario(True)
    slow, _ = await _scenario(False)
    assert len(fast) == len(slow)
    for f, s in zip(fast, slow):
        assert f == s
    statuses = [a[2] for a in fast]
    assert statuses[:3] == [201, 201, 422]  # created, replayed, key reused
    assert ("idempotent-replayed", "true") in fast[1][3]
    assert {409, 404, 403, 413, 412, 507, 200} <= set(statuses)
    # a batch body nested too deep to parse is a 422 (it was an unhandled 500)
    assert [a[2] for a in fast[-2:]] == [422, 422]
    assert all(json.loads(a[4])["code"] == "validation_error" for a in fast[-2:])
    # the appends: served as FastAPI serves them (200 with the new ETag, a replay, 412, 428,
    # 404, the service's 422s, 413, 403)
    appends = [(a[2], json.loads(a[4]).get("code") if a[4].startswith("{") else None)
               for a in fast if a[1].split("?")[0].endswith("/append")]
    assert appends[:14] == [(200, None), (412, "precondition_failed"), (428, "precondition_required"),
                            (428, "precondition_required"), (404, "record_not_found"), (200, None), (200, None),
                            (422, "idempotency_key_reused"), (200, None), (422, "secret_detected"),
                            (413, "record_too_large"), (422, "invalid_content"), (403, "read_only"),
                            (404, "store_not_attached")], appends
    replayed = [a for a in fast if a[1].endswith("/append") and ("idempotent-replayed", "true") in a[3]]
    assert len(replayed) == 1 and "etag" in dict(replayed[0][3])
    # the fast path served the well-formed writes (22 creates and updates, 15 appends) and
    # batches (7), FastAPI the rest
    assert served == 44


async def test_a_large_append_is_scanned_before_the_hop(monkeypatch):
    """An append whose suffix has ``PRESCAN_MIN`` characters or more is served here with its
    secret scan (the suffix after its context) run before the write's hop, on a worker
    thread (``prescan``, as the batch path scans its appends), never in the hop; the verdict
    kept still refuses a secret, and a request the service refuses 428 (no ``If-Match``)
    costs no scan. On main the append route was FastAPI's: no hop at all."""
    import threading

    from memfuse import content
    from memfuse.server import prescan

    events: list[tuple[str, object]] = []  # ("scan", in a hop), ("hop", its function), ("hopped", "")
    real_scan = content.find_secret
    hop_threads: set[int] = set()

    def scan(text: str) -> str | None:
        if len(text) >= prescan.PRESCAN_MIN:
            events.append(("scan", threading.get_ident() in hop_threads))
        return real_scan(text)

    monkeypatch.setattr(content, "find_secret", scan)
    with fresh_db_url() as url:
        app = create_app(url, static_tokens={ADMIN: None}, faces=False)
        writes = app.front.writes
        real_hop = writes.hop

        async def hop(fn: Any, *args: Any) -> Any:
            events.append(("hop", fn.__name__))

            def run(*a: Any) -> Any:  # the hop's own thread: no large scan may run there
                hop_threads.add(threading.get_ident())
                try:
                    return fn(*a)
                finally:
                    hop_threads.discard(threading.get_ident())

            try:
                return await real_hop(run, *args)
            finally:
                events.append(("hopped", ""))

        writes.hop = hop
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE,
                                         headers={"Authorization": f"Bearer {ADMIN}"}) as a:
                assert (await a.post("/v1/stores", json={"slug": "s"})).status_code == 201
                r = await a.post("/v1/stores/s/records", json={"path": "j.md", "content": "# journal\n"})
                assert r.status_code == 201
                add = f"/v1/stores/s/records/{r.json()['id']}/append"
                events.clear()
                big = "".join(f"line {i} of a long journal entry\n" for i in range(600))
                assert len(big) >= prescan.PRESCAN_MIN
                r = await a.post(add, json={"append": big}, headers={"If-Match": r.headers["etag"]})
                assert r.status_code == 200, r.text
                # scanned once, before the hop, on a thread that is not in a hop
                assert events == [("scan", False), ("hop", "append_record"), ("hopped", "")], events
                etag = r.headers["etag"]
                events.clear()
                secret = big + "token = ghp_" + "a1B2c3D4" * 5 + "\n"
                r = await a.post(add, json={"append": secret}, headers={"If-Match": etag})
                assert r.status_code == 422 and r.json()["code"] == "secret_detected", r.text
                assert events == [("scan", False), ("hop", "append_record"), ("hopped", "")], events
                events.clear()
                r = await a.post(add, json={"append": big})
                assert r.status_code == 428 and r.json()["code"] == "precondition_required", r.text
                assert events == [], events  # refused before any scan or hop
            assert writes.served == 4
        finally:
            app.state.service.db.dispose()


@pytest.mark.parametrize("fast", [True, False])
async def test_request_duration_histogram_sees_fast_writes(fast):
    with fresh_db_url() as url:
        app = create_app(url, static_tokens={ADMIN: None}, faces=False)
        if not fast:
            app.front.writes = None
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE,
                                         headers={"Authorization": f"Bearer {ADMIN}"}) as a:
                assert (await a.post("/v1/stores", json={"slug": "s"})).status_code == 201
                r = await a.post("/v1/stores/s/records", json={"path": "a.md", "content": "x"})
                assert r.status_code == 201
                r = await a.put(f"/v1/stores/s/records/{r.json()['id']}", json={"content": "y"},
                                headers={"If-Match": '"0"'})
                assert r.status_code == 412
                r = await a.post(f"{r.request.url.path}/append", json={"append": "z"}, headers={"If-Match": '"0"'})
                assert r.status_code == 412
                text = (await a.get("/metrics")).text
            for status, method, route in [("201", "POST", "/v1/stores/{store}/records"),
                                          ("412", "PUT", "/v1/stores/{store}/records/{record_id}"),
                                          ("412", "POST", "/v1/stores/{store}/records/{record_id}/append")]:
                line = (f'http_request_duration_seconds_count{{method="{method}",route="{route}",'
                        f'status="{status}"}} 1.0')
                assert line in text, text[:2000]
            assert (app.front.writes.served if fast else 3) == 3
        finally:
            app.state.service.db.dispose()


# ---------------------------------------------------------------- the fast path's own framing
# The fast path frames its answers without starlette's ``Response`` and reads the request's
# URL path without building a ``URL`` (bench/README.md, "serve's loop, session 13"): the same
# bytes, by construction and by these checks.


def test_reply_head_is_what_starlettes_response_frames():
    from starlette.responses import Response

    from memfuse.server.routes.deps import reply_head, reply_response
    from memfuse.server.service import Reply

    def starlette(r: Reply) -> Response:  # reply_response as it was written before reply_head
        headers = dict(r.headers)
        if r.replayed:
            headers["Idempotent-Replayed"] = "true"
        if r.status == 204 or not r.body:
            return Response(status_code=r.status, headers=headers)
        return Response(content=r.body, status_code=r.status, headers=headers, media_type="application/json")

    n = 0
    for status in (200, 201, 204, 304, 404, 409, 412, 100):
        for body in (b"", b'{"a":1}'):
            for headers in ({}, {"ETag": '"abc"'}, {"ETag": '"x"', "Content-Type": "text/plain"},
                            {"Content-Length": "3"}, {"Idempotent-Replayed": "false"}, {"Location": "/x"}):
                for replayed in (False, True):
                    r = Reply(status, body, dict(headers), replayed)
                    want = starlette(r)
                    got = reply_response(r)
                    assert (got.status_code, got.raw_headers, got.body) == reply_head(r)
                    assert reply_head(r) == (want.status_code, want.raw_headers, want.body), r
                    n += 1
    assert n == 192


def test_url_path_is_starlettes_url_path():
    from hypothesis import given, settings
    from hypothesis import strategies as st
    from starlette.datastructures import URL

    from memfuse.server.writepath import url_path

    @settings(max_examples=3000, deadline=None)
    @given(st.text(min_size=0, max_size=30), st.sampled_from([b"h:1", b"bad host/x", None]))
    def check(tail: str, host: bytes | None) -> None:
        scope = {"type": "http", "scheme": "http", "server": ("127.0.0.1", 8080), "root_path": "",
                 "path": "/v1/stores/" + tail, "query_string": b"",
                 "headers": [(b"host", host)] if host is not None else []}
        assert url_path(scope) == URL(scope=scope).path

    check()
    for odd in ("/v1/a b", "/v1/a\tb", "/v1/a?b#c\\d", "/v1/\x00", "/v1/é\u3000", "/v1/x "):
        scope = {"type": "http", "path": odd, "headers": [], "server": ("::1", 80)}
        assert url_path(scope) == URL(scope=scope).path


def test_canonical_hash_is_jsons_text_for_any_value():
    """``canonical_sha256`` (the idempotency request hash of every write, on the event loop)
    hashes the text ``json.dumps(value, sort_keys=True, separators=(",", ":"),
    ensure_ascii=False)`` gives (UTF-8, lone surrogates kept) for any value, whichever
    encoder wrote it: msgspec for values without floats, json for the rest (floats, NaN,
    lone surrogates, subclasses, keys that are not strings, nesting past the walk)."""
    import enum
    import hashlib

    from hypothesis import given, settings
    from hypothesis import strategies as st

    from memfuse.server.base import canonical_sha256

    def want(value: Any) -> str:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()

    text = st.text(st.characters(codec=None, min_codepoint=0, max_codepoint=0x10FFFF), max_size=12)
    scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-2**70, max_value=2**70)
               | st.floats(allow_nan=True, allow_infinity=True) | text)
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                          | st.dictionaries(text, inner, max_size=4), max_leaves=20)

    @settings(max_examples=400, deadline=None)  # a few s on a quiet machine, ~30 s at load 14
    @given(values)
    def check(value: Any) -> None:
        assert canonical_sha256(value) == want(value)
        parsed = json.loads(json.dumps(value))  # as the write path has it (NaN is parsed back)
        assert canonical_sha256(parsed) == want(parsed)

    check()

    class Color(enum.IntEnum):
        RED = 1

    class Name(str):
        pass

    odd: list[Any] = [{"b": 1, "a": [True, None, 1.0]}, {1: "int key", "1": "str key"}, {True: 1},
                      [Color.RED], {"k": Name("v")}, {Name("k"): 2}, "\ud800", {"\udfff": "x"}, 10**40,
                      -10**40, {"é": 1, "e": 2, "\U0001d11e": 3, "\uffff": 4}, "\x00\x1f\x7f\u2028\\\"/"]
    deep: Any = "leaf"
    for _ in range(5000):
        deep = [deep]
    odd.append(deep)
    for value in odd:
        try:
            expected = want(value)
        except (RecursionError, TypeError, ValueError) as e:
            with pytest.raises(type(e)):
                canonical_sha256(value)
            continue
        assert canonical_sha256(value) == expected, value


def test_the_raw_body_is_hashed_only_when_a_stored_row_is_compared(monkeypatch):
    """The idempotency request of a write (made on the event loop) hashes its canonical JSON
    only; the raw bytes' sha256 (the alternative identity of rows stored by releases before
    the batch endpoint) is computed when a stored row is compared, and still matches."""
    from types import SimpleNamespace

    from memfuse.server import base
    from memfuse.server.service import ServiceError

    real = base.body_sha256
    hashed: list[bytes] = []
    monkeypatch.setattr(base, "body_sha256", lambda b: hashed.append(b) or real(b))
    raw = b'{"path": "notes/a.md",   "content": "x"}'
    idem = base.idempotency_request("k1", "POST", "/v1/stores/s/records", raw, json.loads(raw))
    assert hashed == []  # nothing but the canonical hash on the loop

    def row(request_hash: str) -> SimpleNamespace:
        return SimpleNamespace(method="POST", url_path="/v1/stores/s/records", request_hash=request_hash,
                               status=201, response_body='{"id": "r"}', response_headers="{}")

    assert base.Writer.idem_replay(row(idem.body_sha256), idem).replayed and hashed == []
    assert base.Writer.idem_replay(row(real(raw)), idem).replayed  # a row stored with the raw hash
    assert hashed == [raw]
    with pytest.raises(ServiceError) as e:
        base.Writer.idem_replay(row(real(b"{}")), idem)
    assert e.value.code == "idempotency_key_reused"
    # a body that is not JSON: its raw hash is its identity
    bad = base.idempotency_request("k2", "POST", "/v1/stores/s/records", b"{nope")
    assert bad.body_sha256 == real(b"{nope")


def test_parse_json_is_json_loads():
    """``parse_json`` (the write path's reading of a JSON body, on the event loop) gives what
    ``json.loads`` gives, or raises what it raises, for any bytes: msgspec's value where it
    is exactly json's, json's own where msgspec refuses or a float is in it."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from memfuse.server.base import parse_json

    def same(raw: bytes) -> None:
        try:
            want: Any = json.loads(raw)
        except (ValueError, RecursionError) as e:
            with pytest.raises(type(e)):
                parse_json(raw)
            return
        got = parse_json(raw)
        assert got == want or (want != want and got != got), raw  # NaN is not NaN
        assert repr(got) == repr(want), raw  # types and float bits too

    text = st.text(st.characters(codec=None, min_codepoint=0, max_codepoint=0x10FFFF), max_size=12)
    scalars = (st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
               | st.floats(allow_nan=True, allow_infinity=True) | text)
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                          | st.dictionaries(text, inner, max_size=4), max_leaves=20)

    @settings(max_examples=300, deadline=None)
    @given(values, st.booleans())
    def check(value: Any, ascii_: bool) -> None:
        same(json.dumps(value, ensure_ascii=ascii_).encode("utf-8", "surrogatepass"))

    check()

    @settings(max_examples=300, deadline=None)
    @given(st.binary(max_size=24))
    def check_bytes(raw: bytes) -> None:
        same(raw)

    check_bytes()
    for raw in [b'{"a":1,"a":2}', b'{"a":123456789012345678901234567890}', b'"\\ud800"', b'"\xed\xa0\x80"',
                b'"a\x01b"', b'"\xff"', b'1e400', b'NaN', b'-Infinity', b'\xef\xbb\xbf{"a": 1}',
                '{"a": "b"}'.encode("utf-16"), '{"a": "b"}'.encode("utf-32-le"), b' {} ', b'{}x', b'[1,]',
                b'"\\u0000"', b'1.0', b'-0', b'0.1', b'1E2', b'"\\/"', b'01', b'', b'  ', b'[' * 5000 + b']' * 5000,
                b'{"path": "a.md", "content": "\\u00e9\\ud83d\\ude00"}', b'{"mode": 420, "x": [true, null]}']:
        same(raw)


def test_the_idempotency_hash_does_not_walk_the_body_parse_json_walked(monkeypatch):
    """The write path reads a body with ``parse_json_exact`` (its walk tells whether msgspec
    writes the value as json does) and hands that verdict to the idempotency hash, which then
    does not walk the value again on the event loop (bench/README.md, "The close path, session
    20: serve's loop"); the hash is the same, and a float body still takes json's text."""
    import hashlib

    from memfuse.server import base

    real = base._msgspec_exact
    walked: list[object] = []
    monkeypatch.setattr(base, "_msgspec_exact", lambda v: walked.append(v) or real(v))
    raw = b'{"path": "notes/a.md", "content": "x\\u00e9", "mode": 420, "tags": ["a", {"b": null}]}'
    value, exact = base.parse_json_exact(raw)
    assert exact and value == json.loads(raw) and walked
    walked.clear()
    idem = base.idempotency_request("k1", "POST", "/v1/stores/s/records", raw, value, exact)
    assert walked == []
    text = json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert idem.body_sha256 == hashlib.sha256(text.encode()).hexdigest()
    floaty = b'{"path": "b.md", "content": "y", "n": 1e16}'
    value, exact = base.parse_json_exact(floaty)
    assert not exact and value == json.loads(floaty)
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert base.idempotency_request("k2", "POST", "/p", floaty, value, exact).body_sha256 == \
        hashlib.sha256(text.encode()).hexdigest()
