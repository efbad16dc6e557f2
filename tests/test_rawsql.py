"""``memfuse.server.rawsql``: the record writes' statements run on the DB-API cursor give what
SQLAlchemy Core gives (rows, stored values, errors, listeners), on SQLite and, with
``MEMFUSE_TEST_DB_URL`` (``tests/test_postgres.py``), on PostgreSQL; and a create costs the
statements bench/README.md counts ("The close path, session 10: serve")."""
from __future__ import annotations

import json

import httpx
import pytest
from sqlalchemy import bindparam, event, exc, false, func, insert, select

from memfuse.server.app import create_app
from memfuse.server.base import _I, _R, _S, _V, _RAW_INSERT_IDEM, _RAW_SELECT_IDEM, _SELECT_IDEM
from memfuse.server.db import StoreRow, utcnow
from memfuse.server.rawsql import Raw, RawIn
from memfuse.server.recordrows import (
    _RAW_INSERT_VERSION,
    _RAW_SELECT_LIVE_AT_PATHS,
    _RAW_SELECT_LIVE_UNDER,
    _RAW_SELECT_RECORD,
    _SELECT_LIVE_UNDER,
    _SELECT_RECORD,
    next_seq_sql,
)
from pgutil import fresh_db_url
from planeutil import attach_ws

ADMIN, WS = "raw-admin", "raw-ws"


@pytest.fixture
async def env():
    with fresh_db_url() as url:
        app = create_app(url, static_tokens={ADMIN: None, WS: "ws"})
        t = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=t, base_url="http://t", headers={"Authorization": f"Bearer {ADMIN}"}) as a, \
                httpx.AsyncClient(transport=t, base_url="http://t",
                                  headers={"Authorization": f"Bearer {WS}", "X-Memfuse-Instance": "me"}) as me:
            await attach_ws(a, (("s", "read_write"),))
            yield app, me
        app.state.service.db.dispose()


async def _create(me: httpx.AsyncClient, path: str, **headers: str) -> dict:
    r = await me.post("/v1/stores/s/records", json={"path": path, "content": "x\n"}, headers=headers)
    assert r.status_code == 201, r.text
    return r.json()


async def test_rows_read_raw_are_the_rows_core_reads(env):
    app, me = env
    rec = await _create(me, "a/b.md")
    db = app.state.service.db
    with db.write_conn() as conn:
        core = conn.execute(_SELECT_RECORD, {"rid": rec["id"]}).first()
        raw = _RAW_SELECT_RECORD.first(conn, {"rid": rec["id"]})
        assert raw is not None and core is not None
        assert raw._mapping == core._mapping  # every column, times (aware UTC) and booleans alike
        assert tuple(raw) == tuple(core)
        assert raw.created_at == core.created_at and raw.created_at.tzinfo is not None
        assert raw.deleted is False or raw.deleted == 0
        assert getattr(raw, "no_such_column", "absent") == "absent"
        # a statement with its own bound values (LIMIT 1): the live record under "a/"
        params = {"store": core.store, "lo": "a/", "hi": "a0"}
        pg = db.engine.dialect.name == "postgresql"
        assert _RAW_SELECT_LIVE_UNDER[pg].scalar(conn, params) == "a/b.md"
        assert conn.execute(_SELECT_LIVE_UNDER, params).scalar() == "a/b.md"
        assert _RAW_SELECT_LIVE_UNDER[pg].first(conn, {**params, "lo": "b/", "hi": "b0"}) is None
        # an IN list of any length, as Core's expanding parameter
        for paths in (["a/b.md"], ["a", "a/b.md", "zz"], ["zz"]):
            raw_hits = sorted(tuple(r) for r in _RAW_SELECT_LIVE_AT_PATHS.all(conn, {"store": core.store, "paths": paths}))
            core_hits = sorted(tuple(r) for r in conn.execute(
                select(_R.c.path, _R.c.id).where(_R.c.store == core.store, _R.c.deleted == false(),
                                                 _R.c.path.in_(bindparam("p", expanding=True))), {"p": paths}))
            assert raw_hits == core_hits
        conn.rollback()


