"""What the routers' handlers share: the service, the caller, the idempotency key, the
parameter types, the responses, and ``route`` (a handler registered from the route table).

Handlers are thin: authenticate (``P``), call the ``Service`` (``Svc``), turn the result into a
response. Plain ``def`` handlers run in anyio's worker threads (fine under trio and asyncio);
the dependencies here are ``async``, so they cost no thread: static and recently seen tokens
resolve on the event loop, only an unknown token costs a worker thread and a query.

Responses are serialised once, by pydantic (``model_dump_json``), into plain ``Response``
objects: FastAPI neither validates nor re-encodes them against the ``response_model``
(which only documents the body in the OpenAPI schema).
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Annotated, Any, TypeVar

import anyio
from fastapi import APIRouter, Depends, Header, Path, Query, Request, Security
from fastapi.responses import Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from memfuse import defs
from memfuse.server import streams as streaming
from memfuse.server.jsonpieces import json_list_pieces
from memfuse.server.routetable import Route
from memfuse.server.service import (IdempotencyRequest, Principal, Reply, Service, idempotency_request,
                                    with_write_headers)

_F = TypeVar("_F", bound=Callable[..., Any])

_bearer = HTTPBearer(auto_error=False, description="workspace or admin token")


def route(router: APIRouter, r: Route, **kwargs: Any) -> Callable[[_F], _F]:
    """Register the decorated handler on ``router`` for route ``r`` of the route table
    (``memfuse.server.routetable``): its method, path template and name; ``kwargs`` as
    ``APIRouter.api_route`` takes them (``status_code``, ``response_model``, ``tags``, ...)."""
    return router.api_route(r.path, methods=[r.method], name=r.name, **kwargs)


def service_of(request: Request) -> Service:
    """The app's ``Service`` (``app.state.service``)."""
    svc: Service = request.app.state.service
    return svc


async def get_service(request: Request) -> Service:
    """Dependency: the app's ``Service``."""
    return service_of(request)


def requested_account(request: Request) -> str | None:
    """The account a request names: the ``X-Memfuse-Account`` header, else the ``account``
    query parameter (for links and the console), else None."""
    return request.headers.get("x-memfuse-account") or request.query_params.get("account") or None


async def get_principal(
    request: Request,
    cred: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)],
    x_memfuse_instance: Annotated[str | None, Header(description="sidecar id, recorded in actor")] = None,
) -> Principal:
    """Dependency: the caller. The front door's principal (``memfuse.server.gate``), else the
    bearer token resolved from the cache (no thread) or the database (a worker thread); then
    the token bookkeeping when due, and the account a root admin acts in. Raises
    ``ServiceError`` 401 / 404 (unknown account)."""
    svc = service_of(request)
    p: Principal | None = request.scope.get("memfuse.principal")  # the front door's
    if p is None:
        token = cred.credentials if cred else None
        p = svc.authenticate_cached(token, x_memfuse_instance)  # no database, no thread
        if p is None:
            p = await anyio.to_thread.run_sync(svc.authenticate, token, x_memfuse_instance)
        p = with_write_headers(p, request.headers.get(defs.STORE_CREATED_HEADER),
                               request.headers.get(defs.WRITER_HEADER))
    if svc.token_upkeep_due():  # token bookkeeping: a few statements a minute (tokens.py)
        await anyio.to_thread.run_sync(svc.token_upkeep)
    account = requested_account(request)
    if account:  # the root admin acting in one account (docs/API.md "Accounts")
        p = await anyio.to_thread.run_sync(svc.act_in_account, p, account)
    return p


async def get_idempotency(
    request: Request,
    idempotency_key: Annotated[str | None, Header(max_length=255)] = None,
) -> IdempotencyRequest | None:
    """Dependency: the identity of a write sent with ``Idempotency-Key`` (None without)."""
    if not idempotency_key:
        return None
    body = await request.body()
    return idempotency_request(idempotency_key, request.method, request.url.path, body)


