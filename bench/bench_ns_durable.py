"""What a namespace change's wait for the outbox journal costs (ns27): ``rm -rf`` of 2,000
files, ``sed -i`` of a 2 KB file and ``mv`` of one file, on a ``memfuse serve`` + ``memfuse
mount`` pair (``--commit-wait`` 10 s), every file committed before it is timed.

    .venv/bin/python bench/bench_ns_durable.py [--quick]

Since ns27 an unlink, a rename and a chmod return once their outbox entry is on disk (one
journal transaction each when they come one at a time, as from ``rm -rf``); before, they
returned at once and the entry was written later (lost by a kill -9 meanwhile).
"""
from __future__ import annotations

import statistics
import subprocess
import time
from pathlib import Path

from common import Mount, Row, Session, main_for

STORE = "nsdur"
WS = "ws-nsdur"


def drained(m: Mount, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while m.status()["outbox"]["depth"]:
        if time.monotonic() > deadline:
            raise AssertionError("the outbox did not drain")
        time.sleep(0.2)


def make_files(root: Path, n: int) -> None:
    for d in range(10):
        (root / f"d{d:02d}").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"d{i % 10:02d}" / f"f{i:05d}.md").write_text(f"# file {i}\nsome note\n")


def run(s: Session) -> list[Row]:
    n = 500 if s.quick else 2000
    n_sed = 20 if s.quick else 50
    tok = s.workspace(WS, (STORE,))
    m = Mount(s, s.cp, WS, tok, "nsdur")
    try:
        m.start(STORE, nonempty=False)
        root = m.mountpoint / STORE
        s.say(f"making {n} files")
        make_files(root / "tree", n)
        drained(m)
        s.say(f"rm -rf of {n} files")
        t0 = time.perf_counter()
        subprocess.run(["rm", "-rf", str(root / "tree")], check=True, timeout=600)
        t_rm = time.perf_counter() - t0
        drained(m)
        s.say(f"sed -i of a 2 KB file x{n_sed}; mv x{n_sed}")
        p = root / "sed" / "notes.md"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(("# notes\n" + "the agent prefers tea, reviewed on tuesday.\n" * 48)[:2048])
        drained(m)
        sed = []
        for i in range(n_sed):
            t0 = time.perf_counter()
            subprocess.run(["sed", "-i", f"s/tuesday/day{i}/", str(p)], check=True, timeout=60)
            sed.append(time.perf_counter() - t0)
        drained(m)
        mv = []
        for i in range(n_sed):
            a, b = root / "sed" / f"m{i}.md", root / "sed" / f"m{i + 1}.md"
            if i == 0:
                a.write_text("# moved\n")
                drained(m)
            t0 = time.perf_counter()
            a.rename(b)
            mv.append(time.perf_counter() - t0)
        drained(m)
    finally:
        m.stop()
    return [Row("rm_rf", f"rm -rf of {n} files (10 dirs)", t_rm, "s",
                detail={"files": n, "per_unlink_ms": t_rm / n * 1000}),
            Row("sed_2k_ns", f"sed -i of a 2 KB file, p50 of {n_sed}",
                statistics.median(sed) * 1000, "ms"),
            Row("mv_one", f"rename(2) of one file, p50 of {n_sed}",
                statistics.median(mv) * 1000, "ms")]


if __name__ == "__main__":
    raise SystemExit(main_for(run, "ns_durable"))
