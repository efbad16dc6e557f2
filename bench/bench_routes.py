"""The cost of the HTTP layer per request: the app as ``create_app`` assembles it (the resource
routers' routes in the app's own route list) against the same routers included with
FastAPI's ``include_router``.

    .venv/bin/python bench/bench_routes.py [--records 100]

In one process, through ``httpx.ASGITransport`` (no sockets, no front-door limits in the way):
``--records`` creates, three reads of each record, one update of each and 20 page listings, on
SQLite in a temporary directory. Each way is measured twice, alternately: the Python function
calls of the request loop (``cProfile``: a count, so a loaded machine does not blur it) and
its CPU seconds (best of the two rounds). The ratio is included / as assembled.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time

import httpx
import trio

from memfuse.server import app as app_module
from memfuse.server.app import create_app


def _included(app) -> None:
    """The routes of the resource routers through ``include_router`` instead (for the
    comparison): remove them from the app's list, include the routers."""
    ours = {id(r) for m in app_module.ROUTERS for r in m.router.routes}
    app.router.routes[:] = [r for r in app.router.routes if id(r) not in ours]
    for m in app_module.ROUTERS:
        app.include_router(m.router)


async def _run(records: int, include: bool) -> tuple[int, float, int]:
    with tempfile.TemporaryDirectory() as d:
        app = create_app(f"sqlite:///{d}/db.sqlite", static_tokens={"adm": None, "wt": "w"})
        if include:
            _included(app)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://bench",
                                     headers={"Authorization": "Bearer adm"}) as c:
            (await c.post("/v1/workspaces", json={"name": "w"})).raise_for_status()
            (await c.post("/v1/stores", json={"slug": "s"})).raise_for_status()
            (await c.put("/v1/workspaces/w/attachments/s", json={"access": "read_write"})).raise_for_status()
            c.headers["Authorization"] = "Bearer wt"
            prof = cProfile.Profile()
            prof.enable()
            cpu0 = time.process_time()
            ids = []
            for i in range(records):
                r = await c.post("/v1/stores/s/records", json={"path": f"n/{i}.md", "content": f"note {i}\n"})
                r.raise_for_status()
                ids.append(r.json()["id"])
            for _ in range(3):
                for rid in ids:
                    (await c.get(f"/v1/stores/s/records/{rid}")).raise_for_status()
            for rid in ids:
                (await c.put(f"/v1/stores/s/records/{rid}", json={"content": "changed\n"})).raise_for_status()
            for _ in range(20):
                (await c.get("/v1/stores/s/records", params={"limit": 100})).raise_for_status()
            cpu = time.process_time() - cpu0
            prof.disable()
        app.state.service.db.dispose()
    return pstats.Stats(prof).total_calls, cpu, records * 5 + 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=100)
    args = ap.parse_args()
    results: dict[bool, list[tuple[int, float, int]]] = {False: [], True: []}
    for _ in range(2):
        for include in (False, True):
            results[include].append(trio.run(_run, args.records, include))
    rows = {}
    for include, runs in results.items():
        calls = min(r[0] for r in runs) / runs[0][2]
        cpu = min(r[1] for r in runs) / runs[0][2] * 1e3
        rows[include] = (calls, cpu)
        print(f"{'include_router' if include else 'as assembled'}: {calls:.0f} Python calls and "
              f"{cpu:.2f} ms CPU a request ({runs[0][2]} requests, best of {len(runs)})")
    print(f"ratio include_router / as assembled: calls {rows[True][0] / rows[False][0]:.2f}x, "
          f"CPU {rows[True][1] / rows[False][1]:.2f}x")


if __name__ == "__main__":
    main()
