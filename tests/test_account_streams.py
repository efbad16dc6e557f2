"""Long-lived responses are capped per account (docs/API.md, "Operations: limits";
``memfuse.server.streamclass``): one account's many tokens cannot take every stream slot of
the replica, so another account's sidecar still gets its change feed at once (attack17 F8:
on a server without the share, the restarting sidecar got 429 ``too_many_streams`` and saw
a change 16 s late).

A real ``memfuse serve`` on SQLite (PostgreSQL from ``tests/test_postgres.py``) with 10 slots,
2 per token and the default share (2/5: 4 per account); the unit test checks the counting.
"""
from __future__ import annotations

import os
import subprocess
import sys
from contextlib import AsyncExitStack
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import trio

from mountutil import serve_listening, stop
from pgutil import fresh_db_url

MEMFUSE = Path(sys.executable).with_name("memfuse")
ROOT = "acct-streams-root-token"
PER_REPLICA, PER_TOKEN, SHARE = 10, 2, 4  # SHARE: the default, 2/5 of PER_REPLICA

pytestmark = pytest.mark.timeout(180)


def _auth(token: str, **more: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}", **more}


async def _ok(r: httpx.Response, status: int = 200) -> dict:
    assert r.status_code == status, (r.request.url, r.status_code, r.text)
    return r.json()


async def _setup(url: str) -> dict[str, list[str]]:
    """Accounts alpha and bravo (each a workspace ``<acct>-ws`` with store ``<acct>-notes``
    and six tokens) and, in the default account, workspace ``side`` with store ``side-notes``
    and one token: the sidecar's. Returns account → its workspace tokens."""
    out: dict[str, list[str]] = {}
    async with httpx.AsyncClient(base_url=url, headers=_auth(ROOT), timeout=30) as root:
        for acct in ("alpha", "bravo", None):
            h = {} if acct is None else {"X-Memfuse-Account": acct}
            if acct is not None:
                await _ok(await root.post("/v1/accounts", json={"slug": acct}), 201)
            name = acct or "side"
            await _ok(await root.post("/v1/workspaces", json={"name": f"{name}-ws", "default_store": False},
                                      headers=h), 201)
            await _ok(await root.post("/v1/stores", json={"slug": f"{name}-notes"}, headers=h), 201)
            await _ok(await root.put(f"/v1/workspaces/{name}-ws/attachments/{name}-notes",
                                     json={"access": "read_write"}, headers=h))
            n = 1 if acct is None else 6  # 12 slots' worth: enough to fill the replica alone
            out[name] = [(await _ok(await root.post("/v1/tokens", json={"workspace": f"{name}-ws", "name": f"t{i}"},
                                                     headers=h), 201))["token"] for i in range(n)]
    return out


async def _open(client: httpx.AsyncClient, store: str, stack: AsyncExitStack) -> httpx.Response:
    """Open a change stream of ``store`` from its start and wait for its headers (closed
    with ``stack``)."""
    req = client.build_request("GET", f"/v1/stores/{store}/changes", params={"after": 0, "stream": "true"})
    r = await client.send(req, stream=True)
    stack.push_async_callback(r.aclose)
    return r


async def _fill(url: str, tokens: list[str], store: str, stack: AsyncExitStack) -> list[tuple[int, str]]:
    """Open ``PER_TOKEN`` streams with each of ``tokens``; (status, code) of each answer
    (code "" for a 200)."""
    got = []
    for t in tokens:
        c = await stack.enter_async_context(httpx.AsyncClient(base_url=url, headers=_auth(t), timeout=30))
        for _ in range(PER_TOKEN):
            r = await _open(c, store, stack)
            if r.status_code == 200:
                got.append((200, ""))
            else:
                await r.aread()
                assert r.headers["retry-after"] == "5"
                got.append((r.status_code, r.json()["code"]))
    return got


async def _feed_sees_a_write(url: str, token: str) -> float:
    """The sidecar's part: open its change stream at the store's head, write a record, and
    return the seconds until the stream carries it. Fails on a refusal."""
    async with AsyncExitStack() as stack:
        c = await stack.enter_async_context(httpx.AsyncClient(
            base_url=url, headers=_auth(token, **{"X-Memfuse-Instance": "side-1"}), timeout=30))
        head = (await _ok(await c.get("/v1/stores/side-notes/records", params={"limit": 1})))["seq"]
        req = c.build_request("GET", "/v1/stores/side-notes/changes", params={"after": head, "stream": "true"})
        r = await c.send(req, stream=True)
        stack.push_async_callback(r.aclose)
        if r.status_code != 200:
            await r.aread()
            raise AssertionError(f"the sidecar's feed was refused: {r.status_code} {r.text}")
        async with httpx.AsyncClient(base_url=url, headers=_auth(token), timeout=30) as w:
            rec = await _ok(await w.post("/v1/stores/side-notes/records",
                                         json={"path": "seen.md", "content": "x\n"}), 201)
        t0 = trio.current_time()
        with trio.fail_after(10):
            async for line in r.aiter_lines():
                if line and rec["id"] in line:
                    return trio.current_time() - t0
        raise AssertionError("the stream ended without the change")


