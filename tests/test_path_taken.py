"""A queued or rejected write whose path became a directory elsewhere is never dropped
(docs/SEMANTICS.md, "A queued write whose path became a directory elsewhere"; attack 13).

A real ``memfuse serve`` on SQLite and a real ``memfuse mount``: mount A writes ``notes/x``
while the control plane is down (queued), and holds ``notes/z`` rejected (a UTF-8 sequence
cut at its end, refused at close); the sidecar stops; another writer creates ``notes/x/y``
and ``notes/z/y`` through the API, so both paths are directories. At the next start the
queued write meets a refusal (``EISDIR``, ``path_is_directory``) and the rejected file
cannot be put back at its path: each is kept beside it as ``notes/x.rejected`` /
``notes/z.rejected``, ``state=rejected`` with its content, an ``errors.log`` line naming it,
kept across a further restart; copying it to a free path commits it. Every process is
stopped and every mount unmounted in a ``finally`` (``Rig``); every shell command has a
timeout.
"""
from __future__ import annotations

import json
import os

import pytest

from mountutil import Rig, Sidecar, live_records, read, sh, wait_until

pytestmark = pytest.mark.mount

STATE = "user.memfuse.state"


def _status(sc: Sidecar) -> dict:
    return json.loads((sc.mountpoint / ".memfuse" / "status.json").read_text())


def _errors(sc: Sidecar) -> list[dict]:
    text = (sc.mountpoint / ".memfuse" / "errors.log").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_a_write_whose_path_became_a_directory_elsewhere_is_kept_beside_it(tmp_path):
    with Rig(tmp_path) as rig:
        cp = rig.cp
        rig.workspace("ws", ("s",))
        sc = rig.sidecar("ws", "--drain-timeout", "1", "--offline-after", "2", "--commit-wait", "2")
        m = sc.mountpoint / "s"
        sh("mkdir notes && echo a > a.md", m)
        # a file refused at close (a UTF-8 sequence cut at its very end): kept, rejected
        fd = os.open(m / "notes" / "z", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, b"ok \xc3")
        finally:
            with pytest.raises(OSError):
                os.close(fd)
        assert os.getxattr(m / "notes" / "z", STATE) == b"rejected"
        wait_until(lambda: _status(sc)["outbox"]["depth"] == 0, timeout=30, what="idle")

        cp.stop()  # an outage: the write below is accepted, queued
        sh("echo mine > notes/x", m, timeout=30)
        assert os.getxattr(m / "notes" / "x", STATE) == b"pending"
        sc.stop()  # its drain times out: the write stays in the journal
        cp.start()
        cp.call("create_record", "s", "notes/x/y", "theirs x\n")
        cp.call("create_record", "s", "notes/z/y", "theirs z\n")

        sc.start(expect="s")
        wait_until(lambda: _status(sc)["outbox"]["depth"] == 0, timeout=60, what="backlog drained")
        wait_until(lambda: read(m / "notes" / "x.rejected") is not None, timeout=30,
                   what="the refused write kept beside its path")
        assert read(m / "notes" / "x.rejected") == "mine\n"
        assert (m / "notes" / "z.rejected").read_bytes() == b"ok \xc3"
        for name in ("x.rejected", "z.rejected"):
            assert os.getxattr(m / "notes" / name, STATE) == b"rejected"
        assert read(m / "notes" / "x" / "y") == "theirs x\n"
        assert read(m / "notes" / "z" / "y") == "theirs z\n"
        lines = {e["path"]: e for e in _errors(sc)}
        x = lines["notes/x.rejected"]
        assert x["errno"] == "EISDIR" and x["code"] == "path_is_directory"
        assert "notes/x" in x["reason"] and "kept in this file" in x["reason"]
        z = lines["notes/z.rejected"]
        assert z["errno"] == "EILSEQ" and "notes/z" in z["reason"]
        assert "not sent" in os.getxattr(m / "notes" / "x.rejected", "user.memfuse.error").decode()
        assert set(live_records(cp, "s")) == {"a.md", "notes/x/y", "notes/z/y"}  # nothing sent

        # kept across a restart, like any rejected file
        sc.stop()
        sc.start(expect="s")
        assert read(m / "notes" / "x.rejected") == "mine\n"
        assert (m / "notes" / "z.rejected").read_bytes() == b"ok \xc3"
        assert os.getxattr(m / "notes" / "x.rejected", STATE) == b"rejected"
        # fixed by the agent: copied to a free path it commits; the kept file deleted
        sh("cp notes/x.rejected notes/x2 && rm notes/x.rejected", m, timeout=30)
        wait_until(lambda: "notes/x2" in live_records(cp, "s"), timeout=30, what="x2 committed")
        assert live_records(cp, "s")["notes/x2"].content == "mine\n"
        assert not (m / "notes" / "x.rejected").exists()


