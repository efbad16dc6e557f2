"""The console's record pages and actions (one handler each, called through ``web.view``
with a ``Ctx``): a record with its history, diffs, consolidations, the editor (with the stale
edit form after a 412), new records, the store's ``MEMORY.md`` settings, restore, delete and
redact.
"""
from __future__ import annotations

import json
import logging
from typing import Any

from starlette.responses import Response

from memfuse.content import INDEX_PATH, RECORD_TYPES, ContentError, is_index
from memfuse.defs import INT64_MAX
from memfuse.models import Record, RecordCreate, RecordUpdate, Restore
from memfuse.server.console import render
from memfuse.server.console.forms import field_text, newline_style, with_newlines
from memfuse.server.console.pages import can_write, Ctx, redirect_to, render_page, store_ref
from memfuse.server.service import ServiceError

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- records


def _store_seq(ctx: Ctx, slug: str) -> int:
    """The store's change-feed position now (where a page's live updates start)."""
    return ctx.svc.list_records(ctx.principal, slug, limit=1).seq


HISTORY_ROWS = 50  # versions a record page lists (the newest, or those before ``?before=N``)


def _version_query(ctx: Ctx, name: str) -> int | None:
    """Query parameter ``name`` as a version number (1 to 2**63 - 1), None when absent; 400
    ``validation_error`` for anything else."""
    raw = ctx.q(name)
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit() and 1 <= int(raw) <= INT64_MAX):
        raise ServiceError(400, "validation_error", f"{name} must be a version number")
    return int(raw)


def record_page(ctx: Ctx) -> Response:
    """GET ``/stores/{store}/records/{id}[?version=N][&before=M]``: content (Markdown
    rendered safely), type, path, history with restore / redact, a diff form, edit and
    delete. The history lists the newest ``HISTORY_ROWS`` versions (those before ``M`` with
    ``before``), then an "Older versions" link to the next ones."""
    slug, rid = ctx.path("store"), ctx.path("rid")
    seq = _store_seq(ctx, slug)  # before the reads: a change after them reaches the page
    before = _version_query(ctx, "before")
    rec = ctx.svc.get_record(ctx.principal, slug, rid, with_content=True)
    history = ctx.svc.list_versions(ctx.principal, slug, rid, limit=HISTORY_ROWS, cursor=before, newest_first=True)
    shown = None
    if ctx.q("version"):
        try:
            n = int(ctx.q("version"))
        except ValueError:
            raise ServiceError(404, "version_not_found", "no such version") from None
        shown = ctx.svc.get_version(ctx.principal, slug, rid, n)
    if shown is not None:
        text, path = shown.content, shown.path
    else:
        text, path = rec.content, rec.path
    rendered = render.render_content(path, text) if text is not None else None
    return render_page(
        ctx, "record.html", current_store=slug, rec=rec, versions=history.versions, shown=shown,
        rendered=rendered, can_write=can_write(ctx, slug), is_index=is_index(rec.path),
        diff_a=max(1, rec.version - 1), diff_b=rec.version, older=history.next_cursor, paged=before is not None,
        live_url=ctx.url("stores", slug, "live", after=seq),
    )


def diff_page(ctx: Ctx) -> Response:
    """GET ``/stores/{store}/records/{id}/diff?a=N&b=M[&view=split]``: the diff of two
    versions with line numbers and changed words marked, unified (default) or side by side."""
    slug, rid = ctx.path("store"), ctx.path("rid")
    rec = ctx.svc.get_record(ctx.principal, slug, rid, with_content=False)
    try:
        a, b = int(ctx.q("a")), int(ctx.q("b"))
    except ValueError:
        raise ServiceError(400, "validation_error", "choose two versions to compare") from None
    view = "split" if ctx.q("view") == "split" else "unified"
    va = ctx.svc.get_version(ctx.principal, slug, rid, a)
    vb = ctx.svc.get_version(ctx.principal, slug, rid, b)
    d = None
    redacted = [v.version for v in (va, vb) if v.content is None]
    if not redacted:
        d = render.line_diff(va.content or "", vb.content or "")
    return render_page(ctx, "diff.html", current_store=slug, rec=rec, va=va, vb=vb, d=d, view=view, redacted=redacted)


