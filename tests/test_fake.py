"""The in-process fake control plane: each injected fault is observable, and applied or not
applied as documented."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import trio

from memfuse.fake import RACE_MARKER, FakeControlPlane
from memfuse.server.changes import MAX_WAIT_SECONDS
from test_api import WOKEN


async def _count(fake: FakeControlPlane, store: str = "default") -> int:
    # faults may be on: check through a transport without them
    http = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=fake.app), base_url=fake.base_url,
        headers={"Authorization": f"Bearer {fake.admin_token}"},
    )
    async with http:
        r = await http.get(f"/v1/stores/{store}/records")
        assert r.status_code == 200, r.text
        return len(r.json()["records"])


@pytest.fixture
async def fake():
    f = FakeControlPlane(seed=0)
    yield f
    await f.aclose()


async def test_setup_and_plain_use(fake: FakeControlPlane):
    token = await fake.setup("ws", stores=("default", "notes"), access="read_write")
    assert token == fake.token_for("ws")
    async with fake.client(token) as http:
        r = await http.get("/v1/workspaces/ws/attachments")
        assert [a["store"]["slug"] for a in r.json()] == ["default", "notes"]
        r = await http.post("/v1/stores/default/records", json={"path": "a.md", "content": "x"})
        assert r.status_code == 201
        assert r.json()["updated_by"] == "ws:ws/api"
    # setup is repeatable; read_only is honoured
    ro = await fake.setup("reader", stores=("default",), access="read_only")
    async with fake.client(ro) as http:
        r = await http.post("/v1/stores/default/records", json={"path": "b.md", "content": "x"})
        assert r.status_code == 403 and r.json()["code"] == "read_only"
    assert fake.counters.requests == 3 and fake.counters.forwarded == 3


async def test_latency(fake: FakeControlPlane):
    token = await fake.setup()
    fake.faults.latency = 0.2
    async with fake.client(token) as http:
        t0 = time.monotonic()
        r = await http.get("/v1/workspaces/ws/attachments")
        assert r.status_code == 200 and time.monotonic() - t0 >= 0.2
    assert fake.counters.delayed == 1


async def test_error_rate_answers_503_without_applying(fake: FakeControlPlane):
    token = await fake.setup()
    fake.faults.error_rate = 1.0
    async with fake.client(token) as http:
        for i in range(3):
            r = await http.post("/v1/stores/default/records", json={"path": f"{i}.md", "content": "x"})
            assert r.status_code == 503 and r.json()["code"] == "unavailable"
            assert r.headers["content-type"] == "application/problem+json"
    assert fake.counters.errors_503 == 3 and fake.counters.forwarded == 0
    assert await _count(fake) == 0


async def test_rate_429_with_retry_after(fake: FakeControlPlane):
    token = await fake.setup()
    fake.faults.rate_429 = 1.0
    async with fake.client(token) as http:
        r = await http.post("/v1/stores/default/records", json={"path": "a.md", "content": "x"})
        assert r.status_code == 429 and r.headers["retry-after"] == "0"
    assert fake.counters.rate_limited_429 == 1
    assert await _count(fake) == 0


async def test_drop_applies_but_loses_the_response(fake: FakeControlPlane):
    token = await fake.setup()
    fake.faults.drop_rate = 1.0
    async with fake.client(token) as http:
        with pytest.raises(httpx.ReadError):
            await http.post(
                "/v1/stores/default/records", json={"path": "a.md", "content": "x"}, headers={"Idempotency-Key": "k1"}
            )
        assert fake.counters.dropped == 1
        assert await _count(fake) == 1  # it was applied
        fake.faults.drop_rate = 0.0
        # the retry with the same key replays instead of applying twice
        r = await http.post(
            "/v1/stores/default/records", json={"path": "a.md", "content": "x"}, headers={"Idempotency-Key": "k1"}
        )
        assert r.status_code == 201 and r.headers["idempotent-replayed"] == "true"
    assert await _count(fake) == 1


async def test_outage(fake: FakeControlPlane):
    token = await fake.setup()
    fake.faults.outage = True
    async with fake.client(token) as http:
        with pytest.raises(httpx.ConnectError):
            await http.post("/v1/stores/default/records", json={"path": "a.md", "content": "x"})
        assert fake.counters.outage_refused == 1 and fake.counters.forwarded == 0
        assert await _count(fake) == 0
        fake.faults.outage = False
        r = await http.post("/v1/stores/default/records", json={"path": "a.md", "content": "x"})
        assert r.status_code == 201


async def test_precondition_race(fake: FakeControlPlane):
    token = await fake.setup()
    async with fake.client(token) as http:
        r = await http.post("/v1/stores/default/records", json={"path": "a.md", "content": "base"})
        rec = r.json()
        url = f"/v1/stores/default/records/{rec['id']}"
        fake.faults.precondition_race = 1
        # a PUT without If-Match is not raced
        r = await http.put(url, json={"content": "base"})
        assert r.status_code == 200 and fake.counters.races == 0
        r = await http.put(url, json={"content": "mine"}, headers={"If-Match": f'"{rec["sha256"]}"'})
        assert r.status_code == 412 and r.json()["code"] == "precondition_failed"
        assert fake.counters.races == 1 and fake.faults.precondition_race == 0
        r = await http.get(url)
        latest = r.json()
        assert latest["content"] == "base" + RACE_MARKER and latest["version"] == 2
        assert latest["updated_by"] != "ws:ws/api"
        # the next one is not raced any more
        r = await http.get(url)
        r = await http.put(url, json={"content": "mine"}, headers={"If-Match": r.headers["etag"]})
        assert r.status_code == 200
        vs = (await http.get(f"{url}/versions")).json()
        assert [v["operation"] for v in vs] == ["created", "modified", "modified"]
        assert fake.counters.races == 1


async def test_seed_makes_faults_repeatable():
    async def pattern(seed):
        f = FakeControlPlane(seed=seed)
        token = await f.setup()
        f.faults.error_rate = 0.5
        out = []
        async with f.client(token) as http:
            for _ in range(20):
                out.append((await http.get("/v1/workspaces/ws/attachments")).status_code)
        await f.aclose()
        return out

    a, b = await pattern(7), await pattern(7)
    assert a == b and 503 in a and 200 in a


def test_transport_works_under_asyncio():
    async def main():
        f = FakeControlPlane(seed=1)
        token = await f.setup()
        f.faults.latency = 0.01
        async with f.client(token) as http:
            r = await http.post("/v1/stores/default/records", json={"path": "a.md", "content": "x"})
            assert r.status_code == 201
            # long-poll wake-up works on asyncio too
            seq = r.json()["seq"]
            result = {}

            async def poll():
                r = await http.get("/v1/stores/default/changes", params={"after": seq, "wait": 20})
                result["page"] = r.json()

            task = asyncio.create_task(poll())
            await asyncio.sleep(0.2)
            await http.post("/v1/stores/default/records", json={"path": "b.md", "content": "y"})
            await asyncio.wait_for(task, 5)
            assert [c["record"]["path"] for c in result["page"]["changes"]] == ["b.md"]
        await f.aclose()
        return f.counters.delayed

    assert asyncio.run(main()) == 3


async def test_long_poll_through_fake_under_trio(fake: FakeControlPlane):
    token = await fake.setup()
    async with fake.client(token) as http:
        result = {}

        async def poll():
            r = await http.get("/v1/stores/default/changes", params={"after": 0, "wait": MAX_WAIT_SECONDS})
            result["page"], result["t"] = r.json(), time.monotonic()

        with trio.fail_after(MAX_WAIT_SECONDS + 30):
            async with trio.open_nursery() as n:
                n.start_soon(poll)
                await trio.sleep(0.2)
                t0 = time.monotonic()
                await http.post("/v1/stores/default/records", json={"path": "a.md", "content": "x"})
        assert result["t"] - t0 < WOKEN, result["t"] - t0
        assert len(result["page"]["changes"]) == 1
