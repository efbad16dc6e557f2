"""Turning untrusted memory content into inert HTML, and other display helpers of the console.

Memory is written by agents and is untrusted: nothing in it may run in a person's browser.
Markdown records are rendered by markdown-it-py with raw HTML disabled (``<script>`` in a
record comes out as escaped text), then the HTML is cleaned by nh3 (the Ammonia sanitizer)
with an allow-list of tags and attributes and only ``http``, ``https`` and ``mailto`` URLs,
so no element, event-handler attribute or ``javascript:`` URL survives even if the Markdown
renderer let one through. Everything else (paths, other file types, diffs, the prompt block)
is shown as text escaped by Jinja2's autoescape. The page's Content-Security-Policy (no
inline script) is the last line of defence.
"""
from __future__ import annotations

import difflib
import functools
import re
from dataclasses import dataclass
from datetime import datetime, timezone

import nh3
from markdown_it import MarkdownIt
from markupsafe import Markup

from memfuse.diffwork import BoundedMatcher, DiffTooCostly, WorkBudget
from memfuse.server.context import fenced_lines

MARKDOWN_SUFFIXES = (".md", ".markdown", ".mdown", ".mkd")

# CommonMark with raw HTML off; tables and strikethrough (GFM) on. Links are validated by
# markdown-it (no javascript:, vbscript:, file:, data: other than images) and again by nh3.
_md = MarkdownIt("commonmark", {"html": False, "linkify": False, "typographer": False}).enable(
    ["table", "strikethrough"]
)

_TAGS = {
    "a", "abbr", "b", "blockquote", "br", "code", "del", "em", "h1", "h2", "h3", "h4", "h5",
    "h6", "hr", "i", "img", "kbd", "li", "ol", "p", "pre", "s", "strong", "sub", "sup",
    "table", "tbody", "td", "th", "thead", "tr", "ul",
}
_ATTRIBUTES = {
    "a": {"href", "title"},
    "img": {"src", "alt", "title"},
    "code": {"class"},
    "ol": {"start"},
}
_URL_SCHEMES = {"http", "https", "mailto"}

_FRONTMATTER = re.compile(r"\A\ufeff?---[ \t]*\r?\n(.*?\r?\n)?(?:---|\.\.\.)[ \t]*(?:\r?\n|\Z)", re.S)


def sanitize_html(html: str) -> str:
    """Clean ``html`` with nh3: only the tags and attributes the console allows, URLs only
    ``http``/``https``/``mailto`` (relative URLs are kept), every link gets ``rel="noopener
    noreferrer nofollow"`` (a protocol-relative ``//host`` link, which leaves the console as
    an ``https://`` one does, too: it is every ``<a>``; pages are served with
    ``Referrer-Policy: no-referrer`` and ``img-src 'self'``). Event handlers, ``style`` attributes, ``<script>``,
    ``<iframe>``, forms and comments are removed."""
    return nh3.clean(
        html,
        tags=_TAGS,
        attributes=_ATTRIBUTES,
        url_schemes=_URL_SCHEMES,
        link_rel="noopener noreferrer nofollow",
        strip_comments=True,
    )


#: the most characters of a record rendered as Markdown; the rest is shown only as text.
#: markdown-it-py is pure Python and linear but slow on hostile valid Markdown (``[`` x N,
#: table rows of many cells: ~15 µs of CPU a character here, against ~3 for prose), so an
#: agent's 1 MiB record would cost a replica ~15 s of CPU per view (attack 13 F9); 64 Ki
#: characters bound a render to about a second, and ordinary memory files are far smaller.
MARKDOWN_RENDER_MAX = 64 * 1024

#: rendered heads kept (an LRU keyed by the text: versions are immutable, so a page viewed
#: again, or by many people, costs no second render); at most ~64 Ki characters each
RENDER_CACHE_ENTRIES = 32


@functools.lru_cache(maxsize=RENDER_CACHE_ENTRIES)
def render_markdown(text: str) -> Markup:
    """Markdown ``text`` → safe HTML (``Markup``): markdown-it-py with raw HTML disabled,
    then :func:`sanitize_html`. Cached (:data:`RENDER_CACHE_ENTRIES`); callers bound the
    text's length (:func:`render_content`)."""
    return Markup(sanitize_html(_md.render(text)))


def markdown_head(body: str, limit: int = MARKDOWN_RENDER_MAX) -> str:
    """The part of ``body`` the console renders as Markdown: all of it up to ``limit``
    characters, else cut at the last blank line (else line end) at or before ``limit``, so a
    paragraph is not cut in two where it can be helped."""
    if len(body) <= limit:
        return body
    cut = body.rfind("\n\n", 0, limit - 1)
    if cut > 0:
        return body[: cut + 2]
    cut = body.rfind("\n", 0, limit)
    return body[: cut + 1] if cut > 0 else body[:limit]


@dataclass(frozen=True)
class RenderedContent:
    """A record's content for display: ``frontmatter`` (raw text, shown escaped, or None),
    ``html`` (sanitized Markdown, or None when the record is not Markdown), ``text`` (the
    whole content, shown escaped in the source view), ``unrendered`` (characters of the body
    past :data:`MARKDOWN_RENDER_MAX` left out of ``html``: shown only in the source)."""

    frontmatter: str | None
    html: Markup | None
    text: str
    unrendered: int = 0


