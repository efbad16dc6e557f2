"""What every `memfuse` command shares, checked across the whole command tree and with the
real executable: each option's environment variable, a quiet exit into a closed pipe; and
`attach --read-write`, `serve` leaving nothing behind when it cannot start (local mode,
MEMFUSE_HOME in a tmp dir)."""
from __future__ import annotations

import os
import re
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

#: (command path, option) → its own variable MEMFUSE_<COMMAND>_<FLAG>, where MEMFUSE_<FLAG> means
#: something else to other commands (one name, one type, one meaning); docs/CLI.md lists each
OWN_ENVVAR = {
    (("mount",), "--admin-socket"): "MEMFUSE_MOUNT_ADMIN_SOCKET",  # a switch; MEMFUSE_ADMIN_SOCKET: a path
    (("context",), "--max-bytes"): "MEMFUSE_CONTEXT_MAX_BYTES",  # the block's bound; MEMFUSE_MAX_BYTES: a quota
    (("consolidate",), "--instructions"): "MEMFUSE_CONSOLIDATE_INSTRUCTIONS",  # to the model; not attach's
    # the sidecar's admin token: MEMFUSE_ADMIN_TOKEN_FILE is serve's (the platform's admin token)
    (("mount",), "--admin-token-file"): "MEMFUSE_SIDECAR_ADMIN_TOKEN_FILE",
    (("status",), "--admin-token-file"): "MEMFUSE_SIDECAR_ADMIN_TOKEN_FILE",
    (("mounts", "add"), "--admin-token-file"): "MEMFUSE_SIDECAR_ADMIN_TOKEN_FILE",
    (("mounts", "remove"), "--admin-token-file"): "MEMFUSE_SIDECAR_ADMIN_TOKEN_FILE",
}

#: every variable that more than one command reads → what it means to all of them (their
#: types are checked to agree): a new sharing is declared here, after checking the meaning
SHARED_MEANING = {
    "MEMFUSE_CONTROL_PLANE": "the control plane's URL",
    "MEMFUSE_TOKEN_FILE": "the file holding the API token",
    "MEMFUSE_JSON": "print JSON",
    "MEMFUSE_DEBUG": "verbose logging",
    "MEMFUSE_LOG_FORMAT": "the log line format (json or text)",
    "MEMFUSE_WORKSPACE": "the workspace acted on",
    "MEMFUSE_ACCOUNT": "the account acted on",
    "MEMFUSE_DB": "the database URL",
    "MEMFUSE_MOUNTPOINT": "the mount's directory",
    "MEMFUSE_ACTOR": "who writes through the mount",
    "MEMFUSE_ADMIN_LISTEN": "the sidecar's admin HTTP address",
    "MEMFUSE_ADMIN": "the sidecar's admin API URL",
    "MEMFUSE_ADMIN_SOCKET": "the sidecar's admin Unix socket path",
    "MEMFUSE_SIDECAR_ADMIN_TOKEN_FILE": "the bearer token file of the sidecar's admin API the command serves or asks",
    "MEMFUSE_CACHE_DIR": "the sidecar's cache directory",
    "MEMFUSE_DRAIN_TIMEOUT": "seconds to finish pending work on SIGTERM/SIGINT or the end of input",
    "MEMFUSE_READ_ONLY": "attach read-only",
    "MEMFUSE_MAX_STORES": "an account's quota of stores",
    "MEMFUSE_MAX_BYTES": "an account's quota of live bytes",
    "MEMFUSE_MAX_TOKENS": "an account's quota of active tokens",
    "MEMFUSE_DESCRIPTION": "a store's description",
    "MEMFUSE_DEFAULT_TYPE": "a store's default record type",
    "MEMFUSE_MAX_RECORD_BYTES": "a store's record size limit",
    "MEMFUSE_MAX_STORE_BYTES": "a store's size limit",
    "MEMFUSE_MAX_RECORDS": "a store's record count limit",
    "MEMFUSE_MAX_HISTORY_BYTES": "a store's history budget in bytes",
    "MEMFUSE_MAX_HISTORY_VERSIONS": "a store's history budget in versions",
    "MEMFUSE_HISTORY_MIN_AGE": "a store's history budget's minimum age",
}

