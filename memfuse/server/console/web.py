"""The console's pages and actions: a Starlette app mounted at ``/ui`` of the control plane.

Every page and action authenticates like the API (``Service.authenticate``: session cookie or
``Authorization: Bearer``) and calls ``Service``'s public methods, so a workspace token sees
and changes exactly what its attachments allow (a read-only attachment gets no edit buttons,
and the service refuses a POST with 403 ``read_only``). Pages are server-rendered Jinja2
templates; every action is a plain HTML form (POST, then a redirect to a page: no
JavaScript needed). The only script, ``static/console.js``, reloads a page that shows a store
when the store changes (server-sent events from ``/ui/stores/{store}/live``, fed by the
store's change feed).

Handlers are ``async`` only to read the request; the work (database, Markdown, diffs,
templates) runs in a worker thread. Errors become HTML pages: a refusal of the service keeps
its status (404 for an unknown store or record, 403 read-only, ...), an unexpected exception
is logged and shown as a 500 page without details.

The module is over 800 lines on purpose: one handler per page or action, each short, read side
by side with the templates in ``templates/`` and with docs/CONSOLE.md; the rendering helpers
(``render``), forms (``forms``) and sessions (``session``) already live apart.
"""
from __future__ import annotations

import functools
import json
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any
from urllib.parse import quote, urlencode

import anyio
from jinja2 import Environment, PackageLoader, select_autoescape
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from memfuse.content import INDEX_PATH, RECORD_TYPES, ContentError, is_index
from memfuse.defs import INT64_MAX, SEARCH_QUERY_MAX, parse_byte_size, parse_count
from memfuse.models import (
    Access,
    AttachmentPut,
    RecordCreate,
    RecordUpdate,
    Restore,
    StoreCreate,
    StoreUpdate,
    WorkspaceCreate,
)
from memfuse.server.console import render
from memfuse.server.console.forms import FormError, field_text, read_form
from memfuse.server.console.session import (
    CSRF_FIELD,
    Credentials,
    LoginCodes,
    SecurityHeaders,
    cookie_args,
    cookie_names,
    csrf_token,
    request_credentials,
    same,
)
from memfuse.server.service import Principal, Service, ServiceError
from memfuse.server import wakeups

log = logging.getLogger(__name__)

INSTANCE = "console"  # recorded in the actor of a workspace token's writes: ws:<ws>/console
PAGE_SIZE = 100  # records per page of a store listing
LIVE_STREAM_SECONDS = 300.0  # an event stream ends after this long; EventSource reconnects
LIVE_KEEPALIVE_SECONDS = 15.0

_MESSAGES = {  # ?msg= codes → fixed text (no user-supplied text is ever echoed from a URL)
    "saved": "Saved: a new version was written.",
    "unchanged": "Nothing to save: the content and type are the same as the current version.",
    "created": "Created.",
    "restored": "Restored: a new version with that content was written.",
    "deleted": "Deleted (a deleted version is kept; restore it from the history).",
    "redacted": "Redacted: the version's content was removed; its audit fields are kept.",
    "attached": "Attachment saved.",
    "detached": "Detached.",
    "store_created": "Store created.",
    "settings_saved": "Store settings saved.",
    "settings_unchanged": "Nothing to save: the settings are as they were.",
    "workspace_created": "Workspace created.",
    "cleared": "Cleared: MEMORY.md is now empty (the old text is kept in its history).",
    "logged_out": "Logged out.",
}


class _LoginNeeded(Exception):
    """No (valid) credentials on a page request: redirect to the login page."""

    def __init__(self, reason: str = "") -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class Ctx:
    """What a view gets: the service, who calls, the request's parameters and form."""

    svc: Service
    request: Request
    principal: Principal
    creds: Credentials
    form: dict[str, str] = field(default_factory=dict)
    _sidebar: list[dict[str, Any]] | None = None

    @property
    def base(self) -> str:
        return self.request.scope.get("root_path", "")

    @property
    def csrf(self) -> str:
        return csrf_token(self.creds.secret)

    def path(self, name: str) -> str:
        return self.request.path_params[name]

    def q(self, name: str, default: str = "") -> str:
        return self.request.query_params.get(name, default)

    def url(self, *parts: str, **query: Any) -> str:
        """``<base>/<part>/<part>?query``; parts are percent-quoted (slashes inside kept)."""
        path = "/".join(quote(str(p), safe="/") for p in parts)
        qs = urlencode({k: v for k, v in query.items() if v not in (None, "")})
        return f"{self.base}/{path}" + (f"?{qs}" if qs else "")


# ---------------------------------------------------------------- templates

_env = Environment(
    loader=PackageLoader("memfuse.server.console", "templates"),
    autoescape=select_autoescape(["html"], default=True),
    trim_blocks=True,
    lstrip_blocks=True,
)
_env.filters["bytes"] = render.human_bytes
_env.filters["utc"] = render.utc
_env.filters["iso"] = render.iso
_env.filters["wbr"] = render.path_breaks


def _sidebar(ctx: Ctx) -> list[dict[str, Any]]:
    """The stores a principal sees, with usage and limits: every store for admin, the
    attached ones (with their access) for a workspace token. Read once per request."""
    if ctx._sidebar is None:
        p = ctx.principal
        if p.is_admin:
            ctx._sidebar = [{"store": s, "access": None} for s in ctx.svc.list_stores(p)]
        else:
            ctx._sidebar = [{"store": a.store, "access": a.access.value}
                            for a in ctx.svc.list_attachments(p, p.workspace)]
    return ctx._sidebar


