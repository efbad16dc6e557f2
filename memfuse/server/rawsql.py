"""The hot statements of the record writes, run on the DB-API cursor (bench/README.md, "The
close path, session 10: serve").

SQLAlchemy Core costs ~20-30 µs of CPU per statement beyond the driver's own ~3-5 µs
(cache key, parameter construction, execution context, result object, event dispatch), and
a create runs nine of them. ``Raw`` keeps a Core statement as the one definition of its SQL
and runs it on the connection's DB-API cursor from the text SQLAlchemy compiled for the
connection's dialect, once per dialect (SQLite and PostgreSQL alike), with SQLAlchemy's own
bind and result processors of the columns' types (so a ``UTCDateTime`` is stored and read
back exactly as through Core), scalar column defaults of an ``INSERT`` filled in as Core
fills them, the engine's ``before_cursor_execute`` listeners called as Core calls them (the
``/metrics`` statement counter), and a driver error raised as SQLAlchemy's exception class
for it (``IntegrityError`` for a unique or foreign-key conflict: ``Writer.write`` retries on
it). Rows come back as ``RawRow``: attribute access, ``_mapping``, indexing.

What it does not do (and refuses at its first compile with ``TypeError``, so a statement
that needs it is found by the first test that runs it): expanding ``IN`` parameters (use
``RawIn``), column defaults that are Python callables or SQL expressions, and
``executemany``. A disconnect seen here is not reported to the pool (PostgreSQL's pool
pings a connection before each checkout, ``db._make_engine``).
"""
from __future__ import annotations

import sqlite3
import threading
from operator import itemgetter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sqlalchemy import exc
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.event.attr import _EmptyListener, _empty_collection, _JoinedListener, _ListenerCollection
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import ClauseElement

__all__ = ["Raw", "RawIn", "RawRow", "SharedCursorConnection", "statement_listeners"]

# the listener collections last seen (``statement_listeners``) and the sequences that hold
# their listeners, in SQLAlchemy's order; one tuple, replaced whole (threads read it without
# a lock)
_LAST: tuple[tuple[Any, ...], tuple[Any, ...]] = ((), ())


def statement_listeners(conn: Connection) -> tuple[Any, ...]:
    """The sequences that hold the ``before_cursor_execute`` listeners of ``conn``, in the
    order SQLAlchemy's own iteration of ``conn.dispatch.before_cursor_execute`` calls them:
    iterate each sequence in turn. The sequences are SQLAlchemy's own deques (of the
    Connection class, the connection, the Engine class, the engine, and of an engine made by
    ``execution_options`` and its class), so a listener added or removed later
    (``event.listen`` / ``event.remove``) is seen at the next iteration: their contents are
    never cached. What is kept is which deques to read, for the last chain of collections
    seen: the chain is walked per call (attribute reads, no Python call), and a collection
    SQLAlchemy replaces (its first instance-level listener turns an ``_EmptyListener`` into a
    ``_ListenerCollection``) is another object, so the chain no longer matches. A collection
    of another shape (another SQLAlchemy) falls back to SQLAlchemy's iteration:
    ``(conn.dispatch.before_cursor_execute,)``. SQLAlchemy's own iteration
    (``_JoinedListener`` / ``_CompoundListener.__iter__``, ``chain``s, a property) costs ~10
    Python calls per statement (bench/README.md, "The close path, session 14: serve")."""
    global _LAST
    joined = coll = conn.dispatch.before_cursor_execute
    chain: list[Any] = []
    while type(coll) is _JoinedListener:  # its own collection first, then its parent's
        chain.append(coll.local)
        coll = coll.parent_dispatch.before_cursor_execute
    chain.append(coll)
    key = tuple(chain)
    last = _LAST
    if last[0] == key:  # the same objects (these collections compare by identity)
        return last[1]
    parts: list[Any] = []
    for c in key:
        if type(c) is _EmptyListener:
            parts.append(c.parent_listeners)
        elif type(c) is _ListenerCollection:
            parts += (c.parent_listeners, c.listeners)
        else:
            return (joined,)
    # SQLAlchemy's ``_empty_collection`` (the class-level collection of a class that refuses
    # class-level listeners, ``_sa_propagate_class_events = False``: an ``OptionEngine``'s)
    # never holds a listener (its ``append`` does nothing) and costs a Python ``__iter__``
    # call per statement: left out
    _LAST = (key, tuple(c for c in parts if type(c) is not _empty_collection))
    return _LAST[1]


