"""How old a record's knowledge is: ``review_after`` and ``expires`` from its frontmatter,
stale records, and the expiry sweep.

A record may carry in its YAML frontmatter

- ``review_after``: a date or time (``2027-01-31``, ``2027-01-31T09:00:00Z``) after which it
  should be checked again;
- ``expires``: a date or time at which memfuse deletes it (a ``deleted`` version, actor
  ``admin:expiry``, restorable like any delete).

They are read at every write (``record_dates``, called by ``records._add_version`` and the
batch's deferred creates) into ``records.review_after`` / ``records.expires_at``
(revision ``0008_record_review``); a date means its midnight UTC; a value that is not a
date or time is ignored. A record is *stale* when it has not changed for ``stale_after``
(``memfuse serve --stale-after DAYS``, default 90, 0 = off) or its ``review_after`` has
passed: the prompt block names the stale entries of ``MEMORY.md`` and the console lists the
stale records of a store.

The sweep (``sweep_once``, run every ``--expiry-interval`` seconds by ``memfuse serve``)
deletes live records whose ``expires_at`` has passed and that did not change after it (a
record restored or edited after its expiry time stays), at most ``SWEEP_BATCH`` a round.
Safe with several replicas: each delete names the sha256 it read (``If-Match``), so a
record deleted or changed meanwhile by another replica or a writer is skipped (404 / 412),
never deleted twice nor deleted over a newer change.
"""
from __future__ import annotations

import logging
from datetime import date, datetime, time, timezone
from dataclasses import replace
from typing import Protocol

from sqlalchemy import ColumnElement, and_, false, or_, select
from sqlalchemy.engine import Connection

from memfuse import content as content_rules
from memfuse.server.base import LIVE_PATHS_ORDER, _R, _S, IdempotencyRequest, Principal, Reply, ServiceError
from memfuse.server.db import Database, utc_shift
from memfuse.server import promptline


class Service(Protocol):
    """What the expiry sweep needs of ``memfuse.server.service.Service`` (named here, so this
    module, which the services import, imports none of them)."""

    @property
    def db(self) -> Database: ...

    def delete_record(self, p: Principal, slug: str, record_id: str, if_match: str | None = None,
                      idem: IdempotencyRequest | None = None) -> Reply: ...

log = logging.getLogger(__name__)

STALE_AFTER_DAYS = 90  # default age after which an unchanged record is stale
SWEEP_INTERVAL = 60.0  # seconds between expiry sweeps (memfuse serve default)
SWEEP_BATCH = 200  # records one sweep round deletes at most
EXPIRY_ACTOR = Principal(workspace=None, name="expiry")  # versions say admin:expiry


def _when(value: object) -> datetime | None:
    """A frontmatter value as an aware UTC time: a date is its midnight UTC; a naive time is
    UTC; a string in ISO 8601 form likewise; anything else None, and so is a time whose UTC
    offset takes it before year 1 or past 9999 (``0001-01-01T00:00:00+01:00``: not a time
    Python can hold in UTC; attack24 F1, a 500 on every write of it)."""
    if isinstance(value, str):
        v = value.strip()
        try:
            value = datetime.fromisoformat(v.replace("Z", "+00:00")) if ("T" in v or " " in v) else date.fromisoformat(v)
        except (ValueError, OverflowError):
            return None
    if isinstance(value, datetime):
        if value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        try:
            return value.astimezone(timezone.utc)
        except (OverflowError, ValueError):
            return None
    if isinstance(value, date):
        return datetime.combine(value, time(0), tzinfo=timezone.utc)
    return None


def record_dates(text: str | None) -> tuple[datetime | None, datetime | None]:
    """(``review_after``, ``expires``) of a record's content (module docstring)."""
    if not text or not (text.startswith("---") or text.startswith("\ufeff---")):
        return None, None
    fm = content_rules.frontmatter(text)
    if not fm:
        return None, None
    return _when(fm.get("review_after")), _when(fm.get("expires"))


