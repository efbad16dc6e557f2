"""Streams of pages (``stream=true``, docs/API.md "Streams"): :class:`PageStream`, what
:meth:`ApiClient.changes_stream <memfuse.client.api.ApiClient.changes_stream>` and
``events_stream`` return.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Generic

import httpx

from ..errors import ApiError, PermanentError, TransientError
from .base import ApiSession, P, _http_error, _transport_error, log


class PageStream(Generic[P]):
    """One stream of pages (``ApiClient.changes_stream`` / ``events_stream``): iterate with
    ``async for``; ``streaming`` is None before the response, then True (an NDJSON stream)
    or False (the server answered without streaming). ``aclose()`` closes the connection
    (idempotent; also done when iteration ends or raises)."""

    def __init__(self, api: ApiSession, model: type[P], path: str, params: dict[str, Any],
                 read_timeout: float) -> None:
        self._api, self._path, self._params = api, path, params
        self._model: type[P] = model
        self._read_timeout = read_timeout
        self._resp: httpx.Response | None = None
        self._gen: AsyncGenerator[P, None] | None = None
        self.streaming: bool | None = None

    def __aiter__(self) -> AsyncIterator[P]:
        if self._gen is None:
            self._gen = self._pages()
        return self._gen

    async def aclose(self) -> None:
        """Close the response (idempotent)."""
        gen, self._gen = self._gen, None
        if gen is not None:
            await gen.aclose()
        await self._close_response()

    async def _close_response(self) -> None:
        if self._resp is not None:
            resp, self._resp = self._resp, None
            await resp.aclose()

    async def _pages(self) -> AsyncGenerator[P, None]:
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
                yield ApiSession._parse(self._model, resp, "GET", path)
                return
            self.streaming = True
            try:
                async for line in self._lines(resp):
                    self._api.last_answer = time.monotonic()  # a heartbeat is an answer too
                    if not line.strip():
                        continue
                    if line.startswith('{"error"'):
                        raise _line_error(line, path)
                    yield ApiSession._parse_bytes(self._model, line.encode(), resp.status_code, "GET", path)
            except httpx.HTTPError as exc:
                raise _transport_error(exc, "GET", path) from None
        finally:
            await self._close_response()


    async def _lines(self, resp: httpx.Response) -> AsyncGenerator[str, None]:
        """The stream's lines. From a bounded client (``ApiSession.bounded``: the sidecar)
        each line (a page or a heartbeat) has a deadline of its own, as a request has
        (``deadline``): ``read_timeout`` s from when it is awaited, moved on as its bytes
        arrive at ``deadline.MIN_BODY_RATE``; past it ``httpx.ReadTimeout`` is raised (a
        stream that drips a byte at a time never trips the per-read timeout, and its feed
        would stall for good). Otherwise httpx's ``aiter_lines``."""
        if not self._api.bounded:
            async for line in resp.aiter_lines():
                yield line
            return
        import trio  # only bounded clients (the sidecar) come here

        from . import deadline

        chunks = resp.aiter_bytes().__aiter__()
        pending = bytearray()
        ended = False
        rt = self._read_timeout
        while True:
            nl = pending.find(b"\n")
            if nl >= 0:
                raw = bytes(pending[:nl])
                del pending[:nl + 1]
                yield raw.decode("utf-8", "replace").rstrip("\r")
                continue
            if ended:
                if pending:
                    yield bytes(pending).decode("utf-8", "replace")
                return
            start, received = trio.current_time(), 0
            with trio.CancelScope(deadline=start + rt) as scope:
                while True:
                    try:
                        chunk = await chunks.__anext__()
                    except StopAsyncIteration:
                        ended = True
                        break
                    pending += chunk
                    if b"\n" in chunk:
                        break
                    received += len(chunk)
                    deadline.extend(scope, start, rt, received)
            if scope.cancelled_caught:
                raise httpx.ReadTimeout(deadline.message(rt))


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
