"""The transport half of :class:`memfuse.client.ApiClient`: error classification of HTTP
answers, ETag and ``Retry-After`` helpers, the TLS context, and :class:`ApiSession` (one
``httpx.AsyncClient``, the request loop with its authentication state, answer parsing).
The endpoints are in :mod:`memfuse.client.api`; see :mod:`memfuse.client` for the error
model and the secrecy rules.
"""
from __future__ import annotations

import contextlib
import copy
import email.utils
import functools
import logging
import math
import random
import re
import ssl
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Self, TypeVar
from urllib.parse import quote

import httpx
import msgspec

from ..errors import (
    ApiError,
    Conflict,
    Forbidden,
    Gone,
    NotFound,
    PermanentError,
    PreconditionFailed,
    StoreFull,
    StoreReplaced,
    TransientError,
    Unauthorized,
)
from ..defs import ACTOR_HEADER, STORE_CREATED_HEADER, WRITER_HEADER
from ..tokenfile import TokenFile

if TYPE_CHECKING:
    from .lean import Answer, LeanHTTP
from ..wire import (
    Attachment,
    ChangePage,
    ConsolidationJob,
    EventPage,
    Record,
    Store,
    TokenInfo,
    Version,
    Workspace,
    Account,
    decode,
    encode,
)

log = logging.getLogger("memfuse.client")

#: s at most a request refused for its token's share of the request slots (429
#: ``too_many_requests``) is sent again for (``ApiSession._send``)
SHARE_WAIT = 30.0
#: s at most between two of those attempts, whatever ``Retry-After`` says
SHARE_RETRY_MAX = 5.0
#: s at least before the first of those attempts, doubled after each (up to
#: ``SHARE_RETRY_MAX``): a ``Retry-After`` of 0, negative or a past date is no reason to send
#: again at once (verify26: a proxy answering ``Retry-After: 0`` drew ~2,000 requests a second)
SHARE_RETRY_MIN = 0.05


async def _pause(seconds: float) -> None:
    """Wait ``seconds``: ``time.sleep`` when the running coroutine is driven without an event
    loop (``retries.run_loopless``), else ``trio.sleep`` (trio imported only then)."""
    from .retries import _LOOPLESS

    if _LOOPLESS.get():
        time.sleep(seconds)
        return
    import trio

    await trio.sleep(seconds)


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
#: the request headers ``ApiSession._send`` sets, by their lower-case names (the lean path's)
_LOWER = {"If-Match": "if-match", IDEMPOTENCY_HEADER: "idempotency-key", "Accept": "accept",
          "Content-Type": "content-type", "Authorization": "authorization"}


#: the identity of the store the writes sent in this context were made for (its creation
#: time, RFC 3339), set by ``store_precondition``; None: no precondition sent
_STORE_CREATED: ContextVar[str | None] = ContextVar("memfuse_store_created", default=None)


@contextlib.contextmanager
def store_precondition(created: str | None) -> Iterator[None]:
    """Inside (the current task only: a context variable), every request but a ``GET``
    carries ``Memfuse-Store-Created: <created>``, the creation time (``Store.created_at``,
    RFC 3339) of the store its write was made for: the control plane refuses the write with
    412 ``store_replaced`` (:class:`StoreReplaced`) when the store of that slug is another
    one now (deleted and made again), in the write's own transaction (docs/API.md "Store
    identity"). ``created`` None or '' sends nothing (a write not checked, as outside)."""
    token = _STORE_CREATED.set(created or None)
    try:
        yield
    finally:
        _STORE_CREATED.reset(token)


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
    if status == 412 and code == "store_replaced":  # not a version to merge with: refused
        cls: type[ApiError] = StoreReplaced
    elif status in _STATUS_CLASSES:
        cls = _STATUS_CLASSES[status]
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
    """Percent-encode one URL path segment (``quote(value, safe="")``; a segment of
    unreserved characters only, as store slugs and record ids are, is returned as it is
    without ``quote``'s work)."""
    value = str(value)
    if _UNRESERVED.fullmatch(value) is not None:
        return value
    return quote(value, safe="")


#: a path segment that ``quote(..., safe="")`` leaves as it is (RFC 3986 unreserved)
_UNRESERVED = re.compile(r"[A-Za-z0-9_.~-]+")


