"""What every resource of the control plane shares: refusals, callers, the parts it is built from.

This room holds ``ServiceError`` (a refusal with its HTTP status and problem code),
``Principal`` (who calls), ``IdempotencyRequest`` / ``Reply`` (the identity of a write and
its stored response), the ``If-Match`` parser, and the parts every resource service is built
from (``Parts``):

- ``Settings``: the settings its owner may change while serving (one object, shared);
- ``AccessRules``: who may address which workspace and store (admin, account, attachment):
  the isolation rules, in one place;
- ``Writer``: the one write transaction (idempotency check and store, retry on a concurrent
  conflict, commit notes: sent to other replicas inside the transaction, and waking this
  process's long-polls after the commit; see ``memfuse.server.wakeups``);
- ``Resource``: the base of every resource service, holding the parts as declared attributes.

It holds no resource's rules: those are in ``accounts``, ``tokens``, ``stores``, ``records``,
``changes``, ... , composed into ``Service`` by ``memfuse.server.service``.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, Unpack, cast

import msgspec
from pydantic import BaseModel
from sqlalchemy import Table, and_, bindparam, delete, func, insert, select
from sqlalchemy.engine import Connection, Row
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from memfuse import content as content_rules
from memfuse import names
from memfuse.defs import ACTOR_HEADER, RECORD_BODY_MAX, SEQ_HEADER
from memfuse.models import Access
from memfuse.server import history, keys, wakeups
from memfuse.server.rawsql import Raw, RawRow
from memfuse.server.scanbudget import ScanBudget
from memfuse.server.writertime import WriterTime
from memfuse.server.db import (
    AccountRow,
    AttachmentRow,
    DEFAULT_ACCOUNT,
    Database,
    IdempotencyRow,
    RecordRow,
    StoreRow,
    TokenRow,
    VersionRow,
    WorkspaceRow,
    info_of,
    utcnow,
)

if TYPE_CHECKING:
    from memfuse.server.wakeups import Bus, Notifier

log = logging.getLogger("memfuse.server.service")  # every room of the Service logs under one name

# The tables, for SQLAlchemy Core statements (the record paths skip the ORM unit of work).
_R = cast(Table, RecordRow.__table__)
_V = cast(Table, VersionRow.__table__)
_S = cast(Table, StoreRow.__table__)
_A = cast(Table, AttachmentRow.__table__)
_I = cast(Table, IdempotencyRow.__table__)
_T = cast(Table, TokenRow.__table__)

#: What every read of the live records at a list of paths (``path IN (...)``: a create's path
#: and its ancestors, a batch's creates, a move's target's ancestors) is ordered by. Without
#: it SQLite's planner (no statistics) took ``ix_records_usage`` (``store = ? AND deleted =
#: ?``, two equalities; dropped by revision ``0022_drop_records_usage``) for three or more
#: paths and read every live record of the store:
#: a create of ``a/b/c.md`` cost ~0.5 ms more per 1,500 records in its store (bench/README.md,
#: "The close path, session 12: serve's writer"). Ordered by path, it looks each path up on a
#: path index (``ix_records_live_path`` / ``ix_records_store_path``: no sort needed);
#: ``tests/test_rawsql.py`` checks the plans. PostgreSQL: a sort of the few rows found.
LIVE_PATHS_ORDER = _R.c.path

IDEMPOTENCY_TTL = timedelta(hours=24)

AnyRow = Row[Unpack[tuple[Any, ...]]] | RawRow
"""A Core result row of any columns (SQLAlchemy's ``Row`` is generic over its column types),
or the same row read on the DB-API cursor (``memfuse.server.rawsql``)."""

# Reason phrases of problem titles (RFC 9110 §15).
REASONS = {
    400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
    405: "Method Not Allowed", 409: "Conflict", 410: "Gone", 412: "Precondition Failed",
    413: "Content Too Large", 415: "Unsupported Media Type", 422: "Unprocessable Content",
    429: "Too Many Requests", 500: "Internal Server Error", 503: "Service Unavailable",
    507: "Insufficient Storage",
}


# ---------------------------------------------------------------- errors and principals


class ServiceError(Exception):
    """A refusal with its HTTP ``status`` and problem ``code`` (docs/API.md error table).

    ``extra`` holds additional problem members (``record_id``, ``sha256``); ``headers`` extra
    response headers (``WWW-Authenticate``, ``Retry-After``).
    """

    def __init__(
        self,
        status: int,
        code: str,
        detail: str = "",
        *,
        headers: dict[str, str] | None = None,
        **extra: object,
    ) -> None:
        super().__init__(f"{status} {code}: {detail}")
        self.status = status
        self.code = code
        self.detail = detail
        self.headers = headers or {}
        self.extra = extra


def _unauthorized(detail: str) -> ServiceError:
    return ServiceError(401, "unauthorized", detail, headers={"WWW-Authenticate": "Bearer"})


def _name_error(err: names.NameError_, what: str = "path") -> ServiceError:
    if err.too_long:
        return ServiceError(422, "path_too_long", f"{what}: {err.reason}")
    return ServiceError(422, "invalid_path", f"{what}: {err.reason}")


def _check_path(path: str, what: str = "path") -> str:
    try:
        return names.check_path(path)
    except names.NameError_ as err:
        raise _name_error(err, what) from None


def _check_new_path(path: str, what: str = "path", *, directory: bool = False) -> str:
    """``_check_path`` for a path a write gives a record (create, move, the target of a
    prefix move): also ``names.check_new_path`` (NFC names, no directory named like the
    index at the root), plus the secret rules of content applied to the name
    (``content.find_secret_in_path``): a path holding a credential would show in listings,
    history, the console and logs. 422 ``secret_detected`` (the code content secrets use;
    the detail names the kind and a redacted form, never the secret). ``directory``: the path
    is a directory's (a prefix move's target): ``names.check_new_dir_path`` instead."""
    try:
        path = (names.check_new_dir_path if directory else names.check_new_path)(path)
    except names.NameError_ as err:
        raise _name_error(err, what) from None
    found = content_rules.find_secret_in_path(path)
    if found is not None:
        raise ServiceError(422, "secret_detected", f"{what}: {found.reason}")
    return path


def fold(text: str) -> str:
    """``text`` as case-insensitive matching compares it: Unicode lowercase (``str.lower``:
    ``ÄPFEL`` → ``äpfel``, ``ÉTÉ`` → ``été``; no case folding, so ``ß`` and ``ss`` differ).
    The one rule of the search API and the console's filters, on every database."""
    return text.lower()


