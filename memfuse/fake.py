"""In-process fake control plane for tests: the reference app on an in-memory SQLite
database, reached through ``httpx.ASGITransport`` (streams, ``stream=true``, through a small streaming
ASGI bridge of its own, which ``httpx.ASGITransport`` is not), with fault injection.

    fake = FakeControlPlane(seed=0)
    token = await fake.setup("ws", stores=("default",))
    async with fake.client(token) as http:          # or httpx.AsyncClient(transport=fake.transport, ...)
        fake.faults.error_rate = 0.2                # 20 % of requests answered 503, not applied
        ...
    assert fake.counters.errors_503 > 0

The transport works under trio and asyncio (it only uses anyio). Faults apply to requests sent
through ``fake.transport``; ``setup()`` and the injected concurrent edits bypass them.
"""
from __future__ import annotations

import json
import logging
import random
import re
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import anyio
import httpx

from memfuse.models import Problem
from memfuse.server.app import create_app
from memfuse.server.gate import replay

if TYPE_CHECKING:  # for the annotations only
    import asyncio

    from starlette.types import Message

    from memfuse.server.service import Service

log = logging.getLogger(__name__)

BASE_URL = "http://memfuse.test"
RACE_MARKER = "\n<!-- memfuse fake: concurrent edit -->\n"
_RECORD_URL = re.compile(r"^/v1/stores/(?P<store>[^/]+)/records/(?P<id>[^/]+)(?:/append)?$")


@dataclass
class Faults:
    """What the fake transport injects; change the fields at any time.

    - ``latency``: seconds added before every request;
    - ``error_rate``: fraction of requests answered 503 without reaching the app;
    - ``rate_429``: fraction answered 429 with ``Retry-After: 0`` without reaching the app;
    - ``drop_rate``: fraction applied by the app whose response is then lost
      (``httpx.ReadError``);
    - ``outage``: every request raises ``httpx.ConnectError`` without reaching the app;
    - ``precondition_race``: the next N PUT/DELETE requests (and appends, ``POST
      .../append``) on a record that carry
      ``If-Match`` first see the record modified by another actor (a real new version whose
      content ends with ``RACE_MARKER``), so they get 412.
    - ``inject``: scripted answers, each ``(method, path regex, status)`` used once by the
      next request whose method and URL path match (``re.search``), answered with that
      status without reaching the app: ``410`` as ``cursor_expired`` (a change feed whose
      cursor the server dropped), ``404`` / ``405`` as an unknown route / method (an older
      server: ``not_found``, ``method_not_allowed``), ``5xx`` / ``429`` as transient failures, others as
      ``injected`` refusals. E.g. ``[("GET", r"/changes$", 410), ("GET", r"/records$", 503)]``.
      An open stream whose request matches gets it as its error line instead of its next line.
    - ``broken_send_over``: a request whose body is larger than this many bytes (0: none)
      raises ``httpx.WriteError`` without reaching the app and without an answer (a proxy
      that resets an upload past its own bound);
    - ``cut_streams``: the next N stream lines (``stream=true``) that carry changes or events
      break their stream right after the line (``httpx.ReadError``, as a connection reset).
    """

    latency: float = 0.0
    error_rate: float = 0.0
    rate_429: float = 0.0
    drop_rate: float = 0.0
    outage: bool = False
    precondition_race: int = 0
    inject: list[tuple[str, str, int]] = field(default_factory=list)
    cut_streams: int = 0
    broken_send_over: int = 0

    def reset(self) -> None:
        """Back to no faults."""
        for f in fields(self):
            setattr(self, f.name, [] if f.name == "inject" else f.default)


@dataclass
class FaultCounters:
    """How many requests saw each fault (counted by the fake transport)."""

    requests: int = 0  # every request sent through the transport
    delayed: int = 0  # requests that got ``latency`` added
    errors_503: int = 0
    rate_limited_429: int = 0
    dropped: int = 0  # applied, response lost
    outage_refused: int = 0
    races: int = 0  # concurrent edits injected before an If-Match request
    streams: int = 0  # streams opened (``stream=true`` answered as NDJSON)
    streams_cut: int = 0  # streams broken by ``cut_streams``
    injected: int = 0  # scripted answers (``Faults.inject``) given
    forwarded: int = 0  # requests that reached the app


