"""Sidecar memory and big stores: RSS per record, mount time, ``ls`` and ``grep -r`` slopes.

    .venv/bin/python bench/bench_sidecar_memory.py [--sizes 1000,10000,100000] [--grep]

- Stores of 1,000, 10,000 and 100,000 records of 200 B – 4 KB, written straight into the
  control plane's SQLite file before ``memfuse serve`` starts (the API would take minutes for
  100,000; what the sidecar sees is the same). Records sit in directories of 1,000
  (``dNNN/note-NNNNNN.md``); one directory, ``flat/``, holds the first min(N, 10,000).
- For each size, a fresh sidecar (empty cache) mounts it, then a second one with that cache
  (resume from the saved cursor): seconds from starting ``memfuse mount`` until the store
  lists, the CPU seconds the sidecar used until then (user + system: robust to load from
  elsewhere) and those the control plane (``memfuse serve``) used meanwhile, and ``VmRSS``
  after each. A sidecar of an empty store gives the baseline; the slope
  of RSS over records (least squares over the sizes) is the per-record cost.
- ``ls`` (``os.scandir`` + ``stat`` of every entry, warm, median of 5) of ``flat/`` at 1,000
  and 10,000 entries, memfuse and the bare pyfuse3 floor (``barefs.py`` over the same tree,
  mounted at the same time), 3 interleaved rounds, µs per entry.
- ``--grep``: warm ``grep -r`` over the whole store at each size (one warm-up each, then 3
  interleaved rounds memfuse / bare, median), µs per file, and the least-squares slope of
  seconds over files (µs per file) for both. The bare floor holds the store's content in
  memory (100,000 records: ~250 MB there).
Results: ``bench/results-sidecar-memory.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import uuid
from pathlib import Path

from common import MEMFUSE, Bare, Mount, Session, cpu_s, grep, median, rss_kib  # noqa: F401
from mountutil import ControlPlane

BENCH = Path(__file__).resolve().parent
BASELINE_TARGET_MIB = 45.0  # a sidecar of an empty store (issue 9); `baseline_ok` in the results


def populate(db_path: Path, slug: str, n: int, seed: int) -> list[tuple[str, str]]:
    """Store ``slug`` with ``n`` records written straight into the SQLite file (one
    transaction); returns (path, content) of each."""
    from sqlalchemy import insert, update

    from memfuse.models import sha256_hex
    from memfuse.server.db import Database, RecordRow, StoreRow, VersionRow, utcnow

    rng = random.Random(seed)
    db = Database(f"sqlite:///{db_path}")
    files = []
    now = utcnow()
    with db.write_conn() as conn:
        conn.execute(insert(StoreRow.__table__).values(
            slug=slug, description="", default_type="project", max_record_bytes=1 << 20,
            max_store_bytes=1 << 40, max_records=10_000_000, created_at=now, usage_bytes=0, record_count=0))
        recs, vers = [], []
        total = 0
        for i in range(n):
            path = f"flat/note-{i:06d}.md" if i < 10_000 else f"d{i // 1000:03d}/note-{i:06d}.md"
            size = rng.randint(200, 4096)
            text = (f"# note {i}\n" + " ".join(rng.choice(("memory", "agent", "notes", "review", "zebrafish"
                                                            if i % 100 == 0 else "cache")) for _ in range(size // 7)))
            text = text[:size] + "\n"
            raw = text.encode()
            rid = str(uuid.UUID(int=rng.getrandbits(128)))
            sha = sha256_hex(raw)
            recs.append(dict(id=rid, store=slug, path=path, type="project", version=1, sha256=sha, size=len(raw),
                             content=text, deleted=False, created_at=now, updated_at=now,
                             updated_by="admin:bench", seq=0))
            vers.append(dict(record_id=rid, store=slug, version=1, operation="created", path=path, old_path=None,
                             type="project", sha256=sha, size=len(raw), content=text, created_at=now,
                             actor="admin:bench", redacted=False))
            total += len(raw)
            files.append((path, text))
        for k in range(0, n, 5000):
            conn.execute(insert(RecordRow.__table__), recs[k:k + 5000])
            conn.execute(insert(VersionRow.__table__), vers[k:k + 5000])
        conn.exec_driver_sql("UPDATE records SET seq = (SELECT MAX(seq) FROM versions v WHERE v.record_id = records.id)"
                             " WHERE store = ?", (slug,))
        conn.execute(update(StoreRow.__table__).where(StoreRow.__table__.c.slug == slug)
                     .values(usage_bytes=total, record_count=n))
    db.dispose()
    return files


def write_local(root: Path, files: list[tuple[str, str]]) -> None:
    for path, text in files:
        p = root / path
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def ls_us_per_entry(d: Path, rounds: int = 5) -> float:
    times = []
    for _ in range(rounds + 1):
        t0 = time.perf_counter()
        n = 0
        with os.scandir(d) as it:
            for e in it:
                e.stat(follow_symlinks=False)
                n += 1
        times.append((time.perf_counter() - t0) / max(n, 1))
    return 1e6 * median(times[1:])


def slope(xs: list[float], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--grep", action="store_true", help="also warm grep -r over each store")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--out", type=Path, default=BENCH / "results-sidecar-memory.json")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    out: dict = {"meta": {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                          "loadavg_start": os.getloadavg()[0]}, "sizes": {}}
    with Session(keep=args.keep) as s:
        cp = ControlPlane(s.dir)
        s.on_close(cp.stop)
        all_files = {}
        t0 = time.perf_counter()
        for n in [0, *sizes]:
            all_files[n] = populate(cp.db, f"s{n}", n, seed=n)
        out["meta"]["populate_s"] = time.perf_counter() - t0
        cp.start()
        for n in [0, *sizes]:
            row: dict = {}
            tok = cp.setup_workspace(f"w{n}", (f"s{n}",))
            cache = s.dir / "cache" / f"w{n}"
            bare = None
            if n and (n <= 10_000 or args.grep):
                # the bare floor over the same tree, mounted beside the warm sidecar so that
                # their ls / grep rounds interleave (load from elsewhere hits both alike)
                local = s.dir / "local" / f"s{n}"
                write_local(local, all_files[n] if args.grep else [f for f in all_files[n] if f[0].startswith("flat/")])
                bare = Bare(s, local, name=f"bare{n}")
                bare.start("flat", timeout=600)
            for label in ("fresh", "warm"):
                m = Mount(s, cp, f"w{n}", tok, f"m{n}-{label}", cache_dir=cache)
                expect = f"s{n}/flat" if n else f"s{n}"
                server0 = cpu_s(cp.proc.pid)
                row[f"mount_{label}_s"] = m.start(expect, nonempty=bool(n), timeout=600)
                # CPU the sidecar used until ready (user + system): robust to load elsewhere
                row[f"mount_{label}_cpu_s"] = cpu_s(m.pid)
                # and the control plane's CPU meanwhile (serving the snapshot pages)
                row[f"mount_{label}_server_cpu_s"] = cpu_s(cp.proc.pid) - server0
                time.sleep(1.0)
                row[f"rss_{label}_mib"] = rss_kib(m.pid)["VmRSS"] / 1024
                if label == "warm" and n:
                    flat = m.mountpoint / f"s{n}" / "flat"
                    row["ls_entries"] = min(n, 10_000)
                    mine, floor = [], []
                    for _ in range(3):  # interleaved rounds, each the median of 5
                        mine.append(ls_us_per_entry(flat))
                        if bare is not None:
                            floor.append(ls_us_per_entry(bare.mountpoint / "flat"))
                    row["ls_us_per_entry"] = median(mine)
                    if floor:
                        row["bare_ls_us_per_entry"] = median(floor)
                    if args.grep:
                        mine, floor = [], []
                        grep(m.mountpoint / f"s{n}", timeout=1800)  # warm-up: kernel caches
                        grep(bare.mountpoint, timeout=1800)
                        for _ in range(3):
                            mine.append(grep(m.mountpoint / f"s{n}", timeout=1800)[0])
                            floor.append(grep(bare.mountpoint, timeout=1800)[0])
                        row["grep_s"], row["bare_grep_s"] = median(mine), median(floor)
                        row["grep_us_per_file"] = 1e6 * row["grep_s"] / n
                        row["bare_grep_us_per_file"] = 1e6 * row["bare_grep_s"] / n
                    row["rss_after_ls_mib"] = rss_kib(m.pid)["VmRSS"] / 1024
                m.stop()
            if bare is not None:
                bare.stop()
            row["loadavg"] = os.getloadavg()[0]
            out["sizes"][n] = row
            s.say(f"{n} records: {row}")
        ns = [n for n in sizes]
        for label in ("fresh", "warm"):
            out[f"rss_slope_{label}_bytes_per_record"] = 1024 * 1024 * slope(
                [0, *ns], [out["sizes"][n][f"rss_{label}_mib"] for n in [0, *ns]])
        out["baseline_rss_mib"] = out["sizes"][0]["rss_fresh_mib"]
        out["baseline_target_mib"] = BASELINE_TARGET_MIB
        out["baseline_ok"] = out["baseline_rss_mib"] <= BASELINE_TARGET_MIB
        s.say(f"baseline {out['baseline_rss_mib']:.1f} MiB: "
              f"{'meets' if out['baseline_ok'] else 'misses'} the target of {BASELINE_TARGET_MIB:g} MiB")
        if args.grep and len(ns) >= 2:
            # least-squares slope of warm grep -r seconds over files: µs per file
            for key in ("grep_s", "bare_grep_s"):
                out[f"{key[:-2]}_slope_us_per_file"] = 1e6 * slope(ns, [out["sizes"][n][key] for n in ns])
    out["meta"]["loadavg_end"] = os.getloadavg()[0]
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
