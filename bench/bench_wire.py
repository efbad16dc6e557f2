"""Decoding a snapshot page: the client's msgspec Structs (memfuse/wire.py) against the
server's pydantic models (memfuse/models.py, what the client decoded with before).

    .venv/bin/python bench/bench_wire.py [--records 1000] [--content-bytes 600]

One ``RecordPage`` of ``--records`` records with content (the largest page a snapshot asks
for) is made by the server model and serialised as the server sends it; each side decodes
it repeatedly (best of 5 rounds, so other load on the machine inflates it least), and the
memory the decoded records hold is measured with ``tracemalloc`` (10 pages). Pure CPU in one
process: no server, no mount. The ratio is pydantic / msgspec (higher: msgspec faster or
smaller).
"""
from __future__ import annotations

import argparse
import gc
import random
import time
import tracemalloc
from datetime import datetime, timedelta, timezone

from memfuse import models, wire


def page_json(n: int, content_bytes: int) -> bytes:
    rng = random.Random(3)
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    recs = []
    for i in range(n):
        text = "".join(rng.choice("abcdefghij klmnop\n") for _ in range(content_bytes))
        t = t0 + timedelta(seconds=i, microseconds=rng.randrange(1_000_000))
        recs.append(models.Record(id=f"{i:032x}", store="default", path=f"notes/{i:05d}.md",
                                  type="project", version=1 + i % 3, sha256="ab" * 32,
                                  size=len(text), created_at=t, updated_at=t, updated_by="ws:w/side",
                                  seq=i + 1, content=text, mtime_ns=None if i % 2 else 1_700_000_000_000_000_000))
    return models.RecordPage(records=recs, next_cursor="c", seq=n).model_dump_json().encode()


def best_ms(fn, data: bytes, rounds: int = 5, per_round: int = 5) -> float:
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(per_round):
            fn(data)
        best = min(best, (time.perf_counter() - t) / per_round)
    return best * 1000


def held_kib(fn, data: bytes, pages: int = 10) -> float:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    kept = [fn(data) for _ in range(pages)]
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del kept
    return (after - before) / pages / 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1000)
    ap.add_argument("--content-bytes", type=int, default=600)
    args = ap.parse_args()
    data = page_json(args.records, args.content_bytes)
    old = models.RecordPage.model_validate_json
    new = lambda b: wire.decode(b, wire.RecordPage)  # noqa: E731
    assert wire.to_jsonable(new(data)) == old(data).model_dump(mode="json")
    old_ms, new_ms = best_ms(old, data), best_ms(new, data)
    old_kib, new_kib = held_kib(old, data), held_kib(new, data)
    print(f"one RecordPage of {args.records} records, {len(data) // 1024} KiB of JSON")
    print(f"{'':28}{'pydantic':>10}{'msgspec':>10}{'ratio':>8}")
    print(f"{'decode [ms], best of 5':28}{old_ms:>10.2f}{new_ms:>10.2f}{old_ms / new_ms:>7.1f}×")
    print(f"{'held after decode [KiB]':28}{old_kib:>10.0f}{new_kib:>10.0f}{old_kib / new_kib:>7.2f}×")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
