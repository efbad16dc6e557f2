"""Ranked search (``GET /v1/stores/{s}/search?order=relevance``) at 3,000 and 30,000 records,
beside the substring search of today (not a test, never run by pytest).

For each size N, builds one store of N records of ~1 KiB (a heading, four lines of words
drawn from a 4,000-word vocabulary, Zipf-like) through the reference ``Service`` (batches of
100, in process, no HTTP: the figure is the search's own database work), on a SQLite file
and, when PostgreSQL is installed (``./scripts/setup --test``), on a throwaway cluster
(``tests/pgutil.pg_cluster``). Then, best of 40 rounds of ``Service.search``, the two sizes and the cases interleaved in each round (first page of
20 hits, 5 lines each):

- ranked, a rare word (in 10 records at either N);
- ranked, a selective word (in 1% of the records: 30, then 300);
- ranked, two words (both in the same 10 records at either N);
- substring (``order=path``), the same rare word: the default, which reads every record.

The ratio column is the 30,000-record time over the 3,000-record one: the target is at
most 3 for the ranked rows (10× the records). Each figure is given as wall time and as the
CPU time of the calling thread (``time.thread_time``: on SQLite all of the search's work,
the database included, and a figure a busy machine does not inflate; on PostgreSQL the
server's part is not in it, so read the wall time there). Writes ``bench/results-ranked-search.json``
(``--out``) and prints a Markdown table. ``--sizes 3000,30000`` and ``--no-pg`` to change.

    .venv/bin/python bench/bench_ranked_search.py
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from memfuse.models import BatchRequest, StoreCreate  # noqa: E402
from memfuse.server.db import Database  # noqa: E402
from memfuse.server.service import Principal, Service  # noqa: E402
from pgutil import fresh_db_url, pg_bindir, pg_cluster  # noqa: E402  (imported before any work)

REPS = 40
VOCAB = 4000
ADMIN = Principal(None)
CASES = [
    ("ranked: rare word (10 records)", "xylophone", "relevance"),
    ("ranked: selective word (1% of records)", "quartz", "relevance"),
    ("ranked: two words (10 records)", "xylophone came", "relevance"),
    ("substring (default): rare word", "xylophone", "path"),
]


def _words(rng: random.Random) -> list[str]:
    syll = ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "si", "de", "pa", "ri", "go", "be", "nu", "zo"]
    out: set[str] = set()
    while len(out) < VOCAB:
        out.add("".join(rng.choice(syll) for _ in range(rng.randint(2, 4))))
    return sorted(out)


def _content(i: int, n: int, vocab: list[str], rng: random.Random) -> str:
    pick = lambda k: " ".join(vocab[min(int(rng.paretovariate(1.1)) - 1, VOCAB - 1)] if rng.random() < .5  # noqa: E731
                              else rng.choice(vocab) for _ in range(k))
    extra = []
    if i % (n // 10) == 3:
        extra.append("the xylophone came up")
    if i % 100 == 5:
        extra.append("quartz")
    if i % 1000 == 5:
        extra.append("a meadow")
    body = "\n".join(pick(28) for _ in range(4))
    return f"# {pick(4)}\n{body}\n{' '.join(extra)}\n"


def _fill(svc: Service, n: int) -> float:
    rng = random.Random(7)
    vocab = _words(rng)
    svc.create_store(ADMIN, StoreCreate(slug="s", max_records=10 ** 6, max_store_bytes=10 ** 10))
    t = time.perf_counter()
    ops = []
    for i in range(n):
        ops.append({"op": "create", "body": {"path": f"topic{i % 20:02d}/note{i:05d}.md",
                                              "content": _content(i, n, vocab, rng)}})
        if len(ops) == 100 or i == n - 1:
            svc.batch(ADMIN, "s", BatchRequest.model_validate({"operations": ops}).operations)
            ops = []
    return time.perf_counter() - t


def _measure(svcs: dict[int, Service]) -> dict[int, dict[str, dict]]:
    """Best time of every case on every size, the sizes and cases interleaved round by round
    (a busy machine slows them alike)."""
    best: dict[int, dict[str, float]] = {n: {} for n in svcs}
    cpu: dict[int, dict[str, float]] = {n: {} for n in svcs}
    hits: dict[int, dict[str, int]] = {n: {} for n in svcs}
    for _ in range(REPS):
        for n, svc in svcs.items():
            for name, q, order in CASES:
                c, t = time.thread_time(), time.perf_counter()
                page = svc.search(ADMIN, "s", q, order=order, match="any", limit=20, max_lines=5)
                dt, dc = (time.perf_counter() - t) * 1000, (time.thread_time() - c) * 1000
                best[n][name] = min(dt, best[n].get(name, dt))
                cpu[n][name] = min(dc, cpu[n].get(name, dc))
                hits[n][name] = len(page.hits)
    return {n: {name: {"ms": round(best[n][name], 3), "cpu_ms": round(cpu[n][name], 3), "hits": hits[n][name]}
                for name in best[n]} for n in svcs}


def run_sizes(urls: dict[int, str]) -> dict:
    """Fill one database per size, then measure them together."""
    dbs = {n: Database(url) for n, url in urls.items()}
    try:
        svcs = {n: Service(db) for n, db in dbs.items()}
        fills = {n: _fill(svc, n) for n, svc in svcs.items()}
        cases = _measure(svcs)
        return {n: {"fill_s": round(fills[n], 2), "cases": cases[n]} for n in urls}
    finally:
        for db in dbs.values():
            db.dispose()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="3000,30000")
    ap.add_argument("--no-pg", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results-ranked-search.json"))
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    results: dict = {"sqlite": {}, "postgresql": {}}
    work = Path(tempfile.mkdtemp(prefix="memfuse-bench-rank-"))
    try:
        results["sqlite"] = run_sizes({n: f"sqlite:///{work}/db{n}.sqlite" for n in sizes})
        print(f"sqlite: {results['sqlite']}", flush=True)
        if not args.no_pg:
            import os

            if pg_bindir() is None:
                print("PostgreSQL not installed: skipped", flush=True)
            else:
                with pg_cluster() as base, contextlib.ExitStack() as stack:
                    os.environ["MEMFUSE_TEST_DB_URL"] = base
                    urls = {n: stack.enter_context(fresh_db_url()) for n in sizes}
                    results["postgresql"] = run_sizes(urls)
                    print(f"postgresql: {results['postgresql']}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    lo, hi = sizes[0], sizes[-1]
    print(f"\n| database | search | {lo:,} records: wall / CPU ms | {hi:,} records: wall / CPU ms "
          "| ratio wall / CPU |")
    print("|---|---|---:|---:|---:|")
    for dbname, per in results.items():
        if not per:
            continue
        for name, _, _ in CASES:
            a, b = per[lo]["cases"][name], per[hi]["cases"][name]
            print(f"| {dbname} | {name} | {a['ms']:.2f} / {a['cpu_ms']:.2f} | {b['ms']:.2f} / {b['cpu_ms']:.2f} "
                  f"| {b['ms'] / a['ms']:.1f}× / {b['cpu_ms'] / max(a['cpu_ms'], 1e-3):.1f}× |")
        print(f"| {dbname} | (fill, s) | {per[lo]['fill_s']} | {per[hi]['fill_s']} | |")


if __name__ == "__main__":
    main()
