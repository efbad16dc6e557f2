"""Each token's budget of time holding the database's writer (``memfuse.server.writertime``,
attack21 F2: one token looping prefix moves held SQLite's one writer ~2 s a move, and another
workspace's single creates waited p50 1.9 s). A real control plane served lean on loopback."""
from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
import trio
from planeutil import serve_app
from test_lean import ADMIN, WS

from memfuse.client.api import ApiClient
from memfuse.errors import TransientError
from memfuse.server import prescan, writertime
from memfuse.server.app import create_app
from memfuse.server.base import Principal, ServiceError
from memfuse.server.db import Database
from memfuse.server.writertime import Charge, WriterTime

pytestmark = pytest.mark.timeout(120)

WS2 = "writertime-ws2-token"
RECORDS = 150  # records under a/ (a move of them holds the writer some ms)


async def _served(tmp_path, nursery: trio.Nursery) -> tuple[Any, str]:
    """A lean control plane with workspaces ws (``WS``, store ``default``) and ws2 (``WS2``,
    store ``other``), ``RECORDS`` records under ``a/`` in ``default``; (app, base URL)."""
    app = create_app(f"sqlite:///{tmp_path / 'cp.db'}", static_tokens={ADMIN: None, WS: "ws", WS2: "ws2"})
    base = await serve_app(nursery, app)
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30) as a:
        for ws, store in (("ws", "default"), ("ws2", "other")):
            assert (await a.post("/v1/workspaces", json={"name": ws, "default_store": False})).status_code == 201
            assert (await a.post("/v1/stores", json={"slug": store})).status_code == 201
            r = await a.put(f"/v1/workspaces/{ws}/attachments/{store}", json={"access": "read_write"})
            assert r.status_code == 200, r.text
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {WS}"}, timeout=30) as c:
        ops = [{"op": "create", "body": {"path": f"a/r{i}.md", "content": f"record {i}\n"}} for i in range(RECORDS)]
        for i in range(0, RECORDS, 100):
            r = await c.post("/v1/stores/default/batch", json={"operations": ops[i:i + 100]})
            assert r.status_code == 200, r.text
    return app, base


def _key(app: Any, token: str) -> str:
    """The key of ``token``'s writer time (``prescan.scan_key`` of its principal)."""
    return prescan.scan_key(app.state.service.tokens.authenticate(token))


def test_a_token_past_its_writer_time_is_refused_and_another_is_not(tmp_path) -> None:
    """A token whose writes held the writer past its burst (a prefix move) is refused its next
    write with 429 ``rate_limited`` and ``Retry-After``, before it runs (create on the lean
    route and through FastAPI, batch, move, delete); another workspace's token writes on, and
    so does the root admin (not charged)."""
    answers: dict[str, Any] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            app, base = await _served(tmp_path, nursery)
            wt = app.state.service.parts.writer_time
            wt.rate, wt.burst = 0.001, 0.001  # one move spends it for a long while
            wt.charge("another tenant", 0.0)  # the writer is shared: the buckets apply
            async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {WS}"}, timeout=30) as c:
                r = await c.post("/v1/stores/default/move", json={"from_prefix": "a", "to_prefix": "b"})
                answers["move"] = r.status_code
                answers["debt"] = wt.wait(_key(app, WS))
                charged = wt.charged
                r = await c.post("/v1/stores/default/records", json={"path": "x.md", "content": "x\n"})
                answers["create"] = (r.status_code, r.headers.get("content-type"), r.json().get("code"),
                                     int(r.headers.get("retry-after", "0")))
                r = await c.post("/v1/stores/default/records?x=1", json={"path": "y.md", "content": "y\n"})
                answers["fastapi"] = r.status_code
                r = await c.post("/v1/stores/default/batch",
                                 json={"operations": [{"op": "create", "body": {"path": "z.md", "content": "z"}}]})
                answers["batch"] = r.status_code
                r = await c.post("/v1/stores/default/move", json={"from_prefix": "b", "to_prefix": "a"})
                answers["move2"] = r.status_code
                r = await c.delete("/v1/stores/default/records/nope")
                answers["delete"] = r.status_code
                answers["uncharged"] = wt.charged == charged  # refused before any transaction
                r = await c.get("/v1/stores/default/records?limit=5")
                answers["read"] = r.status_code
            async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {WS2}"}, timeout=30) as c:
                r = await c.post("/v1/stores/other/records", json={"path": "a.md", "content": "o\n"})
                answers["other"] = r.status_code
            async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30) as c:
                r = await c.post("/v1/stores", json={"slug": "third"})
                answers["admin"] = r.status_code
                answers["admin_uncharged"] = wt.wait(_key(app, ADMIN)) == 0
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert answers["move"] == 200, answers
    assert answers["debt"] >= 1, answers  # ~RECORDS × 0.1-0.5 ms of writer, at 0.001 s a second
    assert answers["create"][:3] == (429, "application/problem+json", "rate_limited"), answers
    assert answers["create"][3] >= 1, answers
    assert (answers["fastapi"], answers["batch"], answers["move2"], answers["delete"]) == (429,) * 4, answers
    assert answers["uncharged"] and answers["read"] == 200, answers
    assert answers["other"] == 201 and answers["admin"] == 201 and answers["admin_uncharged"], answers


