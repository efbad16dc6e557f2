"""Start-to-exit time of CLI commands in local mode (no ``--control-plane``: the control plane
in process on the dev database), beside the floor of a Python interpreter that only starts
and the import of ``memfuse.cli`` alone.

    .venv/bin/python bench/bench_cli_local.py [--runs 15] [--src DIR]

Makes a dev database in a fresh ``MEMFUSE_HOME`` (one store, ``MEMORY.md`` and 20 records),
then runs each command ``--runs`` times and reports the median wall time and the median CPU
time (user + system of the child, from ``wait4``), which the other work on the machine
inflates less than wall time. ``--src DIR`` runs the ``memfuse`` package found in DIR (a
``git archive`` of another commit, say) with this venv, for a before / after comparison.
Writes ``bench/results-cli-local.json`` (``--out`` to change).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

COMMANDS = {
    "python -c pass (floor)": ["-c", "pass"],
    "import memfuse.cli": ["-c", "import memfuse.cli"],
    "history default MEMORY.md": ["-m", "memfuse.cli", "history", "default", "MEMORY.md"],
    "show default MEMORY.md": ["-m", "memfuse.cli", "show", "default", "MEMORY.md"],
    "search default note": ["-m", "memfuse.cli", "search", "default", "note"],
    "store list": ["-m", "memfuse.cli", "store", "list"],
}

FILL = """
import trio
from memfuse.devenv import ensure_dev_setup, local_client
async def main():
    async with local_client() as api:
        await ensure_dev_setup(api)
        await api.create_record("default", "MEMORY.md", "- [notes](notes/): the notes\\n")
        for i in range(20):
            await api.create_record("default", f"notes/n{i:02d}.md", f"note {i}\\nabout things\\n")
trio.run(main)
"""

def run_once(args: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall s, child CPU s) of one run; raises when it fails."""
    if args[:1] == ["-m"]:  # memfuse.cli has no __main__: call its entry point
        args = ["-c", "from memfuse.cli import main; import sys; sys.argv[0] = 'memfuse'; main()", *args[2:]]
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, cwd=env["MEMFUSE_HOME"])  # not a checkout
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read() if proc.stderr else b""
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"{args}: exit {proc.returncode}: {err.decode(errors='replace')[-500:]}")
    return wall, usage.ru_utime + usage.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--src", type=Path, help="directory holding the memfuse package to run")
    ap.add_argument("--out", type=Path, default=HERE / "results-cli-local.json")
    opts = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="memfuse-bench-cli-"))
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MEMFUSE_")}
        env["MEMFUSE_HOME"] = str(work / "home")
        if opts.src:
            env["PYTHONPATH"] = str(opts.src.resolve())
        os.makedirs(env["MEMFUSE_HOME"])
        subprocess.run([sys.executable, "-c", FILL], env=env, check=True, timeout=300, cwd=env["MEMFUSE_HOME"])
        where = subprocess.run([sys.executable, "-c", "import memfuse; print(memfuse.__file__)"],
                               env=env, check=True, capture_output=True, text=True,
                               cwd=env["MEMFUSE_HOME"]).stdout.strip()
        rows = []
        for name, args in COMMANDS.items():
            try:
                run_once(args, env)  # warm the page cache and the bytecode
            except RuntimeError as e:  # a command the memfuse of --src does not have
                print(f"{name:32s} n/a ({str(e).splitlines()[-1]})", flush=True)
                rows.append({"command": name, "wall_s": None, "cpu_s": None})
                continue
            samples = [run_once(args, env) for _ in range(opts.runs)]
            wall = statistics.median(s[0] for s in samples)
            cpu = statistics.median(s[1] for s in samples)
            rows.append({"command": name, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3)})
            print(f"{name:32s} wall {wall:6.3f} s   cpu {cpu:6.3f} s", flush=True)
        result = {"memfuse": where, "runs": opts.runs, "loadavg": os.getloadavg(), "rows": rows}
        opts.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"load average {os.getloadavg()}; memfuse from {where}; wrote {opts.out}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
