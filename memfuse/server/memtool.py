"""The memory-tool command engine: Anthropic's client-side memory tool (``memory_20250818``:
``view``, ``create``, ``str_replace``, ``insert``, ``delete``, ``rename`` under
``/memories``) run server-side on a workspace's records, plus memfuse's ``search``,
``history`` and ``remember``.

Every face (``POST /v1/workspaces/{ws}/memory-tool``, the MCP server on stdio and on
``/mcp``, the Anthropic SDK adapter) runs its commands through ``MemoryTool.run``; the engine
calls ``Service`` public methods only, so a tool write is an ordinary record version (same
rules, quotas, secret scan, change feed) and shows in every mount of the store.

Layout: ``/memories/<store>/<record path>`` — the mount's layout under another root. The
root lists the workspace's attached stores; directories are implied by record paths.

Outputs and error strings are those of the reference implementation
(``anthropic.lib.tools.BetaLocalFilesystemMemoryTool``, anthropic 2.14), with these
differences, each a refusal the local tool cannot make or a bound it does not keep:

- paths are canonicalised (``//``, ``.`` components and a trailing ``/`` dropped) and
  ``..`` components, backslashes and percent-encoded ``.``, ``/``, ``\\`` are refused (the
  reference resolves ``..`` that stays inside ``/memories``); ``/memoriesX`` is refused (the
  reference reads it as ``/memories/X``);
- files live in stores: creating a file at ``/memories`` itself, deleting or renaming a store
  directory, renaming across stores are refused (the mount refuses them too: ``EACCES`` at
  the root, ``EXDEV``);
- ``view`` of a file shows at most ``VIEW_MAX_LINES`` lines / ``VIEW_MAX_BYTES`` bytes and a
  directory listing at most ``LIST_MAX_ENTRIES`` entries, then a ``[memfuse: ...]`` marker
  saying what was left out and how to page on (``view_range``);
- ``view`` of a directory reads the two levels it shows through ``Service.tree`` (range
  queries that pass over deeper subtrees) and ``search`` goes through ``Service.search``
  (the database finds the files, a bounded page at a time, and the search stops once it has
  the lines to show), so neither loads a whole store;
- refusals of the store's rules read ``Cannot write <path>: <reason> (<errno>)`` with the
  reason and errno the mount gives for the same write (``EFBIG``, ``ENOSPC``, ``EPERM``,
  ``EILSEQ``, ``EINVAL``, ``EROFS``).

Atomicity: each command reads the record, computes the new content and writes it with
``If-Match`` (the sha256 read); on ``412`` it reads again and recomputes, with jittered
backoff, for up to ``RETRY_SECONDS``. ``insert`` at the last line is an append: on a retry
it appends at the new last line. Correctness comes from the database, not from a lock in
this process, so any number of control-plane replicas may run commands on one file.

The tool's vocabulary without the service (``parse_path`` and ``Target``, ``ToolResult``,
``ToolError``, ``ToolPrincipal``, the output formats) lives in ``memtool_base``; its names are
importable from here too.
"""
from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from memfuse import content as content_rules
from memfuse.defs import INT64_MAX, RECORDS_PAGE_MAX, Access
from memfuse.errors import ERRNO_NAME_BY_CODE
from memfuse.models import Attachment, PrefixMove, Record, RecordCreate, RecordMove, RecordUpdate
from memfuse.server.memtool_base import (  # re-exported: callers import them from here
    LINE_NUMBER_WIDTH as LINE_NUMBER_WIDTH,
    MAX_LINES as MAX_LINES,
    ROOT as ROOT,
    Target as Target,
    ToolError as ToolError,
    ToolPrincipal as ToolPrincipal,
    ToolResult as ToolResult,
    clean_client as clean_client,
    format_size as format_size,
    numbered as numbered,
    parse_path as parse_path,
    split_lines_keeping_cr as split_lines_keeping_cr,
)
from memfuse.server import keys
from memfuse.server.recordrows import _encode_cursor
from memfuse.server.search import LINE_MAX_CHARS, TreeListing, check_query
from memfuse.server.service import Principal, Service, ServiceError

log = logging.getLogger(__name__)

