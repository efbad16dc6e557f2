"""The ``memfuse`` command line (DESIGN §8).

Commands: ``serve``, ``dev``, ``mount``, ``status``, ``store create|list|show|update``,
``workspace create|list``, ``attach``, ``detach``, ``token create``, ``history``, ``show``,
``restore``, ``redact``, ``context``, ``import``, ``export``.

Every option also reads ``MEMFUSE_<OPTION>`` from the environment (``--control-plane`` →
``MEMFUSE_CONTROL_PLANE``, ``--token-file`` → ``MEMFUSE_TOKEN_FILE``, ...); a raw token may be
given as ``MEMFUSE_TOKEN``. API commands without ``--control-plane`` run the reference control
plane in-process on the dev database (local mode, see :mod:`memfuse.devenv`), which works while
``memfuse dev`` runs on the same file.

Errors print one line to stderr and exit 1 (2 for usage errors); never a traceback, unless
``MEMFUSE_TRACEBACK=1`` is set.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import socket
import sys
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timezone
from pathlib import Path
from typing import Any, TypeVar

import click

from .client import ApiClient, ApiError, with_retries
from .models import RECORD_TYPES, Record, Store

T = TypeVar("T")

TOKEN_ENV = "MEMFUSE_TOKEN"
DEFAULT_LISTEN = "127.0.0.1:8080"
DEFAULT_ADMIN_LISTEN = "127.0.0.1:9464"


# ---------------------------------------------------------------- plumbing


def opt(*decls: str, **kw: Any) -> Callable[[Any], Any]:
    """``click.option`` that also reads ``MEMFUSE_<LONG_NAME>`` from the environment."""
    if "envvar" not in kw:
        longs = [d for d in decls if d.startswith("--")]
        name = longs[0][2:].split("/")[0] if longs else decls[-1]
        kw["envvar"] = "MEMFUSE_" + name.upper().replace("-", "_")
    kw.setdefault("show_envvar", True)
    return click.option(*decls, **kw)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _api_error_message(e: ApiError) -> str:
    if e.status is None:
        return _one_line(str(e))
    what = e.detail or e.title or "request failed"
    extra = f"HTTP {e.status}" + (f" {e.code}" if e.code else "")
    return _one_line(f"{what} ({extra})")


class MemfuseGroup(click.Group):
    """Top-level group: turns every failure into a one-line message and exit status 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Abort, click.exceptions.Exit):
            raise
        except ApiError as e:
            if os.environ.get("MEMFUSE_TRACEBACK"):
                raise
            raise click.ClickException(_api_error_message(e)) from None
        except KeyboardInterrupt:
            raise click.exceptions.Abort() from None
        except Exception as e:  # noqa: BLE001 — the CLI never shows a traceback
            if os.environ.get("MEMFUSE_TRACEBACK"):
                raise
            if isinstance(e, BaseExceptionGroup):  # trio may wrap errors
                leaves = _leaves(e)
                if len(leaves) == 1:
                    inner = leaves[0]
                    if isinstance(inner, ApiError):
                        raise click.ClickException(_api_error_message(inner)) from None
                    if isinstance(inner, click.ClickException):
                        raise inner from None
                    e = inner  # type: ignore[assignment]
            raise click.ClickException(_one_line(f"{type(e).__name__}: {e}")) from None


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

    def client(self) -> ApiClient:
        """A new ApiClient for this target (close it when done)."""
        if self.control_plane:
            tok = self.token()
            if tok is None:
                raise click.UsageError(
                    "no token: pass --token-file F (or set MEMFUSE_TOKEN_FILE / MEMFUSE_TOKEN)"
                )
            return ApiClient(self.control_plane, tok)
        if self.token_file is not None or os.environ.get(TOKEN_ENV):
            click.echo(
                "memfuse: no --control-plane given; using the local dev database (token ignored)",
                err=True,
            )
        from .devenv import local_client

        return local_client()


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


def _key() -> str:
    """A fresh idempotency key, reused across the retries of one CLI write."""
    return "cli-" + uuid.uuid4().hex


def _api(target: Target, body: Callable[[ApiClient], Awaitable[T]]) -> T:
    """Open a client for ``target``, run ``body(client)`` under trio, close the client."""

    async def main() -> T:
        async with target.client() as api:
            return await body(api)

    return _run(main)


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
    _UNITS = {
        "": 1, "b": 1,
        "k": 1 << 10, "kib": 1 << 10, "kb": 1000,
        "m": 1 << 20, "mib": 1 << 20, "mb": 1000**2,
        "g": 1 << 30, "gib": 1 << 30, "gb": 1000**3,
    }

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        if isinstance(value, int):
            return value
        text = str(value).strip().replace(" ", "")
        num = text.rstrip("kKmMgGiIbB")
        unit = text[len(num):].lower()
        try:
            n = float(num)
        except ValueError:
            self.fail(f"{value!r} is not a byte size (e.g. 1048576, 512K, 1MiB)", param, ctx)
        if unit not in self._UNITS:
            self.fail(f"unknown unit in {value!r} (use K, M, G, KiB, MiB, GiB, kB, MB, GB)", param, ctx)
        result = int(n * self._UNITS[unit])
        if result <= 0:
            self.fail(f"{value!r} must be positive", param, ctx)
        return result