async def test_values_written_raw_read_back_through_core(env):
    app, me = env
    rec = await _create(me, "v.md")
    db = app.state.service.db
    now = utcnow()
    with db.write_conn() as conn:
        store = conn.execute(select(_R.c.store).where(_R.c.id == rec["id"])).scalar_one()
        seq = _RAW_INSERT_VERSION.scalar(conn, {
            "record_id": rec["id"], "store": store, "version": 2, "operation": "modified", "path": "v.md",
            "old_path": None, "type": "project", "sha256": "0" * 64, "size": 3, "content": "yé\n",
            "created_at": now, "actor": "ws:ws/me", "redacted": True, "mode": 0o600, "mtime_ns": 5,
            "base_version": None, "chain": 0})
        assert isinstance(seq, int) and seq > rec["seq"]
        v = conn.execute(select(_V).where(_V.c.seq == seq)).one()
        assert (v.created_at, v.redacted, v.pruned, v.content, v.mode) == (now, True, False, "yé\n", 0o600)
        # the stored text of the time is Core's own (SQLite keeps times as text)
        raw_text = conn.exec_driver_sql(f"SELECT created_at FROM versions WHERE seq = {int(seq)}").scalar()
        conn.execute(insert(_V), {**{k: v._mapping[k] for k in v._mapping if k != "seq"}, "version": 3})
        core_text = conn.exec_driver_sql("SELECT created_at FROM versions WHERE version = 3").scalar()
        assert raw_text == core_text
        conn.rollback()


async def test_none_is_bound_as_null_without_the_sqlite3_adaptation_search(env):
    """``None`` parameters (~10 a create) are bound by the ``sqlite3`` module through its
    adapter registry: with ``memfuse.sqlitebind``'s ``NoneType`` adapter the search ends at
    its first lookup (on main: the ``__adapt__`` / ``__conform__`` lookups, ~2.6 k
    instructions each). The value stored is ``NULL`` as before, through Raw and Core."""
    import sqlite3

    adapter = sqlite3.adapters.get((type(None), sqlite3.PrepareProtocol))
    assert adapter is not None and adapter(None) is None
    app, me = env
    rec = await _create(me, "n.md")
    db = app.state.service.db
    with db.write_conn() as conn:
        store = conn.execute(select(_R.c.store).where(_R.c.id == rec["id"])).scalar_one()
        seq = _RAW_INSERT_VERSION.scalar(conn, {
            "record_id": rec["id"], "store": store, "version": 2, "operation": "modified", "path": "n.md",
            "old_path": None, "type": None, "sha256": "0" * 64, "size": 3, "content": "n\n",
            "created_at": utcnow(), "actor": "ws:ws/me", "redacted": False, "mode": None, "mtime_ns": None,
            "base_version": None, "chain": 0})
        v = conn.execute(select(_V).where(_V.c.seq == seq)).one()
        assert (v.old_path, v.type, v.mode, v.mtime_ns, v.base_version) == (None, None, None, None, None)
        found = conn.exec_driver_sql(
            "SELECT count(*) FROM versions WHERE old_path IS NULL AND type IS NULL AND mode IS NULL "
            f"AND mtime_ns IS NULL AND base_version IS NULL AND seq = {int(seq)}").scalar()
        assert found == 1
        if db.is_sqlite:  # stored as SQLite's NULL, not as a text or blob that reads back None
            kinds = conn.exec_driver_sql(
                f"SELECT typeof(old_path), typeof(type), typeof(mode) FROM versions WHERE seq = {int(seq)}").one()
            assert tuple(kinds) == ("null", "null", "null")
        conn.rollback()
    # a caller's own NoneType adapter is kept (registered before ours is asked again)
    from memfuse import sqlitebind

    sqlitebind.bind_none_directly()
    assert sqlite3.adapters[(type(None), sqlite3.PrepareProtocol)] is adapter


