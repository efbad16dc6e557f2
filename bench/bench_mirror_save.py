"""The store mirror's save at 100,000 records: the time it holds the trio thread and the bytes
it writes, before (the whole mirror rewritten at every save) and after (an append to the
mirror's log; the base rewritten in a worker thread when the log passes a quarter of it).

    .venv/bin/python bench/bench_mirror_save.py [--records 100000] [--changes 1,1000] [--rounds 5]

In process, on a temporary directory: a ``StoreState`` of ``--records`` ``Meta`` entries (ids
like the control plane's, paths in directories of 1,000, random digests), saved once; then,
for each count of changed records, ``--rounds`` rounds of: that many feed changes applied
(``StoreState.apply``), then one save. Measured while a trio task ticks (``await
trio.sleep(0)`` in a loop, as the FUSE loop would take turns): the longest the ticker could
not run during the save (the trio thread held, including the GIL taken by a worker thread),
the wall time of the save call on the trio thread, and the bytes written. The floor: the
same gap around a call that does nothing (scheduling noise of a loaded machine).

- ``before``: the save of the previous release, run as it was (``encode`` of the whole mirror
  with one ``msgspec.json.encode``, tmp file, rename), copied here;
- ``append``: ``StoreState.save_async`` when no compaction is due (one frame appended);
- ``compaction``: ``StoreState.save_async`` forced to rewrite the base (``_base_id`` cleared):
  the encode and the write run in a worker thread, the trio thread takes the list of entries
  and then writes the first frame of the new log;
- ``load``: ``StoreState.load`` of the base alone and of the base with a log at the size that
  triggers a compaction (the slowest load the log allows).
Results: printed, and ``bench/results-mirror-save.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

import msgspec  # noqa: E402
import trio  # noqa: E402

from memfuse.sidecar import sync  # noqa: E402
from memfuse.sidecar.cachedir import write_private  # noqa: E402
from memfuse.sidecar.sync import Meta, StoreState  # noqa: E402
from memfuse.wire import Change, Operation, Record  # noqa: E402

T0 = datetime(2026, 12, 1, tzinfo=timezone.utc)


def build(path: Path, n: int, rng: random.Random) -> StoreState:
    st = StoreState(path, "bench")
    metas = [Meta.new(str(uuid.UUID(int=rng.getrandbits(128))), f"d{i // 1000:03d}/note-{i:06d}.md",
                      "project", 1 + i % 3, rng.randbytes(32).hex(), 200 + i % 4000,
                      1_764_547_200_000_000_000 + i, 0o644, None)
             for i in range(n)]
    st.reset(metas, n)
    return st


def change(st: StoreState, k: int, rng: random.Random) -> None:
    ids = rng.sample(list(st.records), k)
    for i in ids:
        m = st.records[i]
        r = Record(id=i, store="bench", path=m.path, type=m.type, version=m.version + 1,
                   sha256=rng.randbytes(32).hex(), size=m.size + 1, created_at=T0,
                   updated_at=T0, updated_by="other", seq=st.cursor + 1)
        st.apply(Change(seq=st.cursor + 1, operation=Operation.modified, record=r))


def save_before(st: StoreState) -> int:
    """The previous release's ``StoreState.save`` (format 4 written whole), verbatim."""
    recs = list(st.records.values())
    dirs: dict[str, int] = {}
    types: dict = {}
    modes: dict[int, int] = {}
    cols = {"id": [m.id for m in recs],
            "dir": [dirs.setdefault(m.dir, len(dirs)) for m in recs],
            "name": [m.name for m in recs],
            "type": [types.setdefault(m.type, len(types)) for m in recs],
            "version": [m.version for m in recs],
            "sha256": b"".join([m.sha for m in recs]).hex(),
            "size": [m.size for m in recs], "updated_ns": [m.updated_ns for m in recs],
            "mode": [modes.setdefault(m.mode, len(modes)) for m in recs],
            "mtime_ns": [m.mtime_ns for m in recs]}
    data = msgspec.json.encode({"format": 4, "cursor": st.cursor, "access": st.access,
                                "limits": st.limits, "dirs": list(dirs), "types": list(types),
                                "modes": list(modes), "columns": cols})
    tmp = st.path.with_suffix(".tmp")
    write_private(tmp, data)
    os.replace(tmp, st.path)
    st.dirty = False
    return len(data)


