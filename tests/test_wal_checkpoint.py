"""The SQLite WAL checkpoint of serve's kept write connection runs after a write's answer, not
inside its commit (``memfuse.server.db.WalCheckpoints``; bench/README.md, "The close path,
session 20: the WAL checkpoint").

On a real SQLite file through ``Service.create_record`` (the writer's job of a create), and a
crash (``os._exit`` in a child process, no dispose) right after a run of creates."""
from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from memfuse.models import RecordCreate, WorkspaceCreate
from memfuse.server.base import IdempotencyRequest, Principal
from memfuse.server.db import Database, WalCheckpoints
from memfuse.server.service import Service

ROOT = Path(__file__).resolve().parent.parent
FRAME = 4096 + 24  # a WAL frame: its header and one page of the default size


def _service(path: Path) -> tuple[Database, Service, Principal]:
    db = Database(f"sqlite:///{path}")
    svc = Service(db)
    svc.create_workspace(Principal(workspace=None, name="t"), WorkspaceCreate(name="ws"))
    return db, svc, Principal(workspace="ws", instance="t")


def _create(svc: Service, p: Principal, i: int, committed: list[int] | None = None) -> None:
    idem = IdempotencyRequest(str(uuid.uuid4()), "POST", "/v1/stores/ws/records",
                              uuid.uuid4().hex * 2, uuid.uuid4().hex * 2)
    r = svc.create_record(p, "ws", RecordCreate(path=f"d{i % 10}/{i}.md", content=f"note {i}\n" * 40), idem)
    assert r.status == 201, r.body


def test_the_kept_connection_checkpoints_after_commits_not_inside_them(tmp_path, monkeypatch):
    db, svc, p = _service(tmp_path / "cp.db")
    try:
        order: list[str] = []
        real_due = WalCheckpoints.due

        def due(self: WalCheckpoints, conn) -> None:  # noqa: ANN001
            runs = self.runs
            real_due(self, conn)
            order.append("checkpoint" if self.runs > runs else "none")

        monkeypatch.setattr(WalCheckpoints, "due", due)
        for i in range(400):
            _create(svc, p, i)
        kept = db._kept
        assert kept is not None
        auto = kept.connection.dbapi_connection.execute("PRAGMA wal_autocheckpoint").fetchone()[0]
        assert auto == 0  # SQLite's own checkpoint (inside a commit) is off on this connection
        assert order.count("checkpoint") >= 3, order.count("checkpoint")
        # the interval was learnt from the log's size: about FRAMES frames between two
        # checkpoints (a create writes tens of frames: far fewer transactions than FRAMES)
        assert 1 <= db._wal.every < WalCheckpoints.FRAMES // 4
        # the log stays bounded as with SQLite's own checkpoint: one interval's frames, the
        # file reused from its start after each complete checkpoint
        wal = (tmp_path / "cp.db-wal").stat().st_size
        assert wal <= 3 * WalCheckpoints.FRAMES * FRAME, wal
    finally:
        db.dispose()


def test_a_failing_checkpoint_fails_no_write_and_is_tried_again(tmp_path, monkeypatch, caplog):
    db, svc, p = _service(tmp_path / "cp.db")
    try:
        _create(svc, p, 0)
        assert db._kept is not None
        real = db._kept.connection.dbapi_connection
        fails = {"n": 3}

        class Failing:
            """The kept driver connection, whose checkpoint fails ``fails["n"]`` times."""

            def execute(self, sql: str, *a):  # noqa: ANN002, ANN201
                if "wal_checkpoint" in sql and fails["n"] > 0:
                    fails["n"] -= 1
                    raise sqlite3.OperationalError("disk I/O error")
                return real.execute(sql, *a)

            def __getattr__(self, name: str):  # noqa: ANN204 - commit, rollback: the real ones
                return getattr(real, name)

        monkeypatch.setattr("memfuse.server.db._driver", lambda conn: Failing())
        db._wal.every = 1
        for i in range(1, 6):
            _create(svc, p, i)  # each answered 201 (asserted in _create)
        assert fails["n"] == 0  # tried again after each failing write
        assert db._wal.runs >= 1  # then ran
        assert "WAL checkpoint failed" in caplog.text
    finally:
        db.dispose()


def test_commits_answered_before_a_crash_are_kept_without_any_checkpoint(tmp_path):
    """A child process creates records, then dies at once (``os._exit``: no dispose, no
    checkpoint, no close): every create it returned from is in the database afterwards (the
    commit is on disk at its own fsync of the log; the checkpoint only moves pages)."""
    path = tmp_path / "cp.db"
    child = textwrap.dedent(f"""
        import os, sys, uuid
        sys.path.insert(0, {str(ROOT)!r})
        from memfuse.models import RecordCreate, WorkspaceCreate
        from memfuse.server.base import IdempotencyRequest, Principal
        from memfuse.server.db import Database, WalCheckpoints
        from memfuse.server.service import Service
        WalCheckpoints.FIRST_EVERY = 10 ** 6  # never checkpoint: only the log holds them
        db = Database("sqlite:///{path}")
        svc = Service(db)
        svc.create_workspace(Principal(workspace=None, name="t"), WorkspaceCreate(name="ws"))
        p = Principal(workspace="ws", instance="t")
        for i in range(120):
            idem = IdempotencyRequest(str(uuid.uuid4()), "POST", "/v1/stores/ws/records",
                                      uuid.uuid4().hex * 2, uuid.uuid4().hex * 2)
            r = svc.create_record(p, "ws", RecordCreate(path=f"c/{{i}}.md", content="x"), idem)
            assert r.status == 201
        print("created", flush=True)
        os._exit(0)
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0 and "created" in out.stdout, out.stderr[-2000:]
    assert (tmp_path / "cp.db-wal").stat().st_size > 0  # the records are in the log only
    conn = sqlite3.connect(path)
    try:
        n = conn.execute("SELECT count(*) FROM records WHERE path LIKE 'c/%' AND deleted = 0").fetchone()[0]
    finally:
        conn.close()
    assert n == 120


@pytest.mark.parametrize("frames,since,expect", [(1000, 32, 33), (2000, 32, 16), (10, 32, 1000), (64_000, 32, 1)])
def test_the_interval_is_learnt_from_the_log_size(frames, since, expect):
    """``since`` transactions then the one that makes the checkpoint due; the next interval
    makes ``FRAMES`` frames at the rate the log showed, within [1, MAX_EVERY]."""
    w = WalCheckpoints()
    w.since = since

    class Row:
        def fetchone(self):  # noqa: ANN201
            return (0, frames, frames)

    class Driver:
        def execute(self, sql: str):  # noqa: ANN201
            assert sql == "PRAGMA wal_checkpoint(PASSIVE)"
            return Row()

    class Conn:
        class _dbapi_connection:  # noqa: N801 - the attribute chain _driver reads
            dbapi_connection = Driver()

    w.every = since
    w.due(Conn())  # type: ignore[arg-type]
    assert (w.every, w.since, w.runs) == (expect, 0, 1)
