"""Which pages one record create writes to SQLite's write-ahead log: a store of ``--n``
records made with ``Service.create_record`` (with an ``Idempotency-Key``, as the sidecar sends
it), then ``--k`` more creates, each alone in the log (a ``TRUNCATE`` checkpoint before it);
each frame's page number is read from the log file and named by SQLite's ``dbstat`` table
(the b-tree it belongs to; ``sqlite_schema`` is page 1, the file's header, written when the
file grows). Issue 25 item 2 (bench/README.md, "The close path, session 21: serve's WAL pages").

Usage: ``python bench/prof_wal_pages.py [--n 500] [--k 20] [--size BYTES]``; prints frames per
create, then frames per create by b-tree. ``--size``: records of that many bytes instead of the
benchmark's ~500-byte files (``bench_write.content``).
"""
from __future__ import annotations

import argparse
import collections
import json
import sqlite3
import struct
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_write import content  # noqa: E402

from memfuse.models import RecordCreate, WorkspaceCreate  # noqa: E402
from memfuse.server.base import IdempotencyRequest, Principal  # noqa: E402
from memfuse.server.db import Database  # noqa: E402
from memfuse.server.service import Service  # noqa: E402


def wal_pages(path: Path) -> tuple[int, list[int]]:
    """(page size, page number of every frame) of the write-ahead log at ``path``."""
    wal = path.read_bytes()
    psz = struct.unpack(">I", wal[8:12])[0]
    pages, off = [], 32
    while off + 24 + psz <= len(wal):
        pages.append(struct.unpack(">I", wal[off:off + 4])[0])
        off += 24 + psz
    return psz, pages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--size", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="prof-wal-pages-") as d:
        db = Database(f"sqlite:///{d}/cp.db")
        svc = Service(db)
        svc.create_workspace(Principal(workspace=None, name="bench"), WorkspaceCreate(name="ws"))
        p = Principal(workspace="ws", instance="bench")

        def one(path: str, i: int) -> None:
            idem = IdempotencyRequest(str(uuid.uuid4()), "POST", "/v1/stores/ws/records",
                                      uuid.uuid4().hex * 2, uuid.uuid4().hex * 2)
            body = content(i).decode() if not args.size else ("x" * 60 + "\n") * max(1, args.size // 61)
            r = svc.create_record(p, "ws", RecordCreate(path=path, content=body), idem)
            assert r.status == 201, r.body

        for i in range(args.n):
            one(f"warm/d{i % 10}/{i}.md", i)
        db._wal.every = 1 << 30  # noqa: SLF001 - no checkpoint but this script's
        by: collections.Counter[str] = collections.Counter()
        frames, psz = 0, 0
        for j in range(args.k):
            with db.write_conn():  # the kept connection, made if none
                pass
            kept = db._kept  # noqa: SLF001 - outside a transaction: a checkpoint cannot run inside one
            assert kept is not None
            kept.connection.dbapi_connection.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            one(f"new/d{j % 10}/{j}.md", args.n + j)
            psz, pages = wal_pages(Path(d) / "cp.db-wal")
            frames += len(pages)
            named = sqlite3.connect(f"{d}/cp.db")
            try:
                names = dict(named.execute("SELECT pageno, name FROM dbstat"))
            finally:
                named.close()
            by.update(names.get(pg, f"page {pg}") for pg in pages)
        db.dispose()
    print(json.dumps({"page_size": psz, "frames_per_create": round(frames / args.k, 2), "n": args.n}))
    for name, c in by.most_common():
        print(f"{c / args.k:6.2f}  {name}")


if __name__ == "__main__":
    main()
