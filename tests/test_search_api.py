"""Search in the HTTP API (``GET /v1/stores/{store}/search``, docs/API.md "Search") and the
memory tool's ``search`` / directory ``view`` on top of it (``Service.search`` /
``Service.tree``): matches by the database, bounded pages, problem+json on bad input.
Runs on SQLite here and on PostgreSQL through tests/test_postgres.py."""
from __future__ import annotations

import httpx
import pytest
from sqlalchemy import event

from memfuse.server import memtool, search
from memfuse.server.service import Principal

from test_api import Env, assert_problem, env  # noqa: F401  (env: the fixture)

URL = "/v1/stores/default/search"


async def batch_create(env: Env, files: dict[str, str]) -> None:
    items = list(files.items())
    for i in range(0, len(items), 100):
        ops = [{"op": "create", "idempotency_key": f"k-{path}", "body": {"path": path, "content": text}}
               for path, text in items[i:i + 100]]
        r = await env.ws.post("/v1/stores/default/batch", json={"operations": ops})
        assert r.status_code == 200, r.text
        assert all(x["status"] == 201 for x in r.json()["results"]), r.text


async def find(env: Env, **params) -> dict:
    r = await env.ws.get(URL, params=params)
    assert r.status_code == 200, r.text
    return r.json()


def paths(page: dict) -> list[str]:
    return [h["record"]["path"] for h in page["hits"]]


async def test_search_path_and_content_literal_bounded(env: Env):
    await batch_create(env, {
        "notes/tea.md": "Green TEA\ncoffee\nmore tea\n",
        "notes/été.md": "Été à Paris\n",
        "notes2/x.md": "tea for two\n",
        "journal/tea-log.md": "nothing here\n",
        "pct.md": "100% done_ok\n",
        "long.md": "tea " + "x" * 400 + "\n",
        "typed.md": "---\ntype: user\n---\ntea time\n",
    })
    gone = await env.create("old/tea.md", "tea\n")
    assert (await env.ws.delete(f"/v1/stores/default/records/{gone['id']}")).status_code == 204

    page = await find(env, q="tea")
    assert paths(page) == ["journal/tea-log.md", "long.md", "notes/tea.md", "notes2/x.md", "typed.md"]
    assert page["next_cursor"] is None and page["seq"] > 0
    by = {h["record"]["path"]: h for h in page["hits"]}
    assert by["journal/tea-log.md"]["path_match"] and by["journal/tea-log.md"]["lines"] == []
    assert by["notes/tea.md"]["lines"] == [{"line": 1, "text": "Green TEA"}, {"line": 3, "text": "more tea"}]
    assert by["notes/tea.md"]["line_matches"] == 2 and by["notes/tea.md"]["record"]["content"] is None
    assert by["long.md"]["lines"][0]["text"] == "tea " + "x" * 296 + " …"
    assert by["typed.md"]["lines"] == [{"line": 4, "text": "tea time"}]

    assert paths(await find(env, q="tea", match="path")) == ["journal/tea-log.md", "notes/tea.md"]
    assert paths(await find(env, q="tea", match="content")) == [
        "long.md", "notes/tea.md", "notes2/x.md", "typed.md"]
    cs = await find(env, q="TEA", case_sensitive="true")
    assert paths(cs) == ["notes/tea.md"] and cs["hits"][0]["lines"] == [{"line": 1, "text": "Green TEA"}]
    # Unicode case folding on both databases, accents kept distinct
    assert paths(await find(env, q="ÉTÉ")) == ["notes/été.md"]
    assert paths(await find(env, q="ete")) == []
    # a prefix is a file or a directory (not a sibling that shares its first characters)
    assert paths(await find(env, q="tea", prefix="notes")) == ["notes/tea.md"]
    assert paths(await find(env, q="tea", prefix="notes/tea.md")) == ["notes/tea.md"]
    assert paths(await find(env, q="tea", type="user")) == ["typed.md"]
    # LIKE's characters are plain text
    assert paths(await find(env, q="100%")) == ["pct.md"]
    assert paths(await find(env, q="e_o")) == ["pct.md"]
    assert paths(await find(env, q="%")) == ["pct.md"]
    # max_lines bounds the lines shown, line_matches counts them all
    one = await find(env, q="tea", prefix="notes", max_lines=1)
    assert one["hits"][0]["lines"] == [{"line": 1, "text": "Green TEA"}]
    assert one["hits"][0]["line_matches"] == 2
    assert (await find(env, q="tea", prefix="notes", max_lines=0))["hits"][0]["lines"] == []

    # pages: every hit once, in order, whatever the page size
    got, cursor = [], None
    while True:
        page = await find(env, q="tea", limit=2, **({"cursor": cursor} if cursor else {}))
        assert len(page["hits"]) <= 2
        got += paths(page)
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert got == ["journal/tea-log.md", "long.md", "notes/tea.md", "notes2/x.md", "typed.md"]


