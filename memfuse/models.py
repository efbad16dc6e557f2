"""Wire models of the control-plane API v1 (docs/API.md): the server's side.

Every body the API sends or takes is one of these pydantic models, so the OpenAPI document the
reference server publishes (``/openapi.json``) and the server agree by construction. The client
side (``memfuse.client`` and all that uses it: sidecar, CLI) uses the msgspec Structs of
:mod:`memfuse.wire` instead, one per model here with the same fields, types and defaults
(``tests/test_wire.py`` holds them equal): a body added here needs its Struct there.

Conventions:
- times are timezone-aware UTC ``datetime``;
- ``sha256`` is the lowercase hex digest of the UTF-8 content bytes and doubles as the ETag
  (``"<sha256>"`` in ``ETag`` / ``If-Match`` headers, RFC 9110 §8.8.3);
- ``content`` is text (UTF-8); records hold Markdown, JSONL or plain text;
- ``seq`` is the change-feed position: a number that grows with every version written;
- file attributes: ``mode`` is the POSIX permission bits (``0o777`` mask: rwx for user,
  group, other; setuid, setgid and sticky are refused in requests, 422, and stripped on
  export), 0o644 when never set; ``mtime_ns`` is the
  modification time in integer nanoseconds since the Unix epoch (as ``st_mtime_ns``), None
  when never set explicitly (a file then shows ``updated_at``).
"""
from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Constants, enums and helpers live in memfuse.defs (no pydantic there: the sidecar uses them);
# importing them from here stays supported (``X as X``: an explicit re-export for the type checker).
from .defs import (  # noqa: F401  (re-exported)
    BATCH_MAX_BYTES as BATCH_MAX_BYTES,
    BATCH_MAX_OPERATIONS as BATCH_MAX_OPERATIONS,
    DEFAULT_MAX_RECORD_BYTES as DEFAULT_MAX_RECORD_BYTES,
    INT64_MAX as INT64_MAX,
    DEFAULT_MODE as DEFAULT_MODE,
    INSTRUCTIONS_MAX_CHARS as INSTRUCTIONS_MAX_CHARS,
    MAX_TOKEN_TTL_SECONDS as MAX_TOKEN_TTL_SECONDS,
    MODE_MASK as MODE_MASK,
    MTIME_NS_MAX as MTIME_NS_MAX,
    MTIME_NS_MIN as MTIME_NS_MIN,
    RECORD_TYPES as RECORD_TYPES,
    SLUG_PATTERN as SLUG_PATTERN,
    Access as Access,
    Operation as Operation,
    datetime_ns as datetime_ns,
    mtime_effective_ns as mtime_effective_ns,
    sha256_hex as sha256_hex,
)


# ---------------------------------------------------------------- admin resources


class WorkspaceCreate(BaseModel):
    name: str = Field(pattern=SLUG_PATTERN)
    # Also a store named like the workspace, attached read-write (an existing store of that
    # name is attached, not recreated). False: the workspace starts with no store.
    default_store: bool = Field(default=True, strict=True)  # JSON true/false only: "no" is no bool
    # The owning account (docs/API.md "Accounts"): the root admin's choice, as
    # ``X-Memfuse-Account`` names it; anyone else may name only its own. None: the caller's.
    account: str | None = Field(default=None, pattern=SLUG_PATTERN)


class Workspace(BaseModel):
    name: str
    created_at: datetime
    account: str = "default"  # the owning account (docs/API.md "Accounts")


# ---------------------------------------------------------------- accounts


class AccountCreate(BaseModel):
    """``POST /v1/accounts`` (root admin): a new account; quotas None = unlimited."""

    slug: str = Field(pattern=SLUG_PATTERN)
    max_stores: int | None = Field(default=None, ge=0, le=INT64_MAX, strict=True)  # true is not 1
    max_bytes: int | None = Field(default=None, ge=0, le=INT64_MAX, strict=True)
    max_tokens: int | None = Field(default=None, ge=0, le=INT64_MAX, strict=True)


