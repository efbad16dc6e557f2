"""The change feed leaves out one sidecar's own versions by the sidecar instance that wrote
them (``Memfuse-Writer``, kept on the version: ``skip_writer``), not by the actor: two
sidecars of one workspace given the same ``--actor`` see each other's writes (attack 16 F8).
A page and a long-poll (woken by the other writer's commit, not by its own); the stream
(the same shared read and wake-ups) is driven by the mounts of ``test_two_mounts_one_actor``.

Runs on in-memory SQLite, and on PostgreSQL through ``tests/test_postgres.py``.
"""
from __future__ import annotations

import httpx
import pytest
import trio

from memfuse.client import ApiClient
from memfuse.server.app import create_app
from pgutil import fresh_db_url

ADMIN = "feedw-admin-token"
WS = "feedw-ws-token"
BASE = "http://test"


@pytest.fixture
async def app():
    with fresh_db_url() as url:
        app = create_app(url, static_tokens={ADMIN: None, WS: "ws"}, faces=False)
        async with ApiClient(BASE, ADMIN, transport=httpx.ASGITransport(app=app)) as admin:
            await admin.create_workspace("ws", default_store=False)
            await admin.create_store("s")
            await admin.attach("ws", "s", access="read_write")
        yield app
        app.state.service.db.dispose()


def _sidecar(app, writer: str | None) -> ApiClient:
    """A client as a sidecar of ``ws`` named ``pod`` (the same actor for every one) that
    sends ``writer`` on its writes (None: an older sidecar, without one)."""
    c = ApiClient(BASE, WS, transport=httpx.ASGITransport(app=app), instance="pod")
    if writer is not None:
        c.set_writer(writer)
    return c


async def test_two_writers_of_one_actor_see_each_others_versions_not_their_own(app):
    async with _sidecar(app, "w1") as one, _sidecar(app, "w2") as two, _sidecar(app, None) as old:
        a = await one.create_record("s", "a.md", "from one\n", idempotency_key="k1")
        b = await two.create_record("s", "b.md", "from two\n", idempotency_key="k2")
        c = await old.create_record("s", "c.md", "from old\n", idempotency_key="k3")
        assert a.updated_by == b.updated_by == c.updated_by == "ws:ws/pod"  # one actor
        actor = a.updated_by
        seen = {w: [ch.record.path for ch in (await cl.changes("s", 0, skip_actor=actor, skip_writer=w)).changes]
                for w, cl in (("w1", one), ("w2", two))}
        assert seen == {"w1": ["b.md", "c.md"], "w2": ["a.md", "c.md"]}
        # skip_actor alone (an older sidecar) leaves out the versions written without a writer
        page = await old.changes("s", 0, skip_actor=actor)
        assert [ch.record.path for ch in page.changes] == ["a.md", "b.md"]
        assert page.seq == c.seq


async def test_a_long_poll_is_woken_by_the_other_writer_of_its_actor_not_by_its_own(app):
    async with _sidecar(app, "w1") as one, _sidecar(app, "w2") as two:
        start = (await one.changes("s", 0)).seq
        got: list = []

        async def poll() -> None:
            got.append(await one.changes("s", start, wait=20, skip_actor="ws:ws/pod", skip_writer="w1"))

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(poll)
                await trio.sleep(0.3)
                await one.create_record("s", "own.md", "mine\n", idempotency_key="o1")
                await trio.sleep(0.5)
                assert not got, "woken by its own write"
                await two.create_record("s", "other.md", "theirs\n", idempotency_key="t1")
        assert [ch.record.path for ch in got[0].changes] == ["other.md"]

