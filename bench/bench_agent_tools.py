"""The memory tool's ``search`` and directory ``view`` on a big store (not a test, never run
by pytest).

Builds a store of N records (default 10,000; ``--quick`` 2,000) in a SQLite file through the
reference ``Service`` (in-process, no HTTP: the figure is the command's own database work),
spread over 20 top-level directories of 7 subdirectories each, and the same files in a local
directory. Then, best of 5 runs each:

- ``search`` of a rare word (10 lines in the store), of a common one (the first 100 lines
  shown), and ``view`` of ``/memories``, of the store and of one top-level directory, through
  ``memfuse.server.memtool.MemoryTool``: wall ms and SQL statements per command;
- the floor on the local directory: ``grep -rn -i -m 100`` for the searches (its first 100
  lines), Anthropic's reference ``BetaLocalFilesystemMemoryTool`` for the views (when the
  ``anthropic`` package is installed), wall ms.

Run it from the repository root::

    .venv/bin/python bench/bench_agent_tools.py            # 10,000 records
    .venv/bin/python bench/bench_agent_tools.py --quick    # 2,000 records

Writes ``bench/results-agent-tools.json`` (``--out`` to change); prints a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sqlalchemy import event

from memfuse.models import BatchRequest, WorkspaceCreate
from memfuse.server.app import create_app
from memfuse.server.memtool import MemoryTool
from memfuse.server.service import Principal

ROOT = Path(__file__).resolve().parent.parent
REPS = 5


def _content(i: int) -> str:
    rare = "the rare word zanzibar\n" if i % 1000 == 7 else ""
    return f"# note {i}\n" + "lorem ipsum dolor sit amet, consectetur adipiscing elit\n" * 3 + rare


def _path(i: int) -> str:
    return f"topic{i % 20:02d}/sub{i % 7}/note{i:05d}.md"


def _best(fn) -> tuple[float, object]:
    best, out = None, None
    for _ in range(REPS):
        t = time.perf_counter()
        out = fn()
        dt = (time.perf_counter() - t) * 1000
        best = dt if best is None or dt < best else best
    return best, out


def run(n: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="memfuse-bench-tools-"))
    try:
        app = create_app(f"sqlite:///{work}/db.sqlite", static_tokens={"bench-admin": None})
        svc = app.state.service
        admin = Principal(None)
        svc.create_workspace(admin, WorkspaceCreate(name="ws"))
        local = work / "memories" / "ws"
        ops = []
        for i in range(n):
            ops.append({"op": "create", "body": {"path": _path(i), "content": _content(i)}})
            f = local / _path(i)
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(_content(i))
            if len(ops) == 100 or i == n - 1:
                svc.batch(admin, "ws", BatchRequest.model_validate({"operations": ops}).operations)
                ops = []
        statements = [0]

        @event.listens_for(svc.db.engine, "before_cursor_execute")
        def _count(*_a) -> None:
            statements[0] += 1

        tool = MemoryTool(svc, Principal(workspace="ws"), "ws")
        try:
            from anthropic.tools.memory import BetaLocalFilesystemMemoryTool
            ref = BetaLocalFilesystemMemoryTool(base_path=str(work))
        except ImportError:
            ref = None
        rows = []
        cases = [
            ("search, rare word", {"command": "search", "query": "ZANZIBAR"}, ["-i", "zanzibar"]),
            ("search, common word (100 lines shown)", {"command": "search", "query": "ipsum"}, ["-i", "ipsum"]),
            ("view /memories", {"command": "view", "path": "/memories"}, None),
            ("view of the store", {"command": "view", "path": "/memories/ws"}, None),
            ("view of one top-level directory", {"command": "view", "path": "/memories/ws/topic03"}, None),
        ]
        for name, cmd, grep in cases:
            statements[0] = 0
            ms, result = _best(lambda: tool.run(cmd))
            stmts = statements[0] // REPS
            assert not result.is_error, result.content
            if grep is not None:
                floor, _ = _best(lambda: subprocess.run(
                    ["grep", "-rn", "-m", "100", *grep, str(local)], capture_output=True))
                floor_what = "grep -rn -i -m 100 on a local dir"
            elif ref is not None:
                floor, _ = _best(lambda: ref.call(cmd))
                floor_what = "reference local memory tool"
            else:
                floor, floor_what = None, "anthropic not installed"
            rows.append({"case": name, "records": n, "ms": round(ms, 1), "statements": stmts,
                         "floor_ms": None if floor is None else round(floor, 1), "floor": floor_what,
                         "ratio": None if not floor else round(ms / floor, 2)})
        return {"meta": {"records": n, "reps": REPS, "loadavg": os.getloadavg(),
                         "python": sys.version.split()[0]}, "rows": rows}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2,000 records instead of 10,000")
    ap.add_argument("--records", type=int, default=None)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results-agent-tools.json"))
    args = ap.parse_args()
    n = args.records or (2000 if args.quick else 10000)
    res = run(n)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"records: {n}, load average {res['meta']['loadavg'][0]:.2f}")
    print("| command | ms | SQL statements | floor ms | floor | ratio |")
    print("|---|---|---|---|---|---|")
    for r in res["rows"]:
        print(f"| {r['case']} | {r['ms']} | {r['statements']} | {r['floor_ms']} | {r['floor']} | {r['ratio']} |")


if __name__ == "__main__":
    main()
