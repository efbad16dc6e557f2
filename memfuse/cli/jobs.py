"""Consolidation jobs from the command line: ``memfuse consolidate STORE``, ``memfuse job
show|list|cancel`` (docs/CLI.md, docs/API.md "Consolidation jobs"). Text from the store or
the model (instructions, summaries, paths, errors) is shown escaped on a terminal."""
from __future__ import annotations

from pathlib import Path

import click
import msgspec
import trio

from memfuse.cli.common import (
    Seconds,
    Target,
    _api,
    _fmt_time,
    _table,
    api_options,
    cli,
    opt,
    stdout_is_terminal,
    terminal_safe,
)
from memfuse.client import ApiClient
from memfuse.wire import ConsolidationJob

TERMINAL = ("completed", "failed", "canceled")


def _safe(text: str) -> str:
    return terminal_safe(text) if stdout_is_terminal() else text


def _print_job(job: ConsolidationJob, as_json: bool) -> None:
    if as_json:
        click.echo(msgspec.json.encode(job).decode())
        return
    click.echo(f"job {job.id}: {job.status}")
    click.echo(f"  store: {job.store} → {job.output}"
               + (f" ({job.output_store})" if job.output_store else ""))
    click.echo(f"  model: {_safe(job.model)}; asked by {_safe(job.requested_by)}"
               + ("; scheduled" if job.scheduled else ""))
    click.echo(f"  created {_fmt_time(job.created_at)}"
               + (f", started {_fmt_time(job.started_at)}" if job.started_at else "")
               + (f", finished {_fmt_time(job.finished_at)}" if job.finished_at else ""))
    if job.usage is not None:
        click.echo(f"  tokens: {job.usage.input_tokens} in, {job.usage.output_tokens} out")
    if job.error:
        click.echo(f"  error: {_safe(job.error)}")
    if job.summary:
        click.echo(f"  summary: {_safe(job.summary)}")
    for c in job.changes:
        click.echo(f"  {c.op:6} {_safe(c.path)}")


async def _wait(api: ApiClient, job: ConsolidationJob, timeout: float) -> ConsolidationJob:
    with trio.move_on_after(timeout):
        while job.status not in TERMINAL:
            await trio.sleep(1.0)
            job = await api.get_consolidation(job.id)
    return job


@cli.command("consolidate")
@click.argument("store_slug", metavar="STORE")
@opt("--instructions", metavar="TEXT", envvar="MEMFUSE_CONSOLIDATE_INSTRUCTIONS", help="What the model should do with the store.")
@opt("--instructions-file", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
     help="Read the instructions from FILE instead.")
@opt("--in-place", is_flag=True,
     help="Write into STORE itself (each change a version restore undoes) instead of a new store.")
@opt("--model", help="Model name (default: the server's).")
@opt("--include-history", is_flag=True,
     help="Also give the model the store's recent change history (paths, operations, actors, times).")
@opt("--wait", "wait_s", type=Seconds(), default=None, metavar="SECONDS",
     help="Wait up to SECONDS for the job to end and print it (exit 1 unless it completed).")
@opt("--json", "as_json", is_flag=True, help="Print the job as JSON (the API's body).")
@api_options
def consolidate(target: Target, store_slug: str, instructions: str | None, instructions_file: Path | None,
                in_place: bool, model: str | None, include_history: bool, wait_s: float | None,
                as_json: bool) -> None:
    """Start a consolidation job on STORE: a model rewrites its records into a new store for
    review (default) or in place.

    The new store is attached to no workspace: an admin reviews it (the console shows the
    diff) and attaches it (accepts) or archives it (discards). With a workspace token, a new
    job is refused while the store has a few outputs waiting for review (409 review_pending)
    and past the server's jobs per hour (429 rate_limited)."""
    if (instructions is None) == (instructions_file is None):
        raise click.UsageError("give the instructions as --instructions or --instructions-file (one of them)")
    if instructions_file is not None:
        try:
            instructions = instructions_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise click.UsageError(f"cannot read --instructions-file {instructions_file}: {e}") from None
    assert instructions is not None

    async def body(api: ApiClient) -> ConsolidationJob:
        job = await api.create_consolidation(store_slug, instructions, "in_place" if in_place else "new_store",
                                             model, include_history)
        if wait_s:
            job = await _wait(api, job, wait_s)
        return job

    job = _api(target, body)
    _print_job(job, as_json)
    if wait_s and job.status != "completed":
        raise SystemExit(1)


@cli.group()
def job() -> None:
    """Show, list and cancel consolidation jobs."""


@job.command("show")
@click.argument("job_id", metavar="ID")
@opt("--json", "as_json", is_flag=True, help="Print the job as JSON (the API's body).")
@api_options
def job_show(target: Target, job_id: str, as_json: bool) -> None:
    """Show consolidation job ID: its status, output store, tokens, error and changes."""
    _print_job(_api(target, lambda api: api.get_consolidation(job_id)), as_json)


@job.command("list")
@click.argument("store_slug", metavar="STORE")
@opt("--json", "as_json", is_flag=True, help="Print the jobs as JSON (the API's body).")
@api_options
def job_list(target: Target, store_slug: str, as_json: bool) -> None:
    """List STORE's consolidation jobs, newest first."""
    jobs = _api(target, lambda api: api.list_consolidations(store_slug))
    if as_json:
        click.echo(msgspec.json.encode(jobs).decode())
        return
    rows = [[j.id, j.status, j.output, j.output_store or "-", _fmt_time(j.created_at),
             _safe((j.error or "")[:60])] for j in jobs]
    click.echo(_table(rows, ["ID", "STATUS", "OUTPUT", "OUTPUT STORE", "CREATED", "ERROR"]))


@job.command("cancel")
@click.argument("job_id", metavar="ID")
@api_options
def job_cancel(target: Target, job_id: str) -> None:
    """Cancel consolidation job ID (it writes nothing)."""
    j = _api(target, lambda api: api.cancel_consolidation(job_id))
    click.echo(f"job {j.id}: {j.status}")