async def test_a_conflict_is_sqlalchemys_integrity_error_and_listeners_see_each_statement(env):
    app, me = env
    await _create(me, "k.md", **{"Idempotency-Key": "k1"})
    db = app.state.service.db
    seen: list[str] = []

    def spy(conn, cursor, statement, parameters, context, executemany):
        seen.append(statement)

    event.listen(db.engine, "before_cursor_execute", spy)
    try:
        with db.write_conn() as conn:
            row = _RAW_SELECT_IDEM.first(conn, {"scope": "ws:ws", "key": "k1"})
            core = conn.execute(_SELECT_IDEM, {"scope": "ws:ws", "key": "k1"}).first()
            assert row is not None and row._mapping == core._mapping
            with pytest.raises(exc.IntegrityError):  # Writer.write retries on exactly this class
                _RAW_INSERT_IDEM.run(conn, {k: getattr(row, k) for k in (
                    "method", "url_path", "request_hash", "status", "response_body", "response_headers",
                    "created_at")} | {"scope": "ws:ws", "key": "k1"})
            conn.rollback()
    finally:
        event.remove(db.engine, "before_cursor_execute", spy)
    begin = ["BEGIN"] if db.is_sqlite else []  # SQLite's BEGIN IMMEDIATE is a statement of ours
    assert [s.split()[0] for s in seen] == [*begin, "SELECT", "SELECT", "INSERT"]
    assert seen[len(begin)] == _RAW_SELECT_IDEM._compiled(db.engine.dialect, {"scope": 0, "key": 0}).sql


def test_what_raw_cannot_run_is_refused_at_its_first_compile():
    from sqlalchemy.dialects import sqlite

    with pytest.raises(TypeError, match="expanding"):
        Raw(select(_R.c.id).where(_R.c.path.in_(bindparam("p", expanding=True))))._compiled(sqlite.dialect(), {"p": 0})
    with pytest.raises(TypeError, match="default"):  # stores.created_at defaults to utcnow(), a callable
        Raw(insert(StoreRow.__table__))._compiled(sqlite.dialect(), {"slug": 0})
    with pytest.raises(exc.ArgumentError, match="alt"):  # a parameter not given: refused, as Core does
        c = Raw(select(_S.c.slug).where(_S.c.slug.in_([bindparam("slug"), bindparam("alt")])))._compiled(
            sqlite.dialect(), {"slug": 0})
        c.parameters({"slug": "x"})
    assert RawIn("p", lambda n: select(_I.c.id).where(_I.c.key.in_([bindparam(f"p{i}") for i in range(n)])))
    assert _S is not None


async def test_a_create_costs_six_statements_and_begin(env):
    """The store row with the idempotency key's lookup (``IDEM_PROBE``; its own statement
    before session 18), the live records at the path and its
    ancestors with the ``path/`` range (one statement since session 17), the record's insert
    with its version's seq (``next_seq_sql``; no statement of its own since session 18), the
    version's insert, the usage and history counters, the idempotency row (bench/README.md);
    on SQLite our ``BEGIN IMMEDIATE``, on PostgreSQL the commit bus's ``pg_notify`` (its
    BEGIN is the driver's, not counted)."""
    app, me = env
    await _create(me, "warm.md", **{"Idempotency-Key": "w"})
    counter = app.state.metrics.db_statements
    before = counter.value()
    await _create(me, "d/one.md", **{"Idempotency-Key": "one"})
    assert counter.value() - before == 6 + 1


