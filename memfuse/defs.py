"""Constants, enums and pure helpers of the control-plane API v1 (docs/API.md).

Shared by the server's pydantic models (:mod:`memfuse.models`, which re-exports all of this)
and the client's msgspec Structs (:mod:`memfuse.wire`). Imports only the standard library and
msgspec (``json_text_bytes`` measures with its encoder), so the sidecar, which never loads
pydantic, can use them.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone
from enum import Enum
from typing import TypeVar
from urllib.parse import parse_qsl, urlencode

import msgspec

__all__ = [
    "RECORD_TYPES",
    "DEFAULT_MODE",
    "MODE_MASK",
    "MTIME_NS_MIN",
    "MTIME_NS_MAX",
    "SLUG_PATTERN",
    "MAX_TOKEN_TTL_SECONDS",
    "INSTRUCTIONS_MAX_CHARS",
    "BATCH_MAX_OPERATIONS",
    "BATCH_MAX_BYTES",
    "MAX_RECORD_BYTES",
    "DEFAULT_MAX_RECORD_BYTES",
    "RECORD_BODY_MIN",
    "RECORD_BODY_ENVELOPE",
    "RECORD_BODY_GROWTH",
    "RECORD_BODY_MAX",
    "record_body_bound",
    "largest_record",
    "PREFIX_MOVE_MAX",
    "PREFIX_MOVE_S_PER_RECORD",
    "prefix_move_timeout",
    "RECORDS_PAGE_DEFAULT",
    "RECORDS_PAGE_MAX",
    "SEARCH_QUERY_MAX",
    "SEARCH_PREFIX_MAX",
    "SEARCH_PAGE_DEFAULT",
    "SEARCH_PAGE_MAX",
    "SEARCH_LINES_DEFAULT",
    "SEARCH_LINES_MAX",
    "VERSIONS_PAGE_DEFAULT",
    "VERSIONS_PAGE_MAX",
    "VERSIONS_PAGE_BYTES",
    "versions_page_rows",
    "next_page_link",
    "FEED_PAGE_MAX",
    "PAGE_CONTENT_BYTES",
    "page_rows_within",
    "JSON_TEXT_GROWTH",
    "json_text_bytes",
    "json_rows_within",
    "content_page",
    "JOBS_PAGE_DEFAULT",
    "JOBS_PAGE_MAX",
    "Access",
    "Operation",
    "sha256_hex",
    "datetime_ns",
    "mtime_effective_ns",
    "HISTORY_BYTES_FACTOR",
    "HISTORY_VERSIONS_FACTOR",
    "HISTORY_MIN_AGE_S",
]

RECORD_TYPES = ("user", "feedback", "project", "reference")
DEFAULT_MODE = 0o644  # permission bits of a record whose mode was never set
#: a store's history budget when it sets none (docs/SEMANTICS.md "History budget"): the
#: content of past versions kept is at most this many times ``max_store_bytes`` and this many
#: times ``max_records`` versions; versions younger than ``HISTORY_MIN_AGE_S`` are never pruned
HISTORY_BYTES_FACTOR = 16
HISTORY_VERSIONS_FACTOR = 16
HISTORY_MIN_AGE_S = 86_400
MODE_MASK = 0o777  # the bits a record keeps (rwx of user, group, other; never setuid, setgid or sticky)
MTIME_NS_MIN, MTIME_NS_MAX = -(1 << 63), (1 << 63) - 1  # a signed 64-bit ns count
# versions, feed positions (seq, after) and limits are signed 64-bit integers in the database:
# the API refuses a larger one with 422 (and says so in its OpenAPI document)
INT64_MAX = (1 << 63) - 1
SLUG_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"
MAX_TOKEN_TTL_SECONDS = 10 * 366 * 86400  # ten years
# characters of an attachment's instructions (the prompt block shows them): the bound of
# Anthropic's memory-store resources (docs/ANTHROPIC-API.md)
INSTRUCTIONS_MAX_CHARS = 4096
BATCH_MAX_OPERATIONS = 100  # operations in one POST /v1/stores/{store}/batch
# A record must fit in one request: the largest record a store may allow and the front door's
# body bound are one rule (``record_body_bound`` / ``largest_record``; docs/API.md, "Limits").
MAX_RECORD_BYTES = 8 * 1024 * 1024  # the largest max_record_bytes with the default body bound
DEFAULT_MAX_RECORD_BYTES = 1 << 20  # a new store's max_record_bytes
RECORD_BODY_ENVELOPE = 64 * 1024  # bytes of a write's JSON body besides its content (path, type, syntax)
# the most one byte of valid text (UTF-8) grows in a request body, over every encoder a client
# may use: JSON escapes a control character other than \b \t \n \f \r as ``\u00XX``, six bytes
# for one, whether it escapes non-ASCII (``ensure_ascii``: at most six bytes for a 2-byte
# character, twelve for a 4-byte one) or not (msgspec, the sidecar's and the CLI's); a form's
# percent-encoding is at most three (``%XX`` a byte). So every valid record of up to a store's
# ``max_record_bytes`` fits (tests/test_body_bound.py checks every code point)
RECORD_BODY_GROWTH = 6


def record_body_bound(max_record_bytes: int) -> int:
    """The body bound (bytes) a control plane needs so that a write of any valid record of up
    to ``max_record_bytes`` bytes (UTF-8) fits in one request, however its client encodes it:
    each content byte escaped at most ``RECORD_BODY_GROWTH``-fold (the true worst case, a
    control character as ``\\u00XX``), plus ``RECORD_BODY_ENVELOPE``. The inverse of
    ``largest_record``."""
    return RECORD_BODY_GROWTH * max_record_bytes + RECORD_BODY_ENVELOPE


def largest_record(max_body: int) -> int:
    """The largest ``max_record_bytes`` (bytes) a store may have on a control plane whose
    record writes take bodies of at most ``max_body`` bytes (``memfuse serve --max-body``):
    the largest ``n`` with ``record_body_bound(n) <= max_body`` (0 when none fits). A larger
    setting is refused 422 ``invalid_limit`` (``Service.create_store`` / ``update_store``); a
    store that has one already (set under a larger ``--max-body``) is named in a warning at
    the server's start (``memfuse.server.stores.stores_over_body_bound``)."""
    return max(0, (max_body - RECORD_BODY_ENVELOPE) // RECORD_BODY_GROWTH)


# the default body bound of record writes, batches, the memory tool and console forms
# (``memfuse serve --max-body``): a record of ``MAX_RECORD_BYTES`` fits (48 MiB + 64 KiB)
RECORD_BODY_MAX = record_body_bound(MAX_RECORD_BYTES)
BATCH_MAX_BYTES = RECORD_BODY_MAX  # bytes of one batch request body: holds any one record
# the smallest body bound a control plane may have: a store with the default limit fits (6 MiB + 64 KiB)
RECORD_BODY_MIN = record_body_bound(DEFAULT_MAX_RECORD_BYTES)
# records one prefix move (POST /v1/stores/{store}/move, a directory rename) moves at most:
# one request holds the database's one writer a bounded time (~0.2 ms of CPU per record,
# bench/README.md "Prefix moves"); a bigger one is refused 413 ``move_too_large``, and the
# sidecar refuses the rename(2) of a directory holding more with EXDEV, so ``mv`` copies
# file by file instead (docs/SEMANTICS.md "Directories")
PREFIX_MOVE_MAX = 20_000
# the seconds per record the client allows a prefix move beyond its usual timeout: 25 times
# the CPU measured (0.2 ms) for a loaded 2-CPU machine and a writer queue
PREFIX_MOVE_S_PER_RECORD = 0.005


def prefix_move_timeout(timeout: float) -> float:
    """Seconds a client waits for a prefix move's answer, for a client whose ordinary read
    timeout is ``timeout`` s: that plus what the largest move allowed (``PREFIX_MOVE_MAX``
    records) may legitimately take (``PREFIX_MOVE_S_PER_RECORD`` each): 130 s for 30 s."""
    return timeout + PREFIX_MOVE_MAX * PREFIX_MOVE_S_PER_RECORD


# query bounds of GET /v1/stores/{store}/records and .../search: the app's Query(...) and the
# CLI's local fast path (memfuse.server.local) must agree on them
RECORDS_PAGE_DEFAULT, RECORDS_PAGE_MAX = 500, 1000  # records per snapshot page (``limit``)
SEARCH_QUERY_MAX = 256  # characters of ``q``
SEARCH_PREFIX_MAX = 1024  # characters of ``prefix`` (a record path's bound)
SEARCH_PAGE_DEFAULT, SEARCH_PAGE_MAX = 20, 100  # records read per search page (``limit``)
SEARCH_LINES_DEFAULT, SEARCH_LINES_MAX = 5, 100  # matching lines shown per record
# GET /v1/stores/{store}/records/{id}/versions: versions per page (``limit``; the default is
# the most, so a client that pages nothing sees as much as it can) and the JSON bytes of one
# page's versions (without content: a version's path is at most 1 KiB, so this cuts only
# pages of long paths); a page cut by either carries a ``Link: <…>; rel="next"`` header
VERSIONS_PAGE_DEFAULT = VERSIONS_PAGE_MAX = 1000
VERSIONS_PAGE_BYTES = 1 << 20


def versions_page_rows(encoded: Sequence[bytes]) -> int:
    """How many of the leading versions (``encoded``: each version's JSON, in page order) one
    page of ``GET .../records/{id}/versions`` carries: as many as fit ``VERSIONS_PAGE_BYTES``
    of the page's JSON array, each counted with the ``[`` or ``,`` before it
    (``page_rows_within``: at least one; 0 for none). The control plane's pages and the CLI's
    local reads (``memfuse.cli.localread``) cut by it."""
    return page_rows_within((len(b) + 1 for b in encoded), VERSIONS_PAGE_BYTES)


def next_page_link(query: str, cursor: int) -> str:
    """The ``Link`` header (RFC 8288) of a page whose request had the query string ``query``
    (raw, percent-encoded) when more follow: ``<?…>; rel="next"``, a reference relative to
    the request's URL whose query is the request's with ``cursor`` set to ``cursor`` (the
    other parameters kept, in order). Clients read it with httpx's ``Response.links``."""
    kept = [(k, v) for k, v in parse_qsl(query, keep_blank_values=True) if k != "cursor"]
    return f'<?{urlencode([*kept, ("cursor", str(cursor))])}>; rel="next"'


# the response header of GET /v1/workspaces/{ws}/attachments naming the actor the control plane
# records on this caller's writes (``ws:<workspace name>/<instance>``): what a sidecar's feed
# leaves out as its own (docs/API.md "Workspaces and attachments")
ACTOR_HEADER = "Memfuse-Actor"
# the response header of a record write answered without a body (DELETE's 204, and ``seq`` of
# such an operation's batch result): the change-feed seq of the version it made, so its
# writer can tell the record's older versions in the feed, which leaves its own out
# (docs/API.md "Records")
SEQ_HEADER = "Memfuse-Seq"
# the response header of GET /v1/workspaces/{ws}/attachments naming the workspace's account
# (docs/API.md "Workspaces and attachments"): what ``memfuse mount`` keys its default cache
# directory by, so two accounts' workspaces of one name on one host never share it
ACCOUNT_HEADER = "Memfuse-Account"
# the account of every object made before accounts, and of those made naming none
# (docs/API.md "Accounts"); a control plane that does not send ``ACCOUNT_HEADER`` has only it
DEFAULT_ACCOUNT = "default"
# the request header of a record write naming the store it was made for by that store's
# creation time (``Store.created_at``, RFC 3339): a precondition the control plane checks in
# the write's transaction, refusing a write of a store deleted and made again under its slug
# with 412 ``store_replaced`` (docs/API.md "Store identity"); a write without it is not checked
STORE_CREATED_HEADER = "Memfuse-Store-Created"
# the request header naming the sidecar instance that sends it (an opaque id of at most 64
# characters ``[A-Za-z0-9._-]``, one per running sidecar): kept on the versions its writes
# make, so its change feed leaves out exactly its own versions (``skip_writer``), not those of
# another sidecar given the same actor name (docs/API.md "Endpoints", GET .../changes)
WRITER_HEADER = "Memfuse-Writer"
# changes / events per page of GET .../changes and .../events (``limit``: also the default), in the
# app's Query(...), the long-poll fast path and the streams
FEED_PAGE_MAX = 1000
# bytes of content (UTF-8, the rows' ``size``) one page carrying content may hold: every page
# with content (change feed and its long-polls / streams, store snapshots, the memory-store
# face's memories and versions with ``view=full``) stops adding rows past it, so a page's memory
# is bounded by bytes and not only by rows (``limit``): each applies ``content_page`` (by the
# rows' sizes, ``page_rows_within``, then again in encoded JSON bytes, ``json_rows_within``)
PAGE_CONTENT_BYTES = 8 * 1024 * 1024


def page_rows_within(sizes: Iterable[int | None], budget: int = PAGE_CONTENT_BYTES) -> int:
    """How many of the leading rows (``sizes``: each row's content bytes in page order, None
    counted as 0) one page carries: as many as fit in ``budget`` bytes together, and always at
    least one (a row larger than the budget is served alone, so a reader makes progress).
    0 only when ``sizes`` is empty. A page cut short this way is not the end: its cursor
    (``next_cursor``, ``next_page``, the feed's ``seq``) goes on after its last row."""
    total = n = 0
    for size in sizes:
        total += size or 0
        if n and total > budget:
            break
        n += 1
    return n


# the bytes of JSON one byte of text (UTF-8) escapes to at most in an answer: a control
# character other than \b \t \n \f \r is ``\u00XX`` (memfuse's encoders — pydantic, msgspec,
# ``json`` without ``ensure_ascii`` — write other characters as their UTF-8, unescaped)
JSON_TEXT_GROWTH = 6
# the bytes JSON escapes in two (``\"`` ``\\`` ``\b`` ``\t`` ``\n`` ``\f`` ``\r``); the other
# control characters take six (``\u00XX``), every other byte stays itself
_JSON_SHORT = b'"\\\b\t\n\f\r'
_JSON_PLAIN = bytes(b for b in range(0x20, 256) if b not in _JSON_SHORT)
# characters up to which ``json_text_bytes`` measures a text by encoding it (its JSON, at most
# six bytes a character, is then a transient of at most 384 KiB)
_JSON_ENCODE_MAX = 64 * 1024
_json_encode = msgspec.json.Encoder().encode


def json_text_bytes(text: str) -> int:
    r"""The bytes of ``text`` as the body of a JSON string (without its quotes), as memfuse's
    answers encode it: its UTF-8 bytes, plus one for each ``"``, ``\``, and ``\b \t \n \f
    \r`` (two-byte escapes) and five for each other control character (``\u00XX``); at most
    ``JSON_TEXT_GROWTH`` times its UTF-8. Exact for pydantic's (serde_json's) and msgspec's
    encoders (tests/test_version_pages.py checks every code point). A text of at most
    ``_JSON_ENCODE_MAX`` characters is measured by encoding it (msgspec: ~0.35 µs per KB, its
    JSON a transient of at most six bytes a character), a longer one, or one msgspec refuses
    (a lone surrogate, counted as its three bytes), in C without its JSON (encode,
    ``bytes.translate`` twice): 1–5 ms per MiB (bench/README.md, "Change-feed pages bounded
    in JSON bytes", "Sidecar memory, session 24")."""
    if len(text) <= _JSON_ENCODE_MAX:
        try:
            return len(_json_encode(text)) - 2
        except UnicodeEncodeError:
            pass
    raw = text.encode("utf-8", "surrogatepass")
    escaped = raw.translate(None, _JSON_PLAIN)  # the bytes JSON escapes, and only those
    if not escaped:
        return len(raw)
    six = len(escaped.translate(None, _JSON_SHORT))  # ``\u00XX`` each; the rest two bytes each
    return len(raw) + (len(escaped) - six) + 5 * six


def json_rows_within(texts: Sequence[str | None], budget: int = PAGE_CONTENT_BYTES) -> int:
    """``page_rows_within`` for rows whose content is ``texts`` (None: none), each counted as
    its JSON (``json_text_bytes``): how many of the leading rows one page carries when its
    content is bounded in encoded bytes (a long-poll's or a stream line's page is encoded
    whole: 8 MiB of control characters would be 48 MiB of JSON). Counts nothing when even
    the worst growth (``JSON_TEXT_GROWTH`` bytes a character) fits."""
    if sum(len(t) for t in texts if t) * JSON_TEXT_GROWTH <= budget:
        return len(texts)
    return page_rows_within(json_text_bytes(t) if t else 0 for t in texts)


_Row = TypeVar("_Row")


def content_page(sizes: Sequence[int | None], read: Callable[[int], Sequence[_Row]],
                 text: Callable[[_Row], str | None]) -> tuple[list[_Row], bool]:
    """The page byte rule of every listing that carries content (the change feed and its
    long-polls and streams, store snapshots, the memory-store face's memories and versions),
    in its two steps:

    1. by size: ``n`` = ``page_rows_within(sizes)`` (``sizes``: each candidate row's content
       bytes, UTF-8, in page order, None counted as 0), then ``read(n)`` reads the first
       ``n`` rows with their content, so content past the budget is never read. It returns
       them in page order: fewer when some went meanwhile, one more when the caller reads
       one ahead to learn whether more follow;
    2. in JSON bytes: of the first ``n`` rows read, as many as ``json_rows_within`` lets the
       page carry (``text(row)``: the content the answer shows, None for none), since an
       answer is encoded whole.

    Returns the rows kept and whether the page was cut (by step 1, by step 2, or with a row
    read ahead): then more may follow its last row. ``([], False)`` when ``sizes`` is
    empty (``read`` is not called). A cut by the caller's row limit is the caller's to add."""
    n = page_rows_within(sizes)
    if n == 0:
        return [], False
    rows = read(n)
    kept = json_rows_within([text(r) for r in rows[:n]])
    return list(rows[:kept]), n < len(sizes) or kept < len(rows)


# consolidation jobs per page of GET /v1/stores/{store}/consolidations (``limit``)
JOBS_PAGE_DEFAULT, JOBS_PAGE_MAX = 100, 1000
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def sha256_hex(data: bytes) -> str:
    """Return the lowercase hex sha256 of ``data`` (the record ETag)."""
    return hashlib.sha256(data).hexdigest()


def datetime_ns(t: datetime) -> int:
    """An aware ``datetime`` as integer nanoseconds since the epoch (µs precision, exact).
    Raises ``TypeError`` for a naive one."""
    delta = t - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000_000 + delta.microseconds * 1_000


def mtime_effective_ns(mtime_ns: int | None, updated_at: datetime) -> int:
    """The mtime a record's file shows, in ns since the epoch: its explicit ``mtime_ns``,
    else ``updated_at``."""
    if mtime_ns is not None:
        return mtime_ns
    return datetime_ns(updated_at)


class Access(str, Enum):
    """How a workspace may use an attached store."""

    read_write = "read_write"
    read_only = "read_only"


class Operation(str, Enum):
    """What one version did to its record (docs/API.md)."""

    created = "created"
    modified = "modified"
    moved = "moved"
    deleted = "deleted"
    restored = "restored"


# byte units a size field takes: binary K / M / G (also KiB ...), decimal kB / MB / GB
_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 1000,
    "m": 1 << 20, "mib": 1 << 20, "mb": 1000**2,
    "g": 1 << 30, "gib": 1 << 30, "gb": 1000**3,
}
MAX_COUNT = (1 << 63) - 1  # the database keeps limits as 64-bit integers