def holds(text: str, q: str, case_sensitive: bool = False) -> bool:
    """Whether ``text`` holds ``q`` literally; case-insensitively by ``fold`` of both sides."""
    return q in text if case_sensitive else fold(q) in fold(text)


def like_superset(needle: str) -> str:
    """A ``LIKE`` / ``ILIKE`` pattern body (escape ``\\``, no leading or trailing ``%``)
    matching every text whose ``fold`` holds ``needle`` (itself folded), on SQLite (``LIKE``
    folds ASCII only) and on PostgreSQL in any locale. Per character of ``needle``:

    - ASCII other than ``i`` / ``k``: itself (``LIKE`` / ``ILIKE`` match its ASCII case);
    - ``i``, ``k``: ``_`` (any one character): U+0130 (İ, lowercase ``i`` + U+0307) and
      U+212A (KELVIN SIGN) fold to them;
    - U+0307 (the combining dot of İ's lowercase): ``%``, since İ gave the ``i`` before it;
    - any other character with an uppercase (``ä``): ``_``, its uppercase and itself each
      being one character;
    - the rest (caseless: ``東``): itself, the only character folding to it.

    So the database narrows the rows without ever losing one; ``tests/test_search_api.py``
    checks this over every code point."""
    out = []
    for ch in needle:
        if ch in "ik":
            out.append("_")
        elif ch.isascii():
            out.append(ch.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_"))
        elif ch == "\u0307":
            out.append("%")
        elif ch.upper() != ch:
            out.append("_")
        else:
            out.append(ch)
    return "".join(out)


@dataclass(frozen=True)
class Principal:
    """Who calls: a workspace token (``workspace`` set) or an admin token (None).

    ``account``: the account the caller acts in (docs/API.md, "Accounts"). For an admin:
    None for the root admin (sees every account), else the account it administers (an
    account admin token, or the root admin that named an account with ``X-Memfuse-Account``
    / ``?account=``): it sees and changes that account's objects only, anything else is 404.
    For a database workspace token: its workspace's account (informational: a workspace
    token reaches only the stores attached to its workspace, always of the same account).
    ``root_token``: the token is a root admin token (also while it acts in one account).

    ``name`` is the token's name (``"static"`` for tokens given to ``create_app``);
    ``instance`` the sidecar id from ``X-Memfuse-Instance``; ``token_id`` the database
    token's id (None for a static token) and ``expires_at`` its expiry (wall-clock epoch
    seconds, None when it does not expire): what ends the caller's long-lived responses
    (``memfuse.server.streamclass``). Neither takes part in equality. ``store_created``:
    this request's ``Memfuse-Store-Created`` (the creation time of the store its write was
    made for, RFC 3339; ``with_store_created``), checked by every write's store lookup
    (``AccessRules.store``); ``writer`` its ``Memfuse-Writer`` (the sidecar instance that
    sends it, kept on the versions it writes: ``versions.writer``, what that sidecar's
    change feed leaves out); neither is part of equality.
    """

    workspace: str | None
    name: str = "static"
    instance: str | None = None
    account: str | None = None
    root_token: bool = field(default=False, compare=False)
    token_id: str | None = field(default=None, compare=False)
    expires_at: float | None = field(default=None, compare=False)
    store_created: str | None = field(default=None, compare=False)
    writer: str | None = field(default=None, compare=False)

    @property
    def is_admin(self) -> bool:
        return self.workspace is None

    @property
    def is_root(self) -> bool:
        """The root admin acting on every account (an admin token without an account)."""
        return self.workspace is None and self.account is None

    @property
    def admin_account(self) -> str | None:
        """For an admin: the one account it may see (None: all, the root admin). For a
        workspace token: None (its reach is its workspace's attachments)."""
        return self.account if self.workspace is None else None

    @property
    def workspace_name(self) -> str | None:
        """The public name of the token's workspace (``workspace`` is its key,
        ``memfuse.server.keys``); None for an admin."""
        return None if self.workspace is None else keys.public(self.workspace)

    @property
    def actor(self) -> str:
        """``ws:<workspace name>/<instance or "api">`` or ``admin:<token name or "static">``:
        what a version records. The workspace's public name, never its key: a store's writers
        are all of the store's account (an attachment never crosses accounts), so within a
        store the name is unambiguous, versions hold no key to hide, and a sidecar knows its
        own actor from the name it was given (docs/ARCHITECTURE.md "Accounts")."""
        if self.workspace is None:
            return f"admin:{self.name or 'static'}"
        return f"ws:{keys.public(self.workspace)}/{self.instance or 'api'}"

    @property
    def feed_key(self) -> str:
        """What the change feed tells this caller's versions by (``skip_actor`` /
        ``skip_writer``, the notifier's notes): its writer id when it sent one, else its
        actor. The two never look alike (a writer id has no ``:``)."""
        return self.writer or self.actor

    @property
    def scope(self) -> str:
        """Idempotency-key scope: the token's workspace (its key), ``admin`` for the root
        admin, ``acct:<account>`` for an admin acting in one account."""
        if self.workspace is not None:
            return f"ws:{self.workspace}"
        return "admin" if self.account is None else f"acct:{self.account}"


@dataclass(frozen=True)
class IdempotencyRequest:
    """The identity of a write sent with ``Idempotency-Key``: key, method, URL path and the
    sha256 of the body (``request_sha256``: of its canonical JSON, so the same operation
    sent alone or inside a batch is the same request). ``alt_sha256``: the sha256 of the raw
    bytes, which releases before the batch endpoint stored; a stored row with either matches.
    ``raw``: those bytes, hashed only when a stored row is compared (``alternative``), not
    for every write on the event loop (bench/README.md, "The close path, session 17")."""

    key: str
    method: str
    url_path: str
    body_sha256: str
    alt_sha256: str | None = None
    raw: bytes | None = field(default=None, repr=False, compare=False)

    def alternative(self) -> str | None:
        """``alt_sha256``, else the sha256 of ``raw`` (None without either)."""
        if self.alt_sha256 is not None or self.raw is None:
            return self.alt_sha256
        return body_sha256(self.raw)


def seq_header(headers: dict[str, str], seq: int | None) -> None:
    """Set ``SEQ_HEADER`` (``Memfuse-Seq``: docs/API.md) in a write's reply ``headers`` to
    ``seq``, the change-feed seq of the version a write answered without a body made (a
    delete's 204); nothing when None (no version made)."""
    if seq is not None:
        headers[SEQ_HEADER] = str(seq)


@dataclass
class Reply:
    """The response to a write: ``status``, JSON ``body`` (empty for 204), ``headers``;
    ``replayed`` when it is the stored response of an earlier request with the same key."""

    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    replayed: bool = False


# ---------------------------------------------------------------- helpers


def parse_if_match(header: str | None) -> list[str] | None:
    """Parse an ``If-Match`` value (RFC 9110 §13.1.1).

    Returns None when absent or empty (no precondition), ``["*"]`` for ``*``, else the list
    of strong entity-tag values without quotes. Weak tags (``W/"..."``) are dropped because
    ``If-Match`` uses strong comparison; an unquoted token is accepted as a tag (lenient).
    """
    if header is None or not header.strip():
        return None
    header = header.strip()
    if header == "*":
        return ["*"]
    tags: list[str] = []
    for part in header.split(","):
        part = part.strip()
        if not part or part.startswith("W/"):
            continue
        if len(part) >= 2 and part[0] == part[-1] == '"':
            part = part[1:-1]
        tags.append(part)
    return tags


def body_sha256(body: bytes) -> str:
    """sha256 hex of a raw request body."""
    return hashlib.sha256(body).hexdigest()


#: ``json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)``'s encoder,
#: made once (``json.dumps`` builds one per call for arguments other than its defaults)
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)
#: the same text as UTF-8 for a value of ``_msgspec_exact`` types (msgspec escapes strings as
#: ``json`` does with ``ensure_ascii=False``, sorts keys by code point, writes any ``int``; it
#: writes floats otherwise, and refuses lone surrogates: those values take ``_CANONICAL``)
_CANONICAL_FAST = msgspec.json.Encoder(order="sorted")


