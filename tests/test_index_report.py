"""The index report (``GET /v1/stores/{store}/index``, docs/API.md "Index report"): links of
``MEMORY.md`` to records that do not exist, records it does not mention, entries the prompt
block cuts; the prompt block naming the entries it cuts; ``memfuse index STORE`` and the
console's store page. Runs on SQLite here and on PostgreSQL through tests/test_postgres.py."""
from __future__ import annotations

import json

from memfuse.server.indexlinks import entries, omitted_marker

from test_api import Env, assert_problem, env  # noqa: F401  (env: the fixture)
from test_search_api import batch_create

INDEX = """# Memory index

- [Deploy](notes/deploy.md) — how we ship
- [Gone](notes/gone.md) — deleted long ago
- [Team](team/) — people
- [Web](https://example.com/x.md) and [anchor](#top) are not entries
- [Escape](../outside.md)
- [Spaced](<notes/with space.md> "title") and [Encoded](notes/with%20space.md#part)
Also see `misc/plain.md` written as a path.
"""


def test_entries_parse_local_links_only():
    got = [(e.line, e.target, e.dir) for e in entries(INDEX)]
    assert got == [(3, "notes/deploy.md", False), (4, "notes/gone.md", False), (5, "team", True),
                   (7, None, False), (8, "notes/with space.md", False), (8, "notes/with space.md", False)]


async def test_index_report_missing_unindexed_omitted(env: Env):
    await batch_create(env, {
        "MEMORY.md": INDEX, "notes/deploy.md": "x\n", "team/alice.md": "x\n", "team/sub/bob.md": "x\n",
        "notes/with space.md": "x\n", "misc/plain.md": "x\n", "notes/orphan.md": "x\n", "z.md": "x\n",
    })
    r = await env.ws.get("/v1/stores/default/index")
    assert r.status_code == 200, r.text
    rep = r.json()
    assert rep["store"] == "default" and rep["index_exists"] and rep["entries"] == 6
    assert [(e["line"], e["target"]) for e in rep["missing"]] == [(4, "notes/gone.md"), (7, "../outside.md")]
    assert rep["missing"][0]["text"] == "- [Gone](notes/gone.md) — deleted long ago"
    assert rep["unindexed"] == ["notes/orphan.md", "z.md"] and rep["unindexed_count"] == 2
    assert rep["omitted"] == [] and rep["lines"] == rep["lines_shown"] == 9
    assert rep["bytes"] == rep["bytes_shown"] == len(INDEX.encode())


async def test_a_long_index_reports_and_names_what_the_prompt_block_cuts(env: Env):
    lines = ["# Index"] + [f"- [Note {i}](n/{i:03}.md) — hook {i}" for i in range(250)]
    text = "\n".join(lines) + "\n"
    await batch_create(env, {"MEMORY.md": text, **{f"n/{i:03}.md": "x\n" for i in range(250)}})
    rep = (await env.ws.get("/v1/stores/default/index")).json()
    assert rep["lines"] == 251 and rep["lines_shown"] == 200
    assert [e["target"] for e in rep["omitted"]] == [f"n/{i:03}.md" for i in range(199, 250)]
    assert rep["missing"] == [] and rep["unindexed"] == []
    # the prompt block names the entries it cuts (the first 20, then how many more)
    block = (await env.ws.get("/v1/workspaces/ws/context")).text
    names = ", ".join(f"`n/{i:03}.md`" for i in range(199, 219))
    assert f"The entries cut are: {names} and 31 more." in block
    assert "[memfuse: MEMORY.md is cut here: 51 more line(s)" in block


def test_omitted_marker_bounds_and_cleans_names():
    text = "\n".join(f"- [x](a/{'y' * 200}{i}.md)" for i in range(30)) + "\n- [z](b]`c.md)\n"
    marker = omitted_marker(text, 31)
    assert marker.startswith(" The entries cut are: `a/") and marker.endswith(" more.")
    assert len(marker.encode()) < 1300
    assert omitted_marker("- [z](b`c.md)\n", 1) == " The entries cut are: `bc.md`."
    assert omitted_marker("no links\n", 1) == ""


async def test_index_report_without_memory_md_and_refusals(env: Env):
    await batch_create(env, {"a.md": "x\n"})
    rep = (await env.ws.get("/v1/stores/default/index")).json()
    assert rep["index_exists"] is False and rep["unindexed"] == ["a.md"] and rep["entries"] == 0
    assert_problem(await env.other.get("/v1/stores/default/index"), 404, "store_not_attached")
    assert_problem(await env.admin.get("/v1/stores/nope/index"), 404, "store_not_found")


async def test_console_store_page_shows_the_report(env: Env):
    await batch_create(env, {"MEMORY.md": "- [Gone](<b>gone</b>.md)\n", "orphan.md": "x\n"})
    r = await env.admin.get("/ui/stores/default")
    assert r.status_code == 200, r.text
    section = r.text.split('id="index-report"')[1].split("</details>")[0]
    assert "1 missing · 1 unindexed · 0 omitted" in section
    assert "&lt;b&gt;gone&lt;/b&gt;.md" in section and "<b>gone" not in section
    assert "<code>orphan.md</code>" in section


