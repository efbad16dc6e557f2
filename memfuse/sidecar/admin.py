"""The sidecar's admin HTTP API (DESIGN §6), and the client side used by ``memfuse status``.

Served by :func:`serve_admin` with hypercorn under trio, in the sidecar's own trio run (the
handlers call the target directly, in the trio thread: no locking against the FUSE handlers
is needed). Listens on ``--admin-listen``, default ``127.0.0.1:9464``; there is no
authentication, so keep it on loopback (a warning is logged for any other address).

Endpoints:

- ``GET /healthz`` → 200 ``{"ok": true}`` while the process serves.
- ``GET /readyz`` → 200 ``{"ready": true}`` once the first load and mount are done and while
  the control plane accepts the token, else 503 with the reason in ``detail`` (the target's
  optional ``not_ready_reason``).
- ``GET /metrics`` → Prometheus exposition of ``target.metrics.registry`` (text format 0.0.4 by
  default; OpenMetrics or text 1.0.0 when the ``Accept`` header asks for it).
- ``GET /v1/status`` → 200 JSON of ``target.status()``.
- ``POST /v1/mounts/{store}`` → 200 JSON of ``target.mount_store(store)``; 404 when the store is
  not attached to the workspace, 403 when it is refused, 400 for an invalid slug.
- ``DELETE /v1/mounts/{store}`` → 200 JSON of ``target.unmount_store(store)``; 404 when the
  store is not mounted, 400 for an invalid slug.

Every error is ``application/problem+json`` (RFC 9457) with memfuse's ``code`` member:
``not_found``, ``method_not_allowed``, ``invalid_name``, ``store_not_attached``,
``store_refused``, ``store_not_mounted``, ``not_ready``, ``internal_error``. Each failed request
logs one line on the ``memfuse.admin`` logger: method, path, status and code (never a token,
never memory content, never the exception's message).
"""
from __future__ import annotations

import errno
import functools
import ipaddress
import json
import logging
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import trio

from .metrics import Metrics

if TYPE_CHECKING:
    from starlette.applications import Starlette

log = logging.getLogger("memfuse.admin")

DEFAULT_ADMIN_LISTEN = "127.0.0.1:9464"
PROBLEM_JSON = "application/problem+json"
GRACEFUL_TIMEOUT = 2.0  # seconds requests in flight get once serve_admin is cancelled
STATUS_TIMEOUT = 5.0  # seconds `memfuse status --admin URL` waits for an answer

_REASONS = {400: "Bad Request", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed",
            500: "Internal Server Error", 503: "Service Unavailable"}


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

    def status(self) -> dict:
        """The status document (``/v1/status``, ``.memfuse/status.json``): a JSON-able dict,
        see ``Filesystem.status()``."""
        ...

    async def mount_store(self, slug: str) -> dict:
        """Mount store ``slug`` now; return a JSON-able description of the result.

        Raises ``LookupError`` when the store is not attached to the workspace,
        ``PermissionError`` when it is refused (e.g. the token may not read it).
        """
        ...

    async def unmount_store(self, slug: str) -> dict:
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


def create_admin_app(target: AdminTarget) -> Starlette:
    """The admin ASGI app (Starlette) serving ``target``; see the module docstring.

    Mount and unmount requests run one at a time. (Starlette and the server are imported
    lazily, so ``memfuse status`` stays quick to start.)
    """
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from ..names import NameError_, check_slug

    mutations = trio.Lock()

    def json_response(body: Any, status: int = 200) -> Response:
        return Response(_json_bytes(body), status_code=status, media_type="application/json")

    def problem(request: Request, status: int, code: str, detail: str = "", *,
                headers: dict[str, str] | None = None, level: int = logging.WARNING) -> Response:
        log.log(level, "admin request failed: %s %s -> %d %s",
                request.method, request.url.path, status, code)
        body = {"type": "about:blank", "title": _REASONS.get(status, "Error"), "status": status,
                "detail": detail, "code": code, "instance": request.url.path}
        return Response(_json_bytes(body), status_code=status, headers=headers, media_type=PROBLEM_JSON)

    Handler = Callable[[Request], Awaitable[Response]]

    def guarded(fn: Handler) -> Handler:
        """Turn an unexpected exception into a logged 500 problem; the server keeps serving."""

        @functools.wraps(fn)
        async def wrapper(request: Request) -> Response:
            try:
                return await fn(request)
            except Exception as e:  # noqa: BLE001
                log.debug("admin handler error in %s %s", request.method, request.url.path,
                          exc_info=True)
                return problem(request, 500, "internal_error",
                               f"unexpected error ({type(e).__name__}); see the sidecar log",
                               level=logging.ERROR)

        return wrapper

    @guarded
    async def healthz(request: Request) -> Response:
        return json_response({"ok": True})

    @guarded
    async def readyz(request: Request) -> Response:
        if target.ready:
            return json_response({"ready": True})
        # Probes poll this while starting: a failure, but an expected one.
        reason = getattr(target, "not_ready_reason", None) or "the first load and mount are not done yet"
        return problem(request, 503, "not_ready", reason,
                       headers={"Retry-After": "1"}, level=logging.INFO)

    @guarded
    async def metrics(request: Request) -> Response:
        from prometheus_client.exposition import choose_encoder

        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encoder(target.metrics.registry), headers={"Content-Type": content_type})

    @guarded
    async def status(request: Request) -> Response:
        return json_response(target.status())

    def slug_of(request: Request) -> str | None:
        try:
            return check_slug(request.path_params["store"])
        except NameError_:
            return None

    @guarded
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

    @guarded
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

    async def mounts(request: Request) -> Response:
        return await (mount if request.method == "POST" else unmount)(request)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return problem(request, exc.status_code, code, "", headers=dict(exc.headers or {}))

    return Starlette(
        routes=[
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/v1/status", status, methods=["GET"]),
            Route("/v1/mounts/{store}", mounts, methods=["POST", "DELETE"]),
        ],
        exception_handlers={HTTPException: http_error},
    )