def _msgspec_exact(value: object) -> bool:
    """Whether ``value`` holds only ``dict`` (with ``str`` keys), ``list``, ``str``, ``int``,
    ``bool`` and None, as exactly those types: what ``_CANONICAL_FAST`` writes as
    ``_CANONICAL`` does (no float, no subclass). Raises ``RecursionError`` when too deep."""
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:
        return True
    if kind is dict:
        for k, v in value.items():  # type: ignore[attr-defined]
            if type(k) is not str or not (type(v) is str or _msgspec_exact(v)):
                return False
        return True
    if kind is list:
        for v in value:  # type: ignore[attr-defined]
            if not (type(v) is str or _msgspec_exact(v)):
                return False
        return True
    return False


_DECODE = msgspec.json.Decoder().decode


def parse_json_exact(raw: bytes) -> tuple[Any, bool]:
    """``parse_json(raw)``'s value, and whether it holds only what ``_msgspec_exact`` allows
    (checked there: ``canonical_sha256(value, exact=True)`` does not walk it again). Raises
    what ``parse_json`` raises."""
    try:
        value = _DECODE(raw)
        if _msgspec_exact(value):
            return value, True
    except Exception:  # noqa: BLE001 - refused or too deep for msgspec: json's answer
        pass
    return json.loads(raw), False


def parse_json(raw: bytes) -> Any:
    """``json.loads(raw)``: its value, or what it raises (``ValueError``, ``RecursionError``).
    What FastAPI (starlette's ``Request.json``) makes of a JSON body, read ~5x faster: msgspec
    decodes it, and its value is taken when it holds only what ``_msgspec_exact`` allows (no
    float: msgspec and ``json`` could differ in the last bit), else ``json.loads`` reads it
    (a float, and everything msgspec refuses and ``json`` takes: ``NaN``, ``1e400``, a
    byte-order mark, UTF-16, lone surrogates). Each value msgspec takes, ``json`` reads the
    same (duplicate keys: the last; integers of any size; tests/test_writepath.py)."""
    return parse_json_exact(raw)[0]


def canonical_sha256(value: object, exact: bool = False) -> str:
    """sha256 hex of ``value`` (a parsed JSON body) as canonical JSON: keys sorted, no
    whitespace, UTF-8 (lone surrogates kept). The idempotency request hash of a write: equal
    for the same body however it was spaced or ordered, alone or inside a batch. The text is
    ``_CANONICAL``'s; for a value without floats (``_msgspec_exact``) msgspec writes the same
    bytes ~5x faster (tests/test_idempotency.py compares them on random values). ``exact``:
    the caller knows ``_msgspec_exact(value)`` holds (``parse_json_exact``)."""
    try:
        if exact or _msgspec_exact(value):
            return hashlib.sha256(_CANONICAL_FAST.encode(value)).hexdigest()
    except (UnicodeEncodeError, RecursionError):
        pass  # a lone surrogate (kept below), a value too deep for the walk: json's answer
    text = _CANONICAL.encode(value)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


_UNPARSED = object()


def idempotency_request(key: str, method: str, url_path: str, raw: bytes,
                        parsed: object = _UNPARSED, exact: bool = False) -> IdempotencyRequest:
    """The ``IdempotencyRequest`` of a single write whose raw body is ``raw`` (empty for a
    body-less DELETE): canonical hash of the parsed body, raw hash as the alternative (of
    ``raw``, hashed when a stored row is compared: ``IdempotencyRequest.alternative``).
    ``parsed``: ``json.loads(raw)`` when the caller has it already (not parsed again);
    ``exact``: ``parse_json_exact`` said it holds only what msgspec writes as ``json`` does."""
    try:
        if parsed is not _UNPARSED:
            canon = canonical_sha256(parsed, exact)
        else:
            canon = canonical_sha256(json.loads(raw)) if raw.strip() else canonical_sha256(None)
    except ValueError:
        raw_hash = body_sha256(raw)  # not JSON: the request is refused anyway; keep the raw identity
        return IdempotencyRequest(key, method, url_path, raw_hash, raw_hash)
    return IdempotencyRequest(key, method, url_path, canon, raw=raw)


# Statements of the hot paths, built once (parameters at execution). A request names a store
# by its public name; ``slug`` / ``alt`` are the two keys it can have (``keys.candidates``).
# A store read for writing also reads its account's byte quota (``account_max_bytes``, NULL:
# none, or no account row), which every write that grows the store checks
# (``recordrows._account_room``): one statement fewer per write.
_ACCOUNT_MAX_BYTES = (select(cast(Table, AccountRow.__table__).c.max_bytes)
                      .where(cast(Table, AccountRow.__table__).c.slug == _S.c.account)
                      .scalar_subquery().label("account_max_bytes"))


def _for_update(stmt: Any) -> Any:
    """``stmt`` (a select of the store row) for writing: with the account's byte quota, the
    store row locked on PostgreSQL."""
    return stmt.add_columns(_ACCOUNT_MAX_BYTES).with_for_update(of=_S)


