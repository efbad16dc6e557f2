"""The outbox journal's witness: ``accepted.log`` beside ``outbox.db``, one JSON line per
entry accepted, per entry finished and per key-map change, so a lost, emptied, cut or
corrupt journal is noticed and what it lost is known (docs/SEMANTICS.md "What an accepted
write survives"). Written by the journal's writer (``journal.Journal``) after each batch
commits; read at start (``Sidecar._recover_journal``). Also ``move_aside``: how a damaged
SQLite file is kept for inspection."""
from __future__ import annotations

import contextlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any

WITNESS_NAME = "accepted.log"


def move_aside(path: Path) -> Path:
    """Rename ``path`` and its ``-wal`` / ``-shm`` / ``-journal`` files to
    ``<path>.corrupt-<unix time>[-wal...]`` (kept for inspection); returns the new path."""
    stamp = f"{path.name}.corrupt-{int(time.time())}"
    target = path.with_name(stamp)
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{stamp}.{n}")
    for suffix in ("", "-wal", "-shm", "-journal"):
        src = Path(f"{path}{suffix}")
        if src.exists():
            src.rename(Path(f"{target}{suffix}"))
    return target


class Witness:
    """What the outbox journal should hold, kept apart from it: ``accepted.log``, one JSON
    line per entry accepted (id, idempotency key, store, op, node key, args, the sha256 of its
    content, the record id and base it was written on), per entry finished (``{"d": id}``)
    and per key-map change, appended by the journal's writer right after each batch commits
    and before any of its entries counts as accepted (not fsynced: see ``append``). No content: the content
    of an accepted put is in the blob cache (``blobs.db``), put there before the entry was
    queued. Emptied when the journal holds no entry. ``unfinished(present)`` gives the
    accepted entries neither finished nor in the journal: what a lost, emptied, cut or
    corrupt journal lost (docs/SEMANTICS.md "What an accepted write survives")."""

    def __init__(self, path: Path) -> None:
        self.path = path
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        self._fd = fd
        #: node key -> (record id, base sha256) its earliest unfinished entry was written on,
        #: for the keys with a record whose earliest unfinished entry line comes after their
        #: last key-map line (set by ``unfinished``): the version this sidecar last saw
        #: (the key map persists only commits: a remote change seen, or the clean version of
        #: a record loaded from a snapshot, is memory only), the base of the replayed put
        #: (``Sidecar._recover_journal``)
        self.bases: dict[str, tuple[Any, Any]] = {}
        #: lines of the witness that ``unfinished`` could not read as any of its shapes
        #: (JSON of another shape, wrong types, garbage), set by it
        self.damaged = 0

    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def append(self, lines: list[dict[str, Any]]) -> None:
        """Append ``lines`` (worker thread), one ``write(2)``, no fsync: the lines are in the
        kernel's page cache, so they survive the process (a crash, ``kill -9``) at once; only
        a crash of the machine may lose the last ones, and then the journal (fsynced) still
        holds those entries: the witness is read only for what the journal lacks. So the
        witness adds no disk flush to a ``close``. Raises ``OSError``."""
        data = "".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]

    def clear(self) -> None:
        os.ftruncate(self._fd, 0)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)

    def unfinished(self, present: set[int]) -> tuple[list[dict[str, Any]], dict[str, tuple[Any, Any]], int]:
        """(entries accepted, not finished and not in ``present`` (the journal's entry ids),
        in order; the key map the witness saw, node key -> (record id, sha256); the highest
        entry id it names). A damaged line is never fatal and never silent (attack17 F5):
        one cut (a crash of the machine, an edit) whose entry id can still be read stands for
        its entry, which, unfinished and missing from the journal, comes back as a placeholder
        (``"damaged": True``, with the store, op and path when its text still holds them,
        never replayed: ``Journal.recover`` names it lost); any other line that does not read
        as one of the witness's shapes (JSON of another shape, wrong types, garbage) is
        counted in ``damaged``, for the start to say that writes may be lost when the
        journal lacked entries too (``Sidecar.journal_missing``).

        A line of an accepted entry is read in full only when needed (a lost entry, the
        first line of a node key for ``bases``); for the others the id and node key are
        taken from the head ``Journal.add`` writes (``_WITNESS_HEAD``): a backlog of 10,000
        entries is 10,000 lines (bench/README.md, "A backlog of one file")."""
        top = 0
        added: dict[int, tuple[str | None, str | dict[str, Any]]] = {}  # id -> (node key, line)
        keys: dict[str, tuple[Any, Any]] = {}
        # entry id -> number of its first line; node key -> number of its last key-map
        # line: which of the two the sidecar knew last (``bases``)
        first_pos: dict[int, int] = {}
        last_key: dict[str, int] = {}
        self.damaged = 0
        try:
            text = self.path.read_text("utf-8", errors="replace")
        except OSError:
            return [], {}, 0
        for pos, raw in enumerate(text.splitlines()):
            m = _WITNESS_DONE.match(raw)
            if m is not None:
                added.pop(int(m.group(1)), None)
                continue
            m = _WITNESS_HEAD.match(raw)
            if m is not None and raw.endswith("}"):
                i = int(m.group(1))
                added[i] = (m.group(2), raw)
                top = max(top, i)
                first_pos.setdefault(i, pos)
                continue
            try:
                x = json.loads(raw)
            except ValueError:
                x = None
            if isinstance(x, dict) and _is_int(x.get("d")) and len(x) == 1:
                added.pop(x["d"], None)
            elif isinstance(x, dict) and isinstance(x.get("m"), str):
                keys[x["m"]] = (x.get("r"), x.get("h"))
                last_key[x["m"]] = pos
            elif isinstance(x, dict) and _entry_shape(x):
                added[x["i"]] = (x.get("n"), x)
                top = max(top, x["i"])
                first_pos.setdefault(x["i"], pos)
            elif raw.strip():
                cut = _WITNESS_ID.match(raw)
                if cut is not None and x is None:  # cut short: its entry stands, unreadable
                    i = int(cut.group(1))
                    added[i] = (None, raw)
                    top = max(top, i)
                    first_pos.setdefault(i, pos)
                else:
                    self.damaged += 1

        def full(i: int, line: str | dict[str, Any]) -> dict[str, Any]:
            if isinstance(line, dict):
                return line
            try:
                x = json.loads(line)
            except ValueError:  # cut by a crash or an edit
                x = None
            if isinstance(x, dict) and _entry_shape(x):
                return x
            return _placeholder(i, line)

        self.bases = {}
        seen: set[str] = set()
        lost = []
        for i, (node_key, line) in sorted(added.items()):
            if i not in present:
                lost.append(full(i, line))
            if node_key and node_key not in seen:
                seen.add(node_key)
                # the base the sidecar knew last: the ident the entry was written on,
                # unless a key-map line (a commit learnt) came after it; the key map is
                # then the base (the journal's, or ``keys`` when it is lost)
                if first_pos.get(i, -1) < last_key.get(node_key, -1):
                    continue
                x = full(i, line)
                if x.get("r") and not x.get("damaged"):
                    self.bases[node_key] = (x.get("r"), x.get("b"))
        return lost, keys, top


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _entry_shape(x: dict[str, Any]) -> bool:
    """Whether ``x`` has the shape of an accepted entry's line as ``Journal.add`` writes it:
    an integer id, string idempotency key, store and op, a string or null node key, an
    object or null args and a string or null sha256."""
    return (_is_int(x.get("i")) and isinstance(x.get("k"), str) and isinstance(x.get("s"), str)
            and isinstance(x.get("o"), str) and isinstance(x.get("n"), (str, type(None)))
            and isinstance(x.get("a"), (dict, type(None))) and isinstance(x.get("h"), (str, type(None))))


def _placeholder(i: int, line: str) -> dict[str, Any]:
    """What a damaged line of accepted entry ``i`` still says, for naming it lost: its store,
    op and path when its text holds them whole, ``"damaged": True``; no content hash, so it
    is never replayed."""
    def field(name: str) -> str | None:
        m = re.search(r'"%s":"([^"\\]*)"' % name, line)
        return m.group(1) if m else None

    path = field("path")
    return {"i": i, "k": None, "s": field("s") or "", "o": field("o") or "write",
            "n": None, "a": {"path": path} if path is not None else {}, "h": None,
            "damaged": True}


#: the head of an accepted entry's witness line as ``Journal.add`` writes it (json.dumps of
#: a dict in that order): its id and node key (keys are ``r:<id>`` / ``n:<hex>``)
_WITNESS_HEAD = re.compile(r'\{"i":(\d+),"k":"[^"\\]*","s":"[^"\\]*","o":"[^"\\]*","n":(?:null|"([^"\\]*)")')
#: a finished entry's witness line
_WITNESS_DONE = re.compile(r'\{"d":(\d+)\}$')
#: the start of an accepted entry's line, enough to know its id when the rest is cut
_WITNESS_ID = re.compile(r'\{"i":(\d+)[,}]')
