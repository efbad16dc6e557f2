"""The commands that run a process, or look at a running one: ``serve``, ``dev``, ``mount``, ``status``.

``serve`` runs the reference control plane, ``dev`` the embedded default (control plane
in-process and a mount in the foreground), ``mount`` the sidecar against a remote control
plane; ``status`` reads a running sidecar's status. The admin and record commands are in
``admin`` and ``records``.
"""
from __future__ import annotations

import getpass
import hashlib
import json
import logging
import os
import re
import secrets
import socket
import shutil
import sys
from pathlib import Path

import click
from click.core import ParameterSource

from memfuse.cli.common import (
    BYTES,
    DEFAULT_ADMIN_LISTEN,
    DEFAULT_LISTEN,
    SIDECAR_ADMIN_TOKEN_ENV,
    Seconds,
    Target,
    _one_line,
    _run,
    cli,
    control_plane_token_unread,
    opt,
)
from memfuse.client import ApiClient
from memfuse.defs import RECORD_BODY_MAX, RECORD_BODY_MIN
from memfuse.tokenfile import TokenFile, TokenFileError


#: the variable of ``mount --admin-socket/--no-admin-socket`` (a boolean): MEMFUSE_ADMIN_SOCKET
#: is the socket's path, for ``memfuse status`` and ``memfuse mounts`` (attack26 F5: one name,
#: one type; docs/CLI.md)
MOUNT_ADMIN_SOCKET_ENV = "MEMFUSE_MOUNT_ADMIN_SOCKET"


def _old_admin_socket_switch() -> bool | None:
    """``mount``'s switch from MEMFUSE_ADMIN_SOCKET as releases before session 26 read it (a
    boolean word: ``false``, ``0``...), said once on stderr; None when that variable is not a
    boolean word (unset, or the socket path ``memfuse status`` reads: not the mount's)."""
    value = os.environ.get("MEMFUSE_ADMIN_SOCKET", "").strip().lower()
    try:  # click's own boolean words, as a flag's variable reads them
        switch = click.BOOL.convert(value, None, None) if value else None
    except click.BadParameter:
        return None
    if switch is None:
        return None
    click.echo(f"memfuse: MEMFUSE_ADMIN_SOCKET={value} read as {MOUNT_ADMIN_SOCKET_ENV}={value}; "
               f"set {MOUNT_ADMIN_SOCKET_ENV} instead (MEMFUSE_ADMIN_SOCKET is the socket's path, "
               "for memfuse status and memfuse mounts)", err=True)
    return bool(switch)


def _admin_token(admin_token_file: Path | None) -> tuple[str, Path, bool]:
    """Return (token, file, generated). Reads ``admin_token_file`` (default
    ``<data dir>/admin.token``); when that file does not exist, creates it (mode 0600) with a
    new random token. A named file that exists but is empty or unreadable is a usage error
    (never overwritten: it may be a mounted Secret that is not there yet)."""
    from memfuse.devenv import data_dir
    from memfuse.privfile import write_private

    path = admin_token_file if admin_token_file is not None else data_dir(create=False) / "admin.token"
    try:
        tok = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        tok = None
    except OSError as e:
        raise click.UsageError(f"cannot read admin token file {path}: {e.strerror}") from None
    if tok:
        if admin_token_file is None:
            os.chmod(path, 0o600)
        return tok, path, False
    if tok is not None and admin_token_file is not None:
        raise click.UsageError(f"admin token file {path} is empty")
    tok = "mfa_" + secrets.token_urlsafe(32)
    try:
        if admin_token_file is None:
            data_dir()  # <data dir> itself, made 0700 when missing
        write_private(path, tok + "\n")
    except OSError as e:
        raise click.UsageError(f"cannot create admin token file {path}: {e.strerror}") from None
    return tok, path, True


@cli.command()
@opt("--db", metavar="URL", help="Database URL: sqlite:///path or postgresql://... "
     "Default: the dev database (sqlite:///<data dir>/dev.db). A new SQLite file is created "
     "mode 0600, its missing directory mode 0700.")
@opt("--listen", default=DEFAULT_LISTEN, show_default=True, metavar="HOST:PORT",
     help="Address to serve HTTP on.")
@opt("--admin-token-file", type=click.Path(dir_okay=False, path_type=Path),
     help="File holding the bootstrap admin token (default: <data dir>/admin.token). Created "
     "(mode 0600) with a new random token when it does not exist; an existing file is read.")
@opt("--migrate", is_flag=True,
     help="Upgrade the database schema before serving (default: refuse a database behind the "
     "newest revision and name `memfuse db upgrade`; the dev database is always upgraded).")
@opt("--no-streams", is_flag=True,
     help="Do not stream change feeds and events (stream=true is answered as a long-poll, as "
     "by a server without streams; sidecars then long-poll). For a proxy that buffers responses.")
@opt("--max-requests", type=click.IntRange(min=1), default=128, show_default=True,
     help="Ordinary requests in the app at once (a request counts once its body is read); "
     "one more is answered 503 overloaded with Retry-After.")
@opt("--max-requests-per-token", type=click.IntRange(min=1), default=None,
     show_default="a quarter of --max-requests",
     help="Ordinary requests of one token in the app at once; one more is answered 429 "
     "too_many_requests with Retry-After, so one token cannot hold every request slot.")
