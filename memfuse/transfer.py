"""Import and export of memory files: a directory of files ↔ a store's records, without click.

``import_walk`` lists the files of a directory to import (and what it skips);
``import_files`` writes them into a store through an :class:`~memfuse.client.ApiClient`
(created, updated, left alone when identical; refusals collected, never raised) and returns
an :class:`ImportReport`; ``export_records`` writes records under a directory at their paths,
byte for byte, with the manifest ``.memfuse/export.json`` (:data:`MANIFEST_PATH`: each record's
type, permission bits, mtime and sha256, what a plain file cannot carry), and returns an
:class:`ExportReport`; ``read_manifest`` reads that manifest back for ``import_walk`` and
``import_files``, so an export imported gives the same records back (docs/CLI.md, "Export
manifest").

This room does not parse options, print summaries or choose exit codes: the ``memfuse
import`` / ``memfuse export`` commands (:mod:`memfuse.cli.transfer`) do, from these reports.
"""
from __future__ import annotations

import json
import os
import stat
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from memfuse.client import ApiClient, with_retries
from memfuse.defs import RECORDS_PAGE_MAX
from memfuse.defs import one_line  # noqa: F401  (re-exported: callers found it here)
from memfuse.content import ContentError, check_secrets, check_type, check_utf8, record_type
from memfuse.errors import Conflict, PermanentError
from memfuse.wire import MODE_MASK, Record, sha256_hex
from memfuse.names import NameError_, check_path, is_local_only

#: Every action of :class:`ImportReport` ``done``, in the order a summary lists them.
IMPORT_ACTIONS = ("would create", "would update", "created", "updated", "unchanged")

#: Where an export's manifest is written, relative to the export directory: inside ``.memfuse/``,
#: the directory a plain import skips (a mount's control directory has that name).
MANIFEST_PATH = ".memfuse/export.json"
#: The manifest's ``format`` member, and the ``version`` this memfuse writes and reads.
MANIFEST_FORMAT = "memfuse-export"
MANIFEST_VERSION = 1


def shown(path: str) -> str:
    """A path for the terminal: undecodable bytes of a file name shown as U+FFFD."""
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def new_key() -> str:
    """A fresh idempotency key (``cli-`` + 32 hex digits), reused across the retries of one
    write."""
    return "cli-" + uuid.uuid4().hex


# ---------------------------------------------------------------- manifest


class ManifestError(ValueError):
    """The export manifest cannot be read or is not one this memfuse understands; the message
    names the file and what is wrong, on one line."""


@dataclass(frozen=True)
class ManifestEntry:
    """One record of an export manifest: ``path`` (the record path, also the file's path
    relative to the export directory), ``type`` (None for a store's root ``MEMORY.md``),
    ``mode`` (permission bits, ``& 0o777``: setuid, setgid and sticky are stripped), ``mtime_ns`` (the modification time the record
    shows, ns since the epoch), ``sha256`` (hex of the content's UTF-8 bytes) and ``size``
    (bytes)."""

    path: str
    type: str | None
    mode: int
    mtime_ns: int
    sha256: str
    size: int

    @classmethod
    def of(cls, rec: Record) -> "ManifestEntry":
        """The entry of a record (its content's sha256 and size as the store has them)."""
        return cls(rec.path, rec.type, rec.mode & MODE_MASK, rec.mtime_effective_ns(), rec.sha256, rec.size)


