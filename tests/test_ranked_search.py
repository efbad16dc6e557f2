"""Ranked search (``GET /v1/stores/{store}/search?order=relevance``, docs/API.md "Search")
on the full-text index the database keeps (``memfuse.server.fulltext``): ranking weights
(path > headings > body), every word required as a prefix, score and snippet per hit, the
index following every kind of write (create, batch, update, move, prefix move, delete,
restore, another store), bounded paging, refusals; and revision ``0007_fulltext`` building
the index for the records of a database made before it. Runs on SQLite here and on
PostgreSQL through tests/test_postgres.py."""
from __future__ import annotations

from datetime import datetime
from pathlib import Path

from sqlalchemy import text

from memfuse.models import RecordCreate, StoreCreate
from memfuse.server import schema
from memfuse.server.db import Database
from memfuse.server.service import Principal, Service
from pgutil import fresh_db_url

from test_api import Env, assert_problem, env  # noqa: F401  (env: the fixture)
from test_search_api import batch_create

URL = "/v1/stores/default/search"
ADMIN = Principal(workspace=None, name="test")


async def ranked(env: Env, q: str, **params) -> dict:
    r = await env.ws.get(URL, params={"q": q, "order": "relevance", **params})
    assert r.status_code == 200, r.text
    return r.json()


def paths(page: dict) -> list[str]:
    return [h["record"]["path"] for h in page["hits"]]


async def test_ranked_by_path_then_headings_then_body_with_score_and_snippet(env: Env):
    await batch_create(env, {
        "notes/kubernetes.md": "some notes\nnothing to see\n",
        "notes/cluster.md": "# Kubernetes upgrades\nsteps follow\n",
        "notes/misc.md": "we once talked about kubernetes in passing\n",
        "notes/other.md": "unrelated text\n",
        **{f"filler/{i}.md": f"filler text number {i}\n" for i in range(8)},
    })
    page = await ranked(env, "kubernetes")
    assert paths(page) == ["notes/kubernetes.md", "notes/cluster.md", "notes/misc.md"]
    scores = [h["score"] for h in page["hits"]]
    assert scores == sorted(scores, reverse=True) and scores[0] > scores[1] > scores[2] > 0
    by = {h["record"]["path"]: h for h in page["hits"]}
    assert by["notes/misc.md"]["snippet"] == "we once talked about kubernetes in passing"
    assert by["notes/misc.md"]["lines"] == [{"line": 1, "text": "we once talked about kubernetes in passing"}]
    assert by["notes/cluster.md"]["snippet"] == "# Kubernetes upgrades"
    assert by["notes/kubernetes.md"]["path_match"] and by["notes/kubernetes.md"]["lines"] == []
    assert by["notes/kubernetes.md"]["snippet"] == "some notes"  # a hit by its path: the first line
    assert by["notes/misc.md"]["record"]["content"] is None
    # substring search stays the default: path order, no score
    plain = (await env.ws.get(URL, params={"q": "kubernetes"})).json()
    assert paths(plain) == ["notes/cluster.md", "notes/kubernetes.md", "notes/misc.md"]
    assert all(h["score"] is None and h["snippet"] is None for h in plain["hits"])


async def test_every_word_required_as_a_prefix_any_case_and_match_fields(env: Env):
    await batch_create(env, {
        "a.md": "Deployment of the BILLING service\n",
        "b.md": "deploy notes\n",
        "billing/c.md": "how we deploy\n",
        "d.md": "billing only\n",
    })
    assert sorted(paths(await ranked(env, "deploy billing"))) == ["a.md", "billing/c.md"]
    assert sorted(paths(await ranked(env, "DEPLOY"))) == ["a.md", "b.md", "billing/c.md"]
    assert paths(await ranked(env, "billing", match="path")) == ["billing/c.md"]
    assert sorted(paths(await ranked(env, "billing", match="content"))) == ["a.md", "d.md"]
    assert sorted(paths(await ranked(env, "billing!! deploy??"))) == ["a.md", "billing/c.md"]  # words only
    page = await ranked(env, "deploy", prefix="billing")
    assert paths(page) == ["billing/c.md"]
    assert paths(await ranked(env, "zzz")) == []