VIEW_MAX_LINES = 2000  # lines one view shows at most
VIEW_MAX_BYTES = 100_000  # UTF-8 bytes of file content one view shows at most
LIST_MAX_ENTRIES = 1000  # entries one directory listing shows at most
DIR_SIZE = 4096  # directories show this size, as on the mount (st_size of a directory)
RETRY_SECONDS = 15.0  # a command retries a concurrent change for this long
SEARCH_MAX_RESULTS = 100  # matching lines one search returns at most
SEARCH_MAX_LINE_CHARS = LINE_MAX_CHARS  # a matching line is shown up to this many characters
SEARCH_PAGE = 100  # files one search request reads at most
NOTES_FILE = "notes.md"  # remember appends here, at the store root
SCAN_PAGE = 1000  # records per snapshot page while listing
HISTORY_MAX_VERSIONS = 100  # versions one history shows at most (the newest)


def _redacted(path: str) -> str:
    """``path`` as a log line may show it: a secret in it replaced by its first four
    characters and ``[REDACTED]`` (``content.find_secret_in_path``), like the REST API's
    problem detail and the mount's ``errors.log``."""
    found = content_rules.find_secret_in_path(path)
    return path if found is None else found.redacted

@dataclass
class _Node:
    """A directory in a listing: child directories and files (name → size)."""

    dirs: dict[str, "_Node"] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)