_SELECT_STORE = select(_S).where(_S.c.slug.in_([bindparam("slug"), bindparam("alt")]))
_SELECT_STORE_FOR_UPDATE = _for_update(_SELECT_STORE)
# the root admin's last resort: the stores of any account holding a name (the key differs)
_SELECT_NAMED_STORE = select(_S).where(_S.c.public_slug == bindparam("slug")).limit(2)
_SELECT_NAMED_STORE_FOR_UPDATE = _for_update(_SELECT_NAMED_STORE)
# an account admin's: the store only if it is in its account
_SELECT_ACCOUNT_STORE = _SELECT_STORE.where(_S.c.account == bindparam("account"))
_SELECT_ACCOUNT_STORE_FOR_UPDATE = _for_update(_SELECT_ACCOUNT_STORE)
# a workspace token's: among the stores attached to its workspace (all of its account), the
# one whose name is asked (its key, or a key of that name taken by another account)
_SELECT_ATTACHED_STORE = (
    select(_S, _A.c.access)
    .join(_A, and_(_A.c.store == _S.c.slug, _A.c.workspace == bindparam("ws")))
    # by its public name only: a workspace token never names a store by its key or a
    # reference (``notes~bravo``), which would answer or not by which account took the name first
    .where(_S.c.public_slug == bindparam("slug"))
)
_SELECT_ATTACHED_STORE_FOR_UPDATE = _for_update(_SELECT_ATTACHED_STORE)
_INSERT_IDEM = insert(_I)
_SELECT_IDEM = select(
    _I.c.id, _I.c.method, _I.c.url_path, _I.c.request_hash, _I.c.status, _I.c.response_body,
    _I.c.response_headers, _I.c.created_at,
).where(_I.c.scope == bindparam("scope"), _I.c.key == bindparam("key"))
# the same, run on the DB-API cursor (every write's path: memfuse.server.rawsql)
_RAW_STORE = {False: Raw(_SELECT_STORE), True: Raw(_SELECT_STORE_FOR_UPDATE)}
_RAW_NAMED_STORE = {False: Raw(_SELECT_NAMED_STORE), True: Raw(_SELECT_NAMED_STORE_FOR_UPDATE)}
_RAW_ACCOUNT_STORE = {False: Raw(_SELECT_ACCOUNT_STORE), True: Raw(_SELECT_ACCOUNT_STORE_FOR_UPDATE)}
_RAW_ATTACHED_STORE = {False: Raw(_SELECT_ATTACHED_STORE), True: Raw(_SELECT_ATTACHED_STORE_FOR_UPDATE)}
_RAW_INSERT_IDEM = Raw(_INSERT_IDEM)
_RAW_SELECT_IDEM = Raw(_SELECT_IDEM)
#: a workspace token's store row for writing with, as ``idem_id``, the id of the row of the
#: write's idempotency key (``idem_scope``, ``idem_key``; NULL: none): the key's lookup of
#: ``Writer.write(store_first=True)`` without a statement of its own (bench/README.md, "The
#: close path, session 18: serve's writer statements")
#: The row has only the store's columns that a record write (``Writer.write(store_first=True)``:
#: ``records``' create, update, append, attributes, move, delete) and ``AccessRules.store``
#: read (``RECORD_WRITE_COLUMNS``), not all 20 (15 of them): the driver describes and converts every
#: column of every row (~1 k instructions a column; bench/README.md, "The close path, session
#: 20: serve's writer"). A record write that reads another column of ``st`` fails with
#: ``AttributeError`` in the tests of that write (``tests/test_rawsql.py`` reads every column
#: of the store row that ``records.py`` and ``recordrows.py`` name).
RECORD_WRITE_COLUMNS = ("slug", "account", "default_type", "max_record_bytes", "max_store_bytes", "max_records",
                        "usage_bytes", "record_count", "created_at", "archived_at",
                        # the history budget's (``history.settle_with_usage``)
                        "max_history_bytes", "max_history_versions", "history_min_age_s",
                        "version_bytes", "version_count")
_RAW_ATTACHED_STORE_PROBE = Raw(
    select(*(_S.c[name] for name in RECORD_WRITE_COLUMNS), _A.c.access)
    .join_from(_S, _A, and_(_A.c.store == _S.c.slug, _A.c.workspace == bindparam("ws")))
    .where(_S.c.public_slug == bindparam("slug"))
    .add_columns(_ACCOUNT_MAX_BYTES,
                 select(_I.c.id).where(_I.c.scope == bindparam("idem_scope"), _I.c.key == bindparam("idem_key"))
                 .scalar_subquery().label("idem_id"))
    .with_for_update(of=_S))
#: ``Connection.info`` key of the idempotency key (scope, key) that ``AccessRules.store``
#: looks up beside the store row of a write (``Writer.write``, ``store_first``)
IDEM_PROBE = "memfuse_idem_probe"


class IdemFound(Exception):
    """The store row read for a write (``AccessRules.store``) came with a row of the write's
    idempotency key: ``Writer.write`` runs the write again with the key's full lookup first
    (a replay, a key reused, an expired row)."""


# ---------------------------------------------------------------- the parts every resource is built from


@dataclass
class Settings:
    """The settings of one control plane that its resources read and its owner may change
    while it serves (one object shared by every resource, so a change is seen by all).

    ``context_max_bytes``: default bound of the prompt block (bytes); ``mount_root``: the
    default mount root of the prompt block's paths; ``stale_after_days``: age of a stale record
    (days, 0 = off; ``memfuse.server.staleness``); ``expiry_interval``: seconds between the
    expiry sweeps of ``memfuse serve`` (0 = none); ``closing``: set at server shutdown (the
    long-polls answer at once); ``max_body``: the front door's body bound of a record write
    (bytes, ``memfuse serve --max-body``), which bounds a store's ``max_record_bytes``
    (``memfuse.defs.largest_record``)."""

    context_max_bytes: int
    mount_root: str
    stale_after_days: int
    expiry_interval: float = 0.0
    closing: bool = False
    max_body: int = RECORD_BODY_MAX


