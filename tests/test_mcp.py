"""The MCP face, in process: an MCP client session (the official ``mcp`` SDK, under trio) on
the server ``memfuse mcp`` runs on stdio (``HttpBackend`` over the in-process fake control
plane), for every tool and its errors, the instructions, the index resources and their
subscriptions."""
from __future__ import annotations

import json

import anyio
import mcp_types as types
import pytest
import trio
from mcp import Client

from memfuse.client import ApiClient
from memfuse.mcp_server import TOOLS, HttpBackend, IndexWatcher, build_server, index_uri

M = "/memories/default"


@pytest.fixture
async def server(fake):
    """The server ``memfuse mcp`` runs (HttpBackend over the fake, index subscriptions)."""
    token = await fake.setup("ws", stores=("default",))
    await fake.setup("ws", stores=("ro",), access="read_only")
    async with ApiClient(fake.base_url, token, transport=fake.transport, instance="mcp-test") as api:
        backend = HttpBackend(api, "ws")
        async with anyio.create_task_group() as tg:
            watcher = IndexWatcher(api, tg)
            watcher.POLL_WAIT = 5.0
            yield build_server(lambda: backend, instructions=await backend.instructions(),
                               on_subscribe=watcher.subscribe, on_unsubscribe=watcher.unsubscribe)
            tg.cancel_scope.cancel()


@pytest.fixture
async def session(server):
    async with Client(server) as client:
        yield client


async def call(client, name, **args) -> tuple[str, bool]:
    r = await client.call_tool(name, args)
    assert len(r.content) == 1 and r.content[0].type == "text"
    return r.content[0].text, r.is_error


def _walk(schema):
    if isinstance(schema, dict):
        yield schema
        for v in schema.values():
            yield from _walk(v)
    elif isinstance(schema, list):
        for v in schema:
            yield from _walk(v)


async def test_tools_are_flat_without_unions(session):
    tools = (await session.list_tools()).tools
    assert [t.name for t in tools] == [
        "memory_view", "memory_create", "memory_str_replace", "memory_insert", "memory_delete",
        "memory_rename", "memory_search", "memory_history", "memory_remember"]
    for t in tools:
        assert t.input_schema["type"] == "object"
        for node in _walk(t.input_schema):
            assert not {"oneOf", "anyOf", "allOf"} & set(node), t.name
            assert not isinstance(node.get("type"), list), t.name
    by = {t.name: t.input_schema for t in tools}
    assert set(by["memory_insert"]["properties"]) == {"path", "insert_line", "insert_text"}
    assert set(by["memory_rename"]["properties"]) == {"old_path", "new_path"}
    assert set(by["memory_str_replace"]["properties"]) == {"path", "old_str", "new_str"}
    assert TOOLS == tools


async def test_instructions_carry_the_context_block(session):
    text = session.instructions
    assert "memory_view /memories" in text
    assert "## Store `default` at `/memories/default/` (read-write)" in text
    assert "## Store `ro` at `/memories/ro/` (read-only)" in text
    assert ".memfuse/errors.log" not in text  # no mount: refusals come back as tool results


