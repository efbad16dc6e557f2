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
import re
from dataclasses import dataclass
from datetime import datetime, timezone

import nh3
from markdown_it import MarkdownIt
from markupsafe import Markup

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
    noreferrer nofollow"``. Event handlers, ``style`` attributes, ``<script>``,
    ``<iframe>``, forms and comments are removed."""
    return nh3.clean(
        html,
        tags=_TAGS,
        attributes=_ATTRIBUTES,
        url_schemes=_URL_SCHEMES,
        link_rel="noopener noreferrer nofollow",
        strip_comments=True,
    )


def render_markdown(text: str) -> Markup:
    """Markdown ``text`` → safe HTML (``Markup``): markdown-it-py with raw HTML disabled,
    then :func:`sanitize_html`."""
    return Markup(sanitize_html(_md.render(text)))


@dataclass(frozen=True)
class RenderedContent:
    """A record's content for display: ``frontmatter`` (raw text, shown escaped, or None),
    ``html`` (sanitized Markdown, or None when the record is not Markdown), ``text`` (the
    whole content, shown escaped in the source view)."""

    frontmatter: str | None
    html: Markup | None
    text: str


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
    return RenderedContent(fm, render_markdown(body), text)


@dataclass(frozen=True)
class DiffLine:
    """One line of a unified diff: ``kind`` is ``head`` (file names), ``hunk`` (``@@``),
    ``add``, ``del`` or ``ctx``; ``text`` the line as is (escaped when shown)."""

    kind: str
    text: str


MAX_DIFF_LINES = 20_000  # per side; beyond it the diff is refused (difflib is quadratic)


def unified_diff(a: str, b: str, a_label: str, b_label: str, context: int = 3) -> list[DiffLine] | None:
    """The unified diff (``difflib``) of ``a`` → ``b`` as typed lines; ``[]`` when equal,
    None when either side has more than ``MAX_DIFF_LINES`` lines."""
    al, bl = a.splitlines(), b.splitlines()
    if len(al) > MAX_DIFF_LINES or len(bl) > MAX_DIFF_LINES:
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
    """The prompt block as ``(is_marker, line)`` pairs: lines of a ``[memfuse: …]`` omission
    marker are flagged so the preview can highlight them."""
    out = []
    in_marker = False
    for line in text.split("\n"):
        if line.startswith(MARKER_PREFIX):
            in_marker = True
        out.append((in_marker, line))
        if in_marker and line.rstrip().endswith("]"):
            in_marker = False
    return out