Svc = Annotated[Service, Depends(get_service)]
P = Annotated[Principal, Depends(get_principal)]
Idem = Annotated[IdempotencyRequest | None, Depends(get_idempotency)]
IfMatch = Annotated[str | None, Header(description='"<sha256>" of the version the change is based on, or *')]
StoreSlug = Annotated[str, Path(description="store slug")]
AccountSlug = Annotated[str, Path(description="account slug")]
VersionNumber = Annotated[int, Path(ge=1, le=defs.INT64_MAX, description="version number (1, 2, ...)")]
After = Annotated[int, Query(ge=0, le=defs.INT64_MAX, description="feed position to read after (a page's seq)")]
Wait = Annotated[float, Query(ge=0, description="long-poll seconds (capped at 60)")]
JobId = Annotated[str, Path(max_length=64)]


def reply_response(r: Reply) -> Response:
    """The response of a write's ``Reply`` (``Idempotent-Replayed: true`` when replayed):
    status, headers and body of ``reply_head``."""
    status, headers, body = reply_head(r)
    response = Response(content=body, status_code=status)
    response.raw_headers = headers
    return response


def reply_head(r: Reply) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The status, ASGI headers (lower-case names, latin-1) and body of a write's ``Reply``
    as starlette's ``Response`` frames them (its ``init_headers``): the reply's headers,
    ``idempotent-replayed: true`` when replayed, then ``content-length`` (not for a 204) and,
    with a body, ``content-type: application/json`` (each unless the reply has it). The one
    rule of ``reply_response`` and of the record-write fast path (``memfuse.server.writepath``)."""
    headers = dict(r.headers)
    if r.replayed:
        headers["Idempotent-Replayed"] = "true"
    raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    names = {k for k, _ in raw}
    body = r.body if r.status != 204 and r.body else b""
    if r.status != 204 and not 100 <= r.status < 200 and r.status != 304 and b"content-length" not in names:
        raw.append((b"content-length", str(len(body)).encode("latin-1")))
    if body and b"content-type" not in names:
        raw.append((b"content-type", b"application/json"))
    return r.status, raw, body


def json_response(model: BaseModel | Sequence[BaseModel], *, etag: str | None = None) -> Response:
    """A 200 JSON response of a wire model (or a list of them), serialised by pydantic."""
    headers = {"ETag": f'"{etag}"'} if etag else None
    if isinstance(model, BaseModel):
        body = model.model_dump_json().encode()
    else:
        body = b"[" + b",".join(m.model_dump_json().encode() for m in model) + b"]"
    return Response(content=body, headers=headers, media_type="application/json")


CHUNKED_MIN = 1 << 20  # bytes of content from which a page's JSON is sent in pieces (``pieces_response``)
_CHUNK = 256 * 1024  # bytes of JSON per piece sent


def pieces_response(pieces: Iterable[bytes], content_bytes: int) -> Response:
    """A 200 JSON response whose body is ``pieces`` (encoded lazily, in order) joined. A page
    carrying ``content_bytes`` >= ``CHUNKED_MIN`` of content is sent in pieces of about
    ``_CHUNK`` bytes as they are encoded (chunked transfer), so the server never holds the
    whole JSON (up to six bytes per content byte: control characters are escaped) nor a
    second copy of it framed for the socket; a smaller page is one body."""
    if content_bytes < CHUNKED_MIN:
        return Response(content=b"".join(pieces), media_type="application/json")

    async def chunks() -> AsyncIterator[bytes]:
        buf: list[bytes] = []
        n = 0
        for piece in pieces:
            buf.append(piece)
            n += len(piece)
            if n >= _CHUNK:
                yield b"".join(buf)
                buf, n = [], 0
        if buf:
            yield b"".join(buf)

    return StreamingResponse(chunks(), media_type="application/json")


class StreamResponse(Response):
    """A response that runs an opened stream (``memfuse.server.streams``)."""

    def __init__(self, run: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        super().__init__(media_type=streaming.NDJSON.decode())
        self._run = run

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._run(scope, receive, send)