def _page(ctx: Ctx, template: str, status: int = 200, **values: Any) -> HTMLResponse:
    stores = _sidebar(ctx)
    values.setdefault("current_store", None)
    html = _env.get_template(template).render(
        base=ctx.base,
        url=ctx.url,
        csrf=ctx.csrf,
        csrf_field=CSRF_FIELD,
        principal=ctx.principal,
        sidebar=stores,
        # the account switch of the root admin: every account (read once per page)
        accounts=(ctx.svc.account_slugs(ctx.principal)
                  if ctx.principal.root_token and ctx.principal.workspace is None else []),
        message=_MESSAGES.get(ctx.q("msg")),
        record_types=RECORD_TYPES,
        **values,
    )
    return HTMLResponse(html, status_code=status)


def _bare(request: Request, template: str, status: int = 200, **values: Any) -> HTMLResponse:
    """A page without a session (login, errors before authentication)."""
    html = _env.get_template(template).render(base=request.scope.get("root_path", ""), principal=None,
                                              sidebar=[], **values)
    return HTMLResponse(html, status_code=status)


def _redirect(url: str) -> RedirectResponse:
    return RedirectResponse(url, status_code=303)


def _can_write(ctx: Ctx, slug: str) -> bool:
    if ctx.principal.is_admin:
        return True
    return any(s["store"].slug == slug and s["access"] == Access.read_write.value for s in _sidebar(ctx))


# ---------------------------------------------------------------- request plumbing


def _safe_next(base: str, target: str | None) -> str:
    """A same-console path to return to after login (never another host: no ``//``, no
    scheme, no backslash)."""
    if target and target.startswith(base + "/") and not target.startswith("//") and "\\" not in target:
        return target
    return base + "/"


def _secure(request: Request) -> bool:
    """The request came over TLS (directly, or as a trusted proxy says: the scheme is set by
    ``memfuse.server.proxies.TrustedProxyScheme``)."""
    return request.url.scheme == "https"


async def _authenticate(svc: Service, request: Request) -> tuple[Principal, Credentials]:
    """The request's principal and credentials (a session cookie or a bearer token); marks the
    request authenticated for the front door (``memfuse.authenticated`` in the scope: its
    connection leaves the per-address cap of ``memfuse.server.gate.Connections`` whatever
    the answer, e.g. a 429 past the token's live pages). Raises ``_LoginNeeded``,
    ``ServiceError`` 401."""
    creds = request_credentials(dict(request.headers), request.cookies, _secure(request))
    if creds is None:
        raise _LoginNeeded()
    if creds.via_cookie:
        try:
            p = await anyio.to_thread.run_sync(svc.session_principal, creds.session, INSTANCE)
        except ServiceError:
            raise _LoginNeeded("Your session ended; log in again.") from None
    else:
        p = svc.authenticate_cached(creds.token, INSTANCE)
        if p is None:
            p = await anyio.to_thread.run_sync(svc.authenticate, creds.token, INSTANCE)
        account = request.headers.get("x-memfuse-account")
        if account:  # a bearer caller naming its account, as on the API (docs/API.md "Accounts")
            p = await anyio.to_thread.run_sync(svc.act_in_account, p, account)
    request.scope["memfuse.authenticated"] = True
    return p, creds


def _error_page(request: Request, status: int, title: str, detail: str, principal_ctx: Ctx | None = None) -> Response:
    if principal_ctx is not None:
        try:
            return _page(principal_ctx, "error.html", status=status, title=title, detail=detail)
        except Exception:  # the sidebar itself failed: show the bare page
            log.exception("console: error page with sidebar failed")
    return _bare(request, "error.html", status=status, title=title, detail=detail)


_TITLES = {400: "Bad request", 401: "Not logged in", 403: "Not allowed", 404: "Not found", 409: "Conflict",
           412: "Changed meanwhile", 413: "Too large", 415: "Unsupported form", 422: "Refused",
           503: "Unavailable", 507: "Store full"}


def view(svc: Service, fn: Callable[[Ctx], Response], *, post: bool = False) -> Callable[[Request], Awaitable[Response]]:
    """Wrap a sync view: authenticate, read and CSRF-check the form of a POST, run ``fn`` in a
    worker thread, and turn refusals into HTML error pages."""

    async def endpoint(request: Request) -> Response:
        try:
            p, creds = await _authenticate(svc, request)
        except _LoginNeeded as need:
            if request.method != "GET":
                return _bare(request, "error.html", status=401, title="Not logged in",
                             detail="Log in first (your session ended).")
            base = request.scope.get("root_path", "")
            target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            resp = _redirect(f"{base}/login?" + urlencode({"next": target}))
            if need.reason:
                _forget_session(request, resp)
            return resp
        except ServiceError as err:
            return _bare(request, "error.html", status=err.status, title=_TITLES.get(err.status, "Error"),
                         detail=err.detail)
        ctx = Ctx(svc, request, p, creds)
        if request.method == "POST":
            try:
                ctx.form = await read_form(request)
            except FormError as err:
                return _error_page(request, err.status, _TITLES.get(err.status, "Error"), err.detail)
            if creds.via_cookie and not same(ctx.form.get(CSRF_FIELD), ctx.csrf):
                log.warning("console: POST %s refused: CSRF token missing or wrong", request.url.path)
                return _error_page(request, 403, "Not allowed",
                                   "The form's CSRF token is missing or stale: reload the page and try again.")
        try:
            return await anyio.to_thread.run_sync(fn, ctx)
        except ServiceError as err:
            if err.status >= 500:
                log.warning("console: %s %s: %s %s", request.method, request.url.path, err.status, err.code)
            ctx._sidebar = None  # the failed write may have changed usage
            return await anyio.to_thread.run_sync(
                _error_page, request, err.status, _TITLES.get(err.status, "Error"), err.detail, ctx
            )
        except Exception:
            log.exception("console: unexpected error in %s %s", request.method, request.url.path)
            return _bare(request, "error.html", status=500, title="Server error",
                         detail="Something went wrong on the server; it was logged.")

    functools.update_wrapper(endpoint, fn)
    return endpoint


