"""Record tails: the live content of a large record is its stored content plus what was
appended since, so an append writes what it appends (revision ``0018_record_tails``).

Why: the database rewrites a whole row, with every overflow page (SQLite) or TOAST chunk
(PostgreSQL) of its content, when the row's content changes: an append of one line to a
1 MiB record wrote 1 MiB again (bench/README.md, "Appends, session 10"). An append to a
large record therefore leaves ``records.content`` (the *base*) alone and writes the
``record_tails`` row of the record (the *tail*): the base is written again once the tail
passes ``TAIL_MAX_BYTES`` (a *fold*: what the tail held up to its secret-scan context moves
to the base), and by every write of the record that is not an append (an update, a move, an
attribute change, a delete or a restore writes the whole content, as before, and deletes the
tail: ``drop``).

The one rule: the live content is ``records.content || coalesce(tail, '')``,
``memfuse.defs.LIVE_CONTENT_SQL``, ``LIVE_CONTENT`` here as a SQLAlchemy column labelled
``content``; every statement that reads a record's content selects that (``live``), never
``records.content`` (tests/test_record_tails.py reads the whole read surface of a record with
a tail and of one without, and compares).

INVARIANT (``RecordTailRow``): a tail exists only for a live record whose base holds at least
``fulltext.PG_MAX_CHARS`` characters and ends with a line end (``\\n``), and the tail holds at
least ``APPEND_SCAN_CONTEXT`` characters. So, while a record has a tail:

- the full-text index's head (the first ``PG_MAX_CHARS`` characters) is in the base and does
  not change with an append (the index's triggers see no change, and need no tail);
- the frontmatter (within the first 64 KiB of a content: type, review and expiry dates) is
  in the base and does not change: the tail row keeps its block (``head``, at most
  ``HEAD_MAX_CHARS``; ``memfuse.content.frontmatter_head``), which an append reads instead
  of the base;
- the secret scan's context of the next append (the ``APPEND_SCAN_CONTEXT`` characters
  before it, from their line start: ``recordrows.scan_context``) is in the tail.

A tail starts at an append to a record whose new content has at least ``PG_MAX_CHARS``
characters before the scan context's line start (the last whole write of the base); it moves
on at each fold, and ends at any other write.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import Table, Text, bindparam, case, delete, exists, insert, literal_column, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.sql.elements import ColumnElement

from memfuse.content import frontmatter_head
from memfuse.defs import LIVE_CONTENT_SQL
from memfuse.server.db import RecordRow, RecordTailRow
from memfuse.server.fulltext import PG_MAX_CHARS

__all__ = ["TAIL_MAX_BYTES", "HEAD_MAX_CHARS", "LIVE_CONTENT", "LIVE_CONTENT_EXPR", "live", "Append", "scan_context", "read_for_append",
           "live_content", "write", "drop", "HAS_TAIL", "SCAN_CONTEXT"]

_R = cast(Table, RecordRow.__table__)
_T = cast(Table, RecordTailRow.__table__)

#: a tail longer than this (UTF-8 bytes) is folded into the base at the append that makes it
#: so: the base is written once per ~48 KiB appended, the tail row is at most this
TAIL_MAX_BYTES = 64 * 1024
#: the longest frontmatter block a tail keeps as its ``head`` (a longer one: no tail, the
#: record's appends write it whole as before)
HEAD_MAX_CHARS = 4096
#: characters before an appended suffix that the secret scan reads with it (from the start
#: of their line; ``recordrows.APPEND_SCAN_CONTEXT``)
SCAN_CONTEXT = 16 * 1024

#: a record's live content (the one rule; module docstring), labelled ``content``
LIVE_CONTENT_EXPR: ColumnElement[str] = literal_column(LIVE_CONTENT_SQL, Text)
#: ``LIVE_CONTENT_EXPR`` labelled ``content`` (a selected column; conditions use the former)
LIVE_CONTENT: ColumnElement[str] = LIVE_CONTENT_EXPR.label("content")
#: whether a record has a tail, labelled ``tailed`` (a writer of the whole content drops it)
HAS_TAIL: ColumnElement[bool] = exists().where(_T.c.record_id == _R.c.id).label("tailed")


def live(cols: tuple[Any, ...]) -> tuple[Any, ...]:
    """``cols`` (columns of ``records``) with ``records.content`` replaced by ``LIVE_CONTENT``."""
    return tuple(LIVE_CONTENT if c is _R.c.content else c for c in cols)


def scan_context(text: str) -> str:
    """The end of ``text`` the secret scan reads before an appended suffix: its last
    ``SCAN_CONTEXT`` characters, from the start of their line (the whole of ``text`` when it
    is shorter, or when that line starts it)."""
    start = max(0, len(text) - SCAN_CONTEXT)
    if start:
        nl = text.rfind("\n", 0, start)
        start = nl + 1 if nl >= 0 else 0
    return text[start:]


@dataclass
class Append:
    """An append being written: ``suffix`` added to a record whose previous live content is
    ``base + tail`` (``tail`` None: the record had no tail, and the caller holds its whole
    content)."""

    suffix: str
    tail: str | None


#: the record's columns but content; ``content``: the base whole when the record has no tail,
#: else the base's frontmatter block (``head``); ``tail``: the tail, or NULL
_SELECT_FOR_APPEND = (
    select(*(c for c in _R.c if c.name != "content"), _T.c.tail,
           case((_T.c.tail.is_(None), _R.c.content), else_=_T.c.head).label("content"))
    .select_from(_R.outerjoin(_T, _T.c.record_id == _R.c.id))
    .where(_R.c.id == bindparam("rid"))
)
_SELECT_LIVE = select(LIVE_CONTENT).select_from(_R).where(_R.c.id == bindparam("rid"))
_INSERT_TAIL = insert(_T)
_UPDATE_TAIL = update(_T).where(_T.c.record_id == bindparam("rid"))
_DELETE_TAIL = delete(_T).where(_T.c.record_id == bindparam("rid"))
_FOLD = update(_R).where(_R.c.id == bindparam("rid")).values(content=_R.c.content + bindparam("moved", type_=Text))


def read_for_append(conn: Connection, record_id: str) -> Any:
    """The record's row for an append (``_SELECT_FOR_APPEND``: no whole base when it has a
    tail), or None. One indexed read."""
    return conn.execute(_SELECT_FOR_APPEND, {"rid": record_id}).first()


def live_content(conn: Connection, record_id: str) -> str | None:
    """The record's whole live content (base and tail), read by the database."""
    return cast("str | None", conn.scalar(_SELECT_LIVE, {"rid": record_id}))


