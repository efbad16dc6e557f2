"""The control plane's faces for agents without a mount: the memory-tool endpoint and MCP.

- ``POST /v1/workspaces/{ws}/memory-tool``: the body is the model's ``tool_use.input`` as is
  (``{"command": "view", "path": "/memories"}``); the answer is ``{"content", "is_error"}``
  (200 also for a refused command: the model reads the refusal). Workspace token auth as
  everywhere; header ``X-Memfuse-Instance`` names the client (actor ``tool:<client>``).
- ``/mcp``: the MCP server of ``memfuse.mcp_server`` over streamable HTTP, stateless (every
  POST stands alone, so any replica answers), authenticated with a workspace bearer token:
  a missing or unknown token gets ``401`` with ``WWW-Authenticate: Bearer
  resource_metadata="…/.well-known/oauth-protected-resource/mcp"`` (RFC 9728 §5.1), and that
  document names the resource and the header bearer method. ``GET /mcp`` is 405: a stateless
  server sends nothing unasked, so it holds no event stream open (the transport allows it). Tokens are issued by the
  operator (``memfuse token create``), so it lists no authorization server. Versions are
  recorded as ``tool:mcp-<client name>`` (the client's ``clientInfo.name`` is not sent on
  stateless requests after ``initialize``, so the header ``X-Memfuse-Instance`` names it;
  default ``mcp``).

Both run commands through ``memfuse.server.memtool.MemoryTool`` in a worker thread.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from fastapi import Body, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from memfuse.mcp_server import INDEX, TOOL_INSTRUCTIONS, build_server
from memfuse.models import MemoryToolResult
from memfuse.server.gate import mcp_body_bound, replay
from memfuse.server.memtool import ROOT, MemoryTool, ToolResult, clean_client
from memfuse.server.service import Principal, Service, ServiceError

log = logging.getLogger(__name__)

MCP_PATH = "/mcp"
METADATA_PATH = "/.well-known/oauth-protected-resource" + MCP_PATH


class InProcessBackend:
    """``ToolBackend`` of the MCP server inside the control plane: one workspace, one
    principal; every call runs in a worker thread."""

    def __init__(self, svc: Service, principal: Principal, workspace: str, client: str) -> None:
        self.svc = svc
        self.workspace = workspace
        self.tool = MemoryTool(svc, principal, workspace, client)

    async def call(self, command: dict[str, Any]) -> tuple[str, bool]:
        bad = _bad_name(command, "arguments")
        if bad is not None:
            return f"{bad}: not valid Unicode text (a lone surrogate code point)", True
        try:
            r: ToolResult = await anyio.to_thread.run_sync(self.tool.run, command)
        except ServiceError as e:
            if e.code != "timeout":
                raise
            # a read ended by its budget (memfuse.server.budget): past --read-timeout, or its
            # client gone (then no one reads this); the model may retry or ask for less
            return e.detail, True
        return _text(r.content), r.is_error

    async def instructions(self) -> str:
        text = await anyio.to_thread.run_sync(
            functools.partial(self.svc.context, self.tool.p, self.workspace, ROOT, mounted=False))
        return TOOL_INSTRUCTIONS + text

    async def stores(self) -> list[str]:
        atts = await anyio.to_thread.run_sync(self.svc.list_attachments, self.tool.p, self.workspace)
        return [a.store.slug for a in atts]

    async def read_index(self, store: str) -> str | None:
        def read() -> str | None:
            try:
                page = self.svc.list_records(self.tool.p, store, path=INDEX, limit=1, with_content=True)
            except ServiceError as e:
                if e.status == 404:
                    raise LookupError(store) from None
                raise
            return page.records[0].content if page.records else None

        return await anyio.to_thread.run_sync(read)


# Memory-tool parameters that name something (a path, a store, the command): a lone surrogate
# there is refused before the tool runs (422). Text parameters (file_text, new_str, ...) reach
# the tool, which refuses such content as it refuses any invalid UTF-8 (EILSEQ).
_NAMING_KEYS = ("command", "path", "old_path", "new_path", "store", "query")


def _text(s: str) -> str:
    """``s`` with every lone surrogate as U+FFFD (so it has a UTF-8 form)."""
    return s.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def _bad_name(command: dict[str, Any], where: str) -> str | None:
    """The first naming parameter (or any parameter name) of a memory-tool command holding a
    lone surrogate, as ``"<where>.path"``; None when there is none."""
    for k in command:
        if isinstance(k, str) and _not_unicode(k, where):
            return where
    for k in _NAMING_KEYS:
        if _not_unicode(command.get(k), f"{where}.{k}"):
            return f"{where}.{k}"
    return None


def _not_unicode(value: Any, where: str = "body") -> str | None:
    """Where in a decoded JSON value a string holds a lone surrogate (JSON's ``"\\ud800"``
    decodes to one; it has no UTF-8 form, so it can be neither a path nor stored), e.g.
    ``"body.path"``; None when there is none."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            found = _not_unicode(k, where) or _not_unicode(v, f"{where}.{k}")
            if found:
                return found
    if isinstance(value, list):
        for i, v in enumerate(value):
            found = _not_unicode(v, f"{where}[{i}]")
            if found:
                return found
    return None


