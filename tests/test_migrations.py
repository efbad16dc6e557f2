"""Schema migrations (Alembic revisions in ``memfuse/server/migrations/``) on SQLite and, under
``MEMFUSE_TEST_DB_URL`` (tests/test_postgres.py), PostgreSQL.

- ``create_all`` (what in-memory databases use) and ``upgrade head`` give the same schema,
  by the inspector and by Alembic's autogenerate comparison;
- a database file made by memfuse 0.1.0 before migrations existed
  (``tests/fixtures/memfuse-0.1.0-ce3808f.db``) is recognised, stamped and upgraded, its rows
  intact; one made before the usage columns gets them filled;
- ``memfuse serve`` refuses a database behind head with a message naming
  ``memfuse db upgrade``; ``--migrate`` and ``memfuse dev`` migrate by themselves;
- two upgrades at once run the revisions once; downgrade to empty and back works.
"""
from __future__ import annotations

import json
import logging
import re
import shutil
import threading
from dataclasses import replace
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from click.testing import CliRunner
from sqlalchemy import create_engine, inspect, text

from memfuse.cli import cli
from memfuse.models import AccountCreate, RecordAttributes, RecordCreate, StoreCreate, WorkspaceCreate
from memfuse.server import fulltext, schema
from memfuse.server.app import create_app
from memfuse.server.db import Base, Database, normalize_db_url
from memfuse.server.service import Principal
from pgutil import fresh_db_url

FIXTURES = Path(__file__).resolve().parent / "fixtures"
LEGACY_DB = FIXTURES / "memfuse-0.1.0-ce3808f.db"
ADMIN = Principal(workspace=None, name="test")
# Indexes Alembic's autogenerate cannot compare: ``ix_records_live_path_bytes`` exists on
# PostgreSQL only (``ddl_if``, which autogenerate ignores), and SQLAlchemy reflects its
# ``path COLLATE "C"`` as a plain ``path``. ``_dump`` compares PostgreSQL's own definitions
# (``pg_indexes.indexdef``: columns, collations, WHERE) instead.
AUTOGEN_BLIND_INDEXES = {"ix_records_live_path_bytes"}


def _dump(url: str) -> dict:
    """Everything about a schema that the inspector reports, per table (alembic_version left out)."""
    engine = create_engine(normalize_db_url(url))
    try:
        insp = inspect(engine)
        out: dict = {}
        for table in sorted(insp.get_table_names()):
            if table == schema.VERSION_TABLE:
                continue
            out[table] = {
                # by name: the order of columns added later differs between the two roads (the
                # full-text column is created last by create_all, in revision order by upgrade)
                # and nothing reads columns by position
                "columns": sorted((c["name"], str(c["type"]), c["nullable"], str(c.get("default")))
                                  for c in insp.get_columns(table)),
                "pk": insp.get_pk_constraint(table)["constrained_columns"],
                "fks": sorted((tuple(f["constrained_columns"]), f["referred_table"], tuple(f["referred_columns"]),
                               str(sorted(f.get("options", {}).items()))) for f in insp.get_foreign_keys(table)),
                "indexes": sorted((i["name"], tuple(i["column_names"]), bool(i["unique"]),
                                   str(sorted((k, str(v)) for k, v in i.get("dialect_options", {}).items())))
                                  for i in insp.get_indexes(table)),
                "uniques": sorted(tuple(u["column_names"]) for u in insp.get_unique_constraints(table)),
            }
        if engine.dialect.name == "postgresql":
            with engine.connect() as conn:
                out["pg_indexes"] = [(name, re.sub(r" ON \S+\.", " ON ", indexdef)) for name, indexdef in conn.execute(text(
                    "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = current_schema() "
                    "AND tablename <> :v ORDER BY indexname"), {"v": schema.VERSION_TABLE})]
        if engine.dialect.name == "sqlite":
            with engine.connect() as conn:
                out["sqlite_sequence"] = conn.execute(text(
                    "SELECT name FROM sqlite_master WHERE sql LIKE '%AUTOINCREMENT%' ORDER BY name")).scalars().all()
                out["sqlite_triggers"] = conn.execute(text(
                    "SELECT name, sql FROM sqlite_master WHERE type = 'trigger' ORDER BY name")).all()
                out["sqlite_virtual"] = conn.execute(text(
                    "SELECT name, sql FROM sqlite_master WHERE sql LIKE 'CREATE VIRTUAL%' ORDER BY name")).all()
        else:
            with engine.connect() as conn:
                out["pg_generated"] = conn.execute(text(
                    "SELECT column_name, generation_expression FROM information_schema.columns "
                    "WHERE table_schema = current_schema() AND is_generated = 'ALWAYS' ORDER BY column_name")).all()
                here = conn.execute(text("SELECT current_schema()")).scalar()  # each database its own
                out["pg_triggers"] = [(name, tdef.replace(f"{here}.", ""), src) for name, tdef, src in conn.execute(text(
                    "SELECT t.tgname, pg_get_triggerdef(t.oid), p.prosrc FROM pg_trigger t "
                    "JOIN pg_proc p ON p.oid = t.tgfoid JOIN pg_class c ON c.oid = t.tgrelid "
                    "WHERE NOT t.tgisinternal AND c.relnamespace = current_schema()::regnamespace "
                    "ORDER BY t.tgname"))]
        return out
    finally:
        engine.dispose()


