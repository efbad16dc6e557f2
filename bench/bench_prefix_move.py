"""A prefix move of N records (``POST /v1/stores/{store}/move``, a directory rename) in
process over a SQLite file: wall and CPU of the move request, per record (attack 12 A4;
bench/README.md "Prefix moves"). ``python bench/bench_prefix_move.py [N]`` (default 10,000).
``MB_WAIT=<file>``: write that file and pause 1 s before the moves (to attach py-spy)."""
import asyncio, os, shutil, sys, time, tempfile
import httpx
from memfuse.server.app import create_app

N = int(sys.argv[1]) if len(sys.argv) > 1 else 10000
WAIT = os.environ.get("MB_WAIT")
ADMIN = "a"

async def main():
    d = tempfile.mkdtemp(prefix="bench-prefix-move-")
    app = create_app(f"sqlite:///{d}/db.sqlite", static_tokens={ADMIN: None})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                 headers={"Authorization": f"Bearer {ADMIN}"}, timeout=600) as c:
        r = await c.post("/v1/stores", json={"slug": "s", "max_records": N + 10})
        assert r.status_code == 201, r.text
        for i in range(0, N, 100):
            ops = [{"op": "create", "body": {"path": f"big/d{j // 100}/n{j:05d}.md",
                    "content": f"# note {j}\nsome text {j} about things\n"}} for j in range(i, min(N, i + 100))]
            r = await c.post("/v1/stores/s/batch", json={"operations": ops})
            assert r.status_code == 200, r.text[:300]
        if WAIT:
            open(WAIT, "w").write("go"); time.sleep(1)
        for src, dst in (("big", "big2"), ("big2", "big")):
            t0, c0 = time.perf_counter(), time.process_time()
            r = await c.post("/v1/stores/s/move", json={"from_prefix": src, "to_prefix": dst})
            t1, c1 = time.perf_counter(), time.process_time()
            assert r.status_code == 200, r.text[:300]
            assert len(r.json()["records"]) == N
            print(f"N={N} move {src}->{dst}: wall {t1 - t0:.2f} s, cpu {c1 - c0:.2f} s, "
                  f"{(c1 - c0) / N * 1e6:.0f} us cpu/record, load {os.getloadavg()[0]:.1f}")
    app.state.service.db.dispose()
    shutil.rmtree(d, ignore_errors=True)

asyncio.run(main())
