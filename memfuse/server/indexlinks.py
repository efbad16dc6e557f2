"""The links of a store's ``MEMORY.md`` (its *entries*), shared by the index report
(``indexreport``) and the prompt block (``context``), which names the entries it cuts.

An *entry* is a local Markdown link on a line of ``MEMORY.md`` (``[text](notes/a.md)``;
``<…>`` and a title allowed; links with a scheme ``https:`` / ``mailto:``, pure anchors
``#x`` and absolute paths are not local). A target is read relative to the store root (where
``MEMORY.md`` is): ``./`` and ``..`` resolved, ``%XX`` decoded, ``#anchor`` / ``?query``
dropped; a target ending in ``/`` is written as a directory.
"""
from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from urllib.parse import unquote

from memfuse.server.promptline import quoted

LINK_RE = re.compile(r"\[(?:[^\]\n\\]|\\.)*\]\(\s*(<[^>\n]*>|[^)\s]+)(?:\s+(?:\"[^\"\n]*\"|'[^'\n]*'))?\s*\)")
SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*:")
MARKER_NAMES_MAX = 20  # omitted entries the prompt block's marker names at most
MARKER_NAMES_BYTES = 1000  # and at most this many bytes of their targets
#: characters of the lines a prompt block cuts that its marker reads for entries (whole
#: lines; the rest is not read: the marker then says "at least"), so the work per index is
#: bounded whatever its size (attack 13 F10)
OMITTED_SCAN_CHARS = 32 * 1024
_QUERY_RE = re.compile(r"[#?]")


@dataclass(frozen=True)
class Entry:
    """A local link of ``MEMORY.md``: its 1-based ``line``, the line's ``text`` and the
    ``target`` path relative to the store root (``None``: it leaves the store), ``dir``
    when written as a directory (trailing ``/``)."""

    line: int
    text: str
    target: str | None
    raw: str
    dir: bool = False


def _target(raw: str) -> tuple[str | None, bool] | None:
    """(path relative to the store root or None when it leaves the store, written as a
    directory) of a link target; None when the link is not local."""
    raw = raw.strip()
    if raw.startswith("<") and raw.endswith(">"):
        raw = raw[1:-1].strip()
    if not raw or raw[0] in "#/" or SCHEME_RE.match(raw):
        return None
    raw = _QUERY_RE.split(raw, maxsplit=1)[0]
    if not raw:
        return None
    path = unquote(raw) if "%" in raw else raw
    is_dir = path.endswith("/")
    norm = posixpath.normpath(path)
    if norm == "." or norm.startswith("../") or norm == "..":
        return (None, is_dir) if norm != "." else None
    return norm, is_dir


def entries(text: str, first_line: int = 1) -> list[Entry]:
    """Every local link of ``MEMORY.md`` text, in order (a line with two links gives two);
    ``first_line``: the number of ``text``'s first line (``text`` a part of the file).
    Work: linear in ``len(text)``; callers bound what they pass (``omitted_marker``, the
    prompt block's shown part, ``indexreport.REPORT_SCAN_CHARS``)."""
    out: list[Entry] = []
    seen: dict[str, tuple[str | None, bool] | None] = {}  # a target written many times is read once
    for i, line in enumerate(text.split("\n"), first_line):
        if "](" not in line:
            continue
        for m in LINK_RE.finditer(line):
            raw = m.group(1)
            t = seen[raw] if raw in seen else seen.setdefault(raw, _target(raw))
            if t is not None:
                out.append(Entry(line=i, text=line, target=t[0], raw=raw, dir=t[1]))
    return out


def line_count(text: str) -> int:
    """Lines of ``text`` as ``context.cut_index`` counts them (an unterminated tail is one)."""
    return text.count("\n") + (0 if text.endswith("\n") or not text else 1)


def omitted_marker(text: str, lines_left: int) -> str:
    """The sentence the prompt block's cut marker adds when its last ``lines_left`` lines
    are cut: the targets of the entries on them (at most ``MARKER_NAMES_MAX`` /
    ``MARKER_NAMES_BYTES``, then how many more), or ``""`` when they hold no entry. Each
    target is memory content shown outside the fence: ``promptline.quoted`` (one line, no
    backtick or bracket, at most ``promptline.NAME_MAX_CHARS`` characters).

    Only the first ``OMITTED_SCAN_CHARS`` characters of the lines cut are read (whole
    lines, unless one line is longer): when more is cut, the count says ``at least K
    more`` (``possibly more`` when K is 0), so the work is bounded whatever the size of
    ``text``."""
    first_cut = line_count(text) - lines_left + 1
    start = 0
    for _ in range(first_cut - 1):  # at most the lines shown (context.CONTEXT_INDEX_MAX_LINES)
        start = text.index("\n", start) + 1
    window = text[start:start + OMITTED_SCAN_CHARS]
    complete = start + len(window) >= len(text)
    if not complete and "\n" in window:
        window = window[:window.rindex("\n") + 1]
    gone = entries(window, first_cut)
    if not gone:
        return ""
    names: list[str] = []
    size = 0
    for e in gone:
        # memory content outside the fence: one line, no quoting characters (promptline)
        name = quoted(e.target if e.target is not None else e.raw)
        if len(names) >= MARKER_NAMES_MAX or size + len(name.encode()) > MARKER_NAMES_BYTES:
            break
        names.append(name)
        size += len(name.encode())
    more = len(gone) - len(names)
    if complete:
        tail = f" and {more} more" if more else ""
    else:
        tail = f" and at least {more} more" if more else " and possibly more"
    return f" The entries cut are: {', '.join(names)}{tail}."
