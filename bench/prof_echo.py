"""What a create costs *besides* its own request (issue 25 item 2, session 15: the echo).

    .venv/bin/python bench/prof_echo.py [--n 500] [--rounds 2] [--reader] [--cprofile DIR]
                                        [--strace DIR] [--idle 5]

One ``memfuse serve`` (SQLite) and one writing sidecar (``prof_write.py``'s setup; with
``--reader`` a second sidecar mounted on the same store, which must see every write through
its change feed). Each round writes ``n`` files of ~550 B with one writer and prints, per
file: the CPU of each process split by thread name (``/proc/PID/task/*/stat``: the threads
other than the main one are the periodic and worker threads), the CPU the same processes
spend per second while idle (measured right after each round: what a create's wall time
costs in periodic work), and counters read from the sidecars' and serve's ``/metrics``
(feed pages applied, stream lines sent, wake-ups). ``--cprofile DIR``: cProfile the main
(trio) thread of serve and of every sidecar during the round (``bench/sigprof``; stats in
``DIR/prof.PID``, the last round's). ``--strace DIR``: ``strace -c -f`` of each process
during the last round (syscall counts per file; the run is slower then, its CPU figures are
not figures). One JSON line per round on stdout.

To compare two trees, run each tree's own copy of this script from its ``bench/`` with
``PYTHONPATH`` at that tree (``common.py`` puts its own tree first on ``sys.path``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import common
from bench_grep import ctx_switches
from bench_write import STORE, WS, write_files
from common import Mount, Session, loadavg
from prof_write import stop_tracer

TICK = os.sysconf("SC_CLK_TCK")


def threads_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of ``pid``'s threads so far, summed by thread name (the
    main thread as ``main``), and of the whole process as ``all`` (with the threads that
    ended: trio's idle worker threads exit after 10 s, their CPU leaves the thread list)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    out: dict[str, float] = {"all": (int(fields[11]) + int(fields[12])) / TICK}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                raw = f.read()
        except OSError:
            continue
        name = "main" if tid == str(pid) else raw[raw.index("(") + 1:raw.rindex(")")]
        name = re.sub(r"[-_ ]?\d+$", "", name) or name
        fields = raw.rsplit(")", 1)[1].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / TICK
    return out


def diff(a: dict[str, float], b: dict[str, float], per: float) -> dict[str, float]:
    """``(b - a) / per`` by key, in ms, keys with a change only."""
    return {k: round((b.get(k, 0.0) - a.get(k, 0.0)) / per * 1000, 3)
            for k in sorted(set(a) | set(b)) if b.get(k, 0.0) != a.get(k, 0.0)}


_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN|[+-]Inf)$")


def metrics(url: str, want: tuple[str, ...]) -> dict[str, float]:
    """The samples of ``url`` (Prometheus text) whose name starts with one of ``want``."""
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m and m.group(1).startswith(want) and not m.group(1).endswith(("_created", "_bucket")):
            key = m.group(1) + (m.group(2) or "")
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def admin_url(m: Mount) -> str | None:
    """The sidecar's admin ``/metrics`` address (from its status file), or None."""
    try:
        addr = json.loads((m.cache_dir / "mount.json").read_text()).get("admin")
    except (OSError, ValueError):
        return None
    return f"http://{addr}/metrics" if isinstance(addr, str) and addr else None


