"""Staleness (docs/API.md "Staleness"): ``review_after`` / ``expires`` read from the
frontmatter at every write and shown on the record; stale records in the index report, the
prompt block and the console; the expiry sweep deleting expired records (a ``deleted``
version, restorable, a restored one left alone), safely from two replicas at once. Runs on
SQLite here and on PostgreSQL through tests/test_postgres.py."""
from __future__ import annotations

import json
import threading
from datetime import datetime, timedelta, timezone

from sqlalchemy import update

from memfuse.models import RecordCreate, StoreCreate
from memfuse.server import staleness
from memfuse.server.base import _R
from memfuse.server.db import Database
from memfuse.server.service import Principal, Service
from pgutil import fresh_db_url

from test_api import Env, env  # noqa: F401  (env: the fixture)
from test_search_api import batch_create

ADMIN = Principal(workspace=None, name="test")
UTC = timezone.utc


def test_record_dates_from_frontmatter():
    d = staleness.record_dates
    assert d("---\nreview_after: 2027-01-31\nexpires: 2027-02-01T10:00:00+02:00\n---\nx\n") == (
        datetime(2027, 1, 31, tzinfo=UTC), datetime(2027, 2, 1, 8, tzinfo=UTC))
    assert d("---\nexpires: '2027-03-01'\n---\n") == (None, datetime(2027, 3, 1, tzinfo=UTC))
    assert d("---\nexpires: soon\nreview_after: [1]\n---\n") == (None, None)
    assert d("review_after: 2027-01-31\n") == (None, None)  # not frontmatter
    assert d(None) == (None, None) and d("") == (None, None)


async def test_dates_on_the_record_follow_every_write(env: Env):
    rec = await env.create("a.md", "---\nreview_after: 2027-01-31\nexpires: 2028-01-01\n---\nfact\n")
    got = await env.get(rec["id"])
    assert got["review_after"] == "2027-01-31T00:00:00Z" and got["expires_at"] == "2028-01-01T00:00:00Z"
    r = await env.ws.put(f"/v1/stores/default/records/{rec['id']}", json={"content": "fact\n"},
                         headers={"If-Match": f'"{got["sha256"]}"'})
    assert r.status_code == 200, r.text
    got = await env.get(rec["id"])
    assert got["review_after"] is None and got["expires_at"] is None
    # the batch's creates too
    await batch_create(env, {"b.md": "---\nexpires: 2029-05-05\n---\n"})
    ids = await env.live_paths()
    assert (await env.get(ids["b.md"]))["expires_at"] == "2029-05-05T00:00:00Z"


def _age(svc: Service, store: str, path: str, days: int) -> None:
    """Make the live record at ``path`` look unchanged for ``days`` days."""
    with svc.db.write_conn() as conn:
        conn.execute(update(_R).where(_R.c.store == store, _R.c.path == path, _R.c.deleted.is_(False))
                     .values(updated_at=datetime.now(UTC) - timedelta(days=days)))


async def test_stale_records_in_the_report_the_prompt_block_and_the_console(env: Env):
    svc = env.app.state.service
    await batch_create(env, {
        "MEMORY.md": "- [Old](old.md)\n- [Fresh](fresh.md)\n- [Review](review.md)\n",
        "old.md": "x\n", "fresh.md": "x\n", "review.md": "---\nreview_after: 2020-01-01\n---\nx\n",
        "other.md": "x\n",
    })
    _age(svc, "default", "old.md", 100)
    _age(svc, "default", "other.md", 95)
    rep = (await env.ws.get("/v1/stores/default/index")).json()
    assert [r["path"] for r in rep["stale"]] == ["other.md", "old.md", "review.md"] or \
        [r["path"] for r in rep["stale"]] == ["old.md", "other.md", "review.md"]
    assert rep["stale_count"] == 3 and rep["stale_after_days"] == 90
    review = next(r for r in rep["stale"] if r["path"] == "review.md")
    assert review["review_after"] == "2020-01-01T00:00:00Z"
    block = (await env.ws.get("/v1/workspaces/ws/context")).text
    day = (datetime.now(UTC) - timedelta(days=100)).date().isoformat()
    assert (f"verify them before relying on them: `old.md` (unchanged since {day}), "
            "`review.md` (review after 2020-01-01).]") in block
    assert "`fresh.md`" not in block.split("verify them")[1]
    svc.stale_after_days = 0  # by review date only
    block = (await env.ws.get("/v1/workspaces/ws/context")).text
    assert "relying on them: `review.md` (review after 2020-01-01).]" in block
    svc.stale_after_days = 90
    page = (await env.admin.get("/ui/stores/default")).text
    table = page.split('id="stale"')[1].split("</table>")[0]
    assert "<code>old.md</code>" in table and "<code>review.md</code>" in table and "fresh.md" not in table
    ids = await env.live_paths()
    rec_page = (await env.admin.get(f"/ui/stores/default/records/{ids['review.md']}")).text
    assert "<dt>Review after</dt>" in rec_page


