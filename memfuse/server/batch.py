"""Batched writes to one store: ``POST /v1/stores/{store}/batch`` (``Service.batch``).

A batch is a list of record writes (create, update, attrs, move, delete) exactly as their
single endpoints take them, each with its own ``Idempotency-Key`` and ``If-Match``. The whole
batch is one transaction holding the store's row lock once. A refusal (412, 409, 413, 422,
507, ...) is that operation's own answer and leaves nothing while the others commit: every
write checks all its rules before its first statement (``RecordsService._room`` included), so a
refused operation has nothing to undo; should one be refused after it wrote (no rule does
today: ``_LateRefusal``), the whole batch runs again with a SAVEPOINT around each operation
(two more round trips per operation, which is why it is not the default). One commit, one
``NOTIFY``, one wake-up of the store's long-polls; the versions get seqs in the batch's order.

What the batch saves against as many single requests: one HTTP request, one authentication,
one worker-thread hop, one store lock, one idempotency read for every key (``IN``), one write
of the usage counters, one insert of every idempotency row, one ``pg_notify``, one commit.

Refusals of the whole batch (nothing applied): 401, 403 ``read_only``, 404
``store_not_attached`` / ``store_not_found``, 413 ``batch_too_large`` (more than
``BATCH_MAX_OPERATIONS`` operations or ``routes.records.batch_max_bytes`` bytes), 422 ``validation_error``
(a body that is not a batch, or an ``Idempotency-Key`` header on the batch itself: keys belong
to the operations), 503 (database). Everything else is an operation's own answer.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ValidationError
from sqlalchemy import bindparam, delete, select
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from memfuse.defs import SEQ_HEADER
from memfuse.models import (
    BATCH_MAX_OPERATIONS,
    BatchOperation,
    Problem,
    RecordAppend,
    RecordAttributes,
    RecordCreate,
    RecordMove,
    RecordUpdate,
)
from memfuse.server import history, wakeups
from memfuse.server.base import (
    _I,
    IDEMPOTENCY_TTL,
    REASONS,
    _INSERT_IDEM,
    Answer,
    IdempotencyRequest,
    Parts,
    Principal,
    Reply,
    Resource,
    ServiceError,
    answer_json,
    canonical_sha256,
    seq_header,
)
from memfuse.server.db import utcnow
from memfuse.server import routetable as table
from memfuse.server.recordrows import _UPDATE_USAGE, BatchStore
from memfuse.server.records import RecordsService

log = logging.getLogger("memfuse.server.service")

_SELECT_IDEM_MANY = select(
    _I.c.key, _I.c.method, _I.c.url_path, _I.c.request_hash, _I.c.status, _I.c.response_body,
    _I.c.response_headers, _I.c.created_at,
).where(_I.c.scope == bindparam("scope"), _I.c.key.in_(bindparam("keys", expanding=True)))

# op → (the single endpoint's route in the app's route table, success status, ETag on success)
_ENDPOINTS: dict[str, tuple[table.Route, int, bool]] = {
    "create": (table.CREATE_RECORD, 201, True),
    "update": (table.UPDATE_RECORD, 200, True),
    "append": (table.APPEND_RECORD, 200, True),
    "attrs": (table.SET_RECORD_ATTRIBUTES, 200, True),
    "move": (table.MOVE_RECORD, 200, False),
    "delete": (table.DELETE_RECORD, 204, False),
}
_BODIES: dict[str, type[BaseModel] | None] = {
    "create": RecordCreate, "update": RecordUpdate, "append": RecordAppend, "attrs": RecordAttributes, "move": RecordMove,
    "delete": None,
}


def problem_body(err: ServiceError) -> bytes:
    """The ``application/problem+json`` body a single request refused with ``err`` gets."""
    body = Problem(title=REASONS.get(err.status, "Error"), status=err.status, detail=err.detail,
                   code=err.code).model_dump()
    body.update({k: v for k, v in err.extra.items()})
    return json.dumps(body, default=str).encode()


def batch_body(replies: list[Reply]) -> bytes:
    """The ``BatchResponse`` JSON of ``replies``, built from their bodies as they are (each
    body is encoded once, by the operation)."""
    parts = []
    for r in replies:
        etag = r.headers.get("ETag")
        seq = r.headers.get(SEQ_HEADER)
        parts.append(b'{"status":%d,"replayed":%s,"etag":%s,%s"body":%s}' % (
            r.status, b"true" if r.replayed else b"false",
            json.dumps(etag.strip('"')).encode() if etag else b"null",
            b'"seq":%d,' % int(seq) if seq else b"", r.body or b"null"))
    return b'{"results":[' + b",".join(parts) + b"]}"


def _validation_problem(err: ValidationError, where: str) -> ServiceError:
    """422 ``validation_error`` naming where and what (never the input values: content)."""
    parts = [f"{where}.{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg', '')}"
             for e in err.errors()[:10]]
    return ServiceError(422, "validation_error", "; ".join(parts))


class _LateRefusal(Exception):
    """An operation of a batch run without savepoints was refused after it wrote."""


@dataclass
class _Planned:
    """One operation of a batch: its refusal before any database work (``refusal``), or the
    write ``fn(conn, st)`` with its idempotency identity and success status."""

    refusal: ServiceError | None = None
    fn: Callable[[Connection, Any], Answer] | None = None
    idem: IdempotencyRequest | None = None
    status: int = 200
    etag: bool = False
    create_path: str | None = None  # a create's (checked) path


class BatchService(Resource):
    """``Service.batch``: many record writes to one store in one transaction."""

    records: RecordsService  # the record writes a batch is made of

    def __init__(self, parts: Parts, records: RecordsService) -> None:
        super().__init__(parts)
        self.records = records

    def _plan(self, p: Principal, slug: str, i: int, op: BatchOperation) -> _Planned:
        route, status, etag = _ENDPOINTS[op.op]
        method = route.method
        model = _BODIES[op.op]
        if op.op != "create" and not op.record_id:
            return _Planned(ServiceError(422, "validation_error", f"operations.{i}: {op.op} needs record_id"))
        url_path = route.url(store=slug, record_id=op.record_id or "")
        idem = None
        if op.idempotency_key:
            idem = IdempotencyRequest(op.idempotency_key, method, url_path, canonical_sha256(op.body))
        try:
            body = model.model_validate(op.body or {}) if model is not None else None
        except ValidationError as err:
            return _Planned(_validation_problem(err, f"operations.{i}.body"))
        fn: Callable[[Connection, Any], Answer]
        try:
            if op.op == "create":
                fn = self.records._create_op(p, body)  # type: ignore[arg-type]
            elif op.op == "update":
                fn = self.records._update_op(p, op.record_id, body, op.if_match)  # type: ignore[arg-type]
            elif op.op == "append":
                fn = self.records._append_op(p, op.record_id, body, op.if_match)  # type: ignore[arg-type]
            elif op.op == "attrs":
                fn = self.records._attrs_op(p, op.record_id, body, op.if_match)  # type: ignore[arg-type]
            elif op.op == "move":
                fn = self.records._move_op(p, op.record_id, body, op.if_match)  # type: ignore[arg-type]
            else:
                fn = self.records._delete_op(p, op.record_id, op.if_match)  # type: ignore[arg-type]
        except ServiceError as err:
            return _Planned(err, idem=idem)
        path = body.path if op.op == "create" else None  # type: ignore[union-attr]
        return _Planned(None, fn, idem, status, etag, path)

    def batch(self, p: Principal, slug: str, ops: list[BatchOperation]) -> list[Reply]:
        """Apply ``ops`` (at most ``BATCH_MAX_OPERATIONS``) to store ``slug`` in order, in one
        transaction; returns one ``Reply`` per operation: what it would have got alone
        (``status``, ``body`` bytes: the model or a problem, ``headers``: ``ETag``,
        ``replayed``). A refused operation leaves nothing (its savepoint is rolled back, its
        idempotency key stays unused); the others commit.

        Raises ``ServiceError`` for a refusal of the whole batch: 413 ``batch_too_large``,
        401/403/404 (token, access, store); ``sqlalchemy.exc.OperationalError`` when the
        database stays locked."""
        if len(ops) > BATCH_MAX_OPERATIONS:
            raise ServiceError(413, "batch_too_large",
                               f"{len(ops)} operations; a batch holds at most {BATCH_MAX_OPERATIONS}")
        plans = [self._plan(p, slug, i, op) for i, op in enumerate(ops)]  # outside the lock
        keys = sorted({pl.idem.key for pl in plans if pl.idem is not None})
        savepoints = False
        for attempt in range(4):
            try:
                replies, notes, vseqs, eseqs = self._batch_tx(p, slug, plans, keys, savepoints)
                break
            except _LateRefusal:
                # an operation was refused after it wrote (no check of the rules does that
                # today): the same batch again, every operation in a SAVEPOINT
                log.warning("batch operation refused after writing; running the batch with savepoints")
                savepoints = True
            except IntegrityError:
                # a concurrent transaction stored one of the keys (or took a path) first: run
                # the whole batch again; its lookups now see what committed
                log.info("batch conflicted with a concurrent write (attempt %d)", attempt + 1)
                if attempt >= 2:
                    raise ServiceError(409, "exists", "conflicting concurrent write") from None
        self.notifier.committed(notes, own=(vseqs, eseqs))
        applied = sum(1 for r in replies if r.status < 300 and not r.replayed)
        log.debug("batch on store %s: %d operations, %d applied", slug, len(ops), applied)
        return replies

    def _batch_tx(self, p: Principal, slug: str, plans: list[_Planned], keys: list[str], savepoints: bool,
                  *, prepare: Callable[[Connection], None] | None = None,
                  finish: Callable[[Connection, list[Reply]], None] | None = None,
                  ) -> tuple[list[Reply], list[wakeups.Note], list[int], list[int]]:
        """The batch's transaction. ``prepare(conn)`` runs first (a consolidation job makes its
        output store there); ``finish(conn, replies)`` runs after every operation, before the
        commit: raising rolls the whole batch back (a job's all-or-nothing result)."""
        with self.db.write_conn() as conn:
            wakeups.begin_notes()
            history.reset(conn)
            if prepare is not None:
                prepare(conn)
            row = self._store(conn, p, slug, write=True)
            st = BatchStore(row)
            stored: dict[str, Any] = {}
            if keys:
                self.writer.idem_cleanup(conn)
                stored = {r.key: r for r in conn.execute(_SELECT_IDEM_MANY, {"scope": p.scope, "keys": keys})}
            lead = []  # the creates at the head of the batch: deferred (BatchStore)
            for pl in plans:
                if pl.fn is not None and pl.create_path is None:
                    break
                if pl.create_path is not None:
                    lead.append(pl.create_path)
            if len(lead) > 1 and not savepoints:
                st.defer(conn, lead, len(lead))
            now = utcnow()
            replies: list[Reply] = []
            new_keys: dict[str, tuple[IdempotencyRequest, Reply]] = {}
            inserts: list[dict[str, Any]] = []
            for pl in plans:
                if pl.fn is not None and pl.create_path is None:
                    st.flush(conn)  # another kind of write reads records: the creates first
                replies.append(self._batch_one(conn, p.scope, st, pl, stored, new_keys, inserts, now, savepoints))
            st.flush(conn)
            d_count, d_bytes = st.record_count - st.read_count, st.usage_bytes - st.read_bytes
            if d_count or d_bytes:
                conn.execute(_UPDATE_USAGE, {"slug_": st.slug, "d_bytes": d_bytes, "d_count": d_count})
            if inserts:
                conn.execute(_INSERT_IDEM, inserts)
            history.settle(conn)
            if finish is not None:
                finish(conn, replies)
            notes, vseqs, eseqs = wakeups.take_notes()
            self.bus.publish(conn, notes)  # one NOTIFY for the batch (PostgreSQL)
        return replies, notes, vseqs, eseqs

    def _batch_one(self, conn: Connection, scope: str, st: BatchStore, pl: _Planned, stored: dict[str, Any],
                   new_keys: dict[str, tuple[IdempotencyRequest, Reply]],
                   inserts: list[dict[str, Any]], now: datetime, savepoints: bool) -> Reply:
        idem = pl.idem
        try:
            if idem is not None:
                row = stored.get(idem.key)
                if row is not None and row.created_at >= now - IDEMPOTENCY_TTL:
                    return self.writer.idem_replay(row, idem)
                earlier = new_keys.get(idem.key)  # the same key earlier in this batch
                if earlier is not None:
                    first, reply = earlier
                    if (first.method, first.url_path, first.body_sha256) != (
                            idem.method, idem.url_path, idem.body_sha256):
                        raise ServiceError(422, "idempotency_key_reused",
                                           "this Idempotency-Key was used for a different request")
                    return Reply(reply.status, reply.body, reply.headers, replayed=True)
            if pl.refusal is not None:
                raise pl.refusal
            assert pl.fn is not None
            mark = wakeups.notes_mark()
            counters = st.record_count, st.usage_bytes
            if savepoints:
                kept = history.kept_mark(conn)
                savepoint = conn.begin_nested()
                try:
                    result = pl.fn(conn, st)
                except ServiceError:
                    savepoint.rollback()
                    wakeups.notes_rollback(mark)
                    history.kept_rollback(conn, kept)
                    st.record_count, st.usage_bytes = counters
                    raise
                except BaseException:
                    savepoint.rollback()
                    raise
                savepoint.commit()
            else:
                writes = conn.info.get("memfuse_writes", 0)
                try:
                    result = pl.fn(conn, st)
                except ServiceError:
                    if conn.info.get("memfuse_writes", 0) != writes:
                        raise _LateRefusal() from None
                    raise
        except ServiceError as err:
            return Reply(err.status, problem_body(err), {"Content-Type": "application/problem+json"})
        body = answer_json(result) if result is not None else b""
        headers: dict[str, str] = {}
        if pl.etag and result is not None and getattr(result, "sha256", None):
            headers["ETag"] = f'"{getattr(result, "sha256")}"'  # a Record's (as Writer.write)
        if result is None:  # a delete's 204: the seq of its version (as Writer.write)
            seq_header(headers, wakeups.version_seq_since(mark))
        reply = Reply(pl.status, body, headers)
        if idem is not None:
            if idem.key in stored:  # an expired row of the same key: the new answer replaces it
                conn.execute(delete(_I).where(_I.c.scope == scope, _I.c.key == idem.key))
            new_keys[idem.key] = (idem, reply)
            inserts.append({
                "scope": scope, "key": idem.key, "method": idem.method,
                "url_path": idem.url_path, "request_hash": idem.body_sha256, "status": pl.status,
                "response_body": body.decode(), "response_headers": json.dumps(headers),
                "created_at": now,
            })
        return reply