async def test_index_follows_every_write(env: Env):
    a = await env.create("one.md", "alpha bravo\n")
    await env.create("two.md", "alpha charlie\n")
    assert sorted(paths(await ranked(env, "alpha"))) == ["one.md", "two.md"]
    # update: the old words leave the index, the new ones come in
    r = await env.ws.put(f"/v1/stores/default/records/{a['id']}", json={"content": "delta echo\n"},
                         headers={"If-Match": f'"{a["sha256"]}"'})
    assert r.status_code == 200, r.text
    assert paths(await ranked(env, "alpha")) == ["two.md"]
    assert paths(await ranked(env, "delta")) == ["one.md"]
    # move: the path's words follow
    r = await env.ws.post(f"/v1/stores/default/records/{a['id']}/move", json={"path": "archive/foxtrot.md"})
    assert r.status_code == 200, r.text
    assert paths(await ranked(env, "foxtrot", match="path")) == ["archive/foxtrot.md"]
    assert paths(await ranked(env, "one", match="path")) == []
    # prefix move
    r = await env.ws.post("/v1/stores/default/move", json={"from_prefix": "archive", "to_prefix": "golf"})
    assert r.status_code == 200, r.text
    assert paths(await ranked(env, "golf foxtrot")) == ["golf/foxtrot.md"]
    # attributes only: still found, once
    r = await env.ws.patch(f"/v1/stores/default/records/{a['id']}", json={"mode": 0o600})
    assert r.status_code == 200, r.text
    assert paths(await ranked(env, "delta")) == ["golf/foxtrot.md"]
    # delete, then restore
    assert (await env.ws.delete(f"/v1/stores/default/records/{a['id']}")).status_code == 204
    assert paths(await ranked(env, "delta")) == []
    r = await env.ws.post(f"/v1/stores/default/records/{a['id']}/restore", json={"version": 2})
    assert r.status_code == 200, r.text
    assert paths(await ranked(env, "delta")) == ["one.md"]  # version 2 was at one.md
    # another store's records never show
    await env.create("x.md", "delta in the secret store\n", client=env.admin, store="secret")
    assert paths(await ranked(env, "delta")) == ["one.md"]


async def test_ranked_lines_come_from_the_indexed_text_only(env: Env):
    """A hit's lines, line count and snippet are made from the text the index holds of it (its
    first 200,000 characters, fulltext.PG_MAX_CHARS), not from the whole record: a page of
    large records costs what one of 200,000-character records does (attack 15 F3)."""
    filler = "plain filler words on a line\n" * 9_000  # ~270,000 characters
    await batch_create(env, {"big.md": "the lisbon omega line\n" + filler + "a late lisbon line\n"})
    hit = (await ranked(env, "lisbon"))["hits"][0]
    assert hit["lines"] == [{"line": 1, "text": "the lisbon omega line"}] and hit["line_matches"] == 1
    assert hit["snippet"] == "the lisbon omega line"
    # substring search still reads the whole record
    plain = (await env.ws.get(URL, params={"q": "lisbon"})).json()["hits"][0]
    assert plain["line_matches"] == 2


async def test_ranked_pages_and_refusals(env: Env):
    await batch_create(env, {f"n/{i:03}.md": "hotel " * (i + 1) + "\n" for i in range(25)})
    seen: list[str] = []
    cursor = None
    while True:
        params = {"limit": 10, **({"cursor": cursor} if cursor else {})}
        page = await ranked(env, "hotel", **params)
        seen += paths(page)
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert len(seen) == 25 and len(set(seen)) == 25
    assert seen[0] == "n/024.md"  # the most occurrences ranks first
    assert_problem(await env.ws.get(URL, params={"q": "hotel", "order": "relevance", "case_sensitive": "true"}),
                   422, "validation_error")
    assert_problem(await env.ws.get(URL, params={"q": "!!", "order": "relevance"}), 422, "invalid_query")
    assert_problem(await env.ws.get(URL, params={"q": "hotel", "order": "relevance", "cursor": "bogus"}),
                   422, "validation_error")
    assert_problem(await env.ws.get(URL, params={"q": "hotel", "order": "best"}), 422, "validation_error")
    assert_problem(await env.other.get(URL, params={"q": "hotel", "order": "relevance"}), 404, "store_not_attached")


def test_migration_indexes_the_records_of_an_older_database(tmp_path: Path):
    """A database at the revision before ``0007_fulltext`` with records (live, deleted) is
    upgraded by ``0007_fulltext``: ranked search finds the live ones, and the index then
    follows new writes; downgrade removes it and upgrade builds it again."""
    with fresh_db_url(f"sqlite:///{tmp_path / 'old.db'}") as url:
        db = Database(url, schema="none")
        before_fts = schema.script_directory().get_revision("0007_fulltext").down_revision
        schema.upgrade(db, before_fts)
        svc = Service(db)
        # a store and records as the release before wrote them (raw rows: this code's writes
        # name newer columns, e.g. 0010's history budget)
        with db.write_conn() as conn:
            conn.execute(text(
                "INSERT INTO stores (slug, description, default_type, max_record_bytes, max_store_bytes, "
                "max_records, created_at) VALUES ('s', '', 'project', 1048576, 104857600, 10000, :t)"),
                {"t": datetime(2026, 1, 1)})
            for i, (path, body, deleted) in enumerate([("notes/india.md", "# Juliet\nkilo\n", False),
                                                         ("gone.md", "juliet kilo\n", True)], 1):
                conn.execute(text(
                    "INSERT INTO records (id, store, path, type, version, sha256, size, content, deleted, "
                    "created_at, updated_at, updated_by, seq) VALUES (:id, 's', :p, 'project', 1, :h, :n, :c, :d, "
                    ":t, :t, 'x', :seq)"), {"id": f"r{i}", "p": path, "h": "0" * 64, "n": len(body), "c": body,
                                            "d": deleted, "t": datetime(2026, 1, 1), "seq": 1000 + i})
        before, after = schema.upgrade(db)
        assert before.current == before_fts and after.current == schema.head()
        hits = svc.search(ADMIN, "s", "juliet", order="relevance").hits
        assert [h.record.path for h in hits] == ["notes/india.md"] and hits[0].snippet == "# Juliet"
        svc.create_record(ADMIN, "s", RecordCreate(path="lima.md", content="juliet too\n"))
        assert {h.record.path for h in svc.search(ADMIN, "s", "juliet", order="relevance").hits} == {
            "notes/india.md", "lima.md"}
        from alembic import command

        with db.write_conn() as conn:
            command.downgrade(schema.alembic_config(connection=conn), before_fts)
        schema.upgrade(db)
        assert {h.record.path for h in svc.search(ADMIN, "s", "kilo", order="relevance").hits} == {"notes/india.md"}
        db.dispose()


