"""The agent-tool faces against a real ``memfuse serve`` and a real mount: a tool write shows
in the mount, a mount write shows to ``view`` at once, ``/mcp`` over streamable HTTP with
bearer auth, and ``memfuse mcp`` on stdio as a desktop app launches it."""
from __future__ import annotations

import os
import time
import uuid

import httpx
import httpx2
import pytest
import trio
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from memfuse.client import ApiClient
from memfuse.server.streams import HEARTBEAT_SECONDS
from mountutil import MEMFUSE, read, serve_and_mount, wait_until

pytestmark = pytest.mark.mount


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agent-tools")
    with serve_and_mount(tmp) as (cp, sc):
        yield cp, sc, (tmp / "ws.token")


def tool(cp, token_file, command: dict) -> tuple[str, bool]:
    async def go():
        async with ApiClient(cp.url, token_file.read_text().strip(), instance="live") as api:
            r = await api.memory_tool("ws", command)
            return r.content, r.is_error
    return trio.run(go)


def test_tool_write_appears_in_the_mount_and_back(live):
    """Each of 10 tool writes is read from the mount (the median must be under 1 s; each
    within half the feed's 20 s heartbeat, the other way a change could reach the mount, as in
    test_sharing's latency test: 3 s each was inside a loaded machine's noise); a mount write
    is visible to view at once (close commits)."""
    cp, sc, tok = live
    d = "t-" + uuid.uuid4().hex[:6]
    lat = []
    for i in range(10):
        t0 = time.monotonic()
        assert tool(cp, tok, {"command": "create", "path": f"/memories/default/{d}/f{i}.md",
                              "file_text": f"fact {i}\n"}) == (
            f"File created successfully at: /memories/default/{d}/f{i}.md", False)
        p = sc.mountpoint / "default" / d / f"f{i}.md"
        lat.append(wait_until(lambda: read(p) == f"fact {i}\n", HEARTBEAT_SECONDS / 2,
                              f"tool write {i} in the mount") - t0)
    lat.sort()
    print(f"tool write → mount: p50={lat[5] * 1000:.0f} ms max={lat[-1] * 1000:.0f} ms")
    assert lat[5] < 1.0, lat
    # the other way: a write through the mount, then view at once
    (sc.mountpoint / "default" / d / "from-mount.md").write_text("written with cat\n")
    assert tool(cp, tok, {"command": "view", "path": f"/memories/default/{d}/from-mount.md"}) == (
        f"Here's the content of /memories/default/{d}/from-mount.md with line numbers:\n"
        "     1\twritten with cat\n     2\t", False)
    # an append through the tool lands in the mounted file
    tool(cp, tok, {"command": "insert", "path": f"/memories/default/{d}/from-mount.md", "insert_line": 1,
                   "insert_text": "appended by a tool"})
    p = sc.mountpoint / "default" / d / "from-mount.md"
    wait_until(lambda: read(p) == "written with cat\nappended by a tool\n", 3.0, "the append in the mount")