BYTES = ByteSize()


def _setup_logging(debug: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not debug:
        logging.getLogger("httpx").setLevel(logging.WARNING)


def _write_exact(text: str) -> None:
    """Write ``text`` to stdout as UTF-8 bytes, exactly (no newline added or translated)."""
    sys.stdout.flush()
    buf = getattr(sys.stdout, "buffer", None)
    if buf is None:  # pragma: no cover — a text-only stdout
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    buf.write(text.encode("utf-8"))
    buf.flush()


def _fmt_time(dt: Any) -> str:
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


# ---------------------------------------------------------------- group


@click.group(
    name="memfuse",
    cls=MemfuseGroup,
    context_settings={
        "auto_envvar_prefix": "MEMFUSE",
        "help_option_names": ["-h", "--help"],
        "max_content_width": 100,
    },
)
@click.version_option(package_name="memfuse", prog_name="memfuse")
def cli() -> None:
    """memfuse: long-term memory for AI agents, served as plain files over FUSE.

    Start with `memfuse dev` (embedded control plane on a local SQLite file, workspace `dev`
    with store `default` mounted at ./memory). Every option also reads MEMFUSE_<OPTION> from
    the environment.
    """
    # with_retries() retries quietly; the last error, if any, is the one line the user sees.
    logging.getLogger("stamina").setLevel(logging.ERROR)


def main() -> None:
    """Console-script entry point (``memfuse``)."""
    cli.main(prog_name="memfuse")


# ---------------------------------------------------------------- serve / dev / mount / status


def _admin_token(admin_token_file: Path | None) -> tuple[str, Path, bool]:
    """Return (token, file, generated). Reads ``admin_token_file``; without one, reuses or
    creates ``<data dir>/admin.token`` (mode 0600)."""
    from .devenv import data_dir

    if admin_token_file is not None:
        try:
            tok = admin_token_file.read_text(encoding="utf-8").strip()
        except OSError as e:
            raise click.UsageError(f"cannot read admin token file {admin_token_file}: {e.strerror}") from None
        if not tok:
            raise click.UsageError(f"admin token file {admin_token_file} is empty")
        return tok, admin_token_file, False
    path = data_dir() / "admin.token"
    try:
        tok = path.read_text(encoding="utf-8").strip()
        if tok:
            os.chmod(path, 0o600)
            return tok, path, False
    except FileNotFoundError:
        pass
    tok = "mfa_" + secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(tok + "\n")
    os.chmod(path, 0o600)
    return tok, path, True


@cli.command()
@opt("--db", metavar="URL", help="Database URL: sqlite:///path or postgresql://... "
     "Default: the dev database (sqlite:///<data dir>/dev.db).")
@opt("--listen", default=DEFAULT_LISTEN, show_default=True, metavar="HOST:PORT",
     help="Address to serve HTTP on.")
@opt("--admin-token-file", type=click.Path(dir_okay=False, path_type=Path),
     help="File holding the bootstrap admin token. Default: <data dir>/admin.token, "
     "created (mode 0600) with a random token if missing.")
@opt("--debug", is_flag=True, help="Verbose logging.")
def serve(db: str | None, listen: str, admin_token_file: Path | None, debug: bool) -> None:
    """Run the reference control plane (HTTP API v1) on a database."""
    from .devenv import dev_db_url

    _setup_logging(debug)
    url = db or dev_db_url()
    token, token_path, generated = _admin_token(admin_token_file)
    from .server.app import create_app
    from .server.serve import serve as serve_app

    app = create_app(url, static_tokens={token: None})
    click.echo(
        f"memfuse serve: admin token {'written to' if generated else 'read from'} {token_path}",
        err=True,
    )

    async def run() -> None:
        import signal

        import trio

        async with trio.open_nursery() as nursery:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                bound = await nursery.start(serve_app, app, listen)
                click.echo(f"memfuse serve: listening on {bound or 'http://' + listen} "
                           f"(database {_safe_url(url)}); stop with Ctrl-C", err=True)
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    break

    _run(run)
    click.echo("memfuse serve: stopped", err=True)


def _safe_url(url: str) -> str:
    """A database URL without its password."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001
        return url.split("@")[-1] if "@" in url else url


@cli.command()
@click.argument("mountpoint", default="memory", type=click.Path(file_okay=False, path_type=Path),
                envvar="MEMFUSE_MOUNTPOINT")
@opt("--admin-listen", metavar="HOST:PORT", help="Serve the sidecar admin HTTP API here (off by default).")
@opt("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True,
     help="Log line format on stderr.")
@opt("--debug", is_flag=True, help="Verbose logging (and FUSE debug).")
def dev(mountpoint: Path, admin_listen: str | None, log_format: str, debug: bool) -> None:
    """Embedded default: control plane in-process on the dev database, workspace `dev` with
    store `default` attached, mounted at MOUNTPOINT (default ./memory) in the foreground."""
    from .devenv import DEV_WORKSPACE, dev_app, dev_cache_dir, dev_db_path, ensure_dev_setup

    mountpoint.mkdir(parents=True, exist_ok=True)
    mountpoint = mountpoint.resolve()

    setup = dev_app()

    async def prepare() -> None:
        async with setup.admin_client() as api:
            await ensure_dev_setup(api)

    _run(prepare)
    del setup
    # A fresh app for the mount: it runs under its own trio.run.
    env = dev_app()

    from .sidecar.mount import MountConfig, run_mount

    config = MountConfig(
        mountpoint=mountpoint,
        workspace=DEV_WORKSPACE,
        cache_dir=dev_cache_dir(),
        admin_listen=admin_listen or None,
        debug=debug,
        log_format=log_format,
    )
    click.echo(
        f"memfuse dev: mounting workspace '{DEV_WORKSPACE}' at {mountpoint} "
        f"(database {dev_db_path()}); stop with Ctrl-C",
        err=True,
    )
    rc = run_mount(config, lambda: env.workspace_client(instance="dev"))
    click.echo(f"memfuse dev: unmounted {mountpoint}", err=True)
    sys.exit(rc)


def _mount_cache_dir(control_plane: str, workspace: str) -> Path:
    """Default sidecar cache: ``<user cache dir>/<workspace>-<sha256(url)[:8]>`` (or under
    ``$MEMFUSE_HOME/cache`` when set)."""
    import platformdirs

    home = os.environ.get("MEMFUSE_HOME")
    root = Path(home).expanduser() / "cache" if home else Path(platformdirs.user_cache_dir("memfuse"))
    digest = hashlib.sha256(control_plane.rstrip("/").encode()).hexdigest()[:8]
    return root / f"{workspace}-{digest}"


@cli.command()
@click.argument("mountpoint", type=click.Path(file_okay=False, path_type=Path), envvar="MEMFUSE_MOUNTPOINT")
@opt("--control-plane", required=True, metavar="URL", help="Control-plane URL.")
@opt("--workspace", required=True, metavar="WS", help="Workspace whose attached stores to mount.")
@opt("--token-file", type=click.Path(dir_okay=False, path_type=Path),
     help="File holding the workspace token (else $MEMFUSE_TOKEN).")
@opt("--cache-dir", type=click.Path(file_okay=False, path_type=Path),
     help="Local cache and outbox. Default: <user cache dir>/memfuse/<workspace>-<url hash>.")
@opt("--uid", type=int, help="Owner uid shown for files (default: this process's).")
@opt("--gid", type=int, help="Owner gid shown for files (default: this process's).")
@opt("--allow-other", is_flag=True, help="Let other users (e.g. the agent container) use the mount.")
@opt("--admin-listen", default=DEFAULT_ADMIN_LISTEN, show_default=True, metavar="HOST:PORT",
     help="Sidecar admin HTTP (/healthz, /readyz, /metrics, /v1/status); '' to disable.")
@opt("--commit-wait", type=float, default=10.0, show_default=True, metavar="S",
     help="Seconds close() waits for the commit.")
@opt("--fsync-timeout", type=float, default=60.0, show_default=True, metavar="S",
     help="Seconds fsync() waits for the commit before EIO.")
@opt("--drain-timeout", type=float, default=20.0, show_default=True, metavar="S",
     help="Seconds to drain the outbox on SIGTERM/SIGINT.")
@opt("--offline-after", type=float, default=10.0, show_default=True, metavar="S",
     help="Seconds without an answer from the control plane at start before the stores saved "
          "in the cache are mounted as they were (only when the outbox is empty).")
@opt("--instance", metavar="ID", help="Sidecar id recorded on versions. Default: the host name.")
@opt("--log-format", type=click.Choice(["json", "text"]), default="json", show_default=True,
     help="Log line format on stderr.")
@opt("--debug", is_flag=True, help="Verbose logging (and FUSE debug).")
def mount(
    mountpoint: Path,
    control_plane: str,
    workspace: str,
    token_file: Path | None,
    cache_dir: Path | None,
    uid: int | None,
    gid: int | None,
    allow_other: bool,
    admin_listen: str,
    commit_wait: float,
    fsync_timeout: float,
    drain_timeout: float,
    offline_after: float,
    instance: str | None,
    log_format: str,
    debug: bool,
) -> None:
    """Run the sidecar: mount WORKSPACE's stores at MOUNTPOINT until SIGTERM/SIGINT."""
    from .names import NameError_, check_slug

    try:
        check_slug(workspace)
    except NameError_ as e:
        raise click.BadParameter(e.reason, param_hint="--workspace") from None
    token = Target(control_plane, token_file).token()
    if token is None:
        raise click.UsageError("no token: pass --token-file F (or set MEMFUSE_TOKEN_FILE / MEMFUSE_TOKEN)")
    mountpoint.mkdir(parents=True, exist_ok=True)
    mountpoint = mountpoint.resolve()
    inst = instance or socket.gethostname()

    from .sidecar.mount import MountConfig, run_mount

    config = MountConfig(
        mountpoint=mountpoint,
        workspace=workspace,
        cache_dir=cache_dir or _mount_cache_dir(control_plane, workspace),
        uid=uid,
        gid=gid,
        allow_other=allow_other,
        commit_wait=commit_wait,
        fsync_timeout=fsync_timeout,
        drain_timeout=drain_timeout,
        offline_after=offline_after,
        admin_listen=admin_listen or None,
        debug=debug,
        log_format=log_format,
    )
    rc = run_mount(config, lambda: ApiClient(control_plane, token, instance=inst))
    sys.exit(rc)


@cli.command()
@click.argument("mountpoint", default="memory", type=click.Path(file_okay=False, path_type=Path),
                envvar="MEMFUSE_MOUNTPOINT")
@opt("--admin", "admin_url", metavar="URL",
     help="Ask the sidecar's admin API instead (GET URL/v1/status), e.g. http://127.0.0.1:9464.")
@opt("--json", "as_json", is_flag=True, envvar="MEMFUSE_JSON", help="Print the raw status JSON.")
def status(mountpoint: Path, admin_url: str | None, as_json: bool) -> None:
    """Print the sidecar status of the mount at MOUNTPOINT (its .memfuse/status.json), or,
    with --admin URL, of the sidecar serving that admin API: workspace, readiness, stores,
    outbox. Exits 1 with one line when nothing answers."""
    from .sidecar.admin import StatusUnavailable, fetch_status, format_status, read_status_file

    try:
        data = fetch_status(admin_url) if admin_url else read_status_file(mountpoint)
    except StatusUnavailable as e:
        raise click.ClickException(_one_line(str(e))) from None
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str) if as_json else format_status(data))