class MemoryTool:
    """Runs memory-tool commands for one workspace through ``Service``.

    ``principal`` must be allowed to act on ``workspace`` (the workspace's token, or admin);
    ``workspace`` is its key (memfuse.server.keys), never shown; versions are recorded with actor ``tool:<client>``. Blocking (database calls): run it
    in a worker thread from async code. Thread-safe (no state between commands).
    """

    def __init__(self, svc: Service, principal: Principal, workspace: str, client: str | None = None) -> None:
        self.svc = svc
        self.workspace = workspace
        # The workspace's own view, whoever calls (an admin token acts as the workspace).
        self.p = ToolPrincipal(workspace=workspace, name=principal.name, instance=principal.instance,
                               client=clean_client(client or principal.instance))
        self._commands: dict[str, Callable[[Mapping[str, Any]], str]] = {
            "view": self.view, "create": self.create, "str_replace": self.str_replace,
            "insert": self.insert, "delete": self.delete, "rename": self.rename,
            "search": self.search, "history": self.history, "remember": self.remember,
        }

    # ------------------------------------------------------------ entry point

    def run(self, command: Mapping[str, Any]) -> ToolResult:
        """Run one command (the model's ``tool_use.input``: ``{"command": "view", ...}``).
        Never raises for a refusal: errors come back as ``ToolResult(..., is_error=True)``.
        ``ServiceError`` other than a rule refusal (database trouble) propagates."""
        if not isinstance(command, Mapping):
            return ToolResult("The tool input must be a JSON object with a `command`", True)
        name = command.get("command")
        fn = self._commands.get(name) if isinstance(name, str) else None
        if fn is None:
            return ToolResult(
                f"Unknown command: {name}. Use one of view, create, str_replace, insert, delete, rename"
                " (memfuse also has search, history, remember)", True)
        try:
            return ToolResult(fn(command))
        except ToolError as e:
            # path and reason code, never content (file_text, old_str...) nor tokens; the path
            # is the model's input, so shortened, quoted (%r: no line breaks in the log) and
            # redacted when it holds a secret (as the REST API and the mount log it)
            paths = [command.get(k) for k in ("path", "old_path", "new_path")]
            shown = " -> ".join(repr(_redacted(p)[:200]) for p in paths if isinstance(p, str)) or "-"
            log.info("memory tool %s refused in workspace %s path=%s code=%s", name, self.workspace,
                     shown, e.code)
            return ToolResult(e.message, True)

    # ------------------------------------------------------------ lookups

    def _attachments(self) -> dict[str, Attachment]:
        return {a.store.slug: a for a in self.svc.list_attachments(self.p, self.workspace)}

    def _attachment(self, t: Target, *, write: bool = False, creating: bool = False) -> Attachment:
        """The attachment of ``t``'s store; ``ToolError`` when not attached (the path does
        not exist; ``ENOENT`` when ``creating``) or, with ``write``, attached read-only."""
        assert t.store is not None
        a = self._attachments().get(t.store)
        if a is None:
            if creating:
                raise ToolError(f"Cannot write {t.raw}: store {t.store} is not attached to this workspace (ENOENT)")
            raise ToolError(f"The path {t.raw} does not exist. Please provide a valid path.")
        if write and a.access != Access.read_write:
            raise ToolError(f"Cannot write {t.raw}: store {t.store} is attached read-only (EROFS)")
        return a

    def _record(self, store: str, path: str) -> Record | None:
        """The live record at ``path`` with content, or None."""
        page = self.svc.list_records(self.p, store, path=path, limit=1, with_content=True)
        return page.records[0] if page.records else None

    def _under(self, store: str, prefix: str, *, limit: int | None = None) -> list[Record]:
        """Live records under directory ``prefix`` (``""``: the whole store), by path,
        without content; at most ``limit`` when given."""
        out: list[Record] = []
        lead = prefix + "/" if prefix else ""
        # The snapshot is ordered by path: start at the prefix (the server's cursor, as if a
        # record at "<prefix>/" had been the last one seen) and stop past it.
        cursor = _encode_cursor(lead, "") if lead else None
        while True:
            n = SCAN_PAGE if limit is None else min(SCAN_PAGE, limit - len(out))
            page = self.svc.list_records(self.p, store, cursor=cursor, limit=n)
            for r in page.records:
                if not r.path.startswith(lead):
                    return out
                out.append(r)
            if page.next_cursor is None or (limit is not None and len(out) >= limit):
                return out
            cursor = page.next_cursor

    def _is_dir(self, store: str, path: str) -> bool:
        return not path or bool(self._under(store, path, limit=1))

    def _file_ancestor(self, store: str, path: str) -> str | None:
        """The first ancestor directory of ``path`` that is a file, if any."""
        parts = path.split("/")
        for i in range(1, len(parts)):
            anc = "/".join(parts[:i])
            if self._record(store, anc) is not None:
                return anc
        return None

    @staticmethod
    def _refusal(t: Target, e: ServiceError) -> ToolError:
        code = ERRNO_NAME_BY_CODE.get(e.code)
        if code is None:
            raise e
        reason = e.detail or e.code
        if e.code == "read_only":
            reason = f"store {t.store} is attached read-only"
        return ToolError(f"Cannot write {_redacted(t.raw)}: {reason} ({code})", e.code)

    def _retrying(self, t: Target, attempt: Callable[[], str | None]) -> str:
        """Run ``attempt`` until it returns a result (not None = done); None means a
        concurrent change (412): wait a little (jittered, growing) and run it again, for up
        to ``RETRY_SECONDS``."""
        deadline = time.monotonic() + RETRY_SECONDS
        delay = 0.002
        tries = 0
        while True:
            tries += 1
            result = attempt()
            if result is not None:
                if tries > 1:
                    log.info("memory tool write succeeded after %d tries", tries)
                return result
            if time.monotonic() > deadline:
                raise ToolError(f"Cannot write {t.raw}: it kept changing concurrently; try again")
            time.sleep(random.uniform(0, delay))
            delay = min(delay * 2, 0.2)

    # ------------------------------------------------------------ view

    def view(self, c: Mapping[str, Any]) -> str:
        t = parse_path(c.get("path"))
        if t.is_root:
            root, cut = self._tree_of_root()
            return self._listing(t, root, cut=cut)
        self._attachment(t)
        rec = self._record(t.in_store, t.path) if t.path else None
        if rec is not None:
            return self._view_file(t, rec.content or "", c.get("view_range"))
        # the database lists two levels, skipping deeper subtrees (Service.tree): bounded
        listing = self.svc.tree(self.p, t.in_store, t.path, depth=2, max_entries=LIST_MAX_ENTRIES)
        if not listing.dirs and not listing.files and t.path and not self._is_dir(t.in_store, t.path):
            raise ToolError(f"The path {t.raw} does not exist. Please provide a valid path.")
        return self._listing(t, self._tree(listing), cut=not listing.complete)

    @staticmethod
    def _tree(listing: TreeListing) -> _Node:
        root = _Node()
        for d in listing.dirs:
            node = root
            for comp in d.split("/"):
                node = node.dirs.setdefault(comp, _Node())
        for path, size in listing.files.items():
            parts = path.split("/")
            node = root
            for comp in parts[:-1]:
                node = node.dirs.setdefault(comp, _Node())
            node.files[parts[-1]] = size
        return root

    def _tree_of_root(self) -> tuple[_Node, bool]:
        """The root listing: each attached store and its top level (depth 2 from
        ``/memories``); ``cut`` True when a store had more entries than a listing shows."""
        root = _Node()
        cut = False
        for slug in sorted(self._attachments()):
            listing = self.svc.tree(self.p, slug, "", depth=1, max_entries=LIST_MAX_ENTRIES)
            cut = cut or not listing.complete
            node = root.dirs.setdefault(slug, _Node())
            top = self._tree(listing)
            node.dirs = {k: _Node() for k in top.dirs}
            node.files = dict(top.files)
        return root, cut

    def _listing(self, t: Target, root: _Node, cut: bool = False) -> str:
        """The reference's listing of ``root`` (two levels, hidden names left out), at most
        ``LIST_MAX_ENTRIES`` entries; ``cut``: the tree itself was cut at that bound (more
        entries exist than were read)."""
        entries: list[str] = []

        def walk(node: _Node, rel: str, depth: int) -> None:
            items = [(n, True) for n in node.dirs] + [(n, False) for n in node.files]
            for name, is_dir in sorted(items, key=lambda x: x[0]):
                if name.startswith("."):
                    continue
                path = f"{rel}/{name}" if rel else name
                if is_dir:
                    entries.append(f"{format_size(DIR_SIZE)}\t{t.raw}/{path}/")
                    if depth < 2:
                        walk(node.dirs[name], path, depth + 1)
                else:
                    entries.append(f"{format_size(node.files[name])}\t{t.raw}/{path}")

        walk(root, "", 1)
        header = f"Here're the files and directories up to 2 levels deep in {t.raw}, excluding hidden items:"
        shown = entries[:LIST_MAX_ENTRIES]
        text = f"{header}\n" + "\n".join([f"{format_size(DIR_SIZE)}\t{t.raw}"] + shown)
        if len(entries) > len(shown) or cut:
            text += (f"\n[memfuse: listing cut after {len(shown)} entries: more not "
                     "shown; view a subdirectory to see them]")
        return text

    def _view_file(self, t: Target, content: str, view_range: Any) -> str:
        lines = content.split("\n")
        if len(lines) > MAX_LINES:
            raise ToolError(f"File {t.raw} exceeds maximum line limit of 999,999 lines.")
        start = 0
        end = len(lines)
        if view_range is not None:
            if (not isinstance(view_range, list) or len(view_range) != 2
                    or not all(isinstance(v, int) and not isinstance(v, bool) for v in view_range)):
                raise ToolError(f"Invalid `view_range` parameter: {view_range}. "
                                "It should be a list of two integers [start_line, end_line]; end_line -1 means "
                                "the end of the file.")
            start = max(1, view_range[0]) - 1
            end = len(lines) if view_range[1] == -1 else view_range[1]
        shown = lines[start:end]
        # The bound: whole lines up to VIEW_MAX_LINES / VIEW_MAX_BYTES (a first line longer
        # than that is shown in part).
        out: list[str] = []
        used = 0
        partial = False
        for line in shown[:VIEW_MAX_LINES]:
            n = len(line.encode("utf-8")) + 1
            if used + n > VIEW_MAX_BYTES:
                if not out:
                    out.append(line.encode("utf-8")[:VIEW_MAX_BYTES].decode("utf-8", "ignore"))
                    partial = True
                break
            out.append(line)
            used += n
        text = f"Here's the content of {t.raw} with line numbers:\n" + numbered(out, start + 1)
        if partial:
            text += (f"\n[memfuse: line {start + 1} is {len(shown[0].encode('utf-8'))} bytes long; only its first "
                     f"{VIEW_MAX_BYTES} bytes are shown]")
            if len(shown) > 1:
                text += f"\n[memfuse: view_range [{start + 2}, -1] reads on from the next line]"
        elif len(out) < len(shown):
            last = start + len(out)
            text += (f"\n[memfuse: output cut after line {last}: lines {last + 1}-{start + len(shown)} of "
                     f"{len(lines)} are not shown (a view shows up to {VIEW_MAX_LINES} lines / "
                     f"{VIEW_MAX_BYTES} bytes). Call view with view_range [{last + 1}, -1] to read on.]")
        return text

    # ------------------------------------------------------------ create

    def create(self, c: Mapping[str, Any]) -> str:
        t = parse_path(c.get("path"))
        text = c.get("file_text")
        if not isinstance(text, str):
            raise ToolError("Parameter `file_text` is required and must be a string")
        if t.is_root:
            raise ToolError(f"File {t.raw} already exists")
        if t.is_store_root:
            atts = self._attachments()
            if t.store in atts:
                self._attachment(t, write=True)
                raise ToolError(f"File {t.raw} already exists")
            stores = ", ".join(f"{ROOT}/{s}/" for s in sorted(atts)) or "none attached"
            raise ToolError(f"Cannot create {t.raw}: {ROOT} holds one directory per store ({stores}); "
                            "create files inside a store")
        self._attachment(t, write=True, creating=True)
        if self._is_dir(t.in_store, t.path):
            raise ToolError(f"File {t.raw} already exists")
        anc = self._file_ancestor(t.in_store, t.path)
        if anc is not None:
            raise ToolError(f"Cannot create {t.raw}: {ROOT}/{t.store}/{anc} is a file (ENOTDIR)")
        try:
            self.svc.create_record(self.p, t.in_store, RecordCreate(path=t.path, content=text))
        except ServiceError as e:
            if e.code == "path_exists":
                raise ToolError(f"File {t.raw} already exists") from None
            raise self._refusal(t, e) from None
        return f"File created successfully at: {t.raw}"

    # ------------------------------------------------------------ edits

    def _file(self, t: Target, *, write: bool) -> Record:
        """The live file at ``t`` with content; the reference's errors for a missing path
        or a directory."""
        if t.is_root or t.is_store_root:
            if t.store is not None:
                self._attachment(t, write=write)
            raise ToolError(f"The path {t.raw} is not a file.")
        self._attachment(t, write=write)
        rec = self._record(t.in_store, t.path)
        if rec is None:
            if self._is_dir(t.in_store, t.path):
                raise ToolError(f"The path {t.raw} is not a file.")
            raise ToolError(f"The path {t.raw} does not exist. Please provide a valid path.")
        return rec

    def _put(self, t: Target, rec: Record, new: str) -> bool:
        """Write ``new`` over ``rec`` with If-Match; False on a concurrent change (412 or
        the record gone and another at its path)."""
        try:
            self.svc.update_record(self.p, t.in_store, rec.id, RecordUpdate(content=new), f'"{rec.sha256}"')
            return True
        except ServiceError as e:
            if e.code == "precondition_failed":
                return False
            if e.code == "record_not_found":
                raise ToolError(f"The file {t.raw} no longer exists (may have been deleted or renamed "
                                "concurrently).") from None
            raise self._refusal(t, e) from None

    def str_replace(self, c: Mapping[str, Any]) -> str:
        t = parse_path(c.get("path"))
        old, new = c.get("old_str"), c.get("new_str", "")
        if not isinstance(old, str):
            raise ToolError("Parameter `old_str` is required and must be a string")
        if not isinstance(new, str):
            raise ToolError("Parameter `new_str` must be a string")
        rec = self._file(t, write=True)

        def attempt() -> str | None:
            nonlocal rec
            content = rec.content or ""
            count = content.count(old)
            if count == 0:
                raise ToolError(
                    f"No replacement was performed, old_str `{old}` did not appear verbatim in {t.raw}.")
            if count > 1:
                lines: list[int] = []
                start = 0
                while (pos := content.find(old, start)) != -1:
                    lines.append(content[:pos].count("\n") + 1)
                    start = pos + 1
                raise ToolError(
                    f"No replacement was performed. Multiple occurrences of old_str `{old}` in lines: "
                    f"{', '.join(map(str, lines))}. Please ensure it is unique")
            pos = content.find(old)
            changed = content[:pos].count("\n")
            result = content.replace(old, new)
            if not self._put(t, rec, result):
                rec = self._file(t, write=True)
                return None
            new_lines = result.split("\n")
            lo, hi = max(0, changed - 2), min(len(new_lines), changed + 3)
            snippet = [f"{str(n).rjust(LINE_NUMBER_WIDTH)}\t{new_lines[n - 1]}" for n in range(lo + 1, hi + 1)]
            return ("The memory file has been edited. Here is the snippet showing the change (with line numbers):\n"
                    + "\n".join(snippet))

        return self._retrying(t, attempt)

    def insert(self, c: Mapping[str, Any]) -> str:
        t = parse_path(c.get("path"))
        line, text = c.get("insert_line"), c.get("insert_text")
        if not isinstance(line, int) or isinstance(line, bool):
            raise ToolError("Parameter `insert_line` is required and must be an integer")
        if not isinstance(text, str):
            raise ToolError("Parameter `insert_text` is required and must be a string")
        rec = self._file(t, write=True)
        append: bool | None = None  # decided on the first read: insert at the last line

        def attempt() -> str | None:
            nonlocal rec, append
            lines = split_lines_keeping_cr(rec.content or "")
            if append is None:
                append = line == len(lines)
            at = len(lines) if append else line
            if at < 0 or at > len(lines):
                raise ToolError(f"Invalid `insert_line` parameter: {line}. "
                                f"It should be within the range [0, {len(lines)}].")
            lines.insert(at, text.rstrip("\n"))
            result = "\n".join(lines)
            if not result.endswith("\n"):
                result += "\n"
            if not self._put(t, rec, result):
                rec = self._file(t, write=True)
                return None
            return f"The file {t.raw} has been edited."

        return self._retrying(t, attempt)

    # ------------------------------------------------------------ delete, rename

    def delete(self, c: Mapping[str, Any]) -> str:
        t = parse_path(c.get("path"))
        if t.is_root:
            raise ToolError("Cannot delete the /memories directory itself")
        self._attachment(t, write=True)
        if t.is_store_root:
            raise ToolError(f"Cannot delete {t.raw}: it is the directory of store {t.store} (EACCES); "
                            "delete the files in it instead")
        rec = self._record(t.in_store, t.path)
        targets = [rec] if rec is not None else self._under(t.in_store, t.path)
        if not targets:
            raise ToolError(f"The path {t.raw} does not exist")
        for r in targets:
            self._delete_one(t, r)
        return f"Successfully deleted {t.raw}"

    def _delete_one(self, t: Target, rec: Record) -> None:
        def attempt() -> str | None:
            nonlocal rec
            try:
                self.svc.delete_record(self.p, t.in_store, rec.id, f'"{rec.sha256}"')
                return "done"
            except ServiceError as e:
                if e.code == "record_not_found":
                    return "gone"  # deleted concurrently: what we wanted
                if e.code != "precondition_failed":
                    raise self._refusal(t, e) from None
            current = self._record(t.in_store, rec.path)
            if current is None or current.id != rec.id:
                return "gone"
            rec = current
            return None

        self._retrying(t, attempt)

    def rename(self, c: Mapping[str, Any]) -> str:
        old = parse_path(c.get("old_path"), "old_path")
        new = parse_path(c.get("new_path"), "new_path")
        if old.is_root:
            raise ToolError("Cannot rename the /memories directory itself")
        atts = self._attachments()
        if old.store not in atts:
            raise ToolError(f"The path {old.raw} does not exist")
        self._attachment(old, write=True)
        if new.is_root or (new.is_store_root and new.store in atts):
            raise ToolError(f"The destination {new.raw} already exists")
        if old.is_store_root:
            raise ToolError(f"Cannot rename {old.raw}: it is the directory of store {old.store} (EACCES)")
        if new.store not in atts:
            raise ToolError(f"Cannot rename {old.raw} to {new.raw}: store {new.store} is not attached "
                            f"to this workspace (ENOENT); {ROOT} holds one directory per store")
        if new.store != old.store:
            raise ToolError(f"Cannot rename {old.raw} to {new.raw}: they are in different stores (EXDEV); "
                            "create the file in the other store and delete this one")
        if self._record(new.store, new.path) is not None or self._is_dir(new.store, new.path):
            raise ToolError(f"The destination {new.raw} already exists")
        rec = self._record(old.store, old.path)
        if rec is None and not self._is_dir(old.store, old.path):
            raise ToolError(f"The path {old.raw} does not exist")
        if new.path.startswith(old.path + "/"):
            raise ToolError(f"Cannot rename {old.raw} to {new.raw}: a directory cannot move inside itself (EINVAL)")
        anc = self._file_ancestor(new.store, new.path)
        if anc is not None:
            raise ToolError(f"Cannot rename {old.raw} to {new.raw}: {ROOT}/{new.store}/{anc} is a file (ENOTDIR)")
        try:
            if rec is not None:
                self.svc.move_record(self.p, old.store, rec.id, RecordMove(path=new.path, replace=False))
            else:
                self.svc.move_prefix(self.p, old.store, PrefixMove(from_prefix=old.path, to_prefix=new.path))
        except ServiceError as e:
            if e.code == "path_exists":
                raise ToolError(f"The destination {new.raw} already exists") from None
            if e.code == "record_not_found":
                raise ToolError(f"The path {old.raw} does not exist") from None
            raise self._refusal(new, e) from None
        return f"Successfully renamed {old.raw} to {new.raw}"

    # ------------------------------------------------------------ memfuse's own commands

    def search(self, c: Mapping[str, Any]) -> str:
        """``query`` (literal text, case-insensitive unless ``case_sensitive``) in the files
        under ``path`` (default ``/memories``): ``<path>:<line>: <text>`` per matching line,
        at most ``SEARCH_MAX_RESULTS`` (``max_results`` asks for fewer), each line cut at
        ``SEARCH_MAX_LINE_CHARS`` characters. The database finds the files
        (``Service.search``, one bounded page at a time): the search stops reading once
        the lines to show are found, so what is left out is counted over the files read
        (``N more``), or given as a floor (``N+ more``) when more files may match."""
        query = c.get("query")
        if not isinstance(query, str) or not query:
            raise ToolError("Parameter `query` is required and must be a non-empty string")
        try:
            check_query(query)
        except ServiceError as e:
            raise ToolError(f"Parameter `query`: {e.detail}") from None
        t = parse_path(c.get("path") or ROOT)
        limit = c.get("max_results", SEARCH_MAX_RESULTS)
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ToolError("Parameter `max_results` must be a positive integer")
        limit = min(limit, SEARCH_MAX_RESULTS)
        case_sensitive = bool(c.get("case_sensitive", False))
        stores = sorted(self._attachments()) if t.is_root else [self._attachment(t).store.slug]
        if c.get("rank"):
            if case_sensitive:
                raise ToolError("Parameter `case_sensitive` does not apply to a ranked search (`rank`)")
            return self._ranked_search(query, t, stores, limit)
        hits: list[str] = []
        more = 0
        unsure = False  # files not read may match too
        for slug in stores:
            if unsure:
                break
            cursor = None
            while True:
                want = limit - len(hits)
                page = self.svc.search(self.p, slug, query, match="content", prefix=t.path,
                                       case_sensitive=case_sensitive, cursor=cursor,
                                       limit=min(max(want, 20), SEARCH_PAGE), max_lines=max(want, 0))
                for h in page.hits:
                    for ln in h.lines[:max(limit - len(hits), 0)]:
                        hits.append(f"{ROOT}/{slug}/{h.record.path}:{ln.line}: {ln.text}")
                        more -= 1
                    more += h.line_matches
                cursor = page.next_cursor
                if cursor is None:
                    break
                if len(hits) >= limit:
                    unsure = True
                    break
        if not hits:
            return f"No matches for {query!r} in {t.raw}"
        text = "\n".join(hits)
        if more or unsure:
            if more:
                what = f"{more}{'+' if unsure else ''} more matching line(s) not shown"
            else:  # the lines shown filled the bound exactly; files not read may match too
                what = f"the search stopped after {len(hits)} lines; other files may match too"
            text += f"\n[memfuse: {what}; narrow the search with `path` or a longer query]"
        return text

    def _ranked_search(self, query: str, t: Target, stores: list[str], limit: int) -> str:
        """``search`` with ``rank``: the files holding every word of ``query`` (word
        prefixes, any case) by the full-text index, best first over every store searched
        (``Service.search`` with ``order="relevance"``, one page per store); per file its
        lines holding a word as ``<path>:<line>: <text>``, or ``<path>`` alone for a file
        found by its path; at most ``limit`` lines in all."""
        found = []
        for slug in stores:
            try:
                page = self.svc.search(self.p, slug, query, match="any", prefix=t.path, order="relevance",
                                       limit=SEARCH_PAGE, max_lines=SEARCH_MAX_RESULTS)
            except ServiceError as e:
                raise ToolError(f"Parameter `query`: {e.detail}") from None
            found += [(h.score or 0.0, slug, h) for h in page.hits]
        found.sort(key=lambda x: -x[0])
        out: list[str] = []
        more = 0
        for _, slug, h in found:
            where = f"{ROOT}/{slug}/{h.record.path}"
            if not h.lines:
                if len(out) < limit:
                    out.append(where)
                else:
                    more += 1
                continue
            for ln in h.lines:
                if len(out) < limit:
                    out.append(f"{where}:{ln.line}: {ln.text}")
                else:
                    more += 1
            more += h.line_matches - len(h.lines)
        if not out:
            return f"No files hold every word of {query!r} in {t.raw}"
        text = "\n".join(out)
        if more:
            text += f"\n[memfuse: {more} more matching line(s) not shown; best files first]"
        return text

    def history(self, c: Mapping[str, Any]) -> str:
        """The versions of the file at ``path`` (also a deleted one), newest first (at most
        ``HISTORY_MAX_VERSIONS``, then a line saying which are left out); with
        ``version``, that version's content (line-numbered and bounded like ``view``)."""
        t = parse_path(c.get("path"))
        if t.is_root or t.is_store_root:
            raise ToolError(f"The path {t.raw} is not a file.")
        self._attachment(t)
        page = self.svc.list_records(self.p, t.in_store, path=t.path, limit=RECORDS_PAGE_MAX, include_deleted=True)
        if not page.records:
            raise ToolError(f"The path {t.raw} does not exist. Please provide a valid path.")
        rec = max(page.records, key=lambda r: (not r.deleted, r.updated_at))
        version = c.get("version")
        if version is not None:
            if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= INT64_MAX:
                raise ToolError(f"Parameter `version` must be an integer from 1 to {INT64_MAX}")
            try:
                v = self.svc.get_version(self.p, t.in_store, rec.id, version)
            except ServiceError as e:
                if e.code == "version_not_found":
                    raise ToolError(f"{t.raw} has no version {version}") from None
                raise
            if v.pruned:
                return (f"Version {version} of {t.raw} was pruned by the store's history budget: "
                        "its content is gone")
            if v.content is None:
                return f"Version {version} of {t.raw} was redacted: its content is gone"
            return self._view_file(t, v.content, c.get("view_range"))
        newest = self.svc.list_versions(self.p, t.in_store, rec.id, limit=HISTORY_MAX_VERSIONS, newest_first=True)
        lines = [f"History of {t.raw} (newest first; `version` shows one):"]
        for v in newest.versions:
            where = f"{ROOT}/{t.store}/{v.path}"
            size = "redacted" if v.redacted else f"pruned ({format_size(v.size)})" if v.pruned else format_size(v.size)
            lines.append(f"v{v.version}\t{v.created_at.strftime('%Y-%m-%dT%H:%M:%SZ')}\t{v.operation.value}"
                         f"\t{v.actor}\t{size}\t{where}")
        if newest.next_cursor is not None:  # the oldest are left out: each is still shown by `version`
            lines.append(f"[memfuse: the versions before v{newest.next_cursor} are not shown; `version` shows one]")
        return "\n".join(lines)

    def remember(self, c: Mapping[str, Any]) -> str:
        """Append ``- <fact>`` (whitespace collapsed to one line) to ``notes.md`` at the root
        of ``store`` (default: the workspace's own store when attached read-write, else the
        first read-write store), unless that exact line is there. Past the record size
        limit it refuses (``EFBIG``); it never truncates."""
        fact = c.get("fact")
        if not isinstance(fact, str) or not fact.split():
            raise ToolError("Parameter `fact` is required and must be a non-empty string")
        line = "- " + " ".join(fact.split())
        atts = self._attachments()
        store = c.get("store")
        if store in (None, ""):
            writable = [s for s, a in sorted(atts.items()) if a.access == Access.read_write]
            if not writable:
                raise ToolError("Cannot remember: no store is attached read-write to this workspace (EROFS)")
            own = keys.public(self.workspace)  # its own store has its public name
            store = own if own in writable else writable[0]
        if not isinstance(store, str):
            raise ToolError("Parameter `store` must be a store slug")
        t = parse_path(f"{ROOT}/{store}/{NOTES_FILE}")
        self._attachment(t, write=True, creating=True)

        def attempt() -> str | None:
            rec = self._record(store, NOTES_FILE)
            if rec is None:
                try:
                    self.svc.create_record(self.p, store, RecordCreate(path=NOTES_FILE, content=line + "\n"))
                except ServiceError as e:
                    if e.code == "path_exists":
                        return None  # created concurrently: read it and append
                    raise self._refusal(t, e) from None
                return f"Remembered in {t.raw}: {line}"
            content = rec.content or ""
            if line in split_lines_keeping_cr(content.replace("\r\n", "\n")):
                return f"Already remembered in {t.raw}: {line}"
            lines = split_lines_keeping_cr(content)
            lines.append(line)
            return f"Remembered in {t.raw}: {line}" if self._put(t, rec, "\n".join(lines) + "\n") else None

        return self._retrying(t, attempt)