async def test_every_tool_and_its_errors(session):
    assert await call(session, "memory_create", path=f"{M}/a.md", file_text="one\ntwo\n") == (
        f"File created successfully at: {M}/a.md", False)
    assert await call(session, "memory_create", path=f"{M}/a.md", file_text="x") == (
        f"File {M}/a.md already exists", True)
    assert await call(session, "memory_view", path=f"{M}/a.md") == (
        f"Here's the content of {M}/a.md with line numbers:\n     1\tone\n     2\ttwo\n     3\t", False)
    assert await call(session, "memory_view", path=f"{M}/a.md", view_range=[2, 2]) == (
        f"Here's the content of {M}/a.md with line numbers:\n     2\ttwo", False)
    assert await call(session, "memory_view", path=f"{M}/zz.md") == (
        f"The path {M}/zz.md does not exist. Please provide a valid path.", True)
    text, err = await call(session, "memory_view", path="/memories")
    assert not err and text.split("\n")[1:] == [
        "4K\t/memories", "4K\t/memories/default/", f"8B\t{M}/a.md", "4K\t/memories/ro/"]
    assert await call(session, "memory_str_replace", path=f"{M}/a.md", old_str="two", new_str="2") == (
        "The memory file has been edited. Here is the snippet showing the change (with line numbers):\n"
        "     1\tone\n     2\t2\n     3\t", False)
    assert await call(session, "memory_str_replace", path=f"{M}/a.md", old_str="nine", new_str="9") == (
        f"No replacement was performed, old_str `nine` did not appear verbatim in {M}/a.md.", True)
    await call(session, "memory_insert", path=f"{M}/a.md", insert_line=2, insert_text="2")
    assert await call(session, "memory_str_replace", path=f"{M}/a.md", old_str="2", new_str="3") == (
        "No replacement was performed. Multiple occurrences of old_str `2` in lines: 2, 3. Please ensure it is "
        "unique", True)
    assert await call(session, "memory_insert", path=f"{M}/a.md", insert_line=7, insert_text="x") == (
        "Invalid `insert_line` parameter: 7. It should be within the range [0, 3].", True)
    assert await call(session, "memory_insert", path=f"{M}/a.md", insert_line=3, insert_text="four") == (
        f"The file {M}/a.md has been edited.", False)
    assert await call(session, "memory_rename", old_path=f"{M}/a.md", new_path=f"{M}/d/b.md") == (
        f"Successfully renamed {M}/a.md to {M}/d/b.md", False)
    assert await call(session, "memory_rename", old_path=f"{M}/a.md", new_path=f"{M}/c.md") == (
        f"The path {M}/a.md does not exist", True)
    assert await call(session, "memory_search", query="FOUR") == (f"{M}/d/b.md:4: four", False)
    assert (await call(session, "memory_search", query="nowhere"))[0].startswith("No matches")
    text, err = await call(session, "memory_history", path=f"{M}/d/b.md")
    assert not err and [line.split("\t")[2] for line in text.split("\n")[1:]] == [
        "moved", "modified", "modified", "modified", "created"]
    assert all("\ttool:mcp-test\t" in line for line in text.split("\n")[1:])
    assert await call(session, "memory_history", path=f"{M}/nope.md") == (
        f"The path {M}/nope.md does not exist. Please provide a valid path.", True)
    assert await call(session, "memory_remember", fact="likes tea") == (
        f"Remembered in {M}/notes.md: - likes tea", False)
    assert (await call(session, "memory_remember", fact="likes tea"))[0].startswith("Already remembered")
    assert await call(session, "memory_remember", fact="x", store="ro") == (
        "Cannot write /memories/ro/notes.md: store ro is attached read-only (EROFS)", True)
    assert await call(session, "memory_delete", path=f"{M}/d") == (f"Successfully deleted {M}/d", False)
    assert await call(session, "memory_delete", path=f"{M}/d") == (f"The path {M}/d does not exist", True)
    assert await call(session, "memory_delete", path="/memories") == (
        "Cannot delete the /memories directory itself", True)
    assert await call(session, "memory_view", path="/etc") == ("Path must start with /memories, got: /etc", True)
    assert await call(session, "memory_view", path=f"{M}/../../etc") == (
        f"Path {M}/../../etc would escape /memories directory", True)
    assert await call(session, "memory_frob", path=M) == (
        "Unknown tool: memory_frob. Tools: " + ", ".join(t.name for t in TOOLS), True)
    text, err = await call(session, "memory_create", path=f"{M}/x.md")  # file_text missing
    assert err and text == "Parameter `file_text` is required and must be a string"


