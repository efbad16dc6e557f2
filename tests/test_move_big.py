"""A directory rename of thousands of files on a real mount (attack 12 A4): the control
plane's prefix move runs a fixed number of statements (test_server_perf), so another
sidecar's small creates meanwhile commit within its commit-wait; the moving sidecar never
counts the control plane that is applying its move as unreachable, never sends the move
again, and the move is applied once. Plus the bound: a directory of more than
``PREFIX_MOVE_MAX`` files is refused ``EXDEV`` at rename(2) (``mv`` copies it instead).

Two real sidecars on a real ``memfuse serve`` (SQLite)."""
from __future__ import annotations

import os
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.mount

from mountutil import ControlPlane, Sidecar, sh, two_sidecars, wait_until

N = 3000  # files moved (directories of 100)
STORE = "shared"


def _seed(cp, n: int, top: str) -> None:
    """``n`` small records under ``top/`` through the batch endpoint (100 a request)."""
    with httpx.Client(base_url=cp.url, headers={"Authorization": f"Bearer {cp.admin_token}"},
                      timeout=60) as c:
        r = c.patch(f"/v1/stores/{STORE}", json={"max_records": 3 * n})
        assert r.status_code == 200, r.text
        for i in range(0, n, 100):
            ops = [{"op": "create", "body": {"path": f"{top}/d{j // 100:02d}/n{j:05d}.md",
                                             "content": f"# note {j}\nabout {j}\n"}}
                   for j in range(i, min(n, i + 100))]
            r = c.post(f"/v1/stores/{STORE}/batch", json={"operations": ops})
            assert r.status_code == 200, r.text[:300]


def _count(root) -> int:
    return sum(len(files) for _, _, files in os.walk(root))


def test_big_directory_move_leaves_other_writers_committing(tmp_path):
    """A's ``--commit-wait 2`` makes its liveness probe count the control plane as down
    after 1 s without an answer (``Sidecar._liveness``): before, the move's own request
    was a probe, so a move of a few seconds was called an outage (and past 30 s sent
    again); now a request that may legitimately take long is no probe."""
    with two_sidecars(tmp_path, STORE, a_args=("--commit-wait", "2")) as (cp, a, b):
        _moving(cp, a, b)


def _moving(cp: ControlPlane, a: Sidecar, b: Sidecar) -> None:
    """A moves ``big`` (``N`` files) while B creates a small file every 0.2 s."""
    _seed(cp, N, "big")
    ma, mb = a.mountpoint / STORE, b.mountpoint / STORE
    wait_until(lambda: _count(ma / "big") == N, timeout=60, what="A sees every record", poll=0.2)
    a_log = a.log.stat().st_size
    serve_log = cp.log.stat().st_size
    closes: list[tuple[str, float]] = []
    stop = threading.Event()

    def probe() -> None:  # B: a small create every 0.2 s, each close timed
        i = 0
        while not stop.is_set():
            name = f"probe_{i}.md"
            t0 = time.monotonic()
            sh(f"echo p-{i} > {name}", mb, timeout=60)
            closes.append((name, time.monotonic() - t0))
            i += 1
            stop.wait(0.2)

    t = threading.Thread(target=probe)
    t.start()
    try:
        time.sleep(0.5)
        t0 = time.monotonic()
        sh("mv big big2", ma, timeout=60)
        mv_s = time.monotonic() - t0

        wait_until(lambda: f"moved {N} records".encode() in cp.log.read_bytes()[serve_log:],
                   timeout=120, what="the move applied", poll=0.1)
        applied_s = time.monotonic() - t0
        time.sleep(1.0)
    finally:
        stop.set()
        t.join(90)
    assert mv_s < 10, mv_s  # applied locally at once
    # every probe of B committed within the commit-wait (10 s), none waited it out
    assert closes and max(s for _, s in closes) < 10, closes
    a_text = a.log.read_bytes()[a_log:].decode("utf-8", "replace")
    assert "counted as unreachable" not in a_text, a_text[-2000:]
    assert "read_timeout" not in a_text, a_text[-2000:]
    serve_text = cp.log.read_bytes()[serve_log:].decode("utf-8", "replace")
    assert serve_text.count(f"moved {N} records") == 1
    wait_until(lambda: _count(mb / "big2") == N, timeout=60, what="B sees the move", poll=0.2)
    assert _count(mb / "big") == 0  # (empty directories stay, as on a local disk)
    records, _ = cp.call("snapshot", STORE, content=False, limit=1000)
    paths = {r.path for r in records}
    assert all(name in paths for name, _ in closes)
    print(f"mv {mv_s:.2f} s, applied after {applied_s:.2f} s; B: {len(closes)} closes, slowest {max(s for _, s in closes):.2f} s")


async def test_directory_over_the_move_bound_is_refused_exdev(tmp_path, monkeypatch):
    """rename(2) of a directory holding more than ``PREFIX_MOVE_MAX`` files with records:
    ``EXDEV`` (``mv`` then copies file by file), nothing moved or queued; at the bound it
    moves. The bound lowered to 3 here (the sidecar core without FUSE, fake control plane)."""
    import errno

    import trio

    from memfuse.fake import FakeControlPlane
    from memfuse.sidecar import namespace
    from memfuse.sidecar.inodes import FsError
    from test_faults import make_sidecar, start

    monkeypatch.setattr(namespace, "PREFIX_MOVE_MAX", 3)
    fake = FakeControlPlane(seed=7)
    token = await fake.setup("ws")
    sc = await make_sidecar(tmp_path, fake, token)
    async with trio.open_nursery() as nursery:
        await start(sc, nursery)
        sm = sc.fs.stores["default"]
        for d, n in (("three", 3), ("four", 4)):
            dn = sc.fs.mkdir(sm.root.ino, d.encode(), 0o755, 0, 0)
            for i in range(n):
                h = sc.fs.create(dn.ino, f"f{i}.md".encode(), 0o644, os.O_WRONLY, 0, 0)
                try:
                    sc.fs.write(h, 0, b"x\n")
                    await sc.fs.flush(h)
                finally:
                    sc.fs.release(h.fh)
        with pytest.raises(FsError) as ei:
            sc.fs.rename(sm.root.ino, b"four", sm.root.ino, b"four2", 0)
        assert ei.value.errno == errno.EXDEV
        assert sc.fs.lookup(sm.root.ino, b"four") is not None and sc.fs.lookup(sm.root.ino, b"four2") is None
        sc.fs.rename(sm.root.ino, b"three", sm.root.ino, b"three2", 0)
        assert sc.fs.lookup(sm.root.ino, b"three2") is not None
        nursery.cancel_scope.cancel()
