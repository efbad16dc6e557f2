"""Problem details (RFC 9457) of the control plane's app: the response of a refusal, and the
exception handlers every route and the long-poll fast path answer with.

Every error is ``application/problem+json`` with memfuse's ``code``: refusals of the service
(``ServiceError``), request validation (422 ``validation_error``), unknown routes (404
``not_found``), a database that stays locked (503 ``unavailable``, ``Retry-After: 1``) and
unexpected exceptions (500 ``internal_error``, logged with the traceback).
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from memfuse.models import Problem
from memfuse.server.base import REASONS, ServiceError

log = logging.getLogger("memfuse.server.app")

PROBLEM_JSON = "application/problem+json"
PROBLEM_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": Problem, "description": "Refusal (RFC 9457 problem details)",
            "content": {PROBLEM_JSON: {}}},
    "5XX": {"model": Problem, "description": "Transient failure (RFC 9457 problem details)",
            "content": {PROBLEM_JSON: {}}},
}
"""The OpenAPI responses every operation may give besides its own."""


def problem_response(
    status: int,
    code: str,
    detail: str = "",
    *,
    headers: Mapping[str, str] | None = None,
    **extra: Any,
) -> JSONResponse:
    """An ``application/problem+json`` response; ``extra`` become additional members. A lone
    surrogate in ``detail`` (echoed client input) becomes U+FFFD: the body is always UTF-8."""
    detail = detail.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    body = Problem(title=REASONS.get(status, "Error"), status=status, detail=detail, code=code).model_dump()
    body.update(jsonable_encoder(extra))
    return JSONResponse(body, status_code=status, headers=headers, media_type=PROBLEM_JSON)


def exception_response(exc: Exception, scope: Mapping[str, Any]) -> Response:
    """What the app's exception handlers answer for ``exc`` (for the long-poll fast path and
    the streams, which answer outside FastAPI's handlers)."""
    if isinstance(exc, ServiceError):
        if exc.status >= 500:
            log.warning("%s %s: %s %s", scope.get("method"), scope.get("path"), exc.status, exc.code)
        return problem_response(exc.status, exc.code, exc.detail, headers=exc.headers, **exc.extra)
    if isinstance(exc, OperationalError):
        return db_error_response(exc, str(scope.get("method")), str(scope.get("path")))
    log.error("unhandled error in %s %s", scope.get("method"), scope.get("path"), exc_info=exc)
    return problem_response(500, "internal_error", "unexpected server error")


def db_error_response(exc: OperationalError, method: str, path: str) -> Response:
    """503 ``unavailable`` with ``Retry-After: 1`` for a database error: "the database is
    busy" when SQLite stayed locked (logged as a warning), else "database error" (logged with
    the traceback)."""
    text = str(exc.orig).lower() if exc.orig is not None else ""
    if "locked" in text or "busy" in text:
        log.warning("database busy on %s %s", method, path)
        return problem_response(503, "unavailable", "the database is busy; retry", headers={"Retry-After": "1"})
    log.error("database error on %s %s", method, path, exc_info=exc)
    return problem_response(503, "unavailable", "database error; retry", headers={"Retry-After": "1"})


def install_error_handlers(app: FastAPI) -> None:
    """Register the problem+json handlers of ``ServiceError``, request validation, Starlette's
    HTTP errors (404 / 405) and database errors on ``app``."""

    async def on_service_error(request: Request, exc: ServiceError) -> Response:
        if exc.status >= 500:
            log.warning("%s %s: %s %s", request.method, request.url.path, exc.status, exc.code)
        return problem_response(exc.status, exc.code, exc.detail, headers=exc.headers, **exc.extra)

    async def on_validation_error(request: Request, exc: RequestValidationError) -> Response:
        errors = [
            {"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
            for e in exc.errors()
        ]
        detail = "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in errors)
        return problem_response(422, "validation_error", detail, errors=errors)

    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 400 and isinstance(exc.__cause__, (ValueError, RecursionError)):
            # FastAPI's answer to a body ``json.loads`` refused with other than a
            # JSONDecodeError (an integer of more than 4,300 digits, Python's bound on
            # integer parsing; JSON nested past the parser's depth): 400 "There was an error
            # parsing the body". Answered as its JSONDecodeError is, and as the batch route
            # answers the same bodies: 422 ``validation_error``, ``json_invalid``.
            return await on_validation_error(request, RequestValidationError(
                [{"loc": ["body"], "msg": f"invalid JSON: {exc.__cause__}", "type": "json_invalid"}]))
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        detail = exc.detail if isinstance(exc.detail, str) else ""
        if exc.status_code == 404 and detail == "Not Found":
            detail = f"no route for {request.method} {request.url.path}"
        return problem_response(exc.status_code, code, detail, headers=getattr(exc, "headers", None))

    async def on_db_error(request: Request, exc: OperationalError) -> Response:
        return db_error_response(exc, request.method, request.url.path)

    handlers: dict[type[Exception], Callable[[Request, Any], Awaitable[Response]]] = {
        ServiceError: on_service_error,
        RequestValidationError: on_validation_error,
        StarletteHTTPException: on_http_error,
        OperationalError: on_db_error,
    }
    for exc_type, handler in handlers.items():
        app.add_exception_handler(exc_type, handler)
