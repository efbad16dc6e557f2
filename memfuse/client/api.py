"""The endpoints of the control-plane API v1 (docs/API.md): :class:`ApiClient`, one short
method per endpoint in the document's order (workspaces and feeds, records, admin), all on
:class:`~memfuse.client.base.ApiSession`'s ``_request`` / ``_call``.
"""
from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from ..defs import (
    ACCOUNT_HEADER,
    ACTOR_HEADER,
    FEED_PAGE_MAX,
    JOBS_PAGE_DEFAULT,
    RECORDS_PAGE_DEFAULT,
    RECORDS_PAGE_MAX,
    SEARCH_LINES_DEFAULT,
    SEARCH_PAGE_DEFAULT,
    SEQ_HEADER,
    VERSIONS_PAGE_DEFAULT,
    Access,
    prefix_move_timeout,
)
from ..errors import TransientError
from ..wire import (
    Attachment,
    BatchOperation,
    BatchRequest,
    BatchResponse,
    ChangePage,
    ConsolidationCreate,
    ConsolidationJob,
    EventPage,
    MemoryToolResult,
    MoveResult,
    PrefixMove,
    Record,
    SearchPage,
    IndexReport,
    RecordAttributes,
    RecordCreate,
    RecordMove,
    RecordPage,
    RecordUpdate,
    RecordAppend,
    Restore,
    Version,
    build,
    convert,
    to_jsonable,
)
from .admin import AdminEndpoints
from .base import (
    STREAM_READ_TIMEOUT,
    UNSET,
    _Unset,
    _attrs,
    _memory_tool_command,
    _seg,
    _seq_of,
    _bool,
    _num,
    _BATCH_ENDPOINTS,
    _JOBS,
    _ATTACHMENTS,
    _VERSIONS,
    _error_from,
    quote_etag,
    log,
)
from .stream import PageStream


