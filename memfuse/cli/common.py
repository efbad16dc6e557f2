"""What every ``memfuse`` command shares: the root group, option and error plumbing, output helpers.

``opt`` (an option that also reads ``MEMFUSE_<OPTION>``), ``MemfuseGroup`` (every failure as
one line on stderr and exit status 1; a closed stdout pipe as a quiet status 141), ``Target`` / ``api_options`` / ``_api`` (where API
commands go: a control plane with a token, or local mode), ``ByteSize``, ``Seconds`` (every duration flag), and the tables, byte
counts and times commands print. The commands themselves are in the sibling modules; this
room defines none except the root group ``cli``.
"""
from __future__ import annotations

import logging
import math
import os
import re
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timezone
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

from memfuse.client import ApiClient
from memfuse.defs import one_line, parse_byte_size
from memfuse.durations import NOT_SECONDS, seconds_bounds, seconds_problem
from memfuse.errors import ApiError


# memfuse.transfer (and the content checks it imports) is loaded by this one only when
# called: a read command (``history``, ``show``, ``store list``...) does not pay for it.
def _key() -> str:
    """A fresh idempotency key for one CLI write (:func:`memfuse.transfer.new_key`)."""
    from memfuse.transfer import new_key

    return new_key()


def _one_line(text: str) -> str:
    """``text`` on one line (:func:`memfuse.defs.one_line`)."""
    return one_line(text)

T = TypeVar("T")

TOKEN_ENV = "MEMFUSE_TOKEN"
DEFAULT_LISTEN = "127.0.0.1:8080"
DEFAULT_ADMIN_LISTEN = "127.0.0.1:9464"


# ---------------------------------------------------------------- plumbing


def envvar_for(*decls: str) -> str:
    """The environment variable of an option declared by ``decls``: ``MEMFUSE_`` + its first
    long name upper-cased with ``-`` as ``_`` (``--token-file`` → ``MEMFUSE_TOKEN_FILE``,
    ``--admin-socket/--no-admin-socket`` → ``MEMFUSE_ADMIN_SOCKET``)."""
    longs = [d for d in decls if d.startswith("--")]
    name = longs[0][2:].split("/")[0] if longs else decls[-1]
    return "MEMFUSE_" + name.upper().replace("-", "_")


def opt(*decls: str, **kw: Any) -> Callable[[Any], Any]:
    """``click.option`` that also reads ``MEMFUSE_<LONG_NAME>`` (:func:`envvar_for`) from the
    environment. ``envvar=None`` makes an option that reads no environment variable at all
    (a documented exception, docs/CLI.md)."""
    if "envvar" not in kw:
        kw["envvar"] = envvar_for(*decls)
    elif kw["envvar"] is None:
        kw["allow_from_autoenv"] = False
    kw.setdefault("show_envvar", kw["envvar"] is not None)
    return click.option(*decls, **kw)


#: the variable of the sidecar's admin token file (``mount``, ``status``, ``mounts add|remove``
#: ``--admin-token-file``): ``MEMFUSE_ADMIN_TOKEN_FILE`` is ``memfuse serve``'s, the control
#: plane's bootstrap admin token, which must never be sent to a sidecar's admin API nor
#: become one (one name, two secrets, before session 27; docs/CLI.md)
SIDECAR_ADMIN_TOKEN_ENV = "MEMFUSE_SIDECAR_ADMIN_TOKEN_FILE"


def control_plane_token_unread(given: object) -> str:
    """A notice for a sidecar command run without its token file (``given`` is None) while
    ``MEMFUSE_ADMIN_TOKEN_FILE`` (``memfuse serve``'s admin token) is set: that variable is not
    read for a sidecar, and the notice says which one is. "" when there is nothing to say."""
    if given is not None or not os.environ.get("MEMFUSE_ADMIN_TOKEN_FILE"):
        return ""
    return (f"MEMFUSE_ADMIN_TOKEN_FILE (memfuse serve's admin token) is not read for a sidecar; "
            f"its token file is --admin-token-file or {SIDECAR_ADMIN_TOKEN_ENV}")


#: Exit status after stdout turned out to be a closed pipe (``memfuse history ... | head -1``):
#: 128 + SIGPIPE, the status a shell reports for git, grep and coreutils, which die of the
#: signal when they write to a pipe whose reader has gone (POSIX ``write(2)``: EPIPE, SIGPIPE).
EXIT_BROKEN_PIPE = 128 + 13


