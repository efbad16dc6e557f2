"""Read-your-writes across a crash (attack11 F1): every write whose ``close(2)`` returned 0 on a
mount is shown by that mount after a ``kill -9`` of its sidecar and a restart, also while the
control plane is down (an offline start from the saved mirror), with the state ``clean`` when
the control plane had it. The entries of committed writes leave the outbox journal within
``Journal.LAZY_DELAY`` s (or are never written there: a held insert answered first), and the
change feed leaves this sidecar's own versions out: only the saved mirror can show them, so it
is saved as they commit (``StoreSync.save_committed``), not only every 2 s."""
from __future__ import annotations

import json
import os
import time

import pytest

from mountutil import ControlPlane, Sidecar, live_records, read, wait_until

pytestmark = pytest.mark.mount

ARGS = ("--offline-after", "3", "--commit-wait", "5", "--drain-timeout", "1")


def _status(mnt) -> dict:
    return json.loads((mnt / ".memfuse" / "status.json").read_text())


def _append(path, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)  # returns 0: the write is in the control plane (or the journal)


def test_own_committed_writes_survive_kill_9_and_an_offline_restart(tmp_path):
    """Appends, a new file and a delete, each close returning 0; the sidecar is killed -9 right
    after the last close, then the control plane stops answering (SIGSTOP); the restart
    (``--offline-after 3``) mounts from the cache and must show all of them, as clean; once
    the control plane answers again, nothing is written twice. Before the fix the file showed the content of the mirror's last
    periodic save (up to 2 s older), as clean, and the new file was missing."""
    cp = ControlPlane(tmp_path).start()
    sc = None
    try:
        tok = cp.setup_workspace("ws", ("s",))
        sc = Sidecar(cp, "ws", tok, tmp_path / "mnt", tmp_path / "cache", *ARGS).start(expect="s")
        m = sc.mountpoint / "s"
        f = m / "log.txt"
        f.write_text("head\n")
        (m / "old.md").write_text("to be deleted\n")
        wait_until(lambda: {"log.txt", "old.md"} <= set(live_records(cp, "s")), timeout=30,
                   what="the first files committed")
        time.sleep(2.5)  # one periodic save holds them
        acked = ["head\n"]
        stop_at = time.monotonic() + 1.5  # appends across a periodic save, the last after it
        i = 0
        while time.monotonic() < stop_at:
            line = f"line {i}\n"
            _append(f, line)
            acked.append(line)
            i += 1
        (m / "new.md").write_text("created last\n")
        os.unlink(m / "old.md")
        _append(f, "the last line\n")
        acked.append("the last line\n")
        sc.kill9()  # right after the last close returned
        # the control plane goes down too: SIGSTOPped, it answers nothing (a request hangs),
        # so the restart can only mount from the saved mirror; thawed below instead of a
        # second `memfuse serve` start (the slowest step of this test on a loaded machine)
        cp.freeze()
        offset = sc.log.stat().st_size if sc.log.exists() else 0
        sc.start(expect="s")
        assert "mounted from the local cache" in sc.log.read_bytes()[offset:].decode()
        assert read(f) == "".join(acked), f"{len(acked)} lines acknowledged"
        assert read(m / "new.md") == "created last\n"
        assert not (m / "old.md").exists()
        if _status(sc.mountpoint)["outbox"]["depth"] == 0:  # else a leftover entry: pending
            assert os.getxattr(f, "user.memfuse.state") == b"clean"
            assert os.getxattr(m / "new.md", "user.memfuse.state") == b"clean"
        # the control plane is back: the catch-up of our own versions changes nothing, and
        # nothing acknowledged is written twice
        cp.thaw()
        wait_until(lambda: _status(sc.mountpoint)["outbox"]["depth"] == 0, timeout=60,
                   what="outbox drained")
        wait_until(lambda: _status(sc.mountpoint)["control_plane"]["reachable"], timeout=60,
                   what="control plane reachable")
        live = live_records(cp, "s")
        assert live["log.txt"].content == "".join(acked)
        assert live["new.md"].content == "created last\n" and "old.md" not in live
        time.sleep(1)
        assert read(f) == "".join(acked)
    finally:
        try:
            if sc is not None:
                sc.stop()
        finally:
            cp.stop()
