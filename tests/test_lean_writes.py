"""The front door's route for record writes on the lean path (``memfuse.server.gate.Gate.write``,
what ``memfuse.server.lean`` calls for a create, update, append or batch instead of the app's general
request path) answers byte for byte as hypercorn and the general path do, on SQLite and on
PostgreSQL: two control planes with the same state, one served lean, one not, are sent the same
requests on real loopback sockets and their answers compared (``tests/test_lean.py``'s
normalization: the ``Date`` header, the ids and times a create makes).

Cases: creates with a static token and with a database token (its first write looks it up on
a thread: the general path; the next ones come from the token cache: the lean route), an
idempotent replay, 409 (the path exists), 412 (``If-Match`` stale), 422 (FastAPI's), 401 (no
token, an unknown token), 403 (a read-only attachment), 404, 413 (declared), 429
``rate_limited`` (the token's write buckets), 503 ``overloaded`` and 429 ``too_many_requests``
(the request slots), a batch, appends (200, 412, 428, 404, 422, a replay, a secret); and the
lean route's counter shows which of them it took.
"""
from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import trio
from pgutil import ENV, fresh_db_url, pg_bindir, pg_cluster
from planeutil import serve_app, setup_ws
from test_lean import ADMIN, WS, _create, _normal, _req, _statuses, _talk

from memfuse.server import gate, tokens
from memfuse.server.app import create_app

pytestmark = pytest.mark.timeout(180)

MAX_BODY = 64 * 1024


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def database(request) -> Iterator[str | None]:
    """None: SQLite files; else a PostgreSQL cluster's URL (each control plane a schema)."""
    if request.param == "sqlite":
        yield None
        return
    if pg_bindir() is None:
        pytest.skip("PostgreSQL is not installed (./scripts/setup --test)")
    with pg_cluster(max_connections=60) as url:
        yield url


class Plane:
    """One control plane served on loopback: its app, port and the workspace's database token."""

    def __init__(self, app: Any, port: int) -> None:
        self.app, self.port = app, port
        self.token = ""
        self.ids: dict[str, str] = {}  # path → record id
        self.etags: dict[str, str] = {}


async def _plane(nursery: trio.Nursery, url: str, lean: bool) -> Plane:
    app = create_app(url, static_tokens={ADMIN: None, WS: "ws"}, max_body=MAX_BODY,
                     receive_timeout=0.5, body_timeout=2, header_timeout=2)
    base = await serve_app(nursery, app, lean=lean)
    plane = Plane(app, int(base.rsplit(":", 1)[1]))
    token = await setup_ws(base, ADMIN, (("default", "read_write"), ("ro", "read_only")), token_name="db")
    assert token is not None
    plane.token = token
    return plane


