"""Start-to-exit time of the CLI's read commands, in local mode (no ``--control-plane``: the
control plane in process on the dev database) and against a server (``memfuse serve`` on
loopback), beside the floor the issue sets: ``python -c "import httpx, click"``.

    .venv/bin/python bench/bench_cli_local.py [--runs 15] [--src DIR] [--no-server]

Makes a dev database in a fresh ``MEMFUSE_HOME`` (one store, ``MEMORY.md`` and 20 records)
and, unless ``--no-server``, a ``memfuse serve`` on a copy of it; ``memfuse status`` reads a
directory holding a mount's ``.memfuse/status.json``. Runs every command once per
round, ``--runs`` rounds, the floor in each round (paired runs: a machine loaded by others
slows a round's runs alike), and reports per command the median wall time and CPU time (user
+ system of the child, from ``wait4``; the other work on the machine inflates it less than
wall time) and the ratio of its CPU time to the floor's (median of the per-round ratios;
target: at most 2.5). Then lists what each command imports: the top-level packages of
``python -X importtime`` by their own import time. ``--src DIR`` runs the ``memfuse`` package
found in DIR (a ``git archive`` of another commit, say) with this venv, for a before / after
comparison. Writes ``bench/results-cli-local.json`` (``--out`` to change).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

FLOOR = "import httpx, click (floor)"
READS = {  # the read commands people script (issue 26)
    "history": ["history", "default", "MEMORY.md"],
    "show": ["show", "default", "MEMORY.md"],
    "search": ["search", "default", "note"],
    "store list": ["store", "list"],
    "token list": ["token", "list"],
}
COMMANDS = {
    FLOOR: ["-c", "import httpx, click"],
    "python -c pass": ["-c", "pass"],
    "import memfuse.cli": ["-c", "import memfuse.cli"],
    "status (a mount's status.json)": ["-m", "memfuse.cli", "status", "{mount}"],
    **{f"local: {k}": ["-m", "memfuse.cli", *v] for k, v in READS.items()},
    **{f"server: {k}": ["-m", "memfuse.cli", *v] for k, v in READS.items()},
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

STATUS_JSON = {"workspace": "dev", "ready": True, "stores": {"default": {"access": "read_write", "records": 21}},
               "outbox": {"depth": 0}}


def _argv(args: list[str]) -> list[str]:
    mount = os.environ.get("MEMFUSE_BENCH_MOUNT", "")
    args = [a.replace("{mount}", mount) for a in args]
    if args[:1] == ["-m"]:  # memfuse.cli has no __main__: call its entry point
        return ["-c", "from memfuse.cli import main; import sys; sys.argv[0] = 'memfuse'; main()", *args[2:]]
    return args


def run_once(args: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall s, child CPU s) of one run; raises when it fails."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *_argv(args)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, cwd=env["MEMFUSE_HOME"])  # not a checkout
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read() if proc.stderr else b""
    proc.stderr.close()
    if proc.returncode != 0:
        raise RuntimeError(f"{args}: exit {proc.returncode}: {err.decode(errors='replace')[-500:]}")
    return wall, usage.ru_utime + usage.ru_stime


def imports(args: list[str], env: dict[str, str], top: int = 12) -> list[tuple[str, float]]:
    """What a run imports: (top-level package, ms of its modules' own import time), the
    ``top`` costliest first (``python -X importtime``)."""
    proc = subprocess.run([sys.executable, "-X", "importtime", *_argv(args)], env=env, capture_output=True,
                          text=True, cwd=env["MEMFUSE_HOME"], timeout=300)
    cost: dict[str, float] = {}
    for line in proc.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+\d+ \|\s*(\S+)", line)
        if m:
            mod = m.group(2)
            key = ".".join(mod.split(".")[:3 if mod.startswith("memfuse.server") else 2]) \
                if mod.startswith("memfuse") else mod.split(".")[0]
            cost[key] = cost.get(key, 0.0) + int(m.group(1)) / 1000
    return sorted(cost.items(), key=lambda kv: -kv[1])[:top]


def start_server(work: Path, env: dict[str, str]) -> tuple[subprocess.Popen, str, str]:
    """``memfuse serve`` on a copy of the dev database, on a free loopback port: (process,
    URL, admin token)."""
    db = next(Path(env["MEMFUSE_HOME"]).rglob("*.db"))
    copy = work / "server.db"
    with sqlite3.connect(db) as src, sqlite3.connect(copy) as dst:
        src.backup(dst)  # the pages still in the WAL too (a file copy may miss them)
    token = secrets.token_urlsafe(24)
    (work / "admin-token").write_text(token)
    log = (work / "serve.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-c", "from memfuse.cli import main; main()", "serve",
                             "--db", f"sqlite:///{copy}", "--listen", "127.0.0.1:0",
                             "--admin-token-file", str(work / "admin-token"), "--migrate"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=work)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        m = re.search(r"memfuse serve: listening on (http://\S+)", (work / "serve.log").read_text(errors="replace"))
        if m:
            return proc, m.group(1), token
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("memfuse serve did not start:\n" + (work / "serve.log").read_text(errors="replace")[-2000:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--src", type=Path, help="directory holding the memfuse package to run")
    ap.add_argument("--no-server", action="store_true", help="local mode only")
    ap.add_argument("--out", type=Path, default=HERE / "results-cli-local.json")
    opts = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="memfuse-bench-cli-"))
    server = None
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MEMFUSE_")}
        env["MEMFUSE_HOME"] = str(work / "home")
        if opts.src:
            env["PYTHONPATH"] = str(opts.src.resolve())
        os.makedirs(env["MEMFUSE_HOME"])
        mount = work / "mnt"  # what `memfuse status` reads: a mount's .memfuse/status.json
        (mount / ".memfuse").mkdir(parents=True)
        (mount / ".memfuse" / "status.json").write_text(json.dumps(STATUS_JSON))
        os.environ["MEMFUSE_BENCH_MOUNT"] = str(mount)
        subprocess.run([sys.executable, "-c", FILL], env=env, check=True, timeout=300, cwd=env["MEMFUSE_HOME"])
        where = subprocess.run([sys.executable, "-c", "import memfuse; print(memfuse.__file__)"],
                               env=env, check=True, capture_output=True, text=True,
                               cwd=env["MEMFUSE_HOME"]).stdout.strip()
        envs = {name: env for name in COMMANDS}
        if opts.no_server:
            envs = {k: v for k, v in envs.items() if not k.startswith("server: ")}
        else:
            server, url, token = start_server(work, env)
            senv = dict(env, MEMFUSE_CONTROL_PLANE=url, MEMFUSE_TOKEN=token)
            envs.update({k: senv for k in envs if k.startswith("server: ")})
        live = {}
        for name, e in envs.items():
            try:
                run_once(COMMANDS[name], e)  # warm the page cache and the bytecode
                live[name] = e
            except RuntimeError as err:  # a command the memfuse of --src does not have
                print(f"{name:32s} n/a ({str(err).splitlines()[-1][:100]})", flush=True)
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in live}
        for _ in range(opts.runs):  # paired: every command once per round, the floor included
            for name, e in live.items():
                samples[name].append(run_once(COMMANDS[name], e))
        rows = []
        for name in envs:
            if name not in live:
                rows.append({"command": name, "wall_s": None, "cpu_s": None})
                continue
            wall = statistics.median(s[0] for s in samples[name])
            cpu = statistics.median(s[1] for s in samples[name])
            ratio = statistics.median(s[1] / f[1] for s, f in zip(samples[name], samples[FLOOR]))
            rows.append({"command": name, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
                         "cpu_ratio_to_floor": round(ratio, 2)})
            print(f"{name:32s} wall {wall:6.3f} s   cpu {cpu:6.3f} s   {ratio:5.2f}x floor", flush=True)
        print("\nwhat each command imports (top-level package: own import ms, costliest first):")
        for row in rows:
            name = row["command"]
            if name in live and (name.startswith(("local: ", "server: ", "status")) or name == FLOOR):
                row["imports_ms"] = dict(imports(COMMANDS[name], live[name]))
                print(f"  {name}: " + ", ".join(f"{k} {v:.0f}" for k, v in row["imports_ms"].items()))
        result = {"memfuse": where, "runs": opts.runs, "loadavg": os.getloadavg(), "rows": rows}
        opts.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"load average {os.getloadavg()}; memfuse from {where}; wrote {opts.out}")
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
