"""The route table of the v1 API: every route's method and URL path template, in one place.

The app's routers (``memfuse.server.routes.<resource>``) register their handlers from it, and
the three places that look at a request without FastAPI's routing read it too: the long-poll
fast path (``memfuse.server.longpoll.FastPath``: which requests are long-polls), the CLI's
local transport (``memfuse.server.local.LocalTransport``: which reads it answers itself) and
batch (``memfuse.server.batch``: the method and URL path of the single endpoint each operation
stands for, which is its idempotency identity). So a route is spelled once.

Templates use Starlette's syntax: ``{name}`` matches one non-empty path segment (no ``/``),
as the app's router does with its default ``str`` convertor; ``match`` therefore agrees with
the app on which route a decoded path (ASGI ``scope["path"]``) is. This module imports
nothing (the local transport avoids loading FastAPI; batch and the fast path sit below the app).
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ROUTES", "Match", "Route", "match"]


@dataclass(frozen=True)
class Route:
    """One route of the v1 API: ``name`` (the handler's name: the FastAPI route name, from
    which the OpenAPI ``operationId`` is made), HTTP ``method`` and URL ``path`` template."""

    name: str
    method: str
    path: str
    segments: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "segments", tuple(self.path.split("/")[1:]))

    def url(self, **params: str) -> str:
        """The URL path of this route with ``params`` filled in (not percent-encoded: the
        form an idempotency key's identity and ASGI's decoded ``scope["path"]`` use)."""
        return self.path.format(**params)

    def match(self, segments: list[str] | tuple[str, ...]) -> dict[str, str] | None:
        """The path parameters when ``segments`` (a decoded path split on ``/``, without the
        empty first piece) is this route's, else None."""
        if len(segments) != len(self.segments):
            return None
        params: dict[str, str] = {}
        for want, got in zip(self.segments, segments):
            if want.startswith("{") and want.endswith("}"):
                if not got:
                    return None
                params[want[1:-1]] = got
            elif want != got:
                return None
        return params


@dataclass(frozen=True)
class Match:
    """A request's route and its path parameters (decoded strings)."""

    route: Route
    params: dict[str, str]


# ------------------------------------------------------------ accounts
CREATE_ACCOUNT = Route("create_account", "POST", "/v1/accounts")
LIST_ACCOUNTS = Route("list_accounts", "GET", "/v1/accounts")
GET_ACCOUNT = Route("get_account", "GET", "/v1/accounts/{account}")
UPDATE_ACCOUNT = Route("update_account", "PATCH", "/v1/accounts/{account}")
DELETE_ACCOUNT = Route("delete_account", "DELETE", "/v1/accounts/{account}")
PUT_ACCOUNT_ATTACHMENT = Route("put_account_attachment", "PUT", "/v1/accounts/{account}/attachments/{store}")
DELETE_ACCOUNT_ATTACHMENT = Route("delete_account_attachment", "DELETE",
                                  "/v1/accounts/{account}/attachments/{store}")