def _sqlite(tmp_path: Path, name: str) -> str:
    return f"sqlite:///{tmp_path / name}"


# Alembic says so on SQLite before asking ``include_object`` (see AUTOGEN_BLIND_INDEXES)
@pytest.mark.filterwarnings("ignore:autogenerate skipping metadata-specified expression-based index "
                            "'ix_records_live_path_bytes':UserWarning")
def test_create_all_and_upgrade_head_give_the_same_schema(tmp_path):
    with fresh_db_url(_sqlite(tmp_path, "a.db")) as a, fresh_db_url(_sqlite(tmp_path, "b.db")) as b:
        engine = create_engine(normalize_db_url(a))
        Base.metadata.create_all(engine)
        engine.dispose()
        db = Database(b, schema="none")
        before, after = schema.upgrade(db)
        assert before.current is None and after.current == schema.head() and after.at_head
        # Alembic's own comparison of the migrated database with the models: nothing to do
        with db.engine.connect() as conn:
            def include(obj, name, type_, reflected, compare_to):  # noqa: ARG001 — Alembic's signature
                # the full-text index is DDL beside the models (memfuse.server.fulltext): _dump
                # compares it (tables, triggers, column, indexes) between the two databases
                return not ((type_ == "index" and name in AUTOGEN_BLIND_INDEXES | fulltext.INDEX_OBJECTS["indexes"])
                            or (type_ == "table" and name in fulltext.INDEX_OBJECTS["tables"])
                            or (type_ == "column" and name in fulltext.INDEX_OBJECTS["columns"]))

            diff = compare_metadata(MigrationContext.configure(
                conn, opts={"compare_type": True, "include_object": include}), Base.metadata)
        db.dispose()
        assert diff == []
        dumped_a, dumped_b = _dump(a), _dump(b)
        assert set(dumped_a) >= {"stores", "records", "versions", "tokens"}
        assert dumped_a == dumped_b
        if "sqlite_triggers" in dumped_b:  # the full-text index, as its revision and fulltext.install make it
            assert [name for name, _ in dumped_b["sqlite_triggers"]] == ["records_fts_ad", "records_fts_ai",
                                                                          "records_fts_au", "records_fts_au_seq"]
            assert [name for name, _ in dumped_b["sqlite_virtual"]] == ["records_fts"]
        else:
            # the full-text vector is kept by a trigger (revision 0016_fts_record_keys)
            assert dumped_b["pg_generated"] == []
            assert [name for name, *_ in dumped_b["pg_triggers"]] == ["records_search_vector"]
        if "pg_indexes" in dumped_b:  # the byte-order index, as its revision and the model say
            defs = dict(dumped_b["pg_indexes"])
            assert defs["ix_records_live_path_bytes"] == ('CREATE INDEX ix_records_live_path_bytes ON records '
                                                          'USING btree (store, path COLLATE "C", id) '
                                                          "WHERE (deleted = false)")


def test_schema_head_constant_is_the_newest_revision(tmp_path, monkeypatch):
    """``db.SCHEMA_HEAD`` (how a database at the newest revision opens without Alembic) is
    the newest revision; a database at it opens without running ``schema`` at all, one
    behind it is upgraded as before."""
    from memfuse.server import db as db_mod

    assert db_mod.SCHEMA_HEAD == schema.head()
    with fresh_db_url(_sqlite(tmp_path, "head.db")) as url:
        Database(url).dispose()  # made by the revisions
        calls: list[str] = []
        monkeypatch.setattr(schema, "upgrade", lambda db, *a: calls.append("upgrade"))
        monkeypatch.setattr(schema, "check", lambda db, shown: calls.append("check"))
        Database(url).dispose()
        Database(url, schema="check").dispose()
        assert calls == []
        monkeypatch.setattr(db_mod, "SCHEMA_HEAD", "9999_not_yet")
        Database(url).dispose()
        Database(url, schema="check").dispose()
        assert calls == ["upgrade", "check"]


