"""A record's version list in pages (attack 13 F14): ``GET .../records/{id}/versions`` with
``limit``, ``order`` and ``cursor`` and a ``Link: <…>; rel="next"`` header, bounded in versions
and in bytes; the Python client, the memory tool's history and the console's record page on a
record with thousands of versions (made cheaply: 100 updates per batch request, as a hostile
client would). Runs on PostgreSQL too (tests/test_postgres.py).
"""
from __future__ import annotations

import re

import httpx
import pytest

from memfuse.client import ApiClient
from memfuse.defs import INT64_MAX, VERSIONS_PAGE_BYTES, VERSIONS_PAGE_MAX
from memfuse.server.app import create_app
from pgutil import fresh_db_url

ADMIN = "vp-admin-token"
WS = "vp-ws-token"
BASE = "http://test"
R = "/v1/stores/ws/records"
V = 2100  # versions of the record: more than two pages of the most a page holds


def _client(app, token: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE,
                             headers={"Authorization": f"Bearer {token}"})


@pytest.fixture
async def env():
    """(app, admin client, record id of ``v.md`` with ``V`` versions, id of a record at a
    1,000-byte path with 1,000 versions)."""
    with fresh_db_url() as url:
        app = create_app(url, static_tokens={ADMIN: None, WS: "ws"})
        async with _client(app, ADMIN) as c:
            assert (await c.post("/v1/workspaces", json={"name": "ws"})).status_code == 201
            rid = await _many_versions(c, "v.md", V)
            long_rid = await _many_versions(c, "/".join(["d" * 99] * 10)[:1000] + ".md", 1000)
            yield app, c, rid, long_rid
        app.state.service.db.engine.dispose()


async def _many_versions(c: httpx.AsyncClient, path: str, n: int) -> str:
    r = await c.post(R, json={"path": path, "content": "1\n"})
    assert r.status_code == 201, r.text
    rid = r.json()["id"]
    done = 1
    while done < n:  # 100 updates per request: how cheap thousands of versions are
        ops = [{"op": "update", "record_id": rid, "body": {"content": f"{done + i + 1}\n"}}
               for i in range(min(100, n - done))]
        r = await c.post("/v1/stores/ws/batch", json={"operations": ops})
        assert r.status_code == 200, r.text
        done += len(ops)
    return rid


def _next(r: httpx.Response) -> str | None:
    """The query of the answer's ``Link: <?…>; rel="next"``, or None."""
    link = r.links.get("next", {}).get("url")
    return None if link is None else str(r.url.join(link))


async def _follow(c: httpx.AsyncClient, url: str) -> tuple[list[dict], list[int], list[int]]:
    """Every version from ``url`` following the links: (versions, page lengths, body sizes)."""
    out, lengths, sizes = [], [], []
    for _ in range(100):
        r = await c.get(url)
        assert r.status_code == 200, r.text
        page = r.json()
        assert isinstance(page, list) and all(v["content"] is None for v in page)
        out += page
        lengths.append(len(page))
        sizes.append(len(r.content))
        url = _next(r)
        if url is None:
            return out, lengths, sizes
    raise AssertionError("the links never ended")


async def test_version_list_is_paged_by_count_with_a_next_link(env):
    app, c, rid, _ = env
    # no parameters (every client before pages): the oldest page, and where the next starts
    r = await c.get(f"{R}/{rid}/versions")
    assert r.status_code == 200
    page = r.json()
    assert [v["version"] for v in page] == list(range(1, VERSIONS_PAGE_MAX + 1))
    assert r.headers["link"] == f'<?cursor={VERSIONS_PAGE_MAX}>; rel="next"'
    versions, lengths, _ = await _follow(c, f"{BASE}{R}/{rid}/versions")
    assert [v["version"] for v in versions] == list(range(1, V + 1)) and lengths == [1000, 1000, V - 2000]
    # newest first, a small limit: the link keeps the other parameters
    r = await c.get(f"{R}/{rid}/versions", params={"order": "desc", "limit": 7})
    assert [v["version"] for v in r.json()] == list(range(V, V - 7, -1))
    assert r.headers["link"] == f'<?order=desc&limit=7&cursor={V - 6}>; rel="next"'
    versions, lengths, _ = await _follow(c, f"{BASE}{R}/{rid}/versions?order=desc&limit=700")
    assert [v["version"] for v in versions] == list(range(V, 0, -1)) and lengths == [700, 700, 700]
    # at either end: an empty page or the last one, without a link
    # cursors past PostgreSQL's 32-bit version columns too (the database must not compare them)
    for params, want in (({"cursor": V}, []), ({"cursor": INT64_MAX}, []), ({"order": "desc", "cursor": 1}, []),
                         ({"cursor": 2**31 - 1}, []), ({"cursor": 2**31}, []), ({"cursor": 2**32 + 1}, []),
                         ({"order": "desc", "cursor": 2**31, "limit": 2}, [V, V - 1]),
                         ({"order": "desc", "cursor": 2**31 - 1, "limit": 2}, [V, V - 1]),
                         ({"order": "desc", "cursor": 3}, [2, 1]), ({"cursor": V - 2}, [V - 1, V]),
                         ({"order": "desc", "cursor": INT64_MAX, "limit": 2}, [V, V - 1])):
        r = await c.get(f"{R}/{rid}/versions", params=params)
        assert r.status_code == 200 and [v["version"] for v in r.json()] == want, params
        assert ("link" in r.headers) == (params.get("limit") == 2), params