# ---------------------------------------------------------------- login


def _cookie_args(request: Request) -> dict[str, Any]:
    return cookie_args(_secure(request), request.scope.get("root_path", ""))


def _forget_session(request: Request, resp: Response) -> None:
    """Make the browser drop the session cookie of this kind of request."""
    args = _cookie_args(request)
    resp.delete_cookie(cookie_names(_secure(request))[0], path=args["path"], secure=args["secure"],
                       httponly=True, samesite="strict")


async def _start_session(svc: Service, request: Request, token: str, target: str) -> Response:
    """Log in with ``token``: a new session (``Service.create_session``), its cookie, and a
    redirect to ``target``. Raises ``ServiceError`` 401 when the token is not valid."""
    session, p, ends = await anyio.to_thread.run_sync(svc.create_session, token, INSTANCE)
    log.info("console: login (%s)", "admin" if p.is_admin else f"workspace {p.workspace}")
    resp = _redirect(target)
    max_age = max(1, int((ends - datetime.now(timezone.utc)).total_seconds()))
    resp.set_cookie(cookie_names(_secure(request))[0], session, max_age=max_age, **_cookie_args(request))
    return resp


def login_page(svc: Service) -> Callable[[Request], Awaitable[Response]]:
    """GET/POST ``/login``: the token form (double-submit CSRF before any session)."""

    async def endpoint(request: Request) -> Response:
        base = request.scope.get("root_path", "")
        login_cookie = cookie_names(_secure(request))[1]
        nxt = _safe_next(base, request.query_params.get("next"))
        nonce = request.cookies.get(login_cookie) or secrets.token_urlsafe(24)
        error = ""
        status = 200
        if request.method == "POST":
            try:
                form = await read_form(request)
            except FormError as err:
                return _bare(request, "error.html", status=err.status, title="Bad request", detail=err.detail)
            nxt = _safe_next(base, form.get("next"))
            token = form.get("token", "").strip()
            if not same(form.get(CSRF_FIELD), request.cookies.get(login_cookie)):
                error, status = "The login form expired: try again.", 403
            elif not token:
                error, status = "Paste a token.", 401
            else:
                try:
                    resp = await _start_session(svc, request, token, nxt)
                except ServiceError as err:
                    if err.status != 401:
                        raise
                    error, status = "That token is not valid here.", 401
                else:
                    args = _cookie_args(request)
                    resp.delete_cookie(login_cookie, path=args["path"], secure=args["secure"],
                                       httponly=True, samesite="strict")
                    return resp
        resp = _bare(request, "login.html", status=status, next=nxt, nonce=nonce, error=error,
                     csrf_field=CSRF_FIELD, message=_MESSAGES.get(request.query_params.get("msg", "")),
                     notice=request.query_params.get("notice") == "expired")
        resp.set_cookie(login_cookie, nonce, **_cookie_args(request))
        return resp

    return endpoint


def login_code(svc: Service, codes: LoginCodes) -> Callable[[Request], Awaitable[Response]]:
    """GET ``/login/{code}``: a one-time login link (``memfuse dev`` prints one)."""

    async def endpoint(request: Request) -> Response:
        base = request.scope.get("root_path", "")
        token = codes.redeem(request.path_params["code"])
        if token is None:
            return _redirect(f"{base}/login?notice=expired")
        try:
            resp = await _start_session(svc, request, token, base + "/")
        except ServiceError:
            return _redirect(f"{base}/login?notice=expired")
        log.info("console: login with a one-time link")
        return resp

    return endpoint


def switch_account(ctx: Ctx) -> Response:
    """POST ``/account`` (root admin, console session): act in the account of the form's
    ``account`` from now on (empty: every account); back to the overview."""
    if not ctx.creds.session:
        raise ServiceError(403, "forbidden", "switching accounts needs a console session")
    ctx.svc.set_session_account(ctx.principal, ctx.creds.session, ctx.form.get("account") or None)
    log.info("console: account switched to %s", ctx.form.get("account") or "(all)")
    return _redirect(ctx.url(""))


def logout(ctx: Ctx) -> Response:
    """POST ``/logout``: end the session on the server (its cookie is refused from now on, on
    every replica) and make the browser forget the cookie."""
    if ctx.creds.session:
        ctx.svc.end_session(ctx.creds.session)
        log.info("console: logout")
    resp = _redirect(ctx.url("login", msg="logged_out"))
    _forget_session(ctx.request, resp)
    return resp


# ---------------------------------------------------------------- overview, stores