async def test_search_bad_input_is_problem_json(env: Env):
    await env.create("a.md", "x\n")
    for params, code in [({}, "validation_error"), ({"q": ""}, "validation_error"),
                         ({"q": "x" * 257}, "validation_error"),
                         ({"q": "a\nb"}, "invalid_query"), ({"q": "a\u200bb"}, "invalid_query"),
                         ({"q": "x", "limit": 0}, "validation_error"),
                         ({"q": "x", "limit": 101}, "validation_error"),
                         ({"q": "x", "max_lines": 101}, "validation_error"),
                         ({"q": "x", "match": "body"}, "validation_error"),
                         ({"q": "x", "cursor": "not-ours"}, "validation_error"),
                         ({"q": "x", "prefix": "a/../b"}, "invalid_path"),
                         ({"q": "x", "type": "diary"}, "invalid_type")]:
        assert_problem(await env.ws.get(URL, params=params), 422, code)
    assert_problem(await env.other.get(URL, params={"q": "x"}), 404, "store_not_attached")
    assert_problem(await env.admin.get("/v1/stores/nope/search", params={"q": "x"}), 404, "store_not_found")
    r = await env.ws.get("/v1/stores/ro/search", params={"q": "x"})  # read-only attachment reads
    assert r.status_code == 200 and r.json()["hits"] == []
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=env.app), base_url="http://test") as anon:
        assert (await anon.get(URL, params={"q": "x"})).status_code == 401


async def test_search_is_in_openapi(env: Env):
    doc = (await env.admin.get("/openapi.json")).json()
    op = doc["paths"]["/v1/stores/{store}/search"]["get"]
    assert {p["name"] for p in op["parameters"]} >= {"q", "match", "prefix", "type", "case_sensitive",
                                                      "cursor", "limit", "max_lines"}
    assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/SearchPage")


def count_statements(engine) -> list[str]:
    seen: list[str] = []

    @event.listens_for(engine, "before_cursor_execute")
    def _count(conn, cursor, statement, params, context, executemany):
        if statement.lstrip().upper().startswith("SELECT"):
            seen.append(statement)

    return seen


async def test_tree_skips_deep_subtrees_and_view_uses_it(env: Env, monkeypatch):
    """A directory view reads about as many rows as it shows: 300 records three levels down
    are one jump, not pages of rows."""
    files = {f"deep/a/b/{i:03}.md": "x\n" for i in range(300)}
    files.update({"top.md": "t\n", "deep/a/one.md": "o\n", "deep/z.md": "z\n", ".hidden/x.md": "h\n",
                  "deep/.dot.md": "d\n", "deep/a/.h/x.md": "h\n"})
    await batch_create(env, files)
    svc = env.app.state.service
    p = Principal(workspace="ws")
    monkeypatch.setattr(search, "TREE_PAGE", 20)
    seen = count_statements(svc.db.engine)
    t = svc.tree(p, "default", "deep", depth=2)
    assert sorted(t.dirs) == ["a", "a/b"] and t.files == {"a/one.md": 2, "z.md": 2} and t.complete
    assert len(seen) <= 6, seen  # store, first rows, the jump past a/b/, the rest
    seen.clear()
    root = svc.tree(p, "default", "", depth=1)
    assert root.dirs == ["deep"] and root.files == {"top.md": 2} and len(seen) <= 6, seen
    cut = svc.tree(p, "default", "deep/a/b", max_entries=10)
    assert len(cut.files) == 10 and not cut.complete

    tool = memtool.MemoryTool(svc, p, "ws")
    out = tool.run({"command": "view", "path": "/memories/default/deep"})
    assert out.content.split("\n")[1:] == [
        "4K\t/memories/default/deep", "4K\t/memories/default/deep/a/",
        "4K\t/memories/default/deep/a/b/", "2B\t/memories/default/deep/a/one.md",
        "2B\t/memories/default/deep/z.md"], out.content
    monkeypatch.setattr(memtool, "LIST_MAX_ENTRIES", 5)
    big = tool.run({"command": "view", "path": "/memories/default/deep/a/b"}).content
    assert big.count("\t") == 6 and big.endswith("view a subdirectory to see them]")
    assert "[memfuse: listing cut after 5 entries" in big
    rt = tool.run({"command": "view", "path": "/memories"}).content
    assert "/memories/default/deep/" in rt and "/memories/default/top.md" in rt and ".hidden" not in rt
    missing = tool.run({"command": "view", "path": "/memories/default/nope"})
    assert missing.is_error and "does not exist" in missing.content


