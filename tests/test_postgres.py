"""The control plane on PostgreSQL ("PostgreSQL by URL for more than one machine", README.md).

Starts a throwaway PostgreSQL cluster on loopback (``./scripts/setup --test`` installs the
server and the ``postgres`` extra), then runs the API test files against it in a child pytest
with ``MEMFUSE_TEST_DB_URL`` set (``tests/pgutil.py`` gives each test a fresh schema). In CI a
missing PostgreSQL fails the run; elsewhere the test is skipped with the reason.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
API_TESTS = ["tests/test_api.py", "tests/test_batch.py", "tests/test_semantics_api.py", "tests/test_server_perf.py",
             "tests/test_migrations.py", "tests/test_tokens_api.py", "tests/test_console_api.py",
             "tests/test_health.py", "tests/test_streams.py", "tests/test_search_api.py",
             "tests/test_hostile.py::test_on_postgresql_caps_hold_and_a_revocation_on_one_replica_cuts_on_the_other",
             "tests/test_ranked_search.py", "tests/test_index_report.py", "tests/test_staleness.py",
             "tests/test_append_versions.py", "tests/test_consolidation.py", "tests/test_accounts.py",
             "tests/test_rawsql.py", "tests/test_pg_contract.py", "tests/test_record_tails.py",
             "tests/test_version_pages.py", "tests/test_token_share.py", "tests/test_hostile_reads.py",
             "tests/test_store_precondition.py", "tests/test_feed_writer.py", "tests/test_feed_own_run.py", "tests/test_hostile_tool_reads.py",
             "tests/test_account_streams.py"]


@pytest.mark.timeout(1800)
def test_api_suite_on_postgresql():
    from pgutil import pg_cluster

    _need_pg()
    with pg_cluster(max_connections=300) as url:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               *API_TESTS], cwd=HERE.parent, capture_output=True, text=True,
                              timeout=1500, env=dict(os.environ, MEMFUSE_TEST_DB_URL=url))
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " skipped" not in proc.stdout.splitlines()[-1]


def _need_pg() -> None:
    """Skip (fail in CI) unless PostgreSQL server binaries and psycopg are installed."""
    from pgutil import pg_bindir

    if pg_bindir() is None:
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL or psycopg missing: ./scripts/setup --test installs them")
        pytest.skip("PostgreSQL or psycopg not installed (./scripts/setup --test installs them)")


def _plan_nodes(plan: dict) -> list[dict]:
    out = [plan]
    for child in plan.get("Plans", []):
        out += _plan_nodes(child)
    return out


@pytest.mark.timeout(300)
def test_byte_order_pages_seek_an_index_on_a_non_c_database():
    """On a database whose default collation is not ``C`` (``C.UTF-8`` of libc here, as
    production databases use ``en_US.UTF-8``), the snapshot page, the search page and the tree
    step the service really sends (``path COLLATE "C"``) are index scans on
    ``ix_records_live_path_bytes`` with no Sort, reading about the rows they return; without
    that index the same statements sort the store's records. Pages stay in byte order."""
    _need_pg()
    from sqlalchemy import event, insert
    from sqlalchemy.engine import make_url

    from memfuse.server.db import Database, RecordRow, StoreRow, utcnow
    from memfuse.server.records import _encode_cursor
    from memfuse.server.service import Principal, Service
    from pgutil import pg_cluster

    with pg_cluster() as base:
        u = make_url(base)
        admin = Database(u.set(username="postgres", password=None, database="postgres")
                         .render_as_string(hide_password=False), schema="none")
        with admin.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
            c.exec_driver_sql("CREATE DATABASE bytes OWNER memfuse TEMPLATE template0 "
                              "LC_COLLATE 'C.UTF-8' LC_CTYPE 'C.UTF-8'")
        admin.dispose()
        db = Database(u.set(database="bytes").render_as_string(hide_password=False))  # migrates to head
        try:
            with db.read_conn() as c:
                assert c.exec_driver_sql("SHOW lc_collate").scalar() == "C.UTF-8"
            now = utcnow()
            n = 20_000
            paths = [f"d{i // 500:03d}/note-{i:05d}.md" for i in range(n)] + ["A.md", "a.md", "Z-x.md", "é.md"]
            with db.write_conn() as c:
                for slug in ("big", "small"):
                    c.execute(insert(StoreRow.__table__).values(
                        slug=slug, description="", default_type="project", max_record_bytes=1 << 20,
                        max_store_bytes=1 << 40, max_records=1 << 30, created_at=now))
                rows = [dict(id=f"r{i:06d}", store="big" if i < len(paths) else "small",
                             path=paths[i % len(paths)], type="project", version=1, sha256="0" * 64, size=3,
                             content="x\n" if i % 50 else "needle\n", deleted=i % 97 == 0, created_at=now,
                             updated_at=now, updated_by="admin:test", seq=i + 1)
                        for i in range(len(paths) + 2_000)]
                c.execute(insert(RecordRow.__table__), rows)
                c.exec_driver_sql("ANALYZE records")
            svc, p = Service(db), Principal(workspace=None, name="test")
            live = sorted((r["path"].encode(), r["id"]) for r in rows if r["store"] == "big" and not r["deleted"])
            mid = _encode_cursor(live[len(live) // 2][0].decode(), live[len(live) // 2][1])
            seen: list[tuple[str, dict]] = []

            @event.listens_for(db.engine, "before_cursor_execute")
            def grab(conn, cursor, statement, parameters, context, executemany):  # noqa: ARG001
                if "FROM records" in statement and "max(versions.seq)" not in statement:
                    seen.append((statement, dict(parameters or {})))

            page = svc.list_records(p, "big", cursor=mid, limit=1000, with_content=True)
            got = [r.path.encode() for r in page.records]
            assert got == [k for k, _ in live[len(live) // 2 + 1:len(live) // 2 + 1001]]  # byte order
            first = svc.list_records(p, "big", limit=5)
            assert [r.path for r in first.records] == ["A.md", "Z-x.md", "a.md", "d000/note-00001.md",
                                                       "d000/note-00002.md"]
            svc.search(p, "big", "needle", cursor=mid, limit=20)
            svc.tree(p, "big", "", depth=1)
            statements = list(seen)
            assert len(statements) >= 3
            event.remove(db.engine, "before_cursor_execute", grab)

            def plans() -> list[list[dict]]:
                with db.read_conn() as c:
                    return [_plan_nodes(c.exec_driver_sql("EXPLAIN (ANALYZE, FORMAT JSON) " + s, prm)
                                        .scalar()[0]["Plan"]) for s, prm in statements]

            for nodes in plans():
                kinds = [nd["Node Type"] for nd in nodes]
                assert "Sort" not in kinds and "Incremental Sort" not in kinds, kinds
                # the live content's tail (revision 0018_record_tails): a primary-key probe per row
                scans = [nd for nd in nodes if "Scan" in nd["Node Type"] and nd.get("Relation Name") != "record_tails"]
                assert [(nd["Node Type"], nd.get("Index Name")) for nd in scans] in (
                    [("Index Scan", "ix_records_live_path_bytes")],
                    [("Index Only Scan", "ix_records_live_path_bytes")]), kinds
            snapshot = plans()[0]
            read = sum(nd["Actual Rows"] + nd.get("Rows Removed by Filter", 0) for nd in snapshot
                       if "Scan" in nd["Node Type"] and nd.get("Relation Name") != "record_tails")
            assert read <= 1001, read  # the page (+1 to know more follow), not the store

            # without the index the same statements sort the store. (The index is dropped by
            # hand: a downgrade to the revision before it would also drop later revisions'
            # record columns, which the statements read.)
            with db.write_conn() as c:
                indexdef = c.exec_driver_sql("SELECT indexdef FROM pg_indexes WHERE indexname = "
                                             "'ix_records_live_path_bytes'").scalar()
                c.exec_driver_sql("DROP INDEX ix_records_live_path_bytes")
            for nodes in plans():
                assert "Sort" in [nd["Node Type"] for nd in nodes]
            with db.write_conn() as c:  # and back: the index again, the statements seek it again
                c.exec_driver_sql(indexdef)
            with db.read_conn() as c:
                assert c.exec_driver_sql("SELECT count(*) FROM pg_indexes WHERE indexname = "
                                         "'ix_records_live_path_bytes'").scalar() == 1
            assert all("Sort" not in [nd["Node Type"] for nd in nodes] for nodes in plans())
        finally:
            db.dispose()