def home(ctx: Ctx) -> Response:
    """GET ``/``: the stores with usage and limits (admin: also create a store)."""
    workspaces = ctx.svc.list_workspaces(ctx.principal) if ctx.principal.is_admin else []
    return _page(ctx, "home.html", workspaces=workspaces, errors={}, form={}, account=_account(ctx))


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
        body = StoreCreate(slug=form["slug"].strip(), description=field_text(ctx.form, "description"),
                           default_type=form["default_type"] or "project")
    except ContentError as err:
        workspaces = ctx.svc.list_workspaces(ctx.principal)
        return _page(ctx, "home.html", status=422, workspaces=workspaces, errors={"description": str(err)},
                     form=form)
    except ValidationError as err:
        errors = {".".join(str(x) for x in e["loc"]): e["msg"] for e in err.errors()}
        workspaces = ctx.svc.list_workspaces(ctx.principal)
        return _page(ctx, "home.html", status=422, workspaces=workspaces, errors=errors, form=form)
    try:
        ctx.svc.create_store(ctx.principal, body)
    except ServiceError as err:
        if err.status != 409:
            raise
        workspaces = ctx.svc.list_workspaces(ctx.principal)
        return _page(ctx, "home.html", status=409, workspaces=workspaces, errors={"slug": err.detail}, form=form)
    return _redirect(ctx.url("stores", body.slug, msg="store_created"))


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


def _settings_values(store) -> dict[str, str]:
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
        return _redirect(ctx.url("stores", slug, msg="settings_unchanged"))
    ctx.svc.update_store(ctx.principal, slug, StoreUpdate(**changed))
    log.info("console: store %s settings changed (%s)", slug, ", ".join(sorted(changed)))
    return _redirect(ctx.url("stores", slug, msg="settings_saved"))


def _ranked_hits(ctx: Ctx, slug: str) -> dict | None:
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
    return _page(
        ctx, "store.html", current_store=slug, store=store, records=page.records, index=index,
        index_rendered=rendered, filters={"type": rtype or "", "path": path_q or "", "text": text_q or ""},
        filtered=bool(rtype or path_q or text_q), next_url=next_url, first_page=cursor is None,
        can_write=_can_write(ctx, slug), live_url=ctx.url("stores", slug, "live", after=page.seq),
        ranked=ranked, report=report, status=status, settings_errors=settings_errors or {},
        settings_values=settings_values or _settings_values(store), settings_open=bool(settings_errors),
    )


# ---------------------------------------------------------------- records


def _store_seq(ctx: Ctx, slug: str) -> int:
    """The store's change-feed position now (where a page's live updates start)."""
    return ctx.svc.list_records(ctx.principal, slug, limit=1).seq


def _record_and_versions(ctx: Ctx, slug: str, rid: str):
    rec = ctx.svc.get_record(ctx.principal, slug, rid, with_content=True)
    versions = ctx.svc.list_versions(ctx.principal, slug, rid)
    return rec, versions


def record_page(ctx: Ctx) -> Response:
    """GET ``/stores/{store}/records/{id}[?version=N]``: content (Markdown rendered safely),
    type, path, history with restore / redact, a diff form, edit and delete."""
    slug, rid = ctx.path("store"), ctx.path("rid")
    seq = _store_seq(ctx, slug)  # before the reads: a change after them reaches the page
    rec, versions = _record_and_versions(ctx, slug, rid)
    shown = None
    if ctx.q("version"):
        try:
            n = int(ctx.q("version"))
        except ValueError:
            raise ServiceError(404, "version_not_found", "no such version") from None
        shown = ctx.svc.get_version(ctx.principal, slug, rid, n)
    if shown is not None:
        text, path = shown.content, shown.path
    else:
        text, path = rec.content, rec.path
    rendered = render.render_content(path, text) if text is not None else None
    prev = versions[-2].version if len(versions) > 1 else versions[-1].version
    return _page(
        ctx, "record.html", current_store=slug, rec=rec, versions=list(reversed(versions)), shown=shown,
        rendered=rendered, can_write=_can_write(ctx, slug), is_index=is_index(rec.path),
        diff_a=prev, diff_b=versions[-1].version,
        live_url=ctx.url("stores", slug, "live", after=seq),
    )


def diff_page(ctx: Ctx) -> Response:
    """GET ``/stores/{store}/records/{id}/diff?a=N&b=M[&view=split]``: the diff of two
    versions with line numbers and changed words marked, unified (default) or side by side."""
    slug, rid = ctx.path("store"), ctx.path("rid")
    rec, versions = _record_and_versions(ctx, slug, rid)
    try:
        a, b = int(ctx.q("a")), int(ctx.q("b"))
    except ValueError:
        raise ServiceError(400, "validation_error", "choose two versions to compare") from None
    view = "split" if ctx.q("view") == "split" else "unified"
    va = ctx.svc.get_version(ctx.principal, slug, rid, a)
    vb = ctx.svc.get_version(ctx.principal, slug, rid, b)
    d = None
    redacted = [v.version for v in (va, vb) if v.content is None]
    if not redacted:
        d = render.line_diff(va.content or "", vb.content or "")
    return _page(ctx, "diff.html", current_store=slug, rec=rec, versions=list(reversed(versions)), va=va, vb=vb,
                 d=d, view=view, redacted=redacted)


def consolidations_page(ctx: Ctx) -> Response:
    """GET ``/stores/{store}/consolidations``: the store's consolidation jobs, newest first
    (docs/API.md "Consolidation jobs")."""
    slug = ctx.path("store")
    store = ctx.svc.get_store(ctx.principal, slug)
    jobs = ctx.svc.list_consolidations(ctx.principal, slug)
    return _page(ctx, "consolidations.html", current_store=slug, store=store, jobs=jobs)


