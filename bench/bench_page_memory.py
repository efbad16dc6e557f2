"""Server memory of pages that carry content (attack 13 F7): peak RSS of one ``memfuse serve``
answering ``GET .../changes?after=0&content=true&limit=1000`` (plain, long-poll ``wait=5`` and
the first line of ``stream=true``) and ``GET .../records?content=true&limit=1000`` ``K`` times
at once, over ``N`` versions (and ``N`` records) of 1 MiB of U+0001 (escaped six-fold in JSON:
the worst content per stored byte).

    PYTHONPATH=$PWD .venv/bin/python bench/bench_page_memory.py [--n 40] [--k 4]
        [--only changes|longpoll|stream|records|memories|memversions]

``memories`` / ``memversions``: Anthropic's memory-store face, ``GET /v1/memory_stores/
memstore_snap/memories?view=full&limit=100`` and ``.../memstore_big/memory_versions?view=full
&limit=100`` (the same records and versions; attack 14 F6).

Starts its own ``memfuse serve`` (``$PYTHONPATH``'s code: run it with the base tree's to
compare; SQLite file, default limits) on loopback. Prints, per endpoint, the bytes of one
answer, the pages a reader needed to read everything (following ``seq`` / ``next_cursor``),
and the server's ``VmHWM`` before and after the K concurrent first pages. The same workload as
``atk13/feed_memory.py`` of the outside tester.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from mountutil import MEMFUSE, serve_listening, stop  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=40, help="versions / records of 1 MiB")
    ap.add_argument("--k", type=int, default=4, help="concurrent readers")
    ap.add_argument("--only", choices=("changes", "longpoll", "stream", "records", "memories", "memversions"),
                    help="one endpoint (each its own peak)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="page-memory-"))
    token_file = tmp / "admin.token"
    token_file.write_text("bench-admin-token\n")
    log = tmp / "serve.log"
    proc = subprocess.Popen([MEMFUSE, "serve", "--db", f"sqlite:///{tmp / 'cp.db'}", "--listen", "127.0.0.1:0",
                             "--admin-token-file", str(token_file), "--migrate"],
                            stdout=log.open("ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=dict(os.environ, MEMFUSE_HOME=str(tmp / "home")))
    try:
        base = serve_listening(proc, log)
        run(base, proc.pid, args.n, args.k, args.only)
    finally:
        stop(proc)
    return 0


def run(base: str, pid: int, n: int, k: int, only: str | None) -> None:
    def call(method: str, path: str, body: object = None) -> bytes:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(base + path, data=data, method=method)
        req.add_header("Authorization", "Bearer bench-admin-token")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=600) as r:
            if "stream=true" in path:  # the first line (a page), then the stream is closed
                return r.readline()
            return r.read()

    def hwm() -> int:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmHWM:"))

    body = "\x01" * (1024 * 1024 - 8)
    call("POST", "/v1/stores", {"slug": "big"})
    rid = json.loads(call("POST", "/v1/stores/big/records", {"path": "blob.txt", "content": "v0000\n" + body}))["id"]
    for i in range(1, n):
        call("PUT", f"/v1/stores/big/records/{rid}", {"content": f"v{i:04d}\n" + body})
    call("POST", "/v1/stores", {"slug": "snap"})
    for i in range(n):
        call("POST", "/v1/stores/snap/records", {"path": f"r{i:03d}.txt", "content": f"r{i:04d}\n" + body})
    print(f"load average {os.getloadavg()[0]:.1f}; {n} versions and {n} records of 1 MiB of U+0001; "
          f"server peak RSS after the writes {hwm()} MiB", flush=True)
    feed = "/v1/stores/big/changes?after=0&content=true&limit=1000"
    for name, first in (("changes", feed), ("longpoll", feed + "&wait=5"), ("stream", feed + "&stream=true"),
                        ("records", "/v1/stores/snap/records?content=true&limit=1000"),
                        ("memories", "/v1/memory_stores/memstore_snap/memories?view=full&limit=100"),
                        ("memversions", "/v1/memory_stores/memstore_big/memory_versions?view=full&limit=100")):
        if only not in (None, name):
            continue
        max_seq = json.loads(call("GET", f"/v1/stores/big/records/{rid}?content=false"))["seq"]  # the feed's head
        sizes: list[int] = []
        before = hwm()
        ts = [threading.Thread(target=lambda: sizes.append(len(call("GET", first)))) for _ in range(k)]
        t0 = time.monotonic()
        for t in ts:
            t.start()
        for t in ts:
            t.join(600)
        secs, after = time.monotonic() - t0, hwm()
        rows, pages, nxt = 0, 0, first
        while nxt is not None:  # one reader reads everything, following the cursors
            page = json.loads(call("GET", nxt))
            pages += 1
            if name in ("changes", "longpoll", "stream"):  # the same request from the page's seq (a stream: its next line)
                rows += len(page["changes"])
                nxt = first.replace("after=0", f"after={page['seq']}") if page["changes"] else None
                if nxt is not None and name != "changes" and page["seq"] == max_seq:
                    nxt = None  # a long-poll or stream at the head would wait: the end
            elif name == "records":
                rows += len(page["records"])
                nxt = (f"/v1/stores/snap/records?content=true&limit=1000&cursor={page['next_cursor']}"
                       if page["next_cursor"] else None)
            else:  # the memory-store face: ``data`` and an opaque ``next_page``
                rows += len(page["data"])
                nxt = f"{first}&page={page['next_page']}" if page["next_page"] else None
        print(f"{k} x GET {name} (first page): {max(sizes) / 2**20:.0f} MiB each, {secs:.1f} s; "
              f"server peak RSS {before} -> {after} MiB (+{after - before}); all {rows} rows in {pages} pages "
              f"(the last one empty for plain changes); load average {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
