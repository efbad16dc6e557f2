"""An ablation for ``prof_write.py --ablate-serve-fsync`` (bench/README.md, "The close path,
session 24: the control plane's fsync"): with this directory on ``PYTHONPATH``, a ``memfuse
serve`` process opens every SQLite connection with ``PRAGMA synchronous=NORMAL``, so a commit
writes the WAL without waiting for the disk (SQLite syncs the WAL only at a checkpoint), the
durability JuiceFS's SQLite metadata engine runs with. It measures what the control plane's
per-commit ``fdatasync`` costs the close path; it is **not** a mode of memfuse: a commit the
sidecar was told about could be lost with the machine's power, and the sidecar would not send it
again. Any other process: nothing happens. A bench tool, never imported by memfuse.
"""
import sys

if "serve" in sys.argv[1:]:
    import sqlite3
    import sqlite3.dbapi2 as _dbapi2  # SQLAlchemy's pysqlite dialect connects through this module

    _connect = _dbapi2.connect

    def _connect_nosync(*args, **kwargs):  # type: ignore[no-untyped-def]
        conn = _connect(*args, **kwargs)
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    sqlite3.connect = _dbapi2.connect = _connect_nosync