async def test_memory_tool_search_reads_bounded_pages(env: Env, monkeypatch):
    """The tool's search is the API's: the database finds the files, and once the lines to
    show are found it stops reading (what is left out is then a floor: ``N+ more``)."""
    await batch_create(env, {f"n/{i:03}.md": "tea\nTea again\n" for i in range(150)})
    svc = env.app.state.service
    tool = memtool.MemoryTool(svc, Principal(workspace="ws"), "ws")
    calls: list[dict] = []
    real = svc.search

    def spy(*a, **kw):
        calls.append(kw)
        return real(*a, **kw)

    monkeypatch.setattr(svc, "search", spy)
    out = tool.run({"command": "search", "query": "TEA", "max_results": 3}).content.split("\n")
    assert out[:3] == ["/memories/default/n/000.md:1: tea", "/memories/default/n/000.md:2: Tea again",
                       "/memories/default/n/001.md:1: tea"]
    assert out[3].startswith("[memfuse: 37+ more matching line(s) not shown"), out[3]
    assert len(calls) == 1 and calls[0]["limit"] == 20 and calls[0]["match"] == "content"
    exact = tool.run({"command": "search", "query": "again", "path": "/memories/default/n/149.md"})
    assert exact.content == "/memories/default/n/149.md:2: Tea again"
    bad = tool.run({"command": "search", "query": "a\nb"})
    assert bad.is_error and "one line" in bad.content
    none = tool.run({"command": "search", "query": "coffee"})
    assert none.content == "No matches for 'coffee' in /memories"


async def test_search_prefix_leaves_out_siblings_that_sort_inside_its_range(env: Env):
    """``prefix`` is read as the byte range [prefix, prefix + "0"); names that sort inside it
    without being the file or under the directory (``d-x``, ``d.md``: ``-`` and ``.`` sort
    before ``/``) are not hits."""
    await batch_create(env, {p: "needle\n" for p in ("c.md", "d/x.md", "d/y/z.md", "d-x/y.md", "d.md", "d0.md",
                                                     "e.md")})
    assert paths(await find(env, q="needle", prefix="d")) == ["d/x.md", "d/y/z.md"]
    assert paths(await find(env, q="needle", prefix="d.md")) == ["d.md"]
    assert paths(await find(env, q="needle", prefix="d-x")) == ["d-x/y.md"]
    assert paths(await find(env, q="needle", prefix="d/y")) == ["d/y/z.md"]
    got, cursor = [], None
    while True:  # the cursor pages through the range in byte order
        page = await find(env, q="needle", limit=1, **({"cursor": cursor} if cursor else {}))
        got += paths(page)
        if not (cursor := page["next_cursor"]):
            break
    assert got == ["c.md", "d-x/y.md", "d.md", "d/x.md", "d/y/z.md", "d0.md", "e.md"]


@pytest.mark.parametrize("q", ["<script>alert(1)</script>"])
async def test_search_returns_content_as_data(env: Env, q: str):
    await env.create("x.md", f"{q}\n")
    page = await find(env, q="<script>")
    assert page["hits"][0]["lines"] == [{"line": 1, "text": q}]  # JSON text, for the caller to escape