class AccessRules:
    """Who may address which workspace and store: the one place of the isolation rules
    (docs/API.md, "Accounts" and "Tokens"). Every resource resolves workspaces and stores
    through these methods; none reads a store or workspace row for a caller otherwise."""

    @staticmethod
    def require_admin(p: Principal) -> None:
        """403 ``forbidden`` unless ``p`` is an admin (root or account admin)."""
        if not p.is_admin:
            raise ServiceError(403, "forbidden", "this needs an admin token")

    @staticmethod
    def workspace(s: Session, p: Principal, ws: str) -> WorkspaceRow:
        """The workspace row that ``ws`` (a public name, or a key: docs/ARCHITECTURE.md
        "Accounts") names for ``p``, if ``p`` may address it: a workspace token its own (by
        name or key); an account admin the workspace of that name in its account; the root
        admin the workspace of that name in ``default``, else the workspace whose key is the
        name, else the one workspace of any account holding the name (two other accounts'
        of that name: 404, name one with ``X-Memfuse-Account``), and by its reference
        ``<name>~<account>`` (``keys.split``, as a store) the workspace of that name in that
        account. The row's ``name`` is the
        workspace's key: what the caller queries and writes with, never what it shows
        (``keys.public``). Raises 404 ``workspace_not_found`` for a missing workspace or one
        of another account (never telling which); 403 ``forbidden`` for a workspace token
        naming another workspace of its own account. A name no workspace can have
        (``keys.possible``: a NUL byte, which PostgreSQL refuses in a query) is a missing
        workspace, found without a query."""
        if not keys.possible(ws):
            raise ServiceError(404, "workspace_not_found", f"no workspace {ws!r}")
        row: WorkspaceRow | None
        if not p.is_admin:
            assert p.workspace is not None
            if ws in (p.workspace, keys.public(p.workspace)):
                row = s.get(WorkspaceRow, p.workspace)
                if row is None:  # a static token of a workspace that does not exist
                    raise ServiceError(404, "workspace_not_found", f"no workspace {ws!r}")
                return row
            # the refusal names the token's own actor (``Memfuse-Actor``, as an answer to it
            # does): a sidecar given a token of another workspace tells the rotation mistake
            # from a deleted workspace (memfuse.client.base ``expect_workspace``). Only the
            # caller's own workspace is named: nothing about ``ws`` or another account
            own = s.get(WorkspaceRow, p.workspace)
            told = {ACTOR_HEADER: p.actor} if p.actor.isascii() and p.actor.isprintable() else None
            if own is not None and AccessRules._in_account(s, ws, own.account) is not None:
                raise ServiceError(403, "forbidden", "the token belongs to another workspace",
                                   headers=told)
            raise ServiceError(404, "workspace_not_found", f"no workspace {ws!r}", headers=told)
        if p.account is None:  # the root admin
            name, account = keys.split(ws)
            if account is not None:  # a reference ``<name>~<account>`` (a key has that form too)
                row = AccessRules._in_account(s, name, account)
            else:
                rows = s.scalars(select(WorkspaceRow).where(
                    WorkspaceRow.name.in_((ws, keys.workspace_key(ws, DEFAULT_ACCOUNT))))).all()
                row = min(rows, key=lambda r: (r.account != DEFAULT_ACCOUNT, r.name != ws), default=None)
            if row is None and account is None:  # the one workspace holding the name, if one
                named = s.scalars(select(WorkspaceRow).where(WorkspaceRow.public_name == ws).limit(2)).all()
                row = named[0] if len(named) == 1 else None
        else:  # an account admin: a name, or a reference to its own account (as a store's)
            name, account = keys.split(ws)
            row = (AccessRules._in_account(s, name, p.account)
                   if account is None or account == p.account else None)
        if row is None:
            raise ServiceError(404, "workspace_not_found", f"no workspace {ws!r}")
        return row

    @staticmethod
    def _in_account(s: Session, ws: str, account: str) -> WorkspaceRow | None:
        """The workspace of ``account`` that ``ws`` (a name, or a key) names, or None."""
        return s.scalars(select(WorkspaceRow).where(
            WorkspaceRow.name.in_(keys.workspace_candidates(ws, account)),
            WorkspaceRow.account == account)).first()

    @staticmethod
    def store(conn: Connection, p: Principal, slug: str, *, write: bool = False) -> AnyRow:
        """The store row (Core: its columns, usage counters included) that ``slug`` (a public
        name, docs/ARCHITECTURE.md "Accounts") names for ``p``, if ``p`` may see it (and
        write it, with ``write``), in one query with the attachment: an account admin's is
        the store of that name in its account (404 ``store_not_found`` for any other); a
        workspace token's the attached store of that name; the root admin's the store of
        that name in ``default``, else the store whose key is the name, else the one store of
        any account holding the name (whichever account it is in: the root admin sees every
        account; two other accounts' stores of that name: 404, name one with
        ``X-Memfuse-Account`` or by its reference). An admin may also give a reference
        ``name~account`` (``keys.ref``): the store ``name`` of ``account`` (the root admin any
        account's, an account admin its own only). The row's ``slug`` is the store's key:
        what the caller queries and writes with, never what it shows (``keys.public``). A
        write locks the store row on PostgreSQL (serialises the store's versions). A name no
        store can have (``keys.possible``) is a missing store, found without a query. The
        idempotency key that ``Writer.write`` left for a write in ``conn.info[IDEM_PROBE]``
        (``store_first``) is taken out and, for a workspace token, looked up in the store
        row's statement: a row of it raises ``IdemFound`` before any refusal."""
        if not keys.possible(slug):
            if p.is_admin:
                raise ServiceError(404, "store_not_found", f"no store {slug!r}")
            raise ServiceError(404, "store_not_attached", f"store {slug!r} is not attached to this workspace")
        name, named_account = keys.split(slug)
        if p.is_admin and (named_account is not None or p.account is not None):
            # a reference ``name~account`` (keys.ref), or an account admin's name: the store
            # ``name`` of that account, whatever its key; an account admin naming another
            # account's is 404 like a missing one
            account = named_account or p.account
            assert account is not None
            st = None
            if p.account is None or account == p.account:
                st = _RAW_ACCOUNT_STORE[write].first(
                    conn, {"slug": name, "alt": keys.store_key(name, account), "account": account})
        elif p.is_admin:  # the root admin, a plain name
            rows = _RAW_STORE[write].all(conn, {"slug": slug, "alt": keys.store_key(slug, DEFAULT_ACCOUNT)})
            st = min(rows, key=lambda r: (r.account != DEFAULT_ACCOUNT, r.slug != slug), default=None)
            if st is None:  # the one store holding the name, if one
                named = _RAW_NAMED_STORE[write].all(conn, {"slug": slug})
                st = named[0] if len(named) == 1 else None
        else:
            probe = info_of(conn).pop(IDEM_PROBE, None) if write else None
            if probe is None:
                st = _RAW_ATTACHED_STORE[write].first(conn, {"slug": slug, "ws": p.workspace})
            else:
                st = _RAW_ATTACHED_STORE_PROBE.first(
                    conn, {"slug": slug, "ws": p.workspace, "idem_scope": probe[0], "idem_key": probe[1]})
                if st is not None and st.idem_id is not None:
                    raise IdemFound
        if st is None:
            if p.is_admin:
                raise ServiceError(404, "store_not_found", f"no store {slug!r}")
            raise ServiceError(404, "store_not_attached", f"store {slug!r} is not attached to this workspace")
        if write and not p.is_admin and st.access != Access.read_write.value:
            raise ServiceError(403, "read_only", f"store {slug!r} is attached read-only")
        if write and p.store_created is not None:
            check_store_identity(st, p.store_created)
        return st

    @staticmethod
    def store_by_key(conn: Connection, p: Principal, key: str, *, write: bool = False) -> AnyRow:
        """``store`` for a store the caller knows by its key (``key``: a row's ``store``
        column, e.g. a job's), never by a name a request gave: the same row and refusals as
        ``store`` of its public name, and 404 when the name leads ``p`` to another store
        (the same name in ``p``'s account)."""
        if p.is_admin and p.account is None:
            row = _RAW_STORE[write].first(conn, {"slug": key, "alt": key})
            if row is None:
                raise ServiceError(404, "store_not_found", f"no store {keys.public(key)!r}")
            return row
        st = AccessRules.store(conn, p, keys.public(key), write=write)
        if st.slug != key:
            if p.is_admin:
                raise ServiceError(404, "store_not_found", f"no store {keys.public(key)!r}")
            raise ServiceError(404, "store_not_attached",
                               f"store {keys.public(key)!r} is not attached to this workspace")
        return st


