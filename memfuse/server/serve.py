"""Run the control-plane app with hypercorn under trio (``memfuse serve``)."""
from __future__ import annotations

import logging

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

log = logging.getLogger(__name__)

GRACEFUL_TIMEOUT = 5.0  # seconds in-flight requests get after shutdown begins


async def serve(app, listen: str = "127.0.0.1:8080", *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve the ASGI ``app`` on ``listen`` (``HOST:PORT``; port 0 picks a free one) until
    cancelled.

    ``task_status.started(url)`` is called once the socket listens, with the base URL actually
    bound (``"http://127.0.0.1:54321"``). On cancellation the server stops accepting, gives
    requests in flight up to 5 s to finish (long-polls are cut), then returns (re-raising the
    cancellation). Raises ``OSError`` when the address cannot be bound.
    """
    config = Config()
    config.bind = [listen]
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
                svc.notifier.notify()
            shutdown.set()
            inner.deadline = trio.current_time() + GRACEFUL_TIMEOUT + 2