def test_local_only_files_and_queued_writes_whose_path_was_taken_are_kept_beside_it(tmp_path):
    """Local-only files (never sent: ``f.md~``, ``q~``, ``.g.swp``) whose path another
    workspace took while the sidecar was stopped (a record at the path, a directory at it, a
    record at a directory of it) and a queued write of ``p/y`` whose directory became a
    record (``parent_is_file``) are each kept beside their path at the next start, never
    dropped: ``<stem>.rejected<ext>``, the local-only ones still local (never sent), the
    refused write rejected; each named in ``errors.log``; kept across a further restart."""
    with Rig(tmp_path) as rig:
        cp = rig.cp
        rig.workspace("ws", ("s",))
        sc = rig.sidecar("ws", "--drain-timeout", "1", "--offline-after", "2", "--commit-wait", "2")
        m = sc.mountpoint / "s"
        sh("mkdir notes w && echo a > a.md && echo backup > notes/f.md~ && echo swap q > notes/q~"
           " && echo swap g > w/.g.swp", m, timeout=30)
        wait_until(lambda: _status(sc)["outbox"]["depth"] == 0, timeout=30, what="idle")
        cp.stop()  # an outage: the write below is accepted, queued
        sh("mkdir p && echo mine > p/y", m, timeout=30)
        sc.stop()  # its drain times out: the write stays in the journal
        cp.start()
        cp.call("create_record", "s", "notes/f.md~", "theirs f\n")
        cp.call("create_record", "s", "notes/q~/y", "theirs q\n")
        cp.call("create_record", "s", "w", "theirs w\n")
        cp.call("create_record", "s", "p", "theirs p\n")

        sc.start(expect="s")
        wait_until(lambda: _status(sc)["outbox"]["depth"] == 0, timeout=60, what="backlog drained")
        wait_until(lambda: read(m / "y.rejected") is not None, timeout=30,
                   what="the refused write kept beside its path")
        kept = {"notes/f.rejected.md~": "backup\n", "notes/q~.rejected": "swap q\n",
                ".g.rejected.swp": "swap g\n"}

        def check() -> None:
            for path, text in kept.items():
                assert read(m / path) == text, path
                assert os.getxattr(m / path, STATE) == b"local", path
            assert read(m / "y.rejected") == "mine\n"
            assert os.getxattr(m / "y.rejected", STATE) == b"rejected"
            assert read(m / "notes" / "f.md~") == "theirs f\n"
            assert read(m / "notes" / "q~" / "y") == "theirs q\n"
            assert read(m / "w") == "theirs w\n" and read(m / "p") == "theirs p\n"
            assert set(live_records(cp, "s")) == {"a.md", "notes/f.md~", "notes/q~/y", "w", "p"}

        check()
        lines = {e["path"]: e for e in _errors(sc)}
        for path, was in (("notes/f.rejected.md~", "notes/f.md~"), ("notes/q~.rejected", "notes/q~"),
                          (".g.rejected.swp", "w/.g.swp")):
            line = lines[path]
            assert line["errno"] == "EEXIST" and line["code"] == "local_file_kept_aside", line
            assert was in line["reason"] and "kept in this file" in line["reason"], line
        y = lines["y.rejected"]
        assert y["errno"] == "ENOTDIR" and y["code"] == "parent_is_file" and "p/y" in y["reason"]
        assert [s["local"] for s in _status(sc)["stores"] if s["slug"] == "s"] == [3]

        sc.stop()  # kept across a restart, each at its new path
        sc.start(expect="s")
        check()
        # renamed onto a free normal name, a kept local-only file becomes a record
        sh("mv notes/q~.rejected notes/q.md", m, timeout=30)
        wait_until(lambda: "notes/q.md" in live_records(cp, "s"), timeout=30, what="q.md committed")
        assert live_records(cp, "s")["notes/q.md"].content == "swap q\n"


def test_a_rejected_file_where_a_queued_change_passed_is_kept_at_the_next_start(tmp_path):
    """While the control plane is down: ``notes/p`` written (queued), moved to ``notes/q``
    (queued), then a refused write at ``notes/p`` (a UTF-8 sequence cut at its end: rejected
    here, at close). At the next start the queued changes are shown on the tree as they were
    made, passing through ``notes/p``: the rejected file made there later is never dropped by
    them (on main the queued write's file replaced it, then moved away with it)."""
    with Rig(tmp_path) as rig:
        cp = rig.cp
        rig.workspace("ws", ("s",))
        sc = rig.sidecar("ws", "--drain-timeout", "1", "--offline-after", "2", "--commit-wait", "2")
        m = sc.mountpoint / "s"
        sh("mkdir notes", m, timeout=30)
        wait_until(lambda: _status(sc)["outbox"]["depth"] == 0, timeout=30, what="idle")
        cp.stop()
        sh("echo mine > notes/p && mv notes/p notes/q", m, timeout=30)
        fd = os.open(m / "notes" / "p", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, b"ok \xc3")
        finally:
            with pytest.raises(OSError):
                os.close(fd)
        assert os.getxattr(m / "notes" / "p", STATE) == b"rejected"
        sc.stop()  # its drain times out: the writes stay in the journal
        cp.start()
        sc.start(expect="s")
        wait_until(lambda: _status(sc)["outbox"]["depth"] == 0, timeout=60, what="backlog drained")
        assert read(m / "notes" / "q") == "mine\n"
        kept = [p for p in ("p", "p.rejected") if (m / "notes" / p).exists()]
        assert len(kept) == 1, os.listdir(m / "notes")
        assert (m / "notes" / kept[0]).read_bytes() == b"ok \xc3"
        assert os.getxattr(m / "notes" / kept[0], STATE) == b"rejected"
        assert set(live_records(cp, "s")) == {"notes/q"}
        sc.stop()
        sc.start(expect="s")
        assert (m / "notes" / kept[0]).read_bytes() == b"ok \xc3"
