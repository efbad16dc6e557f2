"""Append versions: a version that extends the previous one is stored as what it adds.

A version row holds its content whole, or — when its content is the previous version's
content plus a suffix (an append such as ``echo line >> f``, and any version that keeps the
content: a move, an attribute change, a delete) — only that suffix, with ``base_version``
the version it extends (always ``version - 1`` of the same record) and ``chain`` the links
since the last whole copy. Every ``CHAIN_MAX`` links the next version is whole again, so the
content of any version is one whole copy plus at most ``CHAIN_MAX`` suffixes, read with one
indexed range query (``uq_versions_record_version``).

Rules that keep every version exact (docs/SEMANTICS.md, "Append versions"):

- a version is written as an append version only when its base still holds content (not
  pruned, not redacted) and the chain is shorter than ``CHAIN_MAX`` (``plan``);
- before a version loses its content (the history budget's pruning, a redaction), the
  version that extends it becomes a whole copy (``materialize_dependent``), so no kept
  version ever depends on a removed one. ``chain`` counts are not lowered then: they are an
  upper bound of the links, which is all a read needs;
- readers of version content go through ``resolve`` (history, restore, the change feed, the
  memory-store API's versions). The live content of a record is ``records.content`` and
  its tail (``memfuse.server.tails``).

The history budget still counts a version's whole size (``versions.size``): what the budget
bounds is the history a store shows, not the bytes it takes.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any, cast

from sqlalchemy import Table, bindparam, select, update
from sqlalchemy.engine import Connection

from memfuse.server.db import VersionRow

__all__ = ["CHAIN_MAX", "plan", "plan_append", "resolve", "content_of", "materialize_dependent", "materialize_all"]

_V = cast(Table, VersionRow.__table__)  # a mapped class's table (SQLAlchemy types it as a FromClause)
CHAIN_MAX = 32  # links from a whole copy before the next version is whole again

_SELECT_BASE = select(_V.c.chain, _V.c.content.is_not(None).label("kept")).where(
    _V.c.record_id == bindparam("rid"), _V.c.version == bindparam("v"))
_SELECT_CHAIN = (
    select(_V.c.version, _V.c.base_version, _V.c.content)
    .where(_V.c.record_id == bindparam("rid"), _V.c.version >= bindparam("lo"), _V.c.version < bindparam("v"))
    .order_by(_V.c.version.desc())
)


def plan(conn: Connection, record_id: str, version: int, base: str | None,
         content: str | None) -> tuple[str | None, int | None, int]:
    """How to store version ``version`` of record ``record_id`` whose content is ``content``,
    when the previous version's content is ``base`` (None: unknown, or no content): the
    ``(content column, base_version, chain)`` to write. An append version (only the suffix)
    when ``content`` starts with ``base`` and the previous version still holds content with
    a chain shorter than ``CHAIN_MAX`` (one indexed point read); else whole."""
    if content is None or base is None or version <= 1 or not content.startswith(base):
        return content, None, 0
    row = conn.execute(_SELECT_BASE, {"rid": record_id, "v": version - 1}).first()
    if row is None or not row.kept or row.chain >= CHAIN_MAX:
        return content, None, 0
    return content[len(base):], version - 1, row.chain + 1


def plan_append(conn: Connection, record_id: str, version: int, suffix: str,
                whole: Callable[[], str]) -> tuple[str | None, int | None, int]:
    """``plan`` for a version known to be the previous one plus ``suffix`` (an append):
    ``whole()`` (the whole new content) is called only when the version is stored whole."""
    if version > 1:
        row = conn.execute(_SELECT_BASE, {"rid": record_id, "v": version - 1}).first()
        if row is not None and row.kept and row.chain < CHAIN_MAX:
            return suffix, version - 1, row.chain + 1
    return whole(), None, 0


def content_of(conn: Connection, record_id: str, version: int, chain: int, suffix: str,
               known: dict[tuple[str, int], str] | None = None) -> str | None:
    """The whole content of append version ``version`` (its stored ``chain`` and ``suffix``):
    the last whole copy before it plus every suffix since, read with one range query (or
    from ``known``: (record id, version) → whole content already resolved). None when a link
    holds no content (never after the rules above; a database written otherwise)."""
    if known is not None:
        prev = known.get((record_id, version - 1))
        if prev is not None:
            return prev + suffix
    parts = [suffix]
    expected = version - 1
    for r in conn.execute(_SELECT_CHAIN, {"rid": record_id, "lo": version - max(chain, 1), "v": version}):
        if r.version != expected or r.content is None:
            return None
        parts.append(r.content)
        if r.base_version is None:
            parts.reverse()
            return "".join(parts)
        expected -= 1
    return None


def resolve(conn: Connection, rows: Sequence[Any]) -> list[Any]:
    """``rows`` (version rows with ``record_id``, ``version``, ``content``, ``base_version``
    and ``chain``) with each append version's ``content`` replaced by its whole content (as
    a ``SimpleNamespace`` with the row's members); others are returned as they are. Rows of
    one record in version order reuse the previous one's content (a feed page of many
    appends reads each link once)."""
    out: list[Any] = []
    known: dict[tuple[str, int], str] = {}
    for r in rows:
        if getattr(r, "base_version", None) is not None and r.content is not None:
            whole = content_of(conn, r.record_id, r.version, r.chain, r.content, known)
            r = SimpleNamespace(**{**r._mapping, "content": whole})
        if r.content is not None:
            known[(r.record_id, r.version)] = r.content
        out.append(r)
    return out


def materialize_dependent(conn: Connection, record_id: str, version: int) -> int:
    """Version ``version`` of ``record_id`` is about to lose its content (pruned, redacted):
    the version that extends it, if any, becomes a whole copy first. Returns the bytes of
    content this added (UTF-8 of the base part), 0 when nothing depends on it."""
    dep = conn.execute(select(_V.c.seq, _V.c.chain, _V.c.content).where(
        _V.c.record_id == record_id, _V.c.version == version + 1, _V.c.base_version.is_not(None),
        _V.c.content.is_not(None))).first()
    if dep is None:
        return 0
    whole = content_of(conn, record_id, version + 1, dep.chain, dep.content)
    if whole is None:
        return 0
    conn.execute(update(_V).where(_V.c.seq == dep.seq).values(content=whole, base_version=None, chain=0))
    return len(whole.encode()) - len(dep.content.encode())


def materialize_all(conn: Connection) -> int:
    """Make every append version whole (before a downgrade to a schema that reads every
    version's content as whole). Returns how many were rewritten."""
    rows = conn.execute(select(_V.c.seq, _V.c.record_id, _V.c.version, _V.c.chain, _V.c.content).where(
        _V.c.base_version.is_not(None)).order_by(_V.c.record_id, _V.c.version.desc())).all()
    wholes = []
    for r in rows:  # newest first: each is resolved before any of its links is rewritten
        whole = content_of(conn, r.record_id, r.version, r.chain, r.content) if r.content is not None else None
        wholes.append({"s": r.seq, "c": whole})
    if wholes:
        conn.execute(update(_V).where(_V.c.seq == bindparam("s")).values(
            content=bindparam("c"), base_version=None, chain=0), wholes)
    return len(wholes)