def consolidations_page(ctx: Ctx) -> Response:
    """GET ``/stores/{store}/consolidations``: the store's consolidation jobs, newest first
    (docs/API.md "Consolidation jobs")."""
    slug = ctx.path("store")
    store = ctx.svc.get_store(ctx.principal, slug)
    jobs = ctx.svc.list_consolidations(ctx.principal, slug)
    return render_page(ctx, "consolidations.html", current_store=slug, store=store, jobs=jobs)


def consolidation_page(ctx: Ctx) -> Response:
    """GET ``/consolidations/{job}``: one job, and for a completed one the diff of each file
    it wrote or deleted against the input it read (unified; the history diff's rendering).
    Everything from the store or the model is untrusted text, escaped by the template."""
    p = ctx.principal
    job, changes = ctx.svc.consolidation_diff(p, ctx.path("job"))
    files = []
    for c in changes:
        d = None if c["gone"] else render.line_diff(c["old"] or "", c["new"] or "")
        files.append({**c, "diff": d})
    # the root admin over every account links the job's stores by reference (their account)
    account = ctx.svc.consolidation_account(p, job.id) if p.is_root else None
    return render_page(ctx, "consolidation.html", current_store=store_ref(p, job.store, account), job=job,
                       files=files, job_account=account)


def _type_choice(ctx: Ctx, required: bool) -> tuple[str | None, str | None]:
    """The ``type`` field: (type or None, error)."""
    t = ctx.form.get("type", "").strip()
    if not t:
        return None, ("Choose a type." if required else None)
    if t not in RECORD_TYPES:
        return None, f"type {t!r} is not one of {', '.join(RECORD_TYPES)}"
    return t, None


_FIELD_OF = {  # problem code → the form field its reason is shown next to
    "invalid_path": "path", "path_too_long": "path", "path_exists": "path",
    "invalid_type": "type",
}


def _edit_form(ctx: Ctx, slug: str, *, rec: Record | None = None, status: int = 200, content: str | None = None,
               errors: dict[str, str] | None = None, stale: dict[str, Any] | None = None,
               settings: bool = False, values: dict[str, str] | None = None) -> Response:
    # The notice watches for a change of the record after the version the form is based on.
    return render_page(
        ctx, "edit.html", status=status, current_store=slug, rec=rec, settings=settings,
        content=content if content is not None else (rec.content if rec is not None else ""),
        errors=errors or {}, stale=stale, values=values or {},
        is_index=rec is not None and is_index(rec.path), live_mode="notice",
        live_url=ctx.url("stores", slug, "live", after=rec.seq, record=rec.id) if rec is not None else None,
    )


def _write_error(err: ServiceError) -> tuple[str, str] | None:
    """(field, reason) for a refusal of the content the person typed, else None."""
    if err.code in _FIELD_OF:
        return _FIELD_OF[err.code], err.detail
    if err.code in ("invalid_content", "secret_detected", "record_too_large", "store_full"):
        return "content", err.detail
    return None


