"""Content rules of the control plane: YAML frontmatter type detection and content checks.

A record's type comes from (first match wins) the request's ``type``, the YAML frontmatter
(``type:`` at top level, else ``metadata.type:``), the store's ``default_type``. The root
``MEMORY.md`` is the store's index and has no type. Frontmatter is a block that starts at the
very first byte with a ``---`` line and ends at the next ``---`` (or ``...``) line; YAML that
does not parse, or that is not a mapping, is ignored.
"""
from __future__ import annotations

import re

import yaml

from memfuse.models import RECORD_TYPES

INDEX_PATH = "MEMORY.md"

# The closing fence: a line that is exactly '---' or '...' (optionally with trailing spaces).
_CLOSE_RE = re.compile(r"^(?:---|\.\.\.)[ \t]*\r?$", re.MULTILINE)
_MAX_FRONTMATTER_CHARS = 64 * 1024


def frontmatter(content: str) -> dict | None:
    """Return the YAML frontmatter of ``content`` as a dict, or None when there is none, it
    does not parse, or it is not a mapping. Never raises."""
    if not (content.startswith("---\n") or content.startswith("---\r\n")):
        return None
    start = content.index("\n") + 1
    m = _CLOSE_RE.search(content, start, start + _MAX_FRONTMATTER_CHARS)
    if m is None:
        return None
    block = content[start : m.start()]
    try:
        data = yaml.safe_load(block)
    except Exception:  # yaml.YAMLError, and RecursionError on hostile input
        return None
    return data if isinstance(data, dict) else None


def frontmatter_type(content: str) -> str | None:
    """The ``type`` named by the frontmatter (top-level ``type`` first, then
    ``metadata.type``), as a string, or None when there is none. The value is not validated:
    a non-string scalar is returned as its string form (and will fail validation)."""
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
    return value if isinstance(value, str) else str(value)


def is_index(path: str) -> bool:
    """True for the store's root index ``MEMORY.md`` (which has no type)."""
    return path == INDEX_PATH


def resolve_type(path: str, content: str, explicit: str | None, default_type: str) -> str | None:
    """The type a record at ``path`` with ``content`` gets.

    ``explicit`` (the request's ``type``) wins, then the frontmatter, then ``default_type``;
    the root ``MEMORY.md`` always gets None. Raises ``ValueError`` when the chosen type is not
    one of ``user``, ``feedback``, ``project``, ``reference``.
    """
    if is_index(path):
        return None
    chosen = explicit if explicit is not None else frontmatter_type(content)
    if chosen is None:
        chosen = default_type
    if chosen not in RECORD_TYPES:
        raise ValueError(f"type {chosen!r} is not one of {', '.join(RECORD_TYPES)}")
    return chosen


def check_content(content: str) -> bytes:
    """Return ``content`` encoded as UTF-8. Raises ``ValueError`` when it contains NUL or
    cannot be encoded (lone surrogates from JSON ``\\ud800`` escapes)."""
    if "\x00" in content:
        raise ValueError("content contains a NUL character")
    try:
        return content.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("content is not valid UTF-8 (lone surrogate)") from None


_STRIP_RE = re.compile(
    "[\u0000-\u0008\u000b-\u001f\u007f-\u009f\u200b-\u200f\u2028\u2029\u202a-\u202e\u2060-\u2064\ufeff]"
)


def strip_controls(text: str) -> str:
    """Remove control and Unicode format characters except tab and newline (for the prompt
    block); ``\\r\\n`` becomes ``\\n``."""
    return _STRIP_RE.sub("", text.replace("\r\n", "\n"))
