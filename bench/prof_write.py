"""create-write-close rate and CPU per file per process, optionally profiled with py-spy.

    .venv/bin/python bench/prof_write.py [--n 1000] [--rounds 3] [--threads 1,4,16]
                                         [--juicefs] [--pyspy DIR] [--callgrind DIR]
                                         [--cprofile PREFIX] [--trace DIR]
                                         [--count-syncs] [--ablate-serve-fsync [off|deferred]]

One ``memfuse serve`` (SQLite) and one sidecar (``--commit-wait`` 10 s: every close returns
once the control plane has the record). Each round writes ``n`` files of ~550 B
(``bench_write.content``) with 1 writer, then with each number of writer threads in
``--threads``, into fresh directories; it prints files/s and the CPU milliseconds per file of
the sidecar and of the control plane (``/proc/PID/stat``). With ``--juicefs`` the peer
(``common.JuiceFS``) runs the same writes in the same rounds (interleaved), so every rate has
a ratio to the peer measured minutes apart on the same machine. With ``--pyspy DIR`` the one-
writer part of the first round is sampled by ``py-spy record`` in both processes (raw
collapsed stacks ``DIR/sidecar.txt`` and ``DIR/serve.txt``, idle frames dropped); py-spy must
be on PATH or in the venv. With ``--callgrind DIR`` the sidecar runs under valgrind's callgrind
(instrumentation off until a measured part starts; dumps in ``DIR``) and each row carries the
instructions it executed per file (``sidecar_ir_per_file``, user space, the same on a loaded
machine as on a quiet one, less the idle rate measured right after: ``idle_ir_per_s``; without
that subtraction: ``sidecar_ir_per_file_raw``); the
sidecar then runs ~50x slower, so its files/s and CPU are not figures, and with several
writers its batches differ from a normal run's. Every row splits the CPU per file into
user and system time (``cpu_ms_per_file_user_sys``). ``--count-syncs``: the one-writer part
of the first round counts the ``fsync(2)`` and ``fdatasync(2)`` calls of serve, the sidecar and
JuiceFS (``perf stat`` on the ``syscalls`` tracepoints; root or ``perf_event_paranoid`` <= 1),
per file written: a ``syncs_per_file`` object in that round's line. ``--ablate-serve-fsync``:
``memfuse serve`` commits without waiting for the disk (``bench/ablate_fsync``: SQLite's
``synchronous=NORMAL``, JuiceFS's durability), an ablation that prices the control plane's
per-commit ``fdatasync``, never a mode of memfuse; ``--ablate-serve-fsync deferred``
(``bench/ablate_fsync_deferred``): a syncer thread ``fdatasync``s serve's WAL after each answer
and the sidecar journals every write at once, the cost of the deferred-sync design (bench/README.md,
"Priced in session 25"). Results go to stdout as JSON lines, one per
measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import common
import sched_trace
from bench_write import STORE, WS, write_files
from common import Mount, Session, cpu_s, loadavg


def _pyspy() -> str | None:
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def _record(pid: int, out: Path) -> subprocess.Popen:
    exe = _pyspy()
    assert exe, "py-spy not found"
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--format", "raw", "--rate", "250",
                             "--threads", "--output", str(out), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_tracer(p: subprocess.Popen) -> None:
    """SIGINT to a tracer (py-spy, strace) so it writes its output; killed after 60 s."""
    p.send_signal(signal.SIGINT)
    try:
        p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (``/proc/PID/task/*/children``), e.g. the JuiceFS daemon
    its ``juicefs mount`` starts."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


class _SyncCount:
    """``perf stat`` of the ``fsync`` and ``fdatasync`` system calls of named groups of processes
    (all their threads), from construction to ``stop``."""

    EVENTS = ("syscalls:sys_enter_fsync", "syscalls:sys_enter_fdatasync")

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.procs = {}
        for name, pids in groups.items():
            self.procs[name] = subprocess.Popen(
                ["perf", "stat", "-x", ",", "-e", ",".join(self.EVENTS), "-p", ",".join(map(str, pids))],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(0.3)  # perf attached

    def stop(self, files: int) -> dict[str, float | None]:
        """Syncs per file of each group (None when perf could not count them)."""
        out: dict[str, float | None] = {}
        for name, p in self.procs.items():
            p.send_signal(signal.SIGINT)
            try:
                _, err = p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                out[name] = None
                continue
            total, seen = 0, False
            for line in err.splitlines():
                fields = line.split(",")
                if len(fields) > 2 and fields[2] in self.EVENTS and fields[0].strip().isdigit():
                    total += int(fields[0])
                    seen = True
            out[name] = round(total / files, 3) if seen else None
        return out


def user_sys(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds used so far by ``pid``, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tck = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tck, int(fields[12]) / tck


def _callgrind_launcher(out: Path) -> str:
    """A script that runs ``memfuse`` under callgrind with instrumentation off (dumps
    ``out/cg.PID.N``), for ``common.MEMFUSE``."""
    sh = out / "memfuse-callgrind"
    sh.write_text("#!/bin/sh\n"
                  f"exec valgrind --tool=callgrind --instr-atstart=no --trace-children=no "
                  f"--callgrind-out-file={out}/cg.%p {sys.executable} {common.MEMFUSE} \"$@\"\n")
    sh.chmod(0o755)
    return str(sh)


def _cg(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], capture_output=True, timeout=600,
                   check=True)


def callgrind_ir(pid: int, out: Path) -> int:
    """Instructions ``pid`` executed since its counters were last zeroed: dump them
    (``callgrind_control -d``), read the dump's total, zero them."""
    before = set(out.glob(f"cg.{pid}*"))
    _cg(pid, "-d")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        for p in set(out.glob(f"cg.{pid}*")) - before:
            for line in p.read_text(errors="replace").splitlines():
                if line.startswith(("totals:", "summary:")):
                    _cg(pid, "-z")
                    return int(line.split()[1])
        time.sleep(0.2)
    raise RuntimeError(f"no callgrind dump from {pid}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", default="4,16")
    ap.add_argument("--juicefs", action="store_true")
    ap.add_argument("--pyspy", type=Path)
    ap.add_argument("--label", default="")
    ap.add_argument("--callgrind", type=Path, metavar="DIR")
    ap.add_argument("--trace", type=Path, metavar="DIR",
                    help="perf sched record of the first round's one-writer part (DIR/sched.data, "
                         "--trace-seconds long) cut into the pipeline's segments per file "
                         "(bench/sched_trace.py): a 'trace' object in that round's line")
    ap.add_argument("--trace-seconds", type=float, default=2.0)
    ap.add_argument("--cprofile", metavar="PREFIX",
                    help="cProfile the sidecar's trio thread during each one-writer part "
                         "(bench/sigprof: stats in PREFIX.PID, the last part's; PREFIX's directory "
                         "is made if missing)")
    ap.add_argument("--count-syncs", action="store_true",
                    help="fsync/fdatasync calls per file of serve, the sidecar and JuiceFS in the first "
                         "round's one-writer part (perf stat): 'syncs_per_file' in that line")
    ap.add_argument("--ablate-serve-fsync", nargs="?", const="off", choices=("off", "deferred"),
                    help="memfuse serve commits with SQLite synchronous=NORMAL: 'off' (the default "
                         "when named, bench/ablate_fsync): what the control plane's per-commit "
                         "fdatasync costs; 'deferred' (bench/ablate_fsync_deferred): a syncer thread "
                         "fdatasyncs the WAL after each answer and the sidecar journals every write "
                         "at once, the cost of the proposed close path; never a memfuse mode")
    a = ap.parse_args()
    if a.ablate_serve_fsync:  # inherited by memfuse serve (bench/ablate_fsync*/sitecustomize.py)
        d = "ablate_fsync" if a.ablate_serve_fsync == "off" else "ablate_fsync_deferred"
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(Path(__file__).resolve().parent / d), *filter(None, [os.environ.get("PYTHONPATH")])])
    if a.callgrind is not None:
        a.callgrind = a.callgrind.resolve()
        a.callgrind.mkdir(parents=True, exist_ok=True)
        common.MEMFUSE = _callgrind_launcher(a.callgrind)
    threads = [int(x) for x in a.threads.split(",") if x]
    if a.cprofile:  # inherited by the sidecar (bench/sigprof/sitecustomize.py)
        prefix = Path(a.cprofile).resolve()
        prefix.parent.mkdir(parents=True, exist_ok=True)  # the sidecar writes PREFIX.PID there
        os.environ["MEMFUSE_SIGPROF"] = str(prefix)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(Path(__file__).resolve().parent / "sigprof"), *filter(None, [os.environ.get("PYTHONPATH")])])
    with Session(quick=True, verbose=True) as s:
        tok = s.workspace(WS, (STORE,))
        m = Mount(s, s.cp, WS, tok, "writer")
        m.start(STORE, nonempty=False, timeout=900 if a.callgrind else 180)
        s.on_close(m.stop)
        jfs = s.juicefs() if a.juicefs else None
        write_files(m.mountpoint / STORE / "warmup", 50)
        if jfs is not None:
            write_files(jfs.mountpoint / "warmup", 50)
        for r in range(a.rounds):
            for t in dict.fromkeys([1, *threads]):  # 1 first, each count once
                spies = []
                if a.pyspy and r == 0 and t == 1:
                    a.pyspy.mkdir(parents=True, exist_ok=True)
                    spies = [_record(m.pid, a.pyspy / "sidecar.txt"),
                             _record(s.cp.proc.pid, a.pyspy / "serve.txt")]
                    time.sleep(1.0)
                if a.callgrind:
                    _cg(m.pid, "-i", "on")
                    callgrind_ir(m.pid, a.callgrind)  # zeroed
                if a.cprofile and t == 1:
                    os.kill(m.pid, signal.SIGUSR1)
                cg: dict[str, Any] = {}
                tracer = None
                if a.trace and r == 0 and t == 1:
                    a.trace.mkdir(parents=True, exist_ok=True)
                    tracer = sched_trace.record(a.trace / "sched.data", a.trace_seconds)
                counting = a.count_syncs and r == 0 and t == 1
                syncs = _SyncCount({"serve": [s.cp.proc.pid], "sidecar": [m.pid]}) if counting else None
                tz = time.monotonic()
                c0 = (cpu_s(m.pid), cpu_s(s.cp.proc.pid))
                u0 = user_sys(m.pid)
                dt = write_files(m.mountpoint / STORE / f"r{r}t{t}", a.n, threads=t)
                c1 = (cpu_s(m.pid), cpu_s(s.cp.proc.pid))
                u1 = user_sys(m.pid)
                if syncs is not None:
                    cg["syncs_per_file"] = syncs.stop(a.n)
                if a.cprofile and t == 1:
                    time.sleep(0.6)  # the journal's lazy write of the last files (LAZY_DELAY)
                    os.kill(m.pid, signal.SIGUSR2)
                if a.callgrind:
                    time.sleep(0.6)  # the journal's lazy write of the last files (LAZY_DELAY)
                    ir, busy = callgrind_ir(m.pid, a.callgrind), time.monotonic() - tz
                    tz = time.monotonic()
                    time.sleep(2.0)  # nothing written: what the sidecar runs per second idle
                    idle = callgrind_ir(m.pid, a.callgrind) / (time.monotonic() - tz)
                    _cg(m.pid, "-i", "off")
                    cg.update({"sidecar_ir_per_file": round((ir - idle * busy) / a.n),
                          "sidecar_ir_per_file_raw": round(ir / a.n), "idle_ir_per_s": round(idle)})
                for p in spies:
                    stop_tracer(p)
                if tracer is not None:
                    tracer.wait(timeout=a.trace_seconds + 120)
                    cg["trace"] = sched_trace.analyse(sched_trace.script(a.trace / "sched.data"),
                                                      os.getpid(), m.pid, s.cp.proc.pid)
                peer = None
                if jfs is not None:
                    jsyncs = None
                    if counting and jfs.proc is not None:
                        jsyncs = _SyncCount({"juicefs": [jfs.proc.pid, *_children(jfs.proc.pid)]})
                    peer = a.n / write_files(jfs.mountpoint / f"r{r}t{t}", a.n, threads=t)
                    if jsyncs is not None:
                        cg.setdefault("syncs_per_file", {}).update(jsyncs.stop(a.n))
                row = {"label": a.label, "round": r, "writers": t, "files_s": round(a.n / dt, 1),
                       "juicefs_files_s": round(peer, 1) if peer else None,
                       "vs_juicefs": round(a.n / dt / peer, 2) if peer else None,
                       "cpu_ms_per_file": {"sidecar": round((c1[0] - c0[0]) / a.n * 1000, 3),
                                           "serve": round((c1[1] - c0[1]) / a.n * 1000, 3)},
                       "cpu_ms_per_file_user_sys": {"sidecar": [round((u1[i] - u0[i]) / a.n * 1000, 3)
                                                                for i in (0, 1)]},
                       **cg,
                       "loadavg": loadavg()}
                print(json.dumps(row), flush=True)
        st = m.status()
        print(json.dumps({"label": a.label, "outbox": st.get("outbox")}), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