def render_content(path: str, text: str) -> RenderedContent:
    """How the console shows a record at ``path``: Markdown files (``.md`` and friends) are
    rendered (frontmatter split off and shown as text); any other file only as escaped text."""
    if not path.lower().endswith(MARKDOWN_SUFFIXES):
        return RenderedContent(None, None, text)
    fm = None
    body = text
    m = _FRONTMATTER.match(text)
    if m:
        fm = (m.group(1) or "").rstrip("\r\n")
        body = text[m.end():]
    head = markdown_head(body)
    return RenderedContent(fm, render_markdown(head), text, len(body) - len(head))


@dataclass(frozen=True)
class DiffLine:
    """One line of a unified diff: ``kind`` is ``head`` (file names), ``hunk`` (``@@``),
    ``add``, ``del`` or ``ctx``; ``text`` the line as is (escaped when shown)."""

    kind: str
    text: str


MAX_DIFF_LINES = 20_000  # per side; beyond it the diff is refused
# and within it a diff's work is bounded (memfuse.diffwork: difflib is quadratic in lines on
# hostile input, attack 13 F11): past the budget the diff is refused too ("too large")


def unified_diff(a: str, b: str, a_label: str, b_label: str, context: int = 3,
                 budget: WorkBudget | None = None) -> list[DiffLine] | None:
    """The unified diff (``difflib``) of ``a`` → ``b`` as typed lines; ``[]`` when equal,
    None when either side has more than ``MAX_DIFF_LINES`` lines or the diff would take
    more than ``diffwork.DIFF_WORK_BUDGET`` work (``budget``: a ``WorkBudget`` to spend)."""
    al, bl = a.splitlines(), b.splitlines()
    if len(al) > MAX_DIFF_LINES or len(bl) > MAX_DIFF_LINES:
        return None
    try:  # the same matcher difflib.unified_diff runs, counted: it then runs within the bound
        BoundedMatcher(None, al, bl, budget=budget or WorkBudget()).get_matching_blocks()
    except DiffTooCostly:
        return None
    out: list[DiffLine] = []
    for line in difflib.unified_diff(al, bl, a_label, b_label, n=context, lineterm=""):
        if line.startswith(("---", "+++")) and len(out) < 2:
            kind = "head"
        elif line.startswith("@@"):
            kind = "hunk"
        elif line.startswith("+"):
            kind = "add"
        elif line.startswith("-"):
            kind = "del"
        else:
            kind = "ctx"
        out.append(DiffLine(kind, line))
    if a != b and not out:  # differ only in a final newline or line endings
        out = [DiffLine("hunk", "(the versions differ only in line endings or a final newline)")]
    return out


@dataclass(frozen=True)
class Segment:
    """A run of a line's text; ``changed`` marks words that differ from the paired line on
    the other side (shown highlighted)."""

    text: str
    changed: bool = False


@dataclass(frozen=True)
class Row:
    """One line of a diff as shown: ``kind`` is ``ctx``, ``del`` or ``add``; ``old`` / ``new``
    the 1-based line numbers in the old / new version (None on the side the line is not in);
    ``segments`` the text, with changed words marked."""

    kind: str
    old: int | None
    new: int | None
    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class Hunk:
    """A run of changes with its context: ``header`` (``@@ -a,n +b,m @@``), ``unified`` (rows
    in unified order: removed lines before added ones), ``split`` (pairs ``(left, right)`` for
    the side-by-side view; either may be None where one side has no line)."""

    header: str
    unified: tuple[Row, ...]
    split: tuple[tuple[Row | None, Row | None], ...]


@dataclass(frozen=True)
class LineDiff:
    """A diff for display: ``hunks`` (empty when the texts are equal) and ``note`` (set when
    the texts differ only in line endings or a final newline, which no line shows)."""

    hunks: tuple[Hunk, ...]
    note: str | None = None


_TOKEN = re.compile(r"\w+|\s+|[^\w\s]")
MAX_WORD_DIFF_CHARS = 4000  # per line; longer changed lines are shown without word marks
MIN_WORD_SIMILARITY = 0.3  # below it two paired lines are unrelated: marking every word is noise


def _segments(tokens: list[str], spans: list[tuple[int, int, bool]]) -> tuple[Segment, ...]:
    out: list[Segment] = []
    for lo, hi, changed in spans:
        text = "".join(tokens[lo:hi])
        if not text:
            continue
        if out and out[-1].changed == changed:
            out[-1] = Segment(out[-1].text + text, changed)
        else:
            out.append(Segment(text, changed))
    return tuple(out)


