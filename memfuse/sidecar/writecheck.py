"""Refusals at write(2): the content checks a close makes, decided at the write that makes
the content refusable, so a shell sees them (bash ignores close(2)'s result; ``echo … > f``
can only report what write(2) returns). docs/SEMANTICS.md, "Refusals at write(2)".

Pure: no FUSE, no I/O; ``core.Filesystem`` keeps one :class:`WriteChecker` per file being
written (``Node.checker``) and asks it before applying each write or ftruncate. A refused
write is not applied: the file keeps what it held before it.

What a write is refused for, judged on the file's bytes as they would stand after it:

- ``EILSEQ``: it makes the content invalid UTF-8 or puts a NUL in it (a zero-filled hole
  too). A multi-byte sequence cut at the end of the file waits for the next write; only
  a byte that cannot continue it is refused.
- ``EPERM``: it completes a secret (``memfuse.content.find_secret``, on the text as the
  prompt renders it) in the window around the bytes written, which held none before. The
  window holds :data:`WINDOW` bytes on each side *as the secret rules read them*
  (``content.scan_floor``: what a view removes, such as zero-width spaces, counts for
  nothing), so padding a token with invisible characters does not push its start out of
  it (attack21 F3), and a write that opens or closes an HTML comment (one line) reads to
  the comment's other end on its line; it takes at most :data:`WINDOW_CAP` bytes of the file
  on each side.
  A secret longer than the window, or split by more padding than the cap, is refused at
  close.
- ``EINVAL``: the frontmatter (within its first 64 Ki characters), once closed, names a
  ``type`` outside the four, where before it did not.

Content that is refusable already (a rejected file being fixed, a cut sequence left
elsewhere) does not make later writes fail: close judges the whole file, as before.

Cost per write: the bytes written plus a few bytes of context for UTF-8; the window (about
``2 * WINDOW`` bytes of ordinary text, at most ``2 * WINDOW_CAP`` of a file padded with
what the rules do not read) for secrets; the head of the file (YAML parse) only for a write
within the first :data:`HEAD_BYTES` of a file that starts with a frontmatter fence. A 1 MiB
file written in 4 KiB chunks is never rescanned whole.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Union
from dataclasses import dataclass

from memfuse import content as content_rules
from memfuse.errors import ERRNO_BY_CODE

if TYPE_CHECKING:
    from .appendbuf import AppendBuffer

#: what is judged: a file's bytes (``Node.buf``: a ``bytearray``, or an ``AppendBuffer``)
_Buffer = Union[bytes, bytearray, "AppendBuffer"]

__all__ = ["Refusal", "WriteChecker", "WINDOW", "WINDOW_CAP", "HEAD_BYTES", "FENCES"]

#: bytes of context on each side of a write scanned for a secret it completes, as the
#: secret rules read them (``content.scan_floor``)
WINDOW = 2048
#: bytes of the file on each side of a write that the window takes at most, however little
#: of them the rules read (a file of zero-width spaces: each write reads this much, not the
#: whole file; what lies beyond is judged at close)
WINDOW_CAP = 16 * 1024
#: bytes that may hold a frontmatter: 64 Ki characters of at most 4 bytes, plus the fences
HEAD_BYTES = 4 * 64 * 1024 + 16
#: how a frontmatter opens (after an optional BOM): a content that starts otherwise has none
FENCES = (b"---", b"\xef\xbb\xbf---")
_FENCES = FENCES
_UNKNOWN = object()


@dataclass(frozen=True)
class Refusal:
    """Why a write is refused: ``code`` (the API's problem code, as at close) and a
    ``reason`` for ``errors.log`` (never the content); ``errno`` for the syscall comes from
    the one table (``memfuse.errors.ERRNO_BY_CODE``)."""

    code: str
    reason: str

    @property
    def errno(self) -> int:
        return ERRNO_BY_CODE[self.code]


def _is_cont(b: int) -> bool:
    return b & 0xC0 == 0x80


class WriteChecker:
    """The incremental judge of one file's content during a write session.

    ``content``: the file's bytes when the session starts (the first write after an open
    for writing; after ``O_TRUNC``, empty). ``trusted``: they are known to be valid UTF-8
    without NUL (a clean record), so they are not scanned. ``type_rule(text)`` returns the
    refusal for a file whose text starts with ``text`` (its frontmatter), or None; it is
    the caller's (path and explicit type decide whether a type applies).

    ``check_write`` / ``check_truncate`` return a :class:`Refusal` (nothing changes) or None
    (the checker's state now describes the content after the change, which the caller must
    then apply)."""

    __slots__ = ("ok_upto", "bad", "head_error", "type_rule", "last_refused", "clean_len")

    def __init__(self, content: _Buffer, *, trusted: bool,
                 type_rule: Callable[[str], Refusal | None]) -> None:
        self.type_rule = type_rule
        self.last_refused: tuple[str, int] | None = None  # the caller's: (reason, offset) last refused
        #: [0, ok_upto) is valid UTF-8 without NUL ending at a character boundary; the rest
        #: (at most 3 bytes) is the start of a multi-byte sequence; meaningless when ``bad``
        self.ok_upto = len(content)
        #: the content is refusable as UTF-8 already: not judged here, close judges it
        self.bad = False
        self.head_error: object = _UNKNOWN  # the frontmatter's refusal before the next write
        #: the length of the content when the last change judged here was a write whose
        #: secret scan read the whole content after it and found none (a file written in
        #: one go: its close need not scan it again, ``core.Filesystem.commit``); else -1.
        #: Whoever changes the content without ``check_write`` sets it to -1.
        self.clean_len = -1
        if not trusted:
            valid, cut = self._scan(bytes(content), tail_ok=True)
            if valid is None:
                self.bad = True
            else:
                self.ok_upto = valid

    # ------------------------------------------------------------------ UTF-8
    @staticmethod
    def _scan(region: bytes, tail_ok: bool) -> tuple[int | None, int]:
        """``(valid, at)``: ``valid`` the length of ``region``'s valid prefix when the rest is
        a cut sequence at its end (``tail_ok``) or nothing; None when it holds an invalid
        byte or a NUL, ``at`` its offset."""
        try:
            region.decode("utf-8")
            valid = len(region)
        except UnicodeDecodeError as e:
            if not (tail_ok and e.reason == "unexpected end of data" and e.end == len(region)):
                return None, e.start
            valid = e.start
        nul = region.find(b"\0", 0, valid)
        if nul >= 0:
            return None, nul
        return valid, valid

    def _check_utf8(self, buf: _Buffer, off: int, data: bytes) -> tuple[Refusal | None, int]:
        """The UTF-8 / NUL verdict of writing ``data`` at ``off`` into ``buf``, and the
        ``ok_upto`` after it."""
        if self.bad:
            return None, self.ok_upto
        old_len = len(buf)
        end = off + len(data)
        start = min(self.ok_upto, off)
        while start > 0 and start < old_len and _is_cont(buf[start]):
            start -= 1  # [0, ok_upto) is valid: a character starts within 3 bytes back
        if end >= self.ok_upto:
            stop, tail_ok = max(old_len, end), True
        else:
            stop, tail_ok = end, False
            while stop < self.ok_upto and _is_cont(buf[stop]):
                stop += 1  # up to the next character of the old content
        if off > old_len:
            region = bytes(buf[start:old_len]) + b"\0" * (off - old_len) + data
        else:
            region = bytes(buf[start:off]) + data
        if stop > end:
            region += bytes(buf[end:stop])
        valid, at = self._scan(region, tail_ok)
        if valid is None:
            where = start + at
            what = ("a NUL character" if region[at:at + 1] == b"\0" else "invalid UTF-8")
            return Refusal("invalid_content",
                           f"the write puts {what} in the content (at byte {where}); records are "
                           "UTF-8 text; the write was not applied"), self.ok_upto
        return None, (start + valid if tail_ok else self.ok_upto)

    # ------------------------------------------------------------------ secrets
    @staticmethod
    def _reach(buf: _Buffer, pos: int, step: int) -> int:
        """Where the window's context on one side of byte ``pos`` ends (``step`` -1: its
        start, before ``pos``; 1: its end, after it): the nearest offset such that the bytes
        between hold :data:`WINDOW` bytes as the secret rules read them
        (``content.scan_floor``), or the file's edge, or :data:`WINDOW_CAP` bytes away. The
        context grows by half at least each round: its cost is linear in what it takes."""
        limit = 0 if step < 0 else len(buf)
        ext = WINDOW
        while True:
            edge = max(limit, pos - ext) if step < 0 else min(limit, pos + ext)
            if edge == limit or ext >= WINDOW_CAP:
                return edge
            part = bytes(buf[edge:pos] if step < 0 else buf[pos:edge]).decode("utf-8", "ignore")
            short = WINDOW - content_rules.scan_floor(part)
            if short <= 0:
                return edge
            ext = min(WINDOW_CAP, ext + max(short, ext // 2))

    @classmethod
    def _check_secret(cls, buf: _Buffer, off: int, data: bytes) -> tuple[Refusal | None, bool]:
        """The secret verdict of writing ``data`` at ``off`` into ``buf`` (the window around
        it: ``_reach``), and whether that window was the whole content after the write and
        held no secret."""
        old_len = len(buf)
        end = off + len(data)
        ws = cls._reach(buf, min(off, old_len), -1)
        we = cls._reach(buf, end, 1) if end < old_len else end
        # an HTML comment (one line) the write closes or opens hides what it holds, however
        # long, from the markup view: its other end, on the same line, is in the window too
        # (the line's rest, within the cap)
        if b"-->" in data and ws > 0:
            lo = max(0, min(off, old_len) - WINDOW_CAP)
            ws = min(ws, lo + bytes(buf[lo:min(off, old_len)]).rfind(b"\n") + 1)
        if b"<!--" in data and we < old_len:
            hi = min(old_len, end + WINDOW_CAP)
            nl = bytes(buf[end:hi]).find(b"\n")
            we = max(we, hi if nl < 0 else end + nl + 1)
        after = bytes(buf[ws:off]) + b"\0" * max(0, off - old_len) + data + bytes(buf[end:we])
        found = content_rules.find_secret(after.decode("utf-8", "ignore"))
        if found is None:
            return None, ws == 0 and we >= old_len
        before = bytes(buf[ws:we])
        if content_rules.find_secret(before.decode("utf-8", "ignore")) is not None:
            return None, False  # held one already: close judges the file
        kind = found.rsplit(" on line ", 1)[0]
        return Refusal("secret_detected",
                       f"the write completes a secret ({kind}); memory must not store "
                       "credentials; the write was not applied"), False

    # ------------------------------------------------------------------ frontmatter type
    def _type_verdict(self, head: bytes) -> Refusal | None:
        if not head.startswith(_FENCES):
            return None
        return self.type_rule(head.decode("utf-8", "ignore"))

    @staticmethod
    def _after(buf: _Buffer, off: int, data: bytes, upto: int) -> bytes:
        """Bytes ``[0, upto)`` of ``buf`` as they would stand after writing ``data`` at ``off``."""
        out = bytes(buf[:min(off, upto)])
        if off < upto:
            out += b"\0" * max(0, off - len(buf)) + data[:upto - off]
            if off + len(data) < upto:
                out += bytes(buf[off + len(data):upto])
        return out

    def _check_type(self, buf: _Buffer, off: int, data: bytes) -> tuple[Refusal | None, object]:
        if off >= HEAD_BYTES:
            return None, self.head_error
        if not (bytes(buf[:6]).startswith(_FENCES) or self._after(buf, off, data, 6).startswith(_FENCES)):
            return None, None  # no frontmatter before or after: no type to judge
        before = self.head_error
        if before is _UNKNOWN:
            before = self._type_verdict(bytes(buf[:HEAD_BYTES]))
        after = self._type_verdict(self._after(buf, off, data, HEAD_BYTES))
        if after is not None and before is None:
            return Refusal(after.code, after.reason + "; the write was not applied"), before
        return None, after

    # ------------------------------------------------------------------ the checks
    def check_write(self, buf: _Buffer, off: int, data: bytes) -> Refusal | None:
        """Judge writing ``data`` at byte ``off`` into the file whose bytes are ``buf`` (not
        changed here). None: accepted, the state now describes the content after it."""
        refusal, ok_upto = self._check_utf8(buf, off, data)
        if refusal is not None:
            return refusal
        refusal, whole_clean = self._check_secret(buf, off, data)
        if refusal is not None:
            return refusal
        refusal, head = self._check_type(buf, off, data)
        if refusal is not None:
            return refusal
        self.ok_upto, self.head_error = ok_upto, head
        self.clean_len = max(len(buf), off + len(data)) if whole_clean else -1
        return None

    def check_truncate(self, buf: _Buffer, size: int) -> Refusal | None:
        """Judge ftruncate(2) of the file whose bytes are ``buf`` to ``size`` bytes: an
        extension adds NUL bytes (``EILSEQ``); a cut may leave a cut sequence at the end,
        which waits for the next write."""
        old_len = len(buf)
        self.clean_len = -1
        if size > old_len:
            if not self.bad:
                return Refusal("invalid_content",
                               f"extending the file to {size} bytes fills it with NUL characters; "
                               "records are UTF-8 text; the truncate was not applied")
            return None
        if not self.bad and size < self.ok_upto:
            start = size
            while start > 0 and _is_cont(buf[start]):
                start -= 1
            self.ok_upto = start  # [start, size) is a cut sequence, waiting for a write
        if size < HEAD_BYTES:
            self.head_error = _UNKNOWN
        return None
