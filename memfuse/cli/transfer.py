"""The ``import`` and ``export`` commands: options, the summary lines and the exit status.

The work (walking a directory, checking and writing files, writing records out) is in
:mod:`memfuse.transfer`, which knows nothing of click; this room only turns its reports into
output.
"""
from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import click

from memfuse.cli.common import Target, _api, _human_bytes, _one_line, api_options, cli, opt
from memfuse.client import with_retries
from memfuse.transfer import (
    MANIFEST_PATH,
    ImportReport,
    ManifestError,
    export_records,
    import_files,
    import_walk,
    read_manifest,
    shown,
)


T = TypeVar("T")


def progress_bar(total: int, desc: str, unit: str) -> Any:
    """A progress bar (``tqdm``) of ``total`` items (``unit``) on stderr when stderr is a terminal,
    else None: piped or redirected, import and export print exactly their lines and nothing
    else. The bar is cleared when closed (``leave=False``); redrawn at most 10 times a second."""
    try:
        tty = sys.stderr.isatty()
    except (AttributeError, ValueError):
        tty = False
    if not tty:
        return None
    from tqdm import tqdm

    try:  # a terminal that reports no size (0 columns: some ptys) gets $COLUMNS or 80
        sized = os.get_terminal_size(sys.stderr.fileno()).columns > 0
    except (OSError, ValueError):
        sized = False
    width = {"dynamic_ncols": True} if sized else {"ncols": shutil.get_terminal_size().columns}
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, mininterval=0.1, **width)


def _ticking(bar: Any, items: Iterable[T]) -> Iterable[T]:
    """``items``, the bar advanced by one as each is done (when the next is asked for)."""
    first = True
    for item in items:
        if not first:
            bar.update(1)
        first = False
        yield item
    if not first:
        bar.update(1)


def _echo_with(bar: Any) -> Callable[[str], None]:
    """``click.echo``, or above the bar while one is shown (``tqdm.write``: the bar is redrawn
    under the line)."""
    if bar is None:
        return click.echo
    return lambda line: bar.write(line, file=sys.stdout)


@cli.command("import")
@click.argument("store_slug", metavar="STORE")
@click.argument("directory", metavar="DIR",
                type=click.Path(exists=True, file_okay=False, readable=True, path_type=Path))
@opt("--dry-run", is_flag=True, help="Check every file against the store's rules; write nothing.")
@opt("-q", "--quiet", is_flag=True, help="No line per file: only the summary, what was skipped and what was refused.")
@api_options
def import_(target: Target, store_slug: str, directory: Path, dry_run: bool, quiet: bool) -> None:
    """Load the memory files under DIR into STORE, keeping their paths.

    Every regular file becomes the record at its path relative to DIR (a Claude Code memory
    directory with MEMORY.md and frontmatter files, a FACT.md + JOURNAL.jsonl workspace, a
    single user_profile.md, ...): created when the path is new, updated when its content
    differs, left alone when identical. Each record gets its file's permission bits and
    modification time (as `cp -p` keeps them); a file differing only in those updates them
    without sending its content. Types come from each file's frontmatter (`type:` or
    `metadata.type:`), else the store's default type (or, on update, the record's current
    type). Hidden files and directories, editor temporaries and symbolic links are skipped.

    A directory written by `memfuse export` has a manifest (.memfuse/export.json): the files
    it lists are imported whatever their names (dot-files too), and each one still as
    exported gets the exported type, permission bits and modification time back.

    Files the store refuses (not UTF-8, unknown type, a secret, too large, bad name, store
    full) are listed at the end; the others are imported. Exits 1 only when files were found
    and none could be imported.
    """
    try:
        manifest = read_manifest(directory)
    except ManifestError as e:
        raise click.ClickException(_one_line(e)) from None
    files, skipped = import_walk(directory, manifest or ())
    bar = progress_bar(len(files), "checking" if dry_run else "importing", "file")
    try:
        items = files if bar is None else _ticking(bar, files)
        echo = (lambda line: None) if quiet else _echo_with(bar)
        report = _api(target, lambda api: import_files(api, store_slug, items, dry_run, echo, manifest))
    finally:
        if bar is not None:
            bar.close()
    report.skipped = skipped
    found = {p for p, _ in files}
    for path in sorted(manifest or (), key=lambda p: p.encode("utf-8")):
        if path not in found:
            report.refused.append((path, f"listed in {MANIFEST_PATH} but not a regular file in DIR [missing]"))
    click.echo(import_summary(report, store_slug, dry_run))
    if report.skipped:
        click.echo("skipped: " + ", ".join(shown(s) for s in report.skipped))
    if report.refused:
        click.echo("refused:")
        for path, reason in report.refused:
            click.echo(f"  {shown(path)}: {reason}")
    if files and not report.done:
        raise click.ClickException(f"nothing imported: all {len(files)} file(s) were refused")


