"""What each file's close makes durable: fsync-family system calls per created file, memfuse
beside JuiceFS in the same run (issue 25 item 2: the one-writer rate is compared with a peer,
so the comparison says what each side's close promises).

    .venv/bin/python bench/bench_peer_syncs.py [--n 500]

One writer in this process creates, writes ~500 B and closes ``n`` files (``bench_write.
write_files``) on a memfuse mount (``memfuse serve`` on SQLite + ``memfuse mount``) and on
JuiceFS (``common.JuiceFS``: SQLite metadata, a local file bucket, default settings), each with
``strace -f -c`` attached to every process of that side (memfuse: the sidecar and serve;
JuiceFS: its mount processes) for exactly that loop. Prints one JSON line per side: files/s
(under strace: slower than untraced, only the counts matter), and per file the calls of
``fsync``, ``fdatasync``, ``sync_file_range``, ``syncfs`` and ``msync`` and those of all
system calls (and the 12 most made), summed over the side's processes.

What it showed on this machine (bench/README.md, "The close path, session 20: what a close
makes durable"): memfuse ~1 fdatasync a file (serve's SQLite commit, ``synchronous=FULL``;
the sidecar's outbox journal writes nothing for a write the control plane acknowledged within
``Journal.HOLD``); JuiceFS 16 fsyncs for 500 files (its metadata commits are not synced one by
one): its close returns once its metadata transaction committed, not once it is on disk.

Needs ``strace`` (and ptrace rights: root, or ``kernel.yama.ptrace_scope`` 0); a side that
cannot be traced is skipped with the reason.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

from bench_write import STORE, WS, write_files
from common import Mount, Session

SYNCS = ("fsync", "fdatasync", "sync_file_range", "syncfs", "msync")
_ROW = re.compile(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)\s*$")


def _children(pid: int) -> list[int]:
    """``pid`` and its descendants (``/proc/PID/task/*/children``)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo.extend(int(c) for c in (task / "children").read_text().split())
            except OSError:
                pass
    return sorted(set(out))


def counts(text: str) -> dict[str, int]:
    """Calls per system call from ``strace -c``'s table (``calls`` column)."""
    d: dict[str, int] = {}
    for line in text.splitlines():
        m = _ROW.match(line)
        if m and m.group(2) != "total":
            d[m.group(2)] = d.get(m.group(2), 0) + int(m.group(1))
    return d


def traced(pids: list[int], out: Path, work) -> tuple[float, dict[str, int]]:
    """Run ``work()`` (returns seconds) with ``strace -f -c`` on each of ``pids``; return its
    seconds and the summed calls per system call."""
    tracers = []
    for i, pid in enumerate(pids):
        f = out.with_suffix(f".{i}")
        tracers.append((subprocess.Popen(["strace", "-f", "-c", "-p", str(pid), "-o", str(f)],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), f))
    time.sleep(1.0)  # attached to every thread
    try:
        dt = work()
    finally:
        time.sleep(0.7)  # the journal's lazy write of the last files (LAZY_DELAY)
        for p, _ in tracers:
            p.send_signal(signal.SIGINT)
        for p, _ in tracers:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    total: dict[str, int] = {}
    for _, f in tracers:
        for k, v in counts(f.read_text() if f.exists() else "").items():
            total[k] = total.get(k, 0) + v
    return dt, total


def line(side: str, n: int, dt: float, calls: dict[str, int]) -> dict:
    return {"side": side, "files": n, "files_s_traced": round(n / dt, 1),
            "syncs_per_file": {k: round(calls.get(k, 0) / n, 3) for k in SYNCS if calls.get(k)},
            "syscalls_per_file": round(sum(calls.values()) / n, 1),
            "top_per_file": {k: round(v / n, 2) for k, v in
                             sorted(calls.items(), key=lambda kv: -kv[1])[:12]}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=500)
    a = ap.parse_args()
    if shutil.which("strace") is None:
        print(json.dumps({"skipped": "strace not installed"}))
        return 0
    with Session(quick=True, verbose=True) as s:
        tok = s.workspace(WS, (STORE,))
        m = Mount(s, s.cp, WS, tok, "writer")
        m.start(STORE, nonempty=False)
        s.on_close(m.stop)
        write_files(m.mountpoint / STORE / "warmup", 50)
        dt, calls = traced([m.pid, s.cp.proc.pid], s.dir / "strace-memfuse",
                           lambda: write_files(m.mountpoint / STORE / "traced", a.n))
        print(json.dumps(line("memfuse", a.n, dt, calls)), flush=True)
        jfs = s.juicefs()
        if jfs is None or jfs.proc is None:
            print(json.dumps({"side": "juicefs", "skipped": s.peer_meta}))
            return 0
        write_files(jfs.mountpoint / "warmup", 50)
        dt, calls = traced(_children(jfs.proc.pid), s.dir / "strace-juicefs",
                           lambda: write_files(jfs.mountpoint / "traced", a.n))
        print(json.dumps(line("juicefs", a.n, dt, calls)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
