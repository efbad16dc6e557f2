"""Consolidation jobs: a model rewrites a store's records (``/v1/stores/{store}/consolidations``).

A job reads a store's live records (and, when asked, its recent change history: paths,
operations, actors and times, never past content), asks a model through the Anthropic
Messages API (the official ``anthropic`` SDK, at the endpoint ``memfuse serve
--consolidation-model-url`` names, with the key of ``--consolidation-api-key-file``), and
writes what the model answered as versions whose actor is ``job:<id>``:

- ``new_store`` (the default): a new store ``<store>-consolidated-<n>`` holding the input's
  records with the model's changes applied, for a person to review and swap in; attached
  nowhere, whoever asked: the model's text (its ``MEMORY.md`` too) is untrusted and reaches
  no workspace's prompt block until an admin accepts it by attaching it (attack 15 F4);
- ``in_place``: the store itself; every change is an ordinary version (restore undoes it),
  each update and delete made ``If-Match`` the content the model read, so a record changed
  since then fails the job instead of being overwritten.

The model must answer with one call of the ``apply_consolidation`` tool (``TOOL``: a strict
JSON schema of ``write`` / ``delete`` changes and a summary). Its answer is untrusted: the
changes are validated again here (``Output``: no other members, bounded counts and sizes,
each path at most once, a delete only of an input record) and become record writes planned
exactly as the batch endpoint plans them, so every path and content goes through the rules of
any API write (names, secrets in paths and content, UTF-8, types, record and store sizes).
All the writes, the new store and the job's completion are one transaction: a job that fails,
is canceled or times out writes nothing, and its input is never touched.

Bounds (``ConsolidationSettings``): the input (paths and contents of the live records, in
UTF-8 bytes) at most ``max_input_bytes``, refused at creation (413 ``input_too_large``) and
again when the job reads the store (failed): nothing is truncated, so a model never rewrites
a store it only saw part of; the model's answer at most ``max_output_tokens`` tokens (a cut
answer fails the job), ``MAX_CHANGES`` changes and ``max_output_bytes`` bytes of content; the
whole job at most ``timeout`` seconds; one ``pending`` or ``running`` job per store, which
the database enforces (a unique index over the active jobs: 409 ``job_running`` on any
replica). A workspace token's jobs also (``_check_workspace_bounds``, attack 15 F4): at most
``max_unreviewed`` ``new_store`` outputs of a store waiting for review (409
``review_pending``), at most ``workspace_jobs_per_hour`` jobs a workspace creates in an hour
(429 ``rate_limited``); an admin's and the scheduler's jobs are not bounded there.

Jobs are rows (``consolidation_jobs``). The process running a job refreshes its
``heartbeat_at`` every ``heartbeat`` seconds; a job whose heartbeat is older than
``stale_after`` (its process died, or was restarted) is marked failed by whichever replica
looks next (every job read, list, creation and scheduler round), which frees its store.
Cancel marks the row ``canceled`` at once (any replica); the runner notices at its next
heartbeat (or at once in the same process), abandons the model call, and its final
transaction, which only completes a job still ``running``, writes nothing.

Scheduled maintenance (``schedule_once``, run by ``memfuse serve`` every ``schedule_tick``
seconds when ``idle_after`` and ``interval`` are set): a store is consolidated only when its
last change is at least ``idle_after`` seconds old, its last job started at least
``interval`` seconds ago, and it changed since the change-feed seq its last completed job
read (the cursor, ``input_seq``), counting only changes not written by a job. Output stores of
jobs are never scheduled themselves.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any, cast

from pydantic import ValidationError
from sqlalchemy import Table, false, func, insert, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from memfuse import content
from memfuse.defs import JOBS_PAGE_DEFAULT
from memfuse.models import BatchOperation, ConsolidationChange, ConsolidationCreate, ConsolidationJob
from memfuse.server import deltas, keys, tails
from memfuse.server.accounts import AccountsService
from memfuse.server.base import _A, _R, _S, _V, AnyRow, Parts, Principal, Reply, Resource, ServiceError
from memfuse.server.batch import BatchService, _LateRefusal, _Planned
from memfuse.server.db import ConsolidationJobRow, WorkspaceRow, utc_shift, utcnow
from memfuse.server.jobspec import (
    ACTIVE,
    ConsolidationSettings,
    DEFAULT_MODEL,
    HISTORY_MAX,
    JobPrincipal,
    MAX_CHANGES,
    Output,
    SCHEDULED_INSTRUCTIONS,
    SYSTEM_PROMPT,
    TOOL,
    TOOL_NAME,
    _Change,
    _Gone,
    _Stop,
    _cut,
    _job_model,
    output_slug,
)

log = logging.getLogger("memfuse.server.consolidation")

_J = cast(Table, ConsolidationJobRow.__table__)
_W = cast(Table, WorkspaceRow.__table__)


def instructions_label(job: AnyRow) -> str:
    """Who gave job ``job``'s instructions, as the model reads it before them
    (``jobspec.SYSTEM_PROMPT``): an admin token or the scheduler (``requested_by``
    ``admin:...``, ``scheduled``) is the store's administrator; a workspace token is an agent
    with write access, never "the store's owner": its request may carry text the agent read
    in memories (memory content is untrusted and must not gain an owner's authority). The
    workspace is named by its public name (a slug), not by the client's self-chosen instance
    label."""
    by = job.requested_by or ""
    if job.scheduled or by.startswith("admin:"):
        return "Instructions from the store's administrator"
    ws = by[3:].split("/", 1)[0] if by.startswith("ws:") else "unknown"
    return (f"Instructions requested by an agent (workspace {ws}) with write access to the store, "
            "not by its administrator")


class ConsolidationService(Resource):
    """``Service`` methods of consolidation jobs: ``create_consolidation``,
    ``get_consolidation``, ``list_consolidations``, ``cancel_consolidation``, and the runner
    (``_run_job``, one thread per job in the process that created it), the stale-job reaper
    (``reap_stale_jobs``) and scheduled maintenance (``schedule_once``)."""

    accounts: AccountsService  # the store quota of a job's new store
    batch: BatchService  # a job's changes are written as one batch
    consolidation: ConsolidationSettings  # off until a model is configured
    _job_cancels: dict[str, threading.Event]  # this process's running jobs, by id
    _job_threads: dict[str, threading.Thread]

    def __init__(self, parts: Parts, accounts: AccountsService, batch: BatchService) -> None:
        super().__init__(parts)
        self.accounts = accounts
        self.batch = batch
        self.consolidation = ConsolidationSettings()
        self._job_cancels = {}
        self._job_threads = {}
        parts.db.on_dispose(self.stop_jobs)  # stopped (failed, nothing written) before the pool closes

    # ------------------------------------------------------------ API

    def create_consolidation(self, p: Principal, slug: str, body: ConsolidationCreate,
                             *, scheduled: bool = False) -> ConsolidationJob:
        """Create a job on store ``slug`` and start it in a thread of this process; returns
        the job (``pending``). Refusals: 404 (store), 403 ``read_only``, 409
        ``consolidation_disabled`` (not configured), 403 ``store_archived`` (in place), 413
        ``input_too_large`` (the store's live bytes exceed the input cap), 409 ``job_running``
        (the store has a pending or running job, on any replica)."""
        cfg = self.consolidation
        if not cfg.enabled:
            raise ServiceError(409, "consolidation_disabled",
                               "consolidation jobs are off: the control plane has no model configured "
                               "(memfuse serve --consolidation-model-url and --consolidation-api-key-file)")
        self.reap_stale_jobs()
        job_id = str(uuid.uuid4())
        now = utcnow()
        try:
            with self.db.write_conn() as conn:
                st = self._store(conn, p, slug, write=True)
                if p.workspace is not None:  # an agent's jobs are bounded (attack 15 F4)
                    self._check_workspace_bounds(conn, p, st, body.output, now)
                if body.output == "new_store":  # refused now, before the model is paid for
                    self.accounts.check_store_quota(conn, st.account)
                if body.output == "in_place" and getattr(st, "archived_at", None) is not None:
                    raise ServiceError(403, "store_archived", f"store {slug!r} is archived: it cannot be written")
                size = (st.usage_bytes or 0)
                if size > cfg.max_input_bytes:
                    raise ServiceError(413, "input_too_large",
                                       f"store {slug!r} holds {size} bytes; a consolidation reads at most "
                                       f"{cfg.max_input_bytes}")
                conn.execute(insert(_J).values(
                    id=job_id, store=st.slug, status="pending", output=body.output, output_store=None,
                    instructions=body.instructions, model=body.model or cfg.model,
                    include_history=body.include_history, requested_by=p.actor, scheduled=scheduled,
                    created_at=now, heartbeat_at=now))
                row = conn.execute(select(_J).where(_J.c.id == job_id)).one()
        except IntegrityError:
            raise ServiceError(409, "job_running", f"store {slug!r} has a consolidation job pending or running; "
                               "wait for it or cancel it") from None
        log.info("consolidation job created", extra={"job": job_id, "store": slug, "output": body.output,
                                                      "scheduled": scheduled})
        self._start_job(job_id)
        return _job_model(row)

    def _check_workspace_bounds(self, conn: Connection, p: Principal, st: AnyRow, output: str,
                                now: datetime) -> None:
        """Refuse a job workspace ``p`` asks for on store row ``st`` past the bounds of
        ``ConsolidationSettings`` (``max_unreviewed``, ``workspace_jobs_per_hour``; 0 = off):
        409 ``review_pending`` when a ``new_store`` job would add to ``max_unreviewed`` outputs
        of the store still waiting for a person (``_unreviewed_outputs``), 429 ``rate_limited``
        (``Retry-After``: s until the oldest job of the hour leaves it) past the hourly rate.
        Locks the workspace's row first, so a workspace's concurrent requests are counted one
        after the other (PostgreSQL; SQLite writes one at a time anyway)."""
        cfg = self.consolidation
        assert p.workspace is not None
        conn.execute(select(_W.c.name).where(_W.c.name == p.workspace).with_for_update())
        if output == "new_store" and cfg.max_unreviewed > 0:
            waiting = self._unreviewed_outputs(conn, st.slug)
            if waiting >= cfg.max_unreviewed:
                raise ServiceError(409, "review_pending",
                                   f"store {keys.public(st.slug)!r} has {waiting} consolidation output(s) waiting "
                                   f"for review (at most {cfg.max_unreviewed}): an admin attaches one (accepts it) "
                                   "or archives it (discards it) before another job may start")
        if cfg.workspace_jobs_per_hour > 0:
            since = now - timedelta(hours=1)
            mine = select(_J.c.created_at).join(_S, _S.c.slug == _J.c.store).where(
                _S.c.account == st.account, _J.c.created_at > since,
                _J.c.requested_by.startswith(f"ws:{keys.public(p.workspace)}/", autoescape=True))
            times = sorted(conn.execute(mine).scalars())
            if len(times) >= cfg.workspace_jobs_per_hour:
                oldest = times[-cfg.workspace_jobs_per_hour]
                wait = max(1, int((oldest - since).total_seconds()) + 1)
                raise ServiceError(429, "rate_limited",
                                   f"this workspace started {len(times)} consolidation jobs in the last hour "
                                   f"(at most {cfg.workspace_jobs_per_hour})",
                                   headers={"Retry-After": str(wait)})

    @staticmethod
    def _unreviewed_outputs(conn: Connection, store: str) -> int:
        """How many ``new_store`` outputs of the store whose key is ``store`` wait for review:
        its pending or running ``new_store`` jobs, and the output stores of its completed ones
        that still exist, are not archived and are attached to no workspace (a person accepts
        an output by attaching it, discards it by archiving it)."""
        active = conn.scalar(select(func.count()).select_from(_J).where(
            _J.c.store == store, _J.c.output == "new_store", _J.c.status.in_(ACTIVE))) or 0
        attached = select(_A.c.store).where(_A.c.store == _S.c.slug).exists()
        outputs = select(_J.c.output_store).where(
            _J.c.store == store, _J.c.output == "new_store", _J.c.status == "completed",
            _J.c.output_store.is_not(None))
        waiting = conn.scalar(select(func.count()).select_from(_S).where(
            _S.c.slug.in_(outputs), _S.c.archived_at.is_(None), ~attached)) or 0
        return int(active) + int(waiting)

    def get_consolidation(self, p: Principal, job_id: str) -> ConsolidationJob:
        """The job; 404 ``job_not_found`` when there is none or the caller may not see its
        store (a workspace sees the jobs of the stores attached to it)."""
        self.reap_stale_jobs()
        with self.db.read_conn() as conn:
            row = conn.execute(select(_J).where(_J.c.id == job_id)).first()
            if row is None or not self._may_see(conn, p, row.store):
                raise ServiceError(404, "job_not_found", f"no consolidation job {job_id!r}")
            return _job_model(row)

    def consolidation_account(self, p: Principal, job_id: str) -> str:
        """The account of the store job ``job_id`` read (its output store's too: a job's new
        store is made in its input's account): what the console needs to link the root
        admin's view of the job to the right store (``keys.ref``). 404 ``job_not_found`` as
        ``get_consolidation``."""
        with self.db.read_conn() as conn:
            row = conn.execute(select(_J.c.store).where(_J.c.id == job_id)).first()
            if row is None or not self._may_see(conn, p, row.store):
                raise ServiceError(404, "job_not_found", f"no consolidation job {job_id!r}")
            return str(self._store_by_key(conn, p, row.store).account)

    def list_consolidations(self, p: Principal, slug: str, limit: int = JOBS_PAGE_DEFAULT) -> list[ConsolidationJob]:
        """The store's jobs, newest first (at most ``limit``); 404 for the store."""
        self.reap_stale_jobs()
        with self.db.read_conn() as conn:
            st = self._store(conn, p, slug)
            rows = conn.execute(select(_J).where(_J.c.store == st.slug)
                                .order_by(_J.c.created_at.desc(), _J.c.id).limit(limit)).all()
            return [_job_model(r) for r in rows]

    def cancel_consolidation(self, p: Principal, job_id: str) -> ConsolidationJob:
        """Cancel a pending or running job (it writes nothing); returns the job. 404
        ``job_not_found``; 403 ``read_only``; 409 ``job_finished`` when it already ended."""
        with self.db.write_conn() as conn:
            row = conn.execute(select(_J).where(_J.c.id == job_id)).first()
            if row is None or not self._may_see(conn, p, row.store):
                raise ServiceError(404, "job_not_found", f"no consolidation job {job_id!r}")
            self._store_by_key(conn, p, row.store, write=True)  # 403 read_only for a read-only workspace
            n = conn.execute(update(_J).where(_J.c.id == job_id, _J.c.status.in_(ACTIVE)).values(
                status="canceled", finished_at=utcnow(), error=f"canceled by {p.actor}")).rowcount
            if n == 0:
                raise ServiceError(409, "job_finished", f"job {job_id!r} already ended ({row.status})")
            row = conn.execute(select(_J).where(_J.c.id == job_id)).one()
        ev = self._job_cancels.get(job_id)
        if ev is not None:
            ev.set()
        log.info("consolidation job canceled", extra={"job": job_id, "store": row.store})
        return _job_model(row)

    def consolidation_diff(self, p: Principal, job_id: str) -> tuple[ConsolidationJob, list[dict[str, Any]]]:
        """The job and, for a completed job, each change it made as ``{op, path, old, new}``:
        ``old`` the input's content at that path as the job read it (the newest version of the
        input store at or before ``input_seq``; None when the path held nothing), ``new`` the
        content the job wrote in the output store (None for a delete). A content removed
        since (redacted, pruned) is None with ``gone`` set. Same access as ``get_consolidation``
        (and read access to the output store for its side)."""
        job = self.get_consolidation(p, job_id)
        if job.status != "completed" or not job.changes or job.output_store is None:
            return job, []
        actor = f"job:{job.id}"
        out = []
        with self.db.read_conn() as conn:
            # the stores' keys (the model shows their names: memfuse.server.keys)
            job_row = conn.execute(select(_J.c.store, _J.c.output_store).where(_J.c.id == job.id)).one()
            if not self._may_see(conn, p, job_row.output_store):
                return job, []
            cols = (_V.c.operation, _V.c.content, _V.c.record_id, _V.c.version, _V.c.base_version, _V.c.chain)
            for c in job.changes[:200]:
                old = conn.execute(select(*cols).where(
                    _V.c.store == job_row.store, _V.c.path == c.path, _V.c.seq <= (job.input_seq or 0))
                    .order_by(_V.c.seq.desc()).limit(1)).first()
                new = conn.execute(select(*cols).where(
                    _V.c.store == job_row.output_store, _V.c.path == c.path, _V.c.actor == actor)
                    .order_by(_V.c.seq.desc()).limit(1)).first()
                # an append version holds only its suffix: the whole content (memfuse.server.deltas)
                old, new = (deltas.resolve(conn, [v])[0] if v is not None else None for v in (old, new))
                old_text = None if old is None or old.operation == "deleted" else old.content
                new_text = None if c.op == "delete" or new is None else new.content
                gone = (old is not None and old.operation != "deleted" and old.content is None) or (
                    c.op == "write" and (new is None or new.content is None))
                out.append({"op": c.op, "path": c.path, "old": old_text, "new": new_text, "gone": gone})
        return job, out

    def _may_see(self, conn: Connection, p: Principal, store: str) -> bool:
        """Whether ``p`` may see ``store`` (the one rule of ``_store``: the root admin every
        store, an account admin its account's, a workspace its attachments)."""
        try:
            self._store_by_key(conn, p, store)  # ``store``: a key (a job row's)
        except ServiceError:
            return False
        return True

    def reap_stale_jobs(self) -> int:
        """Mark failed every pending or running job whose heartbeat is older than
        ``stale_after`` (the process running it stopped); returns how many."""
        cutoff = utc_shift(utcnow(), -self.consolidation.stale_after)
        with self.db.read_conn() as conn:
            stale = conn.execute(select(_J.c.id).where(_J.c.status.in_(ACTIVE), _J.c.heartbeat_at < cutoff)
                                 .limit(100)).scalars().all()
        if not stale:
            return 0
        with self.db.write_conn() as conn:
            n = conn.execute(update(_J).where(_J.c.id.in_(stale), _J.c.status.in_(ACTIVE),
                                              _J.c.heartbeat_at < cutoff).values(
                status="failed", finished_at=utcnow(),
                error="the control plane running the job stopped (no heartbeat); nothing was written")).rowcount
        if n:
            log.warning("consolidation jobs without a heartbeat marked failed", extra={"jobs": n})
        return n

    # ------------------------------------------------------------ the runner

    def _start_job(self, job_id: str) -> None:
        cancel = threading.Event()
        self._job_cancels[job_id] = cancel
        t = threading.Thread(target=self._run_job, args=(job_id, cancel),
                             name=f"consolidation-{job_id[:8]}", daemon=True)
        self._job_threads[job_id] = t
        t.start()

    def stop_jobs(self, wait: float = 5.0) -> None:
        """Stop this process's running jobs (shutdown): each is marked failed, writing
        nothing; waits up to ``wait`` s in all for their threads."""
        for ev in list(self._job_cancels.values()):
            ev.set()
        deadline = time.monotonic() + wait
        for t in list(self._job_threads.values()):
            t.join(max(0.0, deadline - time.monotonic()))

    def _ticker(self, job_id: str, cancel: threading.Event, stop: threading.Event) -> None:
        """Refresh the job's heartbeat every ``heartbeat`` s for the whole life of its thread
        (reading the store, importing the SDK, writing: not only while the model thinks);
        set ``cancel`` when the row is no longer active (canceled, or failed elsewhere), so
        the runner stops at its next check."""
        while not stop.wait(self.consolidation.heartbeat):
            try:
                with self.db.write_conn() as conn:
                    n = conn.execute(update(_J).where(_J.c.id == job_id, _J.c.status.in_(ACTIVE))
                                     .values(heartbeat_at=utcnow())).rowcount
            except Exception:  # noqa: BLE001 - the next tick tries again
                log.warning("consolidation heartbeat failed", extra={"job": job_id}, exc_info=True)
                continue
            if n == 0:
                cancel.set()
                return

    def _run_job(self, job_id: str, cancel: threading.Event) -> None:
        stop = threading.Event()
        threading.Thread(target=self._ticker, args=(job_id, cancel, stop), daemon=True,
                         name=f"consolidation-beat-{job_id[:8]}").start()
        try:
            self._run_job_inner(job_id, cancel)
        except _Gone:
            log.info("consolidation job ended elsewhere (canceled or failed)", extra={"job": job_id})
        except _Stop as e:
            self._fail(job_id, str(e))
        except Exception as e:  # noqa: BLE001 - the job fails, the server keeps serving
            log.exception("consolidation job failed unexpectedly", extra={"job": job_id})
            self._fail(job_id, f"internal error ({type(e).__name__})")
        finally:
            stop.set()
            self._job_cancels.pop(job_id, None)
            self._job_threads.pop(job_id, None)

    def _fail(self, job_id: str, reason: str) -> None:
        values: dict[str, Any] = {"status": "failed", "finished_at": utcnow(), "error": _cut(reason)}
        try:
            with self.db.write_conn() as conn:
                n = conn.execute(update(_J).where(_J.c.id == job_id, _J.c.status.in_(ACTIVE))
                                 .values(**values)).rowcount
        except Exception:  # noqa: BLE001 - the heartbeat reaper marks it failed later
            log.exception("could not mark a consolidation job failed", extra={"job": job_id})
            return
        if n:
            log.warning("consolidation job failed", extra={"job": job_id, "reason": _cut(reason, 200)})

    def _beat(self, job_id: str, cancel: threading.Event) -> None:
        """Refresh the heartbeat. Raises ``_Gone`` when the job is no longer running
        (canceled, or marked failed elsewhere), ``_Stop`` when this process is stopping its
        jobs (``stop_jobs``)."""
        with self.db.write_conn() as conn:
            n = conn.execute(update(_J).where(_J.c.id == job_id, _J.c.status == "running")
                             .values(heartbeat_at=utcnow())).rowcount
        if n == 0:
            raise _Gone()
        if cancel.is_set():  # not a cancel (the row would say so): stop_jobs, at shutdown
            raise _Stop("the control plane shut down while the job ran; nothing was written")

    def _run_job_inner(self, job_id: str, cancel: threading.Event) -> None:
        cfg = self.consolidation
        started = time.monotonic()
        deadline = started + cfg.timeout
        with self.db.write_conn() as conn:
            now = utcnow()
            n = conn.execute(update(_J).where(_J.c.id == job_id, _J.c.status == "pending")
                             .values(status="running", started_at=now, heartbeat_at=now)).rowcount
            if n == 0:
                raise _Gone()
            job = conn.execute(select(_J).where(_J.c.id == job_id)).one()
        with self.db.read_conn() as conn:  # the job acts in its store's account (keys resolve there)
            account = conn.scalar(select(_S.c.account).where(_S.c.slug == job.store))
        jp = JobPrincipal(workspace=None, name="job", job_id=job_id, account=account)
        records, seq, history = self._job_input(jp, job)
        with self.db.write_conn() as conn:
            conn.execute(update(_J).where(_J.c.id == job_id).values(input_seq=seq))
        request = self._model_request(job, records, history)
        message = self._call_model(job_id, request, cancel, deadline)
        u = getattr(message, "usage", None)
        usage = {"input_tokens": int(getattr(u, "input_tokens", 0) or 0),
                 "output_tokens": int(getattr(u, "output_tokens", 0) or 0)}
        with self.db.write_conn() as conn:  # the tokens were spent whatever happens next
            conn.execute(update(_J).where(_J.c.id == job_id).values(usage=json.dumps(usage)))
        out = self._parse_answer(message)
        self._beat(job_id, cancel)
        self._apply(jp, job, records, out, usage)

    def _job_input(self, jp: Principal, job: AnyRow) -> tuple[Sequence[AnyRow], int, list[dict[str, Any]]]:
        """The store's live records (path order), its change-feed seq, and its recent history
        (``include_history``). Raises ``_Stop`` beyond the input cap."""
        cap = self.consolidation.max_input_bytes
        with self.db.read_conn() as conn:
            st = self._store_by_key(conn, jp, job.store)
            seq = conn.scalar(select(func.max(_V.c.seq)).where(_V.c.store == st.slug)) or 0
            rows = conn.execute(select(_R.c.id, _R.c.path, tails.LIVE_CONTENT, _R.c.sha256, _R.c.type, _R.c.size,
                                       _R.c.mode, _R.c.mtime_ns)
                                .where(_R.c.store == st.slug, _R.c.deleted == false())
                                .order_by(self._path_col())).all()
            history: list[dict[str, Any]] = []
            if job.include_history:
                hv = conn.execute(select(_V.c.seq, _V.c.path, _V.c.operation, _V.c.actor, _V.c.created_at)
                                  .where(_V.c.store == st.slug).order_by(_V.c.seq.desc()).limit(HISTORY_MAX)).all()
                history = [{"seq": v.seq, "path": v.path, "operation": v.operation, "actor": v.actor,
                            "at": v.created_at.isoformat()} for v in reversed(hv)]
        total = sum(len(r.path.encode("utf-8", "surrogatepass")) + (r.size or 0) for r in rows)
        if total > cap:
            raise _Stop(f"the store holds {total} bytes of paths and content; a consolidation reads at most {cap}: "
                        "nothing was sent to the model")
        return rows, seq, history

    def _model_request(self, job: AnyRow, records: Sequence[AnyRow], history: list[dict[str, Any]]) -> dict[str, Any]:
        """The Messages API request of a job: the system prompt, the instructions and the
        store's files as JSON, the forced tool call."""
        files = [{"path": r.path, "content": r.content} for r in records]
        parts = [f"Store: {keys.public(job.store)}\n\n{instructions_label(job)}:\n{job.instructions}\n\n"
                 f"The store's files ({len(files)}), as JSON:\n{json.dumps(files, ensure_ascii=False)}"]
        if history:
            parts.append("Recent changes (oldest first), as JSON:\n" + json.dumps(history, ensure_ascii=False))
        return {
            "model": job.model,
            "max_tokens": self.consolidation.max_output_tokens,
            "system": SYSTEM_PROMPT,
            "messages": [{"role": "user", "content": "\n\n".join(parts)}],
            "tools": [TOOL],
            "tool_choice": {"type": "tool", "name": TOOL_NAME},
        }

    def _call_model(self, job_id: str, request: dict[str, Any], cancel: threading.Event, deadline: float) -> Any:
        """Send ``request`` with the ``anthropic`` SDK in a thread; beat while it runs; return
        the ``Message``. Raises ``_Stop`` (API error, timeout, shutdown) or ``_Gone``."""
        import anthropic

        from memfuse.tokenfile import TokenFile, TokenFileError

        cfg = self.consolidation
        try:
            key = TokenFile(cfg.api_key_file).token  # type: ignore[arg-type]
        except TokenFileError as e:
            raise _Stop(f"the model's API key cannot be read: {e}") from None
        remaining = max(1.0, deadline - time.monotonic())
        client = anthropic.Anthropic(base_url=cfg.model_url, api_key=key, max_retries=1,
                                     timeout=anthropic.Timeout(remaining, connect=min(10.0, remaining)))
        box: dict[str, Any] = {}
        done = threading.Event()

        def call() -> None:
            try:
                box["message"] = client.messages.create(**request)
            except BaseException as e:  # noqa: BLE001 - handed to the job's thread
                box["error"] = e
            finally:
                done.set()

        threading.Thread(target=call, name=f"consolidation-call-{job_id[:8]}", daemon=True).start()
        try:
            next_beat = time.monotonic() + cfg.heartbeat
            while not done.wait(0.1):
                now = time.monotonic()
                if now >= deadline:
                    raise _Stop(f"the job ran longer than its {cfg.timeout:g} s timeout; nothing was written")
                if cancel.is_set() or now >= next_beat:  # a cancel here is seen at once
                    self._beat(job_id, cancel)
                    next_beat = now + cfg.heartbeat
            if cancel.is_set():
                self._beat(job_id, cancel)  # canceled while the answer came: _Gone or _Stop
        finally:
            if not done.is_set():
                try:
                    client.close()  # abandon the request in flight
                except Exception:  # noqa: BLE001
                    pass
        err = box.get("error")
        if err is not None:
            if isinstance(err, anthropic.APIStatusError):
                raise _Stop(f"the model API refused the request: HTTP {err.status_code}") from None
            if isinstance(err, anthropic.APITimeoutError):
                raise _Stop(f"the model did not answer within the job's {cfg.timeout:g} s timeout") from None
            if isinstance(err, anthropic.APIConnectionError):
                raise _Stop("the model API cannot be reached") from None
            raise _Stop(f"the model call failed ({type(err).__name__})") from None
        return box["message"]

    @staticmethod
    def _parse_answer(message: Any) -> Output:
        """The validated ``Output`` of the model's ``Message``. Raises ``_Stop`` for an answer
        cut by ``max_tokens``, without the tool call, or whose input breaks the schema."""
        if getattr(message, "stop_reason", None) == "max_tokens":
            raise _Stop("the model's answer was cut at the output token cap; nothing was written")
        calls = [b for b in (message.content or []) if getattr(b, "type", None) == "tool_use"
                 and getattr(b, "name", None) == TOOL_NAME]
        if len(calls) != 1:
            raise _Stop(f"the model answered without exactly one {TOOL_NAME} call; nothing was written")
        try:
            return Output.model_validate(calls[0].input)
        except ValidationError as e:
            where = "; ".join(f"{'.'.join(str(x) for x in err.get('loc', ()))}: {err.get('msg', '')}"
                              for err in e.errors()[:5])
            raise _Stop(f"the model's answer does not fit the {TOOL_NAME} schema ({where}); nothing was written") \
                from None

    # ------------------------------------------------------------ writing the result

    def _apply(self, jp: JobPrincipal, job: AnyRow, records: Sequence[AnyRow], out: Output, usage: dict[str, int]) -> None:
        """Check the answer against the input and write it in one transaction (see module
        doc). Raises ``_Stop`` for a refused change (nothing written), ``_Gone`` when the job
        was canceled meanwhile."""
        cfg = self.consolidation
        by_path = {r.path: r for r in records}
        seen: set[str] = set()
        written = 0
        changes: list[_Change] = []
        for i, c in enumerate(out.changes):
            if c.path in seen:
                raise _Stop(f"change {i}: the answer changes the same path twice; nothing was written")
            seen.add(c.path)
            if c.op == "write":
                if c.content is None:
                    raise _Stop(f"change {i}: a write without content; nothing was written")
                written += len(c.content.encode("utf-8", "surrogatepass"))
                if written > cfg.max_output_bytes:
                    raise _Stop(f"the answer writes more than {cfg.max_output_bytes} bytes; nothing was written")
                old = by_path.get(c.path)
                if old is not None and old.content == c.content:
                    continue  # unchanged
            else:
                if c.content is not None:
                    raise _Stop(f"change {i}: a delete with content; nothing was written")
                if c.path not in by_path:
                    raise _Stop(f"change {i}: deletes a file the store does not hold; nothing was written")
            changes.append(c)
        ops: list[BatchOperation] = []
        if job.output == "in_place":
            for c in changes:
                old = by_path.get(c.path)
                if c.op == "delete":
                    assert old is not None  # a delete of a file the store does not hold stopped above
                    ops.append(BatchOperation(op="delete", record_id=old.id, if_match=f'"{old.sha256}"'))
                elif old is not None:
                    ops.append(BatchOperation(op="update", record_id=old.id, if_match=f'"{old.sha256}"',
                                              body={"content": c.content}))
                else:
                    ops.append(BatchOperation(op="create", body={"path": c.path, "content": c.content}))
        else:
            final: dict[str, dict[str, Any]] = {
                r.path: {"path": r.path, "content": r.content, "type": r.type, "mode": r.mode, "mtime_ns": r.mtime_ns}
                for r in records}
            for c in changes:
                if c.op == "delete":
                    final.pop(c.path, None)
                else:
                    prev = final.get(c.path)
                    final[c.path] = {"path": c.path, "content": c.content,
                                     "mode": prev["mode"] if prev else None}
            ops = [BatchOperation(op="create", body={k: v for k, v in body.items() if v is not None})
                   for body in final.values()]
        summary = [ConsolidationChange(op=c.op, path=c.path).model_dump() for c in sorted(changes, key=lambda c: c.path)]
        plans = [self.batch._plan(jp, keys.public(job.store), i, op) for i, op in enumerate(ops)]
        for i, pl in enumerate(plans):
            if pl.refusal is not None:
                raise _Stop(self._refusal(i, ops, pl.refusal.code, pl.refusal.detail))
        # the summary is untrusted model output shown in the API and the console: a secret the
        # model echoed is cut out as everywhere else memfuse keeps text (attack 13 F6)
        self._write_result(jp, job, plans, ops, summary, content.redact_secrets(out.summary), usage)

    @staticmethod
    def _refusal(i: int, ops: list[BatchOperation], code: str, detail: str) -> str:
        what = ops[i].op
        return f"a {what} the model asked for was refused ({code}: {_cut(detail, 200)}); nothing was written"

    def _write_result(self, jp: JobPrincipal, job: AnyRow, plans: list[_Planned], ops: list[BatchOperation],
                      changes: list[dict[str, Any]], summary: str, usage: dict[str, int]) -> None:
        new_store = job.output == "new_store"
        savepoints = False  # a refusal after a write (an account's byte quota): again, per operation
        for attempt in range(5):
            target = keys.public(job.store)  # a name: jp resolves it in the job's account
            prepare = None
            made: list[str] = []  # the output store's key (memfuse.server.keys), set by prepare
            if new_store:
                target = self._free_output_slug(job.store)
                prepare = self._new_store_maker(job, target, made)

            def finish(conn: Connection, replies: list[Reply], target: str = target) -> None:
                for i, r in enumerate(replies):
                    if r.status >= 300:
                        try:
                            prob = json.loads(r.body)
                        except ValueError:
                            prob = {}
                        raise _Stop(self._refusal(i, ops, str(prob.get("code", r.status)), str(prob.get("detail", ""))))
                n = conn.execute(update(_J).where(_J.c.id == job.id, _J.c.status == "running").values(
                    status="completed", finished_at=utcnow(), output_store=made[0] if made else job.store,
                    usage=json.dumps(usage),
                    changes=json.dumps(changes), summary=summary, error=None)).rowcount
                if n == 0:
                    raise _Gone()

            try:
                _, notes, vseqs, eseqs = self.batch._batch_tx(jp, target, plans, [], savepoints, prepare=prepare,
                                                        finish=finish)
            except _LateRefusal:
                savepoints = True  # the refused operation's own problem comes back through finish
                continue
            except ServiceError as e:  # the output store refused (the account's store quota)
                raise _Stop(f"the result could not be written ({e.code}: {_cut(e.detail, 200)}); "
                            "nothing was written") from None
            except IntegrityError:
                if attempt == 4:
                    raise _Stop("the result could not be written (concurrent writes); nothing was written") from None
                continue
            self.notifier.committed(notes, own=(vseqs, eseqs))
            log.info("consolidation job completed", extra={"job": job.id, "store": job.store,
                                                           "output_store": made[0] if made else job.store,
                                                           "changes": len(changes)})
            return

    def _free_output_slug(self, store: str) -> str:
        """The first free output name for the store whose key is ``store``, in its account
        (names are per account: memfuse.server.keys)."""
        name = keys.public(store)
        with self.db.read_conn() as conn:
            account = conn.scalar(select(_S.c.account).where(_S.c.slug == store))
            prefix = output_slug(name, 0)[:-1]
            taken = {keys.public(k) for k in conn.execute(select(_S.c.slug).where(
                _S.c.slug.startswith(prefix, autoescape=True), _S.c.account == account)).scalars()}
        store = name
        n = 1
        while output_slug(store, n) in taken:
            n += 1
        return output_slug(store, n)

    def _new_store_maker(self, job: AnyRow, name: str, made: list[str] | None = None) -> Callable[[Connection], None]:
        made = [] if made is None else made  # receives the new store's key
        def prepare(conn: Connection) -> None:
            src = conn.execute(select(_S).where(_S.c.slug == job.store)).one()
            # the output belongs to the input's account and counts against its store quota
            self.accounts.check_store_quota(conn, src.account)
            slug = keys.new_key(conn, name, src.account)
            if slug is None:  # taken since _free_output_slug looked: the write runs again
                raise IntegrityError("output store", None, ValueError(f"store {name!r} exists"))
            made[:] = [slug]
            now = utcnow()
            conn.execute(insert(_S).values(
                slug=slug, public_slug=name, account=src.account,
                description=_cut(f"consolidation of {keys.public(job.store)} by job {job.id}", 200),
                default_type=src.default_type, max_record_bytes=src.max_record_bytes,
                max_store_bytes=src.max_store_bytes, max_records=src.max_records,
                max_history_bytes=src.max_history_bytes, max_history_versions=src.max_history_versions,
                history_min_age_s=src.history_min_age_s, created_at=now,
                usage_bytes=0, record_count=0, version_bytes=0, version_count=0))
        return prepare

    # ------------------------------------------------------------ scheduled maintenance

    def schedule_once(self, now: datetime | None = None) -> list[str]:
        """One round of scheduled maintenance: start a job (``scheduled``) on every store due
        (see the module doc); returns the slugs started. Stores with an active job, archived
        stores and stores made by jobs are skipped."""
        cfg = self.consolidation
        if not cfg.scheduled:
            return []
        self.reap_stale_jobs()
        now = now or utcnow()
        idle_cut = utc_shift(now, -cfg.idle_after)
        interval_cut = utc_shift(now, -cfg.interval)
        due: list[tuple[str, str]] = []
        with self.db.read_conn() as conn:
            outputs = select(_J.c.output_store).where(_J.c.output == "new_store", _J.c.output_store.is_not(None))
            stores = conn.execute(select(_S.c.slug, _S.c.usage_bytes, _S.c.account).where(
                _S.c.archived_at.is_(None), _S.c.slug.not_in(outputs)).order_by(_S.c.slug)).all()
            for st in stores:  # index seeks per store: never a scan of the versions
                if (st.usage_bytes or 0) > cfg.max_input_bytes:
                    continue
                # the last change not written by a job (an in-place job's own versions are no
                # reason to consolidate again)
                last = conn.execute(select(_V.c.seq, _V.c.created_at).where(
                    _V.c.store == st.slug, ~_V.c.actor.startswith("job:")).order_by(_V.c.seq.desc()).limit(1)).first()
                if last is None or last.created_at > idle_cut:
                    continue  # never written, or not idle yet
                last_job = conn.scalar(select(func.max(_J.c.created_at)).where(_J.c.store == st.slug))
                if last_job is not None and last_job > interval_cut:
                    continue  # a job within the interval
                cursor = conn.scalar(select(func.max(_J.c.input_seq)).where(
                    _J.c.store == st.slug, _J.c.status == "completed"))
                if cursor is not None and last.seq <= cursor:
                    continue  # nothing new since the last completed job read it
                due.append((st.slug, st.account))
        admin = Principal(workspace=None, name="scheduler")
        started = []
        for slug, account in due:  # as the store's account's admin: its key resolves there
            try:
                self.create_consolidation(replace(admin, account=account), slug, ConsolidationCreate(
                    instructions=cfg.schedule_instructions, output=cfg.schedule_output), scheduled=True)
            except ServiceError as e:
                log.info("scheduled consolidation skipped", extra={"store": slug, "code": e.code})
                continue
            started.append(keys.public(slug))
        return started


async def schedule_forever(svc: Any) -> None:
    """Run ``schedule_once`` every ``schedule_tick`` seconds in a worker thread until
    cancelled; a failed round is logged and retried at the next one."""
    import trio

    while True:
        try:
            started = await trio.to_thread.run_sync(svc.schedule_once)
            if started:
                log.info("scheduled consolidation started", extra={"stores": len(started)})
        except Exception:  # noqa: BLE001 - the next round tries again
            log.exception("scheduled consolidation round failed")
        await trio.sleep(svc.consolidation.schedule_tick)

