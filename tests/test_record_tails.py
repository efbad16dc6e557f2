"""Record tails (``memfuse.server.tails``, revision ``0018_record_tails``): an append to a large
record writes what it appends, and every reader of live content reads the tail too.

- the read surface (record, snapshot pages, the JSON page, search by substring and ranked,
  the record search's text filter, the memory-store API's listing, the memory tool, the index
  report and context of a ``MEMORY.md`` with a tail, the CLI's local reads) answers the same
  for a record with a pending tail as for one holding the same content whole; and no
  statement the service runs selects ``records.content`` outside the one rule;
- a tail starts, grows, folds (past ``TAIL_MAX_BYTES``) and ends at any other write, and every
  version and the live content stay exact through it;
- the appends' cost: the large row is written once per fold, not at every append;
- downgrade folds every tail back into its record.
On the control plane the tests run on (SQLite, or PostgreSQL with ``MEMFUSE_TEST_DB_URL``).
"""
from __future__ import annotations

import re

import pytest
from sqlalchemy import event, select, text

from memfuse.client import ApiClient
from memfuse.defs import LIVE_CONTENT_SQL
from memfuse.models import RecordAppend, RecordCreate, RecordUpdate, StoreCreate
from memfuse.server import fulltext, schema, tails
from memfuse.server.db import Database, RecordTailRow
from memfuse.server.service import Principal
from pgutil import fresh_db_url

