"""Warm ``grep -r`` on memfuse beside the bare pyfuse3 floor: wall time and the daemons' CPU
per file, user and system apart, over interleaved rounds (issue 25 item 4).

    .venv/bin/python bench/bench_grep.py [--files 10000] [--rounds 7]
        [--variant NAME[=SRC_DIR]] ... [--env NAME:KEY=VALUE] ... [--json FILE]

One control plane and one populated store (``common.Session``); the bare floor
(``barefs.py``) serves a copy of the same files. Each ``--variant`` is a ``memfuse mount``
of that store with its own cache directory: ``NAME`` alone runs this tree's code,
``NAME=SRC_DIR`` runs the ``memfuse`` package found in ``SRC_DIR`` (for instance a
``git archive main`` copy), so two commits are compared in the same rounds on the same
store; ``--env NAME:KEY=VALUE`` sets an environment variable for one variant (an
experiment's switch). Default: one variant, ``memfuse``.

Each place is grepped once to warm the kernel's caches, then ``--rounds`` rounds, the order
rotated every round so that load from elsewhere on the machine hits every place alike. For
each run the CPU time the daemon spent (``/proc/PID/stat``: user and system, all threads)
is divided by the number of files; the figures are medians over the rounds, and the ratio
to the floor is taken per round and its median reported (paired: a busy moment hits both
runs of a round). The CPU per file is the primary figure on a loaded machine: it counts
what the daemon did, not how long it waited for a CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import PY, Mount, Session, grep, is_mounted, loadavg, machine_meta
from mountutil import ControlPlane

import trio
from memfuse.client.api import ApiClient
from memfuse.defs import BATCH_MAX_OPERATIONS


#: set by --callgrind: the command every daemon runs under, and where its dumps go
PREFIX: list[str] = []
CG_DIR: Path | None = None


def callgrind_ir(pid: int, name: str) -> int:
    """Dump ``pid``'s callgrind counters (``callgrind_control -d``), zero them, and return
    the instructions (Ir) counted since the last zeroing (the dump's ``totals:`` line)."""
    assert CG_DIR is not None
    before = set(CG_DIR.glob(f"cg.{name}.*"))
    subprocess.run(["callgrind_control", "-d", str(pid)], capture_output=True, timeout=300, check=True)
    deadline = time.monotonic() + 120
    while True:
        new = [p for p in CG_DIR.glob(f"cg.{name}.*") if p not in before]
        if new:
            for line in new[0].read_text(errors="replace").splitlines():
                if line.startswith(("totals:", "summary:")):
                    subprocess.run(["callgrind_control", "-z", str(pid)], capture_output=True,
                                   timeout=300, check=True)
                    return int(line.split()[1])
        if time.monotonic() > deadline:
            raise RuntimeError(f"no callgrind dump from {name}")
        time.sleep(0.2)


def proc_cpu(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds used so far by ``pid`` (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tck = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tck, int(fields[12]) / tck


def run_ns(pid: int) -> int:
    """Nanoseconds ``pid``'s threads have spent on a CPU so far (``/proc/PID/task/*/schedstat``,
    first field): ``/proc/PID/stat`` counts clock ticks (10 ms), too coarse for a short grep."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended meanwhile
    return total


def ctx_switches(pid: int) -> int:
    """Voluntary + involuntary context switches of ``pid``'s main thread so far."""
    n = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                n += int(line.split()[1])
    return n


def cg_prefix(name: str) -> list[str]:
    """The valgrind command line a daemon named ``name`` runs under (none without
    --callgrind): instrumentation off until the measured rounds start."""
    if CG_DIR is None:
        return []
    return ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--trace-children=no",
            f"--callgrind-out-file={CG_DIR}/cg.{name}.%p"]


class VariantMount(Mount):
    """A ``memfuse mount`` of the session's big store running another source tree's code
    and/or with extra environment variables."""

    def __init__(self, session: Session, name: str, src: Path | None, env: dict[str, str]) -> None:
        super().__init__(session, session.cp, session.WS_READ, session.big_token(), name)
        self.src, self.env = src, env

    def start(self, expect: str, nonempty: bool = True, timeout: float = 900) -> float:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, **self.env)
        argv = cg_prefix(self.mountpoint.name) + [
            PY, "-c", "import sys; from memfuse.cli import main; sys.exit(main())"]
        if self.src is not None:
            env["PYTHONPATH"] = str(self.src)
        elif "PYTHONPATH" in self.env:  # an experiment's sitecustomize beside this tree
            env["PYTHONPATH"] = f"{self.env['PYTHONPATH']}:{Path(__file__).resolve().parent.parent}"
        self.proc = subprocess.Popen(
            argv + ["mount", str(self.mountpoint), "--control-plane", self.cp.url,
                    "--workspace", self.ws, "--token-file", str(self.token_file),
                    "--cache-dir", str(self.cache_dir), "--commit-wait", str(self.commit_wait),
                    "--admin-listen", "127.0.0.1:0"],
            stdout=self.log.open("ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, cwd=str(self.src) if self.src is not None else None)
        self.session.track(self.proc, self.mountpoint)
        t0 = time.perf_counter()
        while True:
            try:
                if os.listdir(self.mountpoint / expect) and is_mounted(self.mountpoint):
                    return time.perf_counter() - t0
            except OSError:
                pass
            if self.proc.poll() is not None or time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"sidecar {self.name_} did not come up:\n"
                                   + self.log.read_text()[-3000:])
            time.sleep(0.005)

    @property
    def name_(self) -> str:
        return self.mountpoint.name


async def populate_batches(url: str, token: str, store: str, files: list[tuple[str, str]]) -> None:
    """Create every file as a record, ``BATCH_MAX_OPERATIONS`` to a request, 4 requests at a
    time (the same records as ``common.populate``, in a fraction of its time)."""
    async with ApiClient(url, token, timeout=300) as api:
        chunks = iter([files[i:i + BATCH_MAX_OPERATIONS]
                       for i in range(0, len(files), BATCH_MAX_OPERATIONS)])

        async def worker() -> None:
            for chunk in chunks:
                res = await api.batch(store, [api.batch_create(rel, text) for rel, text in chunk])
                bad = [r for r in res if isinstance(r, Exception)]
                if bad:
                    raise RuntimeError(f"batch create refused: {bad[0]!r}")

        async with trio.open_nursery() as n:
            for _ in range(4):
                n.start_soon(worker)


def use_state(s: Session, state: Path) -> None:
    """Start the session's control plane from the database saved in ``state`` (the data set
    and the reader's token with it); when ``state`` holds none, populate as usual and save
    a copy there (SQLite's backup API: consistent while the server runs)."""
    if (state / "cp.db").exists():
        d = s.dir / "cp"
        d.mkdir()
        shutil.copy(state / "cp.db", d / "cp.db")
        cp = ControlPlane(d)
        cp.admin_token = (state / "admin.token").read_text()
        cp.token_file.write_text(cp.admin_token)
        s._cp = cp.start()
        shutil.copytree(state / "local", s.dir / "local")
        files = sorted(str(p.relative_to(s.dir / "local")) for p in (s.dir / "local").rglob("*.md"))
        s._files = [(rel, (s.dir / "local" / rel).read_text()) for rel in files]
        shutil.copy(state / "reader.token", d / "reader.token")
        s._big_token = d / "reader.token"
        s.say(f"control plane from {state}: {len(files)} files")
        return
    files = s.files
    s._big_token = s.workspace(s.WS_READ, (s.BIG,))
    s.say(f"populating store {s.BIG!r} with {len(files)} records in batches")
    t0 = time.perf_counter()
    trio.run(populate_batches, s.cp.url, s.cp.admin_token, s.BIG, files)
    s.say(f"populated in {time.perf_counter() - t0:.1f} s")
    state.mkdir(parents=True, exist_ok=True)
    src = sqlite3.connect(str(s.cp.db))
    dst = sqlite3.connect(str(state / "cp.db"))
    try:
        src.backup(dst)
    finally:
        dst.close()
        src.close()
    (state / "admin.token").write_text(s.cp.admin_token)
    shutil.copy(s.big_token(), state / "reader.token")
    shutil.copytree(s.local, state / "local")
    s.say(f"populated control plane saved in {state}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--subdir", default="", help="grep only this subdirectory of the tree "
                    "(e.g. t00: 1,000 of the 10,000 files): shorter runs, more rounds")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME or NAME=SRC_DIR (repeatable; default: memfuse)")
    ap.add_argument("--env", action="append", default=[], help="NAME:KEY=VALUE (repeatable)")
    ap.add_argument("--bare", action="append", default=[], metavar="NAME=SCRIPT",
                    help="another floor: SCRIPT MOUNTPOINT --from DIR (repeatable)")
    ap.add_argument("--json", type=Path, help="write the raw figures here")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--state", type=Path, metavar="DIR",
                    help="reuse the populated control plane saved in DIR (populating 10,000 "
                         "records takes 1-13 min here), or save it there after populating")
    ap.add_argument("--profile", type=Path, metavar="DIR",
                    help="after the rounds, per place one more grep under `perf record -g` "
                         "(software clock; DIR/<place>.perf) and one under py-spy "
                         "(--native, raw; DIR/<place>.pyspy) of its daemon")
    ap.add_argument("--callgrind", type=Path, metavar="DIR",
                    help="run every daemon under valgrind's callgrind and report the "
                         "instructions it executes per file (user space only; the same on a "
                         "loaded machine as on a quiet one); dumps in DIR")
    args = ap.parse_args()
    global CG_DIR
    if args.callgrind is not None:
        args.callgrind.mkdir(parents=True, exist_ok=True)
        CG_DIR = args.callgrind.resolve()
    variants: dict[str, Path | None] = {}
    for v in args.variant or ["memfuse"]:
        name, _, src = v.partition("=")
        variants[name] = Path(src).resolve() if src else None
    envs: dict[str, dict[str, str]] = {n: {} for n in variants}
    for e in args.env:
        name, _, kv = e.partition(":")
        k, _, val = kv.partition("=")
        envs[name][k] = val

    load0 = loadavg()
    with Session(keep=args.keep) as s:
        s.n_files = args.files
        if args.state is not None:
            use_state(s, args.state)
        nf = len(s.files)
        roots: dict[str, Path] = {}
        pids: dict[str, int] = {}
        for name, src in variants.items():
            m = VariantMount(s, name, src, envs[name])
            s.say(f"mounting variant {name} ({src or 'this tree'}, env {envs[name]})")
            m.start(s.BIG)
            s.on_close(m.stop)
            roots[name], pids[name] = m.mountpoint / s.BIG, m.pid
        bares = list(args.bare)
        if CG_DIR is None:
            bare = s.bare()
            roots["bare"], pids["bare"] = bare.mountpoint, bare.proc.pid
        else:  # the floor under valgrind too
            bares.insert(0, f"bare={Path(__file__).resolve().parent / 'barefs.py'}")
        for spec in bares:  # floor variants: another script serving the same tree
            name, _, script = spec.partition("=")
            mp = s.dir / "mnt" / name
            mp.mkdir(parents=True)
            proc = subprocess.Popen(cg_prefix(name) + [PY, script, str(mp), "--from", str(s.local)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    env=dict(os.environ, BENCH_DIR=str(Path(__file__).resolve().parent)))
            s.track(proc, mp)
            t0 = time.perf_counter()
            while not is_mounted(mp):
                if proc.poll() is not None or time.perf_counter() - t0 > 600:
                    raise RuntimeError(f"floor variant {name} did not mount")
                time.sleep(0.01)
            roots[name], pids[name] = mp, proc.pid
        keys = list(roots)
        lines = {k: grep(roots[k], timeout=3600)[1] for k in keys}  # warm-up
        if len(set(lines.values())) != 1:
            raise RuntimeError(f"places disagree on the matches: {lines}")
        if args.subdir:
            nf = sum(1 for rel, _ in s.files if rel.startswith(args.subdir.rstrip("/") + "/"))
            lines = {k: grep(roots[k] / args.subdir)[1] for k in keys}
        s.say(f"{nf} files, {lines['bare']} matching lines; {args.rounds} rounds, load {loadavg()}")
        runs: dict[str, list[dict]] = {k: [] for k in keys}
        if CG_DIR is not None:  # instructions per file, one grep per place and round
            for k in keys:
                subprocess.run(["callgrind_control", "-i", "on", str(pids[k])],
                               capture_output=True, timeout=300, check=True)
                grep(roots[k] / args.subdir, timeout=3600)  # warm under instrumentation
                callgrind_ir(pids[k], k)
            for i in range(args.rounds):
                for k in keys:
                    # zeroed just before: the daemon's own background work while the other
                    # places were grepped (minutes under valgrind) is not counted
                    subprocess.run(["callgrind_control", "-z", str(pids[k])],
                                   capture_output=True, timeout=300, check=True)
                    grep(roots[k] / args.subdir, timeout=3600)
                    runs[k].append({"ir_per_file": callgrind_ir(pids[k], k) / nf})
                s.say(f"round {i + 1}: " + ", ".join(
                    f"{k} {runs[k][-1]['ir_per_file']:,.0f} Ir/file" for k in keys))
            for k in keys:
                v = [r["ir_per_file"] for r in runs[k]]
                print(f"{k:<12} {statistics.median(v):>12,.0f} Ir/file (min {min(v):,.0f}, "
                      f"max {max(v):,.0f}) {statistics.median(v) / statistics.median(r['ir_per_file'] for r in runs['bare']):.3f}x bare")
            if args.json:
                args.json.write_text(json.dumps({"files": nf, "runs": runs}, indent=1))
            return 0
        for i in range(args.rounds):
            order = keys[i % len(keys):] + keys[:i % len(keys)]
            for k in order:
                u0, s0 = proc_cpu(pids[k])
                c0 = ctx_switches(pids[k])
                r0 = run_ns(pids[k])
                wall, _ = grep(roots[k] / args.subdir)
                r1 = run_ns(pids[k])
                u1, s1 = proc_cpu(pids[k])
                runs[k].append({"wall_s": wall, "cpu_us_per_file": (r1 - r0) / nf / 1e3,
                                "user_us_per_file": (u1 - u0) / nf * 1e6,
                                "sys_us_per_file": (s1 - s0) / nf * 1e6,
                                "ctxsw_per_file": (ctx_switches(pids[k]) - c0) / nf})
            s.say(f"round {i + 1}: " + ", ".join(
                f"{k} {runs[k][-1]['wall_s']:.2f}s "
                f"{runs[k][-1]['cpu_us_per_file']:.0f}us/f"
                for k in keys) + f" (load {loadavg()})")
        load1 = loadavg()
        if args.profile:
            args.profile.mkdir(parents=True, exist_ok=True)
            for k in keys:
                for tool in ("perf", "pyspy"):
                    out = args.profile / f"{k}.{tool}"
                    cmd = (["perf", "record", "-e", "cpu-clock", "-F", "4000", "-g",
                            "-p", str(pids[k]), "-o", str(out)] if tool == "perf" else
                           [str(Path(PY).parent / "py-spy"), "record", "--format", "raw",
                            "--native", "-r", "400", "-p", str(pids[k]), "-o", str(out)])
                    rec = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    time.sleep(1)
                    grep(roots[k])
                    rec.send_signal(signal.SIGINT)
                    rec.wait(timeout=120)
                    s.say(f"{tool} profile of {k}: {out}")

    def med(k: str, f: str) -> float:
        return statistics.median(r[f] for r in runs[k])

    def cpu(r: dict) -> float:
        return r["cpu_us_per_file"]

    print(f"\n{nf} files, {args.rounds} rounds, load {load0} -> {load1}")
    print(f"{'place':<14}{'wall s':>8}{'x bare':>8}{'cpu us/f':>10}{'min':>7}{'user':>7}{'sys':>6}"
          f"{'x bare':>8}{'min x':>7}{'ctxsw/f':>9}")
    summary = {}
    for k in keys:
        wr = statistics.median(r["wall_s"] / b["wall_s"] for r, b in zip(runs[k], runs["bare"]))
        cr = statistics.median(cpu(r) / cpu(b) for r, b in zip(runs[k], runs["bare"]))
        cmin = min(cpu(r) for r in runs[k])
        summary[k] = {"wall_s": med(k, "wall_s"), "wall_vs_bare": wr,
                      "cpu_us_per_file": statistics.median(cpu(r) for r in runs[k]),
                      "cpu_us_per_file_min": cmin,
                      "cpu_min_vs_bare_min": cmin / min(cpu(r) for r in runs["bare"]),
                      "user_us_per_file": med(k, "user_us_per_file"),
                      "sys_us_per_file": med(k, "sys_us_per_file"), "cpu_vs_bare": cr,
                      "ctxsw_per_file": med(k, "ctxsw_per_file")}
        d = summary[k]
        print(f"{k:<14}{d['wall_s']:>8.3f}{wr:>8.2f}{d['cpu_us_per_file']:>10.1f}{cmin:>7.1f}"
              f"{d['user_us_per_file']:>7.0f}{d['sys_us_per_file']:>6.0f}{cr:>8.2f}"
              f"{d['cpu_min_vs_bare_min']:>7.2f}{d['ctxsw_per_file']:>9.2f}")
    if args.json:
        meta = machine_meta(False)
        meta.update(files=nf, rounds=args.rounds, loadavg=[load0, load1],
                    variants={k: str(v) if v else None for k, v in variants.items()}, env=envs)
        args.json.write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
