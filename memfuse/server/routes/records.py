"""The records router: a store's records and their versions (read, write, move, delete,
restore, redact), the batch of record writes, search and the index report (docs/API.md,
"Records", "Batch", "Search", "Index report")."""
from __future__ import annotations

import json
from typing import Annotated, Literal

import anyio
from fastapi import APIRouter, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError

from memfuse import defs
from memfuse.models import (
    BatchResponse,
    BatchRequest,
    IndexReport,
    MoveResult,
    PrefixMove,
    Record,
    RecordAppend,
    RecordAttributes,
    RecordCreate,
    RecordMove,
    RecordPage,
    RecordUpdate,
    Restore,
    SearchPage,
    Version,
)
from memfuse.server.batch import batch_body
from memfuse.server import routetable as table
from memfuse.server.routes.deps import (
    Idem,
    IfMatch,
    P,
    StoreSlug,
    Svc,
    VersionNumber,
    json_response,
    pieces_response,
    reply_response,
    route,
)
from memfuse.server.problems import PROBLEM_RESPONSES
from memfuse.server.service import Service, ServiceError

router = APIRouter(responses=PROBLEM_RESPONSES)  # the problem+json answers every operation may give


def batch_max_bytes(svc: Service) -> int:
    """Bytes a batch body may hold (413 ``batch_too_large`` past it): the front door's body
    bound of record writes (``Settings.max_body``, ``memfuse serve --max-body``; default
    ``defs.BATCH_MAX_BYTES``), so a batch holds any one record a store may allow
    (``defs.record_body_bound``). The fast path (``memfuse.server.writepath``) reads it here too."""
    return svc.settings.max_body


@route(router, table.LIST_RECORDS, response_model=RecordPage, tags=["records"])
def list_records(
    svc: Svc,
    store: StoreSlug,
    p: P,
    cursor: str | None = None,
    limit: Annotated[int, Query(ge=1, le=defs.RECORDS_PAGE_MAX)] = defs.RECORDS_PAGE_DEFAULT,
    content: bool = False,
    path: str | None = None,
    include_deleted: bool = False,
) -> Response:
    pieces, content_bytes = svc.list_records_pieces(  # the RecordPage's JSON, without pydantic per record
        p, store, cursor=cursor, limit=limit, with_content=content, path=path,
        include_deleted=include_deleted,
    )
    return pieces_response(pieces, content_bytes)


@route(router, table.SEARCH_RECORDS, response_model=SearchPage, tags=["records"])
def search_records(
    svc: Svc,
    store: StoreSlug,
    p: P,
    q: Annotated[str, Query(min_length=1, max_length=defs.SEARCH_QUERY_MAX,
                            description="literal text (one line) to find")],
    match: Annotated[Literal["any", "path", "content"], Query(
        description="where to look: the path, the content, or either")] = "any",
    prefix: Annotated[str, Query(max_length=defs.SEARCH_PREFIX_MAX, description=(
        "only the record at this path or under this directory"))] = "",
    type: Annotated[str | None, Query(description="only records of this type")] = None,
    case_sensitive: bool = False,
    cursor: str | None = None,
    limit: Annotated[int, Query(ge=1, le=defs.SEARCH_PAGE_MAX,
                                description="records read for this page")] = defs.SEARCH_PAGE_DEFAULT,
    max_lines: Annotated[int, Query(ge=0, le=defs.SEARCH_LINES_MAX,
                                    description="matching lines shown per record")] = defs.SEARCH_LINES_DEFAULT,
    order: Annotated[Literal["path", "relevance"], Query(description=(
        "path: substring search in path order (grep); relevance: every word of q in the "
        "full-text index, best first, with score and snippet"))] = "path",
) -> Response:
    """Live records whose path and / or content hold ``q`` (docs/API.md, "Search")."""
    return json_response(svc.search(p, store, q, match=match, prefix=prefix, type=type,
                            case_sensitive=case_sensitive, cursor=cursor, limit=limit,
                            max_lines=max_lines, order=order))


@route(router, table.INDEX_REPORT, response_model=IndexReport, tags=["records"])
def index_report(svc: Svc, store: StoreSlug, p: P) -> Response:
    """How the store's ``MEMORY.md`` and its records agree (docs/API.md, "Index report")."""
    return json_response(svc.index_report(p, store))


@route(router, table.CREATE_RECORD, status_code=201, response_model=Record, tags=["records"])
def create_record(svc: Svc, store: StoreSlug, body: RecordCreate, p: P, idem: Idem) -> Response:
    return reply_response(svc.create_record(p, store, body, idem))


@route(router, table.GET_RECORD, response_model=Record, tags=["records"])
def get_record(svc: Svc, store: StoreSlug, record_id: str, p: P, content: bool = True) -> Response:
    rec = svc.get_record(p, store, record_id, with_content=content)
    return json_response(rec, etag=rec.sha256)


@route(router, table.UPDATE_RECORD, response_model=Record, tags=["records"])
def update_record(svc: Svc, store: StoreSlug, record_id: str, body: RecordUpdate, p: P, idem: Idem, if_match: IfMatch = None) -> Response:
    return reply_response(svc.update_record(p, store, record_id, body, if_match, idem))


