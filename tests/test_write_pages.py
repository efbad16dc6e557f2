"""What one record create writes to SQLite's write-ahead log (issue 25 item 2; bench/README.md,
"The close path, session 21: serve's WAL pages"): one page of each b-tree it changes, so the
b-trees a create changes are its log's size. Revision ``0022_drop_records_usage`` took
``ix_records_usage`` out of them (no statement needs it: the statements that read it search
another index), ``0023_fts_queue_ids`` the full-text keys (``records_fts_keys`` and its index
of record ids: a create queues the record's id, the drain gives the key)."""
from __future__ import annotations

import sqlite3
import struct
import uuid
from pathlib import Path

from alembic import command
from sqlalchemy import event, text

from memfuse.models import RecordCreate, StoreCreate
from memfuse.server import schema
from memfuse.server.base import IdempotencyRequest
from memfuse.server.db import Database
from memfuse.server.recordrows import _usage
from memfuse.server.service import Principal, Service

ADMIN = Principal(workspace=None, name="test")

#: the b-trees a create with an ``Idempotency-Key`` changes (besides page 1, ``sqlite_schema``,
#: whose header SQLite writes when the file grows): the record row and four indexes of it, the
#: version and two, the versions' ``AUTOINCREMENT`` row, the key's row and two, the store row
#: (its usage counters), the full-text queue
CREATE_BTREES = {
    "records", "sqlite_autoindex_records_1", "ix_records_live_path", "ix_records_store_path", "ix_records_fts_hit",
    "versions", "sqlite_autoindex_versions_1", "ix_versions_store_seq", "sqlite_sequence",
    "idempotency_keys", "sqlite_autoindex_idempotency_keys_1", "ix_idempotency_keys_created_at",
    "stores", "records_fts_pending",
}


def _service(path: Path) -> Service:
    svc = Service(Database(f"sqlite:///{path}"))
    svc.create_store(ADMIN, StoreCreate(slug="s"))
    return svc


def _create(svc: Service, path: str, content: str = "# Note\nsome words\n") -> str:
    idem = IdempotencyRequest(str(uuid.uuid4()), "POST", "/v1/stores/s/records", "a" * 64, "b" * 64)
    r = svc.create_record(ADMIN, "s", RecordCreate(path=path, content=content), idem)
    assert r.status == 201, r.body
    return r.body.decode().split('"id":"', 1)[1].split('"', 1)[0]


def _log_btrees(db_file: Path) -> set[str]:
    """The names of the b-trees whose pages are in the write-ahead log (``dbstat``)."""
    wal = (db_file.parent / (db_file.name + "-wal")).read_bytes()
    size = struct.unpack(">I", wal[8:12])[0]
    pages = {struct.unpack(">I", wal[o:o + 4])[0] for o in range(32, len(wal) - size - 23, size + 24)}
    conn = sqlite3.connect(db_file)
    try:
        names = dict(conn.execute("SELECT pageno, name FROM dbstat"))
    finally:
        conn.close()
    return {names[p] for p in pages if p in names} - {"sqlite_schema"}


def test_a_create_changes_these_btrees_and_no_other(tmp_path):
    """A create alone in the log (after a ``TRUNCATE`` checkpoint) wrote pages of exactly
    ``CREATE_BTREES``: not ``ix_records_usage`` (0022), nor ``records_fts_keys`` and its index
    (0023). Main wrote 17 b-trees, this 14."""
    svc = _service(tmp_path / "a.db")
    for i in range(40):
        _create(svc, f"d{i % 4}/{i}.md")
    with svc.db.write_conn():
        pass
    kept = svc.db._kept  # noqa: SLF001 - a checkpoint cannot run inside a transaction
    assert kept is not None
    busy, _, _ = kept.connection.dbapi_connection.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    assert busy == 0
    _create(svc, "d1/new.md")
    assert _log_btrees(tmp_path / "a.db") == CREATE_BTREES
    svc.db.dispose()