def edit_page(ctx: Ctx) -> Response:
    """GET/POST ``/stores/{store}/records/{id}/edit``. The form carries the sha256 and version
    it was based on; the save sends ``If-Match``, so a change made meanwhile is never
    overwritten silently: the page says so, shows what changed (diff) and keeps the text."""
    slug, rid = ctx.path("store"), ctx.path("rid")
    settings = ctx.q("view") == "settings"
    svc, p = ctx.svc, ctx.principal
    rec = svc.get_record(p, slug, rid, with_content=True)
    if rec.deleted and ctx.request.method == "GET":
        raise ServiceError(404, "record_not_found", "the record is deleted; restore a version from its history first")
    if ctx.request.method == "GET":
        if not can_write(ctx, slug):
            raise ServiceError(403, "read_only", f"store {slug!r} is attached read-only")
        return _edit_form(ctx, slug, rec=rec, settings=settings,
                          values={"base_sha256": rec.sha256, "base_version": str(rec.version),
                                  "type": rec.type or "", "newline": newline_style(rec.content or "")})
    values = {k: ctx.form.get(k, "") for k in ("base_sha256", "base_version", "type", "original_type", "newline")}
    action = ctx.form.get("action", "save")
    try:
        # the record's own line endings back (a textarea submits CRLF for every line break)
        content = "" if action == "clear" else with_newlines(field_text(ctx.form, "content"), values["newline"])
    except ContentError as err:
        return _edit_form(ctx, slug, rec=rec, status=422, content=ctx.form.get("content", "").encode(
            "utf-8", "surrogateescape").decode("utf-8", "replace"), errors={"content": str(err)},
            settings=settings, values=values)
    rtype, type_error = _type_choice(ctx, required=False)
    if type_error:
        return _edit_form(ctx, slug, rec=rec, status=422, content=content, errors={"type": type_error},
                          settings=settings, values=values)
    if rtype is not None and rtype == values["original_type"]:
        rtype = None  # unchanged select: let frontmatter / the current type decide (docs/API.md)
    base = values["base_sha256"]
    def deleted_meanwhile() -> Response:
        return _edit_form(
            ctx, slug, rec=rec, status=409, content=content, settings=settings, values=values,
            errors={"content": "The record was deleted while you were editing; nothing was saved. Copy your text, "
                               "restore the record from its history, then save again."})
    if rec.deleted:
        return deleted_meanwhile()
    try:
        reply = svc.update_record(p, slug, rid, RecordUpdate(content=content, type=rtype),
                                  if_match=f'"{base}"' if base else None)
    except ServiceError as err:
        if err.status == 412:
            return _stale(ctx, slug, rec, content, values, settings)
        if err.code == "record_not_found":  # deleted meanwhile: keep the text, say so
            return deleted_meanwhile()
        where = _write_error(err)
        if where is None:
            raise
        return _edit_form(ctx, slug, rec=rec, status=err.status, content=content, errors={where[0]: where[1]},
                          settings=settings, values=values)
    new = json.loads(reply.body)
    msg = "cleared" if action == "clear" else ("saved" if new["version"] != rec.version else "unchanged")
    if settings:
        return redirect_to(ctx.url("stores", slug, "memory", msg=msg))
    return redirect_to(ctx.url("stores", slug, "records", rid, msg=msg))


def _stale(ctx: Ctx, slug: str, rec: Record, content: str, values: dict[str, str], settings: bool) -> Response:
    """The edit form again after a 412: what changed since the base version (diff), the
    person's text kept, the base moved to the current version (saving again overwrites,
    knowingly)."""
    svc, p = ctx.svc, ctx.principal
    rec = svc.get_record(p, slug, rec.id, with_content=True)  # the version that beat us, as of now
    try:
        base_version = int(values.get("base_version") or 0)
        base = svc.get_version(p, slug, rec.id, base_version)
        base_text = base.content or ""
    except (ValueError, ServiceError):
        base_version, base_text = 0, ""
    lines = render.unified_diff(base_text, rec.content or "", f"version {base_version} (you started from)",
                                f"version {rec.version} (current)")
    mine = render.unified_diff(rec.content or "", content, f"version {rec.version} (current)", "your text")
    stale = {"version": rec.version, "actor": rec.updated_by, "at": rec.updated_at, "lines": lines,
             "mine": mine, "base_version": base_version}
    values = dict(values, base_sha256=rec.sha256, base_version=str(rec.version))
    log.info("console: stale edit of record %s refused (412)", rec.id)
    return _edit_form(ctx, slug, rec=rec, status=409, content=content, stale=stale, settings=settings, values=values)


def new_record_page(ctx: Ctx) -> Response:
    """GET/POST ``/stores/{store}/new``: create a record (path, type required, content)."""
    slug = ctx.path("store")
    svc, p = ctx.svc, ctx.principal
    store = svc.get_store(p, slug)
    if not can_write(ctx, slug):
        raise ServiceError(403, "read_only", f"store {slug!r} is attached read-only")
    if ctx.request.method == "GET":
        path = ctx.q("path")
        return render_page(ctx, "new.html", current_store=slug, store=store, errors={},
                     values={"path": path, "type": ""}, content="")
    values = {"path": ctx.form.get("path", "").strip(), "type": ctx.form.get("type", "")}
    errors: dict[str, str] = {}
    content = ""
    try:
        content = field_text(ctx.form, "content")
    except ContentError as err:
        errors["content"] = str(err)
        content = ctx.form.get("content", "").encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    rtype, type_error = _type_choice(ctx, required=not is_index(values["path"]))
    if type_error:
        errors["type"] = type_error
    if not values["path"]:
        errors["path"] = "Give the record a path, e.g. notes/topic.md."
    if not errors:
        try:
            reply = svc.create_record(p, slug, RecordCreate(path=values["path"], content=content, type=rtype))
        except ServiceError as err:
            where = _write_error(err)
            if where is None:
                raise
            errors[where[0]] = where[1]
        else:
            return redirect_to(ctx.url("stores", slug, "records", json.loads(reply.body)["id"], msg="created"))
    return render_page(ctx, "new.html", status=422, current_store=slug, store=store, errors=errors, values=values,
                 content=content)


