"""The memory tool's vocabulary, without the service: ``/memories`` paths (``parse_path`` →
``Target``), what a command answers (``ToolResult``) or refuses with (``ToolError``, its
reason code for the log), the principal its writes are recorded under (``ToolPrincipal``,
actor ``tool:<client>``), and the text formats of the reference tool's outputs (sizes,
line-numbered views). The engine that runs the commands is ``memfuse.server.memtool``, which
re-exports these names.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from memfuse import names
from memfuse.server.service import Principal

ROOT = "/memories"
MAX_LINES = 999_999  # the reference's line limit for view
LINE_NUMBER_WIDTH = len(str(MAX_LINES))

_PCT_TRICK = re.compile(r"%(2e|2f|5c)", re.IGNORECASE)


# A refusal's reason code for the log line, from its message when the raise gives none (the
# messages are fixed: the Anthropic reference tool's wording, kept for the differential test).
_CODES = (
    ("Parameter `", "invalid_parameter"),
    ("Invalid `", "invalid_parameter"),
    ("does not exist", "not_found"),
    ("no longer exists", "not_found"),
    ("has no version", "not_found"),
    ("already exists", "already_exists"),
    ("(EROFS)", "read_only"),
    ("is not attached", "not_attached"),
    ("is not a file", "not_a_file"),
    ("(ENOTDIR)", "not_a_directory"),
    ("(EXDEV)", "cross_store"),
    ("(EACCES)", "forbidden"),
    ("(EINVAL)", "invalid_move"),
    ("No replacement was performed", "no_match"),
    ("maximum line limit", "too_large"),
    ("kept changing concurrently", "conflict"),
    ("Path ", "invalid_path"),
    ("Invalid path", "invalid_path"),
    ("Cannot delete the /memories", "forbidden"),
    ("Cannot rename the /memories", "forbidden"),
)


class ToolError(Exception):
    """A command refused: ``message`` is the tool result text (``is_error`` true); ``code`` a
    short reason code for logs (``not_found``, ``read_only``, a service problem code...; by
    default derived from the message, ``invalid_input`` when nothing matches)."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or next((c for frag, c in _CODES if frag in message), "invalid_input")


@dataclass(frozen=True)
class ToolResult:
    """What a command returns to the model: ``content`` text and ``is_error``."""

    content: str
    is_error: bool = False


@dataclass(frozen=True)
class ToolPrincipal(Principal):
    """A workspace principal whose versions are recorded with actor ``tool:<client>``."""

    client: str = "api"

    @property
    def actor(self) -> str:
        """``tool:<client>``."""
        return f"tool:{self.client}"


def clean_client(value: str | None) -> str:
    """A client name fit for the actor (``names.client_label``: printable, no format
    controls, ``/`` or spaces, at most 100 characters); ``"api"`` when nothing is left."""
    return names.client_label(value) or "api"


def format_size(n: int) -> str:
    """A size as the reference listing shows it: ``0B``, ``512B``, ``4K``, ``1.5K``, ``2M``
    (1024-based, one decimal unless whole)."""
    if n == 0:
        return "0B"
    units = ["B", "K", "M", "G"]
    i = min((n.bit_length() - 1) // 10, len(units) - 1)
    size = n / (1024**i)
    return f"{int(size)}{units[i]}" if size == int(size) else f"{size:.1f}{units[i]}"


def split_lines_keeping_cr(content: str) -> list[str]:
    """Split on LF only (CR kept), without the empty tail a trailing newline leaves."""
    lines = content.split("\n")
    if lines[-1] == "":
        lines.pop()
    return lines


def numbered(lines: list[str], start: int) -> str:
    """Lines as the reference view shows them: number right-aligned to 6, a tab, the line."""
    return "\n".join(f"{str(i + start).rjust(LINE_NUMBER_WIDTH)}\t{line}" for i, line in enumerate(lines))


@dataclass(frozen=True)
class Target:
    """A parsed ``/memories`` path: ``store`` None for the root; ``path`` the record path
    inside the store (``""`` for the store's own directory); ``raw`` as the model gave it
    (outputs echo it, as the reference does)."""

    raw: str
    store: str | None
    path: str

    @property
    def is_root(self) -> bool:
        return self.store is None

    @property
    def is_store_root(self) -> bool:
        return self.store is not None and not self.path

    @property
    def in_store(self) -> str:
        """``store`` of a path known to be inside a store (not the root; ``_attachment``
        checked it)."""
        assert self.store is not None, "the /memories root has no store"
        return self.store


def parse_path(raw: Any, what: str = "path") -> Target:
    """Canonicalise a ``/memories/...`` path. Raises ``ToolError`` for a path that is not a
    string, outside ``/memories``, with a ``..`` component, a backslash, a percent-encoded
    ``.`` ``/`` ``\\``, or a name the stores do not accept (docs/API.md names)."""
    if not isinstance(raw, str) or not raw:
        raise ToolError(f"Parameter `{what}` is required and must be a string starting with /memories")
    if "\\" in raw:
        raise ToolError(f"Path {raw} contains a backslash; separate path components with /")
    if _PCT_TRICK.search(raw):
        raise ToolError(f"Path {raw} contains a percent-encoded '.', '/' or '\\'; write the path in plain text")
    if raw != ROOT and not raw.startswith(ROOT + "/"):
        raise ToolError(f"Path must start with /memories, got: {raw}")
    parts = [p for p in raw[len(ROOT):].split("/") if p not in ("", ".")]
    if ".." in parts:
        depth = 0
        for p in parts:
            depth += -1 if p == ".." else 1
            if depth < 0:
                raise ToolError(f"Path {raw} would escape /memories directory")
        raise ToolError(f"Path {raw} contains a '..' component; give the path without it")
    if not parts:
        return Target(raw, None, "")
    try:  # the store component: any name; a store not attached simply does not exist
        for p in parts[:1]:
            names.check_component(p)
        rest = "/".join(parts[1:])
        if rest:
            names.check_path(rest)
    except names.NameError_ as e:
        raise ToolError(f"Invalid path {raw}: {e.reason}") from None
    return Target(raw, parts[0], rest)
