"""memfuse as an MCP server: the memory tool's commands as flat MCP tools, each store's
``MEMORY.md`` as a resource, the workspace's prompt block as the server's instructions.

Built on the official ``mcp`` SDK's low-level ``Server`` (anyio: runs under trio and asyncio).
The tools only translate: every call becomes one memory-tool command (``{"command": ...}``)
run by the control plane's command engine (``memfuse.server.memtool``), reached through a
``ToolBackend``: in-process inside ``memfuse serve`` (``/mcp``), over HTTP with the
workspace token for ``memfuse mcp`` on stdio (``HttpBackend``).

Tools: ``memory_view``, ``memory_create``, ``memory_str_replace``, ``memory_insert``,
``memory_delete``, ``memory_rename`` (the memory tool's own parameter names),
``memory_search``, ``memory_history``, ``memory_remember``. Their input schemas are written
by hand: plain ``type: object`` with typed properties, no ``oneOf`` / ``anyOf`` / nullable
unions (some model APIs refuse a whole tool list for one union). A refused command is a tool
result with ``isError`` true and the engine's exact text, never a protocol error.

Resources: ``memfuse:///memories/<store>/MEMORY.md`` per attached store (text/markdown).
Subscriptions (``resources/subscribe``) are served where the connection is long-lived
(stdio): a change of a subscribed index is pushed as ``notifications/resources/updated``
within about a second (the store's change feed, long-polled).
"""
from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable
from typing import Any, Protocol

import mcp_types as types
from mcp.server import Server
from mcp.server.context import ServerRequestContext
from mcp.shared.exceptions import MCPError

log = logging.getLogger(__name__)

SERVER_NAME = "memfuse"
RESOURCE_PREFIX = "memfuse:///memories/"
INDEX = "MEMORY.md"
RESOURCE_NOT_FOUND = -32002  # MCP's code for an unknown resource
TOOL_INSTRUCTIONS = (
    "Memory tools: memory_view, memory_create, memory_str_replace, memory_insert, memory_delete, "
    "memory_rename, memory_search, memory_history and memory_remember act on the stores below, at "
    "/memories/<store>/. Start with memory_view /memories.\n\n"
)


class ToolBackend(Protocol):
    """Where the MCP tools' commands run (one workspace)."""

    async def call(self, command: dict[str, Any]) -> tuple[str, bool]:
        """Run one memory-tool command; ``(content, is_error)``."""
        ...

    async def instructions(self) -> str:
        """The workspace's prompt block (stores, access, each ``MEMORY.md``)."""
        ...

    async def stores(self) -> list[str]:
        """Slugs of the attached stores."""
        ...

    async def read_index(self, store: str) -> str | None:
        """The store's ``MEMORY.md`` text; None when it has none. ``LookupError`` when the
        store is not attached."""
        ...


def _path(description: str) -> dict[str, Any]:
    return {"type": "string", "description": description}