def write_manifest(directory: Path, store: str, entries: list[ManifestEntry]) -> Path:
    """Write the manifest of an export of ``store`` into ``directory`` (at
    :data:`MANIFEST_PATH`, atomically: a temporary file renamed over it) and return its path.
    The format (docs/CLI.md): a JSON object ``{"format": "memfuse-export", "version": 1,
    "store": slug, "records": [{"path", "type", "mode", "mtime_ns", "sha256", "size"}, ...]}``,
    records in path order. Raises ``OSError``."""
    path = directory / MANIFEST_PATH
    path.parent.mkdir(exist_ok=True)
    doc = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "store": store,
        "records": [
            {"path": e.path, "type": e.type, "mode": e.mode, "mtime_ns": e.mtime_ns, "sha256": e.sha256,
             "size": e.size}
            for e in sorted(entries, key=lambda e: e.path.encode("utf-8"))
        ],
    }
    tmp = path.with_name(f".export.json.{uuid.uuid4().hex}")
    try:
        tmp.write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def read_manifest(directory: Path) -> dict[str, ManifestEntry] | None:
    """The records of the export manifest in ``directory`` by path, or None when there is
    none (a plain directory). Raises :class:`ManifestError` when it cannot be read, is not
    JSON, or is not a ``memfuse-export`` manifest of a version this memfuse reads (a newer
    one is refused rather than half understood)."""
    path = directory / MANIFEST_PATH
    if not path.is_file() or path.is_symlink():
        return None
    try:
        doc = json.loads(path.read_bytes())
    except OSError as e:
        raise ManifestError(f"cannot read {path}: {e.strerror}") from None
    except ValueError as e:
        raise ManifestError(f"{path} is not JSON: {one_line(e)}") from None
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
        raise ManifestError(f"{path} is not a memfuse export manifest (no \"format\": \"{MANIFEST_FORMAT}\")")
    if doc.get("version") != MANIFEST_VERSION:
        raise ManifestError(f"{path} has version {doc.get('version')!r}; this memfuse reads version "
                            f"{MANIFEST_VERSION} (a newer memfuse wrote it?)")
    out: dict[str, ManifestEntry] = {}
    records = doc.get("records")
    if not isinstance(records, list):
        raise ManifestError(f"{path}: \"records\" is not a list")
    for i, r in enumerate(records):
        try:
            entry = ManifestEntry(r["path"], r["type"], r["mode"], r["mtime_ns"], r["sha256"], r["size"])
            ok = (isinstance(entry.path, str) and (entry.type is None or isinstance(entry.type, str))
                  and all(isinstance(v, int) and not isinstance(v, bool)
                          for v in (entry.mode, entry.mtime_ns, entry.size))
                  and isinstance(entry.sha256, str))
        except (KeyError, TypeError):
            ok = False
        if not ok:
            raise ManifestError(f"{path}: record {i} is not {{path, type, mode, mtime_ns, sha256, size}}")
        out[entry.path] = entry
    return out


# ---------------------------------------------------------------- import


@dataclass
class ImportReport:
    """What an import did, file by file: ``done`` as (action, record path, type or None for
    the index), action one of :data:`IMPORT_ACTIONS`; ``refused`` as (record path, one-line
    reason ending in ``[code]``); ``skipped`` as paths relative to the directory (a
    directory with a trailing ``/``)."""

    done: list[tuple[str, str, str | None]] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """Action → number of files, for the actions that occurred."""
        out: dict[str, int] = {}
        for action, _, _ in self.done:
            out[action] = out.get(action, 0) + 1
        return out


def import_walk(root: Path, listed: Iterable[str] = ()) -> tuple[list[tuple[str, Path]], list[str]]:
    """The files under ``root`` to import, as (record path, file) in path order (UTF-8 byte
    order, undecodable name bytes as surrogate escapes), and what is skipped: hidden files
    and directories (``.git/``, ``.DS_Store``, ``.memfuse/``), editor and tool temporaries
    (the local-only names of :func:`memfuse.names.is_local_only`: ``*~``, ``.#*``, ``#*#``,
    ``.*.swp``, ``4913``, ...), symbolic links and anything that is not a regular file.

    ``listed``: the record paths of an export manifest (:func:`read_manifest`): a regular file
    at one of them is imported whatever its name (a record ``.hidden.md`` or ``.notes/a.md``
    of the exported store), while other hidden files, in those directories too, are still
    skipped. Raises ``OSError`` only when ``root`` cannot be listed at all."""
    listed = set(listed)
    listed_dirs = {p.rsplit("/", 1)[0] + "/" for p in listed if "/" in p}
    listed_dirs |= {d[: i + 1] for d in listed_dirs for i, c in enumerate(d) if c == "/"}
    if (root / MANIFEST_PATH).is_file():  # an export: its .memfuse/ holds the manifest, not junk
        listed_dirs.add(MANIFEST_PATH.split("/")[0] + "/")
    files: list[tuple[str, Path]] = []
    skipped: list[str] = []
    hidden_dirs: set[str] = set()  # entered only for listed files: nothing else taken there
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root).as_posix()
        prefix = "" if rel == "." else rel + "/"
        in_hidden = prefix in hidden_dirs
        keep = []
        for d in sorted(dirnames):
            sub = prefix + d + "/"
            if os.path.islink(os.path.join(dirpath, d)):
                skipped.append(sub)
            elif d.startswith(".") or in_hidden:
                if sub in listed_dirs:
                    hidden_dirs.add(sub)
                    keep.append(d)
                else:
                    skipped.append(sub)
            else:
                keep.append(d)
        dirnames[:] = keep
        for f in sorted(filenames):
            full = Path(dirpath, f)
            path = prefix + f
            if path == MANIFEST_PATH or full.is_symlink() or not full.is_file():
                if path != MANIFEST_PATH:
                    skipped.append(path)
            elif path in listed:
                files.append((path, full))
            elif in_hidden or f.startswith(".") or is_local_only(f):
                skipped.append(path)
            else:
                files.append((path, full))
    files.sort(key=lambda x: x[0].encode("utf-8", "surrogateescape"))
    return files, skipped


