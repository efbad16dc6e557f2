"""The sha256 of an append from the hash state of what it extends: one pass over the suffix.

A record's sha256 (its ETag) is of its whole content, so an append (``echo line >> f``) to a
1 MiB file would hash 1 MiB for a one-line change: about 7 ms of CPU on a small machine, at
every step of the path that hashes (the sidecar's commit, its outbox witness, its put; the
control plane's write). ``Sha256States`` keeps, in memory, the running ``hashlib`` state of
recently hashed contents, keyed by their sha256: the sha256 of ``content + suffix`` is that
state copied (``hashlib``'s ``copy()``) and fed ``suffix`` only. A state is exact by
construction (it is the state that produced that digest), so a hit gives the same digest as
hashing the whole; a miss (another process, an evicted entry, a restart) hashes the whole as
before. Nothing is persisted: ``hashlib`` states cannot be serialized, and none is needed.

Memory: a state is a ``hashlib`` object of ~100 bytes plus its key; ``MAX_STATES`` of them at
most, least recently used evicted first. Thread safety: every method holds one lock (the
control plane writes from worker threads).
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any

__all__ = ["MAX_STATES", "MIN_BYTES", "Sha256States"]

#: states kept at most (least recently used first out)
MAX_STATES = 512
#: contents shorter than this are not worth a state: hashing them whole costs less than the
#: bookkeeping (~10 µs for 4 KiB)
MIN_BYTES = 16 * 1024


class Sha256States:
    """Recently hashed contents' sha256 states, by sha256 hex (least recently used evicted
    beyond ``max_states``). ``digest(data)`` hashes a content whole and keeps its state;
    ``extend(base_sha, suffix)`` gives the sha256 of (the content whose sha256 is
    ``base_sha``) + ``suffix`` from the kept state, or None when none is kept."""

    def __init__(self, max_states: int = MAX_STATES, min_bytes: int = MIN_BYTES) -> None:
        self.max_states = max_states
        self.min_bytes = min_bytes
        self._states: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0  # extend answered from a state
        self.misses = 0  # extend found none

    def _keep(self, sha: str, state: Any) -> None:
        self._states[sha] = state
        self._states.move_to_end(sha)
        while len(self._states) > self.max_states:
            self._states.popitem(last=False)

    def digest(self, data: bytes) -> str:
        """The sha256 hex of ``data`` (hashed whole); its state is kept when ``data`` is at
        least ``min_bytes`` long."""
        h = hashlib.sha256(data)
        sha = h.hexdigest()
        if len(data) >= self.min_bytes:
            with self._lock:
                self._keep(sha, h)
        return sha

    def extend(self, base_sha: str, suffix: bytes) -> str | None:
        """The sha256 hex of the content whose sha256 is ``base_sha`` followed by ``suffix``,
        computed from ``base_sha``'s kept state (one pass over ``suffix``) and kept in turn;
        None when no state of ``base_sha`` is kept (hash the whole content then)."""
        with self._lock:
            state = self._states.get(base_sha)
            if state is None:
                self.misses += 1
                return None
            self._states.move_to_end(base_sha)
            self.hits += 1
            h = state.copy()
        h.update(suffix)
        sha: str = h.hexdigest()
        with self._lock:
            self._keep(sha, h)
        return sha

    def of(self, data: bytes, base_sha: str | None = None, base_len: int = 0) -> str:
        """The sha256 hex of ``data``, whose first ``base_len`` bytes are the content whose
        sha256 is ``base_sha`` (the caller knows it: an append): from that content's state
        when kept (``extend``), else hashed whole (``digest``)."""
        if base_sha and 0 < base_len <= len(data):
            sha = self.extend(base_sha, data[base_len:])
            if sha is not None:
                return sha
        return self.digest(data)