#: what a ``Memfuse-Writer`` value may be (an opaque sidecar instance id); another is ignored
_WRITER = re.compile(r"[A-Za-z0-9._-]{1,64}")


def with_write_headers(p: Principal, store_created: str | None, writer: str | None) -> Principal:
    """``p`` for a request that sent ``Memfuse-Store-Created: store_created`` and / or
    ``Memfuse-Writer: writer`` (``p`` itself when it sent neither): its writes are refused
    unless the store they name is the one created then (``check_store_identity``), and the
    versions they make record ``writer`` (a value that is no writer id is ignored). Used by
    the front door and the principal dependency."""
    if not store_created and not writer:
        return p
    key = (id(p), store_created, writer)
    hit = _WITH_HEADERS.get(key)
    if hit is not None and hit[0] is p:  # a sidecar sends the same values on every write
        return hit[1]
    if writer is not None and _WRITER.fullmatch(writer) is None:
        writer = None
    derived = replace(p, store_created=store_created or None, writer=writer)
    if len(_WITH_HEADERS) >= _WITH_HEADERS_MAX:
        _WITH_HEADERS.clear()
    _WITH_HEADERS[key] = (p, derived)  # ``p`` kept: its id names no other object meanwhile
    return derived


#: ``with_write_headers``' answers by (id of the principal, its two values), with the
#: principal itself: the token cache gives one ``Principal`` object per token and instance
#: (``tokens._principal_of``), so a sidecar's writes of one store derive theirs once, not
#: with ``dataclasses.replace`` (~2 us) on each. At most ``_WITH_HEADERS_MAX``, then cleared.
_WITH_HEADERS: dict[tuple[int, str | None, str | None], tuple[Principal, Principal]] = {}
_WITH_HEADERS_MAX = 1024


def _utc(t: datetime) -> datetime:
    return t.replace(tzinfo=timezone.utc) if t.tzinfo is None else t


def check_store_identity(st: AnyRow, created: str) -> None:
    """The store precondition of a write (docs/API.md "Store identity"): ``created`` (the
    ``Memfuse-Store-Created`` header, RFC 3339) must be the creation time of ``st``, the
    store row the write's transaction read (and, on PostgreSQL, locked): so a write made for
    a store deleted since, whose slug another store has now, never lands in that one, with
    no window between a check and the write. Raises ``ServiceError`` 412 ``store_replaced``
    on a mismatch, 422 ``validation_error`` for a value that is no date-time."""
    try:
        want = _utc(datetime.fromisoformat(created.strip()))
    except ValueError:
        raise ServiceError(422, "validation_error",
                           "Memfuse-Store-Created must be an RFC 3339 date-time (the store's created_at)") from None
    have = st.created_at
    have = _utc(datetime.fromisoformat(have) if isinstance(have, str) else have)
    if want != have:
        raise ServiceError(412, "store_replaced",
                           f"the store {keys.public(st.slug)!r} this write was made for was deleted; "
                           "the store of that name now is another one (created "
                           f"{have.isoformat()}): nothing was written")


_ANSWER_ENCODER = msgspec.json.Encoder()


def headers_json(headers: dict[str, str]) -> str:
    """``json.dumps(headers)``: the stored headers of an idempotent answer. An answer's only
    header is nearly always its ``ETag`` (a quoted sha256, hex): that text written directly."""
    if len(headers) == 1:
        etag = headers.get("ETag")
        if etag is not None and len(etag) > 2 and etag[0] == etag[-1] == '"' and etag[1:-1].isalnum() \
                and etag.isascii():
            return '{"ETag": "\\"' + etag[1:-1] + '\\""}'
    return json.dumps(headers)

#: What a write's ``fn`` may return: its answer as a pydantic model, as a msgspec ``Struct``
#: of ``memfuse.wire`` (the same members, order and JSON: a create's ``Record``,
#: ``recordrows.record_answer``), or None (no body)
Answer = BaseModel | msgspec.Struct | None


def answer_json(result: BaseModel | msgspec.Struct) -> bytes:
    """The JSON body of a write's answer ``result``: msgspec's encoding of a ``Struct``,
    pydantic's ``model_dump_json`` of a model (the same bytes for the same members: the
    ``wire`` structs mirror the models, ``tests/test_wire.py``)."""
    if isinstance(result, msgspec.Struct):
        return _ANSWER_ENCODER.encode(result)
    return result.model_dump_json().encode()


#: How the answer of the write running in this context may leave as soon as its transaction
#: commits (``Writer.write`` calls it once with the ``Reply``, after the commit's wake-ups and
#: before the full-text drain): set by the record-write fast path (``memfuse.server.writepath``)
#: around its write's thread hop; None (the default): the answer leaves when ``write`` returns.
#: The function must not raise and must not block.
EARLY_ANSWER: ContextVar[Callable[[Reply], None] | None] = ContextVar("memfuse_early_answer", default=None)


