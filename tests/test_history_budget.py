"""The history budget of a store (docs/SEMANTICS.md "History budget"): the content of past
versions beyond the store's budget (bytes, versions; never younger than the minimum age) is
pruned, oldest first, keeping the metadata; pruned versions show as such in history (API,
CLI, memory tool, console); restoring or showing one answers a clear problem; the usage is in
the store's answer and the budget is settable per store. On the control plane the tests run
on (SQLite, or PostgreSQL with ``MEMFUSE_TEST_DB_URL``)."""
from __future__ import annotations

import pytest

from memfuse.client import ApiClient
from memfuse.errors import Conflict
from memfuse.server import history

STORE = "s"


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


async def test_defaults_are_in_force_and_usage_is_reported(admin, api):
    st = await admin.get_store(STORE)
    assert st.max_history_bytes == 16 * st.max_store_bytes
    assert st.max_history_versions == 16 * st.max_records
    assert st.history_min_age_s == 86_400
    assert (st.history_bytes, st.history_versions) == (0, 0)
    rec = await api.create_record(STORE, "a.md", "x" * 100)
    for i in range(5):
        await api.update_record(STORE, rec.id, f"{i}" * 100)
    st = await admin.get_store(STORE)
    assert (st.history_bytes, st.history_versions) == (500, 5)  # the 5 past versions
    assert (st.usage_bytes, st.record_count) == (100, 1)
    await api.delete_record(STORE, rec.id)
    st = await admin.get_store(STORE)
    # a deleted record's versions are all history (its last one, restorable, included)
    assert (st.history_bytes, st.history_versions) == (700, 7) and st.usage_bytes == 0


async def test_rewrites_past_the_budget_prune_the_oldest_content_and_keep_metadata(admin, api, fake):
    """300 rewrites of a 1 KiB record in a 4 KiB store: history stays within the budget."""
    await admin.update_store(STORE, max_store_bytes=4096, max_history_bytes=8192,
                             history_min_age_s=0)
    st = await admin.get_store(STORE)
    assert (st.max_history_bytes, st.history_min_age_s) == (8192, 0)
    rec = await api.create_record(STORE, "r.md", "v0\n" + "x" * 1021)
    other = await api.create_record(STORE, "other.md", "keep me\n")
    for i in range(1, 300):
        await api.update_record(STORE, rec.id, f"v{i}\n" + "x" * (1021 - len(str(i)) + 1))
    st = await admin.get_store(STORE)
    assert st.history_bytes <= 8192 and st.history_versions == 8, st
    versions = await api.versions(STORE, rec.id)
    assert len(versions) == 300  # every version's metadata is kept
    pruned = [v.version for v in versions if v.pruned]
    kept = [v.version for v in versions if not v.pruned]
    assert pruned == list(range(1, 292)) and kept == list(range(292, 301))  # oldest first
    # the current content and other records are never pruned
    assert (await api.get_record(STORE, rec.id)).content.startswith("v299\n")
    assert (await api.get_record(STORE, other.id)).content == "keep me\n"
    v1 = await api.version(STORE, rec.id, 1)
    assert v1.pruned and v1.content is None and v1.size == 1024 and v1.sha256
    with pytest.raises(Conflict) as info:
        await api.restore(STORE, rec.id, 1)
    assert info.value.code == "pruned" and "history budget" in info.value.detail
    await api.restore(STORE, rec.id, 295)  # a kept version restores
    # the counters agree with the rows
    async with fake.client(fake.admin_token) as http:
        metrics = (await http.get("/metrics")).text
    assert "memfuse_server_history_pruned_versions_total" in metrics


async def test_the_minimum_age_protects_recent_versions(admin, api):
    await admin.update_store(STORE, max_history_bytes=10, max_history_versions=1,
                             history_min_age_s=3600)
    rec = await api.create_record(STORE, "young.md", "a\n")
    for i in range(10):
        await api.update_record(STORE, rec.id, f"b{i}\n")
    versions = await api.versions(STORE, rec.id)
    assert not any(v.pruned for v in versions)
    st = await admin.get_store(STORE)
    assert st.history_versions == 10 and st.history_bytes > st.max_history_bytes  # over, but young


async def test_version_budget_and_batches_and_redaction_count(admin, api):
    await admin.update_store(STORE, max_history_versions=3, history_min_age_s=0)
    ops = [ApiClient.batch_create(f"b{i}.md", f"{i}\n") for i in range(5)]
    out = await api.batch(STORE, ops)
    ids = [r.id for r in out]
    for k in range(2):
        out = await api.batch(STORE, [ApiClient.batch_update(i, f"again {k} {i}\n") for i in ids])
    st = await admin.get_store(STORE)
    assert st.history_versions == 3, st
    all_versions = {i: await api.versions(STORE, i) for i in ids}
    assert sum(v.pruned for vs in all_versions.values() for v in vs) == 7
    # a redaction takes its content out of the count
    kept = [(i, v.version) for i, vs in all_versions.items() for v in vs
            if not v.pruned and v.version != 3]
    rid, n = kept[0]
    await admin.redact(STORE, rid, n)
    assert (await admin.get_store(STORE)).history_versions == 2


