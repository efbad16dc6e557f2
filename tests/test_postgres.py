"""The control plane on PostgreSQL ("PostgreSQL by URL for more than one machine", README.md).

Starts a throwaway PostgreSQL cluster on loopback (``./scripts/setup --test`` installs the
server and the ``postgres`` extra), then runs the API test files against it in a child pytest
with ``MEMFUSE_TEST_DB_URL`` set (``tests/pgutil.py`` gives each test a fresh schema). In CI a
missing PostgreSQL fails the run; elsewhere the test is skipped with the reason.
"""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from mountutil import free_port

HERE = Path(__file__).resolve().parent
API_TESTS = ["tests/test_api.py", "tests/test_batch.py", "tests/test_semantics_api.py", "tests/test_server_perf.py",
             "tests/test_migrations.py", "tests/test_tokens_api.py", "tests/test_console_api.py",
             "tests/test_health.py", "tests/test_streams.py", "tests/test_search_api.py"]


def _pg_bindir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


@pytest.mark.timeout(600)
def test_api_suite_on_postgresql():
    bindir = _pg_bindir()
    try:
        import psycopg  # noqa: F401
    except ImportError:
        bindir = None
    if bindir is None:
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL or psycopg missing: ./scripts/setup --test installs them")
        pytest.skip("PostgreSQL or psycopg not installed (./scripts/setup --test installs them)")
    work = Path(tempfile.mkdtemp(prefix="memfuse-pg-"))
    as_pg: list[str] = []
    if os.geteuid() == 0:  # initdb refuses to run as root
        pw = pwd.getpwnam("postgres")
        os.chown(work, pw.pw_uid, pw.pw_gid)
        as_pg = ["runuser", "-u", "postgres", "--"]
    data, port = work / "data", free_port()
    pg_ctl = [*as_pg, str(bindir / "pg_ctl"), "-D", str(data)]
    started = False
    try:
        subprocess.run([*as_pg, str(bindir / "initdb"), "-D", str(data), "-A", "trust",
                        "-U", "postgres"], check=True, capture_output=True, timeout=120)
        subprocess.run([*pg_ctl, "-l", str(work / "log"), "-w", "-o",
                        f"-c listen_addresses=127.0.0.1 -p {port} -k {work} -c fsync=off "
                        "-c max_connections=300", "start"],
                       check=True, capture_output=True, timeout=120)
        started = True
        subprocess.run([*as_pg, str(bindir / "psql"), "-h", "127.0.0.1", "-p", str(port),
                        "-U", "postgres", "-qc", "CREATE ROLE memfuse LOGIN PASSWORD 'memfuse'",
                        "-c", "CREATE DATABASE memfuse_test OWNER memfuse"],
                       check=True, capture_output=True, timeout=60)
        url = f"postgresql://memfuse:memfuse@127.0.0.1:{port}/memfuse_test"
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               *API_TESTS], cwd=HERE.parent, capture_output=True, text=True,
                              timeout=500, env=dict(os.environ, MEMFUSE_TEST_DB_URL=url))
        print(proc.stdout[-3000:])
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
        assert " passed" in proc.stdout and " skipped" not in proc.stdout.splitlines()[-1]
    finally:
        if started:
            subprocess.run([*pg_ctl, "-m", "fast", "-w", "stop"], capture_output=True, timeout=60)
        shutil.rmtree(work, ignore_errors=True)