# ---------------------------------------------------------------- stores


@cli.group()
def store() -> None:
    """Create, list, show and update stores (admin)."""


def _store_rows(stores: list[Store]) -> str:
    rows = [
        [
            s.slug,
            s.default_type,
            f"{s.record_count}/{s.max_records}",
            f"{_human_bytes(s.usage_bytes)}/{_human_bytes(s.max_store_bytes)}",
            _human_bytes(s.max_record_bytes),
            _one_line(s.description),
        ]
        for s in stores
    ]
    return _table(rows, ["SLUG", "DEFAULT TYPE", "RECORDS", "USAGE", "MAX RECORD", "DESCRIPTION"])


_type_choice = click.Choice(list(RECORD_TYPES))


@store.command("create")
@click.argument("slug")
@opt("--description", default="", help="What the store is for (shown to agents).")
@opt("--default-type", type=_type_choice, default="project", show_default=True,
     help="Type of records without frontmatter type.")
@opt("--max-record-bytes", type=BYTES, help="Largest record (default 1 MiB). Accepts 512K, 1MiB, ...")
@opt("--max-store-bytes", type=BYTES, help="Total size limit (default 64 MiB).")
@opt("--max-records", type=click.IntRange(min=1), help="Record count limit (default 10000).")
@api_options
def store_create(target: Target, slug: str, description: str, default_type: str,
                 max_record_bytes: int | None, max_store_bytes: int | None,
                 max_records: int | None) -> None:
    """Create store SLUG."""
    from .names import NameError_, check_slug

    try:
        check_slug(slug)
    except NameError_ as e:
        raise click.BadParameter(e.reason, param_hint="SLUG") from None
    key = _key()
    s = _api(target, lambda api: with_retries(lambda: api.create_store(
        slug, description=description, default_type=default_type,
        max_record_bytes=max_record_bytes, max_store_bytes=max_store_bytes,
        max_records=max_records, idempotency_key=key)))
    click.echo(_store_rows([s]))


