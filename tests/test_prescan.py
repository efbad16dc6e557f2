"""A large content's secret scan runs before the write reaches the writer thread
(``memfuse.server.prescan``, attack18 F5: a batch of 1 MiB records made of base64 runs held the
one writer thread of a SQLite replica for ~45 s, and another workspace's 3-byte write waited
93 s). A real control plane served lean on loopback; ``content.find_secret`` is spied on to
see which thread scans each large content; the verdicts still refuse what they must."""
from __future__ import annotations

import base64
import random
import threading
import time
from typing import Any

import httpx
import pytest
import trio
from planeutil import serve_app, setup_ws
from test_lean import ADMIN, WS

from memfuse import content
from memfuse.server import prescan
from memfuse.server.app import create_app

pytestmark = pytest.mark.timeout(120)


def _big(seed: int) -> str:
    """~80 KB of base64 runs (each decoded and scanned: the costly kind), no secret."""
    r = random.Random(seed)
    return "\n".join(base64.b64encode(r.randbytes(300)).decode() for _ in range(200)) + "\n"


async def _served_ws(tmp_path, nursery: trio.Nursery) -> tuple[Any, str]:
    """A lean control plane (bodies up to 4 MiB) with workspace ws (token ``WS``) and its
    store ``default``; (app, base URL)."""
    app = create_app(f"sqlite:///{tmp_path / 'cp.db'}", static_tokens={ADMIN: None, WS: "ws"},
                     max_body=4 * 1024 * 1024)
    base = await serve_app(nursery, app, lean=True)
    await setup_ws(base, ADMIN)
    return app, base


def test_large_contents_are_scanned_off_the_writer_thread(tmp_path, monkeypatch) -> None:
    seen: list[str] = []
    real = content.find_secret

    def spy(text: str) -> str | None:
        if len(text) >= prescan.PRESCAN_MIN:
            seen.append(threading.current_thread().name)
        return real(text)

    monkeypatch.setattr(content, "find_secret", spy)
    token = "gh" + "p_" + "R8xkQ2mZp4LwT9vNc3YhJ6bF1sD7gK0aEu5W"
    answers: dict[str, Any] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            app, base = await _served_ws(tmp_path, nursery)
            async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {WS}"}, timeout=30) as c:
                big = _big(1)
                assert len(big) >= prescan.PRESCAN_MIN
                r = await c.post("/v1/stores/default/records", json={"path": "a.md", "content": big})
                answers["create"] = r.status_code
                rid = r.json().get("id") or r.json().get("record_id")
                assert rid, r.text[:300]
                r = await c.put(f"/v1/stores/default/records/{rid}", json={"content": _big(2)})
                answers["update"] = r.status_code
                ops = [{"op": "create", "body": {"path": f"b{i}.md", "content": _big(10 + i)}} for i in range(3)]
                ops.append({"op": "create", "body": {"path": "s.md", "content": _big(20) + token + "\n"}})
                r = await c.post("/v1/stores/default/batch", json={"operations": ops})
                answers["batch"] = [x["status"] for x in r.json()["results"]]
                answers["secret"] = r.json()["results"][3]["body"]["code"]
            answers["lean_writes"] = int(app.front.lean_writes)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert answers["create"] == 201 and answers["update"] == 200, answers
    assert answers["batch"] == [201, 201, 201, 422] and answers["secret"] == "secret_detected", answers
    assert answers["lean_writes"] >= 3, answers  # they took the lean route, whose hop is the writer thread
    assert len(seen) >= 6, seen  # each large content scanned (the refused one too)
    assert "memfuse-writer" not in seen, seen