@opt("--read-timeout", type=Seconds(0.1), default=30.0, show_default=True, metavar="SECONDS",
     help="Time a read (GET under /v1/) may wait for a read slot and work: its database work is "
     "then interrupted and it is answered 504 timeout. Its client's disconnect interrupts it at once.")
@opt("--max-reads", type=click.IntRange(min=1), default=8, show_default=True,
     help="Reads (GET under /v1/, /ui/) the app works on at once; the others wait, a slot going "
     "to each waiting token in turn. Bounds the CPU the reads take from every other client.")
@opt("--max-reads-per-token", type=click.IntRange(min=1), default=2, show_default=True,
     help="Reads of one token (or one address without a token) the app works on at once; its "
     "others wait their turn.")
@opt("--max-streams", type=click.IntRange(min=1), default=20_000, show_default=True,
     help="Long-lived responses at once (long-polls, streams, console live pages); one more "
     "is answered 429 too_many_streams with Retry-After.")
@opt("--max-streams-per-token", type=click.IntRange(min=1), default=64, show_default=True,
     help="Long-lived responses at once per token (429 too_many_long_polls beyond).")
@opt("--max-streams-per-account", type=click.IntRange(min=1), default=None, show_default="2/5 of --max-streams",
     help="Long-lived responses at once per account, all its tokens together (429 "
     "too_many_account_streams beyond): one account cannot take the slots other accounts' "
     "sidecars need for their change feeds. Root admin and static tokens share one. Set it to "
     "--max-streams on a server with one account.")
@opt("--max-body", type=BYTES, default=str(RECORD_BODY_MAX), show_default="48MiB+64KiB", metavar="SIZE",
     help="Largest body of a record write, batch, memory-tool call, console form or /mcp "
     "request (413 beyond; /mcp takes at least 4 MiB, other endpoints 1 MiB). It bounds a store's max_record_bytes: "
     "at most (SIZE - 64 KiB) / 6, as a record's JSON body may be six times its size (a control "
     "character is escaped as \\u00XX; 8 MiB by default); at least 6MiB+64KiB. A store whose "
     "max_record_bytes is over it (set under a larger SIZE) is named in a warning at start.")
@opt("--header-timeout", type=Seconds(0.1), default=5.0, show_default=True, metavar="SECONDS",
     help="Time for a request's headers to arrive (also how long an idle keep-alive connection "
     "stays open).")
@opt("--body-timeout", type=Seconds(0.1), default=60.0, show_default=True, metavar="SECONDS",
     help="Time for a whole request body to arrive (408 beyond).")
@opt("--body-read-timeout", type=Seconds(0.1), default=10.0, show_default=True, metavar="SECONDS",
     help="Longest wait for the next piece of a request body (408 beyond).")
@opt("--max-unauthenticated-per-address", type=click.IntRange(min=0), default=64, show_default=True,
     help="Connections per client address that have not shown a valid token yet (more are "
     "closed at once); 0: no cap. Behind a proxy every client has the proxy's address: raise it.")
@opt("--max-unauthenticated", type=click.IntRange(min=0), default=1024, show_default=True,
     help="Connections that have not shown a valid token yet, all addresses together; at the cap "
     "a new one whose request head has not arrived (within 0.1 s) is closed, and one whose head "
     "has closes the one idle the longest (its header deadline furthest gone). 0: no cap.")
@opt("--stale-after", type=click.IntRange(min=0), default=90, show_default=True, metavar="DAYS",
     help="A record unchanged for DAYS is stale: the prompt block names the MEMORY.md entries "
     "linking it and the console lists it (also a record past its frontmatter review_after). 0: off.")
@opt("--expiry-interval", type=Seconds(), default=60.0, show_default=True, metavar="SECONDS",
     help="How often to delete the records past their frontmatter `expires` (a deleted version, "
     "restorable). 0: never.")
@opt("--consolidation-model-url", metavar="URL",
     help="Base URL of the Anthropic Messages API that consolidation jobs call (the SDK posts to "
     "URL/v1/messages). With --consolidation-api-key-file it turns consolidation jobs on.")
@opt("--consolidation-api-key-file", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
     help="File holding the Messages API key (read at each job's start; never logged).")
@opt("--consolidation-model", default="claude-sonnet-4-5", show_default=True,
     help="Model a job uses when its request names none.")
@opt("--consolidation-timeout", type=Seconds(1), default=600.0, show_default=True,
     metavar="SECONDS", help="How long a consolidation job may run (the model call included).")
@opt("--consolidation-max-input-bytes", type=click.IntRange(min=1), default=512 * 1024, show_default=True,
     help="Largest store (paths and contents of its live records) a job reads; larger: refused.")
@opt("--consolidation-max-output-tokens", type=click.IntRange(min=1), default=32_000, show_default=True,
     help="The model's max_tokens; an answer cut there fails the job.")
@opt("--consolidation-idle-after", type=Seconds(), default=0.0, show_default=True,
     metavar="SECONDS", help="Scheduled maintenance: consolidate a store once it has been idle this long "
     "(with --consolidation-interval; 0: off).")
@opt("--consolidation-interval", type=Seconds(), default=0.0, show_default=True,
     metavar="SECONDS", help="Scheduled maintenance: at most one scheduled job per store in this time (0: off).")
@opt("--consolidation-schedule-output", type=click.Choice(["new_store", "in_place"]), default="new_store",
     show_default=True, help="Where scheduled jobs write.")
@opt("--consolidation-max-unreviewed", type=click.IntRange(min=0), default=2, show_default=True,
     help="Jobs a workspace token starts: refused (409 review_pending) while the store has this many "
     "new-store outputs waiting for review (not attached, not archived) or running. 0: no bound.")
