"""CPU per search of a store of large records (attack 15 F3; not a test, never run by pytest).

Builds, through the reference ``Service`` in process (no HTTP: the figure is the search's own
work, database included), the attacker's store on a SQLite file: 56 records of ~900 KB of
ordinary text (12 words of a 30-word vocabulary a line, as ``/work/brief/atk15/mkbig.py``),
then measures the calling thread's CPU (``time.thread_time``: not inflated by a busy machine)
of each case, best and median of ``--reps`` rounds, cases interleaved in each round:

- ranked ``q=lisbon omega``, ``limit=100`` (the flood's request) and ``limit=20``;
- substring ``q=lisbon``, ``limit=100``.

Run it on two trees for a paired comparison (same machine, alternate the runs):

    PYTHONPATH=/tmp/base .venv/bin/python bench/bench_big_search.py
    PYTHONPATH=$PWD .venv/bin/python bench/bench_big_search.py

Prints one JSON line per case: ``{"case", "cpu_ms_best", "cpu_ms_median", "hits", "lines"}``.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from memfuse.models import RecordCreate, StoreCreate
from memfuse.server.db import Database
from memfuse.server.service import Principal, Service

ADMIN = Principal(None)
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
         "rho sigma tau upsilon phi chi psi omega memory agent note tea coffee lisbon").split()
CASES = [("ranked limit=100", "lisbon omega", "relevance", 100),
         ("ranked limit=20", "lisbon omega", "relevance", 20),
         ("substring limit=100", "lisbon", "path", 100)]


def _text(i: int) -> str:
    rnd = random.Random(i)
    lines: list[str] = []
    size = 0
    while size < 900_000:
        line = " ".join(rnd.choice(WORDS) for _ in range(12)) + f" {i}-{len(lines)}\n"
        lines.append(line)
        size += len(line)
    return "".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=56)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        svc = Service(Database(f"sqlite:///{Path(tmp) / 'cp.db'}"), max_body=64 << 20)
        svc.create_store(ADMIN, StoreCreate(slug="w1"))
        for i in range(args.records):
            svc.create_record(ADMIN, "w1", RecordCreate(path=f"big/b{i:03}.md", content=_text(i)))
        svc.search(ADMIN, "w1", "lisbon", order="relevance", limit=1)  # the index drained
        cpu: dict[str, list[float]] = {c[0]: [] for c in CASES}
        out: dict[str, tuple[int, int]] = {}
        for _ in range(args.reps):
            for name, q, order, limit in CASES:
                t0 = time.thread_time()
                page = svc.search(ADMIN, "w1", q, order=order, limit=limit)
                cpu[name].append((time.thread_time() - t0) * 1000)
                out[name] = (len(page.hits), sum(h.line_matches for h in page.hits))
        for name, _, _, _ in CASES:
            print(json.dumps({"case": name, "cpu_ms_best": round(min(cpu[name]), 1),
                              "cpu_ms_median": round(statistics.median(cpu[name]), 1),
                              "hits": out[name][0], "lines": out[name][1]}))


if __name__ == "__main__":
    main()
