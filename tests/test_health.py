"""The control plane's probes: ``/healthz`` (liveness) never touches the database; ``/readyz``
(readiness) answers 200 only while the database answers, 503 problem otherwise and once
shutdown has begun. Runs on SQLite and, under MEMFUSE_TEST_DB_URL, PostgreSQL."""
from __future__ import annotations

import httpx
import pytest
from sqlalchemy import event
from sqlalchemy.exc import OperationalError

from memfuse.server.app import PROBLEM_JSON, create_app
from pgutil import fresh_db_url


@pytest.fixture
async def app(tmp_path):
    with fresh_db_url(f"sqlite:///{tmp_path / 'h.db'}") as url:
        app = create_app(url)
        yield app
        app.state.service.db.dispose()


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://cp")


async def test_healthz_never_touches_the_database(app):
    statements: list[str] = []
    engine = app.state.service.db.engine
    listener = lambda *a: statements.append(a[2])  # noqa: E731 — (conn, cursor, statement, ...)
    event.listen(engine, "before_cursor_execute", listener)
    try:
        async with _client(app) as c:
            for _ in range(3):
                r = await c.get("/healthz")
                assert r.status_code == 200 and r.json() == {"ok": True}
            assert statements == []
            r = await c.get("/readyz")
            assert r.status_code == 200 and r.json() == {"ready": True}
            assert "SELECT 1" in statements
    finally:
        event.remove(engine, "before_cursor_execute", listener)


async def test_readyz_fails_while_the_database_fails_and_when_shutting_down(app, monkeypatch, caplog):
    svc = app.state.service

    def broken():
        raise OperationalError("SELECT 1", {}, Exception("connection refused: password=hunter2"))

    async with _client(app) as c:
        monkeypatch.setattr(svc.db, "read_conn", broken)
        r = await c.get("/readyz")
        assert r.status_code == 503 and r.headers["content-type"] == PROBLEM_JSON
        assert r.json()["code"] == "database_unavailable" and r.headers["retry-after"] == "1"
        assert (await c.get("/healthz")).status_code == 200  # liveness is not the database's
        assert "readiness: database unavailable" in caplog.text and "hunter2" not in caplog.text
        monkeypatch.undo()
        assert (await c.get("/readyz")).status_code == 200
        svc.closing = True
        r = await c.get("/readyz")
        assert r.status_code == 503 and r.json()["code"] == "shutting_down"
        assert (await c.get("/healthz")).status_code == 200


async def test_metrics_are_rendered_off_the_event_loop_and_shared_by_the_scrapes_that_wait(app, monkeypatch):
    """``GET /metrics`` is rendered on a worker thread, one render at a time, each shared by
    the scrapes that arrived before it started (attack 12 A5: a flood of anonymous scrapes on
    32 keep-alive connections held the event loop ~20 ms per answer and stalled every
    authenticated request 4-6 s); a scrape still sees every count made before it."""
    import threading
    import time

    import trio

    metrics = app.front.metrics
    real = metrics.render
    renders: list[int] = []

    def slow() -> bytes:
        renders.append(threading.get_ident())
        time.sleep(0.2)  # as a render of a big registry holds its thread
        return real()

    monkeypatch.setattr(metrics, "render", slow)
    bodies: list[str] = []
    async with _client(app) as c:
        async def scrape() -> None:
            r = await c.get("/metrics")
            assert r.status_code == 200
            bodies.append(r.text)

        with trio.fail_after(30):
            async with trio.open_nursery() as n:
                for _ in range(20):
                    n.start_soon(scrape)
        assert len(bodies) == 20 and all("memfuse_server_requests" in b for b in bodies)
        assert 1 <= len(renders) <= 2, renders  # one wave: the first render, and one for the rest
        assert threading.get_ident() not in renders  # never on the event loop
        # a scrape after a render finished gets a new one: what was counted since is in it
        metrics.requests.labels("2xx").inc(1000)
        before = len(renders)
        text = (await c.get("/metrics")).text
        assert len(renders) == before + 1
        line = next(x for x in text.splitlines() if x.startswith('memfuse_server_requests_total{status="2xx"}'))
        assert float(line.split()[1]) >= 1000