class AccountUpdate(BaseModel):
    """``PATCH /v1/accounts/{account}`` (root admin): new quotas. A field left out keeps its
    quota; ``null`` makes it unlimited and a number sets it (as in ``AccountCreate``, ``0``
    is a quota of zero, not unlimited). A quota below the current usage refuses what would
    add to it (new stores, new tokens, growing writes) and deletes nothing."""

    model_config = ConfigDict(extra="forbid")  # a misspelt quota is a 422, not a silent no-op

    max_stores: int | None = Field(default=None, ge=0, le=INT64_MAX, strict=True)
    max_bytes: int | None = Field(default=None, ge=0, le=INT64_MAX, strict=True)
    max_tokens: int | None = Field(default=None, ge=0, le=INT64_MAX, strict=True)


class AccountAttachment(BaseModel):
    """A store attached to every workspace of its account (``PUT
    /v1/accounts/{account}/attachments/{store}``): the store's name in the account, the
    access every workspace gets, when the account-wide attachment was made."""

    store: str
    access: Access
    created_at: datetime


class Account(BaseModel):
    """An account with its quotas (None: unlimited) and usage: ``stores`` (count),
    ``bytes`` (live record bytes of all its stores), ``tokens`` (active tokens:
    neither revoked nor expired); and its account-wide ``attachments``, by store name."""

    slug: str
    created_at: datetime
    max_stores: int | None = None
    max_bytes: int | None = None
    max_tokens: int | None = None
    stores: int = 0
    bytes: int = 0
    tokens: int = 0
    attachments: list[AccountAttachment] = []


class StoreLimits(BaseModel):
    """Per-store limits; ``None`` in an update means 'leave as is'."""

    max_record_bytes: int = 1 << 20
    max_store_bytes: int = 64 << 20
    max_records: int = 10_000


class StoreCreate(BaseModel):
    slug: str = Field(pattern=SLUG_PATTERN)
    description: str = ""
    default_type: Literal["user", "feedback", "project", "reference"] = "project"
    max_record_bytes: int = Field(default=DEFAULT_MAX_RECORD_BYTES, gt=0, le=INT64_MAX, strict=True)
    max_store_bytes: int = Field(default=64 << 20, gt=0, le=INT64_MAX, strict=True)
    max_records: int = Field(default=10_000, gt=0, le=INT64_MAX, strict=True)
    max_history_bytes: int | None = Field(default=None, gt=0, le=INT64_MAX, strict=True)
    max_history_versions: int | None = Field(default=None, gt=0, le=INT64_MAX, strict=True)
    history_min_age_s: int | None = Field(default=None, ge=0, le=INT64_MAX, strict=True)
    # The owning account, as in ``WorkspaceCreate.account``.
    account: str | None = Field(default=None, pattern=SLUG_PATTERN)


class StoreUpdate(BaseModel):
    description: str | None = None
    default_type: Literal["user", "feedback", "project", "reference"] | None = None
    max_record_bytes: int | None = Field(default=None, gt=0, le=INT64_MAX, strict=True)
    max_store_bytes: int | None = Field(default=None, gt=0, le=INT64_MAX, strict=True)
    max_records: int | None = Field(default=None, gt=0, le=INT64_MAX, strict=True)
    max_history_bytes: int | None = Field(default=None, gt=0, le=INT64_MAX, strict=True)
    max_history_versions: int | None = Field(default=None, gt=0, le=INT64_MAX, strict=True)
    history_min_age_s: int | None = Field(default=None, ge=0, le=INT64_MAX, strict=True)


class Store(BaseModel):
    slug: str
    description: str
    default_type: str
    max_record_bytes: int
    max_store_bytes: int
    max_records: int
    created_at: datetime
    usage_bytes: int = 0
    record_count: int = 0
    # the history budget in force (the store's own, else the default) and its use: content
    # bytes and count of the past versions kept (docs/SEMANTICS.md "History budget")
    max_history_bytes: int = 0
    max_history_versions: int = 0
    history_min_age_s: int = 0
    history_bytes: int = 0
    history_versions: int = 0
    account: str = "default"  # the owning account (docs/API.md "Accounts")


class AttachmentPut(BaseModel):
    access: Access = Access.read_write
    instructions: str = Field(default="", max_length=INSTRUCTIONS_MAX_CHARS)