def memory_settings(ctx: Ctx) -> Response:
    """GET ``/stores/{store}/memory``: the store's ``MEMORY.md`` as one document: read it,
    replace it, clear it (the single-document "project memory" view)."""
    slug = ctx.path("store")
    svc, p = ctx.svc, ctx.principal
    svc.get_store(p, slug)
    page = svc.list_records(p, slug, path=INDEX_PATH, limit=1, with_content=True)
    if not page.records:
        if can_write(ctx, slug):
            return redirect_to(ctx.url("stores", slug, "new", path=INDEX_PATH))
        return render_page(ctx, "error.html", status=404, title="Not found", detail=f"store {slug!r} has no MEMORY.md yet")
    rec = page.records[0]
    if not can_write(ctx, slug):
        return redirect_to(ctx.url("stores", slug, "records", rec.id))
    return _edit_form(ctx, slug, rec=rec, settings=True,
                      values={"base_sha256": rec.sha256, "base_version": str(rec.version), "type": ""})


def restore(ctx: Ctx) -> Response:
    """POST ``/stores/{store}/records/{id}/restore`` (``version``): a ``restored`` version."""
    slug, rid = ctx.path("store"), ctx.path("rid")
    try:
        n = int(ctx.form.get("version", ""))
    except ValueError:
        raise ServiceError(400, "validation_error", "which version to restore?") from None
    ctx.svc.restore_record(ctx.principal, slug, rid, Restore(version=n))
    return redirect_to(ctx.url("stores", slug, "records", rid, msg="restored"))


def delete(ctx: Ctx) -> Response:
    """POST ``/stores/{store}/records/{id}/delete`` (``sha256`` of the version shown → If-Match)."""
    slug, rid = ctx.path("store"), ctx.path("rid")
    sha = ctx.form.get("sha256", "")
    try:
        ctx.svc.delete_record(ctx.principal, slug, rid, if_match=f'"{sha}"' if sha else None)
    except ServiceError as err:
        if err.status != 412:
            raise
        raise ServiceError(412, err.code, "the record changed since the page was loaded; nothing was deleted. "
                           "Open it again, check the change, then delete.") from None
    return redirect_to(ctx.url("stores", slug, "records", rid, msg="deleted"))


def redact(ctx: Ctx) -> Response:
    """GET/POST ``/stores/{store}/records/{id}/versions/{n}/redact`` (admin): redaction
    destroys content for good, so it is asked twice. GET (and a POST without
    ``confirm=redact``) shows what would be lost — the version, its path, time, actor, size and
    content — with the confirming form (no JavaScript needed); only a POST with
    ``confirm=redact`` redacts."""
    slug, rid, n = ctx.path("store"), ctx.path("rid"), ctx.path_int("n")
    svc, p = ctx.svc, ctx.principal
    if not p.is_admin:
        raise ServiceError(403, "forbidden", "only an admin token may redact")
    if ctx.request.method == "POST" and ctx.form.get("confirm") == "redact":
        svc.redact_version(p, slug, rid, n)
        return redirect_to(ctx.url("stores", slug, "records", rid, msg="redacted"))
    rec = svc.get_record(p, slug, rid)
    v = svc.get_version(p, slug, rid, n)
    if not rec.deleted and rec.version == n:
        raise ServiceError(409, "current_version",
                           "the current version of a live record cannot be redacted; write over it first")
    return render_page(ctx, "redact.html", current_store=slug, rec=rec, v=v)
