"""Tokens and authentication: bearer token → ``Principal``; the admin's token create, list
and revoke.

Tokens are stored as their sha256 only. A request's token is hashed and looked up by that
hash (an index lookup on a digest reveals nothing about the token); the match is then
compared with ``hmac.compare_digest``; static tokens (given to ``create_app``) are compared
in constant time too.

The positive cache (``TokenCache``): a database token is remembered for
``TOKEN_CACHE_SECONDS`` after a lookup, so most requests resolve on the event loop without
a query (``authenticate_cached``). Every ~``TOKEN_CACHE_SECONDS / 2`` (``token_upkeep``, run
from a request when due) one ``IN`` query confirms every cached token seen lately whose entry
is in the second half of its life, so tokens in use never fall out of the cache and
thousands of idle sidecars cost one token query per ~15 s per process; a lookup of an
unknown token also confirms the due ones (at most once a second). What bounds it:

- expiry: the cached entry carries ``expires_at``, checked on every request;
- revocation: ``DELETE /v1/tokens/{id}`` sets the row's ``revoked_at`` and drops the token
  from this process's cache at once. Every process reads the ids of the tokens revoked in the
  last ``REVOCATION_LOOKBACK_SECONDS`` (an index range read on ``revoked_at``, usually empty)
  at most every ``REVOCATION_CHECK_SECONDS``, and only while requests arrive, and drops them;
  a cached token is never used once that read is overdue. So another replica refuses a
  revoked token within about a second. The look-back spans the cache lifetime plus a margin
  for clock skew between replicas, so the order in which concurrent revocations commit does
  not matter. On PostgreSQL the revocation also travels on the commit bus
  (``memfuse.server.wakeups``, topic ``TOKEN_REVOKED``) and every replica drops the token when
  it commits; while the bus is connected (``Bus.revocations_live``) the periodic read is not
  needed, and on every (re)connect of the bus the cache is emptied (revocations may have been
  missed while it was down).
- a row deleted from the database by hand: refused within ``TOKEN_CACHE_SECONDS``.

``last_used_at``: a request only marks its token's cache entry as used; once per
``LAST_USED_SECONDS`` (± 10 %, the first time at a random point of the first minute, so
replicas started together do not write together) each process writes ``last_used_at`` of
every token used since its last write in one ``UPDATE ... WHERE id IN (...)``
(``flush_token_use``; conditional: a row another replica wrote in the last half minute is
left alone). An idle control plane with N sidecars therefore costs one statement a minute
per process, whatever N. ``list_tokens`` writes what is pending first (its answer is
current for this process; other replicas' uses show within about a minute), and so does
closing the database.
"""
from __future__ import annotations

import hmac
import logging
import random
import secrets
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from sqlalchemy import bindparam, or_, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from memfuse import names
from memfuse.models import TokenCreate, TokenCreated, TokenInfo, sha256_hex
from memfuse.server.base import (
    _T,
    AnyRow,
    IdempotencyRequest,
    Principal,
    Reply,
    Parts,
    Resource,
    ServiceError,
    _unauthorized,
)
from memfuse.server import keys, wakeups
from memfuse.server.accounts import AccountsService
from memfuse.server.db import TokenRow, utc_shift, utcnow

log = logging.getLogger("memfuse.server.service")  # every room of the Service logs under one name

TOKEN_CACHE_SECONDS = 30.0  # a database token is looked up again after this long
TOKEN_CACHE_MAX = 4096  # entries; the cache is emptied when full
REVOCATION_CHECK_SECONDS = 1.0  # a cached token is used only if revocations were read this recently
REVOCATION_LOOKBACK_SECONDS = TOKEN_CACHE_SECONDS + 30.0  # cache lifetime + clock-skew margin
LAST_USED_SECONDS = 60.0  # last_used_at is written at most this often per token
TOKEN_CONFIRM_BATCH = 1000  # tokens confirmed by one query

_SELECT_TOKENS = select(
    _T.c.id, _T.c.token_sha256, _T.c.workspace, _T.c.name, _T.c.expires_at, _T.c.revoked_at,
    _T.c.last_used_at, _T.c.account,
).where(_T.c.token_sha256.in_(bindparam("digests", expanding=True)))
_SELECT_REVOKED = select(_T.c.id).where(_T.c.revoked_at > bindparam("since"))
_TOUCH_MANY = update(_T).where(
    _T.c.id.in_(bindparam("ids", expanding=True)),
    or_(_T.c.last_used_at.is_(None), _T.c.last_used_at < bindparam("before")),
).values(last_used_at=bindparam("now"))
TOUCH_BATCH = 1000  # token ids per UPDATE


