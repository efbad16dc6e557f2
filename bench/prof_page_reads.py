"""Reads of a store on an SQLite file made with a given page size (bench/README.md, "The close
path, session 21: serve's WAL pages", the page size tried and dropped): ``--n`` records made
with ``Service.create_record``, the full-text queue drained, then, each on a new ``Database``
(the OS page cache warm): a 1,000-record snapshot page with content (the mount's listing), a
substring search (``grep``-like), a ranked search; this thread's CPU ms and read system calls
of the first run, and CPU ms of the warm runs after it.

Usage: ``python bench/prof_page_reads.py [--page-size 4096] [--n 3000] [--size BYTES]``; one
JSON line. The file is made with ``PRAGMA page_size`` and WAL mode before memfuse opens it
(memfuse makes its files with SQLite's default, 4096).
"""
from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_write import content  # noqa: E402

from memfuse.models import RecordCreate, WorkspaceCreate  # noqa: E402
from memfuse.server.base import IdempotencyRequest, Principal  # noqa: E402
from memfuse.server.db import Database  # noqa: E402
from memfuse.server.service import Service  # noqa: E402


def _syscr() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split(": ")[1]) for line in f if line.startswith("syscr"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--page-size", type=int, default=4096)
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--size", type=int, default=0, help="records of this many bytes (default: ~500-byte files)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="prof-page-reads-") as d:
        f = f"{d}/cp.db"
        made = sqlite3.connect(f)
        made.execute(f"PRAGMA page_size={args.page_size}")
        made.execute("PRAGMA journal_mode=WAL")
        made.close()
        db = Database(f"sqlite:///{f}")
        svc = Service(db)
        svc.create_workspace(Principal(workspace=None, name="bench"), WorkspaceCreate(name="ws"))
        p = Principal(workspace="ws", instance="bench")
        for i in range(args.n):
            idem = IdempotencyRequest(str(uuid.uuid4()), "POST", "/v1/stores/ws/records",
                                      uuid.uuid4().hex * 2, uuid.uuid4().hex * 2)
            body = content(i).decode() if not args.size else f"line {i} words quartz\n" * max(1, args.size // 22)
            r = svc.create_record(p, "ws", RecordCreate(path=f"d{i % 10}/e{i % 7}/{i}.md", content=body), idem)
            assert r.status == 201, r.body
        db.index_pending()
        db.dispose()
        out: dict[str, Any] = {"page_size": args.page_size, "n": args.n, "size": args.size}
        reads: list[tuple[str, Callable[[Service], object], int]] = [
            ("snapshot_content", lambda s: s.list_records(p, "ws", limit=1000, with_content=True), 5),
            ("search_substring", lambda s: s.search(p, "ws", "quartz"), 5),
            ("search_ranked", lambda s: s.search(p, "ws", "quartz words", order="relevance"), 20),
        ]
        for name, fn, reps in reads:
            db = Database(f"sqlite:///{f}")
            svc = Service(db)
            r0, t0 = _syscr(), time.thread_time()
            fn(svc)
            t1, r1 = time.thread_time(), _syscr()
            for _ in range(reps):
                fn(svc)
            t2 = time.thread_time()
            out[name] = {"first_ms": round((t1 - t0) * 1000, 2), "first_syscr": r1 - r0,
                         "warm_ms": round((t2 - t1) / reps * 1000, 2)}
            db.dispose()
        out["file_kib"] = os.path.getsize(f) // 1024
    print(json.dumps(out))


if __name__ == "__main__":
    main()