STORE = "s"
_T = RecordTailRow.__table__
ADMIN = Principal(workspace=None, name="test")
LINE = '{"event": "a journal line of some agent notes, long enough to look like one"}\n'
# a base whose tail can start at the first append: past the full-text head, with lines
BASE = "# journal\n\n## head words\n\n" + LINE * ((fulltext.PG_MAX_CHARS + 40_000) // len(LINE))


@pytest.fixture
async def fake(tmp_path, monkeypatch):
    """The fake control plane on a database file (SQLite), or on PostgreSQL under
    ``MEMFUSE_TEST_DB_URL`` (a fresh schema): the tails' SQL runs on both."""
    import memfuse.fake as fk

    with fresh_db_url(f"sqlite:///{tmp_path / 'cp.db'}") as url:
        make = fk.create_app
        monkeypatch.setattr(fk, "create_app", lambda _url, **kw: make(url, **kw))
        f = fk.FakeControlPlane()
        try:
            yield f
        finally:
            await f.aclose()


@pytest.fixture
async def admin(fake):
    await fake.setup("ws", stores=(STORE,))
    async with ApiClient(fake.base_url, fake.admin_token, transport=fake.transport, instance="pytest") as c:
        await c.update_store(STORE, max_record_bytes=8 << 20)
        yield c


@pytest.fixture
async def api(fake, admin):
    async with ApiClient(fake.base_url, fake.token_for("ws"), transport=fake.transport,
                         instance="pytest") as c:
        yield c


def _tail(fake, rid: str) -> str | None:
    with fake.service.db.read_conn() as conn:
        return conn.scalar(select(_T.c.tail).where(_T.c.record_id == rid))


def _base(fake, rid: str) -> str:
    with fake.service.db.read_conn() as conn:
        return conn.scalar(text("SELECT content FROM records WHERE id = :r"), {"r": rid})


async def _append(api, rid: str, lines: list[str]) -> str:
    cur = await api.get_record(STORE, rid, content=False)
    for i, line in enumerate(lines):
        cur = await api.append_record(STORE, rid, line, if_match=cur.sha256, idempotency_key=f"{rid}-{cur.version}-{i}")
    return cur.sha256


@pytest.fixture
def audit(fake):
    """Every SQL statement the service runs; ``check()`` fails on a ``SELECT`` that reads
    ``records.content`` other than through the live-content rule (or the append's own read of
    the base head)."""
    seen: list[str] = []

    def before(conn, cursor, statement, parameters, context, executemany):
        seen.append(statement)

    engine = fake.service.db.engine
    event.listen(engine, "before_cursor_execute", before)

    class Audit:
        def check(self) -> None:
            allowed = ("THEN records.content",)
            bad = []
            for s in seen:
                flat = " ".join(s.split())
                if not flat.lstrip("( ").upper().startswith("SELECT"):
                    continue
                rest = flat.replace(" ".join(LIVE_CONTENT_SQL.split()), "")
                for a in allowed:
                    rest = rest.replace(a, "")
                if re.search(r"\brecords\.content\b", rest):
                    bad.append(flat[:300])
            assert not bad, bad
            assert any(" ".join(LIVE_CONTENT_SQL.split()) in " ".join(s.split()) for s in seen)

    yield Audit()
    event.remove(engine, "before_cursor_execute", before)


async def test_every_reader_sees_a_pending_tail(api, fake, audit):
    appended = [f"line {i} with needle-{i} and tailword\n" for i in range(40)]
    a = await api.create_record(STORE, "notes/a.md", BASE, type="project")
    await _append(api, a.id, appended)
    whole = BASE + "".join(appended)
    assert _tail(fake, a.id) is not None and len(_base(fake, a.id)) < len(whole)  # a pending tail
    b = await api.create_record(STORE, "notes/b.md", whole, type="project")
    assert _tail(fake, b.id) is None
    # the root index with a tail too (the index report and the context read it)
    m = await api.create_record(STORE, "MEMORY.md", BASE)
    await _append(api, m.id, ["- [tail link](notes/a.md) indexed late\n"])
    assert _tail(fake, m.id) is not None

    ga, gb = await api.get_record(STORE, a.id), await api.get_record(STORE, b.id)
    assert ga.content == gb.content == whole and ga.size == gb.size and ga.sha256 == gb.sha256
    page = await api.list_records(STORE, content=True)
    by_path = {r.path: r.content for r in page.records}
    assert by_path["notes/a.md"] == by_path["notes/b.md"] == whole
    assert by_path["MEMORY.md"].endswith("indexed late\n")
    # the service's other page (pydantic) and the record search's text filter
    p = fake.service.authenticate(fake.token_for("ws"))
    pg = fake.service.list_records(p, STORE, with_content=True)
    assert {r.path: r.content for r in pg.records}["notes/a.md"] == whole
    found = fake.service.search_records(p, STORE, text="NEEDLE-39")
    assert sorted(r.path for r in found.records) == ["notes/a.md", "notes/b.md"]
    # substring search, case-insensitive and not, content and any
    for kw in ({}, {"case_sensitive": True}, {"match": "content"}):
        hits = (await api.search(STORE, "needle-39", max_lines=3, **kw)).hits
        assert sorted(h.record.path for h in hits) == ["notes/a.md", "notes/b.md"], kw
        la, lb = ({h.record.path: [(x.line, x.text) for x in h.lines] for h in hits}[k] for k in ("notes/a.md", "notes/b.md"))
        assert la == lb and la and la[0][0] == whole.split("\n").index(appended[39].rstrip("\n")) + 1
    ranked = (await api.search(STORE, "head words", order="relevance", max_lines=2)).hits
    assert {h.record.path for h in ranked} >= {"notes/a.md", "notes/b.md"}
    lines = {h.record.path: [(x.line, x.text) for x in h.lines] for h in ranked}
    assert lines["notes/a.md"] == lines["notes/b.md"]
    # the memory-store API's listing with content, the memory tool's view, the index report
    items, _ = fake.service.ms_list_memories(p, STORE, prefix="notes/", depth=0, limit=10, after=None,
                                             with_content=True)
    listed = {it.row.path: it.row.content for it in items if it.row is not None}
    assert listed["notes/a.md"] == listed["notes/b.md"] == whole
    last = whole.count("\n")
    view, view_b = [await api.memory_tool("ws", {"command": "view", "path": f"/memories/s/notes/{n}.md",
                                                  "view_range": [last - 3, -1]}) for n in "ab"]
    assert not view.is_error and "needle-39" in view.content
    assert view.content == view_b.content.replace("notes/b.md", "notes/a.md")
    report = await api.index_report(STORE)
    # its only link to notes/a.md is in the tail
    assert "notes/b.md" in report.unindexed and "notes/a.md" not in report.unindexed
    assert report.bytes == len((BASE + "- [tail link](notes/a.md) indexed late\n").encode())
    # the prompt block shows the head of a long index only: read for the audit below
    assert "/mnt/memory/s/MEMORY.md" in await api.context("ws", mounted=False)
    audit.check()


@pytest.mark.timeout(600)
async def test_tail_starts_grows_folds_and_ends_with_every_version_exact(api, fake):
    rec = await api.create_record(STORE, "j.md", BASE, type="project")
    contents = [BASE]
    cur = rec
    # ~140 KiB appended: folds (TAIL_MAX_BYTES), chain whole copies (deltas.CHAIN_MAX) too
    lines = [f"{i:05d} " + LINE * 14 for i in range(130)]
    for i, line in enumerate(lines):
        cur = await api.append_record(STORE, rec.id, line, if_match=cur.sha256, idempotency_key=f"j{i}")
        contents.append(contents[-1] + line)
        tail = _tail(fake, rec.id)
        assert tail is not None  # started at the first append, never ended by one
        base = _base(fake, rec.id)
        # INVARIANT (tails): the base holds the index head and ends with a line end; the tail
        # holds the scan context and stays bounded
        assert len(base) >= fulltext.PG_MAX_CHARS and base.endswith("\n")
        assert tails.SCAN_CONTEXT <= len(tail) and len(tail.encode()) <= tails.TAIL_MAX_BYTES
        assert base + tail == contents[-1]
    assert len(_base(fake, rec.id)) > len(BASE) + 64 * 1024  # folded
    got = await api.get_record(STORE, rec.id)
    assert got.content == contents[-1] and got.size == len(contents[-1].encode())
    import hashlib
    assert got.sha256 == hashlib.sha256(contents[-1].encode()).hexdigest()
    for v in (1, 2, 33, 34, 35, 100, len(contents)):
        assert (await api.version(STORE, rec.id, v)).content == contents[v - 1], v
    # a secret the suffix completes is still found (its context is in the tail)
    from memfuse.errors import ApiError
    half = await api.append_record(STORE, rec.id, "key AKIAZ7VQ3M", if_match=got.sha256, idempotency_key="k1")
    with pytest.raises(ApiError) as err:
        await api.append_record(STORE, rec.id, "XK2PLR8WQT\n", if_match=half.sha256, idempotency_key="k2")
    assert err.value.code == "secret_detected"
    # a large suffix too, scanned before the write lock after the context read then
    # (``prescan.append_verdict``: the tail's end, here)
    from memfuse.server import prescan
    big = "XK2PLR8WQT\n" + LINE * (prescan.PRESCAN_MIN // len(LINE) + 1)
    with pytest.raises(ApiError) as err:
        await api.append_record(STORE, rec.id, big, if_match=half.sha256, idempotency_key="k3")
    assert err.value.code == "secret_detected"
    contents.append(contents[-1] + "key AKIAZ7VQ3M")
    # any other write ends the tail and writes the whole content
    cur = await api.get_record(STORE, rec.id, content=False)
    moved = await api.move_record(STORE, rec.id, "k.md", if_match=cur.sha256)
    assert moved.records[0].path == "k.md"
    assert _tail(fake, rec.id) is None and _base(fake, rec.id) == contents[-1]
    # and the next append starts one again; an update ends it
    cur = await api.get_record(STORE, rec.id, content=False)
    cur = await api.append_record(STORE, rec.id, "again\n", if_match=cur.sha256, idempotency_key="again")
    assert _tail(fake, rec.id) is not None
    await api.update_record(STORE, rec.id, "short\n", if_match=cur.sha256)
    assert _tail(fake, rec.id) is None and (await api.get_record(STORE, rec.id)).content == "short\n"
    assert (await api.version(STORE, rec.id, len(contents) + 1)).content == contents[-1]  # moved
    assert (await api.version(STORE, rec.id, len(contents) + 2)).content == contents[-1] + "again\n"


async def test_the_frontmatter_of_a_base_with_a_tail_still_decides_type_and_dates(api, fake):
    fm = "---\ntype: feedback\nreview_after: 2031-01-02\n---\n"
    rec = await api.create_record(STORE, "fm.md", fm + BASE)
    await _append(api, rec.id, ["one\n", "two\n"])
    with fake.service.db.read_conn() as conn:
        assert conn.scalar(select(_T.c.head).where(_T.c.record_id == rec.id)) == fm.rstrip("\n")
    got = await api.get_record(STORE, rec.id, content=False)
    assert got.type == "feedback" and got.review_after is not None and got.review_after.year == 2031
    # an explicit type does not outlive the next append (the frontmatter wins, as without a tail)
    p = fake.service.authenticate(fake.token_for("ws"))
    r = fake.service.append_record(p, STORE, rec.id, RecordAppend(append="three\n", type="user"),
                                   if_match=got.sha256)
    import json
    assert json.loads(r.body)["type"] == "user"
    await _append(api, rec.id, ["four\n"])
    assert (await api.get_record(STORE, rec.id, content=False)).type == "feedback"
    assert (await api.get_record(STORE, rec.id)).content == fm + BASE + "one\ntwo\nthree\nfour\n"


async def test_a_small_record_never_gets_a_tail_and_its_index_follows(api, fake):
    rec = await api.create_record(STORE, "small.md", "# small okapi\n", type="project")
    # indexed when its seq is given after the insert (records_fts_au_seq on SQLite)
    assert [h.record.path for h in (await api.search(STORE, "okapi", order="relevance")).hits] == ["small.md"]
    await _append(api, rec.id, ["zebrafish appended\n"])
    assert _tail(fake, rec.id) is None
    hits = (await api.search(STORE, "zebrafish", order="relevance")).hits
    assert [h.record.path for h in hits] == ["small.md"]


async def test_an_append_to_a_large_record_writes_the_base_once_per_fold(api, fake):
    """The point of the tails: the large row's content is written at the first append and at
    each fold, not at every append (counted from the statements that set it)."""
    rec = await api.create_record(STORE, "big.md", BASE + LINE * 10_000, type="project")
    writes: list[str] = []

    def before(conn, cursor, statement, parameters, context, executemany):
        flat = " ".join(statement.split())
        if flat.startswith("UPDATE records SET") and "content" in flat.split(" WHERE ")[0]:
            writes.append(flat)

    event.listen(fake.service.db.engine, "before_cursor_execute", before)
    try:
        await _append(api, rec.id, [f"{i} " + LINE for i in range(200)])  # ~17 KiB: no fold
    finally:
        event.remove(fake.service.db.engine, "before_cursor_execute", before)
    assert len(writes) == 1, writes  # the first append (the tail starts)


def test_downgrade_folds_every_tail(tmp_path):
    with fresh_db_url(f"sqlite:///{tmp_path / 'tails.db'}") as url:
        from memfuse.server.app import create_app
        from alembic import command

        app = create_app(url, schema="migrate")
        svc = app.state.service
        svc.create_store(ADMIN, StoreCreate(slug="s"))
        from memfuse.models import StoreUpdate
        svc.update_store(ADMIN, "s", StoreUpdate(max_record_bytes=8 << 20))
        made = svc.create_record(ADMIN, "s", RecordCreate(path="a.md", content=BASE, type="project"))
        import json
        body = json.loads(made.body)
        sha = body["sha256"]
        for i in range(5):
            r = svc.append_record(ADMIN, "s", body["id"], RecordAppend(append=f"tail {i}\n"), if_match=sha)
            sha = json.loads(r.body)["sha256"]
        whole = BASE + "".join(f"tail {i}\n" for i in range(5))
        with svc.db.read_conn() as conn:
            assert conn.scalar(text("SELECT count(*) FROM record_tails")) == 1
        svc.db.dispose()
        db = Database(url)
        with db.write_conn() as conn:
            command.downgrade(schema.alembic_config(connection=conn), "0017_workspace_names")
        with db.read_conn() as conn:
            assert conn.scalar(text("SELECT content FROM records")) == whole
            from sqlalchemy import inspect
            assert "record_tails" not in inspect(conn).get_table_names()
        schema.upgrade(db)
        assert schema.status(db).at_head
        db.dispose()
        app = create_app(url)
        svc = app.state.service
        r = svc.append_record(ADMIN, "s", body["id"], RecordAppend(append="after\n"), if_match=sha)
        assert r.status == 200
        assert svc.get_record(ADMIN, "s", body["id"]).content == whole + "after\n"
        svc.db.dispose()