@store.command("list")
@opt("--json", "as_json", is_flag=True, envvar="MEMFUSE_JSON", help="Print JSON.")
@api_options
def store_list(target: Target, as_json: bool) -> None:
    """List every store with usage and limits."""
    stores = _api(target, lambda api: with_retries(api.list_stores))
    if as_json:
        click.echo(json.dumps([s.model_dump(mode="json") for s in stores], indent=2))
    else:
        click.echo(_store_rows(stores))


@store.command("show")
@click.argument("slug")
@api_options
def store_show(target: Target, slug: str) -> None:
    """Show store SLUG as JSON."""
    s = _api(target, lambda api: with_retries(lambda: api.get_store(slug)))
    click.echo(json.dumps(s.model_dump(mode="json"), indent=2))


@store.command("update")
@click.argument("slug")
@opt("--description", default=None, help="New description.")
@opt("--default-type", type=_type_choice, default=None, help="New default type.")
@opt("--max-record-bytes", type=BYTES, help="New record size limit.")
@opt("--max-store-bytes", type=BYTES, help="New total size limit.")
@opt("--max-records", type=click.IntRange(min=1), help="New record count limit.")
@api_options
def store_update(target: Target, slug: str, description: str | None, default_type: str | None,
                 max_record_bytes: int | None, max_store_bytes: int | None,
                 max_records: int | None) -> None:
    """Change the description, default type or limits of store SLUG (only what is given)."""
    fields = dict(description=description, default_type=default_type,
                  max_record_bytes=max_record_bytes, max_store_bytes=max_store_bytes,
                  max_records=max_records)
    if all(v is None for v in fields.values()):
        raise click.UsageError("nothing to update: give at least one option")
    key = _key()
    s = _api(target, lambda api: with_retries(
        lambda: api.update_store(slug, idempotency_key=key, **fields)))
    click.echo(_store_rows([s]))


