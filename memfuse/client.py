"""Async HTTP client of the control-plane API v1 (docs/API.md), shared by the sidecar and the CLI.

One :class:`ApiClient` wraps one ``httpx.AsyncClient``; every endpoint of the API is a method that
returns the msgspec Structs of :mod:`memfuse.wire` (the client's side of the server's pydantic
models in :mod:`memfuse.models`: the client never imports pydantic). Methods never retry: the sidecar's outbox
owns retries (with idempotency keys), and the CLI wraps its calls in :func:`with_retries`.

Errors are classified once, here, so callers only look at the exception class (the classes
are in :mod:`memfuse.errors`):

- :class:`TransientError` — the request may succeed later: connection refused, timeouts, a
  response lost on the way back (``ReadError`` / ``RemoteProtocolError``), 5xx (except 507),
  429. Its
  ``retry_after`` carries the server's ``Retry-After`` in seconds when given.
- :class:`PermanentError` — the server refused for good (every other 4xx), with subclasses
  :class:`Unauthorized` (401), :class:`Forbidden` (403), :class:`NotFound` (404),
  :class:`Conflict` (409), :class:`Gone` (410), :class:`PreconditionFailed` (412), and
  :class:`StoreFull` (507 ``store_full``: a 5xx, but a refusal the API maps to ENOSPC).

Secrets: neither the token nor any record content ever goes into an exception message, an
exception attribute or a log line; messages carry the method, the URL path, the status, the
problem ``code``, ``title`` and ``detail``.

Streams (``stream=true``, docs/API.md "Streams"): :meth:`ApiClient.changes_stream` and
:meth:`ApiClient.events_stream` return a :class:`PageStream`, an async iterator of the pages
as the server sends them, with the fallback to long-polls told by ``PageStream.streaming``.

Why one module of ~1,200 lines: most of it is :class:`ApiClient`, one short method per
endpoint of docs/API.md in the same order (records, feeds, admin), all sharing ``_request`` /
``_call`` (``PageStream`` too); split by resource, a reader would lose the one-to-one reading
against the API document while no piece would be simpler.
"""
from __future__ import annotations

import contextvars
import email.utils
import functools
import json
import logging
import math
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import httpx
import msgspec

# The error classes live in memfuse.errors; importing them from here stays supported for
# callers outside this package (code inside memfuse imports them from memfuse.errors).
from .errors import (  # noqa: F401  (ERRNO_BY_CODE: re-exported only)
    ERRNO_BY_CODE,
    ApiError,
    Conflict,
    Forbidden,
    Gone,
    NotFound,
    PermanentError,
    PreconditionFailed,
    StoreFull,
    TransientError,
    Unauthorized,
)
from .tokenfile import TokenFile
from .wire import (
    Access,
    Attachment,
    AttachmentPut,
    BatchOperation,
    BatchRequest,
    BatchResponse,
    ChangePage,
    ConsolidationCreate,
    ConsolidationJob,
    EventPage,
    MemoryToolResult,
    MoveResult,
    PrefixMove,
    Record,
    SearchPage,
    IndexReport,
    RecordAttributes,
    RecordCreate,
    RecordMove,
    RecordPage,
    RecordUpdate,
    RecordAppend,
    Restore,
    Store,
    StoreCreate,
    StoreUpdate,
    TokenCreate,
    TokenCreated,
    TokenInfo,
    Version,
    Workspace,
    WorkspaceCreate,
    Account,
    AccountCreate,
    build,
    convert,
    decode,
    encode,
    to_jsonable,
)

__all__ = [
    "ApiClient",
    "ApiError",
    "TransientError",
    "PermanentError",
    "Unauthorized",
    "Forbidden",
    "NotFound",
    "Conflict",
    "Gone",
    "PreconditionFailed",
    "StoreFull",
    "PageStream",
    "STREAM_READ_TIMEOUT",
    "quote_etag",
    "unquote_etag",
    "parse_retry_after",
    "with_retries",
]

log = logging.getLogger("memfuse.client")


def _package_version() -> str:
    try:
        from importlib.metadata import version

        return version("memfuse")
    except Exception:  # not installed (running from a source tree)
        return "0"


_version = _package_version()

T = TypeVar("T")
P = TypeVar("P", ChangePage, EventPage)

INSTANCE_HEADER = "X-Memfuse-Instance"
#: s without a line before a stream counts as dead: two heartbeats (20 s each) and a margin
STREAM_READ_TIMEOUT = 45.0
IDEMPOTENCY_HEADER = "Idempotency-Key"


# ---------------------------------------------------------------- error classification


