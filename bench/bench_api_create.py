"""Serial creates straight to ``memfuse serve`` (no sidecar): one keep-alive client
(``ApiClient``) sends ``POST /v1/stores/{store}/records`` with an ``Idempotency-Key``, one at a
time, and the server's CPU per request is read from ``/proc`` (issue 25 item 2, the server half
of the close path; bench/README.md, "The close path").

Usage: ``python bench/bench_api_create.py [--n 1000] [--rounds 3] [--client httpx|lean]
[--op create|append]``; one JSON line per round:
requests/s, ms per request (wall; and the median and 90th percentile of the requests' round
trips, ``p50_ms`` / ``p90_ms``, which a loaded machine's stalls move less than the mean), serve's CPU ms per request (all threads; user / system; the
event-loop thread apart from the others), its context switches per request, the load average.
Compare branches by running a ``git archive`` copy of the other with ``PYTHONPATH`` in the same
minutes (wall figures swing with the machine's load; CPU per request holds better).

``--client lean``: the sidecar's own client path (``ApiClient(lean=True)``: a request's head and
body in one write), not httpx (two writes: the server often reads the head before its body).

``--op append``: appends instead (``POST .../records/{id}/append``, what the sidecar sends for
``echo line >> f``): each round appends ``--n`` lines of ~60 bytes to a record of its own
(created before the round, as the warm-up's record), each with the ``If-Match`` of the version
the previous append made and an ``Idempotency-Key``; ``--op mixed``: a create and an append in
turn, on the one connection (bench/README.md, "The close path, session 22: appends on the lean
path").

``--profile PREFIX``: cProfile serve's event-loop thread during each round (``bench/sigprof``),
its stats in ``PREFIX.rN`` (``pstats``; call counts per request are load-independent).

``--callgrind DIR``: run ``memfuse serve`` under valgrind's callgrind with instrumentation off
until a round starts (``callgrind_control -i on``), and report the instructions (Ir, user space,
all threads, and the event-loop thread's alone) per request of each round: a count that does not depend on the machine's load
(but for the loop's periodic work, which grows with the round's wall time: ``ir_loop_net_per_req``
subtracts the loop's instructions per second measured idle right after the round, times the
round's wall time)
(valgrind runs one thread at a time, ~50x slower: use ``--n 200``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import trio  # noqa: E402

from bench_write import STORE, WS, content  # noqa: E402
from common import Session, loadavg  # noqa: E402

from memfuse.client.api import ApiClient  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def _stat(path: str) -> tuple[float, float]:
    """(user, system) CPU seconds in ``path`` (a ``/proc/.../stat``)."""
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def sample(pid: int) -> dict[str, float]:
    """The process's CPU (user, system, its main thread's user + system and system alone,
    its threads' user + system summed by name) in seconds and its context switches (voluntary +
    involuntary, all threads) so far."""
    u, s = _stat(f"/proc/{pid}/stat")
    mu, ms = _stat(f"/proc/{pid}/task/{pid}/stat")
    out = {"user": u, "sys": s, "main": mu + ms, "main_sys": ms}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/comm") as f:
                name = "thread:" + f.read().strip().rstrip("0123456789").strip()
            tu, ts = _stat(f"/proc/{pid}/task/{task}/stat")
        except OSError:
            continue  # the thread ended
        if int(task) != pid:
            out[name] = out.get(name, 0.0) + tu + ts
    ctx = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if "ctxt_switches" in line:
                ctx += int(line.split(":")[1])
    out["ctx"] = ctx
    return out


def _callgrind(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True, timeout=120)


def _callgrind_ir(out_dir: Path, pid: int, thread: int | None = None, trigger: str | None = None) -> int:
    """Instructions (Ir) in the dumps callgrind wrote for ``pid`` so far (summed), of one
    thread (1: the main thread, serve's event loop; ``--separate-threads=yes`` dumps) or
    all; ``trigger``: only the dumps made before that function ran (``--split``)."""
    total = 0
    pattern = f"callgrind.out.{pid}*" if thread is None else f"callgrind.out.{pid}*-{thread:02d}"
    for f in out_dir.glob(pattern):
        text = f.read_text(errors="replace")
        if trigger is not None and f"Trigger: --dump-before={trigger}\n" not in text[:2000]:
            continue
        m = re.search(r"^totals: (\d+)", text, re.M) or re.search(r"^summary: (\d+)", text, re.M)
        if m:
            total += int(m.group(1))
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=1000, help="creates per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--callgrind", type=Path, default=None, metavar="DIR",
                    help="count serve's instructions per request with callgrind (dumps in DIR)")
    ap.add_argument("--client", choices=("httpx", "lean"), default="httpx",
                    help="the client: httpx (head and body in two writes) or the sidecar's lean "
                         "HTTP/1.1 path (ApiClient(lean=True): one write per request)")
    ap.add_argument("--op", choices=("create", "append", "mixed"), default="create",
                    help="the request: a create of a new record, or an append of one line to a "
                         "record of the round's (If-Match the version the previous one made), "
                         "or the two in turn (mixed)")
    ap.add_argument("--profile", type=Path, default=None, metavar="PREFIX",
                    help="cProfile serve's event-loop thread during each round (bench/sigprof): "
                         "pstats files PREFIX.rN")
    ap.add_argument("--split", action="store_true",
                    help="with --callgrind: also split the loop's instructions at the request's "
                         "receive and the writer's wake (callgrind dumps before ``sock_recv`` and "
                         "``os_eventfd_read``): ``ir_loop_to_hop_per_req`` (the head read, checked, "
                         "handed to the writer thread: the trace's ``send_to_hop``) and "
                         "``ir_loop_after_hop_per_req`` (the answer's end, the wait for the next)")
    ap.add_argument("--steady", action="store_true",
                    help="serve reads token revocations every 600 s, not every second (bench/sigprof/"
                         "sitecustomize.py): instruction counts per request free of the worker-thread "
                         "hops a slow (valgrind) request makes for them")
    args = ap.parse_args()
    if args.steady:
        os.environ["MEMFUSE_BENCH_REVOCATION_S"] = "600"
    if args.profile is not None or args.steady:  # memfuse serve inherits these (bench/sigprof/sitecustomize.py)
        if args.profile is not None:
            args.profile.parent.mkdir(parents=True, exist_ok=True)
            os.environ["MEMFUSE_SIGPROF"] = str(args.profile)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(Path(__file__).resolve().parent / "sigprof"), *filter(None, [os.environ.get("PYTHONPATH")])])
    n = args.n
    cg: Path | None = args.callgrind
    if cg is not None:  # memfuse serve under valgrind: the test helper starts this wrapper
        import mountutil

        cg.mkdir(parents=True, exist_ok=True)
        wrapper = cg / "memfuse-callgrind"
        split = " --dump-before=sock_recv --dump-before=os_eventfd_read" if args.split else ""
        wrapper.write_text(f"#!/bin/sh\nexec valgrind --tool=callgrind --instr-atstart=no{split} "
                           f"--separate-threads=yes --callgrind-out-file={cg}/callgrind.out.%p {sys.executable} "
                           f"{mountutil.MEMFUSE} \"$@\"\n")
        wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
        mountutil.MEMFUSE = str(wrapper)
        mountutil.serve_listening.__defaults__ = (0, 600)  # (offset, timeout): valgrind starts slowly
    with Session(quick=True, verbose=False) as s:
        tok = s.workspace(WS, (STORE,)).read_text().strip()
        cp = s.cp
        pid = cp.proc.pid

        async def go() -> None:
            async with ApiClient(cp.url, tok, lean=args.client == "lean") as c:
                # the record each append of a round extends: (id, sha256 of its current version)
                journal = ["", ""]

                async def one(rnd: int | str, i: int) -> None:
                    if args.op == "create" or (args.op == "mixed" and i % 2 == 0):
                        await c.create_record(STORE, f"r{rnd}/{i}.md", content(i).decode(),
                                              idempotency_key=str(uuid.uuid4()))
                        return
                    rec = await c.append_record(STORE, journal[0], f'{{"n": {i}, "event": "appended by the bench"}}\n',
                                                journal[1], idempotency_key=str(uuid.uuid4()))
                    journal[1] = rec.sha256

                async def new_journal(rnd: int | str) -> None:
                    rec = await c.create_record(STORE, f"journal-{rnd}.md", "# journal\n",
                                                idempotency_key=str(uuid.uuid4()))
                    journal[:] = [rec.id, rec.sha256]

                if args.op != "create":
                    await new_journal("warm")
                for i in range(50):  # warm: connection, caches, statements compiled
                    await one("warm", i)
                for rnd in range(args.rounds):
                    if args.op != "create":
                        await new_journal(rnd)
                    if cg is not None:
                        for f in cg.glob(f"callgrind.out.{pid}*"):
                            f.unlink()
                        _callgrind(pid, "-z")
                        _callgrind(pid, "-i", "on")
                    if args.profile is not None:
                        os.kill(pid, signal.SIGUSR1)
                    a = sample(pid)
                    times: list[float] = []  # each request's round trip, s
                    t = time.perf_counter()
                    for i in range(n):
                        t_req = time.perf_counter()
                        await one(rnd, i)
                        times.append(time.perf_counter() - t_req)
                    dt = time.perf_counter() - t
                    times.sort()
                    b = sample(pid)
                    if args.profile is not None:
                        os.kill(pid, signal.SIGUSR2)
                        stats = Path(f"{args.profile}.{pid}")
                        for _ in range(100):  # written by serve's signal handler
                            if stats.exists():
                                break
                            await trio.sleep(0.1)
                        stats.rename(f"{args.profile}.r{rnd}")
                    ir = ir_loop = ir_loop_net = None
                    split_ir: dict[str, int] = {}
                    if cg is not None:
                        _callgrind(pid, "-i", "off")
                        _callgrind(pid, "-d")
                        ir = round(_callgrind_ir(cg, pid) / n)
                        loop_total = _callgrind_ir(cg, pid, 1)
                        ir_loop = round(loop_total / n)
                        if args.split:  # a dump before the writer's wake ends a segment from the receive
                            split_ir = {"ir_loop_to_hop_per_req": round(_callgrind_ir(cg, pid, 1, "os_eventfd_read") / n),
                                        "ir_loop_after_hop_per_req": round(_callgrind_ir(cg, pid, 1, "sock_recv") / n)}
                        # the loop's periodic work (timers, sweeps) per second, idle: the same
                        # work in the round's wall time is not the requests' (under valgrind on
                        # a loaded machine a round takes minutes)
                        kept = cg / f"round{rnd}"  # the round's dumps, for callgrind_annotate
                        kept.mkdir(exist_ok=True)
                        for f in cg.glob(f"callgrind.out.{pid}*"):
                            f.rename(kept / f.name)
                        _callgrind(pid, "-z")
                        _callgrind(pid, "-i", "on")
                        t_idle = time.perf_counter()
                        await trio.sleep(min(dt, 30.0))
                        _callgrind(pid, "-i", "off")
                        idle_dt = time.perf_counter() - t_idle
                        _callgrind(pid, "-d")
                        idle_rate = _callgrind_ir(cg, pid, 1) / idle_dt
                        ir_loop_net = round((loop_total - idle_rate * dt) / n)
                    d = {k: b[k] - a.get(k, 0.0) for k in b}
                    print(json.dumps({
                        "round": rnd, "op": args.op, "client": args.client, "steady": args.steady, "req_s": round(n / dt, 1), "ms_per_req": round(dt / n * 1000, 3),
                        "p50_ms": round(times[n // 2] * 1000, 3), "p90_ms": round(times[n * 9 // 10] * 1000, 3),
                        "serve_cpu_ms": round((d["user"] + d["sys"]) / n * 1000, 3),
                        "user_ms": round(d["user"] / n * 1000, 3), "sys_ms": round(d["sys"] / n * 1000, 3),
                        "loop_thread_ms": round(d["main"] / n * 1000, 3),
                        "loop_sys_ms": round(d["main_sys"] / n * 1000, 3),
                        "other_threads_ms": round((d["user"] + d["sys"] - d["main"]) / n * 1000, 3),
                        "ctx_per_req": round(d["ctx"] / n, 2), "load": loadavg(), "ir_per_req": ir,
                        "ir_loop_per_req": ir_loop, "ir_loop_net_per_req": ir_loop_net, **split_ir,
                        "threads_ms": {k[7:]: round(v / n * 1000, 3) for k, v in d.items()
                                       if k.startswith("thread:") and v}}), flush=True)

        trio.run(go)


if __name__ == "__main__":
    main()
