"""Local-only files and truncate refusals through a real mount and real restarts of
``memfuse mount`` on the same cache directory (docs/SEMANTICS.md, "Local-only files" and
"Writes and close"):

- a file with a local-only name (``draft.md.bak~``, ``tickets/4913``, a vim swap file) is
  still there after a restart (a clean stop, and a ``kill -9`` right after its ``close``
  returned 0) with its content and mode, ``user.memfuse.state`` ``local``, and never reaches
  the control plane; renamed onto a normal name it commits as a record and is no longer kept
  as a local file; unlinked it is gone for good; local-only files share the store's byte
  quota (``ENOSPC``);
- a file refused at close right after its create (``: > f; truncate -s 10 f``: the refused
  content arrives before the create's commit) is still rejected after a restart;
- ``truncate(2)`` by path into refused content (NUL bytes) fails with ``EILSEQ`` and leaves the
  file as it was.
"""
from __future__ import annotations

import errno
import os
import shutil
import stat

import pytest

from mountcheck import errors_log, outcome, status, wait_drained, write_file, xattr
from mountutil import ControlPlane, Sidecar, live_records, sh

pytestmark = pytest.mark.mount

OK = {"open": None, "write": None, "close": None}


def test_local_only_files_survive_restarts_and_never_leave(tmp_path):
    cp = ControlPlane(tmp_path).start()
    sc = None
    try:
        tok = cp.setup_workspace("ws", ("default", "small", "full"))
        cp.call("update_store", "small", max_store_bytes=100, max_records=1)
        cp.call("update_store", "full", max_records=1)
        cache, mnt = tmp_path / "cache", tmp_path / "mnt"
        sc = Sidecar(cp, "ws", tok, mnt, cache).start()
        d = mnt / "default"
        # the commands, through a shell
        sh("echo backup > mnt/default/draft.md.bak~ && mkdir -p mnt/default/tickets && "
           "echo body > mnt/default/tickets/4913", tmp_path, timeout=30)
        assert xattr(d / "tickets" / "4913", "state") == "local"
        assert xattr(d / "draft.md.bak~", "state") == "local"
        os.chmod(d / "draft.md.bak~", 0o600)
        swap = b"b0VIM 9.0\0" + b"\0" * 20 + b"swap content"  # binary: never judged as a record
        assert write_file(d / ".notes.md.swp", swap) == OK
        assert write_file(d / "notes.md", b"the record\n") == OK
        assert write_file(d / "empty~", b"") == OK
        wait_drained(mnt)
        assert set(live_records(cp)) == {"notes.md"}

        # a clean stop and start on the same cache
        assert sc.stop() == 0
        sc = Sidecar(cp, "ws", tok, mnt, cache).start()
        kept = {"draft.md.bak~": b"backup\n", "tickets/4913": b"body\n", ".notes.md.swp": swap,
                "empty~": b""}
        assert {p: (d / p).read_bytes() for p in kept} == kept
        assert {p: xattr(d / p, "state") for p in kept} == dict.fromkeys(kept, "local")
        assert stat.S_IMODE(os.stat(d / "draft.md.bak~").st_mode) == 0o600
        assert sorted(os.listdir(d)) == [".notes.md.swp", "draft.md.bak~", "empty~", "notes.md",
                                         "tickets"]

        # kill -9 right after close returned 0: the file is on disk already, and so is what
        # happened before it (the journal writes in order)
        os.rename(d / "draft.md.bak~", d / "draft.md.bak2~")  # renamed, still local
        os.unlink(d / "empty~")
        assert write_file(d / "tickets" / "#autosave#", b"emacs autosave\n") == OK
        sc.kill9()
        sc = Sidecar(cp, "ws", tok, mnt, cache).start()
        assert (d / "tickets" / "#autosave#").read_bytes() == b"emacs autosave\n"
        assert (d / "draft.md.bak2~").read_bytes() == b"backup\n"
        assert not (d / "draft.md.bak~").exists() and not (d / "empty~").exists()
        wait_drained(mnt)
        assert set(live_records(cp)) == {"notes.md"}  # nothing local ever reached it

        # renamed onto a normal name: a record (committed as today), no longer a local file
        os.rename(d / "draft.md.bak2~", d / "draft.md")
        wait_drained(mnt)
        assert xattr(d / "draft.md", "state") == "clean"
        assert live_records(cp)["draft.md"].content == "backup\n"
        # a record renamed onto a local-only name: its record is deleted, the file kept here
        os.rename(d / "notes.md", d / "notes.md~")
        wait_drained(mnt)
        assert set(live_records(cp)) == {"draft.md"}
        assert sc.stop() == 0
        sc = Sidecar(cp, "ws", tok, mnt, cache).start()
        assert sorted(os.listdir(d)) == [".notes.md.swp", "draft.md", "notes.md~", "tickets"]
        assert (d / "notes.md~").read_bytes() == b"the record\n"
        assert xattr(d / "notes.md~", "state") == "local"
        assert sorted(os.listdir(d / "tickets")) == ["#autosave#", "4913"]

        # local-only files share the store's byte quota here (100 bytes in "small"), and
        # have a count of their own (a store at its record limit, 1, still takes them)
        s = mnt / "small"
        assert write_file(s / "a.md", b"x" * 60) == OK
        got = write_file(s / "a.md~", b"y" * 60)
        assert got["write"] == "ENOSPC", got
        os.unlink(s / "a.md~")  # made, but empty
        assert write_file(s / "b.md~", b"y" * 30) == OK  # the store is at max_records
        assert write_file(s / "c.md", b"z")["open"] == "ENOSPC"  # a record: no
        assert write_file(s / "a.md", b"x" * 80)["write"] == "ENOSPC"  # 80 + 30 > 100
        why = [e["reason"] for e in errors_log(mnt) if e["errno"] == "ENOSPC"]
        assert "local-only" not in why[0] and "(30 of them in local-only files)" in why[-1], why
        (st,) = [x for x in status(mnt)["stores"] if x["slug"] == "small"]
        assert (st["local"], st["local_bytes"]) == (1, 30)
        assert write_file(s / "d.md~", b"") == {"open": "ENOSPC", "write": "skipped",
                                                 "close": "skipped"}  # a second local file

        # a store at its record limit: vim's swap file is not a record, so vim still edits
        f = mnt / "full"
        assert write_file(f / "a.md", b"blue\n") == OK
        if shutil.which("vim"):
            r = sh("vim -N -es -u NONE -c '%s/blue/green/' -c wq a.md", f, timeout=30, check=False)
            assert r.returncode == 0, (r.stdout, r.stderr)
            assert (f / "a.md").read_bytes() == b"green\n" and os.listdir(f) == ["a.md"]

        # unlinked: gone for good, also after a restart
        os.unlink(d / "tickets" / "4913")
        os.unlink(d / ".notes.md.swp")
        assert sc.stop() == 0
        sc = Sidecar(cp, "ws", tok, mnt, cache).start()
        assert sorted(os.listdir(d / "tickets")) == ["#autosave#"]
        assert not (d / ".notes.md.swp").exists()
        assert set(live_records(cp)) == {"draft.md"}
        assert {p: r.content for p, r in live_records(cp, "small").items()} == {"a.md": "x" * 60}
    finally:
        try:
            if sc is not None:
                sc.stop()
        finally:
            cp.stop()


