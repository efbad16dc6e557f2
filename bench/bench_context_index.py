"""The prompt block and the index report on a hostile ``MEMORY.md`` (attack 13 F10), main
beside a branch in the same run: per request, wall ms and the process's CPU ms, in process
(``create_app`` on SQLite through ``httpx.ASGITransport``, no network).

Cases: ``context``: ``GET /v1/workspaces/ws/context`` with the tester's index (60,000 links
``[](N)``, 575 KB) in the one attached store: the first ask after the write (``miss``) and
the asks after it (``repeat``); ``report``: ``GET /v1/stores/default/index`` on a 1 MiB
index of ``[](a)`` lines (answer size in bytes too).

    python bench/bench_context_index.py --src A=/tmp/base --src B=. [--rounds 3] [--repeats 5]

Each round runs every tree once, in turn (a child process each: ``PYTHONPATH=SRC``), so a
pair shares the machine's load; medians per tree and the B/A ratio of each round's pair.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

ADMIN, WS = "bench-admin", "bench-ws"


def _child(repeats: int) -> dict[str, Any]:
    import asyncio

    import httpx

    from memfuse.server.app import create_app

    async def run() -> dict[str, Any]:
        app = create_app("sqlite://", static_tokens={ADMIN: None, WS: "ws"})
        out: dict[str, Any] = {}
        t = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=t, base_url="http://b", headers={"Authorization": f"Bearer {ADMIN}"}) as admin, \
                httpx.AsyncClient(transport=t, base_url="http://b", headers={"Authorization": f"Bearer {WS}"}) as ws:
            assert (await admin.post("/v1/workspaces", json={"name": "ws", "default_store": False})).status_code == 201
            assert (await admin.post("/v1/stores", json={"slug": "default"})).status_code == 201
            assert (await admin.put("/v1/workspaces/ws/attachments/default", json={"access": "read_write"})).status_code == 200

            async def timed(path: str) -> tuple[float, float, int]:
                w, c = time.perf_counter(), time.process_time()
                r = await ws.get(path)
                assert r.status_code == 200, r.text[:300]
                return (time.perf_counter() - w) * 1e3, (time.process_time() - c) * 1e3, len(r.content)

            md = "".join(f"[]({i})\n" for i in range(60000))
            r = await ws.post("/v1/stores/default/records", json={"path": "MEMORY.md", "content": md})
            assert r.status_code == 201, r.text
            rid = r.json()["id"]
            out["context_miss"] = await timed("/v1/workspaces/ws/context")
            rep = [await timed("/v1/workspaces/ws/context") for _ in range(repeats)]
            out["context_repeat"] = [statistics.median(x[i] for x in rep) for i in range(3)]
            big = "[](a)\n" * ((1024 * 1024 - 100) // 6)
            r = await ws.put(f"/v1/stores/default/records/{rid}", json={"content": big})
            assert r.status_code == 200, r.text
            out["report"] = await timed("/v1/stores/default/index")
        app.state.service.db.dispose()
        return out

    return asyncio.run(run())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", action="append", default=[], help="NAME=DIR of a tree (repeat; the first is the base)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(_child(a.repeats)))
        return
    srcs = [tuple(s.split("=", 1)) for s in a.src] or [("here", os.getcwd())]
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n, _ in srcs}
    loads = [os.getloadavg()[0]]
    for _ in range(a.rounds):
        for name, src in srcs:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--repeats", str(a.repeats)],
                               env=env, capture_output=True, text=True, timeout=900, cwd=os.path.abspath(src))
            if p.returncode:
                sys.exit(f"{name}: {p.stderr[-2000:]}")
            runs[name].append(json.loads(p.stdout.strip().splitlines()[-1]))
            loads.append(os.getloadavg()[0])
    print(f"load average (1 min) over the run: {min(loads):.1f}-{max(loads):.1f}")
    print(f"{'case':16} " + " ".join(f"{n + ' wall ms':>14} {n + ' CPU ms':>13}" for n, _ in srcs) + "  bytes")
    for case in ("context_miss", "context_repeat", "report"):
        cells = []
        for n, _ in srcs:
            cells.append(f"{statistics.median(r[case][0] for r in runs[n]):14.1f} "
                         f"{statistics.median(r[case][1] for r in runs[n]):13.1f}")
        print(f"{case:16} " + " ".join(cells) + f"  {' / '.join(str(int(runs[n][0][case][2])) for n, _ in srcs)}")
    if len(srcs) == 2:
        (a_n, _), (b_n, _) = srcs
        for case in ("context_miss", "context_repeat", "report"):
            ratios = [rb[case][1] / ra[case][1] for ra, rb in zip(runs[a_n], runs[b_n]) if ra[case][1]]
            print(f"{case}: CPU {b_n}/{a_n} per round: " + ", ".join(f"{x:.3f}" for x in ratios))


if __name__ == "__main__":
    main()
