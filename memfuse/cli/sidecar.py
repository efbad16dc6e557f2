"""``memfuse mounts add|remove STORE``: change a running sidecar's mounts through its admin API.

By default over the sidecar's Unix socket ``<cache dir>/admin.sock`` (mode 0600: run it as the
sidecar's user, e.g. ``kubectl exec POD -c memfuse -- memfuse mounts remove notes``; the image
sets ``MEMFUSE_CACHE_DIR``), or over TCP with ``--admin URL --admin-token-file F`` (its variable:
``MEMFUSE_SIDECAR_ADMIN_TOKEN_FILE``, never the control plane's). Registers
the ``mounts`` group on ``memfuse.cli.common.cli`` when imported.
"""
from __future__ import annotations

from pathlib import Path

import click

from memfuse.cli.common import SIDECAR_ADMIN_TOKEN_ENV, _one_line, cli, control_plane_token_unread, opt


def _target(f):
    f = opt("--admin-token-file", type=click.Path(dir_okay=False, path_type=Path),
            envvar=SIDECAR_ADMIN_TOKEN_ENV,
            help="Bearer token for --admin (the sidecar's --admin-token-file).")(f)
    f = opt("--admin", "admin_url", metavar="URL",
            help="The sidecar's TCP admin API (e.g. http://127.0.0.1:9464) instead of its Unix socket.")(f)
    f = opt("--admin-socket", type=click.Path(dir_okay=False, path_type=Path),
            help="The sidecar's admin Unix socket. Default: <cache dir>/admin.sock.")(f)
    f = opt("--cache-dir", type=click.Path(file_okay=False, path_type=Path),
            help="The sidecar's --cache-dir (where its admin socket is).")(f)
    return f


def _call(method: str, store: str, cache_dir: Path | None, admin_socket: Path | None,
          admin_url: str | None, admin_token_file: Path | None) -> dict:
    from memfuse.names import NameError_, check_slug
    from memfuse.sidecar.admin import AdminRequestFailed, admin_call, admin_socket_path, read_admin_token

    try:
        check_slug(store)
    except NameError_ as e:
        raise click.BadParameter(e.reason, param_hint="STORE") from None
    token = None
    if admin_url:
        if admin_token_file is None:
            hint = control_plane_token_unread(admin_token_file)
            raise click.UsageError("--admin URL needs --admin-token-file (mount changes over TCP need the token)"
                                   + (f"; {hint}" if hint else ""))
        try:
            token = read_admin_token(admin_token_file)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
        sock = None
    else:
        if admin_socket is None and cache_dir is None:
            raise click.UsageError("give the sidecar's --cache-dir (or --admin-socket, or --admin URL)")
        sock = admin_socket or admin_socket_path(cache_dir)
    try:
        return admin_call(method, f"/v1/mounts/{store}", socket_path=sock, url=admin_url, token=token)
    except AdminRequestFailed as e:
        raise click.ClickException(_one_line(str(e))) from None


@cli.group()
def mounts() -> None:
    """Mount or unmount a store in a running sidecar (its admin API)."""


@mounts.command("add")
@click.argument("store")
@_target
def mounts_add(store: str, cache_dir: Path | None, admin_socket: Path | None, admin_url: str | None,
               admin_token_file: Path | None) -> None:
    """Mount STORE (attached to the sidecar's workspace) now."""
    r = _call("POST", store, cache_dir, admin_socket, admin_url, admin_token_file)
    click.echo(f"{store}: mounted" + ("" if r.get("changed", True) else " (already)"))


@mounts.command("remove")
@click.argument("store")
@_target
def mounts_remove(store: str, cache_dir: Path | None, admin_socket: Path | None, admin_url: str | None,
                  admin_token_file: Path | None) -> None:
    """Commit STORE's dirty files (bounded wait) and unmount it; open files on it get ESTALE."""
    r = _call("DELETE", store, cache_dir, admin_socket, admin_url, admin_token_file)
    left = r.get("uncommitted") or 0
    click.echo(f"{store}: unmounted" + (f" ({left} change(s) left in the outbox)" if left else ""))
