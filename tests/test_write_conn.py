"""``Database.write_conn`` on an SQLite file: every write transaction on one connection kept
between them (no pool checkout and check-in per write: bench/README.md, "The close path,
session 12: serve's writer"), with the same commit / rollback behaviour as a pooled one, a
broken connection replaced, and the kept one closed by ``dispose``."""
from __future__ import annotations

import sqlite3

import pytest
from sqlalchemy import column, event, text
from sqlalchemy.exc import IntegrityError, OperationalError

from memfuse.server.db import Database
from memfuse.server.rawsql import Raw


@pytest.fixture
def db(tmp_path):
    d = Database(f"sqlite:///{tmp_path}/cp.db")
    try:
        with d.write_conn() as conn:
            conn.execute(text("CREATE TABLE t (k INTEGER PRIMARY KEY, v TEXT)"))
        yield d
    finally:
        d.dispose()


def _rows(db: Database) -> list[tuple]:
    with db.read_conn() as conn:
        return [tuple(r) for r in conn.execute(text("SELECT k, v FROM t ORDER BY k"))]


def test_writes_share_one_connection_without_pool_checkouts(db):
    checkouts: list[object] = []

    def spy(dbapi, rec, proxy):
        checkouts.append(dbapi)

    event.listen(db.engine, "checkout", spy)
    try:
        seen = set()
        for i in range(5):
            with db.write_conn() as conn:
                conn.execute(text("INSERT INTO t (k, v) VALUES (:k, 'x')"), {"k": i})
                seen.add(id(conn.connection.driver_connection))
    finally:
        event.remove(db.engine, "checkout", spy)
    assert len(seen) == 1
    assert checkouts == []  # the first write of the fixture made it; none since
    assert [k for k, _ in _rows(db)] == [0, 1, 2, 3, 4]  # committed, seen by another connection


def test_a_refused_write_is_rolled_back_and_the_next_one_runs(db):
    with pytest.raises(RuntimeError):
        with db.write_conn() as conn:
            conn.execute(text("INSERT INTO t (k, v) VALUES (1, 'gone')"))
            raise RuntimeError("refused")
    first = db._kept
    with db.write_conn() as conn:
        assert not conn.in_nested_transaction()
        conn.execute(text("INSERT INTO t (k, v) VALUES (2, 'kept')"))
    assert db._kept is first is not None  # a rollback does not cost the connection
    assert _rows(db) == [(2, "kept")]


def test_an_invalidated_connection_is_replaced(db):
    with pytest.raises(RuntimeError):
        with db.write_conn() as conn:
            broken = conn
            conn.invalidate()
            raise RuntimeError("connection lost")
    with db.write_conn() as conn:
        assert conn is not broken
        conn.execute(text("INSERT INTO t (k, v) VALUES (3, 'again')"))
    assert _rows(db) == [(3, "again")]


def test_orm_writes_and_core_writes_alternate(db):
    for i in range(3):
        with db.write_conn() as conn:
            conn.execute(text("INSERT INTO t (k, v) VALUES (:k, 'core')"), {"k": 2 * i})
        with db.write() as s:
            s.execute(text("INSERT INTO t (k, v) VALUES (:k, 'orm')"), {"k": 2 * i + 1})
    assert [v for _, v in _rows(db)] == ["core", "orm"] * 3


def test_dispose_closes_the_kept_connection(tmp_path):
    d = Database(f"sqlite:///{tmp_path}/cp.db")
    with d.write_conn() as conn:
        conn.execute(text("CREATE TABLE t (k INTEGER PRIMARY KEY)"))
    kept = d._kept
    assert kept is not None and not kept.closed
    d.dispose()
    assert d._kept is None and kept.closed


# ---------------------------------------------------------------- the transaction on the driver
# (session 15): BEGIN IMMEDIATE through Raw, the driver's commit / rollback, SQLAlchemy's
# transaction only when a Core statement inside autobegins it

_INSERT = Raw(text("INSERT INTO t (k, v) VALUES (:k, :v)"))