_STATUS_CLASSES: dict[int, type[PermanentError]] = {
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    410: Gone,
    412: PreconditionFailed,
    507: StoreFull,
}


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Parse a ``Retry-After`` header (RFC 9110 §10.2.3) into seconds ≥ 0.

    Accepts delay-seconds (``"5"``, also ``"1.5"``) or an HTTP-date; returns ``None`` when the
    header is absent or unparsable.
    """
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    try:
        secs = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        secs = when.timestamp() - (time.time() if now is None else now)
    if math.isnan(secs) or math.isinf(secs):
        return None
    return max(0.0, secs)


def quote_etag(sha256: str) -> str:
    """Return ``sha256`` as an entity tag for ``If-Match`` (RFC 9110 §8.8.3): ``"<sha256>"``.

    A value that already is an entity tag (starts with ``"`` or ``W/"``) or ``*`` is returned
    unchanged.
    """
    if sha256 == "*" or sha256.startswith('"') or sha256.startswith('W/"'):
        return sha256
    return f'"{sha256}"'


def unquote_etag(etag: str | None) -> str | None:
    """Return the opaque value of an entity tag (``W/"x"`` or ``"x"`` → ``x``); ``None`` stays
    ``None``."""
    if etag is None:
        return None
    etag = etag.strip()
    if etag.startswith("W/"):
        etag = etag[2:]
    if len(etag) >= 2 and etag[0] == etag[-1] == '"':
        etag = etag[1:-1]
    return etag


def _transport_error(exc: httpx.HTTPError, method: str, path: str) -> ApiError:
    """Classify an httpx exception raised before a complete response arrived."""
    if isinstance(exc, httpx.TimeoutException):
        code = {
            httpx.ConnectTimeout: "connect_timeout",
            httpx.ReadTimeout: "read_timeout",
            httpx.WriteTimeout: "write_timeout",
            httpx.PoolTimeout: "pool_timeout",
        }.get(type(exc), "timeout")
        cls: type[ApiError] = TransientError
    elif isinstance(exc, (httpx.UnsupportedProtocol, httpx.LocalProtocolError, httpx.InvalidURL)):
        # configuration or client bug: repeating cannot help
        code, cls = "client_error", PermanentError
    elif isinstance(exc, httpx.ConnectError):
        code, cls = "connect_error", TransientError
    elif isinstance(exc, httpx.ReadError):
        code, cls = "read_error", TransientError
    elif isinstance(exc, httpx.WriteError):
        code, cls = "write_error", TransientError
    elif isinstance(exc, httpx.RemoteProtocolError):
        code, cls = "protocol_error", TransientError
    else:  # NetworkError, ProxyError, DecodingError, StreamError, ...
        code, cls = "transport_error", TransientError
    reason = str(exc) or type(exc).__name__
    msg = f"{method} {path}: control plane unreachable ({type(exc).__name__}: {reason})"
    if cls is PermanentError:
        msg = f"{method} {path}: {type(exc).__name__}: {reason}"
    return cls(msg, code=code, detail=reason, method=method, path=path)


def _http_error(resp: httpx.Response, method: str, path: str) -> ApiError:
    """Build the exception for a non-2xx response from its problem body."""
    problem: dict[str, Any] = {}
    try:
        body = resp.json()
        if isinstance(body, dict):
            problem = body
    except ValueError:
        pass
    return _error_from(resp.status_code, problem, resp.reason_phrase, resp.headers.get("Retry-After"),
                       method, path)


def _error_from(status: int, problem: dict[str, Any], reason: str | None, retry_header: str | None,
                method: str, path: str) -> ApiError:
    """The exception for a refusal with HTTP ``status`` and ``problem`` body (a response's, or
    one operation's answer inside a batch)."""
    title = str(problem.get("title") or reason or "HTTP error")
    detail = problem.get("detail") or ""
    if not isinstance(detail, str):
        # A plain FastAPI 422 puts a list of {loc, msg, type, input} here; ``input`` may hold
        # record content, so keep only where and what.
        detail = _validation_summary(detail)
        problem = {k: v for k, v in problem.items() if k != "detail"}
        problem["detail"] = detail
    code = str(problem.get("code") or "")
    if not problem:
        problem = {"type": "about:blank", "title": title, "status": status}
    retry_after = None
    if status in _STATUS_CLASSES:
        cls: type[ApiError] = _STATUS_CLASSES[status]
    elif status >= 500 or status in (408, 429):  # 408: the body was too slow; send it again
        cls = TransientError
        retry_after = parse_retry_after(retry_header)
    elif 400 <= status < 500:
        cls = _STATUS_CLASSES.get(status, PermanentError)
    else:  # 1xx/3xx that httpx did not handle: nothing sensible to do again
        cls = PermanentError
    msg = f"{method} {path}: {status} {title}"
    if code:
        msg += f" [{code}]"
    if detail:
        msg += f": {detail}"
    return cls(
        _one_line(msg),
        status=status,
        code=code,
        detail=detail,
        title=title,
        problem=problem,
        retry_after=retry_after,
        method=method,
        path=path,
    )


def _validation_summary(detail: Any) -> str:
    """``loc: msg; ...`` from a list of validation errors, without their ``input`` values."""
    parts = []
    if isinstance(detail, list):
        for item in detail[:10]:
            if isinstance(item, dict):
                loc = ".".join(str(x) for x in item.get("loc", ()) or ())
                parts.append(f"{loc}: {item.get('msg', '')}".strip(": "))
    return _one_line("; ".join(parts))[:500] or "invalid request"


def _one_line(text: str) -> str:
    return " ".join(text.split())


class _Unset:
    """The type of ``UNSET``: an argument not passed (``None`` means "reset")."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET = _Unset()


def _attrs(mode: int | None, mtime_ns: int | None) -> dict[str, int]:
    """The attribute members of a create / update body: only those given."""
    out = {}
    if mode is not None:
        out["mode"] = mode
    if mtime_ns is not None:
        out["mtime_ns"] = mtime_ns
    return out


def _memory_tool_command(command: dict[str, Any]) -> dict[str, Any]:
    """The memory-tool body: ``command`` first, then the command's other members as given.
    Raises ``ValueError`` (``msgspec.ValidationError``) when ``command`` is not a JSON object
    with a string ``command``."""
    if not isinstance(command, dict) or not isinstance(command.get("command"), str):
        raise msgspec.ValidationError("a memory-tool command is an object with a string `command`")
    return {"command": command["command"], **{k: v for k, v in command.items() if k != "command"}}


def _seg(value: str | int) -> str:
    """Percent-encode one URL path segment."""
    return quote(str(value), safe="")


def _bool(value: bool) -> str:
    return "true" if value else "false"


_BATCH_ENDPOINTS = {  # op of a batch → (method, path) of its single endpoint (for errors)
    "create": ("POST", "/v1/stores/{store}/records"),
    "update": ("PUT", "/v1/stores/{store}/records/{id}"),
    "append": ("POST", "/v1/stores/{store}/records/{id}/append"),
    "attrs": ("PATCH", "/v1/stores/{store}/records/{id}"),
    "move": ("POST", "/v1/stores/{store}/records/{id}/move"),
    "delete": ("DELETE", "/v1/stores/{store}/records/{id}"),
}
_RECORDS = list[Record]
_STORES = list[Store]
_JOBS = list[ConsolidationJob]
_WORKSPACES = list[Workspace]
_ACCOUNTS = list[Account]
_ATTACHMENTS = list[Attachment]
_VERSIONS = list[Version]
_TOKENS = list[TokenInfo]


@functools.cache
def _verifying_context() -> ssl.SSLContext:
    return httpx.create_ssl_context()


def tls_context(base_url: str) -> ssl.SSLContext:
    """The TLS context for a control plane at ``base_url``.

    ``https://``: httpx's default, built once per process and shared: verifies the server's
    certificate and host name against ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` when set, else
    certifi's CA bundle. Any other scheme (plain ``http://`` on a pod network or loopback):
    a context that loads no CA bundle at all (loading one costs ~2 MiB of the sidecar's
    baseline memory) and still requires a verified certificate, so it can never complete a
    TLS handshake: nothing is sent unverified (redirects are not followed either).
    """
    if base_url.lower().startswith("https:"):
        return _verifying_context()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED, check_hostname, no CAs
    return ctx


# ---------------------------------------------------------------- client


class ApiClient:
    """Async client of the control-plane API v1.

    Args:
        base_url: the control plane's root URL, e.g. ``http://127.0.0.1:8080`` (no ``/v1``).
        token: bearer token (workspace-scoped or admin); ``None`` sends no ``Authorization``.
            A :class:`~memfuse.tokenfile.TokenFile` is read on every request, and refreshed
            (``stat``, re-read if changed) on every 401: when that yields a different token,
            the request is sent once more with it (nothing was applied: a 401 is answered
            before anything is done, and writes carry their idempotency key anyway).
        transport: an httpx transport (``httpx.ASGITransport`` for in-process use, the fake's
            fault-injecting transport in tests); default: real network.
        instance: sidecar id sent as ``X-Memfuse-Instance`` (recorded in version actors).
        timeout: seconds for connect, read, write and pool waits of ordinary calls. Long-poll
            calls (``wait > 0``) get a read timeout of ``wait + timeout``.

    Use as ``async with ApiClient(...) as api:`` or call :meth:`aclose`. Every method raises
    :class:`TransientError` or :class:`PermanentError` (see the module docstring); none retries
    (except the one resend with a refreshed token file above).

    Authentication state: :attr:`auth_failure` is ``None`` while the token works, else the
    problem detail of the last 401 answered to the token in use, until any other answer
    arrives; :attr:`auth_failures` counts 401 answers; ``auth_listener(ok)`` (if set) is called
    with ``False`` on each such 401 and with ``True`` when an answer ends a failure.
    """

    def __init__(
        self,
        base_url: str,
        token: str | TokenFile | None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        instance: str | None = None,
        timeout: float = 30.0,
    ) -> None:
        headers = {"User-Agent": f"memfuse/{_version}", "Accept": "application/json"}
        self.token_file: TokenFile | None = token if isinstance(token, TokenFile) else None
        if token and self.token_file is None:
            headers["Authorization"] = f"Bearer {token}"
        self.auth_failure: str | None = None
        self.auth_failures = 0
        self.auth_listener: Callable[[bool], None] | None = None
        if instance:
            headers[INSTANCE_HEADER] = instance
        self.base_url = base_url.rstrip("/")
        self.instance = instance
        #: called as ``observer(endpoint, status, seconds)`` after every request (metrics);
        #: ``endpoint`` is a low-cardinality template such as ``PUT /v1/stores/{}/records/{}``
        self.observer: Callable[[str, str, float], None] | None = None
        self.timeout = float(timeout)
        #: ordinary requests waiting for an answer (not long polls or streams): a number per
        #: request → when it was sent (``time.monotonic()``); ``no_answer_for`` reads it
        self._waiting: dict[int, float] = {}
        self._next_request = 0
        #: when the control plane last answered anything (``time.monotonic()``; 0: never)
        self.last_answer = 0.0
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            transport=transport,
            verify=tls_context(self.base_url),
            timeout=httpx.Timeout(self.timeout),
            limits=httpx.Limits(max_connections=200, max_keepalive_connections=50),
            follow_redirects=False,
        )

    def set_instance(self, instance: str) -> None:
        """Send ``X-Memfuse-Instance: instance`` from now on (the sidecar id on versions)."""
        self.instance = instance
        self._http.headers[INSTANCE_HEADER] = instance

    def no_answer_for(self) -> float:
        """Seconds the oldest ordinary request (not a long poll or a stream) has been waiting
        while the control plane answered nothing at all: 0 when none waits or an answer to
        any request arrived since it was sent. A hung control plane (a paused process, a
        black-holed network) shows here within seconds, long before the request's own read
        timeout (``timeout``)."""
        if not self._waiting:
            return 0.0
        oldest = min(self._waiting.values())
        if self.last_answer >= oldest:
            return 0.0
        return max(0.0, time.monotonic() - oldest)

    def _observe(self, method: str, path: str, status: str, t0: float) -> None:
        if self.observer is not None:
            try:
                self.observer(endpoint_label(method, path), status, time.perf_counter() - t0)
            except Exception:  # metrics must never break a call
                log.debug("API call observer failed", exc_info=True)

    def __repr__(self) -> str:  # never show the token
        return f"ApiClient({self.base_url!r}, instance={self.instance!r})"

    async def __aenter__(self) -> ApiClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool. Idempotent."""
        await self._http.aclose()

    # ------------------------------------------------------------ plumbing

    async def _request(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        body: msgspec.Struct | dict[str, Any] | None = None,
        if_match: str | None = None,
        idempotency_key: str | None = None,
        wait: float = 0.0,
        accept: str | None = None,
        exclude_none: bool = False,
        stream: bool = False,
        read_timeout: float | None = None,
    ) -> httpx.Response:
        headers: dict[str, str] = {}
        if if_match is not None:
            headers["If-Match"] = quote_etag(if_match)
        if idempotency_key is not None:
            headers[IDEMPOTENCY_HEADER] = idempotency_key
        if accept is not None:
            headers["Accept"] = accept
        timeout = None
        if wait > 0:
            timeout = httpx.Timeout(self.timeout, read=wait + self.timeout)
        if read_timeout is not None:
            timeout = httpx.Timeout(self.timeout, read=read_timeout)
        kwargs: dict[str, Any] = {"params": params, "headers": headers}
        if timeout is not None:
            kwargs["timeout"] = timeout
        if body is not None:
            # UNSET members are left out (pydantic's exclude_unset of earlier releases: the
            # same bodies, so the same idempotency hashes)
            kwargs["content"] = encode(body, exclude_none=exclude_none)
            headers["Content-Type"] = "application/json"
        tf = self.token_file
        for attempt in (1, 2):
            generation = None
            if tf is not None:
                generation = tf.generation
                headers["Authorization"] = f"Bearer {tf.token}"
            t0 = time.perf_counter()
            ordinary = wait <= 0 and not stream and read_timeout is None
            if ordinary:
                self._next_request += 1
                rid = self._next_request
                self._waiting[rid] = time.monotonic()
            try:
                resp = await self._http.send(self._http.build_request(method, path, **kwargs), stream=stream)
                if stream and not resp.is_success:
                    await resp.aread()
            except httpx.HTTPError as exc:
                err = _transport_error(exc, method, path)
                log.debug("%s %s failed: %s", method, path, err.code)
                self._observe(method, path, err.code or "error", t0)
                raise err from None
            finally:
                if ordinary:
                    del self._waiting[rid]
            self.last_answer = time.monotonic()
            self._observe(method, path, str(resp.status_code), t0)
            log.debug("%s %s -> %s", method, path, resp.status_code)
            if resp.status_code != 401:
                self._auth_ok()
                break
            if tf is not None and attempt == 1 and (tf.generation != generation or tf.refresh()):
                log.info("%s %s: token refused; sending again with the token file's new token",
                         method, path)
                await resp.aclose()
                continue
            if tf is None or tf.generation == generation:  # refused: the token in use
                self._auth_failed(resp)
            break
        if not resp.is_success:
            if stream:
                await resp.aclose()
            raise _http_error(resp, method, path)
        return resp

    def _auth_ok(self) -> None:
        if self.auth_failure is not None:
            self.auth_failure = None
            log.info("the control plane accepts the token again")
            self._tell_auth(True)

    def _auth_failed(self, resp: httpx.Response) -> None:
        self.auth_failures += 1
        detail = "token refused (401)"
        try:
            body = resp.json()
            if isinstance(body, dict) and isinstance(body.get("detail"), str) and body["detail"]:
                detail = f"token refused (401): {body['detail'][:200]}"
        except ValueError:
            pass
        if self.auth_failure is None:
            log.warning("the control plane refused the token",
                        extra={"detail": detail,
                               "token_file": str(self.token_file.path) if self.token_file else None})
        self.auth_failure = detail
        self._tell_auth(False)

    def _tell_auth(self, ok: bool) -> None:
        if self.auth_listener is not None:
            try:
                self.auth_listener(ok)
            except Exception:  # a listener must never break a call
                log.exception("auth listener failed")

    def refresh_token(self) -> bool:
        """Refresh the token file (if any); True when a different token is in use now."""
        return self.token_file.refresh() if self.token_file is not None else False

    @staticmethod
    def _parse(model: Any, resp: httpx.Response, method: str, path: str) -> Any:
        """``resp``'s body decoded as ``model`` (a Struct or ``list[Struct]``); a body that is
        not JSON of that shape raises ``TransientError`` ``bad_response``."""
        return ApiClient._parse_bytes(model, resp.content, resp.status_code, method, path)

    @staticmethod
    def _parse_bytes(model: Any, data: bytes, status: int, method: str, path: str) -> Any:
        try:
            return decode(data, model)
        except ValueError as exc:  # msgspec.DecodeError / ValidationError
            # A 2xx whose body is not what the contract says: treat like a garbled response.
            raise TransientError(
                f"{method} {path}: {status} response does not match the API contract"
                f" ({type(exc).__name__})",
                status=status,
                code="bad_response",
                method=method,
                path=path,
            ) from None

    async def _call(self, model: Any, method: str, path: str, **kw: Any) -> Any:
        resp = await self._request(method, path, **kw)
        return self._parse(model, resp, method, path)

    # ------------------------------------------------------------ workspace endpoints

    async def list_attachments(self, ws: str) -> list[Attachment]:
        """``GET /v1/workspaces/{ws}/attachments``: the stores attached to ``ws``, sorted by
        slug. Raises NotFound (``workspace_not_found``), Forbidden for another workspace."""
        return await self._call(_ATTACHMENTS, "GET", f"/v1/workspaces/{_seg(ws)}/attachments")

    async def workspace_events(self, ws: str, after: int = 0, wait: float = 0) -> EventPage:
        """``GET /v1/workspaces/{ws}/events``: attach / detach / store_changed events with
        seq > ``after``; long-polls up to ``wait`` seconds (0–60) while there are none.
        Resume with ``after=page.seq``."""
        return await self._call(
            EventPage,
            "GET",
            f"/v1/workspaces/{_seg(ws)}/events",
            params={"after": after, "wait": _num(wait)},
            wait=wait,
        )

    def events_stream(self, ws: str, after: int,
                      read_timeout: float = STREAM_READ_TIMEOUT) -> PageStream[EventPage]:
        """``GET /v1/workspaces/{ws}/events?stream=true``: the event pages as they come, and
        heartbeats; everything else as ``changes_stream`` (403 / 404 instead of 410)."""
        return PageStream(self, EventPage, f"/v1/workspaces/{_seg(ws)}/events",
                          {"after": after, "stream": "true"}, read_timeout)

    async def context(self, ws: str, mount_root: str | None = None,
                      max_bytes: int | None = None, mounted: bool = True) -> str:
        """``GET /v1/workspaces/{ws}/context``: the Markdown prompt block (docs/API.md, "Prompt block") as text.
        ``mount_root`` is where the sidecar mounts the stores (server default
        ``/mnt/memory``); ``mounted=False`` for an agent without a mount (no line on the
        mount's ``.memfuse/errors.log``)."""
        params: dict[str, Any] = {}
        if not mounted:
            params["mounted"] = "false"
        if mount_root is not None:
            params["mount_root"] = mount_root
        if max_bytes is not None:
            params["max_bytes"] = max_bytes
        resp = await self._request(
            "GET",
            f"/v1/workspaces/{_seg(ws)}/context",
            params=params or None,
            accept="text/markdown, text/plain, */*",
        )
        return resp.text

    async def index_report(self, store: str) -> IndexReport:
        """``GET /v1/stores/{store}/index``: how the store's ``MEMORY.md`` and its records
        agree (docs/API.md, "Index report"). Raises :class:`~memfuse.errors.ApiError`."""
        return await self._call(IndexReport, "GET", f"/v1/stores/{_seg(store)}/index")

    async def create_consolidation(self, store: str, instructions: str, output: str = "new_store",
                                   model: str | None = None, include_history: bool = False) -> ConsolidationJob:
        """``POST /v1/stores/{store}/consolidations``: start a consolidation job (docs/API.md,
        "Consolidation jobs"); the job comes back ``pending``. Raises Conflict
        (``job_running``, ``consolidation_disabled``), NotFound, Forbidden, PermanentError
        (413 ``input_too_large``); ``ValueError`` before any request for a bad body."""
        body = build(ConsolidationCreate, instructions=instructions, output=output, model=model,
                     include_history=include_history)
        return await self._call(ConsolidationJob, "POST", f"/v1/stores/{_seg(store)}/consolidations", body=body)

    async def get_consolidation(self, job_id: str) -> ConsolidationJob:
        """``GET /v1/consolidations/{id}``. Raises NotFound (``job_not_found``)."""
        return await self._call(ConsolidationJob, "GET", f"/v1/consolidations/{_seg(job_id)}")

    async def list_consolidations(self, store: str, limit: int = 100) -> list[ConsolidationJob]:
        """``GET /v1/stores/{store}/consolidations``: the store's jobs, newest first."""
        return await self._call(_JOBS, "GET", f"/v1/stores/{_seg(store)}/consolidations", params={"limit": limit})

    async def cancel_consolidation(self, job_id: str) -> ConsolidationJob:
        """``POST /v1/consolidations/{id}/cancel``. Raises NotFound, Conflict (``job_finished``)."""
        return await self._call(ConsolidationJob, "POST", f"/v1/consolidations/{_seg(job_id)}/cancel")

    async def memory_tool(self, ws: str, command: dict[str, Any]) -> MemoryToolResult:
        """``POST /v1/workspaces/{ws}/memory-tool``: run one memory-tool command (the model's
        ``tool_use.input`` as is) on the workspace's stores. A refused command is a result
        with ``is_error`` true, not an exception; raises for auth and transport problems."""
        return await self._call(
            MemoryToolResult, "POST", f"/v1/workspaces/{_seg(ws)}/memory-tool",
            body=_memory_tool_command(command),
        )

    async def search(
        self,
        store: str,
        q: str,
        *,
        match: str = "any",
        prefix: str = "",
        type: str | None = None,
        case_sensitive: bool = False,
        cursor: str | None = None,
        limit: int = 20,
        max_lines: int = 5,
        order: str = "path",
    ) -> SearchPage:
        """``GET /v1/stores/{store}/search``: one page of the live records whose path
        (``match="path"``), content (``"content"``) or either (``"any"``) hold ``q``
        (literal, one line, 1–256 characters), in path order, each with its first
        ``max_lines`` matching lines (docs/API.md, "Search"). ``prefix`` limits it to a file
        or directory; ``limit`` 1–100 records a page; follow ``next_cursor``. ``order=
        "relevance"``: ranked by the full-text index instead, best first, with ``score`` and
        ``snippet`` per hit. Raises :class:`~memfuse.errors.ApiError` (422 ``invalid_query``
        and friends for bad input)."""
        params: dict[str, Any] = {"q": q, "match": match, "limit": limit, "max_lines": max_lines,
                                  "case_sensitive": _bool(case_sensitive)}
        if order != "path":
            params["order"] = order
        if prefix:
            params["prefix"] = prefix
        if type is not None:
            params["type"] = type
        if cursor is not None:
            params["cursor"] = cursor
        return await self._call(SearchPage, "GET", f"/v1/stores/{_seg(store)}/search", params=params)

    # ------------------------------------------------------------ records: reading

    async def list_records(
        self,
        store: str,
        cursor: str | None = None,
        limit: int = 500,
        content: bool = False,
        path: str | None = None,
        include_deleted: bool = False,
    ) -> RecordPage:
        """``GET /v1/stores/{store}/records``: one snapshot page of live records ordered by path
        (plus deleted ones with ``include_deleted``). ``limit`` 1–1000; ``path`` filters on an
        exact path; ``page.seq`` is the change-feed position read before the page;
        ``page.next_cursor`` is None on the last page."""
        params: dict[str, Any] = {"limit": limit, "content": _bool(content)}
        if cursor is not None:
            params["cursor"] = cursor
        if path is not None:
            params["path"] = path
        if include_deleted:
            params["include_deleted"] = "true"
        return await self._call(RecordPage, "GET", f"/v1/stores/{_seg(store)}/records", params=params)

    async def iter_pages(
        self, store: str, *, content: bool = True, limit: int = 500, include_deleted: bool = False
    ) -> AsyncIterator[RecordPage]:
        """Async generator over every snapshot page of ``store`` (``list_records`` pages of
        ``limit`` records, deleted ones too with ``include_deleted``), following
        ``next_cursor``: the one paging loop of the client and its callers.

        The first page's ``seq`` is where to resume the change feed (``changes(after=seq)``);
        applying a change the snapshot already contains is harmless. Raises what
        ``list_records`` raises (:class:`~memfuse.errors.ApiError`); no retries.
        """
        cursor: str | None = None
        while True:
            page = await self.list_records(
                store, cursor=cursor, limit=limit, content=content, include_deleted=include_deleted
            )
            yield page
            if not page.next_cursor:
                return
            cursor = page.next_cursor

    async def snapshot(
        self, store: str, *, content: bool = True, limit: int = 500, include_deleted: bool = False
    ) -> tuple[list[Record], int]:
        """Every live record of ``store`` (all pages of ``iter_pages``; deleted ones too with
        ``include_deleted``) and the change-feed seq to resume from (the first page's
        ``seq``). Returns ``(records ordered by (path, id), seq)``."""
        records: list[Record] = []
        seq: int | None = None
        async for page in self.iter_pages(store, content=content, limit=limit, include_deleted=include_deleted):
            if seq is None:
                seq = page.seq
            records.extend(page.records)
        assert seq is not None
        return records, seq

    async def find_record(self, store: str, path: str, include_deleted: bool = False) -> Record | None:
        """The record at ``path`` (exact, via the ``path=`` filter), or ``None``.

        With ``include_deleted`` a deleted record may be returned; when several records had
        that path (deleted, then created anew), the live one wins, else the most recently
        updated deleted one. Content is not included.
        """
        page = await self.list_records(store, limit=1000, path=path, include_deleted=include_deleted)
        found = [r for r in page.records if r.path == path]
        if not found:
            return None
        live = [r for r in found if not r.deleted]
        if live:
            return live[0]
        return max(found, key=lambda r: (r.updated_at, r.seq))

    async def get_record(self, store: str, id: str, content: bool = True) -> Record:
        """``GET /v1/stores/{store}/records/{id}``: the record (deleted ones have
        ``deleted=True``). Raises NotFound (``record_not_found``)."""
        return await self._call(
            Record,
            "GET",
            f"/v1/stores/{_seg(store)}/records/{_seg(id)}",
            params={"content": _bool(content)},
        )

    async def changes(
        self,
        store: str,
        after: int,
        wait: float = 0,
        content: bool = True,
        limit: int = 1000,
        skip_actor: str | None = None,
    ) -> ChangePage:
        """``GET /v1/stores/{store}/changes``: versions with seq > ``after``, oldest first;
        long-polls up to ``wait`` s (0–60) while empty. Resume with ``after=page.seq``.
        ``skip_actor``: leave out versions whose actor is exactly this (a sidecar's own
        writes, ``ws:<workspace>/<instance>``); ``page.seq`` still moves past them, so a page
        may be empty with a new ``seq``, and the long-poll keeps waiting while only such
        versions arrive.
        Raises Gone (410 ``cursor_expired``) when ``after`` is unknown → take a snapshot."""
        params: dict[str, Any] = {"after": after, "wait": _num(wait), "content": _bool(content), "limit": limit}
        if skip_actor:
            params["skip_actor"] = skip_actor
        return await self._call(
            ChangePage,
            "GET",
            f"/v1/stores/{_seg(store)}/changes",
            params=params,
            wait=wait,
        )

    def changes_stream(
        self,
        store: str,
        after: int,
        content: bool = True,
        limit: int = 1000,
        skip_actor: str | None = None,
        read_timeout: float = STREAM_READ_TIMEOUT,
    ) -> PageStream[ChangePage]:
        """``GET /v1/stores/{store}/changes?stream=true`` (docs/API.md, "Streams"): an async
        iterator of the pages ``changes`` would answer, each as soon as the server has it, and
        heartbeat pages (no changes, the current ``seq``) while nothing happens. Resume with
        ``after=page.seq`` of the last page seen. Iteration ends when the server ends the
        stream (its lifetime, its shutdown): open a new one from the cursor.

        A server that does not stream answers one ordinary page: it is yielded, iteration
        ends and ``streaming`` is False (so is a 400, or a 404 / 405 naming no resource, for
        the parameter, with nothing yielded): long-poll instead. Raises what ``changes``
        raises (Gone → snapshot), also mid-stream (the server's error line), and
        ``TransientError`` ``read_timeout`` when no line arrived for ``read_timeout`` s (a
        dead connection; the server sends one at least every 20 s). Use as ``async with
        aclosing(stream)`` or call ``aclose``."""
        params: dict[str, Any] = {"after": after, "stream": "true", "content": _bool(content), "limit": limit}
        if skip_actor:
            params["skip_actor"] = skip_actor
        return PageStream(self, ChangePage, f"/v1/stores/{_seg(store)}/changes", params, read_timeout)

    async def versions(self, store: str, id: str) -> list[Version]:
        """``GET .../records/{id}/versions``: every version without content, oldest first."""
        return await self._call(
            _VERSIONS, "GET", f"/v1/stores/{_seg(store)}/records/{_seg(id)}/versions"
        )

    async def version(self, store: str, id: str, n: int) -> Version:
        """``GET .../records/{id}/versions/{n}``: version ``n`` with content (``None`` when
        redacted). Raises NotFound (``version_not_found``)."""
        return await self._call(
            Version, "GET", f"/v1/stores/{_seg(store)}/records/{_seg(id)}/versions/{int(n)}"
        )

    # ------------------------------------------------------------ records: writing

    async def create_record(
        self,
        store: str,
        path: str,
        content: str,
        type: str | None = None,
        idempotency_key: str | None = None,
        *,
        mode: int | None = None,
        mtime_ns: int | None = None,
    ) -> Record:
        """``POST /v1/stores/{store}/records``: create a record; returns it without content
        (its ``sha256`` is the ETag). ``mode``: permission bits (None: 0o644); ``mtime_ns``:
        an explicit modification time in ns since the epoch (None: ``updated_at``). Raises
        Conflict (``path_exists``, see ``.record_id``), PermanentError 413
        (``record_too_large``) / 422 (``invalid_path``, ``invalid_type``,
        ``secret_detected``, ...), StoreFull (507)."""
        return await self._call(
            Record,
            "POST",
            f"/v1/stores/{_seg(store)}/records",
            body=build(RecordCreate, path=path, content=content, type=type, **_attrs(mode, mtime_ns)),
            idempotency_key=idempotency_key,
        )

    async def update_record(
        self,
        store: str,
        id: str,
        content: str,
        type: str | None = None,
        if_match: str | None = None,
        idempotency_key: str | None = None,
        *,
        mode: int | None = None,
        mtime_ns: int | None = None,
    ) -> Record:
        """``PUT /v1/stores/{store}/records/{id}``: new content (and type, attributes).
        ``if_match`` is the base sha256 (quoted for you). ``mode`` None keeps the permission
        bits; ``mtime_ns`` None keeps an explicit mtime when the content is the same and
        clears it when it changes. Identical content, type and attributes make no new
        version. Raises PreconditionFailed (see ``.current_sha256``), NotFound for a deleted
        record."""
        return await self._call(
            Record,
            "PUT",
            f"/v1/stores/{_seg(store)}/records/{_seg(id)}",
            body=build(RecordUpdate, content=content, type=type, **_attrs(mode, mtime_ns)),
            if_match=if_match,
            idempotency_key=idempotency_key,
        )

    async def append_record(
        self,
        store: str,
        id: str,
        suffix: str,
        if_match: str,
        type: str | None = None,
        idempotency_key: str | None = None,
        *,
        mode: int | None = None,
        mtime_ns: int | None = None,
    ) -> Record:
        """``POST /v1/stores/{store}/records/{id}/append``: the record's content becomes its
        current content plus ``suffix``, sent as only the suffix. ``if_match`` (required) is
        the sha256 of the version ``suffix`` extends. Answers and raises as
        ``update_record`` (PreconditionFailed when the record changed since)."""
        return await self._call(
            Record,
            "POST",
            f"/v1/stores/{_seg(store)}/records/{_seg(id)}/append",
            body=build(RecordAppend, append=suffix, type=type, **_attrs(mode, mtime_ns)),
            if_match=if_match,
            idempotency_key=idempotency_key,
        )

    async def set_attributes(
        self,
        store: str,
        id: str,
        *,
        mode: int | None | _Unset = UNSET,
        mtime_ns: int | None | _Unset = UNSET,
        if_match: str | None = None,
        idempotency_key: str | None = None,
    ) -> Record:
        """``PATCH /v1/stores/{store}/records/{id}``: change only the record's attributes
        (no content is sent). ``mode``: permission bits (``& 0o7777``), ``None`` resets to
        0o644; ``mtime_ns``: modification time in ns since the epoch, ``None`` clears it (the
        record then shows ``updated_at``); a member not passed is kept. A change makes a
        ``modified`` version with the same sha256; no change makes none. Raises NotFound for
        a missing or deleted record, PreconditionFailed when ``if_match`` is not the current
        sha256; ``ValueError`` (``msgspec.ValidationError``) for a mode or time out of range,
        before anything is sent."""
        given: dict[str, int | None] = {}
        if not isinstance(mode, _Unset):
            given["mode"] = mode
        if not isinstance(mtime_ns, _Unset):
            given["mtime_ns"] = mtime_ns
        return await self._call(
            Record,
            "PATCH",
            f"/v1/stores/{_seg(store)}/records/{_seg(id)}",
            body=build(RecordAttributes, **given),
            if_match=if_match,
            idempotency_key=idempotency_key,
        )

    async def move_record(
        self,
        store: str,
        id: str,
        path: str,
        replace: bool = False,
        if_match: str | None = None,
        idempotency_key: str | None = None,
    ) -> MoveResult:
        """``POST .../records/{id}/move``: move one record to ``path``; with ``replace`` an
        existing target keeps its id and gets this content. Returns the one resulting record.
        Raises Conflict (``path_exists``) when the target is taken and not ``replace``."""
        return await self._call(
            MoveResult,
            "POST",
            f"/v1/stores/{_seg(store)}/records/{_seg(id)}/move",
            body=build(RecordMove, path=path, replace=replace),
            if_match=if_match,
            idempotency_key=idempotency_key,
        )

    async def move_prefix(
        self, store: str, from_prefix: str, to_prefix: str, idempotency_key: str | None = None
    ) -> MoveResult:
        """``POST /v1/stores/{store}/move``: move every record under ``from_prefix/`` to
        ``to_prefix/`` in one transaction; returns every moved record. Raises Conflict
        (``path_exists``), PermanentError 422 (``invalid_path``)."""
        return await self._call(
            MoveResult,
            "POST",
            f"/v1/stores/{_seg(store)}/move",
            body=build(PrefixMove, from_prefix=from_prefix, to_prefix=to_prefix),
            idempotency_key=idempotency_key,
        )

    async def delete_record(
        self, store: str, id: str, if_match: str | None = None, idempotency_key: str | None = None
    ) -> None:
        """``DELETE /v1/stores/{store}/records/{id}``: delete (a ``deleted`` version is kept).
        Raises NotFound when already deleted, PreconditionFailed on ``if_match`` mismatch."""
        await self._request(
            "DELETE",
            f"/v1/stores/{_seg(store)}/records/{_seg(id)}",
            if_match=if_match,
            idempotency_key=idempotency_key,
        )

    # ------------------------------------------------------------ records: batches
    # Each builder gives the operation exactly as the single method above sends it (same
    # body, same If-Match, same key), so a key first sent alone and then inside a batch (or
    # the other way round) is the same request to the server.

    @staticmethod
    def batch_create(path: str, content: str, type: str | None = None, idempotency_key: str | None = None,
                     *, mode: int | None = None, mtime_ns: int | None = None) -> BatchOperation:
        """The ``create_record`` operation of a batch."""
        body = build(RecordCreate, path=path, content=content, type=type, **_attrs(mode, mtime_ns))
        return build(BatchOperation, op="create", idempotency_key=idempotency_key, body=to_jsonable(body))

    @staticmethod
    def batch_update(id: str, content: str, type: str | None = None, if_match: str | None = None,
                     idempotency_key: str | None = None, *, mode: int | None = None,
                     mtime_ns: int | None = None) -> BatchOperation:
        """The ``update_record`` operation of a batch."""
        body = build(RecordUpdate, content=content, type=type, **_attrs(mode, mtime_ns))
        return build(BatchOperation, op="update", record_id=id, idempotency_key=idempotency_key,
                     if_match=quote_etag(if_match) if if_match is not None else None,
                     body=to_jsonable(body))

    @staticmethod
    def batch_append(id: str, suffix: str, if_match: str, type: str | None = None,
                     idempotency_key: str | None = None, *, mode: int | None = None,
                     mtime_ns: int | None = None) -> BatchOperation:
        """The ``append_record`` operation of a batch."""
        body = build(RecordAppend, append=suffix, type=type, **_attrs(mode, mtime_ns))
        return build(BatchOperation, op="append", record_id=id, idempotency_key=idempotency_key,
                     if_match=quote_etag(if_match), body=to_jsonable(body))

    @staticmethod
    def batch_attrs(id: str, *, mode: int | None | _Unset = UNSET, mtime_ns: int | None | _Unset = UNSET,
                    if_match: str | None = None, idempotency_key: str | None = None) -> BatchOperation:
        """The ``set_attributes`` operation of a batch."""
        given: dict[str, int | None] = {}
        if not isinstance(mode, _Unset):
            given["mode"] = mode
        if not isinstance(mtime_ns, _Unset):
            given["mtime_ns"] = mtime_ns
        body = build(RecordAttributes, **given)
        return build(BatchOperation, op="attrs", record_id=id, idempotency_key=idempotency_key,
                     if_match=quote_etag(if_match) if if_match is not None else None,
                     body=to_jsonable(body))

    @staticmethod
    def batch_move(id: str, path: str, replace: bool = False, if_match: str | None = None,
                   idempotency_key: str | None = None) -> BatchOperation:
        """The ``move_record`` operation of a batch."""
        return build(BatchOperation, op="move", record_id=id, idempotency_key=idempotency_key,
                     if_match=quote_etag(if_match) if if_match is not None else None,
                     body=to_jsonable(build(RecordMove, path=path, replace=replace)))

    @staticmethod
    def batch_delete(id: str, if_match: str | None = None, idempotency_key: str | None = None) -> BatchOperation:
        """The ``delete_record`` operation of a batch."""
        return build(BatchOperation, op="delete", record_id=id, idempotency_key=idempotency_key,
                     if_match=quote_etag(if_match) if if_match is not None else None)

    async def batch(self, store: str, operations: list[BatchOperation]) -> list[Any]:
        """``POST /v1/stores/{store}/batch``: apply ``operations`` (at most
        ``BATCH_MAX_OPERATIONS``, built with the ``batch_*`` builders) in order in one
        transaction. Returns one outcome per operation, in order: what its single method would
        have returned (``Record`` for create / update / attrs, ``MoveResult`` for move, None
        for delete), or the ``ApiError`` it would have raised (not raised here: a refused
        operation leaves nothing, the others are applied).

        Raises for the batch as a whole (nothing applied): ``TransientError`` (retry the same
        operations: their keys replay what was applied), ``Unauthorized``, ``Forbidden``,
        ``NotFound`` (the store, or a server without the endpoint: ``code`` ``not_found``;
        also ``PermanentError`` 405), ``PermanentError`` 413 ``batch_too_large``."""
        path = f"/v1/stores/{_seg(store)}/batch"
        # BatchOperation leaves out its None members (pydantic's exclude_none of earlier releases)
        page = await self._call(BatchResponse, "POST", path, body=BatchRequest(operations=operations))
        if len(page.results) != len(operations):
            raise TransientError(f"POST {path}: {len(page.results)} answers for {len(operations)} operations",
                                 code="bad_response", method="POST", path=path)
        out: list[Any] = []
        for op, res in zip(operations, page.results):
            method, one = _BATCH_ENDPOINTS[op.op]
            one_path = one.format(store=_seg(store), id=_seg(op.record_id or ""))
            if res.status >= 300:
                out.append(_error_from(res.status, res.body or {}, None, None, method, one_path))
                continue
            try:
                if op.op == "move":
                    out.append(convert(res.body, MoveResult))
                elif op.op == "delete":
                    out.append(None)
                else:
                    out.append(convert(res.body, Record))
            except ValueError:  # msgspec.ValidationError
                raise TransientError(f"POST {path}: an answer does not match the API contract",
                                     code="bad_response", method="POST", path=path) from None
        return out

    async def restore(
        self, store: str, id: str, version: int, idempotency_key: str | None = None
    ) -> Record:
        """``POST .../records/{id}/restore``: a ``restored`` version with version ``version``'s
        content, type and path (undeletes). Raises Conflict (``path_exists``, ``redacted``)."""
        return await self._call(
            Record,
            "POST",
            f"/v1/stores/{_seg(store)}/records/{_seg(id)}/restore",
            body=build(Restore, version=version),
            idempotency_key=idempotency_key,
        )

    async def redact(
        self, store: str, id: str, n: int, idempotency_key: str | None = None
    ) -> Version:
        """``POST .../records/{id}/versions/{n}/redact`` (admin): remove version ``n``'s content.
        Raises Conflict (``current_version``), Forbidden for non-admin tokens."""
        return await self._call(
            Version,
            "POST",
            f"/v1/stores/{_seg(store)}/records/{_seg(id)}/versions/{int(n)}/redact",
            idempotency_key=idempotency_key,
        )

    # ------------------------------------------------------------ admin

    async def create_workspace(
        self, name: str, idempotency_key: str | None = None, *, default_store: bool = True
    ) -> Workspace:
        """``POST /v1/workspaces`` (admin); with ``default_store`` the server also creates a
        store named ``name`` (or takes the existing one) and attaches it read-write. Raises
        Conflict (``exists``)."""
        return await self._call(
            Workspace,
            "POST",
            "/v1/workspaces",
            body=build(WorkspaceCreate, name=name, default_store=default_store),
            idempotency_key=idempotency_key,
        )

    async def list_workspaces(self) -> list[Workspace]:
        """``GET /v1/workspaces`` (admin)."""
        return await self._call(_WORKSPACES, "GET", "/v1/workspaces")

    async def create_store(
        self,
        slug: str,
        description: str = "",
        default_type: str = "project",
        max_record_bytes: int | None = None,
        max_store_bytes: int | None = None,
        max_records: int | None = None,
        idempotency_key: str | None = None,
        *,
        max_history_bytes: int | None = None,
        max_history_versions: int | None = None,
        history_min_age_s: int | None = None,
    ) -> Store:
        """``POST /v1/stores`` (admin). Limits left ``None`` take the server defaults (1 MiB,
        64 MiB, 10,000; the history budget: 16 x max_store_bytes, 16 x max_records, 24 h).
        Raises Conflict (``exists``); ``ValueError``
        (``msgspec.ValidationError``, before any request) for a bad slug, type or limit."""
        fields: dict[str, Any] = {"slug": slug, "description": description, "default_type": default_type}
        for k, v in (
            ("max_record_bytes", max_record_bytes),
            ("max_store_bytes", max_store_bytes),
            ("max_records", max_records),
            ("max_history_bytes", max_history_bytes),
            ("max_history_versions", max_history_versions),
            ("history_min_age_s", history_min_age_s),
        ):
            if v is not None:
                fields[k] = v
        return await self._call(
            Store, "POST", "/v1/stores", body=build(StoreCreate, **fields), idempotency_key=idempotency_key
        )

    async def list_stores(self) -> list[Store]:
        """``GET /v1/stores`` (admin): every store."""
        return await self._call(_STORES, "GET", "/v1/stores")

    async def get_store(self, slug: str) -> Store:
        """``GET /v1/stores/{slug}`` (admin or an attached workspace). Raises NotFound."""
        return await self._call(Store, "GET", f"/v1/stores/{_seg(slug)}")

    async def update_store(
        self,
        slug: str,
        *,
        description: str | None = None,
        default_type: str | None = None,
        max_record_bytes: int | None = None,
        max_store_bytes: int | None = None,
        max_records: int | None = None,
        idempotency_key: str | None = None,
        max_history_bytes: int | None = None,
        max_history_versions: int | None = None,
        history_min_age_s: int | None = None,
    ) -> Store:
        """``PATCH /v1/stores/{slug}`` (admin): change only the fields given (not ``None``):
        the limits, and the history budget (``max_history_bytes``, ``max_history_versions``,
        ``history_min_age_s``: docs/SEMANTICS.md "History budget").
        Raises ``ValueError`` (``msgspec.ValidationError``, before any request) for a bad type
        or limit."""
        update = build(
            StoreUpdate,
            description=description,
            default_type=default_type,
            max_record_bytes=max_record_bytes,
            max_store_bytes=max_store_bytes,
            max_records=max_records,
            max_history_bytes=max_history_bytes,
            max_history_versions=max_history_versions,
            history_min_age_s=history_min_age_s,
        )
        return await self._call(
            Store,
            "PATCH",
            f"/v1/stores/{_seg(slug)}",
            body=update,
            exclude_none=True,
            idempotency_key=idempotency_key,
        )

    async def attach(
        self,
        ws: str,
        store: str,
        access: Access | str = Access.read_write,
        instructions: str = "",
        idempotency_key: str | None = None,
    ) -> Attachment:
        """``PUT /v1/workspaces/{ws}/attachments/{store}`` (admin): attach or change access.
        Raises NotFound (``workspace_not_found``, ``store_not_found``)."""
        return await self._call(
            Attachment,
            "PUT",
            f"/v1/workspaces/{_seg(ws)}/attachments/{_seg(store)}",
            body=build(AttachmentPut, access=Access(access), instructions=instructions),
            idempotency_key=idempotency_key,
        )

    async def create_account(self, slug: str, max_stores: int | None = None, max_bytes: int | None = None,
                             max_tokens: int | None = None, idempotency_key: str | None = None) -> Account:
        """``POST /v1/accounts`` (root admin): a new account with its quotas (None:
        unlimited). Raises Conflict (``exists``), Forbidden unless the root admin."""
        return await self._call(
            Account, "POST", "/v1/accounts",
            body=build(AccountCreate, slug=slug, max_stores=max_stores, max_bytes=max_bytes,
                       max_tokens=max_tokens),
            idempotency_key=idempotency_key,
        )

    async def list_accounts(self) -> list[Account]:
        """``GET /v1/accounts`` (admin): every account with quotas and usage (an account
        admin: its own)."""
        return await self._call(_ACCOUNTS, "GET", "/v1/accounts")

    async def get_account(self, slug: str) -> Account:
        """``GET /v1/accounts/{account}``. Raises NotFound (``account_not_found``)."""
        return await self._call(Account, "GET", f"/v1/accounts/{_seg(slug)}")

    async def delete_account(self, slug: str, idempotency_key: str | None = None) -> None:
        """``DELETE /v1/accounts/{account}`` (root admin): an empty account. Raises
        Conflict (``account_not_empty``), NotFound."""
        await self._request("DELETE", f"/v1/accounts/{_seg(slug)}", idempotency_key=idempotency_key)

    async def attach_account(self, account: str, store: str, access: Access | str = Access.read_write,
                             idempotency_key: str | None = None) -> Attachment:
        """``PUT /v1/accounts/{account}/attachments/{store}``: attach ``store`` to every
        workspace of the account, existing and new."""
        return await self._call(
            Attachment, "PUT", f"/v1/accounts/{_seg(account)}/attachments/{_seg(store)}",
            body=build(AttachmentPut, access=Access(access)), idempotency_key=idempotency_key,
        )

    async def detach_account(self, account: str, store: str, idempotency_key: str | None = None) -> None:
        """``DELETE /v1/accounts/{account}/attachments/{store}``: detach it everywhere."""
        await self._request("DELETE", f"/v1/accounts/{_seg(account)}/attachments/{_seg(store)}",
                            idempotency_key=idempotency_key)

    async def detach(self, ws: str, store: str, idempotency_key: str | None = None) -> None:
        """``DELETE /v1/workspaces/{ws}/attachments/{store}`` (admin). Raises NotFound when
        not attached."""
        await self._request(
            "DELETE",
            f"/v1/workspaces/{_seg(ws)}/attachments/{_seg(store)}",
            idempotency_key=idempotency_key,
        )

    async def create_token(
        self, workspace: str | None = None, name: str = "", idempotency_key: str | None = None,
        ttl_seconds: int | None = None, account: str | None = None,
    ) -> TokenCreated:
        """``POST /v1/tokens`` (admin): a token for ``workspace``, or an admin token when
        ``None``; with ``ttl_seconds`` it expires that long after creation (``.expires_at``).
        The raw token is in ``.token`` and is shown only once. With ``account`` and no
        ``workspace``: an admin token of that account only. Raises NotFound
        (``workspace_not_found``, ``account_not_found``), Forbidden for a workspace token."""
        return await self._call(
            TokenCreated,
            "POST",
            "/v1/tokens",
            body=build(TokenCreate, workspace=workspace, name=name, ttl_seconds=ttl_seconds,
                       account=account),
            idempotency_key=idempotency_key,
            exclude_none=ttl_seconds is None,
        )

    async def list_tokens(self, workspace: str | None = None,
                          include_revoked: bool = False) -> list[TokenInfo]:
        """``GET /v1/tokens`` (admin): every token, oldest first, never its secret;
        ``workspace`` keeps one workspace's (``""``: admin tokens only); revoked ones only
        with ``include_revoked``. Raises Forbidden for a workspace token."""
        params: dict[str, Any] = {}
        if workspace is not None:
            params["workspace"] = workspace
        if include_revoked:
            params["include_revoked"] = "true"
        return await self._call(_TOKENS, "GET", "/v1/tokens", params=params or None)

    async def revoke_token(self, token_id: str, idempotency_key: str | None = None) -> None:
        """``DELETE /v1/tokens/{id}`` (admin): the token stops working at once (on every
        replica within about a second). Revoking a revoked token succeeds. Raises NotFound
        (``token_not_found``), Forbidden for a workspace token."""
        await self._request("DELETE", f"/v1/tokens/{_seg(token_id)}",
                            idempotency_key=idempotency_key)



_TEMPLATE_AFTER = {"stores", "records", "workspaces", "versions", "attachments", "mounts"}


class PageStream(Generic[P]):
    """One stream of pages (``ApiClient.changes_stream`` / ``events_stream``): iterate with
    ``async for``; ``streaming`` is None before the response, then True (an NDJSON stream)
    or False (the server answered without streaming). ``aclose()`` closes the connection
    (idempotent; also done when iteration ends or raises)."""

    def __init__(self, api: ApiClient, model: type[P], path: str, params: dict[str, Any],
                 read_timeout: float) -> None:
        self._api, self._model, self._path, self._params = api, model, path, params
        self._read_timeout = read_timeout
        self._resp: httpx.Response | None = None
        self._gen: AsyncIterator[P] | None = None
        self.streaming: bool | None = None

    def __aiter__(self) -> AsyncIterator[P]:
        if self._gen is None:
            self._gen = self._pages()
        return self._gen

    async def aclose(self) -> None:
        """Close the response (idempotent)."""
        gen, self._gen = self._gen, None
        if gen is not None:
            await gen.aclose()  # type: ignore[attr-defined]
        await self._close_response()

    async def _close_response(self) -> None:
        if self._resp is not None:
            resp, self._resp = self._resp, None
            await resp.aclose()

    async def _pages(self) -> AsyncIterator[P]:
        path = self._path
        try:
            try:
                resp = await self._api._request("GET", path, params=self._params, stream=True,
                                                accept="application/x-ndjson, application/json",
                                                read_timeout=self._read_timeout)
            except PermanentError as e:
                if e.status == 400 or (e.status in (404, 405) and e.code in ("", "not_found", "method_not_allowed")):
                    log.debug("the control plane does not stream; long-polling",
                             extra={"path": path, "status": e.status, "code": e.code})
                    self.streaming = False
                    return
                raise
            self._resp = resp
            ctype = resp.headers.get("content-type", "").split(";")[0].strip().lower()
            if ctype != "application/x-ndjson":
                self.streaming = False
                try:
                    await resp.aread()
                except httpx.HTTPError as exc:
                    raise _transport_error(exc, "GET", path) from None
                log.debug("the control plane does not stream; long-polling", extra={"path": path})
                yield ApiClient._parse(self._model, resp, "GET", path)
                return
            self.streaming = True
            try:
                async for line in resp.aiter_lines():
                    self._api.last_answer = time.monotonic()  # a heartbeat is an answer too
                    if not line.strip():
                        continue
                    if line.startswith('{"error"'):
                        raise _line_error(line, path)
                    yield ApiClient._parse_bytes(self._model, line.encode(), resp.status_code, "GET", path)
            except httpx.HTTPError as exc:
                raise _transport_error(exc, "GET", path) from None
        finally:
            await self._close_response()


def _line_error(line: str, path: str) -> ApiError:
    """The exception of a stream's last line ``{"error": <problem>}`` (classified like an
    HTTP answer with that problem)."""
    try:
        problem = json.loads(line)["error"]
        status = int(problem["status"])
    except (ValueError, KeyError, TypeError):
        return TransientError(f"GET {path}: unreadable error line on a stream", code="bad_response",
                              method="GET", path=path)
    return _http_error(httpx.Response(status, json=problem), "GET", path)


def endpoint_label(method: str, path: str) -> str:
    """``PUT /v1/stores/default/records/3f…`` → ``PUT /v1/stores/{}/records/{}``: a label
    for metrics with no store names, ids or paths in it."""
    parts = path.split("?")[0].split("/")
    out = []
    for i, part in enumerate(parts):
        out.append("{}" if i > 0 and parts[i - 1] in _TEMPLATE_AFTER and part else part)
    return f"{method} {'/'.join(out)}"


def _num(value: float) -> str:
    """Format seconds for a query string: ``5`` rather than ``5.0``."""
    f = float(value)
    return str(int(f)) if f.is_integer() else repr(f)


# ---------------------------------------------------------------- retries for the CLI


def _retry_hook(max_wait: float) -> Callable[[Exception], bool | float]:
    def hook(exc: Exception) -> bool | float:
        if not isinstance(exc, TransientError):
            return False
        if exc.retry_after is not None:
            return min(exc.retry_after, max_wait)
        return True

    return hook


class NeedEventLoop(Exception):
    """Raised inside :func:`run_loopless` when the work needs a real event loop after all
    (it awaited something that suspends, or a transport could not serve a request without
    one): the caller runs the same work again under trio. Not an ``httpx.HTTPError``, so
    :class:`ApiClient` lets it through unchanged."""


#: whether the running coroutine is driven by :func:`run_loopless` (``with_retries`` then
#: waits between attempts with ``time.sleep``)
_LOOPLESS = contextvars.ContextVar("memfuse_loopless", default=False)


def run_loopless(fn: Callable[[], Awaitable[T]]) -> T:
    """Run the coroutine ``fn()`` to its end without an event loop, when nothing it awaits
    suspends: an :class:`ApiClient` whose transport answers synchronously
    (:class:`SyncTransport`, or an in-process one) never does. A short-lived command (the
    CLI's reads) so avoids importing and starting trio, about the cost of importing httpx.

    Returns what ``fn()`` returns; its exceptions propagate. Raises :class:`NeedEventLoop`
    when the coroutine suspends (it is closed first; nothing it started runs on) or raises
    it itself: the caller then runs ``fn`` again under an event loop, so ``fn`` must be
    safe to run twice up to that point (a read)."""
    token = _LOOPLESS.set(True)
    try:
        coro = fn()
        try:
            coro.send(None)  # type: ignore[attr-defined]
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        try:
            coro.close()  # type: ignore[attr-defined]
        except RuntimeError:  # it awaited again while closing: nothing more to do
            pass
        raise NeedEventLoop("the work suspended: it needs an event loop")
    finally:
        _LOOPLESS.reset(token)


class SyncTransport(httpx.AsyncBaseTransport):
    """An async httpx transport that sends each request with a synchronous
    ``httpx.HTTPTransport`` (blocking, no event loop), for :func:`run_loopless`. The response
    body is read whole (raw, still content-encoded: the client decodes it as it would the
    async transport's). Only for requests without a streaming body and responses read whole
    (the CLI's reads); ``verify`` as ``httpx.HTTPTransport`` takes it (:func:`tls_context`).
    """

    def __init__(self, verify: ssl.SSLContext) -> None:
        self._sync = httpx.HTTPTransport(verify=verify, retries=0)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:  # noqa: D102
        resp = self._sync.handle_request(request)
        try:
            raw = b"".join(resp.stream)  # type: ignore[union-attr]
        finally:
            resp.close()
        return httpx.Response(resp.status_code, headers=resp.headers, content=raw,
                              extensions=resp.extensions, request=request)

    async def aclose(self) -> None:  # noqa: D102
        self._sync.close()


async def with_retries(
    fn: Callable[[], Awaitable[T]],
    *,
    attempts: int = 4,
    timeout: float = 60.0,
    wait_initial: float = 0.5,
    wait_max: float = 10.0,
) -> T:
    """Await ``fn()`` and repeat it on :class:`TransientError`, for interactive (CLI) use.

    Up to ``attempts`` calls within ``timeout`` seconds, exponential backoff with jitter from
    ``wait_initial`` up to ``wait_max`` seconds; a ``Retry-After`` from the server (429/503) is
    honoured, capped at ``wait_max``. Permanent errors and the last transient error propagate.
    ``fn`` takes no arguments, so nothing it closes over (content, tokens) is logged by the
    retry machinery. Writes should pass one fixed ``idempotency_key`` across the attempts.
    """
    if _LOOPLESS.get():
        return await _with_retries_loopless(fn, attempts=attempts, timeout=timeout,
                                            wait_initial=wait_initial, wait_max=wait_max)
    import stamina

    async for attempt in stamina.retry_context(
        on=_retry_hook(wait_max),
        attempts=attempts,
        timeout=timeout,
        wait_initial=wait_initial,
        wait_max=wait_max,
        wait_jitter=min(1.0, wait_max),
    ):
        with attempt:
            return await fn()
    raise AssertionError("unreachable")  # pragma: no cover


async def _with_retries_loopless(fn: Callable[[], Awaitable[T]], *, attempts: int, timeout: float,
                                 wait_initial: float, wait_max: float) -> T:
    """:func:`with_retries` under :func:`run_loopless`: the first attempt without importing
    stamina (a read that succeeds, nearly all, never loads it); after a
    :class:`TransientError`, the wait stamina would make (``Retry-After`` capped at
    ``wait_max``, else ``wait_initial`` plus up to 1 s of jitter) with ``time.sleep``, then
    stamina's synchronous retries for the rest of ``attempts`` and ``timeout``, their backoff
    going on from the second wait (``wait_initial`` × 2)."""
    start = time.monotonic()
    try:
        return await fn()
    except TransientError as e:
        first = e
    hook = _retry_hook(wait_max)(first)
    jitter = min(1.0, wait_max)
    import random

    wait = float(hook) if not isinstance(hook, bool) else min(wait_max, wait_initial + random.uniform(0, jitter))
    if attempts <= 1 or time.monotonic() - start + wait > timeout:
        raise first
    time.sleep(wait)
    import stamina

    for attempt in stamina.retry_context(
        on=_retry_hook(wait_max),
        attempts=attempts - 1,
        timeout=max(0.001, timeout - (time.monotonic() - start)),
        wait_initial=min(wait_max, wait_initial * 2),
        wait_max=wait_max,
        wait_jitter=jitter,
    ):
        with attempt:
            return await fn()
    raise AssertionError("unreachable")  # pragma: no cover