#: values each parameter type sharing a variable must treat alike (the same value, or refused)
PROBES = ["0", "1", "-1", "0.05", "2.5", "1024", "nan", "inf", "30m", "10M", "unlimited", "true", "false",
          "json", "text", "x", "/nonexistent-memfuse-probe/admin.sock", ""]


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
            expected = OWN_ENVVAR.get((path, long), expected)
            assert param.envvar == expected, (path, long, param.envvar)
            if expected != envvar_for(*param.opts):  # its own name: MEMFUSE_<FLAG> is not read
                with monkeypatch.context() as m:
                    m.setenv(envvar_for(*param.opts), "x")
                    assert param.resolve_envvar_value(ctx) is None, (path, long)
                assert f"`{expected}`" in docs, expected
            with monkeypatch.context() as m:
                m.setenv(expected, "x")
                assert param.resolve_envvar_value(ctx) == "x", (path, long)
            if auto != expected:
                with monkeypatch.context() as m:
                    m.setenv(auto, "x")
                    assert param.resolve_envvar_value(ctx) is None, (path, long, auto)
            seen += 1
    assert seen > 80  # the whole tree was walked (lazy commands too)


def _probe(param: click.Parameter, ctx: click.Context) -> list[object]:
    """What ``param``'s type makes of each of :data:`PROBES` (its value, or ``refused``)."""
    out: list[object] = []
    for v in PROBES:
        try:
            out.append(param.type.convert(v, param, ctx))
        except Exception:  # noqa: BLE001 — refused, however the type says it
            out.append("refused")
    return out


def test_every_variable_has_one_type_and_one_meaning(monkeypatch):
    """A variable read by more than one command means one thing to all of them: it is
    declared in SHARED_MEANING, and every option or argument reading it has a type that
    converts every probe alike (attack26 F5: MEMFUSE_ADMIN_SOCKET was a
    path to `status` and a boolean to `mount`; MEMFUSE_MAX_BYTES a size, a quota and an int)."""
    for k in list(os.environ):
        if k.startswith("MEMFUSE_"):
            monkeypatch.delenv(k)
    root = click.Context(cli, info_name="memfuse", **cli.context_settings)
    readers: dict[str, list[tuple[tuple[str, ...], click.Parameter, click.Context]]] = {}
    for path, cmd, ctx in walk(cli, root):
        for param in cmd.get_params(ctx):
            names = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or [])
            for name in names:
                readers.setdefault(name, []).append((path, param, ctx))
    shared = {name for name, rs in readers.items() if len({p for p, _, _ in rs}) > 1}
    assert shared == set(SHARED_MEANING), (shared - set(SHARED_MEANING), set(SHARED_MEANING) - shared)
    for name in shared:
        (path0, first, ctx0), *rest = readers[name]
        want = (isinstance(first, click.Option) and first.is_flag, first.multiple, first.nargs, _probe(first, ctx0))
        for path, param, ctx in rest:
            got = (isinstance(param, click.Option) and param.is_flag, param.multiple, param.nargs, _probe(param, ctx))
            assert got == want, (name, path0, path, want, got)


def _duration_options():
    """(command path, option, its context) of every duration flag of the tree: a Seconds or
    Duration type, or a name or metavar that says time."""
    from memfuse.cli.admin import Duration
    from memfuse.cli.common import Seconds

    root = click.Context(cli, info_name="memfuse", **cli.context_settings)
    timely = re.compile(r"timeout|interval|wait|after|ttl|age|delay|period|seconds")
    for path, cmd, ctx in walk(cli, root):
        for param in cmd.get_params(ctx):
            if not isinstance(param, click.Option) or param.is_flag:
                continue
            long = next(o for o in param.opts if o.startswith("--"))
            if (isinstance(param.type, (Seconds, Duration)) or timely.search(long)
                    or param.metavar in {"S", "SECONDS", "DURATION", "DAYS"}):
                yield path, long, param, ctx


