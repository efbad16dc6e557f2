"""The database the API tests run on: in-memory SQLite by default, PostgreSQL when
``MEMFUSE_TEST_DB_URL`` names one (e.g. ``postgresql://memfuse:memfuse@127.0.0.1:5432/memfuse_test``).

On PostgreSQL every test gets a fresh schema of its own (``CREATE SCHEMA``, reached through
the connection's ``search_path``), dropped with everything in it when the test ends, so tests
never see each other's rows and the role needs only CREATE on the one test database.
"""
from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

ENV = "MEMFUSE_TEST_DB_URL"


def pg_url() -> str | None:
    """The PostgreSQL URL of ``$MEMFUSE_TEST_DB_URL``, or None (run on SQLite)."""
    return os.environ.get(ENV) or None


@contextmanager
def fresh_db_url(sqlite_url: str = "sqlite://") -> Iterator[str]:
    """A database URL for one test: ``sqlite_url`` without ``$MEMFUSE_TEST_DB_URL``; with it,
    the PostgreSQL URL pointed at a new empty schema, dropped when the block ends."""
    base = pg_url()
    if base is None:
        yield sqlite_url
        return
    from sqlalchemy import create_engine

    from memfuse.server.db import normalize_db_url

    schema = "t_" + uuid.uuid4().hex[:16]
    admin = create_engine(normalize_db_url(base), poolclass=_null_pool())
    try:
        with admin.begin() as conn:
            conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
        url = normalize_db_url(base).update_query_dict({"options": f"-csearch_path={schema}"})
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        admin.dispose()


def _null_pool():
    from sqlalchemy.pool import NullPool

    return NullPool


def pg_bindir():
    """The directory of the newest installed PostgreSQL server binaries (``initdb``,
    ``pg_ctl``, ``psql``), or None when none is installed or psycopg is missing."""
    import glob
    from pathlib import Path

    try:
        import psycopg  # noqa: F401
    except ImportError:
        return None
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


@contextmanager
def pg_cluster(max_connections: int = 300, settings: tuple[str, ...] = ()) -> Iterator[str]:
    """A throwaway PostgreSQL cluster on loopback for the duration of the block; yields the
    URL of an empty database ``memfuse_test`` owned by role ``memfuse`` (password
    ``memfuse``). ``fsync=off`` (a test cluster); ``settings`` are extra ``-c`` options.
    Runs the server as user ``postgres`` when started as root (initdb refuses root). Stops
    the cluster and removes its directory at the end. Raises ``RuntimeError`` when PostgreSQL
    or psycopg is not installed (``./scripts/setup --test`` installs both),
    ``subprocess.CalledProcessError`` / ``TimeoutExpired`` when it does not start."""
    import pwd
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    from mountutil import free_port

    bindir = pg_bindir()
    if bindir is None:
        raise RuntimeError("PostgreSQL or psycopg not installed (./scripts/setup --test installs them)")
    work = Path(tempfile.mkdtemp(prefix="memfuse-pg-"))
    as_pg: list[str] = []
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        os.chown(work, pw.pw_uid, pw.pw_gid)
        as_pg = ["runuser", "-u", "postgres", "--"]
    data = work / "data"
    pg_ctl = [*as_pg, str(bindir / "pg_ctl"), "-D", str(data)]
    extra = "".join(f" -c {s}" for s in settings)
    started = False
    try:
        subprocess.run([*as_pg, str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres"],
                       check=True, capture_output=True, timeout=120)
        # PostgreSQL cannot listen on port 0: a free port is picked here, and another process
        # on a shared machine may take it before the server binds it; then pick another
        for attempt in range(5):
            port = free_port()
            log = work / f"log{attempt}"
            try:
                subprocess.run([*pg_ctl, "-l", str(log), "-w", "-o",
                                f"-c listen_addresses=127.0.0.1 -p {port} -k {work} -c fsync=off "
                                f"-c max_connections={max_connections}{extra}", "start"],
                               check=True, capture_output=True, timeout=120)
                break
            except subprocess.CalledProcessError:
                if attempt == 4 or not log.exists() or \
                        "Address already in use" not in log.read_text(errors="replace"):
                    raise
        started = True
        subprocess.run([*as_pg, str(bindir / "psql"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres",
                        "-qc", "CREATE ROLE memfuse LOGIN PASSWORD 'memfuse'",
                        "-c", "CREATE DATABASE memfuse_test OWNER memfuse"],
                       check=True, capture_output=True, timeout=60)
        yield f"postgresql://memfuse:memfuse@127.0.0.1:{port}/memfuse_test"
    finally:
        if started:
            subprocess.run([*pg_ctl, "-m", "fast", "-w", "stop"], capture_output=True, timeout=60)
        shutil.rmtree(work, ignore_errors=True)
