"""What one header-incomplete connection costs ``memfuse serve`` (CPU per connection).

``python bench/prof_conns.py PORT PID [--n 4000] [--addrs 100] [--hold 8] [--at-once 500]``:
opens ``n`` connections to the server on ``PORT`` (pid ``PID``) from ``addrs`` loopback
addresses (127.77.X.1), ``at-once`` at a time; each sends a request line and one header,
never finishes its head, and waits ``hold`` s for the server to close it (with ``hold``
beyond ``--header-timeout``: the header deadline closes it) before closing it itself. Prints
the server's CPU (user + system, /proc/PID/stat) per connection, and the load average.
Below ``--max-unauthenticated`` (keep ``at-once`` under it) every connection is held; above
it the server closes the new ones at once (section "Hostile clients" of bench/README.md).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import time


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("port", type=int)
    ap.add_argument("pid", type=int)
    ap.add_argument("--n", type=int, default=4000)
    ap.add_argument("--addrs", type=int, default=100)
    ap.add_argument("--hold", type=float, default=8.0)
    ap.add_argument("--at-once", type=int, default=500)
    a = ap.parse_args()
    gate = asyncio.Semaphore(a.at_once)
    done = 0

    async def one(i: int) -> None:
        nonlocal done
        async with gate:
            try:
                r, w = await asyncio.open_connection("127.0.0.1", a.port, local_addr=(f"127.77.{i % a.addrs}.1", 0))
            except OSError:
                return
            w.write(b"GET /v1/stores HTTP/1.1\r\nHost: x\r\n")
            try:
                await asyncio.wait_for(r.read(1), a.hold)
            except (OSError, asyncio.TimeoutError):
                pass
            w.close()
            done += 1

    c0, t0 = cpu_seconds(a.pid), time.monotonic()
    await asyncio.gather(*(one(i) for i in range(a.n)))
    await asyncio.sleep(1)
    used = cpu_seconds(a.pid) - c0
    print(f"{done} connections in {time.monotonic() - t0:.1f} s; server CPU {used:.2f} s = "
          f"{1e6 * used / max(done, 1):.0f} us per connection; load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    asyncio.run(main())