def _refusals(url: str, reason: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith("memfuse_server_refused_total{") and f'reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A ``memfuse serve`` with ``PER_REPLICA`` stream slots, ``PER_TOKEN`` per token and the
    default share per account: its URL."""
    tmp = tmp_path_factory.mktemp("acct-streams")
    (tmp / "root.token").write_text(ROOT)
    with fresh_db_url(f"sqlite:///{tmp / 'cp.db'}") as db:
        log = tmp / "serve.log"
        proc = subprocess.Popen(
            [MEMFUSE, "serve", "--db", db, "--listen", "127.0.0.1:0", "--admin-token-file",
             str(tmp / "root.token"), "--migrate", f"--max-streams={PER_REPLICA}",
             f"--max-streams-per-token={PER_TOKEN}"],
            stdout=log.open("ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=dict(os.environ, MEMFUSE_HOME=str(tmp / "home")))
        try:
            yield serve_listening(proc, log)
        finally:
            stop(proc)


async def test_one_accounts_tokens_cannot_take_another_accounts_feed(server):
    url = server
    tokens = await _setup(url)
    with trio.fail_after(90):
        async with AsyncExitStack() as stack:
            # alpha's six tokens: its share opens, every further stream is refused
            got = await _fill(url, tokens["alpha"], "alpha-notes", stack)
            assert got[:SHARE] == [(200, "")] * SHARE, got
            assert set(got[SHARE:]) == {(429, "too_many_account_streams")}, got
            # a second account at its share too: the two leave the replica's other slots
            got = await _fill(url, tokens["bravo"], "bravo-notes", stack)
            assert got.count((200, "")) == SHARE, got
            assert _refusals(url, "too_many_account_streams") == 2 * (6 * PER_TOKEN - SHARE)
            # the default account's sidecar: its feed opens and carries a write at once
            assert await _feed_sees_a_write(url, tokens["side"][0]) < 5
            # the root admin (no account) has a share of its own
            async with httpx.AsyncClient(base_url=url, headers=_auth(ROOT), timeout=30) as root:
                assert (await _open(root, "side-notes", stack)).status_code == 200


async def test_reads_one_after_another_on_one_keep_alive_connection_are_all_answered(server):
    """The end of a read's request cycle (hypercorn's ``http.disconnect`` once the answer is
    sent) is not its client leaving: the next request on the same connection is answered,
    not dropped as one pipelined by a client gone (a 500 from hypercorn, every second
    request, after b2655a6; fixed on main by 688f0f0)."""
    before = _refusals(server, "client_gone")
    async with httpx.AsyncClient(base_url=server, headers=_auth(ROOT), timeout=30,
                                 limits=httpx.Limits(max_connections=1)) as c:
        got = [(await c.get("/v1/stores", params={"limit": 1})).status_code for _ in range(6)]
    assert got == [200] * 6
    assert _refusals(server, "client_gone") == before


async def test_the_share_counts_bound_leases_per_account_and_releases_them():
    """``StreamClass``'s share: by account (root admin and static tokens share ``none``),
    checked after the token's cap, given back on close; the default is 2/5 of the replica."""
    from memfuse.server.service import Principal, ServiceError
    from memfuse.server.streamclass import StreamClass, default_per_account

    svc = SimpleNamespace(notifier=SimpleNamespace(on_topic=lambda *a: None, on_reset=[]),
                          bus=SimpleNamespace(on_scan=[]))
    assert (default_per_account(20_000), default_per_account(10), default_per_account(1)) == (8000, 4, 1)
    sc = StreamClass(svc, per_replica=100, per_token=2, per_account=3)
    assert StreamClass(svc, per_replica=100).per_account == 40

    def lease(p: Principal):
        one = sc.enter()
        try:
            one.bind(p)
        except ServiceError as e:
            one.close()
            return e.code
        return one

    a = [Principal(workspace="w", account="alpha", token_id=f"a{i}") for i in range(3)]
    held = [lease(a[0]), lease(a[0]), lease(a[1])]
    assert lease(a[0]) == "too_many_long_polls"  # the token's cap first
    assert lease(a[2]) == "too_many_account_streams"
    other = lease(Principal(workspace="w", account="bravo", token_id="b0"))
    assert not isinstance(other, str)
    root = [lease(Principal(workspace=None, token_id=f"r{i}")) for i in range(2)]
    static = lease(Principal(workspace="w"))  # a static token: no account, the root's share
    assert not isinstance(static, str)
    assert lease(Principal(workspace=None, token_id="r9")) == "too_many_account_streams"
    held[2].close()
    held[2].close()  # idempotent
    last = lease(a[2])
    assert not isinstance(last, str)
    assert lease(a[1]) == "too_many_account_streams"
    for one in [*held, last, other, *root, static]:
        one.close()
    assert sc.open == 0 and sc._per_account == {} and sc._per_key == {}
