"""Content rules shared by the control plane (which enforces them) and the sidecar (which
checks early, so a refusal fails fast at close with the right errno). The rules: docs/API.md ("Record rules") and docs/SEMANTICS.md.

No server imports: only the standard library, PyYAML and :mod:`memfuse.defs`.

- **Types** — :func:`record_type` picks a record's type: an explicit type (request field,
  ``user.memfuse.type`` xattr) wins, then the YAML frontmatter (``type:`` at top level, else
  ``metadata.type:`` as Claude Code writes it), then a fallback the caller gives (the store's
  ``default_type`` for a new record; the record's current type for an update). The root
  ``MEMORY.md`` is the store's index and has no type (None). :func:`check_type` validates.
- **Encoding** — :func:`check_utf8` turns bytes into the text memfuse stores (valid UTF-8,
  no NUL) or refuses (EILSEQ / ``invalid_content``).
- **Secrets** — :func:`find_secret` looks for credentials that must never be written to
  shared memory (EPERM / ``secret_detected``): PEM / PGP / PuTTY private keys, GCP
  service-account keys and API keys, AWS access key ids and secret keys, Azure storage /
  service-bus keys, GitHub, GitLab and Slack tokens and Slack webhooks, OpenAI and Anthropic
  API keys, JSON Web Tokens. Every rule anchors on a vendor prefix or an assignment context,
  and checks that the secret part looks random, so placeholders (``ghp_xxxx…``,
  ``AKIAIOSFODNN7EXAMPLE``, ``<your key>``), prose that merely mentions a key format, UUIDs,
  hashes and ordinary base64 do not match. The reason names the kind and line, never the
  secret.

Refusals raise subclasses of :class:`ContentError` (a ``ValueError``) whose ``code`` is the
API problem code and ``reason`` a short human-readable sentence.
"""
from __future__ import annotations

import base64
import bisect
import binascii
import codecs
import html
import functools
import itertools
import json
import re
import string
import sys
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from memfuse.defs import RECORD_TYPES
from memfuse.names import DEFAULT_IGNORABLE_RANGES, INDEX_NAME

__all__ = [
    "RECORD_TYPES",
    "INDEX_PATH",
    "ContentError",
    "InvalidType",
    "InvalidContent",
    "SecretDetected",
    "frontmatter",
    "frontmatter_type",
    "is_index",
    "record_type",
    "check_type",
    "check_utf8",
    "check_text",
    "find_secret",
    "find_secret_in_view",
    "hints_in",
    "Hint",
    "HINT_MAX_CHARS",
    "check_secrets",
    "find_secret_in_path",
    "NameSecret",
    "SECRET_KINDS",
    "prompt_text",
    "secret_view",
    "scan_floor",
]

INDEX_PATH = INDEX_NAME  # the store's index (memfuse.names: no directory may take its name)


# ---------------------------------------------------------------- errors


class ContentError(ValueError):
    """Content memfuse refuses. ``reason`` is a short sentence for the user (never holds a
    secret); ``code`` is the API problem code."""

    code = "invalid_content"

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class InvalidType(ContentError):
    """The type is not one of ``user``, ``feedback``, ``project``, ``reference`` (EINVAL)."""

    code = "invalid_type"


class InvalidContent(ContentError):
    """Not valid UTF-8, or holds a NUL character (EILSEQ)."""

    code = "invalid_content"


class SecretDetected(ContentError):
    """The content holds a credential (EPERM)."""

    code = "secret_detected"


# ---------------------------------------------------------------- frontmatter and types

# The closing fence: a line that is exactly '---' or '...' (optionally with trailing spaces).
_CLOSE_RE = re.compile(r"^(?:---|\.\.\.)[ \t]*\r?$", re.MULTILINE)
_MAX_FRONTMATTER_CHARS = 64 * 1024


def frontmatter(content: str) -> dict[str, Any] | None:
    """Return the YAML frontmatter of ``content`` as a dict, or None when there is none, it
    does not parse, or it is not a mapping. Never raises.

    Frontmatter is a block that starts at the very first character (after an optional BOM)
    with a ``---`` line and ends at the next ``---`` or ``...`` line, within 64 KiB. It is
    parsed with ``yaml.safe_load``.
    """
    if content.startswith("\ufeff"):
        content = content[1:]
    if not (content.startswith("---\n") or content.startswith("---\r\n")):
        return None
    start = content.index("\n") + 1
    m = _CLOSE_RE.search(content, start, start + _MAX_FRONTMATTER_CHARS)
    if m is None:
        return None
    block = content[start : m.start()]
    try:
        import yaml  # here: most processes (the sidecar) never parse front matter

        data = yaml.load(block, Loader=_frontmatter_loader())
    except Exception:  # yaml.YAMLError, and RecursionError / MemoryError-ish on hostile input
        return None
    return data if isinstance(data, dict) else None


@functools.cache
def _frontmatter_loader() -> type:
    """``yaml.SafeLoader`` but for a value that looks like a date and is none (``2026-02-30``,
    ``0000-01-01``): its text, not an error that loses the whole frontmatter (attack26: one
    such value in any key made the file's ``type:`` silently ignored). Every other tag is
    SafeLoader's. Built at first use: importing yaml costs the sidecar, which never parses
    front matter."""
    import yaml

    class FrontmatterLoader(yaml.SafeLoader):  # type: ignore[misc]  # yaml ships no types here
        pass

    def timestamp(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
        try:
            return yaml.SafeLoader.construct_yaml_timestamp(loader, node)
        except (ValueError, OverflowError, AttributeError, TypeError):
            # AttributeError: an explicit ``!!timestamp`` on text that is no date at all
            return loader.construct_scalar(node)

    FrontmatterLoader.add_constructor("tag:yaml.org,2002:timestamp", timestamp)
    return FrontmatterLoader


def frontmatter_head(content: str) -> str:
    """The shortest start of ``content`` whose :func:`frontmatter` is ``content``'s (and so
    its type and dates): up to the end of the frontmatter's closing line, or ``""`` when it
    has none (no ``---`` first line, or no closing line within 64 KiB)."""
    text = content[1:] if content.startswith("\ufeff") else content
    if not (text.startswith("---\n") or text.startswith("---\r\n")):
        return ""
    start = text.index("\n") + 1
    m = _CLOSE_RE.search(text, start, start + _MAX_FRONTMATTER_CHARS)
    if m is None:
        return ""
    return content[:m.end() + len(content) - len(text)]


def frontmatter_type(content: str) -> str | None:
    """The ``type`` the frontmatter names (top-level ``type`` first, then ``metadata.type``),
    or None when there is none (no frontmatter, bad YAML, key absent or null).

    Not validated. A non-string value comes back as a short description such as
    ``"<int 5>"`` or ``"<list>"`` so that :func:`check_type` refuses it with a readable
    reason (and a hostile alias-expanding value is never turned into a string)."""
    data = frontmatter(content)
    if data is None:
        return None
    value = data.get("type")
    if value is None:
        meta = data.get("metadata")
        if isinstance(meta, dict):
            value = meta.get("type")
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, int, float)):
        return f"<{type(value).__name__} {value!r}>"
    return f"<{type(value).__name__}>"


def is_index(path: str) -> bool:
    """True for the store's root index ``MEMORY.md`` (which has no type)."""
    return path == INDEX_PATH


def record_type(path: str, content: str, explicit: str | None, default: str | None) -> str | None:
    """The type a record at ``path`` with ``content`` gets.

    ``explicit`` (the request's ``type`` / the ``user.memfuse.type`` xattr) wins, then the
    frontmatter of ``content``, then ``default`` — the store's ``default_type`` for a new
    record, the record's current type for an update. The root ``MEMORY.md`` always gets None.

    The result is **not validated**: pass it to :func:`check_type`.
    """
    if is_index(path):
        return None
    if explicit is not None:
        return explicit
    found = frontmatter_type(content)
    return found if found is not None else default


#: why a type is refused; the value itself is never shown (it is content)
TYPE_REFUSAL = f"the type is not one of {', '.join(RECORD_TYPES)}"


