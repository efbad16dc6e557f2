"""Anthropic's memory-store API (``/v1/memory_stores/…``) over memfuse's stores, records,
versions and attachments, so the anthropic SDK (``client.beta.memory_stores…``) and its
session sync helper (``anthropic.lib.tools._memories.SessionMemoryStores``) work against
``memfuse serve`` unchanged. docs/ANTHROPIC-API.md says what maps and what differs.

The wire format is the SDK's (anthropic 2.15.0, ``resources/beta/memory_stores/*.py`` and
``types/beta/memory_stores/*``): bodies in ``memfuse.server.anthropic_models``, errors in
Anthropic's envelope ``{"type": "error", "error": {"type": …, "message": …}}`` with the
statuses the SDK maps to its exception classes, and ``x-should-retry: false`` on every
refusal (the SDK retries a 409 by default; a failed precondition must not be retried).
The rules are memfuse's: the handlers call ``Service`` (``memfuse.server.memstores`` and the
record operations), so one store is the same through the mount, memfuse's API, the memory
tool, MCP and this API at once.

Identifiers (stable, reversible, nothing stored for them):

- ``memstore_<slug>``: the store's name in its account (a rename changes ``name`` only); for
  the root admin over every account, the store's reference (``keys.ref``:
  ``memstore_notes~bravo`` for a store of another account than ``default``), so two
  accounts' stores of one name have two ids (``memstores.shown_slug``);
- ``mem_<32 hex>``: the record's UUID without hyphens (``memory_id`` / ``record_id``);
- ``memver_<seq>``: the version's change-feed position, unique across the database.

Credentials: a memfuse token (workspace or admin) as ``x-api-key`` or as
``Authorization: Bearer``; ``anthropic-version`` and ``anthropic-beta`` are accepted and not
required. ``anthropic-workspace-id`` names a memfuse workspace (``wrkspc_`` prefix optional):
a workspace token's must be its own; with an admin token it scopes store listings and
attaches the stores it creates.
"""
from __future__ import annotations

import base64
import json
import logging
import math
import re
import unicodedata
import uuid
from collections.abc import Callable, Coroutine
from datetime import datetime
from typing import Annotated, Any, Literal

import anyio
import msgspec
from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel
from sqlalchemy.engine import Row
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from memfuse import defs
from memfuse.models import Record
from memfuse.server.base import AnyRow
from memfuse.server import anthropic_models as am
from memfuse.server.memstores import VERSION_OPERATIONS, ListedItem, shown_slug, store_id, store_out, store_slug
from memfuse.server.service import IdempotencyRequest, Principal, Reply, Service, ServiceError, idempotency_request

log = logging.getLogger(__name__)

PREFIX = "/v1/memory_stores"
_PAGE_ENCODER = msgspec.json.Encoder()
WORKSPACE_PREFIX = "wrkspc_"
MEMORY_PREFIX = "mem_"
VERSION_PREFIX = "memver_"


# ---------------------------------------------------------------- errors


