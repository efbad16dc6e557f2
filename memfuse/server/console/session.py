"""Who is using the console: session cookies, CSRF tokens, one-time login links, security headers.

A person logs in with a token (admin or workspace), the same tokens the API takes. The
browser never holds that token: login makes a server-side session (``Service.create_session``,
memfuse/server/sessions.py: a random id stored hashed, bound to the token, ending after
12 hours, at log-out, or with the token's revocation or expiry) and the cookie holds only the
session id. The cookie is ``HttpOnly`` (no script can read it), ``SameSite=Strict`` (no other
site's page can send it), with a ``Max-Age`` up to the session's end, and

- over TLS (``https``, or ``X-Forwarded-Proto: https`` from a trusted proxy:
  memfuse/server/proxies.py): ``Secure`` and named ``__Host-memfuse_session`` (RFC 6265bis
  §4.1.3.2: a browser keeps a ``__Host-`` cookie only when it is ``Secure``, has no ``Domain``
  and ``Path=/``, so no sibling sub-domain and no plain-HTTP page can set or shadow it);
- over plain HTTP (loopback, ``memfuse dev``): ``memfuse_session`` with ``Path=/ui/``, so the
  browser sends it to the console's pages only, not to other paths of the host.

A cookie cannot be scoped to a port (RFC 6265 §8.5): a browser sends it to every server on the
same host name whose path matches. That is why it holds a session id rather than the token:
what another server on the host could see opens the console only, never the API, and ends
with the session.

Every form carries a CSRF token; for a cookie session it is ``HMAC-SHA256(session id,
"memfuse-console-csrf")`` (derived from a secret only the session holds, so another site
cannot know it; OWASP "synchronizer token" pattern without more server state). The login form,
before any session, uses the double-submit pattern: a random value in a ``SameSite=Strict``
cookie and the same value in the form. A request with ``Authorization: Bearer`` (scripts,
tests) needs no CSRF token: another site's page cannot set that header.

One-time login links (``/ui/login/<code>``, printed by ``memfuse dev``) map a random code to
a token in this process's memory; the first use consumes the code and makes a session.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from typing import Any
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

SESSION_COOKIE = "memfuse_session"  # over plain HTTP, Path=/ui/
SECURE_SESSION_COOKIE = "__Host-" + SESSION_COOKIE  # over TLS: Secure, Path=/
LOGIN_COOKIE = "memfuse_login"
SECURE_LOGIN_COOKIE = "__Host-" + LOGIN_COOKIE
CSRF_FIELD = "csrf"
LOGIN_CODE_SECONDS = 24 * 3600  # a one-time login link expires after this long, unused

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
_SECURITY_HEADERS = [
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"cross-origin-opener-policy", b"same-origin"),
]


def csrf_token(secret: str) -> str:
    """The CSRF token of a session whose secret (session id, or the bearer token of a request
    without cookie) is ``secret`` (hex HMAC-SHA256)."""
    return hmac.new(secret.encode("utf-8", "surrogatepass"), b"memfuse-console-csrf", hashlib.sha256).hexdigest()


def cookie_names(secure: bool) -> tuple[str, str]:
    """(session cookie, login cookie) names for a request over TLS (``secure``) or not."""
    return (SECURE_SESSION_COOKIE, SECURE_LOGIN_COOKIE) if secure else (SESSION_COOKIE, LOGIN_COOKIE)


def cookie_args(secure: bool, base: str) -> dict[str, Any]:
    """``set_cookie`` arguments of the console's cookies (see the module docstring):
    ``__Host-`` rules over TLS, ``Path=<base>/`` otherwise."""
    return {"path": "/" if secure else (base.rstrip("/") + "/"), "httponly": True, "samesite": "strict",
            "secure": secure}


def same(a: str | None, b: str | None) -> bool:
    """Constant-time comparison; False when either is missing or empty."""
    return bool(a) and bool(b) and hmac.compare_digest(str(a).encode(), str(b).encode())


class LoginCodes:
    """One-time login codes of this process: ``issue(token)`` → code; ``redeem(code)`` →
    the token once (then the code is gone), or None when unknown, used or older than
    ``LOGIN_CODE_SECONDS``. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._codes: dict[str, tuple[str, float]] = {}

    def issue(self, token: str) -> str:
        """A new random code (URL-safe, 256 bits) for ``token``."""
        code = secrets.token_urlsafe(32)
        with self._lock:
            self._codes[code] = (token, time.monotonic() + LOGIN_CODE_SECONDS)
        return code

    def redeem(self, code: str) -> str | None:
        """The token of ``code`` if it is known and fresh; the code is consumed either way."""
        with self._lock:
            hit = self._codes.pop(code, None)
        if hit is None or hit[1] < time.monotonic():
            return None
        return hit[0]


@dataclass(frozen=True)
class Credentials:
    """How a request authenticates: an ``Authorization: Bearer`` ``token`` (``via_cookie``
    False), or a browser ``session`` id from the cookie (``via_cookie`` True; CSRF checked on
    every POST; ``token`` None: the browser never holds it)."""

    token: str | None
    via_cookie: bool
    session: str | None = None

    @property
    def secret(self) -> str:
        """What the CSRF token is derived from: the session id, else the bearer token."""
        return self.session or self.token or ""


def request_credentials(headers: dict[str, str], cookies: dict[str, str], secure: bool) -> Credentials | None:
    """The request's credentials: ``Authorization: Bearer`` first, else the session cookie of
    this kind of request (``secure``: over TLS, the ``__Host-`` one; a plain-HTTP request
    never uses a cookie set over TLS, and the other way round)."""
    auth = headers.get("authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return Credentials(value.strip(), via_cookie=False)
    session = cookies.get(cookie_names(secure)[0])
    if session:
        return Credentials(None, via_cookie=True, session=session)
    return None


class SecurityHeaders:
    """ASGI middleware: every console response gets the Content-Security-Policy (no inline
    script or style, nothing from other origins), ``nosniff``, ``DENY`` framing and
    ``no-referrer``; HTML pages also ``Cache-Control: no-store`` (memory content must not
    linger in shared caches)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                names = {k.lower() for k, _ in headers}
                headers += [(k, v) for k, v in _SECURITY_HEADERS if k not in names]
                ctype = next((v for k, v in headers if k.lower() == b"content-type"), b"")
                if ctype.startswith(b"text/html") and b"cache-control" not in names:
                    headers.append((b"cache-control", b"no-store"))
                message = dict(message, headers=headers)
            await send(message)

        await self.app(scope, receive, send_wrapper)