def _split(content: str) -> int:
    """Where a tail of ``content`` would start: the line start of its scan context
    (``scan_context``), 0 when there is none (no line end before the context)."""
    nl = content.rfind("\n", 0, max(0, len(content) - SCAN_CONTEXT))
    return nl + 1 if nl >= 0 and len(content) > SCAN_CONTEXT else 0


def write(conn: Connection, record_id: str, append: Append,
          content: Callable[[], str]) -> tuple[str | None, bool]:
    """Store the live content after ``append`` (the record's row not yet updated): returns
    what the caller writes to ``records.content`` (None: leave it as it is) and whether the
    record has a tail now. ``content``: the whole new content (called only when the record
    had no tail, where the caller holds it).

    - a tail: the suffix joins it; past ``TAIL_MAX_BYTES`` the tail up to its scan context
      moves to the base (one statement that rewrites the base; all of it, and no tail, when
      the tail has no line end before its scan context);
    - no tail: one starts when the new content holds at least ``PG_MAX_CHARS`` characters
      before its scan context's line start and what follows is within ``TAIL_MAX_BYTES``
      (the base is then written without it); otherwise the whole content is written."""
    if append.tail is not None:
        tail = append.tail + append.suffix
        if len(tail) <= TAIL_MAX_BYTES // 4 or len(tail.encode("utf-8")) <= TAIL_MAX_BYTES:
            conn.execute(_UPDATE_TAIL, {"rid": record_id, "tail": tail})
            return None, True
        cut = _split(tail)
        conn.execute(_FOLD, {"rid": record_id, "moved": tail[:cut] if cut else tail})
        if cut:
            conn.execute(_UPDATE_TAIL, {"rid": record_id, "tail": tail[cut:]})
            return None, True
        conn.execute(_DELETE_TAIL, {"rid": record_id})
        return None, False
    whole = content()
    cut = _split(whole)
    if cut < PG_MAX_CHARS or len(whole) - cut > TAIL_MAX_BYTES or len(whole[cut:].encode("utf-8")) > TAIL_MAX_BYTES:
        return whole, False
    head = frontmatter_head(whole)
    if len(head) > HEAD_MAX_CHARS:
        return whole, False
    conn.execute(_INSERT_TAIL, {"record_id": record_id, "tail": whole[cut:], "head": head})
    return whole[:cut], True


def drop(conn: Connection, record_id: str) -> None:
    """Delete the record's tail (a write that stores the whole content: module docstring)."""
    conn.execute(_DELETE_TAIL, {"rid": record_id})


def drop_many(conn: Connection, record_ids: list[str]) -> None:
    """``drop`` for each of ``record_ids`` (one executemany: a prefix move)."""
    if record_ids:
        conn.execute(_DELETE_TAIL, [{"rid": rid} for rid in record_ids])