@opt("--consolidation-workspace-jobs-per-hour", type=click.IntRange(min=0), default=10, show_default=True,
     help="Jobs one workspace token may start in any hour (429 rate_limited past it). 0: no bound.")
@opt("--trusted-proxy", "trusted_proxies", multiple=True, metavar="CIDR",
     help="Address or CIDR block of a TLS-terminating proxy whose X-Forwarded-Proto is believed "
     "(repeatable; the environment variable takes a comma-separated list). A request through it "
     "that came over https gets the console's Secure __Host- session cookie. Default: none "
     "(the header is ignored).")
@opt("--db-file", type=click.Path(dir_okay=False, path_type=Path),
     help="Read the database URL from this file instead (e.g. a mounted Secret, so the password "
     "is in no flag, environment variable or process listing); surrounding whitespace is ignored.")
@opt("--log-format", type=click.Choice(["json", "text"]), default="json", show_default=True,
     help="Log lines as JSON objects (one per event, the exception as a field) or as text.")
@opt("--debug", is_flag=True, help="Verbose logging.")
def serve(db: str | None, listen: str, admin_token_file: Path | None, migrate: bool, no_streams: bool,
          max_requests: int, max_requests_per_token: int | None, read_timeout: float,
          max_reads: int, max_reads_per_token: int,
          max_streams: int, max_streams_per_token: int, max_streams_per_account: int | None, max_body: int,
          header_timeout: float, body_timeout: float, body_read_timeout: float,
          max_unauthenticated_per_address: int, max_unauthenticated: int, stale_after: int, expiry_interval: float,
          consolidation_model_url: str | None, consolidation_api_key_file: Path | None,
          consolidation_model: str, consolidation_timeout: float, consolidation_max_input_bytes: int,
          consolidation_max_output_tokens: int, consolidation_idle_after: float, consolidation_interval: float,
          consolidation_schedule_output: str, consolidation_max_unreviewed: int,
          consolidation_workspace_jobs_per_hour: int,
          trusted_proxies: tuple[str, ...], db_file: Path | None, log_format: str, debug: bool) -> None:
    """Run the reference control plane (HTTP API v1) on a database."""
    from memfuse.cli.db import database_errors
    from memfuse.devenv import data_dir, dev_db_url
    from memfuse.sidecar.logs import setup_logging

    setup_logging(debug, log_format)
    if db_file is not None:
        if db:
            raise click.UsageError("give the database as --db or as --db-file, not both")
        db = _read_db_file(db_file)
    if max_body < RECORD_BODY_MIN:  # every store's default max_record_bytes fits (defs.largest_record)
        raise click.BadParameter(f"must be at least {RECORD_BODY_MIN} bytes (6MiB+64KiB): a record of a "
                                 "store's default 1 MiB must fit in one request", param_hint="--max-body")
    from memfuse.server.proxies import parse_trusted

    try:
        parse_trusted(trusted_proxies)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--trusted-proxy") from None
    # What a start that fails (a database without the schema, a port in use, ...) made is
    # removed again: the data dir, the admin token file, the SQLite file and its directory.
    made = _MadeFiles()
    try:
        made.watch(data_dir(create=False))
        url = db or dev_db_url()
        made.watch_sqlite(url)
        made.watch(admin_token_file if admin_token_file is not None else data_dir(create=False) / "admin.token")
        token, token_path, generated = _admin_token(admin_token_file)
        from memfuse.procmem import fix_mmap_threshold, start_trimmer
        from memfuse.server.app import create_app
        from memfuse.server.serve import AlreadyServing, claim_database, release_database, tune_gc
        from memfuse.server.serve import serve as serve_app

        tune_gc()  # thousands of streams: see memfuse.server.serve.tune_gc
        fix_mmap_threshold()  # malloc's policy: memfuse.procmem (attack18 F10, appends)
        start_trimmer()  # what bursts of big bodies leave free goes back within seconds

        with database_errors(url):
            app = create_app(url, static_tokens={token: None}, schema="migrate" if migrate or not db else "check",
                             streams=not no_streams, max_inflight=max_requests,
                             max_inflight_per_token=max_requests_per_token, read_budget=read_timeout,
                             max_reads=max_reads, max_reads_per_token=max_reads_per_token,
                             max_long_polls=max_streams,
                             max_long_polls_per_token=max_streams_per_token,
                             max_long_polls_per_account=max_streams_per_account, max_body=max_body,
                             header_timeout=header_timeout, body_timeout=body_timeout,
                             receive_timeout=body_read_timeout,
                             max_unauthenticated_per_address=max_unauthenticated_per_address,
                             max_unauthenticated=max_unauthenticated,
                             trusted_proxies=trusted_proxies)
            # a store allowing records larger than --max-body carries is said at start, never
            # found at a write's 413 (docs/DEPLOY.md, "Request limits")
            app.state.service.stores.warn_stores_over_body_bound()
        app.state.service.stale_after_days = stale_after
        app.state.service.expiry_interval = expiry_interval
        cons = app.state.service.consolidation
        if bool(consolidation_model_url) != (consolidation_api_key_file is not None):
            app.state.service.db.dispose()
            raise click.UsageError("consolidation jobs need both --consolidation-model-url and "
                                   "--consolidation-api-key-file")
        cons.model_url, cons.api_key_file = consolidation_model_url or None, consolidation_api_key_file
        cons.model, cons.timeout = consolidation_model, consolidation_timeout
        cons.max_input_bytes, cons.max_output_tokens = consolidation_max_input_bytes, consolidation_max_output_tokens
        cons.max_output_bytes = max(cons.max_output_bytes, consolidation_max_input_bytes)
        cons.idle_after, cons.interval = consolidation_idle_after, consolidation_interval
        cons.schedule_output = consolidation_schedule_output  # type: ignore[assignment]
        cons.max_unreviewed = consolidation_max_unreviewed
        cons.workspace_jobs_per_hour = consolidation_workspace_jobs_per_hour
        if cons.enabled:  # the SDK takes seconds to import: not in the first job's time
            import threading

            threading.Thread(target=lambda: __import__("anthropic"), name="import-anthropic", daemon=True).start()
        try:
            claim_database(app)  # SQLite: one replica per file
        except AlreadyServing as e:
            app.state.service.db.dispose()
            raise click.ClickException(str(e)) from None
        try:
            _serve_until_signal(app, url, listen, token_path, generated, serve_app, made)
        finally:
            # every pooled connection closed: SQLite checkpoints its WAL into the file and
            # removes the -wal and -shm files, so the .db alone holds everything (copy it, back
            # it up)
            app.state.service.db.dispose()
            release_database(app)
    except BaseException:
        made.remove()  # nothing once serving started (made.keep())
        raise
    logging.getLogger("memfuse.serve").info("memfuse serve: stopped")


