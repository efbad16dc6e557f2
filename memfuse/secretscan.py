"""The secret scan of an append from what the scan of the content it extends found.

An append (``echo line >> f``) is scanned for secrets over its suffix and the context before
it: the last 16 KiB of the content it extends, from a line start (the control plane's
``tails.scan_context``, the sidecar's ``core.APPEND_SCAN_CONTEXT``), so that a secret split
across the two is found. ``memfuse.content.find_secret`` looks for each rule's literal hints
in the whole text it is given (~60 passes over it: ~0.6 ms per 16 KiB here, 4× what the same
append to a 4 KiB file costs), at every append, in the sidecar and in ``memfuse serve``.

``AppendScans`` keeps, for recently scanned windows (context + suffix), the hints each held,
keyed by the sha256 of the content the window ends. The next append's context is a suffix
of that window (checked: ``window.endswith(context)``, not assumed), so a hint in the new
window is either in the old window (kept) or overlaps the new suffix (within
``HINT_MAX_CHARS - 1`` characters before it: looked for there). Only the kept hints are
looked for in the whole new window, each once; only the rules with a hint present run,
exactly as ``find_secret`` runs them.

Exact by construction: the answer is ``find_secret(context + suffix)``'s, hit or miss
(``tests/test_secretscan.py`` compares them over random appends). It is used only for a window
that is its own ``secret_view`` (nothing ``prompt_text`` strips, NFKC-normalized), where
``find_secret`` reads the text once as written, then its encoded forms
(``content._encoded_secret``: escapes, base64 / hex runs, rot13, a pass each over the whole
window, here too); any other window is scanned by
``find_secret`` whole, as before, and keeps nothing. A window longer than ``MAX_CHARS`` (a
context with no line end in its last 16 KiB) is not kept.

Memory: at most ``MAX_ENTRIES`` windows of at most ``MAX_CHARS`` characters each, least
recently used out. Nothing persisted (a restart scans whole once). Thread safety: the table
is changed under one lock (the control plane scans from worker threads).
"""
from __future__ import annotations

import threading
from collections import OrderedDict

from memfuse import content as content_rules
from memfuse.content import HINT_MAX_CHARS, Hint

__all__ = ["MAX_ENTRIES", "MAX_CHARS", "AppendScans"]

#: windows kept at most (least recently used first out)
MAX_ENTRIES = 64
#: the longest window kept, in characters (a 16 KiB context plus a line and a suffix fit)
MAX_CHARS = 64 * 1024


def _clean(text: str) -> bool:
    """Whether ``text`` is its own ``secret_view`` (nothing stripped by ``prompt_text``, no
    gap between token characters, NFKC-normalized, no look-alike letter; ASCII text is its
    own view when ``prompt_text`` strips nothing)."""
    return content_rules.secret_view(text) == text


class AppendScans:
    """``find_secret`` of appends, from the hints of the window each one extends.

    ``find_secret(context, suffix, base, new)`` is ``content.find_secret(context + suffix)``;
    ``base``: the sha256 of the content ``context`` ends (its window, when kept, saves the
    pass over ``context``), ``new``: the sha256 of the content the append makes (the
    window is kept under it for the next append). ``hits`` / ``misses`` count the appends
    scanned from a kept window or whole."""

    def __init__(self, max_entries: int = MAX_ENTRIES, max_chars: int = MAX_CHARS) -> None:
        self.max_entries = max_entries
        self.max_chars = max_chars
        # INVARIANT: for every (window, hints) kept, ``_clean(window)`` and
        # ``hints == content.hints_in(window)``. GUARDED_BY(_lock)
        self._kept: OrderedDict[str, tuple[str, frozenset[Hint]]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def find_secret(self, context: str, suffix: str, base: str = "", new: str = "") -> str | None:
        """The reason ``content.find_secret(context + suffix)`` gives, or None (module
        docstring). ``base`` / ``new``: sha256 hex of the content before / after the
        append ("" for none: nothing looked up / kept). Never raises."""
        window = context + suffix
        with self._lock:
            kept = self._kept.get(base) if base else None
            if kept is not None:
                self._kept.move_to_end(base)
        hints: frozenset[Hint] | None = None
        if (kept is not None and kept[0].endswith(context)
                and (_clean(suffix) if window.isascii() else _clean(window))):
            # context is clean (a part of a clean window) and so is suffix: an ASCII window
            # is too (its view is prompt_text's, character by character); a non-ASCII one
            # is checked whole (a gap at context's end may meet a token character).
            # A hint in window lies in context (so in the kept window: among kept[1]) or
            # overlaps suffix (so in edge)
            edge = context[max(0, len(context) - (HINT_MAX_CHARS - 1)):] + suffix
            fresh = content_rules.hints_in(edge)
            low = window.lower() if any(lower for lower, _ in kept[1] - fresh) else ""
            hints = fresh | frozenset(h for h in kept[1] - fresh if h[1] in (low if h[0] else window))
            self.hits += 1
        elif _clean(window):
            hints = content_rules.hints_in(window)
            self.misses += 1
        else:
            self.misses += 1
            return content_rules.find_secret(window)
        if new and len(window) <= self.max_chars:
            with self._lock:
                self._kept[new] = (window, hints)
                self._kept.move_to_end(new)
                while len(self._kept) > self.max_entries:
                    self._kept.popitem(last=False)
        return content_rules.find_secret_in_view(window, hints)