class FaultTransport(httpx.AsyncBaseTransport):
    """An ``httpx.AsyncBaseTransport`` that injects ``FakeControlPlane.faults`` in front of an
    ``httpx.ASGITransport`` to the app. Raises ``httpx.ConnectError`` (outage) and
    ``httpx.ReadError`` (dropped response)."""

    def __init__(self, fake: FakeControlPlane) -> None:
        self._fake = fake

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        fake = self._fake
        faults, counters = fake.faults, fake.counters
        counters.requests += 1
        if faults.outage:
            counters.outage_refused += 1
            raise httpx.ConnectError("fake control plane: outage", request=request)
        if faults.broken_send_over and len(request.content) > faults.broken_send_over:
            raise httpx.WriteError("fake control plane: connection reset while sending", request=request)
        if faults.latency > 0:
            counters.delayed += 1
            await anyio.sleep(faults.latency)
        injected = _take_inject(fake, request)
        if injected is not None:
            return injected
        r_error, r_drop = fake._rng.random(), fake._rng.random()
        if r_error < faults.error_rate:
            counters.errors_503 += 1
            return _problem(503, "unavailable", "injected by the fake control plane", request)
        if r_error < faults.error_rate + faults.rate_429:
            counters.rate_limited_429 += 1
            return _problem(429, "rate_limited", "injected by the fake control plane", request, {"Retry-After": "0"})
        if faults.precondition_race > 0 and "if-match" in request.headers and (
                request.method in ("PUT", "DELETE")
                or (request.method == "POST" and request.url.path.endswith("/append"))):
            m = _RECORD_URL.match(request.url.path)
            if m and await fake._concurrent_edit(m["store"], m["id"]):
                faults.precondition_race -= 1
                counters.races += 1
        counters.forwarded += 1
        if request.url.params.get("stream") == "true":
            return await _stream_request(fake, request)
        response = await fake._inner.handle_async_request(request)
        if r_drop < faults.drop_rate:
            await response.aread()
            await response.aclose()
            counters.dropped += 1
            raise httpx.ReadError("fake control plane: connection dropped after the request was applied", request=request)
        return response

    async def aclose(self) -> None:
        await self._fake._inner.aclose()


def _take_inject(fake: FakeControlPlane, request: httpx.Request) -> httpx.Response | None:
    """The scripted answer of ``Faults.inject`` for this request (used once), or None."""
    for i, (method, pattern, status) in enumerate(fake.faults.inject):
        if request.method == method and re.search(pattern, request.url.path):
            del fake.faults.inject[i]
            fake.counters.injected += 1
            code = {410: "cursor_expired", 429: "rate_limited", 404: "not_found",
                    405: "method_not_allowed"}.get(status, "unavailable" if status >= 500 else "injected")
            headers = {"Retry-After": "0"} if status == 429 else None
            return _problem(status, code, "injected by the fake control plane", request, headers)
    return None


async def _stream_request(fake: FakeControlPlane, request: httpx.Request) -> httpx.Response:
    """Serve a request whose answer may be a stream: ``httpx.ASGITransport`` returns only
    after the app has finished its response, which a stream does after minutes. The app runs
    in a task of its own (trio system task / asyncio task) and the response body is fed
    from it line by line; closing the response tells the app the client left."""
    import sniffio

    body = await request.aread()
    left = anyio.Event()
    started = anyio.Event()
    send_ch, recv_ch = anyio.create_memory_object_stream[tuple[bytes, bool]](1000)
    head: dict[str, Any] = {}
    scope: dict[str, Any] = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
        "scheme": "http", "path": request.url.path, "raw_path": request.url.raw_path.split(b"?")[0],
        "query_string": request.url.query, "root_path": "", "server": ("memfuse.test", 80),
        "client": ("127.0.0.1", 1), "headers": [(k.lower(), v) for k, v in request.headers.raw],
    }

    async def gone() -> Message:  # the connection's messages after the body: the client leaving
        await left.wait()
        return {"type": "http.disconnect"}

    receive = replay(body, gone)

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            head.update(message)
            started.set()
        elif message["type"] == "http.response.body":
            try:
                await send_ch.send((message.get("body", b""), message.get("more_body", False)))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass  # the client left: dropped, as an HTTP server drops it

    async def run_app() -> None:
        try:
            await fake.app(scope, receive, send)
        except Exception:
            log.exception("fake: streaming request failed")
        finally:
            started.set()
            send_ch.close()

    if sniffio.current_async_library() == "trio":
        import trio

        trio.lowlevel.spawn_system_task(run_app)
    else:
        import asyncio

        task = asyncio.get_running_loop().create_task(run_app())
        fake._tasks.add(task)
        task.add_done_callback(fake._tasks.discard)
    await started.wait()
    if not head:
        left.set()
        raise httpx.ReadError("fake control plane: no response", request=request)
    ctype = dict(head.get("headers", ())).get(b"content-type", b"")
    if ctype.startswith(b"application/x-ndjson"):
        fake.counters.streams += 1

    class _Body(httpx.AsyncByteStream):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            try:
                async for chunk, more in recv_ch:
                    injected = _take_inject(fake, request)
                    if injected is not None:  # an open stream gets it as its error line
                        yield b'{"error":' + injected.content + b"}\n"
                        return
                    if chunk:
                        yield chunk
                    if fake.faults.cut_streams > 0 and (b'"changes":[{' in chunk or b'"events":[{' in chunk):
                        fake.faults.cut_streams -= 1
                        fake.counters.streams_cut += 1
                        raise httpx.ReadError("fake control plane: stream cut", request=request)
                    if not more:
                        return
            finally:
                left.set()

        async def aclose(self) -> None:
            left.set()
            recv_ch.close()

    return httpx.Response(head["status"], headers=head.get("headers", []), stream=_Body(), request=request)


