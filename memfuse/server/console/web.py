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

This module holds the request plumbing (``view``: authentication, CSRF, forms, errors as
pages), login, the live updates and the route table (``create_console``). The handlers, one
per page or action, read side by side with the templates in ``templates/`` and with
docs/CONSOLE.md, live in ``store_pages`` (overview, stores, workspaces) and ``record_pages``
(records, history, edits) over what every page shares (``pages``: ``Ctx``, ``render_page``);
the rendering helpers (``render``), forms (``forms``) and sessions (``session``) apart.
"""
from __future__ import annotations

import functools
import json
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlencode

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from memfuse.defs import INT64_MAX
from memfuse.server.console.forms import FormError, read_form
from memfuse.server.console.pages import (
    bare_page,
    Ctx,
    INSTANCE,
    MESSAGES,
    redirect_to,
    render_page,
)
from memfuse.server.console.record_pages import (
    consolidation_page,
    consolidations_page,
    delete,
    diff_page,
    edit_page,
    memory_settings,
    new_record_page,
    record_page,
    redact,
    restore,
)
from memfuse.server.console.store_pages import (
    attach,
    context_page,
    create_store,
    detach,
    home,
    store_page,
    store_settings,
    workspace_page,
    workspaces_page,
)
from memfuse.server.console.session import (
    CSRF_FIELD,
    Credentials,
    LoginCodes,
    SecurityHeaders,
    cookie_args,
    cookie_names,
    request_credentials,
    same,
)
from memfuse.server.service import Principal, Service, ServiceError
from memfuse.server import wakeups

log = logging.getLogger(__name__)

LIVE_STREAM_SECONDS = 300.0  # an event stream ends after this long; EventSource reconnects
LIVE_KEEPALIVE_SECONDS = 15.0


class _LoginNeeded(Exception):
    """No (valid) credentials on a page request: redirect to the login page."""

    def __init__(self, reason: str = "") -> None:
        super().__init__(reason)
        self.reason = reason


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
        cached = svc.authenticate_cached(creds.token, INSTANCE)
        p = cached if cached is not None else await anyio.to_thread.run_sync(svc.authenticate, creds.token, INSTANCE)
        account = request.headers.get("x-memfuse-account")
        if account:  # a bearer caller naming its account, as on the API (docs/API.md "Accounts")
            p = await anyio.to_thread.run_sync(svc.act_in_account, p, account)
    request.scope["memfuse.authenticated"] = True
    return p, creds


def _error_page(request: Request, status: int, title: str, detail: str, principal_ctx: Ctx | None = None) -> Response:
    if principal_ctx is not None:
        try:
            return render_page(principal_ctx, "error.html", status=status, title=title, detail=detail)
        except Exception:  # the sidebar itself failed: show the bare page
            log.exception("console: error page with sidebar failed")
    return bare_page(request, "error.html", status=status, title=title, detail=detail)


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
                return bare_page(request, "error.html", status=401, title="Not logged in",
                             detail="Log in first (your session ended).")
            base = request.scope.get("root_path", "")
            target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            resp = redirect_to(f"{base}/login?" + urlencode({"next": target}))
            if need.reason:
                _forget_session(request, resp)
            return resp
        except ServiceError as err:
            return bare_page(request, "error.html", status=err.status, title=_TITLES.get(err.status, "Error"),
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
            return bare_page(request, "error.html", status=500, title="Server error",
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
    resp = redirect_to(target)
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
                return bare_page(request, "error.html", status=err.status, title="Bad request", detail=err.detail)
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
        resp = bare_page(request, "login.html", status=status, next=nxt, nonce=nonce, error=error,
                     csrf_field=CSRF_FIELD, message=MESSAGES.get(request.query_params.get("msg", "")),
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
            return redirect_to(f"{base}/login?notice=expired")
        try:
            resp = await _start_session(svc, request, token, base + "/")
        except ServiceError:
            return redirect_to(f"{base}/login?notice=expired")
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
    return redirect_to(ctx.url(""))


def logout(ctx: Ctx) -> Response:
    """POST ``/logout``: end the session on the server (its cookie is refused from now on, on
    every replica) and make the browser forget the cookie."""
    if ctx.creds.session:
        ctx.svc.end_session(ctx.creds.session)
        log.info("console: logout")
    resp = redirect_to(ctx.url("login", msg="logged_out"))
    _forget_session(ctx.request, resp)
    return resp


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
            try:  # per-token and per-account caps; revocation and expiry end the page's stream
                lease.bind(p)
            except ServiceError as err:
                return Response(f"{err.detail}\n", status_code=err.status, media_type="text/plain",
                                headers=err.headers)
        name: str = request.path_params["store"]
        slug: str = name  # becomes the store's key (memfuse.server.keys) once access is checked
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

        async def events() -> AsyncIterator[str]:
            nonlocal slug
            deadline = anyio.current_time() + LIVE_STREAM_SECONDS
            last_sent = anyio.current_time()
            yield "retry: 2000\n\n"
            try:  # the key the Notifier wakes by
                key = svc.cached_feed_key(p, name)
                slug = key if key is not None else await anyio.to_thread.run_sync(svc.check_feed_access, p, name)
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
                return redirect_to(f"{base}/login?" + urlencode({"next": request.url.path}))
            return bare_page(request, "error.html", status=401, title="Not logged in", detail="Log in first.")
        ctx = Ctx(svc, request, p, creds)
        title = {404: "Not found", 405: "Method not allowed"}.get(status, "Error")
        detail = "There is no such page." if status == 404 else "This page does not take that method."
        return await anyio.to_thread.run_sync(_error_page, request, status, title, detail, ctx)

    app = Starlette(routes=routes, exception_handlers={StarletteHTTPException: not_found})
    app.add_middleware(SecurityHeaders)
    app.state.login_codes = codes
    return app