# ---------------------------------------------------------------- workspaces, attachments, tokens


@cli.group()
def workspace() -> None:
    """Create and list workspaces (admin)."""


@workspace.command("create")
@click.argument("name")
@api_options
def workspace_create(target: Target, name: str) -> None:
    """Create workspace NAME."""
    from .names import NameError_, check_slug

    try:
        check_slug(name)
    except NameError_ as e:
        raise click.BadParameter(e.reason, param_hint="NAME") from None
    key = _key()
    w = _api(target, lambda api: with_retries(lambda: api.create_workspace(name, idempotency_key=key)))
    click.echo(f"created workspace {w.name}")


@workspace.command("list")
@api_options
def workspace_list(target: Target) -> None:
    """List workspaces with their attached stores."""

    async def body(api: ApiClient) -> list[list[str]]:
        rows = []
        for w in await with_retries(api.list_workspaces):
            atts = await with_retries(lambda: api.list_attachments(w.name))
            rows.append([w.name, _fmt_time(w.created_at),
                         ", ".join(f"{a.store.slug} ({a.access.value})" for a in atts)])
        return rows

    click.echo(_table(_api(target, body), ["WORKSPACE", "CREATED", "STORES"]))


@cli.command()
@click.argument("ws")
@click.argument("store_slug", metavar="STORE")
@opt("--read-only", is_flag=True, help="Attach read-only (default read-write).")
@opt("--instructions", default="", help="Instructions shown to the agent with this store.")
@api_options
def attach(target: Target, ws: str, store_slug: str, read_only: bool, instructions: str) -> None:
    """Attach STORE to workspace WS (or change its access / instructions)."""
    access = "read_only" if read_only else "read_write"
    key = _key()
    a = _api(target, lambda api: with_retries(
        lambda: api.attach(ws, store_slug, access, instructions, idempotency_key=key)))
    click.echo(f"attached {a.store.slug} to {a.workspace} ({a.access.value})")


@cli.command()
@click.argument("ws")
@click.argument("store_slug", metavar="STORE")
@api_options
def detach(target: Target, ws: str, store_slug: str) -> None:
    """Detach STORE from workspace WS."""
    key = _key()
    _api(target, lambda api: with_retries(lambda: api.detach(ws, store_slug, idempotency_key=key)))
    click.echo(f"detached {store_slug} from {ws}")


@cli.group()
def token() -> None:
    """Create API tokens (admin)."""


@token.command("create")
@opt("--workspace", metavar="WS", help="Scope the token to WS. Without it: an admin token.")
@opt("--name", default="", help="A label for the token.")
@api_options
def token_create(target: Target, workspace: str | None, name: str) -> None:
    """Create a token and print it on stdout (shown once; the server keeps only its hash)."""
    key = _key()
    t = _api(target, lambda api: with_retries(
        lambda: api.create_token(workspace or None, name, idempotency_key=key)))
    scope = f"workspace {t.workspace}" if t.workspace else "admin"
    click.echo(f"created {scope} token {t.id}" + (f" ({t.name})" if t.name else ""), err=True)
    click.echo(t.token)