class SharedCursorConnection(sqlite3.Connection):
    """The ``sqlite3`` connection class of ``memfuse.server.db``'s SQLite file engines (the
    driver's ``factory``): ``raw_cursor`` is the one cursor every ``Raw`` statement on it runs
    on while set, instead of a cursor made and closed per statement (~2.5 k instructions of
    each; bench/README.md, "The close path, session 20: serve's writer"). ``Database.write_conn``
    sets it for its transactions on the kept connection and closes it before the transaction
    ends (which resets a statement left unfinished, e.g. by ``first`` of a result of several
    rows), so no statement stays open past the transaction. None (the default): a cursor per
    statement, as on any other connection."""

    raw_cursor: sqlite3.Cursor | None = None
    #: while ``raw_cursor`` is set: the ``before_cursor_execute`` listener sequences
    #: (``statement_listeners``) as they were at the transaction's first statement, which its
    #: ``Raw`` statements read instead of walking SQLAlchemy's dispatch chain again (~5.6 k
    #: instructions a statement): a listener added or removed while a write transaction runs
    #: is seen from the next transaction on (the deques are still read live: one added to a
    #: collection that existed is called at once)
    raw_listeners: tuple[Any, ...] = ()


class RawRow(tuple[Any, ...]):
    """One result row: a tuple with its columns by name as attributes (``row.slug``) and
    ``_mapping`` (a dict of name to value), as a Core ``Row`` offers them. The class of a
    statement's rows is made once per compiled statement (``_row_class``)."""

    __slots__ = ()
    _keys: tuple[str, ...] = ()

    @property
    def _mapping(self) -> dict[str, Any]:
        return dict(zip(self._keys, self, strict=True))

    def _asdict(self) -> dict[str, Any]:
        return self._mapping

    def __getattr__(self, name: str) -> Any:
        # only for a name that is not a column (the columns are properties): as a Core
        # ``Row``, AttributeError (``getattr(row, name, default)`` works); typed Any for mypy
        raise AttributeError(name)


def _row_class(keys: Sequence[str]) -> type[RawRow]:
    ns: dict[str, Any] = {"__slots__": (), "_keys": tuple(keys)}
    for i, k in enumerate(keys):
        ns[k] = property(itemgetter(i))
    return type("RawRow", (RawRow,), ns)


