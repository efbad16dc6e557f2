"""The sidecar's admin HTTP API (docs/DEPLOY.md, "The sidecar's admin API"), and the client side
used by ``memfuse status`` and ``memfuse mounts``.

Served in the sidecar's own trio run by a small HTTP/1.1 server framed by h11 (the handlers
call the target directly, in the trio thread: no locking against the FUSE handlers is needed;
no web framework or ASGI server is loaded: they would cost the sidecar's baseline memory ~4 MiB
for six endpoints), on two listeners:

- TCP (:func:`serve_admin`, ``--admin-listen``, default ``127.0.0.1:9464``; in Kubernetes the
  pod IP, so the kubelet's probes and Prometheus reach it). Only ``/healthz``, ``/readyz``
  and ``/metrics`` are open (``OPEN_ON_TCP``: they carry no memory content, no store path and
  no token). Everything else — the status document (it names stores, the mountpoint and the
  control plane), the prompt block (every attached store's ``MEMORY.md``), mount changes —
  needs ``Authorization: Bearer <admin token>`` (``--admin-token-file``, compared in constant
  time), on loopback too: any process in the pod's network namespace, or any pod that can
  reach the pod IP, can reach this port. Without a token file they are refused on TCP (403
  ``admin_token_required``).
- a Unix socket (:func:`serve_admin_unix`) at ``<cache dir>/admin.sock``, mode 0600, owned by
  the sidecar's user: every endpoint without a token (file permissions are the
  authentication). ``memfuse mounts add|remove`` and ``memfuse status --admin-socket`` use it.

Endpoints:

- ``GET /healthz`` → 200 ``{"ok": true}`` while the process serves.
- ``GET /readyz`` → 200 ``{"ready": true, "draining": bool, "backlog": n}`` once the first
  load and mount are done and while the control plane accepts the token (``draining``: the
  outbox a previous process left, ``backlog`` entries of it, still commits behind the
  mount), else 503 with the reason in ``detail`` (the target's optional
  ``not_ready_reason``).
- ``GET /metrics`` → Prometheus exposition of ``target.metrics.registry`` (text format 0.0.4 by
  default; OpenMetrics or text 1.0.0 when the ``Accept`` header asks for it).
- ``GET /v1/status`` → 200 JSON of ``target.status()``.
- ``POST /v1/mounts/{store}`` → 200 JSON of ``target.mount_store(store)``; 404 when the store is
  not attached to the workspace, 403 when it is refused, 400 for an invalid slug.
- ``DELETE /v1/mounts/{store}`` → 200 JSON of ``target.unmount_store(store)``; 404 when the
  store is not mounted, 400 for an invalid slug.
- ``GET /v1/context`` → 200 ``text/markdown``: the prompt block for this mount (the same as
  ``MOUNT/.memfuse/context.md``), refreshed from the control plane within a bound
  (``target.prompt_block()``); the last one fetched when the control plane does not answer;
  503 ``context_unavailable`` when none was ever fetched; 404 for a target without one.

Every error is ``application/problem+json`` (RFC 9457) with memfuse's ``code`` member:
``not_found``, ``method_not_allowed``, ``invalid_name``, ``store_not_attached``,
``store_refused``, ``store_not_mounted``, ``not_ready``, ``context_unavailable``,
``internal_error``, ``unauthorized`` (401 with ``WWW-Authenticate: Bearer``, RFC 6750: a
request on TCP past the open endpoints without the right token), ``admin_token_required``
(403: such a request on TCP when the sidecar has no admin token), ``bad_request`` (400: malformed HTTP), ``headers_too_large`` (431: a
request head over 16 KiB), ``body_too_large`` (413: a body over 64 KiB; no endpoint takes one).
Each failed request
logs one line on the ``memfuse.admin`` logger: method, path, status and code (never a token,
never memory content, never the exception's message).
"""
from __future__ import annotations

