"""The writer side of one record create in process: ``Service.create_record`` (with an
``Idempotency-Key``, as the sidecar sends it) on a SQLite file, called serially from one thread
as ``memfuse serve``'s writer thread calls it; CPU per create from ``time.thread_time`` (issue 25
item 2; bench/README.md, "The close path, session 12: serve's writer").

Usage: ``python bench/prof_writer.py [--n 2000] [--rounds 3] [--nosync] [--bus] [--metrics] [--io] [--profile FILE]``;
one JSON line per round: CPU ms per create (this thread: user + system), wall ms, and, with
``--bus`` (the commit watcher started as ``memfuse serve`` starts it), the memfuse-bus
thread's CPU per create (``/proc``). ``--metrics``: the ``/metrics`` statement counter
listening as ``memfuse serve`` has it. ``--nosync``: ``PRAGMA synchronous=OFF`` on
every connection, so the figure excludes the commit's fsync (the durability promise keeps it in
``memfuse serve``; here only to read the rest). ``--profile FILE``: cProfile of the last round
to FILE (pstats).

Instructions per create: run it under ``valgrind --tool=callgrind --dump-before=getpgrp``
with ``--rounds 1``: the script calls ``os.getpgrp()`` (libc ``getpgrp``, called by nothing
else here) right before and after the timed round, so the second dump
(``callgrind.out.PID.2``) holds that round alone (``/tmp/servsql_cg.sh`` in the session's
notes; bench/README.md, "The close path, session 12: serve's writer").
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sqlalchemy import event  # noqa: E402
from sqlalchemy.engine import Engine  # noqa: E402

from bench_write import content  # noqa: E402
from common import loadavg  # noqa: E402

from memfuse.models import RecordCreate, WorkspaceCreate  # noqa: E402
from memfuse.server.base import IdempotencyRequest, Principal  # noqa: E402
from memfuse.server.db import Database  # noqa: E402
from memfuse.server.limits import ServerMetrics  # noqa: E402
from memfuse.server.service import Service  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def _bus_cpu() -> float:
    """CPU seconds of this process's memfuse-bus thread so far (found by its Python name:
    CPython 3.11 does not name the OS thread)."""
    import threading

    total = 0.0
    for t in threading.enumerate():
        if t.name != "memfuse-bus" or t.native_id is None:
            continue
        try:
            with open(f"/proc/self/task/{t.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / TICK
    return total


def _proc_io() -> dict[str, int]:
    """This process's /proc/self/io counters (syscw, wchar, syscr, rchar, ...)."""
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def _checkpoint(db: Database) -> None:
    """A checkpoint on the kept write connection now (an empty write transaction whose
    ``WalCheckpoints.due`` is made due), so ``WalCheckpoints.frames`` counts every frame
    written before it; the interval it learnt is kept."""
    wal = db._wal  # noqa: SLF001
    every = wal.every
    wal.every = 1
    with db.write_conn():
        pass
    if wal.every == 1:
        wal.every = every


def _page_size(db: Database) -> int:
    with db.read_conn() as conn:
        return int(conn.exec_driver_sql("PRAGMA page_size").scalar_one())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nosync", action="store_true")
    ap.add_argument("--profile", type=Path, default=None)
    ap.add_argument("--bus", action="store_true", help="run the commit watcher (memfuse-bus) as serve does")
    ap.add_argument("--io", action="store_true",
                    help="per create: WAL frames (the kept connection's checkpoints' count, a checkpoint forced at "
                         "the round's start and end), this process's write/read system calls and bytes (/proc/self/io), "
                         "this thread's user and system CPU")
    ap.add_argument("--metrics", action="store_true",
                    help="count statements for /metrics (a before_cursor_execute listener) as serve does")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="prof-writer-") as d:
        if args.nosync:  # every engine's connections, from the first (the schema's)
            @event.listens_for(Engine, "connect")
            def _nosync(dbapi_conn, _rec):  # noqa: ANN001
                dbapi_conn.execute("PRAGMA synchronous=OFF")
        db = Database(f"sqlite:///{d}/cp.db")
        svc = Service(db)
        if args.metrics:
            ServerMetrics().count_statements(db.engine)
        if args.bus:
            svc.records.bus.start()
        admin = Principal(workspace=None, name="bench")
        svc.create_workspace(admin, WorkspaceCreate(name="ws"))
        p = Principal(workspace="ws", instance="bench")
        url = "/v1/stores/ws/records"

        def request(path: str, i: int) -> tuple[RecordCreate, IdempotencyRequest]:
            """What the event loop hands the writer: the parsed body and the request's identity."""
            idem = IdempotencyRequest(str(uuid.uuid4()), "POST", url, uuid.uuid4().hex * 2, uuid.uuid4().hex * 2)
            return RecordCreate(path=path, content=content(i).decode()), idem

        def one(req: tuple[RecordCreate, IdempotencyRequest]) -> None:
            r = svc.create_record(p, "ws", *req)
            assert r.status == 201, r.body

        for i in range(50):
            one(request(f"warm/{i}.md", i))
        for rnd in range(args.rounds):
            prof = None
            if args.profile is not None and rnd == args.rounds - 1:
                import cProfile
                prof = cProfile.Profile()
                prof.enable()
            reqs = [request(f"r{rnd}/d{i % 10}/{i}.md", i) for i in range(args.n)]
            if args.io:
                _checkpoint(db)
                io0, f0, ru0 = _proc_io(), db._wal.frames, resource.getrusage(resource.RUSAGE_THREAD)  # noqa: SLF001
            os.getpgrp()  # the round's start for callgrind (--dump-before=getpgrp; see --help)
            bus0, c0, t0 = _bus_cpu(), time.thread_time(), time.perf_counter()
            for req in reqs:
                one(req)
            c1, t1, bus1 = time.thread_time(), time.perf_counter(), _bus_cpu()
            os.getpgrp()  # the round's end
            extra: dict[str, object] = {}
            if args.io:
                io1, ru1 = _proc_io(), resource.getrusage(resource.RUSAGE_THREAD)
                _checkpoint(db)
                extra = {"frames": round((db._wal.frames - f0) / args.n, 2),  # noqa: SLF001
                         **{k: round((io1[k] - io0[k]) / args.n, 1) for k in ("syscw", "wchar", "syscr", "rchar")},
                         "user_ms": round((ru1.ru_utime - ru0.ru_utime) / args.n * 1000, 4),
                         "sys_ms": round((ru1.ru_stime - ru0.ru_stime) / args.n * 1000, 4),
                         "page_size": _page_size(db)}
            if prof is not None:
                prof.disable()
                prof.dump_stats(str(args.profile))
            print(json.dumps({"round": rnd, "cpu_ms": round((c1 - c0) / args.n * 1000, 4),
                              "wall_ms": round((t1 - t0) / args.n * 1000, 4),
                              "bus_ms": round((bus1 - bus0) / args.n * 1000, 4),
                              "nosync": args.nosync, "load": loadavg(), **extra}), flush=True)
        db.dispose()


if __name__ == "__main__":
    main()
