"""What memfuse's FUSE handlers cost per request, without the kernel: the warm ``grep -r``
sequence (``open`` + ``flush`` + ``release`` of every file, ``opendir`` + ``readdir`` +
``releasedir`` of every directory) run in process against ``MemfuseOps`` over a loaded
10,000-record ``Filesystem`` and against ``barefs.BareOps`` over the same tree.

    .venv/bin/python bench/bench_fuse_ops.py [--files 10000] [--rounds 7]

No mount, no control plane: the handlers are awaited directly (``readdir`` replies go to a
stand-in for ``pyfuse3.readdir_reply`` that accepts every entry, in both). The difference
between the two columns is what memfuse's own Python adds per request on the trio thread,
the part of a warm ``grep -r``'s daemon CPU that is ours (pyfuse3's dispatch and the kernel
round trips are the same for both and not in these figures). Prints µs per request (the
median request of a pass over the whole tree, median of ``--rounds`` passes, the lower of
two interleaved runs); ``--json`` for the raw figures.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

import pyfuse3  # noqa: E402
import trio  # noqa: E402

import barefs  # noqa: E402
from memfuse.sidecar.blobcache import BlobCache  # noqa: E402
from memfuse.sidecar.core import Filesystem, Settings  # noqa: E402
from memfuse.sidecar.fuse_ops import MemfuseOps  # noqa: E402
from memfuse.sidecar.journal import Journal  # noqa: E402
from memfuse.wire import Record, sha256_hex  # noqa: E402


class Ctx:
    uid = gid = pid = 0
    umask = 0o022


def tree(n: int) -> list[tuple[str, bytes]]:
    """``n`` files laid out as bench/common.py's data set (``tNN/sNN/lNN/note-NNNNN.md``)."""
    out = []
    for i in range(n):
        leaf = i // 20
        rel = f"t{leaf // 50 % 100:02d}/s{leaf // 5 % 10:02d}/l{leaf % 5:02d}/note-{i:05d}.md"
        out.append((rel, (f"# note {i}\n" + "memory agent notes " * (10 + i % 90)).encode()))
    return out


def memfuse_ops(files: list[tuple[str, bytes]], work: Path) -> tuple[MemfuseOps, int]:
    """A ``MemfuseOps`` over a ``Filesystem`` holding ``files`` in store ``big``; the store
    root's inode."""
    fs = Filesystem(BlobCache(work / "blobs.db"), None, Journal(work / "outbox.db"),
                    Settings(), "ws", dirs_file=work / "dirs.json")
    now = datetime.now(timezone.utc)
    recs = [Record(id=f"r{i}", store="big", path=rel, type="note", version=1,
                   sha256=sha256_hex(data), size=len(data), created_at=now, updated_at=now,
                   updated_by="bench", seq=i + 1, content=data.decode())
            for i, (rel, data) in enumerate(files)]
    sm = fs.add_store("big", "read_write", recs)
    return MemfuseOps(fs), sm.root.ino


def bare_ops(files: list[tuple[str, bytes]]) -> tuple[barefs.BareOps, int]:
    """``barefs.BareOps`` holding ``files`` (at its root)."""
    ops = barefs.BareOps()
    for rel, data in files:
        d = ops.root
        *dirs, name = rel.split("/")
        for comp in dirs:
            c = d.children.get(comp.encode())
            if c is None:
                c = ops._new(0o040755)
                d.children[comp.encode()] = c
                d.nlink += 1
            d = c
        f = ops._new(0o100644)
        f.data[:] = data
        d.children[name.encode()] = f
    return ops, ops.root.ino


async def walk(ops, root: int, timing: dict[str, list[float]]) -> None:
    """One warm ``grep -r`` worth of requests over the tree under ``root``: per directory
    opendir, readdir (all entries), releasedir; per file open, flush, release. Adds each
    request's ns to ``timing[op]``."""
    clock = time.perf_counter_ns
    stack = [root]
    while stack:
        ino = stack.pop()
        t = clock()
        fh = await ops.opendir(ino, Ctx)
        t1 = clock()
        timing["opendir"].append(t1 - t)
        entries: list[tuple[bytes, pyfuse3.EntryAttributes]] = []
        token = entries
        t = clock()
        await ops.readdir(fh, 0, token)
        t1 = clock()
        timing["readdir_entry"].append((t1 - t) / max(1, len(entries)))
        t = clock()
        await ops.releasedir(fh)
        timing["releasedir"].append(clock() - t)
        for name, a in entries:
            if name in (b".", b".."):
                continue
            if a.st_mode & 0o040000:
                stack.append(a.st_ino)
                continue
            t = clock()
            fi = await ops.open(a.st_ino, os.O_RDONLY, Ctx)
            t1 = clock()
            await ops.flush(fi.fh)
            t2 = clock()
            await ops.release(fi.fh)
            t3 = clock()
            timing["open"].append(t1 - t)
            timing["flush"].append(t2 - t1)
            timing["release"].append(t3 - t2)


def _reply(token, name, attrs, off):  # pyfuse3.readdir_reply's stand-in: accept every entry
    token.append((name, attrs))
    return True


OPS = ("open", "flush", "release", "opendir", "readdir_entry", "releasedir")


async def measure(ops, root: int, rounds: int) -> dict[str, float]:
    """Median over ``rounds`` passes of each request's median µs (medians: on a loaded
    machine a few requests that lost the CPU would dominate a mean)."""
    await walk(ops, root, {k: [] for k in OPS})  # warm-up
    per: dict[str, list[float]] = {k: [] for k in OPS}
    for _ in range(rounds):
        timing: dict[str, list[float]] = {k: [] for k in OPS}
        await walk(ops, root, timing)
        for k in OPS:
            per[k].append(statistics.median(timing[k]) / 1000)
    return {k: statistics.median(v) for k, v in per.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    pyfuse3.readdir_reply = _reply  # both adapters call it through the module
    files = tree(args.files)
    with tempfile.TemporaryDirectory(prefix="memfuse-ops-") as work:
        mops, mroot = memfuse_ops(files, Path(work))
        bops, broot = bare_ops(files)

        async def go() -> dict[str, dict[str, float]]:
            out: dict[str, dict[str, float]] = {"memfuse": {}, "bare": {}}
            for _ in range(2):  # interleaved: load elsewhere hits both alike
                for name, ops, root in (("memfuse", mops, mroot), ("bare", bops, broot)):
                    r = await measure(ops, root, args.rounds)
                    for k, v in r.items():
                        out[name].setdefault(k, []).append(v)  # type: ignore[attr-defined]
            return {n: {k: min(v) for k, v in d.items()} for n, d in out.items()}
        res = trio.run(go)
    per_file = {n: d["open"] + d["flush"] + d["release"] for n, d in res.items()}
    if args.json:
        print(json.dumps({"us": res, "per_file_us": per_file, "load": os.getloadavg()}))
        return 0
    print(f"{'request':14s} {'memfuse µs':>11s} {'bare µs':>9s} {'extra µs':>9s}")
    for k in OPS:
        m, b = res["memfuse"][k], res["bare"][k]
        print(f"{k:14s} {m:11.2f} {b:9.2f} {m - b:9.2f}")
    print(f"{'per file':14s} {per_file['memfuse']:11.2f} {per_file['bare']:9.2f} "
          f"{per_file['memfuse'] - per_file['bare']:9.2f}   (open + flush + release)")
    print(f"load {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
