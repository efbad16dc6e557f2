"""Business logic of the reference control plane: every rule of docs/API.md, no HTTP.

``Service`` methods take a ``Principal`` (who is calling) and plain arguments, open their own
short database session (``Database.read()`` / ``.write()``), and return the wire models of
``memfuse.models``. Write methods return a ``Reply`` (status, JSON body, headers) because the
stored response of an ``Idempotency-Key`` is part of the contract: the key is checked and the
response stored inside the same transaction as the change, so a retried request never applies
twice, even across processes sharing one database.

Refusals raise ``ServiceError`` (HTTP status, problem ``code``, detail, extra fields).

This module only composes ``Service`` from one room per resource, and re-exports what callers
import from here:

- ``base``: ``ServiceError``, ``Principal``, ``IdempotencyRequest``, ``Reply``,
  ``parse_if_match``, ``body_sha256``, and ``ServiceBase`` (access checks, the write
  transaction with its idempotency check);
- ``tokens``: authentication and token creation;
- ``stores``: workspaces, stores, attachments and the workspace events they emit;
- ``records``: record and version reads and writes (SQLAlchemy Core; store usage counters
  kept in the same transaction);
- ``batch``: many record writes to one store in one transaction (``batch``);
- ``changes``: the change feed, the workspace events feed, and the shared feed reads of
  long-polls (``feed_read``); ``memfuse.server.wakeups`` has the ``Notifier`` (wakes this
  process's long-polls after a commit, knows the heads) and the ``Bus`` (commit notes between
  replicas);
- ``consolidation``: consolidation jobs (a model rewrites a store: new store or in place),
  their runner threads, the stale-job reaper and scheduled maintenance;
- ``search``: search (path / content, bounded pages) and the bounded directory tree of the
  memory tool's ``view``;
- ``context``: the prompt block (``cut_index``, ``strip_controls``);
- ``memstores``: what the Anthropic memory-store API (``memfuse.server.anthropic_api``) needs
  beyond the rest (stores by name, archive, delete; listings by depth; versions by seq).
"""
from __future__ import annotations

import threading

from memfuse import content as content_rules  # noqa: F401  (tests switch the secret detector off through this name)
from memfuse.server.base import (
    IDEMPOTENCY_TTL,
    IdempotencyRequest,
    Principal,
    Reply,
    ServiceError,
    body_sha256,
    canonical_sha256,
    idempotency_request,
    parse_if_match,
)
from memfuse.server import staleness, wakeups
from memfuse.server.accounts import AccountsMixin
from memfuse.server.batch import BatchMixin
from memfuse.server.changes import MAX_WAIT_SECONDS, ChangesMixin, FeedRead
from memfuse.server.consolidation import ConsolidationMixin, ConsolidationSettings
from memfuse.server.context import (
    CONTEXT_INDEX_MAX_BYTES,
    CONTEXT_INDEX_MAX_LINES,
    CONTEXT_MAX_BYTES_ENV,
    CONTEXT_MIN_BYTES,
    CONTEXT_TOTAL_MAX_BYTES,
    ContextMixin,
    cut_index,
)
from memfuse.server.db import Database
from memfuse.server.indexreport import IndexReportMixin
from memfuse.server.memstores import MemoryStoresMixin
from memfuse.server.records import RecordsMixin, _usage  # noqa: F401  (_usage: for tests)
from memfuse.server.search import SearchMixin
from memfuse.server.sessions import SessionsMixin
from memfuse.server.stores import StoresMixin
from memfuse.server.tokens import TOKEN_CACHE_MAX, TOKEN_CACHE_SECONDS, TokenCache, TokensMixin
from memfuse.server.wakeups import Bus, Notifier

# Re-exported: callers (the app, tests, other branches) import these from here.
__all__ = [
    "CONTEXT_INDEX_MAX_BYTES",
    "CONTEXT_INDEX_MAX_LINES",
    "CONTEXT_MAX_BYTES_ENV",
    "CONTEXT_MIN_BYTES",
    "CONTEXT_TOTAL_MAX_BYTES",
    "IDEMPOTENCY_TTL",
    "MAX_WAIT_SECONDS",
    "TOKEN_CACHE_MAX",
    "TOKEN_CACHE_SECONDS",
    "FeedRead",
    "IdempotencyRequest",
    "Notifier",
    "Principal",
    "Reply",
    "Service",
    "ServiceError",
    "body_sha256",
    "canonical_sha256",
    "idempotency_request",
    "cut_index",
    "parse_if_match",
]


class Service(AccountsMixin, TokensMixin, SessionsMixin, StoresMixin, ConsolidationMixin, BatchMixin, RecordsMixin,
              SearchMixin, ChangesMixin, ContextMixin, MemoryStoresMixin, IndexReportMixin):
    """The control plane's rules over a ``Database``.

    ``static_tokens`` maps raw token → workspace (None = admin); the mapping is consulted on
    every request, so a caller may add tokens later (the in-process fake does).
    ``context_max_bytes`` is the default bound of the prompt block (``context``).
    ``mount_root`` is where this deployment's sidecars mount the stores (``/mnt/memory``, the
    Kubernetes manifests' path; ``memfuse dev`` sets its real mountpoint): the default of the
    prompt block's paths, so the console's preview shows what the agents get.
    """

    def __init__(
        self,
        db: Database,
        static_tokens: dict[str, str | None] | None = None,
        *,
        context_max_bytes: int = CONTEXT_TOTAL_MAX_BYTES,
        mount_root: str = "/mnt/memory",
    ) -> None:
        self.db = db
        self.context_max_bytes = context_max_bytes
        self.mount_root = mount_root
        self.static_tokens: dict[str, str | None] = static_tokens if static_tokens is not None else {}
        self.notifier = Notifier()
        self.bus = Bus(db, self.notifier)
        db.on_dispose(self.bus.close)
        db.on_dispose(lambda: self.flush_token_use(force=True))  # pending last_used_at
        self.closing = False  # set at server shutdown: long-polls answer at once
        # staleness (memfuse.server.staleness): age of a stale record (days, 0 = off) and
        # the expiry sweep's interval in ``memfuse serve`` (seconds, 0 = no sweep)
        self.stale_after_days = staleness.STALE_AFTER_DAYS
        self.expiry_interval = 0.0
        self._last_idem_cleanup = 0.0
        # consolidation jobs (memfuse.server.consolidation): off until a model is configured;
        # this process's running jobs, stopped (failed, nothing written) before the pool closes
        self.consolidation = ConsolidationSettings()
        self._job_cancels: dict[str, threading.Event] = {}
        self._job_threads: dict[str, threading.Thread] = {}
        db.on_dispose(self.stop_jobs)
        self._token_cache = TokenCache()  # database tokens seen lately
        self._feed_keys: dict[tuple[str, str], str] = {}  # (scope, store name) -> key (changes.py)
        # a revocation committed on any replica reaches this one on the commit bus; after the
        # bus (re)connects nothing cached is trusted (revocations may have been missed)
        self.notifier.on_topic(wakeups.TOKEN_REVOKED, lambda token_id: self.tokens_revoked({token_id}))
        self.notifier.on_reset.append(lambda: self.tokens_revoked(None))