async def test_version_pages_are_bounded_in_bytes(env):
    app, c, _, long_rid = env
    versions, lengths, sizes = await _follow(c, f"{BASE}{R}/{long_rid}/versions")
    assert [v["version"] for v in versions] == list(range(1, 1001))
    assert len(lengths) == 2 and lengths[0] < 1000  # a full page of 1,000 would pass the bound
    assert max(sizes) <= VERSIONS_PAGE_BYTES + 1 and sizes[0] > VERSIONS_PAGE_BYTES * 0.95


async def test_bad_paging_parameters_are_problems(env):
    """A cursor past 64 bits, negative or not a number, a limit out of bounds, an unknown
    order: 422 ``validation_error`` (problem+json), as every other bound of the API."""
    app, c, rid, _ = env
    for params in ({"cursor": str(INT64_MAX + 1)}, {"cursor": str(2**70)}, {"cursor": str(2**64)},
                   {"cursor": "-1"}, {"cursor": "abc"}, {"cursor": "1e3"}, {"cursor": ""}, {"limit": "0"},
                   {"limit": str(VERSIONS_PAGE_MAX + 1)}, {"limit": str(2**70)}, {"order": "sideways"},
                   {"order": ""}):
        r = await c.get(f"{R}/{rid}/versions", params=params)
        assert r.status_code == 422, (params, r.text)
        assert r.headers["content-type"] == "application/problem+json"
        assert r.json()["code"] == "validation_error"


async def test_client_follows_the_pages(env):
    app, c, rid, _ = env
    async with ApiClient(BASE, ADMIN, transport=httpx.ASGITransport(app=app)) as api:
        assert [v.version for v in await api.versions("ws", rid)] == list(range(1, V + 1))
        page, cursor = await api.versions_page("ws", rid, limit=5, newest_first=True)
        assert [v.version for v in page] == list(range(V, V - 5, -1)) and cursor == V - 4
        page, cursor = await api.versions_page("ws", rid, cursor=3, newest_first=True)
        assert [v.version for v in page] == [2, 1] and cursor is None
        newest = []
        async for v in api.iter_versions("ws", rid, newest_first=True, limit=300):
            newest.append(v.version)
            if len(newest) == 301:
                break
        assert newest == list(range(V, V - 301, -1))


async def test_memory_tool_history_shows_the_newest(env):
    app, c, rid, _ = env
    r = await c.post("/v1/workspaces/ws/memory-tool", json={"command": "history", "path": "/memories/ws/v.md"})
    assert r.status_code == 200 and not r.json()["is_error"], r.text
    text = r.json()["content"]
    shown = [int(m) for m in re.findall(r"^v(\d+)\t", text, re.M)]
    assert shown == list(range(V, V - 100, -1))
    assert text.endswith(f"[memfuse: the versions before v{V - 99} are not shown; `version` shows one]")
    assert len(text.encode()) < 20_000


async def test_console_record_page_lists_the_newest_with_an_older_link(env):
    app, c, rid, _ = env
    url = f"/ui/stores/ws/records/{rid}"
    seen: list[int] = []
    for _ in range(100):
        r = await c.get(url)
        assert r.status_code == 200, r.text[:2000]
        assert len(r.content) < 200_000  # 2,100 versions listed whole: ~2.5 MB
        rows = re.findall(r'<td class="num" data-label="Version"><a href="[^"]*\?version=(\d+)">', r.text)
        assert 0 < len(rows) <= 50
        seen += [int(n) for n in rows]
        older = re.search(r'<a class="older-versions" rel="next" href="([^"]+)">Older versions…</a>', r.text)
        if older is None:
            break
        assert "Newest versions" in r.text or len(seen) == 50
        url = older.group(1)
    assert seen == list(range(V, 0, -1))
    for bad in ("x", "0", str(2**70), "-3"):
        r = await c.get(f"/ui/stores/ws/records/{rid}?before={bad}")
        assert r.status_code == 400 and "Traceback" not in r.text, bad


