"""Agent-style scenarios against a store mounted by ``memfuse dev``: every case must behave as
on a local disk, and the tree must survive a restart.

Two sets run: the project's own (``tests/scenarios``: runner and cases written for memfuse,
always there) and, where it exists, an external set (``../shared/scenarios`` beside the
checkout, as in CI, or ``MEMFUSE_SCENARIOS=/path/to/run.py``); a plain clone runs the first."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mountutil import MEMFUSE, is_mounted, stop, unmount, wait_for

pytestmark = pytest.mark.mount

OWN_RUNNER = Path(__file__).resolve().parent / "scenarios" / "run.py"
SHARED_RUNNER = Path(os.environ.get(
    "MEMFUSE_SCENARIOS", Path(__file__).resolve().parents[2] / "shared" / "scenarios" / "run.py"))
RUNNERS = [pytest.param(OWN_RUNNER, id="own")]
if SHARED_RUNNER.exists() or "MEMFUSE_SCENARIOS" in os.environ:
    RUNNERS.append(pytest.param(SHARED_RUNNER, id="shared"))


def _start_dev(tmp: Path, mnt: Path, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen([MEMFUSE, "dev", str(mnt)], stdout=log.open("ab"),
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=dict(os.environ, MEMFUSE_HOME=str(tmp / "home"),
                                     XDG_CACHE_HOME=str(tmp / "xdg-cache")))
    wait_for(lambda: is_mounted(mnt) and (mnt / "default").is_dir(), 60, "memfuse dev", proc, log)
    return proc


@pytest.mark.timeout(600)
@pytest.mark.parametrize("runner", RUNNERS)
def test_scenarios_pass_on_memfuse_dev(tmp_path, runner):
    assert runner.exists(), f"scenario runner not found at {runner}"
    mnt, log = tmp_path / "memory", tmp_path / "dev.log"
    proc = _start_dev(tmp_path, mnt, log)
    try:
        out = subprocess.run([sys.executable, str(runner), "--target", str(mnt / "default"),
                              "--save-tree", str(tmp_path / "tree.json")],
                             capture_output=True, text=True, timeout=500)
        print(out.stdout[-6000:], out.stderr[-2000:])
        assert out.returncode == 0, out.stdout[-6000:] + log.read_text()[-3000:]
        assert stop(proc) == 0
        assert not is_mounted(mnt)
        proc = _start_dev(tmp_path, mnt, log)
        check = subprocess.run([sys.executable, str(runner), "--target", str(mnt / "default"),
                                "--check-tree", str(tmp_path / "tree.json")],
                               capture_output=True, text=True, timeout=120)
        assert check.returncode == 0, check.stdout
    finally:
        stop(proc)
        unmount(mnt)
