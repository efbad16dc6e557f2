"""The sidecar's cost of one append as the file grows: CPU per append, or instructions.

    .venv/bin/python bench/prof_append.py [--n 100] [--callgrind DIR]

One ``memfuse serve`` (SQLite) and one sidecar; for files of 4 KiB, 64 KiB and 1 MiB:
3 warm-up appends, then ``--n`` appends of one line (``bench_append._appends``: open
``O_APPEND``, write, close, which waits for the commit). Prints per size the median wall
per append and the CPU per append of the sidecar and of ``memfuse serve``
(``/proc/PID/stat``), with the load average. With ``--callgrind DIR`` the sidecar runs under
valgrind's callgrind (instrumentation on only during the measured appends) and the
instructions it executed per append are printed instead (load-independent); the dumps stay
in ``DIR`` (``dump-<size>``, for ``callgrind_annotate``). ``--serve`` with it runs ``memfuse
serve`` under callgrind too and prints its instructions per append as well (dumps
``dump-serve-<size>``; its start takes a minute or more). To measure another commit's code,
run with ``PYTHONPATH`` pointing at a copy of its tree (the sidecar inherits it).
bench/README.md, "Appends, session 10: sidecar".
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import trio

import common
import mountutil
from bench_append import _appends, _body
from common import MEMFUSE, Mount, Session, cpu_s, median
from memfuse.client import ApiClient

SIZES = {"4k": 4 << 10, "64k": 64 << 10, "1m": 1 << 20}


def _callgrind_ir(pid: int, out: Path, prefix: str = "cg") -> tuple[int, Path]:
    """Dump ``pid``'s callgrind counters (its dumps are ``out/<prefix>.<pid>*``), zero them;
    (instructions since the last zeroing, the dump)."""
    before = set(out.glob(f"{prefix}.*"))
    subprocess.run(["callgrind_control", "-d", str(pid)], capture_output=True, timeout=300, check=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for p in set(out.glob(f"{prefix}.*")) - before:
            for line in p.read_text(errors="replace").splitlines():
                if line.startswith(("totals:", "summary:")):
                    subprocess.run(["callgrind_control", "-z", str(pid)], capture_output=True,
                                   timeout=300, check=True)
                    return int(line.split()[1]), p
        time.sleep(0.2)
    raise RuntimeError("no callgrind dump")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=100, help="appends measured per size")
    ap.add_argument("--callgrind", type=Path, metavar="DIR",
                    help="run the sidecar under callgrind; print instructions per append")
    ap.add_argument("--serve", action="store_true",
                    help="with --callgrind: memfuse serve under callgrind as well")
    args = ap.parse_args()
    out: Path | None = args.callgrind.resolve() if args.callgrind else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        real = subprocess.Popen

        def popen(cmd, *a, **kw):  # type: ignore[no-untyped-def]
            if cmd[:2] == [MEMFUSE, "mount"] or (args.serve and cmd[:2] == [MEMFUSE, "serve"]):
                prefix = "cg" if cmd[1] == "mount" else "cg-serve"
                cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--trace-children=no",
                       f"--callgrind-out-file={out}/{prefix}.%p", *cmd]
            return real(cmd, *a, **kw)

        common.subprocess.Popen = popen  # type: ignore[assignment,misc]
        if args.serve:  # a serve under valgrind takes more than the usual minute to listen
            listening = mountutil.serve_listening
            mountutil.serve_listening = lambda proc, log, offset=0, timeout=60: listening(  # type: ignore[assignment]
                proc, log, offset, timeout=900)
    n = args.n
    with Session(quick=True) as s:
        tok = s.workspace("wappend", ("journal",))

        async def roomy() -> None:  # a 1 MiB journal plus its appends fits one record
            async with ApiClient(s.cp.url, s.cp.admin_token) as c:
                await c.update_store("journal", max_record_bytes=8 << 20)

        trio.run(roomy)
        m = Mount(s, s.cp, "wappend", tok, "append", commit_wait=120 if out else 10)
        m.start("journal", nonempty=False, timeout=900 if out else 180)
        s.on_close(m.stop)
        for name, size in SIZES.items():
            f = m.mountpoint / "journal" / f"J-{name}.md"
            f.write_text(_body(size))
            _appends(f, 3)
            if out is not None:
                procs = [("sidecar", m.pid, "cg", f"dump-{name}")]
                if args.serve:
                    procs.append(("serve", s.cp.proc.pid, "cg-serve", f"dump-serve-{name}"))
                for _, pid, prefix, _ in procs:
                    subprocess.run(["callgrind_control", "-i", "on", str(pid)], capture_output=True,
                                   timeout=300, check=True)
                    _callgrind_ir(pid, out, prefix)
                _appends(f, n)
                for who, pid, prefix, dumped in procs:
                    total, dump = _callgrind_ir(pid, out, prefix)
                    subprocess.run(["callgrind_control", "-i", "off", str(pid)], capture_output=True,
                                   timeout=300, check=True)
                    dump.rename(out / dumped)
                    print(f"{name}: {total / n / 1e6:.2f} M instructions per append ({who}, "
                          f"callgrind, {n} appends)", flush=True)
                continue
            c0, k0 = cpu_s(m.pid), cpu_s(s.cp.proc.pid)
            times = _appends(f, n)
            c1, k1 = cpu_s(m.pid), cpu_s(s.cp.proc.pid)
            print(f"{name}: wall median {median(times) * 1e3:.2f} ms  sidecar CPU "
                  f"{(c1 - c0) / n * 1e3:.2f} ms/append  serve {(k1 - k0) / n * 1e3:.2f} ms  "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
