"""The workspaces router: ``/v1/workspaces`` (admin: create, list), a workspace's attachments
(admin: attach, detach; a workspace token: list its own) and its prompt block (``context``)."""
from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import PlainTextResponse, Response

from memfuse.defs import ACCOUNT_HEADER, ACTOR_HEADER
from memfuse.models import Attachment, AttachmentPut, Workspace, WorkspaceCreate
from memfuse.server import routetable as table
from memfuse.server.routes.deps import Idem, P, StoreSlug, Svc, json_response, reply_response, route
from memfuse.server.problems import PROBLEM_RESPONSES
from memfuse.server.service import CONTEXT_MIN_BYTES

router = APIRouter(responses=PROBLEM_RESPONSES)  # the problem+json answers every operation may give


@route(router, table.CREATE_WORKSPACE, status_code=201, response_model=Workspace, tags=["admin"])
def create_workspace(svc: Svc, body: WorkspaceCreate, p: P, idem: Idem) -> Response:
    return reply_response(svc.create_workspace(p, body, idem))


@route(router, table.LIST_WORKSPACES, response_model=list[Workspace], tags=["admin"])
def list_workspaces(svc: Svc, p: P) -> Response:
    return json_response(svc.list_workspaces(p))


@route(router, table.PUT_ATTACHMENT, response_model=Attachment, tags=["admin"])
def put_attachment(svc: Svc, ws: str, store: StoreSlug, body: AttachmentPut, p: P, idem: Idem) -> Response:
    return reply_response(svc.put_attachment(p, ws, store, body, idem))


@route(router, table.DELETE_ATTACHMENT, status_code=204, tags=["admin"])
def delete_attachment(svc: Svc, ws: str, store: StoreSlug, p: P, idem: Idem) -> Response:
    return reply_response(svc.delete_attachment(p, ws, store, idem))


@route(router, table.LIST_ATTACHMENTS, response_model=list[Attachment], tags=["workspace"])
def list_attachments(svc: Svc, ws: str, p: P) -> Response:
    account, atts = svc.workspace_attachments(p, ws)
    r = json_response(atts)
    if p.actor.isascii() and p.actor.isprintable():  # a header value (a sidecar's always is)
        r.headers[ACTOR_HEADER] = p.actor  # the actor of the caller's writes: a sidecar's own
    r.headers[ACCOUNT_HEADER] = account  # a slug: what `memfuse mount` keys its cache dir by
    return r


@route(router, table.CONTEXT, response_class=PlainTextResponse,
    responses={200: {"content": {"text/markdown": {}}, "description": "the prompt block"}},
    tags=["workspace"],
)
def context(
    svc: Svc,
    ws: str,
    p: P,
    mount_root: Annotated[
        str | None,
        Query(description="where the sidecar mounts the stores (default: the server's, "
                          "/mnt/memory, or the mountpoint under memfuse dev)"),
    ] = None,
    max_bytes: Annotated[
        int | None,
        Query(ge=CONTEXT_MIN_BYTES, le=10_000_000,
              description="bound of the whole block in bytes (default: the server's setting)"),
    ] = None,
    mounted: Annotated[
        bool,
        Query(description="false: for an agent without a mount (memory tool, MCP): leave out "
                          "the line on the mount's .memfuse/errors.log"),
    ] = True,
) -> Response:
    text = svc.context(p, ws, mount_root or svc.mount_root, max_bytes, mounted=mounted)
    return PlainTextResponse(text, media_type="text/markdown; charset=utf-8")
