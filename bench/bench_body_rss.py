"""What one record write at the body bound costs ``memfuse serve`` in memory: the peak RSS
(``VmHWM``) of a fresh server before and after one 8 MiB record write, by content: plain
(``x``, an 8 MiB body), every byte a newline (a 16 MiB body: the worst case of the rule of
session 12) and every byte ``\\x01`` (a 48 MiB body: the worst case of any JSON encoder, which
``memfuse.defs.RECORD_BODY_GROWTH`` admits since session 13). Section "The body bound counts
the true worst case" of bench/README.md.

    PYTHONPATH=TREE .venv/bin/python bench/bench_body_rss.py [plain twice worst ...]

One ``memfuse serve`` per write (default flags, SQLite file, loopback); prints one JSON line
per write: the HTTP status, the body in MiB, the peak RSS before / after and its growth (MiB).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

MEMFUSE = Path(sys.executable).with_name("memfuse")
CONTENT = {"plain": "x", "twice": "\n", "worst": "\x01"}  # one character of each kind
SIZE = 8 << 20  # the record: the largest max_record_bytes of the default body bound


def peak_mib(pid: int) -> float:
    """``VmHWM`` of process ``pid`` in MiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    m = re.search(r"VmHWM:\s+(\d+)", status)
    assert m is not None
    return int(m.group(1)) / 1024


def one(kind: str) -> dict[str, object]:
    """Start a server, write one record of ``SIZE`` characters ``CONTENT[kind]``, stop it."""
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        (tmp / "admin.token").write_text("bench-body-rss-admin")
        log = tmp / "serve.log"
        proc = subprocess.Popen(
            [str(MEMFUSE), "serve", "--db", f"sqlite:///{tmp}/cp.db", "--listen", "127.0.0.1:0",
             "--admin-token-file", str(tmp / "admin.token"), "--migrate"], stdout=log.open("ab"),
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=dict(os.environ, MEMFUSE_HOME=str(tmp / "home")))
        try:
            url = None
            for _ in range(600):
                m = re.search(rb"listening on (http://[0-9.:]+)", log.read_bytes())
                if m:
                    url = m.group(1).decode()
                    break
                if proc.poll() is not None:
                    raise SystemExit(log.read_text())
                time.sleep(0.1)
            assert url, "memfuse serve did not listen within 60 s"
            with httpx.Client(base_url=url, headers={"Authorization": "Bearer bench-body-rss-admin"},
                              timeout=120) as c:
                c.post("/v1/stores", json={"slug": "big", "max_record_bytes": SIZE,
                                           "max_store_bytes": 256 << 20}).raise_for_status()
                c.post("/v1/stores/big/records", json={"path": "warm.md", "content": "warm"}).raise_for_status()
                before = peak_mib(proc.pid)
                body = json.dumps({"path": "r.txt", "content": CONTENT[kind] * SIZE}).encode()
                r = c.post("/v1/stores/big/records", content=body, headers={"Content-Type": "application/json"})
                after = peak_mib(proc.pid)
            return {"kind": kind, "status": r.status_code, "body_mib": round(len(body) / 2**20, 1),
                    "peak_before_mib": round(before, 1), "peak_after_mib": round(after, 1),
                    "growth_mib": round(after - before, 1)}
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    for k in sys.argv[1:] or ["plain", "twice", "worst"]:
        print(json.dumps(one(k)), flush=True)
