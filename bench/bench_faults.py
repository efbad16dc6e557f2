"""Write throughput with faults (optional): ``tests/fake_sidecar.py`` with fault injection.

    .venv/bin/python bench/bench_faults.py [--quick]

``tests/fake_sidecar.py`` runs the real sidecar over the in-process fake control plane
(``memfuse.fake``) in one process. It is started twice: without faults, then with 10 % of
requests answered 503 and 5 % applied with the response lost (``--error-rate 0.1
--drop-rate 0.05``). Each time one writer creates, writes and closes 300 files (each close
waits for the commit), then SIGTERM drains and the script dumps the fake's state, which is
checked: every file must be a record with the content written. The fake is in-process (no
HTTP, no SQLite), so these rates are not comparable with ``create_write_close``; the figure is
the rate with faults and its ratio to the rate without. Skipped when the script is absent.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time

from common import PY, REPO, Row, Session, main_for, stop, unmount

SCRIPT = REPO / "tests" / "fake_sidecar.py"


def one(s: Session, name: str, n: int, faults: list[str]) -> dict:
    mp = s.dir / "mnt" / name
    mp.mkdir(parents=True, exist_ok=True)
    dump = s.dir / f"{name}.json"
    log = s.dir / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([PY, str(SCRIPT), str(mp), "--cache-dir", str(s.dir / "cache" / name),
                             "--dump", str(dump), "--seed", "7", *faults],
                            stdout=log.open("ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    s.track(proc, mp)
    try:
        deadline = time.monotonic() + 60
        while not os.path.isdir(mp / "default"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("fake sidecar did not come up:\n" + log.read_text()[-2000:])
            time.sleep(0.01)
        root = mp / "default" / "w"
        root.mkdir()
        want = {}
        t0 = time.perf_counter()
        for i in range(n):
            data = f"fault run {name} file {i}\n".encode() * 8
            fd = os.open(root / f"f{i:04d}.md", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            want[f"w/f{i:04d}.md"] = hashlib.sha256(data).hexdigest()
        dt = time.perf_counter() - t0
        code = stop(proc, timeout=90)
    finally:
        stop(proc, timeout=30)
        s.untrack(proc)
        unmount(mp)
    state = json.loads(dump.read_text())
    live = {r["path"]: r["sha256"] for r in state["records"] if not r["deleted"]}
    missing = sum(1 for p, h in want.items() if live.get(p) != h)
    return {"seconds": dt, "files_s": n / dt, "exit": code, "mismatched_or_missing": missing,
            "counters": state.get("counters"), "outbox": state.get("outbox")}


def run(s: Session) -> list[Row]:
    if not SCRIPT.exists():
        s.say("tests/fake_sidecar.py not present: fault benchmark skipped")
        return [Row("faults", "write throughput with faults (skipped: no tests/fake_sidecar.py)",
                    None, "files/s")]
    n = 100 if s.quick else 300
    s.say(f"faults: {n} files without faults, then with 10 % 503 + 5 % lost responses")
    try:
        clean = one(s, "fake-clean", n, [])
        faulty = one(s, "fake-faults", n, ["--error-rate", "0.1", "--drop-rate", "0.05"])
    except Exception as e:  # optional figure: report, never fail the run
        s.say(f"faults benchmark failed: {e}")
        return [Row("faults", "write throughput with faults (failed, see detail)", None,
                    "files/s", detail={"error": str(e)[-2000:]})]
    return [Row("faults", f"create-write-close with 10 % 503 + 5 % lost responses (fake, {n} files)",
                faulty["files_s"], "files/s",
                note="in-process fake control plane; ratio is vs the same run without faults",
                detail={"no_faults": clean, "faults": faulty,
                        "vs_no_faults": faulty["files_s"] / clean["files_s"]})]


if __name__ == "__main__":
    raise SystemExit(main_for(run, "faults"))
