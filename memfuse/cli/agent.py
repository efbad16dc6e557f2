"""``memfuse mcp``: the memory tools for agents without a mount, served to an MCP client on
stdio (docs/AGENT-TOOLS.md)."""
from __future__ import annotations

import click

from memfuse.cli.common import Seconds, Target, _run, _setup_logging, api_options, cli, opt


@cli.command()
@opt("--workspace", required=True, metavar="WS", help="Workspace whose stores the tools act on.")
@opt("--client-name", default="mcp", show_default=True, metavar="NAME",
     help="Recorded on every version written through the tools as actor tool:NAME.")
@opt("--drain-timeout", type=Seconds(), default=None, metavar="S",
     help="When stdin closes (the client's shutdown), finish the requests already read for "
          "up to S seconds before exiting. Default: the request timeout (30 s).")
@opt("--debug", is_flag=True, help="Verbose logging (stderr).")
@api_options
def mcp(target: Target, workspace: str, client_name: str, drain_timeout: float | None,
        debug: bool) -> None:
    """Serve the memory tools to an MCP client (Claude Desktop, Cursor, Cherry Studio...) on
    stdin/stdout: memory_view, memory_create, memory_str_replace, memory_insert, memory_delete,
    memory_rename, memory_search, memory_history, memory_remember on /memories/<store>/.
    When stdin closes, the requests already read are answered, then it exits 0.

    With --control-plane the commands go to that control plane over HTTP with the workspace
    token; without it, to the local dev database in-process (`memfuse dev`'s). stdout carries
    only the protocol; logs go to stderr. See docs/AGENT-TOOLS.md."""
    _setup_logging(debug)
    from memfuse.mcp_server import serve_stdio

    async def main() -> None:
        async with target.client(faces=True) as api:
            api.set_instance(client_name)
            await serve_stdio(api, workspace, drain_timeout=drain_timeout)

    _run(main)
