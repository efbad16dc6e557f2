"""The sidecar on streams (``stream=true``, docs/API.md "Streams"): over the in-process fake
with streams cut mid-way (it reopens from its cursor: nothing lost, nothing applied twice), and
real mounts: a write in one sidecar reaches another through the stream, and a control plane
with ``--no-streams`` still syncs through long-polls. The API of the streams is tested in
``tests/test_streams.py``.
"""
from __future__ import annotations

import os
import time

import pytest
import trio


async def until(pred, timeout: float = 20, what: str = "condition") -> None:
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(0.01)


async def test_sidecar_reopens_a_cut_stream_from_its_cursor(tmp_path):
    """Streams cut mid-way (connection reset after a page) are reopened from the cursor of
    the last page applied: every remote change arrives, none is applied twice."""
    from memfuse.fake import FakeControlPlane
    from test_faults import local, make_sidecar, start

    fake = FakeControlPlane(seed=5)
    token = await fake.setup("ws")
    sc = await make_sidecar(tmp_path, fake, token)
    try:
        async with trio.open_nursery() as nursery:
            await start(sc, nursery)
            await until(lambda: fake.counters.streams >= 2, what="the feed and event streams")
            fake.faults.cut_streams = 4
            n = 0
            async with fake.client() as http:
                # write until four lines were cut (writes close together may share a line)
                while fake.faults.cut_streams > 0 and n < 200:
                    r = await http.post("/v1/stores/default/records", json={"path": f"r{n}.md", "content": f"{n}\n"})
                    assert r.status_code == 201, r.text
                    n += 1
                    await trio.sleep(0.05)
            assert fake.counters.streams_cut == 4
            await until(lambda: len(local(sc)) == n, what="every remote change")
            assert local(sc) == {f"r{k}.md": f"{k}\n".encode() for k in range(n)}
            applied = sc.metrics.remote_changes.labels("default")._value.get()
            assert applied == n, f"{applied} changes applied for {n} versions"
            nursery.cancel_scope.cancel()
    finally:
        await sc.client.aclose()
        await fake.aclose()


@pytest.mark.mount
@pytest.mark.parametrize("streams", [True, False], ids=["streams", "no-streams"])
def test_write_in_one_sidecar_reaches_another(tmp_path, streams):
    """Two real mounts: a write in A is read in B through B's change feed, a stream when the
    control plane streams, long-polls when it runs with ``--no-streams``."""
    from mountutil import ControlPlane, Sidecar, wait_for

    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse")
    cp = ControlPlane(tmp_path, () if streams else ("--no-streams",)).start()
    a = b = None
    try:
        ta = cp.setup_workspace("wa", ("shared",))
        tb = cp.setup_workspace("wb", ("shared",))
        a = Sidecar(cp, "wa", ta, tmp_path / "ma", tmp_path / "ca").start(expect="shared")
        b = Sidecar(cp, "wb", tb, tmp_path / "mb", tmp_path / "cb").start(expect="shared")
        for i in range(5):
            data = f"note {i}\n"
            t0 = time.monotonic()
            (tmp_path / "ma" / "shared" / "n.md").write_text(data)

            def seen() -> bool:
                try:
                    return (tmp_path / "mb" / "shared" / "n.md").read_text() == data
                except OSError:
                    return False
            wait_for(seen, 30, f"write {i} in B", b.proc, b.log)
            assert time.monotonic() - t0 < 30
        def open_streams() -> float:
            metrics = cp.call("_request", "GET", "/metrics").text
            return sum(float(ln.split()[1]) for ln in metrics.splitlines()
                       if ln.startswith("memfuse_server_streams "))

        def fallback_said() -> list[str]:
            return [ln for ln in a.log.read_text().splitlines() if "does not stream" in ln]
        # each sidecar holds its store's feed and its events: 4 streams, or none. A's own
        # streams open on their own schedule (B's feed delivered the writes): wait for them
        if streams:
            wait_for(lambda: open_streams() == 4, 30, "both sidecars' feed and event streams")
        else:  # A's feed and events asked for a stream and fell back
            wait_for(lambda: fallback_said(), 30, "A's fallback to long-polls", a.proc, a.log)
            assert open_streams() == 0
        # the fallback is said once per sidecar (not once per feed and again by the client)
        said = fallback_said()
        assert len(said) == (0 if streams else 1), said
        assert all('"level": "info"' in ln for ln in said), said
    finally:
        for s in (a, b):
            if s is not None:
                s.stop()
        cp.stop()