def _broken_pipe_exit() -> NoReturn:
    """Leave quietly after a write to a closed stdout pipe: nothing on stderr, exit status
    :data:`EXIT_BROKEN_PIPE`. Python ignores SIGPIPE (the write raises ``BrokenPipeError``
    instead), and the process holds sockets, so SIGPIPE is not restored to its default (see
    the Python docs, "Note on SIGPIPE"): stdout is pointed at ``/dev/null`` instead so the
    flush at interpreter exit does not fail again. Raises ``click.exceptions.Exit``."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (click's test runner)
        fd = None
    if fd is not None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, fd)
        finally:
            os.close(devnull)
    raise click.exceptions.Exit(EXIT_BROKEN_PIPE)


def flush_stdout() -> None:
    """Flush stdout now, so a closed pipe shows here (a quiet :func:`_broken_pipe_exit`), not
    as ``Exception ignored ... BrokenPipeError`` and status 120 at interpreter exit."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _broken_pipe_exit()



#: ``memfuse --verbose``: errors said in the user's terms also show the HTTP status and code
VERBOSE = False


class PathError(click.ClickException):
    """An API refusal about a record the user named by path, said in the user's terms
    (``prefs.md has no version 99``) instead of the server's (record id, HTTP status, code);
    ``memfuse --verbose`` appends the server's status, code and detail."""

    def __init__(self, message: str, cause: ApiError) -> None:
        super().__init__(message)
        self.cause = cause

    def format_message(self) -> str:  # noqa: D102
        if not VERBOSE:
            return self.message
        c = self.cause
        extra = f"HTTP {c.status}" + (f" {c.code}" if c.code else "")
        detail = _one_line(c.detail or c.title or "")
        if detail and detail != self.message:
            extra += f": {detail}"
        return f"{self.message} ({extra})"


def path_error(e: ApiError, store: str, path: str, record_id: str | None = None,
               version: int | None = None) -> click.ClickException:
    """``e`` (a refusal of a request about the record at ``path`` in ``store``, id
    ``record_id``, version ``version``) as a :class:`PathError` naming the path and version;
    a failure without an HTTP status (unreachable, ...) is left as :func:`click_error` says it."""
    if e.status is None:
        return click_error(e)
    if e.code == "version_not_found" and version is not None:
        return PathError(f"{path} has no version {version}", e)
    if e.code == "record_not_found":
        return PathError(f"no record at {path} in store {store}", e)
    what = e.detail or e.title or "request failed"
    if record_id:
        what = what.replace(f"record {record_id!r}", path).replace(record_id, path)
    return PathError(_one_line(what), e)


def _api_error_message(e: ApiError) -> str:
    if e.status is None:
        return _one_line(str(e))
    what = e.detail or e.title or "request failed"
    extra = f"HTTP {e.status}" + (f" {e.code}" if e.code else "")
    return _one_line(f"{what} ({extra})")


