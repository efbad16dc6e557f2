"""Identical appends from two writers (attack finding 3): a put refused 412 whose record
already holds the put's content is "already applied" only when its own idempotency keys say
so (``ConflictResolver.applied_before``); an identical append by another writer on the same
base is rebased, so both lines are kept. Real mount, real control plane; deterministic: the
control plane is frozen while ``echo >>`` is accepted into the outbox, the sidecar and the
frozen request killed, and the rival write made before the sidecar replays its append."""
from __future__ import annotations

import json
import os
import signal
import sqlite3

import pytest

from mountutil import drained, sidecar_status, ControlPlane, Sidecar, read, sh, wait_until

pytestmark = pytest.mark.mount

BASE = "# heartbeats\n" + "h" * 1100 + "\n"




@pytest.mark.parametrize("earlier", ["rival", "own_whole_put"])
def test_an_append_meeting_the_same_content_is_kept_unless_it_was_its_own(tmp_path, earlier):
    """``rival``: another writer appended the same line on the same base (as a second mount
    would, with its own keys): the replayed append is rebased, the record ends with two
    ``heartbeat`` lines (it kept one before: the 412 was taken as "already applied").
    ``own_whole_put``: this append was applied before as a whole put under its own key (its
    answer lost): the replay, sent as a suffix, meets it and adds nothing."""
    cp = ControlPlane(tmp_path).start()
    mnt, cache = tmp_path / "mnt", tmp_path / "cache"
    sc = None
    frozen = False
    try:
        tok = cp.setup_workspace("ws")
        ws_token = tok.read_text().strip()
        sc = Sidecar(cp, "ws", tok, mnt, cache, "--commit-wait", "0.5").start()
        f = mnt / "default" / "beats.log"
        f.write_text(BASE)
        drained(sc)
        rec = cp.call("find_record", "default", "beats.log")
        os.kill(cp.proc.pid, signal.SIGSTOP)
        frozen = True
        sh(f"echo heartbeat >> {f}", f.parent, timeout=60)  # accepted: its journal row is written
        sc.kill9()
        cp.proc.kill()  # the frozen request dies with it, never applied
        cp.proc.wait(30)
        frozen = False
        cp.start()
        db = sqlite3.connect(f"file:{cache / 'outbox.db'}?mode=ro", uri=True, timeout=30)
        try:
            rows = db.execute("SELECT key, args FROM entries ORDER BY id").fetchall()
        finally:
            db.close()
        assert len(rows) == 1, rows
        key, args = rows[0][0], json.loads(rows[0][1])
        kw = {"type": args.get("type"), "mode": args.get("mode"), "mtime_ns": args.get("mtime_ns")}
        if earlier == "rival":  # another mount's identical append: its own key
            cp.call("append_record", "default", rec.id, "heartbeat\n", if_match=rec.sha256,
                    idempotency_key="rival-" + key, **kw)
            want = BASE + "heartbeat\nheartbeat\n"
        else:  # this very write, sent whole under its key, its answer lost
            cp.call("update_record", "default", rec.id, BASE + "heartbeat\n", if_match=rec.sha256,
                    idempotency_key=key, token=ws_token, **kw)
            want = BASE + "heartbeat\n"
        sc = Sidecar(cp, "ws", tok, mnt, cache, "--commit-wait", "0.5").start()
        drained(sc)
        assert cp.call("get_record", "default", rec.id).content == want
        wait_until(lambda: read(f) == want, timeout=30, what="the mount shows the record")
        sh(f"echo heartbeat >> {f}", f.parent, timeout=60)  # the next append lands once, on it
        drained(sc)
        want += "heartbeat\n"
        assert cp.call("get_record", "default", rec.id).content == want
        assert read(f) == want
    finally:
        try:
            if frozen:
                os.kill(cp.proc.pid, signal.SIGCONT)
            if sc is not None:
                sc.stop()
        finally:
            cp.stop()