def parse_byte_size(text: str) -> int:
    """A byte count as people write it: ``1048576``, ``512K``, ``1M``, ``1MiB``, ``2G``
    (binary), ``1MB`` (decimal), spaces allowed (``1 MiB``). Raises ``ValueError`` with a
    sentence for the user when it is not a positive size below 2**63 bytes. The CLI's
    ``--max-*-bytes`` options take the same forms."""
    raw = text.strip().replace(" ", "")
    num = raw.rstrip("kKmMgGiIbB")
    unit = raw[len(num):].lower()
    if not num:
        raise ValueError(f"{text.strip()!r} is not a byte size (e.g. 1048576, 512K, 1MiB)")
    if unit not in _BYTE_UNITS:
        raise ValueError(f"unknown unit in {text.strip()!r} (use K, M, G, KiB, MiB, GiB, kB, MB, GB)")
    if num.isascii() and num.isdigit():  # a whole number: exact (a float loses digits past 2**53)
        result = int(num) * _BYTE_UNITS[unit]
    else:
        try:
            n = float(num)
        except ValueError:
            raise ValueError(f"{text.strip()!r} is not a byte size (e.g. 1048576, 512K, 1MiB)") from None
        if not n == n or n in (float("inf"), float("-inf")):  # nan, inf
            raise ValueError(f"{text.strip()!r} is not a byte size (e.g. 1048576, 512K, 1MiB)")
        result = int(n * _BYTE_UNITS[unit])
    if result <= 0:
        raise ValueError(f"{text.strip()!r} must be at least 1 byte")
    if result > MAX_COUNT:
        raise ValueError(f"{text.strip()!r} is too large (at most {MAX_COUNT} bytes)")
    return result


