"""Every line diff memfuse runs on untrusted content is bounded in work (memfuse.diffwork;
attack 13 F11, F12): the sidecar's three-way merge falls back to last writer wins (conflict
line, the other version in history) past the budget, the console says "too large to diff
here"; normal inputs merge and diff exactly as before. Work is counted, never timed."""
from __future__ import annotations

import hashlib
import os
import uuid

import merge3
import pytest

from memfuse.diffwork import DIFF_WORK_BUDGET, BoundedMatcher, DiffTooCostly, WorkBudget
from memfuse.server.console import render
from memfuse.sidecar.conflict import merge_lines

from mountcheck import errors_log
from mountutil import live_records, read, two_sidecars, wait_applied, wait_until, written_and_seen


def _lines(n: int) -> list[str]:
    return [f"line {i:05d} " + "abcdefghij" * 3 + "\n" for i in range(n)]


def _alternate(lines: list[str]) -> list[str]:
    """Every other line changed (the tester's hostile edit: quadratic for difflib)."""
    return [("REMOTE " + ln) if i % 2 and i > 2 else ln for i, ln in enumerate(lines)]


def _b(lines: list[str]) -> bytes:
    return "".join(lines).encode()


def test_a_merge_of_a_file_whose_every_other_line_changed_stops_at_the_budget():
    base = _lines(4000)
    ours = ["LINE " + base[0]] + base[1:]
    budget = WorkBudget()
    with pytest.raises(DiffTooCostly):
        merge_lines(_b(base), _b(_alternate(base)), _b(ours), budget)
    # the work done is the budget plus at most one longest-match search (two ranges of
    # 4,000 lines and the places of 4,000 lines)
    assert DIFF_WORK_BUDGET < budget.spent <= DIFF_WORK_BUDGET + 3 * 4000


def test_a_merge_under_the_budget_is_exactly_merge3s():
    for n, theirs_f, ours_f in [
        (20000, lambda ls: ls[:-1] + ["REMOTE " + ls[-1]], lambda ls: ["LINE " + ls[0]] + ls[1:]),
        (2000, _alternate, lambda ls: ["LINE " + ls[0]] + ls[1:]),
        (6000, lambda ls: [("R " + x) if i % 60 == 5 else x for i, x in enumerate(ls)],
         lambda ls: [("O " + x) if i % 60 == 30 else x for i, x in enumerate(ls)]),
    ]:
        base = _lines(n)
        theirs, ours = theirs_f(base), ours_f(base)
        plain = merge3.Merge3([x.encode() for x in base], [x.encode() for x in theirs],
                              [x.encode() for x in ours])
        want = b"".join(ln for g in plain.merge_groups() for ln in g[1])
        assert merge_lines(_b(base), _b(theirs), _b(ours)) == want


def test_the_matcher_counts_repeated_lines_places():
    """Many copies of one line (no autojunk, as the console diffs): each search visits every
    place of each line, so the budget stops it within the first searches."""
    a = ["-"] * 3000
    b = ["-" if i % 2 else "+" for i in range(3000)]
    budget = WorkBudget()
    with pytest.raises(DiffTooCostly):
        BoundedMatcher(None, a, b, autojunk=False, budget=budget).get_opcodes()
    assert budget.spent <= DIFF_WORK_BUDGET + 3000 * 1500 + 6000


def test_the_console_diff_of_a_hostile_pair_is_too_large_and_a_normal_one_is_shown():
    a = "".join(_lines(4000))
    b = "".join(_alternate(_lines(4000)))
    assert render.line_diff(a, b) is None  # "Too large to diff here."
    assert render.unified_diff(a, b, "v1", "v2") is None
    small_a, small_b = "".join(_lines(200)), "".join(_alternate(_lines(200)))
    d = render.line_diff(small_a, small_b)
    assert d is not None and d.hunks
    u = render.unified_diff(small_a, small_b, "v1", "v2")
    import difflib
    want = list(difflib.unified_diff(small_a.splitlines(), small_b.splitlines(), "v1", "v2", lineterm=""))
    assert u is not None and [x.text for x in u] == want


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with two_sidecars(tmp_path_factory.mktemp("mb"), "s") as cp_a_b:
        yield cp_a_b


def _state(p) -> str:
    try:
        return os.getxattr(p, "user.memfuse.state").decode()
    except OSError as err:
        return f"errno {err.errno}"


def test_a_merge_past_the_budget_is_last_writer_wins_and_the_store_goes_on(pair):
    """B rewrites a 4,000-line file (sed -i) on the version it read after A changed every
    other line: the merge is too costly, so B's write wins, says so, and A's stays in history;
    a small file B writes right after commits (the outbox is not held by a long merge)."""
    cp, a, b = pair
    name = f"big-{uuid.uuid4().hex[:6]}.md"
    v1 = "".join(_lines(4000))
    _, pb = written_and_seen(a, b, "s", name, v1, timeout=30)
    mine = pb.read_text()  # B's tool reads version 1
    v2 = "".join(_alternate(_lines(4000)))
    (a.mountpoint / "s" / name).write_text(v2)  # A commits version 2
    wait_until(lambda: _state(a.mountpoint / "s" / name) == "clean", timeout=30, what="v2 committed")
    wait_until(lambda: live_records(cp, "s")[name].content == v2, timeout=30, what="v2 stored")
    ours = "LINE " + mine
    want = hashlib.sha256(v2.encode()).hexdigest()
    wait_applied(pb, want, timeout=30, what="v2 applied in B from the feed")  # no read: B's tool saw version 1
    tmp = pb.with_name(f"sed{uuid.uuid4().hex[:6]}")
    tmp.write_text(ours)
    os.replace(tmp, pb)  # B's edit of line 1, made on version 1 (sed -i)
    small = b.mountpoint / "s" / f"small-{uuid.uuid4().hex[:6]}.md"
    small.write_text("a small unrelated note\n")
    wait_until(lambda: _state(small) == "clean", timeout=30, what="the small file committed")
    wait_until(lambda: live_records(cp, "s")[name].content == ours, timeout=30,
               what="B's write is the latest version")
    conflicts = [e for e in errors_log(b.mountpoint) if e.get("conflict") and e["path"].endswith(name)]
    assert len(conflicts) == 1, errors_log(b.mountpoint)  # last writer wins, and says so
    rec = live_records(cp, "s")[name]
    history = [cp.call("version", "s", rec.id, v.version).content for v in cp.call("versions", "s", rec.id)]
    assert v2 in history  # nothing lost
