"""What every console page shares: ``Ctx`` (the service, the caller, the request's
parameters and form), the Jinja2 environment and ``render_page`` (a page with the sidebar of
the stores the caller sees), ``bare_page`` (a page without a session), ``redirect_to`` and
``can_write``. The pages themselves are ``store_pages`` (overview, stores, workspaces) and
``record_pages`` (records, history, edits); ``web`` holds the request plumbing, login, the
live updates and the route table.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlencode

from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse

from memfuse.content import RECORD_TYPES
from memfuse.defs import Access
from memfuse.server.db import DEFAULT_ACCOUNT
from memfuse.server import keys
from memfuse.server.console import render
from memfuse.server.console.session import CSRF_FIELD, Credentials, csrf_token
from memfuse.server.service import Principal, Service

INSTANCE = "console"  # recorded in the actor of a workspace token's writes: ws:<ws>/console
PAGE_SIZE = 100  # records per page of a store listing

MESSAGES = {  # ?msg= codes → fixed text (no user-supplied text is ever echoed from a URL)
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
        root: str = self.request.scope.get("root_path", "")
        return root

    @property
    def csrf(self) -> str:
        return csrf_token(self.creds.secret)

    def path(self, name: str) -> str:
        value: str = self.request.path_params[name]
        return value

    def path_int(self, name: str) -> int:
        """A path parameter the route table declares ``{name:int}`` (Starlette converts it)."""
        value: int = self.request.path_params[name]
        return value

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


def sidebar_stores(ctx: Ctx) -> list[dict[str, Any]]:
    """The stores a principal sees, with usage and limits: every store for admin, the
    attached ones (with their access) for a workspace token. Read once per request."""
    if ctx._sidebar is None:
        p = ctx.principal
        if p.is_admin:
            ctx._sidebar = [{"store": s, "access": None} for s in ctx.svc.list_stores(p)]
        else:
            assert p.workspace is not None  # a workspace token
            ctx._sidebar = [{"store": a.store, "access": a.access.value}
                            for a in ctx.svc.list_attachments(p, p.workspace)]
    return ctx._sidebar


def store_ref(p: Principal, name: str, account: str | None) -> str:
    """How the console links store ``name`` of ``account`` for ``p``: the root admin over
    every account by its reference (``keys.ref``: ``notes~bravo``, the name in
    ``default``), so two accounts' stores of one name have two links; anyone else (one
    account) by its name."""
    return keys.ref(name, account or DEFAULT_ACCOUNT) if p.is_root else name


def render_page(ctx: Ctx, template: str, status: int = 200, **values: Any) -> HTMLResponse:
    """The page ``template`` with ``values``, the sidebar and what every page uses: ``ref``
    (``store_ref`` for the caller: the links to a store from a list) and ``sref`` (the store
    as this request's URL named it: the links within a store's pages, which so stay on the
    same store)."""
    stores = sidebar_stores(ctx)
    values.setdefault("current_store", None)
    p = ctx.principal
    html = _env.get_template(template).render(
        ref=lambda name, account: store_ref(p, name, account),
        sref=ctx.request.path_params.get("store"),
        base=ctx.base,
        url=ctx.url,
        csrf=ctx.csrf,
        csrf_field=CSRF_FIELD,
        principal=ctx.principal,
        sidebar=stores,
        # the account switch of the root admin: every account (read once per page)
        accounts=(ctx.svc.account_slugs(ctx.principal)
                  if ctx.principal.root_token and ctx.principal.workspace is None else []),
        message=MESSAGES.get(ctx.q("msg")),
        record_types=RECORD_TYPES,
        **values,
    )
    return HTMLResponse(html, status_code=status)


def bare_page(request: Request, template: str, status: int = 200, **values: Any) -> HTMLResponse:
    """A page without a session (login, errors before authentication)."""
    html = _env.get_template(template).render(base=request.scope.get("root_path", ""), principal=None,
                                              sidebar=[], **values)
    return HTMLResponse(html, status_code=status)


def redirect_to(url: str) -> RedirectResponse:
    return RedirectResponse(url, status_code=303)


def can_write(ctx: Ctx, slug: str) -> bool:
    if ctx.principal.is_admin:
        return True
    return any(s["store"].slug == slug and s["access"] == Access.read_write.value for s in sidebar_stores(ctx))
