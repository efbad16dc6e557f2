"""The embedded dev setup shared by ``memfuse dev`` and the CLI's local mode (README.md, docs/ARCHITECTURE.md).

Everything lives in one data directory, ``platformdirs.user_data_dir("memfuse")`` or
``$MEMFUSE_HOME`` when set: the dev database ``dev.db`` (SQLite) and ``admin.token`` written by
``memfuse serve``. The reference control plane runs in-process on that file: the CLI's local
mode reaches it through ``httpx.ASGITransport``; ``memfuse dev`` serves it on loopback with
hypercorn (``ConsoleServer``) and its sidecar is an HTTP client of it, as in production (so the
change feed streams). Each process gets its own random static tokens (an admin token and a
token for workspace ``dev``), which never leave the process. Several processes (``memfuse dev``
and CLI commands) may use the same database at once; SQLite arbitrates.
"""
from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import platformdirs

from .client import ApiClient
from .errors import Conflict
from .defs import Access

__all__ = [
    "DEV_WORKSPACE",
    "DEV_STORE",
    "DEV_STORE_DESCRIPTION",
    "LOCAL_BASE_URL",
    "DevApp",
    "data_dir",
    "dev_db_path",
    "dev_db_url",
    "dev_cache_dir",
    "dev_app",
    "local_client",
    "dev_workspace_client",
    "ensure_dev_setup",
    "ConsoleServer",
    "DEV_CONSOLE_LISTEN",
]

DEV_WORKSPACE = "dev"
DEV_STORE = "default"
DEV_STORE_DESCRIPTION = "default memory store"
LOCAL_BASE_URL = "http://memfuse.local"
HOME_ENV = "MEMFUSE_HOME"


def data_dir(create: bool = True) -> Path:
    """The memfuse data directory: ``$MEMFUSE_HOME`` if set, else
    ``platformdirs.user_data_dir("memfuse")``. Created (mode 0700) when ``create``; then the
    default directory, when it exists with group or other permission bits (made by an older
    release) and this user owns it, is made owner-only (``privfile.tighten``, logged). A
    ``$MEMFUSE_HOME`` directory keeps its mode (it is the user's choice, and may be shared);
    the database files in it are made owner-only when opened (``prepare_sqlite_file``)."""
    home = os.environ.get(HOME_ENV)
    path = Path(home).expanduser() if home else Path(platformdirs.user_data_dir("memfuse"))
    if create:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not home:
            from .privfile import tighten_logged

            tighten_logged([path], "memfuse data directory")
    return path


def dev_db_path() -> Path:
    """Path of the dev database, ``<data dir>/dev.db``."""
    return data_dir() / "dev.db"


def dev_db_url() -> str:
    """SQLAlchemy URL of the dev database, ``sqlite:///<absolute path>/dev.db``."""
    return f"sqlite:///{dev_db_path().resolve()}"


def dev_cache_dir() -> Path:
    """Sidecar cache directory for ``memfuse dev``: ``platformdirs.user_cache_dir("memfuse")/dev``,
    or ``$MEMFUSE_HOME/cache/dev`` when ``MEMFUSE_HOME`` is set (so one variable relocates
    everything, and a cache never outlives the database it mirrors). Not created here."""
    home = os.environ.get(HOME_ENV)
    if home:
        return Path(home).expanduser() / "cache" / "dev"
    return Path(platformdirs.user_cache_dir("memfuse")) / "dev"


@dataclass
class DevApp:
    """The reference control plane on a database, in this process.

    Attributes:
        app: the ASGI (FastAPI) application.
        admin_token: random static admin token, valid only for this ``app``.
        workspace_token: random static token scoped to workspace ``dev``.
        db_url: the database URL the app runs on.
    """

    app: Any
    admin_token: str
    workspace_token: str
    db_url: str
    workspace: str = DEV_WORKSPACE
    _transport: Any = field(default=None, repr=False)

    def transport(self) -> Any:
        """An ``httpx.ASGITransport`` to :attr:`app` (shared by the clients of this DevApp)."""
        import httpx

        if self._transport is None:
            self._transport = httpx.ASGITransport(app=self.app)
        return self._transport

    def admin_client(self, *, timeout: float = 30.0) -> ApiClient:
        """A new admin :class:`ApiClient` on :attr:`app`; close it when done."""
        return ApiClient(LOCAL_BASE_URL, self.admin_token, transport=self.transport(), timeout=timeout)

    def workspace_client(self, *, instance: str | None = "dev", timeout: float = 30.0) -> ApiClient:
        """A new :class:`ApiClient` scoped to workspace ``dev`` on :attr:`app` (what the sidecar
        uses in dev mode); ``instance`` is sent as ``X-Memfuse-Instance``."""
        return ApiClient(
            LOCAL_BASE_URL,
            self.workspace_token,
            transport=self.transport(),
            instance=instance,
            timeout=timeout,
        )