def on_disk(st: StoreState) -> int:
    return sum(p.stat().st_size for p in (st.path, st.log_path) if p.exists())


async def measured(fn) -> tuple[float, float]:
    """(longest gap of a trio ticker, wall seconds of ``fn`` on the trio thread) while
    ``fn`` (sync or async) runs."""
    gaps = [0.0]
    done = False

    async def ticker():
        last = time.perf_counter()
        while not done:
            await trio.sleep(0)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async with trio.open_nursery() as n:
        n.start_soon(ticker)
        await trio.sleep(0.01)
        gaps[:] = [0.0]
        t = time.perf_counter()
        r = fn()
        if hasattr(r, "__await__"):
            await r
        wall = time.perf_counter() - t
        await trio.sleep(0)
        done = True
    return max(gaps), wall


def run(n: int, counts: list[int], rounds: int) -> dict:
    rng = random.Random(7)
    out = {"records": n, "rounds": rounds, "saves": {}}
    with tempfile.TemporaryDirectory(prefix="bench-mirror-") as d:
        d = Path(d)
        floor = [trio.run(measured, lambda: None)[0] for _ in range(max(rounds, 5))]
        out["floor_held_ms_median"] = round(statistics.median(floor) * 1000, 2)
        print(f"floor (the ticker's longest gap around a call that does nothing): "
              f"{out['floor_held_ms_median']} ms", flush=True)
        for k in counts:
            for mode in ("before", "append", "compaction"):
                st = build(d / f"{mode}-{k}.json", n, rng)
                trio.run(st.save_async)  # the base
                held, walls, written = [], [], []
                for _ in range(rounds):
                    change(st, k, rng)
                    before = on_disk(st) if mode == "append" else 0
                    if mode == "before":
                        fn = lambda: save_before(st)  # noqa: E731
                    else:
                        if mode == "compaction":
                            st._base_id = None
                        fn = st.save_async
                    size = {"v": 0}

                    async def go():
                        return await measured(fn)
                    gap, wall = trio.run(go)
                    if mode == "before":
                        size["v"] = st.path.stat().st_size
                    elif mode == "append":
                        size["v"] = on_disk(st) - before
                    else:
                        size["v"] = on_disk(st)
                    assert not st.dirty
                    held.append(gap)
                    walls.append(wall)
                    written.append(size["v"])
                row = {"held_ms_median": round(statistics.median(held) * 1000, 2),
                       "held_ms_max": round(max(held) * 1000, 2),
                       "call_ms_median": round(statistics.median(walls) * 1000, 2),
                       "bytes_median": int(statistics.median(written))}
                out["saves"][f"{mode}/{k}"] = row
                print(f"{n} records, {k:5d} changed, {mode:10s}: trio thread held "
                      f"{row['held_ms_median']:8.2f} ms (max {row['held_ms_max']:.2f}), call "
                      f"{row['call_ms_median']:8.2f} ms, written {row['bytes_median']:>10,} B",
                      flush=True)
        # loads: base alone; base + a log at the compaction threshold
        st = build(d / "load.json", n, rng)
        st.save()
        base = st.path.stat().st_size
        t = []
        for _ in range(rounds):
            s = time.perf_counter()
            assert StoreState(st.path, "bench").load()
            t.append(time.perf_counter() - s)
        out["load_base_s"] = round(statistics.median(t), 3)
        while (st._log_size or 0) <= max(sync.LOG_MIN, base * sync.LOG_FRACTION):
            change(st, 1000, rng)
            st.save()
        t = []
        for _ in range(rounds):
            s = time.perf_counter()
            again = StoreState(st.path, "bench")
            assert again.load() and again.records == st.records
            t.append(time.perf_counter() - s)
        out["load_base_and_log_s"] = round(statistics.median(t), 3)
        out["log_bytes_at_threshold"] = st._log_size
        out["base_bytes"] = base
        print(f"load: base ({base:,} B) {out['load_base_s']} s; base + log of "
              f"{st._log_size:,} B (the compaction threshold) {out['load_base_and_log_s']} s")
    out["loadavg"] = os.getloadavg()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--changes", default="1,1000")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    res = run(a.records, [int(x) for x in a.changes.split(",")], a.rounds)
    (BENCH / "results-mirror-save.json").write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