def consolidation_page(ctx: Ctx) -> Response:
    """GET ``/consolidations/{job}``: one job, and for a completed one the diff of each file
    it wrote or deleted against the input it read (unified; the history diff's rendering).
    Everything from the store or the model is untrusted text, escaped by the template."""
    job, changes = ctx.svc.consolidation_diff(ctx.principal, ctx.path("job"))
    files = []
    for c in changes:
        d = None if c["gone"] else render.line_diff(c["old"] or "", c["new"] or "")
        files.append({**c, "diff": d})
    return _page(ctx, "consolidation.html", current_store=job.store, job=job, files=files)


def _type_choice(ctx: Ctx, required: bool) -> tuple[str | None, str | None]:
    """The ``type`` field: (type or None, error)."""
    t = ctx.form.get("type", "").strip()
    if not t:
        return None, ("Choose a type." if required else None)
    if t not in RECORD_TYPES:
        return None, f"type {t!r} is not one of {', '.join(RECORD_TYPES)}"
    return t, None


_FIELD_OF = {  # problem code → the form field its reason is shown next to
    "invalid_path": "path", "path_too_long": "path", "path_exists": "path",
    "invalid_type": "type",
}


def _edit_form(ctx: Ctx, slug: str, *, rec=None, status: int = 200, content: str | None = None,
               errors: dict[str, str] | None = None, stale: dict[str, Any] | None = None,
               settings: bool = False, values: dict[str, str] | None = None) -> Response:
    # The notice watches for a change of the record after the version the form is based on.
    return _page(
        ctx, "edit.html", status=status, current_store=slug, rec=rec, settings=settings,
        content=content if content is not None else (rec.content if rec is not None else ""),
        errors=errors or {}, stale=stale, values=values or {},
        is_index=rec is not None and is_index(rec.path), live_mode="notice",
        live_url=ctx.url("stores", slug, "live", after=rec.seq, record=rec.id) if rec is not None else None,
    )


def _write_error(err: ServiceError) -> tuple[str, str] | None:
    """(field, reason) for a refusal of the content the person typed, else None."""
    if err.code in _FIELD_OF:
        return _FIELD_OF[err.code], err.detail
    if err.code in ("invalid_content", "secret_detected", "record_too_large", "store_full"):
        return "content", err.detail
    return None


def edit_page(ctx: Ctx) -> Response:
    """GET/POST ``/stores/{store}/records/{id}/edit``. The form carries the sha256 and version
    it was based on; the save sends ``If-Match``, so a change made meanwhile is never
    overwritten silently: the page says so, shows what changed (diff) and keeps the text."""
    slug, rid = ctx.path("store"), ctx.path("rid")
    settings = ctx.q("view") == "settings"
    svc, p = ctx.svc, ctx.principal
    rec = svc.get_record(p, slug, rid, with_content=True)
    if rec.deleted and ctx.request.method == "GET":
        raise ServiceError(404, "record_not_found", "the record is deleted; restore a version from its history first")
    if ctx.request.method == "GET":
        if not _can_write(ctx, slug):
            raise ServiceError(403, "read_only", f"store {slug!r} is attached read-only")
        return _edit_form(ctx, slug, rec=rec, settings=settings,
                          values={"base_sha256": rec.sha256, "base_version": str(rec.version),
                                  "type": rec.type or ""})
    values = {k: ctx.form.get(k, "") for k in ("base_sha256", "base_version", "type", "original_type")}
    action = ctx.form.get("action", "save")
    try:
        content = "" if action == "clear" else field_text(ctx.form, "content")
    except ContentError as err:
        return _edit_form(ctx, slug, rec=rec, status=422, content=ctx.form.get("content", "").encode(
            "utf-8", "surrogateescape").decode("utf-8", "replace"), errors={"content": str(err)},
            settings=settings, values=values)
    rtype, type_error = _type_choice(ctx, required=False)
    if type_error:
        return _edit_form(ctx, slug, rec=rec, status=422, content=content, errors={"type": type_error},
                          settings=settings, values=values)
    if rtype is not None and rtype == values["original_type"]:
        rtype = None  # unchanged select: let frontmatter / the current type decide (docs/API.md)
    base = values["base_sha256"]
    deleted_meanwhile = lambda: _edit_form(  # noqa: E731
        ctx, slug, rec=rec, status=409, content=content, settings=settings, values=values,
        errors={"content": "The record was deleted while you were editing; nothing was saved. Copy your text, "
                           "restore the record from its history, then save again."})
    if rec.deleted:
        return deleted_meanwhile()
    try:
        reply = svc.update_record(p, slug, rid, RecordUpdate(content=content, type=rtype),
                                  if_match=f'"{base}"' if base else None)
    except ServiceError as err:
        if err.status == 412:
            return _stale(ctx, slug, rec, content, values, settings)
        if err.code == "record_not_found":  # deleted meanwhile: keep the text, say so
            return deleted_meanwhile()
        where = _write_error(err)
        if where is None:
            raise
        return _edit_form(ctx, slug, rec=rec, status=err.status, content=content, errors={where[0]: where[1]},
                          settings=settings, values=values)
    new = json.loads(reply.body)
    msg = "cleared" if action == "clear" else ("saved" if new["version"] != rec.version else "unchanged")
    if settings:
        return _redirect(ctx.url("stores", slug, "memory", msg=msg))
    return _redirect(ctx.url("stores", slug, "records", rid, msg=msg))