def _clean_instance(value: str | None) -> str | None:
    """``X-Memfuse-Instance`` fit for the actor (``names.client_label``)."""
    return names.client_label(value)


def _label(name: str | None) -> str:
    """A token name for a log line: printable characters only (names are user input)."""
    return "".join(ch if ch.isprintable() else "?" for ch in (name or ""))[:200] or "-"


def _principal_of(e: _Entry, instance: str | None) -> Principal:
    """The principal of cache entry ``e`` called with ``X-Memfuse-Instance`` ``instance``: made
    from the entry's fields (none of which changes) and kept on it for the next request with
    the same instance (a frozen dataclass of seven fields is ~2 µs to build, on the event
    loop per request)."""
    last = e.last
    if last is not None and last[0] == instance:
        return last[1]
    p = Principal(workspace=e.workspace, name=e.name, instance=_clean_instance(instance),
                  account=e.account, root_token=e.workspace is None and e.account is None,
                  token_id=e.token_id, expires_at=e.expires_at)
    e.last = (instance, p)  # one assignment: a worker thread reading it sees the old or the new
    return p


def token_digest(token: str) -> str:
    """The sha256 hex of a bearer token as the tokens table stores it (``token_sha256``) and
    the positive cache keys it."""
    return sha256_hex(token.encode("utf-8", "surrogatepass"))



@dataclass
class _Entry:
    token_id: str
    workspace: str | None
    name: str
    expires_at: float | None  # wall-clock epoch seconds
    until: float  # monotonic: looked up again after this
    account: str | None = None  # the token's account (None: a root admin token)
    used: bool = False  # used since last_used_at was last written (or found fresh)
    seen: float = 0.0  # monotonic: last request with this token
    last: tuple[str | None, Principal] | None = None  # the last principal made of it (``_principal_of``)


class TokenCache:
    """This process's positive cache of database tokens (digest → entry), and when it last
    read the recent revocations. Shared by the event loop (reads) and worker threads."""

    def __init__(self) -> None:
        self.entries: dict[str, _Entry] = {}
        self.checked_at = -1e18  # monotonic time of the last read of token_revocations
        self.batch_at = -1e18  # monotonic time of the last batched confirmation
        # monotonic time of the next write of last_used_at (see the module docstring)
        self.flush_at = time.monotonic() + LAST_USED_SECONDS * random.uniform(0.25, 1.0)
        self.pending: set[str] = set()  # ids used, not written, whose entries were dropped
        # monotonic time of the next confirmation of the cached tokens (token_upkeep)
        self.confirm_at = time.monotonic() + TOKEN_CACHE_SECONDS / 2 * random.uniform(0.5, 1.0)
        self.lock = threading.Lock()

    def forget(self, token_ids: set[str]) -> None:
        """Drop these tokens (revoked)."""
        for digest, e in list(self.entries.items()):
            if e.token_id in token_ids:
                self.entries.pop(digest, None)

    def clear(self) -> None:
        """Drop every entry; the ids of those used since their last write stay pending (the
        next ``flush_token_use`` writes them)."""
        self.pending.update(e.token_id for e in self.entries.values() if e.used)
        self.entries.clear()


def _state(row: AnyRow, now: datetime) -> Literal["active", "expired", "revoked"]:
    if row.revoked_at is not None:
        return "revoked"
    if row.expires_at is not None and row.expires_at <= now:
        return "expired"
    return "active"


def _public(workspace: str | None) -> str | None:
    """The public name of a token's workspace (the row holds its key, memfuse.server.keys)."""
    return None if workspace is None else keys.public(workspace)


def _info(row: AnyRow, now: datetime) -> TokenInfo:
    return TokenInfo(id=row.id, workspace=_public(row.workspace), name=row.name or "",
                     created_at=row.created_at, last_used_at=row.last_used_at,
                     expires_at=row.expires_at, revoked_at=row.revoked_at, state=_state(row, now),
                     account=row.account)