class Attachment(BaseModel):
    """One store attached to one workspace, with the store's description and limits."""

    workspace: str
    store: Store
    access: Access
    instructions: str
    created_at: datetime


class TokenCreate(BaseModel):
    """A token for one workspace, or an admin token when ``workspace`` is None.
    ``ttl_seconds``: the token expires that long after creation (never when None)."""

    workspace: str | None = None
    name: str = Field(default="", max_length=200)
    ttl_seconds: int | None = Field(default=None, ge=1, le=MAX_TOKEN_TTL_SECONDS, strict=True)  # true is not 1 s
    # an admin token (no workspace) for this account only (an account admin); the root
    # admin's when None (docs/API.md "Accounts")
    account: str | None = Field(default=None, pattern=SLUG_PATTERN)


class TokenCreated(BaseModel):
    id: str
    workspace: str | None
    name: str
    token: str  # shown once; the server keeps only its sha256
    expires_at: datetime | None = None
    account: str | None = None  # None: a root admin token


class TokenInfo(BaseModel):
    """A token as listed (``GET /v1/tokens``): never its secret. ``state`` is ``active``,
    ``expired`` (``expires_at`` passed) or ``revoked`` (``revoked_at`` set); ``last_used_at``
    is updated at most once a minute per token, so it may lag the last use by that much."""

    id: str
    workspace: str | None
    name: str
    created_at: datetime
    last_used_at: datetime | None = None
    expires_at: datetime | None = None
    revoked_at: datetime | None = None
    state: Literal["active", "expired", "revoked"] = "active"
    account: str | None = None  # None: a root admin token


# ---------------------------------------------------------------- records


Mode = Field(default=None, ge=0, le=MODE_MASK, strict=True,
             description="permission bits (0..0o777; setuid, setgid, sticky refused); absent: 0o644 on create, unchanged on update")
MtimeNs = Field(default=None, ge=MTIME_NS_MIN, le=MTIME_NS_MAX, strict=True,
                description="modification time, integer ns since the Unix epoch")


class RecordCreate(BaseModel):
    """A new record. ``mode``: permission bits (absent or null: 0o644); ``mtime_ns``: an
    explicit modification time (absent or null: the file shows ``updated_at``)."""

    path: str
    content: str
    type: str | None = None
    mode: int | None = Mode
    mtime_ns: int | None = MtimeNs


class RecordUpdate(BaseModel):
    """New content (and type, attributes) of a record. ``mode`` absent or null: kept.
    ``mtime_ns`` absent or null: an explicit mtime is kept when the content stays the same
    and cleared when it changes (a write sets the mtime, as on a local disk)."""

    content: str
    type: str | None = None
    mode: int | None = Mode
    mtime_ns: int | None = MtimeNs
    #: the write is sent by last writer wins over a concurrent change it did not merge (the
    #: sidecar's conflict rule, docs/SEMANTICS.md "Conflicts"): the version it replaces is
    #: recorded as overwritten (``Change.overwrote``), so that version's writer can be told;
    #: absent, null or false: an ordinary write
    overwrite: bool | None = Field(default=None, strict=True)
    #: with ``overwrite``: the sha256 of the version the write was made on (the ``If-Match``
    #: that failed); every writer of a version after it is named in ``Change.overwrote.also``
    #: (their changes are dropped too), not only the writer of the version replaced
    overwrite_base: str | None = None


class RecordAppend(BaseModel):
    """``POST .../records/{record_id}/append``: add ``append`` at the end of the record's
    content (``echo line >> f``), sent as only the suffix, ``If-Match`` the version it
    extends; ``type``, ``mode``, ``mtime_ns`` as in [RecordUpdate]."""

    append: str
    type: str | None = None
    mode: int | None = Mode
    mtime_ns: int | None = MtimeNs


class RecordAttributes(BaseModel):
    """``PATCH`` body: change only a record's attributes, never its content. A member left
    out is kept; ``mode: null`` resets the permission bits to 0o644; ``mtime_ns: null``
    clears the explicit mtime (the file then shows ``updated_at``)."""

    mode: int | None = Mode
    mtime_ns: int | None = MtimeNs