def test_json_text_bytes_is_what_the_encoders_write():
    """``defs.json_text_bytes`` (the JSON byte count of the feed's page budget) is exact for
    pydantic's and msgspec's encoders, over every code point (and a lone surrogate counted as
    its three bytes rather than raising), and ``json_rows_within`` cuts by it."""
    import msgspec
    from pydantic_core import to_json

    from memfuse.defs import JSON_TEXT_GROWTH, PAGE_CONTENT_BYTES, json_rows_within, json_text_bytes

    every = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF)
    assert json_text_bytes(every) == len(to_json(every)) - 2 == len(msgspec.json.encode(every)) - 2
    for c in every[:0x100]:
        assert json_text_bytes(c) == len(to_json(c)) - 2 == len(msgspec.json.encode(c)) - 2, repr(c)
    assert json_text_bytes("\x01") == JSON_TEXT_GROWTH and json_text_bytes("\ud800") == 3
    # measured by encoding up to _JSON_ENCODE_MAX characters, without the JSON past it: one count
    from memfuse.defs import _JSON_ENCODE_MAX
    mix = ("a\x01\"\n\\é\u2028\U0001f600\x7f" * _JSON_ENCODE_MAX)[:_JSON_ENCODE_MAX]
    for text in (mix, mix + "\x02", mix[:-1] + "\ud800", mix[:-1] + "\ud800\x03"):
        # a lone surrogate counted as its three bytes, as any other character of three
        assert json_text_bytes(text) == len(to_json(text.replace("\ud800", "\u0800"))) - 2, len(text)
    third = PAGE_CONTENT_BYTES // 3
    assert json_rows_within(["a" * third] * 4) == 3  # plain text: its UTF-8
    assert json_rows_within(["\x01" * (third // 6)] * 4) == 3  # six bytes a character
    assert json_rows_within(["\x01" * (third // 5)] * 4) == 2
    assert json_rows_within(["\x01" * PAGE_CONTENT_BYTES, "a"]) == 1 and json_rows_within([]) == 0
    assert json_rows_within([None, "", "x"]) == 3


def test_content_page_is_the_two_step_page_byte_rule():
    """``defs.content_page``, the one page byte rule of the change feed, store snapshots and
    the memory-store face's memories and versions: rows are read only up to what their sizes
    let one page carry (at least one), then cut again by their content as JSON; a row read
    ahead, or any cut, says more may follow."""
    from memfuse.defs import PAGE_CONTENT_BYTES, content_page

    third = PAGE_CONTENT_BYTES // 3
    reads: list[int] = []

    def reader(texts: list[str | None], ahead: int = 0):
        def read(n: int) -> list[str | None]:
            reads.append(n)
            return texts[:n + ahead]
        return read

    plain = ["a" * third] * 4
    assert content_page([third] * 4, reader(plain), lambda t: t) == (plain[:3], True)
    assert reads == [3]  # the fourth row's content is never read
    assert content_page([third] * 2, reader(plain[:2]), lambda t: t) == (plain[:2], False)
    # the sizes let three through, their JSON (six bytes a character) only two
    ctl = ["\x01" * (third // 5)] * 3
    assert content_page([third // 5] * 3, reader(ctl), lambda t: t) == (ctl[:2], True)
    # what the answer shows is counted (a redacted row: none), not the row's size alone
    assert content_page([third // 5] * 3, reader(ctl), lambda t: None) == (ctl, False)
    # a row read one ahead: kept out, and more follow
    assert content_page([1, 1], reader(["x", "y", "z"], ahead=1), lambda t: t) == (["x", "y"], True)
    # a row larger than the budget is served alone; none: nothing read
    assert content_page([PAGE_CONTENT_BYTES + 1, 1], reader(["b", "c"]), lambda t: t) == (["b"], True)
    reads.clear()
    assert content_page([], reader([]), lambda t: t) == ([], False) and reads == []
    # rows gone between the two reads: what is left, not cut by that
    assert content_page([1, 1, 1], reader(["x"]), lambda t: t) == (["x"], False)


def test_versions_page_rows_counts_each_version_with_its_separator():
    """``defs.versions_page_rows``, the one byte rule of a versions page (the control plane's
    and the CLI's local reads): each version's JSON plus the ``[`` or ``,`` before it fits
    ``VERSIONS_PAGE_BYTES``; at least one version."""
    from memfuse.defs import versions_page_rows

    half = b"v" * (VERSIONS_PAGE_BYTES // 2 - 1)  # with its separator: half the page exactly
    assert versions_page_rows([half, half, half]) == 2
    assert versions_page_rows([half + b"v", half]) == 1  # one byte over with the separators
    assert versions_page_rows([b"v" * (VERSIONS_PAGE_BYTES + 1), b"{}"]) == 1
    assert versions_page_rows([]) == 0