_P = _path("Path under /memories: /memories/<store>/<file>, e.g. /memories/default/notes.md")
TOOLS: list[types.Tool] = [
    types.Tool(
        name="memory_view",
        description=("Show a directory of memory (files and directories up to 2 levels deep, with sizes) or a "
                     "file with line numbers. /memories lists the stores. Long files are shown in parts: "
                     "pass view_range to read on."),
        input_schema={"type": "object", "properties": {
            "path": _P,
            "view_range": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2,
                           "description": "[start_line, end_line], 1-based; end_line -1 reads to the end"},
        }, "required": ["path"], "additionalProperties": False},
        annotations=types.ToolAnnotations(read_only_hint=True),
    ),
    types.Tool(
        name="memory_create",
        description="Create a new memory file with the given text. Refuses if the file already exists.",
        input_schema={"type": "object", "properties": {
            "path": _P, "file_text": {"type": "string", "description": "the whole content of the new file"},
        }, "required": ["path", "file_text"], "additionalProperties": False},
        annotations=types.ToolAnnotations(destructive_hint=False),
    ),
    types.Tool(
        name="memory_str_replace",
        description="Replace the one occurrence of old_str in a memory file with new_str.",
        input_schema={"type": "object", "properties": {
            "path": _P,
            "old_str": {"type": "string", "description": "text to replace; must appear exactly once"},
            "new_str": {"type": "string", "description": "replacement text (empty to remove old_str)"},
        }, "required": ["path", "old_str", "new_str"], "additionalProperties": False},
    ),
    types.Tool(
        name="memory_insert",
        description=("Insert a line of text into a memory file after line insert_line (0 = at the top). "
                     "insert_line equal to the number of lines appends, atomically."),
        input_schema={"type": "object", "properties": {
            "path": _P,
            "insert_line": {"type": "integer", "minimum": 0, "description": "insert after this line"},
            "insert_text": {"type": "string", "description": "text to insert"},
        }, "required": ["path", "insert_line", "insert_text"], "additionalProperties": False},
    ),
    types.Tool(
        name="memory_delete",
        description=("Delete a memory file, or a directory and every file in it. Each file keeps its history "
                     "and can be restored."),
        input_schema={"type": "object", "properties": {"path": _P}, "required": ["path"],
                      "additionalProperties": False},
        annotations=types.ToolAnnotations(destructive_hint=True),
    ),
    types.Tool(
        name="memory_rename",
        description="Rename or move a memory file or directory within its store. Never overwrites.",
        input_schema={"type": "object", "properties": {
            "old_path": _path("current path, /memories/<store>/..."),
            "new_path": _path("new path in the same store; must not exist"),
        }, "required": ["old_path", "new_path"], "additionalProperties": False},
    ),
    types.Tool(
        name="memory_search",
        description=("Search memory files for literal text (case-insensitive unless case_sensitive), or with "
                     "rank for the files holding every word, best first. Answers grep-style lines "
                     "`path:line: text`, at most 100."),
        input_schema={"type": "object", "properties": {
            "query": {"type": "string", "description": "text to look for"},
            "path": _path("where to search (default /memories: every store)"),
            "case_sensitive": {"type": "boolean", "description": "match case exactly (default false)"},
            "rank": {"type": "boolean", "description": ("rank by relevance: files holding every word of "
                                                        "query (word prefixes), best first (default false)")},
            "max_results": {"type": "integer", "minimum": 1, "maximum": 100,
                            "description": "at most this many lines (default 100)"},
        }, "required": ["query"], "additionalProperties": False},
        annotations=types.ToolAnnotations(read_only_hint=True),
    ),
    types.Tool(
        name="memory_history",
        description=("List the versions of a memory file (time, operation, who, size), newest first; with "
                     "version, show that version's text."),
        input_schema={"type": "object", "properties": {
            "path": _P,
            "version": {"type": "integer", "minimum": 1, "description": "show this version's text"},
        }, "required": ["path"], "additionalProperties": False},
        annotations=types.ToolAnnotations(read_only_hint=True),
    ),
    types.Tool(
        name="memory_remember",
        description=("Remember one fact: append it as one line to notes.md of a store (default: the "
                     "workspace's own store), unless that exact line is already there."),
        input_schema={"type": "object", "properties": {
            "fact": {"type": "string", "description": "the fact, one line"},
            "store": {"type": "string", "description": "store slug (default: the workspace's own store)"},
        }, "required": ["fact"], "additionalProperties": False},
    ),
]
_BY_NAME = {t.name: t for t in TOOLS}


def index_uri(store: str) -> str:
    """The resource URI of a store's ``MEMORY.md``."""
    return f"{RESOURCE_PREFIX}{store}/{INDEX}"


def store_of_uri(uri: str) -> str | None:
    """The store slug of an index resource URI, or None."""
    if not uri.startswith(RESOURCE_PREFIX) or not uri.endswith("/" + INDEX):
        return None
    store = uri[len(RESOURCE_PREFIX):-len(INDEX) - 1]
    return store if store and "/" not in store else None


