"""An ablation for ``prof_write.py --ablate-serve-fsync=deferred`` (bench/README.md, "The close
path, session 25: pricing the deferred sync"): the cost of issue 25's proposed close path,
before building it. With this directory on ``PYTHONPATH``:

- ``memfuse serve`` opens every SQLite connection with ``PRAGMA synchronous=NORMAL`` (a commit
  writes the WAL without waiting for the disk) and, after each write transaction of its kept
  write connection (``WalCheckpoints.due``, run after the answer is handed over), wakes a syncer
  thread that ``fdatasync``s the WAL file: one sync per commit or fewer (commits that come during
  a sync share the next one), off the answer's path but on the machine's CPUs and disk, as the
  design's background WAL sync would be.
- the sidecar (``memfuse mount``) writes every accepted write to its outbox journal at once
  (``Journal.HOLD = 0``: a transaction and an fsync per batch of closes, in its worker thread,
  beside the send), as the design's sidecar would, whose journal keeps a write until the control
  plane says it is on disk.

Not modelled: the close waiting for both the journal and the answer, the durable-seq bookkeeping,
the feeds holding back versions not yet synced. **Not a mode of memfuse**: a commit the sidecar was
told about could be lost with the machine's power. A bench tool, never imported by memfuse.
"""
import sys
import threading

if "serve" in sys.argv[1:]:
    import os
    import sqlite3
    import sqlite3.dbapi2 as _dbapi2  # SQLAlchemy's pysqlite dialect connects through this module

    _connect = _dbapi2.connect

    def _connect_nosync(*args, **kwargs):  # type: ignore[no-untyped-def]
        conn = _connect(*args, **kwargs)
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    sqlite3.connect = _dbapi2.connect = _connect_nosync

    from memfuse.server import db as _db  # noqa: E402

    _cond = threading.Condition()
    _state = {"asked": 0, "fd": -1, "syncs": 0}

    def _syncer() -> None:
        done = 0
        while True:
            with _cond:
                while _state["asked"] == done:
                    _cond.wait()
                done = _state["asked"]
                fd = _state["fd"]
            if fd >= 0:
                os.fdatasync(fd)
                _state["syncs"] += 1

    threading.Thread(target=_syncer, name="wal-syncer", daemon=True).start()
    _due = _db.WalCheckpoints.due

    def _due_and_sync(self, conn):  # type: ignore[no-untyped-def]
        if _state["fd"] < 0:
            dbapi = _db._driver(conn)
            if dbapi is not None:
                path = dbapi.execute("PRAGMA database_list").fetchone()[2]
                if path:
                    _state["fd"] = os.open(path + "-wal", os.O_RDONLY)
        with _cond:
            _state["asked"] += 1
            _cond.notify()
        return _due(self, conn)

    _db.WalCheckpoints.due = _due_and_sync

if "mount" in sys.argv[1:]:
    from memfuse.sidecar import journal as _journal

    _journal.Journal.HOLD = 0
