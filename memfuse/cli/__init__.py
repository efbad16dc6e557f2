"""The ``memfuse`` command line: the entry point ``main`` and the root group ``cli``.

Commands: ``serve``, ``dev``, ``mount``, ``status``, ``store create|list|show|update``,
``workspace create|list``, ``attach``, ``detach``, ``token create``, ``history``, ``show``,
``restore``, ``redact``, ``search``, ``context``, ``consolidate``, ``job show|list|cancel``, ``import``, ``export``, ``db upgrade|current``, ``mcp``,
``mounts add|remove``.

Every option also reads ``MEMFUSE_<OPTION>`` from the environment (``--control-plane`` →
``MEMFUSE_CONTROL_PLANE``, ``--token-file`` → ``MEMFUSE_TOKEN_FILE``, ...; the exceptions, which
read none, are listed in docs/CLI.md); a raw token may be given as ``MEMFUSE_TOKEN``. API commands without ``--control-plane`` run the reference control
plane in-process on the dev database (local mode, see :mod:`memfuse.devenv`), which works while
``memfuse dev`` runs on the same file.

Errors print one line to stderr and exit 1 (2 for usage errors); never a traceback, unless
``MEMFUSE_TRACEBACK=1`` is set. Output into a pipe whose reader has gone (``| head -1``) ends
the command quietly with status 141, as a shell reports for git or grep there.

One module per command group, each registering its commands on ``cli`` when imported (only
the invoked command's module is imported: ``cli.lazy_commands``):
``common`` (the root group and the plumbing every command shares), ``run`` (``serve``,
``dev``, ``mount``, ``status``), ``admin`` (stores, workspaces, attachments, tokens),
``records`` (``history``, ``show``, ``diff``, ``restore``, ``redact``, ``search``, ``index``, ``context``),
``jobs`` (``consolidate``, ``job show|list|cancel``: consolidation jobs), ``transfer``
(``import``, ``export``, over :mod:`memfuse.transfer`), ``db`` (schema migrations of the
control-plane database), ``agent`` (``mcp``, the MCP server for agents without a mount) and
``sidecar`` (``mounts``: a running sidecar's admin API).
"""
from __future__ import annotations

import sys

# httpx's own command line (``httpx._main``, imported by ``import httpx`` whenever click is
# installed) loads pygments and rich when they are present: ~1 MiB of every memfuse process's
# memory (the sidecar's baseline) for a tool memfuse never runs. Marking it absent makes httpx
# skip it (its ``main`` then says its dependencies are missing).
if "httpx" not in sys.modules:
    sys.modules.setdefault("httpx._main", None)  # type: ignore[assignment]

from memfuse.cli.common import ByteSize, cli  # noqa: E402

#: command -> the module registering it, imported when the command is looked up
#: (``MemfuseGroup.lazy_commands``; tests/test_cli.py checks this against the modules)
cli.lazy_commands = {
    "serve": "run", "dev": "run", "mount": "run", "status": "run",
    "store": "admin", "workspace": "admin", "attach": "admin", "detach": "admin", "token": "admin", "account": "admin",
    "history": "records", "show": "records", "diff": "records", "restore": "records", "redact": "records",
    "context": "records", "search": "records", "index": "records",
    "consolidate": "jobs", "job": "jobs",
    "import": "transfer", "export": "transfer",
    "db": "db",
    "mcp": "agent",
    "mounts": "sidecar",
}

__all__ = ["ByteSize", "cli", "main"]


def main() -> None:
    """Console-script entry point (``memfuse``). Exits with the command's status; a closed
    stdout pipe (``| head -1``) ends it quietly with status 141 (``EXIT_BROKEN_PIPE``)."""
    import click

    from memfuse.cli.common import flush_stdout

    try:
        cli.main(prog_name="memfuse")
    except SystemExit:
        try:
            flush_stdout()  # output still buffered meets the closed pipe here, not at exit
        except click.exceptions.Exit as e:
            sys.exit(e.exit_code)
        raise


if __name__ == "__main__":  # pragma: no cover
    main()
