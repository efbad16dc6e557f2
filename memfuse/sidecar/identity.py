"""Record identity: which control-plane record a file of the mount is, and at which version.

A file's outbox identity is its *node key*: ``r:<record id>`` for records loaded from the
control plane, ``n:<key>`` for files created here (memfuse/sidecar/INVARIANTS.md,
"Identity"). ``RecordIds`` maps node keys to ``(record id, last known sha256)``: learnt from
commits (persisted in the journal's ``keymap`` table, so a replay after a crash resolves the
keys of records the previous process created), from remote changes and from first local
writes (memory only). A record loaded from a snapshot is not in the map until it is written
(memory per record): its sha256 is then the one the store's mirror holds (``base_sha``).

One object, shared by the filesystem core (which notes what it learns) and the committer
(which resolves keys when it sends an entry and learns from the answers).
"""
from __future__ import annotations

from typing import Callable

from ..wire import Record
from .journal import Journal

__all__ = ["RecordIds"]

#: ``(record id, sha256)``; ``(None, None)`` for a key known to have no record (deleted)
Identity = tuple["str | None", "str | None"]


class RecordIds:
    """node key → (record id, last known sha256).

    ``map`` holds the keys learnt (``learn``: also queued in the journal; ``note``: memory
    only). ``get`` falls back, for an ``r:<id>`` key not in ``map``, to the id and the sha256
    the store's mirror holds (``base_sha(store, record_id)``, None when unknown).
    """

    def __init__(self, journal: Journal | None, known: dict[str, Identity] | None = None,
                 base_sha: Callable[[str, str], str | None] | None = None) -> None:
        self._journal = journal
        #: INVARIANT: ``map[k]`` is the record id and sha256 the control plane last told us
        #: (or we last committed) for node key ``k``
        self.map: dict[str, Identity] = known if known is not None else {}
        #: ``base_sha(store, record_id)``: the sha256 the store's mirror holds, or None
        self.base_sha = base_sha

    def get(self, node_key: str | None, store: str = "") -> Identity:
        """(record id, last known sha256) of ``node_key``: from ``map``, else for
        ``r:<id>`` the id and the sha256 the store's mirror holds (``base_sha``; None when
        unknown: an update is then unconditional), else ``(None, None)``."""
        if node_key is None:
            return None, None
        if node_key in self.map:
            return self.map[node_key]
        if node_key.startswith("r:"):
            rid = node_key[2:]
            return rid, (self.base_sha(store, rid) if self.base_sha is not None else None)
        return None, None

    def learn(self, node_key: str | None, rec: Record | None) -> None:
        """A commit answered ``rec`` for ``node_key`` (None: the record is gone): remember it
        and queue it in the journal (a replay after a crash resolves the key)."""
        val: Identity = (rec.id, rec.sha256) if rec is not None else (None, None)
        self.map[node_key] = val  # type: ignore[index]  # None only for entries without a file
        if self._journal is not None:
            self._journal.set_key(node_key, *val)  # type: ignore[arg-type]

    def forget(self, node_key: str) -> None:
        """``node_key``'s file was replaced (its record taken over by another file): forget
        it, in memory and in the journal."""
        self.map.pop(node_key, None)
        if self._journal is not None:
            self._journal.set_key(node_key, None, None)

    def note(self, node_key: str, record_id: str | None, sha: str | None) -> None:
        """Remember ``node_key``'s record and sha256 as the control plane now holds them (a
        remote change): memory only, the journal learns it from the next commit."""
        self.map[node_key] = (record_id, sha)

    def note_default(self, node_key: str, record_id: str | None, sha: str | None) -> None:
        """Remember ``node_key``'s clean record and sha256 unless already known (the first
        local write of a record loaded from a snapshot: the base of its update)."""
        self.map.setdefault(node_key, (record_id, sha))

    def record_id(self, node_key: str) -> str | None:
        """The record id ``map`` knows for ``node_key`` (None when none)."""
        return self.map.get(node_key, (None, None))[0]
