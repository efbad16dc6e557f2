"""``POST /v1/stores/{store}/batch``: many record writes to one store in one transaction.

Runs on in-memory SQLite, and on PostgreSQL through ``tests/test_postgres.py`` (each test gets
a fresh schema, ``tests/pgutil.py``). What is checked: each operation answered as alone, a
refused one leaving nothing while the others commit, idempotency keys per operation (also
across single requests and batches, and a whole batch retried after a lost response), If-Match,
store limits reached mid-batch, the size bound, seq order in the change feed, one commit note.
"""
from __future__ import annotations

import hashlib
import json

import httpx
import pytest

from memfuse.client import ApiClient
from memfuse.errors import Conflict, PreconditionFailed, StoreFull, TransientError
from memfuse.fake import FakeControlPlane
from memfuse.wire import BATCH_MAX_OPERATIONS, Record
from memfuse.server.app import create_app
from memfuse.server.records import _usage
from pgutil import fresh_db_url

ADMIN = "batch-admin-token"
WS = "batch-ws-token"
BASE = "http://test"


def _client(app, token: str = ADMIN) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE,
                             headers={"Authorization": f"Bearer {token}", "X-Memfuse-Instance": "t"})


@pytest.fixture
async def env():
    with fresh_db_url() as url:
        app = create_app(url, static_tokens={ADMIN: None, WS: "ws"}, faces=False)
        async with _client(app) as admin:
            assert (await admin.post("/v1/workspaces", json={"name": "ws", "default_store": False})).status_code == 201
            r = await admin.post("/v1/stores", json={"slug": "s", "max_records": 6, "max_record_bytes": 1000})
            assert r.status_code == 201
            r = await admin.put("/v1/workspaces/ws/attachments/s", json={"access": "read_write"})
            assert r.status_code == 200
            async with _client(app, WS) as ws:
                yield app, admin, ws
        app.state.service.db.dispose()


def _op(op: str, **kw) -> dict:
    return {"op": op, **kw}


