"""The CLI's read commands without an event loop (issue 26: a CLI as quick as kubectl).

In local mode they read the dev database with ``sqlite3`` (``memfuse.cli.localread``), against
a server through a blocking transport (``memfuse.client.SyncTransport``); both must print
exactly what the full paths print (the service through SQLAlchemy under trio; the async
client under trio). Every read command runs both ways on one database made by the real
service, and once more against ``memfuse serve`` on a copy of it, and the outputs are
compared byte for byte. A real subprocess shows what a read command imports.
"""
from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio
from click.testing import CliRunner

from memfuse import client as client_mod
from memfuse.cli import cli
from memfuse.cli import common as common_mod
from memfuse.cli import localread
from memfuse.client import NeedEventLoop, run_loopless, with_retries
from memfuse.devenv import dev_db_path, ensure_dev_setup, local_client
from memfuse.errors import TransientError
from memfuse.wire import Access
from mountutil import serve_listening, serve_process, stop

#: every read command, with the cases the fast path answers and some it hands on
READS = [
    ["store", "list"],
    ["store", "list", "--json"],
    ["store", "show", "default"],
    ["store", "show", "limited"],
    ["token", "list"],
    ["token", "list", "--all"],
    ["token", "list", "--all", "--json"],
    ["token", "list", "--workspace", "dev"],
    ["history", "default", "MEMORY.md"],
    ["history", "default", "notes/moved.md"],
    ["history", "default", "gone.md"],
    ["show", "default", "MEMORY.md"],
    ["show", "default", "notes/äpfel.md"],
    ["show", "default", "MEMORY.md", "--version", "1"],
    ["show", "default", "MEMORY.md", "--version", "2"],  # redacted
    ["show", "default", "MEMORY.md", "--version", "99"],
    ["show", "default", "journal.md", "--version", "2"],  # an append version: the full path
    ["show", "default", "gone.md"],
    ["show", "default", "nowhere.md"],
    ["show", "nostore", "x.md"],
    ["search", "default", "note"],
    ["search", "default", "ÄPFEL"],
    ["search", "default", "Note", "--case-sensitive"],
    ["search", "default", "note", "--match", "path"],
    ["search", "default", "note", "--match", "any", "-l"],
    ["search", "default", "note", "--type", "project"],
    ["search", "default", "note", "--limit", "2"],
    ["search", "default", "long"],
    ["search", "default", "nothing-matches-this"],
    ["search", "default", "note", "--rank"],  # ranked: the full path
    ["search", "default", "note", "--path-prefix", "notes"],  # a prefix: the full path
    ["search", "nostore", "x"],
    ["workspace", "list"],
]

#: commands the fast path must answer itself (no fallback to the full local mode)
FAST = [a for a in READS if not ({"--rank", "--path-prefix", "nostore", "nowhere.md", "99", "journal.md"} & set(a))]


async def _fill() -> None:
    async with local_client() as api:
        await ensure_dev_setup(api)
        await api.create_store("limited", description="small one", max_records=7,
                               max_store_bytes=4096, max_record_bytes=1024, max_history_versions=3)
        await api.create_workspace("other", default_store=False)
        await api.attach("other", "limited", Access.read_only)
        r = await api.create_record("default", "MEMORY.md", "- [notes](notes/): the notes\n")
        r = await api.update_record("default", r.id, "- [notes](notes/): secret v2\n", if_match=r.sha256)
        r = await api.update_record("default", r.id, "- [notes](notes/): the notes, v3\n", if_match=r.sha256)
        await api.redact("default", r.id, 2)
        for i in range(5):
            await api.create_record("default", f"notes/n{i}.md",
                                    f"---\ntype: project\n---\nnote {i}\nNote again {i}\nnothing\n")
        await api.create_record("default", "notes/äpfel.md", "ÄPFEL und äpfel\nkeine Note\n")
        await api.create_record("default", "notes/long.md", "long " + "x" * 400 + "\n")
        m = await api.create_record("default", "notes/m.md", "to move\n")
        await api.move_record("default", m.id, "notes/moved.md", if_match=m.sha256)
        j = await api.create_record("default", "journal.md", "line 0\n")
        await api.update_record("default", j.id, "line 0\nline 1\n", if_match=j.sha256)  # stored as its suffix
        g = await api.create_record("default", "gone.md", "soon gone\n")
        await api.delete_record("default", g.id, if_match=g.sha256)
        await api.create_token("dev", name="laptop")
        await api.create_token(None, name="ops")
        t = await api.create_token("other", name="old")
        await api.revoke_token(t.id)