class RecordMove(BaseModel):
    """Move one record to ``path``. With ``replace`` an existing record at ``path`` keeps its
    id and history and gets this record's content as a new version; this record is deleted."""

    path: str
    replace: bool = Field(default=False, strict=True)


class PrefixMove(BaseModel):
    """Move every record under ``from_prefix/`` to ``to_prefix/`` in one transaction."""

    from_prefix: str
    to_prefix: str


class Restore(BaseModel):
    version: int = Field(ge=1, le=INT64_MAX, strict=True)


class Record(BaseModel):
    """The current state of a record. ``content`` is None where the call did not ask for it."""

    id: str
    store: str
    path: str
    type: str | None  # None only for the store's root MEMORY.md (the index)
    version: int
    sha256: str
    size: int
    deleted: bool = False
    created_at: datetime
    updated_at: datetime
    updated_by: str
    seq: int
    content: str | None = None
    mode: int = DEFAULT_MODE  # permission bits; 0o644 when never set
    mtime_ns: int | None = None  # explicit mtime (ns since the epoch); None: ``updated_at``
    # from the content's frontmatter (``review_after``, ``expires``): when to check it again,
    # when memfuse deletes it; None when not set (docs/API.md, "Staleness")
    review_after: datetime | None = None
    expires_at: datetime | None = None

    def mtime_effective_ns(self) -> int:
        """The mtime a file shows: ``mtime_ns``, else ``updated_at``, in ns since the epoch."""
        return mtime_effective_ns(self.mtime_ns, self.updated_at)


class Version(BaseModel):
    record_id: str
    version: int
    operation: Operation
    path: str
    type: str | None
    sha256: str
    size: int
    created_at: datetime
    actor: str
    redacted: bool = False
    pruned: bool = False  # content removed by the store's history budget (metadata kept)
    seq: int
    content: str | None = None
    mode: int = DEFAULT_MODE  # the record's attributes as of this version
    mtime_ns: int | None = None


class RecordPage(BaseModel):
    """One page of a store snapshot. ``next_cursor`` is None on the last page; ``seq`` is the
    change-feed position the snapshot is consistent with (resume ``changes?after=seq``)."""

    records: list[Record]
    next_cursor: str | None = None
    seq: int


class MoveResult(BaseModel):
    records: list[Record]


class SearchLine(BaseModel):
    """A line of a record's content that matches a search: ``line`` its number (1-based),
    ``text`` the line, cut at 300 characters (then `` …``). Content: untrusted text."""

    line: int
    text: str


class SearchHit(BaseModel):
    """A live record that matches a search (``GET /v1/stores/{store}/search``): the record
    without content; ``path_match`` whether its path holds the query; ``lines`` its first
    matching lines (at most the request's ``max_lines``); ``line_matches`` how many of its
    lines match in all. A ranked search (``order=relevance``) also gives ``score`` (higher is
    better; comparable within one search only) and ``snippet`` (a short excerpt of the
    content around the query's words, plain untrusted text); None otherwise."""

    record: Record
    path_match: bool = False
    lines: list[SearchLine] = []
    line_matches: int = 0
    score: float | None = None
    snippet: str | None = None


class SearchPage(BaseModel):
    """One page of search hits ordered by path (by score with ``order=relevance``); ``next_cursor`` None on the last page (a page
    may hold fewer hits than ``limit`` and still have a next one); ``seq``: the store's
    change-feed position read before the page."""

    hits: list[SearchHit]
    next_cursor: str | None = None
    seq: int


class IndexEntry(BaseModel):
    """A link of a store's ``MEMORY.md`` (an entry of its index): ``line`` its line
    (1-based), ``text`` the line (cut at 300 characters, then `` …``; untrusted), ``target``
    the path it links relative to the store root (as written when it leaves the store)."""

    line: int
    text: str
    target: str


class StaleRecord(BaseModel):
    """A stale live record (docs/API.md, "Staleness"): its path, last change, and the
    frontmatter's ``review_after`` / ``expires`` (None when not set)."""

    path: str
    updated_at: datetime
    review_after: datetime | None = None
    expires_at: datetime | None = None


