"""The work bound of every line diff memfuse runs on untrusted content (the sidecar's
three-way merge, ``sidecar/conflict.merge_lines``; the console's version diffs,
``server/console/render``): one rule, here.

``difflib.SequenceMatcher`` finds matching blocks by repeated longest-match searches, each
scanning the whole unmatched region it is given; on texts whose lines all differ in a
fine-grained pattern (every other line changed) it recurses once per line over regions that
shrink by one line, quadratic in lines (attack 13 F11, F12: 6,000 lines → 10-14 s, 19,000
lines → minutes). :class:`BoundedMatcher` is that same matcher (same results, so merges and
diffs under the bound are exactly as before) that counts its work, the lines each
longest-match search visits, against a :class:`WorkBudget`, and raises
:class:`DiffTooCostly` once the budget is spent. Callers fall back: the merge to last
writer wins (the other version stays in history), the console to "too large to diff here".
"""
from __future__ import annotations

import difflib
from typing import Any, Callable, Hashable, Sequence

__all__ = ["DIFF_WORK_BUDGET", "BoundedMatcher", "DiffTooCostly", "WorkBudget", "bounded_matcher"]

#: lines scanned by longest-match searches, over all the diffs one merge or one diff view
#: runs. ~0.2-0.8 s of CPU on this project's machines (bench/README.md, "Bounded diffs"):
#: far below the sidecar's default ``--commit-wait`` (10 s). A merge of one edit on each
#: side of a 20,000-line file costs ~150,000; of 2,000 lines with every other line changed
#: ~2.5 million (merged as before); of 4,000 such lines ~10 million (falls back).
DIFF_WORK_BUDGET = 4_000_000


class DiffTooCostly(Exception):
    """A diff would take more work than its :class:`WorkBudget` allows (``spent``, ``limit``:
    lines scanned)."""

    def __init__(self, spent: int, limit: int) -> None:
        super().__init__(f"the diff needs more than {limit} line comparisons")
        self.spent = spent
        self.limit = limit


class WorkBudget:
    """Lines a diff (or several, sharing it) may scan: ``limit`` (default
    ``DIFF_WORK_BUDGET``); ``spent`` so far. ``spend(n)`` raises :class:`DiffTooCostly`
    once ``spent`` would pass ``limit``."""

    def __init__(self, limit: int = DIFF_WORK_BUDGET) -> None:
        self.limit = limit
        self.spent = 0

    def spend(self, n: int) -> None:
        """Count ``n`` more units of work; raises :class:`DiffTooCostly` past the limit."""
        self.spent += n
        if self.spent > self.limit:
            raise DiffTooCostly(self.spent, self.limit)


class BoundedMatcher(difflib.SequenceMatcher):  # type: ignore[type-arg]
    """``difflib.SequenceMatcher`` (same arguments, same results) whose longest-match
    searches are counted against ``budget`` (a :class:`WorkBudget`, keyword-only; a fresh
    one of ``DIFF_WORK_BUDGET`` when not given): each search costs the lengths of the two
    ranges it is given plus the places in ``b`` it visits for the lines of ``a`` (an upper
    bound: a line repeated many times costs its every place). Raises :class:`DiffTooCostly` from whichever method runs the searches
    (``get_matching_blocks``, ``get_opcodes``, ...) once the budget is spent."""

    def __init__(self, isjunk: Callable[[Any], bool] | None = None, a: Sequence[Hashable] = "",
                 b: Sequence[Hashable] = "", autojunk: bool = True, *,
                 budget: WorkBudget | None = None) -> None:
        self.budget = budget if budget is not None else WorkBudget()
        super().__init__(isjunk, a, b, autojunk)

    def find_longest_match(self, alo: int = 0, ahi: int | None = None, blo: int = 0,
                           bhi: int | None = None) -> difflib.Match:
        """As ``difflib.SequenceMatcher.find_longest_match``, after counting its work."""
        seq_a: Sequence[Hashable] = getattr(self, "a")
        hi_a = len(seq_a) if ahi is None else ahi
        hi_b = len(getattr(self, "b")) if bhi is None else bhi
        # the search visits, for each line of a[alo:hi_a], that line's places in b (its
        # ``b2j`` list, up to hi_b): counted in full (an upper bound), plus the b range
        b2j: dict[Hashable, list[int]] = getattr(self, "b2j")
        visits = 0
        for x in seq_a[alo:hi_a]:
            visits += len(b2j.get(x, ()))
        self.budget.spend(max(0, hi_b - blo) + max(0, hi_a - alo) + visits)
        return super().find_longest_match(alo, hi_a, blo, hi_b)


def bounded_matcher(budget: WorkBudget) -> Callable[..., BoundedMatcher]:
    """A ``sequence_matcher`` factory (as ``merge3.Merge3`` takes: called like
    ``difflib.SequenceMatcher``) whose matchers all spend ``budget``."""

    def make(isjunk: Callable[[Any], bool] | None = None, a: Sequence[Hashable] = "",
             b: Sequence[Hashable] = "", autojunk: bool = True) -> BoundedMatcher:
        return BoundedMatcher(isjunk, a, b, autojunk, budget=budget)

    return make
