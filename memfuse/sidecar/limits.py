"""Refusals at write(2) and truncate of a memfuse mount: the part of ``core.Filesystem`` that
judges each change of a write session before it is applied.

``WriteLimits`` holds the size limits (``EFBIG`` past the store's ``max_record_bytes``,
``ENOSPC`` past its ``max_store_bytes``, local-only files included) and the content checks
of ``writecheck.WriteChecker`` (``EILSEQ``, ``EPERM``, ``EINVAL``: docs/SEMANTICS.md,
"Refusals"). A refused change is not applied; the refusal is one ``errors.log`` line per
refusal (a writer retrying the rest of a split write is not logged again), and when the
session had changed the file already, it is held back (``Node.refused``, state ``REJECTED``)
until the next open for writing, so what it left behind never replaces the stored record
(INVARIANTS.md, "Refusals at write(2)"). Nothing here awaits.
"""
from __future__ import annotations

import errno
from typing import TYPE_CHECKING, Any

from .. import content as content_rules  # the server enforces the same rules
from ..errors import errno_of
from .appendbuf import WriteBuffer
from .inodes import CLEAN, REJECTED, FsError, Node
from .writecheck import Refusal, WriteChecker


class WriteLimits:
    """Size limits and content checks of write sessions (module docstring); mixed into
    ``core.Filesystem``."""

    if TYPE_CHECKING:  # the filesystem's methods this part calls
        def note_error(self, where: Node | None, name: str, err: int, reason: str,
                       code: str = "", store: str = "") -> None: ...

        def invalidate(self, items: list[tuple[Any, ...]]) -> None: ...

    def _check_size(self, n: Node, size: int, truncating: bool = False) -> None:
        """``EFBIG`` when a write ending at byte ``size`` (or, ``truncating``, a truncation
        to ``size`` bytes) passes the store's ``max_record_bytes``. The reason says what is
        known at that moment: where the refused write reached (the kernel hands a large
        write over in chunks, so the file the writer meant may be larger still), never a
        guess of the file's final size."""
        sm = n.store
        if sm is not None and size > sm.max_record_bytes and not n.local_only:
            if truncating:
                reason = (f"truncating to {size} bytes exceeds the store's max_record_bytes "
                          f"{sm.max_record_bytes}")
            else:
                reason = (f"a write reaching byte {size} exceeds the store's max_record_bytes "
                          f"{sm.max_record_bytes}")
            self._note_size_refusal(n, errno_of("record_too_large"), reason, "record_too_large")
            # What this write session left behind (often a truncation at open plus part of
            # the content) must not replace the stored record: hold it back until the next
            # open for writing (docs/SEMANTICS.md: the stored record untouched).
            if n.dirty and n.refused != errno.EFBIG:  # else nothing changed, or held already
                n.refused, n.refused_code, n.state, n.error = errno.EFBIG, "record_too_large", REJECTED, reason
            raise FsError.of("record_too_large", reason)

    def _note_size_refusal(self, n: Node, err: int, reason: str, code: str) -> None:
        """``note_error`` for a write / truncate refused for size, once per refusal: a
        write(2) the kernel split in chunks returns the bytes written before the refused
        chunk, and the writer (``dd``, Python's ``write``, coreutils) retries the rest, which
        is refused again for the same reason; this session is already held back with it, so
        it is one refusal and one ``errors.log`` line."""
        if n.refused == err:
            return  # this session is held back for that already (the reason may name
            # another byte: a writer retrying the rest may be refused at another chunk)
        self.note_error(n.parent, n.name, err, reason, code)

    def _check_growth(self, n: Node, new_size: int) -> None:
        """``ENOSPC`` when growing ``n`` to ``new_size`` passes the store's byte quota."""
        sm = n.store
        grow = new_size - n.cur_size()
        if sm is None or grow <= 0 or sm.used + sm.local_used + grow <= sm.max_store_bytes:
            return
        reason = (f"store {sm.slug} would hold {sm.used + sm.local_used + grow} bytes, "
                  f"limit {sm.max_store_bytes}")
        if sm.local_used:
            reason += f" ({sm.local_used} of them in local-only files)"
        self._note_size_refusal(n, errno_of("store_full"), reason, "store_full")
        if n.dirty and not n.local_only:
            n.refused, n.refused_code, n.state, n.error = errno.ENOSPC, "store_full", REJECTED, reason
        raise FsError.of("store_full", reason)

    def _judge(self, n: Node, buf: WriteBuffer, off: int, data: bytes | None = None,
               size: int | None = None) -> None:
        """Refusals at write(2): raise ``FsError`` when writing ``data`` at ``off`` (or, with
        ``size``, ftruncate to it) would make the content refusable (``writecheck``); the
        change is then not applied, and the refusal is one ``errors.log`` line (a writer
        retrying the same write is not logged again)."""
        if n.local_only or n.store is None:
            return
        ch = n.checker
        if ch is None:
            trusted = not buf or (n.state == CLEAN and not n.dirty)
            ch = n.checker = WriteChecker(buf, trusted=trusted,
                                          type_rule=lambda text: self._type_refusal(n, text))
        if size is None:
            assert data is not None  # a write (else an ftruncate, with size)
            r = ch.check_write(buf, off, data)
        else:
            r = ch.check_truncate(buf, size)
        if r is None:
            return
        if ch.last_refused != (r.reason, off):  # the rest of a split write(2) retried: one line
            ch.last_refused = (r.reason, off)
            self.note_error(n.parent, n.name, r.errno, r.reason, r.code)
        if n.dirty and not n.refused:
            # as for EFBIG: what this session left behind (a truncation at open, vim's
            # ftruncate, earlier writes) must not replace the stored record; held back
            # until the next open for writing, and its close reports the refusal too
            n.refused, n.refused_code, n.state, n.error = r.errno, r.code, REJECTED, r.reason
            n.last_put = None  # an earlier put landing later must not mark it clean
        # the kernel's pages may hold the refused bytes already: a write through a shared
        # mmap is in the page cache before its write-back reaches us (attack18 F13), and
        # with keep_cache a later read would be served them. Dropped (after the file's
        # readers close, Invalidator.reading; an open meanwhile waits for it: catch_up)
        self.invalidate([("inode", n.ino)])
        raise FsError(r.errno, r.reason, r.code)

    def _type_refusal(self, n: Node, text: str) -> Refusal | None:
        """The refusal of a file ``n`` whose text starts with ``text`` for its type (the
        frontmatter's, unless ``user.memfuse.type`` set one; none for ``MEMORY.md``)."""
        try:
            content_rules.check_type(content_rules.record_type(n.path(), text, n.type_override, "project"))
        except ValueError as e:
            return Refusal("invalid_type", str(e) or "invalid record type")
        return None
