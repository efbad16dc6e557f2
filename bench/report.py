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
    print("| figure | memfuse | local | bare floor | ratio | target | result |")
    print("|---|---:|---:|---:|---:|---|---|")
    for r in data["rows"]:
        ratio = f"{r['ratio']:.2f}× {r['ratio_vs']}" if r.get("ratio") is not None else "—"
        res = {True: "pass", False: "**MISS**", None: "—"}[r["passed"]]
        unit = f" ({r['unit']})" if r["unit"] else ""
        print(f"| {r['figure']}{unit} | {fmt(r['value'])} | {fmt(r['local'])} | {fmt(r['bare'])} "
              f"| {ratio} | {r['target_text'].replace('<=', '≤').replace('>=', '≥')} | {res} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