async def import_files(
    api: ApiClient,
    store_slug: str,
    files: Iterable[tuple[str, Path]],
    dry_run: bool,
    echo: Callable[[str], None],
    manifest: dict[str, ManifestEntry] | None = None,
) -> ImportReport:
    """Write ``files`` (record path, file) into ``store_slug``: a new path is created, a
    changed one updated, an identical one (same sha256, permission bits, mtime and type) left
    alone; each record gets its file's permission bits (``st_mode & 0o777``: setuid, setgid and sticky are dropped) and modification
    time (``st_mtime_ns``), as ``cp -p`` keeps them, so an export imported again is unchanged
    (a file differing only in those gets them by ``PATCH``, no content sent); ``echo`` gets one line
    per file done (``"created notes/a.md (project)"``).

    ``manifest`` (:func:`read_manifest` of an export): a file whose content is still the
    exported one (same sha256) gets the entry's type (explicitly, as the ``user.memfuse.type``
    xattr sets it, whatever its frontmatter says), permission bits and mtime, so the record is
    the exported one even when the files lost their modes or times on the way (``cp -r``, an
    archive, a checkout); an edited file is imported as a plain one.

    With ``dry_run`` nothing is written: each file is checked against the store's rules here
    (size, type, secrets) and reported as ``would create`` / ``would update``. Without it the
    server decides; a path created meanwhile by someone else is updated instead.

    A file that cannot be read, is not UTF-8, has a bad name or is refused by the server
    (``PermanentError``) lands in ``report.refused``; the others are still imported.
    ``report.skipped`` is left empty (the caller fills it from :func:`import_walk`). Raises
    :class:`~memfuse.errors.ApiError` when the store cannot be read or a write keeps failing
    transiently (after ``with_retries``)."""
    store_info = await with_retries(lambda: api.get_store(store_slug))
    records, _ = await with_retries(lambda: api.snapshot(store_slug, content=False, limit=RECORDS_PAGE_MAX))
    live: dict[str, Record] = {r.path: r for r in records}

    report = ImportReport()

    def refuse(path: str, reason: str) -> None:
        report.refused.append((path, one_line(reason)))

    for path, file in files:
        try:
            check_path(path)
        except NameError_ as e:
            refuse(path, f"{e.reason} [{'path_too_long' if e.too_long else 'invalid_path'}]")
            continue
        try:
            data = file.read_bytes()
            st = file.stat()
        except OSError as e:
            refuse(path, f"cannot read: {e.strerror}")
            continue
        mode, mtime_ns = st.st_mode & MODE_MASK, st.st_mtime_ns
        try:
            text = check_utf8(data)
        except ContentError as e:
            refuse(path, f"{e.reason} [{e.code}]")
            continue
        digest = sha256_hex(data)
        entry = (manifest or {}).get(path)
        explicit: str | None = None  # the type to set whatever the frontmatter says
        if entry is not None and entry.sha256 == digest:  # as exported: the record's attributes
            mode, mtime_ns, explicit = entry.mode & MODE_MASK, entry.mtime_ns, entry.type
        old = live.get(path)
        same_content = old is not None and old.sha256 == digest
        same_type = explicit is None or old is None or old.type == explicit
        if (old is not None and same_content and same_type and old.mode == mode
                and old.mtime_effective_ns() == mtime_ns):
            report.done.append(("unchanged", path, old.type))
            echo(f"unchanged {shown(path)} ({old.type or 'index'})")
            continue
        if dry_run:
            # The server's rules, checked here; a real import lets the server decide.
            fallback = (old.type if old is not None else None) or store_info.default_type
            try:
                if len(data) > store_info.max_record_bytes:
                    raise ContentError(
                        f"record is {len(data)} bytes, the store allows {store_info.max_record_bytes} [record_too_large]"
                    )
                rtype = record_type(path, text, explicit, fallback)
                check_type(rtype)
                check_secrets(text)
            except ContentError as e:
                code = f" [{e.code}]" if type(e) is not ContentError else ""
                refuse(path, e.reason + code)
                continue
            action = "would update" if old is not None else "would create"
            report.done.append((action, path, rtype))
            echo(f"{action} {shown(path)} ({rtype or 'index'})")
            continue
        key = new_key()
        try:
            if old is not None and same_content and same_type:  # only the attributes differ: no content is sent
                oid = old.id
                rec = await with_retries(lambda: api.set_attributes(
                    store_slug, oid, mode=mode, mtime_ns=mtime_ns, idempotency_key=key))
                action = "updated"
            elif old is None:
                try:
                    rec = await with_retries(
                        lambda: api.create_record(store_slug, path, text, explicit, idempotency_key=key,
                                                  mode=mode, mtime_ns=mtime_ns)
                    )
                    action = "created"
                except Conflict as e:  # created meanwhile: update it instead
                    if e.code != "path_exists" or not e.record_id:
                        raise
                    rid, key2 = e.record_id, new_key()
                    rec = await with_retries(
                        lambda: api.update_record(store_slug, rid, text, explicit, idempotency_key=key2,
                                                  mode=mode, mtime_ns=mtime_ns)
                    )
                    action = "updated"
            else:
                oid = old.id
                rec = await with_retries(lambda: api.update_record(store_slug, oid, text, explicit,
                                                                  idempotency_key=key, mode=mode,
                                                                  mtime_ns=mtime_ns))
                action = "updated"
        except PermanentError as e:
            what = e.detail or e.title or str(e)
            refuse(path, f"{what} [{e.code or e.status}]")
            continue
        report.done.append((action, path, rec.type))
        echo(f"{action} {shown(path)} ({rec.type or 'index'})")
    return report