def _run(args: list[str], env: dict[str, str] | None = None) -> tuple[int, str, str]:
    r = CliRunner().invoke(cli, args, env=env, catch_exceptions=False)
    return r.exit_code, r.stdout, r.stderr


@pytest.fixture
def filled(home):
    trio.run(_fill)
    return home


def test_schema_head_is_the_services():
    from memfuse.server.db import SCHEMA_HEAD

    assert localread.schema_head() == SCHEMA_HEAD


def test_local_reads_match_the_full_path(filled, monkeypatch):
    fast: dict[tuple[str, ...], tuple[int, str, str]] = {}
    fell_back: list[list[str]] = []
    real_api = common_mod._api

    def spy(target, body):
        fell_back.append(current)
        return real_api(target, body)

    monkeypatch.setattr(common_mod, "_api", spy)
    for current in READS:
        fast[tuple(current)] = _run(current)
    assert [a for a in fell_back if a in FAST] == []  # the fast path answered these itself
    assert ["search", "default", "note", "--rank"] in fell_back

    monkeypatch.setattr(localread.LocalReadTransport, "open", classmethod(lambda cls, path: None))
    for args in READS:
        full = _run(args)
        assert fast[tuple(args)] == full, args
    # the cases say something: content, a redacted version, a moved record, a refusal
    assert fast[("show", "default", "notes/äpfel.md")][1] == "ÄPFEL und äpfel\nkeine Note\n"
    assert "redacted" in fast[("show", "default", "MEMORY.md", "--version", "2")][2]
    assert "notes/moved.md" in fast[("history", "default", "notes/moved.md")][1]
    assert fast[("show", "default", "MEMORY.md", "--version", "99")][0] == 1
    assert fast[("show", "default", "journal.md", "--version", "2")][1] == "line 0\nline 1\n"
    assert fast[("search", "default", "ÄPFEL")][1].count("\n") == 1
    assert "(admin)" in fast[("token", "list")][1] and "revoked" in fast[("token", "list", "--all")][1]
    assert "3/" in fast[("store", "show", "limited")][1] or '"max_history_versions": 3' in \
        fast[("store", "show", "limited")][1]


def test_an_old_or_missing_database_goes_the_full_way(home):
    assert localread.LocalReadTransport.open(dev_db_path()) is None  # none yet
    code, out, _ = _run(["store", "list"])  # made (and migrated) by the full path
    assert code == 0 and out.startswith("SLUG")
    with sqlite3.connect(dev_db_path()) as db:
        db.execute("UPDATE alembic_version SET version_num = '0009_console_sessions'")
    assert localread.LocalReadTransport.open(dev_db_path()) is None


def test_a_time_in_another_form_goes_the_full_way(filled):
    with sqlite3.connect(dev_db_path()) as db:
        db.execute("UPDATE stores SET created_at = '2026-01-02 03:04:05.5' WHERE slug = 'limited'")
    t = localread.LocalReadTransport.open(dev_db_path())
    assert t is not None
    code, out, _ = _run(["store", "list"])
    assert code == 0 and "limited" in out


def test_server_reads_match_the_trio_path(filled, tmp_path, monkeypatch):
    db = tmp_path / "serve.db"
    with sqlite3.connect(dev_db_path()) as src, sqlite3.connect(db) as dst:
        src.backup(dst)  # the WAL's pages too
    token = tmp_path / "admin.token"
    token.write_text("admin-secret-token-7\n")
    log = tmp_path / "serve.log"
    proc = serve_process(["--db", f"sqlite:///{db}", "--listen", "127.0.0.1:0", "--admin-token-file", str(token)],
                         log)
    try:
        url = serve_listening(proc, log)
        env = {"MEMFUSE_CONTROL_PLANE": url, "MEMFUSE_TOKEN_FILE": str(token)}
        loopless = {tuple(a): _run(a, env) for a in READS}

        def no_loopless(fn):
            raise NeedEventLoop("test: the trio path")

        monkeypatch.setattr(client_mod, "run_loopless", no_loopless)
        for args in READS:
            assert loopless[tuple(args)] == _run(args, env), args
        # and the server answers what local mode answers (but for its own admin token)
        monkeypatch.setattr(client_mod, "run_loopless", run_loopless)
        for args in READS:
            if args[0] != "token":
                assert loopless[tuple(args)][:2] == _run(args)[:2], args
    finally:
        stop(proc)


