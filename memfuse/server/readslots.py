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

A token's own heavy reads must not hold up its quick ones either: a console tab's page of one
record behind the same token's export (two pages of 1,000 records that may take up to
``--read-timeout``) would otherwise wait for one of them to end. So a read estimated cheap
(``is_cheap``: one record, one version, one store, one account or job, a page of at most
``SMALL_PAGE`` records without content) may also take one of ``cheap_per_key`` further slots of
its token, and one of ``cheap_total`` further slots in all: a token's heavy reads still run at
most ``per_key`` at once (every slot a key holds counts), all heavy reads at most ``total``
(every slot held counts), and the CPU is shared by at most ``total + cheap_total`` reads, the
extra ones each a few milliseconds. A waiting cheap read may go before its own token's
waiting heavy read that cannot (its cap reached); reads of one kind keep their order.

Read-only tool calls are reads too (attack17 F3: 30 memory-tool views of one token made
another client's answers 14-20 times slower): a ``POST`` of the memory tool
(``/v1/workspaces/{ws}/memory-tool``) whose command only reads, and a ``POST /mcp`` whose
JSON-RPC messages only read (``read_call``), take a read slot as a ``GET`` does.

The wait is bounded by the read's budget (``memfuse.server.gate.Gate._run_read``: its client
leaving, or ``read_budget`` s, end it) and its length by the request slots a token and all
tokens may hold (``Shares``, ``max_inflight``). Event-loop only.
"""
from __future__ import annotations

from collections import deque
from urllib.parse import parse_qsl

import json

import anyio

from memfuse.server import routetable as table

READS_PER_TOKEN = 2  # reads of one token (or one address without a token) the app works on at once
MAX_READS = 8  # reads the app works on at once, all tokens
CHEAP_PER_TOKEN = 1  # further slots of a token for its reads estimated cheap
CHEAP_READS = 4  # further slots in all for reads estimated cheap
SMALL_PAGE = 50  # records (without content) of a page estimated cheap
# one row each, bounded by the record size limit (or holding no content)
_CHEAP_ROUTES = frozenset({table.GET_RECORD, table.GET_VERSION, table.GET_STORE,
                           table.GET_ACCOUNT, table.GET_CONSOLIDATION})
# memory-tool commands that only read (memfuse.server.memtool); their MCP tools are
# ``memory_<command>`` (memfuse.mcp_server.TOOLS marks them read_only_hint, tested)
READ_COMMANDS = frozenset({"view", "search", "history"})
# MCP methods that read no data (answered from the process): with the read tools' calls
# only these, a POST /mcp is a cheap read; any other method or tool makes it a write
_MCP_PROTOCOL = frozenset({"ping", "tools/list", "notifications/initialized",
                           "notifications/cancelled"})
# MCP methods that read data (the prompt block, a store's index, its stores)
_MCP_READS = frozenset({"initialize", "server/discover", "resources/list", "resources/read",
                        "resources/templates/list"})
MEMORY_TOOL_SUFFIX = "/memory-tool"
_FALSE = frozenset({"0", "false", "off", "no", "f", "n"})  # as the app's bool query parameters


def is_cheap(path: str, query: bytes) -> bool:
    """Whether a ``GET`` of decoded URL ``path`` with raw ``query`` string is a read estimated
    cheap (module docstring): a v1 route answering one row (a record, a version, a store, an
    account, a job), or a page of records or versions whose ``limit`` is at most
    ``SMALL_PAGE`` and that asks no ``content``. Everything else (searches, the prompt block,
    bigger pages, the console, a query it cannot read) is not."""
    m = table.match("GET", path)
    if m is None:
        return False
    if m.route in _CHEAP_ROUTES:
        return True
    if m.route not in (table.LIST_RECORDS, table.LIST_VERSIONS):
        return False
    try:
        args = parse_qsl(query.decode("ascii"), strict_parsing=False)
    except UnicodeDecodeError:
        return False
    limit = [v for k, v in args if k == "limit"]
    if len(limit) != 1 or not limit[0].isdigit() or int(limit[0]) > SMALL_PAGE:
        return False
    return all(v.lower() in _FALSE for k, v in args if k == "content")


def read_call(path: str, body: bytes) -> bool | None:
    """Whether a ``POST`` of decoded URL ``path`` with ``body`` is a read-only tool call
    (module docstring): None when it is not (a write, another endpoint, a body that is not
    the JSON it should be: the app answers it), else whether it is estimated cheap (an MCP
    request of protocol methods only, ``tools/list``, ``ping``...). A memory-tool command in
    ``READ_COMMANDS``, an MCP message (or batch) of read tools' calls and reading methods."""
    if path.endswith(MEMORY_TOOL_SUFFIX):
        if not path.startswith("/v1/workspaces/") or path.count("/") != 4:
            return None
        msg = _json(body)
        return False if isinstance(msg, dict) and msg.get("command") in READ_COMMANDS else None
    if path != "/mcp":
        return None
    msg = _json(body)
    msgs = msg if isinstance(msg, list) else [msg]
    cheap = True
    for m in msgs:
        if not isinstance(m, dict) or not isinstance(m.get("method"), str):
            return None
        method = m["method"]
        if method in _MCP_PROTOCOL:
            continue
        cheap = False
        if method in _MCP_READS:
            continue
        params = m.get("params")
        name = params.get("name") if isinstance(params, dict) else None
        if (method != "tools/call" or not isinstance(name, str)
                or name.removeprefix("memory_") not in READ_COMMANDS or not name.startswith("memory_")):
            return None
    return cheap if msgs else None