class _Server(Server[Any]):
    """``Server`` whose ``instructions`` may come from a context variable (per request,
    for the HTTP face serving many workspaces), else the value given at construction."""

    current_instructions: contextvars.ContextVar[str | None] = contextvars.ContextVar(
        "memfuse_mcp_instructions", default=None)

    @property  # over mcp Server's plain attribute, with a setter below
    def instructions(self) -> str | None:
        v = self.current_instructions.get()
        return v if v is not None else self._static_instructions

    @instructions.setter
    def instructions(self, value: str | None) -> None:
        self._static_instructions = value


def build_server(
    backend: Callable[[], ToolBackend],
    *,
    instructions: str | None = None,
    on_subscribe: Callable[[ServerRequestContext[Any], str], Any] | None = None,
    on_unsubscribe: Callable[[ServerRequestContext[Any], str], Any] | None = None,
) -> Server[Any]:
    """The MCP server. ``backend()`` returns the backend for the current request (one for
    stdio; per request for HTTP). ``on_subscribe(ctx, store)`` / ``on_unsubscribe`` enable
    ``resources/subscribe`` (long-lived connections only)."""

    async def list_tools(ctx: ServerRequestContext[Any], params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=TOOLS)

    async def call_tool(ctx: ServerRequestContext[Any], params: types.CallToolRequestParams) -> types.CallToolResult:
        tool = _BY_NAME.get(params.name)
        if tool is None:
            text, err = f"Unknown tool: {params.name}. Tools: {', '.join(_BY_NAME)}", True
        else:
            command = {**(params.arguments or {}), "command": params.name.removeprefix("memory_")}
            try:
                text, err = await backend().call(command)
            except Exception as e:  # noqa: BLE001 - a tool result, never a protocol error with internal text
                log.error("memory tool %s failed (%s)", params.name, type(e).__name__, exc_info=e)
                text, err = ("The memory tool could not run this command (a server error, logged); "
                             "try again later"), True
        return types.CallToolResult(content=[types.TextContent(text=text)], is_error=err)

    async def list_resources(ctx: ServerRequestContext[Any], params: Any) -> types.ListResourcesResult:
        return types.ListResourcesResult(resources=[
            types.Resource(uri=index_uri(s), name=f"{s}/{INDEX}", title=f"Memory index of store {s}",
                           description=f"The index of store {s} (/memories/{s}/{INDEX})",
                           mime_type="text/markdown")
            for s in await backend().stores()
        ])

    async def read_resource(ctx: ServerRequestContext[Any], params: types.ReadResourceRequestParams
                            ) -> types.ReadResourceResult:
        uri = str(params.uri)
        store = store_of_uri(uri)
        try:
            if store is None:
                raise LookupError(uri)
            text = await backend().read_index(store)
        except LookupError:
            raise MCPError(RESOURCE_NOT_FOUND, f"Resource not found: {uri}") from None
        return types.ReadResourceResult(contents=[
            types.TextResourceContents(uri=uri, mime_type="text/markdown", text=text or "")])

    handlers: dict[str, Any] = {}
    if on_subscribe is not None:
        async def subscribe(ctx: ServerRequestContext[Any], params: types.SubscribeRequestParams) -> types.EmptyResult:
            store = store_of_uri(str(params.uri))
            if store is None or store not in await backend().stores():
                raise MCPError(RESOURCE_NOT_FOUND, f"Resource not found: {params.uri}")
            await on_subscribe(ctx, store)
            return types.EmptyResult()

        async def unsubscribe(ctx: ServerRequestContext[Any], params: types.UnsubscribeRequestParams
                              ) -> types.EmptyResult:
            store = store_of_uri(str(params.uri))
            if store is not None and on_unsubscribe is not None:
                await on_unsubscribe(ctx, store)
            return types.EmptyResult()

        handlers = {"on_subscribe_resource": subscribe, "on_unsubscribe_resource": unsubscribe}

    from memfuse.client.base import _package_version

    return _Server(
        SERVER_NAME,
        version=_package_version(),
        title="memfuse memory",
        instructions=instructions,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
        on_list_resources=list_resources,
        on_read_resource=read_resource,
        **handlers,
    )