def test_a_write_transaction_runs_on_the_driver_not_through_sqlalchemys(db):
    """No SQLAlchemy ``begin`` / ``commit`` for a transaction of raw statements; the
    ``BEGIN IMMEDIATE`` is still seen by the statement listeners, the rows are committed
    (another connection reads them) and the connection is left outside a transaction."""
    seen: list[str] = []
    events: list[str] = []

    def spy(conn, cursor, statement, parameters, context, executemany):
        seen.append(statement)

    listeners = [("before_cursor_execute", spy)] + [
        (name, (lambda name: lambda *a: events.append(name))(name)) for name in ("begin", "commit", "rollback")]
    for name, fn in listeners:
        event.listen(db.engine, name, fn)
    try:
        with db.write_conn() as conn:
            _INSERT.run(conn, {"k": 1, "v": "a"})
            _INSERT.run(conn, {"k": 2, "v": "b"})
    finally:
        for name, fn in listeners:
            event.remove(db.engine, name, fn)
    assert events == []
    assert seen[0] == "BEGIN IMMEDIATE" and len(seen) == 3
    assert _rows(db) == [(1, "a"), (2, "b")]
    assert not db._kept.connection.dbapi_connection.in_transaction and not db._kept.in_transaction()


@pytest.mark.parametrize("fail", [False, True])
def test_a_core_statement_inside_joins_the_drivers_transaction(db, fail):
    """A Core statement in the block (SQLAlchemy autobegins) runs in the same transaction:
    both committed, or both rolled back by an error; the connection is kept either way."""
    kept = db._kept
    try:
        with db.write_conn() as conn:
            _INSERT.run(conn, {"k": 1, "v": "raw"})
            conn.execute(text("INSERT INTO t (k, v) VALUES (2, 'core')"))
            _INSERT.run(conn, {"k": 3, "v": "raw"})
            if fail:
                raise RuntimeError("refused")
    except RuntimeError:
        assert fail
    assert _rows(db) == ([] if fail else [(1, "raw"), (2, "core"), (3, "raw")])
    assert db._kept is kept and not kept.in_transaction()
    assert not kept.connection.dbapi_connection.in_transaction
    with db.write_conn() as conn:  # and the next one runs
        _INSERT.run(conn, {"k": 9, "v": "next"})
    assert (9, "next") in _rows(db)


@pytest.mark.parametrize("core", [False, True])
def test_a_commit_that_fails_is_rolled_back_and_raised_as_sqlalchemy_raises_it(db, core):
    """A commit the database refuses (a deferred foreign key left dangling) raises
    SQLAlchemy's ``IntegrityError`` (``Writer.write`` retries on it), leaves nothing written
    and the connection usable, on the driver's commit and on SQLAlchemy's (``core``)."""
    with db.write_conn() as conn:
        conn.exec_driver_sql("CREATE TABLE c (k INTEGER PRIMARY KEY, "
                             "t INTEGER REFERENCES t(k) DEFERRABLE INITIALLY DEFERRED)")
    with pytest.raises(IntegrityError):
        with db.write_conn() as conn:
            _INSERT.run(conn, {"k": 1, "v": "gone"})
            if core:
                conn.execute(text("INSERT INTO c (k, t) VALUES (1, 42)"))
            else:
                Raw(text("INSERT INTO c (k, t) VALUES (1, 42)")).run(conn, {})
    assert _rows(db) == []
    assert not db._kept.connection.dbapi_connection.in_transaction
    with db.write_conn() as conn:
        _INSERT.run(conn, {"k": 2, "v": "kept"})
    assert _rows(db) == [(2, "kept")]