class _Compiled:
    """A statement compiled for one dialect: its SQL text, how to build the driver's
    parameters from a dict, and how to make rows from the cursor's tuples."""

    __slots__ = ("sql", "names", "binds", "fixed", "positional", "row", "results", "getter", "single", "procs")

    def __init__(self, stmt: ClauseElement, dialect: Dialect, keys: Sequence[str]) -> None:
        c = stmt.compile(dialect=dialect, column_keys=list(keys))
        assert isinstance(c, SQLCompiler)
        if c.literal_execute_params or c.post_compile_params:
            raise TypeError(f"Raw cannot run a statement with expanding parameters: {c.string!r}")
        self.fixed: dict[str, Any] = {}
        defaults = [(col, col.default) for col in c.insert_prefetch]
        defaults += [(col, col.onupdate) for col in c.update_prefetch]
        for col, d in defaults:
            if d is None or not d.is_scalar:
                raise TypeError(f"Raw cannot fill the default of column {col.key!r}: not a constant")
            self.fixed[col.key] = d.arg  # type: ignore[attr-defined]
        # values bound in the statement itself (LIMIT 1, ...); a required parameter the caller
        # does not give stays missing (ArgumentError at execution, as Core refuses it)
        required = {name for bp, name in c.bind_names.items() if bp.required}
        for name, value in c.construct_params(_check=False, escape_names=False).items():
            if name not in keys and name not in self.fixed and name not in required:
                self.fixed[name] = value
        self.sql: str = c.string
        self.positional: bool = bool(c.positional)
        names = list(c.positiontup or ()) if self.positional else list(c.construct_params(_check=False, escape_names=False))
        procs: Mapping[str, Any] = c._bind_processors  # noqa: SLF001 - SQLAlchemy's own processors of the bind types
        # the driver's name of each bind (PostgreSQL: escaped, e.g. a name with a dot)
        escaped: Mapping[str, str] = c.escaped_bind_names or {}
        self.names: list[tuple[str, str]] = [(n, escaped.get(n, n)) for n in names]
        self.binds: list[tuple[str, str, Callable[[Any], Any] | None]] = [
            (n, e, procs.get(n)) for n, e in self.names]
        # positional (SQLite): the values in order by one C call, then the few with a bind
        # processor (a time, a boolean) replaced (~3 us less per statement than a generator)
        self.getter: Callable[[Mapping[str, Any]], Any] | None = itemgetter(*names) if names else None
        self.single = len(names) == 1
        self.procs: list[tuple[int, str, Callable[[Any], Any]]] = [
            (i, n, p) for i, (n, _, p) in enumerate(self.binds) if p is not None]
        cols = c._result_columns  # noqa: SLF001 - (key, name, objects, type) per result column
        self.row: type[RawRow] | None = _row_class([col[0] for col in cols]) if cols else None
        self.results: list[tuple[int, Callable[[Any], Any]]] = []
        for i, entry in enumerate(cols):
            proc = entry[3]._cached_result_processor(dialect, None)  # noqa: SLF001
            if proc is not None:
                self.results.append((i, proc))

    def parameters(self, params: Mapping[str, Any]) -> tuple[Any, ...] | dict[str, Any]:
        values = {**self.fixed, **params} if self.fixed else params
        try:
            if self.positional:
                if self.getter is None:
                    return ()
                got = self.getter(values)
                if self.single:
                    got = (got,)
                if not self.procs:
                    return tuple(got)
                out = list(got)
                for i, n, p in self.procs:
                    out[i] = p(values[n])
                return tuple(out)
            return {e: (values[n] if p is None else p(values[n])) for n, e, p in self.binds}
        except KeyError as err:
            raise exc.ArgumentError(f"no value for bind parameter {err.args[0]!r} of {self.sql!r}") from None

    def make_row(self, t: Sequence[Any]) -> RawRow:
        assert self.row is not None
        if self.results:
            values = list(t)
            for i, proc in self.results:
                values[i] = proc(values[i])
            return self.row(values)
        return self.row(t)


