#!/usr/bin/env python3
"""memfuse's own agent-style scenarios: each ``cases/*.sh`` runs in a fresh directory inside a
mounted store and in a fresh local directory; exit status, output (paths replaced by ``$DIR``)
and the tree left behind (paths, kinds, sizes, sha256) must be equal. A case whose first lines
hold ``# expect-exit: N`` / ``# expect-stdout: TEXT`` is checked against those instead, where
memfuse differs from a local disk on purpose (docs/SEMANTICS.md).

    run.py --target MOUNT/STORE [-k NAME] [--cases DIR] [--save-tree F | --check-tree F]

Exit 0 when every case passes. Standard library only.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

CASES = Path(__file__).resolve().parent / "cases"
CASE_TIMEOUT = 30  # seconds per case


def snapshot_tree(root: Path) -> dict[str, str]:
    """Relative path → ``d`` | ``f SIZE SHA256`` | ``l TARGET`` | ``other MODE``."""
    out: dict[str, str] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            st = os.lstat(p)
            if stat.S_ISDIR(st.st_mode):
                out[rel] = "d"
            elif stat.S_ISLNK(st.st_mode):
                out[rel] = "l " + os.readlink(p)
            elif stat.S_ISREG(st.st_mode):
                data = p.read_bytes()
                out[rel] = f"f {len(data)} {hashlib.sha256(data).hexdigest()}"
            else:
                out[rel] = f"other {stat.filemode(st.st_mode)}"
    return dict(sorted(out.items()))


def expectations(case: Path) -> dict[str, str]:
    found = {}
    for line in case.read_text().splitlines()[:5]:
        if line.startswith("# expect-"):
            key, _, value = line[2:].partition(":")
            found[key.strip()] = value.strip().encode().decode("unicode_escape")
    return found


def run_in(case: Path, where: Path) -> dict:
    where.mkdir(parents=True)
    env = dict(os.environ, LC_ALL="C.UTF-8", TZ="UTC", HOME=str(where))
    try:
        p = subprocess.run(["timeout", "-k", "5", str(CASE_TIMEOUT), "bash", str(case)],
                           cwd=where, env=env, capture_output=True, stdin=subprocess.DEVNULL,
                           timeout=CASE_TIMEOUT + 15)
        code, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired:
        code, out, err = 124, b"", b"timed out\n"

    def text(b: bytes) -> str:
        return b.decode("utf-8", "replace").replace(str(where), "$DIR")
    return {"exit": code, "stdout": text(out), "stderr": text(err), "tree": snapshot_tree(where)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, required=True, help="a directory in a mounted store")
    ap.add_argument("--cases", type=Path, default=CASES)
    ap.add_argument("-k", default="", help="only cases whose file name contains this")
    ap.add_argument("--save-tree", type=Path, help="write the target's tree after the run")
    ap.add_argument("--check-tree", type=Path, help="compare the target's tree with a saved one")
    a = ap.parse_args(argv)
    target = a.target.resolve()
    if a.check_tree:
        saved, now = json.loads(a.check_tree.read_text()), snapshot_tree(target)
        diff = sorted(k for k in saved.keys() | now.keys() if saved.get(k) != now.get(k))
        for k in diff[:40]:
            print(f"differs: {k}: saved {saved.get(k)!r}, now {now.get(k)!r}")
        print(f"tree check: {len(saved)} entries, {len(diff)} differ")
        return 1 if diff else 0
    cases = sorted(c for c in a.cases.resolve().glob("*.sh") if a.k in c.name)
    if not cases:
        ap.error(f"no cases in {a.cases}")
    run_dir = target / f"own-{uuid.uuid4().hex[:8]}"
    local = Path(tempfile.mkdtemp(prefix="memfuse-own-scenarios-"))
    failed = 0
    try:
        for case in cases:
            got = run_in(case, run_dir / case.stem)
            want = expectations(case)
            problems = []
            if want:
                if "expect-exit" in want and got["exit"] != int(want["expect-exit"]):
                    problems.append(f"exit {got['exit']}, expected {want['expect-exit']}")
                if "expect-stdout" in want and got["stdout"] != want["expect-stdout"]:
                    problems.append(f"stdout {got['stdout']!r}, expected {want['expect-stdout']!r}")
            else:
                ref = run_in(case, local / case.stem)
                problems = [f"{k}: memfuse {got[k]!r}\n      local   {ref[k]!r}"
                            for k in ("exit", "stdout", "stderr", "tree") if got[k] != ref[k]]
            failed += bool(problems)
            print(("FAIL " if problems else "ok   ") + case.stem)
            for p in problems:
                print("     " + p)
        if a.save_tree:
            a.save_tree.write_text(json.dumps(snapshot_tree(target), indent=1))
    finally:
        shutil.rmtree(local, ignore_errors=True)
        if not a.save_tree:
            shutil.rmtree(run_dir, ignore_errors=True)
    print(f"{len(cases) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
