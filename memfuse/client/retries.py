"""Calling the API from the CLI: :func:`with_retries` (bounded retries of transient
failures) and :func:`run_loopless` / :class:`SyncTransport` (a command run without an event
loop: trio is not imported when every request is answered synchronously).
"""
from __future__ import annotations

import contextvars
import ssl
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, cast

import httpx

from ..errors import TransientError
from .base import T


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


def run_loopless(fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
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
            coro.send(None)
        except StopIteration as done:
            value: T = done.value  # what the coroutine returned
            return value
        try:
            coro.close()
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
            raw = b"".join(cast(httpx.SyncByteStream, resp.stream))  # a blocking transport's stream
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