# ---------------------------------------------------------------- records


async def _find(api: ApiClient, store_slug: str, path: str) -> Record:
    rec = await with_retries(lambda: api.find_record(store_slug, path, include_deleted=True))
    if rec is None:
        raise click.ClickException(f"no record at {store_slug}/{path}")
    return rec


@cli.command()
@click.argument("store_slug", metavar="STORE")
@click.argument("path")
@api_options
def history(target: Target, store_slug: str, path: str) -> None:
    """Show every version of the record at PATH in STORE (deleted records too)."""

    async def body(api: ApiClient) -> tuple[Record, list[Any]]:
        rec = await _find(api, store_slug, path)
        return rec, await with_retries(lambda: api.versions(store_slug, rec.id))

    rec, versions = _api(target, body)
    rows = [
        [
            str(v.version),
            v.operation.value + (" (redacted)" if v.redacted else ""),
            _fmt_time(v.created_at),
            v.actor,
            v.type or "-",
            str(v.size),
            v.sha256[:12],
            v.path if v.path != path else "",
        ]
        for v in versions
    ]
    state = "deleted" if rec.deleted else "live"
    click.echo(f"record {rec.id} ({state}, version {rec.version})")
    click.echo(_table(rows, ["VERSION", "OPERATION", "TIME", "ACTOR", "TYPE", "SIZE", "SHA256", "PATH"]))


@cli.command()
@click.argument("store_slug", metavar="STORE")
@click.argument("path")
@opt("--version", "version_n", envvar=None, type=click.IntRange(min=1), metavar="N",
     help="Show version N (default: the current content).")
@api_options
def show(target: Target, store_slug: str, path: str, version_n: int | None) -> None:
    """Print the content of the record at PATH in STORE, exactly (no added newline)."""

    async def body(api: ApiClient) -> str:
        rec = await _find(api, store_slug, path)
        if version_n is not None:
            v = await with_retries(lambda: api.version(store_slug, rec.id, version_n))
            if v.redacted or v.content is None:
                raise click.ClickException(f"version {version_n} of {store_slug}/{path} is redacted")
            return v.content
        if rec.deleted:
            raise click.ClickException(
                f"{store_slug}/{path} is deleted (last version {rec.version}); "
                "see `memfuse history` and use --version N"
            )
        full = await with_retries(lambda: api.get_record(store_slug, rec.id, content=True))
        return full.content or ""

    content = _api(target, body)
    _write_exact(content)


@cli.command()
@click.argument("store_slug", metavar="STORE")
@click.argument("path")
@opt("--version", "version_n", envvar=None, type=click.IntRange(min=1), required=True, metavar="N",
     help="The version whose content, type and path to restore.")
@api_options
def restore(target: Target, store_slug: str, path: str, version_n: int) -> None:
    """Restore the record at PATH in STORE to version N (undeletes a deleted record)."""
    key = _key()

    async def body(api: ApiClient) -> Record:
        rec = await _find(api, store_slug, path)
        return await with_retries(lambda: api.restore(store_slug, rec.id, version_n, idempotency_key=key))

    rec = _api(target, body)
    click.echo(f"restored {store_slug}/{rec.path} to version {version_n} (now version {rec.version})")


@cli.command()
@click.argument("store_slug", metavar="STORE")
@click.argument("path")
@opt("--version", "version_n", envvar=None, type=click.IntRange(min=1), required=True, metavar="N",
     help="The version whose content to remove (not the current one).")
@api_options
def redact(target: Target, store_slug: str, path: str, version_n: int) -> None:
    """Remove the content of version N of the record at PATH in STORE (admin; audit kept)."""
    key = _key()

    async def body(api: ApiClient) -> Any:
        rec = await _find(api, store_slug, path)
        return await with_retries(lambda: api.redact(store_slug, rec.id, version_n, idempotency_key=key))

    _api(target, body)
    click.echo(f"redacted version {version_n} of {store_slug}/{path}")


@cli.command()
@opt("--workspace", required=True, metavar="WS", help="Workspace to render the prompt block for.")
@opt("--mount-root", metavar="DIR", help="Where the stores are mounted (server default /mnt/memory).")
@opt("--max-bytes", type=click.IntRange(min=1024), metavar="N",
     help="Bound of the whole block in bytes (server default 100,000); what does not fit is "
          "replaced by a marker that says what was left out.")
@api_options
def context(target: Target, workspace: str, mount_root: str | None, max_bytes: int | None) -> None:
    """Print the prompt block of workspace WS: its stores and their MEMORY.md indexes."""
    text = _api(target, lambda api: with_retries(
        lambda: api.context(workspace, mount_root, max_bytes=max_bytes)))
    click.echo(text, nl=not text.endswith("\n"))


