"""Read slots: how many reads the app works on at once, per token and in all, and who goes
next when one ends (docs/API.md, "Request slots"; attack 16 F4).

``memfuse serve`` is one process: a read's work (SQL, building and encoding its answer) runs
on a worker thread under the GIL, beside the event loop that answers every other client. A
token's share of the request slots (``memfuse.server.gate.Shares``, 32 of 128) bounds how
many requests it has in the server, not how much of the CPU they take: 16 searches or
1000-record pages of one token, well within that share, made every other client's answers
40-100 times slower (/healthz 4 -> 283 ms p50). So a read (an ordinary ``GET`` under
``/v1/`` or ``/ui/``, run under ``memfuse.server.budget``) also takes one of ``total``
*read slots*, at most ``per_key`` of them per token (or per client address without one),
before the app sees it; the others wait here, in a FIFO per token, and a slot that frees
goes to the next token in turn (round robin over the tokens that wait, each token's own
reads in their order). One token's flood then costs another client at most the wait for
one read to end, and the CPU is shared by at most ``total`` reads.

The wait is bounded by the read's budget (``memfuse.server.gate.Gate._run_read``: its client
leaving, or ``read_budget`` s, end it) and its length by the request slots a token and all
tokens may hold (``Shares``, ``max_inflight``). Event-loop only.
"""
from __future__ import annotations

from collections import deque

import anyio

READS_PER_TOKEN = 2  # reads of one token (or one address without a token) the app works on at once
MAX_READS = 8  # reads the app works on at once, all tokens


class ReadSlots:
    """``total`` read slots, at most ``per_key`` per key (a token's digest, or an address),
    handed out fairly (module docstring). ``acquire(key)`` waits for one (cancellable: a
    slot given meanwhile is given back), ``release(key)`` gives it back. ``running``: slots
    held now; ``waiting``: reads waiting now."""

    def __init__(self, per_key: int = READS_PER_TOKEN, total: int = MAX_READS) -> None:
        if per_key < 1 or total < 1:
            raise ValueError("read slots: per_key and total must be at least 1")
        self.per_key = per_key
        self.total = total
        self.running = 0
        self.waiting = 0
        # INVARIANT: ``_held[k]`` is the slots key k holds (no zero entry), their sum is
        # ``running`` <= ``total``; ``_queues`` holds the keys with reads waiting (no empty
        # deque), in the order they are served next (round robin: a key served goes last),
        # each with its waiters' events oldest first, ``waiting`` of them in all; a key
        # waits only while it holds ``per_key`` or all ``total`` are held (``_grant``).
        self._held: dict[str, int] = {}
        self._queues: dict[str, deque[anyio.Event]] = {}

    async def acquire(self, key: str) -> None:
        """Take one of ``key``'s slots, waiting (in its turn) while none is free. Raises
        the cancellation that ends a wait (nothing is then held)."""
        # (no read waits that could take it: a key waits only while a cap holds it back)
        if self.running < self.total and self._held.get(key, 0) < self.per_key:
            self._take(key)
            return
        event = anyio.Event()
        self._queues.setdefault(key, deque()).append(event)
        self.waiting += 1
        try:
            await event.wait()
        except BaseException:
            if event.is_set():  # granted as it was cancelled: give it back
                self.release(key)
            else:
                queue = self._queues[key]
                queue.remove(event)
                self.waiting -= 1
                if not queue:
                    del self._queues[key]
            raise

    def release(self, key: str) -> None:
        """Give back a slot of ``key`` taken by ``acquire``; the next reads in turn get the
        slots free now."""
        n = self._held[key] - 1
        if n:
            self._held[key] = n
        else:
            del self._held[key]
        self.running -= 1
        self._grant()

    def _take(self, key: str) -> None:
        self._held[key] = self._held.get(key, 0) + 1
        self.running += 1

    def _grant(self) -> None:
        """Give the free slots to the waiting keys in turn, skipping keys at ``per_key``."""
        for key in list(self._queues):
            if self.running >= self.total:
                return
            if self._held.get(key, 0) >= self.per_key:
                continue
            queue = self._queues.pop(key)
            queue.popleft().set()
            self.waiting -= 1
            self._take(key)
            if queue:
                self._queues[key] = queue  # its next read waits behind the other keys'