class IndexReport(BaseModel):
    """``GET /v1/stores/{store}/index``: how ``MEMORY.md`` and the records agree.
    ``missing``: entries linking no live record nor directory (first 1,000;
    ``missing_count`` all of them); ``unindexed``: live records ``MEMORY.md`` does not
    mention (first 1,000 in path order; ``unindexed_count`` all of them); ``omitted``:
    entries on the lines the prompt block cuts (first 1,000; ``omitted_count`` all);
    ``entries`` links in all; ``bytes_scanned``: the UTF-8 bytes of ``MEMORY.md`` read for
    them (its first 256 Ki characters, whole lines); ``lines`` / ``bytes`` of ``MEMORY.md``
    and how many the prompt block shows;
    ``stale``: the store's stale records, oldest change first (first 100; ``stale_count``
    all), ``stale_after_days`` the server's age of staleness (0: by review date only)."""

    store: str
    index_exists: bool
    entries: int = 0
    missing: list[IndexEntry] = []
    missing_count: int = 0
    unindexed: list[str] = []
    unindexed_count: int = 0
    omitted: list[IndexEntry] = []
    omitted_count: int = 0
    bytes_scanned: int = 0
    lines: int = 0
    lines_shown: int = 0
    bytes: int = 0
    bytes_shown: int = 0
    stale: list[StaleRecord] = []
    stale_count: int = 0
    stale_after_days: int = 0


#: characters of a ``record_id`` a batch operation may name. A record's id is a UUID (36
#: characters; ``recordrows.new_record_id``): a longer one names no record, and each refusal
#: quotes the id it refuses, so an unbounded one made an answer ~3x its request (100 ids of
#: 240,000 characters: a 144 MB answer to a 48 MB batch, serve's RSS +380 MB; attack24 F3).
#: Refused with the batch's ``validation_error`` (422).
RECORD_ID_MAX_LENGTH = 64


class BatchOperation(BaseModel):
    """One write of a batch, as its single endpoint takes it. ``op``: ``create`` (``POST
    .../records``), ``update`` (``PUT .../records/{record_id}``), ``attrs`` (``PATCH
    .../records/{record_id}``), ``move`` (``POST .../records/{record_id}/move``) or
    ``delete`` (``DELETE .../records/{record_id}``), ``append`` (``POST
    .../records/{record_id}/append``). ``body``: that endpoint's JSON body ([RecordCreate],
    [RecordUpdate], [RecordAppend], [RecordAttributes], [RecordMove]; none for ``delete``).
    ``if_match``: what that endpoint takes as ``If-Match``; ``idempotency_key``: what it takes
    as ``Idempotency-Key`` (the same operation sent alone or in a batch is the same request)."""

    op: Literal["create", "update", "append", "attrs", "move", "delete"]
    record_id: str | None = Field(default=None, max_length=RECORD_ID_MAX_LENGTH)
    if_match: str | None = None
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=255)
    body: dict[str, Any] | None = None


class BatchRequest(BaseModel):
    """``POST /v1/stores/{store}/batch``: up to ``BATCH_MAX_OPERATIONS`` operations on one
    store, applied in order in one transaction."""

    operations: list[BatchOperation]


class BatchResult(BaseModel):
    """The answer one operation of a batch would have had alone: ``status`` (201, 200, 204 or
    the refusal's), ``body`` (the [Record] / [MoveResult], a [Problem] for a refusal, None for
    204), ``etag`` (the ``ETag`` header it would have had), ``replayed`` (the stored answer of
    its ``idempotency_key``), ``seq`` (for a 204: the ``Memfuse-Seq`` header it would have
    had, the change-feed seq of the version it made; left out otherwise)."""

    status: int
    body: dict[str, Any] | None = None
    etag: str | None = None
    replayed: bool = False
    seq: int | None = None


class BatchResponse(BaseModel):
    """One ``BatchResult`` per operation, in the request's order."""

    results: list[BatchResult]


CONSOLIDATION_INSTRUCTIONS_MAX_CHARS = 20_000  # a job's instructions, in characters