async def test_expiry_sweep_deletes_restorably_and_leaves_a_restored_record(env: Env):
    svc = env.app.state.service
    await batch_create(env, {"gone.md": "---\nexpires: 2020-01-01\n---\nold fact\n",
                             "later.md": "---\nexpires: 2999-01-01\n---\n", "plain.md": "x\n"})
    ids = await env.live_paths()
    # records written before their expiry time (the batch wrote them now, after it): age them
    _age(svc, "default", "gone.md", 3000)
    assert staleness.sweep_once(svc) == 1
    assert set(await env.live_paths()) == {"later.md", "plain.md"}
    versions = await env.versions(ids["gone.md"])
    assert versions[-1]["operation"] == "deleted" and versions[-1]["actor"] == "admin:expiry"
    r = await env.ws.post(f"/v1/stores/default/records/{ids['gone.md']}/restore", json={"version": 1})
    assert r.status_code == 200, r.text
    assert staleness.sweep_once(svc) == 0  # changed after its expiry time: left alone
    assert "gone.md" in await env.live_paths()


def test_two_replicas_sweep_at_once_and_delete_each_record_once(tmp_path):
    """Two ``Service``s on one database (two replicas) sweep at the same time: every expired
    record gets exactly one ``deleted`` version."""
    with fresh_db_url(f"sqlite:///{tmp_path / 'x.db'}") as url:
        dbs = [Database(url), Database(url)]
        a, b = Service(dbs[0]), Service(dbs[1])
        a.create_store(ADMIN, StoreCreate(slug="s", max_records=1000))
        ids = [json.loads(a.create_record(ADMIN, "s", RecordCreate(
            path=f"n{i}.md", content="---\nexpires: 2020-01-01\n---\n")).body)["id"] for i in range(40)]
        with dbs[0].write_conn() as conn:
            conn.execute(update(_R).values(updated_at=datetime(2019, 1, 1, tzinfo=UTC)))
        counts: list[int] = []
        errors: list[BaseException] = []
        start = threading.Barrier(2)

        def run(svc: Service) -> None:
            try:
                start.wait(10)
                counts.append(staleness.sweep_once(svc))
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(s,)) for s in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert sum(counts) == 40
        for rid in ids:
            ops = [v.operation.value for v in a.list_versions(ADMIN, "s", rid).versions]
            assert ops == ["created", "deleted"], ops
        for db in dbs:
            db.dispose()


def test_a_time_outside_what_utc_can_hold_is_no_date():
    # attack24 F1: an offset that takes a time before year 1 or past 9999 in UTC raised
    # OverflowError in every write's frontmatter read (a 500; a mount wedged on it)
    d = staleness.record_dates
    for v in ("0001-01-01T00:00:00+01:00", "'0001-01-01T00:00:00+01:00'", "9999-12-31T23:59:59-01:00",
              "'9999-12-31T23:59:59-01:00'", "'0001-01-01 00:30+14:00'"):
        assert d(f"---\nexpires: {v}\nreview_after: {v}\n---\nx\n") == (None, None), v
    assert d("---\nexpires: 9999-12-31T23:59:59+00:00\n---\n") == (None, datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC))


async def test_every_write_of_a_time_utc_cannot_hold_succeeds(env: Env):
    text = "---\nexpires: 0001-01-01T00:00:00+01:00\nreview_after: 9999-12-31T23:59:59-01:00\n---\nx\n"
    rec = await env.create("f1.md", text)
    got = await env.get(rec["id"])
    assert got["expires_at"] is None and got["review_after"] is None
    r = await env.ws.put(f"/v1/stores/default/records/{rec['id']}", json={"content": text + "y\n"},
                         headers={"If-Match": f'"{got["sha256"]}"'})
    assert r.status_code == 200, r.text
    await batch_create(env, {"f1b.md": text})
    assert "f1b.md" in await env.live_paths()


def test_a_stale_after_past_year_one_is_no_error(tmp_path):
    # attack24 F5: --stale-after 99999999 (days) made the index report a 500
    db = Database(f"sqlite:///{tmp_path}/s.db")
    try:
        with db.read_conn() as conn:
            for days in (99_999_999, 2**62):
                conn.execute(_R.select().where(staleness.stale_condition(datetime.now(UTC), days))).fetchall()
    finally:
        db.dispose()