def test_budget_defaults_follow_the_store_limits():
    class Row:
        max_history_bytes = max_history_versions = history_min_age_s = None
        max_store_bytes, max_records = 1000, 10
    assert history.budget(Row) == (16_000, 160, 86_400)


async def test_budgets_of_the_largest_limits_fit_64_bits(admin):
    """Limits of 2^63-1 (the largest accepted) give default budgets of 2^63-1, not 16 times
    it: every answer's integers fit the 64 bits clients read (found by a hostile client)."""
    from memfuse.defs import INT64_MAX

    st = await admin.create_store("huge", max_store_bytes=INT64_MAX, max_records=INT64_MAX)
    assert (st.max_history_bytes, st.max_history_versions) == (INT64_MAX, INT64_MAX)
    st = await admin.update_store("huge", max_record_bytes=1 << 20)
    assert (st.max_history_bytes, st.max_history_versions) == (INT64_MAX, INT64_MAX)
    assert max(st.max_history_bytes, st.max_history_versions, st.max_store_bytes) <= INT64_MAX


async def test_console_shows_pruned_versions_and_sets_the_budget():
    """The console: the store page shows the history usage and takes the budget in its
    settings form; a record's history marks pruned versions and offers no restore for them."""
    import httpx

    from memfuse.models import RecordCreate, RecordUpdate, WorkspaceCreate
    from memfuse.server.app import create_app
    from memfuse.server.console.session import csrf_token
    from memfuse.server.service import Principal
    from pgutil import fresh_db_url

    admin_token, p = "history-admin-token", Principal(None)
    with fresh_db_url() as url:
        app = create_app(url, static_tokens={admin_token: None})
        svc = app.state.service
        try:
            svc.create_workspace(p, WorkspaceCreate(name="ws"))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
                await c.get("/ui/login")
                r = await c.post("/ui/login", data={"token": admin_token, "csrf": c.cookies["memfuse_login"]})
                assert r.status_code == 303
                session = c.cookies["memfuse_session"]  # the CSRF token is the session's
                page = (await c.get("/ui/stores/ws")).text
                assert 'name="max_history_bytes" value="1073741824"' in page  # 16 x 64 MiB
                form = {"description": "", "default_type": "project", "max_record_bytes": "1M",
                        "max_store_bytes": "64M", "max_records": "10000", "max_history_bytes": "1K",
                        "max_history_versions": "2", "history_min_age_s": "0", "csrf": csrf_token(session)}
                r = await c.post("/ui/stores/ws/settings", data=form)
                assert r.status_code == 303 and r.headers["location"].endswith("msg=settings_saved")
                st = svc.get_store(p, "ws")
                assert (st.max_history_bytes, st.max_history_versions, st.history_min_age_s) == (1024, 2, 0)
                import json
                rid = json.loads(svc.create_record(p, "ws", RecordCreate(path="a.md", content="v0\n")).body)["id"]
                for i in range(1, 5):
                    svc.update_record(p, "ws", rid, RecordUpdate(content=f"v{i}\n"))
                page = (await c.get(f"/ui/stores/ws/records/{rid}")).text
                assert page.count(">pruned</span>") == 2
                assert page.count('name="version" value=') == 2  # restore offered for the kept two only
                page = (await c.get(f"/ui/stores/ws/records/{rid}?version=1")).text
                assert "pruned by the store&#39;s history budget" in page or "pruned by the store's history budget" in page
                page = (await c.get("/ui/stores/ws")).text
                assert "history 6 B of 1.0 KiB (2 of 2 past versions)" in page or "(2 of 2 past versions)" in page
        finally:
            svc.db.engine.dispose()


# ------------------------------------------------------------------ per-token write rate
async def test_a_token_writing_too_fast_gets_429_with_retry_after(fake, admin, api):
    """Writes of one token draw on its buckets (requests, body bytes); an empty bucket is
    429 ``rate_limited`` with ``Retry-After``, decided before the body is read; reads and
    other tokens are not affected."""
    import httpx

    from memfuse.server.gate import WriteRate

    fake.app.front.write_rate = WriteRate(rate=0.5, burst=3, bytes_rate=1000, bytes_burst=4000)
    async with fake.client(fake.token_for("ws")) as http:
        for i in range(3):
            r = await http.post(f"/v1/stores/{STORE}/records", json={"path": f"r{i}.md", "content": "x\n"})
            assert r.status_code == 201, r.text
        r = await http.post(f"/v1/stores/{STORE}/records", json={"path": "r3.md", "content": "x\n"})
        assert r.status_code == 429 and r.json()["code"] == "rate_limited"
        assert 1 <= int(r.headers["retry-after"]) <= 2
        assert (await http.get(f"/v1/stores/{STORE}/records")).status_code == 200  # reads: not limited
    # another token has its own buckets
    r2 = await admin.create_record(STORE, "admin.md", "y\n")
    assert r2.path == "admin.md"
    # a body larger than the bytes left waits for the bytes bucket (bytes_rate 1000/s)
    fake.app.front.write_rate = WriteRate(rate=100, burst=100, bytes_rate=100, bytes_burst=4000)
    async with fake.client(fake.token_for("ws")) as http:
        r = await http.post(f"/v1/stores/{STORE}/records", json={"path": "big.md", "content": "z" * 3000})
        assert r.status_code == 201
        r = await http.post(f"/v1/stores/{STORE}/records", json={"path": "big2.md", "content": "z" * 3000})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 10
    assert isinstance(r, httpx.Response)


