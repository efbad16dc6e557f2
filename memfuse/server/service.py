"""Business logic of the reference control plane: every rule of docs/API.md, no HTTP.

``Service`` methods take a ``Principal`` (who is calling) and plain arguments, open their own
short database session (``Database.read()`` / ``.write()``), and return the wire models of
``memfuse.models``. Write methods return a ``Reply`` (status, JSON body, headers) because the
stored response of an ``Idempotency-Key`` is part of the contract: the key is checked and the
response stored inside the same transaction as the change, so a retried request never applies
twice, even across processes sharing one database.

Refusals raise ``ServiceError`` (HTTP status, problem ``code``, detail, extra fields).

``Service`` is a facade: it builds the parts (``memfuse.server.base.Parts``: the database,
the notifier and commit bus, the shared ``Settings``, the access rules, the write
transaction) and one service object per resource from them, each given the other resources it
needs at construction, and offers their public methods under their usual names
(``svc.create_record`` is ``svc.records.create_record``). The resources:

- ``base``: ``ServiceError``, ``Principal``, ``IdempotencyRequest``, ``Reply``,
  ``parse_if_match``, ``body_sha256``, and the parts: ``Settings``, ``AccessRules`` (who may
  address which workspace and store), ``Writer`` (the write transaction with its idempotency
  check), ``Resource`` (the base of every resource service);
- ``accounts`` (``AccountsService``): accounts, quotas, a root admin acting in an account;
- ``tokens`` (``TokensService``): authentication, the token cache, token creation;
- ``sessions`` (``SessionsService``): the console's sessions;
- ``stores`` (``StoresService``): workspaces, stores, attachments and the workspace events
  they emit;
- ``records`` (``RecordsService``): record and version writes (SQLAlchemy Core; store usage
  counters kept in the same transaction); ``recordreads`` (``RecordReadsService``): their
  reads; ``recordrows``: what both share (the row object, the content rules, the statements);
- ``batch`` (``BatchService``): many record writes to one store in one transaction;
- ``changes`` (``ChangesService``): the change feed, the workspace events feed, and the
  shared feed reads of long-polls (``feed_read``); ``memfuse.server.wakeups`` has the
  ``Notifier`` (wakes this process's long-polls after a commit, knows the heads) and the
  ``Bus`` (commit notes between replicas);
- ``consolidation`` (``ConsolidationService``): consolidation jobs (a model rewrites a
  store: new store or in place), their runner threads, the stale-job reaper and scheduled
  maintenance;
- ``search`` (``SearchService``): search (path / content, bounded pages) and the bounded
  directory tree of the memory tool's ``view``;
- ``context`` (``ContextService``): the prompt block (``cut_index``, ``strip_controls``);
- ``memstores`` (``MemoryStoresService``): what the Anthropic memory-store API
  (``memfuse.server.anthropic_api``) needs beyond the rest;
- ``indexreport`` (``IndexReportService``): how a store's ``MEMORY.md`` and its records agree.
"""
from __future__ import annotations

from memfuse import content as content_rules  # noqa: F401  (tests switch the secret detector off through this name)
from memfuse.defs import RECORD_BODY_MAX
from memfuse.server.base import (
    IDEMPOTENCY_TTL,
    IdempotencyRequest,
    Principal,
    Parts,
    Reply,
    ServiceError,
    Settings,
    body_sha256,
    canonical_sha256,
    idempotency_request,
    parse_if_match,
    with_write_headers,
)
from memfuse.server import staleness
from memfuse.server.accounts import AccountsService
from memfuse.server.batch import BatchService
from memfuse.server.changes import MAX_WAIT_SECONDS, ChangesService, FeedRead
from memfuse.server.consolidation import ConsolidationService
from memfuse.server.context import (
    CONTEXT_INDEX_MAX_BYTES,
    CONTEXT_INDEX_MAX_LINES,
    CONTEXT_MAX_BYTES_ENV,
    CONTEXT_MIN_BYTES,
    CONTEXT_TOTAL_MAX_BYTES,
    ContextService,
    cut_index,
)
from memfuse.server.db import Database
from memfuse.server.indexreport import IndexReportService
from memfuse.server.jobspec import ConsolidationSettings
from memfuse.server.memstores import MemoryStoresService
from memfuse.server.recordreads import RecordReadsService, VersionList  # noqa: F401  (VersionList: list_versions answers it)
from memfuse.server.recordrows import _usage  # noqa: F401  (_usage: for tests)
from memfuse.server.records import RecordsService
from memfuse.server.search import SearchService
from memfuse.server.sessions import SessionsService
from memfuse.server.stores import StoresService
from memfuse.server.tokens import TOKEN_CACHE_MAX, TOKEN_CACHE_SECONDS, TokensService
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
    "with_write_headers",
]