def test_a_batch_of_contents_under_the_bound_is_scanned_off_the_writer_thread(tmp_path, monkeypatch) -> None:
    """attack19 F1: contents each just under ``PRESCAN_MIN`` whose batch sums past it are
    scanned before the writer thread (on main they were scanned on it, one after another);
    the verdicts still refuse the one with a secret."""
    seen: list[str] = []
    real = content.find_secret

    def spy(text: str) -> str | None:
        if len(text) >= prescan.PRESCAN_MIN // 2:
            seen.append(threading.current_thread().name)
        return real(text)

    monkeypatch.setattr(content, "find_secret", spy)
    answers: dict[str, Any] = {}
    n = prescan.PRESCAN_MIN - 1

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            app, base = await _served_ws(tmp_path, nursery)
            async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {WS}"}, timeout=30) as c:
                ops = [{"op": "create", "body": {"path": f"u{i}.md", "content": _big(30 + i)[:n]}}
                       for i in range(4)]
                ops.append({"op": "create", "body": {"path": "s.md", "content": (TOKEN + "\n" + _big(40))[:n]}})
                r = await c.post("/v1/stores/default/batch", json={"operations": ops})
                answers["batch"] = [x["status"] for x in r.json()["results"]]
            answers["lean_writes"] = int(app.front.lean_writes)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert answers["batch"] == [201, 201, 201, 201, 422], answers
    assert answers["lean_writes"] >= 1, answers  # the lean route, whose hop is the writer thread
    assert len(seen) >= 5, seen  # each content scanned (the refused one too)
    assert "memfuse-writer" not in seen, seen


def test_prescan_keeps_find_secrets_answers() -> None:
    """``prescan.find_secret`` answers as ``content.find_secret`` with and without kept verdicts."""
    token = "gh" + "p_" + "R8xkQ2mZp4LwT9vNc3YhJ6bF1sD7gK0aEu5W"
    texts = [_big(3), _big(4) + token + "\n", "short " + token + "\n", "short\n"]

    async def main() -> list[str | None]:
        async with prescan.prescanned(texts):
            return [prescan.find_secret(t) for t in texts]

    assert trio.run(main) == [content.find_secret(t) for t in texts]
    assert [prescan.find_secret(t) for t in texts] == [content.find_secret(t) for t in texts]


WS2 = "prescan-ws2-token"
TOKEN = "gh" + "p_" + "R8xkQ2mZp4LwT9vNc3YhJ6bF1sD7gK0aEu5W"


async def _served(tmp_path, nursery: trio.Nursery) -> tuple[Any, str]:
    """A lean control plane with workspaces ws (token ``WS``) and ws2 (``WS2``), each with
    the store ``default`` / ``other`` attached read-write; (app, base URL)."""
    app = create_app(f"sqlite:///{tmp_path / 'cp.db'}", static_tokens={ADMIN: None, WS: "ws", WS2: "ws2"},
                     max_body=4 * 1024 * 1024)
    base = await serve_app(nursery, app)
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30) as a:
        for ws, store in (("ws", "default"), ("ws2", "other")):
            assert (await a.post("/v1/workspaces", json={"name": ws, "default_store": False})).status_code == 201
            assert (await a.post("/v1/stores", json={"slug": store})).status_code == 201
            r = await a.put(f"/v1/workspaces/{ws}/attachments/{store}", json={"access": "read_write"})
            assert r.status_code == 200, r.text
    return app, base