def test_no_option_takes_a_plain_float():
    """Every float option is a duration of one type, ``Seconds`` (attack26 F4: --commit-wait
    was a plain float and took nan, inf and -1)."""
    from memfuse.cli.common import Seconds

    root = click.Context(cli, info_name="memfuse", **cli.context_settings)
    for path, cmd, ctx in walk(cli, root):
        for param in cmd.get_params(ctx):
            assert isinstance(param.type, Seconds) or not isinstance(
                param.type, (click.types.FloatParamType, click.FloatRange)), (path, param.name)
    durations = list(_duration_options())
    assert len(durations) >= 20
    for path, long, param, _ in durations:
        assert isinstance(param.type, (Seconds, click.IntRange)) or type(param.type).__name__ == "Duration", \
            (path, long, param.type)


@pytest.mark.parametrize("value", ["nan", "-1", "inf", "-inf", "1e400", "1_000", "\u0663", "0x10"])
def test_every_duration_flag_refuses_nan_negative_and_inf(value, monkeypatch):
    """nan, -1 and inf given to any duration flag, or to its MEMFUSE_<FLAG>, are a usage error
    naming the flag (exit 2), before the command runs; only a flag meaning "forever" takes inf
    (``mount --start-timeout``)."""
    for k in list(os.environ):
        if k.startswith("MEMFUSE_"):
            monkeypatch.delenv(k)
    from memfuse.cli.common import Seconds

    for path, long, param, ctx in _duration_options():
        if value in ("1_000", "\u0663") and not isinstance(param.type, Seconds):
            continue  # a whole number of days (IntRange) reads them as int() does: 1000, 3
        forever = getattr(param.type, "forever", False) and value == "inf"
        cmd = ctx.command
        if forever:
            assert param.process_value(ctx, value) == float("inf"), (path, long)
            continue
        with pytest.raises(click.BadParameter) as err:  # the flag (parsed first: it is given first)
            cmd.make_context(path[-1], [long, value], parent=ctx.parent)
        assert f"'{long}'" in err.value.format_message(), (path, long, err.value.format_message())
        if param.envvar:
            with monkeypatch.context() as m, pytest.raises(click.BadParameter) as err:
                m.setenv(param.envvar, value)
                param.handle_parse_result(click.Context(cmd, parent=ctx.parent, info_name=path[-1]), {}, [])
            assert f"'{long}'" in err.value.format_message() and param.envvar in err.value.format_message()


def test_duration_zero_where_it_means_something():
    """0 stays: --commit-wait 0 (do not wait for the control plane), --drain-timeout 0,
    --start-timeout 0 (forever), consolidate --wait 0, the serve intervals 0 (off); a fsync
    timeout of 0 (EIO at once) is refused."""
    mount = cli.get_command(click.Context(cli), "mount")
    base = ["/nonexistent-memfuse-probe", "--control-plane", "http://127.0.0.1:9", "--workspace", "w"]
    params = mount.make_context("mount", [*base, "--commit-wait", "0", "--drain-timeout", "0", "--offline-after", "0",
                                          "--start-timeout", "0"]).params
    assert (params["commit_wait"], params["drain_timeout"], params["offline_after"], params["start_timeout"]) == (0, 0, 0, 0)
    with pytest.raises(click.BadParameter) as err:
        mount.make_context("mount", [*base, "--fsync-timeout", "0"])
    assert "'--fsync-timeout'" in err.value.format_message()
    with pytest.raises(click.BadParameter) as err:  # from the environment too
        _make_with_env(mount, base, {"MEMFUSE_COMMIT_WAIT": "nan"})
    assert "'--commit-wait' (env var: 'MEMFUSE_COMMIT_WAIT')" in err.value.format_message()


