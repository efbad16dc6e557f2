"""The lazy reader hand-off (``memfuse/sidecar/fusereader.py``): a handler that awaits hands the
reading of the next FUSE request to another worker first, so a close waiting for its commit
never holds up the mount; a handler that never awaits keeps its worker the reader; the mount
still ends on SIGTERM and on an external unmount."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from mountutil import is_mounted, read, serve_and_mount, sh, wait_for, wait_until

pytestmark = pytest.mark.mount


def _stalled_close(cwd) -> subprocess.Popen:
    """``echo during > b.md`` in ``cwd`` (its close waits for a commit that cannot come)."""
    return subprocess.Popen(["timeout", "60", "sh", "-c", "echo during > b.md"], cwd=cwd,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_a_close_waiting_for_its_commit_holds_up_no_other_request(tmp_path):
    """While one close waits for its commit (the control plane paused: it returns once the
    silence is noticed, ~3 s), reads, listings and stats of other processes are
    answered: they finish while that close is still waiting. Without the hand-off in the
    guard of ``flush`` (``_guard_then``) every one of them waits behind the close (checked:
    even the read of ``b.md`` then waits, and the test fails)."""
    with serve_and_mount(tmp_path, stores=("s",)) as (cp, sc):  # --commit-wait 10
        d = sc.mountpoint / "s"
        sh("echo before > a.md", d)
        os.kill(cp.proc.pid, signal.SIGSTOP)
        w = None
        try:
            w = _stalled_close(d)
            wait_until(lambda: read(d / "b.md") == "during\n", timeout=10,
                       what="the write reached the mount")  # its close is under way
            time.sleep(0.3)  # (bounded) the close's flush is now waiting for the commit
            assert w.poll() is None, "the close returned before the control plane was missed"
            assert sh("cat a.md && ls && stat -c %s a.md", d,
                      timeout=30).stdout.split() == ["before", "a.md", "b.md", "7"]
            assert w.poll() is None, "the other requests waited for the stalled close"
        finally:
            os.kill(cp.proc.pid, signal.SIGCONT)
            if w is not None:
                w.wait(60)
        assert w.returncode == 0
        assert read(d / "b.md") == "during\n"


def test_many_files_then_sigterm_and_external_unmount_end_the_mount(tmp_path):
    """After hundreds of requests (pyfuse3 has started all its workers: 99, parked), SIGTERM
    ends the sidecar with exit code 0; a second sidecar, unmounted from outside, exits too."""
    with serve_and_mount(tmp_path, stores=("s",)) as (cp, sc):
        d = sc.mountpoint / "s"
        sh("for i in $(seq 150); do echo $i > f$i.md; done; cat f150.md", d, timeout=120)
        assert read(d / "f77.md") == "77\n"
        t0 = time.monotonic()
        assert sc.stop() == 0
        assert time.monotonic() - t0 < 25
        assert not is_mounted(sc.mountpoint)
        sc.start(expect="s")
        assert read(d / "f150.md") == "150\n"
        sh("for i in $(seq 120); do cat f$i.md > /dev/null; done", d, timeout=120)
        subprocess.run(["fusermount3", "-u", str(sc.mountpoint)], timeout=30, check=True)
        wait_for(lambda: sc.proc.poll() is not None, 30, "the sidecar's exit after an "
                 "external unmount", None, sc.log)
