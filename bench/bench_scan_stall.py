"""Another tenant's write while one token posts batches of records that are costly to scan for
secrets (attack18 F5's stall.py, measured).

    .venv/bin/python bench/bench_scan_stall.py [--batches 2] [--records 40] [--kib 976]

One ``memfuse serve`` (SQLite file, default limits; this tree's code: ``PYTHONPATH`` is set to
it) on loopback, workspaces ``a`` and ``b`` with a store each and a database token each. The
attacker (b's token) posts ``--batches`` batches at once, each of ``--records`` creates of
``--kib`` KiB made of base64 runs (24 random bytes encoded, then a space: every run is
decoded and scanned again, ~1.1 s of scan per MiB). Meanwhile the victim (a's token) creates
a 3-byte record every 0.1 s, one after the other, and each create's latency is taken. Prints
one JSON object: the victim's latencies (n, p50, p90, max, ms; failures), each batch's status,
its per-operation statuses and its time, and the server's CPU seconds.

``--singles N --seconds S`` (attack20 F1): instead of batches, N threads of the attacker each
post single creates of ``--chars`` characters of base64 runs back to back for S seconds
(``singles``: the count of each status).
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

TREE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TREE / "tests"))

from mountutil import serve_listening, stop  # noqa: E402


def _post(url: str, token: str, body: dict[str, Any], timeout: float) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _content(r: random.Random, size: int) -> str:
    parts: list[str] = []
    n = 0
    while n < size:
        run = base64.b64encode(r.randbytes(24)).decode() + " "
        parts.append(run)
        n += len(run)
    return "".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--records", type=int, default=40)
    ap.add_argument("--kib", type=int, default=976)  # under a store's default 1 MiB record bound
    ap.add_argument("--singles", type=int, default=0, help="attacker threads of single creates (no batches)")
    ap.add_argument("--seconds", type=float, default=30.0, help="how long the single creates go on")
    ap.add_argument("--chars", type=int, default=64_977, help="characters of each single create")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="scanstall-"))
    admin = secrets.token_urlsafe(24)
    (tmp / "admin.token").write_text(admin)
    log = tmp / "serve.log"
    env = dict(os.environ, PYTHONPATH=str(TREE), MEMFUSE_HOME=str(tmp / "home"))
    proc = subprocess.Popen(
        [sys.executable, "-c", "from memfuse.cli import main; main()", "serve", "--db", f"sqlite:///{tmp / 'cp.db'}",
         "--listen", "127.0.0.1:0", "--admin-token-file", str(tmp / "admin.token"), "--migrate"],
        stdout=log.open("ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    try:
        url = serve_listening(proc, log)
        tokens = {}
        for ws in ("a", "b"):
            for path, body in (("/v1/workspaces", {"name": ws, "default_store": False}),
                               ("/v1/stores", {"slug": ws})):
                status, out = _post(url + path, admin, body, 30)
                assert status == 201, (path, status, out)
            req = urllib.request.Request(f"{url}/v1/workspaces/{ws}/attachments/{ws}", method="PUT",
                                         data=b'{"access":"read_write"}',
                                         headers={"Authorization": f"Bearer {admin}", "Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=30).read()
            status, out = _post(url + "/v1/tokens", admin, {"workspace": ws, "name": ws}, 30)
            assert status == 201, out
            tokens[ws] = json.loads(out)["token"]
        r = random.Random(1)
        bodies = [] if args.singles else [{"operations": [{"op": "create", "body": {"path": f"s{b}_{i}.md", "content": _content(r, args.kib * 1024)}}
                                  for i in range(args.records)]} for b in range(args.batches)]
        lat: list[float] = []
        fails: list[str] = []
        stop_at: list[float] = []

        def victim() -> None:
            i = 0
            while not stop_at or time.monotonic() < stop_at[0]:
                t = time.monotonic()
                try:
                    status, out = _post(f"{url}/v1/stores/a/records", tokens["a"], {"path": f"v{i}.md", "content": "hi\n"}, 200)
                    if status != 201:
                        fails.append(f"{status} {out[:80]!r}")
                    else:
                        lat.append(time.monotonic() - t)
                except Exception as e:  # noqa: BLE001 - a timeout or a reset is a result here
                    fails.append(repr(e)[:80])
                i += 1
                time.sleep(0.1)

        batches: list[dict[str, Any]] = []

        def attack(body: dict[str, Any]) -> None:
            t = time.monotonic()
            try:
                status, out = _post(f"{url}/v1/stores/b/batch", tokens["b"], body, 300)
                ops = [x["status"] for x in json.loads(out)["results"]] if status == 200 else []
                batches.append({"status": status, "seconds": round(time.monotonic() - t, 2),
                                "ops": {s: ops.count(s) for s in sorted(set(ops))},
                                "detail": "" if status == 200 else out[:120].decode("utf-8", "replace")})
            except Exception as e:  # noqa: BLE001
                batches.append({"error": repr(e)[:120], "seconds": round(time.monotonic() - t, 2)})

        singles: dict[str, int] = {}
        end: list[float] = []

        def single(t: int) -> None:
            rs = random.Random(100 + t)
            i = 0
            while time.monotonic() < end[0]:
                body = {"path": f"t{t}_{i}.md", "content": _content(rs, args.chars)[:args.chars]}
                try:
                    status, _ = _post(f"{url}/v1/stores/b/records", tokens["b"], body, 300)
                    key = str(status)
                except Exception as e:  # noqa: BLE001
                    key = type(e).__name__
                singles[key] = singles.get(key, 0) + 1
                i += 1

        cpu0 = _cpu(proc.pid)
        vt = threading.Thread(target=victim)
        vt.start()
        time.sleep(1.0)
        if args.singles:
            bodies = []
            end.append(time.monotonic() + args.seconds)
        ats = [threading.Thread(target=single, args=(t,)) for t in range(args.singles)]
        ats += [threading.Thread(target=attack, args=(b,)) for b in bodies]
        for a in ats:
            a.start()
        for a in ats:
            a.join()
        stop_at.append(time.monotonic() + 1.0)
        vt.join()
        cpu = _cpu(proc.pid) - cpu0
        ms = sorted(x * 1000 for x in lat)
        print(json.dumps({
            "victim": {"n": len(ms), "p50_ms": round(statistics.median(ms), 1) if ms else None,
                       "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 1) if ms else None,
                       "max_ms": round(ms[-1], 1) if ms else None, "failures": fails[:5], "n_failures": len(fails)},
            "batches": batches, "singles": singles, "serve_cpu_s": round(cpu, 1),
            "args": vars(args)}, indent=1))
        return 0
    finally:
        stop(proc)


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    sys.exit(main())
