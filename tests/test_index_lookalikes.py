"""Names that look like a store's index (docs/SEMANTICS.md, "Names"): ``MEMORY.md `` (a trailing
space or U+00A0), fullwidth ``ＭＥＭＯＲＹ.md``, ``memory.md``, a Cyrillic ``М``, ``MEM0RY.md``,
an invisible Hangul filler... given at a store's root are refused on every face — the rule
(``memfuse.names.looks_like_index``), the REST API (create, move, the store-wide move, a batch),
the memory tool, MCP, Anthropic's memory-store API, the CLI's import, and a real mount (create,
mkdir, rename: ``EINVAL`` with an ``errors.log`` line). The index itself and the same names
below the root stay ordinary.
"""
from __future__ import annotations

import unicodedata

import httpx
import pytest
import trio

from memfuse import names
from memfuse.names import NameError_, check_new_dir_path, check_new_path

# one of each kind; the first is the issue's
LOOKALIKES = [
    "MEMORY.md ",  # trailing space
    "MEMORY.md\u00a0",  # no-break space (NFKC: a space)
    " MEMORY.md",
    "MEMORY.md.",  # Windows drops it
    "\uff2d\uff25\uff2d\uff2f\uff32\uff39.md",  # fullwidth
    "MEMORY\uff0emd",  # fullwidth full stop
    "\U0001d40c\U0001d404\U0001d40c\U0001d40e\U0001d411\U0001d418.md",  # mathematical bold
    "memory.md", "Memory.md", "MEMORY.MD",  # case
    "\u041cEMORY.md",  # Cyrillic capital EM
    "M\u0395M\u039fRY.md",  # Greek EPSILON, OMICRON
    "MEMOR\u04ae.md",  # Cyrillic STRAIGHT U
    "MEMORY.m\u0501",  # Cyrillic KOMI DE
    "MEM0RY.md",  # digit zero
    "rnemory.md",  # rn for m
    "MEMORY.md\u3164",  # HANGUL FILLER: drawn as nothing, not a format character
    "MEMORY.md\ufe0f",  # a variation selector
    "MEMORY\u0660md",  # ARABIC-INDIC DIGIT ZERO for the dot
    "MEMORY.md\u0332",  # COMBINING LOW LINE: an underlined d (attack18 F7)
    "MEMORY.md\u0301",  # a combining acute over the d
    "MEMORY.m\u1e0b",  # LATIN SMALL LETTER D WITH DOT ABOVE (NFC)
    "M\u0305EMORY.md",  # a combining overline
]
ORDINARY = ["MEMORY.md", "notes.md", "MEMORY.md.bak", ".MEMORY.md", "MEMORY.txt", "memory",
            "MEMORIES.md", "MEMORY .md", "MEMORYmd", "memory-notes.md", "history.md", "\u65e5\u672c.md"]


def test_lookalikes_of_the_index_are_refused_at_the_root_only():
    from memfuse.names import looks_like_index

    for name in LOOKALIKES:
        assert looks_like_index(name), ascii(name)
        for path, check in ((name, check_new_path), (f"{name}/x.md", check_new_path), (name, check_new_dir_path)):
            with pytest.raises(NameError_, match="looks like the store's index") as ei:
                check(path)
            assert not ei.value.too_long and ascii(name) in ei.value.reason
        if names._IGNORABLE_RE.search(name) is None:
            assert check_new_path(f"notes/{name}/x.md")  # below the root: an ordinary name
        else:  # ... but for the invisible character it holds (refused in any name given)
            with pytest.raises(NameError_, match="invisible character"):
                check_new_path(f"notes/{name}/x.md")
    for name in ORDINARY:
        assert not looks_like_index(name), name
    assert check_new_path("MEMORY.md") == "MEMORY.md"


