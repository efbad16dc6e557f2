"""Appends sent as appends and stored as what they add (docs/SEMANTICS.md "Append versions",
docs/API.md ``POST .../append``): the suffix with ``If-Match`` its base; append versions that
hold only their suffix, a whole copy every ``deltas.CHAIN_MAX`` links; every version's content
exact through history, the change feed, restore, the memory-store API, redaction and the
history budget's pruning. On the control plane the tests run on (SQLite, or PostgreSQL with
``MEMFUSE_TEST_DB_URL``)."""
from __future__ import annotations

import pytest
from sqlalchemy import select

from memfuse.client import ApiClient
from memfuse.errors import ApiError, PreconditionFailed
from memfuse.server import deltas
from memfuse.server.db import VersionRow

STORE = "s"
_V = VersionRow.__table__


@pytest.fixture
async def admin(fake):
    await fake.setup("ws", stores=(STORE,))
    async with ApiClient(fake.base_url, fake.admin_token, transport=fake.transport, instance="pytest") as c:
        yield c


@pytest.fixture
async def api(fake, admin):
    async with ApiClient(fake.base_url, fake.token_for("ws"), transport=fake.transport,
                         instance="pytest") as c:
        yield c


def _rows(fake, record_id: str) -> list:
    """The stored version rows of a record (what the database holds, not what the API shows)."""
    with fake.service.db.read_conn() as conn:
        return conn.execute(select(_V.c.version, _V.c.content, _V.c.base_version, _V.c.chain)
                            .where(_V.c.record_id == record_id).order_by(_V.c.version)).all()


def _stored(fake, record_id: str) -> int:
    return sum(len((r.content or "").encode()) for r in _rows(fake, record_id))


def _line(i: int) -> str:
    return f"{{\"n\": {i}, \"note\": \"line é {i}\"}}\n"


async def _appended(api, rid: str, n: int, start: str) -> list[str]:
    """Append ``n`` lines through the append endpoint; the content after each, in order."""
    contents, cur = [start], await api.get_record(STORE, rid)
    text = start
    for i in range(n):
        cur = await api.append_record(STORE, rid, _line(i), if_match=cur.sha256, idempotency_key=f"a{i}")
        text += _line(i)
        contents.append(text)
    return contents


async def test_appends_are_stored_as_suffixes_and_every_version_reads_exact(api, fake):
    base = "# journal\n" + "x" * 100_000 + "\n"
    rec = await api.create_record(STORE, "JOURNAL.md", base, type="project")
    n = 80
    contents = await _appended(api, rec.id, n, base)
    cur = await api.get_record(STORE, rec.id)
    assert cur.content == contents[-1] and cur.version == n + 1 and cur.size == len(contents[-1].encode())
    rows = _rows(fake, rec.id)
    whole = [r.version for r in rows if r.base_version is None]
    # a whole copy at version 1 and then every CHAIN_MAX links
    assert whole == list(range(1, n + 2, deltas.CHAIN_MAX + 1)), whole
    assert all(r.base_version == r.version - 1 for r in rows if r.base_version is not None)
    appended = sum(len(_line(i).encode()) for i in range(n))
    full_copies = sum(len(contents[v - 1].encode()) for v in whole)
    assert _stored(fake, rec.id) <= 2 * appended + full_copies
    # the stored bytes are far below what whole versions held
    assert _stored(fake, rec.id) < sum(len(c.encode()) for c in contents) / 10
    for v in range(1, n + 2):
        got = await api.version(STORE, rec.id, v)
        assert got.content == contents[v - 1], v
    # the change feed carries each version's whole content
    page = await api.changes(STORE, 0, content=True)
    mine = [c for c in page.changes if c.record.id == rec.id]
    assert [c.record.content for c in mine] == contents


