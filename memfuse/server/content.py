"""Content rules of the control plane: the shared rules of :mod:`memfuse.content` (types,
UTF-8, secrets) as the server uses them, plus the prompt-block text cleaning.

A record's type comes from (first match wins) the request's ``type``, the YAML frontmatter
(``type:`` at top level, else ``metadata.type:``), then the store's ``default_type`` for a new
record or the record's current type for an update. The root ``MEMORY.md`` is the store's
index and has no type. See :mod:`memfuse.content` for the frontmatter rules.
"""
from __future__ import annotations

import re
import unicodedata

from memfuse.content import (
    INDEX_PATH,
    ContentError,
    InvalidContent,
    InvalidType,
    SecretDetected,
    check_secrets,
    check_text,
    check_type,
    find_secret,
    frontmatter,
    frontmatter_type,
    is_index,
    record_type,
)

__all__ = [
    "INDEX_PATH",
    "ContentError",
    "InvalidContent",
    "InvalidType",
    "SecretDetected",
    "check_content",
    "check_secrets",
    "find_secret",
    "frontmatter",
    "frontmatter_type",
    "is_index",
    "record_type",
    "resolve_type",
    "strip_controls",
]


def resolve_type(path: str, content: str, explicit: str | None, default_type: str | None) -> str | None:
    """The validated type of a record at ``path`` with ``content``: :func:`record_type` then
    :func:`check_type`. ``default_type`` is the fallback (store default for a create, the
    current type for an update). Raises :class:`InvalidType` (a ``ValueError``)."""
    t = record_type(path, content, explicit, default_type)
    if t is None and not is_index(path):
        raise InvalidType("the record has no type and no default applies")
    check_type(t)
    return t


def check_content(content: str) -> bytes:
    """Return ``content`` encoded as UTF-8. Raises :class:`InvalidContent` (a ``ValueError``)
    when it contains NUL or cannot be encoded (lone surrogates from JSON ``\\ud800``)."""
    return check_text(content)


_SUSPECT_RE = re.compile(r"[^\t\n\x20-\x7e]")
_STRIP_CATEGORIES = frozenset(("Cc", "Cf", "Zl", "Zp", "Cs"))


def _strip_one(m: re.Match[str]) -> str:
    ch = m.group()
    return "" if unicodedata.category(ch) in _STRIP_CATEGORIES else ch


def strip_controls(text: str) -> str:
    """Remove control characters (Cc, except tab and newline), Unicode format characters
    (Cf: zero-width, bidi overrides, BOM, tag characters, ...), line / paragraph separators
    and lone surrogates, for the prompt block; ``\\r\\n`` becomes ``\\n`` (a lone ``\\r`` is
    removed like any control character)."""
    text = text.replace("\r\n", "\n")
    return _SUSPECT_RE.sub(_strip_one, text)
