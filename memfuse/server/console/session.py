"""Who is using the console: sessions, CSRF tokens, one-time login links, security headers.

A person logs in with a token (admin or workspace), the same tokens the API takes. The
session cookie ``memfuse_session`` holds that token: ``HttpOnly`` (no script can read it),
``SameSite=Strict`` (no other site's page can send it), ``Path=/ui``, ``Secure`` when the
request came over HTTPS, no expiry (it ends with the browser session or at log-out). Holding
the token rather than a server-side session id means a session works on every replica and
after a restart, and revoking the token ends every console session made with it. Every
request is authenticated again (``Service.authenticate``), exactly as an API call.

Every form carries a CSRF token; for a cookie session it is ``HMAC-SHA256(token,
"memfuse-console-csrf")`` (derived from a secret only the session holds, so another site
cannot know it; OWASP "synchronizer token" pattern without server state). The login form,
before any session, uses the double-submit pattern: a random value in a ``SameSite=Strict``
cookie and the same value in the form. A request with ``Authorization: Bearer`` (scripts,
tests) needs no CSRF token: another site's page cannot set that header.

One-time login links (``/ui/login/<code>``, printed by ``memfuse dev``) map a random code to
a token in this process's memory; the first use consumes the code.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

SESSION_COOKIE = "memfuse_session"
LOGIN_COOKIE = "memfuse_login"
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


def csrf_token(token: str) -> str:
    """The CSRF token of a session holding ``token`` (hex HMAC-SHA256)."""
    return hmac.new(token.encode("utf-8", "surrogatepass"), b"memfuse-console-csrf", hashlib.sha256).hexdigest()


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
    """The token of a request and how it came: ``via_cookie`` (a browser session, CSRF
    checked on every POST) or an ``Authorization: Bearer`` header."""

    token: str
    via_cookie: bool


def request_credentials(headers: dict[str, str], cookies: dict[str, str]) -> Credentials | None:
    """The request's token: ``Authorization: Bearer`` first, else the session cookie."""
    auth = headers.get("authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return Credentials(value.strip(), via_cookie=False)
    token = cookies.get(SESSION_COOKIE)
    if token:
        return Credentials(token, via_cookie=True)
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