def _problem(
    status: int, code: str, detail: str, request: httpx.Request, headers: dict[str, str] | None = None
) -> httpx.Response:
    title = {503: "Service Unavailable", 429: "Too Many Requests", 410: "Gone",
             500: "Internal Server Error"}.get(status, "Injected")
    body = Problem(title=title, status=status, detail=detail, code=code).model_dump_json().encode()
    return httpx.Response(
        status,
        headers={"Content-Type": "application/problem+json", **(headers or {})},
        content=body,
        request=request,
    )


class FakeControlPlane:
    """The reference control plane in process, on a fresh in-memory database.

    Attributes: ``app`` (the FastAPI app), ``admin_token`` (a static admin token),
    ``transport`` (``FaultTransport``), ``faults`` (``Faults``), ``counters``
    (``FaultCounters``), ``base_url``. ``seed`` makes the random fault choices repeatable.
    """

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)
        self.admin_token = "fake-admin-" + secrets.token_hex(12)
        self._static_tokens: dict[str, str | None] = {self.admin_token: None}
        self._ws_tokens: dict[str, str] = {}
        self.app = create_app("sqlite://", static_tokens=self._static_tokens)
        self.faults = Faults()
        self.counters = FaultCounters()
        self.base_url = BASE_URL
        self._inner = httpx.ASGITransport(app=self.app)
        self.transport = FaultTransport(self)
        self._tasks: set[asyncio.Task[None]] = set()  # streaming requests' app tasks under asyncio

    @property
    def service(self) -> Service:
        """The app's ``memfuse.server.service.Service`` (for direct inspection in tests)."""
        svc: Service = self.app.state.service
        return svc

    def token_for(self, workspace: str) -> str:
        """A static bearer token for ``workspace`` (the same one on every call). The workspace
        itself is not created: see ``setup``."""
        if workspace not in self._ws_tokens:
            token = f"fake-ws-{workspace}-{secrets.token_hex(12)}"
            self._static_tokens[token] = workspace
            self._ws_tokens[workspace] = token
        return self._ws_tokens[workspace]

    def new_token(self, workspace: str | None) -> str:
        """A further static bearer token for ``workspace`` (``None``: admin), valid at once
        (a rotation hands out a new one before revoking the old)."""
        token = f"fake-ws-{workspace or 'admin'}-{secrets.token_hex(12)}"
        self._static_tokens[token] = workspace
        return token

    def revoke(self, token: str) -> None:
        """Make ``token`` unknown: every later request with it is answered 401."""
        self._static_tokens.pop(token, None)
        for ws, tok in list(self._ws_tokens.items()):
            if tok == token:
                del self._ws_tokens[ws]

    def client(self, token: str | None = None, **kwargs: Any) -> httpx.AsyncClient:
        """An ``httpx.AsyncClient`` through the fault transport, with ``token`` (default: the
        admin token) as bearer."""
        headers = {"Authorization": f"Bearer {token or self.admin_token}", **kwargs.pop("headers", {})}
        return httpx.AsyncClient(transport=self.transport, base_url=self.base_url, headers=headers, **kwargs)

    async def setup(
        self, workspace: str = "ws", stores: tuple[str, ...] | list[str] = ("default",), access: str = "read_write"
    ) -> str:
        """Create ``workspace`` and ``stores`` (when missing), attach each store with
        ``access``, and return a workspace token. Bypasses the faults. Raises
        ``httpx.HTTPStatusError`` on an unexpected refusal."""
        async with self._admin() as http:
            r = await http.post("/v1/workspaces", json={"name": workspace, "default_store": False})
            if r.status_code != 409:
                r.raise_for_status()
            for slug in stores:
                r = await http.post("/v1/stores", json={"slug": slug})
                if r.status_code != 409:
                    r.raise_for_status()
                r = await http.put(f"/v1/workspaces/{workspace}/attachments/{slug}", json={"access": access})
                r.raise_for_status()
        return self.token_for(workspace)

    def _admin(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app),
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {self.admin_token}", "X-Memfuse-Instance": "fake-race"},
        )

    async def _concurrent_edit(self, store: str, record_id: str) -> bool:
        """Write a new version of the record as another actor; False when it cannot (missing,
        deleted)."""
        async with self._admin() as http:
            r = await http.get(f"/v1/stores/{store}/records/{record_id}")
            if r.status_code != 200:
                return False
            rec = r.json()
            if rec.get("deleted") or rec.get("content") is None:
                return False
            r = await http.put(
                f"/v1/stores/{store}/records/{record_id}",
                content=json.dumps({"content": rec["content"] + RACE_MARKER}),
                headers={"Content-Type": "application/json"},
            )
            if r.status_code != 200:
                log.warning("fake: injected concurrent edit refused (%s)", r.status_code)
                return False
            return True

    async def aclose(self) -> None:
        """End open streams, close the transport and the database."""
        self.service.closing = True
        self.service.notifier.wake_all()
        await self._inner.aclose()
        self.service.db.dispose()
