"""The memory-tool command engine and its HTTP face (``POST /v1/workspaces/{ws}/memory-tool``).

The differential test runs the same command scripts through the Anthropic SDK's
``BetaLocalFilesystemMemoryTool`` on a local directory and through memfuse, and requires the
same output strings and the same resulting files.
"""
from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest
import trio

from memfuse.client import ApiClient
from memfuse.server import memtool

anthropic_tools = pytest.importorskip("anthropic.lib.tools")
from anthropic.lib.tools import ToolError  # noqa: E402
from anthropic.tools.memory import BetaLocalFilesystemMemoryTool  # noqa: E402

STORE = "default"


@pytest.fixture
async def api(fake):
    token = await fake.setup("ws", stores=(STORE,))
    async with ApiClient(fake.base_url, token, transport=fake.transport, instance="pytest") as client:
        yield client


async def run(api, **command):
    r = await api.memory_tool("ws", command)
    return r.content, r.is_error


def reference(tool: BetaLocalFilesystemMemoryTool, command: dict) -> tuple[str, bool]:
    """The SDK's answer: (text, is_error) as its tool runner would hand it to the model."""
    try:
        return tool.call(command), False
    except ToolError as e:
        return str(e.content), True


async def dump(api, store: str = STORE) -> dict[str, str]:
    page = await api.list_records(store, content=True, limit=1000)
    return {r.path: r.content for r in page.records}


