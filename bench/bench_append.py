"""Appends: what ``echo line >> f`` costs as ``f`` grows, and what its versions take.

    .venv/bin/python bench/bench_append.py [--quick]

One sidecar on a ``memfuse serve`` (SQLite). For files of 4 KiB, 256 KiB and 1 MiB: N appends
of one line each (open ``O_APPEND``, write, close — what the shell does for ``echo >>``;
close waits for the commit), ms per append (median and p90) beside the same on a local
directory, and the CPU ms per append of the sidecar and of ``memfuse serve`` (from
``/proc/PID/stat``). Then the control plane's ``versions`` rows of each file: the bytes stored
for the N append versions beside the bytes appended and beside what whole versions would
have held (docs/SEMANTICS.md "Append versions"). Targets: an append to 1 MiB at most 1.5×
the cost at 4 KiB; stored bytes at most 2× the appended bytes plus the whole copies made
every ``CHAIN_MAX`` links.
"""
from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from memfuse.client import ApiClient

import trio

from common import Mount, Row, Session, cpu_s, main_for, median, pct

SIZES = {"4k": 4 << 10, "256k": 256 << 10, "1m": 1 << 20}


def _body(size: int) -> str:
    line = '{"event": "a journal line of some agent notes, long enough to look like one"}\n'
    return (line * (size // len(line) + 1))[:size - 1] + "\n"


def _appends(path: Path, n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        with open(path, "a") as f:
            f.write(f'{{"n": {i}, "event": "appended by the benchmark"}}\n')
        out.append(time.perf_counter() - t0)
    return out


def run(s: Session) -> list[Row]:
    n = 40 if s.quick else 150
    tok = s.workspace("wappend", ("journal",))

    async def roomy() -> None:  # a 1 MiB journal plus its appends fits one record
        async with ApiClient(s.cp.url, s.cp.admin_token) as c:
            await c.update_store("journal", max_record_bytes=8 << 20)

    trio.run(roomy)
    m = Mount(s, s.cp, "wappend", tok, "append")
    m.start("journal", nonempty=False)
    s.on_close(m.stop)
    local_dir = s.dir / "local-append"
    local_dir.mkdir()
    rows: list[Row] = []
    per: dict[str, float] = {}
    stored_rows = []
    server_pid = s.cp.proc.pid
    for name, size in SIZES.items():
        body = _body(size)
        f = m.mountpoint / "journal" / f"J-{name}.md"
        f.write_text(body)  # close waits for the commit
        lf = local_dir / f"J-{name}.md"
        lf.write_text(body)
        _appends(f, 3)  # warm up: the file's first appends
        c0, k0 = cpu_s(m.pid), cpu_s(server_pid)
        times = _appends(f, n)
        c1, k1 = cpu_s(m.pid), cpu_s(server_pid)
        local = _appends(lf, n)
        per[name] = median(times)
        s.say(f"append to {name}: {median(times) * 1e3:.2f} ms (local {median(local) * 1e3:.3f} ms)")
        rows.append(Row(f"append_{name}", f"`echo >>` to a {name} file, ms (median; p90 "
                        f"{pct(times, 90) * 1e3:.1f})", median(times) * 1e3, "ms",
                        local=median(local) * 1e3, ratio_vs="local",
                        detail={"n": n, "p90_ms": pct(times, 90) * 1e3,
                                "sidecar_cpu_ms": (c1 - c0) / n * 1e3,
                                "server_cpu_ms": (k1 - k0) / n * 1e3},
                        note=f"CPU per append: sidecar {(c1 - c0) / n * 1e3:.2f} ms, "
                             f"serve {(k1 - k0) / n * 1e3:.2f} ms"))
    rows.append(Row("append_1m_vs_4k", "`echo >>` to 1 MiB / to 4 KiB", per["1m"] / per["4k"], "×",
                    target=1.5, note="same run, same sidecar"))
    # what the versions of each file take
    db = sqlite3.connect(f"file:{s.cp.db}?mode=ro", uri=True)
    try:
        for name, size in SIZES.items():
            rid = db.execute("SELECT id FROM records WHERE store = 'journal' AND path = ?",
                             (f"J-{name}.md",)).fetchone()[0]
            vs = db.execute("SELECT version, size, base_version, length(CAST(content AS BLOB))"
                            " FROM versions WHERE record_id = ? ORDER BY version", (rid,)).fetchall()
            later = vs[1:]  # every version after the create: the appends
            appended = vs[-1][1] - vs[0][1]
            stored = sum(b or 0 for _, _, _, b in later)
            whole_copies = sum(sz for _, sz, base, _ in later if base is None)
            would = sum(sz for _, sz, _, _ in later)
            stored_rows.append((name, len(later), appended, stored, whole_copies, would))
            rows.append(Row(f"append_stored_{name}",
                            f"{len(later)} appends to {name}: stored bytes / (2 × appended + whole copies)",
                            stored / (2 * appended + whole_copies), "×", target=1.0,
                            detail={"versions": len(later), "appended": appended, "stored": stored,
                                    "whole_copies": whole_copies, "whole_versions_would_hold": would},
                            note=f"stored {stored:,} B for {appended:,} B appended "
                                 f"({whole_copies:,} B of whole copies); whole versions: {would:,} B"))
    finally:
        db.close()
    return rows


if __name__ == "__main__":
    raise SystemExit(main_for(run, "append"))