SIDE_METRICS = ("memfuse_sync", "memfuse_api_calls", "memfuse_outbox_committed")
SERVE_METRICS = ("memfuse_server_wakeups", "memfuse_server_bus_scans", "memfuse_server_stream_lines",
                 "memfuse_server_db_statements", "memfuse_server_requests")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reader", action="store_true", help="a second sidecar on the same store")
    ap.add_argument("--cprofile", type=Path, metavar="DIR")
    ap.add_argument("--strace", type=Path, metavar="DIR")
    ap.add_argument("--idle", type=float, default=3.0, help="seconds of idle measured after each round")
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    # inherited by serve and the sidecars (bench/sigprof/sitecustomize.py): OS thread names
    # (for the CPU by thread) and, with --cprofile, the profiles
    os.environ["MEMFUSE_THREAD_NAMES"] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parent / "sigprof"), *filter(None, [os.environ.get("PYTHONPATH")])])
    if a.cprofile:
        a.cprofile = a.cprofile.resolve()
        a.cprofile.mkdir(parents=True, exist_ok=True)
        os.environ["MEMFUSE_SIGPROF"] = str(a.cprofile / "prof")
    with Session(quick=True, verbose=True) as s:
        tok = s.workspace(WS, (STORE,))
        w = Mount(s, s.cp, WS, tok, "writer")
        w.start(STORE, nonempty=False)
        s.on_close(w.stop)
        mounts = [("writer", w)]
        if a.reader:
            r = Mount(s, s.cp, WS, tok, "reader")
            r.start(STORE, nonempty=False)
            s.on_close(r.stop)
            mounts.append(("reader", r))
        write_files(w.mountpoint / STORE / "warmup", 50)
        time.sleep(1.0)
        serve_pid = s.cp.proc.pid
        pids = {"serve": serve_pid, **{name: m.pid for name, m in mounts}}
        murls = {name: admin_url(m) for name, m in mounts}
        serve_metrics = s.cp.url.rstrip("/") + "/metrics"
        for rnd in range(a.rounds):
            last = rnd == a.rounds - 1
            if a.cprofile:
                for pid in pids.values():
                    os.kill(pid, signal.SIGUSR1)
            tracers = []
            if a.strace and last:
                a.strace.mkdir(parents=True, exist_ok=True)
                for name, pid in pids.items():
                    tracers.append(subprocess.Popen(
                        ["strace", "-c", "-f", "-p", str(pid), "-o", str(a.strace / f"{name}.txt")],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                time.sleep(1.0)
            c0 = {k: threads_cpu(p) for k, p in pids.items()}
            x0 = {k: ctx_switches(p) for k, p in pids.items()}
            m0 = {k: metrics(u, SIDE_METRICS) for k, u in murls.items() if u}
            sm0 = metrics(serve_metrics, SERVE_METRICS)
            dt = write_files(w.mountpoint / STORE / f"r{rnd}", a.n)
            if a.reader:  # until the reader shows the last file (bounded)
                target = mounts[1][1].mountpoint / STORE / f"r{rnd}" / f"d{(a.n - 1) % 10:02d}" / f"f{a.n - 1:05d}.md"
                deadline = time.monotonic() + 60
                while not target.exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
            time.sleep(0.6)  # the journal's lazy write of the last files
            c1 = {k: threads_cpu(p) for k, p in pids.items()}
            x1 = {k: ctx_switches(p) for k, p in pids.items()}
            m1 = {k: metrics(u, SIDE_METRICS) for k, u in murls.items() if u}
            sm1 = metrics(serve_metrics, SERVE_METRICS)
            if a.cprofile:
                for pid in pids.values():
                    os.kill(pid, signal.SIGUSR2)
            for t in tracers:
                stop_tracer(t)
            time.sleep(0.5)
            i0 = {k: threads_cpu(p) for k, p in pids.items()}
            t0 = time.monotonic()
            time.sleep(a.idle)
            i1 = {k: threads_cpu(p) for k, p in pids.items()}
            idle_s = time.monotonic() - t0
            row = {"label": a.label, "round": rnd, "files_s": round(a.n / dt, 1),
                   "cpu_ms_per_file": {k: diff(c0[k], c1[k], a.n) for k in pids},
                   "main_ctx_switches_per_file": {k: round((x1[k] - x0[k]) / a.n, 2) for k in pids},
                   "idle_cpu_ms_per_s": {k: diff(i0[k], i1[k], idle_s) for k in pids},
                   "sidecar_metrics_per_file": {k: {n: round((m1[k].get(n, 0) - v) / a.n, 3)
                                                     for n, v in m0[k].items() if m1[k].get(n, 0) != v}
                                                for k in m0},
                   "serve_metrics_per_file": {n: round((sm1.get(n, 0) - v) / a.n, 3)
                                              for n, v in sm0.items() if sm1.get(n, 0) != v},
                   "loadavg": loadavg()}
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
