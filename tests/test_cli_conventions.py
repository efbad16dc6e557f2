"""What every `memfuse` command shares, checked across the whole command tree and with the
real executable: each option's environment variable, a quiet exit into a closed pipe; and
`attach --read-write`, `serve` leaving nothing behind when it cannot start (local mode,
MEMFUSE_HOME in a tmp dir)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import click
import pytest
import trio
from click.testing import CliRunner

from memfuse.cli import cli
from memfuse.cli.common import EXIT_BROKEN_PIPE, envvar_for
from memfuse.devenv import ensure_dev_setup, local_client

MEMFUSE = Path(sys.executable).with_name("memfuse")
DOCS = Path(__file__).resolve().parents[1] / "docs" / "CLI.md"

#: (command path, option) → why it reads no environment variable; docs/CLI.md lists each
NO_ENVVAR = {
    ((), "--version"): "the release: MEMFUSE_VERSION often names the release to install",
    (("show",), "--version"): "the record version acted on is an operand, like STORE and PATH",
    (("restore",), "--version"): "as show --version",
    (("redact",), "--version"): "as show --version: redact destroys that version's content",
    (("diff",), "--from"): "as show --version",
    (("diff",), "--to"): "as show --version",
    (("diff",), "--unified"): "how much context one diff shows, not a setting",
}


def invoke(args: list[str], env: dict[str, str] | None = None):
    return CliRunner().invoke(cli, args, env=env, catch_exceptions=False)


def walk(cmd: click.Command, ctx: click.Context, path: tuple[str, ...] = ()):
    """(command path, command, its context) for ``cmd`` and every command under it."""
    yield path, cmd, ctx
    if isinstance(cmd, click.Group):
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            yield from walk(sub, click.Context(sub, parent=ctx, info_name=name), (*path, name))


# ---------------------------------------------------------------- environment variables


def test_every_option_reads_memfuse_and_its_flag_name(monkeypatch):
    """Each option of each command reads exactly MEMFUSE_<FLAG> (click's own resolution,
    with the root's context settings), never click's automatic MEMFUSE_<COMMAND>_<PARAM>;
    the exceptions read nothing and are documented."""
    for k in list(os.environ):
        if k.startswith("MEMFUSE_"):
            monkeypatch.delenv(k)
    root = click.Context(cli, info_name="memfuse", **cli.context_settings)
    seen = 0
    docs = DOCS.read_text(encoding="utf-8")
    for path, cmd, ctx in walk(cli, root):
        for param in cmd.get_params(ctx):
            if not isinstance(param, click.Option):
                continue
            long = next(o for o in param.opts if o.startswith("--"))
            auto = "_".join(["MEMFUSE", *path, param.name or ""]).upper().replace("-", "_")
            expected = envvar_for(*param.opts)
            is_help = param is cmd.get_help_option(ctx)
            if is_help or (path, long) in NO_ENVVAR:
                with monkeypatch.context() as m:
                    for name in {auto, expected, "MEMFUSE_HELP"}:
                        m.setenv(name, "1")
                    assert param.resolve_envvar_value(ctx) is None, (path, long)
                if not is_help:
                    assert f"`{' '.join(('memfuse', *path, long))}`" in docs, (path, long)
                continue
            assert param.envvar == expected, (path, long, param.envvar)
            with monkeypatch.context() as m:
                m.setenv(expected, "x")
                assert param.resolve_envvar_value(ctx) == "x", (path, long)
            if auto != expected:
                with monkeypatch.context() as m:
                    m.setenv(auto, "x")
                    assert param.resolve_envvar_value(ctx) is None, (path, long, auto)
            seen += 1
    assert seen > 80  # the whole tree was walked (lazy commands too)


def test_version_variables_do_not_steer_commands(home):
    async def setup():
        async with local_client() as api:
            await ensure_dev_setup(api)
            r = await api.create_record("default", "a.md", "v1\n")
            await api.update_record("default", r.id, "v2\n")

    trio.run(setup)
    # once, MEMFUSE_VERSION made every command print the release and do nothing
    r = invoke(["workspace", "list"], env={"MEMFUSE_VERSION": "1.2.3"})
    assert r.exit_code == 0 and "dev" in r.stdout and "version" not in r.stdout
    r = invoke(["show", "default", "a.md"], env={"MEMFUSE_VERSION": "1", "MEMFUSE_SHOW_VERSION_N": "1"})
    assert r.exit_code == 0 and r.stdout == "v2\n"
    r = invoke(["redact", "default", "a.md"], env={"MEMFUSE_VERSION": "1", "MEMFUSE_REDACT_VERSION_N": "1"})
    assert r.exit_code == 2 and "--version" in r.stderr
    assert invoke(["--version"]).stdout.startswith("memfuse, version ")


# ---------------------------------------------------------------- closed pipe


def test_output_into_a_closed_pipe_ends_quietly_with_141(home):
    lines = "".join(f"line {i}: {'x' * 20}\n" for i in range(30000))  # ~900 KB: more than a pipe holds

    async def setup():
        async with local_client() as api:
            await ensure_dev_setup(api)
            r = await api.create_record("default", "big.md", lines)
            for i in range(3):
                r = await api.update_record("default", r.id, lines + f"v{i + 2}\n")

    trio.run(setup)
    env = dict(os.environ)
    script = (f"set -o pipefail; {MEMFUSE} show default big.md | head -1; echo status=$?; "
              f"{MEMFUSE} history default big.md | head -1; echo status=$?")
    p = subprocess.run(["bash", "-c", script], env=env, capture_output=True, timeout=120, text=True)
    assert p.stderr == ""  # no "Error: BrokenPipeError", no "Exception ignored"
    out = p.stdout.splitlines()
    assert out[0] == "line 0: " + "x" * 20
    assert out[1] == f"status={EXIT_BROKEN_PIPE}"  # as `git log | head -1` or `seq 1e6 | head -1`
    # history writes two lines' worth of output: whether head has left before the second write
    # is up to the scheduler; either way quietly, with 141 or 0
    assert out[2].startswith("record ") and out[3] in (f"status={EXIT_BROKEN_PIPE}", "status=0")
    # the same output into a pipe that stays open: everything, status 0
    p = subprocess.run([str(MEMFUSE), "show", "default", "big.md"], env=env, capture_output=True, timeout=120)
    assert p.returncode == 0 and p.stdout == (lines + "v4\n").encode()


# ---------------------------------------------------------------- attach access


def test_attach_read_write_undoes_read_only_and_says_the_access(home):
    assert invoke(["workspace", "create", "w"]).exit_code == 0
    assert invoke(["store", "create", "notes"]).exit_code == 0

    r = invoke(["attach", "w", "notes", "--read-only", "--instructions", "read first"])
    assert r.exit_code == 0 and r.stdout == "attached notes to w (read_only)\n"
    r = invoke(["attach", "w", "notes", "--read-write"])
    assert r.exit_code == 0 and r.stdout == "attached notes to w (read_write, was read_only)\n"
    r = invoke(["attach", "w", "notes", "--read-write"])
    assert r.stdout == "attached notes to w (read_write, unchanged)\n"
    r = invoke(["attach", "w", "notes", "--read-only"])
    assert r.stdout == "attached notes to w (read_only, was read_write)\n"
    r = invoke(["attach", "w", "notes"])  # the default stays read-write
    assert r.stdout == "attached notes to w (read_write, was read_only)\n"

    async def attachment():
        async with local_client() as api:
            return next(a for a in await api.list_attachments("w") if a.store.slug == "notes")

    # changing the access keeps the instructions; --instructions "" clears them
    assert trio.run(attachment).instructions == "read first"
    assert invoke(["attach", "w", "notes", "--instructions", ""]).exit_code == 0
    assert trio.run(attachment).instructions == ""

    r = invoke(["attach", "w", "notes", "--read-only", "--read-write"])
    assert r.exit_code == 2 and "--read-only and --read-write exclude each other" in r.stderr
    # a flag given wins over the other's environment variable; both from the environment clash
    r = invoke(["attach", "w", "notes", "--read-write"], env={"MEMFUSE_READ_ONLY": "1"})
    assert r.exit_code == 0 and "(read_write" in r.stdout
    r = invoke(["attach", "w", "notes"], env={"MEMFUSE_READ_ONLY": "1", "MEMFUSE_READ_WRITE": "1"})
    assert r.exit_code == 2
    r = invoke(["attach", "w", "notes"], env={"MEMFUSE_READ_ONLY": "1"})
    assert r.stdout == "attached notes to w (read_only, was read_write)\n"
    r = invoke(["attach", "--help"])
    assert "--read-write" in r.stdout and "MEMFUSE_READ_WRITE" in r.stdout


# ---------------------------------------------------------------- serve that cannot start


def _tree(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


def _serve(args: list[str], cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([str(MEMFUSE), "serve", *args], cwd=cwd, env=dict(os.environ), capture_output=True,
                          timeout=timeout, text=True)


def test_serve_that_cannot_start_leaves_no_files(home, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    # a database without the schema: the clear message, and no admin token, data dir, SQLite
    # file or directory left behind
    p = _serve(["--db", f"sqlite:///{work}/var/cp.db", "--listen", "127.0.0.1:0"], work)
    assert p.returncode == 1 and "run `memfuse db upgrade --db URL` first" in p.stderr, p.stderr
    assert _tree(work) == set() and not home.exists()
    # what was there before stays as it was: an empty database file, a token file
    (work / "empty.db").write_bytes(b"")
    home.mkdir()
    (home / "admin.token").write_text("mfa_mine\n")
    p = _serve(["--db", f"sqlite:///{work}/empty.db", "--listen", "127.0.0.1:0"], work)
    assert p.returncode == 1 and "is empty (no memfuse schema)" in p.stderr
    assert _tree(work) == {"empty.db"} and _tree(home) == {"admin.token"}
    assert (home / "admin.token").read_text() == "mfa_mine\n"
    (home / "admin.token").unlink()
    home.rmdir()
    # a port in use: the dev database it made and the admin token are removed again
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = _serve(["--listen", f"127.0.0.1:{port}"], work)
    assert p.returncode == 1 and f"Error: cannot listen on 127.0.0.1:{port}: Address already in use" in p.stderr, \
        p.stderr
    assert "admin token written" not in p.stderr
    assert not home.exists() and _tree(work) == {"empty.db"}
