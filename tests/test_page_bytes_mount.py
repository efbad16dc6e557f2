"""A sidecar catches up through change-feed pages bounded in bytes (attack 13 F7; docs/API.md,
"Pages"): the control plane cuts a page carrying content at ``defs.PAGE_CONTENT_BYTES``, so a
sidecar behind a burst of big rewrites reads them in several short pages. Real mounts, a real
``memfuse serve``: B is frozen (SIGSTOP, its stream stalls) while another writer rewrites a
1 MB file ten times, then continued; then B is stopped, the file is rewritten ten times more,
and B is started again on its cache (the offline catch-up). Each time B ends with the last
content, and the feed pages it read were short (the control plane's log counts no page over
the budget; the byte bound itself is tested in tests/test_api.py).
"""
from __future__ import annotations

import os
import signal

import pytest

from memfuse.defs import PAGE_CONTENT_BYTES
from mountutil import read, two_sidecars, wait_until

pytestmark = [pytest.mark.mount, pytest.mark.timeout(300)]

BIG = 1_000_000  # bytes of one version: 8 fit in a page's content budget, 9 do not


def text(i: int) -> str:
    return (f"{i:04d}" * (BIG // 4 + 1))[:BIG]


def vm_hwm_kib(pid: int) -> int:
    """The process's peak resident set (``VmHWM``), KiB."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def test_a_sidecar_catches_up_through_short_pages_of_big_versions(tmp_path):
    assert 8 * BIG <= PAGE_CONTENT_BYTES < 9 * BIG
    with two_sidecars(tmp_path) as (cp, a, b):
        rec = cp.call("create_record", "shared", "big.txt", text(0))
        wait_until(lambda: read(b.mountpoint / "shared" / "big.txt") == text(0), 60, "B sees the first version")
        assert b.proc is not None
        pid = b.proc.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            for i in range(1, 11):
                cp.call("update_record", "shared", rec.id, text(i))
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_until(lambda: read(b.mountpoint / "shared" / "big.txt") == text(10), 90, "B catches up (stream)")
        assert read(a.mountpoint / "shared" / "big.txt") == text(10)
        print(f"B's peak RSS after the stream catch-up: {vm_hwm_kib(pid) / 1024:.0f} MiB")

        # offline: B stopped, ten more versions, B started again on its cache
        b.stop()
        for i in range(11, 21):
            cp.call("update_record", "shared", rec.id, text(i))
        b.start(expect="shared")  # stopped again by two_sidecars
        wait_until(lambda: read(b.mountpoint / "shared" / "big.txt") == text(20), 90, "B catches up (restart)")
        assert b.proc is not None
        print(f"B's peak RSS after the offline catch-up: {vm_hwm_kib(b.proc.pid) / 1024:.0f} MiB")
