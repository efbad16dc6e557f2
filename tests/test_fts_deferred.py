"""An update of a live record re-indexed at the drain, not in its transaction (SQLite;
revision ``0024_fts_queue_updates``, ``memfuse.server.fulltext`` "Pending"): an append, an
update, a move or a restore queues the record's id and writes no FTS row; a ranked search
right after drains first, so it finds the new words and no longer the removed ones; a delete
leaves the index at once; ranking is the same as a database that indexed the final contents
at their creates. Main indexed every such write in its transaction (nothing queued)."""
from __future__ import annotations

from pathlib import Path

from alembic import command
from sqlalchemy import text
from test_fts_keys import ADMIN, _append, _create

from memfuse.models import RecordMove, RecordUpdate, Restore, StoreCreate
from memfuse.server import fulltext, schema
from memfuse.server.db import Database
from memfuse.server.service import Service


def _service(path: Path) -> Service:
    svc = Service(Database(f"sqlite:///{path}"))
    svc.create_store(ADMIN, StoreCreate(slug="s"))
    return svc


def _paths(svc: Service, q: str) -> list[str]:
    return [h.record.path for h in svc.search(ADMIN, "s", q, order="relevance").hits]


def _ranked(svc: Service, q: str) -> list[tuple]:
    page = svc.search(ADMIN, "s", q, order="relevance")
    return [(h.record.path, round(h.score or 0, 9), h.snippet, [(ln.line, ln.text) for ln in h.lines])
            for h in page.hits]


def _state(svc: Service) -> tuple[set[str], dict[str, str], tuple[int, int]]:
    """(ids queued, {record id: the body its FTS row holds}, (segments, bytes) of the FTS data)."""
    with svc.db.read_conn() as conn:
        queued = set(conn.execute(text("SELECT record_id FROM records_fts_pending")).scalars())
        rows = {str(r[0]): str(r[1]) for r in conn.execute(text(
            "SELECT k.record_id, f.body FROM records_fts f JOIN records_fts_keys k ON k.k = -f.rowid"))}
        data = conn.execute(text("SELECT count(*), sum(length(block)) FROM records_fts_data")).one()
    return queued, rows, (int(data[0]), int(data[1]))


def test_an_append_or_update_queues_the_record_and_writes_no_fts_row(tmp_path):
    svc = _service(tmp_path / "a.db")
    a = _create(svc, "notes/journal.md", "# Journal\nfirst line with walrus\n")
    svc.db.index_pending()
    _, rows, data = _state(svc)
    assert rows == {a["id"]: "# Journal\nfirst line with walrus\n"}
    sha = _append(svc, a["id"], a["sha256"], "appended yankee line\n")
    # queued; the FTS table untouched in the append's transaction (main re-indexed it here)
    assert _state(svc) == ({a["id"]}, rows, data)
    assert _paths(svc, "yankee") == ["notes/journal.md"]  # a ranked search right after drains first
    queued, rows2, _ = _state(svc)
    assert queued == set() and rows2 == {a["id"]: "# Journal\nfirst line with walrus\nappended yankee line\n"}
    # an update that removes a word: queued; the search right after no longer finds it
    r = svc.update_record(ADMIN, "s", a["id"], RecordUpdate(content="# Journal\nonly zebra now\n"),
                          if_match=f'"{sha}"')
    assert r.status == 200, r.body
    assert _state(svc)[:2] == ({a["id"]}, rows2)
    assert _paths(svc, "walrus") == [] and _paths(svc, "yankee") == []
    assert _paths(svc, "zebra") == ["notes/journal.md"]
    assert _state(svc)[0] == set()
    svc.db.dispose()


