"""The client's side of the API v1 wire format (docs/API.md): msgspec Structs.

The server builds its bodies and its OpenAPI document from the pydantic models of
:mod:`memfuse.models`; the HTTP client (:mod:`memfuse.client`) and everything that only talks
to a server (the sidecar, the CLI, ``memfuse.transfer``, the MCP server) decodes and encodes
with these Structs instead: same class and field names, same types, optionality and defaults
(``tests/test_wire.py`` checks each pair against the server's JSON), but no pydantic import and
no schema building (a sidecar's baseline memory is ~9 MiB smaller), and decoding a snapshot
page is several times faster.

Shapes: a Struct is a plain class with attribute access, ``==`` by fields, mutable, not
hashable. Times decode as timezone-aware ``datetime`` (UTC); ``Access`` / ``Operation`` as
the enums of :mod:`memfuse.defs`. Unknown members of a body are ignored (a newer server may
send more). msgspec equivalents of pydantic calls: ``msgspec.structs.replace(r, mode=...)``
for ``model_copy(update=...)``, :func:`to_jsonable` for ``model_dump(mode="json")``,
:func:`encode` for ``model_dump_json``, :func:`decode` for ``model_validate_json``.

Request bodies: members of the ``UNSET`` kind are left out of the JSON when not given
(pydantic's ``exclude_unset``); :func:`build` checks a body's constraints (patterns, ranges)
as the server will, raising ``msgspec.ValidationError`` (a ``ValueError``) before anything is
sent.
"""
from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from .defs import (  # noqa: F401  (re-exported: the client side imports them from here)
    BATCH_MAX_BYTES as BATCH_MAX_BYTES,
    BATCH_MAX_OPERATIONS as BATCH_MAX_OPERATIONS,
    DEFAULT_MODE as DEFAULT_MODE,
    INSTRUCTIONS_MAX_CHARS as INSTRUCTIONS_MAX_CHARS,
    MAX_TOKEN_TTL_SECONDS as MAX_TOKEN_TTL_SECONDS,
    MODE_MASK as MODE_MASK,
    INT64_MAX as INT64_MAX,
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

__all__ = [
    "UNSET",
    "Workspace", "WorkspaceCreate", "Store", "StoreCreate", "StoreUpdate", "Attachment",
    "AttachmentPut", "AccountCreate", "AccountUpdate", "AccountAttachment", "Account", "TokenCreate", "TokenCreated", "TokenInfo", "RecordCreate",
    "RecordUpdate", "RecordAppend",
    "RecordAttributes", "RecordMove", "PrefixMove", "Restore", "Record", "Version",
    "RecordPage", "MoveResult", "SearchLine", "SearchHit", "SearchPage", "BatchOperation", "BatchRequest", "BatchResult", "BatchResponse",
    "BATCH_MAX_OPERATIONS", "BATCH_MAX_BYTES", "Change", "Overwritten", "ChangePage", "WorkspaceEvent", "EventPage",
    "MemoryToolResult", "Problem", "decode", "encode", "build", "convert", "to_jsonable",
]

S = TypeVar("S")

Slug = Annotated[str, Meta(pattern=SLUG_PATTERN)]
Positive = Annotated[int, Meta(gt=0, le=INT64_MAX)]
NonNegative = Annotated[int, Meta(ge=0, le=INT64_MAX)]
Mode = Annotated[int, Meta(ge=0, le=MODE_MASK)]
MtimeNs = Annotated[int, Meta(ge=MTIME_NS_MIN, le=MTIME_NS_MAX)]
RecordType = Literal["user", "feedback", "project", "reference"]


# ---------------------------------------------------------------- admin resources


class WorkspaceCreate(Struct, kw_only=True):
    name: Slug
    default_store: bool = True
    account: Slug | None = None


class Workspace(Struct, kw_only=True):
    name: str
    created_at: datetime
    account: str = "default"


class AccountCreate(Struct, kw_only=True):
    slug: Slug
    max_stores: NonNegative | None = None
    max_bytes: NonNegative | None = None
    max_tokens: NonNegative | None = None


class AccountUpdate(Struct, kw_only=True):
    """``PATCH /v1/accounts/{account}`` body: a quota left UNSET is kept (left out of the
    JSON); ``None`` makes it unlimited."""

    max_stores: NonNegative | None | UnsetType = UNSET
    max_bytes: NonNegative | None | UnsetType = UNSET
    max_tokens: NonNegative | None | UnsetType = UNSET


class AccountAttachment(Struct, kw_only=True):
    store: str
    access: Access
    created_at: datetime


class Account(Struct, kw_only=True):
    slug: str
    created_at: datetime
    max_stores: int | None = None
    max_bytes: int | None = None
    max_tokens: int | None = None
    stores: int = 0
    bytes: int = 0
    tokens: int = 0
    attachments: list[AccountAttachment] = msgspec.field(default_factory=list)


class StoreCreate(Struct, kw_only=True):
    slug: Slug
    description: str = ""
    default_type: RecordType = "project"
    max_record_bytes: Positive = 1 << 20
    max_store_bytes: Positive = 64 << 20
    max_records: Positive = 10_000
    max_history_bytes: Positive | None = None
    max_history_versions: Positive | None = None
    history_min_age_s: NonNegative | None = None
    account: Slug | None = None


class StoreUpdate(Struct, kw_only=True, omit_defaults=True):
    """Only the members given (not None) are sent: the server leaves the others as they are."""

    description: str | None = None
    default_type: RecordType | None = None
    max_record_bytes: Positive | None = None
    max_store_bytes: Positive | None = None
    max_records: Positive | None = None
    max_history_bytes: Positive | None = None
    max_history_versions: Positive | None = None
    history_min_age_s: NonNegative | None = None


class Store(Struct, kw_only=True):
    slug: str
    description: str
    default_type: str
    max_record_bytes: int
    max_store_bytes: int
    max_records: int
    created_at: datetime
    usage_bytes: int = 0
    record_count: int = 0
    max_history_bytes: int = 0
    max_history_versions: int = 0
    history_min_age_s: int = 0
    history_bytes: int = 0
    history_versions: int = 0
    account: str = "default"


class AttachmentPut(Struct, kw_only=True):
    access: Access = Access.read_write
    instructions: Annotated[str, Meta(max_length=INSTRUCTIONS_MAX_CHARS)] = ""


class Attachment(Struct, kw_only=True):
    """One store attached to one workspace, with the store's description and limits."""

    workspace: str
    store: Store
    access: Access
    instructions: str
    created_at: datetime


class TokenCreate(Struct, kw_only=True):
    """A token for one workspace, or an admin token when ``workspace`` is None;
    ``ttl_seconds``: it expires that long after creation (never when None)."""

    workspace: str | None = None
    name: Annotated[str, Meta(max_length=200)] = ""
    ttl_seconds: Annotated[int, Meta(ge=1, le=MAX_TOKEN_TTL_SECONDS)] | None = None
    account: Slug | None = None


class TokenCreated(Struct, kw_only=True):
    id: str
    workspace: str | None
    name: str
    token: str  # shown once; the server keeps only its sha256
    expires_at: datetime | None = None
    account: str | None = None


class TokenInfo(Struct, kw_only=True):
    """A token as listed: never its secret; ``state`` ``active``, ``expired`` or ``revoked``."""

    id: str
    workspace: str | None
    name: str
    created_at: datetime
    last_used_at: datetime | None = None
    expires_at: datetime | None = None
    revoked_at: datetime | None = None
    state: Literal["active", "expired", "revoked"] = "active"
    account: str | None = None


# ---------------------------------------------------------------- records


class RecordCreate(Struct, kw_only=True):
    """A new record; ``mode`` / ``mtime_ns`` are sent only when given."""

    path: str
    content: str
    type: str | None = None
    mode: Mode | None | UnsetType = UNSET
    mtime_ns: MtimeNs | None | UnsetType = UNSET


class RecordUpdate(Struct, kw_only=True):
    """New content (and type, attributes) of a record; ``mode`` / ``mtime_ns`` sent only when
    given."""

    content: str
    type: str | None = None
    mode: Mode | None | UnsetType = UNSET
    mtime_ns: MtimeNs | None | UnsetType = UNSET
    overwrite: bool | None | UnsetType = UNSET  # sent only by last writer wins (``ApiClient.update_record``)
    overwrite_base: str | None | UnsetType = UNSET  # with ``overwrite``: the version it was made on


class RecordAppend(Struct, kw_only=True):
    """``POST .../append``: the suffix to add at the end of the record's content, ``If-Match``
    the version it extends; ``mode`` / ``mtime_ns`` sent only when given."""

    append: str
    type: str | None = None
    mode: Mode | None | UnsetType = UNSET
    mtime_ns: MtimeNs | None | UnsetType = UNSET


class RecordAttributes(Struct, kw_only=True):
    """``PATCH`` body: a member left UNSET is kept; ``None`` resets it (docs/API.md)."""

    mode: Mode | None | UnsetType = UNSET
    mtime_ns: MtimeNs | None | UnsetType = UNSET


class RecordMove(Struct, kw_only=True):
    path: str
    replace: bool = False


class PrefixMove(Struct, kw_only=True):
    from_prefix: str
    to_prefix: str


class Restore(Struct, kw_only=True):
    version: Annotated[int, Meta(ge=1, le=INT64_MAX)]


class Record(Struct, kw_only=True, gc=False):
    """The current state of a record. ``content`` is None where the call did not ask for it.
    (``gc=False``: holds no containers, so never in a reference cycle; 16 bytes less each.)"""

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


class Version(Struct, kw_only=True, gc=False):
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
    pruned: bool = False
    seq: int
    content: str | None = None
    mode: int = DEFAULT_MODE  # the record's attributes as of this version
    mtime_ns: int | None = None


class RecordPage(Struct, kw_only=True):
    """One page of a store snapshot; ``next_cursor`` None on the last page; ``seq``: the
    change-feed position the snapshot is consistent with."""

    records: list[Record]
    next_cursor: str | None = None
    seq: int


class MoveResult(Struct, kw_only=True):
    records: list[Record]


class SearchLine(Struct, kw_only=True):
    """A matching line: ``line`` its number (1-based), ``text`` the line (cut at 300
    characters, then `` …``). Untrusted content."""

    line: int
    text: str


class SearchHit(Struct, kw_only=True):
    """A record matching a search (without content), whether its path matched, its first
    matching lines and how many lines match in all; a ranked search's ``score`` and
    ``snippet`` (None otherwise)."""

    record: Record
    path_match: bool = False
    lines: list[SearchLine] = msgspec.field(default_factory=list)
    line_matches: int = 0
    score: float | None = None
    snippet: str | None = None


class SearchPage(Struct, kw_only=True):
    """One page of search hits by path; ``next_cursor`` None on the last page; ``seq``: the
    store's change-feed position read before the page."""

    hits: list[SearchHit]
    next_cursor: str | None = None
    seq: int


class IndexEntry(Struct, kw_only=True):
    """A link of ``MEMORY.md``: its line number, the line (untrusted, cut at 300
    characters) and the path it links."""

    line: int
    text: str
    target: str


class StaleRecord(Struct, kw_only=True):
    """A stale live record: path, last change, frontmatter review and expiry times."""

    path: str
    updated_at: datetime
    review_after: datetime | None = None
    expires_at: datetime | None = None


class IndexReport(Struct, kw_only=True):
    """A store's index report: links to nothing (``missing``, first 1,000;
    ``missing_count``), records not mentioned (``unindexed``, first 1,000;
    ``unindexed_count``), entries the prompt block cuts (``omitted``, first 1,000;
    ``omitted_count``), the UTF-8 bytes of ``MEMORY.md`` read for them (``bytes_scanned``),
    the sizes of ``MEMORY.md`` in all and shown, and the store's stale records (first 100;
    ``stale_count``)."""

    store: str
    index_exists: bool
    entries: int = 0
    missing: list[IndexEntry] = msgspec.field(default_factory=list)
    missing_count: int = 0
    unindexed: list[str] = msgspec.field(default_factory=list)
    unindexed_count: int = 0
    omitted: list[IndexEntry] = msgspec.field(default_factory=list)
    omitted_count: int = 0
    bytes_scanned: int = 0
    lines: int = 0
    lines_shown: int = 0
    bytes: int = 0
    bytes_shown: int = 0
    stale: list[StaleRecord] = msgspec.field(default_factory=list)
    stale_count: int = 0
    stale_after_days: int = 0


class BatchOperation(Struct, kw_only=True, omit_defaults=True):
    """One write of a batch, as its single endpoint takes it (docs/API.md, batch): ``op``
    ``create`` / ``update`` / ``append`` / ``attrs`` / ``move`` / ``delete``; ``body`` that endpoint's
    JSON body (none for ``delete``); ``if_match`` / ``idempotency_key`` what it takes as
    ``If-Match`` / ``Idempotency-Key``. Members left None are not sent."""

    op: Literal["create", "update", "append", "attrs", "move", "delete"]
    record_id: str | None = None
    if_match: str | None = None
    idempotency_key: Annotated[str, Meta(min_length=1, max_length=255)] | None = None
    body: dict[str, Any] | None = None


class BatchRequest(Struct, kw_only=True):
    operations: list[BatchOperation]


class BatchResult(Struct, kw_only=True):
    """The answer one operation of a batch would have had alone: ``status``, ``body`` (a
    Record / MoveResult as a dict, a Problem for a refusal, None for 204), ``etag``,
    ``replayed``, ``seq`` (a 204's ``Memfuse-Seq``: the seq of the version it made; None
    from a control plane that does not tell it)."""

    status: int
    body: dict[str, Any] | None = None
    etag: str | None = None
    replayed: bool = False
    seq: int | None = None


class BatchResponse(Struct, kw_only=True):
    results: list[BatchResult]


CONSOLIDATION_INSTRUCTIONS_MAX_CHARS = 20_000


class ConsolidationCreate(Struct, kw_only=True):
    """``POST /v1/stores/{store}/consolidations`` (see memfuse.models.ConsolidationCreate)."""

    instructions: Annotated[str, Meta(min_length=1, max_length=CONSOLIDATION_INSTRUCTIONS_MAX_CHARS)]
    output: Literal["new_store", "in_place"] = "new_store"
    model: Annotated[str, Meta(min_length=1, max_length=200)] | None = None
    include_history: bool = False


class ConsolidationUsage(Struct, kw_only=True):
    input_tokens: int = 0
    output_tokens: int = 0


class ConsolidationChange(Struct, kw_only=True):
    op: Literal["write", "delete"]
    path: str


class ConsolidationJob(Struct, kw_only=True):
    """A consolidation job (see memfuse.models.ConsolidationJob)."""

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
    changes: list[ConsolidationChange] = msgspec.field(default_factory=list)
    error: str | None = None


class Overwritten(Struct, kw_only=True):
    """The version a write replaced by last writer wins (``Change.overwrote``); ``also``: the
    other writers whose changes it dropped, each with its newest such version."""

    version: int
    actor: str
    also: list[Overwritten] = msgspec.field(default_factory=list)


class Change(Struct, kw_only=True, gc=False):
    """One entry of a store's change feed: the record's state after version ``seq``;
    ``overwrote``: the version it replaced by last writer wins, when it was written so."""

    seq: int
    operation: Operation
    old_path: str | None = None
    record: Record
    overwrote: Overwritten | None = None


class ChangePage(Struct, kw_only=True):
    changes: list[Change]
    seq: int  # resume with after=seq


class WorkspaceEvent(Struct, kw_only=True, gc=False):
    seq: int
    kind: Literal["attached", "detached", "store_changed"]
    store: str
    access: Access | None = None


class EventPage(Struct, kw_only=True):
    events: list[WorkspaceEvent]
    seq: int


class MemoryToolResult(Struct, kw_only=True):
    """The tool result to hand back to the model: ``content`` text and ``is_error``."""

    content: str
    is_error: bool = False


class Problem(Struct, kw_only=True):
    """RFC 9457 problem details. ``code`` is memfuse's machine-readable reason."""

    type: str = "about:blank"
    title: str
    status: int
    detail: str = ""
    code: str = ""


# ---------------------------------------------------------------- encoding and decoding

_encoder = msgspec.json.Encoder()
_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


def decode(data: bytes | str, cls: type[S] | Any) -> S:
    """Decode JSON ``data`` as ``cls`` (a Struct, or e.g. ``list[Record]``). Raises
    ``msgspec.DecodeError`` (a ``ValueError``; ``msgspec.ValidationError`` when the JSON
    does not have the shape of ``cls``)."""
    dec = _decoders.get(cls)
    if dec is None:
        dec = _decoders[cls] = msgspec.json.Decoder(cls)
    out: S = dec.decode(data)  # the decoder is keyed by cls, so it yields a cls
    return out


def encode(obj: Any, *, exclude_none: bool = False) -> bytes:
    """Compact JSON (UTF-8) of a Struct (or builtins), members in declaration order, UNSET
    ones left out; with ``exclude_none`` members that are None are left out too (at the top
    level, as pydantic's ``exclude_none`` for these flat bodies)."""
    if exclude_none:
        obj = {k: v for k, v in msgspec.structs.asdict(obj).items() if v is not None and v is not UNSET}
    return _encoder.encode(obj)


def to_jsonable(obj: Any) -> Any:
    """``obj`` (Structs, lists of them) as JSON-able builtins: dicts, lists, str, int, ...
    (times as RFC 3339 strings, enums as values), like pydantic's ``model_dump(mode="json")``."""
    return msgspec.to_builtins(obj)


def convert(obj: Any, cls: type[S] | Any) -> S:
    """Builtins already parsed from JSON (a dict, say one answer's ``body`` of a batch) as
    ``cls``; times from RFC 3339 strings. Raises ``msgspec.ValidationError`` (a ``ValueError``)."""
    return msgspec.convert(obj, cls)


def build(cls: type[S], /, **fields: Any) -> S:
    """A request body of ``type`` from ``fields``, checked against its constraints (slug
    pattern, positive limits, mode and mtime ranges, strict types: ``True`` is no mode).
    Raises ``msgspec.ValidationError`` (a ``ValueError``) naming the member."""
    return msgspec.convert(fields, cls)