def test_refused_truncates_keep_their_verdict_across_a_restart(tmp_path):
    cp = ControlPlane(tmp_path).start()
    sc = None
    try:
        tok = cp.setup_workspace("ws", ("default",))
        cache, mnt = tmp_path / "cache", tmp_path / "mnt"
        sc = Sidecar(cp, "ws", tok, mnt, cache).start()
        d = mnt / "default"
        # ftruncate(2) on a descriptor (coreutils truncate opens the file) that would fill the
        # file with NULs is refused at the syscall (a refusal at write(2)), not applied
        r = sh(": > mnt/default/e4.md; truncate -s 10 mnt/default/e4.md", tmp_path, timeout=30,
               check=False)
        assert "failed to truncate" in r.stderr and os.strerror(errno.EILSEQ) in r.stderr, r.stderr
        assert (d / "e4.md").read_bytes() == b""
        assert xattr(d / "e4.md", "state") in ("pending", "clean")
        # truncate(2) by path: no close follows, so truncate itself answers; nothing changes
        assert write_file(d / "e6.md", b"hello\n") == OK
        assert outcome(lambda: os.truncate(d / "e6.md", 10)) == "EILSEQ"
        assert (d / "e6.md").read_bytes() == b"hello\n"
        assert os.stat(d / "e6.md").st_size == 6
        assert xattr(d / "e6.md", "state") == "clean"
        # a truncate by path that leaves valid text commits at once
        assert outcome(lambda: os.truncate(d / "e6.md", 3)) is None
        wait_drained(mnt)
        lines = [(e["path"], e["errno"]) for e in errors_log(mnt)]
        assert lines == [("e4.md", "EILSEQ"), ("e6.md", "EILSEQ")], lines
        assert "truncate was not applied" in errors_log(mnt)[-1]["reason"]
        assert {p: r.content for p, r in live_records(cp).items()} == {"e4.md": "", "e6.md": "hel"}

        assert sc.stop() == 0
        sc = Sidecar(cp, "ws", tok, mnt, cache).start()
        assert (d / "e4.md").read_bytes() == b""
        assert xattr(d / "e4.md", "state") == "clean"
        assert (d / "e6.md").read_bytes() == b"hel"
        # fixed in place: commits over the record the create made
        assert write_file(d / "e4.md", b"fixed\n") == OK
        wait_drained(mnt)
        assert {p: r.content for p, r in live_records(cp).items()} == {"e4.md": "fixed\n",
                                                                     "e6.md": "hel"}
    finally:
        try:
            if sc is not None:
                sc.stop()
        finally:
            cp.stop()