async def serve_admin(target: AdminTarget, listen: str = DEFAULT_ADMIN_LISTEN, *,
                      task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve the admin API for ``target`` on ``listen`` (``HOST:PORT`` or ``[IPV6]:PORT``;
    port 0 picks a free port) until cancelled.

    Calls ``task_status.started(address)`` once the socket listens, with the address actually
    bound in the same ``HOST:PORT`` form (``"127.0.0.1:54321"``, ``"[::1]:54321"``). On
    cancellation it stops accepting, gives requests in flight up to 2 s, then returns
    (re-raising the cancellation). Raises ``ValueError`` for a malformed ``listen`` and
    ``OSError`` when the address cannot be bound (both before ``started``).
    """
    from hypercorn.config import Config
    from hypercorn.trio import serve as hypercorn_serve

    host, port = parse_listen(listen)
    if not is_loopback(host):
        log.warning("admin API listening on non-loopback address %s: it has no authentication",
                    _hostport(host, port))
    config = Config()
    config.bind = [_hostport(host, port)]
    config.graceful_timeout = GRACEFUL_TIMEOUT
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    app = create_admin_app(target)
    shutdown = trio.Event()
    # Shielded: our cancellation becomes hypercorn's graceful shutdown (the trigger below)
    # rather than an abrupt cancel of its tasks; the deadline set at shutdown bounds the wait.
    inner = trio.CancelScope(shield=True)

    async def run(task_status=trio.TASK_STATUS_IGNORED) -> None:
        with inner:
            await hypercorn_serve(app, config, shutdown_trigger=shutdown.wait, task_status=task_status)

    started = False
    try:
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(run)
            bound = binds[0].split("://", 1)[-1] if binds else _hostport(host, port)
            log.info("admin API listening on %s", bound)
            task_status.started(bound)
            started = True
            try:
                await trio.sleep_forever()
            finally:
                shutdown.set()
                inner.deadline = trio.current_time() + GRACEFUL_TIMEOUT + 1
    except BaseExceptionGroup as group:
        # A failure to start (the bind) is one error under several nurseries: raise it bare.
        leaves = _leaves(group)
        if not started and len(leaves) == 1 and isinstance(leaves[0], Exception):
            raise leaves[0] from None
        raise


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for sub in error.exceptions for leaf in _leaves(sub)]
    return [error]


# ---------------------------------------------------------------- client side (memfuse status)


class StatusUnavailable(Exception):
    """Nothing answered with a status document; the message is one line for people."""


def read_status_file(mountpoint: Path) -> dict:
    """The status document at ``MOUNTPOINT/.memfuse/status.json``.

    Raises ``StatusUnavailable`` when there is no mount there, the mount does not answer
    (sidecar gone) or the file is not a JSON object.
    """
    path = mountpoint / ".memfuse" / "status.json"
    try:
        text = path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):
        raise StatusUnavailable(f"no memfuse mount at {mountpoint} ({path} not found)") from None
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            raise StatusUnavailable(f"the memfuse mount at {mountpoint} is not answering "
                                    "(sidecar stopped?); unmount it with fusermount3 -u") from None
        raise StatusUnavailable(f"cannot read {path}: {e.strerror or e}") from None
    return _status_object(text, str(path))


def fetch_status(admin_url: str, timeout: float = STATUS_TIMEOUT) -> dict:
    """``GET {admin_url}/v1/status`` (``admin_url`` like ``http://127.0.0.1:9464``; a bare
    ``HOST:PORT`` gets ``http://``), waiting at most ``timeout`` seconds.

    Raises ``StatusUnavailable`` when nothing answers, the answer is an error, or not a JSON
    object.
    """
    import httpx

    base = admin_url.strip().rstrip("/")
    if "://" not in base:
        base = "http://" + base
    url = base + "/v1/status"
    try:
        r = httpx.get(url, timeout=timeout)
    except httpx.InvalidURL as e:
        raise StatusUnavailable(f"invalid admin URL {admin_url!r}: {e}") from None
    except httpx.TimeoutException:
        raise StatusUnavailable(f"sidecar admin API at {base} did not answer within {timeout:g} s") from None
    except httpx.HTTPError as e:
        reason = " ".join(str(e).split()) or type(e).__name__
        raise StatusUnavailable(f"sidecar admin API not reachable at {base} ({reason})") from None
    if r.status_code != 200:
        detail = ""
        try:
            body = r.json()
            if isinstance(body, dict):
                detail = str(body.get("detail") or body.get("title") or "")
        except ValueError:
            pass
        raise StatusUnavailable(f"sidecar admin API at {base} answered HTTP {r.status_code}"
                                + (f": {' '.join(detail.split())}" if detail else ""))
    return _status_object(r.text, url)


def _status_object(text: str, where: str) -> dict:
    try:
        data = json.loads(text)
    except ValueError:
        raise StatusUnavailable(f"{where} is not valid JSON") from None
    if not isinstance(data, dict):
        raise StatusUnavailable(f"{where} is not a JSON object")
    return data


def _duration(seconds: Any) -> str:
    try:
        s = float(seconds)
    except (TypeError, ValueError):
        return str(seconds)
    if not math.isfinite(s):
        return str(seconds)
    if s < 60:
        return f"{s:.1f} s"
    m, sec = divmod(int(s), 60)
    h, m = divmod(m, 60)
    d, h = divmod(h, 24)
    if d:
        return f"{d}d {h}h {m}m"
    if h:
        return f"{h}h {m}m {sec}s"
    return f"{m}m {sec}s"


def _scalar(value: Any) -> str:
    if value is True:
        return "yes"
    if value is False:
        return "no"
    if value is None:
        return "-"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, default=str)
    return " ".join(str(value).split())


def _table(rows: list[list[str]], headers: list[str], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [headers, *rows]]


def _dict_table(items: list[dict], first: list[str], indent: str = "  ") -> list[str]:
    cols = [c for c in first if any(c in it for it in items)]
    for it in items:
        cols += [k for k in it if k not in cols]
    rows = [[_scalar(it.get(c)) for c in cols] for it in items]
    return _table(rows, [_label(c).upper() for c in cols], indent)


def _fields(d: dict, first: list[str], indent: str, durations: tuple[str, ...] = ()) -> list[str]:
    """``key: value`` lines (known keys first, then the rest), nesting dicts and lists."""
    keys = [k for k in first if k in d] + [k for k in d if k not in first]
    labels = {k: _label(k[:-2] if k in durations else k) for k in keys}
    width = max((len(x) for x in labels.values()), default=0)
    out: list[str] = []
    for k in keys:
        v, label = d[k], labels[k]
        if isinstance(v, dict):
            out.append(f"{indent}{label}:")
            out += _fields(v, [], indent + "  ", tuple(x for x in v if str(x).endswith("_s")))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            out.append(f"{indent}{label}: {len(v)}")
            out += _dict_table(v, [], indent + "  ")
        elif isinstance(v, list):
            out.append(f"{indent}{label}: " + (", ".join(_scalar(x) for x in v) if v else "-"))
        else:
            shown = _duration(v) if k in durations else _scalar(v)
            out.append(f"{indent}{(label + ':').ljust(width + 1)} {shown}")
    return out


def _label(key: Any) -> str:
    return " ".join(str(key).replace("_", " ").split())


def format_status(data: dict) -> str:
    """The status document for people: workspace, ready, uptime, one row per store (slug,
    access, records, then any other store keys), the outbox (depth, oldest age, committed,
    refused, retries, then any other keys), then every other key, nested ones indented.
    Keys ending in ``_s`` are durations in seconds and print as such."""
    out: list[str] = []
    head = {k: data[k] for k in ("workspace", "ready", "uptime_s") if k in data}
    out += _fields(head, ["workspace", "ready", "uptime_s"], "", ("uptime_s",))
    stores = data.get("stores")
    if isinstance(stores, list) and all(isinstance(s, dict) for s in stores):
        out.append(f"stores: {len(stores)}")
        if stores:
            out += _dict_table(stores, ["slug", "access", "records"])
    elif "stores" in data:
        out += _fields({"stores": stores}, [], "")
    outbox = data.get("outbox")
    if isinstance(outbox, dict):
        out.append("outbox:")
        out += _fields(outbox, ["depth", "oldest_age_s", "committed", "refused", "retries"], "  ",
                       tuple(k for k in outbox if k.endswith("_s")))
    elif "outbox" in data:
        out += _fields({"outbox": outbox}, [], "")
    rest = {k: v for k, v in data.items() if k not in ("workspace", "ready", "uptime_s", "stores", "outbox")}
    out += _fields(rest, [], "", tuple(k for k in rest if k.endswith("_s")))
    return "\n".join(out)