class WholeHelpGroup(click.Group):
    """A command group whose ``--help`` lists each command's whole first sentence, wrapped
    to the terminal, where click cuts it to one line ending in ``...``. The root group and,
    through its ``group_class``, every group under it (``store``, ``token``, ``db``...)."""

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The ``Commands:`` section of ``--help`` with each command's whole first sentence,
        wrapped to the terminal, where click cuts it to one line ending in ``...``."""
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                rows.append((name, cmd.get_short_help_str(limit=10_000)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


class MemfuseGroup(WholeHelpGroup):
    """Top-level group: turns every failure into a one-line message and exit status 1, and
    output into a closed pipe into a quiet exit with :data:`EXIT_BROKEN_PIPE`.

    ``lazy_commands`` maps a command name to the module under ``memfuse.cli`` that registers
    it when imported (click's documented lazy loading of subcommands): a run loads only the
    module of the command it invokes, so ``memfuse mount`` (the sidecar, for its whole life)
    carries none of the admin, record, transfer or database commands and what they import;
    ``memfuse --help`` loads them all to list them.
    """

    lazy_commands: dict[str, str] = {}
    group_class = WholeHelpGroup  # ``@cli.group()`` makes one

    def list_commands(self, ctx: click.Context) -> list[str]:  # noqa: D102
        return sorted(set(super().list_commands(ctx)) | set(self.lazy_commands))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:  # noqa: D102
        module = self.lazy_commands.get(cmd_name)
        if module is not None and cmd_name not in self.commands:
            import importlib

            importlib.import_module(f"memfuse.cli.{module}")
        return super().get_command(ctx, cmd_name)

    def make_context(self, *args: Any, **kw: Any) -> click.Context:  # noqa: D102
        try:  # eager options print here: `memfuse --help | head -1`
            return super().make_context(*args, **kw)
        except BrokenPipeError:
            _broken_pipe_exit()

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Abort, click.exceptions.Exit):
            raise
        except BrokenPipeError:  # stdout's reader has gone: quiet, like coreutils
            _broken_pipe_exit()
        except KeyboardInterrupt:
            raise click.exceptions.Abort() from None
        except Exception as e:  # noqa: BLE001 — the CLI never shows a traceback
            if os.environ.get("MEMFUSE_TRACEBACK"):
                raise
            if isinstance(e, BaseExceptionGroup):  # trio may wrap errors
                leaves = _leaves(e)
                if len(leaves) == 1 and isinstance(leaves[0], BrokenPipeError):
                    _broken_pipe_exit()
            raise click_error(e) from None


def click_error(e: Exception) -> click.ClickException:
    """The one-line ``click.ClickException`` the CLI shows for ``e``: an ``ApiError``'s detail
    with its HTTP status and code, a lone error inside a (trio) exception group as itself,
    anything else as ``Type: message``."""
    if isinstance(e, BaseExceptionGroup):  # trio may wrap errors
        leaves = _leaves(e)
        if len(leaves) == 1 and isinstance(leaves[0], Exception):
            e = leaves[0]
    if isinstance(e, click.ClickException):
        return e
    if isinstance(e, ApiError):
        return click.ClickException(_api_error_message(e))
    return click.ClickException(_one_line(f"{type(e).__name__}: {e}"))


def _leaves(group: BaseException) -> list[BaseException]:
    if isinstance(group, BaseExceptionGroup):
        out: list[BaseException] = []
        for sub in group.exceptions:
            out.extend(_leaves(sub))
        return out
    return [group]


def _run(fn: Callable[[], Awaitable[T]]) -> T:
    import trio

    return trio.run(fn)


@dataclass
class Target:
    """Where API commands go: a control plane URL with a token, or local mode."""

    control_plane: str | None
    token_file: Path | None
    _warned: bool = False

    def token(self) -> str | None:
        """The token from ``--token-file`` (whitespace stripped), else ``$MEMFUSE_TOKEN``."""
        if self.token_file is not None:
            try:
                tok = self.token_file.read_text(encoding="utf-8").strip()
            except OSError as e:
                raise click.UsageError(f"cannot read token file {self.token_file}: {e.strerror}") from None
            if not tok:
                raise click.UsageError(f"token file {self.token_file} is empty")
            return tok
        tok = os.environ.get(TOKEN_ENV, "").strip()
        return tok or None

    def warn_local(self) -> None:
        """In local mode, say once on stderr that a token given is ignored."""
        if (self.token_file is not None or os.environ.get(TOKEN_ENV)) and not self._warned:
            self._warned = True
            click.echo(
                "memfuse: no --control-plane given; using the local dev database (token ignored)",
                err=True,
            )

    def server_token(self) -> str:
        """The token for ``--control-plane`` (:meth:`token`); a usage error when none is given."""
        tok = self.token()
        if tok is None:
            raise click.UsageError(
                "no token: pass --token-file F (or set MEMFUSE_TOKEN_FILE / MEMFUSE_TOKEN)"
            )
        return tok

    def client(self, *, faces: bool = False) -> ApiClient:
        """A new ApiClient for this target (close it when done). In local mode ``faces=True``
        also serves the agent-tool routes in process (``memfuse mcp`` needs the memory-tool
        endpoint); the other commands leave them out."""
        if self.control_plane:
            return ApiClient(self.control_plane, self.server_token())
        self.warn_local()
        from memfuse.devenv import local_client

        return local_client(faces=faces)


def api_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """Add ``--control-plane`` and ``--token-file``; pass a :class:`Target` as ``target``."""

    f = opt(
        "--token-file",
        type=click.Path(dir_okay=False, path_type=Path),
        help="File holding the API token (else $MEMFUSE_TOKEN). Ignored in local mode.",
    )(f)
    f = opt(
        "--control-plane",
        metavar="URL",
        help="Control-plane URL, e.g. http://127.0.0.1:8080. "
        "Default: local mode on the dev database in-process.",
    )(f)

    def wrapper(*args: Any, control_plane: str | None, token_file: Path | None, **kw: Any) -> Any:
        return f(*args, target=Target(control_plane or None, token_file), **kw)

    import functools

    return functools.update_wrapper(wrapper, f)



def _api(target: Target, body: Callable[[ApiClient], Awaitable[T]]) -> T:
    """Open a client for ``target``, run ``body(client)`` under trio, close the client."""

    async def main() -> T:
        async with target.client() as api:
            return await body(api)

    return _run(main)


#: environment variables that make httpx send through a proxy (its ``trust_env``): a read
#: then takes the ordinary path (the proxy transports need an event loop)
_PROXY_ENV = {"http_proxy", "https_proxy", "all_proxy"}


def _read_api(target: Target, body: Callable[[ApiClient], Awaitable[T]]) -> T:
    """:func:`_api` for a read command (``history``, ``show``, ``search``, ``store list``,
    ``token list``...), without an event loop where one is not needed
    (:func:`memfuse.client.run_loopless`), so trio is never imported: against a control
    plane through a blocking transport (:class:`memfuse.client.SyncTransport`); in local mode
    from the dev database through ``sqlite3`` (:class:`memfuse.cli.localread.LocalReadTransport`,
    when the database exists at the newest schema revision). Output and errors are the same
    as :func:`_api`'s; when the work needs an event loop or the full service after all
    (:class:`memfuse.client.NeedEventLoop`: a request the local reader does not answer
    plainly, a refusal, an HTTP proxy in the environment), it runs again through
    :func:`_api`. ``body`` must be a read: it may be started twice (before any output, for
    the commands using this: the local reader answers a search in one page)."""
    if target.control_plane and not any(k.lower() in _PROXY_ENV for k in os.environ):
        from memfuse.client import NeedEventLoop, SyncTransport, run_loopless, tls_context

        base = target.control_plane
        tok = target.server_token()

        async def main() -> T:
            async with ApiClient(base, tok, transport=SyncTransport(tls_context(base))) as api:
                return await body(api)

        try:
            return run_loopless(main)
        except NeedEventLoop:
            pass
    elif not target.control_plane:
        from memfuse.client import NeedEventLoop, run_loopless
        from memfuse.cli.localread import LocalReadTransport
        from memfuse.devenv import LOCAL_BASE_URL, dev_db_path

        transport = LocalReadTransport.open(dev_db_path())
        if transport is not None:
            target.warn_local()

            async def local() -> T:
                async with ApiClient(LOCAL_BASE_URL, None, transport=transport) as api:
                    return await body(api)

            try:
                return run_loopless(local)
            except NeedEventLoop:
                pass
    return _api(target, body)


def _table(rows: list[list[str]], headers: list[str]) -> str:
    cols = list(zip(headers, *rows)) if rows else [(h,) for h in headers]
    widths = [max(len(str(c)) for c in col) for col in cols]
    lines = []
    for row in [headers, *rows]:
        cells = [str(c).ljust(w) for c, w in zip(row, widths)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}".replace(".0 ", " ")
        n /= 1024  # type: ignore[assignment]
    return str(n)  # pragma: no cover


class ByteSize(click.ParamType):
    """A byte count: ``1048576``, ``512K``, ``1M``, ``1MiB``, ``2G`` (binary), ``1MB`` (decimal)."""

    name = "BYTES"

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        if isinstance(value, int):
            return value
        try:  # the same forms as the console's size fields
            return parse_byte_size(str(value))
        except ValueError as err:
            self.fail(str(err), param, ctx)


BYTES = ByteSize()


class Seconds(click.FloatRange):
    """A duration in seconds, the one type of every duration flag (``--commit-wait``,
    ``--fsync-timeout``, ``--read-timeout``, ``consolidate --wait``...) and so of its
    ``MEMFUSE_<FLAG>`` variable, which click converts through the same type: a decimal number
    (ASCII digits, an optional exponent: ``5``, ``0.25``, ``1e3``) from ``min`` (``min_open``:
    more than ``min``) up to :data:`memfuse.durations.MAX_SECONDS`, by the rule the sidecar's
    options also follow (:func:`memfuse.durations.seconds_problem`). ``nan``, a negative
    number, a number past the bound (``1e400``) and ``inf`` are refused with a usage error
    naming the flag; the word ``inf`` is taken only by a flag whose ``forever`` says it means
    "wait forever" (``mount --start-timeout``). A ``click.FloatRange`` so that ``--help`` shows the lower bound
    (``x>=0.1``). (attack26: ``--commit-wait nan`` made a close fail with EIO at once and its
    write commit afterwards; verify26: ``1e400`` read as forever, ``1_000`` and non-ASCII
    digits taken as numbers.)"""

    name = "seconds"
    _NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", re.ASCII)
    _FOREVER = frozenset({"inf", "+inf", "infinity", "+infinity"})

    def __init__(self, min: float = 0.0, *, min_open: bool = False, forever: bool = False) -> None:
        super().__init__(min=min, min_open=min_open)
        self.forever = forever

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        n: float
        low = float(self.min or 0.0)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            n = value
        else:
            text = str(value).strip()
            if self.forever and text.lower() in self._FOREVER:
                return math.inf
            if not self._NUMBER.fullmatch(text):
                self.fail(f"{value!r} {NOT_SECONDS}", param, ctx)
            n = float(text)
            if n == math.inf:  # 1e400: past the bound, never the word for forever
                self.fail(f"{value!r} {NOT_SECONDS} {seconds_bounds(low, low_open=self.min_open, forever=self.forever)}",
                          param, ctx)
        problem = seconds_problem(n, low, low_open=self.min_open, forever=self.forever)
        if problem is not None:
            self.fail(f"{value!r} {problem}", param, ctx)
        return float(n) + 0.0  # -0.0 as 0.0


def _setup_logging(debug: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not debug:
        logging.getLogger("httpx").setLevel(logging.WARNING)


def _write_exact(text: str) -> None:
    """Write ``text`` to stdout as UTF-8 bytes, exactly (no newline added or translated), all
    of it: a write cut short (``write(2)`` returns what fit when a signal arrives, or when the
    pipe's reader leaves; ``BufferedWriter.write`` then returns that count) is continued, so a
    closed pipe raises ``BrokenPipeError`` instead of the rest being dropped silently."""
    sys.stdout.flush()
    buf = getattr(sys.stdout, "buffer", None)
    if buf is None:  # pragma: no cover — a text-only stdout
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    view = memoryview(text.encode("utf-8"))
    while view:
        n = buf.write(view)
        view = view[n if n is not None else len(view):]
    buf.flush()


#: characters a terminal may act on or that reorder what it shows: the C0 controls but tab,
#: DEL, the C1 controls (ESC starts escape sequences; U+009B is a one-character CSI) and the
#: Unicode bidirectional controls (a line that reads differently than it is, "Trojan Source",
#: CVE-2021-42574)
_TERMINAL_UNSAFE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escape_one(m: re.Match[str]) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c <= 0xFF else f"\\u{c:04x}"


def terminal_safe(text: str) -> str:
    """``text`` with every character a terminal would act on shown as an escape instead:
    C0 controls (tab kept), DEL and C1 controls as ``\\xNN``, bidirectional controls as
    ``\\uNNNN`` (``_TERMINAL_UNSAFE``). For untrusted text (memory content) printed to a
    terminal; a backslash already in the text is left as it is."""
    return _TERMINAL_UNSAFE.sub(_escape_one, text)


def stdout_is_terminal() -> bool:
    """Whether stdout is a terminal (then untrusted text goes through ``terminal_safe``)."""
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stdout
        return False


def _fmt_time(dt: Any) -> str:
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


# ---------------------------------------------------------------- group


@click.group(
    name="memfuse",
    cls=MemfuseGroup,
    # no auto_envvar_prefix: click's automatic names (MEMFUSE_<COMMAND>_<PARAMETER>) follow
    # no documented rule; every option names its variable through ``opt`` instead
    context_settings={
        "help_option_names": ["-h", "--help"],
        "max_content_width": 100,
    },
)
# the release, never from the environment: MEMFUSE_VERSION is a common name for the release
# to install (Dockerfiles, CI), and reading it made every command print the version instead
@click.version_option(package_name="memfuse", prog_name="memfuse", allow_from_autoenv=False)
@click.option("-v", "--verbose", is_flag=True, envvar="MEMFUSE_VERBOSE",
              help="Errors about a path also show the server's HTTP status and error code.")
def cli(verbose: bool) -> None:
    """memfuse: long-term memory for AI agents, served as plain files over FUSE.

    Start with `memfuse dev` (embedded control plane on a local SQLite file, workspace `dev`
    with store `default` mounted at ./memory). Every option also reads MEMFUSE_<OPTION> from
    the environment (exceptions: --version, --help, and the options that pick a version or
    a diff's ends: show/restore/redact --version, diff --from/--to/--unified). Rules shared by
    every command: docs/CLI.md.
    """
    global VERBOSE
    VERBOSE = verbose
    # with_retries() retries quietly; the last error, if any, is the one line the user sees.
    logging.getLogger("stamina").setLevel(logging.ERROR)