def _stale(ctx: Ctx, slug: str, rec, content: str, values: dict[str, str], settings: bool) -> Response:
    """The edit form again after a 412: what changed since the base version (diff), the
    person's text kept, the base moved to the current version (saving again overwrites,
    knowingly)."""
    svc, p = ctx.svc, ctx.principal
    rec = svc.get_record(p, slug, rec.id, with_content=True)  # the version that beat us, as of now
    try:
        base_version = int(values.get("base_version") or 0)
        base = svc.get_version(p, slug, rec.id, base_version)
        base_text = base.content or ""
    except (ValueError, ServiceError):
        base_version, base_text = 0, ""
    lines = render.unified_diff(base_text, rec.content or "", f"version {base_version} (you started from)",
                                f"version {rec.version} (current)")
    mine = render.unified_diff(rec.content or "", content, f"version {rec.version} (current)", "your text")
    stale = {"version": rec.version, "actor": rec.updated_by, "at": rec.updated_at, "lines": lines,
             "mine": mine, "base_version": base_version}
    values = dict(values, base_sha256=rec.sha256, base_version=str(rec.version))
    log.info("console: stale edit of record %s refused (412)", rec.id)
    return _edit_form(ctx, slug, rec=rec, status=409, content=content, stale=stale, settings=settings, values=values)


def new_record_page(ctx: Ctx) -> Response:
    """GET/POST ``/stores/{store}/new``: create a record (path, type required, content)."""
    slug = ctx.path("store")
    svc, p = ctx.svc, ctx.principal
    store = svc.get_store(p, slug)
    if not _can_write(ctx, slug):
        raise ServiceError(403, "read_only", f"store {slug!r} is attached read-only")
    if ctx.request.method == "GET":
        path = ctx.q("path")
        return _page(ctx, "new.html", current_store=slug, store=store, errors={},
                     values={"path": path, "type": ""}, content="")
    values = {"path": ctx.form.get("path", "").strip(), "type": ctx.form.get("type", "")}
    errors: dict[str, str] = {}
    content = ""
    try:
        content = field_text(ctx.form, "content")
    except ContentError as err:
        errors["content"] = str(err)
        content = ctx.form.get("content", "").encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    rtype, type_error = _type_choice(ctx, required=not is_index(values["path"]))
    if type_error:
        errors["type"] = type_error
    if not values["path"]:
        errors["path"] = "Give the record a path, e.g. notes/topic.md."
    if not errors:
        try:
            reply = svc.create_record(p, slug, RecordCreate(path=values["path"], content=content, type=rtype))
        except ServiceError as err:
            where = _write_error(err)
            if where is None:
                raise
            errors[where[0]] = where[1]
        else:
            return _redirect(ctx.url("stores", slug, "records", json.loads(reply.body)["id"], msg="created"))
    return _page(ctx, "new.html", status=422, current_store=slug, store=store, errors=errors, values=values,
                 content=content)


def memory_settings(ctx: Ctx) -> Response:
    """GET ``/stores/{store}/memory``: the store's ``MEMORY.md`` as one document: read it,
    replace it, clear it (the single-document "project memory" view)."""
    slug = ctx.path("store")
    svc, p = ctx.svc, ctx.principal
    svc.get_store(p, slug)
    page = svc.list_records(p, slug, path=INDEX_PATH, limit=1, with_content=True)
    if not page.records:
        if _can_write(ctx, slug):
            return _redirect(ctx.url("stores", slug, "new", path=INDEX_PATH))
        return _page(ctx, "error.html", status=404, title="Not found", detail=f"store {slug!r} has no MEMORY.md yet")
    rec = page.records[0]
    if not _can_write(ctx, slug):
        return _redirect(ctx.url("stores", slug, "records", rec.id))
    return _edit_form(ctx, slug, rec=rec, settings=True,
                      values={"base_sha256": rec.sha256, "base_version": str(rec.version), "type": ""})


def restore(ctx: Ctx) -> Response:
    """POST ``/stores/{store}/records/{id}/restore`` (``version``): a ``restored`` version."""
    slug, rid = ctx.path("store"), ctx.path("rid")
    try:
        n = int(ctx.form.get("version", ""))
    except ValueError:
        raise ServiceError(400, "validation_error", "which version to restore?") from None
    ctx.svc.restore_record(ctx.principal, slug, rid, Restore(version=n))
    return _redirect(ctx.url("stores", slug, "records", rid, msg="restored"))


def delete(ctx: Ctx) -> Response:
    """POST ``/stores/{store}/records/{id}/delete`` (``sha256`` of the version shown → If-Match)."""
    slug, rid = ctx.path("store"), ctx.path("rid")
    sha = ctx.form.get("sha256", "")
    try:
        ctx.svc.delete_record(ctx.principal, slug, rid, if_match=f'"{sha}"' if sha else None)
    except ServiceError as err:
        if err.status != 412:
            raise
        raise ServiceError(412, err.code, "the record changed since the page was loaded; nothing was deleted. "
                           "Open it again, check the change, then delete.") from None
    return _redirect(ctx.url("stores", slug, "records", rid, msg="deleted"))