def test_every_listed_lookalike_letter_folds_to_its_letter():
    """Each character of the table, put in place of its letter in ``MEMORY.md``, makes a
    look-alike; none of them is a character the category rule already refuses (the table
    would be dead) or ASCII other than the digit 0."""
    from memfuse.names import looks_like_index

    for letter, chars in names._INDEX_LOOKALIKES.items():
        for ch in chars:
            assert unicodedata.category(ch) not in names.FORBIDDEN_CATEGORIES, hex(ord(ch))
            assert not ch.isascii() or ch == "0"
            i = "memory.md".index(letter)
            for base in ("MEMORY.md", "memory.md"):
                name = base[:i] + ch + base[i + 1:]
                assert looks_like_index(name), (letter, hex(ord(ch)))
                names.check_component(name)  # the name passes every other rule


async def _api(fake):
    from memfuse.client import ApiClient

    token = await fake.setup("ws", stores=("default",))
    return token, ApiClient(fake.base_url, token, transport=fake.transport, instance="pytest")


async def test_rest_api_batch_and_memory_tool_refuse_lookalikes(fake):
    from memfuse.client import ApiError

    token, client = await _api(fake)
    async with client as api:
        rec = await api.create_record("default", "notes/a.md", "a\n")
        for name in LOOKALIKES[:6] + ["\u041cEMORY.md", "memory.md"]:
            for path in (name, f"{name}/x.md"):
                with pytest.raises(ApiError) as ei:
                    await api.create_record("default", path, "x")
                assert (ei.value.status, ei.value.code) == (422, "invalid_path"), (ascii(path), ei.value)
                assert "looks like the store's index" in str(ei.value)
            with pytest.raises(ApiError) as ei:
                await api.move_record("default", rec.id, name)
            assert (ei.value.status, ei.value.code) == (422, "invalid_path"), ascii(name)
            with pytest.raises(ApiError) as ei:  # the store-wide move
                await api.move_prefix("default", "notes/", f"{name}/")
            assert (ei.value.status, ei.value.code) == (422, "invalid_path"), ascii(name)
            r = await api.memory_tool("ws", {"command": "create", "path": f"/memories/default/{name}",
                                             "file_text": "x"})
            assert r.is_error and "looks like the store's index" in r.content, (ascii(name), r.content)
            r = await api.memory_tool("ws", {"command": "rename", "old_path": "/memories/default/notes",
                                             "new_path": f"/memories/default/{name}"})
            assert r.is_error, ascii(name)
        async with httpx.AsyncClient(transport=fake.transport, base_url=fake.base_url,
                                     headers={"Authorization": f"Bearer {token}"}) as http:
            b = await http.post("/v1/stores/default/batch", json={"operations": [
                {"op": "create", "body": {"path": "MEMORY.md ", "content": "x"}},
                {"op": "create", "body": {"path": "notes/MEMORY.md ", "content": "y"}}]})
            assert b.status_code == 200, b.text
            codes = [(o["status"], (o["body"] or {}).get("code") if o["status"] >= 400 else None) for o in b.json()["results"]]
            assert codes == [(422, "invalid_path"), (201, None)], b.json()
        await api.create_record("default", "MEMORY.md", "# index\n")  # the index itself
        moved = await api.move_prefix("default", "notes/", "deep/memory.md/")  # not at the root
        page = await api.list_records("default")
        assert sorted(x.path for x in page.records) == ["MEMORY.md", "deep/memory.md/MEMORY.md ",
                                                        "deep/memory.md/a.md"], moved


