"""Two sidecars of one workspace given the same ``--actor`` (attack 16 F8): the change feed
leaves out each one's own versions by the sidecar instance that wrote them
(``Memfuse-Writer``), not by the actor they share, so each sees the other's writes within
the usual bound — a new file, an append, a rename, a delete — and history names both
``ws:ws/pod``. Real mounts on one real ``memfuse serve``, driven by sh."""
from __future__ import annotations

import pytest

from mountutil import Rig, drained, live_records, read, sh, wait_until

SEEN = 15  # s: the bound of "shows in the other mount" (1 s p99 on a quiet machine)


@pytest.mark.mount
def test_two_mounts_given_one_actor_see_each_others_writes(tmp_path):
    with Rig(tmp_path) as rig:
        a = rig.sidecar("ws", "--actor", "pod", mountpoint=tmp_path / "ma", cache_dir=tmp_path / "ca")
        b = rig.sidecar("ws", "--actor", "pod", mountpoint=tmp_path / "mb", cache_dir=tmp_path / "cb")
        ra, rb = a.mountpoint / "default", b.mountpoint / "default"
        sh("echo from-a > a.md", ra)
        wait_until(lambda: read(rb / "a.md") == "from-a\n", timeout=SEEN, what="B shows A's new file")
        sh("echo from-b > b.md && echo b-line >> a.md", rb)
        wait_until(lambda: read(ra / "b.md") == "from-b\n", timeout=SEEN, what="A shows B's new file")
        wait_until(lambda: read(ra / "a.md") == "from-a\nb-line\n", timeout=SEEN, what="A shows B's append")
        sh("mv b.md c.md && rm a.md", ra)
        wait_until(lambda: read(rb / "c.md") == "from-b\n" and read(rb / "b.md") is None,
                   timeout=SEEN, what="B shows A's rename")
        wait_until(lambda: read(rb / "a.md") is None, timeout=SEEN, what="B shows A's delete")
        drained(a, b)
        recs = live_records(rig.cp)
        assert {p: r.content for p, r in recs.items()} == {"c.md": "from-b\n"}
        assert recs["c.md"].updated_by == "ws:ws/pod"  # one actor, as given