def _make_with_env(cmd: click.Command, args: list[str], env: dict[str, str]) -> click.Context:
    """``cmd.make_context`` (parse only: nothing runs) with ``env`` in the environment."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return cmd.make_context(cmd.name or "", list(args))  # (click consumes the list)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_admin_socket_variable_is_a_path_and_mount_has_its_own(monkeypatch, capsys):
    """MEMFUSE_ADMIN_SOCKET is the socket's path (status, mounts); mount's switch reads
    MEMFUSE_MOUNT_ADMIN_SOCKET, and an old boolean word in MEMFUSE_ADMIN_SOCKET with a notice
    (attack26 F5: MEMFUSE_ADMIN_SOCKET=/x/admin.sock memfuse mount exited "not a valid boolean")."""
    from memfuse.cli.run import _old_admin_socket_switch

    for k in list(os.environ):
        if k.startswith("MEMFUSE_"):
            monkeypatch.delenv(k)
    mount = cli.get_command(click.Context(cli), "mount")
    base = ["/nonexistent-memfuse-probe", "--control-plane", "http://127.0.0.1:9", "--workspace", "w"]
    assert _make_with_env(mount, base, {"MEMFUSE_ADMIN_SOCKET": "/x/admin.sock"}).params["admin_socket"] is True
    assert _make_with_env(mount, base, {"MEMFUSE_MOUNT_ADMIN_SOCKET": "false"}).params["admin_socket"] is False
    monkeypatch.setenv("MEMFUSE_ADMIN_SOCKET", "/x/admin.sock")
    assert _old_admin_socket_switch() is None and capsys.readouterr().err == ""
    monkeypatch.setenv("MEMFUSE_ADMIN_SOCKET", "False")
    assert _old_admin_socket_switch() is False
    assert "set MEMFUSE_MOUNT_ADMIN_SOCKET instead" in capsys.readouterr().err
    status = cli.get_command(click.Context(cli), "status")
    assert _make_with_env(status, [], {"MEMFUSE_ADMIN_SOCKET": "/x/admin.sock"}).params["admin_socket"] == \
        Path("/x/admin.sock")


def test_control_plane_admin_token_never_reaches_a_sidecar(monkeypatch, capsys, tmp_path):
    """MEMFUSE_ADMIN_TOKEN_FILE is memfuse serve's admin token (the platform's); the sidecar
    commands read MEMFUSE_SIDECAR_ADMIN_TOKEN_FILE, and say so when only the former is set.
    (Before session 27 one variable named both: exported for serve, `memfuse status --admin
    URL` sent the platform's admin token to a sidecar's admin API, and `mount` accepted it as
    its own.)"""
    from memfuse.cli.common import control_plane_token_unread

    for k in list(os.environ):
        if k.startswith("MEMFUSE_"):
            monkeypatch.delenv(k)
    platform = tmp_path / "platform.token"
    platform.write_text("mfa_platform\n")
    env = {"MEMFUSE_ADMIN_TOKEN_FILE": str(platform)}
    mount = cli.get_command(click.Context(cli), "mount")
    base = ["/nonexistent-memfuse-probe", "--control-plane", "http://127.0.0.1:9", "--workspace", "w"]
    assert _make_with_env(mount, base, env).params["admin_token_file"] is None
    status = cli.get_command(click.Context(cli), "status")
    assert _make_with_env(status, ["--admin", "http://127.0.0.1:9"], env).params["admin_token_file"] is None
    assert _make_with_env(status, [], {"MEMFUSE_SIDECAR_ADMIN_TOKEN_FILE": "/x/t"}).params["admin_token_file"] \
        == Path("/x/t")
    serve = cli.get_command(click.Context(cli), "serve")
    assert _make_with_env(serve, [], env).params["admin_token_file"] == platform
    # the notice, and the refusal of `mounts add --admin URL` without the sidecar's token
    monkeypatch.setenv("MEMFUSE_ADMIN_TOKEN_FILE", str(platform))
    assert "MEMFUSE_SIDECAR_ADMIN_TOKEN_FILE" in control_plane_token_unread(None)
    assert control_plane_token_unread(Path("/x/t")) == ""
    r = CliRunner().invoke(cli, ["mounts", "add", "notes", "--admin", "http://127.0.0.1:9"],
                           env={"MEMFUSE_ADMIN_TOKEN_FILE": str(platform)})
    assert r.exit_code == 2 and "MEMFUSE_SIDECAR_ADMIN_TOKEN_FILE" in r.output, r.output
    assert "mfa_platform" not in r.output
    monkeypatch.delenv("MEMFUSE_ADMIN_TOKEN_FILE")
    assert control_plane_token_unread(None) == ""


def test_sidecar_config_refuses_what_the_flags_refuse(tmp_path):
    """MountConfig and the core's Settings (any caller, not only the CLI) refuse nan, inf and
    negative durations, a zero fsync timeout; 0 commit wait stays, inf start timeout is forever."""
    from memfuse.sidecar.config import MountConfig
    from memfuse.sidecar.inodes import Settings

    ok = dict(mountpoint=tmp_path / "m", workspace="w", cache_dir=tmp_path / "c")
    MountConfig(**ok, commit_wait=0, start_timeout=float("inf"))
    Settings(commit_wait=0)
    for field, value in [("commit_wait", float("nan")), ("fsync_timeout", 0), ("drain_timeout", -1),
                         ("offline_after", float("inf")), ("token_check_interval", 0), ("start_timeout", -1),
                         ("commit_wait", "3")]:
        with pytest.raises(ValueError, match=field):
            MountConfig(**ok, **{field: value})
    for field, value in [("commit_wait", float("nan")), ("fsync_timeout", float("inf")), ("commit_wait", -0.5)]:
        with pytest.raises(ValueError, match=field):
            Settings(**{field: value})


def test_sidecar_config_bounds_durations_as_the_flags_do(tmp_path):
    """MountConfig and Settings take at most MAX_SECONDS (1e9), as the flags: 1e10 and 1e300
    were taken and overflow the clocks they are added to (``threading.Event.wait``,
    ``time.sleep``); inf only where it means forever (start_timeout)."""
    from memfuse.durations import MAX_SECONDS
    from memfuse.sidecar.config import MountConfig
    from memfuse.sidecar.inodes import Settings

    ok = dict(mountpoint=tmp_path / "m", workspace="w", cache_dir=tmp_path / "c")
    names = ("commit_wait", "fsync_timeout", "drain_timeout", "offline_after", "token_check_interval",
             "start_timeout")
    assert MAX_SECONDS == 1e9
    MountConfig(**ok, **{name: 1e9 for name in names})
    Settings(commit_wait=1e9, fsync_timeout=1e9)
    for value in (1e10, 1e300, 10**400):
        for name in names:
            with pytest.raises(ValueError, match=rf"MountConfig\.{name} = .* is not a number of seconds"):
                MountConfig(**ok, **{name: value})
        for name in ("commit_wait", "fsync_timeout"):
            with pytest.raises(ValueError, match=rf"Settings\.{name} = "):
                Settings(**{name: value})


#: values for a duration, as given on the command line (and so to MEMFUSE_<FLAG>)
DURATION_TABLE = ["0", "-0", "0.05", "0.1", "1", "1e3", "999999999.5", "1e9", "1000000000.5", "1e10",
                  "1e300", "1e400", "-1", "-1e400", "nan", "inf", "-inf"]


@pytest.mark.parametrize("flag, field", [("--commit-wait", "commit_wait"), ("--drain-timeout", "drain_timeout"),
                                         ("--offline-after", "offline_after"), ("--start-timeout", "start_timeout")])
def test_mount_flag_and_mount_config_agree(flag, field, tmp_path, monkeypatch):
    """A mount flag and MountConfig's field take and refuse the same durations (one rule,
    ``memfuse.durations``): the flag's text, and the number it reads as given to MountConfig
    (``1e400`` reads as inf: the flag's text is a number past the bound, which only the
    field meaning forever takes as inf)."""
    from memfuse.sidecar.config import MountConfig

    for k in list(os.environ):
        if k.startswith("MEMFUSE_"):
            monkeypatch.delenv(k)
    mount = cli.get_command(click.Context(cli), "mount")
    base = ["/nonexistent-memfuse-probe", "--control-plane", "http://127.0.0.1:9", "--workspace", "w"]
    ok = dict(mountpoint=tmp_path / "m", workspace="w", cache_dir=tmp_path / "c")
    param = next(p for p in mount.params if p.name == field)
    forever = field == "start_timeout"
    for text in DURATION_TABLE:
        try:
            flag_took = mount.make_context("mount", [*base, flag, text]).params[field] is not None
        except click.BadParameter as err:
            assert f"'{flag}'" in err.format_message()
            flag_took = False
        try:
            MountConfig(**ok, **{field: float(text)})
            config_took = True
        except ValueError as err:
            assert field in str(err)
            config_took = False
        if text == "1e400" and forever:  # the number, not the word: the flag refuses it
            assert (flag_took, config_took) == (False, True)
            continue
        assert flag_took == config_took, (flag, text, flag_took, config_took)
        try:  # a number given to the flag's type (a default, a caller's value) by the same rule
            param.type.convert(float(text), param, None)
            type_took = True
        except click.BadParameter:
            type_took = False
        assert type_took == config_took, (flag, text)


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