def install(app: FastAPI, svc: Service, principal: Callable[..., Any]) -> None:
    """Add the memory-tool endpoint, ``/mcp`` and its protected-resource metadata to ``app``.
    ``principal`` is the app's authentication dependency. The MCP session manager runs in
    the app's lifespan (``memfuse serve`` runs it; an ``httpx.ASGITransport`` client must
    enter ``app.router.lifespan_context(app)`` itself to use ``/mcp``)."""

    @app.post("/v1/workspaces/{ws}/memory-tool", response_model=MemoryToolResult, tags=["agent tools"])
    def memory_tool(
        ws: str,
        p: Principal = Depends(principal),
        command: dict[str, Any] = Body(
            description="the model's tool_use.input as is: {command, path, ...} (docs/AGENT-TOOLS.md)",
            examples=[{"command": "view", "path": "/memories"}]),
    ) -> Response:
        # the workspace's key (memfuse.server.keys); as REST: 404 for another account's or a
        # missing one (and 403 for another workspace of the token's account)
        own = not p.is_admin and ws in (p.workspace, p.workspace_name)
        key = p.workspace if own else svc.check_workspace(p, ws)
        assert key is not None
        bad = _bad_name(command, "body")
        if bad is not None:
            raise ServiceError(422, "validation_error",
                               f"{bad}: not valid Unicode text (a lone surrogate code point)")
        r = MemoryTool(svc, p, key, p.instance).run(command)
        body = MemoryToolResult(content=_text(r.content), is_error=r.is_error).model_dump_json()
        return Response(body, media_type="application/json")

    # the backend of the request being served, set around each /mcp request
    backend_var: contextvars.ContextVar[InProcessBackend] = contextvars.ContextVar("memfuse_mcp_backend")
    server = build_server(lambda: backend_var.get())
    instructions_var = type(server).current_instructions  # type: ignore[attr-defined]
    most = mcp_body_bound(svc.settings.max_body)  # the front door's bound of /mcp, here too
    manager = StreamableHTTPSessionManager(
        app=server,
        stateless=True,
        json_response=True,
        max_request_body_size=most,
        # Bearer tokens, not cookies, authenticate: a page in a browser cannot use them, so
        # the DNS-rebinding guard (Host / Origin allow-lists) is not needed and would refuse
        # deployments behind a proxy.
        security_settings=TransportSecuritySettings(enable_dns_rebinding_protection=False),
    )

    def metadata_url(request_scope: Scope) -> str:
        return _base_url(request_scope) + METADATA_PATH

    def unauthorized(e: ServiceError, scope: Scope) -> Response:
        """The 401 of /mcp (RFC 9728 §5.1); also what the front door answers for it."""
        return JSONResponse(
            {"error": "invalid_token", "error_description": e.detail}, status_code=401,
            headers={"WWW-Authenticate": f'Bearer error="invalid_token", '
                                         f'resource_metadata="{metadata_url(scope)}"'})

    front = getattr(app, "front", None)  # memfuse.server.gate.Gate: authenticates /mcp first
    if front is not None:
        front.auth_refusals[MCP_PATH] = unauthorized
        front.refusal_bodies[MCP_PATH] = _rpc_refusal

    async def mcp_app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] == "GET":
            # stateless: no server-initiated messages, so no SSE stream to hold open (the
            # streamable HTTP transport lets a server answer 405 here)
            await Response(status_code=405, headers={"Allow": "POST, DELETE"})(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        p: Principal | None = scope.get("memfuse.principal")
        if p is None:
            auth = headers.get("authorization", "")
            token = auth[7:].strip() if auth[:7].lower() == "bearer " else None
            try:
                found = svc.authenticate_cached(token, headers.get("x-memfuse-instance"))
                if found is None:
                    found = await anyio.to_thread.run_sync(svc.authenticate, token, headers.get("x-memfuse-instance"))
            except ServiceError as e:
                await unauthorized(e, scope)(scope, receive, send)
                return
            p = found
        if p.is_admin:
            resp = JSONResponse({"error": "insufficient_scope",
                                 "error_description": "/mcp needs a workspace token"}, status_code=403,
                                headers={"WWW-Authenticate": 'Bearer error="insufficient_scope"'})
            await resp(scope, receive, send)
            return
        assert p.workspace is not None
        backend = InProcessBackend(svc, p, p.workspace, "mcp-" + clean_client(p.instance) if p.instance else "mcp")
        # Read the body (bounded by the transport's own limit later) to see whether it is an
        # initialize or discover: only those carry the instructions (the prompt block).
        body = b""
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > most:
                await JSONResponse({"error": "request too large"}, status_code=413)(scope, receive, send)
                return
        instructions = None
        try:
            wanted = _wants_instructions(body)
        except RecursionError:  # nested deeper than the parser recurses: JSON-RPC's parse error
            await JSONResponse({"jsonrpc": "2.0", "id": None, "error": {
                "code": -32700, "message": "Parse error: JSON nested too deep"}},
                status_code=400)(scope, receive, send)
            return
        if wanted:
            instructions = await backend.instructions()

        t1 = backend_var.set(backend)
        t2 = instructions_var.set(instructions)
        try:
            await manager.handle_request(scope, replay(body, receive), send)
        finally:
            backend_var.reset(t1)
            instructions_var.reset(t2)

    async def metadata(request: Request) -> Response:
        base = _base_url(request.scope)
        return JSONResponse({
            "resource": base + MCP_PATH,
            "bearer_methods_supported": ["header"],
            "resource_name": "memfuse memory (MCP)",
        })

    # an object, not a function: Starlette then calls it as an ASGI app
    app.router.routes.append(Route(MCP_PATH, endpoint=_Asgi(mcp_app), methods=["GET", "POST", "DELETE"]))
    app.router.routes.append(Route(METADATA_PATH, endpoint=metadata, methods=["GET"]))

    previous = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[Any]:
        async with previous(a) as state, manager.run():
            yield state

    app.router.lifespan_context = lifespan
    app.state.mcp_manager = manager


class _Asgi:
    """Wraps an ASGI callable so Starlette's ``Route`` treats it as an app."""

    def __init__(self, fn: Callable[[Scope, Receive, Send], Any]) -> None:
        self.fn = fn

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.fn(scope, receive, send)


RPC_SERVER_ERROR = -32000  # JSON-RPC's "server error" range: the front door's refusals of /mcp


def _rpc_refusal(status: int, code: str, detail: str) -> tuple[bytes, bytes]:
    """(body, content type) of the front door's refusal of a ``/mcp`` request with HTTP
    ``status`` (429, 503, 504 ``timeout`` ...): a JSON-RPC error response (id null: the
    request was not read as JSON-RPC), ``data`` holding the status and the problem code."""
    return json.dumps({"jsonrpc": "2.0", "id": None, "error": {
        "code": RPC_SERVER_ERROR, "message": detail,
        "data": {"status": status, "code": code}}}).encode(), b"application/json"


def _wants_instructions(body: bytes) -> bool:
    """Whether the JSON-RPC message (or batch) ``body`` is an ``initialize`` or
    ``server/discover`` (the requests that carry the instructions). A body that is not JSON
    is False (the transport answers it); raises RecursionError for JSON nested deeper than
    the parser recurses, which the caller answers as a parse error (-32700)."""
    try:
        msg = json.loads(body)
    except ValueError:
        return False
    msgs = msg if isinstance(msg, list) else [msg]
    return any(isinstance(m, dict) and m.get("method") in ("initialize", "server/discover") for m in msgs)


def _base_url(scope: Scope) -> str:
    """The URL the client used to reach this server (scheme and Host header; behind a
    proxy, the proxy's ``X-Forwarded-Proto`` / ``X-Forwarded-Host`` when present)."""
    headers: dict[str, str] = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
    own_scheme: str = scope.get("scheme", "http")
    scheme = headers.get("x-forwarded-proto", own_scheme).split(",")[0].strip()
    host = headers.get("x-forwarded-host") or headers.get("host")
    if not host:
        server = scope.get("server") or ("localhost", 80)
        host = f"{server[0]}:{server[1]}"
    return f"{scheme}://{host.split(',')[0].strip()}{scope.get('root_path', '')}"
