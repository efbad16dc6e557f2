"""The tokens router: ``/v1/tokens`` (admin: create, list, revoke; docs/TOKENS.md)."""
from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from memfuse.models import TokenCreate, TokenCreated, TokenInfo
from memfuse.server import routetable as table
from memfuse.server.routes.deps import Idem, P, Svc, json_response, reply_response, route
from memfuse.server.problems import PROBLEM_RESPONSES

router = APIRouter(responses=PROBLEM_RESPONSES)  # the problem+json answers every operation may give


@route(router, table.CREATE_TOKEN, status_code=201, response_model=TokenCreated, tags=["admin"])
def create_token(svc: Svc, body: TokenCreate, p: P, idem: Idem) -> Response:
    return reply_response(svc.create_token(p, body, idem))


@route(router, table.LIST_TOKENS, response_model=list[TokenInfo], tags=["admin"])
def list_tokens(svc: Svc, p: P, workspace: str | None = None, include_revoked: bool = False) -> Response:
    return json_response(svc.list_tokens(p, workspace, include_revoked))


@route(router, table.REVOKE_TOKEN, status_code=204, tags=["admin"])
def revoke_token(svc: Svc, token_id: str, p: P, idem: Idem) -> Response:
    return reply_response(svc.revoke_token(p, token_id, idem))