async def test_a_new_records_seq_is_its_first_versions_and_the_feed_stays_ascending(env):
    """A record created alone, in a batch (deferred and not) and after the latest versions
    are gone (a purge of the newest record) has its first version's seq, each new one past
    every seq ever given (SQLite: ``sqlite_sequence`` follows), and is found by ranked search
    (indexed through the queue, as when its seq came by a second statement)."""
    app, me = env
    db = app.state.service.db
    seqs = [(await _create(me, "one.md"))["seq"]]
    ops = [{"op": "create", "body": {"path": f"b/{i}.md", "content": f"batch word{i}\n"}} for i in range(3)]
    r = await me.post("/v1/stores/s/batch", json={"operations": ops})
    assert r.status_code == 200, r.text
    top = await _create(me, "top.md")
    seqs.append(top["seq"])
    # the newest record and its versions gone: a seq is still never given twice
    r = await me.delete(f"/v1/stores/s/records/{top['id']}")
    assert r.status_code in (200, 204), r.text
    with db.write_conn() as conn:
        gone = conn.execute(select(func.max(_V.c.seq))).scalar_one()
        conn.execute(_V.delete().where(_V.c.record_id == top["id"]))
        conn.execute(_R.delete().where(_R.c.id == top["id"]))
    after = await _create(me, "after.md", **{"Idempotency-Key": "after"})
    assert after["seq"] > gone
    seqs.append(after["seq"])
    with db.read_conn() as conn:
        rows = conn.execute(select(_R.c.id, _R.c.path, _R.c.seq, _V.c.seq.label("vseq")).join(
            _V, (_V.c.record_id == _R.c.id) & (_V.c.version == 1))).all()
        assert rows and all(row.seq == row.vseq for row in rows), rows
        if db.is_sqlite:
            ever = conn.exec_driver_sql("SELECT seq FROM sqlite_sequence WHERE name = 'versions'").scalar()
            assert ever == conn.execute(select(func.max(_V.c.seq))).scalar_one() == after["seq"]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    for q, want in (("word1", ["b/1.md"]), ("after", ["after.md"])):
        r = await me.get("/v1/stores/s/search", params={"q": q, "order": "relevance"})
        assert r.status_code == 200, r.text
        assert [h["record"]["path"] for h in r.json()["hits"]] == want


def test_the_next_seq_is_the_one_sqlites_autoincrement_gives():
    """``next_seq_sql`` (SQLite) against SQLite's own choice, in random states of a table
    like ``versions``: inserts with and without a seq (above and below the top), deletes
    (the top row too), ``sqlite_sequence`` moved up, down or gone."""
    import random
    import sqlite3

    rng = random.Random(18)
    conn = sqlite3.connect(":memory:", isolation_level=None)
    conn.execute("CREATE TABLE versions (seq INTEGER PRIMARY KEY AUTOINCREMENT, x INTEGER)")
    expr = next_seq_sql(False)
    checked = 0
    for _ in range(3000):
        top = conn.execute("SELECT max(seq) FROM versions").fetchone()[0] or 0
        op = rng.randrange(7)
        if op == 0:
            conn.execute("INSERT INTO versions (x) VALUES (1)")
        elif op == 1 and top:
            seq = rng.randrange(1, top + 20)
            conn.execute("INSERT OR IGNORE INTO versions (seq, x) VALUES (?, 2)", (seq,))
        elif op == 2 and top:
            conn.execute("DELETE FROM versions WHERE seq >= ?", (rng.randrange(1, top + 1),))
        elif op == 3:
            conn.execute("UPDATE sqlite_sequence SET seq = ? WHERE name = 'versions'", (rng.randrange(0, top + 10),))
        elif op == 4:
            conn.execute("DELETE FROM sqlite_sequence WHERE name = 'versions'")
        want_row = conn.execute(f"SELECT {expr}").fetchone()
        conn.execute("SAVEPOINT probe")
        conn.execute("INSERT INTO versions (x) VALUES (3)")
        got = conn.execute("SELECT last_insert_rowid()").fetchone()[0]
        conn.execute("ROLLBACK TO probe")
        conn.execute("RELEASE probe")
        assert want_row[0] == got
        checked += 1
    assert checked == 3000