def test_the_writer_time_refills(tmp_path) -> None:
    """After ``Retry-After`` seconds the token's bucket is back above zero and its write goes;
    the client reads the refusal as a ``TransientError`` with ``retry_after`` (what the
    sidecar's committer waits before it sends the entry again: a move, a create)."""
    answers: dict[str, Any] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            app, base = await _served(tmp_path, nursery)
            wt = app.state.service.parts.writer_time
            wt.charge("another tenant", 0.0)  # the writer is shared: the buckets apply
            async with ApiClient(base, WS) as api:
                await api.move_prefix("default", "a", "b")
                # the move's time, plus debt for a second at the rate set below
                wt.charge(_key(app, WS), wt.burst + 0.5)
                wt.rate = 1.0
                for name, call in (("move", lambda: api.move_prefix("default", "b", "a")),
                                   ("create", lambda: api.create_record("default", "n.md", "n\n"))):
                    try:
                        await call()
                        answers[name] = "went"
                    except TransientError as e:
                        answers[name] = (e.status, e.code, e.retry_after)
                wait = wt.wait(_key(app, WS))
                answers["wait"] = wait
                await trio.sleep(wait + 0.05)
                await api.move_prefix("default", "b", "a")
                answers["after"] = (await api.create_record("default", "n.md", "n\n")).path
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert answers["move"][:2] == (429, "rate_limited") and answers["move"][2] >= 1, answers
    assert answers["create"][:2] == (429, "rate_limited"), answers
    assert 0 < answers["wait"] <= 1.5, answers
    assert answers["after"] == "n.md", answers


def test_buckets_refill_at_the_rate() -> None:
    now = [100.0]
    wt = WriterTime(rate=0.5, burst=2.0, clock=lambda: now[0])
    wt.charge("other", 0.0)  # another token wrote: the writer is shared for SHARED_WINDOW s
    assert wt.wait("k") == 0 and wt.refused_now("k") is None
    wt.charge("k", 4.0)  # 2 s in debt: 4 s at 0.5 a second
    assert wt.wait("k") == pytest.approx(4.0)
    e = wt.refused_now("k")
    assert e is not None and e.status == 429 and e.code == "rate_limited" and e.headers == {"Retry-After": "4"}
    assert wt.wait("other") == 0
    now[0] += 4.0
    assert wt.wait("k") == 0 and wt.refused_now("k") is None
    now[0] += 100.0  # never past the burst
    wt.charge("other", 0.0)
    wt.charge("k", 2.5)
    assert wt.wait("k") == pytest.approx(1.0)


@pytest.mark.parametrize("memory", [False, True])
def test_the_database_charges_each_write_transaction_and_refuses_a_requests_first(tmp_path, memory) -> None:
    """``Database.write_conn`` / ``write`` (both engines' one place) charge the request's token
    the time they hold the writer, and refuse the request's first transaction (429) when its
    bucket is in debt, before it runs; a later transaction of the same request is charged,
    never refused (a write is not cut half-way); without a request's charge nothing is. In
    memory: the branch PostgreSQL takes (no write lock of this process: the transaction)."""
    db = Database("sqlite://" if memory else f"sqlite:///{tmp_path / 'w.db'}")
    try:
        wt = WriterTime(rate=0.001, burst=0.001)
        wt.charge("another tenant", 0.0)  # the writer is shared: the buckets apply
        charge = Charge("k", wt)
        mine = writertime.CURRENT.set(charge)
        try:
            with db.write_conn() as conn:
                conn.exec_driver_sql("SELECT 1")
                time.sleep(0.02)
            assert wt.charged >= 0.02 and wt.wait("k") > 0
            with db.write() as s:  # the same request's second transaction: charged, not refused
                time.sleep(0.01)
            assert wt.charged >= 0.03
            again = Charge("k", wt)  # the token's next request
            writertime.CURRENT.set(again)
            with pytest.raises(ServiceError) as ei:
                with db.write_conn():
                    raise AssertionError("refused before it runs")
            assert ei.value.status == 429 and ei.value.code == "rate_limited"
            assert int(ei.value.headers["Retry-After"]) >= 1
            writertime.CURRENT.set(None)
            before = wt.charged
            with db.write_conn():
                pass
            db.index_pending()
            assert wt.charged == before
        finally:
            writertime.CURRENT.reset(mine)
        with db.write() as s:  # the lock was given back by the refusal
            s.connection().exec_driver_sql("SELECT 1")
    finally:
        db.dispose()