async def test_mcp_and_memory_store_api_refuse_lookalikes(fake):
    from mcp import Client

    from memfuse.mcp_server import HttpBackend, build_server

    token, client = await _api(fake)
    async with client as api:
        backend = HttpBackend(api, "ws")
        server = build_server(lambda: backend, instructions=await backend.instructions())
        async with Client(server) as mcp:
            r = await mcp.call_tool("memory_create", {"path": "/memories/default/MEMORY.md ", "file_text": "x"})
            assert r.is_error and "looks like the store's index" in r.content[0].text, r.content
            r = await mcp.call_tool("memory_create", {"path": "/memories/default/ok.md", "file_text": "x"})
            assert not r.is_error, r.content
            r = await mcp.call_tool("memory_rename", {"old_path": "/memories/default/ok.md",
                                                      "new_path": "/memories/default/\uff2d\uff25\uff2d\uff2f\uff32\uff39.md"})
            assert r.is_error and "looks like the store's index" in r.content[0].text, r.content
        async with httpx.AsyncClient(transport=fake.transport, base_url=fake.base_url,
                                     headers={"x-api-key": token}) as http:
            base = "/v1/memory_stores/memstore_default/memories"
            for path in ("/MEMORY.md\u00a0", "/memory.md", "/M\u0395M\u039fRY.md"):
                r = await http.post(base, json={"path": path, "content": "x"})
                assert r.status_code == 400 and "looks like the store's index" in r.text, (ascii(path), r.text)
            r = await http.post(base, json={"path": "/notes.md", "content": "x"})
            assert r.status_code == 200, r.text
            r = await http.post(f"{base}/{r.json()['id']}", json={"path": "/MEM0RY.md"})
            assert r.status_code == 400 and "looks like the store's index" in r.text, r.text
            page = (await http.get(base, params={"depth": 5})).json()
            assert sorted(m["path"] for m in page["data"] if m["type"] == "memory") == ["/notes.md", "/ok.md"], page


def test_cli_import_refuses_lookalikes(home, tmp_path):
    from click.testing import CliRunner

    from memfuse.cli import cli
    from memfuse.devenv import local_client

    src = tmp_path / "src"
    (src / "notes").mkdir(parents=True)
    for name in ("MEMORY.md ", "\uff2d\uff25\uff2d\uff2f\uff32\uff39.md", "notes/memory.md", "MEMORY.md"):
        (src / name).write_text("x\n")
    runner = CliRunner()
    assert runner.invoke(cli, ["store", "create", "s"], catch_exceptions=False).exit_code == 0
    r = runner.invoke(cli, ["import", "s", str(src)], catch_exceptions=False)
    assert "(2 created); 0 unchanged, 2 refused" in r.stdout, r.stdout
    assert "looks like the store's index" in r.stdout, r.stdout

    async def paths():
        async with local_client() as api:
            recs, _ = await api.snapshot("s")
            return sorted(x.path for x in recs)

    assert trio.run(paths) == ["MEMORY.md", "notes/memory.md"]


@pytest.mark.mount
def test_lookalikes_are_einval_on_the_mount(tmp_path):
    from mountcheck import errors_log, outcome, wait_drained
    from mountutil import live_records, serve_and_mount

    with serve_and_mount(tmp_path) as (cp, sc):
        d = sc.mountpoint / "default"
        (d / "sub").mkdir()
        (d / "sub" / "f.md").write_bytes(b"f\n")
        got = {"trailing space": outcome(lambda: (d / "MEMORY.md ").write_bytes(b"x\n")),
               "fullwidth dir": outcome(lambda: (d / "\uff2d\uff25\uff2d\uff2f\uff32\uff39.md").mkdir()),
               "case by rename": outcome(lambda: (d / "sub" / "f.md").rename(d / "memory.md")),
               "cyrillic dir by rename": outcome(lambda: (d / "sub").rename(d / "\u041cEMORY.md")),
               "below the root": outcome(lambda: (d / "sub" / "memory.md").write_bytes(b"y\n")),
               "the index": outcome(lambda: (d / "MEMORY.md").write_bytes(b"# index\n"))}
        assert got == {"trailing space": "EINVAL", "fullwidth dir": "EINVAL", "case by rename": "EINVAL",
                       "cyrillic dir by rename": "EINVAL", "below the root": None, "the index": None}, got
        wait_drained(sc.mountpoint)
        assert set(live_records(cp)) == {"MEMORY.md", "sub/f.md", "sub/memory.md"}
        lines = errors_log(sc.mountpoint)
        assert [(e["errno"], e["code"]) for e in lines] == [("EINVAL", "invalid_path")] * 4, lines
        assert all("looks like the store's index" in e["reason"] for e in lines), lines