# ------------------------------------------------------------ workspaces, stores, attachments
CREATE_WORKSPACE = Route("create_workspace", "POST", "/v1/workspaces")
LIST_WORKSPACES = Route("list_workspaces", "GET", "/v1/workspaces")
CREATE_STORE = Route("create_store", "POST", "/v1/stores")
LIST_STORES = Route("list_stores", "GET", "/v1/stores")
GET_STORE = Route("get_store", "GET", "/v1/stores/{store}")
UPDATE_STORE = Route("update_store", "PATCH", "/v1/stores/{store}")
PUT_ATTACHMENT = Route("put_attachment", "PUT", "/v1/workspaces/{ws}/attachments/{store}")
DELETE_ATTACHMENT = Route("delete_attachment", "DELETE", "/v1/workspaces/{ws}/attachments/{store}")
LIST_ATTACHMENTS = Route("list_attachments", "GET", "/v1/workspaces/{ws}/attachments")
# ------------------------------------------------------------ tokens
CREATE_TOKEN = Route("create_token", "POST", "/v1/tokens")
LIST_TOKENS = Route("list_tokens", "GET", "/v1/tokens")
REVOKE_TOKEN = Route("revoke_token", "DELETE", "/v1/tokens/{token_id}")
# ------------------------------------------------------------ a workspace's feeds and prompt block
EVENTS = Route("events", "GET", "/v1/workspaces/{ws}/events")
CONTEXT = Route("context", "GET", "/v1/workspaces/{ws}/context")
# ------------------------------------------------------------ records
LIST_RECORDS = Route("list_records", "GET", "/v1/stores/{store}/records")
SEARCH_RECORDS = Route("search_records", "GET", "/v1/stores/{store}/search")
INDEX_REPORT = Route("index_report", "GET", "/v1/stores/{store}/index")
CREATE_RECORD = Route("create_record", "POST", "/v1/stores/{store}/records")
GET_RECORD = Route("get_record", "GET", "/v1/stores/{store}/records/{record_id}")
UPDATE_RECORD = Route("update_record", "PUT", "/v1/stores/{store}/records/{record_id}")
APPEND_RECORD = Route("append_record", "POST", "/v1/stores/{store}/records/{record_id}/append")
SET_RECORD_ATTRIBUTES = Route("set_record_attributes", "PATCH", "/v1/stores/{store}/records/{record_id}")
MOVE_RECORD = Route("move_record", "POST", "/v1/stores/{store}/records/{record_id}/move")
MOVE_PREFIX = Route("move_prefix", "POST", "/v1/stores/{store}/move")
DELETE_RECORD = Route("delete_record", "DELETE", "/v1/stores/{store}/records/{record_id}")
BATCH = Route("batch", "POST", "/v1/stores/{store}/batch")
LIST_VERSIONS = Route("list_versions", "GET", "/v1/stores/{store}/records/{record_id}/versions")
GET_VERSION = Route("get_version", "GET", "/v1/stores/{store}/records/{record_id}/versions/{n}")
RESTORE_RECORD = Route("restore_record", "POST", "/v1/stores/{store}/records/{record_id}/restore")
REDACT_VERSION = Route("redact_version", "POST", "/v1/stores/{store}/records/{record_id}/versions/{n}/redact")
CHANGES = Route("changes", "GET", "/v1/stores/{store}/changes")
# ------------------------------------------------------------ consolidation jobs
CREATE_CONSOLIDATION = Route("create_consolidation", "POST", "/v1/stores/{store}/consolidations")
LIST_CONSOLIDATIONS = Route("list_consolidations", "GET", "/v1/stores/{store}/consolidations")
GET_CONSOLIDATION = Route("get_consolidation", "GET", "/v1/consolidations/{job_id}")
CANCEL_CONSOLIDATION = Route("cancel_consolidation", "POST", "/v1/consolidations/{job_id}/cancel")

ROUTES: tuple[Route, ...] = tuple(v for v in dict(globals()).values() if isinstance(v, Route))
"""Every route of the v1 API (the app registers exactly these; ``tests/test_routes.py``)."""

_BY_SHAPE: dict[tuple[str, int], tuple[Route, ...]] = {}
for _r in ROUTES:
    _BY_SHAPE[(_r.method, len(_r.segments))] = (*_BY_SHAPE.get((_r.method, len(_r.segments)), ()), _r)


def match(method: str, path: str) -> Match | None:
    """The route of a request (``method``, decoded URL ``path`` as ASGI's ``scope["path"]``)
    and its path parameters, or None when no v1 route is it (another face: the console, the
    memory tool, MCP, the Anthropic API; or a 404)."""
    segments = path.split("/")[1:]
    for r in _BY_SHAPE.get((method, len(segments)), ()):
        params = r.match(segments)
        if params is not None:
            return Match(r, params)
    return None