def test_large_appends_are_scanned_outside_the_write_lock(tmp_path, monkeypatch) -> None:
    """A large append's scan (the append route, and a batch's append operation) runs neither on
    the writer thread nor under the database's write lock (attack18 F5: it did both), after
    the same context the write reads; a token split across the context and the suffix is
    still refused."""
    seen: list[tuple[str, bool]] = []
    holder: dict[str, Any] = {}

    def spying(real: Any) -> Any:
        def spy(text: str, *args: Any) -> str | None:
            # the scans of the ~80 KB suffixes (a small suffix's scan with its 16 Ki
            # characters of context is done in place, under the lock, as it should be)
            if len(text) >= 64 * 1024:
                seen.append((threading.current_thread().name, holder["db"]._write_lock.locked()))
            return real(text, *args)
        return spy

    # the whole scan, and the append scan's (``secretscan.AppendScans``) from known hints
    monkeypatch.setattr(content, "find_secret", spying(content.find_secret))
    monkeypatch.setattr(content, "find_secret_in_view", spying(content.find_secret_in_view))
    answers: dict[str, Any] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            app, base = await _served(tmp_path, nursery)
            holder["db"] = app.state.service.db
            async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {WS}"}, timeout=30) as c:
                r = await c.post("/v1/stores/default/records", json={"path": "a.md", "content": "start\n"})
                rid, sha = r.json()["id"], r.json()["sha256"]
                r = await c.post(f"/v1/stores/default/records/{rid}/append", json={"append": _big(5)},
                                 headers={"If-Match": f'"{sha}"'})
                answers["route"] = r.status_code
                sha = r.json()["sha256"]
                ops = [{"op": "append", "record_id": rid, "if_match": sha, "body": {"append": _big(6)}}]
                r = await c.post("/v1/stores/default/batch", json={"operations": ops})
                answers["batch"] = [x["status"] for x in r.json()["results"]]
                sha = r.json()["results"][0]["etag"].strip('"')
                # the token's first half ends the content, its second half starts a large suffix
                r = await c.post(f"/v1/stores/default/records/{rid}/append", json={"append": TOKEN[:12] + "\n"},
                                 headers={"If-Match": f'"{sha}"'})
                sha = r.json()["sha256"]
                # (a newline above: the half alone is no token; joined without it below)
                r = await c.put(f"/v1/stores/default/records/{rid}", json={"content": "x " + TOKEN[:12]},
                                headers={"If-Match": f'"{sha}"'})
                sha = r.json()["sha256"]
                ops = [{"op": "append", "record_id": rid, "if_match": sha,
                        "body": {"append": TOKEN[12:] + "\n" + _big(7)}}]
                r = await c.post("/v1/stores/default/batch", json={"operations": ops})
                answers["split"] = r.json()["results"][0]["body"].get("code")
                r = await c.post(f"/v1/stores/default/records/{rid}/append",
                                 json={"append": TOKEN[12:] + "\n" + _big(8)}, headers={"If-Match": f'"{sha}"'})
                answers["split_route"] = (r.status_code, r.json().get("code"))
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert answers["route"] == 200 and answers["batch"] == [200], answers
    assert answers["split"] == "secret_detected", answers
    assert answers["split_route"] == (422, "secret_detected"), answers
    assert len(seen) >= 4, seen
    assert all(name != "memfuse-writer" and not locked for name, locked in seen), seen


def test_one_tokens_large_scans_are_bounded(tmp_path) -> None:
    """A token whose scan budget is spent is refused its next large write with the API's 429
    ``rate_limited`` problem and ``Retry-After`` (create, update, batch, append; lean or
    not), before it is scanned; its small writes and another token's large ones go on."""
    answers: dict[str, Any] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            app, base = await _served(tmp_path, nursery)
            scans = app.state.service.parts.scans
            scans.rate, scans.burst = 0.001, 0.001  # one large scan spends it for a long while
            async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {WS}"}, timeout=30) as c:
                r = await c.post("/v1/stores/default/records", json={"path": "a.md", "content": _big(1)})
                answers["first"] = r.status_code
                rid, sha = r.json()["id"], r.json()["sha256"]
                charged, refused = scans.charged, scans.refused
                r = await c.post("/v1/stores/default/records", json={"path": "b.md", "content": _big(2)})
                answers["create"] = (r.status_code, r.headers.get("content-type"), r.json().get("code"),
                                     int(r.headers.get("retry-after", "0")))
                r = await c.put(f"/v1/stores/default/records/{rid}", json={"content": _big(3)})
                answers["update"] = r.status_code
                ops = [{"op": "create", "body": {"path": "c.md", "content": _big(4)}}]
                r = await c.post("/v1/stores/default/batch", json={"operations": ops})
                answers["batch"] = r.status_code
                r = await c.post(f"/v1/stores/default/records/{rid}/append", json={"append": _big(5)},
                                 headers={"If-Match": f'"{sha}"'})
                answers["append"] = r.status_code
                # the FastAPI route (an account header is FastAPI's), not only the lean one
                r = await c.post("/v1/stores/default/records?x=1", json={"path": "d.md", "content": _big(6)})
                answers["fastapi"] = r.status_code
                answers["no_scan"] = (scans.charged == charged, scans.refused - refused)
                r = await c.post("/v1/stores/default/records", json={"path": "small.md", "content": "hi\n"})
                answers["small"] = r.status_code
            async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {WS2}"}, timeout=30) as c:
                r = await c.post("/v1/stores/other/records", json={"path": "a.md", "content": _big(7)})
                answers["other"] = r.status_code
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert answers["first"] == 201, answers
    assert answers["create"][:3] == (429, "application/problem+json", "rate_limited"), answers
    assert answers["create"][3] >= 1, answers
    assert (answers["update"], answers["batch"], answers["append"], answers["fastapi"]) == (429, 429, 429, 429), answers
    assert answers["no_scan"] == (True, 5), answers  # refused before any scan ran
    assert answers["small"] == 201 and answers["other"] == 201, answers