@route(router, table.APPEND_RECORD, response_model=Record, tags=["records"])
def append_record(svc: Svc, store: StoreSlug, record_id: str, body: RecordAppend, p: P, idem: Idem,
                  if_match: IfMatch = None) -> Response:
    return reply_response(svc.append_record(p, store, record_id, body, if_match, idem))


@route(router, table.SET_RECORD_ATTRIBUTES, response_model=Record, tags=["records"])
def set_record_attributes(
    svc: Svc,
    store: StoreSlug, record_id: str, body: RecordAttributes, p: P, idem: Idem, if_match: IfMatch = None
) -> Response:
    return reply_response(svc.set_attributes(p, store, record_id, body, if_match, idem))


@route(router, table.MOVE_RECORD, response_model=MoveResult, tags=["records"])
def move_record(svc: Svc, store: StoreSlug, record_id: str, body: RecordMove, p: P, idem: Idem, if_match: IfMatch = None) -> Response:
    return reply_response(svc.move_record(p, store, record_id, body, if_match, idem))


@route(router, table.MOVE_PREFIX, response_model=MoveResult, tags=["records"])
def move_prefix(svc: Svc, store: StoreSlug, body: PrefixMove, p: P, idem: Idem) -> Response:
    return reply_response(svc.move_prefix(p, store, body, idem))


@route(router, table.DELETE_RECORD, status_code=204, tags=["records"], responses={204: {
    "description": "Deleted (a `deleted` version is kept)", "headers": {defs.SEQ_HEADER: {
        "description": "the change-feed seq of the `deleted` version", "schema": {"type": "integer"}}}}})
def delete_record(svc: Svc, store: StoreSlug, record_id: str, p: P, idem: Idem, if_match: IfMatch = None) -> Response:
    return reply_response(svc.delete_record(p, store, record_id, if_match, idem))


@route(
    router, table.BATCH, response_model=BatchResponse, tags=["records"],
    openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/BatchRequest"}}}}},
)
async def batch(svc: Svc, request: Request, store: StoreSlug, p: P) -> Response:
    """Up to 100 record writes to one store in one transaction, each answered as alone
    (docs/API.md, "Batch")."""
    if request.headers.get("idempotency-key"):
        raise ServiceError(422, "validation_error",
                           "a batch takes no Idempotency-Key: give each operation its own idempotency_key")
    raw = bytearray()
    most = batch_max_bytes(svc)
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > most:
            raise ServiceError(413, "batch_too_large", f"a batch body holds at most {most} bytes")
    try:  # json.loads, as FastAPI parses the single endpoints' bodies (lone surrogates
        # reach the content rules and become that operation's 422 invalid_content)
        req = BatchRequest.model_validate(json.loads(raw))
    except (ValueError, RecursionError) as err:  # RecursionError: JSON nested too deep to parse
        errors = err.errors(include_input=False) if isinstance(err, ValidationError) else [
            {"loc": ["body"], "msg": f"invalid JSON: {err}", "type": "json_invalid"}]
        raise RequestValidationError(errors) from None
    replies = await anyio.to_thread.run_sync(svc.batch, p, store, req.operations)
    return Response(content=batch_body(replies), media_type="application/json")


@route(router, table.LIST_VERSIONS, response_model=list[Version], tags=["records"], responses={200: {"headers": {
    "Link": {"description": '<?…&cursor=N>; rel="next" (RFC 8288) when more versions follow: the next '
             "page's query, relative to this request's URL", "schema": {"type": "string"}}}}})
def list_versions(
    request: Request,
    svc: Svc,
    store: StoreSlug,
    record_id: str,
    p: P,
    limit: Annotated[int, Query(ge=1, le=defs.VERSIONS_PAGE_MAX,
                                description="versions in this page")] = defs.VERSIONS_PAGE_DEFAULT,
    order: Annotated[Literal["asc", "desc"], Query(
        description="asc: oldest first; desc: newest first")] = "asc",
    cursor: Annotated[int | None, Query(ge=0, le=defs.INT64_MAX, description=(
        "the last version number of the previous page (its Link rel=next gives it): this "
        "page holds the versions after it (asc) or before it (desc)"))] = None,
) -> Response:
    """A page of the record's versions without content (docs/API.md, "Records"); when more
    follow, the header ``Link: <?…cursor=N…>; rel="next"`` gives the next page's query."""
    page = svc.list_versions(p, store, record_id, limit=limit, cursor=cursor, newest_first=order == "desc")
    return Response(content=page.body(), headers=page.headers(request.url.query), media_type="application/json")


@route(router, table.GET_VERSION, response_model=Version, tags=["records"])
def get_version(svc: Svc, store: StoreSlug, record_id: str, n: VersionNumber, p: P) -> Response:
    return json_response(svc.get_version(p, store, record_id, n))


@route(router, table.RESTORE_RECORD, response_model=Record, tags=["records"])
def restore_record(svc: Svc, store: StoreSlug, record_id: str, body: Restore, p: P, idem: Idem) -> Response:
    return reply_response(svc.restore_record(p, store, record_id, body, idem))


@route(router, table.REDACT_VERSION, response_model=Version, tags=["records"])
def redact_version(svc: Svc, store: StoreSlug, record_id: str, n: VersionNumber, p: P, idem: Idem) -> Response:
    return reply_response(svc.redact_version(p, store, record_id, n, idem))