def _read_db_file(path: Path) -> str:
    """The database URL in ``path`` (``--db-file``), surrounding whitespace stripped. Raises
    ``click.UsageError`` (naming the file, never its content) when it cannot be read, is not
    UTF-8, is empty, or holds more than one line."""
    try:
        text = path.read_text(encoding="utf-8").strip()
    except OSError as e:
        raise click.UsageError(f"cannot read --db-file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise click.UsageError(f"--db-file {path} is not UTF-8 text") from None
    if not text:
        raise click.UsageError(f"--db-file {path} is empty")
    if "\n" in text:
        raise click.UsageError(f"--db-file {path} must hold one line: the database URL")
    return text


class _MadeFiles:
    """The files and directories ``memfuse serve`` may create before it serves, each noted
    only when it did not exist yet, so a failed start removes exactly what it made (files,
    then the directories when empty) and nothing the user had. ``keep()`` once serving."""

    def __init__(self) -> None:
        self._paths: list[Path] = []
        self._kept = False

    def watch(self, path: Path) -> None:
        """Note ``path`` and its missing ancestors (they would be created for it)."""
        path = Path(os.path.abspath(path))
        for p in (path, *path.parents):
            if os.path.lexists(p):
                break
            self._paths.append(p)

    def watch_sqlite(self, url: str) -> None:
        """Note the file of an SQLite ``url``, its ``-wal``, ``-shm`` and ``-journal`` and the
        one-replica lock ``<file>.serve.lock`` (:func:`memfuse.server.serve.claim_sqlite_file`)."""
        try:
            from memfuse.server.db import normalize_db_url

            u = normalize_db_url(url)
        except Exception:  # noqa: BLE001 — a bad URL fails later, with its message
            return
        if u.get_backend_name() != "sqlite" or u.database in (None, "", ":memory:") or u.query.get("uri"):
            return
        self.watch(Path(u.database))
        for suffix in ("-wal", "-shm", "-journal"):
            self.watch(Path(u.database + suffix))
        self.watch(Path(os.path.realpath(u.database) + ".serve.lock"))

    def keep(self) -> None:
        """Serving: what was made stays."""
        self._kept = True

    def remove(self) -> None:
        """Remove what was made (deepest first; a directory only when empty), unless kept."""
        if self._kept:
            return
        for p in sorted(set(self._paths), key=lambda p: len(p.parts), reverse=True):
            try:
                if p.is_dir() and not p.is_symlink():
                    p.rmdir()
                else:
                    p.unlink()
            except OSError:  # not made after all, or not empty: left as it is
                pass


def _serve_until_signal(app, url: str, listen: str, token_path: Path, generated: bool, serve_app,
                        made: _MadeFiles) -> None:
    """``memfuse serve``'s loop: serve ``app`` on ``listen`` until SIGINT or SIGTERM;
    ``made.keep()`` once it listens."""
    async def run() -> None:
        import signal

        import trio

        async with trio.open_nursery() as nursery:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                try:
                    bound = await nursery.start(serve_app, app, listen)
                except* OSError as group:  # the address: in use, not ours, bad host
                    e = group.exceptions[0]
                    raise click.ClickException(
                        f"cannot listen on {listen}: {getattr(e, 'strerror', None) or e}") from None
                made.keep()
                say = logging.getLogger("memfuse.serve").info  # log lines: JSON by default
                say(f"memfuse serve: admin token {'written to' if generated else 'read from'} {token_path}")
                say(f"memfuse serve: listening on {bound or 'http://' + listen} "
                    f"(database {_safe_url(url)}); stop with Ctrl-C")
                say(f"memfuse serve: web console at {bound or 'http://' + listen}/ui/ (log in with a token)")
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    break

    _run(run)


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
@opt("--console-listen", metavar="HOST:PORT", default="127.0.0.1:8765", show_default=True,
     help="Serve the web console (and the API) here; a free port when this one is taken. "
          "'off': no console.")
@opt("--nonempty", is_flag=True,
     help="Mount even when MOUNTPOINT holds files; they are hidden (not changed) while dev runs.")
@opt("--actor", metavar="NAME",
     help="Who writes through this mount, recorded on every version (history, the console, the "
          "API's updated_by) as ws:dev/NAME. Default: USER@HOST.")
def dev(mountpoint: Path, admin_listen: str | None, log_format: str, debug: bool, console_listen: str,
        nonempty: bool, actor: str | None) -> None:
    """Mount memory at MOUNTPOINT (default ./memory) with everything built in: store `default` of workspace `dev`, the control plane in process on the dev database.

    The control plane runs in-process on the dev database, workspace `dev` with store
    `default` attached, mounted at MOUNTPOINT (default ./memory) in the foreground.
    The web console is served on 127.0.0.1 and a one-time login link is printed at start.
    A MOUNTPOINT that holds files is refused unless --nonempty (libfuse 2's `nonempty`
    rule): the mount would hide them."""
    from memfuse.devenv import dev_db_path
    from memfuse.server.serve import AlreadyServing, claim_sqlite_file

    # one memfuse dev (or serve) per dev database: refused at once, before anything is built
    try:
        claim = claim_sqlite_file(dev_db_path(), "dev")
    except AlreadyServing as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:
        raise click.ClickException(f"cannot lock {dev_db_path()}: {e.strerror}") from None
    try:
        _dev(mountpoint, admin_listen, log_format, debug, console_listen, claim, nonempty,
             actor_name(actor or default_actor()))
    finally:
        os.close(claim)


def _dev(mountpoint: Path, admin_listen: str | None, log_format: str, debug: bool, console_listen: str,
         claim: int, nonempty: bool = False, actor: str = "dev") -> None:
    """``memfuse dev`` once the dev database's lock (the descriptor ``claim``) is held."""
    from memfuse.devenv import (
        DEV_WORKSPACE,
        ConsoleServer,
        dev_app,
        dev_cache_dir,
        dev_db_path,
        ensure_dev_setup,
    )

    from memfuse.sidecar.mount import StartError, check_mountpoint_free, clean_stale_mount

    # a mountpoint served by another sidecar (or another dev, with another MEMFUSE_HOME) is
    # refused before anything is built or printed; a stale one left by a killed dev is cleaned
    try:
        check_mountpoint_free(mountpoint.absolute())
    except StartError as e:
        raise click.ClickException(str(e)) from None
    if clean_stale_mount(mountpoint.absolute()):
        click.echo(f"memfuse dev: unmounted a stale mount at {mountpoint} (left by a killed run)",
                   err=True)
    mountpoint.mkdir(parents=True, exist_ok=True)
    mountpoint = mountpoint.resolve()
    _check_nonempty(mountpoint, nonempty)
    # the first words at once: loading the control plane and the sidecar takes seconds
    click.echo(f"memfuse dev: starting the control plane ({dev_db_path()}) and the mount at {mountpoint} ...",
               err=True)

    setup = dev_app()

    async def prepare() -> None:
        async with setup.admin_client() as api:
            await ensure_dev_setup(api)

    try:
        _run(prepare)
    finally:
        setup.app.state.service.db.dispose()
    del setup
    console_on = console_listen.strip().lower() not in ("off", "none", "")
    # A fresh app for the mount, served over HTTP on loopback by hypercorn in a thread of its
    # own (ConsoleServer), as `memfuse serve` serves it: the sidecar is its HTTP client, as in
    # production, so its change feed streams (through httpx.ASGITransport a stream would only
    # arrive when it ends). With the console off the app has no console or agent-tool faces
    # and listens on a free loopback port, for the sidecar only.
    env = dev_app(faces=console_on, streams=True)
    env.app.state.db_claim = claim  # held by this process: the server takes it as its own
    # the console's prompt preview shows the paths the agents get: this mount's
    env.app.state.service.mount_root = str(mountpoint)

    from memfuse.sidecar.mount import MountConfig, run_mount

    config = MountConfig(
        mountpoint=mountpoint,
        workspace=DEV_WORKSPACE,
        cache_dir=dev_cache_dir(),
        admin_listen=admin_listen or None,
        debug=debug,
        log_format=log_format,
    )
    listen = console_listen.strip() if console_on else "127.0.0.1:0"
    server = ConsoleServer(env.app, listen)
    try:
        api_url = server.start()
    except (OSError, TimeoutError) as err:
        what = "the console" if console_on else "the control plane"
        raise click.ClickException(f"cannot serve {what} on {listen}: {err}") from None
    try:
        base = None
        if console_on:
            from memfuse.server.console import login_url

            base = api_url
            click.echo(
                f"memfuse dev: console at {base}/ui/ ; log in with this one-time link:\n"
                f"    {login_url(env.app, env.admin_token, base)}",
                err=True,
            )
        click.echo(
            f"memfuse dev: mounting workspace '{DEV_WORKSPACE}' at {mountpoint} "
            f"(database {dev_db_path()}); stop with Ctrl-C",
            err=True,
        )
        from memfuse.devenv import agent_tools_hint

        click.echo(agent_tools_hint(shutil.which("memfuse") or sys.argv[0], base), err=True)
        rc = run_mount(config, lambda: ApiClient(api_url, env.workspace_token, instance=actor, lean=True,
                                                    bounded=True))
    finally:
        server.stop()  # after the mount's drain, which commits through it
        # every pooled connection closed: SQLite checkpoints its WAL into dev.db and removes
        # the -wal and -shm files
        env.app.state.service.db.dispose()
    if rc == 0:
        click.echo(f"memfuse dev: unmounted {mountpoint}", err=True)
    else:
        click.echo(f"memfuse dev: stopped (exit status {rc}); the reason is logged above", err=True)
    sys.exit(rc)


def _check_nonempty(mountpoint: Path, allow: bool) -> None:
    """Refuse (``ClickException``, exit 1) to mount over a directory that holds entries,
    which the mount would hide while it runs, unless ``allow`` (``--nonempty``): then warn,
    naming how many. The rule of libfuse 2's ``nonempty`` option (libfuse 3 dropped the
    check; a user of ``memfuse dev`` still expects not to lose sight of files). A mount
    already there (a running or stale sidecar) is left to the sidecar's own checks."""
    if os.path.ismount(mountpoint):
        return
    try:
        with os.scandir(mountpoint) as it:
            names = sorted(e.name for e in it)
    except OSError:
        return  # a stale FUSE mount (ENOTCONN): the sidecar cleans it up
    if not names:
        return
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    what = f"{mountpoint} is not empty ({len(names)} entries: {shown})"
    if not allow:
        raise click.ClickException(
            f"{what}: mounting there would hide them while dev runs. Move them away, name "
            "another MOUNTPOINT, or pass --nonempty to mount over them anyway")
    click.echo(f"memfuse dev: warning: {what}; they are hidden while dev runs (--nonempty)",
               err=True)


class _UnstattedPath(click.ParamType):
    """A path that click does not ``stat``: with ``--fuse-fd`` MOUNTPOINT is a FUSE mount
    already, served by this very process, so a ``stat`` before it serves would never return."""

    name = "directory"

    def convert(self, value, param, ctx) -> Path:  # noqa: D102
        return value if isinstance(value, Path) else Path(value)


_UNSTATTED_PATH = _UnstattedPath()

# characters an actor name keeps (the control plane records ws:<workspace>/<name>: no "/")
_ACTOR_BAD = re.compile(r"[^A-Za-z0-9._@:+-]")


def actor_name(value: str) -> str:
    """``value`` as an actor name: characters outside ``[A-Za-z0-9._@:+-]`` become ``-``,
    at most 100 characters (what the control plane keeps); ``sidecar`` when nothing is left."""
    return _ACTOR_BAD.sub("-", value.strip())[:100] or "sidecar"


def default_actor(cache_dir: Path | None = None) -> str:
    """``USER@HOST``, the name a person recognises; with ``cache_dir`` (``memfuse mount``)
    followed by ``.`` and 6 hex digits of its absolute path: stable across restarts, and
    different for two sidecars of one workspace on one host (no two running sidecars share a
    cache directory), whose versions the change feed tells apart by actor."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    name = f"{user}@{socket.gethostname()}"
    if cache_dir is not None:
        name += "." + hashlib.sha256(os.path.abspath(cache_dir).encode()).hexdigest()[:6]
    return name


@cli.command()
@click.argument("mountpoint", type=_UNSTATTED_PATH, envvar="MEMFUSE_MOUNTPOINT")
@opt("--control-plane", required=True, metavar="URL", help="Control-plane URL.")
@opt("--workspace", required=True, metavar="WS", help="Workspace whose attached stores to mount.")
@opt("--token-file", type=click.Path(dir_okay=False, path_type=Path),
     help="File holding the workspace token (else $MEMFUSE_TOKEN). Re-read when it changes "
          "(checked every --token-check-interval and on every 401), so a rotated Secret needs "
          "no restart.")
@opt("--token-check-interval", type=Seconds(0.1), default=5.0, show_default=True,
     metavar="S", help="Seconds between checks of --token-file for a new token (a stat).")
@opt("--cache-dir", type=click.Path(file_okay=False, path_type=Path),
     help="Local cache and outbox. Default: <user cache dir>/memfuse/<workspace>-<url hash> "
          "(<workspace>~<account>-<url hash> for a workspace of an account other than default; "
          "asked from the control plane, see docs/CLI.md).")
@opt("--uid", type=int, help="Owner uid shown for files (default: this process's).")
@opt("--gid", type=int, help="Owner gid shown for files (default: this process's).")
@opt("--allow-other", is_flag=True, help="Let other users (e.g. the agent container) use the mount.")
@opt("--admin-listen", default=DEFAULT_ADMIN_LISTEN, show_default=True, metavar="HOST:PORT",
     help="Sidecar admin HTTP (/healthz, /readyz, /metrics, /v1/status); '' for the Unix "
          "socket only. A taken address is an error (no other port is tried): give each "
          "sidecar on a host its own, or port 0 for a free one.")
@opt("--commit-wait", type=Seconds(), default=10.0, show_default=True, metavar="S",
     help="Seconds close() waits for the control plane's commit (0: return once the write "
          "is on disk in the outbox journal, which has its own bound).")
@opt("--fsync-timeout", type=Seconds(0.1), default=60.0, show_default=True, metavar="S",
     help="Seconds fsync() waits for the commit before EIO.")
@opt("--drain-timeout", type=Seconds(), default=20.0, show_default=True, metavar="S",
     help="Seconds to drain the outbox on SIGTERM/SIGINT.")
@opt("--offline-after", type=Seconds(), default=10.0, show_default=True, metavar="S",
     help="Seconds the whole start may take (listing the attachments and loading every store) "
          "when stores are saved in the cache; past that, those not loaded yet are mounted as they "
          "were (writes the outbox holds are shown on them and sent once the control plane "
          "answers). Each request to the control plane also has a total deadline: its answer's "
          "head within 30 s (plus a long poll's wait), its body at 64 KiB/s at least.")
@opt("--actor", "--instance", "actor", metavar="NAME",
     help="Who writes through this mount, recorded on every version (history, the console, the "
          "API's updated_by) as ws:WORKSPACE/NAME; stable across restarts, so it should differ "
          "between sidecars of one workspace running at once. In Kubernetes the manifests pass "
          "the pod name (downward API). Default: USER@HOST.CACHE (CACHE: 6 hex digits of the "
          "cache directory's path, which no two running sidecars share). --instance is the old "
          "name.")
@opt("--log-format", type=click.Choice(["json", "text"]), default="json", show_default=True,
     help="Log line format on stderr.")
@opt("--admin-token-file", type=click.Path(dir_okay=False, path_type=Path), envvar=SIDECAR_ADMIN_TOKEN_ENV,
     help="File holding the bearer token that mount changes (POST/DELETE /v1/mounts/...) need on "
     "the TCP admin API, loopback included. Without it they are refused on TCP and served only on "
     "the Unix socket <cache dir>/admin.sock (mode 0600).")
@opt("--admin-socket/--no-admin-socket", default=True, show_default=True, envvar=MOUNT_ADMIN_SOCKET_ENV,
     help="Serve the admin API on <cache dir>/admin.sock (used by `memfuse mounts`).")
@opt("--fuse-fd", type=click.IntRange(min=0), metavar="N",
     help="Serve an already mounted FUSE connection: N is an open /dev/fuse descriptor that a "
     "privileged helper opened and mounted at MOUNTPOINT (libfuse >= 3.3 takes /dev/fd/N), so this "
     "process needs no mount privilege; the helper unmounts.")
@opt("--start-timeout", type=Seconds(forever=True), default=60.0, show_default=True, metavar="S",
     help="Seconds to wait for the control plane at start when nothing is cached to mount, "
     "then exit 1 with the reason (0 or inf: wait forever).")
@opt("--debug", is_flag=True, help="Verbose logging (and FUSE debug).")
def mount(
    mountpoint: Path,
    control_plane: str,
    workspace: str,
    token_file: Path | None,
    token_check_interval: float,
    cache_dir: Path | None,
    uid: int | None,
    gid: int | None,
    allow_other: bool,
    admin_listen: str,
    commit_wait: float,
    fsync_timeout: float,
    drain_timeout: float,
    offline_after: float,
    actor: str | None,
    log_format: str,
    admin_token_file: Path | None,
    admin_socket: bool,
    fuse_fd: int | None,
    start_timeout: float,
    debug: bool,
) -> None:
    """Run the sidecar: mount WORKSPACE's stores at MOUNTPOINT until SIGTERM/SIGINT."""
    from memfuse.names import NameError_, check_slug
    from memfuse.sidecar.admin import read_admin_token

    if not workspace.strip():
        raise click.UsageError(
            "--workspace is empty: give the workspace to mount (in Kubernetes, the MEMFUSE_WORKSPACE "
            "value or the pod label it is read from is missing)")
    try:
        check_slug(workspace)
    except NameError_ as e:
        raise click.BadParameter(e.reason, param_hint="--workspace") from None
    token: str | TokenFile | None
    if token_file is not None:  # re-read when it changes (a rotated Kubernetes Secret)
        try:
            token = TokenFile(token_file)
        except TokenFileError as e:
            raise click.UsageError(str(e)) from None
    else:
        token = Target(control_plane, None).token()
    if token is None:
        raise click.UsageError("no token: pass --token-file F (or set MEMFUSE_TOKEN_FILE / MEMFUSE_TOKEN)")
    admin_token = None
    hint = control_plane_token_unread(admin_token_file)
    if hint and admin_listen:
        click.echo(f"memfuse: {hint}; mount changes are refused on TCP", err=True)
    if admin_token_file is not None:
        try:
            admin_token = read_admin_token(admin_token_file)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
    if fuse_fd is not None:
        _check_fuse_fd(fuse_fd)
        # never stat the mountpoint: it is mounted already and would wait for this very process
        mountpoint = Path(os.path.abspath(mountpoint))
    else:
        _prepare_mountpoint(mountpoint)
        mountpoint = Path(os.path.realpath(mountpoint))
    sidecar_process_setup()  # before any request: the account's below loads httpcore
    cache = cache_dir
    if cache is None:  # keyed by the workspace's account (memfuse.cli.mountcache)
        from memfuse.cli.mountcache import choose_cache_dir

        try:
            cache = choose_cache_dir(control_plane, token, workspace, start_timeout,
                                     lambda line: click.echo(line, err=True))
        except ValueError as e:
            raise click.ClickException(str(e)) from None
    inst = actor_name(actor or default_actor(cache))
    if click.get_current_context().get_parameter_source("admin_socket") is ParameterSource.DEFAULT:
        old = _old_admin_socket_switch()  # neither the flag nor MEMFUSE_MOUNT_ADMIN_SOCKET given
        admin_socket = admin_socket if old is None else old

    from memfuse.sidecar.mount import MountConfig, run_mount

    config = MountConfig(
        mountpoint=mountpoint,
        workspace=workspace,
        cache_dir=cache,
        uid=uid,
        gid=gid,
        allow_other=allow_other,
        commit_wait=commit_wait,
        fsync_timeout=fsync_timeout,
        drain_timeout=drain_timeout,
        offline_after=offline_after,
        token_check_interval=token_check_interval,
        admin_listen=admin_listen or None,
        debug=debug,
        log_format=log_format,
        admin_token=admin_token,
        admin_socket=admin_socket,
        fuse_fd=fuse_fd,
        start_timeout=start_timeout,
    )
    rc = run_mount(config, lambda: ApiClient(control_plane, token, instance=inst, lean=True, bounded=True))
    sys.exit(rc)


def sidecar_process_setup() -> None:
    """Process setup of ``memfuse mount`` (the sidecar), before its HTTP client is built.

    httpcore imports ``h2`` (HTTP/2) whenever it is installed, as it is in the image for the
    control plane's server: ~1 MiB of the sidecar's baseline memory for a protocol the
    sidecar never speaks (its client is HTTP/1.1; the admin API is served by h11). Marking
    ``h2`` absent for this process makes httpcore skip it. No-op once httpcore is loaded.
    ``memfuse dev`` runs a server in-process and keeps it.
    """
    if "httpcore" not in sys.modules:
        sys.modules.setdefault("h2", None)  # type: ignore[assignment]


def _prepare_mountpoint(mountpoint: Path) -> None:
    """Create MOUNTPOINT if missing; refuse one that is not a directory; as root, make a
    root-owned group- or world-writable one 0755 (see below). A stale FUSE mount there (its
    daemon killed: ENOTCONN) is left for the sidecar to clean up."""
    import errno
    import stat

    try:
        st = os.stat(mountpoint)
    except FileNotFoundError:
        mountpoint.mkdir(parents=True, exist_ok=True)
        return
    except OSError as e:
        if e.errno in (errno.ENOTCONN, errno.ECONNABORTED):
            return
        raise click.BadParameter(f"{mountpoint}: {e.strerror}", param_hint="MOUNTPOINT") from None
    if not stat.S_ISDIR(st.st_mode):
        raise click.BadParameter(f"{mountpoint} is not a directory", param_hint="MOUNTPOINT")
    if os.geteuid() == 0 and st.st_uid == 0 and st.st_mode & 0o022:
        # a Kubernetes emptyDir is 0777: while the mount is down (a sidecar restart), other
        # users' writes would land in the bare directory, on the node's disk, and vanish from
        # view at the next mount; 0755 makes them fail (EACCES) instead
        os.chmod(mountpoint, 0o755)


def _check_fuse_fd(fd: int) -> None:
    """Refuse (one line, exit 2) a ``--fuse-fd`` that is not an open /dev/fuse descriptor."""
    import stat

    try:
        st = os.fstat(fd)
    except OSError as e:
        raise click.BadParameter(f"descriptor {fd} is not open ({e.strerror})", param_hint="--fuse-fd") from None
    if not stat.S_ISCHR(st.st_mode) or (os.major(st.st_rdev), os.minor(st.st_rdev)) != (10, 229):
        raise click.BadParameter(f"descriptor {fd} is not /dev/fuse (character device 10:229)",
                                 param_hint="--fuse-fd")


@cli.command()
@click.argument("mountpoint", default="memory", type=click.Path(file_okay=False, path_type=Path),
                envvar="MEMFUSE_MOUNTPOINT")
@opt("--admin", "admin_url", metavar="URL",
     help="Ask the sidecar's TCP admin API instead (GET URL/v1/status), e.g. http://127.0.0.1:9464; "
          "needs --admin-token-file.")
@opt("--admin-token-file", type=click.Path(dir_okay=False, path_type=Path), envvar=SIDECAR_ADMIN_TOKEN_ENV,
     help="Bearer token for --admin (the sidecar's --admin-token-file): on TCP the status needs it.")
@opt("--admin-socket", type=click.Path(dir_okay=False, path_type=Path),
     help="Ask the sidecar's admin Unix socket instead (<cache dir>/admin.sock; no token).")
@opt("--json", "as_json", is_flag=True, envvar="MEMFUSE_JSON", help="Print the raw status JSON.")
def status(mountpoint: Path, admin_url: str | None, admin_token_file: Path | None, admin_socket: Path | None,
           as_json: bool) -> None:
    """Print the sidecar status of the mount at MOUNTPOINT (its .memfuse/status.json), or,
    with --admin URL --admin-token-file F or --admin-socket PATH, of the sidecar serving that
    admin API: workspace, readiness, stores, outbox. Exits 1 with one line when nothing
    answers."""
    # not memfuse.sidecar.admin, the server side (trio): `memfuse status` is a quick read
    from memfuse.sidecar.statusclient import StatusUnavailable, fetch_status, format_status, read_status_file

    token = None
    hint = control_plane_token_unread(admin_token_file) if admin_url else ""
    if hint:
        click.echo(f"memfuse: {hint}", err=True)
    if admin_token_file is not None:
        from memfuse.sidecar.admin import read_admin_token

        try:
            token = read_admin_token(admin_token_file)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
    try:
        if admin_socket is not None:
            data = fetch_status(socket_path=admin_socket)
        elif admin_url:
            data = fetch_status(admin_url, token=token)
        else:
            data = read_status_file(mountpoint)
    except StatusUnavailable as e:
        raise click.ClickException(_one_line(str(e))) from None
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str) if as_json else format_status(data))