def import_summary(report: ImportReport, store_slug: str, dry_run: bool) -> str:
    """The summary line of ``memfuse import``: how many files were imported (created or
    updated; a dry run: would be), then unchanged, refused, skipped, each counted on its own
    (newuser26: "imported 5 of 7 file(s) ...: 5 unchanged" when nothing was imported)."""
    counts = report.counts()
    if dry_run:
        kinds = (("would create", "to create"), ("would update", "to update"))
    else:
        kinds = (("created", "created"), ("updated", "updated"))
    imported = sum(counts.get(action, 0) for action, _ in kinds)
    detail = ", ".join(f"{counts[action]} {word}" for action, word in kinds if counts.get(action))
    return (f"{'would import' if dry_run else 'imported'} {imported} file(s) into {store_slug}"
            + (f" ({detail})" if detail else "")
            + f"; {counts.get('unchanged', 0)} unchanged, {len(report.refused)} refused, "
            f"{len(report.skipped)} skipped"
            + (" (dry run: nothing written)" if dry_run else ""))


@cli.command()
@click.argument("store_slug", metavar="STORE")
@click.argument("directory", metavar="DIR", type=click.Path(file_okay=False, path_type=Path))
@api_options
def export(target: Target, store_slug: str, directory: Path) -> None:
    """Write every live record of STORE under DIR at its path, byte for byte.

    Directories are created as needed; a file that exists at a record's path is replaced
    (atomically); other files under DIR are left alone. Each file gets the record's
    permission bits (plus the owner's read bit) and modification time. The manifest
    DIR/.memfuse/export.json lists every record written with its type, permission bits,
    modification time and sha256 (format: docs/CLI.md), so that `memfuse import` of DIR gives
    the same records back: paths (dot-files included), content, types (set by frontmatter,
    xattr or the console), modes and times.
    """
    bar = progress_bar(0, "reading", "record")
    try:
        if bar is None:
            records, _ = _api(target, lambda api: with_retries(lambda: api.snapshot(store_slug, content=True)))
        else:
            records = _api(target, lambda api: _read_with_bar(api, store_slug, bar))
            bar.close()
            bar = progress_bar(len(records), "writing", "record")
        report = export_records(records if bar is None else _ticking(bar, records), directory, store_slug)
    finally:
        if bar is not None:
            bar.close()
    click.echo(f"exported {report.written} record(s), {_human_bytes(report.bytes)}, from {store_slug} to {directory}")
    if report.failed:
        click.echo("failed:")
        for path, reason in report.failed:
            click.echo(f"  {shown(path)}: {_one_line(reason)}")
        raise click.ClickException(f"{len(report.failed)} record(s) could not be written")


async def _read_with_bar(api: Any, store_slug: str, bar: Any) -> list[Any]:
    """Every live record of the store with content, as ``ApiClient.snapshot`` reads them
    (the same pages), the bar advanced per page; its total is the store's record count."""
    store = await with_retries(lambda: api.get_store(store_slug))

    async def read() -> list[Any]:
        bar.reset(total=store.record_count)
        records: list[Any] = []
        async for page in api.iter_pages(store_slug, content=True):
            records.extend(page.records)
            bar.update(len(page.records))
        return records

    return await with_retries(read)