def _json(body: bytes) -> object:
    """``body`` decoded as JSON, None when it is not JSON (or nested deeper than the parser
    recurses)."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


class ReadSlots:
    """``total`` read slots, at most ``per_key`` per key (a token's digest, or an address),
    and for reads estimated cheap ``cheap_total`` more, ``cheap_per_key`` more per key,
    handed out fairly (module docstring). ``acquire(key, cheap)`` waits for one
    (cancellable: a slot given meanwhile is given back), ``release(key)`` gives it back.
    ``running``: slots held now; ``waiting``: reads waiting now."""

    def __init__(self, per_key: int = READS_PER_TOKEN, total: int = MAX_READS,
                 cheap_per_key: int = CHEAP_PER_TOKEN, cheap_total: int = CHEAP_READS) -> None:
        if per_key < 1 or total < 1 or cheap_per_key < 0 or cheap_total < 0:
            raise ValueError("read slots: per_key and total must be at least 1, the cheap "
                             "ones at least 0")
        self.per_key = per_key
        self.total = total
        self.cheap_per_key = cheap_per_key
        self.cheap_total = cheap_total
        self.running = 0
        self.waiting = 0
        # INVARIANT: ``_held[k]`` is the slots key k holds (no zero entry), their sum is
        # ``running`` <= ``total + cheap_total``; a read that is not cheap was granted only
        # while its key held < ``per_key`` and ``running`` < ``total`` (so at most
        # ``per_key`` of a key's and ``total`` in all run); a cheap one while its key held <
        # ``per_key + cheap_per_key`` and ``running`` < ``total + cheap_total``
        # (``_fits``). ``_queues`` holds the keys with reads waiting (no empty deque), in the
        # order they are served next (round robin: a key served goes last), each with its
        # waiters (event, cheap) oldest first, ``waiting`` of them in all; a read waits only
        # while it does not fit (``_grant`` hands out every slot that frees).
        self._held: dict[str, int] = {}
        self._queues: dict[str, deque[tuple[anyio.Event, bool]]] = {}

    def _fits(self, key: str, cheap: bool) -> bool:
        held = self._held.get(key, 0)
        if cheap:
            return (held < self.per_key + self.cheap_per_key
                    and self.running < self.total + self.cheap_total)
        return held < self.per_key and self.running < self.total

    async def acquire(self, key: str, cheap: bool = False) -> None:
        """Take one of ``key``'s slots (``cheap``: a read estimated cheap, ``is_cheap``),
        waiting (in its turn) while none is free. Raises the cancellation that ends a wait
        (nothing is then held)."""
        # (no read waits that could take it: a read waits only while its caps hold it back,
        # and the same caps hold back a later read of its key and kind)
        if self._fits(key, cheap):
            self._take(key)
            return
        waiter = (anyio.Event(), cheap)
        self._queues.setdefault(key, deque()).append(waiter)
        self.waiting += 1
        try:
            await waiter[0].wait()
        except BaseException:
            if waiter[0].is_set():  # granted as it was cancelled: give it back
                self.release(key)
            else:
                queue = self._queues[key]
                queue.remove(waiter)
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
        """Give the free slots to the waiting keys in turn: to each key's oldest waiting
        read that fits (``_fits``), skipping keys with none."""
        for key in list(self._queues):
            if self.running >= self.total + self.cheap_total:
                return
            queue = self._queues[key]
            kinds: set[bool] = set()
            for waiter in queue:  # the oldest read of each kind, the older first
                if waiter[1] in kinds:
                    continue
                if self._fits(key, waiter[1]):
                    break
                kinds.add(waiter[1])
                if len(kinds) == 2:
                    break
            else:
                continue
            if waiter[1] in kinds:  # neither kind fits
                continue
            queue.remove(waiter)
            del self._queues[key]
            if queue:
                self._queues[key] = queue  # its next read waits behind the other keys'
            waiter[0].set()
            self.waiting -= 1
            self._take(key)