async def _record(plane: Plane, path: str) -> None:
    """Note ``path``'s record id and ETag on ``plane``."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{plane.port}",
                                 headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30) as a:
        r = await a.get("/v1/stores/default/records", params={"path": path})
        assert r.status_code == 200, r.text
        rec = r.json()["records"][0]
        plane.ids[path] = rec["id"]
        r = await a.get(f"/v1/stores/default/records/{rec['id']}")
        plane.etags[path] = r.headers["etag"]


async def _both(lean: Plane, plain: Plane, pieces: Any) -> bytes:
    """Send ``pieces(plane)`` (bytes, or a list for ``_talk``) to each plane on a new
    connection; their normalized answers, asserted equal."""
    got = []
    for plane in (lean, plain):
        p = pieces(plane) if callable(pieces) else pieces
        got.append(_normal(await _talk(plane.port, p if isinstance(p, list) else [p])))
    assert got[0] == got[1], got
    return got[0]


def _written(plane: Plane) -> int:
    return int(plane.app.front.lean_writes)


async def test_the_lean_write_route_answers_as_the_general_path_does(database, tmp_path, monkeypatch):
    # a cached database token is trusted while revocations were read within this (1 s by
    # default: past it a write looks its token up on a thread, the general path's way)
    monkeypatch.setattr(tokens, "REVOCATION_CHECK_SECONDS", 120.0)
    with contextlib.ExitStack() as schemas, trio.fail_after(150):  # each plane's schema, dropped after the servers
        urls = []
        for name in ("lean", "plain"):
            if database is None:
                urls.append(f"sqlite:///{tmp_path / name}.db")
            else:
                monkeypatch.setenv(ENV, database)
                urls.append(schemas.enter_context(fresh_db_url()))
        await _compare(urls)


async def _compare(urls: list[str]) -> None:
    async with trio.open_nursery() as nursery:
        lean = await _plane(nursery, urls[0], True)
        plain = await _plane(nursery, urls[1], False)
        assert lean.app.state.lean.write is not None

        # successes: a static token; a database token (its first write looked up on a
        # thread, the general path; the next from the cache: the lean route); pipelined
        a = await _both(lean, plain, _create("a.md") + _create("b.md", token=WS))
        assert _statuses(a) == [201, 201], a
        before = _written(lean)
        a = await _both(lean, plain, lambda p: _create("c.md", token=p.token))
        assert _statuses(a) == [201] and _written(lean) == before, a  # looked up: not lean
        a = await _both(lean, plain, lambda p: _create("d.md", token=p.token) + _create("e.md", token=p.token,
                                                                                          close=True))
        assert _statuses(a) == [201, 201] and _written(lean) == before + 2, a

        # an idempotent replay (the same key twice: the second answer replayed), and the
        # same key with another body (422 from the service)
        key = "Idempotency-Key: k-1\r\n"
        a = await _both(lean, plain, _create("i.md", extra=key) + _create("i.md", extra=key)
                        + _create("i.md", "other\n", extra=key, close=True))
        assert _statuses(a)[:2] == [201, 201] and b"idempotent-replayed: true" in a.lower(), a
        assert _statuses(a)[2] in (409, 422), a

        # 409: the path exists; 412: a stale If-Match; an update that fits; 404 and 422
        a = await _both(lean, plain, _create("a.md", close=True))
        assert _statuses(a) == [409], a
        for plane in (lean, plain):
            await _record(plane, "a.md")
        put = lambda p, etag: _req("PUT", f"/v1/stores/default/records/{p.ids['a.md']}",  # noqa: E731
                                   b'{"content":"new\\n"}', extra=f"If-Match: {etag}\r\n")
        a = await _both(lean, plain, lambda p: put(p, '"stale"') + put(p, p.etags["a.md"]))
        assert _statuses(a) == [412, 200], a
        a = await _both(lean, plain, [_req("POST", "/v1/stores/nope/records", b'{"path":"n.md","content":"x"}'),
                                      _req("POST", "/v1/stores/default/records", b'{"path": 5}', close=True)])
        assert _statuses(a) == [404, 422], a

        # appends (``echo >>``, the sidecar's commonest write): the lean route's (counted), with
        # FastAPI's answers: 200 with the new ETag, 412 stale, 428 without If-Match, 404, an
        # idempotent replay, 422 (the model's: FastAPI's own) and a secret refused
        for plane in (lean, plain):
            await _record(plane, "a.md")
        written = _written(lean)

        def add(p: Plane, text: str, etag: str | None, *, rid: str | None = None, extra: str = "",
                close: bool = False, body: bytes | None = None) -> bytes:
            return _req("POST", f"/v1/stores/default/records/{rid or p.ids['a.md']}/append",
                        json.dumps({"append": text}).encode() if body is None else body,
                        extra=(f"If-Match: {etag}\r\n" if etag else "") + extra, close=close)

        a = await _both(lean, plain, lambda p: add(p, "one\n", p.etags["a.md"]) + add(p, "two\n", '"stale"')
                        + add(p, "three\n", None) + add(p, "x\n", p.etags["a.md"], rid="no-such-id")
                        + add(p, "", p.etags["a.md"], body=b'{"content": "x"}', close=True))
        assert _statuses(a) == [200, 412, 428, 404, 422], a
        assert b"precondition_required" in a and b"record_not_found" in a and b"etag: " in a, a
        for plane in (lean, plain):
            await _record(plane, "a.md")
        key = "Idempotency-Key: ak-1\r\n"
        secret = "token = ghp_" + "a1B2c3D4" * 5 + "\n"
        a = await _both(lean, plain, lambda p: add(p, "four\n", p.etags["a.md"], extra=key)
                        + add(p, "four\n", p.etags["a.md"], extra=key)
                        + add(p, secret, '"' + "0" * 64 + '"') + add(p, secret, "*", close=True))
        assert _statuses(a) == [200, 200, 412, 428] and b"idempotent-replayed: true" in a.lower(), a
        for plane in (lean, plain):
            await _record(plane, "a.md")
        a = await _both(lean, plain, lambda p: add(p, secret, p.etags["a.md"], close=True))
        assert _statuses(a) == [422] and b"secret_detected" in a, a
        assert _written(lean) == written + 10, (_written(lean), written)  # every append took the lean route

        # 403: the workspace's store attached read-only; a batch
        a = await _both(lean, plain, _req("POST", "/v1/stores/ro/records", b'{"path":"r.md","content":"x"}',
                                          close=True))
        assert _statuses(a) == [403] and b"read_only" in a, a
        batch = json.dumps({"operations": [{"op": "create", "body": {"path": "bt.md", "content": "b\n"}}]}).encode()
        a = await _both(lean, plain, _req("POST", "/v1/stores/default/batch", batch, close=True))
        assert _statuses(a) == [200] and b'"status":201' in a.replace(b" ", b""), a

        # 401 (no token, an unknown one) and 413 (declared): the general path's, at once
        written = _written(lean)
        a = await _both(lean, plain, _create("x.md", token=None))
        assert _statuses(a) == [401] and b"connection: close" in a, a
        a = await _both(lean, plain, _create("x.md", token="nobody-has-this-token"))
        assert _statuses(a) == [401], a
        a = await _both(lean, plain, _create("big.md", length=MAX_BODY + 1))
        assert _statuses(a) == [413] and b"connection: close" in a, a
        assert _written(lean) == written

        # the request slots: 503 overloaded, 429 too_many_requests (each closes the connection)
        for plane in (lean, plain):
            plane.app.front.max_inflight = 0
        a = await _both(lean, plain, _create("s1.md") + _create("s2.md"))
        assert _statuses(a) == [503] and b"connection: close" in a and b"retry-after: 1" in a, a
        for plane in (lean, plain):
            plane.app.front.max_inflight = gate.MAX_INFLIGHT
            plane.app.front.shares.per_token = 0
        a = await _both(lean, plain, lambda p: _create("s3.md", token=p.token))
        assert _statuses(a) == [429] and b"too_many_requests" in a, a
        for plane in (lean, plain):
            plane.app.front.shares.per_token = 32
        assert _written(lean) == written + 2

        # the token's write buckets: one write, then 429 rate_limited with Retry-After
        for plane in (lean, plain):
            plane.app.front.write_rate = gate.WriteRate(rate=0.01, burst=1)
        a = await _both(lean, plain, lambda p: _create("w1.md", token=p.token) + _create("w2.md", token=p.token))
        assert _statuses(a) == [201, 429] and b"retry-after: 100" in a and b"rate_limited" in a, a
        assert b"connection: close" in a, a
        assert _written(lean) == written + 4

        # what each stored is the same
        got = []
        for plane in (lean, plain):
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{plane.port}",
                                         headers={"Authorization": f"Bearer {ADMIN}"}) as c:
                r = await c.get("/v1/stores/default/records", params={"limit": 100})
                got.append(sorted(x["path"] for x in r.json()["records"]))
        assert got[0] == got[1] and len(got[0]) == 8, " ".join(got[0])
        contents = []
        for plane in (lean, plain):
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{plane.port}",
                                         headers={"Authorization": f"Bearer {ADMIN}"}) as c:
                r = await c.get(f"/v1/stores/default/records/{plane.ids['a.md']}")
                contents.append(r.json()["content"])
        assert contents[0] == contents[1] == "new\none\nfour\n", contents
        nursery.cancel_scope.cancel()



async def test_a_lean_write_hashes_its_token_once_not_per_request(tmp_path, monkeypatch):
    """The front door keeps a token's digest once the token authenticated (``Gate._token_key``):
    the lean write route hands it to the token cache instead of hashing the token again per
    request (bench/README.md, "The close path, session 20: serve's loop"); a refused token is
    not kept."""
    monkeypatch.setattr(tokens, "REVOCATION_CHECK_SECONDS", 120.0)
    hashed: list[bytes] = []
    real = tokens.sha256_hex
    monkeypatch.setattr(tokens, "sha256_hex", lambda data: hashed.append(data) or real(data))
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            plane = await _plane(nursery, f"sqlite:///{tmp_path / 'cp.db'}", True)
            a = _normal(await _talk(plane.port, [_create("t0.md", token=plane.token, close=True)]))
            assert _statuses(a) == [201], a  # looked up on a thread: the general path
            before, hashed[:] = _written(plane), []
            a = _normal(await _talk(plane.port, [_create(f"t{i}.md", token=plane.token, close=i == 3) for i in range(1, 4)]))
            assert _statuses(a) == [201, 201, 201] and _written(plane) == before + 3, a
            assert hashed == [], hashed  # three lean writes, their token not hashed again
            a = _normal(await _talk(plane.port, [_create("u.md", token="nobody-has-this-token", close=True)]))
            assert _statuses(a) == [401], a
            assert "nobody-has-this-token" not in plane.app.front._digests
            nursery.cancel_scope.cancel()