import contextlib
import errno
import hmac
import ipaddress
import json
import logging
import math
import os
import socket
import stat
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable
from urllib.parse import unquote

import trio

from .metrics import Metrics

# the client side (``memfuse status``, ``memfuse mounts``) lives in statusclient, which does
# not import trio: re-exported here, where callers found it
from .statusclient import (  # noqa: F401, E402
    OUTBOX_LABELS,
    STATUS_LABELS,
    STATUS_TIMEOUT,
    AdminRequestFailed,
    StatusUnavailable,
    _short,
    admin_call,
    fetch_status,
    format_status,
    read_status_file,
)

log = logging.getLogger("memfuse.admin")

DEFAULT_ADMIN_LISTEN = "127.0.0.1:9464"
ADMIN_SOCKET_NAME = "admin.sock"  # in the cache directory
PROBLEM_JSON = "application/problem+json"
GRACEFUL_TIMEOUT = 2.0  # seconds requests in flight get once serve_admin is cancelled

_REASONS = {400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed",
            413: "Content Too Large", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
            503: "Service Unavailable"}


@runtime_checkable
class AdminTarget(Protocol):
    """What the admin API serves: the running sidecar (or a stub in tests).

    Every member is used from the trio thread that runs :func:`serve_admin`.
    """

    @property
    def ready(self) -> bool:
        """True once the first load and mount are done (``/readyz``)."""
        ...

    @property
    def metrics(self) -> Metrics:
        """The process's metrics; ``/metrics`` exposes ``metrics.registry``."""
        ...

    def status(self) -> dict[str, Any]:
        """The status document (``/v1/status``, ``.memfuse/status.json``): a JSON-able dict,
        see ``Filesystem.status()``."""
        ...

    async def mount_store(self, slug: str) -> dict[str, Any]:
        """Mount store ``slug`` now; return a JSON-able description of the result.

        Raises ``LookupError`` when the store is not attached to the workspace,
        ``PermissionError`` when it is refused (e.g. the token may not read it).
        """
        ...

    async def unmount_store(self, slug: str) -> dict[str, Any]:
        """Commit the store's dirty files (bounded wait), unmount it; return a JSON-able result.

        Raises ``LookupError`` when the store is not mounted.
        """
        ...


# ---------------------------------------------------------------- listen addresses


def parse_listen(listen: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``127.0.0.1:9464``, ``[::1]:9464``, ``localhost:0``) into
    ``(host, port)``; the host of an IPv6 address comes back without brackets.

    Raises ``ValueError`` (one-line message) for anything else: no port, a port outside
    0..65535, an empty host, an IPv6 address without brackets.
    """
    text = (listen or "").strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"invalid listen address {listen!r}: expected [IPV6]:PORT")
        port_s = rest[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"invalid listen address {listen!r}: {host!r} is not an IPv6 address") from None
    else:
        host, sep, port_s = text.rpartition(":")
        if not sep:
            raise ValueError(f"invalid listen address {listen!r}: expected HOST:PORT")
        if ":" in host:
            raise ValueError(f"invalid listen address {listen!r}: put an IPv6 address in brackets, "
                             "e.g. [::1]:9464")
    if not host:
        raise ValueError(f"invalid listen address {listen!r}: no host (use 127.0.0.1:PORT)")
    if not port_s.isdigit() or not 0 <= int(port_s) <= 65535:
        raise ValueError(f"invalid listen address {listen!r}: port must be 0..65535")
    return host, int(port_s)


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (127.0.0.0/8, ``::1``)."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# ---------------------------------------------------------------- admin token


def read_admin_token(path: Path) -> str:
    """The admin token in ``path`` (surrounding whitespace stripped).

    Raises ``ValueError`` with a one-line message when the file cannot be read or is empty.
    """
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as e:
        raise ValueError(f"cannot read admin token file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"admin token file {path} is not UTF-8 text") from None
    if not token:
        raise ValueError(f"admin token file {path} is empty")
    return token


def token_matches(header: str | None, token: str) -> bool:
    """True when ``header`` is ``Bearer <token>`` (RFC 6750 §2.1; the scheme is
    case-insensitive). The comparison takes the same time wherever the tokens differ
    (``hmac.compare_digest``)."""
    if not header:
        return False
    scheme, _, given = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode("utf-8"), token.encode("utf-8"))


def admin_socket_path(cache_dir: Path) -> Path:
    """Where the sidecar with cache directory ``cache_dir`` serves its admin Unix socket."""
    return Path(cache_dir) / ADMIN_SOCKET_NAME


# ---------------------------------------------------------------- the app


def _json_safe(value: Any) -> Any:
    """``value`` with non-finite floats as ``None`` (JSON has no NaN / Infinity)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _json_bytes(value: Any) -> bytes:
    return json.dumps(_json_safe(value), ensure_ascii=False, allow_nan=False, default=str).encode()