def test_upgrade_is_idempotent_and_status_reports_head(tmp_path):
    with fresh_db_url(_sqlite(tmp_path, "x.db")) as url:
        db = Database(url)  # migrate mode: upgraded at open
        st = schema.status(db)
        assert (st.current, st.legacy, st.known, st.at_head) == (schema.head(), False, True, True)
        before, after = schema.upgrade(db)
        assert before == after == st
        assert schema.check(db, "shown") == st
        db.dispose()


def test_two_upgrades_at_once_run_the_revisions_once(tmp_path):
    with fresh_db_url(_sqlite(tmp_path, "race.db")) as url:
        dbs = [Database(url, schema="none") for _ in range(2)]
        results: list = []
        errors: list = []
        start = threading.Barrier(2)

        def go(db):
            try:
                start.wait(10)
                results.append(schema.upgrade(db))
            except Exception as e:  # noqa: BLE001 — reported below
                errors.append(e)

        threads = [threading.Thread(target=go, args=(d,)) for d in dbs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        starts = sorted((b.current or "") for b, _ in results)
        assert starts == ["", schema.head()]  # one built it, the other found it done
        with dbs[0].engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM alembic_version")).scalar() == 1
        for d in dbs:
            d.dispose()


def test_downgrade_to_empty_and_back(tmp_path):
    with fresh_db_url(_sqlite(tmp_path, "down.db")) as url:
        db = Database(url)
        svc_app = create_app(url)
        svc = svc_app.state.service
        svc.create_store(ADMIN, StoreCreate(slug="s"))
        svc.create_record(ADMIN, "s", RecordCreate(path="a.md", content="abc"))
        svc.db.dispose()
        from alembic import command

        with db.write_conn() as conn:
            command.downgrade(schema.alembic_config(connection=conn), "0001_initial")
        with db.read_conn() as conn:
            assert "usage_bytes" not in {c["name"] for c in inspect(conn).get_columns("stores")}
        schema.upgrade(db)  # the backfill recounts the live record
        with db.read_conn() as conn:
            assert conn.execute(text("SELECT usage_bytes, record_count FROM stores")).one() == (3, 1)
        with db.write_conn() as conn:
            command.downgrade(schema.alembic_config(connection=conn), "base")
        with db.read_conn() as conn:
            assert set(inspect(conn).get_table_names()) <= {schema.VERSION_TABLE}
        schema.upgrade(db)
        assert schema.status(db).at_head
        db.dispose()


def _make_legacy(url: str, revision: str) -> None:
    """A database as memfuse 0.1.0 left it: the tables of ``revision``, no alembic_version."""
    db = Database(url, schema="none")
    schema.upgrade(db, revision)
    with db.write_conn() as conn:
        conn.exec_driver_sql(f"DROP TABLE {schema.VERSION_TABLE}")
    db.dispose()


def test_database_without_usage_columns_gets_them_filled(tmp_path):
    """0.1.0 before the usage columns: recognised as 0001_initial, then 0002 fills them."""
    with fresh_db_url(_sqlite(tmp_path, "old.db")) as url:
        _make_legacy(url, "0001_initial")
        engine = create_engine(normalize_db_url(url))
        with engine.begin() as conn:
            conn.execute(text(
                "INSERT INTO stores (slug, description, default_type, max_record_bytes, max_store_bytes,"
                " max_records, created_at) VALUES ('s', '', 'project', 100, 1000, 10, :t),"
                " ('empty', '', 'project', 100, 1000, 10, :t)"), {"t": "2026-01-01 00:00:00"})
            for i, (size, deleted) in enumerate([(1, False), (2, False), (3, True), (4, False)]):
                conn.execute(text(
                    "INSERT INTO records (id, store, path, type, version, sha256, size, content, deleted,"
                    " created_at, updated_at, updated_by, seq) VALUES (:id, 's', :p, NULL, 1, :h, :n, :c, :d,"
                    " :t, :t, 'x', :i)"),
                    {"id": f"r{i}", "p": f"r{i}.md", "h": "0" * 64, "n": size, "c": "x" * size, "d": deleted,
                     "t": "2026-01-01 00:00:00", "i": i + 1})
        engine.dispose()
        db = Database(url, schema="none")
        st = schema.status(db)
        assert (st.current, st.legacy, st.at_head) == ("0001_initial", True, False)
        with pytest.raises(schema.SchemaBehind, match="memfuse db upgrade"):
            schema.check(db, "shown")
        db.dispose()
        app = create_app(url)  # migrate mode
        svc = app.state.service
        assert schema.status(svc.db).at_head
        s = svc.get_store(ADMIN, "s")
        assert (s.record_count, s.usage_bytes) == (3, 1 + 2 + 4)
        assert svc.get_store(ADMIN, "empty").record_count == 0
        svc.create_record(ADMIN, "s", RecordCreate(path="new.md", content="yy"))
        assert svc.get_store(ADMIN, "s").usage_bytes == 9
        svc.db.dispose()


def test_legacy_database_with_usage_columns_is_stamped(tmp_path):
    with fresh_db_url(_sqlite(tmp_path, "legacy.db")) as url:
        _make_legacy(url, "0002_store_usage")
        db = Database(url, schema="none")
        assert schema.status(db) == schema.SchemaStatus("0002_store_usage", schema.head(), legacy=True, known=True)
        before, after = schema.upgrade(db)
        assert before.legacy and not after.legacy and after.at_head
        db.dispose()


def test_fixture_from_memfuse_0_1_0_upgrades_with_rows_intact(tmp_path):
    """An SQLite file (also under MEMFUSE_TEST_DB_URL; PostgreSQL's legacy databases are made
    by ``_make_legacy`` above)."""
    path = tmp_path / "cp.db"
    shutil.copy(LEGACY_DB, path)
    url = f"sqlite:///{path}"
    token = (FIXTURES / (LEGACY_DB.name + ".token")).read_text().strip()
    db = Database(url, schema="none")
    st = schema.status(db)
    assert st.legacy and st.current == "0002_store_usage"
    with pytest.raises(schema.SchemaBehind) as err:
        schema.check(db, "sqlite:///cp.db")
    assert "memfuse db upgrade" in str(err.value) and "before migrations" in str(err.value)
    db.dispose()
    app = create_app(url, schema="migrate")
    svc = app.state.service
    assert schema.status(svc.db).at_head
    p = svc.authenticate(token)
    assert p.workspace == "agent-1"
    # 0003_token_lifecycle: old tokens are active, never expire, and have been used now
    listed = [t for t in svc.list_tokens(ADMIN) if t.workspace == "agent-1"]
    assert listed and all(t.state == "active" and t.expires_at is None for t in listed)
    assert any(t.last_used_at is not None for t in listed)
    notes = svc.get_store(ADMIN, "notes")
    assert (notes.record_count, notes.usage_bytes, notes.description) == (3, 34, "team notes")
    paths = sorted(r.path for r in svc.list_records(ADMIN, "notes").records)
    assert paths == ["MEMORY.md", "a.md", "sub/c.md"]
    assert [a.store.slug for a in svc.list_attachments(ADMIN, "agent-2")] == ["notes"]
    rid = next(r.id for r in svc.list_records(ADMIN, "notes").records if r.path == "a.md")
    versions = svc.list_versions(ADMIN, "notes", rid).versions
    assert [(v.version, v.redacted) for v in versions] == [(1, True), (2, False)]
    # 0003: records and versions from before the attributes show the defaults, and take them
    assert all((r.mode, r.mtime_ns) == (0o644, None) for r in svc.list_records(ADMIN, "notes").records)
    assert all((v.mode, v.mtime_ns) == (0o644, None) for v in versions)
    svc.set_attributes(p, "notes", rid, RecordAttributes(mode=0o600, mtime_ns=1))
    rec = svc.get_record(ADMIN, "notes", rid)
    assert (rec.mode, rec.mtime_ns, rec.version) == (0o600, 1, 3)
    created = svc.create_record(p, "notes", RecordCreate(path="after-upgrade.md", content="new\n"))
    assert created.status == 201
    assert svc.get_store(ADMIN, "notes").record_count == 4
    # 0017_workspace_names: every workspace's public name is its name (= its key)
    with svc.db.read_conn() as conn:
        rows = conn.execute(text("SELECT name, public_name, account FROM workspaces ORDER BY name")).all()
    assert rows and all(r.public_name == r.name and r.account == "default" for r in rows)
    # ... so another account may now have one of the same name, keyed apart
    svc.create_account(ADMIN, AccountCreate(slug="other"))
    made = svc.create_workspace(replace(ADMIN, account="other"), WorkspaceCreate(name="agent-1"))
    assert made.status == 201 and json.loads(made.body)["name"] == "agent-1"
    assert [a.store.slug for a in svc.list_attachments(ADMIN, "agent-2")] == ["notes"]
    assert svc.authenticate(token).workspace == "agent-1"  # the old token: the old workspace
    svc.db.dispose()


def test_unknown_newer_revision_is_served_but_not_migrated(tmp_path, caplog):
    with fresh_db_url(_sqlite(tmp_path, "newer.db")) as url:
        db = Database(url)
        with db.write_conn() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = '9999_from_the_future'"))
        st = schema.status(db)
        assert not st.known and st.at_head
        with caplog.at_level(logging.WARNING, logger="memfuse.server.schema"):
            assert schema.check(db, "shown").current == "9999_from_the_future"
            before, after = schema.upgrade(db)
        assert before == after and after.current == "9999_from_the_future"
        assert "unknown to this memfuse" in caplog.text
        db.dispose()


def test_offline_sql_for_both_dialects():
    for url in ("sqlite:///x.db", "postgresql://u@h/db"):
        sql = schema.offline_sql(url)
        assert "CREATE TABLE stores" in sql and "ADD COLUMN usage_bytes" in sql
        assert "alembic_version" in sql
    assert "BIGSERIAL" in schema.offline_sql("postgresql://u@h/db")
    assert "AUTOINCREMENT" in schema.offline_sql("sqlite:///x.db")


# ---------------------------------------------------------------- command line


def _cli(args: list[str], env: dict | None = None):
    return CliRunner().invoke(cli, args, env=env, catch_exceptions=False)


def test_db_commands_and_serve_refusal(tmp_path):
    with fresh_db_url(_sqlite(tmp_path, "cli.db")) as url:
        r = _cli(["db", "current", "--db", url, "--check"])
        assert r.exit_code == 1 and "empty (no memfuse schema)" in r.output and "memfuse db upgrade" in r.output
        (tmp_path / "admin.token").write_text("t0ken\n")
        r = _cli(["serve", "--db", url, "--admin-token-file", str(tmp_path / "admin.token"),
                  "--listen", "127.0.0.1:0"])
        assert r.exit_code == 1
        last = r.output.strip().splitlines()[-1]
        assert last.startswith("Error: database ") and "`memfuse db upgrade --db URL`" in last and "--migrate" in last
        assert "***" in last or "@" not in url  # no password shown
        r = _cli(["db", "upgrade", "--db", url])
        assert r.exit_code == 0 and f"upgraded from empty to {schema.head()}" in r.output
        r = _cli(["db", "upgrade", "--db", url])
        assert r.exit_code == 0 and f"already at {schema.head()}" in r.output
        r = _cli(["db", "current", "--db", url, "--check"])
        assert r.exit_code == 0 and f"{schema.head()} (head)" in r.output


def test_db_upgrade_of_an_unreachable_database_is_one_line(tmp_path):
    (tmp_path / "adir").mkdir()  # a directory where the file should be: SQLite cannot open it
    r = _cli(["db", "upgrade", "--db", f"sqlite:///{tmp_path}/adir"])
    assert r.exit_code == 1
    assert len(r.output.strip().splitlines()) == 1 and "unreachable or failing" in r.output
    (tmp_path / "afile").write_text("")  # a missing directory that cannot be made
    r = _cli(["db", "upgrade", "--db", f"sqlite:///{tmp_path}/afile/dir/x.db"])
    assert r.exit_code == 1
    assert r.output.strip() == f"Error: cannot create the directory {tmp_path}/afile/dir for the SQLite " \
        "database x.db: Not a directory", r.output
    r = _cli(["db", "current", "--db", "nosuchdialect://x"])
    assert r.exit_code == 1 and "bad database URL" in r.output


def test_dev_database_migrates_by_itself(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMFUSE_HOME", str(tmp_path))
    shutil.copy(LEGACY_DB, tmp_path / "dev.db")
    from memfuse.devenv import dev_app

    env = dev_app()
    assert schema.status(env.app.state.service.db).at_head
    env.app.state.service.db.dispose()