def check_type(t: str | None) -> None:
    """Raise :class:`InvalidType` unless ``t`` is one of ``user``, ``feedback``, ``project``,
    ``reference``. None passes: it is the root index's (absent) type, which
    :func:`record_type` only returns for ``MEMORY.md``."""
    if t is None or t in RECORD_TYPES:
        return
    # the value is memory content (it can hold anything: a name, a token): the reason, which
    # reaches logs, errors.log and API answers, never shows it (attack 13 F13)
    raise InvalidType(TYPE_REFUSAL)


# ---------------------------------------------------------------- encoding


def check_utf8(data: bytes) -> str:
    """Decode ``data`` as record content: strict UTF-8 without NUL characters.

    Returns the text. Raises :class:`InvalidContent` naming the first bad byte offset.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidContent(f"content is not valid UTF-8 (bad byte at offset {e.start})") from None
    nul = text.find("\x00")
    if nul >= 0:
        raise InvalidContent(
            f"content contains a NUL character (at offset {len(text[:nul].encode('utf-8'))})"
        )
    return text


def check_text(text: str) -> bytes:
    """The counterpart of :func:`check_utf8` for text that arrived as ``str`` (JSON):
    return it as UTF-8 bytes. Raises :class:`InvalidContent` for a NUL character or a lone
    surrogate (a JSON ``\\ud800`` escape), which no UTF-8 file can hold."""
    if "\x00" in text:
        raise InvalidContent("content contains a NUL character")
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidContent("content is not valid UTF-8 (lone surrogate)") from None


# ---------------------------------------------------------------- the text as the prompt shows it

_SUSPECT_RE = re.compile(r"[^\t\n\x20-\x7e]")
_PLAIN_BYTES = bytes([9, 10, *range(0x20, 0x7F)])  # the ASCII characters _SUSPECT_RE does not match
_STRIP_CATEGORIES = frozenset(("Cc", "Cf", "Zl", "Zp", "Cs"))

#: Unicode's Default_Ignorable_Code_Point ranges (``memfuse.names.DEFAULT_IGNORABLE_RANGES``:
#: code points a renderer shows as nothing). A token split by one of them reads, and copies,
#: as the token (attack 15 F2), so ``prompt_text`` removes them too.
_IGNORABLE_RANGES = DEFAULT_IGNORABLE_RANGES


#: the code points ``prompt_text`` removes (categories ``_STRIP_CATEGORIES`` but tab and
#: newline, and ``_IGNORABLE_RANGES``) as ranges, for the Unicode version ``_STRIP_UNICODE``
#: (Python 3.11's ``unicodedata``); under another version they are computed from
#: ``unicodedata`` once (``_strip_ranges``, ~0.4 s). tests/test_content.py checks the table
#: against the computation.
_STRIP_UNICODE = "14.0.0"
_STRIP_RANGES: tuple[tuple[int, int], ...] = (
    (0x0, 0x8), (0xB, 0x1F), (0x7F, 0x9F), (0xAD, 0xAD), (0x34F, 0x34F), (0x600, 0x605),
    (0x61C, 0x61C), (0x6DD, 0x6DD), (0x70F, 0x70F), (0x890, 0x891), (0x8E2, 0x8E2),
    (0x115F, 0x1160), (0x17B4, 0x17B5), (0x180B, 0x180F), (0x200B, 0x200F), (0x2028, 0x202E),
    (0x2060, 0x206F), (0x3164, 0x3164), (0xD800, 0xDFFF), (0xFE00, 0xFE0F), (0xFEFF, 0xFEFF),
    (0xFFA0, 0xFFA0), (0xFFF0, 0xFFFB), (0x110BD, 0x110BD), (0x110CD, 0x110CD),
    (0x13430, 0x13438), (0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A), (0xE0000, 0xE0FFF),
)
_strip_re: re.Pattern[str] | None = None


def _strip_ranges() -> list[tuple[int, int]]:
    """The code points of categories ``_STRIP_CATEGORIES`` but tab and newline, and those of
    ``_IGNORABLE_RANGES``, as sorted inclusive ranges, from this Python's ``unicodedata``
    (every code point: ~0.4 s)."""
    ignorable: set[int] = set()
    for a, b in _IGNORABLE_RANGES:
        ignorable.update(range(a, b + 1))
    out: list[tuple[int, int]] = []
    for c in range(sys.maxunicode + 1):
        if c not in (9, 10) and (c in ignorable or unicodedata.category(chr(c)) in _STRIP_CATEGORIES):
            if out and out[-1][1] == c - 1:
                out[-1] = (out[-1][0], c)
            else:
                out.append((c, c))
    return out


def _stripper() -> re.Pattern[str]:
    """One character class of every code point ``prompt_text`` removes: a removal in C,
    where a Python call per suspect character cost ~0.7 µs each (a MiB of control or
    non-ASCII characters: most of a second per scan, and a write is scanned more than once;
    bigbody, session 12)."""
    global _strip_re
    if _strip_re is None:
        ranges = _STRIP_RANGES if unicodedata.unidata_version == _STRIP_UNICODE else _strip_ranges()
        _strip_re = re.compile("[" + "".join(f"\\U{a:08x}-\\U{b:08x}" for a, b in ranges) + "]")
    return _strip_re


def prompt_text(text: str) -> str:
    """``text`` as the prompt block renders it: control characters (Cc, except tab and
    newline), Unicode format characters (Cf: zero-width, bidi controls, BOM, tag characters,
    ...), every other default-ignorable code point (``_IGNORABLE_RANGES``: variation
    selectors, the combining grapheme joiner, Hangul fillers, ...), line / paragraph
    separators and lone surrogates removed; ``\\r\\n`` becomes
    ``\\n`` (a lone ``\\r`` is removed like any control character).

    The one normalisation of the prompt block (``memfuse.server.context``) and of the secret
    detector (:func:`secret_view`), so that what the detector reads is what the model reads.
    Pure ASCII text costs one regex scan that finds nothing."""
    text = text.replace("\r\n", "\n")
    if _plain(text):
        return text
    return _stripper().sub("", text)


def _plain(text: str) -> bool:
    """``_SUSPECT_RE.search(text) is None`` (only tab, newline and printable ASCII: nothing
    for ``prompt_text`` to remove), ~4x cheaper for ASCII text than the regex's step per
    character: any non-ASCII character is suspect, and in ASCII what is left after deleting
    the plain bytes is."""
    return text.isascii() and not text.encode("ascii").translate(None, _PLAIN_BYTES)


#: non-ASCII characters that show as a blank or as nothing and that :func:`secret_view`
#: drops *between two token characters* (``\w`` or ``-``): the space separators (Unicode Zs)
#: other than U+0020 (no-break, en/em/thin/hair/figure, ideographic, ...), U+2800 (Braille
#: blank) and the combining marks of the BMP (Mn, Me: an accent over a token's letter), from
#: ``unicodedata`` on first use (``_gap_re``). NFKC would make the spaces an ASCII space,
#: which splits the token (attack17 F2); Hangul fillers are default-ignorable, gone already.
_GAP_SPACES = "\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000\u2800"
_gap_pattern: tuple[re.Pattern[str], re.Pattern[str]] | None = None


def _gap_re() -> tuple[re.Pattern[str], re.Pattern[str]]:
    """The patterns of one gap character (``_GAP_SPACES``, Mn, Me: a search in C, the test
    before the other) and of a run of them between two token characters; the Mn / Me
    ranges of the BMP from this Python's ``unicodedata``, once (~50 ms). BMP only: ``re``
    then tests a character in one table lookup (with the supplementary planes' ranges in
    the class, the search cost ~0.25 ms per 1.5 KiB note); the marks above are of historic
    scripts, and variation selectors, which ``prompt_text`` removes."""
    global _gap_pattern
    if _gap_pattern is None:
        ranges: list[tuple[int, int]] = []
        for c in range(0x300, 0x10000):
            if unicodedata.category(chr(c)) in ("Mn", "Me"):
                if ranges and ranges[-1][1] == c - 1:
                    ranges[-1] = (ranges[-1][0], c)
                else:
                    ranges.append((c, c))
        marks = "".join(f"\\U{a:08x}-\\U{b:08x}" for a, b in ranges)
        _gap_pattern = (re.compile("[" + _GAP_SPACES + marks + "]"),
                        re.compile(r"(?<=[\w-])[" + _GAP_SPACES + marks + r"]+(?=[\w-])"))
    return _gap_pattern


#: letters of other scripts that look like an ASCII letter, mapped to it by
#: :func:`secret_view` (a ``ghp_`` token with a Cyrillic ``р``, attack17 F2): the Cyrillic
#: and Greek rows of Unicode's confusables.txt whose skeleton is one ASCII letter, and
#: dotless i and script a / g. A table of our own, written down here: the libraries
#: (``confusable-homoglyphs``: a per-character Python lookup over a 2 MB JSON;
#: ``anyascii`` / ``unidecode``: transliteration, which reads Cyrillic ``р`` as ``r``, not
#: as the ``p`` it looks like) do not give a skeleton at ``str.translate``'s speed.
_CONFUSABLES = str.maketrans({
    # Cyrillic lower / upper case
    "а": "a", "в": "B", "е": "e", "ѕ": "s", "і": "i", "ј": "j", "о": "o", "р": "p", "с": "c",
    "у": "y", "х": "x", "һ": "h", "ԁ": "d", "ԛ": "q", "ԝ": "w", "ӏ": "l", "ɡ": "g", "ɑ": "a",
    "ı": "i", "А": "A", "В": "B", "Е": "E", "Ѕ": "S", "І": "I", "Ј": "J", "К": "K", "М": "M",
    "Н": "H", "О": "O", "Р": "P", "С": "C", "Т": "T", "У": "Y", "Х": "X", "Ү": "Y", "Ԛ": "Q",
    "Ԝ": "W", "Ӏ": "I",
    # Greek lower / upper case
    "α": "a", "ι": "i", "ν": "v", "ο": "o", "ρ": "p", "υ": "u", "Α": "A", "Β": "B", "Ε": "E",
    "Ζ": "Z", "Η": "H", "Ι": "I", "Κ": "K", "Μ": "M", "Ν": "N", "Ο": "O", "Ρ": "P", "Τ": "T",
    "Υ": "Y", "Χ": "X",
    # Armenian (confusables.txt rows whose skeleton is one ASCII letter; attack18 F1: ``ghp_``
    # with Armenian ``հ``)
    "հ": "h", "ո": "n", "ս": "u", "օ": "o", "ց": "g", "զ": "q", "Ս": "U", "Օ": "O",
    # punctuation look-alikes of the vendor prefixes' ``-`` and ``_`` (attack18 F1: an
    # ``sk-ant-api03-`` key with U+2011 / U+2212 for its hyphens): the hyphens and dashes
    # confusables.txt maps to ``-`` (U+2011 is U+2010 after NFKC), and the low lines it maps
    # to ``_`` that NFKC leaves (U+2017 is mapped before NFKC: ``_PRE_NFKC``)
    # (not the em dash and the horizontal bar: confusables.txt reads them as U+30FC, and prose
    # is full of them)
    "\u2010": "-", "\u2012": "-", "\u2013": "-", "\u2043": "-", "\u2212": "-", "\u02d7": "-",
    "\u058a": "-", "\u1806": "-", "\u06d4": "-", "\u2cba": "-", "\u2796": "-", "\u02cd": "_",
})

#: mapped before NFKC, which would turn them into something else (U+2017 DOUBLE LOW LINE
#: into a space and a combining mark, which splits a token)
_PRE_NFKC = str.maketrans({"\u2017": "_"})

_ANY_CONFUSABLE = re.compile("[" + "".join(chr(c) for c in _CONFUSABLES) + "]")


def _nfkc_view(text: str) -> str:
    """:func:`prompt_text`, then NFKC: the view before gaps and look-alikes (attack 15)."""
    out = prompt_text(text)
    if not out.isascii():
        out = unicodedata.normalize("NFKC", out)
    return out


def secret_view(text: str) -> str:
    """The text the secret rules read: :func:`prompt_text` (format characters gone, so a
    zero-width space inside a token does not hide it), then the blank-looking characters
    and combining marks between two token characters dropped (``_gap_re``: a no-break
    space, a Braille blank or an accent inside a token), then NFKC (full-width and other
    compatibility forms of ASCII, ``ｇｈｐ＿…``, read as ASCII, as a model reads them), then
    Cyrillic / Greek / Armenian look-alikes of ASCII letters, and look-alike hyphens and
    low lines, read as the ASCII character (``_CONFUSABLES``, ``_PRE_NFKC``).
    Keeps every newline (line numbers hold). Returns ``text`` itself (no copy) when nothing
    changes: ASCII text costs what :func:`prompt_text` costs."""
    out = prompt_text(text)
    if not out.isascii():
        any_gap, gaps = _gap_re()
        if any_gap.search(out) is not None:
            out = gaps.sub("", out)
        if "\u2017" in out:
            out = out.translate(_PRE_NFKC)
        out = unicodedata.normalize("NFKC", out)
        if not out.isascii() and _ANY_CONFUSABLE.search(out) is not None:
            out = out.translate(_CONFUSABLES)
    return out


#: one escaped sequence any parser of the text undoes (:func:`decoded_view`): JSON / Python
#: ``\uXXXX`` runs (surrogate pairs too), ``\xHH``, any other backslash escape (a stray
#: backslash, ``gh\p_``), percent-escape runs, HTML numeric and named character references
_ESCAPE_RE = re.compile(
    r"(?P<u>(?:\\u[0-9a-fA-F]{4})+)|\\x(?P<x>[0-9a-fA-F]{2})|\\(?P<c>[^\n])"
    r"|(?P<pct>(?:%[0-9a-fA-F]{2})+)|(?P<html>&(?:#[0-9]{1,7}|#[xX][0-9a-fA-F]{1,6}|[A-Za-z][A-Za-z0-9]{1,31});?)")
_JSON_WHITESPACE = {"n": " ", "t": " ", "r": " ", "b": " ", "f": " "}
#: line ends a decoded escape may produce: read as a space (line numbers hold)
_LINE_ENDS = re.compile("[\n\r\x0b\x0c\x1c-\x1e\x85\u2028\u2029]")


def _unescape(m: re.Match[str]) -> str:
    """The text one ``_ESCAPE_RE`` match stands for, line ends read as spaces."""
    if (u := m.group("u")) is not None:
        out = u.encode("ascii").decode("unicode_escape").encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    elif (x := m.group("x")) is not None:
        out = chr(int(x, 16))
    elif (c := m.group("c")) is not None:
        out = _JSON_WHITESPACE.get(c, c)
    elif (pct := m.group("pct")) is not None:
        out = bytes.fromhex(pct.replace("%", "")).decode("utf-8", "replace")
    else:
        out = html.unescape(m.group("html"))
    return _LINE_ENDS.sub(" ", out)


def decoded_view(view: str) -> str:
    """``view`` (a :func:`secret_view`) with the escapes any parser undoes decoded
    (``_ESCAPE_RE``: JSON ``"\\u0067hp_…"``, ``%67hp_…``, ``&#103;hp_…``, ``gh\\p_…``), one
    level, then :func:`secret_view` again; the same lines (a decoded line end is a space).
    ``view`` itself when it holds no ``\\``, ``%`` or ``&`` (three ``memchr``). Linear: one
    regex pass, a Python call per escape run (~1 µs)."""
    if "\\" not in view and "%" not in view and "&" not in view:
        return view
    return secret_view(_ESCAPE_RE.sub(_unescape, view))


#: the Markdown / HTML :func:`markup_view` may drop, wherever it stands (:func:`scan_floor`)
_MARKUP_ANYWHERE = re.compile(r"[*~]+|<!--[^\n]*?-->")


def _floor_text(text: str) -> str:
    """``text`` with everything some view of the secret rules may remove taken out, in any
    context (:func:`scan_floor`)."""
    out = prompt_text(text)
    if not out.isascii():
        out = _gap_re()[0].sub("", out)  # gaps, wherever they stand (not only between tokens)
    return out


def scan_floor(text: str) -> int:
    """A lower bound of the UTF-8 bytes that ``text``, as a part of a larger text, adds to any
    view the secret rules read of it (:func:`find_secret`: :func:`secret_view`, its rendered
    views, :func:`decoded_view`): its bytes with everything a view may remove taken out
    wherever it stands, not only where the view removes it: what :func:`prompt_text` removes
    (format and default-ignorable characters, controls), the gap characters (``_gap_re``:
    non-ASCII spaces, Braille blank, combining marks), Markdown emphasis and one-line HTML
    comments (``_MARKUP_SPLIT``), escapes read as what they decode to (``_ESCAPE_RE``).

    For a window of context around a write (``memfuse.sidecar.writecheck``): a window whose
    context holds N bytes by this measure holds N bytes of every view, so padding made of
    what a view removes (a run of zero-width spaces inside a token: attack21 F3) does not
    push a token's start out of it. Ordinary ASCII text without ``*``, ``~``, ``<!--``,
    ``\\``, ``%`` or ``&`` costs what :func:`prompt_text` costs and measures its length."""
    out = _floor_text(text)
    if "\\" in out or "%" in out or "&" in out:
        out = _floor_text(_ESCAPE_RE.sub(_unescape, out))
    if "*" in out or "~" in out or "<!--" in out:
        out = _MARKUP_ANYWHERE.sub("", out)
    return len(out) if out.isascii() else len(out.encode("utf-8", "surrogatepass"))


#: a run that may be a base64 / base64url (27+: a 20-character token is 27 characters and a
#: ``=``, attack18 F4) or hex (40+) encoding
_ENCODED_RUN = re.compile(r"(?<![A-Za-z0-9+/_-])[A-Za-z0-9+/_-]{27,}={0,2}")
_HEX_RUN = re.compile(r"(?:[0-9a-fA-F]{2}){20,}")
_ROT13 = bytes.maketrans(
    b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz",
    b"NOPQRSTUVWXYZABCDEFGHIJKLMnopqrstuvwxyzabcdefghijklm")


#: the bytes of a text with each base64 / hex character as ``a``, any other byte a space
_RUN_CHARS = bytes(0x61 if chr(b) in string.ascii_letters + string.digits + "+/_-" else 0x20 for b in range(256))


def _has_run(view: str) -> bool:
    """Whether ``view`` holds a run ``_ENCODED_RUN`` would find (27 base64 characters in a
    row): a ``bytes.translate`` and one search in C, ~20x cheaper than the regex's step per
    character over ordinary text, where it finds none."""
    return b"a" * 27 in view.encode("utf-8", "surrogatepass").translate(_RUN_CHARS)


def _run_decoded(run: str) -> str:
    """The text a base64 / base64url / hex run decodes to (UTF-8, errors replaced); ""
    when it is none of them."""
    try:
        if len(run) % 2 == 0 and _HEX_RUN.fullmatch(run):
            raw = bytes.fromhex(run)
        else:
            body = run.rstrip("=")
            alt = b"-_" if ("-" in body or "_" in body) else None
            if alt is not None and ("+" in body or "/" in body):
                return ""
            raw = base64.b64decode(body + "=" * (-len(body) % 4), altchars=alt)
    except (ValueError, binascii.Error):
        return ""
    return raw.decode("utf-8", "replace")


def _encoded_secret(view: str) -> str | None:
    """The reason for a secret in a form a parser or one command decodes from ``view`` (a
    :func:`secret_view`): escapes (:func:`decoded_view`), base64 / hex runs (each decoded,
    scanned together, one per line of a text of their own), rot13; or None. The reason
    names the form (``GitHub token (base64) on line 2``), never the secret."""
    dec = decoded_view(view)
    if dec is not view and dec != view:
        found = _first_secret(dec)
        if found is not None:
            return _secret_reason(found, dec, "escaped")
    runs = [m for m in _ENCODED_RUN.finditer(view)] if _has_run(view) else []
    if runs:
        texts = [_run_decoded(m.group()) for m in runs]
        joined = "\n".join(texts)
        found = _first_secret(joined)  # a decoded token is ASCII: no view (garbage costs none)
        if found is not None:
            ends = list(itertools.accumulate(len(t) + 1 for t in texts))
            run = runs[bisect.bisect_right(ends, found[1].start())]
            line = view.count("\n", 0, run.start()) + 1
            return f"{found[0].kind} (base64 or hex) on line {line}"
    for sep, hs in _ROT13_GATED:
        if sep in view and any(h in view for h in hs):
            break
    else:
        return None
    rot = (view.encode("ascii").translate(_ROT13).decode("ascii") if view.isascii()
           else codecs.encode(view, "rot13"))
    present = _hints(rot, rot.lower()) & _ROT13_HINTS
    found = _first_secret(rot, present=present) if present else None
    if found is not None:
        return _secret_reason(found, rot, "rot13")
    return None


# ---------------------------------------------------------------- secrets


def _placeholder(s: str) -> bool:
    """A value that is obviously not a real credential: repetitive (``xxxx``, ``0000``,
    ``abab``), or marked as an example."""
    if len(set(s)) < 6:
        return True
    upper = s.upper()
    return any(w in upper for w in ("EXAMPLE", "XXXXXX", "PLACEHOLDER", "ABCDEFGH", "12345678"))


def _mixed(s: str) -> bool:
    """Random base62/base64 of 20+ characters: has upper case, lower case and digits."""
    return (
        any(c.isupper() for c in s) and any(c.islower() for c in s) and any(c.isdigit() for c in s)
    )


_WORDCHAR = re.compile(r"[A-Za-z0-9_]")
_B64_RUN = re.compile(r"[A-Za-z0-9+/]{40,}")
_PEM_HEADER_LINE = re.compile(r"[ \t]*[A-Za-z][A-Za-z0-9-]*:[^\n]*\n")


def _standalone(m: re.Match[str], text: str, extra: str = "") -> bool:
    """No word character (or one of ``extra``) right before or after the match."""
    before = text[m.start() - 1] if m.start() > 0 else ""
    after = text[m.end()] if m.end() < len(text) else ""
    for ch in (before, after):
        if ch and (_WORDCHAR.match(ch) or ch in extra):
            return False
    return True


def _pem_body_follows(m: re.Match[str], text: str) -> bool:
    """After a ``BEGIN ... PRIVATE KEY`` line: optional ``Name: value`` header lines (PGP,
    encrypted PEM), then at once a run of 40+ base64 characters that is not a placeholder.
    Newlines may be real or written as ``\\n`` (a key inside a JSON string)."""
    window = text[m.end() : m.end() + 1200].replace("\\r", "").replace("\\n", "\n").replace("\r", "")
    pos = 0
    n = len(window)
    while True:
        while pos < n and window[pos] in " \t\n":
            pos += 1
        hm = _PEM_HEADER_LINE.match(window, pos)
        if hm is None:
            break
        pos = hm.end()
    body = _B64_RUN.match(window, pos)
    return body is not None and not _placeholder(body.group())


def _classes(s: str) -> int:
    """How many of upper case, lower case and digits ``s`` has (0-3)."""
    return (any(c.isupper() for c in s) + any(c.islower() for c in s)
            + any(c.isdigit() for c in s))


def _group_random(
    group: int, *, mixed: bool = False, classes: int = 0, extra: str = "", standalone: bool = True
) -> Callable[[re.Match[str], str], bool]:
    """A check: group ``group`` is not a placeholder (and, with ``mixed``, has upper case,
    lower case and digits; with ``classes``, at least that many of the three); with
    ``standalone``, the match is not part of a longer word."""

    def check(m: re.Match[str], text: str) -> bool:
        s = m.group(group)
        if _placeholder(s):
            return False
        if mixed and not _mixed(s):
            return False
        if classes and _classes(s) < classes:
            return False
        return not standalone or _standalone(m, text, extra)

    return check


# Values that stand for a password in documentation, not one (compared lower-cased).
_FAKE_PASSWORDS = frozenset((
    "password", "passwd", "pass", "secret", "changeme", "change_me", "example", "redacted",
    "hidden", "none", "null", "true", "false", "required", "optional", "string", "str",
    "pwd", "mypassword", "yourpassword", "your_password", "my_password", "p@ssw0rd",
    "password123", "admin", "root", "test", "testing", "user", "username", "dummy", "foobar",
    "hunter2", "letmein", "qwerty", "secret123", "postgres", "mysql", "guest", "notasecret",
))
_REFERENCE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
_TEMPLATE_CHARS = frozenset("<>{}$%()[]*\\|")


_PERCENT_HEX = re.compile(r"%[0-9A-Fa-f]{2}")


def _percent_char(m: re.Match[str]) -> str:
    """One URL escape ``%HH`` as the character it stands for (a byte above 0x7f as U+FFFD:
    only whether the password is a template or a placeholder is asked of it)."""
    b = int(m.group()[1:], 16)
    return chr(b) if b < 0x80 else "\ufffd"


def _real_password(value: str, assignment: bool = False) -> bool:
    """Whether ``value`` (after ``password =``, or in ``user:value@`` of a URL) looks like a
    real password rather than a placeholder (``<password>``, ``${DB_PASSWORD}``, ``****``,
    ``changeme``, ``xxxxxx``), a reference (``os.environ…``, ``self.password``,
    ``getpass()``), or, after a keyword in prose, a plain word (``password: required``)."""
    v = value.strip().rstrip(".")
    if not v or _TEMPLATE_CHARS.intersection(v) or v.lower() in _FAKE_PASSWORDS:
        return False
    if len(set(v.lower())) < 3 or "xxx" in v.lower() or "example" in v.lower():
        return False
    if assignment:
        if v.isalpha() and (v.islower() or v.istitle()):
            return False  # a word: "password: required", "password = Optional"
        if v.isdigit() or _REFERENCE.fullmatch(v) or v.endswith(":"):
            return False  # a number ("min_password = 12"), an attribute, a label
    return not v.isdigit()


def _b64url_json(seg: str) -> object:
    raw = base64.urlsafe_b64decode(seg + "=" * (-len(seg) % 4))
    return json.loads(raw.decode("utf-8"))


def _jwt(m: re.Match[str], text: str) -> bool:
    """Three base64url segments whose first two decode to JSON objects, the header with an
    ``alg``; and a signature that is not a placeholder."""
    before = text[m.start() - 1] if m.start() > 0 else ""
    after = text[m.end()] if m.end() < len(text) else ""
    if (before and (_WORDCHAR.match(before) or before in "-.")) or (after and (_WORDCHAR.match(after) or after == "-")):
        return False
    head, payload, sig = m.group(0).split(".")
    try:
        h = _b64url_json(head)
        p = _b64url_json(payload)
    except (binascii.Error, ValueError, UnicodeDecodeError):
        return False
    return isinstance(h, dict) and "alg" in h and isinstance(p, dict) and not _placeholder(sig)


@dataclass(frozen=True)
class _Rule:
    kind: str
    pattern: re.Pattern[str]
    check: Callable[[re.Match[str], str], bool]
    #: literals one of which every match holds: the rule's regex runs only on a text that
    #: holds one (``str.__contains__`` is ~10x faster than a regex scan for no match);
    #: with ``lower``, lower-case literals one of which every match *starts with*, found in
    #: the lower-cased text, where the (case-insensitive) regex is then tried alone: a
    #: case-insensitive scan tried at every position costs ~0.5 s per MiB
    hints: tuple[str, ...] = ()
    lower: bool = False


_SEP = r"[_.\-]?"
_ASSIGN = r"""["']?\s*(?::=|=>|[:=])\s*["']?"""

# Order matters only for the reason given when one secret matches several rules (the more
# specific kind first): GCP's JSON key before the generic private key, Anthropic before OpenAI.
_RULES: tuple[_Rule, ...] = (
    _Rule(
        "GCP service-account private key",
        re.compile(r'"private_key"\s*:\s*"-----BEGIN [A-Z0-9 ]{0,30}PRIVATE KEY-----'),
        _pem_body_follows,
        ("\"private_key\"",),
    ),
    _Rule(
        "private key",
        re.compile(r"-----BEGIN (?:[A-Z0-9]+ ){0,3}PRIVATE KEY(?: BLOCK)?-----"),
        _pem_body_follows,
        ("PRIVATE KEY",),
    ),
    _Rule(
        "private key (PuTTY)",
        re.compile(r"PuTTY-User-Key-File-[23]: [^\n]+\n(?:[^\n]*\n){0,40}?Private-Lines: \d+\n([A-Za-z0-9+/=]{40,})"),
        _group_random(1),
        ("PuTTY-User-Key-File-",),
    ),
    _Rule(
        "AWS access key id",
        re.compile(r"(?:AKIA|ASIA|ABIA|ACCA|A3T[A-Z0-9])([A-Z0-9]{16})"),
        _group_random(1),
        ("AKIA", "ASIA", "ABIA", "ACCA", "A3T"),
    ),
    _Rule(
        "AWS secret access key",
        re.compile(
            rf"(?i:aws{_SEP}secret{_SEP}(?:access{_SEP})?key|secret{_SEP}access{_SEP}key|aws{_SEP}secret)"
            rf"{_ASSIGN}([A-Za-z0-9/+]{{40}})(?![A-Za-z0-9/+=])"
        ),
        _group_random(1, mixed=True, standalone=False),
        ("aws", "secret"), True,
    ),
    _Rule(
        "GCP API key",
        re.compile(r"AIza([0-9A-Za-z_\-]{35})"),
        _group_random(1, extra="-"),
        ("AIza",),
    ),
    _Rule(
        "GCP OAuth client secret",
        re.compile(r"GOCSPX-([A-Za-z0-9_\-]{28})"),
        _group_random(1, extra="-"),
        ("GOCSPX-",),
    ),
    _Rule(
        "Azure storage or service-bus key",
        re.compile(r"(?i:AccountKey|SharedAccessKey)\s*=\s*([A-Za-z0-9+/]{40,}={0,2})(?![A-Za-z0-9+/=])"),
        _group_random(1, mixed=True, standalone=False),
        ("accountkey", "sharedaccesskey"), True,
    ),
    _Rule(
        "GitHub token",
        re.compile(r"gh[pousr]_([A-Za-z0-9]{36,251})"),
        _group_random(1),
        ("ghp_", "gho_", "ghu_", "ghs_", "ghr_"),
    ),
    _Rule(
        "GitHub fine-grained token",
        re.compile(r"github_pat_([A-Za-z0-9_]{50,251})"),
        _group_random(1),
        ("github_pat_",),
    ),
    _Rule(
        "GitLab token",
        re.compile(r"(?:glpat|gldt|glrt|glft|glsoat|glptt|glcbt|glimt|gloas)-([A-Za-z0-9_\-.]{20,255})"),
        _group_random(1, extra="-."),
        ("glpat-", "gldt-", "glrt-", "glft-", "glsoat-", "glptt-", "glcbt-", "glimt-", "gloas-"),
    ),
    _Rule(
        "GitLab runner registration token",
        re.compile(r"GR1348941([A-Za-z0-9_\-]{20,50})"),
        _group_random(1, extra="-"),
        ("GR1348941",),
    ),
    _Rule(
        "Slack token",
        re.compile(r"xox[abposre]-((?:[0-9]+-)+[A-Za-z0-9]{10,}(?:-[A-Za-z0-9]+)*)"),
        _group_random(1, extra="-"),
        ("xox",),
    ),
    _Rule(
        "Slack app token",
        re.compile(r"xapp-[0-9]+-([A-Z0-9]+-[0-9]+-[A-Za-z0-9]{20,})"),
        _group_random(1, extra="-"),
        ("xapp-",),
    ),
    _Rule(
        "Slack webhook URL",
        re.compile(r"https://hooks\.slack\.com/(?:services|workflows|triggers)/(T[A-Z0-9_]+/[A-Z0-9_]+/([A-Za-z0-9_]{16,}))"),
        _group_random(2),
        ("hooks.slack.com",),
    ),
    _Rule(
        "Anthropic API key",
        re.compile(r"sk-ant-[a-z]{2,10}[0-9]{0,3}-([A-Za-z0-9_\-]{32,})"),
        _group_random(1, mixed=True, extra="-"),
        ("sk-ant-",),
    ),
    _Rule(
        "OpenAI API key",
        re.compile(r"sk-(?:(?:proj|svcacct|admin)-([A-Za-z0-9_\-]{40,})|([A-Za-z0-9]{32,}))"),
        lambda m, text: _group_random(1 if m.group(1) else 2, mixed=True, extra="-")(m, text),
        ("sk-",),
    ),
    _Rule(
        "memfuse token",
        # memfuse's own bearer tokens: mf_ (made by the API), mfa_ / mfw_ (admin and workspace
        # tokens of `memfuse dev` / `serve`), each + secrets.token_urlsafe(32): 43 base64url
        re.compile(r"mf[aw]?_([A-Za-z0-9_\-]{43})(?![A-Za-z0-9_\-])"),
        _group_random(1, classes=2),
        ("mf_", "mfa_", "mfw_"),
    ),
    _Rule(
        "Stripe key",
        # detect-secrets StripeDetector / gitleaks stripe-access-token: secret and restricted
        # keys, live and test (a test key still opens the account's test data)
        re.compile(r"(?:sk|rk)_(?:live|test|prod)_([0-9A-Za-z]{24,247})"),
        _group_random(1, classes=2),
        ("sk_", "rk_"),
    ),
    _Rule(
        "npm token",
        # gitleaks npm-access-token (detect-secrets finds only .npmrc _authToken lines)
        re.compile(r"npm_([A-Za-z0-9]{36})(?![A-Za-z0-9])"),
        _group_random(1, classes=2),
        ("npm_",),
    ),
    _Rule(
        "PyPI token",
        # detect-secrets PypiTokenDetector: a macaroon for pypi.org / test.pypi.org
        re.compile(r"pypi-(?:AgEIcHlwaS5vcmc|AgENdGVzdC5weXBpLm9yZw)([A-Za-z0-9_\-]{50,})"),
        _group_random(1, standalone=False),
        ("pypi-",),
    ),
    _Rule(
        "Hugging Face token",
        # gitleaks huggingface-access-token / -organization-api-token
        re.compile(r"(?:hf_|api_org_)([A-Za-z]{34})(?![A-Za-z0-9_])"),
        _group_random(1, classes=2),
        ("hf_", "api_org_"),
    ),
    _Rule(
        "SendGrid API key",
        # detect-secrets SendGridDetector
        re.compile(r"SG\.([A-Za-z0-9_\-]{22}\.[A-Za-z0-9_\-]{43})(?![A-Za-z0-9_\-])"),
        _group_random(1, classes=2),
        ("SG.",),
    ),
    _Rule(
        "Twilio API key",
        # gitleaks twilio-api-key (an API key SID and its secret come together; the SID is
        # what gives it away); detect-secrets TwilioKeyDetector also flags AC (account) SIDs,
        # which are identifiers, not secrets
        re.compile(r"SK([0-9a-fA-F]{32})(?![0-9A-Za-z])"),
        _group_random(1),
        ("SK",),
    ),
    _Rule(
        "DigitalOcean token",
        # gitleaks digitalocean-pat / -access-token / -refresh-token
        re.compile(r"do[opr]_v1_([a-f0-9]{64})(?![A-Za-z0-9])"),
        _group_random(1),
        ("dop_v1_", "doo_v1_", "dor_v1_"),
    ),
    _Rule(
        "Google OAuth access token",
        # gitleaks gcp-api-key's sibling for OAuth 2 access tokens (ya29.)
        re.compile(r"ya29\.([0-9A-Za-z_\-]{30,})"),
        _group_random(1, classes=2, extra="."),
        ("ya29.",),
    ),
    _Rule(
        "URL with a password",
        # detect-secrets BasicAuthDetector: user:password@ in any URL (database URLs first of
        # all: postgresql://app:…@db/app); templated or placeholder passwords pass
        # (an empty user too: Redis's redis://:password@host; a password's %XX escapes are
        # read decoded, not as a %(name)s template: attack18 F3)
        re.compile(r"://([^\s:/?#\[\]@'\"`<>]{0,128}):([^\s/?#\[\]@'\"`<>]{1,256})@[A-Za-z0-9\[]"),
        lambda m, text: _real_password(_PERCENT_HEX.sub(_percent_char, m.group(2))),
        ("://",),
    ),
    _Rule(
        "password assignment",
        # detect-secrets KeywordDetector, narrowed for prose: a key ending in password /
        # passwd / passphrase, then = or :, then one literal value that looks like a password
        # (not a word, a reference, a template or a placeholder)
        re.compile(r"(?i:password|passwd|passphrase)[\"'\]]{0,2}\s*(?::=|=>|[:=])\s*[\"'`]?"
                   r"([^\s\"'`,;]{6,128})"),
        lambda m, text: _real_password(m.group(1), assignment=True),
        ("password", "passwd", "passphrase"), True,
    ),
    _Rule(
        "secret assignment",
        # detect-secrets KeywordDetector's other keys (secret, api_key, access token...),
        # with a value that looks random, 16+ characters
        re.compile(r"(?i:secret|secret[_\-]?key|api[_\-]?key|access[_\-]?token|auth[_\-]?token|private[_\-]?key)"
                   r"[\"'\]]{0,2}\s*(?::=|=>|[:=])\s*[\"'`]?([A-Za-z0-9_\-+/.]{16,256}+={0,2})(?![A-Za-z0-9_\-+/=.])"),
        _group_random(1, classes=3, standalone=False),
        ("secret", "api", "access", "auth", "private"), True,
    ),
    _Rule(
        "JSON Web Token",
        re.compile(r"eyJ[A-Za-z0-9_\-]{10,}\.[A-Za-z0-9_\-]{10,}\.[A-Za-z0-9_\-]{16,}"),
        _jwt,
        ("eyJ",),
    ),
)

#: Every kind of secret :func:`find_secret` can report.
SECRET_KINDS: tuple[str, ...] = tuple(r.kind for r in _RULES)


_ANCHORS = {r.kind: re.compile("|".join(re.escape(h) for h in r.hints)) for r in _RULES if r.lower}


def _matches(rule: _Rule, content: str, low: str | None) -> Iterator[re.Match[str]]:
    """The candidate matches of ``rule`` in ``content`` (``low``: its lower-cased text)."""
    if rule.lower and low is not None and len(low) == len(content):
        for a in _ANCHORS[rule.kind].finditer(low):
            m = rule.pattern.match(content, a.start())
            if m is not None:
                yield m
        return
    yield from rule.pattern.finditer(content)


#: a hint as ``_first_secret`` looks for it: (looked for in the lower-cased text, the literal)
Hint = tuple[bool, str]
#: the characters of ordinary text, most frequent first (space, newline, English letters): a
#: hint's *gate* is its character latest in this order, or one not in it at all (upper
#: case, a digit, punctuation), so rarely in a text that holds no hint
_COMMON_CHARS = " \netaoinsrhldcumfpgwybvkxjqz"


def _gate(hint: str) -> str:
    """The character of ``hint`` least likely in ordinary text (``_COMMON_CHARS``)."""
    return max(hint, key=lambda ch: _COMMON_CHARS.find(ch) if ch in _COMMON_CHARS else len(_COMMON_CHARS))


#: every hint once, grouped by gate: ((gate, ((hint, (lower, hint)), ...)), ...) for the
#: hints looked for in the text as written, then for those looked for in the lower-cased
#: text. ``gate in text`` is one ``memchr``, and a hint is in a text only if each of its
#: characters is, so a hint is looked for only where its gate is: the same answer as ``hint
#: in text`` for each (a search of 60 hints through a note, one Python step each, was most of
#: a create's secret scans: bench/README.md, "The close path, session 15: serve's writer")
_GATED: tuple[tuple[tuple[str, tuple[tuple[str, Hint], ...]], ...], ...] = tuple(
    tuple((g, tuple((h, (lower, h)) for h in hs if _gate(h) == g))
          for g in dict.fromkeys(_gate(h) for h in hs))
    for lower in (False, True)
    for hs in [tuple(dict.fromkeys(h for r in _RULES if r.lower == lower for h in r.hints))])
#: the indexes in ``_RULES`` of the rules that have each hint
_RULES_OF: dict[Hint, tuple[int, ...]] = {
    hint: tuple(i for i, r in enumerate(_RULES) if r.lower == hint[0] and hint[1] in r.hints)
    for group in _GATED for _, gated in group for _, hint in gated}
_NO_HINTS: frozenset[Hint] = frozenset()

#: the hints looked for in a text's rot13: the vendor prefixes (``ghp_``, ``AKIA``, ...),
#: not the generic ones (``://``, ``password =``), which rot13 of ordinary text forms
#: (``USER:PASSWORD@HOST`` in docs/DEPLOY.md rot13'd reads as a real password)
_ROT13_HINTS: frozenset[Hint] = frozenset(
    (r.lower, h) for r in _RULES if not r.lower and r.kind != "URL with a password" for h in r.hints)
#: those of them with a ``_`` or ``-`` (``ghp_``, ``sk-ant-``, ``GOCSPX-``: rot13 keeps
#: both) rot13'd, by that character: the cheap test (a ``memchr``, then an ``in`` per hint)
#: before a text is rot13'd and scanned. The others (``AKIA``, ``eyJ``, ``SK``) are not
#: looked for in rot13: their rot13 (``NXVN``) is common enough in ordinary text that the
#: test would cost a scan more often
_ROT13_GATED: tuple[tuple[str, tuple[str, ...]], ...] = tuple(
    (sep, tuple(sorted({codecs.encode(h, "rot13") for _, h in _ROT13_HINTS if sep in h
                        and (sep == "_" or "_" not in h)})))
    for sep in ("_", "-"))


def _hints(content: str, low: str) -> frozenset[Hint]:
    """``hints_in(content)``, given ``low = content.lower()``."""
    found: list[Hint] | None = None
    for text, group in ((content, _GATED[0]), (low, _GATED[1])):
        for g, gated in group:
            if g in text:
                for h, hint in gated:
                    if h in text:
                        if found is None:
                            found = []
                        found.append(hint)
    return _NO_HINTS if found is None else frozenset(found)


def _first_secret(content: str, in_name: bool = False,
                  present: frozenset[Hint] | None = None) -> tuple[_Rule, re.Match[str]] | None:
    """The first rule (in ``_RULES`` order) with a match in ``content`` that passes its
    check, and the match; None. ``present``: the hints known to occur in ``content`` (a
    superset: ``hints_in``), instead of looking for each one here. Only the rules with a
    hint in the text run (``_Rule.hints``: the others cannot match)."""
    low = content.lower()  # a rule with ``lower`` looks for its hints in it
    if present is None:
        present = _hints(content, low)
    if not present:
        return None
    for i in sorted({i for hint in present for i in _RULES_OF.get(hint, ())}):
        rule = _RULES[i]
        for m in _matches(rule, content, low):
            if rule.check(m, content) and (not in_name or _name_check(rule, m)):
                return rule, m
    return None


_AWS_ID_IN_NAME = re.compile(r"[A-Z2-7]*[2-7][A-Z2-7]*")


def _name_check(rule: _Rule, m: re.Match[str]) -> bool:
    """The one rule tightened for names: an AWS access key id's 16 characters are base32
    (``A-Z``, ``2-7``, as AWS issues them) with at least one digit, so an upper-case name
    such as ``ASIAPACIFICOVERVIEW.md`` or ``ASIAPACIFICSALES2025.md`` is not a key (about
    4 % of real key ids have no digit and pass in a name; content is checked as before)."""
    if rule.kind == "AWS access key id":
        return _AWS_ID_IN_NAME.fullmatch(m.group(1)) is not None
    return True


def find_secret(content: str) -> str | None:
    """Return a short reason naming the first kind of secret found in ``content`` and its
    line (``"GitHub token on line 3"``), or None. The reason never holds the secret.

    Linear in the length of ``content`` (one regex scan per rule, nearly all anchored on a
    literal prefix): about 50 ms per MiB of ordinary text, under 150 ms per MiB for the
    adversarial inputs in the tests.
    """
    return _find(content, _RLO in content)


def _find(content: str, rlo: bool) -> str | None:
    """``find_secret(content)``, each line also read reversed when ``rlo`` (the text held a
    right-to-left override: ``_rendered_views``)."""
    view = secret_view(content)
    found = _first_secret(view)
    if found is None:
        # the text as the prompt shows it before gaps and look-alikes, and as written (the
        # views can also join two words)
        for alt in (_nfkc_view(content), content):
            if alt != view:
                found = _first_secret(alt)
                if found is not None:
                    view = alt
                    break
    if found is None:
        for alt in _rendered_views(view, rlo):
            found = _first_secret(alt)
            if found is not None:
                view = alt
                break
    return _encoded_secret(view) if found is None else _secret_reason(found, view)


_RLO = "\u202e"

#: Markdown / HTML that a rendered view (the console) draws as nothing *between two token
#: characters*, so a token split by it shows whole (attack18 F2): an HTML comment on one
#: line, ``*`` / ``**`` / ``***`` (emphasis: ``ghp_AB**CD**`` draws ``ghp_AB`` and a bold
#: ``CD``) and ``~~`` (strike-through). Dropped only there, so prose keeps its words apart
#: (``a * b``, ``x*y`` in code joins two words, which no secret rule reads as a secret
#: unless the two halves are one: the prose corpus of tests/test_secret_corpus.py holds)
#: (written to start with a character class: the search skips to a ``*``, ``~`` or ``<`` at
#: C speed, then looks behind; ~50 ms per MiB of Markdown dense with them, 5x the plain form)
#: The first marker and the run after it are atomic (the run a possessive repetition whose
#: alternatives start with different characters; a comment ends at its first ``-->``, as
#: HTML's and CommonMark's do, not at a later one the former lazy group reached): a
#: run of n markers not followed by a token character fails in O(n), where the former
#: ``(?:\*{1,3}|...)*`` tried every way to cut it in ones, twos and threes (exponential:
#: ``a`` and 30 ``*`` took 5 s, one more ``*`` ~1.7x that; session 21).
_MARKUP_SPLIT = re.compile(r"[*~<](?<=[\w-][*~<])(?>(?<=\*)|(?<=~)~|(?<=<)!--[^\n]*?-->)"
                           r"(?>\*|~~|<!--[^\n]*?-->)*+(?=[\w-])")


def markup_view(view: str) -> str:
    """``view`` with the Markdown / HTML a renderer draws as nothing removed where it sits
    between two token characters (``_MARKUP_SPLIT``); ``view`` itself when it holds no
    ``*``, ``~`` or ``<!--``. The same lines."""
    if "*" not in view and "~" not in view and "<!--" not in view:
        return view
    return _MARKUP_SPLIT.sub("", view)


def _reversed_lines(view: str) -> str:
    """Each line of ``view`` reversed (the lines keep their numbers)."""
    return "\n".join(line[::-1] for line in view.split("\n"))


def _rendered_views(view: str, rlo: bool) -> Iterator[str]:
    """The views of ``view`` (a :func:`secret_view`) as a renderer may draw it, other than
    ``view`` itself, in the order the rules read them: each line reversed when the text held
    U+202E RIGHT-TO-LEFT OVERRIDE (``rlo``: it draws what follows it on its line in reverse
    order, so a token written backwards after it shows as the token in a browser or an
    editor, attack18 F2; the view has the override removed already), then the Markdown /
    HTML view (:func:`markup_view`). The one list :func:`find_secret`,
    :func:`find_secret_in_view` and :func:`redact_secrets` read."""
    if rlo:
        yield _reversed_lines(view)
    md = markup_view(view)
    if md is not view and md != view:
        yield md


#: at most this many secrets are cut out of one text by :func:`redact_secrets`; past it the
#: whole text is replaced (a text made of secrets says nothing else worth keeping)
REDACT_MAX = 64


def redact_secrets(text: str) -> str:
    """``text`` with every secret the content rules find (:func:`find_secret`) cut to its
    first four characters (the vendor prefix, ``ghp_``) and ``[REDACTED]``: for untrusted
    text memfuse keeps but does not refuse (a consolidation model's summary). Returns
    ``text`` itself when it holds none. The matches are found in the text as a prompt shows
    it (:func:`secret_view`), so a text that held a secret comes back in that view (format
    characters removed, NFKC); one found only as a renderer draws the text
    (``_rendered_views``: reversed after a right-to-left override, split by Markdown) is cut
    in that drawing, and its line comes back as drawn. More than :data:`REDACT_MAX`
    secrets: one line saying so. Linear per secret found (one :func:`find_secret` scan
    each)."""
    rlo = _RLO in text
    if _find(text, rlo) is None:
        return text
    view = secret_view(text)
    for _ in range(REDACT_MAX):
        found = _first_secret(view)
        if found is not None:
            view = _redact_at(view, found[1])
            continue
        for alt in _rendered_views(view, rlo):
            found = _first_secret(alt)
            if found is not None:
                view = _redact_rendered(view, alt, found[1], rlo)
                break
        if found is None:
            if _find(view, rlo) is None:
                return view
            # a secret only in an encoded form (base64, escapes, rot13) or only in the
            # text as written: no span of the view to cut
            return "[REDACTED: the text held a secret in a form not cut out]"
    return "[REDACTED: the text held more than %d secrets]" % REDACT_MAX


def _redact_rendered(view: str, alt: str, m: re.Match[str], rlo: bool) -> str:
    """``view`` with the secret found at ``m`` in ``alt`` (one of ``_rendered_views(view,
    rlo)``) cut: in the reversed view, its span on its line of ``view`` replaced by
    :data:`REDACTED` (the vendor prefix is not kept: it reads backwards there); in the
    markup view, its line replaced by that line of ``alt`` with the secret cut to its first
    four characters. The other lines as they were."""
    line = alt.count("\n", 0, m.start())
    lines = view.split("\n")
    if rlo and alt == _reversed_lines(view):
        start = alt.rfind("\n", 0, m.start()) + 1  # the line's start in alt
        text = lines[line]
        a, b = m.start() - start, min(m.end() - start, len(text))
        lines[line] = text[: len(text) - b] + REDACTED + text[len(text) - a :]
    else:
        lines[line] = _redact_at(alt, m).split("\n")[line]
    return "\n".join(lines)


def _secret_reason(found: tuple[_Rule, re.Match[str]], view: str, form: str = "") -> str:
    """``find_secret``'s reason for a match ``found`` in ``view``: the kind, the ``form`` it
    was found in (``escaped``, ``rot13``) if any, and its line."""
    rule, m = found
    kind = f"{rule.kind} ({form})" if form else rule.kind
    return f"{kind} on line {view.count(chr(10), 0, m.start()) + 1}"


#: the longest hint, in characters: an occurrence of a hint that ends in an appended suffix
#: starts at most this many characters minus one before it (``memfuse.secretscan``)
HINT_MAX_CHARS = max(len(h) for r in _RULES for h in r.hints)


def hints_in(text: str) -> frozenset[Hint]:
    """Every hint of every rule (``_Rule.hints``) that occurs in ``text`` (the lower-case
    ones in ``text.lower()``): the rules whose hint is absent cannot match ``text``, so
    ``_first_secret(text, present=hints_in(text))`` is ``_first_secret(text)``. A full pass
    per hint, as ``_first_secret``'s own gate (~0.6 ms per 16 KiB here)."""
    return _hints(text, text.lower())


def find_secret_in_view(content: str, present: frozenset[Hint]) -> str | None:
    """``find_secret(content)`` for a ``content`` that is its own ``secret_view`` (nothing
    stripped, NFKC-normalized: the caller knows), given ``present``, a superset of the hints
    it holds (``hints_in``): only the rules with a hint in ``present`` run, then the encoded
    forms (``_encoded_secret``, over the whole text). The same answer as
    ``find_secret(content)``: the rules left out cannot match (their hints are absent)."""
    found = _first_secret(content, present=present) if present else None
    if found is None:  # as ``_find`` reads it: the markup view (no override in a view)
        for alt in _rendered_views(content, False):
            found = _first_secret(alt)
            if found is not None:
                content = alt
                break
    return _encoded_secret(content) if found is None else _secret_reason(found, content)


#: what stands for the secret part of a name in a redacted name
REDACTED = "[REDACTED]"


@dataclass(frozen=True)
class NameSecret:
    """A secret found in a record path or name (:func:`find_secret_in_path`): ``kind`` (one
    of :data:`SECRET_KINDS`), ``component`` (1-based index of the path component holding
    it) and ``redacted``: the whole path with the secret replaced by its first four
    characters (the vendor prefix, such as ``AKIA`` or ``ghp_``) and ``[REDACTED]``, safe to
    show in logs, problem details and ``errors.log``."""

    kind: str
    component: int
    redacted: str

    @property
    def reason(self) -> str:
        """One sentence for a refusal (never the secret)."""
        return (f"the name holds a secret ({self.kind} in path component {self.component}: "
                f"{self.redacted!r}); names show in listings, history and logs: choose another name")


def _redact_at(text: str, m: re.Match[str]) -> str:
    """``text`` with the secret at ``m``'s span (positions in ``text``) cut to its first four
    characters (the vendor prefix, ``AKIA``, ``ghp_``) and :data:`REDACTED`."""
    return text[: m.start()] + text[m.start() : m.start() + 4] + REDACTED + text[m.end() :]


def find_secret_in_path(path: str) -> NameSecret | None:
    """The first secret in a record path (``a/b.md``) or one name, found with the same rules
    as content (:func:`find_secret`), each component scanned on its own, as written and with
    ``_`` read as a separator (``key_AKIA…`` is a key too); or None.

    Names are short, so this costs microseconds. The rules anchor on vendor prefixes and
    random-looking secret parts, so ordinary names (dates, ticket numbers, UUIDs, hashes,
    ``ASIA-pacific.md``, ``sk-learn.md``) do not match: tests/test_content.py runs them
    over realistic names."""
    if _plain(path) and not _hints(path, path.lower()) and (
            "_" not in path or not _hints(spaced := path.replace("_", " "), spaced.lower())):
        # every component is its own view, and a secret in one needs a hint in it or in it
        # with ``_`` read as a space: in the whole path, read the same way (one pass)
        return None
    parts = path.split("/")
    for i, comp in enumerate(parts):
        view = secret_view(comp)  # as the prompt shows it (a name reaches prompts too)
        bases = [comp, view] if view != comp else [comp]
        # each text with the base its match positions refer to (``_`` read as a separator
        # keeps the length)
        for text, base in [(b, b) for b in bases] + [(b.replace("_", " "), b) for b in bases if "_" in b]:
            found = _first_secret(text, in_name=True)
            if found is None:
                continue
            rule, m = found
            red = _redact_at(base, m)
            shown = "/".join(parts[:i] + [red] + [_redact_rest(c) for c in parts[i + 1 :]])
            return NameSecret(rule.kind, i + 1, shown)
    return None


def _redact_rest(comp: str) -> str:
    """A later component of a path whose earlier one held a secret, redacted too if it holds
    one (a path may hold two)."""
    found = find_secret_in_path(comp)
    return comp if found is None else found.redacted


def check_secrets(content: str) -> None:
    """Raise :class:`SecretDetected` when :func:`find_secret` finds a secret in ``content``."""
    reason = find_secret(content)
    if reason is not None:
        raise SecretDetected(f"content holds a secret ({reason}); remove it and write again")


def refusals_line(mount_root: str) -> str:
    """The one line of the prompt block (and of the sidecar's placeholder ``context.md``)
    that tells an agent where refused writes are reported: a refusal decided at ``close()``
    is invisible to a shell redirection (``echo … >> f`` ignores close's errno), so the agent
    must know to look. Our text only, never memory content; ``mount_root`` without a
    trailing slash."""
    return (
        "Refused writes (a secret, bad UTF-8 or `type`, over a size limit) are listed with the "
        f"reason in `{mount_root}/.memfuse/errors.log`, even when the tool reported success; "
        "such a file stays here (`user.memfuse.state` is `rejected`), not saved, until you fix it."
    )
