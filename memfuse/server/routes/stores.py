"""The stores router: ``/v1/stores`` and ``/v1/stores/{store}`` (admin: create, list, read,
update stores; docs/API.md, "Stores")."""
from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from memfuse.models import Store, StoreCreate, StoreUpdate
from memfuse.server import routetable as table
from memfuse.server.routes.deps import Idem, P, StoreSlug, Svc, json_response, reply_response, route
from memfuse.server.problems import PROBLEM_RESPONSES

router = APIRouter(responses=PROBLEM_RESPONSES)  # the problem+json answers every operation may give


@route(router, table.CREATE_STORE, status_code=201, response_model=Store, tags=["admin"])
def create_store(svc: Svc, body: StoreCreate, p: P, idem: Idem) -> Response:
    return reply_response(svc.create_store(p, body, idem))


@route(router, table.LIST_STORES, response_model=list[Store], tags=["admin"])
def list_stores(svc: Svc, p: P) -> Response:
    return json_response(svc.list_stores(p))


@route(router, table.GET_STORE, response_model=Store, tags=["admin"])
def get_store(svc: Svc, store: StoreSlug, p: P) -> Response:
    return json_response(svc.get_store(p, store))


@route(router, table.UPDATE_STORE, response_model=Store, tags=["admin"])
def update_store(svc: Svc, store: StoreSlug, body: StoreUpdate, p: P, idem: Idem) -> Response:
    return reply_response(svc.update_store(p, store, body, idem))
