"""Memory-controlled text *outside* the prompt block's fence (``memfuse.server.context``):
the one sanitizer every such piece goes through (``one_line``, ``quoted``).

Inside the fence, ``MEMORY.md`` keeps its lines (``memfuse.content.prompt_text``): the fence
is longer than any backtick run in it, so it cannot close it. Outside the fence the block's
structure is lines: ``## Store …`` headers, ``Instructions for this store (from the
operator): …``, ``[memfuse: …]`` markers. Memory content that reaches those lines — the
entries a cut marker names (``indexlinks.omitted_marker``: link targets, ``%XX`` decoded),
the stale records a note names (``staleness.stale_marker``: record paths), the mount root a
caller passes — must not start a line of its own nor close the marker's quoting, or it forges
sections (attack 12, A1: ``%0A`` in a cut link target made an "operator instruction").

INVARIANT: ``one_line(x)`` holds no character of Unicode categories C* (controls incl.
``\\n`` ``\\r`` ``\\t`` NEL, format characters: zero-width, bidi controls, BOM, tags;
surrogates, private use, unassigned), Zl / Zp (U+2028, U+2029), no backtick or square
bracket, and at most ``max_chars`` characters. A record path (``names.check_path`` refuses
those categories) is shown as it is but for ``` `` ``[`` ``]``.
Operator text (store descriptions, attachment instructions: admin-only writes) keeps its
lines and is not passed here.
"""
from __future__ import annotations

import unicodedata

NAME_MAX_CHARS = 200  # one name in a marker, at most (characters; cut with "…")
ELLIPSIS = "…"
#: characters that would close the marker's quoting (`` `name` `` inside ``[memfuse: …]``)
QUOTING = frozenset("`[]")
#: categories read as a word break (a space): controls and line / paragraph separators, so
#: that ``a\nb`` shows as ``a b``, not ``ab``; every other C* category is dropped
_BREAK_CATEGORIES = frozenset(("Cc", "Zl", "Zp"))


def one_line(text: str, max_chars: int = NAME_MAX_CHARS) -> str:
    """``text`` as one line fit for the prompt block outside its fence (module INVARIANT):
    each control character and line / paragraph separator becomes a space; format,
    surrogate, private-use and unassigned characters, backticks and square brackets are
    removed; cut to ``max_chars`` characters (``max_chars >= 1``), the last one ``…`` when
    cut. Returns ``""`` when nothing but spaces is left."""
    out: list[str] = []
    for ch in text:
        if ch in QUOTING:
            continue
        if " " <= ch <= "~":  # printable ASCII: no lookup
            out.append(ch)
            continue
        cat = unicodedata.category(ch)
        if cat in _BREAK_CATEGORIES:
            out.append(" ")
        elif cat[0] != "C":
            out.append(ch)
    line = "".join(out)
    if len(line) > max_chars:
        line = line[: max_chars - 1] + ELLIPSIS
    return line if line.strip() else ""


def quoted(text: str, max_chars: int = NAME_MAX_CHARS) -> str:
    """``one_line(text)`` in backticks (a name in a ``[memfuse: …]`` marker); ``(unprintable
    name)`` when nothing is left of it."""
    line = one_line(text, max_chars)
    return f"`{line}`" if line else "(unprintable name)"