class Writer:
    """The one write transaction of the control plane (``write``) with its idempotency
    check and store, over ``db``; what a write changed is published to the other replicas on
    ``bus`` and wakes this process's long-polls through ``notifier`` after the commit
    (``memfuse.server.wakeups``), then hands its answer to ``EARLY_ANSWER``'s function when
    one is set."""

    db: Database
    notifier: Notifier
    bus: Bus
    _last_idem_cleanup: float  # time.monotonic() of the last sweep of old idempotency rows

    def __init__(self, db: Database, notifier: Notifier, bus: Bus) -> None:
        self.db = db
        self.notifier = notifier
        self.bus = bus
        self._last_idem_cleanup = 0.0

    def write(
        self,
        p: Principal,
        idem: IdempotencyRequest | None,
        status: int,
        fn: Callable[[Any], Answer],
        *,
        etag: bool = False,
        feed: str | None = None,
        store_first: bool = False,
    ) -> Reply:
        """Run ``fn`` in a write transaction with the idempotency check and store; commit;
        wake long-polls. ``fn`` gets an ORM ``Session`` or, with ``feed`` (the slug of the
        only store whose records ``fn`` writes), a Core ``Connection``. What ``fn`` wrote is
        noted (``wakeups.note_*``: versions by ``_add_version``, events by ``_emit``; every
        write without ``feed`` may change access) and published to the other replicas in
        the transaction (``Bus.publish``); after the commit the notes wake exactly the
        long-polls they concern in this process. A refusal of ``fn`` with ``idem`` when a
        request with the same key committed meanwhile (PostgreSQL's concurrent writers)
        replays that request's stored answer (``idem_settled``). Raises ``ServiceError`` from
        ``fn``, or 422 ``idempotency_key_reused``; ``sqlalchemy.exc.OperationalError`` when the
        database stays locked. With ``EARLY_ANSWER`` set (and ``feed``), the commit's wake-ups
        run and its reply is handed to that function as soon as the transaction commits (before
        ``Database.write_conn``'s follow-up work, the full-text drain), then the reply is returned.

        ``store_first``: ``fn``'s first statement is the store row read for writing
        (``AccessRules.store``); for a workspace token the idempotency key is then looked up
        in that statement (``IDEM_PROBE``) instead of one of its own before ``fn``: no row,
        the write goes on; a row (``IdemFound``), the transaction is rolled back and the
        write runs again with the full lookup first (a replay, 422, an expired row deleted);
        a refusal of the store read is answered as any refusal of ``fn`` (the key's stored
        answer when one committed, ``idem_settled``). A key ``fn`` left unread is looked up
        after it, before its own row is written (a row: ``fn``'s writes are rolled back and
        the write runs again as above). Same answers as the lookup first."""
        early = EARLY_ANSWER.get() if feed is not None else None
        # the committing attempt's reply and notes, made at the end of its transaction (``early``)
        ready: list[tuple[Reply, list[wakeups.Note], list[int], list[int]]] = []
        answered: Callable[[], None] | None = None
        if early is not None:
            def answered() -> None:
                if not ready:
                    return  # a replay: nothing written, the reply is returned
                reply, notes, vseqs, eseqs = ready[-1]
                self.notifier.committed(notes, own=(vseqs, eseqs))  # as below, before the answer
                try:
                    early(reply)
                except Exception:  # noqa: BLE001 - the write committed: its reply is returned
                    log.exception("early answer failed")
        probe = store_first and idem is not None and not p.is_admin
        for attempt in range(3):
            ready.clear()
            try:
                with (self.db.write_conn(committed=answered) if feed is not None else self.db.write()) as s:
                    # ``s`` is what the branch above opened: a Core connection with ``feed``, else a Session
                    conn = cast(Connection, s) if feed is not None else cast(Session, s).connection()
                    wakeups.begin_notes()
                    history.reset(conn)
                    if idem is not None:
                        if probe:  # looked up with the store row (``AccessRules.store``)
                            self.idem_cleanup(conn)
                            info_of(conn)[IDEM_PROBE] = (p.scope, idem.key)
                        else:
                            replay = self.idem_lookup(conn, p, idem)
                            if replay is not None:
                                wakeups.take_notes()
                                return replay
                    try:
                        result = fn(s)
                    finally:
                        unread = info_of(conn).pop(IDEM_PROBE, None)
                    if unread is not None and _RAW_SELECT_IDEM.first(conn, {"scope": unread[0], "key": unread[1]}):
                        raise IdemFound  # ``fn`` did not read the store first: its writes undone
                    history.settle(conn)  # the kept versions counted; pruned when over budget
                    if feed is None:
                        wakeups.note_acl()  # admin writes: access answers may have changed
                    body = answer_json(result) if result is not None else b""
                    headers: dict[str, str] = {}
                    if etag and result is not None and getattr(result, "sha256", None):
                        headers["ETag"] = f'"{getattr(result, "sha256")}"'
                    if result is None and feed is not None:
                        seq_header(headers, wakeups.version_seq_since(0))
                    if idem is not None:
                        _RAW_INSERT_IDEM.run(
                            conn,
                            {
                                "scope": p.scope,
                                "key": idem.key,
                                "method": idem.method,
                                "url_path": idem.url_path,
                                "request_hash": idem.body_sha256,
                                "status": status,
                                "response_body": body.decode(),
                                "response_headers": headers_json(headers),
                                "created_at": utcnow(),
                            },
                        )
                    notes, vseqs, eseqs = wakeups.take_notes()
                    self.bus.publish(conn, notes)  # PostgreSQL: delivered at commit, if it commits
                    if answered is not None:
                        ready.append((Reply(status, body, headers), notes, vseqs, eseqs))
                break
            except IdemFound:
                wakeups.take_notes()
                probe = False  # again, with the key's full lookup first
                continue
            except IntegrityError:
                # A concurrent transaction (another process, PostgreSQL) took the same path or
                # idempotency key first: run again, the checks now see it.
                log.info("write conflicted with a concurrent one (attempt %d)", attempt + 1)
                if attempt == 2:
                    raise ServiceError(409, "exists", "conflicting concurrent write") from None
            except ServiceError as e:
                # PostgreSQL runs writers at once: a request with the same key may have committed
                # after this one's idempotency check and caused this refusal (412, 404): its
                # stored answer is this one's (API.md "Idempotency"). The error path only, so
                # the success path keeps its statements (tests/test_rawsql.py).
                if idem is None or e.code == "idempotency_key_reused":
                    raise
                replay = self.idem_settled(p, idem)
                if replay is None:
                    raise
                log.info("write refused (%d %s) after a request with its key committed: replayed", e.status, e.code)
                return replay
        if answered is None:  # else ``answered`` did, as the transaction committed
            self.notifier.committed(notes, own=(vseqs, eseqs))
        return Reply(status, body, headers)

    def idem_cleanup(self, conn: Connection) -> None:
        """Delete idempotency rows older than ``IDEMPOTENCY_TTL`` (at most once a minute per
        process, inside a write transaction that uses keys)."""
        if time.monotonic() - self._last_idem_cleanup > 60:
            self._last_idem_cleanup = time.monotonic()
            conn.execute(delete(_I).where(_I.c.created_at < utcnow() - IDEMPOTENCY_TTL))

    def idem_lookup(self, conn: Connection, p: Principal, idem: IdempotencyRequest) -> Reply | None:
        """The stored response of ``idem`` in ``p``'s scope, or None (none, or expired: then
        deleted). Raises 422 ``idempotency_key_reused`` for a row of another request."""
        now = utcnow()
        self.idem_cleanup(conn)
        row = _RAW_SELECT_IDEM.first(conn, {"scope": p.scope, "key": idem.key})
        if row is None:
            return None
        if row.created_at < now - IDEMPOTENCY_TTL:
            conn.execute(delete(_I).where(_I.c.id == row.id))
            return None
        return self.idem_replay(row, idem)

    def idem_settled(self, p: Principal, idem: IdempotencyRequest) -> Reply | None:
        """After a write with ``idem`` was refused: the stored response of ``idem``'s key in
        ``p``'s scope as committed now (a new read transaction), or None (none, or expired).
        Raises 422 ``idempotency_key_reused`` for a row of another request."""
        with self.db.read_conn() as conn:
            row = _RAW_SELECT_IDEM.first(conn, {"scope": p.scope, "key": idem.key})
        if row is None or row.created_at < utcnow() - IDEMPOTENCY_TTL:
            return None
        return self.idem_replay(row, idem)

    @staticmethod
    def idem_replay(row: AnyRow, idem: IdempotencyRequest) -> Reply:
        """The stored response ``row`` for ``idem``; 422 ``idempotency_key_reused`` when the
        row is of another request."""
        if (row.method, row.url_path) != (idem.method, idem.url_path) or (
                row.request_hash != idem.body_sha256 and row.request_hash != idem.alternative()):
            raise ServiceError(
                422, "idempotency_key_reused", "this Idempotency-Key was used for a different request"
            )
        return Reply(row.status, row.response_body.encode(), json.loads(row.response_headers), replayed=True)