class Service:
    """The control plane's rules over a ``Database``: the resource services, composed.

    ``static_tokens`` maps raw token → workspace (None = admin); the mapping is consulted on
    every request, so a caller may add tokens later (the in-process fake does).
    ``context_max_bytes`` is the default bound of the prompt block (``context``).
    ``mount_root`` is where this deployment's sidecars mount the stores (``/mnt/memory``, the
    Kubernetes manifests' path; ``memfuse dev`` sets its real mountpoint): the default of the
    prompt block's paths, so the console's preview shows what the agents get.

    The resources are attributes (``accounts``, ``tokens``, ``sessions``, ``stores``,
    ``records``, ``record_reads``, ``batches``, ``consolidations``, ``searches``, ``changes``, ``contexts``,
    ``memory_stores``, ``index_reports``); their public methods are bound here under their
    own names. The settings (``closing``, ``stale_after_days``, ``expiry_interval``,
    ``context_max_bytes``, ``mount_root``) are the one shared ``Settings`` object's: setting
    them here is seen by every resource.
    """

    parts: Parts
    db: Database
    notifier: Notifier
    bus: Bus
    settings: Settings
    static_tokens: dict[str, str | None]
    accounts: AccountsService
    tokens: TokensService
    sessions: SessionsService
    stores: StoresService
    records: RecordsService
    record_reads: RecordReadsService
    batches: BatchService
    consolidations: ConsolidationService
    searches: SearchService
    changes: ChangesService
    contexts: ContextService
    memory_stores: MemoryStoresService
    index_reports: IndexReportService

    def __init__(
        self,
        db: Database,
        static_tokens: dict[str, str | None] | None = None,
        *,
        context_max_bytes: int = CONTEXT_TOTAL_MAX_BYTES,
        mount_root: str = "/mnt/memory",
        max_body: int = RECORD_BODY_MAX,
    ) -> None:
        # staleness (memfuse.server.staleness): age of a stale record (days, 0 = off) and
        # the expiry sweep's interval in ``memfuse serve`` (seconds, 0 = no sweep);
        # ``max_body``: the front door's bound of a record write's body (Settings)
        settings = Settings(context_max_bytes=context_max_bytes, mount_root=mount_root,
                            stale_after_days=staleness.STALE_AFTER_DAYS, max_body=max_body)
        parts = self.parts = Parts.build(db, settings)
        self.db, self.notifier, self.bus, self.settings = db, parts.notifier, parts.bus, settings
        self.static_tokens = static_tokens if static_tokens is not None else {}
        self.accounts = AccountsService(parts)
        self.tokens = TokensService(parts, self.static_tokens, self.accounts)
        self.sessions = SessionsService(parts, self.tokens)
        self.stores = StoresService(parts, self.accounts)
        self.records = RecordsService(parts)
        self.record_reads = RecordReadsService(parts)
        self.batches = BatchService(parts, self.records)
        self.consolidations = ConsolidationService(parts, self.accounts, self.batches)
        self.searches = SearchService(parts)
        self.changes = ChangesService(parts)
        self.contexts = ContextService(parts)
        self.memory_stores = MemoryStoresService(parts, self.records, self.stores, self.accounts)
        self.index_reports = IndexReportService(parts)
        # accounts
        self.act_in_account = self.accounts.act_in_account
        self.set_session_account = self.accounts.set_session_account
        self.create_account = self.accounts.create_account
        self.list_accounts = self.accounts.list_accounts
        self.account_slugs = self.accounts.account_slugs
        self.get_account = self.accounts.get_account
        self.update_account = self.accounts.update_account
        self.delete_account = self.accounts.delete_account
        # tokens
        self.authenticate = self.tokens.authenticate
        self.authenticate_cached = self.tokens.authenticate_cached
        self.tokens_gone = self.tokens.tokens_gone
        self.token_id_of = self.tokens.token_id_of
        self.token_upkeep_due = self.tokens.token_upkeep_due
        self.token_upkeep = self.tokens.token_upkeep
        self.confirm_cached_tokens = self.tokens.confirm_cached_tokens
        self.flush_token_use = self.tokens.flush_token_use
        self.tokens_revoked = self.tokens.tokens_revoked
        self.create_token = self.tokens.create_token
        self.list_tokens = self.tokens.list_tokens
        self.revoke_token = self.tokens.revoke_token
        # sessions
        self.create_session = self.sessions.create_session
        self.session_principal = self.sessions.session_principal
        self.end_session = self.sessions.end_session
        # stores
        self.put_account_attachment = self.stores.put_account_attachment
        self.delete_account_attachment = self.stores.delete_account_attachment
        self.create_workspace = self.stores.create_workspace
        self.list_workspaces = self.stores.list_workspaces
        self.create_store = self.stores.create_store
        self.list_stores = self.stores.list_stores
        self.get_store = self.stores.get_store
        self.update_store = self.stores.update_store
        self.put_attachment = self.stores.put_attachment
        self.delete_attachment = self.stores.delete_attachment
        self.check_workspace = self.stores.check_workspace
        self.list_attachments = self.stores.list_attachments
        self.workspace_attachments = self.stores.workspace_attachments
        self.stores_over_body_bound = self.stores.stores_over_body_bound
        self.warn_stores_over_body_bound = self.stores.warn_stores_over_body_bound
        # record_reads
        self.list_records = self.record_reads.list_records
        self.list_records_json = self.record_reads.list_records_json
        self.list_records_pieces = self.record_reads.list_records_pieces
        self.search_records = self.record_reads.search_records
        self.get_record = self.record_reads.get_record
        self.list_versions = self.record_reads.list_versions
        self.get_version = self.record_reads.get_version
        # records
        self.create_record = self.records.create_record
        self.update_record = self.records.update_record
        self.append_record = self.records.append_record
        self.set_attributes = self.records.set_attributes
        self.move_record = self.records.move_record
        self.move_prefix = self.records.move_prefix
        self.delete_record = self.records.delete_record
        self.restore_record = self.records.restore_record
        self.redact_version = self.records.redact_version
        # batches
        self.batch = self.batches.batch
        # consolidations
        self.create_consolidation = self.consolidations.create_consolidation
        self.get_consolidation = self.consolidations.get_consolidation
        self.list_consolidations = self.consolidations.list_consolidations
        self.cancel_consolidation = self.consolidations.cancel_consolidation
        self.consolidation_diff = self.consolidations.consolidation_diff
        self.consolidation_account = self.consolidations.consolidation_account
        self.reap_stale_jobs = self.consolidations.reap_stale_jobs
        self.stop_jobs = self.consolidations.stop_jobs
        self.schedule_once = self.consolidations.schedule_once
        # searches
        self.search = self.searches.search
        self.tree = self.searches.tree
        # changes
        self.events_page = self.changes.events_page
        self.check_feed_access = self.changes.check_feed_access
        self.cached_feed_key = self.changes.cached_feed_key
        self.check_events_access = self.changes.check_events_access
        self.cached_events_key = self.changes.cached_events_key
        self.feed_read = self.changes.feed_read
        self.feed_own_run = self.changes.feed_own_run
        self.changes_page = self.changes.changes_page
        # contexts
        self.context = self.contexts.context
        # memory_stores
        self.ms_list_stores = self.memory_stores.ms_list_stores
        self.ms_get_store = self.memory_stores.ms_get_store
        self.ms_create_store = self.memory_stores.ms_create_store
        self.ms_update_store = self.memory_stores.ms_update_store
        self.ms_archive_store = self.memory_stores.ms_archive_store
        self.ms_delete_store = self.memory_stores.ms_delete_store
        self.ms_list_memories = self.memory_stores.ms_list_memories
        self.ms_update_memory = self.memory_stores.ms_update_memory
        self.ms_list_versions = self.memory_stores.ms_list_versions
        self.ms_get_version = self.memory_stores.ms_get_version
        self.ms_redact_version = self.memory_stores.ms_redact_version
        self.ms_create_memory = self.memory_stores.ms_create_memory
        # index_reports
        self.index_report = self.index_reports.index_report

    # ------------------------------------------------------------ the shared settings

    @property
    def closing(self) -> bool:
        """Set at server shutdown: long-polls answer at once."""
        return self.settings.closing

    @closing.setter
    def closing(self, value: bool) -> None:
        self.settings.closing = value

    @property
    def stale_after_days(self) -> int:
        """Age of a stale record in days (0 = off; ``memfuse.server.staleness``)."""
        return self.settings.stale_after_days

    @stale_after_days.setter
    def stale_after_days(self, value: int) -> None:
        self.settings.stale_after_days = value

    @property
    def expiry_interval(self) -> float:
        """Seconds between the expiry sweeps of ``memfuse serve`` (0 = no sweep)."""
        return self.settings.expiry_interval

    @expiry_interval.setter
    def expiry_interval(self, value: float) -> None:
        self.settings.expiry_interval = value

    @property
    def context_max_bytes(self) -> int:
        """Default bound of the prompt block in bytes."""
        return self.settings.context_max_bytes

    @context_max_bytes.setter
    def context_max_bytes(self, value: int) -> None:
        self.settings.context_max_bytes = value

    @property
    def mount_root(self) -> str:
        """The default mount root of the prompt block's paths."""
        return self.settings.mount_root

    @mount_root.setter
    def mount_root(self, value: str) -> None:
        self.settings.mount_root = value

    @property
    def consolidation(self) -> ConsolidationSettings:
        """The consolidation jobs' settings (off until a model is configured)."""
        return self.consolidations.consolidation

    @consolidation.setter
    def consolidation(self, value: ConsolidationSettings) -> None:
        self.consolidations.consolidation = value