def test_a_begin_refused_while_another_writer_holds_the_database_raises_and_keeps_the_connection(db, tmp_path):
    """``BEGIN IMMEDIATE`` refused (another process's writer holds the lock past the busy
    timeout): ``OperationalError``, nothing begun, the next write runs."""
    with db.write_conn() as conn:
        conn.exec_driver_sql("PRAGMA busy_timeout=50")  # the kept connection waits 50 ms
    kept = db._kept
    other = sqlite3.connect(str(tmp_path / "cp.db"), isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        with pytest.raises(OperationalError):
            with db.write_conn() as conn:
                _INSERT.run(conn, {"k": 1, "v": "blocked"})
        other.execute("ROLLBACK")
    finally:
        other.close()
    with db.write_conn() as conn:
        _INSERT.run(conn, {"k": 2, "v": "after"})
    assert db._kept is kept and _rows(db) == [(2, "after")]


def test_raw_statements_of_a_write_transaction_share_one_cursor_closed_at_its_end(db):
    """``rawsql.SharedCursorConnection``: the ``Raw`` statements of one ``write_conn``
    transaction on the kept connection run on one cursor (not a cursor made and closed per
    statement: bench/README.md, "The close path, session 20: serve's writer"), closed before
    the transaction ends; a ``first`` of a result of several rows leaves no read open past
    it (the file checkpoints whole after it), and statements outside such a transaction
    (another connection) still get a cursor each."""
    cursors: list[object] = []

    def spy(conn, cursor, statement, parameters, context, executemany):
        cursors.append(cursor)

    insert, every = Raw(text("INSERT INTO t (k, v) VALUES (:k, :v)")), Raw(text("SELECT k FROM t ORDER BY k").columns(column("k")))
    event.listen(db.engine, "before_cursor_execute", spy)
    try:
        with db.write_conn() as conn:
            for k in range(3):
                insert.run(conn, {"k": k, "v": "x"})
            assert every.first(conn, {})[0] == 0  # two rows left unread
            insert.run(conn, {"k": 9, "v": "y"})
        shared = cursors[1:]  # after BEGIN IMMEDIATE (made before the cursor)
        assert len(shared) == 5 and all(c is shared[0] for c in shared), cursors
        with pytest.raises(sqlite3.ProgrammingError):  # closed with the transaction
            shared[0].execute("SELECT 1")
        cursors.clear()
        with db.read_conn() as conn:
            assert every.first(conn, {})[0] == 0
            assert every.first(conn, {})[0] == 0
        assert len(cursors) == 2 and cursors[0] is not cursors[1]
    finally:
        event.remove(db.engine, "before_cursor_execute", spy)
    with db.write_conn() as conn:  # nothing holds a read of the file: the checkpoint is whole
        pass
    dbapi = db._kept.connection.dbapi_connection
    busy, _, _ = dbapi.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    assert busy == 0
    assert [k for k, _ in _rows(db)] == [0, 1, 2, 9]


def test_the_kept_write_connection_has_its_own_larger_page_cache(db):
    """``WRITER_CACHE_KIB``: the kept write connection's SQLite page cache (a create's random
    index leaves stay cached as the store grows; bench/README.md, "The close path, session 20:
    serve's writer"); the pool's readers keep SQLite's default."""
    from memfuse.server.db import WRITER_CACHE_KIB

    with db.write_conn() as conn:
        assert conn.exec_driver_sql("PRAGMA cache_size").scalar() == -WRITER_CACHE_KIB
    assert WRITER_CACHE_KIB >= 8192
    with db.read_conn() as conn:
        assert conn.exec_driver_sql("PRAGMA cache_size").scalar() == -2000


def test_a_write_transactions_statements_call_the_listeners_of_its_start(db):
    """``SharedCursorConnection.raw_listeners``: the ``Raw`` statements of a ``write_conn``
    transaction call the ``before_cursor_execute`` listeners found at its first statement,
    each of its statements (the /metrics counter counts every one); a listener removed
    meanwhile is not called again (SQLAlchemy's deques are read live), one added to an
    engine with no listener yet is called from the next transaction on."""
    calls: list[str] = []

    def spy(name):
        def fn(conn, cursor, statement, parameters, context, executemany):
            calls.append(name + ":" + statement.split()[0])
        return fn

    a, b = spy("a"), spy("b")
    insert = Raw(text("INSERT INTO t (k, v) VALUES (:k, 'x')"))
    event.listen(db.engine, "before_cursor_execute", a)
    try:
        with db.write_conn() as conn:
            insert.run(conn, {"k": 1})
            insert.run(conn, {"k": 2})
            event.remove(db.engine, "before_cursor_execute", a)
            insert.run(conn, {"k": 3})
        assert calls == ["a:BEGIN", "a:INSERT", "a:INSERT"]
        calls.clear()
        event.listen(db.engine, "before_cursor_execute", b)
        with db.write_conn() as conn:
            insert.run(conn, {"k": 4})
        assert calls == ["b:BEGIN", "b:INSERT"]
    finally:
        for fn in (a, b):
            if event.contains(db.engine, "before_cursor_execute", fn):
                event.remove(db.engine, "before_cursor_execute", fn)
    assert [k for k, _ in _rows(db)] == [1, 2, 3, 4]
