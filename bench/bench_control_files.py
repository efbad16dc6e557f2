"""Cost of ``ls -l MOUNT/.memfuse``: the control files report their real size.

    .venv/bin/python bench/bench_control_files.py [--quick]

``status.json``, ``errors.log`` and ``context.md`` are rendered by the sidecar; their size in
``stat`` is the length of the content an open would read, so a lookup / getattr of them renders
the content (``status.json`` is the costly one: one entry per store and a pass over the
rejected files). This measures what that adds to ``ls -l``.

One sidecar mounts a workspace with ``STORES`` stores attached and ``REJECTED`` files refused
for good (invalid UTF-8, kept locally: each one is in ``status.json``'s counts and one line of
``errors.log``), so ``status.json`` is larger than on a usual mount. Then, N times each, in
this process (no ``ls`` process start in the figure): the syscalls of ``ls -l`` — ``opendir`` +
``readdir`` + ``lstat`` and the ``getxattr`` probe of every entry — on ``.memfuse/`` and on a
store directory holding three regular files (the same FUSE path without rendering: the
reference). Figures: µs per listing (p50) and the sidecar's CPU µs per listing (from
``/proc/PID/stat``: robust to other load on the machine), in interleaved rounds, plus one
``ls -l`` process run for the sizes it prints.
"""
from __future__ import annotations

import errno
import os
import subprocess
import time
from pathlib import Path

from common import Mount, Row, Session, cpu_s, loadavg, main_for, median

STORES = 20
REJECTED = 100


def _ls_l(d: Path) -> None:
    """What ``ls -l d`` asks the filesystem: the listing, then lstat and a getxattr probe of
    each entry."""
    for name in os.listdir(d):
        p = d / name
        os.lstat(p)
        try:
            os.getxattr(p, "security.selinux", follow_symlinks=False)
        except OSError as e:
            if e.errno not in (errno.ENODATA, errno.ENOTSUP):
                raise


def _measure(dirs: list[Path], n: int, pid: int, rounds: int = 10) -> list[tuple[float, float]]:
    """Per directory of ``dirs``: (p50 µs per listing, sidecar CPU µs per listing) over ``n``
    listings, taken in ``rounds`` interleaved rounds so that other load on the machine (and the
    sidecar's own background work) falls on every directory alike."""
    for d in dirs:
        for _ in range(20):  # warm-up
            _ls_l(d)
    times: list[list[float]] = [[] for _ in dirs]
    cpu = [0.0 for _ in dirs]
    for _ in range(rounds):
        for i, d in enumerate(dirs):
            c0 = cpu_s(pid)
            for _ in range(n // rounds):
                t0 = time.perf_counter()
                _ls_l(d)
                times[i].append(time.perf_counter() - t0)
            cpu[i] += cpu_s(pid) - c0
    return [(median(t) * 1e6, c / len(t) * 1e6) for t, c in zip(times, cpu)]


def run(s: Session) -> list[Row]:
    n = 300 if s.quick else 2000
    stores = tuple(["ctl"] + [f"ctl{i:02d}" for i in range(STORES - 1)])
    tok = s.workspace("ws-ctl", stores)
    m = Mount(s, s.cp, "ws-ctl", tok, "ctl")
    try:
        m.start("ctl", nonempty=False)
        store = m.mountpoint / "ctl"
        for i in range(3):
            (store / f"plain{i}.md").write_text(f"a plain file {i}\n" * 40)
        bad = store / "bad"
        bad.mkdir()
        s.say(f"control files: {REJECTED} rejected files, {STORES} stores")
        for i in range(REJECTED):
            try:
                with open(bad / f"r{i:03d}.md", "wb") as f:
                    f.write(b"caf\xe9 %d\n" % i)
            except OSError as e:
                assert e.errno == errno.EILSEQ, e
        ctl = m.mountpoint / ".memfuse"
        sizes = {p.name: p.stat().st_size for p in ctl.iterdir()}
        ls = subprocess.run(["ls", "-l", str(ctl)], capture_output=True, text=True, timeout=30)
        s.say(f"ls -l {ctl}:\n{ls.stdout}")
        plain_dir = m.mountpoint / "ctl" / "plaindir"
        plain_dir.mkdir()
        for i in range(3):
            (plain_dir / f"f{i}.md").write_text("x" * 1000)
        s.say(f"control files: {n} listings of each directory")
        (ctl_us, ctl_cpu), (ref_us, ref_cpu) = _measure([ctl, plain_dir], n, m.pid)
        note = (f"{STORES} stores, {REJECTED} rejected files; sizes {sizes}; "
                f"load {loadavg()}")
        return [
            Row("ctl_ls_l", "ls -l .memfuse (3 rendered files), p50", ctl_us, "µs",
                local=ref_us, ratio_vs="local", note="local = ls -l of a 3-file store dir; " + note,
                detail={"sizes": sizes, "ls": ls.stdout}),
            Row("ctl_ls_l_cpu", "ls -l .memfuse, sidecar CPU per listing", ctl_cpu, "µs",
                local=ref_cpu, ratio_vs="local", note="local = same on a 3-file store dir"),
        ]
    finally:
        m.stop()


if __name__ == "__main__":
    raise SystemExit(main_for(run, "control-files"))