# ---------------------------------------------------------------- stdio (memfuse mcp)


class HttpBackend:
    """``ToolBackend`` over the control plane's HTTP API with a workspace token
    (``memfuse.client.ApiClient``): what ``memfuse mcp`` on stdio uses. A control plane that
    cannot be reached gives a tool result with ``isError`` (the model may retry), not a
    protocol error."""

    def __init__(self, api: Any, workspace: str) -> None:
        self.api = api
        self.workspace = workspace

    async def call(self, command: dict[str, Any]) -> tuple[str, bool]:
        from memfuse.errors import ApiError

        try:
            r = await self.api.memory_tool(self.workspace, command)
        except ApiError as e:
            log.warning("memory-tool call failed: %s", e)
            return f"memfuse: the memory service did not answer ({e.code or e.status}); try again", True
        return r.content, r.is_error

    async def instructions(self) -> str:
        block: str = await self.api.context(self.workspace, mount_root="/memories", mounted=False)
        return TOOL_INSTRUCTIONS + block

    async def stores(self) -> list[str]:
        return [a.store.slug for a in await self.api.list_attachments(self.workspace)]

    async def read_index(self, store: str) -> str | None:
        from memfuse.errors import NotFound

        try:
            page = await self.api.list_records(store, path=INDEX, content=True, limit=1)
        except NotFound:
            raise LookupError(store) from None
        return page.records[0].content if page.records else None


class IndexWatcher:
    """Pushes ``notifications/resources/updated`` for subscribed ``MEMORY.md`` resources:
    one task per subscribed store long-polls the store's change feed (``wait`` 25 s) and
    notifies when a change touches the index. Tasks run in ``nursery`` (anyio task group);
    an error is logged and the watch retried after a pause."""

    POLL_WAIT = 25.0
    RETRY_PAUSE = 2.0

    def __init__(self, api: Any, task_group: Any) -> None:
        self.api = api
        self.tg = task_group
        self.scopes: dict[str, Any] = {}

    async def subscribe(self, ctx: ServerRequestContext[Any], store: str) -> None:
        import anyio

        if store in self.scopes:
            return
        page = await self.api.list_records(store, limit=1)
        session = ctx.session
        scope = anyio.CancelScope()
        self.scopes[store] = scope

        async def watch(after: int) -> None:
            with scope:
                while True:
                    try:
                        ch = await self.api.changes(store, after, wait=self.POLL_WAIT, content=False)
                    except Exception as e:  # noqa: BLE001 - supervised: logged, retried
                        log.warning("watching %s/%s failed (%s); retrying", store, INDEX, type(e).__name__)
                        await anyio.sleep(self.RETRY_PAUSE)
                        continue
                    after = ch.seq
                    if any(INDEX in (c.record.path, c.old_path) for c in ch.changes):
                        await session.send_resource_updated(index_uri(store))

        self.tg.start_soon(watch, page.seq)

    async def unsubscribe(self, ctx: ServerRequestContext[Any], store: str) -> None:
        scope = self.scopes.pop(store, None)
        if scope is not None:
            scope.cancel()


class InFlight:
    """The requests read from the client and not answered yet (JSON-RPC ids), for the drain
    at end of input (``serve_stdio``). ``read`` sees every message read, ``written`` every
    message written; ``idle`` is set while nothing is in flight."""

    def __init__(self) -> None:
        import anyio

        self.ids: set[Any] = set()
        self.idle = anyio.Event()
        self.idle.set()

    @staticmethod
    def _key(request_id: Any) -> Any:
        # JSON-RPC ids are strings or numbers; 1 and "1" are different requests
        return (type(request_id).__name__, request_id)

    def read(self, item: Any) -> None:
        """A message from the client: a request goes in flight; ``notifications/cancelled``
        takes its request out (the server does not answer a request the client cancelled)."""
        import anyio

        msg = getattr(item, "message", None)
        if isinstance(msg, types.JSONRPCRequest):
            self.ids.add(self._key(msg.id))
            if self.idle.is_set():
                self.idle = anyio.Event()
        elif isinstance(msg, types.JSONRPCNotification) and msg.method == "notifications/cancelled":
            rid = (msg.params or {}).get("requestId")
            if rid is not None:
                self._done(rid)

    def written(self, item: Any) -> None:
        """A message to the client: a response or an error answers its request."""
        msg = getattr(item, "message", None)
        if isinstance(msg, (types.JSONRPCResponse, types.JSONRPCError)) and msg.id is not None:
            self._done(msg.id)

    def _done(self, request_id: Any) -> None:
        self.ids.discard(self._key(request_id))
        if not self.ids:
            self.idle.set()