# ---------------------------------------------------------------- import / export


@dataclass
class _ImportReport:
    """What ``memfuse import`` did, file by file."""

    done: list[tuple[str, str, str | None]]  # (action, path, type)
    refused: list[tuple[str, str]]  # (path, reason)
    skipped: list[str]


def _shown(path: str) -> str:
    """A path for the terminal: undecodable bytes of a file name shown as U+FFFD."""
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _import_walk(root: Path) -> tuple[list[tuple[str, Path]], list[str]]:
    """The files under ``root`` to import, as (record path, file) in path order, and what is
    skipped: hidden files and directories (``.git/``, ``.DS_Store``, ``.memfuse/``), editor
    and tool temporaries (DESIGN §3's local-only names: ``*~``, ``.#*``, ``#*#``, ``*.swp``,
    ``4913``, ...), symbolic links and anything that is not a regular file."""
    from .names import is_local_only

    files: list[tuple[str, Path]] = []
    skipped: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root).as_posix()
        prefix = "" if rel == "." else rel + "/"
        keep = []
        for d in sorted(dirnames):
            if d.startswith(".") or os.path.islink(os.path.join(dirpath, d)):
                skipped.append(prefix + d + "/")
            else:
                keep.append(d)
        dirnames[:] = keep
        for f in sorted(filenames):
            full = Path(dirpath, f)
            if f.startswith(".") or is_local_only(f) or full.is_symlink() or not full.is_file():
                skipped.append(prefix + f)
            else:
                files.append((prefix + f, full))
    files.sort(key=lambda x: x[0].encode("utf-8", "surrogateescape"))
    return files, skipped


async def _import_files(
    api: ApiClient, store_slug: str, files: list[tuple[str, Path]], dry_run: bool, echo: Callable[[str], None]
) -> _ImportReport:
    from .client import Conflict, PermanentError
    from .content import ContentError, check_secrets, check_type, check_utf8, record_type
    from .models import sha256_hex
    from .names import NameError_, check_path

    store_info = await with_retries(lambda: api.get_store(store_slug))
    live: dict[str, Record] = {}
    cursor: str | None = None
    while True:
        page = await with_retries(lambda: api.list_records(store_slug, cursor=cursor, limit=1000))
        live.update({r.path: r for r in page.records})
        if not page.next_cursor:
            break
        cursor = page.next_cursor

    report = _ImportReport([], [], [])

    def refuse(path: str, reason: str) -> None:
        report.refused.append((path, _one_line(reason)))

    for path, file in files:
        try:
            check_path(path)
        except NameError_ as e:
            refuse(path, f"{e.reason} [{'path_too_long' if e.too_long else 'invalid_path'}]")
            continue
        try:
            data = file.read_bytes()
        except OSError as e:
            refuse(path, f"cannot read: {e.strerror}")
            continue
        try:
            text = check_utf8(data)
        except ContentError as e:
            refuse(path, f"{e.reason} [{e.code}]")
            continue
        old = live.get(path)
        if old is not None and old.sha256 == sha256_hex(data):
            report.done.append(("unchanged", path, old.type))
            echo(f"unchanged {_shown(path)} ({old.type or 'index'})")
            continue
        if dry_run:
            # The server's rules, checked here; a real import lets the server decide.
            fallback = (old.type if old is not None else None) or store_info.default_type
            try:
                if len(data) > store_info.max_record_bytes:
                    raise ContentError(
                        f"record is {len(data)} bytes, the store allows {store_info.max_record_bytes} [record_too_large]"
                    )
                rtype = record_type(path, text, None, fallback)
                check_type(rtype)
                check_secrets(text)
            except ContentError as e:
                code = f" [{e.code}]" if type(e) is not ContentError else ""
                refuse(path, e.reason + code)
                continue
            action = "would update" if old is not None else "would create"
            report.done.append((action, path, rtype))
            echo(f"{action} {_shown(path)} ({rtype or 'index'})")
            continue
        key = _key()
        try:
            if old is None:
                try:
                    rec = await with_retries(
                        lambda: api.create_record(store_slug, path, text, idempotency_key=key)
                    )
                    action = "created"
                except Conflict as e:  # created meanwhile: update it instead
                    if e.code != "path_exists" or not e.record_id:
                        raise
                    rid, key2 = e.record_id, _key()
                    rec = await with_retries(
                        lambda: api.update_record(store_slug, rid, text, idempotency_key=key2)
                    )
                    action = "updated"
            else:
                oid = old.id
                rec = await with_retries(lambda: api.update_record(store_slug, oid, text, idempotency_key=key))
                action = "updated"
        except PermanentError as e:
            what = e.detail or e.title or str(e)
            refuse(path, f"{what} [{e.code or e.status}]")
            continue
        report.done.append((action, path, rec.type))
        echo(f"{action} {_shown(path)} ({rec.type or 'index'})")
    return report


