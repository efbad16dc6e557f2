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

The package's modules: :mod:`~memfuse.client.base` (error classification of answers, ETags,
TLS, :class:`~memfuse.client.base.ApiSession`: the request loop and authentication state),
:mod:`~memfuse.client.api` (:class:`ApiClient`: records and feeds endpoints, one short method
per endpoint of docs/API.md in the same order) on :mod:`~memfuse.client.admin` (the admin
endpoints), :mod:`~memfuse.client.stream` (:class:`PageStream`) and
:mod:`~memfuse.client.retries` (the CLI's :func:`with_retries` and loop-less calls), and
:mod:`~memfuse.client.lean` (the lean HTTP/1.1 path of ``ApiClient(lean=True)``: the
sidecar's commits). Import
every name from ``memfuse.client``: the split into modules is not part of the interface.
"""
from __future__ import annotations

# The error classes live in memfuse.errors; importing them from here stays supported for
# callers outside this package (code inside memfuse imports them from memfuse.errors).
from ..errors import (  # noqa: F401  (re-exported)
    ERRNO_BY_CODE,
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
from .admin import AdminEndpoints  # noqa: F401
from .api import ApiClient
from .base import (  # noqa: F401
    IDEMPOTENCY_HEADER,
    INSTANCE_HEADER,
    STREAM_READ_TIMEOUT,
    UNSET,
    ApiSession,
    _package_version,
    endpoint_label,
    parse_retry_after,
    quote_etag,
    store_precondition,
    tls_context,
    unquote_etag,
)
from .retries import NeedEventLoop, SyncTransport, run_loopless, with_retries
from .stream import PageStream

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
    "StoreReplaced",
    "store_precondition",
    "PageStream",
    "STREAM_READ_TIMEOUT",
    "quote_etag",
    "unquote_etag",
    "parse_retry_after",
    "with_retries",
    "run_loopless",
    "NeedEventLoop",
    "SyncTransport",
    "tls_context",
]
