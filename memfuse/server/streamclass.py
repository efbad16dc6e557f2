"""The one class of long-lived responses: change-feed and event long-polls, NDJSON streams
(``memfuse.server.streams``) and the console's live pages (server-sent events).

A long-lived response never holds one of the ordinary request slots
(``memfuse.server.gate``); it holds a ``Lease`` of this class instead:

- **Caps**: at most ``per_replica`` leases at once in this process (429 ``too_many_streams``),
  ``per_token`` per token (429 ``too_many_long_polls``, the code clients already know) and
  ``per_account`` per account (429 ``too_many_account_streams``), all with ``Retry-After``
  (``RETRY_AFTER`` s; RFC 6585 §4, RFC 9110 §10.2.3). A lease first counts against the
  replica (``enter``, before anything is known of the caller), then against its token and
  its account once authenticated (``Lease.bind``). The account's share is what keeps one
  account's many tokens from taking every slot of the replica, so that another account's
  sidecars still get their change feeds (attack17 F8): by default 2/5 of ``per_replica``
  (``default_per_account``), so two accounts together still leave a fifth of the slots.
  Callers of no account (the root admin's tokens, static tokens) share one share
  (``account_key``).
- **Tokens**: a bound lease runs in its ``scope`` (an anyio ``CancelScope``), cancelled when
  its token is revoked (``revoke``: this process's revocations at once; other replicas' by
  the ``TOKEN_REVOKED`` topic of the commit bus, as they commit) and at its token's
  ``expires_at`` (the scope's deadline). Whoever runs the lease (``memfuse.server.gate.Gate``)
  then ends the response: a 401 problem when nothing was sent yet, else the stream's last
  line. When revocations may have been missed (the PostgreSQL listener reconnected, or
  another process committed to an SQLite file: ``Bus.on_scan`` / ``Notifier.on_reset``), the
  tokens of every open lease are looked up again in one query (``Service.tokens_gone``).
- **Heartbeats** stay with each kind (an NDJSON stream's empty page, a live page's SSE
  comment); a long-poll answers within ``MAX_WAIT_SECONDS`` and needs none.

Counters and the token index are touched on the event loop; ``revoke`` may be called from
any thread (it posts the cancellations to the lease's event loop).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio

from memfuse.server import wakeups
from memfuse.server.service import Principal, ServiceError

log = logging.getLogger(__name__)

MAX_STREAMS = 20_000  # leases per replica
MAX_STREAMS_PER_TOKEN = 64  # leases per token
ACCOUNT_SHARE = (2, 5)  # an account's default share of the replica's leases: 2/5
RETRY_AFTER = 5  # seconds, on a refusal


class Lease:
    """One long-lived response's place in the ``StreamClass``.

    ``scope``: the cancel scope the response runs in; ``ended``: None while it may run, else
    why it was cut (``"token revoked"``, ``"token expired"``). Release it with ``close()``
    (idempotent)."""

    __slots__ = ("_cls", "key", "account", "token_id", "scope", "revoked", "_post", "_closed")

    def __init__(self, cls: StreamClass) -> None:
        self._cls = cls
        self.key: str | None = None  # the per-token key once bound
        self.account: str | None = None  # the per-account key once bound
        self.token_id: str | None = None
        self.scope = anyio.CancelScope()
        self.revoked = False
        self._post: Callable[..., Any] | None = None
        self._closed = False

    @property
    def ended(self) -> str | None:
        """Why the response must end now (the token was revoked or expired), else None."""
        if self.revoked:
            return "token revoked"
        if self.key is not None and self.scope.deadline <= anyio.current_time():
            return "token expired"
        return None

    def bind(self, p: Principal) -> None:
        """Count this lease against ``p``'s token (idempotent for the same principal) and
        arm the revocation and expiry cut. Raises ``ServiceError`` 429 ``too_many_long_polls``
        when the token already holds ``per_token`` leases, 429 ``too_many_account_streams``
        when its account already holds ``per_account``, 401 when its token expired (the
        lease then counts against neither)."""
        if self.key is not None:
            return
        self._cls._bind(self, p)

    def close(self) -> None:
        """Release the lease (idempotent)."""
        if not self._closed:
            self._closed = True
            self._cls._release(self)


def default_per_account(per_replica: int) -> int:
    """An account's default share of ``per_replica`` leases: ``ACCOUNT_SHARE`` of them (at
    least 1), so that two accounts at their share leave the others a fifth of the replica."""
    num, den = ACCOUNT_SHARE
    return max(1, per_replica * num // den)


class StreamClass:
    """The long-lived responses of one process (see the module docstring).

    ``per_replica``, ``per_token`` and ``per_account`` (None: ``default_per_account``): the
    caps, in leases. ``svc``: the ``Service`` (its notifier's ``TOKEN_REVOKED`` topic and
    resets, its bus's scans, and ``tokens_gone`` for a recheck). ``open``: leases now;
    ``cut``: leases ended by a revocation or expiry so far (for /metrics; refusals are
    counted by the front door under their code)."""

    def __init__(self, svc: Any, *, per_replica: int = MAX_STREAMS,
                 per_token: int = MAX_STREAMS_PER_TOKEN, per_account: int | None = None) -> None:
        self.svc = svc
        self.per_replica = per_replica
        self.per_token = per_token
        self.per_account = default_per_account(per_replica) if per_account is None else per_account
        self.open = 0
        self.cut = 0  # leases ended by a revocation or an expiry
        # invariant: _per_key[k] / _per_account[a] = bound, unreleased leases with key k /
        # account a (no zero entries); open >= sum of either
        self._per_key: dict[str, int] = {}
        self._per_account: dict[str, int] = {}
        self._by_token: dict[str, set[Lease]] = {}  # token id → bound leases
        self._lock = threading.Lock()  # _by_token, read by revoke from other threads
        self._recheck_lock = threading.Lock()
        svc.notifier.on_topic(wakeups.TOKEN_REVOKED, lambda token_id: self.revoke({token_id}))
        svc.notifier.on_reset.append(self.recheck)
        svc.bus.on_scan.append(self.recheck)

    # ------------------------------------------------------------ admission

    def enter(self) -> Lease:
        """A new lease counted against this replica. Raises ``ServiceError`` 429
        ``too_many_streams`` (``Retry-After``) when ``per_replica`` are open."""
        if self.open >= self.per_replica:
            raise ServiceError(429, "too_many_streams",
                               f"this server holds {self.per_replica} long-lived responses; retry",
                               headers={"Retry-After": str(RETRY_AFTER)})
        self.open += 1
        return Lease(self)

    @staticmethod
    def token_key(p: Principal) -> str:
        """What the per-token cap counts: the database token's id, or (static tokens, which
        have none) the principal's workspace."""
        if p.token_id is not None:
            return "id:" + p.token_id
        return "static:" + (p.workspace if p.workspace is not None else "")

    @staticmethod
    def account_key(p: Principal) -> str:
        """What the per-account cap counts: ``acct:`` and the principal's account (a
        workspace token's workspace's, an account admin's), or ``none`` for callers of no
        account (root admin tokens, static tokens): one share for the operator's own."""
        return "acct:" + p.account if p.account is not None else "none"

    def _bind(self, lease: Lease, p: Principal) -> None:
        key = self.token_key(p)
        if self._per_key.get(key, 0) >= self.per_token:
            raise ServiceError(429, "too_many_long_polls",
                               f"this token already holds {self.per_token} long-polls, streams or live pages",
                               headers={"Retry-After": str(RETRY_AFTER)})
        account = self.account_key(p)
        if self._per_account.get(account, 0) >= self.per_account:
            raise ServiceError(429, "too_many_account_streams",
                               f"this account already holds {self.per_account} long-polls, streams or "
                               "live pages on this server; retry",
                               headers={"Retry-After": str(RETRY_AFTER)})
        if p.expires_at is not None:
            left = p.expires_at - time.time()
            if left <= 0:
                raise ServiceError(401, "unauthorized", "token expired", headers={"WWW-Authenticate": "Bearer"})
            lease.scope.deadline = anyio.current_time() + left
        self._per_key[key] = self._per_key.get(key, 0) + 1
        self._per_account[account] = self._per_account.get(account, 0) + 1
        lease.key, lease.account = key, account
        if p.token_id is not None:
            lease.token_id = p.token_id
            lease._post = wakeups.loop_poster()
            with self._lock:
                self._by_token.setdefault(p.token_id, set()).add(lease)

    def _release(self, lease: Lease) -> None:
        self.open -= 1
        if lease.key is not None:
            n = self._per_key.get(lease.key, 1) - 1
            if n:
                self._per_key[lease.key] = n
            else:
                self._per_key.pop(lease.key, None)
        if lease.account is not None:
            n = self._per_account.get(lease.account, 1) - 1
            if n:
                self._per_account[lease.account] = n
            else:
                self._per_account.pop(lease.account, None)
        if lease.token_id is not None:
            with self._lock:
                group = self._by_token.get(lease.token_id)
                if group is not None:
                    group.discard(lease)
                    if not group:
                        del self._by_token[lease.token_id]
        if lease.scope.cancel_called:
            self.cut += 1

    # ------------------------------------------------------------ tokens

    def revoke(self, token_ids: set[str]) -> None:
        """Cut every lease of these tokens now (from any thread)."""
        with self._lock:
            hit = [lease for t in token_ids for lease in self._by_token.get(t, ())]
        for lease in hit:
            lease.revoked = True
            if lease._post is not None:
                try:
                    lease._post(lease.scope.cancel)
                except RuntimeError:  # its event loop has finished
                    pass
        if hit:
            log.info("long-lived responses of a revoked token ended", extra={"count": len(hit)})

    def recheck(self) -> None:
        """Look up the tokens of every open lease again (one query) and cut those revoked,
        expired or deleted: for when revocations may have been missed. Any thread but the
        event loop (it queries the database); a failure is logged and left for the next."""
        with self._lock:
            ids = set(self._by_token)
        if not ids or not self._recheck_lock.acquire(blocking=False):
            return
        try:
            gone = self.svc.tokens_gone(ids)
        except Exception as e:  # noqa: BLE001 - the database may be down; the next recheck tries again
            log.warning("could not recheck the tokens of open streams", extra={"error": type(e).__name__})
            return
        finally:
            self._recheck_lock.release()
        if gone:
            self.revoke(gone)
