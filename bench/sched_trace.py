"""One writer's create-write-close as a serial pipeline, read from the scheduler: which
process holds the critical path for how long, per file (issue 25 item 2).

``perf sched record`` (system-wide ``sched:*`` tracepoints, no sampling) while one writer
creates files on a memfuse mount; this module reads ``perf script``'s text of it and cuts the
trace into *cycles*, one per file, at four wake-ups every file makes in this order:

==========  =======================================================================
``t_ans``   a thread of ``memfuse serve`` wakes the sidecar: the commit's answer sent
``t_reply`` the sidecar wakes a bench thread: the FLUSH reply (``close(2)`` returns)
``t_send``  the sidecar wakes serve's loop thread: the next file's commit request sent
``t_hop``   serve's loop wakes another serve thread: the write handed to the writer
==========  =======================================================================

and reports, per cycle, the four segments between them (µs): ``answer_to_reply`` (the sidecar's
handling of the answer), ``reply_to_send`` (the bench's next ``open``/``write``/``close`` through
the kernel and the sidecar's FUSE handlers, up to the commit's send), ``send_to_hop`` (serve's
loop: the request read, checked and queued), ``hop_to_answer`` (the writer thread: its wake, the
job, the commit's fsync, the answer); and what each party ran in the cycle (``sched_stat_runtime``,
µs), its context switches, and how often serve's writer thread was woken. Medians and means over
the cycles that hold exactly one of each boundary in order (others, e.g. the full-text drain's
or a periodic task's, are counted as ``skipped``).

Usage: ``prof_write.py --trace DIR`` records and prints it; or by hand, ``python
bench/sched_trace.py sched.data --bench PID --sidecar PID --serve PID`` (thread group ids).
Needs ``perf`` with the ``sched`` tracepoints readable (root, or ``perf_event_paranoid`` ≤ 1).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

FIELDS = "pid,tid,cpu,time,event,trace"
_LINE = re.compile(r"^\s*(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+(\S+):\s*(.*)$")
_WAKE = re.compile(r"pid=(\d+)")
_SWITCH = re.compile(r"prev_pid=(\d+) .*?prev_state=(\S+) ==> .*?next_pid=(\d+)")
_RUNTIME = re.compile(r"pid=(\d+) runtime=(\d+)")
SEGMENTS = ("answer_to_reply", "reply_to_send", "send_to_hop", "hop_to_answer")


def record(out: Path, seconds: float) -> subprocess.Popen:
    """Start ``perf sched record`` of the whole machine into ``out`` for ``seconds`` s (it
    stops by itself: ``-- sleep``). Raises ``FileNotFoundError`` without ``perf``."""
    return subprocess.Popen(["perf", "sched", "record", "-o", str(out), "--", "sleep", str(seconds)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def script(data: Path) -> str:
    """``perf script`` of a recording, one event a line with thread group and thread ids."""
    return subprocess.run(["perf", "script", "-i", str(data), "-F", FIELDS], capture_output=True,
                          text=True, timeout=600, check=True).stdout


@dataclass
class _Cycle:
    marks: list[tuple[str, float]] = field(default_factory=list)
    run: dict[str, int] = field(default_factory=dict)  # party -> ns
    switches: dict[str, int] = field(default_factory=dict)  # party -> context switches
    writer_wakes: int = 0


def analyse(text: str, bench: int, sidecar: int, serve: int) -> dict:
    """The cycles of ``text`` (``perf script -F pid,tid,cpu,time,event,trace``) for the bench
    process ``bench``, the sidecar ``sidecar`` and ``memfuse serve`` ``serve`` (thread group
    ids): ``{"cycles": n, "skipped": n, "us": {segment: {"median", "mean"}}, "run_us":
    {party: median}, "switches": {party: median}, "writer_wakes": median, "cycle_us": median}``.
    Parties: ``bench``, ``sidecar``, ``serve_loop`` (serve's main thread), ``serve_other`` (its
    other threads: the writer and periodic ones), ``other`` (kworkers, every other process)."""
    tgid: dict[int, int] = {}
    for line in text.splitlines():  # every thread's group first: wakes name a tid only
        m = _LINE.match(line)
        if m:
            tgid[int(m.group(2))] = int(m.group(1))

    def party(tid: int) -> str:
        g = tgid.get(tid)
        if tid == 0:
            return "idle"
        if g == bench:
            return "bench"
        if g == sidecar:
            return "sidecar"
        if g == serve:
            return "serve_loop" if tid == serve else "serve_other"
        return "other"

    cycles: list[_Cycle] = []
    cur = _Cycle()
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        tid, t, ev, rest = int(m.group(2)), float(m.group(4)), m.group(5), m.group(6)
        who = party(tid)
        if ev == "sched:sched_waking":
            w = _WAKE.search(rest)
            if not w:
                continue
            target = int(w.group(1))
            to = party(target)
            if who in ("serve_loop", "serve_other") and target == sidecar:
                if cur.marks:
                    cycles.append(cur)
                cur = _Cycle(marks=[("ans", t)])
            elif who == "sidecar" and to == "bench":
                cur.marks.append(("reply", t))
            elif who == "sidecar" and target == serve:
                cur.marks.append(("send", t))
            elif who == "serve_loop" and to == "serve_other":
                cur.writer_wakes += 1
                cur.marks.append(("hop", t))
        elif ev == "sched:sched_switch":
            s = _SWITCH.search(rest)
            if s:
                p = party(int(s.group(1)))
                cur.switches[p] = cur.switches.get(p, 0) + 1
        elif ev == "sched:sched_stat_runtime":
            r = _RUNTIME.search(rest)
            if r:
                p = party(int(r.group(1)))
                cur.run[p] = cur.run.get(p, 0) + int(r.group(2))
    segs: dict[str, list[float]] = {k: [] for k in SEGMENTS}
    runs: dict[str, list[float]] = {}
    sw: dict[str, list[float]] = {}
    wakes: list[float] = []
    lengths: list[float] = []
    skipped = 0
    for i, c in enumerate(cycles[1:-1], 1):  # the first and last may be cut by the recording
        names = [n for n, _ in c.marks]
        first = {n: t for n, t in reversed(c.marks)}  # the first time of each boundary
        ok = (names[0] == "ans" and names.count("ans") == 1 and all(k in first for k in ("reply", "send", "hop"))
              and first["ans"] < first["reply"] < first["send"] < first["hop"])
        if not ok:
            skipped += 1
            continue
        nxt = cycles[i + 1].marks[0][1]
        bounds = [first["ans"], first["reply"], first["send"], first["hop"], nxt]
        for k, a, b in zip(SEGMENTS, bounds, bounds[1:]):
            segs[k].append((b - a) * 1e6)
        lengths.append((nxt - first["ans"]) * 1e6)
        for p in ("bench", "sidecar", "serve_loop", "serve_other", "other"):
            runs.setdefault(p, []).append(c.run.get(p, 0) / 1000)
            sw.setdefault(p, []).append(c.switches.get(p, 0))
        wakes.append(c.writer_wakes)
    if not lengths:
        return {"cycles": 0, "skipped": skipped}
    med = statistics.median
    return {
        "cycles": len(lengths), "skipped": skipped,
        "cycle_us": round(med(lengths)),
        "us": {k: {"median": round(med(v)), "mean": round(statistics.fmean(v))} for k, v in segs.items()},
        "run_us": {p: round(med(v)) for p, v in runs.items()},
        "switches": {p: med(v) for p, v in sw.items()},
        "writer_wakes": med(wakes),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", type=Path, help="a perf sched recording (perf.data)")
    ap.add_argument("--bench", type=int, required=True)
    ap.add_argument("--sidecar", type=int, required=True)
    ap.add_argument("--serve", type=int, required=True)
    a = ap.parse_args()
    print(json.dumps(analyse(script(a.data), a.bench, a.sidecar, a.serve)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