def _seq_of(header: str | None) -> int | None:
    """A ``Memfuse-Seq`` header's value as an int, None when absent or not a number."""
    if header is None or not header.strip().isdigit():
        return None
    return int(header.strip())


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


_TEMPLATE_AFTER = {"stores", "records", "workspaces", "versions", "attachments", "mounts"}


#: (method, path) -> its ``endpoint_label``: every commit request of one store asks for
#: the same few (a create's path is the store's ``records``); cleared when full
_LABELS: dict[tuple[str, str], str] = {}
_LABELS_MAX = 256


def endpoint_label(method: str, path: str) -> str:
    """``PUT /v1/stores/default/records/3f…`` → ``PUT /v1/stores/{}/records/{}``: a label
    for metrics with no store names, ids or paths in it."""
    label = _LABELS.get((method, path))
    if label is not None:
        return label
    parts = path.split("?")[0].split("/")
    out = []
    for i, part in enumerate(parts):
        out.append("{}" if i > 0 and parts[i - 1] in _TEMPLATE_AFTER and part else part)
    label = f"{method} {'/'.join(out)}"
    if len(_LABELS) >= _LABELS_MAX:
        _LABELS.clear()
    _LABELS[(method, path)] = label
    return label


def _num(value: float) -> str:
    """Format seconds for a query string: ``5`` rather than ``5.0``."""
    f = float(value)
    return str(int(f)) if f.is_integer() else repr(f)