def local_files(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = Path(dirpath) / f
            out[str(p.relative_to(root))] = p.read_bytes().decode("utf-8")
    return out


M = f"/memories/{STORE}"
SCRIPTS = {
    "create_view_edit": [
        {"command": "view", "path": "/memories"},
        {"command": "create", "path": f"{M}/notes.md", "file_text": "# Notes\nalpha\nbeta\n"},
        {"command": "create", "path": f"{M}/notes.md", "file_text": "again"},
        {"command": "view", "path": f"{M}/notes.md"},
        {"command": "view", "path": f"{M}/notes.md", "view_range": [2, 3]},
        {"command": "view", "path": f"{M}/notes.md", "view_range": [2, -1]},
        {"command": "str_replace", "path": f"{M}/notes.md", "old_str": "alpha", "new_str": "ALPHA"},
        {"command": "str_replace", "path": f"{M}/notes.md", "old_str": "gamma", "new_str": "x"},
        {"command": "create", "path": f"{M}/dup.md", "file_text": "x\ny\nx\nz x\n"},
        {"command": "str_replace", "path": f"{M}/dup.md", "old_str": "x", "new_str": "q"},
        {"command": "str_replace", "path": f"{M}/missing.md", "old_str": "x", "new_str": "q"},
        {"command": "view", "path": f"{M}/missing.md"},
        {"command": "view", "path": M},
        {"command": "view", "path": "/memories"},
    ],
    "insert": [
        {"command": "create", "path": f"{M}/j.jsonl", "file_text": '{"a": 1}\n'},
        {"command": "insert", "path": f"{M}/j.jsonl", "insert_line": 1, "insert_text": '{"b": 2}'},
        {"command": "insert", "path": f"{M}/j.jsonl", "insert_line": 0, "insert_text": "top\n"},
        {"command": "insert", "path": f"{M}/j.jsonl", "insert_line": 9, "insert_text": "no"},
        {"command": "insert", "path": f"{M}/j.jsonl", "insert_line": -1, "insert_text": "no"},
        {"command": "create", "path": f"{M}/nonl.txt", "file_text": "one\r\ntwo"},
        {"command": "insert", "path": f"{M}/nonl.txt", "insert_line": 2, "insert_text": "three"},
        {"command": "view", "path": f"{M}/nonl.txt"},
        {"command": "insert", "path": f"{M}/nope.txt", "insert_line": 0, "insert_text": "x"},
        {"command": "insert", "path": M, "insert_line": 0, "insert_text": "x"},
        {"command": "str_replace", "path": M, "old_str": "x", "new_str": "y"},
        {"command": "view", "path": f"{M}/j.jsonl"},
    ],
    "dirs_delete_rename": [
        {"command": "create", "path": f"{M}/a/b/c/deep.md", "file_text": "deep"},
        {"command": "create", "path": f"{M}/a/one.md", "file_text": "1" * 1500},
        {"command": "create", "path": f"{M}/a/.hidden", "file_text": "h"},
        {"command": "create", "path": f"{M}/z.md", "file_text": ""},
        {"command": "create", "path": f"{M}/a", "file_text": "x"},
        {"command": "view", "path": M},
        {"command": "view", "path": f"{M}/a"},
        {"command": "view", "path": "/memories"},
        {"command": "rename", "old_path": f"{M}/a/one.md", "new_path": f"{M}/z.md"},
        {"command": "rename", "old_path": f"{M}/a/one.md", "new_path": f"{M}/moved/one.md"},
        {"command": "rename", "old_path": f"{M}/nothing.md", "new_path": f"{M}/else.md"},
        {"command": "rename", "old_path": f"{M}/a", "new_path": f"{M}/b"},
        {"command": "view", "path": M},
        {"command": "delete", "path": f"{M}/b"},
        {"command": "delete", "path": f"{M}/b"},
        {"command": "delete", "path": f"{M}/z.md"},
        {"command": "delete", "path": "/memories"},
        {"command": "rename", "old_path": "/memories", "new_path": f"{M}/x"},
        {"command": "view", "path": M},
    ],
    "path_checks": [
        {"command": "view", "path": "/etc/passwd"},
        {"command": "view", "path": "memories/default"},
        {"command": "create", "path": "/tmp/x.md", "file_text": "x"},
        {"command": "view", "path": "/memories/../etc"},
        {"command": "view", "path": f"{M}/../../etc/passwd"},
        {"command": "create", "path": f"{M}/../../../x.md", "file_text": "x"},
    ],
}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
async def test_differential_against_the_sdk_local_tool(api, tmp_path, name):
    """Same script, same strings, same files: memfuse vs the SDK's local-filesystem tool."""
    tool = BetaLocalFilesystemMemoryTool(base_path=str(tmp_path))
    (tmp_path / "memories" / STORE).mkdir()
    for command in SCRIPTS[name]:
        want = await trio.to_thread.run_sync(reference, tool, dict(command))
        got = await run(api, **command)
        assert got == want, command
    assert await dump(api) == local_files(tmp_path / "memories" / STORE)


async def test_paths_canonicalised_and_tricks_refused(api):
    await run(api, command="create", path=f"{M}/ok.md", file_text="ok\n")
    text, err = await run(api, command="view", path=f"/memories//{STORE}/./ok.md/")
    assert not err and text.startswith(f"Here's the content of /memories//{STORE}/./ok.md/")
    for bad, why in [
        (f"{M}/a/../ok.md", "'..'"),
        (f"{M}/%2e%2e/%2e%2e/etc", "percent-encoded"),
        (f"{M}/%2E%2E%2Fetc", "percent-encoded"),
        (f"{M}\\..\\..\\etc", "backslash"),
        ("/memoriesX/ok.md", "Path must start with /memories, got: /memoriesX/ok.md"),
        ("/memories/../memories/default/ok.md", "would escape /memories directory"),
        (f"{M}/bad\x00name", "Invalid path"),
        (f"{M}/bad\u202ename", "Invalid path"),
        ("", "is required"),
    ]:
        for command in ({"command": "view", "path": bad},
                        {"command": "create", "path": bad, "file_text": "x"},
                        {"command": "delete", "path": bad},
                        {"command": "rename", "old_path": f"{M}/ok.md", "new_path": bad}):
            text, err = await run(api, **command)
            assert err and why in text, (command, text)
    assert await dump(api) == {"ok.md": "ok\n"}


async def test_refusals_name_the_reason_and_errno(fake, api):
    async with fake.client() as admin:
        r = await admin.patch(f"/v1/stores/{STORE}", json={"max_record_bytes": 100, "max_records": 2})
        r.raise_for_status()
    text, err = await run(api, command="create", path=f"{M}/big.md", file_text="x" * 101)
    assert err and text == f"Cannot write {M}/big.md: record is 101 bytes, the store allows 100 (EFBIG)"
    text, err = await run(api, command="create", path=f"{M}/key.md",
                          file_text="token ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8" + "\n")
    assert err and text.startswith(f"Cannot write {M}/key.md: content holds a secret (GitHub token on line 1)")
    assert text.endswith("(EPERM)")
    text, err = await run(api, command="create", path=f"{M}/t.md", file_text="---\ntype: bogus\n---\n")
    assert err and "the type is not one of" in text and "bogus" not in text and text.endswith("(EINVAL)")
    async with fake.client(fake.token_for("ws")) as http:  # a lone surrogate, as JSON can carry it
        r = await http.post("/v1/workspaces/ws/memory-tool", headers={"Content-Type": "application/json"},
                            content=b'{"command": "create", "path": "%s/sur.md", "file_text": "x\\ud800y"}' % M.encode())
    assert r.json()["is_error"] and r.json()["content"].endswith("(EILSEQ)"), r.json()
    for i in range(2):
        assert not (await run(api, command="create", path=f"{M}/{i}.md", file_text="x"))[1]
    text, err = await run(api, command="create", path=f"{M}/2.md", file_text="x")
    assert err and "holds its limit of 2 records" in text and text.endswith("(ENOSPC)")
    text, err = await run(api, command="insert", path=f"{M}/0.md", insert_line=1, insert_text="y" * 200)
    assert err and text.endswith("(EFBIG)")
    text, err = await run(api, command="create", path="/memories/nostore/x.md", file_text="x")
    assert err and "store nostore is not attached to this workspace (ENOENT)" in text
    text, err = await run(api, command="create", path="/memories/x.md", file_text="x")
    assert err and "holds one directory per store (/memories/default/)" in text


async def test_types_actor_and_versions(fake, api):
    await run(api, command="create", path=f"{M}/u.md", file_text="---\ntype: user\n---\nlikes tea\n")
    await run(api, command="create", path=f"{M}/p.md", file_text="plain\n")
    await run(api, command="str_replace", path=f"{M}/p.md", old_str="plain", new_str="edited")
    page = await api.list_records(STORE)
    by = {r.path: r for r in page.records}
    assert by["u.md"].type == "user" and by["p.md"].type == "project"
    assert by["p.md"].updated_by == "tool:pytest" and by["p.md"].version == 2
    text, err = await run(api, command="history", path=f"{M}/p.md")
    assert not err and "v2\t" in text and "\tmodified\ttool:pytest\t" in text and "\tcreated\t" in text
    text, err = await run(api, command="history", path=f"{M}/p.md", version=1)
    assert not err and text.endswith("     1\tplain\n     2\t")


async def test_rename_keeps_id_refuses_overwrite_and_cross_store(fake, api):
    await fake.setup("ws", stores=("other",))
    await run(api, command="create", path=f"{M}/a.md", file_text="a")
    await run(api, command="create", path=f"{M}/b.md", file_text="b")
    rid = (await api.list_records(STORE, path="a.md")).records[0].id
    assert (await run(api, command="rename", old_path=f"{M}/a.md", new_path=f"{M}/d/c.md")) == (
        f"Successfully renamed {M}/a.md to {M}/d/c.md", False)
    assert (await api.list_records(STORE, path="d/c.md")).records[0].id == rid
    text, err = await run(api, command="rename", old_path=f"{M}/b.md", new_path=f"{M}/d/c.md")
    assert err and text == f"The destination {M}/d/c.md already exists"
    text, err = await run(api, command="rename", old_path=f"{M}/b.md", new_path="/memories/other/b.md")
    assert err and "different stores (EXDEV)" in text
    text, err = await run(api, command="rename", old_path=f"{M}/d", new_path=f"{M}/d/e")
    assert err and "(EINVAL)" in text
    text, err = await run(api, command="rename", old_path=f"{M}/b.md", new_path=f"{M}/d/c.md/x")
    assert err
    text, err = await run(api, command="delete", path=M)
    assert err and "(EACCES)" in text
    assert await dump(api) == {"b.md": "b", "d/c.md": "a"}


async def test_delete_directory_keeps_deleted_versions(api):
    for p in ("d/x.md", "d/e/y.md", "dx.md"):
        await run(api, command="create", path=f"{M}/{p}", file_text=p)
    assert (await run(api, command="delete", path=f"{M}/d")) == (f"Successfully deleted {M}/d", False)
    assert await dump(api) == {"dx.md": "dx.md"}
    gone = (await api.list_records(STORE, include_deleted=True, path="d/e/y.md")).records[0]
    versions = await api.versions(STORE, gone.id)
    assert [v.operation.value for v in versions] == ["created", "deleted"]


async def test_view_is_bounded_with_a_marker_and_paging(api):
    lines = [f"line {i}" for i in range(1, 5001)]
    await run(api, command="create", path=f"{M}/huge.md", file_text="\n".join(lines) + "\n")
    text, err = await run(api, command="view", path=f"{M}/huge.md")
    assert not err
    body = text.split("\n")
    assert body[1] == "     1\tline 1" and body[memtool.VIEW_MAX_LINES] == f"{memtool.VIEW_MAX_LINES:>6}\tline 2000"
    assert body[-1].startswith("[memfuse: output cut after line 2000: lines 2001-5001 of 5001 are not shown")
    assert "view_range [2001, -1]" in body[-1]
    text, _ = await run(api, command="view", path=f"{M}/huge.md", view_range=[4990, -1])
    assert text.split("\n")[-1] == "  5001\t" and "[memfuse" not in text
    await run(api, command="create", path=f"{M}/wide.md", file_text="x" * 300_000 + "\nend\n")
    text, _ = await run(api, command="view", path=f"{M}/wide.md")
    assert len(text) < memtool.VIEW_MAX_BYTES + 1000 and "only its first 100000 bytes are shown" in text
    assert "view_range [2, -1]" in text


async def test_read_only_attachment_refuses_every_writing_command(fake, api):
    await fake.setup("ws", stores=("shared",), access="read_write")
    await run(api, command="create", path="/memories/shared/f.md", file_text="one\n")
    await fake.setup("ws", stores=("shared",), access="read_only")
    R = "/memories/shared"
    for command in (
        {"command": "create", "path": f"{R}/new.md", "file_text": "x"},
        {"command": "str_replace", "path": f"{R}/f.md", "old_str": "one", "new_str": "two"},
        {"command": "insert", "path": f"{R}/f.md", "insert_line": 1, "insert_text": "x"},
        {"command": "delete", "path": f"{R}/f.md"},
        {"command": "delete", "path": R},
        {"command": "rename", "old_path": f"{R}/f.md", "new_path": f"{R}/g.md"},
        {"command": "remember", "fact": "x", "store": "shared"},
    ):
        text, err = await run(api, **command)
        assert err and text.endswith("store shared is attached read-only (EROFS)"), (command, text)
    assert (await run(api, command="view", path=f"{R}/f.md"))[1] is False
    assert await dump(api, "shared") == {"f.md": "one\n"}


async def test_parallel_inserts_lose_nothing(api):
    """50 concurrent inserts into one file, and 50 concurrent remembers: every line exactly
    once (If-Match retries against the database, no lock in the process)."""
    await run(api, command="create", path=f"{M}/JOURNAL.jsonl", file_text="")
    results = []

    async def insert(i: int) -> None:
        results.append(await run(api, command="insert", path=f"{M}/JOURNAL.jsonl", insert_line=0,
                                 insert_text=f'{{"n": {i}}}'))

    async def remember(i: int) -> None:
        results.append(await run(api, command="remember", fact=f"fact {i}"))

    async with trio.open_nursery() as n:
        for i in range(50):
            n.start_soon(insert, i)
            n.start_soon(remember, i)
    assert len(results) == 100 and all(not err for _, err in results), results
    files = await dump(api)
    assert sorted(files["JOURNAL.jsonl"].splitlines()) == sorted(f'{{"n": {i}}}' for i in range(50))
    assert sorted(files["notes.md"].splitlines()) == sorted(f"- fact {i}" for i in range(50))


async def test_insert_at_the_last_line_appends_under_concurrency(fake, api):
    """An insert at the last line stays an append when another write lands first."""
    await run(api, command="create", path=f"{M}/log.md", file_text="a\nb\n")
    fake.faults.precondition_race = 1  # the insert's first If-Match write meets a concurrent edit
    svc_tool = memtool.MemoryTool(fake.service, memtool.Principal(workspace="ws"), "ws", "race")
    rec = svc_tool._record(STORE, "log.md")
    orig_put = svc_tool._put
    raced = []

    def racing_put(t, r, new):
        if not raced:  # another writer appends first
            raced.append(1)
            svc_tool.svc.update_record(memtool.Principal(workspace="ws"), STORE, r.id,
                                       memtool.RecordUpdate(content=(r.content or "") + "c\n"))
        return orig_put(t, r, new)

    svc_tool._put = racing_put
    fake.faults.precondition_race = 0
    r = await trio.to_thread.run_sync(svc_tool.run, {"command": "insert", "path": f"{M}/log.md",
                                                     "insert_line": 2, "insert_text": "d"})
    assert r == memtool.ToolResult(f"The file {M}/log.md has been edited.", False) and raced
    assert (await dump(api))["log.md"] == "a\nb\nc\nd\n"
    assert rec is not None


async def test_remember_dedups_and_refuses_past_the_limit(fake, api):
    assert (await run(api, command="remember", fact="  likes\n tea ")) == (
        f"Remembered in {M}/notes.md: - likes tea", False)
    assert (await run(api, command="remember", fact="likes tea"))[0].startswith("Already remembered")
    async with fake.client() as admin:
        (await admin.patch(f"/v1/stores/{STORE}", json={"max_record_bytes": 40})).raise_for_status()
    text, err = await run(api, command="remember", fact="a much longer fact that does not fit")
    assert err and text.endswith("(EFBIG)")
    assert (await dump(api))["notes.md"] == "- likes tea\n"


async def test_search_is_grep_style_and_bounded(api):
    await run(api, command="create", path=f"{M}/a.md", file_text="Tea\ncoffee\nmore tea\n")
    await run(api, command="create", path=f"{M}/sub/b.md", file_text="green TEA\n")
    text, err = await run(api, command="search", query="tea")
    assert not err and text.split("\n") == [f"{M}/a.md:1: Tea", f"{M}/a.md:3: more tea", f"{M}/sub/b.md:1: green TEA"]
    text, _ = await run(api, command="search", query="tea", case_sensitive=True, path=f"{M}/a.md")
    assert text == f"{M}/a.md:3: more tea"
    text, _ = await run(api, command="search", query="e", max_results=2)
    assert text.split("\n")[2].startswith("[memfuse: 2 more matching line(s) not shown")


async def test_http_face_auth(fake, api):
    await fake.setup("other", stores=("o",))
    async with fake.client(fake.token_for("other")) as http:
        r = await http.post("/v1/workspaces/ws/memory-tool", json={"command": "view", "path": "/memories"})
        assert r.status_code == 403
    async with fake.client("nope") as http:
        r = await http.post("/v1/workspaces/ws/memory-tool", json={"command": "view", "path": "/memories"})
        assert r.status_code == 401
    assert (await run(api, command="frobnicate"))[1] is True


async def test_refusal_log_line_names_path_and_reason_code_never_content(api, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="memfuse.server.memtool")
    assert (await run(api, command="create", path="/memories/default/a.md", file_text="secret-ish body\n"))[1] is False
    text, is_error = await run(api, command="create", path="/memories/default/a.md", file_text="other body\n")
    assert is_error and "already exists" in text
    _, is_error = await run(api, command="str_replace", path="/memories/default/a.md",
                            old_str="not there at all", new_str="x")
    assert is_error
    _, is_error = await run(api, command="rename", old_path="/memories/default/nope.md",
                            new_path="/memories/default/b.md")
    assert is_error
    _, is_error = await run(api, command="create", path="/memories/default/bad\n.md", file_text="y")
    assert is_error
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert lines[:3] == [
        "memory tool create refused in workspace ws path='/memories/default/a.md' code=already_exists",
        "memory tool str_replace refused in workspace ws path='/memories/default/a.md' code=no_match",
        "memory tool rename refused in workspace ws path='/memories/default/nope.md' -> "
        "'/memories/default/b.md' code=not_found",
    ], lines
    assert len(lines) == 4 and "\n" not in lines[3] and "code=" in lines[3], lines
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "secret-ish" not in logged and "other body" not in logged and "not there at all" not in logged
    # a path holding a secret is refused and logged redacted, as the REST API and the mount do
    token = "gh" + "p_" + "aB3dE5fG7hJ9kL1mN3pQ5rS7tU9vW1xY3zA5"
    text, is_error = await run(api, command="create", path=f"/memories/default/{token}.md", file_text="y")
    assert is_error and token not in text
    (line,) = [r.getMessage() for r in caplog.records if "secret_detected" in r.getMessage()]
    assert token not in line and "ghp_[REDACTED].md" in line, line