async def test_the_sidecar_waits_out_retry_after(tmp_path, fake):
    """The outbox meets 429 ``rate_limited``: it waits at least ``Retry-After`` before its
    next attempt, and every write commits in the end."""
    import trio

    from memfuse.server.gate import WriteRate
    from test_faults import make_sidecar, remote, start, write

    token = await fake.setup("ws")
    sc = await make_sidecar(tmp_path, fake, token)
    async with trio.open_nursery() as nursery:
        await start(sc, nursery)
        fake.app.front.write_rate = WriteRate(rate=0.5, burst=2, bytes_rate=1 << 20, bytes_burst=1 << 20)
        t0 = trio.current_time()
        for i in range(4):
            await write(sc, f"f{i}.md", f"{i}\n".encode())
        with trio.fail_after(30):
            while sc.committer.depth():
                await trio.sleep(0.02)
        took = trio.current_time() - t0
        assert await remote(fake) == {f"f{i}.md": f"{i}\n".encode() for i in range(4)}
        assert sc.committer.retries >= 1 and took >= 1.5, (sc.committer.retries, took)
        nursery.cancel_scope.cancel()
    sc.journal.close()
    await sc.client.aclose()


async def test_a_writes_counted_store_row_is_the_row_after_its_update(admin, api, fake, monkeypatch):
    """``history.settle_with_usage`` checks the budget on the store row as read for writing
    plus the write's deltas (no RETURNING: bench/README.md, "The close path, session 20:
    serve's writer"): at every check those values are the row's own, read in the same
    transaction, for creates, updates, appends, deletes, restores and moves, with an
    idempotency key (the store row of ``base.RECORD_WRITE_COLUMNS``) and without (every
    column), in a store whose small budget prunes."""
    from sqlalchemy import select

    from memfuse.server.base import _S

    await admin.update_store(STORE, max_history_versions=3, history_min_age_s=0)
    checked: list[int] = []
    real = history._prune

    def prune(conn, store, st=None):
        if st is not None:
            row = conn.execute(select(*history._BUDGET_COLUMNS).where(_S.c.slug == store)).one()
            assert {k: getattr(st, k) for k in row._mapping} == dict(row._mapping)
            checked.append(1)
        return real(conn, store, st)

    monkeypatch.setattr(history, "_prune", prune)
    n = 0

    def key() -> str:
        nonlocal n
        n += 1
        return f"k{n}"

    a = await api.create_record(STORE, "a.md", "x" * 100, idempotency_key=key())
    b = await api.create_record(STORE, "b.md", "y" * 50)
    for i in range(4):
        a = await api.update_record(STORE, a.id, f"{i}" * (90 + i), idempotency_key=key() if i % 2 else None)
    await api.append_record(STORE, a.id, "tail\n", a.sha256, idempotency_key=key())
    await api.move_record(STORE, b.id, "c/b.md")
    await api.delete_record(STORE, b.id, idempotency_key=key())
    newest = max(v.version for v in await api.versions(STORE, b.id) if not v.pruned)
    await api.restore(STORE, b.id, newest, idempotency_key=key())
    assert len(checked) >= 8
    st = await admin.get_store(STORE)
    assert st.history_versions <= 3 and st.record_count == 2


async def test_a_minimum_age_past_year_one_keeps_every_version_and_never_fails_a_write(admin, api):
    """attack24 F2: ``history_min_age_s`` is accepted up to 2**63 - 1; a cutoff of now minus
    that is before year 1 (``OverflowError``: a 500 on every write that met the budget, and a
    mount retrying it forever). It means no version is old enough to prune (``utc_shift``)."""
    for age in (64_000_000_000, 2**63 - 1):
        await admin.update_store(STORE, max_history_versions=1, history_min_age_s=age)
        assert (await admin.get_store(STORE)).history_min_age_s == age
        rec = await api.create_record(STORE, f"old-{age}.md", "v0\n")
        for i in range(1, 4):
            rec = await api.update_record(STORE, rec.id, f"v{i}\n")
        assert rec.version == 4
        assert not any(v.pruned for v in await api.versions(STORE, rec.id))
