"""memfuse as the backend of Anthropic's memory tool (``memory_20250818``) in the Python SDK.

    from anthropic import Anthropic
    from memfuse.anthropic_tool import MemfuseMemoryTool

    memory = MemfuseMemoryTool("http://127.0.0.1:8080", workspace="ws", token=open("ws.token").read().strip())
    runner = Anthropic().beta.messages.tool_runner(
        model="claude-sonnet-4-5", max_tokens=1024, tools=[memory],
        messages=[{"role": "user", "content": "Remember that I like green tea"}])
    for message in runner: ...

Every command is sent as is to ``POST /v1/workspaces/{ws}/memory-tool``; the control plane
runs it on the workspace's stores (``/memories/<store>/...``), so what the model writes shows
in every mount of those stores. A refused command raises the SDK's ``ToolError`` with the
engine's text (the runner hands it to the model with ``is_error``). Needs the optional extra
``memfuse[anthropic]``.
"""
from __future__ import annotations

from typing import Any

import httpx
from anthropic.lib.tools import BetaAbstractMemoryTool, ToolError

CLIENT_HEADER = "X-Memfuse-Instance"


class MemfuseMemoryTool(BetaAbstractMemoryTool):
    """A ``BetaAbstractMemoryTool`` whose commands run in a memfuse control plane.

    ``base_url``: the control plane (``http://127.0.0.1:8080``); ``workspace`` and its
    ``token``; ``client_name`` is recorded on versions as actor ``tool:<client_name>``;
    ``http`` an ``httpx.Client`` to use instead of a new one (tests pass an in-process
    transport). Raises ``httpx.HTTPError`` when the control plane cannot be reached or
    refuses the token.
    """

    def __init__(self, base_url: str, *, workspace: str, token: str, client_name: str = "anthropic-sdk",
                 http: httpx.Client | None = None, timeout: float = 60.0) -> None:
        super().__init__()
        self.workspace = workspace
        self._http = http or httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout)
        self._headers = {"Authorization": f"Bearer {token}", CLIENT_HEADER: client_name}

    def __repr__(self) -> str:  # never show the token
        return f"MemfuseMemoryTool(workspace={self.workspace!r})"

    def _run(self, command: Any) -> str:
        body = command.to_dict() if hasattr(command, "to_dict") else dict(command)
        r = self._http.post(f"/v1/workspaces/{self.workspace}/memory-tool", json=body, headers=self._headers)
        r.raise_for_status()
        result = r.json()
        if result.get("is_error"):
            raise ToolError(result["content"])
        content: str = result["content"]  # MemoryToolResult.content (docs/API.md)
        return content

    # The six commands of memory_20250818, each sent as is.
    def view(self, command: Any) -> str:
        return self._run(command)

    def create(self, command: Any) -> str:
        return self._run(command)

    def str_replace(self, command: Any) -> str:
        return self._run(command)

    def insert(self, command: Any) -> str:
        return self._run(command)

    def delete(self, command: Any) -> str:
        return self._run(command)

    def rename(self, command: Any) -> str:
        return self._run(command)

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self._http.close()