def dev_app(db_url: str | None = None, *, faces: bool = True, admin_token: str | None = None,
            streams: bool = False) -> DevApp:
    """Create the reference app on ``db_url`` (default: the dev database) with fresh random
    static tokens: one admin, one for workspace ``dev``. Each call makes a new app (own
    engine); make one per event loop (``trio.run``). ``faces=False`` leaves out the console
    and the agent-tool faces (``create_app``), as the CLI's local mode does. ``admin_token``:
    that admin token instead of a random one (``local_client``'s).

    ``streams``: serve the streamed change feed and events (``create_app``). Only for an app
    served over HTTP (``memfuse dev`` serves it on loopback with ``ConsoleServer``); a client
    through ``httpx.ASGITransport`` (``transport()``, the CLI's local mode) gets a response only
    once the app has finished it, so a stream would deliver its lines when it ends (~10 min
    later): there the default, False, answers as a server without streams (clients long-poll)."""
    from .server.app import create_app

    url = db_url or dev_db_url()
    admin = admin_token or "mfa_" + secrets.token_urlsafe(32)
    ws = "mfw_" + secrets.token_urlsafe(32)
    # The dev database upgrades itself to the newest schema revision (memfuse serve refuses).
    app = create_app(url, static_tokens={admin: None, ws: DEV_WORKSPACE}, schema="migrate",
                     faces=faces, streams=streams)
    return DevApp(app=app, admin_token=admin, workspace_token=ws, db_url=url)


def local_client(db_url: str | None = None, *, timeout: float = 30.0, faces: bool = False) -> ApiClient:
    """An admin :class:`ApiClient` to the reference control plane in this process on the dev
    database (base URL ``http://memfuse.local``, a random static admin token): the CLI's
    local mode. Its transport (``memfuse.server.local.LocalTransport``) answers the plain
    record reads from the service layer and builds the full app (a :func:`dev_app` with the
    same token) only for a request it does not serve, so ``memfuse history`` and friends do
    not import FastAPI. ``faces=True`` gives that app the agent-tool routes (``memfuse mcp``
    calls the memory-tool endpoint)."""
    from .server.local import LocalTransport

    url = db_url or dev_db_url()
    admin = "mfa_" + secrets.token_urlsafe(32)
    tokens: dict[str, str | None] = {admin: None}
    transport = LocalTransport(url, tokens, lambda: dev_app(url, faces=faces, admin_token=admin).app)
    return ApiClient(LOCAL_BASE_URL, admin, transport=transport, timeout=timeout)


def dev_workspace_client(db_url: str | None = None, *, instance: str | None = "dev") -> ApiClient:
    """A workspace-``dev``-scoped :class:`ApiClient` to a new :func:`dev_app` (the sidecar's
    client in dev mode). Prefer :meth:`DevApp.workspace_client` to share one app."""
    return dev_app(db_url).workspace_client(instance=instance)


async def ensure_dev_setup(client: ApiClient) -> None:
    """Idempotently make workspace ``dev``, store ``default`` ("default memory store") and
    attach it ``read_write``. An existing attachment is left as it is (an access the user
    changed on purpose is kept). ``client`` must be an admin client. Raises ApiError."""
    try:
        # no same-named store: dev's store is `default` (DESIGN of `memfuse dev`)
        await client.create_workspace(DEV_WORKSPACE, default_store=False)
    except Conflict:
        pass
    try:
        await client.create_store(DEV_STORE, description=DEV_STORE_DESCRIPTION)
    except Conflict:
        pass
    attached = {a.store.slug for a in await client.list_attachments(DEV_WORKSPACE)}
    if DEV_STORE not in attached:
        await client.attach(DEV_WORKSPACE, DEV_STORE, Access.read_write)


def agent_tools_hint(memfuse_exe: str, console_base: str | None) -> str:
    """What ``memfuse dev`` prints for agents without a mount (desktop apps, SDK tool
    runners): the stdio command line of ``memfuse mcp`` on the dev database (``memfuse_exe``
    made absolute, since a desktop app starts it from another directory), and the ``/mcp`` URL
    that ``memfuse dev``'s own HTTP server answers at ``console_base`` (``http://HOST:PORT``;
    None when the console is off). With ``$MEMFUSE_HOME`` set, the stdio config carries it
    (``"env": {"MEMFUSE_HOME": <absolute path>}``): the desktop app starts ``memfuse mcp``
    without this shell's environment, which would open another dev database."""
    import json
    import os

    exe = os.path.abspath(memfuse_exe)
    stdio: dict[str, Any] = {"command": exe, "args": ["mcp", "--workspace", DEV_WORKSPACE]}
    home = os.environ.get(HOME_ENV)
    if home:
        stdio["env"] = {HOME_ENV: os.path.abspath(os.path.expanduser(home))}
    lines = [
        "memfuse dev: agents without a mount can use the same memory (docs/AGENT-TOOLS.md):",
        f"  MCP on stdio (desktop app config): {json.dumps({'mcpServers': {'memfuse': stdio}})}",
    ]
    if console_base:
        lines.append(f"  MCP over HTTP while this runs: {console_base}/mcp with a bearer token from "
                     f"`{exe} token create --workspace {DEV_WORKSPACE}`")
    return "\n".join(lines)