def parse_count(text: str) -> int:
    """A positive whole number (``10000``, ``10_000`` or ``10,000``); ``ValueError`` with a
    sentence for the user otherwise."""
    raw = text.strip().replace(",", "").replace("_", "")
    digits = raw[1:] if raw[:1] in "+-" else raw
    if not digits.isascii() or not digits.isdigit():
        raise ValueError(f"{text.strip()!r} is not a whole number")
    n = int(raw)
    if n <= 0:
        raise ValueError("must be at least 1")
    if n > MAX_COUNT:
        raise ValueError(f"is too large (at most {MAX_COUNT})")
    return n


def one_line(text: object) -> str:
    """``text`` with every run of whitespace (newlines included) as one space, stripped (an
    error or a description on one line of the CLI's output)."""
    return " ".join(str(text).split())


#: A record's live content as SQL over the ``records`` table (unaliased): its stored content
#: plus what was appended since (``record_tails``, revision ``0018_record_tails``). The one
#: rule every reader of live content goes through (``memfuse.server.tails.LIVE_CONTENT``, and
#: the CLI's local reads); NULL when ``records.content`` is (a redacted deleted record). A
#: record without a tail is its stored content itself, not a copy concatenated with ``''``
#: (``||`` is NULL when its tail is: 0.03 s less SQLite CPU a 100,000-record snapshot,
#: bench/README.md "Sidecar memory, session 24").
LIVE_CONTENT_SQL = ("coalesce(records.content || (SELECT record_tails.tail FROM record_tails "
                    "WHERE record_tails.record_id = records.id), records.content)")
