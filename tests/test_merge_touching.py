"""Three-way merges of changes that *touch* (attack 27 F3): one side's change and lines the
other side added right next to it, with no unchanged line between them. ``diff3`` counts
that a conflict; ``merge_lines`` merges it when no base line changed on both sides and the
place of every added line is fixed by the base lines around it (docs/SEMANTICS.md,
"Sharing and sync", rule 3). Argument order: ``merge_lines(base, theirs, ours)``; theirs is
the version the control plane holds (it landed first), ours the write being merged."""
from __future__ import annotations

import logging
import os

import pytest
import trio

from memfuse.client import ApiClient
from memfuse.fake import FakeControlPlane
from memfuse.sidecar.conflict import merge_lines

from test_faults import conflict_lines, make_sidecar, remote, start, write

B30 = b"".join(b"B %d\n" % i for i in range(1, 31))
A40 = b"".join(b"A %d\n" % i for i in range(1, 41))

# (case, base, theirs, ours, the merge a person expects; None: a conflict)
CASES = [
    # -- a change of one side, the other side's lines added right after it: merged
    ("ours edits the last line, theirs appended after it",
     b"a\nb\n", b"a\nb\nT1\nT2\n", b"a\nB\n", b"a\nB\nT1\nT2\n"),
    ("theirs edited the last line, ours appends after it",
     b"a\nb\n", b"a\nB\n", b"a\nb\nO1\nO2\n", b"a\nB\nO1\nO2\n"),
    ("theirs added lines in the middle, ours edits the line just before them (F3)",
     b"base\nA 1\n", b"base\n" + B30 + b"A 1\n", b"base edited by A\n" + A40,
     b"base edited by A\n" + B30 + A40),
    ("ours adds lines in the middle, theirs edited the line just before them",
     b"h\nx\ny\n", b"H\nx\ny\n", b"h\nO\nx\ny\n", b"H\nO\nx\ny\n"),
    ("theirs added lines just before a line ours edits",
     b"x\nh\ny\n", b"x\nT\nh\ny\n", b"x\nH\ny\n", b"x\nT\nH\ny\n"),
    ("ours edits the first line, theirs added lines before it",
     b"h\nx\n", b"T\nh\nx\n", b"H\nx\n", b"T\nH\nx\n"),
    # both append after an edit of the last line: theirs' lines first (two appenders,
    # as rule 2); when the edit is ours, its lines and ours' appended lines are one block
    # to a line diff (``b`` became ``B`` + ``O``: which is the append is not known) and
    # theirs' lines follow what the line they were appended after became
    ("theirs edited the last line and appended, ours appends",
     b"a\nb\n", b"a\nB\nT\n", b"a\nb\nO\n", b"a\nB\nT\nO\n"),
    ("ours edits the last line and appends, theirs appended",
     b"a\nb\n", b"a\nb\nT\n", b"a\nB\nO\n", b"a\nB\nO\nT\n"),
    ("both appended, ours also edits the first line (disjoint: diff3 merges it)",
     b"a\nb\n", b"a\nb\nT\n", b"A\nb\nO\n", b"A\nb\nT\nO\n"),
    # deletions next to the other side's added lines
    ("ours deletes the last line, theirs appended",
     b"a\nb\n", b"a\nb\nT\n", b"a\n", b"a\nT\n"),
    ("theirs deleted the last line, ours appends",
     b"a\nb\n", b"a\n", b"a\nb\nO\n", b"a\nO\n"),
    ("ours deletes every line, theirs appended",
     b"a\nb\n", b"a\nb\nT\n", b"", b"T\n"),
    ("ours deletes a middle line, theirs added lines right after it",
     b"a\nb\nc\n", b"a\nb\nT\nc\n", b"a\nc\n", b"a\nT\nc\n"),
    # the same line appended on both sides, ours editing the last line too: to a line
    # diff not the same change (ours replaced b by B + S, theirs added S), so both are
    # kept, as two mounts appending one line keep it twice (rule 2); as before F3
    ("the same line appended on both sides after ours edits the last line",
     b"a\nb\n", b"a\nb\nS\n", b"a\nB\nS\n", b"a\nB\nS\nS\n"),
    ("the same line appended on both sides, nothing else changed: once (merge3's 'same')",
     b"a\nb\n", b"a\nb\nS\n", b"a\nb\nS\n", b"a\nb\nS\n"),
    # -- still conflicts
    ("one line changed differently on both sides",
     b"a\nb\n", b"a\nX\n", b"a\nY\n", None),
    ("both insert at one place inside the file (which first?)",
     b"a\nb\n", b"a\nT\nb\n", b"a\nO\nb\n", None),
    ("theirs inserted between two lines ours changes (where?)",
     b"a\nb\nc\nd\n", b"a\nb\nT\nc\nd\n", b"a\nB\nC\nd\n", None),
    ("ours inserts between two lines theirs changed (where?)",
     b"a\nb\nc\nd\n", b"a\nB\nC\nd\n", b"a\nb\nO\nc\nd\n", None),
    ("adjacent lines changed on the two sides (as diff3)",
     b"a\nb\nc\n", b"a\nB\nc\n", b"a\nb\nC\n", None),
    ("ours' last line has no newline, theirs appended (would join two lines)",
     b"a\nb\n", b"a\nb\nc\n", b"a\nB", None),
    ("theirs appended a partial line, ours appends (would join two lines)",
     b"a\n", b"a\nT", b"a\nO\n", None),
]


@pytest.mark.parametrize("base, theirs, ours, want", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_merge_of_touching_changes(base, theirs, ours, want):
    assert merge_lines(base, theirs, ours) == want


async def test_the_sidecar_merges_an_edit_next_to_lines_another_writer_added(tmp_path, caplog):
    """Through the sidecar's merge path (``ConflictResolver.rebase``): this mount rewrote the
    file (its first line edited, lines appended) while another writer added lines after
    that first line (attack 27 F3, where mount B's 30 appended lines were lost from the
    live file by last writer wins): one merge keeps both, no conflict line."""
    caplog.set_level(logging.INFO, logger="memfuse.outbox")
    fake = FakeControlPlane(seed=27)
    token = await fake.setup("ws")
    sc = await make_sidecar(tmp_path, fake, token)
    async with trio.open_nursery() as nursery:
        await start(sc, nursery)
        await write(sc, "j.md", b"base\nA 1\n")
        sm = sc.fs.stores["default"]
        n = sc.fs.lookup(sm.root.ino, b"j.md")
        h = sc.fs.open(n.ino, os.O_WRONLY)
        sc.fs.write(h, 0, b"base edited by A\n" + A40)  # dirty: the feed leaves it alone
        async with ApiClient(fake.base_url, fake.admin_token, transport=fake._inner) as adm:
            await adm.update_record("default", n.record_id, (b"base\n" + B30 + b"A 1\n").decode())
        await sc.fs.flush(h)
        sc.fs.release(h.fh)
        want = b"base edited by A\n" + B30 + A40
        assert (await remote(fake))["j.md"] == want and sc.fs._content(n) == want
        assert sc.committer.merges == 1 and conflict_lines(sc) == []
        assert [r.kind for r in caplog.records if r.getMessage().startswith("write merged")] == ["three_way"]
        nursery.cancel_scope.cancel()
    sc.journal.close()
    await sc.client.aclose()
