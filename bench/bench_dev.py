"""``memfuse dev``: start time and the cost of a committed write.

    .venv/bin/python bench/bench_dev.py [--quick]

``memfuse dev`` serves its in-process control plane over HTTP on loopback (hypercorn, the
console's server) and its sidecar is an HTTP client of it, as against ``memfuse serve``. This
measures what a user of dev sees: seconds from the process start until ``MOUNT/default`` is
there (fresh data directory each time: the first start creates the database; with the
console on and with ``--console-listen off``), and create-write-close of N files on the mount
(each close waits for the commit): files/s and the dev process's CPU ms per file (all its
threads: sidecar, app, HTTP server; from ``/proc/PID/stat``, robust to other load). To compare
with another version, run the same command in its checkout.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from common import MEMFUSE, Row, Session, cpu_s, is_mounted, loadavg, main_for, median, unmount


def _start(s: Session, name: str, console: str) -> tuple[subprocess.Popen, Path, float]:
    """Start ``memfuse dev`` in a fresh data directory; (process, mountpoint, seconds until
    the store directory is there)."""
    root = s.dir / name
    mnt = root / "memory"
    env = dict(os.environ, MEMFUSE_HOME=str(root / "home"), XDG_CACHE_HOME=str(root / "cache"),
               MEMFUSE_CONSOLE_LISTEN=console)
    root.mkdir(parents=True)
    log = (root / "dev.log").open("ab")
    t0 = time.perf_counter()
    proc = subprocess.Popen([MEMFUSE, "dev", str(mnt)], env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    s.track(proc, mnt)
    while not (is_mounted(mnt) and (mnt / "default").is_dir()):
        if proc.poll() is not None or time.perf_counter() - t0 > 120:
            raise RuntimeError(f"memfuse dev did not come up:\n{(root / 'dev.log').read_text()[-3000:]}")
        time.sleep(0.005)
    return proc, mnt, time.perf_counter() - t0


def _stop(s: Session, proc: subprocess.Popen, mnt: Path) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    finally:
        s.untrack(proc)
        unmount(mnt)


def run(s: Session) -> list[Row]:
    runs = 2 if s.quick else 4
    n = 100 if s.quick else 400
    starts: dict[str, list[float]] = {"127.0.0.1:0": [], "off": []}
    for i in range(runs):
        for console in starts:
            proc, mnt, took = _start(s, f"start-{i}-{console.replace(':', '_')}", console)
            starts[console].append(took)
            _stop(s, proc, mnt)
    s.say(f"dev: {n} create-write-close")
    proc, mnt, _ = _start(s, "writes", "127.0.0.1:0")
    try:
        d = mnt / "default"
        for i in range(20):  # warm-up
            (d / f"w{i}.md").write_text("warm\n")
        c0, t0 = cpu_s(proc.pid), time.perf_counter()
        for i in range(n):
            with open(d / f"f{i:04d}.md", "w") as f:
                f.write(f"note {i}: the agent prefers tea\n")
        wall, cpu = time.perf_counter() - t0, cpu_s(proc.pid) - c0
    finally:
        _stop(s, proc, mnt)
    load = f"load {loadavg()}"
    return [
        Row("dev_start", "memfuse dev: start until mounted, fresh data dir, console on (p50)",
            median(starts["127.0.0.1:0"]), "s", note=load, detail={"runs": starts}),
        Row("dev_start_off", "memfuse dev: start until mounted, --console-listen off (p50)",
            median(starts["off"]), "s", note=load),
        Row("dev_writes", f"memfuse dev: create-write-close of {n} files", n / wall, "files/s",
            note=load),
        Row("dev_write_cpu", "memfuse dev: process CPU per committed file", cpu / n * 1000, "ms",
            note="sidecar + app + HTTP server; " + load),
    ]


if __name__ == "__main__":
    raise SystemExit(main_for(run, "dev"))