@dataclass
class Request:
    """One admin request: ``method`` (upper case), ``path`` (percent-decoded, no query),
    ``headers`` (lower-case names), ``path_params`` (the route's ``{store}``)."""

    method: str
    path: str
    headers: dict[str, str]
    path_params: dict[str, str] = field(default_factory=dict)


@dataclass
class Response:
    """One admin response: ``body`` bytes, ``status_code``, extra ``headers`` and the
    ``Content-Type`` (``media_type``)."""

    body: bytes
    status_code: int = 200
    headers: dict[str, str] | None = None
    media_type: str | None = None


App = Callable[[Request], Awaitable[Response]]

# The only endpoints a TCP client may call without the admin token: probes and metrics, which
# carry no memory content, no store path and no token. Everything else needs the token on TCP
# (or the Unix socket).
OPEN_ON_TCP: frozenset[tuple[str, ...]] = frozenset({("healthz",), ("readyz",), ("metrics",)})

# (path template, allowed methods); "{store}" is one path segment
_ROUTES: tuple[tuple[tuple[str, ...], frozenset[str]], ...] = (
    (("healthz",), frozenset({"GET", "HEAD"})),
    (("readyz",), frozenset({"GET", "HEAD"})),
    (("metrics",), frozenset({"GET", "HEAD"})),
    (("v1", "status"), frozenset({"GET", "HEAD"})),
    (("v1", "mounts", "{store}"), frozenset({"POST", "DELETE"})),
    (("v1", "context"), frozenset({"GET", "HEAD"})),
)


def _route(raw_path: str) -> tuple[tuple[str, ...], frozenset[str], dict[str, str]] | None:
    """The route matching ``raw_path`` (still percent-encoded), with its path parameters
    (decoded), or None."""
    segments = raw_path.split("/")[1:]
    for template, methods in _ROUTES:
        if len(template) != len(segments):
            continue
        params: dict[str, str] = {}
        for want, got in zip(template, segments):
            if want == "{store}":
                if not got:
                    break
                params["store"] = unquote(got)
            elif want != got:
                break
        else:
            return template, methods, params
    return None