async def test_reads_of_live_records_at_paths_look_each_path_up_on_sqlite(env):
    """Every ``path IN (...)`` read of the live records (a create's path and its ancestors, a
    batch's creates, a move's target's ancestors) looks the paths up on a path index: SQLite's
    planner, without statistics, took ``ix_records_usage`` (``store = ? AND deleted = ?``) for
    three or more paths and read every live record of the store per create
    (``base.LIVE_PATHS_ORDER``; bench/README.md, "The close path, session 12: serve's writer")."""
    app, me = env
    db = app.state.service.db
    seen: list[tuple[str, object]] = []

    arms: list[tuple[str, object]] = []  # the create's read (``recordrows._live_at_or_under``)

    def spy(conn, cursor, statement, parameters, context, executemany):
        if ".path IN (" in statement and "FROM records" in statement:
            seen.append((statement, parameters))
        elif "UNION ALL" in statement and "FROM records" in statement and "under_" in statement:
            arms.append((statement, parameters))

    event.listen(db.engine, "before_cursor_execute", spy)
    try:
        await _create(me, "a/b/c/d.md")
        moved = await _create(me, "m.md")
        r = await me.post(f"/v1/stores/s/records/{moved['id']}/move", json={"path": "x/y/z/m.md"})
        assert r.status_code == 200, r.text
        ops = [{"op": "create", "body": {"path": f"b/{i}/n.md", "content": "x\n"}} for i in range(20)]
        r = await me.post("/v1/stores/s/batch", json={"operations": ops})
        assert r.status_code == 200, r.text
    finally:
        event.remove(db.engine, "before_cursor_execute", spy)
    assert len(seen) >= 2  # the move's, the batch's
    assert len(arms) >= 2  # the creates' (a/b/c/d.md, m.md): one arm per path, no IN list
    # the one rule on both databases (PostgreSQL: a sort of the few rows found) ...
    assert all("ORDER BY records.path" in statement for statement, _ in seen), seen
    if not db.is_sqlite:
        return
    # ... and what it is for on SQLite, whose planner has no statistics
    with db.read_conn() as conn:
        for statement, parameters in seen + arms:
            plan = " ".join(row[3] for row in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, parameters))
            assert "path=?" in plan and "ix_records_usage" not in plan, (statement, plan)
        # a create's read builds no ephemeral table (an IN list's values: ~40 % of the
        # statement's instructions; bench/README.md, "The close path, session 20")
        for statement, parameters in arms:
            ops = [row[1] for row in conn.exec_driver_sql("EXPLAIN " + statement, parameters)]
            assert "OpenEphemeral" not in ops, (statement, ops)