def test_a_delete_leaves_the_index_at_once_a_restore_and_a_move_are_found_after(tmp_path):
    svc = _service(tmp_path / "a.db")
    a = _create(svc, "notes/alpha.md", "alpha quokka\n")
    b = _create(svc, "notes/bravo.md", "bravo quokka\n")
    svc.db.index_pending()
    _append(svc, a["id"], a["sha256"], "more quokka words\n")  # queued, its old FTS row kept
    assert a["id"] in _state(svc)[0]
    assert svc.delete_record(ADMIN, "s", a["id"]).status == 204
    # gone from the FTS table in the delete's transaction, before any drain
    queued, rows, _ = _state(svc)
    assert a["id"] not in rows and b["id"] in rows
    assert _paths(svc, "quokka") == ["notes/bravo.md"]
    assert svc.restore_record(ADMIN, "s", a["id"], Restore(version=2)).status == 200
    assert _state(svc)[0] == {a["id"]} and a["id"] not in _state(svc)[1]  # queued (main indexed it here)
    assert _paths(svc, "quokka") == ["notes/alpha.md", "notes/bravo.md"]
    assert _paths(svc, "more") == ["notes/alpha.md"]
    assert svc.get_record(ADMIN, "s", a["id"]).content == "alpha quokka\nmore quokka words\n"
    r = svc.move_record(ADMIN, "s", b["id"], RecordMove(path="archive/narwhal.md"), if_match=f'"{b["sha256"]}"')
    assert r.status == 200, r.body
    assert _state(svc)[0] == {b["id"]}  # queued (main indexed it here)
    assert _paths(svc, "narwhal") == ["archive/narwhal.md"]
    assert _paths(svc, "bravo") == ["archive/narwhal.md"]  # by its content; the old path's words gone
    assert _paths(svc, "notes") == ["notes/alpha.md"]
    svc.db.dispose()


def test_ranking_after_deferred_updates_is_that_of_the_final_contents_indexed_at_once(tmp_path):
    svc = _service(tmp_path / "a.db")
    recs = [_create(svc, f"notes/{i}.md", f"# Heading {i}\nquartz line {i}\n") for i in range(4)]
    svc.db.index_pending()
    for i, rec in enumerate(recs):
        sha = rec["sha256"]
        for j in range(i + 1):
            sha = _append(svc, rec["id"], sha, f"quartz appended {j} " + "filler " * j + "\n")
    fresh = _service(tmp_path / "b.db")
    for rec in recs:
        content = svc.get_record(ADMIN, "s", rec["id"]).content
        assert content is not None
        _create(fresh, rec["path"], content)
    for q in ("quartz", "appended", "heading 2", "filler"):
        assert _ranked(svc, q) == _ranked(fresh, q), q
    svc.db.dispose()
    fresh.db.dispose()


def test_a_writer_drains_queued_appends_every_drain_every_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(fulltext, "DRAIN_EVERY", 4)
    svc = _service(tmp_path / "a.db")
    a = _create(svc, "j.md", "start\n")
    svc.db.index_pending()
    sha, longest = a["sha256"], 0
    for i in range(20):
        sha = _append(svc, a["id"], sha, f"line {i} umbrella{i}\n")
        longest = max(longest, len(_state(svc)[0]))
    assert longest == 1  # one record queued at most, however many appends
    svc.db._since_drain = fulltext.DRAIN_EVERY - 1  # noqa: SLF001 - the next write transaction drains
    sha = _append(svc, a["id"], sha, "last umbrella20\n")
    queued, rows, _ = _state(svc)
    assert queued == set() and rows[a["id"]].endswith("line 19 umbrella19\nlast umbrella20\n")
    svc.db.dispose()


def test_the_revision_replaces_the_trigger_and_its_downgrade_puts_0023s_back(tmp_path):
    svc = _service(tmp_path / "a.db")

    def trigger() -> str:
        with svc.db.read_conn() as conn:
            return str(conn.execute(text(
                "SELECT sql FROM sqlite_master WHERE type = 'trigger' AND name = 'records_fts_au'")).scalar())

    assert trigger() == fulltext._AU_QUEUE.replace(" IF NOT EXISTS", "")  # noqa: SLF001
    a = _create(svc, "notes/a.md", "kiwi\n")
    svc.db.index_pending()
    sha = _append(svc, a["id"], a["sha256"], "mango\n")  # queued by 0024's trigger
    with svc.db.write_conn() as conn:
        command.downgrade(schema.alembic_config(connection=conn), "0023_fts_queue_ids")
    assert trigger() == fulltext._AU.replace(" IF NOT EXISTS", "")  # noqa: SLF001
    assert _paths(svc, "mango") == ["notes/a.md"]  # 0023's drain indexes what 0024 queued
    sha = _append(svc, a["id"], sha, "papaya\n")  # 0023: indexed in the append's transaction
    assert _state(svc)[0] == set() and "papaya" in _state(svc)[1][a["id"]]
    schema.upgrade(svc.db)
    assert trigger() == fulltext._AU_QUEUE.replace(" IF NOT EXISTS", "")  # noqa: SLF001
    _append(svc, a["id"], sha, "lychee\n")
    assert _state(svc)[0] == {a["id"]}
    assert _paths(svc, "lychee") == ["notes/a.md"]
    svc.db.dispose()