def create_admin_app(target: AdminTarget, *, token: str | None = None, local: bool = False,
                     lock: trio.Lock | None = None) -> App:
    """The admin API serving ``target`` as ``async app(request, raw_path) -> Response``
    (``raw_path``: the request target's path, still percent-encoded, routed segment by
    segment); see the module docstring for the endpoints. Never raises: an unexpected error is
    a logged 500 problem, an unknown path 404, a wrong method 405 with ``Allow``.

    ``local``: the app serves the Unix socket, so nothing needs a token. Otherwise (TCP) every
    endpoint but ``OPEN_ON_TCP`` needs ``Authorization: Bearer <token>`` (401 without it), and
    is refused (403 ``admin_token_required``) when ``token`` is None.
    Mount and unmount requests run one at a time (``lock``, shared by the apps of one sidecar).
    """
    from ..names import NameError_, check_slug

    mutations = lock if lock is not None else trio.Lock()

    def json_response(body: Any, status: int = 200) -> Response:
        return Response(_json_bytes(body), status_code=status, media_type="application/json")

    def problem(request: Request, status: int, code: str, detail: str = "", *,
                headers: dict[str, str] | None = None, level: int = logging.WARNING) -> Response:
        log.log(level, "admin request failed: %s %s -> %d %s",
                request.method, request.path, status, code)
        body = {"type": "about:blank", "title": _REASONS.get(status, "Error"), "status": status,
                "detail": detail, "code": code, "instance": request.path}
        return Response(_json_bytes(body), status_code=status, headers=headers, media_type=PROBLEM_JSON)

    async def healthz(request: Request) -> Response:
        return json_response({"ok": True})

    async def readyz(request: Request) -> Response:
        if target.ready:
            # ready = mounted and serving; a backlog left by the previous process may still
            # be draining behind the mount (reads show it, writes queue behind it)
            committer = getattr(target, "committer", None)
            if committer is None:
                return json_response({"ready": True})
            left = committer.backlog_left()
            return json_response({"ready": True, "draining": left > 0, "backlog": left})
        # Probes poll this while starting: a failure, but an expected one.
        reason = getattr(target, "not_ready_reason", None) or "the first load and mount are not done yet"
        return problem(request, 503, "not_ready", reason,
                       headers={"Retry-After": "1"}, level=logging.INFO)

    async def metrics(request: Request) -> Response:
        from prometheus_client.exposition import choose_encoder

        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encoder(target.metrics.registry), media_type=content_type)

    async def status(request: Request) -> Response:
        return json_response(target.status())

    def slug_of(request: Request) -> str | None:
        try:
            return check_slug(request.path_params["store"])
        except NameError_:
            return None

    async def mount(request: Request) -> Response:
        slug = slug_of(request)
        if slug is None:
            return problem(request, 400, "invalid_name", "not a valid store slug")
        async with mutations:
            try:
                result = await target.mount_store(slug)
            except LookupError:
                return problem(request, 404, "store_not_attached",
                               f"store '{slug}' is not attached to this workspace")
            except PermissionError:
                return problem(request, 403, "store_refused", f"store '{slug}' cannot be mounted here")
        log.info("admin: mounted store %s", slug)
        return json_response(result)

    async def unmount(request: Request) -> Response:
        slug = slug_of(request)
        if slug is None:
            return problem(request, 400, "invalid_name", "not a valid store slug")
        async with mutations:
            try:
                result = await target.unmount_store(slug)
            except LookupError:
                return problem(request, 404, "store_not_mounted", f"store '{slug}' is not mounted")
        log.info("admin: unmounted store %s", slug)
        return json_response(result)

    async def context(request: Request) -> Response:
        fn = getattr(target, "prompt_block", None)
        if fn is None:
            return problem(request, 404, "not_found", "this sidecar serves no prompt block")
        text = await fn()
        if text is None:
            return problem(request, 503, "context_unavailable",
                           "the prompt block has not been fetched from the control plane yet",
                           headers={"Retry-After": "5"}, level=logging.INFO)
        return Response(text.encode("utf-8"), media_type="text/markdown; charset=utf-8")

    def refused(request: Request, template: tuple[str, ...]) -> Response | None:
        """The refusal of a TCP request to a guarded endpoint without the admin token."""
        if local or template in OPEN_ON_TCP:
            return None
        if token is None:
            return problem(request, 403, "admin_token_required",
                           "on TCP only /healthz, /readyz and /metrics are open; this endpoint needs "
                           "the sidecar's --admin-token-file, or the admin Unix socket in the cache "
                           "directory (memfuse status --admin-socket, memfuse mounts add|remove)")
        if not token_matches(request.headers.get("authorization"), token):
            return problem(request, 401, "unauthorized", "a valid admin bearer token is required",
                           headers={"WWW-Authenticate": 'Bearer realm="memfuse-admin"'})
        return None

    async def mounts(request: Request) -> Response:
        return await (mount if request.method == "POST" else unmount)(request)

    handlers: dict[tuple[str, ...], Callable[[Request], Awaitable[Response]]] = {
        ("healthz",): healthz, ("readyz",): readyz, ("metrics",): metrics, ("v1", "status"): status,
        ("v1", "mounts", "{store}"): mounts, ("v1", "context"): context,
    }

    async def app(request: Request, raw_path: str) -> Response:
        found = _route(raw_path)
        if found is None:
            return problem(request, 404, "not_found")
        template, methods, params = found
        if request.method not in methods:
            return problem(request, 405, "method_not_allowed",
                           headers={"Allow": ", ".join(sorted(methods))})
        request.path_params = params
        no = refused(request, template)
        if no is not None:
            return no
        try:
            return await handlers[template](request)
        except Exception as e:  # noqa: BLE001 — the server keeps serving
            log.debug("admin handler error in %s %s", request.method, request.path, exc_info=True)
            return problem(request, 500, "internal_error",
                           f"unexpected error ({type(e).__name__}); see the sidecar log",
                           level=logging.ERROR)

    return app  # type: ignore[return-value]