class AnthropicError(Exception):
    """A refusal in Anthropic's envelope: HTTP ``status``, error ``type``
    (``invalid_request_error``, ``authentication_error``, ``permission_error``,
    ``not_found_error``, ``memory_precondition_failed_error``, ``memory_path_conflict_error``,
    ``conflict_error``, ``request_too_large``, ``rate_limit_error``, ``api_error``,
    ``overloaded_error``) and ``message``."""

    def __init__(self, status: int, type_: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(f"{status} {type_}: {message}")
        self.status, self.type, self.message = status, type_, message
        self.headers = headers or {}

    def response(self, request_id: str | None = None) -> Response:
        body = am.ErrorResponse(error=am.ErrorObject(type=self.type, message=self.message), request_id=request_id)
        headers = dict(self.headers)
        if self.status < 500 and self.status not in (408, 429):
            headers["x-should-retry"] = "false"  # a refusal the SDK must not retry (it retries 409)
        if request_id:
            headers["request-id"] = request_id
        return Response(body.model_dump_json().encode(), status_code=self.status, headers=headers,
                        media_type="application/json")


def _bad(message: str) -> AnthropicError:
    return AnthropicError(400, "invalid_request_error", message)


def from_service_error(e: ServiceError) -> AnthropicError:
    """The Anthropic refusal of a memfuse refusal: 422 → 400, 412 ``precondition_failed`` →
    409 ``memory_precondition_failed_error``, 409 ``path_exists`` → 409
    ``memory_path_conflict_error``, 403 ``store_archived`` and 507 ``store_full`` → 400, the
    rest by status; the message is memfuse's detail with its code."""
    msg = f"{e.detail} ({e.code})" if e.detail else e.code
    s, code = e.status, e.code
    if s == 412:
        return AnthropicError(409, "memory_precondition_failed_error", msg)
    if s == 409 and code == "path_exists":
        return AnthropicError(409, "memory_path_conflict_error", msg)
    if s == 409:
        return AnthropicError(409, "conflict_error", msg)
    if code == "store_archived" or s in (422, 400, 507):
        return AnthropicError(400, "invalid_request_error", msg)
    if s == 401:
        return AnthropicError(401, "authentication_error", msg)
    if s == 403:
        return AnthropicError(403, "permission_error", msg)
    if s == 404:
        return AnthropicError(404, "not_found_error", msg)
    if s == 413:
        return AnthropicError(413, "request_too_large", msg)
    if s == 429:
        return AnthropicError(429, "rate_limit_error", msg, e.headers)
    if s == 503:
        return AnthropicError(503, "overloaded_error", msg, e.headers)
    return AnthropicError(s if s >= 400 else 500, "api_error", msg, e.headers)


class _AnthropicRoute(APIRoute):
    """A route whose every refusal, validation included, answers in Anthropic's envelope
    (the app's own handlers answer problem+json for memfuse's API)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            rid = "req_" + uuid.uuid4().hex
            try:
                return await handler(request)
            except AnthropicError as e:
                return e.response(rid)
            except ServiceError as e:
                if e.status >= 500:
                    log.warning("%s %s: %s %s", request.method, request.url.path, e.status, e.code)
                return from_service_error(e).response(rid)
            except RequestValidationError as e:
                parts = []
                for err in e.errors():
                    loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
                    parts.append(f"{loc}: {err.get('msg', '')}" if loc else str(err.get("msg", "")))
                return _bad("; ".join(parts) or "invalid request").response(rid)
            except StarletteHTTPException as e:
                return AnthropicError(e.status_code, "invalid_request_error", str(e.detail)).response(rid)
            except OperationalError as e:
                text = str(e.orig).lower() if e.orig is not None else ""
                if "locked" in text or "busy" in text:
                    log.warning("database busy on %s %s", request.method, request.url.path)
                else:
                    log.error("database error on %s %s", request.method, request.url.path, exc_info=True)
                return AnthropicError(503, "overloaded_error", "database error; retry",
                                      {"retry-after": "1"}).response(rid)
            except Exception:
                log.exception("unhandled error in %s %s", request.method, request.url.path)
                return AnthropicError(500, "api_error", "unexpected server error").response(rid)

        return route


# the error type of a refusal the front door makes before the app runs
# (memfuse.server.gate: size, body deadline, write rate, load), by status
_GATE_TYPES = {401: "authentication_error", 408: "timeout_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error"}


def gate_refusal(status: int, code: str, detail: str) -> tuple[bytes, bytes]:
    """(body, content type) of a refusal of the front door (``memfuse.server.gate``) under
    ``PREFIX``: Anthropic's envelope, the error type by status (``api_error`` for others),
    the message memfuse's detail with its code."""
    body = am.ErrorResponse(error=am.ErrorObject(type=_GATE_TYPES.get(status, "api_error"),
                                                 message=f"{detail} ({code})"),
                            request_id="req_" + uuid.uuid4().hex)
    return body.model_dump_json().encode(), b"application/json"


# Every refusal an operation of this API may answer, as its OpenAPI document declares it
# (status → Anthropic error types; ``writes``: only POST and DELETE). Source: the SDK's
# status → exception map (anthropic 2.15.0, ``_client.py: _make_status_error``), and what
# memfuse answers (``from_service_error``, ``_AnthropicRoute``, ``gate_refusal``).
ERROR_STATUSES: dict[int, tuple[str, bool]] = {
    400: ("invalid_request_error: input the API does not take (validation, bounds, a page "
          "of another listing, a path or content memfuse refuses, an archived or full store)", False),
    401: ("authentication_error: no credential, or an unknown, revoked or expired one", False),
    403: ("permission_error: the credential may not do this, or names another workspace", False),
    404: ("not_found_error: no such memory store, memory or version (or not visible to the "
          "credential)", False),
    408: ("timeout_error: the request body did not arrive in time", False),
    409: ("memory_precondition_failed_error (the content's sha256 is not the precondition's), "
          "memory_path_conflict_error (a memory holds that path) or conflict_error", True),
    413: ("request_too_large: the body is larger than the endpoint takes", False),
    429: ("rate_limit_error: the credential writes faster than the server allows "
          "(Retry-After)", True),
    500: ("api_error: an unexpected server error", False),
    503: ("overloaded_error: the server or its database is busy; retry (Retry-After)", False),
}
ERROR_SCHEMA = "AnthropicErrorResponse"


def declare_errors(document: dict[str, Any]) -> None:
    """Make ``document`` (the app's OpenAPI document) declare what the operations under
    ``PREFIX`` answer on refusal: the statuses of ``ERROR_STATUSES`` in Anthropic's envelope
    (``application/json``, schema ``AnthropicErrorResponse``) instead of the app's
    problem+json and FastAPI's 422. Changes ``document`` in place."""
    comps = document.setdefault("components", {}).setdefault("schemas", {})
    schema = am.ErrorResponse.model_json_schema(ref_template="#/components/schemas/Anthropic{model}")
    for name, d in schema.pop("$defs", {}).items():
        comps["Anthropic" + name] = d
    schema["required"] = ["type", "error"]  # always sent (``request_id`` too, but may be null)
    comps[ERROR_SCHEMA] = schema
    ref = {"$ref": f"#/components/schemas/{ERROR_SCHEMA}"}
    for path, item in document.get("paths", {}).items():
        if not path.startswith(PREFIX):
            continue
        for method, op in item.items():
            if not isinstance(op, dict) or "responses" not in op:
                continue
            responses = {k: v for k, v in op["responses"].items() if k.startswith("2")}
            for status, (description, writes_only) in ERROR_STATUSES.items():
                if writes_only and method not in ("post", "delete"):
                    continue
                responses[str(status)] = {"description": description,
                                          "content": {"application/json": {"schema": ref}}}
            op["responses"] = responses


# ---------------------------------------------------------------- ids, paths, pages


def memory_id(record_id: str) -> str:
    """``mem_<hex>`` of a record id (a UUID); ids of another form are kept as they are."""
    try:
        return MEMORY_PREFIX + uuid.UUID(record_id).hex
    except ValueError:
        return MEMORY_PREFIX + record_id


def record_id_of(mem_id: str) -> str:
    """The record id of a ``mem_…`` id; 404 for anything else."""
    if not mem_id.startswith(MEMORY_PREFIX):
        raise AnthropicError(404, "not_found_error", f"no memory {mem_id!r}")
    rest = mem_id[len(MEMORY_PREFIX):]
    try:
        return str(uuid.UUID(hex=rest)) if len(rest) == 32 else rest
    except ValueError:
        return rest


def version_id(seq: int) -> str:
    return f"{VERSION_PREFIX}{seq}"


def version_seq(ver_id: str) -> int:
    """The seq of a ``memver_…`` id; 404 for anything else."""
    rest = ver_id[len(VERSION_PREFIX):] if ver_id.startswith(VERSION_PREFIX) else ""
    if not rest.isascii() or not rest.isdigit() or len(rest) > 18:
        raise AnthropicError(404, "not_found_error", f"no memory version {ver_id!r}")
    return int(rest)


def slug_of(memory_store_id: str) -> str:
    slug = store_slug(memory_store_id)
    if slug is None:
        raise AnthropicError(404, "not_found_error", f"no memory store {memory_store_id!r}")
    return slug


_LINE_SEPARATORS = ("\u2028", "\u2029")


def memfuse_path(path: str, what: str = "path") -> str:
    """The memfuse record path of an API path, by the API's rules (source: the SDK's
    ``MemoryCreateParams.path``): a leading ``/``, 1 to 20 segments, none empty, ``.`` or
    ``..``, no control (Cc) or format (Cf) characters nor U+2028 / U+2029, NFC, at most
    1,024 bytes. Returns the path without its leading ``/`` (memfuse's own rules then apply
    on write: reserved names, secrets). 400 otherwise."""
    if not path.startswith("/"):
        raise _bad(f"{what} must start with '/'")
    if len(path.encode("utf-8", "surrogatepass")) > am.PATH_MAX_BYTES:
        raise _bad(f"{what} is longer than {am.PATH_MAX_BYTES} bytes")
    if unicodedata.normalize("NFC", path) != path:
        raise _bad(f"{what} must be in Unicode Normalization Form C")
    for ch in path:
        if unicodedata.category(ch) in ("Cc", "Cf", "Cs") or ch in _LINE_SEPARATORS:
            raise _bad(f"{what} holds a control or format character (U+{ord(ch):04X})")
    segments = path[1:].split("/")
    if len(segments) > am.PATH_MAX_SEGMENTS:
        raise _bad(f"{what} has {len(segments)} segments, at most {am.PATH_MAX_SEGMENTS}")
    for seg in segments:
        if seg in ("", ".", ".."):
            raise _bad(f"{what} has an empty, '.' or '..' segment")
    return path[1:]


def _encode_page(value: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(value, separators=(",", ":")).encode()).decode().rstrip("=")


def _decode_page(page: str | None, kind: str) -> dict[str, Any] | None:
    if not page:
        return None
    try:
        value = json.loads(base64.urlsafe_b64decode(page + "=" * (-len(page) % 4)))
    except (ValueError, RecursionError):  # RecursionError: JSON nested deeper than the stack
        value = None
    if not isinstance(value, dict) or value.get("k") != kind or not _PAGE_SHAPES[kind](value):
        raise _bad("page is not a next_page value of this listing")
    return value


def _is_str(v: Any) -> bool:
    """A string a listing could have put in a page: valid UTF-8 (JSON's ``\\ud800`` decodes to
    a lone surrogate, which no database parameter can carry) without NUL (a record path or
    id never holds one; PostgreSQL text cannot)."""
    if not isinstance(v, str) or "\0" in v:
        return False
    if not v.isascii():
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            return False
    return True


def _is_int64(v: Any) -> bool:
    return type(v) is int and 0 <= v <= defs.INT64_MAX


def _is_number(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v) and abs(v) < 1e15


def _memory_position(v: Any) -> bool:
    """``ListedItem.after``: ``["m", path, record id]`` or ``["p", first path after a prefix]``."""
    return (isinstance(v, list) and all(_is_str(x) for x in v)
            and ((len(v) == 3 and v[0] == "m") or (len(v) == 2 and v[0] == "p")))


# INVARIANT: a ``page`` value decoded by ``_decode_page`` has exactly the shape its listing
# encodes (``_encode_page`` in ``list_stores`` / ``list_memories`` / ``list_versions``): the
# client holds it as an opaque string, so a forged one is a 400 ``invalid_request_error``,
# never a 500 from a value the handler trusted (attack 12 A7: ``"a": 5``, ``"b": 2**70``, ``"b": "x"``)
_PAGE_SHAPES: dict[str, Callable[[dict[str, Any]], bool]] = {
    "s": lambda v: _is_number(v.get("t")) and _is_str(v.get("s")),
    "m": lambda v: (isinstance(v.get("q"), list) and len(v["q"]) == 2 and _is_str(v["q"][0])
                    and _is_int64(v["q"][1]) and _memory_position(v.get("a"))),
    "v": lambda v: _is_int64(v.get("b")),
}


def _view(view: str | None, default: str) -> bool:
    """True for ``full``; 400 for anything but ``basic`` / ``full``."""
    v = view or default
    if v not in ("basic", "full"):
        raise _bad("view must be 'basic' or 'full'")
    return v == "full"


# ``limit``'s bounds stated in the OpenAPI document; the handler checks them itself (``_limit``)
# so that a bad one is Anthropic's 400 ``invalid_request_error``, not FastAPI's 422
ListLimit = Annotated[int, Query(json_schema_extra={"minimum": 1, "maximum": am.LIST_LIMIT_MAX})]


# ``created_at[gte|lte]``: an RFC 3339 date-time, as the document says (``format: date-time``);
# read by the handler (``_when``), since pydantic would also take a number (a Unix time) and
# a date alone, which the document refuses
_DATE_TIME = re.compile(r"\d{4}-\d\d-\d\d[Tt ]\d\d:\d\d:\d\d(\.\d{1,9})?([Zz]|[+-]\d\d:\d\d)?", re.ASCII)
WhenQ = Annotated[str | None, Query(json_schema_extra={"format": "date-time"})]


def _when(value: str | None, name: str) -> datetime | None:
    """The date-time of a ``created_at[…]`` filter (an offset-less one is taken as it is, as
    the anthropic SDK sends a naive ``datetime``); 400 for anything else."""
    if value is None:
        return None
    if not _DATE_TIME.fullmatch(value):
        raise _bad(f"{name} must be an RFC 3339 date-time")
    try:
        return datetime.fromisoformat(value[:19] + value[19:].replace("z", "Z"))
    except ValueError:
        raise _bad(f"{name} must be an RFC 3339 date-time") from None


def _limit(limit: int | None, full: bool) -> int:
    n = am.LIST_LIMIT_DEFAULT if limit is None else limit
    if not 1 <= n <= am.LIST_LIMIT_MAX:
        raise _bad(f"limit must be between 1 and {am.LIST_LIMIT_MAX}")
    return min(n, am.FULL_VIEW_LIMIT_MAX) if full else n


# ---------------------------------------------------------------- shapes


def memory_out(slug: str, rec: Record | Row[Any], content: str | None) -> am.MemoryOut:
    """``MemoryOut`` of a record (the model or a row with id, path, sha256, size, times, seq)."""
    return am.MemoryOut(
        id=memory_id(rec.id), memory_store_id=store_id(slug), memory_version_id=version_id(rec.seq),
        path="/" + rec.path, content_sha256=rec.sha256, content_size_bytes=rec.size,
        created_at=rec.created_at, updated_at=rec.updated_at, content=content,
    )


def actor_out(actor: str | None) -> am.SessionActor | am.APIActor | None:
    """The Anthropic actor of a memfuse actor: a sidecar's write (``ws:<w>/<instance>``) is a
    ``session_actor`` named by the instance (the mount is the session's filesystem); any other
    (``ws:<w>/api``: a workspace token through an API; ``admin:<name>``) an ``api_actor``
    whose ``api_key_id`` is the actor string itself."""
    if not actor:
        return None
    if actor.startswith("ws:"):
        instance = actor.rpartition("/")[2]
        if instance and instance != "api":
            return am.SessionActor(session_id=instance)
    return am.APIActor(api_key_id=actor)


def version_out(slug: str, v: AnyRow, with_content: bool) -> am.MemoryVersionOut:
    """``MemoryVersionOut`` of a version row: ``moved`` / ``restored`` / attribute changes
    are ``modified``; a redacted version shows no content, path, size or sha (its
    ``redacted_at`` is the version's own time when the redaction predates the column)."""
    op: Literal["created", "modified", "deleted"] = (
        "created" if v.operation == "created" else "deleted" if v.operation == "deleted" else "modified")
    out = am.MemoryVersionOut(
        id=version_id(v.seq), memory_id=memory_id(v.record_id), memory_store_id=store_id(slug),
        operation=op, created_at=v.created_at, created_by=actor_out(v.actor),
    )
    if v.redacted:
        out.redacted_at = getattr(v, "redacted_at", None) or v.created_at
        out.redacted_by = actor_out(getattr(v, "redacted_by", None))
        return out
    out.path = "/" + v.path
    if op != "deleted":
        out.content_sha256, out.content_size_bytes = v.sha256, v.size
        if with_content:
            out.content = v.content
    return out


def _json(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json().encode(), status_code=status, media_type="application/json")


def _reply(r: Reply) -> Response:
    return Response(r.body, status_code=r.status, media_type="application/json")


# ---------------------------------------------------------------- validation of bodies


def _check_name(name: str) -> str:
    if not 1 <= len(name) <= am.NAME_MAX_CHARS:
        raise _bad(f"name must be 1 to {am.NAME_MAX_CHARS} characters long")
    if any(unicodedata.category(ch) == "Cc" for ch in name):
        raise _bad("name must not hold control characters")
    return name


def _check_description(description: str) -> str:
    if len(description) > am.DESCRIPTION_MAX_CHARS:
        raise _bad(f"description is longer than {am.DESCRIPTION_MAX_CHARS} characters")
    return description


def check_metadata(meta: dict[str, str]) -> None:
    """At most 16 pairs; keys 1 to 64 characters, values at most 512. 400 otherwise."""
    if len(meta) > am.METADATA_MAX_PAIRS:
        raise _bad(f"metadata holds {len(meta)} pairs, at most {am.METADATA_MAX_PAIRS}")
    for k, v in meta.items():
        if not 1 <= len(k) <= am.METADATA_KEY_MAX_CHARS:
            raise _bad(f"metadata keys must be 1 to {am.METADATA_KEY_MAX_CHARS} characters long")
        if len(v) > am.METADATA_VALUE_MAX_CHARS:
            raise _bad(f"metadata values must be at most {am.METADATA_VALUE_MAX_CHARS} characters long")


def _sha(value: str | None, what: str) -> str:
    if value is None or len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise _bad(f"{what} must be 64 lowercase hexadecimal characters")
    return value


# ---------------------------------------------------------------- the router


# the two ways to send the credential, as the OpenAPI document's security schemes (either)
_api_key = APIKeyHeader(name="x-api-key", auto_error=False, scheme_name="AnthropicApiKey",
                        description="a memfuse token (workspace or admin), as the anthropic SDK sends it")
_bearer = HTTPBearer(auto_error=False, scheme_name="HTTPBearer", description="workspace or admin token")


async def principal(
    request: Request,
    x_api_key: Annotated[str | None, Depends(_api_key)] = None,
    bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)] = None,
) -> Principal:
    """The caller: a memfuse token as ``x-api-key`` (it wins) or ``Authorization: Bearer``;
    401 ``authentication_error`` when missing, unknown, revoked or expired."""
    svc: Service = request.app.state.service
    token = (x_api_key or "").strip() or (bearer.credentials.strip() if bearer is not None else None)
    if not token:
        raise AnthropicError(401, "authentication_error", "x-api-key header is required")
    p = svc.authenticate_cached(token, None)
    if p is None:
        p = await anyio.to_thread.run_sync(svc.authenticate, token, None)
    if svc.token_upkeep_due():  # tokens' last_used_at, as memfuse's own API keeps it
        await anyio.to_thread.run_sync(svc.token_upkeep)
    account = request.headers.get("x-memfuse-account") or request.query_params.get("account")
    if account:  # the root admin acting in one account (docs/API.md "Accounts")
        p = await anyio.to_thread.run_sync(svc.act_in_account, p, account)
    return p


