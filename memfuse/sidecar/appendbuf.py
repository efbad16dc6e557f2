"""The write buffer of a file being appended to: its content before the session, by
reference, plus what was written after it.

A write session on a file keeps the file's bytes in memory until close (``Node.buf``). For
``echo line >> f`` on a 1 MiB journal, a ``bytearray`` copy of the content at the first
write and a ``bytes`` copy of the buffer at close were two 1 MiB copies (each a fresh
allocation, its pages faulted in) per appended line: most of what an append to a large file
still cost the sidecar (bench/README.md, "Appends, session 10: sidecar").

``AppendBuffer`` holds the content the session started from as the immutable ``bytes`` it
already is (kept in memory by ``recent.RecentContents``, or read once from the blob cache)
and a ``bytearray`` of the bytes after it. It answers what ``core`` and ``writecheck`` ask
of a buffer (``len``, an index, a slice, ``bytes()``, a slice assignment, ``del`` of a
tail, ``extend``); a change before the end of the base (an overwrite, a truncation into it)
first makes it one ``bytearray`` (the copy the plain buffer made at open), after which it
behaves as one. ``bytes(buf)`` is one concatenation. While nothing before the end of the
base was changed, ``appended_to`` names the base, so close knows the content is an append
of it without comparing (``core.Filesystem._checked_prefix``).

Not thread-safe (the trio thread only, as every ``Node`` field).
"""
from __future__ import annotations

from typing import Union, overload

__all__ = ["AppendBuffer", "WriteBuffer"]


class AppendBuffer:
    """A write buffer = ``base`` (``bytes``, the content whose sha256 is ``base_sha``) +
    ``tail`` (``bytearray``) (module docstring).

    INVARIANT: the buffer's bytes are ``base + tail``; ``base_sha`` is the sha256 hex of
    ``base`` while the buffer is unflattened, and '' once it was flattened (``base`` is then
    ``b""`` and ``tail`` holds everything)."""

    __slots__ = ("base", "base_sha", "tail")

    def __init__(self, base: bytes, base_sha: str) -> None:
        self.base = base
        self.base_sha = base_sha
        self.tail = bytearray()

    @property
    def appended_to(self) -> tuple[str, bytes] | None:
        """``(sha256, bytes)`` of the content this buffer holds plus a suffix (only bytes
        after it were written), None once an earlier byte was changed."""
        return (self.base_sha, self.base) if self.base_sha else None

    def _flatten(self) -> bytearray:
        """Make the buffer one ``bytearray`` (``tail``) and return it."""
        if self.base_sha:
            whole = bytearray(self.base)
            whole += self.tail
            self.base, self.base_sha, self.tail = b"", "", whole
        return self.tail

    def __len__(self) -> int:
        return len(self.base) + len(self.tail)

    def __bytes__(self) -> bytes:
        return self.base + self.tail if self.base else bytes(self.tail)

    @overload
    def __getitem__(self, key: int) -> int: ...

    @overload
    def __getitem__(self, key: slice) -> bytes: ...

    def __getitem__(self, key: int | slice) -> int | bytes:
        """A byte (``int``) or the bytes of a slice (``bytes``); nothing changes."""
        lb = len(self.base)
        if isinstance(key, int):
            i = key + len(self) if key < 0 else key
            if not 0 <= i < len(self):
                raise IndexError("index out of range")
            return self.base[i] if i < lb else self.tail[i - lb]
        start, stop, step = key.indices(len(self))
        if step != 1:
            return bytes(self)[key]
        if stop <= start:
            return b""
        if stop <= lb:
            return self.base[start:stop]
        if start >= lb:
            return bytes(self.tail[start - lb:stop - lb])
        return self.base[start:] + self.tail[:stop - lb]

    def __setitem__(self, key: slice, value: bytes) -> None:
        """``buf[a:b] = value`` (as ``bytearray``'s): after the base, written into the
        tail; into the base, after flattening."""
        start, stop, step = key.indices(len(self))
        lb = len(self.base)
        if step == 1 and start >= lb:
            self.tail[start - lb:max(start, stop) - lb] = value
        elif step == 1 and stop <= start and not value:
            return  # nothing replaced, nothing inserted
        else:
            self._flatten()[key] = value

    def __delitem__(self, key: slice) -> None:
        """``del buf[a:b]`` (as ``bytearray``'s): of the tail alone, or after flattening."""
        start, stop, step = key.indices(len(self))
        lb = len(self.base)
        if step == 1 and start >= lb:
            del self.tail[start - lb:max(start, stop) - lb]
        elif step == 1 and stop <= start:
            return  # nothing to delete
        else:
            del self._flatten()[key]

    def extend(self, data: bytes) -> None:
        """Append ``data``."""
        self.tail.extend(data)


#: what ``Node.buf`` holds while a file is written
WriteBuffer = Union[bytearray, AppendBuffer]