@dataclass(frozen=True)
class Parts:
    """What every resource service is built from (``Resource.__init__``): the database, the
    wake-ups of this process (``notifier``) and of the other replicas (``bus``), the shared
    ``settings``, the access rules, the write transaction and the tokens' secret-scan budget
    (``scans``). ``Parts.build`` makes the usual set over one database."""

    db: Database
    notifier: Notifier
    bus: Bus
    settings: Settings
    access: AccessRules
    writer: Writer
    #: each token's budget of secret scans (``memfuse.server.scanbudget``; from ``prescan.CHARGE_MIN`` chars)
    scans: ScanBudget = field(default_factory=ScanBudget)
    #: each token's time holding the database's writer (``memfuse.server.writertime``)
    writer_time: WriterTime = field(default_factory=WriterTime)

    @classmethod
    def build(cls, db: Database, settings: Settings) -> Parts:
        """The parts over ``db``: a new ``Notifier``, the commit ``Bus`` on ``db`` (closed when
        the database is disposed), the access rules and the write transaction."""
        notifier = wakeups.Notifier()
        bus = wakeups.Bus(db, notifier)
        db.on_dispose(bus.close)
        return cls(db, notifier, bus, settings, AccessRules(), Writer(db, notifier, bus))


class Resource:
    """The base of every resource service (accounts, tokens, stores, records, ...): the parts
    it was built from, as declared attributes, and the shared machinery under the names the
    resources' methods use (``_write``: ``Writer.write``; ``_require_admin`` / ``_workspace``
    / ``_store`` / ``_store_by_key``: ``AccessRules``; ``_contains`` / ``_path_col``: the dialect's text rules).
    A resource that needs another takes it in its own ``__init__``."""

    db: Database
    notifier: Notifier
    bus: Bus
    settings: Settings
    access: AccessRules
    writer: Writer
    scans: ScanBudget

    def __init__(self, parts: Parts) -> None:
        self.db = parts.db
        self.scans = parts.scans
        self.notifier = parts.notifier
        self.bus = parts.bus
        self.settings = parts.settings
        self.access = parts.access
        self.writer = parts.writer

    def _contains(self, col: Any, q: str, case_sensitive: bool = False) -> Any:
        """SQL: ``col`` may hold ``q`` (``memfuse.server.base.holds`` decides). Case-sensitive:
        exactly (``instr`` / ``strpos``). Case-insensitive: a superset filter the database
        runs in C, the same on both dialects whatever PostgreSQL's ``LC_CTYPE`` (SQLite's
        ``LIKE`` and ``lower()`` fold ASCII only, and PostgreSQL's ``ILIKE`` folds by the
        database's locale: ASCII only under ``C``): ``LIKE`` (SQLite) / ``ILIKE`` with the
        pattern of ``like_superset``; the caller checks every row it reads with ``holds``."""
        pg = self.db.engine.dialect.name == "postgresql"
        if case_sensitive:
            return (func.strpos(col, q) if pg else func.instr(col, q)) > 0
        pattern = "%" + like_superset(fold(q)) + "%"
        return col.ilike(pattern, escape="\\") if pg else col.like(pattern, escape="\\")

    def _path_col(self) -> Any:
        """``records.path`` compared in byte order on both databases: SQLite compares bytes;
        on PostgreSQL ``COLLATE "C"``, which the live records' ``(store, path COLLATE "C",
        id)`` index serves (revision ``0005_records_path_bytes``). Snapshot pages, search and
        ``tree`` page by it."""
        if self.db.engine.dialect.name == "postgresql":
            return _R.c.path.collate("C")
        return _R.c.path

    def _require_admin(self, p: Principal) -> None:
        self.access.require_admin(p)

    def _workspace(self, s: Session, p: Principal, ws: str) -> WorkspaceRow:
        return self.access.workspace(s, p, ws)

    def _store(self, conn: Connection, p: Principal, slug: str, *, write: bool = False) -> AnyRow:
        return self.access.store(conn, p, slug, write=write)

    def _store_by_key(self, conn: Connection, p: Principal, key: str, *, write: bool = False) -> AnyRow:
        return self.access.store_by_key(conn, p, key, write=write)

    def _write(
        self,
        p: Principal,
        idem: IdempotencyRequest | None,
        status: int,
        fn: Callable[[Any], Answer],
        *,
        etag: bool = False,
        feed: str | None = None,
        store_first: bool = False,
    ) -> Reply:
        return self.writer.write(p, idem, status, fn, etag=etag, feed=feed, store_first=store_first)