def test_the_statements_that_read_the_dropped_index_search_another(tmp_path):
    """Every statement that took ``ix_records_usage`` on main (the index report's live paths
    and stale records, the usage count of the tests, a store's delete, a create's path read)
    searches the records by another index now, none scans the table."""
    svc = _service(tmp_path / "a.db")
    for i in range(30):
        _create(svc, f"d{i % 3}/e{i % 2}/{i}.md")
    seen: list[str] = []

    def listen(_conn, _cursor, statement, _params, _context, _many):  # noqa: ANN001
        if "records" in statement:
            seen.append(statement)

    event.listen(svc.db.engine, "before_cursor_execute", listen)
    try:
        svc.index_report(ADMIN, "s")
        _create(svc, "d0/e1/a/b/new.md")
        with svc.db.read_conn() as conn:
            assert _usage(conn, ["s"])["s"][0] == 31
    finally:
        event.remove(svc.db.engine, "before_cursor_execute", listen)
    statements = {s for s in seen if s.lstrip().upper().startswith("SELECT")}
    assert len(statements) >= 4
    with svc.db.read_conn() as conn:
        dbapi = conn.connection.dbapi_connection
        for s in statements:
            n = s.count("?")
            plan = [r[3] for r in dbapi.execute("EXPLAIN QUERY PLAN " + s, [None] * n).fetchall()]
            assert not any(line == "SCAN records" or line.startswith("SCAN records ") for line in plan), (s, plan)
            assert "ix_records_usage" not in " ".join(plan)
    svc.db.dispose()


def _keys_and_queue(svc: Service) -> tuple[set[str], set[str], set[str]]:
    """(records with a full-text key, ids in the queue, records in the FTS table)."""
    with svc.db.read_conn() as conn:
        keyed = set(conn.execute(text("SELECT record_id FROM records_fts_keys")).scalars())
        queued = set(conn.execute(text("SELECT record_id FROM records_fts_pending")).scalars())
        indexed = set(conn.execute(text(
            "SELECT k.record_id FROM records_fts f JOIN records_fts_keys k ON k.k = -f.rowid")).scalars())
    return keyed, queued, indexed


def test_a_new_record_gets_its_full_text_key_at_the_drain(tmp_path):
    """A create queues the record's id (0023); the drain gives it its key and indexes it."""
    svc = _service(tmp_path / "a.db")
    rid = _create(svc, "notes/alpha.md", "# Quasar\nwords\n")
    assert _keys_and_queue(svc) == (set(), {rid}, set())
    svc.db.index_pending()
    assert _keys_and_queue(svc) == ({rid}, set(), {rid})
    assert [h.record.path for h in svc.search(ADMIN, "s", "quasar", order="relevance").hits] == ["notes/alpha.md"]
    svc.db.dispose()


def test_the_queue_survives_the_revision_both_ways(tmp_path):
    """Records queued in one form of the queue are indexed when the revision changes its form:
    upgrade (0020's queue of keys) and downgrade (0023's queue of ids) drain it first."""
    svc = _service(tmp_path / "a.db")
    with svc.db.write_conn() as conn:
        command.downgrade(schema.alembic_config(connection=conn), "0022_drop_records_usage")
    old = _create(svc, "notes/old.md", "zircon old\n")
    with svc.db.read_conn() as conn:  # 0020's form: the key given, the key queued
        assert conn.execute(text("SELECT count(*) FROM records_fts_pending")).scalar() == 1
        assert conn.execute(text("SELECT record_id FROM records_fts_keys")).scalars().all() == [old]
    schema.upgrade(svc.db)
    assert _keys_and_queue(svc) == ({old}, set(), {old})
    new = _create(svc, "notes/new.md", "zircon new\n")
    assert _keys_and_queue(svc) == ({old}, {new}, {old})
    with svc.db.write_conn() as conn:
        command.downgrade(schema.alembic_config(connection=conn), "0022_drop_records_usage")
    with svc.db.read_conn() as conn:
        assert conn.execute(text("SELECT count(*) FROM records_fts_pending")).scalar() == 0
        assert set(conn.execute(text(
            "SELECT k.record_id FROM records_fts f JOIN records_fts_keys k ON k.k = -f.rowid")).scalars()) == {old, new}
    schema.upgrade(svc.db)
    assert sorted(h.record.path for h in svc.search(ADMIN, "s", "zircon", order="relevance").hits) == [
        "notes/new.md", "notes/old.md"]
    svc.db.dispose()
