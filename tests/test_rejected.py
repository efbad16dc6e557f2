"""Rejected files survive a restart (layer test, no FUSE): a file refused for good is kept in
the outbox journal's ``rejected`` table and put back, still rejected, when its store is loaded
by the next process; it is not sent again until it changes; a fix commits it and drops it from
the table, an unlink drops it too; ``status`` counts it apart from records and bytes. The same
through a real mount and a real restart: tests/test_rejected_mount.py."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import trio

from memfuse.sidecar.blobcache import BlobCache
from memfuse.sidecar.core import PENDING, REJECTED, Filesystem, FsError
from memfuse.sidecar.journal import PUT, Journal

from test_layers import Offline, rec, tree

BAD = b"notes: caf\xc3"  # a UTF-8 sequence cut at the end: accepted at write, EILSEQ at close


def start(tmp_path: Path, records) -> tuple[Filesystem, Journal]:
    j = Journal(tmp_path / "outbox.db")
    fs = Filesystem(BlobCache(tmp_path / "blobs.db"), Offline(), j, rejected=j.load_rejected())
    fs.controls.committed_size = lambda slug, rid: {"r1": 4, "r2": 4}.get(rid)
    fs.add_store("default", "read_write", list(records))
    return fs, j


def stop(fs: Filesystem, j: Journal) -> None:
    fs.sync_rejected()
    j.close()
    fs.blobs.close()


def write(fs: Filesystem, name: str, data: bytes, *, create: bool) -> object:
    sm = fs.stores["default"]
    if create:
        h = fs.create(sm.root.ino, name.encode(), 0o644, os.O_WRONLY | os.O_CREAT, 0, 0)
    else:
        h = fs.open(sm.root.children[name].ino, os.O_WRONLY | os.O_TRUNC)
    fs.write(h, 0, data)
    try:
        return fs.commit(h.node)
    finally:
        fs.release(h.fh)


def store_status(fs: Filesystem) -> dict:
    (st,) = fs.status()["stores"]
    return {k: st[k] for k in ("records", "bytes", "rejected", "rejected_bytes")}


def test_rejected_files_survive_a_restart_until_fixed_or_unlinked(tmp_path):
    records = [rec("r1", "a.md", "one\n"), rec("r2", "b.md", "two\n")]
    fs, j = start(tmp_path, records)
    with pytest.raises(FsError) as new:
        write(fs, "k.md", BAD, create=True)
    with pytest.raises(FsError) as over:
        write(fs, "a.md", BAD, create=False)
    assert new.value.errno == over.value.errno == errno.EILSEQ
    assert new.value.code == "invalid_content"
    # status: the control plane holds a.md (4 bytes) and b.md; k.md never reached it
    assert store_status(fs) == {"records": 2, "bytes": 8, "rejected": 2,
                                "rejected_bytes": 2 * len(BAD)}
    trio.run(j.flush_pending)
    stop(fs, j)

    fs, j = start(tmp_path, records)  # the next process: same cache, same records
    sm = fs.stores["default"]
    assert tree(fs) == {"a.md": BAD, "b.md": b"two\n", "k.md": BAD}
    k, a = sm.root.children["k.md"], sm.root.children["a.md"]
    assert (k.state, a.state) == (REJECTED, REJECTED)
    assert "UTF-8" in k.error and "UTF-8" in a.error
    assert a.record_id == "r1" and k.record_id is None
    assert fs.committer.depth() == 0  # nothing is sent again until it changes
    assert store_status(fs) == {"records": 2, "bytes": 8, "rejected": 2,
                                "rejected_bytes": 2 * len(BAD)}
    assert fs.getxattr(k, "user.memfuse.state") == b"rejected"

    # fix k.md in place: it is sent (a put in the outbox) and no longer kept as rejected
    e = write(fs, "k.md", b"notes: fixed\n", create=False)
    assert e is not None and e.op == PUT and k.state == PENDING
    # unlink a.md: its rejected content goes with it (and the record is deleted)
    fs.unlink(sm.root.ino, b"a.md")
    trio.run(j.flush_pending)
    assert {r["path"] for r in j.load_rejected()} == set()
    stop(fs, j)

    j = Journal(tmp_path / "outbox.db")
    assert j.load_rejected() == []
    assert [(e.op, e.args["path"]) for e in j.load()[0]] == [("put", "k.md"), ("delete", "a.md")]
    j.close()


def test_renamed_rejected_file_is_kept_at_its_new_path(tmp_path):
    fs, j = start(tmp_path, [])
    sm = fs.stores["default"]
    with pytest.raises(FsError):
        write(fs, "k.md", BAD, create=True)
    d = fs.mkdir(sm.root.ino, b"sub", 0o755, 0, 0)
    fs.rename(sm.root.ino, b"k.md", d.ino, b"moved.md", 0)
    trio.run(j.flush_pending)
    assert [(r["path"], r["errno"], r["code"]) for r in j.load_rejected()] == [
        ("sub/moved.md", errno.EILSEQ, "invalid_content")]
    stop(fs, j)
    fs, j = start(tmp_path, [])
    assert tree(fs) == {"sub/moved.md": BAD}
    assert fs.stores["default"].root.children["sub"].children["moved.md"].state == REJECTED
    stop(fs, j)


def test_path_taken_meanwhile_keeps_it_beside_with_a_trace(tmp_path):
    fs, j = start(tmp_path, [])
    for name in ("k.md", "m.md"):
        with pytest.raises(FsError):
            write(fs, name, BAD, create=True)
    trio.run(j.flush_pending)
    stop(fs, j)
    # meanwhile another sidecar made a record at that path: the rejected file is kept
    # beside it (before, it was dropped with an errors.log line: its content lost); the
    # other rejected file of the store, put back after it, keeps its row
    fs, j = start(tmp_path, [rec("r9", "k.md", "other\n")])
    assert tree(fs) == {"k.md": b"other\n", "k.rejected.md": BAD, "m.md": BAD}
    assert fs.stores["default"].root.children["k.rejected.md"].state == REJECTED
    (line,) = [e for e in fs.errors if e["path"] == "k.rejected.md"]
    assert line["errno"] == "EILSEQ" and "k.md" in line["reason"]
    fs.sync_rejected()
    trio.run(j.flush_pending)
    assert sorted(r["path"] for r in j.load_rejected()) == ["k.rejected.md", "m.md"]
    stop(fs, j)
    fs, j = start(tmp_path, [rec("r9", "k.md", "other\n")])
    assert tree(fs) == {"k.md": b"other\n", "k.rejected.md": BAD, "m.md": BAD}  # kept once
    stop(fs, j)


def test_errors_log_says_why_after_a_restart(tmp_path):
    """errors.log's lines are kept in the journal: after a restart the refusal of a file that
    is back (rejected) is still there, once, with its original time; a line about a file that
    is gone stays too (it is a log). A rejected file whose line is no longer kept (fell out of
    the last 200) gets it back, at the time it was refused, marked ``restored``."""
    fs, j = start(tmp_path, [])
    with pytest.raises(FsError):
        write(fs, "k.md", BAD, create=True)
    fs.note_error(None, "gone.md", errno.EPERM, "content looks like a secret", "", "default")
    before = list(fs.errors)
    assert [(e["path"], e["errno"], e["code"]) for e in before] == [
        ("k.md", "EILSEQ", "invalid_content"), ("gone.md", "EPERM", "secret_detected")]
    stop(fs, j)
    fs, j = start(tmp_path, [])
    assert fs.stores["default"].root.children["k.md"].state == REJECTED
    assert list(fs.errors) == before  # the same lines, not a second one for k.md
    assert fs.controls.content("errors").decode().splitlines()[0].startswith('{"time"')
    stop(fs, j)

    # more than the kept 200 lines since: k.md's refusal fell out of the log
    fs, j = start(tmp_path, [])
    for i in range(210):
        fs.note_error(None, f"n{i}.md", errno.EACCES, "read-only", "", "default")
    assert len(fs.errors) == 200 and all(e["path"] != "k.md" for e in fs.errors)
    stop(fs, j)
    fs, j = start(tmp_path, [])
    errs = list(fs.errors)
    assert len(errs) == 200
    (line,) = [e for e in errs if e["path"] == "k.md"]
    assert line == {**before[0], "restored": True}
    assert errs[0] == line  # the oldest refusal, placed in time order
    assert [e["path"] for e in errs[1:]] == [f"n{i}.md" for i in range(11, 210)]
    stop(fs, j)
    fs, j = start(tmp_path, [])
    assert [e for e in fs.errors if e["path"] == "k.md"] == [line]  # not added twice
    stop(fs, j)


def test_store_mounted_again_gets_its_rejected_files_back(tmp_path):
    fs, j = start(tmp_path, [])
    with pytest.raises(FsError):
        write(fs, "k.md", BAD, create=True)
    fs.remove_store("default")
    fs.sync_rejected()
    fs.add_store("default", "read_write", [])
    fs.sync_rejected()
    assert tree(fs) == {"k.md": BAD}
    assert fs.stores["default"].root.children["k.md"].state == REJECTED
    trio.run(j.flush_pending)
    assert [r["path"] for r in j.load_rejected()] == ["k.md"]
    stop(fs, j)


def test_refusal_log_line_names_store_path_errno_and_code_in_text_format(tmp_path):
    """``memfuse dev`` logs as text: the refusal's line carries the same fields as the JSON
    line (store, path, errno name, reason code, reason), never the content."""
    import io
    import logging

    from memfuse.sidecar.logs import JsonFormatter, TextFormatter

    fs, j = start(tmp_path, [])
    out = {"text": io.StringIO(), "json": io.StringIO()}
    handlers = []
    for kind, fmt in (("text", TextFormatter()), ("json", JsonFormatter())):
        h = logging.StreamHandler(out[kind])
        h.setFormatter(fmt)
        handlers.append(h)
        logging.getLogger("memfuse.fs").addHandler(h)
    try:
        with pytest.raises(FsError):
            write(fs, "notes dir.md", b"key: " + BAD, create=True)
    finally:
        for h in handlers:
            logging.getLogger("memfuse.fs").removeHandler(h)
    stop(fs, j)
    (text,) = [ln for ln in out["text"].getvalue().splitlines() if ": refused" in ln]
    assert " WARNING memfuse.fs: refused store=default " in text
    assert 'path="notes dir.md" errno=EILSEQ code=invalid_content reason="content is not' in text
    (js,) = [ln for ln in out["json"].getvalue().splitlines() if '"refused"' in ln]
    assert '"path": "notes dir.md", "errno": "EILSEQ", "code": "invalid_content"' in js
    assert "caf" not in text + js


def test_rejection_before_the_create_committed_keeps_the_record_id(tmp_path):
    """``: > e4.md`` then content refused at the next close (a UTF-8 sequence cut at the
    end: only the whole file shows it): the empty file's create is still in flight when the
    content is refused; the create lands afterwards. The node must
    learn the record's id anyway, so the kept rejected file finds its record at the next
    start (before, it had none and was dropped as "another record now has its path", and the
    empty stored version came back as ``clean``)."""
    fs, j = start(tmp_path, [])
    created = write(fs, "e4.md", b"", create=True)  # the create's put, not committed yet
    with pytest.raises(FsError) as refused:
        write(fs, "e4.md", BAD, create=False)
    assert refused.value.errno == errno.EILSEQ
    n = fs.stores["default"].root.children["e4.md"]
    assert n.last_put is None and n.state == REJECTED
    created.record = rec("r9", "e4.md", "")  # the create's answer arrives now
    fs._on_commit(created)
    assert (n.record_id, n.state) == ("r9", REJECTED)
    trio.run(j.flush_pending)
    assert [r["record_id"] for r in j.load_rejected()] == ["r9"]
    stop(fs, j)

    fs, j = start(tmp_path, [rec("r9", "e4.md", "")])  # the control plane holds the empty version
    n = fs.stores["default"].root.children["e4.md"]
    assert (tree(fs), n.state, n.record_id) == ({"e4.md": BAD}, REJECTED, "r9")
    assert not any("dropped" in e["reason"] for e in fs.errors)
    stop(fs, j)


def test_a_write_refused_while_an_earlier_put_is_in_flight_stays_rejected(tmp_path):
    """A file committed once (a reader's release commits a writer's dirty content), written
    on, then a write refused (held back): when the earlier put lands it must not mark the
    file clean, and the held content is kept across a restart."""
    token = "gh" + "p_" + "aB3dE5fG7hJ9kL1mN3pQ5rS7tU9vW1xY3zA5"
    fs, j = start(tmp_path, [])
    sm = fs.stores["default"]
    h = fs.create(sm.root.ino, b"c.md", 0o644, os.O_WRONLY | os.O_CREAT, 0, 0)
    fs.write(h, 0, b"one\n")
    first = fs.commit(h.node)  # in flight
    fs.write(h, 4, ("token " + token[:20]).encode())
    with pytest.raises(FsError) as ei:
        fs.write(h, 4 + 6 + 20, token[20:].encode())
    assert ei.value.errno == errno.EPERM
    with pytest.raises(FsError):
        fs.commit(h.node)  # the close reports the held session
    first.record = rec("r1", "c.md", "one\n")
    fs._on_commit(first)  # the earlier put lands now
    n = h.node
    assert (n.state, n.record_id) == (REJECTED, "r1")
    fs.release(h.fh)
    trio.run(j.flush_pending)
    stop(fs, j)
    fs, j = start(tmp_path, [rec("r1", "c.md", "one\n")])
    n = fs.stores["default"].root.children["c.md"]
    assert (tree(fs), n.state) == ({"c.md": ("one\ntoken " + token[:20]).encode()}, REJECTED)
    stop(fs, j)


def test_a_snapshot_after_a_reconnect_keeps_rejected_files_and_says_so_once(tmp_path):
    """A full snapshot (after ``410``) that changed, deleted, or moved another record onto
    the path of rejected files keeps them, each change one ``errors.log`` line (``kept``),
    not repeated by the next snapshot (docs/SEMANTICS.md, "Remote changes and rejected
    files"). Through a real mount and the feed: test_rejected_mount."""
    fs, j = start(tmp_path, [rec("r1", "a.md", "one\n"), rec("r2", "b.md", "two\n"),
                             rec("r3", "c.md", "three\n")])
    sm = fs.stores["default"]
    for name in ("a.md", "b.md"):
        with pytest.raises(FsError):
            write(fs, name, BAD, create=False)
    before = len(fs.errors)
    # r1 changed, r2 deleted, r3 moved onto b.md
    snapshot = [rec("r1", "a.md", "remote\n", version=2), rec("r3", "b.md", "three\n", version=2)]
    fs.reconcile_store(sm, snapshot)
    assert tree(fs) == {"a.md": BAD, "b.md": BAD, "c.md": b"three\n"}
    assert {n: sm.root.children[n].state for n in ("a.md", "b.md")} == {
        "a.md": REJECTED, "b.md": REJECTED}
    kept = [(e["path"], e["errno"], e["reason"].split(":")[0]) for e in list(fs.errors)[before:]]
    assert all(e.get("kept") for e in list(fs.errors)[before:])
    assert sorted(kept) == [
        ("a.md", "EILSEQ", "the record was changed elsewhere (version 2)"),
        ("b.md", "EILSEQ", "record r3 was moved onto this path elsewhere; it stays shown at c.md "
                           "while this file is kept"),
        ("b.md", "EILSEQ", "the record was deleted elsewhere")], kept
    fs.reconcile_store(sm, snapshot)  # the same snapshot again: nothing new to say
    assert len(fs.errors) == before + 3
    # across a restart a.md is kept; b.md, whose path the next process finds taken by
    # r3, is kept beside it (the rule of a restart, test_path_taken_meanwhile...)
    trio.run(j.flush_pending)
    stop(fs, j)
    fs, j = start(tmp_path, snapshot)
    assert tree(fs) == {"a.md": BAD, "b.md": b"three\n", "b.rejected.md": BAD}
    (line,) = [e for e in fs.errors if e["path"] == "b.rejected.md"]
    assert "b.md" in line["reason"] and "another record's path" in line["reason"]
    stop(fs, j)