def redact(ctx: Ctx) -> Response:
    """GET/POST ``/stores/{store}/records/{id}/versions/{n}/redact`` (admin): redaction
    destroys content for good, so it is asked twice. GET (and a POST without
    ``confirm=redact``) shows what would be lost — the version, its path, time, actor, size and
    content — with the confirming form (no JavaScript needed); only a POST with
    ``confirm=redact`` redacts."""
    slug, rid, n = ctx.path("store"), ctx.path("rid"), ctx.path("n")
    svc, p = ctx.svc, ctx.principal
    if not p.is_admin:
        raise ServiceError(403, "forbidden", "only an admin token may redact")
    if ctx.request.method == "POST" and ctx.form.get("confirm") == "redact":
        svc.redact_version(p, slug, rid, n)
        return _redirect(ctx.url("stores", slug, "records", rid, msg="redacted"))
    rec = svc.get_record(p, slug, rid)
    v = svc.get_version(p, slug, rid, n)
    if not rec.deleted and rec.version == n:
        raise ServiceError(409, "current_version",
                           "the current version of a live record cannot be redacted; write over it first")
    return _page(ctx, "redact.html", current_store=slug, rec=rec, v=v)


# ---------------------------------------------------------------- workspaces


def workspaces_page(ctx: Ctx) -> Response:
    """GET/POST ``/workspaces``: the workspaces (admin; create one); a workspace token is sent
    to its own workspace."""
    p = ctx.principal
    if not p.is_admin:
        return _redirect(ctx.url("workspaces", p.workspace))
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
            return _redirect(ctx.url("workspaces", body.name, msg="workspace_created"))
    rows = []
    for w in ctx.svc.list_workspaces(p):
        rows.append({"workspace": w, "attachments": ctx.svc.list_attachments(p, w.name)})
    return _page(ctx, "workspaces.html", status=status, rows=rows, errors=errors, values=values)


def workspace_page(ctx: Ctx) -> Response:
    """GET ``/workspaces/{ws}``: its attachments and access; admin: attach, detach, switch."""
    ws = ctx.path("ws")
    attachments = ctx.svc.list_attachments(ctx.principal, ws)
    attached = {a.store.slug for a in attachments}
    candidates = ([s for s in ctx.svc.list_stores(ctx.principal) if s.slug not in attached]
                  if ctx.principal.is_admin else [])
    return _page(ctx, "workspace.html", ws=ws, attachments=attachments, candidates=candidates)


def attach(ctx: Ctx) -> Response:
    """POST ``/workspaces/{ws}/attachments`` (admin): attach a store or change its access."""
    ws = ctx.path("ws")
    slug = ctx.form.get("store", "")
    try:
        body = AttachmentPut(access=ctx.form.get("access", "read_write"),
                             instructions=field_text(ctx.form, "instructions"))
    except (ValidationError, ContentError) as err:
        raise ServiceError(422, "validation_error", f"bad attachment: {err}") from None
    ctx.svc.put_attachment(ctx.principal, ws, slug, body)
    return _redirect(ctx.url("workspaces", ws, msg="attached"))


def detach(ctx: Ctx) -> Response:
    """POST ``/workspaces/{ws}/attachments/{store}/detach`` (admin)."""
    ws, slug = ctx.path("ws"), ctx.path("store")
    ctx.svc.delete_attachment(ctx.principal, ws, slug)
    return _redirect(ctx.url("workspaces", ws, msg="detached"))


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
    return _page(ctx, "context.html", ws=ws, text=text, lines=lines, mount_root=mount_root,
                 max_bytes=ctx.q("max_bytes"), size=len(text.encode()), markers=sum(1 for m, _ in lines if m))


# ---------------------------------------------------------------- live updates