async def serve_admin(target: AdminTarget, listen: str = DEFAULT_ADMIN_LISTEN, *,
                      token: str | None = None, lock: trio.Lock | None = None,
                      task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve the admin API for ``target`` on ``listen`` (``HOST:PORT`` or ``[IPV6]:PORT``;
    port 0 picks a free port) until cancelled. Mutations need ``token`` (see
    ``create_admin_app``); ``lock`` serialises them with the Unix-socket listener.

    Calls ``task_status.started(address)`` once the socket listens, with the address actually
    bound in the same ``HOST:PORT`` form (``"127.0.0.1:54321"``, ``"[::1]:54321"``). On
    cancellation it stops accepting, gives requests in flight up to 2 s, then returns
    (re-raising the cancellation). Raises ``ValueError`` for a malformed ``listen`` and
    ``OSError`` when the address cannot be bound (both before ``started``).
    """
    host, port = parse_listen(listen)
    if token is None:
        log.info("admin API on TCP %s: read-only (no admin token; mutations only on the Unix socket)",
                 _hostport(host, port))
    app = create_admin_app(target, token=token, lock=lock)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = trio.socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        await sock.bind((host, port))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    bound_host, bound_port = sock.getsockname()[:2]
    await _serve(app, trio.SocketListener(sock), "admin API", _hostport(bound_host, bound_port), task_status)


async def serve_admin_unix(target: AdminTarget, path: Path, *, lock: trio.Lock | None = None,
                           task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve the admin API for ``target`` on a Unix socket at ``path`` (mode 0600: only the
    sidecar's user may connect; every endpoint, mutations without a token) until cancelled;
    the socket file is removed on the way out.

    The socket is bound in a fresh 0700 directory next to ``path``, made 0600, then renamed
    into place, so there is no moment when another user could connect (the cache directory
    may be world-writable, as a Kubernetes ``emptyDir`` is). A stale socket at ``path`` (from
    a killed sidecar) is replaced; only one sidecar runs per cache directory (its lock).
    ``task_status.started(str(path))`` once it listens. Raises ``OSError`` when it cannot be
    created (e.g. a path longer than ``sun_path``'s 107 bytes).
    """
    path = Path(path)
    sock = _bind_private_unix(path)
    app = create_admin_app(target, local=True, lock=lock)
    try:
        sock.listen(128)
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
    except BaseException:
        sock.close()
        raise
    try:
        await _serve(app, listener, "admin socket", str(path), task_status)
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


def _bind_private_unix(path: Path) -> socket.socket:
    """A Unix stream socket bound at ``path``, mode 0600, with no window where anyone else
    could connect (see ``serve_admin_unix``). Raises ``OSError``."""
    parent_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    private = tempfile.mkdtemp(prefix=".admin-", dir=path.parent)  # mode 0700
    private_fd = os.open(private, os.O_RDONLY | os.O_DIRECTORY)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(_short(private_fd, "s"))
        os.chmod("s", 0o600, dir_fd=private_fd)
        try:
            st = os.lstat(path.name, dir_fd=parent_fd)
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISSOCK(st.st_mode):
                raise OSError(errno.EEXIST, f"{path} exists and is not a socket; not replacing it")
        os.replace("s", path.name, src_dir_fd=private_fd, dst_dir_fd=parent_fd)
    except BaseException:
        sock.close()
        raise
    finally:
        try:
            os.unlink("s", dir_fd=private_fd)
        except OSError:
            pass
        os.close(private_fd)
        os.close(parent_fd)
        try:
            os.rmdir(private)
        except OSError:
            pass
    return sock


# ---------------------------------------------------------------- the HTTP/1.1 server

MAX_HEAD_BYTES = 16 * 1024  # request line + headers; larger: 431 / close
MAX_BODY_BYTES = 64 * 1024  # no endpoint takes a body; larger: 413 / close
KEEP_ALIVE_S = 75.0  # an idle connection (no request begun) is closed after this
REQUEST_S = 30.0  # a request must arrive in full (head and body) within this


class _Server:
    """HTTP/1.1 over trio streams, framed by h11 (the protocol state machine hypercorn and
    httpcore use): keep-alive, bounded heads, bodies and waits, ``Connection: close`` on
    errors. A request is answered by ``app``; malformed input gets a 400 problem (431 / 413
    for an oversized head / body) and the connection is closed."""

    def __init__(self, app: Any, what: str) -> None:
        self.app, self.what = app, what
        self.closing = False
        self.idle: set[trio.CancelScope] = set()  # connections waiting for their next request

    def close(self) -> None:
        """Stop taking requests: idle connections close now, busy ones after their answer."""
        self.closing = True
        for scope in list(self.idle):
            scope.cancel()

    async def connection(self, stream: trio.abc.Stream) -> None:
        import h11

        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        try:
            while not self.closing:
                with trio.CancelScope(deadline=trio.current_time() + KEEP_ALIVE_S) as waiting:
                    self.idle.add(waiting)
                    try:
                        event = await _next_event(stream, conn)
                    finally:
                        self.idle.discard(waiting)
                if waiting.cancelled_caught or not isinstance(event, h11.Request):
                    return
                if len(event.target) + sum(len(k) + len(v) + 4 for k, v in event.headers) > MAX_HEAD_BYTES:
                    # h11 bounds only a head still incomplete; one that arrived whole is checked here
                    log.info("admin request refused: request head over %d bytes", MAX_HEAD_BYTES)
                    await self._send(stream, conn, 431, _problem_bytes(431, "headers_too_large", ""),
                                     PROBLEM_JSON, None, close=True)
                    return
                request, raw_path, too_large = None, "", False
                with trio.move_on_after(REQUEST_S):
                    size = 0
                    while True:
                        ev = await _next_event(stream, conn)
                        if isinstance(ev, h11.Data):
                            size += len(ev.data)
                            too_large = too_large or size > MAX_BODY_BYTES
                            if too_large:
                                break
                        elif isinstance(ev, h11.EndOfMessage):
                            break
                        else:  # the client went away mid-request
                            return
                    target = event.target.decode("ascii", "replace")
                    raw_path = target.split("?", 1)[0]
                    request = Request(
                        method=event.method.decode("ascii", "replace").upper(),
                        path=unquote(raw_path),
                        headers={k.decode("latin-1"): v.decode("latin-1") for k, v in event.headers},
                    )
                if request is None:  # too slow
                    return
                if too_large:
                    await self._send(stream, conn, 413, _problem_bytes(413, "body_too_large", request.path),
                                     PROBLEM_JSON, None, close=True)
                    return
                response = await self.app(request, raw_path)
                await self._send(stream, conn, response.status_code, response.body,
                                 response.media_type, response.headers, close=self.closing,
                                 head=request.method == "HEAD")
                if conn.our_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except h11.RemoteProtocolError as e:
            if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                status = e.error_status_hint or 400
                code = "headers_too_large" if status == 431 else "bad_request"
                log.info("admin request refused: malformed HTTP (%s)", code)
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError,
                                         h11.LocalProtocolError):
                    await self._send(stream, conn, status, _problem_bytes(status, code, ""),
                                     PROBLEM_JSON, None, close=True)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception as e:  # noqa: BLE001 — one connection never stops the server (or the sidecar)
            log.warning("%s: connection failed (%s)", self.what, type(e).__name__)
            log.debug("%s: connection failed", self.what, exc_info=True)
        finally:
            await stream.aclose()

    @staticmethod
    async def _send(stream: trio.abc.Stream, conn: Any, status: int, body: bytes, media_type: str | None,
                    headers: dict[str, str] | None, *, close: bool, head: bool = False) -> None:
        import h11

        out: list[tuple[str, str]] = []
        if media_type:
            out.append(("Content-Type", media_type))
        out.extend((headers or {}).items())
        out.append(("Content-Length", str(len(body))))
        if close:
            out.append(("Connection", "close"))
        data = conn.send(h11.Response(status_code=status, headers=out, reason=_REASONS.get(status, "").encode()))
        if not head and body:
            data += conn.send(h11.Data(data=body))
        data += conn.send(h11.EndOfMessage())
        await stream.send_all(data)