def stale_condition(now: datetime, stale_after_days: int) -> ColumnElement[bool]:
    """The SQL condition of a stale live record (module docstring)."""
    conds = [and_(_R.c.review_after.is_not(None), _R.c.review_after <= now)]
    if stale_after_days > 0:
        conds.append(_R.c.updated_at < utc_shift(now, -86400.0 * stale_after_days))
    return or_(*conds)


def sweep_once(svc: Service, now: datetime | None = None) -> int:
    """Delete the live records whose ``expires_at`` has passed and that did not change after
    it, at most ``SWEEP_BATCH``; returns how many this call deleted. Each delete is its own
    transaction with ``If-Match`` of the sha256 read, so a concurrent change or delete (other
    replica, a writer) skips the record. Errors other than 404 / 412 / 409 propagate."""
    now = now or datetime.now(timezone.utc)
    with svc.db.read_conn() as conn:
        rows = conn.execute(
            select(_R.c.id, _R.c.store, _R.c.sha256, _R.c.path, _S.c.account)
            .join(_S, _S.c.slug == _R.c.store)
            .where(_R.c.deleted == false(), _R.c.expires_at.is_not(None), _R.c.expires_at <= now,
                   _R.c.updated_at < _R.c.expires_at)
            .order_by(_R.c.expires_at).limit(SWEEP_BATCH)).all()
    done = 0
    for r in rows:
        try:
            # as the store's account's admin: ``r.store`` (a key) resolves in that account
            svc.delete_record(replace(EXPIRY_ACTOR, account=r.account), r.store, r.id, if_match=f'"{r.sha256}"')
        except ServiceError as e:
            if e.status in (404, 409, 412):
                continue
            raise
        done += 1
        log.info("record expired and deleted", extra={"store": r.store, "record_id": r.id})
    return done


async def sweep_forever(svc: Service, interval: float) -> None:
    """Run ``sweep_once`` every ``interval`` seconds in a worker thread until cancelled; a
    failed round is logged and retried at the next one."""
    import trio

    while True:
        try:
            n = await trio.to_thread.run_sync(sweep_once, svc)
            if n:
                log.info("expiry sweep deleted %d record(s)", n)
        except Exception:  # noqa: BLE001 - the next round tries again
            log.exception("expiry sweep failed")
        await trio.sleep(interval)


STALE_NAMES_MAX = 20  # stale entries the prompt block names at most


def stale_targets(conn: Connection, store: str, targets: list[str], now: datetime, stale_after_days: int
                  ) -> list[tuple[str, str]]:
    """(path, why) of the live records at ``targets`` of ``store`` that are stale, in the
    order of ``targets``: why is ``unchanged since YYYY-MM-DD`` or ``review after
    YYYY-MM-DD``. One query, on the live-path index."""
    if not targets:
        return []
    rows = conn.execute(select(_R.c.path, _R.c.updated_at, _R.c.review_after).where(
        _R.c.store == store, _R.c.deleted == false(), _R.c.path.in_(sorted(set(targets))),
        stale_condition(now, stale_after_days)).order_by(LIVE_PATHS_ORDER)).all()
    why = {}
    for path, updated, review in rows:
        if review is not None and review <= now:
            why[path] = f"review after {review.date().isoformat()}"
        else:
            why[path] = f"unchanged since {updated.date().isoformat()}"
    seen: set[str] = set()
    out = []
    for t in targets:
        if t in why and t not in seen:
            seen.add(t)
            out.append((t, why[t]))
    return out


def stale_marker(stale: list[tuple[str, str]], stale_after_days: int) -> str:
    """The prompt block's note naming the stale entries of a ``MEMORY.md`` (at most
    ``STALE_NAMES_MAX``, then how many more); ``""`` when none. Record paths are memory
    content shown outside the fence: ``promptline.quoted`` (one line, no backtick or bracket,
    at most ``promptline.NAME_MAX_CHARS`` characters)."""
    if not stale:
        return ""
    names = [f"{promptline.quoted(p)} ({why})" for p, why in stale[:STALE_NAMES_MAX]]
    more = len(stale) - len(names)
    age = f"not changed in {stale_after_days} days or " if stale_after_days > 0 else ""
    return (f"[memfuse: these entries link files {age}past their review date; verify them before "
            f"relying on them: {', '.join(names)}{f' and {more} more' if more else ''}.]")