class ConsolidationCreate(BaseModel):
    """``POST /v1/stores/{store}/consolidations``: what the model is asked to do with the
    store (``instructions``), where the result goes (``new_store``: a new store for review,
    the default; ``in_place``: the store itself, every change a version restore undoes), the
    model (None: the server's default), and whether the store's recent change history (paths,
    operations, actors, times; never past content) goes with the records."""

    instructions: str = Field(min_length=1, max_length=CONSOLIDATION_INSTRUCTIONS_MAX_CHARS)
    output: Literal["new_store", "in_place"] = "new_store"
    model: str | None = Field(default=None, min_length=1, max_length=200)
    include_history: bool = Field(default=False, strict=True)


class ConsolidationUsage(BaseModel):
    """Tokens the model call used, as the Messages API reported them."""

    input_tokens: int = 0
    output_tokens: int = 0


class ConsolidationChange(BaseModel):
    """One change a job made (or, in a new store, made against its input): ``op`` is
    ``write`` (created or changed) or ``delete``."""

    op: Literal["write", "delete"]
    path: str


class ConsolidationJob(BaseModel):
    """A consolidation job. ``status``: ``pending`` → ``running`` → ``completed`` |
    ``failed`` | ``canceled``. ``output_store``: the store the result went to (the new
    store's slug, or the store itself in place; None until written). ``input_seq``: the
    store's change-feed seq the job read. ``usage``: the model call's tokens (None before
    it answered). ``changes``: what the job wrote (path order). ``error``: why it failed
    or was canceled (never memory content). ``summary``: the model's own summary (untrusted
    text)."""

    id: str
    store: str
    status: Literal["pending", "running", "completed", "failed", "canceled"]
    output: Literal["new_store", "in_place"]
    output_store: str | None = None
    model: str
    instructions: str
    include_history: bool = False
    requested_by: str
    scheduled: bool = False
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    input_seq: int | None = None
    usage: ConsolidationUsage | None = None
    summary: str | None = None
    changes: list[ConsolidationChange] = []
    error: str | None = None


class Overwritten(BaseModel):
    """The version a write replaced by last writer wins (``Change.overwrote``): its number
    and the actor that wrote it. ``also``: every other writer whose changes the write
    dropped (a version made after the one the write was made on, [RecordUpdate]
    ``overwrite_base``), each with its newest such version (no ``also`` of its own)."""

    version: int
    actor: str
    also: list["Overwritten"] = []


class Change(BaseModel):
    """One entry of a store's change feed: the record's state after version ``seq``.
    ``old_path`` is set for moves; ``record.deleted`` is True for deletes. ``overwrote``:
    set when this version was written by last writer wins over a concurrent change
    ([RecordUpdate] ``overwrite``): the version it replaced, whose writer is told."""

    seq: int
    operation: Operation
    old_path: str | None = None
    record: Record
    overwrote: Overwritten | None = None


class ChangePage(BaseModel):
    changes: list[Change]
    seq: int  # resume with after=seq


class WorkspaceEvent(BaseModel):
    seq: int
    kind: Literal["attached", "detached", "store_changed"]
    store: str
    access: Access | None = None


class EventPage(BaseModel):
    events: list[WorkspaceEvent]
    seq: int


class MemoryToolCommand(BaseModel):
    """A memory-tool command: the model's ``tool_use.input`` as is (``command`` plus that
    command's parameters: ``path``, ``file_text``, ``view_range``, ``old_str``, ``new_str``,
    ``insert_line``, ``insert_text``, ``old_path``, ``new_path``; memfuse's ``search``,
    ``history`` and ``remember`` take ``query``, ``version``, ``fact``, ``store``)."""

    model_config = {"extra": "allow"}

    command: str


class MemoryToolResult(BaseModel):
    """The tool result to hand back to the model: ``content`` text and ``is_error``."""

    content: str
    is_error: bool = False


class Problem(BaseModel):
    """RFC 9457 problem details. ``code`` is memfuse's machine-readable reason."""

    type: str = "about:blank"
    title: str
    status: int
    detail: str = ""
    code: str = ""