@cli.command("import")
@click.argument("store_slug", metavar="STORE")
@click.argument("directory", metavar="DIR",
                type=click.Path(exists=True, file_okay=False, readable=True, path_type=Path))
@opt("--dry-run", is_flag=True, help="Check every file against the store's rules; write nothing.")
@api_options
def import_(target: Target, store_slug: str, directory: Path, dry_run: bool) -> None:
    """Load the memory files under DIR into STORE, keeping their paths.

    Every regular file becomes the record at its path relative to DIR (a Claude Code memory
    directory with MEMORY.md and frontmatter files, a FACT.md + JOURNAL.jsonl workspace, a
    single user_profile.md, ...): created when the path is new, updated when its content
    differs, left alone when identical. Types come from each file's frontmatter (`type:` or
    `metadata.type:`), else the store's default type (or, on update, the record's current
    type). Hidden files and directories, editor temporaries and symbolic links are skipped.

    Files the store refuses (not UTF-8, unknown type, a secret, too large, bad name, store
    full) are listed at the end; the others are imported. Exits 1 only when files were found
    and none could be imported.
    """
    files, skipped = _import_walk(directory)
    report = _api(target, lambda api: _import_files(api, store_slug, files, dry_run, click.echo))
    report.skipped = skipped
    counts: dict[str, int] = {}
    for action, _, _ in report.done:
        counts[action] = counts.get(action, 0) + 1
    order = ["would create", "would update", "created", "updated", "unchanged"]
    parts = [f"{counts[a]} {a}" for a in order if counts.get(a)]
    verb = "checked" if dry_run else "imported"
    click.echo(
        f"{verb} {len(report.done)} of {len(files)} file(s) into {store_slug}"
        + (f": {', '.join(parts)}" if parts else "")
        + f"; {len(report.refused)} refused; {len(report.skipped)} skipped"
        + (" (dry run: nothing written)" if dry_run else "")
    )
    if report.skipped:
        click.echo("skipped: " + ", ".join(_shown(s) for s in report.skipped))
    if report.refused:
        click.echo("refused:")
        for path, reason in report.refused:
            click.echo(f"  {_shown(path)}: {reason}")
    if files and not report.done:
        raise click.ClickException(f"nothing imported: all {len(files)} file(s) were refused")


@cli.command()
@click.argument("store_slug", metavar="STORE")
@click.argument("directory", metavar="DIR", type=click.Path(file_okay=False, path_type=Path))
@api_options
def export(target: Target, store_slug: str, directory: Path) -> None:
    """Write every live record of STORE under DIR at its path, byte for byte.

    Directories are created as needed; a file that exists at a record's path is replaced
    (atomically); other files under DIR are left alone. Each file's modification time is the
    record's last update. `memfuse import` of the result gives the same store back.
    """
    from .names import NameError_, check_path

    records, _ = _api(target, lambda api: with_retries(lambda: api.snapshot(store_slug, content=True)))
    directory.mkdir(parents=True, exist_ok=True)
    root = directory.resolve()
    failed: list[tuple[str, str]] = []
    total = 0
    for rec in records:
        try:
            check_path(rec.path)
            dest = root.joinpath(*rec.path.split("/"))
            parent = dest.parent.resolve()  # through any symbolic link already there
            if parent != root and root not in parent.parents:
                raise OSError(f"{dest.parent} leads outside {root}")
            parent.mkdir(parents=True, exist_ok=True)
            if dest.is_dir() and not dest.is_symlink():
                raise OSError("a directory is in the way")
            data = (rec.content or "").encode("utf-8")
            tmp = parent / f".memfuse-export-{uuid.uuid4().hex}"
            try:
                with open(tmp, "xb") as fh:
                    fh.write(data)
                ts = rec.updated_at.timestamp()
                os.utime(tmp, (ts, ts))
                os.replace(tmp, parent / dest.name)
            finally:
                if tmp.exists():
                    tmp.unlink()
            total += len(data)
        except NameError_ as e:
            failed.append((rec.path, e.reason))
        except OSError as e:
            failed.append((rec.path, e.strerror or str(e)))
    click.echo(f"exported {len(records) - len(failed)} record(s), {_human_bytes(total)}, from {store_slug} to {directory}")
    if failed:
        click.echo("failed:")
        for path, reason in failed:
            click.echo(f"  {_shown(path)}: {_one_line(reason)}")
        raise click.ClickException(f"{len(failed)} record(s) could not be written")


if __name__ == "__main__":  # pragma: no cover
    main()