def _mid(seed: int, chars: int) -> str:
    """``chars`` characters of base64 runs (the costly kind to scan), no secret."""
    r = random.Random(seed)
    out = ""
    while len(out) < chars:
        out += base64.b64encode(r.randbytes(300)).decode() + "\n"
    return out[:chars]


def test_scans_in_the_writer_thread_are_charged_too(tmp_path, monkeypatch) -> None:
    """attack20 F1: contents just under ``PRESCAN_MIN``, scanned in the writer thread, are
    charged to their token as well, so a token past its budget is refused them (429) before
    they reach the writer; under ``CHARGE_MIN`` nothing is charged or refused. Lean route and
    batch; the writer thread is the scanning one (spied), another token goes on."""
    scanned_on: list[tuple[int, str]] = []
    real = content.find_secret

    def spy(text: str) -> str | None:
        if len(text) >= prescan.CHARGE_MIN:
            scanned_on.append((len(text), threading.current_thread().name))
        return real(text)

    monkeypatch.setattr(content, "find_secret", spy)
    answers: dict[str, Any] = {}
    under = prescan.PRESCAN_MIN - 200  # one content, scanned where it is written

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            app, base = await _served_ws(tmp_path, nursery)
            scans = app.state.service.parts.scans
            scans.rate, scans.burst = 0.001, 0.001  # one charged scan spends it for a long while
            async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {WS}"}, timeout=30) as c:
                r = await c.post("/v1/stores/default/records", json={"path": "a.md", "content": _mid(1, under)})
                answers["first"] = r.status_code
                answers["charged"] = scans.charged > 0
                n = len(scanned_on)
                r = await c.post("/v1/stores/default/records", json={"path": "b.md", "content": _mid(2, under)})
                answers["second"] = (r.status_code, r.json().get("code"), int(r.headers.get("retry-after", "0")))
                ops = [{"op": "create", "body": {"path": "c.md", "content": _mid(3, 4000)}}]
                r = await c.post("/v1/stores/default/batch", json={"operations": ops})
                answers["batch"] = (r.status_code, [x["status"] for x in r.json().get("results", [])])
                answers["scanned_after"] = len(scanned_on) - n
                r = await c.post("/v1/stores/default/records",
                                 json={"path": "small.md", "content": _mid(4, prescan.CHARGE_MIN - 1)})
                answers["small"] = r.status_code
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert answers["first"] == 201 and answers["charged"], answers
    assert scanned_on and scanned_on[0] == (under, "memfuse-writer"), scanned_on
    assert answers["second"][:2] == (429, "rate_limited") and answers["second"][2] >= 1, answers
    assert answers["batch"] == (200, [429]), answers  # the operation refused, as an append in a batch is
    assert answers["scanned_after"] == 0, answers  # refused before any scan ran
    assert answers["small"] == 201, answers


def test_one_tokens_large_scans_run_one_at_a_time_on_every_face(tmp_path, monkeypatch) -> None:
    """attack20 F2: the memory tool (and the memory-store API, MCP: every face that scans in
    its own thread before the write lock) scans a token's large contents one at a time, as
    the lean routes' prescan does, so one token's threads cannot take the GIL from the writer
    thread; another token's scan is not held by them, and every write is answered."""
    lock = threading.Lock()
    active: dict[str, int] = {}
    peak: dict[str, int] = {}
    real = content.find_secret

    def spy(text: str) -> str | None:
        if len(text) >= prescan.PRESCAN_MIN:
            who = "ws2" if text.startswith("ws2") else "ws"
            with lock:
                active[who] = active.get(who, 0) + 1
                peak[who] = max(peak.get(who, 0), active[who])
            time.sleep(0.15)  # widen the window in which a second scan of the token would overlap
            with lock:
                active[who] -= 1
        return real(text)

    monkeypatch.setattr(content, "find_secret", spy)
    statuses: list[int] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            _, base = await _served(tmp_path, nursery)

            async def tool(token: str, ws: str, store: str, i: int) -> None:
                async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {token}"},
                                             timeout=60) as c:
                    text = (ws + "\n" if ws == "ws2" else "") + _big(10 + i)
                    r = await c.post(f"/v1/workspaces/{ws}/memory-tool",
                                     json={"command": "create", "path": f"/memories/{store}/m{i}.md",
                                           "file_text": text})
                    statuses.append(r.status_code)

            async with trio.open_nursery() as inner:
                for i in range(4):
                    inner.start_soon(tool, WS, "ws", "default", i)
                inner.start_soon(tool, WS2, "ws2", "other", 9)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert statuses == [200] * 5, statuses
    assert peak.get("ws") == 1, peak  # one token's four large scans never overlapped
    assert peak.get("ws2") == 1, peak


