"""The Service room behind the Anthropic memory-store API (``memfuse.server.anthropic_api``).

The API's objects are memfuse's own rows, read and written here with memfuse's rules:

- a *memory store* is a store row: its slug is the id (``memstore_<slug>``), plus what only
  this API sets (``name``, ``metadata_json``, ``archived_at``, ``updated_at``: revision
  ``0006_anthropic_memory_stores``); creating, changing, archiving or deleting one needs an
  admin token, as memfuse's own store endpoints do;
- a *memory* is a live record (its path with a leading ``/``); its writes go through
  ``RecordsService``'s operations, so every rule (content, secrets, limits, the change feed, the
  versions) is the one the mount, the API, the memory tool and MCP meet;
- a *memory version* is a version row, named by its change-feed ``seq``.

Nothing here speaks HTTP: it takes a ``Principal`` and plain values and returns rows or
memfuse's wire models; refusals are ``ServiceError`` (the router maps them to Anthropic's
error envelope). Each method reads or writes in one transaction of its own.
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, false, select, tuple_, update
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from memfuse.defs import content_page
from memfuse.models import Access, MoveResult, Record, RecordCreate, RecordMove, RecordUpdate, StoreCreate
from memfuse.server import deltas, keys, tails
from memfuse.server.anthropic_models import DeletedMemoryStore, MemoryStoreOut
from memfuse.server.base import _A, _R, _S, _V, AnyRow, IdempotencyRequest, Principal, Parts, Reply, Resource, ServiceError
from memfuse.server.db import DEFAULT_ACCOUNT, AttachmentRow, StoreRow, WorkspaceRow, utcnow
from memfuse.server.accounts import AccountsService
from memfuse.server.recordrows import _record_model
from memfuse.server.records import RecordsService
from memfuse.server.stores import StoresService

log = logging.getLogger("memfuse.server.service")  # every room of the Service logs under one name

#: memfuse operations (``Operation``) behind each Anthropic version ``operation``: a move, a
#: restore and an attribute change are all ``modified`` there.
VERSION_OPERATIONS: dict[str, tuple[str, ...]] = {
    "created": ("created",),
    "modified": ("modified", "moved", "restored"),
    "deleted": ("deleted",),
}

_NON_ALNUM = re.compile(r"[^a-z0-9]+")
SLUG_MAX = 63


def slug_for_name(name: str) -> str:
    """The store slug a memory-store ``name`` gives: Anthropic's mount-directory rule (the
    name lowercased, every run of characters other than ASCII letters and digits one ``-``),
    then memfuse's slug pattern (``[a-z0-9][a-z0-9._-]{0,62}``): hyphens at either end
    dropped, cut to 63 characters, ``store`` when nothing is left. The caller makes it
    unique (``-2``, ``-3``... appended)."""
    slug = _NON_ALNUM.sub("-", name.lower()).strip("-")[:SLUG_MAX].rstrip("-")
    return slug or "store"


def path_prefix_end(prefix: str) -> str:
    """The first path after every path under ``prefix`` (which ends with ``/``) in byte
    order: ``notes/`` → ``notes0`` (``0`` follows ``/``)."""
    return prefix[:-1] + "0"


@dataclass(frozen=True)
class ListedItem:
    """One item of a memory listing: a live record row (``row``) or a rolled-up directory
    (``prefix``, memfuse form with the trailing ``/``), and the listing position after it
    (``after``: ``("m", path, id)`` or ``("p", first path after the prefix)``)."""

    row: AnyRow | None
    prefix: str | None
    after: tuple[str, ...]


_MEMORY_COLUMNS = (_R.c.id, _R.c.path, _R.c.sha256, _R.c.size, _R.c.created_at, _R.c.updated_at, _R.c.seq)


class MemoryStoresService(Resource):
    """``Service`` methods of the Anthropic memory-store API (``ms_*``)."""

    records: RecordsService  # memories are records
    stores: StoresService  # memory stores are stores (their attachment events)
    accounts: AccountsService  # the store quota

    def __init__(self, parts: Parts, records: RecordsService, stores: StoresService,
                 accounts: AccountsService) -> None:
        super().__init__(parts)
        self.records = records
        self.stores = stores
        self.accounts = accounts

    # ------------------------------------------------------------ memory stores

    @staticmethod
    def _ms_visible(p: Principal, workspace: str | None) -> Any:
        """The statement of the stores ``p`` sees: all for an admin token (those attached to
        the workspace whose key is ``workspace`` when given), the attached ones for a
        workspace token."""
        ws = p.workspace or workspace
        q = select(_S)
        if p.admin_account is not None:  # an account admin: its account's stores only
            q = q.where(_S.c.account == p.admin_account)
        if ws is None:
            return q
        return q.join(_A, (_A.c.store == _S.c.slug) & (_A.c.workspace == ws))

    def ms_list_stores(
        self, p: Principal, workspace: str | None, *, include_archived: bool,
        created_gte: datetime | None, created_lte: datetime | None,
    ) -> list[AnyRow]:
        """The store rows ``p`` sees, newest first (then by ``shown_slug``), archived ones only with
        ``include_archived``, created within the bounds given (inclusive)."""
        with self.db.read() as s:
            conn = s.connection()
            if workspace is not None and p.is_admin:  # a name: its key, as the caller sees it
                try:
                    workspace = self._workspace(s, p, workspace).name
                except ServiceError:
                    return []  # no such workspace for this caller: no store attached to it
            q = self._ms_visible(p, workspace)
            if not include_archived:
                q = q.where(_S.c.archived_at.is_(None))
            if created_gte is not None:
                q = q.where(_S.c.created_at >= created_gte)
            if created_lte is not None:
                q = q.where(_S.c.created_at <= created_lte)
            rows = conn.execute(q).all()
        return sorted(rows, key=lambda r: (-r.created_at.timestamp(), shown_slug(r, p)))

    def ms_get_store(self, p: Principal, slug: str) -> AnyRow:
        """The store row, if ``p`` may see it; 404 otherwise."""
        with self.db.read_conn() as conn:
            return self._store(conn, p, slug)

    def ms_create_store(
        self, p: Principal, *, name: str, description: str, metadata: dict[str, str],
        workspace: str | None, idem: IdempotencyRequest | None = None,
    ) -> Reply:
        """200 [MemoryStoreOut] (Anthropic's API answers a create 200); admin. The slug is
        ``slug_for_name(name)``, made unique with ``-2``, ``-3``...; the store gets memfuse's
        default limits. With ``workspace`` the store is attached to it ``read_write`` (event
        ``attached``). 404 ``workspace_not_found``."""
        self._require_admin(p)
        def fn(s: Session) -> MemoryStoreOut:
            account = p.admin_account or DEFAULT_ACCOUNT
            if workspace is not None:
                wrow = self._workspace(s, p, workspace)
                account = wrow.account  # the root admin's store goes to the workspace's account
            self.accounts.check_store_quota(s, account)
            base = slug_for_name(name)
            public, n = base, 1  # unique within the account (memfuse.server.keys)
            while (slug := keys.new_key(s.connection(), public, account)) is None:
                n += 1
                suffix = f"-{n}"
                public = base[: SLUG_MAX - len(suffix)].rstrip("-") + suffix
            limits = StoreCreate(slug=public)
            now = utcnow()
            st = StoreRow(
                slug=slug, public_slug=public, description=description, default_type=limits.default_type,
                max_record_bytes=limits.max_record_bytes, max_store_bytes=limits.max_store_bytes,
                max_records=limits.max_records, created_at=now, name=name,
                metadata_json=json.dumps(metadata, ensure_ascii=False), updated_at=now,
                account=account,
            )
            s.add(st)
            s.flush()
            if workspace is not None:
                s.add(AttachmentRow(workspace=wrow.name, store=slug, access=Access.read_write.value,
                                    instructions="", created_at=now))
                s.flush()
                self.stores._emit(s, [wrow.name], "attached", slug, Access.read_write.value)
            log.info("store %s created (memory-store API)%s", slug,
                     f", attached to {workspace} read-write" if workspace else "")
            return store_out(st, p)

        return self._write(p, idem, 200, fn)

    def ms_update_store(
        self, p: Principal, slug: str, *, name: str | None, description: str | None,
        metadata_patch: dict[str, str | None] | None, check_metadata: Callable[[dict[str, str]], None],
        idem: IdempotencyRequest | None = None,
    ) -> Reply:
        """200 the store; admin. 403 ``store_archived`` for an archived store. ``name`` and
        ``description`` replace; ``metadata_patch`` sets (or, with None, removes) keys and
        ``check_metadata(result)`` validates the result (raises ``ServiceError``). A change
        of the description emits ``store_changed`` to the attached workspaces (their prompt
        block shows it). Nothing changed: no write, ``updated_at`` kept."""
        self._require_admin(p)

        def fn(s: Session) -> MemoryStoreOut:
            conn = s.connection()
            st = self._store(conn, p, slug, write=True)
            if st.archived_at is not None:
                raise ServiceError(403, "store_archived", f"store {slug!r} is archived: it cannot be changed")
            values: dict[str, Any] = {}
            key = st.slug  # the store's key (memfuse.server.keys): what the rows name
            if name is not None and name != (st.name or keys.public(key)):
                values["name"] = name
            if description is not None and description != st.description:
                values["description"] = description
            if metadata_patch is not None:
                meta = store_metadata(st)
                new = dict(meta)
                for k, v in metadata_patch.items():
                    if v is None:
                        new.pop(k, None)
                    else:
                        new[k] = v
                check_metadata(new)
                if new != meta:
                    values["metadata_json"] = json.dumps(new, ensure_ascii=False)
            if values:
                values["updated_at"] = utcnow()
                conn.execute(update(_S).where(_S.c.slug == key).values(**values))
                if "description" in values:
                    attached = s.scalars(select(AttachmentRow.workspace).where(AttachmentRow.store == key)).all()
                    self.stores._emit(s, attached, "store_changed", key, None)
            return store_out(self._store(conn, p, slug), p)

        return self._write(p, idem, 200, fn)

    def ms_archive_store(self, p: Principal, slug: str, idem: IdempotencyRequest | None = None) -> Reply:
        """200 the store, archived (admin); an archived store is answered unchanged. Emits
        ``store_changed`` to the attached workspaces."""
        self._require_admin(p)

        def fn(s: Session) -> MemoryStoreOut:
            conn = s.connection()
            st = self._store(conn, p, slug, write=True)
            if st.archived_at is None:
                key, now = st.slug, utcnow()
                conn.execute(update(_S).where(_S.c.slug == key).values(archived_at=now, updated_at=now))
                attached = s.scalars(select(AttachmentRow.workspace).where(AttachmentRow.store == key)).all()
                self.stores._emit(s, attached, "store_changed", key, None)
                log.info("store %s archived", key)
            return store_out(self._store(conn, p, slug), p)

        return self._write(p, idem, 200, fn)

    def ms_delete_store(self, p: Principal, slug: str, idem: IdempotencyRequest | None = None) -> Reply:
        """200 ``{"type": "memory_store_deleted", "id": ...}`` (admin): the store, its records,
        its versions and its attachments are deleted in one transaction; every workspace it
        was attached to gets a ``detached`` event (its sidecars unmount it). 404 when
        missing."""
        self._require_admin(p)
        def fn(s: Session) -> DeletedMemoryStore:
            conn = s.connection()
            key = self._store(conn, p, slug, write=True).slug  # the key (memfuse.server.keys)
            attached = s.scalars(select(AttachmentRow.workspace).where(AttachmentRow.store == key)).all()
            conn.execute(delete(_A).where(_A.c.store == key))
            conn.execute(delete(_V).where(_V.c.store == key))
            conn.execute(delete(_R).where(_R.c.store == key))
            conn.execute(delete(_S).where(_S.c.slug == key))
            self.stores._emit(s, attached, "detached", key, None)
            log.info("store %s deleted with its records and versions", key)
            return DeletedMemoryStore(id=store_id(slug))

        return self._write(p, idem, 200, fn)

    # ------------------------------------------------------------ memories

    def ms_list_memories(
        self, p: Principal, slug: str, *, prefix: str, depth: int, limit: int, after: tuple[str, ...] | None,
        with_content: bool,
    ) -> tuple[list[ListedItem], bool]:
        """At most ``limit`` items of the store's live records under ``prefix`` (memfuse form:
        ``""`` or ``a/b/``), in byte order of the path, after the listing position ``after``
        (``ListedItem.after`` of the previous page's last item); and whether more follow.
        With ``depth`` > 0 a record more than ``depth`` segments below the prefix is rolled
        up into one prefix item for its first ``depth`` segments, and the listing seeks past
        that directory (one query per rolled-up directory, not one per record). With content
        a page holds at most ``defs.PAGE_CONTENT_BYTES`` of it, as UTF-8 and as JSON (at least
        one memory; ``_with_content``, ``defs.content_page``); the content is read only for the memories the page
        keeps by size."""
        path_col = self._path_col()
        with self.db.read_conn() as conn:
            st = self._store(conn, p, slug)
            base = select(*_MEMORY_COLUMNS).where(_R.c.store == st.slug, _R.c.deleted == false())
            if prefix:
                base = base.where(path_col >= prefix, path_col < path_prefix_end(prefix))
            items: list[ListedItem] = []
            pos = after
            while len(items) <= limit:
                q = base
                if pos is not None and pos[0] == "m":
                    q = q.where(tuple_(path_col, _R.c.id) > tuple_(pos[1], pos[2]))
                elif pos is not None:
                    q = q.where(path_col >= pos[1])
                want = limit + 1 - len(items)
                batch = conn.execute(q.order_by(path_col, _R.c.id).limit(want)).all()
                rolled = False
                for r in batch:
                    rel = r.path[len(prefix):].split("/")
                    if depth and len(rel) > depth:
                        pre = prefix + "/".join(rel[:depth]) + "/"
                        pos = ("p", path_prefix_end(pre))
                        items.append(ListedItem(None, pre, pos))
                        rolled = True
                        break
                    pos = ("m", r.path, r.id)
                    items.append(ListedItem(r, None, pos))
                if not rolled and len(batch) < want:
                    break
            more = len(items) > limit
            items = items[:limit]
            if with_content:
                items, cut = self._with_content(conn, items)
                more = more or cut
        return items, more

    @staticmethod
    def _with_content(conn: Connection, items: list[ListedItem]) -> tuple[list[ListedItem], bool]:
        """The leading ``items`` one page with content may carry (``defs.content_page``: by
        the records' sizes, prefixes counting 0, then in encoded JSON bytes: the page is
        encoded whole, and 8 MiB of control characters is 48 MiB of JSON), their rows read
        again with their live content (a record deleted meanwhile is left out); and whether
        items were cut."""

        def read(n: int) -> list[ListedItem]:
            ids = [it.row.id for it in items[:n] if it.row is not None]
            rows = {r.id: r for r in conn.execute(select(*_MEMORY_COLUMNS, tails.LIVE_CONTENT).select_from(_R)
                                                  .where(_R.c.id.in_(ids))).all()} if ids else {}
            return [it if it.row is None else ListedItem(rows[it.row.id], None, it.after)
                    for it in items[:n] if it.row is None or it.row.id in rows]

        return content_page([it.row.size if it.row is not None else 0 for it in items], read,
                            lambda it: it.row.content if it.row is not None else None)

    def ms_update_memory(
        self, p: Principal, slug: str, record_id: str, *, content: str | None, path: str | None,
        if_match: str | None, idem: IdempotencyRequest | None = None,
    ) -> Reply:
        """200 [Record]: the record moved to ``path`` and / or given ``content``, in one
        transaction, under ``if_match`` (the content sha256 it must have now, checked by each
        step). A move makes a ``moved`` version, new content a ``modified`` one; a step that
        changes nothing makes none. Refusals are those of ``move_record`` (409
        ``path_exists`` when another live record holds ``path``) and ``update_record``
        (412 ``precondition_failed``, 404, 403 ``store_archived``, content rules); nothing is
        written when one refuses."""
        move = self.records._move_op(p, record_id, RecordMove(path=path), if_match) if path is not None else None
        upd = None
        if content is not None:
            upd = self.records._update_op(p, record_id, RecordUpdate(content=content), if_match)

        def fn(conn: Connection) -> Record:
            st = self._store(conn, p, slug, write=True)
            rec: Record | None = None
            if move is not None:
                moved: MoveResult = move(conn, st)
                rec = moved.records[0]
            if upd is not None:
                rec = upd(conn, st)
            if rec is None:  # neither: the record as it is (404 when deleted)
                rec = self._ms_record(conn, st, record_id)
            return rec

        return self._write(p, idem, 200, fn, etag=True, feed=slug)

    def _ms_record(self, conn: Connection, st: AnyRow, record_id: str) -> Record:
        return _record_model(self.records._live(self.records._record(conn, st, record_id)), with_content=False)

    # ------------------------------------------------------------ versions

    def ms_list_versions(
        self, p: Principal, slug: str, *, limit: int, before_seq: int | None, record_id: str | None,
        operations: Sequence[str] | None, created_gte: datetime | None, created_lte: datetime | None,
        actor_exact: str | None, actor_instance: str | None, with_content: bool,
    ) -> tuple[Sequence[AnyRow], bool]:
        """At most ``limit`` version rows of the store, newest first (``seq`` descending),
        older than ``before_seq``, filtered by record, memfuse operations, creation time
        (inclusive) and actor (``actor_exact``: the actor string; ``actor_instance``: a
        sidecar's writes, ``ws:<any>/<instance>``); and whether more follow. With content a
        page holds at most ``defs.PAGE_CONTENT_BYTES`` of it, as UTF-8 and as JSON
        (``defs.content_page``; at least one version), read only for the versions it
        keeps by size."""
        cols = [c for c in _V.c if c.name != "content"]
        with self.db.read_conn() as conn:
            st = self._store(conn, p, slug)
            q = select(*cols).where(_V.c.store == st.slug)
            if before_seq is not None:
                q = q.where(_V.c.seq < before_seq)
            if record_id is not None:
                q = q.where(_V.c.record_id == record_id)
            if operations is not None:
                q = q.where(_V.c.operation.in_(list(operations)))
            if created_gte is not None:
                q = q.where(_V.c.created_at >= created_gte)
            if created_lte is not None:
                q = q.where(_V.c.created_at <= created_lte)
            if actor_exact is not None:
                q = q.where(_V.c.actor == actor_exact)
            if actor_instance is not None:
                esc = actor_instance.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
                q = q.where(_V.c.actor.like("ws:%/" + esc, escape="\\"))
            rows = conn.execute(q.order_by(_V.c.seq.desc()).limit(limit + 1)).all()
            if actor_instance is not None:  # LIKE's ``%`` may span a "/" of the workspace part
                rows = [r for r in rows if r.actor.rpartition("/")[2] == actor_instance]
            more, rows = len(rows) > limit, rows[:limit]
            if with_content and rows:
                listed = rows

                def read(n: int) -> list[Any]:  # content only for the versions one page may carry
                    seqs = [r.seq for r in listed[:n]]
                    whole = conn.execute(select(_V).where(_V.c.seq.in_(seqs)).order_by(_V.c.seq)).all()
                    # append versions' content made whole (oldest first: links reused)
                    return list(reversed(deltas.resolve(conn, whole)))

                # a redacted or deleted version shows no content (anthropic_api.version_out)
                rows, cut = content_page([r.size for r in listed], read,
                                         lambda r: None if r.redacted or r.operation == "deleted" else r.content)
                more = more or cut
        return rows, more

    def ms_get_version(self, p: Principal, slug: str, seq: int, *, with_content: bool) -> AnyRow:
        """The version row of ``seq`` in the store; 404 ``version_not_found``."""
        with self.db.read_conn() as conn:
            st = self._store(conn, p, slug)
            v: AnyRow | None = conn.execute(select(_V).where(_V.c.seq == seq, _V.c.store == st.slug)).first()
            if v is not None:
                v = deltas.resolve(conn, [v])[0]  # an append version's content made whole
        if v is None:
            raise ServiceError(404, "version_not_found", f"store {slug!r} has no such version")
        return v

    def ms_redact_version(self, p: Principal, slug: str, seq: int, idem: IdempotencyRequest | None = None) -> AnyRow:
        """Redact the version of ``seq`` (``redact_version``'s rules: admin; 409
        ``current_version`` for the current version of a live record) and return its row."""
        v = self.ms_get_version(p, slug, seq, with_content=False)
        self.records.redact_version(p, slug, v.record_id, v.version, idem)
        return self.ms_get_version(p, slug, seq, with_content=True)

    def ms_create_memory(
        self, p: Principal, slug: str, path: str, content: str, idem: IdempotencyRequest | None = None
    ) -> Reply:
        """``create_record`` with the store's type rules (201 [Record])."""
        return self.records.create_record(p, slug, RecordCreate(path=path, content=content), idem)


# ---------------------------------------------------------------- ids and shapes

STORE_PREFIX = "memstore_"


def store_id(slug: str) -> str:
    """``memstore_<slug>``: reversible (``store_slug``), stable for the store's life."""
    return STORE_PREFIX + slug


def store_slug(memory_store_id: str) -> str | None:
    """The slug of a ``memstore_…`` id, or None when it is not one."""
    if not memory_store_id.startswith(STORE_PREFIX):
        return None
    return memory_store_id[len(STORE_PREFIX):] or None


def store_metadata(st: AnyRow | StoreRow) -> dict[str, str]:
    """The store's metadata (``{}`` when never set)."""
    raw = getattr(st, "metadata_json", None)
    return json.loads(raw) if raw else {}


def shown_slug(st: AnyRow | StoreRow, p: Principal) -> str:
    """What ``p`` calls the store of row ``st`` on this API: its name, or for the root admin
    over every account its reference (``keys.ref``: ``notes~bravo`` for ``bravo``'s
    ``notes``, the name for a store of ``default``), so two accounts' stores of one name
    have two ids. An account admin and a workspace token never see a ``~``."""
    name = keys.public(st.slug)
    return keys.ref(name, st.account or DEFAULT_ACCOUNT) if p.is_root else name


def store_out(st: AnyRow | StoreRow, p: Principal) -> MemoryStoreOut:
    """``MemoryStoreOut`` of a store row as ``p`` sees it: the id from ``shown_slug``,
    ``name`` the store's name when never set, ``updated_at`` the creation time when never
    changed."""
    return MemoryStoreOut(
        id=store_id(shown_slug(st, p)), name=st.name or keys.public(st.slug), description=st.description or "",
        metadata=store_metadata(st), created_at=st.created_at,
        updated_at=st.updated_at or st.created_at, archived_at=st.archived_at,
    )


__all__ = [
    "ListedItem", "MemoryStoresService", "VERSION_OPERATIONS", "slug_for_name", "store_id", "store_metadata",
    "store_out", "store_slug", "shown_slug", "path_prefix_end",
]