async def serve_stdio(api: Any, workspace: str, *, drain_timeout: float | None = None) -> None:
    """Serve MCP on this process's stdin/stdout for ``workspace`` through ``api`` (an
    ``ApiClient`` with the workspace token) until stdin closes. Nothing but protocol goes to
    stdout; logs go to stderr. Raises ``memfuse.client.ApiError`` when the control plane
    refuses the token or cannot be reached at start (the instructions are read then).

    End of input is the client's shutdown: the MCP specification (2025-06-18, "Lifecycle",
    "Shutdown", stdio: https://modelcontextprotocol.io/specification/2025-06-18/basic/lifecycle#shutdown)
    has the client close the server's input stream first, then wait for the server to exit
    (SIGTERM, then SIGKILL, only if it does not exit "within a reasonable time"); it defines
    no shutdown message. So at EOF the requests already read are finished and answered —
    a client that writes its requests and closes its end (``printf ... | memfuse mcp``) gets
    every answer, and a tool call whose write reached the store is never reported as lost —
    for up to ``drain_timeout`` seconds (default: the API client's request timeout, as one
    call to the control plane is bounded by it); requests still running then are cancelled
    and answered with the SDK's "Connection closed" error. Then stdout is closed and the
    function returns (``memfuse mcp`` exits 0). Subscriptions end at EOF; no new request is
    read after it."""
    import anyio
    from mcp.server.stdio import stdio_server

    bound = float(drain_timeout if drain_timeout is not None else getattr(api, "timeout", 30.0))
    backend = HttpBackend(api, workspace)
    instructions = await backend.instructions()
    async with anyio.create_task_group() as tg:
        watcher = IndexWatcher(api, tg)
        server = build_server(lambda: backend, instructions=instructions,
                              on_subscribe=watcher.subscribe, on_unsubscribe=watcher.unsubscribe)
        async with stdio_server() as (read, write):
            flight = InFlight()
            # the server reads from and writes to these relays, so that EOF reaches it only
            # once what was read before it is answered (the SDK cancels in-flight handlers at
            # EOF)
            in_send, in_recv = anyio.create_memory_object_stream[Any](0)
            out_send, out_recv = anyio.create_memory_object_stream[Any](0)

            async def pump_in() -> None:
                async with in_send:
                    async with read:
                        async for item in read:
                            flight.read(item)
                            try:
                                await in_send.send(item)
                            except anyio.BrokenResourceError:  # the server stopped reading
                                return
                    if flight.ids:
                        log.info("end of input: finishing %d request(s) in flight (up to %.0f s)",
                                 len(flight.ids), bound)
                        with anyio.move_on_after(bound):
                            while flight.ids:
                                await flight.idle.wait()
                        if flight.ids:
                            log.warning("end of input: %d request(s) still running after %.0f s; "
                                        "cancelled, answered 'Connection closed'",
                                        len(flight.ids), bound)

            async def pump_out() -> None:
                async with out_recv:
                    try:
                        async with write:
                            async for item in out_recv:
                                await write.send(item)
                                flight.written(item)
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                        log.info("stdout is closed: answers from now on are dropped")
                        async for item in out_recv:  # the server must not block on them
                            flight.written(item)

            async with anyio.create_task_group() as io:
                io.start_soon(pump_in)
                io.start_soon(pump_out)
                await server.run(in_recv, out_send, server.create_initialization_options())
        tg.cancel_scope.cancel()
