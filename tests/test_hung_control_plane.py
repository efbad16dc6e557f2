"""A control plane that stops answering without refusing anything (a paused ``memfuse serve``:
SIGSTOP; the same as a black-holed network) is noticed within seconds, not after the
client's 30 s read timeout: closes return once their write is accepted, as in a known outage;
``status.json`` and ``/metrics`` say so; ``/readyz`` stays 200 (reads are served from the
cache, writes are accepted); everything commits once it answers again."""
from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from mountutil import live_records, read, serve_and_mount, sh, wait_until

pytestmark = pytest.mark.mount


def _status(mnt) -> dict:
    return json.loads((mnt / ".memfuse" / "status.json").read_text())


def test_a_paused_control_plane_is_noticed_within_seconds(tmp_path):
    with serve_and_mount(tmp_path, stores=("s",)) as (cp, sc):  # --commit-wait 10
        mnt = sc.mountpoint
        sh("echo before > a.md", mnt / "s")
        assert _status(mnt)["control_plane"]["reachable"] is True
        admin = "http://" + _status(mnt)["admin"]
        os.kill(cp.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            sh("echo during > b.md", mnt / "s", timeout=30)
            took = time.monotonic() - t0
            # noticed after 3 s of silence, not after --commit-wait (10 s) or the read timeout
            assert took < 8, f"close took {took:.1f} s"
            st = _status(mnt)
            cpst = st["control_plane"]
            assert cpst["reachable"] is False and cpst["error"] == "no_answer", cpst
            assert cpst["no_answer_s"] >= 2.5, cpst
            # a close now returns as soon as its write is accepted
            t0 = time.monotonic()
            sh("echo more > c.md", mnt / "s", timeout=30)
            assert time.monotonic() - t0 < 2.5
            # reads are served from the cache meanwhile
            assert read(mnt / "s" / "a.md") == "before\n"
            assert read(mnt / "s" / "b.md") == "during\n"
            r = httpx.get(f"{admin}/readyz", timeout=5)
            assert r.status_code == 200, r.text
            metrics = httpx.get(f"{admin}/metrics", timeout=5).text
            assert "memfuse_control_plane_up 0.0" in metrics
            assert "memfuse_control_plane_no_answer_total 1.0" in metrics
            assert _status(mnt)["outbox"]["depth"] >= 2
        finally:
            os.kill(cp.proc.pid, signal.SIGCONT)
        wait_until(lambda: _status(mnt)["control_plane"]["reachable"] is True, timeout=60,
                   what="the control plane reachable again")
        wait_until(lambda: _status(mnt)["outbox"]["depth"] == 0, timeout=60, what="outbox drained")
        recs = live_records(cp, "s")
        assert {p: r.content for p, r in recs.items()} == {
            "a.md": "before\n", "b.md": "during\n", "c.md": "more\n"}
        metrics = httpx.get(f"{admin}/metrics", timeout=5).text
        assert "memfuse_control_plane_up 1.0" in metrics
