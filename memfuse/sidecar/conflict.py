"""The conflict protocol: how a write that met a concurrent change is resolved.

A ``put`` carries ``If-Match`` the sha256 of the version it was written on (``put_base``). When
the control plane answers ``412`` (the record changed elsewhere meanwhile):

- the record already holds what the put carries because this write was applied before (its
  answer lost; proved by its idempotency keys, ``applied_before``): nothing to do. The same
  content alone proves nothing (two mounts appending the same line on one base): it is
  rebased like any other;
- an **append** (the put's content is its base's content plus a suffix: ``echo >> f``) is
  rebased: the current content plus that suffix;
- any other change becomes a **three-way line merge** of base, current and local content
  (``merge_lines``) when the two changes touch disjoint lines (or both only add lines at
  the end: kept as two appends, theirs first; or they touch without a common changed line
  and the place of every added line is fixed: ``_merge_touching``, attack 27 F3);
- else last writer wins: the put is sent unconditionally, marked ``overwrite`` with the
  version it was made on (the control plane records the version it replaced and the writers
  of every version after that base, whose changes it drops, and the change feed tells each:
  ``Change.overwrote``, ``stores.StoreSync.told_overwritten``), the other version stays in
  the record's history, and the conflict is reported (``on_conflict``: a line in
  ``errors.log``).

A record deleted elsewhere is created again; a path created elsewhere is taken over (last
writer wins). A merged put whose file was written again before the merge came back leaves a
*merge state* (``ConflictResolver.merged``, kept in the journal's ``merges`` table): the next
put of that file is based on the local content the merged put carried, so it is merged onto
the merge in turn (memfuse/sidecar/INVARIANTS.md, "Merges").

``AnsweredClient`` stands in for the API client for an entry whose first request was
answered inside a batch (``committer.Committer``).
"""
from __future__ import annotations

import logging
import os
from contextlib import aclosing
from typing import Any, Callable

import trio

from ..client import ApiClient
from ..errors import ApiError, Conflict, NotFound, PermanentError, PreconditionFailed, TransientError
from ..defs import sha256_hex
from ..diffwork import DiffTooCostly, WorkBudget, bounded_matcher
from ..wire import Record
from .identity import RecordIds
from .inodes import ABSENT_BASE, UNKNOWN_BASE
from .journal import Entry, Journal

log = logging.getLogger("memfuse.outbox")

__all__ = ["APPEND_MIN_BYTES", "MERGE_ROUNDS", "AnsweredClient", "ConflictResolver", "local_refusal", "merge_lines"]

MERGE_ROUNDS = 8  # rebase attempts of one append racing other writers, then back off
#: a put of fewer bytes is sent whole even when it is an append (the suffix would not save
#: what looking its base up costs)
APPEND_MIN_BYTES = 1024

#: a merge state: (sha256 and bytes of the local content a merged put carried, sha256 the
#: control plane holds after the merge)
MergeState = tuple[str, bytes, str]