def word_diff(old: str, new: str, budget: WorkBudget | None = None) -> tuple[tuple[Segment, ...], tuple[Segment, ...]]:
    """The words of ``old`` and ``new`` (two paired changed lines) with the ones that differ
    marked, as GitHub does: ``difflib.SequenceMatcher`` over word / space / punctuation
    tokens. Lines that are too long or too different, or whose diff would pass ``budget``
    (a ``diffwork.WorkBudget``, shared by a view's diffs), come back unmarked (one segment
    each)."""
    plain = (Segment(old),) if old else (), (Segment(new),) if new else ()
    if len(old) > MAX_WORD_DIFF_CHARS or len(new) > MAX_WORD_DIFF_CHARS:
        return plain
    a, b = _TOKEN.findall(old), _TOKEN.findall(new)
    sm = BoundedMatcher(None, a, b, autojunk=False, budget=budget or WorkBudget())
    try:
        if sm.ratio() < MIN_WORD_SIMILARITY:
            return plain
    except DiffTooCostly:
        return plain
    left: list[tuple[int, int, bool]] = []
    right: list[tuple[int, int, bool]] = []
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        left.append((i1, i2, tag != "equal"))
        right.append((j1, j2, tag != "equal"))
    return _segments(a, left), _segments(b, right)


def line_diff(a: str, b: str, context: int = 3) -> LineDiff | None:
    """The diff of ``a`` → ``b`` for the console's unified and side-by-side views: hunks of
    changed lines with ``context`` lines around them, line numbers on both sides, and within
    each replaced line paired with its counterpart the changed words marked (:func:`word_diff`).
    None when either side has more than ``MAX_DIFF_LINES`` lines or the line diff would
    take more than ``diffwork.DIFF_WORK_BUDGET`` work (difflib is quadratic on hostile
    input: attack 13 F11); the word marks share that budget and are left out once it is
    spent."""
    al, bl = a.splitlines(), b.splitlines()
    if len(al) > MAX_DIFF_LINES or len(bl) > MAX_DIFF_LINES:
        return None
    budget = WorkBudget()
    sm = BoundedMatcher(None, al, bl, autojunk=False, budget=budget)
    try:
        groups = list(sm.get_grouped_opcodes(context))
    except DiffTooCostly:
        return None
    hunks: list[Hunk] = []
    for group in groups:
        i0, i9, j0, j9 = group[0][1], group[-1][2], group[0][3], group[-1][4]
        header = f"@@ -{i0 + 1 if i9 > i0 else i0},{i9 - i0} +{j0 + 1 if j9 > j0 else j0},{j9 - j0} @@"
        unified: list[Row] = []
        split: list[tuple[Row | None, Row | None]] = []
        for tag, i1, i2, j1, j2 in group:
            if tag == "equal":
                for k in range(i2 - i1):
                    row = Row("ctx", i1 + k + 1, j1 + k + 1, (Segment(al[i1 + k]),) if al[i1 + k] else ())
                    unified.append(row)
                    split.append((row, row))
                continue
            dels: list[Row] = []
            adds: list[Row] = []
            olds, news = al[i1:i2], bl[j1:j2]
            for k in range(max(len(olds), len(news))):
                o = olds[k] if k < len(olds) else None
                n = news[k] if k < len(news) else None
                if o is not None and n is not None:
                    os_, ns_ = word_diff(o, n, budget)
                else:
                    os_ = (Segment(o),) if o else ()
                    ns_ = (Segment(n),) if n else ()
                left = Row("del", i1 + k + 1, None, os_) if o is not None else None
                right = Row("add", None, j1 + k + 1, ns_) if n is not None else None
                if left:
                    dels.append(left)
                if right:
                    adds.append(right)
                split.append((left, right))
            unified.extend(dels)
            unified.extend(adds)
        hunks.append(Hunk(header, tuple(unified), tuple(split)))
    note = None
    if a != b and not hunks:
        note = "The versions differ only in line endings or a final newline."
    return LineDiff(tuple(hunks), note)


def path_breaks(path: str) -> Markup:
    """A record path as HTML with a line-break opportunity (``<wbr>``) after each ``/``, so a
    narrow screen wraps it between directories, never inside a name; each part is escaped."""
    return Markup("/<wbr>").join(path.split("/"))


def human_bytes(n: int | None) -> str:
    """``1536`` → ``"1.5 KiB"``, ``1048576`` → ``"1 MiB"`` (binary units, as ``ls -h``)."""
    if n is None:
        return ""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            if unit == "B":
                return f"{int(value)} B"
            text = f"{value:.1f}"
            return f"{text[:-2] if text.endswith('.0') else text} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def utc(dt: datetime | None) -> str:
    """A time as ``YYYY-MM-DD HH:MM:SS UTC``."""
    if dt is None:
        return ""
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def iso(dt: datetime | None) -> str:
    """A time as RFC 3339 (for ``<time datetime>``)."""
    if dt is None:
        return ""
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.astimezone(timezone.utc).isoformat()


MARKER_PREFIX = "[memfuse:"


def context_lines(text: str) -> list[tuple[bool, str]]:
    """The prompt block as ``(is_marker, line)`` pairs: ``[memfuse: …]`` omission markers
    (one line each, outside the indexes' fences: ``context.fenced_lines``) are flagged so the
    preview can highlight them; a line of ``MEMORY.md`` shaped as a marker is not."""
    return [(not in_fence and line.startswith(MARKER_PREFIX), line) for in_fence, line in fenced_lines(text)]
