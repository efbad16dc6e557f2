"""The accounts router: ``/v1/accounts`` (docs/API.md, "Accounts"): the root admin's
accounts and an account's attachments to every workspace of the account."""
from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from memfuse.models import Account, AccountCreate, AccountUpdate, Attachment, AttachmentPut
from memfuse.server import routetable as table
from memfuse.server.routes.deps import AccountSlug, Idem, P, StoreSlug, Svc, json_response, reply_response, route
from memfuse.server.problems import PROBLEM_RESPONSES

router = APIRouter(responses=PROBLEM_RESPONSES)  # the problem+json answers every operation may give


@route(router, table.CREATE_ACCOUNT, status_code=201, response_model=Account, tags=["accounts"])
def create_account(svc: Svc, body: AccountCreate, p: P, idem: Idem) -> Response:
    return reply_response(svc.create_account(p, body, idem))


@route(router, table.LIST_ACCOUNTS, response_model=list[Account], tags=["accounts"])
def list_accounts(svc: Svc, p: P) -> Response:
    return json_response(svc.list_accounts(p))


@route(router, table.GET_ACCOUNT, response_model=Account, tags=["accounts"])
def get_account(svc: Svc, account: AccountSlug, p: P) -> Response:
    return json_response(svc.get_account(p, account))


@route(router, table.UPDATE_ACCOUNT, response_model=Account, tags=["accounts"])
def update_account(svc: Svc, account: AccountSlug, body: AccountUpdate, p: P, idem: Idem) -> Response:
    return reply_response(svc.update_account(p, account, body, idem))


@route(router, table.DELETE_ACCOUNT, status_code=204, tags=["accounts"])
def delete_account(svc: Svc, account: AccountSlug, p: P, idem: Idem) -> Response:
    return reply_response(svc.delete_account(p, account, idem))


@route(router, table.PUT_ACCOUNT_ATTACHMENT, response_model=Attachment, tags=["accounts"])
def put_account_attachment(svc: Svc, account: AccountSlug, store: StoreSlug, body: AttachmentPut, p: P, idem: Idem) -> Response:
    return reply_response(svc.put_account_attachment(p, account, store, body, idem))


@route(router, table.DELETE_ACCOUNT_ATTACHMENT, status_code=204, tags=["accounts"])
def delete_account_attachment(svc: Svc, account: AccountSlug, store: StoreSlug, p: P, idem: Idem) -> Response:
    return reply_response(svc.delete_account_attachment(p, account, store, idem))