# ---------------------------------------------------------------- export


@dataclass
class ExportReport:
    """What an export wrote: ``written`` records, ``bytes`` in total (UTF-8 content), and
    ``failed`` as (record path, reason)."""

    written: int = 0
    bytes: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)


def export_records(records: Iterable[Record], directory: Path, store: str | None = None) -> ExportReport:
    """Write each record's content (UTF-8, byte for byte) under ``directory`` at its path;
    ``directory`` and the parents are created as needed. A file at a record's path is
    replaced atomically (a temporary file, then ``rename(2)``); other files are left alone.
    Each file gets the record's attributes: its permission bits (``mode & 0o777``: setuid,
    setgid and sticky bits a record of an older release holds are stripped; the owner's read
    bit added, so that the export can be read back: the manifest has the exact bits) and
    modification time (``mtime_ns``, else ``updated_at``).

    With ``store`` (its slug), the manifest of the records written is written last at
    :data:`MANIFEST_PATH` (:func:`write_manifest`); a record at that very path cannot be
    written and lands in ``failed``.

    A record whose path is not a valid record path, leads outside ``directory`` (through a
    symbolic link already there) or is blocked by a directory lands in ``failed``; the others
    are still written. Raises ``OSError`` only when ``directory`` or the manifest cannot be
    written."""
    directory.mkdir(parents=True, exist_ok=True)
    root = directory.resolve()
    report = ExportReport()
    entries: list[ManifestEntry] = []
    for rec in records:
        try:
            check_path(rec.path)
            if store is not None and rec.path == MANIFEST_PATH:
                raise OSError("the export manifest's own path")
            dest = root.joinpath(*rec.path.split("/"))
            parent = dest.parent.resolve()  # through any symbolic link already there
            if parent != root and root not in parent.parents:
                raise OSError(f"{dest.parent} leads outside {root}")
            parent.mkdir(parents=True, exist_ok=True)
            if dest.is_dir() and not dest.is_symlink():
                raise OSError("a directory is in the way")
            data = (rec.content or "").encode("utf-8")
            tmp = parent / f".memfuse-export-{uuid.uuid4().hex}"
            try:
                with open(tmp, "xb") as fh:
                    fh.write(data)
                ts = rec.mtime_effective_ns()
                os.utime(tmp, ns=(ts, ts))
                os.chmod(tmp, (rec.mode & MODE_MASK) | stat.S_IRUSR)  # never setuid / setgid / sticky
                os.replace(tmp, parent / dest.name)
            finally:
                if tmp.exists():
                    tmp.unlink()
            report.written += 1
            report.bytes += len(data)
            entries.append(ManifestEntry.of(rec))
        except NameError_ as e:
            report.failed.append((rec.path, e.reason))
        except OSError as e:
            report.failed.append((rec.path, e.strerror or str(e)))
    if store is not None:
        write_manifest(root, store, entries)
    return report
