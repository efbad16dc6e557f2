"""Two mounts' ``sed -i`` on one file (attack 15), with two real sidecars on one store of a
real ``memfuse serve`` (docs/SEMANTICS.md "Conflicts"):

- F6: every author whose edits a last-writer-wins overwrite drops is told. A slow tool on
  mount A read version 1; mount B's edit (version 2) reaches A; A appends to the file
  (version 3, written by A, holds B's line); then the tool's rename, made on version 1 and
  overlapping B's line (adjacent lines: no clean three-way merge), replaces version 3 by
  last writer wins. The version replaced is A's own, but the edit it drops is B's: B gets
  the ``overwritten`` line in its ``errors.log`` (naming its version 2), not only A its
  ``conflict`` line. On main the feed named only A (the writer of version 3): B was told
  nothing.
- F5: ``sed -i`` of a journal's only line on B while A appends to it is merged (the
  appended lines kept after the edited line), not last writer wins: ``diff3`` counts a
  change of the base's last line and lines added right after it as a conflict.
"""
from __future__ import annotations

import os
import uuid

import pytest

pytestmark = pytest.mark.mount

from mountcheck import errors_log
from mountutil import (drained, live_records, read, replace_like_sed, sh, two_sidecars, wait_applied, wait_until,
                       written_and_seen)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with two_sidecars(tmp_path_factory.mktemp("sed2"), "s") as cp_a_b:
        yield cp_a_b


def test_an_edit_held_by_a_version_the_overwriting_mount_wrote_is_told_to_its_author(pair):
    cp, a, b = pair
    name = f"held-{uuid.uuid4().hex[:6]}.md"
    v1 = "".join(f"l{i} orig\n" for i in range(10))
    pa, pb = written_and_seen(a, b, "s", name, v1)
    mine = pa.read_text()  # A's slow tool (sed) reads version 1
    sh(f"sed -i s/^l6.orig/l6_EDIT-B/ {name}", b.mountpoint / "s")  # B's version 2
    wait_until(lambda: live_records(cp, "s")[name].version == 2, timeout=20, what="B's edit")
    v2 = live_records(cp, "s")[name].sha256
    # A applies it (asked by xattr: a read would make version 2 what A's tool read)
    wait_applied(pa, v2, what="A applied B's edit")
    sh(f"echo tail-A >> {name}", a.mountpoint / "s")  # A's version 3: B's line is in it
    wait_until(lambda: live_records(cp, "s")[name].version == 3, timeout=20, what="A's append")
    # the slow tool's rename: line 5, next to B's line 6 (no clean three-way merge)
    replace_like_sed(pa, mine.replace("l5 orig", "l5_EDIT-A"))
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


def test_a_sed_of_a_journals_only_line_keeps_the_lines_another_mount_appended(pair):
    cp, a, b = pair
    name = f"journal-{uuid.uuid4().hex[:6]}.md"
    pa, pb = written_and_seen(a, b, "s", name, "head 0\n")
    sh(f"echo 'app 1' >> {name}", a.mountpoint / "s")  # A's version 2
    wait_until(lambda: live_records(cp, "s")[name].version == 2, timeout=20, what="A's append")
    v2 = live_records(cp, "s")[name].sha256
    # B's sed read version 1 before the append reached B; its rename comes after
    mine = "head 0\n"
    wait_applied(pb, v2, what="B applied A's append")
    replace_like_sed(pb, mine.replace("head 0", "head 1"))
    drained(a, b)
    wait_until(lambda: live_records(cp, "s")[name].version >= 3, timeout=20, what="B's edit")
    assert live_records(cp, "s")[name].content == "head 1\napp 1\n"
    wait_until(lambda: read(pb) == "head 1\napp 1\n", timeout=20, what="B shows the merge")
    wait_until(lambda: read(pa) == "head 1\napp 1\n", timeout=20, what="A shows the merge")
    assert [e for e in errors_log(a.mountpoint) + errors_log(b.mountpoint) if e["path"] == name] == []


def test_a_change_of_the_last_lines_keeps_lines_appended_after_them():
    """``merge_lines``: theirs only appended whole lines to the base, ours changed its last
    line (diff3: a conflict) → ours then the appended lines; a partial line on either side
    (no final newline) or theirs changing a line too stays a conflict (None)."""
    from memfuse.sidecar.conflict import merge_lines

    assert merge_lines(b"head 0\n", b"head 0\napp 1\napp 2\n", b"head 1\n") == b"head 1\napp 1\napp 2\n"
    assert merge_lines(b"a\nb\n", b"a\nb\nc\n", b"a\nB\nB2\n") == b"a\nB\nB2\nc\n"
    assert merge_lines(b"a\nb\n", b"a\nb\nc\n", b"") == b"c\n"  # all lines deleted here
    assert merge_lines(b"a\nb", b"a\nbc\n", b"a\nB\n") is None
    assert merge_lines(b"a\nb\n", b"a\nb\nc\n", b"a\nB") is None
    assert merge_lines(b"a\nb\n", b"a\nX\nc\n", b"a\nB\n") is None
