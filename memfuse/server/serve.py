"""Run the control-plane app with hypercorn under trio (``memfuse serve``).

SQLite is one replica: ``claim_database`` takes an exclusive lock next to an SQLite file
(``<file>.serve.lock``, holding the pid) for as long as the server runs, so a second ``memfuse
serve`` on the same file is refused with ``AlreadyServing`` instead of running beside the first
(the replicas' long-polls would not see each other's commits without polling). CLI commands in
local mode may still open the file; their commits are picked up by the server's watcher.
"""
from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

log = logging.getLogger(__name__)

GRACEFUL_TIMEOUT = 5.0  # seconds in-flight requests get after shutdown begins
BACKLOG = 2048  # pending connections the kernel queues (thousands of sidecars reconnect at once)


class AlreadyServing(RuntimeError):
    """Another ``memfuse serve`` holds this SQLite file."""


def claim_database(app) -> None:
    """Take the one-replica lock of an SQLite file database (no-op for PostgreSQL, in-memory
    SQLite, or when ``app`` already holds it). Raises ``AlreadyServing`` naming the other pid
    when another process holds it; ``OSError`` when the lock file cannot be created."""
    db = app.state.service.db
    if not db.is_sqlite or db.is_memory or getattr(app.state, "db_claim", None) is not None:
        return
    path = Path(db.url.database).resolve()
    lock = path.with_name(path.name + ".serve.lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            other = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        finally:
            os.close(fd)
        raise AlreadyServing(
            f"another memfuse serve (pid {other}) is serving {path}; SQLite supports one control-plane "
            "replica: stop it, or run several replicas on PostgreSQL (--db postgresql://...)"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    app.state.db_claim = fd


def release_database(app) -> None:
    """Drop the lock of ``claim_database`` (idempotent)."""
    fd = getattr(getattr(app, "state", None), "db_claim", None)
    if fd is not None:
        app.state.db_claim = None
        os.close(fd)


async def serve(app, listen: str = "127.0.0.1:8080", *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve the ASGI ``app`` on ``listen`` (``HOST:PORT``; port 0 picks a free one) until
    cancelled.

    ``task_status.started(url)`` is called once the socket listens, with the base URL actually
    bound (``"http://127.0.0.1:54321"``). On cancellation the server stops accepting, gives
    requests in flight up to 5 s to finish (long-polls are cut), then returns (re-raising the
    cancellation). Raises ``OSError`` when the address cannot be bound, ``AlreadyServing`` when
    another process serves the same SQLite file (``claim_database``).
    """
    claimed_here = getattr(app.state, "db_claim", None) is None
    claim_database(app)
    try:
        await _serve(app, listen, task_status)
    finally:
        if claimed_here:
            release_database(app)


async def _serve(app, listen: str, task_status) -> None:
    config = Config()
    config.bind = [listen]
    config.backlog = BACKLOG
    config.graceful_timeout = GRACEFUL_TIMEOUT
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    shutdown = trio.Event()
    # Shielded: our cancellation becomes a graceful shutdown (the trigger below), not an
    # abrupt cancel of hypercorn's tasks; its deadline, set at shutdown, bounds the wait.
    inner = trio.CancelScope(shield=True)

    async def run(task_status=trio.TASK_STATUS_IGNORED) -> None:
        with inner:
            await hypercorn_serve(app, config, shutdown_trigger=shutdown.wait, task_status=task_status)

    svc = getattr(getattr(app, "state", None), "service", None)
    if svc is not None:
        svc.bus.start()  # listen for other replicas' commits before the first long-poll
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(run)
        url = binds[0] if binds else f"http://{listen}"
        log.info("control plane listening on %s", url)
        task_status.started(url)
        try:
            await trio.sleep_forever()
        finally:
            log.info("control plane shutting down")
            svc = getattr(getattr(app, "state", None), "service", None)
            if svc is not None:  # answer open long-polls now instead of holding the shutdown
                svc.closing = True
                svc.notifier.wake_all()
            shutdown.set()
            inner.deadline = trio.current_time() + GRACEFUL_TIMEOUT + 2
