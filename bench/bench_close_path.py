"""What the sidecar's own Python costs per create-write-close, without the kernel and without
HTTP: the seven FUSE requests of one file written by ``cp`` / a Python ``open(..., "w")``
(a negative ``lookup``, ``create``, the kernel's ``getxattr security.capability`` probe,
``write``, ``flush``, ``release`` and the directory's ``getattr``) awaited directly on
``MemfuseOps`` over a ``Filesystem`` whose outbox commits to a stand-in client, with the
outbox journal and the committer running as in a mount (``hold_journal`` on: the close
waits for the commit, as with the default ``--commit-wait``).

    .venv/bin/python bench/bench_close_path.py [--files 2000] [--rounds 5] [--size 550]
    valgrind --tool=callgrind --callgrind-out-file=/dev/null --instr-atstart=yes \\
        .venv/bin/python bench/bench_close_path.py --files N --rounds 1 --quiet

The stand-in client's ``create_record`` yields to trio once (a commit's answer arrives on a
later loop pass, as from a socket) and answers with a ``Record``: what is measured is the
FUSE adapter, the core, the committer's worker and trio's scheduling of the three tasks a
close involves (the request's, the committer's, the journal's), not pyfuse3's dispatch, the
kernel round trips or the client's HTTP exchange (memfuse/client, measured by the whole
sidecar: ``prof_write.py``). The garbage collector runs with the sidecar process's
thresholds (``mount.tune_gc``; ``--gc default``: CPython's). Prints the thread CPU µs per
file of each round and their median, and the median µs of each request; under callgrind,
run it with two ``--files`` counts and subtract (the difference over the extra files is the
instructions per file, start-up excluded).

Its rounds grow (~155 -> ~280 µs a file over four rounds, session 23): the outbox journal's
lazy writes (key-map rows, written by a worker thread every ``Journal.LAZY_DELAY`` s) wait for
the GIL behind a trio thread that never idles here (no kernel, no HTTP), so the journal's
queue grows and each finished entry's removal from it (a list scan) costs more. In a mount the
trio thread idles between requests and the queue is written every 0.25 s; compare rounds of
the same index between trees, not a round with the median.
"""
from __future__ import annotations

import argparse
import errno
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

import pyfuse3  # noqa: E402
import trio  # noqa: E402

from memfuse.sidecar.blobcache import BlobCache  # noqa: E402
from memfuse.sidecar.core import Filesystem, Settings  # noqa: E402
from memfuse.sidecar.fuse_ops import MemfuseOps  # noqa: E402
from memfuse.sidecar.journal import Journal  # noqa: E402
from memfuse.wire import Record, sha256_hex  # noqa: E402


class _Ctx:
    """A request context (``pyfuse3.RequestContext`` ignores keyword arguments)."""
    uid = gid = pid = 0
    umask = 0o022


Ctx: Any = _Ctx  # passed where a ``pyfuse3.RequestContext`` goes


class StubClient:
    """The part of ``ApiClient`` a create's commit uses: ``create_record`` answers after one
    loop pass with the record the control plane would make."""

    def __init__(self) -> None:
        self.n = 0
        self.now = datetime.now(timezone.utc)

    async def create_record(self, store: str, path: str, content: str, type: str | None = None,
                            idempotency_key: str | None = None, *, mode: int | None = None,
                            mtime_ns: int | None = None) -> Record:
        await trio.lowlevel.checkpoint()  # the answer comes on a later pass
        self.n += 1
        data = content.encode()
        return Record(id=f"r{self.n}", store=store, path=path, type=type or "note", version=1,
                      sha256=sha256_hex(data), size=len(data), created_at=self.now,
                      updated_at=self.now, updated_by="bench", seq=self.n,
                      mode=mode if mode is not None else 0o644, mtime_ns=mtime_ns)


OPS = ("lookup", "create", "getxattr", "write", "flush", "release", "getattr")


async def write_files(ops: MemfuseOps, d: int, prefix: str, n: int, data: bytes,
                      timing: dict[str, list[int]] | None = None) -> None:
    """``n`` create-write-closes in directory inode ``d``, each the seven requests the kernel
    sends for one (module docstring); with ``timing``, each request's thread CPU ns is
    appended to ``timing[op]`` (the flush's includes the loop passes of its commit)."""
    clock = time.thread_time_ns
    t = [0] * 8
    for i in range(n):
        name = f"{prefix}-{i:06d}.md".encode()
        t[0] = clock()
        a = await ops.lookup(d, name, Ctx)
        t[1] = clock()
        assert a.st_ino == 0  # absent (cached negative entry)
        fi, attrs = await ops.create(d, name, 0o644, os.O_WRONLY | os.O_CREAT | os.O_EXCL, Ctx)
        t[2] = clock()
        try:
            await ops.getxattr(attrs.st_ino, b"security.capability", Ctx)
        except pyfuse3.FUSEError as e:
            assert e.errno == errno.ENODATA
        t[3] = clock()
        await ops.write(fi.fh, 0, data)
        t[4] = clock()
        await ops.flush(fi.fh)
        t[5] = clock()
        await ops.release(fi.fh)
        t[6] = clock()
        await ops.getattr(d, Ctx)
        t[7] = clock()
        if timing is not None:
            for k, op in enumerate(OPS):
                timing[op].append(t[k + 1] - t[k])


async def run(files: int, rounds: int, size: int, quiet: bool) -> list[float]:
    """Thread CPU µs per file of each round (a fresh directory each)."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        journal = Journal(work / "outbox.db")
        fs = Filesystem(BlobCache(work / "blobs.db"), StubClient(), journal,
                        Settings(commit_wait=10), "ws", dirs_file=work / "dirs.json")
        ops = MemfuseOps(fs)
        data = (b"# note\n" + b"memory agent notes " * (size // 19 + 1))[:size]
        out: list[float] = []
        timing: dict[str, list[int]] = {op: [] for op in OPS}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(journal.run)
            await nursery.start(fs.committer.run)
            sm = fs.add_store("default", "read_write", [])
            await write_files(ops, sm.root.ino, "warm", 50, data)
            for r in range(rounds):
                a = await ops.mkdir(sm.root.ino, f"r{r}".encode(), 0o755, Ctx)
                t0 = time.thread_time()
                await write_files(ops, a.st_ino, "f", files, data, None if quiet else timing)
                out.append((time.thread_time() - t0) / files * 1e6)
                if not quiet:
                    print(f"round {r}: {out[-1]:.1f} µs CPU per file", flush=True)
            await fs.committer.wait_idle()
            nursery.cancel_scope.cancel()
        journal.close()
        if not quiet:  # the median request of each kind, all rounds
            print("median µs per request (thread CPU): " + ", ".join(
                f"{op} {statistics.median(v) / 1000:.1f}" for op, v in timing.items()))
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=4,
                    help="rounds of --files each; all of them together stay under the store's record limit (10,000)")
    ap.add_argument("--size", type=int, default=550, help="bytes per file")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--gc", choices=("sidecar", "default"), default="sidecar",
                    help="the collector's thresholds: the sidecar process's (mount.tune_gc, "
                         "where the code run has it) or CPython's default")
    a = ap.parse_args()
    if a.gc == "sidecar":
        import memfuse.sidecar.mount as mount
        tune = getattr(mount, "tune_gc", None)  # (not in releases before session 15)
        if tune is not None:
            tune()
    res = trio.run(run, a.files, a.rounds, a.size, a.quiet)
    print(f"median {statistics.median(res):.1f} µs CPU per file "
          f"(rounds: {', '.join(f'{x:.1f}' for x in res)}; load {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
