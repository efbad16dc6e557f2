"""SQLite's full-text index keyed by record (revision ``0016_fts_record_keys``,
``memfuse.server.fulltext``): a write that leaves the indexed text alone (an append past the
first ``PG_MAX_CHARS`` characters, an attribute change) does not touch the index, and ranked
search stays exact: the same hits, scores, snippets and lines as a database that indexed the
final contents at once. The revision re-keys a database of the revision before with its
records, and its downgrade puts the seq-keyed form back."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from sqlalchemy import text

from memfuse.models import RecordAppend, RecordAttributes, RecordCreate, RecordMove, RecordUpdate, Restore, StoreCreate
from memfuse.server import fulltext, schema
from memfuse.server.db import Database
from memfuse.server.service import Principal, Service

ADMIN = Principal(workspace=None, name="test")
HEAD = fulltext.PG_MAX_CHARS
#: the revision before this one (whatever it is after a re-chain)
BEFORE = schema.script_directory().get_revision("0016_fts_record_keys").down_revision


def _service(path: Path) -> Service:
    svc = Service(Database(f"sqlite:///{path}"))
    svc.create_store(ADMIN, StoreCreate(slug="s", max_record_bytes=4 << 20))
    return svc


def _big() -> str:
    # words in the indexed head, then past it: only the head is ranked (as on PostgreSQL)
    line = "# Ledger heading\n" + "journal entry with quartz and words\n" * 20
    body = (line * (HEAD // len(line) + 1))[:HEAD - 1] + "\n"
    return body + "tail words zircon only past the head\n" * 3000


def _index_state(svc: Service) -> tuple[int, int, list]:
    with svc.db.read_conn() as conn:
        changes = conn.execute(text("SELECT count(*), sum(length(block)) FROM records_fts_data")).one()
        keys = conn.execute(text("SELECT k, record_id FROM records_fts_keys ORDER BY k")).all()
    return int(changes[0]), int(changes[1]), [tuple(k) for k in keys]


def _ranked(svc: Service, q: str, **kw) -> list[tuple]:
    page = svc.search(ADMIN, "s", q, order="relevance", **kw)
    return [(h.record.path, round(h.score or 0, 9), h.snippet, [(ln.line, ln.text) for ln in h.lines],
             h.line_matches, h.path_match) for h in page.hits]


def _create(svc: Service, path: str, content: str) -> dict:
    r = svc.create_record(ADMIN, "s", RecordCreate(path=path, content=content))
    assert r.status == 201, r.body
    return json.loads(r.body)


def _append(svc: Service, rid: str, sha: str, suffix: str) -> str:
    r = svc.append_record(ADMIN, "s", rid, RecordAppend(append=suffix), if_match=f'"{sha}"')
    assert r.status == 200, r.body
    return json.loads(r.body)["sha256"]


def test_a_write_that_keeps_the_indexed_text_leaves_the_index_alone_and_ranking_exact(tmp_path):
    svc = _service(tmp_path / "a.db")
    big = _create(svc, "journal/ledger.md", _big())
    small = _create(svc, "notes/quartz.md", "quartz notes\n")
    _create(svc, "notes/other.md", "# Quartz\nother words\n")
    svc.db.index_pending()  # the new records keyed and indexed (revision 0023: keys given at the drain)
    before = _index_state(svc)
    sha = big["sha256"]
    for i in range(5):  # appends past the indexed head: the index is not written
        sha = _append(svc, big["id"], sha, f"appended line {i} with quartz\n")
    assert _index_state(svc) == before
    r = svc.set_attributes(ADMIN, "s", big["id"], RecordAttributes(mode=0o600), if_match=f'"{sha}"')
    assert r.status == 200, r.body
    assert _index_state(svc) == before
    # an append inside the head (a small record) is indexed: its new word is found
    s2 = _append(svc, small["id"], small["sha256"], "yankee appended\n")
    assert [h[0] for h in _ranked(svc, "yankee")] == ["notes/quartz.md"]
    assert _index_state(svc)[2] == before[2]  # same keys: re-indexed in place
    # the same final contents indexed at once in a fresh database rank exactly the same
    fresh = _service(tmp_path / "b.db")
    for path, rid in (("journal/ledger.md", big["id"]), ("notes/quartz.md", small["id"])):
        content = svc.get_record(ADMIN, "s", rid).content
        assert content is not None
        _create(fresh, path, content)
    _create(fresh, "notes/other.md", "# Quartz\nother words\n")
    for q, kw in (("quartz", {}), ("ledger", {}), ("quartz journal", {"match": "content"}),
                  ("quartz", {"match": "path"}), ("yankee", {}), ("zircon", {})):
        assert _ranked(svc, q, **kw) == _ranked(fresh, q, **kw), q
    assert [h[0] for h in _ranked(svc, "ledger")] == ["journal/ledger.md"]
    assert _ranked(svc, "zircon") == []  # past the head: not ranked (substring search finds it)
    assert [h.record.path for h in svc.search(ADMIN, "s", "zircon").hits] == ["journal/ledger.md"]
    # move, delete, restore, purge keep the key table and the index in step
    assert svc.move_record(ADMIN, "s", small["id"], RecordMove(path="archive/moved.md"),
                           if_match=f'"{s2}"').status == 200
    assert [h[0] for h in _ranked(svc, "yankee")] == ["archive/moved.md"]
    assert svc.delete_record(ADMIN, "s", small["id"]).status == 204
    assert _ranked(svc, "yankee") == []
    assert svc.restore_record(ADMIN, "s", small["id"], Restore(version=2)).status == 200
    assert [h[0] for h in _ranked(svc, "yankee")] == ["notes/quartz.md"]
    with svc.db.write_conn() as conn:  # a purge (the row goes): its key goes with it
        conn.execute(text("DELETE FROM versions WHERE record_id = :r"), {"r": small["id"]})
        conn.execute(text("DELETE FROM records WHERE id = :r"), {"r": small["id"]})
    assert _ranked(svc, "yankee") == []
    assert small["id"] not in {rid for _, rid in _index_state(svc)[2]}
    with svc.db.read_conn() as conn:  # every FTS row belongs to a live record's key
        orphans = conn.execute(text(
            "SELECT count(*) FROM records_fts f LEFT JOIN records_fts_keys k ON k.k = -f.rowid "
            "LEFT JOIN records r ON r.id = k.record_id WHERE r.id IS NULL OR r.deleted = 1")).scalar()
        plan = " ".join(str(r[-1]) for r in conn.execute(text(
            "EXPLAIN QUERY PLAN SELECT records.id FROM records_fts CROSS JOIN records_fts_keys "
            "ON records_fts_keys.k = -records_fts.rowid CROSS JOIN records INDEXED BY ix_records_fts_hit "
            "ON records.id = records_fts_keys.record_id WHERE records_fts MATCH 'quartz' "
            "AND records.store = 's' AND records.deleted = 0")))
    assert orphans == 0
    assert "COVERING INDEX ix_records_fts_hit" in plan  # a hit never reads a record's row
    svc.db.dispose()
    fresh.db.dispose()


def test_revision_rekeys_an_older_database_and_downgrades(tmp_path: Path):
    url = f"sqlite:///{tmp_path / 'old.db'}"
    db = Database(url, schema="none")
    schema.upgrade(db, BEFORE)
    with db.write_conn() as conn:  # rows as the release before wrote them
        conn.execute(text(
            "INSERT INTO stores (slug, public_slug, description, default_type, max_record_bytes, "
            "max_store_bytes, max_records, created_at) VALUES ('s', 's', '', 'project', 1048576, "
            "104857600, 10000, :t)"), {"t": datetime(2026, 1, 1)})
        for i, (path, body, deleted) in enumerate([("notes/india.md", "# Juliet\nkilo\n", False),
                                                     ("b.md", "juliet juliet\n", False),
                                                     ("gone.md", "juliet kilo\n", True)], 1):
            conn.execute(text(
                "INSERT INTO records (id, store, path, type, version, sha256, size, content, deleted, "
                "created_at, updated_at, updated_by, seq) VALUES (:id, 's', :p, 'project', 1, :h, :n, :c, "
                ":d, :t, :t, 'x', :seq)"), {"id": f"r{i}", "p": path, "h": "0" * 64, "n": len(body), "c": body,
                                           "d": deleted, "t": datetime(2026, 1, 1), "seq": 1000 + i})
    with db.read_conn() as conn:  # the seq-keyed form's own hits
        old = conn.execute(text("SELECT r.path, bm25(records_fts, 10.0, 4.0, 1.0) FROM records_fts CROSS JOIN records r "
                                "ON r.seq = records_fts.rowid WHERE records_fts MATCH 'juliet' "
                                "ORDER BY 2, 1")).all()
    assert [p for p, _ in old] == ["notes/india.md", "b.md"]
    svc = Service(db)
    before, after = schema.upgrade(db)
    assert before.current == BEFORE and after.current == schema.head()
    assert [(h[0], h[1]) for h in _ranked(svc, "juliet")] == [(p, round(-score, 9)) for p, score in old]
    with db.read_conn() as conn:
        assert {r for _, r in conn.execute(text("SELECT k, record_id FROM records_fts_keys"))} == {"r1", "r2"}
        # a previous release's ranked search (joined on seq) finds nothing, never a wrong record
        assert conn.execute(text("SELECT count(*) FROM records_fts CROSS JOIN records "
                                 "ON records.seq = records_fts.rowid WHERE records_fts MATCH 'juliet'")).scalar() == 0
    svc.create_record(ADMIN, "s", RecordCreate(path="lima.md", content="juliet too\n"))
    from alembic import command

    with db.write_conn() as conn:
        command.downgrade(schema.alembic_config(connection=conn), BEFORE)
    with db.read_conn() as conn:
        rows = conn.execute(text("SELECT r.path FROM records_fts CROSS JOIN records r ON r.seq = records_fts.rowid "
                                 "WHERE records_fts MATCH 'juliet' ORDER BY r.path")).scalars().all()
    assert rows == ["b.md", "lima.md", "notes/india.md"]  # the seq-keyed form, every live record
    schema.upgrade(db)
    assert {h[0] for h in _ranked(svc, "juliet")} == {"b.md", "lima.md", "notes/india.md"}
    db.dispose()


def test_postgresql_vector_kept_by_trigger_equals_the_computed_one():
    """PostgreSQL (a cluster of its own; skipped without the binaries): after the migrations
    (``0007_fulltext``'s generated column made a plain one kept by the trigger
    ``records_search_vector``), every record's stored vector equals the vector computed from
    its row now, through appends past and inside the indexed head, a move, an attribute
    change, a delete and a restore; ranked search finds what it did; downgrade to the
    revision before gives the generated column back, upgrade the trigger."""
    import pytest

    from pgutil import pg_bindir, pg_cluster

    if pg_bindir() is None:
        pytest.skip("PostgreSQL not installed (./scripts/setup --test installs it)")
    with pg_cluster(max_connections=20) as url:
        svc = Service(Database(url))
        svc.create_store(ADMIN, StoreCreate(slug="s", max_record_bytes=4 << 20))
        big = _create(svc, "journal/ledger.md", _big())
        small = _create(svc, "notes/quartz.md", "quartz notes\n")

        def check() -> None:
            with svc.db.read_conn() as conn:
                bad = conn.execute(text(
                    f"SELECT path FROM records WHERE search_vector IS DISTINCT FROM ({fulltext.PG_VECTOR_SQL})"
                )).scalars().all()
            assert bad == []

        def stored(rid: str) -> str:
            with svc.db.read_conn() as conn:
                return str(conn.execute(text("SELECT search_vector::text FROM records WHERE id = :r"),
                                        {"r": rid}).scalar())

        check()
        before = stored(big["id"])
        sha = big["sha256"]
        for i in range(3):
            sha = _append(svc, big["id"], sha, f"appended zulu {i}\n")
        assert stored(big["id"]) == before
        check()
        s2 = _append(svc, small["id"], small["sha256"], "yankee appended\n")
        check()
        assert [h[0] for h in _ranked(svc, "yankee")] == ["notes/quartz.md"]
        assert svc.move_record(ADMIN, "s", small["id"], RecordMove(path="archive/moved.md"),
                               if_match=f'"{s2}"').status == 200
        assert svc.set_attributes(ADMIN, "s", big["id"], RecordAttributes(mode=0o600),
                                  if_match=f'"{sha}"').status == 200
        assert svc.delete_record(ADMIN, "s", small["id"]).status == 204
        assert svc.restore_record(ADMIN, "s", small["id"], Restore(version=2)).status == 200
        check()
        assert [h[0] for h in _ranked(svc, "yankee")] == ["notes/quartz.md"]
        assert [h[0] for h in _ranked(svc, "ledger")] == ["journal/ledger.md"]
        from alembic import command

        with svc.db.write_conn() as conn:
            command.downgrade(schema.alembic_config(connection=conn), BEFORE)
        with svc.db.read_conn() as conn:
            gen = conn.execute(text("SELECT column_name FROM information_schema.columns WHERE "
                                    "table_schema = current_schema() AND is_generated = 'ALWAYS'")).scalars().all()
        assert gen == ["search_vector"]
        schema.upgrade(svc.db)
        check()
        assert [h[0] for h in _ranked(svc, "yankee")] == ["notes/quartz.md"]
        svc.db.dispose()


def _queued(svc: Service) -> tuple[set[str], set[str]]:
    """(ids of the records queued for indexing, ids of the records in the FTS table)."""  # 0023: ids queued
    with svc.db.read_conn() as conn:
        queued = set(conn.execute(text(
            "SELECT record_id FROM records_fts_pending")).scalars())
        indexed = set(conn.execute(text(
            "SELECT k.record_id FROM records_fts f JOIN records_fts_keys k ON k.k = -f.rowid")).scalars())
    return queued, indexed


def test_a_new_record_is_queued_and_a_ranked_search_right_after_its_write_finds_it(tmp_path):
    """A new record is not indexed in its write's transaction (``fulltext`` "Pending",
    revisions ``0020_fts_pending``, ``0023_fts_queue_ids``): its id is queued, and a ranked search right after the
    write drains the queue first, so it finds the record (read-your-writes). Writes of a
    queued record before the drain (an update, a move, a delete, a purge) rank as if it had
    been indexed at its create; the batch's creates are queued the same way."""
    svc = _service(tmp_path / "a.db")
    a = _create(svc, "notes/alpha.md", "# Quasar heading\nfirst words\n")
    queued, indexed = _queued(svc)
    assert a["id"] in queued and a["id"] not in indexed  # queued, not indexed (main indexes it here)
    assert [h[0] for h in _ranked(svc, "quasar")] == ["notes/alpha.md"]  # at once
    assert _queued(svc) == (set(), {a["id"]})
    # writes of queued records before any search
    b = _create(svc, "notes/bravo.md", "old words xylophone\n")
    c = _create(svc, "notes/charlie.md", "charlie quasar\n")
    d = _create(svc, "notes/delta.md", "delta quasar\n")
    e = _create(svc, "notes/echo.md", "echo quasar\n")
    r = svc.update_record(ADMIN, "s", b["id"], RecordUpdate(content="new words quasar\n"), if_match=f'"{b["sha256"]}"')
    assert r.status == 200, r.body
    assert svc.move_record(ADMIN, "s", c["id"], RecordMove(path="moved/charlie.md"),
                           if_match=f'"{c["sha256"]}"').status == 200
    assert svc.delete_record(ADMIN, "s", d["id"]).status == 204
    with svc.db.write_conn() as conn:  # a purge of a queued record
        conn.execute(text("DELETE FROM versions WHERE record_id = :r"), {"r": e["id"]})
        conn.execute(text("DELETE FROM records WHERE id = :r"), {"r": e["id"]})
    ops = [{"op": "create", "body": {"path": f"batch/{i}.md", "content": f"quasar batch {i}\n"}} for i in range(3)]
    from memfuse.models import BatchRequest
    replies = svc.batch(ADMIN, "s", BatchRequest.model_validate({"operations": ops}).operations)
    assert all(x.status == 201 for x in replies)
    assert len(_queued(svc)[0]) >= 4  # the batch's three and alpha's siblings
    got = _ranked(svc, "quasar")
    assert sorted(h[0] for h in got) == ["batch/0.md", "batch/1.md", "batch/2.md", "moved/charlie.md",
                                         "notes/alpha.md", "notes/bravo.md"]
    assert _ranked(svc, "xylophone") == []  # the update's old text is not in the index
    assert _queued(svc)[0] == set()
    # the same final contents indexed one by one at their writes rank exactly the same
    fresh = _service(tmp_path / "b.db")
    for h in got:
        rec = svc.search(ADMIN, "s", h[0].split("/")[-1]).hits[0].record
        content = svc.get_record(ADMIN, "s", rec.id).content
        assert content is not None
        _create(fresh, h[0], content)
        _ranked(fresh, "quasar")  # drained after each create
    assert _ranked(svc, "quasar") == _ranked(fresh, "quasar")
    svc.db.dispose()
    fresh.db.dispose()


def test_a_writer_drains_the_queue_every_drain_every_writes(tmp_path, monkeypatch):
    """Without a search the queue stays short: every ``fulltext.DRAIN_EVERY`` committed write
    transactions the writer indexes it (``Database.write_conn``)."""
    monkeypatch.setattr(fulltext, "DRAIN_EVERY", 3)
    svc = _service(tmp_path / "a.db")  # the store's create: one write transaction
    one = _create(svc, "one.md", "one\n")
    assert _queued(svc)[0] == {one["id"]}
    two = _create(svc, "two.md", "two\n")  # the third write: drained after its commit
    assert _queued(svc) == (set(), {one["id"], two["id"]})
    svc.db.dispose()
