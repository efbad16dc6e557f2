"""The contents of recently written files, kept in memory by sha256: an append's base
without a read of the blob cache.

``echo line >> f`` opens ``f`` for appending, writes a line at its end and closes it; the
write session starts from the file's content (``core.Filesystem._make_buf``) and its close
checks that the new content starts with it (``_checked_prefix``: an append is judged and
hashed by its suffix). For a file appended to again and again (a journal), that content is
the one this sidecar committed at the previous close, and the blob cache stores it as a
link to its base plus the suffix (``BlobCache.put_append``): reading it back takes up to
``blobcache.APPEND_CHAIN_MAX`` reads and a join of the whole content, the largest cost of
an append to a 1 MiB file left in the sidecar (bench/README.md, "Appends, session 10:
sidecar"). ``RecentContents`` keeps the bytes of the last contents ``core`` held (committed,
or read back for a write session), so the next append to one of them starts from memory.

Exact by construction: an entry is the content whose sha256 its key is (the caller hashed
those very bytes, or read them from the content-addressed blob cache under that key), and
``bytes`` are immutable. Nothing is persisted; a miss reads the blob cache as before.

Memory: at most ``max_bytes`` of contents (default ``RECENT_BYTES``), least recently used
evicted first; contents shorter than ``min_bytes`` are not kept (reading them back costs
less than keeping them). The close of an append drops the content it extends
(``core.Filesystem._hold_content``): the base of no next append, so the bound holds the last
contents of several files, not the last versions of one. A kept content is usually still referenced by its outbox entry
(``Entry.content``) until it commits. Every method runs on the trio thread (no lock).
"""
from __future__ import annotations

from collections import OrderedDict

__all__ = ["RECENT_BYTES", "RecentContents"]

#: bytes of contents kept at most (eight appended 1 MiB journals)
RECENT_BYTES = 8 << 20


class RecentContents:
    """Recently held contents by sha256 hex (module docstring): ``keep(sha, data)``,
    ``get(sha)`` (None when not kept), least recently used evicted beyond ``max_bytes``;
    contents shorter than ``min_bytes`` or longer than ``max_bytes`` are not kept."""

    __slots__ = ("max_bytes", "min_bytes", "_items", "_bytes", "hits", "misses")

    def __init__(self, max_bytes: int = RECENT_BYTES, min_bytes: int = 0) -> None:
        self.max_bytes = max_bytes
        self.min_bytes = min_bytes
        # INVARIANT: _bytes == sum(len(v) for v in _items.values()) <= max_bytes
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self.hits = 0  # get answered from memory
        self.misses = 0  # get found nothing

    def keep(self, sha: str, data: bytes) -> None:
        """Keep ``data``, the content whose sha256 hex is ``sha`` (not checked: the caller
        hashed it, or read it under that key), as the most recently used."""
        if not sha or not self.min_bytes <= len(data) <= self.max_bytes:
            return
        old = self._items.pop(sha, None)
        if old is not None:
            self._bytes -= len(old)
        self._items[sha] = data
        self._bytes += len(data)
        while self._bytes > self.max_bytes:
            _, gone = self._items.popitem(last=False)
            self._bytes -= len(gone)

    def get(self, sha: str) -> bytes | None:
        """The kept content whose sha256 hex is ``sha`` (now the most recently used), or
        None."""
        data = self._items.get(sha)
        if data is None:
            self.misses += 1
            return None
        self._items.move_to_end(sha)
        self.hits += 1
        return data

    def drop(self, sha: str) -> None:
        """Forget the content of ``sha`` (absent: nothing)."""
        old = self._items.pop(sha, None)
        if old is not None:
            self._bytes -= len(old)

    @property
    def size(self) -> int:
        """Bytes of contents kept."""
        return self._bytes
