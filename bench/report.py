"""Print a results file as a Markdown table (the one in ``bench/README.md``).

    .venv/bin/python bench/report.py [bench/results.json]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from common import BENCH, fmt


def main() -> int:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else BENCH / "results.json"
    data = json.loads(path.read_text())
    m = data["meta"]
    print(f"Run {m['time']}, commit {m['git']}, {m['cpus']} CPUs ({m['cpu_model']}), kernel "
          f"{m['kernel']}, Python {m['python']}, pyfuse3 {m['pyfuse3']}, load average "
          f"{m.get('loadavg_start', ['?'])[0]:.1f} → {m.get('loadavg_end', ['?'])[0]:.1f}, "
          f"{m.get('total_s')} s.\n")
    if m.get("peer_skipped"):
        print(f"JuiceFS (the peer) skipped: {m['peer_skipped']}\n")
    elif m.get("peer_version"):
        print(f"Peer: {m['peer_version']} (SQLite metadata, file bucket).\n")
    print("| figure | memfuse | local | bare floor | JuiceFS | vs JuiceFS | ratio | target | result |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---|")
    for r in data["rows"]:
        ratio = f"{r['ratio']:.2f}× {r['ratio_vs']}" if r.get("ratio") is not None else "—"
        res = {True: "pass", False: "**MISS**", None: "—"}[r["passed"]]
        unit = f" ({r['unit']})" if r["unit"] else ""
        vs = f"{r['vs_peer']:.2f}×" if r.get("vs_peer") is not None else "—"
        print(f"| {r['figure']}{unit} | {fmt(r['value'])} | {fmt(r['local'])} | {fmt(r['bare'])} "
              f"| {fmt(r.get('peer'))} | {vs} | {ratio} | {r['target_text'].replace('<=', '≤').replace('>=', '≥')} | {res} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
