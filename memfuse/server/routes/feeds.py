"""The feeds router: a store's change feed and a workspace's events, each a page, a
long-poll (``wait``: ``memfuse.server.longpoll``) or an NDJSON stream (``stream``:
``memfuse.server.streams``). The long-polls and streams are usually answered by the fast path
in front of the app (``longpoll.FastPath``) before they get here; these handlers answer the rest
(a parameter to validate, a token to look up) the same way."""
from __future__ import annotations

from typing import Annotated

import anyio
from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from memfuse import defs
from memfuse.models import ChangePage, EventPage
from memfuse.server import longpoll
from memfuse.server import routetable as table
from memfuse.server.jsonpieces import json_list_pieces
from memfuse.server.routes.deps import (After, P, StoreSlug, StreamResponse, Svc, Wait, json_response, pieces_response,
                                        route)
from memfuse.server.problems import PROBLEM_RESPONSES

router = APIRouter(responses=PROBLEM_RESPONSES)  # the problem+json answers every operation may give


@route(router, table.EVENTS, response_model=EventPage, tags=["workspace"])
async def events(
    svc: Svc,
    request: Request,
    ws: str,
    p: P,
    after: After = 0,
    wait: Wait = 0,
    limit: Annotated[int, Query(ge=1, le=defs.FEED_PAGE_MAX)] = defs.FEED_PAGE_MAX,
    stream: Annotated[bool, Query(description="answer an NDJSON stream of pages (docs/API.md)")] = False,
) -> Response:
    if stream and request.app.state.streams.enabled:
        return StreamResponse(await request.app.state.streams.events(p, ws, after, limit=limit))
    if wait <= 0:
        return json_response(await anyio.to_thread.run_sync(lambda: svc.events_page(p, ws, after, limit)))
    return await longpoll.events(svc, request, p, ws, after, wait, limit=limit)


@route(router, table.CHANGES, response_model=ChangePage, tags=["records"])
async def changes(
    svc: Svc,
    request: Request,
    store: StoreSlug,
    p: P,
    after: After = 0,
    wait: Wait = 0,
    content: bool = True,
    limit: Annotated[int, Query(ge=1, le=defs.FEED_PAGE_MAX)] = defs.FEED_PAGE_MAX,
    skip_actor: Annotated[
        str | None,
        Query(description="leave out versions whose actor is exactly this, among those written "
              "without Memfuse-Writer (a sidecar's own writes); seq still moves past them and a "
              "long-poll keeps waiting"),
    ] = None,
    skip_writer: Annotated[
        str | None,
        Query(description="leave out versions written with Memfuse-Writer exactly this (one sidecar's "
              "own writes, not those of another sidecar of the same actor); wins over skip_actor"),
    ] = None,
    stream: Annotated[bool, Query(description="answer an NDJSON stream of pages (docs/API.md)")] = False,
) -> Response:
    skip = skip_writer or skip_actor or None
    if stream and request.app.state.streams.enabled:
        return StreamResponse(await request.app.state.streams.changes(
            request.app.state.feed_reads, p, store, after, limit=limit, content=content, skip_actor=skip))
    if wait <= 0:
        page = await anyio.to_thread.run_sync(
            lambda: svc.changes_page(p, store, after, limit=limit, with_content=content, skip_actor=skip))
        return change_page_response(page)
    return await longpoll.changes(svc, request.app.state.feed_reads, request, p, store, after, wait, limit=limit, content=content,
                                  skip_actor=skip)


def change_page_response(page: ChangePage) -> Response:
    """The JSON of ``page`` (the bytes of ``page.model_dump_json()``), sent in pieces when it
    carries much content (``deps.pieces_response``)."""
    content = sum(len(c.record.content) for c in page.changes if c.record.content is not None)
    items = (c.model_dump_json().encode() for c in page.changes)
    return pieces_response(json_list_pieces(b'{"changes":[', items, b'],"seq":%d}' % page.seq), content)