async def test_an_append_needs_if_match_and_meets_a_rival_change_with_412(api, fake):
    rec = await api.create_record(STORE, "a.md", "one\n", type="project")
    async with fake.client(fake.token_for("ws")) as http:
        r = await http.post(f"/v1/stores/{STORE}/records/{rec.id}/append", json={"append": "two\n"})
        assert r.status_code == 428 and r.json()["code"] == "precondition_required"
        r = await http.post(f"/v1/stores/{STORE}/records/{rec.id}/append", json={"append": "two\n"},
                            headers={"If-Match": "*"})
        assert r.status_code == 428
    rival = await api.update_record(STORE, rec.id, "rival\n")
    with pytest.raises(PreconditionFailed) as info:
        await api.append_record(STORE, rec.id, "two\n", if_match=rec.sha256)
    assert info.value.current_sha256 == rival.sha256
    done = await api.append_record(STORE, rec.id, "two\n", if_match=rival.sha256)
    assert (await api.get_record(STORE, rec.id)).content == "rival\ntwo\n" and done.version == 3


async def test_append_keeps_the_rules_of_a_whole_write(api, admin):
    rec = await api.create_record(STORE, "a.md", "---\ntype: project\n---\nnotes\n")
    # a secret the suffix completes (its first half was already there) is refused
    half = await api.update_record(STORE, rec.id, "---\ntype: project\n---\nkey = AKIA")
    with pytest.raises(ApiError) as info:
        await api.append_record(STORE, rec.id, "IOSFODNN7QZ4RTXA\n", if_match=half.sha256)
    assert info.value.code == "secret_detected"
    with pytest.raises(ApiError) as info:
        await api.append_record(STORE, rec.id, "bad \x00 nul", if_match=half.sha256)
    assert info.value.code == "invalid_content"
    await admin.update_store(STORE, max_record_bytes=64)
    with pytest.raises(ApiError) as info:
        await api.append_record(STORE, rec.id, "y" * 64, if_match=half.sha256)
    assert info.value.status == 413
    # an empty suffix with the same attributes makes no version
    same = await api.append_record(STORE, rec.id, "", if_match=half.sha256)
    assert same.version == half.version


async def test_idempotent_replay_and_batch(api, fake):
    rec = await api.create_record(STORE, "a.md", "one\n", type="project")
    first = await api.append_record(STORE, rec.id, "two\n", if_match=rec.sha256, idempotency_key="k1")
    again = await api.append_record(STORE, rec.id, "two\n", if_match=rec.sha256, idempotency_key="k1")
    assert again.version == first.version == 2  # replayed, never appended twice
    assert (await api.get_record(STORE, rec.id)).content == "one\ntwo\n"
    ops = [ApiClient.batch_append(rec.id, "three\n", if_match=first.sha256, idempotency_key="k2"),
           ApiClient.batch_append(rec.id, "four\n", if_match=first.sha256, idempotency_key="k3")]
    out = await api.batch(STORE, ops)
    assert out[0].version == 3 and isinstance(out[1], PreconditionFailed)
    # the batch's answer replays for the same operation sent alone
    alone = await api.append_record(STORE, rec.id, "three\n", if_match=first.sha256, idempotency_key="k2")
    assert alone.version == 3
    assert (await api.get_record(STORE, rec.id)).content == "one\ntwo\nthree\n"
    assert [r.base_version for r in _rows(fake, rec.id)] == [None, 1, 2]


async def test_whole_writes_that_extend_moves_and_deletes_are_stored_as_suffixes(api, fake):
    body = "z" * 10_000 + "\n"
    rec = await api.create_record(STORE, "a.md", body, type="project")
    await api.update_record(STORE, rec.id, body + "more\n")  # a whole PUT that appends
    await api.move_record(STORE, rec.id, "b.md")
    await api.delete_record(STORE, rec.id)
    rows = _rows(fake, rec.id)
    assert [(r.base_version, r.content if r.base_version else None) for r in rows] == [
        (None, None), (1, "more\n"), (2, ""), (3, "")]
    await api.restore(STORE, rec.id, 2)
    assert (await api.get_record(STORE, rec.id)).content == body + "more\n"
    assert (await api.version(STORE, rec.id, 4)).content == body + "more\n"
    # a rewrite is whole again
    await api.update_record(STORE, rec.id, "new\n")
    assert _rows(fake, rec.id)[-1].base_version is None