class ConflictResolver:
    """Sends ``put`` entries and resolves the ones that meet a concurrent change (see the
    module's docstring).

    ``ids``: the record identity shared with the filesystem; ``journal``: where merge states
    are kept. ``base_content(sha256)``: the bytes of a version this sidecar had (the blob
    cache), None when gone: the base of a rebase. ``on_conflict(entry, what)``: a write was
    resolved last-writer-wins (``what``: one sentence for ``errors.log``); an exception in it
    is logged, never raised. Counters: ``conflicts`` (last writer won), ``merges`` (rebased).
    """

    def __init__(self, ids: RecordIds, journal: Journal, metrics: Any = None, *,
                 base_content: Callable[[str], bytes | None] | None = None,
                 on_conflict: Callable[[Entry, str], None] | None = None) -> None:
        self.ids = ids
        self.journal = journal
        self.metrics = metrics
        self.base_content: Callable[[str], bytes | None] = base_content or (lambda sha: None)
        self.on_conflict: Callable[[Entry, str], None] = on_conflict or (lambda e, what: None)
        self.conflicts = 0
        self.merges = 0  # puts rebased onto a concurrent change instead of overwriting it
        #: node key -> merge state: a later put of that file, written before the merge came
        #: back, derives from the local content, not the merge, and is rebased onto it too
        #: (``put_base``); dropped once the file shows the merge (``forget_merge``) or the
        #: next put was sent
        self.merged: dict[str, MergeState] = journal.load_merges()

    def replayed(self, keep: set[str] | frozenset[str] = frozenset()) -> None:
        """The outbox a previous process left is queued again (``Committer.replay``, its
        content shown on the tree): the merge state of a file with a queued put (its node
        key in ``keep``) still bases that put and is dropped when the put is sent, as in
        the process that wrote it; every other one is obsolete (the file shows the
        control plane's content): dropped."""
        for key in list(self.merged):
            if key not in keep:
                self.set_merged(key, None)

    def forget_merge(self, node_key: str) -> None:
        """The file ``node_key`` now shows the merged content of its last put (nothing was
        written on top meanwhile): later puts derive from it, so nothing to rebase."""
        self.set_merged(node_key, None)

    def set_merged(self, node_key: str, value: MergeState | None) -> None:
        """Change ``merged[node_key]`` (None: drop it) and queue the same in the journal."""
        if value is None:
            if self.merged.pop(node_key, None) is not None:
                self.journal.set_merge(node_key, None)
        elif self.merged.get(node_key) != value:
            self.merged[node_key] = value
            self.journal.set_merge(node_key, value)

    def conflict(self, e: Entry, what: str) -> None:
        """``e`` was resolved last-writer-wins: count it and tell ``on_conflict``."""
        self.conflicts += 1
        if self.metrics is not None:
            self.metrics.conflicts.inc()
        try:
            self.on_conflict(e, what)
        except Exception:
            log.exception("conflict handler failed")

    def put_base(self, e: Entry) -> tuple[str | None, str | None, bytes | None]:
        """(record id, the sha256 the put's ``If-Match`` names, that version's bytes when
        known here already) of a ``put``: the last known sha256 of its record, unless the
        previous put of the same file was merged (``merged``) and the control plane still
        holds that merge: this put was written on the local content before the merge came
        back, so its base is that local content (the ``If-Match`` then fails and the put is
        rebased onto the merge, ``rebase``). A put whose args hold ``base`` (an overwrite
        of a file the feed changed after a reader here was served it, ``Node.read_base``;
        for coalesced puts the oldest one's) is based on that version instead."""
        rid, sha = self.ids.get(e.node_key, e.store)
        # an overwrite written on a version older than the last one seen here (the feed
        # applied a rival change after a reader was served it: ``Node.read_base``, carried
        # as ``args["base"]``) is based on that version; a coalesced put on its oldest's
        first = e.absorbed[0] if e.absorbed else e
        read_base = first.args.get("base")
        if rid is not None and read_base and read_base != sha:
            return rid, read_base, None
        m = self.merged.get(e.node_key) if e.node_key else None
        if rid is not None and m is not None and sha == m[2]:
            # an overwrite written on what readers here were served before a write here
            # that was merged onto a rival change (``Node.served``: sed -i read, echo >>
            # appended, its merge not shown yet): based on that, so the rival lines it
            # never read are merged in, not dropped (attack report 11, F3)
            served = self.served(e)
            if served:
                return rid, served, None
            return rid, m[0], m[1]
        return rid, sha, None

    @staticmethod
    def served(e: Entry) -> str | None:
        """The sha256 of the content readers here were served before a write here changed
        the file, carried by an overwrite (``args["served"]``, ``Node.served``; of coalesced
        puts the first that carries one), None when it carries none."""
        return next((a.args["served"] for a in (*e.absorbed, e) if a.args.get("served")), None)

    def merge_base(self, e: Entry, sha: str | None, base: bytes | None) -> tuple[str | None, bytes | None]:
        """(sha256, bytes when known here) of the version a put that met a concurrent change
        (``412`` on ``If-Match`` ``sha``, ``put_base``) is merged from (``rebase``): ``sha``,
        except for an overwrite written on what readers here were served before this mount's
        own writes that committed without a merge (``served``, while ``sha``, the record's
        last known version, is this mount's own commit on top of it: no rival change is
        known here, none was shown). Its ``If-Match`` stays ``sha``, so with no rival change
        it is the last writer, as on a local disk (its own lines written after the read
        go, as sed's rename drops them there); a rival change since is merged from the
        version the writer read (verify 11, F3 with three mounts: based on the own version,
        whose appended lines the writer never read, the rewrite deletes them where the
        rival lines were added after them, an overlap, and the rival lines were dropped by
        last writer wins). The own lines come back with the merge: they are on the control
        plane and the writer never saw them (a three-way merge keeps what one side added)."""
        served = self.served(e)
        first = e.absorbed[0] if e.absorbed else e
        if not served or served == sha or first.args.get("base") or e.args.get("base"):
            return sha, base  # nothing else read, or based on it already (``put_base``)
        m = self.merged.get(e.node_key) if e.node_key else None
        if m is not None and sha == m[0]:
            return sha, base  # based on the merge state (``put_base``)
        return served, None

    def append_suffix(self, e: Entry, sha: str | None, base: bytes | None) -> bytes | None:
        """What a ``put`` adds at the end of the version it was written on, when it is an
        append (``echo >> f``): the put's content minus that version's bytes (``base``, else
        the blob cache's copy of ``sha``), or None when it is not one or the base's bytes are
        not known here (the put is then sent whole). An append is sent as only the suffix
        (``ApiClient.append_record``, ``If-Match`` ``sha``, idempotency key
        ``<key>-append``): the same outcome as the whole content, with fewer bytes."""
        local = e.content or b""
        if sha is None or sha in (UNKNOWN_BASE, ABSENT_BASE) or len(local) < APPEND_MIN_BYTES:
            return None
        ab = e.append_base
        if base is None and ab is not None and ab[0] == sha and 0 < ab[1] < len(local):
            return local[ab[1]:]  # checked at commit: local starts with sha's content
        if base is None:
            base = self.base_content(sha)
        if base is None or len(local) <= len(base) or not local.startswith(base):
            return None
        return local[len(base):]

    async def put(self, e: Entry, c: ApiClient, a: dict[str, Any]) -> None:
        """Create or update the record with the entry's content and attributes (``If-Match``
        the sha256 of the version it was written on, ``put_base``). On ``412`` an append
        (the content is that version's plus a suffix) is rebased onto the current version
        (``rebase``); any other concurrent change is resolved last-writer-wins
        (``conflict``); a record deleted elsewhere is created again. A put known only as
        an append on a version (``Entry.suffix_only``) is ``put_suffix``'s."""
        if e.content is None and e.suffix_only is not None:
            await self.put_suffix(e, c, a)
            return
        rid, sha, base = self.put_base(e)
        # an append sends (and decodes) only its suffix; the whole text is decoded once a
        # request needs it (``_Text``)
        suffix = self.append_suffix(e, sha, base) if rid is not None else None
        appended = None
        if suffix is not None:
            try:
                appended = suffix.decode("utf-8")
            except UnicodeDecodeError:
                suffix = None
        text = _Text(e.content or b"")
        if suffix is None:
            text.check()
        e.merged = None
        want = e.content_sha() or sha256_hex(b"")
        typ = a.get("type")
        # absent in entries journaled by earlier releases: then the server keeps / defaults
        attrs = {"mode": a.get("mode"), "mtime_ns": a.get("mtime_ns")}
        create_key = e.key
        if rid is not None:
            create_key = e.key + "-create"

            sent_key = e.key + "-append" if appended is not None and sha is not None else e.key
            try:
                if appended is not None and sha is not None:
                    rec = await c.append_record(e.store, rid, appended, if_match=sha, type=typ,
                                                idempotency_key=sent_key, **attrs)
                else:
                    rec = await c.update_record(e.store, rid, text.check(), type=typ, if_match=sha,
                                                idempotency_key=sent_key, **attrs)
            except PreconditionFailed:
                cur = await c.get_record(e.store, rid, content=True)
                merged = None
                same = (cur.sha256 == want and (typ is None or cur.type == typ)
                        and attrs["mode"] in (None, cur.mode)
                        and attrs["mtime_ns"] in (None, cur.mtime_ns))
                if same and await self.applied_before(e, c, rid, sent_key):
                    rec = cur  # this write, applied before (its answer lost)
                elif (merged := await self.rebase(e, c, rid, *self.merge_base(e, sha, base), cur)) is not None:
                    rec = merged  # e.g. an identical append by another writer: both kept
                elif same:
                    rec = cur  # a whole write of the content already there: nothing lost
                else:  # last writer wins, said in errors.log and the log
                    if sha == UNKNOWN_BASE:
                        why = ("a reader of this file was served parts of two versions (its reads "
                               "straddled a change, or one version at the size of another), so "
                               "this write may hold lines no one wrote (a line cut or doubled): "
                               "check it")
                        what = "written on parts of two versions"
                    elif sha == ABSENT_BASE:  # Filesystem._create_existing
                        why = ("the path was created elsewhere while this file was created "
                               "here")
                        what = "path created elsewhere"
                    else:
                        why, what = "the record changed elsewhere", "record changed elsewhere"
                    self.conflict(e, f"{why}; this write is now the latest version, the other one "
                                     "stays in history")
                    log.warning(f"conflict: {what}; last writer wins, the other version stays in history",
                                extra={"store": e.store, "path": a.get("path"), "record": rid})
                    # the version it was made on: every writer of a later one is told
                    # (their changes go too), not only the writer of the version replaced
                    rec = await c.update_record(e.store, rid, text.check(), type=typ,
                                                idempotency_key=e.key + "-lww", overwrite=True,
                                                overwrite_base=sha, **attrs)
            except NotFound:
                rid = None  # deleted elsewhere: re-create it below
        if rid is None:
            try:
                rec = await c.create_record(e.store, a["path"], text.check(), type=typ,
                                            idempotency_key=create_key, **attrs)
            except Conflict as err:
                other = (err.problem or {}).get("record_id")
                if not other:
                    found = await c.find_record(e.store, a["path"])
                    other = found.id if found else None
                if other is None:
                    raise
                self.conflict(e, "the path was created elsewhere; this write is now the "
                                  "latest version of that record, the other stays in history")
                log.warning("conflict: path created elsewhere; last writer wins",
                            extra={"store": e.store, "path": a["path"], "record": other})
                rec = await c.update_record(e.store, other, text.check(), type=typ,
                                            idempotency_key=e.key + "-lww", overwrite=True,
                                            **attrs)
        e.record = rec
        self.ids.learn(e.node_key, rec)
        if e.node_key is not None:
            # this put was sent: its base is used; a merge of it is the next one's base
            # until the file shows it (forget_merge)
            if e.merged is not None and rec is not None and rec.sha256 != want:
                self.set_merged(e.node_key, (want, e.content or b"", rec.sha256))
            else:
                self.set_merged(e.node_key, None)

    async def applied_before(self, e: Entry, c: ApiClient, rid: str, refused: str) -> bool:
        """Whether a write of ``e`` was applied before (its answer lost): the control plane
        holds a request under one of the idempotency keys a put of ``e`` sends (``<key>``,
        ``-append``, ``-rebase``, ``-lww``, ``-create``; ``refused``, the key whose request
        was just answered 412, is known unused). Asked when a 412 shows the record already
        holding the put's content, which is no proof of its own: another writer may have
        made the same change (two mounts appending the same line on one base; attack
        finding 3). Each probe is a ``PUT`` under that key ``If-Match`` a tag no version
        has: a key that was used is answered from the idempotency store (its stored answer,
        or ``422 idempotency_key_reused``), one that was not fails the precondition and
        writes nothing (the server checks the key first, ``Writer.write``). Raises API
        errors other than those as the client raises them."""
        never = "memfuse-probe-" + sha256_hex(os.urandom(16))
        for key in (e.key, e.key + "-append", e.key + "-rebase", e.key + "-lww", e.key + "-create"):
            if key == refused:
                continue
            try:
                await c.update_record(e.store, rid, "", if_match=never, idempotency_key=key)
            except (PreconditionFailed, NotFound):
                continue  # not used: refused before anything was written
            except ApiError as err:
                if err.code != "idempotency_key_reused":
                    raise
            log.info("a write met its own earlier commit (its answer was lost)",
                     extra={"store": e.store, "record": rid, "entry": e.id, "key_kind": key[len(e.key):] or "put"})
            return True
        return False

    async def put_suffix(self, e: Entry, c: ApiClient, a: dict[str, Any]) -> None:
        """Send a put the journal holds only as bytes appended to a version whose content is
        gone here (``Entry.suffix_only``: its journal row was an append row, and the rows or
        blob holding its base are lost, e.g. by a machine crash). That base is a version the
        control plane committed (or a queued put of this file, committed before this one is
        sent): its content is read back from there (the current record, else the version
        of that sha256 in the record's history) and the put goes on as a whole one
        (``put``: an append on the current version, else a whole write ``If-Match`` it).
        When no version holds it, the bytes are appended to the current content (as
        ``rebase`` does for an append; key ``<key>-append``), which the file then shows
        (``e.merged``). Raises ``local_refusal("journal_lost")`` when they cannot be
        placed (the record is gone, or the row was damaged), API errors as the client
        raises them."""
        base_sha, suffix = e.suffix_only or ("", b"")
        rid = self.ids.get(e.node_key, e.store)[0]
        lost = ("this queued append's base is gone from the outbox journal and the cache, "
                "and the control plane cannot place it: write it again")
        if not base_sha or rid is None:
            raise local_refusal("journal_lost", lost)
        try:
            text = suffix.decode("utf-8")
        except UnicodeDecodeError:
            raise local_refusal("invalid_content", "content is not valid UTF-8") from None
        try:
            cur = await c.get_record(e.store, rid, content=True)
        except NotFound:
            raise local_refusal("journal_lost", lost) from None
        base = cur.content if cur.sha256 == base_sha else None
        if base is None:
            async with aclosing(c.iter_versions(e.store, rid, newest_first=True)) as history:
                async for v in history:  # newest first: pages read only until found
                    if v.sha256 == base_sha and not (v.redacted or v.pruned):
                        base = (await c.version(e.store, rid, v.version)).content
                        break
        log.info("a queued append whose base was gone here is rebuilt from the control plane",
                 extra={"store": e.store, "path": a.get("path"), "record": rid, "entry": e.id,
                        "base_sha256": base_sha, "found": base is not None})
        if base is not None:
            raw = base.encode("utf-8")
            e.content, e.suffix_only, e.sha = raw + suffix, None, None
            e.append_base = (base_sha, len(raw))
            await self.put(e, c, a)
            if e.merged is None and e.record is not None and e.record.sha256 == e.content_sha():
                e.merged = e.content  # the file shows it (it was not shown while queued)
            return
        if cur.deleted or cur.content is None:
            raise local_refusal("journal_lost", lost)
        kw = {"type": a.get("type"), "mode": a.get("mode"), "mtime_ns": a.get("mtime_ns")}
        try:
            rec = await c.append_record(e.store, rid, text, if_match=cur.sha256,
                                        idempotency_key=e.key + "-append", **kw)
        except PreconditionFailed:  # changed again meanwhile: start over, with backoff
            raise TransientError("the record changed while a queued append was placed; will retry",
                                 code="merge_contended") from None
        self.merges += 1
        e.merged = cur.content.encode("utf-8") + suffix
        e.record = rec
        self.ids.learn(e.node_key, rec)
        if e.node_key is not None:
            self.set_merged(e.node_key, None)

    async def rebase(self, e: Entry, c: ApiClient, rid: str, base_sha: str | None,
                      base: bytes | None, cur: Record) -> Record | None:
        """Merge a write that met a concurrent change (412) instead of overwriting it, when
        that is clean: an **append** (the put's content is its base version's content plus
        a suffix: ``echo >> f``) becomes the current content plus that suffix; any other
        change becomes a **three-way line merge** of base, current and local content
        (``merge3``, the Breezy project's merge) when the two changes touch disjoint
        regions (or touch without a common changed line: ``merge_lines``). The result is written ``If-Match`` the current version, again (at most
        ``MERGE_ROUNDS``) if that changes meanwhile. ``cur``: the current record, with
        content. Returns the record written (``e.merged`` set to its content), or None when
        the changes overlap, or the base's content is not known here (``base_content``):
        last writer wins then.

        The merge is sent with one idempotency key (``<key>-rebase``): the control plane
        stores only answered writes, so a merge whose answer was lost (even across a
        restart) is met again as ``422 idempotency_key_reused`` on the retry's new body,
        which means it was applied: the current record is then the result. Raises
        ``TransientError`` (``merge_contended``) when other writers won ``MERGE_ROUNDS``
        times in a row (the entry backs off and tries again); API errors as the client
        raises them."""
        local = e.content or b""
        if base_sha in (UNKNOWN_BASE, ABSENT_BASE):
            # written on parts of two versions (Handle.across), or on none (a create that
            # opened a record made elsewhere just before, Filesystem._create_existing)
            return None
        ab = e.append_base
        if base is None and base_sha and ab is not None and ab[0] == base_sha and ab[1] <= len(local):
            base = local[:ab[1]]  # the put extends that version (checked when it was made)
        if base is None and base_sha:
            base = self.base_content(base_sha)
        if base is None or cur.deleted or cur.content is None:
            return None
        kind = "append" if local.startswith(base) else "three_way"
        typ = e.args.get("type")
        attrs = {"mode": e.args.get("mode"), "mtime_ns": e.args.get("mtime_ns")}
        for attempt in range(1, MERGE_ROUNDS + 1):
            theirs = cur.content.encode("utf-8")
            if kind == "append":
                new = theirs + local[len(base):]
            else:
                try:
                    three_way = await trio.to_thread.run_sync(merge_lines, base, theirs, local)
                except DiffTooCostly as err:
                    # too costly to merge (attack 13 F12): last writer wins, as for an
                    # overlap; the other version stays in history, nothing is lost
                    log.warning("merge too costly; last writer wins", extra={
                        "store": e.store, "path": e.args.get("path"), "record": rid,
                        "work_limit": err.limit, "local_bytes": len(local),
                        "theirs_bytes": len(theirs), "entry": e.id})
                    return None
                if three_way is None:
                    return None  # the changes overlap: last writer wins
                new = three_way
            try:
                rec = await c.update_record(e.store, rid, new.decode("utf-8"), type=typ,
                                            if_match=cur.sha256,
                                            idempotency_key=e.key + "-rebase", **attrs)
            except PreconditionFailed:
                cur = await c.get_record(e.store, rid, content=True)
                if cur.deleted or cur.content is None:
                    return None
                continue
            except ApiError as err:
                if err.code != "idempotency_key_reused":
                    raise
                # applied before, its answer lost: what it wrote is in the current record
                rec = await c.get_record(e.store, rid, content=True)
                new = (rec.content or "").encode("utf-8")
            self.merges += 1
            if self.metrics is not None:
                self.metrics.merges.inc()
            e.merged = new
            log.info("write merged onto a concurrent change", extra={
                "store": e.store, "path": e.args.get("path"), "record": rid, "kind": kind,
                "base_sha256": base_sha, "theirs_sha256": cur.sha256,
                "merged_sha256": rec.sha256, "local_bytes": len(local),
                "merged_bytes": len(new), "attempt": attempt, "entry": e.id})
            return rec
        raise TransientError(f"merge lost {MERGE_ROUNDS} races in a row; will retry",
                             code="merge_contended")

