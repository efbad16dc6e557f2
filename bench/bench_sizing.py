"""Sizing figures for deployment (docs/DEPLOY.md "Sizing"): sidecar memory per 1,000 records
and cache disk per store byte.

    .venv/bin/python bench/bench_sizing.py [--quick]

Three stores, each mounted alone by a fresh sidecar with an empty cache directory:

- ``empty``: no records (the baseline RSS: interpreter, imports, the FUSE loop);
- ``small``: 10,000 records of 200 B – 2 KB (the bench data set; 2,000 with ``--quick``);
- ``large``: 200 records of 64 KiB (50 with ``--quick``), so the per-byte cost shows apart
  from the per-record one.

For each: ``VmRSS`` after the mount and after reading every file once (``cat`` of all, the
largest), and the cache directory's disk use after the mount and after a clean stop (``du``
block usage, and the apparent byte count). Memory per 1,000 records = (RSS of ``small`` −
baseline) / records × 1,000; cache disk per store byte = cache bytes / store bytes (the sum
of the records' sizes), for ``small`` and ``large``. These size the Kubernetes requests,
limits and the cache ``emptyDir``'s ``sizeLimit``; the one target is the baseline's
(``BASELINE_TARGET_MIB``, pass / fail in the table). What the sidecar may import is a test
(``tests/test_replicas.py``, ``SIDECAR_NEVER_LOADS``).
"""
from __future__ import annotations

import random
import subprocess
import time
from pathlib import Path

import trio

from common import Mount, Row, Session, main_for, populate, rss_kib

BASELINE_TARGET_MIB = 45.0  # the sidecar's baseline (issue 9): checked here, never in a test


def du(path: Path) -> tuple[int, int]:
    """(bytes of disk blocks used, apparent bytes) under ``path``."""
    used = int(subprocess.run(["du", "-s", "-B1", str(path)], capture_output=True, text=True,
                              check=True).stdout.split()[0])
    apparent = int(subprocess.run(["du", "-s", "-b", str(path)], capture_output=True, text=True,
                                  check=True).stdout.split()[0])
    return used, apparent


def large_files(n: int, size: int = 64 * 1024, seed: int = 7) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz      \n"
    return [(f"big/{i:04d}.md", "".join(rng.choice(alphabet) for _ in range(size))) for i in range(n)]


def measure(s: Session, name: str, files: list[tuple[str, str]]) -> dict:
    tok = s.workspace(f"ws-{name}", (name,))
    if files:
        trio.run(populate, s.cp.url, s.cp.admin_token, name, files)
    m = Mount(s, s.cp, f"ws-{name}", tok, f"sizing-{name}")
    m.start(name, nonempty=bool(files))
    rss_mounted = rss_kib(m.pid)["VmRSS"]
    cache_mounted = du(m.cache_dir)
    subprocess.run(["bash", "-c", f"find {m.mountpoint / name} -type f -exec cat {{}} + > /dev/null"],
                   check=True, timeout=600)
    rss_read = rss_kib(m.pid)["VmRSS"]
    m.stop()
    time.sleep(0.2)
    cache_stopped = du(m.cache_dir)
    store_bytes = sum(len(text.encode()) for _, text in files)
    s.say(f"{name}: {len(files)} records, {store_bytes} B, RSS {rss_mounted} / {rss_read} KiB, "
          f"cache {cache_mounted} → {cache_stopped} B")
    return {"records": len(files), "store_bytes": store_bytes, "rss_kib": max(rss_mounted, rss_read),
            "cache_used": max(cache_mounted[0], cache_stopped[0]),
            "cache_apparent": max(cache_mounted[1], cache_stopped[1])}


def run(s: Session) -> list[Row]:
    empty = measure(s, "empty", [])
    small = measure(s, "small", s.files)
    large = measure(s, "large", large_files(50 if s.quick else 200))
    per_1k = (small["rss_kib"] - empty["rss_kib"]) / 1024 / small["records"] * 1000
    rows = [
        Row("rss_base", "sidecar RSS, empty store (baseline)", empty["rss_kib"] / 1024, "MiB",
            target=BASELINE_TARGET_MIB),
        Row("rss_small", f"sidecar RSS, {small['records']} records of 200 B–2 KB", small["rss_kib"] / 1024, "MiB"),
        Row("rss_per_1k", "sidecar memory per 1,000 records (small − baseline)", per_1k, "MiB"),
        Row("rss_large", f"sidecar RSS, {large['records']} records of 64 KiB", large["rss_kib"] / 1024, "MiB"),
        Row("cache_base", "cache directory, empty store", empty["cache_used"] / 1024, "KiB"),
    ]
    for name, d in (("small", small), ("large", large)):
        rows.append(Row(f"cache_per_byte_{name}",
                        f"cache disk per store byte, {name} ({d['store_bytes'] / 2**20:.1f} MiB stored)",
                        (d["cache_used"] - empty["cache_used"]) / d["store_bytes"], "×"))
        rows.append(Row(f"cache_apparent_per_byte_{name}", f"cache apparent bytes per store byte, {name}",
                        (d["cache_apparent"] - empty["cache_apparent"]) / d["store_bytes"], "×"))
    return rows


if __name__ == "__main__":
    raise SystemExit(main_for(run, "sizing"))