async def _next_event(stream: trio.abc.Stream, conn: Any) -> Any:
    """The next h11 event of ``conn``, reading ``stream`` as needed (EOF included)."""
    import h11

    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        conn.receive_data(await stream.receive_some(65536))


def _problem_bytes(status: int, code: str, instance: str) -> bytes:
    return _json_bytes({"type": "about:blank", "title": _REASONS.get(status, "Error"), "status": status,
                        "detail": "", "code": code, "instance": instance})


async def _serve(app: Any, listener: trio.SocketListener, what: str, bound: str,
                 task_status: trio.TaskStatus[str]) -> None:
    """Serve ``app`` on ``listener`` until cancelled (see ``serve_admin``): then stop accepting,
    close idle connections and give requests in flight up to ``GRACEFUL_TIMEOUT`` s."""
    server = _Server(app, what)
    # Shielded: our cancellation becomes a graceful shutdown of the connections rather than
    # an abrupt cancel; the deadline set at shutdown bounds the wait.
    grace = trio.CancelScope(shield=True)
    stop = trio.Event()

    async def connections(task_status: trio.TaskStatus[trio.Nursery] = trio.TASK_STATUS_IGNORED) -> None:
        with grace:
            async with trio.open_nursery() as conns:
                task_status.started(conns)
                await stop.wait()

    async with trio.open_nursery() as nursery:
        conns = await nursery.start(connections)
        try:
            async with listener:
                log.info("%s listening on %s", what, bound)
                task_status.started(bound)
                while True:
                    try:
                        stream = await listener.accept()
                    except OSError as e:  # out of descriptors or buffers: keep serving the others
                        if e.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                            raise
                        log.warning("%s: cannot accept a connection (%s)", what, errno.errorcode[e.errno])
                        await trio.sleep(0.1)
                        continue
                    conns.start_soon(server.connection, stream)
        finally:
            grace.deadline = trio.current_time() + GRACEFUL_TIMEOUT
            server.close()
            stop.set()