async def _batch(c: httpx.AsyncClient, ops: list[dict], store: str = "s") -> list[dict]:
    r = await c.post(f"/v1/stores/{store}/batch", content=json.dumps({"operations": ops}),  # \ud800 escaped
                     headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert len(results) == len(ops)
    return results


def _state(app) -> tuple[dict[str, str], tuple[int, int], tuple[int, int]]:
    """(live path → content, counted usage, the store row's usage counters)."""
    svc = app.state.service
    with svc.db.read_conn() as conn:
        counted = _usage(conn, ["s"]).get("s", (0, 0))
    page = svc.list_records(svc_admin(), "s", with_content=True)
    st = svc.get_store(svc_admin(), "s")
    return {r.path: r.content for r in page.records}, counted, (st.record_count, st.usage_bytes)


def svc_admin():
    from memfuse.server.base import Principal
    return Principal(workspace=None)


async def test_mixed_batch_refused_operations_leave_nothing_the_others_commit(env):
    app, admin, ws = env
    r = await ws.post("/v1/stores/s/records", json={"path": "a.md", "content": "alpha"})
    a = r.json()
    seq0 = a["seq"]
    results = await _batch(ws, [
        _op("create", body={"path": "b.md", "content": "bravo"}),
        _op("create", body={"path": "a.md", "content": "again"}),  # 409
        _op("update", record_id=a["id"], if_match='"0000"', body={"content": "x"}),  # 412
        _op("create", body={"path": "big.md", "content": "x" * 2000}),  # 413
        _op("create", body={"path": "bad.md", "content": "lone \ud800 surrogate"}),  # 422 UTF-8
        _op("create", body={"path": "../up.md", "content": "x"}),  # 422 path
        _op("update", record_id=a["id"], if_match=f'"{a["sha256"]}"', body={"content": "alpha 2"}),
        _op("attrs", record_id=a["id"], body={"mode": 0o600}),
        _op("create", body={"path": "gone.md", "content": "soon deleted"}),
        _op("create", body={"path": "c.md", "content": 5}),  # 422 validation
    ])
    statuses = [x["status"] for x in results]
    assert statuses == [201, 409, 412, 413, 422, 422, 200, 200, 201, 422]
    codes = [(x["body"] or {}).get("code") for x in results]
    assert codes[1:6] == ["path_exists", "precondition_failed", "record_too_large", "invalid_content",
                          "invalid_path"]
    assert results[1]["body"]["record_id"] == a["id"]  # the problem's members, as alone
    assert results[2]["body"]["sha256"] == a["sha256"]
    assert results[0]["etag"] == hashlib.sha256(b"bravo").hexdigest() == results[0]["body"]["sha256"]
    gone = results[8]["body"]["id"]
    results = await _batch(ws, [_op("delete", record_id=gone), _op("delete", record_id=gone),
                                _op("move", record_id=a["id"], body={"path": "b.md"})])
    assert [x["status"] for x in results] == [204, 404, 409]
    live, counted, counters = _state(app)
    assert live == {"a.md": "alpha 2", "b.md": "bravo"}
    assert counted == counters == (2, len("alpha 2") + len("bravo"))
    # the versions, in the order of the batch, seqs increasing, refused ones absent
    ch = (await ws.get("/v1/stores/s/changes", params={"after": seq0})).json()["changes"]
    assert [(c["operation"], c["record"]["path"]) for c in ch] == [
        ("created", "b.md"), ("modified", "a.md"), ("modified", "a.md"), ("created", "gone.md"),
        ("deleted", "gone.md")]
    seqs = [c["seq"] for c in ch]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert ch[2]["record"]["mode"] == 0o600


async def test_store_limit_reached_mid_batch(env):
    app, admin, ws = env
    ops = [_op("create", body={"path": f"f{i}.md", "content": f"file {i}"}) for i in range(9)]
    results = await _batch(ws, ops)
    assert [x["status"] for x in results] == [201] * 6 + [507] * 3  # max_records 6
    assert all(x["body"]["code"] == "store_full" for x in results[6:])
    live, counted, counters = _state(app)
    assert sorted(live) == [f"f{i}.md" for i in range(6)]
    assert counted == counters == (6, sum(len(f"file {i}") for i in range(6)))
    # a delete frees one slot: the create after it in the same batch fits, the next does not
    results = await _batch(ws, [_op("delete", record_id=results[0]["body"]["id"]),
                                _op("create", body={"path": "g1.md", "content": "g"}),
                                _op("create", body={"path": "g2.md", "content": "g"})])
    assert [x["status"] for x in results] == [204, 201, 507]
    assert _state(app)[1] == _state(app)[2] == (6, sum(len(f"file {i}") for i in range(1, 6)) + 1)


async def test_size_bound_and_whole_batch_refusals(env, monkeypatch):
    app, admin, ws = env
    one = _op("create", body={"path": "x.md", "content": "x"})
    r = await ws.post("/v1/stores/s/batch", json={"operations": [one] * (BATCH_MAX_OPERATIONS + 1)})
    assert r.status_code == 413 and r.json()["code"] == "batch_too_large"
    monkeypatch.setattr(app.state.service.settings, "max_body", 1000)  # the batch handler's own bound
    r = await ws.post("/v1/stores/s/batch", json={"operations": [
        _op("create", body={"path": f"{i}.md", "content": "y" * 200}) for i in range(10)]})
    assert r.status_code == 413 and r.json()["code"] == "batch_too_large"
    r = await ws.post("/v1/stores/s/batch", json={"operations": [one]}, headers={"Idempotency-Key": "k"})
    assert r.status_code == 422 and "idempotency_key" in r.json()["detail"]
    r = await ws.post("/v1/stores/s/batch", json={"ops": []})
    assert r.status_code == 422 and r.json()["code"] == "validation_error"
    r = await ws.post("/v1/stores/nope/batch", json={"operations": [one]})
    assert r.status_code == 404 and r.json()["code"] == "store_not_attached"
    await admin.put("/v1/workspaces/ws/attachments/s", json={"access": "read_only"})
    r = await ws.post("/v1/stores/s/batch", json={"operations": [one]})
    assert r.status_code == 403 and r.json()["code"] == "read_only"
    assert _state(app)[0] == {}  # nothing applied by any of them


async def test_a_record_id_longer_than_any_id_is_refused_whole_not_quoted_back(env):
    # attack24 F3: an id no record has, as long as the body allows, was quoted in each
    # operation's refusal (an answer ~3x the request: 144 MB for a 48 MB batch)
    app, admin, ws = env
    r = await ws.post("/v1/stores/s/batch", json={"operations": [
        _op("delete", record_id="\u00e9" * 20_000) for _ in range(20)]})
    assert r.status_code == 422 and r.json()["code"] == "validation_error" and len(r.content) < 4096
    r = await ws.post("/v1/stores/s/batch", json={"operations": [_op("delete", record_id="x" * 64)]})
    assert r.status_code == 200 and r.json()["results"][0]["status"] == 404
    assert _state(app)[0] == {}


async def test_keys_are_per_operation_and_shared_with_single_requests(env):
    app, admin, ws = env
    body = {"path": "k.md", "content": "kilo"}
    r = await ws.post("/v1/stores/s/records", json=body, headers={"Idempotency-Key": "key-1"})
    assert r.status_code == 201
    rec = r.json()
    results = await _batch(ws, [
        _op("create", idempotency_key="key-1", body={"content": "kilo", "path": "k.md"}),  # same request
        _op("create", idempotency_key="key-1", body={"path": "k.md", "content": "other"}),  # reused
        _op("update", record_id=rec["id"], if_match=f'"{rec["sha256"]}"', idempotency_key="key-2",
            body={"content": "kilo 2"}),
        _op("update", record_id=rec["id"], if_match=f'"{rec["sha256"]}"', idempotency_key="key-2",
            body={"content": "kilo 2"}),  # the same key again in the batch: its answer replayed
    ])
    assert [(x["status"], x["replayed"]) for x in results] == [(201, True), (422, False), (200, False), (200, True)]
    assert results[0]["body"] == rec and results[1]["body"]["code"] == "idempotency_key_reused"
    assert results[3]["body"] == results[2]["body"]
    # the batch's answer replays for the same operation sent alone
    r = await ws.put(f"/v1/stores/s/records/{rec['id']}", json={"content": "kilo 2"},
                     headers={"Idempotency-Key": "key-2", "If-Match": f'"{rec["sha256"]}"'})
    assert r.status_code == 200 and r.headers.get("idempotent-replayed") == "true"
    assert r.json() == results[2]["body"] and r.headers["etag"] == f'"{results[2]["etag"]}"'
    versions = (await ws.get(f"/v1/stores/s/records/{rec['id']}/versions")).json()
    assert [v["version"] for v in versions] == [1, 2]


async def test_a_delete_tells_the_seq_of_its_version_alone_in_a_batch_and_replayed(env):
    """A delete is answered without a body (204); ``Memfuse-Seq`` (a batch result's ``seq``)
    gives the change-feed seq of its ``deleted`` version, the same when its idempotency key
    replays it, so its writer can tell older versions in the feed, which leaves its own out
    (attack 18 F9). Other results carry no ``seq``."""
    app, admin, ws = env
    one = (await ws.post("/v1/stores/s/records", json={"path": "d1.md", "content": "x"})).json()
    two = (await ws.post("/v1/stores/s/records", json={"path": "d2.md", "content": "y"})).json()

    async def deleted_seq(rid: str) -> int:
        versions = (await ws.get(f"/v1/stores/s/records/{rid}/versions")).json()
        assert versions[-1]["operation"] == "deleted"
        return versions[-1]["seq"]

    r = await ws.delete(f"/v1/stores/s/records/{one['id']}", headers={"Idempotency-Key": "del-1"})
    assert r.status_code == 204 and r.content == b""
    assert int(r.headers["memfuse-seq"]) == await deleted_seq(one["id"])
    again = await ws.delete(f"/v1/stores/s/records/{one['id']}", headers={"Idempotency-Key": "del-1"})
    assert again.status_code == 204 and again.headers.get("idempotent-replayed") == "true"
    assert again.headers["memfuse-seq"] == r.headers["memfuse-seq"]
    results = await _batch(ws, [
        _op("create", body={"path": "d3.md", "content": "z"}),
        _op("delete", record_id=two["id"], idempotency_key="del-2"),
        _op("delete", record_id=two["id"], idempotency_key="del-2"),  # replayed in the batch
        _op("delete", record_id=one["id"]),  # already deleted: 404, no seq
    ])
    assert [x["status"] for x in results] == [201, 204, 204, 404]
    assert "seq" not in results[0] and "seq" not in results[3]
    assert results[1]["seq"] == results[2]["seq"] == await deleted_seq(two["id"])
    assert results[1]["body"] is None
    r = await ws.get("/v1/stores/s/changes", params={"after": results[1]["seq"] - 1})
    [ch] = r.json()["changes"]
    assert ch["record"]["id"] == two["id"] and ch["record"]["deleted"]


async def test_the_client_returns_a_deletes_seq_alone_and_in_a_batch():
    """``ApiClient.delete_record`` returns the ``Memfuse-Seq`` of the delete; ``batch``
    gives it as a delete's outcome (what the sidecar's outbox keeps: ``Entry.seq``)."""
    fake = FakeControlPlane(seed=3)
    try:
        token = await fake.setup("ws", stores=("default",))
        async with ApiClient(fake.base_url, token, transport=fake.transport, instance="i") as api:
            a = await api.create_record("default", "a.md", "alpha")
            b = await api.create_record("default", "b.md", "beta")
            seq = await api.delete_record("default", a.id, idempotency_key="d-a")
            assert seq == (await api.get_record("default", a.id)).seq
            [out] = await api.batch("default", [api.batch_delete(b.id, idempotency_key="d-b")])
            assert out == (await api.get_record("default", b.id)).seq and out > seq
    finally:
        await fake.aclose()


async def test_batch_retried_after_a_lost_response_applies_nothing_twice():
    fake = FakeControlPlane(seed=7)
    try:
        token = await fake.setup("ws", stores=("default",))
        async with ApiClient(fake.base_url, token, transport=fake.transport, instance="i") as api:
            a = await api.create_record("default", "a.md", "alpha", idempotency_key="a-1")
            ops = [api.batch_create(f"n{i}.md", f"new {i}", idempotency_key=f"c-{i}") for i in range(20)]
            ops.append(api.batch_update(a.id, "alpha 2", if_match=a.sha256, idempotency_key="u-1"))
            ops.append(api.batch_create("a.md", "taken", idempotency_key="c-dup"))
            fake.faults.drop_rate = 1.0  # applied, then the connection drops
            with pytest.raises(TransientError):
                await api.batch("default", ops)
            fake.faults.drop_rate = 0.0
            assert fake.counters.dropped == 1
            out = await api.batch("default", ops)  # the same operations, the same keys
            assert all(isinstance(x, Record) for x in out[:21])
            assert isinstance(out[21], Conflict) and out[21].code == "path_exists"
            assert out[20].sha256 == hashlib.sha256(b"alpha 2").hexdigest()
            # a stale If-Match and a full store are each that operation's own error
            out = await api.batch("default", [api.batch_update(a.id, "x", if_match=a.sha256),
                                              api.batch_create("z.md", "z")])
            assert isinstance(out[0], PreconditionFailed) and out[0].current_sha256 == out[0].problem["sha256"]
            assert isinstance(out[1], Record)
            recs, _ = await api.snapshot("default")
            assert sorted(r.path for r in recs) == sorted(["a.md", "z.md", *(f"n{i}.md" for i in range(20))])
            assert [v.version for v in await api.versions("default", a.id)] == [1, 2]
            for r in recs:
                if r.path.startswith("n"):
                    assert r.version == 1  # created once
        async with ApiClient(fake.base_url, fake.admin_token, transport=fake.transport) as adm:
            await adm.update_store("default", max_records=len(recs))
        async with ApiClient(fake.base_url, token, transport=fake.transport) as api:
            out = await api.batch("default", [api.batch_create("full.md", "f")])
            assert isinstance(out[0], StoreFull)
    finally:
        await fake.aclose()


async def test_one_commit_note_per_batch(env, monkeypatch):
    """The batch publishes its notes once (one NOTIFY on PostgreSQL) with one note for the
    store up to its last seq, and wakes this process's waiters once."""
    app, admin, ws = env
    svc = app.state.service
    published: list[list] = []
    real = svc.bus.publish

    def publish(conn, notes):
        published.append(list(notes))
        return real(conn, notes)
    monkeypatch.setattr(svc.bus, "publish", publish)
    results = await _batch(ws, [_op("create", body={"path": f"p{i}.md", "content": "p"}) for i in range(5)])
    assert len(published) == 1
    feeds = [n for n in published[0] if n.kind == "f"]
    assert len(feeds) == 1 and feeds[0].key == "s" and feeds[0].seq == results[-1]["body"]["seq"]


async def test_operation_refused_after_it_wrote_reruns_the_batch_with_savepoints(env, monkeypatch, caplog):
    """No rule refuses a write after its first statement today; if one did, the batch runs
    again with a SAVEPOINT per operation and the refusal still leaves nothing."""
    from memfuse.server import records
    from memfuse.server.base import ServiceError
    app, admin, ws = env
    real, real_answer = records._record_model, records.record_answer

    def late(rec, *, with_content):
        if rec.path in ("late.md", "late2.md"):
            raise ServiceError(422, "invalid_type", "refused late (test)")
        return real(rec, with_content=with_content)

    def late_answer(rec):  # a create's answer (the move's is _record_model's)
        if rec.path in ("late.md", "late2.md"):
            raise ServiceError(422, "invalid_type", "refused late (test)")
        return real_answer(rec)
    monkeypatch.setattr(records, "_record_model", late)
    monkeypatch.setattr(records, "record_answer", late_answer)
    r = await ws.post("/v1/stores/s/records", json={"path": "a.md", "content": "a"})
    a = r.json()
    results = await _batch(ws, [
        _op("create", body={"path": "x.md", "content": "x"}),
        _op("create", body={"path": "late.md", "content": "late"}),  # deferred create, refused after
        _op("update", record_id=a["id"], body={"content": "a2"}),
        _op("move", record_id=a["id"], body={"path": "late2.md"}),  # a real write, refused after
        _op("create", body={"path": "y.md", "content": "y"}),
    ])
    assert [x["status"] for x in results] == [201, 422, 200, 422, 201]
    live, counted, counters = _state(app)
    assert live == {"a.md": "a2", "x.md": "x", "y.md": "y"}
    assert counted == counters == (3, 4)
    ch = (await ws.get("/v1/stores/s/changes", params={"after": a["seq"]})).json()["changes"]
    assert [(c["operation"], c["record"]["path"]) for c in ch] == [
        ("created", "x.md"), ("modified", "a.md"), ("created", "y.md")]
    assert "running the batch with savepoints" in caplog.text