def test_a_token_alone_on_the_writer_is_neither_refused_nor_put_in_debt() -> None:
    """Work-conserving: while no other key was charged within ``shared_window`` s, a token's
    charges take its bucket to zero at most and it is never refused (a lone ``cp -r`` or import
    runs at the writer's speed); once another token writes, its charges count in full and it
    is refused while in debt; when the other has been quiet ``shared_window`` s, it is not."""
    now = [0.0]
    wt = WriterTime(rate=0.5, burst=2.0, clock=lambda: now[0], shared_window=10.0)
    for _ in range(100):  # 100 s of writer time alone
        wt.charge("k", 1.0)
        now[0] += 0.01
        assert wt.wait("k") == 0 and wt.refused_now("k") is None
    assert wt._level("k", now[0]) >= 0
    wt.charge("victim", 0.002)  # another tenant writes
    assert wt.wait("k") == 0  # no debt was kept from when it was alone
    wt.charge("k", 3.0)  # counted in full now
    assert wt.wait("k") == pytest.approx(6.0, abs=0.1) and wt.refused_now("k") is not None
    assert wt.wait("victim") == 0
    now[0] += 10.5  # the victim quiet past the window: the writer is the token's alone again
    assert wt.wait("k") == 0 and wt.refused_now("k") is None


def test_the_root_admin_is_not_charged() -> None:
    wt = WriterTime()
    assert writertime.charge_of(Principal(None, root_token=True), wt) is None
    acct = writertime.charge_of(Principal(None, account="acme", token_id="t1"), wt)
    assert acct is not None and acct.key == "t1"
    ws = writertime.charge_of(Principal("ws", token_id="t2"), wt)
    assert ws is not None and ws.key == "t2"
    static = Principal("ws")  # a static token: the key of its scan budget too
    assert writertime.charge_of(static, wt).key == prescan.scan_key(static)


async def test_the_sidecar_sends_a_refused_move_and_create_again(tmp_path) -> None:
    """The sidecar's committer takes this 429 (``rate_limited``, ``Retry-After``) as it takes
    every other: it waits and sends the entry again, and nothing is lost (a create, then a
    directory's move)."""
    import os

    from test_faults import make_sidecar, remote, start, wait_until

    from memfuse.fake import FakeControlPlane

    fake = FakeControlPlane(seed=5)
    token = await fake.setup("ws")
    sc = await make_sidecar(tmp_path, fake, token)
    async with trio.open_nursery() as nursery:
        await start(sc, nursery)
        fs = sc.fs
        root = fs.stores["default"].root
        d = fs.mkdir(root.ino, b"d", 0o755, 0, 0)
        fake.faults.inject += [("POST", r"/records$", 429), ("POST", r"/batch$", 429)]
        h = fs.create(d.ino, b"f.md", 0o644, os.O_WRONLY, 0, 0)
        try:
            fs.write(h, 0, b"kept\n")
            await fs.flush(h)
        finally:
            fs.release(h.fh)
        assert fake.counters.injected >= 1  # the create was refused once, then committed
        fake.faults.inject += [("POST", r"/move$", 429)]
        fs.rename(root.ino, b"d", root.ino, b"e", 0)
        await wait_until(lambda: not any(m == "POST" and p == r"/move$" for m, p, _ in fake.faults.inject))
        await wait_until(lambda: sc.committer.retries >= 2 and sc.committer.depth() == 0)
        assert await remote(fake) == {"e/f.md": b"kept\n"}
        nursery.cancel_scope.cancel()
    sc.journal.close()
    await sc.client.aclose()