class _Text:
    """A put's content as the text a request sends, decoded once, when first needed
    (``check``): an append that goes as its suffix never decodes the whole file."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.text: str | None = None

    def check(self) -> str:
        """The text; raises ``local_refusal("invalid_content")`` when it is not UTF-8."""
        if self.text is None:
            text = self.data.decode("utf-8", errors="surrogateescape")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise local_refusal("invalid_content", "content is not valid UTF-8") from None
            self.text = text
        return self.text


class AnsweredClient:
    """The client for an entry whose first request was answered inside a batch: that one
    call (``op``'s method) returns, or raises, the batch's answer, once; every other call
    goes to the real client."""

    _METHODS = {"create": "create_record", "update": "update_record", "append": "append_record",
                "attrs": "set_attributes",
                "move": "move_record", "delete": "delete_record"}

    def __init__(self, client: ApiClient, op: str, outcome: Any) -> None:
        self._client = client
        self._method = self._METHODS[op]
        self._outcome: Any = outcome

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if name != self._method or self._outcome is _USED:
            return attr

        async def answered(*args: Any, **kwargs: Any) -> Any:
            outcome, self._outcome = self._outcome, _USED
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome

        return answered


_USED = object()


def merge_lines(base: bytes, theirs: bytes, ours: bytes, budget: WorkBudget | None = None) -> bytes | None:
    """The three-way merge of two changes of ``base`` line by line (``merge3.Merge3``,
    as ``bzr merge`` / ``diff3``): the merged content when the changes touch disjoint
    regions (or make the same change), None when they conflict. Where ``diff3`` sees a
    conflict because the two changes *touch* (no line between them that neither changed),
    the region is split into each side's own hunks (``_merge_touching``) and merged when
    no base line is changed by both and the place of every added line is fixed by the
    base lines around it: lines one side inserted right before or right after lines the
    other changed or deleted go before / after that change (attack 27 F3: another mount's
    appended lines next to this mount's ``sed -i`` of the line before them were lost by
    last writer wins). Both adding lines at the end of ``base`` is what two appenders do,
    kept as ``rebase`` keeps an append (theirs, then ours), not a conflict: an overwrite
    that carries this mount's own queued appends (coalesced with them, e.g. ``sed -i``
    after ``echo >>`` while the control plane was down) meets the other mount's appends
    there (attack report 12, A9). When theirs only appended whole lines to ``base``, ours
    changing its last lines keeps them after ours (``_after_their_append``; attack 15 F5).
    Still conflicts: a line changed on both sides (differently), both inserting at one
    place other than the end (which first?), one side inserting between two lines the
    other changed (where?), two changes of adjacent lines (as ``diff3``), and any merge
    that would join a partial last line (no newline) to another line. Pure;
    ``ConflictResolver.rebase`` runs it in a worker thread. Its work is bounded
    (``memfuse.diffwork``: ``budget``, default ``DIFF_WORK_BUDGET`` lines scanned, shared
    by all its line diffs): raises ``DiffTooCostly`` past it (attack 13 F12: quadratic in
    lines on hostile input), and the caller falls back to last writer wins."""
    import merge3

    matcher = bounded_matcher(budget or WorkBudget())
    b_lines = base.splitlines(keepends=True)
    t_lines = theirs.splitlines(keepends=True)
    o_lines = ours.splitlines(keepends=True)
    m = merge3.Merge3(b_lines, t_lines, o_lines, sequence_matcher=matcher)  # type: ignore[arg-type]
    out: list[bytes] = []
    for region in m.merge_regions():
        what = region[0]
        if what == "unchanged":
            out.extend(b_lines[region[1]:region[2]])
        elif what in ("a", "same"):
            out.extend(t_lines[region[1]:region[2]])
        elif what == "b":
            out.extend(o_lines[region[1]:region[2]])
        else:
            _, zs, ze, ts, te, os_, oe = region  # type: ignore[misc]
            merged = _merge_touching(b_lines[zs:ze], t_lines[ts:te], o_lines[os_:oe],
                                     ze == len(b_lines), matcher)
            if merged is None:
                return _after_their_append(base, theirs, ours)
            out.extend(merged)
    if any(not line.endswith(b"\n") for line in out[:-1]):
        return None  # a partial line joined to the next: a line no one wrote
    return b"".join(out)


#: one side's change of a conflict region: (first base line, end, the lines put there)
_Hunk = tuple[int, int, list[bytes]]


def _hunks(base: list[bytes], side: list[bytes], matcher: Callable[..., Any]) -> list[_Hunk]:
    """``side``'s changes of ``base`` (its line diff's non-equal opcodes)."""
    return [(i1, i2, side[j1:j2])
            for tag, i1, i2, j1, j2 in matcher(None, base, side).get_opcodes()
            if tag != "equal"]


def _merge_touching(base: list[bytes], theirs: list[bytes], ours: list[bytes], at_end: bool,
                    matcher: Callable[..., Any]) -> list[bytes] | None:
    """One region ``diff3`` calls a conflict (``base`` lines changed to ``theirs`` on one
    side, to ``ours`` on the other, with no line in between that both left alone), merged
    hunk by hunk: each side's hunks (its line diff of the region) are kept in base order
    when no two of them conflict. Two hunks of the two sides conflict when they change a
    common base line (unless they are the same change: kept once), change adjacent lines
    (both replacing or deleting lines: ``diff3``'s rule, kept), both insert at one place
    (which first? unless at the end of the file, ``at_end``: two appenders, theirs first),
    or one inserts strictly inside the lines the other changed (where?). An insertion right
    before or right after the other side's changed lines is not a conflict: the base line
    it follows or precedes fixes its place. None on a conflict."""
    th, oh = _hunks(base, theirs, matcher), _hunks(base, ours, matcher)
    kept: list[tuple[int, int, int, list[bytes]]] = [(i1, i2, 0, lines) for i1, i2, lines in th]
    for j1, j2, lines in oh:
        same = False
        for i1, i2, t_added in th:
            if (i1, i2, t_added) == (j1, j2, lines):
                same = True  # the same change on both sides
            elif i1 < i2 and j1 < j2:
                if i1 <= j2 and j1 <= i2:
                    return None  # a common line changed, or adjacent lines changed
            elif i1 == i2 and j1 == j2:
                if i1 == j1 and not (at_end and i1 == len(base)):
                    return None  # both insert at one place
            elif i1 == i2:
                if j1 < i1 < j2:
                    return None  # theirs inserted between lines ours changed
            elif i1 < j1 < i2:
                return None  # ours inserted between lines theirs changed
        if not same:
            kept.append((j1, j2, 1, lines))
    # in base order; at one place an insertion goes before a change starting there, and
    # theirs before ours (two appenders at the end)
    kept.sort(key=lambda h: (h[0], h[1] != h[0], h[2]))
    out: list[bytes] = []
    at = 0
    for i1, i2, _, lines in kept:
        out.extend(base[at:i1])
        out.extend(lines)
        at = i2
    out.extend(base[at:])
    return out


def _after_their_append(base: bytes, theirs: bytes, ours: bytes) -> bytes | None:
    """``ours`` then the whole lines ``theirs`` added after the end of ``base``, when that is
    all ``theirs`` did (another mount's ``echo >> f``) and ``ours`` ends a line; else None.
    The merge ``merge_lines`` gives for a rewrite that changed ``base``'s last lines (or
    all of a one-line file: ``sed -i`` of a journal's only line while another mount
    appends, attack 15 F5), which ``diff3`` counts as a conflict with an insertion right
    after them: the appended lines are kept after ours, as they would be after any other
    change of ours."""
    if len(theirs) <= len(base) or not theirs.startswith(base):
        return None
    if (base and not base.endswith(b"\n")) or (ours and not ours.endswith(b"\n")):
        return None  # a partial line: joining it to another would make a line no one wrote
    return ours + theirs[len(base):]


def local_refusal(code: str, detail: str) -> ApiError:
    """A refusal found before sending (as the control plane would answer it: 422 ``code``)."""
    return PermanentError(detail, status=422, code=code, detail=detail, problem={"code": code})