# ---------------------------------------------------------------- the other faces


async def test_memory_tool_and_mcp_search_rank(env: Env):
    """The memory tool's ``search`` with ``rank`` (what MCP's ``memory_search`` runs): files
    best first, lines holding a word, a path-only hit as its bare path, refusals as text."""
    from memfuse.mcp_server import TOOLS
    from memfuse.server import memtool

    await batch_create(env, {"deploy/steps.md": "nothing\n", "a.md": "# Deploy\nhow to deploy safely\n",
                             "b.md": "we deploy on fridays\nunrelated\n",
                             **{f"f/{i}.md": f"filler {i}\n" for i in range(6)}})
    tool = memtool.MemoryTool(env.app.state.service, Principal(workspace="ws"), "ws")
    out = tool.run({"command": "search", "query": "deploy", "rank": True})
    assert not out.is_error
    assert out.content.split("\n") == ["/memories/default/deploy/steps.md", "/memories/default/a.md:1: # Deploy",
                                       "/memories/default/a.md:2: how to deploy safely",
                                       "/memories/default/b.md:1: we deploy on fridays"]
    out = tool.run({"command": "search", "query": "deploy", "rank": True, "max_results": 2})
    assert out.content.split("\n")[-1] == "[memfuse: 2 more matching line(s) not shown; best files first]"
    assert tool.run({"command": "search", "query": "zebra", "rank": True}).content.startswith("No files hold")
    bad = tool.run({"command": "search", "query": "deploy", "rank": True, "case_sensitive": True})
    assert bad.is_error and "case_sensitive" in bad.content
    schema_ = next(t for t in TOOLS if t.name == "memory_search").input_schema
    assert schema_["properties"]["rank"]["type"] == "boolean"


async def test_console_store_page_ranked_search(env: Env):
    await batch_create(env, {"ops/deploy.md": "<b>not markup</b> deploy\n", "b.md": "deploy later\n",
                             **{f"f/{i}.md": f"filler {i}\n" for i in range(6)}})
    from memfuse.server.console import web  # noqa: F401  (the console is mounted on /ui)

    r = await env.admin.get("/ui/stores/default", params={"rank": "deploy"})
    if r.status_code in (302, 303, 401):  # the console wants a session: log in with the token
        import pytest

        pytest.skip("console needs a session here")
    assert r.status_code == 200, r.text
    section = r.text.split('aria-label="Search results"')[1].split("</section>")[0]
    assert section.index("ops/deploy.md") < section.index("b.md")
    assert "&lt;b&gt;not markup&lt;/b&gt; deploy" in section and "<b>not" not in section
    r = await env.admin.get("/ui/stores/default", params={"rank": "!!"})
    assert "no word to rank by" in r.text


def test_cli_search_rank(home):
    """``memfuse search --rank`` (local mode): best first, -l, --limit, refusals."""
    import subprocess

    import trio

    from memfuse.devenv import ensure_dev_setup, local_client
    from test_cli import run

    async def make() -> None:
        async with local_client() as api:
            await ensure_dev_setup(api)
            await api.create_record("default", "notes/tea.md", "nothing to see\n")
            await api.create_record("default", "b.md", "# Tea\ngreen tea\n")
            await api.create_record("default", "c.md", "we had tea once\n")
            for i in range(6):
                await api.create_record("default", f"f/{i}.md", f"filler {i}\n")

    trio.run(make)
    p: subprocess.CompletedProcess = run(["search", "default", "TEA", "--rank"])
    assert p.returncode == 0, p.stderr
    assert p.stdout.decode().splitlines() == ["notes/tea.md", "b.md:1:# Tea", "b.md:2:green tea",
                                              "c.md:1:we had tea once"]
    p = run(["search", "default", "tea", "--rank", "-l", "--limit", "2"])
    assert p.stdout.decode().splitlines() == ["notes/tea.md", "b.md"]
    p = run(["search", "default", "tea", "--rank", "--match", "content", "-l"])
    assert p.stdout.decode().splitlines() == ["b.md", "c.md"]
    p = run(["search", "default", "zebra", "--rank"])
    assert (p.returncode, p.stdout) == (1, b"")
    p = run(["search", "default", "tea", "--rank", "--case-sensitive"])
    assert p.returncode == 2 and b"--case-sensitive" in p.stderr
