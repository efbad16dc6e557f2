"""A refused write lets go of its request (attack23 HIGH 2).

``WriterThread.run`` unwrapped the writer thread's outcome from its slot: an exception raised
there (a create answered 409 because the path exists, an update answered 412 for a stale
``If-Match``) carried ``run``'s frame in its traceback, and that frame's slot held the outcome
holding the exception. The cycle kept the request's body and parsed content alive until the
cyclic collector ran, which ``memfuse serve``'s thresholds (``serve.tune_gc``) make rare: one
token's 40 creates of 4 MiB at a taken path grew the server by ~500 MiB, for good.

A real ``memfuse serve`` (SQLite): 30 creates of 4 MiB at a taken path (409), then 30 updates
of 4 MiB with a stale ``If-Match`` (412): its RSS grows by far less than one of those bodies
a request (it grew by ~12 MiB a request before).
"""
from __future__ import annotations

import pytest

from test_feed_cache import MIB, _auth, admin_client, start  # noqa: F401 (MIB, the helpers)
from test_hostile import LIMITS
from mountutil import stop
from pgutil import fresh_db_url

import httpx

pytestmark = pytest.mark.timeout(180)


async def test_refused_writes_do_not_keep_their_bodies(tmp_path):
    with fresh_db_url(f"sqlite:///{tmp_path / 'cp.db'}") as db:
        s = start(tmp_path, db, "serve", {**LIMITS, "max_body": 48 * MIB})
        try:
            async with admin_client(s.url) as a:
                assert (await a.post("/v1/workspaces", json={"name": "ws", "default_store": False})).status_code == 201
                r = await a.post("/v1/stores", json={"slug": "s", "max_record_bytes": 6 * MIB,
                                                     "max_store_bytes": 1 << 34})
                assert r.status_code == 201, r.text
                r = await a.put("/v1/workspaces/ws/attachments/s", json={"access": "read_write"})
                assert r.status_code == 200, r.text
                tok = (await a.post("/v1/tokens", json={"workspace": "ws", "name": "w"})).json()["token"]
            async with httpx.AsyncClient(base_url=s.url, headers=_auth(tok), timeout=60) as c:
                r = await c.post("/v1/stores/s/records", json={"path": "x.md", "content": "hello\n"})
                assert r.status_code == 201, r.text
                rid = r.json()["id"]

                def body(i: int) -> str:
                    return f"{i:08d}" + "abcdefghijklmnop\n" * ((4 * MIB) // 17)

                for i in range(2):  # the process's one-time growth (buffers, caches)
                    await c.post("/v1/stores/s/records", json={"path": "x.md", "content": body(i)})
                base = s.rss()
                for i in range(30):
                    r = await c.post("/v1/stores/s/records", json={"path": "x.md", "content": body(i)})
                    assert r.status_code == 409, r.text
                stale = {"If-Match": '"' + "0" * 64 + '"'}
                for i in range(30):
                    r = await c.put(f"/v1/stores/s/records/{rid}", json={"content": body(i)}, headers=stale)
                    assert r.status_code == 412, r.text
                grown = s.rss() - base
            print(f"serve RSS +{grown / MIB:.1f} MiB after 60 refused writes of 4 MiB")
            assert grown < 64 * MIB  # kept, they held ~8 MiB each (body and content): ~500 MiB
        finally:
            stop(s.proc)
