"""The memfuse command line: in-process with click's CliRunner and as a real subprocess
(`memfuse` console script), in local mode (MEMFUSE_HOME in a tmp dir) and against
`memfuse serve` on a loopback port."""
from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import click
import httpx
import pytest
import trio
from click.testing import CliRunner

from memfuse import cli as cli_mod
from memfuse.cli import cli
from memfuse.client import ApiClient
from memfuse.devenv import dev_db_path, ensure_dev_setup, local_client
from mountutil import serve_listening, serve_process
from mountutil import stop as stop_process

MEMFUSE = Path(sys.executable).with_name("memfuse")


def run(args: list[str], *, env_extra: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run the real `memfuse` executable with the current environment (+ env_extra)."""
    assert MEMFUSE.exists(), f"console script missing: {MEMFUSE}"
    env = dict(os.environ)
    env.update(env_extra or {})
    return subprocess.run([str(MEMFUSE), *args], env=env, capture_output=True, timeout=timeout)


def invoke(args: list[str], env: dict[str, str] | None = None):
    return CliRunner().invoke(cli, args, env=env, catch_exceptions=False)


def assert_one_line_error(stderr: str | bytes) -> None:
    text = stderr.decode() if isinstance(stderr, bytes) else stderr
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("memfuse: no --control-plane")]
    assert len(lines) == 1, text
    assert lines[0].startswith("Error: "), text
    assert "Traceback" not in text


def all_command_paths(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = [prefix]
    ctx = click.Context(group)
    for name in group.list_commands(ctx):  # click's API: commands of a lazy group too
        cmd = group.get_command(ctx, name)
        if isinstance(cmd, click.Group):
            out.extend(all_command_paths(cmd, (*prefix, name)))
        else:
            out.append((*prefix, name))
    return out


# ---------------------------------------------------------------- help


def test_help_for_every_command(home):
    paths = all_command_paths(cli)
    expected = {("serve",), ("dev",), ("mount",), ("status",), ("store", "create"), ("store", "list"),
                ("store", "update"), ("workspace", "create"), ("attach",), ("detach",), ("token", "create"),
                ("token", "list"), ("token", "revoke"),
                ("history",), ("show",), ("restore",), ("search",), ("context",), ("db", "upgrade"),
                ("db", "current")}
    assert expected <= set(paths)
    for path in paths:
        r = invoke([*path, "--help"])
        assert r.exit_code == 0, (path, r.output)
        assert r.stdout.startswith("Usage: "), (path, r.stdout)
        assert " ".join(("memfuse", *path)) in r.stdout.splitlines()[0]
    r = invoke(["store", "create", "--help"])
    assert "MEMFUSE_DESCRIPTION" in r.stdout and "MEMFUSE_CONTROL_PLANE" in r.stdout
    p = run(["--help"], env_extra={"COLUMNS": "80"})
    assert p.returncode == 0 and b"Usage: memfuse" in p.stdout
    # no description cut short (click ends a cut one with "..."); `dev` says what it does
    for group in ([], ["store"], ["token"], ["workspace"], ["db"], ["mounts"]):
        r = invoke([*group, "--help"], env={"COLUMNS": "80"})
        listing = r.stdout.split("Commands:", 1)[1]
        assert not [ln for ln in listing.splitlines() if ln.rstrip().endswith("...")], (group, listing)
    listing = invoke(["--help"], env={"COLUMNS": "80"}).stdout.split("Commands:", 1)[1]
    assert re.search(r"\n  dev\s+Mount memory at MOUNTPOINT", listing), listing
    p = run(["mount", "--help"])
    assert p.returncode == 0 and b"--control-plane" in p.stdout and b"MEMFUSE_COMMIT_WAIT" in p.stdout


# ---------------------------------------------------------------- local mode


def test_local_admin_commands(home):
    r = invoke(["store", "create", "notes", "--description", "team notes", "--max-record-bytes", "512K",
                "--default-type", "reference"])
    assert r.exit_code == 0, r.output
    assert dev_db_path() == home / "dev.db" and (home / "dev.db").exists()
    r = invoke(["store", "list"])
    assert r.exit_code == 0
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("notes "))
    assert "reference" in line and "512 KiB" in line and "team notes" in line
    r = invoke(["store", "update", "notes", "--max-records", "5", "--description", "renamed"])
    assert r.exit_code == 0 and "0/5" in r.stdout and "renamed" in r.stdout
    r = invoke(["store", "update", "notes"])
    assert r.exit_code == 2  # nothing to update: usage error

    r = invoke(["workspace", "create", "w1"])
    assert r.exit_code == 0 and "with store w1 attached read-write" in r.stdout
    r = invoke(["attach", "w1", "notes", "--read-only", "--instructions", "read first"])
    assert r.exit_code == 0 and "read_only" in r.stdout
    r = invoke(["workspace", "list"])
    assert "notes (read_only), w1 (read_write)" in r.stdout
    r = invoke(["workspace", "create", "w0", "--no-default-store"])
    assert r.exit_code == 0 and r.stdout.strip() == "created workspace w0"
    assert "w0" not in invoke(["store", "list"]).stdout
    r = invoke(["context", "--workspace", "w1", "--mount-root", "/srv/mem"])
    assert r.exit_code == 0 and "/srv/mem/notes" in r.stdout and "read first" in r.stdout

    r = invoke(["token", "create", "--workspace", "w1", "--name", "bot"])
    assert r.exit_code == 0
    tok = r.stdout.strip()
    assert tok and "\n" not in tok and "workspace w1" in r.stderr
    r = invoke(["token", "create"])
    assert r.exit_code == 0 and "admin" in r.stderr
    r = invoke(["token", "create", "--workspace", "w1", "--name", "temp", "--ttl", "12h"])
    assert r.exit_code == 0 and "expires 20" in r.stderr, r.output
    temp = r.stdout.strip()
    r = invoke(["token", "list", "--workspace", "w1"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["ID", "NAME", "WORKSPACE", "CREATED", "LAST", "USED", "EXPIRES", "STATE"]
    bot = next(ln for ln in lines if " bot " in ln)
    assert bot.split()[-2:] == ["never", "active"] and tok not in r.stdout and temp not in r.stdout
    temp_id = next(ln for ln in lines if " temp " in ln).split()[0]
    r = invoke(["token", "revoke", temp_id])
    assert r.exit_code == 0 and f"revoked token {temp_id}" in r.stdout
    r = invoke(["token", "list", "--json", "--all"])
    states = {t["name"]: t["state"] for t in json.loads(r.stdout)}
    assert states["temp"] == "revoked" and states["bot"] == "active"
    assert "temp" not in invoke(["token", "list"]).stdout
    r = invoke(["token", "revoke", "no-such-id"])  # shorter than an id: a prefix of none
    assert r.exit_code == 1 and "no token id starts with no-such-id" in r.stderr
    r = invoke(["token", "revoke", "00000000-0000-4000-8000-000000000000"])  # a full id: the API's 404
    assert r.exit_code == 1 and "404" in r.stderr
    assert_one_line_error(r.stderr)
    assert invoke(["token", "create", "--ttl", "0"]).exit_code == 2
    assert invoke(["token", "create", "--ttl", "3 parsecs"]).exit_code == 2

    r = invoke(["detach", "w1", "notes"])
    assert r.exit_code == 0 and "detached" in r.stdout
    r = invoke(["detach", "w1", "notes"])
    assert r.exit_code == 1
    assert_one_line_error(r.stderr)
    assert "not attached" in r.stderr and "404" in r.stderr

    r = invoke(["workspace", "create", "w1"])
    assert r.exit_code == 1 and "exists" in r.stderr
    r = invoke(["store", "create", "Bad Slug"])
    assert r.exit_code == 2


def test_env_vars_for_flags(home):
    r = invoke(["store", "create", "envstore"], env={"MEMFUSE_DESCRIPTION": "from env",
                                                     "MEMFUSE_DEFAULT_TYPE": "user"})
    assert r.exit_code == 0, r.output
    assert "from env" in r.stdout and "user" in r.stdout
    assert invoke(["workspace", "create", "w2"]).exit_code == 0
    r = invoke(["attach", "w2", "envstore"], env={"MEMFUSE_READ_ONLY": "1", "MEMFUSE_INSTRUCTIONS": "env instr"})
    assert r.exit_code == 0 and "read_only" in r.stdout
    # a flag's env var in a real subprocess
    p = run(["context"], env_extra={"MEMFUSE_WORKSPACE": "w2"})
    assert p.returncode == 0, p.stderr
    assert b"envstore" in p.stdout and b"env instr" in p.stdout
    # without it the required option is missing: usage error
    p = run(["context"])
    assert p.returncode == 2 and b"--workspace" in p.stderr


async def _make_history(content_v2: str) -> str:
    async with local_client() as api:
        await ensure_dev_setup(api)
        await api.create_record("default", "MEMORY.md", "- [a](notes/a.md): the note\n")
        r = await api.create_record("default", "notes/a.md", "first\n")
        await api.update_record("default", r.id, content_v2, if_match=r.sha256)
        await api.delete_record("default", r.id)
        return r.id


def test_errors_about_a_path_say_it_in_its_terms(home):
    """A refusal about a record named by path names the path and version, not the record id
    and HTTP code; --verbose adds them."""
    rid = trio.run(_make_history, "second\n")
    for cmd in (["show", "default", "notes/a.md", "--version", "99"],
                ["restore", "default", "notes/a.md", "--version", "99"]):
        r = invoke(cmd)
        assert r.exit_code == 1 and r.stderr.strip() == "Error: notes/a.md has no version 99", r.stderr
    r = invoke(["--verbose", "show", "default", "notes/a.md", "--version", "99"])
    assert r.stderr.startswith("Error: notes/a.md has no version 99 (HTTP 404 version_not_found"), r.stderr
    assert rid in r.stderr
    assert_one_line_error(r.stderr)


def test_history_show_restore_subprocess(home):
    v2 = "second — ünïcode\nno newline at end"
    rid = trio.run(_make_history, v2)

    p = run(["history", "default", "notes/a.md"])
    assert p.returncode == 0, p.stderr
    out = p.stdout.decode()
    assert rid in out and "deleted" in out
    rows = [ln.split() for ln in out.splitlines()[2:]]
    assert [r[:2] for r in rows] == [["1", "created"], ["2", "modified"], ["3", "deleted"]]
    assert out.splitlines()[1].split()[6:8] == ["MODE", "MTIME"]
    assert all("0644" in r and "-" in r for r in rows)  # default mode, no explicit mtime
    assert all("ws:dev" in " ".join(r) or "admin:" in " ".join(r) for r in rows)
    assert [r[-1] for r in rows] == ["notes/a.md"] * 3  # every row names the path it had then

    p = run(["show", "default", "notes/a.md", "--version", "2"])
    assert p.returncode == 0, p.stderr
    assert p.stdout == v2.encode("utf-8")  # exactly, no added newline
    p = run(["show", "default", "notes/a.md"])
    assert p.returncode == 1 and b"deleted" in p.stderr
    assert_one_line_error(p.stderr)

    p = run(["restore", "default", "notes/a.md", "--version", "2"])
    assert p.returncode == 0, p.stderr
    assert b"now version 4" in p.stdout
    p = run(["show", "default", "notes/a.md"])
    assert p.returncode == 0 and p.stdout == v2.encode("utf-8")
    p = run(["show", "default", "notes/a.md", "--version", "1"])
    assert p.stdout == b"first\n"

    p = run(["redact", "default", "notes/a.md", "--version", "1"])
    assert p.returncode == 0, p.stderr
    p = run(["show", "default", "notes/a.md", "--version", "1"])
    assert p.returncode == 1 and b"redacted" in p.stderr

    p = run(["context", "--workspace", "dev"])
    assert p.returncode == 0 and b"the note" in p.stdout

    p = run(["history", "default", "nope.md"])
    assert p.returncode == 1 and b"no record at default/nope.md" in p.stderr
    assert_one_line_error(p.stderr)
    p = run(["history", "nostore", "x.md"])
    assert p.returncode == 1
    assert_one_line_error(p.stderr)
    p = run(["restore", "default", "notes/a.md"])  # --version missing
    assert p.returncode == 2


def test_control_plane_errors_are_one_line(home, tmp_path):
    p = run(["store", "list", "--control-plane", "http://127.0.0.1:9"])
    assert p.returncode == 2 and b"no token" in p.stderr
    tf = tmp_path / "tok"
    tf.write_text("some-token\n")
    p = run(["store", "list", "--control-plane", "http://127.0.0.1:9", "--token-file", str(tf)])
    assert p.returncode == 1
    assert_one_line_error(p.stderr)
    assert b"unreachable" in p.stderr and b"some-token" not in p.stderr + p.stdout


# ---------------------------------------------------------------- dev and mount (sidecar stubbed)


def test_dev_sets_up_and_runs_sidecar_with_workspace_client(home, tmp_path, monkeypatch):
    import memfuse.sidecar.mount as mount_mod

    seen = {}

    def fake_run_mount(config, client_factory):
        seen["config"] = config

        async def use():
            async with client_factory() as api:
                seen["attachments"] = [(a.store.slug, a.access.value) for a in await api.list_attachments("dev")]
                if "actor" not in seen:
                    r = await api.create_record("default", "from-sidecar.md", "hi")
                    seen["actor"] = r.updated_by
                with pytest.raises(Exception) as ei:
                    await api.list_stores()  # workspace token, not admin
                seen["list_stores_status"] = getattr(ei.value, "status", None)

        trio.run(use)
        return 0

    monkeypatch.setattr(mount_mod, "run_mount", fake_run_mount)
    mp = tmp_path / "mnt" / "memory"
    r = invoke(["dev", str(mp)])
    assert r.exit_code == 0, r.output
    cfg = seen["config"]
    assert mp.is_dir() and cfg.mountpoint == mp.resolve()
    assert cfg.workspace == "dev" and cfg.cache_dir == home / "cache" / "dev"
    assert seen["attachments"] == [("default", "read_write")]
    import getpass
    import socket
    assert seen["actor"] == f"ws:dev/{getpass.getuser()}@{socket.gethostname()}"  # USER@HOST
    assert seen["list_stores_status"] == 403
    assert str(mp.resolve()) in r.stderr and "Ctrl-C" in r.stderr

    # idempotent: a second run works on the same database, and the record is there
    assert invoke(["dev", str(mp)]).exit_code == 0
    r = invoke(["show", "default", "from-sidecar.md"])
    assert r.exit_code == 0 and r.stdout == "hi"
    r = invoke(["store", "list"])
    assert "default memory store" in r.stdout


def test_mount_builds_config_and_client(home, tmp_path, monkeypatch):
    import memfuse.sidecar.mount as mount_mod

    seen = {}

    def fake_run_mount(config, client_factory):
        seen["config"] = config
        seen["client"] = client_factory()
        return 3

    monkeypatch.setattr(mount_mod, "run_mount", fake_run_mount)

    async def account(*args):  # the workspace's account, as the control plane would say
        return "default", {}
    import memfuse.cli.mountcache as mountcache
    monkeypatch.setattr(mountcache, "_ask", account)
    tf = tmp_path / "ws.token"
    tf.write_text("ws-token-abc\n")
    mp = tmp_path / "m"
    r = invoke(["mount", str(mp), "--control-plane", "http://cp.example:8080/", "--workspace", "team",
                "--token-file", str(tf), "--uid", "1000", "--gid", "1001", "--allow-other",
                "--commit-wait", "2.5", "--admin-listen", "", "--instance", "pod-1"],
               env={"MEMFUSE_DRAIN_TIMEOUT": "3", "MEMFUSE_FSYNC_TIMEOUT": "7"})
    assert r.exit_code == 3, r.output  # run_mount's exit code is the command's
    c = seen["config"]
    assert (c.mountpoint, c.workspace, c.uid, c.gid, c.allow_other) == (mp.resolve(), "team", 1000, 1001, True)
    assert (c.commit_wait, c.fsync_timeout, c.drain_timeout, c.admin_listen) == (2.5, 7.0, 3.0, None)
    assert c.cache_dir.parent == home / "cache" and c.cache_dir.name.startswith("team-")
    client = seen["client"]
    assert isinstance(client, ApiClient)
    assert client.base_url == "http://cp.example:8080" and client.instance == "pod-1"
    # the token file is re-read when it changes (a rotated Secret), every 5 s by default
    assert client.token_file.path == tf and client.token_file.token == "ws-token-abc"
    assert c.token_check_interval == 5.0
    trio.run(client.aclose)

    # --actor (MEMFUSE_ACTOR): a pod name from the downward API; the default names the
    # user and host, with a stable suffix from the cache directory
    r = invoke(["mount", str(mp), "--control-plane", "http://cp.example:8080/", "--workspace", "team",
                "--token-file", str(tf)], env={"MEMFUSE_ACTOR": "agent-pod-7"})
    assert r.exit_code == 3 and seen["client"].instance == "agent-pod-7", r.output
    trio.run(seen["client"].aclose)
    names = []
    for _ in range(2):  # the same name at each start
        r = invoke(["mount", str(mp), "--control-plane", "http://cp.example:8080/", "--workspace", "team",
                    "--token-file", str(tf)])
        assert r.exit_code == 3, r.output
        names.append(seen["client"].instance)
        trio.run(seen["client"].aclose)
    import getpass
    import socket
    assert names[0] == names[1] and re.fullmatch(
        re.escape(f"{getpass.getuser()}@{socket.gethostname()}") + r"\.[0-9a-f]{6}", names[0]), names

    r = invoke(["mount", str(mp), "--workspace", "team", "--token-file", str(tf)])
    assert r.exit_code == 2 and "--control-plane" in r.output
    r = invoke(["mount", str(mp), "--control-plane", "http://x", "--workspace", "team"])
    assert r.exit_code == 2 and "no token" in r.output
    r = invoke(["mount", str(mp), "--control-plane", "http://x", "--workspace", "Bad!", "--token-file", str(tf)])
    assert r.exit_code == 2


def test_status_reads_status_json(home, tmp_path):
    mp = tmp_path / "mnt"
    (mp / ".memfuse").mkdir(parents=True)
    (mp / ".memfuse" / "status.json").write_text('{"ready": true, "outbox": {"depth": 0}}')
    r = invoke(["status", str(mp), "--json"])
    assert r.exit_code == 0 and '"ready": true' in r.stdout
    r = invoke(["status", str(tmp_path / "nothing")])
    assert r.exit_code == 1 and "no memfuse mount" in r.stderr


# ---------------------------------------------------------------- memfuse serve


class Server:
    """A ``memfuse serve`` subprocess (``mountutil.serve_process``, started in ``cwd``) with
    the options ``args``; give it ``--listen 127.0.0.1:0`` and take its URL from
    ``wait_ready``. ``start`` after ``stop`` starts it again, its output appended to ``log``."""

    def __init__(self, args: list[str], log: Path, cwd: Path | None = None):
        self.args, self.log, self.cwd = args, log, cwd
        self.start()

    def start(self) -> None:
        self.offset = self.log.stat().st_size if self.log.exists() else 0  # this start's output from here
        self.proc = serve_process(self.args, self.log, cwd=self.cwd)

    def wait_ready(self, timeout: float = 60.0) -> str:
        """The URL the server listens on, once it answers ``/healthz``."""
        url = serve_listening(self.proc, self.log, self.offset, timeout=timeout)
        assert httpx.get(url + "/healthz", timeout=30).status_code == 200, self.log.read_text()
        return url

    def stop(self) -> int | None:
        """SIGTERM, SIGKILL as the last resort (``mountutil.stop``); the exit code."""
        return stop_process(self.proc)


def test_serve_subprocess_and_remote_commands(home, tmp_path):
    admin_file = tmp_path / "admin.token"
    admin_file.write_text("admin-secret-token-1\n")
    db = tmp_path / "serve.db"
    server = Server(["--db", f"sqlite:///{db}", "--listen", "127.0.0.1:0", "--admin-token-file", str(admin_file),
                     "--migrate"],
                    tmp_path / "serve.log")
    url = None
    try:
        url = server.wait_ready()
        cp = ["--control-plane", url, "--token-file", str(admin_file)]
        p = run(["store", "create", "shared", "--description", "over http", *cp])
        assert p.returncode == 0, p.stderr
        p = run(["workspace", "create", "agents", *cp])
        assert p.returncode == 0, p.stderr
        p = run(["attach", "agents", "shared", *cp])
        assert p.returncode == 0 and b"read_write" in p.stdout
        p = run(["token", "create", "--workspace", "agents", "--name", "sidecar", *cp])
        assert p.returncode == 0, p.stderr
        ws_token = p.stdout.decode().strip()
        ws_file = tmp_path / "ws.token"
        ws_file.write_text(ws_token)

        # env vars instead of flags; the raw token in MEMFUSE_TOKEN
        p = run(["store", "list"], env_extra={"MEMFUSE_CONTROL_PLANE": url, "MEMFUSE_TOKEN": "admin-secret-token-1"})
        assert p.returncode == 0 and b"over http" in p.stdout
        # the local dev database is untouched
        assert not (home / "dev.db").exists()

        async def write():
            async with ApiClient(url, ws_token, instance="remote-test") as api:
                r = await api.create_record("shared", "MEMORY.md", "- remote index\n")
                await api.update_record("shared", r.id, "- remote index v2\n", if_match=r.sha256)

        trio.run(write)
        wcp = ["--control-plane", url, "--token-file", str(ws_file)]
        p = run(["history", "shared", "MEMORY.md", *wcp])
        assert p.returncode == 0, p.stderr
        assert b"ws:agents/remote-test" in p.stdout and b"modified" in p.stdout
        p = run(["show", "shared", "MEMORY.md", "--version", "1", *wcp])
        assert p.stdout == b"- remote index\n"
        p = run(["restore", "shared", "MEMORY.md", "--version", "1", *wcp])
        assert p.returncode == 0, p.stderr
        p = run(["show", "shared", "MEMORY.md", *wcp])
        assert p.stdout == b"- remote index\n"
        p = run(["context", "--workspace", "agents", *wcp])
        assert p.returncode == 0 and b"remote index" in p.stdout and b"over http" in p.stdout
        p = run(["search", "shared", "REMOTE", *wcp])  # the workspace's token: read access
        assert (p.returncode, p.stdout) == (0, b"MEMORY.md:1:- remote index\n"), p.stderr
        p = run(["search", "shared", "nowhere", *wcp])
        assert (p.returncode, p.stdout) == (1, b"")
        p = run(["search", "nostore", "x", *wcp])
        assert p.returncode == 2 and b"404" in p.stderr
        assert_one_line_error(p.stderr)

        # a workspace token may not do admin things: one-line 403
        p = run(["store", "list", *wcp])
        assert p.returncode == 1 and b"403" in p.stderr
        assert_one_line_error(p.stderr)
        assert ws_token.encode() not in p.stderr
        for args in (["token", "list"], ["token", "revoke", "any-id"]):  # nor see tokens
            p = run([*args, *wcp])
            assert p.returncode == 1 and b"403" in p.stderr, p.stderr
        bad = tmp_path / "bad.token"
        bad.write_text("nope")
        p = run(["store", "list", "--control-plane", url, "--token-file", str(bad)])
        assert p.returncode == 1 and b"401" in p.stderr
    finally:
        rc = server.stop()
    log = server.log.read_text()
    assert rc == 0, log  # SIGTERM is a clean stop
    assert "admin-secret-token-1" not in log
    assert f"listening on {url}" in log


def test_serve_generates_admin_token(home, tmp_path):
    server = Server(["--listen", "127.0.0.1:0"], tmp_path / "serve.log")
    try:
        url = server.wait_ready()
        token_file = home / "admin.token"
        assert token_file.exists()
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert str(token_file) in server.log.read_text()
        p = run(["workspace", "create", "viaserve", "--control-plane", url, "--token-file", str(token_file)])
        assert p.returncode == 0, p.stderr
        # the default database is the dev database: local mode works on it while the server
        # process has it open, and each side sees the other's writes
        r = invoke(["workspace", "list"])
        assert r.exit_code == 0 and "viaserve" in r.stdout
        p = run(["store", "create", "vialocal"])
        assert p.returncode == 0, p.stderr
        p = run(["store", "list", "--control-plane", url, "--token-file", str(token_file)])
        assert p.returncode == 0 and b"vialocal" in p.stdout
    finally:
        server.stop()
    assert token_file.read_text().strip() not in server.log.read_text()


def test_messages_for_exception_groups():
    # trio may wrap a single failure in an ExceptionGroup: still one line, right message
    from memfuse.errors import NotFound

    @cli.command("boom-test", hidden=True)
    def boom():
        raise BaseExceptionGroup("wrapped", [NotFound("x", status=404, code="store_not_found", detail="no store 'q'")])

    try:
        r = CliRunner().invoke(cli, ["boom-test"])
        assert r.exit_code == 1 and r.stderr.strip() == "Error: no store 'q' (HTTP 404 store_not_found)"
    finally:
        cli.commands.pop("boom-test")
    assert cli_mod.ByteSize().convert("1MiB", None, None) == 1 << 20
    assert cli_mod.ByteSize().convert("2k", None, None) == 2048
    assert cli_mod.ByteSize().convert("1MB", None, None) == 1_000_000


def test_context_max_bytes_bound(tmp_path):
    """`memfuse context --max-bytes N` bounds the whole block and says what was left out."""
    import trio
    from memfuse.devenv import dev_app, ensure_dev_setup

    env = {"MEMFUSE_HOME": str(tmp_path / "home")}

    async def setup():
        app = dev_app()
        async with app.admin_client() as c:
            await ensure_dev_setup(c)
            await c.create_record("default", "MEMORY.md",
                                  "".join(f"- memory {i}: {'x' * 60}\n" for i in range(150)))
    old = os.environ.get("MEMFUSE_HOME")
    os.environ["MEMFUSE_HOME"] = env["MEMFUSE_HOME"]
    try:
        trio.run(setup)
    finally:
        if old is None:
            os.environ.pop("MEMFUSE_HOME")
        else:
            os.environ["MEMFUSE_HOME"] = old
    full = subprocess.run([MEMFUSE, "context", "--workspace", "dev"], capture_output=True,
                          text=True, env=dict(os.environ, **env), timeout=60)
    small = subprocess.run([MEMFUSE, "context", "--workspace", "dev", "--max-bytes", "2000"],
                           capture_output=True, text=True, env=dict(os.environ, **env), timeout=60)
    assert full.returncode == 0 and small.returncode == 0, small.stderr
    assert "memory 149" in full.stdout
    assert len(small.stdout.encode()) <= 2000
    assert "memory 149" not in small.stdout and "memfuse:" in small.stdout


async def _make_moved() -> None:
    async with local_client() as api:
        await ensure_dev_setup(api)
        r = await api.create_record("default", "old/name.md", "text\n")
        await api.move_record("default", r.id, "new/name.md")


def test_diff_between_versions(home):
    """`memfuse diff` prints `diff -u` between two versions (default: the last change), a
    missing last newline as diff marks it, a deleted version as empty, a redacted one as an
    error, through the real executable."""
    rid = trio.run(_make_history, "first\nsecond\u202e\x1b[31m")  # v1 created, v2 modified, v3 deleted
    assert rid
    p = run(["diff", "default", "notes/a.md", "--from", "1", "--to", "2"])
    assert p.returncode == 0, p.stderr
    assert p.stdout.decode() == ("--- default/notes/a.md@1\n+++ default/notes/a.md@2\n@@ -1 +1,2 @@\n"
                                 " first\n+second\u202e\x1b[31m\n\\ No newline at end of file\n")
    p = run(["diff", "default", "notes/a.md"])  # the last change: the delete
    assert p.returncode == 0, p.stderr
    out = p.stdout.decode()
    assert out.startswith("--- default/notes/a.md@2\n+++ default/notes/a.md@3\n") and "-first\n" in out
    p = run(["diff", "default", "notes/a.md", "--from", "0", "--to", "1"])
    assert p.returncode == 0 and p.stdout.decode() == "--- /dev/null\n+++ default/notes/a.md@1\n@@ -0,0 +1 @@\n+first\n"
    p = run(["diff", "default", "notes/a.md", "--from", "2", "--to", "2"])
    assert p.returncode == 0 and p.stdout == b""
    p = run(["diff", "default", "notes/a.md", "--to", "9"])
    assert p.returncode == 1 and p.stderr.decode().strip() == "Error: notes/a.md has no version 9"
    assert run(["redact", "default", "notes/a.md", "--version", "1"]).returncode == 0
    p = run(["diff", "default", "notes/a.md", "--from", "1", "--to", "2"])
    assert p.returncode == 1 and b"redacted" in p.stderr
    assert_one_line_error(p.stderr)
    # a move alone: the two names the record had (it printed nothing)
    async def move() -> None:
        async with local_client() as api:
            r = await api.create_record("default", "old/m.md", "same\n")
            await api.move_record("default", r.id, "new/m.md")
    trio.run(move)
    p = run(["diff", "default", "new/m.md"])
    assert p.returncode == 0 and p.stdout.decode() == "--- default/old/m.md@1\n+++ default/new/m.md@2\n", p.stdout
    # to a terminal (script(1) gives it one), what a terminal would act on is shown as
    # escapes (content is untrusted), line breaks kept
    cmd = " ".join([str(MEMFUSE), "diff", "default", "notes/a.md", "--from", "2", "--to", "3"])
    p = subprocess.run(["script", "-qec", cmd, "/dev/null"], capture_output=True, timeout=60,
                       env=dict(os.environ, TERM="dumb"))
    assert p.returncode == 0, p.stderr
    seen = p.stdout.decode().replace("\r\n", "\n")
    assert "\x1b" not in seen and "\u202e" not in seen and "\\x1b[31m" in seen and "\\u202e" in seen
    assert seen.splitlines()[:3] == ["--- default/notes/a.md@2", "+++ default/notes/a.md@3", "@@ -1,2 +0,0 @@"]


async def _make_pair(path: str, v1: str, v2: str) -> None:
    async with local_client() as api:
        await ensure_dev_setup(api)
        r = await api.create_record("default", path, v1)
        await api.update_record("default", r.id, v2, if_match=r.sha256)


def test_diff_is_bounded_in_work_as_the_consoles(home):
    """`memfuse diff` of two versions whose every other line differs (difflib's quadratic
    case; memory content is untrusted) stops at diffwork's budget with a one-line error
    (attack 14 F5: 33 s of CPU for 12,000 lines), counted in work, never timed; the same
    shape at 200 lines is diffed exactly as difflib does."""
    import difflib

    def pair(n: int) -> tuple[str, str]:
        lines = [f"line {i:05d} " + "abcdefghij" * 3 + "\n" for i in range(n)]
        return "".join(lines), "".join(("CHANGED " + ln) if i % 2 else ln for i, ln in enumerate(lines))

    big, small = pair(4000), pair(200)
    trio.run(_make_pair, "bomb/big.md", *big)
    trio.run(_make_pair, "bomb/small.md", *small)
    p = run(["diff", "default", "bomb/big.md"], timeout=120)
    assert p.returncode == 1 and p.stdout == b"", (p.returncode, p.stdout[:200])
    assert_one_line_error(p.stderr)
    assert b"too large to diff" in p.stderr
    p = run(["diff", "default", "bomb/small.md"])
    assert p.returncode == 0, p.stderr
    want = difflib.unified_diff(small[0].splitlines(keepends=True), small[1].splitlines(keepends=True),
                                "default/bomb/small.md@1", "default/bomb/small.md@2")
    assert p.stdout.decode() == "".join(want)


def test_history_shows_where_a_record_moved(home):
    trio.run(_make_moved)
    p = run(["history", "default", "new/name.md"])
    assert p.returncode == 0, p.stderr
    rows = [ln.split() for ln in p.stdout.decode().splitlines()[2:]]
    assert rows[0][1] == "created" and rows[0][-1] == "old/name.md"
    assert rows[1][1] == "moved" and rows[1][-1] == "new/name.md"
    assert len(rows) == 2
    # the move keeps the record's mtime (docs/SEMANTICS.md): the moved version shows it as
    # its explicit mtime (a date and a time) where the created one shows "-"
    assert len(rows[1]) == len(rows[0]) + 1 and rows[0][-3] == "-", rows


def test_lazy_commands_name_the_module_that_registers_each_command():
    """``memfuse`` imports a command's module only when that command runs
    (``cli.lazy_commands``): every command is in the map, under the module that defines it,
    and ``--help`` of each one works from a fresh process."""
    import importlib

    from memfuse.cli import cli

    for module in set(cli.lazy_commands.values()):
        importlib.import_module(f"memfuse.cli.{module}")
    registered = {name for name in cli.commands if name != "boom-test"}
    assert registered == set(cli.lazy_commands)
    for name, command in cli.commands.items():
        if name in cli.lazy_commands:
            assert command.callback.__module__ == f"memfuse.cli.{cli.lazy_commands[name]}", name
    script = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from memfuse.cli import cli\n"
        "for args in [['--help']] + [[name, '--help'] for name in sorted(cli.lazy_commands)]:\n"
        "    r = CliRunner().invoke(cli, args, prog_name='memfuse')\n"
        "    assert r.exit_code == 0 and 'Usage: memfuse' in r.output, (args, r.output)\n"
        "    if args == ['--help']:\n"
        "        assert all(f'  {n} ' in r.output for n in cli.lazy_commands), r.output\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_serve_sigint_leaves_no_wal(home, tmp_path):
    """A clean stop (Ctrl-C) closes every database connection: SQLite checkpoints its WAL into
    the file and removes -wal and -shm, so a copy of the .db alone holds every write."""
    import shutil
    import sqlite3

    admin_file = tmp_path / "admin.token"
    admin_file.write_text("admin-secret-token-wal\n")
    db = tmp_path / "cp.db"
    server = Server(["--db", f"sqlite:///{db}", "--listen", "127.0.0.1:0",
                     "--admin-token-file", str(admin_file), "--migrate"], tmp_path / "serve.log")
    try:
        url = server.wait_ready()

        async def write():
            async with ApiClient(url, "admin-secret-token-wal") as api:
                await api.create_workspace("walws")
                await api.create_record("walws", "MEMORY.md", "- kept\n")

        trio.run(write)
        assert Path(f"{db}-wal").exists()  # the writes are in the WAL while it serves
        server.proc.send_signal(signal.SIGINT)
        rc = server.proc.wait(timeout=30)
    finally:
        server.stop()
    log = server.log.read_text()
    assert rc == 0, log
    assert "memfuse serve: stopped" in log
    assert not Path(f"{db}-wal").exists(), log
    assert not Path(f"{db}-shm").exists(), log
    copy = tmp_path / "copy" / "cp.db"
    copy.parent.mkdir()
    shutil.copyfile(db, copy)  # the .db alone
    with sqlite3.connect(copy) as conn:
        assert conn.execute("select name from workspaces").fetchall() == [("walws",)]
        assert conn.execute("select content from records where path='MEMORY.md'").fetchall() == [("- kept\n",)]


def test_sqlite_database_private_and_directory_created(home, tmp_path):
    """A new SQLite database is 0600 in a directory created 0700 (it holds memory content and
    token hashes), whatever the umask; SQLite's -wal and -shm take the database's mode."""
    from memfuse.server.db import Database, WorkspaceRow

    old = os.umask(0o022)
    try:
        db = tmp_path / "var" / "lib" / "memfuse" / "cp.db"
        r = invoke(["db", "upgrade", "--db", f"sqlite:///{db}"])
        assert r.exit_code == 0, r.output
        assert stat.S_IMODE(db.stat().st_mode) == 0o600
        assert stat.S_IMODE(db.parent.stat().st_mode) == 0o700
        database = Database(f"sqlite:///{db}", schema="check")
        try:
            with database.write() as s:
                s.add(WorkspaceRow(name="private"))
            for suffix in ("-wal", "-shm"):
                assert stat.S_IMODE(Path(f"{db}{suffix}").stat().st_mode) == 0o600, suffix
        finally:
            database.dispose()
        # an existing file is made owner-only (group / other bits cleared), its directory kept
        os.chmod(db, 0o640)
        os.chmod(db.parent, 0o755)
        assert invoke(["db", "upgrade", "--db", f"sqlite:///{db}"]).exit_code == 0
        assert stat.S_IMODE(db.stat().st_mode) == 0o600
        assert stat.S_IMODE(db.parent.stat().st_mode) == 0o755
    finally:
        os.umask(old)


def test_existing_wide_database_and_data_dir_are_tightened(tmp_path, monkeypatch, caplog):
    """A dev.db (and its -wal / -shm) left 0644 by an older release, in a data directory left
    0755, are made 0600 / 0700 when the dev environment opens them, with one log line naming
    the paths (no content); files of another user and symlinks are left alone."""
    import logging
    import sqlite3

    from memfuse.devenv import data_dir, dev_db_path
    from memfuse.server.db import Database

    for k in list(os.environ):
        if k.startswith("MEMFUSE_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))  # platformdirs' default data dir
    old = os.umask(0o022)
    try:
        home = tmp_path / "xdg" / "memfuse"
        home.mkdir(parents=True, mode=0o755)
        db = home / "dev.db"
        with sqlite3.connect(db) as conn:  # as an older release made it
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("CREATE TABLE t (x)")
            keep = sqlite3.connect(db)  # keeps -wal and -shm in place
            keep.execute("SELECT * FROM t").fetchall()
        for p in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
            os.chmod(p, 0o644)
        other = tmp_path / "xdg" / "other.db"
        other.write_bytes(b"")
        os.chmod(other, 0o644)
        link = tmp_path / "xdg" / "linked.db"
        link.symlink_to(other)
        caplog.set_level(logging.INFO, logger="memfuse.privfile")

        assert data_dir() == home and dev_db_path() == db
        assert stat.S_IMODE(home.stat().st_mode) == 0o700
        Database(f"sqlite:///{db}", schema="none").dispose()
        for p in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
            assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
        lines = [r for r in caplog.records if r.name == "memfuse.privfile"]
        assert [r.levelname for r in lines] == ["INFO", "INFO"], [r.getMessage() for r in lines]
        assert lines[0].paths == [str(home)] and lines[0].old_modes == ["0755"]
        assert sorted(lines[1].paths) == sorted(str(p) for p in (db, f"{db}-wal", f"{db}-shm"))
        caplog.clear()
        data_dir()
        Database(f"sqlite:///{db}", schema="none").dispose()
        assert [r for r in caplog.records if r.name == "memfuse.privfile"] == []  # once: nothing left to do

        # a symlink is not followed; a file of another user is not touched
        from memfuse.privfile import tighten

        assert tighten(link) is None and stat.S_IMODE(other.stat().st_mode) == 0o644
        if os.geteuid() == 0:
            os.chown(other, 65534, 65534)
            assert tighten(other) is None and stat.S_IMODE(other.stat().st_mode) == 0o644
        assert tighten(tmp_path / "missing") is None
        keep.close()
    finally:
        os.umask(old)


def test_sqlite_directory_that_cannot_be_made_fails_fast(home, tmp_path):
    (tmp_path / "afile").write_text("in the way\n")
    url = f"sqlite:///{tmp_path}/afile/memfuse/cp.db"
    for args in (["db", "upgrade", "--db", url], ["serve", "--db", url, "--listen", "127.0.0.1:0"]):
        start = time.monotonic()
        p = run(args, timeout=30)
        took = time.monotonic() - start
        assert p.returncode == 1, p.stderr
        assert_one_line_error(p.stderr)
        assert f"cannot create the directory {tmp_path}/afile/memfuse" in p.stderr.decode(), p.stderr
        assert took < 10, took  # no retries (a start of the CLI takes a few seconds under load)


def test_readme_deployment_block_on_a_fresh_machine(home, tmp_path):
    """The README's deployment block as written: the database directory does not exist, nor
    does admin.token; `token create --out` writes the workspace token 0600."""
    db = f"sqlite:///{tmp_path}/var/lib/memfuse/cp.db"
    work = tmp_path / "work"
    work.mkdir()
    p = subprocess.run([str(MEMFUSE), "db", "upgrade", "--db", db], cwd=work, capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr
    log = tmp_path / "serve.log"
    server = Server(["--db", db, "--listen", "127.0.0.1:0", "--admin-token-file", "admin.token"], log, cwd=work)
    try:
        url = server.wait_ready()
        admin = work / "admin.token"
        assert stat.S_IMODE(admin.stat().st_mode) == 0o600
        assert "admin token written to admin.token" in log.read_text()
        cp = ["--control-plane", url, "--token-file", "admin.token"]

        def cli_run(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([str(MEMFUSE), *args], cwd=work, capture_output=True, timeout=60)

        for args in (["workspace", "create", "agent-1"], ["store", "create", "team"],
                     ["attach", "agent-1", "team", "--read-only"]):
            p = cli_run(*args, *cp)
            assert p.returncode == 0, p.stderr
        p = cli_run("token", "create", "--workspace", "agent-1", "--out", "ws.token", *cp)
        assert p.returncode == 0, p.stderr
        assert p.stdout == b"" and b"written to ws.token" in p.stderr
        ws = work / "ws.token"
        assert stat.S_IMODE(ws.stat().st_mode) == 0o600
        p = cli_run("context", "--workspace", "agent-1", "--control-plane", url, "--token-file", "ws.token")
        assert p.returncode == 0 and b"team" in p.stdout, p.stderr
    finally:
        rc = server.stop()
    assert rc == 0, log.read_text()
    # restarted with the same file: the token is read, not replaced
    token = (work / "admin.token").read_text()
    server.start()
    try:
        server.wait_ready()
        assert "admin token read from admin.token" in log.read_bytes()[server.offset:].decode()
    finally:
        server.stop()
    assert (work / "admin.token").read_text() == token


def test_dev_mcp_config_carries_memfuse_home(home, monkeypatch, tmp_path):
    """The stdio MCP config `memfuse dev` prints opens the same database as `memfuse dev`: with
    MEMFUSE_HOME set it carries it (absolute), since a desktop app starts it elsewhere."""
    import re

    from memfuse.devenv import agent_tools_hint

    def stdio() -> dict:
        line = agent_tools_hint("/opt/bin/memfuse", None)
        found = re.search(r"MCP on stdio \(desktop app config\): (\{.*\})", line)
        assert found, line
        return json.loads(found.group(1))["mcpServers"]["memfuse"]

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MEMFUSE_HOME", "rel-home")
    assert stdio() == {"command": "/opt/bin/memfuse", "args": ["mcp", "--workspace", "dev"],
                       "env": {"MEMFUSE_HOME": str(tmp_path / "rel-home")}}
    monkeypatch.delenv("MEMFUSE_HOME")
    assert "env" not in stdio()


def test_token_revoke_by_unique_prefix(home):
    from memfuse.server.db import Database, TokenRow

    r = invoke(["token", "create", "--name", "one"])
    assert r.exit_code == 0, r.output
    r = invoke(["token", "list", "--json"])
    (one,) = [t["id"] for t in json.loads(r.stdout) if t["name"] == "one"]
    database = Database(f"sqlite:///{dev_db_path()}")
    try:
        with database.write() as s:  # two ids sharing a prefix
            for i, tid in enumerate(("abcd0000-0000-4000-8000-000000000001", "abcd1111-0000-4000-8000-000000000002")):
                s.add(TokenRow(id=tid, token_sha256=f"{i:064x}", workspace=None, name=f"twin{i}"))
    finally:
        database.dispose()
    prefix = one[:8] if not one.startswith("abcd") else one[:9]
    r = CliRunner().invoke(cli, ["token", "revoke", prefix])
    assert r.exit_code == 0 and f"revoked token {one}" in r.stdout, r.output
    r = CliRunner().invoke(cli, ["token", "revoke", "abcd"])  # ambiguous: nothing revoked
    assert r.exit_code == 1 and "ambiguous" in r.stderr and "abcd0000" in r.stderr, r.output
    r = CliRunner().invoke(cli, ["token", "revoke", "ffffeeee"])
    assert r.exit_code == 1 and "no token id starts with ffffeeee" in r.stderr, r.output
    r = CliRunner().invoke(cli, ["token", "revoke", "abc"])
    assert r.exit_code != 0 and "too short" in r.stderr, r.output
    r = CliRunner().invoke(cli, ["token", "revoke", "abcd1"])
    assert r.exit_code == 0 and "revoked token abcd1111-0000-4000-8000-000000000002" in r.stdout, r.output
    states = {t["id"]: t["state"] for t in json.loads(invoke(["token", "list", "--all", "--json"]).stdout)}
    assert states[one] == "revoked" and states["abcd1111-0000-4000-8000-000000000002"] == "revoked"
    assert states["abcd0000-0000-4000-8000-000000000001"] == "active"


# ---------------------------------------------------------------- search

SEARCH_TEXT = "Ich mag Äpfel\nund BIRNEN\n\x1b]0;pwned\x07\x1b[31mrot\x1b[0m äpfel \u202egnirts\r\nlast line\n"


async def _make_search() -> None:
    async with local_client() as api:
        await ensure_dev_setup(api)
        await api.create_record("default", "notes/fruit.md", SEARCH_TEXT, type="user")
        await api.create_record("default", "notes/äpfel-liste.md", "nothing here\n")
        await api.create_record("default", "other/pfel.md", "- apfel ÄPFEL\n" * 3)
        await api.create_record("default", "many.md", "".join(f"äpfel {i}\n" for i in range(150)))


def test_search_like_grep(home):
    """``memfuse search`` prints PATH:LINE:TEXT in path order, case-insensitively in Unicode,
    exit 0 / 1 / 2 like grep; piped output is the stored text, exactly."""
    trio.run(_make_search)
    p = run(["search", "default", "ÄPFEL", "--path-prefix", "notes"])
    assert p.returncode == 0, p.stderr
    assert p.stdout.decode() == (
        "notes/fruit.md:1:Ich mag Äpfel\n"
        "notes/fruit.md:3:\x1b]0;pwned\x07\x1b[31mrot\x1b[0m äpfel \u202egnirts\r\n")  # piped: as stored
    p = run(["search", "default", "äpfel", "--match", "any", "--path-prefix", "notes"])
    assert p.stdout.decode().splitlines()[-1] == "notes/äpfel-liste.md"  # a path-only hit: bare path
    p = run(["search", "default", "äpfel", "-l"])
    assert p.stdout.decode().splitlines() == ["many.md", "notes/fruit.md", "other/pfel.md"]
    p = run(["search", "default", "äpfel", "-l", "--limit", "2"])
    assert p.stdout.decode().splitlines() == ["many.md", "notes/fruit.md"]
    p = run(["search", "default", "Äpfel", "--case-sensitive"])
    assert p.stdout.decode() == "notes/fruit.md:1:Ich mag Äpfel\n"
    p = run(["search", "default", "birnen", "--type", "user"])
    assert p.stdout.decode() == "notes/fruit.md:2:und BIRNEN\n"
    p = run(["search", "default", "birnen", "--type", "project"])
    assert (p.returncode, p.stdout) == (1, b"")
    # every matching line up to the API's 100 per record, the rest said on stderr
    p = run(["search", "default", "äpfel", "--path-prefix", "many.md"])
    lines = p.stdout.decode().splitlines()
    assert len(lines) == 100 and lines[0] == "many.md:1:äpfel 0" and lines[-1] == "many.md:100:äpfel 99"
    assert b"many.md: 50 more matching lines not shown" in p.stderr

    p = run(["search", "default", "no such text"])
    assert (p.returncode, p.stdout, p.stderr) == (1, b"", b"")
    p = run(["search", "nostore", "x"])
    assert p.returncode == 2 and b"no store" in p.stderr
    assert_one_line_error(p.stderr)
    p = run(["search", "default", "a\tb"])  # a control character in the query: 422, exit 2
    assert p.returncode == 2 and b"invalid_query" in p.stderr
    p = run(["search", "default"])  # usage
    assert p.returncode == 2 and b"QUERY" in p.stderr


def test_search_on_a_terminal_escapes_control_characters(home):
    """On a terminal no escape sequence or bidi control of memory content reaches it raw:
    ESC, BEL, C1 and U+202E show as \\xNN / \\uNNNN; a CRLF line end is dropped."""
    import pty

    trio.run(_make_search)
    pid, fd = pty.fork()
    if pid == 0:  # child: stdout is the pty
        try:
            os.execv(str(MEMFUSE), [str(MEMFUSE), "search", "default", "rot"])
        finally:
            os._exit(127)
    out = b""
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # EIO: the child closed the pty
                break
            if not chunk:
                break
            out += chunk
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0, out
    text = out.decode().replace("\r\n", "\n")  # the pty's own line discipline
    assert text == "notes/fruit.md:3:\\x1b]0;pwned\\x07\\x1b[31mrot\\x1b[0m äpfel \\u202egnirts\n", text
    assert b"\x1b" not in out and "\u202e".encode() not in out


def test_terminal_safe():
    from memfuse.cli.common import terminal_safe

    assert terminal_safe("tab\tok é ü 東京 \\x41") == "tab\tok é ü 東京 \\x41"
    assert terminal_safe("\x00\x1b\x7f\x85\x9b\u061c\u200f\u2066") == "\\x00\\x1b\\x7f\\x85\\x9b\\u061c\\u200f\\u2066"