def test_mcp_over_http_with_bearer_auth(live):
    cp, sc, tok = live
    url = cp.url + "/mcp"
    r = httpx.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
    assert r.status_code == 401
    challenge = r.headers["WWW-Authenticate"]
    assert challenge.startswith("Bearer ") and f'resource_metadata="{cp.url}/.well-known/oauth-protected-resource/mcp"' in challenge
    meta = httpx.get(f"{cp.url}/.well-known/oauth-protected-resource/mcp").json()
    assert meta["resource"] == url and meta["bearer_methods_supported"] == ["header"]
    r = httpx.post(url, json={}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401

    async def go():
        headers = {"Authorization": f"Bearer {tok.read_text().strip()}"}
        async with httpx2.AsyncClient(headers=headers, timeout=30) as http:
            async with Client(streamable_http_client(url, http_client=http), mode="legacy") as client:
                assert "## Store `default` at `/memories/default/` (read-write)" in client.instructions
                assert ".memfuse/errors.log" not in client.instructions  # no mount here
                names = [t.name for t in (await client.list_tools()).tools]
                assert "memory_remember" in names
                r = await client.call_tool("memory_remember", {"fact": "served over HTTP"})
                assert not r.is_error, r
                r = await client.call_tool("memory_view", {"path": "/memories/nope"})
                assert r.is_error and r.content[0].text == (
                    "The path /memories/nope does not exist. Please provide a valid path.")
    trio.run(go)
    p = sc.mountpoint / "default" / "notes.md"
    wait_until(lambda: "- served over HTTP\n" in (read(p) or ""), 3.0, "the remembered fact in the mount")
    rec = cp.call("list_records", "default", path="notes.md").records[0]
    assert rec.updated_by == "tool:mcp"


def test_memfuse_mcp_on_stdio(live, tmp_path):
    cp, sc, tok = live
    errlog = tmp_path / "mcp-stderr.log"

    async def go():
        params = StdioServerParameters(
            command=MEMFUSE,
            args=["mcp", "--control-plane", cp.url, "--workspace", "ws", "--token-file", str(tok),
                  "--client-name", "desktop"],
            env=dict(os.environ))
        with errlog.open("w") as err, trio.fail_after(60):
            from mcp.client.stdio import stdio_client

            async with Client(stdio_client(params, errlog=err), mode="legacy") as client:
                assert "memory_view /memories" in client.instructions
                r = await client.call_tool("memory_create", {"path": "/memories/default/stdio.md",
                                                             "file_text": "over stdio\n"})
                assert (r.is_error, r.content[0].text) == (False, "File created successfully at: "
                                                                   "/memories/default/stdio.md")
    trio.run(go)
    wait_until(lambda: read(sc.mountpoint / "default" / "stdio.md") == "over stdio\n", 3.0, "stdio write")
    assert cp.call("list_records", "default", path="stdio.md").records[0].updated_by == "tool:desktop"


def test_memfuse_mcp_on_stdio_in_local_mode(tmp_path):
    """``memfuse mcp --workspace dev`` without --control-plane (the line ``memfuse dev``
    prints for desktop apps) serves the tools on the local dev database in process."""
    errlog = tmp_path / "mcp-local-stderr.log"
    env = dict(os.environ, MEMFUSE_HOME=str(tmp_path / "home"))
    env.pop("MEMFUSE_CONTROL_PLANE", None)

    async def setup():  # what `memfuse dev` made on its first start
        from memfuse.devenv import dev_app, ensure_dev_setup

        async with dev_app(f"sqlite:///{tmp_path / 'home' / 'dev.db'}").admin_client() as api:
            await ensure_dev_setup(api)
    (tmp_path / "home").mkdir()
    trio.run(setup)

    async def go():
        params = StdioServerParameters(command=MEMFUSE, args=["mcp", "--workspace", "dev"], env=env)
        with errlog.open("w") as err, trio.fail_after(90):
            from mcp.client.stdio import stdio_client

            async with Client(stdio_client(params, errlog=err), mode="legacy") as client:
                r = await client.call_tool("memory_create", {"path": "/memories/default/local.md",
                                                             "file_text": "in process\n"})
                assert (r.is_error, r.content[0].text) == (False, "File created successfully at: "
                                                                   "/memories/default/local.md")
                r = await client.call_tool("memory_view", {"path": "/memories/default/local.md"})
                assert not r.is_error and "in process" in r.content[0].text
    trio.run(go)


def test_anthropic_sdk_adapter(live):
    """The SDK adapter runs the runner's commands in memfuse; refusals are the SDK's ToolError."""
    pytest.importorskip("anthropic")
    from anthropic.lib.tools import ToolError

    from memfuse.anthropic_tool import MemfuseMemoryTool

    cp, sc, tok = live
    memory = MemfuseMemoryTool(cp.url, workspace="ws", token=tok.read_text().strip(), client_name="sdk-test")
    try:
        assert memory.to_dict() == {"type": "memory_20250818", "name": "memory"}
        assert memory.call({"command": "create", "path": "/memories/default/sdk.md", "file_text": "from the SDK\n"}) == (
            "File created successfully at: /memories/default/sdk.md")
        assert memory.call({"command": "view", "path": "/memories/default/sdk.md", "view_range": [1, 1]}) == (
            "Here's the content of /memories/default/sdk.md with line numbers:\n     1\tfrom the SDK")
        with pytest.raises(ToolError, match="^File /memories/default/sdk.md already exists$"):
            memory.call({"command": "create", "path": "/memories/default/sdk.md", "file_text": "x"})
    finally:
        memory.close()
    wait_until(lambda: read(sc.mountpoint / "default" / "sdk.md") == "from the SDK\n", 3.0, "SDK write in the mount")
    assert cp.call("list_records", "default", path="sdk.md").records[0].updated_by == "tool:sdk-test"
