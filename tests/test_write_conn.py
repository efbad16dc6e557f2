"""``Database.write_conn`` on an SQLite file: every write transaction on one connection kept
between them (no pool checkout and check-in per write: bench/README.md, "The close path,
session 12: serve's writer"), with the same commit / rollback behaviour as a pooled one, a
broken connection replaced, and the kept one closed by ``dispose``."""
from __future__ import annotations

import pytest
from sqlalchemy import event, text

from memfuse.server.db import Database


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
