"""The ``import`` and ``export`` commands: options, the summary lines and the exit status.

The work (walking a directory, checking and writing files, writing records out) is in
:mod:`memfuse.transfer`, which knows nothing of click; this room only turns its reports into
output.
"""
from __future__ import annotations

from pathlib import Path

import click

from memfuse.cli.common import Target, _api, _human_bytes, _one_line, api_options, cli, opt
from memfuse.client import with_retries
from memfuse.transfer import (
    IMPORT_ACTIONS,
    MANIFEST_PATH,
    ManifestError,
    export_records,
    import_files,
    import_walk,
    read_manifest,
    shown,
)


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
    report = _api(target, lambda api: import_files(api, store_slug, files, dry_run, click.echo, manifest))
    report.skipped = skipped
    found = {p for p, _ in files}
    for path in sorted(manifest or (), key=lambda p: p.encode("utf-8")):
        if path not in found:
            report.refused.append((path, f"listed in {MANIFEST_PATH} but not a regular file in DIR [missing]"))
    counts = report.counts()
    parts = [f"{counts[a]} {a}" for a in IMPORT_ACTIONS if counts.get(a)]
    verb = "checked" if dry_run else "imported"
    click.echo(
        f"{verb} {len(report.done)} of {len(files)} file(s) into {store_slug}"
        + (f": {', '.join(parts)}" if parts else "")
        + f"; {len(report.refused)} refused; {len(report.skipped)} skipped"
        + (" (dry run: nothing written)" if dry_run else "")
    )
    if report.skipped:
        click.echo("skipped: " + ", ".join(shown(s) for s in report.skipped))
    if report.refused:
        click.echo("refused:")
        for path, reason in report.refused:
            click.echo(f"  {shown(path)}: {reason}")
    if files and not report.done:
        raise click.ClickException(f"nothing imported: all {len(files)} file(s) were refused")


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
    records, _ = _api(target, lambda api: with_retries(lambda: api.snapshot(store_slug, content=True)))
    report = export_records(records, directory, store_slug)
    click.echo(f"exported {report.written} record(s), {_human_bytes(report.bytes)}, from {store_slug} to {directory}")
    if report.failed:
        click.echo("failed:")
        for path, reason in report.failed:
            click.echo(f"  {shown(path)}: {_one_line(reason)}")
        raise click.ClickException(f"{len(report.failed)} record(s) could not be written")
