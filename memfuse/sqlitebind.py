"""``None`` bound as SQL ``NULL`` by the ``sqlite3`` module without its adaptation search.

Python's ``sqlite3`` binds a parameter of an exact ``int``, ``float``, ``str`` or
``bytearray`` as it is; any other value, ``None`` included, goes through
``microprotocols_adapt``: a key tuple built and looked up in ``sqlite3.adapters``, then
``PrepareProtocol.__adapt__`` and the value's ``__conform__`` looked up and not found, and only
then the value bound as it is. A record create of ``memfuse serve`` binds ~10 ``None`` (the
optional columns of the record and its version): ~26 k instructions of its writer thread's
~1.24 M (callgrind, bench/README.md, "The close path, session 19"). With an adapter registered
for ``NoneType`` the search ends at the first lookup, and the adapter (``{}.get``: a C call
that answers ``None`` for ``None``) gives back ``None``, which the module binds as ``NULL``:
the same value stored, for ~1.1 k instructions.

The registry is the ``sqlite3`` module's (process-wide): every connection of the process binds
``None`` this way. The answer is the one the search gave (``None`` itself), so no caller sees a
difference; ``NoneType`` is not one of the base types whose adaptation makes the module adapt
every parameter (``BaseTypeAdapted``)."""
from __future__ import annotations

import sqlite3

_NOTHING: dict[object, None] = {}
_NONE_TO_NULL = _NOTHING.get  # _NONE_TO_NULL(None) is None: a C call, no Python frame


def bind_none_directly() -> None:
    """Register the ``NoneType`` adapter (above) unless one is registered already (ours, or a
    caller's own, which is kept). Idempotent; never raises."""
    sqlite3.adapters.setdefault((type(None), sqlite3.PrepareProtocol), _NONE_TO_NULL)


bind_none_directly()
