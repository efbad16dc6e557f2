"""The index report of a store (``GET /v1/stores/{store}/index``): how its ``MEMORY.md``
and its records agree, and what of ``MEMORY.md`` the prompt block leaves out.

- an *entry* is a line of ``MEMORY.md`` holding at least one local Markdown link
  (``[text](notes/a.md)``; ``<…>`` and a title allowed; links with a scheme ``https:`` /
  ``mailto:``, pure anchors ``#x`` and absolute paths are not local). A target is read
  relative to the store root (where ``MEMORY.md`` is): ``./`` and ``..`` resolved, ``%XX``
  decoded, ``#anchor`` / ``?query`` dropped; a target ending in ``/`` or naming a directory
  of the store links that directory;
- ``missing``: entries whose target is neither a live record nor a directory holding one
  (or leaves the store: ``../x``);
- ``unindexed``: live records (but ``MEMORY.md``) that ``MEMORY.md`` does not mention: not
  linked, not under a linked directory, and their path not written in it as a word
  (`` `notes/a.md` `` counts); listed up to ``UNINDEXED_MAX`` in path order, all counted;
- ``omitted``: entries on the lines the prompt block cuts (``context.cut_index``: 200 lines,
  25,000 bytes), which agents never see in their prompt. The prompt block names them too
  (``indexlinks.omitted_marker``);
- the lists ``missing`` and ``omitted`` hold the first ``ENTRIES_LISTED_MAX`` entries,
  ``missing_count`` / ``omitted_count`` count them all; only the first
  ``REPORT_SCAN_CHARS`` characters of ``MEMORY.md`` (whole lines) are read for entries and
  mentions (``bytes_scanned`` says how many bytes were; a path mentioned only after them counts
  as unindexed), so the report's work and size are bounded whatever the index (attack 13
  F10: a 1 MiB index of ``[](a)`` lines made a 14 MiB answer in seconds);
- ``stale``: the store's stale live records (``staleness``: unchanged for the server's
  ``stale_after_days``, or past their ``review_after``), oldest change first, up to
  ``STALE_MAX`` listed, all counted.

Memory content is untrusted: an entry's ``text`` is the line as stored, cut at
``search.LINE_MAX_CHARS`` characters; whoever renders it escapes it.
"""
from __future__ import annotations

import re

from sqlalchemy import false, func, select

from memfuse import content as content_rules
from memfuse.models import IndexEntry, IndexReport, StaleRecord
from memfuse.server import keys, staleness, tails
from memfuse.server.base import _R, Principal, Resource
from memfuse.server.context import cut_index
from memfuse.server.db import utcnow
from memfuse.server.indexlinks import Entry, entries, line_count
from memfuse.server.search import cut_line

WORDISH_RE = re.compile(r"[^\s`'\"()<>\[\]{},;|*]+")
UNINDEXED_MAX = 1000  # unindexed records listed at most (all are counted)
STALE_MAX = 100  # stale records listed at most (all are counted)
ENTRIES_LISTED_MAX = 1000  # missing / omitted entries listed at most (all are counted)
REPORT_SCAN_CHARS = 256 * 1024  # characters of MEMORY.md read for entries and mentions, at most


def _entry_model(e: Entry) -> IndexEntry:
    return IndexEntry(line=e.line, text=cut_line(e.text), target=e.target if e.target is not None else e.raw)


class IndexReportService(Resource):
    """``Service.index_report``."""

    def index_report(self, p: Principal, slug: str) -> IndexReport:
        """The index report of store ``slug`` (module docstring): reads the store's live
        paths (no content) and its ``MEMORY.md``. Raises 404 like ``list_records``."""
        with self.db.read_conn() as conn:
            st = self._store(conn, p, slug)
            rows = conn.execute(select(_R.c.path, tails.LIVE_CONTENT).where(
                _R.c.store == st.slug, _R.c.deleted == false(), _R.c.path == content_rules.INDEX_PATH)).first()
            paths = sorted(conn.execute(select(_R.c.path).where(
                _R.c.store == st.slug, _R.c.deleted == false())).scalars())
            now = utcnow()
            stale_where = (_R.c.store == st.slug, _R.c.deleted == false(),
                           staleness.stale_condition(now, self.settings.stale_after_days))
            stale = [StaleRecord(path=r.path, updated_at=r.updated_at, review_after=r.review_after,
                                 expires_at=r.expires_at)
                     for r in conn.execute(select(_R.c.path, _R.c.updated_at, _R.c.review_after, _R.c.expires_at)
                                           .where(*stale_where).order_by(_R.c.updated_at, _R.c.path)
                                           .limit(STALE_MAX))]
            stale_count = conn.scalar(select(func.count()).select_from(_R).where(*stale_where)) or 0
        text = (rows.content or "") if rows is not None else ""
        scanned = text
        if len(text) > REPORT_SCAN_CHARS:  # whole lines, unless the first is longer
            scanned = text[:REPORT_SCAN_CHARS]
            if "\n" in scanned:
                scanned = scanned[:scanned.rindex("\n") + 1]
        live = set(paths)
        dirs: set[str] = set()
        for path in paths:
            parts = path.split("/")
            for k in range(1, len(parts)):
                dirs.add("/".join(parts[:k]))
        found = entries(scanned)
        missing = [e for e in found if e.target is None or (e.target not in live and e.target not in dirs)]
        linked_files = {e.target for e in found if e.target is not None and not e.dir and e.target in live}
        linked_dirs = {e.target for e in found if e.target is not None and e.target in dirs}
        words = {w.strip(".:!?").removeprefix("./") for w in WORDISH_RE.findall(scanned)}
        unindexed: list[str] = []
        count = 0
        for path in paths:
            if path == content_rules.INDEX_PATH or path in linked_files or path in words:
                continue
            parts = path.split("/")
            if any("/".join(parts[:k]) in linked_dirs for k in range(1, len(parts))):
                continue
            count += 1
            if len(unindexed) < UNINDEXED_MAX:
                unindexed.append(path)
        total_lines = line_count(text)
        _, lines_left, bytes_left = cut_index(text)
        n_shown = total_lines - lines_left
        omitted = [e for e in found if e.line > n_shown]
        return IndexReport(
            store=keys.public(st.slug), index_exists=rows is not None, entries=len(found),
            missing=[_entry_model(e) for e in missing[:ENTRIES_LISTED_MAX]], missing_count=len(missing),
            unindexed=unindexed, unindexed_count=count,
            omitted=[_entry_model(e) for e in omitted[:ENTRIES_LISTED_MAX]], omitted_count=len(omitted),
            bytes_scanned=len(scanned.encode()),
            lines=total_lines, lines_shown=n_shown, bytes=len(text.encode()), bytes_shown=len(text.encode()) - bytes_left,
            stale=stale, stale_count=stale_count, stale_after_days=self.settings.stale_after_days,
        )