async def test_restore_redact_and_memory_store_api_of_append_versions(api, admin, fake):
    base = "base\n" * 1000
    rec = await api.create_record(STORE, "j.md", base, type="project")
    contents = await _appended(api, rec.id, 6, base)
    # restore an append version: the live content is that version's, whole
    await api.restore(STORE, rec.id, 4)
    assert (await api.get_record(STORE, rec.id)).content == contents[3]
    # redact versions later ones build on: they still read exact
    await admin.redact(STORE, rec.id, 2)
    await admin.redact(STORE, rec.id, 5)
    for v in (1, 3, 4, 6, 7):
        assert (await api.version(STORE, rec.id, v)).content == contents[v - 1], v
    assert (await api.version(STORE, rec.id, 2)).content is None
    rows = {r.version: r for r in _rows(fake, rec.id)}
    assert rows[3].base_version is None and rows[6].base_version is None  # made whole first
    # the memory-store API's versions (view=full) show whole content
    async with fake.client(fake.token_for("ws")) as http:
        r = await http.get(f"/v1/memory_stores/memstore_{STORE}/memory_versions",
                           params={"view": "full", "limit": 50})
        assert r.status_code == 200, r.text
        got = {v["content"] for v in r.json()["data"] if v.get("content")}
    assert {contents[v - 1] for v in (1, 3, 4, 6, 7)} <= got


async def test_pruning_a_base_keeps_its_dependents_exact(api, admin, fake):
    await admin.update_store(STORE, max_history_bytes=60_000, history_min_age_s=0)
    base = "b" * 10_000 + "\n"
    rec = await api.create_record(STORE, "j.md", base, type="project")
    contents = await _appended(api, rec.id, 12, base)
    versions = await api.versions(STORE, rec.id)
    pruned = [v.version for v in versions if v.pruned]
    kept = [v.version for v in versions if not v.pruned]
    assert pruned and pruned == list(range(1, len(pruned) + 1))  # the budget counts whole sizes
    for v in kept:
        assert (await api.version(STORE, rec.id, v)).content == contents[v - 1], v
    assert _rows(fake, rec.id)[len(pruned)].base_version is None  # the first kept one is whole
    # the next appends still chain onto the kept ones
    cur = await api.get_record(STORE, rec.id)
    await api.append_record(STORE, rec.id, "tail\n", if_match=cur.sha256)
    assert (await api.version(STORE, rec.id, cur.version + 1)).content == contents[-1] + "tail\n"


def test_materialize_all_makes_every_version_whole(fake_sync_db):
    """The downgrade of 0011: every append version becomes whole, exact."""
    svc, conn_factory = fake_sync_db
    with conn_factory() as conn:
        rows = conn.execute(select(_V.c.seq, _V.c.record_id, _V.c.version, _V.c.chain, _V.c.content,
                                   _V.c.base_version)).all()
        expected = {r.seq: c.content for r, c in zip(rows, deltas.resolve(conn, rows))}
        assert any(r.base_version is not None for r in rows)
        assert deltas.materialize_all(conn) > 0
        after = conn.execute(select(_V.c.seq, _V.c.content, _V.c.base_version)).all()
    assert all(r.base_version is None for r in after)
    assert {r.seq: r.content for r in after} == expected


@pytest.fixture
def fake_sync_db():
    """A service on an in-memory database holding a record with append versions."""
    import trio

    from memfuse.fake import FakeControlPlane

    async def build():
        f = FakeControlPlane()
        await f.setup("ws", stores=(STORE,))
        async with ApiClient(f.base_url, f.token_for("ws"), transport=f.transport, instance="pytest") as c:
            rec = await c.create_record(STORE, "a.md", "a" * 5000, type="project")
            await _appended(c, rec.id, 40, "a" * 5000)
        return f

    f = trio.run(build)
    try:
        yield f.service, f.service.db.write_conn
    finally:
        trio.run(f.aclose)