async def test_client_search_decodes_pages(env: Env):
    """``ApiClient.search`` (the msgspec side) follows the pages of the same endpoint and
    raises the problem's code for bad input."""
    from memfuse.client import ApiClient
    from memfuse.errors import ApiError

    await batch_create(env, {f"d/{i}.md": f"needle {i}\nhay\n" for i in range(5)})
    async with ApiClient("http://test", "test-ws-token", transport=httpx.ASGITransport(app=env.app)) as api:
        got, cursor = [], None
        while True:
            page = await api.search("default", "NEEDLE", match="content", prefix="d", limit=2, cursor=cursor)
            got += [(h.record.path, [(ln.line, ln.text) for ln in h.lines], h.line_matches) for h in page.hits]
            cursor = page.next_cursor
            if cursor is None:
                break
        assert got == [(f"d/{i}.md", [(1, f"needle {i}")], 1) for i in range(5)]
        with pytest.raises(ApiError) as bad:
            await api.search("default", "two\nlines")
        assert bad.value.code == "invalid_query"


def brute_tree(paths: dict[str, int], prefix: str, depth: int) -> tuple[set[str], dict[str, int]]:
    """What ``Service.tree`` must give, from every live path: directories and files up to
    ``depth`` levels under ``prefix``, nothing under a name starting with ``.``."""
    lead = prefix + "/" if prefix else ""
    dirs, files = set(), {}
    for path, size in paths.items():
        if not path.startswith(lead):
            continue
        parts = path[len(lead):].split("/")
        if any(c.startswith(".") for c in parts[:depth]):
            continue
        for i in range(1, min(len(parts), depth + 1)):
            dirs.add("/".join(parts[:i]))
        if len(parts) <= depth:
            files[path[len(lead):]] = size
    return dirs, files


async def test_tree_matches_a_full_scan_whatever_the_page_sizes(env: Env, monkeypatch):
    """``Service.tree`` against a brute-force listing of every record, on a store with
    subtrees of every size, hidden names at each level and files of varied sizes, for page
    sizes from 1 row up (every jump and page boundary lands somewhere else)."""
    import random
    rnd = random.Random(7)
    names = ["a", "b", "b0", "b.md", ".h", "c-d", "z", "é", "日本"]
    files: dict[str, str] = {}
    while len(files) < 250:
        depth = rnd.choice([1, 2, 2, 3, 3, 4])
        parts = [rnd.choice(names) for _ in range(depth - 1)] + [f"f{rnd.randrange(40)}.md"]
        path = "/".join(parts)
        if any(p.startswith(path + "/") or path.startswith(p + "/") for p in files):
            continue  # a file cannot also be a directory
        files[path] = "x" * rnd.randrange(1, 300)
    await batch_create(env, files)
    sizes = {p: len(c.encode()) for p, c in files.items()}
    svc = env.app.state.service
    p = Principal(workspace="ws")
    prefixes = ["", "a", "b", "b/a", "é", "nope"]
    for page, first in [(1, 1), (2, 1), (3, 2), (7, 16), (20, 16), (200, 16)]:
        monkeypatch.setattr(search, "TREE_PAGE", page)
        monkeypatch.setattr(search, "TREE_MIN_PAGE", first)
        for prefix in prefixes:
            for depth in (1, 2, 3):
                t = svc.tree(p, "default", prefix, depth=depth, max_entries=10_000)
                want_dirs, want_files = brute_tree(sizes, prefix, depth)
                assert (set(t.dirs), t.files, t.complete) == (want_dirs, want_files, True), (page, prefix, depth)
                assert len(t.dirs) == len(set(t.dirs))


async def test_search_matches_a_full_scan(env: Env):
    """Paged search against a brute-force scan of every record (``str.lower`` on both sides
    unless case-sensitive), for queries with ASCII, accented, caseless and LIKE characters,
    on path, content or either, with page sizes that cut between every hit."""
    import random
    rnd = random.Random(11)
    words = ["Tea", "tEA", "été", "ÉTÉ", "日本", "100%", "a_b", "x\\y", "Straße", "plain"]
    files = {}
    for i in range(60):
        lines = [" ".join(rnd.choice(words) for _ in range(rnd.randrange(1, 4))) for _ in range(rnd.randrange(1, 5))]
        files[f"{rnd.choice(['d', 'D', 'tea', 'été'])}/{i:02d}-{rnd.choice(words).replace('%', 'p')}.md"] = (
            "\n".join(lines) + "\n")
    await batch_create(env, files)

    def want(q: str, match: str, case_sensitive: bool) -> list[tuple[str, bool, list[int]]]:
        fold = (lambda s: s) if case_sensitive else str.lower
        out = []
        for path in sorted(files, key=lambda s: s.encode()):
            pm = match != "content" and fold(q) in fold(path)
            lines = [i for i, ln in enumerate(files[path].split("\n"), 1)
                     if match != "path" and fold(q) in fold(ln)]
            if pm or lines:
                out.append((path, pm, lines))
        return out

    for q in ["tea", "TEA", "été", "ÉTÉ", "日本", "%", "a_b", "x\\y", "straße", "STRASSE", "ß", "-t"]:
        for match in ("any", "path", "content"):
            for cs in (False, True):
                got, cursor = [], None
                while True:
                    params = {"q": q, "match": match, "case_sensitive": str(cs).lower(), "limit": 3,
                              "max_lines": 100}
                    if cursor:
                        params["cursor"] = cursor
                    page = await find(env, **params)
                    got += [(h["record"]["path"], h["path_match"], [ln["line"] for ln in h["lines"]])
                            for h in page["hits"]]
                    cursor = page["next_cursor"]
                    if cursor is None:
                        break
                assert got == want(q, match, cs), (q, match, cs)