class Raw:
    """``Raw(stmt)``: the Core statement ``stmt`` run on the DB-API cursor of a Core
    ``Connection`` (see the module docstring). ``first`` / ``all`` / ``scalar`` / ``run``
    take the connection and a dict of the statement's bind parameters (for an ``INSERT`` /
    ``UPDATE`` without ``values``: the columns to set, as Core's ``execute`` takes them).
    Compiled SQL is cached per dialect and set of parameter names; the cache is shared by
    threads (a lost race compiles twice, harmlessly)."""

    def __init__(self, stmt: ClauseElement) -> None:
        self.stmt = stmt
        self._cache: dict[tuple[str, frozenset[str]], _Compiled] = {}
        self._lock = threading.Lock()
        # the last statement compiled or found: (dialect, its parameter names, it), replaced
        # whole (threads read it without the lock); a statement runs with the same names
        # nearly always, found by one comparison of the names (no frozenset built and hashed)
        self._last: tuple[Dialect, frozenset[str], _Compiled] | None = None

    def _compiled(self, dialect: Dialect, params: Mapping[str, Any]) -> _Compiled:
        last = self._last
        if last is not None and last[0] is dialect and params.keys() == last[1]:
            return last[2]
        names = frozenset(params)
        key = (dialect.name, names)
        c = self._cache.get(key)
        if c is None:
            c = _Compiled(self.stmt, dialect, list(params))
            with self._lock:
                self._cache[key] = c
        self._last = (dialect, names, c)
        return c

    def _execute(self, conn: Connection, params: Mapping[str, Any]) -> tuple[Any, _Compiled, bool]:
        """Run the statement; (the cursor holding its result, the compiled statement, whether
        the cursor is this statement's own: the caller closes it then, else it is the
        connection's ``raw_cursor``, left open)."""
        dialect = conn.dialect
        last = self._last  # ``_compiled``'s first test, without its call
        if last is not None and last[0] is dialect and params.keys() == last[1]:
            c = last[2]
        else:
            c = self._compiled(dialect, params)
        args = c.parameters(params)
        # the DB-API connection itself: ``driver_connection`` is the same object for our sync
        # drivers (sqlite3, psycopg), two property calls further
        # (``Connection.connection`` returns ``_dbapi_connection`` when it is set; when not,
        # the property revalidates or raises)
        fairy = conn._dbapi_connection  # noqa: SLF001
        if fairy is None:
            fairy = conn.connection
        dbapi: Any = fairy.dbapi_connection
        cursor: Any = dbapi.raw_cursor if type(dbapi) is SharedCursorConnection else None
        own = cursor is None
        if own:
            cursor = dbapi.cursor()
            sequences = statement_listeners(conn)
        else:  # in a write_conn transaction: its listeners (``SharedCursorConnection``)
            sequences = dbapi.raw_listeners
        for listeners in sequences:  # the /metrics statement counter, tests' spies
            for fn in listeners:
                fn(conn, cursor, c.sql, args, None, False)
        try:
            cursor.execute(c.sql, args)
        except dialect.loaded_dbapi.Error as e:
            if own:
                cursor.close()
            raise exc.DBAPIError.instance(c.sql, args, e, dialect.loaded_dbapi.Error,
                                          dialect=dialect) from e
        return cursor, c, own

    def run(self, conn: Connection, params: Mapping[str, Any]) -> None:
        """Execute, no result."""
        cursor, _, own = self._execute(conn, params)
        if own:
            cursor.close()

    def first(self, conn: Connection, params: Mapping[str, Any]) -> RawRow | None:
        """The first row, or None."""
        cursor, c, own = self._execute(conn, params)
        try:
            t = cursor.fetchone()
        finally:
            if own:
                cursor.close()
        return None if t is None else c.make_row(t)

    def all(self, conn: Connection, params: Mapping[str, Any]) -> list[RawRow]:
        """Every row."""
        cursor, c, own = self._execute(conn, params)
        try:
            rows = cursor.fetchall()
        finally:
            if own:
                cursor.close()
        return [c.make_row(t) for t in rows]

    def inserted_rowid(self, conn: Connection, params: Mapping[str, Any]) -> int:
        """Execute an ``INSERT`` of one row on SQLite; the rowid it gave (the driver's
        ``lastrowid``: for a table whose ``INTEGER PRIMARY KEY`` is its rowid, that key),
        what ``RETURNING`` of the key would give without SQLite's ephemeral table of a
        ``RETURNING`` (~30 k instructions; bench/README.md, "The close path, session 20").
        SQLite only (``TypeError`` elsewhere)."""
        if conn.dialect.name != "sqlite":
            raise TypeError("inserted_rowid: SQLite only")
        cursor, _, own = self._execute(conn, params)
        rowid: int = cursor.lastrowid
        if own:
            cursor.close()
        return rowid

    def scalar(self, conn: Connection, params: Mapping[str, Any]) -> Any:
        """The first column of the first row, or None."""
        row = self.first(conn, params)
        return None if row is None else row[0]


class RawIn:
    """``Raw`` for a statement with one ``IN`` list of any length: ``build(n)`` makes the
    Core statement for ``n`` values, its list bound as ``<name>0`` .. ``<name>{n-1}``
    (``bindparam(f"{name}{i}")``); ``first`` / ``all`` take the list under ``name``. One
    ``Raw`` per length, made on first use."""

    def __init__(self, name: str, build: Callable[[int], ClauseElement]) -> None:
        self.name = name
        self.build = build
        self._by_len: dict[int, Raw] = {}

    def _raw(self, params: Mapping[str, Any]) -> tuple[Raw, dict[str, Any]]:
        values = list(params[self.name])
        raw = self._by_len.get(len(values))
        if raw is None:
            raw = self._by_len.setdefault(len(values), Raw(self.build(len(values))))
        flat = {k: v for k, v in params.items() if k != self.name}
        flat.update({f"{self.name}{i}": v for i, v in enumerate(values)})
        return raw, flat

    def all(self, conn: Connection, params: Mapping[str, Any]) -> list[RawRow]:
        """Every row."""
        raw, flat = self._raw(params)
        return raw.all(conn, flat)
