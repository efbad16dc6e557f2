"""The console's overview, store and workspace pages and actions (one handler each, called
through ``web.view`` with a ``Ctx``): the home page and store creation, a store's listing,
search and settings, the workspaces with their attachments and the prompt preview.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pydantic import ValidationError
from starlette.responses import Response

from memfuse.content import INDEX_PATH, RECORD_TYPES, ContentError
from memfuse.defs import SEARCH_QUERY_MAX, parse_byte_size, parse_count
from memfuse.models import AttachmentPut, Store, StoreCreate, StoreUpdate, WorkspaceCreate
from memfuse.server.console import render
from memfuse.server.console.forms import field_text
from memfuse.server.console.pages import can_write, Ctx, PAGE_SIZE, redirect_to, render_page
from memfuse.server.service import ServiceError

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- overview, stores


def home(ctx: Ctx) -> Response:
    """GET ``/``: the stores with usage and limits (admin: also create a store)."""
    p = ctx.principal
    workspaces = ctx.svc.list_workspaces(p) if p.is_admin else []
    accounts = ctx.svc.list_accounts(p) if p.is_root else []  # the root's overview: each account's usage
    return render_page(ctx, "home.html", workspaces=workspaces, errors={}, form={}, account=_account(ctx),
                       all_accounts=accounts)


def _account(ctx: Ctx) -> Any:
    """The [Account] (usage and quotas) an admin acting in one account sees on the overview;
    None for the root admin over every account and for a workspace token."""
    p = ctx.principal
    if p.workspace is None and p.account is not None:
        return ctx.svc.get_account(p, p.account)
    return None


def create_store(ctx: Ctx) -> Response:
    """POST ``/stores`` (admin): create a store."""
    form = {k: ctx.form.get(k, "") for k in ("slug", "description", "default_type")}
    try:
        body = StoreCreate.model_validate({  # default_type validated as the model's Literal
            "slug": form["slug"].strip(), "description": field_text(ctx.form, "description"),
            "default_type": form["default_type"] or "project"})
    except ContentError as err:
        workspaces = ctx.svc.list_workspaces(ctx.principal)
        return render_page(ctx, "home.html", status=422, workspaces=workspaces, errors={"description": str(err)},
                     form=form)
    except ValidationError as err:
        errors = {".".join(str(x) for x in e["loc"]): e["msg"] for e in err.errors()}
        workspaces = ctx.svc.list_workspaces(ctx.principal)
        return render_page(ctx, "home.html", status=422, workspaces=workspaces, errors=errors, form=form)
    try:
        ctx.svc.create_store(ctx.principal, body)
    except ServiceError as err:
        if err.status != 409:
            raise
        workspaces = ctx.svc.list_workspaces(ctx.principal)
        return render_page(ctx, "home.html", status=409, workspaces=workspaces, errors={"slug": err.detail}, form=form)
    return redirect_to(ctx.url("stores", body.slug, msg="store_created"))


def store_page(ctx: Ctx) -> Response:
    """GET ``/stores/{store}``: ``MEMORY.md`` first, then the records (path, type, size, last
    change), filtered by type, path and content on the server; (admin) the store's settings
    form."""
    return _store_view(ctx, ctx.path("store"))


# the settings form's fields: name → how to read it (a ValueError is the field's message)
_SETTINGS_FIELDS: dict[str, Callable[[str], Any]] = {
    "max_record_bytes": parse_byte_size,
    "max_store_bytes": parse_byte_size,
    "max_records": parse_count,
    "max_history_bytes": parse_byte_size,
    "max_history_versions": parse_count,
    "history_min_age_s": lambda text: 0 if text.strip() in ("0", "") else parse_count(text),
}


def _settings_values(store: Store) -> dict[str, str]:
    return {"description": store.description, "default_type": store.default_type,
            **{k: str(getattr(store, k)) for k in _SETTINGS_FIELDS}}


def store_settings(ctx: Ctx) -> Response:
    """POST ``/stores/{store}/settings`` (admin): update the description, default type and
    limits (``Service.update_store``, like ``memfuse store update``). Sizes take ``1048576``,
    ``512K``, ``1MiB``...; every field is checked first and a bad one re-shows the page (422)
    with the reason by the field and nothing changed; a store whose settings are unchanged
    is not written."""
    slug = ctx.path("store")
    store = ctx.svc.get_store(ctx.principal, slug)
    if not ctx.principal.is_admin:
        raise ServiceError(403, "forbidden", "only an admin token may change a store's settings")
    values = {k: ctx.form.get(k, "") for k in ("description", "default_type", *_SETTINGS_FIELDS)}
    errors: dict[str, str] = {}
    update: dict[str, Any] = {}
    try:
        update["description"] = field_text(ctx.form, "description").strip()
    except ContentError as err:
        errors["description"] = str(err)
    if values["default_type"] not in RECORD_TYPES:
        errors["default_type"] = f"choose one of {', '.join(RECORD_TYPES)}"
    else:
        update["default_type"] = values["default_type"]
    for name, parse in _SETTINGS_FIELDS.items():
        if name.startswith(("max_history", "history_")) and name not in ctx.form:
            continue  # a form of an earlier release: the history budget is left as it is
        try:
            update[name] = parse(values[name])
        except ValueError as err:
            errors[name] = str(err)
    if (not errors and update["max_record_bytes"] > update["max_store_bytes"]
            and (update["max_record_bytes"], update["max_store_bytes"])
            != (store.max_record_bytes, store.max_store_bytes)):
        errors["max_record_bytes"] = "a record cannot be larger than the whole store may hold"
    if errors:
        return _store_view(ctx, slug, status=422, settings_errors=errors, settings_values=values)
    changed = {k: v for k, v in update.items() if getattr(store, k) != v}
    if not changed:
        return redirect_to(ctx.url("stores", slug, msg="settings_unchanged"))
    try:
        ctx.svc.update_store(ctx.principal, slug, StoreUpdate(**changed))
    except ServiceError as err:
        if err.code != "invalid_limit":
            raise
        errors["max_record_bytes"] = err.detail
        return _store_view(ctx, slug, status=422, settings_errors=errors, settings_values=values)
    log.info("console: store %s settings changed (%s)", slug, ", ".join(sorted(changed)))
    return redirect_to(ctx.url("stores", slug, msg="settings_saved"))


def _ranked_hits(ctx: Ctx, slug: str) -> dict[str, Any] | None:
    """The store page's ranked search (``?rank=WORDS[&rcursor=…]``): a page of hits best
    first (``Service.search`` with ``order="relevance"``), or its refusal; None without
    ``rank``."""
    q = ctx.q("rank")
    if not q:
        return None
    try:
        page = ctx.svc.search(ctx.principal, slug, q[:SEARCH_QUERY_MAX], order="relevance",
                              cursor=ctx.q("rcursor") or None, limit=min(PAGE_SIZE, 100), max_lines=0)
    except ServiceError as err:
        if err.status != 422:
            raise
        return {"q": q, "hits": [], "error": err.detail, "next_url": None}
    next_url = (ctx.url("stores", slug, rank=q, rcursor=page.next_cursor) if page.next_cursor else None)
    return {"q": q, "hits": page.hits, "error": None, "next_url": next_url}


def _store_view(ctx: Ctx, slug: str, *, status: int = 200, settings_errors: dict[str, str] | None = None,
                settings_values: dict[str, str] | None = None) -> Response:
    svc, p = ctx.svc, ctx.principal
    store = svc.get_store(p, slug)
    rtype = ctx.q("type") or None
    if rtype is not None and rtype not in RECORD_TYPES:
        rtype = None
    path_q, text_q, cursor = ctx.q("path") or None, ctx.q("text") or None, ctx.q("cursor") or None
    page = svc.search_records(p, slug, type=rtype, path_contains=path_q, text=text_q, cursor=cursor,
                              limit=PAGE_SIZE)
    index_page = svc.list_records(p, slug, path=INDEX_PATH, limit=1, with_content=True)
    index = index_page.records[0] if index_page.records else None
    rendered = render.render_content(index.path, index.content or "") if index else None
    next_url = (ctx.url("stores", slug, type=rtype, path=path_q, text=text_q, cursor=page.next_cursor)
                if page.next_cursor else None)
    ranked = _ranked_hits(ctx, slug)
    report = svc.index_report(p, slug)
    return render_page(
        ctx, "store.html", current_store=slug, store=store, records=page.records, index=index,
        index_rendered=rendered, filters={"type": rtype or "", "path": path_q or "", "text": text_q or ""},
        filtered=bool(rtype or path_q or text_q), next_url=next_url, first_page=cursor is None,
        can_write=can_write(ctx, slug), live_url=ctx.url("stores", slug, "live", after=page.seq),
        ranked=ranked, report=report, status=status, settings_errors=settings_errors or {},
        settings_values=settings_values or _settings_values(store), settings_open=bool(settings_errors),
    )


# ---------------------------------------------------------------- workspaces


def workspaces_page(ctx: Ctx) -> Response:
    """GET/POST ``/workspaces``: the workspaces (admin; create one); a workspace token is sent
    to its own workspace."""
    p = ctx.principal
    if not p.is_admin:
        assert p.workspace is not None  # a workspace token
        return redirect_to(ctx.url("workspaces", p.workspace_name or ""))
    errors: dict[str, str] = {}
    values = {"name": "", "default_store": "on"}
    status = 200
    if ctx.request.method == "POST":
        values = {"name": ctx.form.get("name", "").strip(), "default_store": ctx.form.get("default_store", "")}
        try:
            body = WorkspaceCreate(name=values["name"], default_store=bool(values["default_store"]))
            ctx.svc.create_workspace(p, body)
        except ValidationError as err:
            errors["name"] = "; ".join(e["msg"] for e in err.errors())
            status = 422
        except ServiceError as err:
            if err.status != 409:
                raise
            errors["name"], status = err.detail, 409
        else:
            return redirect_to(ctx.url("workspaces", body.name, msg="workspace_created"))
    rows = []
    for w in ctx.svc.list_workspaces(p):
        # the root admin over every account: each workspace's name resolved in its account
        # (two accounts may each have a workspace ``agent``, memfuse.server.keys)
        asker = replace(p, account=w.account) if p.is_root else p
        rows.append({"workspace": w, "attachments": ctx.svc.list_attachments(asker, w.name)})
    return render_page(ctx, "workspaces.html", status=status, rows=rows, errors=errors, values=values)


def workspace_page(ctx: Ctx) -> Response:
    """GET ``/workspaces/{ws}``: its attachments and access; admin: attach, detach, switch."""
    ws = ctx.path("ws")
    p = ctx.principal
    attachments = ctx.svc.list_attachments(p, ws)
    candidates = []
    if p.is_admin:  # the stores of the workspace's account not attached to it yet
        account = next((w.account for w in ctx.svc.list_workspaces(p) if w.name == ws), None)
        attached = {a.store.slug for a in attachments}
        candidates = [s for s in ctx.svc.list_stores(p) if s.account == account and s.slug not in attached]
    return render_page(ctx, "workspace.html", ws=ws, attachments=attachments, candidates=candidates)


def attach(ctx: Ctx) -> Response:
    """POST ``/workspaces/{ws}/attachments`` (admin): attach a store or change its access."""
    ws = ctx.path("ws")
    slug = ctx.form.get("store", "")
    try:
        body = AttachmentPut.model_validate({  # access validated as the model's enum
            "access": ctx.form.get("access", "read_write"), "instructions": field_text(ctx.form, "instructions")})
    except (ValidationError, ContentError) as err:
        raise ServiceError(422, "validation_error", f"bad attachment: {err}") from None
    ctx.svc.put_attachment(ctx.principal, ws, slug, body)
    return redirect_to(ctx.url("workspaces", ws, msg="attached"))


def detach(ctx: Ctx) -> Response:
    """POST ``/workspaces/{ws}/attachments/{store}/detach`` (admin)."""
    ws, slug = ctx.path("ws"), ctx.path("store")
    ctx.svc.delete_attachment(ctx.principal, ws, slug)
    return redirect_to(ctx.url("workspaces", ws, msg="detached"))


def context_page(ctx: Ctx) -> Response:
    """GET ``/workspaces/{ws}/context``: exactly the prompt block the workspace's agents get
    (``Service.context``, as ``GET /v1/workspaces/{ws}/context``), omission markers marked."""
    ws = ctx.path("ws")
    mount_root = ctx.q("mount_root") or ctx.svc.mount_root  # memfuse dev: its real mountpoint
    max_bytes = None
    if ctx.q("max_bytes"):
        try:
            max_bytes = int(ctx.q("max_bytes"))
        except ValueError:
            raise ServiceError(422, "validation_error", "max_bytes must be a number") from None
    text = ctx.svc.context(ctx.principal, ws, mount_root, max_bytes)
    lines = render.context_lines(text)
    return render_page(ctx, "context.html", ws=ws, text=text, lines=lines, mount_root=mount_root,
                 max_bytes=ctx.q("max_bytes"), size=len(text.encode()), markers=sum(1 for m, _ in lines if m))
