"""The control plane under hostile clients: probe and good-client latency during each attack,
server RSS under a 300 MB body, how fast revocation and expiry end long-lived responses.

    .venv/bin/python bench/bench_hostile.py [--seconds 10] [--out bench/results-hostile.json]

One ``memfuse serve`` (one replica, SQLite file, default limits) on loopback. For each attack
(300 MB bodies in a loop, anonymous and over the limit; 200 authenticated slow bodies,
one byte a second; 200 slow-header connections from one address, re-opened as they close;
idle long-lived responses up to every cap, change streams and console live pages, plus
refused extras and ``GET /mcp``) a well-behaved client asks, one after the other for
``--seconds`` s, ``GET /healthz`` and an authenticated ``GET`` of one record (a keep-alive
connection of its own each) and the table gives p50 / p99 / max and the failures. Before
each attack the same client runs one window with no attack (the baseline): the table gives
each attack's p99 over its own baseline's, which is what the attack costs on a machine whose
load moves between windows. The
server's RSS is sampled every 10 ms during the 300 MB bodies. Last, a change stream, a
long-poll and a live page of one token are cut by the token's revocation, then of another by
its expiry: the time from the revocation (the ``DELETE`` answered) or the ``expires_at`` to
the end of each. Target: probes and the good client ≤ 100 ms p99 under every attack; RSS
growth < 16 MiB under a 300 MB anonymous body; every cut within 1 s.

The attacks themselves are the ones of ``tests/test_hostile.py`` (imported from there). The
attacker runs at nice 10 and the well-behaved client in a process of its own at nice 0 (as
the server): on a shared 2-CPU machine the attacker's own CPU would otherwise be counted
against the server. The server's CPU during each window is reported too.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for p in (str(HERE.parent), str(HERE.parent / "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

import httpx  # noqa: E402
import trio  # noqa: E402

import test_hostile as h  # noqa: E402
from mountutil import serve_listening, stop  # noqa: E402

MIB = 1024 * 1024


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


async def measure(s: h.Server, seconds: float) -> dict:
    """Latencies (ms) of /healthz and of an authenticated record read, asked one after the
    other on two keep-alive connections for ``seconds`` s."""
    out: dict[str, list[float]] = {"healthz": [], "read": []}
    fails = {"healthz": 0, "read": 0}
    end = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=s.url, timeout=10) as probe, \
            httpx.AsyncClient(base_url=s.url, headers=h._auth(s.good), timeout=10) as good:
        async def loop(name: str, client: httpx.AsyncClient, path: str) -> None:
            while time.monotonic() < end:
                t0 = time.perf_counter()
                try:
                    ok = (await client.get(path)).status_code == 200
                except httpx.HTTPError:
                    ok = False
                out[name].append((time.perf_counter() - t0) * 1000)
                fails[name] += not ok
                await trio.sleep(0.02)

        async with trio.open_nursery() as n:
            n.start_soon(loop, "healthz", probe, "/healthz")
            n.start_soon(loop, "read", good, f"/v1/stores/default/records/{s.rid}")
    return {k: {"n": len(v), "p50_ms": round(pct(v, 0.5), 1), "p99_ms": round(pct(v, 0.99), 1),
                "max_ms": round(max(v), 1), "failed": fails[k]} for k, v in out.items()}


async def attack_bodies(s: h.Server, stop_: trio.Event, rss: dict) -> None:
    while not stop_.is_set():
        for what, token, chunked, source in (("anonymous", None, False, "127.0.0.2"),
                                             ("anonymous", None, True, "127.0.0.2"),
                                             ("token", s.good, False, "127.0.0.1")):
            if stop_.is_set():
                return
            base = s.rss()
            peak = base
            done = False

            async def sample() -> None:
                nonlocal peak
                while not done:
                    peak = max(peak, s.rss())
                    await trio.sleep(0.01)

            async with trio.open_nursery() as n:
                n.start_soon(sample)
                await h.big_post(s, token, chunked, source)
                await trio.sleep(0.05)
                done = True
            key = f"{what}{', chunked' if chunked else ''}"
            rss[key] = max(rss.get(key, 0), peak - base)


async def _closing(stream: trio.SocketStream) -> None:
    with trio.CancelScope(shield=True):
        await stream.aclose()


async def attack_slow_bodies(s: h.Server, stop_: trio.Event, n_conn: int = 200) -> None:
    async def one() -> None:
        while not stop_.is_set():
            stream = None
            try:
                stream = await h.connect(s, "127.0.0.3")
                await stream.send_all(b"POST /v1/stores/default/records HTTP/1.1\r\nHost: x\r\n"
                                      b"Content-Length: 100000\r\nAuthorization: Bearer "
                                      + s.good.encode() + b"\r\n\r\n")
                while not stop_.is_set():
                    await stream.send_all(b"{")
                    await trio.sleep(1.0)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                await trio.sleep(1.0)  # the body deadline cut it: open another a second later
            finally:
                if stream is not None:
                    await _closing(stream)

    async with trio.open_nursery() as n:
        for _ in range(n_conn):
            n.start_soon(one)
            await trio.sleep(0.01)
        await stop_.wait()
        n.cancel_scope.cancel()


async def attack_slow_headers(s: h.Server, stop_: trio.Event, n_conn: int = 200) -> None:
    async def one() -> None:
        while not stop_.is_set():
            stream = None
            try:
                stream = await h.connect(s, "127.0.0.2")
                await stream.send_all(b"GET /v1/stores HTTP/1.1\r\nHost: x\r\n")
                while not stop_.is_set():
                    await stream.send_all(b"X")
                    await trio.sleep(0.5)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                await trio.sleep(1.0)  # refused or cut: open another a second later
            finally:
                if stream is not None:
                    await _closing(stream)

    async with trio.open_nursery() as n:
        for _ in range(n_conn):
            n.start_soon(one)
        await stop_.wait()
        n.cancel_scope.cancel()


async def attack_streams(s: h.Server, stop_: trio.Event, refused: dict) -> None:
    from contextlib import AsyncExitStack

    token = (await h.new_token(s.url, "idle-streams"))["token"]
    async with AsyncExitStack() as stack:
        c = await stack.enter_async_context(httpx.AsyncClient(
            base_url=s.url, headers=h._auth(token), timeout=30, limits=httpx.Limits(max_connections=400)))
        held = 0
        for i in range(200):  # 64 held (the per-token cap), the rest refused at once
            kind = ("stream", "live")[i % 2]
            r = await h._open_stream(c, kind, stack)
            if r.status_code == 200:
                held += 1
            else:
                refused[r.status_code] = refused.get(r.status_code, 0) + 1
        refused["held"] = held
        refused["mcp_get"] = (await c.get("/mcp")).status_code
        await stop_.wait()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_attack(s: h.Server, name: str, seconds: float, attack, *args) -> dict:
    """Run ``attack`` and, once it is in full swing, the well-behaved client in a process of
    its own (so that the attacker's work in this process does not delay its timings)."""
    stop_ = trio.Event()
    async with trio.open_nursery() as n:
        n.start_soon(attack, s, stop_, *args)
        await trio.sleep(2.0)  # the attack in full swing
        cpu0, t0 = cpu_seconds(s.proc.pid), time.monotonic()
        child = await trio.run_process(
            [sys.executable, __file__, "--measure", s.url, s.good, s.rid, str(seconds)],
            capture_stdout=True, check=True)
        cpu = (cpu_seconds(s.proc.pid) - cpu0) / (time.monotonic() - t0)
        got = json.loads(child.stdout)
        got["server_cpu_pct"] = round(100 * cpu, 1)
        stop_.set()
    await trio.sleep(1.0)
    print(name, json.dumps(got), flush=True)
    return got


async def cuts(s: h.Server) -> dict:
    from datetime import datetime

    tok = await h.new_token(s.url, "bench-revoked")

    async def revoke() -> float:
        async with h.admin_client(s.url) as a:
            assert (await a.delete(f"/v1/tokens/{tok['id']}")).status_code == 204
            return time.time()

    rev = await h._cut_all(s, tok["token"], revoke)
    tok2 = await h.new_token(s.url, "bench-expiring", ttl=4)
    expires = datetime.fromisoformat(tok2["expires_at"].replace("Z", "+00:00")).timestamp()

    async def expire() -> float:
        await trio.sleep(max(0.0, expires - time.time()))
        return expires

    exp = await h._cut_all(s, tok2["token"], expire)
    return {"revoked": {k: round(t * 1000) for k, t, _ in rev}, "expired": {k: round(t * 1000) for k, t, _ in exp}}


def _with_baseline(got: dict, base: dict) -> dict:
    """``got`` (an attack's window) with ``baseline``: the p99s of the no-attack window just
    before it, and ``ratio``: its p99s over those (the load of a shared machine moves between
    windows; the ratio to the window next to it is the attack's own cost)."""
    got["baseline_p99_ms"] = {k: base[k]["p99_ms"] for k in ("healthz", "read")}
    got["ratio_p99"] = {k: round(got[k]["p99_ms"] / max(base[k]["p99_ms"], 0.1), 2) for k in ("healthz", "read")}
    return got


async def main_async(s: h.Server, seconds: float) -> dict:
    results: dict = {}

    async def idle(s_: h.Server, e: trio.Event) -> None:
        await e.wait()

    async def attack(name: str, fn, *args) -> dict:
        base = await run_attack(s, f"baseline before {name}", seconds, idle)
        results.setdefault("baselines", {})[name] = base
        results[name] = _with_baseline(await run_attack(s, name, seconds, fn, *args), base)
        return results[name]

    rss: dict = {}
    bodies = await attack("300 MB bodies", attack_bodies, rss)
    bodies["rss_growth_mib"] = {k: round(v / MIB, 1) for k, v in rss.items()}
    await attack("200 slow bodies", attack_slow_bodies)
    await attack("200 slow headers", attack_slow_headers)
    refused: dict = {}
    (await attack("idle streams", attack_streams, refused))["streams"] = refused
    results["cut_ms"] = await cuts(s)
    results["server_rss_mib"] = round(s.rss() / MIB, 1)
    return results


_NOT_ATTACKS = ("baselines", "cut_ms", "meta", "server_rss_mib")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="measurement window per attack")
    ap.add_argument("--out", type=Path, default=HERE / "results-hostile.json")
    ap.add_argument("--measure", nargs=4, metavar=("URL", "TOKEN", "RECORD", "SECONDS"),
                    help=argparse.SUPPRESS)  # the well-behaved client's process
    args = ap.parse_args()
    if args.measure:
        try:  # back to the server's priority (the attacker runs niced: see main)
            os.setpriority(os.PRIO_PROCESS, 0, 0)
        except PermissionError:
            pass
        s = h.Server()
        s.url, s.good, s.rid, seconds = args.measure
        print(json.dumps(trio.run(measure, s, float(seconds))))
        return 0
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        (tmp / "admin.token").write_text(h.ADMIN)
        log = tmp / "serve.log"
        proc = subprocess.Popen(
            [str(h.MEMFUSE), "serve", "--db", f"sqlite:///{tmp / 'cp.db'}", "--listen", "127.0.0.1:0",
             "--admin-token-file", str(tmp / "admin.token"), "--migrate"],
            stdout=log.open("ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=dict(os.environ, MEMFUSE_HOME=str(tmp / "home")))
        try:
            s = h.Server()
            s.proc, s.url = proc, serve_listening(proc, log)
            s.port = int(s.url.rsplit(":", 1)[1])
            s.good, s.rid = trio.run(h._setup, s.url)
            # The attacker (this process) runs at nice 10: on a shared 2-CPU machine its own
            # work would otherwise be counted against the server; in the world it runs on
            # another machine. The server and the well-behaved client keep nice 0.
            os.nice(10)
            results = trio.run(main_async, s, args.seconds)
        finally:
            stop(proc)
    results["meta"] = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "load": os.getloadavg(), "cpus": os.cpu_count()}
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print()
    print("| attack | /healthz p50 / p99 / max ms | record read p50 / p99 / max ms | "
          "baseline p99 ms (no attack, just before) | p99 ratio attack / baseline | server CPU | failed |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        if name in _NOT_ATTACKS:
            continue
        hz, rd, b, q = r["healthz"], r["read"], r["baseline_p99_ms"], r["ratio_p99"]
        print(f"| {name} | {hz['p50_ms']} / {hz['p99_ms']} / {hz['max_ms']} | "
              f"{rd['p50_ms']} / {rd['p99_ms']} / {rd['max_ms']} | {b['healthz']} / {b['read']} | "
              f"{q['healthz']:.2f}× / {q['read']:.2f}× | {r['server_cpu_pct']} % | "
              f"{hz['failed'] + rd['failed']} |")
    print("RSS growth under 300 MB bodies (MiB):", results["300 MB bodies"]["rss_growth_mib"])
    print("streams:", results["idle streams"]["streams"])
    print("cut after revocation / expiry (ms):", results["cut_ms"])
    attacks = [r for k, r in results.items() if k not in _NOT_ATTACKS]
    ok = all(r["healthz"]["p99_ms"] <= 100 and r["read"]["p99_ms"] <= 100 for r in attacks)
    print("target (p99 <= 100 ms under every attack):", "met" if ok else "NOT met")
    worst = max(max(r["ratio_p99"].values()) for r in attacks)
    print(f"largest p99 ratio attack / its baseline: {worst:.2f}×")
    return 0


if __name__ == "__main__":
    sys.exit(main())
