"""The history budget of a store: how much past versions' content the control plane keeps.

Every write keeps the content of the version it makes, so without a bound a store's history
grows with every rewrite (300 rewrites of a 1 KiB record in a 4 KiB store kept 300 KB). Each
store has a budget (docs/SEMANTICS.md "History budget"; the store's own settings, else the
defaults of :mod:`memfuse.defs`):

- ``max_history_bytes`` (default 16 x ``max_store_bytes``): content bytes of past versions;
- ``max_history_versions`` (default 16 x ``max_records``): past versions with content;
- ``history_min_age_s`` (default 24 h): a version younger than this is never pruned, whatever
  the budget says (a mistake of the last day can always be undone).

*History* is every version whose content is kept, minus the current version of each live
record (those are the live content, counted by ``usage_bytes`` / ``record_count``). The store
row counts the kept versions (``version_bytes`` / ``version_count``) in the same transaction
as every write: ``note_kept`` collects a transaction's changes in ``conn.info`` and
``settle`` (called at the end of every record write transaction, single or batch) adds them
in one statement per store, then prunes when the store is over its budget: the oldest past
versions (by change-feed seq) older than the minimum age lose their content (``content`` NULL,
``pruned`` true; path, sha256, size, time and actor kept), until the history fits. A kept
append version built on a pruned one is made whole first (``deltas.materialize_dependent``). A pruned
version shows ``pruned: true`` in the history of every face; showing or restoring its content
answers 409 ``pruned``.

Pruning runs in the write transaction that went over the budget, so it costs that write one
indexed read (``ix_versions_store_seq``) and two updates; a store over its budget with
nothing old enough to prune is not looked at again for ``IDLE_RECHECK`` s by this process.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import Table, bindparam, or_, select, true, update
from sqlalchemy.engine import Connection

from memfuse.defs import HISTORY_BYTES_FACTOR, HISTORY_MIN_AGE_S, HISTORY_VERSIONS_FACTOR, INT64_MAX
from memfuse.server import deltas
from memfuse.server.db import RecordRow, StoreRow, VersionRow, info_of, utc_shift, utcnow
from memfuse.server.rawsql import Raw

if TYPE_CHECKING:  # for the annotations only
    from prometheus_client.metrics_core import Metric

__all__ = ["budget", "usage", "note_kept", "kept_mark", "kept_rollback", "reset", "settle",
           "forget_idle", "collector", "PRUNED", "IDLE_RECHECK"]

log = logging.getLogger("memfuse.server.service")

# mapped classes' tables (SQLAlchemy types ``__table__`` as a FromClause)
_S, _R, _V = (cast(Table, StoreRow.__table__), cast(Table, RecordRow.__table__),
              cast(Table, VersionRow.__table__))
_KEY = "memfuse_kept"  # conn.info: store slug -> [bytes, count] of kept versions added
PRUNE_BATCH = 500  # candidate versions read per pass
IDLE_RECHECK = 30.0  # s before a store with nothing prunable is looked at again

_UPDATE_KEPT = (
    update(_S)
    .where(_S.c.slug == bindparam("slug_"))
    .values(version_bytes=_S.c.version_bytes + bindparam("d_bytes"),
            version_count=_S.c.version_count + bindparam("d_count"))
)
#: what ``budget`` and ``usage`` read, given back by the updates below (RETURNING)
_BUDGET_COLUMNS = (_S.c.slug, _S.c.max_history_bytes, _S.c.max_store_bytes, _S.c.max_history_versions,
                   _S.c.max_records, _S.c.history_min_age_s, _S.c.version_bytes, _S.c.usage_bytes,
                   _S.c.version_count, _S.c.record_count)
_UPDATE_KEPT_RETURNING = _UPDATE_KEPT.returning(*_BUDGET_COLUMNS)
#: a write's usage counters and kept-version counters in one statement (``settle_with_usage``),
#: without RETURNING: SQLite runs a RETURNING through an ephemeral table, ~30 k instructions
#: plus ~2 k a column (an UPDATE of the store row 23 k without, 70 k with the ten
#: ``_BUDGET_COLUMNS``; bench/README.md, "The close path, session 20: serve's writer")
_UPDATE_USAGE_KEPT = (
    update(_S)
    .where(_S.c.slug == bindparam("slug_"))
    .values(usage_bytes=_S.c.usage_bytes + bindparam("d_bytes"),
            record_count=_S.c.record_count + bindparam("d_count"),
            version_bytes=_S.c.version_bytes + bindparam("k_bytes"),
            version_count=_S.c.version_count + bindparam("k_count"))
)
# the two updates of every record write, run on the DB-API cursor (memfuse.server.rawsql)
_RAW_UPDATE_KEPT_RETURNING = Raw(_UPDATE_KEPT_RETURNING)
_RAW_UPDATE_USAGE_KEPT = Raw(_UPDATE_USAGE_KEPT)


class _Totals:
    """What this process pruned (``memfuse_server_history_pruned_*`` metrics)."""

    def __init__(self) -> None:
        self.versions = 0
        self.bytes = 0
        self.lock = threading.Lock()


PRUNED = _Totals()
_idle_until: dict[str, float] = {}  # store slug -> time.monotonic() before which not to look


def budget(st: Any) -> tuple[int, int, int]:
    """(max bytes, max versions, minimum age in s) of the history of store row ``st``: its
    own settings, else the defaults (16 x ``max_store_bytes``, 16 x ``max_records``, 24 h),
    each at most ``INT64_MAX`` (a limit of 2^63-1 times 16 must still fit a 64-bit integer in
    answers and SQL parameters)."""
    b = st.max_history_bytes if st.max_history_bytes is not None else HISTORY_BYTES_FACTOR * st.max_store_bytes
    n = (st.max_history_versions if st.max_history_versions is not None
         else HISTORY_VERSIONS_FACTOR * st.max_records)
    age = st.history_min_age_s if st.history_min_age_s is not None else HISTORY_MIN_AGE_S
    return min(int(b), INT64_MAX), min(int(n), INT64_MAX), min(int(age), INT64_MAX)


def usage(st: Any) -> tuple[int, int]:
    """(bytes, versions) of store row ``st``'s history: its kept versions minus its live
    records (never below 0: a rolling update may leave old replicas' versions uncounted)."""
    return (max(0, (st.version_bytes or 0) - (st.usage_bytes or 0)),
            max(0, (st.version_count or 0) - (st.record_count or 0)))


def note_kept(conn: Connection, store: str, d_bytes: int, d_count: int) -> None:
    """Note in this transaction that ``store`` keeps ``d_count`` more versions holding
    ``d_bytes`` more content (negative: content removed, by a redaction)."""
    kept = info_of(conn).setdefault(_KEY, {})
    b, n = kept.get(store, (0, 0))
    kept[store] = (b + d_bytes, n + d_count)


def kept_mark(conn: Connection) -> dict[str, tuple[int, int]]:
    """The notes so far (for ``kept_rollback`` when a savepoint is rolled back)."""
    return dict(conn.info.get(_KEY, {}))


def kept_rollback(conn: Connection, mark: dict[str, tuple[int, int]]) -> None:
    """Forget the notes made since ``kept_mark`` returned ``mark``."""
    conn.info[_KEY] = dict(mark)


def reset(conn: Connection) -> None:
    """Drop notes left on a pooled connection by a transaction that did not settle."""
    info_of(conn).pop(_KEY, None)


def settle(conn: Connection) -> None:
    """At the end of a record write transaction: add the noted kept versions to each
    store's counters, then prune each store that is over its history budget."""
    kept = info_of(conn).pop(_KEY, None)
    if not kept:
        return
    for store, (d_bytes, d_count) in kept.items():
        params = {"slug_": store, "d_bytes": d_bytes, "d_count": d_count}
        if d_bytes > 0 or d_count > 0:
            # the counters' new values come back with the update (RETURNING: SQLite 3.35+,
            # PostgreSQL), so the budget check costs no second statement
            _prune(conn, store, _RAW_UPDATE_KEPT_RETURNING.first(conn, params))
        elif d_bytes or d_count:
            conn.execute(_UPDATE_KEPT, params)


class _Counted:
    """A store row's ``_BUDGET_COLUMNS`` after a write added to its counters (what the
    UPDATE's RETURNING gave): ``st``'s values plus the deltas."""

    __slots__ = ("slug", "max_history_bytes", "max_store_bytes", "max_history_versions", "max_records",
                 "history_min_age_s", "version_bytes", "usage_bytes", "version_count", "record_count")

    def __init__(self, st: Any, d_bytes: int, d_count: int, k_bytes: int, k_count: int) -> None:
        self.slug = st.slug
        self.max_history_bytes, self.max_store_bytes = st.max_history_bytes, st.max_store_bytes
        self.max_history_versions, self.max_records = st.max_history_versions, st.max_records
        self.history_min_age_s = st.history_min_age_s
        self.usage_bytes, self.record_count = st.usage_bytes + d_bytes, st.record_count + d_count
        self.version_bytes, self.version_count = st.version_bytes + k_bytes, st.version_count + k_count


def settle_with_usage(conn: Connection, st: Any, d_bytes: int, d_count: int) -> bool:
    """Add ``d_bytes`` / ``d_count`` to store ``st``'s usage counters (``usage_bytes`` /
    ``record_count``) in the same statement as what ``note_kept`` noted for it so far in this
    transaction (then settled here, pruning as ``settle`` would): one UPDATE for a write that
    changes both. ``st``: the store row this transaction read for writing (under the write
    lock: SQLite's, PostgreSQL's ``FOR UPDATE``) with nothing in it changing the row's
    counters since, so its counters plus the deltas are the row's new ones (the budget check
    needs no RETURNING; ``tests/test_history_budget.py`` compares them with the row). False
    (nothing done) when nothing is noted for the store: the caller updates its usage counters
    itself."""
    kept: dict[str, tuple[int, int]] | None = info_of(conn).get(_KEY)
    store = st.slug
    kb, kn = kept.get(store, (0, 0)) if kept else (0, 0)
    if not (kb or kn):
        return False
    assert kept is not None  # kb or kn came from it
    del kept[store]
    _RAW_UPDATE_USAGE_KEPT.run(conn, {"slug_": store, "d_bytes": d_bytes, "d_count": d_count,
                                      "k_bytes": kb, "k_count": kn})
    if kb > 0 or kn > 0:
        _prune(conn, store, _Counted(st, d_bytes, d_count, kb, kn))
    return True


def _prune(conn: Connection, store: str, st: Any = None) -> None:
    """Prune ``store``'s oldest versions while its history is over budget. ``st``: the store
    row as it is now in this transaction (read here when None)."""
    if st is None:
        st = conn.execute(select(_S).where(_S.c.slug == store)).first()
    if st is None:
        return
    max_b, max_n, min_age = budget(st)
    hist_b, hist_n = usage(st)
    over_b, over_n = hist_b - max_b, hist_n - max_n
    if over_b <= 0 and over_n <= 0:
        return
    if _idle_until.get(store, 0.0) > time.monotonic():
        return
    cutoff = utc_shift(utcnow(), -min_age)  # a min age past year 1: nothing is old enough
    rows = conn.execute(
        select(_V.c.seq, _V.c.size, _V.c.record_id, _V.c.version, _R.c.deleted, _R.c.version.label("current"))
        .select_from(_V.join(_R, _R.c.id == _V.c.record_id))
        .where(_V.c.store == store, _V.c.content.is_not(None), _V.c.created_at < cutoff,
               or_(_R.c.deleted == true(), _R.c.version != _V.c.version))
        .order_by(_V.c.seq).limit(PRUNE_BATCH)
    ).all()
    seqs: list[int] = []
    gone_records: list[str] = []  # deleted records whose last version is pruned: no content left
    freed = 0
    for r in rows:
        if over_b <= 0 and over_n <= 0:
            break
        seqs.append(r.seq)
        freed += r.size
        over_b -= r.size
        over_n -= 1
        if r.deleted and r.version == r.current:
            gone_records.append(r.record_id)
    if seqs:
        # an append version kept after a pruned one becomes whole first (memfuse.server.deltas)
        chosen = set(seqs)
        pruning = {(r.record_id, r.version) for r in rows if r.seq in chosen}
        for rid, v in sorted(pruning):
            if (rid, v + 1) not in pruning:
                deltas.materialize_dependent(conn, rid, v)
        conn.execute(update(_V).where(_V.c.seq.in_(seqs)).values(content=None, pruned=True,
                                                                 base_version=None, chain=0))
        if gone_records:
            conn.execute(update(_R).where(_R.c.id.in_(gone_records)).values(content=None))
        conn.execute(_UPDATE_KEPT, {"slug_": store, "d_bytes": -freed, "d_count": -len(seqs)})
        with PRUNED.lock:
            PRUNED.versions += len(seqs)
            PRUNED.bytes += freed
        log.info("history budget: pruned the content of %d versions (%d bytes) of store %s",
                 len(seqs), freed, store)
    if over_b > 0 or over_n > 0:
        # still over: what is left is younger than the minimum age (or the current content)
        _idle_until[store] = time.monotonic() + IDLE_RECHECK
    else:
        _idle_until.pop(store, None)


def forget_idle(store: str) -> None:
    """``store``'s budget changed: look at it again at its next write."""
    _idle_until.pop(store, None)


def collector() -> Callable[[], list[Metric]]:
    """Metric families of what this process pruned (``ServerMetrics.add_collector``)."""
    from prometheus_client.core import CounterMetricFamily

    def collect() -> list[Metric]:
        v = CounterMetricFamily("memfuse_server_history_pruned_versions",
                                "Versions whose content the history budget pruned")
        v.add_metric([], PRUNED.versions)
        b = CounterMetricFamily("memfuse_server_history_pruned_bytes",
                                "Content bytes the history budget pruned")
        b.add_metric([], PRUNED.bytes)
        return [v, b]

    return collect
