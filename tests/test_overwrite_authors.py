"""Every author whose edits a last-writer-wins overwrite drops is told (docs/SEMANTICS.md
"Conflicts"; attack 15 F6), with two real sidecars on one store of a real ``memfuse serve``:

a slow tool on mount A read version 1; mount B's edit (version 2) reaches A; A appends to
the file (version 3, written by A, holds B's line); then the tool's rename, made on version
1 and overlapping B's line (adjacent lines: no clean three-way merge), replaces version 3
by last writer wins. The version replaced is A's own, but the edit it drops is B's: B gets
the ``overwritten`` line in its ``errors.log`` (naming its version 2), not only A its
``conflict`` line. On main the feed named only A (the writer of version 3): B was told
nothing.
"""
from __future__ import annotations

import os
import uuid

import pytest

pytestmark = pytest.mark.mount

from mountcheck import errors_log
from mountutil import drained, live_records, read, sh, two_sidecars, wait_until


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with two_sidecars(tmp_path_factory.mktemp("authors"), "s") as cp_a_b:
        yield cp_a_b


def _replace(p, text: str) -> None:
    """What ``sed -i`` does: a temporary file renamed over ``p``."""
    tmp = p.with_name(f".sed{uuid.uuid4().hex[:6]}")
    tmp.write_text(text)
    os.replace(tmp, p)


def test_an_edit_held_by_a_version_the_overwriting_mount_wrote_is_told_to_its_author(pair):
    cp, a, b = pair
    name = f"held-{uuid.uuid4().hex[:6]}.md"
    pa, pb = a.mountpoint / "s" / name, b.mountpoint / "s" / name
    v1 = "".join(f"l{i} orig\n" for i in range(10))
    pa.write_text(v1)
    wait_until(lambda: read(pb) == v1, timeout=20, what="v1 in B")
    mine = pa.read_text()  # A's slow tool (sed) reads version 1
    sh(f"sed -i s/^l6.orig/l6_EDIT-B/ {name}", b.mountpoint / "s")  # B's version 2
    wait_until(lambda: live_records(cp, "s")[name].version == 2, timeout=20, what="B's edit")
    v2 = live_records(cp, "s")[name].sha256
    # A applies it (asked by xattr: a read would make version 2 what A's tool read)
    wait_until(lambda: os.getxattr(pa, "user.memfuse.sha256").decode() == v2, timeout=20,
               what="A applied B's edit")
    sh(f"echo tail-A >> {name}", a.mountpoint / "s")  # A's version 3: B's line is in it
    wait_until(lambda: live_records(cp, "s")[name].version == 3, timeout=20, what="A's append")
    # the slow tool's rename: line 5, next to B's line 6 (no clean three-way merge)
    _replace(pa, mine.replace("l5 orig", "l5_EDIT-A"))
    wait_until(lambda: live_records(cp, "s")[name].version == 4, timeout=30, what="A's rewrite")
    drained(a, b)
    rec = live_records(cp, "s")[name]
    assert rec.content == mine.replace("l5 orig", "l5_EDIT-A"), rec.content  # last writer won
    vs = {v.version: v for v in cp.call("versions", "s", rec.id)}
    assert vs[2].actor.startswith("ws:wb/") and vs[3].actor.startswith("ws:wa/"), vs

    def told_b() -> list[dict]:
        return [e for e in errors_log(b.mountpoint) if e.get("overwritten") and e["path"] == name]
    # version 3 (A's) was replaced, but the edit lost with it is B's: B is told
    wait_until(told_b, timeout=20, what="B told its edit was overwritten")
    [line] = told_b()
    assert (line["lost_version"], line["version"]) == (2, 4), line
    assert line.get("conflict") is True and "memfuse restore" in line["reason"], line
    # A, the last writer, has its own conflict line; never one as overwritten
    errs_a = [e for e in errors_log(a.mountpoint) if e["path"] == name]
    assert [e.get("overwritten") for e in errs_a] == [None], errs_a
