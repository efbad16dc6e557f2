"""Change-feed reads per commit: do the waiters woken by one commit share one database read?

A real ``memfuse serve`` (``tests/mountutil.ControlPlane``) on an SQLite file or on PostgreSQL
(the tests' throwaway cluster, ``tests/pgutil.pg_cluster``, with ``pg_stat_statements``);
``--clients`` readers follow one store's feed with content (long-polls, ``wait=30``, re-issued
at once, or streams), each with its own ``skip_writer`` as sidecars do; one writer makes
``--writes`` record creates (550 B) in that store. ``--paced``: the writer waits, after each
create, until every reader has it (every waiter woken by one commit, at one cursor: the ideal
is one read per commit); otherwise it writes as fast as it can.

Counted over the writes (after the readers are all waiting):

- ``db_statements``: the server's ``memfuse_server_db_statements_total`` delta; the same run
  with 0 readers gives what the writes cost, so ``(S_N - S_0) / (S_1 - S_0)`` estimates the
  feed reads of N readers per commit in units of one reader's;
- ``--kill-listener-at K``: before write K the server's ``LISTEN`` connection is terminated
  (a database restart or failover as a replica sees it): the Bus stops trusting its heads
  until it reconnects (``memfuse.server.wakeups``);
- on PostgreSQL, exactly: ``pg_stat_statements`` calls of the feed's head read (``_TOPS``,
  ``... AS store_top``: one per ``FeedReads`` read, and one per own-run read) and of its rows
  read, divided by the writes.

Run ``python bench/bench_feed_share.py --db sqlite,postgres --clients 50 --writes 200``.
Loopback only; every process started here is stopped in ``finally``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import trio  # noqa: E402

from memfuse.client.api import ApiClient  # noqa: E402
from mountutil import ControlPlane  # noqa: E402


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


async def _scrape(url: str, token: str) -> tuple[float, float]:
    async with httpx.AsyncClient() as c:
        r = await c.get(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=30)
        return (_metric(r.text, "memfuse_server_db_statements_total"),
                _metric(r.text, "memfuse_server_wakeups_total"))


def _pg_reset(admin_url: str | None) -> None:
    if admin_url is None:
        return
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as c:
        c.execute("SELECT pg_stat_statements_reset()")


def _pg_counts(admin_url: str | None) -> dict[str, int]:
    if admin_url is None:
        return {}
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as c:
        rows = c.execute("SELECT query, calls FROM pg_stat_statements WHERE query ILIKE '%versions%' "
                         "AND query ILIKE 'select%' ORDER BY calls DESC").fetchall()
    out = {"heads": 0, "rows": 0}
    for q, calls in rows:
        if "store_top" in q:
            out["heads"] += calls
        elif "content" in q and "ORDER BY versions.seq" in q:
            out["rows"] += calls
    return out


def _kill_listener(admin_url: str) -> int:
    """Terminate the server's ``LISTEN`` connection (the Bus reconnects after its backoff):
    the backends terminated."""
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as c:
        return len(c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                             "WHERE query ILIKE 'LISTEN%' AND pid <> pg_backend_pid()").fetchall())


async def _run(cp: ControlPlane, clients: int, writes: int, mode: str, paced: bool,
               pg_admin: str | None, kill_at: int | None = None) -> dict:
    url, token = cp.url, cp.admin_token
    async with ApiClient(url, token) as admin:
        await admin.create_store("s")
        for i in range(3):  # some content before the readers come
            await admin.create_record("s", f"pre{i}.md", "x" * 550)
        start = (await admin.changes("s", 0)).seq
    seen = [0] * clients  # changes each reader received
    waiting = [False] * clients
    done = trio.Event()
    headers = {"Authorization": f"Bearer {token}"}

    async def longpoll(i: int, c: httpx.AsyncClient) -> None:
        cursor = start
        while not done.is_set():
            waiting[i] = True
            r = await c.get(f"{url}/v1/stores/s/changes", headers=headers, timeout=60,
                            params={"after": cursor, "wait": 30, "content": "true", "skip_writer": f"r{i}"})
            waiting[i] = False
            r.raise_for_status()
            page = r.json()
            seen[i] += len(page["changes"])
            cursor = page["seq"]

    async def stream(i: int, c: httpx.AsyncClient) -> None:
        cursor = start
        while not done.is_set():
            async with c.stream("GET", f"{url}/v1/stores/s/changes", headers=headers, timeout=60,
                                params={"after": cursor, "stream": "true", "content": "true",
                                        "skip_writer": f"r{i}"}) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line:
                        continue
                    page = json.loads(line)
                    waiting[i] = True
                    seen[i] += len(page.get("changes", ()))
                    cursor = page.get("seq", cursor)
                    if done.is_set():
                        return

    reader = longpoll if mode == "longpoll" else stream
    result: dict = {"clients": clients, "writes": writes, "mode": mode, "paced": paced}
    async with trio.open_nursery() as nursery:
        conns = [httpx.AsyncClient(limits=httpx.Limits(max_connections=1)) for _ in range(clients)]
        for i, c in enumerate(conns):
            nursery.start_soon(reader, i, c)
        with trio.fail_after(60):
            while not all(waiting):
                await trio.sleep(0.05)
        await trio.sleep(0.5)  # every reader subscribed
        s0, w0 = await _scrape(url, token)
        _pg_reset(pg_admin)
        t0 = time.monotonic()
        lag_max = 0.0
        async with ApiClient(url, token) as writer:
            for n in range(writes):
                if kill_at is not None and n == kill_at and pg_admin is not None:
                    result["listeners_killed"] = _kill_listener(pg_admin)
                await writer.create_record("s", f"w{n}.md", f"write {n}\n" + "y" * 540)
                if paced:
                    tw = time.monotonic()
                    with trio.fail_after(30):
                        while any(s < n + 1 for s in seen):
                            await trio.sleep(0.002)
                    lag_max = max(lag_max, time.monotonic() - tw)
        with trio.fail_after(60):
            while any(s < writes for s in seen):
                await trio.sleep(0.01)
        elapsed = time.monotonic() - t0
        pg = _pg_counts(pg_admin)
        s1, w1 = await _scrape(url, token)
        done.set()
        nursery.cancel_scope.cancel()
    result.update(db_statements=s1 - s0, wakeups=w1 - w0, seconds=round(elapsed, 2),
                  slowest_feed_s=round(lag_max, 3), seen_min=min(seen) if seen else None)
    if pg:
        result.update(pg_head_reads=pg["heads"], pg_rows_reads=pg["rows"],
                      pg_head_reads_per_commit=round(pg["heads"] / writes, 2))
    return result


def _one(db: str, base_pg: str | None, clients: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="feedshare-") as tmp:
        pg_admin = None
        db_url = None
        if db == "postgres":
            import psycopg

            assert base_pg is not None
            name = f"fs_{clients}_{int(time.time() * 1000) % 10**9}"
            admin = base_pg.replace("memfuse:memfuse@", "postgres@").rsplit("/", 1)[0] + "/postgres"
            with psycopg.connect(admin, autocommit=True) as c:
                c.execute(f'CREATE DATABASE "{name}" OWNER memfuse')
            pg_admin = admin.rsplit("/", 1)[0] + f"/{name}"
            with psycopg.connect(pg_admin, autocommit=True) as c:
                c.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            db_url = base_pg.rsplit("/", 1)[0] + f"/{name}"
        cp = ControlPlane(Path(tmp), db_url=db_url).start()
        try:
            r = trio.run(_run, cp, clients, args.writes, args.mode, args.paced, pg_admin, args.kill_listener_at)
        finally:
            cp.stop()
        r["db"] = db
        return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", default="sqlite,postgres")
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--writes", type=int, default=200)
    ap.add_argument("--mode", choices=("longpoll", "stream"), default="longpoll")
    ap.add_argument("--paced", action="store_true")
    ap.add_argument("--kill-listener-at", type=int, default=None,
                    help="PostgreSQL: terminate the server's LISTEN connection before this write")
    ap.add_argument("--no-baseline", action="store_true", help="skip the 0- and 1-reader runs")
    args = ap.parse_args()
    results = []
    with contextlib.ExitStack() as stack:
        base_pg = None
        if "postgres" in args.db:
            from pgutil import pg_cluster

            base_pg = stack.enter_context(pg_cluster(settings=("shared_preload_libraries=pg_stat_statements",)))
        for db in args.db.split(","):
            counts = [args.clients] if args.no_baseline else [0, 1, args.clients]
            runs = {n: _one(db, base_pg, n, args) for n in counts}
            for r in runs.values():
                print(json.dumps(r), flush=True)
                results.append(r)
            if not args.no_baseline:
                s0, s1, sn = (runs[n]["db_statements"] for n in (0, 1, args.clients))
                est = (sn - s0) / (s1 - s0) if s1 > s0 else float("nan")
                print(f"{db}: N={args.clients} readers cost {est:.2f}x one reader's feed statements "
                      f"({(s1 - s0) / args.writes:.2f} statements/commit for 1 reader)", flush=True)


if __name__ == "__main__":
    main()
