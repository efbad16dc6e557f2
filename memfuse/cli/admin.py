"""The admin commands: ``account create|list|show|delete|attach|detach``, ``store
create|list|show|update``, ``workspace create|list``, ``attach``, ``detach``, ``token
create|list|revoke``.

Each is one API call (or a few reads) through ``_api`` with an idempotency key per write; the
record commands are in ``records``.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import click

from memfuse.cli.common import (
    BYTES,
    Target,
    _api,
    _read_api,
    _fmt_time,
    _human_bytes,
    _key,
    _one_line,
    _table,
    api_options,
    cli,
    opt,
)
from memfuse.client import ApiClient, with_retries
from memfuse.wire import MAX_TOKEN_TTL_SECONDS, RECORD_TYPES, Store, to_jsonable


@cli.group()
def store() -> None:
    """Create, list, show and update stores (admin)."""


def _store_rows(stores: list[Store]) -> str:
    """The store table; with an ACCOUNT column first when the stores are of more than one
    account (the root admin's listing: two accounts may each have a store ``notes``)."""
    rows = [
        [
            s.slug,
            s.default_type,
            f"{s.record_count}/{s.max_records}",
            f"{_human_bytes(s.usage_bytes)}/{_human_bytes(s.max_store_bytes)}",
            _human_bytes(s.max_record_bytes),
            f"{_human_bytes(s.history_bytes)}/{_human_bytes(s.max_history_bytes)}",
            _one_line(s.description),
        ]
        for s in stores
    ]
    head = ["SLUG", "DEFAULT TYPE", "RECORDS", "USAGE", "MAX RECORD", "HISTORY", "DESCRIPTION"]
    if len({s.account for s in stores}) > 1:
        rows = [[s.account, *r] for s, r in zip(stores, rows)]
        head = ["ACCOUNT", *head]
    return _table(rows, head)


def _history_options(fn):
    """--max-history-bytes, --max-history-versions, --history-min-age (docs/CLI.md)."""
    fn = opt("--history-min-age", "history_min_age_s", type=click.IntRange(min=0), metavar="SECONDS",
             help="Never prune a version younger than this (default 86400: 24 h).")(fn)
    fn = opt("--max-history-versions", type=click.IntRange(min=1),
             help="Past versions whose content is kept (default 16 x max records).")(fn)
    fn = opt("--max-history-bytes", type=BYTES,
             help="Content of past versions kept; beyond it the oldest are pruned "
                  "(default 16 x max store bytes).")(fn)
    return fn


_type_choice = click.Choice(list(RECORD_TYPES))


@store.command("create")
@click.argument("slug")
@opt("--description", default="", help="What the store is for (shown to agents).")
@opt("--default-type", type=_type_choice, default="project", show_default=True,
     help="Type of records without frontmatter type.")
@opt("--max-record-bytes", type=BYTES, help="Largest record (default 1 MiB). Accepts 512K, 1MiB, ...")
@opt("--max-store-bytes", type=BYTES, help="Total size limit (default 64 MiB).")
@opt("--max-records", type=click.IntRange(min=1), help="Record count limit (default 10000).")
@_history_options
@opt("--account", metavar="ACCOUNT", default=None,
     help="Create it in ACCOUNT (the root admin; default: the caller's account, 'default' for the "
          "root admin). Slugs are unique within an account.")
@api_options
def store_create(target: Target, slug: str, description: str, default_type: str,
                 max_record_bytes: int | None, max_store_bytes: int | None,
                 max_records: int | None, max_history_bytes: int | None,
                 max_history_versions: int | None, history_min_age_s: int | None,
                 account: str | None) -> None:
    """Create store SLUG."""
    from memfuse.names import NameError_, check_slug

    try:
        check_slug(slug)
    except NameError_ as e:
        raise click.BadParameter(e.reason, param_hint="SLUG") from None
    key = _key()
    s = _api(target, lambda api: with_retries(lambda: api.create_store(
        slug, description=description, default_type=default_type,
        max_record_bytes=max_record_bytes, max_store_bytes=max_store_bytes,
        max_records=max_records, idempotency_key=key, max_history_bytes=max_history_bytes,
        max_history_versions=max_history_versions, history_min_age_s=history_min_age_s,
        account=account or None)))
    click.echo(_store_rows([s]))


@store.command("list")
@opt("--json", "as_json", is_flag=True, envvar="MEMFUSE_JSON", help="Print JSON.")
@api_options
def store_list(target: Target, as_json: bool) -> None:
    """List every store with usage and limits."""
    stores = _read_api(target, lambda api: with_retries(api.list_stores))
    if as_json:
        click.echo(json.dumps([to_jsonable(s) for s in stores], indent=2))
    else:
        click.echo(_store_rows(stores))


@store.command("show")
@click.argument("slug")
@api_options
def store_show(target: Target, slug: str) -> None:
    """Show store SLUG as JSON."""
    s = _read_api(target, lambda api: with_retries(lambda: api.get_store(slug)))
    click.echo(json.dumps(to_jsonable(s), indent=2))


@store.command("update")
@click.argument("slug")
@opt("--description", default=None, help="New description.")
@opt("--default-type", type=_type_choice, default=None, help="New default type.")
@opt("--max-record-bytes", type=BYTES, help="New record size limit.")
@opt("--max-store-bytes", type=BYTES, help="New total size limit.")
@opt("--max-records", type=click.IntRange(min=1), help="New record count limit.")
@_history_options
@api_options
def store_update(target: Target, slug: str, description: str | None, default_type: str | None,
                 max_record_bytes: int | None, max_store_bytes: int | None,
                 max_records: int | None, max_history_bytes: int | None,
                 max_history_versions: int | None, history_min_age_s: int | None) -> None:
    """Change the description, default type, limits or history budget of store SLUG (only
    what is given)."""
    fields = dict(description=description, default_type=default_type,
                  max_record_bytes=max_record_bytes, max_store_bytes=max_store_bytes,
                  max_records=max_records, max_history_bytes=max_history_bytes,
                  max_history_versions=max_history_versions, history_min_age_s=history_min_age_s)
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
@opt("--default-store/--no-default-store", default=True, show_default=True,
     help="Also give the workspace a store named NAME attached read-write (an existing "
          "store of that name is attached, not recreated).")
@opt("--account", metavar="ACCOUNT", default=None,
     help="Create it in ACCOUNT (the root admin; default: the caller's account, 'default' for the "
          "root admin).")
@api_options
def workspace_create(target: Target, name: str, default_store: bool, account: str | None) -> None:
    """Create workspace NAME (with a same-named store attached read-write, unless
    --no-default-store)."""
    from memfuse.names import NameError_, check_slug

    try:
        check_slug(name)
    except NameError_ as e:
        raise click.BadParameter(e.reason, param_hint="NAME") from None
    key = _key()
    w = _api(target, lambda api: with_retries(
        lambda: api.create_workspace(name, idempotency_key=key, default_store=default_store,
                                     account=account or None)))
    if default_store:
        click.echo(f"created workspace {w.name} with store {w.name} attached read-write")
    else:
        click.echo(f"created workspace {w.name}")


@workspace.command("list")
@api_options
def workspace_list(target: Target) -> None:
    """List workspaces with their attached stores."""

    async def body(api: ApiClient) -> tuple[list[list[str]], bool]:
        rows = []
        workspaces = await with_retries(api.list_workspaces)
        several = len({w.account for w in workspaces}) > 1  # the root admin's: an ACCOUNT column
        for w in workspaces:
            atts = await with_retries(lambda: api.list_attachments(w.name))
            rows.append([*([w.account] if several else []), w.name, _fmt_time(w.created_at),
                         ", ".join(f"{a.store.slug} ({a.access.value})" for a in atts)])
        return rows, several

    rows, several = _read_api(target, body)
    click.echo(_table(rows, [*(["ACCOUNT"] if several else []), "WORKSPACE", "CREATED", "STORES"]))


@cli.command()
@click.argument("ws")
@click.argument("store_slug", metavar="STORE")
@opt("--read-only", is_flag=True, help="Attach read-only: the workspace's agents cannot write.")
@opt("--read-write", is_flag=True,
     help="Attach read-write (the default; names it explicitly, e.g. to undo --read-only).")
@opt("--instructions", default=None,
     help="Instructions shown to the agent with this store (default: none for a new "
          "attachment, the current ones kept when it exists).")
@api_options
def attach(target: Target, ws: str, store_slug: str, read_only: bool, read_write: bool,
           instructions: str | None) -> None:
    """Attach STORE to workspace WS, or change the access / instructions of an attachment.

    The access is read-write unless --read-only is given; --read-write says so explicitly
    (turning a read-only attachment back into a read-write one). The two exclude each other;
    a flag on the command line wins over the other's environment variable. Prints the
    resulting access and, for an existing attachment, what it was.
    """
    ctx = click.get_current_context()
    if read_only and read_write:
        src = ctx.get_parameter_source
        from_cli = [n for n in ("read_only", "read_write")
                    if src(n) == click.core.ParameterSource.COMMANDLINE]
        if len(from_cli) == 1:  # the command line wins over the other flag's env var
            read_only = from_cli[0] == "read_only"
        else:
            raise click.UsageError("--read-only and --read-write exclude each other (give one)")
    access = "read_only" if read_only else "read_write"
    key = _key()

    async def body(api: ApiClient) -> tuple[Any, Any]:
        before = next((a for a in await with_retries(lambda: api.list_attachments(ws))
                       if a.store.slug == store_slug), None)
        text = instructions if instructions is not None else (before.instructions if before else "")
        after = await with_retries(lambda: api.attach(ws, store_slug, access, text, idempotency_key=key))
        return before, after

    before, a = _api(target, body)
    if before is None:
        was = ""
    elif before.access == a.access:
        was = ", unchanged"
    else:
        was = f", was {before.access.value}"
    click.echo(f"attached {a.store.slug} to {a.workspace} ({a.access.value}{was})")


@cli.command()
@click.argument("ws")
@click.argument("store_slug", metavar="STORE")
@api_options
def detach(target: Target, ws: str, store_slug: str) -> None:
    """Detach STORE from workspace WS."""
    key = _key()
    _api(target, lambda api: with_retries(lambda: api.detach(ws, store_slug, idempotency_key=key)))
    click.echo(f"detached {store_slug} from {ws}")


class Duration(click.ParamType):
    """A duration in whole seconds: ``3600``, ``45s``, ``30m``, ``12h``, ``90d``, ``2w``."""

    name = "DURATION"
    _UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        if isinstance(value, int):
            return value
        text = str(value).strip().lower()
        num = text.rstrip("smhdw")
        unit = text[len(num):]
        try:
            n = float(num)
        except ValueError:
            self.fail(f"{value!r} is not a duration (e.g. 3600, 30m, 12h, 90d)", param, ctx)
        if not math.isfinite(n):  # inf, 1e400: int() of it raised OverflowError (exit 1, no usage error)
            self.fail(f"{value!r} must be between 1 second and 10 years", param, ctx)
        if unit not in self._UNITS:
            self.fail(f"unknown unit in {value!r} (use s, m, h, d or w)", param, ctx)
        seconds = int(n * self._UNITS[unit])
        if seconds < 1 or seconds > MAX_TOKEN_TTL_SECONDS:
            self.fail(f"{value!r} must be between 1 second and 10 years", param, ctx)
        return seconds


@cli.group()
def token() -> None:
    """Create, list and revoke API tokens (admin)."""


@token.command("create")
@opt("--workspace", metavar="WS", help="Scope the token to WS. Without it: an admin token.")
@opt("--account", metavar="ACCOUNT",
     help="Without --workspace: an admin token of ACCOUNT only (an account admin). "
          "Default: a root admin token (the root admin only).")
@opt("--name", default="", help="A label for the token (shown by 'token list').")
@opt("--ttl", type=Duration(), metavar="DURATION",
     help="Expire the token after DURATION (3600, 45s, 30m, 12h, 90d, 2w). Default: never.")
@opt("--out", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
     help="Write the token to FILE (mode 0600, replaced atomically) instead of stdout.")
@api_options
def token_create(target: Target, workspace: str | None, account: str | None, name: str, ttl: int | None,
                 out: Path | None) -> None:
    """Create a token and print it on stdout, or write it to --out FILE (mode 0600); it is
    shown once: the server keeps only its hash."""
    from memfuse.privfile import write_private

    key = _key()
    t = _api(target, lambda api: with_retries(
        lambda: api.create_token(workspace or None, name, idempotency_key=key, ttl_seconds=ttl,
                                 account=account or None)))
    scope = (f"workspace {t.workspace}" if t.workspace
             else f"account {t.account} admin" if t.account else "admin")
    where = ""
    if out is not None:
        try:
            write_private(out, t.token + "\n")
        except OSError as e:
            raise click.ClickException(f"created {scope} token {t.id} but cannot write it to {out}: "
                                       f"{e.strerror}; revoke it (memfuse token revoke {t.id})") from None
        where = f", written to {out}"
    click.echo(f"created {scope} token {t.id}" + (f" ({t.name})" if t.name else "")
               + (f", expires {_fmt_time(t.expires_at)}" if t.expires_at else "") + where, err=True)
    if out is None:
        click.echo(t.token)


@token.command("list")
@opt("--workspace", metavar="WS", help="Only WS's tokens.")
@opt("--all", "include_revoked", is_flag=True, help="Include revoked tokens.")
@opt("--json", "as_json", is_flag=True, envvar="MEMFUSE_JSON", help="Print JSON.")
@api_options
def token_list(target: Target, workspace: str | None, include_revoked: bool, as_json: bool) -> None:
    """List tokens (never their secrets): id, name, workspace, created, last used, expiry,
    state. LAST USED is updated at most once a minute."""
    tokens = _read_api(target, lambda api: with_retries(
        lambda: api.list_tokens(workspace, include_revoked=include_revoked)))
    if as_json:
        click.echo(json.dumps([to_jsonable(t) for t in tokens], indent=2))
        return
    rows = [[t.id, _one_line(t.name) or "-", t.workspace or "(admin)", _fmt_time(t.created_at),
             _fmt_time(t.last_used_at) if t.last_used_at else "never",
             _fmt_time(t.expires_at) if t.expires_at else "never", t.state]
            for t in tokens]
    click.echo(_table(rows, ["ID", "NAME", "WORKSPACE", "CREATED", "LAST USED", "EXPIRES", "STATE"]))


MIN_TOKEN_PREFIX = 4  # characters of a token id `token revoke` accepts as a prefix


@token.command("revoke")
@click.argument("token_ids", metavar="ID...", nargs=-1, required=True)
@api_options
def token_revoke(target: Target, token_ids: tuple[str, ...]) -> None:
    """Revoke the tokens with these ids (see 'token list'): they stop working at once. An id
    may be shortened to a unique prefix of at least 4 characters (revoked tokens count); a
    prefix no token id starts with, or several do, is an error and revokes nothing."""

    async def body(api: ApiClient) -> None:
        known: list[str] | None = None
        resolved = []
        for tid in token_ids:
            if len(tid) >= 36:
                resolved.append(tid)
                continue
            if len(tid) < MIN_TOKEN_PREFIX:
                raise click.BadParameter(f"{tid!r} is too short: give the id or at least "
                                         f"{MIN_TOKEN_PREFIX} of its first characters", param_hint="ID")
            if known is None:
                known = [t.id for t in await api.list_tokens(include_revoked=True)]
            matches = [k for k in known if k.lower().startswith(tid.lower())]
            if not matches:
                raise click.ClickException(f"no token id starts with {tid} (see memfuse token list --all)")
            if len(matches) > 1:
                raise click.ClickException(f"{tid} is ambiguous: {len(matches)} token ids start with it "
                                           f"({', '.join(matches[:5])}); give more characters")
            resolved.append(matches[0])
        for tid in resolved:
            key = _key()
            await with_retries(lambda: api.revoke_token(tid, idempotency_key=key))
            click.echo(f"revoked token {tid}")

    _api(target, body)



# ---------------------------------------------------------------- accounts


@cli.group()
def account() -> None:
    """Create, list, show and delete accounts (root admin); account-wide attachments."""


def _account_rows(accounts: list[Any]) -> str:
    def quota(used: int, limit: int | None, fmt: Any = str) -> str:
        return f"{fmt(used)} / {fmt(limit) if limit is not None else 'unlimited'}"

    rows = [[a.slug, quota(a.stores, a.max_stores), quota(a.bytes, a.max_bytes, _human_bytes),
             quota(a.tokens, a.max_tokens), _fmt_time(a.created_at)] for a in accounts]
    return _table(rows, ["ACCOUNT", "STORES", "BYTES", "TOKENS", "CREATED"])


UNLIMITED = "unlimited"


class QuotaParam(click.ParamType):
    """A quota: a count (``QuotaParam(False)``) or a byte size (``QuotaParam(True)``: 512M,
    2G, as BYTES), or ``unlimited`` (``UNLIMITED``)."""

    def __init__(self, size: bool) -> None:
        self.size = size
        self.name = "SIZE|unlimited" if size else "N|unlimited"

    def convert(self, value: Any, param: Any, ctx: Any) -> int | str:
        if isinstance(value, str) and value.strip().lower() == UNLIMITED:
            return UNLIMITED
        if self.size:
            if isinstance(value, str) and value.strip() == "0":
                return 0  # a quota of zero bytes (as the API takes it), not a size error
            return int(BYTES.convert(value, param, ctx))
        return int(click.IntRange(min=0).convert(value, param, ctx))


def _quota(value: int | str | None) -> int | None:
    """A :class:`QuotaParam` value as the API takes it: ``unlimited`` (or not given) is None."""
    return None if value is None or value == UNLIMITED else int(value)


# --max-stores, --max-bytes, --max-tokens (and their MEMFUSE_MAX_* variables) have the same
# type in 'account create' and 'account set': one name, one type (attack26 F5)
@account.command("create")
@click.argument("slug")
@opt("--max-stores", type=QuotaParam(False), help="Quota: stores (a number, or 'unlimited', the default).")
@opt("--max-bytes", type=QuotaParam(True),
     help="Quota: live bytes of all its stores (512M, 2G..., or 'unlimited', the default).")
@opt("--max-tokens", type=QuotaParam(False), help="Quota: active tokens (a number, or 'unlimited', the default).")
@api_options
def account_create(target: Target, slug: str, max_stores: int | str | None, max_bytes: int | str | None,
                   max_tokens: int | str | None) -> None:
    """Create account SLUG (root admin). Give it an admin with
    'memfuse token create --account SLUG'."""
    from memfuse.names import NameError_, check_slug

    try:
        check_slug(slug)
    except NameError_ as e:
        raise click.BadParameter(e.reason, param_hint="SLUG") from None
    key = _key()
    quotas = {"max_stores": _quota(max_stores), "max_bytes": _quota(max_bytes), "max_tokens": _quota(max_tokens)}
    a = _api(target, lambda api: with_retries(lambda: api.create_account(slug, **quotas, idempotency_key=key)))
    click.echo(f"created account {a.slug}")


@account.command("list")
@opt("--json", "as_json", is_flag=True, envvar="MEMFUSE_JSON", help="Print JSON.")
@api_options
def account_list(target: Target, as_json: bool) -> None:
    """List accounts with their usage and quotas (an account admin sees its own)."""
    accounts = _api(target, lambda api: with_retries(api.list_accounts))
    if as_json:
        click.echo(json.dumps([to_jsonable(a) for a in accounts], indent=2))
        return
    click.echo(_account_rows(accounts))


@account.command("show")
@click.argument("slug")
@opt("--json", "as_json", is_flag=True, envvar="MEMFUSE_JSON", help="Print JSON.")
@api_options
def account_show(target: Target, slug: str, as_json: bool) -> None:
    """Show account SLUG's usage and quotas, and the stores attached to every workspace of
    it ('memfuse account attach')."""
    a = _api(target, lambda api: with_retries(lambda: api.get_account(slug)))
    if as_json:
        click.echo(json.dumps(to_jsonable(a), indent=2))
        return
    click.echo(_account_rows([a]))
    click.echo("")
    if a.attachments:
        click.echo("Attached to every workspace of the account:")
        click.echo(_table([[x.store, x.access.value, _fmt_time(x.created_at)] for x in a.attachments],
                          ["STORE", "ACCESS", "SINCE"]))
    else:
        click.echo("No store is attached to every workspace of the account.")


@account.command("set")
@click.argument("slug")
@opt("--max-stores", type=QuotaParam(False), help="Quota: stores (a number, or 'unlimited').")
@opt("--max-bytes", type=QuotaParam(True), help="Quota: live bytes of all its stores (512M, 2G..., or 'unlimited').")
@opt("--max-tokens", type=QuotaParam(False), help="Quota: active tokens (a number, or 'unlimited').")
@api_options
def account_set(target: Target, slug: str, max_stores: int | str | None, max_bytes: int | str | None,
                max_tokens: int | str | None) -> None:
    """Change account SLUG's quotas (root admin); the ones not given are kept, 'unlimited'
    lifts one. A quota below the current usage refuses new stores, tokens or growing
    writes, and deletes nothing."""
    given = (("max_stores", max_stores), ("max_bytes", max_bytes), ("max_tokens", max_tokens))
    quotas = {k: _quota(v) for k, v in given if v is not None}
    if not quotas:
        raise click.UsageError("give at least one of --max-stores, --max-bytes, --max-tokens")
    key = _key()
    a = _api(target, lambda api: with_retries(lambda: api.update_account(slug, quotas, idempotency_key=key)))
    click.echo(_account_rows([a]))


@account.command("delete")
@click.argument("slug")
@api_options
def account_delete(target: Target, slug: str) -> None:
    """Delete account SLUG (root admin): it must hold no store, workspace or active token."""
    key = _key()
    _api(target, lambda api: with_retries(lambda: api.delete_account(slug, idempotency_key=key)))
    click.echo(f"deleted account {slug}")


@account.command("attach")
@click.argument("slug")
@click.argument("store_slug", metavar="STORE")
@opt("--read-only", is_flag=True, help="Attach read-only (default: read-write).")
@api_options
def account_attach(target: Target, slug: str, store_slug: str, read_only: bool) -> None:
    """Attach STORE to every workspace of account SLUG, existing and new."""
    key = _key()
    a = _api(target, lambda api: with_retries(lambda: api.attach_account(
        slug, store_slug, "read_only" if read_only else "read_write", idempotency_key=key)))
    click.echo(f"attached {a.store.slug} to every workspace of account {slug} ({a.access.value})")


@account.command("detach")
@click.argument("slug")
@click.argument("store_slug", metavar="STORE")
@api_options
def account_detach(target: Target, slug: str, store_slug: str) -> None:
    """Detach STORE from every workspace of account SLUG (ends its account-wide attachment)."""
    key = _key()
    _api(target, lambda api: with_retries(lambda: api.detach_account(slug, store_slug, idempotency_key=key)))
    click.echo(f"detached {store_slug} from every workspace of account {slug}")