def workspace(
    request: Request,
    p: Annotated[Principal, Depends(principal)],
    anthropic_workspace_id: Annotated[str | None, Header()] = None,
) -> str | None:
    """The workspace the request names (``anthropic-workspace-id``), checked against the
    token as memfuse's API checks a workspace in a path (``Service.check_workspace``): 404
    ``not_found_error`` for a missing workspace or one of another account (never telling
    which), 403 ``permission_error`` for a workspace token naming another workspace of its
    own account. None when not named by an admin token. Reads the database only when a
    workspace token names another workspace, or an admin token names one."""
    ws = anthropic_workspace_id
    if ws and ws.startswith(WORKSPACE_PREFIX):
        ws = ws[len(WORKSPACE_PREFIX):]
    # a workspace token's own workspace: its key; the header may give its name (memfuse.server.keys)
    if p.workspace is not None and (not ws or ws in (p.workspace, p.workspace_name)):
        return p.workspace
    if ws:
        svc: Service = request.app.state.service
        try:
            svc.check_workspace(p, ws)
        except ServiceError as e:
            raise from_service_error(e) from None
        if p.workspace is not None:  # not reached: AccessRules refuses another workspace
            raise AnthropicError(403, "permission_error", "the credential belongs to another workspace")
    return ws or None


