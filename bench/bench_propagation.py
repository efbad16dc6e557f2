"""Propagation: how long until a write in one sidecar is visible in another.

    .venv/bin/python bench/bench_propagation.py [--quick]

Two sidecars (workspaces ``ws-pa`` and ``ws-pb``) mount the same store ``shared`` from one
``memfuse serve``. For each of 200 writes, this process writes a file through sidecar A
(``open(O_WRONLY|O_CREAT|O_TRUNC)`` + write + close, which returns once the control plane has
the version) and then reads the same path through sidecar B in a loop (open + read + close,
1 ms apart) until B returns the new content. The writes rotate over 20 files, so the first 20
create new names (B had them cached as absent) and the rest modify files B has cached.

Latency = from the start of the write in A until B shows it (the close in A is part of it; its
own p50 is in the detail). Target: p99 ≤ 1 s.
"""
from __future__ import annotations

import os
import time

from common import Mount, Row, Session, main_for, pct

STORE = "shared"


def run(s: Session) -> list[Row]:
    n = 50 if s.quick else 200
    ta = s.workspace("ws-pa", (STORE,))
    tb = s.workspace("ws-pb", (STORE,))
    a = Mount(s, s.cp, "ws-pa", ta, "prop-a")
    b = Mount(s, s.cp, "ws-pb", tb, "prop-b")
    lat, close_lat, timeouts = [], [], 0
    try:
        a.start(STORE, nonempty=False)
        b.start(STORE, nonempty=False)
        da, db = a.mountpoint / STORE / "p", b.mountpoint / STORE / "p"
        da.mkdir()
        s.say(f"propagation: {n} writes A → B")
        for i in range(n):
            name = f"f{i % 20:02d}.md"
            marker = f"seq {i:05d}\n".encode()
            body = marker + b"the agent moved to Lisbon on a Tuesday\n" * (1 + i % 5)
            t0 = time.perf_counter()
            fd = os.open(da / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, body)
            finally:
                os.close(fd)
            t1 = time.perf_counter()
            target = str(db / name)
            while True:
                try:
                    fd = os.open(target, os.O_RDONLY)
                    try:
                        got = os.read(fd, 65536)
                    finally:
                        os.close(fd)
                    if got.startswith(marker):
                        break
                except FileNotFoundError:
                    pass
                if time.perf_counter() - t0 > 10:
                    timeouts += 1
                    break
                time.sleep(0.001)
            t2 = time.perf_counter()
            lat.append(t2 - t0)
            close_lat.append(t1 - t0)
    finally:
        b.stop()
        a.stop()
    creates, modifies = lat[:20], lat[20:]
    detail = {"writes": n, "timeouts_10s": timeouts,
              "close_in_a_p50_ms": pct(close_lat, 50) * 1000,
              "max_s": max(lat),
              "creates_p50_s": pct(creates, 50), "modifies_p50_s": pct(modifies, 50) if modifies else None}
    return [
        Row("propagation_p50", f"write in A visible in B, p50 ({n} writes)", pct(lat, 50), "s",
            detail=detail),
        Row("propagation_p99", f"write in A visible in B, p99 ({n} writes)", pct(lat, 99), "s",
            target=1.0),
    ]


if __name__ == "__main__":
    raise SystemExit(main_for(run, "propagation"))
