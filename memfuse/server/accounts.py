"""Accounts: the top of the model (docs/API.md "Accounts", docs/ARCHITECTURE.md "Accounts").

An account owns workspaces, stores and tokens (their ``account`` column). The root admin (an
admin token without an account: every admin token made before accounts) creates, lists and
deletes accounts and acts on every account; an account admin (an admin token with
``account``) sees and changes only its account: another account's object is 404
(``AccessRules.store`` / ``.workspace`` and the listings filter by
``Principal.admin_account``). A database made before accounts has all its objects in
``default`` (revision 0013_accounts).

Quotas (NULL: unlimited): ``max_stores`` (checked when a store is created, 409
``account_quota``), ``max_tokens`` (active tokens, checked when a token is created, 409
``account_quota``), ``max_bytes`` (live bytes of all the account's stores, checked by every
record write that grows a store, 507 ``account_full``: ENOSPC at the mount, like a store's
own ``store_full``).
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import cast

from sqlalchemy import Table, delete, func, or_, select
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from memfuse import names
from memfuse.models import Access, Account, AccountAttachment, AccountCreate, AccountUpdate
from memfuse.server import keys
from memfuse.server.base import _S, _T, AnyRow, IdempotencyRequest, Principal, Reply, Resource, ServiceError
from memfuse.server.db import DEFAULT_ACCOUNT, AccountAttachmentRow, AccountRow, WorkspaceRow, utcnow
from memfuse.server.sessions import _CS, session_digest

log = logging.getLogger("memfuse.server.service")  # every room of the Service logs under one name

_AC = cast(Table, AccountRow.__table__)
_AA = cast(Table, AccountAttachmentRow.__table__)
_W = cast(Table, WorkspaceRow.__table__)


def _not_found(slug: str) -> ServiceError:
    return ServiceError(404, "account_not_found", f"no account {slug!r}")


#: account slugs no account may take, each with why: words the console and the CLI show in
#: the place of an account
RESERVED_ACCOUNTS = {
    "all": "the console's and the CLI's word for every account (the root admin's view)",
    "root": "the root admin, which has no account",
}

class AccountsService(Resource):
    """``Service`` methods: ``create_account``, ``list_accounts``, ``get_account``,
    ``update_account``, ``delete_account``, ``act_in_account`` and the quota checks the other rooms call."""

    @staticmethod
    def _require_root(p: Principal) -> None:
        if not p.is_root:
            raise ServiceError(403, "forbidden", "this needs the root admin token")

    def _usage(self, conn: Connection, slug: str) -> tuple[int, int, int]:
        """(stores, live bytes, active tokens) of account ``slug``."""
        stores, nbytes = conn.execute(
            select(func.count(), func.coalesce(func.sum(_S.c.usage_bytes), 0)).where(_S.c.account == slug)
        ).one()
        now = utcnow()
        tokens = conn.execute(
            select(func.count()).select_from(_T).where(
                _T.c.account == slug, _T.c.revoked_at.is_(None),
                or_(_T.c.expires_at.is_(None), _T.c.expires_at > now))
        ).scalar_one()
        return int(stores), int(nbytes), int(tokens)

    def _account_model(self, conn: Connection, row: AccountRow | AnyRow) -> Account:
        """[Account] of ``row`` with its usage and its account-wide attachments (by the
        store's name: ``keys.public`` of the key the row holds)."""
        stores, nbytes, tokens = self._usage(conn, row.slug)
        atts = conn.execute(select(_AA.c.store, _AA.c.access, _AA.c.created_at)
                            .where(_AA.c.account == row.slug)).all()
        attachments = sorted((AccountAttachment(store=keys.public(a.store), access=Access(a.access),
                                                created_at=a.created_at) for a in atts), key=lambda a: a.store)
        return Account(slug=row.slug, created_at=row.created_at, max_stores=row.max_stores,
                       max_bytes=row.max_bytes, max_tokens=row.max_tokens,
                       stores=stores, bytes=nbytes, tokens=tokens, attachments=attachments)

    # ------------------------------------------------------------ quotas (other rooms call these)

    def check_store_quota(self, s: Session | Connection, account: str) -> None:
        """409 ``account_quota`` when ``account`` holds ``max_stores`` stores already; 404
        ``account_not_found`` when it does not exist."""
        conn = s.connection() if isinstance(s, Session) else s
        row = conn.execute(select(_AC).where(_AC.c.slug == account)).first()
        if row is None:
            raise _not_found(account)
        if row.max_stores is not None:
            n = conn.execute(select(func.count()).select_from(_S).where(_S.c.account == account)).scalar_one()
            if n >= row.max_stores:
                raise ServiceError(409, "account_quota",
                                   f"account {account!r} holds {n} stores; its limit is {row.max_stores}")

    def check_token_quota(self, s: Session, account: str) -> None:
        """409 ``account_quota`` when ``account`` has ``max_tokens`` active tokens already; 404
        ``account_not_found`` when it does not exist."""
        conn = s.connection()
        row = conn.execute(select(_AC).where(_AC.c.slug == account)).first()
        if row is None:
            raise _not_found(account)
        if row.max_tokens is not None:
            held = self._usage(conn, account)[2]
            if held >= row.max_tokens:
                raise ServiceError(409, "account_quota", f"account {account!r} holds {held} active "
                                                         f"tokens; its limit is {row.max_tokens}")

    def _check_bytes_quota(self, conn: Connection, account: str, d_bytes: int) -> None:
        """507 ``account_full`` when adding ``d_bytes`` (> 0) to the live bytes of
        ``account``'s stores passes its ``max_bytes``. One primary-key read when the account
        has no byte quota (the common case), one aggregate over its stores otherwise."""
        if d_bytes <= 0:
            return
        limit = conn.execute(select(_AC.c.max_bytes).where(_AC.c.slug == account)).scalar()
        if limit is None:
            return
        used = conn.execute(select(func.coalesce(func.sum(_S.c.usage_bytes), 0))
                            .where(_S.c.account == account)).scalar_one()
        if used + d_bytes > limit:
            raise ServiceError(507, "account_full",
                               f"account {account!r} would hold {used + d_bytes} bytes, limit {limit}")

    # ------------------------------------------------------------ acting in an account

    def act_in_account(self, p: Principal, account: str | None) -> Principal:
        """The principal for a request that names ``account`` (``X-Memfuse-Account`` or
        ``?account=``): the root admin then acts as that account's admin; anyone else may
        name only its own account (404 ``account_not_found`` otherwise, the same answer as for
        a missing account). None: ``p`` unchanged. Reads the database for the root admin."""
        if not account:
            return p
        if not names.SLUG_RE.match(account):  # no account has it (a NUL byte: PostgreSQL refuses it)
            raise _not_found(account)
        if p.is_root:
            with self.db.read_conn() as conn:
                if conn.execute(select(_AC.c.slug).where(_AC.c.slug == account)).first() is None:
                    raise _not_found(account)
            return replace(p, account=account, root_token=True)
        own = p.account
        if own is None and p.workspace is not None:  # a static workspace token
            with self.db.read_conn() as conn:
                own = conn.execute(select(_W.c.account).where(_W.c.name == p.workspace)).scalar()
        if account != (own or DEFAULT_ACCOUNT):
            raise _not_found(account)
        return p

    def set_session_account(self, p: Principal, session_id: str, account: str | None) -> None:
        """The console's account switch: the root admin's session ``session_id`` acts in
        ``account`` from now on (None: every account). 403 ``forbidden`` unless the session's
        token is a root admin token; 404 ``account_not_found``."""
        if not (p.root_token or p.is_root):
            raise ServiceError(403, "forbidden", "only the root admin switches accounts")
        if account:
            self.act_in_account(replace(p, account=None), account)
        with self.db.write_conn() as conn:
            conn.execute(_CS.update().where(_CS.c.id_sha256 == session_digest(session_id))
                         .values(account=account or None))

    # ------------------------------------------------------------ root admin: accounts

    def create_account(self, p: Principal, body: AccountCreate, idem: IdempotencyRequest | None = None) -> Reply:
        """201 [Account]; 409 ``exists`` (also for a ``RESERVED_ACCOUNTS`` slug); 403
        ``forbidden`` unless the root admin."""
        self._require_root(p)
        if body.slug in RESERVED_ACCOUNTS:
            raise ServiceError(409, "exists", f"account slug {body.slug!r} is reserved: {RESERVED_ACCOUNTS[body.slug]}")

        def fn(s: Session) -> Account:
            if s.get(AccountRow, body.slug) is not None:
                raise ServiceError(409, "exists", f"account {body.slug!r} exists")
            row = AccountRow(slug=body.slug, created_at=utcnow(), max_stores=body.max_stores,
                             max_bytes=body.max_bytes, max_tokens=body.max_tokens)
            s.add(row)
            s.flush()
            log.info("account %s created by %s", body.slug, p.actor)
            return self._account_model(s.connection(), row)

        return self._write(p, idem, 201, fn)

    def list_accounts(self, p: Principal) -> list[Account]:
        """Every account with quotas and usage, by slug (root admin); an account admin gets its
        own account only."""
        self._require_admin(p)
        with self.db.read_conn() as conn:
            q = select(_AC).order_by(_AC.c.slug)
            if p.account is not None:
                q = q.where(_AC.c.slug == p.account)
            return [self._account_model(conn, r) for r in conn.execute(q).all()]

    def account_slugs(self, p: Principal) -> list[str]:
        """The slugs of every account, sorted (root admin; one query, no usage: the console's
        account switch). 403 ``forbidden`` for anyone else."""
        if not (p.is_root or (p.root_token and p.workspace is None)):
            raise ServiceError(403, "forbidden", "this needs the root admin token")
        with self.db.read_conn() as conn:
            return list(conn.execute(select(_AC.c.slug).order_by(_AC.c.slug)).scalars())

    def get_account(self, p: Principal, slug: str) -> Account:
        """[Account] (root admin, or that account's admin); 404 ``account_not_found``."""
        self._require_admin(p)
        if p.account is not None and p.account != slug:
            raise _not_found(slug)
        with self.db.read_conn() as conn:
            row = conn.execute(select(_AC).where(_AC.c.slug == slug)).first()
            if row is None:
                raise _not_found(slug)
            return self._account_model(conn, row)

    def update_account(self, p: Principal, slug: str, body: AccountUpdate,
                       idem: IdempotencyRequest | None = None) -> Reply:
        """200 [Account] (root admin): the quotas ``body`` names (its fields set: a number, or
        null for unlimited) replace the account's; the others are kept. A quota below the
        current usage is accepted: from then on the checks (``check_store_quota``,
        ``check_token_quota``, ``_check_bytes_quota``) refuse what would add to the usage,
        and nothing held is deleted. 404 ``account_not_found``; 403 ``forbidden`` unless the
        root admin (an account admin cannot raise its own quotas)."""
        self._require_root(p)
        values = {k: getattr(body, k) for k in ("max_stores", "max_bytes", "max_tokens")
                  if k in body.model_fields_set}

        def fn(s: Session) -> Account:
            conn = s.connection()
            if conn.execute(select(_AC.c.slug).where(_AC.c.slug == slug)).first() is None:
                raise _not_found(slug)
            if values:
                conn.execute(_AC.update().where(_AC.c.slug == slug).values(**values))
                log.info("account %s quotas set by %s: %s", slug, p.actor,
                         ", ".join(f"{k}={'unlimited' if v is None else v}" for k, v in sorted(values.items())))
            return self._account_model(conn, conn.execute(select(_AC).where(_AC.c.slug == slug)).one())

        return self._write(p, idem, 200, fn)

    def delete_account(self, p: Principal, slug: str, idem: IdempotencyRequest | None = None) -> Reply:
        """204 (root admin): an account that holds no store, workspace or active token any
        more (its revoked and expired tokens are deleted with it); 409 ``account_not_empty`` otherwise, 409 ``default_account`` for
        ``default``; 404 ``account_not_found``."""
        self._require_root(p)

        def fn(s: Session) -> None:
            conn = s.connection()
            if conn.execute(select(_AC.c.slug).where(_AC.c.slug == slug)).first() is None:
                raise _not_found(slug)
            if slug == DEFAULT_ACCOUNT:
                raise ServiceError(409, "default_account", "the account 'default' cannot be deleted")
            for table in (_S, _W):
                if conn.execute(select(func.count()).select_from(table).where(table.c.account == slug)).scalar_one():
                    raise ServiceError(409, "account_not_empty",
                                       f"account {slug!r} still holds {table.name}: delete them first")
            if self._usage(conn, slug)[2]:
                raise ServiceError(409, "account_not_empty",
                                   f"account {slug!r} still has active tokens: revoke them first")
            conn.execute(delete(_T).where(_T.c.account == slug))  # revoked or expired ones
            conn.execute(delete(_AC).where(_AC.c.slug == slug))
            log.info("account %s deleted by %s", slug, p.actor)
            return None

        return self._write(p, idem, 204, fn)
