"""Byte-order paging of a big store on PostgreSQL, before and after the ``C``-collation index.

The control plane pages a store's records in byte order of the path on both databases: on
PostgreSQL its queries order by ``path COLLATE "C"`` (the snapshot ``GET
/v1/stores/{s}/records?cursor=``, ``search_records``, ``GET /v1/stores/{s}/search`` and the
tree of the console). PostgreSQL uses an index for such an ORDER BY or range only when the
index's collation is the expression's; a database whose default collation is not ``C`` (as
production databases usually are: ``en_US.UTF-8``, ``C.UTF-8``, ICU) needs an index in
``"C"`` (revision ``0005_records_path_bytes``).

What it does, in one throwaway cluster (``tests/pgutil.py``):

1. creates a database with ``--locale`` (default ``C.UTF-8`` of libc; ``icu:en-US`` for an
   ICU collation) and migrates it to ``--before`` (default ``0004_record_attributes``, the
   schema without the index);
2. loads a store of ``--records`` records (default 100,000; paths like the sidecar bench's:
   10,000 in ``flat/``, the others 1,000 per directory ``dNNN/``; 200–2,000 bytes each) and
   a second store of ``--other`` records, then ``ANALYZE``;
3. measures: ``EXPLAIN (ANALYZE, BUFFERS)`` of the statements the service really sends
   (captured from the engine) for a snapshot page at the start, middle and end of the store,
   a ``search_records`` page, a ``GET /search`` page and a tree listing; then a full snapshot
   (pages of ``--page`` records with content) through the API (ASGI, in process);
4. upgrades to head (timing the index build), ``ANALYZE``, and measures again.

Prints a summary and writes ``--json``. Figures are wall times on a shared machine: compare
the two halves of one run (the plans and the buffers read do not depend on load).

    .venv/bin/python bench/bench_pg_paging.py --records 100000 --json bench/results-pg-paging.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for p in (str(REPO), str(REPO / "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

SLUG, OTHER = "big", "other"
ADMIN = "bench-admin-token"


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_database(admin_url: str, name: str, locale: str) -> str:
    """CREATE DATABASE ``name`` with ``locale`` (``icu:LOCALE`` for ICU); returns its datcollate."""
    from sqlalchemy import create_engine, text

    eng = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with eng.connect() as c:
            if locale.startswith("icu:"):
                c.exec_driver_sql(f"CREATE DATABASE {name} OWNER memfuse TEMPLATE template0 LOCALE_PROVIDER icu "
                                  f"ICU_LOCALE '{locale[4:]}' LOCALE 'C.UTF-8'")
            else:
                c.exec_driver_sql(f"CREATE DATABASE {name} OWNER memfuse TEMPLATE template0 "
                                  f"LC_COLLATE '{locale}' LC_CTYPE '{locale}'")
            row = c.execute(text("SELECT datcollate, datlocprovider, "
                                 "(SELECT setting FROM pg_settings WHERE name = 'server_version') "
                                 "FROM pg_database WHERE datname = :n"), {"n": name}).one()
            return f"datcollate={row[0]} provider={row[1]} server={row[2]}"
    finally:
        eng.dispose()


def populate(db, slug: str, n: int, seed: int) -> None:
    """Store ``slug`` with ``n`` records (and one version each) inserted directly."""
    from sqlalchemy import insert, update

    from memfuse.models import sha256_hex
    from memfuse.server.db import RecordRow, StoreRow, VersionRow, utcnow

    rng = random.Random(seed)
    now = utcnow()
    words = ("memory", "agent", "notes", "review", "cache", "design", "paging")
    with db.write_conn() as conn:
        conn.execute(insert(StoreRow.__table__).values(
            slug=slug, description="", default_type="project", max_record_bytes=1 << 20,
            max_store_bytes=1 << 40, max_records=10_000_000, created_at=now, usage_bytes=0, record_count=0))
        total = 0
        for k in range(0, n, 5000):
            recs, vers = [], []
            for i in range(k, min(n, k + 5000)):
                path = f"flat/note-{i:06d}.md" if i < 10_000 else f"d{i // 1000:03d}/note-{i:06d}.md"
                size = rng.randint(200, 2000)
                text = f"# note {i}\n" + " ".join(rng.choice(words) for _ in range(size // 7))
                if i % 100 == 0:
                    text += " zebrafish"
                text = text[:size] + "\n" if i % 100 else text + "\n"
                raw = text.encode()
                rid = str(uuid.UUID(int=rng.getrandbits(128)))
                sha = sha256_hex(raw)
                recs.append(dict(id=rid, store=slug, path=path, type="project", version=1, sha256=sha,
                                 size=len(raw), content=text, deleted=False, created_at=now, updated_at=now,
                                 updated_by="admin:bench", seq=0))
                vers.append(dict(record_id=rid, store=slug, version=1, operation="created", path=path,
                                 old_path=None, type="project", sha256=sha, size=len(raw), content=text,
                                 created_at=now, actor="admin:bench", redacted=False))
                total += len(raw)
            conn.execute(insert(RecordRow.__table__), recs)
            conn.execute(insert(VersionRow.__table__), vers)
        conn.exec_driver_sql("UPDATE records SET seq = v.seq FROM versions v WHERE v.record_id = records.id "
                             "AND records.store = %(s)s", {"s": slug})
        conn.execute(update(StoreRow.__table__).where(StoreRow.__table__.c.slug == slug)
                     .values(usage_bytes=total, record_count=n))


class Capture:
    """The statements the engine sends while ``on`` (SELECTs on ``records`` only)."""

    def __init__(self, engine) -> None:
        from sqlalchemy import event

        self.on = False
        self.seen: list[tuple[str, dict]] = []

        @event.listens_for(engine, "before_cursor_execute")
        def _grab(conn, cursor, statement, parameters, context, executemany):  # noqa: ARG001
            if self.on and statement.lstrip().upper().startswith("SELECT") and "FROM records" in statement \
                    and "max(versions.seq)" not in statement:
                self.seen.append((statement, dict(parameters or {})))

    def take(self, fn) -> list[tuple[str, dict]]:
        self.seen, self.on = [], True
        try:
            fn()
        finally:
            self.on = False
        return self.seen


def explain(db, stmt: str, params: dict) -> dict:
    """EXPLAIN (ANALYZE, BUFFERS) of one statement: its text plan and a summary."""
    with db.read_conn() as conn:
        text_plan = [r[0] for r in conn.exec_driver_sql("EXPLAIN (ANALYZE, BUFFERS) " + stmt, params)]
        plan = conn.exec_driver_sql("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + stmt, params).scalar()
    root = plan[0]
    nodes: list[dict] = []

    def walk(n):
        nodes.append(n)
        for c in n.get("Plans", []):
            walk(c)

    walk(root["Plan"])
    scans = [n for n in nodes if "Scan" in n["Node Type"]]
    top = root["Plan"]
    return {
        "nodes": [n["Node Type"] + (f" using {n['Index Name']}" if "Index Name" in n else "") for n in nodes],
        "sort": any(n["Node Type"] in ("Sort", "Incremental Sort") for n in nodes),
        "rows_returned": top["Actual Rows"],
        # rows the scans produced + those their filters dropped (both per loop: parallel workers)
        "rows_read": sum((n["Actual Rows"] + n.get("Rows Removed by Filter", 0)) * n.get("Actual Loops", 1)
                         for n in scans),
        "buffers": top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0),
        "ms": root["Execution Time"],
        "text": text_plan,
    }


def measure(db, svc, cursors: dict[str, str | None], label: str) -> dict:
    """The plans of the queries under test (see module doc)."""
    from memfuse.server.service import Principal

    p = Principal(workspace=None, name="bench")
    cap = Capture(db.engine)
    out: dict = {}
    for where, cur in cursors.items():
        [(stmt, params)] = cap.take(lambda: svc.list_records_json(p, SLUG, cursor=cur, limit=1000, with_content=True))
        out[f"snapshot page ({where})"] = explain(db, stmt, params)
    mid = cursors["middle"]
    [(stmt, params)] = cap.take(lambda: svc.search_records(p, SLUG, path_contains="note-05", cursor=mid, limit=100))
    out["search_records (path_contains, middle)"] = explain(db, stmt, params)
    [(stmt, params)] = cap.take(lambda: svc.search(p, SLUG, "zebrafish", cursor=mid, limit=20))
    out["GET /search (content, middle)"] = explain(db, stmt, params)
    [(stmt, params)] = cap.take(lambda: svc.search(p, SLUG, "zebrafish", prefix="d050", limit=20))
    out["GET /search (prefix d050)"] = explain(db, stmt, params)
    tree = cap.take(lambda: svc.tree(p, SLUG, "", depth=2))
    steps = [explain(db, s, pr) for s, pr in tree]
    out[f"tree step (1st of {len(tree)})"] = steps[0]
    out[f"tree step (2nd of {len(tree)})"] = steps[1] if len(steps) > 1 else steps[0]
    out["tree (all steps)"] = {"steps": len(steps), "ms": sum(s["ms"] for s in steps),
                               "rows_read": sum(s["rows_read"] for s in steps),
                               "sort": any(s["sort"] for s in steps)}
    say(f"{label}:")
    for k, v in out.items():
        print(f"  {k:40s} {v['ms']:9.2f} ms  rows read {v['rows_read']:>7}  sort={v['sort']}  "
              + (" > ".join(v["nodes"]) if "nodes" in v else ""), flush=True)
    return out


def full_snapshot(url: str, page: int) -> dict:
    """Every page of the big store with content through the API (httpx over ASGI)."""
    import httpx
    import trio

    from memfuse.server.app import create_app

    app = create_app(url, static_tokens={ADMIN: None}, schema="none")

    async def run():
        times: list[float] = []
        n = 0
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench",
                                     headers={"Authorization": f"Bearer {ADMIN}"}, timeout=600) as c:
            cursor = None
            t0 = time.perf_counter()
            while True:
                params = {"limit": page, "content": "true"}
                if cursor:
                    params["cursor"] = cursor
                t = time.perf_counter()
                r = await c.get(f"/v1/stores/{SLUG}/records", params=params)
                r.raise_for_status()
                body = r.json()
                times.append(time.perf_counter() - t)
                n += len(body["records"])
                cursor = body.get("next_cursor")
                if not cursor:
                    break
            total = time.perf_counter() - t0
        return {"records": n, "pages": len(times), "total_s": round(total, 2),
                "first_page_ms": round(times[0] * 1000, 1),
                "middle_page_ms": round(times[len(times) // 2] * 1000, 1),
                "last_page_ms": round(times[-1] * 1000, 1)}

    try:
        return trio.run(run)
    finally:
        app.state.service.db.dispose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--other", type=int, default=10_000, help="records of a second store")
    ap.add_argument("--page", type=int, default=1000)
    ap.add_argument("--locale", default="C.UTF-8", help="database locale (libc), or icu:LOCALE")
    ap.add_argument("--before", default="0004_record_attributes", help="revision measured first")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from sqlalchemy.engine import make_url

    from memfuse.server import schema
    from memfuse.server.db import Database
    from memfuse.server.records import _encode_cursor
    from memfuse.server.service import Service
    from pgutil import pg_cluster

    res: dict = {"meta": {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                          "commit": subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                                   capture_output=True, text=True).stdout.strip(),
                          "loadavg_start": os.getloadavg(), "args": {k: str(v) for k, v in vars(args).items()}}}
    with pg_cluster() as base:
        u = make_url(base)
        admin = u.set(username="postgres", password=None, database="postgres").render_as_string(False)
        admin = admin.replace("postgresql://", "postgresql+psycopg://", 1)
        res["meta"]["database"] = make_database(admin, "paging", args.locale)
        say(res["meta"]["database"])
        url = u.set(database="paging").render_as_string(False)
        db = Database(url, schema="none")
        schema.upgrade(db, args.before)
        t = time.perf_counter()
        populate(db, SLUG, args.records, 1)
        populate(db, OTHER, args.other, 2)
        with db.write_conn() as conn:
            conn.exec_driver_sql("ANALYZE")
        say(f"loaded {args.records} + {args.other} records in {time.perf_counter() - t:.1f} s")
        # the cursors of the pages: byte order of (path, id), as the API gives them
        with db.read_conn() as conn:
            keys = conn.exec_driver_sql(
                "SELECT path, id FROM records WHERE store = %(s)s AND NOT deleted "
                "ORDER BY path COLLATE \"C\", id", {"s": SLUG}).all()
        n = len(keys)
        cursors = {"start": None,
                   "middle": _encode_cursor(*keys[n // 2 - 1]),
                   "end": _encode_cursor(*keys[n - args.page - 1])}
        svc = Service(db)
        res["before"] = {"revision": args.before, "plans": measure(db, svc, cursors, f"before ({args.before})")}
        res["before"]["snapshot"] = full_snapshot(url, args.page)
        say(f"full snapshot before: {res['before']['snapshot']}")
        t = time.perf_counter()
        schema.upgrade(db)
        res["index_build_s"] = round(time.perf_counter() - t, 2)
        with db.write_conn() as conn:
            conn.exec_driver_sql("ANALYZE records")
            size = conn.exec_driver_sql(
                "SELECT pg_relation_size(indexrelid), indexrelid::regclass::text FROM pg_index "
                "WHERE indrelid = 'records'::regclass").all()
        res["index_sizes_bytes"] = {name: s for s, name in size}
        say(f"upgraded to {schema.head()} in {res['index_build_s']} s; index sizes {res['index_sizes_bytes']}")
        res["after"] = {"revision": schema.head(), "plans": measure(db, svc, cursors, f"after ({schema.head()})")}
        res["after"]["snapshot"] = full_snapshot(url, args.page)
        say(f"full snapshot after: {res['after']['snapshot']}")
        db.dispose()
    res["meta"]["loadavg_end"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