def test_cli_index(home):
    import trio

    from memfuse.devenv import ensure_dev_setup, local_client
    from test_cli import run

    async def make() -> None:
        async with local_client() as api:
            await ensure_dev_setup(api)
            await api.create_record("default", "MEMORY.md", "- [A](a.md)\n- [B](b.md)\n")
            await api.create_record("default", "a.md", "x\n")
            await api.create_record("default", "c.md", "x\n")

    trio.run(make)
    p = run(["index", "default"])
    assert p.returncode == 0, p.stderr
    assert p.stdout.decode().splitlines() == [
        "MEMORY.md: 2 entries; 2 lines (24 bytes), 2 lines (24 bytes) shown in the prompt block",
        "missing (1): links to records that do not exist", "  MEMORY.md:2: b.md",
        "unindexed (1): records MEMORY.md does not mention", "  c.md",
        "omitted (0): entries the prompt block cuts",
        "stale (0): records unchanged for 90 days or past their review date"]
    p = run(["index", "default", "--json"])
    rep = json.loads(p.stdout)
    assert rep["missing"][0]["target"] == "b.md" and rep["unindexed"] == ["c.md"]
    p = run(["index", "nope"])
    assert p.returncode == 1 and b"no store" in p.stderr


# ---------------------------------------------------------------- bounded work (attack 13 F10)
#: the tester's index: 60,000 distinct links, one a line (575 KB)
HUGE_INDEX = "".join(f"[]({i})\n" for i in range(60000))


async def test_a_huge_index_costs_the_prompt_block_only_what_it_shows(env: Env, monkeypatch):
    """The block parses the lines it shows and a bounded part of the cut (not the 60,000
    links), asks about staleness for the shown entries only, and a repeat ask for the same
    index parses nothing (counted: links read, SQL parameters of the stale lookup)."""
    from memfuse.server import indexlinks, staleness

    await env.create("MEMORY.md", HUGE_INDEX)
    parsed = [0]
    looked_up: list[int] = []
    target, stale_targets = indexlinks._target, staleness.stale_targets

    def counting_target(raw: str):
        parsed[0] += 1
        return target(raw)

    def counting_stale(conn, store, targets, now, days):
        looked_up.append(len(targets))
        return stale_targets(conn, store, targets, now, days)

    monkeypatch.setattr(indexlinks, "_target", counting_target)
    monkeypatch.setattr(staleness, "stale_targets", counting_stale)
    r = await env.ws.get("/v1/workspaces/ws/context")
    assert r.status_code == 200, r.text
    first = r.text
    assert looked_up == [200]  # the 200 lines shown, one link each
    assert 0 < parsed[0] <= 200 + indexlinks.OMITTED_SCAN_CHARS // len("[](200)\n")  # not 120,000
    assert "[memfuse: MEMORY.md is cut here: 59800 more line(s)" in first
    assert "The entries cut are: `200`, `201`," in first and " and at least " in first
    parsed[0] = 0
    again = (await env.ws.get("/v1/workspaces/ws/context")).text
    assert again == first and parsed[0] == 0 and looked_up == [200, 200]


async def test_the_prompt_block_follows_a_changed_index(env: Env):
    """The views cached by content hash never show an index that changed."""
    rec = await env.create("MEMORY.md", "- [A](a.md)\n")
    assert "- [A](a.md)" in (await env.ws.get("/v1/workspaces/ws/context")).text
    r = await env.ws.put(f"/v1/stores/default/records/{rec['id']}", json={"content": "- [B](b.md)\n"})
    assert r.status_code == 200, r.text
    block = (await env.ws.get("/v1/workspaces/ws/context")).text
    assert "- [B](b.md)" in block and "- [A](a.md)" not in block


def test_the_cut_marker_reads_a_bounded_part_of_the_cut():
    from memfuse.server.indexlinks import OMITTED_SCAN_CHARS

    line = "- [x](a.md)\n"
    n = OMITTED_SCAN_CHARS // len(line)  # the lines the marker reads
    assert omitted_marker(line * (n + 10), n + 10).endswith(f"`a.md` and at least {n - 20} more.")
    assert omitted_marker(line * n, n).endswith(f"`a.md` and {n - 20} more.")
    assert omitted_marker("x\n" * OMITTED_SCAN_CHARS + line, OMITTED_SCAN_CHARS + 1) == ""


async def test_the_index_report_caps_its_lists_and_its_scan(env: Env, monkeypatch):
    from memfuse.server import indexreport

    text = "- [gone](gone.md)\n" * 5000
    await env.create("MEMORY.md", text)
    rep = (await env.ws.get("/v1/stores/default/index")).json()
    assert rep["entries"] == 5000 and rep["missing_count"] == 5000 and len(rep["missing"]) == 1000
    assert rep["omitted_count"] == 4800 and len(rep["omitted"]) == 1000
    assert [e["line"] for e in rep["omitted"][:2]] == [201, 202]
    assert rep["bytes_scanned"] == rep["bytes"] == len(text)
    # past REPORT_SCAN_CHARS (whole lines) the index is not read, and the answer says so
    monkeypatch.setattr(indexreport, "REPORT_SCAN_CHARS", 100 * 18 + 5)
    rep = (await env.ws.get("/v1/stores/default/index")).json()
    assert rep["entries"] == rep["missing_count"] == 100 and rep["bytes_scanned"] == 100 * 18
    assert rep["omitted_count"] == 0 and rep["bytes"] == len(text) and rep["lines"] == 5000
    page = (await env.admin.get("/ui/stores/default")).text
    assert "100 missing" in page and "only its first" in page
