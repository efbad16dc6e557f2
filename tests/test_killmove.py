"""A directory move queued when the sidecar is killed (-9) and committed after its restart
(attack 12, A6): the restarted sidecar shows the move as the local operation it was while it
drains, and once committed the mount shows the directory where the control plane has it.

Cause found: the rename saved the directory paths (``dirs.json``) after the move, so the
restarted tree had the target's subdirectories (empty) while the records were still at the
source; the replay took the target for taken and deferred the move "until committed", and the
commit's answer (its ``moved`` records) was never applied to the tree (the feed leaves this
sidecar's own changes out). Real ``memfuse serve`` and ``memfuse mount`` processes; the
control plane is down from the ``mv`` to the restart, so the move commits only after it."""
from __future__ import annotations

import json
import os
import time

import pytest

from mountutil import ControlPlane, Sidecar, live_records, read, sh, wait_until

pytestmark = pytest.mark.mount

N = 12  # files under d/sub


def _status(sc: Sidecar) -> dict:
    return json.loads((sc.mountpoint / ".memfuse" / "status.json").read_text())


def _depth(sc: Sidecar) -> int:
    return _status(sc)["outbox"]["depth"]


def _tree(root) -> set[str]:
    out = set()
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for name in dirnames + filenames:
            out.add(name if rel == "." else f"{rel}/{name}")
    return out


# two `memfuse serve` starts (each bounded at 120 s by serve_listening) and two mounts: 102 s
# alone at a load of 13, so the hang guard is well past that, not a bound on the test's speed
@pytest.mark.timeout(420)
@pytest.mark.parametrize("local_file", [False, True], ids=["records", "with_local_only_file"])
def test_a_directory_move_replayed_after_a_kill_shows_where_it_committed(tmp_path, local_file):
    """``local_file``: the directory also holds a local-only file (an editor backup), which
    is restored at its moved path before the replay: the target then holds a file, so the
    replay cannot show the move at start; it shows once committed (its answer applied)."""
    cp = ControlPlane(tmp_path).start()
    sc = None
    try:
        tok = cp.setup_workspace("ws", ("s",))
        args = ("--offline-after", "2")
        sc = Sidecar(cp, "ws", tok, tmp_path / "mnt", tmp_path / "cache", *args).start(expect="s")
        m = sc.mountpoint / "s"
        sh("mkdir -p d/sub d/empty && echo top > d/top.md && "
           f"for i in $(seq 1 {N}); do echo f$i > d/sub/f$i.md; done", m)
        if local_file:
            sh("echo backup > d/sub/f1.md~", m)
        wait_until(lambda: len(live_records(cp, "s")) == N + 1, timeout=30, what="files committed")
        wait_until(lambda: _depth(sc) == 0, timeout=30, what="idle")

        cp.stop()  # the move is queued, not sent
        sh("mv d e", m, timeout=30)
        wait_until(lambda: _depth(sc) == 1, timeout=10, what="the move queued")
        # the move's row on disk (and the local-only file's new path: its own journal row,
        # queued with no close waiting for it, a lazy write; a fixed 1 s wait was short under
        # load). 0 counts the batch being written too (Journal.depth): it once did not, and
        # under load the kill came while the move's transaction was still in its fsync
        wait_until(lambda: _status(sc)["cache"]["journal_queued"] == 0, timeout=30,
                   what="the journal written")
        sc.kill9()  # the move is in the journal only
        sc.proc = None

        cp.start()
        sc.start(expect="s")
        want = {"e", "e/top.md", "e/sub", "e/empty"} | {f"e/sub/f{i}.md" for i in range(1, N + 1)}
        if local_file:
            want.add("e/sub/f1.md~")
        else:
            assert _tree(m) == want  # the queued move shown from the start
        wait_until(lambda: _depth(sc) == 0, timeout=30, what="the move committed")
        recs = live_records(cp, "s")
        assert set(recs) == {p for p in want if p.endswith(".md")}
        deadline = time.monotonic() + 10
        while _tree(m) != want and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _tree(m) == want, "the mount shows the directory where it was committed"
        if local_file:
            assert read(m / "e" / "sub" / "f1.md~") == "backup\n"
        assert read(m / "e" / "sub" / "f1.md") == "f1\n"

        # writes through the paths shown land there, and replace nothing
        sh("echo more >> e/sub/f1.md && echo fresh > e/sub/new.md", m, timeout=30)
        wait_until(lambda: _depth(sc) == 0, timeout=30, what="writes committed")
        recs = live_records(cp, "s")
        assert recs["e/sub/f1.md"].content == "f1\nmore\n"
        assert recs["e/sub/new.md"].content == "fresh\n"
        assert recs["e/sub/f2.md"].content == "f2\n" and len(recs) == N + 2
        assert _tree(m) == want | {"e/sub/new.md"}
        assert not any("Traceback" in line for line in sc.log.read_text().splitlines())
    finally:
        if sc is not None and sc.proc is not None:
            sc.stop()
        cp.stop()
