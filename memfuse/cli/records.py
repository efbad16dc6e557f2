"""The record commands, by path: ``history``, ``show``, ``diff``, ``restore``, ``redact``; ``search``
(grep over a store, through the search API); and ``context``.

A record is found by its path (``_find``: the live record, else the latest deleted one), then
read or written by id. Import and export of whole directories are in ``transfer``.
"""
from __future__ import annotations

import os
import sys
from datetime import datetime, timezone
from typing import Any

import click
import msgspec

from memfuse.cli.common import (
    Target,
    _api,
    _read_api,
    _fmt_time,
    _key,
    _table,
    _write_exact,
    api_options,
    cli,
    click_error,
    opt,
    path_error,
    stdout_is_terminal,
    terminal_safe,
)
from memfuse.client import ApiClient, with_retries
from memfuse.errors import ApiError
from memfuse.wire import Record


def _fmt_mtime(mtime_ns: int | None) -> str:
    """An explicit mtime (``touch -d``, ``cp -p``) as UTC to the second; ``-`` when the
    version has none (its file shows the version's time); the raw ns when out of range."""
    if mtime_ns is None:
        return "-"
    try:
        return _fmt_time(datetime.fromtimestamp(mtime_ns // 10**9, timezone.utc))
    except (OverflowError, OSError, ValueError):
        return f"{mtime_ns}ns"


async def _find(api: ApiClient, store_slug: str, path: str) -> Record:
    rec = await with_retries(lambda: api.find_record(store_slug, path, include_deleted=True))
    if rec is None:
        raise click.ClickException(f"no record at {store_slug}/{path}")
    return rec


async def _about(store_slug: str, path: str, rec: Record, call: Any, version: int | None = None) -> Any:
    """``await with_retries(call)``, a refusal said in the user's terms (the path and version
    they gave, not the record id and HTTP code: :func:`memfuse.cli.common.path_error`)."""
    try:
        return await with_retries(call)
    except ApiError as e:
        raise path_error(e, store_slug, path, rec.id, version) from e


@cli.command()
@click.argument("store_slug", metavar="STORE")
@click.argument("path")
@api_options
def history(target: Target, store_slug: str, path: str) -> None:
    """Show every version of the record at PATH in STORE (deleted records too)."""

    async def body(api: ApiClient) -> tuple[Record, list[Any]]:
        rec = await _find(api, store_slug, path)
        return rec, await _about(store_slug, path, rec, lambda: api.versions(store_slug, rec.id))

    rec, versions = _read_api(target, body)
    rows = [
        [
            str(v.version),
            v.operation.value + (" (redacted)" if v.redacted else " (pruned)" if v.pruned else ""),
            _fmt_time(v.created_at),
            v.actor,
            v.type or "-",
            str(v.size),
            f"{v.mode:04o}",
            _fmt_mtime(v.mtime_ns),
            v.sha256[:12],
            v.path,  # the path the record had at that version (a move's: where it went)
        ]
        for v in versions
    ]
    state = "deleted" if rec.deleted else "live"
    click.echo(f"record {rec.id} ({state}, version {rec.version})")
    click.echo(_table(rows, ["VERSION", "OPERATION", "TIME", "ACTOR", "TYPE", "SIZE", "MODE", "MTIME",
                            "SHA256", "PATH"]))


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
            v = await _about(store_slug, path, rec, lambda: api.version(store_slug, rec.id, version_n), version_n)
            if v.pruned:
                raise click.ClickException(
                    f"version {version_n} of {store_slug}/{path} was pruned by the store's history "
                    "budget: its content is gone, its metadata is in `memfuse history`")
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

    content = _read_api(target, body)
    _write_exact(content)


def unified_diff(old: str, new: str, old_label: str, new_label: str, context: int = 3) -> str:
    """``old`` → ``new`` as ``diff -u`` prints it (``difflib.unified_diff`` over lines, their
    endings kept), with diff's ``\\ No newline at end of file`` after a last line that has
    none; ``""`` when equal. Bounded in work as every diff of untrusted content
    (``memfuse.diffwork``, the console's rule): raises ``diffwork.DiffTooCostly`` past
    ``diffwork.DIFF_WORK_BUDGET`` (difflib is quadratic in lines on hostile input)."""
    import difflib

    from memfuse.diffwork import BoundedMatcher

    a, b = old.splitlines(keepends=True), new.splitlines(keepends=True)
    # the matcher difflib.unified_diff runs, counted first: it then runs within the bound
    BoundedMatcher(None, a, b).get_matching_blocks()
    out = []
    for line in difflib.unified_diff(a, b, old_label, new_label, n=context):
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)


@cli.command()
@click.argument("store_slug", metavar="STORE")
@click.argument("path")
@opt("--from", "from_n", envvar=None, type=click.IntRange(min=0), metavar="N",
     help="The older version (default: the one before --to; 0: the empty file before the first).")
@opt("--to", "to_n", envvar=None, type=click.IntRange(min=1), metavar="N",
     help="The newer version (default: the record's last version).")
@opt("-U", "--unified", "context", envvar=None, type=click.IntRange(min=0), default=3, show_default=True,
     metavar="LINES", help="Lines of context around each change.")
@api_options
def diff(target: Target, store_slug: str, path: str, from_n: int | None, to_n: int | None, context: int) -> None:
    """Show what changed in the record at PATH in STORE between two versions, as `diff -u`
    does (default: its last change), each side labelled with the path the record had then (a
    move alone prints just the two labels). Deleted versions read as empty; a redacted or pruned
    version is an error. Memory content is untrusted: to a terminal, control characters are
    shown as escapes. Versions too large to diff (``memfuse.diffwork``'s work bound, the
    console's) are an error."""
    from memfuse.diffwork import DiffTooCostly

    async def version_of(api: ApiClient, rec: Record, n: int) -> tuple[str, str]:
        """(content, the record's path at version ``n``); version 0: empty, at PATH."""
        if n == 0:
            return "", path
        v = await _about(store_slug, path, rec, lambda: api.version(store_slug, rec.id, n), n)
        if v.pruned:
            raise click.ClickException(
                f"version {n} of {store_slug}/{path} was pruned by the store's history budget")
        if v.redacted:
            raise click.ClickException(f"version {n} of {store_slug}/{path} is redacted")
        if v.operation.value == "deleted":  # it keeps the content it removed; the file is gone
            return "", v.path
        return v.content or "", v.path

    async def body(api: ApiClient) -> str:
        rec = await _find(api, store_slug, path)
        new_n = rec.version if to_n is None else to_n
        old_n = max(new_n - 1, 0) if from_n is None else from_n
        new, new_path = await version_of(api, rec, new_n)  # first: a missing --to is the error to name
        old, old_path = await version_of(api, rec, old_n)
        old_label = f"{store_slug}/{old_path}@{old_n}" if old_n else "/dev/null"
        new_label = f"{store_slug}/{new_path}@{new_n}"
        if old == new and old_path != new_path:  # a move alone: its two names, as git shows a rename
            return f"--- {old_label}\n+++ {new_label}\n"
        try:
            return unified_diff(old, new, old_label, new_label, context)
        except DiffTooCostly as err:
            raise click.ClickException(
                f"versions {old_n} and {new_n} of {store_slug}/{path} are too large to diff (more than "
                f"{err.limit:,} line comparisons); `memfuse show --version N` prints each") from None

    out = _read_api(target, body)
    if stdout_is_terminal():  # each line made safe, its line break kept
        out = "".join(terminal_safe(ln[:-1]) + "\n" if ln.endswith("\n") else terminal_safe(ln)
                      for ln in out.splitlines(keepends=True))
    _write_exact(out)


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
        return await _about(store_slug, path, rec,
                            lambda: api.restore(store_slug, rec.id, version_n, idempotency_key=key), version_n)

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
        return await _about(store_slug, path, rec,
                            lambda: api.redact(store_slug, rec.id, version_n, idempotency_key=key), version_n)

    _api(target, body)
    click.echo(f"redacted version {version_n} of {store_slug}/{path}")


@cli.command("index")
@click.argument("store_slug", metavar="STORE")
@opt("--json", "as_json", is_flag=True, help="Print the report as JSON (the API's body).")
@api_options
def index_cmd(target: Target, store_slug: str, as_json: bool) -> None:
    """Report how STORE's MEMORY.md and its records agree: links to records that do not
    exist (missing), records MEMORY.md does not mention (unindexed), and entries the prompt
    block cuts (omitted). Lines of MEMORY.md are shown escaped on a terminal."""
    rep = _read_api(target, lambda api: with_retries(lambda: api.index_report(store_slug)))
    if as_json:
        click.echo(msgspec.json.encode(rep).decode())
        return
    tty = stdout_is_terminal()
    safe = (lambda t: terminal_safe(t)) if tty else (lambda t: t)
    if not rep.index_exists:
        click.echo(f"{store_slug}: no MEMORY.md")
    else:
        click.echo(f"MEMORY.md: {rep.entries} entries; {rep.lines} lines ({rep.bytes} bytes), "
                   f"{rep.lines_shown} lines ({rep.bytes_shown} bytes) shown in the prompt block")
    n_missing = max(rep.missing_count, len(rep.missing))  # a server before the counts: 0
    click.echo(f"missing ({n_missing}): links to records that do not exist")
    for e in rep.missing:
        click.echo(f"  MEMORY.md:{e.line}: {safe(e.target)}")
    if n_missing > len(rep.missing):
        click.echo(f"  … and {n_missing - len(rep.missing)} more")
    click.echo(f"unindexed ({rep.unindexed_count}): records MEMORY.md does not mention")
    for path in rep.unindexed:
        click.echo(f"  {safe(path)}")
    if rep.unindexed_count > len(rep.unindexed):
        click.echo(f"  … and {rep.unindexed_count - len(rep.unindexed)} more")
    n_omitted = max(rep.omitted_count, len(rep.omitted))
    click.echo(f"omitted ({n_omitted}): entries the prompt block cuts")
    for e in rep.omitted:
        click.echo(f"  MEMORY.md:{e.line}: {safe(e.target)}")
    if n_omitted > len(rep.omitted):
        click.echo(f"  … and {n_omitted - len(rep.omitted)} more")
    if rep.index_exists and rep.bytes_scanned and rep.bytes_scanned < rep.bytes:
        click.echo(f"(only the first {rep.bytes_scanned} bytes of MEMORY.md were read for entries)")
    age = f"unchanged for {rep.stale_after_days} days or " if rep.stale_after_days else ""
    click.echo(f"stale ({rep.stale_count}): records {age}past their review date")
    for r in rep.stale:
        extra = "".join([f", review after {_fmt_time(r.review_after)}" if r.review_after else "",
                         f", expires {_fmt_time(r.expires_at)}" if r.expires_at else ""])
        click.echo(f"  {safe(r.path)} (last change {_fmt_time(r.updated_at)}{extra})")
    if rep.stale_count > len(rep.stale):
        click.echo(f"  … and {rep.stale_count - len(rep.stale)} more")


@cli.command()
@opt("--workspace", required=True, metavar="WS", help="Workspace to render the prompt block for.")
@opt("--mount-root", metavar="DIR",
     help="Where the stores are mounted. Default: in local mode, the mountpoint of a running "
          "`memfuse dev` of that workspace; else the server's default, /mnt/memory.")
@opt("--max-bytes", type=click.IntRange(min=1024), metavar="N", envvar="MEMFUSE_CONTEXT_MAX_BYTES",
     help="Bound of the whole block in bytes (server default 100,000); what does not fit is "
          "replaced by a marker that says what was left out.")
@api_options
def context(target: Target, workspace: str, mount_root: str | None, max_bytes: int | None) -> None:
    """Print the prompt block of workspace WS: its stores and their MEMORY.md indexes."""
    if mount_root is None and not target.control_plane:
        mount_root = running_dev_mountpoint(workspace)
    text = _api(target, lambda api: with_retries(
        lambda: api.context(workspace, mount_root, max_bytes=max_bytes)))
    click.echo(text, nl=not text.endswith("\n"))


def running_dev_mountpoint(workspace: str) -> str | None:
    """The mountpoint of the ``memfuse dev`` sidecar running for ``workspace`` on this
    machine's dev cache (``<cache dir>/mount.json`` while its cache lock is held), or None."""
    from memfuse.devenv import dev_cache_dir
    from memfuse.sidecar.control import running_mount

    info = running_mount(dev_cache_dir())
    if info is None or info.get("workspace") != workspace:
        return None
    mp = info.get("mountpoint")
    return mp if isinstance(mp, str) and mp else None


SEARCH_PAGE = 100  # records asked for per search page (the API's most)
SEARCH_LINES = 100  # matching lines asked for per record (the API's most)


class SearchError(click.ClickException):
    """A failed ``memfuse search``: exit status 2, as grep's for trouble (1 is "no match")."""

    exit_code = 2


@cli.command()
@click.argument("store_slug", metavar="STORE")
@click.argument("query")
@opt("--path-prefix", "prefix", default="", metavar="PATH",
     help="Only the record at PATH or the records under directory PATH.")
@opt("--type", "rtype", type=click.Choice(["user", "feedback", "project", "reference"]),
     help="Only records of this type.")
@opt("--match", type=click.Choice(["content", "path", "any"]), default=None,
     help="Where QUERY must be: in the content (grep), in the path, or either (the memory "
          "tool's search). A record found by its path alone prints as its bare path. "
          "Default: content; with --rank, any.")
@opt("--rank", is_flag=True,
     help="Rank by relevance (the store's full-text index): records holding every word of "
          "QUERY (as word prefixes, any case), best first; a word in the path or a heading "
          "counts more. Prints the lines holding one of the words.")
@opt("--case-sensitive", is_flag=True,
     help="Match case exactly. Default: both sides compared in Unicode lowercase (ÄPFEL finds äpfel).")
@opt("-l", "--files-with-matches", "files_only", is_flag=True,
     help="Print only the path of each matching record (as grep -l).")
@opt("--limit", type=click.IntRange(min=1), metavar="N",
     help="Stop after N matching records. Default: all of them.")
@api_options
def search(target: Target, store_slug: str, query: str, prefix: str, rtype: str | None, match: str | None,
           rank: bool, case_sensitive: bool, files_only: bool, limit: int | None) -> None:
    """Find QUERY (literal text, one line) in the live records of STORE, like `grep -rn`.

    With --rank, the records holding QUERY's words instead, best first (see --rank).
    Prints PATH:LINE:TEXT for each matching line, in path order (PATH relative to the store
    root, LINE counted from 1, a line longer than 300 characters cut and ended with " …").
    On a terminal, control characters and bidirectional controls in TEXT are shown escaped
    (\\x1b, \\u202e); piped, TEXT is printed as stored. Exit status: 0 when something
    matched, 1 when nothing did, 2 on an error (as grep).
    """
    if rank and case_sensitive:
        raise click.UsageError("--case-sensitive applies to substring search, not to --rank")
    match = match or ("any" if rank else "content")
    tty = stdout_is_terminal()
    out = getattr(sys.stdout, "buffer", None) or sys.stdout  # bytes: UTF-8 whatever the locale

    def emit(line: str) -> None:
        data = (line + "\n").encode("utf-8", "replace")
        out.write(data if out is not sys.stdout else data.decode("utf-8"))

    async def body(api: ApiClient) -> int:
        found = 0
        cursor: str | None = None
        while True:
            page = await with_retries(lambda: api.search(
                store_slug, query, match=match, prefix=prefix, type=rtype,
                case_sensitive=case_sensitive, cursor=cursor, limit=SEARCH_PAGE,
                max_lines=0 if files_only else SEARCH_LINES, order="relevance" if rank else "path"))
            for hit in page.hits:
                path = hit.record.path
                if files_only or not hit.lines:
                    emit(path)
                else:
                    for ln in hit.lines:
                        text = ln.text
                        if tty:
                            text = terminal_safe(text[:-1] if text.endswith("\r") else text)
                        emit(f"{path}:{ln.line}:{text}")
                    if hit.line_matches > len(hit.lines):
                        out.flush()
                        click.echo(f"memfuse: {path}: {hit.line_matches - len(hit.lines)} more matching "
                                   f"lines not shown (`memfuse show {store_slug} {path}`)", err=True)
                found += 1
                if limit is not None and found >= limit:
                    return found
            out.flush()
            cursor = page.next_cursor
            if cursor is None:
                return found

    sys.stdout.flush()
    try:
        found = _read_api(target, body)
    except (click.exceptions.Abort, click.exceptions.Exit):
        raise
    except BrokenPipeError:  # the reader left (`| head`): quiet, as grep killed by SIGPIPE
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        sys.exit(128 + 13)
    except KeyboardInterrupt:
        raise click.exceptions.Abort() from None
    except Exception as e:  # noqa: BLE001 — one line, exit 2
        if os.environ.get("MEMFUSE_TRACEBACK"):
            raise
        err = click_error(e)
        raise SearchError(err.message) from None
    if not found:
        sys.exit(1)