async def test_memory_tool_search_marker_when_the_bound_is_met_exactly(env: Env):
    """The lines shown fill ``max_results`` exactly at a page's end while later files were
    not read: the marker says more may match, without a count of 0."""
    await batch_create(env, {f"m/{i:03}.md": "needle\n" for i in range(30)})
    tool = memtool.MemoryTool(env.app.state.service, Principal(workspace="ws"), "ws")
    out = tool.run({"command": "search", "query": "needle", "max_results": 20}).content.split("\n")
    assert len(out) == 21 and out[19] == "/memories/default/m/019.md:1: needle"
    assert out[20] == ("[memfuse: the search stopped after 20 lines; other files may match too; narrow "
                       "the search with `path` or a longer query]")
    exact = tool.run({"command": "search", "query": "needle", "max_results": 30}).content.split("\n")
    assert len(exact) == 30  # all of them, no marker


def test_like_superset_never_loses_a_match():
    """For every code point ``x`` (and ``x`` between other text), the pattern of each piece of
    ``fold(x)`` matches ``x`` under SQLite's ``LIKE`` (ASCII-only case folding): the
    database's filter is a superset of what ``holds`` accepts (``Resource._contains``)."""
    import sqlite3
    import sys

    from memfuse.server.base import fold, holds, like_superset

    cases: list[tuple[str, str]] = []
    for c in range(sys.maxunicode + 1):
        if 0xD800 <= c <= 0xDFFF:
            continue
        x = chr(c)
        low = fold(x)
        if low == x and x.upper() == x:
            continue  # caseless: the pattern is the character itself
        text = f"a{x}Z"
        for needle in {low, *low, fold(text)}:
            assert holds(text, needle)
            cases.append((text, "%" + like_superset(needle) + "%"))
    assert len(cases) > 2500
    con = sqlite3.connect(":memory:")
    con.execute("CREATE TABLE t (txt TEXT, pat TEXT)")
    con.executemany("INSERT INTO t VALUES (?, ?)", cases)
    missed = con.execute("SELECT txt, pat FROM t WHERE NOT (txt LIKE pat ESCAPE '\\')").fetchall()
    assert missed == []
    # and literal characters stay literal
    assert like_superset("100%_x\\y") == "100\\%\\_x\\\\y"
    assert like_superset("tee") == "tee" and like_superset("kind") == "__nd"
    assert like_superset("日本ä") == "日本_"


async def test_search_unicode_case_beyond_ascii(env: Env):
    """``ÄPFEL`` finds ``äpfel``, ``k`` finds U+212A KELVIN SIGN, ``i̇`` finds U+0130: the same
    hits on SQLite and PostgreSQL (tests/test_postgres.py)."""
    await batch_create(env, {"a.md": "Ich mag Äpfel\n", "b.md": "grüne äpfel\nKELVIN \u212a\n",
                             "c.md": "İstanbul\n", "d.md": "plain\n"})
    assert paths(await find(env, q="ÄPFEL")) == ["a.md", "b.md"]
    page = await find(env, q="kelvin k")
    assert paths(page) == ["b.md"] and page["hits"][0]["lines"] == [{"line": 2, "text": "KELVIN \u212a"}]
    assert paths(await find(env, q="i̇stanbul")) == ["c.md"]
    assert paths(await find(env, q="ÄPFEL", case_sensitive="true")) == []
