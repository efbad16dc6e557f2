"""One token's heavy reads against a real ``memfuse serve`` (attack 16 F4): 16 keep-alive
connections of one token each asking a 1000-record page with content in a loop, well within
its share of the request slots, must not take the CPU from every other client. The reads the
app works on at once are capped per token and in all, and a slot that frees goes to each
waiting token in turn (``memfuse.server.readslots``), so another token asking the same
heavy reads gets about as many answered as the flooding token, and probes stay fast.

And ``ReadSlots`` itself: caps, the turn between tokens, a cancelled wait.
"""
from __future__ import annotations

import statistics
import time

import h11
import httpx
import pytest
import trio

from memfuse.server.readslots import ReadSlots
from mountutil import stop
from test_hostile import _auth, admin_client, start

pytestmark = pytest.mark.timeout(180)

N_RECORDS = 150
RECORD = "word " * 4000  # 20 KB
HEAVY = "/v1/stores/{store}/records?limit=1000&content=true"
FLOOD = 16  # the flooding token's connections (its share of the slots: 32)


async def _workspace(url: str, name: str) -> str:
    """A workspace ``name`` with its store ``name`` of ``N_RECORDS`` records of 20 KB; its
    token."""
    async with admin_client(url) as a:
        assert (await a.post("/v1/workspaces", json={"name": name, "default_store": False})).status_code == 201
        assert (await a.post("/v1/stores", json={"slug": name})).status_code == 201
        r = await a.put(f"/v1/workspaces/{name}/attachments/{name}", json={"access": "read_write"})
        assert r.status_code == 200, r.text
        token = (await a.post("/v1/tokens", json={"workspace": name, "name": name})).json()["token"]
    async with httpx.AsyncClient(base_url=url, headers=_auth(token), timeout=60) as c:
        async def put(i0: int) -> None:
            for i in range(i0, N_RECORDS, 8):
                r = await c.post(f"/v1/stores/{name}/records", json={"path": f"r{i:04}.md", "content": RECORD})
                assert r.status_code == 201, r.text

        async with trio.open_nursery() as n:
            for i0 in range(8):
                n.start_soon(put, i0)
    return token


async def _reader(port: int, token: str, path: str, done: list[float], stop_: trio.Event) -> None:
    """Ask ``GET path`` on one keep-alive connection in a loop until ``stop_``: the seconds of
    each 200 answer are appended to ``done`` (h11 over a raw socket: the test's own CPU stays
    small)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    conn = h11.Connection(h11.CLIENT)
    request = h11.Request(method="GET", target=path,
                          headers=[("Host", "x"), ("Authorization", f"Bearer {token}")])
    try:
        while not stop_.is_set():
            t0 = time.monotonic()
            await stream.send_all(conn.send(request) + conn.send(h11.EndOfMessage()))
            status = 0
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    piece = await stream.receive_some(1 << 20)
                    assert piece, "the server closed the connection"
                    conn.receive_data(piece)
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.EndOfMessage):
                    break
            assert status == 200, status
            done.append(time.monotonic() - t0)
            conn.start_next_cycle()
    finally:
        await stream.aclose()


async def test_one_tokens_heavy_reads_do_not_take_the_cpu_from_other_clients(tmp_path):
    s = start(tmp_path, f"sqlite:///{tmp_path / 'cp.db'}", "reads", {"header_timeout": 10})
    try:
        evil = await _workspace(s.url, "evil")
        good = await _workspace(s.url, "good")
        flood: list[float] = []
        mine: list[float] = []
        probes: list[float] = []
        stop_ = trio.Event()

        async def probe() -> None:
            async with httpx.AsyncClient(base_url=s.url, timeout=30) as c:
                while not stop_.is_set():
                    t0 = time.monotonic()
                    assert (await c.get("/healthz")).status_code == 200
                    probes.append(time.monotonic() - t0)
                    await trio.sleep(0.05)

        with trio.fail_after(120):
            async with trio.open_nursery() as n:
                for _ in range(FLOOD):
                    n.start_soon(_reader, s.port, evil, HEAVY.format(store="evil"), flood, stop_)
                await trio.sleep(2)  # the flood is under way
                flood_before = len(flood)
                for _ in range(2):  # a well-behaved client of another token: 2 at a time
                    n.start_soon(_reader, s.port, good, HEAVY.format(store="good"), mine, stop_)
                n.start_soon(probe)
                await trio.sleep(8)
                stop_.set()
        flooded = len(flood) - flood_before
        p50 = statistics.median(probes)
        print(f"flood answers {flooded}, good answers {len(mine)} (median {statistics.median(mine):.3f} s), "
              f"/healthz n={len(probes)} p50 {p50 * 1000:.1f} ms max {max(probes) * 1000:.1f} ms")
        # Fair shares of the CPU: the good token's 2 connections get about as many reads done
        # as the flood's 16 (without read slots: 2 of 18 threads, ~1/8 of the flood's).
        assert len(mine) >= 0.5 * flooded, (len(mine), flooded)
        assert len(probes) >= 10 and p50 < 0.5, (len(probes), p50)
    finally:
        stop(s.proc)


def test_read_slots_cap_each_token_and_all_and_serve_waiting_tokens_in_turn():
    order: list[str] = []

    async def main() -> None:
        slots = ReadSlots(per_key=2, total=3)
        release: dict[str, trio.Event] = {}

        async def read(key: str, name: str) -> None:
            await slots.acquire(key)
            order.append(name)
            release[name] = trio.Event()
            await release[name].wait()
            slots.release(key)

        async with trio.open_nursery() as n:
            for i in range(4):  # a1 a2 run; a3 a4 wait (a's cap)
                n.start_soon(read, "a", f"a{i + 1}")
                await trio.sleep(0.01)
            n.start_soon(read, "b", "b1")  # the third slot
            await trio.sleep(0.01)
            for i in range(2, 4):  # all 3 held: b2 b3 wait
                n.start_soon(read, "b", f"b{i}")
                await trio.sleep(0.01)
            assert order == ["a1", "a2", "b1"] and slots.running == 3 and slots.waiting == 4
            # a cancelled wait leaves its turn and holds nothing
            with trio.move_on_after(0.01):
                await slots.acquire("c")
            assert slots.waiting == 4 and slots.running == 3
            release["a1"].set()  # a's next (a3) and then b's, in turn
            await trio.sleep(0.01)
            assert order[-1] == "a3"
            release["b1"].set()
            await trio.sleep(0.01)
            assert order[-1] == "b2"
            release["a2"].set()  # a holds 1 (a3), b 1 (b2): a4's turn comes before b3's
            await trio.sleep(0.01)
            assert order[-1] == "a4"
            for name in ("a3", "b2"):
                release[name].set()
            await trio.sleep(0.01)
            assert order[-1] == "b3" and slots.waiting == 0
            for name in ("a4", "b3"):
                release[name].set()
        assert slots.running == 0 and slots.waiting == 0

    trio.run(main)
    with pytest.raises(ValueError):
        ReadSlots(per_key=0)
