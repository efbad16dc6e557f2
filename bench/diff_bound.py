"""CPU-ms of the line diffs memfuse runs on untrusted content (memfuse.diffwork; attack 13
F11, F12), for the tester's hostile input (N lines, every other line changed by the other
writer, line 1 by this one) and a normal control (20,000 lines, one edit at each end).
Run it once per tree (PYTHONPATH=<tree>) and compare; prints one JSON line per case:
{"case", "n", "cpu_ms", "outcome"}. Usage: PYTHONPATH=. python bench/diff_bound.py [N ...]"""
import json
import sys
import time

from memfuse.server.console import render
from memfuse.sidecar.conflict import merge_lines


def lines(n):
    return [f"line {i:05d} " + "abcdefghij" * 3 + "\n" for i in range(n)]


def case(name, n, fn):
    t = time.process_time()
    try:
        r = fn()
        out = "none" if r is None else "result"
    except Exception as err:  # DiffTooCostly on the bounded tree
        out = type(err).__name__
    print(json.dumps({"case": name, "n": n, "cpu_ms": round((time.process_time() - t) * 1000), "outcome": out}),
          flush=True)


for n in [int(x) for x in sys.argv[1:]] or [4000]:
    base = lines(n)
    alt = [("REMOTE " + x) if i % 2 and i > 2 else x for i, x in enumerate(base)]
    ours = ["LINE " + base[0]] + base[1:]
    b, t, o = ("".join(x).encode() for x in (base, alt, ours))
    case("merge_hostile", n, lambda: merge_lines(b, t, o))
    case("line_diff_hostile", n, lambda: render.line_diff("".join(base), "".join(alt)))
    case("unified_diff_hostile", n, lambda: render.unified_diff("".join(base), "".join(alt), "a", "b"))
base = lines(20000)
theirs = base[:-1] + ["REMOTE " + base[-1]]
ours = ["LINE " + base[0]] + base[1:]
b, t, o = ("".join(x).encode() for x in (base, theirs, ours))
case("merge_normal", 20000, lambda: merge_lines(b, t, o))
case("line_diff_normal", 20000, lambda: render.line_diff("".join(base), "".join(theirs)))