class TokensService(Resource):
    """``Service`` methods: ``authenticate``, ``authenticate_cached``, ``create_token``,
    ``list_tokens``, ``revoke_token``, ``tokens_revoked``."""

    accounts: AccountsService  # the account a root admin acts in, the token quota
    static_tokens: dict[str, str | None]  # raw token → workspace (None: admin), read per request
    _token_cache: TokenCache  # database tokens seen lately

    def __init__(self, parts: Parts, static_tokens: dict[str, str | None], accounts: AccountsService) -> None:
        super().__init__(parts)
        self.accounts = accounts
        self.static_tokens = static_tokens
        self._token_cache = TokenCache()
        parts.db.on_dispose(lambda: self.flush_token_use(force=True))  # pending last_used_at
        # a revocation committed on any replica reaches this one on the commit bus; after the
        # bus (re)connects nothing cached is trusted (revocations may have been missed)
        self.notifier.on_topic(wakeups.TOKEN_REVOKED, lambda token_id: self.tokens_revoked({token_id}))
        self.notifier.on_reset.append(lambda: self.tokens_revoked(None))

    # ------------------------------------------------------------ authentication

    def authenticate(self, token: str | None, instance: str | None = None) -> Principal:
        """Resolve a bearer token (in a worker thread: may read and, once a minute per
        token, write the database). Raises ``ServiceError`` 401 ``unauthorized`` when the
        token is missing, unknown, revoked or expired (the detail says which)."""
        p = self.authenticate_cached(token, instance)
        if p is not None:
            return p
        assert token  # authenticate_cached refused a missing one
        cache: TokenCache = self._token_cache
        self._read_revocations()
        digest = token_digest(token)
        mono, wall = time.monotonic(), time.time()
        hit = cache.entries.get(digest)
        if hit is not None and hit.until > mono and (hit.expires_at is None or hit.expires_at > wall):
            hit.used, hit.seen = True, mono
            return _principal_of(hit, instance)
        # One query for this token and, at most once a second, every cached token whose entry
        # is in the second half of its life: idle sidecars then cost about one token query
        # per TOKEN_CACHE_SECONDS / 2 in all, not one per token.
        due: list[str] = []
        with cache.lock:
            if mono - cache.batch_at >= 1.0:
                cache.batch_at = mono
                due = [d for d, e in cache.entries.items()
                       if d != digest and e.until - mono < TOKEN_CACHE_SECONDS / 2][:TOKEN_CONFIRM_BATCH - 1]
        with self.db.read_conn() as conn:
            rows = {r.token_sha256: r for r in conn.execute(_SELECT_TOKENS, {"digests": [digest, *due]})}
        for d in due:
            self._confirmed(d, rows.get(d), mono, wall)
        row = rows.get(digest)
        if row is None or not hmac.compare_digest(row.token_sha256, digest):
            cache.entries.pop(digest, None)
            raise _unauthorized("unknown token")
        if row.revoked_at is not None:
            cache.entries.pop(digest, None)
            raise _unauthorized("token revoked")
        if row.expires_at is not None and row.expires_at.timestamp() <= wall:
            cache.entries.pop(digest, None)
            raise _unauthorized("token expired")
        name = row.name or row.id
        fresh = row.last_used_at is not None and row.last_used_at.timestamp() > wall - LAST_USED_SECONDS
        old = cache.entries.get(digest)
        entry = _Entry(token_id=row.id, workspace=row.workspace, name=name, account=row.account,
                       expires_at=row.expires_at.timestamp() if row.expires_at is not None else None,
                       until=mono + TOKEN_CACHE_SECONDS,
                       used=not fresh or (old is not None and old.used), seen=mono)
        if len(cache.entries) >= TOKEN_CACHE_MAX:
            cache.clear()
        cache.entries[digest] = entry
        return _principal_of(entry, instance)

    def authenticate_cached(self, token: str | None, instance: str | None = None,
                            digest: str | None = None) -> Principal | None:
        """Resolve a bearer token without touching the database (on the event loop): static
        tokens, and database tokens in the positive cache while it may be trusted (entry
        younger than ``TOKEN_CACHE_SECONDS``, not expired, revocations read within
        ``REVOCATION_CHECK_SECONDS``). None when the database must
        be asked (``authenticate``). Raises ``ServiceError`` 401 when the token is missing.
        ``digest``: ``token_digest(token)`` when the caller has it already (the front door
        keeps it per token: not hashed again per request)."""
        if not token:
            raise _unauthorized("a bearer token is required")
        raw = token.encode("utf-8", "surrogatepass")
        for known, workspace in list(self.static_tokens.items()):
            if hmac.compare_digest(known.encode("utf-8", "surrogatepass"), raw):
                return Principal(workspace=workspace, name="static", instance=_clean_instance(instance),
                                 root_token=workspace is None)
        cache: TokenCache = self._token_cache
        hit = cache.entries.get(digest if digest is not None else sha256_hex(raw))
        mono = time.monotonic()
        revocations_fresh = self.bus.revocations_live or mono - cache.checked_at <= REVOCATION_CHECK_SECONDS
        if (hit is None or hit.until < mono or not revocations_fresh
                or (hit.expires_at is not None and hit.expires_at <= time.time())):
            return None
        hit.used, hit.seen = True, mono
        return _principal_of(hit, instance)

    def tokens_gone(self, token_ids: set[str]) -> set[str]:
        """Which of these database token ids are revoked, expired or deleted now (one query
        per ``TOKEN_CONFIRM_BATCH`` ids; in a worker thread). Raises ``SQLAlchemyError`` when
        the database fails."""
        ids = sorted(token_ids)
        found: dict[str, Any] = {}
        q = select(_T.c.id, _T.c.expires_at, _T.c.revoked_at).where(
            _T.c.id.in_(bindparam("ids", expanding=True)))
        with self.db.read_conn() as conn:
            for i in range(0, len(ids), TOKEN_CONFIRM_BATCH):
                for r in conn.execute(q, {"ids": ids[i:i + TOKEN_CONFIRM_BATCH]}):
                    found[r.id] = r
        wall = time.time()
        gone = {t for t in ids if t not in found or found[t].revoked_at is not None
                or (found[t].expires_at is not None and found[t].expires_at.timestamp() <= wall)}
        if gone:
            self.tokens_revoked(gone)
        return gone

    def token_id_of(self, token: str) -> str | None:
        """The id of a database token this process authenticated lately (in the positive
        cache), else None (static tokens have none). No database."""
        e = self._token_cache.entries.get(token_digest(token))
        return e.token_id if e is not None else None

    def _read_revocations(self) -> None:
        """Read the ids of tokens revoked in the last ``REVOCATION_LOOKBACK_SECONDS`` (at most
        every ``REVOCATION_CHECK_SECONDS``) and drop them from the cache."""
        cache: TokenCache = self._token_cache
        with cache.lock:
            if time.monotonic() - cache.checked_at <= REVOCATION_CHECK_SECONDS:
                return
            started = time.monotonic()
            since = utcnow() - timedelta(seconds=REVOCATION_LOOKBACK_SECONDS)
            with self.db.read_conn() as conn:
                revoked = {r.id for r in conn.execute(_SELECT_REVOKED, {"since": since})}
            if revoked:
                cache.forget(revoked)
            cache.checked_at = started

    def token_upkeep_due(self) -> bool:
        """True when ``token_upkeep`` has work to look at (cheap: a clock read; for the event
        loop, which then runs it in a worker thread)."""
        cache: TokenCache = self._token_cache
        mono = time.monotonic()
        return mono >= cache.flush_at or mono >= cache.confirm_at

    def token_upkeep(self) -> None:
        """The token bookkeeping of this process, each part when due: confirm the cached
        tokens (``confirm_cached_tokens``, every ~``TOKEN_CACHE_SECONDS / 2``) and write
        ``last_used_at`` (``flush_token_use``, every ~``LAST_USED_SECONDS``). Runs in a worker
        thread; never raises for a database failure (logged)."""
        if time.monotonic() >= self._token_cache.confirm_at:
            self.confirm_cached_tokens()
        self.flush_token_use()

    def confirm_cached_tokens(self) -> int:
        """Look up again, in one ``SELECT … WHERE token_sha256 IN (…)`` per
        ``TOKEN_CONFIRM_BATCH``, every cached token seen in the last ``2 × TOKEN_CACHE_SECONDS``
        whose entry is in the second half of its life: a confirmed entry lives
        ``TOKEN_CACHE_SECONDS`` more, a revoked, expired or deleted one is dropped. Tokens in
        use then never fall out of the cache, and N idle sidecars cost one query per
        ~``TOKEN_CACHE_SECONDS / 2`` per process. Returns how many were looked up."""
        cache: TokenCache = self._token_cache
        with cache.lock:
            mono = time.monotonic()
            cache.confirm_at = mono + TOKEN_CACHE_SECONDS / 2 * random.uniform(0.8, 1.0)
            due = [d for d, e in cache.entries.items()
                   if e.until - mono < TOKEN_CACHE_SECONDS / 2 and e.seen > mono - 2 * TOKEN_CACHE_SECONDS]
        if not due:
            return 0
        wall = time.time()
        try:
            with self.db.read_conn() as conn:
                for i in range(0, len(due), TOKEN_CONFIRM_BATCH):
                    chunk = due[i:i + TOKEN_CONFIRM_BATCH]
                    rows = {r.token_sha256: r for r in conn.execute(_SELECT_TOKENS, {"digests": chunk})}
                    for d in chunk:
                        self._confirmed(d, rows.get(d), mono, wall)
        except SQLAlchemyError as err:
            log.warning("could not confirm %d cached tokens (%s); they are looked up one by one "
                        "when their cache entries end", len(due), type(err).__name__)
            return 0
        return len(due)

    def _confirmed(self, digest: str, row: AnyRow | None, mono: float, wall: float) -> None:
        """Apply a fresh lookup (``row``, None when gone) to the cache entry of ``digest``."""
        cache: TokenCache = self._token_cache
        e = cache.entries.get(digest)
        if e is None:
            return
        if row is None or row.revoked_at is not None or (
                row.expires_at is not None and row.expires_at.timestamp() <= wall):
            cache.entries.pop(digest, None)
        else:
            e.until = mono + TOKEN_CACHE_SECONDS

    def flush_token_use(self, *, force: bool = False) -> int:
        """Write ``last_used_at`` = now for every cached token used since its last write, in
        one ``UPDATE ... WHERE id IN (...)`` per ``TOUCH_BATCH`` tokens (rows written in the
        last ``LAST_USED_SECONDS / 2`` s, e.g. by another replica, are left alone); when due
        (``token_flush_due``) or with ``force``. Returns how many tokens it wrote. A failure
        (database busy) is logged; those tokens are written at the next try, in ~5 s. Runs in
        a worker thread."""
        cache: TokenCache = self._token_cache
        with cache.lock:
            mono = time.monotonic()
            if not force:
                if mono < cache.flush_at:
                    return 0
                cache.flush_at = mono + LAST_USED_SECONDS * random.uniform(0.9, 1.1)
            due = [e for e in cache.entries.values() if e.used]
            for e in due:
                e.used = False
            pending, cache.pending = cache.pending, set()
        ids = sorted({e.token_id for e in due} | pending)
        if not ids:
            return 0
        now = utcnow()
        try:
            with self.db.write_conn() as conn:
                for i in range(0, len(ids), TOUCH_BATCH):
                    conn.execute(_TOUCH_MANY, {"ids": ids[i:i + TOUCH_BATCH], "now": now,
                                               "before": now - timedelta(seconds=LAST_USED_SECONDS / 2)})
        except SQLAlchemyError as err:
            log.warning("could not record the last use of %d tokens (%s); will try again in ~5 s",
                        len(ids), type(err).__name__)
            for e in due:
                e.used = True
            cache.pending |= pending
            cache.flush_at = time.monotonic() + 5.0
            return 0
        return len(ids)

    def tokens_revoked(self, token_ids: set[str] | None = None) -> None:
        """Forget revoked tokens now: ``token_ids``, or every cached token when None. The hook
        for a cross-replica notification of a revocation; without one, each process reads
        the revocations within ``REVOCATION_CHECK_SECONDS``."""
        cache: TokenCache = self._token_cache
        if token_ids is None:
            cache.clear()
        else:
            cache.forget(token_ids)

    # ------------------------------------------------------------ admin: create, list, revoke

    def create_token(self, p: Principal, body: TokenCreate, idem: IdempotencyRequest | None = None) -> Reply:
        """201 [TokenCreated] (the token is shown once; only its sha256 is kept); with
        ``ttl_seconds`` it expires that long after now. A workspace token belongs to its
        workspace's account; an admin token (no ``workspace``) with ``account`` (or made by
        an account admin) administers that account only, else it is a root admin token
        (only the root admin makes those). 404 ``workspace_not_found`` (also another
        account's) / ``account_not_found``; 409 ``account_quota`` (``max_tokens``); 403
        ``forbidden`` for a workspace token. Logged with the actor (audit)."""
        self._require_admin(p)
        made: list[TokenRow] = []  # the row, once the transaction ran (not on a replay)
        if body.account is not None:
            p = self.accounts.act_in_account(p, body.account)

        def fn(s: Session) -> TokenCreated:
            wkey: str | None = None  # the workspace's key (memfuse.server.keys): what the row holds
            account: str | None
            if body.workspace is not None:
                wrow = self._workspace(s, p, body.workspace)
                wkey, account = wrow.name, wrow.account
                if body.account is not None and body.account != account:
                    raise ServiceError(404, "workspace_not_found",
                                       f"no workspace {body.workspace!r} in account {body.account!r}")
            else:  # an admin token: of the caller's account (an account admin's), or root
                account = p.admin_account
            if account is not None:
                self.accounts.check_token_quota(s, account)
            raw = "mf_" + secrets.token_urlsafe(32)
            now = utcnow()
            expires = utc_shift(now, body.ttl_seconds) if body.ttl_seconds else None
            row = TokenRow(
                id=str(uuid.uuid4()), token_sha256=sha256_hex(raw.encode()), workspace=wkey,
                name=body.name, created_at=now, expires_at=expires, account=account,
            )
            s.add(row)
            s.flush()
            made[:] = [row]
            return TokenCreated(id=row.id, workspace=_public(row.workspace), name=row.name, token=raw,
                                expires_at=expires, account=account)

        reply = self._write(p, idem, 201, fn)
        for row in made:  # committed (audit: after the commit, never for a replay)
            log.info("audit: token %s (%s) created for %s by %s%s", row.id, _label(row.name),
                     row.workspace or "admin", _label(p.actor),
                     f", expires {row.expires_at.isoformat()}" if row.expires_at else "",
                     extra={"audit": "token_created", "token_id": row.id,
                            "workspace": row.workspace, "actor": p.actor})
        return reply

    def list_tokens(self, p: Principal, workspace: str | None = None,
                    include_revoked: bool = False) -> list[TokenInfo]:
        """[TokenInfo] of every token (admin only; 403 ``forbidden`` otherwise), oldest first;
        ``workspace`` keeps one workspace's tokens (``""``: admin tokens only); revoked tokens
        only with ``include_revoked``. Never the secret nor its hash."""
        self._require_admin(p)
        self.flush_token_use(force=True)  # this process's pending uses, so the answer is current
        q = select(_T.c.id, _T.c.workspace, _T.c.name, _T.c.created_at, _T.c.last_used_at,
                   _T.c.expires_at, _T.c.revoked_at, _T.c.account).order_by(_T.c.created_at, _T.c.id)
        if p.admin_account is not None:  # an account admin: its account's tokens only
            q = q.where(_T.c.account == p.admin_account)
        if not include_revoked:
            q = q.where(_T.c.revoked_at.is_(None))
        now = utcnow()
        with self.db.read() as s:
            if workspace == "":
                q = q.where(_T.c.workspace.is_(None))
            elif workspace is not None:  # by name: the key of the workspace the caller sees so
                try:
                    q = q.where(_T.c.workspace == self._workspace(s, p, workspace).name)
                except ServiceError:
                    return []  # no such workspace (for this caller): no tokens
            return [_info(r, now) for r in s.connection().execute(q)]

    def revoke_token(self, p: Principal, token_id: str, idem: IdempotencyRequest | None = None) -> Reply:
        """204: the token stops working at once on this process and within
        ``REVOCATION_CHECK_SECONDS`` on every other one sharing the database (see the module
        docstring). Revoking a revoked token is a no-op (204). 404 ``token_not_found``; 403
        ``forbidden`` for a workspace token. Logged with the actor (audit)."""
        self._require_admin(p)
        revoked: list[tuple[str, str | None]] = []  # (name, workspace) once it ran

        def fn(s: Session) -> None:
            revoked.clear()
            row = s.get(TokenRow, token_id)
            if row is None or (p.admin_account is not None and row.account != p.admin_account):
                raise ServiceError(404, "token_not_found", f"no token {token_id!r}")
            if row.revoked_at is None:
                row.revoked_at = utcnow()
                s.flush()
                revoked.append((row.name, row.workspace))
                wakeups.note_topic(wakeups.TOKEN_REVOKED, token_id)  # every replica, at commit
            return None

        reply = self._write(p, idem, 204, fn)
        self.tokens_revoked({token_id})
        for name, workspace in revoked:  # committed (audit: after the commit)
            log.info("audit: token %s (%s) of %s revoked by %s", token_id, _label(name),
                     workspace or "admin", _label(p.actor),
                     extra={"audit": "token_revoked", "token_id": token_id,
                            "workspace": workspace, "actor": p.actor})
        return reply
