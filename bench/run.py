"""Run every memfuse benchmark in one session; print the table and write ``bench/results.json``.

    .venv/bin/python bench/run.py [--quick] [--only read,mount,...] [--keep] [--out FILE]

``--quick`` writes ``bench/results-quick.json`` (so it never overwrites the full run's file).

One ``Session``: the data set is written, ``memfuse serve`` started and the 10,000-record store
populated once, then each benchmark runs in turn (see ``bench/README.md``). A benchmark that
fails is reported as a row with its error and the others still run; the exit code is then 1.
Everything started is stopped and unmounted at the end, also on Ctrl-C or SIGTERM.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import traceback
from pathlib import Path

from common import BENCH, Row, Session, _install_signal_handlers, machine_meta, table, write_results

BENCHMARKS = ["read", "mount", "write", "propagation", "drain", "faults"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller N (2,000 files, 200 writes, ...)")
    ap.add_argument("--only", help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    ap.add_argument("--out", type=Path,
                    help="default bench/results.json, or bench/results-quick.json with --quick")
    args = ap.parse_args()
    if args.out is None:
        args.out = BENCH / ("results-quick.json" if args.quick else "results.json")
    names = args.only.split(",") if args.only else BENCHMARKS
    for n in names:
        if n not in BENCHMARKS:
            ap.error(f"unknown benchmark {n!r}")
    _install_signal_handlers()
    rows: list[Row] = []
    failed = False
    t_all = time.perf_counter()
    load_start = list(os.getloadavg())
    timings = {}
    with Session(quick=args.quick, keep=args.keep) as s:
        for name in names:
            mod = importlib.import_module(f"bench_{name}")
            t0 = time.perf_counter()
            s.say(f"=== {name}")
            try:
                rows += mod.run(s)
            except Exception as e:
                failed = True
                traceback.print_exc()
                rows.append(Row(f"{name}_error", f"{name}: FAILED ({type(e).__name__})", None, "",
                                detail={"error": str(e)[-3000:]}))
            timings[name] = round(time.perf_counter() - t0, 1)
        populate_s = s.populate_s
        peer = s.peer_meta
        n_files = len(s.files) if s._files is not None else None
    meta = machine_meta(args.quick)
    meta.update(loadavg_start=load_start, total_s=round(time.perf_counter() - t_all, 1), benchmark_s=timings,
                populate_s=populate_s, files=n_files, **peer)
    print()
    print(table(rows))
    print(f"\ntotal {meta['total_s']} s; per benchmark {timings}")
    write_results(rows, args.out, meta)
    print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