def test_scan_budget_refills_and_charges_cpu_time() -> None:
    from memfuse.server.scanbudget import ScanBudget

    now = [100.0]
    b = ScanBudget(rate=0.5, burst=2.0, clock=lambda: now[0])
    assert b.wait("k") == 0
    b.charge("k", 3.0)  # one scan past the burst: in debt by 1 s
    assert b.wait("k") == pytest.approx(2.0)
    with pytest.raises(ScanBudget.Refused) as e:
        b.scan("k", lambda: None)
    assert e.value.retry_after == 2
    assert b.wait("other") == 0
    now[0] += 2.5
    assert b.wait("k") == 0
    assert b.scan("k", lambda: sum(range(200_000))) == sum(range(200_000))
    assert 0 < b.charged - 3.0 < 1.0


def test_one_tokens_prescans_run_one_at_a_time(tmp_path, monkeypatch) -> None:
    """Large writes sent at once by one token are scanned one after the other (one worker
    thread of anyio's pool at a time: the others stay free for other tenants); another
    token's scan runs beside them."""
    lock = threading.Lock()
    running: dict[str, int] = {}
    most: dict[str, int] = {}
    real = content.find_secret

    def spy(text: str) -> str | None:
        if len(text) < prescan.PRESCAN_MIN:
            return real(text)
        who = "ws2" if text.startswith("ws2") else "ws"
        with lock:
            running[who] = running.get(who, 0) + 1
            most[who] = max(most.get(who, 0), running[who])
            both = running.get("ws", 0) and running.get("ws2", 0)
            most["both"] = max(most.get("both", 0), 1 if both else 0)
        try:
            time.sleep(0.3)  # long enough for the other requests to arrive meanwhile
            return real(text)
        finally:
            with lock:
                running[who] -= 1

    monkeypatch.setattr(content, "find_secret", spy)
    statuses: list[int] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            app, base = await _served(tmp_path, nursery)
            async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {WS}"}, timeout=60) as c, \
                    httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {WS2}"}, timeout=60) as c2:
                async def create(client: httpx.AsyncClient, store: str, name: str, text: str) -> None:
                    r = await client.post(f"/v1/stores/{store}/records", json={"path": name, "content": text})
                    statuses.append(r.status_code)

                async with trio.open_nursery() as n:
                    for i in range(4):
                        n.start_soon(create, c, "default", f"a{i}.md", _big(30 + i))
                    n.start_soon(create, c2, "other", "b.md", "ws2" + _big(40) + "ws2" + _big(41))
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert statuses == [201] * 5, statuses
    assert most["ws"] == 1, most
    assert most.get("both") == 1, most


def test_a_small_write_makes_no_prescan_context_manager_on_the_event_loop() -> None:
    """A request below ``PRESCAN_MIN`` (every file a sidecar commits, nearly) gets the one
    shared do-nothing context manager: no async generator made, started and closed per write
    on the event loop (trio's async-generator hooks, a weak set, the context manager:
    bench/README.md, "The close path, session 20: serve's loop"); a large one still scans."""
    small = prescan.prescanned(("short\n", None, ""), appends=[("r1", "tail\n")])
    assert small is prescan.prescanned(("other\n",))
    made: list[object] = []

    async def main() -> None:
        import sys

        hooks = sys.get_asyncgen_hooks()
        sys.set_asyncgen_hooks(firstiter=lambda g: made.append(g), finalizer=hooks.finalizer)
        try:
            async with prescan.prescanned(("short\n",)):
                pass
        finally:
            sys.set_asyncgen_hooks(*hooks)
        big = _big(5) + TOKEN + "\n"
        async with prescan.prescanned((big,)):
            assert prescan.find_secret(big) == content.find_secret(big)

    trio.run(main)
    assert made == []
