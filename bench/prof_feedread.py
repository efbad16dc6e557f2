"""The change-feed read a create costs ``memfuse serve`` for each other listener of its store:
``Service.feed_read`` of the one new version (with content, as a sidecar's stream asks), and the
page's JSON, in process on a SQLite file (issue 25 item 2, session 15: the echo; bench/README.md,
"The close path, session 15: the echo").

Usage: ``python bench/prof_feedread.py [--n 1000] [--rounds 3] [--profile FILE]``; one JSON
line per round: CPU ms per read (``time.thread_time``: the read as a stream's worker thread
runs it, then the page's encoding as the event loop runs it), with the creates' CPU apart.
Each create is followed by the read of the version it made (after the previous read's
``seq``), as a stream's wake-up reads it. ``--profile FILE``: cProfile of the last round's
reads (pstats). Instructions per read: run it under ``valgrind --tool=callgrind
--dump-before=getpgrp`` with ``--rounds 1``, once as it is and once with ``--no-read``
(the script calls ``os.getpgrp()`` right before and after the round: the second dump holds
the round alone); the difference over ``n`` is a read's.

To compare two trees, run each tree's own copy of this script from its ``bench/`` with
``PYTHONPATH`` at that tree (``common.py`` puts its own tree first on ``sys.path``).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_write import content  # noqa: E402
from common import loadavg  # noqa: E402

from memfuse.defs import FEED_PAGE_MAX  # noqa: E402
from memfuse.models import RecordCreate, WorkspaceCreate  # noqa: E402
from memfuse.server.base import IdempotencyRequest, Principal  # noqa: E402
from memfuse.server.db import Database  # noqa: E402
from memfuse.server.service import Service  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", type=Path, default=None)
    ap.add_argument("--no-read", action="store_true",
                    help="the creates alone (callgrind: a round with reads less one without is the reads' cost)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="prof-feedread-") as d:
        db = Database(f"sqlite:///{d}/cp.db")
        svc = Service(db)
        admin = Principal(workspace=None, name="bench")
        svc.create_workspace(admin, WorkspaceCreate(name="ws"))
        p = Principal(workspace="ws", instance="bench")
        url = "/v1/stores/ws/records"
        key = svc.check_feed_access(p, "ws")

        def create(path: str, i: int) -> None:
            idem = IdempotencyRequest(str(uuid.uuid4()), "POST", url, uuid.uuid4().hex * 2, uuid.uuid4().hex * 2)
            r = svc.create_record(p, "ws", RecordCreate(path=path, content=content(i).decode()), idem)
            assert r.status == 201, r.body

        for i in range(50):
            create(f"warm/{i}.md", i)
        for rnd in range(args.rounds):
            after = svc.feed_read(key, 0, limit=1000, with_content=False).store_top
            prof = None
            if args.profile is not None and rnd == args.rounds - 1:
                import cProfile
                prof = cProfile.Profile()
            creates = reads = 0.0
            size = 0
            ru0 = resource.getrusage(resource.RUSAGE_THREAD)
            os.getpgrp()  # the round's start for callgrind (--dump-before=getpgrp)
            for i in range(args.n):
                c0 = time.thread_time()
                create(f"r{rnd}/d{i % 10}/{i}.md", i)
                c1 = time.thread_time()
                if not args.no_read:
                    if prof is not None:
                        prof.enable()
                    fr = svc.feed_read(key, after, limit=FEED_PAGE_MAX, with_content=True)
                    page, raw = fr.page(None)
                    if prof is not None:
                        prof.disable()
                    assert len(page.changes) == 1, page
                    after = page.seq
                    size += len(raw or b"")
                c2 = time.thread_time()
                creates += c1 - c0
                reads += c2 - c1
            os.getpgrp()  # the round's end
            ru1 = resource.getrusage(resource.RUSAGE_THREAD)
            if prof is not None:
                prof.dump_stats(str(args.profile))
            print(json.dumps({"round": rnd, "read_cpu_ms": round(reads / args.n * 1000, 4),
                              "create_cpu_ms": round(creates / args.n * 1000, 4),
                              "round_user_sys_ms": [round((ru1.ru_utime - ru0.ru_utime) / args.n * 1000, 4),
                                                    round((ru1.ru_stime - ru0.ru_stime) / args.n * 1000, 4)],
                              "page_bytes": size // args.n, "load": loadavg()}), flush=True)
        db.dispose()


if __name__ == "__main__":
    main()