class ApiSession:
    """The request machinery of :class:`~memfuse.client.api.ApiClient` (its base class): one
    ``httpx.AsyncClient``, ``_request`` / ``_call`` / ``_parse``, the authentication state
    (``auth_failure``, ``auth_failures``, ``auth_listener``) and the metrics ``observer``. The
    constructor's arguments, the errors raised and the authentication state are described on
    ``ApiClient``, the class callers make."""

    def __init__(
        self,
        base_url: str,
        token: str | TokenFile | None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        instance: str | None = None,
        timeout: float = 30.0,
        lean: bool = False,
        bounded: bool = False,
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
        #: the sidecar instance id sent on writes (``set_writer``); None: none sent
        self.writer: str | None = None
        #: the actor the control plane records on this client's writes, as it last said
        #: (``Memfuse-Actor`` on ``list_attachments``' answer); None until then, and from a
        #: control plane that does not say
        self.actor: str | None = None
        #: the account of the workspace whose attachments this client listed last
        #: (``Memfuse-Account`` on ``list_attachments``' answer); None until then, and from a
        #: control plane that does not say
        self.account: str | None = None
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
        #: the workspace this client acts for (``expect_workspace``); None: any token goes
        self._expect_ws: str | None = None
        #: the token generation (``TokenFile.generation``, 0 for a fixed token) found to be
        #: for ``_expect_ws`` (or not a token matter); None: not yet checked. Invariant: no
        #: request other than the check's own is sent with a token of another generation
        self._checked: int | None = None
        #: (generation, reason) of the token found to be another workspace's: requests with
        #: it raise ``Unauthorized`` unsent until another token is taken up
        self._wrong: tuple[int, str] | None = None
        self._check_lock: Any = None  # a trio.Lock, made at the first check
        #: checks made so far, and the TransientError of the last when it got no answer:
        #: callers that waited for that check fail with it rather than each trying in turn
        self._checks = 0
        self._check_error: TransientError | None = None
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            transport=transport,
            verify=tls_context(self.base_url),
            timeout=httpx.Timeout(self.timeout),
            limits=httpx.Limits(max_connections=200, max_keepalive_connections=50),
            follow_redirects=False,
        )
        #: every request has a total deadline (``deadline``: the answer's head within
        #: ``timeout`` s, plus ``wait`` for a long poll; its body at ``MIN_BODY_RATE`` after
        #: that), not only per read. Needs trio (the sidecar); off for the CLI, whose reads
        #: may run without an event loop (``retries.run_loopless``)
        self.bounded = bounded
        #: the lean HTTP/1.1 path for ordinary requests (``lean.LeanHTTP``), when asked for
        #: (``lean=True``: the sidecar) and usable: no custom transport, no proxy configured
        self._lean: LeanHTTP | None = None
        #: the client's default headers as the lean path sends them (lower-case names, no
        #: ``accept-encoding``: it reads no compressed body), built once from ``_http``'s
        #: and again after ``set_instance`` changes them (None: to be built)
        self._lean_defaults: dict[str, str] | None = None
        if lean:  # imported here: it needs trio, which the CLI's read commands never load
            from .lean import LeanHTTP, proxy_configured
            if transport is None and not proxy_configured():
                self._lean = LeanHTTP(self.base_url, tls_context(self.base_url), self.timeout)

    def set_writer(self, writer: str) -> None:
        """Send ``Memfuse-Writer: writer`` on every write from now on: the id of this sidecar
        instance (at most 64 characters ``[A-Za-z0-9._-]``), kept on the versions it writes,
        so its change feed leaves out exactly those (``changes(skip_writer=...)``)."""
        self.writer = writer

    def expect_workspace(self, ws: str) -> None:
        """Act for workspace ``ws`` only (the sidecar's ``--workspace``; needs trio): each
        token taken up (the first, and each new one of the token file) is checked with
        ``GET /v1/workspaces/{ws}/attachments`` before any other request is sent with it. A
        token the control plane says is another workspace's (403, or a 404 whose
        ``Memfuse-Actor`` names another workspace) is an authentication outage like a 401:
        ``auth_failure`` says "the token is for workspace X, this sidecar is for ws",
        ``auth_listener(False)`` is told, it is logged once, and every request raises
        ``Unauthorized`` (code ``wrong_workspace``) unsent until a new token is taken up
        and checked. A check that gets no answer raises its ``TransientError`` to the
        request that made it; the next request checks again."""
        self._expect_ws = ws
        self._checked = None

    def set_instance(self, instance: str) -> None:
        """Send ``X-Memfuse-Instance: instance`` from now on (the sidecar id on versions)."""
        self.instance = instance
        self._http.headers[INSTANCE_HEADER] = instance
        self._lean_defaults = None

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

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool. Idempotent."""
        await self._http.aclose()
        if self._lean is not None:
            await self._lean.aclose()

    # ------------------------------------------------------------ plumbing

    async def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """One request (``_send``); the answer as an ``httpx.Response``. Raises the
        ``ApiError`` of a refusal or of a transport failure."""
        resp = await self._send(method, path, raw_ok=False, **kw)
        assert isinstance(resp, httpx.Response)  # raw_ok=False: never an Answer
        return resp

    async def _send(self, method: str, path: str, **kw: Any) -> "httpx.Response | Answer":
        """``_send_once``, sent again while the control plane refuses it for its token's
        share of the request slots (429 ``too_many_requests``: refused at the front door
        before the app, so never applied, whatever the method; docs/API.md, "Request
        slots"): the server's ``Retry-After`` (at least ``SHARE_RETRY_MIN`` s doubling, at
        most ``SHARE_RETRY_MAX`` s) with jitter between attempts, for at most ``SHARE_WAIT`` s in all, then that refusal is raised.
        A client with more requests in flight than its share (parallel memory-tool calls
        of one token) so queues instead of failing. Raises what ``_send_once`` raises."""
        deadline: float | None = None
        floor = SHARE_RETRY_MIN
        while True:
            try:
                return await self._send_once(method, path, **kw)
            except TransientError as e:
                if e.status != 429 or e.code != "too_many_requests":
                    raise
                now = time.monotonic()
                if deadline is None:
                    deadline = now + SHARE_WAIT
                after = e.retry_after if e.retry_after is not None else 1.0
                delay = min(max(after, floor), SHARE_RETRY_MAX) * random.uniform(0.5, 1.0)
                floor = min(floor * 2, SHARE_RETRY_MAX)
                if now + delay > deadline:
                    raise
                log.debug("%s %s: over its token's share of the request slots; sent again in "
                          "%.2f s", method, path, delay)
                await _pause(delay)

    async def _send_once(
        self,
        method: str,
        path: str,
        *,
        raw_ok: bool = False,
        params: dict[str, Any] | None = None,
        body: msgspec.Struct | dict[str, Any] | None = None,
        if_match: str | None = None,
        idempotency_key: str | None = None,
        wait: float = 0.0,
        accept: str | None = None,
        exclude_none: bool = False,
        stream: bool = False,
        read_timeout: float | None = None,
        check: bool = False,
    ) -> "httpx.Response | Answer":
        """Send one request and read its answer: the lean path (``lean.LeanHTTP``) for an
        ordinary request when there is one, else httpx; a 401 is sent once more when the
        token file holds a new token. A token not yet checked for ``expect_workspace`` is
        checked first (``_check_token``; raises its ``Unauthorized`` or ``TransientError``);
        ``check``: this request is that check (its 403 / 404 is returned, not raised, and
        says nothing of the token's validity). ``raw_ok``: a successful answer of the lean path
        is returned as its ``lean.Answer`` (no ``httpx.Response`` built: ``_call`` decodes
        only its body); anything else is an ``httpx.Response``. Raises the ``ApiError`` of a
        non-2xx answer (``_http_error``) or of a transport failure (``_transport_error``)."""
        headers: dict[str, str] = {}
        if if_match is not None:
            headers["If-Match"] = quote_etag(if_match)
        if idempotency_key is not None:
            headers[IDEMPOTENCY_HEADER] = idempotency_key
        if accept is not None:
            headers["Accept"] = accept
        if method != "GET":
            created = _STORE_CREATED.get()
            if created is not None:
                headers[STORE_CREATED_HEADER] = created
            if self.writer is not None:
                headers[WRITER_HEADER] = self.writer
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
        # ordinary requests without query parameters take the lean path when there is one
        lean = self._lean if (self._lean is not None and not params and timeout is None
                               and not stream) else None
        raw: Answer | None = None
        for attempt in (1, 2):
            if self._expect_ws is not None and not check and (
                    tf.generation if tf is not None else 0) != self._checked:
                await self._check_token()
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
                if lean is not None:  # its requests are always bounded (LeanHTTP.send)
                    defaults = self._lean_defaults
                    if defaults is None:
                        defaults = self._lean_defaults = {
                            k: v for k, v in self._http.headers.items() if k != "accept-encoding"}
                    # the per-request headers (idempotency key, If-Match) apart: the lean
                    # path validates the others once per set (LeanHTTP._headers); the
                    # defaults (the client's own headers) hold none of them
                    merged = defaults.copy()
                    varying = []
                    per_request = lean.PER_REQUEST
                    for k, v in headers.items():
                        lk = _LOWER.get(k) or k.lower()
                        if lk in per_request:
                            varying.append((lk, v))
                        else:
                            merged[lk] = v
                    got = await lean.exchange(method, path, list(merged.items()), kwargs.get("content"),
                                              varying)
                    if raw_ok and 200 <= got.status < 300 and got.plain():
                        raw = got
                    else:
                        resp = got.response()
                elif self.bounded:
                    head = self.timeout + max(wait, 0.0)
                    if read_timeout is not None and not stream:  # a longer answer allowed (a prefix move)
                        head = max(head, read_timeout)
                    resp = await self._send_bounded(self._http.build_request(method, path, **kwargs),
                                                    stream, head)
                else:
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
            if raw is not None:  # a success: no 401, nothing to send again
                self._observe(method, path, str(raw.status), t0)
                log.debug("%s %s -> %s", method, path, raw.status)
                self._auth_ok()
                return raw
            self._observe(method, path, str(resp.status_code), t0)
            log.debug("%s %s -> %s", method, path, resp.status_code)
            if resp.status_code != 401:
                if resp.is_success or not check:
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
        if not resp.is_success and not (check and resp.status_code in (403, 404)):
            if stream:
                await resp.aclose()
            raise _http_error(resp, method, path)
        return resp

    async def _check_token(self) -> None:
        """Check the token in use for ``expect_workspace`` (one ``GET .../attachments``,
        concurrent callers waiting for the one check) unless done for its generation.
        Raises ``Unauthorized`` (code ``wrong_workspace``) for a token the control plane
        says is another workspace's, and what the check's request raises (a 401's
        ``Unauthorized``, a ``TransientError``)."""
        import trio  # only the sidecar sets expect_workspace

        ws = self._expect_ws
        assert ws is not None
        if self._check_lock is None:
            self._check_lock = trio.Lock()
        tf = self.token_file
        waited_for = self._checks
        async with self._check_lock:
            while True:  # a token taken up during the check is checked in turn
                gen = tf.generation if tf is not None else 0
                if gen == self._checked:
                    return
                path = f"/v1/workspaces/{_seg(ws)}/attachments"
                if self._wrong is not None and self._wrong[0] == gen:
                    raise Unauthorized(self._wrong[1], status=401, code="wrong_workspace",
                                       detail=self._wrong[1], method="GET", path=path)
                if self._checks != waited_for and self._check_error is not None:
                    raise copy.copy(self._check_error)  # the check this caller waited for
                self._checks += 1
                try:
                    resp = await self._send_once("GET", path, check=True)
                except TransientError as e:
                    self._check_error = e
                    raise
                self._check_error = None
                assert isinstance(resp, httpx.Response)
                told = resp.headers.get(ACTOR_HEADER) or ""
                theirs = told[3:].rsplit("/", 1)[0] if told.startswith("ws:") else None
                mine = ws.split("~", 1)[0]  # a key or reference ``<name>~<account>``: its name
                named = theirs if theirs and theirs != mine else None
                # 403: another workspace of its account (named by a control plane that says);
                # 404: another account's workspace, or none: a token matter only when named
                wrong = resp.status_code == 403 or (resp.status_code == 404 and named is not None)
                if gen != (tf.generation if tf is not None else 0):
                    continue  # answered for a token taken up meanwhile: check the one in use
                if not wrong:  # its workspace, or a 404 that is no token matter
                    if self._wrong is not None:
                        self._wrong = None
                        log.info("the token is for this workspace again", extra={"workspace": ws})
                    self._checked = gen
                    return
                reason = (f"the token is for workspace {named}, this sidecar is for {ws}"
                          if named is not None else
                          f"the token is for another workspace, this sidecar is for {ws}")
                self._wrong = (gen, reason)
                self.auth_failures += 1
                log.warning("the token is for another workspace; writes are kept until a "
                            "token of this workspace comes",
                            extra={"workspace": ws, "token_workspace": named,
                                   "token_file": str(tf.path) if tf is not None else None})
                self.auth_failure = reason
                self._tell_auth(False)

    async def _send_bounded(self, request: httpx.Request, stream: bool, head: float) -> httpx.Response:
        """Send ``request`` through httpx within its total deadline (``deadline``): the head
        within ``head`` s; then, unless ``stream``, the body read here at
        ``deadline.MIN_BODY_RATE`` at least and returned as a whole ``httpx.Response`` (the
        raw bytes; decoded by their ``Content-Encoding`` as httpx would). Raises
        ``httpx.ReadTimeout`` past the deadline, and what ``httpx.AsyncClient.send`` raises."""
        import trio  # only bounded clients (the sidecar) come here

        from . import deadline

        resp: httpx.Response | None = None
        with trio.CancelScope(deadline=trio.current_time() + head) as scope:
            got = await self._http.send(request, stream=True)
            if stream:
                resp = got
            else:
                try:
                    body_start, received, chunks = trio.current_time(), 0, []
                    async for chunk in got.aiter_raw():
                        chunks.append(chunk)
                        received += len(chunk)
                        deadline.extend(scope, body_start, self.timeout, received)
                finally:
                    with trio.CancelScope(shield=True):
                        await got.aclose()
                resp = httpx.Response(got.status_code, headers=got.headers, content=b"".join(chunks),
                                      request=request, extensions=got.extensions)
        if resp is None:
            raise httpx.ReadTimeout(deadline.message(head), request=request)
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
    def _parse(model: type[T], resp: httpx.Response, method: str, path: str) -> T:
        """``resp``'s body decoded as ``model`` (a Struct or ``list[Struct]``); a body that is
        not JSON of that shape raises ``TransientError`` ``bad_response``."""
        return ApiSession._parse_bytes(model, resp.content, resp.status_code, method, path)

    @staticmethod
    def _parse_bytes(model: type[T], data: bytes, status: int, method: str, path: str) -> T:
        try:
            return decode(data, model)  # type[T] binds decode's S to T
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

    async def _call(self, model: type[T], method: str, path: str, **kw: Any) -> T:
        """``_request``, then the answer's body decoded as ``model`` (``_parse``)."""
        resp = await self._send(method, path, raw_ok=True, **kw)
        if isinstance(resp, httpx.Response):
            return self._parse(model, resp, method, path)
        return self._parse_bytes(model, resp.content, resp.status, method, path)

    # ------------------------------------------------------------ workspace endpoints
