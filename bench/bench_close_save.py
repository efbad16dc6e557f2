"""The save that follows each close of this sidecar (``StoreSync.save_committed``), in CPU µs per
close, the way session 13 left it and the way session 14 makes it (bench/README.md, "The close
path, session 14: sidecar").

    .venv/bin/python bench/bench_close_save.py [--records 1000] [--closes 2000] [--size 550] [--rounds 5]
                                               [--mode before|after]

In process, on a temporary directory: a ``BlobCache`` and a ``StoreState`` of ``--records``
records with a base on disk. Each close: its content (``--size`` bytes, new each time) is put
behind (``BlobCache.put_behind``, as ``Filesystem.commit`` does), its record enters the mirror
(``StoreState.put``), then the save runs:

- ``before``: the contents behind written to the blob cache in a transaction of their own
  (``BlobCache.write_behind``), then one log frame, the log opened, checked, positioned and
  closed around its write (``StoreState.close`` after each append: the session-13 syscalls);
- ``after``: one log frame carrying the content (``StoreState(blobs=...)``), the log kept open;
  the contents behind are written in one transaction per ``BEHIND_MAX`` closes (as the
  sidecar's ``put_behind`` does; its twice-a-second timer is not run here).

The rounds alternate the two (fresh directories each); CPU is ``time.thread_time`` of the
loop (this thread: user + system) and ``time.process_time`` (with the blob cache's
checkpoint thread, which copies the write-ahead log into the file every 4 MiB of it), plus
the load average. Results: JSON lines on stdout.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memfuse.sidecar.blobcache import BlobCache  # noqa: E402
from memfuse.sidecar.sync import StoreState  # noqa: E402
from memfuse.wire import Record  # noqa: E402

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def _rec(i: int, data: bytes) -> Record:
    return Record(id=f"id-{i:06d}", store="s", path=f"d{i % 50}/n{i}.md", type="project",
                  version=1, sha256=hashlib.sha256(data).hexdigest(), size=len(data),
                  created_at=T0, updated_at=T0, updated_by="t", seq=i)


def run(mode: str, records: int, closes: int, size: int) -> dict[str, float]:
    """One round: ``closes`` saves in ``mode`` (``before`` / ``after``); CPU µs per close."""
    with tempfile.TemporaryDirectory(prefix="close-save-") as d:
        blobs = BlobCache(Path(d) / "blobs.db")
        st = StoreState(Path(d) / "s.json", "s", blobs=blobs if mode == "after" else None)
        seed = [(b"seed %d\n" % i) for i in range(records)]
        for i, data in enumerate(seed):
            blobs.put(data)
        st.reset([_rec(i, data) for i, data in enumerate(seed)], records)
        st.save()
        pad = b"x" * max(0, size - 16)
        t0, p0 = time.thread_time(), time.process_time()
        for k in range(closes):
            data = b"%015d\n" % k + pad
            sha = hashlib.sha256(data).hexdigest()
            blobs.put_behind(data, sha)
            st.put(_rec(records + k, data))
            if mode == "before":
                blobs.write_behind()
                st.save_log()
                st.close()
            else:
                st.save_log()
        blobs.write_behind()  # what waits is part of the cost (after: < BEHIND_MAX contents)
        cpu = time.thread_time() - t0
        blobs.close()  # waits for a checkpoint running behind: its CPU is the process's
        proc = time.process_time() - p0
        st.close()
    return {"cpu_us_per_close": round(cpu / closes * 1e6, 1),
            "process_cpu_us_per_close": round(proc / closes * 1e6, 1)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=1000)
    ap.add_argument("--closes", type=int, default=2000)
    ap.add_argument("--size", type=int, default=550)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mode", choices=("before", "after"), help="only this one (e.g. under "
                    "valgrind --tool=callgrind, whose totals then hold one mode's rounds)")
    a = ap.parse_args()
    for r in range(a.rounds):
        for mode in (a.mode,) if a.mode else ("before", "after"):
            row = {"round": r, "mode": mode, **run(mode, a.records, a.closes, a.size),
                   "loadavg": os.getloadavg()[0]}
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
