"""Another tenant's writes while one token loops prefix moves (attack21 F2's mover.py and
probe.py, measured): each token's writer time (``memfuse.server.writertime``).

    .venv/bin/python bench/bench_writer_share.py [--records 9900] [--seconds 25] [--tree PATH]

One ``memfuse serve`` (SQLite file, default limits; the code of ``--tree``, default this tree:
``PYTHONPATH`` is set to it) on loopback, workspaces ``a`` (the victim) and ``b`` (the
attacker) with a store each and a database token each. The admin (not charged) writes
``--records`` records of ~25 bytes under ``a/`` in store ``b`` (batches of 100, directories of
1,000). Then, for ``--warmup`` + ``--seconds`` (10 + 20): the attacker moves ``a → b → a`` (``POST
/v1/stores/b/move``) one after the other, sleeping the ``Retry-After`` of a 429; the victim
creates a 1-byte record every 0.1 s, one after the other, and each create's latency is taken
in the last ``--seconds`` (the warm-up spends the attacker's burst).
``--quiet`` leaves the attacker out (the floor). Prints one JSON object: the victim's
latencies (n, p50, p90, max, ms; failures), the attacker's moves (done, 429s, each move's
seconds) and the server's CPU seconds.
"""
from __future__ import annotations

import argparse
import json
import os
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
sys.path.insert(0, str(TREE / "bench"))

from common import cpu_s  # noqa: E402
from mountutil import serve_listening, stop  # noqa: E402


def _req(method: str, url: str, token: str, body: dict[str, Any] | None, timeout: float) -> tuple[int, bytes, dict[str, str]]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=9_900)
    ap.add_argument("--seconds", type=float, default=20.0, help="how long the victim's creates are measured")
    ap.add_argument("--warmup", type=float, default=10.0,
                    help="seconds the attacker moves before the victim's creates are measured (its burst spent)")
    ap.add_argument("--tree", type=Path, default=TREE, help="the memfuse tree the server runs")
    ap.add_argument("--quiet", action="store_true", help="no attacker: the victim alone")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="writershare-"))
    admin = secrets.token_urlsafe(24)
    (tmp / "admin.token").write_text(admin)
    log = tmp / "serve.log"
    env = dict(os.environ, PYTHONPATH=str(args.tree.resolve()), MEMFUSE_HOME=str(tmp / "home"))
    proc = subprocess.Popen(
        [sys.executable, "-c", "from memfuse.cli import main; main()", "serve", "--db", f"sqlite:///{tmp / 'cp.db'}",
         "--listen", "127.0.0.1:0", "--admin-token-file", str(tmp / "admin.token"), "--migrate"],
        stdout=log.open("ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
        cwd=tmp)  # not this tree's directory: ``-c`` puts the working directory first on sys.path
    try:
        url = serve_listening(proc, log)
        tokens = {}
        for ws in ("a", "b"):
            for path, body in (("/v1/workspaces", {"name": ws, "default_store": False}),
                               ("/v1/stores", {"slug": ws})):
                status, out, _ = _req("POST", url + path, admin, body, 30)
                assert status == 201, (path, status, out)
            status, out, _ = _req("PUT", f"{url}/v1/workspaces/{ws}/attachments/{ws}", admin, {"access": "read_write"}, 30)
            assert status == 200, out
            status, out, _ = _req("POST", url + "/v1/tokens", admin, {"workspace": ws, "name": ws}, 30)
            assert status == 201, out
            tokens[ws] = json.loads(out)["token"]
        t0 = time.monotonic()
        for b in range(0, args.records, 100):
            ops = [{"op": "create", "body": {"path": f"a/d{(b + i) // 1000}/r{b + i}.md", "content": f"record {b + i} lorem ipsum\n"}}
                   for i in range(min(100, args.records - b))]
            status, out, _ = _req("POST", f"{url}/v1/stores/b/batch", admin, {"operations": ops}, 120)
            assert status == 200, (status, out[:200])
        populate = time.monotonic() - t0
        begin = time.monotonic() + (0.0 if args.quiet else args.warmup)
        end = begin + args.seconds
        lat: list[float] = []
        fails: list[str] = []

        def victim() -> None:
            time.sleep(max(0.0, begin - time.monotonic()))
            i = 0
            while time.monotonic() < end:
                t = time.monotonic()
                try:
                    status, out, _ = _req("POST", f"{url}/v1/stores/a/records", tokens["a"], {"path": f"v{i}.md", "content": "v"}, 200)
                    if status != 201:
                        fails.append(f"{status} {out[:80]!r}")
                    else:
                        lat.append(time.monotonic() - t)
                except Exception as e:  # noqa: BLE001 - a timeout or a reset is a result here
                    fails.append(repr(e)[:80])
                i += 1
                time.sleep(0.1)

        moves: list[float] = []
        refused: list[int] = []
        codes: dict[str, int] = {}
        details: list[str] = []
        moves_at_begin: list[int] = []  # moves done in the warm-up

        def attacker() -> None:
            src, dst = "a", "b"
            while time.monotonic() < end:
                t = time.monotonic()
                if t >= begin and not moves_at_begin:
                    moves_at_begin.append(len(moves))
                status, out, headers = _req("POST", f"{url}/v1/stores/b/move", tokens["b"],
                                            {"from_prefix": src, "to_prefix": dst}, 300)
                if status == 200:
                    moves.append(time.monotonic() - t)
                    src, dst = dst, src
                elif status == 429:
                    wait = float(headers.get("Retry-After") or headers.get("retry-after") or 1)
                    refused.append(int(wait))
                    if len(details) < 2:
                        details.append(json.loads(out).get("detail", "")[:100])
                    codes[json.loads(out).get("code", "")] = codes.get(json.loads(out).get("code", ""), 0) + 1
                    time.sleep(min(wait, max(0.0, end - time.monotonic())))
                else:
                    fails.append(f"attacker {status} {out[:80]!r}")
                    time.sleep(1)

        cpu0 = cpu_s(proc.pid)
        threads = [threading.Thread(target=victim)] + ([] if args.quiet else [threading.Thread(target=attacker)])
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        cpu = cpu_s(proc.pid) - cpu0
        ms = sorted(x * 1000 for x in lat)
        print(json.dumps({
            "victim": {"n": len(ms), "p50_ms": round(statistics.median(ms), 1) if ms else None,
                       "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 1) if ms else None,
                       "max_ms": round(ms[-1], 1) if ms else None, "failures": fails[:5], "n_failures": len(fails)},
            "attacker": {"moves": len(moves), "moves_in_warmup": (moves_at_begin or [len(moves)])[0],
                         "writer_s_share_measured": round(sum(moves[(moves_at_begin or [len(moves)])[0]:]) / args.seconds, 2),
                         "refused_429": len(refused), "codes_429": codes, "details_429": details, "retry_after_s": refused[:20],
                         "move_s": [round(x, 2) for x in moves]},
            "populate_s": round(populate, 1), "serve_cpu_s": round(cpu, 1),
            "args": {k: str(v) for k, v in vars(args).items()}}, indent=1))
        return 0
    finally:
        stop(proc)


if __name__ == "__main__":
    sys.exit(main())
