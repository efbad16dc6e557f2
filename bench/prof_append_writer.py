"""The writer side of appends to one growing record, in process: ``Service.append_record``
(with ``If-Match`` and an ``Idempotency-Key``, as the sidecar sends an ``echo line >> f``) on a
SQLite file, called serially from one thread as ``memfuse serve``'s writer thread calls it
(issue 25 item 1; bench/README.md, "The close path, session 22: appends re-indexed at the
drain").

Usage: ``python bench/prof_append_writer.py [--rounds 5] [--n 400] [--nofts] [--statements]``;
per round of ``n`` appends of a ~60-byte line (the record grows ~24 KB a round): the write-ahead
log frames per append (``Database._wal``'s count), this thread's CPU ms per append
(``time.thread_time``) and the record's size. ``--nofts``: the SQLite full-text index's update
trigger dropped first (what the index costs an append). ``--statements``: after the last round,
the statements of the memfuse ``Raw`` layer by time per append (their triggers inside).
One JSON line per round.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sqlalchemy import text  # noqa: E402

from memfuse.models import RecordAppend, RecordCreate, WorkspaceCreate  # noqa: E402
from memfuse.server import rawsql  # noqa: E402
from memfuse.server.base import IdempotencyRequest, Principal  # noqa: E402
from memfuse.server.db import Database  # noqa: E402
from memfuse.server.service import Service  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--nofts", action="store_true")
    ap.add_argument("--statements", action="store_true")
    args = ap.parse_args()
    spent: collections.Counter[str] = collections.Counter()
    if args.statements:
        run = rawsql.Raw._execute  # noqa: SLF001

        def timed(self: Any, conn: Any, params: Any) -> Any:
            t = time.perf_counter()
            try:
                return run(self, conn, params)
            finally:
                spent[" ".join(str(self.stmt).split())[:100]] += time.perf_counter() - t
        rawsql.Raw._execute = timed  # type: ignore[method-assign]  # noqa: SLF001
    with tempfile.TemporaryDirectory(prefix="prof-append-") as d:
        db = Database(f"sqlite:///{d}/cp.db")
        svc = Service(db)
        if args.nofts:
            with db.engine.begin() as c:
                c.execute(text("DROP TRIGGER records_fts_au"))
        svc.create_workspace(Principal(workspace=None, name="bench"), WorkspaceCreate(name="ws"))
        p = Principal(workspace="ws", instance="bench")
        r = svc.create_record(p, "ws", RecordCreate(path="JOURNAL.jsonl", content='{"i": 0}\n'), None)
        rid, etag = json.loads(r.body)["id"], r.headers["ETag"]
        url = f"/v1/stores/ws/records/{rid}/append"
        size = 9
        for rnd in range(args.rounds):
            spent.clear()
            f0, c0 = db._wal.frames, time.thread_time()  # noqa: SLF001
            for i in range(args.n):
                line = f'{{"i": {i}, "msg": "another line of the agent journal, round {rnd}"}}\n'
                idem = IdempotencyRequest(str(uuid.uuid4()), "POST", url, uuid.uuid4().hex * 2, uuid.uuid4().hex * 2)
                rr = svc.append_record(p, "ws", rid, RecordAppend(append=line), etag, idem)
                assert rr.status == 200, rr.body
                etag = rr.headers["ETag"]
                size += len(line)
            print(json.dumps({"round": rnd, "record_kb": round(size / 1024, 1),
                              "frames": round((db._wal.frames - f0) / args.n, 2),  # noqa: SLF001
                              "cpu_ms": round((time.thread_time() - c0) / args.n * 1000, 3),
                              "nofts": args.nofts}), flush=True)
        if args.statements:
            for k, v in spent.most_common(8):
                print(json.dumps({"statement": k, "ms_per_append": round(v / args.n * 1000, 3)}))
        db.dispose()


if __name__ == "__main__":
    main()
