"""Workspaces, stores and attachments: the admin's resources, and the workspace events they emit.

Every change here that a sidecar must see (a store attached, detached or changed) appends a
workspace event in the same transaction (``_emit``); the events are read by
``changes.ChangesService.events_page``. Records live in ``records``; the store row's access
check (``_store``) is shared with them in ``base``.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import replace

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from memfuse.defs import RECORD_BODY_GROWTH, largest_record, record_body_bound
from memfuse.models import (
    Access,
    Attachment,
    AttachmentPut,
    Store,
    StoreCreate,
    StoreUpdate,
    Workspace,
    WorkspaceCreate,
)
from memfuse.server.accounts import AccountsService
from memfuse.server.base import _S, AnyRow, IdempotencyRequest, Principal, Parts, Reply, Resource, ServiceError
from memfuse.server import history, keys, wakeups
from memfuse.server.db import DEFAULT_ACCOUNT, AccountAttachmentRow, AttachmentRow, EventRow, StoreRow, WorkspaceRow, utcnow

log = logging.getLogger("memfuse.server.service")  # every room of the Service logs under one name


def _store_model(st: StoreRow | AnyRow) -> Store:
    """[Store] of a store row (ORM or Core), with its usage counters and its history budget
    (the one in force) and usage."""
    max_b, max_n, min_age = history.budget(st)
    hist_b, hist_n = history.usage(st)
    return Store(
        slug=keys.public(st.slug),
        description=st.description,
        default_type=st.default_type,
        max_record_bytes=st.max_record_bytes,
        max_store_bytes=st.max_store_bytes,
        max_records=st.max_records,
        created_at=st.created_at,
        usage_bytes=st.usage_bytes or 0,
        record_count=st.record_count or 0,
        max_history_bytes=max_b,
        max_history_versions=max_n,
        history_min_age_s=min_age,
        history_bytes=hist_b,
        history_versions=hist_n,
        account=st.account or DEFAULT_ACCOUNT,
    )


def _workspace_model(row: WorkspaceRow) -> Workspace:
    """[Workspace] of a workspace row: its public name (``keys.public`` of the key)."""
    return Workspace(name=keys.public(row.name), created_at=row.created_at, account=row.account)


class StoresService(Resource):
    """``Service`` methods: workspaces, stores, attachments (``create_*``, ``list_*``,
    ``get_store``, ``update_store``, ``put_attachment``, ``delete_attachment``)."""

    accounts: AccountsService  # the account a root admin acts in, the store quota

    def __init__(self, parts: Parts, accounts: AccountsService) -> None:
        super().__init__(parts)
        self.accounts = accounts

    def _check_record_limit(self, max_record_bytes: int | None) -> None:
        """422 ``invalid_limit`` when a store's ``max_record_bytes`` (bytes; None: not given)
        is larger than a record the front door takes in one request with its body bound
        (``Settings.max_body``, ``memfuse serve --max-body``): the rule
        ``memfuse.defs.largest_record`` (a larger record would be refused 413 ``too_large``
        before it is read; attack 12, A2)."""
        if max_record_bytes is None:
            return
        most = largest_record(self.settings.max_body)
        if max_record_bytes > most:
            raise ServiceError(
                422, "invalid_limit",
                f"max_record_bytes {max_record_bytes} is larger than this control plane takes in one "
                f"request: at most {most} bytes (its body bound, --max-body, is {self.settings.max_body} "
                f"bytes; a record's JSON body may be {RECORD_BODY_GROWTH} times its size: a control character is "
                f"escaped as \\u00XX)")

    #: stores named in full in the warning of ``warn_stores_over_body_bound`` (the count is whole)
    OVER_BOUND_NAMED = 20

    def stores_over_body_bound(self) -> list[tuple[str, int]]:
        """The stores whose ``max_record_bytes`` is larger than this control plane takes in one
        request (``largest_record(Settings.max_body)``; set under a larger ``--max-body``, or
        before the rule existed): ``(reference, max_record_bytes)`` pairs by reference, the
        reference being what a root admin names the store by (``keys.ref``: ``notes``, or
        ``notes~bravo`` in account ``bravo``). Their records past the bound cannot be written
        (413 ``too_large`` before the body is read; ``EFBIG`` at a mount's close). Reads only
        the store rows' slug, account and limit (no content)."""
        most = largest_record(self.settings.max_body)
        with self.db.read() as s:
            rows = s.connection().execute(
                select(_S.c.slug, _S.c.account, _S.c.max_record_bytes).where(_S.c.max_record_bytes > most)).all()
        return sorted((keys.ref(keys.public(r.slug), r.account), int(r.max_record_bytes)) for r in rows)

    def warn_stores_over_body_bound(self) -> list[tuple[str, int]]:
        """Log one structured WARNING ``stores_over_body_bound`` when some store allows records
        larger than one request carries (``stores_over_body_bound``, whose list it returns):
        the stores (their references, at most ``OVER_BOUND_NAMED``; ``count`` is all of them),
        the body bound, the largest record it admits, the body bound they need, and what to do.
        ``memfuse serve`` calls it at start (docs/DEPLOY.md, "Request limits")."""
        over = self.stores_over_body_bound()
        if over:
            biggest = max(n for _, n in over)
            log.warning(
                "stores_over_body_bound: %d store(s) allow records larger than --max-body %d takes in one "
                "request (at most %d bytes); their larger records are refused 413 too_large (EFBIG at a "
                "mount). Raise --max-body to at least %d, or lower each store's max_record_bytes "
                "(memfuse store update STORE --max-record-bytes %d)",
                len(over), self.settings.max_body, largest_record(self.settings.max_body),
                record_body_bound(biggest), largest_record(self.settings.max_body),
                extra={"event": "stores_over_body_bound", "stores": ",".join(ref for ref, _ in over[:self.OVER_BOUND_NAMED]),
                       "count": len(over), "max_body": self.settings.max_body,
                       "largest_record": largest_record(self.settings.max_body),
                       "max_body_needed": record_body_bound(biggest)})
        return over

    def _emit(self, s: Session, workspaces: Iterable[str], kind: str, store: str, access: str | None) -> None:
        ws = sorted(set(workspaces))
        if not ws:
            return
        # PostgreSQL: serialise event writers per workspace so event seqs commit in order.
        s.execute(select(WorkspaceRow.name).where(WorkspaceRow.name.in_(ws)).with_for_update())
        now = utcnow()
        rows = [EventRow(workspace=w, kind=kind, store=store, access=access, created_at=now) for w in ws]
        s.add_all(rows)
        s.flush()
        for r in rows:
            wakeups.note_events(r.workspace, r.seq)

    def _attach_account_stores(self, s: Session, ws: WorkspaceRow) -> None:
        """Attach to the new workspace ``ws`` every account-wide attachment of its account
        (events ``attached``); a store already attached (its own store) is left as it is."""
        rows = s.scalars(select(AccountAttachmentRow).where(AccountAttachmentRow.account == ws.account)).all()
        for aa in rows:
            if s.get(AttachmentRow, (ws.name, aa.store)) is not None:
                continue
            s.add(AttachmentRow(workspace=ws.name, store=aa.store, access=aa.access, instructions="",
                                created_at=utcnow()))
            s.flush()
            self._emit(s, [ws.name], "attached", aa.store, aa.access)

    def put_account_attachment(self, p: Principal, account: str, slug: str, body: AttachmentPut,
                               idem: IdempotencyRequest | None = None) -> Reply:
        """200 [Attachment] with ``workspace`` ``"*"``: ``slug`` (a store of ``account``) is
        attached with ``body.access`` to every workspace of the account, now and every
        workspace created later (events ``attached`` where new or changed). Admin of the
        account (the root admin, or its account admin); 404 ``account_not_found`` /
        ``store_not_found``; 403 ``store_archived``."""
        self._require_admin(p)
        p = self.accounts.act_in_account(p, account)

        def fn(s: Session) -> Attachment:
            st = self._store(s.connection(), p, slug)
            if st.archived_at is not None:
                raise ServiceError(403, "store_archived", f"store {slug!r} is archived: it takes no new attachments")
            now = utcnow()
            key = st.slug  # the store's key (memfuse.server.keys): what the rows name
            aa = s.get(AccountAttachmentRow, (account, key))
            if aa is None:
                aa = AccountAttachmentRow(account=account, store=key, access=body.access.value, created_at=now)
                s.add(aa)
            else:
                aa.access = body.access.value
            s.flush()
            changed: list[str] = []
            for ws in s.scalars(select(WorkspaceRow.name).where(WorkspaceRow.account == account)).all():
                att = s.get(AttachmentRow, (ws, key))
                if att is None:
                    s.add(AttachmentRow(workspace=ws, store=key, access=aa.access,
                                        instructions=body.instructions, created_at=now))
                elif att.access != aa.access or att.instructions != body.instructions:
                    att.access, att.instructions = aa.access, body.instructions
                else:
                    continue
                changed.append(ws)
            s.flush()
            self._emit(s, changed, "attached", key, aa.access)
            log.info("store %s attached to every workspace of account %s (%s; %d changed)", slug, account,
                     aa.access, len(changed))
            return Attachment(workspace="*", store=_store_model(st), access=Access(aa.access),
                              instructions=body.instructions, created_at=aa.created_at)

        return self._write(p, idem, 200, fn)

    def delete_account_attachment(self, p: Principal, account: str, slug: str,
                                  idem: IdempotencyRequest | None = None) -> Reply:
        """204: the account-wide attachment of ``slug`` ends and the store is detached from
        every workspace of ``account`` (events ``detached``). 404 ``account_not_found`` /
        ``store_not_attached``."""
        self._require_admin(p)
        p = self.accounts.act_in_account(p, account)

        def fn(s: Session) -> None:
            key = self._store(s.connection(), p, slug).slug  # 404 store_not_found: not of the account
            aa = s.get(AccountAttachmentRow, (account, key))
            if aa is None:
                raise ServiceError(404, "store_not_attached", f"store {slug!r} is not attached account-wide")
            s.delete(aa)
            wss = s.scalars(select(AttachmentRow.workspace).join(
                WorkspaceRow, WorkspaceRow.name == AttachmentRow.workspace).where(
                AttachmentRow.store == key, WorkspaceRow.account == account)).all()
            for ws in wss:
                att = s.get(AttachmentRow, (ws, key))
                if att is not None:
                    s.delete(att)
            s.flush()
            self._emit(s, wss, "detached", key, None)
            log.info("store %s detached from every workspace of account %s", slug, account)
            return None

        return self._write(p, idem, 204, fn)

    # ------------------------------------------------------------ admin

    def create_workspace(self, p: Principal, body: WorkspaceCreate, idem: IdempotencyRequest | None = None) -> Reply:
        """201 [Workspace]; 409 ``exists``; 403 ``forbidden`` for workspace tokens.

        With ``body.default_store`` (the default), the same transaction also gives the
        workspace a store of its own name attached ``read_write`` (event ``attached``): a new
        store with the default limits and type, or the existing store of that name, which is
        attached as it is (its records and limits untouched, never recreated)."""
        self._require_admin(p)
        if body.account is not None:  # named in the body: as X-Memfuse-Account would name it
            p = self.accounts.act_in_account(p, body.account)
        account = p.admin_account or DEFAULT_ACCOUNT

        def fn(s: Session) -> Workspace:
            wkey = keys.new_workspace_key(s.connection(), body.name, account)
            if wkey is None:
                raise ServiceError(409, "exists", f"workspace {body.name!r} exists")
            now = utcnow()
            # the key (memfuse.server.keys): the name, or ``<name>~<account>`` when taken
            row = WorkspaceRow(name=wkey, public_name=body.name, created_at=now, account=account)
            s.add(row)
            s.flush()
            if body.default_store:
                conn = s.connection()
                key = keys.new_key(conn, body.name, account)
                if key is None:  # the account's own store of that name: attached as it is
                    key = next(k for k in keys.candidates(body.name, account)
                               if (r := s.get(StoreRow, k)) is not None and r.account == account)
                else:
                    self.accounts.check_store_quota(s, account)
                    limits = StoreCreate(slug=body.name)
                    s.add(StoreRow(
                        slug=key, public_slug=body.name, description=limits.description,
                        default_type=limits.default_type, max_record_bytes=limits.max_record_bytes,
                        max_store_bytes=limits.max_store_bytes, max_records=limits.max_records,
                        created_at=now, account=account,
                    ))
                    s.flush()  # the store row before the attachment that references it
                    log.info("store %s created for workspace %s", key, body.name)
                s.add(AttachmentRow(workspace=wkey, store=key, access=Access.read_write.value,
                                    instructions="", created_at=now))
                s.flush()
                self._emit(s, [wkey], "attached", key, Access.read_write.value)
            log.info("workspace %s created%s", body.name,
                     f" with store {body.name} attached read-write" if body.default_store else "")
            self._attach_account_stores(s, row)
            return _workspace_model(row)

        return self._write(p, idem, 201, fn)

    def list_workspaces(self, p: Principal) -> list[Workspace]:
        """Every workspace, by name (admin; an account admin: its account's)."""
        self._require_admin(p)
        with self.db.read() as s:
            q = select(WorkspaceRow).order_by(WorkspaceRow.name)
            if p.admin_account is not None:
                q = q.where(WorkspaceRow.account == p.admin_account)
            rows = s.scalars(q).all()
            return sorted((_workspace_model(r) for r in rows), key=lambda m: (m.name, m.account))

    def create_store(self, p: Principal, body: StoreCreate, idem: IdempotencyRequest | None = None) -> Reply:
        """201 [Store] in the caller's account (the root admin's: ``default``, unless it
        names one: ``X-Memfuse-Account``); 409 ``exists`` (the account has a store of that
        slug; another account's store of the same slug is no conflict: memfuse.server.keys),
        409 ``account_quota`` (the account's ``max_stores``), 422 ``invalid_limit`` (a
        ``max_record_bytes`` past what one request can carry: ``_check_record_limit``) (admin)."""
        self._require_admin(p)
        if body.account is not None:  # named in the body: as X-Memfuse-Account would name it
            p = self.accounts.act_in_account(p, body.account)
        account = p.admin_account or DEFAULT_ACCOUNT
        # a limit the caller chose; the default one is served by any body bound this
        # control plane accepts for it, or refused at the write (413) when --max-body is smaller
        self._check_record_limit(body.max_record_bytes if "max_record_bytes" in body.model_fields_set else None)

        def fn(s: Session) -> Store:
            key = keys.new_key(s.connection(), body.slug, account)
            if key is None:
                raise ServiceError(409, "exists", f"store {body.slug!r} exists")
            self.accounts.check_store_quota(s, account)
            st = StoreRow(
                account=account,
                slug=key,
                public_slug=body.slug,
                description=body.description,
                default_type=body.default_type,
                max_record_bytes=body.max_record_bytes,
                max_store_bytes=body.max_store_bytes,
                max_records=body.max_records,
                max_history_bytes=body.max_history_bytes,
                max_history_versions=body.max_history_versions,
                history_min_age_s=body.history_min_age_s,
                created_at=utcnow(),
                usage_bytes=0, record_count=0, version_bytes=0, version_count=0,
            )
            s.add(st)
            s.flush()
            log.info("store %s created", key)
            return _store_model(st)

        return self._write(p, idem, 201, fn)

    def list_stores(self, p: Principal) -> list[Store]:
        """Every store with its usage, by slug (admin; an account admin: its account's)."""
        self._require_admin(p)
        with self.db.read() as s:
            q = select(_S).order_by(_S.c.slug)
            if p.admin_account is not None:
                q = q.where(_S.c.account == p.admin_account)
            rows = s.connection().execute(q).all()
            return sorted((_store_model(r) for r in rows), key=lambda m: (m.slug, m.account))

    def get_store(self, p: Principal, slug: str) -> Store:
        """[Store] for admin or a workspace it is attached to; 404 otherwise."""
        with self.db.read() as s:
            return _store_model(self._store(s.connection(), p, slug))

    def update_store(
        self, p: Principal, slug: str, body: StoreUpdate, idem: IdempotencyRequest | None = None
    ) -> Reply:
        """200 [Store]; emits ``store_changed`` to every attached workspace (admin); 422
        ``invalid_limit`` for a ``max_record_bytes`` past what one request can carry
        (``_check_record_limit``)."""
        self._require_admin(p)
        self._check_record_limit(body.max_record_bytes)

        def fn(s: Session) -> Store:
            key = self._store(s.connection(), p, slug, write=True).slug
            values = {k: v for k, v in body.model_dump(exclude_unset=True).items() if v is not None}
            if values:
                s.connection().execute(update(_S).where(_S.c.slug == key).values(**values, updated_at=utcnow()))
                history.forget_idle(key)  # a new budget: look at the store again at its next write
            attached = s.scalars(select(AttachmentRow.workspace).where(AttachmentRow.store == key)).all()
            self._emit(s, attached, "store_changed", key, None)
            return _store_model(self._store(s.connection(), p, slug))

        return self._write(p, idem, 200, fn)

    def put_attachment(
        self, p: Principal, ws: str, slug: str, body: AttachmentPut, idem: IdempotencyRequest | None = None
    ) -> Reply:
        """200 [Attachment]; 404 ``workspace_not_found`` / ``store_not_found`` (also for a
        store of another account than the workspace's); 403
        ``store_archived`` for a new attachment of an archived store (an existing one may
        still change); emits ``attached`` when the attachment is new or its access or
        instructions changed."""
        self._require_admin(p)

        def fn(s: Session) -> Attachment:
            wrow = self._workspace(s, p, ws)
            if p.is_root:  # the root admin: the store of that name in the workspace's account
                st = self._store(s.connection(), replace(p, account=wrow.account), slug)
            else:
                st = self._store(s.connection(), p, slug)
            if st.account != wrow.account:  # never across accounts
                raise ServiceError(404, "store_not_found", f"no store {slug!r} in the workspace's account")
            key, wkey = st.slug, wrow.name  # the keys (memfuse.server.keys): what the rows name
            att = s.get(AttachmentRow, (wkey, key))
            changed = True
            if att is None and st.archived_at is not None:
                raise ServiceError(403, "store_archived", f"store {slug!r} is archived: it takes no new attachments")
            if att is None:
                att = AttachmentRow(
                    workspace=wkey, store=key, access=body.access.value, instructions=body.instructions,
                    created_at=utcnow(),
                )
                s.add(att)
            elif att.access != body.access.value or att.instructions != body.instructions:
                att.access = body.access.value
                att.instructions = body.instructions
            else:
                changed = False
            s.flush()
            if changed:
                self._emit(s, [wkey], "attached", key, att.access)
                log.info("store %s attached to %s (%s)", slug, wkey, att.access)
            return Attachment(
                workspace=keys.public(wkey), store=_store_model(st), access=Access(att.access),
                instructions=att.instructions, created_at=att.created_at,
            )

        return self._write(p, idem, 200, fn)

    def delete_attachment(self, p: Principal, ws: str, slug: str, idem: IdempotencyRequest | None = None) -> Reply:
        """204; 404 ``workspace_not_found`` or ``store_not_attached``; emits ``detached``."""
        self._require_admin(p)

        def fn(s: Session) -> None:
            wkey = self._workspace(s, p, ws).name  # the key
            wrow = s.get(WorkspaceRow, wkey)
            assert wrow is not None
            att = (s.get(AttachmentRow, (wkey, keys.store_key(slug, wrow.account)))
                   or s.get(AttachmentRow, (wkey, slug)))
            if att is None:
                raise ServiceError(404, "store_not_attached", f"store {slug!r} is not attached to {ws!r}")
            s.delete(att)
            s.flush()
            self._emit(s, [wkey], "detached", att.store, None)
            log.info("store %s detached from %s", slug, wkey)
            return None

        return self._write(p, idem, 204, fn)
    def check_workspace(self, p: Principal, ws: str) -> str:
        """The key of the workspace ``p`` names ``ws`` (memfuse.server.keys); raise what
        ``_workspace`` raises when ``p`` may not address it (404 ``workspace_not_found`` for
        another account's)."""
        with self.db.read() as s:
            return self._workspace(s, p, ws).name

    def list_attachments(self, p: Principal, ws: str) -> list[Attachment]:
        """The workspace's attachments, by store slug."""
        return self.workspace_attachments(p, ws)[1]

    def workspace_attachments(self, p: Principal, ws: str) -> tuple[str, list[Attachment]]:
        """(the workspace's account, its attachments by store slug): ``list_attachments``
        with the account, which a workspace without stores shows nowhere else."""
        with self.db.read() as s:
            row = self._workspace(s, p, ws)
            wkey, account = row.name, row.account  # the key
            rows = s.execute(
                select(AttachmentRow, StoreRow)
                .join(StoreRow, StoreRow.slug == AttachmentRow.store)
                .where(AttachmentRow.workspace == wkey)
                .order_by(StoreRow.public_slug, AttachmentRow.store)
            ).all()
            return account, [
                Attachment(
                    workspace=keys.public(wkey),
                    store=_store_model(st),
                    access=Access(att.access),
                    instructions=att.instructions,
                    created_at=att.created_at,
                )
                for att, st in rows
            ]
