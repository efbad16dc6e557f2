"""A read request's budget: its database work ends when its client has gone or its time is up
(docs/API.md, "Request slots"; attack 15 F3: searches of departed clients held the control
plane for minutes).

The front door (``memfuse.server.gate.Gate._run_read``) makes a ``Budget`` per ordinary ``GET``
under ``/v1/``, sets it in ``CURRENT`` (a context variable: the app's worker thread sees it,
anyio copies the context into it) and ends it (``Budget.end``) when the client disconnects
(``GONE``) or the read budget's seconds have passed (``DEADLINE``). Ending it interrupts the
statement running on every database connection the request holds (``attach``: SQLite's
``sqlite3.Connection.interrupt``, PostgreSQL's cancel request, ``psycopg.Connection.cancel``),
and every later ``check`` raises, so the request stops at its next statement or its next
``check`` (the search loops call it per hit). ``memfuse.server.db.Database.read_conn``
attaches its connection and turns an interrupted statement into that same error.

The error: ``ServiceError`` 504 ``timeout`` (the answer a client still there gets; a client
gone gets none). Thread-safe: ``end`` runs on the event loop (a PostgreSQL cancel, a round
trip, is sent from a thread of its own), ``attach`` / ``detach`` /
``check`` on the request's worker thread.
"""
from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memfuse.server.base import ServiceError

log = logging.getLogger(__name__)

GONE = "client_gone"
DEADLINE = "timeout"


class Budget:
    """One read request's budget (module docstring): ``reason`` is None while it runs, else
    ``GONE`` or ``DEADLINE``."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self._lock = threading.Lock()
        # GUARDED_BY _lock: the DB-API connections the request holds now (interrupted by ``end``)
        self._conns: list[Any] = []

    def end(self, reason: str) -> None:
        """End the budget for ``reason`` (``GONE`` / ``DEADLINE``): interrupt the statements
        of the connections attached now; later ``check`` calls raise. Once only."""
        with self._lock:
            if self.reason is not None:
                return
            self.reason = reason
            remote = []
            for c in self._conns:  # under the lock: a connection detached is never interrupted
                if isinstance(c, sqlite3.Connection):
                    _interrupt(c)  # sets a flag: never waits
                else:
                    remote.append(c)
        for c in remote:  # a cancel request is a round trip: on a thread, not the caller's loop
            threading.Thread(target=self._cancel, args=(c,), name="memfuse-cancel", daemon=True).start()

    def _cancel(self, dbapi_conn: Any) -> None:
        with self._lock:  # still the request's: a connection back in the pool is left alone
            if any(c is dbapi_conn for c in self._conns):
                _interrupt(dbapi_conn)

    def check(self) -> None:
        """Raise ``ServiceError`` 504 ``timeout`` once the budget has ended."""
        if self.reason is not None:
            raise self.error()

    def error(self) -> ServiceError:
        """The error of an ended budget (504 ``timeout``)."""
        from memfuse.server.base import ServiceError  # base imports db, which imports this
        detail = ("the client disconnected" if self.reason == GONE
                  else "the request took longer than the server allows a read; retry or ask for less")
        return ServiceError(504, "timeout", detail)

    @contextmanager
    def attached(self, dbapi_conn: Any) -> Iterator[None]:
        """Within the block, ``end`` interrupts ``dbapi_conn``'s running statement; raises
        ``ServiceError`` at once when the budget has ended."""
        with self._lock:
            self.check()
            self._conns.append(dbapi_conn)
        try:
            yield
        finally:
            with self._lock:
                self._conns.remove(dbapi_conn)


def _interrupt(dbapi_conn: Any) -> None:
    """Interrupt the statement running on a DB-API connection (sqlite3: ``interrupt()``;
    psycopg: ``cancel()``, a cancel request to the server), if any."""
    try:
        fn = getattr(dbapi_conn, "interrupt", None) or getattr(dbapi_conn, "cancel", None)
        if fn is not None:
            fn()
    except Exception:  # noqa: BLE001 - a connection closing meanwhile: nothing to interrupt
        log.debug("could not interrupt a statement", exc_info=True)


CURRENT: ContextVar[Budget | None] = ContextVar("memfuse_budget", default=None)


def check() -> None:
    """``Budget.check`` of the current request's budget (none outside a read: no-op)."""
    b = CURRENT.get()
    if b is not None and b.reason is not None:
        raise b.error()