def _imports(args: list[str], env: dict[str, str]) -> set[str]:
    p = subprocess.run([sys.executable, "-X", "importtime", "-c",
                        "import sys; sys.argv[0] = 'memfuse'; from memfuse.cli import main; main()", *args],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode in (0, 1), p.stderr[-2000:]
    return {m.group(1) for m in re.finditer(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)", p.stderr, re.M)}


def _heavy(modules: set[str]) -> set[str]:
    """The costly modules among ``modules``: the server side, trio, the content checks."""
    top = {"sqlalchemy", "fastapi", "pydantic", "trio", "alembic", "starlette", "stamina"}
    return {m for m in modules if m.split(".")[0] in top or m.startswith("memfuse.server")
            or m in ("memfuse.content", "memfuse.transfer", "memfuse.sidecar.admin")}


def test_read_commands_import_no_server_nor_trio(filled):
    """What a read command loads in a real process: neither SQLAlchemy, FastAPI, pydantic nor
    trio (each alone costs about the floor, ``import httpx, click``, or more)."""
    env = dict(os.environ)
    for args in (["history", "default", "MEMORY.md"], ["show", "default", "MEMORY.md"],
                 ["search", "default", "note"], ["store", "list"], ["token", "list"]):
        assert _heavy(_imports(args, env)) == set(), args
    # a command the fast path hands on still works, and loads what it needs
    assert "sqlalchemy" in _imports(["search", "default", "note", "--rank"], env)


def test_status_imports_no_trio(tmp_path):
    """``memfuse status`` of a mount reads its status.json without the sidecar's server side."""
    mp = tmp_path / "mnt"
    (mp / ".memfuse").mkdir(parents=True)
    (mp / ".memfuse" / "status.json").write_text('{"workspace": "dev", "ready": true, "outbox": {"depth": 0}}')
    assert _heavy(_imports(["status", str(mp)], dict(os.environ))) == set()


def test_loopless_retries_a_transient_error(monkeypatch):
    calls = []

    async def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise TransientError("GET /v1/stores: 503", status=503, retry_after=0.01)
        return "ok"

    assert run_loopless(lambda: with_retries(flaky, wait_initial=0.01, wait_max=0.05)) == "ok"
    assert len(calls) == 3
    calls.clear()

    async def down() -> str:
        calls.append(1)
        raise TransientError("GET /v1/stores: 503", status=503, retry_after=0.01)

    with pytest.raises(TransientError):
        run_loopless(lambda: with_retries(down, attempts=3, wait_initial=0.01, wait_max=0.05))
    assert len(calls) == 3


def test_loopless_refuses_work_that_suspends():
    class Suspend:  # what an event loop's primitive does: yield to the loop
        def __await__(self):
            yield "suspend"

    async def sleeps() -> None:
        await Suspend()

    with pytest.raises(NeedEventLoop):
        run_loopless(sleeps)


def test_a_long_history_is_read_in_pages_like_the_service(home, monkeypatch):
    """``memfuse history`` of a record with 2,100 versions: the local reader answers the
    version list in pages with the service's ``Link`` (its limit, order and cursor), the CLI
    follows them, and the whole table is the full path's, every version once."""
    from memfuse.client import ApiClient

    async def fill() -> str:
        async with local_client() as api:
            await ensure_dev_setup(api)
            rec = await api.create_record("default", "many.md", "1\n")
            for lo in range(2, 2101, 100):
                await api.batch("default", [ApiClient.batch_update(rec.id, f"{n}\n") for n in range(lo, min(lo + 100, 2101))])
            return rec.id

    rid = trio.run(fill)
    fast = _run(["history", "default", "many.md"])
    rows = [line.split()[0] for line in fast[1].splitlines()[2:]]
    assert fast[0] == 0 and rows == [str(n) for n in range(1, 2101)]
    reader = localread.LocalReadTransport.open(dev_db_path())
    assert reader is not None

    async def pages() -> list[tuple[int, str | None]]:
        out = []
        async with httpx.AsyncClient(transport=reader, base_url="http://local") as c:
            for q in ("", "?order=desc&limit=7", "?cursor=2000&limit=50", "?order=desc&cursor=3"):
                r = await c.get(f"/v1/stores/default/records/{rid}/versions{q}")
                out.append((len(r.json()), r.headers.get("link")))
        return out

    assert trio.run(pages) == [(1000, '<?cursor=1000>; rel="next"'), (7, '<?order=desc&limit=7&cursor=2094>; rel="next"'),
                               (50, '<?limit=50&cursor=2050>; rel="next"'), (2, None)]
    monkeypatch.setattr(localread.LocalReadTransport, "open", classmethod(lambda cls, path: None))
    assert _run(["history", "default", "many.md"]) == fast