class ApiClient(AdminEndpoints):
    """Async client of the control-plane API v1.

    Args:
        base_url: the control plane's root URL, e.g. ``http://127.0.0.1:8080`` (no ``/v1``).
        token: bearer token (workspace-scoped or admin); ``None`` sends no ``Authorization``.
            A :class:`~memfuse.tokenfile.TokenFile` is read on every request, and refreshed
            (``stat``, re-read if changed) on every 401: when that yields a different token,
            the request is sent once more with it (nothing was applied: a 401 is answered
            before anything is done, and writes carry their idempotency key anyway).
        transport: an httpx transport (``httpx.ASGITransport`` for in-process use, the fake's
            fault-injecting transport in tests); default: real network.
        instance: sidecar id sent as ``X-Memfuse-Instance`` (recorded in version actors).
        timeout: seconds for connect, read, write and pool waits of ordinary calls. Long-poll
            calls (``wait > 0``) get a read timeout of ``wait + timeout``.
        lean: send ordinary requests without query parameters (the sidecar's commits: one
            small request per ``close(2)``) through :class:`~memfuse.client.lean.LeanHTTP`
            (pooled HTTP/1.1 framed by h11, ~5x less client CPU than httpx per request),
            unless ``transport`` is given or a proxy is configured in the environment;
            answers and errors are the same. Default False (httpx for everything).
        bounded: give every request a total deadline, not only a timeout per read
            (:mod:`~memfuse.client.deadline`: the answer's head within ``timeout`` s, plus
            ``wait`` for a long poll; its body at 64 KiB/s at least after that; a stream's
            head, then each of its lines within its read timeout at the same rate). A request past it raises :class:`TransientError` ``read_timeout``.
            Needs trio (the sidecar passes it); default False. Lean requests always have it.

    Use as ``async with ApiClient(...) as api:`` or call :meth:`aclose`. Every method raises
    :class:`TransientError` or :class:`PermanentError` (see the module docstring); none retries
    (except the one resend with a refreshed token file above).

    Authentication state: :attr:`auth_failure` is ``None`` while the token works, else the
    problem detail of the last 401 answered to the token in use, until any other answer
    arrives; :attr:`auth_failures` counts 401 answers; ``auth_listener(ok)`` (if set) is called
    with ``False`` on each such 401 and with ``True`` when an answer ends a failure.
    """

    async def list_attachments(self, ws: str) -> list[Attachment]:
        """``GET /v1/workspaces/{ws}/attachments``: the stores attached to ``ws``, sorted by
        slug. Raises NotFound (``workspace_not_found``), Forbidden for another workspace.
        Keeps the answer's ``Memfuse-Actor`` (the actor of this client's writes) in
        :attr:`actor` and its ``Memfuse-Account`` (the workspace's account) in
        :attr:`account`."""
        path = f"/v1/workspaces/{_seg(ws)}/attachments"
        resp = await self._request("GET", path)
        atts = self._parse(_ATTACHMENTS, resp, "GET", path)
        told = resp.headers.get(ACTOR_HEADER)
        if told:
            self.actor = told
        self.account = resp.headers.get(ACCOUNT_HEADER) or self.account
        return atts

    async def workspace_events(self, ws: str, after: int = 0, wait: float = 0) -> EventPage:
        """``GET /v1/workspaces/{ws}/events``: attach / detach / store_changed events with
        seq > ``after``; long-polls up to ``wait`` seconds (0–60) while there are none.
        Resume with ``after=page.seq``."""
        return await self._call(
            EventPage,
            "GET",
            f"/v1/workspaces/{_seg(ws)}/events",
            params={"after": after, "wait": _num(wait)},
            wait=wait,
        )

    def events_stream(self, ws: str, after: int,
                      read_timeout: float = STREAM_READ_TIMEOUT) -> PageStream[EventPage]:
        """``GET /v1/workspaces/{ws}/events?stream=true``: the event pages as they come, and
        heartbeats; everything else as ``changes_stream`` (403 / 404 instead of 410)."""
        return PageStream(self, EventPage, f"/v1/workspaces/{_seg(ws)}/events",
                          {"after": after, "stream": "true"}, read_timeout)

    async def context(self, ws: str, mount_root: str | None = None,
                      max_bytes: int | None = None, mounted: bool = True) -> str:
        """``GET /v1/workspaces/{ws}/context``: the Markdown prompt block (docs/API.md, "Prompt block") as text.
        ``mount_root`` is where the sidecar mounts the stores (server default
        ``/mnt/memory``); ``mounted=False`` for an agent without a mount (no line on the
        mount's ``.memfuse/errors.log``)."""
        params: dict[str, Any] = {}
        if not mounted:
            params["mounted"] = "false"
        if mount_root is not None:
            params["mount_root"] = mount_root
        if max_bytes is not None:
            params["max_bytes"] = max_bytes
        resp = await self._request(
            "GET",
            f"/v1/workspaces/{_seg(ws)}/context",
            params=params or None,
            accept="text/markdown, text/plain, */*",
        )
        return resp.text

    async def index_report(self, store: str) -> IndexReport:
        """``GET /v1/stores/{store}/index``: how the store's ``MEMORY.md`` and its records
        agree (docs/API.md, "Index report"). Raises :class:`~memfuse.errors.ApiError`."""
        return await self._call(IndexReport, "GET", f"/v1/stores/{_seg(store)}/index")

    async def create_consolidation(self, store: str, instructions: str, output: str = "new_store",
                                   model: str | None = None, include_history: bool = False) -> ConsolidationJob:
        """``POST /v1/stores/{store}/consolidations``: start a consolidation job (docs/API.md,
        "Consolidation jobs"); the job comes back ``pending``. Raises Conflict
        (``job_running``, ``consolidation_disabled``, ``review_pending``: a workspace's outputs
        wait for review), TransientError (429 ``rate_limited``: a workspace's jobs per hour,
        ``retry_after``), NotFound, Forbidden, PermanentError (413 ``input_too_large``);
        ``ValueError`` before any request for a bad body."""
        body = build(ConsolidationCreate, instructions=instructions, output=output, model=model,
                     include_history=include_history)
        return await self._call(ConsolidationJob, "POST", f"/v1/stores/{_seg(store)}/consolidations", body=body)

    async def get_consolidation(self, job_id: str) -> ConsolidationJob:
        """``GET /v1/consolidations/{id}``. Raises NotFound (``job_not_found``)."""
        return await self._call(ConsolidationJob, "GET", f"/v1/consolidations/{_seg(job_id)}")

    async def list_consolidations(self, store: str, limit: int = JOBS_PAGE_DEFAULT) -> list[ConsolidationJob]:
        """``GET /v1/stores/{store}/consolidations``: the store's jobs, newest first."""
        return await self._call(_JOBS, "GET", f"/v1/stores/{_seg(store)}/consolidations", params={"limit": limit})

    async def cancel_consolidation(self, job_id: str) -> ConsolidationJob:
        """``POST /v1/consolidations/{id}/cancel``. Raises NotFound, Conflict (``job_finished``)."""
        return await self._call(ConsolidationJob, "POST", f"/v1/consolidations/{_seg(job_id)}/cancel")

    async def memory_tool(self, ws: str, command: dict[str, Any]) -> MemoryToolResult:
        """``POST /v1/workspaces/{ws}/memory-tool``: run one memory-tool command (the model's
        ``tool_use.input`` as is) on the workspace's stores. A refused command is a result
        with ``is_error`` true, not an exception; raises for auth and transport problems."""
        return await self._call(
            MemoryToolResult, "POST", f"/v1/workspaces/{_seg(ws)}/memory-tool",
            body=_memory_tool_command(command),
        )

    async def search(
        self,
        store: str,
        q: str,
        *,
        match: str = "any",
        prefix: str = "",
        type: str | None = None,
        case_sensitive: bool = False,
        cursor: str | None = None,
        limit: int = SEARCH_PAGE_DEFAULT,
        max_lines: int = SEARCH_LINES_DEFAULT,
        order: str = "path",
    ) -> SearchPage:
        """``GET /v1/stores/{store}/search``: one page of the live records whose path
        (``match="path"``), content (``"content"``) or either (``"any"``) hold ``q``
        (literal, one line, 1–256 characters), in path order, each with its first
        ``max_lines`` matching lines (docs/API.md, "Search"). ``prefix`` limits it to a file
        or directory; ``limit`` 1–100 records a page; follow ``next_cursor``. ``order=
        "relevance"``: ranked by the full-text index instead, best first, with ``score`` and
        ``snippet`` per hit. Raises :class:`~memfuse.errors.ApiError` (422 ``invalid_query``
        and friends for bad input)."""
        params: dict[str, Any] = {"q": q, "match": match, "limit": limit, "max_lines": max_lines,
                                  "case_sensitive": _bool(case_sensitive)}
        if order != "path":
            params["order"] = order
        if prefix:
            params["prefix"] = prefix
        if type is not None:
            params["type"] = type
        if cursor is not None:
            params["cursor"] = cursor
        return await self._call(SearchPage, "GET", f"/v1/stores/{_seg(store)}/search", params=params)

    # ------------------------------------------------------------ records: reading

    async def list_records(
        self,
        store: str,
        cursor: str | None = None,
        limit: int = RECORDS_PAGE_DEFAULT,
        content: bool = False,
        path: str | None = None,
        include_deleted: bool = False,
    ) -> RecordPage:
        """``GET /v1/stores/{store}/records``: one snapshot page of live records ordered by path
        (plus deleted ones with ``include_deleted``). ``limit`` 1–1000; ``path`` filters on an
        exact path; ``page.seq`` is the change-feed position read before the page;
        ``page.next_cursor`` is None on the last page."""
        params: dict[str, Any] = {"limit": limit, "content": _bool(content)}
        if cursor is not None:
            params["cursor"] = cursor
        if path is not None:
            params["path"] = path
        if include_deleted:
            params["include_deleted"] = "true"
        return await self._call(RecordPage, "GET", f"/v1/stores/{_seg(store)}/records", params=params)

    async def iter_pages(
        self, store: str, *, content: bool = True, limit: int = RECORDS_PAGE_DEFAULT, include_deleted: bool = False
    ) -> AsyncIterator[RecordPage]:
        """Async generator over every snapshot page of ``store`` (``list_records`` pages of
        ``limit`` records, deleted ones too with ``include_deleted``), following
        ``next_cursor``: the one paging loop of the client and its callers.

        The first page's ``seq`` is where to resume the change feed (``changes(after=seq)``);
        applying a change the snapshot already contains is harmless. Raises what
        ``list_records`` raises (:class:`~memfuse.errors.ApiError`); no retries.
        """
        cursor: str | None = None
        while True:
            page = await self.list_records(
                store, cursor=cursor, limit=limit, content=content, include_deleted=include_deleted
            )
            yield page
            if not page.next_cursor:
                return
            cursor = page.next_cursor

    async def snapshot(
        self, store: str, *, content: bool = True, limit: int = RECORDS_PAGE_DEFAULT, include_deleted: bool = False
    ) -> tuple[list[Record], int]:
        """Every live record of ``store`` (all pages of ``iter_pages``; deleted ones too with
        ``include_deleted``) and the change-feed seq to resume from (the first page's
        ``seq``). Returns ``(records ordered by (path, id), seq)``."""
        records: list[Record] = []
        seq: int | None = None
        async for page in self.iter_pages(store, content=content, limit=limit, include_deleted=include_deleted):
            if seq is None:
                seq = page.seq
            records.extend(page.records)
        assert seq is not None
        return records, seq

    async def find_record(self, store: str, path: str, include_deleted: bool = False) -> Record | None:
        """The record at ``path`` (exact, via the ``path=`` filter), or ``None``.

        With ``include_deleted`` a deleted record may be returned; when several records had
        that path (deleted, then created anew), the live one wins, else the most recently
        updated deleted one. Content is not included.
        """
        page = await self.list_records(store, limit=RECORDS_PAGE_MAX, path=path, include_deleted=include_deleted)
        found = [r for r in page.records if r.path == path]
        if not found:
            return None
        live = [r for r in found if not r.deleted]
        if live:
            return live[0]
        return max(found, key=lambda r: (r.updated_at, r.seq))

    async def get_record(self, store: str, id: str, content: bool = True) -> Record:
        """``GET /v1/stores/{store}/records/{id}``: the record (deleted ones have
        ``deleted=True``). Raises NotFound (``record_not_found``)."""
        return await self._call(
            Record,
            "GET",
            f"/v1/stores/{_seg(store)}/records/{_seg(id)}",
            params={"content": _bool(content)},
        )

    async def changes(
        self,
        store: str,
        after: int,
        wait: float = 0,
        content: bool = True,
        limit: int = FEED_PAGE_MAX,
        skip_actor: str | None = None,
        skip_writer: str | None = None,
    ) -> ChangePage:
        """``GET /v1/stores/{store}/changes``: versions with seq > ``after``, oldest first;
        long-polls up to ``wait`` s (0–60) while empty. Resume with ``after=page.seq``.
        ``skip_actor``: leave out versions whose actor is exactly this (a sidecar's own
        writes, ``ws:<workspace>/<instance>``); ``page.seq`` still moves past them, so a page
        may be empty with a new ``seq``, and the long-poll keeps waiting while only such
        versions arrive. ``skip_writer``: leave out instead the versions written with
        ``Memfuse-Writer`` exactly this (one sidecar's own writes: ``set_writer``; another
        sidecar of the same actor's are kept); a control plane without it keeps to
        ``skip_actor``.
        Raises Gone (410 ``cursor_expired``) when ``after`` is unknown → take a snapshot."""
        params: dict[str, Any] = {"after": after, "wait": _num(wait), "content": _bool(content), "limit": limit}
        if skip_actor:
            params["skip_actor"] = skip_actor
        if skip_writer:
            params["skip_writer"] = skip_writer
        return await self._call(
            ChangePage,
            "GET",
            f"/v1/stores/{_seg(store)}/changes",
            params=params,
            wait=wait,
        )

    def changes_stream(
        self,
        store: str,
        after: int,
        content: bool = True,
        limit: int = FEED_PAGE_MAX,
        skip_actor: str | None = None,
        read_timeout: float = STREAM_READ_TIMEOUT,
        skip_writer: str | None = None,
    ) -> PageStream[ChangePage]:
        """``GET /v1/stores/{store}/changes?stream=true`` (docs/API.md, "Streams"): an async
        iterator of the pages ``changes`` would answer, each as soon as the server has it, and
        heartbeat pages (no changes, the current ``seq``) while nothing happens. Resume with
        ``after=page.seq`` of the last page seen. Iteration ends when the server ends the
        stream (its lifetime, its shutdown): open a new one from the cursor.

        A server that does not stream answers one ordinary page: it is yielded, iteration
        ends and ``streaming`` is False (so is a 400, or a 404 / 405 naming no resource, for
        the parameter, with nothing yielded): long-poll instead. Raises what ``changes``
        raises (Gone → snapshot), also mid-stream (the server's error line), and
        ``TransientError`` ``read_timeout`` when no line arrived for ``read_timeout`` s (a
        dead connection; the server sends one at least every 20 s). Use as ``async with
        aclosing(stream)`` or call ``aclose``."""
        params: dict[str, Any] = {"after": after, "stream": "true", "content": _bool(content), "limit": limit}
        if skip_actor:
            params["skip_actor"] = skip_actor
        if skip_writer:
            params["skip_writer"] = skip_writer
        return PageStream(self, ChangePage, f"/v1/stores/{_seg(store)}/changes", params, read_timeout)

    async def versions_page(
        self, store: str, id: str, *, cursor: int | None = None, limit: int = VERSIONS_PAGE_DEFAULT,
        newest_first: bool = False,
    ) -> tuple[list[Version], int | None]:
        """``GET .../records/{id}/versions``: one page of the record's versions without
        content, oldest first after version ``cursor`` (or ``newest_first``: newest first
        before it); ``limit`` 1–1000 (the server may answer fewer: its pages are also bounded
        in bytes). Returns the versions and the next page's ``cursor`` (from the answer's
        ``Link: <…>; rel="next"``), None on the last page (and from a server that does not
        page). Raises NotFound (``record_not_found``, ``store_not_found``)."""
        params: dict[str, Any] = {"limit": limit}
        if newest_first:
            params["order"] = "desc"
        if cursor is not None:
            params["cursor"] = cursor
        path = f"/v1/stores/{_seg(store)}/records/{_seg(id)}/versions"
        resp = await self._request("GET", path, params=params)
        page = self._parse(_VERSIONS, resp, "GET", path)
        link = resp.links.get("next", {}).get("url")
        if link is None:
            return page, None
        nxt = resp.url.join(link).params.get("cursor", "")
        if not (nxt.isascii() and nxt.isdigit()):
            raise TransientError(f"GET {path}: the next page's link has no cursor", status=resp.status_code,
                                 code="bad_response", method="GET", path=path)
        return page, int(nxt)

    async def iter_versions(
        self, store: str, id: str, *, newest_first: bool = False, limit: int = VERSIONS_PAGE_DEFAULT,
    ) -> AsyncGenerator[Version, None]:
        """Async generator over every version of the record without content (oldest first, or
        newest first), page after page (``versions_page``, following its cursor): stop
        iterating to read no more pages. Raises what ``versions_page`` raises; no retries."""
        cursor: int | None = None
        while True:
            page, cursor = await self.versions_page(store, id, cursor=cursor, limit=limit, newest_first=newest_first)
            for v in page:
                yield v
            if cursor is None:
                return

    async def versions(self, store: str, id: str) -> list[Version]:
        """Every version of the record without content, oldest first (all the pages of
        ``GET .../records/{id}/versions``: a record may have many; ``iter_versions`` reads
        them a page at a time)."""
        return [v async for v in self.iter_versions(store, id)]

    async def version(self, store: str, id: str, n: int) -> Version:
        """``GET .../records/{id}/versions/{n}``: version ``n`` with content (``None`` when
        redacted). Raises NotFound (``version_not_found``)."""
        return await self._call(
            Version, "GET", f"/v1/stores/{_seg(store)}/records/{_seg(id)}/versions/{int(n)}"
        )

    # ------------------------------------------------------------ records: writing

    async def create_record(
        self,
        store: str,
        path: str,
        content: str,
        type: str | None = None,
        idempotency_key: str | None = None,
        *,
        mode: int | None = None,
        mtime_ns: int | None = None,
    ) -> Record:
        """``POST /v1/stores/{store}/records``: create a record; returns it without content
        (its ``sha256`` is the ETag). ``mode``: permission bits (None: 0o644); ``mtime_ns``:
        an explicit modification time in ns since the epoch (None: ``updated_at``). Raises
        Conflict (``path_exists``, see ``.record_id``), PermanentError 413
        (``record_too_large``) / 422 (``invalid_path``, ``invalid_type``,
        ``secret_detected``, ...), StoreFull (507)."""
        return await self._call(
            Record,
            "POST",
            f"/v1/stores/{_seg(store)}/records",
            body=build(RecordCreate, path=path, content=content, type=type, **_attrs(mode, mtime_ns)),
            idempotency_key=idempotency_key,
        )

    async def update_record(
        self,
        store: str,
        id: str,
        content: str,
        type: str | None = None,
        if_match: str | None = None,
        idempotency_key: str | None = None,
        *,
        mode: int | None = None,
        mtime_ns: int | None = None,
        overwrite: bool | None = None,
        overwrite_base: str | None = None,
    ) -> Record:
        """``PUT /v1/stores/{store}/records/{id}``: new content (and type, attributes).
        ``if_match`` is the base sha256 (quoted for you). ``mode`` None keeps the permission
        bits; ``mtime_ns`` None keeps an explicit mtime when the content is the same and
        clears it when it changes. ``overwrite`` True: the write is sent by last writer wins over
        a concurrent change (the version it replaces is recorded as overwritten, and its
        writer told through the change feed: ``Change.overwrote``); ``overwrite_base``: the
        sha256 the write was made on, so that every writer of a version after it is told
        too (``Change.overwrote.also``). Identical content, type
        and attributes make no new version. Raises PreconditionFailed (see
        ``.current_sha256``), NotFound for a deleted record."""
        more: dict[str, Any] = {"overwrite": True} if overwrite else {}
        if overwrite and overwrite_base:
            more["overwrite_base"] = overwrite_base
        return await self._call(
            Record,
            "PUT",
            f"/v1/stores/{_seg(store)}/records/{_seg(id)}",
            body=build(RecordUpdate, content=content, type=type, **_attrs(mode, mtime_ns), **more),
            if_match=if_match,
            idempotency_key=idempotency_key,
        )

    async def append_record(
        self,
        store: str,
        id: str,
        suffix: str,
        if_match: str,
        type: str | None = None,
        idempotency_key: str | None = None,
        *,
        mode: int | None = None,
        mtime_ns: int | None = None,
    ) -> Record:
        """``POST /v1/stores/{store}/records/{id}/append``: the record's content becomes its
        current content plus ``suffix``, sent as only the suffix. ``if_match`` (required) is
        the sha256 of the version ``suffix`` extends. Answers and raises as
        ``update_record`` (PreconditionFailed when the record changed since)."""
        return await self._call(
            Record,
            "POST",
            f"/v1/stores/{_seg(store)}/records/{_seg(id)}/append",
            body=build(RecordAppend, append=suffix, type=type, **_attrs(mode, mtime_ns)),
            if_match=if_match,
            idempotency_key=idempotency_key,
        )

    async def set_attributes(
        self,
        store: str,
        id: str,
        *,
        mode: int | None | _Unset = UNSET,
        mtime_ns: int | None | _Unset = UNSET,
        if_match: str | None = None,
        idempotency_key: str | None = None,
    ) -> Record:
        """``PATCH /v1/stores/{store}/records/{id}``: change only the record's attributes
        (no content is sent). ``mode``: permission bits (``& 0o7777``), ``None`` resets to
        0o644; ``mtime_ns``: modification time in ns since the epoch, ``None`` clears it (the
        record then shows ``updated_at``); a member not passed is kept. A change makes a
        ``modified`` version with the same sha256; no change makes none. Raises NotFound for
        a missing or deleted record, PreconditionFailed when ``if_match`` is not the current
        sha256; ``ValueError`` (``msgspec.ValidationError``) for a mode or time out of range,
        before anything is sent."""
        given: dict[str, int | None] = {}
        if not isinstance(mode, _Unset):
            given["mode"] = mode
        if not isinstance(mtime_ns, _Unset):
            given["mtime_ns"] = mtime_ns
        return await self._call(
            Record,
            "PATCH",
            f"/v1/stores/{_seg(store)}/records/{_seg(id)}",
            body=build(RecordAttributes, **given),
            if_match=if_match,
            idempotency_key=idempotency_key,
        )

    async def move_record(
        self,
        store: str,
        id: str,
        path: str,
        replace: bool = False,
        if_match: str | None = None,
        idempotency_key: str | None = None,
    ) -> MoveResult:
        """``POST .../records/{id}/move``: move one record to ``path``; with ``replace`` an
        existing target keeps its id and gets this content. Returns the one resulting record.
        Raises Conflict (``path_exists``) when the target is taken and not ``replace``."""
        return await self._call(
            MoveResult,
            "POST",
            f"/v1/stores/{_seg(store)}/records/{_seg(id)}/move",
            body=build(RecordMove, path=path, replace=replace),
            if_match=if_match,
            idempotency_key=idempotency_key,
        )

    async def move_prefix(
        self, store: str, from_prefix: str, to_prefix: str, idempotency_key: str | None = None
    ) -> MoveResult:
        """``POST /v1/stores/{store}/move``: move every record under ``from_prefix/`` to
        ``to_prefix/`` in one transaction; returns every moved record. Raises Conflict
        (``path_exists``), PermanentError 422 (``invalid_path``)."""
        return await self._call(
            MoveResult,
            "POST",
            f"/v1/stores/{_seg(store)}/move",
            body=build(PrefixMove, from_prefix=from_prefix, to_prefix=to_prefix),
            idempotency_key=idempotency_key,
            # what the largest move allowed may take (attack 12 A4: a 30 s read timeout sent
            # a 10,000-record move again while the server was applying it); a request with
            # its own read timeout is no liveness probe (``no_answer_for``)
            read_timeout=prefix_move_timeout(self.timeout),
        )

    async def delete_record(
        self, store: str, id: str, if_match: str | None = None, idempotency_key: str | None = None
    ) -> int | None:
        """``DELETE /v1/stores/{store}/records/{id}``: delete (a ``deleted`` version is kept).
        Returns the change-feed seq of the ``deleted`` version (``Memfuse-Seq``), None from a
        control plane that does not tell it. Raises NotFound when already deleted,
        PreconditionFailed on ``if_match`` mismatch."""
        resp = await self._request(
            "DELETE",
            f"/v1/stores/{_seg(store)}/records/{_seg(id)}",
            if_match=if_match,
            idempotency_key=idempotency_key,
        )
        return _seq_of(resp.headers.get(SEQ_HEADER))

    # ------------------------------------------------------------ records: batches
    # Each builder gives the operation exactly as the single method above sends it (same
    # body, same If-Match, same key), so a key first sent alone and then inside a batch (or
    # the other way round) is the same request to the server.

    @staticmethod
    def batch_create(path: str, content: str, type: str | None = None, idempotency_key: str | None = None,
                     *, mode: int | None = None, mtime_ns: int | None = None) -> BatchOperation:
        """The ``create_record`` operation of a batch."""
        body = build(RecordCreate, path=path, content=content, type=type, **_attrs(mode, mtime_ns))
        return build(BatchOperation, op="create", idempotency_key=idempotency_key, body=to_jsonable(body))

    @staticmethod
    def batch_update(id: str, content: str, type: str | None = None, if_match: str | None = None,
                     idempotency_key: str | None = None, *, mode: int | None = None,
                     mtime_ns: int | None = None) -> BatchOperation:
        """The ``update_record`` operation of a batch."""
        body = build(RecordUpdate, content=content, type=type, **_attrs(mode, mtime_ns))
        return build(BatchOperation, op="update", record_id=id, idempotency_key=idempotency_key,
                     if_match=quote_etag(if_match) if if_match is not None else None,
                     body=to_jsonable(body))

    @staticmethod
    def batch_append(id: str, suffix: str, if_match: str, type: str | None = None,
                     idempotency_key: str | None = None, *, mode: int | None = None,
                     mtime_ns: int | None = None) -> BatchOperation:
        """The ``append_record`` operation of a batch."""
        body = build(RecordAppend, append=suffix, type=type, **_attrs(mode, mtime_ns))
        return build(BatchOperation, op="append", record_id=id, idempotency_key=idempotency_key,
                     if_match=quote_etag(if_match), body=to_jsonable(body))

    @staticmethod
    def batch_attrs(id: str, *, mode: int | None | _Unset = UNSET, mtime_ns: int | None | _Unset = UNSET,
                    if_match: str | None = None, idempotency_key: str | None = None) -> BatchOperation:
        """The ``set_attributes`` operation of a batch."""
        given: dict[str, int | None] = {}
        if not isinstance(mode, _Unset):
            given["mode"] = mode
        if not isinstance(mtime_ns, _Unset):
            given["mtime_ns"] = mtime_ns
        body = build(RecordAttributes, **given)
        return build(BatchOperation, op="attrs", record_id=id, idempotency_key=idempotency_key,
                     if_match=quote_etag(if_match) if if_match is not None else None,
                     body=to_jsonable(body))

    @staticmethod
    def batch_move(id: str, path: str, replace: bool = False, if_match: str | None = None,
                   idempotency_key: str | None = None) -> BatchOperation:
        """The ``move_record`` operation of a batch."""
        return build(BatchOperation, op="move", record_id=id, idempotency_key=idempotency_key,
                     if_match=quote_etag(if_match) if if_match is not None else None,
                     body=to_jsonable(build(RecordMove, path=path, replace=replace)))

    @staticmethod
    def batch_delete(id: str, if_match: str | None = None, idempotency_key: str | None = None) -> BatchOperation:
        """The ``delete_record`` operation of a batch."""
        return build(BatchOperation, op="delete", record_id=id, idempotency_key=idempotency_key,
                     if_match=quote_etag(if_match) if if_match is not None else None)

    async def batch(self, store: str, operations: list[BatchOperation]) -> list[Any]:
        """``POST /v1/stores/{store}/batch``: apply ``operations`` (at most
        ``BATCH_MAX_OPERATIONS``, built with the ``batch_*`` builders) in order in one
        transaction. Returns one outcome per operation, in order: what its single method would
        have returned (``Record`` for create / update / attrs, ``MoveResult`` for move, the
        ``deleted`` version's seq or None for delete), or the ``ApiError`` it would have raised (not raised here: a refused
        operation leaves nothing, the others are applied).

        Raises for the batch as a whole (nothing applied): ``TransientError`` (retry the same
        operations: their keys replay what was applied), ``Unauthorized``, ``Forbidden``,
        ``NotFound`` (the store, or a server without the endpoint: ``code`` ``not_found``;
        also ``PermanentError`` 405), ``PermanentError`` 413 ``batch_too_large``."""
        path = f"/v1/stores/{_seg(store)}/batch"
        # BatchOperation leaves out its None members (pydantic's exclude_none of earlier releases)
        page = await self._call(BatchResponse, "POST", path, body=BatchRequest(operations=operations))
        if len(page.results) != len(operations):
            raise TransientError(f"POST {path}: {len(page.results)} answers for {len(operations)} operations",
                                 code="bad_response", method="POST", path=path)
        out: list[Any] = []
        for op, res in zip(operations, page.results):
            method, one = _BATCH_ENDPOINTS[op.op]
            one_path = one.format(store=_seg(store), id=_seg(op.record_id or ""))
            if res.status >= 300:
                out.append(_error_from(res.status, res.body or {}, None, None, method, one_path))
                continue
            try:
                if op.op == "move":
                    out.append(convert(res.body, MoveResult))
                elif op.op == "delete":
                    out.append(res.seq)
                else:
                    out.append(convert(res.body, Record))
            except ValueError:  # msgspec.ValidationError
                raise TransientError(f"POST {path}: an answer does not match the API contract",
                                     code="bad_response", method="POST", path=path) from None
        return out

    async def restore(
        self, store: str, id: str, version: int, idempotency_key: str | None = None
    ) -> Record:
        """``POST .../records/{id}/restore``: a ``restored`` version with version ``version``'s
        content, type and path (undeletes). Raises Conflict (``path_exists``, ``redacted``)."""
        return await self._call(
            Record,
            "POST",
            f"/v1/stores/{_seg(store)}/records/{_seg(id)}/restore",
            body=build(Restore, version=version),
            idempotency_key=idempotency_key,
        )

    async def redact(
        self, store: str, id: str, n: int, idempotency_key: str | None = None
    ) -> Version:
        """``POST .../records/{id}/versions/{n}/redact`` (admin): remove version ``n``'s content.
        Raises Conflict (``current_version``), Forbidden for non-admin tokens."""
        return await self._call(
            Version,
            "POST",
            f"/v1/stores/{_seg(store)}/records/{_seg(id)}/versions/{int(n)}/redact",
            idempotency_key=idempotency_key,
        )