def live(svc: Service) -> Callable[[Request], Awaitable[Response]]:
    """GET ``/stores/{store}/live?after=SEQ[&record=ID]``: server-sent events, a ``change``
    event (data: ``{"seq": N}``) when the store has versions after SEQ (of record ID only,
    when given), a comment every 15 s to keep the
    connection, and the end after 5 minutes (EventSource reconnects); a ``gone`` event and the
    end at once when the session's token is revoked or expires (a long-lived response of
    ``memfuse.server.streamclass``, capped per token and per replica).

    Woken like the change feed's long-polls and streams (``memfuse.server.longpoll``): it
    subscribes to the ``Notifier`` before it looks, reads the feed only when the store's head
    (known from this process's commits and, through the ``Bus``, other replicas') is past its
    cursor, and otherwise sleeps until a commit concerns the store or the keep-alive is due.
    An idle live page makes no database query. Access is checked when it opens and on every
    wake-up (answered from the ``Notifier``'s cache until access changes): a store no longer
    visible → ``gone`` event and the end, at its next commit or keep-alive."""

    async def endpoint(request: Request) -> Response:
        try:
            p, _ = await _authenticate(svc, request)
        except (_LoginNeeded, ServiceError):
            return Response("log in first\n", status_code=401, media_type="text/plain")
        lease = request.scope.get("memfuse.lease")  # the front door's (memfuse.server.streamclass)
        if lease is not None:
            try:  # per-token cap; revocation and expiry end the page's stream
                lease.bind(p)
            except ServiceError as err:
                return Response(f"{err.detail}\n", status_code=err.status, media_type="text/plain",
                                headers=err.headers)
        name = request.path_params["store"]
        slug = name  # becomes the store's key (memfuse.server.keys) once access is checked
        record = request.query_params.get("record") or None
        try:
            after = max(0, min(int(request.query_params.get("after", "0")), INT64_MAX))
        except ValueError:
            after = 0
        notifier = svc.notifier

        async def look() -> int | None:
            """The seq to announce (None: nothing for this page); moves ``after``. Raises
            ``ServiceError`` (404: not visible, 410: cursor beyond the feed)."""
            nonlocal after
            if svc.cached_feed_key(p, name) is None:
                await anyio.to_thread.run_sync(svc.check_feed_access, p, name)
            announce = None
            while True:
                head = notifier.head(slug)
                if head is not None and head <= after:
                    break  # nothing past the cursor: no read
                at = after
                fr = await anyio.to_thread.run_sync(
                    functools.partial(svc.feed_read, slug, at, limit=100, with_content=False))
                if at > fr.top:
                    raise ServiceError(410, "cursor_expired", "the cursor is beyond this server's feed")
                if fr.changes:
                    after = fr.changes[-1].seq
                    if record is None or any(ch.record.id == record for ch in fr.changes):
                        announce = after
                else:
                    after = max(at, fr.store_top)
                if not fr.full:
                    break
            return announce

        async def events():
            nonlocal slug
            deadline = anyio.current_time() + LIVE_STREAM_SECONDS
            last_sent = anyio.current_time()
            yield "retry: 2000\n\n"
            try:  # the key the Notifier wakes by
                slug = svc.cached_feed_key(p, name) or await anyio.to_thread.run_sync(svc.check_feed_access, p, name)
            except ServiceError as err:
                yield f"event: gone\ndata: {json.dumps({'status': err.status})}\n\n"
                return
            waiter = notifier.subscribe(wakeups.FEED, slug)
            try:
                while anyio.current_time() < deadline and not svc.closing:
                    notifier.rearm(waiter)  # before looking: no commit is missed
                    try:
                        seq = await look()
                    except ServiceError as err:
                        yield f"event: gone\ndata: {json.dumps({'status': err.status})}\n\n"
                        return
                    if seq is not None:
                        yield f"event: change\ndata: {json.dumps({'seq': seq})}\n\n"
                        last_sent = anyio.current_time()
                    now = anyio.current_time()
                    if now - last_sent >= LIVE_KEEPALIVE_SECONDS:
                        yield ": keep-alive\n\n"
                        last_sent = now
                    with anyio.move_on_after(min(deadline, last_sent + LIVE_KEEPALIVE_SECONDS) - now):
                        await waiter.event.wait()
            finally:
                notifier.unsubscribe(waiter)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    return endpoint


# ---------------------------------------------------------------- the app


def create_console(svc: Service, codes: LoginCodes | None = None) -> Starlette:
    """The console as an ASGI app over ``svc``, to mount at ``/ui`` (see ``install_console``).
    ``codes`` holds the one-time login links (``app.state.login_codes``)."""
    codes = codes or LoginCodes()

    def v(fn: Callable[[Ctx], Response]) -> Callable[[Request], Awaitable[Response]]:
        return view(svc, fn)

    routes = [
        Route("/", v(home)),
        Route("/login", login_page(svc), methods=["GET", "POST"]),
        Route("/login/{code}", login_code(svc, codes)),
        Route("/logout", v(logout), methods=["POST"]),
        Route("/account", v(switch_account), methods=["POST"]),
        Route("/stores", v(create_store), methods=["POST"]),
        Route("/stores/{store}", v(store_page)),
        Route("/stores/{store}/live", live(svc)),
        Route("/stores/{store}/settings", v(store_settings), methods=["POST"]),
        Route("/stores/{store}/new", v(new_record_page), methods=["GET", "POST"]),
        Route("/stores/{store}/memory", v(memory_settings)),
        Route("/stores/{store}/consolidations", v(consolidations_page)),
        Route("/consolidations/{job}", v(consolidation_page)),
        Route("/stores/{store}/records/{rid}", v(record_page)),
        Route("/stores/{store}/records/{rid}/diff", v(diff_page)),
        Route("/stores/{store}/records/{rid}/edit", v(edit_page), methods=["GET", "POST"]),
        Route("/stores/{store}/records/{rid}/restore", v(restore), methods=["POST"]),
        Route("/stores/{store}/records/{rid}/delete", v(delete), methods=["POST"]),
        Route("/stores/{store}/records/{rid}/versions/{n:int}/redact", v(redact), methods=["GET", "POST"]),
        Route("/workspaces", v(workspaces_page), methods=["GET", "POST"]),
        Route("/workspaces/{ws}", v(workspace_page)),
        Route("/workspaces/{ws}/attachments", v(attach), methods=["POST"]),
        Route("/workspaces/{ws}/attachments/{store}/detach", v(detach), methods=["POST"]),
        Route("/workspaces/{ws}/context", v(context_page)),
        Mount("/static", StaticFiles(packages=[("memfuse.server.console", "static")])),
    ]

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        try:
            p, creds = await _authenticate(svc, request)
        except (_LoginNeeded, ServiceError):
            if request.method == "GET" and status == 404:
                base = request.scope.get("root_path", "")
                return _redirect(f"{base}/login?" + urlencode({"next": request.url.path}))
            return _bare(request, "error.html", status=401, title="Not logged in", detail="Log in first.")
        ctx = Ctx(svc, request, p, creds)
        title = {404: "Not found", 405: "Method not allowed"}.get(status, "Error")
        detail = "There is no such page." if status == 404 else "This page does not take that method."
        return await anyio.to_thread.run_sync(_error_page, request, status, title, detail, ctx)

    app = Starlette(routes=routes, exception_handlers={StarletteHTTPException: not_found})
    app.add_middleware(SecurityHeaders)
    app.state.login_codes = codes
    return app