DEV_CONSOLE_LISTEN = "127.0.0.1:8765"
CONSOLE_START_TIMEOUT = 15.0  # seconds to bind and start serving
CONSOLE_STOP_TIMEOUT = 15.0  # seconds to finish in-flight requests and stop


class ConsoleServer:
    """The control-plane app (API and the console under ``/ui/``) served over HTTP by
    hypercorn in a thread of its own (own trio loop), beside ``memfuse dev``'s mount, whose
    sidecar reaches the API through it.

    ``start()`` binds ``listen`` (``HOST:PORT``); when the port is taken and ``fallback``,
    a free port on the same host instead. Returns the base URL. Raises ``OSError`` when
    nothing could be bound, ``TimeoutError`` when the server did not start in
    ``CONSOLE_START_TIMEOUT`` s. ``stop()`` shuts it down gracefully (bounded) and joins the
    thread; idempotent."""

    def __init__(self, app: Any, listen: str = DEV_CONSOLE_LISTEN, *, fallback: bool = True) -> None:
        self.app, self.listen, self.fallback = app, listen, fallback
        self.url: str | None = None
        self._thread: Any = None
        self._token: Any = None
        self._cancel: Any = None

    def start(self) -> str:
        import errno

        listen = self._address()
        try:
            return self._start_at(listen)
        except OSError as e:
            # the port was free when _address looked and taken before the bind (another
            # process started at the same moment: two `memfuse dev` at once)
            if e.errno != errno.EADDRINUSE or not self.fallback or listen.endswith(":0"):
                raise
            return self._start_at(listen.rpartition(":")[0] + ":0")

    def _start_at(self, listen: str) -> str:
        """Serve on ``listen`` (``HOST:PORT``) in the console thread; the base URL. Raises
        what the bind raised (``OSError``), ``TimeoutError`` (not started in time)."""
        import threading

        import trio

        from .server.serve import serve

        ready = threading.Event()
        outcome: dict[str, Any] = {}

        async def main() -> None:
            self._token = trio.lowlevel.current_trio_token()
            with trio.CancelScope() as scope:
                self._cancel = scope
                try:
                    async with trio.open_nursery() as nursery:
                        outcome["url"] = await nursery.start(serve, self.app, listen)
                        ready.set()
                except Exception as exc:  # reported to start(), which raises it
                    outcome.setdefault("error", exc)
                    ready.set()

        def run() -> None:
            try:
                trio.run(main)
            except BaseException as exc:  # noqa: BLE001 - reported through outcome
                outcome.setdefault("error", exc)
                ready.set()

        self._thread = threading.Thread(target=run, name="memfuse-console", daemon=True)
        self._thread.start()
        if not ready.wait(CONSOLE_START_TIMEOUT):
            raise TimeoutError(f"the console did not start within {CONSOLE_START_TIMEOUT} s")
        if "url" not in outcome:
            error = outcome.get("error")
            while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
                error = error.exceptions[0]
            raise error if isinstance(error, Exception) else OSError(f"cannot serve on {listen}")
        self.url = str(outcome["url"]).replace("http://0.0.0.0", "http://127.0.0.1")
        return self.url

    def _address(self) -> str:
        """``listen``, or ``HOST:0`` (a free port) when its port is taken and ``fallback``."""
        import socket

        host, _, port = self.listen.rpartition(":")
        try:
            with socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((host.strip("[]"), int(port)))
        except OSError:
            if not self.fallback:
                raise
            return f"{host}:0"
        return self.listen

    def stop(self) -> None:
        """Shut the server down (requests in flight get a few seconds) and join the thread."""
        if self._thread is None:
            return
        if self._token is not None and self._cancel is not None:
            try:
                self._token.run_sync_soon(self._cancel.cancel)
            except Exception:  # noqa: BLE001 - the loop already ended (trio.RunFinishedError)
                pass
        self._thread.join(CONSOLE_STOP_TIMEOUT)
        self._thread = None
