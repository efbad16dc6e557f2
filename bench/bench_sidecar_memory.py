"""Sidecar memory and big stores: RSS per record, mount time, ``ls`` and ``grep -r`` slopes.

    .venv/bin/python bench/bench_sidecar_memory.py [--sizes 1000,10000,100000] [--grep]

- Stores of 1,000, 10,000 and 100,000 records of 200 B – 4 KB, each with its workspace (the
  store attached read-write) and a workspace token, written before ``memfuse serve`` starts
  by the control plane's own code in this process (``build_store``: ``Service`` over the
  same SQLite file: ``create_store``, ``create_workspace``, ``put_attachment``,
  ``create_token``, then ``batch`` of ``BATCH_MAX_OPERATIONS`` creates at a time): every row,
  counter, seq and full-text queue entry is what the server itself writes, with no HTTP
  (0.2–0.35 ms a record: ~33 s for 100,000, where the API would take minutes).
  ``check_store`` then checks the rows: the store's usage and history counters against a
  count of its records and versions, every record's seq that of its version, the full-text
  index after its drain.
  Records sit in directories of 1,000 (``dNNN/note-NNNNNN.md``); one directory, ``flat/``,
  holds the first min(N, 10,000).
- For each size, a fresh sidecar (empty cache) mounts it, then a second one with that cache
  (resume from the saved cursor): seconds from starting ``memfuse mount`` until the store
  lists, the CPU seconds the sidecar used until then (user + system: robust to load from
  elsewhere) and those the control plane (``memfuse serve``) used meanwhile, and ``VmRSS``
  after each. A sidecar of an empty store gives the baseline; the slope
  of RSS over records (least squares over the sizes) is the per-record cost.
- ``ls`` (``os.scandir`` + ``stat`` of every entry, warm, median of 5) of ``flat/`` at 1,000
  and 10,000 entries, memfuse and the bare pyfuse3 floor (``barefs.py`` over the same tree,
  mounted at the same time), 3 interleaved rounds, µs per entry.
- After the measurements of the warm sidecar, ``check_mount``: the store's top directory
  and ``flat/`` list exactly the records' names, and ``SAMPLE`` records (the first, the
  last, others at random) read back as written; a mismatch stops the run.
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
from pathlib import Path

from common import MEMFUSE, Bare, Mount, Session, cpu_s, grep, median, read_status, rss_kib  # noqa: F401
from mountutil import ControlPlane

from memfuse.models import (BATCH_MAX_OPERATIONS, Access, AttachmentPut, BatchOperation, StoreCreate, TokenCreate,
                            WorkspaceCreate)
from memfuse.server.base import Principal
from memfuse.server.db import Database
from memfuse.server.recordrows import _usage
from memfuse.server.service import Service

BENCH = Path(__file__).resolve().parent
BASELINE_TARGET_MIB = 45.0  # a sidecar of an empty store (issue 9); `baseline_ok` in the results
SAMPLE = 20  # records read back through each warm mount (check_mount)


def record(rng: random.Random, i: int) -> tuple[str, str]:
    """Record ``i`` of a store: (path, content), 200 B – 4 KB of five words; 1 % of the
    records (``i % 100 == 0``) have ``zebrafish`` for one word in five. The words are drawn
    with ``rng.choices`` (before session 24 one ``rng.choice`` a word: the same mix, other
    records, and 8.0 s instead of 2.1 s for 100,000)."""
    path = f"flat/note-{i:06d}.md" if i < 10_000 else f"d{i // 1000:03d}/note-{i:06d}.md"
    size = rng.randint(200, 4096)
    words = ("memory", "agent", "notes", "review", "zebrafish" if i % 100 == 0 else "cache")
    return path, (f"# note {i}\n" + " ".join(rng.choices(words, k=size // 7)))[:size] + "\n"


def build_store(svc: Service, slug: str, ws: str, n: int, seed: int) -> tuple[str, list[tuple[str, str]]]:
    """Store ``slug`` (limits: 10,000,000 records, 1 TiB) attached read-write to a new workspace
    ``ws``, filled with ``n`` records, all through ``svc`` (a ``memfuse.server.service.Service``
    in this process, as the root admin): the rows the server writes for the same requests.
    Returns (a token of ``ws``, [(path, content)] of every record). Raises ``RuntimeError``
    when the service refuses a record (its problem body in the message)."""
    admin = Principal(workspace=None, name="bench", root_token=True)
    svc.create_store(admin, StoreCreate(slug=slug, max_records=10_000_000, max_store_bytes=1 << 40))
    svc.create_workspace(admin, WorkspaceCreate(name=ws, default_store=False))
    svc.put_attachment(admin, ws, slug, AttachmentPut(access=Access.read_write))
    token = json.loads(svc.create_token(admin, TokenCreate(workspace=ws, name="bench")).body)["token"]
    rng = random.Random(seed)
    files = [record(rng, i) for i in range(n)]
    for k in range(0, n, BATCH_MAX_OPERATIONS):
        ops = [BatchOperation(op="create", body={"path": path, "content": text})
               for path, text in files[k:k + BATCH_MAX_OPERATIONS]]
        for op, reply in zip(ops, svc.batch(admin, slug, ops)):
            if reply.status != 201:
                raise RuntimeError(f"create {op.body['path']} in {slug}: {reply.status} {reply.body[:300]!r}")
    return token, files


def check_store(db: Database, slug: str, files: list[tuple[str, str]]) -> dict:
    """Check the rows of store ``slug`` as ``build_store`` left them, against ``files``: its
    usage counters (``usage_bytes``, ``record_count``) equal a count of its live records
    (``recordrows._usage``) and of ``files``; its history counters (``version_bytes``,
    ``version_count``) equal a count of its versions (one each); every record's ``seq`` is
    its version's, all distinct (``head_seq``: the newest); after the full-text queue's drain
    (``Database.index_pending``) every record has its key in the index. Returns the
    figures; raises ``AssertionError`` naming the first that disagrees."""
    db.index_pending()
    want = (len(files), sum(len(t.encode()) for _, t in files))
    with db.read_conn() as conn:
        usage = _usage(conn, [slug]).get(slug, (0, 0))
        st = conn.exec_driver_sql(
            "SELECT record_count, usage_bytes, version_count, version_bytes FROM stores WHERE slug = ?",
            (slug,)).one()
        versions = conn.exec_driver_sql(
            "SELECT count(*), coalesce(sum(size), 0), count(DISTINCT seq), coalesce(max(seq), 0) FROM versions "
            "WHERE store = ?", (slug,)).one()
        off_seq = conn.exec_driver_sql(
            "SELECT count(*) FROM records r JOIN versions v ON v.record_id = r.id AND v.version = r.version "
            "WHERE r.store = ? AND r.seq != v.seq", (slug,)).scalar()
        indexed = conn.exec_driver_sql(
            "SELECT count(*) FROM records r JOIN records_fts_keys k ON k.record_id = r.id WHERE r.store = ?",
            (slug,)).scalar()
    got = {"records_counted": list(usage), "store_counters": [st.record_count, st.usage_bytes],
           "versions_counted": [versions[0], versions[1]], "history_counters": [st.version_count, st.version_bytes],
           "distinct_seqs": versions[2], "head_seq": versions[3], "records_off_seq": off_seq, "indexed": indexed}
    assert usage == want, f"{slug}: live records {usage}, written {want}"
    assert (st.record_count, st.usage_bytes) == want, f"{slug}: store counters {got['store_counters']}, records {want}"
    assert (versions[0], versions[1]) == want, f"{slug}: versions {versions[:2]}, records {want}"
    assert (st.version_count, st.version_bytes) == want, f"{slug}: history counters {got['history_counters']}"
    assert versions[2] == len(files) and off_seq == 0, f"{slug}: seqs {got}"
    assert indexed == len(files), f"{slug}: {indexed} of {len(files)} records in the full-text index"
    return got


def check_mount(mountpoint: Path, slug: str, files: list[tuple[str, str]], head_seq: int, seed: int) -> int:
    """Check store ``slug`` of the mount at ``mountpoint`` against its records ``files``:
    the sidecar's status (``.memfuse/status.json``) counts their records and bytes, at the
    store's newest seq ``head_seq``; the store's top directory and ``flat/`` list exactly
    their names; ``SAMPLE`` of them (the first, the last and others picked with ``seed``)
    read back as written. Returns the records read; raises ``AssertionError`` on a
    difference."""
    st = next(x for x in read_status(mountpoint)["stores"] if x["slug"] == slug)
    want = {"records": len(files), "bytes": sum(len(t.encode()) for _, t in files), "cursor": head_seq}
    got = {k: st.get(k) for k in want}
    assert got == want, f"{slug}: the sidecar's status {got}, the store {want}"
    root = mountpoint / slug
    top = sorted({p.split("/", 1)[0] for p, _ in files})
    assert sorted(os.listdir(root)) == top, f"{root}: lists {sorted(os.listdir(root))[:5]}..., want {top[:5]}..."
    flat = sorted(p.split("/", 1)[1] for p, _ in files if p.startswith("flat/"))
    if flat:
        assert sorted(os.listdir(root / "flat")) == flat, f"{root}/flat lists other names"
    if not files:
        return 0
    picks = sorted({0, len(files) - 1, *random.Random(seed).sample(range(len(files)), min(SAMPLE, len(files)) - 2)}
                   if len(files) > 2 else range(len(files)))
    for i in picks:
        path, text = files[i]
        back = (root / path).read_text()
        assert back == text, f"{root / path}: read {len(back)} characters, wrote {len(text)}"
    return len(picks)


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
        all_files, tokens, out["checks"] = {}, {}, {}
        t0 = time.perf_counter()
        db = Database(f"sqlite:///{cp.db}")  # the schema at its head, as `memfuse serve --migrate` makes it
        try:
            svc = Service(db)
            for n in [0, *sizes]:
                t1 = time.perf_counter()
                token, all_files[n] = build_store(svc, f"s{n}", f"w{n}", n, seed=n)
                out["meta"][f"populate_{n}_s"] = time.perf_counter() - t1
                tokens[n] = s.dir / f"w{n}.token"
                tokens[n].write_text(token)
                out["checks"][n] = check_store(db, f"s{n}", all_files[n])
        finally:
            db.dispose()
        out["meta"]["populate_s"] = time.perf_counter() - t0
        s.say(f"stores built and checked in {out['meta']['populate_s']:.1f} s")
        cp.start()
        for n in [0, *sizes]:
            row: dict = {}
            tok = tokens[n]
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
                if label == "warm":  # after the figures: lists and reads what was written
                    row["records_read_back"] = check_mount(m.mountpoint, f"s{n}", all_files[n],
                                                              out["checks"][n]["head_seq"], seed=n)
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