def test_raw_calls_the_listeners_sqlalchemy_would_call_without_its_iteration(monkeypatch):
    """``rawsql.statement_listeners``: every ``before_cursor_execute`` listener SQLAlchemy's own
    iteration would call, in its order, as listeners are added and removed at each level
    (engine, Connection class, one connection, Engine class, an ``execution_options`` engine),
    through a remove then an add (the same number of listeners, another one) and between
    engines in turn; and
    SQLAlchemy's iterators (~10 Python calls a statement) are not used for it."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import Connection, Engine
    from sqlalchemy.event.attr import _CompoundListener, _EmptyListener

    calls: list[str] = []

    def spy(name: str):
        def listener(conn, cursor, statement, parameters, context, executemany):
            calls.append(name)
        return listener

    fns = {n: spy(n) for n in "abcdefx"}
    raw = Raw(text("SELECT 1"))

    def check(conn, want: list[str]) -> None:
        calls.clear()
        for fn in conn.dispatch.before_cursor_execute:  # SQLAlchemy's own iteration and order
            fn(conn, None, "", (), None, False)
        assert calls == want
        calls.clear()

        def no(self):
            raise AssertionError("SQLAlchemy's listener iteration used")

        with monkeypatch.context() as m:
            m.setattr(_CompoundListener, "__iter__", no)
            m.setattr(_EmptyListener, "__iter__", no)
            raw.run(conn, {})
        assert calls == want

    one, two = create_engine("sqlite://"), create_engine("sqlite://")
    added: list[tuple[object, str]] = []

    def listen(target, name: str) -> None:
        event.listen(target, "before_cursor_execute", fns[name])
        added.append((target, name))

    def remove(target, name: str) -> None:
        event.remove(target, "before_cursor_execute", fns[name])
        added.remove((target, name))

    try:
        opt = one.execution_options(memfuse_write=True)  # as db.write_conn's engine
        with one.connect() as c1, two.connect() as c2, opt.connect() as c3:
            check(c1, [])
            listen(one, "a")
            check(c1, ["a"])
            listen(two, "x")
            check(c2, ["x"])
            check(c1, ["a"])
            listen(Connection, "b")
            check(c1, ["b", "a"])
            listen(c1, "c")
            check(c1, ["b", "c", "a"])
            check(c2, ["b", "x"])
            check(c1, ["b", "c", "a"])  # the same connection just before: no other pair between
            remove(one, "a")
            listen(one, "d")  # as many listeners as before, another one
            check(c1, ["b", "c", "d"])
            check(c3, ["b", "d"])
            listen(opt, "f")
            check(c3, ["b", "f", "d"])
            check(c1, ["b", "c", "d"])
            listen(Engine, "e")
            check(c1, ["b", "c", "e", "d"])
            check(c2, ["b", "e", "x"])
            check(c3, ["b", "f", "e", "d"])
            for target, name in list(added):
                remove(target, name)
            check(c1, [])
            check(c2, [])
            check(c3, [])
    finally:
        for target, name in added:
            event.remove(target, "before_cursor_execute", fns[name])
        one.dispose()
        two.dispose()


def test_raw_on_a_closed_connection_is_refused_as_core_refuses_it():
    from sqlalchemy import create_engine, text

    engine = create_engine("sqlite://")
    try:
        conn = engine.connect()
        Raw(text("SELECT 1")).run(conn, {})
        conn.close()
        with pytest.raises(exc.ResourceClosedError):
            conn.execute(text("SELECT 1"))
        with pytest.raises(exc.ResourceClosedError):
            Raw(text("SELECT 1")).run(conn, {})
    finally:
        engine.dispose()


async def test_a_key_looked_up_with_the_store_row_answers_as_the_lookup_first(env):
    """``Writer.write(store_first=True)``: a workspace token's keyed write looks its key up in
    the store row's statement (``IDEM_PROBE``). Every answer is the one of the lookup first:
    a replay (byte for byte), 422 for the key with another body, a replay when the store is
    read-only or detached since (the store read refuses, the key's stored answer wins), a
    key whose row expired is a new write, a write without a key is not looked up, and a
    ``fn`` that never reads the store still replays (its writes undone)."""
    from datetime import timedelta

    from memfuse.server.base import IdempotencyRequest, Principal

    app, me = env
    db = app.state.service.db
    t = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=t, base_url="http://t", headers={"Authorization": f"Bearer {ADMIN}"}) as a:
        body = {"path": "k.md", "content": "x\n"}
        first = await me.post("/v1/stores/s/records", json=body, headers={"Idempotency-Key": "k"})
        assert first.status_code == 201, first.text
        again = await me.post("/v1/stores/s/records", json=body, headers={"Idempotency-Key": "k"})
        assert (again.status_code, again.content, again.headers["idempotent-replayed"]) == (201, first.content, "true")
        other = await me.post("/v1/stores/s/records", json={**body, "path": "o.md"}, headers={"Idempotency-Key": "k"})
        assert (other.status_code, other.json()["code"]) == (422, "idempotency_key_reused")
        # the row expired: deleted, the write made anew
        with db.write_conn() as conn:
            conn.execute(_I.update().where(_I.c.key == "k").values(created_at=utcnow() - timedelta(days=2)))
        fresh = await me.post("/v1/stores/s/records", json={**body, "path": "k2.md"}, headers={"Idempotency-Key": "k"})
        assert fresh.status_code == 201 and "idempotent-replayed" not in fresh.headers, fresh.text
        # read-only, then detached: the stored answer still, a new key refused
        ro = await me.post("/v1/stores/s/records", json={**body, "path": "r.md"}, headers={"Idempotency-Key": "r"})
        assert ro.status_code == 201
        assert (await a.put("/v1/workspaces/ws/attachments/s", json={"access": "read_only"})).status_code == 200
        r = await me.post("/v1/stores/s/records", json={**body, "path": "r.md"}, headers={"Idempotency-Key": "r"})
        assert (r.status_code, r.content, r.headers.get("idempotent-replayed")) == (201, ro.content, "true")
        r = await me.post("/v1/stores/s/records", json={**body, "path": "n.md"}, headers={"Idempotency-Key": "n"})
        assert (r.status_code, r.json()["code"]) == (403, "read_only")
        assert (await a.delete("/v1/workspaces/ws/attachments/s")).status_code in (200, 204)
        r = await me.post("/v1/stores/s/records", json={**body, "path": "r.md"}, headers={"Idempotency-Key": "r"})
        assert (r.status_code, r.content, r.headers.get("idempotent-replayed")) == (201, ro.content, "true")
        r = await me.post("/v1/stores/s/records", json={**body, "path": "r.md"}, headers={"Idempotency-Key": "r2"})
        assert (r.status_code, r.json()["code"]) == (404, "store_not_attached")
    # a ``fn`` that does not read the store first: the key found after it, its writes undone
    writer = app.state.service.records.writer
    p = Principal(workspace="ws", instance="me")
    idem = IdempotencyRequest("k", "POST", "/v1/stores/s/records", "h", "h")
    calls: list[int] = []

    def fn(conn):
        calls.append(1)
        conn.execute(_I.insert().values(scope="elsewhere", key="undone", method="POST", url_path="/", request_hash="h",
                                        status=201, response_body="", response_headers="{}", created_at=utcnow()))
        return None

    with pytest.raises(Exception) as err:  # noqa: PT011 - the stored row is of another request: 422
        writer.write(p, idem, 201, fn, feed="s", store_first=True)
    assert getattr(err.value, "code", None) == "idempotency_key_reused"
    assert calls == [1]
    with db.read_conn() as conn:
        assert conn.execute(select(_I.c.id).where(_I.c.key == "undone")).first() is None


def test_a_new_record_id_is_a_random_uuid4_as_str_uuid4_writes_it():
    """``recordrows.new_record_id`` (a create's id without ``uuid.UUID``'s constructor): the
    text ``str(uuid.uuid4())`` gives, version 4, variant RFC 4122, all other bits random."""
    import uuid

    from memfuse.server.recordrows import new_record_id

    ids = [new_record_id() for _ in range(4000)]
    assert len(set(ids)) == len(ids)
    for s in ids:
        u = uuid.UUID(s)
        assert str(u) == s and u.version == 4 and u.variant == uuid.RFC_4122
    # every bit but the version's four and the variant's two takes both values
    ones = zero = 0
    for s in ids:
        n = uuid.UUID(s).int
        ones |= n
        zero |= ~n
    fixed = (0xF << 76) | (0x3 << 62)
    mask = (1 << 128) - 1
    assert ones & ~fixed & mask == ~fixed & mask and zero & ~fixed & mask == ~fixed & mask


def test_info_of_is_the_connections_info(tmp_path):
    """``db.info_of(conn)`` is ``conn.info`` (the same dict), on the kept write connection, a
    pooled one, and an invalidated one (which revalidates, as ``conn.info`` does)."""
    from memfuse.server.db import Database, info_of

    db = Database(f"sqlite:///{tmp_path}/cp.db")
    try:
        with db.write_conn() as conn:
            assert info_of(conn) is conn.info
            info_of(conn)["probe"] = 1
        with db.write_conn() as conn:
            assert conn.info["probe"] == 1
        with db.read_conn() as conn:
            assert info_of(conn) is conn.info
        with db.engine.connect() as conn:
            conn.invalidate()
            assert info_of(conn) is conn.info
    finally:
        db.dispose()


def test_a_record_writes_store_row_has_the_columns_the_record_writes_read():
    """``base.RECORD_WRITE_COLUMNS``: the store row a record write reads with its idempotency
    key (``_RAW_ATTACHED_STORE_PROBE``) has those columns, the attachment's access, the
    account's quota and the key's row, and no others (the driver describes and converts each);
    and every column of the store row that ``records.py`` and ``recordrows.py`` read from a
    store row (``st.<column>``, ``store.<column>``) is among them."""
    import re
    from pathlib import Path

    from memfuse.server import base
    from memfuse.server.db import StoreRow

    stmt = base._RAW_ATTACHED_STORE_PROBE.stmt
    assert [c.name for c in stmt.selected_columns] == [*base.RECORD_WRITE_COLUMNS, "access",
                                                        "account_max_bytes", "idem_id"]
    columns = set(StoreRow.__table__.c.keys())
    src = Path(base.__file__).parent
    read: set[str] = set()
    for name in ("records.py", "recordrows.py"):
        text_ = (src / name).read_text()
        read |= set(re.findall(r"\bst\.([a-z_]+)", text_)) | set(re.findall(r"\bstore\.([a-z_]+)", text_))
        read |= set(re.findall(r"getattr\(st, \"([a-z_]+)\"", text_))
    assert read & columns <= set(base.RECORD_WRITE_COLUMNS), read & columns - set(base.RECORD_WRITE_COLUMNS)
    assert {"slug", "max_record_bytes", "default_type", "usage_bytes"} <= read  # the scan finds reads


def test_a_versions_insert_on_sqlite_takes_its_seq_without_returning(tmp_path):
    """A record write's version (update, append, delete) on SQLite takes its seq as the
    driver's ``lastrowid`` (``Raw.inserted_rowid``: ``versions.seq`` is the rowid), not by
    ``RETURNING`` (an ephemeral table a statement; bench/README.md, "The close path, session
    20"): the seq each answer and the change feed carry is the version's own."""
    from memfuse.models import RecordCreate, RecordUpdate, WorkspaceCreate
    from memfuse.server.base import Principal
    from memfuse.server.db import Database
    from memfuse.server.service import Service

    db = Database(f"sqlite:///{tmp_path}/cp.db")
    seen: list[str] = []

    def spy(conn, cursor, statement, parameters, context, executemany):
        if statement.startswith("INSERT INTO versions"):
            seen.append(statement)

    try:
        svc = Service(db)
        svc.create_workspace(Principal(workspace=None, name="t"), WorkspaceCreate(name="ws"))
        p = Principal(workspace="ws", instance="t")
        event.listen(db.engine, "before_cursor_execute", spy)
        made = json.loads(svc.create_record(p, "ws", RecordCreate(path="a.md", content="x\n")).body)
        other = json.loads(svc.create_record(p, "ws", RecordCreate(path="b.md", content="y\n")).body)
        seqs = [made["seq"], other["seq"]]
        for i in range(3):
            r = svc.update_record(p, "ws", made["id"], RecordUpdate(content=f"v{i}\n"))
            seqs.append(json.loads(r.body)["seq"])
        r = svc.delete_record(p, "ws", other["id"])
        seqs.append(int(r.headers["Memfuse-Seq"]))
        with db.read_conn() as conn:
            stored = [row[0] for row in conn.exec_driver_sql("SELECT seq FROM versions ORDER BY seq")]
        assert seqs == stored and seqs == sorted(set(seqs)), (seqs, stored)
        assert len(seen) == 6 and not any("RETURNING" in s for s in seen), seen
    finally:
        event.remove(db.engine, "before_cursor_execute", spy)
        db.dispose()