async def idempotency(request: Request) -> IdempotencyRequest | None:
    """The identity of a write sent with ``Idempotency-Key`` (memfuse's rules, docs/API.md)."""
    key = request.headers.get("idempotency-key")
    if not key:
        return None
    if len(key) > 255:
        raise _bad("Idempotency-Key is longer than 255 characters")
    return idempotency_request(key, request.method, request.url.path, await request.body())


P = Annotated[Principal, Depends(principal)]
WS = Annotated[str | None, Depends(workspace)]
Idem = Annotated[IdempotencyRequest | None, Depends(idempotency)]
ViewQ = Annotated[str | None, Query(description="basic (no content) or full")]


def install(app: FastAPI, svc: Service) -> None:
    """Add the memory-store API's routes to ``app`` (``memfuse.server.app.create_app``)."""

    front = getattr(app, "front", None)  # memfuse.server.gate.Gate authenticates before the body
    if front is not None:
        front.api_key_prefixes = (*front.api_key_prefixes, PREFIX)

        def unauthorized(e: ServiceError, scope: Any) -> Response:
            message = "x-api-key header is required" if e.detail == "a bearer token is required" else e.detail
            return AnthropicError(401, "authentication_error", message).response("req_" + uuid.uuid4().hex)

        front.auth_refusals[PREFIX] = unauthorized
        front.refusal_bodies[PREFIX] = gate_refusal

    base_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        """The app's document, with this API's refusals declared as they are answered."""
        if app.openapi_schema is None:
            declare_errors(base_openapi())
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]

    # every route checks anthropic-workspace-id against the token (FastAPI runs a dependency
    # once per request, so the routes that read it get the same answer)
    r = APIRouter(prefix=PREFIX, route_class=_AnthropicRoute, tags=["anthropic memory stores"],
                  dependencies=[Depends(workspace)])

    # ------------------------------------------------------------ memory stores

    @r.post("", response_model=am.MemoryStoreOut)
    def create_store(body: am.MemoryStoreCreate, p: P, ws: WS, idem: Idem) -> Response:
        """Create a store: the slug from the name (docs/ANTHROPIC-API.md), memfuse's default
        limits; attached read-write to the workspace the request names (admin token)."""
        meta = body.metadata or {}
        check_metadata(meta)
        return _reply(svc.ms_create_store(
            p, name=_check_name(body.name), description=_check_description(body.description or ""),
            metadata=meta, workspace=ws, idem=idem))

    @r.get("", response_model=am.MemoryStorePage)
    def list_stores(
        p: P, ws: WS,
        created_gte: Annotated[WhenQ, Query(alias="created_at[gte]")] = None,
        created_lte: Annotated[WhenQ, Query(alias="created_at[lte]")] = None,
        include_archived: bool = False,
        limit: ListLimit = am.LIST_LIMIT_DEFAULT,
        page: str | None = None,
    ) -> Response:
        n = _limit(limit, False)
        cur = _decode_page(page, "s")
        rows = svc.ms_list_stores(p, ws, include_archived=include_archived,
                                  created_gte=_when(created_gte, "created_at[gte]"),
                                  created_lte=_when(created_lte, "created_at[lte]"))
        start = 0
        if cur is not None:
            key = (cur["t"], cur["s"])
            start = next((i for i, st in enumerate(rows)
                          if (-st.created_at.timestamp(), shown_slug(st, p)) > key), len(rows))
        chunk = rows[start:start + n]
        more = start + n < len(rows)
        nxt = _encode_page({"k": "s", "t": -chunk[-1].created_at.timestamp(), "s": shown_slug(chunk[-1], p)}) if more else None
        return _json(am.MemoryStorePage(data=[store_out(st, p) for st in chunk], next_page=nxt))

    @r.get("/{memory_store_id}", response_model=am.MemoryStoreOut)
    def get_store(memory_store_id: str, p: P) -> Response:
        return _json(store_out(svc.ms_get_store(p, slug_of(memory_store_id)), p))

    @r.post("/{memory_store_id}", response_model=am.MemoryStoreOut)
    def update_store(memory_store_id: str, body: am.MemoryStoreUpdate, p: P, idem: Idem) -> Response:
        return _reply(svc.ms_update_store(
            p, slug_of(memory_store_id),
            name=_check_name(body.name) if body.name is not None else None,
            description=_check_description(body.description) if body.description is not None else None,
            metadata_patch=body.metadata, check_metadata=check_metadata, idem=idem))

    @r.delete("/{memory_store_id}", response_model=am.DeletedMemoryStore)
    def delete_store(memory_store_id: str, p: P, idem: Idem) -> Response:
        return _reply(svc.ms_delete_store(p, slug_of(memory_store_id), idem))

    @r.post("/{memory_store_id}/archive", response_model=am.MemoryStoreOut)
    def archive_store(memory_store_id: str, p: P, idem: Idem) -> Response:
        return _reply(svc.ms_archive_store(p, slug_of(memory_store_id), idem))

    # ------------------------------------------------------------ memories

    @r.post("/{memory_store_id}/memories", response_model=am.MemoryOut)
    def create_memory(memory_store_id: str, body: am.MemoryCreate, p: P, idem: Idem, view: ViewQ = None) -> Response:
        slug = slug_of(memory_store_id)
        full = _view(view, "basic")
        content = body.content or ""
        reply = svc.ms_create_memory(p, slug, memfuse_path(body.path), content, idem)
        rec = Record.model_validate_json(reply.body)
        return _json(memory_out(slug, rec, content if full else None))

    @r.get("/{memory_store_id}/memories", response_model=am.MemoryPage)
    def list_memories(
        memory_store_id: str, p: P,
        depth: Annotated[int, Query(ge=0, le=defs.INT64_MAX)] = 0,
        limit: ListLimit = am.LIST_LIMIT_DEFAULT,
        page: str | None = None,
        path_prefix: str | None = None,
        view: ViewQ = None,
    ) -> Response:
        slug = slug_of(memory_store_id)
        full = _view(view, "basic")
        n = _limit(limit, full)
        prefix = ""
        if path_prefix is not None and path_prefix != "/":
            if not path_prefix.endswith("/"):
                raise _bad("path_prefix must end with '/'")
            prefix = memfuse_path(path_prefix[:-1], "path_prefix") + "/"
        cur = _decode_page(page, "m")
        after = None
        if cur is not None:
            if cur.get("q") != [prefix, depth]:
                raise _bad("page belongs to a listing with another path_prefix or depth")
            after = tuple(cur["a"])
        items, more = svc.ms_list_memories(p, slug, prefix=prefix, depth=depth, limit=n, after=after,
                                           with_content=full)
        nxt = _encode_page({"k": "m", "q": [prefix, depth], "a": list(items[-1].after)}) if more else None
        # the page's JSON by msgspec from plain dicts (the members of MemoryOut / MemoryPrefix;
        # tests/test_anthropic_api.py holds a listed memory equal to the retrieved one): 0.2 ms
        # of CPU per page of 100 where a pydantic model per memory took 3.1 ms
        sid = store_id(slug)

        def listed(it: ListedItem) -> dict[str, Any]:
            if it.prefix is not None:
                return {"type": "memory_prefix", "path": "/" + it.prefix}
            row = it.row
            assert row is not None  # an item is a prefix or a row (ListedItem)
            return {"type": "memory", "id": memory_id(row.id), "memory_store_id": sid,
                    "memory_version_id": version_id(row.seq), "path": "/" + row.path,
                    "content_sha256": row.sha256, "content_size_bytes": row.size,
                    "created_at": row.created_at, "updated_at": row.updated_at,
                    "content": row.content if full else None}

        data = [listed(it) for it in items]
        return Response(_PAGE_ENCODER.encode({"data": data, "next_page": nxt}), media_type="application/json")

    @r.get("/{memory_store_id}/memories/{memory_id}", response_model=am.MemoryOut)
    def get_memory(memory_store_id: str, memory_id: str, p: P, view: ViewQ = None) -> Response:
        slug = slug_of(memory_store_id)
        full = _view(view, "full")
        rec = svc.get_record(p, slug, record_id_of(memory_id), with_content=full)
        if rec.deleted:
            raise AnthropicError(404, "not_found_error", f"memory {memory_id!r} is deleted")
        return _json(memory_out(slug, rec, rec.content if full else None))

    @r.post("/{memory_store_id}/memories/{memory_id}", response_model=am.MemoryOut)
    def update_memory(memory_store_id: str, memory_id: str, body: am.MemoryUpdate, p: P, idem: Idem,
                      view: ViewQ = None) -> Response:
        slug = slug_of(memory_store_id)
        full = _view(view, "basic")
        if_match = None
        if body.precondition is not None:
            if_match = '"' + _sha(body.precondition.content_sha256, "precondition.content_sha256") + '"'
        path = memfuse_path(body.path) if body.path is not None else None
        reply = svc.ms_update_memory(p, slug, record_id_of(memory_id), content=body.content, path=path,
                                     if_match=if_match, idem=idem)
        rec = Record.model_validate_json(reply.body)
        content = None
        if full:
            content = body.content if body.content is not None else svc.get_record(p, slug, rec.id).content
        return _json(memory_out(slug, rec, content))

    @r.delete("/{memory_store_id}/memories/{memory_id}", response_model=am.DeletedMemory)
    def delete_memory(memory_store_id: str, memory_id: str, p: P, idem: Idem,
                      expected_content_sha256: str | None = None) -> Response:
        slug = slug_of(memory_store_id)
        if_match = None
        if expected_content_sha256 is not None:
            if_match = '"' + _sha(expected_content_sha256, "expected_content_sha256") + '"'
        svc.delete_record(p, slug, record_id_of(memory_id), if_match, idem)
        return _json(am.DeletedMemory(id=memory_id))

    # ------------------------------------------------------------ memory versions

    @r.get("/{memory_store_id}/memory_versions", response_model=am.MemoryVersionPage)
    def list_versions(
        memory_store_id: str, p: P,
        api_key_id: str | None = None,
        created_gte: Annotated[WhenQ, Query(alias="created_at[gte]")] = None,
        created_lte: Annotated[WhenQ, Query(alias="created_at[lte]")] = None,
        limit: ListLimit = am.LIST_LIMIT_DEFAULT,
        memory_id: str | None = None,
        operation: str | None = None,
        page: str | None = None,
        service_account_id: str | None = None,
        session_id: str | None = None,
        view: ViewQ = None,
    ) -> Response:
        slug = slug_of(memory_store_id)
        full = _view(view, "basic")
        n = _limit(limit, full)
        if operation is not None and operation not in VERSION_OPERATIONS:
            raise _bad("operation must be 'created', 'modified' or 'deleted'")
        cur = _decode_page(page, "v")
        if service_account_id is not None:  # memfuse has no service accounts: nothing matches
            return _json(am.MemoryVersionPage(data=[]))
        rows, more = svc.ms_list_versions(
            p, slug, limit=n, before_seq=cur["b"] if cur else None,
            record_id=record_id_of(memory_id) if memory_id is not None else None,
            operations=VERSION_OPERATIONS[operation] if operation else None,
            created_gte=_when(created_gte, "created_at[gte]"), created_lte=_when(created_lte, "created_at[lte]"),
            actor_exact=api_key_id, actor_instance=session_id, with_content=full)
        if api_key_id is not None:  # an api_actor's id is its actor string, never a session's
            rows = [v for v in rows if isinstance(actor_out(v.actor), am.APIActor)]
        nxt = _encode_page({"k": "v", "b": rows[-1].seq}) if more and rows else None
        return _json(am.MemoryVersionPage(data=[version_out(slug, v, full) for v in rows], next_page=nxt))

    @r.get("/{memory_store_id}/memory_versions/{memory_version_id}", response_model=am.MemoryVersionOut)
    def get_version(memory_store_id: str, memory_version_id: str, p: P, view: ViewQ = None) -> Response:
        slug = slug_of(memory_store_id)
        full = _view(view, "full")
        v = svc.ms_get_version(p, slug, version_seq(memory_version_id), with_content=full)
        return _json(version_out(slug, v, full))

    @r.post("/{memory_store_id}/memory_versions/{memory_version_id}/redact", response_model=am.MemoryVersionOut)
    def redact_version(memory_store_id: str, memory_version_id: str, p: P, idem: Idem) -> Response:
        slug = slug_of(memory_store_id)
        v = svc.ms_redact_version(p, slug, version_seq(memory_version_id), idem)
        return _json(version_out(slug, v, True))

    app.include_router(r)


__all__ = ["AnthropicError", "ERROR_STATUSES", "PREFIX", "declare_errors", "from_service_error", "gate_refusal",
           "install", "memfuse_path",
           "memory_id", "record_id_of", "version_id", "version_seq"]