async def test_read_only_store_refuses_every_writing_tool(session, fake):
    async with fake.client() as admin:  # a file in the read-only store, written by the operator
        r = await admin.post("/v1/stores/ro/records", json={"path": "f.md", "content": "one\n"})
        r.raise_for_status()
    R = "/memories/ro"
    for name, args in [
        ("memory_create", {"path": f"{R}/n.md", "file_text": "x"}),
        ("memory_str_replace", {"path": f"{R}/f.md", "old_str": "one", "new_str": "2"}),
        ("memory_insert", {"path": f"{R}/f.md", "insert_line": 1, "insert_text": "x"}),
        ("memory_delete", {"path": f"{R}/f.md"}),
        ("memory_rename", {"old_path": f"{R}/f.md", "new_path": f"{R}/g.md"}),
        ("memory_remember", {"fact": "x", "store": "ro"}),
    ]:
        text, err = await call(session, name, **args)
        assert err and text.endswith("store ro is attached read-only (EROFS)"), (name, text)
    assert (await call(session, "memory_view", path=f"{R}/f.md"))[1] is False


async def test_path_escapes_refused_by_every_tool(session):
    for bad in ["/etc/passwd", "/memories/../etc", f"{M}/../../x", f"{M}/%2e%2e/x", f"{M}\\..\\x",
                "/memoriesX", f"{M}/a/../b"]:
        for name, args in [
            ("memory_view", {"path": bad}), ("memory_create", {"path": bad, "file_text": "x"}),
            ("memory_str_replace", {"path": bad, "old_str": "a", "new_str": "b"}),
            ("memory_insert", {"path": bad, "insert_line": 0, "insert_text": "x"}),
            ("memory_delete", {"path": bad}), ("memory_rename", {"old_path": bad, "new_path": f"{M}/x"}),
            ("memory_history", {"path": bad}), ("memory_search", {"query": "x", "path": bad}),
        ]:
            text, err = await call(session, name, **args)
            assert err, (name, bad, text)
    assert (await call(session, "memory_view", path=M))[0].split("\n")[1:] == ["4K\t/memories/default"]


async def test_parallel_memory_insert_loses_nothing(session):
    await call(session, "memory_create", path=f"{M}/JOURNAL.jsonl", file_text="")
    out = []

    async def one(i: int) -> None:
        out.append(await call(session, "memory_insert", path=f"{M}/JOURNAL.jsonl", insert_line=0,
                              insert_text=json.dumps({"n": i})))

    async with trio.open_nursery() as n:
        for i in range(50):
            n.start_soon(one, i)
    assert all(not err for _, err in out)
    text, _ = await call(session, "memory_view", path=f"{M}/JOURNAL.jsonl")
    rows = [line.split("\t", 1)[1] for line in text.split("\n")[1:] if line.split("\t", 1)[1]]
    assert sorted(rows) == sorted(json.dumps({"n": i}) for i in range(50))


async def test_index_resources_read_and_subscribe(server):
    """Handshake-era clients (today's desktop apps) subscribe with resources/subscribe."""
    notes: list = []

    async def on_message(message) -> None:
        notes.append(message)

    uri = index_uri("default")
    async with Client(server, mode="legacy", message_handler=on_message) as session:
        listed = (await session.list_resources()).resources
        assert [str(r.uri) for r in listed] == [uri, index_uri("ro")]
        assert (await session.read_resource(uri)).contents[0].text == ""
        with pytest.warns(Warning, match="resources/subscribe"):
            await session.subscribe_resource(uri)
        await call(session, "memory_create", path=f"{M}/MEMORY.md", file_text="- [notes](notes.md)\n")
        with trio.fail_after(30):
            while not any(isinstance(n, types.ResourceUpdatedNotification) and str(n.params.uri) == uri
                          for n in notes):
                await trio.sleep(0.02)
        assert (await session.read_resource(uri)).contents[0].text == "- [notes](notes.md)\n"
        with pytest.raises(Exception, match="Resource not found"):
            await session.read_resource("memfuse:///memories/nope/MEMORY.md")
