"""The sidecar's commit exchange alone: the client half of ``POST /v1/stores/{store}/records``
(issue 25 item 2; bench/README.md, "The close path, session 15: the commit exchange").

    .venv/bin/python bench/bench_commit_exchange.py [--n 2000] [--rounds 3]
                                                    [--callgrind DIR] [--profile FILE]

One ``memfuse serve`` (SQLite, loopback) and, in this process, one ``ApiClient`` built as the
sidecar builds it (``lean=True, bounded=True``, a token file, an instance id, an observer)
sending creates one at a time, each with an idempotency key, as the outbox sends a close's
record. Each round prints this process's CPU µs per request (user and system; the trio thread
is the only one working: ``time.thread_time``), wall µs per request, and the load average.
What it measures is what the sidecar's trio thread spends per commit request from
``create_record`` to the decoded ``Record``: building the body and the request, the socket
calls, trio's waits and the answer's parsing (not the outbox around it).

``--callgrind DIR``: this process runs again under valgrind's callgrind with instrumentation
off except during the rounds (``callgrind_control -i on/off``), and each round also reports
the instructions executed per request (``ir_per_req``, user space only: the kernel's share of
the socket calls is not in it; a count that does not move with the machine's load). The
server runs outside valgrind.

``--profile FILE``: cProfile the rounds (``pstats`` in FILE). ``--sample FILE``: a statistical
profile of the rounds' CPU instead (``ITIMER_PROF`` every 200 µs of process CPU, the Python stack
at each tick; collapsed stacks in FILE, as ``bench/sigprof``'s sample mode writes them).

Compare branches by running a ``git archive`` copy of the other with ``PYTHONPATH`` in the same
minutes, alternated.
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import trio  # noqa: E402

from bench_write import STORE, WS, content  # noqa: E402
from common import Session, loadavg  # noqa: E402

from memfuse.client.api import ApiClient  # noqa: E402
from memfuse.tokenfile import TokenFile  # noqa: E402

_UNDER = "MEMFUSE_BENCH_UNDER_CALLGRIND"


def _cg(*args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(os.getpid())], check=True, capture_output=True,
                   timeout=300)


def _dumped_ir(out: Path) -> int:
    """Instructions in the newest dump of this process (``callgrind_control -d``)."""
    before = set(out.glob(f"cg.{os.getpid()}*"))
    _cg("-d")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        for f in set(out.glob(f"cg.{os.getpid()}*")) - before:
            text = f.read_text(errors="replace")
            m = re.search(r"^totals: (\d+)", text, re.M) or re.search(r"^summary: (\d+)", text, re.M)
            if m:
                return int(m.group(1))
        time.sleep(0.2)
    raise RuntimeError("no callgrind dump")


_samples: collections.Counter[str] = collections.Counter()


def _tick(sig: int, frame: Any) -> None:
    names = []
    while frame is not None:
        co = frame.f_code
        names.append(f"{co.co_filename.rsplit('/', 1)[-1]}:{co.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    _samples[";".join(reversed(names))] += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=2000, help="creates per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--callgrind", type=Path, default=None, metavar="DIR")
    ap.add_argument("--profile", type=Path, default=None, metavar="FILE")
    ap.add_argument("--sample", type=Path, default=None, metavar="FILE")
    args = ap.parse_args()
    cg: Path | None = args.callgrind
    if cg is not None and not os.environ.get(_UNDER):
        cg = cg.resolve()
        cg.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, _UNDER: "1"}
        os.execvpe("valgrind", ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                                f"--callgrind-out-file={cg}/cg.%p", sys.executable, *sys.argv], env)
    if cg is not None:
        cg = cg.resolve()
    with Session(quick=True, verbose=False) as s:
        tok = s.workspace(WS, (STORE,))
        cp = s.cp
        seen: dict[tuple[str, str], int] = {}

        def observe(endpoint: str, status: str, seconds: float) -> None:  # as the sidecar's
            seen[(endpoint, status)] = seen.get((endpoint, status), 0) + 1

        async def go() -> None:
            c = ApiClient(cp.url, TokenFile(tok), instance="bench-exchange", lean=True, bounded=True)
            c.observer = observe
            async with c:
                for i in range(50):  # warm: the connection, caches, the server's statements
                    await c.create_record(STORE, f"warm/{i}.md", content(i).decode(),
                                          idempotency_key=str(uuid.uuid4()))
                for rnd in range(args.rounds):
                    bodies = [content(i).decode() for i in range(args.n)]
                    keys = [str(uuid.uuid4()) for _ in range(args.n)]
                    prof = cProfile.Profile() if args.profile is not None else None
                    if cg is not None:
                        _cg("-z")
                        _cg("-i", "on")
                    r0 = resource.getrusage(resource.RUSAGE_THREAD)
                    w0 = time.perf_counter()
                    if prof is not None:
                        prof.enable()
                    if args.sample is not None:
                        signal.signal(signal.SIGPROF, _tick)
                        signal.setitimer(signal.ITIMER_PROF, 0.0002, 0.0002)
                    for i in range(args.n):
                        await c.create_record(STORE, f"r{rnd}/d{i % 10}/f{i:05d}.md", bodies[i],
                                              idempotency_key=keys[i])
                    if prof is not None:
                        prof.disable()
                        prof.dump_stats(str(args.profile))
                    if args.sample is not None:
                        signal.setitimer(signal.ITIMER_PROF, 0, 0)
                        with open(args.sample, "w") as fh:
                            for stack, k in _samples.most_common():
                                fh.write(f"{stack} {k}\n")
                        _samples.clear()
                    w1 = time.perf_counter()
                    r1 = resource.getrusage(resource.RUSAGE_THREAD)
                    ir = None
                    if cg is not None:
                        _cg("-i", "off")
                        ir = round(_dumped_ir(cg) / args.n)
                    u = (r1.ru_utime - r0.ru_utime) / args.n * 1e6
                    sy = (r1.ru_stime - r0.ru_stime) / args.n * 1e6
                    print(json.dumps({
                        "round": rnd, "n": args.n, "cpu_us_per_req": round(u + sy, 1),
                        "user_us": round(u, 1), "sys_us": round(sy, 1),
                        "wall_us_per_req": round((w1 - w0) / args.n * 1e6, 1),
                        "ir_per_req": ir, "load": loadavg(),
                        "connections": getattr(getattr(c, "_lean", None), "connections_opened", None),
                    }), flush=True)

        trio.run(go)


if __name__ == "__main__":
    main()
